"""Property test of the follow (orchestrator.ops.follow.follow + the agent's `tail` verb): whatever the
log holds and wherever the connection is cut, the follower prints exactly the log's lines, once, in order, and
the agent never sends again a byte the follower already received: every reconnect asks for the end of the last
complete event, and the data events received whole tile the file exactly.

Real parts: the real agent process (`python -m orchestrator.agent tail`), the real client (LocalTarget.agent's
event stream and follow's reconnect loop). The cut: a transport that hands the client only the first N bytes of
the agent's stdout and then SIGKILLs the agent, as a dropped connection does (the client sees a stream that
stops mid-event and an agent that died without a result)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orchestrator.bundle import source_root
from orchestrator.ops.follow import Backoff, follow
from orchestrator.target import LocalTarget
from orchestrator.transport.base import Result

NO_WAIT = Backoff(initial=0.0, factor=1.0, cap=0.0, jitter=0.0, give_up_s=120)


class CuttingTransport:
    """Runs the agent locally; exec number k is cut after `cuts[k]` bytes of its stdout (None: not cut)."""

    name = "cutting"

    def __init__(self, cuts: list[int | None]):
        self.cuts = list(cuts)
        self.execs: list[dict] = []  # per exec: the request, the bytes the client got, the cut

    def run(self, argv, *, stdin=None, timeout=None, on_stdout=None, on_stderr=None) -> Result:
        cut = self.cuts.pop(0) if self.cuts else None
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(source_root()), os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=env)
        proc.stdin.write(stdin or b"")
        proc.stdin.close()
        got = bytearray()
        while True:
            chunk = proc.stdout.read1(65536)
            if not chunk:
                break
            if cut is not None and len(got) + len(chunk) >= cut:
                chunk = chunk[: cut - len(got)]
                got += chunk
                if chunk:
                    on_stdout(chunk)
                proc.kill()  # the connection drops here: whatever the agent sends next is lost
                break
            got += chunk
            on_stdout(chunk)
        proc.stdout.close()
        code = proc.wait()
        self.execs.append({"request": json.loads(stdin), "got": bytes(got), "cut": cut})
        return Result(list(argv), code, b"", b"", self.name)

    def close(self) -> None:
        pass


def data_events(stream: bytes) -> list[tuple[int, int]]:
    """(offset, next) of every data event that arrived WHOLE (its JSON line and newline) in `stream`."""
    out = []
    for raw in stream.split(b"\n")[:-1]:
        ev = json.loads(raw)
        if ev.get("event") == "data":
            payload = ev["text"].encode() if "text" in ev else __import__("base64").b64decode(ev["b64"])
            assert len(payload) == ev["next"] - ev["offset"]
            out.append((ev["offset"], ev["next"]))
    return out


LINE = st.binary(max_size=60).map(lambda b: b.replace(b"\n", b""))


@st.composite
def log_bytes(draw) -> bytes:
    """Random lines (any bytes: text, invalid UTF-8, \\r) between blocks of numbered lines big enough to need
    several data events (256 KiB each), sometimes one line longer than an event, maybe no final newline."""
    parts = []
    for block in range(draw(st.integers(1, 4))):
        parts += [line + b"\n" for line in draw(st.lists(LINE, max_size=12))]
        n = draw(st.sampled_from([0, 500, 25_000]))
        parts.append(b"".join(b"block %d line %07d\n" % (block, i) for i in range(n)))
        if draw(st.integers(0, 5)) == 0:
            parts.append(b"y" * 300_000 + b"\n")
    return b"".join(parts) + draw(LINE)


# A cut anywhere in an exec's stdout: often early (inside the first events), sometimes never.
CUT = st.one_of(st.none(), st.integers(0, 300), st.integers(0, 1_500_000))


def expected_lines(content: bytes) -> list[str]:
    lines = content.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    out = []
    for line in lines:
        text = line.decode("utf-8", errors="replace")
        out.append(text[:-1] if text.endswith("\r") else text)
    return out


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(content=log_bytes(), cuts=st.lists(CUT, max_size=5))
@example(content=b"".join(b"line %07d\n" % i for i in range(60_000)), cuts=[400_000, 1, 0, 300_000, 200])
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_random_cuts_give_the_exact_stream_and_no_byte_is_sent_twice(tmp_path_factory, content, cuts):
    workdir = tmp_path_factory.mktemp("follow")
    run = workdir / "runs" / "prop-20260101T000000Z"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run.name, "experiment": "prop",
                                              "created": "2026-01-01T00:00:00Z"}))
    (run / "train.log").write_bytes(content)
    (run / "exit.json").write_text(json.dumps({"exit_code": 0}))
    transport = CuttingTransport(cuts)
    lines: list[str] = []
    out = follow(LocalTarget(name="local", workdir=str(workdir), transport=transport), run.name,
                 on_line=lines.append, backoff=NO_WAIT, sleep=lambda s: None, heartbeat=0.5)

    assert out.state == "succeeded" and out.reconnects == len(transport.execs) - 1
    assert lines == expected_lines(content)
    delivered = 0  # the end of the last data event the client received whole
    for n, ex in enumerate(transport.execs):
        asked = ex["request"]["offset"]
        assert asked == delivered, f"exec {n} asked for offset {asked}, but bytes up to {delivered} had arrived"
        ranges = data_events(ex["got"])
        for start, end in ranges:
            assert start == delivered, f"exec {n} sent bytes {start}..{end} when {delivered} had arrived"
            delivered = end
    assert delivered == len(content) == out.offsets["log"]  # the whole file, each byte once
