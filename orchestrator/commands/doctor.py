"""`dflashctl doctor [--target T] [--json]`: can this target train? Exit 1 if any check fails."""

from __future__ import annotations

import typer

from orchestrator.commands import options


def doctor_cmd(
    ctx: typer.Context,
    target: str = typer.Option(None, "--target", "-t", help="Target to check (default: `local`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check ssh, host key, pct, the container, GPUs, python3, tmux, uv, disk and caches; print fixes."""
    from orchestrator.errors import with_inventory
    from orchestrator.ops.doctor import doctor
    from orchestrator.render import console, print_json, status_text, table, text

    inv = options.load(ctx)
    report = doctor(inv, target or inv.default_target())
    if as_json:
        print_json(report.to_dict())
    else:
        rows = [(c.name, status_text(c.status), c.detail) for c in report.checks]
        out = console()
        out.print(table(f"doctor: {report.target} ({report.kind}, {inv.source})", ["check", "status", "detail"], rows))
        # Fixes below the table, one line each: a table cell would wrap a command at the terminal's width, and a
        # command is only pasteable as one line.
        for c in report.checks:
            if c.fix:
                out.print(f"fix for {c.name}: {with_inventory(c.fix, options.options(ctx).inventory)}")
        out.print(text(("all checks passed", "green")) if report.ok else text(("some checks failed", "bold red")))
    if not report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_cmd)
