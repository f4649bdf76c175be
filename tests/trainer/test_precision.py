"""The `precision` setting (trainer/precision.py) through the real training loop (trainer.loop.train, the
colocated layout in this process) on a small tiny-target config: what reaches the parameters, AdamW's state
and the checkpoint; how the loss curves of bf16-mixed and bf16-true compare with fp32's; resume across
precisions; the config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import ConfigError, TinyTargetConfig, load_config, parse_config
from trainer.distributed import single_world
from trainer.loop import train
from trainer.metrics import read_metrics
from trainer.precision import resolve_precision

REPO = Path(__file__).resolve().parents[2]
TINY = TinyTargetConfig(num_prompts=40, held_out=4, response_tokens=24, hidden_size=32, intermediate_size=64, head_dim=8)
MASTER = {"fp32": torch.float32, "bf16-mixed": torch.float32, "bf16-true": torch.bfloat16}


@pytest.fixture(scope="module")
def tiny_cache(tiny_cache):
    """The session's tiny cache (tests/conftest.py) with this TINY built in it, as DFLASH_TINY_CACHE (read when
    a run builds its assets) for the module: every test here, and other files training on it, share one build."""
    from trainer.tiny import build_tiny

    root = tiny_cache
    build_tiny(TINY, cache_root=root, log=lambda _: None)
    old = os.environ.get("DFLASH_TINY_CACHE")
    os.environ["DFLASH_TINY_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("DFLASH_TINY_CACHE", None)
    else:
        os.environ["DFLASH_TINY_CACHE"] = old


def _config(out: Path, precision: str, steps: int):
    return parse_config({
        "model": {"target": "tiny", "tiny_target": TINY.model_dump(mode="json"), "block_size": 4,
                  "num_draft_layers": 1, "num_target_features": 2},
        "data": {"max_len": 64, "token_budget": 256, "max_batch_size": 4, "num_anchors": 8},
        "optim": {"lr": 1e-3},
        "evaluation": {"budgets": [], "temperatures": [0.0]},
        "precision": precision, "epochs": 100, "max_steps": steps, "seed": 3, "output_dir": str(out),
        "log_every": 1, "save_every": 10**6,
    })


def _train(out: Path, precision: str, steps: int) -> list[str]:
    lines: list[str] = []
    cfg = _config(out, precision, steps)
    train(cfg, single_world(cfg.layout.to_layout()), log=lines.append)
    return lines


def _checkpoint(out: Path, step: int) -> dict:
    return torch.load(out / "checkpoints" / f"step_{step:08d}" / "state.pt", weights_only=True)


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r.get("kind") == "train"]


# ------------------------------------------------------------------------------------------ the setting
def test_auto_is_bf16_mixed_on_cuda_and_fp32_on_cpu():
    assert resolve_precision("auto", "cuda").name == "bf16-mixed"
    assert resolve_precision("auto", "cpu").name == "fp32"
    assert resolve_precision("bf16-true", "cpu").master_dtype == torch.bfloat16
    assert resolve_precision("bf16-mixed", "cuda").master_dtype == torch.float32
    with resolve_precision("bf16-mixed", "cpu").autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    for name in ("fp32", "bf16-true"):
        with resolve_precision(name, "cpu").autocast():
            assert not torch.is_autocast_enabled("cpu")


def test_a_bad_precision_names_the_key_the_choices_and_the_file(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("precision: bf16\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: precision: 'bf16' is not a precision; set one of: fp32 (")
    assert "bf16-mixed (float32 master weights and AdamW state, bfloat16 autocast compute" in msg
    assert "bf16-true (" in msg and "auto (" in msg and "Value error" not in msg


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_model_dtype_is_refused_with_the_precision_that_replaces_it(tmp_path):
    """The trainer CLI prints it and exits 2, so an old experiment never trains in a precision it did not ask for."""
    path = tmp_path / "exp.json"
    path.write_text(json.dumps({"model": {"dtype": "bfloat16"}, "output_dir": str(tmp_path / "run")}))
    done = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(path)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert done.returncode == 2, done.stderr
    assert (f"error: {path}: model: model.dtype ('bfloat16') was replaced by the top-level `precision` setting: "
            "write precision: bf16-true for what model.dtype: bfloat16 did") in done.stderr
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------- what reaches the weights
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-true"])
def test_the_setting_reaches_parameters_adamw_state_and_the_checkpoint(precision, tiny_cache, tmp_path):
    out = tmp_path / precision
    lines = _train(out, precision, steps=2)
    assert any(f"precision {precision};" in line for line in lines), lines
    state = _checkpoint(out, 2)
    assert state["precision"] == precision
    assert {t.dtype for t in state["model"].values()} == {MASTER[precision]}
    moments = [s[k] for s in state["optimizer"]["state"].values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {t.dtype for t in moments} == {MASTER[precision]}
    # the export keeps its own dtype whatever the training precision
    from safetensors import safe_open

    with safe_open(str(out / "export" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_bf16_mixed_tracks_fp32_closely_and_bf16_true_less_so(tiny_cache, tmp_path):
    """60 steps from the same seed, data and anchors. Measured on this config: mean |loss - fp32 loss| over
    the steps 5.2e-4 for bf16-mixed, 3.7e-3 for bf16-true (7x). bf16-mixed running as fp32 would give 0;
    running as bf16-true (bfloat16 master weights) would give bf16-true's distance."""
    curves = {p: (_train(tmp_path / p, p, steps=60), _losses(tmp_path / p))[1] for p in ("fp32", "bf16-mixed", "bf16-true")}
    assert all(len(c) == 60 for c in curves.values())

    def distance(p):
        return sum(abs(a - b) for a, b in zip(curves[p], curves["fp32"])) / 60

    mixed, true = distance("bf16-mixed"), distance("bf16-true")
    assert 1e-5 < mixed < 2e-3, (mixed, true)  # bf16 compute differs from fp32, a little
    assert true > 3 * mixed, (mixed, true)
    assert curves["bf16-mixed"][-1] < curves["bf16-mixed"][0] - 0.3  # and it trains


# ----------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("first, then", [("bf16-true", "bf16-mixed"), ("fp32", "bf16-true")])
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_checkpoint_resumes_under_another_precision(first, then, tiny_cache, tmp_path):
    """The resumed run holds the checkpoint's weights and AdamW state in its own master dtype: exactly
    (bf16 -> float32) or rounded (float32 -> bf16), and says so. max_steps = the checkpoint's step: the
    resumed run trains nothing and saves what it loaded."""
    out = tmp_path / "run"
    _train(out, first, steps=2)
    saved = _checkpoint(out, 2)
    lines = _train(out, then, steps=2)
    assert f"[precision] checkpoint step 2 in {out / 'checkpoints'} was trained in {first}; continuing in {then}" in "\n".join(lines)
    resumed = _checkpoint(out, 2)
    dtype = MASTER[then]
    assert resumed["precision"] == then
    for name, t in resumed["model"].items():
        assert t.dtype == dtype and torch.equal(t, saved["model"][name].to(dtype)), name
    for idx, s in resumed["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert s[k].dtype == dtype and torch.equal(s[k], saved["optimizer"]["state"][idx][k].to(dtype))


# ------------------------------------------------------------------------------- one step, each backend
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device, backend", [
    ("cpu", "sdpa"),
    pytest.param("cuda", "sdpa", marks=[pytest.mark.cuda, CUDA]),
    pytest.param("cuda", "flex", marks=[pytest.mark.cuda, CUDA]),  # compiled flex_attention under autocast
])
def test_a_bf16_mixed_step_keeps_float32_masters_and_tracks_fp32(device, backend):
    """One loss + backward under each precision's autocast, from the same float32 weights and anchors:
    bf16-mixed's loss is near fp32's but not equal (bf16 matmuls), and its gradients are float32."""
    from tiny_targets import MASK_ID, build_hf_target, small_model_config

    from trainer.features import TargetModel
    from trainer.model import DFlashDrafter
    from trainer.objective import PackedBatch, dflash_loss

    target = TargetModel(build_hf_target("qwen3").to(device), [1, 2, 3])
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(small_model_config(attention_backend=backend), target, MASK_ID, "float32")
    ids = torch.randint(0, MASK_ID, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    pos = torch.arange(64, device=device).expand(2, 64)
    batch = PackedBatch(ids, torch.ones_like(ids), torch.zeros_like(ids), pos, target.features(ids))
    losses, grads = {}, {}
    for name in ("fp32", "bf16-mixed"):
        drafter.zero_grad(set_to_none=True)
        with resolve_precision(name, device).autocast():
            res = dflash_loss(drafter, batch, num_anchors=8, gamma=4.0, generator=torch.Generator().manual_seed(1))
        res.loss.backward()
        losses[name], grads[name] = res.loss.item(), drafter.fc.weight.grad
    assert grads["bf16-mixed"].dtype == torch.float32 and drafter.fc.weight.dtype == torch.float32
    assert torch.isfinite(grads["bf16-mixed"]).all()
    assert losses["bf16-mixed"] != losses["fp32"] and losses["bf16-mixed"] == pytest.approx(losses["fp32"], rel=2e-2)
    cos = torch.nn.functional.cosine_similarity(grads["bf16-mixed"].flatten(), grads["fp32"].flatten(), dim=0)
    assert cos > 0.98, cos
