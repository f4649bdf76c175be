"""`metrics`: the agent reads a real metrics.jsonl through the LocalTarget; plots render; PNG is written."""

from __future__ import annotations

import json

import pytest

from orchestrator.errors import RunNotFound, UserError
from orchestrator.ops.metrics import fetch_metrics, render_terminal, series_from_rows, write_png
from orchestrator.target import LocalTarget
from orchestrator.transport.local import LocalTransport


@pytest.fixture
def target(tmp_path):
    return LocalTarget(name="local", workdir=str(tmp_path), transport=LocalTransport())


def _write_run(workdir, run_id, rows, torn=False):
    d = workdir / "runs" / run_id
    d.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if torn:
        text += '{"step": 99, "loss": 1.'
    (d / "metrics.jsonl").write_text(text)


def test_fetch_skips_torn_last_line_and_downsamples(target, tmp_path):
    rows = [{"step": i, "loss": 5.0 - i * 0.01, "acc": [0.1, 0.3], "tokens_per_s": 1000 + i} for i in range(50)]
    _write_run(tmp_path, "tiny-20261130T000000Z", rows, torn=True)
    ms = fetch_metrics(target, "tiny-20261130T000000Z", max_rows=10)
    assert ms.total_rows == 50
    steps, losses = ms.series["loss"]
    assert len(steps) == 10 and steps[0] == 0 and steps[-1] == 49  # first and last kept
    assert ms.series["accuracy"][1][0] == pytest.approx(0.2)  # per-slot list -> mean
    assert "simulated τ" not in ms.series


def test_missing_run_and_bad_name(target):
    with pytest.raises(RunNotFound):
        fetch_metrics(target, "nope")
    with pytest.raises(RunNotFound, match="not a valid run id"):
        fetch_metrics(target, "../etc")


def test_experiment_means_its_newest_run(target, tmp_path):
    for run_id, created, loss in (("tiny-a", "2026-11-30T01:00:00Z", 1.0), ("tiny-b", "2026-11-30T02:00:00Z", 2.0)):
        _write_run(tmp_path, run_id, [{"step": 0, "loss": loss}])
        (tmp_path / "runs" / run_id / "run.json").write_text(json.dumps({"experiment": "tiny", "created": created}))
    ms = fetch_metrics(target, experiment="tiny")
    assert ms.run_id == "tiny-b" and ms.series["loss"][1] == [2.0]


def test_terminal_and_png(tmp_path):
    ms = series_from_rows("r1", [{"step": i, "loss": 1.0 / (i + 1), "sim_accept_len": 1 + i / 10} for i in range(20)])
    text = render_terminal(ms, width=60, height=8)
    assert "r1: loss" in text and "r1: simulated τ" in text
    png = tmp_path / "m.png"
    write_png(ms, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(UserError, match="no metrics"):
        write_png(series_from_rows("empty", []), str(tmp_path / "e.png"))


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_cli_metrics_draws_and_writes_png(dflashctl, tmp_path):
    """`dflashctl metrics` through the installed console script (its only CLI test): the terminal plot, the PNG,
    and exit 4 for a run that does not exist."""
    from tests.orchestrator.test_cli import write_inventory

    inv = write_inventory(tmp_path)
    runs = tmp_path / "work" / "runs" / "tiny-x"
    runs.mkdir(parents=True)
    (runs / "run.json").write_text(json.dumps({"experiment": "tiny", "created": "2026-11-30T00:00:00Z"}))
    (runs / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 3 - i / 10}) + "\n" for i in range(10)))
    png = tmp_path / "out.png"
    res = dflashctl("--inventory", str(inv), "metrics", "tiny", "--png", str(png))
    assert res.returncode == 0, res.stderr
    assert "tiny-x: loss" in res.stdout
    assert png.exists() and png.stat().st_size > 1000
    res = dflashctl("--inventory", str(inv), "metrics", "nope-run")
    assert res.returncode == 4 and "no run 'nope-run'" in res.stderr


def test_cli_metrics_prints_the_balance_and_vllms_verdict_under_the_charts_and_in_json(dflashctl, tmp_path):
    """The installed script prints what the records say beyond the charts (orchestrator.ops.metrics.run_notes):
    the balance of a 1 target + 2 drafter run and the export's numbers in vLLM, last, and `--json` carries them."""
    from tests.orchestrator.test_cli import write_inventory

    inv = write_inventory(tmp_path)
    runs = tmp_path / "work" / "runs" / "tiny-b"
    runs.mkdir(parents=True)
    (runs / "run.json").write_text(json.dumps({"experiment": "tiny", "created": "2026-11-30T00:00:00Z"}))
    rows = [{"kind": "facts", "target_ranks": 1, "drafter_ranks": 2},
            *({"kind": "train", "step": i, "loss": 3 - i / 10, "target_tokens_per_s": 1000.0,
               "drafter_tokens_per_s": 8000.0} for i in range(1, 5)),
            {"kind": "eval_vllm", "tau_own": 2.5, "tau_vllm": 2.5, "tau_vllm_pooled": 2.25, "lossless": True,
             "tokens_per_s_plain": 10.0, "tokens_per_s_spec": 20.0, "speedup": 2.0}]
    (runs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = dflashctl("--inventory", str(inv), "metrics", "tiny-b")
    assert res.returncode == 0, res.stderr
    tail = res.stdout.rstrip("\n").splitlines()[-5:]
    assert tail[0] == "balance: the drafter ranks wait for features (the target side is the bottleneck)"
    assert tail[2] == "  now 1 target + 2 drafter: min(1 x 1000, 2 x 4000) = 1000 tokens/s"
    assert tail[3].startswith("  suggested 2 target + 1 drafter: min(2 x 1000, 1 x 4000) = 2000 tokens/s (2.00x)")
    assert tail[4].startswith("vLLM: τ 2.500 per-prompt mean (2.250 pooled)")
    res = dflashctl("--inventory", str(inv), "metrics", "tiny-b", "--json")
    assert json.loads(res.stdout)["notes"] == tail


def test_parse_records_counts_what_is_not_a_record():
    from orchestrator.agent.rundirs import parse_records

    records, invalid = parse_records([b'{"step": 1}\n', b"\n", b"[1, 2]\n", b'{"step": \n', '{"step": 2}'])
    assert records == [{"step": 1}, {"step": 2}] and invalid == 2


def test_real_tau_beside_simulated_tau(tmp_path):
    """Evaluation lines (chain and DDTree budgets at T=0, named by trainer.metrics.tau_key) share the τ panel
    with the training's simulated τ; sampled τ stays in the JSON only; an older eval line's `tau` is the chain."""
    from orchestrator.ops.metrics import TAU_PANEL

    rows = [{"kind": "train", "step": s, "loss": 2.0 - s / 100, "sim_tau": 1 + s / 100} for s in range(0, 101, 10)]
    rows += [{"kind": "eval", "step": 0, "when": "before", "tau": 1.0}]
    rows += [{"kind": "eval", "step": s, "tau": 1.5 + s / 100, "tau_chain": 1.5 + s / 100, "tau_tree16": 2 + s / 100,
              "tau_tree64": 2.5 + s / 100, "tau_chain_t0.7": 1.2, "verify_tree16": 17.0} for s in (50, 100)]
    ms = series_from_rows("r2", rows)
    assert ms.panels[TAU_PANEL] == ["simulated τ", "τ chain", "τ tree B=16", "τ tree B=64"]
    assert ms.series["τ chain"] == ([0.0, 50.0, 100.0], [1.0, 2.0, 2.5])
    assert ms.series["τ tree B=64"] == ([50.0, 100.0], [3.0, 3.5])
    assert ms.series["simulated τ"][1][-1] == 2.0 and "loss" in ms.panels
    text = render_terminal(ms, width=80, height=10)
    assert f"r2: {TAU_PANEL}" in text and "τ tree B=64" in text and "simulated τ" in text
    png = tmp_path / "tau.png"
    write_png(ms, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_downsampling_keeps_every_eval_line(target, tmp_path):
    rows = [{"kind": "train", "step": i, "loss": 1.0} for i in range(500)]
    rows[333:333] = [{"kind": "eval", "step": 333, "tau_chain": 2.0, "tau_tree32": 3.0}]
    _write_run(tmp_path, "tiny-20261130T000001Z", rows)
    ms = fetch_metrics(target, "tiny-20261130T000001Z", max_rows=20)
    assert ms.series["τ tree B=32"] == ([333.0], [3.0]) and len(ms.series["loss"][0]) <= 20
