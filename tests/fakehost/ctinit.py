"""PID 1 of a fake container. Started by the `pct` stand-in inside `unshare --mount --pid --uts --fork
--mount-proc`; installed as `<base>/bin/ctinit`. Stdlib only.

Usage: ctinit CT_DIR HOSTNAME

It gives the container its own view of the host file system where it matters:
  <ct>/tmp   over /tmp            (a private /tmp, so the container's tmux socket is its own)
  <ct>/sbin  over /usr/local/sbin (the stand-in nvidia-smi, or nothing for a GPU-less container)
  <ct>/proc-driver over /proc/driver (its nvidia/version: the host's NVIDIA kernel module, as a real
             container sees it in its /proc; skipped when the kernel has no /proc/driver to cover)
then sets the hostname, writes <ct>/ready, and reaps orphans forever (a tmux server started by an exec
is re-parented here). When this process dies the kernel kills everything in the pid namespace.
"""

import os
import signal
import socket
import subprocess
import sys


def main() -> int:
    root, hostname = sys.argv[1], sys.argv[2]
    for src, dest in ((os.path.join(root, "tmp"), "/tmp"), (os.path.join(root, "sbin"), "/usr/local/sbin")):
        os.makedirs(dest, exist_ok=True)
        subprocess.run(["mount", "--bind", src, dest], check=True)
    # procfs cannot grow directories, but a mount may cover one (as docker covers /proc/acpi): this
    # container's own /proc (unshare --mount-proc) is the only one that sees it.
    proc_driver = os.path.join(root, "proc-driver")
    if os.path.isdir(proc_driver) and os.path.isdir("/proc/driver"):
        subprocess.run(["mount", "--bind", proc_driver, "/proc/driver"], check=True)
    socket.sethostname(hostname)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    # A handler (not SIG_DFL, which ignores) so pause() wakes when an adopted orphan dies.
    signal.signal(signal.SIGCHLD, lambda *_: None)
    with open(os.path.join(root, "ready"), "w") as fh:
        fh.write(f"{hostname}\n")
    while True:
        try:
            os.wait()
        except ChildProcessError:
            signal.pause()
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for clarity
            continue


if __name__ == "__main__":
    sys.exit(main())
