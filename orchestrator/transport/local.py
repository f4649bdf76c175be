"""Run commands on this machine: a subprocess, no shell, stdout and stderr drained on their own threads."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

from orchestrator.errors import ConnectError
from orchestrator.transport.base import CommandTimeout, Result, Started, StreamCallback
from orchestrator.quoting import check_argv

_CHUNK = 65536
_TAIL = 16384


def _drain(stream, sink: list[bytes], callback: StreamCallback | None, tail: bytearray) -> None:
    """Read a pipe to EOF; hand chunks to callback or keep them; always keep a bounded tail."""
    try:
        while True:
            chunk = stream.read1(_CHUNK) if hasattr(stream, "read1") else stream.read(_CHUNK)
            if not chunk:
                break
            if callback is not None:
                callback(chunk)
            else:
                sink.append(chunk)
            tail.extend(chunk)
            if len(tail) > _TAIL:
                del tail[: len(tail) - _TAIL]
    finally:
        stream.close()


class LocalTransport:
    """Subprocess runner. The child gets its own process group so a timeout kills all of it."""

    name = "local"

    def __init__(self, env: dict[str, str] | None = None, cwd: str | None = None):
        self.env = env
        self.cwd = cwd

    def command_line(self, argv: Sequence[str]) -> str:
        """`argv` as a command line the user can paste here (no hop: quoted once)."""
        from orchestrator.quoting import render

        return render(argv)

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        on_stdout: StreamCallback | None = None,
        on_stderr: StreamCallback | None = None,
    ) -> Result:
        """Run argv here (Transport.run): finish(start(argv)). A program that is not there is exit code 127."""
        return self.finish(self.start(argv), stdin=stdin, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr)

    def start(self, argv: Sequence[str]) -> Started:
        """Start argv in its own process group, its stdin an open pipe (Transport.start).

        Raises:
            ConnectError: the process could not be started (permissions and the like).
        """
        argv = list(argv)
        # A NUL byte is refused by name, as the remote transports refuse it (paths and bytes are fine here).
        check_argv([a if isinstance(a, str) else os.fsdecode(a) for a in argv])
        at = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=self.env, cwd=self.cwd, start_new_session=True)
        except FileNotFoundError as exc:
            proc = Result(argv, 127, b"", f"{argv[0]}: command not found ({exc})\n".encode(), self.name)
        except OSError as exc:  # pragma: no cover - permissions and the like
            raise ConnectError(f"cannot start {argv[0]!r} locally: {exc}") from exc
        return Started(argv, proc, at, self.name)

    def finish(
        self,
        started: Started,
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        on_stdout: StreamCallback | None = None,
        on_stderr: StreamCallback | None = None,
    ) -> Result:
        """Feed the started process its stdin (then closed), stream its output, wait for it (Transport.finish).

        Raises:
            CommandTimeout: it outlived `timeout` and was killed with its process group.
        """
        proc, argv = started.handle, started.argv
        if isinstance(proc, Result):  # the program was not found: nothing ran
            return proc
        out: list[bytes] = []
        err: list[bytes] = []
        out_tail, err_tail = bytearray(), bytearray()
        readers = [
            threading.Thread(target=_drain, args=(proc.stdout, out, on_stdout, out_tail), daemon=True),
            threading.Thread(target=_drain, args=(proc.stderr, err, on_stderr, err_tail), daemon=True),
        ]
        for t in readers:
            t.start()
        threading.Thread(target=self._feed, args=(proc, stdin or b""), daemon=True).start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            for t in readers:
                t.join(5)
            res = Result(argv, -9, b"".join(out), b"".join(err), self.name, time.monotonic() - started.at,
                         bytes(err_tail))
            raise CommandTimeout(f"command timed out after {timeout:.0f} s on {self.name}", result=res) from None
        except KeyboardInterrupt:
            self._kill(proc)
            raise
        for t in readers:
            t.join(30)
        if code < 0:  # killed by a signal: report like a shell does
            code = 128 - code
        return Result(argv, code, b"".join(out), b"".join(err), self.name, time.monotonic() - started.at,
                      bytes(err_tail))

    def discard(self, started: Started) -> None:
        """Close the started process's stdin (it reads end-of-file) and reap it in the background."""
        proc = started.handle
        if isinstance(proc, Result):
            return
        self._feed(proc, b"")
        threading.Thread(target=self._reap, args=(proc,), daemon=True).start()

    @staticmethod
    def _reap(proc: subprocess.Popen) -> None:
        for pipe in (proc.stdout, proc.stderr):
            try:
                pipe.read()
                pipe.close()
            except (OSError, ValueError):
                pass
        proc.wait()

    @staticmethod
    def _feed(proc: subprocess.Popen, data: bytes) -> None:
        try:
            if data:
                proc.stdin.write(data)
        except (BrokenPipeError, OSError):
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def close(self) -> None:
        pass
