"""Benchmark: loading a large inventory (parse, line index, validation) with libyaml against PyYAML's
pure-Python loader, both measured in this run on inventories made the same way.

    python bench/inventory_load.py [--mb 10] [--baseline-mb 1] [--repeats 3]

The inventory is dense (a container target per ~60 bytes, command experiments with GPU lists and env), the
worst shape per byte for a YAML composer. The pure-Python baseline is run on a smaller file (it takes about
20 s per MB) and compared per MB; both rates are printed. Goal: the `--mb 10` file in under 2 s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import yaml  # noqa: E402

from orchestrator import inventory  # noqa: E402


def dense_inventory(mb: float) -> str:
    """An inventory of about `mb` megabytes: 30% container targets, the rest command experiments."""
    out = ["hosts:", "  pve1: {ssh: pve1.example.lan, user: root}", "targets:", "  local: {kind: local}"]
    size = sum(len(line) + 1 for line in out)
    n = 0
    while size < mb * 1e6 * 0.3:
        line = f"  ct{n}: {{kind: container, host: pve1, ctid: {100 + n}, venv: cuda}}"
        out.append(line)
        size += len(line) + 1
        n += 1
    out += ["venvs:", "  cuda: {kind: uv, lock: cuda}", "experiments:"]
    i = 0
    while size < mb * 1e6:
        block = [f"  exp-{i}:", "    kind: command", f"    target: ct{i % n}",
                 "    command: [python3, -m, mytrainer, --config, configs/run.yaml, --seed, '1']",
                 "    gpus: [0, 1, 2, 3]", f"    env: {{RUN_NAME: 'exp {i}', B_VAR: 'two', C_VAR: '3'}}"]
        out += block
        size += sum(len(line) + 1 for line in block)
        i += 1
    return "\n".join(out) + "\n"


class _PurePython(yaml.SafeLoader):
    """The baseline: PyYAML's pure-Python reader, scanner, parser and composer."""


def best_of(text: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        inv = inventory.parse_inventory(text, "bench.yaml")
        times.append(time.perf_counter() - t0)
        assert inv.line_of("experiments", "exp-0") is not None
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--baseline-mb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    big = dense_inventory(args.mb)
    small = dense_inventory(args.baseline_mb)
    fast = best_of(big, args.repeats)
    fast_small = best_of(small, args.repeats)
    with mock.patch.object(inventory, "_Loader", _PurePython):
        slow_small = best_of(small, 1)
    big_mb, small_mb = len(big.encode()) / 1e6, len(small.encode()) / 1e6
    print(f"libyaml loader:     {big_mb:.1f} MB in {fast:.2f} s ({fast / big_mb:.3f} s/MB), "
          f"{small_mb:.1f} MB in {fast_small:.2f} s  [goal: 10 MB under 2 s]")
    print(f"pure-Python loader: {small_mb:.1f} MB in {slow_small:.2f} s ({slow_small / small_mb:.3f} s/MB)")
    print(f"ratio (pure-Python / libyaml, same {small_mb:.1f} MB file): {slow_small / fast_small:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
