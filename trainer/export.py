"""Export a drafter in the reference layout (docs/dflash.md §1.6) so serving stacks load it.

    out_dir/config.json        Qwen3-style config + DFlash fields (block_size, dflash_config, num_target_layers)
    out_dir/model.safetensors  unprefixed draft weights only (no embed_tokens / lm_head): 11 per layer + 3
    out_dir/dflash.py          the self-contained remote code (auto_map -> dflash.DFlashDraftModel)

The directory appears complete or not at all: everything is written into a temporary sibling, fsynced,
then renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch

from trainer.atomic import fsync_dir, fsync_file


def reference_code() -> bytes:
    """The self-contained remote code shipped beside every export (trainer/reference/dflash.py).

    Read as package data, never through ``__file__``: in a container the trainer runs from the bundle zip
    (``PYTHONPATH=<hash>.zip``), where the package directory is not a directory on disk.
    """
    return resources.files("trainer").joinpath("reference/dflash.py").read_bytes()

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def draft_config_dict(drafter, target, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json content for ``drafter`` trained against ``target``.

    Carries a top-level ``rope_theta`` as well as ``rope_parameters``: transformers 4.57 loaders read the
    former and silently fall back to 10000 without it; 5.x reads the latter.
    """
    c = drafter.cfg
    tcfg = target.config

    def tok(name):
        v = getattr(tcfg, name, None)
        return v if isinstance(v, (int, list)) or v is None else None

    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": ["full_attention"] * c.num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": c.num_layers,
        "tie_word_embeddings": False,
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
        "bos_token_id": tok("bos_token_id"),
        "eos_token_id": tok("eos_token_id"),
        "initializer_range": 0.02,
        "use_cache": True,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": list(c.target_layer_ids),
            "block_size": c.block_size,
        },
    }


def export_drafter(drafter, target, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the drafter in the reference layout, atomically.

    Args:
        drafter: a `trainer.model.DFlashDrafter`.
        target: the `trainer.features.TargetModel` it was trained against (config fields are copied).
        out_dir: destination directory; replaced if it exists.
        dtype: weights dtype in the file (the reference checkpoints are bfloat16).

    Returns:
        The output directory.

    Raises:
        ValueError: a dtype with no config name, or a state_dict that is not the expected draft layout.
    """
    from safetensors.torch import save_file

    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype {dtype} unsupported; use torch.bfloat16, torch.float16 or torch.float32")
    out = Path(out_dir)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    expected = 3 + 11 * drafter.cfg.num_layers
    if len(state) != expected or any(k.startswith(("embed_tokens", "lm_head")) for k in state):
        raise ValueError(
            f"drafter state_dict has {len(state)} tensors ({sorted(state)[:4]}...), expected {expected} draft "
            "tensors without embed_tokens/lm_head"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; an export is meant to be shared
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(draft_config_dict(drafter, target, dtype), indent=2) + "\n")
        (tmp / "dflash.py").write_bytes(reference_code())
        for name in ("model.safetensors", "config.json", "dflash.py"):
            fsync_file(tmp / name)
        fsync_dir(tmp)
        old = None
        if out.exists():
            # A directory cannot be renamed over a non-empty one: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "x")
        os.rename(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
