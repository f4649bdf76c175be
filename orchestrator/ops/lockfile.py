"""A lock file read: the pinned, hashed requirements a target venv is built from (`templates/locks/<profile>.txt`,
or a file a venv profile names), its identity (the hash of its bytes) and its pins. Shared by `launch` (the
venv must equal the lock), `rebuild-venv` (it installs the lock), `dflashctl lock` (it writes one) and the
wheels carried into a target (orchestrator.ops.carry)."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator import assets
# The one dist-name rule (PEP 503: `PyYAML` -> `pyyaml`, `typing_extensions` -> `typing-extensions`), the agent's:
# what a lock pins is compared with what a venv reports by the same rule. Read here by ops.lock and ops.carry.
from orchestrator.agent.venvfingerprint import normalize_name
from orchestrator.errors import UserError

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")


def lock_hash(data: bytes) -> str:
    """The identity of a lock: sha256 of its bytes, 16 hex characters."""
    return hashlib.sha256(data).hexdigest()[:16]


def parse_pins(text: str) -> dict[str, str]:
    """`{normalized name: version}` of every `name==version` line of a requirements lock."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        m = _PIN.match(line.strip())
        if m:
            pins[normalize_name(m.group(1))] = m.group(2)
    return pins


@dataclass(frozen=True)
class LockFile:
    """A lock's bytes and where they came from."""

    name: str
    """The profile name (`cpu`, `cuda`, `test`) or the file name of a lock given by path."""
    path: Path
    data: bytes = field(repr=False)

    @property
    def hash(self) -> str:
        return lock_hash(self.data)

    @property
    def has_hashes(self) -> bool:
        """True when the lock carries `--hash=` lines (then uv installs in hash-checking mode)."""
        return b"--hash=" in self.data

    def pins(self) -> dict[str, str]:
        return parse_pins(self.data.decode("utf-8", errors="replace"))

    def hashes(self) -> dict[str, set[str]]:
        """`{normalized name: {sha256, ...}}`: the `--hash=sha256:` values of each pin (continuation lines)."""
        out: dict[str, set[str]] = {}
        name = None
        for line in self.data.decode("utf-8", errors="replace").splitlines():
            m = _PIN.match(line.strip())
            if m:
                name = normalize_name(m.group(1))
            elif not line.startswith((" ", "\t")):
                name = None
            if name:
                out.setdefault(name, set()).update(re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
        return out


def resolve_lock(spec: str, locks_dir: Path | None = None) -> LockFile:
    """Find the lock a venv profile names: a shipped profile name, or a path to a lock file.

    Args:
        spec: `cpu`, `cuda`, `test`, or a file path (`~` expanded).
        locks_dir: where shipped locks live (tests point this elsewhere).
    Returns:
        The LockFile, bytes read.
    Raises:
        UserError: no such profile or file, or the file is empty.
    """
    base = locks_dir or assets.locks_dir()
    if "/" not in spec and not spec.endswith(".txt"):
        path = base / f"{spec}.txt"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in base.glob("*.txt"))) or "none"
            raise UserError(
                f"no lock profile {spec!r} in {base} (known: {known})",
                fix=f"generate it with `dflashctl lock {spec}` after writing {base / (spec + '.in')}, "
                "or set the venv profile's `lock:` to a lock file path",
            )
        name = spec
    else:
        path = Path(os.path.expanduser(spec))
        if not path.is_file():
            raise UserError(f"lock file {str(path)!r} does not exist", fix="fix the venv profile's `lock:` path")
        name = path.stem
    data = path.read_bytes()
    if not parse_pins(data.decode("utf-8", errors="replace")):
        raise UserError(f"lock file {str(path)!r} pins no packages (no `name==version` lines)",
                        fix="make it with `uv pip compile --generate-hashes`")
    return LockFile(name, path, data)
