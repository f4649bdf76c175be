"""`stop`: end a run gracefully (orchestrator.agent.stopping) and optionally wait until its GPUs are released.

Request: {workdir, run_id, grace_s: 20, gpus: [..], gpu_idle_mib: 1024, release_timeout_s: 120,
          requested_by: {by: "user@workstation", via: "dflashctl stop"}}
Result:  {run_id, signals: ["SIGINT", ...], state, exit: {...} | null, already_ended: bool, gpus: [...]}
"""

from __future__ import annotations

from orchestrator.agent import gpu
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import StopRequest
from orchestrator.agent.stopping import stop_run


def run(request: dict, emit) -> dict:
    req = StopRequest.from_json(request)
    if not req.run_id:
        raise AgentFailure("BadRequest", "stop needs a run_id")
    result = stop_run(req.workdir, req.run_id, req.grace_s, emit, req.requested_by)
    if req.gpus:
        result["gpus"] = gpu.wait_gpus_idle(req.gpus, req.gpu_idle_mib, req.release_timeout_s, emit)
    return result
