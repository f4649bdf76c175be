"""The shipped tiny experiment on a fake-host container, over the session's cpu-lock venv (the stock_cpu_venv
fixture): what a container test needs to launch the real trainer without building a venv of its own."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def link_shared_cpu_venv(ct, shared: Path) -> None:
    """Make the session's cpu-lock venv `shared` the container's `venvs/current`, seen through links, with a
    stamp of today's bundle: the tree may have changed since the session's build, and a container without a
    network cannot build anew."""
    from orchestrator.agent.venvinfo import STAMP
    from orchestrator.bundle import build_bundle

    venv = Path(ct.workdir) / "venvs" / "cpu-shared"
    venv.mkdir(parents=True)
    for entry in shared.iterdir():
        if entry.name != STAMP:
            (venv / entry.name).symlink_to(entry)
    lock_hash, _bundle, python = (shared / STAMP).read_text().split()
    (venv / STAMP).write_text(f"{lock_hash} {build_bundle().hash} {python}\n")
    (venv.parent / "current").symlink_to(venv.name)
    ct.to_container(venv.parent)


def tiny_inventory(path: Path, fake_pve, ct, **trainer) -> Path:
    """An inventory at `path` with the shipped `tiny` experiment (its trainer settings updated by `trainer`) on
    target `ct` (the container, venv profile `cpu` as shipped, wheels from /opt/wheels)."""
    shipped = yaml.safe_load((REPO / "inventory.yaml").read_text())
    tiny = {**shipped["experiments"]["tiny"], "target": "ct"}
    tiny["trainer"].update(trainer)
    path.write_text(yaml.safe_dump({
        "hosts": {"pve": fake_pve.host_entry()},
        "targets": {"ct": {"kind": "container", "host": "pve", "ctid": ct.ctid, "workdir": ct.workdir, "venv": "cpu"}},
        "venvs": {"cpu": {**shipped["venvs"]["cpu"], "wheelhouse": ["/opt/wheels"],
                          "uv_cache_dir": str(fake_pve.storage() / "uv-cache")}},
        "experiments": {"tiny": tiny},
    }))
    return path
