"""The house rules of orchestrator/, read from the source with ast: every arrow points down, ops reach a target
only through Target, no verb imports another verb, no private name crosses a module, no function over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "orchestrator"
MAX_LINES = 80


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text(), str(path))
    return out


MODULES = modules()


def imports(tree: ast.Module) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every import of an orchestrator or trainer module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
    return [(m, n, line) for m, n, line in out if m.split(".")[0] in ("orchestrator", "trainer")]


def floor(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


# What each floor may not import (docs/architecture.md: arrows point down; the agent runs in the container on the
# standard library, the bundle and libtmux; the trainer knows nothing of the orchestrator).
FORBIDDEN = {
    "orchestrator.agent": ("orchestrator.cli", "orchestrator.commands", "orchestrator.ops", "orchestrator.inventory",
                           "orchestrator.target", "orchestrator.transport", "orchestrator.records",
                           "orchestrator.render", "orchestrator.preconnect", "orchestrator.inventory_file"),
    "orchestrator.transport": ("orchestrator.cli", "orchestrator.commands", "orchestrator.ops",
                               "orchestrator.inventory", "orchestrator.target", "orchestrator.agent"),
    "orchestrator.target": ("orchestrator.cli", "orchestrator.commands", "orchestrator.ops"),
    "orchestrator.inventory": ("orchestrator.cli", "orchestrator.commands", "orchestrator.ops",
                               "orchestrator.target", "orchestrator.transport"),
    "orchestrator.ops": ("orchestrator.cli", "orchestrator.commands"),
    "orchestrator.quoting": ("orchestrator",),
    "orchestrator.names": ("orchestrator",),
}
# ops reach targets through orchestrator.target only. The two transport modules they may use are not about
# a target: the workstation's own subprocess runner (`dflashctl lock` runs uv here) and the workstation's
# known_hosts (`dflashctl trust`).
OPS_MAY_USE = {"orchestrator.transport.local", "orchestrator.transport.hostkeys"}


def test_every_arrow_points_down():
    bad = []
    for name, tree in MODULES.items():
        banned = FORBIDDEN.get(floor(name), ())
        for mod, _names, line in imports(tree):
            if any(mod == b or mod.startswith(b + ".") for b in banned) and not mod.startswith(floor(name)):
                bad.append(f"{name}:{line} imports {mod}")
    assert bad == []


def test_the_trainer_never_imports_the_orchestrator():
    bad = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for mod, _names, line in imports(ast.parse(path.read_text())):
            if mod.split(".")[0] == "orchestrator":
                bad.append(f"{path.relative_to(REPO)}:{line} imports {mod}")
    assert bad == []


def test_ops_reach_a_target_only_through_target():
    bad = []
    for name, tree in MODULES.items():
        if not name.startswith("orchestrator.ops"):
            continue
        for mod, _names, line in imports(tree):
            if mod.startswith("orchestrator.transport") and mod not in OPS_MAY_USE:
                bad.append(f"{name}:{line} imports {mod}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "transport":
                bad.append(f"{name}:{node.lineno} reads .transport of a target")
    assert bad == []


# The ops modules that are verbs (the others, carry, are helpers any verb may use).
OPS_VERBS = {"attach", "diagnose", "doctor", "launch", "lock", "logs", "metrics", "runs", "status", "stop", "trust",
             "venv", "warmup"}


def is_verb(module: str) -> bool:
    pkg, _, last = module.rpartition(".")
    return pkg in ("orchestrator.agent.verbs", "orchestrator.commands") or (pkg == "orchestrator.ops" and last in OPS_VERBS)


def test_no_verb_imports_another_verb():
    bad = []
    for name, tree in MODULES.items():
        if not is_verb(name):
            continue
        pkg = name.rpartition(".")[0]
        for mod, names, line in imports(tree):
            for t in [mod] if mod.startswith(pkg + ".") else [f"{mod}.{n}" for n in names if mod == pkg]:
                if is_verb(t) and t != name and t not in ALLOWED_VERB_IMPORTS.get(name, ()):
                    bad.append(f"{name}:{line} imports {t}")
    assert bad == []


# Shared on purpose, and said where: launch --follow prints exactly as `logs --follow` does; launch and warmup
# resolve an experiment the same way and refuse the same preflight failures; metrics finds a run as logs does;
# doctor suggests the tmux install that rebuild-venv performs; rebuild-venv builds from the lock's file; launch
# records who stops a replaced run as stop does, and checks the venv against the lock.
ALLOWED_VERB_IMPORTS = {
    "orchestrator.commands.launch": ("orchestrator.commands.logs", "orchestrator.commands.options"),
    "orchestrator.ops.warmup": ("orchestrator.ops.launch",),
    "orchestrator.ops.metrics": ("orchestrator.ops.logs",),
    "orchestrator.ops.doctor": ("orchestrator.ops.venv",),
    "orchestrator.ops.venv": ("orchestrator.ops.lock",),
    "orchestrator.ops.launch": ("orchestrator.ops.stop", "orchestrator.ops.lock"),
}
for _verb in ("doctor", "trust", "diagnose", "rebuild_venv", "status", "stop", "attach", "logs", "metrics", "warmup"):
    ALLOWED_VERB_IMPORTS.setdefault(f"orchestrator.commands.{_verb}", ("orchestrator.commands.options",))


def test_no_private_name_crosses_a_module():
    bad = []
    for name, tree in MODULES.items():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orchestrator"):
                bad += [f"{name}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("orchestrator") and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{name}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    assert bad == []


def long_functions() -> list[str]:
    out = []
    for name, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    out.append(f"{name}.{node.name}: {lines} lines")
    return out


def test_no_function_over_80_lines():
    assert long_functions() == []


@pytest.mark.parametrize("rule", [test_no_private_name_crosses_a_module, test_ops_reach_a_target_only_through_target])
def test_the_rules_catch_what_they_name(rule, monkeypatch):
    """Each ast rule fails on a module that breaks it (so a passing rule means something)."""
    bad = {
        "test_no_private_name_crosses_a_module": "from orchestrator.agent.runs import _x\n",
        "test_ops_reach_a_target_only_through_target": "def f(t):\n    return t.transport.parent\n",
    }[rule.__name__]
    fake = dict(MODULES, **{"orchestrator.ops.fake": ast.parse(bad)})
    monkeypatch.setitem(globals(), "MODULES", fake)
    with pytest.raises(AssertionError):
        rule()
