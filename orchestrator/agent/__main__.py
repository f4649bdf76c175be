"""`python -m orchestrator.agent VERB`: read the request, run the verb, stream events."""

from __future__ import annotations

import importlib
import json
import re
import sys
import traceback

from orchestrator.agent.protocol import AgentFailure, Emitter
from orchestrator.agent.requests import REQUESTS

_VERB = re.compile(r"[a-z][a-z0-9_-]{0,40}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    emit = Emitter()
    if len(argv) != 1 or not _VERB.fullmatch(argv[0]):
        emit.error("BadVerb", f"usage: python -m orchestrator.agent VERB (got {argv!r})")
        return 2
    verb = argv[0].replace("-", "_")
    try:
        module = importlib.import_module(f"orchestrator.agent.verbs.{verb}")
    except ModuleNotFoundError as exc:
        if exc.name == f"orchestrator.agent.verbs.{verb}":
            emit.error("UnknownVerb", f"the agent has no verb {argv[0]!r}", fix="update the bundle (dflashctl rebuild-venv)")
            return 2
        emit.error("ModuleNotFoundError", f"agent verb {argv[0]!r} cannot import {exc.name!r}: {exc}")
        return 1
    raw = sys.stdin.read()
    if not raw.strip():  # Target.agent always sends one; none: a call started early and dropped (preconnect)
        emit.error("NoRequest", f"agent {argv[0]!r} got no request on stdin: nothing done")
        return 2
    try:
        request = json.loads(raw)
        if not isinstance(request, dict):
            raise ValueError("request must be a JSON object")
    except ValueError as exc:
        emit.error("BadRequest", f"agent request is not a JSON object: {exc}")
        return 2
    schema = REQUESTS.get(verb)
    try:
        if schema is not None:
            schema.from_json(request)  # every field known, present and of its type, before the verb runs
    except AgentFailure as exc:
        emit.error(exc.type, exc.message, exc.fix, exc.data)
        return 2
    try:
        data = module.run(request, emit)
    except AgentFailure as exc:
        emit.error(exc.type, exc.message, exc.fix, exc.data)
        return 1
    except Exception as exc:  # noqa: BLE001 - every failure must become an error event, with its traceback
        emit.error(type(exc).__name__, f"agent verb {argv[0]!r} crashed: {exc}", data={"traceback": traceback.format_exc()})
        return 1
    emit.result(data if data is not None else {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
