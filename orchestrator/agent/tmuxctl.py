"""tmux inside the target, through the tmux CLI: the sessions runs live in.

A run's session is `dflash-<experiment>` (orchestrator.names.session_name) on the target's default tmux server (the one `tmux attach -t
dflash-<experiment>` reaches by hand; in a container /tmp, and so the server, is the container's own).
Each session carries the user option `@dflash_run` = the run id, so a run's state is read from the session
that really runs it, never from a later run of the same experiment.

Why the CLI and not libtmux: the agent runs under a container's bare python3 before any venv exists (status
and stop of any run, every call on a `kind: system` target), where libtmux cannot be imported, so a CLI path
has to exist; with libtmux beside it there were two. What the agent asks of tmux is two things libtmux's
objects do in several tmux processes each: a race-free start (new-session ; set-option ; set-option ;
respawn-pane, one command list that tmux runs as one) and every session's first pane with its run id in one
`list-panes -a -F`. For both it offered only `Server.cmd`, a subprocess with the same arguments, and it cost
every agent call its import (tens of milliseconds, on the launch path).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from orchestrator import names
from orchestrator.agent.protocol import AgentFailure

SESSION_PREFIX = names.SESSION_PREFIX
RUN_OPTION = "@dflash_run"
# One `list-panes -a` answers for every session at once (one tmux round trip for status).
_FIELDS = ("session_name", "pane_pid", "pane_dead", "pane_dead_status", "session_created", RUN_OPTION)
_FORMAT = "\t".join("#{" + f + "}" for f in _FIELDS)
# What tmux says when no server runs yet: not an error, just no sessions.
_NO_SERVER = ("no server running", "error connecting to", "no such file or directory",
              "server exited unexpectedly")  # (the last: the server was exiting as we connected)


def session_name(experiment: str) -> str:
    """The tmux session of an experiment's runs: names.session_name (`dflash-<experiment>`, `.` as `_`).

    Raises:
        AgentFailure("BadName"): not a valid experiment name.
    """
    try:
        return names.session_name(experiment)
    except names.BadName as exc:
        raise AgentFailure("BadName", exc.message, fix=exc.fix) from None


class TmuxResult:
    """One tmux command's outcome: its exit status and its output as lines."""

    def __init__(self, proc: subprocess.CompletedProcess):
        self.returncode = proc.returncode
        self.stdout = proc.stdout.decode("utf-8", "replace").splitlines()
        self.stderr = proc.stderr.decode("utf-8", "replace").splitlines()


def tmux_missing() -> AgentFailure:
    """The one error of a target without tmux; the workstation replaces the fix with the line that installs it
    there, wrapped in ssh and pct (orchestrator.ops.refusal)."""
    return AgentFailure("TmuxMissing", "tmux is not installed in the target (no tmux on PATH "
                        f"{os.environ.get('PATH', '')}); every run lives in a tmux session",
                        fix="dflashctl rebuild-venv  (installs tmux)")


def _cmd(*args: str) -> TmuxResult:
    """`tmux ARGS` on the default server (no stdin; 30 s at most).

    Raises:
        AgentFailure("TmuxMissing"): no tmux on PATH, or it cannot be run.
        AgentFailure("TmuxFailed"): tmux did not answer in 30 s (a server that hangs, not a missing tmux).
    """
    exe = shutil.which("tmux")
    if exe is None:
        raise tmux_missing()
    try:
        return TmuxResult(subprocess.run([exe, *args], stdin=subprocess.DEVNULL, capture_output=True, timeout=30))
    except subprocess.TimeoutExpired:
        raise AgentFailure("TmuxFailed", f"tmux {args[0]} did not answer in 30 s (its server is hung)") from None
    except OSError as exc:
        raise AgentFailure("TmuxMissing", f"tmux {args[0]} failed: {exc}", fix="dflashctl rebuild-venv  (installs tmux)") from None


def parse_panes(lines: list[str]) -> list[dict]:
    """Parse `list-panes -a -F _FORMAT` output into one dict per session (its first pane).

    Returns:
        [{name, pane_pid, dead, dead_status, created, run_id}], in tmux's order.
    """
    out: dict[str, dict] = {}
    for line in lines:
        parts = line.split("\t")
        if len(parts) != len(_FIELDS):
            continue
        name, pid, dead, status, created, run_id = parts
        if name in out:
            continue
        out[name] = {
            "name": name,
            "pane_pid": int(pid) if pid.isdigit() else None,
            "dead": dead == "1",
            "dead_status": int(status) if status.lstrip("-").isdigit() else None,
            "created": int(created) if created.isdigit() else None,
            "run_id": run_id or None,
        }
    return list(out.values())


def list_sessions() -> list[dict]:
    """Every session on the target's tmux server (see parse_panes); [] when no server runs."""
    res = _cmd("list-panes", "-a", "-F", _FORMAT)
    if res.returncode != 0:
        text = " ".join(res.stderr).lower()
        if any(s in text for s in _NO_SERVER):
            return []
        raise AgentFailure("TmuxFailed", f"tmux list-panes failed: {' '.join(res.stderr)[:300]}")
    return parse_panes(res.stdout)


def find_session(name: str) -> dict | None:
    """The session called exactly `name`, or None."""
    return _named(list_sessions(), name)


def _named(sessions: list[dict], name: str) -> dict | None:
    return next((s for s in sessions if s["name"] == name), None)


def new_session(name: str, command: str, cwd: str, run_id: str) -> dict:
    """Start a detached session running `command` (one shell command line, already rendered).

    The session starts with a placeholder that cannot end by itself; remain-on-exit and the run id are set;
    only then does respawn-pane swap in the real command (one tmux command list). Setting the option after
    starting the command would race a command that ends at once: the session would vanish, status lost.
    The list ends with display-message of the pane as list_sessions reads it (the respawned pane's pid): one
    tmux process for the whole start. (Its target is the plain name, as set-option's: tmux prefers the
    session of exactly that name, which new-session has just made; tmux 3.3 prints nothing for `=NAME` here.)

    Raises:
        AgentFailure("TmuxFailed"): tmux refused (e.g. the name exists: a race lost to another launch).
    """
    res = _cmd(
        "new-session", "-d", "-s", name, "-x", "220", "-y", "50", "-c", cwd, "exec sleep 2147483647",
        ";", "set-option", "-t", name, "remain-on-exit", "on",
        ";", "set-option", "-t", name, RUN_OPTION, run_id,
        ";", "respawn-pane", "-k", "-t", name, "-c", cwd, command,
        ";", "display-message", "-p", "-t", name, _FORMAT,
    )
    if res.returncode != 0:
        raise AgentFailure("TmuxFailed", f"tmux new-session {name} failed: {' '.join(res.stderr)[:300]}")
    found = _named(parse_panes(res.stdout), name)
    if found is None:
        raise AgentFailure("TmuxFailed", f"tmux session {name} vanished right after it was created")
    return found


def kill_session(name: str) -> bool:
    """Kill the session `name` (its pane gets SIGHUP). Returns whether one was there."""
    res = _cmd("kill-session", "-t", "=" + name)
    return res.returncode == 0
