"""launch: turn an experiment into one `launch` agent call in its target, and keep a workstation record.

Every name that reaches the target (experiment, tag, and so the run id) is checked HERE, before any
transport is touched: a hostile tag never costs a `pct exec`.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from orchestrator import names
from orchestrator.agent.driver import PROBLEM_TYPES as DRIVER_PROBLEMS
from orchestrator.agent.requests import (
    DEFAULT_CLAIM_WAIT_S,
    DEFAULT_GRACE_S,
    DEFAULT_RELEASE_TIMEOUT_S,
    LaunchAnswer,
    LaunchRequest,
)
from orchestrator.errors import AgentError, PreflightError, UserError
from orchestrator.inventory import check_name, check_run_ref
from orchestrator.ops.stop import requested_by

if TYPE_CHECKING:
    from orchestrator.agent.events import Event

# Agent error types that are launch refusals (the user's situation, not a bug): shown as PreflightError.
REFUSALS = {"GpuBusy", "GpuClaimed", "SessionExists", "VenvMismatch", "LockHeld", "ResumeNotFound", "ResumeMismatch",
            "NothingToResume", *DRIVER_PROBLEMS}


@dataclass
class LaunchSpec:
    """What to launch, resolved from the inventory (or built directly by tests and scripts)."""

    experiment: str
    kind: str
    """`dflash` (the bundled trainer) or `command` (any argv)."""
    target: str
    """Target name (recorded; the Target object is passed separately)."""
    tag: str | None = None
    command: list[str] = field(default_factory=list)
    """kind command: the argv."""
    env: dict[str, str] = field(default_factory=dict)
    """kind command: extra environment."""
    gpus: list[int] = field(default_factory=list)
    """Every GPU the run occupies (checked idle; CUDA_VISIBLE_DEVICES for kind command)."""
    layout: dict | None = None
    """kind dflash: {target_gpus, drafter_gpus}."""
    config: dict | None = None
    """kind dflash: the resolved TrainConfig as a dict (written to runs/<id>/config.json)."""
    gpu_idle_mib: int = 1024
    venv_profile: dict = field(default_factory=dict)
    lock_hash: str | None = None
    """The expected venv lock hash; None: no lock to compare (the workstation interpreter)."""
    node: dict | None = None
    """A layout across targets: this node's {index, count, targets} (orchestrator.ops.nodes); None: one node."""

    def validate(self) -> None:
        """Raises UserError for an unsafe experiment/target/tag name or an unknown kind."""
        check_name("experiment", self.experiment)
        check_name("target", self.target)
        if self.tag is not None:
            check_name("tag", self.tag)
        if self.kind not in ("dflash", "command"):
            raise UserError(f"experiment {self.experiment}: unknown kind {self.kind!r}", fix="use kind: dflash or kind: command")
        if self.kind == "command" and not self.command:
            raise UserError(f"experiment {self.experiment}: kind command needs a `command:` argv")


def make_run_id(experiment: str, tag: str | None, now: _dt.datetime | None = None) -> str:
    """`<experiment>[-<tag>]-<YYYYmmddTHHMMSSZ>` (UTC): names.run_id, with a UserError for a bad name."""
    check_name("experiment", experiment)
    if tag is not None:
        check_name("tag", tag)
    return names.run_id(experiment, tag, now)


def spec_from_inventory(inv, experiment: str, target: str | None = None, tag: str | None = None) -> LaunchSpec:
    """Resolve an experiment of the inventory into a LaunchSpec.

    Raises:
        InventoryError / UserError: unknown or unsafe names.
    """
    exp = inv.experiment(experiment)
    if exp.kind == "dflash" and exp.layout.nodes and target not in (None, exp.target):
        raise UserError(f"experiment {experiment} runs on the targets of its layout's nodes "
                        f"({', '.join(exp.layout.node_targets())}); --target {target} cannot move it",
                        fix=f"dflashctl launch {experiment}   (or edit experiments.{experiment}.layout.nodes)")
    tname = target or exp.target
    tspec = inv.target(tname)
    vname = exp.venv or tspec.venv
    vspec = inv.venv(vname)
    spec = LaunchSpec(
        experiment=experiment,
        kind=exp.kind,
        target=tname,
        tag=tag,
        gpu_idle_mib=getattr(tspec, "gpu_idle_mib", 1024),
        venv_profile={"name": vname, **vspec.model_dump()},
        lock_hash=expected_lock_hash(vspec),
    )
    if exp.kind == "dflash":
        spec.layout = exp.layout.model_dump()
        spec.gpus = list(exp.layout.gpus)
        spec.config = trainer_config(experiment, exp)
    else:
        spec.command = list(exp.command)
        spec.env = dict(exp.env)
        spec.gpus = list(exp.gpus)
    spec.validate()
    return spec


def trainer_config(name: str, exp) -> dict:
    """The experiment's TrainConfig as a dict with the inventory's GPU layout written into its `layout`
    section (what `python -m trainer.launch` reads); the trainer section's own layout keys (timeout_s,
    prefetch, CPU process counts) are kept.

    Raises:
        UserError: the trainer section lists other GPUs than the experiment's `layout:`, or CPU process
            counts beside GPUs, or the result is not a valid trainer config.
    """
    from trainer.config import ConfigError, parse_config

    config = exp.trainer.model_dump(mode="json")
    lay = dict(config.get("layout") or {})
    if exp.layout.nodes:
        from orchestrator.inventory import trainer_layout

        lay.update(trainer_layout(exp.layout), target_gpus=[], drafter_gpus=[])
    for key in ("target_gpus", "drafter_gpus") if not exp.layout.nodes else ():
        want = list(getattr(exp.layout, key))
        own = list(lay.get(key) or [])
        if own and own != want:
            raise UserError(
                f"experiment {name}: trainer.layout.{key} {own} differs from layout.{key} {want}",
                fix=f"list the GPUs once, in experiments.{name}.layout, and drop trainer.layout.{key}",
            )
        lay[key] = want
    config["layout"] = lay
    try:
        parse_config(config, source=f"experiments.{name}.trainer")
    except ConfigError as exc:
        raise UserError(str(exc), fix=f"fix experiments.{name} (layout / trainer sections)") from None
    return config


def expected_lock_hash(vspec) -> str | None:
    """The lock hash a uv venv profile must match (None for the workstation interpreter: no lock).

    Raises:
        UserError: the profile names a lock that does not exist.
    """
    if getattr(vspec, "kind", None) != "uv":
        return None
    from orchestrator.ops.lock import resolve_lock

    return resolve_lock(vspec.lock).hash


@dataclass
class LaunchResult:
    """What launch did (or, with dry_run, would do)."""

    run_id: str
    run_dir: str
    session: str
    target: str
    experiment: str
    command: list[str]
    gpus: list[int]
    replaced: str | None
    dry_run: bool
    plan: dict | None = None
    record_path: str | None = None
    resumed_from: str | None = None
    env_fingerprint: dict | None = None
    gpus_seen: list | None = None
    bundle_hash: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def launch(
    target,
    spec: LaunchSpec,
    *,
    replace: bool = False,
    dry_run: bool = False,
    grace_s: float = DEFAULT_GRACE_S,
    release_timeout_s: float = DEFAULT_RELEASE_TIMEOUT_S,
    on_event: Callable[[Event], None] | None = None,
    cli: str | None = None,
    record: bool = True,
    now: _dt.datetime | None = None,
    timeout: float | None = 3600,
    resume: str | None = None,
    warmup_device: str = "cuda",
    claim_wait_s: float = DEFAULT_CLAIM_WAIT_S,
) -> LaunchResult:
    """Launch `spec` on `target` in ONE agent call; append a workstation run record.

    Args:
        target: a BaseTarget (LocalTarget or ContainerTarget).
        spec: the resolved experiment.
        replace: stop the experiment's live run first (SIGINT, SIGTERM, SIGKILL), wait for its GPUs.
        dry_run: check and plan only; nothing is written anywhere.
        on_event: receives each progress event of the agent.
        cli: the workstation command line, recorded in run.json.
        record: append to the workstation records (runs.jsonl).
        timeout: seconds for the whole agent call (warm-ups of several GPUs included).
        resume: a run id of this experiment on this target: the new run continues it from its newest
            complete checkpoint, with the old run's config (kind command: DFLASHCTL_RESUME_DIR is set).
        warmup_device: `--device` of the GPU warm-ups ("cpu" only for tests on a GPU-less machine).
        claim_wait_s: seconds to wait for another launch's preflight that holds one of the GPUs.
    Returns:
        LaunchResult.
    Raises:
        UserError: unsafe names or run id (before anything reaches the target).
        PreflightError: refused (GpuBusy / GpuClaimed / SessionExists / VenvMismatch / LockHeld /
            ResumeNotFound / ResumeMismatch / NothingToResume), naming what exactly.
        AgentError, ConnectError, PctError: the target could not do it.
    """
    spec.validate()
    if resume is not None:
        check_run_ref(resume)
    created = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    request = launch_request(spec, created=created, run_id=make_run_id(spec.experiment, spec.tag, now), cli=cli,
                             replace=replace, grace_s=grace_s, release_timeout_s=release_timeout_s,
                             dry_run=dry_run, resume=resume, warmup_device=warmup_device,
                             claim_wait_s=claim_wait_s)
    ans = agent_or_refuse(target, "launch", request, REFUSALS, f"launch {spec.experiment} on {spec.target}",
                          on_event=on_event, timeout=timeout, answer=LaunchAnswer)
    result = LaunchResult(
        run_id=ans.run_id, run_dir=ans.run_dir, session=ans.session, target=spec.target, experiment=spec.experiment,
        command=ans.command, gpus=ans.gpus, replaced=ans.replaced, dry_run=ans.dry_run, plan=ans.plan,
        resumed_from=ans.resumed_from, env_fingerprint=ans.env_fingerprint, gpus_seen=ans.gpus_seen,
        bundle_hash=ans.bundle_hash,
    )
    if record and not result.dry_run:
        _record(spec, ans, result, created)
    return result



def launch_request(spec: LaunchSpec, *, created: str, run_id: str, cli: str | None, replace: bool, grace_s: float,
                   release_timeout_s: float, dry_run: bool, resume: str | None, warmup_device: str,
                   claim_wait_s: float) -> dict[str, Any]:
    """The launch verb's request to the agent (orchestrator.agent.requests.LaunchRequest, as JSON)."""
    from orchestrator.bundle import build_bundle

    return LaunchRequest(
        experiment=spec.experiment, run_id=run_id, tag=spec.tag, target=spec.target, kind=spec.kind,
        command=spec.command, env=spec.env, gpus=list(spec.gpus or []), layout=spec.layout, config=spec.config,
        gpu_idle_mib=spec.gpu_idle_mib, venv_profile=spec.venv_profile, lock_hash=spec.lock_hash,
        bundle_hash=build_bundle().hash, cli=cli, created=created, replace=replace, grace_s=grace_s,
        release_timeout_s=release_timeout_s, dry_run=dry_run, resume=resume, warmup_device=warmup_device,
        claim_wait_s=claim_wait_s, requested_by=requested_by(f"dflashctl launch {spec.experiment} --replace"),
        node=spec.node,
    ).to_json()


def _record(spec: LaunchSpec, ans: LaunchAnswer, result: LaunchResult, created: str) -> None:
    """Append the launch to the workstation records (and the stop of the run it replaced)."""
    from orchestrator.records import append_record

    path = append_record({
        "run_id": result.run_id,
        "experiment": spec.experiment,
        "tag": spec.tag,
        "target": spec.target,
        "kind": spec.kind,
        # What actually ran: a resumed run uses the old run's config, and its layout's GPUs.
        "config": ans.config if spec.kind == "dflash" else {"command": spec.command, "env": spec.env},
        "gpus": ans.gpus,
        "gpus_seen": ans.gpus_seen,
        "env_fingerprint": ans.env_fingerprint,
        "bundle_hash": ans.bundle_hash,
        "run_dir": result.run_dir,
        "created": created,
        "replaced": result.replaced,
        "resumed_from": result.resumed_from,
    })
    result.record_path = str(path)
    if result.replaced and ans.replaced_stopped is not None:
        from orchestrator.records import record_stopped

        record_stopped(result.replaced, ans.replaced_stopped)


def launch_experiment(inv, experiment: str, *, target: str | None = None, tag: str | None = None,
                      early=None, **kw):
    """`dflashctl launch`: resolve `experiment` of `inv` (names checked before anything connects), open its
    target (or `target`), launch, close. `early`: an orchestrator.preconnect.EarlyConnection; `kw`: launch's.
    Returns a LaunchResult, or for a layout across targets a nodes.NodesResult."""
    from orchestrator.target import open_target

    spec = spec_from_inventory(inv, experiment, target, tag)
    if (spec.layout or {}).get("nodes"):  # a layout across targets: every node (orchestrator.ops.nodes)
        from orchestrator.ops import nodes

        if early is not None:
            early.close()
        if kw.get("replace"):  # refused, not ignored: the live run would stay and the launch be refused later
            raise UserError(f"--replace does not apply to {experiment}: its layout runs across targets "
                            "(stopping the live run on every node first is not built yet)",
                            fix=f"dflashctl stop RUN (the live run of {experiment}), then dflashctl launch {experiment}")
        return nodes.launch_experiment(inv, spec, **{k: v for k, v in kw.items() if k in nodes.LAUNCH_KW})
    tgt = open_target(inv, spec.target, early)
    try:
        return launch(tgt, spec, **kw)
    finally:
        tgt.close()


def agent_or_refuse(target, verb: str, request: dict, refusals: set[str], what: str, *, on_event=None,
                    timeout: float | None = None, answer: type | None = None):
    """One agent call (returning its typed `answer`); an error event whose type is in `refusals` becomes a
    PreflightError ("<what> refused: ...") carrying the agent's type and data, anything else propagates as the
    AgentError it is."""
    try:
        return target.agent(verb, request, on_event=on_event, timeout=timeout, answer=answer)
    except AgentError as exc:
        if exc.agent_type in refusals:
            err = PreflightError(f"{what} refused: {exc.message}", fix=exc.fix)
            err.agent_type, err.data = exc.agent_type, exc.data  # type: ignore[attr-defined]
            raise err from None
        raise
