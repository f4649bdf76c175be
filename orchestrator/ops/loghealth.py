"""The health checks a follow of a run runs over what it streams: orchestrator.monitor's metrics monitors over
each metrics record, and its hang check over each heartbeat."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from orchestrator import monitor
from orchestrator.agent.events import Heartbeat
from orchestrator.monitor import Alert

if TYPE_CHECKING:
    from orchestrator.inventory_models import Monitor


class LogHealth:
    """The follower's health checks, fed from the stream: `orchestrator.monitor`'s ThroughputRegression and
    MemoryGrowth (and the τ checks) over each metrics record, and its HangDetector over each heartbeat (the
    session alive, yet neither train.log nor metrics.jsonl grew for `hang_seconds`). Each method returns the
    new alerts.

    Args:
        cfg: the inventory's `monitor:` section (regression_fraction, regression_seconds, hang_seconds,
            memory_growth_seconds).
        clock: seconds (monotonic); tests pass a fake.
    """

    def __init__(self, cfg: Monitor, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.monitors = monitor.build_monitors(cfg)
        self.hang = monitor.HangDetector(float(getattr(cfg, "hang_seconds", 600)))

    def set_baseline(self, baseline: dict) -> None:
        for mon in self.monitors:
            if hasattr(mon, "set_baseline"):
                mon.set_baseline(baseline)

    def metrics(self, records: list[dict]) -> list[Alert]:
        alerts: list[Alert] = []
        for rec in records:
            for mon in self.monitors:
                alerts.extend(mon.feed(rec) or [])
        return alerts

    def heartbeat(self, ev: Heartbeat) -> list[Alert]:
        return self.hang.feed(self.clock(), ev.log_size, ev.metrics_size or 0, ev.session_alive is True)
