"""`gpus`: every GPU's index, uuid and memory use (MiB) from nvidia-smi inside the target.

Result: {"gpus": [{index, uuid, used_mib, total_mib}, ...], "reason": str | null} (reason says why the
list is empty or partial; an empty list is not an error).
"""

from __future__ import annotations

from orchestrator.agent.gpu import query_gpus
from orchestrator.agent.requests import GpusRequest


def run(request: dict, emit) -> dict:
    gpus, reason = query_gpus(timeout=GpusRequest.from_json(request).timeout)
    return {"gpus": gpus, "reason": reason}
