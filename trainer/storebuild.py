"""Writing a token store (its layout, and what opening it checks: trainer.store): building it from
conversation files, and receiving one sent by another node.

`build_store` takes a lock per key, splits the input files into chunks of lines, tokenises the chunks in
worker processes (`tokenize_conversation`, the skip report of each chunk merged in order: the same samples, in
the same order, as one pass), then concatenates the chunks into a temporary directory, fsyncs it and renames
it into place: a store is complete or absent, and a build killed half-way leaves only a temporary directory
that the next builder removes. `receive_store` writes a store that arrives as bytes the same way, keeping it
only if every file hashes to the sender's manifest.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from trainer.data import DataError, SkipReport, parse_line, tokenize
from trainer.store import (
    _IO_BLOCK, ARRAYS, FORMAT, MANIFEST, StoreError, TokenStore, _fix, open_store, store_dir, store_key,
)

LINES_PER_CHUNK = 4096
"""Conversations per worker task: small enough that 8 workers stay busy on a modest file, large enough
that the per-chunk cost (a task, a report, four files) is noise."""


# -- writing -----------------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _npy_header(dtype: Any, n: int) -> bytes:
    """The bytes of a .npy header for a 1-D array of n `dtype`s (the data follows it)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                               "fortran_order": False, "shape": (n,)})
    return buf.getvalue()


class _Hashed:
    """A file written once, front to back, with its sha256 and size counted as it goes."""

    def __init__(self, path: Path):
        self.path, self.f, self.h, self.bytes = path, open(path, "wb"), hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.h.update(data)
        self.bytes += len(data)

    def close(self) -> dict[str, Any]:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": self.bytes, "sha256": self.h.hexdigest()}


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary store directory into place (fsynced: a crash leaves it complete or absent)."""
    _fsync_dir(tmp)
    if final.exists():  # not a store (open_store refused it) or a stale copy: the new one replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def _clear_stale(root: Path, final: Path) -> None:
    """Remove the temporary directories of builds of `final` that died (the caller holds the key's lock)."""
    for stale in root.glob(f".tmp-{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


class _KeyLock:
    """One builder (or receiver) of a key at a time on this file system; flock ends with its process, so a
    killed builder blocks nobody."""

    def __init__(self, root: Path, final: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.file = open(root / f".{final.name}.lock", "w")

    def __enter__(self) -> "_KeyLock":
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.file.close()


# -- building ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """A run of lines of one input file: bytes [start, end), its first line's number."""

    index: int
    file_index: int
    path: str
    start: int
    end: int
    first_line: int


def _count_lines(path: str | Path) -> int:
    n = 0
    with open(path, "rb") as f:
        while block := f.read(_IO_BLOCK):
            n += block.count(b"\n")
    return n


def split_files(files: Sequence[str | Path], lines_per_chunk: int = LINES_PER_CHUNK) -> list[Chunk]:
    """Cut the input files into chunks of `lines_per_chunk` lines (one pass over each file's bytes)."""
    chunks: list[Chunk] = []
    for fi, path in enumerate(files):
        start, first, lines, pos = 0, 1, 0, 0
        with open(path, "rb") as f:
            for line in f:
                pos += len(line)
                lines += 1
                if lines % lines_per_chunk == 0:
                    chunks.append(Chunk(len(chunks), fi, str(path), start, pos, first))
                    start, first = pos, lines + 1
        if pos > start or not chunks or chunks[-1].file_index != fi:
            chunks.append(Chunk(len(chunks), fi, str(path), start, pos, first))
    return chunks


_WORKER: dict[str, Any] = {}
"""What the tokenising processes work with (tokenizer, max_len, min_supervised, kw): set before they fork."""


def _tokenize_chunk(chunk: Chunk, out_dir: str) -> tuple[int, int, int, SkipReport]:
    """Tokenise one chunk into <out_dir>/<index>.{ids,mask,len,line} raw files.

    Returns:
        (chunk index, samples, tokens, its skip report).
    """
    w = _WORKER
    report = SkipReport()
    base = Path(out_dir) / f"{chunk.index:06d}"
    files = {s: open(f"{base}.{s}", "wb") for s in ("ids", "mask", "len", "line")}
    n = t = 0
    try:
        with open(chunk.path, "rb") as f:
            f.seek(chunk.start)
            lineno = chunk.first_line
            while f.tell() < chunk.end:
                raw = f.readline()
                source = f"{chunk.path}:{lineno}"
                conv = parse_line(raw.decode("utf-8", errors="replace"), source, report)
                lineno += 1
                if conv is None:
                    continue
                got = tokenize([conv], w["tokenizer"], w["max_len"], report, min_supervised=w["min_supervised"],
                               chat_template_kwargs=w["kw"])
                if not got:
                    continue
                ids = np.asarray(got[0].input_ids, dtype=np.int64)
                if ids.size and (ids.max() >= 2**31 or ids.min() < 0):
                    raise DataError(f"{source}: token id {int(ids.max())} does not fit the store's int32 ids")
                files["ids"].write(ids.astype(np.int32).tobytes())
                files["mask"].write(np.asarray(got[0].loss_mask, dtype=np.uint8).tobytes())
                files["len"].write(np.int32(ids.size).tobytes())
                files["line"].write(np.int32(lineno - 1).tobytes())
                n, t = n + 1, t + int(ids.size)
    finally:
        for fh in files.values():
            fh.close()
    return chunk.index, n, t, report


def _copy_into(dst: _Hashed, src: Path) -> None:
    with open(src, "rb") as f:
        while block := f.read(_IO_BLOCK):
            dst.write(block)


def _concatenate(tmp: Path, parts: Path, chunks: list[Chunk], counts: list[tuple[int, int]]) -> dict[str, Any]:
    """The chunk files -> the store's .npy files in `tmp` (chunk order); returns the manifest's `files`."""
    n, t = sum(c[0] for c in counts), sum(c[1] for c in counts)
    out: dict[str, Any] = {}
    for name, suffix in (("ids.npy", "ids"), ("mask.npy", "mask"), ("lengths.npy", "len"), ("src_line.npy", "line")):
        h = _Hashed(tmp / name)
        h.write(_npy_header(ARRAYS[name], t if suffix in ("ids", "mask") else n))
        for c in chunks:
            _copy_into(h, parts / f"{c.index:06d}.{suffix}")
        out[name] = h.close()
    lengths = np.load(tmp / "lengths.npy", mmap_mode="r")
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    src_file = np.concatenate([np.full(cnt[0], c.file_index, dtype=np.int32) for c, cnt in zip(chunks, counts)]
                              or [np.zeros(0, dtype=np.int32)])
    for name, arr in (("offsets.npy", offsets), ("src_file.npy", src_file)):
        h = _Hashed(tmp / name)
        h.write(_npy_header(ARRAYS[name], arr.shape[0]))
        h.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
        out[name] = h.close()
    return out


def default_workers() -> int:
    """Worker processes for a build: the cores this process may use, at most 16."""
    return max(1, min(16, len(os.sched_getaffinity(0))))


def build_store(
    files: Sequence[str | Path],
    tokenizer: Any,
    root: str | Path,
    *,
    max_len: int,
    min_supervised: int = 2,
    chat_template_kwargs: dict[str, Any] | None = None,
    workers: int | None = None,
    lines_per_chunk: int | None = None,
    log: Callable[[str], None] = print,
) -> tuple[TokenStore, bool]:
    """Open the store of these inputs under `root`, building it first if no run built it yet.

    Args:
        files: jsonl conversation files (as trainer.data.read_conversations reads them), in order.
        tokenizer: the tokenizer (a fast one, with its chat template).
        root: the datasets root (`datasets_root`).
        workers: tokenising processes (default: `default_workers()`; one chunk or one worker: in this process).
        lines_per_chunk: lines per worker task (default: LINES_PER_CHUNK, fewer for a file that would not
            give every worker four chunks, at least 256).

    Returns:
        (the opened store, whether this call built it).

    Raises:
        DataError: an input file is missing, or no sample is usable (with the skip report).
        StoreError: a store of this key exists but is truncated or corrupt (the message says to delete it).
    """
    kw = dict(chat_template_kwargs or {})
    key, inputs = store_key(files, tokenizer, max_len=max_len, min_supervised=min_supervised, chat_template_kwargs=kw)
    root = Path(root)
    final = store_dir(root, key)
    if final.is_dir():
        return open_store(final, key), False
    with _KeyLock(root, final):
        if final.is_dir():  # built by another process while this one waited for the lock
            return open_store(final, key), False
        _clear_stale(root, final)
        t0 = time.time()
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        parts = tmp / "chunks"
        parts.mkdir(parents=True)
        nw = workers or default_workers()
        if lines_per_chunk is None:
            lines = sum(_count_lines(f) for f in files)
            lines_per_chunk = max(256, min(LINES_PER_CHUNK, -(-lines // (4 * nw))))
        chunks = split_files(files, lines_per_chunk)
        nw = min(nw, len(chunks))
        log(f"data: tokenising {len(files)} file(s) in {len(chunks)} chunk(s) with {nw} process(es) into {final}")
        results = _run_chunks(chunks, parts, tokenizer, max_len, min_supervised, kw, nw, log)
        report = SkipReport()
        for r in results:
            report.merge(r[3])
        counts = [(r[1], r[2]) for r in results]
        n, t = sum(c[0] for c in counts), sum(c[1] for c in counts)
        if not n:
            shutil.rmtree(tmp, ignore_errors=True)
            raise DataError(f"no usable training samples in {[str(f) for f in files]}: {report.summary()}")
        manifest = {
            "format": FORMAT, "key": key, "key_inputs": inputs, "samples": n, "tokens": t,
            "inputs": [str(f) for f in files], "skipped": report.to_dict(),
            "files": _concatenate(tmp, parts, chunks, counts),
            "built_at": time.time(), "build_s": round(time.time() - t0, 3), "workers": nw,
        }
        shutil.rmtree(parts)
        write_manifest(tmp, manifest)
        _publish(tmp, final)
        log(f"data: {n} samples, {t} tokens in {final} ({manifest['build_s']:.1f} s); {report.summary()}")
    return open_store(final, key), True


def write_manifest(tmp: Path, manifest: dict[str, Any]) -> None:
    """Write a store's manifest (fsynced) into its temporary directory: the last file of a store."""
    with open(tmp / MANIFEST, "w") as f:
        f.write(json.dumps(manifest, indent=1))
        f.flush()
        os.fsync(f.fileno())


def _run_chunks(chunks: list[Chunk], parts: Path, tokenizer: Any, max_len: int, min_supervised: int,
                kw: dict[str, Any], workers: int, log: Callable[[str], None]) -> list:
    """Tokenise every chunk (in `workers` forked processes, or here for one); results in chunk order."""
    import multiprocessing

    _WORKER.update(tokenizer=tokenizer, max_len=max_len, min_supervised=min_supervised, kw=kw)
    try:
        if workers <= 1:
            return [_tokenize_chunk(c, str(parts)) for c in chunks]
        # fork, as torch's DataLoader workers are made: the children inherit the tokenizer and start at once
        # (spawn re-imports torch and transformers, seconds per worker); they use neither torch nor CUDA, so
        # the parent's threads and CUDA context do not matter to them.
        ctx = multiprocessing.get_context("fork")
        results: list = [None] * len(chunks)
        last = time.time()
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            futures = [pool.submit(_tokenize_chunk, c, str(parts)) for c in chunks]
            for done, fut in enumerate(futures, start=1):
                r = fut.result()
                results[r[0]] = r
                if time.time() - last > 10:
                    log(f"data: tokenised {done}/{len(chunks)} chunks")
                    last = time.time()
        return results
    finally:
        _WORKER.clear()


# -- receiving (a store sent by another node) -----------------------------------------------------------
def receive_store(root: str | Path, manifest: dict[str, Any], read: Callable[[str, int], Iterable[bytes]]) -> TokenStore:
    """Write a store that arrives as bytes (from another node) under `root`, checking every file's sha256.

    Args:
        manifest: the sender's manifest.
        read: read(file name, its size) yields that file's bytes, in order (the caller's transport).

    Raises:
        StoreError: a file whose bytes do not hash to the manifest's sha256 (nothing is published then).
    """
    root = Path(root)
    final = store_dir(root, manifest["key"])
    with _KeyLock(root, final):
        _clear_stale(root, final)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            for name in ARRAYS:
                want = manifest["files"][name]
                h = _Hashed(tmp / name)
                for block in read(name, want["bytes"]):
                    h.write(block)
                got = h.close()
                if got != want:
                    raise StoreError(f"{final / name}: received {got['bytes']} bytes with sha256 {got['sha256'][:16]}.., "
                                     f"the sender's manifest says {want['bytes']} bytes, {want['sha256'][:16]}..; "
                                     "nothing was kept: run again (the store is sent again)")
            write_manifest(tmp, manifest)
            _publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return open_store(final, manifest["key"])


def read_file_blocks(path: Path, size: int, block: int = _IO_BLOCK) -> Iterator[bytes]:
    """A store file's bytes in blocks (what a sender sends)."""
    with open(path, "rb") as f:
        left = size
        while left > 0:
            data = f.read(min(block, left))
            if not data:
                raise StoreError(f"{path}: shorter than its manifest's {size} bytes; {_fix(path.parent)}")
            left -= len(data)
            yield data
