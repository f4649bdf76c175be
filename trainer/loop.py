"""The training loop every rank runs, as plain as nanoGPT.

    python -m trainer.launch --config F     any layout: torch's elastic launcher starts one process per rank
    python -m trainer train --config F      the colocated layout in this process

A rank's role (trainer.layout.Layout) says which half it runs:

    target rank   trainer.batches.serve_features: compute the features of its batches and send them
    drafter rank  train: per step, the step's batches from a feature source (trainer.batches) -> dflash_loss
                  with each batch's anchors -> backward (DDP averages over drafters) -> clip -> AdamW at
                  get_lr(step)
    colocated     train with LocalFeatures: the same loop at world size 1, features computed in-process

Global batches: the packing plan of every epoch, concatenated. Optimizer step s trains batches s*G .. s*G+G-1
(G = data.batches_per_step, by default one per drafter rank), split over the drafters (trainer.layout.Schedule);
a drafter with several batches accumulates their gradients. Every batch is padded to rows_per_step rows of
row_len tokens (fixed shapes: the feature messages and the compiled kernels never change size), and draws its
anchors from a generator seeded by (seed, batch index). So the loss at a step depends on G, never on the
layout: any layout trains the same sequence of updates, and a checkpoint of one layout resumes under another.

Only the main drafter rank (the first) logs metrics, saves checkpoints, evaluates τ and exports.
Checkpoints (when, how many, what they hold, which one a run resumes from): trainer.checkpoint.RunCheckpoints.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.atomic import write_json
from trainer.batches import (
    LocalFeatures, Plan, RemoteFeatures, anchor_generator, feature_spec, make_plan, rank_memory, serve_features,
)
from trainer.checkpoint import RunCheckpoints
from trainer.config import OptimConfig, TrainConfig
from trainer.distributed import World, talking_to
from trainer.export_check import ExportMismatch, check_export, compare_export
from trainer.layout import Schedule
from trainer.metrics import MetricsWriter, rewind_metrics, run_facts
from trainer.objective import dflash_loss
from trainer.precision import Precision, resolve_precision
from trainer.setup import Assets, TrainError, load_assets, load_target, seed_everything
from trainer.stats import MEM_KEYS, StepStats

Log = Callable[[str], None]


def get_lr(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then cosine to min_lr.

    Warm-up lasts round(warmup_ratio * total_steps) steps (at least 1 when warmup_ratio > 0); step 0
    already gets a non-zero lr (lr / warmup) so no step is wasted.
    """
    warmup = int(round(cfg.warmup_ratio * total_steps))
    if cfg.warmup_ratio > 0:
        warmup = max(1, warmup)
    min_lr = cfg.lr * cfg.min_lr_ratio
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


@dataclass
class TrainResult:
    """What a finished run produced (τ: None where not measured, and on every rank but the main one)."""

    steps: int
    tau_before: float | None
    tau_after: float | None
    export_dir: Path
    output_dir: Path


# -- the drafter being trained ---------------------------------------------------------------------------
class _ModelView:
    """What dflash_loss needs of a drafter, with the forward going through DDP (attributes from the module)."""

    def __init__(self, wrapped, module):
        self._wrapped, self._module = wrapped, module

    def __call__(self, *args, **kwargs):
        return self._wrapped(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


@dataclass
class Drafter:
    """The drafter module, what its forward goes through (DDP or itself), its optimizer, compile state, and
    the precision it trains in (parameters and AdamW state in precision.master_dtype)."""

    module: torch.nn.Module
    view: Any
    opt: torch.optim.Optimizer
    ddp: Any
    compiled: bool
    precision: Precision

    def syncing(self, last: bool):
        """Gradient accumulation: DDP all-reduces only on the last micro-batch of a step."""
        return contextlib.nullcontext() if self.ddp is None or last else self.ddp.no_sync()


def build_drafter(cfg: TrainConfig, assets: Assets, world: World, log: Log) -> Drafter:
    """The drafter (seeded: the same initial weights on every rank), compiled if asked, DDP over drafters."""
    from trainer.model import DFlashDrafter
    from trainer.warmup import compile_drafter, configure_compile

    cache_dir = configure_compile(cfg.compile)
    precision = resolve_precision(cfg.precision, world.device)
    seed_everything(cfg.seed)  # drafter init independent of what setup consumed
    module = DFlashDrafter.from_target(cfg.model, assets.target, assets.mask_token_id, precision.master_dtype_name)
    module = module.to(world.device)
    module.train()
    compiled = compile_drafter(module, cfg.compile)
    if compiled or (module.backend == "flex" and world.device.type == "cuda"):
        torch._logging.set_logs(recompiles=True)  # torch's own "Recompiling function ..." lines name the guard
        log(f"[compile] inductor cache {cache_dir}")
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    ddp = None
    if world.drafters is not None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        with talking_to("DDP set-up (broadcast of the initial weights)"):
            ids = [0] if world.device.type == "cuda" else None
            ddp = DDP(module, device_ids=ids, process_group=world.drafters)
    return Drafter(module, _ModelView(ddp or module, module), opt, ddp, compiled, precision)


def check_servable_export(cfg: TrainConfig, assets: Assets, drafter: Drafter, world: World, log: Log) -> None:
    """Before step 1: can vLLM serve this target with this drafter on this device? A refusal when the run is
    to be judged in vLLM (evaluation.engine: vllm), one log line otherwise."""
    from trainer.export import draft_config_dict
    from trainer.export_check import servability

    reasons = servability(assets.target, draft_config_dict(drafter.module, assets.target), world.device.type)
    if not reasons:
        return
    text = f"vLLM on {world.device.type} cannot serve this target: " + "; ".join(reasons)
    if cfg.evaluation.engine == "vllm":
        raise TrainError(f"{text}. evaluation.engine is vllm: train against a target vLLM serves, or set "
                         "evaluation.engine: own")
    log(f"[export-check] note: {text}")


# -- evaluation (main drafter rank) -----------------------------------------------------------------------
class Evaluation:
    """τ before, during and after training, through trainer.export_eval.periodic_eval (every mode of
    cfg.evaluation, on the weights as the export ships them)."""

    def __init__(self, cfg: TrainConfig, assets: Assets, metrics: MetricsWriter, log: Log):
        self.cfg, self.assets, self.metrics, self.log = cfg, assets, metrics, log
        self.out = Path(cfg.output_dir)
        tiny = cfg.model.target == "tiny"
        self.max_new_tokens = cfg.model.tiny_target.response_tokens if tiny else cfg.data.eval_max_new_tokens

    def run(self, module, step: int, when: str, export_dir: Path | None = None):
        """Evaluate (the written export when given), record a metrics line, and for "before"/"after" write
        eval_<when>.json. Returns the EvalReport, None without held-out prompts."""
        from trainer.export_eval import periodic_eval
        from trainer.features import TargetModel

        a = self.assets
        if not a.eval_prompts:
            return None
        # τ needs the whole target. A drafter rank holds only its head parts: it loads the whole target for
        # this evaluation and lets it go afterwards, so its memory between evaluations stays the parts'.
        target = a.target if isinstance(a.target, TargetModel) else load_target(self.cfg, a.target_dir, a.target.device)
        try:
            report = periodic_eval(module, target, a.eval_prompts, self.cfg.evaluation,
                                   max_new_tokens=self.max_new_tokens, stop_token_ids=a.stop_ids, export_dir=export_dir)
        finally:
            if target is not a.target:
                del target
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        if when != "during":
            report.save(self.out / f"eval_{when}.json")
        self.metrics.write({"kind": "eval", "step": step, "when": when, **report.to_record()})
        note = {"before": " (untrained drafter)", "after": " (the export)", "during": ""}[when]
        self.log(f"[eval] step {step} τ {report.tau:.3f}{note}")
        return report

    def tau_before(self) -> float | None:
        p = self.out / "eval_before.json"
        return json.loads(p.read_text())["tau"] if p.exists() else None


class NoMetrics:
    """The metrics of a rank that writes none (every drafter rank but the main one): writes nothing."""

    def write(self, record: dict) -> None:
        """Nothing: the main drafter rank writes the run's metrics."""

    def close(self) -> None:
        """Nothing to close."""


class NoEvaluation:
    """The evaluation of a rank that evaluates nothing (every drafter rank but the main one)."""

    def run(self, module, step: int, when: str, export_dir: Path | None = None) -> None:
        """No report: the main drafter rank measures τ."""
        return None

    def tau_before(self) -> None:
        return None


class CompileWatch:
    """Reports graphs compiled after the first step: shapes are fixed, so any is a recompile."""

    def __init__(self, log: Log):
        self.log, self.first, self.recompiles = log, None, 0

    def check(self, step: int) -> None:
        from trainer.warmup import compile_counters

        graphs = compile_counters()["unique_graphs"]
        if self.first is None:
            self.first = graphs  # the first step compiles (or loads from the cache): that is the warm-up
        elif graphs > self.first + self.recompiles:
            new = graphs - self.first - self.recompiles
            self.recompiles += new
            # A line for the log follower; torch's own "Recompiling function" line above it names the guard.
            self.log(f"[compile] recompile during training: {new} new graph(s) at step {step} (recompiles "
                     f"{self.recompiles}); shapes must stay fixed, see the guard failure above")


# -- the drafter loop ---------------------------------------------------------------------------------------
@dataclass
class _Run:
    """Everything a drafter rank's loop holds (built once by `train`); a rank other than the main one has
    metrics and an evaluation that do nothing."""

    cfg: TrainConfig
    world: World
    assets: Assets
    plan: Plan
    schedule: Schedule
    drafter: Drafter
    features: Any
    checkpoints: RunCheckpoints
    metrics: MetricsWriter | NoMetrics
    evaluation: Evaluation | NoEvaluation
    log: Log
    grad_norm: float = 0.0
    recompiles: int = 0


def train_step(run: _Run, step: int, stats: StepStats) -> float:
    """One optimizer step over this rank's batches of `step`; returns the lr used."""
    cfg, d = run.cfg, run.drafter
    t0 = time.perf_counter()
    items = run.features(step)
    t_wait = time.perf_counter() - t0
    lr = get_lr(step, run.plan.steps, cfg.optim)
    for group in d.opt.param_groups:
        group["lr"] = lr
    scale = 1.0 / len(items)  # with DDP's mean over drafters: the mean loss of the step's G batches
    for j, item in enumerate(items):
        last = j == len(items) - 1
        with d.syncing(last):
            gen = anchor_generator(cfg.seed, item.index)
            with d.precision.autocast():  # the forward and the loss; backward outside, as torch.autocast asks
                res = dflash_loss(d.view, item.batch, num_anchors=cfg.data.num_anchors, gamma=cfg.resolved_gamma, generator=gen)
            talk = talking_to("DDP gradient all-reduce") if d.ddp is not None and last else contextlib.nullcontext()
            with talk:
                (res.loss * scale).backward()
        stats.add_batch(res, item.batch.num_tokens, item.source, item.report.target_s)
        if not run.world.layout.colocated:
            stats.set_memory(item.source, item.report.memory())
    run.grad_norm = float(torch.nn.utils.clip_grad_norm_(d.module.parameters(), cfg.optim.grad_clip))
    d.opt.step()
    d.opt.zero_grad(set_to_none=True)
    stats.drafter_s += time.perf_counter() - t0 - t_wait
    stats.wait_s += t_wait
    return lr


def log_step(run: _Run, step: int, lr: float, stats: StepStats, wall_s: float, t_start: float, recompiles: int) -> None:
    """Reduce the window's statistics over the drafters; the main rank writes the record and the log line."""
    world = run.world
    stats.set_memory(world.rank, rank_memory(world.device))
    with talking_to("reducing step statistics"):
        tot = stats.reduced(world.drafters, world.device)
    if not world.is_main:
        return
    procs = world.layout.num_drafters if world.drafters is not None else 1
    layout = world.layout
    mine = rank_memory(world.device)
    rec = {"kind": "train", "step": step, "epoch": run.plan.epoch_of(step - 1), **tot.record(wall_s, procs),
           "grad_norm": run.grad_norm, "lr": lr, "recompiles": recompiles,
           "memory": [{"rank": r, "role": layout.role(r), **dict(zip(MEM_KEYS, tot.memory[r].tolist()))}
                      for r in range(layout.world_size)],
           "rss_mb": mine["rss_mb"], "peak_rss_mb": mine["peak_rss_mb"], "max_peak_mb": float(tot.memory[:, 1].max()),
           "time": time.time(), "elapsed_s": time.perf_counter() - t_start}
    run.metrics.write(rec)
    run.log(
        f"step {step}/{run.plan.steps} loss {rec['loss']:.4f} acc {rec['acc']:.3f} sim_tau {rec['sim_tau']:.2f} "
        f"{rec['tokens_per_s']:.0f} tok/s (target {rec['target_tokens_per_s']:.0f}, drafter "
        f"{rec['drafter_tokens_per_s']:.0f}) lr {lr:.2e} peak {rec['max_peak_mb']:.0f}MB recompiles {recompiles}"
    )


def train_steps(run: _Run, step: int) -> int:
    """Steps from `step` to the end: log, checkpoint and evaluate on their schedules. Returns the last step."""
    cfg, plan, world = run.cfg, run.plan, run.world
    layout = world.layout
    stats = StepStats(cfg.model.block_size, layout.num_targets, layout.world_size)
    watch = CompileWatch(run.log)
    t_start = t_mark = time.perf_counter()
    run.features.start(step)
    while step < plan.steps:
        lr = train_step(run, step, stats)
        step += 1
        watch.check(step)
        if step % cfg.log_every == 0 or step == plan.steps:
            log_step(run, step, lr, stats, time.perf_counter() - t_mark, t_start, watch.recompiles)
            stats, t_mark = stats.fresh(), time.perf_counter()
        if world.is_main and run.checkpoints.due(step, plan.steps):
            run.checkpoints.save(run.drafter, step, run.log)
            if cfg.evaluation.export_check:
                check_export(run.drafter.module, run.assets.target, cfg.output_dir, step, log=run.log)
        if cfg.eval_every and step % cfg.eval_every == 0 and step < plan.steps:
            run.evaluation.run(run.drafter.module, step, "during")
    run.recompiles = watch.recompiles
    return step


def _finish(run: _Run, step: int) -> TrainResult:
    """Main rank: the last checkpoint, the export, τ after training, the final metrics line."""
    from trainer.export import export_drafter

    out = Path(run.cfg.output_dir)
    export_dir = out / "export"
    if not run.world.is_main:
        return TrainResult(step, None, None, export_dir, out)
    run.checkpoints.save(run.drafter, step, run.log)
    export_drafter(run.drafter.module, run.assets.target, export_dir)
    run.log(f"[export] {export_dir}")
    if run.cfg.evaluation.export_check:
        problems = compare_export(run.drafter.module, run.assets.target, export_dir)
        if problems:
            raise ExportMismatch(f"the final export {export_dir}, loaded as engines load it, is not the trained "
                                 f"drafter: {'; '.join(problems[:8])}")
    after = run.evaluation.run(run.drafter.module, step, "after", export_dir)
    tau_after = after.tau if after else None
    tau_before = run.evaluation.tau_before()
    run.metrics.write({"kind": "final", "step": step, "tau_before": tau_before, "tau_after": tau_after,
                       "recompiles": run.recompiles, "time": time.time()})
    run.metrics.close()
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    run.log(f"done: {step} steps; τ before {fmt(tau_before)} -> after {fmt(tau_after)}; export {export_dir}")
    return TrainResult(step, tau_before, tau_after, export_dir, out)


def train(cfg: TrainConfig, world: World, log: Log = print) -> TrainResult:
    """A drafter rank (or the colocated one): train, or resume, as configured; see the module docstring.

    Raises:
        TrainError, DataError: the config or data cannot be trained on (the message says what to fix).
    """
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    layout = world.layout
    if world.is_main:
        write_json(out / "config.resolved.json", cfg.model_dump(mode="json"))
    # A drafter rank of a split layout computes no features: the target's embedding, head and norm suffice.
    assets = load_assets(cfg, world.device, builds_data=layout.colocated, wants_eval=world.is_main, log=log,
                         whole_target=layout.colocated, share=world.store_share())
    schedule = Schedule(layout, cfg.batches_per_step)
    plan = make_plan(cfg, assets.samples.lengths, schedule.per_step)
    drafter = build_drafter(cfg, assets, world, log)
    checkpoints = RunCheckpoints(cfg, schedule.per_step)
    step = checkpoints.resume(drafter, world.agree_step, log)
    if step and world.is_main:
        rewind_metrics(out / "metrics.jsonl", step)  # lines logged after this checkpoint repeat: drop them
    if layout.colocated:
        features = LocalFeatures(cfg, assets, plan, schedule)
    else:
        features = RemoteFeatures(world, schedule, feature_spec(cfg, assets, world.device), plan.steps)
    log(f"drafter rank {world.rank} (pid {os.getpid()}): {sum(p.numel() for p in drafter.module.parameters()) / 1e6:.2f}M params, "
        f"backend {drafter.module.backend}, compiled forward {drafter.compiled}, precision {drafter.precision.name}; {plan.steps} steps x "
        f"{schedule.per_step} batch(es) of {cfg.rows_per_step} rows x {cfg.row_len} ({schedule.per_drafter} on this rank)")
    metrics: MetricsWriter | NoMetrics = NoMetrics()
    evaluation: Evaluation | NoEvaluation = NoEvaluation()
    if world.is_main:
        metrics = MetricsWriter(out / "metrics.jsonl")
        metrics.write(run_facts(cfg, assets.target, drafter.module, assets.mask_token_id))
        check_servable_export(cfg, assets, drafter, world, log)
        if cfg.evaluation.export_check:
            check_export(drafter.module, assets.target, out, step, log=log)
        evaluation = Evaluation(cfg, assets, metrics, log)
        if not step or not (out / "eval_before.json").exists():
            evaluation.run(drafter.module, step, "before")
    run = _Run(cfg, world, assets, plan, schedule, drafter, features, checkpoints, metrics, evaluation, log)
    step = train_steps(run, step)
    return _finish(run, step)


def run_rank(cfg: TrainConfig, world: World, log: Log = print) -> TrainResult | None:
    """What this rank does in the run: serve features (target ranks) or train (the others)."""
    if world.role == "target":
        serve_features(cfg, world, log)
        return None
    return train(cfg, world, log)
