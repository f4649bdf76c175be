"""torch.distributed for the trainer: where this rank sits, its device, process groups, the feature protocol.

torch's elastic launcher (trainer.launch) starts one process per rank and gives each its RANK, LOCAL_RANK,
WORLD_SIZE, GROUP_RANK (the node) and the rendezvous address; `read_rank_env` reads them, in this one
place. Ranks 0..T-1 run the frozen target, ranks T..T+D-1 train the drafter under DDP
(trainer.layout.Layout says who is who). NCCL on GPUs, gloo on CPU: the same code runs in the CPU tests with
several processes. A world of one (the colocated layout) initialises no process group at all.

The feature protocol: a target rank sends each batch as three point-to-point messages whose shapes every
rank knows in advance (fixed shapes: packed rows x row length), so no size is ever negotiated:

    ids    [4, R, L] int64    input_ids, loss_mask, doc_ids, position_ids            tag 0
    feats  [R, L, F] dtype    target features (the target's dtype: float32 CPU, bfloat16 CUDA)   tag 1
    report [6] float64        BatchReport of the sending target rank (time, tokens, memory)     tag 2

Messages between one pair of ranks arrive in the order they were posted, and both sides walk the same
deterministic schedule (trainer.layout.Schedule), so a receive never waits for a batch that will not come.

Every call that waits on a peer runs inside `talking_to(...)`: a failure there is re-raised as
PeerLostError, which the launcher's root-cause ranking reads as "a consequence of another rank's failure".
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import astuple, dataclass
from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from trainer.layout import Layout
from trainer.objective import PackedBatch


class DistributedError(RuntimeError):
    """The distributed environment is missing or inconsistent; the message says what to set."""


class PeerLostError(RuntimeError):
    """A call that waits on other ranks failed: usually because another rank failed first."""


@contextlib.contextmanager
def talking_to(what: str) -> Iterator[None]:
    """Mark a call that waits on peers: any error inside is re-raised as PeerLostError (chained)."""
    try:
        yield
    except PeerLostError:
        raise
    except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise plain RuntimeErrors here
        raise PeerLostError(f"{what}: {type(exc).__name__}: {exc}") from exc


# -- rank environment (read in this one place) --------------------------------------------------------
@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the run (as torch's elastic agent describes it).

    Attributes:
        rank: global rank.
        world_size: processes in the run.
        local_rank: index of this process on its node.
        node: the node's rank in the rendezvous (GROUP_RANK; 0 on one host).
    """

    rank: int
    world_size: int
    local_rank: int = 0
    node: int = 0


def read_rank_env(environ: Mapping[str, str] | None = None) -> RankEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK and GROUP_RANK (the last two default to RANK and 0).

    Raises:
        DistributedError: RANK or WORLD_SIZE is missing, or a value is not a number.
    """
    env = os.environ if environ is None else environ
    missing = [k for k in ("RANK", "WORLD_SIZE") if not env.get(k)]
    if missing:
        raise DistributedError(
            f"{', '.join(missing)} not set: a rank process is started by `python -m trainer.launch --config FILE`"
        )
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local, node = int(env.get("LOCAL_RANK", rank)), int(env.get("GROUP_RANK", 0))
    except ValueError as exc:
        raise DistributedError(f"RANK / WORLD_SIZE / LOCAL_RANK / GROUP_RANK must be integers: {exc}") from None
    if not 0 <= rank < world:
        raise DistributedError(f"RANK {rank} outside WORLD_SIZE {world}")
    return RankEnv(rank, world, local, node)


def select_device(layout: Layout, rank: int, environ: dict[str, str] | None = None) -> torch.device:
    """Give this rank its device from the layout, before anything touches CUDA.

    GPU layouts: CUDA_VISIBLE_DEVICES becomes the rank's one GPU (nvidia-smi numbering, PCI bus order), so
    it is cuda:0 in every process (one compile-cache key for all), then torch.cuda.set_device(0). CPU
    layouts: no GPU visible.

    Raises:
        DistributedError: a GPU layout where this process sees no GPU.
    """
    env = os.environ if environ is None else environ
    env.update(layout.env(rank))
    if not layout.uses_gpus:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DistributedError(
            f"rank {rank}: layout gives it GPU {layout.gpu(rank)} but CUDA is not available "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}); check the GPU indices"
        )
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


# -- the world -----------------------------------------------------------------------------------------
@dataclass
class World:
    """This rank's place in the run, its device and its process groups.

    Attributes:
        env: rank, world size, local rank, node.
        layout: the layout every rank shares.
        device: this rank's device.
        drafters: the drafter-only group (DDP and metric reductions); None with a single drafter.
    """

    env: RankEnv
    layout: Layout
    device: torch.device
    drafters: object | None = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def role(self) -> str:
        return self.layout.role(self.rank)

    @property
    def is_main(self) -> bool:
        """The first drafter rank: the one that logs, saves, evaluates and exports."""
        return self.rank == self.layout.drafter_ranks()[0]

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    def agree_step(self, step: int) -> int:
        """Everyone takes the main drafter rank's step (a broadcast over the world; a no-op alone)."""
        if not self.distributed:
            return step
        t = torch.tensor([step], dtype=torch.long, device=self.device)
        with talking_to("agreeing on the resume step"):
            dist.broadcast(t, src=self.layout.drafter_ranks()[0])
        return int(t.item())


def single_world(layout: Layout, device: torch.device | None = None) -> World:
    """The world of one process (the colocated layout run in-process): no process group."""
    if layout.world_size != 1:
        raise DistributedError(f"a {layout.world_size}-rank layout needs `python -m trainer.launch`, not one process")
    dev = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    return World(RankEnv(0, 1), layout, dev)


def init_world(layout: Layout, env: RankEnv, timeout_s: int) -> World:
    """Pick this rank's device, join the world (NCCL on GPUs, gloo on CPU) and create the drafter group.

    Every rank must call this (group creation is collective). The rendezvous address comes from the
    environment the launcher set (MASTER_ADDR, MASTER_PORT).

    Raises:
        DistributedError: the world size disagrees with the layout, or a GPU layout sees no GPU.
    """
    if env.world_size != layout.world_size:
        raise DistributedError(f"WORLD_SIZE {env.world_size} but the layout has {layout.world_size} ranks")
    if env.local_rank != env.rank or env.node != 0:
        # A layout's ranks are its positions on one host; across nodes they need a node -> ranks map first.
        raise DistributedError(f"rank {env.rank} is local rank {env.local_rank} of node {env.node}: layouts across "
                               "several nodes are not supported yet; list every GPU of one host")
    device = select_device(layout, env.rank)
    if env.world_size == 1:
        return World(env, layout, device)
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size, timeout=timeout)
    group = dist.new_group(layout.drafter_ranks(), timeout=timeout)
    return World(env, layout, device, group if layout.num_drafters > 1 else None)


# -- the feature protocol ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchReport:
    """What a target rank reports with every batch it sends (MiB for memory)."""

    target_s: float
    tokens: float
    alloc_mb: float = 0.0
    peak_mb: float = 0.0
    rss_mb: float = 0.0
    peak_rss_mb: float = 0.0

    def memory(self) -> dict[str, float]:
        return {"alloc_mb": self.alloc_mb, "peak_mb": self.peak_mb, "rss_mb": self.rss_mb, "peak_rss_mb": self.peak_rss_mb}

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "BatchReport":
        return cls(*[float(x) for x in t.tolist()])


REPORT_LEN = len(astuple(BatchReport(0.0, 0.0)))


@dataclass(frozen=True)
class FeatureSpec:
    """The fixed shapes of one batch message (known to sender and receiver without talking)."""

    rows: int
    row_len: int
    feat_dim: int
    feat_dtype: torch.dtype
    device: torch.device


def pack_batch(batch: PackedBatch, report: BatchReport, spec: FeatureSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch as the three message tensors (ids [4,R,L] int64, feats [R,L,F], report [6] float64).

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
    return ids, feats, report.to_tensor().to(spec.device)


def send_batch(batch: PackedBatch, report: BatchReport, dst: int, spec: FeatureSpec) -> list:
    """Post the three messages of a batch to rank `dst` (non-blocking).

    Returns:
        [(work, tensor)] pairs: keep them (the tensors must live until `work.wait()` returns).
    """
    out = []
    for tag, t in enumerate(pack_batch(batch, report, spec)):
        out.append((dist.isend(t, dst=dst, tag=tag), t))
    return out


def wait_sent(works: list, dst: int) -> None:
    """Wait until every message of one `send_batch` went out (raises PeerLostError if `dst` is gone)."""
    with talking_to(f"sending features to rank {dst}"):
        for work, _ in works:
            work.wait()


class PendingBatch:
    """A batch being received; `wait()` returns it."""

    def __init__(self, src: int, spec: FeatureSpec):
        R, L = spec.rows, spec.row_len
        self.src = src
        self._ids = torch.empty((4, R, L), dtype=torch.long, device=spec.device)
        self._feats = torch.empty((R, L, spec.feat_dim), dtype=spec.feat_dtype, device=spec.device)
        self._report = torch.empty((REPORT_LEN,), dtype=torch.float64, device=spec.device)
        self._works = [dist.irecv(t, src=src, tag=tag) for tag, t in enumerate((self._ids, self._feats, self._report))]

    def wait(self) -> tuple[PackedBatch, BatchReport]:
        """Block until all three messages are in (PeerLostError on a peer failure or the collective timeout)."""
        with talking_to(f"receiving features from rank {self.src}"):
            for w in self._works:
                w.wait()
        ids = self._ids
        batch = PackedBatch(input_ids=ids[0], loss_mask=ids[1], doc_ids=ids[2], position_ids=ids[3], target_hidden=self._feats)
        return batch, BatchReport.from_tensor(self._report.cpu())
