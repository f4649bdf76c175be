"""Locks: the uv pip compile command line (golden), regeneration that keeps pins unless told to upgrade
(real uv over a local wheel directory, no network), failures that leave the lock as it was, and the
shipped locks themselves (hashes on every pin; the torch CPU hash is the real wheel's)."""

from __future__ import annotations

import base64
import hashlib
import io
import re
import zipfile
from pathlib import Path

import pytest

from orchestrator import assets
from orchestrator.errors import RemoteCommandError, UserError
from orchestrator.ops.lock import (
    compile_argv,
    compile_lock,
    lock_hash,
    parse_pins,
    resolve_lock,
)


def make_wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel `name==version` (one module)."""
    distinfo = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{distinfo}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{distinfo}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
        for p, d in files.items()
    ) + f"{distinfo}/RECORD,,\n"
    files[f"{distinfo}/RECORD"] = record.encode()
    path = directory / f"{name}-{version}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for p, d in files.items():
            zf.writestr(p, d)
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture
def wheelhouse(tmp_path):
    """A locks dir with `demo.in` and a wheel dir (demo 1.0), plus an empty index so nothing goes online."""
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "demo.in").write_text("dflashdemo\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "dflashdemo", "1.0")
    index = tmp_path / "index"
    index.mkdir()
    return locks, wheels, f"file://{index}"


def test_compile_argv_golden():
    argv = compile_argv(["uv"], "cpu.in", ".cpu.txt.tmp", "cpu", upgrade_packages=["transformers"],
                        find_links=["/opt/wheels"], extra_index_urls=["https://x/simple"])
    assert argv == ["uv", "pip", "compile", "cpu.in", "--output-file", ".cpu.txt.tmp", "--generate-hashes",
                    "--no-config", "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
                    "--custom-compile-command", "dflashctl lock cpu", "--extra-index-url", "https://x/simple",
                    "--find-links", "/opt/wheels", "--upgrade-package", "transformers"]


def test_parse_pins_normalizes_names():
    text = "PyYAML==6.0.4 \\\n    --hash=sha256:ab\ntyping_extensions==4.1 ; python_version < '3.12'\n# x==1\n"
    assert parse_pins(text) == {"pyyaml": "6.0.4", "typing-extensions": "4.1"}


def test_compile_keeps_pins_until_upgrade_is_asked(wheelhouse):
    locks, wheels, index = wheelhouse
    kw = dict(find_links=[str(wheels)], index_url=index, locks_dir=locks)
    first = compile_lock("demo", **kw)
    text = (locks / "demo.txt").read_text()
    assert first.old_hash is None and first.changed == {"dflashdemo": (None, "1.0")}
    assert "dflashdemo==1.0" in text and "--hash=sha256:" in text and "dflashctl lock demo" in text
    assert str(wheels) not in text  # no workstation paths in a lock
    assert first.hash == lock_hash((locks / "demo.txt").read_bytes())

    make_wheel(wheels, "dflashdemo", "1.1")
    kept = compile_lock("demo", **kw)
    assert kept.unchanged and "dflashdemo==1.0" in (locks / "demo.txt").read_text()

    upgraded = compile_lock("demo", upgrade_packages=["dflashdemo"], **kw)
    assert upgraded.changed == {"dflashdemo": ("1.0", "1.1")} and upgraded.old_hash == first.hash
    assert "dflashdemo==1.1" in (locks / "demo.txt").read_text()
    assert sorted(p.name for p in locks.iterdir()) == ["demo.in", "demo.txt"]


def test_a_failed_compile_leaves_the_lock_as_it_was(wheelhouse):
    locks, wheels, index = wheelhouse
    compile_lock("demo", find_links=[str(wheels)], index_url=index, locks_dir=locks)
    before = (locks / "demo.txt").read_bytes()
    (locks / "demo.in").write_text("dflashdemo==9.9\n")
    with pytest.raises(RemoteCommandError) as exc:
        compile_lock("demo", find_links=[str(wheels)], index_url=index, locks_dir=locks)
    assert "could not compile the demo lock" in exc.value.message
    assert "dflashdemo" in str(exc.value)  # uv's resolution error is in the tail
    assert (locks / "demo.txt").read_bytes() == before
    assert sorted(p.name for p in locks.iterdir()) == ["demo.in", "demo.txt"]


def test_compile_refuses_unknown_profiles(tmp_path):
    with pytest.raises(UserError, match="no nope.in"):
        compile_lock("nope", locks_dir=tmp_path)
    with pytest.raises(UserError, match="bad lock profile name"):
        compile_lock("../etc", locks_dir=tmp_path)


def test_resolve_lock_by_name_and_path(tmp_path):
    assert resolve_lock("cpu").path == assets.locks_dir() / "cpu.txt"
    with pytest.raises(UserError, match=r"no lock profile 'gpu'.*known: cpu, cuda, test"):
        resolve_lock("gpu")
    with pytest.raises(UserError, match="does not exist"):
        resolve_lock(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(UserError, match="pins no packages"):
        resolve_lock(str(empty))
    mine = tmp_path / "mine.txt"
    mine.write_text("pyyaml==6.0.4\n")
    lock = resolve_lock(str(mine))
    assert lock.name == "mine" and not lock.has_hashes and lock.pins() == {"pyyaml": "6.0.4"}


@pytest.mark.parametrize("profile", ["cpu", "cuda", "test"])
def test_shipped_locks_hash_every_pin(profile):
    text = (assets.locks_dir() / f"{profile}.txt").read_text()
    blocks = re.split(r"\n(?=[a-z0-9])", text.split("\n", 2)[2])
    pins = parse_pins(text)
    assert pins and len([b for b in blocks if "==" in b.split("\n")[0]]) == len(pins)
    for block in blocks:
        if "==" in block.split("\n")[0]:
            assert "--hash=sha256:" in block, block.split("\n")[0]
    assert "/opt/" not in text and "file://" not in text


def test_shipped_cpu_and_cuda_locks_pin_the_right_torch():
    cpu, cuda = resolve_lock("cpu"), resolve_lock("cuda")
    assert cpu.pins()["torch"] == "2.13.0+cpu" and not any(n.startswith("nvidia-") for n in cpu.pins())
    assert cuda.pins()["torch"] == "2.13.0" and "nvidia-cublas" in cuda.pins() and "triton" in cuda.pins()
    for lock in (cpu, cuda):
        for name in ("transformers", "accelerate", "safetensors", "tokenizers", "pydantic", "pyyaml", "numpy"):
            assert name in lock.pins(), (lock.name, name)
        assert "libtmux" not in lock.pins(), lock.name  # the agent drives tmux through its CLI (agent/tmuxctl.py)


def test_the_cpu_lock_holds_the_real_hash_of_the_local_torch_wheel():
    wheel = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    if not wheel.exists():
        pytest.skip("no local torch CPU wheel on this machine")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    block = resolve_lock("cpu").data.decode().split("\ntorch==", 1)[1].split("\n    # via", 1)[0]
    assert f"--hash=sha256:{digest}" in block


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_the_lock_verb_through_the_installed_cli(dflashctl, tmp_path, wheelhouse):
    """`dflashctl lock PROFILE` as a user runs it, offline (a local wheel directory and an empty index). The
    verb writes next to the package's shipped locks, so it runs on a copy of the source tree (first on
    PYTHONPATH) whose locks directory holds the test's profile; the checkout's own locks are never touched."""
    import shutil

    _, wheels, index = wheelhouse
    src = tmp_path / "src"
    repo = assets.checkout_dir().parent
    for name in ("orchestrator", "trainer", assets.DIRNAME):
        shutil.copytree(repo / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    locks = src / assets.DIRNAME / "locks"
    (locks / "demo.in").write_text("dflashdemo\n")
    lock = lambda *a: dflashctl("lock", "demo", "--find-links", str(wheels), "--index-url", index, *a,  # noqa: E731
                                source=src)

    first = lock()
    assert first.returncode == 0, first.stderr
    made = lock_hash((locks / "demo.txt").read_bytes())
    assert first.stdout.splitlines() == [f"demo: 1 packages, new {made} ({locks / 'demo.txt'})",
                                         "  dflashdemo: (new) -> 1.0"]
    make_wheel(wheels, "dflashdemo", "1.1")
    kept = lock()
    assert kept.returncode == 0 and kept.stdout.splitlines() == [f"demo: 1 packages, unchanged ({locks / 'demo.txt'})"]
    upgraded = lock("--upgrade-package", "dflashdemo")
    assert upgraded.returncode == 0, upgraded.stderr
    now = lock_hash((locks / "demo.txt").read_bytes())
    assert upgraded.stdout.splitlines() == [f"demo: 1 packages, {made} -> {now} ({locks / 'demo.txt'})",
                                            "  dflashdemo: 1.0 -> 1.1"]
    assert "dflashdemo==1.1" in (locks / "demo.txt").read_text()
    # A profile without an .in file: one error line with the fix, exit 1.
    missing = dflashctl("lock", "nosuch", source=src)
    assert missing.returncode == 1 and missing.stderr.splitlines() == [
        f"error: no nosuch.in in {locks}", f"fix: write the requirements of `nosuch` to {locks / 'nosuch.in'}"]
