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


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
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


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("error: ")]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_eval_names_bad_input_through_the_module_entry(assets, tmp_path):
    """What the user runs, `python -m trainer eval`: exit 2, one `error:` line, no traceback."""
    tiny, export = assets
    done = _eval("--export", str(export), "--target", str(tiny.target_dir), "--prompts", str(tmp_path / "none.jsonl"))
    assert done.returncode == 2 and "none.jsonl: no such prompt file" in done.stderr
    assert _error_lines(done.stderr) == [next(l for l in done.stderr.splitlines() if "no such prompt" in l)]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("case, message", [
    ("not-an-export", "not an exported drafter (missing dflash.py)"),
    ("budget-0", "--budgets: budgets must be >= 1"),
    ("hot", "--temperatures 'hot': expected comma-separated numbers"),
    ("no-config", "no HF model directory there (no config.json)"),
])
def test_eval_names_bad_input(assets, tmp_path, capsys, case, message):
    """The same entry (`trainer.__main__.main`) in this process: each bad argument is exit 2 and its message."""
    from trainer.__main__ import main

    tiny, export = assets
    base = ["--prompts", str(tiny.eval_file), "--max-new-tokens", "4", "--device", "cpu"]
    args = {
        "not-an-export": ["--export", str(tiny.target_dir), "--target", str(tiny.target_dir)],
        "budget-0": ["--export", str(export), "--target", str(tiny.target_dir), "--budgets", "0,8"],
        "hot": ["--export", str(export), "--target", str(tiny.target_dir), "--temperatures", "hot"],
        "no-config": ["--export", str(export), "--target", str(tmp_path)],
    }[case]
    threads = torch.get_num_threads()  # main() sets a CPU rank's threads: give the rest of the suite its own back
    try:
        assert main(["eval", *args, *base]) == 2
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    [line] = _error_lines(err)
    assert message in line, err
