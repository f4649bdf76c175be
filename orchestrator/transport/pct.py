"""The pct layer: run argv inside an LXC container as `pct exec CTID --keep-env 0 -- argv` on its host.

It only wraps: the parent transport (SSH to the Proxmox host, or local on the host itself) runs the
wrapped argv once, rendered by the one quoting function. lxc-attach execs argv WITHOUT a shell, so the
host's login shell is the only parser on the path (docs/remote-stack.md §1.1).

pct's own failures are Perl `die`s with unreliable exit codes (255, or errno), so they are classified
from stderr TEXT, never the exit code. A command's own non-zero exit is a normal Result.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence

from orchestrator.errors import ContainerMissing, ContainerStopped, PctError, PctNotFound, SudoRequired, UserError
from orchestrator.transport.base import Result, Started, StreamCallback, Transport

# Exact texts from pve-container (pct.pm, AbstractConfig.pm) and the host shells / sudo.
STOPPED_RE = re.compile(r"(?m)^container '(\d+)' not running!\s*$")
MISSING_RE = re.compile(r"(?m)^Configuration file '(nodes/[^']*/lxc/(\d+)\.conf)' does not exist\s*$")
SUDO_PASSWORD_RE = re.compile(r"(?m)^sudo: (?:a password is required|a terminal is required|sorry, you must have a tty)")
SUDO_DENIED_RE = re.compile(r"(?m)(?:is not in the sudoers file|is not allowed to execute)")
SUDO_MISSING_RE = re.compile(r"(?m)(?:^|: )sudo: (?:command )?not found\s*$")



def pct_not_found_re(pct: str = "pct") -> re.Pattern:
    """The shell's (or sudo's) complaint that `pct` does not exist.

    bash: `bash: line 1: pct: command not found`; dash: `sh: 1: pct: not found`; a full path:
    `bash: line 1: /usr/sbin/pct: No such file or directory` (all exit 127); sudo: `sudo: pct: command not found`.
    """
    name = re.escape(pct)
    return re.compile(rf"(?m)(?:^|: ){name}: (?:command not found|not found|No such file or directory)\s*$")


VMID_MIN, VMID_MAX = 100, 999_999_999


def check_ctid(ctid) -> int:
    """A Proxmox VMID as an int.

    Raises:
        UserError: not an integer in 100..999999999.
    """
    try:
        value = int(str(ctid), 10)
    except ValueError:
        value = -1
    if not VMID_MIN <= value <= VMID_MAX or isinstance(ctid, bool):
        raise UserError(f"bad container id {ctid!r}: a Proxmox VMID is an integer from {VMID_MIN} to {VMID_MAX}",
                        fix="set the target's ctid in inventory.yaml to the number `pct list` shows")
    return value


def pct_prefix(pct: str = "pct", sudo: bool = False) -> list[str]:
    """`[sudo -n] pct`: how pct is run on the host."""
    return ["sudo", "-n", pct] if sudo else [pct]


def pct_exec_argv(ctid: int, argv: Sequence[str], pct: str = "pct", sudo: bool = False) -> list[str]:
    """`[sudo -n] pct exec CTID --keep-env 0 -- argv...`.

    `--keep-env 0` because pct's default (1) leaks the SSH session's environment into the container;
    `--` because pct parses options with Getopt and would take a `-la` in argv as its own.

    Raises:
        ValueError: argv is empty (pct would die with `missing command`).
        UserError: ctid is not a VMID.
    """
    argv = list(argv)
    if not argv:
        raise ValueError("pct exec needs a command (argv is empty)")
    return [*pct_prefix(pct, sudo), "exec", str(check_ctid(ctid)), "--keep-env", "0", "--", *argv]


def pct_argv(ctid: int, verb: str, *args: str, pct: str = "pct", sudo: bool = False) -> list[str]:
    """`[sudo -n] pct VERB CTID args...` for status/start/stop/config/set (and push/pull).

    Raises:
        ValueError: an unsupported verb (exec has its own builder).
    """
    if verb not in ("status", "start", "stop", "shutdown", "config", "set", "push", "pull"):
        raise ValueError(f"unsupported pct verb {verb!r} (use pct_exec_argv for exec)")
    return [*pct_prefix(pct, sudo), verb, str(check_ctid(ctid)), *args]


def classify(res: Result, ctid: int, host: str, pct: str = "pct", sudo: bool = False,
             command_line: Callable[[Sequence[str]], str] = shlex.join) -> PctError | None:
    """The typed error for a failed pct call, from its stderr text; None when pct itself did not fail.

    Args:
        res: the Result of a pct command run on the host.
        ctid: the container the call was about (the stopped/missing texts must name it).
        host: the host's name, for messages.
        command_line: a host argv as the user pastes it (the parent transport's command_line: `ssh ...`);
            every fix printed is built with it.
    """
    if res.exit_code == 0:
        return None
    text = (res.stderr or res.stderr_tail).decode("utf-8", errors="replace")
    m = STOPPED_RE.search(text)
    if m and int(m.group(1)) == ctid:
        return ContainerStopped(
            f"container {ctid} on {host} is not running",
            result=res,
            fix=f"start it: {command_line(pct_argv(ctid, 'start', pct=pct, sudo=sudo))}",
        )
    m = MISSING_RE.search(text)
    if m and int(m.group(2)) == ctid:
        return ContainerMissing(
            f"container {ctid} does not exist on {host} ({m.group(1)} is missing)",
            result=res,
            fix=f"check the target's ctid in inventory.yaml against `{command_line([*pct_prefix(pct, sudo), 'list'])}`, "
            f"or the host: a container lives on one node of a cluster",
        )
    if sudo and SUDO_PASSWORD_RE.search(text):
        return SudoRequired(
            f"sudo on {host} wants a password to run {pct}",
            result=res,
            fix="allow it without one (visudo: `USER ALL=(root) NOPASSWD: /usr/sbin/pct`), or connect as root",
        )
    if sudo and SUDO_MISSING_RE.search(text):
        return SudoRequired(
            f"the host {host} has no sudo, which the inventory asks for (sudo: true)",
            result=res,
            fix="install sudo on the host (apt-get install sudo) with a NOPASSWD rule for pct, or connect as root "
            "and set sudo: false",
        )
    if sudo and SUDO_DENIED_RE.search(text):
        return SudoRequired(
            f"the SSH user on {host} may not run {pct} with sudo",
            result=res,
            fix="add a sudoers rule `USER ALL=(root) NOPASSWD: /usr/sbin/pct`, or connect as root",
        )
    if (res.exit_code == 127 or sudo) and pct_not_found_re(pct).search(text):
        return PctNotFound(
            f"`{pct}` was not found on {host}: it is not a Proxmox VE host, or pct is not on the login PATH",
            result=res,
            fix="point the target at the Proxmox node, or set the host's `pct:` in inventory.yaml to /usr/sbin/pct",
        )
    return None


class PctTransport:
    """Runs argv inside container `ctid` through its parent (the host's transport).

    Args:
        parent: the transport that reaches the Proxmox host (SSHTransport, or LocalTransport on the host).
        ctid: the container's VMID.
        pct: the pct program on the host ("pct", or a full path).
        sudo: prefix pct with `sudo -n` (a non-root SSH user with a NOPASSWD sudoers rule).
    """

    def __init__(self, parent: Transport, ctid: int, *, pct: str = "pct", sudo: bool = False):
        self.parent = parent
        self.ctid = check_ctid(ctid)
        self.pct = pct
        self.sudo = sudo
        self.host = getattr(parent, "label", None) or getattr(parent, "name", "host")
        self.name = f"{getattr(parent, 'name', 'host')}/ct{self.ctid}"

    @property
    def calls(self) -> int:
        """Commands run by the parent (pct calls made through this object and its siblings)."""
        return getattr(self.parent, "calls", 0)

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        on_stdout: StreamCallback | None = None,
        on_stderr: StreamCallback | None = None,
    ) -> Result:
        """Run argv in the container: one `pct exec` on the host (finish(start(argv))).

        Returns:
            The command's Result (its own exit code, 0 or not; 128+signo when a signal killed it).
        Raises:
            ContainerStopped, ContainerMissing, PctNotFound, SudoRequired: pct could not run it.
            ConnectError, CommandTimeout: from the parent transport.
        """
        return self.finish(self.start(argv), stdin=stdin, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr)

    def start(self, argv: Sequence[str]) -> Started:
        """Start argv in the container (one `pct exec` on the host through the parent's start), its stdin still
        open: `finish` completes it. The Started names this container (`where`) and keeps `argv` as given.

        Raises:
            ConnectError: from the parent transport.
        """
        inner = self.parent.start(self.exec_argv(argv))
        return Started(list(argv), inner, inner.at, self.name)

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """The host argv that runs `argv` in this container (`[sudo -n] pct exec CTID --keep-env 0 -- argv`)."""
        return pct_exec_argv(self.ctid, argv, self.pct, self.sudo)

    def finish(
        self,
        started: Started,
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        on_stdout: StreamCallback | None = None,
        on_stderr: StreamCallback | None = None,
    ) -> Result:
        """Complete a started command (as run: its Result, or the typed PctError)."""
        return self._checked(self.parent.finish(started.handle, stdin=stdin, timeout=timeout, on_stdout=on_stdout,
                                                on_stderr=on_stderr))

    def _checked(self, res: Result) -> Result:
        """The Result of a `pct exec`, or the typed PctError when pct itself failed."""
        res.where = self.name
        err = classify(res, self.ctid, self.host, self.pct, self.sudo, self.host_command_line)
        if err is not None:
            raise err
        return res

    def discard(self, started: Started) -> None:
        """Drop a started command unfinished (it reads end-of-file on stdin)."""
        self.parent.discard(started.handle)

    def host_command_line(self, argv: Sequence[str]) -> str:
        """A host argv as the user pastes it: through the parent (`ssh ...`), or bare on the host itself."""
        return self.parent.command_line(argv)

    def command_line(self, argv: Sequence[str]) -> str:
        """`argv` inside the container as the user pastes it: `pct exec CT -- argv` on the host."""
        return self.host_command_line(pct_exec_argv(self.ctid, argv, self.pct, self.sudo))

    def interactive_argv(self, argv: Sequence[str]) -> list[str]:
        """The OpenSSH client argv (with a tty) that runs `argv` in the container for a person at a terminal:
        `ssh -t HOST 'pct exec CT --keep-env 0 -- argv'`, through the parent's settings (SSHTransport.openssh_argv:
        an unknown or changed host key refused, never asked about).

        Raises:
            UserError: the parent is not an SSH connection (a container reached from its own host).
        """
        openssh = getattr(self.parent, "openssh_argv", None)
        if openssh is None:
            raise UserError(f"no interactive ssh to container {self.ctid}: it is reached without ssh")
        return openssh(pct_exec_argv(self.ctid, argv, self.pct, self.sudo), tty=True, strict=True)

    def close(self) -> None:
        self.parent.close()
