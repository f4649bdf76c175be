"""Run commands on a host over SSH: ONE connection per host, one channel per command.

transport/sshconn.py resolves ~/.ssh/config (aliases, HostName/Port/User/IdentityFile, ProxyJump) with
paramiko's SSHConfig and opens the connection; everything after that is plain paramiko on its Transport:
- keepalive on; TCP_NODELAY and AES-GCM from the handshake on (sshconn.transport_over);
- no pty (a pty merges stdout and stderr, adds CRLF, and lxc-attach would allocate one too);
- stdout and stderr drained on their own threads while stdin is fed on a third (no window deadlock
  with large outputs), exit status read LAST, with a bounded wait;
- a connection found dead between commands is re-opened once.

Host keys: known_hosts is the truth on every hop (see hostkeys.py); an unknown key is refused, never added.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.errors import ConnectError, HostKeyError
from orchestrator.transport.base import CommandTimeout, Result, Started, StreamCallback
from orchestrator.transport.openssh import openssh_argv, paste_line
from orchestrator.transport.sshimport import import_ssh_stack
from orchestrator.quoting import render

_CHUNK = 32768
_TAIL = 16384
# What OpenSSH's client reports when the server sends no exit status (the remote process was killed by a
# signal; paramiko ignores `exit-signal` and reports -1).
NO_EXIT_STATUS = 255
# After both streams hit EOF the exit status is normally already there; wait at most this long for it.
EXIT_STATUS_GRACE_S = 30.0


# The inventory HostSpec fields a connection depends on (the others say how to run pct).
SETTINGS = ("ssh", "port", "user", "identity_file", "known_hosts")


@dataclass(frozen=True)
class SSHSettings:
    """A connection's settings, as the inventory gives them for a host: what an SSHTransport is made from.
    Two commands whose settings are equal may share one connection (orchestrator.preconnect).

    `ssh` is either an ~/.ssh/config alias or a plain hostname; handing it as both lets the SSH layer apply
    any matching ~/.ssh/config block (as `ssh NAME` would), with the explicit fields overriding it.
    """

    name: str
    """The host's name in the inventory (for messages such as `dflashctl trust NAME`)."""
    ssh: str
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None

    @classmethod
    def of(cls, name: str, host) -> "SSHSettings":
        """The settings of an inventory HostSpec (or anything with the SETTINGS as attributes)."""
        return cls(name, *(getattr(host, f) for f in SETTINGS))

    def transport(self) -> "SSHTransport":
        """An SSHTransport with these settings (not connected yet)."""
        return SSHTransport(
            self.ssh,
            port=self.port or 22,
            user=self.user,
            identity_file=os.path.expanduser(self.identity_file) if self.identity_file else None,
            known_hosts=os.path.expanduser(self.known_hosts) if self.known_hosts else None,
            ssh_config_alias=self.ssh,
            name=self.name,
        )


class SSHTransport:
    """Commands on one SSH host, one channel each, over one connection opened on first use.

    Args:
        hostname: host name or address (or an ~/.ssh/config alias when `ssh_config_alias` is None).
        port: sshd port.
        user: login user (None: ~/.ssh/config's User, else the local user).
        identity_file: private key to use; when given, only it is offered (like IdentitiesOnly=yes).
        known_hosts: known_hosts file to trust (None: ~/.ssh/known_hosts).
        ssh_config_alias: a Host entry of ~/.ssh/config to resolve instead of `hostname` (HostName, Port,
            User, IdentityFile, ProxyJump come from there; explicit arguments win).
        connect_timeout: seconds for TCP connect, banner and authentication, each.
        keepalive: seconds between keepalive messages (0: off).
        name: how the user names this host (inventory name), for messages such as `dflashctl trust NAME`.
        ssh_config_file: read this ssh_config instead of ~/.ssh/config and /etc/ssh/ssh_config (tests).
    """

    def __init__(
        self,
        hostname: str,
        *,
        port: int = 22,
        user: str | None = None,
        identity_file: str | None = None,
        known_hosts: str | None = None,
        ssh_config_alias: str | None = None,
        connect_timeout: float = 10.0,
        keepalive: int = 15,
        name: str | None = None,
        ssh_config_file: str | None = None,
    ):
        self.hostname = hostname
        self.port = int(port)
        self.user = user
        self.identity_file = identity_file
        self.known_hosts = known_hosts
        self.ssh_config_alias = ssh_config_alias
        self.connect_timeout = float(connect_timeout)
        self.keepalive = int(keepalive)
        self.ssh_config_file = ssh_config_file
        self.label = name or ssh_config_alias or hostname
        self.name = f"ssh:{self.label}"
        self.calls = 0  # commands run (for tests and benchmarks)
        self.connects = 0  # connections opened
        self._conn = None
        self._lock = threading.Lock()

    def openssh_argv(self, remote: Sequence[str], *, tty: bool = False, strict: bool = False) -> list[str]:
        """The OpenSSH argv that runs `remote` on this host as this transport reaches it (openssh_argv)."""
        return openssh_argv(self.ssh_config_alias or self.hostname, remote, port=self.port, user=self.user,
                            identity_file=self.identity_file, known_hosts=self.known_hosts, tty=tty, strict=strict)

    def command_line(self, argv: Sequence[str]) -> str:
        """`argv` on this host as a command line the user can paste on the workstation (`ssh ... argv`)."""
        return paste_line(self.openssh_argv(argv))

    # ------------------------------------------------------------------------------------ connection

    def _make_connection(self):
        import_ssh_stack()
        from orchestrator.transport import hostkeys
        from orchestrator.transport.sshconn import Connection, load_config

        kh = hostkeys.known_hosts_path(self.known_hosts)
        hostkeys.load_known_hosts(kh)  # a clear error now if the file is unreadable
        return Connection(
            self.ssh_config_alias or self.hostname,
            load_config(self.ssh_config_file),
            user=self.user,
            port=self.port if (self.ssh_config_alias is None or self.port != 22) else None,
            identity_file=self.identity_file,
            known_hosts=kh,
            label=self.label,
            timeout=self.connect_timeout,
        )

    def _connect(self):
        import paramiko

        conn = self._make_connection()
        where = f"{conn.user}@{conn.host}:{conn.port}"
        try:
            conn.open()
        except HostKeyError:
            conn.close()
            raise
        except paramiko.BadHostKeyException as exc:
            conn.close()
            from orchestrator.transport import hostkeys

            name = hostkeys.host_key_name(conn.host, conn.port)
            raise hostkeys.changed_key_error(name, exc.expected_key, exc.key, hostkeys.known_hosts_path(self.known_hosts)) from None
        except paramiko.AuthenticationException as exc:
            conn.close()
            raise ConnectError(
                f"SSH authentication failed for {where} ({exc})",
                fix=f"check the user and identity_file of host {self.label} in inventory.yaml, and that the public "
                f"key is in the host's authorized_keys (ssh-copy-id -p {conn.port} {conn.user}@{conn.host})",
            ) from None
        except (socket.timeout, TimeoutError) as exc:
            conn.close()
            raise ConnectError(
                f"SSH connection to {where} timed out after {self.connect_timeout:.0f} s ({exc or 'timeout'})",
                fix=f"check that {conn.host} is up and reachable (ping {conn.host}; ssh -p {conn.port} {conn.user}@{conn.host})",
            ) from None
        except socket.gaierror as exc:
            conn.close()
            raise ConnectError(f"cannot resolve host name {conn.host!r} ({exc})",
                               fix=f"fix the hostname of host {self.label} in inventory.yaml or ~/.ssh/config") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            # The handshake thread's own error (e.g. no banner) is more telling than what connect() says
            # after it ("No existing session").
            t = conn.client.get_transport()
            inner = getattr(t, "saved_exception", None) if t is not None else None
            conn.close()
            text = str(exc) or type(exc).__name__
            if inner is not None and str(inner) not in text:
                text = f"{inner}; {text}"
            if isinstance(exc, ConnectionRefusedError) or "Unable to connect" in text or "refused" in text.lower():
                msg = f"SSH connection to {where} refused ({text})"
                fix = f"check that sshd runs on {conn.host} and listens on port {conn.port}"
            elif "banner" in text.lower() or "No existing session" in text:
                # paramiko's start_client returns silently when its timeout passes mid-handshake, and the
                # next step then reports "No existing session": both mean the handshake never completed.
                msg = (f"SSH connection to {where}: the SSH handshake (banner, key exchange) did not complete "
                       f"within {self.connect_timeout:.0f} s ({text})")
                fix = f"check that port {conn.port} on {conn.host} is sshd (not another service) and not overloaded"
            else:
                msg = f"SSH connection to {where} failed: {text}"
                fix = f"try `ssh -p {conn.port} {conn.user}@{conn.host} true` to see the details"
            raise ConnectError(msg, fix=fix) from None
        transport = conn.client.get_transport()
        if self.keepalive > 0:
            transport.set_keepalive(self.keepalive)
        self.connects += 1
        return conn

    def _transport(self, fresh: bool = False):
        """The live paramiko Transport, (re)connecting when there is none or it died."""
        with self._lock:
            if fresh and self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._conn is not None:
                t = self._conn.client.get_transport()
                if t is not None and t.is_active():
                    return t
                self._conn.close()  # died between commands: open a new one
                self._conn = None
            self._conn = self._connect()
            return self._conn.client.get_transport()

    def connect(self) -> None:
        """Open the connection now (otherwise the first run does).

        Raises:
            ConnectError, HostKeyError: as for run.
        """
        self._transport()

    def _open_channel(self):
        import paramiko

        last: Exception | None = None
        for attempt in range(2):
            t = self._transport(fresh=attempt > 0)
            try:
                return t.open_session(timeout=self.connect_timeout)
            except (paramiko.SSHException, EOFError, OSError) as exc:
                # Nothing has run yet, so one retry on a fresh connection is safe.
                last = exc
        raise ConnectError(f"cannot open an SSH channel to {self.label}: {last}",
                           fix=f"check that the host {self.label} is reachable; sshd's MaxSessions may be too low") from last

    # ---------------------------------------------------------------------------------------- running

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        on_stdout: StreamCallback | None = None,
        on_stderr: StreamCallback | None = None,
    ) -> Result:
        """Run argv on the host (rendered once by quoting.render for the login shell).

        Args/Raises: as Transport.run. The exit code is the command's; 255 when the server sent none
        (the process was killed by a signal), as OpenSSH's client reports it.
        """
        return self.finish(self.start(argv), stdin=stdin, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr)

    def start(self, argv: Sequence[str]) -> Started:
        """Start argv on the host and return at once, its stdin still open: `finish` feeds it and waits.
        What the command writes meanwhile waits in the channel's window.

        Raises:
            ConnectError, HostKeyError: as for run.
        """
        argv = list(argv)
        command = render(argv)  # a NUL byte or a non-str is refused here, before anything reaches the host
        at = time.monotonic()
        chan = self._open_channel()
        self.calls += 1
        try:
            chan.exec_command(command)
        except Exception as exc:
            chan.close()
            raise ConnectError(f"cannot start a command on {self.label}: {exc}") from exc
        return Started(argv, chan, at)

    def finish(
        self,
        started: Started,
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        on_stdout: StreamCallback | None = None,
        on_stderr: StreamCallback | None = None,
    ) -> Result:
        """Feed a started command its stdin, stream its output, wait for its exit status (as run; the
        timeout counts from now)."""
        chan, argv = started.handle, started.argv
        deadline = None if timeout is None else time.monotonic() + timeout
        io = _ChannelIO(chan, stdin, on_stdout, on_stderr)

        def result(code: int) -> Result:
            return Result(argv, code, b"".join(io.out), b"".join(io.err), self.name, time.monotonic() - started.at,
                          bytes(io.err_tail))

        try:
            self._wait_output(io, deadline, timeout, result)
            code = self._exit_status(chan, deadline, result)
        except KeyboardInterrupt:
            chan.close()
            raise
        finally:
            io.feeder.join(1)
        chan.close()
        return result(self._final_code(io, chan, code))

    @staticmethod
    def discard(started: Started) -> None:
        """Drop a started command that will not be finished: its channel is closed, so it reads end-of-file
        on stdin (the agent then runs nothing)."""
        started.handle.close()

    def _wait_output(self, io: "_ChannelIO", deadline: float | None, timeout: float | None, result) -> None:
        """Until both streams are at EOF; past the deadline the channel is closed and CommandTimeout raised."""
        for t in io.pumps:
            while t.is_alive():
                t.join(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic())))
                if deadline is not None and time.monotonic() >= deadline and t.is_alive():
                    io.chan.close()
                    for other in (*io.pumps, io.feeder):
                        other.join(2)
                    raise CommandTimeout(f"command timed out after {timeout:.0f} s on {self.label}",
                                         result=result(-9))

    def _exit_status(self, chan, deadline: float | None, result) -> int:
        """The exit status, read last: both streams are at EOF, so it is there or arrives within the grace."""
        grace_end = time.monotonic() + EXIT_STATUS_GRACE_S
        if deadline is not None:
            grace_end = min(grace_end, max(deadline, time.monotonic() + 1.0))
        while not chan.exit_status_ready():
            if time.monotonic() >= grace_end:
                chan.close()
                raise CommandTimeout(f"no exit status from {self.label} after the output ended", result=result(-9))
            time.sleep(0.002)
        return chan.recv_exit_status()

    def _final_code(self, io: "_ChannelIO", chan, code: int) -> int:
        """The command's exit code; a broken connection (a stream error, or no status because the connection
        died) is a ConnectError, since whether the command finished is unknown."""
        if io.errors:
            import paramiko

            if isinstance(io.errors[0], (EOFError, OSError, paramiko.SSHException)):
                raise ConnectError(f"the SSH connection to {self.label} broke during a command: {io.errors[0]}",
                                   fix="check the network; the command may or may not have finished on the host")
            raise io.errors[0]
        if code == -1 and self._connection_died(chan):
            raise ConnectError(
                f"the SSH connection to {self.label} was lost during a command (no exit status)",
                fix="check the network and the host; the command may or may not have finished there",
            )
        if code == -1:
            io.err_tail.extend(b"\n[dflashctl: the remote command ended without an exit status (killed by a signal?)]\n")
            return NO_EXIT_STATUS
        return code

    @staticmethod
    def _connection_died(chan, wait: float = 1.0) -> bool:
        """Whether a channel without exit status closed because the whole connection died (rather than
        the process being killed by a signal). paramiko closes the channels a moment BEFORE it marks the
        transport inactive, so give it up to `wait` seconds to say so."""
        t = chan.get_transport()
        end = time.monotonic() + wait
        while t is not None and t.is_active():
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> "SSHTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ChannelIO:
    """A started command's streams: stdout and stderr drained on their own threads (no window deadlock with
    large outputs), stdin fed on a third (a command that writes a lot before reading must not block us)."""

    def __init__(self, chan, stdin: bytes | None, on_stdout: StreamCallback | None, on_stderr: StreamCallback | None):
        self.chan = chan
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.out_tail, self.err_tail = bytearray(), bytearray()
        self.errors: list[BaseException] = []
        self.pumps = (
            threading.Thread(target=_pump, args=(chan, chan.recv, self.out, on_stdout, self.out_tail, self.errors),
                             daemon=True),
            threading.Thread(target=_pump, args=(chan, chan.recv_stderr, self.err, on_stderr, self.err_tail,
                                                 self.errors), daemon=True),
        )
        self.feeder = threading.Thread(target=_feed, args=(chan, stdin), daemon=True)
        for t in (*self.pumps, self.feeder):
            t.start()


def _pump(chan, recv, sink: list[bytes], callback: StreamCallback | None, tail: bytearray, errors: list) -> None:
    """Read one stream of a channel to EOF; hand chunks to callback or keep them; keep a bounded tail."""
    try:
        while True:
            chunk = recv(_CHUNK)
            if not chunk:
                return
            if callback is not None:
                callback(chunk)
            else:
                sink.append(chunk)
            tail.extend(chunk)
            if len(tail) > _TAIL:
                del tail[: len(tail) - _TAIL]
    except BaseException as exc:  # surfaced by run(); a callback's error must not be swallowed
        errors.append(exc)
        chan.close()  # stop the other stream too: nobody drains this one any more


def _feed(chan, data: bytes | None) -> None:
    """Send stdin (if any) then EOF, so the remote command never waits for input that will not come."""
    try:
        if data:
            view = memoryview(data)
            for i in range(0, len(view), _CHUNK):
                chan.sendall(view[i:i + _CHUNK])
        chan.shutdown_write()
    except (OSError, EOFError):
        pass  # the command exited without reading all of its input
    except Exception:  # paramiko.SSHException on a closed channel: same situation
        pass
