"""Run directories inside the target, and the launch lock. Standard library only.

    <workdir>/runs/<run-id>/  run.json  config.json  train.log  log.mark  metrics.jsonl  exit.json  pid
                              stop.json (written by a stop, before its first signal)
    <workdir>/locks/<experiment>.lock   held (flock) by the launch of that experiment in progress; its text
                                        names the holder
    <workdir>/locks/gpus.json           the GPU claims (orchestrator.agent.claims)

States: running (no exit.json, and its session lives with a live pane or its command's process group from
`pid` still exists), stopped (ended after `dflashctl stop` or `launch --replace` asked it to: exit.json's
"stopped", copied from the run's stop.json, says by whom and when; whatever its exit code), succeeded (exit
0), failed (exit != 0), crashed (no exit.json, its session gone or its pane dead, and no process of its
command left: killed, container stopped).

This module is the one place that finds run directories, reads their JSON files, checks liveness and decides
a run's state; status, stop, launch, resume, tail and metrics all use it.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import names
from orchestrator.agent import runprocs
from orchestrator.agent.protocol import AgentFailure

# How much of metrics.jsonl's end is read for the last tokens/s (lines are short; this is dozens of them).
_METRICS_TAIL = 64 * 1024
STOP_NAME = "stop.json"


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second with a Z (the format of exit.json)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> float | None:
    """Epoch seconds of an ISO time written by us (Z or +00:00), or None."""
    if not text:
        return None
    try:
        return _dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def check_run_id(run_id: str) -> str:
    """Return run_id if it is a run id by names.check_run_id (safe as one path component), else raise
    AgentFailure("BadRunId")."""
    try:
        return names.check_run_id(run_id)
    except names.BadName as exc:
        raise AgentFailure("BadRunId", exc.message, fix=exc.fix) from None


def check_name(kind: str, value: str) -> str:
    """Return value if it is a valid `kind` name by names.check, else raise AgentFailure("BadName")."""
    try:
        return names.check(kind, value)
    except names.BadName as exc:
        raise AgentFailure("BadName", exc.message, fix=exc.fix) from None


def runs_root(workdir: str | Path) -> Path:
    return Path(workdir) / "runs"


def read_json(path: Path) -> dict | None:
    """A JSON object from a file, or None when missing, partial or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict, mode: int = 0o644) -> None:
    """Write JSON by temp file + fsync + rename: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True, default=str)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Like write_json for raw bytes (the env file, the script copy)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def create_run_dir(workdir: str | Path, run_id: str) -> tuple[str, Path]:
    """Create runs/<run_id>/ exclusively; on a clash (same experiment, tag and second) add -2, -3, ...

    Returns:
        (the run id actually used, its directory).
    """
    check_run_id(run_id)
    root = runs_root(workdir)
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, names.CLASH_MAX + 1):
        rid = names.clash_variant(run_id, n)
        try:
            (root / rid).mkdir()
            return rid, root / rid
        except FileExistsError:
            continue
    raise _all_taken(root, run_id)


def free_run_id(workdir: str | Path, run_id: str) -> str:
    """The run id create_run_dir would take now (run_id, or its first -2, -3, ... without a directory), read-only:
    what a launch plans (orchestrator.agent.preflight), then makes with make_run_dir under its lock."""
    check_run_id(run_id)
    root = runs_root(workdir)
    for n in range(1, names.CLASH_MAX + 1):
        rid = names.clash_variant(run_id, n)
        if not (root / rid).exists():
            return rid
    raise _all_taken(root, run_id)


def make_run_dir(workdir: str | Path, run_id: str) -> Path:
    """Create runs/<run_id>/ (the id free_run_id planned) exclusively.

    Raises:
        AgentFailure("RunDirExists"): it appeared since it was planned (a launch of another experiment whose
            run id came out the same in the same second).
    """
    root = runs_root(workdir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        (root / run_id).mkdir()
    except FileExistsError:
        raise AgentFailure("RunDirExists", f"{root / run_id} was created by another launch while this one planned it",
                           fix="launch again (it takes the next free run id)") from None
    return root / run_id


def _all_taken(root: Path, run_id: str) -> AgentFailure:
    return AgentFailure("RunDirExists",
                        f"runs/{run_id} and {names.CLASH_MAX - 1} suffixed variants already exist in {root}")


def parse_records(lines) -> tuple[list[dict], int]:
    """The JSON objects of metrics.jsonl lines (bytes or str), and how many lines were not one (bad JSON or
    not an object). Blank lines are neither."""
    records, invalid = [], 0
    for raw in lines:
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            invalid += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            invalid += 1
    return records, invalid


def last_metrics(path: Path) -> dict | None:
    """The last complete JSON line of metrics.jsonl that carries tokens_per_s (else the last line), or None."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _METRICS_TAIL))
            blob = fh.read()
    except OSError:
        return None
    last = None
    for raw in reversed(blob.split(b"\n")):
        try:
            obj = json.loads(raw)
        except ValueError:
            continue  # the partial first line of the window, or a line being written
        if not isinstance(obj, dict):
            continue
        if last is None:
            last = obj
        if "tokens_per_s" in obj:
            return obj
    return last


# ---------------------------------------------------------------------------------------------- runs


@dataclass
class RunRef:
    """A run directory and what run.json says about it."""

    run_id: str
    path: Path
    info: dict = field(default_factory=dict)

    @property
    def experiment(self) -> str | None:
        return self.info.get("experiment")

    @property
    def session(self) -> str | None:
        """The tmux session the run lives in: run.json's `session`, else `dflash-<experiment>`."""
        if self.info.get("session"):
            return str(self.info["session"])
        return names.session_name(self.experiment) if names.is_valid(self.experiment) else None

    @property
    def log(self) -> Path:
        return self.path / "train.log"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def exit_file(self) -> Path:
        return self.path / "exit.json"


def load_ref(path: Path) -> RunRef:
    """The RunRef of an existing run directory (run.json read now; {} when missing or partial)."""
    return RunRef(path.name, path, read_json(path / "run.json") or {})


def created_key(ref: RunRef) -> tuple:
    """Sort key, oldest first: run.json's ISO `created` (sorts as text), then the directory's mtime (ties,
    and runs whose run.json is missing), then the name."""
    try:
        mtime = ref.path.stat().st_mtime
    except OSError:
        mtime = 0.0
    return (str(ref.info.get("created") or ""), mtime, ref.run_id)


def run_refs(workdir: str | Path) -> list[RunRef]:
    """Every run directory under `<workdir>/runs`, oldest first (created_key)."""
    root = runs_root(workdir)
    if not root.is_dir():
        return []
    refs = [load_ref(p) for p in root.iterdir() if p.is_dir() and names.is_valid(p.name, names.RUN_ID_MAX)]
    return sorted(refs, key=created_key)


def resolve_run(workdir: str | Path, run_id: str | None = None, experiment: str | None = None) -> RunRef:
    """The run named `run_id`, else the newest run of `experiment`, else the newest run of all.

    Raises:
        AgentFailure("RunNotFound"): no such run, or `run_id` is not a valid run id (the message lists the
            newest runs there are).
    """
    if run_id is not None:
        if not names.is_valid(run_id, names.RUN_ID_MAX):
            raise AgentFailure("RunNotFound", f"{run_id!r} is not a valid run id", fix="dflashctl runs")
        path = runs_root(workdir) / run_id
        if path.is_dir():
            return load_ref(path)
    refs = run_refs(workdir)
    if run_id is None:
        candidates = [r for r in refs if experiment is None or r.experiment == experiment]
        if candidates:
            return candidates[-1]
    known = ", ".join(r.run_id for r in refs[-5:]) or "none"
    what = f"no run {run_id!r}" if run_id is not None else (
        f"no run of experiment {experiment!r}" if experiment else "no runs")
    raise AgentFailure(
        "RunNotFound",
        f"{what} in {runs_root(workdir)} (newest runs: {known})",
        fix="dflashctl runs   # lists runs; or launch one with dflashctl launch EXPERIMENT",
        data={"runs": [r.run_id for r in refs[-20:]]},
    )


def read_exit(ref: RunRef) -> dict | None:
    """exit.json's contents, or None while the run has not ended (or the file is still being written)."""
    return read_json(ref.exit_file)


# ------------------------------------------------------------------------------------------ liveness


def pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether process `pid` exists (and, given `since`, started no later than that epoch time).

    `since` guards against pid reuse: a pid file outlives its process (a container restart, a reboot), and
    a new process that got the same number started after the file was written. Where /proc cannot tell the
    start time, existence alone decides.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if since is None:
        return True
    started = process_start(pid)
    # Start times from /proc are whole seconds of boot time plus clock ticks: allow 2 s of rounding.
    return started is None or started <= since + 2.0


def process_start(pid: int) -> float | None:
    """Epoch start time of a process from /proc (Linux), or None when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after the comm field
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_pid(run_dir: Path) -> int | None:
    """The command's process group id from `<run>/pid` (written by start_training.sh), or None."""
    try:
        text = (run_dir / "pid").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def command_alive(ref: RunRef) -> bool | None:
    """Whether the command of `<run>/pid` still runs (its leader, or any process of its group); None when
    there is no pid file yet."""
    pid = read_pid(ref.path)
    if pid is None:
        return None
    try:
        since = (ref.path / "pid").stat().st_mtime
    except OSError:
        since = None
    if pid_alive(pid):
        return pid_alive(pid, since)  # the leader exists: is it still ours, or a reused number?
    # The leader is gone but workers of its group may live on; the kernel does not hand out a number that
    # is still some group's id, so such a group is this run's.
    return group_alive(pid)


def live_processes(ref: RunRef) -> list[runprocs.RunProcess]:
    """Every live process of the run, exit.json or not: the ones carrying its environment marker
    (orchestrator.agent.runprocs) and the members of its command's process group (the pid file, unless its
    leader is a reused pid), by pid."""
    found = {p.pid: p for p in runprocs.run_processes(ref.path)}
    pid = read_pid(ref.path)
    if pid is not None and command_alive(ref):
        for p in runprocs.group_members(pid):
            found.setdefault(p.pid, p)
    return sorted(found.values(), key=lambda p: p.pid)


def check_no_processes(ref: RunRef, doing: str, fix: str) -> None:
    """Refuse `doing` while any process of the run lives, naming them.

    Raises:
        AgentFailure("RunProcessesAlive"): naming each process (pid, command line) and the way out.
    """
    left = live_processes(ref)
    if left:
        raise AgentFailure(
            "RunProcessesAlive",
            f"{doing}: run {ref.run_id} still has {len(left)} live process(es): {runprocs.describe_all(left)}",
            fix=fix, data={"run_id": ref.run_id, "pids": [p.pid for p in left]},
        )


def run_session(ref: RunRef, sessions: list[dict]) -> dict | None:
    """The tmux session running THIS run: the one tagged with its run id (`@dflash_run`), else an untagged
    one (started by hand) of the run's session name; a live pane wins over a dead one. None if there is none.

    Launch tags each session with the run id and keeps dead panes (remain-on-exit), so a session of the
    same name that runs a later run does not count as this one.
    """
    found = [s for s in sessions
             if s.get("run_id") == ref.run_id or (s.get("run_id") is None and ref.session and s.get("name") == ref.session)]
    return next((s for s in found if not s.get("dead")), found[0] if found else None)


def session_alive(ref: RunRef, sessions: list[dict] | None = None) -> bool | None:
    """Whether THIS run's tmux session lives with a live pane (see run_session); None when tmux cannot tell.

    Args:
        sessions: tmuxctl.list_sessions() when the caller has it already; else it is listed here.
    """
    if sessions is None:
        from orchestrator.agent import tmuxctl

        try:
            sessions = tmuxctl.list_sessions()
        except AgentFailure:
            return None  # no tmux or no libtmux here: the pid file may still tell
    s = run_session(ref, sessions)
    return s is not None and not s.get("dead")


def run_alive(ref: RunRef, sessions: list[dict] | None = None) -> bool | None:
    """Whether the run still runs: its tmux session has a live pane, a process carrying its marker lives,
    or its command's process group (the pid file) still exists. Either is enough: a wrongly declared crash is worse than a late one (a follower
    would stop, a status would say crashed while the trainer still holds its GPUs). None when neither can
    tell."""
    alive = session_alive(ref, sessions)
    if alive:
        return True
    if runprocs.run_processes(ref.path):
        return True  # a process of the run that left its group (or outlived its launcher) still runs
    pid = command_alive(ref)
    if pid:
        return True
    return alive if alive is not None else pid


def stopped_by(ref: RunRef, exit_info: dict | None) -> dict | None:
    """Who stopped the run, how and when ({by, via, at}), or None.

    An ended run: exit.json's "stopped" (its wrapper copied stop.json; a stop.json written after exit.json
    came too late to stop anything). A run without exit.json: its stop.json (the stop may still be under
    way, or the wrapper died with the command).
    """
    if exit_info is not None:
        stopped = exit_info.get("stopped")
        return stopped if isinstance(stopped, dict) else None
    return read_json(ref.path / STOP_NAME)


def state_of(exit_info: dict | None, alive: bool | None, stopped: dict | None = None) -> str:
    """running | stopped | succeeded | failed | crashed.

    Args:
        exit_info: exit.json, or None.
        alive: run_alive(); None (nothing could tell) counts as running: only a run known gone has crashed.
        stopped: stopped_by(): an ended run that a stop asked to end is "stopped", whatever its exit code.
    """
    if stopped is not None and (exit_info is not None or alive is False):
        return "stopped"
    if exit_info is not None:
        return "succeeded" if exit_info.get("exit_code") == 0 else "failed"
    return "crashed" if alive is False else "running"


def summarize(ref: RunRef, sessions: list[dict], now: float | None = None) -> dict:
    """Everything status shows about one run.

    Args:
        sessions: tmuxctl.list_sessions() (the state needs them).
    """
    info = ref.info
    exit_info = read_exit(ref)
    stopped = stopped_by(ref, exit_info)
    state = state_of(exit_info, None if exit_info is not None else run_alive(ref, sessions), stopped)
    started = parse_time((exit_info or {}).get("started")) or parse_time(info.get("created"))
    ended = parse_time((exit_info or {}).get("ended"))
    if ended is None and state == "running":
        ended = now if now is not None else time.time()
    metrics = last_metrics(ref.metrics)
    return {
        "run_id": ref.run_id,
        "experiment": info.get("experiment"),
        "tag": info.get("tag"),
        "state": state,
        "created": info.get("created"),
        "session": info.get("session"),
        "exit_code": (exit_info or {}).get("exit_code"),
        "signal": (exit_info or {}).get("signal"),
        "stopped": stopped if state == "stopped" else None,
        "duration_s": round(ended - started, 1) if (started is not None and ended is not None) else None,
        "tokens_per_s": (metrics or {}).get("tokens_per_s"),
        "step": (metrics or {}).get("step"),
    }


def list_runs(workdir: str | Path, sessions: list[dict]) -> list[dict]:
    """summarize() of every run directory, oldest first (created_key)."""
    return [summarize(ref, sessions) for ref in run_refs(workdir)]


# ------------------------------------------------------------------------------------------ the lock


class LaunchLock:
    """One launch of an experiment at a time: flock on `<workdir>/locks/<experiment>.lock` (released by the
    kernel if the agent dies, so it never goes stale) plus the holder's pid, run id and start time in the
    file. Launches of different experiments take different locks and run side by side; the GPUs they may
    share are claimed one by one (orchestrator.agent.claims)."""

    def __init__(self, workdir: str | Path, experiment: str):
        self.experiment = check_name("experiment", experiment)
        self.path = Path(workdir) / "locks" / f"{experiment}.lock"
        self.fd: int | None = None

    def acquire(self, holder: dict) -> None:
        """Take the lock without waiting.

        Raises:
            AgentFailure("LockHeld"): another launch of this experiment holds it; message and data name pid,
                run id, since.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            other = self._read_holder()
            who = (
                f"pid {other.get('pid')} launching run {other.get('run_id')} since {other.get('since')}"
                if other
                else "a launch that has not written its name yet"
            )
            raise AgentFailure(
                "LockHeld",
                f"another launch of experiment {self.experiment} holds {self.path}: {who}",
                fix="wait for it to finish, then check `dflashctl status`",
                data={"holder": other or {}, "lock": str(self.path)},
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode() + b"\n", 0)
        self.fd = fd

    def _read_holder(self) -> dict | None:
        # The winner writes its name right after taking the lock; give it a moment.
        for _ in range(20):
            data = read_json(self.path)
            if data:
                return data
            time.sleep(0.05)
        return None

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
                self.fd = None
