"""`logs`: show or follow a run's log through ONE long-lived agent `tail` exec, surviving dropped
connections without losing or repeating a line, matching crash signatures line by line and watching the
metrics for regressions, memory growth and hangs.

Loss-free resume: the agent only ever sends whole lines, each event tagged with its byte range. The follower
keeps `log_offset` = the end of the last event it fully processed; after a drop it asks a new agent exec to
start exactly there. An event cut in half by the drop is never parsed (it is not a complete JSON line), so
its lines are neither shown nor counted, and the next exec sends them again, once.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.agent.events import Data, Event, Heartbeat, Metrics, RunInfo, Truncated
from orchestrator.agent.requests import TailAnswer
from orchestrator.errors import AgentError, ConnectError, RemoteCommandError, RunNotFound, UserError
from orchestrator.ops import placement
from orchestrator.records import printed_offset, save_printed_offset

# Outcome -> process exit code (README, `dflashctl logs --help`).
EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_KNOWN_CRASH = 2
EXIT_LOST = 3
EXIT_NO_RUN = 4
EXIT_STOPPED = 5  # `dflashctl stop` or `launch --replace` ended the run (neither success nor a failure of its own)

# Severities of signatures that name why a run died (others are warnings: a slowdown, a recompile).
CRASH_SEVERITIES = frozenset({"fatal", "critical", "error", "crash"})
# The matcher's id for a traceback no catalogue entry explains: a crash, but not a "known" one.
UNCLASSIFIED = "unclassified-traceback"


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


@dataclass
class FollowOutcome:
    """How a follow (or a one-shot look) ended.

    state: succeeded | stopped (exit["stopped"] says by whom and when) | failed | crashed | running (one-shot
    look at a live run) | lost (connection gone for good).
    """

    run_id: str | None
    experiment: str | None
    state: str
    exit: dict | None = None
    matches: list = field(default_factory=list)
    alerts: list = field(default_factory=list)
    lines: int = 0
    reconnects: int = 0
    offsets: dict = field(default_factory=dict)
    baseline: dict | None = None
    error: str | None = None

    @property
    def crash_matches(self) -> list:
        """Matches of a known signature severe enough to name why the run died (not warnings, not an
        unclassified traceback)."""
        return [m for m in self.matches
                if _severity(m) in CRASH_SEVERITIES and _signature_id(m) != UNCLASSIFIED]

    @property
    def exit_code(self) -> int:
        """0 succeeded (or still running), 1 failed, 2 died with a known crash signature, 3 lost, 5 stopped."""
        if self.state == "lost":
            return EXIT_LOST
        if self.state == "stopped":
            return EXIT_STOPPED
        if self.state in ("succeeded", "running"):
            return EXIT_SUCCEEDED
        return EXIT_KNOWN_CRASH if self.crash_matches else EXIT_FAILED

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "experiment": self.experiment,
            "state": self.state,
            "exit": self.exit,
            "exit_code": self.exit_code,
            "lines": self.lines,
            "reconnects": self.reconnects,
            "offsets": self.offsets,
            "baseline": self.baseline,
            "matches": [_match_dict(m) for m in self.matches],
            "alerts": [_plain(a) for a in self.alerts],
            "error": self.error,
        }


def _signature_id(match: Any) -> str | None:
    sig = getattr(match, "signature", None)
    if isinstance(match, dict):
        sig = match.get("signature")
    return sig if isinstance(sig, str) or sig is None else getattr(sig, "id", None)


def _severity(match: Any) -> str:
    sig = getattr(match, "signature", None)
    value = getattr(match, "severity", None) or getattr(sig, "severity", None)
    if value is None and isinstance(match, dict):
        value = match.get("severity")
    return str(value or "error").lower()


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return obj
    for name in ("to_dict", "model_dump", "as_dict"):
        fn = getattr(obj, name, None)
        if callable(fn):
            return fn()
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(obj)
    return {"text": str(obj)}


def _match_dict(match: Any) -> dict:
    return _plain(match)


class _Stop(Exception):
    """A consumer callback failed; the follow stops and re-raises it."""


class _Follower:
    """State of one follow across reconnects. Events are handled on the transport's reader thread, one at a
    time and in order; the offsets only move after an event is fully handled."""

    def __init__(self, *, on_line, on_match, on_alert, on_event, matcher, health, on_offset=None):
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
        self.matches: list = []
        self.alerts: list = []
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
        if self.matcher is not None and hasattr(self.matcher, "mark"):
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
        if self.health is not None:
            self._alerts(self.health.log_activity(end))

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

    def _alerts(self, alerts) -> None:
        for alert in alerts or ():
            self.alerts.append(alert)
            if self.on_alert is not None:
                self.on_alert(alert)

    def finish_matcher(self) -> None:
        if self.matcher is None:
            return
        finish = getattr(self.matcher, "finish", None)
        for match in (finish() if callable(finish) else None) or ():
            self.matches.append(match)
            if self.on_match is not None:
                self.on_match(match)


def _transient(exc: BaseException) -> bool:
    """Whether a failed tail exec is worth a reconnect (a dead connection) rather than an error to show."""
    from orchestrator.errors import HostKeyError

    if isinstance(exc, HostKeyError):
        return False  # a changed or unknown host key never fixes itself
    if isinstance(exc, AgentError):
        return exc.agent_type in ("AgentDied",)
    if isinstance(exc, (ConnectError, RemoteCommandError, EOFError, OSError)):
        return True
    return type(exc).__module__.startswith("paramiko")


def follow(
    target,
    run_id: str | None = None,
    *,
    experiment: str | None = None,
    offset: int = 0,
    tail: int | None = None,
    follow: bool = True,
    on_line: Callable[[str], None] | None = None, on_match: Callable[[Any], None] | None = None,
    on_alert: Callable[[Any], None] | None = None, on_status: Callable[[str], None] | None = None,
    on_event: Callable[[Event], None] | None = None, on_offset: Callable[[int], None] | None = None,
    matcher=None, health=None, backoff: Backoff | None = None,
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
        matcher: object with `feed_line(line) -> list[Match]` and optionally `finish() -> list[Match]`.
        health: object with `set_baseline(dict)`, `metrics(records)`, `heartbeat(event)`,
            `log_activity(offset)`, each returning a list of alerts (see LogHealth).
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
            return _finished(st, result, reconnects, health)
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


def _tail_request(st: _Follower, *, follow: bool, tail: int | None, heartbeat: float, baseline: bool) -> dict[str, Any]:
    """The tail request of the next exec: from the byte after the last one delivered (the whole state in `st`)."""
    from orchestrator.agent.requests import TailRequest

    start = {"offset": 0, "tail": tail} if st.log_offset is None else {"offset": st.log_offset}
    return TailRequest(run_id=st.run_id, experiment=None if st.run_id else st.experiment, follow=follow,
                       metrics=follow, metrics_offset=st.metrics_offset, heartbeat=heartbeat,
                       baseline=bool(baseline and st.baseline is None and follow), **start).to_json()


def _tail_once(target, st: _Follower, request: dict, follow: bool,
               heartbeat_timeout: float) -> tuple[dict | None, BaseException | None, bool]:
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


def _finished(st: _Follower, result: TailAnswer, reconnects: int, health) -> FollowOutcome:
    """The outcome of a tail that ended with a result (the run ended, or a show without --follow)."""
    st.finish_matcher()
    outcome = FollowOutcome(
        run_id=result.run_id, experiment=st.experiment, state=result.state,
        exit=result.exit, matches=st.matches, alerts=st.alerts, lines=st.lines,
        reconnects=reconnects, offsets={"log": st.log_offset, "metrics": st.metrics_offset},
        baseline=st.baseline,
    )
    if health is not None:
        outcome.alerts.extend(health.finished(outcome) or [])
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


def resolve(inv, ref: str | None, target: str | None) -> tuple[str, str | None, str | None]:
    """(target name, run id or None, experiment or None) of `dflashctl logs [RUN|EXPERIMENT] [--target T]` on
    one target: the first placement orchestrator.ops.placement.resolve finds (for `metrics`, which reads one).

    Raises:
        UserError: the name is not a safe run id.
    """
    where = placement.resolve(inv, ref, target)
    return where.placements[0].target, where.run_id, where.experiment


class LogHealth:
    """The follower's health checks, fed from the stream: `orchestrator.monitor`'s ThroughputRegression and
    MemoryGrowth over each metrics record, and its HangDetector over each heartbeat (the session alive, yet
    neither train.log nor metrics.jsonl grew for `hang_seconds`). Each method returns the new alerts.

    Args:
        cfg: the inventory's `monitor:` section (regression_fraction, regression_seconds, hang_seconds,
            memory_growth_seconds).
        clock: seconds (monotonic); tests pass a fake.
    """

    def __init__(self, cfg, clock: Callable[[], float] = time.monotonic):
        from orchestrator import monitor

        self.clock = clock
        self.monitors = monitor.build_monitors(cfg)
        self.hang = monitor.HangDetector(float(getattr(cfg, "hang_seconds", 600)))

    def set_baseline(self, baseline: dict) -> None:
        for mon in self.monitors:
            if hasattr(mon, "set_baseline"):
                mon.set_baseline(baseline)

    def metrics(self, records: list[dict]) -> list:
        alerts: list = []
        for rec in records:
            for mon in self.monitors:
                alerts.extend(mon.feed(rec) or [])
        return alerts

    def log_activity(self, offset: int) -> list:
        return []  # the heartbeat carries the sizes the hang check needs

    def heartbeat(self, ev: Heartbeat) -> list:
        return self.hang.feed(self.clock(), ev.log_size, ev.metrics_size or 0, ev.session_alive is True)

    def finished(self, outcome: FollowOutcome) -> list:
        return []


def build_matcher(inv):
    """The signature matcher over the shipped catalogue plus the inventory's `signatures:`."""
    from orchestrator.signatures import Matcher, load_catalogue

    return Matcher(load_catalogue(inv.signatures or None))


def explain(matcher, match) -> dict:
    """A match as a dict with its signature's title, diagnosis, fix and not_this filled in."""
    out = _match_dict(match)
    catalogue = getattr(matcher, "catalogue", None)
    sig_id = _signature_id(match)
    if catalogue is not None and sig_id in getattr(catalogue, "by_id", {}):
        out.update(catalogue.get(sig_id).render(getattr(match, "groups", None) or {}))
    return out


def _exit_match(matcher, outcome: FollowOutcome) -> None:
    """A run killed by a signal prints no traceback: name it from exit.json (137 -> host OOM kill)."""
    if outcome.state != "failed" or outcome.crash_matches or matcher is None or not outcome.exit:
        return
    from orchestrator.signatures import match_exit

    m = match_exit(matcher.catalogue, outcome.exit.get("exit_code"), outcome.exit.get("signal"))
    if m is not None:
        outcome.matches.append(m)


def _notify(inv, kind: str, run_id: str | None, experiment: str | None, message: str, diagnosis: dict | None,
            **extra) -> None:
    cfg = inv.notify
    if not (cfg.webhook or cfg.command) or not run_id:
        return
    from orchestrator.notify import EVENT_KINDS, make_event, notify

    if kind in EVENT_KINDS:
        event = make_event(kind, run_id, experiment=experiment, message=message, diagnosis=diagnosis, **extra)
        for failed in (o for o in notify(cfg, event) if not o.ok):  # one warning per failed channel, on stderr
            print(failed.warning(kind, inv.source), file=sys.stderr, flush=True)


def logs(inv, ref: str | None = None, *, target: str | None = None, following: bool = True, tail: int | None = None,
         resume: bool = False, on_line=None, on_match=None, on_alert=None, on_status=None, on_event=None,
         backoff: Backoff | None = None) -> FollowOutcome:
    """The whole `dflashctl logs` verb: resolve the run's placements (orchestrator.ops.placement), follow each
    (one stream for a run across targets), match signatures, watch health, notify. Every line printed moves
    the run's printed offset (orchestrator.records.save_printed_offset); with `resume`, a placement whose
    offset is known starts there instead of at `tail`.

    Raises:
        RunNotFound, UserError, InventoryError, ConnectError: as `follow` and the resolution.
    """
    if tail is not None and tail < 0:
        raise UserError(f"--tail must be >= 0, got {tail}", fix="dflashctl logs RUN --tail 100")
    where = placement.resolve(inv, ref, target)
    if where.across:  # one stream of every node's log
        return follow_placements(inv, where, tail=tail, resume=resume, following=following, on_line=on_line,
                                 on_status=on_status, backoff=backoff)
    return _logs_one(inv, where, tail=tail, resume=resume, following=following, on_line=on_line,
                     on_match=on_match, on_alert=on_alert, on_status=on_status, on_event=on_event, backoff=backoff)


def _start(run_id: str | None, target: str, tail: int | None, resume: bool) -> dict:
    """follow's start arguments: after the last line printed here (resume, and an offset is known), else `tail`."""
    offset = printed_offset(run_id, target) if resume and run_id else None
    return {"tail": tail} if offset is None else {"offset": offset, "tail": None}


def _mark(run_id: str | None, target: str, seen: dict):
    """on_offset of a follow: the printed offset saved under the run's id (named by the agent if not given)."""
    def save(offset: int) -> None:
        rid = run_id or seen.get("run_id")
        if rid:
            save_printed_offset(rid, target, offset)
    return save


def _logs_one(inv, where, *, tail, resume, following, on_line, on_match, on_alert, on_status, on_event,
              backoff) -> FollowOutcome:
    """`logs` of a run on one target."""
    place = where.placements[0]
    matcher = build_matcher(inv)
    seen: dict = {}

    def alert(a) -> None:
        # Hangs and regressions are worth a message while the run still goes on.
        d = _plain(a)
        _notify(inv, str(d.get("kind")), seen.get("run_id"), seen.get("experiment"), str(d.get("message", "")), d)
        if on_alert is not None:
            on_alert(a)

    def event(ev: Event) -> None:
        if isinstance(ev, RunInfo):
            seen.update(run_id=ev.run_id, experiment=ev.experiment)
        if on_event is not None:
            on_event(ev)

    with placement.opened(inv, [place.target]) as (tgt,):
        outcome = follow(
            tgt, where.run_id, experiment=where.experiment, follow=following, on_line=on_line,
            on_match=(lambda m: on_match(explain(matcher, m))) if on_match is not None else None,
            on_alert=alert, on_status=on_status, on_event=event, matcher=matcher,
            on_offset=_mark(where.run_id, place.target, seen),
            health=LogHealth(inv.monitor) if following else None, backoff=backoff,
            **_start(where.run_id, place.target, tail, resume),
        )
    _exit_match(matcher, outcome)
    outcome.matches = [explain(matcher, m) for m in outcome.matches]
    # A stopped run is no news to whoever stopped it: no notification.
    if following and outcome.state in ("succeeded", "failed", "crashed"):
        first = outcome.crash_matches[0] if outcome.crash_matches else None
        kind = "completion" if outcome.state == "succeeded" else "crash"
        message = f"{outcome.state}" + (f": {first.get('title')}" if first else "")
        _notify(inv, kind, outcome.run_id, outcome.experiment, message, first,
                exit_code=(outcome.exit or {}).get("exit_code"), state=outcome.state)
    return outcome


# ----------------------------------------------------------------------------- a run across targets


class _Cancelled(Exception):
    """A node's follow was called off (its container is gone; the run ended elsewhere)."""


LOST_NODE_GRACE_S = 60.0
"""After one node's run ended failed, how long the follow waits for the others' exit.json (torch ends their
ranks within seconds) before it stops waiting for a node it cannot reach."""

_WORST = {"failed": 0, "crashed": 1, "lost": 2, "stopped": 3, "running": 4, "succeeded": 5}


def follow_placements(inv, where, *, tail: int | None = None, resume: bool = False, following: bool = True,
                      on_line: Callable[[str], None] | None = None, on_status: Callable[[str], None] | None = None,
                      backoff=None) -> FollowOutcome:
    """`logs` of a run across targets (`where`: its RunPlacements): every node's log followed at once (one
    thread each, each with its own reconnects, so a cut to one node does not stop the others), every line as
    `[TARGET] <line>` (the trainer's own prefix names the node's rank); ends when every node's run has ended,
    or, once one ended failed, when a node it names as lost (or any node, after LOST_NODE_GRACE_S) still
    cannot be reached. Returns the run's outcome: the worst node's, with the run's root cause (run_cause).
    """
    places = where.placements
    lock, cancel = threading.Lock(), [threading.Event() for _ in places]
    outcomes: list = [None] * len(places)

    def emit(fn, text: str) -> None:
        if fn is not None:
            with lock:
                fn(text)

    def sleep_or_cancel(i: int, seconds: float) -> None:
        if cancel[i].wait(seconds):
            raise _Cancelled()

    def one(i: int) -> None:
        name = places[i].target
        try:
            with placement.opened(inv, [name]) as (tgt,):
                outcomes[i] = follow(tgt, where.run_id, experiment=where.experiment, follow=following, matcher=build_matcher(inv),
                                     on_line=lambda text: emit(on_line, f"[{name}] {text}"),
                                     on_status=lambda text: emit(on_status, f"[{name}] {text}"),
                                     on_offset=_mark(where.run_id, name, {}), backoff=backoff,
                                     sleep=lambda s: sleep_or_cancel(i, s),
                                     **_start(where.run_id, name, tail, resume))
        except _Cancelled:
            outcomes[i] = FollowOutcome(where.run_id, where.experiment, "lost",
                                        error=f"node {i} ({name}) unreachable after the run ended elsewhere")
        _call_off(i, outcomes, cancel)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(places))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _run_outcome(outcomes)


def _call_off(i: int, outcomes: list, cancel: list) -> None:
    """Node i's follow ended: when its run failed, stop waiting for the node it names as lost at once, and
    for every other node after LOST_NODE_GRACE_S (a timer)."""
    out = outcomes[i]
    if out is None or out.state not in ("failed", "crashed"):
        return
    lost = ((out.exit or {}).get("root_cause") or {}).get("lost") or {}
    if isinstance(lost.get("node"), int) and 0 <= lost["node"] < len(cancel):
        cancel[lost["node"]].set()
    timer = threading.Timer(LOST_NODE_GRACE_S, lambda: [c.set() for c in cancel])
    timer.daemon = True
    timer.start()


def _run_outcome(outcomes: list) -> FollowOutcome:
    """The worst node's outcome, its exit carrying the run's root cause."""
    worst = min((o for o in outcomes if o is not None), key=lambda o: _WORST.get(o.state, 0))
    cause = placement.run_cause([o.exit for o in outcomes if o is not None])
    if cause is not None and worst.exit is not None:
        worst.exit = {**worst.exit, "root_cause": cause}
    worst.matches = [m for o in outcomes if o is not None for m in o.matches]
    return worst
