"""Health checks beyond crashes, as pure state machines over metrics records and follow ticks.

Each detector is fed in time order and returns the alerts that fire now; an alert fires once and re-arms
only after the condition has cleared, so a follower can print every alert it gets. Times are seconds
(epoch or monotonic, as long as one detector sees one kind). Metrics records are the dicts of
`metrics.jsonl`; their time is read from `time_key` (a number or an ISO-8601 string).
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any


@dataclass
class Alert:
    """One health alert: kind is "regression", "memory-growth", "hang", "tau-near-1", "train-serve-gap" or
    "tau-drop"."""

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

    The one hang check: `dflashctl logs` feeds it each tail heartbeat (ops.loghealth.LogHealth.heartbeat).

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


class SilentFailure:
    """Real τ far below what training says while the token accuracy rises: the drafter learns, yet what is
    evaluated does not draft. The classic train/serve mismatch (wrong target layers, mask token, RoPE base,
    chat template or thinking mode, or a context mask that lets training see target features serving never
    has); the alert names each cause with the run's own value for it, read from the trainer's `facts` record
    (`trainer.metrics.run_facts`).

    Two ways to be far below, each an alert of its own kind:
    - `tau-near-1`: real τ at or below `near_one` (an untrained drafter gives 1.0);
    - `train-serve-gap`: real τ below `sim_ratio` x the training's own simulated τ (`sim_tau` of the newest
      step line: the mean accept length of the training blocks, cumprod of per-slot correctness + 1, which
      tracks the real τ closely when training and serving agree: 0.78 of it on the tiny run at step 100, 0.41
      with the block's own features leaking into training, tests/trainer/test_silent_failure_run.py).

    Args:
        near_one: a τ at or below this counts as "near 1".
        min_accuracy: the training accuracy that says the drafter has learned something.
        min_rise: how much the accuracy must have risen since the first training record.
        sim_ratio: real τ below this fraction of the training's simulated τ is a gap.
    """

    def __init__(self, near_one: float = 1.25, min_accuracy: float = 0.3, min_rise: float = 0.1,
                 sim_ratio: float = 0.5):
        if not 0 < sim_ratio < 1:
            raise ValueError(f"sim_ratio must be in (0, 1), got {sim_ratio}")
        self.near_one, self.min_accuracy, self.min_rise = near_one, min_accuracy, min_rise
        self.sim_ratio = sim_ratio
        self.facts: dict[str, Any] = {}
        self._first_acc: float | None = None
        self._acc: float | None = None
        self._sim: float | None = None
        self._fired = False

    def feed(self, record: dict) -> list[Alert]:
        kind = record.get("kind", "train")
        if kind == "facts":
            self.facts = dict(record)
            return []
        if kind == "train":
            acc = _number(record.get("acc"))
            if acc is not None:
                self._first_acc = acc if self._first_acc is None else self._first_acc
                self._acc = acc
            sim = _number(record.get("sim_tau"))
            if sim is not None:
                self._sim = sim
            return []
        if kind != "eval" or record.get("when") == "before":
            return []
        tau = _number(record.get("tau"))
        if tau is None or self._acc is None or self._first_acc is None:
            return []
        learned = self._acc >= self.min_accuracy and self._acc - self._first_acc >= self.min_rise
        near_one = tau <= self.near_one
        gap = self._sim is not None and tau < self.sim_ratio * self._sim
        if not learned or not (near_one or gap):
            self._fired = False
            return []
        if self._fired:
            return []
        self._fired = True
        rose = f"the token accuracy rose {self._first_acc:.2f} -> {self._acc:.2f}"
        if near_one:
            kind, what = "tau-near-1", f"real τ {tau:.2f} at step {record.get('step')} while {rose}"
        else:
            kind, what = "train-serve-gap", (
                f"real τ {tau:.2f} at step {record.get('step')} is {tau / self._sim:.2f} of the {self._sim:.2f} "
                f"training simulates (below {self.sim_ratio:g}) while {rose}")
        return [Alert(
            kind=kind,
            message=(f"{what}: the drafter learns, but the drafter that is evaluated does not draft as it does in "
                     f"training. Usual causes, with this run's values: {silent_failure_causes(self.facts)}"),
            detail={"tau": tau, "sim_tau": self._sim, "accuracy": self._acc, "first_accuracy": self._first_acc,
                    "facts": self.facts},
        )]


def silent_failure_causes(facts: dict) -> str:
    """The usual causes of a high accuracy with τ near 1, each with what the run's facts say of it."""
    def val(key: str) -> str:
        return "not recorded" if key not in facts else json.dumps(facts[key], sort_keys=True)

    return "; ".join([
        f"target layers {val('target_layer_ids')} of the target's {val('num_target_layers')} (the export's "
        "dflash_config.target_layer_ids must name the layers the drafter was trained on)",
        f"mask token id {val('mask_token_id')} (dflash_config.mask_token_id: the id the engine fills draft slots with)",
        f"RoPE base: target {val('rope_theta_target')}, drafter {val('rope_theta_drafter')} (must be equal; "
        "an export without a top-level rope_theta is read as 10000 by transformers 4.57 loaders)",
        f"chat template arguments {val('chat_template_kwargs')} at training and in its evaluation (what is "
        "served must use the same, e.g. enable_thinking)",
        "the training's context mask (a block may see the target's features only before its anchor: a mask that "
        "shows the anchor's or the block's own features trains on what serving never has)",
    ])


class TauDrop:
    """Real τ falls between evaluations by more than `fraction` of the best τ seen so far (steps > 0).

    Args:
        fraction: the drop, as a fraction of the best earlier τ, that fires (0.2: a fall from 3.0 below 2.4).
    """

    def __init__(self, fraction: float = 0.2):
        if not 0 < fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), got {fraction}")
        self.fraction = fraction
        self._best: tuple[float, Any] | None = None
        self._fired = False

    def feed(self, record: dict) -> list[Alert]:
        if record.get("kind") != "eval" or record.get("when") == "before":
            return []
        tau = _number(record.get("tau"))
        if tau is None:
            return []
        if self._best is None or tau > self._best[0]:
            self._best, self._fired = (tau, record.get("step")), False
            return []
        best, at = self._best
        if tau >= best * (1 - self.fraction):
            self._fired = False
            return []
        if self._fired:
            return []
        self._fired = True
        return [Alert(
            kind="tau-drop",
            message=(f"real τ fell to {tau:.2f} at step {record.get('step')} from {best:.2f} at step {at} "
                     f"(more than {self.fraction:.0%}): a learning rate too high for this point of the run, "
                     "a data shift, or a resume that loaded other weights; compare the checkpoints' τ with "
                     "python -m trainer eval before training on"),
            detail={"tau": tau, "best_tau": best, "best_step": at},
        )]


def build_monitors(cfg: Any = None) -> list:
    """The metrics monitors a follower feeds every record to, from the inventory's `monitor:` section.

    The throughput check waits for `set_baseline` (the last good run); memory growth runs from the start.
    The hang check needs follow ticks, not records, so it is built separately (`HangDetector`).

    Args:
        cfg: an object or mapping with regression_fraction, regression_seconds, memory_growth_seconds
            (missing ones take the defaults).

    Returns:
        [ThroughputRegression, MemoryGrowth, SilentFailure, TauDrop]
    """
    def get(name: str, default: float) -> float:
        value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
        return default if value is None else float(value)

    return [
        ThroughputRegression(None, fraction=get("regression_fraction", 0.7), seconds=get("regression_seconds", 300)),
        MemoryGrowth(seconds=get("memory_growth_seconds", 600)),
        SilentFailure(near_one=get("tau_near_one", 1.25), sim_ratio=get("tau_sim_ratio", 0.5)),
        TauDrop(fraction=get("tau_drop_fraction", 0.2)),
    ]
