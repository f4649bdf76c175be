"""templates/rebuild_venv.sh's switch, prune and no-op paths, on real builds (uv, the cpu lock, a LocalTarget;
the shared uv cache of tests/orchestrator/ops/test_venv.py): with keep 1 the previous venv is never pruned (a
rollback must find it), `current` is never missing for a reader while a rebuild switches it (a symlink renamed
over the old one, not removed and made again), and the no-op check compares the stamp's Python request too
(the same lock under another `python:` is a new venv, not "nothing to do")."""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from orchestrator.agent import venvinfo
from orchestrator.ops.venv import rebuild_venv
from orchestrator.target import LocalTarget
from orchestrator.transport.local import LocalTransport

SHARED_CACHE = os.environ.get("DFLASHCTL_TEST_UV_CACHE", "/var/tmp/dflashctl-test-uv-cache")

pytestmark = pytest.mark.slow


def profile(**kw) -> dict:
    return {"kind": "uv", "lock": "cpu", "python": "3.11", "wheelhouse": ["/opt/wheels"], "uv_cache_dir": SHARED_CACHE,
            "keep": 1, **kw}


@pytest.fixture(scope="module")
def target():
    """A workdir (not under /tmp, as test_venv's) with one venv built from the cpu lock, keep 1."""
    wd = Path(tempfile.mkdtemp(prefix="dflash-venv-switch-", dir="/var/tmp"))
    t = LocalTarget(name="local", workdir=str(wd), transport=LocalTransport())
    assert rebuild_venv(t, profile()).action == "built"
    yield t
    subprocess.run(["rm", "-rf", str(wd)])


def venvs(t) -> Path:
    return Path(t.workdir) / "venvs"


def link(t, name: str) -> str | None:
    p = venvs(t) / name
    return os.readlink(p) if p.is_symlink() else None


def test_keep_1_keeps_the_previous_venv_and_a_rollback_finds_it(target):
    before = link(target, "current")
    second = rebuild_venv(target, profile(), force=True)
    assert second.action == "built" and second.previous == before and link(target, "previous") == before
    assert (venvs(target) / before / venvinfo.STAMP).is_file(), sorted(p.name for p in venvs(target).iterdir())
    assert before not in second.pruned
    back = rebuild_venv(target, profile(), rollback=True)
    assert back.action == "rollback" and link(target, "current") == before
    assert subprocess.run([str(venvs(target) / "current" / "bin" / "python"), "-c", "import torch"]).returncode == 0


def test_a_reader_of_current_never_finds_it_missing_during_a_switch(target):
    """A reader resolving venvs/current/bin/python in a loop for the whole rebuild: every look finds it."""
    before = link(target, "current")
    py = venvs(target) / "current" / "bin" / "python"
    stop, looks, misses = threading.Event(), [0], []

    def reader() -> None:
        while not stop.is_set():
            looks[0] += 1
            if not os.path.exists(py):
                misses.append(looks[0])

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        report = rebuild_venv(target, profile(), force=True)
    finally:
        stop.set()
        t.join()
    assert report.action == "built" and link(target, "current") == report.venv != before
    assert looks[0] > 1000 and misses == [], (looks[0], misses[:5])


def test_the_same_lock_under_another_python_request_is_not_a_no_op(target):
    """`python: "3.11"` then `python: "3.11.N"` (the same interpreter asked for by its full version) with the
    same lock and bundle: the stamp's Python differs, so it builds; asked again, nothing to do."""
    full = platform.python_version()
    before = link(target, "current")
    stamp = (venvs(target) / before / venvinfo.STAMP).read_text().split()
    assert stamp[2] != full, stamp
    again = rebuild_venv(target, profile(python=full))
    assert again.action == "built" and again.venv != before
    assert (venvs(target) / again.venv / venvinfo.STAMP).read_text().split()[2] == full
    assert rebuild_venv(target, profile(python=full)).action == "noop"
