"""The agent's `tail` verb and its helpers, on real files written by real processes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from orchestrator.agent.protocol import AgentFailure, Emitter
from orchestrator.agent.rundirs import resolve_run
from orchestrator.agent.tailer import DirWatcher, LineCursor, MAX_LINE, tail_offset
from orchestrator.agent.verbs import tail as tail_verb


class Events:
    """An Emitter sink that parses every event line (thread-safe through Emitter's lock)."""

    def __init__(self):
        self.buf = io.StringIO()
        self.emit = Emitter(self.buf)

    def all(self) -> list[dict]:
        return [json.loads(line) for line in self.buf.getvalue().splitlines()]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.all() if e["event"] == kind]


def make_run(workdir: Path, run_id: str, experiment: str = "exp", created: str = "2026-01-01T00:00:00Z",
             session: str | None = None) -> Path:
    run = workdir / "runs" / run_id
    run.mkdir(parents=True)
    info = {"experiment": experiment, "run_id": run_id, "created": created}
    if session:
        info["session"] = session
    (run / "run.json").write_text(json.dumps(info))
    return run


def text_of(events: list[dict]) -> bytes:
    import base64

    out = b""
    for ev in events:
        out += base64.b64decode(ev["b64"]) if "b64" in ev else ev["text"].encode()
    return out


@pytest.fixture(autouse=True)
def _own_tmux(tmp_path, monkeypatch):
    # A private tmux socket directory: no session of another test (or of the user) is ever seen.
    d = tmp_path / "tmux"
    d.mkdir()
    monkeypatch.setenv("TMUX_TMPDIR", str(d))


# ---------------------------------------------------------------------------------------- pure pieces


@pytest.mark.parametrize(
    "content,n,expected",
    [
        (b"a\nb\nc\n", 2, 2),
        (b"a\nb\nc\n", 3, 0),
        (b"a\nb\nc\n", 10, 0),
        (b"a\nb\nc\n", 0, 6),
        (b"a\nb\nc\npart", 1, 4),
        (b"a\nb\nc\npart", 0, 6),
        (b"", 5, 0),
        (b"only partial", 1, 0),
    ],
)
def test_tail_offset(tmp_path, content, n, expected):
    path = tmp_path / "log"
    path.write_bytes(content)
    assert tail_offset(path, n) == expected


def test_tail_offset_spans_blocks(tmp_path):
    path = tmp_path / "log"
    lines = [f"line {i:06d} " + "x" * 50 + "\n" for i in range(5000)]
    path.write_text("".join(lines))
    off = tail_offset(path, 1234)
    assert path.read_bytes()[off:].decode() == "".join(lines[-1234:])
    assert tail_offset(tmp_path / "absent", 3) == 0


def test_cursor_holds_partial_line_until_newline(tmp_path):
    path = tmp_path / "log"
    cur = LineCursor(path, 0)
    assert cur.read() == []  # no file yet
    path.write_bytes(b"one\ntw")
    assert cur.read() == [(0, b"one\n")]
    assert cur.read() == []
    with open(path, "ab") as fh:
        fh.write(b"o\nthr")
    assert cur.read() == [(4, b"two\n")]
    assert cur.read(final=True) == [(8, b"thr")]
    assert cur.offset == 11


def test_cursor_splits_big_chunks_at_newlines_and_gives_up_on_endless_lines(tmp_path):
    path = tmp_path / "log"
    body = b"".join(b"%07d\n" % i for i in range(100_000))  # 800 KB
    path.write_bytes(body + b"y" * (MAX_LINE + 10))
    cur = LineCursor(path, 0)
    got = []
    while True:
        chunks = cur.read()
        if not chunks:
            break
        got.extend(chunks)
    assert b"".join(c for _, c in got[:-1]) == body
    assert all(c.endswith(b"\n") for _, c in got[:-1])
    # a line longer than MAX_LINE without a newline is handed out rather than held forever
    assert got[-1][1].startswith(b"y") and len(got[-1][1]) == MAX_LINE
    starts = [s for s, _ in got]
    assert starts == sorted(starts) and starts[0] == 0


def test_cursor_restarts_after_truncation(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"aaaa\nbbbb\n")
    cur = LineCursor(path, 10)
    path.write_bytes(b"c\n")
    assert cur.read() == [(0, b"c\n")]
    assert cur.truncations == 1


def test_dir_watcher_wakes_on_write(tmp_path):
    w = DirWatcher(tmp_path, fallback=0.05)
    if not w.uses_inotify:
        pytest.skip("no inotify on this kernel")
    threading.Timer(0.2, lambda: (tmp_path / "f").write_text("x\n")).start()
    t0 = time.monotonic()
    w.wait(5.0)
    assert 0.1 < time.monotonic() - t0 < 2.0
    w.close()


def test_resolve_run(tmp_path):
    make_run(tmp_path, "a-1", "a", "2026-01-01T00:00:00Z")
    make_run(tmp_path, "a-2", "a", "2026-01-02T00:00:00Z")
    make_run(tmp_path, "b-1", "b", "2026-01-03T00:00:00Z")
    assert resolve_run(tmp_path, experiment="a").run_id == "a-2"
    assert resolve_run(tmp_path).run_id == "b-1"
    assert resolve_run(tmp_path, "a-1").run_id == "a-1"
    for bad in ({"run_id": "nope"}, {"experiment": "c"}, {"run_id": "../etc"}):
        with pytest.raises(AgentFailure) as err:
            resolve_run(tmp_path, bad.get("run_id"), bad.get("experiment"))
        assert err.value.type == "RunNotFound"
    with pytest.raises(AgentFailure) as err:
        resolve_run(tmp_path, "nope")
    assert "b-1" in err.value.message  # names the runs there are


# ---------------------------------------------------------------------------------------- the verb

WRITER = textwrap.dedent(
    """
    import json, os, random, sys, time
    run_dir, n = sys.argv[1], int(sys.argv[2])
    rng = random.Random(7)
    with open(os.path.join(run_dir, "train.log"), "ab", buffering=0) as log, \\
         open(os.path.join(run_dir, "metrics.jsonl"), "ab", buffering=0) as met:
        pending = b""
        for i in range(n):
            pending += b"line %06d\\n" % i
            if rng.random() < 0.02 or i == n - 1:
                # write in two pieces, the first ending mid-line, so readers see partial lines
                cut = rng.randrange(1, len(pending))
                log.write(pending[:cut]); time.sleep(0.0005); log.write(pending[cut:])
                pending = b""
            if i % 1000 == 0:
                met.write(json.dumps({"step": i, "tokens_per_s": 100.0}).encode() + b"\\n")
        log.write(b"no newline at the end")
    tmp = os.path.join(run_dir, ".exit.json.tmp")
    with open(tmp, "w") as fh:
        json.dump({"exit_code": 3, "signal": None, "started": "s", "ended": "e"}, fh)
    os.rename(tmp, os.path.join(run_dir, "exit.json"))
    """
)


def test_follow_streams_every_line_of_a_live_writer_once(tmp_path):
    run = make_run(tmp_path, "r1")
    ev = Events()
    n = 20_000
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(run), str(n)])
    (run / "pid").write_text(str(writer.pid))  # no tmux session: the pid file says it runs
    result = tail_verb.run({"workdir": str(tmp_path), "run_id": "r1", "follow": True, "heartbeat": 0.5}, ev.emit)
    assert writer.wait(30) == 0
    data = ev.of("data")
    expected = b"".join(b"line %06d\n" % i for i in range(n)) + b"no newline at the end"
    assert text_of(data) == expected
    # contiguous byte ranges; every chunk but the flushed last one ends on a newline
    pos = 0
    for e in data:
        assert e["offset"] == pos
        pos = e["next"]
    assert all(e["text"].endswith("\n") for e in data[:-1])
    assert result["state"] == "failed" and result["exit"]["exit_code"] == 3
    assert result["offsets"]["log"] == len(expected)
    records = [r for e in ev.of("metrics") for r in e["records"]]
    assert [r["step"] for r in records] == list(range(0, n, 1000))
    assert ev.all()[0]["event"] == "run" and ev.all()[-1]["event"] in ("data", "metrics", "heartbeat")


def test_resume_from_offset_and_tail(tmp_path):
    run = make_run(tmp_path, "r1")
    body = b"".join(b"l%d\n" % i for i in range(100))
    (run / "train.log").write_bytes(body)
    (run / "exit.json").write_text('{"exit_code": 0}')
    ev = Events()
    off = body.index(b"l50\n")
    res = tail_verb.run({"workdir": str(tmp_path), "run_id": "r1", "offset": off, "follow": True}, ev.emit)
    assert text_of(ev.of("data")) == body[off:]
    assert res["state"] == "succeeded"
    ev = Events()
    tail_verb.run({"workdir": str(tmp_path), "run_id": "r1", "tail": 3}, ev.emit)
    assert text_of(ev.of("data")) == b"l97\nl98\nl99\n"
    assert ev.of("run")[0]["offset"] == body.index(b"l97\n")


def test_non_utf8_bytes_travel_exactly(tmp_path):
    run = make_run(tmp_path, "r1")
    body = b"ok\n\xff\xfe bad bytes\n"
    (run / "train.log").write_bytes(body)
    (run / "exit.json").write_text('{"exit_code": 0}')
    ev = Events()
    tail_verb.run({"workdir": str(tmp_path), "run_id": "r1", "follow": True}, ev.emit)
    assert text_of(ev.of("data")) == body
    assert any("b64" in e for e in ev.of("data"))


def _tmux(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10)


def test_live_session_is_running_and_partial_line_is_held(tmp_path):
    run = make_run(tmp_path, "r1", experiment="tailtest")
    (run / "train.log").write_bytes(b"done\nhalf a li")
    assert _tmux("new-session", "-d", "-s", "dflash-tailtest", "sleep 60").returncode == 0
    try:
        ev = Events()
        res = tail_verb.run({"workdir": str(tmp_path), "run_id": "r1"}, ev.emit)
        assert res["state"] == "running" and res["session_alive"] is True
        assert text_of(ev.of("data")) == b"done\n"
        assert res["offsets"]["log"] == 5
    finally:
        _tmux("kill-session", "-t", "dflash-tailtest")


def test_session_gone_without_exit_json_is_a_crash(tmp_path):
    run = make_run(tmp_path, "r1", experiment="tailtest2")
    (run / "train.log").write_bytes(b"step 1\nKilled")
    assert _tmux("new-session", "-d", "-s", "dflash-tailtest2", "sleep 1").returncode == 0
    ev = Events()
    t0 = time.monotonic()
    res = tail_verb.run({"workdir": str(tmp_path), "run_id": "r1", "follow": True, "heartbeat": 0.2}, ev.emit)
    assert res["state"] == "crashed" and res["exit"] is None
    assert time.monotonic() - t0 >= 0.8  # it followed while the session lived
    assert text_of(ev.of("data")) == b"step 1\nKilled"  # the partial last line is flushed at the end
    hb = ev.of("heartbeat")
    assert hb and hb[0]["session_alive"] is True and hb[0]["log_size"] == len(b"step 1\nKilled")


def test_pid_file_tells_liveness_without_a_session(tmp_path, monkeypatch):
    run = make_run(tmp_path, "r1", experiment="nosession")
    proc = subprocess.Popen(["sleep", "30"])
    try:
        (run / "pid").write_text(str(proc.pid))
        monkeypatch.setattr("orchestrator.agent.liveness.session_alive", lambda ref, sessions=None: None)
        ev = Events()
        assert tail_verb.run({"workdir": str(tmp_path), "run_id": "r1"}, ev.emit)["state"] == "running"
        proc.kill()
        proc.wait()
        assert tail_verb.run({"workdir": str(tmp_path), "run_id": "r1"}, ev.emit)["state"] == "crashed"
    finally:
        proc.kill()


def test_baseline_is_the_last_good_run_of_the_experiment(tmp_path):
    def finished(run_id, created, code, tps):
        run = make_run(tmp_path, run_id, "exp", created)
        (run / "exit.json").write_text(json.dumps({"exit_code": code}))
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tokens_per_s": v}) + "\n"
                                                   for i, v in enumerate(tps)))

    finished("exp-1", "2026-01-01", 0, [1, 1, 1, 10, 20, 30, 40, 50])
    finished("exp-2", "2026-01-02", 1, [99] * 8)  # failed: not a baseline
    other = make_run(tmp_path, "other-1", "other", "2026-01-02")
    (other / "exit.json").write_text('{"exit_code": 0}')
    cur = make_run(tmp_path, "exp-3", "exp", "2026-01-03")
    (cur / "exit.json").write_text('{"exit_code": 0}')
    ev = Events()
    tail_verb.run({"workdir": str(tmp_path), "run_id": "exp-3", "baseline": True}, ev.emit)
    base = ev.of("run")[0]["baseline"]
    assert base == {"run_id": "exp-1", "tokens_per_s": 30.0, "samples": 5}


def test_agent_process_reports_run_not_found(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    proc = subprocess.run([sys.executable, "-m", "orchestrator.agent", "tail"],
                          input=json.dumps({"workdir": str(tmp_path), "run_id": "missing"}),
                          capture_output=True, text=True, env=env, timeout=30)
    last = json.loads(proc.stdout.splitlines()[-1])
    assert proc.returncode == 1 and last["event"] == "error" and last["type"] == "RunNotFound"
