"""The one tmux install that a printed fix suggests (doctor, rebuild-venv's TmuxMissing warning, a launch
refused for want of tmux), as a command line that works when pasted on the workstation."""

from __future__ import annotations

from orchestrator.quoting import render

# Installs tmux on a Debian/Ubuntu target whose package lists may be empty (as the PVE templates ship).
TMUX_INSTALL = ["sh", "-c", "apt-get update && apt-get install -y tmux"]


def tmux_fix(target) -> str:
    """The command that installs tmux in a container, runnable as printed on the workstation."""
    line = getattr(target, "command_line", None)  # ContainerTarget: ssh ... pct exec CTID -- ...
    return line(TMUX_INSTALL) if line is not None else render(TMUX_INSTALL)
