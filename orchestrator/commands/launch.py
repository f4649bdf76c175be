"""`dflashctl launch EXPERIMENT [--target T] [--tag TAG] [--replace] [--follow] [--dry-run] [--resume RUN]
[--data-only]`.
Thin: flags, one ops call, render."""

from __future__ import annotations

import shlex
import sys

import typer

from orchestrator.commands import options


def launch_cmd(
    ctx: typer.Context,
    experiment: str = typer.Argument(..., help="Experiment name (key of `experiments:`)."),
    target: str = typer.Option(None, "--target", "-t", help="Run on this target instead of the experiment's."),
    tag: str = typer.Option(None, "--tag", help="Label added to the run id (A-Z a-z 0-9 . _ -)."),
    replace: bool = typer.Option(False, "--replace", help="Stop the experiment's live run first (INT, TERM, KILL)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Follow the log until the run ends."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check and print the plan; change nothing."),
    grace: float = typer.Option(20.0, "--grace", help="Seconds between SIGINT, SIGTERM and SIGKILL for --replace."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (with --follow: JSON lines, "
                                 "the launch's first, then those of `logs --json`)."),
    resume: str = typer.Option(None, "--resume", metavar="RUN",
                               help="Continue this run of the experiment from its last complete checkpoint (a new run)."),
    data_only: bool = typer.Option(False, "--data-only",
                                   help="Run only the data stage (regenerate the training data with the target, in the "
                                   "experiment's data_venv), in the same tmux session and log; no training."),
) -> None:
    """Preflight (GPUs idle, no live session, venv = lock), write runs/<id>/, start it in tmux."""
    from orchestrator.ops.launch import launch_experiment
    from orchestrator.render import EventPrinter

    inv = options.load(ctx)
    # `early`: the connection, and the launch's one agent call, started from the command line (commands.early).
    result = launch_experiment(inv, experiment, target=target, tag=tag, replace=replace, dry_run=dry_run,
                               grace_s=grace, resume=resume, data_only=data_only, on_event=EventPrinter(quiet=as_json),
                               cli=shlex.join(["dflashctl", *sys.argv[1:]]), early=options.options(ctx).early)
    _print(result, as_json=as_json, follow=follow, grace=grace)
    if follow and not dry_run:
        from orchestrator.commands.following import follow_and_print

        # The whole log from its first line, printed exactly as `dflashctl logs RUN --follow` prints it (a run
        # across targets: no target, so that logs follows every node in one stream).
        raise typer.Exit(follow_and_print(inv, result.run_id, target=None if result.across else result.target,
                                          follow=True, tail=None, as_json=as_json))


def _print(result, *, as_json: bool, follow: bool, grace: float) -> None:
    from orchestrator.render import console, print_json, text

    if result.across and not as_json:  # a layout across targets
        out = console()
        out.soft_wrap = True
        what = "plan (dry run, nothing changed)" if result.dry_run else "launched"
        out.print(text((what, "green"), f" {result.run_id} on {len(result.nodes)} nodes"))
        for i, n in enumerate(result.nodes):
            out.print(f"  node {i}: {n.target}  {n.run_dir}  session {n.session}  GPUs {n.gpus or 'CPU'}", markup=False)
        out.print(f"  follow: dflashctl logs {result.run_id} --follow    stop: dflashctl stop {result.run_id}")
        return
    if as_json and follow and not result.dry_run:
        import json  # one JSON line, then those of the follow (as `logs --json` writes them)

        sys.stdout.write(json.dumps({"type": "launch", **result.to_dict()}, default=str) + "\n")
        sys.stdout.flush()
        return
    if as_json:
        print_json(result.to_dict())
        return
    out = console()
    out.soft_wrap = True  # paths and command lines stay whole (copy-pastable)
    result = result.first  # a run on one target
    if result.dry_run:
        _print_plan(out, result, grace)
        return
    out.print(text(("launched", "green"),
                   f" {result.run_id} in tmux session {result.session} on {result.target}"
                   + (f" (replaced {result.replaced})" if result.replaced else "")
                   + (f" (continues {result.resumed_from})" if result.resumed_from else "")))
    out.print(f"  follow: dflashctl logs {result.run_id} --follow    attach: dflashctl attach {result.run_id}")


def _print_plan(out, result, grace: float) -> None:
    from orchestrator.render import text

    plan = result.plan or {}
    out.print(text(("plan", "bold"), f" (dry run, nothing changed) for {result.experiment} on {result.target}"))
    out.print(f"  run id:   {result.run_id}\n  run dir:  {result.run_dir}\n  session:  {result.session}")
    out.print(f"  GPUs:     {result.gpus or 'none (CPU)'}  env: {plan.get('env')}")
    out.print(f"  command:  {shlex.join(result.command)}")
    out.print(f"  tmux:     {shlex.join(plan.get('tmux') or [])}")
    out.print(f"  files:    {', '.join(plan.get('files') or [])}")
    if result.resumed_from:
        out.print(f"  resumes:  {result.resumed_from} (from step {(plan.get('resume') or {}).get('step')})")
    if plan.get("would_stop"):
        out.print(f"  replaces: {plan['would_stop']} (SIGINT, then SIGTERM/SIGKILL after {grace:.0f} s)")


def register(app: typer.Typer) -> None:
    app.command("launch")(launch_cmd)
