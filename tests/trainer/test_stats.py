"""StepStats packs itself for all_reduce: a sum over ranks of packed windows is the window of the sums."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.stats import MEM_KEYS, StepStats


def _res(loss: float, k: float) -> SimpleNamespace:
    """What dflash_loss returns, as far as StepStats reads it (block size 4: slots 1..3)."""
    return SimpleNamespace(loss=torch.tensor(loss), n_tokens=torch.tensor(10 * k), accept_sum=torch.tensor(3 * k),
                           n_blocks=torch.tensor(2 * k), slot_correct=torch.tensor([k, 2 * k, 0.0]),
                           slot_count=torch.tensor([4 * k, 4 * k, 4.0]))


def _window(rank: int) -> StepStats:
    s = StepStats(block_size=4, num_targets=2, world_size=4)
    s.add_batch(_res(1.0 + rank, 1.0 + rank), tokens=100, source=rank % 2, target_s=0.5)
    s.drafter_s, s.wait_s = 2.0, 0.25
    s.set_memory(2 + rank, {"alloc_mb": 10.0 * (rank + 1), "peak_mb": 20.0, "rss_mb": 30.0, "peak_rss_mb": 40.0})
    s.set_memory(0, {"alloc_mb": 5.0 + rank, "peak_mb": 6.0, "rss_mb": 7.0, "peak_rss_mb": 8.0})  # a target's row
    return s


def test_pack_then_unpack_is_the_identity():
    s = _window(0)
    for op in ("sum", "max"):
        back = s.unpack(op, s.pack(op))
        assert back.pack(op).tolist() == s.pack(op).tolist()
    assert s.pack("max").numel() == 4 * len(MEM_KEYS)
    with pytest.raises(ValueError, match="packed stats have 3 values"):
        s.unpack("max", torch.zeros(3))


def test_summed_packs_unpack_to_field_wise_sums_and_memory_maxima():
    a, b = _window(0), _window(1)
    tot = a.unpack("sum", a.pack("sum") + b.pack("sum")).unpack("max", torch.maximum(a.pack("max"), b.pack("max")))
    assert tot.loss_sum == 3.0 and tot.batches == 2 and tot.tokens == 200
    assert tot.slot_correct.tolist() == [3.0, 6.0, 0.0] and tot.slot_count.tolist() == [12.0, 12.0, 8.0]
    assert tot.target_s.tolist() == [0.5, 0.5] and tot.target_tokens.tolist() == [100.0, 100.0]
    assert tot.memory[2].tolist() == [10.0, 20.0, 30.0, 40.0] and tot.memory[3, 0] == 20.0
    assert tot.memory[0].tolist() == [6.0, 6.0, 7.0, 8.0]  # the newest snapshot of a target wins
    rec = tot.record(wall_s=2.0, drafter_procs=2)
    assert rec["loss"] == 1.5 and rec["tokens_per_s"] == 100.0 and rec["drafter_tokens_per_s"] == 100.0
    assert rec["sim_tau"] == pytest.approx(9.0 / 6.0) and rec["acc_per_slot"] == [0.25, 0.5, 0.0]
    assert rec["target_tokens_per_s"] == 400.0 and rec["feature_wait_s"] == 0.25
    assert _window(0).reduced(None) is not None and tot.fresh().pack("sum").abs().sum() == 0
