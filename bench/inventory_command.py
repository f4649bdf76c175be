"""Benchmark: a user's command on a large inventory, the console script in a process of its own, as it was and now.

    python3 bench/inventory_command.py [--mb 10] [--repeats 3]

bench/inventory_load.py times the load alone (orchestrator.inventory.parse_inventory). A command that reaches a
container (launch, status, warmup) also reads the inventory before it loads it: its early connection
(orchestrator.preconnect) finds the container's host in the raw YAML, before typer and pydantic are imported.
Until 2026-12-07 that read was PyYAML's CSafeLoader over the whole text (its Python constructor for every
node), and the load then parsed the text again. Now the early read is the load's own first pass, and the load
takes its data (yamlload's `lend`).

Each round runs `dflashctl --inventory BIG launch exp-5 --dry-run` (`python -c` running orchestrator.entry, the
console script's function, so no launcher script's start is counted), three ways: with the early read as it
was (the same code but _host_key's read, patched in the child), now with nothing in the cache (a user's first
command after editing the file), and now again (its data from the cache). The inventory is bench/inventory_load.py's
dense one, its host at 127.0.0.1 port 9, where the connection is refused at once: the command ends at its first
connection, after all the reading, with exit code 1. The state dir is one of the bench's own and keeps the
command line's grammar (cli-grammar.json) across the runs, as a user's does.

Measured (2 shared CPUs; 10.0 MB, best of 3, wall seconds):

    2026-12-07, load 1.1   before 17.20 s   now, first 2.38 s (7.2x)   now, cached 0.87 s (19.8x)
    2026-12-07, load 1.0   before 16.17 s   now, first 2.01 s (8.1x)   now, cached 0.78 s (20.8x)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from inventory_load import dense_inventory  # noqa: E402

from orchestrator.inventory_file import CACHE_DIR  # noqa: E402

_RUN = "import sys; from orchestrator import entry; sys.argv[0] = 'dflashctl'; entry.run()"

# The early read as it was until this bench's commit: the whole text through PyYAML's CSafeLoader, the load
# then parsing it again. Only the read differs; what _host_key does with the data is today's.
_BEFORE = """
import yaml
from orchestrator import preconnect
today = preconnect._host_key
def as_it_was(inventory, target, experiment):
    raw = yaml.load(preconnect.read_inventory(inventory)[0], Loader=yaml.CSafeLoader)
    from orchestrator import yamlload
    real = yamlload.load_plain
    yamlload.load_plain = lambda *a, **k: raw  # what _host_key reads: the data just made, not lent on
    try:
        return today(inventory, target, experiment)
    finally:
        yamlload.load_plain = real
preconnect._host_key = as_it_was
"""


def command(inventory: Path, state: Path, before: bool) -> float:
    """Wall seconds of one command (exit code 1: the refused connection, after all the reading)."""
    env = {**os.environ, "DFLASHCTL_STATE_DIR": str(state), "PYTHONPATH": str(ROOT)}
    code = (_BEFORE if before else "") + _RUN
    argv = [sys.executable, "-c", code, "--inventory", str(inventory), "launch", "exp-5", "--dry-run"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if done.returncode != 1 or "127.0.0.1" not in done.stderr + done.stdout:
        raise SystemExit(f"the command did not end at its connection (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    text = dense_inventory(args.mb).replace("pve1: {ssh: pve1.example.lan, user: root}",
                                            "pve1: {ssh: 127.0.0.1, port: 9, user: root}")
    runs: dict[str, list[float]] = {"before": [], "first": [], "cached": []}
    with tempfile.TemporaryDirectory() as tmp:
        inventory, state = Path(tmp) / "inventory.yaml", Path(tmp) / "state"
        inventory.write_text(text)
        command(inventory, state, before=False)  # the grammar kept, the cache entry written
        for _ in range(args.repeats):  # alternated, so a busy neighbour slows all three alike
            shutil.rmtree(state / CACHE_DIR, ignore_errors=True)
            runs["before"].append(command(inventory, state, before=True))
            shutil.rmtree(state / CACHE_DIR, ignore_errors=True)
            runs["first"].append(command(inventory, state, before=False))
            runs["cached"].append(command(inventory, state, before=False))
    old, first, cached = (min(runs[k]) for k in ("before", "first", "cached"))
    print(f"launch --dry-run on a {len(text.encode()) / 1e6:.1f} MB inventory, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs, best of {args.repeats}, wall seconds:")
    print(f"  before (the early read of 5295ba7: PyYAML's CSafeLoader, then the load):  {old:5.2f} s")
    print(f"  now, the first command (nothing in the cache):                          {first:5.2f} s  "
          f"{old / first:.1f}x faster")
    print(f"  now, the next command (the data from the cache):                        {cached:5.2f} s  "
          f"{old / cached:.1f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
