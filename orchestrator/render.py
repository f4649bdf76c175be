"""Small rich helpers shared by the commands: tables, JSON output, a progress line for agent events.

Commands render typed results from orchestrator.ops with these; nothing here decides anything.
rich is imported lazily so importing this module stays cheap.

Every message and cell is literal text, never rich markup: `[localhost]:2222`, `[rank0]:` and
`filenames=[f]` print as written. The console has markup off; styled parts are `Text` objects built by
`text()`, whose strings are never parsed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

STATUS_STYLE = {"ok": "green", "fail": "bold red", "warn": "yellow", "skip": "dim"}


def console(stderr: bool = False):
    """A rich Console that prints strings literally: no markup, no highlighting of numbers/paths, no line
    breaks of its own (output is data: a command broken at the terminal's width is not pasteable; the terminal
    wraps what is too long for it). Style goes through `text()`."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True, markup=False)


def text(*parts: str | tuple[str, str]):
    """A rich Text from plain strings and (string, style) pairs; no string is parsed as markup."""
    from rich.text import Text

    return Text.assemble(*parts)


def stopped_text(stopped: Any) -> str | None:
    """'by u@h (dflashctl stop) at T' from a run's "stopped" record (exit.json), or None."""
    if not isinstance(stopped, dict):
        return None
    return f"by {stopped.get('by')} ({stopped.get('via')}) at {stopped.get('at')}"


def run_state(state: str, stopped: Any = None) -> str:
    """A run's state as shown: 'stopped by u@h (dflashctl stop) at T', else the state itself."""
    who = stopped_text(stopped) if state == "stopped" else None
    return f"{state} {who}" if who else state


def print_json(data: Any) -> None:
    """Machine output: one JSON document on stdout (no colour, no wrapping)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], styles: dict[int, str] | None = None):
    """A rich Table with the given columns; `styles` maps a column index to a style. Title, headers and
    cells are literal text (a Text cell keeps its own style)."""
    from rich.table import Table
    from rich.text import Text

    def cell(v: Any) -> Text:
        return v if isinstance(v, Text) else Text("" if v is None else str(v))

    t = Table(title=None if title is None else Text(title), title_justify="left", show_lines=False)
    for i, col in enumerate(columns):
        t.add_column(cell(col), style=(styles or {}).get(i), overflow="fold")
    for row in rows:
        t.add_row(*(cell(v) for v in row))
    return t


def status_text(status: str):
    """A check status as styled text (ok green, fail red, ...)."""
    return text((status, STATUS_STYLE.get(status, "")))


class EventPrinter:
    """Renders agent events (orchestrator.agent.events) as one line each on stderr (so stdout stays clean for
    --json): a progress event as `step message`, any other kind as its name and its fields as JSON.

    Use as the `on_event` callback of `target.agent(...)`.
    """

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._console = console(stderr=True)

    def __call__(self, event) -> None:
        from orchestrator.agent.events import Progress

        if self.quiet:
            return
        if isinstance(event, Progress):
            self._console.print(text((event.step, "cyan"), f" {event.message}".rstrip()))
        else:
            extra = {k: v for k, v in event.to_json().items() if k != "event"}
            self._console.print(text((event.KIND, "dim"), " " + json.dumps(extra, default=str)))
