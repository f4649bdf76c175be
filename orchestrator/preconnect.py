"""A command's SSH connection, started while the inventory is still being validated.

Validating the inventory (pydantic) and importing the SSH stack cost a few hundred milliseconds on the
workstation; opening the connection waits mostly on the host (sshd start, key exchange, authentication).
So a command that will reach a container starts a thread at once: it reads the inventory's raw YAML,
finds the host of the command's target and connects, while the main thread validates the inventory.
`open_target` then takes the connection if the validated host has exactly the settings the thread
used (else the thread's connection is closed and a fresh one is made), and an error the thread met
(unknown host key, refused, ...) is raised there as if the connection had been opened then.
Anything the raw read cannot make sense of just means no early connection: validation reports it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from orchestrator.errors import DflashError

# The HostSpec fields the connection depends on (the others say how to run pct).
FIELDS = ("ssh", "port", "user", "identity_file", "known_hosts")


@dataclass(frozen=True)
class HostKey:
    """What an SSHTransport is made from: the host's inventory name and its connection fields."""

    name: str
    ssh: str
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None

    @classmethod
    def of(cls, name: str, host) -> "HostKey":
        """The key of an inventory HostSpec (or anything with the FIELDS as attributes)."""
        return cls(name, *(getattr(host, f) for f in FIELDS))


class EarlyConnection:
    """One background connection attempt; `take` hands it over once (see the module docstring)."""

    def __init__(self, key: HostKey):
        self.key = key
        self._transport = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._connect, name="dflashctl-preconnect", daemon=True)
        self._thread.start()

    def _connect(self) -> None:
        from orchestrator.target import ssh_transport

        transport = ssh_transport(self.key, self.key.name)
        try:
            transport.connect()
        except BaseException as exc:  # handed to the main thread by take()
            transport.close()
            self._error = exc
            return
        self._transport = transport

    def take(self, key: HostKey):
        """The connected SSHTransport if it was made for `key`, else None (and it is closed).

        Raises:
            DflashError: the connection for `key` failed (ConnectError, HostKeyError) in the thread.
        """
        self._thread.join()
        transport, error = self._transport, self._error
        self._transport = self._error = None
        if key != self.key:
            if transport is not None:
                transport.close()
            return None
        if isinstance(error, DflashError):
            raise error
        return transport  # None after any other error: the caller connects again and reports it

    def close(self) -> None:
        """Close a connection nobody took (the command ended first, or failed)."""
        self._thread.join()
        if self._transport is not None:
            self._transport.close()
            self._transport = None


def start(inventory: str | None, target: str | None, experiment: str | None = None) -> EarlyConnection | None:
    """Start connecting to the host of `target` (else the experiment's target) when it is a container.

    Returns None when the raw inventory names no such container target, or cannot be read: the command
    then connects as usual and validation reports any problem.
    """
    key = _host_key(inventory, target, experiment)
    return EarlyConnection(key) if key is not None else None


def _host_key(inventory: str | None, target: str | None, experiment: str | None) -> HostKey | None:
    try:
        import yaml

        from orchestrator.inventory_file import read_inventory

        raw = yaml.load(read_inventory(inventory)[0], Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if target is None:
            target = raw["experiments"][experiment]["target"]
        spec = raw["targets"][target]
        if spec.get("kind") != "container":
            return None
        name = spec["host"]
        host = raw["hosts"][name]
        key = HostKey(name, *(host.get(f) for f in FIELDS))
    except Exception:  # noqa: BLE001 - any surprise: no early connection, validation will say what is wrong
        return None
    if not isinstance(key.ssh, str) or not all(isinstance(getattr(key, f), (str, type(None))) for f in FIELDS[2:]):
        return None
    if key.port is not None and (not isinstance(key.port, int) or isinstance(key.port, bool)):
        return None
    return key
