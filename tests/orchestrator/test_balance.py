"""Which side of a split layout waits and the GPU split the measured rates suggest, with the arithmetic."""

from __future__ import annotations

import pytest

from orchestrator.balance import from_records, suggest
from orchestrator.ops.metrics import run_notes


def test_a_slow_target_side_makes_the_drafters_wait_and_more_target_gpus_are_suggested():
    # 5 target ranks computing 2,000 tokens/s each, 3 drafter ranks training 6,000 each: min(10000, 18000).
    b = suggest(5, 3, target_tokens_per_s=10_000, drafter_tokens_per_s=18_000)
    assert (b.target_per_gpu, b.drafter_per_gpu) == (2000, 6000)
    assert b.waiting == "drafters"
    assert b.now_tokens_per_s == 10_000
    # k targets: min(2000 k, 6000 (8 - k)) is largest at k = 6: min(12000, 12000)
    assert (b.suggested_targets, b.suggested_drafters, b.suggested_tokens_per_s) == (6, 2, 12_000)
    text = "\n".join(b.lines())
    assert "min(5 x 2000, 3 x 6000) = 10000 tokens/s" in text
    assert "suggested 6 target + 2 drafter: min(6 x 2000, 2 x 6000) = 12000 tokens/s (1.20x)" in text


def test_a_slow_drafter_side_and_a_split_that_is_already_best():
    b = suggest(1, 7, target_tokens_per_s=50_000, drafter_tokens_per_s=14_000)
    assert b.waiting == "targets" and (b.suggested_targets, b.suggested_drafters) == (1, 7)
    assert "already the best" in "\n".join(b.lines())
    assert suggest(2, 2, 1000, 1050).waiting == "neither"


def test_equal_rates_keep_an_even_split_and_bad_input_is_refused():
    b = suggest(2, 2, target_tokens_per_s=2000, drafter_tokens_per_s=2000)  # 1000 per GPU on both sides
    assert (b.suggested_targets, b.suggested_drafters) == (2, 2)
    with pytest.raises(ValueError, match="both sides"):
        suggest(0, 3, 1, 1)
    with pytest.raises(ValueError, match="positive"):
        suggest(1, 1, 0, 1)


def test_from_records_takes_medians_of_the_last_training_records_and_skips_colocated_runs():
    rows = [{"kind": "train", "target_tokens_per_s": t, "drafter_tokens_per_s": 6000.0}
            for t in (100.0, 3000.0, 3100.0, 2900.0)]
    b = from_records(rows, targets=1, drafters=1, last=3)
    assert b.target_per_gpu == 3000.0  # median of the last three; the warm-up's 100 left out
    assert from_records(rows, targets=1, drafters=0) is None
    assert from_records([{"kind": "eval", "tau": 2.0}], 1, 1) is None


def test_metrics_notes_carry_the_balance_from_the_facts_record_and_vllms_verdict():
    rows = [{"kind": "facts", "target_ranks": 2, "drafter_ranks": 1},
            {"kind": "train", "step": 25, "target_tokens_per_s": 4000.0, "drafter_tokens_per_s": 12000.0},
            {"kind": "eval_vllm", "tau_own": 2.371, "tau_vllm": 2.363, "tau_vllm_pooled": 2.155, "lossless": True,
             "tokens_per_s_plain": 45.3, "tokens_per_s_spec": 22.4, "speedup": 0.49}]
    notes = run_notes(rows)
    assert notes[0] == "balance: the drafter ranks wait for features (the target side is the bottleneck)"
    assert "  now 2 target + 1 drafter: min(2 x 2000, 1 x 12000) = 4000 tokens/s" in notes
    assert "  this split is already the best of the node's GPUs" in notes
    assert notes[-1] == ("vLLM: τ 2.363 per-prompt mean (2.155 pooled) against the project's 2.371; lossless yes; "
                         "45.3 -> 22.4 tokens/s (0.49x)")
    assert run_notes([{"kind": "facts", "target_ranks": 1, "drafter_ranks": 0}, rows[1]]) == []


def test_a_colocated_run_is_told_its_feature_share_and_what_two_devices_would_give():
    rows = [{"kind": "facts", "target_ranks": 0, "drafter_ranks": 0},
            {"kind": "train", "step": 25, "target_tokens_per_s": 3000.0, "drafter_tokens_per_s": 1000.0}]
    notes = run_notes(rows)
    # one process: 1 / (1/3000 + 1/1000) = 750 tokens/s, a quarter of each step on features; split: min = 1000
    assert notes == [
        "balance: colocated (one process computes the features, then trains): features 3000 tokens/s, "
        "training 1000 tokens/s; 25% of a step computes features",
        "  now 1 / (1/3000 + 1/1000) = 750 tokens/s; split over two devices, 1 target + 1 drafter: "
        "min(3000, 1000) = 1000 tokens/s (1.33x)",
    ]
