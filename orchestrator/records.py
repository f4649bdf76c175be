"""Workstation run records: one JSON line per launch in `<user state dir>/dflashctl/runs.jsonl`, append-only
(plus one line per later event of a run: its stop, folded into its record on reading).

They answer "what changed since the last good run?" without reaching any target: `runs diff A B` compares
packages (with versions), config keys (flattened dotted paths), bundle hash and GPU/driver of two records.
The directory can be moved with $DFLASHCTL_STATE_DIR (tests use it).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator import names
from orchestrator.agent import atomic
from orchestrator.errors import RunNotFound, UserError

STATE_ENV = "DFLASHCTL_STATE_DIR"
FILE_NAME = "runs.jsonl"


def state_dir() -> Path:
    """$DFLASHCTL_STATE_DIR, else the platformdirs user state dir of dflashctl."""
    override = os.environ.get(STATE_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_state_dir("dflashctl"))


def read_state(name: str) -> str | None:
    """The text of the state dir's small file `name` (a cache an earlier command kept), or None when it is
    missing or unreadable."""
    try:
        return (state_dir() / name).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def write_state(name: str, text: str) -> bool:
    """Write the state dir's small file `name` whole or not at all (agent.atomic). False when the state dir
    cannot be written: these files are caches, and a caller goes on without one."""
    path = state_dir() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(path, text.encode())
    except OSError:
        return False
    return True


def records_path() -> Path:
    return state_dir() / FILE_NAME


def append_record(record: dict) -> Path:
    """Append one record as one line. One write() under an exclusive flock, so concurrent launches from
    two terminals never interleave their lines.

    Raises:
        UserError: the record is not JSON-serialisable or lacks run_id.
    """
    if not record.get("run_id"):
        raise UserError("a run record needs a run_id")
    try:
        line = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str) + "\n"
    except (TypeError, ValueError) as exc:
        raise UserError(f"run record for {record.get('run_id')} is not JSON: {exc}") from exc
    path = records_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            # A write torn by a crash left half a line: end it, or this record would be glued onto it.
            line = "\n" + line
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)  # closing drops the flock
    return path


def record_stopped(run_id: str, stopped: dict) -> Path:
    """Note that a recorded run was stopped ({by, via, at}): one more line, `{"run_id", "event": "stopped",
    "stopped"}`, which load_records folds into the run's launch record (the file stays append-only)."""
    return append_record({"run_id": run_id, "event": "stopped", "stopped": stopped})


def record_dataset(run_id: str, dataset: dict) -> Path:
    """Note the regenerated dataset a recorded run trained on ({key, path, key_inputs}, what its data stage
    recorded in the run's metrics.jsonl): one more line, `{"run_id", "event": "dataset", "dataset"}`, folded into
    the run's launch record like a stop."""
    return append_record({"run_id": run_id, "event": "dataset", "dataset": dataset})


def load_records(experiment: str | None = None) -> list[dict]:
    """Every launch record, oldest first, with later event lines of its run folded in (`stopped`, `dataset`);
    lines that do not parse (a torn write after a crash) are skipped."""
    path = records_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out: list[dict] = []
    latest: dict[str, dict] = {}
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not rec.get("run_id"):
            continue
        if rec.get("event") in ("stopped", "dataset"):
            if rec["run_id"] in latest:  # an event of a run launched elsewhere is not ours to list
                latest[rec["run_id"]][rec["event"]] = rec.get(rec["event"])
            continue
        latest[rec["run_id"]] = rec
        out.append(rec)
    return [r for r in out if experiment is None or r.get("experiment") == experiment]


def find_record(ref: str, fits: Callable[[dict], bool] | None = None) -> dict:
    """The record whose run id is `ref`, or the only one starting with `ref`; `ref` may also be an
    experiment name (its newest run). `fits`: only the records it accepts are looked at.

    Raises:
        RunNotFound: nothing matches, or a prefix matches several runs (they are listed).
    """
    records = [r for r in load_records() if fits is None or fits(r)]
    exact = [r for r in records if r["run_id"] == ref]
    if exact:
        return exact[-1]
    by_exp = [r for r in records if r.get("experiment") == ref]
    if by_exp:
        return by_exp[-1]
    pref = [r for r in records if r["run_id"].startswith(ref)]
    if len(pref) == 1:
        return pref[0]
    if len(pref) > 1:
        raise RunNotFound(
            f"{ref!r} matches {len(pref)} runs: " + ", ".join(r["run_id"] for r in pref[:6]),
            fix="give more of the run id",
        )
    raise RunNotFound(f"no run {ref!r} in {records_path()}", fix="dflashctl runs  (lists recorded runs)")


@dataclass(frozen=True)
class NodeRecord:
    """One node of a run across targets, as its launch recorded it."""

    index: int
    target: str
    run_dir: str | None = None
    session: str | None = None
    gpus: list[int] = field(default_factory=list)
    env_fingerprint: dict | None = None


@dataclass(frozen=True)
class RunRecord:
    """A launch as this workstation recorded it (one line of runs.jsonl, its stop folded in). The fields any
    verb reads are typed here; `raw` is the whole line as written (what `runs diff` compares)."""

    run_id: str
    experiment: str | None = None
    target: str | None = None
    """The run's target (node 0's for a run across targets)."""
    run_dir: str | None = None
    gpus: list[int] = field(default_factory=list)
    nodes: list[NodeRecord] = field(default_factory=list)
    """Empty for a run on one target."""
    stopped: dict | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, rec: dict) -> RunRecord:
        """The typed view of one record line (unknown keys stay in `raw`; a node without a target is skipped
        as the torn remains of a record it is)."""
        nodes = [NodeRecord(index=int(n.get("index", i)), target=n["target"], run_dir=n.get("run_dir"),
                            session=n.get("session"), gpus=list(n.get("gpus") or []),
                            env_fingerprint=n.get("env_fingerprint"))
                 for i, n in enumerate(rec.get("nodes") or []) if isinstance(n, dict) and n.get("target")]
        return cls(run_id=rec["run_id"], experiment=rec.get("experiment"), target=rec.get("target"),
                   run_dir=rec.get("run_dir"), gpus=list(rec.get("gpus") or []), nodes=nodes,
                   stopped=rec.get("stopped"), raw=dict(rec))


def find_run(ref: str, fits: Callable[[RunRecord], bool] | None = None) -> RunRecord:
    """find_record, typed (`fits` sees the typed record).

    Raises:
        RunNotFound: as find_record.
    """
    return RunRecord.from_dict(find_record(ref, None if fits is None else lambda r: fits(RunRecord.from_dict(r))))


def requested_by(verb: str = "dflashctl stop") -> dict:
    """Who acts on a run from this workstation, as its stop.json, exit.json and records note it:
    {by: user@workstation, via: the verb}."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER: a container's uid
        user = f"uid{os.getuid()}"
    return {"by": f"{user}@{socket.gethostname()}", "via": verb}


# ------------------------------------------------------------------ what this workstation printed of a run

PRINTED_DIR = "printed"


def _printed_path(run_id: str, target: str) -> Path:
    return state_dir() / PRINTED_DIR / f"{run_id}@{target}.json"


def printed_offset(run_id: str, target: str) -> int | None:
    """The byte offset in run `run_id`'s train.log on `target` just past the last line this workstation printed
    of it (`logs`, `launch --follow`); None when it printed none, or the file does not read back."""
    try:
        data = json.loads(_printed_path(run_id, target).read_text())
    except (OSError, ValueError):
        return None
    offset = data.get("offset") if isinstance(data, dict) else None
    return offset if isinstance(offset, int) and offset >= 0 else None


def save_printed_offset(run_id: str, target: str, offset: int) -> None:
    """Note that every line of the log up to byte `offset` has been printed here: written to a temporary name,
    fsynced and renamed, so a follow killed at any moment leaves the old offset or the new one, never half.

    Raises:
        UserError: the run id or target cannot name a file (checked as names are everywhere).
    """
    for kind, value, limit in (("run id", run_id, names.RUN_ID_MAX), ("target", target, names.NAME_MAX)):
        if not names.is_valid(value, limit):
            raise UserError(f"bad {kind} {value!r} for the printed-offset file", fix="use the run id as printed")
    path = _printed_path(run_id, target)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(path, json.dumps({"offset": int(offset)}).encode(), 0o644)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": [1, 2]} -> {"a.b": 1, "c": [1, 2]} (lists stay values)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(flatten(v, key))
            else:
                out[key] = v
        return out
    return {prefix: obj} if prefix else {}


@dataclass
class RunDiff:
    """What differs between run A and run B. Each change is (key, value in A, value in B); None = absent."""

    a: str
    b: str
    packages: list[tuple[str, Any, Any]] = field(default_factory=list)
    config: list[tuple[str, Any, Any]] = field(default_factory=list)
    bundle: tuple[Any, Any] | None = None
    environment: list[tuple[str, Any, Any]] = field(default_factory=list)
    dataset: list[tuple[str, Any, Any]] = field(default_factory=list)
    """The regenerated dataset: `key`, then each key input that differs (`inputs`, `target.weights.NAME`,
    `max_new_tokens`, `engine_version` ...): why two runs trained on different data."""
    notes: list[str] = field(default_factory=list)
    """What could not be compared (a run's dataset not known: its target not reachable)."""

    @property
    def same(self) -> bool:
        return not (self.packages or self.config or self.bundle or self.environment or self.dataset)

    def to_dict(self) -> dict:
        return {
            "a": self.a, "b": self.b, "same": self.same,
            "packages": [list(c) for c in self.packages],
            "config": [list(c) for c in self.config],
            "bundle": list(self.bundle) if self.bundle else None,
            "environment": [list(c) for c in self.environment],
            "dataset": [list(c) for c in self.dataset],
            "notes": list(self.notes),
        }


def _changes(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


# Fingerprint fields compared as "GPU/driver and interpreter" (packages are compared one by one).
_ENV_KEYS = ("python", "torch", "cuda", "driver", "gpu", "gpu_names", "lock_hash")


def diff_records(a: dict, b: dict) -> RunDiff:
    """Compare two run records: packages (name -> version), config keys (dotted), bundle hash, GPU/driver."""
    fa, fb = a.get("env_fingerprint") or {}, b.get("env_fingerprint") or {}
    d = RunDiff(a["run_id"], b["run_id"])
    d.packages = _changes(
        {k.lower(): v for k, v in (fa.get("packages") or {}).items()},
        {k.lower(): v for k, v in (fb.get("packages") or {}).items()},
    )
    d.config = _changes(flatten(a.get("config") or {}), flatten(b.get("config") or {}))
    if a.get("bundle_hash") != b.get("bundle_hash"):
        d.bundle = (a.get("bundle_hash"), b.get("bundle_hash"))
    env_a = {k: fa.get(k) for k in _ENV_KEYS if k in fa}
    env_b = {k: fb.get(k) for k in _ENV_KEYS if k in fb}
    env_a["gpus"] = _gpu_summary(a)
    env_b["gpus"] = _gpu_summary(b)
    env_a["target"], env_b["target"] = a.get("target"), b.get("target")
    d.environment = _changes(env_a, env_b)
    _diff_nodes(d, a.get("nodes") or [], b.get("nodes") or [])
    d.dataset = _dataset_changes(a.get("dataset"), b.get("dataset"))
    return d


def _dataset_changes(a: dict | None, b: dict | None) -> list[tuple[str, Any, Any]]:
    """The dataset key first, then each of its inputs that differs (dotted); the key alone when only one run
    has a known dataset (the other has no data stage, or its dataset could not be read)."""
    if not a and not b:
        return []
    if not a or not b:
        return [("key", (a or {}).get("key"), (b or {}).get("key"))]
    if a.get("key") == b.get("key"):
        return []
    return [("key", a.get("key"), b.get("key")),
            *_changes(flatten(a.get("key_inputs") or {}), flatten(b.get("key_inputs") or {}))]


def _diff_nodes(d: RunDiff, na: list[dict], nb: list[dict]) -> None:
    """Runs across targets: every node after node 0 (whose fingerprint is the record's own) compared the same
    way, each change named `node I (TARGET): key`; a node only one run has shows as its target."""
    for i in range(1, max(len(na), len(nb))):
        a = na[i] if i < len(na) else {}
        b = nb[i] if i < len(nb) else {}
        fa, fb = a.get("env_fingerprint") or {}, b.get("env_fingerprint") or {}
        name = f"node {i} ({b.get('target') or a.get('target')})"
        pkgs = _changes({k.lower(): v for k, v in (fa.get("packages") or {}).items()},
                        {k.lower(): v for k, v in (fb.get("packages") or {}).items()})
        d.packages += [(f"{name}: {k}", x, y) for k, x, y in pkgs]
        env_a = {**{k: fa.get(k) for k in _ENV_KEYS if k in fa}, "target": a.get("target"), "gpus": a.get("gpus")}
        env_b = {**{k: fb.get(k) for k in _ENV_KEYS if k in fb}, "target": b.get("target"), "gpus": b.get("gpus")}
        d.environment += [(f"{name}: {k}", x, y) for k, x, y in _changes(env_a, env_b)]


def _gpu_summary(rec: dict) -> list | None:
    """The GPUs a run used as [index, total MiB] pairs (what nvidia-smi showed at launch)."""
    seen = rec.get("gpus_seen") or []
    wanted = set(rec.get("gpus") or [])
    out = [[g.get("index"), g.get("total_mib")] for g in seen if g.get("index") in wanted]
    return out or (sorted(wanted) or None)
