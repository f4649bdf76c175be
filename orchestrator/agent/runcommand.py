"""The command a launched run executes and its environment, from the launch request (pure: nothing runs).

The preflight (orchestrator.agent.preflight) plans with these and the launch verb writes what they return.
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.agent import resume
from orchestrator.agent import warmup as warmups
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import LaunchRequest

SCRIPT_NAME = "start_training.sh"
ENV_FILE = "launch.env0"
# Variables of the agent's own environment that must not leak into a run.
DROP_ENV = ("TMUX", "TMUX_PANE")


def check_env(env: dict) -> dict[str, str]:
    for k, v in env.items():
        if not k or not (k[0].isalpha() or k[0] == "_") or not all(c.isalnum() or c == "_" for c in k):
            raise AgentFailure("BadRequest", f"bad environment variable name {k!r}", fix="use [A-Za-z_][A-Za-z0-9_]*")
        if not isinstance(v, str) or "\x00" in v:
            raise AgentFailure("BadRequest", f"environment variable {k}: value must be a string without NUL bytes")
    return env


def build_command(req: LaunchRequest, gpus: list[int], run_dir: Path, config: dict | None = None,
                  resume_dir: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv the session runs and the extra environment it gets (on top of the agent's own).

    kind dflash: `<this python> -m trainer.launch --config <run>/config.json [--resume <run>]`: one process
    for the colocated CPU layout (which sees no GPU: CUDA_VISIBLE_DEVICES=""), else one process per GPU of
    the layout, each given exactly its GPU by trainer.launch itself (see run_environment). PYTHONPATH stays
    the agent's (the bundle zip in a container, the source tree locally); TORCHINDUCTOR_CACHE_DIR is the
    config's compile.cache_dir. kind command: the experiment's argv with its env, CUDA_VISIBLE_DEVICES from
    its gpus, and DFLASHCTL_RESUME_DIR=<old run dir> when resuming.

    Args:
        gpus: the GPUs the run occupies (a resumed run's may differ from the request's: preflight.run_gpus).
        config: kind dflash: the resolved config (default: req.config).
        resume_dir: the directory the run continues (dflash: the new, seeded run dir; command: the old one).
    """
    extra = {"PYTHONUNBUFFERED": "1", "DFLASHCTL_RUN_ID": run_dir.name, "DFLASHCTL_RUN_DIR": str(run_dir)}
    if req.kind == "dflash":
        argv = [sys.executable, "-m", "trainer.launch", "--config", str(run_dir / "config.json")]
        if resume_dir is not None:
            argv += ["--resume", str(resume_dir)]
        if req.node:  # a layout across targets: this container is node I of the layout
            argv += ["--node", str(int(req.node["index"]))]
        if gpus:
            extra["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the layout's indices are nvidia-smi's
        else:
            extra["CUDA_VISIBLE_DEVICES"] = ""  # the colocated CPU layout sees no GPU
        cache = ((config if config is not None else req.config or {}).get("compile") or {}).get("cache_dir")
        if cache:
            extra["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
        return argv, extra
    if req.kind == "command":
        if not req.command:
            raise AgentFailure("BadRequest", "launch request: command must be a non-empty list of strings")
        env = check_env(dict(req.env or {}))
        if gpus:
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        if resume_dir is not None:
            extra[resume.RESUME_ENV] = str(resume_dir)
        return list(req.command), {**env, **extra}
    raise AgentFailure("BadRequest", f"launch request: unknown experiment kind {req.kind!r} (dflash or command)")


def run_environment(base: dict[str, str], extra: dict[str, str], kind: str, gpus: list[int]) -> dict[str, str]:
    """The run's whole environment (pure): the agent's own, minus what must not leak, plus `extra`.

    A dflash GPU layout drops any inherited CUDA_VISIBLE_DEVICES: the launcher uses no GPU, and each rank
    gets exactly its own from trainer.launch (Layout.env), which always replaces the inherited value.
    """
    env = {k: v for k, v in base.items() if k not in DROP_ENV}
    if kind == "dflash" and gpus:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


def run_config(req: LaunchRequest, run_dir: Path, src: resume.ResumeSource | None) -> dict:
    """kind dflash: the config written to runs/<id>/config.json (the old run's when resuming), writing into
    run_dir, with compile.cache_dir defaulting to the target's persistent cache (not made here: the launch
    makes it when it executes its plan)."""
    config = resume.resumed_config(src, run_dir) if src is not None else {**(req.config or {}),
                                                                         "output_dir": str(run_dir)}
    return warmups.resolve_compile(config, req.workdir, create=False)
