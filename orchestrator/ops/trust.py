"""`trust`: record an inventory host's SSH key in known_hosts (the transport's hostkeys module does the work)."""

from __future__ import annotations

import os
from pathlib import Path


def resolve_address(host, ssh_config: str | os.PathLike = "~/.ssh/config") -> tuple[str, int]:
    """(hostname, port) that sshd is reached at: `host.ssh` looked up in ~/.ssh/config (HostName, Port),
    explicit inventory fields winning, as the SSH transport resolves it."""
    hostname, port = host.ssh, host.port
    path = Path(ssh_config).expanduser()
    if path.is_file():
        import paramiko

        found = paramiko.SSHConfig.from_path(str(path)).lookup(host.ssh)
        hostname = found.get("hostname", host.ssh)
        if port is None and found.get("port"):
            port = int(found["port"])
    return hostname, port or 22


def trust(inv, host_name: str) -> dict:
    """Fetch and record the key of `hosts.<host_name>` in its known_hosts file.

    Returns:
        {host, address, keytype, fingerprint, known_hosts}.
    Raises:
        InventoryError: unknown host (with a suggestion). HostKeyError: the host's key CHANGED (never
            replaced here). ConnectError: the host cannot be reached.
    """
    from orchestrator.transport.hostkeys import trust_host

    host = inv.host(host_name)
    known = os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts")
    hostname, port = resolve_address(host)
    keytype, fingerprint = trust_host(hostname, port, known)
    return {"host": host_name, "address": f"{hostname}:{port}", "keytype": keytype,
            "fingerprint": fingerprint, "known_hosts": known}
