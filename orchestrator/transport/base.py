"""The transport protocol: run an argv somewhere, with stdin, streaming and a timeout, get a Result; or start it
now and finish it later (the request is not ready yet: the agent's early start).

`Transport` is the whole contract; every transport implements all of it, and `run` is `finish(start(argv))`
in each, so the early start is not a second path. Local and SSH are peers; the pct layer only wraps its
parent's argv (pct exec CTID -- argv) and lets the parent start, finish and discard it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.errors import RemoteCommandError

StreamCallback = Callable[[bytes], None]


@dataclass
class Result:
    """What one command did.

    `stdout` is empty when the caller streamed it through `on_stdout`; `stderr` likewise.
    """

    argv: list[str]
    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    where: str = "local"
    duration_s: float = 0.0
    stderr_tail: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    def describe(self, lines: int = 10) -> str:
        """The command, where it ran, its exit code and the last lines of stderr (or stdout)."""
        from orchestrator.quoting import render

        tail_src = self.stderr or self.stderr_tail or self.stdout
        tail = tail_src.decode("utf-8", errors="replace").splitlines()[-lines:]
        out = [f"  command ({self.where}): {render(self.argv)[:400]}", f"  exit code: {self.exit_code}"]
        if tail:
            out.append("  last lines:")
            out.extend("    " + line for line in tail)
        return "\n".join(out)

    def check(self, what: str = "command") -> "Result":
        """Return self if the command succeeded, else raise RemoteCommandError carrying self."""
        if self.exit_code != 0:
            raise RemoteCommandError(f"{what} failed with exit code {self.exit_code} on {self.where}", result=self)
        return self


@dataclass
class Started:
    """A command a transport's `start` began, its stdin still open; the same transport's `finish` completes it
    (feeds stdin, streams the output, returns the Result) and `discard` drops it unfinished."""

    argv: list[str]
    """The argv as given to the transport that started it."""
    handle: Any = field(repr=False)  # the transport's own: a process, an SSH channel, or the parent's Started
    at: float = 0.0  # time.monotonic() when it was started
    where: str = ""
    """The `name` of the transport that started it (a container's names its host and CTID)."""


class Transport(Protocol):
    """Where a command runs. Implementations: LocalTransport, SSHTransport, PctTransport (wraps a parent)."""

    name: str

    def start(self, argv: Sequence[str]) -> Started:
        """Start argv and return at once, its stdin still open (what it writes meanwhile waits in the pipe or
        the channel's window). `finish` completes it, `discard` drops it.

        Raises:
            ConnectError: the transport cannot reach the place.
        """
        ...

    def finish(
        self,
        started: Started,
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        on_stdout: StreamCallback | None = None,
        on_stderr: StreamCallback | None = None,
    ) -> Result:
        """Feed a started command its stdin, stream its output, wait for its exit (as `run`; the timeout
        counts from now)."""
        ...

    def discard(self, started: Started) -> None:
        """Drop a started command unfinished: its stdin reads end-of-file (the agent then runs nothing)."""
        ...

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        on_stdout: StreamCallback | None = None,
        on_stderr: StreamCallback | None = None,
    ) -> Result:
        """Run argv to completion: `finish(start(argv), ...)`.

        Args:
            argv: the command; never a shell string.
            stdin: bytes written to the command's stdin, which is then closed (None: closed at once).
            timeout: seconds for the whole command; on expiry the command is killed and
                `CommandTimeout` raised.
            on_stdout / on_stderr: when given, chunks are passed as they arrive and not kept in the Result.
        Raises:
            ConnectError: the transport cannot reach the place.
            CommandTimeout: the timeout expired.
        """
        ...

    def command_line(self, argv: Sequence[str]) -> str:
        """`argv`, run where this transport runs it, as a line the user can paste on the workstation (the
        form of every printed fix): `pct start 200` locally, `ssh -p 2222 root@pve1.lan pct start 200`
        over SSH, the pct exec inside that for a container."""
        ...

    def close(self) -> None: ...


class CommandTimeout(RemoteCommandError):
    """The command outlived its timeout and was killed."""
