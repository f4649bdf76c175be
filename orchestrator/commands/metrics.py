"""`dflashctl metrics [RUN|EXPERIMENT] [--target T] [--png FILE] [--json]`: draw a run's metrics."""

from __future__ import annotations

import typer

from orchestrator.commands import options


def metrics_cmd(
    ctx: typer.Context,
    ref: str = typer.Argument(None, help="Run id, or an experiment (its newest run). Default: the newest run."),
    target: str = typer.Option(None, "--target", "-t", help="Target the run lives on."),
    png: str = typer.Option(None, "--png", help="Also write the charts to this PNG file (for sharing)."),
    as_json: bool = typer.Option(False, "--json", help="Print the series as JSON instead of charts."),
    width: int = typer.Option(100, "--width", help="Chart width in columns."),
) -> None:
    """Loss, accuracy, simulated τ, tokens/s, memory and recompiles of a run, drawn in the terminal."""
    from orchestrator.ops.metrics import metrics_of, render_terminal, write_png
    from orchestrator.render import console, print_json

    ms = metrics_of(options.load(ctx), ref, target=target)
    if as_json:
        print_json({"run_id": ms.run_id, "total_rows": ms.total_rows, "notes": ms.notes,
                    "series": {k: {"step": xs, "value": ys} for k, (xs, ys) in ms.series.items()}})
    elif not ms.series:
        console().print(f"run {ms.run_id} has no metrics yet")
    else:
        print(render_terminal(ms, width=width))
        for line in ms.notes:
            print(line)
    if png:
        console(stderr=True).print(f"wrote {write_png(ms, png)}")


def register(app: typer.Typer) -> None:
    app.command("metrics")(metrics_cmd)
