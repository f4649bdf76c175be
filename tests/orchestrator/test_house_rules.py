"""The house rules of orchestrator/, read from the source with ast: every arrow points down, ops reach a target
only through Target, no verb imports another verb, no private name crosses a module, no function over 80 lines."""

from __future__ import annotations

import ast
import sys
import re
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
PACKAGES = {".".join(p.relative_to(REPO).parent.parts) for p in PACKAGE.rglob("__init__.py")}


def edges(modules: dict[str, ast.Module], name: str) -> set[str]:
    """The modules of `modules` that module `name` imports, anywhere in it (inside functions, under
    TYPE_CHECKING, relative imports resolved): `from orchestrator.ops import placement` is an edge to
    orchestrator.ops.placement, `from orchestrator.ops.logs import follow` one to orchestrator.ops.logs."""
    tree = modules[name]
    pkg = name if f"{name}.__init__" in PACKAGES or name in PACKAGES else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules and m != name}


def cycles(modules: dict[str, ast.Module]) -> list[list[str]]:
    """Every import cycle between modules (Tarjan's strongly connected components of more than one module)."""
    graph = {name: sorted(edges(modules, name)) for name in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycle_between_our_modules():
    """A cycle held together by an import inside a function is a cycle too."""
    assert cycles(MODULES) == []


DOCS = REPO / "docs" / "architecture.md"
FLOOR_ROW = re.compile(r"^\| (\d+) \| (.+) \|$")


def floors_table(text: str) -> dict[str, int]:
    """docs/architecture.md's "Floors, top to bottom" table: {module path prefix: floor number} (1 = top)."""
    out = {}
    for line in text.splitlines():
        m = FLOOR_ROW.match(line.strip())
        if m:
            for cell in re.findall(r"`([^`]+)`", m.group(2)):
                out[cell.removesuffix(".py").removesuffix("/").replace("/", ".")] = int(m.group(1))
    return out


def floor_of(module: str, table: dict[str, int]) -> int | None:
    """The floor of the longest table entry that is `module` or a package above it."""
    best = None
    for prefix, number in table.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, number)
    return best[1] if best else None


def arrows_up(modules: dict[str, ast.Module], table: dict[str, int]) -> list[str]:
    """Every module the table does not place, and every import of a module on a higher floor."""
    bad = [f"{name}: on no floor of {DOCS.name}" for name in modules
           if name != "orchestrator" and floor_of(name, table) is None]
    for name in modules:
        mine = floor_of(name, table)
        for dep in sorted(edges(modules, name)):
            theirs = floor_of(dep, table)
            if mine is not None and theirs is not None and theirs < mine:
                bad.append(f"{name} (floor {mine}) imports {dep} (floor {theirs})")
    return bad


def test_no_arrow_points_up_by_the_floors_table_of_the_docs():
    assert arrows_up(MODULES, floors_table(DOCS.read_text())) == []


def test_the_cycle_and_floor_rules_catch_a_made_up_violation():
    """A tiny fake package: a cycle through an import inside a function, and an import of a higher floor."""
    fake = {
        "orchestrator": ast.parse(""),
        "orchestrator.ops": ast.parse(""),
        "orchestrator.ops.a": ast.parse("from orchestrator.ops import b\n"),
        "orchestrator.ops.b": ast.parse("def f():\n    from orchestrator.ops.c import x\n"),
        "orchestrator.ops.c": ast.parse("import orchestrator.ops.a\n"),
        "orchestrator.ops.d": ast.parse("from orchestrator.ops.a import y\n"),
        "orchestrator.target": ast.parse("def g():\n    from orchestrator.ops.d import z\n"),
    }
    assert cycles(fake) == [["orchestrator.ops.a", "orchestrator.ops.b", "orchestrator.ops.c"]]
    table = floors_table("| 1 | `orchestrator/ops/` |\n| 2 | `orchestrator/target.py` |\n")
    assert arrows_up(fake, table) == ["orchestrator.target (floor 2) imports orchestrator.ops.d (floor 1)"]
    assert arrows_up({**fake, "orchestrator.extra": ast.parse("")}, table)[0] == \
        "orchestrator.extra: on no floor of architecture.md"


def test_the_verbs_are_what_the_commands_call():
    assert {m.rpartition(".")[2] for m in ops_verbs(MODULES)} >= {"launch", "logs", "stop", "attach", "status", "runs"}
    fake = dict(MODULES, **{"orchestrator.commands.fresh": ast.parse(
        "from orchestrator.ops.fresh import go\ndef register(app):\n    pass\n"),
        "orchestrator.ops.fresh": ast.parse("from orchestrator.ops.stop import stop_run\n")})
    assert "orchestrator.ops.fresh" in ops_verbs(fake)  # a new verb needs no list to be checked
    helped = dict(MODULES, **{"orchestrator.commands.fresh": ast.parse(
        "from orchestrator.commands.printing import show\ndef register(app):\n    pass\n"),
        "orchestrator.commands.printing": ast.parse("from orchestrator.ops.fresh import go\n"),
        "orchestrator.ops.fresh": ast.parse("")})
    assert "orchestrator.ops.fresh" in ops_verbs(helped)  # called through a helper of the commands
    assert "orchestrator.commands.printing" not in command_modules(helped)  # the helper is no verb itself


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
# standard library and the bundle; the trainer knows nothing of the orchestrator).
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


# The one trainer module the agent may import: the causes a failed rank cannot report itself (an OOM kill, a
# full file system), one rule for the launcher's report and the agent's answer. Standard library only, so the
# agent stays as light in the container as the stdlib and the bundle.
AGENT_MAY_USE_FROM_TRAINER = {"trainer.faults"}


def test_the_agent_imports_from_the_trainer_only_its_stdlib_faults():
    bad = []
    for name, tree in MODULES.items():
        if floor(name) != "orchestrator.agent":
            continue
        for mod, names, line in imports(tree):
            if mod.split(".")[0] != "trainer":
                continue
            used = [f"{mod}.{n}" for n in names] if mod == "trainer" else [mod]  # `from trainer import faults`
            bad += [f"{name}:{line} imports {u}" for u in used if u not in AGENT_MAY_USE_FROM_TRAINER]
    for mod in sorted(AGENT_MAY_USE_FROM_TRAINER):
        tree = ast.parse((REPO / (mod.replace(".", "/") + ".py")).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad += [f"{mod}:{node.lineno} imports {n} (not the standard library)" for n in names
                        if n.split(".")[0] not in sys.stdlib_module_names and n != "__future__"]
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


def command_modules(modules: dict[str, ast.Module]) -> set[str]:
    """The verbs of the CLI: the modules of orchestrator/commands/ that register a command."""
    return {name for name, tree in modules.items() if name.startswith("orchestrator.commands.")
            and any(isinstance(n, ast.FunctionDef) and n.name == "register" for n in tree.body)}


def ops_verbs(modules: dict[str, ast.Module]) -> set[str]:
    """The ops modules that are verbs: those a command calls into, itself or through a helper of the commands
    (a module of orchestrator/commands/ that registers nothing, as `following` for logs and launch --follow);
    every other ops module is a shared helper any verb may use. Derived from the code, so a new verb is
    covered the day its command exists."""
    verbs = command_modules(modules)
    helpers = {name for name in modules if name.startswith("orchestrator.commands.") and name not in verbs}
    reached = {dep for name in verbs for dep in edges(modules, name)}
    reached |= {dep for name in reached & helpers for dep in edges(modules, name)}
    return {dep for dep in reached if dep.startswith("orchestrator.ops.")}


def is_verb(module: str) -> bool:
    pkg = module.rpartition(".")[0]
    return (pkg == "orchestrator.agent.verbs" or module in command_modules(MODULES)
            or module in ops_verbs(MODULES))


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


# Shared on purpose, and said where: none. What two verbs share is a module of its own (ops.placement: a run
# resolved into placements; ops.spec, ops.refusal, ops.runstop: what launch and warmup share; ops.lockfile: a
# lock read; ops.tmuxfix: the tmux install a fix suggests; commands.following: the follow that logs and
# launch --follow print). A new entry here is a shared module not made yet.
ALLOWED_VERB_IMPORTS: dict[str, tuple[str, ...]] = {}


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


@pytest.mark.parametrize("rule", [test_no_private_name_crosses_a_module, test_ops_reach_a_target_only_through_target,
                                  test_no_verb_imports_another_verb])
def test_the_rules_catch_what_they_name(rule, monkeypatch):
    """Each ast rule fails on a module that breaks it (so a passing rule means something)."""
    bad = {
        "test_no_private_name_crosses_a_module": "from orchestrator.agent.rundirs import _x\n",
        "test_ops_reach_a_target_only_through_target": "def f(t):\n    return t.transport.parent\n",
        "test_no_verb_imports_another_verb": "def f():\n    from orchestrator.ops.logs import follow\n",
    }[rule.__name__]
    # A verb's import of another verb is made inside a function of the status verb (which the status command
    # calls): the rule reads every import, at any depth.
    where = "orchestrator.ops.status" if rule is test_no_verb_imports_another_verb else "orchestrator.ops.fake"
    fake = dict(MODULES, **{where: ast.parse(bad)})
    monkeypatch.setitem(globals(), "MODULES", fake)
    with pytest.raises(AssertionError):
        rule()
