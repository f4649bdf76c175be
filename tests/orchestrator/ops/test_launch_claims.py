"""Locks per experiment, GPUs claimed per launch.

Races are made deterministic: the stand-in nvidia-smi holds ONE call (fakehost.nvidia_smi.hold), so the first
launch sits inside its preflight, holding its experiment's lock and its GPU claims, for as long as the test
wants; the second launch then really contends, and the test asserts exactly which refusal it gets. Local
target and the fake Proxmox host's container alike.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from fakehost import nvidia_smi
from orchestrator.agent import claims
from orchestrator.errors import PreflightError
from orchestrator.ops.launch import launch, make_run_id
from orchestrator.ops.status import status
from test_launch import SLEEPER, cmd_spec, ct_spec, ct_target, make_ct

pytestmark = pytest.mark.usefixtures("isolated_tmux")

T = dt.datetime(2026, 5, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


class Launcher(threading.Thread):
    """launch() in a thread; result() joins and returns its LaunchResult or raises its error."""

    def __init__(self, target_factory, spec, **kw):
        super().__init__(daemon=True)
        self.target_factory, self.spec, self.kw = target_factory, spec, kw
        self.value = self.error = None
        self.start()

    def run(self) -> None:
        t = self.target_factory()
        try:
            self.value = launch(t, self.spec, **self.kw)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc
        finally:
            t.close()

    def result(self, timeout: float = 120):
        self.join(timeout)
        assert not self.is_alive(), "the launch did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def claims_file(workdir) -> dict:
    return json.loads((Path(workdir) / "locks" / claims.CLAIMS_NAME).read_text())


def holders(workdir) -> dict[str, tuple]:
    return {k: (c["run_id"], c["phase"]) for k, c in claims_file(workdir).items()}


# ------------------------------------------------------------------------------------------- local target


def test_disjoint_gpus_launch_side_by_side_and_the_same_experiment_waits_for_its_lock(local_target, smi):
    t = local_target
    nvidia_smi.hold(smi)
    a = Launcher(lambda: t, cmd_spec("exp-a", SLEEPER, gpus=[0, 1]), now=T)
    nvidia_smi.wait_held(smi)  # a is inside its preflight: its lock taken, GPUs 0 and 1 claimed
    a_id = make_run_id("exp-a", None, T)
    assert holders(t.workdir) == {"0": (a_id, "launch"), "1": (a_id, "launch")}

    b = launch(t, cmd_spec("exp-b", SLEEPER, gpus=[2, 3]))  # another experiment, other GPUs: side by side
    assert a.is_alive()
    # The same experiment again, even on free GPUs: its lock is held across a's WHOLE preflight.
    with pytest.raises(PreflightError) as info:
        launch(t, cmd_spec("exp-a", SLEEPER, tag="again", gpus=[4]))
    assert info.value.agent_type == "LockHeld"
    assert f"another launch of experiment exp-a holds {t.workdir}/locks/exp-a.lock" in info.value.message
    assert f"launching run {a_id}" in info.value.message

    nvidia_smi.release(smi)
    ra = a.result()
    assert ra.run_id == a_id
    assert {r["run_id"]: r["state"] for r in status(t).runs} == {a_id: "running", b.run_id: "running"}
    assert holders(t.workdir) == {"0": (a_id, "run"), "1": (a_id, "run"), "2": (b.run_id, "run"),
                                  "3": (b.run_id, "run")}


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_overlapping_gpus_wait_for_the_preflight_then_are_refused_naming_gpu_and_run(local_target, smi):
    from orchestrator.ops.stop import stop

    t = local_target
    nvidia_smi.hold(smi)
    a = Launcher(lambda: t, cmd_spec("exp-a", SLEEPER, gpus=[0, 1]), now=T)
    nvidia_smi.wait_held(smi)
    a_id = make_run_id("exp-a", None, T)
    events: list[dict] = []
    with pytest.raises(PreflightError) as info:
        launch(t, cmd_spec("exp-b", SLEEPER, gpus=[1, 2]), claim_wait_s=1.0, on_event=events.append)
    assert info.value.agent_type == "GpuClaimed"
    msg = info.value.message
    assert f"GPU 1 is held by run {a_id} (experiment exp-a), launching since" in msg and "GPU 2" not in msg
    assert "(waited 1 s for its preflight)" in msg and f"dflashctl stop {a_id}" in info.value.fix
    assert [e.message for e in events if e.step == "gpus"] == [
        f"GPU 1 is held by run {a_id} (experiment exp-a), launching since {claims_file(t.workdir)['1']['since']} "
        f"(pid {claims_file(t.workdir)['1']['pid']}); waiting up to 1 s for its preflight"]
    assert not (Path(t.workdir) / "runs").exists()  # b made nothing

    nvidia_smi.release(smi)
    a.result()
    # The run holds GPU 1 now: refused at once (no wait for a run), naming it as running.
    with pytest.raises(PreflightError) as info:
        launch(t, cmd_spec("exp-b", SLEEPER, gpus=[1, 2]), claim_wait_s=30)
    assert info.value.agent_type == "GpuClaimed"
    assert info.value.message == f"launch exp-b on local refused: GPU 1 is held by run {a_id} (experiment exp-a), running"
    # The run ends (here: stopped): its claim goes with it.
    stop(t, a_id, grace_s=5)
    b = launch(t, cmd_spec("exp-b", SLEEPER, gpus=[1, 2]))
    assert holders(t.workdir) == {"1": (b.run_id, "run"), "2": (b.run_id, "run")}


def test_a_launch_whose_preflight_fails_releases_its_gpus_to_the_one_waiting(local_target, smi):
    t = local_target
    state = json.loads((smi / ".gpus.json").read_text())
    state["gpus"][0]["memory_used"] = 30000  # a's preflight will refuse: GPU 0 busy
    (smi / ".gpus.json").write_text(json.dumps(state))
    nvidia_smi.hold(smi)
    a = Launcher(lambda: t, cmd_spec("exp-a", SLEEPER, gpus=[0, 1]), now=T)
    nvidia_smi.wait_held(smi)
    waiting = threading.Event()

    def on_event(ev: dict) -> None:
        if ev.step == "gpus" and "waiting up to" in ev.message:
            waiting.set()

    b = Launcher(lambda: t, cmd_spec("exp-b", SLEEPER, gpus=[1]), claim_wait_s=60, on_event=on_event)
    assert waiting.wait(60), "b never waited for a's claim"
    nvidia_smi.release(smi)
    with pytest.raises(PreflightError) as info:
        a.result()
    assert info.value.agent_type == "GpuBusy"
    rb = b.result()
    assert holders(t.workdir) == {"1": (rb.run_id, "run")}


def test_stale_claims_of_dead_launches_and_ended_runs_are_recognised(local_target, smi):
    t = local_target
    gone = subprocess.Popen(["true"])
    gone.wait()
    ended = Path(t.workdir) / "runs" / "old-20260101T000000Z"
    ended.mkdir(parents=True)
    (ended / "run.json").write_text(json.dumps({"experiment": "old", "run_id": ended.name}))
    (ended / "exit.json").write_text(json.dumps({"exit_code": 0, "signal": None}))
    me = claims.this_process()
    stale = {
        "0": {"run_id": "x-20260101T000000Z", "experiment": "x", "phase": "launch", "pid": gone.pid, "pid_start": None},
        # a reused pid: this process exists, but it started long after the claim's launch did
        "1": {"run_id": "y-20260101T000000Z", "experiment": "y", "phase": "launch", "pid": me["pid"], "pid_start": 1.0},
        "2": {"run_id": ended.name, "experiment": "old", "phase": "run"},
        "3": {"run_id": "never-20260101T000000Z", "experiment": "never", "phase": "run"},
        "4": {"run_id": "live-20260101T000000Z", "experiment": "live", "phase": "launch", **me, "since": "then"},
    }
    (Path(t.workdir) / "locks").mkdir()
    (Path(t.workdir) / "locks" / claims.CLAIMS_NAME).write_text(json.dumps(stale))
    res = launch(t, cmd_spec("new", SLEEPER, gpus=[0, 1, 2, 3]))
    assert holders(t.workdir) == {**{str(i): (res.run_id, "run") for i in range(4)},
                                  "4": ("live-20260101T000000Z", "launch")}
    with pytest.raises(PreflightError) as info:  # a live launch (this very process) still holds GPU 4
        launch(t, cmd_spec("other", SLEEPER, gpus=[4]), claim_wait_s=0.3)
    assert info.value.agent_type == "GpuClaimed"
    assert f"GPU 4 is held by run live-20260101T000000Z (experiment live), launching since then (pid {os.getpid()})" \
        in info.value.message


def test_dry_run_names_a_claimed_gpu_without_claiming_or_waiting(local_target, smi):
    t = local_target
    a = launch(t, cmd_spec("exp-a", SLEEPER, gpus=[3]))
    with pytest.raises(PreflightError) as info:
        launch(t, cmd_spec("exp-b", SLEEPER, gpus=[3]), dry_run=True)
    assert info.value.agent_type == "GpuClaimed" and a.run_id in info.value.message
    assert holders(t.workdir) == {"3": (a.run_id, "run")}


# ------------------------------------------------------------------------------------- fake Proxmox host


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_container_claims_disjoint_side_by_side_overlap_refused_same_experiment_locked(fake_pve):
    ct = make_ct(fake_pve, 306)
    smi = ct.dir / "sbin"  # the container's /usr/local/sbin: the stand-in and its GPUs
    try:
        nvidia_smi.hold(smi)
        a = Launcher(lambda: ct_target(fake_pve, ct), ct_spec("cta", SLEEPER, gpus=[0, 1]), now=T)
        nvidia_smi.wait_held(smi)
        a_id = make_run_id("cta", None, T)

        t = ct_target(fake_pve, ct)
        try:
            b = launch(t, ct_spec("ctb", SLEEPER, gpus=[2, 3]))
            with pytest.raises(PreflightError) as overlap:
                launch(t, ct_spec("ctc", SLEEPER, gpus=[1, 4]), claim_wait_s=1.0)
            with pytest.raises(PreflightError) as same:
                launch(t, ct_spec("cta", SLEEPER, tag="again", gpus=[5]))
            assert a.is_alive()
        finally:
            t.close()
        assert overlap.value.agent_type == "GpuClaimed"
        assert f"GPU 1 is held by run {a_id} (experiment cta), launching since" in overlap.value.message
        assert "GPU 4" not in overlap.value.message
        assert same.value.agent_type == "LockHeld" and f"launching run {a_id}" in same.value.message

        nvidia_smi.release(smi)
        assert a.result().run_id == a_id
        assert holders(ct.workdir) == {"0": (a_id, "run"), "1": (a_id, "run"), "2": (b.run_id, "run"),
                                       "3": (b.run_id, "run")}
        assert sorted(p.name for p in (Path(ct.workdir) / "runs").iterdir()) == sorted([a_id, b.run_id])
    finally:
        nvidia_smi.release(smi)
        fake_pve.remove_container(306)
