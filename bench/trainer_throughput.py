"""Drafter training throughput on this machine, as a fraction of its measured fp32 matmul peak.

    python bench/trainer_throughput.py [--steps 500] [--precisions fp32,bf16-mixed,bf16-true] [--out DIR]

Runs the real training loop (`trainer.loop.train`, the colocated layout in this process) on the `tiny`
experiment's config for --steps steps (logging every step), once per training precision from the same seed,
and in the same process measures a large fp32 matmul's GFLOP/s as the baseline. Prints:
  - per precision: tokens/s and its ratio to fp32's, the final loss, and the mean / final / max absolute
    difference of its per-step loss to fp32's (bf16-mixed should track fp32 closely, bf16-true less so);
For the fp32 run:
  - tokens/s (real packed tokens per second of step time, median over steps after the first 10),
  - estimated training FLOP/s and its fraction of the matmul peak (FLOPs: 6 x params x tokens for the
    drafter's trained weights, the dense attention it computes, 4 x V x H per supervised slot for the frozen
    LM head (forward + input gradient), and 2 x params x tokens for the frozen target's forward),
  - resident memory at step 100 and at the last step, and whether it is flat (growth < 5%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.metrics import read_metrics  # noqa: E402
from trainer.tiny import tiny_train_config  # noqa: E402
from trainer.distributed import single_world  # noqa: E402
from trainer.loop import train  # noqa: E402


def matmul_gflops(n: int = 2048, reps: int = 10) -> float:
    """Best-of-reps fp32 GFLOP/s of an n x n matmul (2 n^3 FLOPs) with torch's current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up (thread pool, caches)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def step_flops(cfg, export_cfg: dict, target_cfg: dict, tokens: float, supervised: float) -> float:
    """Estimated FLOPs of one training step (see the module docstring)."""
    H = export_cfg["hidden_size"]
    I = export_cfg["intermediate_size"]
    Hq, Hkv, D = export_cfg["num_attention_heads"], export_cfg["num_key_value_heads"], export_cfg["head_dim"]
    n_layers = export_cfg["num_hidden_layers"]
    V = export_cfg["vocab_size"]
    n_feat = len(export_cfg["dflash_config"]["target_layer_ids"])
    R, L, N, bs = cfg.rows_per_step, cfg.row_len, cfg.data.num_anchors, cfg.model.block_size
    Tq, Tc = R * N * bs, R * L  # query (block) positions, context positions
    layer_q = H * Hq * D + 2 * H * Hkv * D + Hq * D * H + 3 * H * I  # weights a block position passes
    layer_ctx = 2 * H * Hkv * D  # context positions only go through k_proj / v_proj
    drafter = 6 * (n_layers * layer_q * Tq + (n_layers * layer_ctx + n_feat * H * H) * Tc)
    attention = 3 * n_layers * 4 * Tq * (L + N * bs) * Hq * D  # dense SDPA: QK^T and AV, fwd + bwd
    head = 4 * V * H * supervised
    tH, tI, tL = target_cfg["hidden_size"], target_cfg["intermediate_size"], target_cfg["num_hidden_layers"]
    tq = target_cfg["num_attention_heads"] * target_cfg["head_dim"]
    tkv = target_cfg["num_key_value_heads"] * target_cfg["head_dim"]
    target = 2 * tokens * tL * (tH * tq + 2 * tH * tkv + tq * tH + 3 * tH * tI)
    return drafter + attention + head + target


def run_precision(precision: str, steps: int, out: Path) -> dict:
    """Train the tiny config for `steps` steps in `precision` (logging every step); its numbers."""
    cfg = tiny_train_config(out, max_steps=steps, log_every=1, save_every=10**6, epochs=1000, precision=precision,
                            evaluation={"budgets": [], "temperatures": [0.0]})
    t0 = time.perf_counter()
    train(cfg, single_world(cfg.layout.to_layout()), log=lambda m: None)
    wall = time.perf_counter() - t0
    recs = [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "train"]
    steady = recs[10:] or recs
    by_step = {r["step"]: r for r in recs}
    return {
        "cfg": cfg, "recs": recs, "wall": wall, "losses": [r["loss"] for r in recs],
        "tok_s": statistics.median(r["tokens_per_s"] for r in steady),
        "sec_per_step": statistics.median(r["tokens"] / r["tokens_per_s"] for r in steady),
        "tokens": statistics.mean(r["tokens"] for r in steady),
        "supervised": statistics.mean(r["supervised"] for r in steady),
        "rss100": by_step.get(min(100, len(recs)), recs[0])["rss_mb"],
        "export_cfg": json.loads((out / "export" / "config.json").read_text()),
    }


def report_fp32(r: dict, peak: float, peak_after: float) -> None:
    """The fp32 run against the machine's fp32 matmul peak, and its memory."""
    cfg, recs, export_cfg = r["cfg"], r["recs"], r["export_cfg"]
    flops = step_flops(cfg, export_cfg, cfg.model.tiny_target.model_dump(), r["tokens"], r["supervised"])
    achieved = flops / r["sec_per_step"] / 1e9
    base = max(peak, peak_after)
    rss_end = recs[-1]["rss_mb"]
    growth = (rss_end - r["rss100"]) / r["rss100"]
    print(f"machine: {torch.get_num_threads()} torch threads; fp32 matmul 2048^3: {peak:.1f} / {peak_after:.1f} GFLOP/s (before/after)")
    print(f"tiny config: {cfg.rows_per_step} rows x {cfg.row_len}, {cfg.data.num_anchors} anchors x block {cfg.model.block_size}, "
          f"{export_cfg['num_hidden_layers']} draft layers, H {export_cfg['hidden_size']}; {len(recs)} steps in {r['wall']:.1f} s (incl. setup, eval)")
    print(f"fp32 throughput: {r['tok_s']:.0f} tokens/s ({r['sec_per_step'] * 1e3:.1f} ms/step, {r['tokens']:.0f} tokens/step, "
          f"{r['supervised']:.0f} supervised slots/step)")
    print(f"estimated {flops / 1e9:.2f} GFLOP/step -> {achieved:.2f} GFLOP/s = {achieved / base:.1%} of matmul peak")
    print(f"memory: RSS {r['rss100']:.0f} MiB at step {min(100, len(recs))}, {rss_end:.0f} MiB at step {len(recs)} "
          f"({growth:+.1%}); peak RSS {recs[-1]['peak_rss_mb']:.0f} MiB -> {'flat' if abs(growth) < 0.05 else 'NOT flat'}")


def report_precisions(runs: dict[str, dict]) -> None:
    """tokens/s of each precision as a ratio to fp32's, and its loss curve's distance to fp32's."""
    base = runs.get("fp32")
    print("precision    tokens/s  x fp32   final loss   |loss - fp32| mean / final / max")
    for name, r in runs.items():
        ratio = f"{r['tok_s'] / base['tok_s']:6.2f}" if base else "   n/a"
        line = f"{name:<11} {r['tok_s']:9.0f}  {ratio}   {r['losses'][-1]:10.4f}"
        if base and name != "fp32":
            d = [abs(a - b) for a, b in zip(r["losses"], base["losses"])]
            line += f"   {sum(d) / len(d):.2e} / {d[-1]:.2e} / {max(d):.2e}"
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--precisions", default="fp32,bf16-mixed,bf16-true",
                    help="comma-separated, run in this order (default: fp32,bf16-mixed,bf16-true)")
    ap.add_argument("--out", default=None, help="directory for the runs (default: a temp dir)")
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="bench-trainer-"))

    peak = matmul_gflops()
    runs = {p: run_precision(p, args.steps, root / p) for p in args.precisions.split(",") if p}
    peak_after = matmul_gflops()  # the machine may be shared: report the baseline on both sides
    if "fp32" in runs:
        report_fp32(runs["fp32"], peak, peak_after)
    report_precisions(runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
