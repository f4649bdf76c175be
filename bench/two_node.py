"""Tokens/s of a 1 target + 2 drafter layout across two nodes against the same layout on one node, same run, CPU.

    python bench/two_node.py [--steps 40] [--out DIR]

Both train the tiny experiment's drafter through `python -m trainer.launch` (torch's elastic agent, gloo):
  - one node: one agent starting all three ranks (the baseline);
  - two nodes: node 0 (the target rank, hosting the c10d rendezvous) and node 1 (the two drafter ranks), two
    agents joined over TCP on 127.0.0.1, each node with its own run directory as two containers have.
Prints the median tokens/s of logged steps (after the first 3, which include start-up), the two-node/one-node
ratio, each run's wall time, and the feature wait per step. On one machine the "network" is loopback, so the
ratio shows the cost of the machinery across nodes (a second agent, the rendezvous, samples broadcast, the
final handshake), not of a real link; docs/scaling.md has the link arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.metrics import read_metrics  # noqa: E402
from trainer.tiny import tiny_train_config  # noqa: E402


def _config(out: Path, steps: int, layout: dict) -> dict:
    return tiny_train_config(
        out, max_steps=steps, log_every=1, save_every=10_000,
        model={"target": "tiny", "block_size": 8, "num_draft_layers": 2, "num_target_features": 3,
               "tiny_target": {"num_prompts": 200, "held_out": 8}},
        evaluation={"budgets": [], "temperatures": [0.0]},
        layout=layout,
    ).model_dump(mode="json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(name: str, root: Path, steps: int, layout: dict, env: dict) -> tuple[list[dict], float]:
    """Start one agent per node of `layout` (one when it has no nodes); return the train rows of the node
    that logs them (the main drafter's) and the wall time until every agent ended."""
    count = len(layout.get("nodes") or [None])
    procs, dirs = [], []
    t0 = time.monotonic()
    for i in range(count):
        out = root / name / f"node{i}" / "run"  # the same directory name on every node: it is the rendezvous id
        path = root / f"{name}-node{i}.json"
        path.write_text(json.dumps(_config(out, steps, layout)))
        log = open(root / f"{name}-node{i}.log", "w")
        argv = [sys.executable, "-m", "trainer.launch", "--config", str(path)] + (["--node", str(i)] if count > 1 else [])
        procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        dirs.append(out)
    codes = [p.wait() for p in procs]
    wall = time.monotonic() - t0
    if any(codes):
        sys.exit(f"{name} failed ({codes}); logs in {root}")
    saver = next(d for d in dirs if (d / "metrics.jsonl").exists())
    return [r for r in read_metrics(saver / "metrics.jsonl") if r["kind"] == "train"], wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="two-node-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DFLASH_TINY_CACHE=str(root / "tiny-cache"), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    one, wall1 = run_nodes("one-node", root, args.steps, {"num_target_procs": 1, "num_drafter_procs": 2}, env)
    two_layout = {"nodes": [{"num_target_procs": 1, "name": "node0", "addr": "127.0.0.1"},
                            {"num_drafter_procs": 2, "name": "node1", "addr": "127.0.0.2"}],
                  "rendezvous": f"127.0.0.1:{_free_port()}"}
    two, wall2 = run_nodes("two-nodes", root, args.steps, two_layout, env)

    def med(rows, key):
        vals = [r[key] for r in rows[3:] if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else float("nan")

    a, b = med(one, "tokens_per_s"), med(two, "tokens_per_s")
    print(f"cores: {os.cpu_count()}  steps: {args.steps}  runs in {root}")
    print(f"one node  (1 agent, 3 ranks)        : {a:9.0f} tok/s   wall {wall1:6.1f} s   "
          f"feature wait {med(one, 'feature_wait_s'):.3f} s/step")
    print(f"two nodes (target | 2 drafters)     : {b:9.0f} tok/s   wall {wall2:6.1f} s   "
          f"feature wait {med(two, 'feature_wait_s'):.3f} s/step")
    print(f"ratio two nodes / one node          : {b / a:9.2f}   (wall time {wall2 / wall1:.2f})")
    print(f"same losses: {[round(r['loss'], 5) for r in one] == [round(r['loss'], 5) for r in two]}")


if __name__ == "__main__":
    main()
