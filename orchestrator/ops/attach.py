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


def session_for(ref: str, inv=None, node: int | None = None) -> tuple[str, str | None, str | None]:
    """(session, experiment, target name) for a run id or an experiment name.

    A recorded run gives its experiment and target (a run across targets: node `node`'s, default node 0);
    else `ref` must be an experiment of the inventory (across targets: node `node`'s target).

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
        return names.session_name(experiment), experiment, _node_target(rec.get("nodes"), node, rec.get("target"), ref)
    except RunNotFound:
        if inv is None or ref not in getattr(inv, "experiments", {}):
            raise
    exp = inv.experiment(ref)
    nodes = [{"target": t} for t in exp.layout.node_targets()] if exp.kind == "dflash" else []
    return names.session_name(ref), ref, _node_target(nodes, node, exp.target, ref)


def _node_target(nodes: list | None, node: int | None, default: str | None, ref: str) -> str | None:
    """The target of node `node` of a run across targets (None: node 0, i.e. `default`).

    Raises:
        UserError: --node of a run on one target, or a node the run does not have.
    """
    from orchestrator.errors import UserError

    if node is None:
        return default
    if not nodes or not 0 <= node < len(nodes):
        count = len(nodes or []) or 1
        raise UserError(f"{ref} runs on {count} node(s): there is no node {node}",
                        fix=f"dflashctl attach {ref} --node N with N from 0 to {count - 1}")
    return nodes[node]["target"]


def attach_command(inv, ref: str, *, target: str | None = None, read_only: bool = False,
                   node: int | None = None) -> list[str]:
    """`dflashctl attach`: the argv that attaches to the session of run or experiment `ref` on `target`
    (default: the run's, a run across targets: node `node`'s, else the inventory's default). Opens the target
    for its settings and closes it."""
    from orchestrator.target import open_target

    session, _experiment, tname = session_for(ref, inv, node)
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
