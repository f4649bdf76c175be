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

# The defaults of the protocol, in this one place: ops/ default their arguments to these, the agent reads the
# request's values (its dataclass fills these in for a field the request leaves out).
DEFAULT_GRACE_S = 20.0
"""Seconds between SIGINT, SIGTERM and SIGKILL when a run is stopped."""
DEFAULT_RELEASE_TIMEOUT_S = 120.0
DEFAULT_CLAIM_WAIT_S = 5.0
DEFAULT_GPU_IDLE_MIB = 1024
"""A GPU using less memory than this (MiB) counts as idle."""


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
    grace_s: float = DEFAULT_GRACE_S
    gpus: list[int] = field(default_factory=list)
    gpu_idle_mib: int = DEFAULT_GPU_IDLE_MIB
    release_timeout_s: float = DEFAULT_RELEASE_TIMEOUT_S
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
    gpu_idle_mib: int = DEFAULT_GPU_IDLE_MIB
    device: str = "cuda"
    claim_wait_s: float = DEFAULT_CLAIM_WAIT_S


@dataclass(frozen=True, kw_only=True)
class LaunchRequest(Request):
    """A launch (orchestrator/agent/verbs/launch.py); built by orchestrator/ops/launch.py, whose names the
    workstation checked and the agent checks again."""

    VERB: ClassVar[str] = "launch"
    experiment: str
    run_id: str
    """The run id the workstation made (orchestrator.names.run_id); a clash gets -2, -3, ... in the target."""
    kind: str
    """"dflash" (the bundled trainer) or "command" (any argv)."""
    tag: str | None = None
    target: str | None = None
    """The target's name, recorded and named in fixes."""
    command: list[str] | None = None
    """kind command: the argv."""
    env: dict | None = None
    """kind command: extra environment variables."""
    secret_env: list[str] = field(default_factory=list)
    """The keys of `env` whose values are secret: kept out of run.json, launch.env0 and the plan
    (orchestrator.agent.runcommand.SECRET_FILE)."""
    gpus: list[int] = field(default_factory=list)
    """Every GPU the run occupies (checked idle, claimed; CUDA_VISIBLE_DEVICES for kind command)."""
    layout: dict | None = None
    """The experiment's layout ({target_gpus, drafter_gpus}; across nodes: this node's)."""
    config: dict | None = None
    """kind dflash: the resolved TrainConfig, layout section included."""
    gpu_idle_mib: int = DEFAULT_GPU_IDLE_MIB
    venv_profile: dict | None = None
    lock_hash: str | None = None
    """The lock the venv must match; None: no lock to compare (the workstation interpreter)."""
    bundle_hash: str | None = None
    """The hash of the bundle the workstation sent (the one this agent runs from), recorded in run.json."""
    cli: str | None = None
    created: str | None = None
    """When the workstation made the run id (ISO 8601, UTC)."""
    replace: bool = False
    """Stop the experiment's live run first (SIGINT, SIGTERM, SIGKILL after grace_s) and wait for its GPUs."""
    grace_s: float = DEFAULT_GRACE_S
    release_timeout_s: float = DEFAULT_RELEASE_TIMEOUT_S
    """How long --replace waits for the stopped run's GPUs to be released."""
    dry_run: bool = False
    resume: str | None = None
    """A run id of this experiment: continue that run in a new run."""
    warmup_device: str = "cuda"
    """The warm-ups' --device ("cpu" only for tests on a machine without a GPU)."""
    claim_wait_s: float = DEFAULT_CLAIM_WAIT_S
    """How long to wait for another launch's preflight holding one of the GPUs (it may fail and free it)."""
    requested_by: dict | None = None
    """{by: "user@workstation"}: recorded in the stop.json of a run --replace stops."""
    node: dict | None = None
    """A layout across targets: this node's {index, count, targets} (orchestrator.ops.nodes); None: one node."""
    data_venv_profile: dict | None = None
    """kind dflash: the venv profile the data stage runs in ({name, kind, lock, ...}); None: the training venv."""
    data_lock_hash: str | None = None
    """The lock the data venv must match (a uv profile); None: nothing to compare."""
    data_only: bool = False
    """kind dflash: run the data stage alone (regenerate), no training."""


@dataclass(frozen=True, kw_only=True)
class Answer:
    """Base of a verb's answer (the data of its Result event), typed on both sides: the verb returns one
    (`to_json`), the op reads it back (`from_json`) field by field."""

    VERB: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        """The answer `data` describes.

        Raises:
            BadEvent: not an object, a field this side does not know, a missing one or one of the wrong type;
                the message names the verb and the field.
        """
        from orchestrator.agent.events import BadEvent

        if not isinstance(data, dict):
            raise BadEvent(f"{cls.VERB} result: must be a JSON object, got {type(data).__name__}")
        problem = schema_problem(cls, data)
        if problem is not None:
            raise BadEvent(f"{cls.VERB} result: {problem.message}")
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class LaunchAnswer(Answer):
    """The launch verb's result (orchestrator.agent.preflight.LaunchPlan.answer), read by ops/launch.py."""

    VERB: ClassVar[str] = "launch"
    run_id: str
    run_dir: str
    session: str
    command: list[str]
    gpus: list[int]
    replaced: str | None = None
    """The live run --replace stopped (a dry run: the run, or the session without one, it would stop)."""
    replaced_stopped: dict | None = None
    """The replaced run's exit.json "stopped" record (who stopped it and when)."""
    resumed_from: str | None = None
    dry_run: bool = False
    config: dict | None = None
    """kind dflash: the config as written to config.json."""
    env_fingerprint: dict = field(default_factory=dict)
    bundle_hash: str | None = None
    gpus_seen: list = field(default_factory=list)
    plan: dict | None = None
    """A dry run: what it would stop, resume, write, set and start (what `dflashctl launch --dry-run` prints)."""


@dataclass(frozen=True, kw_only=True)
class TailAnswer(Answer):
    """How a tail ended: the run's state once it ended (or now, without --follow) and the offsets reached."""

    VERB: ClassVar[str] = "tail"
    run_id: str
    state: str
    exit: dict | None = None
    """The run's exit.json, once it ended."""
    session_alive: bool | None = None
    offsets: dict = field(default_factory=dict)
    disk_full: dict | None = None
    """A run that ended failed or without exit.json, on a full file system: {path, free_bytes, total_bytes}."""


@dataclass(frozen=True, kw_only=True)
class StopAnswer(Answer):
    """What a stop did: the signals sent, the run's state and exit.json after them, the GPUs once released."""

    VERB: ClassVar[str] = "stop"
    run_id: str
    state: str
    signals: list[str] = field(default_factory=list)
    already_ended: bool = False
    exit: dict | None = None
    session: str | None = None
    gpus: list = field(default_factory=list)
    """The GPUs as seen once released (the request named GPUs to wait for)."""


@dataclass(frozen=True, kw_only=True)
class WarmupAnswer(Answer):
    """A warm-up's files and one summary per device (python -m trainer.warmup's own report)."""

    VERB: ClassVar[str] = "warmup"
    experiment: str
    dir: str
    config: str
    cache_dir: str
    warmups: list = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class StatusAnswer(Answer):
    """One target's GPUs, tmux sessions and runs."""

    VERB: ClassVar[str] = "status"
    hostname: str
    workdir: str
    gpus: list = field(default_factory=list)
    gpu_reason: str | None = None
    """Why no GPU could be read (no nvidia-smi, ...), or None."""
    sessions: list = field(default_factory=list)
    runs: list = field(default_factory=list)
    total_runs: int = 0


@dataclass(frozen=True, kw_only=True)
class MetricsAnswer(Answer):
    """A run's metrics.jsonl rows, downsampled, and how many there were."""

    VERB: ClassVar[str] = "metrics"
    run_id: str
    rows: list = field(default_factory=list)
    total: int = 0
    bad_lines: int = 0


REQUESTS: dict[str, type[Request]] = {cls.VERB: cls for cls in (
    StatusRequest, StopRequest, MetricsRequest, PingRequest, GpusRequest, FingerprintRequest, TailRequest,
    WarmupRequest, LaunchRequest)}
