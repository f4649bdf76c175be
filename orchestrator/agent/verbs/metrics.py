"""`metrics`: the rows of runs/<run-id>/metrics.jsonl (or the newest run of an experiment), downsampled
evenly to at most `max_rows` (first and last kept).

A torn last line (the trainer is writing it right now) is skipped, not an error.
"""

from __future__ import annotations

import json

from orchestrator.agent.runs import resolve_run


def read_rows(path) -> tuple[list[dict], int]:
    """Parse a metrics.jsonl; returns (rows, number of unparseable lines)."""
    rows, bad = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # being written
            try:
                row = json.loads(raw)
            except ValueError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows, bad


def run(request: dict, emit) -> dict:
    ref = resolve_run(request["workdir"], request.get("run_id"), request.get("experiment"))
    if not ref.metrics.exists():
        return {"run_id": ref.run_id, "rows": [], "total": 0, "bad_lines": 0}
    rows, bad = read_rows(ref.metrics)
    max_rows = int(request.get("max_rows", 2000))
    total = len(rows)
    if total > max_rows > 1:
        stride = (total - 1) / (max_rows - 1)
        rows = [rows[round(i * stride)] for i in range(max_rows)]
    return {"run_id": ref.run_id, "rows": rows, "total": total, "bad_lines": bad}
