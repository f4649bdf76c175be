"""launch: an experiment's placements (one target, or every node of a layout across targets), one `launch`
agent call on each, and a workstation record of the run.

A launch across N nodes preflights every node (the launch agent's dry run: no live session, GPUs idle and
unclaimed, the driver, the venv equal to the lock) in parallel, compares the venv fingerprints ACROSS nodes (one
torch on every node), and only when every node passed starts them all, in parallel, with one run id: each
node's agent call runs the same checks again under its launch lock (a race in between is caught there), writes
its run directory and starts its session running `python -m trainer.launch --node I`. A node that cannot start
stops the nodes that did. So a launch across N nodes costs two agent calls (pct execs) per node: a node must
not start before the last one passed, and one agent call cannot wait for the others' verdicts. A launch on one
target is its one agent call.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.agent.driver import PROBLEM_TYPES as DRIVER_PROBLEMS
from orchestrator.agent.requests import (
    DEFAULT_CLAIM_WAIT_S,
    DEFAULT_GRACE_S,
    DEFAULT_RELEASE_TIMEOUT_S,
    LaunchAnswer,
    LaunchRequest,
)
from orchestrator.bundle import build_bundle
from orchestrator.errors import DflashError, PreflightError, UserError
from orchestrator.inventory import check_run_ref
from orchestrator.ops.placement import each, opened
from orchestrator.ops.refusal import agent_or_refuse
from orchestrator.ops.runstop import stop
from orchestrator.ops.spec import LaunchSpec, make_run_id, node_specs, spec_from_inventory
from orchestrator.records import append_record, record_stopped, requested_by

if TYPE_CHECKING:
    from orchestrator.agent.events import Event

__all__ = ["LaunchResult", "LaunchSpec", "RunLaunch", "fingerprint_differences", "launch", "launch_experiment",
           "launch_placements", "launch_request", "make_run_id", "node_specs", "spec_from_inventory"]

# Agent error types that are launch refusals (the user's situation, not a bug): shown as PreflightError.
REFUSALS = {"GpuBusy", "GpuClaimed", "SessionExists", "VenvMismatch", "LockHeld", "ResumeNotFound", "ResumeMismatch",
            "NothingToResume", *DRIVER_PROBLEMS}

FINGERPRINT_KEYS = ("lock_hash", "python", "packages")
"""What must be equal across the nodes' venvs (paths and build times may differ)."""


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
    data_only: bool = False,
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
        data_only: kind dflash: the session runs the data stage alone (regenerate), no training.
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
                             claim_wait_s=claim_wait_s, data_only=data_only)
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
                   claim_wait_s: float, data_only: bool = False) -> dict[str, Any]:
    """The launch verb's request to the agent (orchestrator.agent.requests.LaunchRequest, as JSON)."""
    return LaunchRequest(
        experiment=spec.experiment, run_id=run_id, tag=spec.tag, target=spec.target, kind=spec.kind,
        command=spec.command, env=spec.env, secret_env=list(spec.secret_env), gpus=list(spec.gpus or []),
        layout=spec.layout, config=spec.config,
        gpu_idle_mib=spec.gpu_idle_mib, venv_profile=spec.venv_profile, lock_hash=spec.lock_hash,
        bundle_hash=build_bundle().hash, cli=cli, created=created, replace=replace, grace_s=grace_s,
        release_timeout_s=release_timeout_s, dry_run=dry_run, resume=resume, warmup_device=warmup_device,
        claim_wait_s=claim_wait_s, requested_by=requested_by(f"dflashctl launch {spec.experiment} --replace"),
        node=spec.node, data_venv_profile=spec.data_venv_profile, data_lock_hash=spec.data_lock_hash,
        data_only=data_only,
    ).to_json()


def _record(spec: LaunchSpec, ans: LaunchAnswer, result: LaunchResult, created: str) -> None:
    """Append the launch to the workstation records (and the stop of the run it replaced)."""
    path = append_record({
        "run_id": result.run_id,
        "experiment": spec.experiment,
        "tag": spec.tag,
        "target": spec.target,
        "kind": spec.kind,
        # What actually ran: a resumed run uses the old run's config, and its layout's GPUs.
        "config": ans.config if spec.kind == "dflash" else {"command": spec.command, "env": {
            k: "<secret>" if k in spec.secret_env else v for k, v in spec.env.items()}},
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
        record_stopped(result.replaced, ans.replaced_stopped)


@dataclass
class RunLaunch:
    """What `dflashctl launch` did (or, with dry_run, would do): one LaunchResult per placement (node 0 first;
    one for a run on one target), all with the same run id."""

    run_id: str
    experiment: str
    nodes: list[LaunchResult]
    dry_run: bool = False
    record_path: str | None = None

    @property
    def across(self) -> bool:
        return len(self.nodes) > 1

    @property
    def first(self) -> LaunchResult:
        return self.nodes[0]

    @property
    def run_dir(self) -> str:
        return self.first.run_dir

    @property
    def target(self) -> str:
        return self.first.target

    def to_dict(self) -> dict:
        """Node 0's fields at the top (a run on one target reads as its LaunchResult), every node under `nodes`."""
        return {**self.first.to_dict(), "record_path": self.record_path, "nodes": [n.to_dict() for n in self.nodes]}


def fingerprint_differences(fingerprints: list[dict], targets: list[str]) -> list[str]:
    """How node i's venv differs from node 0's, as lines (empty: one venv everywhere)."""
    out = []
    base = {k: fingerprints[0].get(k) for k in FINGERPRINT_KEYS}
    for i, fp in enumerate(fingerprints[1:], start=1):
        for key in FINGERPRINT_KEYS:
            a, b = base[key], fp.get(key)
            if a == b:
                continue
            if isinstance(a, dict) and isinstance(b, dict):
                names = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
                out += [f"{n}: {a.get(n) or 'absent'} on {targets[0]}, {b.get(n) or 'absent'} on {targets[i]}"
                        for n in names]
            else:
                out.append(f"{key}: {a} on {targets[0]}, {b} on {targets[i]}")
    return out


def _refusal(specs: list, outcomes: list) -> None:
    """Raise one PreflightError naming every node that refused (the first one's fix), if any did."""
    bad = [(s, exc) for s, (_, exc) in zip(specs, outcomes) if exc is not None]
    if not bad:
        return
    lines = [f"node {s.node['index']} ({s.target}): {exc}" for s, exc in bad]
    first = bad[0][1]
    err = PreflightError("launch across nodes refused, nothing started: " + "; ".join(lines),
                         fix=getattr(first, "fix", None))
    err.agent_type = getattr(first, "agent_type", None)  # type: ignore[attr-defined]
    raise err from first


def launch_placements(targets: list, specs: list[LaunchSpec], *, dry_run: bool = False, record: bool = True,
                      now: _dt.datetime | None = None, **kw) -> RunLaunch:
    """Launch one run with specs[i] on targets[i] (opened): on one target its one launch; across targets as the
    module docstring says. `kw`: launch's other keyword arguments (`replace` only on one target).

    Raises:
        PreflightError: a node refused (every refusing node named), or the nodes' venvs differ.
        DflashError: a node could not start (the started nodes were stopped again).
    """
    if len(specs) == 1:
        res = launch(targets[0], specs[0], dry_run=dry_run, record=record, now=now, **kw)
        return RunLaunch(res.run_id, res.experiment, [res], res.dry_run, res.record_path)
    now = now or _dt.datetime.now(_dt.timezone.utc)
    run_id = make_run_id(specs[0].experiment, specs[0].tag, now)

    def one(i: int, dry: bool) -> LaunchResult:
        return launch(targets[i], specs[i], dry_run=dry, record=False, now=now, **kw)

    plans = each(lambda i: one(i, True), len(specs))
    _refusal(specs, plans)
    diff = fingerprint_differences([p.env_fingerprint or {} for p, _ in plans], [s.target for s in specs])
    if diff:
        raise PreflightError("launch across nodes refused, nothing started: the nodes' venvs differ: "
                             + "; ".join(diff[:12]),
                             fix="dflashctl rebuild-venv --target T on each node that differs, then launch again")
    if dry_run:
        return RunLaunch(run_id, specs[0].experiment, [p for p, _ in plans], True)
    started = each(lambda i: one(i, False), len(specs))
    failed = [(s, exc) for s, (_, exc) in zip(specs, started) if exc is not None]
    if failed:
        _undo(targets, started)
        s, exc = failed[0]
        raise DflashError(f"node {s.node['index']} ({s.target}) could not start run {run_id}: {exc}; "
                          "the nodes that had started were stopped", fix=getattr(exc, "fix", None)) from exc
    result = RunLaunch(run_id, specs[0].experiment, [r for r, _ in started])
    if record:
        result.record_path = str(_record_across(result, specs, kw.get("cli"), now))
    return result


def _undo(targets: list, started: list) -> None:
    """Stop the run on every node where it started (a node that failed to start must not leave the others
    waiting for it at the rendezvous)."""
    for t, (res, exc) in zip(targets, started):
        if exc is None and res is not None:
            try:
                stop(t, res.run_id, grace_s=5.0)
            except DflashError:
                pass  # best effort: the rendezvous's join timeout ends it anyway


def _record_across(result: RunLaunch, specs: list[LaunchSpec], cli: str | None, now: _dt.datetime):
    """The workstation record of a run across targets: node 0's fields, and every node under `nodes`."""
    first = result.first
    return append_record({
        "run_id": result.run_id,
        "experiment": result.experiment,
        "tag": specs[0].tag,
        "target": specs[0].target,
        "kind": specs[0].kind,
        "config": specs[0].config,
        "gpus": specs[0].gpus,
        "run_dir": first.run_dir,
        "created": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cli": cli,
        "nodes": [{"index": s.node["index"], "target": s.target, "run_dir": r.run_dir, "session": r.session,
                   "gpus": r.gpus, "command": r.command, "env_fingerprint": r.env_fingerprint,
                   "gpus_seen": r.gpus_seen, "bundle_hash": r.bundle_hash} for s, r in zip(specs, result.nodes)],
        "env_fingerprint": first.env_fingerprint,
        "bundle_hash": first.bundle_hash,
    })


ACROSS_KW = ("cli", "resume", "warmup_device", "on_event", "timeout", "data_only")
"""Keyword arguments of launch that a launch across targets passes on (`replace` is refused there)."""


def launch_experiment(inv, experiment: str, *, target: str | None = None, tag: str | None = None,
                      early=None, **kw) -> RunLaunch:
    """`dflashctl launch`: resolve `experiment` of `inv` into one spec per placement (names checked before
    anything connects), open their targets (the first may take `early`, an
    orchestrator.preconnect.EarlyConnection), launch_placements, close. `kw`: launch's."""
    spec = spec_from_inventory(inv, experiment, target, tag)
    specs = node_specs(inv, spec) if (spec.layout or {}).get("nodes") else [spec]
    if len(specs) > 1:
        if early is not None:  # started for one container's launch; a launch across targets starts with dry runs
            early.close()
            early = None
        if kw.get("replace"):  # refused, not ignored: the live run would stay and the launch be refused later
            raise UserError(f"--replace does not apply to {experiment}: its layout runs across targets "
                            "(stopping the live run on every node first is not built yet)",
                            fix=f"dflashctl stop RUN (the live run of {experiment}), then dflashctl launch {experiment}")
        kw = {k: v for k, v in kw.items() if k in (*ACROSS_KW, "dry_run", "record", "now")}
    with opened(inv, [s.target for s in specs], early) as targets:
        return launch_placements(targets, specs, **kw)
