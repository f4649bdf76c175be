"""The `dflashctl` command line: thin. Each verb lives in `orchestrator/commands/<verb>.py`, which parses
its flags, makes one call into `orchestrator.ops`, and renders the typed result with rich; every module is
imported and registered explicitly below. The global options travel in typer's context object
(orchestrator.commands.options), made fresh by `main` for each invocation.

Heavy modules (paramiko, torch, transformers) are imported lazily inside the command functions, so
`dflashctl --help` answers fast. One error handler at the top: a one-line message with the fix; the
traceback only with `--verbose`. Usage errors are click's own exceptions (its message and suggestion),
printed as one line with exit 2.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from orchestrator.commands import (
    attach,
    diagnose,
    doctor,
    early,
    launch,
    lock,
    logs,
    metrics,
    rebuild_venv,
    runs,
    status,
    stop,
    trust,
    warmup,
)
from orchestrator.commands.options import Options

app = typer.Typer(
    name="dflashctl",
    help="Train DFlash drafters on Proxmox GPU containers (or locally) from your workstation.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: rich's help formatter costs more start-up than the rest of `--help`, and every text
    # stays literal (no markup in docstrings to interpret).
    rich_markup_mode=None,
)


@app.callback()
def _global(
    ctx: typer.Context,
    inventory: str = typer.Option(None, "--inventory", "-i", help="inventory.yaml to use (else $DFLASHCTL_INVENTORY, ./inventory.yaml, the user config dir, the embedded default)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks on errors."),
) -> None:
    opts = ctx.ensure_object(Options)
    opts.inventory = inventory
    opts.verbose = verbose


# Every verb, registered explicitly: a missing verb module is an ImportError here, never a silent gap.
for _module in (doctor, trust, diagnose, rebuild_venv, lock, launch, status, stop, attach, logs, metrics, warmup, runs):
    _module.register(app)


def _click_exceptions():
    """The exceptions module of the click that typer runs on: newer typer releases carry their own copy
    (`typer._click`), older ones use the click package. typer.BadParameter comes from it either way."""
    return importlib.import_module(typer.BadParameter.__module__)


def _usage_error(exc) -> int:
    """Print a click usage error as one line, `error: <click's message> (see: <command> --help)`, on stderr.

    click's own message keeps its suggestion ("Did you mean 'launch'?"). Bare `dflashctl` (no_args_is_help)
    is shown by click's own handler: the help text.
    """
    from orchestrator.render import console, text

    errors = _click_exceptions()
    if isinstance(exc, getattr(errors, "NoArgsIsHelpError", ())):
        if exc.format_message():  # typer's rich help has printed itself already; click's plain one has not
            exc.show()
        return exc.exit_code
    ctx = getattr(exc, "ctx", None)
    hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
    console(stderr=True).print(text(("error:", "bold red"), f" {exc.format_message()}{hint}"), soft_wrap=True)
    return exc.exit_code


def main(argv: list[str] | None = None, started: tuple | None = None) -> int:
    """Entry point: run the app; map DflashError to its exit code and a readable message, a usage error to
    one line and exit 2.

    Args:
        argv: the command line after the program name (default: sys.argv's).
        started: `(the early connection or None)` when the console script has read the command line already,
            against the grammar the state dir keeps (orchestrator.entry); None: it is read here, against the
            click command, and its grammar kept for the next console script (orchestrator.commands.early).
    """
    from orchestrator.errors import DflashError

    import typer.main

    argv = sys.argv[1:] if argv is None else list(argv)
    opts = Options()  # this invocation's; the callback fills it, the error handler reads --verbose from it
    if started is not None:
        opts.early = started[0]
    command = typer.main.get_command(app)  # what `app(...)` builds and runs; built once here
    try:
        if started is None:
            # A verb that reaches a container starts connecting now, before typer's parse.
            grammar = early.grammar(command)
            early.remember(grammar)
            opts.early = early.start(grammar, argv)
        # With standalone_mode=False click turns `raise typer.Exit(n)` into a return value, not an exception.
        rc = command.main(args=argv, prog_name="dflashctl", standalone_mode=False, obj=opts)
        return rc if isinstance(rc, int) else 0
    except DflashError as exc:
        return _dflash_error(exc, opts.verbose, opts.inventory)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except _click_exceptions().ClickException as exc:  # usage errors come here with standalone_mode=False
        return _usage_error(exc)
    finally:
        if opts.early is not None:  # a connection no verb took (the command failed first) is closed here
            opts.early.close()


def _dflash_error(exc, verbose: bool = False, inventory: str | None = None) -> int:
    """Print a DflashError as `error: ...` and `fix: ...` (literal text, never markup); the traceback only
    with --verbose or $DFLASHCTL_VERBOSE. A `dflashctl` command in the fix gets the `-i` the user gave."""
    from orchestrator.errors import with_inventory
    from orchestrator.render import console, text

    if verbose or os.environ.get("DFLASHCTL_VERBOSE"):
        import traceback

        traceback.print_exc()
    err = console(stderr=True)
    err.print(text(("error:", "bold red"), f" {exc.message}"), soft_wrap=True)
    if exc.fix:
        err.print(text(("fix:", "bold"), f" {with_inventory(exc.fix, inventory)}"), soft_wrap=True)
    return exc.exit_code


def run(argv: list[str] | None = None, started: tuple | None = None) -> None:
    """The console script's end (orchestrator.entry): main, then the streams flushed and the process ended at
    once. Everything a command writes is closed by then (records and caches are written atomically, connections
    closed in `finally`), so the interpreter's own teardown of every imported module (~0.05 s) buys nothing. A
    stream that cannot be flushed (a closed pipe: `dflashctl runs | head -1`) ends the process with 120, as
    Python's own exit would."""
    rc = main(argv, started)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        rc = 120
    os._exit(rc)
