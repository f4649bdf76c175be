"""TensorBoard event files beside metrics.jsonl, read back with TensorBoard's own reader."""

from __future__ import annotations

import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.metrics import MetricsWriter, read_metrics, rewind_metrics


def _scalars(run_dir):
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_records_become_scalars_a_viewer_reads(tmp_path):
    with MetricsWriter(tmp_path / "metrics.jsonl") as w:
        for step in (10, 20):
            w.write({"kind": "train", "step": step, "loss": 3.0 - step / 10, "acc_per_slot": [0.5, 0.25],
                     "sim_tau": 1.5, "time": 1700000000.0 + step})
        w.write({"kind": "eval", "step": 20, "when": "during", "tau": 2.5, "tau_chain": 2.5, "tau_tree16": 3.25,
                 "tau_chain_t0.7": 1.75})
        w.write({"kind": "final", "tau_before": 1.0})  # no step: jsonl only
    s = _scalars(tmp_path)
    assert s["train/loss"] == [(10, pytest.approx(2.0)), (20, pytest.approx(1.0))]
    assert s["train/acc_per_slot/1"] == [(10, 0.25), (20, 0.25)]
    assert s["eval/tau_tree16"] == [(20, 3.25)] and s["eval/tau_chain_t0.7"] == [(20, 1.75)]
    assert not any(t.startswith("final/") or t.endswith(("/time", "/when", "/step")) for t in s)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 4  # the jsonl is unchanged by it


def test_a_resumed_run_hides_the_steps_it_repeats(tmp_path):
    """A run killed after step 30 resumes from its step-20 checkpoint: the viewer shows the new 30 only."""
    p = tmp_path / "metrics.jsonl"
    with MetricsWriter(p) as w:
        for step in (10, 20, 30):
            w.write({"kind": "train", "step": step, "loss": float(step)})
    rewind_metrics(p, 20)
    # A resume is a new process seconds later. TensorBoard reads event files in name order, and a name is
    # `events.out.tfevents.<second>.<host>.<pid>.<counter>`: two writers of one process in one second sort by
    # the counter as text (10 before 9), so the second writer starts in the next second, as a resume does.
    start = int(time.time())
    while int(time.time()) == start:
        time.sleep(0.02)
    with MetricsWriter(p) as w:
        w.write({"kind": "train", "step": 30, "loss": -1.0})
    assert _scalars(tmp_path)["train/loss"] == [(10, 10.0), (20, 20.0), (30, -1.0)]


def test_without_the_package_only_jsonl_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError
    with MetricsWriter(tmp_path / "metrics.jsonl") as w:
        w.write({"kind": "train", "step": 1, "loss": 1.0})
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(RuntimeError, match="pip install tensorboard"):
        MetricsWriter(tmp_path / "other.jsonl", tensorboard=True)
    with MetricsWriter(tmp_path / "off.jsonl", tensorboard=False) as w:
        w.write({"kind": "train", "step": 1, "loss": 1.0})
