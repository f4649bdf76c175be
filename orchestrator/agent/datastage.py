"""The data stage, then training, as ONE command of a run's session (runcommand.build_command):

    python -m orchestrator.agent.datastage N STAGE_ARGV(N words) TRAIN_ARGV...

runs the stage (`<data venv>/bin/python -m trainer regenerate ...`) as a child in this process group, and only
when it exits 0 replaces itself with the training command (exec: the same pid, the same group that
start_training.sh records and `dflashctl stop` signals). A stage that fails ends the run with its exit code (a
signal N as 128 + N, as start_training.sh records it), so exit.json says so and no trainer starts. Standard
library only: it runs in the training venv's interpreter before anything else is imported.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(stage argv, training argv) of this module's arguments `N STAGE... TRAIN...`.

    Raises:
        ValueError: N is not a count of the words that follow, or either command is empty.
    """
    if not argv or not argv[0].isdigit():
        raise ValueError("usage: python -m orchestrator.agent.datastage N STAGE_ARGV... TRAIN_ARGV...")
    n = int(argv[0])
    stage, train = argv[1 : 1 + n], argv[1 + n :]
    if n == 0 or len(stage) != n or not train:
        raise ValueError(f"expected {n} stage words and a training command, got {len(argv) - 1} words")
    return stage, train


def main(argv: list[str] | None = None) -> int:
    try:
        stage, train = split(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    # A stop's SIGINT reaches the whole group, the stage included: the stage decides how it ends; this process
    # only waits for it and then does not start training.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(stage, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    except OSError as exc:
        print(f"error: the data stage could not start: {stage[0]}: {exc.strerror} (build the data venv: dflashctl "
              "rebuild-venv --target T --profile P)", file=sys.stderr, flush=True)
        return 127
    rc = proc.wait()
    if rc != 0:
        code = 128 - rc if rc < 0 else rc
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        print(f"data stage ended with {how}: training not started", file=sys.stderr, flush=True)
        return code
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    os.execvp(train[0], train)
    return 127  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main())
