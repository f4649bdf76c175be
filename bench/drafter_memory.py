"""What a drafter rank holds of the target: the whole model (before) against its head parts (after).

    python bench/drafter_memory.py [--mid] [--split-run]

Each measurement is a fresh Python process that imports torch and transformers and builds the target's model
class on the meta device (the baseline, measured in the same way), then loads the target as a drafter rank did before (trainer.features.TargetModel: every
weight) or does now (trainer.features.TargetHead: embedding, LM head, final norm, read selectively from the
safetensors files) and reads every loaded weight once (as a copy to a GPU would). Prints RSS and peak RSS (VmHWM) over the baseline, the ratio after/before, and the bytes
the arithmetic predicts (params x 4 bytes: the CPU trainer loads the target in float32), for:

  - the `tiny` experiment's target (the shipped CPU demo; the default tiny cache, built if missing);
  - with --mid, a random Qwen3 of hidden 512, 8 layers, vocab 32000 (big enough that the weights, not the
    interpreter, dominate the difference);

then the same arithmetic for Qwen3-8B in bfloat16 (its published config: hidden 4096, 36 layers, vocab
151936, untied). With --split-run it also runs the 1 target + 2 drafter layout on the tiny experiment for 20
steps and prints every rank's RSS from metrics.jsonl (after; the drafter ranks now hold the head parts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}
"""Qwen3-8B's config.json sizes (facts of the published model)."""

_PROBE = r"""
import json, sys, gc
import torch, transformers  # the baseline includes what every rank imports
from trainer.features import TargetHead, TargetModel

def mem():
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out

what, path = sys.argv[1], sys.argv[2]
# The baseline also holds the model code (both loaders import it; TargetHead builds the model on the meta
# device to learn its tensor names).
with torch.device("meta"):
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
gc.collect()
base = mem()
if what == "whole":
    t = TargetModel.from_pretrained(path, num_features=3, dtype=torch.float32)
elif what == "head":
    t = TargetHead.from_pretrained(path, num_features=3, dtype=torch.float32)
if what != "none":
    # Read every weight once, as a rank that moves them to its GPU does: a safetensors file can be mapped
    # lazily, and untouched pages would not count.
    for p in t.parameters():
        p.detach().sum()
gc.collect()
m = mem()
print(json.dumps({"rss_mb": m["VmRSS"] - base["VmRSS"], "peak_mb": m["VmHWM"] - base["VmRSS"],
                  "base_rss_mb": base["VmRSS"]}))
"""


def target_params(c: dict) -> dict[str, int]:
    """Parameter counts of a Qwen3-style causal LM: the whole model, and the parts a drafter rank reads."""
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    D = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H + 2 * D  # attention, MLP, two norms, q/k norms
    embed = V * H
    head = 0 if c.get("tie_word_embeddings") else V * H
    return {"whole": embed + head + L * layer + H, "parts": embed + head + H}


def probe(what: str, path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _PROBE, what, str(path)], env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"probe {what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(name: str, path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    n = target_params(config)
    base, whole, head = probe("none", path), probe("whole", path), probe("head", path)
    print(f"{name}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, vocab {config['vocab_size']} "
          f"(interpreter + torch + transformers baseline: {base['base_rss_mb']:.0f} MiB RSS)")
    for label, m, params in (("before (whole target)", whole, n["whole"]), ("after (head parts)   ", head, n["parts"])):
        print(f"  {label}: RSS +{m['rss_mb'] - base['rss_mb']:7.1f} MiB, peak +{m['peak_mb'] - base['peak_mb']:7.1f} MiB "
              f"over the baseline; arithmetic {params / 1e6:.2f}M params x 4 B = {params * 4 / 2**20:.1f} MiB")
    d_whole, d_head = whole["rss_mb"] - base["rss_mb"], head["rss_mb"] - base["rss_mb"]
    if d_whole > 0:
        print(f"  after / before: {d_head / d_whole:.3f} (arithmetic {n['parts'] / n['whole']:.3f})")


def build_mid(root: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM  # noqa: F401

    cfg = Qwen3Config(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = root / "mid"
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def split_run(root: Path) -> None:
    from trainer.metrics import read_metrics
    from trainer.tiny import tiny_train_config

    out = root / "split"
    cfg = tiny_train_config(out, max_steps=20, log_every=20, save_every=10**6, evaluation={"budgets": [], "temperatures": [0.0]},
                            layout={"num_target_procs": 1, "num_drafter_procs": 2})
    path = root / "split.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "trainer.launch", "--config", str(path)], env=env, cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"split run failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    rec = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"][-1]
    print("tiny experiment, 1 target + 2 drafters, 20 steps (after): " + ", ".join(
        f"rank {m['rank']} ({m['role']}) RSS {m['rss_mb']:.0f} MiB, peak {m['peak_rss_mb']:.0f} MiB" for m in rec["memory"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mid", action="store_true", help="also measure a random Qwen3 of hidden 512, 8 layers, vocab 32000")
    ap.add_argument("--split-run", action="store_true", help="also run the 1 + 2 layout and print every rank's RSS")
    args = ap.parse_args()
    from trainer.tiny import build_tiny, tiny_train_config

    root = Path(tempfile.mkdtemp(prefix="bench-drafter-memory-"))
    tiny = build_tiny(tiny_train_config(root).model.tiny_target, log=lambda m: None).target_dir
    measure("tiny experiment's target", tiny)
    if args.mid:
        measure("mid random Qwen3", build_mid(root))
    n = target_params(QWEN3_8B)
    gb = lambda p: p * 2 / 1e9  # noqa: E731 - bfloat16 bytes, in GB
    print(f"Qwen3-8B in bfloat16: whole target {n['whole'] / 1e9:.2f}B params = {gb(n['whole']):.1f} GB per drafter rank "
          f"before; embedding + LM head + norm {n['parts'] / 1e9:.3f}B params = {gb(n['parts']):.2f} GB after "
          f"(2 x 151936 x 4096 x 2 B); {gb(n['whole'] - n['parts']):.1f} GB less per drafter rank, "
          f"{3 * gb(n['whole'] - n['parts']):.1f} GB less over the 3 drafter GPUs of a 5 + 3 layout")
    if args.split_run:
        split_run(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
