"""`python -m trainer eval --engine vllm` against a real vLLM (its own venv): a trained export served by vLLM's
DFlash speculative decoding is lossless at T = 0 and its per-prompt acceptance equals the project's loop within
the tolerance; a copy vLLM reads differently (a tensor zeroed, wrong target layers) is reported by prompt, not
averaged away."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_venv import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

# vLLM's CPU attention needs head_dim >= 32: a tiny target of hidden 128, 4 heads of 32.
TINY = {"num_prompts": 384, "held_out": 8, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 256, "response_tokens": 32}
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def _config(out, **over):
    from trainer.tiny import tiny_train_config

    return tiny_train_config(out, max_steps=150, log_every=50, save_every=1000,
                             evaluation={"budgets": [], "temperatures": [0.0], "engine": "vllm"},
                             model={"target": "tiny", "tiny_target": TINY, "block_size": 8, "num_draft_layers": 2,
                                    "num_target_features": 3}, **over)


@pytest.fixture(scope="module")
def launched(tiny_cache, tmp_path_factory):
    """A drafter trained 150 steps against the head_dim-32 tiny target by `python -m trainer.launch` with
    evaluation.engine: vllm and the vLLM interpreter in $DFLASH_VLLM_PYTHON: the launcher judges the final
    export in vLLM after the ranks. (vLLM python, run dir, the launcher's result, the config.)"""
    python = vllm_python()
    out = tmp_path_factory.mktemp("vllm-eval") / "run"
    cfg = _config(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    os.environ["DFLASH_TINY_CACHE"] = str(tiny_cache)  # the end-of-training step finds the tiny target there
    env = {**ENV, "DFLASH_VLLM_PYTHON": python}
    res = subprocess.run([sys.executable, "-m", "trainer.launch", "--config", str(out / "config.json")],
                         capture_output=True, text=True, env=env, timeout=1700)
    return python, out, res, cfg


@pytest.fixture(scope="module")
def trained(launched, tiny_cache):
    """(vLLM python, the export, target dir, held-out prompts) of the launched run."""
    from trainer.tiny import build_tiny

    python, out, res, cfg = launched
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    os.environ["DFLASH_TINY_CACHE"] = str(tiny_cache)
    assets = build_tiny(cfg.model.tiny_target, log=lambda _: None)
    return python, out / "export", assets.target_dir, assets.eval_file


def test_the_end_of_training_evaluation_in_vllm_lands_in_the_runs_metrics_beside_the_projects_tau(launched):
    """After the final export the launcher ran the vLLM evaluation on the end-of-training evaluation's prompts
    and numbers: eval_vllm.json, an eval_vllm metrics line with every number, dflashctl metrics' note."""
    from orchestrator.ops.metrics import series_from_rows

    python, out, res, _ = launched
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert "[launch] judging the export in vLLM" in res.stdout
    report = json.loads((out / "eval_vllm.json").read_text())
    after = json.loads((out / "eval_after.json").read_text())
    assert report["per_prompt_own"] == after["per_prompt"]  # the project's own end-of-training numbers
    assert report["lossless"] and report["disagreeing"] == [] and len(report["per_prompt_vllm"]) == 8
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rec = rows[-1]
    assert rec["kind"] == "eval_vllm" and rec["per_prompt_vllm"] == report["per_prompt_vllm"]
    for key in ("tau_vllm", "tau_vllm_pooled", "tau_own", "lossless", "tokens_per_s_spec", "tokens_per_s_plain",
                "speedup", "per_prompt_own"):
        assert key in rec, key
    assert rec["tau_own"] == pytest.approx(after["tau"])
    notes = series_from_rows("r", rows).notes
    assert any(n.startswith("vLLM: τ") and f"against the project's {after['tau']:.3f}" in n for n in notes), notes
    assert "[launch] vLLM: τ" in res.stdout
    print(res.stdout[-1500:])


def test_a_tensor_vllm_reads_as_zero_fails_the_run_at_its_end_naming_the_prompts(launched, tmp_path):
    """The same end-of-training step on a copy of the run whose export lost a tensor (zeroed, as vLLM's loader
    leaves a tensor it does not map): the project's numbers (eval_after.json) and vLLM's disagree, the step
    returns 1 and its line names the prompts."""
    from trainer.launch import judge_in_vllm

    python, out, res, cfg = launched
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(out / "eval_after.json", run / "eval_after.json")
    _copy(out / "export", run / "export", tensors=lambda s: s.__setitem__("fc.weight", torch.zeros_like(s["fc.weight"])))
    lines = []
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    start = time.perf_counter()
    code = judge_in_vllm(cfg, run, python, cfg.layout.to_layout(), lines.append)
    print(f"end-of-training vLLM step: {time.perf_counter() - start:.0f} s")  # its cost, for the record
    assert code == 1, lines
    failed = next(line for line in lines if line.startswith("run failed: the export judged in vLLM"))
    assert "vLLM's acceptance differs from the project's beyond 0.25 on" in failed and "vs project" in failed
    assert json.loads((run / "eval_vllm.json").read_text())["disagreeing"]


def test_a_run_to_be_judged_in_vllm_without_a_vllm_interpreter_is_refused_before_training(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(_config(out).model_dump(mode="json")))
    env = {k: v for k, v in ENV.items() if k != "DFLASH_VLLM_PYTHON"}
    for extra in ({}, {"DFLASH_VLLM_PYTHON": str(tmp_path / "no-such-python")}):
        res = subprocess.run([sys.executable, "-m", "trainer.launch", "--config", str(out / "config.json")],
                             capture_output=True, text=True, env={**env, **extra}, timeout=300)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "evaluation.engine is vllm, but $DFLASH_VLLM_PYTHON" in res.stderr
        assert "dflashctl rebuild-venv --target T --profile vllm" in res.stderr
        assert not (out / "ranks").exists()


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
