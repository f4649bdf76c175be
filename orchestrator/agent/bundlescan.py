"""What modules exist, as the venv verification reads them (standard library only): the top-level modules a
distribution installs, and the third-party modules the container-side bundle code imports (read from its
sources with ast), with those of them this interpreter cannot find. Used by orchestrator.agent.venvinfo's
`verify` (run by a new venv's interpreter) and its `requirements` command."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

BUNDLE_PACKAGES = ("orchestrator", "trainer")
# The bundle code that runs inside the target; everything it reaches through imports must be installed.
# (The rest of `orchestrator` is the workstation CLI: typer, paramiko... are not in the target's lock.)
CONTAINER_ROOTS = ("orchestrator.agent", "trainer")
# Imported by the bundle only where it is asked for, in a venv that holds it: vLLM (the data stage's engine in
# its own venv, the data_venv; `python -m trainer eval --engine vllm`). A training venv's lock need not have it.
ON_REQUEST = ("vllm",)


def top_level_modules(dist) -> list[str]:
    """The importable top-level names a distribution installs: `top_level.txt`, else derived from RECORD.

    RECORD paths like `yaml/__init__.py`, `typing_extensions.py` or `_cffi.cpython-311-x86_64-linux-gnu.so`
    give `yaml`, `typing_extensions`, `_cffi`; metadata dirs, `.pth` files and files outside
    site-packages (scripts in bin/) are not modules.
    """
    text = dist.read_text("top_level.txt")
    if text:
        names = {n.strip().replace("/", ".") for n in text.splitlines() if n.strip()}
        return sorted(n for n in names if all(p.isidentifier() for p in n.split(".")))
    names: set[str] = set()
    for f in dist.files or ():
        parts = f.parts
        if not parts or parts[0] == ".." or parts[0].endswith((".dist-info", ".data", ".egg-info")):
            continue
        if parts[0] == "__pycache__":
            continue
        if len(parts) > 1:
            names.add(parts[0])
        elif parts[0].endswith(".py"):
            names.add(parts[0][:-3])
        elif parts[0].endswith(".so"):
            names.add(parts[0].split(".", 1)[0])
    return sorted(n for n in names if n.isidentifier())


def _optional_import(node: ast.AST, parents: dict) -> bool:
    """True when the import sits in a `try:` that catches ImportError (or broader), or under TYPE_CHECKING."""
    child, cur = node, parents.get(node)
    while cur is not None:
        if isinstance(cur, ast.Try) and child in cur.body:
            for h in cur.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if h.type is None or any(
                    isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")
                    for n in names
                ):
                    return True
        if isinstance(cur, ast.If) and child in cur.body and "TYPE_CHECKING" in ast.unparse(cur.test):
            return True
        child, cur = cur, parents.get(cur)
    return False


def _module_files(module: str, search: list[str], whole: bool = False) -> list[tuple[str, Path, Path]]:
    """(dotted name, file, search base) of a bundle module; with `whole`, of every module of a package
    (agent verbs are imported by name at run time, so a root package counts as a whole)."""
    rel = Path(*module.split("."))
    for base in map(Path, search):
        pkg = base / rel
        if (pkg / "__init__.py").is_file() and not whole:
            return [(module, pkg / "__init__.py", base)]
        if (pkg / "__init__.py").is_file():
            out = []
            for path in sorted(pkg.rglob("*.py")):
                if "__pycache__" in path.parts:
                    continue
                parts = path.relative_to(base).with_suffix("").parts
                out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path, base))
            return out
        single = base / rel.with_suffix(".py")
        if single.is_file():
            return [(module, single, base)]
    return []


def _imports(tree: ast.AST, name: str, is_pkg: bool) -> list[tuple[str, list[str], ast.AST]]:
    """(module, [candidate submodules], node) for every import statement in a module's tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, [], node) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                module = ".".join(pkg + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((module, [f"{module}.{a.name}" for a in node.names], node))
    return out


def bundle_requirements(roots=CONTAINER_ROOTS, search: list[str] | None = None) -> dict[str, list[str]]:
    """Third-party top-level modules the container-side bundle code imports, with where (`file:line`).

    Starts from `roots` and follows imports into other bundle modules, so `orchestrator.signatures`
    counts when an agent verb imports it and `orchestrator.cli` does not. Imports guarded by
    `try/except ImportError` and `if TYPE_CHECKING:` are optional and not listed; lazy imports inside
    functions are listed (they run in the container too).
    """
    search = search or [p for p in sys.path if p and os.path.isdir(p)]
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    todo = [(r, True) for r in roots]
    seen_modules: set[tuple[str, bool]] = set()
    seen_files: set[Path] = set()
    needed: dict[str, list[str]] = {}
    while todo:
        mod, whole = todo.pop()
        if (mod, whole) in seen_modules:
            continue
        seen_modules.add((mod, whole))
        for name, path, base in _module_files(mod, search, whole):
            if path in seen_files:
                continue
            seen_files.add(path)
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            except (OSError, SyntaxError, ValueError):
                continue
            parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
            for module, subs, node in _imports(tree, name, path.name == "__init__.py"):
                top = module.split(".")[0]
                if not top or top in stdlib or top in ON_REQUEST or _optional_import(node, parents):
                    continue
                if top in BUNDLE_PACKAGES:
                    # `from orchestrator.agent import gpu` imports the submodule `gpu`: follow both.
                    todo.extend((m, False) for m in (module, *subs) if _module_files(m, search))
                else:
                    needed.setdefault(top, []).append(f"{path.relative_to(base).as_posix()}:{node.lineno}")
    return dict(sorted(needed.items()))


def missing_modules() -> dict[str, list[str]]:
    """{module: its first five `file:line`} of the third-party modules the bundle imports that this interpreter
    cannot find (what verify refuses a venv for)."""
    import importlib.util

    missing = {}
    for mod, where in bundle_requirements().items():
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing[mod] = where[:5]
    return missing
