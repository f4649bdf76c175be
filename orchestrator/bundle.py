"""The bundle: this project's `orchestrator` and `trainer` packages as one zip, named by its content hash.

The top-level `templates/` goes in as `orchestrator/templates/`, where a wheel puts it too, so the
agent reads it through orchestrator.assets as every other reader does.

The agent and the trainer run in the container from this zip (`PYTHONPATH=<zip>`, zipimport), so the code
there is byte-for-byte the workstation's; the hash is recorded in every run and compared by launch.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from functools import lru_cache
from pathlib import Path

from orchestrator import assets

PACKAGES = ("orchestrator", "trainer")
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = {".pyc", ".pyo"}
# A fixed timestamp so the zip bytes (and so the hash) depend on content only.
_EPOCH = (2020, 1, 1, 0, 0, 0)


def source_root() -> Path:
    """The directory that holds the `orchestrator` and `trainer` packages."""
    return Path(__file__).resolve().parent.parent


def _walk(base: Path, prefix: str) -> list[tuple[str, Path]]:
    """(name in the zip, file) for every file under `base`, named `prefix/<path below base>`."""
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if Path(name).suffix in _SKIP_SUFFIXES:
                continue
            path = Path(dirpath) / name
            out.append((f"{prefix}/{path.relative_to(base).as_posix()}", path))
    return out


def _files(root: Path) -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        out += _walk(root / pkg, pkg)
    # A checkout has templates/ at the top; an installed wheel has it inside the package (walked above).
    if not (root / "orchestrator" / assets.DIRNAME).is_dir():
        out += _walk(root / assets.DIRNAME, f"orchestrator/{assets.DIRNAME}")
    return sorted(out)


class Bundle:
    """The bundle of the source tree at `root`: its hash at once, its zip bytes when first asked for.

    Most commands only compare the hash (the container holds the bundle already), so the zip, whose
    compression is most of the cost, is made only for a push.
    """

    def __init__(self, root: Path):
        self.root = root
        self._files = _files(root)
        self._contents = [(rel, path.read_bytes()) for rel, path in self._files]
        digest = hashlib.sha256()
        for rel, content in self._contents:
            digest.update(rel.encode() + b"\0" + content + b"\0")
        self.hash = digest.hexdigest()[:16]
        self._data: bytes | None = None

    @property
    def filename(self) -> str:
        return f"{self.hash}.zip"

    @property
    def data(self) -> bytes:
        """The zip bytes (deterministic: fixed timestamps and modes, files in name order)."""
        if self._data is None:
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
                for rel, content in self._contents:
                    info = zipfile.ZipInfo(rel, _EPOCH)
                    info.external_attr = 0o644 << 16
                    info.compress_type = zipfile.ZIP_DEFLATED
                    zf.writestr(info, content)
            self._data = buf.getvalue()
        return self._data


@lru_cache(maxsize=1)
def build_bundle(root: str | None = None) -> Bundle:
    """The bundle of `root` (default: this source tree); the hash is sha256 of (path, content) pairs, 16 hex
    chars, and does not depend on the zip."""
    return Bundle(Path(root) if root else source_root())
