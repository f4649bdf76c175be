"""Where a run is: its placements (target, run directory, GPUs, session, node), resolved ONCE per command from
the workstation's run record first, then the inventory's experiment, then a bare run id on a target. Every
verb that acts on a run (stop, logs, attach, metrics) maps over what `resolve` returns; a run on one target is
a list of one.

Resolution order for `ref` (a run id, a unique prefix of one, or an experiment name):
1. a run this workstation recorded for this inventory (exact id, else the experiment's newest, else the one run
   the prefix names; a record whose target is not here, or whose run directory is not in that target's
   workdir, is another inventory's): its own target(s), run directory and GPUs; `--target` narrows a run
   across targets to that node (or names another target outright); a run id recorded only elsewhere is
   refused, naming where it was launched;
2. an experiment of the inventory with no recorded run: its target(s), the run left to the target (its
   newest run of the experiment);
3. anything else: a run id on `--target`, else the inventory's first target.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TypeVar

from orchestrator import names
from orchestrator.agent.rundirs import runs_root
from orchestrator.errors import RunNotFound
from orchestrator.inventory import LocalTargetSpec, check_name, check_run_ref
from orchestrator.records import RunRecord, find_run
from orchestrator.target import open_target

T = TypeVar("T")


@dataclass(frozen=True)
class Placement:
    """One target's share of a run."""

    target: str
    run_dir: str | None = None
    """As recorded at launch (None: not known here; the target finds it)."""
    gpus: list[int] = field(default_factory=list)
    """The GPUs the run holds there (recorded at launch; empty: none known or CPU)."""
    session: str | None = None
    """The run's tmux session there (None: no experiment known, so no session name)."""
    node: int | None = None
    """The node index of a run across targets; None for a run on one target."""


@dataclass(frozen=True)
class RunPlacements:
    """A run reference resolved: which run, and where."""

    run_id: str | None
    """None: the newest run (of `experiment`, if given) on each placement's target, as the target knows it."""
    experiment: str | None
    placements: list[Placement]
    record: RunRecord | None = None
    """This workstation's record of the run, when it has one."""

    @property
    def across(self) -> bool:
        """Whether the run spans several targets (its verbs then report per node)."""
        return len(self.placements) > 1 or any(p.node is not None for p in self.placements)


def _session(experiment: str | None) -> str | None:
    return names.session_name(check_name("experiment", experiment)) if experiment else None


def _from_record(rec: RunRecord, target: str | None, default: str) -> list[Placement]:
    session = _session(rec.experiment)
    if rec.nodes:
        mine = [Placement(n.target, n.run_dir, list(n.gpus), session, n.index) for n in rec.nodes]
        chosen = [p for p in mine if target is None or p.target == target]
        return chosen or [Placement(target or default, session=session)]
    if target is None or target == rec.target:
        return [Placement(rec.target or default, rec.run_dir, list(rec.gpus), session)]
    return [Placement(target, session=session)]


def _reached(inv, rec: RunRecord) -> bool:
    """Whether a record is of a run this inventory reaches: each of its targets is here and each recorded run
    directory is in that target's `<workdir>/runs/`. A record another inventory wrote for a target of the same
    name, or one from before the target's workdir moved, is not this inventory's run."""
    for name, run_dir in [(n.target, n.run_dir) for n in rec.nodes] or [(rec.target, rec.run_dir)]:
        if name is None:
            continue  # (a record without a target: the inventory's first, as before)
        spec = inv.targets.get(name)
        if spec is None:
            return False
        workdir = spec.resolved_workdir() if isinstance(spec, LocalTargetSpec) else spec.workdir
        if run_dir is not None and PurePosixPath(run_dir).parent != PurePosixPath(runs_root(workdir)):
            return False
    return True


def _refuse_recorded_elsewhere(ref: str) -> None:
    """A run id this workstation recorded for a target this inventory does not reach: say so, not "no run".

    Raises:
        RunNotFound: naming where the run was launched.
    """
    try:
        rec = find_run(ref)
    except RunNotFound:
        return
    if rec.run_id != ref:
        return  # a prefix of a run elsewhere: looked for as a run id on the target, as any other
    parts = [(n.target, n.run_dir) for n in rec.nodes] or [(rec.target, rec.run_dir)]
    where = ", ".join(f"target {t} ({d or 'run directory not recorded'})" for t, d in parts)
    raise RunNotFound(f"run {ref!r} was launched on {where}, which this inventory does not reach (no such target "
                      "here, or its workdir is another): it was launched with another inventory, or the workdir moved",
                      fix="dflashctl runs  (this workstation's runs, with their targets)")


def resolve(inv, ref: str | None, target: str | None = None, *, kind: str = "run id or experiment") -> RunPlacements:
    """The run `ref` means and where it is (the module docstring says in which order it is looked for);
    `kind` names `ref` in the error for a bad name.

    Raises:
        UserError: `ref` or a recorded experiment breaks the name rule (before anything connects).
        RunNotFound: a prefix that names several recorded runs (they are listed).
    """
    default = target or inv.default_target()
    if ref is None:
        return RunPlacements(None, None, [Placement(default)])
    check_run_ref(ref, kind)
    try:
        rec = find_run(ref, fits=lambda r: _reached(inv, r))
    except RunNotFound as exc:
        if "matches" in exc.message:  # an ambiguous prefix: the user must say which
            raise
        rec = None
    if rec is not None:
        return RunPlacements(rec.run_id, rec.experiment, _from_record(rec, target, inv.default_target()), rec)
    if ref not in inv.experiments:
        _refuse_recorded_elsewhere(ref)
    if ref in inv.experiments:
        exp = inv.experiments[ref]
        session = _session(ref)
        nodes = exp.layout.node_targets() if exp.kind == "dflash" and exp.layout.nodes else []
        if target is not None or not nodes:
            return RunPlacements(None, ref, [Placement(target or exp.target, session=session)])
        return RunPlacements(None, ref, [Placement(t, session=session, node=i) for i, t in enumerate(nodes)])
    return RunPlacements(ref, None, [Placement(default)])


def resolve_first(inv, ref: str | None, target: str | None = None) -> tuple[str, str | None, str | None]:
    """(target name, run id or None, experiment or None) of the first placement `resolve` finds: for a verb
    that reads one target's copy of a run (`metrics`).

    Raises:
        UserError, RunNotFound: as `resolve`.
    """
    where = resolve(inv, ref, target)
    return where.placements[0].target, where.run_id, where.experiment


def each(fn: Callable[[int], T], count: int) -> list[tuple[T | None, BaseException | None]]:
    """fn(0..count-1), in parallel threads when count > 1; (result, None) or (None, the exception) per index,
    in order: every placement's outcome is reported, none swallowed."""

    def safe(i: int):
        try:
            return fn(i), None
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller, who reports it
            return None, exc

    if count == 1:
        return [safe(0)]
    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(safe, range(count)))


@contextmanager
def opened(inv, names_: list[str], early=None) -> Iterator[list]:
    """The targets named, opened in order (the first one may take `early`, an
    orchestrator.preconnect.EarlyConnection), all closed on the way out."""
    targets: list = []
    try:
        for i, name in enumerate(names_):
            targets.append(open_target(inv, name, early if i == 0 else None))
        yield targets
    finally:
        for t in targets:
            t.close()


def run_cause(exits: list[dict | None]) -> dict | None:
    """The run's root cause from its nodes' exit.json: a rank's own failure first, else a node's report of a
    rank it lost on another node (`lost`), else any node's cause; None when no node recorded one."""
    causes = [e.get("root_cause") for e in exits if e and isinstance(e.get("root_cause"), dict)]
    for good in (lambda c: not c.get("peer_lost"), lambda c: c.get("lost"), lambda c: True):
        found = [c for c in causes if good(c)]
        if found:
            return found[0]
    return None
