"""The early SSH connection (orchestrator.preconnect): started from the raw inventory while it is validated,
taken by open_target only for exactly the host it was made for, its errors raised there."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchestrator import preconnect
from orchestrator.errors import HostKeyError
from orchestrator.inventory import load_inventory
from orchestrator.transport.ssh import SSHSettings
from orchestrator.target import open_target


def write_inv(tmp_path: Path, host: dict, ctid: int = 990, workdir: str = "/root/dflash") -> Path:
    inv = {
        "hosts": {"pve": host},
        "targets": {"ct": {"kind": "container", "host": "pve", "ctid": ctid, "workdir": workdir, "venv": "sys"},
                    "here": {"kind": "local", "workdir": str(tmp_path / "work")}},
        "venvs": {"sys": {"kind": "system"}},
        "experiments": {"e": {"kind": "command", "target": "ct", "command": ["true"]},
                        "l": {"kind": "command", "target": "here", "command": ["true"]}},
    }
    p = tmp_path / "inv.yaml"
    p.write_text(json.dumps(inv))
    return p


def test_the_early_connection_is_the_one_the_target_uses(fake_pve, tmp_path):
    path = write_inv(tmp_path, fake_pve.host_entry())
    early = preconnect.start(str(path), None, "e")  # the experiment's target, found in the raw YAML
    assert early is not None and early.key == SSHSettings.of("pve", load_inventory(path).host("pve"))
    tgt = open_target(load_inventory(path), "ct", early)
    try:
        ssh = tgt.transport.parent
        assert ssh.connects == 1  # connected by the thread, before open_target
        assert ssh.run(["true"]).exit_code == 0 and ssh.connects == 1
    finally:
        tgt.close()
        early.close()


def test_a_local_target_or_an_unreadable_inventory_starts_nothing(fake_pve, tmp_path):
    path = write_inv(tmp_path, fake_pve.host_entry())
    assert preconnect.start(str(path), "here") is None
    assert preconnect.start(str(path), None, "l") is None
    assert preconnect.start(str(path), "nosuch") is None
    assert preconnect.start(str(tmp_path / "missing.yaml"), "ct") is None
    (tmp_path / "bad.yaml").write_text("hosts: [unclosed\n")
    assert preconnect.start(str(tmp_path / "bad.yaml"), "ct") is None


def count_parses(monkeypatch) -> list[str]:
    """The texts yamlload parses (or reads from its cache) from now on: its one step below the lent data."""
    from orchestrator import yamlload

    seen: list[str] = []
    load = yamlload._load

    def counted(text, *args):
        seen.append(text)
        return load(text, *args)

    monkeypatch.setattr(yamlload, "_load", counted)
    return seen


def test_the_early_read_is_the_loads_own_first_pass_and_the_command_parses_once(tmp_path, monkeypatch):
    """Until 2026-12-07 the early read was PyYAML's CSafeLoader over the whole text (17 s of a command on a 10 MB
    inventory, before the load parsed it again); now it is yamlload's first pass, lent to the command's load."""
    path = write_inv(tmp_path, {"ssh": "127.0.0.1"})
    parses = count_parses(monkeypatch)
    found = preconnect._host_key(str(path), None, "e")
    assert found is not None and found[1] == "ct" and parses == [path.read_text()]  # the first pass, once
    inv = load_inventory(path)
    assert len(parses) == 1 and inv.target("ct").ctid == 990  # the lent data, validated
    load_inventory(path)
    assert len(parses) == 2  # lent once: a second load parses


def test_an_inventory_changed_after_the_early_read_is_loaded_as_it_is_now(tmp_path, monkeypatch):
    path = write_inv(tmp_path, {"ssh": "127.0.0.1"})
    parses = count_parses(monkeypatch)
    assert preconnect._host_key(str(path), "ct", None) is not None
    write_inv(tmp_path, {"ssh": "127.0.0.1"}, ctid=991)  # edited between the early read and the load
    assert load_inventory(path).target("ct").ctid == 991 and len(parses) == 2
    assert load_inventory(path).target("ct").ctid == 991  # (and the first text's data was dropped, not kept)


def test_the_early_reads_cache_entry_is_the_one_the_next_commands_load_reads(tmp_path, monkeypatch):
    """A large inventory's data, kept by the early read (the load takes the lent data and keeps nothing), is
    where the next command's load looks: that load parses nothing."""
    from orchestrator import inventory_file, yamlload

    path = tmp_path / "inv.yaml"
    path.write_text(_block_inventory("".join(f"  c{i}: {{kind: command, target: ct, command: ['true', '[{i}]']}}\n"
                                             for i in range(9000))))
    assert path.stat().st_size > yamlload.CACHE_MIN_BYTES
    assert preconnect._host_key(str(path), None, "e") is not None
    assert len(list(inventory_file.cache_dir().glob("*.marshal"))) == 1
    load_inventory(path)  # takes the lent data
    yamlload._lent.clear()  # as in the next command's process
    composed = []
    real = yamlload.Loader.get_single_node
    monkeypatch.setattr(yamlload.Loader, "get_single_node", lambda self: composed.append(1) or real(self))
    inv = load_inventory(path)
    assert composed == [] and inv.experiment("c8999").command == ["true", "[8999]"]


def _block_inventory(experiments: str) -> str:
    return ("hosts:\n  pve: {ssh: 127.0.0.1}\n"
            "targets:\n  ct: {kind: container, host: pve, ctid: 990, venv: sys}\n"
            "venvs:\n  sys: {kind: system}\n"
            "experiments:\n  e: {kind: command, target: ct, command: ['true']}\n" + experiments)


def test_a_connection_made_for_other_settings_is_closed_not_used(fake_pve, tmp_path):
    path = write_inv(tmp_path, fake_pve.host_entry())
    early = preconnect.start(str(path), "ct")
    other = SSHSettings.of("pve", load_inventory(path).host("pve"))
    other = SSHSettings(other.name, other.ssh, other.port, "someoneelse", other.identity_file, other.known_hosts)
    assert early.take(other.name, other) is None
    assert early.take(early.key.name, early.key) is None  # handed over (here: closed) once


def test_an_unknown_host_key_met_early_is_the_error_open_target_raises(fake_pve, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    path = write_inv(tmp_path, {**fake_pve.host_entry(), "known_hosts": str(empty)})
    inv = load_inventory(path)
    with pytest.raises(HostKeyError) as late:
        open_target(inv, "ct").transport.parent.connect()
    early = preconnect.start(str(path), "ct")
    with pytest.raises(HostKeyError) as info:
        open_target(inv, "ct", early)
    assert info.value.message == late.value.message and info.value.fix == late.value.fix


def test_status_of_a_container_named_on_the_command_line_connects_early(fake_pve, tmp_path, monkeypatch):
    """The verb hands the early connection to its op (which hands it to open_target)."""
    from orchestrator.cli import main
    from orchestrator.ops import status as status_ops

    path = write_inv(tmp_path, fake_pve.host_entry())
    seen = []

    def fake_status_of(inv, target, *, limit=20, early=None):
        seen.append((target, early is not None and early.key == SSHSettings.of("pve", inv.host("pve")),
                     early.agent.verb if early is not None and early.agent is not None else None))
        raise SystemExit(0)

    monkeypatch.setattr(status_ops, "status_of", fake_status_of)
    with pytest.raises(SystemExit):
        main(["-i", str(path), "status", "--target", "ct"])
    assert seen == [("ct", True, "status")]  # and its one agent call started early too


def wait_for_execs(pve, ctid: int, n: int, timeout: float = 60) -> None:
    """Until the fake host has logged `n` pct exec calls into `ctid` (pct logs a call when it starts)."""
    deadline = time.monotonic() + timeout
    while len(pve.pct_exec_calls(ctid)) < n:
        assert time.monotonic() < deadline, f"no pct exec into {ctid} within {timeout} s: {pve.pct_calls()}"
        time.sleep(0.05)


def test_a_launch_starts_its_agent_call_before_validation_and_finishes_it(pve, tmp_path, monkeypatch):
    """The early agent call is THE launch's one pct exec: started from the raw inventory, it waits for the
    request, which the launch then sends to it."""
    from orchestrator.ops.launch import launch_experiment

    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))  # the known-bundles cache: this test's

    ct = pve.create_container(993, gpus=0)
    path = write_inv(tmp_path, pve.host_entry(), ctid=993, workdir=ct.workdir)
    try:
        early = preconnect.start(str(path), None, "e", verb="launch")
        wait_for_execs(pve, 993, 1)  # in the container already; nothing validated, no request built yet
        res = launch_experiment(load_inventory(path), "e", early=early, record=False)
        early.close()
        assert len(pve.pct_exec_calls(993)) == 1
        exit_json = Path(res.run_dir) / "exit.json"
        deadline = time.monotonic() + 60
        while not exit_json.exists():
            assert time.monotonic() < deadline, "the launched run did not end"
            time.sleep(0.1)
        assert json.loads(exit_json.read_text())["exit_code"] == 0
    finally:
        pve.remove_container(993)


def test_an_early_agent_call_the_command_does_not_make_is_dropped_and_runs_nothing(pve, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    ct = pve.create_container(994, gpus=0)
    path = write_inv(tmp_path, pve.host_entry(), ctid=994, workdir=ct.workdir)
    try:
        early = preconnect.start(str(path), "ct", verb="launch")
        wait_for_execs(pve, 994, 1)
        tgt = open_target(load_inventory(path), "ct", early)
        assert tgt.agent("echo", {"x": "[y]"})["request"]["x"] == "[y]"  # another verb: its own exec, the started one dropped
        tgt.close()
        early = preconnect.start(str(path), "ct", verb="launch")
        wait_for_execs(pve, 994, 3)
        early.close()  # the command ended before it needed the target (e.g. a bad inventory)
        assert len(pve.pct_exec_calls(994)) == 3
        assert not (Path(ct.workdir) / "runs").exists() and not (Path(ct.workdir) / "locks").exists()
    finally:
        pve.remove_container(994)
