"""τ of the artifact that ships: the exported directory as users load it (`load_export`), the same remote code
holding the trainer's weights cast to the export dtype (`shipped_model`), the training loop's evaluation of it
(`periodic_eval`), held-out prompts through the chat template (`load_prompts`), and `python -m trainer eval`
(`evaluate_export`). The decoding and its counting are trainer.evaluate's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.evaluate import EvalReport, evaluate


def load_export(export_dir: str | Path, device: torch.device | str = "cpu"):
    """The exported drafter as users load it: ``AutoModel.from_pretrained(dir, trust_remote_code=True)``,
    in the file's dtype (bf16 for a default export).

    Raises:
        ValueError: the directory is not an export (no config.json / model.safetensors / dflash.py).
    """
    from transformers import AutoModel

    p = Path(export_dir)
    missing = [n for n in ("config.json", "model.safetensors", "dflash.py") if not (p / n).is_file()]
    if missing:
        raise ValueError(
            f"{p}: not an exported drafter (missing {', '.join(missing)}); point --export at the export/ "
            "directory of a finished run"
        )
    model = AutoModel.from_pretrained(str(p), trust_remote_code=True, dtype="auto")
    return model.to(device).eval()


def shipped_model(drafter, target, dtype: torch.dtype = torch.bfloat16):
    """The remote code that ships with every export, holding ``drafter``'s weights cast to ``dtype``.

    What `load_export` would return for an export of ``drafter`` at ``dtype`` (the same file, the same
    rounding), without writing one: the periodic evaluation measures the artifact, not the fp32 weights.
    """
    from transformers import Qwen3Config

    from trainer.export import draft_config_dict
    from trainer.reference.dflash import DFlashDraftModel

    cfg = Qwen3Config.from_dict(draft_config_dict(drafter, target, dtype))
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    state = {k: v.detach().to(dtype) for k, v in drafter.state_dict().items()}
    model.load_state_dict(state, assign=True, strict=True)
    return model.to(target.device).eval()  # evaluation runs where the target is (a split layout has both)


def periodic_eval(
    drafter,
    target,
    prompts: list[list[int]],
    cfg,
    *,
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    export_dir: str | Path | None = None,
) -> EvalReport | None:
    """The training loop's τ evaluation (before, during and after training): the shipped artifact, every mode.

    Without ``export_dir`` the drafter's weights are cast to the export dtype inside the shipped remote code
    (`shipped_model`: exactly what an export would load); with it, the written export is loaded from disk
    (`load_export`), as after the final export.

    Args:
        drafter: the trainer's `DFlashDrafter` (its weights and train/eval mode are left untouched).
        target: the `TargetModel`.
        prompts: held-out prompts (None report without any).
        cfg: a `trainer.config.EvalConfig` (budgets, temperatures, seed).
        max_new_tokens: N per prompt.
        stop_token_ids: the tokenizer's end tokens.
        dtype: the export dtype.
        export_dir: an export of this drafter to measure instead.

    Returns:
        EvalReport (None without prompts); ``report.to_record()`` is the metrics line's payload,
        ``report.to_dict()`` the eval json.
    """
    if not prompts:
        return None
    model = shipped_model(drafter, target, dtype) if export_dir is None else load_export(export_dir, target.device)
    return evaluate(
        model, target, prompts, budgets=cfg.budgets, temperatures=cfg.temperatures, max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids, seed=cfg.seed,
    )


def load_prompts(files: list[str], tokenizer, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """Held-out prompts: each jsonl record's messages up to (not including) its first assistant turn, through
    the tokenizer's chat template with the generation prompt (the deployment's template, §4).

    Records without an assistant turn are prompts as they are. Unreadable records are skipped and counted.

    Raises:
        DataError: a missing file, or no usable prompt at all (the message lists why records were skipped).
    """
    from trainer.data import DataError, SkipReport, read_prompts

    report = SkipReport()
    prompts = read_prompts(files, tokenizer, chat_template_kwargs, report,
                           "a jsonl of conversations with `messages`")
    if not prompts:
        raise DataError(f"no usable prompt in {', '.join(map(str, files))}: {report.summary()}")
    return prompts


def evaluate_export(
    export_dir: str | Path,
    target_dir: str | Path,
    prompt_files: list[str],
    cfg,
    *,
    max_new_tokens: int = 256,
    max_prompts: int | None = None,
    device: str = "cpu",
    target_dtype: torch.dtype = torch.bfloat16,
    chat_template_kwargs: dict | None = None,
) -> EvalReport:
    """τ of an exported drafter directory against its target directory (``python -m trainer eval``).

    The drafter is the bf16 file loaded as users load it (`load_export`); the target is loaded in
    ``target_dtype`` (bf16, as the published benchmark loads it) with the feature layers the export names.

    Args:
        export_dir: an export (config.json, model.safetensors, dflash.py).
        target_dir: the target's HF model directory, with its tokenizer.
        prompt_files: jsonl files of held-out conversations.
        cfg: a `trainer.config.EvalConfig`.
        max_new_tokens: N per prompt.
        max_prompts: evaluate the first this many prompts only.
        device: where both models run.
        target_dtype: the target's weights dtype.
        chat_template_kwargs: extra chat-template arguments (e.g. {"enable_thinking": False}).

    Raises:
        ValueError: not an export, not a model directory, or a drafter built for another target.
        DataError: unusable prompt files.
    """
    from transformers import AutoTokenizer

    from trainer.features import TargetModel

    drafter = load_export(export_dir, device)
    if not (Path(target_dir) / "config.json").is_file():
        raise ValueError(f"{target_dir}: no HF model directory there (no config.json); give --target the target's directory")
    target = TargetModel.from_pretrained(target_dir, layer_ids=drafter.target_layer_ids, dtype=target_dtype, device=device)
    if (target.hidden_size, target.vocab_size) != (drafter.config.hidden_size, drafter.config.vocab_size):
        raise ValueError(
            f"{export_dir} was trained for a target with hidden size {drafter.config.hidden_size} and "
            f"{drafter.config.vocab_size} tokens; {target_dir} has {target.hidden_size} and {target.vocab_size}: "
            "give the target the drafter was trained against"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = load_prompts(prompt_files, tokenizer, chat_template_kwargs)[:max_prompts]
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return evaluate(
        drafter, target, prompts, budgets=cfg.budgets, temperatures=cfg.temperatures, max_new_tokens=max_new_tokens,
        stop_token_ids=stop, seed=cfg.seed,
    )
