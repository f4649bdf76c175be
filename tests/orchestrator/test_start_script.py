"""templates/start_training.sh on its own: exit.json for every way a command ends, the log, the env file,
and signals reaching the command (not the logger) so the log stays complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator import assets
from waiting import wait_for

SCRIPT = assets.on_disk("start_training.sh")

CHILD = r"""
import signal, sys, time
def term(*_):
    print("got TERM, saving", flush=True); time.sleep(0.3); print("saved", flush=True); sys.exit(5)
signal.signal(signal.SIGTERM, term)
if "ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    print("got INT, cleaning", flush=True); time.sleep(0.3); print("clean", flush=True); raise
"""


def run_dir(tmp_path: Path, env: dict[str, str] | None = None) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    env = env if env is not None else {"PATH": os.environ["PATH"]}
    (d / "launch.env0").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    return d


def start(d: Path, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(SCRIPT), str(d), "--", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def ready(d: Path) -> bool:
    """The child printed its own `ready` line (the wrapper's first line echoes the command, so match a line)."""
    try:
        return (d / "pid").exists() and "\nready\n" in (d / "train.log").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("code", [0, 3])
def test_exit_json_has_the_exit_code_and_the_log_everything(tmp_path, code):
    d = run_dir(tmp_path)
    proc = start(d, "sh", "-c", f"echo out; echo err >&2; exit {code}")
    assert proc.wait(10) == code
    ex = json.loads((d / "exit.json").read_text())
    assert ex["exit_code"] == code and ex["signal"] is None
    assert ex["started"].endswith("Z") and ex["ended"] >= ex["started"]
    log = (d / "train.log").read_text()
    assert "out\n" in log and "err\n" in log and f"exit code {code}" in log


def test_exit_json_carries_the_root_cause_the_trainers_launcher_wrote(tmp_path):
    d = run_dir(tmp_path)
    cause = {"rank": 2, "signal": "SIGKILL", "summary": "rank 2 (drafter) was killed by SIGKILL", "traceback": None,
             "others": [{"rank": 0, "summary": "a \"quoted\" 100% [line]\nand more", "consequence": True}]}
    code = f"import json, sys; open('root_cause.json', 'w').write(json.dumps({cause!r}) + '\\n'); sys.exit(1)"
    proc = subprocess.Popen(["bash", str(SCRIPT), str(d), "--", sys.executable, "-c", code], cwd=d,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    assert proc.wait(10) == 1
    ex = json.loads((d / "exit.json").read_text())
    assert ex["exit_code"] == 1 and ex["root_cause"] == cause
    (tmp_path / "b").mkdir()
    d2 = run_dir(tmp_path / "b")
    assert start(d2, "true").wait(10) == 0 and json.loads((d2 / "exit.json").read_text())["root_cause"] is None


def test_environment_comes_only_from_the_env_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAK_ME", "nope")
    d = run_dir(tmp_path, {"PATH": os.environ["PATH"], "ODD": "a b'$(id)\"\\"})
    proc = start(d, sys.executable, "-c", "import os; print(repr(os.environ.get('ODD')), os.environ.get('LEAK_ME'))")
    assert proc.wait(10) == 0
    assert repr("a b'$(id)\"\\") + " None" in (d / "train.log").read_text()


def test_a_missing_command_still_writes_exit_json(tmp_path):
    d = run_dir(tmp_path)
    start(d, "/nonexistent/trainer").wait(10)
    assert json.loads((d / "exit.json").read_text())["exit_code"] == 127


def test_sigint_to_the_group_reaches_python_and_the_log_keeps_its_cleanup(tmp_path):
    d = run_dir(tmp_path)
    start(d, sys.executable, "-c", CHILD)
    wait_for(lambda: ready(d))
    os.killpg(int((d / "pid").read_text()), signal.SIGINT)
    wait_for(lambda: (d / "exit.json").exists())
    ex = json.loads((d / "exit.json").read_text())
    assert ex == {**ex, "exit_code": 130, "signal": "SIGINT"}
    log = (d / "train.log").read_text()
    assert "got INT, cleaning" in log and "clean\n" in log  # written after the signal: the logger survived


def test_sigterm_handler_output_is_logged_and_its_code_kept(tmp_path):
    d = run_dir(tmp_path)
    start(d, sys.executable, "-c", CHILD)
    wait_for(lambda: ready(d))
    os.killpg(int((d / "pid").read_text()), signal.SIGTERM)
    wait_for(lambda: (d / "exit.json").exists())
    ex = json.loads((d / "exit.json").read_text())
    assert (ex["exit_code"], ex["signal"]) == (5, None)
    assert "saved\n" in (d / "train.log").read_text()


def test_sigkill_is_named_in_exit_json(tmp_path):
    d = run_dir(tmp_path)
    start(d, sys.executable, "-c", CHILD, "ignore-term")
    wait_for(lambda: ready(d))
    os.killpg(int((d / "pid").read_text()), signal.SIGKILL)
    wait_for(lambda: (d / "exit.json").exists())
    ex = json.loads((d / "exit.json").read_text())
    assert (ex["exit_code"], ex["signal"]) == (137, "SIGKILL")


def test_signal_to_the_wrapper_is_forwarded_and_recorded(tmp_path):
    # tmux kill-session / Ctrl-C in the pane signal the wrapper; it passes the signal on and still records.
    d = run_dir(tmp_path)
    proc = start(d, sys.executable, "-c", CHILD)
    wait_for(lambda: ready(d))
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: (d / "exit.json").exists())
    assert json.loads((d / "exit.json").read_text())["signal"] == "SIGINT"
    assert "clean\n" in (d / "train.log").read_text()
