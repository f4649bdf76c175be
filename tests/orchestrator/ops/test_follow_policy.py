"""The follow's reconnect policy in its small parts: the backoff schedule, which errors are worth a reconnect,
the exit code of each ending (pure functions, exact tables), and follow()'s give-up, refusal and stall branches
on real runs and real execs (a local target whose interpreter does not exist fails every exec at once, as a
host that went away does; a tail agent SIGSTOPped mid-follow is a connection that went silent).

Fast on purpose: tests/mutation/run.py's "follow (reconnect policy)" row runs them for every mutant."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import textwrap
import time
from pathlib import Path

import paramiko
import pytest

from orchestrator.agent.events import Data
from orchestrator.errors import AgentError, ConnectError, HostKeyError, RemoteCommandError, RunNotFound
from orchestrator.ops.follow import Backoff, _transient, follow
from orchestrator.ops.followoutcome import FollowOutcome
from orchestrator.ops.launch import LaunchSpec, launch
from orchestrator.signatures import UNCLASSIFIED
from orchestrator.target import LocalTarget
from orchestrator.transport.local import LocalTransport
from tests.orchestrator.ops.test_follow_reconnect import kill_tail_agents
from tests.orchestrator.ops.test_logs import RecordingTarget

# ------------------------------------------------------------------------------------------------ pure parts


def test_backoff_delay_grows_by_the_factor_up_to_the_cap():
    b = Backoff(initial=0.5, factor=3.0, cap=10.0, jitter=0.0)
    assert [b.delay(i) for i in range(5)] == [0.5, 1.5, 4.5, 10.0, 10.0]
    assert b.delay(-2) == 0.5  # a negative attempt is the first


def test_backoff_jitter_adds_up_to_its_share_of_the_delay_drawn_from_the_given_rng():
    b = Backoff(initial=2.0, factor=2.0, cap=5.0, jitter=0.25)
    for attempt, base in [(0, 2.0), (1, 4.0), (2, 5.0)]:
        expected = base + random.Random(attempt).uniform(0, 0.25 * base)
        assert b.delay(attempt, random.Random(attempt)) == expected
        assert base < expected <= base * 1.25
    # Without an rng: the module's own, within the same bounds, not always the same draw.
    drawn = {b.delay(1) for _ in range(20)}
    assert all(4.0 <= d <= 5.0 for d in drawn) and len(drawn) > 1


@pytest.mark.parametrize("exc, transient", [
    (HostKeyError("host key for ct101 has CHANGED"), False),  # never fixes itself
    (AgentError("agent tail ended without a result", agent_type="AgentDied"), True),
    (AgentError("bad request: offset", agent_type="BadRequest"), False),
    (AgentError("the agent failed"), False),
    (ConnectError("connection refused"), True),
    (RemoteCommandError("ssh exited 255"), True),
    (EOFError("channel closed"), True),
    (ConnectionResetError(104, "reset by peer"), True),
    (paramiko.SSHException("Error reading SSH protocol banner"), True),
    (ValueError("a bug in the handling"), False),
])
def test_which_errors_are_worth_a_reconnect(exc, transient):
    assert _transient(exc) is transient


def test_the_exit_code_of_each_ending():
    crash = {"signature": "cuda-oom", "severity": "fatal"}
    warning = {"signature": "dynamo-recompile-limit", "severity": "warning"}
    unknown = {"signature": UNCLASSIFIED, "severity": "error"}
    table = [("lost", [crash], 3), ("stopped", [crash], 5), ("succeeded", [crash], 0), ("running", [], 0),
             ("failed", [], 1), ("failed", [warning], 1), ("failed", [unknown], 1), ("failed", [warning, crash], 2),
             ("crashed", [crash], 2), ("crashed", [], 1)]
    got = [(s, m, FollowOutcome(run_id="r", experiment="e", state=s, matches=m).exit_code) for s, m, _ in table]
    assert got == table


# ------------------------------------------------------------------------------------------ through real execs

WRITER = textwrap.dedent(
    """
    import os, sys, time
    stop, deadline, i = sys.argv[1], time.time() + 120, 0
    while not os.path.exists(stop) and time.time() < deadline:
        print("line %06d" % i, flush=True)
        i += 1
        time.sleep(0.02)
    """
)


def down_target(workdir) -> LocalTarget:
    """Every exec dies at once: an interpreter that does not exist."""
    return LocalTarget(name="local", workdir=str(workdir), transport=LocalTransport(), python="/nonexistent/python3")


def test_a_connection_that_stays_down_is_given_up_within_the_give_up_time(tmp_path):
    """Each wait is the schedule's, cut to what is left of the give-up time; the follow ends "lost" (exit 3)
    once the outage has lasted give_up_s, its error and each status naming the exec's failure."""
    sleeps: list[float] = []
    statuses: list[str] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        time.sleep(s)

    t0 = time.monotonic()
    out = follow(down_target(tmp_path), "r-lost-1", on_status=statuses.append, sleep=sleep,
                 backoff=Backoff(initial=0.1, factor=2.0, cap=0.4, jitter=0.0, give_up_s=1.0))
    took = time.monotonic() - t0
    assert (out.state, out.exit_code) == ("lost", 3)
    assert 1.0 <= took < 5.0
    assert sleeps[:3] == [0.1, 0.2, 0.4] and out.reconnects == len(sleeps) == len(statuses)
    for i, s in enumerate(sleeps):  # never past the give-up time
        assert 0 <= s <= 1.0 - sum(sleeps[:i]) + 1e-9, sleeps
    first = "agent tail on local ended (exit 127) without a result: /nonexistent/python3: command not found"
    assert statuses[0].startswith("connection lost (" + first) and statuses[0].endswith("); reconnecting in 0.1 s")
    assert "\n" not in statuses[0] and statuses[1].endswith("reconnecting in 0.2 s")
    assert re.fullmatch(r"connection lost for 1 s: " + re.escape(first) + r".*", out.error), out.error
    assert out.run_id == "r-lost-1" and out.lines == 0


def test_a_show_without_follow_raises_the_execs_error_at_once(tmp_path):
    sleeps: list[float] = []
    with pytest.raises(AgentError) as err:
        follow(down_target(tmp_path), "r-show-1", follow=False, sleep=sleeps.append,
               backoff=Backoff(initial=0.1, give_up_s=30))
    assert err.value.agent_type == "AgentDied" and "/nonexistent/python3" in str(err.value)
    assert sleeps == []




class Silenced:
    """A local target whose first exec goes silent after its first line (its agent SIGSTOPped: alive, the pipe
    open, nothing sent); abort() cuts an exec as a dropped connection does (SIGKILL)."""

    def __init__(self, target: LocalTarget):
        self.target, self.stopped = target, []

    def agent(self, verb, request=None, *, on_event=None, **kw):
        def event(ev):
            on_event(ev)
            if isinstance(ev, Data) and not self.stopped:
                self.stopped.extend(kill_tail_agents(signal.SIGSTOP))

        return self.target.agent(verb, request, on_event=event, **kw)

    def abort(self) -> None:
        kill_tail_agents()

    def close(self) -> None:
        pass


def follow_silenced(local_target, tmp_path, **kw):
    """Follow a live run (lines every 20 ms until the test's stop file exists) whose first exec goes silent
    after its first line; the run ends once the follow has reported the cut. Returns what the follow saw."""
    stop = tmp_path / "stop"
    res = launch(local_target, LaunchSpec(experiment="silent", kind="command", target="local",
                                          command=[sys.executable, "-c", WRITER, str(stop)],
                                          venv_profile={"kind": "workstation"}))
    target = Silenced(local_target)
    seen: dict = {"lines": [], "offsets": [], "statuses": []}

    def on_status(text: str) -> None:
        seen["statuses"].append(text)
        stop.touch()  # the run may end now: the cut has been seen

    try:
        seen["out"] = follow(target, res.run_id, on_line=seen["lines"].append, on_offset=seen["offsets"].append,
                             on_status=on_status, backoff=Backoff(initial=0.1, factor=2.0, cap=0.4, jitter=0.0,
                                                                  give_up_s=30), **kw)
    finally:
        stop.touch()
        for pid in target.stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert target.stopped
    seen["log"] = Path(res.run_dir) / "train.log"
    return seen


@pytest.mark.usefixtures("isolated_tmux")
def test_a_silent_connection_is_cut_after_the_heartbeat_timeout_and_followed_again(local_target, tmp_path):
    """The agent goes silent mid-follow: after heartbeat_timeout without an event the exec is cut, the status
    says why, the follow reconnects from the byte after the last line shown and sees the run to its end."""
    t0 = time.monotonic()
    seen = follow_silenced(local_target, tmp_path, heartbeat=0.2, heartbeat_timeout=1.0)
    out, lines, offsets, log = seen["out"], seen["lines"], seen["offsets"], seen["log"]
    assert 1.0 <= time.monotonic() - t0 < 30
    assert seen["statuses"] == ["connection lost (no heartbeat for 1 s); reconnecting in 0.1 s"]
    assert (out.state, out.exit_code, out.reconnects) == ("succeeded", 0, 1)
    numbered = [x for x in lines if x.startswith("line ")]
    assert numbered == [f"line {i:06d}" for i in range(len(numbered))] and len(numbered) > 1
    assert numbered == [x for x in log.read_text().splitlines() if x.startswith("line ")]
    assert offsets == sorted(offsets) and offsets[-1] == log.stat().st_size == out.offsets["log"]


@pytest.mark.usefixtures("isolated_tmux")
def test_the_default_heartbeat_timeout_is_five_heartbeats_and_ten_seconds(local_target, tmp_path):
    """Without heartbeat_timeout a silent connection is cut after 5 heartbeats + 10 s (here 10.5 s)."""
    t0 = time.monotonic()
    seen = follow_silenced(local_target, tmp_path, heartbeat=0.1)
    assert time.monotonic() - t0 >= 10.5
    assert seen["statuses"] == ["connection lost (no heartbeat for 10 s); reconnecting in 0.1 s"]
    assert (seen["out"].state, seen["out"].reconnects) == ("succeeded", 1)


def ended_run(workdir: Path, run_id: str, experiment: str, created: str, tps: list[float], lines: list[str]) -> Path:
    """A run that ended with exit 0: run.json, exit.json, its metrics and its log."""
    run = workdir / "runs" / run_id
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"experiment": experiment, "run_id": run_id, "created": created}))
    (run / "exit.json").write_text(json.dumps({"exit_code": 0}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tokens_per_s": v}) + "\n"
                                               for i, v in enumerate(tps)))
    (run / "train.log").write_text("".join(line + "\n" for line in lines))
    return run


@pytest.mark.usefixtures("isolated_tmux")
def test_a_follow_asks_for_heartbeats_metrics_and_the_last_good_runs_baseline_by_default(local_target):
    wd = Path(local_target.workdir)
    ended_run(wd, "exp-1", "exp", "2026-01-01T00:00:00Z", [10.0] * 8, ["one"])
    ended_run(wd, "exp-2", "exp", "2026-01-02T00:00:00Z", [9.0] * 8, ["two"])
    target = RecordingTarget(local_target)
    out = follow(target, "exp-2")
    assert (out.state, out.run_id, out.reconnects) == ("succeeded", "exp-2", 0)
    assert out.baseline == {"run_id": "exp-1", "tokens_per_s": 10.0, "samples": 5}
    [request] = target.requests
    assert (request["run_id"], request["follow"], request["metrics"], request["heartbeat"], request["baseline"]) \
        == ("exp-2", True, True, 2.0, True)


@pytest.mark.usefixtures("isolated_tmux")
def test_a_show_by_experiment_or_from_a_byte_offset(local_target):
    wd = Path(local_target.workdir)
    ended_run(wd, "a-1", "a", "2026-01-01T00:00:00Z", [], ["a first", "a second"])
    ended_run(wd, "b-1", "b", "2026-01-02T00:00:00Z", [], ["b first", "b second", "b third"])
    lines: list[str] = []
    out = follow(local_target, None, experiment="a", follow=False, on_line=lines.append)
    assert (out.run_id, out.experiment, out.state) == ("a-1", "a", "succeeded")
    assert [x for x in lines if not x.startswith("[dflashctl]")] == ["a first", "a second"]
    lines.clear()
    out = follow(local_target, "b-1", offset=len("b first\n"), follow=False, on_line=lines.append)
    assert [x for x in lines if not x.startswith("[dflashctl]")] == ["b second", "b third"]
    assert out.offsets["log"] == (wd / "runs" / "b-1" / "train.log").stat().st_size
    assert follow(local_target, None, follow=False).run_id == "b-1"  # the newest of all


def test_the_jitter_of_each_wait_is_drawn_from_the_rng_the_follow_is_given(tmp_path):
    backoff = Backoff(initial=0.1, factor=2.0, cap=0.4, jitter=0.5, give_up_s=0.6)
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        time.sleep(s)

    out = follow(down_target(tmp_path), "r-jitter-1", sleep=sleep, backoff=backoff, rng=random.Random(11))
    twin = random.Random(11)
    assert out.state == "lost" and len(sleeps) >= 2
    assert sleeps[:2] == [backoff.delay(0, twin), backoff.delay(1, twin)]


class FailsFirst:
    """A real target whose first exec fails with `exc` before the agent runs (what paramiko raises on a cut:
    its packetizer's bare EOFError() when the peer closes the socket, an SSHException for a broken banner);
    later execs reach the agent."""

    def __init__(self, target, exc: BaseException):
        self.target, self.exc, self.calls = target, exc, 0

    def agent(self, verb, request=None, **kw):
        self.calls += 1
        if self.calls == 1:
            raise self.exc
        return self.target.agent(verb, request, **kw)

    def __getattr__(self, name):
        return getattr(self.target, name)


@pytest.mark.parametrize("exc, detail", [
    (EOFError(), "no detail"),  # no text at all
    (paramiko.SSHException("Error reading SSH protocol banner"), "Error reading SSH protocol banner"),
])
@pytest.mark.usefixtures("isolated_tmux")
def test_a_drop_by_paramiko_is_reconnected_and_named_in_the_status(local_target, exc, detail):
    ended_run(Path(local_target.workdir), "eof-1", "eof", "2026-01-01T00:00:00Z", [], ["only"])
    statuses: list[str] = []
    out = follow(FailsFirst(local_target, exc), "eof-1", on_status=statuses.append,
                 backoff=Backoff(initial=0.1, jitter=0.0, give_up_s=10))
    assert statuses == [f"connection lost ({detail}); reconnecting in 0.1 s"]
    assert (out.state, out.reconnects) == ("succeeded", 1)


def test_no_such_run_says_which_and_how_to_list_the_runs(local_target):
    with pytest.raises(RunNotFound) as err:
        follow(local_target, "r-none-20260101-000000", backoff=Backoff(initial=0.1, give_up_s=10))
    assert err.value.message.startswith("no run 'r-none-20260101-000000' in ")
    assert (err.value.fix or "").startswith("dflashctl runs")


class Hung:
    """A local target whose every exec hangs before its first byte (its "interpreter" sleeps: an ssh handshake
    that never completes); abort() cuts it as a dropped connection does (SIGKILL)."""

    def __init__(self, workdir: Path):
        fake = workdir / "hung-python3"
        fake.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(120)\n")
        fake.chmod(0o755)
        self.target = LocalTarget(name="local", workdir=str(workdir), transport=LocalTransport(), python=str(fake))

    def agent(self, verb, request=None, **kw):
        return self.target.agent(verb, request, **kw)

    def abort(self) -> None:
        kill_tail_agents()

    def close(self) -> None:
        pass


def test_an_exec_silent_from_its_start_is_cut_too_and_the_outage_given_up(tmp_path):
    """No event at all, not even the run event: the watchdog's clock starts with the exec, so each hung exec
    is cut after heartbeat_timeout and the follow ends "lost" after give_up_s, not waiting on a hung exec."""
    statuses: list[str] = []
    t0 = time.monotonic()
    try:
        out = follow(Hung(tmp_path), "r-hung-1", on_status=statuses.append, heartbeat=0.2, heartbeat_timeout=1.0,
                     backoff=Backoff(initial=0.1, jitter=0.0, give_up_s=1.0))
    finally:
        kill_tail_agents()
    assert (out.state, out.exit_code) == ("lost", 3) and time.monotonic() - t0 < 30
    assert statuses[0] == "connection lost (no heartbeat for 1 s); reconnecting in 0.1 s"
    assert re.fullmatch(r"connection lost for [12] s: no heartbeat for 1 s", out.error), out.error
