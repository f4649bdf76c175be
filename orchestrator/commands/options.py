"""The global options (`--inventory`, `--verbose`), carried in typer's context object.

`dflashctl`'s callback fills the Options that `orchestrator.cli.main` made for this one invocation; a verb
reads them from its context. Nothing here is module state: two invocations in one process (tests) never
see each other's options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer


@dataclass
class Options:
    """Options shared by every verb (set by the callback, read by verbs and by main's error handler)."""

    inventory: str | None = None
    verbose: bool = False
    early: Any = None
    """The connection `main` started from the command line (orchestrator.commands.early), or None; main closes it."""


def options(ctx: typer.Context) -> Options:
    """The invocation's Options (a default one when the app runs without main, e.g. typer's test runner)."""
    root = ctx.find_root()
    if not isinstance(root.obj, Options):
        root.obj = Options()
    return root.obj


def load(ctx: typer.Context):
    """The inventory named by `--inventory` (else the lookup order): orchestrator.inventory.load_inventory."""
    from orchestrator.inventory import load_inventory

    return load_inventory(options(ctx).inventory)
