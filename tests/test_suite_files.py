"""The suite's own files: pytest's default import mode (prepend, no __init__.py) imports every test file under
its bare name, so two files with one name in different folders stop the whole suite at collection. A run of
single files, as one usually runs while working, never sees it; this test does."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_two_test_files_share_a_name():
    where = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        where[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
