"""`runs` and `runs diff` (orchestrator.ops.runs) over the workstation's records, and the CLI verbs end to end on
the embedded-style local target. The records file itself: tests/orchestrator/test_records.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator import records
from orchestrator.ops.runs import diff


# Own tmux server and run records per test (conftest.py).
pytestmark = pytest.mark.usefixtures("isolated_tmux")


def rec(run_id: str, **kw) -> dict:
    base = {"run_id": run_id, "experiment": "exp", "target": "ct200", "bundle_hash": "b1",
            "config": {"model": {"block_size": 16}, "data": {"token_budget": 49152}, "gamma": 7.0},
            "gpus": [5, 6], "gpus_seen": [{"index": 5, "total_mib": 81559}, {"index": 6, "total_mib": 81559}],
            "env_fingerprint": {"python": "3.11.9", "torch": "2.9.0", "driver": "570.1",
                                "packages": {"transformers": "5.6.0", "torch": "2.9.0"}}}
    base.update(kw)
    return base


def test_diff_names_packages_config_keys_bundle_and_driver():
    records.append_record(rec("good-1"))
    fp = {"python": "3.11.9", "torch": "2.9.0", "driver": "575.2",
          "packages": {"transformers": "5.8.1", "torch": "2.9.0", "accelerate": "1.2.0"}}
    records.append_record(rec("bad-1", bundle_hash="b2", env_fingerprint=fp,
                              config={"model": {"block_size": 16}, "data": {"token_budget": 32768}, "gamma": 7.0}))
    d = diff("good-1", "bad-1")
    assert not d.same
    assert d.packages == [("accelerate", None, "1.2.0"), ("transformers", "5.6.0", "5.8.1")]
    assert d.config == [("data.token_budget", 49152, 32768)]
    assert d.bundle == ("b1", "b2")
    assert d.environment == [("driver", "570.1", "575.2")]
    assert diff("good-1", "good-1").same


# ------------------------------------------------------------------------------------------- the CLI


def cli(*args: str, inv: Path) -> subprocess.CompletedProcess:
    code = "import sys; from orchestrator.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "-i", str(inv), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_cli_launch_status_runs_diff_stop(tmp_path):
    work = tmp_path / "work"
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"""
targets:
  local: {{kind: local, workdir: {work}, venv: workstation}}
venvs:
  workstation: {{kind: workstation}}
experiments:
  quick:
    kind: command
    target: local
    command: [bash, -c, 'echo "{{\\"step\\": 1, \\"tokens_per_s\\": 1234.5}}" >> "$DFLASHCTL_RUN_DIR/metrics.jsonl"; echo trained']
  slow:
    kind: command
    target: local
    command: [sleep, "60"]
    env: {{SEED: "1"}}
""")
    r = cli("launch", "quick", "--tag", "a", "--json", inv=inv)
    assert r.returncode == 0, r.stderr
    a = json.loads(r.stdout)
    r = cli("launch", "quick", "--tag", "b", "--follow", inv=inv)
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stdout
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = json.loads(cli("status", "--json", inv=inv).stdout)
        if all(x["state"] != "running" for x in st["runs"]):
            break
        time.sleep(0.2)
    assert [x["state"] for x in st["runs"]] == ["succeeded", "succeeded"] and st["runs"][0]["tokens_per_s"] == 1234.5
    recs = json.loads(cli("runs", "--json", inv=inv).stdout)
    assert [x["run_id"] for x in recs][0] == a["run_id"] and len(recs) == 2
    d = json.loads(cli("runs", "diff", recs[0]["run_id"], recs[1]["run_id"], "--json", inv=inv).stdout)
    assert d["same"] is True

    r = cli("launch", "slow", inv=inv)
    assert r.returncode == 0, r.stderr
    r = cli("launch", "slow", inv=inv)
    assert r.returncode == 1 and "refused" in r.stderr and "--replace" in r.stderr
    r = cli("launch", "slow", "--tag", "../x", inv=inv)
    assert r.returncode == 1 and "bad tag name" in r.stderr
    r = cli("stop", "slow", "--grace", "1", inv=inv)
    assert r.returncode == 0 and "stopped with SIGINT" in r.stdout, r.stdout + r.stderr


def test_diff_shows_the_dataset_key_and_the_inputs_that_differ_from_the_records_dataset_events():
    """A dataset event folds into its run's record; the diff names the key and each key input that differs
    (not the ones alike); the same key is no difference; a run without a known dataset shows the key alone."""
    ki = {"inputs": ["aa"], "max_new_tokens": 8, "target": {"weights": {"model.safetensors": "w1"}}, "engine": "vllm"}
    for run_id in ("d-1", "d-2", "d-3", "d-4"):
        records.append_record(rec(run_id))
    records.record_dataset("d-1", {"key": "k1", "path": "/w/datasets/regen-k1", "key_inputs": ki})
    records.record_dataset("d-2", {"key": "k2", "path": "/w/datasets/regen-k2",
                                   "key_inputs": {**ki, "max_new_tokens": 16, "target": {"weights": {"model.safetensors": "w2"}}}})
    records.record_dataset("d-3", {"key": "k1", "path": "/w/datasets/regen-k1", "key_inputs": ki})
    assert records.find_record("d-1")["dataset"]["key"] == "k1"
    d = diff("d-1", "d-2")
    assert d.dataset == [("key", "k1", "k2"), ("max_new_tokens", 8, 16), ("target.weights.model.safetensors", "w1", "w2")]
    assert not d.same and d.to_dict()["dataset"][0] == ["key", "k1", "k2"]
    assert diff("d-1", "d-3").same
    assert diff("d-1", "d-4").dataset == [("key", "k1", None)]
