"""One follow, wherever it starts (issue 10, item 10): `launch --follow` and `logs --follow` are the same code
and print the same alerts and signature diagnoses (never a raw dict); an alert states its configured
threshold. Through the installed `dflashctl` console script, on the local target."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("isolated_tmux")

# Prints, then stays silent past hang_seconds while its session lives, then ends well.
SILENT = "import time; print('started', flush=True); time.sleep(14); print('done', flush=True)"
# A real crash the catalogue knows (missing-module).
CRASH = "print('step 1', flush=True); import accelerate_not_installed_here"


def _inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "inv.yaml"
    exps = {"silent": [sys.executable, "-c", SILENT], "crash": [sys.executable, "-c", CRASH]}
    inv.write_text(textwrap.dedent(f"""\
        targets:
          local: {{kind: local, workdir: {json.dumps(str(tmp_path / 'work'))}, venv: workstation}}
        venvs:
          workstation: {{kind: workstation}}
        monitor: {{hang_seconds: 8}}
        experiments:
        """) + "".join(f"  {name}: {{kind: command, target: local, command: {json.dumps(argv)}}}\n"
                       for name, argv in exps.items()))
    return inv


def _newest_run(tmp_path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = sorted((tmp_path / "work" / "runs").glob("*/run.json"))
        if runs:
            return runs[-1].parent.name
        time.sleep(0.1)
    raise AssertionError("no run directory appeared")


def _diagnosis(stderr: str) -> list[str]:
    """The signature block: its heading line and the indented lines under it."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("fatal: "))
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    return block


def test_hang_alert_states_hang_seconds_in_both_follows(tmp_path, dflashctl):
    inv = _inventory(tmp_path)
    import os
    import shutil

    exe = shutil.which("dflashctl")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]), COLUMNS="200")
    launched = subprocess.Popen([exe, "--inventory", str(inv), "launch", "silent", "--follow"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        run_id = _newest_run(tmp_path)
        logs = dflashctl("--inventory", str(inv), "logs", run_id, "--follow", timeout=120)
        out, err = launched.communicate(timeout=120)
    finally:
        launched.kill()
    for name, code, stderr in (("launch --follow", launched.returncode, err), ("logs --follow", logs.returncode, logs.stderr)):
        alerts = [line for line in stderr.splitlines() if line.startswith("alert (hang): ")]
        assert len(alerts) == 1, (name, stderr)
        assert "(hang_seconds: 8 s;" in alerts[0], (name, alerts[0])
        assert code == 0 and f"run {run_id}: succeeded (exit code 0)" in stderr, (name, stderr)
    assert "started" in out.splitlines() and "done" in out.splitlines()


def test_crash_diagnosis_is_printed_identically_by_both_follows(tmp_path, dflashctl):
    inv = _inventory(tmp_path)
    launched = dflashctl("--inventory", str(inv), "launch", "crash", "--follow", timeout=120)
    run_id = _newest_run(tmp_path)
    logs = dflashctl("--inventory", str(inv), "logs", run_id, "--follow", timeout=120)
    assert launched.returncode == logs.returncode == 2, (launched.stderr, logs.stderr)
    block = _diagnosis(logs.stderr)
    assert block[0] == ("fatal: Python module not installed in the run's venv: accelerate_not_installed_here "
                        "(missing-module, log line 4)")
    # What the user reads, in order: the diagnosis, the fix, then each false lead under "will not help".
    from test_diagnose import catalogue_entry

    entry = catalogue_entry("missing-module")
    module = "accelerate_not_installed_here"
    texts = [entry["diagnosis"], entry["fix"], *entry["not_this"]]
    diagnosis, fix, *not_this = (t.replace("{module}", module) for t in texts)
    assert len(not_this) == 2 and block[-4:] == [f"  diagnosis: {diagnosis}", f"  fix: {fix}",
                                                  *(f"  will not help: {item}" for item in not_this)]
    assert _diagnosis(launched.stderr) == block
    for stderr in (launched.stderr, logs.stderr):
        assert "{'signature'" not in stderr and "signature: {" not in stderr
        assert f"run {run_id}: failed (exit code 1)" in stderr
    # The same log lines on stdout, from the first line (launch's own 'launched' lines aside).
    assert [line for line in launched.stdout.splitlines() if not line.startswith(("launched ", "  follow: "))] \
        == logs.stdout.splitlines()
