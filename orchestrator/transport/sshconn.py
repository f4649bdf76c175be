"""One SSH connection opened as the user's own ssh would open it, on paramiko alone: ~/.ssh/config (and
/etc/ssh/ssh_config) resolved with paramiko's SSHConfig (HostName, Port, User, IdentityFile, ProxyJump), the
explicit settings winning over it; a ProxyJump hop (or a chain, `a,b`) reached first, the target through a
`direct-tcpip` channel from it; known_hosts the only truth on every hop (hostkeys.RefuseUnknownHost).

Only what the SSH transport uses of a connection: `client` (a paramiko SSHClient), `host`, `port`, `user`,
`open()` and `close()`.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Callable
from pathlib import Path

import paramiko

from orchestrator.transport import hostkeys

DEFAULT_CONFIGS = ("/etc/ssh/ssh_config", "~/.ssh/config")


def load_config(path: str | None) -> paramiko.SSHConfig:
    """The ssh_config that applies: `path` alone when given (tests), else the system's then the user's."""
    config = paramiko.SSHConfig()
    for p in [path] if path else DEFAULT_CONFIGS:
        full = Path(os.path.expanduser(p))
        if full.is_file():
            with open(full) as f:
                config.parse(f)
    return config


class Connection:
    """A connection to `target` (an ssh_config alias or a host name), not opened yet.

    Args:
        target: what `ssh TARGET` would be given.
        config: the parsed ssh_config.
        user / port: explicit settings (None: ssh_config's, else the local user and 22).
        identity_file: the one key to offer (no agent, no other keys); None: ssh_config's IdentityFile,
            else paramiko's defaults and the agent.
        known_hosts: the file that vouches for every hop's key.
        label: how the user names the host (for `dflashctl trust NAME` in a refusal).
        timeout: seconds for TCP connect, banner and authentication, each.
        transport_factory: makes the paramiko Transport over the socket (cipher order).
        via: the ProxyJump to use instead of ssh_config's (the earlier hops of a chain).
    """

    def __init__(self, target: str, config: paramiko.SSHConfig, *, user: str | None, port: int | None,
                 identity_file: str | None, known_hosts: Path, label: str, timeout: float,
                 transport_factory: Callable | None = None, via: str | None = None):
        found = config.lookup(target)
        self.host = found.get("hostname", target)
        self.port = int(port if port is not None else found.get("port", 22))
        self.user = user or found.get("user") or getpass.getuser()
        self.timeout = timeout
        self.transport_factory = transport_factory
        self.keys: dict = {"look_for_keys": False, "allow_agent": False, "key_filename": [identity_file]} \
            if identity_file else ({"key_filename": [os.path.expanduser(k) for k in found["identityfile"]]}
                                   if found.get("identityfile") else {})
        self.client = paramiko.SSHClient()
        self.client.set_missing_host_key_policy(hostkeys.RefuseUnknownHost(label, known_hosts))
        if known_hosts.exists():
            self.client.get_host_keys().load(str(known_hosts))
        jump = via if via is not None else found.get("proxyjump")
        self.gateway: Connection | None = None
        if jump and jump.lower() != "none":
            *before, last = [hop.strip() for hop in jump.split(",")]
            # `a,b`: b is reached through a (ssh's order); each hop is resolved by the same ssh_config.
            self.gateway = Connection(last, config, user=None, port=None, identity_file=None,
                                      known_hosts=known_hosts, label=label, timeout=timeout,
                                      transport_factory=transport_factory, via=",".join(before) or None)

    def open(self) -> None:
        """Connect and authenticate (the gateway first).

        Raises:
            paramiko's exceptions, socket errors, and HostKeyError (an unknown key on any hop).
        """
        sock = None
        if self.gateway is not None:
            self.gateway.open()
            sock = self.gateway.client.get_transport().open_channel(
                "direct-tcpip", (self.host, self.port), ("", 0), timeout=self.timeout)
        kwargs = dict(self.keys, banner_timeout=self.timeout, auth_timeout=self.timeout,
                      channel_timeout=self.timeout, timeout=self.timeout, sock=sock)
        if self.transport_factory is not None:
            kwargs["transport_factory"] = self.transport_factory
        self.client.connect(self.host, port=self.port, username=self.user, **kwargs)

    def close(self) -> None:
        self.client.close()
        if self.gateway is not None:
            self.gateway.close()
