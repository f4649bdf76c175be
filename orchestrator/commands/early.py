"""The early connection of a command line, started before typer parses it.

typer converts every parameter through a pydantic TypeAdapter, so its parse imports pydantic (~0.08 s here)
before any verb runs, and importing typer and building its click command costs ~0.05 s more; the connection
to the host, and the container's start of the agent, wait on the network and the host for longer than that.
So the command line is read once against its grammar: for the group and each verb in EARLY, every option's
flags (its name, whether it takes a value) and the verb's first argument, taken from the click command typer
built (`grammar`), never a list of our own. A verb in EARLY starts its connection (and its agent call) at
once: orchestrator.preconnect.

The console script (orchestrator.entry) reads the grammar from the state dir (`cached_grammar`), so the
connection starts before typer is even imported; the file is written from the click command whenever it is
missing or its sources changed (`remember`), and `orchestrator.cli.main` reads the click command itself
when it was not given a start.

What is read here is only a hint. The verb gets the connection through its Options, and open_target takes it
only for exactly the host the validated inventory names; an agent call started for another container,
workdir or verb is dropped unfinished. A command line the reading cannot follow (a cluster of short flags,
`--help`, an option it does not know) starts nothing: the verb connects as it would without.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from orchestrator import preconnect

EARLY: tuple[tuple[str, str | None], ...] = (("launch", "launch"), ("status", "status"), ("warmup", None))
"""The verbs whose connection starts from the command line, and the agent verb each starts there (None: only
the connection). Their EXPERIMENT argument and --target option say which container."""

GRAMMAR_FILE = "cli-grammar.json"
"""The grammar's copy in the state dir (orchestrator.records.state_dir), with the stamp of its sources."""


def grammar(command) -> dict:
    """What `start` reads of the click group typer built (`typer.main.get_command(app)`), as plain data:
    `{"options": {flag: [name, takes a value]}, "verbs": {verb: {"options": ..., "experiment": [default]}}}`
    for the group and each verb of EARLY it has; "experiment" is empty when the verb's first argument is not
    EXPERIMENT, or its default is not a string or None."""
    verbs = {}
    for verb, _agent in EARLY:
        if verb not in getattr(command, "commands", {}):
            continue
        params = command.commands[verb].params
        arguments = [p for p in params if p.param_type_name == "argument"]
        usable = arguments and arguments[0].name == "experiment" and isinstance(arguments[0].default, (str, type(None)))
        verbs[verb] = {"options": _flags(params), "experiment": [arguments[0].default] if usable else []}
    return {"options": _flags(command.params), "verbs": verbs}


def _flags(params) -> dict[str, list]:
    flags = {}
    for p in params:
        if p.param_type_name == "option":
            takes_value = not (p.is_flag or p.count)
            for flag in (*p.opts, *p.secondary_opts):
                flags[flag] = [p.name, takes_value]
    return flags


def start(grammar: dict, argv: Sequence[str]) -> preconnect.EarlyConnection | None:
    """The early connection `argv` asks for (see the module docstring), or None.

    Args:
        grammar: the command line's grammar (`grammar`, or `cached_grammar`).
        argv: the command line after the program name.
    """
    read = _read(grammar, list(argv))
    if read is None:
        return None
    verb, inventory, values, positionals = read
    experiment = None
    declared = grammar["verbs"][verb]["experiment"]
    if declared:
        experiment = positionals[0] if positionals else declared[0]
    target = values.get("target")
    if not isinstance(experiment, (str, type(None))) or not isinstance(target, (str, type(None))):
        return None
    return preconnect.start(inventory, target, experiment, verb=dict(EARLY)[verb])


def cached_grammar() -> dict | None:
    """The grammar `remember` kept, when it was made from the sources installed now; else None."""
    from orchestrator.records import read_state

    try:
        kept = json.loads(read_state(GRAMMAR_FILE) or "null")
    except ValueError:
        return None
    if not isinstance(kept, dict) or kept.get("stamp") != _stamp() or not _well_formed(kept.get("grammar")):
        return None
    return kept["grammar"]


def remember(grammar: dict) -> None:
    """Keep `grammar` in the state dir for the next command's `cached_grammar` (a state dir that cannot be
    written only means the next command reads the click command again)."""
    from orchestrator.records import read_state, write_state

    text = json.dumps({"stamp": _stamp(), "grammar": grammar}, sort_keys=True)
    if read_state(GRAMMAR_FILE) != text:
        write_state(GRAMMAR_FILE, text)


def _stamp() -> list:
    """What the grammar is made from, as it is on disk now: every module of the CLI (its path, size and
    mtime) and typer's own (which turns the declarations into click options)."""
    import importlib.util

    here = Path(__file__).resolve().parent
    files = [here.parent / "cli.py", *sorted(here.glob("*.py"))]
    spec = importlib.util.find_spec("typer")
    if spec is not None and spec.origin:
        files.append(Path(spec.origin))
    stamp = []
    for path in files:
        try:
            st = os.stat(path)
        except OSError:
            stamp.append([str(path), None])
            continue
        stamp.append([str(path), st.st_size, st.st_mtime_ns])
    return stamp


def _well_formed(grammar) -> bool:
    """The shape `grammar` makes (a hand-edited or truncated file reads as no grammar, never as a wrong one)."""
    def flags_ok(flags) -> bool:
        return isinstance(flags, dict) and all(
            isinstance(k, str) and isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
            and isinstance(v[1], bool) for k, v in flags.items())

    if not isinstance(grammar, dict) or not flags_ok(grammar.get("options")) or not isinstance(grammar.get("verbs"), dict):
        return False
    agent_verbs = dict(EARLY)
    for verb, entry in grammar["verbs"].items():
        if verb not in agent_verbs or not isinstance(entry, dict) or not flags_ok(entry.get("options")):
            return False
        experiment = entry.get("experiment")
        if not isinstance(experiment, list) or len(experiment) > 1 or any(
                not isinstance(d, (str, type(None))) for d in experiment):
            return False
    return True


def _read(grammar: dict, tokens: list[str]):
    """(verb, --inventory, the verb's option values, its positionals), or None when the line is not plain or
    its verb is not in EARLY."""
    if "--help" in tokens:
        return None
    top, rest = _options(grammar["options"], tokens, stop_at_positional=True)
    if top is None or not rest or rest[0] not in grammar["verbs"]:
        return None
    verb = rest[0]
    values, positionals = _options(grammar["verbs"][verb]["options"], rest[1:], stop_at_positional=False)
    if values is None:
        return None
    return verb, top.get("inventory"), values, positionals


def _options(by_flag: dict[str, list], tokens: list[str], *, stop_at_positional: bool):
    """Read `tokens` against the flags of one command ({flag: [name, takes a value]}): ({option name: value},
    the positional tokens left), or (None, []) at a token it cannot place."""
    values: dict[str, object] = {}
    positionals: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            positionals += tokens[i + 1:]
            break
        if not tok.startswith("-") or tok == "-":
            if stop_at_positional:
                return values, tokens[i:]
            positionals.append(tok)
            i += 1
            continue
        flag, eq, attached = tok.partition("=") if tok.startswith("--") else (tok[:2], "", tok[2:])
        if flag not in by_flag:
            return None, []
        name, takes_value = by_flag[flag]
        if not takes_value:
            if eq or attached:
                return None, []
            values[name] = True
        elif eq or attached:
            values[name] = attached
        elif i + 1 < len(tokens):
            i += 1
            values[name] = tokens[i]
        else:
            return None, []
        i += 1
    return values, positionals
