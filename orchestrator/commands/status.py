"""`dflashctl status [--target T] [--limit N] [--json]`: the container, its GPUs, sessions and runs."""

from __future__ import annotations

import typer

from orchestrator.commands import options


def status_cmd(
    ctx: typer.Context,
    target: str = typer.Option(None, "--target", "-t", help="Target (default: `local`)."),
    limit: int = typer.Option(20, "--limit", help="Newest runs to show (0: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Container state, GPUs (used/total MiB), tmux sessions and runs with their state."""
    from orchestrator.ops.status import status_of

    inv = options.load(ctx)
    # `early`: only a target named on the command line connects (and starts the status call) early
    # (commands.early); the default comes from the validated inventory.
    st = status_of(inv, target or inv.default_target(), limit=limit, early=options.options(ctx).early)
    from orchestrator.render import print_json

    if as_json:
        print_json(st.to_dict())
        return
    _print(st)


def _print(st) -> None:
    from orchestrator.render import console, run_state, table, text

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
    if st.balance:
        out.print(f"run {st.balance_run}:")
        for line in st.balance:
            out.print(f"  {line}")


def register(app: typer.Typer) -> None:
    app.command("status")(status_cmd)
