"""Ending a run gracefully (SIGINT, then SIGTERM after a grace period, then SIGKILL) until no process of it is
left: the `stop` verb and `launch --replace` (in the same agent call) both stop a run with stop_run.

Before its first signal a stop writes runs/<id>/stop.json ({by, via, at}); start_training.sh copies it into
exit.json as "stopped", so the run's state is "stopped", not failed (a SIGINT ends most commands with 130).

What is signalled: the command's process group (start_training.sh writes its id to runs/<id>/pid; before
that file exists, the tmux pane's group, whose wrapper forwards INT and TERM to the command once it runs) and
every process carrying the run's environment marker that left that group (orchestrator.agent.runprocs: a
setsid daemon, a job of a shell with job control, an orphan). Never the wrapper script or its tee: the wrapper
must live on to write exit.json and to finish the log.

The escalation does not end when exit.json appears: the command's leader may end on SIGINT while a child of
it (bash's background job, deaf to SIGINT in a non-interactive shell) lives on. Each step is sent only while
something of the run is left, and the answer lists exactly the signals sent. A run with no process left and
no wrapper to write exit.json (the container was restarted under it) is marked stopped without a signal and
without waiting.
"""

from __future__ import annotations

import os
import signal
import time

from orchestrator.agent import atomic, liveness, rundirs, runprocs, tmuxctl
from orchestrator.agent.protocol import AgentFailure

_POLL_S = 0.1
# After SIGKILL the kernel only has to reap, and the wrapper only has to notice and write exit.json.
_AFTER_KILL_S = 10.0


class _Run:
    """What of one run is left: its command's group (the pid file, else the pane's) and its marked processes."""

    def __init__(self, run_dir, session: dict | None):
        self.run_dir = run_dir
        self.pane_pid = session["pane_pid"] if session and not session["dead"] else None

    def pgid(self) -> int | None:
        """The group to signal: the pid file's (when its leader is not a reused pid), else the live pane's."""
        pid = liveness.read_pid(self.run_dir)
        if pid is not None and liveness.command_alive(rundirs.load_ref(self.run_dir)) is not False:
            return pid
        return self.pane_pid if pid is None else None

    def left(self) -> list[runprocs.RunProcess]:
        """Every live process of the run (the group's and the marked ones), by pid."""
        found = {p.pid: p for p in liveness.live_processes(rundirs.load_ref(self.run_dir))}
        if self.pane_pid is not None and liveness.read_pid(self.run_dir) is None:
            for p in runprocs.group_members(self.pane_pid):
                found.setdefault(p.pid, p)
        return sorted(found.values(), key=lambda p: p.pid)

    def send(self, sig: int) -> list[int]:
        """`sig` to the group and to each marked process outside it; returns the pids signalled one by one."""
        pgid = self.pgid()
        if pgid is not None:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        singles = []
        for p in runprocs.run_processes(self.run_dir):
            if p.pgid == pgid:
                continue
            try:
                os.kill(p.pid, sig)
                singles.append(p.pid)
            except (ProcessLookupError, PermissionError):
                pass
        return singles

    def wrapper_alive(self) -> bool:
        """Whether the pane's wrapper may still write exit.json."""
        return self.pane_pid is not None and liveness.pid_alive(self.pane_pid)


def _record_stop(run_dir, requested_by: dict | None) -> None:
    """stop.json: who asked, through which verb, and when (the wrapper copies it into exit.json)."""
    who = requested_by or {}
    atomic.write_json(run_dir / rundirs.STOP_NAME, {"by": str(who.get("by") or "unknown"),
                                                    "via": str(who.get("via") or "dflashctl stop"), "at": rundirs.utc_now()})


def _wait(until, seconds: float) -> bool:
    """Poll `until()` for up to `seconds`; returns its last answer."""
    deadline = time.monotonic() + seconds
    while not until():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def stop_run(workdir: str, run_id: str, grace_s: float, emit, requested_by: dict | None = None) -> dict:
    """Stop one run; see the module docstring. Returns the result dict (without GPU waiting).

    Args:
        grace_s: seconds after SIGINT, and again after SIGTERM, before the next signal.
        requested_by: {by: user@host, via: the verb}, recorded in stop.json before the first signal.
    Returns:
        {run_id, signals (exactly those sent, in order; none and not already_ended: no process was left and
        nothing will write exit.json, the run is marked stopped), already_ended, exit, state, session}.
    Raises:
        AgentFailure("RunNotFound"): no such run directory.
        AgentFailure("StopFailed"): processes of the run still live after SIGKILL (named with pid, command
            line and state).
    """
    rundirs.check_run_id(run_id)
    run_dir = rundirs.runs_root(workdir) / run_id
    if not run_dir.is_dir():
        raise AgentFailure("RunNotFound", f"no run {run_id} in {rundirs.runs_root(workdir)}", fix="dflashctl status")
    session = next((s for s in tmuxctl.list_sessions() if s.get("run_id") == run_id), None)
    run = _Run(run_dir, session)
    signals_sent: list[str] = []
    ended = (run_dir / "exit.json").exists()
    left = run.left()
    already = ended and not left
    gone = not ended and not left and not run.wrapper_alive()
    if not already:
        _record_stop(run_dir, requested_by)
    if gone:
        emit.progress("stop", f"run {run_id}: the run's processes are gone (container restarted?); marked stopped")
    elif not already:
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, grace_s), (signal.SIGKILL, _AFTER_KILL_S)):
            left = run.left()
            if not left:
                break
            name = signal.Signals(sig).name
            pgid = run.pgid()
            where = f"process group {pgid}" if pgid is not None else "its processes"
            emit.progress("stop", f"sending {name} to run {run_id} ({where}; {len(left)} process(es) left)",
                          signal=name)
            singles = run.send(sig)
            if singles:
                emit.progress("stop", f"also sent {name} to pid(s) {', '.join(map(str, singles))}, which left "
                              "the run's process group", signal=name)
            signals_sent.append(name)
            # Each wait polls again: a process that forks after the signal is sent is signalled at the next step.
            _wait(lambda: not run.left(), wait_s)
        left = run.left()
        if left:
            raise AgentFailure(
                "StopFailed",
                f"run {run_id}: {len(left)} process(es) still alive after {', '.join(signals_sent)}: "
                f"{runprocs.describe_all(left)} (state D: uninterruptible I/O or a hung GPU; T: stopped or frozen)",
                fix="check `nvidia-smi` and `ps -o pid,pgid,stat,cmd -p "
                    + ",".join(str(p.pid) for p in left) + "` in the target",
                data={"pids": [p.pid for p in left], "signals": signals_sent},
            )
        # Nothing of the command is left; give the wrapper a moment to write exit.json (it waits for tee first).
        _wait(lambda: (run_dir / "exit.json").exists() or not run.wrapper_alive(), _AFTER_KILL_S)
    if session is not None:
        # The pane is dead now (remain-on-exit kept it); free the name for the next launch.
        tmuxctl.kill_session(session["name"])
    ref = rundirs.load_ref(run_dir)
    exit_info = rundirs.read_exit(ref)
    return {
        "run_id": run_id,
        "signals": signals_sent,
        "already_ended": bool(already),
        "exit": exit_info,
        # nothing of the run is left by now
        "state": liveness.state_of(exit_info, False, liveness.stopped_by(ref, exit_info)),
        "session": session["name"] if session else None,
    }
