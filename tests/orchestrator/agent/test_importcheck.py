"""The import check of rebuild-venv: worker processes (a crash is named, not fatal), a scheduler that keeps a
heavy import in one worker, the verified-wheels keys (a dependency's change re-verifies its dependents), and the
record as venvinfo.verify keeps it: a failed import is never recorded, a wheel verified under another patch
release of Python is imported again."""

from __future__ import annotations

import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from orchestrator.agent import importcheck


def _modules(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "mods"
    src.mkdir()
    (src / "ic_good.py").write_text("VALUE = 1\n")
    (src / "ic_bad.py").write_text("raise ValueError('boom [in] brackets')\n")
    (src / "ic_dies.py").write_text("import os\nos._exit(7)\n")
    (src / "ic_slow.py").write_text("import time\ntime.sleep(0.5)\n")
    (src / "ic_prints.py").write_text("print('not an answer line')\n")
    monkeypatch.syspath_prepend(str(src))  # the workers get the verifier's sys.path


def test_workers_import_each_module_once_and_name_what_killed_one(tmp_path, monkeypatch):
    _modules(tmp_path, monkeypatch)
    mods = ["ic_slow", "ic_good", "ic_bad", "ic_dies", "ic_prints", "json"]
    results: dict[str, str | None] = {}

    def on_result(module, error, torch_info):
        assert module not in results
        results[module] = error

    start = time.monotonic()
    importcheck.import_all(mods, {m: m for m in mods}, {}, 2, on_result)
    assert set(results) == set(mods)
    assert results["ic_good"] is None and results["ic_slow"] is None and results["json"] is None
    assert results["ic_prints"] is None  # what a module prints goes to stderr, not into the answers
    assert results["ic_bad"] == "ValueError: boom [in] brackets"
    assert results["ic_dies"] == "the interpreter died (exit code 7) while importing it"
    assert time.monotonic() - start < 30


def test_a_single_worker_still_gets_through_a_crash(tmp_path, monkeypatch):
    _modules(tmp_path, monkeypatch)
    results = {}
    importcheck.import_all(["ic_dies", "ic_good"], {"ic_dies": "a", "ic_good": "b"}, {}, 1,
                           lambda m, e, t: results.__setitem__(m, e))
    assert results["ic_good"] is None and "died" in results["ic_dies"]


class _W:
    def __init__(self, loaded=(), module=None):
        self.loaded, self.module = set(loaded), module


def test_the_scheduler_keeps_what_needs_torch_with_the_worker_that_has_torch():
    dist = {"torch": "torch", "accelerate": "accelerate", "sympy": "sympy", "yaml": "pyyaml"}
    needs = {"accelerate": frozenset({"torch", "numpy"}), "torch": frozenset({"sympy"}), "sympy": frozenset(),
             "pyyaml": frozenset()}
    s = importcheck._Scheduler(["torch", "accelerate", "sympy", "yaml"], dist, needs)
    w1, w2 = _W(), _W()
    assert s.pick(w1, [w1, w2]) == "torch"
    w1.loaded, w1.module = {"torch"}, "torch"
    # accelerate needs torch, which worker 1 holds: worker 2 takes sympy (torch requires it, but does not
    # import it), then yaml, and leaves accelerate to worker 1.
    assert s.pick(w2, [w1, w2]) == "sympy"
    w2.loaded, w2.module = {"sympy"}, "sympy"
    w2.module = None
    assert s.pick(w2, [w1, w2]) == "yaml"
    w2.module = None
    assert s.pick(w2, [w1, w2]) is None  # worker 1 is busy and holds torch: wait for it
    w1.module = None
    assert s.pick(w1, [w1, w2]) == "accelerate" and s.todo == []
    # Nobody busy: the last module goes to whoever is free, even if that imports torch again.
    s2 = importcheck._Scheduler(["accelerate"], dist, needs)
    assert s2.pick(_W(), [_W({"torch"}), _W()]) == "accelerate"


def _dist(site: Path, name: str, version: str, requires=(), files=("x.py",), extra_record=()) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    (info / "METADATA").write_text(meta)
    record = [f"{name}/{f},sha256=abc{version},1" for f in files] + list(extra_record)
    (info / "RECORD").write_text("\n".join(record + [f"{info.name}/RECORD,,"]) + "\n")


def _keys(site: Path) -> dict[str, str]:
    by_name, deps = importcheck.requirements(metadata.distributions(path=[str(site)]))
    return importcheck.dist_keys(by_name, deps)


def test_a_wheel_is_verified_again_when_a_dependency_changed_never_when_nothing_did(tmp_path):
    site = tmp_path / "site"
    _dist(site, "base", "1.0")
    _dist(site, "mid", "2.0", requires=["base>=1", "absent-pkg; extra == 'x'"])
    _dist(site, "top", "3.0", requires=["mid", "Base[extra]"],
          extra_record=["../../../bin/top,sha256=SHEBANG-OF-VENV-A,10", "top-3.0.dist-info/INSTALLER,sha256=uv,2"])
    _dist(site, "alone", "1.0")
    before = _keys(site)
    assert set(before) == {"base", "mid", "top", "alone"}

    # Another venv holding the same wheels: the script's shebang and the installer differ, the key does not.
    _dist(site, "top", "3.0", requires=["mid", "Base[extra]"],
          extra_record=["../../../bin/top,sha256=SHEBANG-OF-VENV-B,10", "top-3.0.dist-info/INSTALLER,sha256=pip,3"])
    assert _keys(site) == before

    # base's files changed (a rebuilt wheel of the same version): base, and all that require it, change.
    _dist(site, "base", "1.0", files=("x.py", "y.py"))
    after = _keys(site)
    assert after["base"] != before["base"] and after["mid"] != before["mid"] and after["top"] != before["top"]
    assert after["alone"] == before["alone"]


def test_the_record_is_read_and_extended_atomically(tmp_path):
    rec = tmp_path / "verified.json"
    assert importcheck.load_record(rec) == {}
    importcheck.save_record(rec, {}, {"k1": {"dist": "a", "version": "1"}})
    first = importcheck.load_record(rec)
    assert set(first) == {"k1"} and first["k1"]["dist"] == "a" and first["k1"]["at"]
    importcheck.save_record(rec, first, {"k2": {"dist": "b", "version": "2"}})
    assert set(importcheck.load_record(rec)) == {"k1", "k2"}
    assert [p.name for p in tmp_path.iterdir()] == ["verified.json"]
    rec.write_text("{broken")
    assert importcheck.load_record(rec) == {}  # unreadable: everything is imported again, nothing skipped


def test_the_python_key_names_the_interpreter():
    key = importcheck.python_key()
    assert sys.implementation.name in key and sys.platform in key and "." in key


@pytest.mark.parametrize("jobs", [1, 3])
def test_default_jobs_and_explicit_jobs_cover_every_module(tmp_path, monkeypatch, jobs):
    _modules(tmp_path, monkeypatch)
    seen = []
    importcheck.import_all(["ic_good", "json", "os"], {"ic_good": "g", "json": "j", "os": "o"}, {}, jobs,
                           lambda m, e, t: seen.append((m, e)))
    assert sorted(seen) == [("ic_good", None), ("json", None), ("os", None)]
    assert 1 <= importcheck.default_jobs() <= 8


# -- the verified-wheels record, through venvinfo.verify as rebuild_venv.sh runs it ---------------------------


def _wheel(site: Path, name: str, source: str) -> None:
    """An installed distribution `name` with one module `name.py` holding `source`."""
    (site / f"{name}.py").write_text(source)
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text(f"{name}.py,sha256=x{abs(hash(source))},{len(source)}\n{info.name}/RECORD,,\n")


def _site_with(tmp_path: Path, monkeypatch, wheels: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A site directory holding `wheels` ahead of this interpreter's own packages, and a verified-wheels record
    in which every OTHER installed distribution is verified already (so verify imports only `wheels`).
    Returns (the record's path, {distribution: its key under this interpreter})."""
    site = tmp_path / "site"
    site.mkdir()
    for name, source in wheels.items():
        _wheel(site, name, source)
    monkeypatch.syspath_prepend(str(site))  # the workers get the verifier's sys.path
    from orchestrator.agent import bundlescan

    # What the bundle imports but this machine lacks (vllm on a CPU workstation): an empty package, found by the
    # bundle check and no distribution (not imported). The lock's completeness is test_venvinfo's subject.
    for module in bundlescan.missing_modules():
        (site / module).mkdir()
        (site / module / "__init__.py").write_text("")
    by_name, deps = importcheck.requirements(metadata.distributions())
    keys = importcheck.dist_keys(by_name, deps)
    record = tmp_path / "venvs" / ".verified-wheels.json"
    record.parent.mkdir()
    ours = {importcheck.normalize_name(w) for w in wheels}
    importcheck.save_record(record, {}, {k: {"dist": n, "version": "?"} for n, k in keys.items() if n not in ours})
    return record, keys


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_wheel_whose_import_failed_is_not_recorded_and_is_imported_again(tmp_path, monkeypatch):
    """A venv whose wheel does not import is refused, and the record does not take that wheel as verified:
    the next rebuild imports it again (and is refused again), never skips it into a broken venv."""
    from orchestrator.agent import venvinfo

    record, keys = _site_with(tmp_path, monkeypatch, {"ic_okwheel": "VALUE = 1\n",
                                                      "ic_badwheel": "raise ImportError('built for another Python')\n"})
    before = importcheck.load_record(record)
    for _ in range(2):
        res = venvinfo.verify(out=_Quiet, record=record, jobs=1)
        # The failed entry names the module that did not import and its distribution (the refusal's message and
        # its data read both), and the worker's error.
        [failed] = res["failed"]
        assert (sorted(failed), failed["module"], failed["dist"]) == (["dist", "error", "module"], "ic_badwheel", "ic-badwheel")
        assert "another Python" in failed["error"]
        assert "ic-badwheel" not in res["skipped"] and "ic-okwheel" not in res["skipped"]
        assert keys["ic-badwheel"] not in importcheck.load_record(record)
    assert importcheck.load_record(record) == before  # a refused venv adds nothing


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_wheel_verified_under_another_patch_version_of_python_is_imported_again(tmp_path, monkeypatch):
    """The record says ic-okwheel was verified by Python X.Y.(Z-1) (its key computed as that interpreter computes
    it); this interpreter is X.Y.Z: the wheel is imported again, then recorded for this one and skipped next
    time. (A C extension built against one patch release can fail under another.)"""
    import platform

    from orchestrator.agent import venvinfo

    record, keys = _site_with(tmp_path, monkeypatch, {"ic_okwheel": "VALUE = 1\n"})
    major, minor, patch = platform.python_version().split(".")[:3]
    other = f"{major}.{minor}.{int(''.join(c for c in patch if c.isdigit())) + 1}"
    with monkeypatch.context() as m:
        m.setattr(platform, "python_version", lambda: other)
        old_key = importcheck.dist_keys(*importcheck.requirements(metadata.distributions()))["ic-okwheel"]
    assert platform.python_version() != other and old_key != keys["ic-okwheel"]
    importcheck.save_record(record, importcheck.load_record(record), {old_key: {"dist": "ic-okwheel", "version": "1.0"}})

    first = venvinfo.verify(out=_Quiet, record=record, jobs=1)
    assert first["failed"] == [] and first["missing"] == {} and "ic-okwheel" not in first["skipped"]
    assert keys["ic-okwheel"] in importcheck.load_record(record)
    second = venvinfo.verify(out=_Quiet, record=record, jobs=1)
    assert "ic-okwheel" in second["skipped"] and second["modules"] < first["modules"]


class _Quiet:
    """verify's progress events, dropped."""

    @staticmethod
    def event(kind: str, **fields) -> None:
        pass
