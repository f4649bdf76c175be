"""An experiment of the inventory resolved into what to launch on each target: a LaunchSpec per placement (one
for a run on one target, one per node of a layout across targets). Shared by `launch` and `warmup`, which
resolve an experiment the same way; every name that reaches a target (experiment, tag, and so the run id) is
checked here, before any transport is touched: a hostile tag never costs a `pct exec`."""

from __future__ import annotations

import copy
import datetime as _dt
from dataclasses import dataclass, field

from orchestrator import names
from orchestrator.errors import UserError
from orchestrator.inventory import check_name, resolve_env, trainer_layout
from orchestrator.ops.lockfile import resolve_lock


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
    secret_env: list[str] = field(default_factory=list)
    """kind command: the keys of `env` whose values are secret (never recorded)."""
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
    """A layout across targets: this node's {index, count, targets} (node_specs); None: one node."""
    data_venv_profile: dict | None = None
    """kind dflash: the venv profile the data stage runs in (the experiment's `data_venv`); None: the training venv."""
    data_lock_hash: str | None = None
    """The lock the data venv must match (None: nothing to compare)."""

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
        if exp.data_venv is not None:
            dspec = inv.venv(exp.data_venv)
            spec.data_venv_profile = {"name": exp.data_venv, **dspec.model_dump()}
            spec.data_lock_hash = expected_lock_hash(dspec)
    else:
        spec.command = list(exp.command)
        spec.env, spec.secret_env = resolve_env(exp.env, f"experiments.{experiment}")
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
    return resolve_lock(vspec.lock).hash


def node_specs(inv, spec) -> list:
    """One LaunchSpec per node of `spec` (a dflash spec whose layout lists nodes): the node's target, its GPUs,
    its target's venv profile and lock, and `node` (index, count, targets); the config is the same for all.

    Raises:
        UserError: a node's venv profile locks another lock than node 0's.
    """
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
