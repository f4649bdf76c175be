"""The agent's side of stop (orchestrator.agent.verbs.stop, orchestrator.agent.stopping), called as the agent
calls it, on runs launched for real (start_training.sh in a private tmux server): who asked is on disk before
the first signal reaches the command, and a run that already ended gets no signal and gives its session's name
back. The workstation's side (which target, the records, the CLI): tests/orchestrator/ops/test_stop.py."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pytest

from orchestrator.agent import tmuxctl
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
