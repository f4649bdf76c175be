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

    res = stop_run(options.load(ctx), run, target=target, grace_s=grace, on_event=EventPrinter())
    if isinstance(res, list):  # a run across targets: one result per node
        for i, r in enumerate(res):
            console().print(f"node {i}: " + (str(r) if isinstance(r, Exception) else
                            f"run {r.run_id} {run_state(r.state, (r.exit or {}).get('stopped'))}"), soft_wrap=True)
        return
    how = "had already ended: " if res.already_ended else (
        f"stopped with {', '.join(res.signals)}: " if res.signals else  # no signal: nothing was left to get one
        "- the run's processes are gone (container restarted?); marked ")
    console().print(f"run {res.run_id} {how}{run_state(res.state, (res.exit or {}).get('stopped'))}"
                    + (f" (exit code {res.exit.get('exit_code')})" if res.exit else ""), soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("stop")(stop_cmd)
