"""Ending a run on ONE target (SIGINT, SIGTERM after a grace period, then SIGKILL) in one agent call: the action
that `stop` maps over a run's placements and that `launch` uses to stop the nodes it had started when another
node of a layout across targets could not start."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from orchestrator.agent.requests import DEFAULT_GRACE_S, StopAnswer, StopRequest
from orchestrator.errors import AgentError, RunNotFound
from orchestrator.inventory import check_run_ref
from orchestrator.records import record_stopped, requested_by

if TYPE_CHECKING:
    from orchestrator.agent.events import Event


@dataclass
class StopResult:
    run_id: str
    state: str
    """The run's state afterwards: stopped (the stop ended it; exit["stopped"] says by whom and when), or
    succeeded / failed / crashed when it had already ended."""
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
    on_event: Callable[[Event], None] | None = None,
    lost_cause: dict | None = None,
) -> StopResult:
    """Stop run `run_id` on `target`; with `gpus`, also wait until they are idle again. `lost_cause`: a node
    of a run across targets that vanished gets exit.json failed with this root cause (orchestrator.ops.stop).

    Raises:
        UserError: unsafe run id (checked before anything reaches the target).
        RunNotFound: the target has no such run.
        AgentError: the run survived SIGKILL, or GPUs stayed busy.
    """
    check_run_ref(run_id)
    request = StopRequest(run_id=run_id, grace_s=grace_s, gpus=gpus or [], gpu_idle_mib=gpu_idle_mib,
                          requested_by=requested_by(), lost_cause=lost_cause).to_json()
    # Worst case: two grace periods, the post-SIGKILL wait, and the GPU release wait.
    timeout = 2 * grace_s + 60 + (150 if gpus else 0)
    try:
        ans = target.agent("stop", request, on_event=on_event, timeout=timeout, answer=StopAnswer)
    except AgentError as exc:
        if exc.agent_type == "RunNotFound":
            raise RunNotFound(exc.message, fix=f"dflashctl status --target {target.name}") from None
        raise
    stopped = (ans.exit or {}).get("stopped")  # exit.json: a record the run's wrapper wrote, not the protocol
    if ans.state == "stopped" and isinstance(stopped, dict):
        # `dflashctl runs` shows it; a run launched from another workstation has no record here, and that is fine.
        record_stopped(ans.run_id, stopped)
    return StopResult(run_id=ans.run_id, state=ans.state, signals=ans.signals, already_ended=ans.already_ended,
                      exit=ans.exit, session=ans.session)
