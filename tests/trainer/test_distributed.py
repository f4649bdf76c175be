"""The distributed pieces: rank environment, per-rank process environment, the fixed-shape feature
protocol (its framing, and over a real gloo world of two processes), and how a failed rank is described."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.distributed import DistributedError, PeerLostError, RankEnv, read_rank_env, select_device, talking_to
from trainer.feature_wire import REPORT_LEN, BatchReport, FeatureSpec, encode
from trainer.layout import Layout
from trainer.objective import PackedBatch

REPO = Path(__file__).resolve().parents[2]


def test_rank_env_is_read_from_the_launchers_variables():
    env = read_rank_env({"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "DFLASH_NODE": "1", "GROUP_RANK": "0"})
    assert env == RankEnv(rank=2, world_size=3, local_rank=1, node=1)  # the layout's node, not torch's GROUP_RANK
    assert read_rank_env({"RANK": "1", "WORLD_SIZE": "2"}) == RankEnv(1, 2, 1, 0)
    with pytest.raises(DistributedError, match=r"RANK not set.*python -m trainer.launch"):
        read_rank_env({"WORLD_SIZE": "2"})
    with pytest.raises(DistributedError, match="RANK 3 outside WORLD_SIZE 3"):
        read_rank_env({"RANK": "3", "WORLD_SIZE": "3"})
    with pytest.raises(DistributedError, match="must be integers"):
        read_rank_env({"RANK": "0", "WORLD_SIZE": "two"})


def test_each_rank_gets_its_gpu_from_the_layout_and_cpu_ranks_none():
    env: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    cpu = Layout(num_target_procs=1, num_drafter_procs=2)
    assert select_device(cpu, 2, env) == torch.device("cpu") and env["CUDA_VISIBLE_DEVICES"] == ""
    gpu = Layout(target_gpus=(3, 4), drafter_gpus=(0, 7))
    env = {}
    if not torch.cuda.is_available():
        with pytest.raises(DistributedError, match="gives it GPU 7 but CUDA is not available"):
            select_device(gpu, 3, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "7", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_a_rank_outside_its_nodes_layout_is_refused():
    from trainer.distributed import init_world

    lay = Layout(num_target_procs=1, num_drafter_procs=2)
    with pytest.raises(DistributedError, match="DFLASH_NODE=1 LOCAL_RANK=0: node 1 outside the layout's 1 node"):
        init_world(lay, RankEnv(rank=2, world_size=3, local_rank=0, node=1), 30)
    with pytest.raises(DistributedError, match="WORLD_SIZE 4 but the layout has 3 ranks"):
        init_world(lay, RankEnv(rank=0, world_size=4), 30)


def test_batch_report_round_trips_through_its_tensor():
    r = BatchReport(0.5, 1024, alloc_mb=1.0, peak_mb=2.0, rss_mb=3.0, peak_rss_mb=4.0)
    assert BatchReport.from_tensor(r.to_tensor()) == r and r.to_tensor().shape == (REPORT_LEN,)
    assert r.memory() == {"alloc_mb": 1.0, "peak_mb": 2.0, "rss_mb": 3.0, "peak_rss_mb": 4.0}


def test_a_failed_wait_on_a_peer_is_a_peer_lost_error():
    with pytest.raises(PeerLostError, match="receiving features from rank 0: RuntimeError: Connection reset") as info:
        with talking_to("receiving features from rank 0"):
            raise RuntimeError("Connection reset by peer")
    assert isinstance(info.value.__cause__, RuntimeError) and info.value.peer is None
    with pytest.raises(PeerLostError) as info:
        with talking_to("sending features to rank 2", 2):
            raise RuntimeError("Broken pipe")
    assert info.value.peer == 2


def _batch(R=2, L=8, F=6, seed=0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (R, L), generator=g)
    return PackedBatch(ids, (ids % 2), torch.zeros(R, L, dtype=torch.long), torch.arange(L).expand(R, L).clone(),
                       torch.randn(R, L, F, generator=g))


def test_encode_refuses_a_batch_of_another_shape():
    spec = FeatureSpec(2, 8, 6, torch.float32, torch.device("cpu"))
    header, ids, feats, stats = encode(_batch(), BatchReport(0.0, 0.0), 0, spec)
    assert header.shape == (8,) and ids.shape == (4, 2, 8) and feats.shape == (2, 8, 6) and stats.dtype == torch.float64
    with pytest.raises(ValueError, match=r"does not match the fixed shape \(2, 8, 6\).*pad every batch"):
        encode(_batch(R=1), BatchReport(0.0, 0.0), 0, spec)



def test_a_frame_round_trips_and_its_header_says_which_batch_in_which_shapes():
    from trainer.feature_wire import MAGIC, VERSION, decode

    spec = FeatureSpec(2, 8, 6, torch.bfloat16, torch.device("cpu"))
    report = BatchReport(0.5, 12.0, 1.0, 2.0, 3.0, 4.0)
    frame = encode(_batch(), report, 41, spec)
    assert frame[0].tolist() == [MAGIC, VERSION, 41, 2, 8, 6, 1, REPORT_LEN]  # bfloat16 is dtype code 1
    got, got_report = decode(tuple(t.clone() for t in frame), spec, 41, src=0)
    want = _batch()
    for name in ("input_ids", "loss_mask", "doc_ids", "position_ids"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.target_hidden.dtype == torch.bfloat16 and torch.equal(got.target_hidden, want.target_hidden.to(torch.bfloat16))
    assert got_report == report


def _bad(frame, word: int, value: int):
    header = frame[0].clone()
    header[word] = value
    return (header,) + tuple(frame[1:])


def test_a_bad_header_is_named_with_the_field_and_the_fix():
    from trainer.feature_wire import Header, WireError, decode

    spec = FeatureSpec(2, 8, 6, torch.float32, torch.device("cpu"))
    frame = encode(_batch(), BatchReport(0.0, 0.0), 3, spec)
    cases = {
        0: "rank 2 sent a header that is not a feature frame (magic 0x1234, expected 0xdf1a5f7): another program is "
           "talking on the run's feature tags",
        1: "rank 2 speaks feature protocol version 0x1234 (report of 6), this rank version 1 (report of 6): the nodes "
           "run different trainers; launch every node from the same bundle",
        7: "rank 2 speaks feature protocol version 1 (report of 0x1234), this rank version 1 (report of 6): the nodes "
           "run different trainers; launch every node from the same bundle",
        6: "rank 2 sent features of dtype code 0x1234, which this trainer does not know (known: [0, 1, 2, 3]): the "
           "nodes run different trainers; launch every node from the same bundle",
        5: "rank 2 sends features [2, 8, 0x1234] float32, this rank expects [2, 8, 6] float32: the ranks were started "
           "from different configs (data.max_batch_size, data.max_len, the target or its dtype); launch every node "
           "from the same config",
        2: "rank 2 sent batch 0x1234 where this rank's schedule expects batch 3: the ranks walk different schedules "
           "(layout or data.batches_per_step differ); launch every node from the same config",
    }
    for word, text in cases.items():
        with pytest.raises(WireError) as e:
            decode(_bad(frame, word, 0x1234), spec, 3, src=2)
        assert str(e.value) == text.replace("0x1234", str(0x1234)).replace("magic 4660", "magic 0x1234"), word
    with pytest.raises(WireError, match=r"sends features \[2, 8, 6\] float32, this rank expects \[2, 8, 6\] bfloat16"):
        decode(frame, FeatureSpec(2, 8, 6, torch.bfloat16, torch.device("cpu")), 3, src=2)
    assert issubclass(WireError, DistributedError)  # one `error:` line from the rank, exit code 2
    with pytest.raises(ValueError, match="features of dtype torch.int8 cannot travel"):
        Header(0, 2, 8, 6, torch.int8).to_tensor()


_PEER = r"""
import sys, torch
from trainer.distributed import init_world, read_rank_env
from trainer.feature_wire import BatchReport, FeatureSpec, PendingBatch, WireError, send_batch, wait_sent
from trainer.layout import Layout
sys.path.insert(0, sys.argv[1])
from test_distributed import _batch
env = read_rank_env()
world = init_world(Layout(num_target_procs=1, num_drafter_procs=1), env, 30)
spec = FeatureSpec(2, 8, 6, torch.bfloat16, torch.device("cpu"))
if env.rank == 0:
    works = [send_batch(_batch(seed=s), BatchReport(*[float(s)] * 6), s, 1, spec) for s in range(3)]
    works.append(send_batch(_batch(seed=3), BatchReport(0.0, 0.0), 9, 1, spec))  # not the batch rank 1 expects
    for w in works:
        wait_sent(w, 1)
else:
    pending = [PendingBatch(0, spec, s) for s in range(4)]  # posted ahead, like a drafter's prefetch
    for s, p in enumerate(pending[:3]):
        got, stats = p.wait()
        want = _batch(seed=s)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.position_ids, want.position_ids)
        assert torch.equal(got.loss_mask, want.loss_mask) and torch.equal(got.doc_ids, want.doc_ids)
        assert torch.equal(got.target_hidden, want.target_hidden.to(torch.bfloat16))
        assert stats == BatchReport(*[float(s)] * 6)
    print("received 3 batches in order")
    try:
        pending[3].wait()
    except WireError as exc:
        print("refused:", exc)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_feature_messages_arrive_in_order_over_gloo():
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", _PEER, str(Path(__file__).parent)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "received 3 batches in order" in outs[1]
    assert ("refused: rank 0 sent batch 9 where this rank's schedule expects batch 3: the ranks walk different "
            "schedules (layout or data.batches_per_step differ); launch every node from the same config") in outs[1]


_HEADER_ONLY = r"""
import os, sys, torch
import torch.distributed as dist
from trainer.distributed import init_world, read_rank_env
from trainer.feature_wire import FeatureSpec, Header, PendingBatch, WireError
from trainer.layout import Layout
env = read_rank_env()
world = init_world(Layout(num_target_procs=1, num_drafter_procs=1), env, float(sys.argv[1]))
mine = FeatureSpec(2, 8, 6, torch.bfloat16, torch.device("cpu"))
if env.rank == 0:
    # A peer of another config (F = 8): its header goes out, and nothing else of the frame ever does.
    header = Header.of(0, FeatureSpec(2, 8, 8, torch.bfloat16, torch.device("cpu"))).to_tensor()
    dist.isend(header, dst=1, tag=0).wait()
    done = torch.zeros(1)
    dist.recv(done, src=1, tag=5)  # alive until the receiver has answered
    print("sender released", flush=True)
else:
    try:
        PendingBatch(0, mine, 0).wait()
        print("received a batch", flush=True)
    except WireError as exc:
        print("refused:", exc, flush=True)
    except Exception as exc:
        print("failed:", type(exc).__name__, exc, flush=True)
    dist.send(torch.ones(1), dst=0, tag=5)
os._exit(0)  # the receives of the frame's other messages stay posted: no teardown of the group
"""


@pytest.mark.slow  # two processes over gloo
def test_the_receiver_checks_the_header_before_waiting_for_the_rest_of_the_frame():
    """The sender posts a header of another shape and never the ids, features or report: the receiver names
    the mismatch from the header alone. A receiver that waited for the whole frame first would wait until the
    group's timeout (20 s here) and fail there as a lost peer."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", _HEADER_ONLY, "20"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    refused = [ln for ln in outs[1].splitlines() if ln.startswith(("refused:", "failed:", "received"))]
    assert len(refused) == 1 and refused[0].startswith("refused: rank 0 sends features [2, 8, 8] bfloat16"), outs
    assert "sender released" in outs[0], outs


def test_plan_steps_are_the_same_for_every_rank_and_batches_are_padded():
    from trainer.config import parse_config
    from trainer.data import DataError
    from trainer.batches import anchor_generator, make_plan, padded_rows

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


_STORE_PEER = """
import sys
import numpy as np
import trainer.distributed as D
from trainer.layout import Layout
from trainer.store import StoreError, open_store, verify
D.STORE_BLOCK = 4096  # many blocks per file
env = D.read_rank_env()
world = D.init_world(Layout(num_target_procs=1, num_drafter_procs=1), env, 60)
src, root = sys.argv[1], sys.argv[2]
if env.rank == 0:
    D.send_store(open_store(src), 1)
else:
    try:
        got = D.receive_store(root, 0)
    except StoreError as exc:
        print("refused:", exc)
        sys.exit(0)
    verify(got.path)
    sent = open_store(src)
    assert np.array_equal(got.ids, sent.ids) and np.array_equal(got.mask, sent.mask) and got.manifest == sent.manifest
    print("received", len(got), "samples")
"""


def _send_store(src: Path, root: Path) -> list[str]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", _STORE_PEER, str(src), str(root)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert procs[1].returncode == 0, outs
    return outs


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_token_store_crosses_to_another_node_as_hash_checked_files(tmp_path):
    """Across nodes the store travels as its files in blocks, point-to-point (no pickle), and the receiver keeps
    it only if every file hashes to the sender's manifest; a corrupt file on the sender is refused by name and
    leaves nothing behind on the receiver."""
    from tests.trainer.test_store import CFG, write_conversations
    from trainer.storebuild import build_store
    from trainer.tiny import build_tokenizer

    f = write_conversations(tmp_path / "a.jsonl", 120)
    store, _ = build_store([f], build_tokenizer(CFG), tmp_path / "node0", max_len=80, log=lambda _: None)
    outs = _send_store(store.path, tmp_path / "node1")
    assert f"received {len(store)} samples" in outs[1]
    assert (tmp_path / "node1" / store.path.name / "manifest.json").is_file()
    raw = bytearray((store.path / "ids.npy").read_bytes())
    raw[-3] ^= 0x40  # the sender's file goes bad after its manifest was written
    (store.path / "ids.npy").write_bytes(bytes(raw))
    outs = _send_store(store.path, tmp_path / "node2")
    assert "refused:" in outs[1] and "ids.npy: received" in outs[1] and "sha256" in outs[1], outs
    assert not list((tmp_path / "node2").glob("tokens-*")) and not list((tmp_path / "node2").glob(".tmp-*"))
