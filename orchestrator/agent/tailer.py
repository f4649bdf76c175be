"""Agent-side pieces of `tail`: find a run, read a growing file in whole lines from a byte offset, wait for
changes cheaply, and tell running / succeeded / failed / crashed apart. Standard library only.

Offsets are byte offsets into the file. A chunk handed out always ends with a newline (a partial last line
is held back until its newline arrives or the run is over), so "the offset after the last complete line
received" is always a valid place to resume from: nothing is lost, nothing is repeated.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import select
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.agent.protocol import AgentFailure

# One read from a file per pump; one event carries at most this much (the JSON line stays small enough
# for the workstation to parse without stalls).
READ_BYTES = 1 << 20
EVENT_BYTES = 256 << 10
# A "line" longer than this without a newline is handed out anyway, or the follower would stall forever.
MAX_LINE = 1 << 20

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,159}$")  # as orchestrator.agent.runs.RUN_ID


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
        return f"dflash-{self.experiment}" if self.experiment else None

    @property
    def log(self) -> Path:
        return self.path / "train.log"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def exit_file(self) -> Path:
        return self.path / "exit.json"


def _read_json(path: Path) -> dict | None:
    """A JSON object from path, or None if it is absent or not (yet) a complete JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _created_key(ref: RunRef) -> tuple:
    # run.json's ISO timestamp sorts correctly as text; the directory mtime breaks ties and covers runs
    # whose run.json is missing.
    try:
        mtime = ref.path.stat().st_mtime
    except OSError:
        mtime = 0.0
    return (str(ref.info.get("created") or ""), mtime, ref.run_id)


def list_runs(workdir: str | Path) -> list[RunRef]:
    """Every run directory under `<workdir>/runs`, oldest first."""
    root = Path(workdir) / "runs"
    if not root.is_dir():
        return []
    refs = []
    for entry in root.iterdir():
        if entry.is_dir() and _RUN_ID.match(entry.name):
            refs.append(RunRef(entry.name, entry, _read_json(entry / "run.json") or {}))
    return sorted(refs, key=_created_key)


def resolve_run(workdir: str | Path, run_id: str | None = None, experiment: str | None = None) -> RunRef:
    """The run named `run_id`, else the newest run of `experiment`, else the newest run of all.

    Raises:
        AgentFailure("RunNotFound"): no such run (the message lists the newest runs there are).
    """
    if run_id is not None:
        if not _RUN_ID.match(str(run_id)) or ".." in str(run_id):
            raise AgentFailure("RunNotFound", f"{run_id!r} is not a valid run id", fix="dflashctl runs")
        path = Path(workdir) / "runs" / run_id
        if path.is_dir():
            return RunRef(run_id, path, _read_json(path / "run.json") or {})
    runs = list_runs(workdir)
    if run_id is None:
        candidates = [r for r in runs if experiment is None or r.experiment == experiment]
        if candidates:
            return candidates[-1]
    known = ", ".join(r.run_id for r in runs[-5:]) or "none"
    what = f"no run {run_id!r}" if run_id is not None else (
        f"no run of experiment {experiment!r}" if experiment else "no runs")
    raise AgentFailure(
        "RunNotFound",
        f"{what} in {Path(workdir) / 'runs'} (newest runs: {known})",
        fix="dflashctl runs   # lists runs; or launch one with dflashctl launch EXPERIMENT",
        data={"runs": [r.run_id for r in runs[-20:]]},
    )


def session_alive(ref: RunRef) -> bool | None:
    """Whether the tmux session running THIS run lives with a live pane; None when tmux cannot tell.

    Launch tags each session with the run id (`@dflash_run`) and keeps dead panes (remain-on-exit), so a
    session of the same name that runs a later run, or whose pane died, does not count as this run alive.
    A session without the tag (started by hand) is matched by name.
    """
    from orchestrator.agent import tmuxctl

    if not ref.session:
        return None
    try:
        sessions = tmuxctl.list_sessions()
    except AgentFailure:
        return None  # no tmux or no libtmux here: the pid file may still tell
    for s in sessions:
        if s["name"] == ref.session and s.get("run_id") in (None, ref.run_id):
            return not s.get("dead")
    return False


def pid_alive(ref: RunRef) -> bool | None:
    """Whether the process group in `<run>/pid` (written by start_training.sh) still exists; None if unknown."""
    try:
        pid = int((ref.path / "pid").read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_alive(ref: RunRef) -> bool | None:
    """Whether the run still runs: its tmux session has a live pane, or its command's process group (the
    pid file) still exists. Either is enough: a wrongly declared crash ends the follow, a missed one only
    delays it until the hang check speaks. None when neither can tell."""
    alive = session_alive(ref)
    if alive:
        return True
    pid = pid_alive(ref)
    if pid:
        return True
    return alive if alive is not None else pid


def state_of(exit_info: dict | None, alive: bool | None) -> str:
    """running | succeeded | failed | crashed, from exit.json (or its absence) and the session."""
    if exit_info is not None:
        return "succeeded" if exit_info.get("exit_code") == 0 else "failed"
    return "crashed" if alive is False else "running"


def read_exit(ref: RunRef) -> dict | None:
    """exit.json's contents, or None while the run has not ended (or the file is still being written)."""
    return _read_json(ref.exit_file)


# ------------------------------------------------------------------------------------- baseline


def throughput_summary(metrics_path: Path, skip_first: int = 3) -> dict | None:
    """Median tokens/s of a finished run's metrics (warm-up records skipped), or None if it has none."""
    values = []
    try:
        with open(metrics_path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                v = rec.get("tokens_per_s") if isinstance(rec, dict) else None
                if isinstance(v, (int, float)) and v > 0:
                    values.append(float(v))
    except OSError:
        return None
    if len(values) > skip_first + 2:
        values = values[skip_first:]
    if not values:
        return None
    values.sort()
    mid = len(values) // 2
    median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    return {"tokens_per_s": median, "samples": len(values)}


def last_good_baseline(workdir: str | Path, ref: RunRef) -> dict | None:
    """Throughput of the newest succeeded run of the same experiment that is older than `ref`."""
    if not ref.experiment:
        return None
    for other in reversed(list_runs(workdir)):
        if other.run_id == ref.run_id or other.experiment != ref.experiment:
            continue
        if _created_key(other) >= _created_key(ref):
            continue
        exit_info = read_exit(other)
        if exit_info is None or exit_info.get("exit_code") != 0:
            continue
        summary = throughput_summary(other.metrics)
        if summary is not None:
            return {"run_id": other.run_id, **summary}
    return None


# ------------------------------------------------------------------------------------- cursors


def tail_offset(path: Path, lines: int) -> int:
    """Byte offset where the last `lines` complete lines of path begin (0 if it has fewer, or is absent).

    Reads backwards in blocks, so a 10 GB log costs a few reads. A trailing partial line does not count.
    """
    if lines <= 0:
        try:
            size = path.stat().st_size
        except OSError:
            return 0
        with open(path, "rb") as fh:
            return _last_newline_end(fh, size)
    try:
        fh = open(path, "rb")
    except OSError:
        return 0
    with fh:
        size = os.fstat(fh.fileno()).st_size
        end = _last_newline_end(fh, size)  # the partial last line is not one of the N
        pos, seen, block = end, 0, 65536
        while pos > 0:
            start = max(0, pos - block)
            fh.seek(start)
            data = fh.read(pos - start)
            # newlines before `end`; the (lines+1)-th newline from the end marks the start
            idx = len(data)
            while True:
                idx = data.rfind(b"\n", 0, idx)
                if idx < 0:
                    break
                if start + idx + 1 == end:  # the newline that ends the last line
                    continue
                seen += 1
                if seen == lines:
                    return start + idx + 1
            pos = start
        return 0


def _last_newline_end(fh, size: int) -> int:
    """Offset just after the last newline in the first `size` bytes (0 if none)."""
    pos, block = size, 65536
    while pos > 0:
        start = max(0, pos - block)
        fh.seek(start)
        data = fh.read(pos - start)
        idx = data.rfind(b"\n")
        if idx >= 0:
            return start + idx + 1
        pos = start
    return 0


class LineCursor:
    """Reads a growing file from a byte offset, handing out only whole lines.

    `read()` returns (start_offset, bytes) chunks that each end with a newline; `read(final=True)` also
    hands out a trailing partial line (the writer is done). The file may not exist yet.
    """

    def __init__(self, path: Path, offset: int = 0):
        self.path = path
        self.offset = int(offset)
        self._fh = None
        self.truncations = 0

    def _open(self) -> bool:
        if self._fh is None:
            try:
                self._fh = open(self.path, "rb")
            except OSError:
                return False
        return True

    def size(self) -> int:
        if not self._open():
            return 0
        return os.fstat(self._fh.fileno()).st_size

    def read(self, final: bool = False, limit: int = READ_BYTES) -> list[tuple[int, bytes]]:
        """Whole-line chunks from the offset to the current end (at most `limit` bytes per call)."""
        if not self._open():
            return []
        size = os.fstat(self._fh.fileno()).st_size
        if size < self.offset:
            # Truncated or replaced in place: the old offset means nothing now; start again from 0.
            self.truncations += 1
            self.offset = 0
        if size == self.offset:
            return []
        data = os.pread(self._fh.fileno(), min(limit, size - self.offset), self.offset)
        if not data:
            return []
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            if not final and len(data) < MAX_LINE:
                return []  # only a partial line so far: hold it until its newline arrives
            cut = len(data)
        elif final and self.offset + len(data) == size:
            cut = len(data)  # the writer is done: the partial tail is the last line
        chunks = []
        pos = 0
        while pos < cut:
            end = min(cut, pos + EVENT_BYTES)
            if end < cut:
                nl = data.rfind(b"\n", pos, end)
                # No newline in this window: one over-long line; keep it in one event (it is one line).
                end = nl + 1 if nl >= pos else cut
            chunks.append((self.offset + pos, data[pos:end]))
            pos = end
        self.offset += cut
        return chunks

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


# ------------------------------------------------------------------------------------- waiting

_IN_MODIFY = 0x2
_IN_ATTRIB = 0x4
_IN_CLOSE_WRITE = 0x8
_IN_MOVED_TO = 0x80
_IN_CREATE = 0x100


class DirWatcher:
    """Sleeps until something in a directory changes, or a timeout.

    inotify (through ctypes; no package needed) wakes the follower within a millisecond of a write, which a
    bare `tail -F` also does; a sleep-poll would add half its period to every line's latency. Where inotify
    is unavailable this degrades to sleeping `fallback` seconds.
    """

    def __init__(self, directory: Path, fallback: float = 0.05):
        self.fallback = fallback
        self._fd = -1
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0:
                mask = _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE
                if libc.inotify_add_watch(fd, os.fsencode(str(directory)), mask) >= 0:
                    self._fd = fd
                else:
                    os.close(fd)
        except (OSError, AttributeError):
            self._fd = -1

    @property
    def uses_inotify(self) -> bool:
        return self._fd >= 0

    def wait(self, timeout: float) -> None:
        """Return when the directory changed or after `timeout` seconds (at most `fallback` without inotify)."""
        if self._fd < 0:
            time.sleep(max(0.0, min(timeout, self.fallback)))
            return
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        if ready:
            try:
                while os.read(self._fd, 65536):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

