"""warmup: one agent call that runs `python -m trainer.warmup` once per drafter GPU, one after another,
streaming compile seconds and cache hits; on the fake Proxmox host (one pct exec, busy GPUs refused) and
for real with inductor on the local target (the second warm-up loads from <workdir>/inductor-cache)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.agent.warmup import warmup_env
from orchestrator.errors import PreflightError, UserError
from orchestrator.ops.launch import LaunchSpec
from orchestrator.ops.warmup import warmup
from orchestrator.target import ContainerTarget, LocalTarget
from orchestrator.transport.local import LocalTransport


def shape_target(directory: Path) -> Path:
    """A target model directory with only config.json: the warm-up compiles shapes, it needs no weights."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16).save_pretrained(directory)
    return directory


def dflash_spec(model_dir: Path, *, layout: dict, compile_on: bool, target: str = "local") -> LaunchSpec:
    from trainer.config import parse_config

    config = parse_config({
        "model": {"target": str(model_dir), "block_size": 4, "num_draft_layers": 1, "num_target_features": 1},
        "data": {"max_len": 32, "token_budget": 64, "max_batch_size": 2, "num_anchors": 4},
        "compile": {"enabled": compile_on},
        "layout": layout,
    }).model_dump(mode="json")
    gpus = [*layout.get("target_gpus", []), *layout.get("drafter_gpus", [])]
    return LaunchSpec(experiment="wu", kind="dflash", target=target, config=config, layout=layout, gpus=gpus,
                      venv_profile={"kind": "workstation"})


def test_warmup_env_is_one_gpu_or_none_and_the_persistent_cache():
    base = {"CUDA_VISIBLE_DEVICES": "0,1,2", "HOME": "/root"}
    env = warmup_env(base, 6, "/w/inductor-cache")
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("6", "PCI_BUS_ID")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/w/inductor-cache" and env["HOME"] == "/root"
    assert warmup_env(base, None, None)["CUDA_VISIBLE_DEVICES"] == "" and base["CUDA_VISIBLE_DEVICES"] == "0,1,2"


def test_warmup_refuses_a_command_experiment_before_contacting_the_target():
    class Refuse:
        name = "refuse"

        def agent(self, *a, **k):  # pragma: no cover - reaching it is the failure
            raise AssertionError("the target was contacted")

    spec = LaunchSpec(experiment="c", kind="command", target="local", command=["true"])
    with pytest.raises(UserError, match="only kind dflash"):
        warmup(Refuse(), spec)


def make_ct(fake_pve, ctid: int, venv: Path):
    """A stock container whose current venv is `venv` (stock_cpu_venv: the cpu lock, built in a stock one)."""
    from fakehost import STOCK

    ct = fake_pve.create_container(ctid, gpus=8, image=STOCK)
    (Path(ct.workdir) / "venvs").mkdir()
    (Path(ct.workdir) / "venvs" / "current").symlink_to(venv)
    ct.to_container(Path(ct.workdir) / "venvs")  # made by the host's root: give it to the container's root
    return ct


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_container_warmup_is_one_pct_exec_one_process_per_drafter_gpu_in_order(pve, stock_cpu_venv):
    ct = make_ct(pve, 311, stock_cpu_venv[0])
    try:
        model = shape_target(Path(ct.workdir) / "model")
        # compile off and device cpu: this box has no GPU; the processes, their order and events are real.
        spec = dflash_spec(model, layout={"target_gpus": [4], "drafter_gpus": [5, 6]}, compile_on=False, target="ct")
        t = ContainerTarget(name="ct311", workdir=ct.workdir, transport=pve.pct_transport(311))
        t.agent("echo")  # first contact (bundle inline); from then on a warm-up is one exec
        pve.clear_pct_calls()
        events: list[dict] = []
        res = warmup(t, spec, on_event=events.append, device="cpu")
        assert len(pve.pct_exec_calls(311)) == 1

        assert [w["gpu"] for w in res.warmups] == [5, 6] and all(w["device"] == "cpu" for w in res.warmups)
        done = [e for e in events if e.step == "warmup" and "warm in" in e.message]
        assert [e.gpu for e in done] == [5, 6]
        for e in done:
            assert {"compile_s", "cache_hits", "cache_misses"} <= set(e.warmup) and e.wall_s is not None
            assert f"GPU {e.gpu}: warm in" in e.message and "cache hits" in e.message
        # One after the other: GPU 6 starts only after GPU 5 reported done.
        order = [(e.gpu, "start" if "compiling" in e.message else "done")
                 for e in events if e.step == "warmup" and ("compiling" in e.message or "warm in" in e.message)]
        assert order == [(5, "start"), (5, "done"), (6, "start"), (6, "done")]
        assert res.cache_dir == str(Path(ct.workdir) / "inductor-cache") and Path(res.cache_dir).is_dir()
        written = json.loads((Path(res.dir) / "config.json").read_text())
        assert written["compile"]["cache_dir"] == res.cache_dir and written["layout"]["drafter_gpus"] == [5, 6]
        assert json.loads((Path(res.dir) / "warmup.json").read_text()) == res.warmups

        # A drafter GPU in use: refused, naming it, and no warm-up process runs.
        ct.set_gpu_used(6, 20000)
        with pytest.raises(PreflightError) as info:
            warmup(t, spec, device="cpu")
        assert info.value.agent_type == "GpuBusy" and "GPU 6 uses 20000 MiB" in info.value.message
        t.close()
    finally:
        pve.remove_container(311)


@pytest.mark.slow
def test_local_cpu_warmup_compiles_then_loads_from_the_workdir_cache(cold_warmup, tiny_cache, monkeypatch):
    # The cold warm-up is the session's (tests/conftest.py: this op, on a local target whose workdir cache
    # started empty, with the config of tests/trainer/test_warmup.py, so one cold compile serves both); this
    # test warms up again through the op and checks both.
    monkeypatch.setenv("DFLASH_TINY_CACHE", str(tiny_cache))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    wd = cold_warmup.workdir
    t = LocalTarget(name="local", workdir=str(wd), transport=LocalTransport())
    events: list[dict] = []
    runs = [(cold_warmup.res, cold_warmup.events), (warmup(t, cold_warmup.spec, on_event=events.append), events)]
    (cold, cold_ev), (warm, warm_ev) = runs
    cache = wd / "inductor-cache"
    for res, events in runs:
        assert [w["gpu"] for w in res.warmups] == [None]  # a CPU layout: one warm-up, on the CPU
        assert res.warmups[0]["device"] == "cpu" and res.warmups[0]["cache_dir"] == str(cache)
        assert res.warmups[0]["compiled"]["drafter_forward"] is True
        shapes = [e for e in events if e.step == "warmup" and "shape" in (e.warmup or {})]
        assert len(shapes) == 1 and shapes[0].warmup["shape"] == {"rows": 2, "row_len": 48, "num_anchors": 4}
    c, w = cold.warmups[0], warm.warmups[0]
    assert c["cache_misses"] > 0 and c["cache_hits"] == 0
    assert w["cache_hits"] > 0 and w["cache_misses"] == 0
    assert w["compile_s"] < c["compile_s"]
    assert (cache / "fxgraph").is_dir()
    assert "CPU: warm in" in next(e.message for e in cold_ev if "warm in" in e.message)


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_the_warmup_verb_through_the_installed_cli(dflashctl, tmp_path):
    """`dflashctl warmup EXPERIMENT` as a user runs it, on the local target (a CPU layout: one warm-up on the
    CPU): the table, the JSON, and a command experiment refused before the target is contacted."""
    import yaml

    model = shape_target(tmp_path / "model")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({
        "targets": {"local": {"kind": "local", "workdir": str(tmp_path / "work"), "venv": "workstation"}},
        "venvs": {"workstation": {"kind": "workstation"}},
        "experiments": {
            "wu": {"kind": "dflash", "target": "local", "trainer": {
                "model": {"target": str(model), "block_size": 4, "num_draft_layers": 1, "num_target_features": 1},
                "data": {"max_len": 32, "token_budget": 64, "max_batch_size": 2, "num_anchors": 4},
                "compile": {"enabled": False}}},
            "cmd": {"kind": "command", "target": "local", "command": ["true"]}},
    }))
    r = dflashctl("-i", str(inv), "warmup", "wu", timeout=600)
    assert r.returncode == 0, r.stderr
    files, cache = tmp_path / "work" / "warmup" / "wu", tmp_path / "work" / "inductor-cache"
    lines = r.stdout.splitlines()
    assert lines[0].strip() == "warm-up of wu on local" and lines[-1] == f"cache: {cache}   files: {files}"
    [row] = [line for line in lines if line.startswith("│ CPU ")]
    assert row.split("│")[2].strip() == "cpu"
    assert "CPU: warm in" in r.stderr  # the progress events, on stderr
    [done] = json.loads((files / "warmup.json").read_text())
    assert done["gpu"] is None and done["device"] == "cpu" and done["compiled"]["drafter_forward"] is False

    r = dflashctl("-i", str(inv), "warmup", "wu", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert (res["experiment"], res["target"], res["cache_dir"], res["dir"]) == ("wu", "local", str(cache), str(files))
    assert [(w["gpu"], w["device"]) for w in res["warmups"]] == [(None, "cpu")]

    r = dflashctl("-i", str(inv), "warmup", "cmd")
    assert r.returncode == 1 and r.stderr.splitlines()[0].startswith("error: ") and "only kind dflash" in r.stderr
