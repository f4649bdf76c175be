"""Can this machine run the fake host's LXC containers? `python3 -m fakehost.check` (from tests/), as .ci/run
does before the suite: prints the reason and exits 1 when it cannot."""

from __future__ import annotations

import sys
import time

from . import pct as pct_impl
from .host import FakePVE, lxc_missing
def smoke() -> int:
    """Start a fake host, one container in it and one command inside; print the reason when any of it
    fails (what .ci/run checks before the suite)."""
    missing = lxc_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 1
    host = FakePVE()
    try:
        host.start()
        start = time.monotonic()
        res = host.create_container(100, gpus=0).exec(["true"])
        if res.returncode != 0:
            raise RuntimeError(f"lxc-attach into the container failed: {res.stderr.decode(errors='replace')}")
        print(f"fake host: an LXC container started and entered in {time.monotonic() - start:.1f} s")
        return 0
    except (RuntimeError, pct_impl.Die, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        host.close()


if __name__ == "__main__":
    sys.exit(smoke())
