"""A layout across targets: one run on several containers (nodes), one tmux session and one agent call each.

`launch_nodes` preflights every node (the launch agent's dry run: no live session, GPUs idle and unclaimed,
the driver, the venv equal to the lock) in parallel, then compares the venv fingerprints ACROSS nodes (one
torch on every node), and only when every node passed starts them all, in parallel, with one run id: each
node's agent call runs the same checks again under its launch lock (a race in between is caught there),
writes its run directory and starts its session running `python -m trainer.launch --node I`. A node that
cannot start stops the nodes that did. So a launch across N nodes costs two agent calls (pct execs) per node:
a node must not start before the last one passed, and one agent call cannot wait for the others' verdicts.

`stop_nodes` stops the run on every node. The workstation record of such a run lists its nodes (`nodes`:
index, target, run_dir, gpus, env_fingerprint), which `stop`, `status` and `runs diff` read.
"""

from __future__ import annotations

import copy
import datetime as _dt
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from orchestrator.agent.requests import DEFAULT_GRACE_S
from orchestrator.errors import DflashError, PreflightError, UserError

if TYPE_CHECKING:
    from orchestrator.agent.events import Event

FINGERPRINT_KEYS = ("lock_hash", "python", "packages")
"""What must be equal across the nodes' venvs (paths and build times may differ)."""


@dataclass
class NodesResult:
    """What a launch across nodes did (or, with dry_run, would do)."""

    run_id: str
    experiment: str
    nodes: list[dict] = field(default_factory=list)
    """Per node: index, target, run_dir, session, gpus, command (as the node's LaunchResult has them)."""
    dry_run: bool = False
    record_path: str | None = None

    @property
    def target(self) -> str:
        return self.nodes[0]["target"]

    def to_dict(self) -> dict:
        return asdict(self)


def node_specs(inv, spec) -> list:
    """One LaunchSpec per node of `spec` (a dflash spec whose layout lists nodes): the node's target, its GPUs,
    its target's venv profile and lock, and `node` (index, count, targets); the config is the same for all.

    Raises:
        UserError: a node's venv profile locks another lock than node 0's.
    """
    from orchestrator.ops.launch import expected_lock_hash

    nodes = spec.layout["nodes"]
    names = [n["target"] for n in nodes]
    out = []
    for i, n in enumerate(nodes):
        tspec = inv.target(n["target"])
        vname = inv.experiment(spec.experiment).venv or tspec.venv
        vspec = inv.venv(vname)
        one = copy.deepcopy(spec)
        one.target = n["target"]
        one.gpus = [*n.get("target_gpus", []), *n.get("drafter_gpus", [])]
        one.layout = {"target_gpus": list(n.get("target_gpus", [])), "drafter_gpus": list(n.get("drafter_gpus", []))}
        one.gpu_idle_mib = getattr(tspec, "gpu_idle_mib", 1024)
        one.venv_profile = {"name": vname, **vspec.model_dump()}
        one.lock_hash = expected_lock_hash(vspec)
        one.node = {"index": i, "count": len(nodes), "targets": names}
        out.append(one)
    locks = {s.lock_hash for s in out}
    if len(locks) > 1:
        raise UserError(
            f"experiment {spec.experiment}: its nodes' venv profiles lock different things "
            + ", ".join(f"{s.target}: {s.venv_profile['name']} ({s.lock_hash})" for s in out),
            fix="give every node's target the same venv profile, or set the experiment's `venv:`",
        )
    return out


def _each(fn: Callable[[int], object], count: int) -> list[tuple[object | None, BaseException | None]]:
    """fn(0..count-1) in parallel threads; (result, None) or (None, the exception) per node, in order."""

    def safe(i: int):
        try:
            return fn(i), None
        except BaseException as exc:  # noqa: BLE001 - every node's outcome is reported, none swallowed
            return None, exc

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(safe, range(count)))


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


def launch_nodes(targets: list, specs: list, *, dry_run: bool = False, cli: str | None = None,
                 resume: str | None = None, warmup_device: str = "cuda", record: bool = True,
                 now: _dt.datetime | None = None, on_event: Callable[[Event], None] | None = None,
                 timeout: float | None = 3600) -> NodesResult:
    """Launch one run across `targets` (one per node, node 0 first), as the module docstring says.

    Raises:
        PreflightError: a node refused (every refusing node named), or the nodes' venvs differ.
        DflashError: a node could not start (the started nodes were stopped again).
    """
    from orchestrator.ops.launch import launch, make_run_id

    now = now or _dt.datetime.now(_dt.timezone.utc)
    run_id = make_run_id(specs[0].experiment, specs[0].tag, now)

    def one(i: int, dry: bool):
        return launch(targets[i], specs[i], dry_run=dry, cli=cli, record=False, now=now, resume=resume,
                      warmup_device=warmup_device, on_event=on_event, timeout=timeout)

    plans = _each(lambda i: one(i, True), len(specs))
    _refusal(specs, plans)
    diff = fingerprint_differences([p.env_fingerprint or {} for p, _ in plans], [s.target for s in specs])
    if diff:
        raise PreflightError("launch across nodes refused, nothing started: the nodes' venvs differ: "
                             + "; ".join(diff[:12]),
                             fix="dflashctl rebuild-venv --target T on each node that differs, then launch again")
    if dry_run:
        return NodesResult(run_id, specs[0].experiment, [_node_dict(s, p) for s, (p, _) in zip(specs, plans)], True)
    started = _each(lambda i: one(i, False), len(specs))
    failed = [(s, exc) for s, (_, exc) in zip(specs, started) if exc is not None]
    if failed:
        _undo(targets, specs, started)
        s, exc = failed[0]
        raise DflashError(f"node {s.node['index']} ({s.target}) could not start run {run_id}: {exc}; "
                             "the nodes that had started were stopped", fix=getattr(exc, "fix", None)) from exc
    result = NodesResult(run_id, specs[0].experiment, [_node_dict(s, r) for s, (r, _) in zip(specs, started)])
    if record:
        result.record_path = str(_record(result, specs, [r for r, _ in started], cli, now))
    return result


def _node_dict(spec, res) -> dict:
    return {"index": spec.node["index"], "target": spec.target, "run_dir": res.run_dir, "session": res.session,
            "gpus": res.gpus, "command": res.command}


def _undo(targets: list, specs: list, started: list) -> None:
    """Stop the run on every node where it started (a node that failed to start must not leave the others
    waiting for it at the rendezvous)."""
    from orchestrator.ops.stop import stop

    for t, s, (res, exc) in zip(targets, specs, started):
        if exc is None and res is not None:
            try:
                stop(t, res.run_id, grace_s=5.0)
            except DflashError:
                pass  # best effort: the rendezvous's join timeout ends it anyway


def _record(result: NodesResult, specs: list, runs: list, cli: str | None, now: _dt.datetime):
    from orchestrator.records import append_record

    return append_record({
        "run_id": result.run_id,
        "experiment": result.experiment,
        "tag": specs[0].tag,
        "target": specs[0].target,
        "kind": specs[0].kind,
        "config": specs[0].config,
        "gpus": specs[0].gpus,
        "run_dir": runs[0].run_dir,
        "created": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cli": cli,
        "nodes": [{**_node_dict(s, r), "env_fingerprint": r.env_fingerprint, "gpus_seen": r.gpus_seen,
                   "bundle_hash": r.bundle_hash} for s, r in zip(specs, runs)],
        "env_fingerprint": runs[0].env_fingerprint,
        "bundle_hash": runs[0].bundle_hash,
    })


def run_cause(exits: list[dict | None]) -> dict | None:
    """The run's root cause from its nodes' exit.json: a rank's own failure first, else a node's report of a
    rank it lost on another node (`lost`), else any node's cause; None when no node recorded one."""
    causes = [e.get("root_cause") for e in exits if e and isinstance(e.get("root_cause"), dict)]
    for good in (lambda c: not c.get("peer_lost"), lambda c: c.get("lost"), lambda c: True):
        found = [c for c in causes if good(c)]
        if found:
            return found[0]
    return None


def stop_nodes(targets: list, run_id: str, record: dict, *, grace_s: float = DEFAULT_GRACE_S,
               on_event: Callable[[Event], None] | None = None) -> list:
    """Stop run `run_id` on every node of its record, in parallel (a node already ended is reported as such);
    a node that vanished without exit.json (its container was stopped) then gets exit.json failed with the
    run's root cause (run_cause of the other nodes).

    Returns:
        One StopResult (or the exception) per node, node 0 first.
    """
    from orchestrator.ops.stop import stop

    nodes = record.get("nodes") or []

    def one(i: int, cause: dict | None = None):
        return stop(targets[i], run_id, grace_s=grace_s, gpus=nodes[i].get("gpus") or [], on_event=on_event,
                    lost_cause=cause)

    out = _each(one, len(nodes))
    cause = run_cause([res.exit if exc is None else None for res, exc in out])
    if cause is not None:
        for i, (res, exc) in enumerate(out):
            if exc is None and res.exit is None:
                out[i] = _each(lambda _: one(i, cause), 1)[0]
    return [res if exc is None else exc for res, exc in out]


LAUNCH_KW = ("dry_run", "cli", "resume", "warmup_device", "record", "now", "on_event", "timeout")
"""The keyword arguments of launch_nodes (`launch --replace` is refused across nodes: ops.launch)."""


def launch_experiment(inv, spec, **kw) -> NodesResult:
    """`launch` of an experiment whose layout lists nodes: open every node's target, launch_nodes, close.
    Keyword arguments go to launch_nodes."""
    from orchestrator.target import open_target

    specs = node_specs(inv, spec)
    targets = []
    try:
        for s in specs:
            targets.append(open_target(inv, s.target))
        return launch_nodes(targets, specs, **kw)
    finally:
        for t in targets:
            t.close()


def stop_run(inv, record: dict, *, grace_s: float = DEFAULT_GRACE_S, on_event: Callable[[Event], None] | None = None) -> list:
    """`stop` of a run across targets (its record lists nodes): stop_nodes over every node's target."""
    from orchestrator.target import open_target

    targets = []
    try:
        for n in record.get("nodes") or []:
            targets.append(open_target(inv, n["target"]))
        return stop_nodes(targets, record["run_id"], record, grace_s=grace_s, on_event=on_event)
    finally:
        for t in targets:
            t.close()


class _Cancelled(Exception):
    """A node's follow was called off (its container is gone; the run ended elsewhere)."""


LOST_NODE_GRACE_S = 60.0
"""After one node's run ended failed, how long the follow waits for the others' exit.json (torch ends their
ranks within seconds) before it stops waiting for a node it cannot reach."""

_WORST = {"failed": 0, "crashed": 1, "lost": 2, "stopped": 3, "running": 4, "succeeded": 5}


def follow_nodes(inv, record: dict, *, tail: int | None = None, following: bool = True,
                 on_line: Callable[[str], None] | None = None, on_status: Callable[[str], None] | None = None,
                 backoff=None):
    """`logs` of a run across targets: every node's log followed at once (orchestrator.ops.logs.follow, one
    thread each, each with its own reconnects, so a cut to one node does not stop the others), every line as
    `[TARGET] <line>` (the trainer's own prefix names the node's rank); ends when every node's run has ended,
    or, once one ended failed, when a node it names as lost (or any node, after LOST_NODE_GRACE_S) still
    cannot be reached. Returns the run's outcome: the worst node's, with the run's root cause (run_cause).
    """
    import threading

    from orchestrator.ops.logs import FollowOutcome, build_matcher, follow
    from orchestrator.target import open_target

    nodes = record["nodes"]
    lock, cancel = threading.Lock(), [threading.Event() for _ in nodes]
    outcomes: list = [None] * len(nodes)

    def emit(fn, text: str) -> None:
        if fn is not None:
            with lock:
                fn(text)

    def sleep_or_cancel(i: int, seconds: float) -> None:
        if cancel[i].wait(seconds):
            raise _Cancelled()

    def one(i: int) -> None:
        n, tgt = nodes[i], open_target(inv, nodes[i]["target"])
        try:
            outcomes[i] = follow(tgt, record["run_id"], tail=tail, follow=following, matcher=build_matcher(inv),
                                 on_line=lambda text: emit(on_line, f"[{n['target']}] {text}"),
                                 on_status=lambda text: emit(on_status, f"[{n['target']}] {text}"),
                                 backoff=backoff, sleep=lambda s: sleep_or_cancel(i, s))
        except _Cancelled:
            outcomes[i] = FollowOutcome(record["run_id"], record.get("experiment"), "lost",
                                        error=f"node {i} ({n['target']}) unreachable after the run ended elsewhere")
        finally:
            tgt.close()
        _call_off(i, outcomes, cancel)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _run_outcome(outcomes)


def _call_off(i: int, outcomes: list, cancel: list) -> None:
    """Node i's follow ended: when its run failed, stop waiting for the node it names as lost at once, and
    for every other node after LOST_NODE_GRACE_S (a timer)."""
    import threading

    out = outcomes[i]
    if out is None or out.state not in ("failed", "crashed"):
        return
    lost = ((out.exit or {}).get("root_cause") or {}).get("lost") or {}
    if isinstance(lost.get("node"), int) and 0 <= lost["node"] < len(cancel):
        cancel[lost["node"]].set()
    timer = threading.Timer(LOST_NODE_GRACE_S, lambda: [c.set() for c in cancel])
    timer.daemon = True
    timer.start()


def _run_outcome(outcomes: list):
    """The worst node's outcome, its exit carrying the run's root cause."""
    worst = min((o for o in outcomes if o is not None), key=lambda o: _WORST.get(o.state, 0))
    cause = run_cause([o.exit for o in outcomes if o is not None])
    if cause is not None and worst.exit is not None:
        worst.exit = {**worst.exit, "root_cause": cause}
    worst.matches = [m for o in outcomes if o is not None for m in o.matches]
    return worst
