"""orchestrator.agent.tmuxctl: the tmux sessions runs live in, on a real tmux server (a private one per test:
TMUX_TMPDIR in tmp_path, conftest's isolated_tmux), through the tmux CLI (the one path, the same under a stock
python3 before any venv exists as in a venv)."""

from __future__ import annotations


import pytest

from orchestrator.agent import tmuxctl
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.tmuxctl import parse_panes
from orchestrator.quoting import render
from waiting import wait_for

pytestmark = pytest.mark.usefixtures("isolated_tmux")


@pytest.fixture
def no_outer_tmux(monkeypatch):
    """tmux of the test's own (isolated_tmux), never the developer's server when run from inside tmux."""
    monkeypatch.delenv("TMUX", raising=False)


def dead(name: str):
    return lambda: (s := tmuxctl.find_session(name)) is not None and s["dead"] and s


def test_no_server_yet_is_no_sessions_not_an_error(no_outer_tmux):
    assert tmuxctl.list_sessions() == []
    assert tmuxctl.find_session("dflash-x") is None
    assert tmuxctl.kill_session("dflash-x") is False


def test_a_session_carries_its_run_id_and_outlives_a_command_that_ends_at_once(no_outer_tmux, tmp_path):
    s = tmuxctl.new_session("dflash-fast", "exit 0", str(tmp_path), "fast-1")
    assert (s["name"], s["run_id"]) == ("dflash-fast", "fast-1")
    # remain-on-exit is set before the command runs: the session stays, its pane dead, its run id readable.
    ended = wait_for(dead("dflash-fast"))
    assert ended["run_id"] == "fast-1" and ended["pane_pid"] is not None


def test_the_command_line_runs_as_given_in_the_run_directory(no_outer_tmux, tmp_path):
    text = "[rank0]: it's \"quoted\" $(id) `id` [bold]x[/]\n\tend"
    line = render(["sh", "-c", 'printf %s "$1" > out.txt', "sh", text])
    tmuxctl.new_session("dflash-text", line, str(tmp_path), "text-1")
    wait_for(dead("dflash-text"))
    assert (tmp_path / "out.txt").read_text() == text  # relative path: the session's cwd is the one given


def test_names_are_exact_never_a_prefix(no_outer_tmux, tmp_path):
    tmuxctl.new_session("dflash-ab", "sleep 300", str(tmp_path), "ab-1")
    assert tmuxctl.find_session("dflash-a") is None
    assert tmuxctl.kill_session("dflash-a") is False  # tmux alone would take dflash-ab as its prefix match
    assert tmuxctl.find_session("dflash-ab")["run_id"] == "ab-1"
    tmuxctl.new_session("dflash-a", "sleep 300", str(tmp_path), "a-1")
    assert tmuxctl.kill_session("dflash-a") is True
    assert [s["name"] for s in tmuxctl.list_sessions()] == ["dflash-ab"]


def test_a_second_session_of_the_same_name_is_refused_and_the_first_keeps_its_run(no_outer_tmux, tmp_path):
    tmuxctl.new_session("dflash-one", "sleep 300", str(tmp_path), "one-1")
    with pytest.raises(AgentFailure) as info:
        tmuxctl.new_session("dflash-one", "echo replaced > replaced", str(tmp_path), "one-2")
    assert info.value.type == "TmuxFailed" and "dflash-one" in info.value.message
    assert tmuxctl.find_session("dflash-one")["run_id"] == "one-1" and not (tmp_path / "replaced").exists()


def test_no_tmux_in_the_target_names_the_package_to_install(no_outer_tmux, tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    with monkeypatch.context() as m, pytest.raises(AgentFailure) as info:  # PATH back before the server's teardown
        m.setenv("PATH", str(empty))
        tmuxctl.list_sessions()
    # The agent names what is missing; the workstation (ops/refusal.py) puts the install line, wrapped in the
    # ssh and pct commands that reach this target, in the fix.
    assert info.value.type == "TmuxMissing" and "tmux is not installed in the target" in info.value.message


def test_a_bad_experiment_name_is_refused_as_the_agent_reports_it():
    assert tmuxctl.session_name("exp.v2") == "dflash-exp_v2"  # tmux reads `.` as a window separator
    with pytest.raises(AgentFailure) as info:
        tmuxctl.session_name("../x")
    assert info.value.type == "BadName"


def test_parse_panes_skips_garbage_and_keeps_first_pane():
    lines = ["dflash-a\t10\t0\t\t1700000000\tr-1", "dflash-a\t11\t1\t2\t1700000000\tr-1", "garbage", "x\t\t1\t-1\t\t"]
    assert parse_panes(lines) == [
        {"name": "dflash-a", "pane_pid": 10, "dead": False, "dead_status": None, "created": 1700000000, "run_id": "r-1"},
        {"name": "x", "pane_pid": None, "dead": True, "dead_status": -1, "created": None, "run_id": None},
    ]


def test_a_tmux_that_cannot_run_is_missing_and_one_that_hangs_is_failed(no_outer_tmux, tmp_path, monkeypatch):
    """A `tmux` on PATH that is not a program the kernel can run names tmux missing, with the fix; a tmux
    server that does not answer is a failed tmux (its timeout cut to 1 s here), never a missing one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tmux = bin_dir / "tmux"
    tmux.write_bytes(b"\x7fELF not a program")
    tmux.chmod(0o755)
    with monkeypatch.context() as m, pytest.raises(AgentFailure) as info:
        m.setenv("PATH", str(bin_dir))
        tmuxctl.list_sessions()
    assert info.value.type == "TmuxMissing" and info.value.fix == "dflashctl rebuild-venv  (installs tmux)"
    tmux.write_text("#!/bin/sh\nexec sleep 60\n")
    real_run = tmuxctl.subprocess.run
    with monkeypatch.context() as m, pytest.raises(AgentFailure) as info:
        m.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
        m.setattr(tmuxctl.subprocess, "run", lambda *a, **kw: real_run(*a, **{**kw, "timeout": 1}))
        tmuxctl.list_sessions()
    assert info.value.type == "TmuxFailed" and "did not answer" in info.value.message, info.value.message


def test_the_start_answers_with_the_pane_that_runs_the_command_in_one_tmux_process(no_outer_tmux, tmp_path,
                                                                                   monkeypatch):
    """new_session's answer is the respawned pane (the command's own pid, not the placeholder's), the
    session of exactly its name where a longer one shares its prefix, read in the same tmux process."""
    import os
    import shutil
    from pathlib import Path

    calls = tmp_path / "calls"
    shim = tmp_path / "bin" / "tmux"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\necho \"$1\" >> {calls}\nexec {shutil.which('tmux')} \"$@\"\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}{os.pathsep}{os.environ['PATH']}")
    tmuxctl.new_session("dflash-ab", "exec sleep 301", str(tmp_path), "ab-1")
    calls.unlink()
    s = tmuxctl.new_session("dflash-a", "exec sleep 302", str(tmp_path), "a-1")
    assert calls.read_text().split() == ["new-session"]
    assert (s["name"], s["run_id"], s["dead"]) == ("dflash-a", "a-1", False)
    # The pane's process is the command's (the placeholder's was killed by respawn-pane); its shell may not
    # have reached `exec sleep` yet when the answer comes back, so the same pid is watched until it does.
    cmdline = Path(f"/proc/{s['pane_pid']}/cmdline")
    wait_for(lambda: cmdline.read_bytes().split(b"\0")[:2] == [b"sleep", b"302"])
    assert s == tmuxctl.find_session("dflash-a")
