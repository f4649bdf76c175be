"""The typed agent protocol (orchestrator.agent.requests): what the workstation builds is what the agent
accepts, and anything else is refused at the agent's door with one error naming the verb and the field."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import REQUESTS, LaunchRequest, StopRequest, TailRequest, WarmupRequest

REPO = Path(__file__).resolve().parents[3]


def agent(verb: str, request: dict) -> tuple[int, dict]:
    """Run the real agent process on `request`; (exit code, its last event)."""
    proc = subprocess.run([sys.executable, "-m", "orchestrator.agent", verb], input=json.dumps(request),
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    return proc.returncode, json.loads(proc.stdout.splitlines()[-1])


def test_every_verb_but_echo_has_a_request_type():
    verbs = {p.stem for p in (REPO / "orchestrator" / "agent" / "verbs").glob("*.py") if p.stem != "__init__"}
    assert set(REQUESTS) == verbs - {"echo"}


@pytest.mark.parametrize("verb", sorted(REQUESTS))
def test_a_request_survives_the_round_trip(verb):
    cls = REQUESTS[verb]
    required = {"run_id": "r-1", "experiment": "e", "kind": "command", "config": {"a": 1}}
    fields = {f for f in cls.__dataclass_fields__}
    req = cls(**{k: v for k, v in required.items() if k in fields}, workdir="/w")
    assert cls.from_json(json.loads(json.dumps(req.to_json()))) == req


def test_what_launch_sends_is_exactly_a_launch_request():
    from orchestrator.ops.launch import LaunchSpec, launch_request

    spec = LaunchSpec(experiment="e", kind="command", target="here", command=["true"], gpus=[1])
    sent = launch_request(spec, created="2026-01-01T00:00:00Z", run_id="e-1", cli="dflashctl launch e",
                          replace=False, grace_s=20.0, release_timeout_s=120.0, dry_run=True, resume=None,
                          warmup_device="cpu", claim_wait_s=5.0)
    assert set(sent) == {f.name for f in dataclasses.fields(LaunchRequest)} - {"workdir"}
    assert LaunchRequest.from_json(sent).gpus == [1]


@pytest.mark.parametrize("data, words", [
    ({"run_id": "r", "bogus": 1}, "stop request: unknown field 'bogus'"),
    ({"grace_s": 1.0}, "stop request: missing field 'run_id'"),
    ({"run_id": "r", "grace_s": "soon"}, "stop request: field 'grace_s' must be a number, got \"soon\""),
    ({"run_id": "r", "gpus": [1, True]}, "stop request: field 'gpus' must be a list of integers, got [1, true]"),
    ({"run_id": 7}, "stop request: field 'run_id' must be a string, got 7"),
])
def test_a_bad_request_names_the_verb_and_the_field(data, words):
    with pytest.raises(AgentFailure) as info:
        StopRequest.from_json(data)
    assert info.value.type == "BadRequest" and info.value.message.startswith(words)


def test_optional_fields_take_null_and_numbers_take_integers():
    req = TailRequest.from_json({"tail": None, "offset": 3, "heartbeat": 1})
    assert (req.tail, req.offset, req.heartbeat) == (None, 3, 1)
    with pytest.raises(AgentFailure, match="tail request: field 'offset' must be an integer, got true"):
        TailRequest.from_json({"offset": True})
    with pytest.raises(AgentFailure, match="warmup request: missing field 'config'"):
        WarmupRequest.from_json({"experiment": "e"})


def test_the_agent_refuses_a_bad_request_before_the_verb_runs(tmp_path):
    code, last = agent("stop", {"workdir": str(tmp_path), "run_id": "r-1", "grace": 3})
    assert code == 2 and last["event"] == "error" and last["type"] == "BadRequest"
    assert last["message"].startswith("stop request: unknown field 'grace' (known: ")
    assert "dflashctl rebuild-venv" in last["fix"]
    code, last = agent("status", {"workdir": str(tmp_path), "limit": "all"})
    assert code == 2 and last["message"] == 'status request: field \'limit\' must be an integer, got "all"'
    code, last = agent("echo", {"anything": [1, "goes"]})  # echo has no schema: it returns what it is given
    assert code == 0 and last["data"]["request"] == {"anything": [1, "goes"]}
