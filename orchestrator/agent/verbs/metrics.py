"""`metrics`: the rows of runs/<run-id>/metrics.jsonl (or the newest run of an experiment), downsampled
evenly to at most `max_rows` (first and last kept). Evaluation rows (τ) are few and never dropped.

A torn last line (the trainer is writing it right now) is skipped, not an error.
"""

from __future__ import annotations


from orchestrator.agent.requests import MetricsAnswer, MetricsRequest
from orchestrator.agent.rundirs import parse_records, resolve_run


def read_rows(path) -> tuple[list[dict], int]:
    """Parse a metrics.jsonl; returns (rows, number of lines that are not a JSON object)."""
    with open(path, "rb") as f:
        lines = f.readlines()
    if lines and not lines[-1].endswith(b"\n"):
        lines.pop()  # being written
    return parse_records(lines)


def run(request: dict, emit) -> dict:
    req = MetricsRequest.from_json(request)
    ref = resolve_run(req.workdir, req.run_id, req.experiment)
    if not ref.metrics.exists():
        return MetricsAnswer(run_id=ref.run_id).to_json()
    rows, bad = read_rows(ref.metrics)
    max_rows = req.max_rows
    total = len(rows)
    if total > max_rows > 1:
        stride = (total - 1) / (max_rows - 1)
        keep = {round(i * stride) for i in range(max_rows)}
        rows = [r for i, r in enumerate(rows) if i in keep or r.get("kind") == "eval"]
    return MetricsAnswer(run_id=ref.run_id, rows=rows, total=total, bad_lines=bad).to_json()
