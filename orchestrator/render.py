"""Small rich helpers shared by the commands: tables, JSON output, a progress line for agent events.

Commands render typed results from orchestrator.ops with these; nothing here decides anything.
rich is imported lazily so importing this module stays cheap.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

STATUS_STYLE = {"ok": "green", "fail": "bold red", "warn": "yellow", "skip": "dim"}


def console(stderr: bool = False):
    """A rich Console (no syntax highlighting of numbers/paths: output is data)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def print_json(data: Any) -> None:
    """Machine output: one JSON document on stdout (no colour, no wrapping)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], styles: dict[int, str] | None = None):
    """A rich Table with the given columns; `styles` maps a column index to a style."""
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_lines=False)
    for i, col in enumerate(columns):
        t.add_column(col, style=(styles or {}).get(i), overflow="fold")
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row))
    return t


def status_text(status: str) -> str:
    """A check status as rich markup (ok green, fail red, ...)."""
    style = STATUS_STYLE.get(status, "")
    return f"[{style}]{status}[/]" if style else status


class EventPrinter:
    """Renders agent progress events as one line each on stderr (so stdout stays clean for --json).

    Use as the `on_event` callback of `target.agent(...)`.
    """

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._console = console(stderr=True)

    def __call__(self, event: dict) -> None:
        if self.quiet:
            return
        kind = event.get("event")
        if kind == "progress":
            step = event.get("step", "")
            msg = event.get("message", "")
            self._console.print(f"[cyan]{step}[/] {msg}".rstrip(), markup=True)
        elif kind == "log":
            self._console.print(event.get("line", ""), markup=False)
        else:
            extra = {k: v for k, v in event.items() if k != "event"}
            self._console.print(f"[dim]{kind}[/] {json.dumps(extra, default=str)}", markup=True)
