"""A stand-in for `nvidia-smi` inside a fake container. Stdlib only; installed as `<ct>/sbin/nvidia-smi`,
which the container sees as /usr/local/sbin/nvidia-smi (on lxc's default PATH).

The GPUs are described by `.gpus.json` next to this file (written by FakeContainer):
  {"driver_version": "...", "cuda_version": "12.8", "name": "...", "error": null | "text",
   "gpus": [{"index": 0, "uuid": "GPU-...", "pci_bus_id": "...", "memory_used": 0, "memory_total": 81559}]}
`driver_version` is the container's own user-space driver (libnvidia-ml, libcuda) and `cuda_version` the
newest CUDA that driver runs. The kernel module is the host's: like NVML, every call first compares the
user-space version with the module's version in /proc/driver/nvidia/version (the host's, as a real
container sees it) and, when they differ, fails as the real tool does: "Failed to initialize NVML:
Driver/library version mismatch" plus "NVML library version: <major.minor>", exit 18. Without that file
(a fake host that does not provide it) the check is skipped.

Supported: `--query-gpu=F,F,... --format=csv[,noheader][,nounits]` (fields below), `-i/--id=LIST`, `-L`,
and no arguments (the table, with the real header's "Driver Version: X  CUDA Version: Y"). Anything else
fails like the real tool does.

A slow call: the real tool can take seconds (a wedged GPU, persistence mode off). A test holds exactly ONE
call with `hold(dir)`: the first call to find `.hold` beside this file takes it (renamed to `.held`, so no
other call waits) and answers only once `release(dir)` removes `.held`; `wait_held(dir)` returns when a
call is waiting. This is how a test keeps a launch inside its preflight while another launch contends. Each call that answered
is noted beside this file (`answered(dir)`), so a test can see which calls ran while one was held.
"""

import json
import os
import re
import sys
import time

FIELDS = {
    # field: (json key or callable, unit)
    "index": (lambda g, s: str(g["index"]), None),
    "uuid": (lambda g, s: g["uuid"], None),
    "gpu_uuid": (lambda g, s: g["uuid"], None),
    "name": (lambda g, s: s["name"], None),
    "gpu_name": (lambda g, s: s["name"], None),
    "pci.bus_id": (lambda g, s: g["pci_bus_id"], None),
    "gpu_bus_id": (lambda g, s: g["pci_bus_id"], None),
    "driver_version": (lambda g, s: s["driver_version"], None),
    "count": (lambda g, s: str(len(s["gpus"])), None),
    "memory.used": (lambda g, s: str(g["memory_used"]), "MiB"),
    "memory.total": (lambda g, s: str(g["memory_total"]), "MiB"),
    "memory.free": (lambda g, s: str(g["memory_total"] - g["memory_used"]), "MiB"),
    "utilization.gpu": (lambda g, s: str(g.get("utilization", 0)), "%"),
    "temperature.gpu": (lambda g, s: str(g.get("temperature", 35)), None),
}

INVALID = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
KERNEL_VERSION_FILE = "/proc/driver/nvidia/version"
# NVML's error value for NVML_ERROR_LIB_RM_VERSION_MISMATCH, which nvidia-smi exits with.
EXIT_LIB_MISMATCH = 18


def load() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, ".gpus.json")) as fh:
        return json.load(fh)


def fail(text: str, code: int = 2) -> int:
    sys.stdout.write(text)  # the real tool prints its complaints on stdout
    return code


def kernel_module() -> str | None:
    """The loaded kernel module's version, as the container sees it (None: no such file)."""
    try:
        with open(KERNEL_VERSION_FILE) as fh:
            m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+([0-9.]+)", fh.read())
    except OSError:
        return None
    return m.group(1) if m else None


def nvml_init(state: dict) -> str | None:
    """NVML's start-up check: the failure text when the user-space driver is not the kernel module's."""
    kernel = kernel_module()
    if kernel is None or kernel == state["driver_version"]:
        return None
    short = ".".join(state["driver_version"].split(".")[:2])
    return f"Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {short}\n"


def table(state: dict, gpus: list[dict]) -> str:
    """Bare `nvidia-smi`: the header the real tool prints, then one row per GPU."""
    rule = "+" + "-" * 89 + "+\n"
    head = (f"| NVIDIA-SMI {state['driver_version']:<22} Driver Version: {state['driver_version']:<14} "
            f"CUDA Version: {state.get('cuda_version') or 'N/A':<8} |\n")
    rows = [f"| {g['index']:>3}  {state['name']:<28} {g['pci_bus_id']}  "
            f"{g['memory_used']}MiB / {g['memory_total']}MiB |\n" for g in gpus]
    return rule + head + rule + "".join(rows) + ("" if gpus else "No running processes found\n")


HOLD, HELD = ".hold", ".held"
ANSWERED = ".answered"


def _hold_point() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        os.rename(os.path.join(here, HOLD), os.path.join(here, HELD))  # atomic: one call takes the hold
    except OSError:
        return
    while os.path.exists(os.path.join(here, HELD)):
        time.sleep(0.02)


def hold(directory) -> None:
    """(test side) Hold the next call of the stand-in installed in `directory`."""
    open(os.path.join(directory, HOLD), "w").close()


def wait_held(directory, timeout: float = 60.0) -> None:
    """(test side) Return once a call is held; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(directory, HELD)):
        if time.monotonic() > deadline:
            raise AssertionError(f"no nvidia-smi call was held in {directory} within {timeout} s")
        time.sleep(0.02)


def release(directory) -> None:
    """(test side) Let the held call answer; a hold nobody took is withdrawn."""
    for name in (HELD, HOLD):
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass


def main(args: list[str]) -> int:
    _hold_point()
    state = load()
    if state.get("error"):
        return fail(state["error"].rstrip("\n") + "\n\n", 9)
    mismatch = nvml_init(state)
    if mismatch:
        return fail(mismatch, EXIT_LIB_MISMATCH)
    query = fmt = None
    ids = None
    listing = False
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, val = a.partition("=")
        if name in ("--query-gpu", "--format", "--id", "-i") and not eq:
            if i + 1 >= len(args):
                return fail(INVALID)
            i += 1
            val = args[i]
        if name == "--query-gpu":
            query = [f.strip() for f in val.split(",") if f.strip()]
        elif name == "--format":
            fmt = [f.strip() for f in val.split(",")]
        elif name in ("--id", "-i"):
            ids = [x.strip() for x in val.split(",")]
        elif a in ("-L", "--list-gpus"):
            listing = True
        else:
            return fail(INVALID)
        i += 1
    gpus = state["gpus"]
    if ids is not None:
        known = {str(g["index"]) for g in gpus}
        for x in ids:
            if x not in known:
                return fail("No devices were found\n", 6)
        gpus = [g for g in gpus if str(g["index"]) in ids]
    if listing:
        for g in gpus:
            sys.stdout.write(f"GPU {g['index']}: {state['name']} (UUID: {g['uuid']})\n")
        return 0
    if query is not None:
        if fmt is None or "csv" not in fmt or any(f not in ("csv", "noheader", "nounits") for f in fmt):
            return fail(INVALID)
        for field in query:
            if field not in FIELDS:
                return fail(f'Field "{field}" is not a valid field to query.\n\n', 2)
        units = "nounits" not in fmt
        if "noheader" not in fmt:
            heads = [f"{f} [{FIELDS[f][1]}]" if FIELDS[f][1] and units else f for f in query]
            sys.stdout.write(", ".join(heads) + "\n")
        for g in gpus:
            cells = []
            for f in query:
                getter, unit = FIELDS[f]
                value = getter(g, state)
                cells.append(f"{value} {unit}" if unit and units else value)
            sys.stdout.write(", ".join(cells) + "\n")
        return 0
    if fmt is not None:
        return fail(INVALID)
    sys.stdout.write(table(state, gpus))
    return 0


def _answered(args: list[str]) -> None:
    """Note a finished call beside this file (one JSON line of its arguments): answered() reads them."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), ANSWERED), "a") as fh:
            fh.write(json.dumps(args) + "\n")
    except OSError:
        pass  # a directory the caller cannot write (a container's): the log is only for tests that read it


def answered(directory) -> list[list[str]]:
    """(test side) The arguments of every call that has answered, in order."""
    try:
        text = open(os.path.join(directory, ANSWERED)).read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines()]


if __name__ == "__main__":
    rc = main(sys.argv[1:])
    sys.stdout.flush()
    _answered(sys.argv[1:])
    sys.exit(rc)
