"""The agent's events, typed: one frozen dataclass per event kind, written by the agent (Emitter.send, one JSON
line each) and read back by the workstation (`parse`, in orchestrator.target) so ops only ever see these
classes. Standard library only.

On the wire an event is `{"event": KIND, field: value, ...}`; a field left at None is not written. `from_json`
refuses an unknown kind, an unknown or missing field and a value of the wrong type with ONE error (BadEvent)
naming the event kind and the field: the workstation and the bundle come from the same checkout, so such an
event is a bug, said at once, never a default read silently.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from orchestrator.agent.schema import schema_problem


class BadEvent(ValueError):
    """An agent event this side cannot read; the message names the event kind and the field."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """Base of every event kind (its name on the wire in KIND)."""

    KIND: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        """The JSON object of one event line (fields at None left out)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"event": self.KIND, **{k: v for k, v in out.items() if v is not None}}

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        """The event `data` describes (its "event" key must be this kind).

        Raises:
            BadEvent: another kind, an unknown field, a missing one or a value of the wrong type.
        """
        if not isinstance(data, dict):
            raise BadEvent(f"{cls.KIND} event: must be a JSON object, got {type(data).__name__}")
        fields = {k: v for k, v in data.items() if k != "event"}
        if data.get("event") != cls.KIND:
            raise BadEvent(f"{cls.KIND} event: its \"event\" is {data.get('event')!r}")
        problem = schema_problem(cls, fields)
        if problem is not None:
            raise BadEvent(f"{cls.KIND} event: {problem.message}")
        return cls(**fields)


@dataclass(frozen=True, kw_only=True)
class Progress(Event):
    """One step of a verb, for the user (EventPrinter prints `step message`), with what a reader may use."""

    KIND: ClassVar[str] = "progress"
    step: str
    message: str = ""
    gpu: int | None = None
    """warmup: the GPU warmed up (absent for the CPU)."""
    skipped: bool | None = None
    """warmup: the step was skipped (the message says why)."""
    run_dir: str | None = None
    session: str | None = None
    signal: str | None = None
    """stop: the signal sent."""
    driver: str | None = None
    """driver: the NVIDIA driver version the run's torch was checked against."""
    lock_hash: str | None = None
    resumed_from: str | None = None
    checkpoint_step: int | None = None
    wall_s: float | None = None
    """warmup: seconds the warm-up of one device took."""
    warmup: dict | None = None
    """warmup: the trainer's own report of one shape or one device (python -m trainer.warmup's JSON line)."""
    i: int | None = None
    """echo: the event's index."""


@dataclass(frozen=True, kw_only=True)
class Result(Event):
    """The verb's answer: the last line of a call that worked. `data` is the verb's result object."""

    KIND: ClassVar[str] = "result"
    data: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Error(Event):
    """The last line of a call that failed (an AgentFailure, or a crash with its traceback in data)."""

    KIND: ClassVar[str] = "error"
    type: str
    message: str
    fix: str | None = None
    data: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RunInfo(Event):
    """tail: the run being read, sent first."""

    KIND: ClassVar[str] = "run"
    run_id: str
    experiment: str | None = None
    session: str | None = None
    offset: int = 0
    """The byte of train.log the data starts at."""
    baseline: dict | None = None
    """The last good run's figures, for the health checks."""
    log_mark: str | None = None
    """The mark of dflashctl's own lines in train.log (orchestrator.ownlines)."""


@dataclass(frozen=True, kw_only=True)
class Data(Event):
    """tail: bytes offset..next of train.log, as text when they are UTF-8, else base64."""

    KIND: ClassVar[str] = "data"
    offset: int
    next: int
    text: str | None = None
    b64: str | None = None

    def raw(self) -> bytes:
        """The bytes, exactly as they are in the file."""
        return base64.b64decode(self.b64) if self.b64 is not None else (self.text or "").encode("utf-8")


@dataclass(frozen=True, kw_only=True)
class Metrics(Event):
    """tail: metrics.jsonl bytes offset..next (whole lines), parsed: its records, and how many lines were not."""

    KIND: ClassVar[str] = "metrics"
    offset: int
    next: int
    records: list = field(default_factory=list)
    invalid: int = 0


@dataclass(frozen=True, kw_only=True)
class Truncated(Event):
    """tail: a file got shorter (rewritten): the reader starts it again from 0."""

    KIND: ClassVar[str] = "truncated"
    file: str


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Event):
    """tail --follow: the run is watched; its session and file sizes, for the hang check."""

    KIND: ClassVar[str] = "heartbeat"
    session_alive: bool | None = None
    log_size: int = 0
    metrics_size: int | None = None


EVENTS: dict[str, type[Event]] = {cls.KIND: cls for cls in (
    Progress, Result, Error, RunInfo, Data, Metrics, Truncated, Heartbeat)}


def parse(data: Any) -> Event:
    """The typed event one JSON line of the agent holds.

    Raises:
        BadEvent: not an object, an unknown kind, or fields that do not fit its kind.
    """
    kind = data.get("event") if isinstance(data, dict) else None
    cls = EVENTS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise BadEvent(f"unknown event kind {kind!r} (known: {', '.join(sorted(EVENTS))})")
    return cls.from_json(data)
