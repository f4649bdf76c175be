"""PID 1 of a fake container. Started by the `pct` stand-in inside `unshare --mount --pid --uts --fork
--mount-proc`; installed as `<base>/bin/ctinit`. Stdlib only.

Usage: ctinit CT_DIR HOSTNAME

Two kinds of container:
- shared root (no `<ct>/rootfs.json`): the host's file system, with
    <ct>/tmp   over /tmp            (a private /tmp, so the container's tmux socket is its own)
    <ct>/sbin  over /usr/local/sbin (the stand-in nvidia-smi, or nothing for a GPU-less container)
- stock (`<ct>/rootfs.json` = {"lower": [dirs, top first], "mounts": [[host dir, path inside], ...]}):
  its own root file system, an overlay of the cached Debian image (read-only lower layers) and
  `<ct>/upper` (this container's writes, kept across restarts like a container's disk), with /proc (of
  its pid namespace), /dev, /sys, <ct>/tmp on /tmp, <ct>/sbin on /usr/local/sbin and the mount points;
  then pivot_root into it and detach the host's root, so nothing of the host is reachable by path. Before
  the pivot it writes /etc/hostname and its block of /etc/hosts as Proxmox does at every start.
Both: <ct>/proc-driver over /proc/driver (its nvidia/version: the host's NVIDIA kernel module, as a real
container sees it in its /proc; skipped when the kernel has no /proc/driver to cover).
Then it sets the hostname, writes <ct>/ready, and reaps orphans forever (a tmux server started by an exec
is re-parented here). When this process dies the kernel kills everything in the pid namespace.
"""

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys

MNT_DETACH = 2
SYS_PIVOT_ROOT = 155  # x86_64


def _mount(*argv: str) -> None:
    subprocess.run(["mount", *argv], check=True)


def proc_driver(root: str, proc: str) -> None:
    """procfs cannot grow directories, but a mount may cover one (as docker covers /proc/acpi): this
    container's own /proc (`proc`) is the only one that sees it."""
    src = os.path.join(root, "proc-driver")
    if os.path.isdir(src) and os.path.isdir(os.path.join(proc, "driver")):
        _mount("--bind", src, os.path.join(proc, "driver"))


def shared_root(root: str) -> None:
    for src, dest in ((os.path.join(root, "tmp"), "/tmp"), (os.path.join(root, "sbin"), "/usr/local/sbin")):
        os.makedirs(dest, exist_ok=True)
        _mount("--bind", src, dest)
    proc_driver(root, "/proc")


PVE_BEGIN, PVE_END = "# --- BEGIN PVE ---", "# --- END PVE ---"


def pve_managed_files(merged: str, hostname: str) -> None:
    """What Proxmox's container setup writes into a Debian container's root at every start (unless the
    container has /etc/.pve-ignore.<file>): /etc/hostname, and /etc/hosts with localhost and the host name
    (127.0.1.1) in a marked block it owns; lines outside the block are the user's and stay. A debootstrap
    image has no /etc/hosts at all, and without it `localhost` does not resolve (torch's rendezvous asks)."""
    etc = os.path.join(merged, "etc")
    if not os.path.exists(os.path.join(etc, ".pve-ignore.hostname")):
        with open(os.path.join(etc, "hostname"), "w") as fh:
            fh.write(f"{hostname}\n")
    path = os.path.join(etc, "hosts")
    if os.path.exists(os.path.join(etc, ".pve-ignore.hosts")):
        return
    try:
        with open(path) as fh:
            old = fh.read().splitlines()
    except FileNotFoundError:
        old = []
    keep, inside = [], False
    for line in old:
        if line.strip() == PVE_BEGIN:
            inside = True
        elif line.strip() == PVE_END:
            inside = False
        elif not inside:
            keep.append(line)
    block = [PVE_BEGIN, f"127.0.1.1 {hostname}.localdomain {hostname}", PVE_END]
    if not any(line.split()[1:2] == ["localhost"] or "localhost" in line.split()[1:] for line in keep if line.strip()):
        keep = ["127.0.0.1 localhost.localdomain localhost", "::1 localhost ip6-localhost ip6-loopback", *keep]
    with open(path, "w") as fh:
        fh.write("\n".join(keep + block) + "\n")


def own_root(root: str, spec: dict, hostname: str) -> None:
    """Assemble the container's root under <ct>/root and pivot into it."""
    merged, upper, work = (os.path.join(root, d) for d in ("root", "upper", "ovlwork"))
    for d in (merged, upper, work):
        os.makedirs(d, exist_ok=True)
    _mount("-t", "overlay", "overlay", "-o", f"lowerdir={':'.join(spec['lower'])},upperdir={upper},workdir={work}",
           merged)
    pve_managed_files(merged, hostname)
    _mount("-t", "proc", "proc", os.path.join(merged, "proc"))
    proc_driver(root, os.path.join(merged, "proc"))
    _mount("--rbind", "/dev", os.path.join(merged, "dev"))
    _mount("--rbind", "/sys", os.path.join(merged, "sys"))
    binds = [(os.path.join(root, "tmp"), "/tmp"), (os.path.join(root, "sbin"), "/usr/local/sbin")]
    binds += [(src, dest) for src, dest in spec.get("mounts", [])]
    for src, dest in binds:
        inside = os.path.join(merged, dest.lstrip("/"))
        os.makedirs(inside, exist_ok=True)
        _mount("--bind", src, inside)
    libc = ctypes.CDLL(None, use_errno=True)
    os.chdir(merged)
    # pivot_root(".", "."): the old root ends up stacked on the new one; detaching it leaves only the
    # container's root in this mount namespace (what `pct exec` enters).
    if libc.syscall(SYS_PIVOT_ROOT, b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root failed")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "detaching the host's root failed")
    os.chdir("/")


def main() -> int:
    root, hostname = sys.argv[1], sys.argv[2]
    ct_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # <ct>/ready is written through it after a pivot
    spec_path = os.path.join(root, "rootfs.json")
    if os.path.exists(spec_path):
        with open(spec_path) as fh:
            own_root(root, json.load(fh), hostname)
    else:
        shared_root(root)
    os.chdir("/")  # what `pct exec` starts in (nsenter -r -w: this process's root and working directory)
    socket.sethostname(hostname)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    # A handler (not SIG_DFL, which ignores) so pause() wakes when an adopted orphan dies.
    signal.signal(signal.SIGCHLD, lambda *_: None)
    fd = os.open("ready", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=ct_fd)
    os.write(fd, f"{hostname}\n".encode())
    os.close(fd)
    os.close(ct_fd)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            signal.pause()
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for clarity
            continue


if __name__ == "__main__":
    sys.exit(main())
