"""Launch cost on the fake Proxmox host: `pct exec` calls per launch and wall time, against the same steps
done by hand as separate `ssh HOST pct exec CT -- ...` calls. Both are measured in the same run.

    python bench/launch.py [--repeats 5] [--pct-delay 0.3]

dflashctl   ops.launch over a fresh SSH connection (as one `dflashctl launch` invocation makes): ONE agent
            call does preflight (session, GPUs, venv), the run directory and `tmux new-session`.
by hand     OpenSSH client, new connection per step, as a person types them: `tmux has-session`,
            `nvidia-smi --query-gpu=...`, `mkdir -p` the run dir, write run.json, write the start script,
            `tmux new-session -d`. Six `pct exec` calls.
Each launch is followed (untimed) by killing its session so the next one starts clean. The bundle push of
the very first agent call is done before timing and reported separately. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fakehost import FakePVE  # noqa: E402

from orchestrator import assets  # noqa: E402
from orchestrator.ops.launch import LaunchSpec, launch  # noqa: E402
from orchestrator.target import ContainerTarget  # noqa: E402
from orchestrator.transport.quoting import render  # noqa: E402

CTID = 240
SCRIPT = assets.on_disk("start_training.sh")


def make_container(pve: FakePVE):
    ct = pve.create_container(CTID, gpus=8)
    venv = Path(ct.workdir) / "venvs" / "bench-0"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # has libtmux, like a built venv
    (venv / "dflashctl-fingerprint.json").write_text(json.dumps({"lock_hash": "bench", "packages": {}}))
    (Path(ct.workdir) / "venvs" / "current").symlink_to(venv.name)
    return ct


def spec(tag: str) -> LaunchSpec:
    return LaunchSpec(experiment="bench", kind="command", target="ct", tag=tag, command=["sleep", "30"],
                      gpus=[5, 6, 7], venv_profile={"kind": "uv"}, lock_hash="bench")


def by_hand(pve: FakePVE, ct, n: int) -> None:
    """The hand-typed loop: one ssh + pct exec per step."""
    run_dir = f"{ct.workdir}/runs/hand-{n}"
    session = "dflash-bench"

    def step(argv: list[str], stdin: bytes | None = None, ok=(0,)) -> None:
        remote = render(["pct", "exec", str(CTID), "--keep-env", "0", "--", *argv])
        res = subprocess.run(pve.ssh_argv(remote), input=stdin, capture_output=True, timeout=60)
        if res.returncode not in ok:
            raise RuntimeError(f"{argv[0]} failed ({res.returncode}): {res.stderr.decode()[-300:]}")

    step(["tmux", "has-session", "-t", "=" + session], ok=(0, 1))
    step(["nvidia-smi", "--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"])
    step(["mkdir", "-p", run_dir])
    step(["sh", "-c", 'cat > "$1"', "write", f"{run_dir}/run.json"], stdin=b'{"experiment": "bench"}\n')
    step(["sh", "-c", 'cat > "$1"', "write", f"{run_dir}/start_training.sh"], stdin=SCRIPT.read_bytes())
    step(["tmux", "new-session", "-d", "-s", session,
          render(["bash", f"{run_dir}/start_training.sh", run_dir, "--", "sleep", "30"])])


def kill_session(ct) -> None:
    ct.exec(["tmux", "kill-session", "-t", "=dflash-bench"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pct-delay", type=float, default=0.3, help="seconds each pct call sleeps (Perl start-up)")
    args = ap.parse_args()
    with FakePVE() as pve:
        ct = make_container(pve)
        target = ContainerTarget(name="ct", workdir=ct.workdir, transport=pve.pct_transport(CTID))
        t0 = time.perf_counter()
        target.agent("echo")  # first contact: the bundle travels inline (same single exec)
        first = time.perf_counter() - t0
        target.close()
        pve.set_delay(args.pct_delay)

        ours, ours_calls, hand, hand_calls = [], [], [], []
        for i in range(args.repeats):
            pve.clear_pct_calls()
            t0 = time.perf_counter()
            target = ContainerTarget(name="ct", workdir=ct.workdir, transport=pve.pct_transport(CTID))
            launch(target, spec(f"r{i}"), record=False)
            target.close()
            ours.append(time.perf_counter() - t0)
            ours_calls.append(len(pve.pct_exec_calls(CTID)))
            kill_session(ct)

            pve.clear_pct_calls()
            t0 = time.perf_counter()
            by_hand(pve, ct, i)
            hand.append(time.perf_counter() - t0)
            hand_calls.append(len(pve.pct_exec_calls(CTID)))
            kill_session(ct)
        pve.remove_container(CTID)

    mo, mh = statistics.median(ours), statistics.median(hand)
    print(f"pct delay {args.pct_delay:.2f} s, {args.repeats} launches each (median wall time)")
    print(f"  first agent call (bundle push included, untimed above): {first:.2f} s")
    print(f"  dflashctl launch : {mo:.2f} s   pct exec calls per launch: {sorted(set(ours_calls))}")
    print(f"  by hand (6 steps): {mh:.2f} s   pct exec calls per launch: {sorted(set(hand_calls))}")
    print(f"  ratio by-hand / dflashctl: {mh / mo:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
