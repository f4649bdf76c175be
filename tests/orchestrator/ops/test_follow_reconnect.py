"""The reconnect policy of `dflashctl logs --follow` (orchestrator.ops.follow.follow), on real runs over real
connections: the give-up time counts only the CURRENT outage (outages separated by delivered lines each start
the clock again, however long they add up to); a changed host key met on a reconnect is refused at once, with
the warning, never retried as a dropped connection; a run that a user stops mid-follow ends the follow with
state "stopped" and exit code 5."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import paramiko
import pytest

from orchestrator.agent.events import Data
from orchestrator.agent.protocol import Emitter
from orchestrator.agent.verbs import stop as stop_verb
from orchestrator.errors import HostKeyError
from orchestrator.ops.launch import LaunchSpec, launch
from orchestrator.ops.follow import Backoff, follow
from orchestrator.ops.followoutcome import EXIT_STOPPED
from orchestrator.target import ContainerTarget, LocalTarget
from orchestrator.transport.local import LocalTransport

pytestmark = pytest.mark.slow  # runs real processes: `-m "not slow"` leaves it out

# One numbered line every `pause` s, `n` of them, then exit 0 (line i is "line 000i").
WRITER = textwrap.dedent(
    """
    import sys, time
    n, pause = int(sys.argv[1]), float(sys.argv[2])
    for i in range(n):
        print("line %06d" % i, flush=True)
        time.sleep(pause)
    """
)


def writer(n: int, pause: float, python: str = sys.executable) -> list[str]:
    return [python, "-c", WRITER, str(n), str(pause)]


# One numbered line every 0.02 s until the file `stop` exists, then exit 0 (the test decides when the run ends).
UNTIL = textwrap.dedent(
    """
    import os, sys, time
    stop, deadline, i = sys.argv[1], time.time() + 120, 0
    while not os.path.exists(stop) and time.time() < deadline:
        print("line %06d" % i, flush=True)
        i += 1
        time.sleep(0.02)
    """
)


def spec(experiment: str, argv: list[str]) -> LaunchSpec:
    return LaunchSpec(experiment=experiment, kind="command", target="local", command=argv,
                      venv_profile={"kind": "workstation"})


def kill_tail_agents(sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` to this process's `orchestrator.agent tail` children (the exec serving the follow)."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me and b"orchestrator.agent\0tail" in cmd:
            try:
                os.kill(int(entry), sig)
                pids.append(int(entry))
            except ProcessLookupError:
                pass
    return pids


class Outages:
    """A local target whose connection goes down `count` times for `down_s` seconds each, with progress between:
    the exec that delivers a line is cut right after it (its agent SIGKILLed), then for `down_s` every exec dies
    at once (an interpreter that does not exist, as a host that went away does), then the next exec works."""

    def __init__(self, workdir: str, count: int, down_s: float, stop: Path | None = None):
        self.stop = stop  # made once the last outage is over (the run may end then)
        self.up = LocalTarget(name="local", workdir=workdir, transport=LocalTransport())
        self.down = LocalTarget(name="local", workdir=workdir, transport=LocalTransport(), python="/nonexistent/python3")
        self.left, self.down_s = count, down_s
        self.outage_since: float | None = None
        self.outages: list[tuple[float, int]] = []  # (seconds down, failed execs) of each outage
        self._failed = 0

    def agent(self, verb, request=None, *, on_event=None, **kw):
        if self.outage_since is not None:
            if time.monotonic() - self.outage_since < self.down_s:
                self._failed += 1
                return self.down.agent(verb, request, on_event=on_event, **kw)
            self.outages.append((time.monotonic() - self.outage_since, self._failed))
            self.outage_since, self._failed = None, 0
            if not self.left and self.stop is not None:
                self.stop.touch()
        cut = False

        def event(ev):
            nonlocal cut
            on_event(ev)
            if isinstance(ev, Data) and not cut and self.left:
                cut, self.left = True, self.left - 1
                self.outage_since = time.monotonic()
                kill_tail_agents()

        return self.up.agent(verb, request, on_event=event, **kw)

    def abort(self) -> None:
        kill_tail_agents()

    def close(self) -> None:
        pass


@pytest.mark.usefixtures("isolated_tmux")
def test_outages_separated_by_progress_each_get_the_whole_give_up_time(local_target, tmp_path):
    """Four outages of 0.5 s, each after lines were delivered, with a give-up time of 1.5 s: together they last
    longer than 1.5 s, but none comes near it, so the follow reconnects after each and sees the run to its end,
    every line once. (A give-up clock that kept running from the first outage ends it as "lost".)"""
    stop = tmp_path / "stop"
    res = launch(local_target, spec("outages", [sys.executable, "-c", UNTIL, str(stop)]))
    target = Outages(local_target.workdir, count=4, down_s=0.5, stop=stop)
    lines: list[str] = []
    statuses: list[str] = []
    try:
        out = follow(target, res.run_id, on_line=lines.append, on_status=statuses.append, heartbeat=1.0,
                     backoff=Backoff(initial=0.05, factor=2.0, cap=0.2, jitter=0.0, give_up_s=1.5))
    finally:
        stop.touch()
    assert target.left == 0 and len(target.outages) == 4, target.outages
    assert all(failed >= 1 for _, failed in target.outages) and sum(s for s, _ in target.outages) > 1.5
    assert (out.state, out.exit_code, out.error) == ("succeeded", 0, None), (out.error, statuses[-3:])
    numbered = [x for x in lines if x.startswith("line ")]
    log = (Path(res.run_dir) / "train.log").read_text().splitlines()
    assert numbered == [f"line {i:06d}" for i in range(len(numbered))] == [x for x in log if x.startswith("line ")]
    assert out.reconnects == len(statuses) >= 4 + 4


@pytest.mark.usefixtures("isolated_tmux")
def test_a_run_stopped_during_the_follow_ends_it_with_exit_code_5(local_target):
    """`dflashctl stop` (the agent's stop verb) while a follow is on: the follow sees the run end, reports state
    "stopped" with who stopped it, and its exit code is 5 (not 0 for the trainer's clean exit, not 1)."""
    res = launch(local_target, spec("stopme", writer(10_000, 0.05)))
    stopped: list[dict] = []
    stopper: list[threading.Thread] = []

    def on_line(line: str) -> None:
        if line == "line 000003" and not stopper:
            stopper.append(threading.Thread(target=lambda: stopped.append(stop_verb.run(
                {"workdir": local_target.workdir, "run_id": res.run_id, "grace_s": 30,
                 "requested_by": {"by": "alice@ws", "via": "dflashctl stop"}}, Emitter(io.StringIO()))),
                daemon=True))
            stopper[0].start()

    out = follow(local_target, res.run_id, on_line=on_line, heartbeat=1.0,
                 backoff=Backoff(initial=0.05, cap=0.5, give_up_s=20))
    # The follow ends at exit.json; the stop goes on until no process of the run is left, then answers.
    stopper[0].join(timeout=60)
    assert stopped and stopped[0]["state"] == "stopped"
    assert out.state == "stopped" and out.exit["stopped"]["by"] == "alice@ws"
    assert out.exit_code == EXIT_STOPPED == 5 and out.to_dict()["exit_code"] == 5


CT_WRITER = WRITER


def _sshd_children(main_pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == main_pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def test_a_host_key_that_changed_during_a_follow_is_refused_at_once(fake_pve, tmp_path):
    """A follow over ssh into a container; mid-run the host's key no longer matches known_hosts (here: the
    client's known_hosts gets another key for the host) and the connection drops. The reconnect meets the
    changed key: the follow raises the host-key refusal at once (one reconnect, seconds), never retries it
    for the give-up time as if the connection had only dropped."""
    from fakehost import STOCK_TMUX

    ct = fake_pve.create_container(233, gpus=0, image=STOCK_TMUX)
    run = Path(ct.workdir) / "runs" / "hk-1"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"experiment": "hk", "run_id": "hk-1", "created": "2026-01-01T00:00:00Z"}))
    start = Path(ct.workdir) / "start_training.sh"
    from orchestrator import assets
    from orchestrator.quoting import render

    shutil.copyfile(assets.on_disk("start_training.sh"), start)
    ct.to_container(Path(ct.workdir))  # made by the host's root: the unprivileged container's root writes the run
    r = ct.exec(["tmux", "new-session", "-d", "-s", "dflash-hk",
                 render(["bash", str(start), str(run), "--", *writer(100_000, 0.05, "python3")]),
                 ";", "set-option", "-t", "dflash-hk", "remain-on-exit", "on",
                 ";", "set-option", "-t", "dflash-hk", "@dflash_run", "hk-1"])
    assert r.returncode == 0, r.stderr
    known = tmp_path / "known_hosts"
    shutil.copyfile(fake_pve.known_hosts, known)
    from orchestrator.transport.pct import PctTransport

    target = ContainerTarget(name="ct233", workdir=ct.workdir,
                             transport=PctTransport(fake_pve.ssh_transport(known_hosts=str(known)), 233))
    statuses: list[str] = []
    changed = []

    def on_line(line: str) -> None:
        if line.startswith("line ") and not changed:
            name = known.read_text().split()[0]
            other = paramiko.RSAKey.generate(2048)
            known.write_text(f"{name} {other.get_name()} {other.get_base64()}\n")
            changed.append(time.monotonic())
            for pid in _sshd_children(fake_pve._sshd.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    try:
        with pytest.raises(HostKeyError) as info:
            follow(target, "hk-1", on_line=on_line, on_status=statuses.append, heartbeat=1.0,
                   backoff=Backoff(initial=0.05, cap=0.5, give_up_s=60))
    finally:
        target.close()
        ct.exec(["tmux", "kill-server"])
    assert changed and time.monotonic() - changed[0] < 30
    assert "has CHANGED" in str(info.value) and "ssh-keygen -R" in (info.value.fix or "")
    assert len(statuses) == 1, statuses  # the drop, then the refusal: no retry of a changed key
