"""`dflashctl metrics [RUN|EXPERIMENT] [--target T] [--png FILE] [--json]`: draw a run's metrics."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("metrics")
    def metrics_cmd(
        ref: str = typer.Argument(None, help="Run id, or an experiment (its newest run). Default: the newest run."),
        target: str = typer.Option(None, "--target", "-t", help="Target the run lives on."),
        png: str = typer.Option(None, "--png", help="Also write the charts to this PNG file (for sharing)."),
        as_json: bool = typer.Option(False, "--json", help="Print the series as JSON instead of charts."),
        width: int = typer.Option(100, "--width", help="Chart width in columns."),
    ) -> None:
        """Loss, accuracy, simulated τ, tokens/s, memory and recompiles of a run, drawn in the terminal."""
        from orchestrator.cli import GlobalOptions
        from orchestrator.inventory import load_inventory
        from orchestrator.ops.logs import resolve
        from orchestrator.ops.metrics import fetch_metrics, render_terminal, write_png
        from orchestrator.render import console, print_json
        from orchestrator.target import open_target

        inv = load_inventory(GlobalOptions.inventory)
        target_name, run_id, experiment = resolve(inv, ref, target)
        tgt = open_target(inv, target_name)
        try:
            ms = fetch_metrics(tgt, run_id, experiment=experiment)
        finally:
            tgt.close()
        if as_json:
            print_json({"run_id": ms.run_id, "total_rows": ms.total_rows,
                        "series": {k: {"step": xs, "value": ys} for k, (xs, ys) in ms.series.items()}})
        elif not ms.series:
            console().print(f"run {ms.run_id} has no metrics yet")
        else:
            print(render_terminal(ms, width=width))
        if png:
            console(stderr=True).print(f"wrote {write_png(ms, png)}")
