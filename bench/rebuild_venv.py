"""Benchmark a warm rebuild-venv against doing it by hand, in the same place, in the same run.

    python bench/rebuild_venv.py [--where container|local] [--repeat 3] [--noop-repeat 10]

Both sides start from a warm uv cache (a first, untimed rebuild-venv fills it, brings uv into the container
and records the verified wheels):
  by hand   `uv venv D && uv pip sync --require-hashes ... cpu.txt && D/bin/python -c "import torch,
            transformers, accelerate"`: the least anyone would do to get a venv they trust (one command on
            the target)
  rebuild   rebuild_venv(force=True): the same plus the bundle wheel, the driver checks, the import check of
            every top-level module (parallel workers; distributions verified before in this workdir skipped),
            the fingerprint, the atomic switch and the prune (one command on the target)
  unrecorded  once more, the verified-wheels record deleted first: every module imported again
  no-op     rebuild_venv() when current already matches: wall time and the number of pct calls
Prints medians and the ratio rebuild / by hand (goal: <= 1.3x). `container` runs in a stock Debian 12
container of the fake Proxmox host (tests/fakehost: real sshd, pct stand-in, its own root file system; needs
root), `local` in a LocalTarget.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from orchestrator.ops.carry import workstation_uv  # noqa: E402
from orchestrator.ops.lock import resolve_lock  # noqa: E402
from orchestrator.ops.venv import rebuild_venv  # noqa: E402
from orchestrator.target import ContainerTarget, LocalTarget  # noqa: E402
from orchestrator.transport.local import LocalTransport  # noqa: E402

TORCH_WHEELS = "/opt/wheels"
HAND_CHECK = "import torch, transformers, accelerate"
# One command: a venv, the lock synced into it (same cache, same options as rebuild-venv), the hand check.
BY_HAND = ('set -e; export UV_CACHE_DIR="$2" UV_NATIVE_TLS=1; uv=$1 d=$3; shift 3; '
           '"$uv" venv -q --python-preference only-system --python 3.11 "$d"; '
           '"$uv" pip sync -q --python "$d/bin/python" --require-hashes "$@"; '
           f'"$d/bin/python" -c "{HAND_CHECK}"')


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def open_target(where: str, tmp: Path):
    """(target, host or None, the uv the target runs, the uv cache, the wheel store) for `where`."""
    if where == "container":
        from fakehost import STOCK_TMUX, FakePVE

        host = FakePVE().start()
        ct = host.create_container(390, gpus=0, image=STOCK_TMUX)
        target = ContainerTarget(name="ct390", workdir=ct.workdir, transport=host.pct_transport(ct.ctid))
        cache = str(host.storage() / "uv-cache")
        # The carried uv, and the wheels rebuild-venv keeps beside the cache (what the container has).
        return target, host, f"{ct.workdir}/bin/uv", cache, str(host.storage() / "dflashctl-wheels")
    wd = Path(tempfile.mkdtemp(prefix="dflash-bench-venv-", dir="/var/tmp"))
    target = LocalTarget(name="local", workdir=str(wd), transport=LocalTransport())
    cache = os.environ.get("DFLASHCTL_TEST_UV_CACHE", "/var/tmp/dflashctl-test-uv-cache")
    return target, None, workstation_uv().path, cache, TORCH_WHEELS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--where", choices=["container", "local"], default="container" if os.geteuid() == 0 else "local")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--noop-repeat", type=int, default=10)
    args = ap.parse_args()

    os.environ["DFLASHCTL_STATE_DIR"] = tempfile.mkdtemp(prefix="dflash-bench-state-", dir="/var/tmp")
    lock = resolve_lock("cpu")
    target, host, uv, cache, wheels = open_target(args.where, Path("/var/tmp"))
    profile = {"kind": "uv", "lock": "cpu", "python": "3.11", "wheelhouse": [TORCH_WHEELS], "uv_cache_dir": cache,
               "keep": 2}
    workdir = Path(target.workdir)
    try:
        t = time.monotonic()
        first = rebuild_venv(target, profile)
        print(f"warm-up build ({args.where}): {time.monotonic() - t:.1f}s, venv {first.venv}, brought {first.carried}")
        # The lock travels to the target the way rebuild-venv sends it; by hand, it is simply there.
        lock_in_target = workdir / "bench-lock.txt"
        lock_in_target.write_bytes(lock.data)

        hand, full, verify = [], [], []
        for i in range(args.repeat):
            d = workdir / "venvs" / f"by-hand-{i}"
            t = time.monotonic()
            res = target.run(["bash", "-c", BY_HAND, "by-hand", uv, cache, str(d), "--find-links", wheels,
                              str(lock_in_target)])
            hand.append(time.monotonic() - t)
            if res.exit_code != 0:
                print(res.describe())
                return 1
            shutil.rmtree(d, ignore_errors=True)

            t = time.monotonic()
            rep = rebuild_venv(target, profile, force=True)
            full.append(time.monotonic() - t)
            verify.append(rep.timings_ms.get("verify", 0) / 1000)
            print(f"  run {i}: by hand {hand[-1]:.2f}s  rebuild {full[-1]:.2f}s  (verify {verify[-1]:.2f}s; steps "
                  f"{rep.timings_ms})")

        # The same rebuild without the verified-wheels record: every top-level module imported (in workers).
        (workdir / "venvs" / ".verified-wheels.json").unlink()
        t = time.monotonic()
        rep = rebuild_venv(target, profile, force=True)
        unrecorded, unrecorded_verify = time.monotonic() - t, rep.timings_ms.get("verify", 0) / 1000

        noop, calls = [], []
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
        print(f"by hand: uv venv && uv pip sync && python -c '{HAND_CHECK}'   median {median(hand):.2f}s")
        print(f"warm rebuild-venv --force                                            median {median(full):.2f}s"
              f"   ratio {median(full) / median(hand):.2f}x (goal <= 1.3x)")
        print(f"  of which the import check (verify)                                 median {median(verify):.2f}s")
        print(f"rebuild-venv --force with no verified-wheels record (imports all)   once   {unrecorded:.2f}s   "
              f"ratio {unrecorded / median(hand):.2f}x (verify {unrecorded_verify:.2f}s)")
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
