"""Checkpoints: complete or absent, corrupt ones skipped, newest K kept, RNG restored exactly; metrics lines."""

from __future__ import annotations

import json
import os
import random
import shutil
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


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
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


def test_what_a_save_leaves_and_the_warnings_resume_prints(tmp_path, capsys):
    """meta.json holds the step, the size and the hash; a leftover temp folder of this process is replaced; a
    same-step re-save leaves no .old- folder; a checkpoints folder deleted under a manager means no checkpoint;
    each skipped checkpoint's warning says exactly why."""
    root = tmp_path / "ck"
    m = CheckpointManager(root, keep=5)
    leftover = root / f".tmp-step_00000003-{os.getpid()}"
    leftover.mkdir()
    (leftover / "junk").write_text("a save of this process that died half-way")
    m.save(3, _state(3))
    meta = json.loads((root / "step_00000003" / "meta.json").read_text())
    f = root / "step_00000003" / "state.pt"
    assert meta == {"step": 3, "files": {"state.pt": {"size": f.stat().st_size, "sha256": _sha256(f)}}}
    (root / ".old-step_00000003-999").mkdir()  # a killed process's swap, its step back under its name
    (root / ".tmp-step_00000009-999").mkdir()  # a killed process's half save
    m.save(3, _state(3))
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]
    m.save(4, _state(4))
    (root / "step_00000004" / "meta.json").unlink()
    f.write_bytes(f.read_bytes()[:100])
    assert m.load_latest() is None
    err = capsys.readouterr().err.splitlines()
    assert err == [f"[checkpoint] warning: skipping {root / 'step_00000004'}: no meta.json (incomplete write)",
                   f"[checkpoint] warning: skipping {root / 'step_00000003'}: state.pt has 100 bytes, meta.json says "
                   f"{meta['files']['state.pt']['size']} (truncated?)"]
    d = root / "step_00000005"
    d.mkdir()
    (d / "state.pt").write_bytes(b"not a pickle")
    (d / "meta.json").write_text(json.dumps({"step": 5, "files": {"state.pt": {"size": 12, "sha256": _sha256(d / "state.pt")}}}))
    assert m.load_latest() is None
    assert "state.pt does not load (UnpicklingError: " in capsys.readouterr().err
    shutil.rmtree(root)
    assert m.load_latest() is None and m.list_complete() == []


# -- the run's policy (trainer.checkpoint.RunCheckpoints) ----------------------------------------------------
class _Drafter:
    """What a checkpoint holds of a drafter: a module, its AdamW and the precision."""

    def __init__(self, seed: int, precision: str = "fp32"):
        from trainer.precision import Precision

        torch.manual_seed(seed)
        self.module = torch.nn.Linear(3, 2)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=0.1)
        self.precision = Precision(precision, "cpu")

    def train_once(self) -> None:
        self.module(torch.ones(1, 3)).sum().backward()
        self.opt.step()
        self.opt.zero_grad()


def _policy(tmp_path, per_step: int = 1, **cfg):
    from trainer.checkpoint import RunCheckpoints
    from trainer.config import parse_config

    return RunCheckpoints(parse_config({"output_dir": str(tmp_path), **cfg}), per_step)


def _alone(step: int) -> int:
    return step  # a world of one agrees with itself


def test_the_loop_saves_every_save_every_steps_but_never_at_the_last():
    from trainer.checkpoint import RunCheckpoints

    policy = object.__new__(RunCheckpoints)
    policy.save_every = 3
    assert [s for s in range(1, 11) if policy.due(s, 9)] == [3, 6]
    assert [s for s in range(1, 11) if policy.due(s, 10)] == [3, 6, 9]


def test_a_run_resumes_its_newest_checkpoint_weights_optimizer_and_rng_and_keeps_the_newest_k(tmp_path):
    policy = _policy(tmp_path, per_step=2, save_every=1, keep_checkpoints=2)
    assert policy.root == tmp_path / "checkpoints"
    saved = _Drafter(0)
    lines: list[str] = []
    for step in (1, 2, 3):
        saved.train_once()
        assert policy.save(saved, step, lines.append) == tmp_path / "checkpoints" / f"step_{step:08d}"
    assert lines[-1] == f"[ckpt] step 3 -> {tmp_path / 'checkpoints' / 'step_00000003'}"
    assert [c.step for c in policy.manager.list_complete()] == [2, 3]
    draws = torch.rand(4)
    fresh, log = _Drafter(1), []
    assert _policy(tmp_path, per_step=2).resume(fresh, _alone, log.append) == 3
    assert torch.equal(torch.rand(4), draws)  # the RNG continues where the save left it
    for a, b in zip(fresh.module.state_dict().values(), saved.module.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh.opt.state_dict()["state"][0]["step"] == saved.opt.state_dict()["state"][0]["step"] == 3
    assert log == ["resumed from step 3"]
    assert _policy(tmp_path / "empty").resume(_Drafter(2), _alone, log.append) == 0


def test_resume_refuses_another_g_another_format_and_disagreeing_ranks_naming_the_fix(tmp_path):
    from trainer.setup import TrainError

    _policy(tmp_path, per_step=1).save(_Drafter(0), 4, print)
    where = f"checkpoint step 4 in {tmp_path / 'checkpoints'}"
    with pytest.raises(TrainError) as e:
        _policy(tmp_path, per_step=2).resume(_Drafter(0), _alone, print)
    assert str(e.value) == (f"{where} was trained with 1 batch(es) per step, this config has 2: the global batches "
                            "would not line up; set data.batches_per_step: 1")
    with pytest.raises(TrainError) as e:
        _policy(tmp_path).resume(_Drafter(0), lambda step: step + 2, print)  # the main rank sees step 6
    assert str(e.value) == f"ranks disagree on the checkpoint to resume from (main: step 6); is {tmp_path} shared?"
    old = CheckpointManager(tmp_path / "checkpoints")
    state = old.load_latest()[1]
    state["format"] = 1
    old.save(5, state)
    with pytest.raises(TrainError) as e:
        _policy(tmp_path).resume(_Drafter(0), _alone, print)
    assert str(e.value) == (f"checkpoint step 5 in {tmp_path / 'checkpoints'} was written by an older trainer "
                            "(format 1, this one reads 2); start a fresh run")


def test_a_checkpoint_of_another_precision_resumes_cast_and_says_so(tmp_path):
    _policy(tmp_path).save(_Drafter(0, "bf16-true"), 1, print)
    log: list[str] = []
    assert _policy(tmp_path).resume(_Drafter(1), _alone, log.append) == 1
    assert log[0] == (f"[precision] checkpoint step 1 in {tmp_path / 'checkpoints'} was trained in bf16-true; "
                      "continuing in fp32: master weights and AdamW state now float32")
