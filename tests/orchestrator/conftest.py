"""Fixtures shared by the orchestrator tests that start real runs (launch, status/stop, runs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.target import LocalTarget
from orchestrator.transport.local import LocalTransport


@pytest.fixture
def isolated_tmux(tmp_path, monkeypatch):
    """Own tmux server (TMUX_TMPDIR) and own run records (DFLASHCTL_STATE_DIR) per test; the tmux server dies
    at the end, taking any session a test left behind with it.

    Test modules that launch runs use it for every test: `pytestmark = pytest.mark.usefixtures("isolated_tmux")`.
    """
    d = tmp_path / "tmux"
    d.mkdir()
    monkeypatch.setenv("TMUX_TMPDIR", str(d))
    monkeypatch.setenv("DFLASHCTL_STATE_DIR", str(tmp_path / "state"))
    yield
    subprocess.run(["tmux", "kill-server"], capture_output=True)


@pytest.fixture
def local_target(tmp_path) -> LocalTarget:
    """A local target named "local" whose workdir is `<tmp_path>/work` (created)."""
    wd = tmp_path / "work"
    wd.mkdir(exist_ok=True)
    return LocalTarget(name="local", workdir=str(wd), transport=LocalTransport())


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def smi(tmp_path, monkeypatch) -> Path:
    """The fake host's nvidia-smi stand-in with 8 idle GPUs, as the local target's nvidia-smi
    ($DFLASHCTL_NVIDIA_SMI). Yields its directory: `fakehost.nvidia_smi.hold(smi)` holds its next call, so a
    launch sits inside its preflight (its experiment's lock taken, its GPUs claimed) until `release(smi)`."""
    from fakehost import nvidia_smi

    d = tmp_path / "smi"
    d.mkdir()
    (d / "nvidia-smi").write_text(f"#!{sys.executable} -IS\n" + Path(nvidia_smi.__file__).resolve().read_text())
    (d / "nvidia-smi").chmod(0o755)
    gpus = [{"index": i, "uuid": f"GPU-{i:04x}", "pci_bus_id": f"00000000:{0x18 + i:02X}:00.0", "memory_used": 0,
             "memory_total": 81559} for i in range(8)]
    (d / ".gpus.json").write_text(json.dumps({"driver_version": "570.133.20", "cuda_version": "12.8",
                                              "name": "NVIDIA H100 80GB HBM3", "error": None, "gpus": gpus}))
    monkeypatch.setenv("DFLASHCTL_NVIDIA_SMI", str(d / "nvidia-smi"))
    yield d
    nvidia_smi.release(d)


@pytest.fixture
def dflashctl():
    """Run the INSTALLED `dflashctl` console script (found on PATH, as a user types it) in a subprocess,
    with this checkout (or `source`, a copy of it) first on PYTHONPATH. Returns
    run(*args, env=None, timeout=120, cwd=None, source=None)."""
    exe = shutil.which("dflashctl")
    if exe is None:
        # Not a skip: the console script is what users run (`pip install -e .` puts it on PATH, see .ci/run).
        pytest.fail("the dflashctl console script is not on PATH: pip install -e . (see .ci/run)")

    def run(*args: str, env: dict | None = None, timeout: float = 120, cwd=None,
            source=None) -> subprocess.CompletedProcess:
        full = dict(os.environ if env is None else env)
        full["PYTHONPATH"] = os.pathsep.join(p for p in (str(source or REPO), full.get("PYTHONPATH")) if p)
        full.setdefault("COLUMNS", "200")
        return subprocess.run([exe, *args], capture_output=True, text=True, env=full, timeout=timeout, cwd=cwd,
                              stdin=subprocess.DEVNULL)

    return run


@pytest.fixture
def dflashctl_main(monkeypatch):
    """Run `dflashctl ARGS` IN THIS PROCESS through orchestrator.cli.main (what the console script calls, less
    an interpreter start-up and the CLI's imports each time), with stdout and stderr captured. For the many
    invocations of a test about a verb's output and exit codes; what only a fresh interpreter or the
    installed script can show (imports, the console script, PATH) stays with `dflashctl` in a subprocess.
    Returns run(*args, env=None, cwd=None) -> CompletedProcess (env, when given, replaces os.environ for the
    call; COLUMNS is 200 as in `dflashctl`)."""
    import contextlib
    import io

    from orchestrator.cli import main

    def run(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
        out, err = io.StringIO(), io.StringIO()
        with monkeypatch.context() as m:
            if env is not None:
                for key in list(os.environ):
                    m.delenv(key)
                for key, value in env.items():
                    m.setenv(key, value)
            m.setenv("COLUMNS", (env or {}).get("COLUMNS", "200"))
            if cwd is not None:
                m.chdir(cwd)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(list(args))
        return subprocess.CompletedProcess(["dflashctl", *args], code, out.getvalue(), err.getvalue())

    return run


@pytest.fixture
def claim_cuda_venv():
    """The function `_claim_cuda_venv(workdir, lock="cuda", torch="2.13.0", cuda="13.0")` (below)."""
    return _claim_cuda_venv


def _claim_cuda_venv(workdir: str | Path, lock: str = "cuda", torch: str = "2.13.0", cuda: str | None = "13.0") -> Path:
    """THE one seam of the driver tests: make `<workdir>/venvs/current` a venv whose fingerprint says its
    torch was built for CUDA `cuda`. torch cannot run CUDA on this machine, so no venv built here can say
    so; everything the checks compare it with (the stand-in nvidia-smi, the container's /proc/driver, the
    agent, doctor, launch) is real. An existing current venv keeps its files and lock hash (only torch and
    cuda change); else one fingerprinted as built from lock `lock` is made. Returns the venv directory."""
    from orchestrator.agent import venvfingerprint, venvinfo
    from orchestrator.ops.lock import resolve_lock

    venvs = Path(workdir) / "venvs"
    current = venvs / "current"
    if current.is_dir():
        venv = current.resolve()
        fp = json.loads((venv / venvfingerprint.FINGERPRINT).read_text())
    else:
        lock_hash = resolve_lock(lock).hash
        venv = venvs / f"{lock_hash}-20250611T095812.114Z"
        venv.mkdir(parents=True, exist_ok=True)
        fp = {"kind": "uv", "venv": venv.name, "lock_hash": lock_hash, "bundle_hash": None, "python": "3.11.2"}
        (venv / venvinfo.STAMP).write_text(f"{lock_hash} - 3.11\n")
        current.symlink_to(venv.name)
    fp.update(torch=torch, cuda=cuda, packages={**fp.get("packages", {}), "torch": torch})
    (venv / venvfingerprint.FINGERPRINT).write_text(json.dumps(fp) + "\n")
    return venv
