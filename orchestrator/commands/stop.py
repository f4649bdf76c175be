"""`dflashctl stop RUN [--target T] [--grace S]`: end a run gracefully and wait for its GPUs."""

from __future__ import annotations

import typer

from orchestrator.commands import options


def stop_cmd(
    ctx: typer.Context,
    run: str = typer.Argument(..., help="Run id (or an experiment: its newest recorded run)."),
    target: str = typer.Option(None, "--target", "-t", help="Target (default: the run's, from the records)."),
    grace: float = typer.Option(20.0, "--grace", help="Seconds between SIGINT, SIGTERM and SIGKILL."),
) -> None:
    """Stop a run gracefully: SIGINT, then SIGTERM after --grace, then SIGKILL; wait for its GPUs."""
    from orchestrator.ops.stop import stop_run
    from orchestrator.render import EventPrinter, console, run_state

    done = stop_run(options.load(ctx), run, target=target, grace_s=grace, on_event=EventPrinter())
    for node in done.nodes:
        prefix = f"node {node.placement.node}: " if done.across else ""
        if node.error is not None:
            console().print(f"{prefix}{node.error}", soft_wrap=True)
        elif done.across:
            r = node.result
            console().print(f"{prefix}run {r.run_id} {run_state(r.state, (r.exit or {}).get('stopped'))}",
                            soft_wrap=True)
        else:
            console().print(stopped_line(node.result), soft_wrap=True)


def stopped_line(res) -> str:
    """What one stop did: `run R stopped with SIGINT: stopped by ...`, `run R had already ended: failed`, ..."""
    from orchestrator.render import run_state

    how = "had already ended: " if res.already_ended else (
        f"stopped with {', '.join(res.signals)}: " if res.signals else  # no signal: nothing was left to get one
        "- the run's processes are gone (container restarted?); marked ")
    return (f"run {res.run_id} {how}{run_state(res.state, (res.exit or {}).get('stopped'))}"
            + (f" (exit code {res.exit.get('exit_code')})" if res.exit else ""))


def register(app: typer.Typer) -> None:
    app.command("stop")(stop_cmd)
