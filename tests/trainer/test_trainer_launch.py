"""trainer.launch for real: 1 target + 2 drafter processes on gloo against the single-process reference,
a killed drafter ending the run, a failing rank's traceback, and --resume."""

from __future__ import annotations

import json
import os
import re
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
        layout=layout or {},
    )
    raw.update(top)
    return tiny_train_config(out, **raw).model_dump(mode="json")


def write(path: Path, cfg: dict) -> Path:
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tiny-cache")
    return dict(os.environ, DFLASH_TINY_CACHE=str(cache), PYTHONPATH=str(REPO))


def launch(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.launch", *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def reference(cfg: dict, env: dict, micro_batches: int = 2) -> list[dict]:
    """The single-process run at the same global batch, in a fresh process (same thread settings as a rank)."""
    code = (
        "import json,sys,torch; torch.set_num_threads(1)\n"
        "from trainer.config import parse_config\n"
        "from trainer.rank_loop import train_reference\n"
        f"train_reference(parse_config(json.loads(sys.argv[1])), {micro_batches})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [r for r in read_metrics(Path(cfg["output_dir"]) / "metrics.jsonl") if r["kind"] == "train"]


SPLIT = {"num_target_procs": 1, "num_drafter_procs": 2}


def test_one_target_two_drafters_match_the_single_process_run(tmp_path, env):
    ref = reference(small_config(tmp_path / "ref"), env)
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
    assert (tmp_path / "split" / "export" / "model.safetensors").exists()
    assert (tmp_path / "split" / "checkpoints" / "step_00000006" / "meta.json").exists()


def test_a_failing_rank_ends_the_run_with_its_traceback(tmp_path, env):
    # flex_attention has no CPU backward: both drafter ranks raise in their first step while the target
    # rank is blocked sending; the launcher must stop it and exit non-zero.
    cfg = small_config(tmp_path / "run", SPLIT)
    cfg["model"]["attention_backend"] = "flex"
    t0 = time.monotonic()
    proc = launch(["--config", str(write(tmp_path / "c.json", cfg))], env, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert time.monotonic() - t0 < 60
    out = proc.stdout
    assert re.search(r"^\[rank [12]\] Traceback \(most recent call last\):", out, re.M), out[-3000:]
    assert re.search(r"^\[rank [12]\] ValueError: attention_backend 'flex' has no CPU backward", out, re.M)
    assert re.search(r"\[launch\] run failed: rank [12] \(drafter\) exited with code 1", out)


@pytest.mark.slow
def test_killed_drafter_stops_the_run_and_resume_continues_it(tmp_path, env):
    run_dir = tmp_path / "run"
    long = dict(max_steps=40, save_every=2, epochs=12)
    cfg_path = write(tmp_path / "c.json", small_config(run_dir, SPLIT, **long))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", "--config", str(cfg_path)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines, pid = [], None
    for line in proc.stdout:
        lines.append(line)
        m = re.match(r"\[launch\] rank 2 \(drafter\) pid (\d+)", line)
        if m:
            pid = int(m.group(1))
        if line.startswith("[rank 1] [ckpt] step 4"):
            break
    assert pid is not None and proc.poll() is None, "".join(lines)[-3000:]
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    rest = proc.stdout.read()
    code = proc.wait(timeout=90)
    elapsed = time.monotonic() - t_kill
    out = "".join(lines) + rest
    assert code != 0
    assert elapsed < 60, elapsed
    assert "rank 2 (drafter) was killed by SIGKILL" in out, out[-3000:]
    assert "[launch] run failed" in out

    # Resume from the newest complete checkpoint; the whole run must equal an uninterrupted one.
    done = launch(["--resume", str(run_dir), "--config", str(cfg_path)], env)
    assert done.returncode == 0, done.stdout[-4000:]
    assert re.search(r"^\[rank [12]\] resumed from step (\d+)", done.stdout, re.M)
    got = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(1, 41)), "a resumed run neither repeats nor skips a step"
    ref = reference(small_config(tmp_path / "ref", **long), env)
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])


def test_resume_without_a_checkpoint_is_refused(tmp_path, env):
    (tmp_path / "empty").mkdir()
    cfg_path = write(tmp_path / "c.json", small_config(tmp_path / "empty", SPLIT))
    proc = launch(["--resume", str(tmp_path / "empty"), "--config", str(cfg_path)], env, timeout=60)
    assert proc.returncode == 2
    assert "nothing to resume in" in proc.stderr and "launch without --resume" in proc.stderr


def test_stopping_the_launcher_stops_every_rank(tmp_path, env):
    cfg_path = write(tmp_path / "c.json", small_config(tmp_path / "run", SPLIT, max_steps=40, epochs=12))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", "--config", str(cfg_path)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    pids, lines = [], []
    for line in proc.stdout:
        lines.append(line)
        m = re.match(r"\[launch\] rank \d \(\w+\) pid (\d+)", line)
        if m:
            pids.append(int(m.group(1)))
        if line.startswith("[rank 1] step 2/"):
            break
    assert len(pids) == 3 and proc.poll() is None, "".join(lines)[-3000:]
    proc.send_signal(signal.SIGTERM)  # what a stop of the run does to the launcher
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert "launcher got SIGTERM; stopping the other ranks" in rest
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
