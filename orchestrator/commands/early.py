"""The early connection of a command line, started by `orchestrator.cli.main` before typer parses it.

typer converts every parameter through a pydantic TypeAdapter, so its parse imports pydantic (~0.08 s here)
before any verb runs; the connection to the host, and the container's start of the agent, wait on the network
and the host for longer than that. So `main` reads the command line once with the click command typer built
(the names, the options that take a value and the positional arguments come from it, never a list of our own),
and a verb in EARLY starts its connection (and its agent call) at once: orchestrator.preconnect.

What is read here is only a hint. The verb gets the connection through its Options, and open_target takes it
only for exactly the host the validated inventory names; an agent call started for another container,
workdir or verb is dropped unfinished. A command line the reading cannot follow (a cluster of short flags,
`--help`, an option it does not know) starts nothing: the verb connects as it would without.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator import preconnect

EARLY: tuple[tuple[str, str | None], ...] = (("launch", "launch"), ("status", "status"), ("warmup", None))
"""The verbs whose connection starts from the command line, and the agent verb each starts there (None: only
the connection). Their EXPERIMENT argument and --target option say which container."""


def start(command, argv: Sequence[str]) -> preconnect.EarlyConnection | None:
    """The early connection `argv` asks for (see the module docstring), or None.

    Args:
        command: the click group typer built for the app (`typer.main.get_command(app)`).
        argv: the command line after the program name.
    """
    read = _read(command, list(argv))
    if read is None:
        return None
    verb, inventory, values, positionals = read
    agent_verbs = dict(EARLY)
    if verb not in agent_verbs:
        return None
    arguments = [p for p in command.commands[verb].params if p.param_type_name == "argument"]
    experiment = None
    if arguments and arguments[0].name == "experiment":
        experiment = positionals[0] if positionals else arguments[0].default
    target = values.get("target")
    if not isinstance(experiment, (str, type(None))) or not isinstance(target, (str, type(None))):
        return None
    return preconnect.start(inventory, target, experiment, verb=agent_verbs[verb])


def _read(group, tokens: list[str]):
    """(verb, --inventory, the verb's option values, its positionals), or None when the line is not plain."""
    if "--help" in tokens:
        return None
    top, rest = _options(group.params, tokens, stop_at_positional=True)
    if top is None or not rest or rest[0] not in getattr(group, "commands", {}):
        return None
    verb = rest[0]
    values, positionals = _options(group.commands[verb].params, rest[1:], stop_at_positional=False)
    if values is None:
        return None
    return verb, top.get("inventory"), values, positionals


def _options(params, tokens: list[str], *, stop_at_positional: bool):
    """Read `tokens` against click `params`: ({option name: value}, the positional tokens left), or
    (None, []) at a token it cannot place."""
    by_flag = {}
    for p in params:
        if p.param_type_name == "option":
            takes_value = not (p.is_flag or p.count)
            for flag in (*p.opts, *p.secondary_opts):
                by_flag[flag] = (p.name, takes_value)
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
