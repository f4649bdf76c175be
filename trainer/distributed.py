"""torch.distributed for the trainer: where this rank sits, its device, process groups, the store protocol.

torch's elastic launcher (trainer.launch) starts one process per rank and gives each its RANK, LOCAL_RANK,
WORLD_SIZE and the store's address (MASTER_ADDR, MASTER_PORT); trainer.launch adds DFLASH_NODE, the node's
index in the layout; `read_rank_env` reads them, in this one place. torch numbers nodes (and so RANK) in
the order its rendezvous sorts them (by address and pid), not in the layout's order, so a rank's place in the
layout is (DFLASH_NODE, LOCAL_RANK) and `init_world` joins the process group under that layout rank; torch's
RANK 0 only decides who hosts the store at MASTER_ADDR:MASTER_PORT. Ranks 0..T-1 run the frozen target, ranks T..T+D-1 train the drafter under DDP
(trainer.layout.Layout says who is who). NCCL on GPUs, gloo on CPU: the same code runs in the CPU tests with
several processes. A world of one (the colocated layout) initialises no process group at all.

The feature protocol (how a target rank sends a batch's features to a drafter rank) is trainer.feature_wire.

The store protocol (across nodes, whose run directories and datasets roots are not one): rank 0 builds the
token store (trainer.store) and sends its files to the first rank of every other node, point-to-point, tag 8:

    size     [1] int64        bytes of the manifest's JSON                                  rank 0 -> r
    manifest [size] uint8     the manifest (every file's size and sha256)                   rank 0 -> r
    want     [1] int64        1: send the files; 0: a store of that key is already there    r -> rank 0
    blocks   [<= 16 MiB] uint8   each array file in turn, cut into blocks (sizes follow from the manifest)

The receiver writes them into a temporary directory, checks every sha256 against the manifest and renames it
into place (trainer.storebuild.receive_store), then writes its run's pointer, which the node's other ranks wait for.
Sending the files, not building on every node: the other nodes need neither the input files nor the regenerated
data nor CPU time for tokenising, and there is one store, hash-checked, whatever they have on disk. Nothing
is pickled: each rank maps the files.

Every call that waits on a peer runs inside `talking_to(...)`: a failure there is re-raised as
PeerLostError, which the launcher's root-cause ranking reads as "a consequence of another rank's failure".
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Mapping

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trainer import store as token_store
from trainer import storebuild
from trainer.layout import Layout


class DistributedError(RuntimeError):
    """The distributed environment is missing or inconsistent; the message says what to set."""


class PeerLostError(RuntimeError):
    """A call that waits on other ranks failed: usually because another rank failed first.

    Attributes:
        peer: the one rank the call waited on (point-to-point), None for a collective.
    """

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


@contextlib.contextmanager
def talking_to(what: str, peer: int | None = None) -> Iterator[None]:
    """Mark a call that waits on peers (`peer`: the one rank it waits on, if one): any error inside is
    re-raised as PeerLostError (chained)."""
    try:
        yield
    except PeerLostError:
        raise
    except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise plain RuntimeErrors here
        raise PeerLostError(f"{what}: {type(exc).__name__}: {exc}", peer) from exc


# -- rank environment (read in this one place) --------------------------------------------------------
@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the run (as torch's elastic agent describes it).

    Attributes:
        rank: global rank.
        world_size: processes in the run.
        local_rank: index of this process on its node.
        node: the node's index in the layout (DFLASH_NODE; 0 on one host).
    """

    rank: int
    world_size: int
    local_rank: int = 0
    node: int = 0


FINISH_TAG = 7
"""The point-to-point tag of World.finish (the feature frames use 0-3: trainer.feature_wire.TAGS)."""

STORE_TAG = 8
"""The point-to-point tag of the store protocol (World.share_store)."""

STORE_BLOCK = 16 << 20
"""Bytes per block of a store file on the wire (one buffer of this size on each side)."""

NODE_ENV = "DFLASH_NODE"
"""The node's index in the layout, set by trainer.launch for its ranks."""


def read_rank_env(environ: Mapping[str, str] | None = None) -> RankEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK and DFLASH_NODE (the last two default to RANK and 0).

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
        local, node = int(env.get("LOCAL_RANK", rank)), int(env.get(NODE_ENV, 0))
    except ValueError as exc:
        raise DistributedError(f"RANK / WORLD_SIZE / LOCAL_RANK / {NODE_ENV} must be integers: {exc}") from None
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


    def finish(self) -> None:
        """Across nodes, no rank ends before every rank is done: rank 0 hears from every other rank, then
        answers each (point-to-point, so a rank that is gone is named as the peer). Without it a node whose
        ranks finished early (a target rank that sent every batch) would wait in torch's exit barrier and
        then report success while another node had died. One node: nothing (its agent sees every rank)."""
        if self.layout.num_nodes == 1:
            return
        token = torch.zeros(1, device=self.device)
        others = range(1, self.layout.world_size)
        if self.rank == 0:
            for r in others:
                with talking_to(f"waiting for rank {r} to finish", r):
                    dist.recv(token, src=r, tag=FINISH_TAG)
            for r in others:
                with talking_to(f"telling rank {r} that every rank finished", r):
                    dist.send(token, dst=r, tag=FINISH_TAG)
            return
        with talking_to("telling rank 0 that this rank finished", 0):
            dist.send(token, dst=0, tag=FINISH_TAG)
        with talking_to("waiting for rank 0 to end the run", 0):
            dist.recv(token, src=0, tag=FINISH_TAG)

    def store_share(self):
        """What load_assets shares the token store with (None: one node, whose ranks share the run directory)."""
        return self.share_store if self.layout.num_nodes > 1 else None

    def share_store(self, store: "token_store.TokenStore | None", run_dir: Path) -> "token_store.TokenStore":
        """Every rank calls this; rank 0 (the data builder) with its store, the others with None; each gets
        the store it trains on. Rank 0 sends the store to the first rank of every other node (the store
        protocol above), which writes it under its datasets root and points its run at it; every other rank
        waits for its run's pointer, as on one node. Waits up to layout.timeout_s on rank 0's build."""
        builder_node = self.layout.place(0).node
        if self.rank == 0:
            if store is None:
                raise DistributedError("rank 0 builds the token store: it must pass it to share_store")
            for node in range(self.layout.num_nodes):
                if node != builder_node:
                    send_store(store, self.layout.rank_of(node, 0))
            return store
        if self.env.node != builder_node and self.rank == self.layout.rank_of(self.env.node, 0):
            got = receive_store(token_store.datasets_root(run_dir), 0)
            token_store.write_pointer(run_dir, got)
            return got
        return token_store.wait_for_store(run_dir)


def send_store(store: "token_store.TokenStore", dst: int) -> None:
    """Rank 0's side of the store protocol: the manifest, then (if `dst` asks) every array file in blocks."""
    raw = np.frombuffer(json.dumps(store.manifest).encode(), dtype=np.uint8).copy()
    what = f"sending the token store to rank {dst}"
    with talking_to(what, dst):
        dist.send(torch.tensor([raw.size], dtype=torch.long), dst=dst, tag=STORE_TAG)
        dist.send(torch.from_numpy(raw), dst=dst, tag=STORE_TAG)
        want = torch.zeros(1, dtype=torch.long)
        dist.recv(want, src=dst, tag=STORE_TAG)
    if not int(want.item()):
        return
    buf = np.empty(STORE_BLOCK, dtype=np.uint8)
    wire = torch.from_numpy(buf)
    for name in token_store.ARRAYS:
        size = store.manifest["files"][name]["bytes"]
        for block in storebuild.read_file_blocks(store.path / name, size, STORE_BLOCK):  # a short file: StoreError
            buf[: len(block)] = np.frombuffer(block, dtype=np.uint8)
            with talking_to(what, dst):
                dist.send(wire[: len(block)], dst=dst, tag=STORE_TAG)


def receive_store(root: Path, src: int) -> "token_store.TokenStore":
    """The receiving side: the manifest; the store of its key if this node has it (sizes checked), else
    every file, sha256-checked, written under `root`."""
    what = f"receiving the token store from rank {src}"
    with talking_to(what, src):
        size = torch.zeros(1, dtype=torch.long)
        dist.recv(size, src=src, tag=STORE_TAG)
        raw = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(raw, src=src, tag=STORE_TAG)
    manifest = json.loads(raw.numpy().tobytes())
    try:
        have = token_store.open_store(token_store.store_dir(root, manifest["key"]), manifest["key"])
    except token_store.StoreError:
        have = None  # absent, or broken: replaced by the sender's copy
    with talking_to(what, src):
        dist.send(torch.tensor([0 if have else 1], dtype=torch.long), dst=src, tag=STORE_TAG)
    if have is not None:
        return have
    buf = np.empty(STORE_BLOCK, dtype=np.uint8)
    wire = torch.from_numpy(buf)

    def read(name: str, nbytes: int):
        left = nbytes
        while left > 0:
            n = min(STORE_BLOCK, left)
            with talking_to(what, src):
                dist.recv(wire[:n], src=src, tag=STORE_TAG)
            yield memoryview(buf)[:n]
            left -= n

    return storebuild.receive_store(root, manifest, read)  # a wrong sha256: StoreError, nothing kept


def single_world(layout: Layout, device: torch.device | None = None) -> World:
    """The world of one process (the colocated layout run in-process): no process group."""
    if layout.world_size != 1:
        raise DistributedError(f"a {layout.world_size}-rank layout needs `python -m trainer.launch`, not one process")
    dev = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    return World(RankEnv(0, 1), layout, dev)


def init_world(layout: Layout, env: RankEnv, timeout_s: int, environ: Mapping[str, str] | None = None) -> World:
    """Pick this rank's device, join the world (NCCL on GPUs, gloo on CPU) and create the drafter group.

    Every rank must call this (group creation is collective). The process joins under its layout rank
    (`layout.rank_of(node, local_rank)`); the store is torch's: hosted by the launcher's RANK 0 at
    MASTER_ADDR:MASTER_PORT, as `init_method="env://"` would.

    Returns:
        The World, whose env.rank is the layout rank.
    Raises:
        DistributedError: the world size or this node's rank count disagrees with the layout, or a GPU layout
            sees no GPU.
    """
    from trainer.layout import LayoutError

    if env.world_size != layout.world_size:
        raise DistributedError(f"WORLD_SIZE {env.world_size} but the layout has {layout.world_size} ranks")
    try:
        rank = layout.rank_of(env.node, env.local_rank)
    except LayoutError as exc:
        raise DistributedError(f"{NODE_ENV}={env.node} LOCAL_RANK={env.local_rank}: {exc}") from None
    device = select_device(layout, rank)
    placed = RankEnv(rank, env.world_size, env.local_rank, env.node)
    if env.world_size == 1:
        return World(placed, layout, device)
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    src = os.environ if environ is None else environ
    store = dist.TCPStore(src["MASTER_ADDR"], int(src["MASTER_PORT"]), env.world_size, is_master=env.rank == 0,
                          timeout=timeout, multi_tenant=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=env.world_size, timeout=timeout)
    group = dist.new_group(layout.drafter_ranks(), timeout=timeout)
    return World(placed, layout, device, group if layout.num_drafters > 1 else None)
