"""What rebuild-venv carries from the workstation into a target, so the target needs neither pip nor uv
nor (given the wheels) a network: the workstation's own uv binary and the wheels of the lock found in the
venv profile's `wheelhouse` directories. Both travel inline on stdin ahead of the request, in the same one
command, only when this workstation does not know the target holds them (a cache in the state dir, like
the bundle's; a wrong cache costs one retry, answered by the target's `need` event).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from orchestrator.agent import atomic
from orchestrator.errors import UserError
from orchestrator.ops.lockfile import normalize_name
from orchestrator.records import state_dir

# Workstation cache (in the state dir): which uv and wheels each container is known to hold.
KNOWN_FILES = "carried.json"
# A wheel file name: name-version(-build)?-pytag-abitag-platform.whl (PEP 427).
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


@dataclass(frozen=True)
class UvBinary:
    """The workstation's uv: the binary the `uv` package installed (uv.find_uv_bin())."""

    path: str
    version: str
    """The version number alone (`0.13.9`), as the second word of `uv --version`."""
    sha256: str


@dataclass(frozen=True)
class CarriedWheel:
    """A wheel of the lock found in a wheelhouse directory."""

    file: str
    path: str
    sha256: str
    size: int


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@lru_cache(maxsize=64)
def _sha256_cached(path: str, mtime_ns: int, size: int) -> str:
    return _sha256(path)


def file_sha256(path: str) -> str:
    """sha256 of a file, computed once per (path, mtime, size) in this process (a torch wheel is 200 MB)."""
    st = os.stat(path)
    return _sha256_cached(path, st.st_mtime_ns, st.st_size)


def uv_binary_path() -> str:
    """The uv binary of the installed `uv` package, else `uv` on PATH.

    Raises:
        UserError: neither exists.
    """
    try:
        import uv

        path = uv.find_uv_bin()
        if path and os.access(path, os.X_OK):
            return os.path.realpath(path)
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv")
    if found:
        return os.path.realpath(found)
    raise UserError("uv is not installed on this workstation", fix="pip install uv  (it is a dependency of dflashctl)")


@lru_cache(maxsize=4)
def _uv_binary(path: str, mtime_ns: int) -> UvBinary:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
        version = out.split()[1]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        raise UserError(f"the workstation's uv at {path} does not run: {exc}", fix="pip install --force-reinstall uv") from None
    return UvBinary(path, version, _sha256(path))


def workstation_uv() -> UvBinary:
    """The workstation's uv (path, version, sha256); what a target gets when it has no uv of that version."""
    path = uv_binary_path()
    return _uv_binary(path, os.stat(path).st_mtime_ns)


def wheel_pin(file: str) -> tuple[str, str] | None:
    """(normalized name, version) of a wheel file name; None for anything that is not a wheel."""
    m = _WHEEL.match(file)
    return (normalize_name(m.group("name")), m.group("version")) if m else None


def lock_wheels(lock, dirs) -> list[CarriedWheel]:
    """The wheels in `dirs` (workstation directories) that the lock pins: same name and version, and a
    sha256 among the lock's hashes for that pin (a wheel the lock would refuse is never carried).

    Raises:
        UserError: a directory does not exist.
    """
    pins, hashes = lock.pins(), lock.hashes()
    found: dict[str, CarriedWheel] = {}
    for d in dirs:
        base = Path(os.path.expanduser(d))
        if not base.is_dir():
            raise UserError(f"wheelhouse directory {str(base)!r} of the venv profile does not exist",
                            fix="fix the venv profile's `wheelhouse:` (directories on this workstation)")
        for path in sorted(base.glob("*.whl")):
            pin = wheel_pin(path.name)
            if pin is None or pins.get(pin[0]) != pin[1] or path.name in found:
                continue
            sha = file_sha256(str(path))
            if hashes.get(pin[0]) and sha not in hashes[pin[0]]:
                continue
            found[path.name] = CarriedWheel(path.name, str(path), sha, path.stat().st_size)
    return sorted(found.values(), key=lambda w: w.file)


# ------------------------------------------------------------------------------ what a target holds


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def known(key: str) -> dict:
    """{"uv": sha256, "wheels": {file: sha256}} this workstation knows target `key` holds."""
    entry = _load(state_dir() / KNOWN_FILES).get(key)
    if not isinstance(entry, dict):
        return {"uv": None, "wheels": {}}
    wheels = entry.get("wheels")
    return {"uv": entry.get("uv"), "wheels": wheels if isinstance(wheels, dict) else {}}


def remember(key: str, uv_sha: str | None, wheels: list[CarriedWheel]) -> None:
    """Record that target `key` holds this uv and these wheels (after a rebuild that used them)."""
    path = state_dir() / KNOWN_FILES
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load(path)
        entry = data.get(key) if isinstance(data.get(key), dict) else {}
        held = dict(entry.get("wheels") or {})
        held.update({w.file: w.sha256 for w in wheels})
        data[key] = {"uv": uv_sha or entry.get("uv"), "wheels": held}
        atomic.write_bytes(path, json.dumps(data).encode(), 0o644)
    except OSError:
        pass  # a cache: losing it costs one inline copy later, nothing else
