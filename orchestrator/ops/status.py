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
    balance_run: str | None = None
    """The run the balance advice is about: the newest running run, else the newest run."""
    balance: list[str] = field(default_factory=list)
    """orchestrator.ops.runnotes.balance_notes of that run's records (as `dflashctl metrics` prints them)."""

    def to_dict(self) -> dict:
        return asdict(self)

    def run(self, run_id: str) -> dict | None:
        return next((r for r in self.runs if r["run_id"] == run_id), None)


def status(target, *, limit: int = 20, timeout: float | None = 120, balance: bool = True) -> TargetStatus:
    """Ask the target's agent for its GPUs, sessions and runs (ONE agent call), then (`balance`) the newest
    run's records for its target/drafter balance advice (`run_balance`: one more call when there is a run).

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
    st = TargetStatus(
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
    if balance:
        st.balance_run, st.balance = run_balance(target, ans.runs)
    return st


def run_balance(target, runs: list[dict]) -> tuple[str | None, list[str]]:
    """The balance advice of the newest running run (else the newest run) of `runs`, from its metrics records:
    a second agent call, made only when there is a run. (run id, lines); a run whose records cannot be read
    says why in its one line."""
    from orchestrator.errors import AgentError, RunNotFound
    from orchestrator.ops.runnotes import balance_notes, fetch_rows

    if not runs:
        return None, []
    pick = next((r for r in reversed(runs) if r.get("state") == "running"), runs[-1])
    try:
        rows = fetch_rows(target, pick["run_id"]).rows
    except (AgentError, RunNotFound) as exc:
        return pick["run_id"], [f"balance: the records of run {pick['run_id']} cannot be read: {exc}"]
    return pick["run_id"], balance_notes(rows)


def status_of(inv, target: str, *, limit: int = 20, early=None) -> TargetStatus:
    """`dflashctl status`: open `target` of `inv` (`early`: an orchestrator.preconnect.EarlyConnection), ask it
    (status), close it."""
    tgt = open_target(inv, target, early)
    try:
        return status(tgt, limit=limit)
    finally:
        tgt.close()
