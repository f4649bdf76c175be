"""The mutation run's own configuration stays true to the code: every function pattern in tests/mutation/run.py
names a function that exists in the file it mutates (a rename or a move must not leave a module mutating
nothing), every test selection names test files that exist, and tests/mutation/equivalent.yaml lists each
survivor once, with a reason."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _run_module():
    spec = importlib.util.spec_from_file_location("mutation_run", HERE / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mutation_run"] = mod
    spec.loader.exec_module(mod)
    return mod


run = _run_module()


def _functions(path: Path) -> set[str]:
    """mutmut's names for the functions and methods in `path`: x_name, xǁClassǁmethod."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(f"x_{node.name}")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(f"xǁ{node.name}ǁ{item.name}")
    return out


@pytest.mark.parametrize("name", list(run.MODULES))
def test_every_pattern_names_a_function_of_the_mutated_files(name):
    spec = run.MODULES[name]
    known = {f"{f[:-3].replace('/', '.')}.{fn}" for f in spec["files"] for fn in _functions(REPO / f)}
    for pattern in spec["functions"]:
        rx = re.compile(re.escape(pattern).replace(r"\*", ".*") + "$")
        # a pattern is matched against mutant names: <function>__mutmut_<n>
        assert any(rx.match(f"{fn}__mutmut_1") for fn in known), (name, pattern, sorted(known))


@pytest.mark.parametrize("name", list(run.MODULES))
def test_every_selected_test_file_exists(name):
    files = [t for t in run.MODULES[name]["tests"] if t.endswith(".py")]
    assert files and all((REPO / f).is_file() for f in files), files


def test_ci_modules_and_floors_are_known_modules():
    assert set(run.CI) <= set(run.MODULES) and set(run.FLOORS) == set(run.MODULES)


def test_equivalent_entries_are_unique_keys_with_reasons():
    entries = yaml.safe_load((HERE / "equivalent.yaml").read_text())
    keys = [e["mutant"] for e in entries]
    assert len(keys) == len(set(keys))
    for e in entries:
        assert set(e) == {"mutant", "reason"} and len(e["reason"]) > 20, e
        assert re.match(r"^x[_ǁ]\S+:\d+ \| .+ -> .*$", e["mutant"]), e["mutant"]


def test_key_of_counts_the_line_within_the_function():
    diff = ("--- a.py\n+++ a.py\n@@ -3,4 +3,4 @@\n def f(x):\n     y = 1\n-    return x + y\n+    return x - y\n")
    assert run.key_of("pkg.mod.x_f__mutmut_7", diff) == "x_f:5 | return x + y -> return x - y"
