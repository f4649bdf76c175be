"""Follow latency: a line appended to a run's train.log in a container -> handed to the local printer.

dflashctl's follower (ops.follow.follow: SSHTransport -> pct exec -> agent `tail`, inotify wake-ups) against a
bare `ssh HOST pct exec CT -- tail -F -n 0 FILE` (the OpenSSH client binary), both through the same fake
Proxmox host (real sshd on 127.0.0.1) in this run, taking turns line by line so both see the same load.

    sudo python bench/follow_latency.py [--samples 200] [--pct-delay 0]

Prints the median and p90 latency of each and the ratio of medians (goal: dflashctl within 1.2x of tail -F).
Needs root (the fake host uses namespaces and its own sshd). The container shares the host's file system, so
the writer appends to the same file a process in the container would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--pct-delay", type=float, default=0.0, help="seconds each pct call sleeps (Perl start-up)")
    args = ap.parse_args()

    from fakehost import FakePVE

    from orchestrator.ops.follow import Backoff, follow
    from orchestrator.target import ContainerTarget

    host = FakePVE().start()
    try:
        host.set_delay(args.pct_delay)
        ct = host.create_container(240, gpus=0)
        run_id, exp = "lat-1", "latency"
        run = Path(ct.workdir) / "runs" / run_id
        run.mkdir(parents=True)
        (run / "run.json").write_text(json.dumps({"experiment": exp, "run_id": run_id, "created": "2026-01-01T00:00:00Z"}))
        log = run / "train.log"
        log.write_text("[bench] start\n")
        session = f"dflash-{exp}"
        res = ct.exec(["tmux", "new-session", "-d", "-s", session, "sleep 3600", ";", "set-option", "-t", session,
                       "@dflash_run", run_id])
        if res.returncode:
            raise SystemExit(f"tmux in the container failed: {res.stderr!r}")

        seen: dict[str, dict[int, float]] = {"dflashctl": {}, "tail -F": {}}
        cond = threading.Condition()

        def got(who: str, line: str) -> None:
            if line.startswith("sample "):
                with cond:
                    seen[who][int(line.split()[1])] = time.perf_counter()
                    cond.notify_all()

        # dflashctl: one long-lived agent tail through ssh + pct exec
        target = ContainerTarget(name="ct240", workdir=ct.workdir, transport=host.pct_transport(240))
        outcome: dict = {}
        ours = threading.Thread(target=lambda: outcome.update(o=follow(
            target, run_id, tail=0, on_line=lambda line: got("dflashctl", line), backoff=Backoff(initial=0.1),
            heartbeat=2.0)), daemon=True)
        ours.start()
        # the baseline: the OpenSSH client running tail -F in the container
        bare = subprocess.Popen(host.ssh_argv("pct", "exec", "240", "--", "tail", "-F", "-n", "0", str(log)),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)

        def read_bare() -> None:
            for raw in iter(bare.stdout.readline, b""):
                got("tail -F", raw.decode(errors="replace").rstrip("\n"))

        threading.Thread(target=read_bare, daemon=True).start()

        # wait until both readers are attached and see lines
        warm = -1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with open(log, "a") as fh:
                fh.write(f"sample {warm}\n")
            with cond:
                cond.wait_for(lambda: all(warm in s for s in seen.values()), timeout=0.5)
                if all(warm in s for s in seen.values()):
                    break
            warm -= 1
        else:
            raise SystemExit("the followers never attached")

        lat: dict[str, list[float]] = {k: [] for k in seen}
        for i in range(args.samples):
            time.sleep(0.02 + (i % 5) * 0.005)  # spaced out: each sample is its own wake-up, not a batch
            with open(log, "a") as fh:
                t0 = time.perf_counter()
                fh.write(f"sample {i}\n")
            with cond:
                if not cond.wait_for(lambda: all(i in s for s in seen.values()), timeout=10):
                    raise SystemExit(f"sample {i} was not seen by {[k for k, s in seen.items() if i not in s]}")
                for who, s in seen.items():
                    lat[who].append(s[i] - t0)

        (run / "exit.json").write_text('{"exit_code": 0}')
        ours.join(30)
        bare.kill()
        target.close()

        def stats(xs: list[float]) -> tuple[float, float]:
            xs = sorted(xs)
            return statistics.median(xs) * 1e3, xs[int(len(xs) * 0.9) - 1] * 1e3

        print(f"follow latency, {args.samples} samples, pct delay {args.pct_delay} s, "
              f"dflashctl outcome: {outcome.get('o').state if outcome.get('o') else '?'}")
        for who, xs in lat.items():
            med, p90 = stats(xs)
            print(f"  {who:10s} median {med:7.2f} ms   p90 {p90:7.2f} ms")
        ratio = statistics.median(lat["dflashctl"]) / statistics.median(lat["tail -F"])
        print(f"  ratio of medians dflashctl / tail -F: {ratio:.2f}x (goal <= 1.2x)")
        return 0
    finally:
        host.close()


if __name__ == "__main__":
    sys.exit(main())
