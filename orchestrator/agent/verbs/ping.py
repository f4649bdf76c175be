"""`ping`: everything doctor needs to know from inside the target, in one round trip.

Request: {workdir, venv_profile: {...} (optional: the target's venv profile; default the running
interpreter), gpu_timeout}.
Result keys: python {version, executable}, tmux (version string or null), uv ({version, path} or null),
gpus {gpus: [...], reason}, disk {path, free_bytes, total_bytes}, bundle_hash, hostname,
workdir {path, writable, error}, inductor_cache_dir {path, writable, error}, venv (path of
`<workdir>/venvs/current` or null), driver {info: DriverInfo fields, venv: {torch, cuda, venv, error}}
(orchestrator.agent.driver: what doctor compares). Creating the workdir and `<workdir>/inductor-cache`
is part of the check (they are ours); nothing else is written.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from orchestrator.agent import driver as nvdriver
from orchestrator.agent.gpu import query_gpus
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import PingRequest

# uv's installer puts it in ~/.local/bin (or ~/.cargo/bin), which pct's reset PATH lacks.
_UV_DIRS = ("~/.local/bin", "~/.cargo/bin", "/usr/local/bin")


def _version(argv: list[str], timeout: float = 10.0) -> str | None:
    """First line of `argv`'s output, or None when it cannot run."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    text = (proc.stdout or proc.stderr).decode("utf-8", errors="replace").strip()
    return text.splitlines()[0] if text else None


def find_uv(workdir: str | None = None) -> str | None:
    """The uv rebuild-venv installed (<workdir>/bin/uv), else uv on PATH, else in the installer's usual
    directories."""
    if workdir and os.access(os.path.join(workdir, "bin", "uv"), os.X_OK):
        return os.path.join(workdir, "bin", "uv")
    found = shutil.which("uv")
    if found:
        return found
    for d in _UV_DIRS:
        p = os.path.join(os.path.expanduser(d), "uv")
        if os.access(p, os.X_OK):
            return p
    return None


def _tmux() -> str | None:
    exe = shutil.which("tmux")
    return _version([exe, "-V"]) if exe else None


def _uv(workdir: str | None = None) -> dict | None:
    exe = find_uv(workdir)
    if exe is None:
        return None
    return {"path": exe, "version": _version([exe, "--version"])}


def writable_dir(path: str) -> dict:
    """Create `path` if needed and prove it writable with a temp file; never raises."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dflashctl-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
        return {"path": path, "writable": True, "error": None}
    except OSError as exc:
        return {"path": path, "writable": False, "error": f"{type(exc).__name__}: {exc}"}


def _disk(path: str) -> dict:
    probe = path
    while probe and not os.path.exists(probe):  # the workdir may not exist (yet): measure its filesystem
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        usage = shutil.disk_usage(probe or "/")
    except OSError as exc:
        return {"path": probe, "free_bytes": None, "total_bytes": None, "error": str(exc)}
    return {"path": probe, "free_bytes": usage.free, "total_bytes": usage.total, "error": None}


def _bundle_hash() -> str | None:
    env = os.environ.get("DFLASHCTL_BUNDLE_HASH")
    if env:
        return env
    try:  # local target: the agent runs from the source tree, so hash it the way the bundle does
        from orchestrator.bundle import build_bundle

        return build_bundle().hash
    except Exception:  # noqa: BLE001 - a hash we cannot compute is reported as unknown, not a crash
        return None


def run(request: dict, emit) -> dict:
    req = PingRequest.from_json(request)
    workdir = req.workdir
    if not os.path.isabs(workdir):
        raise AgentFailure("BadRequest", f"ping needs an absolute workdir, got {workdir!r}")
    # nvidia-smi (twice: the GPU query and the bare header), tmux and uv are independent subprocesses; ask
    # them at once (nvidia-smi alone can take a second on a big box).
    with ThreadPoolExecutor(max_workers=4) as pool:
        f_gpus = pool.submit(query_gpus, req.gpu_timeout)
        f_driver = pool.submit(nvdriver.probe, req.gpu_timeout)
        f_tmux = pool.submit(_tmux)
        f_uv = pool.submit(_uv, workdir)
        wd = writable_dir(workdir)
        cache = writable_dir(os.path.join(workdir, "inductor-cache")) if wd["writable"] else {
            "path": os.path.join(workdir, "inductor-cache"), "writable": False, "error": "workdir not writable"}
        current = os.path.join(workdir, "venvs", "current")
        gpus, reason = f_gpus.result()
        tmux = f_tmux.result()
        uv = f_uv.result()
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "tmux": tmux,
        "uv": uv,
        "gpus": {"gpus": gpus, "reason": reason},
        "disk": _disk(workdir),
        "bundle_hash": _bundle_hash(),
        "hostname": socket.gethostname(),
        "workdir": wd,
        "inductor_cache_dir": cache,
        "venv": os.path.realpath(current) if os.path.exists(current) else None,
        "driver": {"info": f_driver.result().to_dict(),
                   "venv": nvdriver.venv_torch(workdir, req.venv_profile or {})},
    }
