"""`metrics`: the rows of runs/<run-id>/metrics.jsonl, downsampled evenly to at most `max_rows`.

A torn last line (the trainer is writing it right now) is skipped, not an error.
"""

from __future__ import annotations

import json
import os
import re

from orchestrator.agent.protocol import AgentFailure

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def read_rows(path: str) -> tuple[list[dict], int]:
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
    run_id = str(request.get("run_id", ""))
    if ".." in run_id or not _SAFE.match(run_id):
        raise AgentFailure("BadName", f"not a valid run id: {run_id!r}")
    run_dir = os.path.join(request["workdir"], "runs", run_id)
    if not os.path.isdir(run_dir):
        raise AgentFailure("RunNotFound", f"no run {run_id} in {request['workdir']}/runs", fix="dflashctl runs")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {"run_id": run_id, "rows": [], "total": 0, "bad_lines": 0}
    rows, bad = read_rows(path)
    max_rows = int(request.get("max_rows", 2000))
    total = len(rows)
    if total > max_rows > 0:
        stride = total / max_rows
        rows = [rows[int(i * stride)] for i in range(max_rows - 1)] + [rows[-1]]
    return {"run_id": run_id, "rows": rows, "total": total, "bad_lines": bad}
