"""CheckpointManager's edges that the mutation run (tests/mutation/run.py, row "checkpoint") found untested: the
default keep, the refusal of keep < 1, a save that cannot delete what it cleans up (a step or leftover that is a
link to a folder elsewhere: shutil.rmtree refuses links), and the recovery of killed swaps when another rank puts
one of them back first. Real folders, real torch.save/torch.load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import CheckpointManager


def _state(x: float) -> dict:
    return {"model": {"w": torch.full((4, 4), x)}, "step": int(x)}


def _w(state: dict) -> float:
    return float(state["model"]["w"][0, 0])


def test_the_default_keeps_the_newest_two(tmp_path):
    m = CheckpointManager(tmp_path / "ck")
    for s in (1, 2, 3, 4):
        m.save(s, _state(s))
    assert [c.step for c in m.list_complete()] == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000003", "step_00000004"]


def test_keep_below_one_is_refused_naming_the_value(tmp_path):
    with pytest.raises(ValueError) as e:
        CheckpointManager(tmp_path / "ck", keep=0)
    assert str(e.value) == "keep must be >= 1, got 0"
    assert not (tmp_path / "ck").exists()


def _linked_checkpoint(tmp_path: Path, root: Path, step: int) -> Path:
    """A complete checkpoint of another run, under `elsewhere/`, linked into `root` as step_N (a user bringing a
    checkpoint in without copying it)."""
    elsewhere = tmp_path / "elsewhere"
    CheckpointManager(elsewhere, keep=5).save(step, _state(step))
    root.mkdir(parents=True, exist_ok=True)
    (root / f"step_{step:08d}").symlink_to(elsewhere / f"step_{step:08d}")
    return elsewhere


def test_resaving_a_step_that_is_a_link_succeeds_and_leaves_the_linked_folder(tmp_path):
    """The same-step swap moves the link aside and cannot delete it (rmtree refuses links): the save still
    succeeds, the new checkpoint is a real folder, and the folder the link pointed to is untouched."""
    root = tmp_path / "ck"
    elsewhere = _linked_checkpoint(tmp_path, root, 7)
    m = CheckpointManager(root, keep=5)
    assert m.load_latest()[0] == 7  # resumes through the link
    final = m.save(7, _state(70))
    assert final == root / "step_00000007" and final.is_dir() and not final.is_symlink()
    step, state = m.load_latest()
    assert (step, _w(state)) == (7, 70.0)
    step, state = CheckpointManager(elsewhere, keep=5).load_latest()
    assert (step, _w(state)) == (7, 7.0)


def test_pruning_an_old_step_that_is_a_link_does_not_fail_the_save(tmp_path):
    """keep 1: the save prunes the older step, a link it cannot delete; the save succeeds, resume loads the new
    step, and the linked folder is untouched."""
    root = tmp_path / "ck"
    elsewhere = _linked_checkpoint(tmp_path, root, 1)
    m = CheckpointManager(root, keep=1)
    assert m.save(2, _state(2)) == root / "step_00000002"
    step, state = m.load_latest()
    assert (step, _w(state)) == (2, 2.0)
    step, state = CheckpointManager(elsewhere, keep=5).load_latest()
    assert (step, _w(state)) == (1, 1.0)


def test_a_leftover_the_save_cannot_delete_does_not_fail_it(tmp_path):
    """A `.tmp-step_` leftover of another process that is a link to a folder elsewhere: the save's clean-up cannot
    delete it (rmtree refuses links); the save succeeds and the folder behind the link keeps its files."""
    root = tmp_path / "ck"
    root.mkdir()
    kept = tmp_path / "someone-elses"
    kept.mkdir()
    (kept / "notes.txt").write_text("not the trainer's")
    (root / ".tmp-step_00000009-999").symlink_to(kept)
    m = CheckpointManager(root, keep=2)
    assert m.save(1, _state(1)) == root / "step_00000001"
    step, state = m.load_latest()
    assert (step, _w(state)) == (1, 1.0)
    assert (kept / "notes.txt").read_text() == "not the trainer's"


def test_a_swap_another_rank_put_back_first_does_not_stop_recovering_the_next(tmp_path, monkeypatch, capsys):
    """Two steps left under `.old-` by killed swaps; another rank of the run, resuming at the same moment, puts the
    first back just before this one renames it (a real rename: this rank's own then fails, FileNotFoundError).
    This rank still puts the second back and resumes it."""
    root = tmp_path / "ck"
    m = CheckpointManager(root, keep=5)
    m.save(3, _state(3))
    m.save(5, _state(5))
    os.rename(root / "step_00000003", root / ".old-step_00000003-111")
    os.rename(root / "step_00000005", root / ".old-step_00000005-222")
    real_rename = os.rename

    def other_rank_first(src, dst):
        if Path(src).name == ".old-step_00000003-111":
            real_rename(src, dst)  # the other rank's recovery of the same folder, a moment earlier
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", other_rank_first)
    step, state = m.load_latest()
    monkeypatch.undo()
    assert (step, _w(state)) == (5, 5.0)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000005"]
    assert capsys.readouterr().err.splitlines() == [
        f"[checkpoint] warning: recovered {root / 'step_00000005'} from .old-step_00000005-222 "
        "(a re-save of that step was interrupted)"]


def test_a_save_that_fails_midway_leaves_no_partial_step_and_keeps_the_last_complete_one(tmp_path):
    """A state that cannot be pickled fails torch.save half-way: the error reaches the caller, the temporary
    step folder is gone at once (not at the next save), the last complete checkpoint is untouched."""
    m = CheckpointManager(tmp_path / "ck")
    m.save(1, _state(1))
    with pytest.raises(Exception) as e:
        m.save(2, {"model": {"w": torch.ones(4)}, "hook": lambda: None})
    assert "lambda" in str(e.value) or "pickle" in str(e.value).lower(), e.value
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000001"]
    assert _w(m.load_latest()[1]) == 1.0


def test_a_full_disk_during_a_save_gives_its_space_back(tmp_path):
    """On a real 1 MiB tmpfs a ~2 MiB state hits ENOSPC inside torch.save: the error (errno 28, or torch's own
    RuntimeError raised over it while closing its zip writer) reaches the caller, and the partial state.pt is deleted with its folder, so the file system has its space again for the last
    words a failed run still has to write."""
    import errno
    import shutil
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("needs root to mount a tmpfs")
    try:
        m = CheckpointManager(mnt / "ck")
        with pytest.raises((OSError, RuntimeError)) as e:  # torch's zip writer may raise its own error over it
            m.save(5, {"model": {"w": torch.zeros(512, 1024)}})
        chain, err = [], e.value
        while err is not None:
            chain.append(err)
            err = err.__cause__ or err.__context__
        assert any(getattr(x, "errno", None) == errno.ENOSPC for x in chain), chain
        assert list((mnt / "ck").iterdir()) == []
        assert shutil.disk_usage(mnt).free > (1 << 20) - (64 << 10)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_a_cleanup_that_fails_after_a_failed_save_does_not_hide_the_cause(tmp_path, monkeypatch):
    """The save's error is what the caller gets, even when its partial folder cannot be removed (a file system
    gone read-only under a full disk): the cleanup is best effort, the cause is never replaced by its error."""
    real_rmdir = os.rmdir

    def refuse(path, *args, **kw):
        if ".tmp-step_" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_rmdir(path, *args, **kw)

    m = CheckpointManager(tmp_path / "ck")
    monkeypatch.setattr(os, "rmdir", refuse)
    with pytest.raises(Exception) as e:
        m.save(2, {"model": {"w": torch.ones(4)}, "hook": lambda: None})
    assert not isinstance(e.value, PermissionError), e.value
    assert "lambda" in str(e.value) or "pickle" in str(e.value).lower(), e.value
