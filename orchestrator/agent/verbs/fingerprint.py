"""`fingerprint`: the venv fingerprint of the target (what launch compares and `runs diff` shows).

Request: {"workdir", "profile": {venv profile dict}, "expected_lock_hash": str|null}
Result:  {"fingerprint": {...}, "diff": [human lines; empty when it matches the expected lock]}
"""

from __future__ import annotations

from orchestrator.agent.requests import FingerprintRequest
from orchestrator.agent.venvfingerprint import current_fingerprint, fingerprint_diff


def run(request: dict, emit) -> dict:
    req = FingerprintRequest.from_json(request)
    fp = current_fingerprint(req.workdir, req.profile or {})
    return {"fingerprint": fp, "diff": fingerprint_diff(fp, req.expected_lock_hash)}
