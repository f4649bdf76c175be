"""Export in the reference layout, reloaded through AutoModel(trust_remote_code=True)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from tiny_targets import MASK_ID, small_model_config
from trainer.evaluate import acceptance_length
from pathlib import Path

from trainer.export import export_drafter
from trainer.model import DFlashDrafter

pytestmark = pytest.mark.slow  # runs real processes: `-m "not slow"` leaves it out

BS = 4
REPO = Path(__file__).resolve().parents[2]
# The checked-in remote code (the export must ship exactly these bytes).
REFERENCE_CODE = REPO / "trainer" / "reference" / "dflash.py"


def _drafter(target, layers=5, seed=0):
    torch.manual_seed(seed)
    return DFlashDrafter.from_target(small_model_config(num_draft_layers=layers), target, MASK_ID).eval()


def _load(path, dtype=torch.float32):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(path), trust_remote_code=True, dtype=dtype).eval()


def test_layout_58_tensors_and_config_fields(qwen3_target, tmp_path):
    out = export_drafter(_drafter(qwen3_target), qwen3_target, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert tuple(f.get_tensor("fc.weight").shape) == (64, 192)
    assert len(keys) == 58
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head")) for k in keys)
    assert "layers.4.self_attn.k_norm.weight" in keys and "hidden_norm.weight" in keys
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["model_type"] == "qwen3"
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert cfg["block_size"] == BS and cfg["dflash_config"]["block_size"] == BS
    assert cfg["dflash_config"]["mask_token_id"] == MASK_ID
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 5
    assert cfg["layer_types"] == ["full_attention"] * 5 and cfg["tie_word_embeddings"] is False
    assert cfg["dtype"] == "bfloat16" and cfg["vocab_size"] == 256
    assert (out / "dflash.py").read_bytes() == REFERENCE_CODE.read_bytes()


@pytest.fixture(scope="module")
def qwen3_rope_1e6_target():
    """A Qwen3 target with RoPE base 1e6 (Qwen3's real models use 1e6; the other fixtures the default 1e4)."""
    from tiny_targets import build_target

    return build_target("qwen3", layers=6, layer_ids=(1, 2, 3), rope_theta=1e6)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3-rope-1e6"])
def test_reload_drafts_the_same_tokens(family, qwen3_target, llama_target, qwen3_rope_1e6_target, tmp_path):
    target = {"qwen3": qwen3_target, "llama": llama_target, "qwen3-rope-1e6": qwen3_rope_1e6_target}[family]
    drafter = _drafter(target, layers=2)
    # The RoPE base travels target -> drafter -> config.json -> the loaded model: a non-default one too.
    theta = 1e6 if family == "qwen3-rope-1e6" else 10000.0
    assert target.rope_theta == drafter.cfg.rope_theta == theta
    # sharpen the drafter so its drafts are not near-ties
    with torch.no_grad():
        drafter.norm.weight.mul_(4.0)
    out = export_drafter(drafter, target, tmp_path / family, dtype=torch.float32)
    model = _load(out)
    assert type(model).__name__ == "DFlashDraftModel"
    assert model.block_size == BS and model.mask_token_id == MASK_ID
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == model.rope_theta == theta

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MASK_ID, (1, 30), generator=g)
    feats = target.features(ids)
    for start in (5, 17, 29):
        block = torch.full((1, BS), MASK_ID)
        block[0, 0] = ids[0, start]
        ctx_pos = torch.arange(start)[None]
        block_pos = torch.arange(start, start + BS)[None]
        with torch.no_grad():
            ours = drafter.draft_step(block, feats[:, :start], ctx_pos, block_pos, drafter.new_cache())
            theirs = model(target.embed_tokens(block), feats[:, :start], torch.cat([ctx_pos, block_pos], 1))
        assert torch.allclose(ours, theirs, atol=1e-5)
        assert torch.equal(drafter.logits(ours).argmax(-1), target.lm_head(theirs).argmax(-1))

    # the exported spec_generate makes the same rounds as the trainer's evaluation
    prompt = ids[0, :8].tolist()
    report = acceptance_length(drafter, target, [prompt], max_new_tokens=20)
    with torch.no_grad():
        gen, lens = model.spec_generate(target.hf, torch.tensor([prompt]), max_new_tokens=20, return_stats=True)
    assert gen[0, 8:].tolist() == report.outputs[0]
    assert sum(lens) / len(lens) == pytest.approx(report.mean)


def test_bfloat16_export_reloads_in_bfloat16(qwen3_target, tmp_path):
    drafter = _drafter(qwen3_target, layers=2)
    model = _load(export_drafter(drafter, qwen3_target, tmp_path / "bf16"), dtype=torch.bfloat16)
    assert model.fc.weight.dtype == torch.bfloat16
    assert torch.equal(model.fc.weight, drafter.fc.weight.to(torch.bfloat16))
    gen = model.spec_generate(qwen3_target.hf, torch.tensor([[1, 2, 3, 4]]), max_new_tokens=6)
    assert gen.shape == (1, 10)


def test_export_replaces_atomically_and_leaves_no_temporaries(qwen3_target, tmp_path, monkeypatch):
    dest = tmp_path / "export"
    first = _drafter(qwen3_target, layers=2, seed=0)
    export_drafter(first, qwen3_target, dest)
    before = (dest / "model.safetensors").read_bytes()
    # a failing export (wrong layout) leaves the previous export untouched
    broken = _drafter(qwen3_target, layers=2, seed=1)
    broken.register_buffer("stray", torch.zeros(2, 2))  # an extra tensor the layout does not have
    with pytest.raises(ValueError, match="expected 25 draft tensors"):
        export_drafter(broken, qwen3_target, dest)
    assert (dest / "model.safetensors").read_bytes() == before
    # a failure half-way through writing leaves the previous export too, and no temporary behind
    import trainer.export as export_mod

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(export_mod, "reference_code", fail)
    with pytest.raises(OSError, match="disk full"):
        export_drafter(_drafter(qwen3_target, layers=2, seed=2), qwen3_target, dest)
    monkeypatch.undo()
    assert (dest / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    export_drafter(_drafter(qwen3_target, layers=2, seed=2), qwen3_target, dest)
    assert (dest / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_reference_code_is_self_contained():
    tree = ast.parse(REFERENCE_CODE.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports in remote code"
            roots.add(node.module.split(".")[0])
    assert roots <= {"torch", "transformers", "inspect", "__future__"}, roots
    # and it imports without the trainer package on the path
    code = f"import importlib.util as u; s=u.spec_from_file_location('d', {str(REFERENCE_CODE)!r}); m=u.module_from_spec(s); s.loader.exec_module(m); print(m.DFlashDraftModel.__name__)"
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DFlashDraftModel"


def test_export_from_the_bundle_zip(tmp_path):
    """In a container the trainer runs from the bundle zip (PYTHONPATH=<hash>.zip): package data must be read
    as package data. Reading trainer/reference/dflash.py through __file__ died here with NotADirectoryError,
    after a whole training run."""
    from orchestrator.bundle import build_bundle

    bundle = build_bundle()
    zpath = tmp_path / bundle.filename
    zpath.write_bytes(bundle.data)
    conftest_dir = Path(__file__).resolve().parent
    code = (
        "import sys, trainer, trainer.export as e\n"
        f"assert trainer.__file__.startswith({str(zpath)!r}), trainer.__file__\n"
        "from tiny_targets import MASK_ID, small_model_config, build_target\n"
        "from trainer.model import DFlashDrafter\n"
        "t = build_target('qwen3', layers=6, layer_ids=(1, 2, 3))\n"
        "d = DFlashDrafter.from_target(small_model_config(num_draft_layers=2), t, MASK_ID)\n"
        f"out = e.export_drafter(d, t, {str(tmp_path / 'export')!r})\n"
        "print(sorted(p.name for p in out.iterdir()))\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": f"{zpath}:{conftest_dir}"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "['config.json', 'dflash.py', 'model.safetensors']"
    assert (tmp_path / "export" / "dflash.py").read_bytes() == REFERENCE_CODE.read_bytes()


# -- the published decode loop: transformers' own DynamicCache, under 5.x and 4.57 ------------------------
TF457 = "/tmp/tf457"
TF457_BUILD = (
    f"uv venv --system-site-packages --python python3 {TF457} && "
    f"uv pip install --python {TF457}/bin/python 'transformers==4.57.*'"
)


def _tf457_python() -> str:
    """The interpreter with transformers 4.57 (over this one's other packages) that .ci/run builds."""
    python = os.environ.get("DFLASH_TF457_PYTHON") or f"{TF457}/bin/python"
    if Path(python).exists():
        return python
    message = f"no transformers 4.57 interpreter at {python}; build it with: {TF457_BUILD}"
    if os.environ.get("DFLASHCTL_CI"):
        pytest.fail(message + " (.ci/run builds it: CI must run this test)")
    pytest.skip(message)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # the published loop's own kwarg
@pytest.mark.parametrize("interpreter", ["transformers 5", "transformers 4.57"])
def test_published_decode_loop_runs_the_export_with_a_dynamic_cache(interpreter, tmp_path):
    """The export loaded by AutoModel(trust_remote_code=True), driven as the published loop drives it (a
    DynamicCache as past_key_values, cropped after each draft), spec_generate and our evaluation of the
    bf16 file: the same tokens (the target's greedy ones) and the same acceptance lengths."""
    if interpreter == "transformers 5":  # this interpreter's: no second one to start, import and build in
        import published_loop

        result = json.loads(json.dumps(published_loop.run(str(tmp_path))))
    else:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            [_tf457_python(), str(Path(__file__).with_name("published_loop.py")), str(tmp_path)],
            capture_output=True, text=True, env=env, timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["transformers"].startswith("5." if interpreter == "transformers 5" else "4.57.")
    assert result["dtype"] == "torch.bfloat16"
    accepted = 0
    for p in result["prompts"]:
        assert p["published"] == p["spec_generate"] == p["ours"] == p["greedy"]
        assert p["published_lens"] == p["spec_generate_lens"]
        assert p["ours_tau"] == pytest.approx(sum(p["published_lens"]) / len(p["published_lens"]))
        accepted += sum(n > 1 for n in p["published_lens"])
    assert accepted >= 4  # rounds that kept drafts: the crop after a partial acceptance was exercised


def test_config_json_is_the_reference_layout_field_by_field(qwen3_target):
    """Every field of the exported config.json, as the reference loader reads it (the fixed ones written out:
    a renamed key or a changed constant is a different file for every consumer)."""
    from trainer.export import draft_config_dict

    drafter = _drafter(qwen3_target, layers=2)
    c, tcfg = drafter.cfg, qwen3_target.config
    bos, eos = getattr(tcfg, "bos_token_id", None), getattr(tcfg, "eos_token_id", None)
    expected = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 2, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "attention_bias": False, "attention_dropout": 0.0, "layer_types": ["full_attention"] * 2,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 2, "tie_word_embeddings": False,
        "dtype": "bfloat16", "torch_dtype": "bfloat16",
        "bos_token_id": bos if isinstance(bos, (int, list)) else None,
        "eos_token_id": eos if isinstance(eos, (int, list)) else None,
        "initializer_range": 0.02, "use_cache": True, "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                          "block_size": c.block_size},
    }
    assert draft_config_dict(drafter, qwen3_target) == expected
    assert draft_config_dict(drafter, qwen3_target, torch.float32)["torch_dtype"] == "float32"
    tcfg.bos_token_id, tcfg.eos_token_id = 7, [8, 9]  # the target's token ids pass through, an int or a list
    try:
        got = draft_config_dict(drafter, qwen3_target)
        assert (got["bos_token_id"], got["eos_token_id"]) == (7, [8, 9])
    finally:
        tcfg.bos_token_id, tcfg.eos_token_id = bos, eos


# -- what the export writes, exactly, and how it replaces an old export -----------------------------------


def test_the_weights_file_and_config_text_are_the_reference_formats(qwen3_target, tmp_path):
    """safetensors metadata {"format": "pt"} (what transformers' save_pretrained writes and loaders check), a
    config.json indented by two with a final newline, the weights and config in the dtype asked for, and the
    export directory readable by everyone (mkdtemp makes 0700; an export is shared with a serving stack)."""
    out = export_drafter(_drafter(qwen3_target, layers=2), qwen3_target, tmp_path / "a" / "b" / "export",
                         dtype=torch.float32)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_tensor("fc.weight").dtype == torch.float32
    text = (out / "config.json").read_text()
    cfg = json.loads(text)
    assert text == json.dumps(cfg, indent=2) + "\n" and text.startswith('{\n  "architectures": [\n    "DFlash')
    assert (cfg["dtype"], cfg["torch_dtype"]) == ("float32", "float32")
    assert out.stat().st_mode & 0o777 == 0o755


def test_an_unsupported_dtype_or_an_embedding_in_the_state_is_refused_by_name(qwen3_target, tmp_path):
    with pytest.raises(ValueError) as info:
        export_drafter(_drafter(qwen3_target, layers=2), qwen3_target, tmp_path / "x", dtype=torch.int8)
    assert str(info.value) == ("export dtype torch.int8 unsupported; use torch.bfloat16, torch.float16 or "
                               "torch.float32")
    for name in ("embed_tokens", "lm_head"):  # the right number of tensors, but one is the target's
        drafter = _drafter(qwen3_target, layers=2)
        del drafter.hidden_norm._parameters["weight"]
        drafter.register_buffer(f"{name}_copy", torch.zeros(2))
        with pytest.raises(ValueError) as info:
            export_drafter(drafter, qwen3_target, tmp_path / "x")
        first = sorted([f"{name}_copy", "fc.weight", "layers.0.input_layernorm.weight",
                        "layers.0.mlp.down_proj.weight", "layers.0.mlp.gate_proj.weight"])[:4]
        assert str(info.value) == (f"drafter state_dict has 25 tensors ({first}...), expected 25 draft tensors "
                                   "without embed_tokens/lm_head")
    assert not (tmp_path / "x").exists() and list(tmp_path.iterdir()) == []


def test_the_export_is_written_beside_its_destination_and_the_old_one_moved_aside_there(qwen3_target, tmp_path,
                                                                                         monkeypatch):
    """The temporary directory is a hidden sibling of the destination (same file system: the final rename is
    atomic), and a replaced export is moved into a hidden sibling before it is deleted."""
    import trainer.export as export_mod

    dest, seen = tmp_path / "export", []
    real_code, real_fsync_dir = export_mod.reference_code, export_mod.fsync_dir
    monkeypatch.setattr(export_mod, "reference_code",
                        lambda: seen.append(sorted(p.name for p in tmp_path.iterdir())) or real_code())
    monkeypatch.setattr(export_mod, "fsync_dir", lambda path: (
        seen.append(sorted(p.name for p in tmp_path.iterdir())) if path == tmp_path else None,
        real_fsync_dir(path))[1])
    export_drafter(_drafter(qwen3_target, layers=2), qwen3_target, dest)
    export_drafter(_drafter(qwen3_target, layers=2, seed=1), qwen3_target, dest)
    shapes = [[name.split("-")[0] if name.startswith(".") else name for name in names] for names in seen]
    # first export: writing the temporary, then the rename; second: writing beside the old one, then both moves
    assert shapes == [[".export.tmp"], ["export"], [".export.tmp", "export"], [".export.old", "export"]], seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_failure_after_the_rename_is_reported_as_itself(qwen3_target, tmp_path, monkeypatch):
    """A failure after the temporary became the export (syncing the parent directory) surfaces with its own
    message: the clean-up of a temporary that is no longer there must not replace it."""
    import trainer.export as export_mod

    real = export_mod.fsync_dir

    def fsync_dir(path):
        if path == tmp_path:
            raise OSError("I/O error syncing the parent")
        real(path)

    monkeypatch.setattr(export_mod, "fsync_dir", fsync_dir)
    with pytest.raises(OSError) as info:
        export_drafter(_drafter(qwen3_target, layers=2), qwen3_target, tmp_path / "export")
    assert str(info.value) == "I/O error syncing the parent"


def test_a_token_id_that_is_not_an_int_or_a_list_is_written_as_null(qwen3_target):
    from trainer.export import draft_config_dict

    drafter, tcfg = _drafter(qwen3_target, layers=2), qwen3_target.config
    bos, eos = tcfg.bos_token_id, tcfg.eos_token_id
    try:
        # transformers 4.57 (which pyproject allows) keeps whatever a config.json holds; 5.x validates on
        # setattr, so the test writes the attribute's slot directly.
        vars(tcfg)["eos_token_id"], vars(tcfg)["bos_token_id"] = "2", 1
        got = draft_config_dict(drafter, qwen3_target)
        assert (got["bos_token_id"], got["eos_token_id"]) == (1, None)
    finally:
        tcfg.bos_token_id, tcfg.eos_token_id = bos, eos
