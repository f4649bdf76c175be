"""`dflashctl warmup [EXPERIMENT] [--target T] [--json]`: compile the training shapes on every drafter GPU."""

from __future__ import annotations

import typer

from orchestrator.commands import options

DEFAULT_EXPERIMENT = "tiny"


def warmup_cmd(
    ctx: typer.Context,
    experiment: str = typer.Argument(DEFAULT_EXPERIMENT, help="Experiment (kind dflash) to warm up."),
    target: str = typer.Option(None, "--target", "-t", help="Warm up on this target instead of the experiment's."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """One warm-up process per drafter GPU, one after another; compile seconds and cache hits per GPU."""
    from orchestrator.ops.warmup import warmup_experiment
    from orchestrator.render import EventPrinter

    # `early`: the connection started from the command line while the inventory is validated (commands.early).
    res = warmup_experiment(options.load(ctx), experiment, target=target, on_event=EventPrinter(quiet=as_json),
                            early=options.options(ctx).early)
    from orchestrator.render import console, print_json, table

    if as_json:
        print_json(res.to_dict())
        return
    rows = [("CPU" if w.get("gpu") is None else w["gpu"], w.get("device"), w.get("compile_s"), w.get("cache_hits"),
             w.get("cache_misses"), w.get("wall_s")) for w in res.warmups]
    out = console()
    out.print(table(f"warm-up of {res.experiment} on {res.target}",
                    ["GPU", "device", "compile s", "cache hits", "cache misses", "wall s"], rows))
    out.print(f"cache: {res.cache_dir}   files: {res.dir}")


def register(app: typer.Typer) -> None:
    app.command("warmup")(warmup_cmd)
