"""Fixtures shared by the orchestrator tests that start real runs (launch, status/stop, runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.target import LocalTarget
from orchestrator.transport.local import LocalTransport


@pytest.fixture
def isolated_tmux(tmp_path, monkeypatch):
    """Own tmux server (TMUX_TMPDIR) and own run records (DFLASHCTL_STATE_DIR) per test; the tmux server dies
    at the end, taking any session a test left behind with it.

    Test modules that launch runs use it for every test: `pytestmark = pytest.mark.usefixtures("isolated_tmux")`.
    """
    d = tmp_path / "tmux"
    d.mkdir()
    monkeypatch.setenv("TMUX_TMPDIR", str(d))
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    yield
    subprocess.run(["tmux", "kill-server"], capture_output=True)


@pytest.fixture
def local_target(tmp_path) -> LocalTarget:
    """A local target named "local" whose workdir is `<tmp_path>/work` (created)."""
    wd = tmp_path / "work"
    wd.mkdir(exist_ok=True)
    return LocalTarget(name="local", workdir=str(wd), transport=LocalTransport())


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def dflashctl():
    """Run the INSTALLED `dflashctl` console script (found on PATH, as a user types it) in a subprocess,
    with this checkout first on PYTHONPATH. Returns run(*args, env=None, timeout=120, cwd=None)."""
    exe = shutil.which("dflashctl")
    if exe is None:
        # Not a skip: the console script is what users run (`pip install -e .` puts it on PATH, see .ci/run).
        pytest.fail("the dflashctl console script is not on PATH: pip install -e . (see .ci/run)")

    def run(*args: str, env: dict | None = None, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
        full = dict(os.environ if env is None else env)
        full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full.get("PYTHONPATH")) if p)
        full.setdefault("COLUMNS", "200")
        return subprocess.run([exe, *args], capture_output=True, text=True, env=full, timeout=timeout, cwd=cwd,
                              stdin=subprocess.DEVNULL)

    return run
