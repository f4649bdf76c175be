"""A new SSH connection and its first command on the fake Proxmox host's sshd: this project's transport
(orchestrator.transport.sshconn.transport_over) against paramiko's own Transport over the same kind of socket,
and OpenSSH's `ssh HOST true` as the floor, all in the same run.

    python bench/ssh_connect.py [--repeats 15]

connect      TCP connect, key exchange, authentication (SSHClient.connect)
first exec   the first channel opened and `true` run on it: every command of dflashctl starts with one
Two stalls of ~40 ms each come from TCP, not SSH: a handshake packet held in Nagle's buffer until the one
before it is acknowledged (TCP_NODELAY from the first byte removes it), and sshd's first channel confirmation
held the same way behind its hostkeys-00 request, whose ACK the client delays (acknowledged at once with
TCP_QUICKACK). Needs root (the fake host's sshd).

Measured (2 CPUs shared with other jobs), 2026-12-04, `--repeats 12`, load ~0.5, with the transport as paramiko
makes it, then TCP_NODELAY before the handshake, then both fixes (medians; the scripts of that day, the same
steps as here): connect 60 ms / 18 ms / 22 ms, first channel 41 ms / 44 ms / 1.2 ms.
This script, `--repeats 12`, load 1.1 (a test suite beside it): paramiko's Transport 62.5 + 46.2 ms,
transport_over 20.3 + 2.7 ms (4.8x); OpenSSH's whole `ssh HOST true` 225 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import paramiko  # noqa: E402

from fakehost import FakePVE  # noqa: E402
from orchestrator.transport.sshconn import transport_over  # noqa: E402


def one(pve: FakePVE, factory) -> tuple[float, float]:
    """(connect, first exec) seconds of one new connection whose Transport `factory` makes."""
    client = paramiko.SSHClient()
    client.load_host_keys(pve.known_hosts)
    t0 = time.perf_counter()
    client.connect(pve.hostname, port=pve.port, username=pve.user, key_filename=pve.identity_file,
                   look_for_keys=False, allow_agent=False, transport_factory=factory)
    t1 = time.perf_counter()
    chan = client.get_transport().open_session()
    chan.exec_command("true")
    code = chan.recv_exit_status()
    t2 = time.perf_counter()
    client.close()
    if code != 0:
        raise RuntimeError(f"`true` exited {code} on the fake host")
    return t1 - t0, t2 - t1


def openssh(pve: FakePVE) -> float:
    t0 = time.perf_counter()
    subprocess.run(pve.ssh_argv("true"), check=True, capture_output=True, timeout=60)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    kinds = {"paramiko's Transport": paramiko.Transport, "transport_over": transport_over}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    floor: list[float] = []
    with FakePVE() as pve:
        one(pve, transport_over)  # sshd's first connection (its host key read, the page cache warm)
        for _ in range(args.repeats):  # alternated, so a busy neighbour slows both alike
            for name, factory in kinds.items():
                got[name].append(one(pve, factory))
            floor.append(openssh(pve))
    print(f"{args.repeats} connections each (medians), load average {load:.2f} on {os.cpu_count()} CPUs")
    total = {}
    for name, rows in got.items():
        connect = statistics.median(r[0] for r in rows)
        first = statistics.median(r[1] for r in rows)
        total[name] = statistics.median(r[0] + r[1] for r in rows)
        print(f"  {name:22s} connect {connect * 1e3:6.1f} ms   first exec {first * 1e3:6.1f} ms   "
              f"both {total[name] * 1e3:6.1f} ms")
    print(f"  OpenSSH `ssh HOST true` (a new process, the floor): {statistics.median(floor) * 1e3:6.1f} ms")
    plain, ours = total["paramiko's Transport"], total["transport_over"]
    print(f"  paramiko's Transport / transport_over: {plain / ours:.1f}x (connect and first exec)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
