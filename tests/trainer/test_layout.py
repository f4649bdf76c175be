import pytest

from trainer.layout import Layout, LayoutError, NodeSpec, Placement, Schedule


def test_production_layout_5_plus_3():
    lay = Layout(target_gpus=[0, 1, 2, 3, 4], drafter_gpus=[5, 6, 7])
    assert lay.world_size == 8
    assert [lay.role(r) for r in range(8)] == ["target"] * 5 + ["drafter"] * 3
    assert [lay.gpu(r) for r in range(8)] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert lay.env(6) == {"CUDA_VISIBLE_DEVICES": "6", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert lay.drafter_index(7) == 2


def test_schedule_every_batch_sent_once_and_received_once():
    lay = Layout(target_gpus=[0, 1, 2, 3, 4], drafter_gpus=[5, 6, 7])
    sch = Schedule(lay, 3)
    for step in range(20):
        sent = [item for t in lay.target_ranks() for item in sch.sends(t, step)]
        # Each drafter receives exactly one batch per step, from the rank `source` names.
        assert sorted(dst for _, dst in sent) == [5, 6, 7]
        for batch, dst in sent:
            d = dst - 5
            assert sch.batches(step, d) == [batch]
            assert (batch, dst) in sch.sends(sch.source(batch), step)
    # Batches are consecutive and disjoint across steps.
    seen = [b for s in range(10) for d in range(3) for b in sch.batches(s, d)]
    assert seen == list(range(30))
    # Load is spread: over 5 steps every target sends 3 batches.
    counts = {t: sum(len(sch.sends(t, s)) for s in range(5)) for t in lay.target_ranks()}
    assert set(counts.values()) == {3}


def test_schedule_with_accumulation_covers_the_same_batches_in_any_layout():
    # Six batches per step: one drafter trains all six, two drafters three each, three drafters two each.
    for drafters in (1, 2, 3):
        lay = Layout(num_target_procs=2, num_drafter_procs=drafters) if drafters > 1 else Layout()
        sch = Schedule(lay, 6)
        assert sch.per_drafter == 6 // drafters
        for step in range(4):
            got = [b for d in range(drafters) for b in sch.batches(step, d)]
            assert got == list(range(6 * step, 6 * step + 6))
            assert all(sch.drafter_of(b) == d for d in range(drafters) for b in sch.batches(step, d))
        if drafters > 1:
            # per (target, drafter) pair the sends are in increasing batch order: the drafter's receive order
            for t in lay.target_ranks():
                for dst in lay.drafter_ranks():
                    order = [b for s in range(4) for b, to in sch.sends(t, s) if to == dst]
                    assert order == sorted(order)
    with pytest.raises(LayoutError, match="set data.batches_per_step to a multiple of 2"):
        Schedule(Layout(num_target_procs=1, num_drafter_procs=2), 3)


def test_cpu_layout_1_plus_2():
    lay = Layout(num_target_procs=1, num_drafter_procs=2)
    assert lay.world_size == 3 and not lay.uses_gpus
    assert Schedule(lay, 2).sends(0, 0) == [(0, 1), (1, 2)]
    assert lay.env(1) == {"CUDA_VISIBLE_DEVICES": ""}


def test_colocated():
    lay = Layout()
    assert lay.colocated and lay.world_size == 1 and lay.role(0) == "colocated"
    assert lay.drafter_ranks() == [0] and Schedule(lay, 1).source(3) == 0


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(target_gpus=[0, 1], drafter_gpus=[1, 2]), "in both"),
        (dict(target_gpus=[0, 0], drafter_gpus=[1]), "twice"),
        (dict(target_gpus=[0]), "both"),
        (dict(target_gpus=[-1], drafter_gpus=[1]), ">= 0"),
        (dict(num_target_procs=1), "both"),
    ],
)
def test_bad_layouts_are_refused_with_a_reason(kwargs, needle):
    with pytest.raises(LayoutError, match=needle):
        Layout(**kwargs)


def test_a_layout_across_nodes_numbers_targets_first_and_maps_each_local_rank_to_its_gpu():
    lay = Layout(nodes=(NodeSpec(target_gpus=(0, 1, 2, 3, 4), drafter_gpus=(5, 6, 7), name="ct200"),
                        NodeSpec(drafter_gpus=(0, 1, 2, 3), name="ct201")))
    assert (lay.num_nodes, lay.world_size, lay.num_targets, lay.num_drafters) == (2, 12, 5, 7)
    assert lay.target_ranks() == [0, 1, 2, 3, 4] and lay.drafter_ranks() == list(range(5, 12))
    assert lay.node_ranks(0) == list(range(8)) and lay.node_ranks(1) == [8, 9, 10, 11]
    assert lay.place(9) == Placement(node=1, local_rank=1, gpu=1) and lay.gpu(5) == 5
    assert lay.rank_of(1, 3) == 11 and lay.env(8) == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert lay.describe_rank(9) == "rank 9 (drafter, node 1 (ct201), local rank 1)"
    # A node holding only targets after one holding only drafters: global ranks still put targets first.
    cpu = Layout(nodes=(NodeSpec(num_drafter_procs=2), NodeSpec(num_target_procs=1)))
    assert [(p.node, p.local_rank) for p in cpu.placements()] == [(1, 0), (0, 0), (0, 1)]
    assert cpu.node_ranks(0) == [1, 2] and cpu.rank_of(1, 0) == 0 and not cpu.uses_gpus
    assert Schedule(cpu, 2).sends(0, 0) == [(0, 1), (1, 2)]


@pytest.mark.parametrize("nodes, needle", [
    ((NodeSpec(target_gpus=(0,)), NodeSpec(target_gpus=(0,))), "at least one target rank and one drafter rank"),
    ((NodeSpec(target_gpus=(0,)), NodeSpec(name="ct201")), r"nodes\[1\] \(ct201\): runs no rank"),
    ((NodeSpec(target_gpus=(0, 0)), NodeSpec(drafter_gpus=(1,))), r"nodes\[0\]: target_gpus lists a GPU twice"),
    ((NodeSpec(target_gpus=(0,), drafter_gpus=(0,)), NodeSpec(drafter_gpus=(1,))), r"nodes\[0\]: GPU\(s\) \[0\] are in both"),
    ((NodeSpec(target_gpus=(0,)), NodeSpec(num_drafter_procs=2)), "all GPUs or all CPU"),
])
def test_bad_node_layouts_are_refused_naming_the_node(nodes, needle):
    with pytest.raises(LayoutError, match=needle):
        Layout(nodes=nodes)
    with pytest.raises(LayoutError, match="drop the top-level"):
        Layout(target_gpus=(1,), drafter_gpus=(2,), nodes=(NodeSpec(target_gpus=(0,)), NodeSpec(drafter_gpus=(0,))))


def test_a_config_across_nodes_needs_a_rendezvous_host_and_port():
    from pydantic import ValidationError

    from trainer.config import LayoutConfig

    nodes = [{"target_gpus": [0], "name": "ct200"}, {"drafter_gpus": [0, 1], "name": "ct201"}]
    lay = LayoutConfig(nodes=nodes, rendezvous="10.0.0.200:29400").to_layout()
    assert lay.node_specs[1].name == "ct201" and lay.world_size == 3
    with pytest.raises(ValidationError, match=r"across 2 nodes needs `rendezvous: HOST:PORT`"):
        LayoutConfig(nodes=nodes)
    with pytest.raises(ValidationError, match=r"nodes\[1\] has node 0's address 10.0.0.200: give every node its own"):
        LayoutConfig(nodes=[nodes[0], {**nodes[1], "addr": "10.0.0.200"}], rendezvous="10.0.0.200:29400")
    for bad in ("10.0.0.200", "10.0.0.200:0", ":29400", "host:99999", "host:http"):
        with pytest.raises(ValidationError, match="must be HOST:PORT with a port 1-65535"):
            LayoutConfig(nodes=nodes, rendezvous=bad)
