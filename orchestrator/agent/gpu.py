"""GPUs inside the target: the query, which are busy, the preflight refusal and the wait for release.

The query: `nvidia-smi --query-gpu=index,uuid,memory.used,memory.total
--format=csv,noheader,nounits`, parsed defensively. Standard library only (runs under a bare python3).

NVIDIA does not promise a stable nvidia-smi output format, so every line is checked: a line that does not
parse is reported in `reason`, never turned into a wrong number. No GPU (no nvidia-smi, no driver) is not
an error here: the result is an empty list plus the reason, and the caller decides.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable

from orchestrator.agent.protocol import AgentFailure

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


def start_query() -> Callable[[], tuple[list[dict], str | None]]:
    """query_gpus() started now, on a thread of its own (nvidia-smi takes a good part of a second on a GPU
    host): the function returned waits for its answer, and gives it (or raises what it raised)."""
    box: list = []

    def ask() -> None:
        try:
            box.append((True, query_gpus()))
        except BaseException as exc:  # noqa: BLE001 - raised where the answer is read
            box.append((False, exc))

    thread = threading.Thread(target=ask, name="nvidia-smi", daemon=True)
    thread.start()

    def answer() -> tuple[list[dict], str | None]:
        thread.join()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    return answer


def busy_gpus(gpus: list[int], threshold_mib: int,
              query: Callable[[], tuple[list[dict], str | None]] = query_gpus) -> tuple[list[dict], list[dict], str | None]:
    """Which of `gpus` are not idle, by `query` (nvidia-smi now, or a query started earlier: start_query).

    Returns:
        (busy, seen, reason): busy = [{index, used_mib, total_mib, uuid}] using >= threshold (or missing from
        nvidia-smi, or unreadable); seen = every GPU nvidia-smi listed; reason = why the query fell short.
    """
    seen, reason = query()
    by_index = {g["index"]: g for g in seen}
    busy = []
    for i in gpus:
        g = by_index.get(i)
        if g is None:
            busy.append({"index": i, "used_mib": None, "total_mib": None, "uuid": None, "problem": "not listed by nvidia-smi"})
        elif g.get("used_mib") is None:
            busy.append({**g, "problem": "memory.used not reported"})
        elif g["used_mib"] >= threshold_mib:
            busy.append(g)
    return busy, seen, reason


def describe_busy(busy: list[dict], threshold_mib: int) -> str:
    """'GPU 5 uses 30000 MiB of 81920, GPU 6 is not listed by nvidia-smi' (limit 1024 MiB)."""
    parts = []
    for g in busy:
        if g.get("problem"):
            parts.append(f"GPU {g['index']} {g['problem']}")
        else:
            parts.append(f"GPU {g['index']} uses {g['used_mib']} MiB of {g.get('total_mib')}")
    return ", ".join(parts) + f" (idle means under {threshold_mib} MiB)"


def wait_gpus_idle(gpus: list[int], threshold_mib: int, timeout_s: float, emit) -> list[dict]:
    """Poll nvidia-smi until every GPU of `gpus` is idle; return the last reading.

    Raises:
        AgentFailure("GpuBusy"): still busy after timeout_s (names each GPU and its MiB).
    """
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        busy, seen, reason = busy_gpus(gpus, threshold_mib)
        if not busy:
            return seen
        if time.monotonic() >= deadline:
            raise AgentFailure(
                "GpuBusy",
                "GPUs not released after the old run stopped: " + describe_busy(busy, threshold_mib)
                + (f"; {reason}" if reason else ""),
                fix="find the holder with `nvidia-smi` in the target and end it",
                data={"busy": busy, "threshold_mib": threshold_mib},
            )
        if not announced:
            emit.progress("gpus", "waiting for GPUs to be released: " + describe_busy(busy, threshold_mib))
            announced = True
        time.sleep(0.5)


def preflight_gpus(gpus: list[int], threshold_mib: int,
                   query: Callable[[], tuple[list[dict], str | None]] = query_gpus) -> list[dict]:
    """Every GPU nvidia-smi lists (by `query`, as busy_gpus), when all of `gpus` are idle (an empty list: no
    GPUs asked for).

    Raises:
        AgentFailure("GpuBusy"): names each busy GPU and its MiB.
    """
    if not gpus:
        return []
    busy, seen, reason = busy_gpus(gpus, threshold_mib, query)
    if busy:
        raise AgentFailure(
            "GpuBusy",
            "GPUs of this experiment are busy: " + describe_busy(busy, threshold_mib) + (f"; {reason}" if reason else ""),
            fix="stop what holds them (`dflashctl status` shows runs), or change the experiment's layout",
            data={"busy": busy, "threshold_mib": threshold_mib, "gpus": seen},
        )
    return seen
