"""Drafter forward time: flex_attention BlockMask vs SDPA with the dense mask, measured in the same run.

CPU only here (forward; flex has no CPU backward). Prints each backend's time per forward, mask-build
time, and the ratio against the SDPA baseline. On a CUDA box it runs there instead (compiled flex).

    python bench/flex_vs_sdpa.py [--rows 2] [--len 1024] [--anchors 64] [--block 16] [--hidden 256] [--reps 5]
"""

from __future__ import annotations

import argparse
import time

import torch


def _timed(fn, reps: int) -> float:
    fn()  # warm-up (first flex call traces / compiles)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.attention import block_mask, dense_mask
    from trainer.config import ModelConfig
    from trainer.features import TargetModel
    from trainer.model import DFlashDrafter
    from trainer.objective import PackedBatch, block_inputs, sample_anchors

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    heads = max(2, a.hidden // 64)
    hf = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=1024, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=6,
            num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=64,
        )  # fmt: skip
    ).to(dev)
    target = TargetModel(hf, [1, 2, 3])
    drafter = DFlashDrafter.from_target(
        ModelConfig(block_size=a.block, num_draft_layers=5, attention_backend="sdpa"), target, 1023
    ).eval()
    R, L = a.rows, a.len
    ids = torch.randint(0, 1000, (R, L), device=dev)
    doc = torch.zeros(R, L, dtype=torch.long, device=dev)
    pos = torch.arange(L, device=dev).expand(R, L)
    batch = PackedBatch(ids, torch.ones_like(ids), doc, pos, target.features(ids))
    anchors, keep = sample_anchors(batch, a.anchors, a.block, torch.Generator(device=dev).manual_seed(0))
    noise, positions = block_inputs(batch, anchors, keep, a.block, 1023)

    t_dense = _timed(lambda: dense_mask(anchors, keep, doc, a.block), a.reps)
    t_block = _timed(lambda: block_mask(anchors, keep, doc, a.block, compile=dev.type == "cuda"), a.reps)
    dense = dense_mask(anchors, keep, doc, a.block)
    bmask = block_mask(anchors, keep, doc, a.block, compile=dev.type == "cuda")
    with torch.no_grad():
        t_sdpa = _timed(lambda: drafter(noise, batch.target_hidden, positions, dense), a.reps)
        t_flex = _timed(lambda: drafter(noise, batch.target_hidden, positions, bmask), a.reps)
        diff = (drafter(noise, batch.target_hidden, positions, dense) - drafter(noise, batch.target_hidden, positions, bmask)).abs().max()
    q, kv = a.anchors * a.block, L + a.anchors * a.block
    print(f"device {dev}, rows {R} x len {L}, {a.anchors} anchors x block {a.block} (Q {q}, KV {kv}), H {a.hidden}, 5 layers")
    print(f"mask build   dense {t_dense * 1e3:8.2f} ms   block {t_block * 1e3:8.2f} ms   ratio block/dense {t_block / t_dense:.2f}")
    print(f"forward      sdpa  {t_sdpa * 1e3:8.2f} ms   flex  {t_flex * 1e3:8.2f} ms   ratio flex/sdpa {t_flex / t_sdpa:.2f}")
    print(f"max |flex - sdpa| = {float(diff):.2e}")


if __name__ == "__main__":
    main()
