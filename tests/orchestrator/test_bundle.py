"""The agent's code reaches a container inside the same single `pct exec` as the request: first contact,
a known bundle, and a bundle that vanished in the container."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.bundle import build_bundle
from orchestrator.target import ContainerTarget

HOSTILE = {"s": "it's \"q\" $(id) `x` ;&& \n*?[ ünï -x"}


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def _target(fake_pve, ct) -> ContainerTarget:
    return ContainerTarget(name="ct", workdir=str(ct.workdir), transport=fake_pve.pct_transport(ct.ctid))


def test_first_contact_is_one_exec_then_no_bundle_is_sent(fake_pve, state):
    ct = fake_pve.create_container(371, gpus=0)
    bundle = build_bundle()
    fake_pve.clear_pct_calls()
    t = _target(fake_pve, ct)
    try:
        data = t.agent("echo", HOSTILE)
        assert data["request"]["s"] == HOSTILE["s"]  # the request survived the bundle in front of it
        assert len(fake_pve.pct_exec_calls(371)) == 1
        assert t.pushes == 1
        assert (Path(ct.workdir) / "bundle" / bundle.filename).read_bytes() == bundle.data
    finally:
        t.close()

    # A new command (new target object): the workstation knows the bundle is there; only the request travels.
    fake_pve.clear_pct_calls()
    t2 = _target(fake_pve, ct)
    try:
        assert t2.agent("echo", {"n": 1})["request"]["n"] == 1
        assert t2.pushes == 0 and len(fake_pve.pct_exec_calls(371)) == 1
    finally:
        t2.close()


def test_bundle_removed_in_the_container_is_sent_again(fake_pve, state):
    ct = fake_pve.create_container(372, gpus=0)
    t = _target(fake_pve, ct)
    try:
        t.agent("echo")
        (Path(ct.workdir) / "bundle" / build_bundle().filename).unlink()
        fake_pve.clear_pct_calls()
        assert t.agent("echo", {"n": 2})["request"]["n"] == 2
        assert len(fake_pve.pct_exec_calls(372)) == 2  # the cache was wrong: one retry with the bundle inline
        assert t.pushes == 2
    finally:
        t.close()


def test_the_bundle_is_unpacked_once_and_its_compiled_modules_kept_between_calls(fake_pve, state):
    # Each call imports the agent from the bundle's hash-named directory, where Python keeps the compiled
    # modules: the second call compiles nothing (the .pyc files are neither rewritten nor added).
    ct = fake_pve.create_container(374, gpus=0)
    bundle = build_bundle()
    t = _target(fake_pve, ct)
    try:
        first = t.agent("echo")
        unpacked = Path(ct.workdir) / "bundle" / bundle.hash
        assert (unpacked / "orchestrator" / "agent" / "__main__.py").is_file()
        pyc = {p: p.stat().st_mtime_ns for p in unpacked.rglob("*.pyc")}
        assert any(p.parent == unpacked / "orchestrator" / "agent" / "__pycache__" for p in pyc)
        second = t.agent("echo", {"n": 3})
        assert second["request"]["n"] == 3 and second["pid"] != first["pid"]
        assert {p: p.stat().st_mtime_ns for p in unpacked.rglob("*.pyc")} == pyc
    finally:
        t.close()
        fake_pve.remove_container(374)
