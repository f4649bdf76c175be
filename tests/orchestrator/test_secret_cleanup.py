"""A launch that fails after the run's secret file is written (tmux refuses the session) removes that file:
no start_training.sh will ever read and delete it."""

from __future__ import annotations

import os
import subprocess

from tests.orchestrator.test_secret_env import SECRET, files_holding, write_inventory


def test_a_launch_whose_tmux_session_fails_to_start_leaves_no_secret_behind(tmp_path, dflashctl):
    """tmux refuses the new session after the run directory and its files are written (a command line over
    tmux's message size: "command too long"; listing the sessions worked): the launch fails naming tmux, and
    the secret file that no start_training.sh will read is gone with it. A tmux server of the test's own."""
    inv = write_inventory(tmp_path)
    text = inv.read_text()
    assert text.count("]\n    env:") == 1
    inv.write_text(text.replace("]\n    env:", f", {'x' * 20000}]\n    env:"))  # an argument python -c ignores
    (tmp_path / "tmux").mkdir()
    env = dict(os.environ, HF_TOKEN=SECRET, DFLASHCTL_STATE_DIR=str(tmp_path / "state"),
               TMUX_TMPDIR=str(tmp_path / "tmux"))
    try:
        res = dflashctl("--inventory", str(inv), "launch", "cmd", env=env, timeout=180)
        assert res.returncode != 0 and "tmux new-session dflash-cmd failed: command too long" in res.stderr, \
            res.stdout + res.stderr
        run_dirs = list((tmp_path / "work" / "runs").iterdir())
        assert len(run_dirs) == 1 and (run_dirs[0] / "launch.env0").is_file()  # it got that far
        assert not (run_dirs[0] / "launch.secret0").exists()
        assert files_holding(tmp_path / "work", SECRET.encode()) == []
    finally:
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True)
