"""dflashctl's own lines in a run's train.log, and how a reader tells them from the command's output.

train.log holds the command's stdout and stderr as written, plus a few lines of dflashctl's own: the command
line (written by the launch agent before the session starts) and the start and end lines of
start_training.sh. Each of ours is ONE line beginning with `[dflashctl <mark>] `, where <mark> is a random
token made for the run at launch and kept beside the log (run.json `log_mark`, and `log.mark`, which
start_training.sh reads). The command is not given the mark (it is neither in its environment nor on its
command line), so its output does not produce it by accident.

A reader that knows the run's mark (the follower gets it from the agent's `run` event; `diagnose` reads the
run.json beside the log) skips exactly those lines when matching crash signatures, so nothing written in
them, not even a command-line argument holding a newline and a fake traceback, is taken for the trainer's
crash. Without a known mark (a log copied away from its run directory), a line of our shape counts as ours.

Standard library only: the agent (inside the target) and the workstation both use it.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

MARK_FILE = "log.mark"
RUN_JSON_KEY = "log_mark"
_MARK_RE = re.compile(r"[0-9a-f]{16}")
_SHAPE_RE = re.compile(r"\[dflashctl [0-9a-f]{16}\] ")
_WORD = "[dflashctl "


def new_mark() -> str:
    """A fresh run mark: 16 lower-case hex digits."""
    return secrets.token_hex(8)


def valid_mark(mark: object) -> str | None:
    """`mark` when it is a well-formed mark, else None."""
    return mark if isinstance(mark, str) and _MARK_RE.fullmatch(mark) else None


def prefix(mark: str) -> str:
    """The start of each of our lines for a run with this mark."""
    return f"[dflashctl {mark}] "


def line(mark: str, text: str) -> str:
    """One of our lines, newline included. Line breaks inside `text` are written as `\\n` / `\\r`: a line of
    ours is always exactly one line."""
    flat = text.replace("\r", "\\r").replace("\n", "\\n")
    return prefix(mark) + flat + "\n"


def is_own(text: str, mark: str | None) -> bool:
    """Whether a log line (without its newline) is one of ours: it begins with the run's prefix; with no mark
    known, with any prefix of our shape."""
    if not text.startswith(_WORD):
        return False  # the common case, decided by one comparison
    if mark is not None:
        return text.startswith(prefix(mark))
    return _SHAPE_RE.match(text) is not None


def mark_beside(log_path: str | Path) -> str | None:
    """The mark of the run whose directory holds `log_path` (its run.json, else its log.mark), or None."""
    d = Path(log_path).parent
    try:
        info = json.loads((d / "run.json").read_text(encoding="utf-8"))
        found = valid_mark(info.get(RUN_JSON_KEY)) if isinstance(info, dict) else None
        if found:
            return found
    except (OSError, ValueError):
        pass
    try:
        return valid_mark((d / MARK_FILE).read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None
