"""Drafter training throughput on this machine, as a fraction of its measured fp32 matmul peak.

    python bench/trainer_throughput.py [--steps 500] [--out DIR]

Runs the real training loop (`trainer.loop.train`, the colocated layout in this process) on the `tiny` experiment's config for --steps steps
(logging every step), and in the same process measures a large fp32 matmul's GFLOP/s as the baseline.
Prints:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--out", default=None, help="run directory (default: a temp dir)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-trainer-"))

    peak = matmul_gflops()
    cfg = tiny_train_config(out, max_steps=args.steps, log_every=1, save_every=10**6, epochs=1000)
    t0 = time.perf_counter()
    train(cfg, single_world(cfg.layout.to_layout()), log=lambda m: None)
    wall = time.perf_counter() - t0
    peak_after = matmul_gflops()  # the machine may be shared: report the baseline on both sides

    recs = [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "train"]
    steady = recs[10:] or recs
    tok_s = statistics.median(r["tokens_per_s"] for r in steady)
    sec_per_step = statistics.median(r["tokens"] / r["tokens_per_s"] for r in steady)
    tokens = statistics.mean(r["tokens"] for r in steady)
    supervised = statistics.mean(r["supervised"] for r in steady)
    export_cfg = json.loads((out / "export" / "config.json").read_text())
    target_cfg = cfg.model.tiny_target.model_dump()
    flops = step_flops(cfg, export_cfg, target_cfg, tokens, supervised)
    achieved = flops / sec_per_step / 1e9
    base = max(peak, peak_after)
    by_step = {r["step"]: r for r in recs}
    rss100 = by_step.get(min(100, len(recs)), recs[0])["rss_mb"]
    rss_end = recs[-1]["rss_mb"]
    growth = (rss_end - rss100) / rss100

    print(f"machine: {torch.get_num_threads()} torch threads; fp32 matmul 2048^3: {peak:.1f} / {peak_after:.1f} GFLOP/s (before/after)")
    print(f"tiny config: {cfg.rows_per_step} rows x {cfg.row_len}, {cfg.data.num_anchors} anchors x block {cfg.model.block_size}, "
          f"{export_cfg['num_hidden_layers']} draft layers, H {export_cfg['hidden_size']}; {len(recs)} steps in {wall:.1f} s (incl. setup, eval)")
    print(f"throughput: {tok_s:.0f} tokens/s ({sec_per_step * 1e3:.1f} ms/step, {tokens:.0f} tokens/step, {supervised:.0f} supervised slots/step)")
    print(f"estimated {flops / 1e9:.2f} GFLOP/step -> {achieved:.2f} GFLOP/s = {achieved / base:.1%} of matmul peak")
    print(f"memory: RSS {rss100:.0f} MiB at step {min(100, len(recs))}, {rss_end:.0f} MiB at step {len(recs)} "
          f"({growth:+.1%}); peak RSS {recs[-1]['peak_rss_mb']:.0f} MiB -> {'flat' if abs(growth) < 0.05 else 'NOT flat'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
