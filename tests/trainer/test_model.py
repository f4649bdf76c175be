"""The drafter: training forward == inference forward (docs/dflash.md §6), no leak past the anchor, layout, borrowing."""

from __future__ import annotations

import pytest
import torch

from tiny_targets import MASK_ID, build_target, small_model_config
from trainer.attention import dense_mask
from trainer.features import TargetModel, positions_from_docs
from trainer.model import DFlashDrafter
from trainer.objective import PackedBatch, block_inputs

BS = 4


def _drafter(target, seed=0, dtype="float32", **kw):
    torch.manual_seed(seed)
    return DFlashDrafter.from_target(small_model_config(**kw), target, MASK_ID, dtype).eval()


def _row(target, L=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK_ID, (1, L), generator=g)
    return ids, target.features(ids)


def _train_forward(drafter, ids, feats, anchors, doc=None, positions=None):
    R, L = ids.shape
    doc = torch.zeros_like(ids) if doc is None else doc
    positions = torch.arange(L).expand(R, L) if positions is None else positions
    keep = torch.ones_like(anchors, dtype=torch.bool)
    batch = PackedBatch(ids, torch.ones_like(ids), doc, positions, feats)
    noise, pos = block_inputs(batch, anchors, keep, BS, MASK_ID)
    with torch.no_grad():
        return drafter(noise, feats, pos, dense_mask(anchors, keep, doc, BS))


def _infer_block(drafter, ids, feats, anchor, cuts=()):
    """The spec-decoding path: context 0..anchor-1 enters the cache in pieces (split at ``cuts``, each
    piece with a throwaway block, as earlier decoding rounds do), then the block at ``anchor``."""
    edges = [0] + sorted(c for c in cuts if 0 < c < anchor) + [anchor]
    cache = drafter.new_cache()
    with torch.no_grad():
        for lo, hi in zip(edges[:-2], edges[1:-1]):
            drafter.draft_step(
                torch.full((1, BS), MASK_ID), feats[:, lo:hi], torch.arange(lo, hi)[None],
                torch.arange(hi, hi + BS)[None], cache,
            )
        lo = edges[-2]
        block = torch.full((1, BS), MASK_ID)
        block[0, 0] = ids[0, anchor]
        return drafter.draft_step(
            block, feats[:, lo:anchor], torch.arange(lo, anchor)[None], torch.arange(anchor, anchor + BS)[None], cache
        )


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_training_forward_equals_inference_forward(family, qwen3_target, llama_target):
    target = qwen3_target if family == "qwen3" else llama_target
    drafter = _drafter(target)
    ids, feats = _row(target)
    anchors = torch.tensor([[1, 7, 18, 30]])
    train_h = _train_forward(drafter, ids, feats, anchors).view(1, 4, BS, -1)
    for j, a in enumerate(anchors[0].tolist()):
        infer_h = _infer_block(drafter, ids, feats, a, cuts=(a // 3, a // 2))
        assert torch.allclose(train_h[:, j], infer_h, atol=1e-5), (j, (train_h[:, j] - infer_h).abs().max())


def test_perturbing_features_at_or_after_the_anchor_changes_nothing(qwen3_target):
    drafter = _drafter(qwen3_target)
    ids, feats = _row(qwen3_target)
    a = 17
    anchors = torch.tensor([[a]])
    base = _train_forward(drafter, ids, feats, anchors)
    leaked = feats.clone()
    leaked[:, a:] += 5 * torch.randn_like(leaked[:, a:])
    assert torch.equal(_train_forward(drafter, ids, leaked, anchors), base)
    # ... while the position just before the anchor is visible (the check above can fail).
    seen = feats.clone()
    seen[:, a - 1] += 5
    assert not torch.allclose(_train_forward(drafter, ids, seen, anchors), base, atol=1e-4)


def test_other_documents_are_invisible_in_packed_rows(qwen3_target):
    drafter = _drafter(qwen3_target)
    ids, feats = _row(qwen3_target)
    doc = torch.tensor([[0] * 15 + [1] * 25])
    positions = positions_from_docs(doc)
    anchors = torch.tensor([[25]])  # in doc 1
    base = _train_forward(drafter, ids, feats, anchors, doc, positions)
    other = feats.clone()
    other[:, :15] = torch.randn_like(other[:, :15])
    assert torch.equal(_train_forward(drafter, ids, other, anchors, doc, positions), base)
    # the block in doc 1 equals a block at doc-local position 10 of doc 1 alone (positions restart)
    alone = _infer_block(drafter, ids[:, 15:], feats[:, 15:], 10)
    assert torch.allclose(base, alone, atol=1e-5)


def test_state_dict_is_the_reference_layout_and_target_is_only_borrowed(qwen3_target):
    drafter = _drafter(qwen3_target, num_draft_layers=5)
    keys = set(drafter.state_dict())
    assert len(keys) == 58
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    per_layer = {
        f"layers.4.{n}.weight"
        for n in [
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "input_layernorm", "post_attention_layernorm",
        ]
    }
    assert per_layer <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert all(p.requires_grad for p in drafter.parameters())
    emb = qwen3_target.embed_tokens.weight
    assert all(p.data_ptr() != emb.data_ptr() for p in drafter.parameters())
    assert drafter.fc.weight.shape == (64, 3 * 64)
    # gradients reach the drafter, never the frozen target
    ids, feats = _row(qwen3_target)
    noise = torch.full((1, BS), MASK_ID)
    noise[0, 0] = ids[0, 5]
    pos = torch.cat([torch.arange(40), torch.arange(5, 5 + BS)])[None]
    mask = dense_mask(torch.tensor([[5]]), torch.tensor([[True]]), torch.zeros_like(ids), BS)
    drafter.logits(drafter(noise, feats, pos, mask)).sum().backward()
    assert drafter.fc.weight.grad is not None and emb.grad is None and qwen3_target.lm_head.weight.grad is None


def test_from_target_copies_rope_theta_and_sizes():
    target = build_target("qwen3", layers=6, rope_theta=123456.0)
    drafter = _drafter(target)
    assert drafter.cfg.rope_theta == 123456.0
    assert drafter.cfg.hidden_size == 64 and drafter.cfg.head_dim == 16
    assert drafter.cfg.num_key_value_heads == 2 and drafter.cfg.target_layer_ids == (1, 2, 3)
    assert drafter.cfg.num_target_layers == 6 and drafter.cfg.vocab_size == 256


def test_from_target_rejects_inconsistent_settings(qwen3_target):
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashDrafter.from_target(small_model_config(target_layer_ids=[0, 1]), qwen3_target, MASK_ID)
    with pytest.raises(ValueError, match="mask_token_id 999"):
        DFlashDrafter.from_target(small_model_config(), qwen3_target, 999)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        DFlashDrafter.from_target(small_model_config(num_key_value_heads=3), qwen3_target, MASK_ID)


def test_forward_names_a_feature_width_mismatch(qwen3_target):
    drafter = _drafter(qwen3_target)
    with pytest.raises(ValueError, match="expects 192"):
        drafter(torch.full((1, BS), MASK_ID), torch.zeros(1, 8, 64), torch.zeros(1, 8 + BS, dtype=torch.long))


def test_bfloat16_drafter_runs_against_a_float32_target(qwen3_target):
    drafter = _drafter(qwen3_target, dtype="bfloat16")
    assert drafter.fc.weight.dtype == torch.bfloat16
    ids, feats = _row(qwen3_target)
    h = _infer_block(drafter, ids, feats, 9)
    assert h.dtype == torch.bfloat16 and torch.isfinite(drafter.logits(h)).all()


# ------------------------------------------------------------------------------------------- features
def test_features_are_hidden_states_after_each_listed_layer(qwen3_target):
    ids = torch.randint(0, MASK_ID, (2, 10))
    with torch.no_grad():
        hs = qwen3_target.hf(input_ids=ids, output_hidden_states=True).hidden_states
    f = qwen3_target.features(ids)
    assert torch.equal(f, torch.cat([hs[2], hs[3], hs[4]], dim=-1))


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_packed_features_equal_per_document_features(family, qwen3_target, llama_target):
    target = qwen3_target if family == "qwen3" else llama_target
    a = torch.randint(0, MASK_ID, (1, 9))
    b = torch.randint(0, MASK_ID, (1, 6))
    packed = torch.cat([a, b, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    doc = torch.tensor([[0] * 9 + [1] * 6 + [-1] * 3])
    f = target.features(packed, doc_ids=doc)
    assert torch.allclose(f[:, :9], target.features(a), atol=1e-5)
    assert torch.allclose(f[:, 9:15], target.features(b), atol=1e-5)


def test_positions_restart_per_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [2, 2, 2, 2, 2, 2, 2]])
    assert positions_from_docs(doc).tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]]


def test_target_rejects_out_of_range_layer_ids():
    from tiny_targets import build_hf_target

    with pytest.raises(ValueError, match=r"out of range.*4 layers"):
        TargetModel(build_hf_target("llama", layers=4), [0, 4])
