"""`echo`: returns its request and the agent's interpreter; the smallest round trip (tests, benchmarks)."""

from __future__ import annotations

import os
import sys


def run(request: dict, emit) -> dict:
    for i in range(int(request.get("events", 0))):
        emit.progress("echo", f"event {i}", i=i)
    return {"request": request, "python": sys.executable, "pid": os.getpid(), "argv0": sys.argv[0]}
