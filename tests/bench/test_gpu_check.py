"""bench/gpu_check.sh and bench/gpu_step.py on a CPU machine: the no-GPU message and exit 0, and the step's
code path (drafter step, tokens/s, FLOP count) at the tiny size."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _gpu_step():
    spec = importlib.util.spec_from_file_location("gpu_step", REPO / "bench" / "gpu_step.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_step"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run the check")
def test_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh")], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout == "gpu_check: no CUDA GPU on this machine (torch sees no CUDA device); nothing to check.\n"


def test_gpu_check_refuses_an_unknown_argument():
    r = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--gpu"], env=_env(),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert "unknown argument '--gpu'; usage: bash bench/gpu_check.sh [--cpu-tiny]" in r.stderr


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_step_on_cpu_at_the_tiny_size_reports_tokens_per_s_and_flops(tmp_path):
    out = tmp_path / "step.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_step.py"), "step", "--size", "tiny", "--device", "cpu",
         "--steps", "1", "--lengths", "64", "--json", str(out)],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["device"] == "cpu" and rep["size"] == "tiny"
    (rec,) = rep["results"]
    assert rec["backend"] == "sdpa" and rec["row_len"] == 64 and rec["rows"] == 1 and rec["precision"] == "fp32"
    assert rec["tokens_per_s"] == pytest.approx(64 / rec["step_s"])
    assert rec["flops"]["total"] == sum(v for k, v in rec["flops"].items() if k != "total") > 0
    assert "sdpa          row     64:" in r.stdout


def test_flop_count_of_the_linear_parts_equals_torchs_flop_counter():
    """FlopCounterMode counts every matmul of a real step (forward + backward); on CPU it does not see the
    SDPA kernel, so the attention term is checked on its own against the mask's pairs."""
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.objective import dflash_loss

    gs = _gpu_step()
    g = gs.SIZES["tiny"]
    torch.manual_seed(0)
    drafter = gs.build_drafter(g, "sdpa", torch.device("cpu"))
    batch, anchors = gs.make_batch(g, 2, 64, torch.device("cpu"))
    with FlopCounterMode(display=False) as counter:
        out = dflash_loss(drafter, batch, num_anchors=g.anchors, gamma=7.0, anchors=anchors)
        out.loss.backward()
    pairs = gs.visible_pairs(g, batch, anchors)
    ours = gs.step_flops(g, 2, 64, int(out.n_tokens), pairs)
    counted = counter.get_total_flops()
    assert counted in (ours["total"] - ours["attention"], ours["total"])
    # One document per row: a kept block at anchor a sees the a context tokens before it and its own bs
    # slots; a padded block sees only its own slots.
    a, keep = anchors
    assert pairs == int((g.block * (g.block + a * keep)).sum())
    assert ours["attention"] == 3 * g.layers * 4 * pairs * g.heads * g.head_dim


def test_forward_flops_equal_torchs_flop_counter_without_backward():
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.objective import dflash_loss

    gs = _gpu_step()
    g = gs.SIZES["tiny"]
    drafter = gs.build_drafter(g, "sdpa", torch.device("cpu"))
    batch, anchors = gs.make_batch(g, 1, 128, torch.device("cpu"))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = dflash_loss(drafter, batch, num_anchors=g.anchors, gamma=7.0, anchors=anchors)
    ours = gs.step_flops(g, 1, 128, int(out.n_tokens), gs.visible_pairs(g, batch, anchors), backward=False)
    assert counter.get_total_flops() in (ours["total"] - ours["attention"], ours["total"])


@pytest.mark.parametrize(
    "name,peak",
    [("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 80GB HBM3", 989.0),
     ("NVIDIA H100 PCIe", 756.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA GeForce RTX 4090", None)],
)  # fmt: skip
def test_peak_by_device_name(name, peak):
    assert _gpu_step().peak_tflops(name) == peak


def test_warmup_config_at_qwen3_8b_size_is_a_valid_train_config(tmp_path):
    """What gpu_check.sh hands `python -m trainer.warmup` on the GPU: checked here, where no GPU can."""
    from transformers import AutoConfig

    from trainer.config import load_config
    from trainer.warmup import training_shapes

    assert _gpu_step().main(["warmup-config", str(tmp_path), "--size", "qwen3-8b", "--row-len", "4096"]) == 0
    cfg = load_config(tmp_path / "train.json")
    assert [s.to_dict() for s in training_shapes(cfg)] == [{"rows": 1, "row_len": 4096, "num_anchors": 512}]
    from trainer.precision import resolve_precision

    assert cfg.compile.enabled and cfg.model.num_draft_layers == 5
    # The warm-up compiles what the timed step runs: the trainer's own default, bf16-mixed on the GPU.
    assert cfg.precision == "auto" and resolve_precision(cfg.precision, "cuda").name == "bf16-mixed"
    tc = AutoConfig.from_pretrained(cfg.model.target)
    assert (tc.hidden_size, tc.num_hidden_layers, tc.num_attention_heads, tc.num_key_value_heads) == (4096, 36, 32, 8)
    from trainer.features import rope_theta_of

    assert rope_theta_of(tc) == 1e6


# The two summary lines trainer.warmup prints (its documented format), among the log lines around them.
WARMUP_LOG = """building target config
{"event": "warmup_shape", "shape": {"rows": 1, "row_len": 64, "num_anchors": 8}, "device": "cpu", "compile_s": 15.8147, "first_call_s": 18.0494, "steady_s": 2.2347, "fxgraph_cache_hit": 2, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 0, "autograd_cache_hit": 1, "autograd_cache_miss": 0, "autograd_cache_bypass": 0, "unique_graphs": 1}
{"event": "warmup_done", "device": "cpu", "cache_dir": "/tmp/x/inductor", "compile_s": 15.8147, "cache_hits": 3, "cache_misses": 0, "compiled": {"drafter_forward": true, "flex_attention": false}}
{not json
"""


def test_warmup_summary_reads_the_warmups_own_lines(tmp_path, capsys):
    log = tmp_path / "warmup_2.log"
    log.write_text(WARMUP_LOG)
    assert _gpu_step().main(["warmup-summary", str(log), "--label", "warm-up 2"]) == 0
    assert capsys.readouterr().out == (
        "warm-up 2: compile 15.8 s (first call 18.0 s, steady 2.23 s), cache hits 3, misses 0, graphs 1, "
        "compiled drafter_forward\n"
    )
    log.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    assert _gpu_step().main(["warmup-summary", str(log), "--label", "warm-up 1"]) == 1
    assert capsys.readouterr().out == f"warm-up 1: no warm-up summary in {log}\n"


def test_a_backend_that_ran_a_longer_row_is_measured_again_at_sdpas_row():
    """What makes the flex/SDPA ratio comparable when flex fits a longer row than SDPA (on a GPU). Here both
    are SDPA steps (flex has no CPU backward); a backend name's suffix other than +compile changes nothing."""
    gs = _gpu_step()
    g = gs.SIZES["tiny"]
    cpu = torch.device("cpu")
    results = [
        gs.measure(g, "sdpa", cpu, 1, 64, 1, None),
        gs.measure(g, "sdpa+same", cpu, 1, 128, 1, None),
        {"backend": "flex", "row_len": 128, "error": "OutOfMemoryError: CUDA out of memory"},
    ]
    extra = gs.at_baseline_length(g, results, cpu, 1, 1, None, deadline=float("inf"))
    assert [(r["backend"], r["row_len"]) for r in extra] == [("sdpa+same", 64)]
    assert extra[0]["tokens_per_s"] == pytest.approx(64 / extra[0]["step_s"])
    assert gs.at_baseline_length(g, results, cpu, 1, 1, None, deadline=0.0) == []


def test_a_bf16_mixed_step_keeps_float32_master_weights():
    """--precision bf16-mixed (the GPU default): the step runs under bf16 autocast, the drafter's weights and
    AdamW state stay float32, as trainer.loop trains."""
    import dataclasses

    gs = _gpu_step()
    g = dataclasses.replace(gs.SIZES["tiny"], precision="bf16-mixed")
    cpu = torch.device("cpu")
    drafter = gs.build_drafter(g, "sdpa", cpu)
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}
    seen = []
    drafter.layers[0].register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    batch, anchors = gs.make_batch(g, 1, 64, cpu)
    from trainer.precision import resolve_precision

    gs.time_steps(drafter, batch, anchors, 1, resolve_precision("bf16-mixed", cpu))
    assert seen == [True] * 3  # two untimed steps and one timed, each forward under bf16 autocast
    seen.clear()
    gs.time_steps(drafter, batch, anchors, 1, resolve_precision("fp32", cpu))
    assert seen == [False] * 3
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}
