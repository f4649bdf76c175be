"""stop: end a run gracefully (SIGINT, SIGTERM after a grace period, then SIGKILL), in one agent call."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from orchestrator.agent.requests import DEFAULT_GRACE_S, StopAnswer, StopRequest
from orchestrator.errors import AgentError, RunNotFound

if TYPE_CHECKING:
    from orchestrator.agent.events import Event



def requested_by(verb: str = "dflashctl stop") -> dict:
    """Who stops a run, as its stop.json and exit.json record it: {by: user@workstation, via: the verb}."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER: a container's uid
        user = f"uid{os.getuid()}"
    return {"by": f"{user}@{socket.gethostname()}", "via": verb}


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
    of a run across targets that vanished gets exit.json failed with this root cause (orchestrator.ops.nodes).

    Raises:
        UserError: unsafe run id (checked before anything reaches the target).
        RunNotFound: the target has no such run.
        AgentError: the run survived SIGKILL, or GPUs stayed busy.
    """
    from orchestrator.inventory import check_run_ref

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
        _record(ans.run_id, stopped)
    return StopResult(run_id=ans.run_id, state=ans.state, signals=ans.signals, already_ended=ans.already_ended,
                      exit=ans.exit, session=ans.session)


def stop_run(inv, ref: str, *, target: str | None = None, grace_s: float = DEFAULT_GRACE_S,
             on_event: Callable[[Event], None] | None = None) -> StopResult:
    """`dflashctl stop`: the run `ref` (a recorded run id, or one the target knows) on `target`, else on the
    target its record names, else the inventory's default; its recorded GPUs are waited for. A run across
    targets (its record lists nodes): every node, a list of results (orchestrator.ops.nodes.stop_run)."""
    from orchestrator.records import find_record
    from orchestrator.target import open_target

    try:
        rec = find_record(ref)
    except RunNotFound:
        rec = {"run_id": ref, "target": target}
    if rec.get("nodes") and target is None:  # a run across targets: every node (one result each)
        from orchestrator.ops import nodes

        return nodes.stop_run(inv, rec, grace_s=grace_s, on_event=on_event)
    tname = target or rec.get("target") or inv.default_target()
    tgt = open_target(inv, tname)
    try:
        return stop(tgt, rec["run_id"], grace_s=grace_s, gpus=rec.get("gpus") or [],
                    gpu_idle_mib=getattr(inv.target(tname), "gpu_idle_mib", 1024), on_event=on_event)
    finally:
        tgt.close()


def _record(run_id: str, stopped: dict) -> None:
    """Note the stop in the workstation records (`dflashctl runs` shows it); a run launched from another
    workstation has no record here, and that is fine."""
    from orchestrator.records import record_stopped

    record_stopped(run_id, stopped)
