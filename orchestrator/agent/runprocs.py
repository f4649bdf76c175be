"""The processes of a run, found by the run's environment marker. Standard library only (Linux /proc).

Every process a run starts carries `DFLASHCTL_RUN_DIR=<the run directory>` in its environment: the agent
writes it into launch.env0, start_training.sh starts the command with exactly that environment, and a child
inherits its parent's. /proc/<pid>/environ shows the environment a process was started with, so the marker
finds every descendant of the command, also one that left the command's process group or session (a
`setsid` daemon, a job of a shell with job control) or whose parent died (reparented to PID 1). The wrapper
script and its tee are not marked: a stop leaves them to write exit.json.

Why a marker and not the alternatives:
- the process group or session id: a descendant may leave both (setsid, `set -m` in a script);
- a cgroup or systemd scope of the run's own: an unprivileged LXC container and the local target seldom
  have a writable, delegated cgroup tree or a systemd instance to ask, and the run must work on both;
- the marker is set once, where the run's environment is made, and reading it needs no privilege beyond
  being the same user (the agent runs as the run's user).
Its limit: a process started with a cleared environment (`env -i`, a daemon that scrubs it) is not seen;
the trainer does neither.

A zombie (exited, not yet reaped) is not a process of the run: it holds no memory, no file, no GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MARKER = "DFLASHCTL_RUN_DIR"
"""The environment variable whose value (the run directory) marks a process as the run's."""

_PROC = Path("/proc")
_ARGV_SHOWN = 200


@dataclass(frozen=True)
class RunProcess:
    """One live process of a run."""

    pid: int
    pgid: int
    state: str
    """/proc state letter: R, S, D (uninterruptible), T (stopped), ..."""
    argv: str
    """The command line, NUL bytes as spaces, cut at 200 characters."""

    def describe(self) -> str:
        """'pid 42 (python -m trainer.rank --config ...)', with ', state D' when it is not R or S."""
        state = "" if self.state in ("R", "S") else f", state {self.state}"
        return f"pid {self.pid} ({self.argv}{state})"


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group id) of a process, or None when it is gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    try:
        return fields[0], int(fields[2])
    except (IndexError, ValueError):
        return None


def _argv(pid: int) -> str:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    return (text[:_ARGV_SHOWN] + "...") if len(text) > _ARGV_SHOWN else (text or "?")


def describe_pid(pid: int) -> RunProcess | None:
    """The live (not zombie) process `pid` as a RunProcess, or None."""
    st = _stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return None
    return RunProcess(pid, st[1], st[0], _argv(pid))


def marked_processes(exclude: set[int] | None = None) -> dict[str, list[RunProcess]]:
    """Every live process carrying a run marker, by the marker's value (the run directory), in one pass over
    /proc (this process never counts).

    A process that ends while it is being read is skipped; one whose environ cannot be read (another user's)
    cannot be a run's (the agent runs as the runs' user).
    """
    prefix = f"{MARKER}=".encode()
    skip = {os.getpid(), *(exclude or ())}
    found: dict[str, list[RunProcess]] = {}
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return {}
    for name in entries:
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            env = (_PROC / name / "environ").read_bytes()
        except OSError:
            continue
        if prefix not in env:
            continue
        value = next((e[len(prefix):] for e in env.split(b"\0") if e.startswith(prefix)), None)
        proc = describe_pid(int(name)) if value else None
        if proc is not None:
            found.setdefault(value.decode("utf-8", "replace"), []).append(proc)
    return {k: sorted(v, key=lambda p: p.pid) for k, v in found.items()}


def of_run(marked: dict[str, list[RunProcess]], run_dir: str | Path) -> list[RunProcess]:
    """The processes of `run_dir` in a marked_processes() answer (the path as given or resolved)."""
    text = str(run_dir)
    keys = {text, os.path.realpath(text)}
    return sorted((p for k in keys for p in marked.get(k, [])), key=lambda p: p.pid)


def run_processes(run_dir: str | Path) -> list[RunProcess]:
    """Every live process whose environment marks it as `run_dir`'s, by pid."""
    return of_run(marked_processes(), run_dir)


def group_members(pgid: int) -> list[RunProcess]:
    """The live (not zombie) processes of process group `pgid`, by pid."""
    found = []
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is not None and st[1] == pgid and st[0] not in ("Z", "X"):
            proc = describe_pid(int(name))
            if proc is not None:
                found.append(proc)
    return sorted(found, key=lambda p: p.pid)


def describe_all(procs: list[RunProcess], most: int = 4) -> str:
    """'pid 42 (...), pid 43 (...)' and ' and N more' past `most`."""
    shown = ", ".join(p.describe() for p in procs[:most])
    return shown + (f" and {len(procs) - most} more" if len(procs) > most else "")
