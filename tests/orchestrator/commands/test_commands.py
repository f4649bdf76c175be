"""The verbs' modules: one per verb, thin. Each command is run in-process through `main` with its op patched,
and the test asserts exactly what the op received (the inventory named by -i, the target name, the flags)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from orchestrator.cli import main

REPO = Path(__file__).resolve().parents[3]
COMMANDS = sorted((REPO / "orchestrator" / "commands").glob("*.py"))
INVENTORY = """\
targets:
  here: {{kind: local, workdir: {workdir}}}
experiments:
  e: {{kind: command, target: here, command: ["true"]}}
"""


@pytest.fixture
def inv(tmp_path) -> str:
    p = tmp_path / "inv.yaml"
    p.write_text(INVENTORY.format(workdir=tmp_path / "work"))
    return str(p)


class Recorder:
    """Stands in for one op: records (args, kwargs), returns `result`."""

    def __init__(self, result=None):
        self.calls: list[tuple[tuple, dict]] = []
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


def patch(monkeypatch, module: str, name: str, result=None) -> Recorder:
    rec = Recorder(result)
    monkeypatch.setattr(f"{module}.{name}", rec)
    return rec


def test_every_verb_module_stands_alone():
    """No verb imports the CLI back (the global options come from the context) and none keeps module state."""
    for path in COMMANDS:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "orchestrator.cli", f"{path.name} imports orchestrator.cli"
                assert not (node.module or "").startswith("orchestrator.commands.") or node.module in (
                    "orchestrator.commands.options", "orchestrator.commands.following"), \
                    f"{path.name} imports another verb ({node.module})"
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                value = node.value
                assert isinstance(value, (ast.Constant, ast.BinOp, ast.JoinedStr, ast.Tuple)), \
                    f"{path.name}:{node.lineno}: module-level state"
    cli = ast.parse((REPO / "orchestrator" / "cli.py").read_text())
    assert not [n for n in cli.body if isinstance(n, ast.ClassDef)], "cli.py holds no options class"


def test_status_gets_the_inventory_the_target_and_the_limit(monkeypatch, inv):
    from orchestrator.ops.status import TargetStatus

    rec = patch(monkeypatch, "orchestrator.ops.status", "status_of", TargetStatus("here", "local"))
    assert main(["-i", inv, "status", "--target", "here", "--limit", "3"]) == 0
    (args, kwargs), = rec.calls
    assert args[0].source == inv and args[1:] == ("here",) and kwargs == {"limit": 3, "early": None}
    assert main(["-i", inv, "status"]) == 0
    assert rec.calls[1][0][1] == rec.calls[1][0][0].default_target() == "here"  # the only target


def test_stop_hands_the_run_the_target_and_the_grace_to_the_op(monkeypatch, inv):
    from orchestrator.ops.placement import Placement
    from orchestrator.ops.stop import NodeStop, RunStop, StopResult

    done = RunStop("r1", [NodeStop(Placement("here"), StopResult("r1", "stopped", ["SIGINT"], False, None, None))])
    rec = patch(monkeypatch, "orchestrator.ops.stop", "stop_run", done)
    assert main(["-i", inv, "stop", "e-x", "--target", "here", "--grace", "2.5"]) == 0
    (args, kwargs), = rec.calls
    assert args[0].source == inv and args[1] == "e-x"
    assert kwargs["target"] == "here" and kwargs["grace_s"] == 2.5 and callable(kwargs["on_event"])


def test_launch_hands_every_flag_to_the_op_and_starts_no_connection_for_a_local_target(monkeypatch, inv):
    from orchestrator.ops.launch import LaunchResult, RunLaunch

    one = LaunchResult("e-t-1", "/w/runs/e-t-1", "dflash-e", "here", "e", ["true"], [], None, False)
    res = RunLaunch(one.run_id, one.experiment, [one])
    rec = patch(monkeypatch, "orchestrator.ops.launch", "launch_experiment", res)
    assert main(["-i", inv, "launch", "e", "--tag", "t", "--replace", "--grace", "4", "--resume", "e-0"]) == 0
    (args, kwargs), = rec.calls
    assert args[0].source == inv and args[1] == "e"
    assert {k: kwargs[k] for k in ("target", "tag", "replace", "dry_run", "grace_s", "resume", "early")} == \
        {"target": None, "tag": "t", "replace": True, "dry_run": False, "grace_s": 4.0, "resume": "e-0", "early": None}
    assert kwargs["cli"].startswith("dflashctl")


def test_warmup_metrics_rebuild_and_attach_get_their_arguments(monkeypatch, inv):
    from orchestrator.ops.metrics import MetricsSeries
    from orchestrator.ops.warmup import WarmupResult

    warm = patch(monkeypatch, "orchestrator.ops.warmup", "warmup_experiment", WarmupResult("e", "here", "/c", "/d", []))
    assert main(["-i", inv, "warmup", "e", "--target", "here"]) == 0
    assert warm.calls[0][0][1:] == ("e",) and warm.calls[0][1]["target"] == "here"

    met = patch(monkeypatch, "orchestrator.ops.metrics", "metrics_of", MetricsSeries("e-1", {}, 0))
    assert main(["-i", inv, "metrics", "e-1", "--target", "here"]) == 0
    assert met.calls[0][0][1:] == ("e-1",) and met.calls[0][1] == {"target": "here"}

    att = patch(monkeypatch, "orchestrator.ops.attach", "attach_command", ["tmux", "attach-session", "-t", "=dflash-e"])
    execd = patch(monkeypatch, "orchestrator.ops.attach", "exec_attach")
    assert main(["-i", inv, "attach", "e", "-r"]) == 0
    assert att.calls[0][0][1:] == ("e",) and att.calls[0][1] == {"target": None, "read_only": True, "node": None}
    assert execd.calls == [((["tmux", "attach-session", "-t", "=dflash-e"],), {})]


def test_rebuild_venv_gets_the_target_the_profile_and_the_flags(monkeypatch, inv):
    import types

    report = types.SimpleNamespace(action="noop", warnings=[], fingerprint={}, venv="v", lock_hash="l",
                                   bundle_hash="b", tmux=None)
    rec = patch(monkeypatch, "orchestrator.ops.venv", "rebuild", ("here", "workstation", report))
    assert main(["-i", inv, "rebuild-venv", "--target", "here", "--profile", "workstation", "--force"]) == 0
    (args, kwargs), = rec.calls
    assert args[0].source == inv and args[1:] == ("here", "workstation")
    assert (kwargs["offline"], kwargs["force"], kwargs["rollback"]) == (False, True, False)
