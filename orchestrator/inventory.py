"""inventory.yaml: hosts, targets, venv profiles, experiments, loaded, validated and checked.

Every error points at the file, the line and the key path, in one readable InventoryError, e.g.

    inventory.yaml:12: experiments.tiny.layuot: unknown key; did you mean 'layout'?

Lookup order (first that exists wins): `--inventory PATH`, `$DFLASHCTL_INVENTORY`, `./inventory.yaml`, the
user config dir (`<platformdirs user_config_dir>/dflashctl/inventory.yaml`), the embedded default shipped
in the package: the repository's top-level inventory.yaml, read through orchestrator.assets as
`templates/inventory.yaml`.

Every name that can reach a shell or a path (host, target, venv, experiment keys; tags, sessions, run ids
given on the command line) follows the one rule of `orchestrator.names`: no slashes, no `..`, no newline,
no shell metacharacters.

Three parts, put together here: the models (orchestrator.inventory_models), the YAML loader that places
errors at FILE:LINE (orchestrator.located: plain data first, the lines only when an error needs them), and
the checks across sections (orchestrator.inventory_refs). The names of the models are importable from here.
"""

from __future__ import annotations

import os

from pydantic import ValidationError

from orchestrator import located, yamlload
from orchestrator.errors import InventoryError
from orchestrator.inventory_file import (  # noqa: F401 - the lookup lives there, light enough for preconnect
    CACHE_DIR,
    CONTAINER_HOME,
    CONTAINER_WORKDIR,
    EMBEDDED,
    ENV_VAR,
    PCT,
    cache_dir,
    embedded_text,
    find_inventory,
    read_inventory,
    user_config_path,
)
from orchestrator.inventory_models import (  # noqa: F401 - the models' names, importable from here
    CommandExperiment,
    ContainerTargetSpec,
    DflashExperiment,
    ExperimentSpec,
    HostSpec,
    Inventory,
    Layout,
    LocalTargetSpec,
    Monitor,
    NodeLayout,
    Notify,
    SecretEnv,
    SystemVenv,
    TargetSpec,
    UvVenv,
    VenvSpec,
    WorkstationVenv,
    check_name,
    check_run_ref,
    complete,
    resolve_env,
    trainer_layout,
)
from orchestrator.inventory_refs import check_references
from orchestrator.located import suggest  # noqa: F401 - used by the verbs' name lookups


def parse_inventory(text: str, source: str = "inventory.yaml", *, cache: bool = True) -> Inventory:
    """Parse and validate inventory text. `source` is the name used in error messages; `cache`: a large
    text's data may be read from (and kept in) the state dir's cache.

    Raises:
        InventoryError: syntax, unknown keys, wrong types, bad names, dangling references; every problem
            on its own line as `FILE:LINE: key.path: what` (all of them, not just the first).
    """
    with yamlload.no_gc(freeze=len(text) >= yamlload.CACHE_MIN_BYTES):  # a large inventory's models are kept
        return _parse(text, source, cache)


def _parse(text: str, source: str, cache: bool) -> Inventory:
    raw = located.load_data(text, source, fixable=source != EMBEDDED, cache_dir=cache_dir() if cache else None)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InventoryError(f"{source}:1: the top level must be a mapping (hosts:, targets:, ...)")
    complete()
    try:
        inv = Inventory.model_validate(raw)
    except ValidationError as exc:
        lines = located.key_lines(text, source)
        msgs = located.validation_errors(exc, raw, lines, source, Inventory)
        raise InventoryError("\n".join(msgs), fix=f"edit {source} at the line shown") from None
    # The workstation's own interpreter needs no settings, so it is always there (a minimal inventory with
    # only a local target must not fail on a venv profile it never mentioned).
    inv.venvs.setdefault("workstation", WorkstationVenv(kind="workstation"))
    problems = check_references(inv)
    if problems:
        msgs = located.place(problems, located.key_lines(text, source), source)
        raise InventoryError("\n".join(msgs), fix=f"edit {source} at the line shown")
    return inv.from_source(source, text)


def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    """Load the inventory by the lookup order (see the module docstring).

    Args:
        path: the `--inventory` value, or None.
    Returns:
        The validated Inventory; `.source` names the file (or EMBEDDED).
    Raises:
        InventoryError: missing explicit file, unreadable file, or invalid content (file:line: key: what).
    """
    return parse_inventory(*read_inventory(path))
