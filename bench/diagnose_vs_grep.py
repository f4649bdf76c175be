"""diagnose vs `grep -E -f` over the same log, measured in the same run.

Generates a log of --size-mb (default 1024) of healthy training lines with a few real crash fixtures
spread through it, writes the catalogue's patterns converted to POSIX ERE into patterns.txt, then times
`grep -E -c -f patterns.txt LOG` and `orchestrator.ops.diagnose.diagnose(LOG)` (best of --repeat) and
prints both and the ratio of diagnose's speed to grep's (goal: >= 0.33).

    python bench/diagnose_vs_grep.py [--size-mb 1024] [--repeat 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.ops.diagnose import diagnose  # noqa: E402
from orchestrator.signatures import load_catalogue  # noqa: E402


def to_ere(pattern: str) -> str:
    """Python regex (the catalogue's grep-compatible subset) -> POSIX ERE for GNU grep."""
    out = re.sub(r"\(\?P<\w+>", "(", pattern)
    out = out.replace("(?:", "(").replace(r"\d", "[0-9]").replace(r"\s", "[[:space:]]")
    return out


def make_log(path: Path, size: int, seed: int = 0) -> int:
    rnd = random.Random(seed)
    fixtures = sorted((ROOT / "tests" / "fixtures" / "signatures").glob("*.log"))
    # A pool of healthy lines, reused so generation is I/O bound rather than formatting bound.
    pool = []
    for step in range(20000):
        pool.append(
            f"step {step}/200000 ep {step // 5000} loss {rnd.uniform(0.8, 4):.4f} acc {rnd.random():.3f} sim_tau "
            f"{rnd.uniform(1, 6):.2f} {rnd.uniform(18000, 21000):.0f} tok/s lr 3.00e-04 rss {rnd.uniform(9000, 9100):.0f}MB\n")
        if step % 50 == 0:
            pool.append("2025-06-11 10:00:02,001 INFO trainer.checkpoint: saved checkpoint step-1000 (1.21 GiB) in 3.2 s\n")
            pool.append("/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py:617: UserWarning: This DataLoader will create 8 worker processes in total.\n")
    block = "".join(pool).encode()
    crashes = 0
    written = 0
    with open(path, "wb") as fh:
        while written < size:
            fh.write(block)
            written += len(block)
            if rnd.random() < 0.05:
                data = rnd.choice(fixtures).read_bytes()
                fh.write(data)
                written += len(data)
                crashes += 1
    return crashes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--keep", help="directory for the log and patterns (default: a temp dir, removed)")
    args = ap.parse_args()
    if not shutil.which("grep"):
        sys.exit("grep not found")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        log, pats = work / "train.log", work / "patterns.txt"
        catalogue = load_catalogue()
        pats.write_text("".join(to_ere(p) + "\n" for s in catalogue for p in s.patterns))
        if not log.exists() or log.stat().st_size < args.size_mb << 20:
            t = time.perf_counter()
            crashes = make_log(log, args.size_mb << 20)
            print(f"generated {log.stat().st_size / 2**20:.0f} MiB with {crashes} crash fixtures in {time.perf_counter() - t:.1f} s")
        size = log.stat().st_size
        subprocess.run(["cat", str(log)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache for both

        grep_s, grep_hits = float("inf"), 0
        for _ in range(args.repeat):
            t = time.perf_counter()
            r = subprocess.run(["grep", "-E", "-c", "-f", str(pats), str(log)], capture_output=True, text=True)
            grep_s = min(grep_s, time.perf_counter() - t)
            if r.returncode not in (0, 1):
                sys.exit(f"grep failed: {r.stderr}")
            grep_hits = int(r.stdout.strip() or 0)
        diag_s, report = float("inf"), None
        for _ in range(args.repeat):
            t = time.perf_counter()
            report = diagnose(log, catalogue)
            diag_s = min(diag_s, time.perf_counter() - t)

        mib = size / 2**20
        print(f"log: {mib:.0f} MiB, {report.lines} lines; grep matching lines: {grep_hits}; "
              f"diagnose events: {sum(s.count for s in report.signatures)} in {len(report.signatures)} signatures")
        print(f"grep -E -f : {grep_s:7.2f} s  {mib / grep_s:7.0f} MiB/s")
        print(f"diagnose   : {diag_s:7.2f} s  {mib / diag_s:7.0f} MiB/s")
        ratio = grep_s / diag_s
        print(f"ratio (diagnose speed / grep speed): {ratio:.2f}  (goal >= 0.33: {'met' if ratio >= 0.33 else 'NOT met'})")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
