"""Gradient accumulation across drafters: two drafter processes with two batches each per step (trainer.launch
for real, gloo) train the same updates as one process accumulating all four. That holds only if each drafter
averages its batches' gradients and DDP all-reduces once per step, on the LAST micro-batch (an all-reduce on the
first leaves the second batch's gradient local: the replicas drift apart), so the loss and the pre-clip gradient
norm of every step must match the single-process run's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_trainer_launch import LOSS_RTOL, REPO, SPLIT, launch, reference, small_config, write
from trainer.metrics import read_metrics

STEPS = 3
PER_STEP = 4  # global batches per step: 2 per drafter in the split run, all 4 in the single process


@pytest.fixture(scope="module")
def env(tiny_cache):
    return dict(os.environ, DFLASH_TINY_CACHE=str(tiny_cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _config(out: Path, layout: dict | None = None) -> dict:
    cfg = small_config(out, layout, max_steps=STEPS, evaluation={"budgets": [], "temperatures": [0.0]})
    cfg["data"]["batches_per_step"] = PER_STEP
    return cfg


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_two_drafters_with_two_batches_each_match_one_process_accumulating_four(tmp_path, env, reference_memo):
    ref = reference(_config(tmp_path / "ref"), env, reference_memo, batches_per_step=PER_STEP)
    proc = launch(["--config", str(write(tmp_path / "split.json", _config(tmp_path / "split", SPLIT)))], env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "4 batch(es) of 4 rows x 64 (2 on this rank)" in proc.stdout, proc.stdout[-3000:]
    got = [r for r in read_metrics(tmp_path / "split" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert b["tokens"] == a["tokens"]
        # the step's gradient: the mean over its 4 batches (a sum, or a second batch left out of the
        # all-reduce, changes it at step 1 already)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a["step"], a["grad_norm"], b["grad_norm"])
        # and the replicas stayed one model: the losses after the first update agree
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
