"""The last good run, the throughput baseline `dflashctl logs --follow` compares a run against
(orchestrator.agent.tailer.last_good_baseline, sent in the tail verb's run event): the newest run of the same
experiment that is OLDER than the followed one and succeeded. A newer run is never it (following an old run
compares it with what came before it), nor a failed one, nor one a user stopped, even when its trainer exited
0 on SIGINT: its throughput is that of a cut-short run."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from orchestrator.agent.protocol import Emitter
from orchestrator.agent.rundirs import resolve_run
from orchestrator.agent.tailer import last_good_baseline
from orchestrator.agent.verbs import stop as stop_verb
from orchestrator.agent.verbs import tail as tail_verb
from orchestrator.ops.launch import LaunchSpec, launch
from waiting import wait_for

STOPPED = {"by": "alice@ws", "via": "dflashctl stop", "at": "2026-01-02T00:00:00Z"}


def finished(workdir: Path, run_id: str, created: str, exit_info: dict | None, tps: list[float]) -> Path:
    run = workdir / "runs" / run_id
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"experiment": "exp", "run_id": run_id, "created": created}))
    if exit_info is not None:
        (run / "exit.json").write_text(json.dumps(exit_info))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tokens_per_s": v}) + "\n"
                                               for i, v in enumerate(tps)))
    return run


def baseline_seen_by_tail(workdir: Path, run_id: str) -> dict | None:
    """The baseline in the run event of the tail verb, as `dflashctl logs --follow` asks for it."""
    out = io.StringIO()
    tail_verb.run({"workdir": str(workdir), "run_id": run_id, "baseline": True}, Emitter(out))
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    return [e for e in events if e["event"] == "run"][0].get("baseline")  # absent when there is none


def test_a_newer_run_is_never_the_baseline(tmp_path):
    finished(tmp_path, "exp-1", "2026-01-01T00:00:00Z", {"exit_code": 0}, [10.0] * 8)
    finished(tmp_path, "exp-2", "2026-01-02T00:00:00Z", None, [5.0] * 8)  # the followed one, still running
    finished(tmp_path, "exp-3", "2026-01-03T00:00:00Z", {"exit_code": 0}, [99.0] * 8)  # newer, succeeded
    assert baseline_seen_by_tail(tmp_path, "exp-2") == {"run_id": "exp-1", "tokens_per_s": 10.0, "samples": 5}
    # the oldest run has nothing before it: no baseline at all, not the newer ones
    assert last_good_baseline(tmp_path, resolve_run(tmp_path, "exp-1")) is None


def test_a_run_stopped_by_the_user_is_never_the_baseline_whatever_its_exit_code(tmp_path):
    finished(tmp_path, "exp-1", "2026-01-01T00:00:00Z", {"exit_code": 0}, [10.0] * 8)
    finished(tmp_path, "exp-2", "2026-01-02T00:00:00Z", {"exit_code": 0, "stopped": STOPPED}, [99.0] * 8)
    finished(tmp_path, "exp-3", "2026-01-02T12:00:00Z", {"exit_code": 130, "stopped": STOPPED}, [98.0] * 8)
    finished(tmp_path, "exp-4", "2026-01-02T18:00:00Z", {"exit_code": 1}, [97.0] * 8)  # failed
    finished(tmp_path, "exp-5", "2026-01-03T00:00:00Z", None, [5.0] * 8)
    assert last_good_baseline(tmp_path, resolve_run(tmp_path, "exp-5"))["run_id"] == "exp-1"


# On SIGINT it ends with exit 0, as a trainer that saves and exits cleanly on Ctrl-C does.
EXITS_0_ON_SIGINT = [sys.executable, "-c", (
    "import json, os, signal, sys, time\n"
    "signal.signal(signal.SIGINT, lambda *_: sys.exit(0))\n"
    "with open(os.path.join(os.environ['DFLASHCTL_RUN_DIR'], 'metrics.jsonl'), 'w') as fh:\n"
    "    for i in range(8):\n"
    "        fh.write(json.dumps({'step': i, 'tokens_per_s': 777.0}) + '\\n')\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n")]


@pytest.mark.usefixtures("isolated_tmux")
def test_a_real_run_stopped_with_exit_0_is_not_the_baseline_of_the_next(local_target):
    """Launched for real (start_training.sh in tmux), stopped through the agent's stop verb, exit.json says exit 0
    and who stopped it: the next run of the experiment has no baseline (its only predecessor was stopped)."""
    spec = LaunchSpec(experiment="cut", kind="command", target="local", command=EXITS_0_ON_SIGINT,
                      venv_profile={"kind": "workstation"})
    first = launch(local_target, spec)
    log = Path(first.run_dir) / "train.log"
    wait_for(lambda: log.exists() and "\nready\n" in log.read_text())
    result = stop_verb.run({"workdir": local_target.workdir, "run_id": first.run_id, "grace_s": 30,
                            "requested_by": {"by": "alice@ws", "via": "dflashctl stop"}}, Emitter(io.StringIO()))
    assert result["state"] == "stopped" and result["exit"]["exit_code"] == 0 and result["exit"]["stopped"]
    second = launch(local_target, LaunchSpec(experiment="cut", kind="command", target="local", command=["true"],
                                             venv_profile={"kind": "workstation"}))
    assert baseline_seen_by_tail(Path(local_target.workdir), second.run_id) is None


# ------------------------------------ exact edges of the summary and the search (what the mutation run found)


def _metrics(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_the_summary_is_the_median_of_positive_numbers_after_the_warm_up(tmp_path):
    from orchestrator.agent.tailer import throughput_summary

    m = tmp_path / "metrics.jsonl"
    # 3 warm-up records skipped when more than 5 values remain: median of 10, 20, 30 (odd) and of 4 values (even)
    assert throughput_summary(_metrics(m, [{"tokens_per_s": v} for v in (1, 2, 3, 30, 10, 20)])) == {
        "tokens_per_s": 20.0, "samples": 3}
    assert throughput_summary(_metrics(m, [{"tokens_per_s": v} for v in (1, 2, 3, 40, 10, 20, 30)])) == {
        "tokens_per_s": 25.0, "samples": 4}
    # five values or fewer: nothing skipped (a short run's every record counts)
    assert throughput_summary(_metrics(m, [{"tokens_per_s": v} for v in (1, 2, 3, 4, 100)])) == {
        "tokens_per_s": 3.0, "samples": 5}
    assert throughput_summary(_metrics(m, [{"tokens_per_s": 7}])) == {"tokens_per_s": 7.0, "samples": 1}
    assert throughput_summary(_metrics(m, [{"tokens_per_s": 6}, {"tokens_per_s": 9}])) == {
        "tokens_per_s": 7.5, "samples": 2}
    # the skip is a parameter
    assert throughput_summary(_metrics(m, [{"tokens_per_s": v} for v in (1, 2, 3, 30, 10, 20)]), skip_first=0) == {
        "tokens_per_s": 6.5, "samples": 6}
    # what is not a positive number, or not a record, or not JSON, is not a value
    junk = ["{half", "[1, 2]", "null", {"tokens_per_s": 0}, {"tokens_per_s": -5}, {"tokens_per_s": "9"},
            {"tokens_per_s": None}, {"tps": 9}, {"tokens_per_s": 4.5}]
    assert throughput_summary(_metrics(m, junk)) == {"tokens_per_s": 4.5, "samples": 1}
    assert throughput_summary(_metrics(m, junk[:-1])) is None
    assert throughput_summary(tmp_path / "absent.jsonl") is None
    # a line that is not UTF-8 (a torn write) is one bad line, not a crash of every follow of the experiment
    m.write_bytes(b'{"tokens_per_s": 3}\n\xff\xfe\n{"tokens_per_s": 5}\n')
    assert throughput_summary(m) == {"tokens_per_s": 4.0, "samples": 2}


def test_the_baseline_is_the_newest_older_succeeded_run_of_the_same_experiment_with_metrics(tmp_path):
    finished(tmp_path, "exp-1", "2026-01-01T00:00:00Z", {"exit_code": 0}, [10.0] * 8)
    finished(tmp_path, "exp-2", "2026-01-01T06:00:00Z", {"exit_code": 0}, [20.0] * 8)
    finished(tmp_path, "exp-3", "2026-01-01T12:00:00Z", {"exit_code": 0}, [])  # succeeded, no metrics: skipped
    other = finished(tmp_path, "oth-1", "2026-01-01T18:00:00Z", {"exit_code": 0}, [99.0] * 8)
    info = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**info, "experiment": "other"}))
    finished(tmp_path, "exp-4", "2026-01-02T00:00:00Z", None, [1.0] * 8)
    assert last_good_baseline(tmp_path, resolve_run(tmp_path, "exp-4")) == {
        "run_id": "exp-2", "tokens_per_s": 20.0, "samples": 5}  # the newest good one, not the first found
    assert last_good_baseline(tmp_path, resolve_run(tmp_path, "exp-2")) == {
        "run_id": "exp-1", "tokens_per_s": 10.0, "samples": 5}
    # the followed run itself never counts, even when it succeeded; nor a run of the same time (not older)
    finished(tmp_path, "exp-5", "2026-01-02T00:00:00Z", {"exit_code": 0}, [50.0] * 8)
    assert last_good_baseline(tmp_path, resolve_run(tmp_path, "exp-4"))["run_id"] == "exp-2"
    # a run with no experiment has no baseline
    ref = resolve_run(tmp_path, "exp-4")
    assert last_good_baseline(tmp_path, type(ref)(**{**ref.__dict__, "info": {}})) is None
