"""stop: end a run gracefully on every one of its placements (one agent call each, in parallel for a run across
targets; orchestrator.ops.runstop is the action on one target)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestrator.agent.requests import DEFAULT_GRACE_S
from orchestrator.ops.placement import Placement, each, opened, resolve, run_cause
from orchestrator.ops.runstop import StopResult, stop

if TYPE_CHECKING:
    from orchestrator.agent.events import Event

__all__ = ["NodeStop", "RunStop", "StopResult", "stop", "stop_placements", "stop_run"]


@dataclass
class NodeStop:
    """What the stop did on one placement: its result, or the error that kept it from one."""

    placement: Placement
    result: StopResult | None = None
    error: BaseException | None = None


@dataclass
class RunStop:
    """What `dflashctl stop` did: one NodeStop per placement (one for a run on one target)."""

    run_id: str
    nodes: list[NodeStop]
    across: bool = False
    """The run spans several targets (each node is reported on its own)."""


def stop_placements(targets: list, run_id: str, placements: list[Placement], *, grace_s: float = DEFAULT_GRACE_S,
                    gpu_idle_mib: list[int] | None = None,
                    on_event: Callable[[Event], None] | None = None) -> list[NodeStop]:
    """Stop run `run_id` on every placement (targets[i] is placements[i]'s, opened), in parallel; each waits
    for its recorded GPUs. A node that vanished without exit.json (its container was stopped) is then stopped
    again with the run's root cause (run_cause of the other nodes), so its exit.json says why it failed."""
    idle = gpu_idle_mib or [1024] * len(placements)

    def one(i: int, cause: dict | None = None) -> StopResult:
        return stop(targets[i], run_id, grace_s=grace_s, gpus=placements[i].gpus, gpu_idle_mib=idle[i],
                    on_event=on_event, lost_cause=cause)

    out = each(one, len(placements))
    if len(placements) > 1:
        cause = run_cause([res.exit if exc is None else None for res, exc in out])
        if cause is not None:
            for i, (res, exc) in enumerate(out):
                if exc is None and res.exit is None:
                    out[i] = each(lambda _: one(i, cause), 1)[0]
    return [NodeStop(p, res, exc) for p, (res, exc) in zip(placements, out)]


def stop_run(inv, ref: str, *, target: str | None = None, grace_s: float = DEFAULT_GRACE_S,
             on_event: Callable[[Event], None] | None = None) -> RunStop:
    """`dflashctl stop`: the run `ref` wherever it is placed (orchestrator.ops.placement.resolve: the run's
    own target(s) from its record, `target` narrowing or naming one); its recorded GPUs are waited for.

    Raises:
        UserError, RunNotFound, AgentError: for a run on one target, as runstop.stop raises them (a run across
            targets reports each node's error in its NodeStop instead).
    """
    where = resolve(inv, ref, target, kind="run id")
    run_id = where.run_id or ref  # an experiment nothing here recorded: the target is asked for that name
    with opened(inv, [p.target for p in where.placements]) as targets:
        nodes = stop_placements(targets, run_id, where.placements, grace_s=grace_s, on_event=on_event,
                                gpu_idle_mib=[getattr(inv.target(p.target), "gpu_idle_mib", 1024)
                                              for p in where.placements])
    if not where.across and nodes[0].error is not None:
        raise nodes[0].error
    return RunStop(nodes[0].result.run_id if not where.across else run_id, nodes, where.across)
