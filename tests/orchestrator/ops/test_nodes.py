"""A layout across targets on the fake Proxmox host: CT 200 runs the target rank (node 0, the rendezvous), CT
201 the two drafter ranks (node 1). Both containers are stock Debian 12 with the real CPU venv; real sshd, pct
stand-in, tmux, torch's elastic agents and gloo. The fake host's containers share the host's network
namespace (tests/fakehost/README.md); each node gets its own loopback address (CT 200 127.0.0.1, CT 201
127.0.0.2: all of 127/8 is the loopback), as containers on vmbr0 get their own, and node 1 reaches node 0's
rendezvous at 127.0.0.1:PORT as a container reaches 10.0.0.200:29400: over TCP, from another pid and mount
namespace and another file system. Own addresses matter: torch tells the nodes of a rendezvous apart by
address and pid, and two containers' agents often have the same pid in their own pid namespaces (with one
address for both, the rendezvous never completes). Not modelled: separate network namespaces, a firewall.

Plus the inventory's validation of `layout.nodes` and the pure parts of a launch across targets."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import InventoryError, UserError
from orchestrator.inventory import load_inventory, parse_inventory
from orchestrator.ops.launch import spec_from_inventory
from orchestrator.ops.launch import fingerprint_differences, launch_placements, node_specs
from orchestrator.ops.placement import resolve, run_cause
from orchestrator.ops.stop import stop_placements
from orchestrator.target import open_target

pytestmark = [pytest.mark.usefixtures("isolated_tmux"), pytest.mark.slow]

TWO_NODES = """\
hosts:
  pve1: {ssh: pve1.lan, user: root}
targets:
  ct200: {kind: container, host: pve1, ctid: 200, workdir: /root/dflash, venv: cuda}
  ct201: {kind: container, host: pve1, ctid: 201, workdir: /root/dflash, venv: cuda}
  local: {kind: local, venv: workstation}
venvs:
  cuda: {kind: uv, python: "3.11", lock: cuda}
experiments:
  two:
    kind: dflash
    target: ct200
    layout:
      nodes:
        - {target: ct200, target_gpus: [0, 1, 2, 3, 4], drafter_gpus: [5, 6, 7]}
        - {target: ct201, drafter_gpus: [0, 1, 2, 3]}
      rendezvous: 10.0.0.200:29400
"""


def _errors(text: str) -> str:
    with pytest.raises(InventoryError) as info:
        parse_inventory(text, "inv.yaml")
    return str(info.value)


def test_a_layout_across_targets_becomes_one_spec_per_node_with_the_same_config():
    inv = parse_inventory(TWO_NODES, "inv.yaml")
    spec = spec_from_inventory(inv, "two")
    lay = spec.config["layout"]
    assert [n["name"] for n in lay["nodes"]] == ["ct200", "ct201"] and lay["rendezvous"] == "10.0.0.200:29400"
    assert lay["target_gpus"] == [] and lay["drafter_gpus"] == []
    specs = node_specs(inv, spec)
    assert [(s.target, s.gpus, s.node["index"]) for s in specs] == [
        ("ct200", [0, 1, 2, 3, 4, 5, 6, 7], 0), ("ct201", [0, 1, 2, 3], 1)]
    assert specs[1].layout == {"target_gpus": [], "drafter_gpus": [0, 1, 2, 3]}
    assert all(s.config == spec.config and s.lock_hash == specs[0].lock_hash for s in specs)
    with pytest.raises(UserError, match="runs on the targets of its layout's nodes"):
        spec_from_inventory(inv, "two", target="ct201")


@pytest.mark.parametrize("edit, needle", [
    (("- {target: ct201, drafter_gpus: [0, 1, 2, 3]}", "- {target: ct202, drafter_gpus: [0]}"),
     "inv.yaml:16: experiments.two.layout.nodes.1.target: no target named 'ct202'; did you mean 'ct201'?"),
    (("- {target: ct201, drafter_gpus: [0, 1, 2, 3]}", "- {target: ct200, drafter_gpus: [0]}"),
     "inv.yaml:16: experiments.two.layout.nodes.1.target: target 'ct200' is already node 0"),
    (("- {target: ct201, drafter_gpus: [0, 1, 2, 3]}", "- {target: local, drafter_gpus: [0]}"),
     "inv.yaml:16: experiments.two.layout.nodes.1.target: target 'local' is not a container"),
    (("target: ct200\n", "target: ct201\n"),
     "inv.yaml:12: experiments.two.target: 'ct201' is not node 0's target 'ct200'"),
    (("drafter_gpus: [0, 1, 2, 3]}", "drafter_gpus: [0, 1, 1]}"),
     "inv.yaml:16: experiments.two.layout.nodes.1: nodes[1] (ct201): drafter_gpus lists a GPU twice: [0, 1, 1]"),
    (("drafter_gpus: [0, 1, 2, 3]}", "}"), "inv.yaml:16: experiments.two.layout.nodes.1: nodes[1] (ct201): runs no rank"),
    (("      rendezvous: 10.0.0.200:29400\n", ""),
     "inv.yaml:13: experiments.two.layout.rendezvous: a layout across 2 nodes needs `rendezvous: HOST:PORT`"),
    (("10.0.0.200:29400", "10.0.0.200"),
     "inv.yaml:17: experiments.two.layout.rendezvous: rendezvous '10.0.0.200' must be HOST:PORT"),
])
def test_bad_layouts_across_targets_name_the_line_and_the_fix(edit, needle):
    old, new = edit
    assert old in TWO_NODES
    assert needle in _errors(TWO_NODES.replace(old, new, 1))


def test_fingerprints_must_be_equal_across_nodes_and_the_run_cause_prefers_a_ranks_own_failure():
    a = {"lock_hash": "L", "python": "3.11.2", "packages": {"torch": "2.13.0", "numpy": "2.1"}, "path": "/a"}
    assert fingerprint_differences([a, {**a, "path": "/b"}], ["ct200", "ct201"]) == []
    b = {**a, "packages": {"torch": "2.12.0"}}
    assert fingerprint_differences([a, b], ["ct200", "ct201"]) == [
        "numpy: 2.1 on ct200, absent on ct201", "torch: 2.13.0 on ct200, 2.12.0 on ct201"]
    lost = {"peer_lost": True, "lost": {"node": 1}, "summary": "lost rank 1"}
    own = {"peer_lost": False, "summary": "rank 2 raised ValueError"}
    assert run_cause([None, {"root_cause": lost}]) == lost
    assert run_cause([{"root_cause": lost}, {"root_cause": own}]) == own and run_cause([None, {}]) is None


# ------------------------------------------------------------------------------------- two containers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inventory(tmp_path: Path, fake_pve, cts, lock: str, **trainer) -> Path:
    from tests.trainer.test_trainer_launch import small_config

    config = small_config(tmp_path / "unused", **trainer)
    config.pop("output_dir")
    nodes = [{"target": "ct200", "num_target_procs": 1, "addr": "127.0.0.1"},
             {"target": "ct201", "num_drafter_procs": 2, "addr": "127.0.0.2"}]
    inv = {
        "hosts": {"pve": fake_pve.host_entry()},
        "targets": {f"ct{c.ctid}": {"kind": "container", "host": "pve", "ctid": c.ctid, "workdir": c.workdir,
                                     "venv": "cpu"} for c in cts},
        "venvs": {"cpu": {"kind": "uv", "python": "3.11", "lock": "cpu"}},
        "experiments": {"two": {"kind": "dflash", "target": "ct200", "trainer": config,
                                "layout": {"nodes": nodes, "rendezvous": f"127.0.0.1:{_free_port()}"}}},
    }
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def _launch(inv_path: Path, **kw):
    inv = load_inventory(inv_path)
    specs = node_specs(inv, spec_from_inventory(inv, "two"))
    targets = [open_target(inv, s.target) for s in specs]
    try:
        return launch_placements(targets, specs, warmup_device="cpu", **kw), inv
    finally:
        for t in targets:
            t.close()


def _wait(path: Path, timeout: float, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() or (what and what not in path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{path} {what!r} not there after {timeout} s"
        time.sleep(0.5)


def _rank_logs(run_dir: Path) -> str:
    """Every rank's own output (ranks/.../stdout.log and stderr.log), for a failure message."""
    return "".join(f"\n== {f}\n{f.read_text(errors='replace')[-2000:]}" for f in sorted((run_dir / "ranks").rglob("std*.log")))


def _losses(run_dir: Path) -> list[float]:
    from trainer.metrics import read_metrics

    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


@pytest.fixture
def two_cts(pve, stock_cpu_venv):
    from tests.orchestrator.ops.test_launch import make_ct

    venv, lock = stock_cpu_venv
    # Two nodes of one run reach each other's rendezvous and peers over TCP, as CTs on one Proxmox bridge do.
    cts = [make_ct(pve, ctid, venv=venv, network=True) for ctid in (200, 201)]
    yield cts, lock
    for c in cts:
        pve.remove_container(c.ctid)


@pytest.fixture(scope="module")
def tenv(tiny_cache):
    import os

    from tests.trainer.test_trainer_launch import REPO

    # The session's tiny cache: the reference runs use small_config's tiny target, built once for the suite.
    return dict(os.environ, DFLASH_TINY_CACHE=str(tiny_cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_containers_as_two_nodes_match_the_single_process_run(pve, two_cts, tmp_path, tenv, reference_memo):
    from tests.trainer.test_trainer_launch import LOSS_RTOL, reference, small_config

    cts, lock = two_cts
    pve.clear_pct_calls()
    res, _ = _launch(_inventory(tmp_path, pve, cts, lock))
    # Preflight on every node, then the start on every node: two agent calls (pct execs) per container.
    assert [len(pve.pct_exec_calls(c.ctid)) for c in cts] == [2, 2]
    runs = [Path(c.workdir) / "runs" / res.run_id for c in cts]
    assert [n.run_dir for n in res.nodes] == [str(r) for r in runs]
    for r in runs:
        _wait(r / "exit.json", 900)
    exits = [json.loads((r / "exit.json").read_text()) for r in runs]
    logs = [(r / "train.log").read_text(errors="replace") for r in runs]
    assert [e["exit_code"] for e in exits] == [0, 0], logs[0][-2000:] + logs[1][-2000:] + _rank_logs(runs[1])
    assert "--node 1" in logs[1] and "[launch] 2 of 3 rank(s) on node 1 of 2" in logs[1]
    assert json.loads((runs[1] / "run.json").read_text())["node"]["index"] == 1
    # The reference of tests/trainer/test_trainer_launch.py's split run (the same config): made once in the session.
    ref = [r["loss"] for r in reference(small_config(tmp_path / "ref"), tenv, reference_memo) if "loss" in r]
    got = _losses(runs[1])
    assert len(got) == len(ref) == 6
    assert got == pytest.approx(ref, rel=LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pct_stop_of_one_node_fails_the_run_on_both_and_resume_continues(pve, two_cts, tmp_path, tenv):
    from tests.trainer.test_trainer_launch import LOSS_RTOL, reference, small_config

    cts, lock = two_cts
    long = dict(max_steps=30, epochs=12, save_every=2)
    inv_path = _inventory(tmp_path, pve, cts, lock, **long)
    res, inv = _launch(inv_path)
    runs = [Path(c.workdir) / "runs" / res.run_id for c in cts]
    _wait(runs[1] / "train.log", 900, "[ckpt] step 4")
    subprocess.run(pve.ssh_argv("pct", "stop", "201"), check=True, timeout=60)
    t0 = time.monotonic()
    _wait(runs[0] / "exit.json", 60)
    assert time.monotonic() - t0 < 60
    first = json.loads((runs[0] / "exit.json").read_text())
    cause = first["root_cause"]
    assert first["exit_code"] != 0 and cause["lost"]["node_name"] == "ct201", (runs[0] / "train.log").read_text()[-3000:]
    assert cause["lost"]["rank"] in (1, 2) and cause["summary"].startswith(f"lost rank {cause['lost']['rank']} (drafter, node 1 (ct201)")
    assert not (runs[1] / "exit.json").exists()  # nothing in a stopped container can write it

    # `logs --follow` of the run: both nodes in one stream; node 1 cannot be reached, and the follow ends with
    # the run's outcome as soon as node 0's cause names node 1 as lost.
    from orchestrator.ops.logs import follow_placements

    lines: list[str] = []
    t1 = time.monotonic()
    outcome = follow_placements(inv, resolve(inv, res.run_id), on_line=lines.append)
    assert time.monotonic() - t1 < 60 and outcome.state == "failed", (outcome.to_dict(), lines[-20:])
    assert outcome.exit["root_cause"]["lost"]["node_name"] == "ct201"
    assert any(ln.startswith("[ct200] [launch] run failed: lost rank") for ln in lines), lines[-20:]
    assert any(ln.startswith("[ct200] [node 0 local rank 0] target rank 0") for ln in lines), lines[-40:]

    # The container comes back; `stop` of the run gives the lost node its exit.json: failed, the same cause.
    subprocess.run(pve.ssh_argv("pct", "start", "201"), check=True, timeout=60)
    where = resolve(inv, res.run_id)
    targets = [open_target(inv, p.target) for p in where.placements]
    try:
        stop_placements(targets, res.run_id, where.placements, grace_s=2)
    finally:
        for t in targets:
            t.close()
    second = json.loads((runs[1] / "exit.json").read_text())
    assert second["exit_code"] == 1 and second["lost"] is True and second["root_cause"] == cause

    # --resume continues from node 1's newest complete checkpoint with the reference loss.
    again, _ = _launch(inv_path, resume=res.run_id)
    new = [Path(c.workdir) / "runs" / again.run_id for c in cts]
    for r in new:
        _wait(r / "exit.json", 900)
    assert [json.loads((r / "exit.json").read_text())["exit_code"] for r in new] == [0, 0], (
        (new[1] / "train.log").read_text()[-3000:])
    got = _losses(new[1])
    assert len(got) == 30
    # The uninterrupted run, without the checkpoints (saving changes no loss): 15 saves fewer.
    ref = [r["loss"] for r in reference(small_config(tmp_path / "ref", **{**long, "save_every": 1000}), tenv)]
    assert got == pytest.approx(ref, rel=LOSS_RTOL)


def test_runs_diff_compares_every_nodes_fingerprint():
    from orchestrator.records import diff_records

    fp = {"lock_hash": "L", "python": "3.11.2", "packages": {"torch": "2.13.0"}}
    a = {"run_id": "a", "target": "ct200", "env_fingerprint": fp,
         "nodes": [{"target": "ct200", "env_fingerprint": fp, "gpus": [0]},
                   {"target": "ct201", "env_fingerprint": fp, "gpus": [0, 1]}]}
    b = json.loads(json.dumps(a))
    b["run_id"] = "b"
    assert diff_records(a, b).same
    b["nodes"][1]["env_fingerprint"] = {**fp, "packages": {"torch": "2.12.0"}}
    b["nodes"][1]["gpus"] = [0]
    d = diff_records(a, b)
    assert d.packages == [("node 1 (ct201): torch", "2.13.0", "2.12.0")]
    assert d.environment == [("node 1 (ct201): gpus", [0, 1], [0])]


def test_attach_node_n_is_that_nodes_target_and_a_missing_node_says_which_exist():
    from orchestrator.ops.attach import session_for

    inv = parse_inventory(TWO_NODES, "inv.yaml")
    assert session_for("two", inv, 1) == ("dflash-two", "two", "ct201")
    assert session_for("two", inv) == ("dflash-two", "two", "ct200")
    with pytest.raises(UserError, match=r"two runs on 2 node\(s\): there is no node 2") as info:
        session_for("two", inv, 2)
    assert info.value.fix == "dflashctl attach two --node N with N from 0 to 1"


def test_launch_replace_across_targets_is_refused_before_any_connection(dflashctl, tmp_path):
    """`--replace` is refused for a layout across targets (one error line and the fix, exit 1), not silently
    dropped: the hosts here do not even resolve, so any connection attempt would have failed otherwise."""
    inv = tmp_path / "inv.yaml"
    inv.write_text(TWO_NODES.replace("pve1.lan", "pve1.invalid"))
    res = dflashctl("-i", str(inv), "launch", "two", "--replace")
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.splitlines() == [
        "error: --replace does not apply to two: its layout runs across targets (stopping the live run on every "
        "node first is not built yet)",
        f"fix: dflashctl -i {inv} stop RUN (the live run of two), then dflashctl -i {inv} launch two"]
