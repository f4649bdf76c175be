"""`python -m trainer eval`: an export directory and a target directory in, τ per mode out; bad input named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import ModelConfig, TinyTargetConfig
from trainer.export import export_drafter
from trainer.features import TargetModel
from trainer.model import DFlashDrafter
from trainer.tiny import build_tiny

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A small tiny target (with its tokenizer and held-out prompts) and an export of a random drafter for it."""
    root = tmp_path_factory.mktemp("evalcli")
    tiny = build_tiny(TinyTargetConfig(num_prompts=6, held_out=3, response_tokens=8), cache_root=root, log=lambda _: None)
    target = TargetModel.from_pretrained(tiny.target_dir, layer_ids=[1, 3], dtype=torch.float32)
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(ModelConfig(block_size=4, num_draft_layers=1, attention_backend="sdpa"), target, 4)
    return tiny, export_drafter(drafter, target, root / "export")


def _eval(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "trainer", "eval", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_eval_prints_tau_per_mode_and_writes_the_report(assets, tmp_path):
    tiny, export = assets
    out = tmp_path / "report.json"
    done = _eval("--export", str(export), "--target", str(tiny.target_dir), "--prompts", str(tiny.eval_file),
                 "--budgets", "4,16", "--temperatures", "0,1", "--max-new-tokens", "8", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {(r["budget"], r["temperature"]) for r in report["results"]} == {
        (b, t) for b in (None, 4, 16) for t in (0.0, 1.0)
    }
    assert all(len(r["per_prompt"]) == 3 and r["tau"] >= 1.0 for r in report["results"])
    assert {r["verify_width"] for r in report["results"] if r["budget"] == 16} == {17.0}
    lines = done.stdout.splitlines()
    assert lines[0] == "τ (tokens per verify forward)" and "chain" in lines[1] and "B=16" in lines[1]
    assert f"τ {report['tau']:.3f} (greedy chain, {export})" in done.stdout and f"wrote {out}" in done.stdout


def test_eval_names_bad_input(assets, tmp_path):
    tiny, export = assets
    base = ["--target", str(tiny.target_dir), "--prompts", str(tiny.eval_file), "--max-new-tokens", "4"]
    done = _eval("--export", str(tiny.target_dir), *base)
    assert done.returncode == 2 and "not an exported drafter (missing dflash.py)" in done.stderr
    done = _eval("--export", str(export), *base, "--budgets", "0,8")
    assert done.returncode == 2 and "--budgets: budgets must be >= 1" in done.stderr, done.stderr
    done = _eval("--export", str(export), *base, "--temperatures", "hot")
    assert done.returncode == 2 and "--temperatures 'hot': expected comma-separated numbers" in done.stderr
    done = _eval("--export", str(export), "--target", str(tmp_path), "--prompts", str(tiny.eval_file))
    assert done.returncode == 2 and "no HF model directory there (no config.json)" in done.stderr
    done = _eval("--export", str(export), "--target", str(tiny.target_dir), "--prompts", str(tmp_path / "none.jsonl"))
    assert done.returncode == 2 and "none.jsonl: no such prompt file" in done.stderr
    assert "Traceback" not in done.stderr
