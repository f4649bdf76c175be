"""`trust`: record an inventory host's SSH key in known_hosts (the transport's hostkeys module does the work)."""

from __future__ import annotations

import os


def trust(inv, host_name: str) -> dict:
    """Fetch and record the key of `hosts.<host_name>`.

    Returns:
        {host, address, keytype, fingerprint, known_hosts}.
    Raises:
        InventoryError: unknown host (with a suggestion). HostKeyError: the host's key CHANGED (never
            replaced here). ConnectError: the host cannot be reached.
    """
    from orchestrator.transport.hostkeys import trust_host

    host = inv.host(host_name)
    known = os.path.expanduser(host.known_hosts) if host.known_hosts else os.path.expanduser("~/.ssh/known_hosts")
    port = host.port or 22
    keytype, fingerprint = trust_host(host.ssh, port, known)
    return {"host": host_name, "address": f"{host.ssh}:{port}", "keytype": keytype,
            "fingerprint": fingerprint, "known_hosts": known}
