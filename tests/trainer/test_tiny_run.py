"""The `tiny` experiment end to end through the real CLI: build, regenerate, train, export, τ before/after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~1-2 min alone; far longer when the 2 cores are shared
def test_tiny_experiment_learns_to_draft(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, DFLASH_TINY_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "tiny", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    before = json.loads((out / "eval_before.json").read_text())
    after = json.loads((out / "eval_after.json").read_text())
    # τ by real greedy speculative decoding on prompts never trained on.
    assert after["tau"] >= 2.0, (before["tau"], after["tau"])
    assert after["tau"] >= 1.5 * before["tau"], (before["tau"], after["tau"])
    assert len(after["per_prompt"]) == after["num_prompts"] >= 8
    assert sum(after["histogram"]) > 0

    recs = read_metrics(out / "metrics.jsonl")
    train = [r for r in recs if r["kind"] == "train"]
    assert train and {"step", "epoch", "loss", "acc_per_slot", "sim_tau", "tokens_per_s", "rss_mb", "lr", "time"} <= set(train[0])
    assert train[-1]["loss"] < train[0]["loss"]
    final = [r for r in recs if r["kind"] == "final"]
    assert final and final[0]["tau_after"] == pytest.approx(after["tau"])
    assert (out / "export" / "config.json").exists() and (out / "export" / "model.safetensors").exists()
    assert "done:" in proc.stdout and "τ before" in proc.stdout
    # the τ of the shipped artifact (the bf16 file through its remote code), every mode of `evaluation`
    shipped = json.loads((out / "export_eval.json").read_text())
    modes = {(r["budget"], r["temperature"]) for r in shipped["results"]}
    assert modes == {(b, t) for b in (None, 16, 32, 64, 128) for t in (0.0, 0.7, 1.0)}
    assert f"export τ {shipped['tau']:.3f}" in proc.stdout and "B=128" in proc.stdout
    assert shipped["tau"] >= 2.0
    greedy = {r["budget"]: r["tau"] for r in shipped["results"] if r["temperature"] == 0}
    assert greedy[128] > greedy[16] > greedy[None], greedy  # DDTree: τ grows with the budget
