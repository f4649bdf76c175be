"""launch: preflight refusals, the run directory, tmux sessions that outlive the connection, idempotence
and concurrency, --replace, --dry-run; on a local target and on the fake Proxmox host (real sshd, pct
stand-in, namespaced containers, real tmux)."""

from __future__ import annotations

import datetime
import json
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator import assets
from orchestrator.agent import launchlock
from orchestrator.agent.requests import LaunchRequest
from orchestrator.agent.runcommand import build_command, run_environment
from orchestrator.errors import PreflightError, UserError
from orchestrator.ops.launch import LaunchSpec, launch, make_run_id
from orchestrator.ops.status import status
from orchestrator.records import load_records
from orchestrator.target import ContainerTarget
from fakehost import STOCK_TMUX, nvidia_smi

# A command that stops cleanly on SIGINT (like a trainer saving a checkpoint), else runs for a minute.
SLEEPER = [sys.executable, "-c", "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('bye', flush=True)\n"]
CT_SLEEPER = ["python3", *SLEEPER[1:]]  # in a stock container: its own python3 (the workstation's is not there)
HOSTILE_TAGS = ["../x", "a;b", "$(id)", "has space", "a/b", "", "..", "x" * 65, "`id`", "-rf"]


# Own tmux server and run records per test (conftest.py).
pytestmark = [pytest.mark.usefixtures("isolated_tmux"), pytest.mark.slow]


def cmd_spec(experiment: str, argv: list[str], **kw) -> LaunchSpec:
    return LaunchSpec(experiment=experiment, kind="command", target=kw.pop("target", "local"), command=argv,
                      venv_profile=kw.pop("venv_profile", {"kind": "workstation"}), **kw)


def wait_exit(run_dir: str, timeout: float = 30) -> dict:
    path = Path(run_dir) / "exit.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear in {timeout} s")


# ------------------------------------------------------------------------------------------- pure parts


def test_run_id_is_experiment_tag_and_utc_stamp():
    import datetime as dt

    t = dt.datetime(2026, 3, 4, 5, 6, 7, tzinfo=dt.timezone.utc)
    assert make_run_id("exp-1", "try.2", t) == "exp-1-try.2-20260304T050607Z"
    assert make_run_id("exp-1", None, t) == "exp-1-20260304T050607Z"


def req(kind: str, **kw) -> LaunchRequest:
    return LaunchRequest(experiment="e", run_id="e-1", kind=kind, **kw)


def test_build_command_for_both_kinds(tmp_path):
    run = tmp_path / "runs" / "r1"
    argv, env = build_command(req("command", command=["python", "train.py"], env={"A": "1"}), [5, 6, 7], run)
    assert argv == ["python", "train.py"]
    assert env["CUDA_VISIBLE_DEVICES"] == "5,6,7" and env["A"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert "DFLASHCTL_RESUME_DIR" not in env
    _, env = build_command(req("command", command=["x"]), [], run, resume_dir=tmp_path / "runs" / "old")
    assert env["DFLASHCTL_RESUME_DIR"] == str(tmp_path / "runs" / "old")

    cfg = {"compile": {"cache_dir": "/w/inductor-cache"}}
    argv, env = build_command(req("dflash", config=cfg), [], run)
    assert argv == [sys.executable, "-m", "trainer.launch", "--config", str(run / "config.json")]
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # the colocated CPU layout sees no GPU
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/w/inductor-cache"
    argv, env = build_command(req("dflash"), [0, 1, 5, 6], run, cfg, resume_dir=run)
    assert argv[-4:] == ["--config", str(run / "config.json"), "--resume", str(run)]
    # A GPU layout: trainer.launch gives every rank its own GPU; the launcher gets no GPU list at all.
    assert "CUDA_VISIBLE_DEVICES" not in env and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_run_environment_drops_an_inherited_gpu_list_for_gpu_layouts(tmp_path):
    base = {"CUDA_VISIBLE_DEVICES": "3", "TMUX": "/tmp/t,1,0", "HOME": "/root"}
    env = run_environment(base, build_command(req("dflash"), [0, 5], tmp_path)[1], "dflash", [0, 5])
    assert "CUDA_VISIBLE_DEVICES" not in env and "TMUX" not in env and env["HOME"] == "/root"
    assert run_environment(base, build_command(req("dflash"), [], tmp_path)[1], "dflash", [])["CUDA_VISIBLE_DEVICES"] == ""
    extra = build_command(req("command", command=["x"]), [], tmp_path)[1]
    assert run_environment(base, extra, "command", [])["CUDA_VISIBLE_DEVICES"] == "3"


def test_inventory_layout_is_written_into_the_trainer_config():
    from orchestrator.inventory import parse_inventory
    from orchestrator.ops.launch import spec_from_inventory

    inv = load_text_inventory()
    spec = spec_from_inventory(inv, "exp-ddtree-expanded")
    assert spec.config["layout"]["target_gpus"] == [0, 1, 2, 3, 4]
    assert spec.config["layout"]["drafter_gpus"] == [5, 6, 7]
    assert spec.config["layout"]["timeout_s"] == 900  # the trainer section's own layout keys stay
    assert spec.gpus == [0, 1, 2, 3, 4, 5, 6, 7]
    tiny = spec_from_inventory(inv, "tiny")
    assert tiny.config["layout"]["target_gpus"] == [] and tiny.config["compile"]["cache_dir"] is None

    text = Path(_embedded()).read_text().replace("      gamma: 10.0\n", "      gamma: 10.0\n      layout: {target_gpus: [0, 1, 2, 3, 4], drafter_gpus: [9]}\n")
    with pytest.raises(UserError) as info:
        spec_from_inventory(parse_inventory(text), "exp-ddtree-expanded")
    assert "trainer.layout.drafter_gpus [9] differs from layout.drafter_gpus [5, 6, 7]" in info.value.message
    assert "experiments.exp-ddtree-expanded.layout" in info.value.fix


def load_text_inventory():
    from orchestrator.inventory import load_inventory

    return load_inventory(_embedded())


@pytest.mark.parametrize("tag", HOSTILE_TAGS)
def test_hostile_tags_never_reach_the_target(tag):
    class Refuse:
        name = "refuse"

        def agent(self, *a, **k):  # pragma: no cover - reaching it is the failure
            raise AssertionError("the target was contacted")

    with pytest.raises(UserError, match="bad tag name"):
        launch(Refuse(), cmd_spec("e", ["true"], tag=tag))


# ------------------------------------------------------------------------------------------- local target


def test_local_launch_success_and_failure_end_in_exit_json_and_status(tmp_path, local_target):
    t = local_target
    ok = launch(t, cmd_spec("ok", ["bash", "-c", "echo hi; exit 0"]), cli="dflashctl launch ok")
    bad = launch(t, cmd_spec("bad", ["bash", "-c", "echo no >&2; exit 7"]))
    assert wait_exit(ok.run_dir)["exit_code"] == 0
    assert wait_exit(bad.run_dir)["exit_code"] == 7
    info = json.loads((Path(ok.run_dir) / "run.json").read_text())
    assert info["experiment"] == "ok" and info["session"] == "dflash-ok" and info["cli"] == "dflashctl launch ok"
    assert info["command_line"] == "bash -c 'echo hi; exit 0'" and info["bundle_hash"]
    assert "hi\n" in (Path(ok.run_dir) / "train.log").read_text()
    states = {r["run_id"]: r["state"] for r in status(t).runs}
    assert states == {ok.run_id: "succeeded", bad.run_id: "failed"}
    assert [r["run_id"] for r in load_records()] == [ok.run_id, bad.run_id]


def test_double_launch_is_refused_with_the_run_id_and_the_replace_hint(tmp_path, local_target):
    t = local_target
    first = launch(t, cmd_spec("dbl", SLEEPER))
    with pytest.raises(PreflightError) as info:
        launch(t, cmd_spec("dbl", SLEEPER, tag="again"))
    assert first.run_id in info.value.message and "--replace" in info.value.fix
    assert info.value.agent_type == "SessionExists"
    assert sorted(p.name for p in (Path(t.workdir) / "runs").iterdir()) == [first.run_id]


def test_a_held_lock_names_its_holder(tmp_path, local_target):
    t = local_target
    lock = launchlock.LaunchLock(t.workdir, "lk")
    lock.acquire({"pid": 4242, "run_id": "lk-20260101T000000Z", "since": "2026-01-01T00:00:00Z"})
    try:
        with pytest.raises(PreflightError) as info:
            launch(t, cmd_spec("lk", ["true"]))
        other = launch(t, cmd_spec("other", ["true"]))  # another experiment's launch takes its own lock
    finally:
        lock.release()
    assert info.value.agent_type == "LockHeld" and "experiment lk" in info.value.message
    assert "pid 4242" in info.value.message and "lk-20260101T000000Z" in info.value.message
    assert "since 2026-01-01T00:00:00Z" in info.value.message
    assert [p.name for p in (Path(t.workdir) / "runs").iterdir()] == [other.run_id]


def test_two_concurrent_launches_make_exactly_one_run(tmp_path, local_target, smi):
    """Both launches really contend: the first is held inside its preflight (its one nvidia-smi call waits)
    while the second starts, so the second must meet the first's lock (LockHeld), not a session that exists
    by then. Once the first has launched, a third meets its session (SessionExists)."""
    from test_launch_claims import Launcher

    t = local_target
    nvidia_smi.hold(smi)
    first = Launcher(lambda: t, cmd_spec("race", SLEEPER, tag="a", gpus=[0]))
    nvidia_smi.wait_held(smi)
    with pytest.raises(PreflightError) as second:
        launch(t, cmd_spec("race", SLEEPER, tag="b", gpus=[1]))
    assert second.value.agent_type == "LockHeld"
    assert f"another launch of experiment race holds {t.workdir}/locks/race.lock" in second.value.message
    assert not (Path(t.workdir) / "runs").exists()  # the refused launch made nothing
    nvidia_smi.release(smi)
    won = first.result()
    with pytest.raises(PreflightError) as third:
        launch(t, cmd_spec("race", SLEEPER, tag="c", gpus=[1]))
    assert third.value.agent_type == "SessionExists" and won.run_id in third.value.message
    assert [p.name for p in (Path(t.workdir) / "runs").iterdir()] == [won.run_id]


def test_replace_stops_the_old_run_gracefully_and_launches(tmp_path, local_target):
    t = local_target
    old = launch(t, cmd_spec("rep", SLEEPER))
    time.sleep(0.5)  # let python install its SIGINT handler
    events: list[dict] = []
    new = launch(t, cmd_spec("rep", SLEEPER, tag="v2"), replace=True, grace_s=5, on_event=events.append)
    assert new.replaced == old.run_id
    ex = json.loads((Path(old.run_dir) / "exit.json").read_text())  # written before the new run started
    # SIGINT was enough: the command caught it, cleaned up (its output is in the log) and exited 0.
    assert (ex["exit_code"], ex["signal"]) == (0, None) and "bye" in (Path(old.run_dir) / "train.log").read_text()
    assert any(e.step == "stop" and "SIGINT" in e.message for e in events)
    states = {r["run_id"]: r["state"] for r in status(t).runs}
    assert states == {old.run_id: "stopped", new.run_id: "running"}  # stopped by the replace, exit 0 or not
    assert ex["stopped"]["via"] == "dflashctl launch rep --replace"


def test_dry_run_plans_and_changes_nothing(tmp_path, local_target):
    t = local_target
    res = launch(t, cmd_spec("dry", ["python", "x.py"], gpus=[]), dry_run=True)
    assert res.dry_run and res.plan["tmux"][:5] == ["tmux", "new-session", "-d", "-s", "dflash-dry"]
    assert res.command == ["python", "x.py"] and res.run_dir.endswith(res.run_id)
    assert not (Path(t.workdir) / "runs").exists() and not (Path(t.workdir) / "locks").exists()
    assert status(t).sessions == [] and load_records() == []


def test_the_launch_executes_exactly_the_plan_its_dry_run_showed(tmp_path, local_target, smi):
    """--dry-run and the launch make their decisions in one place (orchestrator.agent.preflight.plan): with
    the workstation's run id taken already, a live run to replace and GPUs to claim, the launch makes the
    very run id, directory, session, command, environment and files its dry run showed, and its session
    runs the plan's tmux command line."""
    import datetime as dt
    import shlex

    from orchestrator.agent import tmuxctl

    t = local_target
    now = dt.datetime(2026, 5, 6, 7, 8, 9, tzinfo=dt.timezone.utc)
    old = launch(t, cmd_spec("same", SLEEPER, gpus=[1]))  # the live run both replace
    taken = Path(t.workdir) / "runs" / make_run_id("same", "b", now)
    taken.mkdir()  # a clash: the plan takes the next free run id
    spec = cmd_spec("same", SLEEPER, tag="b", gpus=[0, 1], env={"MINE": "x y"})
    plan = launch(t, spec, replace=True, dry_run=True, now=now)
    assert plan.run_id == taken.name + "-2" and plan.replaced == old.run_id and plan.plan["warmup"] == []
    res = launch(t, spec, replace=True, grace_s=5, now=now)
    assert (res.run_id, res.run_dir, res.session, res.command, res.gpus, res.replaced, res.resumed_from) == (
        plan.run_id, plan.run_dir, plan.session, plan.command, plan.gpus, plan.replaced, plan.resumed_from)
    run = Path(res.run_dir)
    assert all(Path(f).is_file() for f in plan.plan["files"])
    info = json.loads((run / "run.json").read_text())
    assert (info["run_id"], info["command"], info["gpus"], info["env_keys"]) == (
        plan.run_id, plan.command, plan.gpus, plan.plan["env_keys"])
    env = dict(e.split("=", 1) for e in (run / "launch.env0").read_text().split("\0") if e)
    assert set(plan.plan["env_keys"]) <= set(env) and env["MINE"] == "x y"
    assert {k: env[k] for k in plan.plan["env"]} == plan.plan["env"]
    pane = tmuxctl.find_session(plan.session)["pane_pid"]
    assert Path(f"/proc/{pane}/cmdline").read_bytes().split(b"\0")[:-1] == [
        a.encode() for a in shlex.split(plan.plan["tmux"][-1])]


def test_a_finished_session_does_not_block_the_next_launch(tmp_path, local_target):
    t = local_target
    first = launch(t, cmd_spec("fin", ["true"]))
    wait_exit(first.run_dir)
    second = launch(t, cmd_spec("fin", ["true"], tag="two"))
    wait_exit(second.run_dir)
    states = {r["run_id"]: r["state"] for r in status(t).runs}
    assert states == {first.run_id: "succeeded", second.run_id: "succeeded"}


def test_dflash_launch_of_the_embedded_tiny_experiment_starts_the_real_trainer(tmp_path, local_target):
    from orchestrator.inventory import load_inventory
    from orchestrator.ops.launch import spec_from_inventory
    from orchestrator.ops.stop import stop
    from trainer.config import load_config

    spec = spec_from_inventory(load_inventory(_embedded()), "tiny", tag="t")
    t = local_target
    events: list[dict] = []
    res = launch(t, spec, on_event=events.append)
    layout = [e for e in events if e.step == "layout"]
    assert [e.message for e in layout] == ["colocated: target and drafter in one CPU process"]
    assert not any("warn" in e.message.lower() for e in events)
    run = Path(res.run_dir)
    cfg = load_config(run / "config.json")  # the trainer's own loader accepts what launch wrote
    assert cfg.output_dir == str(run) and cfg.model.block_size == spec.config["model"]["block_size"]
    assert res.command[1:] == ["-m", "trainer.launch", "--config", str(run / "config.json")]
    # The persistent inductor cache of the target, unless the experiment names one.
    assert cfg.compile.cache_dir == str(Path(t.workdir) / "inductor-cache") and Path(cfg.compile.cache_dir).is_dir()
    env = dict(e.split("=", 1) for e in (run / "launch.env0").read_text().split("\0") if e)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == cfg.compile.cache_dir and env["CUDA_VISIBLE_DEVICES"] == ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "tiny target" not in (run / "train.log").read_text():
        time.sleep(0.2)
    assert "tiny target" in (run / "train.log").read_text()  # the bundled trainer runs in the session
    out = stop(t, res.run_id, grace_s=10)
    assert out.exit is not None and out.signals[0] == "SIGINT"


def test_warmup_argv_golden(tmp_path):
    from orchestrator.agent.warmup import warmup_argv

    assert warmup_argv("/v/bin/python", tmp_path / "config.json") == [
        "/v/bin/python", "-m", "trainer.warmup", "--config", str(tmp_path / "config.json"), "--device", "cuda"]


def test_warm_up_runs_the_trainer_warmup_per_drafter_gpu_and_streams_events(tmp_path, tiny_cache):
    import io
    import os

    from orchestrator.agent.preflight import warmup_targets
    from orchestrator.agent.protocol import Emitter
    from orchestrator.agent.verbs.launch import warm_up
    from orchestrator.bundle import source_root
    from orchestrator.inventory import load_inventory
    from orchestrator.ops.launch import spec_from_inventory

    spec = spec_from_inventory(load_inventory(_embedded()), "tiny")
    # The sizes are not the point here (the processes, their GPUs and the events are): the small tiny target of
    # the resume test below (one build in the session's cache, not the 1024-prompt one) and small steps.
    _small_tiny(spec.config)
    run = tmp_path / "run"
    run.mkdir()
    config = {**spec.config, "output_dir": str(run)}
    (run / "config.json").write_text(json.dumps(config))
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": str(source_root()), "DFLASH_TINY_CACHE": str(tiny_cache)}
    targets, skipped = warmup_targets({"target_gpus": [0], "drafter_gpus": [1, 2]}, config)
    assert (targets, skipped) == ([1, 2], None)
    # device cpu: this machine has no GPU; the per-GPU process, CUDA_VISIBLE_DEVICES and streaming are real.
    done = warm_up(run, targets, skipped, config, env, Emitter(out), device="cpu")
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [d["gpu"] for d in done] == [1, 2] and all(d["device"] == "cpu" for d in done)
    assert [e["gpu"] for e in events if "warm in" in e["message"]] == [1, 2]
    assert json.loads((run / "warmup.json").read_text()) == done

    # A warm-up that fails ends the run before any session: exit.json says so, the error names the GPU.
    (run / "config.json").write_text(json.dumps({"no_such_key": 1}))
    from orchestrator.agent.protocol import AgentFailure

    with pytest.raises(AgentFailure) as info:
        warm_up(run, [4], None, config, env, Emitter(io.StringIO()), device="cpu")
    assert info.value.type == "WarmupFailed" and "GPU 4" in info.value.message and "no_such_key" in info.value.message
    assert json.loads((run / "exit.json").read_text())["phase"] == "warmup"


def _small_tiny(config: dict) -> None:
    """Shrink the embedded tiny experiment's trainer config in place to the sizes of
    tests/trainer/test_trainer_launch.py: a small tiny target, one draft layer, 4 short rows per step."""
    config["model"].update(num_draft_layers=1, tiny_target={**config["model"]["tiny_target"], "num_prompts": 40,
                                                            "held_out": 4, "response_tokens": 24})
    config["data"].update(max_len=64, token_budget=256, max_batch_size=4, num_anchors=8)


def _embedded() -> str:
    """The packaged default inventory (the embedded default's text)."""
    return str(assets.on_disk("inventory.yaml"))


# ------------------------------------------------------------------------------------- fake Proxmox host


def make_ct(fake_pve, ctid: int, lock_hash: str = "L1", gpus: int = 8, venv: Path | None = None,
            network: bool = False):
    """A stock container (Debian 12, tmux installed) with a 'venv': the container's own python3 (the agent
    needs only the standard library) fingerprinted as lock_hash, or `venv`, a real one (stock_cpu_venv).
    `network`: the host's network (nodes of one run must reach each other's rendezvous over TCP)."""
    ct = fake_pve.create_container(ctid, gpus=gpus, image=STOCK_TMUX, network=network)
    (Path(ct.workdir) / "venvs").mkdir()
    if venv is not None:
        (Path(ct.workdir) / "venvs" / "current").symlink_to(venv)
        ct.to_container(Path(ct.workdir) / "venvs")
        return ct
    venv = Path(ct.workdir) / "venvs" / f"{lock_hash}-0"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    (venv / "dflashctl-fingerprint.json").write_text(json.dumps({"lock_hash": lock_hash, "packages": {}}))
    (Path(ct.workdir) / "venvs" / "current").symlink_to(venv.name)
    ct.to_container(Path(ct.workdir) / "venvs")  # made by the host's root: give it to the container's root
    return ct


def ct_target(fake_pve, ct) -> ContainerTarget:
    return ContainerTarget(name=f"ct{ct.ctid}", workdir=ct.workdir, transport=fake_pve.pct_transport(ct.ctid))


def ct_spec(experiment: str, argv: list[str], **kw) -> LaunchSpec:
    return cmd_spec(experiment, argv, target="ct", venv_profile={"kind": "uv"}, lock_hash=kw.pop("lock_hash", "L1"), **kw)


def test_container_run_outlives_ssh_and_reports_its_exit(fake_pve):
    ct = make_ct(fake_pve, 301)
    try:
        t = ct_target(fake_pve, ct)
        ok = launch(t, ct_spec("cok", ["bash", "-c", "sleep 1.5; echo done"]))
        bad = launch(t, ct_spec("cbad", ["bash", "-c", "sleep 1.5; exit 4"]))
        t.close()  # the SSH connection is gone; the sessions live on in the container
        alive = ct.exec(["tmux", "has-session", "-t", "=dflash-cok"])
        assert alive.returncode == 0, alive.stderr
        assert wait_exit(ok.run_dir)["exit_code"] == 0 and wait_exit(bad.run_dir)["exit_code"] == 4
        t = ct_target(fake_pve, ct)
        st = status(t)
        t.close()
        assert st.state == "running" and len(st.gpus) == 8
        assert {r["run_id"]: r["state"] for r in st.runs} == {ok.run_id: "succeeded", bad.run_id: "failed"}
    finally:
        fake_pve.remove_container(301)


def test_container_busy_gpu_is_named_and_nothing_is_started(fake_pve):
    ct = make_ct(fake_pve, 302)
    try:
        ct.set_gpu_used(5, 30000)
        t = ct_target(fake_pve, ct)
        with pytest.raises(PreflightError) as info:
            launch(t, ct_spec("busy", ["true"], gpus=[4, 5], gpu_idle_mib=1024))
        t.close()
        assert info.value.agent_type == "GpuBusy"
        assert "GPU 5 uses 30000 MiB" in info.value.message and "GPU 4" not in info.value.message
        assert info.value.data["busy"][0]["index"] == 5
        assert not (Path(ct.workdir) / "runs").exists()
    finally:
        fake_pve.remove_container(302)


def test_container_venv_mismatch_is_refused(fake_pve):
    ct = make_ct(fake_pve, 303, lock_hash="oldlock")
    try:
        t = ct_target(fake_pve, ct)
        with pytest.raises(PreflightError) as info:
            launch(t, ct_spec("vm", ["true"], lock_hash="newlock"))
        t.close()
        assert info.value.agent_type == "VenvMismatch" and "oldlock" in info.value.message
        assert "rebuild-venv" in info.value.fix
    finally:
        fake_pve.remove_container(303)


def test_container_launch_on_gpus_refuses_a_driver_too_old_for_the_venvs_torch(fake_pve, claim_cuda_venv):
    ct = make_ct(fake_pve, 306)
    ct.set_driver("550.54.15", "12.4")
    ct.set_kernel_module("550.54.15")
    claim_cuda_venv(ct.workdir, torch="2.13.0", cuda="13.0")  # PyPI's torch 2.13.0: a CUDA 13.0 build
    try:
        t = ct_target(fake_pve, ct)
        spec = ct_spec("drv", ["true"], gpus=[0, 1])  # a uv profile: its lock is the default, cuda
        with pytest.raises(PreflightError) as info:
            launch(t, spec)
        assert info.value.agent_type == "DriverTooOld"
        assert info.value.message == (
            "launch drv on ct refused: the venv's torch 2.13.0 is built for CUDA 13.0, but the NVIDIA driver "
            "550.54.15 runs CUDA 12.4 at most (CUDA 13.x needs driver >= 580)")
        assert "dflashctl lock cuda --extra-index-url https://download.pytorch.org/whl/cu126" in info.value.fix
        assert "--target ct" in info.value.fix and info.value.data["gpus"] == [0, 1]
        assert not (Path(ct.workdir) / "runs").exists()  # refused before anything was written
        with pytest.raises(PreflightError) as dry:
            launch(t, spec, dry_run=True)
        assert dry.value.agent_type == "DriverTooOld"
        # The same torch on a driver that runs CUDA 13, and a run without GPUs on the old one, start.
        ct.set_driver("580.65.06", "13.0")
        ct.set_kernel_module("580.65.06")
        assert wait_exit(launch(t, spec).run_dir)["exit_code"] == 0
        ct.set_driver("550.54.15", "12.4")
        ct.set_kernel_module("550.54.15")
        assert wait_exit(launch(t, ct_spec("cpu-only", ["true"], gpus=[])).run_dir)["exit_code"] == 0
        t.close()
    finally:
        fake_pve.remove_container(306)


def test_container_launch_refuses_a_driver_library_kernel_module_mismatch(fake_pve, dflashctl, tmp_path):
    ct = make_ct(fake_pve, 307)
    ct.set_driver("550.54.15", "12.4")   # the container's libraries
    ct.set_kernel_module("570.133.20")   # the host's module after a host upgrade
    inv = {
        "hosts": {"pve": fake_pve.host_entry()},
        "targets": {"ct": {"kind": "container", "host": "pve", "ctid": 307, "workdir": ct.workdir, "venv": "gpu"}},
        "venvs": {"gpu": {"kind": "uv", "lock": "cuda"}},
        "experiments": {"mm": {"kind": "command", "target": "ct", "gpus": [2], "command": ["true"]}},
    }
    (tmp_path / "inv.yaml").write_text(json.dumps(inv))
    try:
        res = dflashctl("-i", str(tmp_path / "inv.yaml"), "launch", "mm")
        out = " ".join((res.stdout + res.stderr).split())
        assert res.returncode == 1, out
        assert "launch mm on ct refused: the container's libnvidia-ml 550.54 does not match the host's NVIDIA " \
               "kernel module 570.133.20" in out
        assert "sh NVIDIA-Linux-x86_64-570.133.20.run --no-kernel-modules" in out
        assert "Traceback" not in out and not (Path(ct.workdir) / "runs").exists()
    finally:
        fake_pve.remove_container(307)


def test_container_launch_is_one_pct_exec_and_hostile_tags_make_none(pve):
    ct = make_ct(pve, 304)
    try:
        t = ct_target(pve, ct)
        t.agent("echo")  # first contact (bundle inline); from then on a launch is one exec
        pve.clear_pct_calls()
        for tag in HOSTILE_TAGS:
            with pytest.raises(UserError):
                launch(t, ct_spec("h", ["true"], tag=tag))
        assert pve.pct_calls() == []
        res = launch(t, ct_spec("one", ["true"]))
        assert len(pve.pct_exec_calls(304)) == 1
        t.close()
        assert wait_exit(res.run_dir)["exit_code"] == 0
    finally:
        pve.remove_container(304)


def test_container_concurrent_launches_one_wins_and_replace_waits_for_gpus(fake_pve):
    from test_launch_claims import Launcher

    ct = make_ct(fake_pve, 305)
    try:
        # The first launch is held inside its preflight (the container's nvidia-smi holds its call) while the
        # second runs: the second meets the first's lock, exactly; then a third meets the first's session.
        smi = ct.dir / "sbin"
        nvidia_smi.hold(smi)
        first = Launcher(lambda: ct_target(fake_pve, ct), ct_spec("conc", CT_SLEEPER, tag="a", gpus=[1]))
        nvidia_smi.wait_held(smi)
        t = ct_target(fake_pve, ct)
        try:
            with pytest.raises(PreflightError) as second:
                launch(t, ct_spec("conc", CT_SLEEPER, tag="b", gpus=[1]))
            nvidia_smi.release(smi)
            old = first.result()
            with pytest.raises(PreflightError) as third:
                launch(t, ct_spec("conc", CT_SLEEPER, tag="b", gpus=[1]))
        finally:
            nvidia_smi.release(smi)
            t.close()
        assert second.value.agent_type == "LockHeld" and "launching run conc-a-" in second.value.message
        assert third.value.agent_type == "SessionExists" and old.run_id in third.value.message
        assert [p.name for p in (Path(ct.workdir) / "runs").iterdir()] == [old.run_id]

        # The old run "holds" GPU 1 until a moment after it exits; --replace must wait for the release.
        ct.set_gpu_used(1, 20000)

        def release() -> None:
            wait_exit(old.run_dir, 60)
            time.sleep(1.0)
            ct.set_gpu_used(1, 0)

        releaser = threading.Thread(target=release)
        releaser.start()
        events: list[dict] = []
        t = ct_target(fake_pve, ct)
        new = launch(t, ct_spec("conc", CT_SLEEPER, tag="c", gpus=[1]), replace=True, grace_s=5, on_event=events.append)
        t.close()
        releaser.join(60)
        assert new.replaced == old.run_id
        assert json.loads((Path(old.run_dir) / "exit.json").read_text())["exit_code"] == 0
        assert "bye" in (Path(old.run_dir) / "train.log").read_text()
        assert any(e.step == "gpus" and "waiting" in e.message for e in events)
    finally:
        fake_pve.remove_container(305)


# ------------------------------------------------------------------------------------------- --resume


def _train_rows(run: Path) -> list[dict]:
    from trainer.metrics import read_metrics

    return [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]


def test_resume_continues_the_last_complete_checkpoint_in_a_new_run(tmp_path, local_target, tiny_cache, monkeypatch):
    """The tiny trainer, shrunk to 6 steps with a checkpoint every 2: run A ends; its newest checkpoint is
    removed (as if A died between the step-4 save and the end); B = `--resume A` is a new run that starts
    at step 4 with A's config and trains steps 5-6 exactly as A did."""
    import shutil

    from orchestrator.inventory import load_inventory
    from orchestrator.ops.launch import spec_from_inventory

    inv = load_inventory(_embedded())
    spec = spec_from_inventory(inv, "tiny", tag="a")
    spec.config.update(max_steps=6, save_every=2, log_every=1, keep_checkpoints=2)
    _small_tiny(spec.config)
    monkeypatch.setenv("DFLASH_TINY_CACHE", str(tiny_cache))  # the runs (local target: this environment) build it once
    t = local_target
    a = launch(t, spec)
    assert wait_exit(a.run_dir, 240)["exit_code"] == 0, (Path(a.run_dir) / "train.log").read_text()[-3000:]
    a_dir = Path(a.run_dir)
    assert sorted(p.name for p in (a_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    shutil.rmtree(a_dir / "checkpoints" / "step_00000006")

    # The inventory's config now says something else: the resumed run must use A's.
    other = spec_from_inventory(inv, "tiny", tag="b")
    events: list[dict] = []
    b = launch(t, other, resume=a.run_id, on_event=events.append)
    b_dir = Path(b.run_dir)
    assert b.run_id != a.run_id and b.resumed_from == a.run_id
    assert b.command[1:] == ["-m", "trainer.launch", "--config", str(b_dir / "config.json"), "--resume", str(b_dir)]
    assert any(e.step == "resume" and "step 4" in e.message for e in events)
    info = json.loads((b_dir / "run.json").read_text())
    assert (info["resumed_from"], info["resumed_step"]) == (a.run_id, 4)
    cfg_a, cfg_b = (json.loads((d / "config.json").read_text()) for d in (a_dir, b_dir))
    assert cfg_b == {**cfg_a, "output_dir": str(b_dir)}
    assert load_records()[-1]["resumed_from"] == a.run_id and load_records()[-1]["config"]["max_steps"] == 6
    assert wait_exit(b.run_dir, 240)["exit_code"] == 0, (b_dir / "train.log").read_text()[-3000:]

    log = (b_dir / "train.log").read_text()
    assert "resumed from step 4" in log
    rows_a, rows_b = _train_rows(a_dir), _train_rows(b_dir)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4, 5, 6]  # the history up to 4 carried over, 5-6 new
    for ra, rb in zip(rows_a, rows_b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), (ra["step"], ra["loss"], rb["loss"])
    assert (b_dir / "checkpoints" / "step_00000006" / "meta.json").exists()
    # The old run is untouched: its metrics were copied, not linked, and it did not get B's checkpoint.
    assert _train_rows(a_dir) == rows_a and not (a_dir / "checkpoints" / "step_00000006").exists()
    states = {r["run_id"]: r["state"] for r in status(t).runs}
    assert states == {a.run_id: "succeeded", b.run_id: "succeeded"}


def test_resume_refusals_name_the_run_and_the_fix(tmp_path, local_target):
    from orchestrator.ops.launch import LaunchSpec

    t = local_target
    ok = launch(t, cmd_spec("rc", ["true"]))
    wait_exit(ok.run_dir)
    tiny = LaunchSpec(experiment="rc", kind="dflash", target="local", config={}, layout={},
                      venv_profile={"kind": "workstation"})
    with pytest.raises(PreflightError) as info:
        launch(t, cmd_spec("other", ["true"]), resume=ok.run_id)
    assert info.value.agent_type == "ResumeMismatch" and "belongs to experiment 'rc'" in info.value.message
    assert f"dflashctl launch rc --resume {ok.run_id}" in info.value.fix
    with pytest.raises(PreflightError) as info:
        launch(t, cmd_spec("rc", ["true"]), resume="rc-19990101T000000Z")
    assert info.value.agent_type == "ResumeNotFound"
    # A dflash run without a checkpoint (here: run.json says dflash, nothing was saved).
    dead = Path(t.workdir) / "runs" / "rc-dflash"
    dead.mkdir()
    (dead / "run.json").write_text(json.dumps({"experiment": "rc", "kind": "dflash"}))
    (dead / "config.json").write_text(json.dumps({"save_every": 200}))
    with pytest.raises(PreflightError) as info:
        launch(t, tiny, resume="rc-dflash")
    assert info.value.agent_type == "NothingToResume" and "no complete checkpoint" in info.value.message
    assert "save_every is 200" in info.value.message and "without --resume" in info.value.fix
    with pytest.raises(UserError):
        launch(t, cmd_spec("rc", ["true"]), resume="../x")
    assert sorted(p.name for p in (Path(t.workdir) / "runs").iterdir()) == [ok.run_id, "rc-dflash"]


def test_resume_of_a_command_run_passes_the_old_run_dir(tmp_path, local_target):
    t = local_target
    first = launch(t, cmd_spec("cr", ["true"]))
    wait_exit(first.run_dir)
    second = launch(t, cmd_spec("cr", ["bash", "-c", 'echo "from=$DFLASHCTL_RESUME_DIR"']), resume=first.run_id)
    assert wait_exit(second.run_dir)["exit_code"] == 0
    assert f"from={first.run_dir}\n" in (Path(second.run_dir) / "train.log").read_text()
    plan = launch(t, cmd_spec("cr", ["true"]), resume=first.run_id, dry_run=True)
    assert plan.plan["env"]["DFLASHCTL_RESUME_DIR"] == first.run_dir and plan.resumed_from == first.run_id


def test_container_dflash_gpu_layout_warms_each_drafter_gpu_and_trainer_launch_gives_each_rank_its_gpu(pve, stock_cpu_venv):
    """A 1 target + 2 drafter GPU layout on the fake host, in one pct exec: the inventory layout lands in
    config.json, each drafter GPU is warmed in turn, and trainer.launch starts one process per GPU with that
    GPU visible. (This box has no GPU: the warm-ups run with --device cpu on a shape-only target, and the
    ranks then fail on their missing CUDA device, which ends the run with a failed exit.json naming the rank.)"""
    from transformers import Qwen3Config

    from trainer.config import parse_config

    venv, cpu_lock = stock_cpu_venv
    ct = make_ct(pve, 306, venv=venv)
    try:
        model = Path(ct.workdir) / "model"
        Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16).save_pretrained(model)
        layout = {"target_gpus": [3], "drafter_gpus": [5, 6]}
        config = parse_config({
            "model": {"target": str(model), "block_size": 4, "num_draft_layers": 1, "num_target_features": 1},
            "data": {"max_len": 32, "token_budget": 64, "max_batch_size": 2, "num_anchors": 4},
            "layout": {**layout, "timeout_s": 30},
        }).model_dump(mode="json")
        spec = LaunchSpec(experiment="gl", kind="dflash", target="ct", config=config, layout=layout, gpus=[3, 5, 6],
                          venv_profile={"kind": "uv"}, lock_hash=cpu_lock)
        t = ct_target(pve, ct)
        now = datetime.datetime.now(datetime.timezone.utc)
        plan = launch(t, spec, dry_run=True, now=now)  # the plan the launch then executes, warm-ups included
        assert plan.plan["warmup"] == [5, 6] and "CUDA_DEVICE_ORDER" in plan.plan["env_keys"]
        pve.clear_pct_calls()
        events: list[dict] = []
        res = launch(t, spec, on_event=events.append, warmup_device="cpu", now=now)
        assert len(pve.pct_exec_calls(306)) == 1
        t.close()
        run = Path(res.run_dir)
        assert (res.run_id, res.run_dir, res.command, res.gpus) == (plan.run_id, plan.run_dir, plan.command, plan.gpus)
        assert json.loads((run / "run.json").read_text())["env_keys"] == plan.plan["env_keys"]
        assert res.command[1:] == ["-m", "trainer.launch", "--config", str(run / "config.json")]
        written = json.loads((run / "config.json").read_text())
        assert (written["layout"]["target_gpus"], written["layout"]["drafter_gpus"]) == ([3], [5, 6])
        assert written["compile"]["cache_dir"] == str(Path(ct.workdir) / "inductor-cache")
        env = dict(e.split("=", 1) for e in (run / "launch.env0").read_text().split("\0") if e)
        assert "CUDA_VISIBLE_DEVICES" not in env and env["TORCHINDUCTOR_CACHE_DIR"] == written["compile"]["cache_dir"]
        assert [e.message for e in events if e.step == "layout"] == [
            "1 target process(es) on GPUs [3], 2 drafter process(es) on GPUs [5, 6]: one process per GPU"]
        assert [e.gpu for e in events if "warm in" in e.message] == [5, 6]
        assert [w["gpu"] for w in json.loads((run / "warmup.json").read_text())] == plan.plan["warmup"]

        ex = wait_exit(res.run_dir, 120)
        log = (run / "train.log").read_text()
        assert ex["exit_code"] != 0, log[-3000:]
        gpus = {0: 3, 1: 5, 2: 6}
        for rank, role in ((0, "target"), (1, "drafter"), (2, "drafter")):
            assert re.search(rf"^\[launch\] rank {rank} \({role}\) on GPU {gpus[rank]}$", log, re.M), log[-3000:]
        # The root cause is a rank that saw exactly its own GPU (and, on this box, no CUDA).
        cause = re.search(r"^\[launch\] run failed: rank (\d) \(\w+, node 0, local rank \1, pid \d+\) raised "
                          r"DistributedError: rank \1: layout gives it GPU (\d) but CUDA is not available "
                          r"\(CUDA_VISIBLE_DEVICES='\2'\)", log, re.M)
        assert cause and gpus[int(cause.group(1))] == int(cause.group(2)), log[-3000:]
        assert ex["root_cause"]["rank"] == int(cause.group(1))
    finally:
        pve.remove_container(306)


def test_a_launch_on_gpus_asks_for_their_memory_while_the_driver_is_probed(tmp_path, local_target, smi):
    """The two nvidia-smi calls of a launch's preflight (the driver's table, the GPUs' memory) run side by
    side: while one is held, the other answers. On a GPU host each takes a good part of a second."""
    from test_launch_claims import Launcher

    nvidia_smi.hold(smi)
    first = Launcher(lambda: local_target, cmd_spec("both", SLEEPER, gpus=[0]))
    nvidia_smi.wait_held(smi)
    deadline = time.monotonic() + 30
    while len(nvidia_smi.answered(smi)) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(nvidia_smi.answered(smi)) == 1  # the other call answered while this one is held
    nvidia_smi.release(smi)
    first.result()
    assert sorted(len(a) for a in nvidia_smi.answered(smi)) == [0, 2]  # the bare table, and the memory query
