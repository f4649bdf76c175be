"""The token store: a run's tokenised samples as flat arrays in files, memory-mapped by every rank.

    <datasets root>/tokens-<key>/      one store per content key (`store_key`)
        manifest.json                  format, key and what it was made of, counts, each file's bytes and sha256,
                                       the skip report, the input files, build time
        ids.npy     int32  [T]         token ids of every sample, back to back (T tokens in all)
        mask.npy    uint8  [T]         loss mask (1 on assistant tokens)
        offsets.npy int64  [N + 1]     sample i is ids[offsets[i]:offsets[i + 1]]
        lengths.npy int32  [N]         tokens per sample (what trainer.packing.plan_epoch packs)
        src_file.npy int32 [N]         index into the manifest's `inputs` of the sample's file
        src_line.npy int32 [N]         its line in that file ("file:line", as a Sample's source)
    <datasets root>/.tmp-tokens-<key>-<pid>/   a build in progress (never opened; removed by the next builder)
    <run>/data/store.json              the run's pointer to its store (a resumed run opens the same one)

This module is what a rank opens and trusts: the key, opening and verifying a store, the run's pointer and the
`verify` command. Writing a store (building it from conversation files, receiving it from another node) is
trainer.storebuild, which imports this module (never the reverse).

Why numpy memmap, not Arrow (HF `datasets`): the arrays are flat and fixed-width, so `.npy` files and
`np.load(mmap_mode="r")` are the whole format: zero-copy slices, the kernel's page cache shared by every rank
of a node (8 ranks map one copy), no dependency beyond numpy, and a file is checked by its size and its
sha256. Arrow would bring pyarrow (and `datasets`' cache rules, fingerprints and its own lock files) to store
the same two columns; its nested list columns buy nothing for token ids that are only ever sliced.

Built once per key: (the input files' content, the tokenizer and its chat template, the chat-template
arguments, max_len, min_supervised, the format); trainer.storebuild says how.

Opening checks every file's size against the manifest (cheap); the full sha256 is checked when a store is
received from another node and by `verify` (`python -m trainer.store verify DIR`). A truncated or corrupt
store is a StoreError naming the file and the fix (delete the store directory: it is rebuilt).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from trainer.atomic import write_json
from trainer.data import DataError, Sample

FORMAT = 1
"""Bump when the layout of a store or the tokenisation rules change: old stores are then not reused."""

DATASETS_ENV = "DFLASH_DATASETS_DIR"
"""Overrides where datasets (regenerated conversations, token stores) live."""

POINTER = Path("data") / "store.json"
"""A run's pointer to its token store, relative to the run directory."""

MANIFEST = "manifest.json"

# name -> dtype of the array files (all 1-D).
ARRAYS = {
    "ids.npy": np.int32,
    "mask.npy": np.uint8,
    "offsets.npy": np.int64,
    "lengths.npy": np.int32,
    "src_file.npy": np.int32,
    "src_line.npy": np.int32,
}

_IO_BLOCK = 16 << 20


class StoreError(DataError):
    """A token store is missing, truncated, corrupt or not the one asked for; the message names the file and
    the fix."""


def datasets_root(run_dir: str | Path, environ: dict[str, str] | None = None) -> Path:
    """Where the datasets of a run's target live: $DFLASH_DATASETS_DIR if set, else `<workdir>/datasets` for a
    run directory laid out as `<workdir>/runs/<run-id>` (the orchestrator's), else `<run dir>/datasets` (a run
    started by hand keeps its datasets inside itself).

    The one rule for that place: the token store and the regenerated datasets both live under it, keyed by
    their content, so every run of the target with the same key reuses them.
    """
    env = os.environ if environ is None else environ
    if env.get(DATASETS_ENV):
        return Path(env[DATASETS_ENV])
    run = Path(run_dir).absolute()
    if run.parent.name == "runs":
        return run.parent.parent / "datasets"
    return run / "datasets"


def _fix(path: Path) -> str:
    return f"delete it (rm -r -- {shlex.quote(str(path))}) and run again: it is rebuilt"


# -- the key ---------------------------------------------------------------------------------------------
def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_IO_BLOCK):
            h.update(block)
    return h.hexdigest()


def tokenizer_identity(tokenizer: Any) -> str:
    """sha256 of what decides a tokenizer's output here: its serialised fast tokenizer, chat template and
    special tokens (a tokenizer loaded from another directory with the same files has the same identity)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"{type(tokenizer).__name__} is not a fast tokenizer; use PreTrainedTokenizerFast")
    parts = {
        "tokenizer": backend.to_str(),
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def store_key(
    files: Sequence[str | Path],
    tokenizer: Any,
    *,
    max_len: int,
    min_supervised: int = 2,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The content key of the store of these inputs: (sha256 hex, what went into it).

    The files count by content and order, not by name: a copy of the same data elsewhere has the same key.

    Raises:
        DataError: an input file does not exist.
    """
    for f in files:
        if not Path(f).is_file():
            raise DataError(f"{f}: no such data file (check data.train_files in the config)")
    inputs = {
        "format": FORMAT,
        "files": [file_sha256(f) for f in files],
        "tokenizer": tokenizer_identity(tokenizer),
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "max_len": int(max_len),
        "min_supervised": int(min_supervised),
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return key, inputs


def store_dir(root: str | Path, key: str) -> Path:
    """The directory of the store with `key` under a datasets root."""
    return Path(root) / f"tokens-{key[:24]}"


# -- opening -----------------------------------------------------------------------------------------------
@dataclass
class TokenStore:
    """An opened store: read-only memory maps; indexing gives a `Sample` whose ids and mask are slices of them.

    Attributes:
        path: the store directory.
        manifest: its manifest.
        ids, mask, offsets, lengths, src_file, src_line: the arrays (see the module docstring).
    """

    path: Path
    manifest: dict[str, Any]
    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    src_file: np.ndarray
    src_line: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i: int) -> Sample:
        # Views into the maps: only the pages of this sample are read, nothing is copied.
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        src = f"{self.manifest['inputs'][int(self.src_file[i])]}:{int(self.src_line[i])}"
        return Sample(self.ids[a:b], self.mask[a:b], src)

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def skipped(self) -> dict[str, Any]:
        """The skip report of the build (SkipReport.to_dict)."""
        return self.manifest["skipped"]


def _read_manifest(path: Path) -> dict[str, Any]:
    mf = path / MANIFEST
    if not mf.is_file():
        raise StoreError(f"{mf}: no manifest: {path} is not a complete token store; {_fix(path)}")
    try:
        m = json.loads(mf.read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"{mf}: unreadable manifest ({exc}); {_fix(path)}") from None
    want = {"format", "key", "samples", "tokens", "files", "inputs", "skipped"}
    if not isinstance(m, dict) or not want <= set(m) or set(m.get("files", {})) != set(ARRAYS):
        raise StoreError(f"{mf}: not a token store manifest (missing fields or files); {_fix(path)}")
    if m["format"] != FORMAT:
        raise StoreError(f"{mf}: store format {m['format']}, this trainer reads {FORMAT}; {_fix(path)}")
    return m


def _expected_len(name: str, m: dict[str, Any]) -> int:
    return {"ids.npy": m["tokens"], "mask.npy": m["tokens"], "offsets.npy": m["samples"] + 1}.get(name, m["samples"])


def open_store(path: str | Path, key: str | None = None) -> TokenStore:
    """Open a store read-only (memory maps), checking every file's size and shape against the manifest.

    Args:
        key: the key it must have (the directory was found by it), or None.

    Raises:
        StoreError: no store there, a file missing, truncated or of another shape, the manifest of another
            key: the message names the file and the fix.
    """
    path = Path(path)
    if not path.is_dir():
        raise StoreError(f"{path}: no token store there (no such directory)")
    m = _read_manifest(path)
    if key is not None and m["key"] != key:
        raise StoreError(f"{path / MANIFEST}: the manifest's key {m['key'][:24]} is not the key {key[:24]} this "
                         f"store was looked up by; {_fix(path)}")
    arrays = {}
    for name, dtype in ARRAYS.items():
        f = path / name
        want = m["files"][name]["bytes"]
        have = f.stat().st_size if f.is_file() else None
        if have != want:
            what = "missing" if have is None else f"{have} bytes, the manifest says {want}"
            raise StoreError(f"{f}: {what}: the token store is truncated or corrupt; {_fix(path)}")
        try:
            a = np.load(f, mmap_mode="r")
        except (ValueError, OSError) as exc:
            raise StoreError(f"{f}: not a readable .npy file ({exc}); {_fix(path)}") from None
        if a.dtype != np.dtype(dtype) or a.shape != (_expected_len(name, m),):
            raise StoreError(f"{f}: {a.dtype} {a.shape}, the manifest says {np.dtype(dtype)} "
                             f"({_expected_len(name, m)},); {_fix(path)}")
        arrays[name[:-4]] = a
    if m["samples"] and int(arrays["offsets"][-1]) != m["tokens"]:
        raise StoreError(f"{path / 'offsets.npy'}: ends at {int(arrays['offsets'][-1])}, not at the "
                         f"{m['tokens']} tokens of ids.npy; {_fix(path)}")
    return TokenStore(path, m, **arrays)


def verify(path: str | Path) -> TokenStore:
    """Open a store and check every file's sha256 against the manifest (reads every byte).

    Raises:
        StoreError: as open_store, or a file whose content is not the one the manifest names.
    """
    store = open_store(path)
    for name in ARRAYS:
        f = store.path / name
        digest = file_sha256(f)
        if digest != store.manifest["files"][name]["sha256"]:
            raise StoreError(f"{f}: sha256 {digest[:16]}.. is not the manifest's "
                             f"{store.manifest['files'][name]['sha256'][:16]}..: the file is corrupt; {_fix(store.path)}")
    return store


# -- a run's pointer ---------------------------------------------------------------------------------------
def write_pointer(run_dir: str | Path, store: TokenStore) -> None:
    """Record in <run>/data/store.json which store the run trains on (whole or not at all: trainer.atomic)."""
    p = Path(run_dir) / POINTER
    p.parent.mkdir(parents=True, exist_ok=True)
    write_json(p, {"path": str(store.path.absolute()), "key": store.key}, indent=1)


def read_pointer(run_dir: str | Path) -> dict[str, str] | None:
    """The run's pointer ({path, key}), or None if the run has none yet."""
    p = Path(run_dir) / POINTER
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
        return {"path": str(d["path"]), "key": str(d["key"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{p}: unreadable store pointer ({exc}); delete it and run again") from None


def wait_for_store(run_dir: str | Path, poll_s: float = 0.2) -> TokenStore:
    """Block until the run's pointer names a store that opens (the data builder writes the pointer once the
    store is in place; a resumed run's pointer may name a store its builder is rebuilding): then open it.
    If the builder dies, the launcher ends this rank."""
    while True:
        ptr = read_pointer(run_dir)
        if ptr is not None and Path(ptr["path"]).is_dir():
            return open_store(ptr["path"], ptr["key"])
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.store", description="Check a token store.")
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check every file's size and sha256 against the manifest")
    v.add_argument("path")
    args = p.parse_args(argv)
    try:
        s = verify(args.path)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{s.path}: ok ({len(s)} samples, {s.num_tokens} tokens, key {s.key[:24]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
