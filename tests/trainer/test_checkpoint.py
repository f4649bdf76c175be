"""Checkpoints: complete or absent, corrupt ones skipped, newest K kept, RNG restored exactly; metrics lines."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from trainer.checkpoint import CheckpointManager, _sha256, capture_rng_state, restore_rng_state
from trainer.metrics import MetricsWriter, read_metrics, rewind_metrics


def _state(x: float) -> dict:
    return {"model": {"w": torch.full((4, 4), x)}, "step": int(x), "data": {"epoch": 0, "index": int(x)}}


def test_save_and_load_latest_roundtrip(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep=3)
    for s in (10, 20, 30):
        m.save(s, _state(s))
    step, state = m.load_latest()
    assert step == 30 and torch.equal(state["model"]["w"], torch.full((4, 4), 30.0))
    assert state["data"] == {"epoch": 0, "index": 30}


def test_keeps_only_the_newest_k(tmp_path):
    m = CheckpointManager(tmp_path / "ck", keep=2)
    for s in (1, 2, 3, 4):
        m.save(s, _state(s))
    assert [c.step for c in m.list_complete()] == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000003", "step_00000004"]


def test_partial_and_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path, capsys):
    m = CheckpointManager(tmp_path / "ck", keep=5)
    m.save(10, _state(10))
    m.save(20, _state(20))
    m.save(30, _state(30))
    # 30: truncated file (size no longer matches meta.json); 20: meta.json never written.
    f = tmp_path / "ck" / "step_00000030" / "state.pt"
    f.write_bytes(f.read_bytes()[:50])
    (tmp_path / "ck" / "step_00000020" / "meta.json").unlink()
    # A leftover temp dir of a killed save is not a candidate at all.
    (tmp_path / "ck" / ".tmp-step_00000040-999").mkdir()
    step, state = m.load_latest()
    assert step == 10 and torch.equal(state["model"]["w"], torch.full((4, 4), 10.0))
    err = capsys.readouterr().err
    assert "step_00000030" in err and "truncated" in err
    assert "step_00000020" in err and "no meta.json" in err


def test_same_size_corruption_is_caught_by_the_hash(tmp_path, capsys):
    m = CheckpointManager(tmp_path / "ck")
    m.save(5, _state(5))
    m.save(6, _state(6))
    f = tmp_path / "ck" / "step_00000006" / "state.pt"
    data = bytearray(f.read_bytes())
    data[-20] ^= 0xFF
    f.write_bytes(bytes(data))
    assert m.load_latest()[0] == 5
    assert "sha256" in capsys.readouterr().err


def test_no_checkpoint_gives_none(tmp_path):
    assert CheckpointManager(tmp_path / "ck").load_latest() is None


def test_sigkill_during_save_leaves_only_complete_checkpoints(tmp_path):
    """A real process killed while writing a large checkpoint: the old one still loads, no half new one."""
    root = tmp_path / "ck"
    CheckpointManager(root).save(1, _state(1))
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from trainer.checkpoint import CheckpointManager
        real_save = torch.save
        def dying_save(obj, f):
            real_save(obj, f)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # after the bytes, before fsync/meta/rename
        torch.save = dying_save
        CheckpointManager({str(root)!r}).save(2, {{"model": {{"w": torch.zeros(256, 256)}}}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -9
    names = sorted(p.name for p in root.iterdir())
    assert "step_00000002" not in names and any(n.startswith(".tmp-step_00000002") for n in names)
    step, _ = CheckpointManager(root).load_latest()
    assert step == 1


def test_rng_state_roundtrip_through_a_checkpoint(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    m = CheckpointManager(tmp_path / "ck")
    m.save(1, {"rng": capture_rng_state()})
    expected = (torch.rand(3), random.random(), np.random.rand(2))
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    restore_rng_state(m.load_latest()[1]["rng"])
    got = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(expected[0], got[0]) and expected[1] == got[1] and np.array_equal(expected[2], got[2])


def test_metrics_lines_are_whole_json_objects(tmp_path):
    p = tmp_path / "m.jsonl"
    with MetricsWriter(p) as w:
        w.write({"step": 1, "loss": torch.tensor(2.5), "acc_per_slot": torch.tensor([0.5, 0.25])})
        w.write({"step": 2, "loss": float("nan")})
    lines = p.read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "loss": 2.5, "acc_per_slot": [0.5, 0.25]},
        {"step": 2, "loss": "nan"},
    ]
    # A fragment left by a dying writer is ended before the next record, so both neighbours survive.
    with open(p, "a") as f:
        f.write('{"step": 3, "lo')
    with MetricsWriter(p) as w:
        w.write({"step": 4})
    assert [r["step"] for r in read_metrics(p)] == [1, 2, 4]


def test_rewind_drops_records_after_the_resumed_step(tmp_path):
    p = tmp_path / "m.jsonl"
    with MetricsWriter(p) as w:
        for s in range(1, 8):
            w.write({"kind": "train", "step": s})
        w.write({"kind": "note"})
    assert rewind_metrics(p, 5) == 2
    assert [r.get("step") for r in read_metrics(p)] == [1, 2, 3, 4, 5, None]
    assert rewind_metrics(p, 5) == 0


def test_keep_1_pruning_never_counts_a_folder_without_meta_json(tmp_path):
    """A step folder without meta.json (a half copy, a disk that lost it) beside complete ones is not complete:
    pruning to the newest 1 keeps the newest COMPLETE checkpoint, and resume loads it."""
    root = tmp_path / "ck"
    m = CheckpointManager(root, keep=1)
    m.save(10, _state(10))
    half = root / "step_00000050"
    half.mkdir()
    (half / "state.pt").write_bytes(b"half a copy")
    m.save(20, _state(20))
    assert [c.step for c in m.list_complete()] == [20]
    assert (root / "step_00000020" / "meta.json").exists() and not (root / "step_00000010").exists()
    step, state = m.load_latest()
    assert step == 20 and torch.equal(state["model"]["w"], torch.full((4, 4), 20.0))


def test_a_hash_valid_state_that_does_not_unpickle_is_skipped(tmp_path, capsys):
    """state.pt whose size and sha256 match meta.json but that torch.load refuses (not a pickle, or one that
    weights_only=True rejects): resume skips it with a warning and loads the older checkpoint, never crashes."""
    root = tmp_path / "ck"
    m = CheckpointManager(root, keep=5)
    m.save(10, _state(10))
    for step, payload in ((20, b"not a torch file at all" * 10), (30, None)):
        d = root / f"step_{step:08d}"
        d.mkdir()
        f = d / "state.pt"
        if payload is None:
            torch.save({"obj": random.Random(1)}, f)  # a pickled class instance: weights_only refuses it
        else:
            f.write_bytes(payload)
        meta = {"step": step, "files": {"state.pt": {"size": f.stat().st_size, "sha256": _sha256(f)}}}
        (d / "meta.json").write_text(json.dumps(meta))
    step, state = m.load_latest()
    assert step == 10 and torch.equal(state["model"]["w"], torch.full((4, 4), 10.0))
    err = capsys.readouterr().err
    assert "step_00000030" in err and "step_00000020" in err and err.count("does not load") == 2


def _kill_at_the_swap(root, step: int) -> subprocess.CompletedProcess:
    """Save `step` again in a real process that is SIGKILLed the moment the new folder would move to its final
    name (after whatever the save did to the old one before)."""
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from pathlib import Path
        import trainer.checkpoint as ck
        real_rename = os.rename
        def dying_rename(src, dst):
            if Path(dst).name == "step_{step:08d}" and Path(src).name.startswith(".tmp-"):
                os.kill(os.getpid(), signal.SIGKILL)
            real_rename(src, dst)
        ck.os.rename = dying_rename
        ck.CheckpointManager({str(root)!r}, keep=1).save({step}, {{"model": {{"w": torch.full((4, 4), 99.0)}}}})
        """
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True)


def test_a_same_step_resave_killed_in_the_middle_keeps_the_step(tmp_path, capsys):
    """A resumed run saving a step it had saved already, SIGKILLed between moving the old folder aside and moving
    the new one in (keep 1: no older checkpoint to fall back to): the step is still resumed, the old copy put
    back under its name, and the next save works."""
    root = tmp_path / "ck"
    CheckpointManager(root, keep=1).save(7, _state(7))
    proc = _kill_at_the_swap(root, 7)
    assert proc.returncode == -9, proc.stderr.decode()
    m = CheckpointManager(root, keep=1)
    got = m.load_latest()
    assert got is not None, sorted(p.name for p in root.iterdir())
    assert got[0] == 7 and torch.equal(got[1]["model"]["w"], torch.full((4, 4), 7.0))
    assert "recovered" in capsys.readouterr().err
    m.save(8, _state(8))
    assert sorted(p.name for p in root.iterdir()) == ["step_00000008"]
