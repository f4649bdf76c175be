"""Steps/s of the colocated tiny experiment with the drafter forward compiled (compile.enabled) against eager.

    python bench/compile_speedup.py [--steps 60] [--rounds 2] [--threads N]

Runs the real loop (`python -m trainer train`, the colocated layout: the path that used to ignore
compile.enabled) on the `tiny` experiment's config, eager and compiled alternately, each in a fresh process
with a fresh inductor cache (so a compiled run pays its compile in its first steps, which are left out), for
--rounds rounds. Prints the median seconds per step of each run after its first 10 steps, steps/s, and the
compiled/eager speed-up per round and overall (medians over rounds). The runs alternate so that a change in
the load of a shared machine hits both sides.
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

SKIP = 10
"""First steps left out of each run (a compiled run compiles in its first step)."""


def one_run(root: Path, name: str, steps: int, compiled: bool, env: dict) -> float:
    """Median seconds per step after the first SKIP steps."""
    out = root / name
    cfg = tiny_train_config(out, max_steps=steps, log_every=1, save_every=10**6,
                            compile={"enabled": compiled, "cache_dir": str(root / f"{name}-inductor")},
                            evaluation={"budgets": [], "temperatures": [0.0]})  # τ is not what is timed here
    path = root / f"{name}.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(path)], env=env, cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    if compiled and "compiled forward True" not in proc.stdout:
        sys.exit(f"{name}: the loop did not compile the drafter forward")
    recs = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"][SKIP:]
    if any(r["recompiles"] for r in recs):
        sys.exit(f"{name}: recompiled during training")
    return statistics.median(r["tokens"] / r["tokens_per_s"] for r in recs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the runs (default: torch's)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    ratios = []
    for r in range(args.rounds):
        eager = one_run(root, f"eager{r}", args.steps, False, env)
        comp = one_run(root, f"compiled{r}", args.steps, True, env)
        ratios.append(eager / comp)
        print(f"round {r}: eager {eager * 1e3:.1f} ms/step ({1 / eager:.2f} steps/s), compiled {comp * 1e3:.1f} ms/step "
              f"({1 / comp:.2f} steps/s): compiled/eager speed {eager / comp:.2f}x", flush=True)
    print(f"tiny experiment, colocated loop, {args.steps} steps per run (first {SKIP} left out), {args.rounds} rounds: "
          f"compiled drafter forward {statistics.median(ratios):.2f}x the steps/s of eager (median of rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
