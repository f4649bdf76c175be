"""The inventory's checks across sections, after its models validated: every name safe, every reference
resolvable (a target's host and venv, an experiment's target and venvs, a node's target), container workdirs
absolute, GPU lists disjoint, layouts across targets valid as the trainer sees them.

Each problem is (key path, message); orchestrator.located places it at its FILE:LINE.
"""

from __future__ import annotations

import functools
import re
from pathlib import PurePosixPath

from orchestrator import names
from orchestrator.inventory_models import (
    ContainerTargetSpec,
    DflashExperiment,
    Inventory,
    WorkstationVenv,
    trainer_layout,
)
from orchestrator.located import suggest

Problem = tuple[tuple[str, ...], str]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@functools.lru_cache(maxsize=1024)
def _workdir_ok(workdir: str) -> bool:
    """An absolute path without `..` or a newline (remembered: thousands of targets share a few workdirs)."""
    wd = PurePosixPath(workdir)
    return wd.is_absolute() and ".." not in wd.parts and "\n" not in workdir


def check_references(inv: Inventory) -> list[Problem]:
    """Names safe, references resolvable, container workdirs absolute, GPU lists disjoint: every problem, in
    the order of the file's sections.

    Linear in the inventory, and cheap per entry (a 10 MB inventory has ~80,000 of them: bench/inventory_load.py):
    a reference is one dict lookup, the rest of `ref` runs only when it fails."""
    errs: list[Problem] = []

    def err(path: tuple[str, ...], msg: str) -> None:
        errs.append((path, msg))

    def ref(path: tuple[str, ...], kind: str, name: str, table: dict) -> None:
        if name not in table:
            close = suggest(name, table)
            hint = f"; did you mean {close!r}?" if close else f" (known: {', '.join(sorted(table)) or 'none'})"
            err(path, f"no {kind} named {name!r}{hint}")

    for section in ("hosts", "targets", "venvs", "experiments"):
        if names.all_valid(getattr(inv, section)):  # the usual case, at once; else each name says what it breaks
            continue
        for name in getattr(inv, section):
            if not names.is_valid(name):
                err((section, name), f"unsafe name: use 1-{names.NAME_MAX} characters from {names.RULE}")

    for name, h in inv.hosts.items():
        for key in ("ssh", "user"):
            if getattr(h, key) is not None and not names.is_ssh_word(getattr(h, key)):
                err(("hosts", name, key), f"{getattr(h, key)!r} cannot be given to ssh: no leading '-', no spaces")

    _check_targets(inv, err, ref)
    _check_experiments(inv, err, ref)
    return errs


def _check_targets(inv: Inventory, err, ref) -> None:
    venvs, hosts = inv.venvs, inv.hosts
    for name, t in inv.targets.items():
        if t.venv not in venvs:
            ref(("targets", name, "venv"), "venv profile", t.venv, venvs)
        if isinstance(t, ContainerTargetSpec):
            if t.host not in hosts:
                ref(("targets", name, "host"), "host", t.host, hosts)
            if not _workdir_ok(t.workdir):
                err(("targets", name, "workdir"), f"must be an absolute path without '..' (got {t.workdir!r})")
            if isinstance(venvs.get(t.venv), WorkstationVenv):
                err(("targets", name, "venv"), f"venv profile {t.venv!r} is the workstation's own interpreter, which "
                    "a container cannot run; use a `kind: system` profile (the container's python3) or a `kind: uv` one")


def _on_container(inv: Inventory, target: str, venv: str) -> bool:
    """The workstation's interpreter named for an experiment on a container (which cannot run it)."""
    return isinstance(inv.targets.get(target), ContainerTargetSpec) and isinstance(inv.venvs.get(venv), WorkstationVenv)


def _check_experiments(inv: Inventory, err, ref) -> None:
    targets, venvs = inv.targets, inv.venvs
    env_ok: set[str] = set()  # environment names already checked (experiments share a few)
    for name, e in inv.experiments.items():
        if e.target not in targets:
            ref(("experiments", name, "target"), "target", e.target, targets)
        if e.venv is not None:
            ref(("experiments", name, "venv"), "venv profile", e.venv, venvs)
            if _on_container(inv, e.target, e.venv):
                err(("experiments", name, "venv"), f"venv profile {e.venv!r} is the workstation's own interpreter, "
                    "which a container cannot run; use a `kind: system` profile (the container's python3)")
        if isinstance(e, DflashExperiment):
            _check_dflash(name, e, inv, err, ref)
            continue
        gpus = e.gpus
        if len(set(gpus)) != len(gpus):
            err(("experiments", name, "gpus"), f"GPU {_twice(gpus)} listed twice")
        for key in e.env:
            if key not in env_ok:
                if _ENV_NAME.fullmatch(key):
                    env_ok.add(key)
                else:
                    err(("experiments", name, "env", key), "not a valid environment variable name")


def _twice(gpus: list[int]) -> list[int]:
    """The GPUs listed more than once, sorted."""
    return sorted({g for g in gpus if gpus.count(g) > 1})


def _check_dflash(name: str, e: DflashExperiment, inv: Inventory, err, ref) -> None:
    if e.data_venv is not None:
        ref(("experiments", name, "data_venv"), "venv profile", e.data_venv, inv.venvs)
        if _on_container(inv, e.target, e.data_venv):
            err(("experiments", name, "data_venv"), f"venv profile {e.data_venv!r} is the workstation's own "
                "interpreter, which a container cannot run; use a `kind: uv` profile (e.g. vllm)")
    if e.layout.nodes:
        _check_nodes(name, e, inv, err, ref)
        return
    lay = e.layout
    for key, gpus in (("target_gpus", lay.target_gpus), ("drafter_gpus", lay.drafter_gpus)):
        if len(set(gpus)) != len(gpus):
            err(("experiments", name, "layout", key), f"GPU {_twice(gpus)} listed twice")
    both = sorted(set(lay.target_gpus) & set(lay.drafter_gpus))
    if both:
        err(("experiments", name, "layout"), f"GPU {both} is in both target_gpus and drafter_gpus")
    if bool(lay.target_gpus) != bool(lay.drafter_gpus):
        err(
            ("experiments", name, "layout"),
            "give both target_gpus and drafter_gpus, or neither (colocated on the CPU)",
        )


def _check_nodes(name: str, e, inv: Inventory, err, ref) -> None:
    """A layout across targets: every node a known container target, each once, node 0 the experiment's
    target, one kind of venv lock, and the layout itself valid as the trainer sees it (trainer.layout, the one
    rule: its message names `nodes[i]`, and the error points at that node's line). Errors go through `err`."""
    at = ("experiments", name, "layout")
    nodes = e.layout.nodes
    seen: dict[str, int] = {}
    for i, n in enumerate(nodes):
        ref((*at, "nodes", str(i), "target"), "target", n.target, inv.targets)
        if n.target in seen:
            err((*at, "nodes", str(i), "target"), f"target {n.target!r} is already node {seen[n.target]}: each node "
                "is its own target (list all of a target's GPUs in one node)")
        seen.setdefault(n.target, i)
        if len(nodes) > 1 and n.target in inv.targets and not isinstance(inv.targets[n.target], ContainerTargetSpec):
            err((*at, "nodes", str(i), "target"), f"target {n.target!r} is not a container: every node of a layout "
                "across targets is a container (`kind: container`)")
    if nodes[0].target != e.target:
        err(("experiments", name, "target"), f"{e.target!r} is not node 0's target {nodes[0].target!r}: the "
            f"experiment's target is the first node (where the rendezvous runs); set target: {nodes[0].target}")
    if e.layout.target_gpus or e.layout.drafter_gpus:
        err(at, "with `nodes`, list every GPU under its node and drop the top-level target_gpus/drafter_gpus")
        return
    from trainer.config import ConfigError, parse_config

    try:
        parse_config({"layout": trainer_layout(e.layout)}, source="layout")
    except ConfigError as exc:
        text = str(exc)
        m = re.search(r"nodes\[(\d+)\]", text)
        where = (*at, "nodes", m.group(1)) if m else (*at, "rendezvous") if "rendezvous" in text else at
        for line in text.splitlines():  # "layout: <loc>: Value error, <the trainer's message>"
            err(where, re.sub(r"^layout: [\w.]+: (Value error, )?", "", line.strip()))
