"""Whether a run still runs, and the state that makes it. Standard library only.

States: running (no exit.json, and its session lives with a live pane, a process carrying its environment
marker lives (orchestrator.agent.runprocs), or its command's process group from `pid` still exists), stopped (ended after `dflashctl stop` or `launch --replace` asked it to: exit.json's
"stopped", copied from the run's stop.json, says by whom and when; whatever its exit code), succeeded (exit
0), failed (exit != 0), crashed (no exit.json, its session gone or its pane dead, and no process of its
command left: killed, container stopped).

This module is the one place that checks liveness (of a pid, a process group, a run's session and processes)
and decides a run's state; status, stop, launch, resume, the GPU claims and tail use it. The run directories
it reads are orchestrator.agent.rundirs's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from orchestrator.agent import runprocs
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.rundirs import STOP_NAME, RunRef, last_metrics, parse_time, read_exit, read_json, run_refs


def pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether process `pid` exists (and, given `since`, started no later than that epoch time).

    `since` guards against pid reuse: a pid file outlives its process (a container restart, a reboot), and
    a new process that got the same number started after the file was written. Where /proc cannot tell the
    start time, existence alone decides.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if since is None:
        return True
    started = process_start(pid)
    # Start times from /proc are whole seconds of boot time plus clock ticks: allow 2 s of rounding.
    return started is None or started <= since + 2.0


def process_start(pid: int) -> float | None:
    """Epoch start time of a process from /proc (Linux), or None when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, counted after the comm field
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` still exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_pid(run_dir: Path) -> int | None:
    """The command's process group id from `<run>/pid` (written by start_training.sh), or None."""
    try:
        text = (run_dir / "pid").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def command_alive(ref: RunRef) -> bool | None:
    """Whether the command of `<run>/pid` still runs (its leader, or any process of its group); None when
    there is no pid file yet."""
    pid = read_pid(ref.path)
    if pid is None:
        return None
    try:
        since = (ref.path / "pid").stat().st_mtime
    except OSError:
        since = None
    if pid_alive(pid):
        return pid_alive(pid, since)  # the leader exists: is it still ours, or a reused number?
    # The leader is gone but workers of its group may live on; the kernel does not hand out a number that
    # is still some group's id, so such a group is this run's.
    return group_alive(pid)


def live_processes(ref: RunRef) -> list[runprocs.RunProcess]:
    """Every live process of the run, exit.json or not: the ones carrying its environment marker
    (orchestrator.agent.runprocs) and the members of its command's process group (the pid file, unless its
    leader is a reused pid), by pid."""
    found = {p.pid: p for p in runprocs.run_processes(ref.path)}
    pid = read_pid(ref.path)
    if pid is not None and command_alive(ref):
        for p in runprocs.group_members(pid):
            found.setdefault(p.pid, p)
    return sorted(found.values(), key=lambda p: p.pid)


def check_no_processes(ref: RunRef, doing: str, fix: str) -> None:
    """Refuse `doing` while any process of the run lives, naming them.

    Raises:
        AgentFailure("RunProcessesAlive"): naming each process (pid, command line) and the way out.
    """
    left = live_processes(ref)
    if left:
        raise AgentFailure(
            "RunProcessesAlive",
            f"{doing}: run {ref.run_id} still has {len(left)} live process(es): {runprocs.describe_all(left)}",
            fix=fix, data={"run_id": ref.run_id, "pids": [p.pid for p in left]},
        )


def run_session(ref: RunRef, sessions: list[dict]) -> dict | None:
    """The tmux session running THIS run: the one tagged with its run id (`@dflash_run`), else an untagged
    one (started by hand) of the run's session name; a live pane wins over a dead one. None if there is none.

    Launch tags each session with the run id and keeps dead panes (remain-on-exit), so a session of the
    same name that runs a later run does not count as this one.
    """
    found = [s for s in sessions
             if s.get("run_id") == ref.run_id or (s.get("run_id") is None and ref.session and s.get("name") == ref.session)]
    return next((s for s in found if not s.get("dead")), found[0] if found else None)


def session_alive(ref: RunRef, sessions: list[dict] | None = None) -> bool | None:
    """Whether THIS run's tmux session lives with a live pane (see run_session); None when tmux cannot tell.

    Args:
        sessions: tmuxctl.list_sessions() when the caller has it already; else it is listed here.
    """
    if sessions is None:
        from orchestrator.agent import tmuxctl

        try:
            sessions = tmuxctl.list_sessions()
        except AgentFailure:
            return None  # no tmux here: the pid file may still tell
    s = run_session(ref, sessions)
    return s is not None and not s.get("dead")


def run_alive(ref: RunRef, sessions: list[dict] | None = None) -> bool | None:
    """Whether the run still runs: its tmux session has a live pane, a process carrying its marker lives,
    or its command's process group (the pid file) still exists. Either is enough: a wrongly declared crash is worse than a late one (a follower
    would stop, a status would say crashed while the trainer still holds its GPUs). None when neither can
    tell."""
    alive = session_alive(ref, sessions)
    if alive:
        return True
    if runprocs.run_processes(ref.path):
        return True  # a process of the run that left its group (or outlived its launcher) still runs
    pid = command_alive(ref)
    if pid:
        return True
    return alive if alive is not None else pid


def stopped_by(ref: RunRef, exit_info: dict | None) -> dict | None:
    """Who stopped the run, how and when ({by, via, at}), or None.

    An ended run: exit.json's "stopped" (its wrapper copied stop.json; a stop.json written after exit.json
    came too late to stop anything). A run without exit.json: its stop.json (the stop may still be under
    way, or the wrapper died with the command).
    """
    if exit_info is not None:
        stopped = exit_info.get("stopped")
        return stopped if isinstance(stopped, dict) else None
    return read_json(ref.path / STOP_NAME)


def state_of(exit_info: dict | None, alive: bool | None, stopped: dict | None = None) -> str:
    """running | stopped | succeeded | failed | crashed.

    Args:
        exit_info: exit.json, or None.
        alive: run_alive(); None (nothing could tell) counts as running: only a run known gone has crashed.
        stopped: stopped_by(): an ended run that a stop asked to end is "stopped", whatever its exit code.
    """
    if stopped is not None and (exit_info is not None or alive is False):
        return "stopped"
    if exit_info is not None:
        return "succeeded" if exit_info.get("exit_code") == 0 else "failed"
    return "crashed" if alive is False else "running"


def summarize(ref: RunRef, sessions: list[dict], now: float | None = None) -> dict:
    """Everything status shows about one run.

    Args:
        sessions: tmuxctl.list_sessions() (the state needs them).
    """
    info = ref.info
    exit_info = read_exit(ref)
    stopped = stopped_by(ref, exit_info)
    state = state_of(exit_info, None if exit_info is not None else run_alive(ref, sessions), stopped)
    started = parse_time((exit_info or {}).get("started")) or parse_time(info.get("created"))
    ended = parse_time((exit_info or {}).get("ended"))
    if ended is None and state == "running":
        ended = now if now is not None else time.time()
    metrics = last_metrics(ref.metrics)
    return {
        "run_id": ref.run_id,
        "experiment": info.get("experiment"),
        "tag": info.get("tag"),
        "state": state,
        "created": info.get("created"),
        "session": info.get("session"),
        "exit_code": (exit_info or {}).get("exit_code"),
        "signal": (exit_info or {}).get("signal"),
        "stopped": stopped if state == "stopped" else None,
        "duration_s": round(ended - started, 1) if (started is not None and ended is not None) else None,
        "tokens_per_s": (metrics or {}).get("tokens_per_s"),
        "step": (metrics or {}).get("step"),
    }


def list_runs(workdir: str | Path, sessions: list[dict]) -> list[dict]:
    """summarize() of every run directory, oldest first (created_key)."""
    return [summarize(ref, sessions) for ref in run_refs(workdir)]
