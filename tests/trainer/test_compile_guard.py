"""The FX-tracing race (docs/remote-stack.md §3) reproduced for real, and the guard that prevents it."""

from __future__ import annotations

import threading

import pytest
import torch

from trainer.compile_guard import CompileGuard


class _BlocksWhileTraced(torch.nn.Module):
    """forward runs during symbolic_trace; it parks the tracing thread so another thread can run meanwhile."""

    def __init__(self, inside: threading.Event, release: threading.Event):
        super().__init__()
        self.inside, self.release = inside, release
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.inside.set()
        self.release.wait(10)
        return self.lin(x).relu()


def _race(guard: CompileGuard | None) -> list[BaseException]:
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    if guard is not None:
        compiled = guard.compiled(compiled)
    inside, release = threading.Event(), threading.Event()
    module = _BlocksWhileTraced(inside, release)
    errors: list[BaseException] = []
    results: list[torch.Tensor] = []

    def tracer():
        try:
            if guard is not None:
                with guard.tracing():
                    torch.fx.symbolic_trace(module)
            else:
                torch.fx.symbolic_trace(module)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def caller():
        try:
            results.append(compiled(torch.ones(3)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            release.set()

    if guard is not None:
        compiled(torch.ones(3))  # warm: the real launch warms up before threads start
    t1 = threading.Thread(target=tracer)
    t1.start()
    assert inside.wait(10), "the tracer never entered forward"
    t2 = threading.Thread(target=caller)
    t2.start()
    if guard is not None:
        # With the guard the caller must wait for the trace: it cannot finish while the tracer is parked.
        t2.join(0.5)
        assert t2.is_alive(), "the guarded call ran while another thread was FX-tracing"
        release.set()
    t2.join(20)
    t1.join(20)
    if not errors:
        assert torch.equal(results[0], torch.full((3,), 3.0))
    return errors


def test_fx_trace_in_one_thread_breaks_compiled_call_in_another():
    errors = _race(guard=None)
    assert errors, "expected the FX tracing race to raise"
    assert "Detected that you are using FX to symbolically trace a dynamo-optimized function" in str(errors[0])


def test_guard_prevents_the_race():
    assert _race(guard=CompileGuard()) == []


def test_guard_first_call_exclusive_then_shared():
    guard = CompileGuard()
    calls = []
    f = guard.compiled(lambda x: calls.append(x.shape) or x)
    f(torch.ones(2))
    f(torch.ones(2))
    f(torch.ones(3))
    assert guard.first_calls == 2  # one per input signature
    assert len(calls) == 3


@pytest.mark.parametrize("n_threads", [4])
def test_warm_calls_run_concurrently(n_threads):
    guard = CompileGuard()
    barrier = threading.Barrier(n_threads, timeout=10)
    f = guard.compiled(lambda x: barrier.wait() if x.shape[0] == 1 and threading.current_thread().name != "MainThread" else 0)
    f(torch.ones(1))  # warm (main thread does not wait on the barrier)
    threads = [threading.Thread(target=f, args=(torch.ones(1),)) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    # Every thread passed the barrier together: warm calls were not serialised.
    assert not barrier.broken
