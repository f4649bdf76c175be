"""`doctor`: is a target ready to train? A list of checks, each failure with the command that fixes it.

The NVIDIA driver is checked against the venv's torch (the CUDA it was built for, from the venv's
fingerprint) and the container's driver libraries against the host's kernel module (agent/driver.py);
each failure names both versions and the lock or driver that fits.

Round trips for a container (pct's Perl start-up makes each one cost hundreds of ms), all over ONE SSH
connection: host side `pct status CTID` (not `pct exec`), then at the same time `pct config CTID` and,
in the container, ONE agent `ping` (one `pct exec`) that answers every in-container check.
A first contact with a container that lacks this bundle adds the one-time bundle copy (target.py).
For the local target the same agent ping runs as a subprocess, and the ssh/pct checks do not apply.

The GPU checks (devices passed through, nvidia-smi, the driver) follow the experiments on the target: when
none of them uses a GPU (CPU layouts, command experiments without `gpus`), they are skipped with that reason,
so a CPU-only container is ready when it can run its experiments.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from orchestrator.agent import driver as nvdriver
from orchestrator.agent.requests import PingRequest
from orchestrator.errors import ConnectError, ContainerMissing, DflashError, HostKeyError, PctError
from orchestrator.ops.tmuxfix import TMUX_INSTALL
from orchestrator.quoting import render

OK, FAIL, WARN, SKIP = "ok", "fail", "warn", "skip"

# A GPU device line in `pct config` output: native passthrough (devN: /dev/nvidiaK) or raw lxc entries.
_GPU_DEV = re.compile(r"^(dev\d+:.*?/dev/nvidia(\d+)\b|lxc\.mount\.entry:.*?/dev/nvidia(\d+)\b)", re.M)
_NVIDIA_ANY = re.compile(r"^(dev\d+|lxc\.cgroup2?\.devices\.allow|lxc\.mount\.entry):.*nvidia", re.M)

DEFAULT_MIN_FREE_GIB = {"container": 20.0, "local": 1.0}


@dataclass
class Check:
    """One line of the doctor table.

    Attributes:
        name: what was checked ("ssh reachable", "tmux", ...).
        status: "ok", "fail", "warn" (works, but worth knowing) or "skip" (an earlier failure hides it).
        detail: what was found.
        fix: the command (or edit) that fixes a failure; None when ok.
    """

    name: str
    status: str
    detail: str
    fix: str | None = None

    @property
    def ok(self) -> bool:
        return self.status != FAIL


@dataclass
class DoctorReport:
    """All checks of one target, plus the raw ping answer when the agent was reached."""

    target: str
    kind: str
    checks: list[Check] = field(default_factory=list)
    ping: dict | None = None

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings and skips do not fail doctor)."""
        return all(c.ok for c in self.checks)

    def add(self, name: str, status: str, detail: str, fix: str | None = None) -> None:
        self.checks.append(Check(name, status, detail, fix if status in (FAIL, WARN) else None))

    def to_dict(self) -> dict:
        return {"target": self.target, "kind": self.kind, "ok": self.ok,
                "checks": [asdict(c) for c in self.checks], "ping": self.ping}


def gpu_devices(config_text: str) -> list[int]:
    """Indexes of /dev/nvidiaN devices passed through, from `pct config` output (sorted, unique)."""
    found = set()
    for m in _GPU_DEV.finditer(config_text):
        found.add(int(m.group(2) or m.group(3)))
    return sorted(found)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _fix(prefix: Callable[[list[str]], str] | None, argv: list[str]) -> str:
    """A fix command line: argv run inside the target, as the user pastes it. `prefix` is the container's
    command_line (`ssh ... pct exec CT --keep-env 0 -- argv`); None (or empty) for the local target."""
    return prefix(argv) if prefix else render(argv)


def _driver_checks(rep: DoctorReport, ping: dict, venv: dict, target: str) -> None:
    """The driver's libraries against the kernel module, and the driver against the venv's torch."""
    found = ping.get("driver")
    if not isinstance(found, dict):  # a bundle from before the driver checks
        rep.add(LIB_CHECK, SKIP, "the target's agent does not report the driver")
        rep.add(CUDA_CHECK, SKIP, "the target's agent does not report the driver")
        return
    info, torch = nvdriver.DriverInfo.from_dict(found.get("info")), found.get("venv") or {}
    lock = nvdriver.profile_lock(venv)
    problem = nvdriver.check_library(info)
    if problem:
        rep.add(LIB_CHECK, FAIL, problem.message, problem.fix(lock=lock, target=target))
        for c in rep.checks:  # the same cause breaks nvidia-smi: one fix for both lines
            if c.name == "nvidia-smi readable" and c.status == FAIL:
                c.fix = rep.checks[-1].fix
    elif info.kernel_module and (info.library or info.driver):
        rep.add(LIB_CHECK, OK, f"driver libraries {info.library or info.driver} = kernel module {info.kernel_module}")
    else:
        rep.add(LIB_CHECK, SKIP, "no NVIDIA kernel module loaded" if not info.kernel_module
                else f"kernel module {info.kernel_module}; no driver libraries to compare")
    if torch.get("error") and not torch.get("torch"):
        rep.add(CUDA_CHECK, SKIP, f"{torch['error']}; rebuild-venv checks the driver before switching")
        return
    problem = nvdriver.check_cuda(torch.get("cuda"), info, torch.get("torch"))
    if problem:
        rep.add(CUDA_CHECK, FAIL, problem.message, problem.fix(lock=lock, target=target))
    elif torch.get("cuda") and not (info.driver or info.cuda):
        rep.add(CUDA_CHECK, SKIP, f"torch {torch.get('torch')} (CUDA {torch['cuda']}): needs a readable nvidia-smi")
    else:
        rep.add(CUDA_CHECK, OK, nvdriver.describe_ok(torch.get("torch"), torch.get("cuda"), info))


def _agent_checks(rep: DoctorReport, ping: dict, kind: str, prefix, min_free_gib: float,
                  venv: dict | None = None, target: str = "") -> None:
    """The in-target checks, all from one ping answer. `prefix` runs a fix inside the target; `venv` is
    the target's venv profile (with its `name`)."""
    py = ping.get("python") or {}
    rep.add("python3", OK, f"Python {py.get('version')} at {py.get('executable')}")

    gpus = (ping.get("gpus") or {}).get("gpus") or []
    reason = (ping.get("gpus") or {}).get("reason")
    if gpus and not reason:
        mem = ", ".join(f"{g['index']}:{g.get('used_mib')}/{g.get('total_mib')} MiB" for g in gpus)
        rep.add("nvidia-smi readable", OK, f"{len(gpus)} GPU(s): {mem}")
    elif kind == "local":
        rep.add("nvidia-smi readable", WARN, f"no GPU here ({reason}); the CPU experiments (tiny) still run",
                "install the NVIDIA driver to train on GPUs")
    else:
        rep.add("nvidia-smi readable", FAIL, reason or "no GPUs listed",
                "install the host's NVIDIA driver version in the container without kernel modules "
                "(NVIDIA-Linux-*.run --no-kernel-modules)")
    _driver_checks(rep, ping, venv or {}, target)

    # A container gets both from rebuild-venv (tmux by apt-get, uv: the workstation's own binary), so their
    # absence there is the next step, not a failure; locally, tmux is the user's to install.
    rebuild = render(["dflashctl", "rebuild-venv", "--target", rep.target])
    tmux = ping.get("tmux")
    if tmux:
        rep.add("tmux", OK, tmux)
    elif kind == "container":
        rep.add("tmux", WARN, "tmux not installed (runs live in tmux sessions)",
                f"{rebuild}  (installs it with apt-get), or: {_fix(prefix, TMUX_INSTALL)}")
    else:
        rep.add("tmux", FAIL, "tmux not found on PATH", "apt-get install -y tmux")

    uv = ping.get("uv")
    rep.add("uv", OK if uv else WARN, f"{uv.get('version')} at {uv.get('path')}" if uv
            else "uv not found (rebuild-venv brings this workstation's own)", rebuild)

    disk = ping.get("disk") or {}
    free = disk.get("free_bytes")
    if free is None:
        rep.add("free disk", FAIL, f"cannot measure free space at {disk.get('path')}: {disk.get('error')}")
    elif free < min_free_gib * 2**30:
        rep.add("free disk", FAIL, f"{_gib(free)} free at {disk.get('path')} (< {min_free_gib:g} GiB)",
                f"free space under {disk.get('path')} (old venvs: dflashctl rebuild-venv prunes to `keep`)")
    else:
        rep.add("free disk", OK, f"{_gib(free)} free of {_gib(disk.get('total_bytes'))} at {disk.get('path')}")

    for key, label in (("workdir", "workdir writable"), ("inductor_cache_dir", "inductor cache dir writable")):
        d = ping.get(key) or {}
        if d.get("writable"):
            rep.add(label, OK, str(d.get("path")))
        else:
            rep.add(label, FAIL, f"{d.get('path')}: {d.get('error')}",
                    _fix(prefix, ["mkdir", "-p", str(d.get("path"))]) + "  (and check its owner and mount)")


def _ping(rep: DoctorReport, target, kind: str, prefix, min_free_gib: float,
          venv: dict | None = None) -> None:
    """Run the one agent ping and turn its answer into checks (or one failure and skips)."""
    try:
        ping = target.agent("ping", PingRequest(venv_profile=venv or {}).to_json(), timeout=120)
    except DflashError as exc:  # AgentError, RemoteCommandError (no python3), ConnectError, pct errors
        if "python3" in exc.message:
            rep.add("python3", FAIL, exc.message, _fix(prefix, ["apt-get", "install", "-y", "python3"]))
        else:
            rep.add("python3", FAIL, f"the agent could not run: {exc.message}", exc.fix)
        _skip_rest(rep, "needs the agent", _ORDER[_ORDER.index("python3"):])
        return
    rep.ping = ping
    _agent_checks(rep, ping, kind, prefix, min_free_gib, venv, target.name)


def _venv_profile(inv, spec) -> dict:
    """The target's venv profile as the agent takes it (with its name); {} when the inventory lacks it
    (the launch and rebuild-venv verbs report that)."""
    try:
        return {"name": spec.venv, **inv.venv(spec.venv).model_dump()}
    except DflashError:
        return {}


def gpu_experiments(inv, target_name: str) -> tuple[list[str], list[str]]:
    """(experiments that use a GPU on `target_name`, every experiment on it), by name in inventory order.

    An experiment is on a target when it is its `target` or one node of its layout; it uses a GPU there when
    its layout gives that node (or the single target) GPUs, or, for a command, when it lists `gpus`."""
    on, gpu = [], []
    for name, exp in inv.experiments.items():
        layout = getattr(exp, "layout", None)
        nodes = layout.nodes if layout is not None else []
        if nodes:
            mine = [n for n in nodes if n.target == target_name]
            if not mine:
                continue
            uses = any(n.gpus for n in mine)
        elif exp.target == target_name:
            uses = bool(layout.gpus) if layout is not None else bool(getattr(exp, "gpus", []))
        else:
            continue
        on.append(name)
        if uses:
            gpu.append(name)
    return gpu, on


def _follow_experiments(rep: DoctorReport, inv, target_name: str) -> DoctorReport:
    """Skip the GPU checks, with the reason, when no experiment on the target uses a GPU."""
    gpu, on = gpu_experiments(inv, target_name)
    if gpu:
        return rep
    if on:
        why = f"no experiment on {target_name} uses a GPU ({', '.join(on)}: CPU only)"
    else:
        why = f"no experiment in {inv.source} runs on {target_name}"
    for c in rep.checks:
        hidden = c.status == SKIP and c.detail.startswith("needs ")  # an earlier failure's reason stays
        if c.name in GPU_CHECKS and not hidden:
            c.status, c.detail, c.fix = SKIP, f"{why}; found: {c.detail}", None
    return rep


def doctor(inv, target_name: str, *, min_free_gib: float | None = None) -> DoctorReport:
    """Check that target `target_name` can train.

    Args:
        inv: the Inventory.
        target_name: key of `targets:`.
        min_free_gib: free disk below this fails (default 20 GiB in a container, 1 GiB locally).
    Returns:
        A DoctorReport; `.ok` is False when any check failed. Connection trouble is reported as a failed
        check, not raised. The GPU checks are skipped (with the reason) when no experiment on the target
        uses a GPU.
    Raises:
        InventoryError / UserError: unknown or unsafe target name.
    """
    from orchestrator.inventory import ContainerTargetSpec

    spec = inv.target(target_name)
    if not isinstance(spec, ContainerTargetSpec):
        from orchestrator.target import open_target

        rep = DoctorReport(target_name, "local")
        target = open_target(inv, target_name)
        try:
            _ping(rep, target, "local", [], DEFAULT_MIN_FREE_GIB["local"] if min_free_gib is None else min_free_gib,
                  _venv_profile(inv, spec))
        finally:
            target.close()
        return _follow_experiments(rep, inv, target_name)
    rep = _doctor_container(inv, target_name, spec,
                            DEFAULT_MIN_FREE_GIB["container"] if min_free_gib is None else min_free_gib)
    return _follow_experiments(rep, inv, target_name)


def _doctor_container(inv, name: str, spec, min_free_gib: float) -> DoctorReport:
    from orchestrator.target import open_target

    host = inv.host(spec.host)
    rep = DoctorReport(name, "container")
    ctid = spec.ctid
    # Host-side pct calls and the one pct exec share the target's one SSH connection.
    target = open_target(inv, name)
    try:
        # 1. ssh + host key + pct: the first host-side call (`pct status`) proves all three.
        try:
            state = target.host.status()
        except HostKeyError as exc:
            rep.add("ssh reachable", SKIP, f"{host.ssh} answered, but its host key is not trusted")
            rep.add("host key known", FAIL, exc.message, exc.fix or f"dflashctl trust {spec.host}")
            return _skip_rest(rep, "needs ssh")
        except ConnectError as exc:
            rep.add("ssh reachable", FAIL, exc.message,
                    exc.fix or f"check that `{target.host.host_line(['true'])}` works (hosts.{spec.host} in {inv.source})")
            return _skip_rest(rep, "needs ssh")
        except ContainerMissing as exc:
            _ssh_ok(rep, host)
            rep.add("pct present", OK, f"{target.host.words('status')} answered")
            rep.add("container running", FAIL, exc.message,
                    f"fix targets.{name}.ctid in {inv.source} (`{target.host.list_line()}` lists the containers)")
            return _skip_rest(rep, "needs the container")
        except PctError as exc:  # PctNotFound, SudoRequired, or pct failing some other way
            _ssh_ok(rep, host)
            rep.add("pct present", FAIL, exc.message, exc.fix)
            return _skip_rest(rep, "needs pct")
        _ssh_ok(rep, host)
        rep.add("pct present", OK, f"{target.host.words('status')} answered")

        # 2. container state (host side).
        running = state == "running"
        if running:
            rep.add("container running", OK, f"CT {ctid}: {state}")
        else:
            rep.add("container running", FAIL, f"CT {ctid} is {state}", target.host.line("start"))

        # 3 and 4 at once over the one SSH connection (each pct call pays pct's Perl start-up):
        # the GPU devices in the container config (host side; readable while stopped too) and, when the
        # container runs, everything inside it: ONE pct exec (the agent ping).
        with ThreadPoolExecutor(max_workers=1) as pool:
            config = pool.submit(_pct_config, target)
            inside = DoctorReport(name, "container")
            if running:
                _ping(inside, target, "container", target.command_line, min_free_gib, _venv_profile(inv, spec))
            _gpu_device_check(rep, config.result(), ctid, target.host.line)
        rep.checks.extend(inside.checks)
        rep.ping = inside.ping
        if not running:
            return _skip_rest(rep, "needs a running container")
        return rep
    finally:
        target.close()


def _pct_config(target) -> str | PctError:
    """`pct config CTID` text, or the PctError it raised (returned, to be reported in order)."""
    try:
        return target.host.config_text()
    except PctError as exc:
        return exc


def _gpu_device_check(rep: DoctorReport, cfg: str | PctError, ctid: int, pct_line: Callable[..., str]) -> None:
    """`pct_line(verb, *args)`: `pct VERB CTID args` on the host as the user pastes it."""
    if isinstance(cfg, PctError):
        rep.add("GPU devices visible", FAIL, cfg.message, pct_line("config"))
        return
    devs = gpu_devices(cfg)
    if devs:
        rep.add("GPU devices visible", OK, f"{len(devs)} passed through: " + ", ".join(f"/dev/nvidia{i}" for i in devs))
    elif _NVIDIA_ANY.search(cfg):
        rep.add("GPU devices visible", WARN, "nvidia device rules present but no /dev/nvidiaN entries",
                pct_line("set", "-dev0", "/dev/nvidia0") + " ...")
    else:
        rep.add("GPU devices visible", FAIL, f"CT {ctid}'s config passes no /dev/nvidia* device",
                pct_line("set", "-dev0", "/dev/nvidia0", "-dev1", "/dev/nvidiactl", "-dev2", "/dev/nvidia-uvm",
                         "-dev3", "/dev/nvidia-uvm-tools") + ", then restart the container")


def _ssh_ok(rep: DoctorReport, host) -> None:
    rep.add("ssh reachable", OK, f"{host.user + '@' if host.user else ''}{host.ssh}:{host.port or 22}")
    rep.add("host key known", OK, "matches known_hosts")


LIB_CHECK, CUDA_CHECK = "driver libraries = kernel module", "driver runs the venv's torch"
GPU_CHECKS = ("GPU devices visible", "nvidia-smi readable", LIB_CHECK, CUDA_CHECK)
_ORDER = ["ssh reachable", "host key known", "pct present", "container running", "GPU devices visible",
          "python3", "nvidia-smi readable", LIB_CHECK, CUDA_CHECK, "tmux", "uv", "free disk", "workdir writable",
          "inductor cache dir writable"]


def _skip_rest(rep: DoctorReport, why: str, names: list[str] | None = None) -> DoctorReport:
    """Add every check not yet reported (of `names`, default all) as skipped because of `why`."""
    done = {c.name for c in rep.checks}
    for n in names or _ORDER:
        if n not in done:
            rep.add(n, SKIP, why)
    return rep
