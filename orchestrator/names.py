"""The one rule for every name that reaches a shell, a path or tmux: hosts, targets, venv profiles, lock
profiles, experiments, tags, run ids, tmux sessions. Standard library only: the agent imports it inside the
container, from the bundle.

A name is 1-64 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit, with no `..` (so never a
slash, a newline, a shell metacharacter or a parent directory). A run id is built from names
(`<experiment>[-<tag>]-<YYYYmmddTHHMMSSZ>[-N]`), so its limit is the sum of its parts: every run id that
launch can make is one that logs, stop, attach, status, runs and `runs diff` accept.
"""

from __future__ import annotations

import datetime as _dt
import functools
import re
from collections.abc import Iterable

NAME_MAX = 64
_FIRST, _REST = "[A-Za-z0-9]", "[A-Za-z0-9._-]"  # the rule's characters (RULE says it in words)
_CHARS = re.compile(f"{_FIRST}{_REST}*")
_STAMP = "%Y%m%dT%H%M%SZ"
STAMP_LEN = len("20260101T000000Z")
CLASH_MAX = 99
"""runs/<id> clashes (same experiment, tag and second) get -2 ... -99 (agent.rundirs.free_run_id, make_run_dir)."""
RUN_ID_MAX = NAME_MAX + 1 + NAME_MAX + 1 + STAMP_LEN + len(f"-{CLASH_MAX}")
SESSION_PREFIX = "dflash-"
RULE = "A-Z a-z 0-9 . _ -, starting with a letter or digit, no '..'"


class BadName(ValueError):
    """A name breaks the rule. `message` says which and why, `fix` what to do (the caller picks the
    error type it raises: UserError on the workstation, AgentFailure in the agent)."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message = message
        self.fix = fix


def is_valid(value: object, limit: int = NAME_MAX) -> bool:
    """True when `value` is a str of 1-`limit` allowed characters, starting with a letter or digit, no `..`.

    fullmatch, not match with `$`: `$` also matches before a final newline, so "abc\\n" would pass.
    """
    return (isinstance(value, str) and len(value) <= limit and _CHARS.fullmatch(value) is not None
            and ".." not in value)


def all_valid(values: Iterable[object], limit: int = NAME_MAX) -> bool:
    """is_valid(v, limit) for every value, in one pass of the rule's pattern over the values joined by line
    breaks (a 10 MB inventory has ~80,000 names: one call each is 0.05 s, this is a few ms). No name holds
    a line break, so a value with one fails here as it fails is_valid."""
    values = list(values)
    if not values:
        return True
    try:
        joined = "\n".join(values)  # type: ignore[arg-type] - a value that is not a str: TypeError
    except TypeError:
        return False
    return ".." not in joined and _lines_pattern(limit).fullmatch(joined) is not None


@functools.lru_cache(maxsize=8)
def _lines_pattern(limit: int) -> re.Pattern:
    """_CHARS with at most `limit` characters, once per line, for whole texts of lines."""
    one = f"{_FIRST}{_REST}{{0,{limit - 1}}}" if limit > 0 else "(?!)"
    return re.compile(f"{one}(?:\n{one})*")


def check(kind: str, value: str, limit: int = NAME_MAX) -> str:
    """Return `value` if it is a valid `kind` name (experiment, target, tag, host, ...).

    Raises:
        BadName: empty, too long, `..`, or a character outside the rule.
    """
    if not is_valid(value, limit):
        raise BadName(f"bad {kind} name {value!r}: use 1-{limit} characters from {RULE}",
                      fix=f"choose another {kind} name, e.g. 'exp-1' or 'run_2'")
    return value


def check_run_id(value: str, kind: str = "run id") -> str:
    """Return `value` if it can be a run id (or a run reference: a run id, its prefix, or an experiment).

    Raises:
        BadName: it breaks the rule or is longer than RUN_ID_MAX.
    """
    if not is_valid(value, RUN_ID_MAX):
        raise BadName(f"bad {kind} {value!r}: use 1-{RUN_ID_MAX} characters from {RULE}",
                      fix="copy the run id from `dflashctl runs` or `dflashctl status`")
    return value


def run_id(experiment: str, tag: str | None, now: _dt.datetime | None = None) -> str:
    """`<experiment>[-<tag>]-<YYYYmmddTHHMMSSZ>` (UTC) from checked names.

    Raises:
        BadName: the experiment or tag breaks the rule.
    """
    check("experiment", experiment)
    if tag is not None:
        check("tag", tag)
    now = now or _dt.datetime.now(_dt.timezone.utc)
    stamp = now.astimezone(_dt.timezone.utc).strftime(_STAMP)
    return "-".join(p for p in (experiment, tag, stamp) if p)


def clash_variant(run_id_: str, n: int) -> str:
    """The n-th name tried for a run directory (1: the run id itself, else `<run id>-<n>`, n <= CLASH_MAX)."""
    if not 1 <= n <= CLASH_MAX:
        raise ValueError(f"clash number {n} outside 1..{CLASH_MAX}")
    return run_id_ if n == 1 else f"{run_id_}-{n}"


def session_name(experiment: str) -> str:
    """The tmux session of an experiment's runs: `dflash-<experiment>` with each `.` as `_`.

    tmux itself turns `.` and `:` in a new session's name into `_` (they separate window and pane in a
    target), so the name we look up must be the one tmux made. Two experiments that differ only in `.`
    versus `_` share a session: the second launch is refused while the first runs, never confused with it.
    """
    check("experiment", experiment)
    return SESSION_PREFIX + experiment.replace(".", "_")


def is_ssh_word(value: str) -> bool:
    """True when `value` can stand as an ssh destination or user: not empty, no leading '-' (ssh would read
    an option), no whitespace or control character."""
    return bool(value) and not value.startswith("-") and value.isprintable() and not any(c.isspace() for c in value)
