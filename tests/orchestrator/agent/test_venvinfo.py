"""orchestrator.agent.venvinfo and venvfingerprint: what a launch's preflight reads of the venv it would use (a uv venv's
fingerprint, the target's python3 for a `system` profile), the words it says when they do not match, and the
post-build verify refusing a venv that lacks what the bundle imports, with nothing written. Real venvs and
real interpreters; the whole rebuild (uv, locks, containers) is in tests/orchestrator/ops/test_venv.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from orchestrator.agent import venvfingerprint, venvinfo

REPO = Path(__file__).resolve().parents[3]
UV = {"kind": "uv", "lock": "cpu"}


def current_venv(workdir: Path, name: str, fingerprint: str | None) -> Path:
    """`<workdir>/venvs/<name>` as `current`, with `fingerprint` as its fingerprint file's text (None: none)."""
    v = workdir / "venvs" / name
    (v / "bin").mkdir(parents=True)
    if fingerprint is not None:
        (v / venvfingerprint.FINGERPRINT).write_text(fingerprint)
    (workdir / "venvs" / "current").symlink_to(name)
    return v


def test_no_venv_yet_says_so_and_how_to_build_one(tmp_path):
    fp = venvfingerprint.current_fingerprint(str(tmp_path), UV)
    assert fp["lock_hash"] is None
    assert venvfingerprint.fingerprint_diff(fp, "abc") == [f"no venv built in {tmp_path}/venvs (run `dflashctl rebuild-venv`)"]


@pytest.mark.parametrize("text", [None, '{"kind": "uv", "lock_h'])  # never written / torn by a crash
def test_a_venv_without_a_whole_fingerprint_is_never_taken_for_a_built_one(tmp_path, text):
    current_venv(tmp_path, "abc-1", text)
    fp = venvfingerprint.current_fingerprint(str(tmp_path), UV)
    assert fp["lock_hash"] is None and fp["venv"] == "abc-1"
    [why] = venvfingerprint.fingerprint_diff(fp, "abc")
    assert venvfingerprint.FINGERPRINT in why and "dflashctl rebuild-venv" in why


def test_a_built_venv_matches_its_lock_and_another_profiles_lock_is_named(tmp_path):
    current_venv(tmp_path, "abc-1", json.dumps({"kind": "uv", "lock_hash": "abc", "torch": "2.13.0"}))
    fp = venvfingerprint.current_fingerprint(str(tmp_path), UV)
    assert (fp["venv"], fp["lock_hash"], fp["torch"]) == ("abc-1", "abc", "2.13.0")
    assert venvfingerprint.fingerprint_diff(fp, "abc") == []
    assert venvfingerprint.fingerprint_diff(fp, "def", {"name": "cuda", "lock": "cuda"}) == [
        "the current venv abc-1 was built from lock abc; venv profile 'cuda' (lock cuda) needs lock def "
        "(run `dflashctl rebuild-venv`)"]


def test_the_workstation_profile_is_this_interpreter_and_matches_without_a_lock(tmp_path):
    fp = venvfingerprint.current_fingerprint(str(tmp_path), {"kind": "workstation"})
    assert fp["executable"] == sys.executable and fp["packages"]["pytest"] == pytest.__version__
    assert venvfingerprint.fingerprint_diff(fp, None) == []


def test_the_system_profile_describes_the_python3_on_path_not_the_agents(tmp_path, monkeypatch):
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # a python3 with no distributions at all
    monkeypatch.setenv("PATH", f"{bare / 'bin'}{os.pathsep}{os.environ['PATH']}")
    fp = venvfingerprint.current_fingerprint(str(tmp_path), {"kind": "system"})
    assert fp["executable"] == str(bare / "bin" / "python3") and fp["packages"] == {}
    assert "error" not in fp and venvfingerprint.fingerprint_diff(fp, None) == []


def test_the_system_profile_without_python3_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    fp = venvfingerprint.current_fingerprint(str(tmp_path), {"kind": "system"})
    assert venvfingerprint.fingerprint_diff(fp, None) == [
        "no python3 on PATH in the target (install it: apt-get install -y python3)"]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_verify_refuses_a_venv_that_lacks_what_the_bundle_imports_and_writes_no_fingerprint(tmp_path):
    # The rebuild script's last step, as it runs it: the NEW venv's interpreter with the bundle importable.
    # This venv has nothing installed, so the modules the container-side code imports (torch, ...) are
    # missing: one error naming them and where they are imported, exit 3, and no fingerprint (a venv
    # without one is never `current`'s match, see above).
    src = tmp_path / "src"  # the packages alone, as the bundle carries them (no .egg-info beside them)
    for pkg in ("orchestrator", "trainer"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    v = tmp_path / "new-venv"
    venv.create(v, with_pip=False)
    res = subprocess.run(
        [str(v / "bin" / "python"), "-m", "orchestrator.agent.venvinfo", "verify", "--venv", str(v),
         "--lock-hash", "abc", "--bundle-hash", "b1", "--python-request", "3.11", "--jobs", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(src)})
    assert res.returncode == venvinfo.EXIT_VERIFY_FAILED, res.stderr
    events = [json.loads(line) for line in res.stdout.splitlines()]
    [error] = [e for e in events if e["event"] == "error"]
    assert error["type"] == "LockMissesModule" and "torch (trainer/" in error["message"]
    assert error["fix"].endswith("run `dflashctl lock PROFILE`") and "torch" in error["data"]["missing"]
    assert not (v / venvfingerprint.FINGERPRINT).exists()


def test_the_module_refuses_an_unknown_command_with_its_usage(capsys):
    assert venvinfo.main(["fingerprint"]) == 2
    assert "usage: python -m orchestrator.agent.venvinfo verify|requirements" in capsys.readouterr().err


class _Events:
    """verify's `out`: the events it emits, in order."""

    def __init__(self):
        self.seen: list[tuple[str, dict]] = []

    def event(self, kind: str, **fields) -> None:
        self.seen.append((kind, fields))


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_verify_record_progress_result_and_the_recorded_torch(tmp_path, monkeypatch):
    """Two wheels not verified before (every other distribution is, torch with its build in the record): verify
    imports exactly those two, one progress event each (counted i of n), skips the rest by name, reports torch's
    version and CUDA build from the record (the GPU count stays unknown: torch was not imported) and records the
    two wheels under their keys, leaving torch's entry as it was."""
    from importlib import metadata

    from orchestrator.agent import importcheck
    from test_importcheck import _site_with

    record, keys = _site_with(tmp_path, monkeypatch, {"ic_evwheel_b": "VALUE = 1\n", "ic_evwheel_a": "VALUE = 2\n"})
    verified = importcheck.load_record(record)
    verified[keys["torch"]] = {"dist": "torch", "version": "?", "torch": "9.9.9+test", "cuda": "12.9"}
    importcheck.save_record(record, verified, {})
    out = _Events()
    res = venvinfo.verify(out=out, record=record, jobs=None)  # the default number of workers
    # Besides the two: a distribution without a key (an editable install of dflashctl has no hashed RECORD) is
    # imported every time.
    mine = sorted((f["module"], f["dist"], f["message"], f["step"], f["n"]) for _, f in out.seen
                  if f["module"].startswith("ic_"))
    assert mine == [("ic_evwheel_a", "ic-evwheel-a", "import ic_evwheel_a", "verify", len(out.seen)),
                    ("ic_evwheel_b", "ic-evwheel-b", "import ic_evwheel_b", "verify", len(out.seen))]
    assert {kind for kind, _ in out.seen} == {"progress"}
    assert [f["i"] for _, f in out.seen] == list(range(1, len(out.seen) + 1))
    names = {importcheck.normalize_name(d.metadata["Name"]) for d in metadata.distributions()}
    others = sorted(n for n in names if keys.get(n) is not None and n not in ("ic-evwheel-a", "ic-evwheel-b"))
    assert res == {"modules": len(out.seen), "skipped": others, "failed": [], "missing": {},
                   "torch": "9.9.9+test", "cuda": "12.9", "device_count": None}
    after = importcheck.load_record(record)
    assert set(after) == set(verified) | {keys["ic-evwheel-a"], keys["ic-evwheel-b"]}  # nothing else (no keyless dist)
    assert {k: {f: v for f, v in after[k].items() if f != "at"} for k in (keys["ic-evwheel-a"], keys["ic-evwheel-b"])} == {
        keys["ic-evwheel-a"]: {"dist": "ic-evwheel-a", "version": "1.0"},
        keys["ic-evwheel-b"]: {"dist": "ic-evwheel-b", "version": "1.0"}}
    assert after[keys["torch"]] == importcheck.load_record(record)[keys["torch"]] and after[keys["torch"]]["torch"] == "9.9.9+test"


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_verify_record_never_skips_nor_records_the_bundle_and_leaves_out_skipped_modules(tmp_path, monkeypatch):
    """The bundle's own distribution is imported by every verify (last: what it imports is checked first, here
    after a wheel whose name sorts after the bundle's), even when its key is in the record, and never added to it
    (the bundle changes with every dflashctl); a module named in `skip` is not imported (here one that would
    fail)."""
    from orchestrator.agent import importcheck
    from test_importcheck import _site_with

    name = venvinfo.BUNDLE_DIST.replace("-", "_")
    record, keys = _site_with(tmp_path, monkeypatch, {name: "VALUE = 1\n", "ic_afterbundle": "VALUE = 2\n",
                                                      "ic_skipme": "raise ImportError('never imported')\n"})
    bundle = keys[venvinfo.BUNDLE_DIST]
    out = _Events()
    res = venvinfo.verify(out=out, skip=("ic_skipme",), record=record, jobs=1)
    imported = [f["module"] for _, f in out.seen]
    assert res["failed"] == [] and "ic_skipme" not in imported
    assert imported[-1] == name and "ic_afterbundle" in imported[:-1]
    assert bundle not in importcheck.load_record(record) and keys["ic-afterbundle"] in importcheck.load_record(record)
    importcheck.save_record(record, importcheck.load_record(record), {bundle: {"dist": venvinfo.BUNDLE_DIST, "version": "1.0"}})
    out = _Events()
    again = venvinfo.verify(out=out, skip=("ic_skipme",), record=record, jobs=1)
    assert venvinfo.BUNDLE_DIST not in again["skipped"] and "ic-afterbundle" in again["skipped"] and again["failed"] == []
    assert [f["module"] for _, f in out.seen] == [m for m in imported if m != "ic_afterbundle"]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_verify_record_imports_torch_when_not_recorded_and_records_its_build(tmp_path, monkeypatch):
    """torch not verified before: verify imports it (first of all), reports the version, CUDA build and GPU count
    the worker read, and records torch's key with its version and CUDA build (what a later verify that skips
    torch reports)."""
    import torch

    from orchestrator.agent import importcheck
    from test_importcheck import _site_with

    record, keys = _site_with(tmp_path, monkeypatch, {})
    verified = importcheck.load_record(record)
    del verified[keys["torch"]]
    importcheck.save_record(record, verified, {})
    out = _Events()
    res = venvinfo.verify(out=out, record=record, jobs=1)
    assert out.seen[0][1]["module"] == "torch" and res["failed"] == [] and res["missing"] == {}
    gpus = torch.cuda.device_count() if torch.version.cuda else 0
    assert (res["torch"], res["cuda"], res["device_count"]) == (str(torch.__version__), torch.version.cuda, gpus)
    entry = importcheck.load_record(record)[keys["torch"]]
    assert {k: v for k, v in entry.items() if k != "at"} == {"dist": "torch", "version": torch.__version__,
                                                            "torch": str(torch.__version__), "cuda": torch.version.cuda}
    again = venvinfo.verify(out=_Events(), record=record, jobs=1)
    assert "torch" in again["skipped"] and (again["torch"], again["cuda"], again["device_count"]) == (
        str(torch.__version__), torch.version.cuda, None)


def test_verify_record_keeps_a_cuda_builds_torch_facts(tmp_path, monkeypatch):
    """torch a CUDA build, as a GPU machine's venv holds it: its CUDA version reaches the result and the record,
    and a later verify that skips torch reports it from there. This machine's torch is a CPU build (CUDA None, the
    same None a lost value reads), so the workers find a module `torch` ahead of it on the verifier's path that
    answers what a CUDA 12.9 build on a machine without a GPU answers (the distribution and its key stay the real
    torch's)."""
    from importlib import metadata

    from orchestrator.agent import bundlescan, importcheck
    from test_importcheck import _site_with

    record, keys = _site_with(tmp_path, monkeypatch, {})
    (tmp_path / "site" / "torch").mkdir()
    (tmp_path / "site" / "torch" / "__init__.py").write_text(
        "__version__ = '2.99.0+cu129'\n\nclass version:\n    cuda = '12.9'\n\n"
        "class cuda:\n    @staticmethod\n    def device_count():\n        return 0\n")
    verified = importcheck.load_record(record)
    del verified[keys["torch"]]
    importcheck.save_record(record, verified, {})
    # torch's other top-level modules (functorch, ...) import the real torch's submodules: not imported here.
    others = tuple(m for m in bundlescan.top_level_modules(metadata.distribution("torch")) if m != "torch")
    out = _Events()
    res = venvinfo.verify(out=out, skip=others, record=record, jobs=1)
    assert out.seen[0][1]["module"] == "torch"  # first of all
    assert res["failed"] == [] and (res["torch"], res["cuda"], res["device_count"]) == ("2.99.0+cu129", "12.9", 0)
    entry = importcheck.load_record(record)[keys["torch"]]
    assert {k: v for k, v in entry.items() if k != "at"} == {"dist": "torch", "version": metadata.version("torch"),
                                                            "torch": "2.99.0+cu129", "cuda": "12.9"}
    again = venvinfo.verify(out=_Events(), skip=others, record=record, jobs=1)
    assert "torch" in again["skipped"] and (again["torch"], again["cuda"], again["device_count"]) == (
        "2.99.0+cu129", "12.9", None)
