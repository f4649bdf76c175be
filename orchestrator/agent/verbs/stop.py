"""`stop`: end a run gracefully (orchestrator.agent.stopping) and optionally wait until its GPUs are released.

Request: {workdir, run_id, grace_s: 20, gpus: [..], gpu_idle_mib: 1024, release_timeout_s: 120,
          requested_by: {by: "user@workstation", via: "dflashctl stop"}}
Result:  {run_id, signals: ["SIGINT", ...], state, exit: {...} | null, already_ended: bool, gpus: [...]}
Request `lost_cause` (a root_cause.json document): a run of a layout across targets whose node here vanished
without exit.json (its container was stopped) gets exit.json failed with that cause (`record_lost`).
"""

from __future__ import annotations

from orchestrator.agent import atomic, gpu, liveness, rundirs
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import StopAnswer, StopRequest
from orchestrator.agent.stopping import stop_run


def record_lost(workdir: str, run_id: str, cause: dict) -> dict:
    """A node of a run across targets that vanished (its container was stopped: nothing in it could write
    exit.json) gets the run's outcome now: exit.json failed, with the root cause another node's launcher
    found (which names this node's lost rank). Returns the fields of the stop result that change."""
    run_dir = rundirs.runs_root(workdir) / run_id
    info = rundirs.read_json(run_dir / "run.json") or {}
    atomic.write_json(run_dir / "exit.json", {"exit_code": 1, "signal": None, "started": info.get("created"),
                                              "ended": rundirs.utc_now(), "stopped": None, "root_cause": cause,
                                              "lost": True})
    exit_info = rundirs.read_exit(rundirs.load_ref(run_dir))
    return {"exit": exit_info, "state": liveness.state_of(exit_info, False, None)}


def run(request: dict, emit) -> dict:
    req = StopRequest.from_json(request)
    if not req.run_id:
        raise AgentFailure("BadRequest", "stop needs a run_id")
    result = stop_run(req.workdir, req.run_id, req.grace_s, emit, req.requested_by)
    if result["exit"] is None and isinstance(req.lost_cause, dict):
        result = {**result, **record_lost(req.workdir, req.run_id, req.lost_cause)}
    if req.gpus:
        result["gpus"] = gpu.wait_gpus_idle(req.gpus, req.gpu_idle_mib, req.release_timeout_s, emit)
    return StopAnswer(**result).to_json()
