"""vLLM's verdict on an export, as pure arithmetic over what the engines returned: τ counted per prompt and
pooled, the lossless check, tokens/s, and the disagreement that names prompts; and which head sizes vLLM's
attention serves."""

from __future__ import annotations

import pytest

from trainer.vllm_eval import EngineError, check_servable, compare, judge, servable_head_dim


def _vllm(acceptance, spec=None, plain=None):
    n = len(acceptance)
    spec = spec or [[1, 2, 3]] * n
    return {"acceptance": acceptance, "spec": spec, "plain": plain or [list(s) for s in spec],
            "wall_spec": 1.0, "wall_plain": 2.0, "k": 7}


def test_tau_is_counted_per_prompt_and_pooled_and_the_speedup_from_the_walls():
    # prompt 0: 2 rounds, 4 drafts accepted (3.0); prompt 1: 8 rounds, 0 accepted (1.0)
    r = compare(_vllm([(3.0, 2, 4), (1.0, 8, 0)]), [3.0, 1.1])
    assert r.tau_vllm == 2.0
    assert r.tau_vllm_pooled == pytest.approx(1 + 4 / 10)
    assert r.tau_own == pytest.approx(2.05)
    assert (r.tokens_per_s_spec, r.tokens_per_s_plain, r.speedup) == (6.0, 3.0, 2.0)
    assert r.lossless and r.disagreeing == []
    judge(r, "EXPORT")  # nothing to say


def test_a_prompt_beyond_the_tolerance_is_named_with_both_numbers_and_the_usual_causes():
    r = compare(_vllm([(3.0, 2, 4), (1.0, 8, 0), (2.0, 4, 4)]), [3.1, 2.6, 2.0], tolerance=0.25)
    assert r.disagreeing == [1]
    with pytest.raises(EngineError) as err:
        judge(r, "/x/export")
    text = str(err.value)
    assert "on 1 of 3 prompts (prompt 1: vLLM 1.00 vs project 2.60)" in text
    assert "a tensor missing from /x/export/model.safetensors" in text and "target_layer_ids" in text


def test_a_speculative_output_that_differs_from_plain_decoding_is_not_lossless():
    r = compare(_vllm([(2.0, 1, 1), (2.0, 1, 1)], spec=[[1, 2], [5, 6]], plain=[[1, 2], [5, 7]]), [2.0, 2.0])
    assert not r.lossless and r.mismatched_outputs == [1]
    with pytest.raises(EngineError, match=r"differs from plain decoding on prompts \[1\]"):
        judge(r, "E")


@pytest.mark.parametrize("head_dim, device, ok", [(16, "cpu", False), (32, "cpu", True), (64, "cpu", True),
                                                  (48, "cpu", False), (16, "cuda", True), (20, "cuda", False),
                                                  (512, "cuda", False)])
def test_the_head_sizes_vllms_attention_serves(head_dim, device, ok):
    assert (servable_head_dim(head_dim, device) is None) == ok


def test_a_target_and_drafter_vllm_cannot_serve_are_explained():
    target = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512}  # head_dim 16 from the sizes
    reasons = check_servable(target, {"hidden_size": 64, "vocab_size": 500}, "cpu")
    assert reasons[0].startswith("the target's head_dim 16: vLLM's CPU attention serves head_dim in [32, 64")
    assert reasons[1] == ("vocab_size: the drafter has 500, the target 512 (vLLM shares the target's embedding "
                          "and LM head)")
    assert check_servable({**target, "head_dim": 32}, {"hidden_size": 64, "vocab_size": 512}, "cpu") == []
