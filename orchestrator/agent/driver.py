"""Does the target's NVIDIA driver run the venv's torch? Standard library only (a bare python3 runs it).

Two checks, shared by doctor, rebuild-venv (before `current` is switched) and launch's preflight:

1. **CUDA**: torch is built for one CUDA version (`torch.version.cuda`, recorded in the venv fingerprint);
   the driver runs CUDA up to the version nvidia-smi prints ("CUDA Version: 12.4"). A build for a newer
   minor release of the same major still runs when the driver is at least NVIDIA's minimum for that major
   (minor-version compatibility, MINOR_COMPAT); a newer major never does: torch's first CUDA call then
   says "The NVIDIA driver on your system is too old (found version 12040)".
2. **Libraries = kernel module**: in an LXC container the kernel module is the host's (the container's
   /proc/driver/nvidia/version and /sys/module/nvidia/version show it), while libnvidia-ml.so.<version>
   and libcuda are the container's own files. Any difference and NVML refuses to start ("Failed to
   initialize NVML: Driver/library version mismatch", nvidia-smi exit 18) and CUDA fails with error 803.

Each mismatch is one Problem naming both versions; `fix_text` turns it into the fix (a lock for a CUDA
line this driver runs, or the driver version to install in the container without kernel modules).

`python -m orchestrator.agent.driver check (--lock FILE | --fingerprint FILE)` is what rebuild_venv.sh
runs (before the sync, then before the switch): JSON events on stdout (the agent protocol's shape), exit 3
after an error event for a mismatch; a CPU torch passes whatever the driver's state.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from orchestrator.agent.venvfingerprint import current_fingerprint, profile_kind

# NVIDIA's minimum Linux driver per CUDA major for minor-version compatibility (CUDA compatibility guide,
# and the toolkit release notes): any 12.x build runs on >= 525.60.13, any 13.x build on >= 580.
MINOR_COMPAT: dict[int, tuple[int, ...]] = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580,)}
# The PyTorch wheel index of each CUDA major that torch 2.12/2.13 publish (PyPI's default torch 2.13.0
# is the CUDA 13.0 build). The lowest line of a major runs on every driver of that major.
CUDA_INDEX: dict[int, str] = {12: "https://download.pytorch.org/whl/cu126",
                              13: "https://download.pytorch.org/whl/cu130"}
# Where the container's user-space driver puts libnvidia-ml.so.<version> (Debian/Ubuntu multiarch, RHEL,
# the .run installer's default, NVIDIA's container layout).
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/nvidia/lib64", "/usr/local/lib")
KERNEL_FILES = ("/proc/driver/nvidia/version", "/sys/module/nvidia/version")
TOO_OLD, LIB_MISMATCH = "DriverTooOld", "DriverLibraryMismatch"
PROBLEM_TYPES = (TOO_OLD, LIB_MISMATCH)
EXIT_MISMATCH = 3
NVML_MISMATCH_TEXT = "Driver/library version mismatch"

Version = tuple  # of ints


def parse_version(text: str | None) -> Version | None:
    """`"550.54.15"` -> (550, 54, 15); None for None or anything that is not dotted numbers."""
    if not text or not re.fullmatch(r"\d+(?:\.\d+)*", text.strip()):
        return None
    return tuple(int(p) for p in text.strip().split("."))


def _fmt(v: Version) -> str:
    return ".".join(str(p) for p in v)


# ------------------------------------------------------------------------------------------- parsers


def parse_smi(text: str) -> tuple[str | None, str | None]:
    """(driver version, CUDA version) from bare `nvidia-smi`'s header
    ("| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |")."""
    driver = re.search(r"Driver Version:\s*(\d+(?:\.\d+)+)", text)
    cuda = re.search(r"CUDA Version:\s*(\d+(?:\.\d+)+)", text)
    return (driver.group(1) if driver else None), (cuda.group(1) if cuda else None)


def parse_nvml_library(text: str) -> str | None:
    """The version a failing nvidia-smi names: "NVML library version: 550.54" (major.minor only)."""
    m = re.search(r"NVML library version:\s*(\d+(?:\.\d+)+)", text)
    return m.group(1) if m else None


def parse_kernel_module(text: str) -> str | None:
    """The kernel module's version from /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX x86_64
    Kernel Module  550.54.15  Tue Mar  5 ...", or "... Open Kernel Module for x86_64  570.133.20  ...") or
    the bare version of /sys/module/nvidia/version."""
    m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)", text)
    if m:
        return m.group(1)
    bare = text.strip()
    return bare if parse_version(bare) else None


def library_version(dirs: tuple[str, ...] = LIB_DIRS) -> str | None:
    """The version of the container's libnvidia-ml.so.<version>: what libnvidia-ml.so.1 resolves to in the
    first directory that has it, else the first fully versioned file name."""
    pattern = re.compile(r"libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)")
    for d in dirs:
        link = os.path.join(d, "libnvidia-ml.so.1")
        m = pattern.fullmatch(os.path.basename(os.path.realpath(link))) if os.path.exists(link) else None
        if m:
            return m.group(1)
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            m = pattern.fullmatch(name)
            if m:
                return m.group(1)
    return None


def lock_torch(text: str) -> tuple[str | None, str | None]:
    """(torch version, CUDA version) a lock installs, read from its pins: torch's local label (`+cu126`,
    `+cpu`), else the CUDA runtime wheel it pins (`nvidia-cuda-runtime==13.0.96`, `...-cu12==12.6.77`).
    CUDA is None for a CPU torch and when the lock does not say."""
    torch = re.search(r"^torch==([^\s;\\]+)", text, re.M | re.I)
    if not torch:
        return None, None
    version = torch.group(1)
    local = version.partition("+")[2]
    if local == "cpu":
        return version, None
    m = re.fullmatch(r"cu(\d{2})(\d+)", local)  # cu126 -> 12.6, cu130 -> 13.0
    if m:
        return version, f"{int(m.group(1))}.{int(m.group(2))}"
    rt = re.search(r"^nvidia-cuda-runtime(?:-cu\d+)?==(\d+)\.(\d+)", text, re.M | re.I)
    return version, (f"{rt.group(1)}.{rt.group(2)}" if rt else None)


# --------------------------------------------------------------------------------------------- probe


@dataclass(frozen=True)
class DriverInfo:
    """What the target says about its NVIDIA driver (every field None when it has none)."""

    smi: str | None = None
    """Path of nvidia-smi (None: not installed)."""
    driver: str | None = None
    """"Driver Version" of bare nvidia-smi."""
    cuda: str | None = None
    """"CUDA Version" of bare nvidia-smi: the newest CUDA this driver runs."""
    smi_error: str | None = None
    """nvidia-smi's own text when it failed."""
    nvml_library: str | None = None
    """"NVML library version: X" of a failing nvidia-smi (major.minor)."""
    library: str | None = None
    """Version of the target's own libnvidia-ml.so.<version>."""
    kernel_module: str | None = None
    """The loaded kernel module's version (in a container: the host's)."""
    arch: str = field(default_factory=platform.machine)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "DriverInfo":
        data = data or {}
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__ if k in data})


def kernel_module() -> str | None:
    """The loaded NVIDIA kernel module's version (in a container: the host's), or None."""
    for path in KERNEL_FILES:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                found = parse_kernel_module(fh.read())
        except OSError:
            continue
        if found:
            return found
    return None


def probe(timeout: float = 30.0) -> DriverInfo:
    """Ask bare nvidia-smi for the driver and CUDA versions, read the kernel module's version and find the
    container's libnvidia-ml. Never raises: what cannot be read stays None (smi_error says why)."""
    from orchestrator.agent.gpu import find_nvidia_smi

    kernel, library = kernel_module(), library_version()
    exe = find_nvidia_smi()
    if exe is None:
        return DriverInfo(kernel_module=kernel, library=library)
    try:
        proc = subprocess.run([exe], stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return DriverInfo(smi=exe, smi_error=f"cannot run {exe}: {exc}", kernel_module=kernel, library=library)
    text = (proc.stdout + proc.stderr).decode("utf-8", errors="replace")
    if proc.returncode != 0:  # nvidia-smi prints its complaints on stdout
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return DriverInfo(smi=exe, smi_error=" | ".join(lines[:3]) or f"exit {proc.returncode}",
                          nvml_library=parse_nvml_library(text), kernel_module=kernel, library=library)
    driver, cuda = parse_smi(text)
    return DriverInfo(smi=exe, driver=driver, cuda=cuda, kernel_module=kernel, library=library)


# ------------------------------------------------------------------------------------- the two checks


@dataclass(frozen=True)
class Problem:
    """One mismatch: `type` is DriverTooOld or DriverLibraryMismatch; `data` holds both versions."""

    type: str
    message: str
    data: dict

    def fix(self, lock: str | None = None, target: str | None = None) -> str:
        return fix_text(self.type, self.data, lock=lock, target=target)


def runs_cuda(need: Version, driver: Version | None, driver_cuda: Version | None) -> bool:
    """True when a driver (its version, and the newest CUDA it runs) runs a build for CUDA `need`."""
    if driver_cuda is not None and driver_cuda[:2] >= need[:2]:
        return True
    minimum = MINOR_COMPAT.get(need[0])
    return minimum is not None and driver is not None and driver >= minimum


def driver_major(driver: Version | None, driver_cuda: Version | None) -> int | None:
    """The newest CUDA major a driver runs (from its CUDA version, else from MINOR_COMPAT)."""
    if driver_cuda is not None:
        return driver_cuda[0]
    if driver is None:
        return None
    fits = [major for major, minimum in MINOR_COMPAT.items() if driver >= minimum]
    return max(fits) if fits else None


def check_cuda(torch_cuda: str | None, info: DriverInfo, torch_version: str | None = None) -> Problem | None:
    """None when the driver runs a torch built for `torch_cuda` (or torch is a CPU build, or there is no
    driver to ask: nvidia-smi's own check reports that); else one DriverTooOld problem."""
    need = parse_version(torch_cuda)
    driver, driver_cuda = parse_version(info.driver), parse_version(info.cuda)
    if need is None or (driver is None and driver_cuda is None) or runs_cuda(need, driver, driver_cuda):
        return None
    minimum = MINOR_COMPAT.get(need[0])
    major = driver_major(driver, driver_cuda)
    data = {"torch": torch_version, "torch_cuda": torch_cuda, "driver": info.driver, "driver_cuda": info.cuda,
            "needs_driver": _fmt(minimum) if minimum else None, "fits_major": major,
            "fits_index": CUDA_INDEX.get(major) if major is not None and major < need[0] else None,
            "arch": info.arch}
    what = f"torch {torch_version}" if torch_version else "torch"
    runs = f"CUDA {info.cuda} at most" if info.cuda else f"no CUDA {need[0]}.x"
    needs = f" (CUDA {need[0]}.x needs driver >= {_fmt(minimum)})" if minimum else ""
    return Problem(TOO_OLD, f"the venv's {what} is built for CUDA {torch_cuda}, but the NVIDIA driver "
                   f"{info.driver or '?'} runs {runs}{needs}", data)


def _same(short: str, full: str) -> bool:
    """Versions agree on every component the shorter one has ("550.54" matches "550.54.15")."""
    a, b = parse_version(short), parse_version(full)
    return a is not None and b is not None and a[:len(b)] == b[:len(a)]


def check_library(info: DriverInfo) -> Problem | None:
    """None when the user-space driver matches the kernel module (or either is unknown and nvidia-smi did
    not complain); else one DriverLibraryMismatch problem."""
    library = info.library or info.nvml_library
    said = bool(info.smi_error and NVML_MISMATCH_TEXT.lower() in info.smi_error.lower())
    differs = bool(library and info.kernel_module and not _same(library, info.kernel_module))
    if not (said or differs):
        return None
    lib = f"libnvidia-ml {library}" if library else "its NVIDIA user-space libraries"
    kernel = f"kernel module {info.kernel_module}" if info.kernel_module else "kernel module"
    data = {"library": library, "kernel_module": info.kernel_module, "smi_error": info.smi_error,
            "arch": info.arch}
    return Problem(LIB_MISMATCH, f"the container's {lib} does not match the host's NVIDIA {kernel}: NVML "
                   f"refuses to start (\"Failed to initialize NVML: {NVML_MISMATCH_TEXT}\") and CUDA fails "
                   "with error 803", data)


def check(torch_cuda: str | None, info: DriverInfo, torch_version: str | None = None) -> list[Problem]:
    """Every mismatch, the library one first (while it lasts nvidia-smi cannot name the CUDA version)."""
    return [p for p in (check_library(info), check_cuda(torch_cuda, info, torch_version)) if p is not None]


def _run_file(arch: str | None, version: str) -> str:
    return f"NVIDIA-Linux-{arch or 'x86_64'}-{version}.run"


def fix_text(kind: str, data: dict, lock: str | None = None, target: str | None = None) -> str:
    """The fix for a problem of `kind` with its `data` (pure; golden-tested).

    Args:
        lock: the venv profile's lock (a shipped profile name, or a path), named in the commands; None:
            the running interpreter's torch (the workstation profile).
        target: the inventory target, for `--target`.
    """
    on = f" --target {target}" if target else ""
    if kind == LIB_MISMATCH:
        ver = data.get("kernel_module")
        run = _run_file(data.get("arch"), ver or "<host version>")
        where = (f"the host's version {ver}" if ver
                 else "the host's version (cat /proc/driver/nvidia/version on the host)")
        return (f"install {where} of the NVIDIA driver in the container without kernel modules: "
                f"sh {run} --no-kernel-modules (inside the container), then dflashctl doctor{on}")
    index, needs = data.get("fits_index"), data.get("needs_driver") or "<a version that runs it>"
    upgrade = (f"upgrade the host's NVIDIA driver to >= {needs} and install the same version in the container "
               f"without kernel modules (sh {_run_file(data.get('arch'), '<version>')} --no-kernel-modules), "
               f"then dflashctl doctor{on}")
    if not index:  # no torch build of this driver's CUDA line: only a newer driver helps
        return upgrade
    if lock is None:  # the workstation profile: the running interpreter's own torch
        base = str(data.get("torch") or "").split("+")[0]
        relock = f"python3 -m pip install 'torch{'==' + base if base else ''}' --index-url {index}"
        return f"install a torch built for CUDA {data.get('fits_major')}: {relock}; or {upgrade}"
    relock = (f"dflashctl lock {lock} --extra-index-url {index}" if "/" not in lock and not lock.endswith(".txt")
              else f"regenerate {lock} with uv pip compile --generate-hashes --extra-index-url {index}")
    return (f"use a torch built for CUDA {data.get('fits_major')}: {relock}, add {index} to the venv profile's "
            f"extra_index_urls in the inventory, then dflashctl rebuild-venv{on}; or {upgrade}")


# ------------------------------------------------------------------------------------- what torch is


def installed_torch_cuda() -> str | None:
    """`torch.version.cuda` of the running interpreter's torch, read from torch/version.py without
    importing torch (seconds saved; the agent never imports it)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py"), encoding="utf-8") as fh:
            m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([0-9.]+)['\"]", fh.read(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def venv_torch(workdir: str, profile) -> dict:
    """{torch, cuda, venv, error} of the venv a launch in `workdir` uses: its fingerprint (a uv profile),
    or the running interpreter's torch (the workstation profile; read from its files, not imported)."""
    if profile_kind(profile) == "workstation":
        from importlib import metadata  # here only: a uv venv's fingerprint says it (and the import costs)

        try:
            torch_version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            torch_version = None
        return {"torch": torch_version, "cuda": installed_torch_cuda() if torch_version else None, "venv": None,
                "error": None}
    fp = current_fingerprint(workdir, profile)
    return {"torch": fp.get("torch"), "cuda": fp.get("cuda"), "venv": fp.get("venv"), "error": fp.get("error")}


def profile_lock(profile: dict | None) -> str | None:
    """The lock a venv profile (a dict, as requests carry it) builds from, for the fixes: None for the
    workstation profile (the running interpreter's torch), else its `lock` (the uv default `cuda`)."""
    if profile_kind(profile) == "workstation":
        return None
    return (profile or {}).get("lock") or "cuda"


def describe_ok(torch_version: str | None, torch_cuda: str | None, info: DriverInfo) -> str:
    """The one line a passing check prints."""
    if not torch_cuda:
        return f"torch {torch_version} is a CPU build" if torch_version else "no torch to check"
    if not (info.driver or info.cuda):
        return f"torch {torch_version} (CUDA {torch_cuda}): no NVIDIA driver to check against"
    return (f"driver {info.driver} (CUDA {info.cuda}) runs torch {torch_version} built for CUDA {torch_cuda}")


# ---------------------------------------------------------------------------------------------- CLI


def _event(kind: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": kind, **fields}, default=str) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m orchestrator.agent.driver",
                                description="Check this machine's NVIDIA driver against a venv's torch.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="exit 3 after an error event when the driver cannot run that torch")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--fingerprint", help="a venv's dflashctl-fingerprint.json (torch.version.cuda as imported)")
    src.add_argument("--lock", help="a lock file (the CUDA its torch pins), checked before anything is installed")
    a = p.parse_args(argv)
    if a.fingerprint:
        with open(a.fingerprint, encoding="utf-8") as fh:
            fp = json.load(fh)
        torch_version, torch_cuda = fp.get("torch"), fp.get("cuda")
    else:
        with open(a.lock, encoding="utf-8") as fh:
            torch_version, torch_cuda = lock_torch(fh.read())
    info = probe()
    # A CPU torch uses no GPU: whatever the driver's state, this venv runs (doctor still reports it).
    problems = check(torch_cuda, info, torch_version) if torch_cuda else []
    if problems:
        first = problems[0]
        _event("error", type=first.type, step="driver", message=first.message, fix=first.fix(),
               data={**first.data, "step": "driver", "problems": [asdict(x) for x in problems]})
        return EXIT_MISMATCH
    _event("progress", step="driver", message=describe_ok(torch_version, torch_cuda, info), driver=info.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
