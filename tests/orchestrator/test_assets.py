"""templates/ at the top level, read through orchestrator.assets from a checkout, a wheel and the bundle."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from orchestrator import assets
from orchestrator.bundle import build_bundle

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(
    p.relative_to(REPO / "templates").as_posix() for p in (REPO / "templates").rglob("*") if p.is_file()
)


def test_the_checkout_reads_the_top_level_templates():
    assert not (REPO / "orchestrator" / "templates").exists()
    assert assets.on_disk("start_training.sh") == REPO / "templates" / "start_training.sh"
    assert assets.locks_dir() == REPO / "templates" / "locks"
    assert {"start_training.sh", "rebuild_venv.sh", "signatures.yaml", "inventory.yaml", "locks/cpu.txt"} <= set(SHIPPED)
    assert assets.read_text("inventory.yaml") == (REPO / "inventory.yaml").read_text()


def test_the_bundle_carries_the_templates_where_the_wheel_does(tmp_path):
    bundle = build_bundle(str(REPO))
    path = tmp_path / bundle.filename
    path.write_bytes(bundle.data)
    names = zipfile.ZipFile(path).namelist()
    assert [n for n in names if n.startswith("templates/")] == []
    for name in SHIPPED:
        assert f"orchestrator/templates/{name}" in names
    # The agent's own reader, run from the zip alone (no checkout on its path), as in a container.
    code = ("from orchestrator import assets; import sys; "
            "sys.stdout.write(assets.read_text('start_training.sh')); "
            "assert not isinstance(assets.path('locks'), __import__('pathlib').Path)")
    out = subprocess.run([sys.executable, "-S", "-c", code], env={"PYTHONPATH": str(path)}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (REPO / "templates" / "start_training.sh").read_text()


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_wheel_carries_every_module_and_template(tmp_path):
    """A non-editable build: every package module and every template is in the wheel, at orchestrator/templates.
    Built from a copy of the tree (setuptools writes build/ beside the sources), links kept as git has them."""
    import shutil

    src = tmp_path / "src"
    for name in ("orchestrator", "trainer", "templates"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    for name in ("pyproject.toml", "README.md", "inventory.yaml"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(src)], check=True, timeout=300, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("dflashctl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in SHIPPED:
        assert f"orchestrator/templates/{name}" in names
    for pkg in ("orchestrator", "trainer"):
        for p in (REPO / pkg).rglob("*.py"):
            assert p.relative_to(REPO).as_posix() in names
    inv = zipfile.ZipFile(wheel).read("orchestrator/templates/inventory.yaml").decode()
    assert inv == (REPO / "inventory.yaml").read_text()  # the link's content, not a link


def test_an_installed_wheel_reads_its_packaged_templates(tmp_path):
    """Unpacked as pip would install it (site-packages has orchestrator/templates/), the accessor and the
    bundle use the packaged copy, and `dflashctl lock` would write the packaged locks."""
    bundle = build_bundle(str(REPO))
    site = tmp_path / "site"
    zipfile.ZipFile(_zip(tmp_path, bundle)).extractall(site)
    code = ("from orchestrator import assets, bundle; import pathlib, sys; "
            "assert assets.locks_dir() == pathlib.Path(sys.argv[1]) / 'orchestrator/templates/locks', assets.locks_dir(); "
            "b = bundle.build_bundle(); print(b.hash)")
    out = subprocess.run([sys.executable, "-c", code, str(site)], env={"PYTHONPATH": str(site)}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == bundle.hash  # same files, same names in the zip: the same bundle


def _zip(tmp_path: Path, bundle) -> Path:
    p = tmp_path / bundle.filename
    p.write_bytes(bundle.data)
    return p
