"""A guard for torch.compile in processes that still have threads.

Why: Dynamo's `compile_wrapper` raises `Detected that you are using FX to symbolically trace a
dynamo-optimized function` whenever `torch.fx._symbolic_trace._is_fx_tracing_flag` is set, and that flag is
PROCESS-global (torch <= 2.13 at least): while thread A FX-traces (symbolic_trace, create_block_mask under
compile, make_fx ...), thread B calling ANY compiled function raises. Compiling itself also mutates global
Dynamo state. The real fix is one process per GPU (trainer.launch); this guard covers the threads that remain
(data preparation, feature prefetch).

Rule: FX traces and first calls of a compiled callable for a new input signature are EXCLUSIVE; warm calls
of compiled callables are SHARED (they may run concurrently with each other, never with a trace/compile).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class _SharedExclusiveLock:
    """A writer-preferring readers/writer lock (exclusive = trace or compile, shared = warm call)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer: int | None = None  # thread ident holding exclusive
        self._writer_depth = 0
        self._writers_waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._writer == me:  # already exclusive in this thread: nested call is fine
            yield
            return
        with self._cond:
            while self._writer is not None or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._writer_depth += 1
            else:
                self._writers_waiting += 1
                while self._writer is not None or self._readers:
                    self._cond.wait()
                self._writers_waiting -= 1
                self._writer = me
                self._writer_depth = 1
        try:
            yield
        finally:
            with self._cond:
                self._writer_depth -= 1
                if self._writer_depth == 0:
                    self._writer = None
                    self._cond.notify_all()


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What Dynamo specialises on, roughly: tensor shapes/dtypes/devices and plain values."""

    def one(x: Any) -> Any:
        shape = getattr(x, "shape", None)
        if shape is not None and hasattr(x, "dtype"):
            return ("T", tuple(shape), str(x.dtype), str(getattr(x, "device", "")))
        if isinstance(x, (int, float, bool, str, type(None))):
            return x
        if isinstance(x, (tuple, list)):
            return tuple(one(v) for v in x)
        return type(x).__name__

    return (tuple(one(a) for a in args), tuple(sorted((k, one(v)) for k, v in kwargs.items())))


class CompileGuard:
    """Serialises FX tracing and compilation against calls of compiled callables across threads.

    Usage:
        guard = CompileGuard()
        step = guard.compiled(torch.compile(step_fn))      # first call per shape exclusive, then shared
        with guard.tracing():                               # around any FX trace / make_fx / compile of masks
            gm = torch.fx.symbolic_trace(module)
    """

    def __init__(self) -> None:
        self._lock = _SharedExclusiveLock()
        self._warm: set[tuple] = set()
        self._warm_lock = threading.Lock()
        self.first_calls = 0

    def tracing(self) -> contextlib.AbstractContextManager[None]:
        """Hold this while FX-tracing (or compiling) outside a guarded callable."""
        return self._lock.exclusive()

    def compiled(self, fn: F) -> F:
        """Wrap a compiled callable: exclusive until warm for an input signature, shared afterwards."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = (id(fn), _signature(args, kwargs))
            with self._warm_lock:
                warm = key in self._warm
            if warm:
                with self._lock.shared():
                    return fn(*args, **kwargs)
            with self._lock.exclusive():
                out = fn(*args, **kwargs)
                with self._warm_lock:
                    if key not in self._warm:
                        self._warm.add(key)
                        self.first_calls += 1
                return out

        return wrapper  # type: ignore[return-value]


# One guard per process: every thread must agree on the same lock.
GUARD = CompileGuard()
