"""`dflashctl logs [RUN|EXPERIMENT] [--target T] [--follow] [--tail N] [--raw] [--json]`. Thin: flags, one
call into orchestrator.ops.logs, printed by orchestrator.commands.following (as `launch --follow` prints)."""

from __future__ import annotations

import typer

from orchestrator.commands import options
from orchestrator.commands.following import follow_and_print

DEFAULT_TAIL = 100
EXIT_CODES_HELP = (
    "Exit codes: 0 the run succeeded (or, without --follow, is still running); 1 it failed (or crashed) "
    "with no known signature; 2 it failed or crashed with a known crash signature; 3 the connection was "
    "lost for good; 4 no such run; 5 it was stopped (dflashctl stop, launch --replace)."
)


def logs_cmd(
    ctx: typer.Context,
    ref: str = typer.Argument(None, metavar="[RUN|EXPERIMENT]",
                              help="A run id, or an experiment name (its newest run). Default: the newest run."),
    target: str = typer.Option(None, "--target", "-t", help="Target holding the run (default: the experiment's, else `local`)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Follow until the run ends (Ctrl-C stops following; the run keeps running)."),
    tail: int = typer.Option(None, "--tail", "-n", show_default=False,
                             help=f"Start at the last N lines (-1: the whole log). Default: {DEFAULT_TAIL}; with "
                             "--follow, after the last line this workstation printed of the run, if it printed any."),
    raw: bool = typer.Option(False, "--raw", help="Only the log lines, exactly as written: no diagnoses, alerts or summary."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line: line, match, alert, status, then outcome."),
) -> None:
    if raw and as_json:
        raise typer.BadParameter("--raw and --json exclude each other")
    inv = options.load(ctx)
    start = DEFAULT_TAIL if tail is None else (None if tail < 0 else tail)
    raise typer.Exit(follow_and_print(inv, ref, target=target, follow=follow, tail=start, raw=raw, as_json=as_json,
                                      resume=follow and tail is None))


def register(app: typer.Typer) -> None:
    app.command("logs", help="Show a run's log, or follow it until the run ends. " + EXIT_CODES_HELP)(logs_cmd)
