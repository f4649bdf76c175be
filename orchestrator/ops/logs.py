"""`logs`: the verb. A run reference resolved into its placements (orchestrator.ops.placement), each followed
by the follow engine (orchestrator.ops.follow) with the signature matcher (orchestrator.ops.logmatch) and the
health checks (orchestrator.ops.loghealth); the printed offset kept per run; notifications sent as the run
ends or goes unhealthy. A run across targets is one stream of every node's log."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from orchestrator.agent.events import Event, RunInfo
from orchestrator.errors import UserError
from orchestrator.monitor import Alert
from orchestrator.notify import EVENT_KINDS, make_event, notify
from orchestrator.ops import placement
from orchestrator.ops.follow import Backoff, follow
from orchestrator.ops.followoutcome import FollowOutcome, alert_dict
from orchestrator.ops.loghealth import LogHealth
from orchestrator.ops.logmatch import build_matcher, exit_match, explain
from orchestrator.ops.placement import RunPlacements
from orchestrator.records import printed_offset, save_printed_offset


def _notify(inv, kind: str, run_id: str | None, experiment: str | None, message: str, diagnosis: dict | None,
            **extra) -> None:
    cfg = inv.notify
    if not (cfg.webhook or cfg.command) or not run_id:
        return
    if kind in EVENT_KINDS:
        event = make_event(kind, run_id, experiment=experiment, message=message, diagnosis=diagnosis, **extra)
        for failed in (o for o in notify(cfg, event) if not o.ok):  # one warning per failed channel, on stderr
            print(failed.warning(kind, inv.source), file=sys.stderr, flush=True)


def logs(inv, ref: str | None = None, *, target: str | None = None, following: bool = True, tail: int | None = None,
         resume: bool = False, on_line: Callable[[str], None] | None = None,
         on_match: Callable[[dict], None] | None = None, on_alert: Callable[[Alert], None] | None = None,
         on_status: Callable[[str], None] | None = None, on_event: Callable[[Event], None] | None = None,
         backoff: Backoff | None = None) -> FollowOutcome:
    """The whole `dflashctl logs` verb: resolve the run's placements (orchestrator.ops.placement), follow each
    (one stream for a run across targets), match signatures, watch health, notify. Every line printed moves
    the run's printed offset (orchestrator.records.save_printed_offset); with `resume`, a placement whose
    offset is known starts there instead of at `tail`. `on_match` gets each match explained (a dict with its
    signature's title, diagnosis and fix).

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


def _mark(run_id: str | None, target: str, seen: dict) -> Callable[[int], None]:
    """on_offset of a follow: the printed offset saved under the run's id (named by the agent if not given)."""
    def save(offset: int) -> None:
        rid = run_id or seen.get("run_id")
        if rid:
            save_printed_offset(rid, target, offset)
    return save


def _logs_one(inv, where: RunPlacements, *, tail, resume, following, on_line, on_match, on_alert, on_status,
              on_event, backoff) -> FollowOutcome:
    """`logs` of a run on one target."""
    place = where.placements[0]
    matcher = build_matcher(inv)
    seen: dict = {}

    def alert(a: Alert) -> None:
        # Hangs and regressions are worth a message while the run still goes on.
        d = alert_dict(a)
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
    exit_match(matcher, outcome)
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


def follow_placements(inv, where: RunPlacements, *, tail: int | None = None, resume: bool = False, following: bool = True,
                      on_line: Callable[[str], None] | None = None, on_status: Callable[[str], None] | None = None,
                      backoff: Backoff | None = None) -> FollowOutcome:
    """`logs` of a run across targets (`where`: its RunPlacements): every node's log followed at once (one
    thread each, each with its own reconnects, so a cut to one node does not stop the others), every line as
    `[TARGET] <line>` (the trainer's own prefix names the node's rank); ends when every node's run has ended,
    or, once one ended failed, when a node it names as lost (or any node, after LOST_NODE_GRACE_S) still
    cannot be reached. Returns the run's outcome: the worst node's, with the run's root cause (run_cause).
    """
    places = where.placements
    lock, cancel = threading.Lock(), [threading.Event() for _ in places]
    outcomes: list[FollowOutcome | None] = [None] * len(places)

    def emit(fn: Callable[[str], None] | None, text: str) -> None:
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


def _call_off(i: int, outcomes: list[FollowOutcome | None], cancel: list[threading.Event]) -> None:
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


def _run_outcome(outcomes: list[FollowOutcome | None]) -> FollowOutcome:
    """The worst node's outcome, its exit carrying the run's root cause."""
    worst = min((o for o in outcomes if o is not None), key=lambda o: _WORST.get(o.state, 0))
    cause = placement.run_cause([o.exit for o in outcomes if o is not None])
    if cause is not None and worst.exit is not None:
        worst.exit = {**worst.exit, "root_cause": cause}
    worst.matches = [m for o in outcomes if o is not None for m in o.matches]
    return worst
