"""A layout across two nodes, for real: two `python -m trainer.launch --node I` agents (torch's elastic
launcher, c10d rendezvous on node 0) on this machine, node 0 with the target rank and node 1 with two drafter
ranks, each node with its own run directory as two containers would have. Losses equal the single-process
reference at the same global batches; a node killed mid-run ends the other one, whose root cause names the
lost node and rank. (tests/orchestrator/ops/test_nodes.py runs the same through dflashctl on two containers.)"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.test_trainer_launch import LOSS_RTOL, REPO, env, reference, small_config, write  # noqa: F401
from trainer.metrics import read_metrics

pytestmark = pytest.mark.slow  # runs real processes: `-m "not slow"` leaves it out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_node_layout(port: int) -> dict:
    return {"nodes": [{"num_target_procs": 1, "name": "ct200", "addr": "127.0.0.1"},
                      {"num_drafter_procs": 2, "name": "ct201", "addr": "127.0.0.2"}],
            "rendezvous": f"127.0.0.1:{port}"}


def start_nodes(tmp_path: Path, env: dict, **top) -> tuple[list[Path], list[subprocess.Popen]]:
    """Both nodes' agents, each with its own config (the same but for output_dir) and run directory, each in
    its own session, output in <node>/out.log."""
    port = free_port()
    dirs, procs = [], []
    for i in range(2):
        run = tmp_path / f"node{i}" / "run"
        cfg = write(tmp_path / f"node{i}.json", small_config(run, two_node_layout(port), **top))
        run.mkdir(parents=True)
        with open(tmp_path / f"node{i}" / "out.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "trainer.launch", "--config", str(cfg), "--node", str(i)],
                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        dirs.append(run)
    return dirs, procs


def output(run: Path) -> str:
    return (run.parent / "out.log").read_text(errors="replace")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (torch's agent starts its ranks in sessions of their own)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    children: dict[int, list[int]] = {}
    for child, parent in zip(map(int, out[::2]), map(int, out[1::2])):
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a node's agent and all its ranks at once, as `pct stop` ends every process of a container."""
    for pid in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every agent; on a timeout kill every node's processes before failing."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_node(p)


def test_two_nodes_match_the_single_process_run(tmp_path, env, reference_memo):
    # The same reference as test_trainer_launch.py's split run: made once per session.
    ref = reference(small_config(tmp_path / "ref"), env, reference_memo)
    dirs, procs = start_nodes(tmp_path, env)
    wait_all(procs, 300)
    outs = [output(d) for d in dirs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "[launch] 1 of 3 rank(s) on node 0 of 2" in outs[0] and "[launch] 2 of 3 rank(s) on node 1 of 2" in outs[1]
    assert "[launch] local rank 1: rank 2 (drafter) on the CPU" in outs[1]
    assert re.search(r"^\[node 0 local rank 0\] target rank 0: sent every batch", outs[0], re.M), outs[0][-3000:]
    assert re.search(r"^\[node 1 local rank 0\] step 6/6 loss", outs[1], re.M), outs[1][-3000:]
    # Whole lines only: a progress bar's line without its newline glued the next rank line onto it.
    assert "Loading weights" not in outs[1] and all(line.count("[node ") <= 1 for line in outs[1].splitlines())
    got = [r for r in read_metrics(dirs[1] / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 7))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
        assert b["tokens"] == a["tokens"]
    assert [(m["rank"], m["role"]) for m in got[-1]["memory"]] == [(0, "target"), (1, "drafter"), (2, "drafter")]


def test_a_lost_node_ends_the_other_and_is_named_as_the_cause(tmp_path, env):
    dirs, procs = start_nodes(tmp_path, env, max_steps=40, epochs=12, save_every=2)
    deadline = time.monotonic() + 240
    while "[ckpt] step 2" not in output(dirs[1]):  # node 1 runs the main drafter rank: its first checkpoint
        assert time.monotonic() < deadline and procs[1].poll() is None, output(dirs[1])[-3000:]
        time.sleep(0.5)
    assert procs[0].poll() is None, output(dirs[0])[-3000:]
    kill_node(procs[1])
    t0 = time.monotonic()
    wait_all(procs, 90)
    elapsed = time.monotonic() - t0
    out = output(dirs[0])
    assert procs[0].returncode != 0 and elapsed < 60, (procs[0].returncode, elapsed, out[-3000:])
    doc = json.loads((dirs[0] / "root_cause.json").read_text())
    assert "lost" in doc, (doc, out[-3000:])
    assert doc["lost"]["node"] == 1 and doc["lost"]["node_name"] == "ct201" and doc["lost"]["rank"] in (1, 2)
    assert doc["summary"].startswith(f"lost rank {doc['lost']['rank']} (drafter, node 1 (ct201), local rank ")
    assert (doc["rank"], doc["node"], doc["peer_lost"]) == (0, 0, True)
    assert "[launch] run failed: lost rank" in out
