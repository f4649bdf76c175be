"""A run that fills its file system and dies of it: the follow's answer (the agent's tail) names the full file
system, a cause that needs no byte of the full disk. A command-kind run has no trainer.launch to name it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.agent.requests import TailAnswer, TailRequest
from orchestrator.inventory import parse_inventory
from orchestrator.ops.launch import launch_experiment
from orchestrator.target import open_target


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_command_run_that_fills_its_disk_is_named_full_in_the_follows_answer(tmp_path, monkeypatch):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("needs root to mount a tmpfs")
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("TMUX_TMPDIR", str(tmp_path))  # a tmux server of the test's own
    fill = "import os, sys\nwith open(os.environ['DFLASHCTL_RUN_DIR'] + '/fill', 'wb') as f:\n" \
           "    while True:\n        f.write(b'x' * 65536)\n        f.flush()\n"
    text = (f"targets:\n  local: {{kind: local, workdir: {mnt}}}\n"
            f"experiments:\n  fill: {{kind: command, target: local, command: [{sys.executable!r}, -c, {fill!r}]}}\n")
    inv = parse_inventory(text)
    (tmp_path / "inventory.yaml").write_text(text)
    try:
        run = launch_experiment(inv, "fill")
        target = open_target(inv, "local")
        try:
            answer = target.agent("tail", TailRequest(run_id=run.run_id, follow=True).to_json(), answer=TailAnswer,
                                  timeout=300)
        finally:
            target.close()
        assert answer.state != "running"
        assert answer.disk_full is not None, answer
        assert answer.disk_full["path"] == str(mnt / "runs" / run.run_id)
        assert answer.disk_full["free_bytes"] < 1 << 20 and answer.disk_full["total_bytes"] == 2 << 20
        # what the user reads: the installed dflashctl's outcome line names the full file system, and --json says it
        shown = subprocess.run(["dflashctl", "--inventory", str(tmp_path / "inventory.yaml"), "logs", run.run_id],
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode in (1, 2), shown.stderr  # failed, or crashed where its traceback reached the log
        [last] = [line for line in shown.stderr.splitlines() if line.startswith(f"run {run.run_id}: ")]
        assert f": its file system is full ({mnt / 'runs' / run.run_id}: " in last and "free of 2.0 MiB" in last
        as_json = subprocess.run(["dflashctl", "--inventory", str(tmp_path / "inventory.yaml"), "logs", run.run_id,
                                  "--json"], capture_output=True, text=True, timeout=120)
        outcome = [json.loads(x) for x in as_json.stdout.splitlines() if '"outcome"' in x][-1]
        assert outcome["disk_full"]["path"] == str(mnt / "runs" / run.run_id)
    finally:
        subprocess.run(["tmux", "kill-server"], capture_output=True)
        subprocess.run(["umount", "-l", str(mnt)])
