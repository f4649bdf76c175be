"""Benchmark rebuild-venv against a bare `uv venv && uv pip sync` of the same lock, in the same place, same run.

    python bench/rebuild_venv.py [--where container|local] [--repeat 3] [--noop-repeat 10]

Measures, on a warm uv cache (warmed by a first, untimed build):
  bare     `uv venv D && uv pip sync --require-hashes ... cpu.txt` (one command on the target)
  full     rebuild_venv(force=True): the same plus the bundle wheel, import verification of every top-level
           module, fingerprint, atomic switch, prune (one command on the target)
  no-op    rebuild_venv() when current already matches: wall time and the number of pct calls
Prints medians and the ratios full/bare and (full minus verify)/bare. `container` runs in a container of
the fake Proxmox host (tests/fakehost: real sshd, pct stand-in; needs root), `local` in a LocalTarget.
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from orchestrator.ops.lock import resolve_lock  # noqa: E402
from orchestrator.ops.venv import rebuild_venv  # noqa: E402
from orchestrator.target import ContainerTarget, LocalTarget  # noqa: E402
from orchestrator.transport.local import LocalTransport  # noqa: E402

TORCH_WHEELS = "/opt/wheels"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--where", choices=["container", "local"], default="container" if os.geteuid() == 0 else "local")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--noop-repeat", type=int, default=10)
    ap.add_argument("--cache", default=os.environ.get("DFLASHCTL_TEST_UV_CACHE", "/var/tmp/dflashctl-test-uv-cache"))
    args = ap.parse_args()

    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    lock = resolve_lock("cpu")
    profile = {"kind": "uv", "lock": "cpu", "python": "3.11", "find_links": [TORCH_WHEELS], "uv_cache_dir": args.cache,
               "keep": 2}
    host = None
    if args.where == "container":
        from fakehost import FakePVE

        host = FakePVE().start()
        ct = host.create_container(390, gpus=0)
        os.symlink(os.path.realpath(uv), Path(ct.dir) / "sbin" / "uv")  # uv "installed" in the container
        target = ContainerTarget(name="ct390", workdir=ct.workdir, transport=host.pct_transport(ct.ctid),
                                 home=str(Path(ct.dir) / "home"))
        uv_in_target = "uv"
    else:
        wd = Path(tempfile.mkdtemp(prefix="dflash-bench-venv-", dir="/var/tmp"))
        target = LocalTarget(name="local", workdir=str(wd), transport=LocalTransport())
        uv_in_target = uv
    workdir = Path(target.workdir)
    try:
        t = time.monotonic()
        first = rebuild_venv(target, profile, offline=False)
        print(f"warm-up build ({args.where}): {time.monotonic() - t:.1f}s, venv {first.venv}")

        bare, full, full_build = [], [], []
        for i in range(args.repeat):
            d = workdir / "venvs" / f"bare-{i}"
            # Same place, same cache, same lock, same options: the floor any rebuild pays.
            script = (f'export UV_CACHE_DIR="$1" UV_NATIVE_TLS=1; {uv_in_target} venv -q --python 3.11 "$2" && '
                      f'{uv_in_target} pip sync -q --python "$2/bin/python" --require-hashes --find-links "$3" "$4"')
            t = time.monotonic()
            res = target.run(["bash", "-c", script, "bare", args.cache, str(d), TORCH_WHEELS, str(lock.path)])
            bare.append(time.monotonic() - t)
            if res.exit_code != 0:
                print(res.describe())
                return 1
            shutil.rmtree(d, ignore_errors=True)

            t = time.monotonic()
            rep = rebuild_venv(target, profile, force=True)
            full.append(time.monotonic() - t)
            verify_s = rep.timings_ms.get("verify", 0) / 1000
            full_build.append(full[-1] - verify_s)
            print(f"  run {i}: bare {bare[-1]:.2f}s  full {full[-1]:.2f}s  (verify {verify_s:.2f}s; steps "
                  f"{rep.timings_ms})")

        noop = []
        calls = []
        for _ in range(args.noop_repeat):
            if host:
                host.clear_pct_calls()
            t = time.monotonic()
            rep = rebuild_venv(target, profile)
            noop.append(time.monotonic() - t)
            assert rep.action == "noop", rep
            if host:
                calls.append(len(host.pct_calls()))
        print()
        print(f"bare uv venv && uv pip sync   median {median(bare):.2f}s")
        print(f"full rebuild-venv (--force)   median {median(full):.2f}s   ratio full/bare {median(full) / median(bare):.2f}x")
        print(f"  without the verify step     median {median(full_build):.2f}s   ratio {median(full_build) / median(bare):.2f}x"
              " (goal 1.2x)")
        print(f"no-op rebuild-venv            median {median(noop) * 1000:.0f} ms  max {max(noop) * 1000:.0f} ms"
              + (f"  pct calls per no-op: {sorted(set(calls))}" if host else ""))
        return 0
    finally:
        target.close()
        if host:
            host.close(remove=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
