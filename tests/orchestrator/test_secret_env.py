"""An environment value marked secret in the inventory reaches the run and nothing else: not the workstation's
records (the state dir), not the run directory's files (launch.env0, run.json, train.log), not the dry-run plan."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from orchestrator.errors import UserError
from orchestrator.inventory import parse_inventory, resolve_env

SECRET = "hf_s3cr3t-V4lue-0123456789"


def write_inventory(tmp_path: Path) -> Path:
    # The command proves it got the value by writing its sha256 (the value itself never reaches an argv).
    prove = ("import hashlib, os, pathlib; pathlib.Path(os.environ['DFLASHCTL_RUN_DIR'], 'got').write_text("
             "hashlib.sha256(os.environ['HF_TOKEN'].encode()).hexdigest() + os.environ['PLAIN'])")
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        f"targets:\n  local: {{kind: local, workdir: {tmp_path / 'work'}}}\n"
        "experiments:\n"
        f"  cmd:\n    kind: command\n    target: local\n    command: [{sys.executable!r}, -c, {json.dumps(prove)}]\n"
        "    env: {HF_TOKEN: {secret: true}, PLAIN: shown}\n")
    return inv


def files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_secret_env_value_reaches_the_run_and_no_file_or_plan(tmp_path, dflashctl):
    """launch --follow through the installed script with HF_TOKEN marked secret and set in the workstation's
    environment: the command sees it; after the run no file under the state dir or the workdir holds it (the
    secret file start_training.sh reads is gone), the record shows `<secret>`, and --dry-run never prints it."""
    inv = write_inventory(tmp_path)
    state = tmp_path / "state"
    env = dict(os.environ, HF_TOKEN=SECRET, DFLASHCTL_STATE_DIR=str(state))
    plan = dflashctl("--inventory", str(inv), "launch", "cmd", "--dry-run", "--json", env=env)
    assert plan.returncode == 0, plan.stderr
    assert SECRET not in plan.stdout + plan.stderr
    human = dflashctl("--inventory", str(inv), "launch", "cmd", "--dry-run", env=env)
    assert human.returncode == 0 and SECRET not in human.stdout + human.stderr

    res = dflashctl("--inventory", str(inv), "launch", "cmd", "--follow", env=env, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert SECRET not in res.stdout + res.stderr
    run_dirs = list((tmp_path / "work" / "runs").iterdir())
    assert len(run_dirs) == 1
    got = (run_dirs[0] / "got").read_text()
    assert got == hashlib.sha256(SECRET.encode()).hexdigest() + "shown"
    assert not (run_dirs[0] / "launch.secret0").exists()
    assert files_holding(tmp_path / "work", SECRET.encode()) == []
    assert files_holding(state, SECRET.encode()) == []
    records = [json.loads(line) for line in (state / "runs.jsonl").read_text().splitlines()]
    assert records[-1]["config"]["env"] == {"HF_TOKEN": "<secret>", "PLAIN": "shown"}
    # The plain value is where it always was (the check above would pass if nothing were written at all).
    assert b"PLAIN=shown" in (run_dirs[0] / "launch.env0").read_bytes()


def test_a_secret_missing_from_the_workstation_is_refused_naming_it(monkeypatch):
    """A secret whose variable is not set here: one error naming the key and the export that fixes it."""
    inv = parse_inventory("targets:\n  local: {kind: local}\nexperiments:\n  c: {kind: command, target: local, "
                          "command: [x], env: {TOK: {secret: true, from_env: MY_TOK}}}\n")
    monkeypatch.delenv("MY_TOK", raising=False)
    with pytest.raises(UserError) as info:
        resolve_env(inv.experiments["c"].env, "experiments.c")
    assert "experiments.c.env.TOK is secret" in info.value.message and "$MY_TOK is not set" in info.value.message
    assert info.value.fix == "export MY_TOK=... in this shell, then launch again"
    monkeypatch.setenv("MY_TOK", "v")
    assert resolve_env(inv.experiments["c"].env, "experiments.c") == ({"TOK": "v"}, ["TOK"])
