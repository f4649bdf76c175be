"""`warmup`: compile an experiment's training shapes on every drafter GPU, in ONE agent call.

Request (built by orchestrator/ops/warmup.py):
  {workdir, experiment, config: {...} (the resolved TrainConfig, layout included), layout: {target_gpus,
   drafter_gpus}, gpu_idle_mib: int, device: "cuda"|"cpu" (GPU warm-ups; "cpu" only for tests)}
Events: progress steps lock, gpus, warmup (one per shape and one per device, with gpu, compile_s,
cache_hits, cache_misses, wall_s).
Result: {experiment, dir, config, cache_dir, warmups: [{gpu, device, compile_s, cache_hits, cache_misses,
         wall_s, ...}]}
Refusals: LockHeld (a launch or warm-up of this experiment is in progress), GpuClaimed (a launch, run or
warm-up holds a drafter GPU), GpuBusy (a drafter GPU is in use); a failed warm-up
is WarmupFailed. The files live in `<workdir>/warmup/<experiment>/`: config.json, warmup.log, warmup.json.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from orchestrator.agent import atomic, claims, gpu, launchlock, rundirs
from orchestrator.agent import warmup as warmups
from orchestrator.agent.requests import WarmupAnswer, WarmupRequest

_DROP_ENV = ("TMUX", "TMUX_PANE", "CUDA_VISIBLE_DEVICES")


def run(request: dict, emit) -> dict:
    req = WarmupRequest.from_json(request)
    workdir = req.workdir
    experiment = rundirs.check_name("experiment", req.experiment)
    config = req.config
    layout = req.layout or config.get("layout") or {}
    drafters = [int(g) for g in layout.get("drafter_gpus") or []]
    targets: list[int | None] = list(drafters) or [None]  # a CPU layout: one warm-up on the CPU

    # The experiment's launch lock (no other warm-up or launch of it writes the same cache entries) and a
    # claim of its drafter GPUs (no launch hands them to a run while this compiles on them).
    lock = launchlock.LaunchLock(workdir, experiment)
    lock.acquire({"pid": os.getpid(), "host": socket.gethostname(), "run_id": f"warmup of {experiment}",
                  "experiment": experiment, "since": rundirs.utc_now()})
    emit.progress("lock", f"holding {lock.path}")
    token = None
    try:
        if drafters:
            token = claims.claim(workdir, drafters, {"run_id": None, "experiment": experiment}, emit,
                                 req.claim_wait_s)
        threshold = req.gpu_idle_mib
        if drafters:
            gpu.preflight_gpus(drafters, threshold)
            emit.progress("gpus", f"drafter GPUs {drafters} idle (under {threshold} MiB)")
        out = Path(workdir) / "warmup" / experiment
        out.mkdir(parents=True, exist_ok=True)
        config = warmups.resolve_compile({**config, "output_dir": str(out)}, workdir)
        atomic.write_json(out / "config.json", config)
        log_path = out / "warmup.log"
        log_path.write_bytes(b"")  # this warm-up's log only: the previous one is of no use after it
        cache = config["compile"]["cache_dir"]
        base = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        done = warmups.run_warmups(out / "config.json", targets, base, emit, log_path,
                                   device=req.device or "cuda", cwd=out, cache_dir=cache)
        atomic.write_bytes(out / "warmup.json", (json.dumps(done, indent=2) + "\n").encode())
        return WarmupAnswer(experiment=experiment, dir=str(out), config=str(out / "config.json"), cache_dir=cache,
                            warmups=done).to_json()
    finally:
        if token is not None:
            claims.release(workdir, token)
        lock.release()
