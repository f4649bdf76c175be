"""status: one agent call for GPUs, sessions and runs; the container's own state when the agent cannot run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from orchestrator.agent.requests import StatusAnswer, StatusRequest
from orchestrator.errors import ContainerMissing, ContainerStopped
from orchestrator.target import ContainerTarget, open_target


@dataclass
class TargetStatus:
    """What `dflashctl status` shows for one target."""

    target: str
    state: str
    """`running` (the agent answered), `stopped`, `missing` (no such container), or `local`."""
    hostname: str | None = None
    workdir: str | None = None
    gpus: list[dict] = field(default_factory=list)
    gpu_reason: str | None = None
    sessions: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    total_runs: int = 0
    note: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def run(self, run_id: str) -> dict | None:
        return next((r for r in self.runs if r["run_id"] == run_id), None)


def status(target, *, limit: int = 20, timeout: float | None = 120) -> TargetStatus:
    """Ask the target's agent for its GPUs, sessions and runs (ONE agent call).

    A stopped or missing container is a state to show, not an error: no agent runs there, so GPUs and runs
    are empty and `note` says how to start it.

    Args:
        target: a BaseTarget.
        limit: newest runs to list (0: all).
    Returns:
        TargetStatus.
    Raises:
        ConnectError / AgentError: the host cannot be reached, or the agent failed.
    """
    kind = "running" if isinstance(target, ContainerTarget) else "local"
    try:
        ans = target.agent("status", StatusRequest(limit=limit).to_json(), timeout=timeout, answer=StatusAnswer)
    except ContainerStopped as exc:
        return TargetStatus(target.name, "stopped", workdir=target.workdir, note=exc.message)
    except ContainerMissing as exc:
        return TargetStatus(target.name, "missing", workdir=target.workdir, note=exc.message)
    return TargetStatus(
        target=target.name,
        state=kind,
        hostname=ans.hostname,
        workdir=ans.workdir,
        gpus=ans.gpus,
        gpu_reason=ans.gpu_reason,
        sessions=ans.sessions,
        runs=ans.runs,
        total_runs=ans.total_runs,
    )


def status_of(inv, target: str, *, limit: int = 20, early=None) -> TargetStatus:
    """`dflashctl status`: open `target` of `inv` (`early`: an orchestrator.preconnect.EarlyConnection), ask it
    (status), close it."""
    tgt = open_target(inv, target, early)
    try:
        return status(tgt, limit=limit)
    finally:
        tgt.close()
