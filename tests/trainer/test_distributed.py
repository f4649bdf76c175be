"""The distributed pieces: rank environment, per-rank process environment, the fixed-shape feature
protocol over a real gloo world of two processes, and how a failed rank is described."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.distributed import DistributedError, FeatureSpec, pack_batch, rank_env_vars, read_rank_env
from trainer.launch import RankFailure, free_port, rank_environment
from trainer.layout import Layout
from trainer.objective import PackedBatch

REPO = Path(__file__).resolve().parents[2]


def test_rank_env_round_trip_and_errors():
    env = read_rank_env(rank_env_vars(2, 3, 29500))
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (2, 3, "127.0.0.1", 29500)
    with pytest.raises(DistributedError, match=r"RANK, MASTER_PORT not set.*python -m trainer.launch"):
        read_rank_env({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    with pytest.raises(DistributedError, match="RANK 3 outside WORLD_SIZE 3"):
        read_rank_env(rank_env_vars(3, 3, 1))
    with pytest.raises(DistributedError, match="must be integers"):
        read_rank_env({**rank_env_vars(0, 2, 1), "WORLD_SIZE": "two"})


def test_rank_environment_one_gpu_each_and_cpu_threads_split():
    gpu = Layout(target_gpus=(0, 1, 2, 3, 4), drafter_gpus=(5, 6, 7))
    e = rank_environment(gpu, 6, 1234, {"PATH": "/bin"})
    assert e["CUDA_VISIBLE_DEVICES"] == "6" and e["RANK"] == "6" and e["WORLD_SIZE"] == "8"
    assert e["MASTER_PORT"] == "1234" and e["PATH"] == "/bin" and "OMP_NUM_THREADS" not in e
    cpu = Layout(num_target_procs=1, num_drafter_procs=2)
    e = rank_environment(cpu, 0, 1, {})
    assert e["CUDA_VISIBLE_DEVICES"] == "" and int(e["OMP_NUM_THREADS"]) >= 1
    assert rank_environment(cpu, 0, 1, {"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"


def test_rank_failure_descriptions():
    assert RankFailure(2, "drafter", -9).describe() == "rank 2 (drafter) was killed by SIGKILL"
    assert RankFailure(2, "drafter", -9).exit_code == 1
    assert RankFailure(0, "target", 2).describe() == "rank 0 (target) exited with code 2"
    assert RankFailure(0, "target", 2).exit_code == 2


def _batch(R=2, L=8, F=6, seed=0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (R, L), generator=g)
    return PackedBatch(ids, (ids % 2), torch.zeros(R, L, dtype=torch.long), torch.arange(L).expand(R, L).clone(),
                       torch.randn(R, L, F, generator=g))


def test_pack_batch_refuses_a_batch_of_another_shape():
    spec = FeatureSpec(2, 8, 6, torch.float32, torch.device("cpu"))
    ids, feats, stats = pack_batch(_batch(), torch.zeros(6), spec)
    assert ids.shape == (4, 2, 8) and feats.shape == (2, 8, 6) and stats.dtype == torch.float64
    with pytest.raises(ValueError, match=r"does not match the fixed shape \(2, 8, 6\).*pad every batch"):
        pack_batch(_batch(R=1), torch.zeros(6), spec)


_PEER = r"""
import sys, torch
from trainer.distributed import FeatureSpec, PendingBatch, init_groups, read_rank_env, send_batch
from trainer.layout import Layout
sys.path.insert(0, sys.argv[1])
from test_distributed import _batch
env = read_rank_env()
groups = init_groups(Layout(num_target_procs=1, num_drafter_procs=1), env, 30)
spec = FeatureSpec(2, 8, 6, torch.bfloat16, torch.device("cpu"))
if env.rank == 0:
    works = [send_batch(_batch(seed=s), torch.full((6,), float(s), dtype=torch.float64), 1, spec) for s in range(3)]
    for w in works:
        for work, _ in w:
            work.wait()
else:
    pending = [PendingBatch(0, spec) for _ in range(3)]  # posted ahead, like a drafter's prefetch
    for s, p in enumerate(pending):
        got, stats = p.wait()
        want = _batch(seed=s)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.position_ids, want.position_ids)
        assert torch.equal(got.loss_mask, want.loss_mask) and torch.equal(got.doc_ids, want.doc_ids)
        assert torch.equal(got.target_hidden, want.target_hidden.to(torch.bfloat16))
        assert stats.tolist() == [float(s)] * 6
    print("received 3 batches in order")
"""


def test_feature_messages_arrive_in_order_over_gloo():
    port = free_port()
    layout = Layout(num_target_procs=1, num_drafter_procs=1)
    procs = []
    for rank in range(2):
        env = rank_environment(layout, rank, port, dict(os.environ, PYTHONPATH=str(REPO)))
        procs.append(subprocess.Popen([sys.executable, "-c", _PEER, str(Path(__file__).parent)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "received 3 batches in order" in outs[1]


def test_plan_steps_are_the_same_for_every_rank_and_batches_are_padded():
    from trainer.config import parse_config
    from trainer.data import DataError
    from trainer.rank_loop import anchor_generator, make_plan, padded_rows

    cfg = parse_config({"epochs": 2, "data": {"max_len": 64, "token_budget": 256, "max_batch_size": 4}})
    lengths = [40] * 10  # one per row, 4 rows per batch: 3 batches per epoch, 6 in all
    a, b = make_plan(cfg, lengths, 2), make_plan(cfg, lengths, 2)
    assert a == b and len(a.batches) == 6 and a.steps == 3
    assert make_plan(cfg.model_copy(update={"max_steps": 2}), lengths, 2).steps == 2
    assert make_plan(cfg, lengths, 4).steps == 1  # the remainder is dropped, never half a step
    with pytest.raises(DataError, match="not one step"):
        make_plan(cfg, lengths, 7)
    assert padded_rows([[1], [2]], 4) == [[1], [2], [], []]
    assert torch.equal(torch.rand(3, generator=anchor_generator(0, 5)), torch.rand(3, generator=anchor_generator(0, 5)))
    assert not torch.equal(torch.rand(3, generator=anchor_generator(0, 5)), torch.rand(3, generator=anchor_generator(0, 6)))
