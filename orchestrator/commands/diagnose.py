"""`dflashctl diagnose LOGFILE [--json]`: the crash-signature matcher over a log file, offline."""

from __future__ import annotations

import typer

from orchestrator.commands import options

HELP = """Name the known failure in a log file: a table of matched signatures (count, first line, title) and
the diagnosis, fix and tempting-but-useless fixes of the most severe one. The catalogue is
templates/signatures.yaml plus the inventory's `signatures:`.

Exit codes: 0 nothing matched; 1 only error/warning signatures matched (e.g. NaN loss, a recompile
limit, an unknown traceback); 2 a fatal signature matched (the run died of a known cause)."""


def diagnose_cmd(
    ctx: typer.Context,
    logfile: str = typer.Argument(..., help="The log file (e.g. runs/<run-id>/train.log)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    from orchestrator.ops.diagnose import catalogue_for, diagnose
    from orchestrator.render import console, print_json, table, text

    report = diagnose(logfile, catalogue_for(options.options(ctx).inventory))
    if as_json:
        print_json(report.to_dict())
        raise typer.Exit(report.exit_code)
    out = console()
    if not report.signatures:
        out.print(f"no known signature in {report.path} ({report.lines} lines)")
        raise typer.Exit(0)
    rows = [(s.id, s.severity, s.count, s.first_line, s.title) for s in report.signatures]
    out.print(table(f"diagnose: {report.path} ({report.lines} lines)",
                    ["signature", "severity", "count", "first line", "title"], rows))
    worst = report.worst
    example = worst.examples[0]
    out.soft_wrap = True  # the diagnosis and fix stay whole lines (copy-pastable); the terminal wraps them
    out.print(text("\n", (worst.title, "bold"), f"  (line {worst.first_line})"))
    if example.kind == "traceback":
        out.print(f"  exception: {example.exception}")
        if example.last_frame:
            f = example.last_frame
            out.print(f"  last frame: {f.file}:{f.line} in {f.function}")
    else:
        out.print(f"  line: {example.text.strip()}")
    out.print(text(("diagnosis:", "bold"), f" {worst.diagnosis}"))
    out.print(text(("fix:", "bold"), f" {worst.fix}"))
    if worst.not_this:
        out.print(text(("will not help:", "bold")))
        for item in worst.not_this:
            out.print(f"  - {item}")
    raise typer.Exit(report.exit_code)


def register(app: typer.Typer) -> None:
    app.command("diagnose", help=HELP)(diagnose_cmd)
