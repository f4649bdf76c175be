"""The command a launched run executes and its environment, from the launch request (pure: nothing runs).

The preflight (orchestrator.agent.preflight) plans with these and the launch verb writes what they return.
"""

from __future__ import annotations

import sys
from pathlib import Path

from orchestrator.agent import resume
from orchestrator.agent import warmup as warmups
from orchestrator.agent.protocol import AgentFailure, need

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


def build_command(request: dict, run_dir: Path, config: dict | None = None,
                  resume_dir: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv the session runs and the extra environment it gets (on top of the agent's own).

    kind dflash: `<this python> -m trainer.launch --config <run>/config.json [--resume <run>]`: one process
    for the colocated CPU layout (which sees no GPU: CUDA_VISIBLE_DEVICES=""), else one process per GPU of
    the layout, each given exactly its GPU by trainer.launch itself (see run_environment). PYTHONPATH stays
    the agent's (the bundle zip in a container, the source tree locally); TORCHINDUCTOR_CACHE_DIR is the
    config's compile.cache_dir. kind command: the experiment's argv with its env, CUDA_VISIBLE_DEVICES from
    its gpus, and DFLASHCTL_RESUME_DIR=<old run dir> when resuming.

    Args:
        config: kind dflash: the resolved config (default: request["config"]).
        resume_dir: the directory the run continues (dflash: the new, seeded run dir; command: the old one).
    """
    kind = request.get("kind")
    extra = {"PYTHONUNBUFFERED": "1", "DFLASHCTL_RUN_ID": run_dir.name, "DFLASHCTL_RUN_DIR": str(run_dir)}
    gpus = [int(g) for g in request.get("gpus") or []]
    if kind == "dflash":
        argv = [sys.executable, "-m", "trainer.launch", "--config", str(run_dir / "config.json")]
        if resume_dir is not None:
            argv += ["--resume", str(resume_dir)]
        if request.get("node"):  # a layout across targets: this container is node I of the layout
            argv += ["--node", str(int(request["node"]["index"]))]
        if gpus:
            extra["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the layout's indices are nvidia-smi's
        else:
            extra["CUDA_VISIBLE_DEVICES"] = ""  # the colocated CPU layout sees no GPU
        cache = ((config if config is not None else request.get("config") or {}).get("compile") or {}).get("cache_dir")
        if cache:
            extra["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
        return argv, extra
    if kind == "command":
        argv = need(request, "command", list, "launch")
        if not argv or not all(isinstance(a, str) for a in argv):
            raise AgentFailure("BadRequest", "launch request: command must be a non-empty list of strings")
        env = check_env(dict(request.get("env") or {}))
        if gpus:
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        if resume_dir is not None:
            extra[resume.RESUME_ENV] = str(resume_dir)
        return list(argv), {**env, **extra}
    raise AgentFailure("BadRequest", f"launch request: unknown experiment kind {kind!r} (dflash or command)")


def run_environment(base: dict[str, str], extra: dict[str, str], request: dict) -> dict[str, str]:
    """The run's whole environment (pure): the agent's own, minus what must not leak, plus `extra`.

    A dflash GPU layout drops any inherited CUDA_VISIBLE_DEVICES: the launcher uses no GPU, and each rank
    gets exactly its own from trainer.launch (Layout.env), which always replaces the inherited value.
    """
    env = {k: v for k, v in base.items() if k not in DROP_ENV}
    if request.get("kind") == "dflash" and request.get("gpus"):
        env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return env


def run_config(request: dict, workdir: str, run_dir: Path, src: resume.ResumeSource | None,
                create: bool = True) -> dict:
    """kind dflash: the config written to runs/<id>/config.json (the old run's when resuming), writing into
    run_dir, with compile.cache_dir defaulting to the target's persistent cache (made unless `create` is
    false: a dry run changes nothing)."""
    config = resume.resumed_config(src, run_dir) if src is not None else {**(request.get("config") or {}),
                                                                         "output_dir": str(run_dir)}
    return warmups.resolve_compile(config, workdir, create=create)
