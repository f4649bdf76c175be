"""`metrics`: the agent reads a real metrics.jsonl through the LocalTarget; plots render; PNG is written."""

from __future__ import annotations

import json

import pytest

from orchestrator.errors import RunNotFound, UserError
from orchestrator.ops.metrics import fetch_metrics, render_terminal, series_from_rows, write_png
from orchestrator.target import LocalTarget
from orchestrator.transport.local import LocalTransport


@pytest.fixture
def target(tmp_path):
    return LocalTarget(name="local", workdir=str(tmp_path), transport=LocalTransport())


def _write_run(workdir, run_id, rows, torn=False):
    d = workdir / "runs" / run_id
    d.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if torn:
        text += '{"step": 99, "loss": 1.'
    (d / "metrics.jsonl").write_text(text)


def test_fetch_skips_torn_last_line_and_downsamples(target, tmp_path):
    rows = [{"step": i, "loss": 5.0 - i * 0.01, "acc": [0.1, 0.3], "tokens_per_s": 1000 + i} for i in range(50)]
    _write_run(tmp_path, "tiny-20261130T000000Z", rows, torn=True)
    ms = fetch_metrics(target, "tiny-20261130T000000Z", max_rows=10)
    assert ms.total_rows == 50
    steps, losses = ms.series["loss"]
    assert len(steps) == 10 and steps[0] == 0 and steps[-1] == 49  # first and last kept
    assert ms.series["accuracy"][1][0] == pytest.approx(0.2)  # per-slot list -> mean
    assert "simulated τ" not in ms.series


def test_missing_run_and_bad_name(target):
    with pytest.raises(RunNotFound):
        fetch_metrics(target, "nope")
    with pytest.raises(UserError):
        fetch_metrics(target, "../etc")


def test_terminal_and_png(tmp_path):
    ms = series_from_rows("r1", [{"step": i, "loss": 1.0 / (i + 1), "sim_accept_len": 1 + i / 10} for i in range(20)])
    text = render_terminal(ms, width=60, height=8)
    assert "r1: loss" in text and "r1: simulated τ" in text
    png = tmp_path / "m.png"
    write_png(ms, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(UserError, match="no metrics"):
        write_png(series_from_rows("empty", []), str(tmp_path / "e.png"))
