"""The bundle: this project's `orchestrator` and `trainer` packages as one zip, named by its content hash.

The agent and the trainer run in the container from this zip (`PYTHONPATH=<zip>`, zipimport), so the code
there is byte-for-byte the workstation's; the hash is recorded in every run and compared by launch.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PACKAGES = ("orchestrator", "trainer")
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = {".pyc", ".pyo"}
# A fixed timestamp so the zip bytes (and so the hash) depend on content only.
_EPOCH = (2020, 1, 1, 0, 0, 0)


def source_root() -> Path:
    """The directory that holds the `orchestrator` and `trainer` packages."""
    return Path(__file__).resolve().parent.parent


def _files(root: Path) -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        base = root / pkg
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for name in sorted(filenames):
                if Path(name).suffix in _SKIP_SUFFIXES:
                    continue
                path = Path(dirpath) / name
                out.append((path.relative_to(root).as_posix(), path))
    return sorted(out)


@dataclass(frozen=True)
class Bundle:
    hash: str
    data: bytes

    @property
    def filename(self) -> str:
        return f"{self.hash}.zip"


@lru_cache(maxsize=1)
def build_bundle(root: str | None = None) -> Bundle:
    """Zip the packages deterministically; the hash is sha256 of (path, content) pairs, 16 hex chars."""
    base = Path(root) if root else source_root()
    digest = hashlib.sha256()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, path in _files(base):
            content = path.read_bytes()
            digest.update(rel.encode() + b"\0" + content + b"\0")
            info = zipfile.ZipInfo(rel, _EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, content)
    return Bundle(digest.hexdigest()[:16], buf.getvalue())
