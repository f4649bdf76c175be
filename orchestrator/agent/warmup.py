"""The warm-up driver shared by the `launch` and `warmup` verbs. Standard library only.

One `python -m trainer.warmup` process per drafter GPU, one after the other: each process sees its GPU as
cuda:0 (CUDA_VISIBLE_DEVICES=<gpu>), so the compile-cache keys match the training ranks' and no two compiles
ever race inside one interpreter. A CPU layout gets one warm-up on the CPU. Compiled artifacts persist in
the experiment's `compile.cache_dir`, by default `<workdir>/inductor-cache` (a directory that outlives runs
and reboots, unlike /tmp).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.agent.protocol import AgentFailure

CACHE_DIR_NAME = "inductor-cache"


def default_cache_dir(workdir: str | Path) -> Path:
    """The persistent inductor cache of a target: `<workdir>/inductor-cache`."""
    return Path(workdir) / CACHE_DIR_NAME


def resolve_compile(config: dict, workdir: str | Path, create: bool = True) -> dict:
    """A copy of a TrainConfig dict whose `compile.cache_dir` is set: the experiment's own value, else the
    target's persistent cache (created here unless `create` is false, so no two processes race to make it)."""
    config = dict(config)
    comp = dict(config.get("compile") or {})
    if not comp.get("cache_dir"):
        comp["cache_dir"] = str(default_cache_dir(workdir))
    config["compile"] = comp
    if create:
        make_cache_dir(config)
    return config


def make_cache_dir(config: dict) -> None:
    """Create the compile cache of a config resolve_compile returned (its compile.cache_dir)."""
    Path(config["compile"]["cache_dir"]).expanduser().mkdir(parents=True, exist_ok=True)


def warmup_argv(python: str, config: Path, device: str = "cuda") -> list[str]:
    """The trainer's warm-up for one device: `python -m trainer.warmup --config FILE --device DEVICE`."""
    return [python, "-m", "trainer.warmup", "--config", str(config), "--device", device]


def warmup_env(base: dict[str, str], gpu: int | None, cache_dir: str | None) -> dict[str, str]:
    """The environment of one warm-up process (pure): exactly one GPU visible in nvidia-smi's numbering, or
    none for a CPU warm-up; TORCHINDUCTOR_CACHE_DIR at the persistent cache."""
    env = dict(base)
    if gpu is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # nvidia-smi's indices, like the training ranks
    if cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _label(gpu: int | None) -> str:
    return "CPU" if gpu is None else f"GPU {gpu}"


def run_warmups(
    config_path: Path,
    gpus: list[int | None],
    env: dict[str, str],
    emit,
    log_path: Path,
    *,
    device: str = "cuda",
    cwd: Path | None = None,
    cache_dir: str | None = None,
    python: str = sys.executable,
) -> list[dict]:
    """Warm up each entry of `gpus` in turn (None: the CPU), streaming progress events.

    Args:
        config_path: the TrainConfig file the warm-up reads (a run's config.json).
        gpus: GPU indices, or [None] for one CPU warm-up.
        env: the base environment (the venv's PYTHONPATH etc.); per-process variables are added.
        emit: the agent's Emitter; one `warmup` progress event per shape and one per device.
        log_path: the warm-ups' stderr is appended here.
        device: `--device` for GPU warm-ups (tests on a GPU-less box pass "cpu").
        cache_dir: TORCHINDUCTOR_CACHE_DIR for the processes.

    Returns:
        One summary per device: {gpu, device, compile_s, cache_hits, cache_misses, wall_s, ...}.
    Raises:
        AgentFailure("WarmupFailed"): a warm-up exited non-zero; data names the GPU, the log and `started`.
    """
    done: list[dict] = []
    for gpu in gpus:
        label = _label(gpu)
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t0 = time.monotonic()
        emit.progress("warmup", f"{label}: compiling the training shapes", gpu=gpu)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                warmup_argv(python, config_path, "cpu" if gpu is None else device),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                cwd=str(cwd or config_path.parent), env=warmup_env(env, gpu, cache_dir),
            )
            for raw in proc.stdout:
                try:
                    ev = json.loads(raw)
                except ValueError:
                    continue
                if not isinstance(ev, dict):
                    continue
                kind = ev.pop("event", "")
                if kind == "warmup_shape":
                    emit.progress("warmup", f"{label}: shape {ev.get('shape')} compiled in {ev.get('compile_s')} s "
                                  f"(fx cache hit {ev.get('fxgraph_cache_hit')}, miss {ev.get('fxgraph_cache_miss')})",
                                  gpu=gpu, warmup=ev)
                elif kind == "warmup_done":
                    wall = round(time.monotonic() - t0, 2)
                    done.append({"gpu": gpu, "wall_s": wall, **ev})
                    emit.progress("warmup", f"{label}: warm in {wall:.1f} s, compile {ev.get('compile_s')} s, "
                                  f"cache hits {ev.get('cache_hits')} / misses {ev.get('cache_misses')}",
                                  gpu=gpu, wall_s=wall, warmup=ev)
            rc = proc.wait()
        if rc != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise AgentFailure(
                "WarmupFailed",
                f"warm-up on {label} failed with exit code {rc}: " + " | ".join(tail),
                fix=f"read {log_path}; `dflashctl diagnose` it if it is a known crash",
                data={"gpu": gpu, "log": str(log_path), "exit_code": rc, "started": started},
            )
    return done
