"""`dflashctl warmup [EXPERIMENT] [--target T] [--json]`: compile the training shapes on every drafter GPU."""

from __future__ import annotations

import typer

DEFAULT_EXPERIMENT = "tiny"


def register(app: typer.Typer) -> None:
    @app.command("warmup")
    def warmup_cmd(
        experiment: str = typer.Argument(DEFAULT_EXPERIMENT, help="Experiment (kind dflash) to warm up."),
        target: str = typer.Option(None, "--target", "-t", help="Warm up on this target instead of the experiment's."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ) -> None:
        """One warm-up process per drafter GPU, one after another; compile seconds and cache hits per GPU."""
        from orchestrator.cli import GlobalOptions
        from orchestrator.inventory import load_inventory
        from orchestrator.ops.launch import spec_from_inventory
        from orchestrator.ops.warmup import warmup
        from orchestrator.render import EventPrinter, console, print_json, table
        from orchestrator.target import open_target

        inv = load_inventory(GlobalOptions.inventory)
        spec = spec_from_inventory(inv, experiment, target)  # names checked before any connection
        tgt = open_target(inv, spec.target)
        try:
            res = warmup(tgt, spec, on_event=EventPrinter(quiet=as_json))
        finally:
            tgt.close()
        if as_json:
            print_json(res.to_dict())
            return
        rows = [("CPU" if w.get("gpu") is None else w["gpu"], w.get("device"), w.get("compile_s"), w.get("cache_hits"),
                 w.get("cache_misses"), w.get("wall_s")) for w in res.warmups]
        out = console()
        out.print(table(f"warm-up of {res.experiment} on {res.target}",
                        ["GPU", "device", "compile s", "cache hits", "cache misses", "wall s"], rows))
        out.print(f"cache: {res.cache_dir}   files: {res.dir}")
