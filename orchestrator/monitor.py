"""Health checks beyond crashes, as pure state machines over metrics records and follow ticks.

Each detector is fed in time order and returns the alerts that fire now; an alert fires once and re-arms
only after the condition has cleared, so a follower can print every alert it gets. Times are seconds
(epoch or monotonic, as long as one detector sees one kind). Metrics records are the dicts of
`metrics.jsonl`; their time is read from `time_key` (a number or an ISO-8601 string).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any


@dataclass
class Alert:
    """One health alert: kind is "regression", "memory-growth" or "hang"."""

    kind: str
    message: str
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def record_time(record: dict, time_key: str = "time") -> float | None:
    """The time of a metrics record in seconds, or None when it has none."""
    value = record.get(time_key)
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def _number(value: Any) -> float | None:
    # The trainer writes non-finite floats as strings ("nan"); those are not throughput or memory.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


class ThroughputRegression:
    """Tokens/s below `fraction` x the baseline for at least `seconds`.

    Args:
        baseline_tokens_per_s: the last good run's median tokens/s (the agent's tail verb finds it:
            orchestrator.agent.tailer.last_good_baseline); None until `set_baseline` provides one (nothing
            fires without a baseline).
        fraction: the threshold as a fraction of the baseline.
        seconds: how long throughput must stay below it.
        key: the metrics field holding tokens/s.
        time_key: the metrics field holding the record's time.
    """

    def __init__(self, baseline_tokens_per_s: float | None, fraction: float = 0.7, seconds: float = 300,
                 key: str = "tokens_per_s", time_key: str = "time"):
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.seconds = seconds
        self.key = key
        self.time_key = time_key
        self.baseline: float | None = None
        self.threshold = 0.0
        self._below_since: float | None = None
        self._fired = False
        self._low: list[float] = []
        if baseline_tokens_per_s is not None:
            self.set_baseline(baseline_tokens_per_s)

    def set_baseline(self, baseline: float | dict) -> None:
        """Set the baseline: tokens/s as a number, or a dict with `tokens_per_s` (the agent's tail verb
        reports that dict)."""
        if isinstance(baseline, dict):
            baseline = baseline.get("tokens_per_s")
        value = _number(baseline)
        if value is None or value <= 0:
            raise ValueError(f"baseline tokens/s must be a number > 0, got {baseline!r}")
        self.baseline = value
        self.threshold = value * self.fraction

    def feed(self, record: dict) -> list[Alert]:
        """Consume one metrics record; return the alert when the regression has lasted `seconds`."""
        value, now = _number(record.get(self.key)), record_time(record, self.time_key)
        if value is None or now is None or self.baseline is None:
            return []
        if value >= self.threshold:
            self._below_since, self._fired, self._low = None, False, []
            return []
        if self._below_since is None:
            self._below_since = now
        self._low.append(value)
        if self._fired or now - self._below_since < self.seconds:
            return []
        self._fired = True
        median = statistics.median(self._low)
        return [Alert(
            kind="regression",
            message=(f"tokens/s {median:.0f} is {median / self.baseline:.0%} of the last good run's "
                     f"{self.baseline:.0f} for {now - self._below_since:.0f} s (regression_fraction: "
                     f"{self.fraction:.0%} for regression_seconds: {self.seconds:g} s)"),
            detail={"tokens_per_s": median, "baseline": self.baseline, "since": self._below_since,
                    "seconds": now - self._below_since, "step": record.get("step")},
        )]


class MemoryGrowth:
    """A memory field rising steadily for `seconds` (after warm-up it should be flat).

    The slope is a least-squares fit over the records of the last `seconds`; it fires when the window is
    full, the slope is at least `min_slope_mib_per_min`, the total rise over the window at least
    `min_rise_mib`, and each half of the window holds at least a quarter of the rise (a single step up,
    e.g. a new shape, is not growth).

    Args:
        seconds: window length.
        min_slope_mib_per_min: the slope that counts as growth.
        min_rise_mib: the minimum rise across the window.
        keys: fields to watch; None watches every numeric field named mem_* or *_mb.
        time_key: the metrics field holding the record's time.
    """

    def __init__(self, seconds: float = 600, min_slope_mib_per_min: float = 10.0, min_rise_mib: float = 256.0,
                 keys: Iterable[str] | None = None, time_key: str = "time"):
        self.seconds = seconds
        self.min_slope = min_slope_mib_per_min / 60.0  # MiB per second
        self.min_rise = min_rise_mib
        self.keys = None if keys is None else set(keys)
        self.time_key = time_key
        self._series: dict[str, deque[tuple[float, float]]] = {}
        self._fired: set[str] = set()

    def _watched(self, record: dict) -> list[str]:
        if self.keys is not None:
            return [k for k in self.keys if k in record]
        return [k for k in record if k.startswith("mem_") or k.endswith("_mb") or k.endswith("_mib")]

    def feed(self, record: dict) -> list[Alert]:
        """Consume one metrics record; return an alert per field that has been growing for the window."""
        now = record_time(record, self.time_key)
        if now is None:
            return []
        alerts = []
        for key in self._watched(record):
            value = _number(record.get(key))
            if value is None:
                continue
            series = self._series.setdefault(key, deque())
            series.append((now, value))
            while len(series) > 2 and now - series[1][0] >= self.seconds:
                series.popleft()  # keep exactly one point at or before the window start
            if now - series[0][0] < self.seconds or len(series) < 3:
                continue
            slope = _slope(series)
            rise = series[-1][1] - series[0][1]
            # Steady, not a step: both halves of the window must rise (a new shape or cache allocation
            # lifts memory once and then stays flat; that is not a leak).
            mid_t = (series[0][0] + now) / 2
            mid_v = min(series, key=lambda p: abs(p[0] - mid_t))[1]
            halves = min(mid_v - series[0][1], series[-1][1] - mid_v)
            growing = slope >= self.min_slope and rise >= self.min_rise and halves >= rise / 4
            if not growing:
                self._fired.discard(key)
            elif key not in self._fired:
                self._fired.add(key)
                alerts.append(Alert(
                    kind="memory-growth",
                    message=(f"{key} rose {rise:.0f} MiB in {now - series[0][0]:.0f} s "
                             f"({slope * 60:.1f} MiB/min) while it should be flat "
                             f"(memory_growth_seconds: {self.seconds:g} s)"),
                    detail={"key": key, "rise_mib": rise, "slope_mib_per_min": slope * 60,
                            "from": series[0][1], "to": series[-1][1], "step": record.get("step")},
                ))
        return alerts


def _slope(points: Iterable[tuple[float, float]]) -> float:
    pts = list(points)
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    mv = sum(v for _, v in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return 0.0 if var == 0 else sum((t - mt) * (v - mv) for t, v in pts) / var


class HangDetector:
    """The session is alive but neither the log nor the metrics advanced for `seconds`.

    The one hang check: `dflashctl logs` feeds it each tail heartbeat (ops.logs.LogHealth.heartbeat).

    Args:
        seconds: silence that counts as a hang.
    """

    def __init__(self, seconds: float = 600):
        self.seconds = seconds
        self._last: tuple[int, int] | None = None
        self._since: float | None = None
        self._fired = False

    def feed(self, now: float, log_bytes: int, metrics_seen: int, session_alive: bool) -> list[Alert]:
        """One follow tick.

        Args:
            now: the current time in seconds.
            log_bytes: bytes of train.log seen so far.
            metrics_seen: how far metrics.jsonl has got (records or bytes: only a change counts).
            session_alive: whether the tmux session still runs (a dead session is an exit, not a hang).

        Returns:
            A hang alert the first tick the silence reaches `seconds`.
        """
        progress = (log_bytes, metrics_seen)
        if progress != self._last or self._since is None:
            self._last, self._since, self._fired = progress, now, False
            return []
        if not session_alive:
            self._since, self._fired = now, False
            return []
        silent = now - self._since
        if self._fired or silent < self.seconds:
            return []
        self._fired = True
        return [Alert(
            kind="hang",
            message=(f"session alive but no new log bytes and no metrics for {silent:.0f} s "
                     f"(hang_seconds: {self.seconds:g} s; log at {log_bytes} bytes, {metrics_seen} metrics records)"),
            detail={"silent_seconds": silent, "log_bytes": log_bytes, "metrics_seen": metrics_seen},
        )]


def build_monitors(cfg: Any = None) -> list:
    """The metrics monitors a follower feeds every record to, from the inventory's `monitor:` section.

    The throughput check waits for `set_baseline` (the last good run); memory growth runs from the start.
    The hang check needs follow ticks, not records, so it is built separately (`HangDetector`).

    Args:
        cfg: an object or mapping with regression_fraction, regression_seconds, memory_growth_seconds
            (missing ones take the defaults).

    Returns:
        [ThroughputRegression, MemoryGrowth]
    """
    def get(name: str, default: float) -> float:
        value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        return default if value is None else float(value)

    return [
        ThroughputRegression(None, fraction=get("regression_fraction", 0.7), seconds=get("regression_seconds", 300)),
        MemoryGrowth(seconds=get("memory_growth_seconds", 600)),
    ]
