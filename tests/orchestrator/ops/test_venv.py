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

from orchestrator.agent import bundlescan, venvfingerprint, venvinfo
from orchestrator.errors import AgentError, UserError
from orchestrator.ops.lock import LockFile, resolve_lock
from orchestrator.ops.venv import rebuild_venv
from orchestrator.ops.venvpayload import as_profile, bundle_wheel, payload, script_argv, sync_options
from orchestrator.ops.venvreport import classify
from orchestrator.target import ContainerTarget, LocalTarget
from orchestrator.transport.local import LocalTransport

SHARED_CACHE = os.environ.get("DFLASHCTL_TEST_UV_CACHE", "/var/tmp/dflashctl-test-uv-cache")
TORCH_WHEELS = "/opt/wheels"


def cpu_profile(**kw) -> dict:
    return {"kind": "uv", "lock": "cpu", "python": "3.11", "wheelhouse": [TORCH_WHEELS], "uv_cache_dir": SHARED_CACHE,
            "keep": 2, **kw}


def local(workdir: Path, env: dict | None = None) -> LocalTarget:
    workdir.mkdir(parents=True, exist_ok=True)
    return LocalTarget(name="local", workdir=str(workdir), transport=LocalTransport(env=env))


def venvs_state(workdir: Path) -> tuple[str | None, list[str]]:
    """(current's link target, sorted entries of venvs/ that are not dotfiles)."""
    d = workdir / "venvs"
    cur = os.readlink(d / "current") if (d / "current").is_symlink() else None
    return cur, sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


def seed_verified_wheels(verified_in: Path, workdir: Path) -> None:
    """Give `workdir` the verified-wheels record of `verified_in` (another workdir on this machine where the
    same lock was built and imported on the same Python): its next build imports only what changed (the
    bundle), as a developer's second workdir would not, but the import check itself is what
    test_build_from_the_cpu_lock and the stock container's first build defend; a test that is about
    something else is spared a full import of torch and transformers."""
    record = Path(verified_in) / "venvs" / ".verified-wheels.json"
    assert record.is_file(), f"{verified_in} holds no verified-wheels record"
    (Path(workdir) / "venvs").mkdir(parents=True, exist_ok=True)
    (Path(workdir) / "venvs" / record.name).write_bytes(record.read_bytes())


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
                       offline=False, cache=None, wheel="w.whl", wheel_sha="S", uv_version="0.13.9", uv_sha="U",
                       tmux=True, sync_opts=["--find-links", "/x"])
    assert argv[:2] == ["bash", "-c"]
    assert argv[3:] == ["rebuild-venv", "build", "/w d", "L", "B", "3.11", "2", "1", "0", "", "w.whl", "S",
                        "-", "0.13.9", "U", "1", "--find-links", "/x"]
    assert "/w d" not in argv[2]
    # The pip path is gone: PEP 668 refuses it on Debian 12, and no uv ever comes from the internet.
    assert "pip install" not in argv[2] and "astral.sh" not in argv[2]


def test_profile_validation():
    assert as_profile({"kind": "workstation"}) is None and as_profile({"kind": "system"}) is None
    # No profile is the running interpreter, as the agent reads it (one rule, venvfingerprint.profile_kind): it
    # builds nothing, not a uv venv of the default lock.
    assert as_profile({}) is None and as_profile(None) is None
    assert as_profile({"kind": "uv"}) is not None and as_profile({"lock": "cpu"}).lock == "cpu"
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
        assert {f"orchestrator/agent/{m}.py" for m in ("venvinfo", "venvfingerprint", "bundlescan", "importcheck")} <= set(zf.namelist())
        for line in zf.read(f"{distinfo}/RECORD").decode().splitlines():
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                continue
            data = zf.read(name)
            import base64

            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)


def test_payload_is_a_tar_of_the_lock_and_the_wheel_and_what_travels_inline(tmp_path):
    import tarfile

    from orchestrator.ops.carry import CarriedWheel, UvBinary
    from orchestrator.ops.venvpayload import Wheel

    lock = LockFile("t", Path("t.txt"), b"a==1\n")
    data = payload(lock, Wheel("w.whl", b"PK"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert tf.getnames() == ["lock.txt", "w.whl", "wheels.sha256"]
        assert tf.extractfile("lock.txt").read() == b"a==1\n" and tf.extractfile("wheels.sha256").read() == b""
    assert payload(lock, Wheel("w.whl", b"PK")) == data

    (tmp_path / "uv").write_bytes(b"\x7fELF uv")
    (tmp_path / "a-1-py3-none-any.whl").write_bytes(b"PK a")
    (tmp_path / "b-2-py3-none-any.whl").write_bytes(b"PK b")
    a = CarriedWheel("a-1-py3-none-any.whl", str(tmp_path / "a-1-py3-none-any.whl"), "aa" * 32, 4)
    b = CarriedWheel("b-2-py3-none-any.whl", str(tmp_path / "b-2-py3-none-any.whl"), "bb" * 32, 4)
    uv = UvBinary(str(tmp_path / "uv"), "0.13.9", "cc" * 32)
    data = payload(lock, Wheel("w.whl", b"PK"), [a, b], send_wheels=[b], uv=uv)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        # Every wheel the target must hold is listed (sha256sum's format); only `b` and uv travel.
        assert tf.getnames() == ["lock.txt", "w.whl", "wheels.sha256", "uv", "wheels/b-2-py3-none-any.whl"]
        assert tf.extractfile("wheels.sha256").read().decode() == f"{'aa' * 32}  a-1-py3-none-any.whl\n{'bb' * 32}  b-2-py3-none-any.whl\n"
        assert tf.getmember("uv").mode == 0o755 and tf.extractfile("uv").read() == b"\x7fELF uv"


def test_lock_hashes_and_the_wheelhouse_wheels_a_lock_accepts(tmp_path):
    from orchestrator.ops.carry import lock_wheels, wheel_pin

    good, other = tmp_path / "demo_pkg-1.0-py3-none-any.whl", tmp_path / "zzz-2.0-py3-none-any.whl"
    good.write_bytes(b"the locked wheel")
    other.write_bytes(b"not locked")
    (tmp_path / "demo_pkg-0.9-py3-none-any.whl").write_bytes(b"another version")
    sha = hashlib.sha256(b"the locked wheel").hexdigest()
    text = (f"demo-pkg==1.0 \\\n    --hash=sha256:{sha} \\\n    --hash=sha256:{'0' * 64}\n    # via -r x.in\n"
            f"zzz==2.0 \\\n    --hash=sha256:{'1' * 64}\n")
    lock = LockFile("x", tmp_path / "x.txt", text.encode())
    assert lock.hashes() == {"demo-pkg": {sha, "0" * 64}, "zzz": {"1" * 64}}
    assert wheel_pin("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl") == ("torch", "2.13.0+cpu")
    # zzz's file is not the locked one (its hash differs), 0.9 is not the pinned version: only demo_pkg travels.
    assert [(w.file, w.sha256) for w in lock_wheels(lock, [str(tmp_path)])] == [(good.name, sha)]
    with pytest.raises(UserError, match="wheelhouse"):
        lock_wheels(lock, [str(tmp_path / "missing")])


def test_what_a_target_holds_is_remembered_per_target(tmp_path, monkeypatch):
    from orchestrator.ops import carry

    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    assert carry.known("h:22/200//w") == {"uv": None, "wheels": {}}
    w = carry.CarriedWheel("a-1-py3-none-any.whl", "/x", "ab" * 32, 1)
    carry.remember("h:22/200//w", "cd" * 32, [w])
    assert carry.known("h:22/200//w") == {"uv": "cd" * 32, "wheels": {w.file: "ab" * 32}}
    assert carry.known("h:22/201//w") == {"uv": None, "wheels": {}}
    uv = carry.workstation_uv()
    assert os.access(uv.path, os.X_OK) and uv.sha256 == hashlib.sha256(Path(uv.path).read_bytes()).hexdigest()
    assert subprocess.run([uv.path, "--version"], capture_output=True, text=True).stdout.split()[1] == uv.version


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
    needed = bundlescan.bundle_requirements(search=[str(root)])
    assert sorted(needed) == ["libtmux", "torch", "yaml"]
    assert needed["yaml"] == ["orchestrator/helper.py:1"]
    assert needed["torch"] == ["trainer/model.py:1", "trainer/model.py:2"]


def test_the_real_bundle_needs_torch_and_not_the_workstation_cli():
    needed = bundlescan.bundle_requirements()
    assert "torch" in needed and "transformers" in needed
    assert "typer" not in needed and "paramiko" not in needed


def test_fingerprint_api_without_a_venv_and_for_the_workstation(tmp_path):
    fp = venvfingerprint.current_fingerprint(str(tmp_path), {"kind": "uv", "lock": "cpu"})
    diff = venvfingerprint.fingerprint_diff(fp, "abc")
    assert fp["lock_hash"] is None and len(diff) == 1 and "rebuild-venv" in diff[0]
    ws = venvfingerprint.current_fingerprint(str(tmp_path), {"kind": "workstation"})
    assert ws["lock_hash"] is None and ws["python"] == ".".join(map(str, sys.version_info[:3]))
    assert ws["packages"]["pydantic"] and venvfingerprint.fingerprint_diff(ws, None) == []


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
    fp = json.loads((wd / "venvs" / "current" / venvfingerprint.FINGERPRINT).read_text())
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
    events: list[dict] = []
    second = rebuild_venv(target, cpu_profile(), offline=True, force=True, on_event=events.append)
    assert second.action == "built" and second.venv != report.venv and second.previous == report.venv
    # Same lock, same Python, same workdir: only the bundle's modules are imported again.
    assert {e["module"] for e in events if e.get("step") == "verify" and e.get("module")} == {"orchestrator", "trainer"}
    assert sorted(second.pruned) == ["0000000000000000-20200101T000000.000Z", "1111111111111111-20200101T000001.000Z"]
    cur, entries = venvs_state(wd)
    assert cur == second.venv and entries == sorted(["current", "previous", report.venv, second.venv])

    back = rebuild_venv(target, cpu_profile(), rollback=True)
    assert back.action == "rollback" and back.venv == report.venv and back.previous == second.venv
    assert os.readlink(venvs / "current") == report.venv and os.readlink(venvs / "previous") == second.venv
    assert back.fingerprint["venv"] == report.venv
    # The rolled-back venv matches the lock: the next rebuild is a no-op.
    assert rebuild_venv(target, cpu_profile()).action == "noop"


@pytest.mark.slow
def test_the_rebuild_venv_verb_through_the_installed_cli(dflashctl, built, tmp_path):
    """`dflashctl rebuild-venv` as a user runs it, on a local target with the cpu lock: a rollback with nothing
    to go back to, a build, a no-op (--json), a forced offline rebuild, a rollback, and a flag clash; what
    each prints and where `current` points after it. The workdir starts with `built`'s verified-wheels
    record (no venv): the full import check is test_build_from_the_cpu_lock's."""
    import yaml

    wd = fresh_dir("dflash-venv-cli-")
    try:
        seed_verified_wheels(built[1], wd)
        inv = tmp_path / "inventory.yaml"
        inv.write_text(yaml.safe_dump({
            "targets": {"local": {"kind": "local", "workdir": str(wd), "venv": "cpu"}},
            "venvs": {"cpu": cpu_profile()}}))
        run = lambda *a: dflashctl("-i", str(inv), "rebuild-venv", *a, timeout=1200)  # noqa: E731
        lock = resolve_lock("cpu")
        env = f"(python {'.'.join(map(str, sys.version_info[:3]))}, torch 2.13.0+cpu, CUDA None)"

        r = run("--rollback")
        assert r.returncode == 1 and r.stderr.splitlines() == [  # nothing before it (no live display off a tty)
            f"error: rebuild-venv failed at step `rollback`: no previous venv to roll back to in {wd}/venvs (the "
            "current venv is unchanged)", f"fix: build one first: dflashctl -i {inv} rebuild-venv"], r.stderr
        assert not (wd / "venvs" / "current").exists()

        r = run()
        assert r.returncode == 0, r.stderr
        first = os.readlink(wd / "venvs" / "current")
        head = f"local: built {first} from lock cpu ({lock.hash}) in "
        assert r.stdout.startswith(head) and r.stdout.splitlines()[0].endswith(env), r.stdout
        assert r.stdout.splitlines()[1].startswith("  steps: stage ")

        r = run("--json")
        assert r.returncode == 0, r.stderr
        noop = json.loads(r.stdout)
        assert (noop["action"], noop["venv"], noop["lock_hash"]) == ("noop", first, lock.hash)

        r = run("--force", "--offline")
        assert r.returncode == 0, r.stderr
        second = os.readlink(wd / "venvs" / "current")
        back = f"dflashctl -i {inv} rebuild-venv --target local --rollback"  # pasteable: this inventory, this target
        assert second != first and f"  previous: {first} ({back})" in r.stdout.splitlines()

        # pasted as printed, in a 40-column terminal: rich wraps nothing of ours (its report is still one line)
        r = subprocess.run(["bash", "-c", back], capture_output=True, text=True, timeout=1200,
                           env=dict(os.environ, COLUMNS="40"))
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [f"local: current -> {first} {env}; was {second}"]
        assert os.readlink(wd / "venvs" / "current") == first

        r = run("--rollback", "--force")
        assert r.returncode == 1 and r.stderr.splitlines() == [
            "error: --rollback takes no --force or --offline", f"fix: dflashctl -i {inv} rebuild-venv --rollback"]
    finally:
        subprocess.run(["rm", "-rf", str(wd)])


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


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_local_target_uses_the_workstations_own_uv_even_off_path(tmp_path):
    # PATH without uv and a HOME without ~/.local/bin/uv: the binary of the installed `uv` package is used
    # (before: "uv is not installed", then a pip --user install that PEP 668 refuses).
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}
    assert subprocess.run(["bash", "-c", "command -v uv"], env=env, capture_output=True).returncode != 0
    with pytest.raises(AgentError) as exc:
        rebuild_venv(local(tmp_path / "w", env=env), cpu_profile(lock="test"))
    # uv created the venv and synced the lock; the small `test` lock lacks torch, which verify then refuses.
    assert exc.value.agent_type == "LockMissesModule" and "step `verify`" in exc.value.message


def test_workstation_and_system_profiles_build_nothing(tmp_path):
    rep = rebuild_venv(local(tmp_path / "w"), {"kind": "workstation"})
    assert rep.action == "workstation" and not (tmp_path / "w" / "venvs").exists()
    assert rebuild_venv(local(tmp_path / "w"), {"kind": "system"}).action == "system"


# ---------------------------------------------------------------- a stock Debian 12 container on the fake host
# Its own root file system (tests/fakehost/rootfs.py): Debian's python3 under PEP 668, no pip, no uv, no tmux.
# It sees nothing of this workstation: uv and the torch wheel reach it only through rebuild-venv's stdin. Its
# uv cache lives in the fake host's storage (mounted in, as a PVE admin might share a cache), so the PyPI
# downloads happen once per machine, not once per test.


def stock_profile(fake_pve, **kw) -> dict:
    return {"kind": "uv", "lock": "cpu", "python": "3.11", "wheelhouse": [TORCH_WHEELS],
            "uv_cache_dir": str(fake_pve.storage() / "uv-cache"), "keep": 2, **kw}


def stock_target(fake_pve, ct) -> ContainerTarget:
    return ContainerTarget(name=f"ct{ct.ctid}", workdir=ct.workdir, transport=fake_pve.pct_transport(ct.ctid))


@pytest.fixture(scope="module")
def stock_built(fake_pve, tmp_path_factory):
    """A fresh stock container (its template's python3, no tmux) and the first rebuild-venv into it, with a
    state dir of its own (so this workstation knows nothing the container holds)."""
    from fakehost import STOCK

    state = tmp_path_factory.mktemp("state")
    old = os.environ.get("DFLASHCTL_STATE_DIR")
    os.environ["DFLASHCTL_STATE_DIR"] = str(state)
    ct = fake_pve.create_container(331, gpus=2, image=STOCK, network=True)  # apt (tmux) and PyPI (the lock)
    before = {cmd: ct.exec(["sh", "-c", cmd]).returncode for cmd in
              ("command -v uv", "command -v tmux", "python3 -m pip --version")}
    target = stock_target(fake_pve, ct)
    fake_pve.clear_pct_calls()
    events: list[dict] = []
    try:
        report = rebuild_venv(target, stock_profile(fake_pve), on_event=events.append)
        yield ct, target, report, events, before, len(fake_pve.pct_exec_calls(331))
    finally:
        target.close()
        fake_pve.remove_container(ct.ctid)
        if old is None:
            os.environ.pop("DFLASHCTL_STATE_DIR", None)
        else:
            os.environ["DFLASHCTL_STATE_DIR"] = old


@pytest.mark.slow
def test_a_stock_container_gets_uv_tmux_and_the_torch_wheel_in_one_pct_exec(fake_pve, stock_built):
    from orchestrator.ops.carry import workstation_uv

    ct, target, report, events, before, execs = stock_built
    assert before == {"command -v uv": 127, "command -v tmux": 127, "python3 -m pip --version": 1}, before
    torch_wheel = next(Path(TORCH_WHEELS).glob("torch-*.whl")).name
    assert report.action == "built" and report.commands == 1 and execs == 1
    assert report.carried == ["uv", torch_wheel] and report.tmux == "installed" and report.warnings == []
    # The venv runs on the container's own python3 (Debian's 3.11), with the locked CPU torch.
    fp = report.fingerprint
    assert fp["torch"] == "2.13.0+cpu" and fp["python"].startswith("3.11.") and fp["driver"]
    assert ct.exec(["python3", "-c", "import platform; print(platform.python_version())"]).stdout.decode().strip() == fp["python"]
    uv_in_ct = Path(ct.workdir) / "bin" / "uv"
    assert hashlib.sha256(uv_in_ct.read_bytes()).hexdigest() == workstation_uv().sha256
    # Nothing root-wide: still no uv on PATH, still no pip in the system python3; tmux is now there.
    assert ct.exec(["sh", "-c", "command -v uv"]).returncode == 127
    assert ct.exec(["python3", "-m", "pip", "--version"]).returncode == 1
    assert ct.exec(["tmux", "-V"]).returncode == 0
    assert any(e.get("event") == "log" and e.get("source") == "apt" for e in events)


@pytest.mark.slow
def test_a_warm_rebuild_imports_only_what_changed_and_a_wrong_memory_costs_one_retry(fake_pve, stock_built):
    ct, target, report, _, _, _ = stock_built
    events: list[dict] = []
    fake_pve.clear_pct_calls()
    again = rebuild_venv(target, stock_profile(fake_pve), force=True, on_event=events.append)
    assert again.action == "built" and again.carried == [] and len(fake_pve.pct_exec_calls(331)) == 1
    imported = {e["module"] for e in events if e.get("step") == "verify" and e.get("module")}
    assert imported == {"orchestrator", "trainer"}  # the bundle changes with every build; the lock's wheels did not
    done = [e for e in events if e.get("step") == "verify" and e.get("skipped")]
    assert "torch" in done[-1]["skipped"] and "transformers" in done[-1]["skipped"]
    assert again.fingerprint["torch"] == "2.13.0+cpu"  # from the record: torch was not imported again

    # The container lost its uv (this workstation still believes it holds it): the script asks, and the
    # second and last command brings it.
    (Path(ct.workdir) / "bin" / "uv").unlink()
    fake_pve.clear_pct_calls()
    third = rebuild_venv(target, stock_profile(fake_pve), force=True)
    assert third.action == "built" and third.commands == 2 and third.carried == ["uv"]
    assert len(fake_pve.pct_exec_calls(331)) == 2


@pytest.mark.slow
def test_container_noop_in_one_pct_call_and_a_failed_rebuild_keeps_launch_working(fake_pve, stock_built, tmp_path,
                                                                                 monkeypatch):
    from orchestrator.ops.launch import LaunchSpec, launch

    ct, target, first, _, _, _ = stock_built
    current = os.readlink(Path(ct.workdir) / "venvs" / "current")
    fake_pve.clear_pct_calls()
    again = rebuild_venv(target, stock_profile(fake_pve))
    assert again.action == "noop" and again.tmux == "present"
    assert len(fake_pve.pct_calls()) == 1 and fake_pve.pct_calls()[0][:2] == ["pct", "exec"]

    bad = tmp_path / "bad.txt"
    bad.write_text("pyyaml==99.0.0\n")
    fake_pve.clear_pct_calls()
    with pytest.raises(AgentError) as exc:
        rebuild_venv(target, stock_profile(fake_pve, lock=str(bad)))
    assert exc.value.agent_type == "ResolutionError" and len(fake_pve.pct_calls()) == 1
    assert os.readlink(Path(ct.workdir) / "venvs" / "current") == current

    # A launch still works: preflight finds the venv matching the cpu lock and starts the run in the tmux
    # that rebuild-venv installed.
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    spec = LaunchSpec(experiment="after-failed-rebuild", kind="command", target="ct331", gpus=[],
                      command=[f"{ct.workdir}/venvs/current/bin/python", "-c", "import torch; print('torch', torch.__version__)"],
                      venv_profile=stock_profile(fake_pve), lock_hash=resolve_lock("cpu").hash)
    result = launch(target, spec)
    run_dir = Path(result.run_dir)
    deadline = time.monotonic() + 60
    while not (run_dir / "exit.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert json.loads((run_dir / "exit.json").read_text())["exit_code"] == 0
    assert "torch 2.13.0+cpu" in (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_offline_without_tmux_warns_with_a_fix_that_works_as_printed(fake_pve, stock_built, tmp_path, monkeypatch):
    from fakehost import STOCK

    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    ct = fake_pve.create_container(333, gpus=0, image=STOCK, network=True)  # the pasted fix runs apt
    # The same image's python3 and the same wheels as stock_built's container: its record spares this build
    # the full import check (the first build's, defended above); what is tested here is tmux and the warning.
    seed_verified_wheels(Path(stock_built[0].workdir), Path(ct.workdir))
    ct.to_container(ct.workdir)  # made by the host's root: the unprivileged container's root cannot write it
    target = stock_target(fake_pve, ct)
    try:
        # --offline: the template's empty package lists may not be refreshed, so apt cannot find tmux. The
        # venv still builds (uv cache + the carried wheels); the warning carries the command that fixes it.
        rep = rebuild_venv(target, stock_profile(fake_pve), offline=True)
        assert rep.action == "built" and rep.tmux == "missing"
        (warning,) = rep.warnings
        assert warning["type"] == "TmuxMissing" and "--offline" in warning["message"]
        # The runnable line: ssh with the inventory's settings, the pct command quoted as ONE argument.
        assert warning["fix"] == target.transport.command_line(["sh", "-c", "apt-get update && apt-get install -y tmux"])
        assert warning["fix"].startswith(f"ssh -p {fake_pve.port} -i {fake_pve.identity_file} ")
        assert warning["fix"].endswith(" root@127.0.0.1 'pct exec 333 --keep-env 0 -- sh -c '\"'\"'apt-get update && apt-get install -y tmux'\"'\"''")
        pasted = subprocess.run(["bash", "-c", warning["fix"]], capture_output=True, text=True, timeout=300)
        assert pasted.returncode == 0, pasted.stderr[-2000:]
        assert ct.exec(["tmux", "-V"]).returncode == 0
        assert rebuild_venv(target, stock_profile(fake_pve)).tmux == "present"
    finally:
        target.close()
        fake_pve.remove_container(ct.ctid)


@pytest.mark.slow
def test_a_python_the_container_lacks_is_one_error_naming_both_versions(fake_pve, tmp_path, monkeypatch):
    from fakehost import STOCK_TMUX

    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    ct = fake_pve.create_container(334, gpus=0, image=STOCK_TMUX)
    target = stock_target(fake_pve, ct)
    try:
        own = ct.exec(["python3", "-c", "import platform; print(platform.python_version())"]).stdout.decode().strip()
        for offline in (True, False):  # offline: no download tried; online: uv's download fails (no route here)
            with pytest.raises(AgentError) as exc:
                rebuild_venv(target, stock_profile(fake_pve, python="3.12", lock="test"), offline=offline)
            err = exc.value
            assert err.agent_type == "PythonMismatch" and "step `venv`" in err.message
            assert "Python 3.12" in err.message and f"python3 is {own}" in err.message
            assert 'python to "3.11"' in err.fix
            assert not (Path(ct.workdir) / "venvs" / "current").exists()
    finally:
        target.close()
        fake_pve.remove_container(ct.ctid)


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_container_rebuild_refuses_a_torch_the_driver_cannot_run_before_downloading_it(pve, claim_cuda_venv, tmp_path,
                                                                                    monkeypatch):
    from fakehost import STOCK_TMUX

    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    ct = pve.create_container(335, gpus=2, image=STOCK_TMUX)
    ct.set_driver("550.54.15", "12.4")
    ct.set_kernel_module("550.54.15")
    # The venv in use (a CPU one): it must stay current whatever the rebuild does.
    claim_cuda_venv(ct.workdir, lock="cpu", torch="2.13.0+cpu", cuda=None)
    ct.to_container(ct.workdir)
    before = venvs_state(Path(ct.workdir))
    target = stock_target(pve, ct)
    cuda = {"kind": "uv", "lock": "cuda", "python": "3.11", "uv_cache_dir": str(pve.storage() / "uv-cache")}  # PyPI's torch: CUDA 13.0
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
        assert "dflashctl rebuild-venv --target ct335" in exc.value.fix
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
        pve.remove_container(ct.ctid)


def test_a_system_profile_fingerprints_the_targets_python3(tmp_path):
    fp = venvfingerprint.current_fingerprint(str(tmp_path), {"kind": "system"})
    py3 = subprocess.run(["python3", "-c", "import platform, sys; print(platform.python_version(), sys.executable)"],
                         capture_output=True, text=True).stdout.split()
    assert fp["kind"] == "system" and [fp["python"], fp["executable"]] == py3 and fp["lock_hash"] is None
    assert venvfingerprint.fingerprint_diff(fp, None) == []


def test_a_uv_that_cannot_run_on_the_target_is_named_with_the_way_out(tmp_path, monkeypatch):
    from orchestrator.ops import carry

    foreign = tmp_path / "uv"
    foreign.write_bytes(b"\xcf\xfa\xed\xfe" + bytes(64))  # a Mach-O header: a Mac's uv, not runnable here
    foreign.chmod(0o755)
    monkeypatch.setattr(carry, "workstation_uv", lambda: carry.UvBinary(str(foreign), "0.13.9", "ab" * 32))
    with pytest.raises(AgentError) as exc:
        rebuild_venv(local(tmp_path / "w"), cpu_profile(lock="test"))
    assert exc.value.agent_type == "UvUnusable" and "step `uv`" in exc.value.message
    assert "does not run on this Linux" in exc.value.message and "install uv 0.13.9 in the target" in exc.value.fix
    assert venvs_state(tmp_path / "w") == (None, [])


def wheelhouse_of_the_test_lock(fake_pve) -> str:
    """Every wheel of the `test` lock for the containers' Python (3.11, x86_64), downloaded once per machine into
    the fake host's storage (pip download, hash-checked by the lock)."""
    out = fake_pve.storage() / "test-lock-wheelhouse"
    done = out / ".complete"
    if not done.exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                        "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                        "--platform", "manylinux2014_x86_64", "-r", str(Path(__file__).resolve().parents[3] / "templates" / "locks" / "test.txt"),
                        "-d", str(out)], check=True, timeout=600)
        done.touch()
    return str(out)


@pytest.mark.slow
def test_a_wheelhouse_holding_the_whole_lock_needs_no_index_and_a_failed_build_resends_nothing(fake_pve, tmp_path,
                                                                                            monkeypatch):
    """No index reachable (the fake host's containers share this machine's network, so "no network" is an
    index URL nobody listens on) and every wheel of the lock in the wheelhouse: rebuild-venv, with no flag,
    syncs from the carried wheels alone (the `test` lock then fails at the import check, which wants torch:
    proof that the sync itself passed), and after that failed build this workstation knows the container
    holds the wheels, so the next try sends none of them."""
    from fakehost import STOCK_TMUX

    from orchestrator.ops.carry import known
    from orchestrator.ops.lockfile import resolve_lock

    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    ct = fake_pve.create_container(335, gpus=0, image=STOCK_TMUX)
    target = stock_target(fake_pve, ct)
    wheelhouse = wheelhouse_of_the_test_lock(fake_pve)
    profile = stock_profile(fake_pve, lock="test", wheelhouse=[wheelhouse], index_url="http://127.0.0.1:9/simple",
                            uv_cache_dir=f"{ct.workdir}/uv-cache")
    try:
        with pytest.raises(AgentError) as exc:
            rebuild_venv(target, profile)
        assert exc.value.agent_type == "LockMissesModule", exc.value.message
        wheels = sorted(p.name for p in Path(wheelhouse).glob("*.whl"))
        assert len(wheels) == len(resolve_lock("test").pins())  # one wheel a pin
        assert sorted(known(target.bundle_cache_key())["wheels"]) == wheels
        events: list[dict] = []
        fake_pve.clear_pct_calls()
        with pytest.raises(AgentError):
            rebuild_venv(target, profile, on_event=events.append)
        assert len(fake_pve.pct_exec_calls(335)) == 1  # no NeedFiles round trip: nothing was missing
    finally:
        target.close()
        fake_pve.remove_container(ct.ctid)
