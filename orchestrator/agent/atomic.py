"""How the agent writes a file that a reader, or a crash, may catch half-way: whole or not at all. Standard
library only, importing nothing of the agent (the import check's record uses it too).

    write_bytes(path, data, mode)   bytes to `.<name>.<pid>-<thread>.tmp` beside `path`, flushed and fsynced, given
                                    exactly `mode`, renamed over `path` (atomic on one file system)
    write_json(path, obj, mode)     the same for one JSON document (indented, keys sorted, one final newline)

A reader sees the old file or the new one, never a mix, and a failed write leaves no temporary file. This is
the orchestrator's one atomic write: every file the agent writes for a reader (run.json, exit.json, stop.json,
the GPU claims, the env files, the records) goes through it, and so do the workstation's own state files
(records' printed offsets, the carried-wheels cache). The trainer, which imports nothing of the orchestrator,
has its own (trainer/atomic.py).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write bytes by temp file + fsync + rename: readers see the old file or the whole new one. The file gets
    exactly `mode` (the umask does not narrow it: the script copy is 0755, the env files 0600)."""
    # pid and thread: two writers of one file (the workstation's follow threads, two agent calls) never share one.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (a full disk) leaves nothing behind, not even its temp file
        raise


def write_json(path: Path, data: dict, mode: int = 0o644) -> None:
    """write_bytes of one JSON document: indented, keys sorted, what JSON cannot hold written as its str(),
    one final newline. Nothing is created when `data` cannot be written (a cycle): the text is made first."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
    write_bytes(path, text.encode("utf-8"), mode)
