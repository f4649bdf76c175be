"""attach: an interactive `tmux attach` to a run's session.

Local target: `tmux attach -t =SESSION` here. Container: the real OpenSSH client with a tty (`ssh -t`; an
interactive terminal is exactly what paramiko's no-pty channels are not for) running `pct exec CT -- tmux
attach ...` on the host, the remote part rendered once by quoting.render.
"""

from __future__ import annotations

import os
import shutil

from orchestrator import names
from orchestrator.errors import UserError


def tmux_attach_argv(session: str, read_only: bool = False) -> list[str]:
    """`tmux attach-session [-r] -t =SESSION` (`=`: the exact name, never a prefix match)."""
    return ["tmux", "attach-session", *(["-r"] if read_only else []), "-t", "=" + session]


def container_attach_argv(
    *,
    hostname: str,
    ctid: int,
    session: str,
    read_only: bool = False,
    env: dict[str, str] | None = None,
    pct: str = "pct",
    sudo: bool = False,
    port: int | None = None,
    user: str | None = None,
    identity_file: str | None = None,
    known_hosts: str | None = None,
) -> list[str]:
    """`ssh -t HOST 'pct exec CT --keep-env 0 -- env -i HOME=.. PATH=.. TERM=.. tmux attach ...'`, built by
    transport.ssh.openssh_argv (the destination as the user's ssh reaches it; an unknown or changed host key
    refused, never asked about).

    TERM must travel inside the command: `--keep-env 0` drops it, and tmux refuses to attach without one.
    """
    from orchestrator.transport.pct import pct_exec_argv
    from orchestrator.quoting import with_env
    from orchestrator.transport.ssh import openssh_argv

    inner = with_env({**(env or {}), "TERM": os.environ.get("TERM") or "xterm-256color"},
                     tmux_attach_argv(session, read_only))
    remote = pct_exec_argv(ctid, inner, pct=pct, sudo=sudo)
    return openssh_argv(hostname, remote, port=port, user=user, identity_file=identity_file,
                        known_hosts=known_hosts, tty=True, strict=True)


def attach_argv(target, session: str, read_only: bool = False) -> list[str]:
    """The argv that attaches to `session` on `target` (LocalTarget or ContainerTarget)."""
    from orchestrator.target import ContainerTarget

    if not isinstance(target, ContainerTarget):
        if os.environ.get("TMUX") and not read_only:
            # Already inside tmux: attaching would nest (tmux refuses); switch this client instead.
            return ["tmux", "switch-client", "-t", "=" + session]
        return tmux_attach_argv(session, read_only)
    pct = target.transport
    ssh = pct.parent
    return container_attach_argv(
        hostname=ssh.ssh_config_alias or ssh.hostname,
        ctid=pct.ctid,
        session=session,
        read_only=read_only,
        env=target.env(),
        pct=pct.pct,
        sudo=pct.sudo,
        port=ssh.port,
        user=ssh.user,
        identity_file=ssh.identity_file,
        known_hosts=ssh.known_hosts,
    )


def session_for(ref: str, inv=None) -> tuple[str, str | None, str | None]:
    """(session, experiment, target name) for a run id or an experiment name.

    A recorded run gives its experiment and target; else `ref` must be an experiment of the inventory.

    Raises:
        UserError: `ref` (or the record's experiment) breaks the name rule.
        RunNotFound / InventoryError: neither a recorded run nor an experiment.
    """
    from orchestrator.errors import RunNotFound
    from orchestrator.inventory import check_name, check_run_ref
    from orchestrator.records import find_record

    check_run_ref(ref, "run id or experiment")
    try:
        rec = find_record(ref)
        experiment = check_name("experiment", rec["experiment"])
        return names.session_name(experiment), experiment, rec.get("target")
    except RunNotFound:
        if inv is None or ref not in getattr(inv, "experiments", {}):
            raise
    exp = inv.experiment(ref)
    return names.session_name(ref), ref, exp.target


def attach_command(inv, ref: str, *, target: str | None = None, read_only: bool = False) -> list[str]:
    """`dflashctl attach`: the argv that attaches to the session of run or experiment `ref` on `target`
    (default: the run's, else the inventory's default). Opens the target for its settings and closes it."""
    from orchestrator.target import open_target

    session, _experiment, tname = session_for(ref, inv)
    tgt = open_target(inv, target or tname or inv.default_target())
    try:
        return attach_argv(tgt, session, read_only)
    finally:
        tgt.close()


def exec_attach(argv: list[str]) -> None:  # pragma: no cover - replaces the process
    """Replace this process with the attach command (the terminal belongs to tmux from here on).

    Raises:
        UserError: the program (tmux or ssh) is not installed here.
    """
    if shutil.which(argv[0]) is None:
        raise UserError(f"`{argv[0]}` is not installed on this machine", fix=f"install {argv[0]} (apt-get install -y {'openssh-client' if argv[0] == 'ssh' else argv[0]})")
    os.execvp(argv[0], argv)
