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

The key hashes the input files' bytes, the target directory's files (config, generation config, tokenizer,
chat template: by content; the weights by content too, with a (size, mtime) cache so 16 GB are hashed once),
the chat-template arguments, `regenerate_max_new_tokens`, the sampling (greedy), the engine, its version and
dtype, and the shard size and HF batch (they decide which prompts are batched together, which can move a
float's last bit). `key_inputs` returns them as a dict.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import json
import os
import queue
import shlex
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from trainer.config import TrainConfig
from trainer.data import Conversation, DataError, SkipReport, read_conversations
from trainer.engines import Engine, EngineError, EngineSpec, HFEngine, engine_version, open_engine
from trainer.engines import regenerate_conversations
from trainer.store import datasets_root, file_sha256

FORMAT = 1
"""Bump when the dataset layout or the regeneration rules change: old datasets are then not reused."""

MANIFEST = "manifest.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
PROGRESS_EVERY_S = 5.0
"""Seconds between progress lines."""


class RegenerateError(DataError):
    """The stage cannot produce the dataset: a corrupt shard, an engine that died or hung, a busy dataset.
    The message names the file or the engine and the fix."""


# -- the key -----------------------------------------------------------------------------------------------
def resolve_dtype(dtype: str, device_type: str) -> str:
    """`data.regenerate_dtype`, with auto = float32 on CPU, bfloat16 on GPUs (the trainer's target dtype)."""
    if dtype != "auto":
        return dtype
    return "float32" if device_type == "cpu" else "bfloat16"


def layout_gpus(cfg: TrainConfig) -> list[int]:
    """The GPUs the stage may use: every GPU of the layout (target and drafter alike: nothing trains yet).
    A layout across nodes: node 0's (the stage runs on one node; the others are not used)."""
    lay = cfg.layout
    gpus = list(lay.target_gpus) + list(lay.drafter_gpus)
    if not gpus and lay.nodes:
        gpus = list(lay.nodes[0].target_gpus) + list(lay.nodes[0].drafter_gpus)
    return list(dict.fromkeys(gpus))


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


# -- files ----------------------------------------------------------------------------------------------
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


# -- progress --------------------------------------------------------------------------------------------
@dataclass
class Progress:
    """Counts of a stage and its progress lines: `regen key=value ...` on stdout (the run's train.log) and,
    with a metrics writer, `{"kind": "regen", ...}` records in metrics.jsonl."""

    total_conversations: int
    total_shards: int
    conversations: int = 0
    shards: int = 0
    tokens: int = 0
    log: Callable[[str], None] = print
    metrics: Any = None
    started: float = field(default_factory=time.monotonic)
    session_tokens: int = 0
    session_conversations: int = 0
    engine_tokens: dict[int, int] = field(default_factory=dict)
    engine_started: dict[int, float] = field(default_factory=dict)
    last: float = 0.0

    def engine_ready(self, wid: int) -> None:
        self.engine_started[wid] = time.monotonic()
        self.engine_tokens.setdefault(wid, 0)
        if len(self.engine_started) == 1:
            self.started = time.monotonic()  # rates count from the first engine's start, not the model load

    def shard_done(self, wid: int, record: dict[str, Any]) -> None:
        self.shards += 1
        self.conversations += record["conversations"]
        self.tokens += record["response_tokens"]
        self.session_conversations += record["conversations"]
        self.session_tokens += record["response_tokens"]
        self.engine_tokens[wid] = self.engine_tokens.get(wid, 0) + record["response_tokens"]

    def fields(self) -> dict[str, Any]:
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        rate = self.session_tokens / elapsed
        conv_rate = self.session_conversations / elapsed
        left = self.total_conversations - self.conversations
        per_conv = self.tokens / self.conversations if self.conversations else 0.0
        per_engine = [self.engine_tokens[w] / max(now - self.engine_started[w], 1e-9) for w in sorted(self.engine_started)]
        return {
            "conversations": self.conversations, "conversations_total": self.total_conversations,
            "shards": self.shards, "shards_total": self.total_shards, "tokens": self.tokens,
            "tokens_total_est": round(per_conv * self.total_conversations),
            "tokens_per_s": round(rate, 1), "tokens_per_s_engines": [round(r, 1) for r in per_engine],
            "eta_s": round(left / conv_rate) if conv_rate > 0 else None, "elapsed_s": round(elapsed, 1),
        }

    def report(self, force: bool = False) -> None:
        """A progress line (and metrics record) if PROGRESS_EVERY_S passed since the last one, or `force`."""
        now = time.monotonic()
        if not force and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        f = self.fields()
        text = " ".join(f"{k}={'-' if v is None else (','.join(map(str, v)) or '-') if isinstance(v, list) else v}"
                        for k, v in f.items())
        self.log(f"regen {text}")
        if self.metrics is not None:
            self.metrics.write({"kind": "regen", "time": time.time(), **{f"regen_{k}": v for k, v in f.items()}})


# -- workers ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """One worker's place: its name in messages, its device, the environment its engine starts with."""

    name: str
    device: str = "cpu"
    env: tuple[tuple[str, str], ...] = ()
    threads: int | None = None


def worker_slots(cfg: TrainConfig, spec: EngineSpec, cpus: Sequence[int] | None = None) -> list[Slot]:
    """One slot per GPU (per tensor-parallel group) of the layout, else `data.regenerate_workers` CPU slots,
    each bound to its own cores (VLLM_CPU_OMP_THREADS_BIND; torch threads for hf); openai: that many clients.

    Raises:
        RegenerateError: the GPUs do not split into tensor-parallel groups, or fewer cores than workers.
    """
    d = cfg.data
    if spec.engine == "openai":
        return [Slot(f"client{i}") for i in range(d.regenerate_workers or 1)]
    gpus, tp = layout_gpus(cfg), spec.tensor_parallel
    if gpus:
        if len(gpus) % tp:
            raise RegenerateError(f"data.regenerate_tensor_parallel {tp} does not divide the layout's {len(gpus)} GPUs "
                                  f"{gpus}; set it to a divisor of {len(gpus)}")
        groups = [gpus[i : i + tp] for i in range(0, len(gpus), tp)][: d.regenerate_workers or None]
        return [Slot("gpu" + ",".join(map(str, g)), "cuda", (("CUDA_VISIBLE_DEVICES", ",".join(map(str, g))),))
                for g in groups]
    cores = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    n = d.regenerate_workers or 1
    if n == 1:
        # vLLM's default binding (one core kept for itself) was fastest on 2 cores; hf likewise: spinning intra-op
        # threads on a busy machine cost far more than the core they add.
        return [Slot("cpu0", threads=max(1, len(cores) - 1))]
    if n > len(cores):
        raise RegenerateError(f"data.regenerate_workers {n} is more than the {len(cores)} CPU cores here; "
                              f"set it to at most {len(cores)}")
    per = len(cores) // n
    slots = []
    for i in range(n):
        mine = cores[i * per : (i + 1) * per]
        env = (("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine))), ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
               ("OMP_NUM_THREADS", str(per)))
        slots.append(Slot(f"cpu{i}", env=env, threads=per))
    return slots


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a kill -9 of the stage ends its engines)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[-1][:500] if str(exc) else type(exc).__name__


def _worker_main(wid: int, spec: EngineSpec, slot: Slot, out: str, kw: dict, tasks, results) -> None:
    """A worker process: open the engine, then regenerate and write every shard it is given until None."""
    _die_with_parent()
    os.environ.update(dict(slot.env))
    try:
        if slot.threads and spec.engine == "hf":
            import torch

            torch.set_num_threads(slot.threads)
        engine = open_engine(spec, slot.device)
    except BaseException as exc:  # noqa: BLE001 - reported to the stage, which names the engine
        results.put(("error", wid, None, _describe(exc)))
        return
    results.put(("ready", wid, None, None))
    while (task := tasks.get()) is not None:
        index, messages, sources, digest = task
        try:
            convs = [Conversation(m, s) for m, s in zip(messages, sources)]
            new, tokens = regenerate_conversations(engine, engine.tokenizer, convs, kw)
            results.put(("done", wid, index, write_shard(Path(out), index, new, tokens, digest)))
        except BaseException as exc:  # noqa: BLE001
            results.put(("error", wid, index, _describe(exc)))
            return


@dataclass
class _Worker:
    wid: int
    slot: Slot
    proc: Any
    tasks: Any
    ready: bool = False
    shard: int | None = None
    since: float = 0.0


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _run_workers(spec: EngineSpec, slots: Sequence[Slot], out: Path, kw: dict, todo: list[int],
                 shards: list[list[Conversation]], digests: list[str], progress: Progress,
                 start_timeout_s: float) -> None:
    """Regenerate the shards `todo` on one worker process per slot; returns when all are written.

    Raises:
        RegenerateError: a worker failed, died, or took longer than spec.timeout_s on a shard (or
            start_timeout_s to start); the other workers are stopped, finished shards stay.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh interpreter: CUDA / vLLM state never crosses a fork
    results = ctx.Queue()
    workers: list[_Worker] = []
    log = progress.log
    pending = list(todo)
    started = time.monotonic()
    engine = f"{spec.engine} engine"

    def name(w: _Worker) -> str:
        return f"{engine} worker {w.wid} ({w.slot.name}, pid {w.proc.pid})"

    try:
        for wid, slot in enumerate(slots):
            tasks = ctx.Queue()
            proc = ctx.Process(target=_worker_main, args=(wid, spec, slot, str(out), kw, tasks, results), daemon=True)
            proc.start()
            workers.append(_Worker(wid, slot, proc, tasks))
            log(f"regen worker={wid} pid={proc.pid} engine={spec.engine} device={slot.name}")
        busy = 0
        while pending or busy:
            for w in workers:
                if w.ready and w.shard is None and pending:
                    i = pending.pop(0)
                    w.tasks.put((i, [c.messages for c in shards[i]], [c.source for c in shards[i]], digests[i]))
                    w.shard, w.since = i, time.monotonic()
                    busy += 1
            try:
                kind, wid, index, payload = results.get(timeout=0.5)
            except queue.Empty:
                kind = None
            now = time.monotonic()
            if kind == "ready":
                workers[wid].ready = True
                progress.engine_ready(wid)
                log(f"regen worker={wid} ready=1 after_s={now - started:.1f}")
            elif kind == "done":
                w = workers[wid]
                w.shard, busy = None, busy - 1
                progress.shard_done(wid, payload)
            elif kind == "error":
                w = workers[wid]
                what = "could not start" if index is None else f"failed on shard {index} ({shard_name(index)})"
                raise RegenerateError(f"{name(w)} {what}: {payload}; finished shards are kept in {out}: fix the "
                                      "engine and run the stage again to finish")
            else:
                for w in workers:
                    if not w.proc.is_alive():
                        doing = "while starting" if w.shard is None else f"during shard {w.shard}"
                        raise RegenerateError(
                            f"{name(w)} died ({_exit_text(w.proc.exitcode)}) {doing}: out of memory? (dmesg | tail); "
                            f"finished shards are kept in {out}: run the stage again to finish")
                    if w.shard is not None and now - w.since > spec.timeout_s:
                        raise RegenerateError(
                            f"{name(w)} hangs: shard {w.shard} unfinished after {spec.timeout_s:.0f} s "
                            f"(data.regenerate_timeout_s); finished shards are kept in {out}: check the engine (GPU "
                            "busy? swapping?), raise data.regenerate_timeout_s for long shards, and run again")
                    if not w.ready and now - started > start_timeout_s:
                        raise RegenerateError(f"{name(w)} did not start in {start_timeout_s:.0f} s; check its log "
                                              "lines above, then run the stage again")
            progress.report()
    finally:
        for w in workers:
            if w.proc.is_alive():
                w.tasks.put(None)
        for w in workers:
            w.proc.join(timeout=10 if w.ready and w.shard is None else 0.1)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=5)


def _run_here(engine: Engine, tokenizer: Any, out: Path, kw: dict, todo: list[int], shards: list[list[Conversation]],
              digests: list[str], progress: Progress) -> None:
    """Regenerate the shards `todo` in this process with an engine already open (the trainer's own target)."""
    progress.engine_ready(0)
    for i in todo:
        new, tokens = regenerate_conversations(engine, tokenizer, shards[i], kw)
        progress.shard_done(0, write_shard(out, i, new, tokens, digests[i]))
        progress.report()


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
    try:
        m = read_manifest(out) if (out / MANIFEST).is_file() else {}
        # Complete, unless the user removed a bad shard with its record (the fix the errors print): then resume.
        if m.get("complete") and all(_record_path(out, r["index"]).is_file() for r in m["shards"]):
            files = dataset_files(out)
            log(f"regen reused=1 key={key[:24]} conversations={m['conversations']} regenerated=0 shards={len(files)} "
                f"path={out}")
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
        if run_dir is not None:
            from trainer.metrics import MetricsWriter

            metrics = MetricsWriter(Path(run_dir) / "metrics.jsonl", tensorboard=False)
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
                _run_here(engine, tokenizer, out, kw, todo, shards, digests, progress)
            else:
                _run_workers(spec, worker_slots(cfg, spec, cpus), out, kw, todo, shards, digests, progress,
                             start_timeout_s=max(900.0, spec.timeout_s))
            for i in todo:
                records[i] = load_record(out, i, digests[i])
        progress.report(force=True)
        manifest.update(complete=True, shards=[records[i] for i in range(len(shards))],
                        response_tokens=sum(r["response_tokens"] for r in records.values()))
        _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
        log(f"regen done key={key[:24]} conversations={len(convs)} regenerated={progress.session_conversations} "
            f"shards={len(shards)} path={out}")
        return out
    finally:
        lock.close()
        if metrics is not None:
            metrics.close()


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
