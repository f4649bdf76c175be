"""The `tiny` experiment's assets: a random-weight target, a locally trained tokenizer, prompts, data.

Nothing is downloaded. From a `TinyTargetConfig` (and nothing else) this builds, deterministically:

- a word-level tokenizer trained here with `tokenizers` on a generated corpus, wrapped as a
  `PreTrainedTokenizerFast` with a ChatML-like chat template and a `<|mask|>` token (the drafter's MASK);
  word-level so that decoding greedy output and re-templating it gives back the very same tokens;
- a Qwen3 (or Llama) causal LM with random weights, saved as an HF model directory so training loads it
  through the real `from_pretrained` path;
- a generated prompt set, split into training and held-out prompts;
- training conversations whose responses are the target's own greedy output (`data.regenerate`).

The result is cached under `<cache>/tiny-<hash of the config>/` (written to a temp dir, then renamed),
so a rerun with the same config starts training at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from trainer.config import TinyTargetConfig

# Bump when the build procedure changes, so old caches are not reused.
_BUILD_VERSION = 4

SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SYLLABLES = ["ka", "to", "mi", "ra", "ne", "su", "lo", "vi", "de", "po", "ga", "fe", "bu", "zi", "ho", "ly"]
_INSTRUCTIONS = ["continue", "repeat", "answer", "describe", "count", "explain", "list", "sort"]


@dataclass(frozen=True)
class TinyAssets:
    """Paths of a built tiny experiment.

    Attributes:
        target_dir: HF model directory (config.json, model.safetensors, tokenizer files).
        train_file: jsonl of conversations (OpenAI `messages`) with regenerated responses.
        eval_file: jsonl of held-out prompts (`messages` with the user turn only).
    """

    target_dir: Path
    train_file: Path
    eval_file: Path


def default_cache_root() -> Path:
    """$DFLASH_TINY_CACHE, else $XDG_CACHE_HOME/dflashctl/tiny, else ~/.cache/dflashctl/tiny."""
    env = os.environ.get("DFLASH_TINY_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflashctl" / "tiny"


def config_hash(cfg: TinyTargetConfig) -> str:
    """Stable short hash of everything that determines the built assets."""
    import transformers

    key = json.dumps(
        {"v": _BUILD_VERSION, "cfg": cfg.model_dump(mode="json"), "transformers": transformers.__version__},
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _words(cfg: TinyTargetConfig) -> list[str]:
    """The word list: two- and three-syllable words, digits and roles; sized to fit the vocabulary."""
    rng = random.Random(cfg.seed)
    budget = cfg.vocab_size - len(SPECIAL_TOKENS) - 16  # room for roles, digits, punctuation
    words = sorted({"".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3)))) for _ in range(budget * 3)})
    rng.shuffle(words)
    return words[: max(8, budget - len(_INSTRUCTIONS))]


def generate_prompts(cfg: TinyTargetConfig) -> list[str]:
    """`cfg.num_prompts` user prompts, deterministic from `cfg.seed` (last `held_out` are held out)."""
    rng = random.Random(cfg.seed + 1)
    words = _words(cfg)
    prompts = []
    for _ in range(cfg.num_prompts):
        body = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))
        prompts.append(f"{rng.choice(_INSTRUCTIONS)} : {body} .")
    return prompts


def build_tokenizer(cfg: TinyTargetConfig):
    """A word-level tokenizer trained on a generated corpus, as a PreTrainedTokenizerFast.

    Returns:
        The tokenizer; `mask_token` is `<|mask|>`, eos `<|im_end|>`, pad `<|pad|>`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(cfg.seed + 2)
    words = _words(cfg)
    corpus = [" ".join(["system", "user", "assistant", ":", ".", ","] + _INSTRUCTIONS + [str(d) for d in range(10)])]
    corpus += [" ".join(rng.choice(words) for _ in range(32)) for _ in range(400)]
    corpus += [" ".join(words)]  # every word at least once, so none is cut by frequency
    tok = Tokenizer(models.WordLevel(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    trainer = trainers.WordLevelTrainer(vocab_size=cfg.vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=1)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_target_model(cfg: TinyTargetConfig, tokenizer):
    """The random-weight causal LM (seeded), eos/pad ids from the tokenizer."""
    torch.manual_seed(cfg.seed)
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=4096,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if cfg.family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common))
    # Random init gives near-uniform next-token logits (|logit| ~ 1). Scaling the head keeps every argmax
    # (so the greedy data is unchanged) but gives the drafter, which borrows this head, room to be confident
    # and the greedy choice a margin that numerical noise between code paths cannot flip.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def build_tiny(
    cfg: TinyTargetConfig, cache_root: str | Path | None = None, log: Callable[[str], None] = print
) -> TinyAssets:
    """Build (or reuse from the cache) the tiny target, tokenizer, prompts and regenerated data.

    Args:
        cfg: the tiny target's config.
        cache_root: where built assets live (default: `default_cache_root()`).
        log: one call per human progress line.

    Returns:
        The asset paths.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    final = root / f"tiny-{config_hash(cfg)}"
    assets = TinyAssets(final / "target", final / "train.jsonl", final / "eval.jsonl")
    if (final / "COMPLETE").exists():
        log(f"tiny target: cached at {final}")
        return assets
    root.mkdir(parents=True, exist_ok=True)
    # One builder at a time (the drafter ranks of a node without the data builder all need it at once); a
    # builder that waited finds it complete. flock ends with its process: a killed builder blocks nobody.
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "COMPLETE").exists():
            log(f"tiny target: cached at {final} (built by another process meanwhile)")
            return assets
        _build_tiny(cfg, root, final, log)
    return assets


def _build_tiny(cfg: TinyTargetConfig, root: Path, final: Path, log: Callable[[str], None]) -> None:
    """Build the tiny assets into a temporary directory, then rename it to `final` (build_tiny holds the lock)."""
    from trainer.data import Conversation
    from trainer.engines import regenerate

    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        log(f"tiny target: building {cfg.family} h{cfg.hidden_size} x{cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}")
        tokenizer = build_tokenizer(cfg)
        model = build_target_model(cfg, tokenizer)
        # transformers writes a model only on global rank 0 once torch.distributed is initialised; the tiny
        # assets are this process's own (a node whose ranks are all > 0 builds them too): always write.
        model.should_save_on_this_rank = lambda is_main_process: True
        model.save_pretrained(tmp / "target")
        tokenizer.save_pretrained(tmp / "target")
        prompts = generate_prompts(cfg)
        train_prompts, eval_prompts = prompts[: -cfg.held_out], prompts[-cfg.held_out :]
        convs = [
            Conversation([{"role": "user", "content": p}, {"role": "assistant", "content": "-"}], f"prompt:{i}")
            for i, p in enumerate(train_prompts)
        ]
        log(f"tiny target: regenerating {len(convs)} responses ({cfg.response_tokens} tokens max, greedy)")
        # Big batches: on CPU a tiny model's generate is per-step overhead, not FLOPs (256 prompts: 41 s
        # at batch 32, 6.5 s at 256).
        convs = regenerate(model, tokenizer, convs, cfg.response_tokens, batch_size=512)
        _write_jsonl(tmp / "train.jsonl", [{"messages": c.messages} for c in convs])
        _write_jsonl(tmp / "eval.jsonl", [{"messages": [{"role": "user", "content": p}]} for p in eval_prompts])
        (tmp / "tiny_config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
        (tmp / "COMPLETE").write_text("ok\n")
        if final.exists():  # a stale incomplete dir (a builder killed before it could rename): replace it
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


TINY_EVALUATION = {"budgets": [16], "temperatures": [0.0]}
"""What the tiny run measures before and after training and on its export: the greedy chain and DDTree at
B=16. Every mode of the default grid (4 budgets x 3 temperatures + chains) took most of the run's minutes on
two CPU cores; `python -m trainer eval` on the export measures the whole grid (`full_eval_command`)."""


def tiny_train_config(output_dir: str | Path, **overrides):
    """The `tiny` experiment: sizes chosen so a run finishes in about a minute on two CPU cores.

    Target: the default TinyTargetConfig but with 1024 prompts (16 held out): with fewer, the drafter
    memorises the training responses instead of learning the target (train-set simulated τ 3.9 vs
    held-out 2.7 at 96 prompts). Drafter: block 8 (γ 4), 2 layers, 3 target features of the 6-layer
    target, rows of 144 tokens (two ~70-token conversations each: 92% full, where 128 left rows ~60% full),
    8 rows and 32 anchors per row per step, 500 steps at lr 1e-3 (the
    paper's 6e-4 is for ~1M-sample runs; 500 steps need a larger step). τ is measured in the modes of
    TINY_EVALUATION only, so a newcomer sees the whole loop in about a minute.

    Args:
        output_dir: the run directory.
        overrides: top-level TrainConfig fields to replace (e.g. max_steps=20 in tests).

    Returns:
        A validated TrainConfig.
    """
    from trainer.config import parse_config

    raw = {
        "model": {
            "target": "tiny",
            "tiny_target": {"num_prompts": 1024, "held_out": 16},
            "block_size": 8,
            "num_draft_layers": 2,
            "num_target_features": 3,
            "attention_backend": "auto",
        },
        "data": {"max_len": 144, "token_budget": 1152, "max_batch_size": 8, "num_anchors": 32},
        "evaluation": dict(TINY_EVALUATION),
        "optim": {"lr": 1e-3},
        "epochs": 100,
        "max_steps": 500,
        "seed": 0,
        "output_dir": str(output_dir),
        "log_every": 25,
        "save_every": 100,
        "keep_checkpoints": 2,
    }
    raw.update(overrides)
    return parse_config(raw, source="tiny experiment")


def evaluate_tiny_export(cfg, export_dir: str | Path, log: Callable[[str], None] = print):
    """τ of a tiny run's export (the bf16 file) against the tiny target, on its held-out prompts.

    Every mode of ``cfg.evaluation`` (chain, DDTree budgets, temperatures), N = the response length the
    target was regenerated with. The report is also written to ``<run>/export_eval.json``.

    Args:
        cfg: the tiny run's TrainConfig.
        export_dir: its export directory.
        log: one call per human progress line.

    Returns:
        The `trainer.evaluate.EvalReport`.
    """
    from trainer.export_eval import evaluate_export

    assets = build_tiny(cfg.model.tiny_target, log=log)
    report = evaluate_export(
        export_dir, assets.target_dir, [str(assets.eval_file)], cfg.evaluation,
        max_new_tokens=cfg.model.tiny_target.response_tokens,
    )
    report.save(Path(cfg.output_dir) / "export_eval.json")
    return report


def full_eval_command(cfg, export_dir: str | Path) -> str:
    """The shell command that measures every mode of the default grid (chain and B=16/32/64/128 at T=0, 0.7
    and 1) on a tiny run's export, against its target and held-out prompts: printed after a tiny run."""
    import shlex
    import sys

    assets = build_tiny(cfg.model.tiny_target, log=lambda _: None)  # cached: only finds the paths
    return shlex.join([
        sys.executable, "-m", "trainer", "eval", "--export", str(export_dir), "--target", str(assets.target_dir),
        "--prompts", str(assets.eval_file), "--max-new-tokens", str(cfg.model.tiny_target.response_tokens),
    ])
