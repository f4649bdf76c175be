"""The early connection read from the command line (orchestrator.commands.early): `main` starts it before
typer's parse, from the click command typer built, and the verb hands it on; a line it cannot follow, or a
verb that reaches no container, starts nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import typer
import typer.main

from orchestrator import cli, preconnect
from orchestrator.commands import early, options


@pytest.fixture
def asked(monkeypatch):
    """What preconnect.start was asked for, instead of connecting: (inventory, target, experiment, verb)."""
    calls = []
    monkeypatch.setattr(preconnect, "start",
                        lambda inventory, target, experiment=None, verb=None: calls.append(
                            (inventory, target, experiment, verb)) or None)
    return calls


COMMAND = typer.main.get_command(cli.app)


@pytest.mark.parametrize("argv, want", [
    (["-i", "inv.yaml", "launch", "exp"], ("inv.yaml", None, "exp", "launch")),
    (["--inventory=inv.yaml", "launch", "--target", "ct", "exp"], ("inv.yaml", "ct", "exp", "launch")),
    (["launch", "-tct", "--tag", "[x]", "exp", "--follow"], (None, "ct", "exp", "launch")),
    (["-v", "launch", "--grace=3", "--replace", "--", "exp"], (None, None, "exp", "launch")),
    (["status", "--target", "ct", "--limit", "5"], (None, "ct", None, "status")),
    (["warmup", "-t", "ct"], (None, "ct", "tiny", None)),  # warmup's EXPERIMENT defaults to tiny
    (["warmup", "exp"], (None, None, "exp", None)),
])
def test_the_verb_its_experiment_target_and_inventory_are_read_from_the_line(asked, argv, want):
    early.start(COMMAND, argv)
    assert asked == [want]


@pytest.mark.parametrize("argv", [
    ["logs", "run-1", "--follow"],  # a verb that connects later, as it always did
    ["launch", "exp", "--help"],
    ["launch", "-fv", "exp"],  # a cluster of short flags
    ["launch", "--nosuch", "exp"],
    ["launch", "--target"],  # an option without its value
    ["--follow=yes", "launch", "exp"],
    ["nosuch", "exp"],
    [],
])
def test_a_line_it_cannot_follow_or_a_verb_it_does_not_serve_starts_nothing(asked, argv):
    assert early.start(COMMAND, argv) is None
    assert asked == []


def test_which_options_take_a_value_comes_from_the_click_command(asked):
    """A new option of a verb is read as typer declares it, with no list of ours to update."""
    app = typer.Typer()

    @app.callback()
    def _top(inventory: str = typer.Option(None, "--inventory", "-i")) -> None: ...

    @app.command("launch")
    def _launch(experiment: str, shiny: str = typer.Option(None, "--shiny"), quick: bool = typer.Option(False, "--quick")) -> None: ...

    @app.command("other")
    def _other() -> None: ...

    early.start(typer.main.get_command(app), ["launch", "--shiny", "not-the-experiment", "--quick", "exp"])
    assert asked == [(None, None, "exp", "launch")]


def test_main_starts_the_launch_agent_call_before_the_inventory_is_validated(pve, tmp_path, monkeypatch):
    """`dflashctl launch` through main: the container has the launch's one pct exec before options.load
    returns (it waits here for it), and the run it starts is that call's."""
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    ct = pve.create_container(996, gpus=0)
    inv = {"hosts": {"pve": pve.host_entry()},
           "targets": {"ct": {"kind": "container", "host": "pve", "ctid": 996, "workdir": ct.workdir, "venv": "sys"}},
           "venvs": {"sys": {"kind": "system"}},
           "experiments": {"e": {"kind": "command", "target": "ct", "command": ["true"]}}}
    path = tmp_path / "inv.yaml"
    path.write_text(json.dumps(inv))
    load = options.load
    seen_before_load = []

    def waiting_load(ctx):
        deadline = time.monotonic() + 30
        while not pve.pct_exec_calls(996) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen_before_load.append(len(pve.pct_exec_calls(996)))
        return load(ctx)

    monkeypatch.setattr(options, "load", waiting_load)
    try:
        assert cli.main(["-i", str(path), "launch", "e", "--json"]) == 0
        assert seen_before_load == [1]
        assert len(pve.pct_exec_calls(996)) == 1  # the early call was the launch's one exec
        runs = list((Path(ct.workdir) / "runs").iterdir())
        assert len(runs) == 1
    finally:
        pve.remove_container(996)
