"""orchestrator.agent.__main__: the agent imports its verb, and the verb everything it uses, BEFORE it reads the
request. A call started early (orchestrator.preconnect starts launch's while the workstation still validates
the inventory) has its imports done by the time the request arrives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.ops.launch import LaunchSpec, launch_request

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("isolated_tmux")

# Runs `python -m orchestrator.agent VERB` in-process with a stdin that notes which modules were loaded when
# the request was read; prints the project's modules imported after that.
PROBE = textwrap.dedent("""
    import json, os, sys
    from orchestrator.agent.__main__ import main

    class Stdin:
        def read(self):
            global at_read
            at_read = set(sys.modules)
            return os.environ["REQUEST"]

    sys.stdin = Stdin()
    rc = main(sys.argv[1:])
    late = sorted(m for m in set(sys.modules) - at_read if m.split(".")[0] == "orchestrator")
    print("LATE=" + json.dumps({"rc": rc, "late": late}), file=sys.stderr)
""")


def late_imports(verb: str, request: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), REQUEST=json.dumps(request))
    proc = subprocess.run([sys.executable, "-c", PROBE, verb], capture_output=True, text=True, env=env, timeout=120)
    line = next((x for x in proc.stderr.splitlines() if x.startswith("LATE=")), None)
    assert line is not None, proc.stderr[-2000:]
    return {**json.loads(line[len("LATE="):]), "stdout": proc.stdout}


def test_launch_imports_everything_it_uses_before_it_reads_the_request(tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    spec = LaunchSpec(experiment="early", kind="command", target="local", command=["true"],
                      venv_profile={"kind": "workstation"})
    request = launch_request(spec, created="2026-12-01T00:00:00Z", run_id="early-20261201T000000Z",
                             cli="dflashctl launch early", replace=False, grace_s=20.0, release_timeout_s=60.0,
                             dry_run=True, resume=None, warmup_device="cpu", claim_wait_s=5.0)
    got = late_imports("launch", {"workdir": str(workdir), **request})
    assert got["rc"] == 0, got["stdout"][-2000:]  # the dry run's checks (tmux session, venv) really ran
    assert got["late"] == []


def test_no_request_on_stdin_runs_nothing(tmp_path):
    """What a call started early and then dropped reads: end-of-file. The verb must not run on defaults."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.agent", "echo"], input="", capture_output=True,
                          text=True, env=env, timeout=60)
    last = json.loads(proc.stdout.splitlines()[-1])
    assert proc.returncode == 2 and last["event"] == "error" and last["type"] == "NoRequest", proc.stdout
