"""The OpenSSH client command lines a user runs or pastes: `attach`'s `ssh -t`, and every printed fix that runs on a
host (`ssh -p 2222 root@pve1.lan pct start 200`). They reach the host as this project's SSH transport does (the
same destination and explicit settings; the rest from ~/.ssh/config for both)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from orchestrator.names import is_ssh_word
from orchestrator.quoting import render


def openssh_argv(
    destination: str,
    remote: Sequence[str],
    *,
    port: int | None = None,
    user: str | None = None,
    identity_file: str | None = None,
    known_hosts: str | None = None,
    tty: bool = False,
    strict: bool = False,
) -> list[str]:
    """The OpenSSH client argv that runs `remote` on a host as the user's own ssh reaches it: the same
    destination (an ~/.ssh/config alias or a hostname) and the same explicit settings this project's SSH
    transport uses; everything else comes from ~/.ssh/config, for both. Fixes printed for a host
    (`ssh -p 2222 root@pve1.lan pct start 200`, or `ssh pve1 pct start 200` for an alias) and `attach`
    are built here.

    Args:
        destination: the inventory's `ssh:` (never the inventory's own name for the host).
        remote: the argv to run there; rendered into ONE string by quoting.render (sshd hands it to the
            login shell, the only parser on the path).
        port: left out when None or 22 (then ~/.ssh/config or 22 decides, as for the transport).
        tty: `-t`, for an interactive program (tmux attach).
        strict: `StrictHostKeyChecking=yes`: never accept an unknown or changed key interactively.
    Raises:
        ValueError: the destination or user starts with '-' or holds whitespace (ssh would read an option).
    """
    for what, value in (("destination", destination), ("user", user)):
        if value is not None and not is_ssh_word(value):
            raise ValueError(f"bad ssh {what} {value!r}")
    argv = ["ssh", *(["-t"] if tty else [])]
    if port and int(port) != 22:
        argv += ["-p", str(port)]
    if identity_file:
        argv += ["-i", identity_file, "-o", "IdentitiesOnly=yes"]  # only the configured key, as the transport
    if known_hosts:
        argv += ["-o", f"UserKnownHostsFile={known_hosts}"]
    if strict:
        argv += ["-o", "StrictHostKeyChecking=yes"]
    return [*argv, f"{user}@{destination}" if user else destination, render(remote)]


def paste_line(argv: Sequence[str]) -> str:
    """An openssh_argv as a line to paste into a shell. ssh joins its trailing arguments with spaces, so a
    remote command whose words need no quoting is printed bare (`ssh pve1 pct start 200`); any other is
    printed as the one quoted argument it is."""
    *local, remote = argv
    words = remote.split(" ")
    if all(w and shlex.quote(w) == w for w in words):
        return f"{shlex.join(local)} {remote}"
    return shlex.join(argv)
