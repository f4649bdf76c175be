"""A venv's fingerprint as the agent reads it (standard library only): the one name rule for distributions,
what is installed, the fingerprint of the running interpreter, of the target's python3, or of the current uv
venv. Shared by the NVIDIA driver check (orchestrator.agent.driver), the venv build and verification
(orchestrator.agent.venvinfo) and the import check (orchestrator.agent.importcheck), which none of them
may import from each other without a cycle."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from pathlib import Path

FINGERPRINT = "dflashctl-fingerprint.json"


def normalize_name(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())



def installed_packages() -> dict[str, str]:
    """`{normalized name: version}` of every distribution visible to this interpreter."""
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            out.setdefault(normalize_name(name), dist.version)
    return dict(sorted(out.items()))



def profile_kind(profile) -> str:
    if not profile:  # no profile: the running interpreter
        return "workstation"
    kind = profile.get("kind") if isinstance(profile, dict) else getattr(profile, "kind", None)
    return kind or "uv"


def workstation_fingerprint() -> dict:
    """The fingerprint of the running interpreter (the `workstation` profile): no lock, no venv dir."""
    from importlib import metadata

    packages = installed_packages()
    torch_mod = sys.modules.get("torch")
    cuda = getattr(getattr(torch_mod, "version", None), "cuda", None) if torch_mod else None
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {
        "kind": "workstation", "venv": None, "lock_hash": None,
        "bundle_hash": os.environ.get("DFLASHCTL_BUNDLE_HASH"),
        "python": platform.python_version(), "python_request": None, "executable": sys.executable,
        "platform": f"{sys.platform}-{platform.machine()}", "packages": packages,
        "freeze": [f"{n}=={v}" for n, v in packages.items()],
        "torch": torch_version, "cuda": cuda, "device_count": None, "driver": None, "uv": None, "created": now_utc(),
    }


# Run by the target's python3 for a `system` profile: what the workstation fingerprint reads, as JSON.
_SYSTEM_PROBE = (
    "import json, platform, re, sys\n"
    "from importlib import metadata\n"
    "p = {}\n"
    "for d in metadata.distributions():\n"
    "    n = d.metadata.get('Name')\n"
    "    if n: p.setdefault(re.sub(r'[-_.]+', '-', n).lower(), d.version)\n"
    "print(json.dumps({'python': platform.python_version(), 'executable': sys.executable, 'packages': dict(sorted(p.items()))}))\n"
)


def system_fingerprint() -> dict:
    """The fingerprint of the target's `python3` on PATH (the `system` profile): no lock, no venv dir. The
    agent itself may run in a venv; the run's commands find python3 on PATH, so that one is described."""
    import shutil
    import subprocess

    exe = shutil.which("python3")
    if exe is None:
        return {"kind": "system", "venv": None, "lock_hash": None,
                "error": "no python3 on PATH in the target (install it: apt-get install -y python3)"}
    try:
        out = subprocess.run([exe, "-I", "-c", _SYSTEM_PROBE], capture_output=True, text=True, timeout=60, check=True)
        probe = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return {"kind": "system", "venv": None, "lock_hash": None, "error": f"{exe} does not run: {exc}"}
    packages = probe["packages"]
    return {
        "kind": "system", "venv": None, "lock_hash": None, "bundle_hash": os.environ.get("DFLASHCTL_BUNDLE_HASH"),
        "python": probe["python"], "python_request": None, "executable": probe["executable"],
        "platform": f"{sys.platform}-{platform.machine()}", "packages": packages,
        "freeze": [f"{n}=={v}" for n, v in packages.items()],
        "torch": packages.get("torch"), "cuda": None, "device_count": None, "driver": None, "uv": None, "created": now_utc(),
    }


def current_fingerprint(workdir: str, profile) -> dict:
    """The fingerprint of the venv a launch in `workdir` would use.

    Args:
        workdir: the target workdir (holds venvs/current).
        profile: the venv profile (a dict, or a model with `.kind`); kind `workstation` (or an empty/None
            profile) means the running interpreter, kind `system` the target's python3 on PATH.
    Returns:
        The fingerprint dict (contracts.md). For a uv profile without a usable current venv, a dict with
        `lock_hash: None` and `error` saying what is wrong and how to fix it.
    """
    if profile_kind(profile) == "workstation":
        return workstation_fingerprint()
    if profile_kind(profile) == "system":
        return system_fingerprint()
    current = Path(workdir) / "venvs" / "current"
    fix = "run `dflashctl rebuild-venv`"
    if not current.exists():
        return {"kind": "uv", "venv": None, "lock_hash": None, "error": f"no venv built in {workdir}/venvs ({fix})"}
    try:
        fp = json.loads((current / FINGERPRINT).read_text())
    except (OSError, ValueError) as exc:
        return {"kind": "uv", "venv": os.path.basename(os.path.realpath(current)), "lock_hash": None,
                "error": f"the current venv has no readable {FINGERPRINT} ({exc.__class__.__name__}; {fix})"}
    fp.setdefault("venv", os.path.basename(os.path.realpath(current)))
    return fp
