"""The workers of the regeneration stage (trainer.regenerate) and its progress lines.

One worker process per slot: a GPU (or tensor-parallel group) of the layout, or a share of this machine's
cores. Each opens its engine once, then regenerates and writes the shards it is given. The stage hands shards
to free workers, watches each (a worker that dies, or that takes longer than data.regenerate_timeout_s on a
shard, stops the stage with an error naming it) and prints `regen key=value ...` lines every few seconds.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from trainer.config import TrainConfig
from trainer.data import Conversation
from trainer.engines import Engine, EngineSpec, open_engine, regenerate_conversations
from trainer.regen_shards import RegenerateError, shard_name, write_shard

PROGRESS_EVERY_S = 5.0
"""Seconds between progress lines."""


def layout_gpus(cfg: TrainConfig) -> list[int]:
    """The GPUs the stage may use: every GPU of the layout (target and drafter alike: nothing trains yet).
    A layout across nodes: node 0's (the stage runs on one node; the others are not used)."""
    lay = cfg.layout
    gpus = list(lay.target_gpus) + list(lay.drafter_gpus)
    if not gpus and lay.nodes:
        gpus = list(lay.nodes[0].target_gpus) + list(lay.nodes[0].drafter_gpus)
    return list(dict.fromkeys(gpus))



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


def run_workers(spec: EngineSpec, slots: Sequence[Slot], out: Path, kw: dict, todo: list[int],
                 shards: list[list[Conversation]], digests: list[str], progress: Progress,
                 start_timeout_s: float) -> None:
    """Regenerate the shards `todo` on one worker process per slot; returns when all are written.

    Raises:
        RegenerateError: a worker failed, died, or took longer than spec.timeout_s on a shard (or
            start_timeout_s to start); the other workers are stopped, finished shards stay.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh interpreter: CUDA / vLLM state never crosses a fork
    try:
        results = ctx.Queue()
    except OSError as exc:  # the queue's lock is a POSIX semaphore: sem_open needs a writable /dev/shm
        raise RegenerateError(
            f"the {spec.engine} engine's workers cannot start: their queues need POSIX shared memory, a writable "
            f"tmpfs at /dev/shm, and creating one failed ({exc.strerror or exc}); a container's systemd mounts it "
            "at boot. Mount it, then run the stage again (finished shards are kept). Fix, as root in the container: "
            "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm") from None
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


def run_here(engine: Engine, tokenizer: Any, out: Path, kw: dict, todo: list[int], shards: list[list[Conversation]],
              digests: list[str], progress: Progress) -> None:
    """Regenerate the shards `todo` in this process with an engine already open (the trainer's own target)."""
    progress.engine_ready(0)
    for i in todo:
        new, tokens = regenerate_conversations(engine, tokenizer, shards[i], kw)
        progress.shard_done(0, write_shard(out, i, new, tokens, digests[i]))
        progress.report()
