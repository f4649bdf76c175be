"""A venv's fingerprint (standard library only): the one name rule for distributions, what is installed, the
fingerprint of the running interpreter, of the target's python3, or of the current uv venv, the one a new
venv's verification writes (`build_fingerprint`), and what does not match (`fingerprint_diff`).

- in the agent (launch preflight, the `fingerprint` verb): `current_fingerprint(workdir, profile)` reads the
  fingerprint of `<workdir>/venvs/current` (uv profiles) or computes one from the running interpreter
  (`workstation` profile); `fingerprint_diff(actual, expected_lock_hash)` says in words what does not match.
- in the rebuild script: orchestrator.agent.venvinfo's `verify` command writes `build_fingerprint`'s.

Shared by the NVIDIA driver check (orchestrator.agent.driver), the venv build and verification
(orchestrator.agent.venvinfo), the import check (orchestrator.agent.importcheck) and the lock's reader
(orchestrator.ops.lockfile: the name rule), which none of them may import from each other without a cycle."""

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


def fingerprint_diff(actual: dict, expected_lock_hash: str | None, profile: dict | None = None) -> list[str]:
    """Human lines saying why `actual` does not match the expected lock; empty = match.

    A workstation profile (expected_lock_hash None) matches any fingerprint without an error. `profile` (the
    venv profile asked for, with its `name` and `lock`) is named in the text: the current venv may be another
    profile's (one target, one `current`), or its profile's lock may have changed since; both read true.
    """
    if actual.get("error"):
        return [actual["error"]]
    if expected_lock_hash is None:
        return []
    got = actual.get("lock_hash")
    if got != expected_lock_hash:
        profile = profile or {}
        wanted = (f"venv profile {profile['name']!r}" if profile.get("name") else "the venv profile") + (
            f" (lock {profile['lock']})" if profile.get("lock") else "")
        return [f"the current venv {actual.get('venv')} was built from lock {got}; {wanted} needs lock "
                f"{expected_lock_hash} (run `dflashctl rebuild-venv`)"]
    return []


def build_fingerprint(venv: Path, *, lock_hash: str | None, bundle_hash: str | None, python_request: str | None,
                      freeze_file: Path | None, torch_info: dict, driver: str | None,
                      uv_version: str | None = None) -> dict:
    """The fingerprint of the running interpreter's environment (see contracts: venv layout); `driver`: the
    NVIDIA driver's version (orchestrator.agent.venvinfo reads it: the driver module imports this one)."""
    freeze = []
    if freeze_file and freeze_file.is_file():
        freeze = [ln.strip() for ln in freeze_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return {
        "kind": "uv",
        "venv": venv.name,
        "lock_hash": lock_hash,
        "bundle_hash": bundle_hash,
        "python": platform.python_version(),
        "python_request": python_request,
        "executable": sys.executable,
        "platform": f"{sys.platform}-{platform.machine()}",
        "packages": installed_packages(),
        "freeze": freeze,
        "torch": torch_info.get("torch"),
        "cuda": torch_info.get("cuda"),
        "device_count": torch_info.get("device_count"),
        "driver": driver,
        "uv": uv_version,
        "created": now_utc(),
    }
