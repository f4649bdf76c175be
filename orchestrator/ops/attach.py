"""attach: an interactive `tmux attach` to a run's session.

The target builds the argv (Target.attach_argv): `tmux attach -t =SESSION` here for a local target; for a
container the real OpenSSH client with a tty running `pct exec CT -- tmux attach ...` on the host. This
module finds the session and replaces the process with that command.
"""

from __future__ import annotations

import os
import shutil

from orchestrator import names
from orchestrator.errors import UserError


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
        return tgt.attach_argv(session, read_only)
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
