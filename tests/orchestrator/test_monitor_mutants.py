"""The regression and hang checks (orchestrator.monitor) at their edges, exactly: thresholds met or not by one
unit, the alert's message and detail field by field, records the checks must ignore, re-arming. Pure logic on
synthetic records, as the follower feeds them; what tests/mutation/run.py runs against the monitor's mutants
with tests/orchestrator/test_monitor.py."""

from __future__ import annotations

import pytest

from orchestrator.monitor import Alert, HangDetector, ThroughputRegression, _number, record_time


def test_record_time_reads_numbers_and_iso_strings_and_nothing_else():
    assert record_time({"time": 12}) == 12.0 and isinstance(record_time({"time": 12}), float)
    assert record_time({"time": 1.5}) == 1.5
    assert record_time({"time": "2026-01-01T00:00:00Z"}) == 1767225600.0
    assert record_time({"time": "2026-01-01T01:00:00+01:00"}) == 1767225600.0
    assert record_time({"time": "2026-01-01T00:00:00"}) is not None  # naive: local time, still a time
    assert record_time({"time": "yesterday"}) is None
    assert record_time({"time": True}) is None and record_time({"time": False}) is None
    assert record_time({"time": None}) is None and record_time({"time": [1]}) is None
    assert record_time({}) is None
    assert record_time({"t": 5, "time": 9}, "t") == 5.0
    assert record_time({"t": "2026-01-01T00:00:00Z"}, time_key="t") == 1767225600.0


def test_number_keeps_finite_numbers_only():
    assert _number(3) == 3.0 and isinstance(_number(3), float) and _number(-2.5) == -2.5 and _number(0) == 0.0
    for bad in (True, False, None, "5", float("nan"), float("inf"), float("-inf"), [1]):
        assert _number(bad) is None, bad


def test_the_regression_alert_says_what_fell_how_far_for_how_long_and_its_settings():
    det = ThroughputRegression(20000, fraction=0.7, seconds=300)
    recs = [{"time": 100 + t, "tokens_per_s": v, "step": t // 10} for t, v in
            [(0, 12000), (100, 13000), (200, 11000), (300, 12500)]]
    alerts = [a for r in recs for a in det.feed(r)]
    assert alerts == [Alert(
        kind="regression",
        message=("tokens/s 12250 is 61% of the last good run's 20000 for 300 s (regression_fraction: 70% for "
                 "regression_seconds: 300 s)"),
        detail={"tokens_per_s": 12250.0, "baseline": 20000.0, "since": 100.0, "seconds": 300.0, "step": 30},
    )]
    assert alerts[0].to_dict() == {"kind": "regression", "message": alerts[0].message, "detail": alerts[0].detail}


def test_the_regression_fires_at_exactly_its_seconds_and_only_strictly_below_the_threshold():
    det = ThroughputRegression(1000, fraction=0.5, seconds=60)
    assert det.threshold == 500.0 and det.baseline == 1000.0 and det.fraction == 0.5 and det.seconds == 60
    assert det.feed({"time": 0, "tokens_per_s": 500}) == []  # at the threshold: not below
    assert det.feed({"time": 60, "tokens_per_s": 500}) == []
    assert det.feed({"time": 100, "tokens_per_s": 499}) == []
    assert det.feed({"time": 159, "tokens_per_s": 499}) == []
    [alert] = det.feed({"time": 160, "tokens_per_s": 499})  # exactly 60 s below
    assert alert.detail["since"] == 100.0 and alert.detail["seconds"] == 60.0 and "step" in alert.detail
    assert alert.detail["step"] is None
    assert det.feed({"time": 170, "tokens_per_s": 1}) == []  # fired: once per fall
    assert det.feed({"time": 171, "tokens_per_s": 500}) == []  # back at the threshold: re-armed
    assert det.feed({"time": 200, "tokens_per_s": 100}) == []
    [again] = det.feed({"time": 260, "tokens_per_s": 300})
    assert again.detail["since"] == 200.0 and again.detail["tokens_per_s"] == 200.0  # the median of this fall only


def test_the_regression_ignores_records_without_a_value_a_time_or_a_baseline_without_resetting():
    det = ThroughputRegression(1000, seconds=10, key="tps", time_key="t")
    assert det.key == "tps" and det.time_key == "t" and det.fraction == 0.7
    assert det.feed({"t": 0, "tps": 100}) == []
    assert det.feed({"t": 5, "tps": "nan"}) == [] and det.feed({"tps": 2000}) == []  # neither resets the fall
    assert det.feed({"t": 6, "tokens_per_s": 2000, "time": 6}) == []  # other keys are not read
    assert len(det.feed({"t": 10, "tps": 100})) == 1
    none = ThroughputRegression(None, seconds=0)
    assert none.baseline is None and none.threshold == 0.0
    assert none.feed({"time": 0, "tokens_per_s": -5}) == []  # no baseline: nothing, even below 0
    none.set_baseline(10)
    assert none.threshold == pytest.approx(7.0) and len(none.feed({"time": 1, "tokens_per_s": 1})) == 1


def test_defaults_and_bad_settings():
    det = ThroughputRegression(100)
    assert (det.fraction, det.seconds, det.key, det.time_key) == (0.7, 300, "tokens_per_s", "time")
    assert ThroughputRegression(100, fraction=1).threshold == 100.0  # 1 is allowed
    for bad in (0, -0.1, 1.01):
        with pytest.raises(ValueError, match=f"fraction must be in \\(0, 1\\], got {bad}"):
            ThroughputRegression(100, fraction=bad)
    for bad in (0, -1, None, "5", float("nan"), True):
        with pytest.raises(ValueError, match="baseline tokens/s must be a number > 0, got "):
            det.set_baseline(bad)
    with pytest.raises(ValueError, match=r"got \{'tokens_per_s': None\}|got None"):
        det.set_baseline({"tokens_per_s": None})
    det.set_baseline({"tokens_per_s": 50, "run_id": "r"})
    assert det.baseline == 50.0 and det.threshold == 35.0
    assert HangDetector().seconds == 600


def test_the_hang_alert_names_the_silence_and_where_the_log_and_metrics_stand():
    det = HangDetector(seconds=30)
    assert det.feed(100, 7, 3, True) == []
    assert det.feed(129, 7, 3, True) == []
    [alert] = det.feed(130, 7, 3, True)  # exactly 30 s
    assert alert == Alert(
        kind="hang",
        message=("session alive but no new log bytes and no metrics for 30 s (hang_seconds: 30 s; log at 7 bytes, "
                 "3 metrics records)"),
        detail={"silent_seconds": 30, "log_bytes": 7, "metrics_seen": 3},
    )


def test_a_dead_session_restarts_the_silence_and_re_arms():
    det = HangDetector(seconds=30)
    det.feed(0, 1, 1, True)
    assert det.feed(40, 1, 1, False) == []  # dead: an exit, not a hang; the silence starts again
    assert det.feed(60, 1, 1, True) == []  # 20 s since the dead tick, not 60 since the last progress
    assert [a.kind for a in det.feed(70, 1, 1, True)] == ["hang"]
    assert det.feed(80, 1, 1, False) == []
    assert [a.detail["silent_seconds"] for a in det.feed(110, 1, 1, True)] == [30]  # re-armed by the dead tick


def test_log_bytes_alone_re_arm_the_hang_check():
    det = HangDetector(seconds=30)
    det.feed(0, 1, 1, True)
    assert det.feed(25, 2, 1, True) == []
    assert det.feed(50, 2, 1, True) == []
    assert [a.detail["silent_seconds"] for a in det.feed(55, 2, 1, True)] == [30]


def test_any_baseline_above_zero_is_a_baseline():
    det = ThroughputRegression(None)
    det.set_baseline(0.5)  # a slow run (a tiny CPU run's first steps) is still a baseline
    assert det.baseline == 0.5 and det.threshold == pytest.approx(0.35)
    det.set_baseline({"tokens_per_s": 1})
    assert det.baseline == 1.0
