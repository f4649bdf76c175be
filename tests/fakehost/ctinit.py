"""PID 1 of a shared-root fake container (a privileged LXC container over the host's /, `lxc.init.cmd`).
Installed as `<base>/bin/ctinit`; stdlib only.

A stock container boots its image's systemd instead. This one only reaps orphans (a tmux server started by
an exec is re-parented here) until `lxc-stop --kill` kills it, and everything in its pid namespace with it.
"""

import os
import signal
import sys


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    signal.signal(signal.SIGPWR, lambda *_: os._exit(0))  # lxc-stop's clean shutdown signal
    # A handler (not SIG_DFL, which ignores) so pause() wakes when an adopted orphan dies.
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            signal.pause()


if __name__ == "__main__":
    sys.exit(main())
