"""Shared fixtures. `fake_pve`: a fake Proxmox VE host (real sshd on 127.0.0.1, `pct` and `nvidia-smi`
stand-ins, containers in their own namespaces); see tests/fakehost/README.md.

Subdirectories add their own fixtures in their own conftest.py files.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fakehost import FakeContainer, FakePVE

__all__ = ["FakeContainer", "FakePVE"]


def _fake_host_missing() -> str | None:
    if os.geteuid() != 0:
        return "the fake Proxmox host needs root (unshare, nsenter, sshd)"
    for tool in ("unshare", "nsenter", "ssh-keygen", "ssh"):
        if shutil.which(tool) is None:
            return f"the fake Proxmox host needs `{tool}`"
    if not os.path.exists("/usr/sbin/sshd"):
        return "the fake Proxmox host needs /usr/sbin/sshd (apt-get install openssh-server)"
    return None


@pytest.fixture(scope="session")
def fake_pve():
    """A started FakePVE for the whole session; containers are made by each test with create_container.

    Set DFLASH_KEEP_FAKE_PVE=1 to keep its directory (sshd.log, pct-calls.jsonl) after the run.
    """
    missing = _fake_host_missing()
    if missing:
        # Not a skip: CI runs as root with openssh-server installed; a silent skip would hide the suite.
        pytest.fail(missing + " (run the tests as root, see .ci/run)")
    host = FakePVE().start()
    try:
        yield host
    finally:
        host.close(remove=not os.environ.get("DFLASH_KEEP_FAKE_PVE"))


@pytest.fixture
def pve(fake_pve):
    """fake_pve with the pct delay reset to 0 (and no forced pct error after the test) and the call log
    cleared, for tests that count calls."""
    fake_pve.set_delay(0)
    fake_pve.clear_pct_calls()
    yield fake_pve
    fake_pve.set_delay(0)
    fake_pve.set_pct_error(None)


@pytest.fixture
def pve_ssh(fake_pve):
    """An SSHTransport to the fake host, closed after the test."""
    transport = fake_pve.ssh_transport()
    yield transport
    transport.close()


@pytest.fixture(scope="session")
def stock_cpu_venv(fake_pve, tmp_path_factory):
    """A venv of the `cpu` lock (torch's CPU build) built by rebuild-venv in a stock container that lives for
    the session; its directory is in the fake host's storage, so every stock container sees it at the same
    path (a test points a container's `venvs/current` at it instead of building its own).

    Yields (venv directory, lock hash).
    """
    from fakehost import STOCK_TMUX
    from orchestrator.ops.venv import rebuild_venv
    from orchestrator.target import ContainerTarget

    old = os.environ.get("DFLASHCTL_STATE_DIR")
    os.environ["DFLASHCTL_STATE_DIR"] = str(tmp_path_factory.mktemp("stock-venv-state"))
    ct = fake_pve.create_container(399, gpus=0, image=STOCK_TMUX)
    target = ContainerTarget(name="ct399", workdir=ct.workdir, transport=fake_pve.pct_transport(399))
    try:
        profile = {"kind": "uv", "lock": "cpu", "python": "3.11", "wheelhouse": ["/opt/wheels"],
                   "uv_cache_dir": str(fake_pve.storage() / "uv-cache")}
        report = rebuild_venv(target, profile)
    finally:
        target.close()
        if old is None:
            os.environ.pop("DFLASHCTL_STATE_DIR", None)
        else:
            os.environ["DFLASHCTL_STATE_DIR"] = old
    yield Path(ct.workdir) / "venvs" / report.venv, report.lock_hash
    fake_pve.remove_container(399)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One DFLASH_TINY_CACHE for the session: the tiny assets are keyed by their config's hash and built under a
    lock, so tests that ask for the same tiny target share one build instead of each making its own. A test that
    is about building (first build, concurrent builders) keeps a cache of its own."""
    return tmp_path_factory.mktemp("tiny-cache")
