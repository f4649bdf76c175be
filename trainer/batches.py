"""Where a drafter's batches come from, the same in every layout.

    the global plan   Plan / make_plan: the packing plan of every epoch, concatenated; optimizer step s trains
                      global batches s*G .. s*G+G-1 (G = data.batches_per_step), each padded to rows_per_step
                      rows of row_len tokens (padded_rows) and drawing its anchors from anchor_generator(seed,
                      batch index)
    LocalFeatures     the colocated layout: the local target computes a step's batches when asked
    serve_features    a target rank: step by step, compute the features of the batches Schedule.sends names and
                      send them over the feature wire (trainer.feature_wire), `layout.prefetch` steps ahead
    RemoteFeatures    a drafter rank of a split layout: the next step's receives are posted before this step
                      trains

trainer.loop trains on what a source returns (a list of Item per step) and never asks which one it is.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trainer.config import TrainConfig
from trainer.data import DataError
from trainer.packing import build_step, plan_epoch, target_features
from trainer.distributed import World
from trainer.feature_wire import BatchReport, FeatureSpec, PendingBatch, send_batch, wait_sent
from trainer.layout import Schedule
from trainer.metrics import memory_stats
from trainer.objective import PackedBatch
from trainer.setup import Assets, TrainError, load_assets

Log = Callable[[str], None]


# -- the global plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Every global batch in order (epoch, rows), G batches per step, and the number of steps."""

    batches: list[tuple[int, list[list[int]]]]
    per_step: int
    steps: int

    def epoch_of(self, step: int) -> int:
        """The epoch of the first batch of optimizer step `step` (0-based)."""
        return self.batches[step * self.per_step][0]


def make_plan(cfg: TrainConfig, lengths: list[int], per_step: int) -> Plan:
    """The global batch sequence and the step count (a pure function of the samples and the config).

    Raises:
        DataError: fewer batches than one step takes.
    """
    batches = []
    for epoch in range(cfg.epochs):
        for rows in plan_epoch(lengths, cfg.row_len, cfg.rows_per_step, cfg.data.token_budget, cfg.seed, epoch):
            batches.append((epoch, rows))
    steps = len(batches) // per_step
    if cfg.max_steps is not None:
        steps = min(steps, cfg.max_steps)
    if steps < 1:
        raise DataError(
            f"{len(batches)} packed batch(es), {per_step} per step: not one step; add data or epochs, "
            "or lower data.batches_per_step"
        )
    return Plan(batches, per_step, steps)


def padded_rows(rows: list[list[int]], rows_per_step: int) -> list[list[int]]:
    """A batch's rows padded with empty rows to the fixed row count (an empty row is all padding)."""
    return list(rows) + [[] for _ in range(rows_per_step - len(rows))]


def anchor_generator(seed: int, batch_index: int) -> torch.Generator:
    """The anchor RNG of global batch `batch_index`: the same in every layout (CPU: same draws everywhere)."""
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + batch_index + 1) % (2**63))


def rank_memory(device: torch.device) -> dict[str, float]:
    """Memory of this process in MiB (MEM_KEYS): allocated and peak on CUDA; on CPU both are the resident set."""
    m = memory_stats()
    rss = m.get("rss_mb", 0.0)
    peak_rss = max(rss, m.get("peak_rss_mb", 0.0))  # two sources (statm, getrusage) can disagree by pages
    if device.type == "cuda":
        alloc, peak = torch.cuda.memory_allocated() / 2**20, torch.cuda.max_memory_allocated() / 2**20
    else:
        alloc, peak = rss, peak_rss
    return {"alloc_mb": alloc, "peak_mb": peak, "rss_mb": rss, "peak_rss_mb": peak_rss}


def compute_batch(assets: Assets, rows: list[list[int]], cfg: TrainConfig):
    """(PackedBatch with features, target seconds) for one global batch, computed by the local target."""
    t0 = time.perf_counter()
    packed = build_step(assets.samples, padded_rows(rows, cfg.rows_per_step), cfg.row_len, assets.pad_id)
    feats = target_features(assets.target, assets.samples, packed)  # [R, L, F] in the target's dtype
    if feats.is_cuda:
        torch.cuda.synchronize()  # CPU-GPU sync point: the target time must include its kernels
    batch = PackedBatch(packed.input_ids, packed.loss_mask, packed.doc_ids, packed.position_ids, feats)
    return batch, time.perf_counter() - t0


def feature_spec(cfg: TrainConfig, assets: Assets, device: torch.device) -> FeatureSpec:
    """The fixed message shapes of this run (every rank derives the same)."""
    return FeatureSpec(cfg.rows_per_step, cfg.row_len, assets.target.feature_size, assets.target.dtype, device)


# -- feature sources: where a drafter's batches come from ----------------------------------------------
@dataclass
class Item:
    """One batch to train on: its global index, the batch, and what its target reported."""

    index: int
    batch: Any
    report: BatchReport
    source: int


class LocalFeatures:
    """Batches computed in this process by the local target (the colocated layout)."""

    def __init__(self, cfg: TrainConfig, assets: Assets, plan: Plan, schedule: Schedule):
        self.cfg, self.assets, self.plan, self.schedule = cfg, assets, plan, schedule

    def start(self, step: int) -> None:
        """Nothing to post ahead: batches are computed when asked for."""

    def __call__(self, step: int) -> list[Item]:
        items = []
        for b in self.schedule.batches(step, 0):
            batch, secs = compute_batch(self.assets, self.plan.batches[b][1], self.cfg)
            items.append(Item(b, batch, BatchReport(secs, batch.num_tokens), 0))
        return items


class RemoteFeatures:
    """Batches sent by the target ranks; the next step's receives are posted before this step trains."""

    def __init__(self, world: World, schedule: Schedule, spec: FeatureSpec, steps: int):
        self.schedule, self.spec, self.steps = schedule, spec, steps
        self.drafter = world.layout.drafter_index(world.rank)
        self.pending: tuple[int, list] | None = None

    def start(self, step: int) -> None:
        """Post the receives of `step` (none past the last step)."""
        if step >= self.steps:
            self.pending = None
            return
        posted = []
        for b in self.schedule.batches(step, self.drafter):
            posted.append((b, PendingBatch(self.schedule.source(b), self.spec, b)))
        self.pending = (step, posted)

    def __call__(self, step: int) -> list[Item]:
        if self.pending is None or self.pending[0] != step:
            raise TrainError(f"feature stream out of step: expected step {step}, posted {self.pending and self.pending[0]}")
        items = []
        for b, pending in self.pending[1]:
            batch, report = pending.wait()
            items.append(Item(b, batch, report, pending.src))
        self.start(step + 1)
        return items


# -- target ranks ----------------------------------------------------------------------------------------
def serve_features(cfg: TrainConfig, world: World, log: Log) -> None:
    """A target rank: compute and send the features of its batches, step by step, `prefetch` ahead."""
    assets = load_assets(cfg, world.device, builds_data=world.rank == 0, wants_eval=False, log=log,
                         share=world.store_share())
    schedule = Schedule(world.layout, cfg.batches_per_step)
    plan = make_plan(cfg, assets.samples.lengths, schedule.per_step)
    spec = feature_spec(cfg, assets, world.device)
    step = world.agree_step(0)
    per_step = max(1, -(-schedule.per_step // world.layout.num_targets))
    cap = cfg.layout.prefetch * per_step
    inflight: collections.deque = collections.deque()
    log(f"target rank {world.rank} (pid {os.getpid()}): steps {step}..{plan.steps}, features [{spec.rows}, {spec.row_len}, {spec.feat_dim}] {spec.feat_dtype}")
    for s in range(step, plan.steps):
        for b, dst in schedule.sends(world.rank, s):
            batch, secs = compute_batch(assets, plan.batches[b][1], cfg)
            report = BatchReport(secs, batch.num_tokens, **rank_memory(world.device))
            inflight.append((send_batch(batch, report, b, dst, spec), dst))
            while len(inflight) > cap:  # bounded: wait for the oldest batch to be received
                wait_sent(*inflight.popleft())
    while inflight:
        wait_sent(*inflight.popleft())
    log(f"target rank {world.rank}: sent every batch")
