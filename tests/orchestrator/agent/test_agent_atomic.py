"""The agent's one atomic write (orchestrator.agent.atomic): a reader sees the old file or the whole new one,
the file gets exactly its mode whatever the umask, and a document that cannot be written leaves the old file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.agent import atomic


def test_the_mode_is_exact_whatever_the_umask_and_no_temp_file_is_left(tmp_path):
    old = os.umask(0o077)
    try:
        atomic.write_bytes(tmp_path / "script.sh", b"#!/bin/sh\n", 0o755)
        atomic.write_json(tmp_path / "run.json", {"a": 1})
        atomic.write_bytes(tmp_path / "launch.env0", b"K=V\0", 0o600)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"script.sh": 0o755, "run.json": 0o644, "launch.env0": 0o600}


def test_json_is_indented_sorted_with_one_final_newline_and_str_for_what_json_cannot_hold(tmp_path):
    path = tmp_path / "exit.json"
    atomic.write_json(path, {"b": 1, "a": tmp_path})
    assert path.read_text() == '{\n  "a": "%s",\n  "b": 1\n}\n' % tmp_path


def test_a_document_that_cannot_be_written_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "gpus.json"
    atomic.write_json(path, {"0": "old"})
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError):
        atomic.write_json(path, loop)
    assert json.loads(path.read_text()) == {"0": "old"} and os.listdir(tmp_path) == ["gpus.json"]


def test_a_reader_in_another_process_sees_only_whole_files(tmp_path):
    """A real reader process reads the file as fast as it can while it is rewritten with documents of
    different sizes: every read parses and is one of the documents written."""
    path = tmp_path / "claims.json"
    docs = [{"n": i, "pad": "x" * (i * 7919 % 200_000)} for i in range(60)]
    atomic.write_json(path, docs[0])
    reader = subprocess.Popen([sys.executable, "-c", (
        "import json, sys, os\n"
        "seen, bad = set(), 0\n"
        "while not os.path.exists(sys.argv[2]):\n"
        "    try:\n        seen.add(json.loads(open(sys.argv[1]).read())['n'])\n"
        "    except ValueError:\n        bad += 1\n"
        "print(json.dumps({'seen': sorted(seen), 'bad': bad}))\n"), str(path), str(tmp_path / "done")],
        stdout=subprocess.PIPE, text=True)
    for doc in docs * 3:
        atomic.write_json(path, doc)
    (tmp_path / "done").touch()
    out = json.loads(reader.communicate(timeout=60)[0])
    assert out["bad"] == 0 and len(out["seen"]) > 1 and set(out["seen"]) <= {d["n"] for d in docs}


def test_a_write_that_fails_at_its_rename_leaves_no_temp_file(tmp_path):
    """A write whose rename fails (here a directory stands where the file goes, as a full disk or a read-only
    mount fails a writer part way) raises, and leaves nothing beside the path: no `.NAME.*.tmp`."""
    (tmp_path / "exit.json").mkdir()
    with pytest.raises(OSError):
        atomic.write_json(tmp_path / "exit.json", {"exit_code": 0})
    assert os.listdir(tmp_path) == ["exit.json"]


def test_two_threads_writing_one_file_each_leave_a_whole_document(tmp_path):
    """The workstation writes a run's printed offset from several follow threads: two threads writing the same
    file at once never share a temporary file, so every write lands whole."""
    import threading

    path = tmp_path / "printed.json"
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(200):
                atomic.write_json(path, {"writer": n, "i": i, "pad": "x" * (n * 5000)})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and json.loads(path.read_text())["i"] == 199 and os.listdir(tmp_path) == ["printed.json"]
