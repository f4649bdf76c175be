"""Benchmark: `doctor` on a container of the fake Proxmox host.

Prints the pct calls per doctor run (from the stand-in's log; goal: ONE `pct exec` per container) and the
wall time of `doctor` against the same checks done the hand-typed way (one `ssh HOST pct ...` per check,
with the real OpenSSH client), both measured in this run with the same per-call pct delay.

    python bench/doctor.py [--repeats 5] [--pct-delay 0.3]

Needs root, sshd, unshare/nsenter (as the tests do).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import yaml  # noqa: E402

from fakehost import FakePVE  # noqa: E402
from orchestrator.inventory import load_inventory  # noqa: E402
from orchestrator.ops.doctor import doctor  # noqa: E402


def baseline(pve, ctid: int, workdir: str) -> None:
    """The checks as separate commands, as one would type them."""
    inside = [
        ["python3", "-V"],
        ["tmux", "-V"],
        ["sh", "-c", "command -v uv || ls ~/.local/bin/uv"],
        ["nvidia-smi", "--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"],
        ["df", "-B1", workdir],
        ["test", "-w", workdir],
        ["mkdir", "-p", workdir + "/inductor-cache"],
    ]
    for argv in (["pct", "status", str(ctid)], ["pct", "config", str(ctid)],
                 *[["pct", "exec", str(ctid), "--", *a] for a in inside]):
        subprocess.run(pve.ssh_argv(*argv), capture_output=True, timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pct-delay", type=float, default=0.3, help="seconds each pct call sleeps (Perl start-up)")
    args = ap.parse_args()
    with FakePVE() as pve:
        ct = pve.create_container(200, gpus=8)
        inv_path = pve.base / "inv.yaml"
        inv_path.write_text(yaml.safe_dump({
            "hosts": {"pve": pve.host_entry()},
            "targets": {"ct200": {"kind": "container", "host": "pve", "ctid": 200, "workdir": ct.workdir, "venv": "cpu"}},
            "venvs": {"cpu": {"kind": "uv", "lock": "cpu"}},
        }))
        inv = load_inventory(inv_path)
        pve.set_delay(args.pct_delay)
        pve.clear_pct_calls()
        doctor(inv, "ct200")  # first contact: copies the bundle in
        first = pve.pct_calls()

        ours, theirs, execs, calls = [], [], [], []
        for _ in range(args.repeats):
            pve.clear_pct_calls()
            t = time.monotonic()
            rep = doctor(inv, "ct200")
            ours.append(time.monotonic() - t)
            execs.append(len(pve.pct_exec_calls(200)))
            calls.append(len(pve.pct_calls()))
            t = time.monotonic()
            baseline(pve, 200, ct.workdir)
            theirs.append(time.monotonic() - t)
        failed = [c.name for c in rep.checks if c.status == "fail"]
        print(f"pct delay per call: {args.pct_delay:.3f} s, repeats: {args.repeats}")
        print(f"first doctor run (bundle copied in): {len(first)} pct calls, "
              f"{sum(1 for c in first if c[1] == 'exec')} pct exec")
        print(f"doctor: pct exec per run = {statistics.median(execs):.0f}, pct calls per run = {statistics.median(calls):.0f}"
              f" (failed checks in the fake container: {failed or 'none'})")
        print(f"doctor wall time median:   {statistics.median(ours):.3f} s")
        print(f"separate ssh+pct calls:    {statistics.median(theirs):.3f} s (9 calls)")
        print(f"ratio doctor / separate:   {statistics.median(ours) / statistics.median(theirs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
