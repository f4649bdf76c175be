"""Run directories inside the target, and the launch lock. Standard library only.

    <workdir>/runs/<run-id>/  run.json  config.json  train.log  metrics.jsonl  exit.json  pid
    <workdir>/launch.lock     held (flock) by the one launch in progress; its text names the holder

States: running (its session lives, pane alive, no exit.json), succeeded (exit 0), failed (exit != 0),
crashed (no exit.json and its session is gone or its pane dead: killed, container stopped).
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import re
import time
from pathlib import Path

from orchestrator.agent.protocol import AgentFailure

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,159}$")
LOCK_NAME = "launch.lock"
# How much of metrics.jsonl's end is read for the last tokens/s (lines are short; this is dozens of them).
_METRICS_TAIL = 64 * 1024


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
    """Return run_id if it is safe as one path component, else raise AgentFailure("BadRunId")."""
    if not isinstance(run_id, str) or not RUN_ID.match(run_id) or ".." in run_id:
        raise AgentFailure("BadRunId", f"bad run id {run_id!r}: only A-Z a-z 0-9 . _ - allowed, no '..'")
    return run_id


def runs_root(workdir: str | Path) -> Path:
    return Path(workdir) / "runs"


def read_json(path: Path) -> dict | None:
    """A JSON object from a file, or None when missing, partial or not an object."""
    try:
        data = json.loads(path.read_text())
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
    for n in range(1, 100):
        rid = run_id if n == 1 else f"{run_id}-{n}"
        try:
            (root / rid).mkdir()
            return rid, root / rid
        except FileExistsError:
            continue
    raise AgentFailure("RunDirExists", f"runs/{run_id} and 98 suffixed variants already exist in {root}")


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


def state_of(exit_info: dict | None, session: dict | None) -> str:
    """running | succeeded | failed | crashed.

    Args:
        exit_info: exit.json, or None.
        session: the tmux session running THIS run (matched by run id), or None.
    """
    if exit_info is not None:
        return "succeeded" if exit_info.get("exit_code") == 0 else "failed"
    if session is not None and not session.get("dead"):
        return "running"
    return "crashed"


def summarize(workdir: str | Path, run_id: str, sessions: list[dict], now: float | None = None) -> dict:
    """Everything status shows about one run."""
    d = runs_root(workdir) / run_id
    info = read_json(d / "run.json") or {}
    exit_info = read_json(d / "exit.json")
    session = next((s for s in sessions if s.get("run_id") == run_id), None)
    state = state_of(exit_info, session)
    started = parse_time((exit_info or {}).get("started")) or parse_time(info.get("created"))
    ended = parse_time((exit_info or {}).get("ended"))
    if ended is None and state == "running":
        ended = now if now is not None else time.time()
    metrics = last_metrics(d / "metrics.jsonl")
    return {
        "run_id": run_id,
        "experiment": info.get("experiment"),
        "tag": info.get("tag"),
        "state": state,
        "created": info.get("created"),
        "session": info.get("session"),
        "exit_code": (exit_info or {}).get("exit_code"),
        "signal": (exit_info or {}).get("signal"),
        "duration_s": round(ended - started, 1) if (started is not None and ended is not None) else None,
        "tokens_per_s": (metrics or {}).get("tokens_per_s"),
        "step": (metrics or {}).get("step"),
    }


def list_runs(workdir: str | Path, sessions: list[dict]) -> list[dict]:
    """Every run directory, oldest first (by run.json's created, then name)."""
    root = runs_root(workdir)
    if not root.is_dir():
        return []
    out = [summarize(workdir, p.name, sessions) for p in root.iterdir() if p.is_dir() and RUN_ID.match(p.name)]
    out.sort(key=lambda r: (r.get("created") or "", r["run_id"]))
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LaunchLock:
    """The one-launch-at-a-time lock of a workdir: flock on `<workdir>/launch.lock` (released by the kernel
    if the agent dies, so it never goes stale) plus the holder's pid, run id and start time in the file."""

    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK_NAME
        self.fd: int | None = None

    def acquire(self, holder: dict) -> None:
        """Take the lock without waiting.

        Raises:
            AgentFailure("LockHeld"): another launch holds it; message and data name pid, run id, since.
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
                f"another launch holds {self.path}: {who}",
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
