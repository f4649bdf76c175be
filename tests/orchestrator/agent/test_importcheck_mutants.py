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


def test_pruning_drops_the_oldest_by_time_not_by_order_and_stamps_utc(tmp_path, monkeypatch):
    import re
    import time

    rec = tmp_path / "verified.json"
    n = importcheck.MAX_ENTRIES
    old = {f"o{i:05d}": {"dist": "x", "at": "2020-01-01T00:00:01Z"} for i in range(n)}
    old["o02500"]["at"] = "2019-01-01T00:00:00Z"  # the oldest, in the middle
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # +05:30: a local stamp would show it
    time.tzset()
    try:
        importcheck.save_record(rec, old, {"new": {"dist": "y"}})
        after = time.gmtime()
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    kept = importcheck.load_record(rec)
    assert "o02500" not in kept and "o00000" in kept and "new" in kept
    at = kept["new"]["at"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", at), at
    assert at[:13] in (time.strftime("%Y-%m-%dT%H", after),
                       time.strftime("%Y-%m-%dT%H", time.gmtime(time.mktime(after) - 3600)))


def test_names_are_read_once_the_first_distribution_wins_and_a_nameless_one_is_none(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    _dist(first, "samename", "1.0")
    _dist(second, "samename", "2.0")
    nameless = tmp_path / "nameless" / "x-1.0.dist-info"
    nameless.mkdir(parents=True)
    (nameless / "METADATA").write_text("Metadata-Version: 2.1\nVersion: 1.0\n")
    by_name, _ = importcheck.requirements(list(metadata.distributions(path=[str(first), str(second),
                                                                            str(tmp_path / "nameless")])))
    assert list(by_name) == ["samename"] and by_name["samename"].version == "1.0"


def test_the_keys_are_these_digests_and_a_cycles_member_stands_in_by_its_files(tmp_path):
    import hashlib

    _dist(tmp_path, "leaf", "1.0", files=("b.py", "a.py"))
    _dist(tmp_path, "ping", "1.0", ["pong"])
    _dist(tmp_path, "pong", "1.0", ["ping"], files=("pong.py",))
    by_name, deps = importcheck.requirements(list(metadata.distributions(path=[str(tmp_path)])))
    own = importcheck._files_digest(by_name["leaf"])
    assert own == hashlib.sha256("a.py,sha256=x,1\nb.py,sha256=x,1".encode()).hexdigest()
    keys = importcheck.dist_keys(by_name, deps)
    py = importcheck.python_key()
    assert keys["leaf"] == hashlib.sha256("\0".join([py, "leaf", "1.0", own]).encode()).hexdigest()
    # the cycle's first member met (directory order) keys its partner with its own files standing in for it
    a, b = sorted(("ping", "pong"), key=list(by_name).index)
    a_own, b_own = (importcheck._files_digest(by_name[n]) for n in (a, b))
    inner = hashlib.sha256("\0".join([py, b, "1.0", b_own, f"{a}:{a_own}"]).encode()).hexdigest()
    assert keys[b] == inner
    assert keys[a] == hashlib.sha256("\0".join([py, a, "1.0", a_own, inner]).encode()).hexdigest()


def test_a_cycles_members_other_requirements_still_count(tmp_path):
    _dist(tmp_path, "aa", "1.0", ["bb", "zz"])
    _dist(tmp_path, "bb", "1.0", ["aa", "zz"])
    _dist(tmp_path, "zz", "1.0")

    def keys():
        return importcheck.dist_keys(*importcheck.requirements(list(metadata.distributions(path=[str(tmp_path)]))))

    before = keys()
    (tmp_path / "zz-1.0.dist-info" / "RECORD").write_text("zz_changed.py,sha256=y,1\n")
    after = keys()
    assert after["aa"] != before["aa"] and after["bb"] != before["bb"]
