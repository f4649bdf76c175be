"""Agent-side pieces of `tail`: read a growing file in whole lines from a byte offset, wait for changes
cheaply, and find the last good run's throughput. Finding runs lives in orchestrator.agent.rundirs, their
state and their liveness in orchestrator.agent.liveness. Standard library only.

Offsets are byte offsets into the file. A chunk handed out always ends with a newline (a partial last line
is held back until its newline arrives or the run is over), so "the offset after the last complete line
received" is always a valid place to resume from: nothing is lost, nothing is repeated.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import select
import time
from pathlib import Path

from orchestrator.agent.liveness import state_of, stopped_by
from orchestrator.agent.rundirs import created_key, read_exit, run_refs, RunRef

# One read from a file per pump; one event carries at most this much (the JSON line stays small enough
# for the workstation to parse without stalls).
READ_BYTES = 1 << 20
EVENT_BYTES = 256 << 10
# A "line" longer than this without a newline is handed out anyway, or the follower would stall forever.
MAX_LINE = 1 << 20


# ------------------------------------------------------------------------------------- baseline


def throughput_summary(metrics_path: Path, skip_first: int = 3) -> dict | None:
    """Median tokens/s of a finished run's metrics (warm-up records skipped), or None if it has none."""
    values = []
    try:
        with open(metrics_path, encoding="utf-8", errors="replace") as fh:  # a torn or foreign byte: that line only
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
    """The last good run: throughput of the newest run of the same experiment, older than `ref`, whose state
    is "succeeded" (liveness.state_of: ended with exit 0 and not stopped by `dflashctl stop` or `launch
    --replace`, whose trainer may exit 0 on SIGINT after a shortened run). The one definition of it."""
    if not ref.experiment:
        return None
    for other in reversed(run_refs(workdir)):
        if other.run_id == ref.run_id or other.experiment != ref.experiment:
            continue
        if created_key(other) >= created_key(ref):
            continue
        exit_info = read_exit(other)
        if exit_info is None or state_of(exit_info, False, stopped_by(other, exit_info)) != "succeeded":
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
                # No IN_CLOSE_WRITE: a close changes no content (the write already raised IN_MODIFY), and a
                # writer that opens the log per line would wake us twice per line, the second time for nothing.
                mask = _IN_MODIFY | _IN_ATTRIB | _IN_MOVED_TO | _IN_CREATE
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

