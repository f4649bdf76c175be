"""`status`: GPUs, tmux sessions and runs of one target, in one agent call.

Request: {workdir, limit: 20 (newest runs kept; 0 = all)}
Result:  {hostname, gpus: [{index, uuid, used_mib, total_mib}], gpu_reason, sessions: [...],
          runs: [{run_id, experiment, state, duration_s, tokens_per_s, exit_code, signal, ...}]}
"""

from __future__ import annotations

import socket

from orchestrator.agent import liveness, tmuxctl
from orchestrator.agent.gpu import query_gpus
from orchestrator.agent.requests import StatusAnswer, StatusRequest


def run(request: dict, emit) -> dict:
    req = StatusRequest.from_json(request)
    workdir = req.workdir
    gpus, reason = query_gpus(timeout=req.gpu_timeout)
    sessions = tmuxctl.list_sessions()
    all_runs = liveness.list_runs(workdir, sessions)
    limit = req.limit
    return StatusAnswer(
        hostname=socket.gethostname(),
        workdir=workdir,
        gpus=gpus,
        gpu_reason=reason,
        sessions=[s for s in sessions if s["name"].startswith(tmuxctl.SESSION_PREFIX)],
        runs=all_runs[-limit:] if limit > 0 else all_runs,
        total_runs=len(all_runs),
    ).to_json()
