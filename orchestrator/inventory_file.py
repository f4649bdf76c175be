"""Where the inventory comes from: the lookup order and the file's text, without pydantic.

Light on purpose: a command's early SSH connection (orchestrator.preconnect) reads the inventory's
text with this while orchestrator.inventory, which builds the pydantic models, is still being imported.
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator import assets
from orchestrator.errors import InventoryError

ENV_VAR = "DFLASHCTL_INVENTORY"
# Defaults of the fields a container target's agent command line depends on: orchestrator.inventory's models
# use them, and orchestrator.preconnect reads the raw YAML with them before those models exist.
CONTAINER_WORKDIR = "/root/dflash"
CONTAINER_HOME = "/root"
PCT = "pct"
EMBEDDED = "<embedded default inventory>"
CACHE_DIR = "yaml-cache"
"""The name, in the state dir, of yamlload's cache of large inventories' plain data (see `cache_dir`)."""
DEFAULT_RESOURCE = "inventory.yaml"


def embedded_text() -> str:
    """The text of the embedded default inventory (packaged with orchestrator)."""
    return assets.read_text(DEFAULT_RESOURCE)


def cache_dir() -> Path:
    """Where the plain data of large inventories is kept between commands (orchestrator.yamlload's cache):
    the command's load and its early connection's read (orchestrator.preconnect) use the one cache."""
    from orchestrator.records import state_dir

    return state_dir() / CACHE_DIR


def user_config_path() -> Path:
    """`<user config dir>/dflashctl/inventory.yaml` (platformdirs)."""
    import platformdirs

    return Path(platformdirs.user_config_dir("dflashctl")) / "inventory.yaml"


def find_inventory(path: str | os.PathLike | None = None) -> Path | None:
    """The inventory file by the lookup order, or None for the embedded default.

    Raises:
        InventoryError: an explicitly given file (argument or $DFLASHCTL_INVENTORY) does not exist.
    """
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise InventoryError(f"inventory file {str(p)!r} (from --inventory) does not exist",
                                 fix="pass an existing file to --inventory, or leave it out for the default")
        return p
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise InventoryError(f"inventory file {str(p)!r} (from ${ENV_VAR}) does not exist",
                                 fix=f"unset {ENV_VAR} or point it at an existing file")
        return p
    for p in (Path.cwd() / "inventory.yaml", user_config_path()):
        if p.is_file():
            return p
    return None


def read_inventory(path: str | os.PathLike | None = None) -> tuple[str, str]:
    """(text, source) of the inventory by the lookup order; source is the file, or EMBEDDED.

    Raises:
        InventoryError: missing explicit file, or a file that cannot be read as UTF-8.
    """
    p = find_inventory(path)
    if p is None:
        return embedded_text(), EMBEDDED
    try:
        return p.read_text(encoding="utf-8"), str(p)
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"cannot read inventory file {str(p)!r}: {exc}") from None
