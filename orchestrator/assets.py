"""templates/: the one way every reader (ops, the agent, the bundle, tests, bench) reaches the shipped files.

The files live at the top of the repository in `templates/` (start_training.sh, rebuild_venv.sh,
signatures.yaml, locks/, inventory.yaml: the embedded default inventory, a link to the top-level file).
A wheel ships them as the package data `orchestrator/templates/` (pyproject's package-dir mapping), and
the bundle zip carries them at the same place, so the agent in a container reads them with zipimport.
A checkout (editable install, PYTHONPATH) has no `orchestrator/templates/`; there the top-level
directory is used, which is also where `dflashctl lock` writes.

Stdlib only: the agent imports this inside the container.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importlib.resources.abc is 3.11+; the workstation may run 3.10
    from importlib.resources.abc import Traversable

# The name of the directory in the wheel (orchestrator/templates/) and in the checkout (templates/).
DIRNAME = "templates"


def checkout_dir() -> Path:
    """`templates/` beside the `orchestrator` package: the checkout's copy (absent in a wheel)."""
    return Path(__file__).resolve().parent.parent / DIRNAME


def root() -> Traversable:
    """The templates directory: packaged (wheel, bundle zip) when present, else the checkout's."""
    packaged = resources.files("orchestrator").joinpath(DIRNAME)
    if packaged.is_dir():
        return packaged
    return checkout_dir()


def path(name: str) -> Traversable:
    """The template `name` (a relative path such as `locks/cpu.txt`)."""
    return root().joinpath(*name.split("/"))


def read_bytes(name: str) -> bytes:
    """The bytes of template `name`.

    Raises:
        FileNotFoundError: the file is not shipped (a broken install or bundle).
    """
    return path(name).read_bytes()


def read_text(name: str) -> str:
    """The UTF-8 text of template `name` (see read_bytes)."""
    return read_bytes(name).decode("utf-8")


def on_disk(name: str) -> Path:
    """Template `name` as a file-system path (a script to run, the lock directory `dflashctl lock` writes).

    Raises:
        FileNotFoundError: the templates are not on the file system (the code runs from a zip).
    """
    p = path(name)
    if not isinstance(p, Path):
        raise FileNotFoundError(f"templates/{name} is inside a zip ({p}), not a file on disk")
    return p


def locks_dir() -> Path:
    """`<templates>/locks`: the shipped .in/.txt lock files (see on_disk)."""
    return on_disk("locks")
