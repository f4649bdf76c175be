"""The training loop (colocated: target and drafter in one process), as plain as nanoGPT.

    setup   target (frozen) + tokenizer, data (read, regenerate, tokenise, count skips), drafter, AdamW
    resume  the newest COMPLETE checkpoint, if any: model, optimizer, step, data position, every RNG
    eval    τ of the untrained drafter on held-out prompts -> eval_before.json (fresh runs only)
    loop    per step: packed rows -> target features per document -> dflash_loss (anchors re-drawn) ->
            backward, clip, AdamW at get_lr(step); a JSON line to metrics.jsonl every log_every steps;
            a checkpoint every save_every steps
    end     export (reference layout) -> export/, τ after -> eval_after.json, a final metrics line

Human lines go to stdout (the orchestrator tees stdout to train.log); machine lines to metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainer.checkpoint import CheckpointManager, capture_rng_state, restore_rng_state
from trainer.config import OptimConfig, TrainConfig
from trainer.data import (
    DataError,
    Sample,
    SkipReport,
    build_step,
    load_samples,
    plan_epoch,
    read_conversations,
    regenerate,
    save_samples,
    target_features,
    tokenize,
)
from trainer.metrics import MetricsWriter, memory_stats, rewind_metrics


class TrainError(RuntimeError):
    """Training cannot start or continue; the message says what to change."""


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
    """What a finished run produced.

    Attributes:
        steps: optimizer steps done (in total, across resumes).
        tau_before: mean τ of the untrained drafter (None if not measured in this run or a previous one).
        tau_after: mean τ after training.
        export_dir: the exported drafter (reference layout).
        output_dir: the run directory.
    """

    steps: int
    tau_before: float | None
    tau_after: float | None
    export_dir: Path
    output_dir: Path


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_mask_token_id(configured: int | None, tokenizer: Any, vocab_rows: int) -> int:
    """MASK id: the configured one, else the tokenizer's mask token, else the first id the tokenizer
    does not use if the embedding has such a row.

    Raises:
        TrainError: none of these exists.
    """
    if configured is not None:
        return configured
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_rows:
        return len(tokenizer)
    raise TrainError(
        f"no MASK token: the tokenizer has no mask token and uses all {vocab_rows} embedding rows; "
        "set model.mask_token_id to an id the data never contains"
    )


# -- setup ------------------------------------------------------------------------------------------
@dataclass
class _Setup:
    target: Any
    tokenizer: Any
    samples: list[Sample]
    eval_prompts: list[list[int]]
    mask_token_id: int
    pad_id: int
    stop_ids: list[int]


def _load_eval_prompts(files: list[str], tokenizer: Any, kw: dict, report: SkipReport) -> list[list[int]]:
    """Held-out prompts: each record's messages up to (not including) its first assistant turn."""
    from trainer.data import BadRecord, normalize_record

    prompts = []
    for path in files:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"{p}: no such eval file (check data.eval_files)")
        for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                # An eval record may lack an assistant turn: add a placeholder so it validates.
                msgs = obj.get("messages", obj.get("conversations")) if isinstance(obj, dict) else None
                if isinstance(msgs, list) and not any(
                    isinstance(m, dict) and m.get("role", m.get("from")) in ("assistant", "gpt") for m in msgs
                ):
                    obj = {"messages": msgs + [{"role": "assistant", "content": "-"}]}
                messages = normalize_record(obj)
            except (json.JSONDecodeError, BadRecord) as exc:
                err = exc if isinstance(exc, BadRecord) else BadRecord("bad JSON", str(exc))
                report.add(f"{p}:{lineno}", err)
                continue
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            text = tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True, tokenize=False, **kw)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def _setup(cfg: TrainConfig, out: Path, device: torch.device, log: Callable[[str], None]) -> _Setup:
    from transformers import AutoTokenizer

    from trainer.features import TargetModel

    data = cfg.data
    train_files, eval_files, do_regen = list(data.train_files), list(data.eval_files), data.regenerate
    if cfg.model.target == "tiny":
        from trainer.tiny import build_tiny

        assets = build_tiny(cfg.model.tiny_target, log=log)
        target_dir = assets.target_dir
        if not train_files:
            train_files, do_regen = [str(assets.train_file)], False  # built already regenerated
        eval_files = eval_files or [str(assets.eval_file)]
    else:
        target_dir = Path(cfg.model.target)
        if not train_files:
            raise TrainError("data.train_files is empty; list jsonl conversation files (or use model.target: tiny)")
    if not (target_dir / "config.json").is_file():
        raise TrainError(
            f"model.target {str(target_dir)!r}: no HF model directory there (no config.json); "
            "point it at a local model directory (downloads are not done here) or use model.target: tiny"
        )
    for f in train_files:
        if not Path(f).is_file():
            raise DataError(f"{f}: no such data file (check data.train_files in the config)")
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = TargetModel.from_pretrained(
        target_dir,
        layer_ids=cfg.model.target_layer_ids,
        num_features=cfg.model.num_target_features,
        dtype=dtype,
        device=device,
    )
    log(f"target: {target_dir} ({target.num_layers} layers, H {target.hidden_size}, features from {target.layer_ids})")
    kw = dict(data.chat_template_kwargs)

    report = SkipReport()
    cache = out / "data" / "samples.jsonl"
    if cache.exists():
        # A resumed run must see the very same samples (regeneration is expensive and order matters).
        samples = load_samples(cache)
        log(f"data: {len(samples)} samples from {cache}")
    else:
        convs = read_conversations(train_files, report)
        if do_regen:
            log(f"data: regenerating {len(convs)} conversations with the target (greedy, {data.regenerate_max_new_tokens} tokens max)")
            convs = regenerate(target, tokenizer, convs, data.regenerate_max_new_tokens, chat_template_kwargs=kw)
        samples = tokenize(convs, tokenizer, data.max_len, report, min_supervised=2, chat_template_kwargs=kw)
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_samples(samples, cache)
        _write_json(out / "data" / "skipped.json", report.to_dict())
        log(f"data: {len(samples)} samples from {len(train_files)} file(s); {report.summary()}")
    if not samples:
        raise DataError(f"no usable training samples in {train_files}: {report.summary()}")
    eval_report = SkipReport()
    eval_prompts = _load_eval_prompts(eval_files, tokenizer, kw, eval_report)
    if eval_report.total:
        log(f"eval data: {eval_report.summary()}")
    mask_id = resolve_mask_token_id(cfg.model.mask_token_id, tokenizer, target.vocab_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return _Setup(target, tokenizer, samples, eval_prompts, mask_id, pad_id, stop_ids)


# -- evaluation -------------------------------------------------------------------------------------
def _evaluate(
    drafter, target, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int] | None = None
) -> dict[str, Any] | None:
    """τ by real greedy speculative decoding on the held-out prompts (None without prompts)."""
    if not prompts:
        return None
    from trainer.evaluate import acceptance_length

    was_training = drafter.training
    drafter.eval()
    try:
        rep = acceptance_length(drafter, target, prompts, max_new_tokens, stop_token_ids=stop_ids)
    finally:
        drafter.train(was_training)
    hist = rep.histogram
    return {
        "tau": float(rep.mean),
        "per_prompt": [float(x) for x in rep.per_prompt],
        "histogram": hist.tolist() if hasattr(hist, "tolist") else (dict(hist) if isinstance(hist, dict) else list(hist)),
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
    }


# -- the run ----------------------------------------------------------------------------------------
def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Run (or resume) training as configured; see the module docstring for the phases.

    Args:
        cfg: the validated config; `cfg.output_dir` is the run directory.
        log: receives human progress lines (default: print, which the orchestrator tees to train.log).

    Returns:
        The TrainResult.

    Raises:
        TrainError, DataError: the config or data cannot be trained on (message says what to fix).
    """
    from trainer.export import export_drafter
    from trainer.model import DFlashDrafter
    from trainer.objective import PackedBatch, dflash_loss

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.resolved.json", cfg.model_dump(mode="json"))
    device = _device()
    _seed_everything(cfg.seed)
    s = _setup(cfg, out, device, log)

    _seed_everything(cfg.seed)  # drafter init independent of what setup consumed
    drafter = DFlashDrafter.from_target(cfg.model, s.target, s.mask_token_id)
    drafter.train()
    n_params = sum(p.numel() for p in drafter.parameters())
    opt = torch.optim.AdamW(
        drafter.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay
    )
    anchor_gen = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    gamma = cfg.resolved_gamma
    row_len, rows_per_step = cfg.row_len, cfg.rows_per_step
    lengths = [len(x) for x in s.samples]

    def plan(epoch: int) -> list[list[list[int]]]:
        return plan_epoch(lengths, row_len, rows_per_step, cfg.data.token_budget, cfg.seed, epoch)

    steps_per_epoch = [len(plan(e)) for e in range(cfg.epochs)]
    total_steps = sum(steps_per_epoch)
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    log(
        f"drafter: {n_params / 1e6:.2f}M params, {cfg.model.num_draft_layers} layers, block {cfg.model.block_size}, "
        f"backend {drafter.backend}; {total_steps} steps ({steps_per_epoch[0]}/epoch, {rows_per_step} rows x {row_len})"
    )

    ckpts = CheckpointManager(out / "checkpoints", keep=cfg.keep_checkpoints)
    step, epoch, index = 0, 0, 0
    resumed = ckpts.load_latest(map_location="cpu")
    if resumed is not None:
        step, state = resumed
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        anchor_gen.set_state(state["anchor_generator"])
        restore_rng_state(state["rng"])
        epoch, index = int(state["data"]["epoch"]), int(state["data"]["index"])
        # Lines the killed process logged after this checkpoint would be repeated: drop them.
        rewind_metrics(out / "metrics.jsonl", step)
        log(f"resumed from step {step} (epoch {epoch}, batch {index})")

    metrics = MetricsWriter(out / "metrics.jsonl", echo=False)
    eval_tokens = cfg.model.tiny_target.response_tokens if cfg.model.target == "tiny" else cfg.data.eval_max_new_tokens
    before_path = out / "eval_before.json"
    if resumed is None or not before_path.exists():
        rng_state, gen_state = capture_rng_state(), anchor_gen.get_state()
        before = _evaluate(drafter, s.target, s.eval_prompts, eval_tokens, s.stop_ids)
        restore_rng_state(rng_state)  # evaluation must not shift the training's random streams
        anchor_gen.set_state(gen_state)
        if before is not None:
            _write_json(before_path, before)
            metrics.write({"kind": "eval", "step": step, "when": "before", "tau": before["tau"]})
            log(f"[eval] step {step} τ {before['tau']:.3f} (untrained drafter, {len(s.eval_prompts)} prompts)")

    def save(step: int, epoch: int, index: int) -> None:
        state = {
            "model": drafter.state_dict(),
            "optimizer": opt.state_dict(),
            "anchor_generator": anchor_gen.get_state(),
            "rng": capture_rng_state(),
            "data": {"epoch": epoch, "index": index},
            "step": step,
        }
        path = ckpts.save(step, state)
        log(f"[ckpt] step {step} -> {path}")

    t_start = time.perf_counter()
    acc_tokens, acc_time, acc_correct, acc_count, acc_tau, acc_n = 0, 0.0, None, None, 0.0, 0
    while step < total_steps and epoch < cfg.epochs:
        batches = plan(epoch)
        while index < len(batches) and step < total_steps:
            t0 = time.perf_counter()
            lr = get_lr(step, total_steps, cfg.optim)
            for group in opt.param_groups:
                group["lr"] = lr
            packed = build_step(s.samples, batches[index], row_len, s.pad_id)
            feats = target_features(s.target, s.samples, packed).to(drafter.dtype)  # [R, L, n_feat*H]
            batch = PackedBatch(
                input_ids=packed.input_ids.to(device),
                loss_mask=packed.loss_mask.to(device),
                doc_ids=packed.doc_ids.to(device),
                position_ids=packed.position_ids.to(device),
                target_hidden=feats,
            )
            res = dflash_loss(drafter, batch, num_anchors=cfg.data.num_anchors, gamma=gamma, generator=anchor_gen)
            res.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.optim.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            index += 1
            loss = res.loss.item()  # CPU-GPU sync point: once per step, the metrics need it anyway
            acc_time += time.perf_counter() - t0
            acc_tokens += packed.num_tokens
            correct, count = res.slot_correct.detach().double().cpu(), res.slot_count.detach().double().cpu()
            acc_correct = correct if acc_correct is None else acc_correct + correct
            acc_count = count if acc_count is None else acc_count + count
            acc_tau += float(res.sim_accept_len)
            acc_n += 1
            if step % cfg.log_every == 0 or step == total_steps:
                # slot_correct/slot_count cover block slots 1..bs-1 (slot 0 is the given anchor).
                per_slot = (acc_correct / acc_count.clamp(min=1)).tolist()
                total_acc = float(acc_correct.sum() / acc_count.sum().clamp(min=1))
                rec = {
                    "kind": "train",
                    "step": step,
                    "epoch": epoch,
                    "loss": loss,
                    "acc": total_acc,
                    "acc_per_slot": per_slot,
                    "sim_tau": acc_tau / acc_n,
                    "tokens_per_s": acc_tokens / max(acc_time, 1e-9),
                    "tokens": packed.num_tokens,
                    "supervised": int(res.n_tokens),
                    "grad_norm": float(grad_norm),
                    "lr": lr,
                    "time": time.time(),
                    "elapsed_s": time.perf_counter() - t_start,
                    **memory_stats(),
                }
                metrics.write(rec)
                log(
                    f"step {step}/{total_steps} ep {epoch} loss {loss:.4f} acc {total_acc:.3f} sim_tau {rec['sim_tau']:.2f} "
                    f"{rec['tokens_per_s']:.0f} tok/s lr {lr:.2e} rss {rec.get('rss_mb', 0):.0f}MB"
                )
                acc_tokens, acc_time, acc_correct, acc_count, acc_tau, acc_n = 0, 0.0, None, None, 0.0, 0
            next_epoch, next_index = (epoch, index) if index < len(batches) else (epoch + 1, 0)
            if step % cfg.save_every == 0 and step < total_steps:
                save(step, next_epoch, next_index)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total_steps:
                rng_state, gen_state = capture_rng_state(), anchor_gen.get_state()
                mid = _evaluate(drafter, s.target, s.eval_prompts, eval_tokens, s.stop_ids)
                restore_rng_state(rng_state)
                anchor_gen.set_state(gen_state)
                if mid is not None:
                    metrics.write({"kind": "eval", "step": step, "when": "during", "tau": mid["tau"]})
                    log(f"[eval] step {step} τ {mid['tau']:.3f}")
        if index >= len(batches):
            epoch, index = epoch + 1, 0

    save(step, epoch, index)
    export_dir = out / "export"
    export_drafter(drafter, s.target, export_dir)
    log(f"[export] {export_dir}")
    after = _evaluate(drafter, s.target, s.eval_prompts, eval_tokens, s.stop_ids)
    tau_after = None
    if after is not None:
        _write_json(out / "eval_after.json", after)
        tau_after = after["tau"]
    tau_before = json.loads(before_path.read_text())["tau"] if before_path.exists() else None
    metrics.write({"kind": "final", "step": step, "tau_before": tau_before, "tau_after": tau_after, "time": time.time()})
    metrics.close()
    if tau_after is not None:
        log(f"[eval] step {step} τ {tau_after:.3f} (before training: {tau_before if tau_before is None else f'{tau_before:.3f}'})")
    return TrainResult(step, tau_before, tau_after, export_dir, out)
