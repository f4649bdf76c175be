"""Regeneration as a stage of its own: every assistant turn of the training conversations replaced by the
target's greedy output (docs/dflash.md §2.1), sharded, resumable and keyed by content.

    python -m trainer regenerate CONFIG [--datasets DIR] [--run-dir DIR]

Layout of one dataset, `<datasets>/regen-<key>/` (the datasets root: trainer.store.datasets_root):

    manifest.json          the key and its inputs, counts, the shard list with sha256, engine and version,
                           `complete` (true only once every shard is written)
    shard-00000.jsonl      regenerated conversations (OpenAI `messages`), read by trainer.data.read_conversations
    shard-00000.json       the shard's record: counts, sha256 of the jsonl, sha256 of its input conversations

The conversations are cut into shards of `data.regenerate_shard_size` in file order. A shard is finished
when its record exists: the jsonl is written first (temporary name, fsync, rename), then the record the same
way, so a stage killed at any point (kill -9, `dflashctl stop`, a power cut) loses at most the shards in
flight; a restart keeps every finished shard and redoes the others. With a greedy engine the finished dataset
is byte-identical to an uninterrupted run's (nothing in it depends on timing, workers or restarts).

Workers: one engine per GPU of the layout (tensor parallel groups of `data.regenerate_tensor_parallel` GPUs),
or `data.regenerate_workers` CPU workers; shards go to whichever worker is free. A worker that dies, or takes
longer than `data.regenerate_timeout_s` on one shard, stops the stage with an error naming it (finished
shards stay). Workers die with the stage (PR_SET_PDEATHSIG), so a kill -9 leaves no engine behind.

Here: the key, the stage and the trainer's way in (regenerated_files); the files and their checks are in
trainer.regen_shards, the workers and the progress lines in trainer.regen_workers.

The key hashes the input files' bytes, the target directory's files (config, generation config, tokenizer,
chat template: by content; the weights by content too, with a (size, mtime) cache so 16 GB are hashed once),
the chat-template arguments, `regenerate_max_new_tokens`, the sampling (greedy), the engine, its version and
dtype, and the shard size and HF batch (they decide which prompts are batched together, which can move a
float's last bit). `key_inputs` returns them as a dict.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from trainer.config import TrainConfig
from trainer.data import DataError, SkipReport, read_conversations
from trainer.engines import Engine, EngineSpec, HFEngine, engine_version
from trainer.regen_shards import (
    MANIFEST, RegenerateError, _input_digest, _record_path, _write_atomic, dataset_files, load_record, read_manifest,
)
from trainer.regen_workers import Progress, layout_gpus, run_here, run_workers, worker_slots
from trainer.store import datasets_root, file_sha256

FORMAT = 1
"""Bump when the dataset layout or the regeneration rules change: old datasets are then not reused."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# -- the key -----------------------------------------------------------------------------------------------
def resolve_dtype(dtype: str, device_type: str) -> str:
    """`data.regenerate_dtype`, with auto = float32 on CPU, bfloat16 on GPUs (the trainer's target dtype)."""
    if dtype != "auto":
        return dtype
    return "float32" if device_type == "cpu" else "bfloat16"


def engine_spec(cfg: TrainConfig, target_dir: str | Path, dtype: str | None = None) -> EngineSpec:
    """The engine the config asks for, on the devices this stage will run on (`dtype`: force one, e.g. the
    dtype of a target already loaded in this process)."""
    d = cfg.data
    if dtype is None:
        device = "cuda" if layout_gpus(cfg) and d.regenerate_engine != "openai" else "cpu"
        dtype = resolve_dtype(d.regenerate_dtype, device)
    return EngineSpec(
        engine=d.regenerate_engine, target_dir=str(target_dir), max_new_tokens=d.regenerate_max_new_tokens, dtype=dtype,
        batch_size=d.regenerate_batch_size, url=(d.regenerate_url or "").rstrip("/") or None, model=d.regenerate_model,
        max_in_flight=d.regenerate_max_in_flight, timeout_s=float(d.regenerate_timeout_s),
        tensor_parallel=d.regenerate_tensor_parallel,
    )


def _cached_sha256(path: Path, cache: dict[str, Any]) -> str:
    """sha256 of a (large) file, reused from `cache` while its size and mtime are unchanged.

    Trade-off: a file rewritten in place with the same size within the same nanosecond mtime keeps its old
    hash; in exchange a 16 GB target is read once, not at every launch (~10 s per launch otherwise)."""
    st = path.stat()
    k = str(path.resolve())
    hit = cache.get(k)
    if hit and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return hit["sha256"]
    digest = file_sha256(path)
    cache[k] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    return digest


def target_identity(target_dir: str | Path, cache_file: Path | None = None) -> dict[str, dict[str, str]]:
    """sha256 of every file of an HF model directory: {"files": {name: sha}, "weights": {name: sha}}.

    Files count by their name inside the directory and their bytes (a copy elsewhere has the same identity)."""
    root = Path(target_dir)
    cache: dict[str, Any] = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
    files, weights = {}, {}
    for p in sorted(q for q in root.rglob("*") if q.is_file() and not q.name.startswith(".")):
        name = str(p.relative_to(root))
        if p.name.endswith(WEIGHT_SUFFIXES):
            weights[name] = _cached_sha256(p, cache)
        else:
            files[name] = file_sha256(p)
    if cache_file is not None and cache:
        _write_atomic(cache_file, json.dumps(cache, indent=1, sort_keys=True).encode())
    return {"files": files, "weights": weights}


def key_inputs(cfg: TrainConfig, target_dir: str | Path, train_files: Sequence[str | Path], spec: EngineSpec,
               root: Path | None = None, *, version: str | None = "") -> dict[str, Any]:
    """What the dataset key hashes, as a dict (`runs diff` shows it).

    Args:
        root: the datasets root (its weight-hash cache); None: no cache.
        version: the engine's version; "" = ask the engine (engines.engine_version); None = leave it out (a
            trainer venv without vLLM looks a vLLM dataset up without knowing the version: find_dataset).

    Raises:
        DataError: an input file is missing.
    """
    for f in train_files:
        if not Path(f).is_file():
            raise DataError(f"{f}: no such data file (check data.train_files in the config)")
    d = cfg.data
    inputs = {
        "format": FORMAT,
        "inputs": [file_sha256(f) for f in train_files],
        "target": target_identity(target_dir, None if root is None else root / ".weights-sha256.json"),
        "chat_template_kwargs": dict(d.chat_template_kwargs),
        "max_new_tokens": spec.max_new_tokens,
        "sampling": {"temperature": 0.0},
        "engine": spec.engine,
        "engine_version": engine_version(spec) if version == "" else version,
        "dtype": spec.dtype if spec.engine != "openai" else "server",
        "shard_size": d.regenerate_shard_size,
    }
    if spec.engine == "hf":
        inputs["batch_size"] = spec.batch_size
    if version is None:
        del inputs["engine_version"]
    return inputs


def dataset_key(inputs: dict[str, Any]) -> str:
    """sha256 hex of the key inputs (canonical JSON)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def dataset_dir(root: str | Path, key: str) -> Path:
    """The directory of the regenerated dataset with `key` under a datasets root."""
    return Path(root) / f"regen-{key[:24]}"


def find_dataset(root: str | Path, inputs: dict[str, Any]) -> Path | None:
    """A complete dataset under `root` whose key inputs are `inputs` (an `engine_version` missing from
    `inputs` matches any version: the newest such dataset is taken); None if there is none."""
    root = Path(root)
    if "engine_version" in inputs:
        d = dataset_dir(root, dataset_key(inputs))
        return d if (d / MANIFEST).is_file() and read_manifest(d).get("complete") else None
    found = []
    for m in root.glob(f"regen-*/{MANIFEST}"):
        try:
            man = json.loads(m.read_text())
        except (OSError, ValueError):
            continue
        ki = dict(man.get("key_inputs") or {})
        ki.pop("engine_version", None)
        if man.get("complete") and ki == inputs:
            found.append((m.stat().st_mtime, m.parent))
    return max(found)[1] if found else None


# -- the stage -------------------------------------------------------------------------------------------
class _Lock:
    """An exclusive flock on a dataset directory: one stage per dataset; released when its process ends."""

    def __init__(self, out: Path):
        self.path = out.with_name(f".{out.name}.lock")  # beside the dataset: nothing in it but the dataset
        self.f = open(self.path, "a+")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.f.seek(0)
            holder = self.f.read().strip() or "unknown"
            self.f.close()
            raise RegenerateError(f"{out}: another regeneration of this dataset is running (pid {holder}); wait for "
                                  "it to finish (its progress lines are in its log), or stop it, then run again") from None
        self.f.seek(0)
        self.f.truncate()
        self.f.write(str(os.getpid()))
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def run_stage(cfg: TrainConfig, target_dir: str | Path, train_files: Sequence[str | Path], root: str | Path, *,
              run_dir: str | Path | None = None, log: Callable[[str], None] = print, engine: Engine | None = None,
              tokenizer: Any = None, cpus: Sequence[int] | None = None) -> Path:
    """Regenerate `train_files` as `cfg.data` says into `<root>/regen-<key>/`, or reuse it if complete.

    Args:
        root: the datasets root.
        run_dir: also append the progress records to `<run_dir>/metrics.jsonl`.
        engine, tokenizer: an engine already open in this process (the trainer's target through HFEngine):
            shards run here, one after another; None: worker processes (worker_slots) open their own.
        cpus: the cores CPU workers split (default: this process's affinity).

    Returns:
        The complete dataset's directory.

    Raises:
        RegenerateError, DataError, EngineError: the message names the file or the engine and the fix.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    d = cfg.data
    dtype = None
    if engine is not None and isinstance(engine, HFEngine):
        dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    spec = engine_spec(cfg, target_dir, dtype)
    inputs = key_inputs(cfg, target_dir, train_files, spec, root)
    key = dataset_key(inputs)
    out = dataset_dir(root, key)
    lock = _Lock(out)
    out.mkdir(exist_ok=True)
    metrics = None
    if run_dir is not None:
        from trainer.metrics import MetricsWriter

        metrics = MetricsWriter(Path(run_dir) / "metrics.jsonl", tensorboard=False)
    try:
        m = read_manifest(out) if (out / MANIFEST).is_file() else {}
        # Complete, unless the user removed a bad shard with its record (the fix the errors print): then resume.
        if m.get("complete") and all(_record_path(out, r["index"]).is_file() for r in m["shards"]):
            files = dataset_files(out)
            log(f"regen reused=1 key={key[:24]} conversations={m['conversations']} regenerated=0 shards={len(files)} "
                f"path={out}")
            _record_dataset(metrics, key, out, inputs)
            return out
        report = SkipReport()
        convs = read_conversations(train_files, report)
        if not convs:
            raise DataError(f"no usable conversations in {list(map(str, train_files))}: {report.summary()}")
        size = d.regenerate_shard_size
        shards = [convs[i : i + size] for i in range(0, len(convs), size)]
        digests = [_input_digest(s) for s in shards]
        manifest = {"format": FORMAT, "key": key, "key_inputs": inputs, "inputs": [str(Path(f).absolute()) for f in train_files],
                    "target_dir": str(Path(target_dir).absolute()), "engine": spec.engine,
                    "engine_version": inputs["engine_version"], "conversations": len(convs), "shard_size": size,
                    "skipped": report.to_dict(), "complete": False, "shards": []}
        _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
        for tmp in out.glob(".*.tmp-*"):
            tmp.unlink(missing_ok=True)  # a killed stage's half-written files
        records: dict[int, dict[str, Any]] = {}
        for i in range(len(shards)):
            r = load_record(out, i, digests[i])
            if r is not None:
                records[i] = r
        todo = [i for i in range(len(shards)) if i not in records]
        progress = Progress(len(convs), len(shards), log=log, metrics=metrics)
        for r in records.values():
            progress.conversations += r["conversations"]
            progress.tokens += r["response_tokens"]
            progress.shards += 1
        log(f"regen start key={key[:24]} engine={spec.engine} conversations={len(convs)} shards={len(shards)} "
            f"done_before={len(records)} todo={len(todo)} skipped={report.total} path={out}")
        if todo:
            kw = dict(d.chat_template_kwargs)
            if engine is not None:
                run_here(engine, tokenizer, out, kw, todo, shards, digests, progress)
            else:
                run_workers(spec, worker_slots(cfg, spec, cpus), out, kw, todo, shards, digests, progress,
                             start_timeout_s=max(900.0, spec.timeout_s))
            for i in todo:
                records[i] = load_record(out, i, digests[i])
        progress.report(force=True)
        manifest.update(complete=True, shards=[records[i] for i in range(len(shards))],
                        response_tokens=sum(r["response_tokens"] for r in records.values()))
        _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
        log(f"regen done key={key[:24]} conversations={len(convs)} regenerated={progress.session_conversations} "
            f"shards={len(shards)} path={out}")
        _record_dataset(metrics, key, out, inputs)
        return out
    finally:
        lock.close()
        if metrics is not None:
            metrics.close()


def _record_dataset(metrics: Any, key: str, out: Path, inputs: dict[str, Any]) -> None:
    """The run's record of the dataset it trains on (`dflashctl runs diff` shows it): one `"kind": "dataset"`
    line in metrics.jsonl with the key and what it hashes, once the dataset is complete."""
    if metrics is not None:
        metrics.write({"kind": "dataset", "time": time.time(), "dataset_key": key, "dataset_path": str(out),
                       "dataset_key_inputs": inputs})


def regenerated_files(cfg: TrainConfig, target_dir: str | Path, train_files: Sequence[str], root: str | Path,
                      report: SkipReport, *, target: Any = None, tokenizer: Any = None,
                      run_dir: str | Path | None = None, log: Callable[[str], None] = print) -> list[Path]:
    """The trainer's way in: the shard files of the regenerated `train_files` (checked), from the finished
    dataset of the same key if there is one, else made now (hf with `target`: in this process; otherwise as
    the stage does), with the input's skipped records added to `report`.

    Raises:
        RegenerateError: engine vllm, vLLM not installed here and no finished dataset (the fix: the data stage).
    """
    root = Path(root)
    if cfg.data.regenerate_engine == "vllm" and importlib.util.find_spec("vllm") is None:
        spec = engine_spec(cfg, target_dir)
        path = find_dataset(root, key_inputs(cfg, target_dir, train_files, spec, root, version=None))
        if path is None:
            raise RegenerateError(
                f"data.regenerate_engine is vllm, but vLLM is not installed in this Python ({sys.executable}) and no "
                f"regenerated dataset of these inputs is under {root}; run the data stage first: dflashctl launch EXP "
                "(it regenerates in the vLLM venv, then trains), or set data.regenerate_engine: hf")
        log(f"data: regenerated dataset {path} (made by {read_manifest(path).get('engine_version')})")
    elif cfg.data.regenerate_engine == "hf" and target is not None:
        path = run_stage(cfg, target_dir, train_files, root, run_dir=run_dir, log=log,
                         engine=HFEngine(target, tokenizer, cfg.data.regenerate_max_new_tokens,
                                         cfg.data.regenerate_batch_size), tokenizer=tokenizer)
    else:
        path = run_stage(cfg, target_dir, train_files, root, run_dir=run_dir, log=log)
    files = dataset_files(path)
    skipped = read_manifest(path).get("skipped") or {}
    report.merge(SkipReport(Counter(skipped.get("counts", {})), dict(skipped.get("where", {}))))
    return files


def default_root(run_dir: str | Path | None, datasets: str | Path | None) -> Path:
    """The datasets root of a stage: --datasets, else trainer.store.datasets_root of the run directory."""
    if datasets:
        return Path(datasets)
    return datasets_root(run_dir or ".")
