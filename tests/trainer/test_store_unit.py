"""The token store's key, checks and files at their edges, exactly: every input of the key counts (and a copy
elsewhere does not), each refusal of open_store names its file and a fix that works as printed, the chunks and
.npy files of a build byte for byte, the publish over a leftover. Small stores built in this process (one
worker); what tests/mutation/run.py runs against the store's mutants with tests/trainer/test_store.py."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from trainer.data import DataError
from trainer.store import (
    ARRAYS, FORMAT, MANIFEST, StoreError, datasets_root, file_sha256, open_store, store_dir, store_key,
    tokenizer_identity, verify,
)
from trainer.storebuild import Chunk, _clear_stale, _count_lines, _npy_header, _publish, build_store, split_files
from trainer.tiny import build_tokenizer
from tests.trainer.test_store import CFG, list_path, write_conversations


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CFG)


def quiet(_):
    pass


def test_datasets_root_env_then_the_workdirs_then_the_run_dirs(tmp_path):
    run = tmp_path / "w" / "runs" / "a-1"
    assert datasets_root(run, {}) == tmp_path / "w" / "datasets"
    assert datasets_root(tmp_path / "by-hand", {}) == tmp_path / "by-hand" / "datasets"
    assert datasets_root(run, {"DFLASH_DATASETS_DIR": str(tmp_path / "d")}) == tmp_path / "d"
    assert datasets_root(run, {"DFLASH_DATASETS_DIR": ""}) == tmp_path / "w" / "datasets"  # empty: unset
    assert datasets_root(Path("rel") / "runs" / "x", {}) == Path("rel").absolute() / "datasets"


def test_the_key_counts_content_order_tokenizer_arguments_and_limits_not_names(tmp_path, tok):
    a = write_conversations(tmp_path / "a.jsonl", 5, 1)
    b = write_conversations(tmp_path / "b.jsonl", 5, 2)
    key, inputs = store_key([a, b], tok, max_len=80)
    assert inputs == {"format": FORMAT, "files": [file_sha256(a), file_sha256(b)], "tokenizer": tokenizer_identity(tok),
                      "chat_template_kwargs": {}, "max_len": 80, "min_supervised": 2}
    assert key == hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    assert file_sha256(a) == hashlib.sha256(a.read_bytes()).hexdigest()
    copy = tmp_path / "elsewhere" / "renamed.jsonl"
    copy.parent.mkdir()
    shutil.copy(a, copy)
    assert store_key([copy, b], tok, max_len=80)[0] == key  # by content, not name
    others = [store_key([b, a], tok, max_len=80), store_key([a], tok, max_len=80),
              store_key([a, b], tok, max_len=81), store_key([a, b], tok, max_len=80, min_supervised=3),
              store_key([a, b], tok, max_len=80, chat_template_kwargs={"enable_thinking": False})]
    assert len({key, *(k for k, _ in others)}) == 6
    assert others[4][1]["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(DataError, match=r"nope\.jsonl: no such data file \(check data\.train_files in the config\)"):
        store_key([a, tmp_path / "nope.jsonl"], tok, max_len=80)
    assert store_dir(tmp_path, key) == tmp_path / f"tokens-{key[:24]}"


def test_a_slow_tokenizer_has_no_identity_and_the_identity_reads_its_template_and_specials(tok):
    class Slow:
        pass

    with pytest.raises(DataError, match="Slow is not a fast tokenizer; use PreTrainedTokenizerFast"):
        tokenizer_identity(Slow())
    ident = tokenizer_identity(tok)
    parts = {"tokenizer": tok.backend_tokenizer.to_str(), "chat_template": tok.chat_template,
             "special": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())}}
    assert ident == hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    saved = tok.chat_template
    try:
        tok.chat_template = (saved or "") + "{# changed #}"
        assert tokenizer_identity(tok) != ident
    finally:
        tok.chat_template = saved


def test_files_are_cut_in_chunks_of_whole_lines_with_their_first_line_numbers(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_bytes(b"1\n22\n333\n4444\n55555\n")
    b = tmp_path / "b.jsonl"
    b.write_bytes(b"x\ny")  # no final newline
    e = tmp_path / "e.jsonl"
    e.write_bytes(b"")
    assert split_files([a, b], 2) == [
        Chunk(0, 0, str(a), 0, 5, 1), Chunk(1, 0, str(a), 5, 14, 3), Chunk(2, 0, str(a), 14, 20, 5),
        Chunk(3, 1, str(b), 0, 3, 1)]
    assert split_files([a], 5) == [Chunk(0, 0, str(a), 0, 20, 1)]  # exactly one full chunk, no empty tail
    assert split_files([a], 100) == [Chunk(0, 0, str(a), 0, 20, 1)]
    assert split_files([e, a], 3) == [Chunk(0, 0, str(e), 0, 0, 1), Chunk(1, 1, str(a), 0, 9, 1),
                                      Chunk(2, 1, str(a), 9, 20, 4)]
    assert split_files([a, e], 5)[-1] == Chunk(1, 1, str(e), 0, 0, 1)  # an empty file still has its chunk
    assert _count_lines(a) == 5 and _count_lines(b) == 1 and _count_lines(e) == 0


def test_a_built_store_is_exactly_the_list_path_in_npy_files_the_manifest_hashes(tmp_path, tok):
    files = [write_conversations(tmp_path / "a.jsonl", 30, 1, bad_every=7), write_conversations(tmp_path / "b.jsonl", 9, 2)]
    logs: list[str] = []
    store, built = build_store(files, tok, tmp_path / "ds", max_len=60, workers=1, lines_per_chunk=8, log=logs.append)
    want, report = list_path(files, tok, 60)
    assert built and len(store) == len(want) and store.num_tokens == sum(len(s) for s in want)
    assert logs[0].startswith(f"data: tokenising 2 file(s) in 6 chunk(s) with 1 process(es) into {store.path}")
    assert logs[-1].startswith(f"data: {len(want)} samples, {store.num_tokens} tokens in {store.path} (")
    assert [(s.input_ids.tolist(), s.loss_mask.tolist(), s.source) for s in store] == [
        (w.input_ids, w.loss_mask, w.source) for w in want]
    assert store.skipped == report.to_dict() and store.key == store.manifest["key"]
    m = store.manifest
    assert (m["format"], m["samples"], m["tokens"], m["inputs"], m["workers"]) == (
        FORMAT, len(want), store.num_tokens, [str(f) for f in files], 1)
    assert m["key"] == store_key(files, tok, max_len=60)[0] and m["key_inputs"] == store_key(files, tok, max_len=60)[1]
    for name, dtype in ARRAYS.items():
        f = store.path / name
        assert m["files"][name] == {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
        arr = np.load(f)
        assert arr.dtype == np.dtype(dtype)
        assert f.read_bytes()[:len(_npy_header(dtype, arr.shape[0]))] == _npy_header(dtype, arr.shape[0])
    assert store.offsets.tolist() == [0, *np.cumsum([len(w) for w in want]).tolist()]
    assert store.lengths.tolist() == [len(w) for w in want]
    assert store.src_file.tolist() == [0 if w.source.startswith(str(files[0])) else 1 for w in want]
    assert sorted(p.name for p in store.path.iterdir()) == sorted([*ARRAYS, MANIFEST])  # no chunks left
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == [f".{store.path.name}.lock", store.path.name]
    # found again by its key: not rebuilt
    again, built = build_store(files, tok, tmp_path / "ds", max_len=60, workers=1, log=logs.append)
    assert not built and again.path == store.path and len(again) == len(store)
    assert verify(store.path).path == store.path


def test_a_build_with_no_usable_sample_is_a_data_error_and_leaves_nothing(tmp_path, tok):
    f = tmp_path / "bad.jsonl"
    f.write_text("{not json\n" * 3)
    with pytest.raises(DataError, match=r"no usable training samples in \[.*bad\.jsonl'\]: "):
        build_store([f], tok, tmp_path / "ds", max_len=60, workers=1, log=quiet)
    assert [p.name for p in (tmp_path / "ds").iterdir() if not p.name.endswith(".lock")] == []


def test_a_dead_builds_leftovers_of_this_key_only_are_cleared_and_a_non_store_is_replaced(tmp_path, tok):
    f = write_conversations(tmp_path / "a.jsonl", 6)
    root = tmp_path / "ds"
    key, _ = store_key([f], tok, max_len=60)
    final = store_dir(root, key)
    (root / f".tmp-{final.name}-99999" / "chunks").mkdir(parents=True)
    (root / ".tmp-tokens-other-1").mkdir()
    _clear_stale(root, final)
    assert sorted(p.name for p in root.iterdir()) == [".tmp-tokens-other-1"]
    tmp = root / "t"
    tmp.mkdir()
    (tmp / "x").write_text("new")
    final.mkdir()
    (final / "junk").write_text("old")
    _publish(tmp, final)
    assert not tmp.exists() and [p.name for p in final.iterdir()] == ["x"]


def _built(tmp_path, tok):
    f = write_conversations(tmp_path / "a.jsonl", 12)
    store, _ = build_store([f], tok, tmp_path / "ds", max_len=80, workers=1, log=quiet)
    return store


def _refusal_fix_works(err: StoreError, path: Path) -> None:
    text = str(err)
    assert text.endswith(f"delete it (rm -r -- {path}) and run again: it is rebuilt")
    cmd = text.split("(rm -r -- ", 1)[1].split(") and run again", 1)[0]
    subprocess.run(["bash", "-c", f"rm -r -- {cmd}"], check=True)
    assert not path.exists()


def test_each_refusal_of_open_names_the_file_and_its_fix(tmp_path, tok):
    with pytest.raises(StoreError) as info:
        open_store(tmp_path / "none")
    assert str(info.value) == f"{tmp_path / 'none'}: no token store there (no such directory)"

    store = _built(tmp_path, tok)
    p, mf = store.path, store.path / MANIFEST
    good = json.loads(mf.read_text())
    for bad, what in [("{half", "unreadable manifest ("), ("[]", "not a token store manifest (missing fields or files)"),
                      (json.dumps({k: v for k, v in good.items() if k != "skipped"}), "not a token store manifest"),
                      (json.dumps({**good, "files": {k: v for k, v in good["files"].items() if k != "src_line.npy"}}),
                       "not a token store manifest"),
                      (json.dumps({**good, "format": FORMAT + 1}), f"store format {FORMAT + 1}, this trainer reads {FORMAT}")]:
        mf.write_text(bad)
        with pytest.raises(StoreError) as info:
            open_store(p)
        assert str(info.value).startswith(f"{mf}: {what}"), str(info.value)
        assert str(info.value).endswith(f"; delete it (rm -r -- {p}) and run again: it is rebuilt")
    mf.write_text(json.dumps(good))
    open_store(p, good["key"])
    with pytest.raises(StoreError) as info:
        open_store(p, "f" * 64)
    assert str(info.value).startswith(f"{mf}: the manifest's key {good['key'][:24]} is not the key {'f' * 24} this "
                                      "store was looked up by; ")

    lengths = p / "lengths.npy"
    data = lengths.read_bytes()
    lengths.unlink()
    with pytest.raises(StoreError) as info:
        open_store(p)
    assert str(info.value).startswith(f"{lengths}: missing: the token store is truncated or corrupt; ")
    lengths.write_bytes(data[:-4])
    with pytest.raises(StoreError) as info:
        open_store(p)
    assert str(info.value).startswith(f"{lengths}: {len(data) - 4} bytes, the manifest says {len(data)}: ")
    lengths.write_bytes(b"\0" * len(data))  # the right size, not a .npy file
    with pytest.raises(StoreError) as info:
        open_store(p)
    assert str(info.value).startswith(f"{lengths}: not a readable .npy file (")
    # the right size and a .npy header, but another dtype: int32 N -> uint32 N (same bytes)
    arr = np.load(p / "src_file.npy")
    np.save(lengths, arr.astype(np.uint32))
    with pytest.raises(StoreError) as info:
        open_store(p)
    assert str(info.value).startswith(f"{lengths}: uint32 ({len(arr)},), the manifest says int32 ({len(arr)},); ")
    np.save(lengths, np.load(p / "src_line.npy"))
    open_store(p)

    # offsets that do not end at the tokens: the same size, the last one off by one
    offsets = p / "offsets.npy"
    o = np.load(offsets)
    o[-1] += 1
    np.save(offsets, o)
    with pytest.raises(StoreError) as info:
        open_store(p)
    assert str(info.value).startswith(f"{offsets}: ends at {int(o[-1])}, not at the {good['tokens']} tokens of ids.npy; ")
    _refusal_fix_works(info.value, p)


def test_an_array_of_another_length_is_refused_with_the_manifests_shape(tmp_path, tok):
    store = _built(tmp_path, tok)
    p, m = store.path, store.manifest
    for name, n in (("ids.npy", m["tokens"]), ("mask.npy", m["tokens"]), ("offsets.npy", m["samples"] + 1),
                    ("lengths.npy", m["samples"]), ("src_file.npy", m["samples"]), ("src_line.npy", m["samples"])):
        f = p / name
        data = f.read_bytes()
        arr = np.load(f)
        # one element fewer, padded back to the manifest's size with a header that says so: size checks pass
        short = np.zeros(n - 1, dtype=arr.dtype)
        hdr = _npy_header(arr.dtype, n - 1)
        body = hdr + short.tobytes()
        f.write_bytes(body + b"\0" * (len(data) - len(body)))
        with pytest.raises(StoreError) as info:
            open_store(p)
        assert str(info.value).startswith(f"{f}: {arr.dtype} ({n - 1},), the manifest says {arr.dtype} ({n},); "), name
        f.write_bytes(data)
    open_store(p)


def test_verify_names_the_corrupt_file_by_both_hashes(tmp_path, tok):
    store = _built(tmp_path, tok)
    for name in ARRAYS:
        f = store.path / name
        data = f.read_bytes()
        at = len(_npy_header(ARRAYS[name], np.load(f).shape[0]))  # the first element (offsets' last is checked on open)
        f.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
        with pytest.raises(StoreError) as info:
            verify(store.path)
        want = store.manifest["files"][name]["sha256"]
        assert str(info.value).startswith(f"{f}: sha256 {file_sha256(f)[:16]}.. is not the manifest's {want[:16]}..: "
                                          "the file is corrupt; delete it (rm -r -- "), name
        f.write_bytes(data)
    verify(store.path)


def test_every_refusal_ends_with_the_fix_for_this_store_and_the_environment_is_read_by_default(tmp_path, tok,
                                                                                             monkeypatch):
    store = _built(tmp_path, tok)
    p = store.path
    fix = f"delete it (rm -r -- {p}) and run again: it is rebuilt"
    good = json.loads((p / MANIFEST).read_text())

    def refusal(call, *args):
        with pytest.raises(StoreError) as info:
            call(*args)
        return str(info.value)

    assert refusal(open_store, p, "e" * 64).endswith(fix)
    (p / MANIFEST).write_text(json.dumps({k: good[k] for k in ("format", "key", "samples", "tokens", "files",
                                                                "inputs", "skipped")}))
    assert len(open_store(p)) == good["samples"]  # exactly the fields it needs: a store
    ids = p / "ids.npy"
    data = ids.read_bytes()
    ids.write_bytes(data[:-4])
    text = refusal(open_store, p)
    assert "the token store is truncated or corrupt" in text and text.endswith(fix)
    ids.write_bytes(b"\0" * len(data))
    text = refusal(open_store, p)
    assert "not a readable .npy file" in text and text.endswith(fix)
    np.save(ids, np.zeros(good["tokens"], dtype=np.int64)[: good["tokens"] // 2])  # another dtype and length
    ids.write_bytes(ids.read_bytes().ljust(len(data), b"\0")[: len(data)])
    text = refusal(open_store, p)
    assert f"int64 ({good['tokens'] // 2},), the manifest says int32" in text and text.endswith(fix)
    ids.write_bytes(data)
    mask = p / "mask.npy"
    raw = bytearray(mask.read_bytes())
    raw[-1] ^= 1
    mask.write_bytes(bytes(raw))
    assert refusal(verify, p).endswith(fix)
    (p / MANIFEST).unlink()
    assert refusal(open_store, p) == f"{p / MANIFEST}: no manifest: {p} is not a complete token store; {fix}"
    monkeypatch.setenv("DFLASH_DATASETS_DIR", str(tmp_path / "from-env"))
    assert datasets_root(tmp_path / "w" / "runs" / "a-1") == tmp_path / "from-env"


def test_chunks_are_cut_at_byte_offsets_in_a_file_that_is_not_ascii(tmp_path):
    a = tmp_path / "u.jsonl"
    a.write_bytes("é\nüü\nx\n".encode())  # 3, 5 and 2 bytes
    assert split_files([a], 2) == [Chunk(0, 0, str(a), 0, 8, 1), Chunk(1, 0, str(a), 8, 10, 3)]
