"""torch.distributed for the split layout: rank environment, process groups, the feature protocol.

One process per rank (trainer.launch starts them). Ranks 0..T-1 run the frozen target, ranks T..T+D-1 train
the drafter under DDP (trainer.layout.Layout says who is who). NCCL on GPUs, gloo on CPU: the same code runs
in the CPU tests with several processes.

The feature protocol: a target rank sends each batch as three point-to-point messages whose shapes every
rank knows in advance (fixed shapes: packed rows x row length), so no size is ever negotiated:

    ids    [4, R, L] int64    input_ids, loss_mask, doc_ids, position_ids            tag 0
    feats  [R, L, F] dtype    target features (the target's dtype: float32 CPU, bfloat16 CUDA)   tag 1
    stats  [6] float64        STATS of the sending target rank (time, tokens, memory)     tag 2

Messages between one pair of ranks arrive in the order they were posted, and both sides walk the same
deterministic schedule (Layout.sends / Layout.source_of), so a receive never waits for a batch that will
not come.

Failure handling on the rank side: `run_rank` prints the traceback and exits non-zero; the collective
timeout turns a hung peer into an error. The launcher (trainer.launch) watches every process and stops the
rest when one dies.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from trainer.layout import Layout
from trainer.objective import PackedBatch

# What a target rank reports with every batch, in this order.
STATS = ("target_s", "tokens", "alloc_mb", "peak_mb", "rss_mb", "peak_rss_mb")


class DistributedError(RuntimeError):
    """The distributed environment is missing or inconsistent; the message says what to set."""


# -- rank environment (read in this one place) --------------------------------------------------------
@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the run: its rank, the world size, and the rendezvous address."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int


def rank_env_vars(rank: int, world_size: int, master_port: int, master_addr: str = "127.0.0.1") -> dict[str, str]:
    """The variables the launcher gives a rank's process (the inverse of `read_rank_env`)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def read_rank_env(environ: Mapping[str, str] | None = None) -> RankEnv:
    """Read RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

    Raises:
        DistributedError: one is missing or not a number (start ranks with `python -m trainer.launch`).
    """
    env = os.environ if environ is None else environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise DistributedError(
            f"{', '.join(missing)} not set: a rank process is started by `python -m trainer.launch --config FILE`"
        )
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
    except ValueError as exc:
        raise DistributedError(f"RANK / WORLD_SIZE / MASTER_PORT must be integers: {exc}") from None
    if not 0 <= rank < world:
        raise DistributedError(f"RANK {rank} outside WORLD_SIZE {world}")
    return RankEnv(rank, world, env["MASTER_ADDR"], port)


# -- process groups ------------------------------------------------------------------------------------
@dataclass
class Groups:
    """The initialised process groups of this rank.

    Attributes:
        rank: global rank.
        layout: the layout every rank shares.
        device: this rank's device (cuda:0 on GPUs: each process sees exactly one GPU).
        drafters: the drafter-only group (DDP and metric reductions); every rank holds a handle.
    """

    rank: int
    layout: Layout
    device: torch.device
    drafters: dist.ProcessGroup


def init_groups(layout: Layout, env: RankEnv, timeout_s: int) -> Groups:
    """Join the world (NCCL on GPUs, gloo on CPU) and create the drafter group.

    Every rank must call this (group creation is collective).

    Raises:
        DistributedError: the world size disagrees with the layout, or a GPU layout sees no GPU.
    """
    if env.world_size != layout.world_size:
        raise DistributedError(f"WORLD_SIZE {env.world_size} but the layout has {layout.world_size} ranks")
    timeout = timedelta(seconds=timeout_s)
    if layout.uses_gpus:
        if not torch.cuda.is_available():
            raise DistributedError(
                f"rank {env.rank}: layout lists GPUs but CUDA is not available "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); check the GPU indices"
            )
        torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES leaves one GPU: it is cuda:0 in every process
        device, backend = torch.device("cuda", 0), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    drafters = dist.new_group(layout.drafter_ranks(), timeout=timeout)
    return Groups(env.rank, layout, device, drafters)


# -- the feature protocol ------------------------------------------------------------------------------
@dataclass(frozen=True)
class FeatureSpec:
    """The fixed shapes of one batch message (known to sender and receiver without talking)."""

    rows: int
    row_len: int
    feat_dim: int
    feat_dtype: torch.dtype
    device: torch.device


def pack_batch(batch: PackedBatch, stats: torch.Tensor, spec: FeatureSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch as the three message tensors (ids [4,R,L] int64, feats [R,L,F], stats [6] float64).

    Raises:
        ValueError: the batch does not have the spec's shapes (every batch must be padded to them).
    """
    want = (spec.rows, spec.row_len)
    if tuple(batch.input_ids.shape) != want or batch.target_hidden.shape[-1] != spec.feat_dim:
        raise ValueError(
            f"batch {tuple(batch.target_hidden.shape)} does not match the fixed shape {want + (spec.feat_dim,)}; "
            "pad every batch to data.max_batch_size rows of data.max_len tokens"
        )
    ids = torch.stack([batch.input_ids, batch.loss_mask, batch.doc_ids, batch.position_ids]).to(spec.device, torch.long)
    feats = batch.target_hidden.to(spec.device, spec.feat_dtype).contiguous()
    return ids, feats, stats.to(spec.device, torch.float64)


def send_batch(batch: PackedBatch, stats: torch.Tensor, dst: int, spec: FeatureSpec) -> list:
    """Post the three messages of a batch to rank `dst` (non-blocking).

    Returns:
        [(work, tensor)] pairs: keep them (the tensors must live until `work.wait()` returns).
    """
    out = []
    for tag, t in enumerate(pack_batch(batch, stats, spec)):
        out.append((dist.isend(t, dst=dst, tag=tag), t))
    return out


class PendingBatch:
    """A batch being received; `wait()` returns it."""

    def __init__(self, src: int, spec: FeatureSpec):
        R, L = spec.rows, spec.row_len
        self._ids = torch.empty((4, R, L), dtype=torch.long, device=spec.device)
        self._feats = torch.empty((R, L, spec.feat_dim), dtype=spec.feat_dtype, device=spec.device)
        self._stats = torch.empty((len(STATS),), dtype=torch.float64, device=spec.device)
        self._works = [dist.irecv(t, src=src, tag=tag) for tag, t in enumerate((self._ids, self._feats, self._stats))]

    def wait(self) -> tuple[PackedBatch, torch.Tensor]:
        """Block until all three messages are in (raises on a peer failure or the collective timeout)."""
        for w in self._works:
            w.wait()
        ids = self._ids
        batch = PackedBatch(input_ids=ids[0], loss_mask=ids[1], doc_ids=ids[2], position_ids=ids[3], target_hidden=self._feats)
        return batch, self._stats.cpu()


# -- running one rank ----------------------------------------------------------------------------------
def run_rank(body: Callable[[], None], rank: int) -> int:
    """Run a rank's work; on any exception print its traceback (the launcher prefixes `[rank N]`).

    Returns:
        0 on success, 2 for a config/data/layout error (the message says what to fix), 1 otherwise.
        On failure the process group is NOT torn down: teardown can block on a dead peer; the caller
        exits with `os._exit` instead.
    """
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.layout import LayoutError

    try:
        body()
    except (ConfigError, DataError, LayoutError, DistributedError) as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    except BaseException:  # noqa: BLE001 - a rank must die loudly, with its traceback, whatever happened
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
