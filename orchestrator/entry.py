"""The `dflashctl` console script.

A verb that reaches a container starts its connection (and its agent call) from the command line before
anything else, then the CLI runs (orchestrator.cli). The command line is read against the grammar the state
dir keeps (orchestrator.commands.early), so the start comes before typer, pydantic and the verbs are
imported: ~0.05 s sooner on the container's clock. With no usable grammar kept (the first command after an
install or an upgrade), orchestrator.cli.main reads the click command itself and keeps its grammar.
"""

from __future__ import annotations

import os
import sys


def run() -> None:
    argv = sys.argv[1:]
    try:
        from orchestrator.commands import early

        grammar = early.cached_grammar()
        started = None if grammar is None else (early.start(grammar, argv),)
    except KeyboardInterrupt:  # as orchestrator.cli.main answers one
        print("interrupted", file=sys.stderr)
        sys.stderr.flush()
        os._exit(130)
    from orchestrator import cli

    cli.run(argv, started)
