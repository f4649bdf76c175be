"""`python -m trainer.rank --config FILE`: one rank of a run (started by `python -m trainer.launch`).

Reads where it sits from the launcher's environment (trainer.distributed.read_rank_env), takes its device
from the layout, joins the world and runs its part of the loop (trainer.loop.run_rank).

The entry point is decorated with torch's `record`: an exception is written, with its traceback, to the
error file the elastic agent named (TORCHELASTIC_ERROR_FILE), which is where the launcher reads the run's
root cause from. `RankErrorHandler` adds what the launcher needs to rank failures: the time in nanoseconds
(torch's own timestamp has whole seconds, too coarse to order a failure and the failures it caused), the
exception's qualified type, and whether it is a PeerLostError (the rank failed because a peer did).

A rank dies with its launcher (die_with_launcher: the kernel's parent-death signal).

Exit codes: 0 done; 2 bad config, layout or data (the message says what to fix); 1 anything else. After a
failure the process ends with os._exit: interpreter teardown can block on a dead peer's sockets.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from trainer.atomic import write_json


class RankErrorHandler(ErrorHandler):
    """torch's error-file writer, with a nanosecond time, the qualified exception type and peer_lost."""

    def record_exception(self, e: BaseException) -> None:
        from trainer.distributed import PeerLostError

        file = self._get_error_file_path()
        if not file:
            return
        cls = type(e)
        data = {
            "message": {
                "message": f"{cls.__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),  # torch's own field (whole seconds), read by the agent
                    "time_ns": time.time_ns(),
                    "exc_type": f"{cls.__module__}.{cls.__qualname__}",
                    "peer_lost": isinstance(e, PeerLostError),
                    "peer": getattr(e, "peer", None) if isinstance(e, PeerLostError) else None,
                },
            }
        }
        write_json(file, data, indent=None)  # the agent may read it the moment the process is gone: never half a file


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message says what to fix: printed as one `error:` line, exit code 2."""
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.distributed import DistributedError
    from trainer.layout import LayoutError
    from trainer.setup import TrainError

    return (ConfigError, DataError, LayoutError, TrainError, DistributedError)


def quiet_progress_bars() -> None:
    """No progress bar from transformers or the hub in this rank, whatever its environment says: a bar writes a
    line without its newline, and the launcher's tee glues the next rank line onto it (a `step 6/6` line was
    once missed behind `Loading weights: 0%|`). The launcher sets HF_HUB_DISABLE_PROGRESS_BARS for every rank
    too; this holds where that variable did not reach the rank's first import of the hub, or was overridden."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _run(config: str) -> None:
    from trainer.config import load_config
    from trainer.distributed import init_world, read_rank_env
    from trainer.loop import run_rank

    quiet_progress_bars()
    env = read_rank_env()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and env.rank == 0:
        print(f"restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}: the elastic agent restarted "
              "every rank after a failure (see above); the run resumes from its newest checkpoint", flush=True)
    cfg = load_config(config)
    layout = cfg.layout.to_layout()
    world = init_world(layout, env, cfg.layout.timeout_s)
    run_rank(cfg, world, lambda msg: print(msg, flush=True))
    world.finish()


LAUNCHER_PID_ENV = "DFLASH_LAUNCHER_PID"
"""The pid of the elastic agent (trainer.launch) that starts the ranks: a rank dies with it."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this rank when its launcher dies (prctl PR_SET_PDEATHSIG), then check that the
    launcher is still the parent: one that died before the prctl call would never send the signal.

    torch starts each rank in a session of its own (start_new_session), so a signal to the launcher's process
    group never reaches the ranks; without this a SIGKILLed launcher (an OOM kill, `kill -9`) leaves its ranks
    training into a run dflashctl calls failed, on GPUs it calls free. The signal is SIGKILL: the launcher
    that would have stopped the rank gracefully is gone, and every file the rank writes is written whole
    (temporary name, rename), so nothing half-written is left. Checkpoints already saved stay.

    The death signal fires when the THREAD that forked the rank ends; torch's agent forks from its main
    thread, which lives as long as the launcher. Outside Linux, or without a launcher (the rank started by
    hand), nothing is done.
    """
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"warning: rank {os.environ.get('RANK', '?')}: prctl(PR_SET_PDEATHSIG) failed ({os.strerror(err)}): "
              "this rank will not die with its launcher", file=sys.stderr, flush=True)
        return
    if os.getppid() != int(expected):
        print(f"error: rank {os.environ.get('RANK', '?')}: its launcher (pid {expected}) is gone; ending",
              file=sys.stderr, flush=True)
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    p = argparse.ArgumentParser(prog="python -m trainer.rank", description="One rank of a run (see trainer.launch).")
    p.add_argument("--config", required=True, help="TrainConfig as JSON or YAML")
    args = p.parse_args(argv)
    try:
        record(_run, error_handler=RankErrorHandler())(args.config)
    except BaseException as exc:  # noqa: BLE001 - a rank must die loudly, whatever happened
        if isinstance(exc, user_errors()):
            print(f"error: rank {os.environ.get('RANK', '?')}: {exc}", file=sys.stderr, flush=True)
            code = 2
        else:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
