"""The root cause of a failed run, from what torch's elastic agent reports (ChildFailedError.failures).

Each failed rank comes as a `ProcessFailure`: its exit code (negative: the signal that killed it) and, when
the rank raised, the error file its `record`-decorated entry point wrote (trainer.rank.RankErrorHandler:
message, traceback, a nanosecond time, the exception's type, and whether it was a PeerLostError, i.e. a wait
on a peer that failed). When one rank fails, the others soon fail too (their peer is gone) or are stopped by
the agent (SIGTERM); the root cause is the failure that started it. Ranked, first wins:

    0  an exception of the rank's own (not PeerLostError), earliest first: its error file was written before
       the rank exited, so before any peer could notice
    1  killed by a signal other than the agent's SIGTERM and SIGABRT (SIGKILL: the OOM killer or a person;
       SIGSEGV ...), or a non-zero exit without an error file: nothing else in the run causes these
    2  SIGABRT without an error file: NCCL's watchdog aborts a rank whose peer died, so it may be a consequence
    3  a PeerLostError, earliest first: this rank only noticed that another one failed
    4  SIGTERM without an error file: stopped by the agent after another failure

The agent's own pick (ChildFailedError.get_first_failure) compares whole-second timestamps and cannot tell a
consequence from a cause; this ranking replaces it.
"""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainer.atomic import write_json

ROOT_CAUSE_FILE = "root_cause.json"
"""Written into the run directory when a run fails (start_training.sh copies it into exit.json)."""

STOP_SIGNAL = signal.SIGTERM
"""What the elastic agent sends the ranks still running after a failure."""


@dataclass(frozen=True)
class Failure:
    """One failed rank, as the launcher reports it.

    Attributes:
        rank, local_rank, node: where it ran (global rank, index on its node, the node's rank).
        role: target, drafter or colocated.
        pid: its process id.
        exit_code: the process's exit code (negative: killed by that signal).
        signal: the signal's name when it was killed by one (SIGKILL), else None.
        exception: the exception's type (qualified) when it raised, else None.
        message: "Type: message" of the exception, else None.
        traceback: the exception's traceback from its error file, else None.
        time_ns: when it raised (nanoseconds since the epoch), None without an error file.
        peer_lost: the exception was a wait on a peer that failed (PeerLostError).
        error_file: the error file's path, None without one.
    """

    rank: int
    local_rank: int
    node: int
    role: str
    pid: int
    exit_code: int
    signal: str | None = None
    exception: str | None = None
    message: str | None = None
    traceback: str | None = None
    time_ns: int | None = None
    peer_lost: bool = False
    error_file: str | None = None
    peer: int | None = None
    """The rank a PeerLostError waited on (point-to-point), else None."""

    @property
    def rank_class(self) -> int:
        """Position in the ranking of the module docstring (0: most likely the cause)."""
        if self.message is not None:
            return 3 if self.peer_lost else 0
        if self.signal == STOP_SIGNAL.name:
            return 4
        return 2 if self.signal == "SIGABRT" else 1

    @property
    def where(self) -> str:
        return f"rank {self.rank} ({self.role}, node {self.node}, local rank {self.local_rank}, pid {self.pid})"

    def describe(self) -> str:
        """One line: which rank and what happened to it."""
        if self.message is not None:
            return f"{self.where} raised {self.message}"
        if self.signal is not None:
            how = "was stopped by the launcher (SIGTERM)" if self.signal == STOP_SIGNAL.name else f"was killed by {self.signal}"
            return f"{self.where} {how}"
        return f"{self.where} exited with code {self.exit_code} without an error file"

    @property
    def launcher_exit_code(self) -> int:
        """What the launcher exits with when this is the root cause: the rank's code, 1 for a signal."""
        return self.exit_code if 0 < self.exit_code < 126 else 1


def _signal_name(exit_code: int) -> str | None:
    if exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def from_process_failure(rank: int, pf: Any, role: str, node: int = 0) -> Failure:
    """A Failure from one entry of ChildFailedError.failures (a torch ProcessFailure)."""
    data = pf.error_file_data.get("message") if isinstance(pf.error_file_data, dict) else None
    base = dict(rank=rank, local_rank=pf.local_rank, node=node, role=role, pid=pf.pid, exit_code=pf.exitcode,
                signal=_signal_name(pf.exitcode))
    if not isinstance(data, dict):
        return Failure(**base)
    extra = data.get("extraInfo") or {}
    time_ns = extra.get("time_ns")
    if time_ns is None and extra.get("timestamp") is not None:
        time_ns = int(extra["timestamp"]) * 10**9  # an error file of torch's own handler: whole seconds
    return Failure(**base, exception=extra.get("exc_type"), message=str(data.get("message")),
                   traceback=extra.get("py_callstack"), time_ns=time_ns, peer_lost=bool(extra.get("peer_lost")),
                   error_file=pf.error_file, peer=extra.get("peer") if isinstance(extra.get("peer"), int) else None)


def failures_of(err: Any, ranks: list[tuple[int, str]], node: int = 0) -> list[Failure]:
    """Every failure of a ChildFailedError, in rank order. `ranks[local_rank]` is (global rank, role) of this
    node's ranks: torch keys failures by its own global rank, which follows its node order, not the layout's."""
    found = [from_process_failure(ranks[pf.local_rank][0], pf, ranks[pf.local_rank][1], node)
             for pf in err.failures.values()]
    return sorted(found, key=lambda f: f.rank)


def root_cause(failures: list[Failure]) -> Failure:
    """The failure that ended the run (see the module docstring for the ranking).

    Raises:
        ValueError: `failures` is empty.
    """
    if not failures:
        raise ValueError("root_cause needs at least one failure")
    return min(failures, key=lambda f: (f.rank_class, f.time_ns if f.time_ns is not None else 0, f.rank))


def report(failures: list[Failure]) -> dict[str, Any]:
    """The root_cause.json document: the cause in full, and a line for every other failure."""
    cause = root_cause(failures)
    doc = asdict(cause)
    doc["summary"] = cause.describe()
    if cause.time_ns is not None:
        doc["time"] = datetime.fromtimestamp(cause.time_ns / 1e9, timezone.utc).isoformat(timespec="milliseconds")
    doc["others"] = [
        {"rank": f.rank, "role": f.role, "node": f.node, "summary": f.describe(), "consequence": f.rank_class >= 2}
        for f in failures
        if f is not cause
    ]
    return doc


def name_lost_peer(doc: dict[str, Any], layout: Any, node: int) -> dict[str, Any]:
    """A root cause that only lost a peer of ANOTHER node (which this node cannot see fail): name that rank
    and node as what was lost (`lost`, and the summary's start). Returns `doc` (updated in place)."""
    peer = doc.get("peer")
    if not doc.get("peer_lost") or not isinstance(peer, int) or not 0 <= peer < layout.world_size:
        return doc
    place = layout.place(peer)
    if place.node == node:
        return doc
    spec = layout.node_specs[place.node]
    doc["lost"] = {"rank": peer, "role": layout.role(peer), "node": place.node, "node_name": spec.name,
                   "local_rank": place.local_rank}
    doc["summary"] = f"lost {layout.describe_rank(peer)}: {doc['summary']}"
    return doc


def write_report(run_dir: Path, doc: dict[str, Any]) -> Path:
    """root_cause.json in `run_dir`, on one line (temp file + rename: complete or absent)."""
    return write_json(run_dir / ROOT_CAUSE_FILE, doc, indent=None, end="\n")


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The block the launcher prints: the cause, its traceback, then the others."""
    lines = [f"run failed: {doc['summary']}"]
    if doc.get("traceback"):
        lines.append(f"its traceback (error file {doc['error_file']}):")
        lines += ["  " + line for line in doc["traceback"].rstrip("\n").splitlines()]
    for other in doc["others"]:
        note = " (a consequence)" if other["consequence"] else ""
        lines.append(f"also: {other['summary']}{note}")
    return lines
