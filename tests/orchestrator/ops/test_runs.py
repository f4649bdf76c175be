"""Workstation run records (append-only runs.jsonl), `runs diff`, the attach argv builders, and the CLI
verbs end to end on the embedded-style local target."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator import records
from orchestrator.errors import RunNotFound
from orchestrator.target import ContainerTarget, tmux_attach_argv
from orchestrator.transport.pct import PctTransport
from orchestrator.transport.ssh import SSHTransport
from orchestrator.ops.runs import diff, list_runs


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


def test_records_append_and_survive_a_torn_line(tmp_path):
    records.append_record(rec("a-1"))
    with open(records.records_path(), "a") as fh:
        fh.write('{"run_id": "torn", "experi')  # a crash in the middle of a write
    records.append_record(rec("a-2", experiment="other"))
    assert [r["run_id"] for r in list_runs()] == ["a-1", "a-2"]
    assert [r["run_id"] for r in list_runs("other")] == ["a-2"]
    assert records.records_path() == tmp_path / "state" / "runs.jsonl"


def test_concurrent_appends_never_interleave():
    big = {"blob": "x" * 200_000}

    def writer(n: int) -> None:
        for i in range(10):
            records.append_record(rec(f"w{n}-{i}", config=big))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    lines = records.records_path().read_text().splitlines()
    assert len(lines) == 40 and all(json.loads(line)["config"] == big for line in lines)


def test_find_record_by_id_prefix_or_experiment():
    records.append_record(rec("exp-20260101T000000Z"))
    records.append_record(rec("exp-20260102T000000Z"))
    assert records.find_record("exp")["run_id"] == "exp-20260102T000000Z"  # experiment: newest
    assert records.find_record("exp-20260101")["run_id"] == "exp-20260101T000000Z"
    with pytest.raises(RunNotFound, match="matches 2 runs"):
        records.find_record("exp-2026")
    with pytest.raises(RunNotFound, match="no run 'zzz'"):
        records.find_record("zzz")


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


def test_flatten_dotted_paths():
    assert records.flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": {}}) == {"a.b.c": 1, "a.d": [1, 2], "e": {}}


# ------------------------------------------------------------------------------------------- attach


def test_attach_argv_local_and_container_golden():
    assert tmux_attach_argv("dflash-x") == ["tmux", "attach-session", "-t", "=dflash-x"]
    assert tmux_attach_argv("dflash-x", read_only=True) == ["tmux", "attach-session", "-r", "-t", "=dflash-x"]
    ssh = SSHTransport("pve1.lan", port=2222, user="root", identity_file="/k/id", known_hosts="/k/kh")
    ct = ContainerTarget(name="ct", workdir="/w", transport=PctTransport(ssh, 200))
    ct.env = lambda: {"HOME": "/root", "PATH": "/usr/bin:/bin"}  # the golden line below, short
    argv = ct.attach_argv("dflash-exp", read_only=True)  # builds the argv; connects to nothing
    assert argv[:-1] == ["ssh", "-t", "-p", "2222", "-i", "/k/id", "-o", "IdentitiesOnly=yes",
                         "-o", "UserKnownHostsFile=/k/kh", "-o", "StrictHostKeyChecking=yes", "root@pve1.lan"]
    term = argv[-1].split("TERM=", 1)[1].split()[0]
    assert argv[-1] == (f"pct exec 200 --keep-env 0 -- env -i HOME=/root PATH=/usr/bin:/bin TERM={term} "
                        "tmux attach-session -r -t =dflash-exp")


def test_ssh_argv_quotes_the_remote_command_once():
    from orchestrator.transport.ssh import openssh_argv

    argv = openssh_argv("pve1", ["pct", "exec", "200", "--", "echo", "a b", "$(id)"], tty=True)
    assert argv == ["ssh", "-t", "pve1", "pct exec 200 -- echo 'a b' '$(id)'"]
    assert subprocess.run(["sh", "-c", "printf '%s\\n' " + argv[-1].split(" -- ", 1)[1]],
                          capture_output=True, text=True).stdout == "echo\na b\n$(id)\n"


def test_attach_builds_the_argv_from_a_container_target(fake_pve):
    t = ContainerTarget(name="ct", workdir="/w", transport=fake_pve.pct_transport(200))
    argv = t.attach_argv("dflash-e")
    assert argv[-2] == f"{fake_pve.user}@{fake_pve.hostname}" and "StrictHostKeyChecking=yes" in argv
    assert f"UserKnownHostsFile={fake_pve.known_hosts}" in argv and argv[-1].startswith("pct exec 200 --keep-env 0 -- env -i HOME=/root")


# ------------------------------------------------------------------------------------------- the CLI


def cli(*args: str, inv: Path) -> subprocess.CompletedProcess:
    code = "import sys; from orchestrator.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "-i", str(inv), *args], capture_output=True, text=True,
                          timeout=120)


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
