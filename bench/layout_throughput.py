"""Tokens/s of the 1 target + 2 drafter process layout against the single-process layout, same run, CPU.

    python bench/layout_throughput.py [--steps 40] [--out DIR]

Both layouts train the tiny experiment's drafter (rows of 128 tokens, 8 rows per batch) through
`python -m trainer.launch`:
  - baseline: the colocated single-process layout (empty `layout`: trainer.train in one process), with
    torch's default threads and with OMP_NUM_THREADS=1;
  - split: 1 target + 2 drafter processes (gloo), features streamed target -> drafters, DDP.
Prints the median tokens/s of logged steps (after the first 3, which include start-up effects), the
split/baseline ratio, and the split run's target-side and drafter-side throughput and per-rank peak memory.
On a 2-core machine three processes share two cores, so the ratio shows the cost of the machinery there;
the layout exists for GPUs, where each process has its own device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.metrics import read_metrics  # noqa: E402
from trainer.tiny import tiny_train_config  # noqa: E402


def _config(out: Path, steps: int, layout: dict) -> dict:
    return tiny_train_config(
        out,
        max_steps=steps,
        log_every=1,
        save_every=10_000,
        model={
            "target": "tiny",
            "block_size": 8,
            "num_draft_layers": 2,
            "num_target_features": 3,
            "tiny_target": {"num_prompts": 200, "held_out": 8},
        },
        layout=layout,
    ).model_dump(mode="json")


def run(name: str, root: Path, steps: int, layout: dict, env: dict) -> list[dict]:
    cfg = _config(root / name, steps, layout)
    path = root / f"{name}.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "trainer.launch", "--config", str(path)], env=env, cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [r for r in read_metrics(root / name / "metrics.jsonl") if r["kind"] == "train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="layout-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DFLASH_TINY_CACHE=str(root / "tiny-cache"), PYTHONPATH=str(REPO))
    base = run("colocated", root, args.steps, {}, env)
    # torch's default intra-op threads spin on a busy 2-core box; the split ranks get 1 thread each.
    base1 = run("colocated-1thread", root, args.steps, {}, dict(env, OMP_NUM_THREADS="1"))
    split = run("split-1t-2d", root, args.steps, {"num_target_procs": 1, "num_drafter_procs": 2}, env)

    def med(rows, key):
        vals = [r[key] for r in rows[3:] if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else float("nan")

    b, s = med(base, "tokens_per_s"), med(split, "tokens_per_s")
    print(f"cores: {os.cpu_count()}  steps: {args.steps}  runs in {root}")
    print(f"colocated (1 process)     : {b:9.0f} tok/s   (tokens per step {base[-1]['tokens']})")
    print(f"1 target + 2 drafters     : {s:9.0f} tok/s   (tokens per step {split[-1]['tokens']}, 2 batches)")
    b1 = med(base1, "tokens_per_s")
    print(f"colocated, 1 thread       : {b1:9.0f} tok/s")
    print(f"ratio split / colocated   : {s / b:9.2f}   (vs 1 thread: {s / b1:.2f})")
    print(f"split target side         : {med(split, 'target_tokens_per_s'):9.0f} tok/s of target compute")
    print(f"split drafter side        : {med(split, 'drafter_tokens_per_s'):9.0f} tok/s of drafter compute")
    print(f"split feature wait / step : {med(split, 'feature_wait_s'):9.3f} s per drafter")
    for m in split[-1]["memory"]:
        print(f"  rank {m['rank']} {m['role']:8s} peak {m['peak_mb']:7.0f} MiB")


if __name__ == "__main__":
    main()
