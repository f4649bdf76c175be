"""trainer.launch for real: 1 target + 2 drafter processes on gloo against the single-process reference,
a killed drafter ending the run, a failing rank's traceback, and --resume."""

from __future__ import annotations

import io
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


def reference(cfg: dict, env: dict, batches_per_step: int = 2) -> list[dict]:
    """The single-process run at the same global batch: the colocated loop accumulating `batches_per_step`
    batches per step, in a fresh process (same thread settings as a rank)."""
    cfg = json.loads(json.dumps(cfg))
    cfg["data"]["batches_per_step"] = batches_per_step
    path = Path(cfg["output_dir"]).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    code = "import sys, torch; torch.set_num_threads(1)\nfrom trainer.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = subprocess.run([sys.executable, "-c", code, "train", "--config", str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
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


def _as_if_killed_after(run_dir: Path, step: int) -> None:
    """Leave the run as a kill right after the checkpoint of `step` would: newer checkpoints gone."""
    for p in (run_dir / "checkpoints").iterdir():
        if p.name.startswith("step_") and int(p.name[len("step_"):]) > step:
            shutil.rmtree(p)


@pytest.mark.parametrize("first, second", [("colocated", "split"), ("split", "colocated")])
def test_a_checkpoint_resumes_under_the_other_layout_with_the_reference_loss(tmp_path, env, first, second):
    # Two batches per step in every layout: the colocated process accumulates both, two drafters one each.
    layouts = {"colocated": {}, "split": SPLIT}

    def config(name: str, layout: dict) -> dict:
        cfg = small_config(tmp_path / name, layout, save_every=3, keep_checkpoints=3)
        cfg["data"]["batches_per_step"] = 2
        return cfg

    ref = reference(small_config(tmp_path / "ref"), env)
    proc = launch(["--config", str(write(tmp_path / "first.json", config("first", layouts[first])))], env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    run_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "first", run_dir)
    _as_if_killed_after(run_dir, 3)

    cfg_path = write(tmp_path / "second.json", config("unused", layouts[second]))
    proc = launch(["--resume", str(run_dir), "--config", str(cfg_path)], env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"^(\[rank 1\] )?resumed from step 3$", proc.stdout, re.M), proc.stdout[-3000:]
    got = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(1, 7)), "a resumed run neither repeats nor skips a step"
    assert [len(r["memory"]) for r in got[3:]] == [3 if second == "split" else 1] * 3  # really the other layout
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])


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
    # The target usually dies too (its send fails: "Connection closed/reset by peer"), sometimes before the
    # launcher sees a drafter exit; the launcher must still name a drafter, whose own traceback is the cause.
    named = re.search(r"\[launch\] run failed: rank ([12]) \(drafter\) exited with code 1: ValueError: attention_backend", out)
    assert named, out[-3000:]
    r = named.group(1)
    assert re.search(rf"^\[rank {r}\] Traceback \(most recent call last\):", out, re.M), out[-3000:]
    assert re.search(rf"^\[rank {r}\] ValueError: attention_backend 'flex' has no CPU backward", out, re.M)
    # every rank that failed on its own printed its whole traceback (nobody was stopped mid-print)
    for also in re.finditer(r"^\[launch\] also: rank (\d) \(\w+\) exited with code 1: .*\((\w+Error): ", out, re.M):
        assert re.search(rf"^\[rank {also.group(1)}\] {also.group(2)}: ", out, re.M), out[-3000:]


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


# Stand-in ranks for the launcher's watcher: real processes whose order of failure the test sets.
STAND_IN = """
import os, sys, time
rank = int(os.environ["RANK"])
script = {
    # rank 0 loses its peer first and says so, as gloo does
    0: (0.0, 'RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242', 1),
    # rank 1 fails on its own a moment later: the root cause, although it is not the first to exit
    1: (0.6, "ValueError: bad batch shape", 3),
    # rank 2 never fails: it is stopped after the settle window
    2: (None, None, 0),
}[rank]
delay, error, code = script
if delay is None:
    print("rank 2 working", flush=True)
    time.sleep(600)
time.sleep(delay)
print("Traceback (most recent call last):")
print('  File "x.py", line 1, in <module>')
print("    step()")
print(error, flush=True)
os._exit(code)
"""


def test_launcher_names_the_rank_with_its_own_error_not_the_first_to_exit(tmp_path):
    from trainer.launch import spawn
    from trainer.layout import Layout

    layout = Layout(num_target_procs=1, num_drafter_procs=2)
    buf = io.StringIO()
    t0 = time.monotonic()
    code = spawn(tmp_path / "unused.json", layout, out=buf, grace_s=5, settle_s=2.0,
                 command=[sys.executable, "-c", STAND_IN])
    elapsed = time.monotonic() - t0
    out = buf.getvalue()
    assert code == 3, out
    assert "[launch] run failed: rank 1 (drafter) exited with code 3: ValueError: bad batch shape" in out, out
    assert "[launch] also: rank 0 (target) exited with code 1: lost its connection to a failed peer" in out
    # both tracebacks reached the log whole; the rank that never failed was stopped after the window, not
    # reported as a failure
    assert "[rank 1] ValueError: bad batch shape" in out and "[rank 0] RuntimeError: [gloo" in out
    assert "stopping the other ranks" in out and "also: rank 2" not in out
    assert 2.0 <= elapsed < 2.0 + 5 + 5, elapsed


def test_final_error_and_root_cause():
    from trainer.launch import RankFailure, final_error, is_peer_lost, root_cause

    chained = [
        "step 1 loss 3.2",
        "Traceback (most recent call last):",
        '  File "a.py", line 1, in f',
        "KeyError: 'x'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "b.py", line 2, in g',
        "    raise ValueError('nope')",
        "ValueError: nope",
        "  a continuation line",
    ]
    assert final_error(chained) == "ValueError: nope"
    assert final_error(["step 1", "error: rank 1: data file missing"]) == "error: rank 1: data file missing"
    assert final_error(["step 1", "step 2"]) == ""
    assert is_peer_lost("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert is_peer_lost("torch.distributed.DistBackendError: NCCL error ... ncclRemoteError: remote process exited")
    assert is_peer_lost("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 900000ms for recv")
    assert not is_peer_lost("ValueError: nope") and not is_peer_lost("")

    peer_first = RankFailure(0, "target", 1, exited_at=1.0, error="RuntimeError: Connection reset by peer", peer_lost=True)
    own_later = RankFailure(2, "drafter", 1, exited_at=1.5, error="ValueError: nope")
    own_latest = RankFailure(1, "drafter", 1, exited_at=1.7, error="ValueError: nope")
    killed = RankFailure(1, "drafter", -9, exited_at=2.0)
    assert root_cause([peer_first, own_later, own_latest]) is own_later  # own error beats an earlier peer loss
    assert root_cause([own_latest, own_later]) is own_later  # then the first to exit
    assert root_cause([peer_first, killed]) is killed  # a signal death (no error printed) is its own cause
    assert root_cause([peer_first]) is peer_first
    with pytest.raises(ValueError):
        root_cause([])


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
