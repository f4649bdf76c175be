"""What rebuild-venv sends to the target: the profile's fields it uses, `uv pip sync`'s options, the project's
bundle as a wheel, the tar read on stdin and the script's one argv (all pure, all deterministic).

Why a wheel for the bundle: it joins the lock in one exact, hash-checked `uv pip sync`, shows up in
`uv pip freeze` and the fingerprint as `dflashctl-bundle==0+b<hash>`, and its RECORD names the files, so
the verifier finds its top-level modules like any other distribution's. (A zip on PYTHONPATH or a .pth
would work too, but would be invisible to uv and to the fingerprint.)
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache

from orchestrator import assets
from orchestrator.agent.venvfingerprint import profile_kind
from orchestrator.agent.venvinfo import BUNDLE_DIST
from orchestrator.errors import UserError
from orchestrator.ops.carry import CarriedWheel, UvBinary
from orchestrator.ops.lockfile import LockFile

SCRIPT_NAME = "rebuild_venv.sh"
# A python request reaches `uv venv --python` and the one-line stamp: a version or a name, no spaces.
_PY_REQUEST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+@/-]{0,63}$")
_EPOCH = (2020, 1, 1, 0, 0, 0)


def script_text() -> str:
    """The rebuild script (constant text; every value is passed as an argument)."""
    return assets.read_text(SCRIPT_NAME)


# -------------------------------------------------------------------------------------------- profile


@dataclass(frozen=True)
class UvProfile:
    """The fields of a `kind: uv` venv profile that rebuild-venv uses (see inventory.UvVenv)."""

    lock: str = "cuda"
    python: str = "3.11"
    uv_cache_dir: str | None = None
    find_links: tuple[str, ...] = ()
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    keep: int = 3
    wheelhouse: tuple[str, ...] = ()
    """Workstation directories whose wheels of the lock travel to the target (see inventory.UvVenv)."""


# Profiles that use an interpreter as it is: nothing to build.
AS_IS_KINDS = ("workstation", "system")


def as_profile(profile) -> UvProfile | None:
    """A UvProfile from an inventory model or a dict; None for the `workstation` and `system` kinds.

    Raises:
        UserError: an unknown kind, a python request with spaces or shell characters, keep < 1.
    """
    kind = profile_kind(profile)  # the agent's one rule: no profile is the running interpreter
    if kind in AS_IS_KINDS:
        return None
    data = profile.model_dump() if hasattr(profile, "model_dump") else dict(profile)
    if kind != "uv":
        raise UserError(f"venv profile kind {kind!r} cannot be rebuilt", fix="use kind: uv (or system / workstation)")
    p = UvProfile(
        lock=str(data.get("lock") or "cuda"),
        python=str(data.get("python") or "3.11"),
        uv_cache_dir=data.get("uv_cache_dir") or None,
        find_links=tuple(data.get("find_links") or ()),
        index_url=data.get("index_url") or None,
        extra_index_urls=tuple(data.get("extra_index_urls") or ()),
        keep=int(data.get("keep") or 3),
        wheelhouse=tuple(data.get("wheelhouse") or ()),
    )
    if not _PY_REQUEST.match(p.python):
        raise UserError(f"bad python request {p.python!r} in the venv profile", fix='use a version like "3.11"')
    if p.keep < 1:
        raise UserError(f"venv profile keep must be >= 1, got {p.keep}", fix="keep: 3")
    return p


def sync_options(profile: UvProfile, lock: LockFile) -> list[str]:
    """`uv pip sync` options from the profile (pure; golden-tested).

    A lock with hashes is installed in hash-checking mode, so a wheel that differs from the one locked
    (another index, a tampered mirror) is refused instead of installed.
    """
    opts: list[str] = ["--require-hashes"] if lock.has_hashes else []
    if profile.index_url:
        opts += ["--index-url", profile.index_url]
    for url in profile.extra_index_urls:
        opts += ["--extra-index-url", url]
    for link in profile.find_links:
        opts += ["--find-links", link]
    return opts


# --------------------------------------------------------------------------------------------- bundle


@dataclass(frozen=True)
class Wheel:
    name: str
    data: bytes = field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@lru_cache(maxsize=4)
def bundle_wheel(bundle_hash: str, bundle_zip: bytes) -> Wheel:
    """The bundle (orchestrator + trainer packages) as a pure-Python wheel `dflashctl-bundle==0+b<hash>`.

    Deterministic: same bundle, same bytes (fixed timestamps, sorted entries).
    """
    version = f"0+b{bundle_hash}"
    distinfo = f"dflashctl_bundle-{version}.dist-info"
    files: list[tuple[str, bytes]] = []
    with zipfile.ZipFile(io.BytesIO(bundle_zip)) as src:
        for info in sorted(src.infolist(), key=lambda i: i.filename):
            if not info.is_dir():
                files.append((info.filename, src.read(info)))
    tops = sorted({name.split("/")[0] for name, _ in files})
    files += [
        (f"{distinfo}/METADATA", f"Metadata-Version: 2.1\nName: {BUNDLE_DIST}\nVersion: {version}\n"
         "Summary: dflashctl's orchestrator and trainer packages, as shipped to a target\n".encode()),
        (f"{distinfo}/WHEEL", b"Wheel-Version: 1.0\nGenerator: dflashctl\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
        (f"{distinfo}/top_level.txt", ("\n".join(tops) + "\n").encode()),
    ]
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files) + f"{distinfo}/RECORD,,\n"
    files.append((f"{distinfo}/RECORD", record.encode()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files:
            info = zipfile.ZipInfo(name, _EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return Wheel(f"dflashctl_bundle-{version}-py3-none-any.whl", buf.getvalue())


def payload(lock: LockFile, wheel: Wheel, wheels: list[CarriedWheel] = (), *, send_wheels: list[CarriedWheel] = (),
            uv: UvBinary | None = None) -> bytes:
    """The tar the script reads on stdin (deterministic): `lock.txt`, the bundle wheel, `wheels.sha256` (the
    wheelhouse wheels the target must hold, sha256sum's format), then inline what the target lacks: `uv`
    (the workstation's binary) and `wheels/<file>` for each of `send_wheels`."""
    buf = io.BytesIO()
    listing = "".join(f"{w.sha256}  {w.file}\n" for w in wheels).encode()

    def add(tf, name: str, data: bytes | None = None, path: str | None = None, mode: int = 0o644) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data) if data is not None else os.stat(path).st_size
        info.mode, info.mtime = mode, 0
        if data is not None:
            tf.addfile(info, io.BytesIO(data))
        else:
            with open(path, "rb") as fh:
                tf.addfile(info, fh)

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "lock.txt", lock.data)
        add(tf, wheel.name, wheel.data)
        add(tf, "wheels.sha256", listing)
        if uv is not None:
            add(tf, "uv", path=uv.path, mode=0o755)
        for w in send_wheels:
            add(tf, f"wheels/{w.file}", path=w.path)
    return buf.getvalue()


def script_argv(mode: str, workdir: str, *, lock_hash: str = "-", bundle_hash: str = "-", python: str = "-",
                keep: int = 3, force: bool = False, offline: bool = False, cache: str | None = None,
                wheel: str = "-", wheel_sha: str = "-", uv_bin: str = "-", uv_version: str = "-", uv_sha: str = "-",
                tmux: bool = False, sync_opts: list[str] | None = None, wheels_only: bool = False) -> list[str]:
    """The ONE command: `bash -c SCRIPT rebuild-venv MODE WORKDIR ...` (pure; argument order is the script's).

    Args:
        offline: --offline: uv uses no index, no Python download, no apt-get update.
        wheels_only: the wheelhouse holds every wheel of the lock: uv asks no index (as offline), but apt-get
            may still update its lists for tmux (a container that reaches only a Debian mirror).
        uv_bin: a uv path the target can run as is (a local target: the workstation's own); `-` for a
            container, which uses <workdir>/bin/uv (sha256 `uv_sha`) or a uv of exactly `uv_version`.
        tmux: install tmux with apt-get when it is missing (containers).
    """
    return ["bash", "-c", script_text(), "rebuild-venv", mode, workdir, lock_hash, bundle_hash, python, str(keep),
            "1" if force else "0", "1" if offline else "2" if wheels_only else "0", cache or "", wheel, wheel_sha, uv_bin, uv_version, uv_sha,
            "1" if tmux else "0", *(sync_opts or [])]
