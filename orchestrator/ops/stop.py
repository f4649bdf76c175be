"""stop: end a run gracefully (SIGINT, SIGTERM after a grace period, then SIGKILL), in one agent call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from orchestrator.errors import AgentError, RunNotFound

DEFAULT_GRACE_S = 20.0


@dataclass
class StopResult:
    run_id: str
    state: str
    """The run's state afterwards: succeeded / failed (it wrote exit.json) or crashed."""
    signals: list[str]
    """Signals sent, in order (empty when the run had already ended)."""
    already_ended: bool
    exit: dict | None
    session: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def stop(
    target,
    run_id: str,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    gpus: list[int] | None = None,
    gpu_idle_mib: int = 1024,
    on_event: Callable[[dict], None] | None = None,
) -> StopResult:
    """Stop run `run_id` on `target`; with `gpus`, also wait until they are idle again.

    Raises:
        UserError: unsafe run id (checked before anything reaches the target).
        RunNotFound: the target has no such run.
        AgentError: the run survived SIGKILL, or GPUs stayed busy.
    """
    from orchestrator.inventory import check_run_ref

    check_run_ref(run_id)
    request = {"run_id": run_id, "grace_s": grace_s, "gpus": gpus or [], "gpu_idle_mib": gpu_idle_mib}
    # Worst case: two grace periods, the post-SIGKILL wait, and the GPU release wait.
    timeout = 2 * grace_s + 60 + (150 if gpus else 0)
    try:
        data = target.agent("stop", request, on_event=on_event, timeout=timeout)
    except AgentError as exc:
        if exc.agent_type == "RunNotFound":
            raise RunNotFound(exc.message, fix=f"dflashctl status --target {target.name}") from None
        raise
    return StopResult(
        run_id=data["run_id"],
        state=data.get("state") or "crashed",
        signals=data.get("signals") or [],
        already_ended=bool(data.get("already_ended")),
        exit=data.get("exit"),
        session=data.get("session"),
    )
