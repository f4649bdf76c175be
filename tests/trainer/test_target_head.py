"""TargetHead: a drafter rank reads only the target's embedding, LM head and final norm from its safetensors
files (sharded or single, tied or not), and a drafter built on it trains exactly as on the whole target."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_targets import build_hf_target, small_model_config
from trainer.features import TargetHead, TargetModel
from trainer.model import DFlashDrafter
from trainer.objective import PackedBatch, dflash_loss


def _save(tmp_path, *, tied: bool = False, shard: str | None = None):
    model = build_hf_target("qwen3", layers=4)
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    out = tmp_path / ("tied" if tied else "untied")
    model.save_pretrained(out, max_shard_size=shard) if shard else model.save_pretrained(out)
    return model, out


def test_a_sharded_target_is_read_only_where_the_head_tensors_are(tmp_path):
    model, path = _save(tmp_path, shard="60KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    head_files = {weight_map[n] for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    others = sorted(set(weight_map.values()) - head_files)
    assert others, "the test needs shards that hold no head tensor"
    for f in others:  # garbage: reading any of these would fail
        (path / f).write_bytes(b"\0" * 64)

    head = TargetHead.from_pretrained(path, layer_ids=[1, 2], dtype=torch.float32)
    assert torch.equal(head.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert torch.equal(head.final_norm_weight, model.model.norm.weight)
    assert sorted(n for n, _ in head.named_parameters()) == ["embed_tokens.weight", "final_norm_weight", "lm_head.weight"]
    assert (head.vocab_size, head.hidden_size, head.feature_size, head.num_layers) == (256, 64, 128, 4)
    assert head.rope_theta == 10000.0 and head.dtype == torch.float32 and head.layer_ids == [1, 2]
    with pytest.raises(Exception):
        TargetModel.from_pretrained(path, layer_ids=[1, 2], dtype=torch.float32)  # the whole model reads them all


def test_tied_embeddings_share_one_tensor_and_need_no_lm_head_in_the_file(tmp_path):
    from safetensors import safe_open

    model, path = _save(tmp_path, tied=True)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    head = TargetHead.from_pretrained(path, layer_ids=[1], dtype=torch.float32)
    assert head.lm_head.weight.data_ptr() == head.embed_tokens.weight.data_ptr()
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)


def test_missing_weights_are_named(tmp_path):
    _, path = _save(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no model.safetensors\(.index.json\).*save_pretrained"):
        TargetHead.from_pretrained(path, layer_ids=[1])
    with pytest.raises(ValueError, match="no config.json"):
        TargetHead.from_pretrained(tmp_path / "nowhere", layer_ids=[1])


def test_a_drafter_on_the_head_trains_exactly_as_on_the_whole_target(tmp_path):
    _, path = _save(tmp_path)
    whole = TargetModel.from_pretrained(path, layer_ids=[1, 2], dtype=torch.float32)
    head = TargetHead.from_pretrained(path, layer_ids=[1, 2], dtype=torch.float32)
    cfg = small_model_config()
    drafters = []
    for target in (whole, head):
        torch.manual_seed(0)
        drafters.append(DFlashDrafter.from_target(cfg, target, mask_token_id=255))
    assert drafters[0].cfg == drafters[1].cfg
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = PackedBatch(ids, torch.ones_like(ids), torch.zeros_like(ids), torch.arange(32).expand(2, 32).clone(),
                        whole.features(ids))
    losses = []
    for d in drafters:
        res = dflash_loss(d, batch, num_anchors=4, gamma=4.0, generator=torch.Generator().manual_seed(2))
        res.loss.backward()
        losses.append((res.loss.item(), d.fc.weight.grad.clone()))
    assert losses[0][0] == losses[1][0] and torch.equal(losses[0][1], losses[1][1])
