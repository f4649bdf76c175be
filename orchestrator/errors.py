"""The error hierarchy. Every error a user can see is a `DflashError`: a one-line message and, where
there is one, the fix. The CLI's single handler prints them; tracebacks only with `--verbose`.

Exit codes (README): 1 for any DflashError unless the subclass says otherwise.
"""

from __future__ import annotations

import re
import shlex

# A `dflashctl VERB` command inside a fix: not a path's tail (`/bin/dflashctl`) nor `dflashctl's`.
_COMMAND = re.compile(r"(?<![\w/.-])dflashctl (?=[a-z])")


class DflashError(Exception):
    """Base of every error meant for the user.

    Args:
        message: what went wrong, where (one line).
        fix: the command or edit that fixes it, or None.
    """

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"

    def to_dict(self) -> dict:
        return {"type": type(self).__name__, "kind": self.kind, "message": self.message, "fix": self.fix}


class UserError(DflashError):
    """The user asked for something invalid (bad name, bad flag, unknown run)."""

    kind = "user"


class InventoryError(UserError):
    """inventory.yaml is missing or wrong; the message names file:line and the key."""


class ConnectError(DflashError):
    """The host cannot be reached or refuses us (network, auth, timeouts)."""

    kind = "connect"


class HostKeyError(ConnectError):
    """The host key is unknown (trust it explicitly) or changed (refused, always)."""


class RemoteCommandError(DflashError):
    """A command on the target failed. Carries the Result so the message can show the tail."""

    kind = "remote"

    def __init__(self, message: str, result=None, fix: str | None = None):
        super().__init__(message, fix)
        self.result = result

    def __str__(self) -> str:
        text = super().__str__()
        if self.result is not None:
            text += "\n" + self.result.describe()
        return text


class PctError(RemoteCommandError):
    """`pct` itself failed (its Perl `die`s); classified from stderr text, never the exit code."""


class ContainerStopped(PctError):
    """`container 'N' not running!`"""


class ContainerMissing(PctError):
    """`Configuration file 'nodes/<node>/lxc/N.conf' does not exist`"""


class PctNotFound(PctError):
    """The host has no `pct`: not a Proxmox VE host, or PATH lacks /usr/sbin."""


class SudoRequired(PctError):
    """A non-root user without passwordless sudo for pct."""


class AgentError(RemoteCommandError):
    """The in-container agent reported an error event (its `type` says which)."""

    def __init__(self, message: str, agent_type: str = "AgentError", fix: str | None = None, result=None):
        super().__init__(message, result=result, fix=fix)
        self.agent_type = agent_type
        self.data: dict = {}

    def with_data(self, data: dict) -> "AgentError":
        """Attach the structured detail of the agent's error event (e.g. busy GPUs) and return self."""
        self.data = data
        return self


class PreflightError(UserError):
    """launch refused: the message names exactly what is wrong (GPU, session, packages)."""


class RunNotFound(UserError):
    """No such run."""

    exit_code = 4


def with_inventory(fix: str, inventory: str | None) -> str:
    """`fix` with every `dflashctl VERB` command in it given `-i INVENTORY`, so that a fix pasted as printed
    reads the inventory the failed command read (pure; unchanged without --inventory).

    >>> with_inventory("dflashctl status --target ct  (or: dflashctl runs)", "my inv.yaml")
    "dflashctl -i 'my inv.yaml' status --target ct  (or: dflashctl -i 'my inv.yaml' runs)"
    """
    if not inventory:
        return fix
    return _COMMAND.sub(lambda m: f"dflashctl -i {shlex.quote(inventory)} ", fix)
