"""`stop`: end a run gracefully (orchestrator.agent.stopping) and optionally wait until its GPUs are released.

Request: {workdir, run_id, grace_s: 20, gpus: [..], gpu_idle_mib: 1024, release_timeout_s: 120,
          requested_by: {by: "user@workstation", via: "dflashctl stop"}}
Result:  {run_id, signals: ["SIGINT", ...], state, exit: {...} | null, already_ended: bool, gpus: [...]}
"""

from __future__ import annotations

from orchestrator.agent import gpu
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.stopping import DEFAULT_GRACE_S, stop_run


def run(request: dict, emit) -> dict:
    workdir = request["workdir"]
    run_id = request.get("run_id")
    if not run_id:
        raise AgentFailure("BadRequest", "stop needs a run_id")
    result = stop_run(workdir, run_id, float(request.get("grace_s", DEFAULT_GRACE_S)), emit,
                      request.get("requested_by"))
    gpus = [int(g) for g in request.get("gpus") or []]
    if gpus:
        result["gpus"] = gpu.wait_gpus_idle(
            gpus, int(request.get("gpu_idle_mib", 1024)), float(request.get("release_timeout_s", 120)), emit
        )
    return result
