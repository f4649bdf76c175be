"""How much does one agent call through SSH + pct cost, against the floor of a bare `ssh HOST pct exec CT
-- true`? Both are measured in the same run against the fake Proxmox host (real sshd, pct stand-in).

    python bench/agent_ping.py [--repeats 15] [--pct-delay 0.0]

Prints the median wall time of:
  bare      `ssh -o BatchMode=yes ... root@127.0.0.1 pct exec 200 -- true` (OpenSSH client, new connection
            each time, as a person would type it)
  echo      ContainerTarget.agent("echo") over one SSHTransport (connection kept, as in one dflashctl run)
  ping      ContainerTarget.agent("ping") (python, tmux, uv, GPUs, disk)
  first     the first agent call of a fresh SSHTransport (connect + auth + agent echo)
and the ratios to `bare`, plus the pct calls per agent call counted in the stand-in's log. `--pct-delay`
adds a sleep to every pct call to model real pct's Perl start-up (both sides pay it once per call).
Needs root (the fake host uses namespaces).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fakehost import FakePVE  # noqa: E402

from orchestrator.target import ContainerTarget  # noqa: E402
from orchestrator.transport.pct import PctTransport  # noqa: E402
from orchestrator.transport.ssh import SSHTransport  # noqa: E402

CTID = 200


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--pct-delay", type=float, default=0.0, help="seconds each pct call sleeps (Perl start-up)")
    args = ap.parse_args()

    host = FakePVE().start()
    try:
        ct = host.create_container(CTID, gpus=8)
        host.set_delay(args.pct_delay)
        ssh = SSHTransport(host.hostname, port=host.port, user=host.user, identity_file=host.identity_file,
                           known_hosts=host.known_hosts)
        target = ContainerTarget(name=f"ct{CTID}", workdir=ct.workdir, transport=PctTransport(ssh, CTID))
        target.agent("echo")  # connect, and push the bundle once (not what we measure)

        def bare():
            subprocess.run(host.ssh_argv("pct", "exec", str(CTID), "--", "true"), check=True)

        samples: dict[str, list[float]] = {"bare": [], "echo": [], "ping": [], "first": []}
        calls: dict[str, list[int]] = {"echo": [], "ping": [], "first": []}
        for _ in range(args.repeats):
            # Interleaved, so drift (cache, load) hits every series alike.
            samples["bare"].append(timed(bare))
            for verb in ("echo", "ping"):
                host.clear_pct_calls()
                samples[verb].append(timed(lambda v=verb: target.agent(v)))
                calls[verb].append(len(host.pct_calls()))
            fresh = SSHTransport(host.hostname, port=host.port, user=host.user, identity_file=host.identity_file,
                                 known_hosts=host.known_hosts)
            fresh_target = ContainerTarget(name=f"ct{CTID}", workdir=ct.workdir, transport=PctTransport(fresh, CTID))
            host.clear_pct_calls()
            samples["first"].append(timed(lambda: fresh_target.agent("echo")))
            calls["first"].append(len(host.pct_calls()))
            fresh.close()
        ssh.close()
    finally:
        host.close()

    base = statistics.median(samples["bare"])
    print(f"repeats={args.repeats} pct_delay={args.pct_delay:.3f}s")
    print(f"{'series':<8} {'median ms':>10} {'min ms':>8} {'ratio':>7} {'pct calls/call':>15}")
    for name, values in samples.items():
        med = statistics.median(values)
        per = f"{statistics.mean(calls[name]):.2f}" if name in calls else "1.00"
        print(f"{name:<8} {med * 1000:>10.1f} {min(values) * 1000:>8.1f} {med / base:>7.2f} {per:>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
