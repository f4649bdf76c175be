"""Launch cost on the fake Proxmox host: `pct exec` calls per launch and wall time, against the same steps
done by hand as separate `ssh HOST pct exec CT -- ...` calls, and against the floor: one bare
`ssh HOST pct exec CT -- true`. All are measured in the same run, with the same pct delay.

    python bench/launch.py [--repeats 5] [--pct-delay 0.3] [--dev]

command     the installed `dflashctl` console script, `dflashctl -i INV launch bench --tag rN`, in a new
            process: imports, inventory, SSH connection, the agent call and the printed result (the
            connection and the agent's pct exec start from the raw inventory while it is validated).
ops.launch  the same launch in this process over a fresh SSH connection (no imports, no inventory): ONE
            agent call does preflight (session, GPUs, venv), the run directory and `tmux new-session`.
bare exec   OpenSSH client, one `pct exec CT -- true`: what any command into the container costs at least.
by hand     OpenSSH client, new connection per step, as a person types them: `tmux has-session`,
            `nvidia-smi --query-gpu=...`, `mkdir -p` the run dir, write run.json, write the start script,
            `tmux new-session -d`. Six `pct exec` calls.
Each launch is followed (untimed) by killing its session so the next one starts clean. The bundle push of
the very first agent call is done before timing and reported separately. Needs root (namespaces).
Goals: command <= 1.3x the bare exec, <= 0.2x the hand loop (the load average is printed beside them: on a
loaded machine every figure grows with it).

Measured (2 CPUs shared with other jobs; `--repeats 3 --pct-delay 0.3`), 2026-12-02:
  before (731d783), load 0.96: command 1.26 s, bare 0.65 s, by hand 3.87 s -> 1.94x bare, 0.33x by hand;
      CPU 0.64 s (this machine sets PYTHONDONTWRITEBYTECODE=1, so each run compiled the project from source).
  after (bf3e73c: the early agent call starts right after the connection; invoke not imported with paramiko;
      bytecode kept), load 9.2: command 2.78 s, bare 0.92 s, by hand 5.97 s -> 3.01x, 0.47x; CPU 0.66 s.
  Same run, same fake host, trees alternated (6 launches each, load 15-17): before 4.12 s / CPU 0.77 s,
      after 3.51 s / CPU 0.67 s (bare 1.01 s). Without the early connection (load 12-15): 2.84 s against
      2.70 s with it. The remaining CPU is mostly imports: the inventory's (pydantic models, ~0.19 s of
      `import orchestrator.inventory` alone), paramiko with cryptography and nacl (~0.1 s), typer and the
      pydantic TypeAdapters it builds for the flags, the agent protocol's dataclasses.
  2026-12-03, `--repeats 5`, load 0.3-1.0, bare 0.57 s, by hand 3.41-3.47 s:
      before (0b3f04e): command 1.01 s -> 1.76x bare, 0.29x by hand; CPU 0.51 s.
      after (the early call started from the command line before typer's parse, the command waiting for it;
      invoke's stand-in not loaded by pydantic's docstring reader; the console script's os._exit; the two
      nvidia-smi calls side by side): command 0.84 s -> 1.46x, 0.24x; CPU 0.40 s (in-process 0.61 s).
  Where the 0.84 s goes (a timeline of one run): Python up 0.04 s; typer and the verbs imported 0.08 s; the
  raw inventory read and paramiko imported 0.17 s; connected 0.24 s; the agent call started 0.29 s; the
  answer 0.80 s. The 0.51 s after the start is the container's (sshd's session, pct 0.30 s, lxc-attach, the
  agent's Python and imports ~0.05 s, the launch itself ~0.08 s: its locks, claims, tmux). OpenSSH's whole
  `ssh host true` is 0.2 s here; the workstation's own share before the exec (0.29 s) is Python, typer,
  paramiko and a handshake in Python, so 1.3x (0.74 s) needs the start at ~0.2 s and the agent free.
  2026-12-04, `--repeats 5`, load 0.0-0.3, bare 0.57 s, by hand 3.47 s: the container's venv now as `uv venv`
      makes it (the container's python3, no system site-packages; before, the workstation's interpreter with
      its development .pth files stood in, ~25 ms a call): command 0.76 s -> 1.34x, 0.22x; CPU 0.38 s;
      in-process 0.58 s. The workstation side as a user installs it (a fresh venv, `uv pip install .`) and
      as this tree's editable install (`--dev`) measure the same within 0.01 s.
  2026-12-04 (later), `--repeats 5`, load 0.2-0.6, bare 0.57-0.58 s, by hand 3.47-3.49 s, before 0.78 s (1.35x,
      0.22x):
      TCP_NODELAY before the handshake, and the host's hostkeys-00 request acknowledged at once (a 40 ms
      delayed ACK that held sshd's first channel confirmation in its Nagle buffer): connect + first channel
      102 ms -> 23 ms; command 0.69 s -> 1.18x, 0.20x; in-process 0.50 s.
      The console script starting the connection from the kept grammar, before typer is imported (the agent
      call starts at ~0.15 s instead of ~0.19 s): command 0.65 s -> 1.15x, 0.19x; CPU 0.39 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from cli_startup import console_script  # noqa: E402  (bench/ is sys.path[0]: the one finder of the console script)
from fakehost import FakePVE  # noqa: E402

from orchestrator import assets  # noqa: E402
from orchestrator.ops.launch import LaunchSpec, launch  # noqa: E402
from orchestrator.ops.lock import lock_hash  # noqa: E402
from orchestrator.target import ContainerTarget  # noqa: E402
from orchestrator.quoting import render  # noqa: E402

CTID = 240
CONTAINER_PYTHON = "/usr/bin/python3"
SCRIPT = assets.on_disk("start_training.sh")


LOCK = b"dflashbench==1.0 --hash=sha256:00\n"  # what the container venv's fingerprint says it was built from


def make_container(pve: FakePVE):
    ct = pve.create_container(CTID, gpus=8)
    venv = Path(ct.workdir) / "venvs" / "bench-0"
    (venv / "bin").mkdir(parents=True)
    # A venv as `uv venv` makes it in a container: the container's python3 (this shared-root container's is
    # the host's /usr/bin/python3) and a pyvenv.cfg without the system's site-packages, so its start-up reads
    # no .pth file of the workstation's development environment (an editable install's finder, coverage's
    # hook: ~25 ms a call that no container venv pays).
    (venv / "bin" / "python").symlink_to(CONTAINER_PYTHON)
    (venv / "pyvenv.cfg").write_text(f"home = {Path(CONTAINER_PYTHON).parent}\ninclude-system-site-packages = false\n")
    (venv / "dflashctl-fingerprint.json").write_text(json.dumps({"lock_hash": lock_hash(LOCK), "packages": {}}))
    (Path(ct.workdir) / "venvs" / "current").symlink_to(venv.name)
    return ct


def spec(tag: str) -> LaunchSpec:
    return LaunchSpec(experiment="bench", kind="command", target="ct", tag=tag, command=["sleep", "30"],
                      gpus=[5, 6, 7], venv_profile={"kind": "uv"}, lock_hash=lock_hash(LOCK))


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


def bare_exec(pve: FakePVE) -> None:
    """The floor: one OpenSSH connection, one `pct exec CT -- true`."""
    res = subprocess.run(pve.ssh_argv(render(["pct", "exec", str(CTID), "--keep-env", "0", "--", "true"])),
                         capture_output=True, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(f"bare pct exec failed ({res.returncode}): {res.stderr.decode()[-300:]}")


def write_inventory(pve: FakePVE, ct, path: Path) -> Path:
    """An inventory naming the fake host, the container and the bench experiment (as `spec` builds it)."""
    inv = {
        "hosts": {"pve": pve.host_entry()},
        "targets": {"ct": {"kind": "container", "host": "pve", "ctid": CTID, "workdir": ct.workdir, "venv": "v"}},
        "venvs": {"v": {"kind": "uv", "lock": str(path.parent / "bench.txt")}},
        "experiments": {"bench": {"kind": "command", "target": "ct", "gpus": [5, 6, 7], "command": ["sleep", "30"]}},
    }
    path.write_text(json.dumps(inv))
    (path.parent / "bench.txt").write_bytes(LOCK)
    return path


CPU: list[float] = []  # CPU seconds (user + system) of each timed console-script process


def installed_script(where: Path) -> list[str] | None:
    """dflashctl as a user installs it: a new venv (`uv venv`) with this tree installed into it, not editable,
    its modules compiled (`uv pip install --compile-bytecode .`, as pip compiles a wheel's). None (with the
    reason on stderr) where uv or the package index is not at hand: the development environment is used."""
    import shutil

    uv = shutil.which("uv")
    if uv is None:
        print("bench: no uv on PATH; measuring the development environment's console script", file=sys.stderr)
        return None
    venv = where / "installed"
    steps = ([uv, "venv", "-q", "--python", sys.executable, str(venv)],
             [uv, "pip", "install", "-q", "--compile-bytecode", "--python", str(venv / "bin" / "python"), str(ROOT)])
    for argv in steps:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            print(f"bench: {' '.join(argv[:3])} failed ({res.stderr.strip()[-300:]}); measuring the development "
                  "environment's console script", file=sys.stderr)
            return None
    return [str(venv / "bin" / "python"), str(venv / "bin" / "dflashctl")]


def run_command(inv: Path, tag: str, script: list[str] | None) -> None:
    """One `dflashctl launch` in a new process; its CPU time goes to CPU (a figure the machine's load does not
    inflate the way it inflates wall time: it is the workstation's own work, imports included). `script`: the
    installed console script (installed_script), or None for this environment's, run from this tree."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ, DFLASHCTL_STATE_DIR=str(inv.parent / "state"))  # the bench's run records stay in its dir
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if script is None:
        env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
                   # Bytecode as an installed dflashctl has it (pip compiles a wheel's modules), kept in the temp
                   # dir, even where the environment says PYTHONDONTWRITEBYTECODE: without it every run compiles
                   # the project's modules from source, a cost no installed dflashctl pays.
                   PYTHONPYCACHEPREFIX=str(inv.parent / "pycache"))
    res = subprocess.run([*(script or console_script()), "-i", str(inv), "launch", "bench", "--tag", tag],
                         capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise RuntimeError(f"dflashctl launch failed ({res.returncode}): {res.stdout[-300:]} {res.stderr[-600:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)


def kill_session(ct) -> None:
    ct.exec(["tmux", "kill-session", "-t", "=dflash-bench"])


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def in_process(pve: FakePVE, tag: str) -> None:
    target = ContainerTarget(name="ct", workdir=pve_ct_workdir(pve), transport=pve.pct_transport(CTID))
    launch(target, spec(tag), record=False)
    target.close()


def pve_ct_workdir(pve: FakePVE) -> str:
    return pve.container(CTID).workdir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pct-delay", type=float, default=0.3, help="seconds each pct call sleeps (Perl start-up)")
    ap.add_argument("--dev", action="store_true",
                    help="time this environment's console script (an editable install) instead of a fresh venv's")
    args = ap.parse_args()
    load_before = os.getloadavg()  # the machine may be shared: every figure below depends on it
    times: dict[str, list[float]] = {"command": [], "ops": [], "hand": [], "bare": []}
    calls: dict[str, set[int]] = {"command": set(), "ops": set(), "hand": set()}
    with FakePVE() as pve, tempfile.TemporaryDirectory() as tmp:
        ct = make_container(pve)
        inv = write_inventory(pve, ct, Path(tmp) / "inventory.yaml")
        target = ContainerTarget(name="ct", workdir=ct.workdir, transport=pve.pct_transport(CTID))
        t0 = time.perf_counter()
        target.agent("echo")  # first contact: the bundle travels inline (same single exec)
        first = time.perf_counter() - t0
        target.close()
        script = None if args.dev else installed_script(Path(tmp))
        run_command(inv, "warm", script)  # the first command run writes its caches (bytecode, known bundles)
        CPU.clear()
        kill_session(ct)
        pve.set_delay(args.pct_delay)
        steps = {"command": lambda i: run_command(inv, f"c{i}", script), "ops": lambda i: in_process(pve, f"r{i}"),
                 "hand": lambda i: by_hand(pve, ct, i), "bare": lambda i: bare_exec(pve)}
        for i in range(args.repeats):
            for name, step in steps.items():
                pve.clear_pct_calls()
                times[name].append(timed(step, i))
                if name in calls:
                    calls[name].add(len(pve.pct_exec_calls(CTID)))
                    kill_session(ct)
        pve.remove_container(CTID)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"pct delay {args.pct_delay:.2f} s, {args.repeats} runs each (median wall time); load average "
          f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs")
    print(f"  first agent call (bundle push included, untimed above): {first:.2f} s")
    print(f"  dflashctl launch (console script): {med['command']:.2f} s   pct exec calls: {sorted(calls['command'])}"
          f"   ({'this environment, editable' if script is None else 'a fresh venv, installed from this tree'})")
    print(f"  ops.launch in-process            : {med['ops']:.2f} s   pct exec calls: {sorted(calls['ops'])}")
    print(f"  by hand (6 steps)                : {med['hand']:.2f} s   pct exec calls: {sorted(calls['hand'])}")
    print(f"  bare ssh + pct exec true         : {med['bare']:.2f} s   pct exec calls: [1]")
    print(f"  dflashctl launch CPU time on the workstation: {statistics.median(CPU):.2f} s (user + system)")
    print(f"  command / bare exec : {med['command'] / med['bare']:.2f}x   (goal <= 1.3x)")
    print(f"  command / by hand   : {med['command'] / med['hand']:.2f}x   (goal <= 0.2x)")
    print(f"  by hand / command   : {med['hand'] / med['command']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
