"""A pytest plugin for tests/mutation/run.py's scratch copies (run.py loads it with `-p`; the main suite never
does). It makes each mutant cheap to test, without changing which tests run or what they check:

- Fastest first. mutmut runs a mutant's tests with `-x` (stop at the first failure) in the order of a set;
  most mutants fail a quick golden test, and a slow test that happens to come first and pass costs its whole
  time for nothing. The tests are sorted by the time each took in mutmut's baseline run (mutmut-stats.json in
  the directory mutmut runs pytest from); a test with no time goes last, in collection order.
- Imports paid once. mutmut forks every mutant's run from one warmed-up server process, which has imported
  only what collecting the tests imports. Modules a test imports while it runs (transformers loads a model's
  code on first use: seconds, and tens of seconds on a loaded machine) were imported again in every fork. The
  baseline run writes the library modules it ended with (mutation-preload.txt); the server imports them once
  before it forks. Modules of the checkout (the mutated packages, the tests) are left to the normal imports.
  Then gc.freeze(): the objects the server holds are never scanned by a child's garbage collector (each full
  collection walked the whole torch/transformers heap, and touching it copied the server's pages).

run.py also turns off pytest's unraisableexception plugin there: at the end of every session it runs five
full garbage collections (0.6 s each with torch loaded), 3 of the 4 seconds a one-test mutant took.
"""

from __future__ import annotations

import gc
import importlib
import json
import sys
from pathlib import Path

PRELOAD = Path("mutation-preload.txt")


def _library_modules() -> list[str]:
    here = str(Path.cwd().resolve())
    names = []
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None) or ""
        if path and not path.startswith(here) and not name.startswith("__"):
            names.append(name)
    return names  # in import order: a package before its submodules, as they were first imported


def pytest_configure(config):
    if PRELOAD.is_file():
        for name in PRELOAD.read_text().split():
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001  (a module that imports only in its own context: the test will)
                    pass
        gc.freeze()


def pytest_collection_modifyitems(session, config, items):
    try:
        durations = json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):  # the baseline run itself: no times yet
        return
    items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))  # stable: ties keep their order


def pytest_sessionfinish(session, exitstatus):
    if not PRELOAD.exists():  # the first run (mutmut's baseline): every test ran, nothing is mutated
        PRELOAD.write_text("\n".join(_library_modules()) + "\n")
