"""The tmux installs that a printed fix suggests, as command lines that work when pasted on the workstation:
apt-get in the target (doctor, rebuild-venv's TmuxMissing warning), and, for a launch refused for want of tmux
on a container, `dflashctl rebuild-venv --target T`, which installs it either way (apt-get there, or Debian's
packages brought from the workstation when the container has no network)."""

from __future__ import annotations

from orchestrator.quoting import render

# Installs tmux on a Debian/Ubuntu target whose package lists may be empty (as the PVE templates ship).
TMUX_INSTALL = ["sh", "-c", "apt-get update && apt-get install -y tmux"]


def tmux_fix(target) -> str:
    """The command that installs tmux in a container, runnable as printed on the workstation."""
    line = getattr(target, "command_line", None)  # ContainerTarget: ssh ... pct exec CTID -- ...
    return line(TMUX_INSTALL) if line is not None else render(TMUX_INSTALL)


def launch_tmux_fix(target) -> str:
    """The fix of a launch (or warm-up) refused because the target has no tmux: on a container, the
    rebuild-venv that installs it whether or not the container reaches a Debian mirror; elsewhere apt-get."""
    if getattr(target, "command_line", None) is not None:
        return f"dflashctl rebuild-venv --target {target.name}"
    return tmux_fix(target)
