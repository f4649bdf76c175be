"""The root cause of a failed run: real error files written by the rank's handler, read back through torch's
own ProcessFailure (what ChildFailedError carries), ranked by trainer.failures."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainer.distributed import talking_to
from trainer.failures import Failure, from_process_failure, report, root_cause, summary_lines, write_report
from trainer.rank import RankErrorHandler


def _raise_and_record(path: Path, exc: BaseException, monkeypatch, peer: bool = False) -> None:
    """Raise `exc` (inside a wait on a peer when `peer`) and let the rank's handler write its error file."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        if peer:
            with talking_to("receiving features from rank 0"):
                raise exc
        raise exc
    except BaseException as e:  # noqa: BLE001
        RankErrorHandler().record_exception(e)


def _failure(rank: int, exitcode: int, error_file: Path | None, role: str = "drafter") -> Failure:
    pf = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file or "/nonexistent"))
    return from_process_failure(rank, pf, role)


def test_an_error_file_carries_the_traceback_type_and_a_fine_time(tmp_path, monkeypatch):
    _raise_and_record(tmp_path / "e.json", ValueError("bad batch shape"), monkeypatch)
    f = _failure(1, 1, tmp_path / "e.json")
    assert f.message == "ValueError: bad batch shape" and f.exception == "builtins.ValueError"
    assert "Traceback (most recent call last)" in f.traceback and 'raise exc' in f.traceback
    assert not f.peer_lost and abs(f.time_ns - time.time_ns()) < 60 * 10**9 and f.rank_class == 0
    assert f.describe() == "rank 1 (drafter, node 0, local rank 1, pid 1001) raised ValueError: bad batch shape"
    _raise_and_record(tmp_path / "p.json", RuntimeError("Connection reset by peer"), monkeypatch, peer=True)
    p = _failure(0, 1, tmp_path / "p.json", "target")
    assert p.peer_lost and p.exception == "trainer.distributed.PeerLostError" and p.rank_class == 3


def test_signals_are_named_and_the_agents_sigterm_is_not_a_cause():
    killed = _failure(2, -signal.SIGKILL, None)
    assert killed.signal == "SIGKILL" and killed.message is None and killed.launcher_exit_code == 1
    assert killed.describe() == "rank 2 (drafter, node 0, local rank 2, pid 1002) was killed by SIGKILL"
    stopped = _failure(0, -signal.SIGTERM, None, "target")
    assert stopped.describe().endswith("was stopped by the launcher (SIGTERM)") and stopped.rank_class == 4
    assert _failure(1, -signal.SIGABRT, None).rank_class == 2 and _failure(1, 3, None).rank_class == 1


def test_root_cause_ranking(tmp_path, monkeypatch):
    _raise_and_record(tmp_path / "own.json", ValueError("nope"), monkeypatch)
    time.sleep(0.01)
    _raise_and_record(tmp_path / "peer.json", RuntimeError("Connection closed by peer"), monkeypatch, peer=True)
    time.sleep(0.01)
    _raise_and_record(tmp_path / "own2.json", KeyError("late"), monkeypatch)
    own, own_later = _failure(1, 1, tmp_path / "own.json"), _failure(2, 1, tmp_path / "own2.json")
    peer = _failure(0, -signal.SIGTERM, tmp_path / "peer.json", "target")  # raised, then stopped by the agent
    killed, stopped, aborted = _failure(2, -9, None), _failure(0, -15, None, "target"), _failure(0, -6, None, "target")
    assert root_cause([peer, own_later, own]) is own  # the earliest own exception, whatever the rank order
    assert root_cause([peer, stopped, killed]) is killed  # the peers only noticed that rank 2 was gone
    assert root_cause([aborted, killed]) is killed  # NCCL's watchdog abort is likely a consequence
    assert root_cause([stopped, peer]) is peer and root_cause([stopped]) is stopped
    with pytest.raises(ValueError):
        root_cause([])


def test_report_and_summary_name_the_cause_first_and_the_rest_as_consequences(tmp_path, monkeypatch):
    _raise_and_record(tmp_path / "own.json", ValueError("attention_backend 'flex' has no CPU backward"), monkeypatch)
    _raise_and_record(tmp_path / "peer.json", RuntimeError("Connection reset by peer"), monkeypatch, peer=True)
    found = [_failure(0, 1, tmp_path / "peer.json", "target"), _failure(1, 1, tmp_path / "own.json"),
             _failure(2, -15, None)]
    doc = report(found)
    assert doc["rank"] == 1 and doc["role"] == "drafter" and doc["exception"] == "builtins.ValueError"
    assert doc["summary"].endswith("raised ValueError: attention_backend 'flex' has no CPU backward")
    assert [(o["rank"], o["consequence"]) for o in doc["others"]] == [(0, True), (2, True)]
    path = write_report(tmp_path, doc)
    assert json.loads(path.read_text()) == doc and len(path.read_text().splitlines()) == 1
    lines = summary_lines(doc)
    assert lines[0] == "run failed: " + doc["summary"]
    assert lines[1] == f"its traceback (error file {tmp_path / 'own.json'}):"
    assert lines[2] == "  Traceback (most recent call last):" and lines[-3].startswith("  ValueError: attention_backend")
    assert lines[-2].startswith("also: rank 0 (target, node 0, local rank 0, pid 1000) raised PeerLostError: ")
    assert lines[-1].endswith("was stopped by the launcher (SIGTERM) (a consequence)")
