"""Locks: the pinned, hashed requirement files a target venv is built from (`templates/locks/<profile>.txt`).

A lock is made on the workstation by `uv pip compile --generate-hashes` from `<profile>.in`, for one
Python version and platform (the container's, not the workstation's), so every rebuild installs exactly
the same files. Regenerating keeps existing pins (uv reads the old lock as preferences) unless a package
is named with `--upgrade-package`. The lock's identity is the hash of its bytes (`lock_hash`): it names
the venv directory and is recorded in the venv fingerprint that launch compares.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator import assets
from orchestrator.errors import RemoteCommandError, UserError
from orchestrator.inventory import check_name
from orchestrator.ops.carry import uv_binary_path
from orchestrator.ops.lockfile import LockFile, lock_hash, normalize_name, parse_pins, resolve_lock
from orchestrator.transport.local import LocalTransport

__all__ = ["LockFile", "LockReport", "compile_argv", "compile_lock", "lock_hash", "normalize_name", "parse_pins",
           "resolve_lock", "uv_command"]

# The shipped profiles. A venv profile may also name a lock file by path.
PROFILES = ("cpu", "cuda", "test", "vllm", "vllm-cuda")
# Locks are compiled for the container, not for the workstation that compiles them.
PYTHON_VERSION = "3.11"
PYTHON_PLATFORM = "x86_64-manylinux_2_28"

# Where a profile's special wheels come from when `dflashctl lock` is given no source of its own.
DEFAULT_SOURCES: dict[str, dict] = {
    "cpu": {"extra_index_urls": ["https://download.pytorch.org/whl/cpu"]},
}

# Packages a profile's lock leaves out (`uv pip compile --no-emit-package`), with the reason in its .in file:
# PyPI's torchvision/torchaudio/torchcodec link CUDA and break `import vllm` on a CPU torch.
NO_EMIT: dict[str, tuple[str, ...]] = {"vllm": ("torchvision", "torchaudio", "torchcodec")}


def uv_command() -> list[str]:
    """How to run uv on the workstation: `uv` on PATH, else the `uv` module of this interpreter.

    Raises:
        UserError: neither exists.
    """
    return [uv_binary_path()]


def compile_argv(
    uv: Sequence[str],
    in_path: str,
    out_path: str,
    profile: str,
    *,
    upgrade_packages: Sequence[str] = (),
    find_links: Sequence[str] = (),
    index_url: str | None = None,
    extra_index_urls: Sequence[str] = (),
    python_version: str = PYTHON_VERSION,
    python_platform: str = PYTHON_PLATFORM,
) -> list[str]:
    """The `uv pip compile` command line that regenerates one lock (pure; golden-tested).

    `--no-config` keeps a stray uv.toml from changing the result; the custom compile command keeps
    workstation paths out of the lock's header; find-links and index URLs are not emitted into the lock,
    because the container names its own sources (the venv profile's `find_links`, `index_url`).
    """
    argv = [
        *uv, "pip", "compile", in_path, "--output-file", out_path,
        "--generate-hashes", "--no-config",
        "--python-version", python_version, "--python-platform", python_platform,
        "--custom-compile-command", f"dflashctl lock {profile}",
    ]
    if index_url:
        argv += ["--index-url", index_url]
    for url in extra_index_urls:
        argv += ["--extra-index-url", url]
    for link in find_links:
        argv += ["--find-links", link]
    for pkg in upgrade_packages:
        argv += ["--upgrade-package", pkg]
    for pkg in NO_EMIT.get(profile, ()):
        argv += ["--no-emit-package", pkg]
    return argv


@dataclass
class LockReport:
    """What `dflashctl lock` did to one profile."""

    profile: str
    path: str
    hash: str
    old_hash: str | None
    packages: int
    changed: dict[str, tuple[str | None, str | None]]
    """name -> (old version, new version); None where added or removed."""
    duration_s: float

    @property
    def unchanged(self) -> bool:
        return self.hash == self.old_hash


def compile_lock(
    profile: str,
    *,
    upgrade_packages: Sequence[str] = (),
    find_links: Sequence[str] = (),
    index_url: str | None = None,
    extra_index_urls: Sequence[str] = (),
    locks_dir: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout: float = 900.0,
) -> LockReport:
    """Regenerate `<locks_dir>/<profile>.txt` from `<profile>.in` with `uv pip compile --generate-hashes`.

    The old lock is copied to a temporary file that uv compiles into (so its pins are kept as
    preferences), and only a successful result is renamed over the lock: a failure leaves it as it was.

    Args:
        profile: the lock profile name (a `<profile>.in` must exist).
        upgrade_packages: packages allowed to move to newer versions.
        find_links / index_url / extra_index_urls: where uv finds distributions (e.g. the torch CPU wheel);
            none given: the profile's DEFAULT_SOURCES (cpu: the PyTorch CPU index).
        locks_dir: the directory of .in/.txt files (default: the shipped templates/locks).
        on_line: called with each line uv prints on stderr (progress).
        timeout: seconds before uv is killed.
    Returns:
        A LockReport (hash, old hash, changed pins).
    Raises:
        UserError: bad profile name, or no `<profile>.in`.
        RemoteCommandError: uv failed (the message carries uv's last lines: the resolution error).
    """
    check_name("lock profile", profile)
    if not (find_links or index_url or extra_index_urls):
        defaults = DEFAULT_SOURCES.get(profile, {})
        extra_index_urls = defaults.get("extra_index_urls", ())
    base = locks_dir or assets.locks_dir()
    in_path = base / f"{profile}.in"
    out_path = base / f"{profile}.txt"
    if not in_path.is_file():
        raise UserError(f"no {in_path.name} in {base}", fix=f"write the requirements of `{profile}` to {in_path}")
    old = out_path.read_bytes() if out_path.is_file() else None
    tmp = base / f".{profile}.txt.tmp-{os.getpid()}"
    if old is not None:
        tmp.write_bytes(old)
    argv = compile_argv(uv_command(), in_path.name, tmp.name, profile, upgrade_packages=upgrade_packages,
                        find_links=find_links, index_url=index_url, extra_index_urls=extra_index_urls)
    buf = bytearray()

    def _stderr(chunk: bytes) -> None:
        buf.extend(chunk)
        *lines, rest = buf.split(b"\n")
        buf[:] = rest
        for line in lines:
            if on_line is not None and line.strip():
                on_line(line.decode("utf-8", errors="replace").rstrip())

    start = time.monotonic()
    try:
        # cwd = the locks dir, so the .in path in uv's annotations ("# via -r cpu.in") has no workstation path.
        res = LocalTransport(cwd=str(base)).run(argv, timeout=timeout, on_stderr=_stderr)
        if res.exit_code != 0 or not tmp.is_file():
            raise RemoteCommandError(f"uv could not compile the {profile} lock (exit {res.exit_code})", result=res,
                                     fix="read uv's message above; relax a pin in "
                                     f"{in_path.name} or pass --find-links/--index-url for missing wheels")
        new = tmp.read_bytes()
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    old_pins = parse_pins(old.decode()) if old else {}
    new_pins = parse_pins(new.decode())
    changed = {
        name: (old_pins.get(name), new_pins.get(name))
        for name in sorted(set(old_pins) | set(new_pins))
        if old_pins.get(name) != new_pins.get(name)
    }
    return LockReport(profile, str(out_path), lock_hash(new), lock_hash(old) if old else None, len(new_pins),
                      changed, time.monotonic() - start)
