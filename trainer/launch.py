"""`python -m trainer.launch --config FILE [--resume RUN_DIR]`: one process per rank of the layout.

- Colocated layout (empty `layout`): runs `trainer.train.train` in this process (the CPU demo).
- Split layout: starts `python -m trainer.rank_loop` once per rank, each with its rank variables and
  Layout.env(rank) (exactly one GPU visible), and watches them. Every output line of a child is echoed as
  `[rank N] line`. When a rank fails (non-zero exit or killed by a signal) the others get SIGTERM, then
  SIGKILL after a grace period, and this process exits non-zero naming the rank: never a hang. The
  collective timeout (layout.timeout_s) covers a rank that hangs without dying.

`--resume RUN_DIR` continues RUN_DIR from its newest complete checkpoint (config: --config, else
RUN_DIR/config.json). Exit codes: 0 done; 2 bad config, layout or data, or nothing to resume (the message
says what to fix); otherwise the failed rank's exit code (1 when it was killed by a signal).
"""

from __future__ import annotations

import argparse
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
    from trainer.distributed import rank_env_vars

    env = dict(base)
    env.update(rank_env_vars(rank, layout.world_size, port))
    env.update(layout.env(rank))
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the log as they happen, not at exit
    if not layout.uses_gpus and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // layout.world_size))
    return env


@dataclass
class RankFailure:
    """The first rank that failed: its rank, role, exit code (negative: killed by that signal)."""

    rank: int
    role: str
    returncode: int

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


def _pump(stream, prefix: str, out: TextIO, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


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
) -> int:
    """Start every rank, echo their output, and watch them until all exit or one fails.

    Args:
        config_path: the config file every rank reads.
        layout: the split layout (world size, roles, per-rank environment).
        out: where prefixed child lines go.
        log: launcher lines (default: `[launch] ...` to `out`).
        grace_s: SIGTERM -> SIGKILL delay when stopping the others.

    Returns:
        0 when every rank exited 0, else the failed rank's exit code (see RankFailure.exit_code).
    """
    lock = threading.Lock()
    log = log or (lambda msg: (out.write(f"[launch] {msg}\n"), out.flush()))
    port = free_port()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    stopping: list[int] = []

    def on_signal(signum, _frame):  # a stop of the launcher stops every rank
        stopping.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    failure: RankFailure | None = None
    try:
        for rank in range(layout.world_size):
            env = rank_environment(layout, rank, port, dict(os.environ))
            p = subprocess.Popen(
                [sys.executable, "-m", "trainer.rank_loop", "--config", str(config_path)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[rank {rank}] ", out, lock), daemon=True)
            t.start()
            pumps.append(t)
            log(f"rank {rank} ({layout.role(rank)}) pid {p.pid} CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}")
        while failure is None and not stopping:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                # A signal death is the cause; the others' errors (a broken connection) are its consequence.
                r, c = min(bad, key=lambda rc: (rc[1] >= 0, rc[0]))
                failure = RankFailure(r, layout.role(r), c)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(poll_s)
        if failure is not None or stopping:
            why = failure.describe() if failure else f"launcher got {signal.Signals(stopping[0]).name}"
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
        log(f"run failed: {failure.describe()} (its traceback is above, prefixed [rank {failure.rank}])")
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
    from trainer.train import TrainError, train

    try:
        cfg, path = resolve_config(args.config, args.resume)
        layout = cfg.layout.to_layout()
        if layout.colocated:
            result = train(cfg)
            fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"done: {result.steps} steps; τ before {fmt(result.tau_before)} -> after {fmt(result.tau_after)}; "
                  f"export {result.export_dir}", flush=True)
            return 0
    except (ConfigError, DataError, TrainError, LaunchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return spawn(path, layout)


if __name__ == "__main__":
    sys.exit(main())
