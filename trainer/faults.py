"""Causes a failed rank cannot report itself: an OOM kill by the container's memory limit, a full file system.
Standard library only (read by the launcher when a rank fails, and by dflashctl's preflight).

OOM kills: the kernel's OOM killer SIGKILLs a process of a memory cgroup that is at its limit; the victim
prints nothing. The cgroup counts them: `oom_kill N` in memory.events (cgroup v2) or in memory.oom_control
(cgroup v1, kernel 4.13 and later). A container (LXC with a cgroup namespace) sees its own cgroup as the root
of /sys/fs/cgroup; the local target finds its own through /proc/self/cgroup. The launcher reads the counter
when it starts and again when a rank fails: more kills than before name the failure an OOM kill, with the limit.

A full disk: a rank whose save or export fails with ENOSPC may leave no trace (its traceback, the error file
and train.log are on the full disk). When a run fails, the file systems it writes to are checked; one with
less than FULL_BYTES free is named.

Last words: `reserve_space` takes a small file's worth of the run directory's file system at launch and
`release` gives it back when the run ends, so the report of a failure on a full disk still fits.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
FULL_BYTES = 1 << 20
"""A file system with less free space than this (1 MiB) is full: no checkpoint, export or log line fits."""
RESERVE_NAME = ".reserved-space"
RESERVE_BYTES = 256 << 10
"""Room for the last words: the launcher's failure block (a traceback or two), root_cause.json, exit.json."""
_UNLIMITED = 1 << 60  # cgroup v1 writes ~2^63 rounded to the page size for "no limit"


@dataclass(frozen=True)
class MemoryCgroup:
    """This process's memory cgroup: where its files are, its limit and its OOM-kill count."""

    version: int
    path: Path
    limit_bytes: int | None
    """None: no limit."""
    oom_kills: int | None
    """None: the kernel does not count them (cgroup v1 before 4.13)."""

    @property
    def counter_file(self) -> str:
        return "memory.events" if self.version == 2 else "memory.oom_control"

    def describe_limit(self) -> str:
        return "no memory limit" if self.limit_bytes is None else f"memory limit {self.limit_bytes >> 20} MiB"


def _own_cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(the v1 memory controller's path, the v2 path) of /proc/self/cgroup's text."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v1, v2


def _int_field(text: str, key: str) -> int | None:
    m = re.search(rf"^{re.escape(key)} (\d+)$", text, re.M)
    return int(m.group(1)) if m else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def memory_cgroup(root: Path = CGROUP_ROOT) -> MemoryCgroup | None:
    """This process's memory cgroup (v1's memory controller first, else v2), or None when none is readable.

    In a container with a cgroup namespace /proc/self/cgroup says "/" and the container's own cgroup is the
    mount's root; elsewhere the path from /proc/self/cgroup is under the mount.
    """
    v1, v2 = _own_cgroup_paths(_read(Path("/proc/self/cgroup")) or "")
    candidates = []
    if v1 is not None:
        candidates.append((1, root / "memory" / v1.lstrip("/")))
        candidates.append((1, root / "memory"))
    if v2 is not None:
        for base in (root, root / "unified"):
            candidates.append((2, base / v2.lstrip("/")))
    for version, path in candidates:
        found = memory_cgroup_at(path, version)
        if found is not None:
            return found
    return None


def oom_since(before: MemoryCgroup | None) -> dict | None:
    """The OOM kills in this process's memory cgroup since `before` was read, as a report field, or None
    when there were none (or nothing can tell).

    Returns:
        {"kills", "limit_bytes", "limit_mib", "cgroup", "counter"}.
    """
    if before is None or before.oom_kills is None:
        return None
    now = memory_cgroup_at(before.path, before.version)
    if now is None or now.oom_kills is None or now.oom_kills <= before.oom_kills:
        return None
    return {"kills": now.oom_kills - before.oom_kills, "limit_bytes": now.limit_bytes,
            "limit_mib": None if now.limit_bytes is None else now.limit_bytes >> 20, "cgroup": str(now.path),
            "counter": f"{now.counter_file} oom_kill {before.oom_kills} -> {now.oom_kills}"}


def memory_cgroup_at(path: Path, version: int) -> MemoryCgroup | None:
    """The cgroup at `path` read again (the launcher's own, read at its start)."""
    if version == 1:
        limit = _read(path / "memory.limit_in_bytes")
        if limit is None:
            return None
        n = int(limit.strip()) if limit.strip().isdigit() else None
        return MemoryCgroup(1, path, None if n is None or n >= _UNLIMITED else n,
                            _int_field(_read(path / "memory.oom_control") or "", "oom_kill"))
    events = _read(path / "memory.events")
    if events is None:
        return None
    limit = (_read(path / "memory.max") or "max").strip()
    return MemoryCgroup(2, path, int(limit) if limit.isdigit() else None, _int_field(events, "oom_kill"))


# pve-container's volume names: vm-CTID-disk-N (a raw image on directory storage, a Ceph or LVM volume),
# subvol-CTID-disk-N (ZFS, directory subvolumes), base-CTID-disk-N (a template). Device-mapper doubles every
# dash of an LVM name, so local-lvm's root shows as /dev/mapper/pve-vm--CTID--disk--N.
_PVE_VOLUME = re.compile(r"(?:vm|subvol|base)(-{1,2})(\d+)\1disk\1\d+")
# LXC's cgroup of a container when no cgroup namespace hides it: /lxc/CTID/... (lxc < 4) or lxc.payload.CTID.
_LXC_CGROUP = re.compile(r"/lxc(?:\.payload)?[./](\d+)(?:[/.]|$)")
# pve-container's hostname when the config sets none: "CT" + the CTID.
_PVE_HOSTNAME = re.compile(r"(?i)ct(\d{3,9})")


def container_id_from(env_ctid: str | None, mountinfo: str, cgroup: str, hostname: str, in_lxc: bool) -> str | None:
    """The Proxmox CTID from what a process inside the container can read (pure), first found wins:
    `env_ctid` (DFLASHCTL_CTID); the name of the root file system's volume in `mountinfo`; then, only inside an
    LXC container (`in_lxc`), LXC's cgroup path in `cgroup` (/proc/self/cgroup) and Proxmox's default hostname
    `CT<CTID>`."""
    if env_ctid and env_ctid.isdigit():
        return env_ctid
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == "/" and " - " in line:
            m = _PVE_VOLUME.search(line.split(" - ", 1)[1])
            if m:
                return m.group(2)
    if not in_lxc:
        return None
    for line in cgroup.splitlines():
        m = _LXC_CGROUP.search(line.split(":", 2)[-1])
        if m:
            return m.group(1)
    m = _PVE_HOSTNAME.fullmatch(hostname.strip())
    return m.group(1) if m else None


def container_id() -> str | None:
    """This Proxmox container's id (container_id_from over this process's view), or None when nothing tells.
    An LXC container is told by PID 1's `container=lxc` (systemd's /run/systemd/container when that is not
    readable)."""
    environ = _read(Path("/proc/1/environ")) or ""
    in_lxc = "container=lxc" in environ.split("\0") or (_read(Path("/run/systemd/container")) or "").strip() == "lxc"
    return container_id_from(os.environ.get("DFLASHCTL_CTID"), _read(Path("/proc/self/mountinfo")) or "",
                             _read(Path("/proc/self/cgroup")) or "", os.uname().nodename, in_lxc)


def raise_memory_fix(limit_bytes: int | None, need_bytes: int | None = None) -> str:
    """The fix for a container that is short of memory: `pct set CTID --memory MiB` on the Proxmox host,
    with twice the limit (or the estimated need, if larger), rounded up to 256 MiB."""
    want = max(2 * (limit_bytes or 0), need_bytes or 0)
    mib = max(512, -(-(want >> 20) // 256) * 256)
    ctid = container_id()
    line = f"pct set {ctid or 'CTID'} --memory {mib}"
    return f"on the Proxmox host: {line}" + ("" if ctid else " (CTID: this container's id, `pct list` shows it)")


def full_filesystem(paths: list[Path]) -> dict | None:
    """The first of `paths` whose file system has less than FULL_BYTES free, as a report field, or None.

    Returns:
        {"path", "free_bytes", "total_bytes"}.
    """
    for p in paths:
        try:
            use = shutil.disk_usage(p)
        except OSError:
            continue
        if use.free < FULL_BYTES:
            return {"path": str(p), "free_bytes": use.free, "total_bytes": use.total}
    return None


def reserve_space(run_dir: Path) -> Path | None:
    """Take RESERVE_BYTES of the run directory's file system in a file of its own (real blocks: written, not
    a sparse or fallocated promise that not every file system keeps), or None when even that does not fit.
    `release` gives the space back when the run ends, so that its last words (the launcher's lines in
    train.log, root_cause.json, the wrapper's exit.json) fit on a disk the run filled."""
    path = run_dir / RESERVE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return None
    try:
        os.write(fd, b"\0" * RESERVE_BYTES)
        os.fsync(fd)
        return path
    except OSError:
        path.unlink(missing_ok=True)
        return None
    finally:
        os.close(fd)


def release(reserve: Path | None) -> None:
    """Give the reserved space back (nothing when there is none, or it was released already)."""
    if reserve is not None:
        try:
            reserve.unlink()
        except OSError:
            pass


_TMP = re.compile(r"\.tmp-(\d+)$")


def remove_stale_temporaries(run_dir: Path) -> list[str]:
    """Delete `*.tmp-PID` files under `run_dir` whose writer PID is gone (a write that died half-way, e.g. on
    a full disk). Returns the paths removed."""
    removed = []
    for p in run_dir.rglob("*.tmp-*"):
        m = _TMP.search(p.name)
        if not m or not p.is_file():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # its writer still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            p.unlink()
            removed.append(str(p))
        except OSError:
            pass
    return removed
