"""GPU claims: which launch or run of a workdir holds which GPU. Standard library only.

    <workdir>/locks/gpus.json   {"<index>": {"run_id", "experiment", "phase", "pid", "pid_start", "since"}}
    <workdir>/locks/gpus.lock   flock around each read-modify-write of gpus.json (held for milliseconds)

A launch claims every GPU of its run before it looks at nvidia-smi, all or none, and keeps the claims while
its preflight runs (phase "launch": live while the launching agent process lives). Once the run's session
has started they pass to the run (phase "run": live while the run runs, by orchestrator.agent.liveness). A
failed launch releases them at once; a claim whose launch process or run has ended is stale and is dropped
by the next claim, so a killed agent or a run that ended (or was stopped, or crashed) never keeps a GPU.

nvidia-smi cannot do this job: a launch still in its preflight (checking the venv, writing its run
directory, warming up) has not touched its GPUs yet, so two launches on overlapping GPUs would both see
them idle.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from orchestrator import names
from orchestrator.agent import atomic, liveness, rundirs, runprocs
from orchestrator.agent.protocol import AgentFailure

CLAIMS_NAME = "gpus.json"
MUTEX_NAME = "gpus.lock"
_POLL_S = 0.1


def locks_dir(workdir: str | Path) -> Path:
    """`<workdir>/locks`: the per-experiment launch locks and the GPU claims."""
    return Path(workdir) / "locks"


class _Mutex:
    """flock on locks/gpus.lock for one read-modify-write (the kernel drops it if the process dies)."""

    def __init__(self, workdir: str | Path):
        self.path = locks_dir(workdir) / MUTEX_NAME
        self.fd: int | None = None

    def __enter__(self) -> "_Mutex":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        assert self.fd is not None
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None


def _read(workdir: str | Path) -> dict[str, dict]:
    data = rundirs.read_json(locks_dir(workdir) / CLAIMS_NAME) or {}
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def _write(workdir: str | Path, claims: dict[str, dict]) -> None:
    atomic.write_json(locks_dir(workdir) / CLAIMS_NAME, claims)


def this_process() -> dict:
    """The fields that make a launch-phase claim recognisable as this process's (pid and its start time)."""
    return {"pid": os.getpid(), "pid_start": liveness.process_start(os.getpid())}


def claim_alive(workdir: str | Path, claim: dict) -> bool:
    """Whether a claim still holds its GPU.

    phase "launch": the launching process exists and started when the claim says (a reused pid does not
    count). phase "run": a process of the run lives (orchestrator.agent.liveness.live_processes), whatever
    exit.json says; else the run has no exit.json and run_alive does not know it gone.
    """
    if claim.get("phase") == "launch":
        pid = claim.get("pid")
        if not isinstance(pid, int) or not liveness.pid_alive(pid):
            return False
        then, now = claim.get("pid_start"), liveness.process_start(pid)
        return then is None or now is None or abs(float(then) - now) <= 2.0
    rid = claim.get("run_id")
    if not isinstance(rid, str) or not names.is_valid(rid, names.RUN_ID_MAX):
        return False
    path = rundirs.runs_root(workdir) / rid
    if not path.is_dir():
        return False
    ref = rundirs.load_ref(path)
    if liveness.live_processes(ref):
        return True  # exit.json or not: a rank that outlived its launcher still holds its GPU
    # Unknown liveness (no tmux to ask, no pid file yet) keeps the GPU: freeing a GPU a trainer still uses
    # puts two runs on it.
    return rundirs.read_exit(ref) is None and liveness.run_alive(ref) is not False


def held(workdir: str | Path, gpus: list[int]) -> dict[int, dict]:
    """The live claims on `gpus`, by GPU index (read-only: nothing is pruned, nothing is claimed)."""
    return {int(k): c for k, c in _read(workdir).items()
            if k.isdigit() and int(k) in gpus and claim_alive(workdir, c)}


def describe(index: int, claim: dict) -> str:
    """'GPU 1 is held by run a-2026... (experiment a), launching since T (pid 42)', '..., running', or 'GPU 5
    is held by the warm-up of experiment a, since T (pid 42)'."""
    since = f"since {claim.get('since')} (pid {claim.get('pid')})"
    if claim.get("run_id") is None:
        return f"GPU {index} is held by the warm-up of experiment {claim.get('experiment')}, {since}"
    what = f"launching {since}" if claim.get("phase") == "launch" else (
        f"ended, but its {claim['survivors']} still run" if claim.get("survivors") else "running")
    return f"GPU {index} is held by run {claim.get('run_id')} (experiment {claim.get('experiment')}), {what}"


def _conflicts(workdir, claims: dict[str, dict], gpus: list[int], mine: str) -> dict[int, dict]:
    """Live claims of other holders on `gpus`; stale claims are dropped from `claims` (in place)."""
    found: dict[int, dict] = {}
    alive: dict[tuple, bool] = {}  # one check per holder, not per GPU (a run check lists tmux sessions)
    for key in list(claims):
        c = claims[key]
        if c.get("token") == mine:
            continue
        who = (c.get("token"), c.get("phase"), c.get("run_id"))
        if who not in alive:
            alive[who] = claim_alive(workdir, c)
        if not alive[who]:
            del claims[key]
        elif key.isdigit() and int(key) in gpus:
            found[int(key)] = _with_survivors(workdir, c)
    return found


def _with_survivors(workdir, claim: dict) -> dict:
    """A run claim whose run has ended (exit.json) but whose processes live on, with them named (`survivors`)."""
    rid = claim.get("run_id")
    if claim.get("phase") != "run" or not isinstance(rid, str) or not names.is_valid(rid, names.RUN_ID_MAX):
        return claim
    ref = rundirs.load_ref(rundirs.runs_root(workdir) / rid)
    if rundirs.read_exit(ref) is None:
        return claim
    left = liveness.live_processes(ref)
    return {**claim, "survivors": runprocs.describe_all(left)} if left else claim


def refusal(conflicts: dict[int, dict], waited: float = 0.0) -> AgentFailure:
    """The GpuClaimed refusal naming each held GPU and its holder."""
    parts = [describe(i, c) for i, c in sorted(conflicts.items())]
    holders = sorted({str(c.get("run_id") or f"(the warm-up of {c.get('experiment')})") for c in conflicts.values()})
    waited_text = f" (waited {waited:.0f} s for its preflight)" if waited >= 0.5 else ""
    return AgentFailure(
        "GpuClaimed",
        "; ".join(parts) + waited_text,
        fix=(f"wait for run {holders[0]} to end, or stop it (dflashctl stop {holders[0]}), or change this "
             "experiment's layout" if len(holders) == 1 else
             f"wait for runs {', '.join(holders)} to end, or stop them, or change this experiment's layout"),
        data={"claims": {str(i): c for i, c in conflicts.items()}, "gpus": sorted(conflicts)},
    )


def claim(workdir: str | Path, gpus: list[int], holder: dict, emit, wait_s: float) -> str:
    """Claim every GPU of `gpus` for a launch (phase "launch"), all or none.

    A GPU held by another launch still in its preflight is waited for, up to `wait_s` seconds (its launch may
    yet fail and release it); one held by a running run is refused at once.

    Args:
        holder: run_id and experiment of the launch (run_id None: a warm-up, which never passes to a run).
    Returns:
        The claim token (give it to promote / release).
    Raises:
        AgentFailure("GpuClaimed"): naming each GPU, the run that holds it and whether it is launching or
            running.
    """
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    entry = {**holder, **this_process(), "phase": "launch", "since": rundirs.utc_now(), "token": token}
    start = time.monotonic()
    announced = False
    while True:
        with _Mutex(workdir):
            claims = _read(workdir)
            conflicts = _conflicts(workdir, claims, gpus, token)
            if not conflicts:
                claims.update({str(g): entry for g in gpus})
                _write(workdir, claims)
                return token
        waited = time.monotonic() - start
        running = any(c.get("phase") != "launch" for c in conflicts.values())
        if running or waited >= wait_s:
            raise refusal(conflicts, 0.0 if running else waited)
        if not announced:
            emit.progress("gpus", "; ".join(describe(i, c) for i, c in sorted(conflicts.items()))
                          + f"; waiting up to {wait_s:.0f} s for its preflight")
            announced = True
        time.sleep(_POLL_S)


def promote(workdir: str | Path, token: str, run_id: str) -> None:
    """The launch's claims pass to its run (phase "run", the run id it ended up with)."""
    with _Mutex(workdir):
        claims = _read(workdir)
        for c in claims.values():
            if c.get("token") == token:
                c.update(phase="run", run_id=run_id, since=rundirs.utc_now())
        _write(workdir, claims)


def release(workdir: str | Path, token: str) -> None:
    """Drop the claims of this launch (it failed before its run started)."""
    with _Mutex(workdir):
        claims = _read(workdir)
        kept = {k: c for k, c in claims.items() if c.get("token") != token}
        if kept != claims:
            _write(workdir, kept)
