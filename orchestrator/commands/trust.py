"""`dflashctl trust HOST`: record a host's SSH key in known_hosts after showing its fingerprint."""

from __future__ import annotations

import typer

from orchestrator.commands import options


def trust_cmd(
    ctx: typer.Context,
    host: str = typer.Argument(..., help="Host name from the inventory (`hosts:`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the recorded key as JSON."),
) -> None:
    """Fetch HOST's key, show its fingerprint and add it to known_hosts (a changed key is never replaced)."""
    from orchestrator.ops.trust import trust
    from orchestrator.render import console, print_json

    inv = options.load(ctx)
    result = trust(inv, host)
    if as_json:
        print_json(result)
    else:
        console().print(
            f"trusted {result['host']} ({result['address']}): {result['keytype']} {result['fingerprint']}"
            f" -> {result['known_hosts']}"
        )


def register(app: typer.Typer) -> None:
    app.command("trust")(trust_cmd)
