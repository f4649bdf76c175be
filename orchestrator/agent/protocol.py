"""Event emission and the typed failure an agent verb raises. Standard library only."""

from __future__ import annotations

import json
import sys
import threading
from typing import IO, Any

from orchestrator.agent.events import Error, Event, Progress, Result


class AgentFailure(Exception):
    """Raise in a verb to end it with an error event.

    Args:
        type: machine-readable kind, e.g. "GpuBusy", "SessionExists", "VenvMismatch", "LockHeld".
        message: one line for the user: what is wrong, where.
        fix: the command that fixes it, or None.
        data: extra structured detail (e.g. which GPUs hold how many MiB).
    """

    def __init__(self, type: str, message: str, fix: str | None = None, data: dict | None = None):
        super().__init__(message)
        self.type = type
        self.message = message
        self.fix = fix
        self.data = data or {}


class Emitter:
    """Writes one JSON event per line (orchestrator.agent.events), flushed per line, safe to call from several
    threads."""

    def __init__(self, stream: IO[str] | None = None):
        self._stream = stream if stream is not None else sys.stdout
        self._lock = threading.Lock()

    def send(self, event: Event) -> None:
        """Write one event."""
        line = json.dumps(event.to_json(), separators=(",", ":"), default=str)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()

    def progress(self, step: str, message: str = "", **fields: Any) -> None:
        """A Progress event; `fields` are its optional fields (a name it lacks is a TypeError)."""
        self.send(Progress(step=step, message=message, **fields))

    def result(self, data: dict) -> None:
        self.send(Result(data=data))

    def error(self, type: str, message: str, fix: str | None = None, data: dict | None = None) -> None:
        self.send(Error(type=type, message=message, fix=fix, data=data or {}))
