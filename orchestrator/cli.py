"""The `dflashctl` command line: thin. Each verb lives in `orchestrator/commands/<verb>.py`, which parses
its flags, makes one call into `orchestrator.ops`, and renders the typed result with rich.

Heavy modules (paramiko, torch, transformers) are imported lazily inside the command functions, so
`dflashctl --help` answers fast. One error handler at the top: a one-line message with the fix; the
traceback only with `--verbose`.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

# Command modules, each exposing `register(app: typer.Typer) -> None`. Add one line per new verb.
COMMAND_MODULES = [
    "orchestrator.commands.doctor",
    "orchestrator.commands.trust",
    "orchestrator.commands.diagnose",
    "orchestrator.commands.venv",
    "orchestrator.commands.launch",
    "orchestrator.commands.logs",
    "orchestrator.commands.metrics",
    "orchestrator.commands.warmup",
]

app = typer.Typer(
    name="dflashctl",
    help="Train DFlash drafters on Proxmox GPU containers (or locally) from your workstation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class GlobalOptions:
    """Options shared by every command (set by the callback, read by commands)."""

    inventory: str | None = None
    verbose: bool = False


@app.callback()
def _global(
    inventory: str = typer.Option(None, "--inventory", "-i", help="inventory.yaml to use (else $DFLASHCTL_INVENTORY, ./inventory.yaml, the user config dir, the embedded default)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks on errors."),
) -> None:
    GlobalOptions.inventory = inventory
    GlobalOptions.verbose = verbose


def _register_all() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # a verb not built yet: leave it out rather than break the CLI
                continue
            raise
        module.register(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app, map DflashError to its exit code and a readable message."""
    from orchestrator.errors import DflashError

    _register_all()
    try:
        # With standalone_mode=False click turns `raise typer.Exit(n)` into a return value, not an exception.
        rc = app(args=argv, standalone_mode=False)
        return rc if isinstance(rc, int) else 0
    except DflashError as exc:
        from rich.console import Console

        err = Console(stderr=True, highlight=False)
        if GlobalOptions.verbose or os.environ.get("DFLASHCTL_VERBOSE"):
            import traceback

            traceback.print_exc()
        err.print(f"[bold red]error:[/] {exc.message}", markup=True, soft_wrap=True)
        if exc.fix:
            err.print(f"[bold]fix:[/] {exc.fix}", markup=True, soft_wrap=True)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # click usage errors come here with standalone_mode=False
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return exc.exit_code
        raise


def run() -> None:  # pragma: no cover - console script shim
    sys.exit(main())
