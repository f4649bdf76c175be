"""Ending a run gracefully (SIGINT, then SIGTERM after a grace period, then SIGKILL): the `stop` verb and
`launch --replace` (in the same agent call) both stop a run with stop_run.

Before its first signal a stop writes runs/<id>/stop.json ({by, via, at}); start_training.sh copies it into
exit.json as "stopped", so the run's state is "stopped", not failed (a SIGINT ends most commands with 130).

The signals go to the command's process group (start_training.sh writes its id to runs/<id>/pid), never to
the wrapper script or its tee: the wrapper must live on to write exit.json and to finish the log.
"""

from __future__ import annotations

import os
import signal
import time

from orchestrator.agent import runs, tmuxctl
from orchestrator.agent.protocol import AgentFailure

_POLL_S = 0.1
# After SIGKILL the wrapper only has to notice and write exit.json.
_AFTER_KILL_S = 10.0


def _ended(run_dir, pgid: int | None) -> bool:
    """The run is over when exit.json exists, or (the wrapper itself killed) nothing of the command is left."""
    if (run_dir / "exit.json").exists():
        return True
    return pgid is not None and not runs.group_alive(pgid)


def _record_stop(run_dir, requested_by: dict | None) -> None:
    """stop.json: who asked, through which verb, and when (the wrapper copies it into exit.json)."""
    who = requested_by or {}
    runs.write_json(run_dir / runs.STOP_NAME, {"by": str(who.get("by") or "unknown"),
                                               "via": str(who.get("via") or "dflashctl stop"), "at": runs.utc_now()})


def stop_run(workdir: str, run_id: str, grace_s: float, emit, requested_by: dict | None = None) -> dict:
    """Stop one run; see the module docstring. Returns the result dict (without GPU waiting).

    Args:
        requested_by: {by: user@host, via: the verb}, recorded in stop.json before the first signal.

    Raises:
        AgentFailure("RunNotFound"): no such run directory.
        AgentFailure("StopFailed"): the run still lives after SIGKILL.
    """
    runs.check_run_id(run_id)
    run_dir = runs.runs_root(workdir) / run_id
    if not run_dir.is_dir():
        raise AgentFailure("RunNotFound", f"no run {run_id} in {runs.runs_root(workdir)}", fix="dflashctl status")
    session = next((s for s in tmuxctl.list_sessions() if s.get("run_id") == run_id), None)
    signals_sent: list[str] = []
    pgid = runs.read_pid(run_dir)
    already = (run_dir / "exit.json").exists() or (pgid is None and (session is None or session["dead"]))
    if not already:
        if pgid is None:
            # The wrapper has not started the command yet (or never will): signal the pane's group, whose
            # wrapper forwards INT/TERM to the command once it exists.
            pgid = session["pane_pid"] if session else None
        if pgid is None:
            already = True
    if not already:
        _record_stop(run_dir, requested_by)
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, grace_s), (signal.SIGKILL, _AFTER_KILL_S)):
            if _ended(run_dir, pgid):
                break
            name = signal.Signals(sig).name
            emit.progress("stop", f"sending {name} to run {run_id} (process group {pgid})", signal=name)
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            signals_sent.append(name)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not _ended(run_dir, pgid):
                time.sleep(_POLL_S)
        # The command is gone; give the wrapper a moment to write exit.json (it waits for tee first).
        deadline = time.monotonic() + _AFTER_KILL_S
        while time.monotonic() < deadline and not (run_dir / "exit.json").exists():
            time.sleep(_POLL_S)
        if runs.group_alive(pgid):
            raise AgentFailure(
                "StopFailed",
                f"run {run_id}: process group {pgid} still alive after SIGKILL (uninterruptible I/O? a hung GPU?)",
                fix="check `nvidia-smi` and `ps -eo pid,pgid,stat,cmd` in the target",
            )
    if session is not None:
        # The pane is dead now (remain-on-exit kept it); free the name for the next launch.
        tmuxctl.kill_session(session["name"])
    ref = runs.load_ref(run_dir)
    exit_info = runs.read_exit(ref)
    return {
        "run_id": run_id,
        "signals": signals_sent,
        "already_ended": bool(already),
        "exit": exit_info,
        # nothing of the run is left by now
        "state": runs.state_of(exit_info, False, runs.stopped_by(ref, exit_info)),
        "session": session["name"] if session else None,
    }
