"""Host keys: known_hosts is the truth.

An unknown key is refused with its type, its SHA256 fingerprint and the exact command that trusts it
(`dflashctl trust HOST`); a changed key is refused, always, with a warning that it may be an attack.
There is no option to bypass either check. `trust_host` is the one way a key gets into known_hosts.

Entries use OpenSSH's naming: `host` on port 22, `[host]:port` otherwise (hashed entries are read too).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shlex
import socket
from pathlib import Path

import paramiko

from orchestrator.errors import ConnectError, HostKeyError

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


def known_hosts_path(path: str | os.PathLike | None = None) -> Path:
    """The known_hosts file to use: `path` if given, else ~/.ssh/known_hosts (user-expanded)."""
    return Path(os.path.expanduser(str(path or DEFAULT_KNOWN_HOSTS)))


def host_key_name(hostname: str, port: int = 22) -> str:
    """How OpenSSH (and paramiko) name a host in known_hosts: `host`, or `[host]:port` off port 22."""
    return hostname if int(port) == 22 else f"[{hostname}]:{int(port)}"


def fingerprint(key: paramiko.PKey) -> str:
    """`SHA256:<base64, unpadded>` of the public key blob, as `ssh-keygen -l` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_known_hosts(path: str | os.PathLike | None = None) -> paramiko.HostKeys:
    """Parse known_hosts (a missing file is an empty one).

    Raises:
        HostKeyError: the file exists but cannot be read.
    """
    keys = paramiko.HostKeys()
    p = known_hosts_path(path)
    if p.exists():
        try:
            keys.load(str(p))
        except (OSError, paramiko.SSHException) as exc:
            raise HostKeyError(f"cannot read known_hosts file {p}: {exc}", fix=f"check the file's permissions and format ({p})") from exc
    return keys


def unknown_key_error(name: str, key_name: str, key: paramiko.PKey, known_hosts: Path) -> HostKeyError:
    """The refusal for a key that known_hosts does not list."""
    return HostKeyError(
        f"the host key of {key_name} is not known (not in {known_hosts}): {key.get_name()} {fingerprint(key)}. "
        f"Compare the fingerprint with `ssh-keygen -lf /etc/ssh/ssh_host_{_short_type(key)}_key.pub` on the host "
        f"before trusting it",
        fix=f"dflashctl trust {name}",
    )


def changed_key_error(key_name: str, expected: paramiko.PKey, got: paramiko.PKey, known_hosts: Path) -> HostKeyError:
    """The refusal for a key that differs from the known one. Never bypassable."""
    return HostKeyError(
        f"WARNING: the host key of {key_name} has CHANGED; this may be an attack (someone intercepting the "
        f"connection) or the host was reinstalled. known_hosts ({known_hosts}) has {expected.get_name()} "
        f"{fingerprint(expected)}, the host now offers {got.get_name()} {fingerprint(got)}. Refusing to connect",
        fix=f"verify the new key on the host out of band, then remove the old entry with "
        f"`ssh-keygen -R {shlex.quote(key_name)} -f {shlex.quote(str(known_hosts))}` and run dflashctl trust again",
    )


def _short_type(key: paramiko.PKey) -> str:
    name = key.get_name()
    return {"ssh-ed25519": "ed25519", "ssh-rsa": "rsa", "rsa-sha2-256": "rsa", "rsa-sha2-512": "rsa"}.get(
        name, "ecdsa" if name.startswith("ecdsa") else name
    )


class RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    """paramiko policy: a host missing from known_hosts raises HostKeyError (with fingerprint and fix).

    Args:
        name: how the user names the host (the inventory host name), used in `dflashctl trust NAME`.
        known_hosts: the file consulted, for the message.
    """

    def __init__(self, name: str, known_hosts: Path):
        self.name = name
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key):
        raise unknown_key_error(self.name, hostname, key, self.known_hosts)


def fetch_host_key(hostname: str, port: int = 22, *, timeout: float = 10.0, sock=None) -> paramiko.PKey:
    """Connect, run the key exchange only (no authentication), and return the server's host key.

    Raises:
        ConnectError: the host cannot be reached or does not speak SSH.
    """
    own_sock = sock is None
    try:
        if own_sock:
            sock = socket.create_connection((hostname, int(port)), timeout=timeout)
        t = paramiko.Transport(sock)
        t.banner_timeout = timeout
        try:
            t.start_client(timeout=timeout)
            return t.get_remote_server_key()
        finally:
            t.close()
    except (OSError, paramiko.SSHException, EOFError) as exc:
        raise ConnectError(
            f"cannot fetch the host key of {hostname}:{port}: {exc or type(exc).__name__}",
            fix=f"check that the host is up and sshd listens on port {port}",
        ) from exc
    finally:
        if own_sock and sock is not None:
            sock.close()


def add_known_host(known_hosts: str | os.PathLike | None, hostname: str, port: int, key: paramiko.PKey) -> Path:
    """Append `<name> <type> <base64>` to known_hosts (temp + rename, so a crash never half-writes it).

    Returns:
        The known_hosts path written.
    """
    path = known_hosts_path(known_hosts)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    old = path.read_bytes() if path.exists() else b""
    if old and not old.endswith(b"\n"):
        old += b"\n"
    line = f"{host_key_name(hostname, port)} {key.get_name()} {key.get_base64()}\n".encode()
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(old + line)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o600 if not path.exists() else (path.stat().st_mode & 0o777))
    os.replace(tmp, path)
    return path


def trust_host(hostname: str, port: int = 22, known_hosts: str | os.PathLike | None = None, *,
               timeout: float = 10.0) -> tuple[str, str]:
    """Fetch the host's key and record it in known_hosts (the one way a key becomes trusted).

    A key that is already recorded is left alone; a recorded key that DIFFERS is refused (remove the old
    entry by hand after verifying the new one).

    Args:
        hostname, port: where sshd listens (an ~/.ssh/config alias must be resolved by the caller).
        known_hosts: the file to update; None = ~/.ssh/known_hosts.
    Returns:
        (key type, SHA256 fingerprint) of the trusted key, for the caller to show.
    Raises:
        ConnectError: the host cannot be reached.
        HostKeyError: known_hosts has a different key for this host.
    """
    key = fetch_host_key(hostname, port, timeout=timeout)
    path = known_hosts_path(known_hosts)
    name = host_key_name(hostname, port)
    entry = load_known_hosts(path).lookup(name)
    if entry is not None:
        if key.get_name() in entry:
            if entry[key.get_name()] == key:
                return key.get_name(), fingerprint(key)
            raise changed_key_error(name, entry[key.get_name()], key, path)
        # Known under another key type: OpenSSH would compare that type; a new type for a known host is
        # still refused so that trust never silently widens what the host may present.
        other = next(iter(entry.values()))
        raise changed_key_error(name, other, key, path)
    add_known_host(path, hostname, port, key)
    return key.get_name(), fingerprint(key)
