"""tmux for a container that has none and cannot install it: Debian's own packages for the container's release,
fetched here, checked against the release's Packages index, sent over and installed with `dpkg -i`.

The rebuild script (templates/rebuild_venv.sh) first tries the container's apt-get; when that fails, its
TmuxMissing warning carries the container's release (`os`, `codename`, `arch`) and the names of the packages
dpkg has installed there. This module then, on the workstation:

1. keeps a private apt root per release under `<state dir>/debs/<os>-<codename>-<arch>/` (its own sources list,
   package lists and an empty dpkg status: the workstation's own apt configuration is neither read nor
   touched) and runs `apt-get update` in it when its lists are missing or a day old. apt checks the Release
   file's signature against the Debian archive keyring and the Packages index against the Release file;
2. resolves tmux's dependencies there (`apt-cache depends --recurse`, Depends and Pre-Depends only) and keeps
   those the container lacks;
3. downloads them with `apt-get download` (apt checks each file's SHA256 against the index) into `archives/`,
   a cache: a file whose SHA256 matches the index is not fetched again;
4. sends them in one tar with their SHA256 lines (from the index, `apt-get download --print-uris`) to
   templates/install_debs.sh, which checks every file again and runs `dpkg -i` on all of them.

Why packages rather than a static tmux binary: they are Debian's own builds, signed through the release, for
exactly the container's libc, and dpkg records them (an `apt-get upgrade` later updates them as usual).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator import assets
from orchestrator.errors import UserError
from orchestrator.records import state_dir
from orchestrator.transport.local import LocalTransport

SCRIPT_NAME = "install_debs.sh"
MIRROR_ENV = "DFLASHCTL_DEBIAN_MIRROR"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# Package lists older than this are refreshed before use (a superseded version is gone from the mirror).
LISTS_MAX_AGE_S = 24 * 3600
_NAME = re.compile(r"^[a-z0-9][a-z0-9.+-]*$")
_URI = re.compile(r"^'(?P<url>[^']+)' (?P<file>\S+) (?P<size>\d+) SHA256:(?P<sha>[0-9a-f]{64})$")


class DebsError(UserError):
    """The packages could not be fetched or checked here (the message says which step and why)."""


@dataclass(frozen=True)
class Release:
    """A container's Debian release, as its /etc/os-release and dpkg say."""

    os: str
    codename: str
    arch: str

    @classmethod
    def from_data(cls, data: dict) -> Release:
        """From the script's TmuxMissing warning data. Raises DebsError for a release this cannot serve."""
        os_id, codename, arch = (str(data.get(k) or "") for k in ("os", "codename", "arch"))
        for what, value in (("os", os_id), ("codename", codename), ("arch", arch)):
            if not _NAME.match(value):
                raise DebsError(f"the target's {what} is {value or 'unknown'!r}: cannot pick Debian packages for it",
                                fix="install tmux in the target by hand (apt-get install tmux)")
        if os_id != "debian":
            raise DebsError(f"the target runs {os_id} {codename}, not Debian: dflashctl brings tmux only from "
                            "Debian's archive", fix="install tmux in the target by hand (apt-get install tmux)")
        return cls(os_id, codename, arch)

    @property
    def key(self) -> str:
        return f"{self.os}-{self.codename}-{self.arch}"


@dataclass(frozen=True)
class Deb:
    """One package file, checked: its SHA256 is the Packages index's."""

    package: str
    file: str
    path: Path
    sha256: str
    size: int


class AptRoot:
    """A private apt configuration for one release, under the workstation's state dir."""

    def __init__(self, release: Release, base: Path | None = None, mirror: str | None = None):
        self.release = release
        self.dir = (base or state_dir() / "debs") / release.key
        self.mirror = mirror or os.environ.get(MIRROR_ENV) or DEFAULT_MIRROR
        self.archives = self.dir / "archives"

    def options(self) -> list[str]:
        d = self.dir
        opts = {
            "Dir::Etc::SourceList": d / "sources.list", "Dir::Etc::SourceParts": d / "sources.list.d",
            "Dir::Etc::Preferences": d / "preferences", "Dir::Etc::PreferencesParts": d / "preferences.d",
            "Dir::State": d / "state", "Dir::State::status": d / "status", "Dir::Cache": d / "cache",
            "APT::Architecture": self.release.arch, "APT::Architectures": self.release.arch,
            "APT::Get::List-Cleanup": "0", "Debug::NoLocking": "1",
        }
        return [a for k, v in opts.items() for a in ("-o", f"{k}={v}")]

    def _run(self, argv: list[str], what: str, cwd: Path | None = None, timeout: float = 600) -> str:
        env = {**os.environ, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive"}
        try:
            res = LocalTransport(env=env, cwd=str(cwd or self.dir)).run(argv, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - no apt-get here, a timeout: one error naming the step
            raise DebsError(f"{what} failed on this workstation: {exc}", fix=self.fix()) from None
        if res.exit_code != 0:
            tail = [ln for ln in res.stderr.decode("utf-8", "replace").splitlines() if ln.strip()][-3:]
            raise DebsError(f"{what} failed on this workstation (exit {res.exit_code}): {' | '.join(tail)}",
                            fix=self.fix())
        return res.stdout.decode("utf-8", "replace")

    def fix(self) -> str:
        return (f"check that this workstation reaches {self.mirror} (or set {MIRROR_ENV} to a Debian mirror it "
                f"reaches) and has apt-get and {KEYRING} (apt-get install debian-archive-keyring); or install tmux "
                "in the target by hand")

    def prepare(self, offline: bool = False) -> None:
        """The directory layout and the sources list; `apt-get update` when the lists are missing or old
        (`offline`: never; lists missing: DebsError)."""
        r = self.release
        for sub in ("sources.list.d", "preferences.d", "state/lists/partial", "cache/archives/partial", "archives"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "status").touch()
        sources = (f"deb [arch={r.arch} signed-by={KEYRING}] {self.mirror} {r.codename} main\n")
        path = self.dir / "sources.list"
        fresh = path.is_file() and path.read_text() == sources
        if not fresh:
            path.write_text(sources)
        stamp = self.dir / "state" / "updated"
        if fresh and stamp.is_file() and (offline or time.time() - stamp.stat().st_mtime < LISTS_MAX_AGE_S):
            return
        if offline:
            raise DebsError(f"--offline, and this workstation has no package lists of {r.codename}/{r.arch} yet",
                            fix="run dflashctl rebuild-venv once without --offline")
        self._run(["apt-get", *self.options(), "-q", "update"], f"apt-get update for {r.codename}/{r.arch}")
        stamp.touch()

    def closure(self, package: str) -> list[str]:
        """`package` and everything it needs (Depends, Pre-Depends), by name, virtual packages left out."""
        out = self._run(["apt-cache", *self.options(), "depends", "--recurse", "--no-recommends", "--no-suggests",
                         "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", package],
                        f"apt-cache depends {package}")
        names = [ln.strip() for ln in out.splitlines() if ln and not ln[0].isspace()]
        return sorted({n for n in names if _NAME.match(n)})

    def download(self, names: list[str], offline: bool = False) -> list[Deb]:
        """The package files of `names`, each checked against the index's SHA256 (cached in archives/;
        `offline`: only from there)."""
        listing = self._run(["apt-get", *self.options(), "download", "--print-uris", *names],
                            "apt-get download --print-uris")
        wanted = []
        for line in listing.splitlines():
            m = _URI.match(line.strip())
            if m:
                wanted.append((m["file"], int(m["size"]), m["sha"]))
        if len(wanted) != len(names):
            raise DebsError(f"the {self.release.codename} index names {len(wanted)} files for {len(names)} packages "
                            f"({', '.join(names)})", fix=self.fix())
        missing = [f for f, _size, sha in wanted if _sha256(self.archives / f) != sha]
        if missing and offline:
            raise DebsError(f"--offline, and this workstation's cache lacks {', '.join(missing)}",
                            fix="run dflashctl rebuild-venv once without --offline")
        if missing:
            self._run(["apt-get", *self.options(), "download", *names], "apt-get download", cwd=self.archives)
        debs = []
        for file, size, sha in wanted:
            path = self.archives / file
            if _sha256(path) != sha:
                raise DebsError(f"{path} differs from its SHA256 in the {self.release.codename} Packages index",
                                fix=f"rm {path}  (it is fetched again on the next try)")
            debs.append(Deb(file.split("_", 1)[0], file, path, sha, size))
        return debs


def _sha256(path: Path) -> str | None:
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return None


def needed(release: Release, installed: set[str], package: str = "tmux", base: Path | None = None,
           offline: bool = False) -> list[Deb]:
    """The checked package files of `package` and those of its dependencies the target lacks (`installed`:
    the names dpkg has installed there). `offline`: from this workstation's cache only, no download."""
    root = AptRoot(release, base)
    root.prepare(offline)
    names = [n for n in root.closure(package) if n not in installed]
    return root.download(names, offline) if names else []


def payload(debs: list[Deb]) -> bytes:
    """The tar install_debs.sh reads: `debs.sha256`, then each file (deterministic)."""
    buf = io.BytesIO()
    listing = "".join(f"{d.sha256}  {d.file}\n" for d in debs).encode()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("debs.sha256")
        info.size, info.mode, info.mtime = len(listing), 0o644, 0
        tf.addfile(info, io.BytesIO(listing))
        for d in debs:
            info = tarfile.TarInfo(d.file)
            info.size, info.mode, info.mtime = d.size, 0o644, 0
            with open(d.path, "rb") as fh:
                tf.addfile(info, fh)
    return buf.getvalue()


def script_argv(check: str = "tmux") -> list[str]:
    """The ONE command that installs the sent packages: `bash -c SCRIPT install-debs CHECK` (pure)."""
    return ["bash", "-c", assets.read_text(SCRIPT_NAME), "install-debs", check]


@dataclass
class Carried:
    """What carry_tmux did: the package files sent and tmux's version line in the target."""

    files: list[str]
    bytes: int
    version: str


def carry_tmux(target, data: dict, timeout: float = 600.0, offline: bool = False) -> Carried:
    """Bring tmux to `target` (a ContainerTarget: `.run(argv, stdin=, timeout=)`) from its TmuxMissing data
    ({os, codename, arch, installed}): one target command.

    `offline` (rebuild-venv --offline): only packages this workstation already holds; nothing is downloaded.

    Raises:
        DebsError: the release is not Debian's, the packages cannot be fetched or checked here, or dpkg in the
            target refused them (its last lines in the message).
    """
    release = Release.from_data(data)
    debs = needed(release, set(data.get("installed") or ()), offline=offline)
    if not debs:
        raise DebsError(f"dpkg in {target.name} lists every package tmux needs, yet tmux is not on PATH",
                        fix="check the target's PATH, or reinstall tmux there (apt-get install --reinstall tmux)")
    res = target.run(script_argv("tmux"), stdin=payload(debs), timeout=timeout)
    lines = [ln for ln in (res.stdout + res.stderr).decode("utf-8", "replace").splitlines() if ln.strip()]
    if res.exit_code != 0 or not lines or not lines[-1].startswith("installed: "):
        raise DebsError(f"installing tmux's packages in {target.name} failed (exit {res.exit_code}): "
                        + " | ".join(lines[-4:]), fix="install tmux in the target by hand (apt-get install tmux)")
    return Carried([d.file for d in debs], sum(d.size for d in debs), lines[-1].removeprefix("installed: "))


__all__ = ["Carried", "Deb", "DebsError", "Release", "carry_tmux", "needed", "payload", "script_argv"]
