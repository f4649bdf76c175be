"""`dflashctl attach RUN [--read-only] [--target T] [--node N]`: your terminal in the run's tmux session."""

from __future__ import annotations

import typer

from orchestrator.commands import options


def attach_cmd(
    ctx: typer.Context,
    run: str = typer.Argument(..., help="Run id or experiment name."),
    read_only: bool = typer.Option(False, "--read-only", "-r", help="Attach read-only (keys do nothing)."),
    target: str = typer.Option(None, "--target", "-t", help="Target (default: the run's)."),
    node: int = typer.Option(None, "--node", "-n", help="A run across targets: attach to node N's session."),
) -> None:
    """Attach your terminal to the run's tmux session (detach: Ctrl-b d; the run keeps going)."""
    from orchestrator.ops.attach import attach_command, exec_attach

    exec_attach(attach_command(options.load(ctx), run, target=target, read_only=read_only, node=node))


def register(app: typer.Typer) -> None:
    app.command("attach")(attach_cmd)
