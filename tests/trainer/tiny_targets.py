"""Tiny random-weight HF targets (Qwen3 and Llama) built from configs, and a drafter geometry for tests: no
downloads, CPU, milliseconds. A plain module (tests/trainer/conftest.py's fixtures use it), so a test imports it
by a name no other directory's conftest shares."""

from __future__ import annotations

import torch

from trainer.config import ModelConfig
from trainer.features import TargetModel

VOCAB = 256
MASK_ID = VOCAB - 1  # a row of the embedding that normal text never uses


def build_hf_target(family: str = "qwen3", *, layers: int = 6, seed: int = 0, vocab: int = VOCAB, rope_theta=10000.0):
    """A random-weight causal LM (hidden 64, GQA 4/2 heads) in eval mode, float32, on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_theta=rope_theta,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(family)
    # Random init gives near-uniform next-token distributions; sharper weights make greedy decoding
    # less tie-prone, so numerical noise cannot flip an argmax between two code paths.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def build_target(family: str = "qwen3", *, layers: int = 6, layer_ids=(1, 2, 3), seed: int = 0, **kw) -> TargetModel:
    return TargetModel(build_hf_target(family, layers=layers, seed=seed, **kw), list(layer_ids))


def small_model_config(**overrides) -> ModelConfig:
    """Drafter geometry for tests: 2 layers, block 4, SDPA (float32: DFlashDrafter.from_target's default)."""
    base = dict(block_size=4, num_draft_layers=2, attention_backend="sdpa")
    base.update(overrides)
    return ModelConfig(**base)
