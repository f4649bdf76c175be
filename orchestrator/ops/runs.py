"""runs: the workstation's run records (no target is contacted): list them, diff two of them."""

from __future__ import annotations

from orchestrator.inventory import check_name
from orchestrator.records import RunDiff, diff_records, find_record, load_records


def list_runs(experiment: str | None = None, limit: int = 0) -> list[dict]:
    """Recorded launches, oldest first (optionally of one experiment; limit > 0 keeps the newest)."""
    if experiment is not None:
        check_name("experiment", experiment)
    records = load_records(experiment)
    return records[-limit:] if limit > 0 else records


def diff(a: str, b: str) -> RunDiff:
    """What differs between runs `a` and `b` (run ids, unique prefixes, or experiment names = newest run).

    Raises:
        RunNotFound: either one is unknown or ambiguous.
    """
    return diff_records(find_record(a), find_record(b))
