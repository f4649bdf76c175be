"""`launch`, `status`, `stop`, `attach`, `runs`: the run lifecycle verbs. Thin: flags, one ops call, render."""

from __future__ import annotations

import shlex
import sys

import typer

runs_app = typer.Typer(help="Recorded runs on this workstation; `runs diff A B` says what changed.", no_args_is_help=False,
                       rich_markup_mode=None)


def _inv():
    from orchestrator.cli import GlobalOptions
    from orchestrator.inventory import load_inventory

    return load_inventory(GlobalOptions.inventory)


def register(app: typer.Typer) -> None:
    @app.command("launch")
    def launch_cmd(
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
    ) -> None:
        """Preflight (GPUs idle, no live session, venv = lock), write runs/<id>/, start it in tmux."""
        from orchestrator import preconnect
        from orchestrator.cli import GlobalOptions

        early = preconnect.start(GlobalOptions.inventory, target, experiment)  # while the inventory is validated
        try:
            from orchestrator.ops.launch import launch, spec_from_inventory
            from orchestrator.target import open_target

            inv = _inv()
            spec = spec_from_inventory(inv, experiment, target, tag)  # names checked before any command runs
            tgt = open_target(inv, spec.target, early)
            try:
                from orchestrator.render import EventPrinter

                result = launch(tgt, spec, replace=replace, dry_run=dry_run, grace_s=grace, resume=resume,
                                on_event=EventPrinter(quiet=as_json), cli=shlex.join(["dflashctl", *sys.argv[1:]]))
            finally:
                tgt.close()
        finally:
            if early is not None:
                early.close()
        from orchestrator.render import console, print_json, text

        if as_json and follow and not dry_run:
            import json  # one JSON line, then those of the follow (as `logs --json` writes them)

            sys.stdout.write(json.dumps({"type": "launch", **result.to_dict()}, default=str) + "\n")
            sys.stdout.flush()
        elif as_json:
            print_json(result.to_dict())
        else:
            out = console()
            out.soft_wrap = True  # paths and command lines stay whole (copy-pastable)
            if result.dry_run:
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
            else:
                out.print(text(("launched", "green"),
                               f" {result.run_id} in tmux session {result.session} on {result.target}"
                               + (f" (replaced {result.replaced})" if result.replaced else "")
                               + (f" (continues {result.resumed_from})" if result.resumed_from else "")))
                out.print(f"  follow: dflashctl logs {result.run_id} --follow    attach: dflashctl attach {result.run_id}")
        if follow and not dry_run:
            from orchestrator.commands.logs import follow_and_print

            # The whole log from its first line, printed exactly as `dflashctl logs RUN --follow` prints it.
            raise typer.Exit(follow_and_print(inv, result.run_id, target=result.target, follow=True, tail=None,
                                              as_json=as_json))

    @app.command("status")
    def status_cmd(
        target: str = typer.Option(None, "--target", "-t", help="Target (default: `local`)."),
        limit: int = typer.Option(20, "--limit", help="Newest runs to show (0: all)."),
        as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
    ) -> None:
        """Container state, GPUs (used/total MiB), tmux sessions and runs with their state."""
        from orchestrator.ops.status import status
        from orchestrator.render import console, print_json, run_state, table, text
        from orchestrator.target import open_target

        inv = _inv()
        tgt = open_target(inv, target or inv.default_target())
        try:
            st = status(tgt, limit=limit)
        finally:
            tgt.close()
        if as_json:
            print_json(st.to_dict())
            return
        out = console()
        out.print(text((st.target, "bold"), f": {st.state}" + (f" ({st.hostname})" if st.hostname else "")
                       + (f"  workdir {st.workdir}" if st.workdir else "")))
        if st.note:
            out.print(f"  {st.note}")
        if st.gpus:
            out.print(table("GPUs", ["index", "used MiB", "total MiB", "uuid"],
                            [(g["index"], g["used_mib"], g["total_mib"], g["uuid"]) for g in st.gpus]))
        elif st.gpu_reason:
            out.print(f"  GPUs: none ({st.gpu_reason})")
        if st.sessions:
            out.print(table("sessions", ["session", "run", "pane"],
                            [(s["name"], s.get("run_id"), f"dead ({s.get('dead_status')})" if s["dead"] else "alive")
                             for s in st.sessions]))
        rows = [(r["run_id"], run_state(r["state"], r.get("stopped")), r.get("exit_code"), r.get("signal"), r.get("duration_s"),
                 None if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.1f}")
                for r in st.runs]
        out.print(table(f"runs ({len(st.runs)} of {st.total_runs})",
                        ["run", "state", "exit", "signal", "seconds", "tokens/s"], rows))

    @app.command("stop")
    def stop_cmd(
        run: str = typer.Argument(..., help="Run id (or an experiment: its newest recorded run)."),
        target: str = typer.Option(None, "--target", "-t", help="Target (default: the run's, from the records)."),
        grace: float = typer.Option(20.0, "--grace", help="Seconds between SIGINT, SIGTERM and SIGKILL."),
    ) -> None:
        """Stop a run gracefully: SIGINT, then SIGTERM after --grace, then SIGKILL; wait for its GPUs."""
        from orchestrator.errors import RunNotFound
        from orchestrator.ops.stop import stop
        from orchestrator.records import find_record
        from orchestrator.render import EventPrinter, console, run_state
        from orchestrator.target import open_target

        inv = _inv()
        try:
            rec = find_record(run)
        except RunNotFound:
            rec = {"run_id": run, "target": target}
        tname = target or rec.get("target") or inv.default_target()
        tgt = open_target(inv, tname)
        try:
            res = stop(tgt, rec["run_id"], grace_s=grace, gpus=rec.get("gpus") or [],
                       gpu_idle_mib=getattr(inv.target(tname), "gpu_idle_mib", 1024), on_event=EventPrinter())
        finally:
            tgt.close()
        how = "had already ended" if res.already_ended else f"stopped with {', '.join(res.signals)}"
        console().print(f"run {res.run_id} {how}: {run_state(res.state, (res.exit or {}).get('stopped'))}"
                        + (f" (exit code {res.exit.get('exit_code')})" if res.exit else ""), soft_wrap=True)

    @app.command("attach")
    def attach_cmd(
        run: str = typer.Argument(..., help="Run id or experiment name."),
        read_only: bool = typer.Option(False, "--read-only", "-r", help="Attach read-only (keys do nothing)."),
        target: str = typer.Option(None, "--target", "-t", help="Target (default: the run's)."),
    ) -> None:
        """Attach your terminal to the run's tmux session (detach: Ctrl-b d; the run keeps going)."""
        from orchestrator.ops.attach import attach_argv, exec_attach, session_for
        from orchestrator.target import open_target

        inv = _inv()
        session, _exp, tname = session_for(run, inv)
        tgt = open_target(inv, target or tname or inv.default_target())
        argv = attach_argv(tgt, session, read_only)
        tgt.close()
        exec_attach(argv)

    @runs_app.callback(invoke_without_command=True)
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

    @runs_app.command("diff")
    def runs_diff(
        a: str = typer.Argument(..., help="Run A (id, unique prefix, or experiment = its newest run)."),
        b: str = typer.Argument(..., help="Run B."),
        as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
    ) -> None:
        """What differs between two runs: packages, config keys, bundle hash, GPU/driver."""
        from orchestrator.ops.runs import diff
        from orchestrator.render import console, print_json, table

        d = diff(a, b)
        if as_json:
            print_json(d.to_dict())
            return
        out = console()
        if d.same:
            out.print(f"{d.a} and {d.b}: no differences in packages, config, bundle or GPUs")
            return
        for title, rows in (("packages", d.packages), ("config", d.config), ("GPU / driver / interpreter", d.environment)):
            if rows:
                out.print(table(title, ["key", d.a, d.b], rows))
        if d.bundle:
            out.print(f"bundle: {d.bundle[0]} -> {d.bundle[1]}")

    app.add_typer(runs_app, name="runs")
