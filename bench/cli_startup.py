"""Start-up of the `dflashctl` console script: `--help` and a verb's `--help`, against the bare interpreter
(`python -c pass` with the same site-packages), all measured in the same run.

    python bench/cli_startup.py [--repeats 10]

Goal: `dflashctl --help` <= 0.2 s of CPU time (user + system; wall time grows with the load average). The
difference to the bare interpreter is what this project's imports cost; `python -X importtime` on the same
command names them (printed: the five largest).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def console_script() -> list[str]:
    """The installed `dflashctl` entry point, run by this interpreter (a pyenv shim's own start-up is not ours)."""
    beside = Path(sys.executable).parent / "dflashctl"
    exe = str(beside) if beside.is_file() else shutil.which("dflashctl")
    if exe is None:
        raise SystemExit("the dflashctl console script is not installed: pip install -e .")
    return [sys.executable, exe]


def timed(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds user + system) of one run: CPU time is the process's own work, which a
    loaded machine does not inflate the way it inflates wall time."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=60)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def largest_imports(argv: list[str], env: dict, n: int = 5) -> list[tuple[int, str]]:
    """The n largest cumulative import times (microseconds, module) of one run under -X importtime."""
    res = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], env=env, capture_output=True, text=True, timeout=60)
    rows = []
    for line in res.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    return sorted(rows, reverse=True)[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    # Bytecode as an installed dflashctl has it (pip compiles a wheel's modules), in a temp dir, even where the
    # environment says PYTHONDONTWRITEBYTECODE: otherwise every timed run compiles the project from source.
    pycache = tempfile.mkdtemp(prefix="dflashctl-bench-pycache-")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               PYTHONPYCACHEPREFIX=pycache)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cases = {"python -c pass": [sys.executable, "-c", "pass"],
             "dflashctl --help": [*console_script(), "--help"],
             "dflashctl launch --help": [*console_script(), "launch", "--help"]}
    for argv in cases.values():  # bytecode caches written before timing
        timed(argv, env)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    for _ in range(args.repeats):
        for name, argv in cases.items():
            times[name].append(timed(argv, env))
    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    base = med["python -c pass"]
    print(f"{args.repeats} runs each (median wall time; CPU time user + system); load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for name, t in med.items():
        extra = "" if name == "python -c pass" else f"   (+{t - base:.3f} s over the bare interpreter)"
        print(f"  {name:<24}: {t:.3f} s, CPU {cpu[name]:.3f} s{extra}")
    print(f"  dflashctl --help: CPU {cpu['dflashctl --help']:.3f} s (goal <= 0.2 s), wall {med['dflashctl --help']:.3f} s")
    print("  largest imports of `dflashctl --help` (cumulative):")
    for us, mod in largest_imports(cases["dflashctl --help"], env):
        print(f"    {us / 1e3:7.1f} ms {mod.strip()}")
    shutil.rmtree(pycache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
