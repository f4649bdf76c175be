"""trainer.launch for real (torch's elastic launcher underneath): 1 target + 2 drafter processes on gloo
against the single-process reference, checkpoints across layouts, the root cause of a rank that raises or is
killed, restarts, a stop, and --resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
# Split and single-process runs see the same global batches, anchors and features; the remaining difference
# is the order of float sums (DDP's pre-divided all-reduce vs summed micro-batch gradients).
LOSS_RTOL = 1e-5


def small_config(out: Path, layout: dict | None = None, **top) -> dict:
    """The tiny experiment shrunk for tests: 36 short samples, 1 draft layer, 4 rows x 64 tokens."""
    from trainer.tiny import tiny_train_config

    raw = dict(
        max_steps=6,
        log_every=1,
        epochs=2,
        model={
            "target": "tiny",
            "block_size": 8,
            "num_draft_layers": 1,
            "num_target_features": 3,
            "tiny_target": {"num_prompts": 40, "held_out": 4, "response_tokens": 24},
        },
        data={"max_len": 64, "token_budget": 256, "max_batch_size": 4, "num_anchors": 8},
        # τ of the chain and one DDTree budget, greedy: the loop's evaluation hook, at the cost of a test
        evaluation={"budgets": [4], "temperatures": [0.0]},
        layout=layout or {},
    )
    raw.update(top)
    return tiny_train_config(out, **raw).model_dump(mode="json")


def write(path: Path, cfg: dict) -> Path:
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def env(tiny_cache):
    # The session's tiny cache: building the assets is not what these tests check (tests/trainer/test_tiny_run.py
    # and the concurrent-builder tests do), and test_two_nodes.py asks for the same tiny target.
    return dict(os.environ, DFLASH_TINY_CACHE=str(tiny_cache), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def launch(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.launch", *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def reference(cfg: dict, env: dict, memo: dict | None = None, batches_per_step: int = 2) -> list[dict]:
    """The single-process run at the same global batch: the colocated loop accumulating `batches_per_step`
    batches per step, in a fresh process (same thread settings as a rank).

    With `memo` (the session's `reference_memo`), a run whose config differs only in output_dir from one
    already made is not made again: its train records are returned (a copy)."""
    cfg = json.loads(json.dumps(cfg))
    cfg["data"]["batches_per_step"] = batches_per_step
    key = json.dumps({k: v for k, v in cfg.items() if k != "output_dir"}, sort_keys=True)
    if memo is not None and key in memo:
        return json.loads(memo[key])
    path = Path(cfg["output_dir"]).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    code = "import sys, torch; torch.set_num_threads(1)\nfrom trainer.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = subprocess.run([sys.executable, "-c", code, "train", "--config", str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [r for r in read_metrics(Path(cfg["output_dir"]) / "metrics.jsonl") if r["kind"] == "train"]
    if memo is not None:
        memo[key] = json.dumps(records)
    return records


SPLIT = {"num_target_procs": 1, "num_drafter_procs": 2}


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_one_target_two_drafters_match_the_single_process_run(tmp_path, env, reference_memo):
    ref = reference(small_config(tmp_path / "ref"), env, reference_memo)
    cfg_path = write(tmp_path / "split.json", small_config(tmp_path / "split", SPLIT))
    proc = launch(["--config", str(cfg_path)], env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "[rank 0] target rank 0: sent every batch" in out
    assert re.search(r"^\[rank 1\] step 6/6 loss", out, re.M)
    assert not re.search(r"^\[rank [02]\] step \d", out, re.M), "only the main drafter rank logs steps"

    got = [r for r in read_metrics(tmp_path / "split" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, 7))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
        assert b["sim_tau"] == pytest.approx(a["sim_tau"], rel=LOSS_RTOL)
        assert b["tokens"] == a["tokens"]
    assert got[-1]["loss"] < got[0]["loss"]
    last = got[-1]
    assert [(m["rank"], m["role"]) for m in last["memory"]] == [(0, "target"), (1, "drafter"), (2, "drafter")]
    assert all(m["peak_mb"] > 50 and m["alloc_mb"] > 50 for m in last["memory"])
    assert last["tokens_per_s"] > 0 and last["target_tokens_per_s"] > 0 and last["drafter_tokens_per_s"] > 0
    assert last["recompiles"] == 0
    final = [r for r in read_metrics(tmp_path / "split" / "metrics.jsonl") if r["kind"] == "final"]
    assert len(final) == 1 and final[0]["step"] == 6
    # The main drafter rank (which holds only the target's head parts) measured τ on the whole target,
    # every configured mode, before training and on the export after it.
    evals = [r for r in read_metrics(tmp_path / "split" / "metrics.jsonl") if r["kind"] == "eval"]
    assert [(r["step"], r["when"]) for r in evals] == [(0, "before"), (6, "after")]
    assert all({"tau", "tau_chain", "tau_tree4"} <= set(r) for r in evals)
    after = json.loads((tmp_path / "split" / "eval_after.json").read_text())
    assert final[0]["tau_after"] == after["tau"] and {r["budget"] for r in after["results"]} == {None, 4}
    assert (tmp_path / "split" / "export" / "model.safetensors").exists()
    assert (tmp_path / "split" / "checkpoints" / "step_00000006" / "meta.json").exists()
    # The balance advice from this real split run: its facts record says 1 target + 2 drafter ranks, and the
    # advice's per-GPU rates are the medians of the measured side rates divided by those counts.
    from statistics import median

    from orchestrator.ops.metrics import run_notes

    rows = read_metrics(tmp_path / "split" / "metrics.jsonl")
    facts = [r for r in rows if r["kind"] == "facts"]
    assert len(facts) == 1 and (facts[0]["target_ranks"], facts[0]["drafter_ranks"]) == (1, 2)
    notes = run_notes(rows)
    t = median(r["target_tokens_per_s"] for r in got)
    d = median(r["drafter_tokens_per_s"] for r in got) / 2
    assert notes[0].startswith("balance: ") and f"a target rank computes {t:.0f} tokens/s" in notes[1], notes
    assert f"now 1 target + 2 drafter: min(1 x {t:.0f}, 2 x {d:.0f})" in notes[2], notes


def _as_if_killed_after(run_dir: Path, step: int) -> None:
    """Leave the run as a kill right after the checkpoint of `step` would: newer checkpoints gone."""
    for p in (run_dir / "checkpoints").iterdir():
        if p.name.startswith("step_") and int(p.name[len("step_"):]) > step:
            shutil.rmtree(p)


@pytest.mark.parametrize("first, second", [("colocated", "split"), ("split", "colocated")])
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_checkpoint_resumes_under_the_other_layout_with_the_reference_loss(tmp_path, env, reference_memo, first, second):
    # Two batches per step in every layout: the colocated process accumulates both, two drafters one each.
    layouts = {"colocated": {}, "split": SPLIT}

    def config(name: str, layout: dict) -> dict:
        cfg = small_config(tmp_path / name, layout, save_every=3, keep_checkpoints=3)
        cfg["data"]["batches_per_step"] = 2
        return cfg

    ref = reference(small_config(tmp_path / "ref"), env, reference_memo)
    proc = launch(["--config", str(write(tmp_path / "first.json", config("first", layouts[first])))], env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "first", run_dir)
    _as_if_killed_after(run_dir, 3)

    cfg_path = write(tmp_path / "second.json", config("unused", layouts[second]))
    proc = launch(["--resume", str(run_dir), "--config", str(cfg_path)], env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"^\[rank [01]\] resumed from step 3$", proc.stdout, re.M), proc.stdout[-3000:]
    got = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(1, 7)), "a resumed run neither repeats nor skips a step"
    assert [len(r["memory"]) for r in got[3:]] == [3 if second == "split" else 1] * 3  # really the other layout
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_checkpoint_of_another_batch_count_is_refused_with_the_setting_to_use(tmp_path, env):
    cfg = small_config(tmp_path / "run", max_steps=2, save_every=1)
    proc = launch(["--config", str(write(tmp_path / "a.json", cfg))], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    _as_if_killed_after(tmp_path / "run", 1)
    split = write(tmp_path / "b.json", small_config(tmp_path / "unused", SPLIT, max_steps=2))
    proc = launch(["--resume", str(tmp_path / "run"), "--config", str(split)], env)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "was trained with 1 batch(es) per step, this config has 2" in proc.stdout + proc.stderr
    assert "set data.batches_per_step: 1" in proc.stdout + proc.stderr


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_rank_that_raises_is_the_root_cause_with_its_error_file_traceback(tmp_path, env):
    # flex_attention has no CPU backward: both drafter ranks raise in their first step while the target rank
    # waits to send; the target then fails only because its peers are gone (PeerLostError), or is stopped.
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, SPLIT)
    cfg["model"]["attention_backend"] = "flex"
    t0 = time.monotonic()
    proc = launch(["--config", str(write(tmp_path / "c.json", cfg))], env, timeout=180)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert time.monotonic() - t0 < 120
    out = proc.stdout
    named = re.search(r"^\[launch\] run failed: rank ([12]) \(drafter, node 0, local rank \1, pid (\d+)\) raised "
                      r"ValueError: attention_backend 'flex' has no CPU backward", out, re.M)
    assert named, out[-3000:]
    doc = json.loads((run_dir / "root_cause.json").read_text())
    assert (doc["rank"], doc["role"], doc["exception"]) == (int(named.group(1)), "drafter", "builtins.ValueError")
    assert doc["pid"] == int(named.group(2)) and doc["signal"] is None
    # The block shows the traceback from the rank's error file, line for line, after the cause.
    tb = doc["traceback"].rstrip("\n").splitlines()
    assert tb[0] == "Traceback (most recent call last):" and "dflash_loss" in doc["traceback"]
    block = out[out.index("[launch] run failed:"):].splitlines()
    assert block[1] == f"[launch] its traceback (error file {doc['error_file']}):"
    assert block[2 : 2 + len(tb)] == ["[launch]   " + line for line in tb]
    assert Path(doc["error_file"]).is_file() and str(run_dir / "ranks") in doc["error_file"]
    # Every other failure is listed, none of them as the cause.
    others = {o["rank"] for o in doc["others"]}
    assert doc["rank"] not in others and others <= {0, 1, 2}
    assert "[launch] root cause written to " + str(run_dir / "root_cause.json") in out


def _start(cfg_path: Path, env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer.launch", "--config", str(cfg_path), *extra],
                            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen, lines: list[str], stop: str, pids: dict[int, int]) -> None:
    """Read the launcher's output into `lines` until a line starts with `stop`; collect rank pids."""
    for line in proc.stdout:
        lines.append(line)
        m = re.match(r"\[rank (\d)\] (?:target|drafter) rank \d \(pid (\d+)\)", line)
        if m:
            pids[int(m.group(1))] = int(m.group(2))
        if line.startswith(stop):
            return


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_is_named_and_resume_continues_the_run(tmp_path, env):
    run_dir = tmp_path / "run"
    long = dict(max_steps=40, save_every=2, epochs=12)
    cfg_path = write(tmp_path / "c.json", small_config(run_dir, SPLIT, **long))
    proc = _start(cfg_path, env)
    lines: list[str] = []
    pids: dict[int, int] = {}
    _read_until(proc, lines, "[rank 1] [ckpt] step 4", pids)
    assert 2 in pids and proc.poll() is None, "".join(lines)[-3000:]
    os.kill(pids[2], signal.SIGKILL)
    t_kill = time.monotonic()
    rest = proc.stdout.read()
    code = proc.wait(timeout=90)
    elapsed = time.monotonic() - t_kill
    out = "".join(lines) + rest
    assert code == 1 and elapsed < 60, (code, elapsed, out[-3000:])
    assert f"[launch] run failed: rank 2 (drafter, node 0, local rank 2, pid {pids[2]}) was killed by SIGKILL" in out, out[-3000:]
    doc = json.loads((run_dir / "root_cause.json").read_text())
    assert (doc["rank"], doc["signal"], doc["exit_code"], doc["traceback"]) == (2, "SIGKILL", -9, None)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    # Resume from the newest complete checkpoint; the whole run must equal an uninterrupted one.
    done = launch(["--resume", str(run_dir), "--config", str(cfg_path)], env)
    assert done.returncode == 0, done.stdout[-4000:]
    assert re.search(r"^\[rank [12]\] resumed from step (\d+)", done.stdout, re.M)
    assert not (run_dir / "root_cause.json").exists(), "a cause of an earlier attempt stays behind"
    got = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(1, 41)), "a resumed run neither repeats nor skips a step"
    ref = reference(small_config(tmp_path / "ref", **long), env)
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])


@pytest.mark.slow
def test_max_restarts_restarts_every_rank_from_the_last_checkpoint(tmp_path, env):
    run_dir = tmp_path / "run"
    long = dict(max_steps=16, save_every=2, epochs=12, max_restarts=1)
    proc = _start(write(tmp_path / "c.json", small_config(run_dir, SPLIT, **long)), env)
    lines: list[str] = []
    pids: dict[int, int] = {}
    _read_until(proc, lines, "[rank 1] [ckpt] step 4", pids)
    assert 0 in pids and proc.poll() is None, "".join(lines)[-3000:]
    os.kill(pids[0], signal.SIGKILL)  # the target rank: the agent restarts all three
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=300) == 0, out[-4000:]
    assert re.search(r"^\[rank [12]\] resumed from step ([4-9]|1\d)$", out, re.M), out[-4000:]
    assert "[rank 0] restart 1 of 1: the elastic agent restarted every rank" in out
    assert "[launch] all ranks finished" in out and not (run_dir / "root_cause.json").exists()
    got = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(1, 17))
    ref = reference(small_config(tmp_path / "ref", **{k: v for k, v in long.items() if k != "max_restarts"}), env)
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])


def test_rank_environment():
    from trainer.launch import rank_environment
    from trainer.layout import Layout

    cpu = Layout(num_target_procs=1, num_drafter_procs=2)
    assert rank_environment(cpu, {}) == {"PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                                         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "DFLASH_NODE": "0",
                                         "OMP_NUM_THREADS": "1"}
    assert rank_environment(cpu, {}, node=1)["DFLASH_NODE"] == "1"  # the ranks' place in the layout
    assert "OMP_NUM_THREADS" not in rank_environment(cpu, {"OMP_NUM_THREADS": "4"})  # the user's stays
    gpu = rank_environment(Layout(target_gpus=[0], drafter_gpus=[1]), {})
    assert gpu["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and "OMP_NUM_THREADS" not in gpu and "CUDA_VISIBLE_DEVICES" not in gpu


def test_launch_config_one_agent_per_node_with_the_layouts_ranks(tmp_path):
    from torch.distributed.elastic.multiprocessing import Std

    from trainer.config import parse_config
    from trainer.launch import LaunchError, Node, launch_config, node_of

    cfg = parse_config(small_config(tmp_path / "r-1", SPLIT, max_restarts=2))
    lc = launch_config(cfg, cfg.layout.to_layout(), tmp_path / "r-1")
    assert (lc.min_nodes, lc.max_nodes, lc.nproc_per_node, lc.max_restarts) == (1, 1, 3, 2)
    assert (lc.rdzv_backend, lc.rdzv_endpoint, lc.local_addr, lc.run_id) == ("c10d", "127.0.0.1:0", "127.0.0.1", "r-1")
    assert lc.log_line_prefix_template == "[rank ${rank}] " and lc.logs_specs.root_log_dir == str(tmp_path / "r-1" / "ranks")
    assert lc.logs_specs._tee == Std.ALL
    assert "is_host" not in lc.rdzv_configs and node_of(cfg, 0) == Node()
    with pytest.raises(LaunchError, match="node 0 of 2, but the layout has 1 node"):
        launch_config(cfg, cfg.layout.to_layout(), tmp_path / "r-1", Node(0, 2, "10.0.0.1:29400"))
    two = parse_config(small_config(tmp_path / "r-2", {
        "nodes": [{"num_target_procs": 1, "name": "ct200"}, {"num_drafter_procs": 2, "name": "ct201", "addr": "10.0.0.201"}],
        "rendezvous": "10.0.0.200:29400"}))
    assert node_of(two, 0) == Node(0, 2, "10.0.0.200:29400", "10.0.0.200")
    assert node_of(two, 1) == Node(1, 2, "10.0.0.200:29400", "10.0.0.201")
    with pytest.raises(LaunchError, match=r"--node 2: the layout has 2 node\(s\), numbered 0..1"):
        node_of(two, 2)
    lc = launch_config(two, two.layout.to_layout(), tmp_path / "r-2", node_of(two, 1))
    assert (lc.min_nodes, lc.max_nodes, lc.nproc_per_node, lc.rdzv_endpoint, lc.local_addr) == (
        2, 2, 2, "10.0.0.200:29400", "10.0.0.201")
    assert lc.rdzv_configs["is_host"] is False and lc.log_line_prefix_template == "[node 1 local rank ${local_rank}] "
    assert launch_config(two, two.layout.to_layout(), tmp_path / "r-2", node_of(two, 0)).rdzv_configs["is_host"] is True


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_resume_without_a_checkpoint_is_refused(tmp_path, env):
    (tmp_path / "empty").mkdir()
    cfg_path = write(tmp_path / "c.json", small_config(tmp_path / "empty", SPLIT))
    proc = launch(["--resume", str(tmp_path / "empty"), "--config", str(cfg_path)], env, timeout=60)
    assert proc.returncode == 2
    assert "nothing to resume in" in proc.stderr and "launch without --resume" in proc.stderr


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_stopping_the_launcher_stops_every_rank(tmp_path, env):
    proc = _start(write(tmp_path / "c.json", small_config(tmp_path / "run", SPLIT, max_steps=40, epochs=12)), env)
    lines: list[str] = []
    pids: dict[int, int] = {}
    _read_until(proc, lines, "[rank 1] step 2/", pids)
    assert sorted(pids) == [0, 1, 2] and proc.poll() is None, "".join(lines)[-3000:]
    proc.send_signal(signal.SIGTERM)  # what a stop of the run does to the launcher
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, rest[-3000:]
    assert "[launch] stopped by SIGTERM: every rank was stopped" in rest
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (tmp_path / "run" / "root_cause.json").exists()


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_rank_shows_no_progress_bar_even_when_its_environment_asks_for_one():
    """A rank's log lines stay whole: the rank turns transformers' and the hub's bars off itself, so a weight load
    prints nothing even in an environment that enables the bars."""
    code = ("import sys\n"
            "from trainer.rank import quiet_progress_bars\n"
            "from transformers.utils import logging\n"
            "assert logging.is_progress_bar_enabled()\n"
            "quiet_progress_bars()\n"
            "from transformers.utils.logging import tqdm\n"
            "for _ in tqdm(range(3), desc='Loading weights'):\n"
            "    pass\n"
            "print('enabled' if logging.is_progress_bar_enabled() else 'disabled')\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**env, "HF_HUB_DISABLE_PROGRESS_BARS": "0", "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "disabled" and "Loading weights" not in res.stderr, res.stdout + res.stderr
