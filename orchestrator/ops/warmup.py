"""warmup: compile an experiment's training shapes on every drafter GPU of its target, in ONE agent call.

The same driver as launch's warm-up step (orchestrator/agent/warmup.py): one `python -m trainer.warmup`
process per drafter GPU, one after another, the cache in `<workdir>/inductor-cache` unless the experiment's
`compile.cache_dir` says otherwise. A CPU layout gets one warm-up on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from orchestrator.agent.requests import WarmupAnswer, WarmupRequest
from orchestrator.errors import UserError
from orchestrator.ops.refusal import agent_or_refuse
from orchestrator.ops.spec import spec_from_inventory

if TYPE_CHECKING:
    from orchestrator.agent.events import Event

REFUSALS = {"GpuBusy", "GpuClaimed", "LockHeld"}


@dataclass
class WarmupResult:
    """What the warm-up did: one summary per device, in the order they ran."""

    experiment: str
    target: str
    cache_dir: str
    dir: str
    """`<workdir>/warmup/<experiment>/` on the target: config.json, warmup.log, warmup.json."""
    warmups: list[dict] = field(default_factory=list)
    """{gpu (None: CPU), device, compile_s, cache_hits, cache_misses, wall_s, ...} per device."""

    def to_dict(self) -> dict:
        return asdict(self)


def warmup(
    target,
    spec,
    *,
    on_event: Callable[[Event], None] | None = None,
    device: str = "cuda",
    timeout: float | None = 3600,
) -> WarmupResult:
    """Warm up `spec` (a kind dflash LaunchSpec, see ops.launch.spec_from_inventory) on `target`.

    Args:
        target: a BaseTarget.
        spec: the resolved experiment (its config carries the inventory layout).
        on_event: receives each progress event (per shape and per GPU: compile seconds, cache hits/misses).
        device: `--device` of the GPU warm-ups ("cpu" only for tests on a GPU-less machine).
        timeout: seconds for the whole call (every GPU's compile included).
    Returns:
        WarmupResult.
    Raises:
        UserError: not a kind dflash experiment, or unsafe names.
        PreflightError: a drafter GPU is busy or claimed, or a launch of the experiment holds its lock.
        AgentError: a warm-up failed (type WarmupFailed; the message has the log's last lines).
    """
    spec.validate()
    if spec.kind != "dflash":
        raise UserError(f"experiment {spec.experiment} is kind {spec.kind}: only kind dflash (the bundled trainer) "
                        "has shapes to warm up", fix="warm up a kind dflash experiment")
    request = WarmupRequest(experiment=spec.experiment, config=spec.config or {}, layout=spec.layout or {},
                            gpu_idle_mib=spec.gpu_idle_mib, device=device).to_json()
    ans = agent_or_refuse(target, "warmup", request, REFUSALS, f"warmup {spec.experiment} on {spec.target}",
                          on_event=on_event, timeout=timeout, answer=WarmupAnswer)
    return WarmupResult(experiment=spec.experiment, target=spec.target, cache_dir=ans.cache_dir, dir=ans.dir,
                        warmups=list(ans.warmups))


def warmup_experiment(inv, experiment: str, *, target: str | None = None,
                      on_event: Callable[[Event], None] | None = None, early=None) -> WarmupResult:
    """`dflashctl warmup`: resolve `experiment` (names checked before anything runs), open its target (or
    `target`; `early`: an orchestrator.preconnect.EarlyConnection), warm up, close."""
    from orchestrator.target import open_target

    spec = spec_from_inventory(inv, experiment, target)
    tgt = open_target(inv, spec.target, early)
    try:
        return warmup(tgt, spec, on_event=on_event)
    finally:
        tgt.close()
