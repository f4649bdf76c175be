"""The training config: γ as given or the paper's default, and the config's γ reaching the loss that the
training loop computes (`python -m trainer train`, the command a run executes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import TinyTargetConfig, TrainConfig
from trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("block_size, gamma, expected", [(16, None, 7.0), (10, None, 5.0), (8, None, 4.0),
                                                         (4, None, 4 / 2.3), (16, 10.0, 10.0), (16, 0.5, 0.5)])
def test_resolved_gamma_is_the_given_one_else_the_default_for_the_block(block_size, gamma, expected):
    cfg = TrainConfig(model={"block_size": block_size}, data={"max_len": 64}, gamma=gamma)
    assert cfg.resolved_gamma == pytest.approx(expected)


def test_gamma_must_be_positive():
    with pytest.raises(ValueError, match="gamma must be > 0"):
        TrainConfig(gamma=0)


TINY = TinyTargetConfig(num_prompts=40, held_out=4, response_tokens=24, hidden_size=32, intermediate_size=64, head_dim=8)


def _one_step_config(out: Path, gamma: float) -> Path:
    cfg = {
        "model": {"target": "tiny", "tiny_target": TINY.model_dump(mode="json"), "block_size": 4,
                  "num_draft_layers": 1, "num_target_features": 2},
        "data": {"max_len": 64, "token_budget": 256, "max_batch_size": 4, "num_anchors": 8},
        "evaluation": {"budgets": [], "temperatures": [0.0]},  # τ is not what this test reads: the cheapest mode
        "epochs": 1, "max_steps": 1, "seed": 3, "log_every": 1, "output_dir": str(out), "gamma": gamma,
    }
    path = out.with_suffix(".json")
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.slow
def test_the_configs_gamma_reaches_the_loss_the_loop_logs(tmp_path, tiny_cache):
    """γ = 10 (the headline setting) and γ = 0.5, one step each from the same seed, data and weights: the
    first step's loss is computed before any update, so it differs only through the loss weights
    exp(-(k-1)/γ). A loop that ignored the config's γ (a constant, the default) logs the same loss twice:
    runs are deterministic on CPU (test_train's resume test holds curves equal to 1e-6)."""
    from trainer.tiny import build_tiny

    # Built here, before both runs start (they would race to build it); the session's cache, so the tiny
    # target is built once for every test that trains on this TINY config.
    build_tiny(TINY, cache_root=tiny_cache, log=lambda _: None)
    env = dict(os.environ, DFLASH_TINY_CACHE=str(tiny_cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = {}
    for gamma in (10.0, 0.5):
        out = tmp_path / f"gamma-{gamma}"
        procs[gamma] = (out, subprocess.Popen(
            [sys.executable, "-m", "trainer", "train", "--config", str(_one_step_config(out, gamma))],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    loss = {}
    for gamma, (out, proc) in procs.items():
        text, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, text[-3000:]
        [step] = [r for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "train"]
        assert step["step"] == 1
        loss[gamma] = step["loss"]
    assert loss[10.0] != pytest.approx(loss[0.5], rel=1e-3), loss
