"""One follow, wherever it starts: `launch --follow` and `logs --follow` are the same code
and print the same alerts and signature diagnoses (never a raw dict); an alert states its configured
threshold. Through the installed `dflashctl` console script, on the local target."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("isolated_tmux")

# Prints, then stays silent while its session lives until the test creates the file named by $1 (once both
# follows have shown their hang alert; a shell, not python: no interpreter start-up inside the silence), then
# ends well. The 300 s cap only keeps a broken test from leaving a run behind.
SILENT = ["sh", "-c", 'echo started; i=0; while [ ! -e "$1" ] && [ $i -lt 6000 ]; do sleep 0.05; i=$((i+1)); done; '
          'echo done', "silent"]
HANG_SECONDS = 3
# A real crash the catalogue knows (missing-module).
CRASH = "print('step 1', flush=True); import accelerate_not_installed_here"


def _inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "inv.yaml"
    exps = {"silent": [*SILENT, str(tmp_path / "release")], "crash": [sys.executable, "-c", CRASH]}
    inv.write_text(textwrap.dedent(f"""\
        targets:
          local: {{kind: local, workdir: {json.dumps(str(tmp_path / 'work'))}, venv: workstation}}
        venvs:
          workstation: {{kind: workstation}}
        monitor: {{hang_seconds: {HANG_SECONDS}}}
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


class _Follow:
    """`dflashctl ARGS` started in the background; its stdout and stderr lines are collected as they come."""

    def __init__(self, exe: str, env: dict, *args: str):
        self.proc = subprocess.Popen([exe, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, stdin=subprocess.DEVNULL)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
                        for pipe, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line.rstrip("\n"))

    def alerted(self) -> bool:
        return any(line.startswith("alert (hang): ") for line in self.err)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(timeout)
        return code


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_hang_alert_states_hang_seconds_in_both_follows(tmp_path, dflashctl):
    inv = _inventory(tmp_path)
    import os
    import shutil

    exe = shutil.which("dflashctl")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]), COLUMNS="200")
    launched = _Follow(exe, env, "--inventory", str(inv), "launch", "silent", "--follow")
    logs = None
    try:
        run_id = _newest_run(tmp_path)
        logs = _Follow(exe, env, "--inventory", str(inv), "logs", run_id, "--follow")
        # The run stays silent until both follows have alerted (an event, not a sleep): however loaded the
        # machine, each follow sees a silence of hang_seconds and more.
        deadline = time.monotonic() + 120
        while not (launched.alerted() and logs.alerted()) and time.monotonic() < deadline:
            time.sleep(0.1)
        (tmp_path / "release").touch()
        launched.wait(120)
        logs.wait(120)
    finally:
        (tmp_path / "release").touch()
        for follow in (launched, logs):
            if follow is not None:
                follow.proc.kill()
    for name, follow in (("launch --follow", launched), ("logs --follow", logs)):
        stderr = "\n".join(follow.err)
        alerts = [line for line in follow.err if line.startswith("alert (hang): ")]
        assert len(alerts) == 1, (name, stderr)
        assert f"(hang_seconds: {HANG_SECONDS} s;" in alerts[0], (name, alerts[0])
        assert follow.proc.returncode == 0 and f"run {run_id}: succeeded (exit code 0)" in stderr, (name, stderr)
    assert "started" in launched.out and "done" in launched.out


def test_crash_diagnosis_is_printed_identically_by_both_follows(tmp_path, dflashctl):
    inv = _inventory(tmp_path)
    launched = dflashctl("--inventory", str(inv), "launch", "crash", "--follow", timeout=120)
    run_id = _newest_run(tmp_path)
    # --tail -1: the whole log again (without it the follow resumes after what launch --follow printed).
    logs = dflashctl("--inventory", str(inv), "logs", run_id, "--follow", "--tail", "-1", timeout=120)
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


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_the_follow_hint_launch_prints_works_when_the_runs_target_is_not_listed_first(tmp_path, dflashctl):
    """`logs RUN` finds the run where its record says it runs, not on the inventory's first target: the
    `follow:` line `launch` prints works as pasted whichever target comes first."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(textwrap.dedent(f"""\
        targets:
          first: {{kind: local, workdir: {json.dumps(str(tmp_path / 'first'))}, venv: workstation}}
          second: {{kind: local, workdir: {json.dumps(str(tmp_path / 'second'))}, venv: workstation}}
        venvs:
          workstation: {{kind: workstation}}
        experiments:
          two: {{kind: command, target: second, command: ["sh", "-c", "echo line-one; echo line-two"]}}
        """))
    launched = dflashctl("--inventory", str(inv), "launch", "two", timeout=120)
    assert launched.returncode == 0, launched.stderr
    hint = next(line.strip() for line in launched.stdout.splitlines() if line.strip().startswith("follow: "))
    pasted = hint.removeprefix("follow: ").split("    ")[0].split()
    assert pasted[:2] == ["dflashctl", "logs"] and pasted[-1] == "--follow", hint
    logs = dflashctl("--inventory", str(inv), *pasted[1:], timeout=120)
    assert logs.returncode == 0, (logs.returncode, logs.stderr)
    lines = logs.stdout.splitlines()
    assert lines.index("line-one") + 1 == lines.index("line-two"), logs.stdout
    assert "succeeded (exit code 0)" in logs.stderr


GAP = 150  # more lines than the default --tail of 100


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_new_follow_resumes_after_the_last_line_the_killed_one_printed(tmp_path, dflashctl):
    """A follow killed (SIGKILL: no clean-up runs), lines written meanwhile, a new `logs RUN --follow`: it prints
    exactly the lines the first never printed, none twice and none skipped, however many; `--tail N` still
    starts at the last N lines."""
    import os
    import shutil

    from orchestrator import records

    gate = tmp_path / "gate"
    script = ('for i in $(seq -w 1 10); do echo "first-$i"; done; '
              'while [ ! -e "$1" ]; do sleep 0.05; done; '
              f'for i in $(seq -w 1 {GAP}); do echo "gap-$i"; done')
    inv = tmp_path / "inv.yaml"
    inv.write_text(textwrap.dedent(f"""\
        targets:
          local: {{kind: local, workdir: {json.dumps(str(tmp_path / 'work'))}, venv: workstation}}
        venvs:
          workstation: {{kind: workstation}}
        experiments:
          gap: {{kind: command, target: local, command: {json.dumps(["sh", "-c", script, "gap", str(gate)])}}}
        """))
    assert dflashctl("--inventory", str(inv), "launch", "gap", timeout=120).returncode == 0
    run_id = _newest_run(tmp_path)
    log = tmp_path / "work" / "runs" / run_id / "train.log"
    exe = shutil.which("dflashctl")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]), COLUMNS="200")
    first = _Follow(exe, env, "--inventory", str(inv), "logs", run_id, "--follow")
    try:
        deadline = time.monotonic() + 60
        # Printed, and noted as printed: the offset file reaches the end of the (now still) log.
        while not ("first-10" in first.out and records.printed_offset(run_id, "local") == log.stat().st_size):
            assert time.monotonic() < deadline, (first.out, first.err)
            time.sleep(0.05)
    finally:
        first.proc.kill()
    first.wait(30)
    gate.touch()
    deadline = time.monotonic() + 60
    while not (log.parent / "exit.json").exists():
        assert time.monotonic() < deadline, "the run did not end"
        time.sleep(0.1)
    second = dflashctl("--inventory", str(inv), "logs", run_id, "--follow", timeout=120)
    assert second.returncode == 0, second.stderr
    printed = second.stdout.splitlines()
    assert [ln for ln in printed if not ln.startswith("[dflashctl ")] == [f"gap-{i:03d}" for i in range(1, GAP + 1)]
    whole = dflashctl("--inventory", str(inv), "logs", run_id, "--tail", "-1", timeout=120).stdout.splitlines()
    assert first.out + printed == whole  # together: the whole log, each line once
    tail = dflashctl("--inventory", str(inv), "logs", run_id, "--follow", "--tail", "5", timeout=120)
    assert tail.stdout.splitlines() == whole[-5:]
