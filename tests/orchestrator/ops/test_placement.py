"""Where a run is (orchestrator.ops.placement.resolve): the workstation's record first (its own target, run
directory, GPUs, every node of a run across targets), then the inventory's experiment, then a bare run id on
--target or the first target; --target narrows a run across targets to its node; an ambiguous prefix and a bad
name are refused before anything connects. Pure: records in this test's state dir, no target opened."""

from __future__ import annotations

import pytest
import yaml

from orchestrator import records
from orchestrator.errors import RunNotFound, UserError
from orchestrator.inventory import load_inventory
from orchestrator.ops.placement import Placement, resolve

pytestmark = pytest.mark.usefixtures("isolated_tmux")  # own run records (DFLASHCTL_STATE_DIR) per test


@pytest.fixture
def inv(tmp_path):
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({
        "targets": {"first": {"kind": "local", "workdir": "/a", "venv": "ws"},  # (nothing is made there)
                    "second": {"kind": "local", "workdir": "/b", "venv": "ws"}},
        "venvs": {"ws": {"kind": "workstation"}},
        "experiments": {"exp": {"kind": "command", "target": "second", "command": ["true"]}},
    }))
    return load_inventory(path)


def test_a_recorded_run_is_where_its_record_says_not_on_the_first_target(inv):
    records.append_record({"run_id": "exp-20261201T100000Z", "experiment": "exp", "target": "second",
                           "run_dir": "/b/runs/exp-20261201T100000Z", "gpus": [3]})
    where = resolve(inv, "exp-20261201T100000Z")
    assert (where.run_id, where.experiment, where.across) == ("exp-20261201T100000Z", "exp", False)
    assert where.placements == [Placement("second", "/b/runs/exp-20261201T100000Z", [3], "dflash-exp")]
    assert resolve(inv, "exp-20261201").run_id == "exp-20261201T100000Z"  # a unique prefix
    assert resolve(inv, "exp").run_id == "exp-20261201T100000Z"  # the experiment: its newest recorded run
    # --target names another target outright: the run is looked for there, with nothing recorded about it.
    assert resolve(inv, "exp-20261201T100000Z", "first").placements == [Placement("first", session="dflash-exp")]


def test_a_record_of_another_inventory_is_not_this_ones_run(inv):
    """Two inventories with a target of the same name, other workdirs (or a workdir moved since the launch): the
    record's run is not looked for here. The experiment is its target's newest run, as with no record; an
    older record of it that does fit is still found."""
    records.append_record({"run_id": "exp-20261201T090000Z", "experiment": "exp", "target": "second",
                           "run_dir": "/b/runs/exp-20261201T090000Z"})
    records.append_record({"run_id": "exp-20261201T100000Z", "experiment": "exp", "target": "second",
                           "run_dir": "/elsewhere/runs/exp-20261201T100000Z"})
    records.append_record({"run_id": "gone-20261201T100000Z", "experiment": "gone", "target": "third",
                           "run_dir": "/c/runs/gone-20261201T100000Z"})
    assert resolve(inv, "exp").run_id == "exp-20261201T090000Z"  # the newest record that is this inventory's
    with pytest.raises(RunNotFound, match="was launched on target second [(]/elsewhere/runs/"):
        resolve(inv, "exp-20261201T100000Z")
    with pytest.raises(RunNotFound) as info:  # a run id recorded elsewhere: said so, not "no run"
        resolve(inv, "gone-20261201T100000Z")
    assert info.value.message.startswith("run 'gone-20261201T100000Z' was launched on target third "
                                         "(/c/runs/gone-20261201T100000Z), which this inventory does not reach")
    assert info.value.fix == "dflashctl runs  (this workstation's runs, with their targets)"
    # A prefix of a run recorded elsewhere is no claim about it: a run id on the first target, as any other.
    assert resolve(inv, "gone-20261201").placements == [Placement("first")]
    # A record without a target (nor a run directory) is not another inventory's: the first target, as before.
    records.append_record({"run_id": "old-20261201T100000Z", "experiment": "old"})
    assert resolve(inv, "old-20261201T100000Z").record is not None


def test_a_run_across_targets_is_every_node_and_target_narrows_it(inv):
    records.append_record({"run_id": "two-20261201T100000Z", "experiment": "two", "target": "first",
                           "nodes": [{"index": 0, "target": "first", "run_dir": "/a/runs/r", "gpus": [0]},
                                     {"index": 1, "target": "second", "run_dir": "/b/runs/r", "gpus": [1, 2]}]})
    where = resolve(inv, "two-20261201T100000Z")
    assert where.across and [(p.target, p.run_dir, p.gpus, p.node) for p in where.placements] == \
        [("first", "/a/runs/r", [0], 0), ("second", "/b/runs/r", [1, 2], 1)]
    one = resolve(inv, "two-20261201T100000Z", "second")
    assert one.placements == [Placement("second", "/b/runs/r", [1, 2], "dflash-two", 1)] and one.across


def test_without_a_record_an_experiment_is_its_target_and_anything_else_a_run_id_on_the_first(inv):
    exp = resolve(inv, "exp")
    assert (exp.run_id, exp.experiment, exp.placements) == (None, "exp", [Placement("second", session="dflash-exp")])
    bare = resolve(inv, "other-20261201T100000Z")
    assert (bare.run_id, bare.experiment, bare.placements) == ("other-20261201T100000Z", None, [Placement("first")])
    assert resolve(inv, None).placements == [Placement("first")]
    assert resolve(inv, None, "second").placements == [Placement("second")]


def test_an_ambiguous_prefix_and_a_bad_name_are_refused(inv):
    records.append_record({"run_id": "exp-20261201T100000Z", "experiment": "exp", "target": "second"})
    records.append_record({"run_id": "exp-20261202T100000Z", "experiment": "exp", "target": "second"})
    with pytest.raises(RunNotFound, match="matches 2 runs"):
        resolve(inv, "exp-2026")
    with pytest.raises(UserError, match="bad run id "):
        resolve(inv, "../x", kind="run id")
