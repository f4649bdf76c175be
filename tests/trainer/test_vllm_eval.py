"""`python -m trainer eval --engine vllm` against a real vLLM (its own venv): a trained export served by vLLM's
DFlash speculative decoding is lossless at T = 0 and its per-prompt acceptance equals the project's loop within
the tolerance; a copy vLLM reads differently (a tensor zeroed, wrong target layers) is reported by prompt, not
averaged away."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_venv import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

# vLLM's CPU attention needs head_dim >= 32: a tiny target of hidden 128, 4 heads of 32.
TINY = {"num_prompts": 384, "held_out": 8, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 256, "response_tokens": 32}
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def trained(tiny_cache, tmp_path_factory):
    """A drafter trained 150 steps against the head_dim-32 tiny target: (export, target dir, held-out prompts)."""
    python = vllm_python()
    from trainer.distributed import single_world
    from trainer.loop import train
    from trainer.tiny import build_tiny, tiny_train_config

    os.environ["DFLASH_TINY_CACHE"] = str(tiny_cache)
    out = tmp_path_factory.mktemp("vllm-eval") / "run"
    cfg = tiny_train_config(out, max_steps=150, log_every=50, save_every=1000,
                            evaluation={"budgets": [], "temperatures": [0.0], "engine": "vllm"},
                            model={"target": "tiny", "tiny_target": TINY, "block_size": 8, "num_draft_layers": 2,
                                   "num_target_features": 3})
    train(cfg, single_world(cfg.layout.to_layout()), log=lambda _: None)
    assets = build_tiny(cfg.model.tiny_target, log=lambda _: None)
    return python, out / "export", assets.target_dir, assets.eval_file


def _eval(trained, export, *extra):
    python, good, target, prompts = trained
    argv = [python, "-m", "trainer", "eval", "--engine", "vllm", "--export", str(export), "--target", str(target),
            "--prompts", str(prompts), "--max-new-tokens", "32", *extra]
    return subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=1500)


def _copy(src, dst, *, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors:
        state = load_file(str(dst / "model.safetensors"))
        tensors(state)
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_trained_export_is_lossless_in_vllm_and_its_acceptance_is_the_projects(trained, tmp_path):
    export = trained[1]
    res = _eval(trained, export, "--json", str(tmp_path / "v.json"), "--metrics", str(tmp_path / "metrics.jsonl"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "lossless at T=0: yes" in res.stdout
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["lossless"] and report["disagreeing"] == []
    diffs = [abs(a - b) for a, b in zip(report["per_prompt_vllm"], report["per_prompt_own"])]
    assert len(diffs) == 8 and max(diffs) <= report["tolerance"]
    assert report["tau_own"] > 1.3, "the drafter learned nothing: the comparison below would prove nothing"
    rec = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rec[-1]["kind"] == "eval_vllm" and rec[-1]["tau_vllm"] == pytest.approx(report["tau_vllm"])
    print(res.stdout)


@pytest.mark.parametrize("fault", ["zeroed-fc", "wrong-target-layers"])
def test_an_export_vllm_reads_differently_is_reported_by_prompt(fault, trained, tmp_path):
    good = trained[1]
    if fault == "zeroed-fc":  # what vLLM's loader does to a tensor whose name it does not map
        bad = _copy(good, tmp_path / "bad", tensors=lambda s: s.__setitem__("fc.weight", torch.zeros_like(s["fc.weight"])))
    else:
        bad = _copy(good, tmp_path / "bad", config=lambda c: c["dflash_config"].__setitem__("target_layer_ids", [0, 4, 5]))
    res = _eval(trained, bad, "--reference-export", str(good))
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "vLLM's acceptance differs from the project's beyond 0.25 on" in res.stderr
    assert "prompt " in res.stderr and "vs project" in res.stderr
