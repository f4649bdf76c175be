"""A run to be judged in vLLM after training (evaluation.engine: vllm) gets the vLLM interpreter, the data
venv's python, as DFLASH_VLLM_PYTHON in its environment, and is refused before anything starts while there is
none, with a fix that builds it when pasted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import LaunchRequest
from orchestrator.agent.runcommand import VLLM_PYTHON_ENV, build_command, data_venv_workdir

VLLM = {"evaluation": {"engine": "vllm"}}
PROFILE = {"name": "vllm", "kind": "uv", "lock": "vllm"}


def _req(workdir, **kw) -> LaunchRequest:
    return LaunchRequest(experiment="e", run_id="e-1", kind="dflash", workdir=str(workdir), target="local", **kw)


def test_the_trainer_reads_the_variable_the_agent_sets():
    from trainer.vllm_eval import VLLM_PYTHON_ENV as trainer_side

    assert VLLM_PYTHON_ENV == trainer_side == "DFLASH_VLLM_PYTHON"


def test_a_vllm_run_gets_the_data_venvs_python_and_an_own_engine_run_nothing(tmp_path):
    python = Path(data_venv_workdir(str(tmp_path), "vllm")) / "venvs" / "current" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    _, env = build_command(_req(tmp_path, config=VLLM, data_venv_profile=PROFILE), [], tmp_path / "runs" / "r")
    assert env[VLLM_PYTHON_ENV] == str(python)
    _, env = build_command(_req(tmp_path, config={"evaluation": {"engine": "own"}}, data_venv_profile=PROFILE), [],
                           tmp_path / "runs" / "r")
    assert VLLM_PYTHON_ENV not in env


def test_a_vllm_run_without_a_vllm_interpreter_is_refused_with_the_fix(tmp_path):
    with pytest.raises(AgentFailure) as err:
        build_command(_req(tmp_path, config=VLLM, data_venv_profile=PROFILE), [], tmp_path / "runs" / "r")
    assert err.value.type == "VenvMismatch" and "evaluation.engine is vllm" in err.value.message
    assert err.value.fix == "dflashctl rebuild-venv --target local --profile vllm"
    if importlib.util.find_spec("vllm") is None:  # this venv has no vLLM: no data venv named is refused too
        with pytest.raises(AgentFailure) as err:
            build_command(_req(tmp_path, config=VLLM), [], tmp_path / "runs" / "r")
        assert "names no data_venv" in err.value.message and "add `data_venv: vllm`" in err.value.fix


SHARED_CACHE = os.environ.get("DFLASHCTL_TEST_UV_CACHE", "/var/tmp/dflashctl-test-uv-cache")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a real uv build on a shared 2-core machine
def test_the_printed_fix_pasted_into_bash_builds_the_venv_and_the_launch_then_passes(tmp_path, dflashctl):
    """`dflashctl launch --dry-run` of an experiment with evaluation.engine: vllm whose data venv is not built
    is refused before anything starts; its printed fix, pasted into bash, builds it (here from the cpu lock, as the
    profile says: the venv is held to its profile's lock, and vLLM's own lock takes 3.5 GB), and the launch then
    passes."""
    from trainer.config import parse_config

    work = tmp_path / "work"
    inv = tmp_path / "inventory.yaml"
    trainer = parse_config({"max_steps": 2, "evaluation": {"engine": "vllm"}}).model_dump(mode="json")
    trainer.pop("output_dir")
    inv.write_text(json.dumps({
        "targets": {"local": {"kind": "local", "workdir": str(work), "venv": "workstation"}},
        "venvs": {"judge": {"kind": "uv", "lock": "cpu", "python": "3.11", "wheelhouse": ["/opt/wheels"],
                            "uv_cache_dir": SHARED_CACHE, "keep": 1}},
        "experiments": {"vj": {"kind": "dflash", "target": "local", "data_venv": "judge", "trainer": trainer}},
    }))
    env = {**os.environ, "DFLASHCTL_INVENTORY": str(inv)}
    res = dflashctl("launch", "vj", "--dry-run", env=env)
    assert res.returncode != 0, res.stdout
    assert "evaluation.engine is vllm, and its vLLM venv (data_venv 'judge') is not built" in res.stderr, res.stderr
    cmd = next(line for line in res.stderr.splitlines() if line.startswith("fix: ")).removeprefix("fix: ").strip()
    assert cmd == "dflashctl rebuild-venv --target local --profile judge", res.stderr
    assert not (work / "runs").exists()
    built = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=900)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    ok = dflashctl("launch", "vj", "--dry-run", env=env)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_vllm_judged_run_whose_vllm_venv_was_built_from_another_lock_is_refused(tmp_path, dflashctl):
    """A run with no data stage, judged in vLLM after training: its vLLM venv (the data venv) is held to its lock
    as a data stage's is. One built from another lock (its fingerprint says so) is refused before anything
    starts, the refusal names that venv and both locks, and its fix rebuilds that profile, not the training
    venv."""
    from trainer.config import parse_config

    work = tmp_path / "work"
    current = Path(data_venv_workdir(str(work), "judge")) / "venvs" / "current"
    (current / "bin").mkdir(parents=True)
    (current / "bin" / "python").write_text("#!/bin/sh\n")
    (current / "dflashctl-fingerprint.json").write_text(json.dumps({"kind": "uv", "venv": "v1", "lock_hash": "0ld10ck"}))
    trainer = parse_config({"max_steps": 2, "evaluation": {"engine": "vllm"}}).model_dump(mode="json")
    trainer.pop("output_dir")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(json.dumps({
        "targets": {"local": {"kind": "local", "workdir": str(work), "venv": "workstation"}},
        "venvs": {"judge": {"kind": "uv", "lock": "cpu", "python": "3.11", "keep": 1}},
        "experiments": {"vj": {"kind": "dflash", "target": "local", "data_venv": "judge", "trainer": trainer}},
    }))
    res = dflashctl("launch", "vj", "--dry-run", env={**os.environ, "DFLASHCTL_INVENTORY": str(inv)})
    assert res.returncode != 0, res.stdout
    assert "the vLLM venv that judges the export (profile 'judge'" in res.stderr, res.stderr
    assert "was built from lock 0ld10ck" in res.stderr, res.stderr
    fixes = [line for line in res.stderr.splitlines() if line.startswith("fix: ")]
    assert fixes == ["fix: dflashctl rebuild-venv --target local --profile judge"], res.stderr
    assert not (work / "runs").exists()
