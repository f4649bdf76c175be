"""Workstation run records (orchestrator.records): append-only runs.jsonl in the state dir
($DFLASHCTL_STATE_DIR here, conftest's isolated_tmux), what survives a torn write, stops folded into their runs,
lookups by id, prefix and experiment, and what `runs diff` compares."""

from __future__ import annotations

import json
import threading

import pytest

from orchestrator import records
from orchestrator.errors import RunNotFound, UserError

pytestmark = pytest.mark.usefixtures("isolated_tmux")


def rec(run_id: str, **kw) -> dict:
    base = {"run_id": run_id, "experiment": "exp", "target": "ct200", "bundle_hash": "b1",
            "config": {"model": {"block_size": 16}, "gamma": 7.0}, "gpus": [5],
            "env_fingerprint": {"python": "3.11.9", "torch": "2.9.0", "packages": {"torch": "2.9.0"}}}
    base.update(kw)
    return base


def test_records_append_and_survive_a_torn_line(tmp_path):
    records.append_record(rec("a-1"))
    with open(records.records_path(), "a") as fh:
        fh.write('{"run_id": "torn", "experi')  # a crash in the middle of a write
    records.append_record(rec("a-2", experiment="other"))
    assert [r["run_id"] for r in records.load_records()] == ["a-1", "a-2"]
    assert [r["run_id"] for r in records.load_records("other")] == ["a-2"]
    assert records.records_path() == tmp_path / "state" / "runs.jsonl"
    lines = records.records_path().read_text().splitlines()
    assert lines[1] == '{"run_id": "torn", "experi'  # the torn line ended, never glued to the next record


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


def test_flatten_dotted_paths():
    assert records.flatten({"a": {"b": {"c": 1}, "d": [1, 2]}, "e": {}}) == {"a.b.c": 1, "a.d": [1, 2], "e": {}}


def test_no_file_yet_is_no_runs_and_a_lookup_says_how_to_list_them():
    assert records.load_records() == []
    with pytest.raises(RunNotFound) as info:
        records.find_record("exp-1")
    assert str(records.records_path()) in info.value.message and info.value.fix.startswith("dflashctl runs")


def test_the_first_record_makes_the_state_dir_and_a_file_of_one_line_per_record(tmp_path):
    path = records.append_record(rec("a-1", note="[rank0]: it's \"quoted\"\nsecond line"))
    assert path == tmp_path / "state" / "runs.jsonl"
    [line] = path.read_text().splitlines()
    assert json.loads(line)["note"] == "[rank0]: it's \"quoted\"\nsecond line"


def test_a_torn_last_line_is_skipped_and_the_records_before_it_stay():
    records.append_record(rec("a-1"))
    with open(records.records_path(), "a") as fh:
        fh.write('{"run_id": "a-2", "exper')  # the workstation died mid-write; nothing appended since
    assert [r["run_id"] for r in records.load_records()] == ["a-1"]


@pytest.mark.parametrize("bad, error", [({"experiment": "exp"}, "needs a run_id"), (None, "is not JSON")])
def test_a_record_that_cannot_be_written_whole_is_refused_and_the_file_is_untouched(bad, error):
    records.append_record(rec("a-1"))
    before = records.records_path().read_bytes()
    if bad is None:
        bad = rec("a-2")
        bad["config"]["self"] = bad["config"]  # a cycle: json cannot write it
    with pytest.raises(UserError, match=error):
        records.append_record(bad)
    assert records.records_path().read_bytes() == before


def test_a_stop_is_folded_into_its_run_and_the_file_stays_append_only():
    records.append_record(rec("a-1"))
    first = records.records_path().read_text()
    stopped = {"by": "alice@ws", "via": "dflashctl stop", "at": "2026-12-01T10:00:00Z"}
    records.record_stopped("a-1", stopped)
    records.record_stopped("elsewhere-1", stopped)  # launched from another workstation: not listed here
    assert records.records_path().read_text().startswith(first)  # the launch line is never rewritten
    [run] = records.load_records()
    assert run["run_id"] == "a-1" and run["stopped"] == stopped
    assert records.find_record("a-1")["stopped"] == stopped


def test_an_exact_run_id_wins_over_the_runs_it_prefixes():
    records.append_record(rec("exp-1"))
    records.append_record(rec("exp-10"))
    assert records.find_record("exp-1")["run_id"] == "exp-1"
    with pytest.raises(RunNotFound) as info:
        records.find_record("exp-")
    assert "exp-1, exp-10" in info.value.message and info.value.fix == "give more of the run id"


def test_a_run_across_targets_diffs_each_node_by_name():
    node = lambda target, torch: {"target": target, "gpus": [0],  # noqa: E731
                                  "env_fingerprint": {"torch": torch, "packages": {"torch": torch}}}
    a = rec("a-1", nodes=[node("ct200", "2.9.0"), node("ct201", "2.9.0")])
    b = rec("b-1", nodes=[node("ct200", "2.9.0"), node("ct201", "2.10.0")])
    d = records.diff_records(a, b)
    assert d.packages == [("node 1 (ct201): torch", "2.9.0", "2.10.0")]
    assert d.environment == [("node 1 (ct201): torch", "2.9.0", "2.10.0")]
    assert records.diff_records(a, a).same


def test_a_state_file_is_written_whole_and_a_state_dir_that_cannot_be_written_is_no_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    assert records.read_state("cache.json") is None
    assert records.write_state("cache.json", '{"a": 1}') is True
    assert records.read_state("cache.json") == '{"a": 1}'
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["cache.json"]  # no temporary file left
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "file" / "state"))  # under a file: mkdir fails
    assert records.write_state("cache.json", "{}") is False
    assert records.read_state("cache.json") is None
