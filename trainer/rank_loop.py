"""What each rank of the split layout does, and the single-process reference at the same global batch.

    python -m trainer.rank_loop --config FILE     (started by trainer.launch, one process per rank)

Global batches: the packing plan of every epoch, concatenated. At step s drafter d trains on batch
b = s*D + d (Layout.batch_index), whose features target rank Layout.source_of(s, d) computes and sends.
Steps = len(batches) // D (capped by max_steps): every rank derives it from the same samples file, so all
ranks run the same number of steps. Every batch is padded to rows_per_step rows of row_len tokens (fixed
shapes: the feature messages and the compiled kernels never change size). Anchors of batch b come from a
generator seeded by (seed, b), so any layout that trains on the same global batches draws the same anchors;
`train_reference` (one process, D micro-batches per step, no torch.distributed) is therefore the exact
single-process counterpart of a 1 + D layout.

Per step on a drafter rank: receive the batch (the next one is already being received), dflash_loss with
the batch's anchors, backward (DDP averages gradients over drafters: the same as the mean of D
micro-batch losses), clip, AdamW at get_lr(step). Only the main drafter rank (the first) logs metrics,
saves checkpoints, evaluates τ and exports.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from trainer.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from trainer.config import TrainConfig
from trainer.data import DataError, build_step, plan_epoch, target_features
from trainer.metrics import MetricsWriter, memory_stats, rewind_metrics
from trainer.train import TrainError, TrainResult, _evaluate, _seed_everything, _setup, _write_json, get_lr

MEM_KEYS = ("alloc_mb", "peak_mb", "rss_mb", "peak_rss_mb")
_SAMPLES = Path("data") / "samples.jsonl"


# -- the global plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Every global batch in order (epoch, rows), and how many lockstep steps D drafters make of them."""

    batches: list[tuple[int, list[list[int]]]]
    drafters: int
    steps: int


def make_plan(cfg: TrainConfig, lengths: list[int], drafters: int) -> Plan:
    """The global batch sequence and the step count (a pure function of the samples and the config).

    Raises:
        DataError: fewer batches than drafters (not even one step).
    """
    batches = []
    for epoch in range(cfg.epochs):
        for rows in plan_epoch(lengths, cfg.row_len, cfg.rows_per_step, cfg.data.token_budget, cfg.seed, epoch):
            batches.append((epoch, rows))
    steps = len(batches) // drafters
    if cfg.max_steps is not None:
        steps = min(steps, cfg.max_steps)
    if steps < 1:
        raise DataError(
            f"{len(batches)} packed batch(es) for {drafters} drafter process(es): not one step; add data or epochs, "
            "or use fewer drafter processes"
        )
    return Plan(batches, drafters, steps)


def padded_rows(rows: list[list[int]], rows_per_step: int) -> list[list[int]]:
    """A batch's rows padded with empty rows to the fixed row count (an empty row is all padding)."""
    return list(rows) + [[] for _ in range(rows_per_step - len(rows))]


def anchor_generator(seed: int, batch_index: int) -> torch.Generator:
    """The anchor RNG of global batch `batch_index`: the same in every layout (CPU: same draws everywhere)."""
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + batch_index + 1) % (2**63))


def rank_memory(device: torch.device) -> dict[str, float]:
    """Memory of this process in MiB: allocated and peak on CUDA; on CPU both are the resident set."""
    m = memory_stats()
    rss = m.get("rss_mb", 0.0)
    peak_rss = max(rss, m.get("peak_rss_mb", 0.0))  # two sources (statm, getrusage) can disagree by pages
    if device.type == "cuda":
        alloc, peak = torch.cuda.memory_allocated() / 2**20, torch.cuda.max_memory_allocated() / 2**20
    else:
        alloc, peak = rss, peak_rss
    return {"alloc_mb": alloc, "peak_mb": peak, "rss_mb": rss, "peak_rss_mb": peak_rss}


def compute_batch(setup, rows: list[list[int]], cfg: TrainConfig):
    """(PackedBatch with features, target seconds) for one global batch, computed by the local target."""
    from trainer.objective import PackedBatch

    t0 = time.perf_counter()
    packed = build_step(setup.samples, padded_rows(rows, cfg.rows_per_step), cfg.row_len, setup.pad_id)
    feats = target_features(setup.target, setup.samples, packed)  # [R, L, F] in the target's dtype
    if feats.is_cuda:
        torch.cuda.synchronize()  # CPU-GPU sync point: the target time must include its kernels
    batch = PackedBatch(packed.input_ids, packed.loss_mask, packed.doc_ids, packed.position_ids, feats)
    return batch, time.perf_counter() - t0


def _prepare(cfg: TrainConfig, device: torch.device, first: bool, log: Callable[[str], None]):
    """Set up target, tokenizer and samples. The first rank builds the data; the others wait for its
    samples file (the launcher stops everyone if that rank dies, so the wait cannot outlive it)."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if first:
        _write_json(out / "config.resolved.json", cfg.model_dump(mode="json"))
    else:
        while not (out / _SAMPLES).exists():
            time.sleep(0.2)
    _seed_everything(cfg.seed)
    return _setup(cfg, out, device, log)


# -- reductions: over the drafter group, or nothing in one process --------------------------------------
class _Reduce:
    def __init__(self, group=None, device: torch.device | None = None):
        self.group, self.device = group, device

    def __call__(self, t: torch.Tensor, op: str) -> torch.Tensor:
        if self.group is None:
            return t
        import torch.distributed as dist

        x = t.to(self.device)
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return x.cpu()


class _ModelView:
    """What dflash_loss needs of a drafter, with the forward going through DDP (attributes from the module)."""

    def __init__(self, wrapped, module):
        self._wrapped, self._module = wrapped, module

    def __call__(self, *args, **kwargs):
        return self._wrapped(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


# -- the drafter loop (shared by a DDP drafter rank and the single-process reference) -------------------
@dataclass
class _DrafterRun:
    cfg: TrainConfig
    setup: object
    device: torch.device
    drafters: int
    local: list[int]  # drafter indices trained in this process (one under DDP; all D in the reference)
    reduce: _Reduce
    is_main: bool
    roles: list[str]  # role of every rank (memory slots in the metrics)
    my_rank: int
    log: Callable[[str], None]


def _drafter_loop(run: _DrafterRun, fetch, wrap, resume_step_agreed: Callable[[int], int]) -> TrainResult:
    """Train; `fetch(step)` -> [(drafter index, PackedBatch, stats[len(STATS)], source rank)].

    `wrap(module)` returns what the forward goes through (DDP or the module); `resume_step_agreed(step)`
    makes every rank agree on the step to resume from and returns it.
    """
    from trainer.export import export_drafter
    from trainer.model import DFlashDrafter
    from trainer.objective import dflash_loss
    from trainer.warmup import compile_counters, compile_drafter, configure_compile

    cfg, s, log, D = run.cfg, run.setup, run.log, run.drafters
    out = Path(cfg.output_dir)
    cache_dir = configure_compile(cfg.compile)
    _seed_everything(cfg.seed)  # drafter init independent of what setup consumed
    drafter = DFlashDrafter.from_target(cfg.model, s.target, s.mask_token_id)
    drafter.train()
    compiled = compile_drafter(drafter, cfg.compile)
    watch_compiles = compiled or (drafter.backend == "flex" and run.device.type == "cuda")
    if watch_compiles:
        torch._logging.set_logs(recompiles=True)  # torch's own "Recompiling function ..." lines name the guard
        log(f"[compile] inductor cache {cache_dir}")
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
    plan = make_plan(cfg, [len(x) for x in s.samples], D)
    ckpts = CheckpointManager(out / "checkpoints", keep=cfg.keep_checkpoints)
    resumed = ckpts.load_latest(map_location="cpu")
    step = resume_step_agreed(resumed[0] if resumed else 0)
    if step:
        if resumed is None or resumed[0] != step:
            raise TrainError(f"ranks disagree on the checkpoint to resume from (main: step {step}); is {out} shared?")
        state = resumed[1]
        data = state.get("data", {})
        if "global_step" not in data:
            raise TrainError(
                f"checkpoint step {step} in {out / 'checkpoints'} was written by the colocated loop "
                "(python -m trainer train); resume it with an empty `layout` section"
            )
        if data.get("drafters") != D:
            raise TrainError(
                f"checkpoint step {step} was trained with {data.get('drafters')} drafter process(es), this layout has "
                f"{D}: the global batches would not line up; resume with the same number of drafters"
            )
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        restore_rng_state(state["rng"])
        if run.is_main:
            rewind_metrics(out / "metrics.jsonl", step)  # lines logged after this checkpoint repeat: drop them
        log(f"resumed from step {step}")
    model = _ModelView(wrap(drafter), drafter)
    log(
        f"drafter {run.local}: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params, backend {drafter.backend}, "
        f"compiled forward {compiled}; {plan.steps} steps x {D} batch(es) of {cfg.rows_per_step} rows x {cfg.row_len}"
    )

    metrics = MetricsWriter(out / "metrics.jsonl") if run.is_main else None
    eval_tokens = cfg.model.tiny_target.response_tokens if cfg.model.target == "tiny" else cfg.data.eval_max_new_tokens
    before_path = out / "eval_before.json"
    if run.is_main and (resumed is None or not before_path.exists()):
        before = _evaluate(drafter, s.target, s.eval_prompts, eval_tokens, s.stop_ids)
        if before is not None:
            _write_json(before_path, before)
            metrics.write({"kind": "eval", "step": step, "when": "before", "tau": before["tau"]})
            log(f"[eval] step {step} τ {before['tau']:.3f} (untrained drafter)")

    def save(step: int) -> None:
        state = {
            "model": drafter.state_dict(),
            "optimizer": opt.state_dict(),
            "rng": capture_rng_state(),
            "data": {"global_step": step, "drafters": D},
            "step": step,
        }
        log(f"[ckpt] step {step} -> {ckpts.save(step, state)}")

    bs, W, T = cfg.model.block_size, len(run.roles), run.roles.count("target")
    n_acc = 5 + 2 * (bs - 1) + 2 * max(T, 1)  # see `acc` below; then drafter busy and wait seconds
    acc = torch.zeros(n_acc + 2, dtype=torch.float64)
    procs = D if run.reduce.group is not None else 1  # drafter processes whose busy seconds get summed
    mem = torch.zeros((W, len(MEM_KEYS)), dtype=torch.float64)
    graphs0, recompiles, t_mark = None, 0, time.perf_counter()
    t_start = t_mark
    while step < plan.steps:
        t0 = time.perf_counter()
        items = fetch(step)
        t_wait = time.perf_counter() - t0
        lr = get_lr(step, plan.steps, cfg.optim)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for d, batch, stats, src in items:
            gen = anchor_generator(cfg.seed, step * D + d)
            res = dflash_loss(model, batch, num_anchors=cfg.data.num_anchors, gamma=cfg.resolved_gamma, generator=gen)
            (res.loss / len(items)).backward()  # DDP averages over drafters: together the mean of D batch losses
            loss_sum += res.loss.item()  # CPU-GPU sync point: once per batch, the metrics need it anyway
            # acc = [loss(step), tokens, supervised, accept_sum, n_blocks, slot_correct.., slot_count..,
            #        (target seconds, target tokens) per target rank]
            acc[1] += stats[1]
            acc[2] += float(res.n_tokens)
            acc[3] += float(res.accept_sum)
            acc[4] += float(res.n_blocks)
            acc[5 : 5 + bs - 1] += res.slot_correct.double().cpu()
            acc[5 + bs - 1 : 5 + 2 * (bs - 1)] += res.slot_count.double().cpu()
            slot = 5 + 2 * (bs - 1) + 2 * (src if T else 0)
            acc[slot] += stats[0]
            acc[slot + 1] += stats[1]
            if T:
                mem[src] = stats[2 : 2 + len(MEM_KEYS)]
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        t_busy = time.perf_counter() - t0 - t_wait
        acc[0] = loss_sum
        acc[n_acc] += t_busy
        acc[n_acc + 1] += t_wait
        graphs = compile_counters()["unique_graphs"]
        if graphs0 is None:
            graphs0 = graphs  # the first step compiles (or loads from the cache): that is the warm-up
        elif graphs > graphs0 + recompiles:
            new = graphs - graphs0 - recompiles
            recompiles += new
            # A line for the log follower; torch's own "Recompiling function" line above it names the guard.
            log(f"[compile] recompile during training: {new} new graph(s) at step {step} (recompiles {recompiles}); "
                "shapes must stay fixed, see the guard failure above")
        if step % cfg.log_every == 0 or step == plan.steps:
            mine = rank_memory(run.device)
            mem[run.my_rank] = torch.tensor([mine[k] for k in MEM_KEYS], dtype=torch.float64)
            tot = run.reduce(acc, "sum")
            mem_all = run.reduce(mem.flatten(), "max").view(W, len(MEM_KEYS))
            if run.is_main:
                wall = time.perf_counter() - t_mark
                sc, cnt = tot[5 : 5 + bs - 1], tot[5 + bs - 1 : 5 + 2 * (bs - 1)]
                tgt = tot[5 + 2 * (bs - 1) : n_acc].view(-1, 2)
                rec = {
                    "kind": "train",
                    "step": step,
                    "epoch": plan.batches[(step - 1) * D][0],
                    "loss": float(tot[0]) / D,
                    "acc": float(sc.sum() / cnt.sum().clamp(min=1)),
                    "acc_per_slot": (sc / cnt.clamp(min=1)).tolist(),
                    "sim_tau": float(tot[3] / tot[4].clamp(min=1)),
                    "tokens_per_s": float(tot[1]) / max(wall, 1e-9),
                    "drafter_tokens_per_s": float(tot[1]) / max(float(tot[n_acc]) / procs, 1e-9),
                    "target_tokens_per_s": float(sum(t[1] / t[0] for t in tgt.tolist() if t[0] > 0)),
                    "feature_wait_s": float(tot[n_acc + 1]) / procs,
                    "tokens": int(tot[1]),
                    "supervised": int(tot[2]),
                    "grad_norm": float(grad_norm),
                    "lr": lr,
                    "recompiles": recompiles,
                    "memory": [{"rank": r, "role": run.roles[r], **dict(zip(MEM_KEYS, mem_all[r].tolist()))} for r in range(W)],
                    "rss_mb": mine["rss_mb"],
                    "peak_rss_mb": mine["peak_rss_mb"],
                    "max_peak_mb": float(mem_all[:, 1].max()),
                    "time": time.time(),
                    "elapsed_s": time.perf_counter() - t_start,
                }
                metrics.write(rec)
                log(
                    f"step {step}/{plan.steps} loss {rec['loss']:.4f} acc {rec['acc']:.3f} sim_tau {rec['sim_tau']:.2f} "
                    f"{rec['tokens_per_s']:.0f} tok/s (target {rec['target_tokens_per_s']:.0f}, drafter "
                    f"{rec['drafter_tokens_per_s']:.0f}) lr {lr:.2e} peak {rec['max_peak_mb']:.0f}MB recompiles {recompiles}"
                )
            acc.zero_()
            t_mark = time.perf_counter()
        if run.is_main and step % cfg.save_every == 0 and step < plan.steps:
            save(step)
        if run.is_main and cfg.eval_every and step % cfg.eval_every == 0 and step < plan.steps:
            mid = _evaluate(drafter, s.target, s.eval_prompts, eval_tokens, s.stop_ids)
            if mid is not None:
                metrics.write({"kind": "eval", "step": step, "when": "during", "tau": mid["tau"]})
                log(f"[eval] step {step} τ {mid['tau']:.3f}")

    export_dir = out / "export"
    tau_before = tau_after = None
    if run.is_main:
        save(step)
        export_drafter(drafter, s.target, export_dir)
        log(f"[export] {export_dir}")
        after = _evaluate(drafter, s.target, s.eval_prompts, eval_tokens, s.stop_ids)
        if after is not None:
            _write_json(out / "eval_after.json", after)
            tau_after = after["tau"]
        tau_before = json.loads(before_path.read_text())["tau"] if before_path.exists() else None
        metrics.write({"kind": "final", "step": step, "tau_before": tau_before, "tau_after": tau_after,
                       "recompiles": recompiles, "time": time.time()})
        metrics.close()
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        log(f"done: {step} steps; τ before {fmt(tau_before)} -> after {fmt(tau_after)}; export {export_dir}")
    return TrainResult(step, tau_before, tau_after, export_dir, out)


# -- the single-process reference ---------------------------------------------------------------------
def train_reference(cfg: TrainConfig, micro_batches: int, log: Callable[[str], None] = print) -> TrainResult:
    """One process, no torch.distributed: each step trains on `micro_batches` global batches (gradients of
    their mean loss), computing features locally. The same global batches, anchors and updates as a split
    layout with that many drafters.

    Raises:
        TrainError, DataError: as `trainer.train.train`.
    """
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    setup = _prepare(cfg, device, True, log)
    plan_cache: dict[str, Plan] = {}

    def fetch(step: int):
        plan = plan_cache.setdefault("p", make_plan(cfg, [len(x) for x in setup.samples], micro_batches))
        items = []
        for d in range(micro_batches):
            batch, secs = compute_batch(setup, plan.batches[step * micro_batches + d][1], cfg)
            stats = torch.tensor([secs, batch.num_tokens] + [0.0] * 4, dtype=torch.float64)
            items.append((d, batch, stats, 0))
        return items

    run = _DrafterRun(cfg, setup, device, micro_batches, list(range(micro_batches)), _Reduce(), True, ["colocated"], 0, log)
    return _drafter_loop(run, fetch, lambda m: m, lambda s: s)


# -- the ranks of the split layout --------------------------------------------------------------------
def _agree_step(groups, main_rank: int, step: int) -> int:
    """Everyone takes the main drafter rank's resume step (a broadcast over the world)."""
    import torch.distributed as dist

    t = torch.tensor([step], dtype=torch.long, device=groups.device)
    dist.broadcast(t, src=main_rank)
    return int(t.item())


def run_target(cfg: TrainConfig, groups, log: Callable[[str], None]) -> None:
    """A target rank: compute and send the features of its batches, step by step, `prefetch` ahead."""
    from trainer.distributed import FeatureSpec, send_batch

    layout, rank = groups.layout, groups.rank
    setup = _prepare(cfg, groups.device, rank == 0, log)
    plan = make_plan(cfg, [len(x) for x in setup.samples], layout.num_drafters)
    step = _agree_step(groups, layout.drafter_ranks()[0], 0)
    target_dtype = next(setup.target.parameters()).dtype
    spec = FeatureSpec(cfg.rows_per_step, cfg.row_len, setup.target.feature_size, target_dtype, groups.device)
    per_step = max(1, -(-layout.num_drafters // layout.num_targets))
    cap = cfg.layout.prefetch * per_step
    inflight: collections.deque = collections.deque()
    log(f"target rank {rank}: steps {step}..{plan.steps}, features [{spec.rows}, {spec.row_len}, {spec.feat_dim}] {target_dtype}")
    for s in range(step, plan.steps):
        for b, dst in layout.sends(rank, s):
            batch, secs = compute_batch(setup, plan.batches[b][1], cfg)
            m = rank_memory(groups.device)
            stats = torch.tensor([secs, batch.num_tokens] + [m[k] for k in MEM_KEYS], dtype=torch.float64)
            inflight.append(send_batch(batch, stats, dst, spec))
            while len(inflight) > cap:  # bounded: wait for the oldest batch to be received
                for work, _ in inflight.popleft():
                    work.wait()
    while inflight:
        for work, _ in inflight.popleft():
            work.wait()
    log(f"target rank {rank}: sent every batch")


class _FeatureStream:
    """A drafter's incoming batches: the next step's receive is posted before this step trains."""

    def __init__(self, layout, rank: int, spec, first: int, steps: int):
        self.layout, self.d, self.spec, self.steps = layout, layout.drafter_index(rank), spec, steps
        self.pending = self._post(first)

    def _post(self, step: int):
        from trainer.distributed import PendingBatch

        if step >= self.steps:
            return None
        src = self.layout.source_of(step, self.d)
        return step, src, PendingBatch(src, self.spec)

    def __call__(self, step: int):
        got, src, pending = self.pending
        if got != step:
            raise TrainError(f"feature stream out of step: expected step {step}, posted {got}")
        batch, stats = pending.wait()
        self.pending = self._post(step + 1) or (None, None, None)
        return [(self.d, batch, stats, src)]


def run_drafter(cfg: TrainConfig, groups, log: Callable[[str], None]) -> None:
    """A drafter rank: DDP over the drafter group, features from the target ranks."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainer.distributed import FeatureSpec

    layout, rank = groups.layout, groups.rank
    main = layout.drafter_ranks()[0]
    setup = _prepare(cfg, groups.device, False, log)
    target_dtype = next(setup.target.parameters()).dtype
    spec = FeatureSpec(cfg.rows_per_step, cfg.row_len, setup.target.feature_size, target_dtype, groups.device)
    roles = [layout.role(r) for r in range(layout.world_size)]
    stream: dict[str, _FeatureStream] = {}

    def agree(step: int) -> int:
        step = _agree_step(groups, main, step)
        steps = make_plan(cfg, [len(x) for x in setup.samples], layout.num_drafters).steps
        stream["s"] = _FeatureStream(layout, rank, spec, step, steps)
        return step

    def wrap(module):
        ids = [0] if groups.device.type == "cuda" else None
        return DDP(module, device_ids=ids, process_group=groups.drafters)

    run = _DrafterRun(
        cfg, setup, groups.device, layout.num_drafters, [layout.drafter_index(rank)],
        _Reduce(groups.drafters, groups.device), rank == main, roles, rank, log,
    )
    _drafter_loop(run, lambda step: stream["s"](step), wrap, agree)


def main(argv: list[str] | None = None) -> int:
    """One rank's process (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; set by trainer.launch)."""
    from trainer.config import load_config
    from trainer.distributed import init_groups, read_rank_env, run_rank

    p = argparse.ArgumentParser(prog="python -m trainer.rank_loop", description="One rank of a split layout.")
    p.add_argument("--config", required=True)
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "-1"))
    log = lambda msg: print(msg, flush=True)  # noqa: E731

    def body() -> None:
        env = read_rank_env()
        cfg = load_config(args.config)
        layout = cfg.layout.to_layout()
        groups = init_groups(layout, env, cfg.layout.timeout_s)
        if layout.role(env.rank) == "target":
            run_target(cfg, groups, log)
        else:
            run_drafter(cfg, groups, log)

    code = run_rank(body, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # no interpreter teardown: it can block on a dead peer's sockets
    return 0


if __name__ == "__main__":
    sys.exit(main())
