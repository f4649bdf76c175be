"""Waiting for a condition in a test: poll until it holds, or fail naming what was awaited.

Event order, not time, is what these tests assert; the timeout only bounds a hang, so it is generous (the machine
is shared and often loaded)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float = 30.0, *, interval: float = 0.05, what: str = "") -> T:
    """Call `pred` until it returns something truthy, and return that.

    Raises:
        AssertionError: `pred` stayed falsy for `timeout` seconds (the message names `what`, when given).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what or 'condition'} not met in {timeout:g} s")
        time.sleep(interval)
