"""The agent's side of stop (orchestrator.agent.verbs.stop, orchestrator.agent.stopping), called as the agent
calls it, on runs launched for real (start_training.sh in a private tmux server): who asked is on disk before
the first signal reaches the command, and a run that already ended gets no signal and gives its session's name
back. The workstation's side (which target, the records, the CLI): tests/orchestrator/ops/test_stop.py."""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path

import pytest

from orchestrator.agent import runprocs, stopping, tmuxctl
from orchestrator.agent.protocol import AgentFailure, Emitter
from orchestrator.agent.verbs import stop as stop_verb
from orchestrator.names import session_name
from orchestrator.ops.launch import LaunchSpec, launch
from waiting import wait_for

pytestmark = pytest.mark.usefixtures("isolated_tmux")

# On SIGINT it prints what stop.json holds at that moment, then ends as python does on Ctrl-C (130).
READS_STOP_JSON = [sys.executable, "-c", (
    "import os, signal, sys, time\n"
    "def on_int(*_):\n"
    "    print('stop.json at SIGINT: ' + open(os.path.join(os.environ['DFLASHCTL_RUN_DIR'], 'stop.json')).read(),"
    " flush=True)\n"
    "    sys.exit(130)\n"
    "signal.signal(signal.SIGINT, on_int)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n")]
WHO = {"by": "alice@ws-[1]", "via": "dflashctl stop"}


def spec(experiment: str, argv: list[str]) -> LaunchSpec:
    return LaunchSpec(experiment=experiment, kind="command", target="local", command=argv,
                      venv_profile={"kind": "workstation"})


def stop(workdir: str, run_id: str, **request) -> tuple[dict, list[dict]]:
    """The stop verb as the agent runs it: the request's JSON in, the result and the events it emitted out."""
    out = io.StringIO()
    result = stop_verb.run({"workdir": workdir, "run_id": run_id, **request}, Emitter(out))
    return result, [json.loads(line) for line in out.getvalue().splitlines()]


def test_who_asked_is_on_disk_before_the_first_signal_and_ends_in_exit_json(local_target):
    res = launch(local_target, spec("asked", READS_STOP_JSON))
    log = Path(res.run_dir) / "train.log"
    wait_for(lambda: "\nready\n" in log.read_text())

    result, events = stop(local_target.workdir, res.run_id, grace_s=30, requested_by=WHO)
    assert [e["signal"] for e in events if e.get("step") == "stop"] == ["SIGINT"] == result["signals"]
    seen = json.loads(log.read_text().rsplit("stop.json at SIGINT: ", 1)[1].split("\n}", 1)[0] + "\n}")
    assert {k: seen[k] for k in ("by", "via")} == WHO  # the command saw it: written before the signal
    assert result["state"] == "stopped" and result["exit"]["exit_code"] == 130
    assert result["exit"]["stopped"] == seen  # the wrapper copied it into exit.json


def test_a_run_that_already_ended_gets_no_signal_and_frees_its_session_name(local_target):
    res = launch(local_target, spec("done", ["true"]))
    wait_for(lambda: (Path(res.run_dir) / "exit.json").exists())
    assert tmuxctl.find_session(session_name("done")) is not None  # remain-on-exit kept the dead pane

    result, events = stop(local_target.workdir, res.run_id, requested_by=WHO)
    assert result["already_ended"] and result["signals"] == [] and events == []
    assert result["state"] == "succeeded" and result["exit"]["stopped"] is None  # not a stop: it had ended
    assert not (Path(res.run_dir) / "stop.json").exists()
    assert tmuxctl.find_session(session_name("done")) is None  # the next launch of `done` may take the name


def test_an_unknown_or_unsafe_run_is_refused_by_name(local_target):
    with pytest.raises(AgentFailure) as info:
        stop(local_target.workdir, "nope-1")
    assert info.value.type == "RunNotFound" and info.value.message == (
        f"no run nope-1 in {local_target.workdir}/runs")
    with pytest.raises(AgentFailure) as info:
        stop(local_target.workdir, "../escape")
    assert info.value.type == "BadRunId"


# ------------------------------------------------------------------ escalation until no process is left

# The command's leader ends on SIGINT; its children do not: bash's background `sleep` inherits the ignored TERM
# (trap '' TERM) and a non-interactive shell's ignored INT; the setsid python leaves the group and the session
# (only the run's environment marker finds it) and ignores both. None of them holds the log's pipe, so the wrapper
# writes exit.json as soon as the leader has ended.
DEAF = [sys.executable, "-c", (
    "import os, subprocess, sys\n"
    "ignore = 'import signal, time; signal.signal(2, signal.SIG_IGN); signal.signal(15, signal.SIG_IGN); time.sleep(600)'\n"
    "quiet = dict(stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "sleeper = subprocess.Popen(['bash', '-c', \"trap '' TERM; sleep 600 >/dev/null & echo $!; wait\"],"
    " stdout=subprocess.PIPE, text=True, **quiet)\n"
    "bash_child = sleeper.stdout.readline().strip()\n"
    "daemon = subprocess.Popen([sys.executable, '-c', ignore], start_new_session=True, stdout=subprocess.DEVNULL,"
    " **quiet)\n"
    "print('children', sleeper.pid, bash_child, daemon.pid, flush=True)\n"
    "print('ready', flush=True)\n"
    "import time; time.sleep(600)\n")]
# Ignores SIGINT; on SIGTERM takes half a second to finish, then exits 0.
SLOW_TERM = [sys.executable, "-c", (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "def on_term(*_):\n"
    "    time.sleep(0.5)\n"
    "    print('finished after SIGTERM', flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, on_term)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n")]
STUBBORN = [sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(600)\n"]


def ready(run_dir: Path) -> str:
    """Wait until the command has printed `ready` (its pid file is there by then); returns the log."""
    log = run_dir / "train.log"
    wait_for(lambda: (run_dir / "pid").exists() and log.exists() and "\nready\n" in log.read_text(), what="ready")
    return log.read_text()


def alive(pid: int) -> bool:
    return runprocs.describe_pid(pid) is not None


def test_children_deaf_to_int_and_term_are_killed_and_the_kill_is_reported(local_target):
    """exit.json appears after SIGINT (the leader ended), yet children live: the stop goes on to SIGTERM and
    SIGKILL, reaches the child that left the group, and says exactly what it sent; nothing of the run is left."""
    res = launch(local_target, spec("deaf", DEAF))
    log = ready(Path(res.run_dir))
    children = [int(p) for p in log.split("children ", 1)[1].split("\n", 1)[0].split()]
    assert all(alive(p) for p in children)

    result, events = stop(local_target.workdir, res.run_id, grace_s=0.5, requested_by=WHO)
    assert result["signals"] == ["SIGINT", "SIGTERM", "SIGKILL"]
    sent = [e["signal"] for e in events if e.get("step") == "stop" and e["message"].startswith("sending")]
    assert sent == ["SIGINT", "SIGTERM", "SIGKILL"]
    assert any(f"pid(s) {children[2]}" in e["message"] for e in events), events  # the setsid daemon, by marker
    assert [p for p in children if alive(p)] == []
    assert runprocs.run_processes(res.run_dir) == []
    assert result["state"] == "stopped" and result["exit"]["exit_code"] == 130  # the leader's own end, on SIGINT


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_sigterm_grace_is_waited_for(local_target):
    """A run that finishes 0.5 s after SIGTERM is given its grace: it is not SIGKILLed."""
    res = launch(local_target, spec("slowterm", SLOW_TERM))
    ready(Path(res.run_dir))
    result, _ = stop(local_target.workdir, res.run_id, grace_s=3, requested_by=WHO)
    assert result["signals"] == ["SIGINT", "SIGTERM"]
    assert result["exit"]["exit_code"] == 0 and result["exit"]["signal"] is None
    assert "finished after SIGTERM" in (Path(res.run_dir) / "train.log").read_text()


# STUBBORN, plus a process outside the run (no marker: env -i; its own session) that keeps the log's pipe open
# for 3 s: the wrapper waits for tee to drain it before it writes exit.json.
SLOW_LOG = [sys.executable, "-c", "import signal, subprocess, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "subprocess.Popen(['setsid', 'env', '-i', 'sleep', '3'], stdin=subprocess.DEVNULL)\n"
            "print('ready', flush=True)\ntime.sleep(600)\n"]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_after_sigkill_the_stop_waits_for_exit_json(local_target):
    """After SIGKILL the wrapper may take seconds to finish the log (tee drains it) and write exit.json; the
    stop waits for it, so its answer has the run's end."""
    res = launch(local_target, spec("stubborn", SLOW_LOG))
    ready(Path(res.run_dir))
    result, _ = stop(local_target.workdir, res.run_id, grace_s=0.3, requested_by=WHO)
    assert result["signals"] == ["SIGINT", "SIGTERM", "SIGKILL"]
    assert result["exit"] is not None and result["exit"]["signal"] == "SIGKILL"
    assert result["state"] == "stopped"


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_stop_before_the_pid_file_signals_the_pane(local_target):
    """A run whose wrapper has not written its pid file yet (here: never will) is stopped through the group of
    its tmux pane."""
    run_id = "early-20260101-000000"
    run_dir = Path(local_target.workdir) / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "experiment": "early"}))
    tmuxctl.new_session(session_name("early"), f"{sys.executable} -c 'import time; time.sleep(600)'",
                        str(run_dir), run_id)
    s = wait_for(lambda: tmuxctl.find_session(session_name("early")))
    pane = s["pane_pid"]
    assert alive(pane) and not (run_dir / "pid").exists()

    result, _ = stop(local_target.workdir, run_id, grace_s=5, requested_by=WHO)
    assert result["signals"] == ["SIGINT"]
    assert not alive(pane)


def test_a_run_whose_processes_are_gone_is_marked_stopped_without_waiting(local_target, tmp_path):
    """The container restarted under the run: a stale pid file, no session, no exit.json. No signal, no wait for
    an exit.json nothing will write, and the answer says so."""
    run_id = "gone-20260101-000000"
    run_dir = Path(local_target.workdir) / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "experiment": "gone"}))
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    (run_dir / "pid").write_text(f"{dead.pid}\n")
    t0 = time.monotonic()
    result, events = stop(local_target.workdir, run_id, requested_by=WHO)
    assert time.monotonic() - t0 < 3
    assert result["signals"] == [] and not result["already_ended"] and result["state"] == "stopped"
    assert [e["message"] for e in events] == [
        f"run {run_id}: the run's processes are gone (container restarted?); marked stopped"]
    assert json.loads((run_dir / "stop.json").read_text())["by"] == WHO["by"]


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.skipif(not (FREEZER / "cgroup.procs").exists() or os.geteuid() != 0,
                    reason="needs root and cgroup v1's freezer (a frozen task does not die of SIGKILL until thawed)")
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_process_that_outlives_sigkill_fails_the_stop_naming_it(local_target, monkeypatch):
    """A process SIGKILL cannot end (frozen by the cgroup v1 freezer, as a task in uninterruptible I/O would
    be): the stop fails naming its pid and command line, after saying it sent SIGKILL."""
    monkeypatch.setattr(stopping, "_AFTER_KILL_S", 1.0)
    res = launch(local_target, spec("frozen", STUBBORN))
    run_dir = Path(res.run_dir)
    ready(run_dir)
    pid = int((run_dir / "pid").read_text())
    cg = FREEZER / f"dflash-test-{os.getpid()}"
    cg.mkdir()
    try:
        (cg / "cgroup.procs").write_text(str(pid))
        (cg / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (cg / "freezer.state").read_text().strip() == "FROZEN", what="frozen")
        with pytest.raises(AgentFailure) as info:
            stop(local_target.workdir, res.run_id, grace_s=0.2, requested_by=WHO)
        err = info.value
        assert err.type == "StopFailed" and err.data["pids"] == [pid]
        assert err.message.startswith(f"run {res.run_id}: 1 process(es) still alive after SIGINT, SIGTERM, SIGKILL: "
                                      f"pid {pid} ({sys.executable} -c import signal")
        assert str(pid) in err.fix
    finally:
        (cg / "freezer.state").write_text("THAWED")
        wait_for(lambda: not alive(pid), what="the thawed process to die of its pending SIGKILL")
        (cg / "cgroup.procs").read_text() or cg.rmdir()


# ------------------------------------------------- what the mutation run found untested (tests/mutation/run.py)

# The leader sleeps; a setsid child (its own group and session, found by the marker only) dies of SIGINT.
WITH_DAEMON = [sys.executable, "-c", (
    "import subprocess, sys, time\n"
    "d = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True,"
    " stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "e = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True,"
    " stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "print('daemon', d.pid, e.pid, flush=True)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n")]


def test_sigint_reaches_a_process_that_left_the_group_at_the_first_step(local_target):
    """The group's leader and a setsid child both end on SIGINT: one step, the child signalled by pid at it."""
    res = launch(local_target, spec("daemon", WITH_DAEMON))
    log = ready(Path(res.run_dir))
    daemons = sorted(int(p) for p in log.split("daemon ", 1)[1].split("\n", 1)[0].split())
    result, events = stop(local_target.workdir, res.run_id, grace_s=5, requested_by=WHO)
    assert result["signals"] == ["SIGINT"]
    assert [(e["step"], e["message"], e["signal"]) for e in events if e.get("message", "").startswith("also sent")] == [
        ("stop", f"also sent SIGINT to pid(s) {daemons[0]}, {daemons[1]}, which left the run's process group", "SIGINT")]
    assert not any(alive(d) for d in daemons) and runprocs.run_processes(res.run_dir) == []


# The leader ends at once; its setsid child ignores INT and TERM and keeps the log's pipe open, so the wrapper
# (in the pane's group) waits for tee, which waits for the child: the pid file's group is empty, the pane lives.
LEADER_GONE = [sys.executable, "-c", (
    "import subprocess, sys\n"
    "c = subprocess.Popen([sys.executable, '-c', 'import signal, sys, time\\n"
    "signal.signal(2, signal.SIG_IGN); signal.signal(15, signal.SIG_IGN)\\n"
    "print(\"ready\", flush=True)\\ntime.sleep(600)'], start_new_session=True)\n"
    "print('child', c.pid, flush=True)\n")]


def test_when_the_groups_leader_is_gone_the_panes_group_is_never_signalled(local_target):
    """The pane's group holds the wrapper and its tee, which must live on to finish the log and write exit.json:
    with the command's leader gone, only the run's own processes are signalled, and exit.json is written."""
    res = launch(local_target, spec("leadergone", LEADER_GONE))
    run_dir = Path(res.run_dir)
    log = ready(run_dir)
    child = int(log.split("child ", 1)[1].split()[0])
    leader = int((run_dir / "pid").read_text())
    wait_for(lambda: not runprocs.group_members(leader), what="the leader's end")
    assert alive(child) and not (run_dir / "exit.json").exists()  # tee still holds the pipe: no exit.json yet
    result, events = stop(local_target.workdir, res.run_id, grace_s=0.3, requested_by=WHO)
    assert result["signals"] == ["SIGINT", "SIGTERM", "SIGKILL"]
    assert [e["message"].split(" (", 1)[1].split(";")[0] for e in events if e.get("message", "").startswith("sending")] \
        == ["its processes"] * 3  # no group: the leader is gone
    assert result["exit"] is not None and result["exit"]["exit_code"] == 0  # the wrapper lived to write it
    assert result["state"] == "stopped" and not alive(child)


def test_stop_json_says_who_and_through_which_verb_with_defaults_for_what_was_not_said(tmp_path):
    stopping._record_stop(tmp_path, {"by": "bob@ws", "via": "dflashctl launch --replace"})
    rec = json.loads((tmp_path / "stop.json").read_text())
    assert (rec["by"], rec["via"]) == ("bob@ws", "dflashctl launch --replace") and rec["at"].endswith("Z")
    stopping._record_stop(tmp_path, None)
    assert {k: v for k, v in json.loads((tmp_path / "stop.json").read_text()).items() if k != "at"} == {
        "by": "unknown", "via": "dflashctl stop"}
    stopping._record_stop(tmp_path, {"by": "", "via": None})
    assert {k: v for k, v in json.loads((tmp_path / "stop.json").read_text()).items() if k != "at"} == {
        "by": "unknown", "via": "dflashctl stop"}


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_run_that_ended_with_a_child_left_is_stopped_not_already_ended(local_target):
    """exit.json is there (the leader exited 0) but a background child of it lives on in its group, deaf to
    SIGINT (a non-interactive shell's background job): the stop signals it, and does not call the run ended."""
    res = launch(local_target, spec("leftover", ["bash", "-c", "sleep 600 >/dev/null 2>&1 & echo child $!; echo ready"]))
    run_dir = Path(res.run_dir)
    wait_for(lambda: (run_dir / "exit.json").exists(), what="exit.json")
    child = int((run_dir / "train.log").read_text().rsplit("child ", 1)[1].split()[0])  # after the echoed command
    assert alive(child)
    result, events = stop(local_target.workdir, res.run_id, grace_s=2, requested_by=WHO)
    assert result["signals"] == ["SIGINT", "SIGTERM"] and not result["already_ended"]
    assert not alive(child) and result["exit"]["exit_code"] == 0
    # its state is its own recorded end: a stop.json written after exit.json came too late to stop the run
    assert result["state"] == "succeeded"


def test_before_the_pid_file_the_panes_whole_group_is_counted_and_named(local_target):
    run_id = "early2-20260101-000000"
    run_dir = Path(local_target.workdir) / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "experiment": "early2"}))
    tmuxctl.new_session(session_name("early2"), "bash -c 'sleep 600 & sleep 600 & wait'", str(run_dir), run_id)
    s = wait_for(lambda: tmuxctl.find_session(session_name("early2")))
    pane = s["pane_pid"]
    wait_for(lambda: len(runprocs.group_members(pane)) == 3, what="bash and its two sleeps")
    result, events = stop(local_target.workdir, run_id, grace_s=5, requested_by=WHO)
    assert result["signals"][0] == "SIGINT"
    sending = [e["message"] for e in events if e.get("message", "").startswith("sending")]
    assert sending[0] == f"sending SIGINT to run {run_id} (process group {pane}; 3 process(es) left)"
    assert runprocs.group_members(pane) == []
    assert result["session"] == session_name("early2")


def test_a_gone_run_and_an_unknown_one_are_answered_as_stop_events_and_with_the_fix(local_target):
    run_id = "gone2-20260101-000000"
    run_dir = Path(local_target.workdir) / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_id": run_id, "experiment": "gone2"}))
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    (run_dir / "pid").write_text(f"{dead.pid}\n")
    _, events = stop(local_target.workdir, run_id, requested_by=WHO)
    assert [(e["event"], e["step"]) for e in events] == [("progress", "stop")]
    with pytest.raises(AgentFailure) as info:
        stop(local_target.workdir, "nope-2")
    assert info.value.fix == "dflashctl status"


# STUBBORN, with a process outside the run (no marker, its own session) holding the log's pipe for 6 s: far
# longer than the stop's steps take, shorter than its 10 s wait for exit.json after SIGKILL.
SLOWER_LOG = SLOW_LOG[:2] + [SLOW_LOG[2].replace("'sleep', '3'", "'sleep', '6'")]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_after_sigkill_the_stop_waits_for_exit_json_while_the_wrapper_lives(local_target):
    assert "'sleep', '6'" in SLOWER_LOG[2]
    res = launch(local_target, spec("slower", SLOWER_LOG))
    ready(Path(res.run_dir))
    result, _ = stop(local_target.workdir, res.run_id, grace_s=0.3, requested_by=WHO)
    assert result["signals"] == ["SIGINT", "SIGTERM", "SIGKILL"]
    assert result["exit"] is not None and result["exit"]["signal"] == "SIGKILL"


@pytest.mark.skipif(not (FREEZER / "cgroup.procs").exists() or os.geteuid() != 0,
                    reason="needs root and cgroup v1's freezer (a frozen task does not die of SIGKILL until thawed)")
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_failed_stop_gives_the_ps_command_for_its_pids_and_the_signals_it_sent(local_target, monkeypatch):
    monkeypatch.setattr(stopping, "_AFTER_KILL_S", 1.0)
    two = [sys.executable, "-c", "import signal, subprocess, sys, time\nsignal.signal(2, signal.SIG_IGN)\n"
           "signal.signal(15, signal.SIG_IGN)\nc = subprocess.Popen([sys.executable, '-c', 'import signal, time\\n"
           "signal.signal(2, signal.SIG_IGN); signal.signal(15, signal.SIG_IGN); time.sleep(600)'])\n"
           "print('child', c.pid, flush=True)\nprint('ready', flush=True)\ntime.sleep(600)\n"]
    res = launch(local_target, spec("frozen2", two))
    run_dir = Path(res.run_dir)
    log = ready(run_dir)
    pids = sorted([int((run_dir / "pid").read_text()), int(log.split("child ", 1)[1].split()[0])])
    cg = FREEZER / f"dflash-test2-{os.getpid()}"
    cg.mkdir()
    try:
        for pid in pids:
            (cg / "cgroup.procs").write_text(str(pid))
        (cg / "freezer.state").write_text("FROZEN")
        wait_for(lambda: (cg / "freezer.state").read_text().strip() == "FROZEN", what="frozen")
        with pytest.raises(AgentFailure) as info:
            stop(local_target.workdir, res.run_id, grace_s=0.2, requested_by=WHO)
        err = info.value
        assert err.fix == f"check `nvidia-smi` and `ps -o pid,pgid,stat,cmd -p {pids[0]},{pids[1]}` in the target"
        assert err.data == {"pids": pids, "signals": ["SIGINT", "SIGTERM", "SIGKILL"]}
    finally:
        (cg / "freezer.state").write_text("THAWED")
        wait_for(lambda: not any(alive(p) for p in pids), what="the thawed processes to die of their pending SIGKILL")
        (cg / "cgroup.procs").read_text() or cg.rmdir()
