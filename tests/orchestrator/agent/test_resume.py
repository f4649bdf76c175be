"""orchestrator.agent.resume: which checkpoints count, and what a resumed run directory gets from the old
one (checkpoints and data linked, metrics copied so the old run never changes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.resume import complete_checkpoints, find_source, resumed_config, seed


def old_run(workdir: Path, run_id: str = "e-1", experiment: str = "e") -> Path:
    d = workdir / "runs" / run_id
    for step, complete in ((2, True), (4, True), (6, False)):
        ck = d / "checkpoints" / f"step_{step:08d}"
        ck.mkdir(parents=True)
        (ck / "state.pt").write_bytes(b"state %d" % step)
        if complete:
            (ck / "meta.json").write_text(json.dumps({"step": step}))
    (d / "checkpoints" / ".tmp-step_00000008").mkdir()  # a save in progress when the run died
    (d / "data").mkdir()
    (d / "data" / "samples.jsonl").write_text('{"ids": [1, 2]}\n')
    (d / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (d / "eval_before.json").write_text('{"tau": 1.0}\n')
    (d / "run.json").write_text(json.dumps({"experiment": experiment, "kind": "dflash"}))
    (d / "config.json").write_text(json.dumps({"output_dir": str(d), "save_every": 2}))
    return d


def test_only_checkpoints_with_meta_json_count(tmp_path):
    d = old_run(tmp_path)
    assert [s for s, _ in complete_checkpoints(d)] == [2, 4]
    assert complete_checkpoints(tmp_path / "nowhere") == []


def test_seed_links_checkpoints_and_data_and_copies_metrics(tmp_path):
    d = old_run(tmp_path)
    src = find_source(tmp_path, "e-1", "e", "dflash")
    assert src.step == 4
    new = tmp_path / "runs" / "e-2"
    new.mkdir()
    seeded = seed(src, new)
    assert seeded == ["checkpoints/step_00000002", "checkpoints/step_00000004", "data", "metrics.jsonl", "eval_before.json"]
    assert sorted(p.name for p in (new / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    old_state, new_state = d / "checkpoints" / "step_00000004" / "state.pt", new / "checkpoints" / "step_00000004" / "state.pt"
    assert new_state.read_bytes() == b"state 4" and new_state.stat().st_ino == old_state.stat().st_ino  # linked
    assert (new / "data" / "samples.jsonl").stat().st_ino == (d / "data" / "samples.jsonl").stat().st_ino
    # The trainer appends to metrics.jsonl: the new run's must be its own file.
    assert (new / "metrics.jsonl").stat().st_ino != (d / "metrics.jsonl").stat().st_ino
    with open(new / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5}\n')
    assert (d / "metrics.jsonl").read_text() == '{"kind": "train", "step": 1}\n'
    assert resumed_config(src, new) == {"output_dir": str(new), "save_every": 2}


@pytest.mark.parametrize("run_id, experiment, kind, error", [
    ("e-9", "e", "dflash", "ResumeNotFound"),
    ("e-1", "f", "dflash", "ResumeMismatch"),
    ("e-1", "e", "command", "ResumeMismatch"),
    ("../e-1", "e", "dflash", "BadRunId"),
])
def test_find_source_refusals(tmp_path, run_id, experiment, kind, error):
    old_run(tmp_path)
    with pytest.raises(AgentFailure) as info:
        find_source(tmp_path, run_id, experiment, kind)
    assert info.value.type == error


def test_a_run_without_a_complete_checkpoint_has_nothing_to_resume(tmp_path):
    d = old_run(tmp_path)
    for ck in (d / "checkpoints").glob("step_*"):
        (ck / "meta.json").unlink(missing_ok=True)
    with pytest.raises(AgentFailure) as info:
        find_source(tmp_path, "e-1", "e", "dflash")
    assert info.value.type == "NothingToResume" and "save_every is 2" in info.value.message


def test_resume_is_refused_while_a_process_of_the_run_lives_naming_it(tmp_path):
    """A rank of the old run still alive (it outlived its launcher, whose exit.json says failed) would keep
    writing checkpoints into what the resume seeds: refused, naming the process and the command that ends it."""
    import os
    import subprocess
    import sys
    import time

    d = old_run(tmp_path)
    (d / "exit.json").write_text(json.dumps({"exit_code": 137}))
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "trainer.rank"],
                            start_new_session=True, env={**os.environ, "DFLASHCTL_RUN_DIR": str(d)})
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                find_source(tmp_path, "e-1", "e", "dflash")
            except AgentFailure as exc:
                err = exc
                break
            assert time.monotonic() < deadline, "never refused"
            time.sleep(0.05)
        assert err.type == "RunProcessesAlive"
        assert err.message == (f"cannot resume run e-1: run e-1 still has 1 live process(es): pid {rank.pid} "
                               f"({sys.executable} -c import time; time.sleep(60) trainer.rank)")
        assert err.fix.startswith("dflashctl stop e-1")
    finally:
        rank.kill()
        rank.wait()
    assert find_source(tmp_path, "e-1", "e", "dflash").step == 4  # once it is gone, the resume is accepted
