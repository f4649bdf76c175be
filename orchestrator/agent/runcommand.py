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
DATA_VENVS = "data-venvs"
"""Under the workdir: one directory per data-stage venv profile (`<workdir>/data-venvs/<profile>/venvs/current`),
beside the trainer's `<workdir>/venvs/current`: vLLM pins its own torch, so the two never share one `current`."""
ENV_FILE = "launch.env0"
SECRET_FILE = "launch.secret0"
"""The secret variables (LaunchRequest.secret_env), NUL-separated KEY=VALUE, mode 0600, apart from ENV_FILE:
start_training.sh reads it and deletes it before the command starts, so no secret stays on the run's disk.
(Not tmux's `-e`/set-environment: those put the value on the tmux client's argv, which `ps` shows to every
user of the container, and keep it in the session's environment for every later pane.)"""
VLLM_PYTHON_ENV = "DFLASH_VLLM_PYTHON"
"""The run's vLLM interpreter for the end-of-training evaluation in vLLM: trainer.vllm_eval.VLLM_PYTHON_ENV (the
agent imports no trainer module but trainer.faults; a test holds the two names equal)."""
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
    its gpus, and DFLASHCTL_RESUME_DIR=<old run dir> when resuming. A dflash run whose config asks for the
    vLLM evaluation (evaluation.engine: vllm) gets DFLASH_VLLM_PYTHON, the vLLM interpreter (`vllm_python`: the
    data venv's), and is refused here, before training, when there is none.

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
        cfg = config if config is not None else req.config or {}
        if req.data_only and not needs_data_stage(cfg):
            raise AgentFailure("NothingToRegenerate", f"experiment {req.experiment} has no data stage: its config does "
                               "not regenerate (data.regenerate is false, or no data.train_files: the tiny target's "
                               "own data comes regenerated)",
                               fix=f"dflashctl launch {req.experiment}   (without --data-only)")
        if req.data_only or needs_data_stage(cfg):
            stage = data_stage_argv(req, run_dir)
            # The stage first, in the same session and log; training only once it exited 0 (data_then_train).
            argv = stage if req.data_only else [sys.executable, "-m", "orchestrator.agent.datastage",
                                               str(len(stage)), *stage, *argv]
        if gpus:
            extra["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the layout's indices are nvidia-smi's
        else:
            extra["CUDA_VISIBLE_DEVICES"] = ""  # the colocated CPU layout sees no GPU
        cache = (cfg.get("compile") or {}).get("cache_dir")
        if cache:
            extra["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
        if judged_in_vllm(req, cfg):
            extra[VLLM_PYTHON_ENV] = vllm_python(req)
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


def judged_in_vllm(req: LaunchRequest, config: dict) -> bool:
    """Whether the run's export is judged in vLLM after training (evaluation.engine: vllm; not --data-only)."""
    return req.kind == "dflash" and (config.get("evaluation") or {}).get("engine") == "vllm" and not req.data_only


def vllm_python(req: LaunchRequest) -> str:
    """The interpreter that judges a run's export in vLLM after training (evaluation.engine: vllm): the data
    venv's (`data_python`), which holds vLLM; the training venv's own only when it has vLLM itself.

    Raises:
        AgentFailure("VenvMismatch"): the data venv is not built (the fix builds it), or the experiment names no
            data venv and the training venv has no vLLM.
    """
    import importlib.util

    profile = req.data_venv_profile or {}
    python = data_python(req)
    where = f" --target {req.target}" if req.target else ""
    if profile.get("kind") == "uv":
        if not Path(python).is_file():
            fix = f"dflashctl rebuild-venv{where} --profile {profile['name']}"
            raise AgentFailure("VenvMismatch", f"experiment {req.experiment}: evaluation.engine is vllm, and its vLLM "
                               f"venv (data_venv {profile['name']!r}) is not built: no {python}", fix=fix,
                               data={"data_venv": profile["name"]})
    elif profile.get("kind") != "system" and importlib.util.find_spec("vllm") is None:
        raise AgentFailure("VenvMismatch", f"experiment {req.experiment}: evaluation.engine is vllm, but it names no "
                           f"data_venv and this venv ({sys.executable}) has no vLLM (vLLM pins its own torch: it lives "
                           "in a venv of its own)",
                           fix=f"add `data_venv: vllm` to experiment {req.experiment} in the inventory, then run "
                               f"`dflashctl rebuild-venv{where} --profile vllm`; or set evaluation.engine: own")
    return python


def needs_data_stage(config: dict) -> bool:
    """Whether a dflash run's config regenerates its training data (the data stage runs before training): its
    data section regenerates and lists the files (the tiny target's own data comes regenerated already)."""
    data = config.get("data") or {}
    return bool(data.get("regenerate", True) and data.get("train_files"))


def data_venv_workdir(workdir: str, profile_name: str) -> str:
    """The workdir rebuild-venv builds a data-stage venv profile in (its `venvs/current` is the data venv)."""
    return str(Path(workdir) / DATA_VENVS / profile_name)


def data_python(req: LaunchRequest) -> str:
    """The interpreter of the data stage: the data venv's (a uv profile), the target's python3 (system), or
    the training venv's own (no data venv, or the workstation's interpreter)."""
    profile = req.data_venv_profile or {}
    kind = profile.get("kind")
    if kind == "uv":
        return str(Path(data_venv_workdir(req.workdir, profile["name"])) / "venvs" / "current" / "bin" / "python")
    if kind == "system":
        return "python3"
    return sys.executable


def data_stage_argv(req: LaunchRequest, run_dir: Path) -> list[str]:
    """`<data python> -m trainer regenerate <run>/config.json --run-dir <run>`: the data stage of the run (its
    datasets root is the target's, <workdir>/datasets, by trainer.store.datasets_root of the run directory)."""
    return [data_python(req), "-m", "trainer", "regenerate", str(run_dir / "config.json"), "--run-dir", str(run_dir)]


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
