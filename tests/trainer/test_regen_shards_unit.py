"""trainer.regen_shards on real files: a shard and its record written atomically with exact counts and hashes;
a restart's bookkeeping (a finished shard kept, one in flight removed, one of other inputs, unreadable,
missing, truncated or changed refused naming the file with an rm that works as printed); the manifest and
a complete dataset's files. Fast: what tests/mutation/run.py runs against regen_shards' mutants (the whole
stage, killed and restarted: tests/trainer/test_regenerate.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from trainer.data import Conversation, DataError
from trainer.regen_shards import (
    MANIFEST, RegenerateError, _input_digest, dataset_files, load_record, read_manifest, shard_name, write_shard,
)

CONVS = [Conversation([{"role": "user", "content": "hé"}, {"role": "assistant", "content": "a"}], "f.jsonl:1"),
         Conversation([{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}], "f.jsonl:2")]


def _run_fix(message: str, cwd) -> None:
    """Paste the printed `rm -- ...` into bash."""
    cmd = message.split("(rm -- ", 1)[1].split(")", 1)[0]
    subprocess.run(["bash", "-c", "rm -- " + cmd], cwd=cwd, check=True)


def test_a_shard_and_its_record_are_written_exactly_and_nothing_else_is_left(tmp_path):
    digest = _input_digest(CONVS)
    rec = write_shard(tmp_path, 3, CONVS, 17, digest)
    assert shard_name(3) == "shard-00003.jsonl" and shard_name(12345) == "shard-12345.jsonl"
    data = (tmp_path / "shard-00003.jsonl").read_bytes()
    assert data.decode("utf-8").splitlines() == [
        json.dumps({"messages": c.messages, "source": c.source}, ensure_ascii=False) for c in CONVS]
    assert "hé".encode() in data  # written as UTF-8, not escaped
    assert rec == {"index": 3, "file": "shard-00003.jsonl", "conversations": 2, "response_tokens": 17,
                   "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "input_sha256": digest}
    assert json.loads((tmp_path / "shard-00003.json").read_text()) == rec
    assert sorted(os.listdir(tmp_path)) == ["shard-00003.json", "shard-00003.jsonl"]  # no temporary left
    assert load_record(tmp_path, 3, digest) == rec
    # the input digest is the messages' (sources do not count), order-sensitive
    assert _input_digest(CONVS) == hashlib.sha256(json.dumps([c.messages for c in CONVS], sort_keys=True)
                                                  .encode()).hexdigest()
    assert _input_digest(CONVS[::-1]) != digest
    assert _input_digest([Conversation(CONVS[0].messages, "other")]) == _input_digest(CONVS[:1])
    # a re-write replaces both files
    rec2 = write_shard(tmp_path, 3, CONVS[:1], 5, "x")
    assert rec2["conversations"] == 1 and load_record(tmp_path, 3, "x") == rec2


def test_a_shard_in_flight_has_no_record_and_its_partial_file_is_removed(tmp_path):
    (tmp_path / shard_name(0)).write_text('{"messages": [')
    assert load_record(tmp_path, 0, "d") is None
    assert not (tmp_path / shard_name(0)).exists()
    assert load_record(tmp_path, 1, "d") is None  # never started: nothing to remove


def test_a_shard_of_other_inputs_is_refused_with_an_rm_that_works(tmp_path):
    write_shard(tmp_path, 0, CONVS, 3, _input_digest(CONVS))
    with pytest.raises(RegenerateError) as info:
        load_record(tmp_path, 0, _input_digest(CONVS[:1]))
    text = str(info.value)
    assert text.startswith(f"{tmp_path / 'shard-00000.json'}: the shard was made from other conversations than "
                           "shard 0 of these inputs")
    _run_fix(text, tmp_path)
    assert os.listdir(tmp_path) == [] and load_record(tmp_path, 0, "d") is None
    assert isinstance(info.value, DataError)


@pytest.mark.parametrize("body", ["{not json", "[]", '{"file": "shard-00000.jsonl", "bytes": 3}', "null"])
def test_an_unreadable_record_is_refused_naming_it_with_an_rm_that_works(tmp_path, body):
    write_shard(tmp_path, 0, CONVS, 3, "d")
    (tmp_path / "shard-00000.json").write_text(body)
    with pytest.raises(RegenerateError) as info:
        load_record(tmp_path, 0, "d")
    text = str(info.value)
    assert text.startswith(f"{tmp_path / 'shard-00000.json'}: unreadable shard record; delete it and its shard")
    _run_fix(text, tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_missing_truncated_or_changed_shard_is_named_and_its_fix_makes_the_stage_redo_it(tmp_path):
    rec = write_shard(tmp_path, 0, CONVS, 3, "d")
    f = tmp_path / shard_name(0)
    data = f.read_bytes()

    f.write_bytes(data[:-1])
    with pytest.raises(RegenerateError, match=r"shard-00000\.jsonl: truncated; delete it and its record \(rm -- "):
        load_record(tmp_path, 0, "d")
    f.write_bytes(data[:-1] + b"X")  # same size, other bytes
    with pytest.raises(RegenerateError, match=r"corrupt \(its sha256 differs from its record\)"):
        load_record(tmp_path, 0, "d")
    f.write_bytes(data + b"\n")  # longer
    with pytest.raises(RegenerateError, match=r"shard-00000\.jsonl: corrupt"):
        load_record(tmp_path, 0, "d")
    f.unlink()
    with pytest.raises(RegenerateError) as info:
        load_record(tmp_path, 0, "d")
    text = str(info.value)
    assert text.startswith(f"{f}: the shard is missing but its record shard-00000.json says it was written; "
                           "delete it and its record (rm -- ")
    assert text.endswith("and run the stage again: that shard is regenerated")
    f.write_bytes(data)
    assert load_record(tmp_path, 0, "d") == rec  # intact again
    f.write_bytes(data[:-1])
    with pytest.raises(RegenerateError) as info:
        load_record(tmp_path, 0, "d")
    _run_fix(str(info.value), tmp_path)
    assert os.listdir(tmp_path) == [] and load_record(tmp_path, 0, "d") is None


def _dataset(tmp_path, complete=True):
    recs = [write_shard(tmp_path, i, CONVS[i:i + 1], i, "d") for i in range(2)]
    (tmp_path / MANIFEST).write_text(json.dumps({"complete": complete, "shards": recs}))
    return recs


def test_a_complete_datasets_files_are_its_shards_in_order_each_checked(tmp_path):
    recs = _dataset(tmp_path)
    assert dataset_files(tmp_path) == [tmp_path / "shard-00000.jsonl", tmp_path / "shard-00001.jsonl"]
    assert read_manifest(tmp_path)["shards"] == recs
    assert read_manifest(tmp_path / MANIFEST)["shards"] == recs
    (tmp_path / "shard-00001.jsonl").write_bytes(b"")
    with pytest.raises(RegenerateError, match=r"shard-00001\.jsonl: truncated"):
        dataset_files(tmp_path)


def test_an_unfinished_dataset_is_refused_with_the_command_that_finishes_it(tmp_path):
    _dataset(tmp_path, complete=False)
    with pytest.raises(RegenerateError) as info:
        dataset_files(tmp_path)
    assert str(info.value) == (f"{tmp_path}: the regeneration is not finished; run the stage again to finish it: "
                               "python -m trainer regenerate CONFIG")
    (tmp_path / MANIFEST).write_text(json.dumps({"shards": []}))
    with pytest.raises(RegenerateError, match="not finished"):
        dataset_files(tmp_path)


def test_a_missing_or_unreadable_manifest_is_named_with_its_fix(tmp_path):
    with pytest.raises(RegenerateError) as info:
        read_manifest(tmp_path)
    assert str(info.value) == (f"{tmp_path / MANIFEST}: no regenerated dataset there (no manifest); run the "
                               "stage: python -m trainer regenerate CONFIG")
    ds = tmp_path / "my dataset"
    ds.mkdir()
    (ds / MANIFEST).write_text("{half")
    with pytest.raises(RegenerateError) as info:
        read_manifest(ds)
    text = str(info.value)
    assert text.startswith(f"{ds / MANIFEST}: unreadable manifest (")
    cmd = text.split("delete the dataset directory (", 1)[1].split(") and run the stage again", 1)[0]
    subprocess.run(["bash", "-c", cmd], cwd=tmp_path, check=True)
    assert not ds.exists()
