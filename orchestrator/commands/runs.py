"""`dflashctl runs [--experiment E] [--json]` and `dflashctl runs diff A B`: the workstation's run records."""

from __future__ import annotations

import typer

def runs_list(
    ctx: typer.Context,
    experiment: str = typer.Option(None, "--experiment", "-e", help="Only this experiment's runs."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """List recorded launches (newest last)."""
    if ctx.invoked_subcommand is not None:
        return
    from orchestrator.ops.runs import list_runs
    from orchestrator.render import console, print_json, stopped_text, table

    recs = list_runs(experiment)
    if as_json:
        print_json(recs)
        return
    console().print(table("runs", ["run", "experiment", "target", "created", "bundle", "stopped"],
                          [(r["run_id"], r.get("experiment"), r.get("target"), r.get("created"), r.get("bundle_hash"),
                            stopped_text(r.get("stopped"))) for r in recs]))


def runs_diff(
    ctx: typer.Context,
    a: str = typer.Argument(..., help="Run A (id, unique prefix, or experiment = its newest run)."),
    b: str = typer.Argument(..., help="Run B."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """What differs between two runs: packages, config keys, bundle hash, GPU/driver, regenerated dataset."""
    from orchestrator.commands import options
    from orchestrator.ops.runs import diff
    from orchestrator.render import console, print_json, table

    d = diff(a, b, inventory=lambda: options.load(ctx))
    if as_json:
        print_json(d.to_dict())
        return
    out = console()
    for note in d.notes:
        console(stderr=True).print(f"note: {note}")
    if d.same:
        out.print(f"{d.a} and {d.b}: no differences in packages, config, bundle, GPUs or dataset")
        return
    for title, rows in (("packages", d.packages), ("config", d.config), ("GPU / driver / interpreter", d.environment),
                        ("dataset (regenerated; key and what it hashes)", d.dataset)):
        if rows:
            out.print(table(title, ["key", d.a, d.b], rows))
    if d.bundle:
        out.print(f"bundle: {d.bundle[0]} -> {d.bundle[1]}")


def register(app: typer.Typer) -> None:
    runs_app = typer.Typer(help="Recorded runs on this workstation; `runs diff A B` says what changed.",
                           no_args_is_help=False, rich_markup_mode=None)
    runs_app.callback(invoke_without_command=True)(runs_list)
    runs_app.command("diff")(runs_diff)
    app.add_typer(runs_app, name="runs")
