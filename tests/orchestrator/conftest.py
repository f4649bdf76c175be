"""Fixtures shared by the orchestrator tests that start real runs (launch, status/stop, runs)."""

from __future__ import annotations

import subprocess

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
