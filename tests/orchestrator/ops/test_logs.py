"""`logs` / `follow`: loss-free following across real connection cuts, exit codes, health alerts, the CLI.

Runs are real: `start_training.sh` in a tmux session (private socket dir) running a Python writer. Cuts are
real: the agent process serving the follow is SIGKILLed (local target) or the SSH connection to the fake
Proxmox host is severed (container target).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from orchestrator import assets
from orchestrator.agent import tmuxctl
from orchestrator.agent.events import Data, Heartbeat, RunInfo
from orchestrator.errors import RunNotFound
from orchestrator.ops.follow import Backoff, follow
from orchestrator.ops.loghealth import LogHealth
from orchestrator.ops.placement import resolve_first as resolve
from orchestrator.target import LocalTarget
from orchestrator.transport.local import LocalTransport
from orchestrator.quoting import render

ROOT = Path(__file__).resolve().parents[3]
START = assets.on_disk("start_training.sh")
FAST = Backoff(initial=0.05, factor=2.0, cap=0.5, jitter=0.2, give_up_s=20)


@pytest.fixture(autouse=True)
def own_state_dir(tmp_path, monkeypatch):
    """This test's run records and printed offsets (a follow notes what it printed), never the user's."""
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))

WRITER = textwrap.dedent(
    """
    import sys, time
    n, batch, pause, code = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    tail = bytes.fromhex(sys.argv[5]).decode() if len(sys.argv) > 5 else ""  # hex: not echoed as text
    out = sys.stdout
    for start in range(0, n, batch):
        out.write("".join("line %06d\\n" % i for i in range(start, min(n, start + batch))))
        out.flush()
        time.sleep(pause)
    if tail:
        out.write(tail)
        out.flush()
    sys.exit(code)
    """
)


@pytest.fixture(autouse=True)
def _own_tmux(tmp_path, monkeypatch):
    d = tmp_path / "tmux"
    d.mkdir()
    monkeypatch.setenv("TMUX_TMPDIR", str(d))
    yield
    subprocess.run(["tmux", "kill-server"], capture_output=True)


def start_run(workdir: Path, run_id: str, experiment: str, argv: list[str], created: str = "2026-01-01T00:00:00Z") -> Path:
    """Launch like `launch` does: run dir + run.json, then start_training.sh in tmux session dflash-<exp>."""
    run = workdir / "runs" / run_id
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"experiment": experiment, "run_id": run_id, "created": created}))
    # The launcher's own session maker: remain-on-exit and the @dflash_run tag, as real runs have.
    tmuxctl.new_session(tmuxctl.session_name(experiment), render(["bash", str(START), str(run), "--", *argv]),
                        str(workdir), run_id)
    return run


def writer_argv(n: int, batch: int = 200, pause: float = 0.01, code: int = 0, tail: str = "") -> list[str]:
    return [sys.executable, "-c", WRITER, str(n), str(batch), str(pause), str(code), tail.encode().hex()]


def numbered(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("line ")]


def local_target(workdir: Path) -> LocalTarget:
    return LocalTarget(name="local", workdir=str(workdir), transport=LocalTransport())


class AgentKiller(threading.Thread):
    """SIGKILLs this process's `orchestrator.agent tail` children at random intervals: a real cut."""

    def __init__(self, every: tuple[float, float], limit: int):
        super().__init__(daemon=True)
        self.every, self.limit, self.kills = every, limit, 0
        self.stop = threading.Event()

    def _agents(self) -> list[int]:
        me, pids = os.getpid(), []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == me and b"orchestrator.agent\0tail" in cmd:
                pids.append(int(entry))
        return pids

    def run(self) -> None:
        rng = random.Random(3)
        while not self.stop.wait(rng.uniform(*self.every)) and self.kills < self.limit:
            for pid in self._agents():
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.kills += 1
                except ProcessLookupError:
                    pass


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_follow_survives_killed_agents_without_loss_or_repeat(tmp_path):
    n = 30_000
    start_run(tmp_path, "r-cut", "cut", writer_argv(n, batch=150, pause=0.01))
    lines: list[str] = []
    statuses: list[str] = []
    killer = AgentKiller(every=(0.1, 0.3), limit=12)
    killer.start()
    try:
        out = follow(local_target(tmp_path), "r-cut", on_line=lines.append, on_status=statuses.append,
                     backoff=FAST, heartbeat=0.5)
    finally:
        killer.stop.set()
    assert killer.kills >= 5, "the writer finished before enough cuts were made"
    assert numbered(lines) == [f"line {i:06d}" for i in range(n)]
    assert out.state == "succeeded" and out.exit_code == 0 and out.exit["exit_code"] == 0
    assert out.reconnects >= killer.kills - 1 and len(statuses) == out.reconnects
    assert lines[0].startswith("[dflashctl] run r-cut started") and "exit code 0" in lines[-1]


def test_failed_run_exit_code_and_partial_last_line(tmp_path):
    start_run(tmp_path, "r-fail", "fail", writer_argv(50, code=3, tail="no newline"))
    lines: list[str] = []
    out = follow(local_target(tmp_path), "r-fail", on_line=lines.append, backoff=FAST, heartbeat=0.5)
    assert out.state == "failed" and out.exit["exit_code"] == 3 and out.exit_code == 1
    assert "no newline" in "\n".join(lines)  # the writer is done: its partial last line is shown
    assert numbered(lines)[-1] == "line 000049"


def test_crash_without_exit_json_is_crashed(tmp_path):
    # The session is killed outright (like a container stop): no exit.json is ever written.
    run = start_run(tmp_path, "r-crash", "crash", writer_argv(10, pause=30))

    def container_stop() -> None:
        # SIGKILL everything, as a container stop does: the wrapper never gets to write exit.json.
        pane = subprocess.run(["tmux", "list-panes", "-t", "dflash-crash", "-F", "#{pane_pid}"],
                              capture_output=True, text=True).stdout.split()
        os.killpg(int((run / "pid").read_text()), signal.SIGKILL)
        for pid in pane:
            os.kill(int(pid), signal.SIGKILL)  # the pane stays, dead (remain-on-exit)

    threading.Timer(1.0, container_stop).start()
    out = follow(local_target(tmp_path), "r-crash", backoff=FAST, heartbeat=0.3)
    assert out.state == "crashed" and out.exit is None and not (run / "exit.json").exists()
    assert out.exit_code == 1  # no known signature in the log


def test_a_later_run_in_the_same_session_name_does_not_keep_an_old_run_alive(tmp_path):
    # r-old never wrote exit.json; its experiment's session now runs r-new (tagged with r-new's id).
    old = tmp_path / "runs" / "r-old"
    old.mkdir(parents=True)
    (old / "run.json").write_text(json.dumps({"experiment": "same", "run_id": "r-old", "created": "2026-01-01"}))
    start_run(tmp_path, "r-new", "same", writer_argv(3, pause=20), created="2026-01-02")
    out = follow(local_target(tmp_path), "r-old", follow=False)
    assert out.state == "crashed"
    assert follow(local_target(tmp_path), "r-new", follow=False).state == "running"


FIXTURES = ROOT / "tests" / "fixtures" / "signatures"
CAT = [sys.executable, "-c", "import sys; sys.stdout.write(open(sys.argv[1]).read()); sys.exit(int(sys.argv[2]))"]


@pytest.mark.parametrize("fixture, signature, code", [
    ("cuda-oom", "cuda-oom", 2),  # fatal: the run died of a known cause
    ("nan-loss", "nan-loss", 2),  # error: the run is wrong, and that is why it failed
    ("dynamo-recompile-limit", "dynamo-recompile-limit", 1),  # a warning alone does not explain a failure
])
def test_a_failed_runs_exit_code_follows_the_severity_of_what_matched(tmp_path, fixture, signature, code):
    """A run that prints a real log (the catalogue's fixture) and exits 1, followed with the real matcher and
    catalogue, as `logs` follows it."""
    from orchestrator.sigmatch import Matcher
    from orchestrator.signatures import load_catalogue

    start_run(tmp_path, "r-sev", "sev", [*CAT, str(FIXTURES / f"{fixture}.log"), "1"])
    matches: list = []
    out = follow(local_target(tmp_path), "r-sev", matcher=Matcher(load_catalogue()), on_match=matches.append,
                 backoff=FAST, heartbeat=0.5)
    assert matches and {m.signature for m in matches} == {signature}
    assert out.state == "failed" and out.exit["exit_code"] == 1 and out.exit_code == code


def test_outcome_json_shape(tmp_path):
    from orchestrator.sigmatch import Matcher
    from orchestrator.signatures import load_catalogue

    start_run(tmp_path, "r-json", "json", [*CAT, str(FIXTURES / "nccl-timeout.log"), "1"])
    out = follow(local_target(tmp_path), "r-json", matcher=Matcher(load_catalogue()), backoff=FAST, heartbeat=0.5)
    d = json.loads(json.dumps(out.to_dict()))
    assert (d["run_id"], d["experiment"], d["state"], d["exit"]["exit_code"], d["exit_code"]) == \
        ("r-json", "json", "failed", 1, 2)
    assert d["matches"] and {(m["signature"], m["severity"]) for m in d["matches"]} == {("nccl-timeout", "fatal")}
    assert d["lines"] == len((tmp_path / "runs" / "r-json" / "train.log").read_text().splitlines())
    assert d["offsets"]["log"] == (tmp_path / "runs" / "r-json" / "train.log").stat().st_size
    assert d["reconnects"] == 0 and d["alerts"] == [] and d["error"] is None


def test_connection_lost_for_good_is_exit_three(tmp_path):
    start_run(tmp_path, "r-lost", "lost", writer_argv(5, pause=5))
    # an interpreter that does not exist: every exec dies at once, as a host that went away would
    tgt = LocalTarget(name="local", workdir=str(tmp_path), transport=LocalTransport(), python="/nonexistent/python3")
    statuses: list[str] = []
    t0 = time.monotonic()
    out = follow(tgt, "r-lost", backoff=Backoff(initial=0.05, cap=0.2, jitter=0, give_up_s=1.0), on_status=statuses.append)
    assert out.state == "lost" and out.exit_code == 3
    assert 1.0 <= time.monotonic() - t0 < 5 and out.reconnects >= 3 and "reconnecting" in statuses[0]


def test_no_such_run(tmp_path):
    with pytest.raises(RunNotFound) as err:
        follow(local_target(tmp_path), "r-none", backoff=FAST)
    assert err.value.exit_code == 4


def test_one_shot_tail_of_a_running_run(tmp_path):
    start_run(tmp_path, "r-live", "live", writer_argv(100, batch=100, pause=30))
    time.sleep(1.0)
    lines: list[str] = []
    out = follow(local_target(tmp_path), "r-live", tail=3, follow=False, on_line=lines.append)
    assert out.state == "running" and out.exit_code == 0
    assert lines == ["line 000097", "line 000098", "line 000099"]


def test_backoff_schedule():
    b = Backoff(initial=1, factor=2, cap=30, jitter=0.1)
    rng = random.Random(0)
    delays = [b.delay(i, rng) for i in range(8)]
    for d, base in zip(delays, [1, 2, 4, 8, 16, 30, 30, 30]):
        assert base <= d <= base * 1.1


# ------------------------------------------------------------------------------------------- health


class _Cfg:
    hang_seconds = 60
    regression_fraction = 0.5
    regression_seconds = 10
    memory_growth_seconds = 600


def test_hang_needs_a_live_session_and_silent_files():
    now = [0.0]
    h = LogHealth(_Cfg(), clock=lambda: now[0])
    beat = Heartbeat(session_alive=True, log_size=10, metrics_size=5)
    assert h.heartbeat(beat) == []
    now[0] = 59
    assert h.heartbeat(beat) == []
    now[0] = 61
    alerts = h.heartbeat(beat)
    assert [a.kind for a in alerts] == ["hang"] and alerts[0].detail["silent_seconds"] == 61
    now[0] = 200
    assert h.heartbeat(beat) == []  # once per silent stretch
    now[0] = 210
    assert h.heartbeat(dataclasses.replace(beat, log_size=11)) == []  # activity re-arms
    now[0] = 300
    assert [a.kind for a in h.heartbeat(dataclasses.replace(beat, log_size=11))] == ["hang"]
    # an unknown or dead session is not a hang (a dead one is a crash, decided by the agent)
    h2 = LogHealth(_Cfg(), clock=lambda: now[0])
    h2.heartbeat(Heartbeat(session_alive=None, log_size=1, metrics_size=1))
    now[0] = 10_000
    assert h2.heartbeat(Heartbeat(session_alive=None, log_size=1, metrics_size=1)) == []


def test_regression_against_the_baseline_from_the_stream():
    h = LogHealth(_Cfg())
    h.set_baseline({"run_id": "old", "tokens_per_s": 20_000.0, "samples": 50})
    ok = [{"step": i, "time": float(i), "tokens_per_s": 19_000.0} for i in range(20)]
    slow = [{"step": 20 + i, "time": 20.0 + i, "tokens_per_s": 6_000.0} for i in range(20)]
    assert h.metrics(ok) == []
    kinds = [a.kind for a in h.metrics(slow)]
    assert kinds == ["regression"]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_hang_alert_reaches_the_follower(tmp_path):
    start_run(tmp_path, "r-hang", "hang", writer_argv(3, pause=4))

    class Quick(_Cfg):
        hang_seconds = 1.0

    alerts: list = []
    out = follow(local_target(tmp_path), "r-hang", health=LogHealth(Quick()), on_alert=alerts.append,
                 backoff=FAST, heartbeat=0.25)
    assert out.state == "succeeded"
    assert [a.kind for a in alerts][:1] == ["hang"]


# ------------------------------------------------------------------------------------------- resolve


def test_resolve_experiment_or_run_id():
    from orchestrator.inventory import load_inventory

    inv = load_inventory(None)
    assert resolve(inv, "tiny", None) == (inv.experiments["tiny"].target, None, "tiny")
    assert resolve(inv, "tiny-20260101-000000", "local") == ("local", "tiny-20260101-000000", None)
    assert resolve(inv, None, None) == (inv.default_target(), None, None)
    with pytest.raises(Exception) as err:
        resolve(inv, "../etc", None)
    assert "run" in str(err.value)


# ------------------------------------------------------------------------------- through the fake Proxmox host

CT_WRITER = textwrap.dedent(
    """
    import os, sys, time
    n, chunks, gate = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

    def granted():
        try:
            with open(gate) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0

    size = -(-n // chunks)
    deadline = time.time() + 300  # the test died: do not wait for it forever
    for c in range(chunks):
        # chunk c only once the test has granted it: the run cannot finish before the test has made its cuts
        while granted() < c and time.time() < deadline:
            time.sleep(0.02)
        stop = min(n, (c + 1) * size)
        for start in range(c * size, stop, 120):  # small batches: a cut lands while lines are being written
            sys.stdout.write("".join("line %06d\\n" % i for i in range(start, min(stop, start + 120))))
            sys.stdout.flush()
            time.sleep(0.01)
    """
)


class RecordingTarget:
    """A real target that also keeps every request the follow sends its agent (the offsets it asks for)."""

    def __init__(self, target):
        self.target, self.requests = target, []

    def agent(self, verb, request=None, **kw):
        self.requests.append(dict(request or {}))
        return self.target.agent(verb, request, **kw)

    def __getattr__(self, name):
        return getattr(self.target, name)


def test_a_reconnect_asks_for_the_next_byte_and_no_byte_is_sent_twice(tmp_path):
    """Cuts at known points (the writer waits for the test between chunks; each cut SIGKILLs the agent
    serving the follow): every reconnect asks for exactly the byte after the last one delivered, and the
    agent sends each byte of train.log once. A follow that re-read from 0 after each cut would still print
    the right lines (the client trims overlap) while re-sending the whole log every time."""
    n, cuts = 3000, 4
    chunks = cuts + 1
    size = -(-n // chunks)
    gate = tmp_path / "gate"
    run = start_run(tmp_path, "r-off", "off", [sys.executable, "-c", CT_WRITER, str(n), str(chunks), str(gate)])
    target = RecordingTarget(local_target(tmp_path))
    stream: list[tuple] = []  # ("data", offset, next) per data event, in arrival order
    statuses: list[str] = []
    seen = {"last_line": -1, "gen": -1}
    problem: list[str] = []

    def on_event(ev) -> None:
        seen["gen"] = len(statuses)
        if isinstance(ev, Data):
            stream.append((len(target.requests) - 1, ev.offset, ev.next))

    def on_line(line: str) -> None:
        if line.startswith("line "):
            seen["last_line"] = int(line[5:])

    def grant(c: int) -> None:
        gate.with_name("gate.tmp").write_text(str(c))
        os.replace(gate.with_name("gate.tmp"), gate)

    def until(cond, what: str) -> bool:
        deadline = time.monotonic() + 60
        while not cond():
            if time.monotonic() > deadline:
                problem.append(what)
                return False
            time.sleep(0.01)
        return True

    def cutter() -> None:
        try:
            for k in range(1, cuts + 1):
                if not until(lambda: seen["gen"] == len(statuses) and seen["last_line"] >= k * size - 1,
                             f"chunk {k - 1} on the live connection"):
                    return
                before = len(statuses)
                for pid in AgentKiller(every=(0, 0), limit=0)._agents():
                    os.kill(pid, signal.SIGKILL)
                if not until(lambda: len(statuses) > before, f"the follow to notice cut {k}"):
                    return
                grant(k)
        finally:
            grant(chunks)

    t = threading.Thread(target=cutter, daemon=True)
    t.start()
    lines: list[str] = []
    out = follow(target, "r-off", on_line=lambda ln: (lines.append(ln), on_line(ln)), on_event=on_event,
                 on_status=statuses.append, backoff=FAST, heartbeat=0.5)
    t.join(10)
    assert not problem, problem
    assert out.state == "succeeded" and out.reconnects == cuts == len(target.requests) - 1
    assert numbered(lines) == [f"line {i:06d}" for i in range(n)]
    size_on_disk = (run / "train.log").stat().st_size
    # The agent sent the log once: consecutive chunks, from byte 0 to the end, nothing twice.
    assert [s[1] for s in stream] == [0] + [s[2] for s in stream[:-1]]
    assert sum(s[2] - s[1] for s in stream) == size_on_disk == out.offsets["log"]
    # Each reconnect asked for the byte after the last one the previous connection delivered (never 0).
    for i, request in enumerate(target.requests[1:], start=1):
        delivered = [s[2] for s in stream if s[0] < i]
        assert request["offset"] == delivered[-1] > 0, (i, request, delivered[-3:])


def test_an_overlapping_chunk_is_trimmed_a_resent_one_skipped_a_gap_refused():
    """The follower's own guard (pure logic, no agent): an agent that resends bytes already shown (an older
    agent, a resend after a cut) must not make a line appear twice; a gap is an error, never a silent loss."""
    from orchestrator.errors import RemoteCommandError
    from orchestrator.ops.follow import _Follower

    lines: list[str] = []
    f = _Follower(on_line=lines.append, on_match=None, on_alert=None, on_event=None, matcher=None, health=None)
    text = "".join(f"line {i}\n" for i in range(6))  # 7 bytes a line
    chunk = lambda a, b: Data(offset=7 * a, next=7 * b, text=text[7 * a: 7 * b])  # noqa: E731
    f.handle(RunInfo(run_id="r", offset=0))
    f.handle(chunk(0, 2))
    f.handle(chunk(1, 4))  # line 1 again, then lines 2 and 3
    f.handle(chunk(0, 3))  # all of it shown already
    f.handle(Data(offset=28, next=42, b64=base64.b64encode(text[28:42].encode()).decode()))
    assert lines == [f"line {i}" for i in range(6)] and f.log_offset == 42 and f.failure is None
    f.handle(chunk(7, 8))  # bytes 42..49 were never sent
    assert isinstance(f.failure, RemoteCommandError) and "skipped bytes 42..49" in str(f.failure)
    assert lines == [f"line {i}" for i in range(6)] and f.log_offset == 42


def start_ct_run(ct, run_id: str, experiment: str, argv: list[str]) -> Path:
    """A run inside the container the way launch makes one: run dir, then start_training.sh in a tagged tmux
    session with remain-on-exit, started by an exec inside the container."""
    run = Path(ct.workdir) / "runs" / run_id
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"experiment": experiment, "run_id": run_id,
                                              "created": "2026-01-01T00:00:00Z"}))
    session = f"dflash-{experiment}"
    # The container sees its own /tmp: a checkout under /tmp (CI's clone, say) is invisible in there, so the
    # script travels into the run's workdir first, as launch's bundle does.
    start = Path(ct.workdir) / "start_training.sh"
    shutil.copyfile(START, start)
    ct.to_container(Path(ct.workdir))  # made by the host's root: the unprivileged container's root writes the run
    res = ct.exec(["tmux", "new-session", "-d", "-s", session, render(["bash", str(start), str(run), "--", *argv]),
                   ";", "set-option", "-t", session, "remain-on-exit", "on",
                   ";", "set-option", "-t", session, "@dflash_run", run_id])
    assert res.returncode == 0, res.stderr
    return run


def sshd_children(main_pid: int) -> list[int]:
    """The live per-connection sshd processes (children of the listening sshd; zombies left out: killing one
    cuts nothing)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == main_pid and fields[0] != "Z":
                out.append(int(entry))
    return out


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_fake_pve_follow_survives_twenty_cut_connections(fake_pve, tmp_path):
    from orchestrator.target import ContainerTarget

    from fakehost import STOCK_TMUX

    ct = fake_pve.create_container(231, gpus=0, image=STOCK_TMUX)
    n, cuts_wanted = 100_000, 20
    chunks = cuts_wanted + 1
    size = -(-n // chunks)
    gate = Path(ct.workdir) / "gate"
    run = start_ct_run(ct, "cut-1", "cutexp", ["python3", "-c", CT_WRITER, str(n), str(chunks), str(gate)])
    target = ContainerTarget(name="ct231", workdir=ct.workdir, transport=fake_pve.pct_transport(231))
    lines: list[str] = []
    statuses: list[str] = []
    # the number of reconnects (statuses) when the last event and the last numbered line arrived: an event
    # seen at the current count came over the connection that is open now
    seen = {"event_gen": -1, "last_line": -1}
    cuts: list[dict] = []
    problem: list[str] = []

    def on_line(line: str) -> None:
        lines.append(line)
        if line.startswith("line "):
            seen["last_line"] = int(line[5:])

    def on_event(ev: dict) -> None:
        seen["event_gen"] = len(statuses)

    def grant(c: int) -> None:
        tmp = gate.with_name("gate.tmp")
        tmp.write_text(str(c))
        os.replace(tmp, gate)

    def wait_for(what: str, cond, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                problem.append(f"cut {len(cuts) + 1}: timed out waiting for {what}")
                return False
            time.sleep(0.01)
        return True

    def cutter() -> None:
        # Cut k: once the follow is serving on its current connection and has shown a line of chunk k-1,
        # sever that connection for real (SIGKILL the sshd processes serving it), wait until the follow has
        # noticed (one more reconnect status), and only then let the writer go on to chunk k. The writer
        # can never run ahead of the cuts, so all of them fall inside the run, however loaded the machine.
        try:
            for k in range(1, cuts_wanted + 1):
                if not wait_for(f"a line of chunk {k - 1} on the live connection",
                                lambda: seen["event_gen"] == len(statuses) and seen["last_line"] >= (k - 1) * size):
                    return
                before = len(statuses)
                victims = sshd_children(fake_pve._sshd.pid)
                for pid in victims:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                cuts.append({"killed": len(victims), "run_going": not (run / "exit.json").exists(),
                             "mid_chunk": seen["last_line"] < min(n, k * size) - 1})
                if not wait_for("the follow to notice the cut", lambda: len(statuses) > before):
                    return
                grant(k)
        finally:
            grant(chunks)  # whatever happened, let the writer finish so the follow ends

    t = threading.Thread(target=cutter, daemon=True)
    t.start()
    try:
        out = follow(target, "cut-1", on_line=on_line, on_event=on_event, on_status=statuses.append,
                     backoff=FAST, heartbeat=1.0)
    finally:
        grant(chunks)
        target.close()
    t.join(10)
    assert not problem, problem
    assert len(cuts) == cuts_wanted and all(c["killed"] and c["run_going"] for c in cuts), (
        cuts, {"state": out.state, "exit": out.exit, "reconnects": out.reconnects, "lines": len(lines),
               "statuses": statuses[-5:]})
    assert numbered(lines) == [f"line {i:06d}" for i in range(n)]  # each exactly once, in order
    assert out.state == "succeeded" and out.exit_code == 0 and json.loads((run / "exit.json").read_text())["exit_code"] == 0
    # every cut was noticed: a reconnect each (the cutter waited for it before letting the writer on)
    assert out.reconnects == len(statuses) >= cuts_wanted, statuses
    # one pct exec per (re)connect; the first use also copies the bundle in (a refused exec, the copy, again)
    assert len(fake_pve.pct_exec_calls(231)) <= out.reconnects + 3


# ------------------------------------------------------------------------------------------- the CLI

OOM_LOG = """\
[dflashctl] run r-oom started 2026-01-01T00:00:00Z: python -m trainer train
step 10 loss 3.2
Traceback (most recent call last):
  File "/root/dflash/bundle/x.zip/trainer/train.py", line 210, in main
    loss = step(batch)
  File "/root/dflash/venvs/current/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1751, in _call_impl
    return forward_call(*args, **kwargs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which 1.20 GiB is free.
[dflashctl] command ended: exit code 1
"""


def finished_run(workdir: Path, run_id: str, log: str, code: int | None, experiment: str = "tiny") -> None:
    run = workdir / "runs" / run_id
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"experiment": experiment, "run_id": run_id, "created": run_id}))
    (run / "train.log").write_text(log)
    if code is not None:
        (run / "exit.json").write_text(json.dumps({"exit_code": code, "signal": None}))


def write_inventory(tmp_path: Path, extra: str = "") -> Path:
    inv = tmp_path / "inv.yaml"
    inv.write_text(extra + textwrap.dedent(f"""\
        targets:
          local: {{kind: local, workdir: {tmp_path / 'work'}, venv: workstation}}
        venvs:
          workstation: {{kind: workstation}}
        experiments:
          tiny: {{kind: dflash, target: local}}
        """))
    return inv


@pytest.fixture
def cli(dflashctl_main):
    """`dflashctl --inventory <tmp_path>/inv.yaml ARGS` in this process (orchestrator.cli.main): these tests
    make a dozen invocations about output and exit codes; test_cli_known_crash_is_two_with_the_diagnosis
    runs the installed console script."""

    def run(tmp_path: Path, *args: str, extra: str = "") -> subprocess.CompletedProcess:
        return dflashctl_main("--inventory", str(write_inventory(tmp_path, extra)), *args)

    return run


def test_cli_known_crash_is_two_with_the_diagnosis(tmp_path, dflashctl):
    finished_run(tmp_path / "work", "r-oom", OOM_LOG, 1)
    res = dflashctl("--inventory", str(write_inventory(tmp_path)), "logs", "r-oom", "--follow")
    assert res.returncode == 2, res.stderr
    assert res.stdout == OOM_LOG[-len(res.stdout):] and "torch.OutOfMemoryError" in res.stdout
    assert "CUDA out of memory" in res.stderr and "fix:" in res.stderr and "will not help:" in res.stderr
    assert "module.py:1751 in _call_impl" in res.stderr  # the traceback's last frame
    assert "run r-oom: failed (exit code 1)" in res.stderr


def test_cli_exit_codes_and_outputs(tmp_path, cli):
    work = tmp_path / "work"
    finished_run(work, "r-ok", "step 1\nstep 2\n", 0, experiment="tiny")
    finished_run(work, "r-bad", "step 1\nValueError: nope\n", 5, experiment="other")
    finished_run(work, "r-killed", "step 1\n", 137, experiment="other")
    assert cli(tmp_path, "logs", "r-ok", "--follow").returncode == 0
    assert cli(tmp_path, "logs", "r-bad", "--follow").returncode == 1
    assert cli(tmp_path, "logs", "r-killed", "--follow").returncode == 2  # exit 137: host OOM kill
    missing = cli(tmp_path, "logs", "r-nope")
    assert missing.returncode == 4 and "no run 'r-nope'" in missing.stderr
    # an experiment name means its newest run; --raw prints the log and nothing else
    raw = cli(tmp_path, "logs", "tiny", "--raw")
    assert raw.returncode == 0 and raw.stdout == "step 1\nstep 2\n" and raw.stderr == ""
    js = cli(tmp_path, "logs", "r-bad", "--json", "--tail", "1")
    rows = [json.loads(line) for line in js.stdout.splitlines()]
    assert [r["type"] for r in rows] == ["line", "outcome"] and rows[0]["text"] == "ValueError: nope"
    assert rows[-1]["state"] == "failed" and rows[-1]["exit_code"] == 1 and js.returncode == 1
    assert "Exit codes: 0" in cli(tmp_path, "logs", "--help").stdout


def test_cli_notifies_crash_and_completion(tmp_path, cli):
    work = tmp_path / "work"
    finished_run(work, "r-oom", OOM_LOG, 1)
    finished_run(work, "r-ok", "fine\n", 0)
    sink = tmp_path / "events.jsonl"
    hook = f"import sys; open({str(sink)!r}, 'a').write(sys.stdin.read() + chr(10))"
    extra = f"notify:\n  command: [{sys.executable!r}, '-c', {json.dumps(hook)}]\n"
    assert cli(tmp_path, "logs", "r-oom", "--follow", extra=extra).returncode == 2
    assert cli(tmp_path, "logs", "r-ok", "--follow", extra=extra).returncode == 0
    assert cli(tmp_path, "logs", "r-ok", extra=extra).returncode == 0  # a one-shot look notifies nothing
    events = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [(e["event"], e["run_id"]) for e in events] == [("crash", "r-oom"), ("completion", "r-ok")]
    assert events[0]["diagnosis"]["signature"] == "cuda-oom" and events[0]["diagnosis"]["fix"]


def test_the_follower_turns_data_events_into_lines_and_feeds_the_real_matcher():
    """The follower's data handling as pure logic (fast: the mutation run's selection): text and base64 events,
    CRLF endings, a final partial line, invalid UTF-8 shown as U+FFFD, a first event at a non-zero offset,
    an event with no text, and every line through the real matcher (a match reaches on_match)."""
    from orchestrator.ops.follow import _Follower
    from orchestrator.sigmatch import Matcher
    from orchestrator.signatures import load_catalogue

    lines: list[str] = []
    matches: list = []
    f = _Follower(on_line=lines.append, on_match=matches.append, on_alert=None, on_event=None,
                  matcher=Matcher(load_catalogue()), health=None)
    f.handle(Data(offset=100, next=108, text="ab\r\ncd\r\n"))  # no run event before it
    assert lines == ["ab", "cd"] and f.log_offset == 108 and f.lines == 2
    bad = b"caf\xe9\n"
    f.handle(Data(offset=108, next=113, b64=base64.b64encode(bad).decode()))
    f.handle(Data(offset=113, next=113, text=""))  # nothing new
    f.handle(Data(offset=113, next=142, text="Killed\nstill writing, no newline"))
    assert lines == ["ab", "cd", "caf\ufffd", "Killed", "still writing, no newline"] and f.lines == 5
    assert f.log_offset == 142
    f.finish_matcher()
    assert [m.signature for m in matches] == ["host-oom-kill"] and f.matches == matches
