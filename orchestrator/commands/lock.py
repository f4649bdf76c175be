"""`dflashctl lock [PROFILE] [--upgrade-package P] [--find-links D] [--index-url U] [--extra-index-url U]`:
the locks the venvs are built from, regenerated into templates/locks/."""

from __future__ import annotations

import typer

LOCK_HELP = """Regenerate templates/locks/PROFILE.txt (all profiles when none is given) with
`uv pip compile --generate-hashes` from PROFILE.in, keeping existing pins unless --upgrade-package
names a package."""


def lock_cmd(
    profile: str = typer.Argument(None, help="Lock profile (cpu, cuda, test); default: all."),
    upgrade_package: list[str] = typer.Option([], "--upgrade-package", "-P", help="Allow this package to upgrade."),
    find_links: list[str] = typer.Option([], "--find-links", help="Directory or URL with wheels (e.g. torch CPU)."),
    index_url: str = typer.Option(None, "--index-url", help="Replace PyPI."),
    extra_index_url: list[str] = typer.Option([], "--extra-index-url", help="An extra index."),
) -> None:
    from orchestrator import assets
    from orchestrator.ops.lock import compile_lock
    from orchestrator.render import console

    out = console()
    err = console(stderr=True)
    profiles = [profile] if profile else sorted(p.stem for p in assets.locks_dir().glob("*.in"))
    for name in profiles:
        rep = compile_lock(name, upgrade_packages=upgrade_package, find_links=find_links, index_url=index_url,
                           extra_index_urls=extra_index_url, on_line=lambda line: err.print(line, style="dim"))
        what = "unchanged" if rep.unchanged else f"{rep.old_hash} -> {rep.hash}" if rep.old_hash else f"new {rep.hash}"
        out.print(f"{name}: {rep.packages} packages, {what} ({rep.path})")
        for pkg, (old, new) in rep.changed.items():
            out.print(f"  {pkg}: {old or '(new)'} -> {new or '(removed)'}")


def register(app: typer.Typer) -> None:
    app.command("lock", help=LOCK_HELP)(lock_cmd)
