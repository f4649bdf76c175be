"""The loop: the pure lr schedule, and (the colocated demo under torch's elastic launcher) a rank killed by
SIGKILL mid-run, named as such, then --resume continuing the same loss curve."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.config import OptimConfig, TinyTargetConfig
from trainer.metrics import read_metrics
from trainer.loop import get_lr
from trainer.setup import resolve_mask_token_id
from trainer.tiny import build_tiny

REPO = Path(__file__).resolve().parents[2]


def test_lr_warms_up_linearly_then_decays_by_cosine():
    cfg = OptimConfig(lr=1e-3, warmup_ratio=0.04, min_lr_ratio=0.0)
    total = 100  # 4 warm-up steps
    assert [get_lr(s, total, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert get_lr(4, total, cfg) == pytest.approx(1e-3)
    mid = 4 + 48
    assert get_lr(mid, total, cfg) == pytest.approx(0.5e-3)
    assert get_lr(total, total, cfg) == pytest.approx(0.0, abs=1e-12)
    lrs = [get_lr(s, total, cfg) for s in range(4, total)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone after warm-up


def test_lr_floor_and_no_warmup():
    cfg = OptimConfig(lr=2.0, warmup_ratio=0.0, min_lr_ratio=0.1)
    assert get_lr(0, 10, cfg) == pytest.approx(2.0)
    assert get_lr(10, 10, cfg) == pytest.approx(0.2)
    assert get_lr(5, 10, cfg) == pytest.approx(0.2 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 1.8)


def test_mask_token_resolution():
    class Tok:
        mask_token_id = None

        def __len__(self):
            return 100

    assert resolve_mask_token_id(7, Tok(), 128) == 7
    assert resolve_mask_token_id(None, Tok(), 128) == 100  # first row the tokenizer never produces
    with pytest.raises(Exception, match="set model.mask_token_id"):
        resolve_mask_token_id(None, Tok(), 100)


# -- kill and resume --------------------------------------------------------------------------------
TINY = TinyTargetConfig(num_prompts=40, held_out=4, response_tokens=24, hidden_size=32, intermediate_size=64, head_dim=8)


def _config(out: Path) -> dict:
    return {
        "model": {
            "target": "tiny",
            "tiny_target": TINY.model_dump(mode="json"),
            "block_size": 4,
            "num_draft_layers": 1,
            "num_target_features": 2,
        },
        "data": {"max_len": 64, "token_budget": 256, "max_batch_size": 4, "num_anchors": 8},
        "evaluation": {"budgets": [], "temperatures": [0.0]},
        "epochs": 100,
        "max_steps": 60,
        "seed": 3,
        "output_dir": str(out),
        "log_every": 1,
        "save_every": 10,
        "keep_checkpoints": 2,
    }


@pytest.fixture(scope="module")
def env(tiny_cache):
    # The session's tiny cache (building is not the point here), filled before the runs below so both start
    # training at once; in this process, as an interpreter started only to build them cost its start-up.
    build_tiny(TINY, tiny_cache, log=lambda line: None)
    return dict(os.environ, DFLASH_TINY_CACHE=str(tiny_cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def _start(run_dir: Path, env: dict, *extra: str) -> subprocess.Popen:
    """The colocated layout under torch's elastic launcher (one rank), output into run_dir/stdout.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "config.json"
    cfg.write_text(json.dumps(_config(run_dir)))
    log = open(run_dir / "stdout.log", "a")
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", "--config", str(cfg), *extra], env=env, stdout=log,
        stderr=subprocess.STDOUT,
    )


def _losses(run_dir: Path) -> dict[int, float]:
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    steps = [r["step"] for r in recs]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics: {steps}"
    return {r["step"]: r["loss"] for r in recs}


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_sigkill_then_resume_continues_the_same_loss_curve(tmp_path, env):
    ref = tmp_path / "ref"
    p = _start(ref, env)
    assert p.wait(timeout=600) == 0, (ref / "stdout.log").read_text()[-3000:]

    run = tmp_path / "killed"
    p = _start(run, env)
    deadline = time.time() + 600
    while time.time() < deadline:
        steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
        if steps and max(steps) >= 15:  # past the step-10 checkpoint, well before the end (60)
            break
        assert p.poll() is None, (run / "stdout.log").read_text()[-3000:]
        time.sleep(0.01)
    pid = int(re.search(r"drafter rank 0 \(pid (\d+)\)", (run / "stdout.log").read_text()).group(1))
    os.kill(pid, signal.SIGKILL)  # the rank, not the launcher: the launcher must notice and name it
    assert p.wait(timeout=60) == 1
    killed_at = max(r["step"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train")
    assert killed_at < 60, "the run finished before it was killed: the test proved nothing"
    assert f"rank 0 (colocated, node 0, local rank 0, pid {pid}) was killed by SIGKILL" in (run / "stdout.log").read_text()

    p = _start(run, env, "--resume", str(run))
    assert p.wait(timeout=600) == 0, (run / "stdout.log").read_text()[-3000:]
    out = (run / "stdout.log").read_text()
    resumed = [line for line in out.splitlines() if line.startswith("[rank 0] resumed from step ")]
    assert len(resumed) == 1 and int(resumed[0].split()[5]) >= 10

    a, b = _losses(ref), _losses(run)
    assert sorted(a) == sorted(b) == list(range(1, 61))
    # Same seed, same data order, same anchors, same optimizer state: the curves must agree. CPU
    # kernels are deterministic run to run, so the tolerance only absorbs float printing (1e-6 rel).
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=1e-6, abs=1e-7), f"step {s}: {a[s]} vs {b[s]}"
    assert (run / "export" / "model.safetensors").exists() and (run / "eval_after.json").exists()
