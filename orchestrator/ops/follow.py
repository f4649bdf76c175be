"""The follow engine: a run's log shown or followed through ONE long-lived agent `tail` exec, surviving dropped
connections without losing or repeating a line, every line handed to a signature matcher and the metrics and
heartbeats to the health checks (orchestrator.ops.loghealth).

Loss-free resume: the agent only ever sends whole lines, each event tagged with its byte range. The follower
keeps `log_offset` = the end of the last event it fully processed; after a drop it asks a new agent exec to
start exactly there. An event cut in half by the drop is never parsed (it is not a complete JSON line), so
its lines are neither shown nor counted, and the next exec sends them again, once.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.agent.events import Data, Event, Heartbeat, Metrics, RunInfo, Truncated
from orchestrator.agent.requests import TailAnswer, TailRequest
from orchestrator.errors import AgentError, ConnectError, HostKeyError, RemoteCommandError, RunNotFound
from orchestrator.monitor import Alert
from orchestrator.ops.followoutcome import FollowOutcome
from orchestrator.ops.loghealth import LogHealth
from orchestrator.sigmatch import Match, Matcher

if TYPE_CHECKING:
    from orchestrator.target import BaseTarget as Target


@dataclass
class Backoff:
    """Reconnect schedule: initial, initial*factor, ... capped, each plus up to `jitter` of itself.

    `give_up_s`: total seconds without a working connection after which the follow ends as "lost".
    """

    initial: float = 1.0
    factor: float = 2.0
    cap: float = 30.0
    jitter: float = 0.2
    give_up_s: float = 900.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before reconnect number `attempt` (0-based)."""
        base = min(self.cap, self.initial * (self.factor ** max(0, attempt)))
        return base + (rng or random).uniform(0, self.jitter * base)


class _Follower:
    """State of one follow across reconnects. Events are handled on the transport's reader thread, one at a
    time and in order; the offsets only move after an event is fully handled."""

    def __init__(self, *, on_line: Callable[[str], None] | None, on_match: Callable[[Match], None] | None,
                 on_alert: Callable[[Alert], None] | None, on_event: Callable[[Event], None] | None,
                 matcher: Matcher | None, health: LogHealth | None,
                 on_offset: Callable[[int], None] | None = None):
        self.on_line = on_line
        self.on_offset = on_offset
        self.on_match = on_match
        self.on_alert = on_alert
        self.on_event = on_event
        self.matcher = matcher
        self.health = health
        self.run_id: str | None = None
        self.experiment: str | None = None
        self.baseline: dict | None = None
        self.log_offset: int | None = None
        self.metrics_offset = 0
        self.lines = 0
        self.matches: list[Match] = []
        self.alerts: list[Alert] = []
        self.last_event = time.monotonic()
        self.progress = False  # an event arrived during the current attempt
        self.failure: BaseException | None = None

    # ---- events

    def handle(self, ev: Event) -> None:
        self.last_event = time.monotonic()
        self.progress = True
        if self.failure is not None:
            return
        try:
            self._handle(ev)
        except Exception as exc:  # noqa: BLE001 - surfaced in the main thread by follow()
            self.failure = exc

    def _handle(self, ev: Event) -> None:
        if self.on_event is not None:
            self.on_event(ev)
        if isinstance(ev, RunInfo):
            self._run(ev)
        elif isinstance(ev, Data):
            self._data(ev)
        elif isinstance(ev, Metrics):
            self._metrics(ev)
        elif isinstance(ev, Heartbeat):
            if self.health is not None:
                self._alerts(self.health.heartbeat(ev))
        elif isinstance(ev, Truncated):
            self.log_offset = 0
            self._printed(0)

    def _printed(self, offset: int) -> None:
        """Every line before `offset` has been handed to on_line: say so (the workstation keeps it)."""
        if self.on_offset is not None:
            self.on_offset(offset)

    def _run(self, ev: RunInfo) -> None:
        self.run_id = ev.run_id or self.run_id
        self.experiment = ev.experiment or self.experiment
        if ev.baseline is not None:
            self.baseline = ev.baseline
            if self.health is not None:
                self.health.set_baseline(self.baseline)
        if self.log_offset is None:
            self.log_offset = ev.offset
        if self.matcher is not None:
            self.matcher.mark = ev.log_mark  # dflashctl's own lines are never matched

    def _data(self, ev: Data) -> None:
        start, end = ev.offset, ev.next
        raw = ev.raw()
        expected = self.log_offset if self.log_offset is not None else start
        if end <= expected:
            return  # already shown (cannot happen with a well-behaved agent; costs nothing to guard)
        if start < expected:
            raw = raw[expected - start:]
        elif start > expected:
            raise RemoteCommandError(f"log stream skipped bytes {expected}..{start} of run {self.run_id}")
        text = raw.decode("utf-8", errors="replace")
        parts = text.split("\n")
        if parts and parts[-1] == "":
            parts.pop()
        for line in parts:
            if line.endswith("\r"):
                line = line[:-1]
            self.lines += 1
            if self.matcher is not None:
                for match in self.matcher.feed_line(line) or ():
                    self.matches.append(match)
                    if self.on_match is not None:
                        self.on_match(match)
            if self.on_line is not None:
                self.on_line(line)
        self.log_offset = end
        self._printed(end)

    def _metrics(self, ev: Metrics) -> None:
        start, end = ev.offset, ev.next
        if end <= self.metrics_offset:
            return
        if start != self.metrics_offset:
            # Metrics chunks are whole lines too; an overlap means a resent chunk: skip it whole.
            if start < self.metrics_offset:
                return
        if self.health is not None:
            self._alerts(self.health.metrics(ev.records))
        self.metrics_offset = end

    def _alerts(self, alerts: list[Alert]) -> None:
        for alert in alerts or ():
            self.alerts.append(alert)
            if self.on_alert is not None:
                self.on_alert(alert)

    def finish_matcher(self) -> None:
        if self.matcher is None:
            return
        for match in self.matcher.finish():
            self.matches.append(match)
            if self.on_match is not None:
                self.on_match(match)


def _transient(exc: BaseException) -> bool:
    """Whether a failed tail exec is worth a reconnect (a dead connection) rather than an error to show."""
    if isinstance(exc, HostKeyError):
        return False  # a changed or unknown host key never fixes itself
    if isinstance(exc, AgentError):
        return exc.agent_type in ("AgentDied",)
    if isinstance(exc, (ConnectError, RemoteCommandError, EOFError, OSError)):
        return True
    return type(exc).__module__.startswith("paramiko")


def follow(
    target: Target,
    run_id: str | None = None,
    *,
    experiment: str | None = None,
    offset: int = 0,
    tail: int | None = None,
    follow: bool = True,
    on_line: Callable[[str], None] | None = None, on_match: Callable[[Match], None] | None = None,
    on_alert: Callable[[Alert], None] | None = None, on_status: Callable[[str], None] | None = None,
    on_event: Callable[[Event], None] | None = None, on_offset: Callable[[int], None] | None = None,
    matcher: Matcher | None = None, health: LogHealth | None = None, backoff: Backoff | None = None,
    heartbeat: float = 2.0, heartbeat_timeout: float | None = None, baseline: bool = True,
    sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None,
) -> FollowOutcome:
    """Show (follow=False) or follow a run's log until it ends, reconnecting as needed.

    Args:
        target: a Target (LocalTarget / ContainerTarget).
        run_id: the run; None: the newest run of `experiment` (or the newest of all). Once the agent has
            named the run, every reconnect asks for that run id.
        offset: byte offset in train.log to start at (ignored when `tail` is given and offset is 0).
        tail: start at the last N complete lines.
        follow: False: print what is there and report the current state (one exec, no reconnect).
        on_line / on_match / on_alert / on_status / on_event: called with each log line (no newline;
            exactly once, in order), signature match (`matcher.feed_line`), monitor alert (`health`), human
            note ("connection lost; reconnecting in 2.1 s"), raw agent event (for --json).
        on_offset: called with the byte offset just past the last line handed to on_line, after each chunk
            (0 when the log was truncated and starts again).
        matcher: the signature matcher every line goes through (orchestrator.ops.logmatch.build_matcher).
        health: the health checks over the metrics and heartbeats (LogHealth).
        backoff: reconnect schedule and give-up time.
        heartbeat: seconds between the agent's heartbeats.
        heartbeat_timeout: silence (no event at all) after which the connection is treated as dead and cut;
            default 5 heartbeats + 10 s.
        baseline: ask the agent for the last good run's throughput.
    Returns:
        FollowOutcome (state lost when the connection stayed down for `backoff.give_up_s`).
    Raises:
        RunNotFound: no such run in the target.
        AgentError / ConnectError: a failure that reconnecting cannot fix (a bad request, a host key).
    """
    backoff = backoff or Backoff()
    heartbeat_timeout = heartbeat_timeout if heartbeat_timeout is not None else 5 * heartbeat + 10
    st = _Follower(on_line=on_line, on_match=on_match, on_alert=on_alert, on_event=on_event,
                   matcher=matcher, health=health, on_offset=on_offset)
    st.run_id = run_id
    st.experiment = experiment
    if offset:
        st.log_offset = int(offset)
    attempt, reconnects, down_since = 0, 0, None
    while True:
        request = _tail_request(st, follow=follow, tail=tail, heartbeat=heartbeat, baseline=baseline)
        result, error, stalled = _tail_once(target, st, request, follow, heartbeat_timeout)
        if result is not None and not stalled:
            return _finished(st, result, reconnects)
        # The exec ended without a result: the connection dropped (or went silent and was cut).
        if error is not None and not _transient(error) and not stalled:
            raise error
        if not follow:
            raise error if error is not None else ConnectError("the tail exec ended without a result")
        last_error = "no heartbeat for %.0f s" % heartbeat_timeout if stalled else str(error or "ended")
        now = time.monotonic()
        if st.progress:
            attempt, down_since = 0, None
        if down_since is None:
            down_since = now
        if now - down_since >= backoff.give_up_s:
            return _lost(st, reconnects, now - down_since, last_error)
        delay = min(backoff.delay(attempt, rng), max(0.0, backoff.give_up_s - (now - down_since)))
        if on_status is not None:
            on_status(f"connection lost ({last_error.splitlines()[0] if last_error else 'no detail'}); "
                      f"reconnecting in {delay:.1f} s")
        sleep(delay)
        attempt += 1
        reconnects += 1


def _tail_request(st: _Follower, *, follow: bool, tail: int | None, heartbeat: float, baseline: bool) -> dict:
    """The tail request of the next exec: from the byte after the last one delivered (the whole state in `st`)."""
    start = {"offset": 0, "tail": tail} if st.log_offset is None else {"offset": st.log_offset}
    return TailRequest(run_id=st.run_id, experiment=None if st.run_id else st.experiment, follow=follow,
                       metrics=follow, metrics_offset=st.metrics_offset, heartbeat=heartbeat,
                       baseline=bool(baseline and st.baseline is None and follow), **start).to_json()


def _tail_once(target: Target, st: _Follower, request: dict, follow: bool,
               heartbeat_timeout: float) -> tuple[TailAnswer | None, BaseException | None, bool]:
    """One tail exec, its events handled by `st`: (result or None, the error that ended it, whether the
    watchdog cut it for silence). A watchdog cuts the exec (Target.abort) after `heartbeat_timeout` s
    without any event, or when the event handling failed.

    Raises:
        RunNotFound; any error that is not a dropped connection; the event handling's own failure.
    """
    st.progress = False
    st.last_event = time.monotonic()
    stalled = threading.Event()
    done = threading.Event()

    def watchdog() -> None:
        while not done.wait(min(1.0, heartbeat_timeout / 4)):
            if time.monotonic() - st.last_event > heartbeat_timeout or st.failure is not None:
                stalled.set()
                target.abort()
                return

    if follow:
        threading.Thread(target=watchdog, name="tail-watchdog", daemon=True).start()
    error: BaseException | None = None
    result: TailAnswer | None = None
    try:
        result = target.agent("tail", request, on_event=st.handle, timeout=None, answer=TailAnswer)
    except AgentError as exc:
        if exc.agent_type == "RunNotFound":
            raise RunNotFound(exc.message, fix=exc.fix) from None
        error = exc
    except (ConnectError, RemoteCommandError, EOFError, OSError) as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - paramiko's own exceptions, classified below
        if not _transient(exc):
            raise
        error = exc
    finally:
        done.set()
    if st.failure is not None:
        raise st.failure
    return result, error, stalled.is_set()


def _finished(st: _Follower, result: TailAnswer, reconnects: int) -> FollowOutcome:
    """The outcome of a tail that ended with a result (the run ended, or a show without --follow)."""
    st.finish_matcher()
    outcome = FollowOutcome(
        run_id=result.run_id, experiment=st.experiment, state=result.state,
        exit=result.exit, matches=st.matches, alerts=st.alerts, lines=st.lines,
        reconnects=reconnects, offsets={"log": st.log_offset, "metrics": st.metrics_offset},
        baseline=st.baseline, disk_full=result.disk_full,
    )
    return outcome


def _lost(st: _Follower, reconnects: int, down_s: float, last_error: str) -> FollowOutcome:
    """The outcome when the connection stayed down too long: state lost, with what was delivered."""
    st.finish_matcher()
    return FollowOutcome(
        run_id=st.run_id, experiment=st.experiment, state="lost", matches=st.matches, alerts=st.alerts,
        lines=st.lines, reconnects=reconnects, baseline=st.baseline,
        offsets={"log": st.log_offset, "metrics": st.metrics_offset},
        error=f"connection lost for {down_s:.0f} s: {last_error.splitlines()[0] if last_error else ''}",
    )
