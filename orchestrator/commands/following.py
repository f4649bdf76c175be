"""The one follow of `dflashctl logs` and `launch --follow`, printed the same way whichever verb started it: log
lines on stdout; signature diagnoses, health alerts, notes and the outcome line on stderr (or all as JSON lines).
A helper of the two commands, not a verb of its own."""

from __future__ import annotations

import json
import sys


def _write(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _json(kind: str, data) -> None:
    _write(json.dumps({"type": kind, **data} if isinstance(data, dict) else {"type": kind, "value": data},
                      default=str))


def _print_match(err, m: dict) -> None:
    from orchestrator.render import text

    sev = m.get("severity") or "error"
    style = "bold red" if sev in ("error", "fatal") else "yellow"
    err.print(text((f"{sev}: {m.get('title')}", style), " ",
                   (f"({m.get('signature')}, log line {m.get('line_no')})", "dim")), soft_wrap=True)
    if m.get("exception"):
        err.print(f"  exception: {m['exception']}", soft_wrap=True)
    frame = m.get("last_frame")
    if frame:
        err.print(f"  last frame: {frame.get('file')}:{frame.get('line')} in {frame.get('function')}", soft_wrap=True)
    for label in ("diagnosis", "fix"):
        if m.get(label):
            err.print(f"  {label}: {m[label]}", soft_wrap=True)
    for wrong in m.get("not_this") or ():
        err.print(f"  will not help: {wrong}", soft_wrap=True)


def _hooks(err, raw: bool, as_json: bool) -> dict:
    """The follow's callbacks: JSON lines, or log lines on stdout with diagnoses, alerts and notes on stderr
    (--raw: the log lines only). Every text is literal (rich Text, never markup)."""
    from orchestrator.render import text

    if as_json:
        return dict(on_line=lambda line: _json("line", {"text": line}),
                    on_match=lambda m: _json("match", m),
                    on_alert=lambda a: _json("alert", a.to_dict() if hasattr(a, "to_dict") else a),
                    on_status=lambda s: _json("status", {"message": s}))
    if raw:
        return dict(on_line=_write)
    return dict(on_line=_write,
                on_match=lambda m: _print_match(err, m),
                on_alert=lambda a: err.print(text((f"alert ({a.kind}):", "bold yellow"), f" {a.message}"),
                                             soft_wrap=True),
                on_status=lambda s: err.print(text((str(s), "dim"))))


def outcome_line(outcome) -> str:
    """'run R: failed (exit code 3)', 'run R: stopped by u@h (dflashctl stop) at T (exit code 130)', ...; a run
    that ended on a full file system says so: 'run R: failed (exit code 1): its file system is full (/w/runs/R:
    12 KiB free of 2.0 MiB)'."""
    code = (outcome.exit or {}).get("exit_code")
    detail = f" (exit code {code})" if code is not None else ""
    if outcome.state == "lost":
        detail = f": {outcome.error}"
    full = outcome.disk_full
    if full:
        detail += (f": its file system is full ({full['path']}: {_size(full['free_bytes'])} free of "
                   f"{_size(full['total_bytes'])}); free space there, then relaunch")
    from orchestrator.render import run_state

    return f"run {outcome.run_id}: {run_state(outcome.state, (outcome.exit or {}).get('stopped'))}{detail}"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def follow_and_print(inv, ref: str | None, *, target: str | None, follow: bool, tail: int | None,
                     raw: bool = False, as_json: bool = False, resume: bool = False) -> int:
    """Show or follow a run and print it all: the ONE follow of `logs` and `launch --follow` (the same
    lines, alerts, signature diagnoses and outcome line, whichever verb started it).

    `resume`: start after the last line this workstation printed of the run, where that is known.

    Returns:
        The exit code (EXIT_CODES_HELP); 130 when Ctrl-C stopped the following (the run keeps running).
    """
    from orchestrator.ops.logs import logs
    from orchestrator.render import console

    err = console(stderr=True)
    try:
        outcome = logs(inv, ref, target=target, following=follow, tail=tail, resume=resume,
                       **_hooks(err, raw, as_json))
    except KeyboardInterrupt:
        if not as_json:
            err.print("stopped following; the run keeps running")
        return 130
    if as_json:
        _json("outcome", outcome.to_dict())
    elif not raw:
        err.print(outcome_line(outcome), soft_wrap=True)
    return outcome.exit_code
