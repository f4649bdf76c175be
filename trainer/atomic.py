"""How the trainer writes a file that a reader, or a crash, may catch half-way: whole or not at all.

    write_atomic(path, data)   text or bytes to `<name>.tmp-<pid>` beside `path`, flushed and fsynced, renamed
                               over `path` (atomic on one file system), then the directory fsynced
    write_json(path, obj)      the same for one JSON document (indented; `indent=None`: one line)
    write_lines(path, lines)   the same for lines streamed from an iterable (a large jsonl file)
    fsync_file, fsync_dir      for writers of a whole directory (checkpoints, the export): every file, then the
                               directory entry of the rename (a power cut can forget a rename without it)

A reader sees the old file or the new one, never a mix; a writer killed half-way leaves only its
`*.tmp-<pid>` file, which trainer.faults.clear_stale_temps removes once that pid is gone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable


def fsync_file(path: str | Path) -> None:
    """Flush a written file's data to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename into it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: str | Path, fill: Callable[[BinaryIO], object]) -> Path:
    p = Path(path)
    tmp = p.with_name(f"{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind, not even its temporary file
        raise
    fsync_dir(p.parent)
    return p


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write text (UTF-8) or bytes to `path`, whole or not at all."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return _write(path, lambda f: f.write(raw))


def write_lines(path: str | Path, lines: Iterable[str]) -> Path:
    """Write the lines (each with its own line end) to `path` as UTF-8, whole or not at all."""

    def fill(f: BinaryIO) -> None:
        for line in lines:
            f.write(line.encode("utf-8"))

    return _write(path, fill)


def write_json(path: str | Path, obj: Any, indent: int | None = 2, end: str = "") -> Path:
    """Write `obj` as JSON to `path`, whole or not at all (`end`: what follows the document, e.g. a newline)."""
    return write_atomic(path, json.dumps(obj, indent=indent) + end)
