"""The files of a regenerated dataset (trainer.regenerate): shards and their records, written atomically;
the manifest; every check that a finished shard is still the one written (size, sha256), with errors that
name the file and print the rm that makes the stage redo it."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path
from typing import Any, Sequence

from trainer.data import Conversation, DataError
from trainer.store import file_sha256

MANIFEST = "manifest.json"


class RegenerateError(DataError):
    """The stage cannot produce the dataset: a corrupt shard, an engine that died or hung, a busy dataset.
    The message names the file or the engine and the fix."""


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temporary name, fsync, rename over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.jsonl"


def _record_path(out: Path, index: int) -> Path:
    return out / f"shard-{index:05d}.json"


def _input_digest(convs: Sequence[Conversation]) -> str:
    return hashlib.sha256(json.dumps([c.messages for c in convs], sort_keys=True).encode()).hexdigest()


def write_shard(out: Path, index: int, convs: Sequence[Conversation], tokens: int, input_sha256: str) -> dict[str, Any]:
    """Write one finished shard: its jsonl, then its record (each atomically). Returns the record."""
    body = "".join(json.dumps({"messages": c.messages, "source": c.source}, ensure_ascii=False) + "\n" for c in convs)
    data = body.encode("utf-8")
    _write_atomic(out / shard_name(index), data)
    record = {"index": index, "file": shard_name(index), "conversations": len(convs), "response_tokens": tokens,
              "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "input_sha256": input_sha256}
    _write_atomic(_record_path(out, index), json.dumps(record, indent=1).encode())
    return record


def _rm_fix(*paths: Path) -> str:
    return f"rm -- {' '.join(shlex.quote(str(p)) for p in paths)}"


def _check_shard(out: Path, record: dict[str, Any]) -> None:
    """A finished shard's jsonl matches its record (size, sha256).

    Raises:
        RegenerateError: missing, truncated or changed; the fix removes it so the stage redoes it.
    """
    f = out / record["file"]
    rec = _record_path(out, record["index"])
    fix = f"delete it and its record ({_rm_fix(f, rec)}) and run the stage again: that shard is regenerated"
    if not f.is_file():
        raise RegenerateError(f"{f}: the shard is missing but its record {rec.name} says it was written; {fix}")
    size = f.stat().st_size
    if size != record["bytes"] or file_sha256(f) != record["sha256"]:
        what = "truncated" if size < record["bytes"] else "corrupt (its sha256 differs from its record)"
        raise RegenerateError(f"{f}: {what}; {fix}")


def load_record(out: Path, index: int, input_sha256: str) -> dict[str, Any] | None:
    """The record of a finished, intact shard; None if the shard was never finished (in flight when the
    stage stopped: its partial jsonl, if any, is removed).

    Raises:
        RegenerateError: a record or shard that is unreadable, corrupt, or of other inputs.
    """
    rec = _record_path(out, index)
    if not rec.is_file():
        (out / shard_name(index)).unlink(missing_ok=True)
        return None
    try:
        record = json.loads(rec.read_text())
        record["file"], record["bytes"], record["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        raise RegenerateError(f"{rec}: unreadable shard record; delete it and its shard "
                              f"({_rm_fix(rec, out / shard_name(index))}) and run the stage again") from None
    if record.get("input_sha256") != input_sha256:
        raise RegenerateError(f"{rec}: the shard was made from other conversations than shard {index} of these "
                              f"inputs; delete it ({_rm_fix(rec, out / shard_name(index))}) and run the stage again")
    _check_shard(out, record)
    return record


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A dataset's manifest (path: the dataset directory or its manifest.json).

    Raises:
        RegenerateError: missing or unreadable.
    """
    p = Path(path)
    p = p / MANIFEST if p.is_dir() else p
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise RegenerateError(f"{p}: no regenerated dataset there (no manifest); run the stage: "
                              "python -m trainer regenerate CONFIG") from None
    except (OSError, ValueError) as exc:
        raise RegenerateError(f"{p}: unreadable manifest ({exc}); delete the dataset directory "
                              f"(rm -r -- {shlex.quote(str(p.parent))}) and run the stage again") from None


def dataset_files(path: str | Path) -> list[Path]:
    """The shard files of a COMPLETE regenerated dataset, in order, each checked against the manifest.

    Raises:
        RegenerateError: not complete, or a shard missing, truncated or corrupt (the message names it).
    """
    out = Path(path)
    m = read_manifest(out)
    if not m.get("complete"):
        raise RegenerateError(f"{out}: the regeneration is not finished; run the stage again to finish it: "
                              "python -m trainer regenerate CONFIG")
    for record in m["shards"]:
        _check_shard(out, record)
    return [out / r["file"] for r in m["shards"]]
