"""stop (orchestrator.ops.stop): the graceful escalation, where a run is looked for, and a user's stop recorded
and shown as "stopped" (by whom, when), distinct from failed and crashed: in exit.json, `status`, `runs`,
`logs` (its outcome line and exit code 5), and for `launch --replace` too. Through the
installed `dflashctl` console script on the local target, plus the wrapper script on its own."""

from __future__ import annotations

import getpass
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator import assets
from orchestrator.errors import RunNotFound
from orchestrator.ops.launch import LaunchSpec, launch
from orchestrator.ops.status import status
from orchestrator.ops.stop import stop

pytestmark = pytest.mark.usefixtures("isolated_tmux")

SCRIPT = assets.on_disk("start_training.sh")
# Ends on SIGINT the way python does (KeyboardInterrupt: killed by SIGINT, exit 130 as the wrapper records it).
SLEEPER = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"]
ME = f"{getpass.getuser()}@{socket.gethostname()}"
# Ignores SIGINT and SIGTERM: only the stop's last step, SIGKILL, ends it.
STUBBORN = [sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)\n"]


def _inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "inv.yaml"
    inv.write_text(textwrap.dedent(f"""\
        targets:
          local: {{kind: local, workdir: {json.dumps(str(tmp_path / 'work'))}, venv: workstation}}
        venvs:
          workstation: {{kind: workstation}}
        experiments:
          sleeper: {{kind: command, target: local, command: {json.dumps(SLEEPER)}}}
        """))
    return inv


def _wait_ready(run: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = run / "train.log"  # the wrapper writes its pid file first, then opens the log
        if (run / "pid").exists() and log.exists() and "\nready\n" in log.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{run.name} never got ready")


def _runs(tmp_path: Path) -> list[Path]:
    return sorted((p for p in (tmp_path / "work" / "runs").iterdir()), key=lambda p: p.stat().st_mtime)


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_stop_escalates_to_sigkill_for_a_run_that_ignores_int_and_term(tmp_path, local_target):
    t = local_target
    res = launch(t, LaunchSpec(experiment="stub", kind="command", target="local", command=STUBBORN,
                                venv_profile={"kind": "workstation"}))
    _wait_ready(Path(res.run_dir))
    events: list[dict] = []
    out = stop(t, res.run_id, grace_s=0.5, on_event=events.append)
    assert out.signals == ["SIGINT", "SIGTERM", "SIGKILL"]
    assert out.exit["signal"] == "SIGKILL" and out.state == "stopped"
    assert [e.signal for e in events if e.step == "stop"] == ["SIGINT", "SIGTERM", "SIGKILL"]
    st = status(t)
    assert st.run(res.run_id)["state"] == "stopped" and st.sessions == []  # the dead session was cleared
    again = stop(t, res.run_id, grace_s=0.5)
    assert again.already_ended and again.signals == []


def test_stop_unknown_run(tmp_path, local_target):
    with pytest.raises(RunNotFound, match="no run nope-1"):
        stop(local_target, "nope-1")


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_stop_is_recorded_and_shown_as_stopped_by_whom_and_when(tmp_path, dflashctl, dflashctl_main):
    inv = ["--inventory", str(_inventory(tmp_path))]
    assert dflashctl(*inv, "launch", "sleeper").returncode == 0
    run = _runs(tmp_path)[0]
    _wait_ready(run)

    stopped = dflashctl(*inv, "stop", run.name, "--grace", "5")
    assert stopped.returncode == 0, stopped.stderr
    ex = json.loads((run / "exit.json").read_text())
    assert (ex["exit_code"], ex["signal"]) == (130, "SIGINT")
    assert ex["stopped"]["by"] == ME and ex["stopped"]["via"] == "dflashctl stop" and ex["stopped"]["at"].endswith("Z")
    shown = f"stopped by {ME} (dflashctl stop) at {ex['stopped']['at']}"
    assert stopped.stdout.strip() == f"run {run.name} stopped with SIGINT: {shown} (exit code 130)"

    # What shows the stop, read in this process (orchestrator.cli.main): the installed script launched and stopped.
    st = json.loads(dflashctl_main(*inv, "status", "--json").stdout)
    row = next(r for r in st["runs"] if r["run_id"] == run.name)
    assert row["state"] == "stopped" and row["stopped"] == ex["stopped"]
    assert shown in dflashctl_main(*inv, "status").stdout

    rec = next(r for r in json.loads(dflashctl_main(*inv, "runs", "--json").stdout) if r["run_id"] == run.name)
    assert rec["stopped"] == ex["stopped"]
    assert f"by {ME} (dflashctl stop) at {ex['stopped']['at']}" in dflashctl_main(*inv, "runs").stdout

    logs = dflashctl_main(*inv, "logs", run.name, "--follow")
    assert logs.returncode == 5, logs.stderr
    assert logs.stderr.splitlines()[-1] == f"run {run.name}: {shown} (exit code 130)"
    js = [json.loads(line) for line in dflashctl_main(*inv, "logs", run.name, "--json").stdout.splitlines()]
    assert js[-1]["state"] == "stopped" and js[-1]["exit_code"] == 5


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_replace_records_the_old_run_as_stopped_by_the_launch(tmp_path, dflashctl, dflashctl_main):
    inv = ["--inventory", str(_inventory(tmp_path))]
    assert dflashctl(*inv, "launch", "sleeper").returncode == 0
    old = _runs(tmp_path)[0]
    _wait_ready(old)
    new = dflashctl(*inv, "launch", "sleeper", "--tag", "two", "--replace", "--grace", "5")
    assert new.returncode == 0, new.stderr
    ex = json.loads((old / "exit.json").read_text())
    assert ex["stopped"]["by"] == ME and ex["stopped"]["via"] == "dflashctl launch sleeper --replace"
    st = {r["run_id"]: r["state"] for r in json.loads(dflashctl_main(*inv, "status", "--json").stdout)["runs"]}
    assert st[old.name] == "stopped" and list(st.values()).count("running") == 1
    rec = next(r for r in json.loads(dflashctl_main(*inv, "runs", "--json").stdout) if r["run_id"] == old.name)
    assert rec["stopped"] == ex["stopped"]


def test_a_failure_and_a_crash_stay_what_they_are(tmp_path, dflashctl):
    from orchestrator.agent import liveness

    assert liveness.state_of({"exit_code": 130, "signal": "SIGINT", "stopped": None}, False) == "failed"
    assert liveness.state_of({"exit_code": 0, "stopped": {"by": ME}}, None, {"by": ME}) == "stopped"
    assert liveness.state_of(None, False) == "crashed"
    assert liveness.state_of(None, False, {"by": ME}) == "stopped"  # stopped, the wrapper gone with it
    assert liveness.state_of(None, True, {"by": ME}) == "running"  # a stop under way


def _wrapper_run(tmp_path: Path, stop_json: str | None) -> dict:
    d = tmp_path / "run"
    d.mkdir()
    (d / "launch.env0").write_bytes(f"PATH={os.environ['PATH']}".encode() + b"\0")
    if stop_json is not None:
        (d / "stop.json").write_text(stop_json)
    proc = subprocess.Popen(["bash", str(SCRIPT), str(d), "--", *SLEEPER], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    _wait_ready(d)
    os.killpg(int((d / "pid").read_text()), signal.SIGINT)
    proc.wait(30)
    return json.loads((d / "exit.json").read_text())


@pytest.mark.parametrize("stop_json, expected", [
    ('{"by": "a@b", "via": "dflashctl stop", "at": "2026-01-01T00:00:00Z"}',
     {"by": "a@b", "via": "dflashctl stop", "at": "2026-01-01T00:00:00Z"}),
    ('{\n  "at": "T",\n  "by": "a@b"\n}\n', {"at": "T", "by": "a@b"}),  # as write_json writes it
    (None, None),
    ("not json", None),  # anything but one JSON object is ignored: exit.json stays valid
])
def test_the_wrapper_copies_stop_json_into_exit_json(tmp_path, stop_json, expected):
    ex = _wrapper_run(tmp_path, stop_json)
    assert ex["stopped"] == expected and ex["exit_code"] == 130


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_stop_goes_where_the_record_says_and_without_a_record_where_the_user_says(tmp_path, dflashctl,
                                                                                 dflashctl_main):
    # orchestrator.ops.stop.stop_run: a recorded run is stopped on its recorded target (not the inventory's
    # default); a run this workstation has no record of (launched from another one) on --target, else on the
    # default target, where it is not found: the user is told where it looked and how to look further.
    inv_path = tmp_path / "inv.yaml"
    inv_path.write_text(textwrap.dedent(f"""\
        targets:
          local: {{kind: local, workdir: {json.dumps(str(tmp_path / 'work'))}, venv: workstation}}
          far: {{kind: local, workdir: {json.dumps(str(tmp_path / 'far'))}, venv: workstation}}
        venvs:
          workstation: {{kind: workstation}}
        experiments:
          one: {{kind: command, target: far, command: {json.dumps(SLEEPER)}}}
          two: {{kind: command, target: far, command: {json.dumps(SLEEPER)}}}
        """))
    inv = ["--inventory", str(inv_path)]
    for exp in ("one", "two"):
        launched = dflashctl(*inv, "launch", exp)
        assert launched.returncode == 0, launched.stderr
    one, two = (next((tmp_path / "far" / "runs").glob(f"{exp}-*")) for exp in ("one", "two"))
    _wait_ready(one)
    _wait_ready(two)

    stopped = dflashctl(*inv, "stop", one.name, "--grace", "5")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith(f"run {one.name} stopped with SIGINT: stopped by {ME}")

    from orchestrator.records import records_path

    records_path().unlink()  # as on another workstation: no record of `two` here
    missed = dflashctl(*inv, "stop", two.name, "--grace", "5")
    assert missed.returncode == 4, missed.stderr
    assert f"no run {two.name}" in missed.stderr
    # The fix names the inventory this command read (-i), so pasted as printed it looks at the same targets.
    [fix] = [line.removeprefix("fix: ") for line in missed.stderr.splitlines() if line.startswith("fix: ")]
    assert fix == f"dflashctl -i {shlex.quote(str(inv_path))} status --target local"
    pasted = dflashctl(*shlex.split(fix)[1:])
    assert pasted.returncode == 0 and "local" in pasted.stdout, pasted.stderr
    assert not (two / "exit.json").exists()  # still running where it is

    stopped = dflashctl(*inv, "stop", two.name, "--target", "far", "--grace", "5")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads((two / "exit.json").read_text())["stopped"]["by"] == ME
    assert json.loads(dflashctl_main(*inv, "runs", "--json").stdout) == []  # a stop alone makes no record of a run
