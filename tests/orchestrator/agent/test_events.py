"""The typed agent events (orchestrator.agent.events): what the agent writes is what the workstation reads,
and anything else is refused with one error naming the event kind and the field."""

from __future__ import annotations

import dataclasses
import io
import json
import sys

import pytest

from orchestrator.agent import events, requests
from orchestrator.agent.events import EVENTS, BadEvent, Data, Error, Heartbeat, Progress, Result
from orchestrator.agent.protocol import Emitter
from orchestrator.agent.requests import Answer
from orchestrator.errors import AgentError
from orchestrator.target import LocalTarget
from orchestrator.transport.local import LocalTransport

REQUIRED = {"step": "s", "type": "T", "message": "m", "run_id": "r", "offset": 3, "next": 5, "file": "train.log"}


@pytest.mark.parametrize("kind", sorted(EVENTS))
def test_an_event_survives_the_wire(kind):
    cls = EVENTS[kind]
    ev = cls(**{k: v for k, v in REQUIRED.items() if k in cls.__dataclass_fields__})
    out = io.StringIO()
    Emitter(out).send(ev)
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line)["event"] == kind and events.parse(json.loads(line)) == ev


def test_a_field_at_none_is_not_written_and_reads_back_as_none():
    assert Progress(step="warmup", message="CPU: compiling", gpu=None).to_json() == {
        "event": "progress", "step": "warmup", "message": "CPU: compiling"}
    assert events.parse({"event": "progress", "step": "warmup"}).gpu is None


@pytest.mark.parametrize("data, words", [
    ({"event": "progress", "step": "x", "bogus": 1}, "progress event: unknown field 'bogus'"),
    ({"event": "progress", "message": "no step"}, "progress event: missing field 'step'"),
    ({"event": "data", "offset": 0}, "data event: missing field 'next'"),
    ({"event": "data", "offset": "0", "next": 1}, "data event: field 'offset' must be an integer, got \"0\""),
    ({"event": "heartbeat", "log_size": True}, "heartbeat event: field 'log_size' must be an integer, got true"),
    ({"event": "run", "offset": 0}, "run event: missing field 'run_id'"),
    ({"event": "error", "type": "T"}, "error event: missing field 'message'"),
    ({"event": "result", "data": [1]}, "result event: field 'data' must be an object, got [1]"),
    ({"event": "log", "line": "x"}, "unknown event kind 'log' (known: data, error, heartbeat, metrics, progress, "
                                    "result, run, truncated)"),
    ({"step": "x"}, "unknown event kind None"),
])
def test_a_bad_event_names_the_kind_and_the_field(data, words):
    with pytest.raises(BadEvent) as info:
        events.parse(data)
    assert words in str(info.value)


def test_from_json_of_one_kind_refuses_another():
    with pytest.raises(BadEvent, match="progress event: its \"event\" is 'data'"):
        Progress.from_json({"event": "data", "offset": 0, "next": 0})


def test_emitting_a_progress_field_the_event_lacks_fails_in_the_agent():
    with pytest.raises(TypeError, match="bogus"):
        Emitter(io.StringIO()).progress("x", "y", bogus=1)


def test_data_gives_back_the_exact_bytes():
    assert Data(offset=0, next=3, text="a\u00e9").raw() == "a\u00e9".encode()
    assert Data(offset=0, next=4, b64="Y2Fm6Q==").raw() == b"caf\xe9"


class _Script(LocalTarget):
    """A LocalTarget whose "agent" is a script printing the given lines (what a mismatched bundle would send)."""

    lines: tuple = ()

    def agent_argv(self, verb: str) -> list[str]:
        return [sys.executable, "-c", "import sys; sys.stdin.read(); print(sys.argv[1])", "\n".join(self.lines)]

    def _run_agent(self, verb, payload, stream, timeout):
        return self.transport.run(self.agent_argv(verb), stdin=payload, timeout=timeout, on_stdout=stream.feed)


def _target(tmp_path, *lines: str) -> _Script:
    t = _Script(name="here", workdir=str(tmp_path), transport=LocalTransport())
    t.lines = lines
    return t


def test_the_workstation_hands_typed_events_on_and_returns_the_result(tmp_path):
    seen: list = []
    t = _target(tmp_path, json.dumps({"event": "progress", "step": "a", "message": "b"}),
                "a library's stray line", json.dumps({"event": "heartbeat", "log_size": 4}),
                json.dumps({"event": "result", "data": {"ok": 1}}))
    assert t.agent("echo", on_event=seen.append) == {"ok": 1}
    assert seen == [Progress(step="a", message="b"), Heartbeat(log_size=4)]


def test_an_error_event_becomes_the_agent_error(tmp_path):
    t = _target(tmp_path, json.dumps(Error(type="GpuBusy", message="GPU 1 busy", fix="wait", data={"g": 1}).to_json()))
    with pytest.raises(AgentError) as info:
        t.agent("launch")
    assert (info.value.agent_type, info.value.message, info.value.fix, info.value.data) == (
        "GpuBusy", "GPU 1 busy", "wait", {"g": 1})


def test_an_event_the_workstation_cannot_read_fails_the_call_naming_it(tmp_path):
    seen: list = []
    t = _target(tmp_path, json.dumps({"event": "progress", "step": "a", "colour": "red"}),
                json.dumps(Result(data={"ok": 1}).to_json()))
    with pytest.raises(AgentError) as info:
        t.agent("launch", on_event=seen.append)
    assert info.value.agent_type == "BadEvent" and seen == []
    assert "agent launch on here sent an event this workstation cannot read: progress event: unknown field " \
           "'colour'" in info.value.message


# ------------------------------------------------------------------------------------------- verbs' answers


@pytest.mark.parametrize("cls", [c for c in vars(requests).values()
                                 if isinstance(c, type) and issubclass(c, Answer) and c is not Answer])
def test_an_answer_survives_the_wire(cls):
    needed = {"run_id": "r", "run_dir": "/w/runs/r", "session": "dflash-e", "command": ["true"], "gpus": [1],
              "state": "succeeded", "experiment": "e", "dir": "/w/warmup/e", "config": "/w/warmup/e/config.json",
              "cache_dir": "/w/inductor-cache", "hostname": "h", "workdir": "/w"}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    ans = cls(**{k: needed[k] for k in required})
    assert cls.from_json(json.loads(json.dumps(ans.to_json()))) == ans


@pytest.mark.parametrize("cls, data, words", [
    (requests.TailAnswer, {"run_id": "r", "state": "running", "colour": 1}, "tail result: unknown field 'colour'"),
    (requests.StopAnswer, {"run_id": "r"}, "stop result: missing field 'state'"),
    (requests.LaunchAnswer, {"run_id": "r", "run_dir": "d", "session": "s", "command": "true", "gpus": []},
     "launch result: field 'command' must be a list of strings, got \"true\""),
    (requests.StatusAnswer, {"hostname": "h", "workdir": "/w", "total_runs": "3"},
     "status result: field 'total_runs' must be an integer, got \"3\""),
    (requests.MetricsAnswer, [], "metrics result: must be a JSON object, got list"),
])
def test_an_answer_that_does_not_fit_names_the_verb_and_the_field(cls, data, words):
    with pytest.raises(BadEvent) as info:
        cls.from_json(data)
    assert words in str(info.value)


def test_the_workstation_reads_a_typed_answer_or_refuses_one_it_cannot_read(tmp_path):
    t = _target(tmp_path, json.dumps(Result(data={"run_id": "r", "state": "succeeded"}).to_json()))
    assert t.agent("tail", answer=requests.TailAnswer) == requests.TailAnswer(run_id="r", state="succeeded")
    t = _target(tmp_path, json.dumps(Result(data={"run_id": "r", "status": "succeeded"}).to_json()))
    with pytest.raises(AgentError) as info:
        t.agent("tail", answer=requests.TailAnswer)
    assert info.value.agent_type == "BadEvent" and info.value.message.startswith(
        "agent tail on here answered what this workstation cannot read: tail result: unknown field 'status'")
