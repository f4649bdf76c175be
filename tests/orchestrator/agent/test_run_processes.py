"""Every process of a run is the run's (orchestrator.agent.runprocs, by its environment marker): a launch of the
experiment, and a resume of that run, are refused while a process of it lives, naming it, even after its
exit.json; a stop of that run ends it; then the launch goes ahead. Real launches on the local target, real tmux."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from orchestrator.agent import runprocs
from orchestrator.ops.launch import LaunchSpec, launch
from orchestrator.ops.stop import stop
from waiting import wait_for

pytestmark = pytest.mark.usefixtures("isolated_tmux")

# Leaves a daemon behind (its own session, no terminal, the log's pipe closed) and ends at once, exit 0.
LEAVES_A_DAEMON = [sys.executable, "-c", (
    "import subprocess, sys\n"
    "d = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', 'left-behind'],"
    " start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "print('daemon', d.pid, flush=True)\n")]


def spec(argv):
    return LaunchSpec(experiment="orphan", kind="command", target="local", command=argv,
                      venv_profile={"kind": "workstation"})


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_launch_is_refused_while_a_process_of_an_earlier_run_lives(local_target):
    first = launch(local_target, spec(LEAVES_A_DAEMON))
    run_dir = Path(first.run_dir)
    wait_for(lambda: (run_dir / "exit.json").exists(), what="the first run's end")
    pid = int((run_dir / "train.log").read_text().split("daemon ", 1)[1].split()[0])
    assert [p.pid for p in runprocs.run_processes(run_dir)] == [pid]

    with pytest.raises(Exception) as info:
        launch(local_target, spec(["true"]))
    text = str(info.value)
    assert f"cannot launch orphan: run {first.run_id} still has 1 live process(es): pid {pid} (" in text, text
    assert "left-behind" in text and f"dflashctl stop {first.run_id}" in text

    with pytest.raises(Exception) as info:  # nor may the run be resumed: two writers in one run
        launch(local_target, spec(["true"]), resume=first.run_id)
    text = str(info.value)
    assert f"cannot resume run {first.run_id}: run {first.run_id} still has 1 live process(es): pid {pid} (" in text
    assert "left-behind" in text

    out = stop(local_target, first.run_id, grace_s=2)
    assert out.signals == ["SIGINT"] and runprocs.run_processes(run_dir) == []
    second = launch(local_target, spec(["true"]))
    assert second.run_id != first.run_id
