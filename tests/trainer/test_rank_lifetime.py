"""A rank dies with its launcher (trainer.rank.die_with_launcher): torch starts each rank in a session of its
own, so without the kernel's parent-death signal a SIGKILLed `python -m trainer.launch` leaves its ranks
training into a run that has ended, on GPUs that look free."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest


from tests.trainer.test_trainer_launch import REPO, SPLIT, env, small_config, write  # noqa: F401
from orchestrator.agent import runprocs

RANK_LINE = "[rank "


def _gone(pid: int) -> bool:
    return runprocs.describe_pid(pid) is None  # a zombie waiting for its reaper counts as gone


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_sigkill_of_the_launcher_kills_every_rank_at_once(tmp_path, env):
    """SIGKILL of the elastic agent under a real 1 target + 2 drafter run: every rank is gone within 5 s, and
    no rank writes a checkpoint or the export afterwards."""
    run_dir = tmp_path / "run"
    cfg = write(tmp_path / "c.json", small_config(run_dir, SPLIT, max_steps=400, epochs=100, save_every=2))
    marker = {"DFLASHCTL_RUN_DIR": str(run_dir)}
    proc = subprocess.Popen([sys.executable, "-m", "trainer.launch", "--config", str(cfg)], env={**env, **marker},
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[rank 1] step 2/"):
            break
    ranks = [p for p in runprocs.run_processes(run_dir) if p.pid != proc.pid]
    assert len(ranks) == 3 and all("trainer.rank" in p.argv for p in ranks), ("".join(lines)[-3000:], ranks)
    assert all(p.pgid != proc.pid for p in ranks)  # torch's own sessions: a group signal would miss them

    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    while not all(_gone(p.pid) for p in ranks) and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert [p.describe() for p in ranks if not _gone(p.pid)] == []
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else []
    time.sleep(2)  # an orphan would go on saving every 2 steps
    again = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else []
    assert again == saved and not (run_dir / "export").exists()


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_rank_whose_launcher_died_before_it_armed_the_signal_ends_itself(tmp_path):
    """The race the getppid check closes: a rank started by a launcher that is no longer its parent (here: it
    names a pid that is not) ends at once instead of training unwatched."""
    code = "from trainer.rank import die_with_launcher; die_with_launcher(); print('still here')"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DFLASH_LAUNCHER_PID": "1", "RANK": "3"},
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 1 and "still here" not in out.stdout
    assert out.stderr.strip() == "error: rank 3: its launcher (pid 1) is gone; ending"
    ok = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DFLASH_LAUNCHER_PID": str(os.getpid())},
                        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert ok.returncode == 0 and ok.stdout == "still here\n", ok.stderr
