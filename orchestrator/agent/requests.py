"""The agent's requests, typed: one frozen dataclass per verb, shared by the workstation (ops build them,
`to_json`) and the agent (`from_json` checks what arrives before the verb runs). Standard library only.

`from_json` refuses an unknown field, a missing one and a value of the wrong type with ONE error that names
the verb and the field (AgentFailure "BadRequest"): a workstation and a bundle that disagree about the
protocol say so at once instead of a verb reading a default. Every request also carries `workdir` (the
target's, added by Target.agent). `echo` has no schema: it returns whatever it is given (tests, benchmarks).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from orchestrator.agent.protocol import AgentFailure

_ATOMS = {"str": str, "int": int, "float": (int, float), "bool": bool, "dict": dict, "list": list, "Any": object}


@dataclass(frozen=True, kw_only=True)
class Request:
    """Base of every verb's request (the verb's name in VERB)."""

    VERB: ClassVar[str] = ""
    workdir: str = ""

    def to_json(self) -> dict[str, Any]:
        """The JSON object the agent reads (without `workdir` when it is empty: Target.agent adds it)."""
        out = dataclasses.asdict(self)
        if not out["workdir"]:
            del out["workdir"]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        """The request `data` describes.

        Raises:
            AgentFailure("BadRequest"): `data` is not an object, has a field this verb does not know or lacks
                one it needs, or a value of the wrong type; the message names the verb and the field.
        """
        if not isinstance(data, dict):
            raise AgentFailure("BadRequest", f"{cls.VERB} request: must be a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise AgentFailure("BadRequest", f"{cls.VERB} request: unknown field {unknown[0]!r} "
                               f"(known: {', '.join(sorted(fields))})",
                               fix="the workstation and the container's bundle differ: dflashctl rebuild-venv")
        hints = typing.get_type_hints(cls)
        for name, f in fields.items():
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if name not in data:
                if required:
                    raise AgentFailure("BadRequest", f"{cls.VERB} request: missing field {name!r}")
                continue
            if not _fits(data[name], hints[name]):
                raise AgentFailure("BadRequest", f"{cls.VERB} request: field {name!r} must be "
                                   f"{_describe(hints[name])}, got {_json(data[name])}")
        return cls(**data)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's annotation (str, int, float, bool, dict, list, their | None)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint) or hint
    if origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict)
    if origin is Any:
        return True
    if isinstance(value, bool) and origin in (int, float):
        return False  # JSON true is not a number
    if origin is float:
        return isinstance(value, (int, float))
    return isinstance(value, origin)


def _json(value: Any) -> str:
    """A value as the JSON it arrived as (`true`, `"soon"`), shortened."""
    import json

    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint) or hint
    if origin is list and args:
        return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(args[0], _describe(args[0]))
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
            list: "a list"}.get(origin, getattr(origin, "__name__", str(origin)))


@dataclass(frozen=True, kw_only=True)
class StatusRequest(Request):
    VERB: ClassVar[str] = "status"
    limit: int = 20
    gpu_timeout: float = 30.0


@dataclass(frozen=True, kw_only=True)
class StopRequest(Request):
    VERB: ClassVar[str] = "stop"
    run_id: str
    grace_s: float = 20.0
    gpus: list[int] = field(default_factory=list)
    gpu_idle_mib: int = 1024
    release_timeout_s: float = 120.0
    requested_by: dict | None = None
    lost_cause: dict | None = None
    """A run across targets whose node here vanished without exit.json: the run's root cause to record."""


@dataclass(frozen=True, kw_only=True)
class MetricsRequest(Request):
    VERB: ClassVar[str] = "metrics"
    run_id: str | None = None
    experiment: str | None = None
    max_rows: int = 2000


@dataclass(frozen=True, kw_only=True)
class PingRequest(Request):
    VERB: ClassVar[str] = "ping"
    venv_profile: dict | None = None
    gpu_timeout: float = 30.0


@dataclass(frozen=True, kw_only=True)
class GpusRequest(Request):
    VERB: ClassVar[str] = "gpus"
    timeout: float = 30.0


@dataclass(frozen=True, kw_only=True)
class FingerprintRequest(Request):
    VERB: ClassVar[str] = "fingerprint"
    profile: dict | None = None
    expected_lock_hash: str | None = None


@dataclass(frozen=True, kw_only=True)
class TailRequest(Request):
    VERB: ClassVar[str] = "tail"
    run_id: str | None = None
    experiment: str | None = None
    follow: bool = False
    offset: int = 0
    tail: int | None = None
    metrics: bool | None = None
    """Send metrics.jsonl too (default: when following)."""
    metrics_offset: int = 0
    poll: float = 0.05
    heartbeat: float = 2.0
    baseline: bool = False


@dataclass(frozen=True, kw_only=True)
class WarmupRequest(Request):
    VERB: ClassVar[str] = "warmup"
    experiment: str
    config: dict
    layout: dict | None = None
    gpu_idle_mib: int = 1024
    device: str = "cuda"
    claim_wait_s: float = 5.0


@dataclass(frozen=True, kw_only=True)
class LaunchRequest(Request):
    """See orchestrator/agent/verbs/launch.py for what each field does."""

    VERB: ClassVar[str] = "launch"
    experiment: str
    run_id: str
    kind: str
    tag: str | None = None
    target: str | None = None
    command: list[str] | None = None
    env: dict | None = None
    gpus: list[int] = field(default_factory=list)
    layout: dict | None = None
    config: dict | None = None
    gpu_idle_mib: int = 1024
    venv_profile: dict | None = None
    lock_hash: str | None = None
    bundle_hash: str | None = None
    cli: str | None = None
    created: str | None = None
    replace: bool = False
    grace_s: float = 20.0
    release_timeout_s: float = 120.0
    dry_run: bool = False
    resume: str | None = None
    warmup_device: str = "cuda"
    claim_wait_s: float = 5.0
    requested_by: dict | None = None
    node: dict | None = None
    """A layout across targets: this node's {index, count, targets} (orchestrator.ops.nodes); None: one node."""


REQUESTS: dict[str, type[Request]] = {cls.VERB: cls for cls in (
    StatusRequest, StopRequest, MetricsRequest, PingRequest, GpusRequest, FingerprintRequest, TailRequest,
    WarmupRequest, LaunchRequest)}
