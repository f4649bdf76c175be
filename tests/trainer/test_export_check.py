"""The export loaded as engines load it is the drafter being trained: every tensor and the drafting config
fields compared at step 0 and at each save; a target vLLM cannot serve is refused before training when the run
is to be judged in vLLM."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_targets import MASK_ID, small_model_config
from trainer.export import export_drafter
from trainer.export_check import ExportMismatch, check_export, compare_export
from trainer.model import DFlashDrafter


def _drafter(target, seed=0):
    torch.manual_seed(seed)
    return DFlashDrafter.from_target(small_model_config(), target, MASK_ID).eval()


def _rewrite(export, *, tensors=None, config=None):
    if tensors is not None:
        state = load_file(str(export / "model.safetensors"))
        tensors(state)
        save_file(state, str(export / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((export / "config.json").read_text())
        config(cfg)
        (export / "config.json").write_text(json.dumps(cfg))


def test_an_export_of_the_drafter_passes_and_the_scratch_copy_is_removed(qwen3_target, tmp_path):
    lines = []
    check_export(_drafter(qwen3_target), qwen3_target, tmp_path, step=0, log=lines.append)
    assert lines and "step 0: the export loads as trained" in lines[0]
    assert not (tmp_path / ".export-check").exists()


@pytest.mark.parametrize("fault, expected", [
    (dict(tensors=lambda s: s.__setitem__("fc.weight", torch.zeros_like(s["fc.weight"]))),
     "tensor fc.weight: values differ"),
    (dict(tensors=lambda s: s.pop("layers.0.mlp.down_proj.weight")),
     "tensor layers.0.mlp.down_proj.weight: values differ"),
    (dict(config=lambda c: c["dflash_config"].__setitem__("target_layer_ids", [0, 1, 2])),
     "config dflash_config.target_layer_ids: the export says [0, 1, 2], the trainer trains with [1, 2, 3]"),
    (dict(config=lambda c: c["dflash_config"].__setitem__("mask_token_id", 7)),
     f"config dflash_config.mask_token_id: the export says 7, the trainer trains with {MASK_ID}"),
    (dict(config=lambda c: (c.pop("rope_parameters"), c.__setitem__("rope_theta", 1e6))),
     "config rope_theta: the export says 1000000.0, the trainer trains with 10000.0"),
])
def test_a_tensor_or_drafting_field_the_loader_reads_differently_is_named(fault, expected, qwen3_target, tmp_path):
    drafter = _drafter(qwen3_target)
    export = export_drafter(drafter, qwen3_target, tmp_path / "export")
    _rewrite(export, **fault)
    problems = compare_export(drafter, qwen3_target, export)
    assert any(p.startswith(expected) for p in problems), problems


def test_a_mismatch_stops_the_check_naming_it_and_keeps_the_export_to_inspect(qwen3_target, tmp_path, monkeypatch):
    import trainer.export as ex

    original = ex.export_drafter

    def export_then_corrupt(d, t, out, dtype=torch.bfloat16):  # an exporter that writes a wrong MASK id
        out = original(d, t, out, dtype=dtype)
        _rewrite(out, config=lambda c: c["dflash_config"].__setitem__("mask_token_id", 3))
        return out

    monkeypatch.setattr(ex, "export_drafter", export_then_corrupt)
    with pytest.raises(ExportMismatch, match=r"the export at step 5, loaded as engines load it .*mask_token_id"):
        check_export(_drafter(qwen3_target), qwen3_target, tmp_path, step=5, log=lambda _: None)
    assert (tmp_path / ".export-check" / "config.json").is_file()


def _small_tiny(out, **over):
    from trainer.tiny import tiny_train_config

    cfg = {"max_steps": 2, "log_every": 1, "save_every": 1,
           "model": {"target": "tiny", "block_size": 4, "num_draft_layers": 1, "num_target_features": 1,
                     "tiny_target": {"num_prompts": 24, "held_out": 1, "response_tokens": 16}},
           "data": {"max_len": 48, "token_budget": 96, "max_batch_size": 2, "num_anchors": 4}}
    cfg.update(over)
    return tiny_train_config(out, **cfg)


def test_a_run_to_be_judged_in_vllm_is_refused_before_step_1_when_vllm_cannot_serve_its_target(
        tiny_cache, tmp_path, monkeypatch):
    from trainer.distributed import single_world
    from trainer.loop import train
    from trainer.setup import TrainError

    monkeypatch.setenv("DFLASH_TINY_CACHE", str(tiny_cache))
    cfg = _small_tiny(tmp_path / "run", evaluation={"budgets": [], "temperatures": [0.0], "engine": "vllm"})
    lines = []
    with pytest.raises(TrainError, match=r"vLLM on cpu cannot serve this target: the target's head_dim 16.*"
                                         r"evaluation.engine is vllm"):
        train(cfg, single_world(cfg.layout.to_layout()), log=lines.append)
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))
    assert not any(line.startswith("step ") for line in lines)


def test_a_run_checks_its_export_at_step_0_and_at_every_save(tiny_cache, tmp_path, monkeypatch):
    from trainer.distributed import single_world
    from trainer.loop import train

    monkeypatch.setenv("DFLASH_TINY_CACHE", str(tiny_cache))
    cfg = _small_tiny(tmp_path / "run", evaluation={"budgets": [], "temperatures": [0.0]}, max_steps=3)
    lines = []
    train(cfg, single_world(cfg.layout.to_layout()), log=lines.append)
    checked = [line.split(":")[0] for line in lines if line.startswith("[export-check] step")]
    assert checked == ["[export-check] step 0", "[export-check] step 1", "[export-check] step 2"]
    assert any(line.startswith("[export-check] note: vLLM on cpu cannot serve") for line in lines)
