"""The early connection read from the command line (orchestrator.commands.early): started before typer's
parse, from the grammar of the click command typer built (kept in the state dir for the console script, which
starts it before typer is imported), and the verb hands it on; a line it cannot follow, or a verb that
reaches no container, starts nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
GRAMMAR = early.grammar(COMMAND)


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
    early.start(GRAMMAR, argv)
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
    assert early.start(GRAMMAR, argv) is None
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

    early.start(early.grammar(typer.main.get_command(app)), ["launch", "--shiny", "not-the-experiment", "--quick", "exp"])
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


def test_the_grammar_is_kept_in_the_state_dir_for_the_sources_that_made_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    assert early.cached_grammar() is None  # nothing kept yet
    early.remember(GRAMMAR)
    assert early.cached_grammar() == GRAMMAR
    path = tmp_path / "state" / early.GRAMMAR_FILE
    kept = json.loads(path.read_text())
    stamped = {Path(entry[0]).name for entry in kept["stamp"]}
    assert {"cli.py", "early.py", "launch.py", "status.py", "warmup.py"} <= stamped  # what the grammar is made of
    # A verb module changed since (its size or mtime differs): the kept grammar is not used.
    kept["stamp"] = [[p, size + 1, mtime] if p.endswith("launch.py") else [p, size, mtime]
                     for p, size, mtime in kept["stamp"]]
    path.write_text(json.dumps(kept))
    assert early.cached_grammar() is None
    early.remember(GRAMMAR)  # written again from the click command
    assert early.cached_grammar() == GRAMMAR


@pytest.mark.parametrize("damage", [
    lambda text: text[: len(text) // 2],  # truncated
    lambda text: text.replace("true", '"yes"', 1),  # a flag's "takes a value" not a bool
    lambda text: text.replace('"launch"', '"nosuch"'),  # a verb that is not in EARLY
    lambda text: "[]",
])
def test_a_damaged_grammar_file_reads_as_none_never_as_a_wrong_grammar(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    early.remember(GRAMMAR)
    path = tmp_path / "state" / early.GRAMMAR_FILE
    path.write_text(damage(path.read_text()))
    assert early.cached_grammar() is None


def _console_script_run(tmp_path: Path, *argv: str) -> dict:
    """orchestrator.entry.run in a fresh interpreter, with preconnect.start recording whether typer and the CLI
    were imported when it was asked (and starting nothing)."""
    code = (
        "import json, sys\n"
        "from orchestrator import preconnect\n"
        "def start(inventory, target, experiment=None, verb=None):\n"
        "    seen = {'typer': 'typer' in sys.modules, 'cli': 'orchestrator.cli' in sys.modules, 'verb': verb,\n"
        "            'experiment': experiment}\n"
        f"    open({str(tmp_path / 'seen.json')!r}, 'w').write(json.dumps(seen))\n"
        "preconnect.start = start\n"
        "from orchestrator import entry\n"
        "sys.argv = ['dflashctl', *sys.argv[1:]]\n"
        "entry.run()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), DFLASHCTL_STATE_DIR=str(tmp_path / "state"))
    subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=60,
                   stdin=subprocess.DEVNULL)
    seen = json.loads((tmp_path / "seen.json").read_text())
    (tmp_path / "seen.json").unlink()
    return seen


def test_the_console_script_starts_the_connection_before_typer_is_imported(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("{}\n")  # what the inventory says does not matter here: preconnect.start only records
    first = _console_script_run(tmp_path, "-i", str(inv), "launch", "exp")
    assert first == {"typer": True, "cli": True, "verb": "launch", "experiment": "exp"}  # nothing kept yet: cli.main
    assert (tmp_path / "state" / early.GRAMMAR_FILE).is_file()
    again = _console_script_run(tmp_path, "-i", str(inv), "launch", "exp")
    assert again == {"typer": False, "cli": False, "verb": "launch", "experiment": "exp"}


def test_an_interrupt_during_the_early_start_is_one_line_and_130(tmp_path):
    code = ("import sys\nfrom orchestrator.commands import early\n"
            "def interrupted():\n    raise KeyboardInterrupt\n"
            "early.cached_grammar = interrupted\nfrom orchestrator import entry\nentry.run()\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), DFLASHCTL_STATE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code, "launch", "exp"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert (res.returncode, res.stderr) == (130, "interrupted\n")


def test_the_installed_script_launches_on_the_connection_it_started_from_the_kept_grammar(pve, tmp_path, dflashctl):
    """`dflashctl launch` as a user runs it, twice: the first keeps the grammar, the second starts its agent call
    from it before typer is imported, and that call is the launch's one `pct exec` (one dropped and a second
    made would be two)."""
    ct = pve.create_container(997, gpus=0)
    inv = {"hosts": {"pve": pve.host_entry()},
           "targets": {"ct": {"kind": "container", "host": "pve", "ctid": 997, "workdir": ct.workdir, "venv": "sys"}},
           "venvs": {"sys": {"kind": "system"}},
           "experiments": {name: {"kind": "command", "target": "ct", "command": ["true"]} for name in ("e1", "e2")}}
    path = tmp_path / "inv.yaml"
    path.write_text(json.dumps(inv))
    env = dict(os.environ, DFLASHCTL_STATE_DIR=str(tmp_path / "state"))
    try:
        first = dflashctl("-i", str(path), "launch", "e1", "--json", env=env)
        assert first.returncode == 0, first.stderr
        assert (tmp_path / "state" / early.GRAMMAR_FILE).is_file()
        pve.clear_pct_calls()
        second = dflashctl("-i", str(path), "launch", "e2", "--json", env=env)
        assert second.returncode == 0, second.stderr
        assert len(pve.pct_exec_calls(997)) == 1
        assert sorted(p.name.split("-")[0] for p in (Path(ct.workdir) / "runs").iterdir()) == ["e1", "e2"]
    finally:
        pve.remove_container(997)
