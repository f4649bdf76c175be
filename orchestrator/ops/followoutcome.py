"""How a follow of a run's log ended (`FollowOutcome`), the exit code each ending gives, and what a signature
match says about it: its signature id and severity, whether a Match from the matcher or the dict `explain`
made of it (orchestrator.ops.logmatch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Union

from orchestrator.monitor import Alert
from orchestrator.sigmatch import Match
from orchestrator.signatures import UNCLASSIFIED

# Outcome -> process exit code (README, `dflashctl logs --help`).
EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_KNOWN_CRASH = 2
EXIT_LOST = 3
# 4, no such run, is errors.RunNotFound.exit_code.
EXIT_STOPPED = 5  # `dflashctl stop` or `launch --replace` ended the run (neither success nor a failure of its own)

# Severities of signatures that name why a run died (others are warnings: a slowdown, a recompile).
CRASH_SEVERITIES = frozenset({"fatal", "critical", "error", "crash"})

FoundMatch = Union[Match, dict[str, Any]]
"""A signature match: the matcher's Match, or (once explained) its dict with the signature's texts."""


def signature_id(match: FoundMatch) -> str | None:
    return match.get("signature") if isinstance(match, dict) else match.signature


def severity(match: FoundMatch) -> str:
    value = match.get("severity") if isinstance(match, dict) else match.severity
    return str(value or "error").lower()


def match_dict(match: FoundMatch) -> dict[str, Any]:
    return match if isinstance(match, dict) else match.to_dict()


def alert_dict(alert: Alert | dict[str, Any]) -> dict[str, Any]:
    return alert if isinstance(alert, dict) else dataclasses.asdict(alert)


@dataclass
class FollowOutcome:
    """How a follow (or a one-shot look) ended.

    state: succeeded | stopped (exit["stopped"] says by whom and when) | failed | crashed | running (one-shot
    look at a live run) | lost (connection gone for good).
    """

    run_id: str | None
    experiment: str | None
    state: str
    exit: dict | None = None
    matches: list[FoundMatch] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    lines: int = 0
    reconnects: int = 0
    offsets: dict[str, int | None] = field(default_factory=dict)
    baseline: dict | None = None
    error: str | None = None
    disk_full: dict | None = None
    """The agent's word that the run ended failed on a full file system ({path, free_bytes, total_bytes}): the
    cause that needs no byte of the full disk (the run's own report may not have been written)."""

    @property
    def crash_matches(self) -> list[FoundMatch]:
        """Matches of a known signature severe enough to name why the run died (not warnings, not an
        unclassified traceback: signatures.UNCLASSIFIED, a crash but not a known one)."""
        return [m for m in self.matches if severity(m) in CRASH_SEVERITIES and signature_id(m) != UNCLASSIFIED]

    @property
    def exit_code(self) -> int:
        """0 succeeded (or still running), 1 failed, 2 died with a known crash signature, 3 lost, 5 stopped."""
        if self.state == "lost":
            return EXIT_LOST
        if self.state == "stopped":
            return EXIT_STOPPED
        if self.state in ("succeeded", "running"):
            return EXIT_SUCCEEDED
        return EXIT_KNOWN_CRASH if self.crash_matches else EXIT_FAILED

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "experiment": self.experiment,
            "state": self.state,
            "exit": self.exit,
            "exit_code": self.exit_code,
            "lines": self.lines,
            "reconnects": self.reconnects,
            "offsets": self.offsets,
            "baseline": self.baseline,
            "matches": [match_dict(m) for m in self.matches],
            "alerts": [alert_dict(a) for a in self.alerts],
            "error": self.error,
            "disk_full": self.disk_full,
        }
