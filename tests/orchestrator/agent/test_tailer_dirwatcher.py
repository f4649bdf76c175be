"""DirWatcher (agent tail's inotify wait): wakes on content changes, not on a writer closing the log."""

from __future__ import annotations

import time

import pytest

from orchestrator.agent.tailer import DirWatcher


@pytest.fixture
def watcher(tmp_path):
    w = DirWatcher(tmp_path, fallback=0.05)
    if not w.uses_inotify:
        pytest.skip("inotify is not available here")
    yield w
    w.close()


def _waited(w: DirWatcher, timeout: float) -> float:
    t = time.monotonic()
    w.wait(timeout)
    return time.monotonic() - t


def test_append_wakes_at_once_and_close_does_not(watcher, tmp_path):
    fh = open(tmp_path / "train.log", "ab")
    watcher.wait(0)  # drain the file's creation
    try:
        assert _waited(watcher, 0.3) >= 0.25  # nothing happened yet: the full timeout
        fh.write(b"step 1\n")
        fh.flush()
        assert _waited(watcher, 5.0) < 1.0  # the write wakes it
    finally:
        fh.close()
    # A close changes no content: waking for it would be a second, empty wake-up per line.
    assert _waited(watcher, 0.3) >= 0.25


def test_new_file_and_rename_wake(watcher, tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b"")
    assert _waited(watcher, 5.0) < 1.0
    (tmp_path / "exit.json.tmp").write_text("{}")
    watcher.wait(0)  # drain the temp file's own events
    (tmp_path / "exit.json.tmp").rename(tmp_path / "exit.json")
    assert _waited(watcher, 5.0) < 1.0
