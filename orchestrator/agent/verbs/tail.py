"""`tail`: stream a run's log (and metrics) from byte offsets, in whole lines, until the run ends.

Request:
  run_id: str | None         the run; None: the newest run of `experiment` (or of all)
  experiment: str | None
  offset: int = 0            byte offset in train.log to start from (the follower's resume point)
  tail: int | None           start at the last N complete lines instead (only when offset is 0)
  follow: bool = False       keep streaming until exit.json appears or the session is gone
  metrics: bool = follow     also stream metrics.jsonl
  metrics_offset: int = 0
  poll: float = 0.05         longest sleep between checks when inotify is unavailable
  heartbeat: float = 2.0     seconds between heartbeat events (and tmux session checks)
  baseline: bool = False     also report the last good run of the same experiment (its tokens/s)
Events:
  {"event": "run", "run_id", "experiment", "session", "offset", "baseline", "log_mark"}   first
                                 (log_mark: run.json's, the prefix of dflashctl's own lines; see ownlines)
  {"event": "data", "offset": start, "next": end, "text": str} | same with "b64"    whole lines only
  {"event": "metrics", "offset": start, "next": end, "records": [...], "invalid": n}
  {"event": "heartbeat", "session_alive": bool|null, "log_size": n, "metrics_size": n}
  {"event": "truncated", "file": "train.log"}    the file shrank; streaming restarts at 0
Result: {"run_id", "state" (liveness.state_of: running | stopped | succeeded | failed | crashed),
         "exit": exit.json|null, "offsets": {"log": n, "metrics": n},
         "session_alive": bool|null}
"""

from __future__ import annotations

import base64
import time

from orchestrator.agent.events import Data, Heartbeat, Metrics, RunInfo, Truncated
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import TailAnswer, TailRequest
from orchestrator.ownlines import RUN_JSON_KEY, valid_mark
from orchestrator.agent.liveness import run_alive, state_of, stopped_by
from orchestrator.agent.rundirs import parse_records, read_exit, resolve_run
from orchestrator.agent.tailer import DirWatcher, LineCursor, last_good_baseline, tail_offset
from trainer import faults

# How long to sleep at most with inotify on: changes wake us at once; this only bounds how late a change
# nobody told us about (a log behind a symlink) is noticed.
_INOTIFY_MAX_WAIT = 0.5


def _data_event(emit, start: int, chunk: bytes) -> None:
    try:
        emit.send(Data(offset=start, next=start + len(chunk), text=chunk.decode("utf-8")))
    except UnicodeDecodeError:
        # Not UTF-8: send the bytes as they are, so offsets stay exact and nothing is "replaced".
        emit.send(Data(offset=start, next=start + len(chunk), b64=base64.b64encode(chunk).decode("ascii")))


def _metrics_event(emit, start: int, chunk: bytes) -> None:
    records, invalid = parse_records(chunk.splitlines())
    emit.send(Metrics(offset=start, next=start + len(chunk), records=records, invalid=invalid))


def _not_negative(req: TailRequest) -> None:
    for key in ("offset", "tail", "metrics_offset"):
        value = getattr(req, key)
        if value is not None and value < 0:
            raise AgentFailure("BadRequest", f"tail: {key} must be >= 0, got {value}")


def run(request: dict, emit) -> dict:
    req = TailRequest.from_json(request)
    _not_negative(req)
    workdir, follow, offset, poll, heartbeat = req.workdir, req.follow, req.offset, req.poll, req.heartbeat
    ref = resolve_run(workdir, req.run_id, req.experiment)
    if offset == 0 and req.tail is not None:
        offset = tail_offset(ref.log, req.tail)

    log = LineCursor(ref.log, offset)
    want_metrics = follow if req.metrics is None else req.metrics
    metrics = LineCursor(ref.metrics, req.metrics_offset) if want_metrics else None
    baseline = last_good_baseline(workdir, ref) if req.baseline else None
    emit.send(RunInfo(run_id=ref.run_id, experiment=ref.experiment, session=ref.session, offset=offset,
                      baseline=baseline, log_mark=valid_mark(ref.info.get(RUN_JSON_KEY))))

    watcher = DirWatcher(ref.path, fallback=poll) if follow else None
    truncations = 0

    def pump(final: bool = False) -> bool:
        nonlocal truncations
        moved = False
        for start, chunk in log.read(final=final):
            _data_event(emit, start, chunk)
            moved = True
        if log.truncations != truncations:
            truncations = log.truncations
            emit.send(Truncated(file="train.log"))
        if metrics is not None:
            for start, chunk in metrics.read(final=final):
                _metrics_event(emit, start, chunk)
                moved = True
        return moved

    def finish(state: str, exit_info: dict | None, alive: bool | None) -> dict:
        # Drain to the end; once the run is over the writer is done, so a partial last line is its last line.
        while pump(final=state != "running"):
            pass
        if watcher is not None:
            watcher.close()
        failed = state != "running" and (exit_info is None or exit_info.get("exit_code") not in (0, None))
        # A failed run's full file system, by the trainer's one rule (the same the launcher names in its
        # report): it travels in this answer, which needs no byte of the full disk.
        disk_full = faults.full_filesystem([ref.path]) if failed else None
        return TailAnswer(run_id=ref.run_id, state=state, exit=exit_info, session_alive=alive,
                          offsets={"log": log.offset, "metrics": metrics.offset if metrics else None},
                          disk_full=disk_full).to_json()

    last_check = float("-inf")
    gone_once = False
    alive: bool | None = None
    while True:
        while pump():
            pass
        exit_info = read_exit(ref)
        if exit_info is not None:
            return finish(state_of(exit_info, alive, stopped_by(ref, exit_info)), exit_info, alive)
        now = time.monotonic()
        if not follow or now - last_check >= heartbeat:
            last_check = now
            alive = run_alive(ref)
            if alive is False:
                exit_info = read_exit(ref)  # the wrapper writes exit.json before its session ends
                if exit_info is not None:
                    return finish(state_of(exit_info, alive, stopped_by(ref, exit_info)), exit_info, alive)
                # Require two checks in a row: a run being launched has its directory before its session.
                if gone_once or not follow:
                    return finish(state_of(None, False, stopped_by(ref, None)), None, alive)
                gone_once = True
            else:
                gone_once = False
            if follow:
                emit.send(Heartbeat(session_alive=alive, log_size=log.size(),
                                    metrics_size=metrics.size() if metrics else None))
        if not follow:
            return finish(state_of(None, alive), None, alive)
        wait = min(heartbeat - (time.monotonic() - last_check), _INOTIFY_MAX_WAIT)
        watcher.wait(max(0.0, wait) if watcher.uses_inotify else min(max(0.0, wait), poll))
