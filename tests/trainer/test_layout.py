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


# What a user reads when a layout is refused, in full (the messages name the field and the fix), and the
# rank arithmetic at its edges: the colocated layout, the last rank, one past it, a 1+1 node.


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_gpus=[0, 1], drafter_gpus=[1, 2]),
     "GPU(s) [1] are in both target_gpus and drafter_gpus; each GPU runs one process: move them to one list"),
    (dict(target_gpus=[0], drafter_gpus=[1, 1]), "drafter_gpus lists a GPU twice: [1, 1]"),
    (dict(target_gpus=[0], drafter_gpus=[True]), "drafter_gpus must be GPU indices >= 0, got [True]"),
    (dict(target_gpus=[-1], drafter_gpus=[1]), "target_gpus must be GPU indices >= 0, got [-1]"),
    (dict(target_gpus=[0]), "give both target_gpus and drafter_gpus (split layout) or neither (colocated single process)"),
    (dict(target_gpus=[0], drafter_gpus=[1], num_target_procs=1),
     "num_target_procs/num_drafter_procs are for CPU layouts; with GPUs the lists decide"),
    (dict(target_gpus=[0], drafter_gpus=[1], num_drafter_procs=2),
     "num_target_procs/num_drafter_procs are for CPU layouts; with GPUs the lists decide"),
    (dict(num_target_procs=1), "give both num_target_procs and num_drafter_procs, or neither"),
])
def test_a_refused_layout_says_exactly_what_and_how_to_fix_it(kwargs, message):
    with pytest.raises(LayoutError) as exc:
        Layout(**kwargs)
    assert str(exc.value) == message


_TWO_NODES = (NodeSpec(target_gpus=(0,)), NodeSpec(drafter_gpus=(0,)))


@pytest.mark.parametrize("nodes, top, message", [
    ((NodeSpec(target_gpus=(0,), num_drafter_procs=1), NodeSpec(drafter_gpus=(1,))), {},
     "nodes[0]: num_target_procs/num_drafter_procs are for CPU nodes; with GPUs the lists decide"),
    ((NodeSpec(target_gpus=(0,)), NodeSpec(num_target_procs=1)), {},
     "some nodes list GPUs and others CPU process counts: a run is all GPUs or all CPU"),
    ((NodeSpec(drafter_gpus=(0,)), NodeSpec(drafter_gpus=(0,))), {},
     "the nodes together need at least one target rank and one drafter rank"),
] + [
    (_TWO_NODES, {field: value}, "a layout with `nodes` lists every GPU under its node: drop the top-level "
                                 "target_gpus/drafter_gpus/num_*_procs")
    for field, value in (("target_gpus", (1,)), ("drafter_gpus", (1,)), ("num_target_procs", 1),
                         ("num_drafter_procs", 1))
])
def test_a_refused_layout_across_nodes_says_exactly_what(nodes, top, message):
    with pytest.raises(LayoutError) as exc:
        Layout(nodes=nodes, **top)
    assert str(exc.value) == message


def test_a_layout_is_a_hashable_value_of_tuples_whatever_sequences_it_was_given():
    lay = Layout(target_gpus=[0], drafter_gpus=[1])
    assert (lay.target_gpus, lay.drafter_gpus) == ((0,), (1,))
    nodes = Layout(nodes=[NodeSpec(target_gpus=[0], drafter_gpus=[1]), NodeSpec(drafter_gpus=[0])])
    assert nodes.nodes == (NodeSpec(target_gpus=(0,), drafter_gpus=(1,)), NodeSpec(drafter_gpus=(0,)))
    assert hash(lay) == hash(Layout(target_gpus=(0,), drafter_gpus=(1,))) and hash(nodes)


def test_a_node_with_as_many_targets_as_drafters_runs_both():
    lay = Layout(nodes=(NodeSpec(target_gpus=(3,), drafter_gpus=(5,)), NodeSpec(drafter_gpus=(2,), name="b")))
    assert lay.placements() == (Placement(0, 0, 3), Placement(0, 1, 5), Placement(1, 0, 2))
    assert lay.describe_rank(2) == "rank 2 (drafter, node 1 (b), local rank 0)"
    assert lay.describe_rank(1) == "rank 1 (drafter, node 0, local rank 1)"


def test_ranks_and_nodes_outside_the_layout_are_refused_by_number():
    one = Layout(target_gpus=[0, 1, 2, 3, 4], drafter_gpus=[5, 6, 7])
    assert one.describe_rank(7) == "rank 7 (drafter)" and one.describe_rank(0) == "rank 0 (target)"
    for call, message in ((lambda: one.role(8), "rank 8 outside world size 8"),
                          (lambda: one.node_ranks(1), "node 1 outside the layout's 1 node(s)"),
                          (lambda: one.rank_of(0, 8), "local rank 8 outside node 0's 8 rank(s)"),
                          (lambda: one.drafter_index(4), "rank 4 is a target rank")):
        with pytest.raises(LayoutError) as exc:
            call()
        assert str(exc.value) == message
    assert one.drafter_index(5) == 0 and one.rank_of(0, 7) == 7


def test_the_colocated_layout_is_rank_0_on_node_0_without_a_gpu():
    lay = Layout()
    assert lay.placements() == (Placement(node=0, local_rank=0, gpu=None),)
    assert lay.place(0) == Placement(node=0, local_rank=0, gpu=None) and lay.gpu(0) is None
    assert lay.target_ranks() == [0] and lay.drafter_ranks() == [0] and lay.drafter_index(0) == 0
    assert lay.node_ranks(0) == [0] and lay.rank_of(0, 0) == 0 and lay.describe_rank(0) == "rank 0 (colocated)"
    assert lay.env(0) == {"CUDA_VISIBLE_DEVICES": ""}
    assert NodeSpec().label(0) == "node 0" and NodeSpec(name="ct201").label(1) == "node 1 (ct201)"
