"""`dflashctl rebuild-venv [--target T] [--profile P] [--offline] [--force] [--rollback] [--json]`: the target's
venv from its profile's lock."""

from __future__ import annotations

import typer

from orchestrator.commands import options

REBUILD_HELP = """Build the target's venv from its profile's lock in ONE command on the target: a new
venvs/<lock-hash>-<time>/ (uv venv + exact uv pip sync of the lock and this project's bundle), every
top-level module imported (once per exact wheel), a fingerprint written, then `current` switched
atomically. The target needs no pip and no uv: this workstation's uv travels along (into <workdir>/bin/uv),
as do the profile's wheelhouse wheels; a container also gets tmux (apt-get) when it lacks it. Nothing to
do when `current` already matches the lock and the bundle (unless --force). A failure names the step and
the reason and leaves `current` as it was."""


class _Progress:
    """The script's events on stderr: one line per step and uv's lines; on a terminal also a live line with
    the step, its message, and a bar while verifying (elsewhere a live display only leaves blank lines)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.console = None
        self.progress = None

    def __enter__(self):
        if not self.quiet:
            from orchestrator.render import console

            self.console = console(stderr=True)
            if self.console.is_terminal:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

                # markup=False: a step's message is literal text ("[localhost]:2222" stays as written).
                self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False),
                                         BarColumn(), MofNCompleteColumn(), console=self.console, transient=True)
                self.progress.start()
                self.task = self.progress.add_task("rebuild-venv", total=None)
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, event: dict) -> None:
        if self.console is None:
            return
        kind = event.get("event")
        if kind == "progress":
            from orchestrator.render import text

            step, message = str(event.get("step", "")), str(event.get("message", ""))
            desc = f"{step} {message}"
            if event.get("n"):
                if self.progress is not None:
                    self.progress.update(self.task, description=desc, total=event["n"], completed=event.get("i", 0))
            else:
                if self.progress is not None:
                    self.progress.update(self.task, description=desc, total=None)
                self.console.print(text((step, "cyan"), f" {message}"))
        elif kind == "log":
            self.console.print(f"  {event.get('line', '')}", style="dim")


def _print_report(tname: str, pname: str, report, inventory: str | None) -> None:
    """The rebuild-venv report as text (warnings with their fixes on stderr, with the user's -i)."""
    from orchestrator.errors import with_inventory
    from orchestrator.quoting import render
    from orchestrator.render import console

    out = console()
    fp = report.fingerprint or {}
    env = f"python {fp.get('python')}, torch {fp.get('torch')}, CUDA {fp.get('cuda')}" if fp else ""
    for w in report.warnings:
        fix = f"\n  fix: {with_inventory(w['fix'], inventory)}" if w.get("fix") else ""
        console(stderr=True).print(f"warning: {w['message']}{fix}")
    if report.action in ("workstation", "system"):
        what = "the workstation's own interpreter" if report.action == "workstation" else "the target's python3 as is"
        out.print(f"profile {pname!r} is {what}: nothing to build")
    elif report.action == "noop":
        out.print(f"{tname}: venv {report.venv} already matches lock {report.lock_hash} and bundle "
                  f"{report.bundle_hash} ({env}); nothing to do (--force rebuilds)")
    elif report.action == "rollback":
        out.print(f"{tname}: current -> {report.venv} ({env}); was {report.previous}")
    else:
        secs = {k: f"{v / 1000:.1f}s" for k, v in report.timings_ms.items()}
        out.print(f"{tname}: built {report.venv} from lock {report.lock} ({report.lock_hash}) in "
                  f"{report.wall_s:.1f}s ({env})")
        out.print(f"  steps: {', '.join(f'{k} {v}' for k, v in secs.items())}")
        if report.previous:
            back = with_inventory(render(["dflashctl", "rebuild-venv", "--target", tname, "--rollback"]), inventory)
            out.print(f"  previous: {report.previous} ({back})")
        if report.pruned:
            out.print(f"  removed old venvs: {', '.join(report.pruned)}")
        if report.carried:
            out.print(f"  brought along: {', '.join(report.carried)} ({report.carried_bytes / 2**20:.0f} MiB)")
    if report.tmux == "installed":
        out.print(f"{tname}: tmux installed ({report.tmux_via})")


def rebuild_venv_cmd(
    ctx: typer.Context,
    target: str = typer.Option(None, "--target", "-t", help="Target (default: the inventory's default)."),
    profile: str = typer.Option(None, "--profile", "-p", help="Venv profile (default: the target's `venv`)."),
    offline: bool = typer.Option(False, "--offline", help="Use only the uv cache (and local find_links)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if the current venv matches."),
    rollback: bool = typer.Option(False, "--rollback", help="Switch back to the previous venv."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    import dataclasses

    from orchestrator.errors import UserError
    from orchestrator.ops.venv import rebuild
    from orchestrator.render import print_json

    if rollback and (force or offline):
        from orchestrator.quoting import render

        again = ["dflashctl", "rebuild-venv", *(["--target", target] if target else []), "--rollback"]
        raise UserError("--rollback takes no --force or --offline", fix=render(again))
    inv = options.load(ctx)
    with _Progress(quiet=as_json) as view:
        tname, pname, report = rebuild(inv, target, profile, offline=offline, force=force, rollback=rollback,
                                       on_event=view)
    if as_json:
        print_json(dataclasses.asdict(report))
        return
    _print_report(tname, pname, report, options.options(ctx).inventory)


def register(app: typer.Typer) -> None:
    app.command("rebuild-venv", help=REBUILD_HELP)(rebuild_venv_cmd)
