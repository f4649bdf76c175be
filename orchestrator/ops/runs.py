"""runs: the workstation's run records (no target is contacted): list them, diff two of them."""

from __future__ import annotations

from typing import Any, Callable

from orchestrator.inventory import check_name
from orchestrator.records import RunDiff, diff_records, find_record, load_records, record_dataset


def list_runs(experiment: str | None = None, limit: int = 0) -> list[dict]:
    """Recorded launches, oldest first (optionally of one experiment; limit > 0 keeps the newest)."""
    if experiment is not None:
        check_name("experiment", experiment)
    records = load_records(experiment)
    return records[-limit:] if limit > 0 else records


def diff(a: str, b: str, inventory: Callable[[], Any] | None = None) -> RunDiff:
    """What differs between runs `a` and `b` (run ids, unique prefixes, or experiment names = newest run),
    the regenerated dataset included.

    A run whose config regenerates its data and whose record does not know its dataset yet has it read from
    its target (the data stage's `"kind": "dataset"` line in the run's metrics.jsonl; `inventory()` gives the
    inventory, loaded only then) and recorded, so the next diff asks nothing. A target that cannot be reached
    or a run that has not finished its data stage becomes a note, not an error.

    Raises:
        RunNotFound: either one is unknown or ambiguous.
    """
    ra, rb = find_record(a), find_record(b)
    notes: list[str] = []
    if inventory is not None and (_needs_dataset(ra) or _needs_dataset(rb)):
        for rec in (ra, rb):
            if _needs_dataset(rec):
                _learn_dataset(rec, inventory, notes)
    d = diff_records(ra, rb)
    d.notes = notes
    return d


def _needs_dataset(rec: dict) -> bool:
    data = (rec.get("config") or {}).get("data") or {}
    return not rec.get("dataset") and bool(data.get("regenerate", True) and data.get("train_files"))


def _learn_dataset(rec: dict, inventory: Callable[[], Any], notes: list[str]) -> None:
    """Read the run's dataset line from its target into `rec` and the records file (or add a note)."""
    from orchestrator.errors import DflashError
    from orchestrator.ops.runnotes import fetch_rows
    from orchestrator.target import open_target

    run_id = rec["run_id"]
    try:
        tgt = open_target(inventory(), rec.get("target"))
        try:
            rows = fetch_rows(tgt, run_id, max_rows=1_000_000).rows
        finally:
            tgt.close()
    except DflashError as exc:
        notes.append(f"{run_id}: its dataset is not known: {exc} (the record keeps no dataset yet; run again "
                     "when its target is reachable)")
        return
    found = [r for r in rows if r.get("kind") == "dataset"]
    if not found:
        notes.append(f"{run_id}: its data stage has not finished, so its dataset has no key yet")
        return
    last = found[-1]
    rec["dataset"] = {"key": last.get("dataset_key"), "path": last.get("dataset_path"),
                      "key_inputs": last.get("dataset_key_inputs") or {}}
    record_dataset(run_id, rec["dataset"])
