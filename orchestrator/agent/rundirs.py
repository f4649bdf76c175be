"""Run directories inside the target: where they are, their ids, their JSON files and what they record.
Standard library only.

    <workdir>/runs/<run-id>/  run.json  config.json  train.log  log.mark  metrics.jsonl  exit.json  pid
                              stop.json (written by a stop, before its first signal)

This module is the one place that finds run directories and reads their JSON files (written through
orchestrator.agent.atomic); whether a run still runs and its state are orchestrator.agent.liveness's, the
launch lock orchestrator.agent.launchlock's. Status, stop, launch, resume, tail and metrics all use it.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import names
from orchestrator.agent.protocol import AgentFailure

# How much of metrics.jsonl's end is read for the last tokens/s (lines are short; this is dozens of them).
_METRICS_TAIL = 64 * 1024
STOP_NAME = "stop.json"


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second with a Z (the format of exit.json)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> float | None:
    """Epoch seconds of an ISO time written by us (Z or +00:00), or None."""
    if not text:
        return None
    try:
        return _dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def check_run_id(run_id: str) -> str:
    """Return run_id if it is a run id by names.check_run_id (safe as one path component), else raise
    AgentFailure("BadRunId")."""
    try:
        return names.check_run_id(run_id)
    except names.BadName as exc:
        raise AgentFailure("BadRunId", exc.message, fix=exc.fix) from None


def check_name(kind: str, value: str) -> str:
    """Return value if it is a valid `kind` name by names.check, else raise AgentFailure("BadName")."""
    try:
        return names.check(kind, value)
    except names.BadName as exc:
        raise AgentFailure("BadName", exc.message, fix=exc.fix) from None


def runs_root(workdir: str | Path) -> Path:
    return Path(workdir) / "runs"


def read_json(path: Path) -> dict | None:
    """A JSON object from a file, or None when missing, partial or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def free_run_id(workdir: str | Path, run_id: str) -> str:
    """The run id a launch would take now (run_id, or its first -2, -3, ... without a directory), read-only:
    what a launch plans (orchestrator.agent.preflight), then makes with make_run_dir under its lock."""
    check_run_id(run_id)
    root = runs_root(workdir)
    for n in range(1, names.CLASH_MAX + 1):
        rid = names.clash_variant(run_id, n)
        if not (root / rid).exists():
            return rid
    raise _all_taken(root, run_id)


def make_run_dir(workdir: str | Path, run_id: str) -> Path:
    """Create runs/<run_id>/ (the id free_run_id planned) exclusively.

    Raises:
        AgentFailure("RunDirExists"): it appeared since it was planned (a launch of another experiment whose
            run id came out the same in the same second).
    """
    root = runs_root(workdir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        (root / run_id).mkdir()
    except FileExistsError:
        raise AgentFailure("RunDirExists", f"{root / run_id} was created by another launch while this one planned it",
                           fix="launch again (it takes the next free run id)") from None
    return root / run_id


def _all_taken(root: Path, run_id: str) -> AgentFailure:
    return AgentFailure("RunDirExists",
                        f"runs/{run_id} and {names.CLASH_MAX - 1} suffixed variants already exist in {root}")


def parse_records(lines) -> tuple[list[dict], int]:
    """The JSON objects of metrics.jsonl lines (bytes or str), and how many lines were not one (bad JSON or
    not an object). Blank lines are neither."""
    records, invalid = [], 0
    for raw in lines:
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            invalid += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            invalid += 1
    return records, invalid


def last_metrics(path: Path) -> dict | None:
    """The last complete JSON line of metrics.jsonl that carries tokens_per_s (else the last line), or None."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - _METRICS_TAIL))
            blob = fh.read()
    except OSError:
        return None
    last = None
    for raw in reversed(blob.split(b"\n")):
        try:
            obj = json.loads(raw)
        except ValueError:
            continue  # the partial first line of the window, or a line being written
        if not isinstance(obj, dict):
            continue
        if last is None:
            last = obj
        if "tokens_per_s" in obj:
            return obj
    return last


# ---------------------------------------------------------------------------------------------- runs


@dataclass
class RunRef:
    """A run directory and what run.json says about it."""

    run_id: str
    path: Path
    info: dict = field(default_factory=dict)

    @property
    def experiment(self) -> str | None:
        return self.info.get("experiment")

    @property
    def session(self) -> str | None:
        """The tmux session the run lives in: run.json's `session`, else `dflash-<experiment>`."""
        if self.info.get("session"):
            return str(self.info["session"])
        return names.session_name(self.experiment) if names.is_valid(self.experiment) else None

    @property
    def log(self) -> Path:
        return self.path / "train.log"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def exit_file(self) -> Path:
        return self.path / "exit.json"


def load_ref(path: Path) -> RunRef:
    """The RunRef of an existing run directory (run.json read now; {} when missing or partial)."""
    return RunRef(path.name, path, read_json(path / "run.json") or {})


def created_key(ref: RunRef) -> tuple:
    """Sort key, oldest first: run.json's ISO `created` (sorts as text), then the directory's mtime (ties,
    and runs whose run.json is missing), then the name."""
    try:
        mtime = ref.path.stat().st_mtime
    except OSError:
        mtime = 0.0
    return (str(ref.info.get("created") or ""), mtime, ref.run_id)


def run_refs(workdir: str | Path) -> list[RunRef]:
    """Every run directory under `<workdir>/runs`, oldest first (created_key)."""
    root = runs_root(workdir)
    if not root.is_dir():
        return []
    refs = [load_ref(p) for p in root.iterdir() if p.is_dir() and names.is_valid(p.name, names.RUN_ID_MAX)]
    return sorted(refs, key=created_key)


def resolve_run(workdir: str | Path, run_id: str | None = None, experiment: str | None = None) -> RunRef:
    """The run named `run_id`, else the newest run of `experiment`, else the newest run of all.

    Raises:
        AgentFailure("RunNotFound"): no such run, or `run_id` is not a valid run id (the message lists the
            newest runs there are).
    """
    if run_id is not None:
        if not names.is_valid(run_id, names.RUN_ID_MAX):
            raise AgentFailure("RunNotFound", f"{run_id!r} is not a valid run id", fix="dflashctl runs")
        path = runs_root(workdir) / run_id
        if path.is_dir():
            return load_ref(path)
    refs = run_refs(workdir)
    if run_id is None:
        candidates = [r for r in refs if experiment is None or r.experiment == experiment]
        if candidates:
            return candidates[-1]
    known = ", ".join(r.run_id for r in refs[-5:]) or "none"
    what = f"no run {run_id!r}" if run_id is not None else (
        f"no run of experiment {experiment!r}" if experiment else "no runs")
    raise AgentFailure(
        "RunNotFound",
        f"{what} in {runs_root(workdir)} (newest runs: {known})",
        fix="dflashctl runs   # lists runs; or launch one with dflashctl launch EXPERIMENT",
        data={"runs": [r.run_id for r in refs[-20:]]},
    )


def read_exit(ref: RunRef) -> dict | None:
    """exit.json's contents, or None while the run has not ended (or the file is still being written)."""
    return read_json(ref.exit_file)
