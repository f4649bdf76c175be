import pytest

from trainer.layout import Layout, LayoutError


def test_production_layout_5_plus_3():
    lay = Layout(target_gpus=[0, 1, 2, 3, 4], drafter_gpus=[5, 6, 7])
    assert lay.world_size == 8
    assert [lay.role(r) for r in range(8)] == ["target"] * 5 + ["drafter"] * 3
    assert [lay.gpu(r) for r in range(8)] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert lay.env(6) == {"CUDA_VISIBLE_DEVICES": "6", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert lay.drafter_index(7) == 2


def test_schedule_every_batch_sent_once_and_received_once():
    lay = Layout(target_gpus=[0, 1, 2, 3, 4], drafter_gpus=[5, 6, 7])
    for step in range(20):
        sent = [item for t in lay.target_ranks() for item in lay.sends(t, step)]
        # Each drafter receives exactly one batch per step, from the rank source_of names.
        assert sorted(dst for _, dst in sent) == [5, 6, 7]
        for batch, dst in sent:
            d = dst - 5
            assert batch == lay.batch_index(step, d)
            assert dst in [dst for _, dst in lay.sends(lay.source_of(step, d), step)]
    # Batches are consecutive and disjoint across steps.
    seen = [lay.batch_index(s, d) for s in range(10) for d in range(3)]
    assert seen == list(range(30))
    # Load is spread: over 5 steps every target sends 3 batches.
    counts = {t: sum(len(lay.sends(t, s)) for s in range(5)) for t in lay.target_ranks()}
    assert set(counts.values()) == {3}


def test_cpu_layout_1_plus_2():
    lay = Layout(num_target_procs=1, num_drafter_procs=2)
    assert lay.world_size == 3 and not lay.uses_gpus
    assert lay.sends(0, 0) == [(0, 1), (1, 2)]
    assert lay.env(1) == {"CUDA_VISIBLE_DEVICES": ""}


def test_colocated():
    lay = Layout()
    assert lay.colocated and lay.world_size == 1 and lay.role(0) == "colocated"
    assert lay.drafter_ranks() == [0] and lay.source_of(3, 0) == 0


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
