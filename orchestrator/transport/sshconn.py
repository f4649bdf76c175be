"""One SSH connection opened as the user's own ssh would open it, on paramiko alone: ~/.ssh/config (and
/etc/ssh/ssh_config) resolved with paramiko's SSHConfig (HostName, Port, User, IdentityFile, ProxyJump), the
explicit settings winning over it; a ProxyJump hop (or a chain, `a,b`) reached first, the target through a
`direct-tcpip` channel from it; known_hosts the only truth on every hop (hostkeys.RefuseUnknownHost).

Only what the SSH transport uses of a connection: `client` (a paramiko SSHClient), `host`, `port`, `user`,
`open()` and `close()`. Every hop's paramiko Transport is `transport_over`'s: TCP options set before the
handshake, AES-GCM offered first.
"""

from __future__ import annotations

import getpass
import os
import socket
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
        via: the ProxyJump to use instead of ssh_config's (the earlier hops of a chain).
    """

    def __init__(self, target: str, config: paramiko.SSHConfig, *, user: str | None, port: int | None,
                 identity_file: str | None, known_hosts: Path, label: str, timeout: float, via: str | None = None):
        found = config.lookup(target)
        self.host = found.get("hostname", target)
        self.port = int(port if port is not None else found.get("port", 22))
        self.user = user or found.get("user") or getpass.getuser()
        self.timeout = timeout
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
                                      via=",".join(before) or None)

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
        self.client.connect(self.host, port=self.port, username=self.user, sock=sock, banner_timeout=self.timeout,
                            auth_timeout=self.timeout, channel_timeout=self.timeout, timeout=self.timeout,
                            transport_factory=transport_over, **self.keys)

    def close(self) -> None:
        self.client.close()
        if self.gateway is not None:
            self.gateway.close()


def transport_over(sock, **kwargs) -> paramiko.Transport:
    """The paramiko Transport of one hop, over `sock` (a TCP socket, or a ProxyJump hop's channel).

    - TCP_NODELAY from the first byte: a handshake packet otherwise waits in Nagle's buffer for the ACK of the
      one before it, which the host delays (~40 ms); about 40 ms of every connection's handshake.
    - AES-GCM first (the rest of paramiko's list follows, unchanged): paramiko handles every incoming packet
      in Python, and with AES-CTR that is a decrypt of the length block, a decrypt of the rest and an HMAC;
      with GCM one AEAD call, ~0.05 ms less per streamed log line (bench/follow_latency.py). A server without
      GCM negotiates the next cipher as before.
    - A global request from the host is acknowledged at once (_AckingTransport).
    """
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport = _AckingTransport(sock, **kwargs)
    options = transport.get_security_options()
    ciphers = tuple(options.ciphers)
    gcm = tuple(c for c in ciphers if "-gcm" in c)
    options.ciphers = gcm + tuple(c for c in ciphers if c not in gcm)
    return transport


class _AckingTransport(paramiko.Transport):
    """A paramiko Transport that acknowledges the host's global requests at once.

    OpenSSH's sshd sends one right after authentication (hostkeys-00@openssh.com, its host keys; no reply
    wanted), and it reaches the client just after the client asked for its first channel. Nothing answers
    it, so the kernel delays its ACK (~40 ms), and the host's channel confirmation, a small packet sent while
    that one is unacknowledged, waits in the host's Nagle buffer for it: the first command of every
    connection started ~40 ms late. TCP_QUICKACK sends the pending ACK now.
    """

    def _parse_global_request(self, m):
        super()._parse_global_request(m)  # paramiko's own handling: refused, replied to only when asked
        if isinstance(self.sock, socket.socket) and hasattr(socket, "TCP_QUICKACK"):  # Linux only
            try:
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            except OSError:
                pass  # the connection is closing: nothing is waiting for this ACK
