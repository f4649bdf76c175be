"""attach: an interactive `tmux attach` to a run's session.

The target builds the argv (Target.attach_argv): `tmux attach -t =SESSION` here for a local target; for a
container the real OpenSSH client with a tty running `pct exec CT -- tmux attach ...` on the host. This
module finds the session (orchestrator.ops.placement) and replaces the process with that command.
"""

from __future__ import annotations

import os
import shutil

from orchestrator.errors import RunNotFound, UserError
from orchestrator.ops.placement import Placement, opened, resolve
from orchestrator.records import records_path


def session_for(ref: str, inv, node: int | None = None) -> tuple[str, str | None, str | None]:
    """(session, experiment, target name) for a run id or an experiment name: the run's placement `node`
    (default: node 0, the only one of a run on one target).

    Raises:
        UserError: `ref` (or the record's experiment) breaks the name rule, or the run has no node `node`.
        RunNotFound / InventoryError: neither a recorded run nor an experiment.
    """
    where = resolve(inv, ref)
    if where.experiment is None:  # a run id nothing here recorded: no experiment, so no session name
        raise RunNotFound(f"no run {ref!r} in {records_path()}", fix="dflashctl runs  (lists recorded runs)")
    place = _node(where.placements, node, ref)
    return place.session, where.experiment, place.target


def _node(places: list[Placement], node: int | None, ref: str) -> Placement:
    """Placement `node` of a run (None: the first).

    Raises:
        UserError: --node of a run on one target, or a node the run does not have.
    """
    if node is None:
        return places[0]
    found = [p for p in places if p.node == node]
    if not found:
        count = len([p for p in places if p.node is not None]) or 1
        raise UserError(f"{ref} runs on {count} node(s): there is no node {node}",
                        fix=f"dflashctl attach {ref} --node N with N from 0 to {count - 1}")
    return found[0]


def attach_command(inv, ref: str, *, target: str | None = None, read_only: bool = False,
                   node: int | None = None) -> list[str]:
    """`dflashctl attach`: the argv that attaches to the session of run or experiment `ref` on `target`
    (default: the run's, a run across targets: node `node`'s). Opens the target for its settings and closes it."""
    session, _experiment, tname = session_for(ref, inv, node)
    with opened(inv, [target or tname]) as (tgt,):
        return tgt.attach_argv(session, read_only)


def exec_attach(argv: list[str]) -> None:  # pragma: no cover - replaces the process
    """Replace this process with the attach command (the terminal belongs to tmux from here on).

    Raises:
        UserError: the program (tmux or ssh) is not installed here.
    """
    if shutil.which(argv[0]) is None:
        raise UserError(f"`{argv[0]}` is not installed on this machine", fix=f"install {argv[0]} (apt-get install -y {'openssh-client' if argv[0] == 'ssh' else argv[0]})")
    os.execvp(argv[0], argv)
