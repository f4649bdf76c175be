"""Regression, memory growth and hang detection on synthetic metrics (the last good run, the regression's
baseline, is found by the agent's tail: tests/orchestrator/agent/test_baseline.py)."""

from __future__ import annotations

import pytest

from orchestrator.monitor import (
    HangDetector,
    MemoryGrowth,
    ThroughputRegression,
    build_monitors,
)


def feed(detector, records):
    return [(r["time"], a) for r in records for a in detector.feed(r)]


def test_regression_fires_once_after_the_set_time_and_rearms():
    det = ThroughputRegression(20000, fraction=0.7, seconds=300)
    recs = [{"time": t, "tokens_per_s": 20000} for t in range(0, 600, 10)]
    recs += [{"time": t, "tokens_per_s": 12000} for t in range(600, 1200, 10)]  # 60 %: below 70 %
    recs += [{"time": t, "tokens_per_s": 19500} for t in range(1200, 1500, 10)]  # recovered
    recs += [{"time": t, "tokens_per_s": 10000} for t in range(1500, 1900, 10)]
    alerts = feed(det, recs)
    assert [t for t, _ in alerts] == [900, 1800]
    assert alerts[0][1].kind == "regression" and alerts[0][1].detail["tokens_per_s"] == 12000
    assert "60%" in alerts[0][1].message


def test_regression_ignores_short_dips_missing_values_and_no_baseline():
    det = ThroughputRegression(20000, seconds=300)
    recs = []
    for cycle in range(10):  # dips of 200 s, never 300 s in a row
        base = cycle * 400
        recs += [{"time": base + t, "tokens_per_s": 5000} for t in range(0, 200, 10)]
        recs += [{"time": base + t, "tokens_per_s": 20000} for t in range(200, 400, 10)]
    recs += [{"time": 9000, "tokens_per_s": "nan"}, {"time": 9100}, {"tokens_per_s": 1}]
    assert feed(det, recs) == []
    idle = build_monitors({"regression_seconds": 10})[0]
    assert feed(idle, [{"time": t, "tokens_per_s": 1} for t in range(100)]) == []
    idle.set_baseline({"run_id": "r1", "tokens_per_s": 100.0, "samples": 9})
    assert [t for t, _ in feed(idle, [{"time": t, "tokens_per_s": 1} for t in range(100, 200)])] == [110]
    with pytest.raises(ValueError):
        idle.set_baseline({"tokens_per_s": 0})


def test_memory_growth_detects_a_leak_not_a_plateau_or_a_step():
    leak = [{"time": t, "rss_mb": 9000 + t * 1.0, "cuda_peak_mb": 60000} for t in range(0, 1300, 20)]  # 60 MiB/min
    alerts = feed(MemoryGrowth(seconds=600), leak)
    assert [(t, a.detail["key"]) for t, a in alerts] == [(600, "rss_mb")]
    assert 55 < alerts[0][1].detail["slope_mib_per_min"] < 65
    flat = [{"time": t, "rss_mb": 9000 + (t % 40) * 0.5} for t in range(0, 3000, 20)]
    assert feed(MemoryGrowth(seconds=600), flat) == []
    step = [{"time": t, "rss_mb": 9000 if t < 1000 else 9600} for t in range(0, 3000, 20)]
    # A single step up: inside one window the slope is large, but it levels off; the rise must persist
    # across a whole window of steady growth, which a step is not once the window has moved past it.
    alerts = feed(MemoryGrowth(seconds=600, min_slope_mib_per_min=60), step)
    assert alerts == []


def test_hang_needs_alive_session_and_silence():
    det = HangDetector(seconds=600)
    assert det.feed(0, 100, 1, True) == []
    assert det.feed(500, 100, 1, True) == []
    alerts = det.feed(610, 100, 1, True)
    assert [a.kind for a in alerts] == ["hang"] and alerts[0].detail["silent_seconds"] == 610
    assert det.feed(900, 100, 1, True) == []  # once per silent stretch
    assert det.feed(950, 200, 1, True) == []  # progress re-arms
    assert [a.kind for a in det.feed(1560, 200, 1, True)] == ["hang"]
    dead = HangDetector(seconds=600)
    assert dead.feed(0, 5, 0, False) == [] and dead.feed(5000, 5, 0, False) == []


def test_metrics_progress_alone_rearms_the_hang_check():
    """A run that writes metrics records but no log line (a quiet trainer logging every 1000 steps) is making
    progress: no hang while metrics_seen moves, one once both stop."""
    det = HangDetector(seconds=600)
    assert all(det.feed(t, 100, t // 300, True) == [] for t in range(0, 3001, 100))  # log still, metrics moving
    assert det.feed(3500, 100, 10, True) == []
    assert [a.kind for a in det.feed(3610, 100, 10, True)] == ["hang"]
