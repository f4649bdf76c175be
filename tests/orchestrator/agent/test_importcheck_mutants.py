"""The verified-wheels keys and record (orchestrator.agent.importcheck) exactly: the interpreter key's every
part (a patch version of Python is another key), transitive requirements with cycles, the record's refusals
and its pruning to the newest entries. Real distributions are written as dist-info folders and read through
importlib.metadata. What tests/mutation/run.py runs against the module's mutants with test_importcheck.py."""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

from orchestrator.agent import importcheck


def test_the_python_key_is_implementation_exact_version_platform_machine_and_base_binary():
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    assert importcheck.python_key() == (f"{sys.implementation.name}-{platform.python_version()}-{sys.platform}-"
                                        f"{platform.machine()}-{base}")
    assert platform.python_version().count(".") == 2  # the patch version is in it


def test_closures_are_transitive_and_survive_cycles():
    deps = {"a": ["b"], "b": ["c"], "c": ["a"], "d": [], "e": ["d", "x"]}
    assert importcheck.closures(deps) == {"a": frozenset({"b", "c"}), "b": frozenset({"a", "c"}),
                                          "c": frozenset({"a", "b"}), "d": frozenset(), "e": frozenset({"d", "x"})}


def _dist(site, name, version, requires=(), files=("pkg/__init__.py",)):
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                + "".join(f"Requires-Dist: {r}\n" for r in requires))
    if files is not None:
        (d / "RECORD").write_text("".join(f"{f},sha256=x,1\n" for f in files))


def test_requirements_and_keys_follow_installed_dependencies_only(tmp_path):
    _dist(tmp_path, "Top_Pkg", "1.0", ["dep-one>=1", "missing", "dep_one ; extra == 'x'"])
    _dist(tmp_path, "dep.one", "2.0")
    _dist(tmp_path, "norecord", "1.0", files=None)
    dists = list(metadata.distributions(path=[str(tmp_path)]))
    by_name, deps = importcheck.requirements(dists)
    assert sorted(by_name) == ["dep-one", "norecord", "top-pkg"]
    assert deps == {"top-pkg": ["dep-one"], "dep-one": [], "norecord": []}
    keys = importcheck.dist_keys(by_name, deps)
    assert sorted(keys) == ["dep-one", "top-pkg"]  # no RECORD: no key
    # the dependency's files change: its key and its dependant's change, not an unrelated one
    (tmp_path / "dep.one-2.0.dist-info" / "RECORD").write_text("pkg/__init__.py,sha256=y,1\n")
    again = importcheck.dist_keys(*importcheck.requirements(list(metadata.distributions(path=[str(tmp_path)]))))
    assert again["dep-one"] != keys["dep-one"] and again["top-pkg"] != keys["top-pkg"]


def test_the_record_refuses_what_it_did_not_write_and_keeps_the_newest_entries(tmp_path):
    rec = tmp_path / "verified.json"
    assert importcheck.load_record(None) == {}
    for bad in ("{half", "[]", json.dumps({"version": importcheck.RECORD_VERSION + 1, "verified": {"k": {}}}),
                json.dumps({"version": importcheck.RECORD_VERSION, "verified": []})):
        rec.write_text(bad)
        assert importcheck.load_record(rec) == {}
    importcheck.save_record(rec, {}, {"k1": {"dist": "a", "version": "1"}})
    got = importcheck.load_record(rec)
    assert set(got) == {"k1"} and got["k1"]["dist"] == "a" and got["k1"]["at"].endswith("Z")
    assert json.loads(rec.read_text())["version"] == importcheck.RECORD_VERSION
    assert [p.name for p in tmp_path.iterdir()] == ["verified.json"]  # no temporary left
    n = importcheck.MAX_ENTRIES
    old = {f"o{i:05d}": {"dist": "x", "at": f"2020-01-01T00:00:{i % 60:02d}Z"} for i in range(n)}
    importcheck.save_record(rec, old, {"new": {"dist": "y"}})
    kept = importcheck.load_record(rec)
    assert len(kept) == n and "new" in kept and "o00000" not in kept  # the oldest goes past MAX
    importcheck.save_record(rec, dict(list(old.items())[:n - 1]), {"new": {"dist": "y"}})
    assert len(importcheck.load_record(rec)) == n  # exactly MAX: nothing pruned
