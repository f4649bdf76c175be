"""rebuild-venv: pure builders (sync options, argv, bundle wheel, failure classes, bundle import scan) and
the real thing: uv, the cpu lock (torch CPU from /opt/wheels), a LocalTarget and a container on the fake
Proxmox host. Failures must leave `current` untouched and say which step failed and why.

The uv cache is shared by every test here (and kept between sessions, like a developer's cache) so torch
is unpacked into it once per machine; venvs hardlink from it. A cold cache is a fresh directory.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from orchestrator.agent import venvinfo
from orchestrator.errors import AgentError, UserError
from orchestrator.ops.lock import LockFile, resolve_lock
from orchestrator.ops.venv import (
    as_profile,
    bundle_wheel,
    classify,
    payload,
    rebuild_venv,
    script_argv,
    sync_options,
)
from orchestrator.target import ContainerTarget, LocalTarget
from orchestrator.transport.local import LocalTransport

UV_BIN = Path(sys.executable).with_name("uv")
SHARED_CACHE = os.environ.get("DFLASHCTL_TEST_UV_CACHE", "/var/tmp/dflashctl-test-uv-cache")
TORCH_WHEELS = "/opt/wheels"


def cpu_profile(**kw) -> dict:
    return {"kind": "uv", "lock": "cpu", "python": "3.11", "find_links": [TORCH_WHEELS], "uv_cache_dir": SHARED_CACHE,
            "keep": 2, **kw}


def local(workdir: Path, env: dict | None = None) -> LocalTarget:
    workdir.mkdir(parents=True, exist_ok=True)
    return LocalTarget(name="local", workdir=str(workdir), transport=LocalTransport(env=env))


def venvs_state(workdir: Path) -> tuple[str | None, list[str]]:
    """(current's link target, sorted entries of venvs/ that are not dotfiles)."""
    d = workdir / "venvs"
    cur = os.readlink(d / "current") if (d / "current").is_symlink() else None
    return cur, sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


def fresh_dir(prefix: str) -> Path:
    import tempfile

    # Not under /tmp: a fake container sees its own /tmp.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))


# ------------------------------------------------------------------------------------------- pure parts


def test_sync_options_from_profile_and_lock():
    lock = LockFile("x", Path("x.txt"), b"a==1 \\\n    --hash=sha256:00\n")
    p = as_profile({"kind": "uv", "index_url": "https://mirror/simple", "extra_index_urls": ["https://e1"],
                    "find_links": ["/w1", "/w2"]})
    assert sync_options(p, lock) == ["--require-hashes", "--index-url", "https://mirror/simple",
                                     "--extra-index-url", "https://e1", "--find-links", "/w1", "--find-links", "/w2"]
    assert sync_options(as_profile({"kind": "uv"}), LockFile("y", Path("y.txt"), b"a==1\n")) == []


def test_script_argv_passes_values_as_arguments_never_in_the_text():
    argv = script_argv("build", "/w d", lock_hash="L", bundle_hash="B", python="3.11", keep=2, force=True,
                       offline=False, cache=None, wheel="w.whl", wheel_sha="S", sync_opts=["--find-links", "/x"])
    assert argv[:2] == ["bash", "-c"]
    assert argv[3:] == ["rebuild-venv", "build", "/w d", "L", "B", "3.11", "2", "1", "0", "", "w.whl", "S",
                        "--find-links", "/x"]
    assert "/w d" not in argv[2]


def test_profile_validation():
    assert as_profile({"kind": "workstation"}) is None
    with pytest.raises(UserError, match="python request"):
        as_profile({"kind": "uv", "python": "3.11; rm -rf /"})
    with pytest.raises(UserError, match="cannot be rebuilt"):
        as_profile({"kind": "conda"})


def test_bundle_wheel_is_deterministic_and_its_record_is_true():
    from orchestrator.bundle import build_bundle

    b = build_bundle()
    w1 = bundle_wheel(b.hash, b.data)
    bundle_wheel.cache_clear()
    w2 = bundle_wheel(b.hash, b.data)
    assert w1.data == w2.data and w1.name == f"dflashctl_bundle-0+b{b.hash}-py3-none-any.whl"
    with zipfile.ZipFile(io.BytesIO(w1.data)) as zf:
        distinfo = f"dflashctl_bundle-0+b{b.hash}.dist-info"
        assert zf.read(f"{distinfo}/top_level.txt").decode().split() == ["orchestrator", "trainer"]
        assert "orchestrator/agent/venvinfo.py" in zf.namelist()
        for line in zf.read(f"{distinfo}/RECORD").decode().splitlines():
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                continue
            data = zf.read(name)
            import base64

            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)


def test_payload_is_a_tar_of_the_lock_and_the_wheel():
    import tarfile

    lock = LockFile("t", Path("t.txt"), b"a==1\n")
    from orchestrator.ops.venv import Wheel

    data = payload(lock, Wheel("w.whl", b"PK"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert tf.getnames() == ["lock.txt", "w.whl"]
        assert tf.extractfile("lock.txt").read() == b"a==1\n"
    assert payload(lock, Wheel("w.whl", b"PK")) == data


@pytest.mark.parametrize("tail, expected", [
    (["error: No solution found when resolving dependencies",
      "  cause: Because there is no version of pyyaml==99.0.0 and you require pyyaml==99.0.0, we can conclude"],
     "ResolutionError"),
    (["  cause: Because accelerate was not found in the cache and you require accelerate==1.15.0, we can conclude",
      "hint: Packages were unavailable because the network was disabled."], "OfflineCacheMiss"),
    (["error: Hash mismatch for `pyyaml==6.0.4`"], "HashMismatch"),
    (["error: something else entirely"], "SyncFailed"),
])
def test_sync_failures_are_classified(tail, expected):
    err = classify({"event": "error", "type": "SyncFailed", "step": "sync", "message": "uv pip sync failed",
                    "data": {"step": "sync", "tail": tail}})
    assert err.agent_type == expected
    assert "step `sync`" in err.message and "current venv is unchanged" in err.message
    assert err.fix


def test_verify_crash_names_the_last_module():
    err = classify({"event": "error", "type": "VerifyCrashed", "step": "verify", "message": "died", "data": {}},
                   last_import="torch")
    assert "'torch'" in err.message


def test_bundle_requirements_follow_imports_and_skip_optional_ones(tmp_path):
    root = tmp_path / "src"
    files = {
        "orchestrator/__init__.py": "",
        "orchestrator/agent/__init__.py": "from orchestrator import helper\n",
        "orchestrator/agent/verbs/__init__.py": "",
        "orchestrator/agent/verbs/go.py": "import json\n\ndef run():\n    import libtmux\n    from . import util\n",
        "orchestrator/agent/verbs/util.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rich\n",
        "orchestrator/helper.py": "import yaml\n",
        "orchestrator/cli.py": "import typer\n",  # workstation only: never reached from the roots
        "trainer/__init__.py": "try:\n    import matplotlib\nexcept ImportError:\n    matplotlib = None\n",
        "trainer/model.py": "import torch.nn as nn\nfrom torch import Tensor\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    needed = venvinfo.bundle_requirements(search=[str(root)])
    assert sorted(needed) == ["libtmux", "torch", "yaml"]
    assert needed["yaml"] == ["orchestrator/helper.py:1"]
    assert needed["torch"] == ["trainer/model.py:1", "trainer/model.py:2"]


def test_the_real_bundle_needs_torch_and_not_the_workstation_cli():
    needed = venvinfo.bundle_requirements()
    assert "torch" in needed and "transformers" in needed
    assert "typer" not in needed and "paramiko" not in needed


def test_fingerprint_api_without_a_venv_and_for_the_workstation(tmp_path):
    fp = venvinfo.current_fingerprint(str(tmp_path), {"kind": "uv", "lock": "cpu"})
    diff = venvinfo.fingerprint_diff(fp, "abc")
    assert fp["lock_hash"] is None and len(diff) == 1 and "rebuild-venv" in diff[0]
    ws = venvinfo.current_fingerprint(str(tmp_path), {"kind": "workstation"})
    assert ws["lock_hash"] is None and ws["python"] == ".".join(map(str, sys.version_info[:3]))
    assert ws["packages"]["pydantic"] and venvinfo.fingerprint_diff(ws, None) == []
    old, new = dict(ws, packages={"a": "1", "b": "2"}), dict(ws, packages={"a": "1", "b": "3", "c": "1"})
    assert venvinfo.diff_fingerprints(old, new) == ["b: 2 -> 3", "c: (absent) -> 1"]


# ------------------------------------------------------------------------------- real builds, locally


@pytest.fixture(scope="module")
def built():
    """One cpu venv built in a module-wide workdir (the shared cache makes it a hardlink install)."""
    wd = fresh_dir("dflash-venv-local-")
    target = local(wd)
    events: list[dict] = []
    report = rebuild_venv(target, cpu_profile(), on_event=events.append)
    yield target, wd, report, events
    subprocess.run(["rm", "-rf", str(wd)])


@pytest.mark.slow
def test_build_from_the_cpu_lock(built):
    target, wd, report, events = built
    lock = resolve_lock("cpu")
    assert report.action == "built" and report.lock_hash == lock.hash and report.commands == 1
    cur, entries = venvs_state(wd)
    assert cur == report.venv and cur.startswith(lock.hash + "-") and report.venv in entries
    fp = json.loads((wd / "venvs" / "current" / venvinfo.FINGERPRINT).read_text())
    assert fp["lock_hash"] == lock.hash and fp["torch"] == "2.13.0+cpu" and fp["cuda"] is None
    assert fp["packages"]["transformers"] == lock.pins()["transformers"]
    assert fp["packages"]["dflashctl-bundle"] == f"0+b{report.bundle_hash}"
    assert any(line.startswith("torch==2.13.0+cpu") for line in fp["freeze"])
    # uv's own lines and one event per imported module came through as events.
    assert any(e.get("event") == "log" and "torch==2.13.0+cpu" in e.get("line", "") for e in events)
    assert any(e.get("step") == "verify" and e.get("module") == "torch" for e in events)
    # The venv runs the bundle's container-side code.
    py = wd / "venvs" / "current" / "bin" / "python"
    out = subprocess.run([str(py), "-I", "-c", "import trainer.model, orchestrator.agent.verbs.ping; print('ok')"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
    # The fingerprint verb (what launch preflight uses) agrees.
    res = LocalTarget(name="l", workdir=str(wd), transport=LocalTransport()).agent(
        "fingerprint", {"profile": cpu_profile(), "expected_lock_hash": lock.hash})
    assert res["diff"] == [] and res["fingerprint"]["venv"] == report.venv
    stale = target.agent("fingerprint", {"profile": cpu_profile(), "expected_lock_hash": "0" * 16})
    assert "rebuild-venv" in stale["diff"][0]


@pytest.mark.slow
def test_noop_when_current_matches(built):
    target, wd, report, _ = built
    before = venvs_state(wd)
    again = rebuild_venv(target, cpu_profile())
    assert again.action == "noop" and again.venv == report.venv and again.commands == 1
    assert again.fingerprint["lock_hash"] == report.lock_hash
    assert venvs_state(wd) == before


@pytest.mark.slow
def test_a_pin_that_does_not_exist_leaves_current_untouched(built, tmp_path):
    target, wd, report, _ = built
    bad = tmp_path / "bad.txt"
    bad.write_text("pyyaml==99.0.0\n")
    before = venvs_state(wd)
    with pytest.raises(AgentError) as exc:
        rebuild_venv(target, cpu_profile(lock=str(bad)))
    assert exc.value.agent_type == "ResolutionError"
    assert "step `sync`" in exc.value.message and "pyyaml==99.0.0" in exc.value.message
    assert venvs_state(wd) == before
    assert not [p for p in (wd / "venvs").iterdir() if p.name.startswith(".stage")]
    py = wd / "venvs" / "current" / "bin" / "python"
    assert subprocess.run([str(py), "-c", "import torch"]).returncode == 0


@pytest.mark.slow
def test_a_lock_without_a_module_the_bundle_imports_is_refused(built):
    target, wd, report, _ = built
    before = venvs_state(wd)
    with pytest.raises(AgentError) as exc:
        rebuild_venv(target, cpu_profile(lock="test"))
    assert exc.value.agent_type == "LockMissesModule"
    assert "torch (trainer/" in exc.value.message and "step `verify`" in exc.value.message
    assert "torch" in exc.value.data["missing"]
    assert venvs_state(wd) == before


@pytest.mark.slow
def test_offline_rebuild_on_a_warm_cache_then_rollback_and_prune(built):
    target, wd, report, _ = built
    venvs = wd / "venvs"
    # Leftovers: an old complete venv and a half-built one; keep=2 leaves room for current + previous only.
    for name, complete in (("0000000000000000-20200101T000000.000Z", True), ("1111111111111111-20200101T000001.000Z", False)):
        (venvs / name / "bin").mkdir(parents=True)
        if complete:
            (venvs / name / venvinfo.STAMP).write_text("0000000000000000 x 3.11\n")
    second = rebuild_venv(target, cpu_profile(), offline=True, force=True)
    assert second.action == "built" and second.venv != report.venv and second.previous == report.venv
    assert sorted(second.pruned) == ["0000000000000000-20200101T000000.000Z", "1111111111111111-20200101T000001.000Z"]
    cur, entries = venvs_state(wd)
    assert cur == second.venv and entries == sorted(["current", "previous", report.venv, second.venv])

    back = rebuild_venv(target, cpu_profile(), rollback=True)
    assert back.action == "rollback" and back.venv == report.venv and back.previous == second.venv
    assert os.readlink(venvs / "current") == report.venv and os.readlink(venvs / "previous") == second.venv
    assert back.fingerprint["venv"] == report.venv
    # The rolled-back venv matches the lock: the next rebuild is a no-op.
    assert rebuild_venv(target, cpu_profile()).action == "noop"


def test_rollback_without_a_previous_venv_says_so(tmp_path):
    with pytest.raises(AgentError) as exc:
        rebuild_venv(local(tmp_path / "w"), cpu_profile(), rollback=True)
    assert exc.value.agent_type == "NoPrevious" and "rebuild-venv" in exc.value.fix


def test_offline_with_a_cold_cache_fails_readably(tmp_path):
    cold = fresh_dir("dflash-uv-cold-")
    try:
        wd = tmp_path / "w"
        with pytest.raises(AgentError) as exc:
            rebuild_venv(local(wd), cpu_profile(uv_cache_dir=str(cold)), offline=True)
        assert exc.value.agent_type == "OfflineCacheMiss"
        assert "--offline" in exc.value.message and "not found in the cache" in exc.value.message
        assert "without --offline" in exc.value.fix
        assert venvs_state(wd) == (None, [])
    finally:
        subprocess.run(["rm", "-rf", str(cold)])


def test_no_uv_and_no_way_to_install_it_says_how(tmp_path):
    # PATH without uv; python3 is the system one (no uv module; pip refuses --user installs: PEP 668).
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}
    if subprocess.run(["/usr/bin/python3", "-m", "uv", "--version"], capture_output=True).returncode == 0:
        pytest.skip("the system python3 has uv")
    with pytest.raises(AgentError) as exc:
        rebuild_venv(local(tmp_path / "w", env=env), cpu_profile(), offline=True)
    assert exc.value.agent_type == "UvMissing" and "step `uv`" in exc.value.message
    assert "pip install --user uv" in exc.value.fix


def test_workstation_profile_builds_nothing(tmp_path):
    rep = rebuild_venv(local(tmp_path / "w"), {"kind": "workstation"})
    assert rep.action == "workstation" and not (tmp_path / "w" / "venvs").exists()


# --------------------------------------------------------------------------- a container on the fake host


@pytest.fixture
def ct_with_uv(fake_pve):
    ct = fake_pve.create_container(331, gpus=2)
    # uv "installed in the container": the stand-in sbin dir is /usr/local/sbin inside it.
    os.symlink(os.path.realpath(UV_BIN), Path(ct.dir) / "sbin" / "uv")
    yield ct
    ct.stop()
    fake_pve.remove_container(ct.ctid)


@pytest.mark.slow
def test_container_build_noop_in_one_pct_call_and_a_failed_rebuild_keeps_launch_working(pve, ct_with_uv, tmp_path,
                                                                                       monkeypatch):
    from orchestrator.ops.launch import LaunchSpec, launch

    ct = ct_with_uv
    target = ContainerTarget(name="ct331", workdir=ct.workdir, transport=pve.pct_transport(ct.ctid),
                             home=str(Path(ct.dir) / "home"))
    try:
        first = rebuild_venv(target, cpu_profile())
        assert first.action == "built" and first.fingerprint["torch"] == "2.13.0+cpu"
        # The stand-in nvidia-smi answers inside the container: the driver is recorded.
        assert first.fingerprint["driver"]
        pve.clear_pct_calls()
        again = rebuild_venv(target, cpu_profile())
        assert again.action == "noop"
        assert len(pve.pct_calls()) == 1 and pve.pct_calls()[0][:2] == ["pct", "exec"]

        bad = tmp_path / "bad.txt"
        bad.write_text("pyyaml==99.0.0\n")
        pve.clear_pct_calls()
        with pytest.raises(AgentError) as exc:
            rebuild_venv(target, cpu_profile(lock=str(bad)))
        assert exc.value.agent_type == "ResolutionError" and len(pve.pct_calls()) == 1
        assert os.readlink(Path(ct.workdir) / "venvs" / "current") == first.venv

        # A launch still works: preflight finds the venv matching the cpu lock and starts the run in tmux.
        monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
        spec = LaunchSpec(experiment="after-failed-rebuild", kind="command", target="ct331", gpus=[],
                          command=[f"{ct.workdir}/venvs/current/bin/python", "-c", "import torch; print('torch', torch.__version__)"],
                          venv_profile=cpu_profile(), lock_hash=resolve_lock("cpu").hash)
        result = launch(target, spec)
        run_dir = Path(result.run_dir)
        deadline = time.monotonic() + 60
        while not (run_dir / "exit.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert json.loads((run_dir / "exit.json").read_text())["exit_code"] == 0
        assert "torch 2.13.0+cpu" in (run_dir / "train.log").read_text()
    finally:
        target.close()


def test_container_rebuild_refuses_a_torch_the_driver_cannot_run_before_downloading_it(pve, ct_with_uv,
                                                                                    claim_cuda_venv):
    ct = ct_with_uv
    ct.set_driver("550.54.15", "12.4")
    ct.set_kernel_module("550.54.15")
    # The venv in use (a CPU one): it must stay current whatever the rebuild does.
    claim_cuda_venv(ct.workdir, lock="cpu", torch="2.13.0+cpu", cuda=None)
    before = venvs_state(Path(ct.workdir))
    target = ContainerTarget(name="ct331", workdir=ct.workdir, transport=pve.pct_transport(ct.ctid),
                             home=str(Path(ct.dir) / "home"))
    cuda = {"kind": "uv", "lock": "cuda", "python": "3.11", "uv_cache_dir": SHARED_CACHE}  # PyPI's torch: CUDA 13.0
    try:
        events: list[dict] = []
        pve.clear_pct_calls()
        # --offline: should the check ever let it through, the sync fails on the cache instead of
        # downloading gigabytes of CUDA wheels.
        with pytest.raises(AgentError) as exc:
            rebuild_venv(target, cuda, on_event=events.append, offline=True)
        assert exc.value.agent_type == "DriverTooOld" and len(pve.pct_calls()) == 1
        assert exc.value.message == (
            "rebuild-venv failed at step `driver`: the venv's torch 2.13.0 is built for CUDA 13.0, but the NVIDIA "
            "driver 550.54.15 runs CUDA 12.4 at most (CUDA 13.x needs driver >= 580) (the current venv is unchanged)")
        assert exc.value.fix.startswith("use a torch built for CUDA 12: dflashctl lock cuda --extra-index-url "
                                        "https://download.pytorch.org/whl/cu126")
        assert "dflashctl rebuild-venv --target ct331" in exc.value.fix
        assert not any(e.get("step") == "sync" for e in events)  # refused before the multi-GB download
        assert venvs_state(Path(ct.workdir)) == before  # current untouched, the new venv removed

        # The host's kernel module moved on without the container's libraries: refused the same way.
        ct.set_kernel_module("570.133.20")
        with pytest.raises(AgentError) as exc:
            rebuild_venv(target, cuda, offline=True)
        assert exc.value.agent_type == "DriverLibraryMismatch" and "step `driver`" in exc.value.message
        assert "libnvidia-ml 550.54" in exc.value.message and "kernel module 570.133.20" in exc.value.message
        assert "sh NVIDIA-Linux-x86_64-570.133.20.run --no-kernel-modules" in exc.value.fix
        assert venvs_state(Path(ct.workdir)) == before
    finally:
        target.close()


def test_container_without_uv_explains_how_to_install_it(pve, fake_pve):
    ct = fake_pve.create_container(332, gpus=0)
    target = ContainerTarget(name="ct332", workdir=ct.workdir, transport=pve.pct_transport(ct.ctid),
                             home=str(Path(ct.dir) / "home"))
    try:
        if ct.exec(["python3", "-m", "uv", "--version"]).returncode == 0:
            pytest.skip("the container's python3 has uv")
        with pytest.raises(AgentError) as exc:
            rebuild_venv(target, cpu_profile())
        assert exc.value.agent_type == "UvMissing"
        assert "pip install --user uv" in exc.value.fix and "astral-sh/uv/releases" in exc.value.fix
        assert not (Path(ct.workdir) / "venvs" / "current").exists()
    finally:
        target.close()
        ct.stop()
        fake_pve.remove_container(ct.ctid)
