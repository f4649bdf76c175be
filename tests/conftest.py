"""Shared fixtures. `fake_pve`: a fake Proxmox VE host (real sshd on 127.0.0.1, `pct` and `nvidia-smi`
stand-ins, real LXC containers); see tests/fakehost/README.md.

Subdirectories add their own fixtures in their own conftest.py files.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from fakehost import FakeContainer, FakePVE
from fakehost.host import lxc_missing

__all__ = ["FakeContainer", "FakePVE"]


_STATE_AT_START = os.environ.get("DFLASHCTL_STATE_DIR")


@pytest.fixture(autouse=True)
def own_state_dir(tmp_path, monkeypatch):
    """Every test's own workstation state (DFLASHCTL_STATE_DIR: run records, printed offsets, caches), for the
    installed dflashctl it runs as for this process: the state of whoever runs the suite (their own launches'
    records) never changes what a test sees. A test may set another or drop it (monkeypatch); a module's
    fixture that made its own for its tests (test_venv's stock_built: what that workstation carried) keeps it."""
    if os.environ.get("DFLASHCTL_STATE_DIR") != _STATE_AT_START:
        return
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture(autouse=True)
def own_process_state():
    """What a test's loads leave in this process goes with the test: the data an early read lent
    (orchestrator.yamlload's `lend`) and the objects a large load froze out of the GC's way (gc.freeze)."""
    yield
    from orchestrator import yamlload

    yamlload._lent.clear()
    gc.unfreeze()


@pytest.fixture(scope="session")
def fake_pve():
    """A started FakePVE for the whole session; containers are made by each test with create_container.

    Set DFLASH_KEEP_FAKE_PVE=1 to keep its directory (sshd.log, pct-calls.jsonl) after the run.
    """
    missing = lxc_missing()
    if missing:
        # Not a skip: CI runs as root with lxc and openssh-server installed; a silent skip would hide the suite.
        pytest.fail(missing + " (run the tests as root; .ci/run installs what the fake host needs)")
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
    ct = fake_pve.create_container(399, gpus=0, image=STOCK_TMUX, network=True)  # the lock's other wheels: PyPI
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


def _warmup_trainer_config() -> dict:
    """cold_warmup's trainer config: a small tiny target (tests/trainer/test_warmup.py trains with it after
    its warm-up: it needs weights, not only a config.json) with ONE held-out prompt (τ before and after
    training is most of that training's time, and no warm-up test is about τ), one draft layer, one 2 x 48
    step shape, compile on."""
    return {
        "max_steps": 3,
        "log_every": 1,
        "model": {
            "target": "tiny",
            "block_size": 4,
            "num_draft_layers": 1,
            "num_target_features": 1,
            "tiny_target": {"num_prompts": 24, "held_out": 1, "response_tokens": 16},
        },
        "data": {"max_len": 48, "token_budget": 96, "max_batch_size": 2, "num_anchors": 4},
        "compile": {"enabled": True},
    }


@pytest.fixture(scope="session")
def cold_warmup(tiny_cache, tmp_path_factory):
    """ONE cold inductor compile for the session: `warmup` of warmup_trainer_config() through the orchestrator on
    a local target whose `<workdir>/inductor-cache` starts empty (a CPU compile of the drafter's forward and
    backward costs ~50 s of CPU here). The tests that defend cold-miss-then-warm-hit assert on this cold
    result, then run their own warm-up (trainer.warmup directly, or the warmup op again) against its cache.

    Returns a namespace: workdir, cache (the inductor cache), spec (its config is the trainer config: a test that
    warms up or trains with it keeps the same graph, hence the same cache keys), res (the WarmupResult), events.
    """
    from types import SimpleNamespace

    from orchestrator.ops.launch import LaunchSpec
    from orchestrator.ops.warmup import warmup
    from orchestrator.target import LocalTarget
    from orchestrator.transport.local import LocalTransport
    from trainer.tiny import tiny_train_config

    wd = tmp_path_factory.mktemp("cold-warmup") / "work"
    wd.mkdir()
    config = tiny_train_config(wd.parent / "unused", **_warmup_trainer_config()).model_dump(mode="json")
    config.pop("output_dir")
    spec = LaunchSpec(experiment="wu", kind="dflash", target="local", config=config, layout={}, gpus=[],
                      venv_profile={"kind": "workstation"})
    target = LocalTarget(name="local", workdir=str(wd), transport=LocalTransport())
    events: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_TINY_CACHE", str(tiny_cache))  # the warm-up process builds the tiny target here
        mp.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        assert not (wd / "inductor-cache").exists()
        res = warmup(target, spec, on_event=events.append)
    return SimpleNamespace(workdir=wd, cache=wd / "inductor-cache", spec=spec, res=res, events=events)


@pytest.fixture(scope="session")
def reference_memo() -> dict:
    """Train records of single-process reference runs (`reference` in tests/trainer/test_trainer_launch.py), keyed
    by the run's config less its output_dir: where a run writes does not change its losses, so the split, resumed,
    two-node and two-container runs that compare against the same reference share one run of it in the session
    (here, not in tests/trainer/conftest.py: tests/orchestrator/ops/test_nodes.py compares against it too)."""
    return {}
