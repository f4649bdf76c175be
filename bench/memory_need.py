"""The preflight's memory estimate (orchestrator.agent.preflight.estimate_memory_need) against a measured run:
the tiny 1 target + 2 drafter CPU run of tests/trainer in a cgroup v1 memory cgroup of its own (root), its peak
(memory.max_usage_in_bytes, page cache included) and its processes' peak RSS (VmHWM, polled). Prints the
estimate, the measurements and their ratio.

    sudo python bench/memory_need.py [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.agent import runprocs  # noqa: E402
from orchestrator.agent.preflight import _dims, estimate_memory_need  # noqa: E402
from tests.trainer.test_trainer_launch import SPLIT, small_config  # noqa: E402

MEMCG = Path("/sys/fs/cgroup/memory")


def hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="memneed-"))
    run_dir = tmp / "run"
    cfg = small_config(run_dir, SPLIT, max_steps=args.steps)
    (tmp / "c.json").write_text(json.dumps(cfg))
    est = estimate_memory_need(cfg, _dims(cfg, str(tmp)))
    cg = MEMCG / f"memneed-{os.getpid()}"
    cg.mkdir()
    env = dict(os.environ, DFLASH_TINY_CACHE=os.environ.get("DFLASH_TINY_CACHE", str(tmp / "cache")),
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DFLASHCTL_RUN_DIR=str(run_dir))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "trainer.launch", "--config", str(tmp / "c.json")], env=env,
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: (cg / "cgroup.procs").write_text(str(os.getpid())))
        peaks: dict[int, tuple[str, int]] = {}
        while proc.poll() is None:
            for p in runprocs.run_processes(run_dir):
                peaks[p.pid] = (p.argv.split(" -m ")[-1].split()[0], max(hwm(p.pid), peaks.get(p.pid, ("", 0))[1]))
            time.sleep(0.2)
        peak = int((cg / "memory.max_usage_in_bytes").read_text())
    finally:
        for _ in range(50):
            if not (cg / "cgroup.procs").read_text().strip():
                break
            time.sleep(0.1)
        cg.rmdir()
    rss = sum(v for _, v in peaks.values())
    print(f"exit code {proc.returncode}; processes: " + ", ".join(f"{n} {v >> 20} MiB" for n, v in peaks.values()))
    print(f"estimate {est['total_bytes'] >> 20} MiB: " + ", ".join(f"{k} {v >> 20}" for k, v in est["parts"].items()))
    print(f"measured cgroup peak {peak >> 20} MiB (page cache included), sum of peak RSS {rss >> 20} MiB")
    print(f"estimate / cgroup peak = {est['total_bytes'] / peak:.2f}; estimate / sum of peak RSS = "
          f"{est['total_bytes'] / max(rss, 1):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
