"""The launch lock: one launch of an experiment at a time. Standard library only.

    <workdir>/locks/<experiment>.lock   held (flock) by the launch of that experiment in progress; its text
                                        names the holder
    <workdir>/locks/gpus.json           the GPU claims (orchestrator.agent.claims)
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.rundirs import check_name, read_json


class LaunchLock:
    """One launch of an experiment at a time: flock on `<workdir>/locks/<experiment>.lock` (released by the
    kernel if the agent dies, so it never goes stale) plus the holder's pid, run id and start time in the
    file. Launches of different experiments take different locks and run side by side; the GPUs they may
    share are claimed one by one (orchestrator.agent.claims)."""

    def __init__(self, workdir: str | Path, experiment: str):
        self.experiment = check_name("experiment", experiment)
        self.path = Path(workdir) / "locks" / f"{experiment}.lock"
        self.fd: int | None = None

    def acquire(self, holder: dict) -> None:
        """Take the lock without waiting.

        Raises:
            AgentFailure("LockHeld"): another launch of this experiment holds it; message and data name pid,
                run id, since.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            other = self._read_holder()
            who = (
                f"pid {other.get('pid')} launching run {other.get('run_id')} since {other.get('since')}"
                if other
                else "a launch that has not written its name yet"
            )
            raise AgentFailure(
                "LockHeld",
                f"another launch of experiment {self.experiment} holds {self.path}: {who}",
                fix="wait for it to finish, then check `dflashctl status`",
                data={"holder": other or {}, "lock": str(self.path)},
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode() + b"\n", 0)
        self.fd = fd

    def _read_holder(self) -> dict | None:
        # The winner writes its name right after taking the lock; give it a moment.
        for _ in range(20):
            data = read_json(self.path)
            if data:
                return data
            time.sleep(0.05)
        return None

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                os.close(self.fd)
                self.fd = None
