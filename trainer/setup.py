"""What a rank loads before it trains: tokenizer, samples, the target, held-out prompts.

    target / colocated rank   the whole frozen target (it computes features)
    drafter rank              only the target's config, embedding, LM head and final norm
                              (trainer.features.TargetHead, read selectively from the safetensors files)
    the data builder          (the first target rank, or the colocated rank) reads and regenerates the
                              conversations and opens their token store (trainer.store), building it first
                              if no run of the target built it yet (trainer.storebuild), then points the run at it
                              (<run>/data/store.json); every other rank waits for that pointer and maps the
                              same store, so all ranks see the very same samples; across nodes the store's
                              files are sent to each node (World.share_store)
    the main drafter rank     also the held-out prompts for τ

A resumed run finds its pointer in place, opens the same store and never regenerates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainer.atomic import write_json
from trainer.config import TrainConfig
from trainer.data import DataError, SkipReport, read_prompts
from trainer.regenerate import regenerated_files
from trainer.store import POINTER, TokenStore, datasets_root, open_store, read_pointer, wait_for_store, write_pointer
from trainer.storebuild import build_store

class TrainError(RuntimeError):
    """Training cannot start or continue; the message says what to change."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_mask_token_id(configured: int | None, tokenizer: Any, vocab_rows: int) -> int:
    """MASK id: the configured one, else the tokenizer's mask token, else the first id the tokenizer
    does not use if the embedding has such a row.

    Raises:
        TrainError: none of these exists.
    """
    if configured is not None:
        return configured
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_rows:
        return len(tokenizer)
    raise TrainError(
        f"no MASK token: the tokenizer has no mask token and uses all {vocab_rows} embedding rows; "
        "set model.mask_token_id to an id the data never contains"
    )


@dataclass
class Sources:
    """Where the target and the data of a run come from (model.target: tiny builds them here)."""

    target_dir: Path
    train_files: list[str]
    eval_files: list[str]
    regenerate: bool


def resolve_sources(cfg: TrainConfig, log: Callable[[str], None]) -> Sources:
    """The target directory and data files of `cfg` (building the tiny assets if asked).

    Raises:
        TrainError: no training files, or no HF model directory at model.target.
    """
    data = cfg.data
    train_files, eval_files, regen = list(data.train_files), list(data.eval_files), data.regenerate
    if cfg.model.target == "tiny":
        from trainer.tiny import build_tiny

        assets = build_tiny(cfg.model.tiny_target, log=log)
        target_dir = assets.target_dir
        if not train_files:
            train_files, regen = [str(assets.train_file)], False  # built already regenerated
        eval_files = eval_files or [str(assets.eval_file)]
    else:
        target_dir = Path(cfg.model.target)
        if not train_files:
            raise TrainError("data.train_files is empty; list jsonl conversation files (or use model.target: tiny)")
    if not (target_dir / "config.json").is_file():
        raise TrainError(
            f"model.target {str(target_dir)!r}: no HF model directory there (no config.json); "
            "point it at a local model directory (downloads are not done here) or use model.target: tiny"
        )
    return Sources(target_dir, train_files, eval_files, regen)


def load_eval_prompts(files: list[str], tokenizer: Any, kw: dict, report: SkipReport) -> list[list[int]]:
    """Held-out prompts: each record's messages up to (not including) its first assistant turn."""
    return read_prompts(files, tokenizer, kw, report, "check data.eval_files")


def target_dtype(device: torch.device) -> torch.dtype:
    """The target's dtype: float32 on CPU, bfloat16 on GPUs (features travel in it)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def load_target(cfg: TrainConfig, target_dir: Path, device: torch.device, whole: bool = True):
    """The frozen target on `device`: the whole model (TargetModel), or only the parts a drafter uses
    (TargetHead: config, embedding, LM head, final norm)."""
    from trainer.features import TargetHead, TargetModel

    cls = TargetModel if whole else TargetHead
    return cls.from_pretrained(
        target_dir,
        layer_ids=cfg.model.target_layer_ids,
        num_features=cfg.model.num_target_features,
        dtype=target_dtype(device),
        device=device,
    )


def build_samples(cfg: TrainConfig, src: Sources, target, tokenizer, out: Path, log: Callable[[str], None]) -> TokenStore:
    """Read and regenerate (if asked) the training conversations, open (or build) their token store under the
    datasets root, write <out>/data/skipped.json and point the run at the store (<out>/data/store.json, last:
    its appearance tells the other ranks the data is ready).

    Raises:
        DataError: a missing data file, or no usable sample.
    """
    for f in src.train_files:
        if not Path(f).is_file():
            raise DataError(f"{f}: no such data file (check data.train_files in the config)")
    data, kw = cfg.data, dict(cfg.data.chat_template_kwargs)
    report = SkipReport()
    files = list(src.train_files)
    (out / "data").mkdir(parents=True, exist_ok=True)
    if src.regenerate:
        files = [str(f) for f in regenerated_files(cfg, src.target_dir, src.train_files, datasets_root(out), report,
                                                   target=target, tokenizer=tokenizer, run_dir=out, log=log)]
    store, _ = build_store(files, tokenizer, datasets_root(out), max_len=data.max_len,
                           min_supervised=2, chat_template_kwargs=kw, log=log)
    report.merge(SkipReport.from_dict(store.skipped))
    write_json(out / "data" / "skipped.json", report.to_dict())
    write_pointer(out, store)
    log(f"data: {len(store)} samples, {store.num_tokens} tokens from {len(src.train_files)} file(s) in {store.path}; "
        f"{report.summary()}")
    return store


@dataclass
class Assets:
    """What one rank loaded.

    Attributes:
        target: the frozen target: TargetModel (whole) or TargetHead (a drafter rank's parts).
        tokenizer: the target's tokenizer.
        samples: every training sample, in the files' order (all ranks agree): the run's token store, memory
            mapped (indexing gives a Sample; `.lengths` is what plan_epoch packs).
        mask_token_id, pad_id, stop_ids: token ids the loop and evaluation need.
        eval_prompts: held-out prompts (main drafter rank only; else empty).
        target_dir: the target's HF directory.
    """

    target: Any
    tokenizer: Any
    samples: TokenStore
    mask_token_id: int
    pad_id: int
    stop_ids: list[int]
    target_dir: Path
    eval_prompts: list[list[int]] = field(default_factory=list)


def load_assets(
    cfg: TrainConfig,
    device: torch.device,
    *,
    builds_data: bool,
    wants_eval: bool,
    log: Callable[[str], None],
    whole_target: bool = True,
    share: Callable[[TokenStore | None, Path], TokenStore] | None = None,
) -> Assets:
    """Load what a rank needs (see the module docstring).

    Args:
        builds_data: this rank opens or builds the token store (the others wait for the run's pointer first).
        wants_eval: load the held-out prompts (the rank that measures τ).
        whole_target: the whole target (it computes features), else only the parts a drafter uses.
        share: a layout across nodes (whose run directories are not shared): every rank calls it with the run
            directory, the builder with its store, the others with None, and gets the store it trains on back
            (World.share_store: the files are sent to each other node, hash-checked).

    Raises:
        TrainError, DataError: the target or the data cannot be used (the message says what to fix).
    """
    from transformers import AutoTokenizer

    out = Path(cfg.output_dir)
    samples = None
    if not builds_data and share is None:
        samples = wait_for_store(out)
    elif not builds_data:
        samples = share(None, out)  # first, as the wait above: the builder has made the target by then
    seed_everything(cfg.seed)
    src = resolve_sources(cfg, log)
    tokenizer = AutoTokenizer.from_pretrained(str(src.target_dir))
    if builds_data and not whole_target:
        raise TrainError("the rank that builds the data needs the whole target (it regenerates the responses)")
    target = load_target(cfg, src.target_dir, device, whole_target)
    what = "" if whole_target else ": embedding, LM head and final norm only"
    log(f"target: {src.target_dir} ({target.num_layers} layers, H {target.hidden_size}, features from {target.layer_ids}){what}")
    if samples is not None:
        log(f"data: {len(samples)} samples, {samples.num_tokens} tokens, mapped from {samples.path}")
    elif (ptr := read_pointer(out)) is not None and Path(ptr["path"]).is_dir():
        # A resumed run sees the very same samples: regeneration is expensive.
        samples = open_store(ptr["path"], ptr["key"])
        log(f"data: {len(samples)} samples from {samples.path} (named by {out / POINTER})")
    else:
        samples = build_samples(cfg, src, target, tokenizer, out, log)
    if share is not None and builds_data:
        share(samples, out)
    prompts: list[list[int]] = []
    if wants_eval:
        report = SkipReport()
        prompts = load_eval_prompts(src.eval_files, tokenizer, dict(cfg.data.chat_template_kwargs), report)
        if report.total:
            log(f"eval data: {report.summary()}")
    mask_id = resolve_mask_token_id(cfg.model.mask_token_id, tokenizer, target.vocab_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return Assets(target, tokenizer, samples, mask_id, pad_id, stop_ids, src.target_dir, prompts)
