"""The silent-failure alert on real training: a tiny run whose context mask lets each block see its own target
features (the classic leak: high accuracy, a τ that serving never reaches) fires it; the same run with the
trainer's own mask stays quiet. The alert is the follower's (orchestrator.monitor.build_monitors), fed the runs'
real metrics.jsonl."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]

# The run, as a script: `leak` replaces the SDPA mask builder with one off by a block (a context key kv is
# visible while kv < anchor + block_size, not kv < anchor), in training only: evaluation decodes without it.
SCRIPT = """
import sys
import trainer.attention as attention

if sys.argv[2] == "leak":
    strict = attention.dense_mask

    def leaky(anchors, keep, doc_ids, block_size):
        return strict((anchors + block_size).clamp(max=doc_ids.shape[1]), keep, doc_ids, block_size)

    attention.dense_mask = leaky
from trainer.distributed import single_world
from trainer.loop import train
from trainer.tiny import tiny_train_config

cfg = tiny_train_config(sys.argv[1], max_steps=100, eval_every=50)
train(cfg, single_world(cfg.layout.to_layout()))
"""


def _run(tmp_path: Path, mode: str) -> list[dict]:
    out = tmp_path / mode
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, DFLASH_TINY_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(script), str(out), mode], env=env, capture_output=True, text=True,
                          timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_run_trained_on_leaked_features_fires_the_silent_failure_alert_and_the_same_run_without_stays_quiet(
        tmp_path):
    from orchestrator.monitor import SilentFailure, build_monitors

    def silent_alerts(records):
        [silent] = [m for m in build_monitors({}) if isinstance(m, SilentFailure)]
        return [a for r in records for a in silent.feed(r)]

    def summary(records):
        train = [r for r in records if r["kind"] == "train"]
        evals = [r for r in records if r["kind"] == "eval" and r.get("when") != "before"]
        return train[-1]["acc"], train[-1]["sim_tau"], evals[-1]["tau"]

    leak = _run(tmp_path, "leak")
    healthy = _run(tmp_path, "healthy")
    print("leak: acc %.3f sim_tau %.2f real tau %.2f" % summary(leak))
    print("healthy: acc %.3f sim_tau %.2f real tau %.2f" % summary(healthy))
    alerts = silent_alerts(leak)
    assert [a.kind for a in alerts] == ["train-serve-gap"], [a.message for a in alerts]
    assert "context mask" in alerts[0].message and "mask token id" in alerts[0].message
    assert alerts[0].detail["tau"] < 0.5 * alerts[0].detail["sim_tau"]
    assert silent_alerts(healthy) == []
    # the leak is what the alert says: training claims more than the trainer's own mask gives, serving less
    leak_acc, leak_sim, leak_tau = summary(leak)
    acc, sim, tau = summary(healthy)
    assert leak_acc > acc and leak_sim > sim and leak_tau < tau
