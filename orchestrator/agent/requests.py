"""The agent's requests, typed: one frozen dataclass per verb, shared by the workstation (ops build them,
`to_json`) and the agent (`from_json` checks what arrives before the verb runs). Standard library only.

`from_json` refuses an unknown field, a missing one and a value of the wrong type with ONE error that names
the verb and the field (AgentFailure "BadRequest"): a workstation and a bundle that disagree about the
protocol say so at once instead of a verb reading a default. Every request also carries `workdir` (the
target's, added by Target.agent). `echo` has no schema: it returns whatever it is given (tests, benchmarks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.schema import schema_problem


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
        problem = schema_problem(cls, data)
        if problem is not None:
            raise AgentFailure("BadRequest", f"{cls.VERB} request: {problem.message}",
                               fix="the workstation and the container's bundle differ: dflashctl rebuild-venv"
                               if problem.unknown else None)
        return cls(**data)


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
