"""GPU query inside the target: `nvidia-smi --query-gpu=index,uuid,memory.used,memory.total
--format=csv,noheader,nounits`, parsed defensively. Standard library only (runs under a bare python3).

NVIDIA does not promise a stable nvidia-smi output format, so every line is checked: a line that does not
parse is reported in `reason`, never turned into a wrong number. No GPU (no nvidia-smi, no driver) is not
an error here: the result is an empty list plus the reason, and the caller decides.
"""

from __future__ import annotations

import os
import shutil
import subprocess

QUERY = ["--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"]
# Where nvidia-smi lives when PATH is minimal (pct resets PATH to /sbin:/bin:/usr/sbin:/usr/bin).
_EXTRA_DIRS = ("/usr/bin", "/usr/local/bin", "/usr/local/sbin", "/usr/sbin", "/usr/local/nvidia/bin")


def find_nvidia_smi() -> str | None:
    """Path of nvidia-smi: $DFLASHCTL_NVIDIA_SMI, then PATH, then the usual directories."""
    override = os.environ.get("DFLASHCTL_NVIDIA_SMI")
    if override:
        return override
    found = shutil.which("nvidia-smi")
    if found:
        return found
    for d in _EXTRA_DIRS:
        p = os.path.join(d, "nvidia-smi")
        if os.access(p, os.X_OK):
            return p
    return None


def _mib(field: str) -> int | None:
    """An integer MiB value, or None for `[N/A]`, `[Not Supported]` and the like."""
    field = field.strip()
    try:
        return int(float(field))
    except ValueError:
        return None


def parse_gpu_csv(text: str) -> tuple[list[dict], list[str]]:
    """Parse nvidia-smi CSV lines (index, uuid, memory.used, memory.total).

    Returns:
        (gpus, problems): gpus as {index, uuid, used_mib, total_mib} sorted by index (used/total None when
        the driver reports N/A); problems names every line that could not be parsed.
    """
    gpus: list[dict] = []
    problems: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            problems.append(f"line {n}: expected 4 comma-separated fields, got {len(fields)}: {line.strip()[:120]!r}")
            continue
        try:
            index = int(fields[0])
        except ValueError:
            problems.append(f"line {n}: GPU index {fields[0]!r} is not a number")
            continue
        gpus.append({"index": index, "uuid": fields[1], "used_mib": _mib(fields[2]), "total_mib": _mib(fields[3])})
    gpus.sort(key=lambda g: g["index"])
    return gpus, problems


def query_gpus(timeout: float = 30.0) -> tuple[list[dict], str | None]:
    """Ask nvidia-smi for every GPU's memory use.

    Returns:
        (gpus, reason): reason is None when nvidia-smi answered cleanly; otherwise it says why the list is
        empty or partial (not installed, driver not loaded, timed out, unparsable lines).
    """
    exe = find_nvidia_smi()
    if exe is None:
        return [], "nvidia-smi not found on PATH or in /usr/bin, /usr/local/bin (no NVIDIA driver, or no GPU passed through)"
    try:
        proc = subprocess.run(
            [exe, *QUERY], stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return [], f"{exe} did not answer within {timeout:.0f} s (driver hung?)"
    except OSError as exc:
        return [], f"cannot run {exe}: {exc}"
    out = proc.stdout.decode("utf-8", errors="replace")
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).decode("utf-8", errors="replace").strip().splitlines()
        tail = " | ".join(detail[-3:]) if detail else "no output"
        return [], f"{exe} failed with exit code {proc.returncode}: {tail}"
    gpus, problems = parse_gpu_csv(out)
    if problems:
        return gpus, f"{exe}: unexpected output: " + "; ".join(problems[:3])
    if not gpus:
        return [], f"{exe} lists no GPUs"
    return gpus, None
