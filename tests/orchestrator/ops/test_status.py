"""status: run states (running / succeeded / failed / crashed), last tokens/s, and a container stopped under a
run (`pct stop`). The graceful stop's escalation: tests/orchestrator/ops/test_stop.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.agent import liveness, rundirs
from orchestrator.ops.launch import LaunchSpec, launch
from orchestrator.ops.status import status
from orchestrator.target import ContainerTarget
from waiting import wait_for

STUBBORN = [sys.executable, "-c", "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)\n"]
METRICS = [sys.executable, "-c", "import json, os, time\np = os.path.join(os.environ['DFLASHCTL_RUN_DIR'], 'metrics.jsonl')\n"
           "with open(p, 'a') as f:\n    for s in (1, 2, 3):\n        f.write(json.dumps({'step': s, 'loss': 1.0, 'tokens_per_s': 1000.0 * s}) + '\\n')\n"
           "    f.write(json.dumps({'step': 3, 'tau': 2.5}) + '\\n')\n    f.write('{\"step\": 4, \"tok')\n"
           "time.sleep(60)\n"]


# Own tmux server and run records per test (conftest.py).
pytestmark = pytest.mark.usefixtures("isolated_tmux")


def spec(experiment: str, argv: list[str], **kw) -> LaunchSpec:
    return LaunchSpec(experiment=experiment, kind="command", target=kw.pop("target", "local"), command=argv,
                      venv_profile={"kind": "workstation"}, **kw)


def test_state_of_covers_every_case():
    assert liveness.state_of({"exit_code": 0}, None) == "succeeded"
    assert liveness.state_of({"exit_code": 2}, True) == "failed"
    assert liveness.state_of({"exit_code": 0}, False) == "succeeded"
    assert liveness.state_of(None, True) == "running"
    assert liveness.state_of(None, False) == "crashed"
    assert liveness.state_of(None, None) == "running"  # nothing could tell: never declared a crash


def test_run_alive_from_its_own_session_or_its_pid_file(tmp_path):
    run = tmp_path / "runs" / "exp-1"
    run.mkdir(parents=True)
    (run / "run.json").write_text('{"experiment": "exp", "created": "2026-01-01T00:00:00Z"}')
    ref = rundirs.load_ref(run)
    alive = liveness.run_alive
    assert alive(ref, [{"name": "dflash-exp", "run_id": "exp-1", "dead": False}]) is True
    assert alive(ref, [{"name": "dflash-exp", "run_id": "exp-1", "dead": True}]) is False
    assert alive(ref, [{"name": "dflash-exp", "run_id": "exp-2", "dead": False}]) is False  # a later run's
    assert alive(ref, [{"name": "dflash-exp", "run_id": None, "dead": False}]) is True  # started by hand
    assert alive(ref, [{"name": "dflash-other", "run_id": None, "dead": False}]) is False
    assert alive(ref, []) is False
    proc = subprocess.Popen(["sleep", "30"])
    try:
        (run / "pid").write_text(f"{proc.pid}\n")
        assert alive(ref, []) is True  # the session is gone, the command still runs
        # A pid file written long before the process with that number started: a reused pid, not this run.
        old = time.time() - 3600
        os.utime(run / "pid", (old, old))
        assert alive(ref, []) is False
    finally:
        proc.kill()
        proc.wait()
    os.utime(run / "pid")
    assert alive(ref, []) is False


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_status_shows_last_tokens_per_s_and_a_growing_duration(tmp_path, local_target):
    t = local_target
    res = launch(t, spec("met", METRICS))
    run = wait_for(lambda: next((r for r in status(t).runs if r.get("tokens_per_s")), None))
    assert run["run_id"] == res.run_id and run["state"] == "running"
    assert run["tokens_per_s"] == 3000.0 and run["step"] == 3  # the partial last line and the tau line skipped
    time.sleep(1.1)
    later = status(t).run(res.run_id)
    assert later["duration_s"] >= run["duration_s"] + 1.0
    assert [s["run_id"] for s in status(t).sessions] == [res.run_id]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_killed_wrapper_without_exit_json_is_crashed(tmp_path, local_target):
    t = local_target
    res = launch(t, spec("kil", STUBBORN))
    wait_for(lambda: "\nready\n" in (Path(res.run_dir) / "train.log").read_text())
    pane = status(t).sessions[0]["pane_pid"]
    # SIGKILL the wrapper (pane group) and then the command: nobody is left to write exit.json (an OOM
    # killer or a power cut does this).
    os.killpg(pane, signal.SIGKILL)
    os.killpg(int((Path(res.run_dir) / "pid").read_text()), signal.SIGKILL)
    run = wait_for(lambda: (r := status(t).run(res.run_id)) and r["state"] != "running" and r)
    assert run["state"] == "crashed" and not (Path(res.run_dir) / "exit.json").exists()


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_pct_stop_kills_the_session_and_status_says_so(fake_pve):
    from fakehost import STOCK_TMUX

    ct = fake_pve.create_container(311, gpus=2, image=STOCK_TMUX)
    venv = Path(ct.workdir) / "venvs" / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")  # the container's own: the agent needs the stdlib only
    (Path(ct.workdir) / "venvs" / "current").symlink_to("v")
    ct.to_container(Path(ct.workdir))  # made by the host's root: give it to the unprivileged container's root
    try:
        t = ContainerTarget(name="ct311", workdir=ct.workdir, transport=fake_pve.pct_transport(311))
        res = launch(t, spec("pst", ["python3", *STUBBORN[1:]], target="ct311"))
        assert status(t).run(res.run_id)["state"] == "running"
        ct.stop()  # `pct stop`: the container's init and everything in it die, no exit.json is written
        down = status(t)
        assert down.state == "stopped" and down.runs == [] and "not running" in (down.note or "")
        ct.start()
        up = status(t)
        t.close()
        assert up.state == "running" and up.sessions == []
        assert up.run(res.run_id)["state"] == "crashed" and up.run(res.run_id)["exit_code"] is None
    finally:
        fake_pve.remove_container(311)


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_cli_status_prints_the_newest_runs_balance_as_metrics_does(dflashctl, tmp_path):
    """`dflashctl status` shows the target/drafter balance advice of the newest run under its runs table: the
    very lines `dflashctl metrics` prints (one rule, orchestrator.ops.runnotes.balance_notes), and --json holds
    them; a run without rates shows none."""
    import json

    from tests.orchestrator.test_cli import write_inventory

    inv = write_inventory(tmp_path)
    runs = tmp_path / "work" / "runs"
    for run_id, created in (("tiny-old", "2026-11-29T00:00:00Z"), ("tiny-b", "2026-11-30T00:00:00Z")):
        (runs / run_id).mkdir(parents=True)
        (runs / run_id / "run.json").write_text(json.dumps({"experiment": "tiny", "created": created}))
    rows = [{"kind": "facts", "target_ranks": 1, "drafter_ranks": 2},
            *({"kind": "train", "step": i, "loss": 1.0, "target_tokens_per_s": 1000.0, "drafter_tokens_per_s": 8000.0}
              for i in range(1, 5))]
    (runs / "tiny-b" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = dflashctl("--inventory", str(inv), "metrics", "tiny-b")
    assert metrics.returncode == 0, metrics.stderr
    advice = metrics.stdout.rstrip("\n").splitlines()[-4:]
    assert advice[0].startswith("balance: the drafter ranks wait for features"), advice
    res = dflashctl("--inventory", str(inv), "status")
    assert res.returncode == 0, res.stderr
    out = res.stdout.rstrip("\n").splitlines()
    at = out.index("run tiny-b:")
    assert [line.strip() for line in out[at + 1:at + 5]] == [line.strip() for line in advice]
    st = json.loads(dflashctl("--inventory", str(inv), "status", "--json").stdout)
    assert st["balance_run"] == "tiny-b" and st["balance"] == advice
    (runs / "tiny-b" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert "balance:" not in dflashctl("--inventory", str(inv), "status").stdout
