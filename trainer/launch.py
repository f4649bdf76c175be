"""`python -m trainer.launch --config FILE [--resume RUN_DIR]`: one process per rank of the layout.

- Colocated layout (empty `layout`): runs `trainer.train.train` in this process (the CPU demo).
- Split layout: starts `python -m trainer.rank_loop` once per rank, each with its rank variables and
  Layout.env(rank) (exactly one GPU visible), and watches them. Every output line of a child is echoed as
  `[rank N] line`. When a rank fails (non-zero exit or killed by a signal) the others get a short settle
  window (SETTLE_S) to fail too and finish printing their tracebacks, then SIGTERM, then SIGKILL after a
  grace period, and this process exits non-zero naming the root cause: never a hang. The root cause is the
  failed rank whose own error ended the run, not a rank that only lost its connection to it (see
  root_cause). The collective timeout (layout.timeout_s) covers a rank that hangs without dying.

`--resume RUN_DIR` continues RUN_DIR from its newest complete checkpoint (config: --config, else
RUN_DIR/config.json). Exit codes: 0 done; 2 bad config, layout or data, or nothing to resume (the message
says what to fix); otherwise the failed rank's exit code (1 when it was killed by a signal).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from trainer.config import ConfigError, TrainConfig, load_config
from trainer.layout import Layout

GRACE_S = 10.0
"""Seconds a rank gets between SIGTERM and SIGKILL when the run is being stopped."""

SETTLE_S = 3.0
"""Seconds the other ranks get after the first failure, before any signal, to fail on their own and print
their tracebacks: a peer's death reaches the survivors within milliseconds, so a few seconds is plenty, and
stopping them sooner would cut off the traceback that names the real cause."""

PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "connection refused",
    "remote process exited",
    "ncclremoteerror",
    "communicator was aborted",
    "distnetworkerror",
    "timed out",  # gloo: a recv that waited out the collective timeout on a peer that never sent
    "before timing out",  # NCCL watchdog: the same on GPUs
)
"""Lower-case fragments of a rank's final error that say it failed because a PEER went away (gloo, NCCL and
the rendezvous word it differently): such a rank is a consequence, not the cause."""

TAIL_LINES = 400
"""Lines of each rank's output kept to find its final error (a traceback ends within its last lines)."""


class LaunchError(RuntimeError):
    """The run cannot be launched as asked; the message says what to change."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_environment(layout: Layout, rank: int, port: int, base: dict[str, str]) -> dict[str, str]:
    """The full environment of one rank's process (pure: `base` is not modified).

    CPU layouts split this machine's cores between the ranks (OMP_NUM_THREADS, unless set), so the
    processes do not oversubscribe the cores.
    """
    env = dict(base)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(layout.world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    env.update(layout.env(rank))
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the log as they happen, not at exit
    if not layout.uses_gpus and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // layout.world_size))
    return env


@dataclass
class RankFailure:
    """A rank that failed: its rank, role, exit code (negative: killed by that signal), when it exited
    (time.monotonic), its final error line ("" when it printed none) and whether that error only says a
    peer went away."""

    rank: int
    role: str
    returncode: int
    exited_at: float = 0.0
    error: str = ""
    peer_lost: bool = False

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                how = f"was killed by {signal.Signals(-self.returncode).name}"
            except ValueError:
                how = f"was killed by signal {-self.returncode}"
        else:
            how = f"exited with code {self.returncode}"
        return f"rank {self.rank} ({self.role}) {how}"

    @property
    def exit_code(self) -> int:
        return self.returncode if 0 < self.returncode < 126 else 1


def final_error(lines) -> str:
    """The error a rank's output ends with: the last line of its last Python traceback (`ValueError: ...`),
    else its last `error: ...` line; "" when there is neither.

    Args:
        lines: the rank's output lines (without the `[rank N] ` prefix), oldest first.
    """
    lines = [line.rstrip("\n") for line in lines]
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")),
                default=None)
    if start is not None:
        # The exception line is the first unindented line after the frames (chained tracebacks start
        # over with a new "Traceback" line, which `start` already skipped to).
        for line in lines[start + 1:]:
            if line and not line[0].isspace():
                return line.strip()
    for line in reversed(lines):
        if line.lower().startswith("error:"):
            return line.strip()
    return ""


def is_peer_lost(error: str) -> bool:
    """Whether a rank's final error only says that a peer went away (see PEER_LOST)."""
    low = error.lower()
    return any(frag in low for frag in PEER_LOST)


def root_cause(failures: list[RankFailure]) -> RankFailure:
    """The failure that ended the run: a rank that failed on its own (a traceback of its own, an `error:`
    line, or killed by a signal) before one whose error only says a peer went away; among those, the one
    that exited first (then the lowest rank).

    Raises:
        ValueError: `failures` is empty.
    """
    if not failures:
        raise ValueError("root_cause needs at least one failed rank")
    return min(failures, key=lambda f: (f.peer_lost, f.exited_at, f.rank))


def _pump(stream, prefix: str, out: TextIO, lock: threading.Lock, tail: collections.deque) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
        tail.append(line)
    stream.close()


def _watch(p: subprocess.Popen, rank: int, exits: dict, cond: threading.Condition) -> None:
    """Wait for one rank and record when it exited (the order of failures names the root cause)."""
    code = p.wait()
    with cond:
        exits[rank] = (code, time.monotonic())
        cond.notify_all()


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live child, then SIGKILL whoever is still alive after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    for p in procs:
        p.wait()


def spawn(
    config_path: Path,
    layout: Layout,
    out: TextIO = sys.stdout,
    log: Callable[[str], None] | None = None,
    grace_s: float = GRACE_S,
    poll_s: float = 0.2,
    settle_s: float = SETTLE_S,
    command: list[str] | None = None,
) -> int:
    """Start every rank, echo their output, and watch them until all exit or one fails.

    Args:
        config_path: the config file every rank reads.
        layout: the split layout (world size, roles, per-rank environment).
        out: where prefixed child lines go.
        log: launcher lines (default: `[launch] ...` to `out`).
        grace_s: SIGTERM -> SIGKILL delay when stopping the others.
        poll_s: how often the watcher wakes up to notice a stop of the launcher.
        settle_s: after the first failure, how long the others may take to exit on their own (and print
            their tracebacks) before they get SIGTERM.
        command: the argv of every rank (default `python -m trainer.rank_loop --config CONFIG`); each
            process still gets its own rank environment.

    Returns:
        0 when every rank exited 0, else the root-cause rank's exit code (see RankFailure.exit_code and
        root_cause); 128 + signal when the launcher itself was stopped.
    """
    lock = threading.Lock()
    log = log or (lambda msg: (out.write(f"[launch] {msg}\n"), out.flush()))
    argv = command or [sys.executable, "-m", "trainer.rank", "--config", str(config_path)]
    port = free_port()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    tails: list[collections.deque] = []
    stopping: list[int] = []
    cond = threading.Condition()
    exits: dict[int, tuple[int, float]] = {}  # rank -> (returncode, when it exited), filled by _watch

    def on_signal(signum, _frame):  # a stop of the launcher stops every rank
        stopping.append(signum)

    def failed() -> list[RankFailure]:
        with cond:
            done = sorted(exits.items())
        found = []
        for r, (code, at) in done:
            if code != 0:
                err = final_error(list(tails[r]))
                found.append(RankFailure(r, layout.role(r), code, at, err, is_peer_lost(err)))
        return found

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    failure: RankFailure | None = None
    others: list[RankFailure] = []
    try:
        for rank in range(layout.world_size):
            env = rank_environment(layout, rank, port, dict(os.environ))
            p = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            procs.append(p)
            tails.append(collections.deque(maxlen=TAIL_LINES))
            t = threading.Thread(target=_pump, args=(p.stdout, f"[rank {rank}] ", out, lock, tails[rank]), daemon=True)
            t.start()
            pumps.append(t)
            threading.Thread(target=_watch, args=(p, rank, exits, cond), daemon=True).start()
            log(f"rank {rank} ({layout.role(rank)}) pid {p.pid} CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}")
        first_failure: float | None = None
        while not stopping:
            with cond:
                codes = dict(exits)
                if len(codes) == len(procs):
                    break  # everyone is done (all 0, or the failures are all in)
                if first_failure is None and any(c != 0 for c, _ in codes.values()):
                    first_failure = time.monotonic()
                if first_failure is not None and time.monotonic() - first_failure >= settle_s:
                    break
                cond.wait(poll_s)
        if not stopping and any(c != 0 for c, _ in exits.values()):
            for t, p in zip(pumps, procs):
                if p.poll() is not None:
                    t.join(timeout=5)  # an exited rank's last lines (its traceback) are in its tail
            found = failed()
            failure = root_cause(found)
            others = [f for f in found if f is not failure]
        if failure is not None or stopping:
            why = failure.describe() if failure else f"launcher got {signal.Signals(stopping[0]).name}"
            if any(p.poll() is None for p in procs):
                log(f"{why}; stopping the other ranks (SIGTERM, SIGKILL after {grace_s:.0f}s)")
            _stop(procs, grace_s)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if failure is None and not stopping and any(p.poll() is None for p in procs):
            _stop(procs, grace_s)  # an exception in the watcher itself: leave no orphan
        for t in pumps:
            t.join(timeout=5)
    if stopping:
        return 128 + stopping[0]
    if failure is not None:
        for f in others:
            note = "lost its connection to a failed peer" if f.peer_lost else "failed too"
            log(f"also: {f.describe()}: {note}" + (f" ({f.error})" if f.error else ""))
        cause = f": {failure.error}" if failure.error else ""
        log(f"run failed: {failure.describe()}{cause} (its traceback is above, prefixed [rank {failure.rank}])")
        return failure.exit_code
    log("all ranks finished")
    return 0


def resolve_config(config: str | None, resume: str | None) -> tuple[TrainConfig, Path]:
    """The config to run and the file the ranks read (for --resume: output_dir forced to RUN_DIR).

    Raises:
        ConfigError: no config given, or a bad one.
        LaunchError: --resume of a directory with no complete checkpoint.
    """
    if resume is None:
        if config is None:
            raise ConfigError("give --config FILE (or --resume RUN_DIR)")
        cfg = load_config(config)
        path = Path(config)
    else:
        from trainer.checkpoint import CheckpointManager

        run_dir = Path(resume)
        path = Path(config) if config else run_dir / "config.json"
        cfg = load_config(path).model_copy(update={"output_dir": str(run_dir)})
        if not CheckpointManager(run_dir / "checkpoints").list_complete():
            raise LaunchError(
                f"nothing to resume in {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}; "
                "launch without --resume to start fresh"
            )
    if Path(cfg.output_dir).resolve() != Path(load_config(path).output_dir).resolve():
        # Ranks read the file: write the resolved config (new output_dir) into the run directory.
        import json

        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "config.launch.json"
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
        os.replace(tmp, path)
    return cfg, path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.launch", description="Run a training layout, one process per rank.")
    p.add_argument("--config", help="TrainConfig as JSON or YAML (runs/<id>/config.json)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its last complete checkpoint")
    args = p.parse_args(argv)
    from trainer.data import DataError
    from trainer.distributed import single_world
    from trainer.loop import train
    from trainer.setup import TrainError

    try:
        cfg, path = resolve_config(args.config, args.resume)
        layout = cfg.layout.to_layout()
        if layout.colocated:
            train(cfg, single_world(layout))
            return 0
    except (ConfigError, DataError, TrainError, LaunchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return spawn(path, layout)


if __name__ == "__main__":
    sys.exit(main())
