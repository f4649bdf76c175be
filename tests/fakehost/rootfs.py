"""Root file systems for the fake host's stock containers: Debian 12 (bookworm) from Debian's packages.

    python3 -m fakehost.rootfs [--cache DIR]      (from tests/; builds once, then reuses; prints the time)

Built once with debootstrap and cached under $DFLASHCTL_FAKEHOST_CACHE (default
/var/cache/dflashctl-fakehost), keyed by the recipe (suite, mirror, packages, the host's site CAs), so a
changed recipe builds a new one and a second run reuses the first:

  <cache>/rootfs/debian-12-<key>/root/   the stock image: minbase + python3 (PEP 668 marker included),
                                         ca-certificates, procps. No pip, no venv module, no uv, no tmux.
  <cache>/rootfs/debian-12-<key>/tmux/   an overlay layer over root/ with tmux installed by apt (for tests
                                         about launching, which need a tmux and not its installation)
  <cache>/rootfs/debian-12-<key>/built.json   {"seconds": ..., "recipe": ...}
  <cache>/ct-storage/                    the fake host's storage, bind-mounted into every stock container at
                                         the same path (a PVE mount point): container workdirs and a uv
                                         cache the tests share (see README.md); owned by the unprivileged
                                         containers' root (100000), as an admin chowns such a directory

Atomic: everything is built in `.build-<key>-<pid>/` and renamed into place last, under an exclusive
flock, so an interrupted build is never reused (the next build removes it) and two test processes never
build at once.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SUITE = "bookworm"
# The mirror this machine's apt uses (/etc/apt/sources.list.d/debian.sources); override for another.
MIRROR = os.environ.get("DFLASHCTL_FAKEHOST_MIRROR", "http://deb.debian.org/debian")
# What Proxmox's debian-12-standard template has that matters here: python3 (Debian's, PEP 668),
# ca-certificates, procps. It has no tmux, no pip, no uv.
# systemd + systemd-sysv: PID 1 of the LXC container is the image's /sbin/init, as in Proxmox's template.
INCLUDE = ("python3", "ca-certificates", "procps", "systemd", "systemd-sysv")
# Bump when the steps below change in a way the key does not see.
RECIPE_VERSION = 2
# An unprivileged container's root (uid/gid 0 inside) is 100000 outside (lxc.idmap u 0 100000 65536, as
# Proxmox maps it with root:100000:65536 in /etc/subuid and /etc/subgid): the built layers are shifted by
# this much once, so a container's overlay over them needs no per-container copy.
ID_SHIFT = 100000
ID_RANGE = 65536
# A site's TLS-intercepting proxy CA (this machine reaches PyPI through one) is installed into the image,
# as a site would bake it into its container template; without it uv in the container cannot verify PyPI.
SITE_CA_DIR = Path("/usr/local/share/ca-certificates")


def cache_root() -> Path:
    return Path(os.environ.get("DFLASHCTL_FAKEHOST_CACHE", "/var/cache/dflashctl-fakehost"))


def storage_dir(cache: Path | None = None) -> Path:
    """The fake host's storage directory (bind-mounted into stock containers at the same path), owned by
    the unprivileged containers' root so that they can make their own directories in it (a uv cache)."""
    d = (cache or cache_root()) / "ct-storage"
    if not d.is_dir():
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, ID_SHIFT, ID_SHIFT)
    return d


def _site_cas() -> list[Path]:
    return sorted(p for p in SITE_CA_DIR.glob("*.crt") if p.is_file()) if SITE_CA_DIR.is_dir() else []


def recipe() -> dict:
    cas = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in _site_cas()}
    return {"suite": SUITE, "mirror": MIRROR, "variant": "minbase", "include": list(INCLUDE), "site_cas": cas,
            "layers": ["tmux"], "id_shift": ID_SHIFT, "version": RECIPE_VERSION}


def recipe_key() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:12]


class Image:
    """A built image: `root` (the stock layer) and `tmux` (tmux installed on top)."""

    def __init__(self, path: Path):
        self.path = path
        self.root = path / "root"
        self.tmux = path / "tmux"

    def lowerdirs(self, tmux: bool) -> list[str]:
        """overlayfs lowerdir list, top first."""
        return [str(self.tmux), str(self.root)] if tmux else [str(self.root)]

    def built(self) -> dict:
        return json.loads((self.path / "built.json").read_text())


def _run(argv: list[str], log) -> None:
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = proc.stdout.decode(errors="replace").strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed (exit {proc.returncode}):\n" + "\n".join(tail))
    log(f"  {' '.join(argv[:3])} ... ok")


# A private mount namespace in which a layer's changes land in `upper` (overlay over the image root), with
# /proc and /dev for apt and dpkg. $1 lower, $2 upper, $3 work, $4 merged, then the command.
_IN_LAYER = r"""set -e
lower=$1 upper=$2 work=$3 merged=$4; shift 4
mount -t overlay overlay -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$merged"
mount -t proc proc "$merged/proc"
mount --rbind /dev "$merged/dev"
exec chroot "$merged" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "$@"
"""


def _in_chroot(root: Path, script: str, log) -> None:
    """Run `sh -c script` chrooted into `root` itself (changes land in root), in a private mount ns."""
    wrapper = ('set -e; r=$1; shift; mount -t proc proc "$r/proc"; mount --rbind /dev "$r/dev"; '
               'exec chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "$@"')
    _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", wrapper, "chroot", str(root),
          "sh", "-c", script], log)


def _build(tmp: Path, log) -> None:
    root = tmp / "root"
    log(f"debootstrap {SUITE} ({', '.join(INCLUDE)}) from {MIRROR} into {root}")
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(INCLUDE)}", "--components=main", SUITE,
          str(root), MIRROR], log)
    cas = _site_cas()
    for ca in cas:
        shutil.copy2(ca, root / "usr/local/share/ca-certificates" / ca.name)
    # As a template is shipped: site CAs trusted, no downloaded .debs, no package lists.
    _in_chroot(root, ("update-ca-certificates >/dev/null; " if cas else "")
               + "apt-get clean; rm -rf /var/lib/apt/lists/*", log)
    if not (root / "usr/lib/python3.11/EXTERNALLY-MANAGED").is_file():
        raise RuntimeError("the built image has no EXTERNALLY-MANAGED marker: not a stock Debian python3")
    log("tmux layer: apt-get install tmux over the image")
    layer, work, merged = tmp / "tmux", tmp / ".tmux-work", tmp / ".tmux-merged"
    for d in (layer, work, merged):
        d.mkdir()
    install = "apt-get update -qq && apt-get install -y -qq --no-install-recommends tmux && apt-get clean && rm -rf /var/lib/apt/lists/*"
    _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", _IN_LAYER, "layer", str(root), str(layer),
          str(work), str(merged), "sh", "-c", install], log)
    shutil.rmtree(work)
    merged.rmdir()
    if not (layer / "usr/bin/tmux").exists():
        raise RuntimeError("the tmux layer has no usr/bin/tmux")
    log(f"shifting the layers' owners by {ID_SHIFT} (what an unprivileged container's root is outside)")
    for d in (root, layer):
        shift_ids(d, ID_SHIFT)


def shift_ids(top: Path, shift: int) -> None:
    """Add `shift` to the owner and group of every file under `top` (symlinks themselves, not their targets),
    keeping set-id bits (chown clears them) and the overlay's whiteouts (0:0 character devices, 0 inside)."""
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames, None]:
            path = dirpath if name is None else os.path.join(dirpath, name)
            st = os.lstat(path)
            if st.st_uid >= shift and st.st_gid >= shift:
                continue
            uid = st.st_uid if st.st_uid >= shift else st.st_uid + shift
            gid = st.st_gid if st.st_gid >= shift else st.st_gid + shift
            os.lchown(path, uid, gid)
            if not os.path.islink(path) and st.st_mode & 0o6000:
                os.chmod(path, st.st_mode & 0o7777)


def ensure_image(cache: Path | None = None, log=lambda s: None) -> Image:
    """The cached Debian 12 image, built first if needed (about 1-3 minutes; see README.md).

    Raises:
        RuntimeError: not root, debootstrap missing, or a build step failed (with its output's tail).
    """
    base = (cache or cache_root()) / "rootfs"
    final = base / f"debian-12-{recipe_key()}"
    if (final / "built.json").is_file():
        return Image(final)
    if os.geteuid() != 0:
        raise RuntimeError("building the stock container image needs root (debootstrap, mount)")
    if shutil.which("debootstrap") is None:
        raise RuntimeError("building the stock container image needs debootstrap (apt-get install debootstrap)")
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then reuse its result
        if (final / "built.json").is_file():
            return Image(final)
        for stale in base.glob(".build-*"):  # an interrupted build (we hold the lock: nobody else builds)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = base / f".build-{final.name}-{os.getpid()}"
        tmp.mkdir()
        start = time.monotonic()
        try:
            _build(tmp, log)
            seconds = round(time.monotonic() - start, 1)
            (tmp / "built.json").write_text(json.dumps({"seconds": seconds, "recipe": recipe()}, indent=1) + "\n")
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(f"built {final} in {seconds:.0f} s")
    return Image(final)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build (once) or reuse the fake host's Debian 12 container image.")
    ap.add_argument("--cache", type=Path, default=None, help="cache directory (default $DFLASHCTL_FAKEHOST_CACHE "
                    "or /var/cache/dflashctl-fakehost)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    try:
        image = ensure_image(args.cache, log=lambda s: print(s, flush=True))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    took = time.monotonic() - start
    built = image.built()
    reused = "reused" if took < built["seconds"] / 2 else "built"
    print(f"stock container image {image.path}: {reused} in {took:.1f} s (a build took {built['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
