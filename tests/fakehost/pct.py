"""A stand-in for Proxmox VE's `pct`, for tests. Stdlib only; installed as `<base>/bin/pct`.

Texts, exit codes and the PATH reset follow docs/remote-stack.md §1 (pve-container
6.1.10): pct-level failures are Perl `die`s (exit 255 here), `exec` passes the command's own status
through (128+signo when a signal killed it), and `pct` resets PATH to /sbin:/bin:/usr/sbin:/usr/bin
before anything runs.

A container is a real LXC container (lxcpath `<base>/lxc`, its files in `<base>/ct/<id>/`): `start` writes
its lxc config from the PVE config and runs `lxc-start`, `stop` is `lxc-stop --kill`, the state is
`lxc-info -s`, `exec` is `lxc-attach --keep-env|--clear-env -- argv` (no shell), as pve-container does.

Knobs (files, so the fixture can change them between calls):
  <base>/pct-delay        seconds to sleep before every call (models Perl start-up)
  <base>/pct-error        when present, every call prints its text on stderr and exits 255
  <base>/pct-calls.jsonl  every call appended as {"argv": [...], "time": epoch}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PCT_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"
# What lxc-attach --clear-env leaves: `container=lxc` and a default PATH (lxc sets one because too many
# programs assume getenv("PATH") is never NULL).
CLEAR_ENV_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PERL_DIE = 255
USAGE = {
    "exec": "pct exec <vmid> [<extra-args>] [OPTIONS]",
    "status": "pct status <vmid> [OPTIONS]",
    "start": "pct start <vmid> [OPTIONS]",
    "stop": "pct stop <vmid> [OPTIONS]",
    "config": "pct config <vmid> [OPTIONS]",
    "push": "pct push <vmid> <file> <destination> [OPTIONS]",
    "pull": "pct pull <vmid> <path> <destination> [OPTIONS]",
    "list": "pct list",
}


class Die(Exception):
    """A Perl `die`: message on stderr, exit 255."""

    def __init__(self, message: str, code: int = PERL_DIE):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------- layout


def default_base() -> Path:
    env = os.environ.get("FAKE_PVE_BASE")
    return Path(env) if env else Path(__file__).resolve().parent.parent


def node_name(base: Path) -> str:
    return (base / "node").read_text().strip()


def conf_path(base: Path, ctid: int) -> Path:
    return base / "etc" / "pve" / "nodes" / node_name(base) / "lxc" / f"{ctid}.conf"


def ct_dir(base: Path, ctid: int) -> Path:
    return base / "ct" / str(ctid)


def read_conf(base: Path, ctid: int) -> list[tuple[str, str]]:
    """The config as (key, value) pairs in file order. Raises Die like AbstractConfig::load_config."""
    path = conf_path(base, ctid)
    if not path.is_file():
        raise Die(f"Configuration file 'nodes/{node_name(base)}/lxc/{ctid}.conf' does not exist")
    pairs = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, _, value = line.partition(":")
        pairs.append((key.strip(), value.strip()))
    return pairs


def lxc_path(base: Path) -> Path:
    """lxc's "lxcpath" of this fake host (`-P`): `<base>/lxc/<id>/config`, as /var/lib/lxc/<id>/config is on
    a Proxmox node; one per fake host, so two test sessions' containers of one id never meet."""
    return base / "lxc"


def lxc_argv(base: Path, tool: str, ctid: int, *args: str) -> list[str]:
    return [f"lxc-{tool}", "-n", str(ctid), "-P", str(lxc_path(base)), *args]


def lxc_state(base: Path, ctid: int) -> str:
    """lxc's own state of the container (`lxc-info -s`): RUNNING, STOPPED, STARTING, ... (STOPPED when lxc
    does not know it)."""
    if not (lxc_path(base) / str(ctid) / "config").is_file():
        return "STOPPED"
    proc = subprocess.run(lxc_argv(base, "info", ctid, "-s", "-H"), capture_output=True, text=True)
    return proc.stdout.strip() or "STOPPED"


def init_pid(base: Path, ctid: int) -> int | None:
    """The host pid of the container's init (`lxc-info -p`), or None when it is not running."""
    if not (lxc_path(base) / str(ctid) / "config").is_file():
        return None
    proc = subprocess.run(lxc_argv(base, "info", ctid, "-p", "-H"), capture_output=True, text=True)
    text = proc.stdout.strip()
    return int(text) if proc.returncode == 0 and text.isdigit() else None


def parse_vmid(text: str) -> int:
    if not text.isdigit() or not 100 <= int(text) <= 999999999:
        raise Die("400 Parameter verification failed.\nvmid: invalid format - value does not look like a valid VM ID\n")
    return int(text)


# ------------------------------------------------------------------------------------------- lifecycle


ID_SHIFT, ID_RANGE = 100000, 65536  # root:100000:65536 in /etc/subuid and /etc/subgid, as on a PVE node
LXC_CONFIG_DIR = Path("/usr/share/lxc/config")
PVE_BEGIN, PVE_END = "# --- BEGIN PVE ---", "# --- END PVE ---"


def cgroup_v2() -> bool:
    """The host's cgroup layout: unified (v2, as on Proxmox VE 7+) or legacy/hybrid (v1)."""
    return os.path.exists("/sys/fs/cgroup/cgroup.controllers")


def rootfs_spec(base: Path, ctid: int) -> dict | None:
    """`<ct>/rootfs.json` of a stock container (image layers, mount points), None for a shared-root one."""
    try:
        return json.loads((ct_dir(base, ctid) / "rootfs.json").read_text())
    except (OSError, ValueError):
        return None


def upper_dir(base: Path, ctid: int) -> Path:
    """A stock container's own layer (its writes, kept across stop/start like its disk) over the image."""
    return ct_dir(base, ctid) / "overlay" / "delta"


def memory_lines(conf: dict[str, str]) -> list[str]:
    """The cgroup limits of the `memory:` and `swap:` keys (MiB), in the host's controller files, as
    pve-container writes them: v1 memory.limit_in_bytes and memory.memsw.limit_in_bytes (memory + swap),
    v2 memory.max and memory.swap.max."""
    mem = int(conf.get("memory", "512")) * 1024 * 1024
    swap = int(conf.get("swap", "0")) * 1024 * 1024
    if cgroup_v2():
        return [f"lxc.cgroup2.memory.max = {mem}", f"lxc.cgroup2.memory.swap.max = {swap}"]
    lines = [f"lxc.cgroup.memory.limit_in_bytes = {mem}"]
    if os.path.exists("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes"):
        lines.append(f"lxc.cgroup.memory.memsw.limit_in_bytes = {mem + swap}")
    return lines


def lxc_config(base: Path, ctid: int, conf: dict[str, str]) -> str:
    """The lxc config of the container, regenerated at every start from its PVE config (as pve-container's
    update_lxc_config does). A stock container (own rootfs) is unprivileged with Proxmox's id map and boots
    the image's systemd; a shared-root one is a privileged container over the host's / with a reaper as init
    (it shares the host's files, which an id-mapped root could not write)."""
    d = ct_dir(base, ctid)
    spec = rootfs_spec(base, ctid)
    lines = ["lxc.arch = amd64", f"lxc.uts.name = {conf.get('hostname', f'ct{ctid}')}",
             f"lxc.include = {LXC_CONFIG_DIR / 'common.conf'}"]
    if spec is not None and conf.get("unprivileged", "0") == "1":
        lines += [f"lxc.include = {LXC_CONFIG_DIR / 'userns.conf'}",
                  f"lxc.idmap = u 0 {ID_SHIFT} {ID_RANGE}", f"lxc.idmap = g 0 {ID_SHIFT} {ID_RANGE}"]
    # No network unless the test asked for one (`lxc.net.0.type = none`: the host's network namespace).
    host_net = bool(conf.get("net0"))
    lines.append(f"lxc.net.0.type = {'none' if host_net else 'empty'}")
    # The container's own cgroup (namespaced) mounted in /sys/fs/cgroup even when init does not mount it.
    if host_net and spec is not None:
        # A user namespace may mount sysfs only in a network namespace it owns: with the host's network
        # the host's /sys is bound instead (read-only).
        lines += ["lxc.mount.auto =", "lxc.mount.auto = proc:mixed cgroup:mixed:force",
                  "lxc.mount.entry = /sys sys none rbind,ro,create=dir 0 0"]
    else:
        lines += ["lxc.mount.auto = cgroup:mixed:force"]
    lines += memory_lines(conf)
    if spec is not None:
        lines.append(f"lxc.rootfs.path = dir:{d / 'rootfs'}")  # the overlay mount_rootfs made
    else:
        lines += ["lxc.rootfs.path = dir:/", f"lxc.init.cmd = {base / 'bin' / 'ctinit'}"]
        # /dev/shm, which a stock container's systemd mounts and the reaper does not (POSIX semaphores:
        # multiprocessing's queues and locks fail without it).
        lines.append("lxc.mount.entry = tmpfs dev/shm tmpfs rw,nosuid,nodev,create=dir 0 0")
    binds = [(d / "tmp", "tmp"), (d / "sbin", "usr/local/sbin")]
    if spec is not None:
        binds += [(Path(src), dest.lstrip("/")) for src, dest in spec.get("mounts", [])]
    for src, dest in binds:
        lines.append(f"lxc.mount.entry = {src} {dest} none rbind,create=dir 0 0")
    # The host's NVIDIA kernel module as the container sees it (/proc/driver/nvidia/version).
    lines.append(f"lxc.mount.entry = {d / 'proc-driver'} proc/driver none bind,optional 0 0")
    lines += [f"lxc.log.file = {d / 'lxc.log'}", "lxc.log.level = WARN"]
    return "\n".join(lines) + "\n"


def _hosts_text(old: str, hostname: str) -> str:
    """/etc/hosts as Proxmox's container setup writes it at every start: localhost, and the host name
    (127.0.1.1) in a marked block it owns; lines outside the block are the user's and stay. A debootstrap
    image has no /etc/hosts at all, and without it `localhost` does not resolve (torch's rendezvous asks)."""
    keep, inside = [], False
    for line in old.splitlines():
        if line.strip() == PVE_BEGIN:
            inside = True
        elif line.strip() == PVE_END:
            inside = False
        elif not inside:
            keep.append(line)
    block = [PVE_BEGIN, f"127.0.1.1 {hostname}.localdomain {hostname}", PVE_END]
    if not any("localhost" in line.split()[1:] for line in keep if line.strip()):
        keep = ["127.0.0.1 localhost.localdomain localhost", "::1 localhost ip6-localhost ip6-loopback", *keep]
    return "\n".join(keep + block) + "\n"


def pve_managed_files(base: Path, ctid: int, spec: dict, hostname: str) -> None:
    """What Proxmox writes into a Debian container's root before every start (unless the container has
    /etc/.pve-ignore.<file>): /etc/hostname and its block of /etc/hosts. Written into the overlay's upper
    layer (the container's own disk), owned by the container's root."""
    upper = upper_dir(base, ctid)
    layers = [upper, *(Path(p) for p in spec["lower"])]

    def current(rel: str) -> Path | None:
        return next((layer / rel for layer in layers if (layer / rel).exists()), None)

    etc = upper / "etc"
    if not etc.exists():
        etc.mkdir(mode=0o755)
        os.chown(etc, ID_SHIFT, ID_SHIFT)
    for name, text in (("hostname", lambda old: f"{hostname}\n"), ("hosts", lambda old: _hosts_text(old, hostname))):
        if current(f"etc/.pve-ignore.{name}") is not None:
            continue
        src = current(f"etc/{name}")
        old = src.read_text() if src is not None else ""
        tmp = etc / f".{name}.pve-tmp"
        tmp.write_text(text(old))
        os.chown(tmp, ID_SHIFT, ID_SHIFT)
        os.replace(tmp, etc / name)


def _mounted(path: Path) -> bool:
    with open("/proc/self/mountinfo") as fh:
        return any(line.split()[4] == str(path) for line in fh)


def mount_rootfs(base: Path, ctid: int, spec: dict) -> None:
    """Mount a stock container's root file system on the host at `<ct>/rootfs` before lxc-start, as
    pve-container mounts a container's volumes first: an overlay of the image's layers (read-only, shared by
    every container) and this container's own layer. Mounted by the host's root, not in the container's user
    namespace: an overlay mounted there would refuse directory renames (EXDEV; dpkg fails on them)."""
    root = ct_dir(base, ctid) / "rootfs"
    root.mkdir(exist_ok=True)
    if _mounted(root):
        return
    work = upper_dir(base, ctid).parent / "work"
    opts = f"lowerdir={':'.join(spec['lower'])},upperdir={upper_dir(base, ctid)},workdir={work}"
    proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(root)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise Die(f"startup for container '{ctid}' failed: mounting its root file system: {proc.stderr.strip()}")


def unmount_rootfs(base: Path, ctid: int) -> None:
    """Undo mount_rootfs (after the container stopped; nothing when it is not mounted)."""
    root = ct_dir(base, ctid) / "rootfs"
    if _mounted(root):
        subprocess.run(["umount", str(root)], capture_output=True, check=True)


def _boot_wait(base: Path, ctid: int, deadline: float) -> str:
    """Wait until the container's systemd has finished booting (`systemctl is-system-running --wait`):
    pct start returns earlier on a real node, but a test that writes /tmp right after the start would race
    systemd-tmpfiles' boot-time cleaning of it. Returns systemd's answer (running, degraded)."""
    while True:
        left = deadline - time.monotonic()
        try:
            proc = subprocess.run(lxc_argv(base, "attach", ctid, "--clear-env", "--", "systemctl",
                                           "is-system-running", "--wait"),
                                  capture_output=True, text=True, timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            return "timeout"
        state = proc.stdout.strip()
        if state in ("running", "degraded") or time.monotonic() > deadline:
            return state or proc.stderr.strip()
        time.sleep(0.05)  # "offline": systemd itself is not up yet


def start(base: Path, ctid: int, timeout: float = 60.0) -> int:
    """Start the container with lxc-start (its config written first, as pve-container does); return its
    init's host pid once it is up (a stock container: once its systemd has booted)."""
    conf = dict(read_conf(base, ctid))
    if lxc_state(base, ctid) != "STOPPED":
        raise Die(f"CT {ctid} already running")
    d = ct_dir(base, ctid)
    spec = rootfs_spec(base, ctid)
    if spec is not None:
        pve_managed_files(base, ctid, spec, conf.get("hostname", f"ct{ctid}"))
        mount_rootfs(base, ctid, spec)
    cfg_dir = lxc_path(base) / str(ctid)
    cfg_dir.mkdir(parents=True, exist_ok=True)
    tmp = cfg_dir / "config.tmp"
    tmp.write_text(lxc_config(base, ctid, conf))
    os.replace(tmp, cfg_dir / "config")
    deadline = time.monotonic() + timeout
    proc = subprocess.run(lxc_argv(base, "start", ctid), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    pid = init_pid(base, ctid)
    if proc.returncode != 0 or pid is None:
        log = (d / "lxc.log").read_text(errors="replace") if (d / "lxc.log").exists() else ""
        # lxc logs the cause first, then the generic "Failed to spawn" and "ABORTING" lines.
        detail = [ln.split(" - ", 2)[-1] for ln in (log + proc.stderr).strip().splitlines() if "ERROR" in ln][:3]
        raise Die(f"startup for container '{ctid}' failed" + (": " + " | ".join(detail) if detail else ""))
    if spec is not None:
        state = _boot_wait(base, ctid, deadline)
        if state not in ("running", "degraded"):
            raise Die(f"startup for container '{ctid}' failed: systemd did not finish booting ({state})")
    return pid


def stop(base: Path, ctid: int) -> None:
    """`lxc-stop --kill`, as `pct stop` ends: SIGKILL to the init, the kernel kills everything in its pid
    namespace (tmux servers and orphans too)."""
    read_conf(base, ctid)
    if lxc_state(base, ctid) == "STOPPED":
        raise Die(f"CT {ctid} not running")
    proc = subprocess.run(lxc_argv(base, "stop", ctid, "--kill"), capture_output=True, text=True)
    if proc.returncode != 0 and lxc_state(base, ctid) != "STOPPED":
        raise Die(f"stopping CT {ctid} failed: {proc.stderr.strip()}")
    unmount_rootfs(base, ctid)


def exec_env(keep_env: bool) -> dict[str, str]:
    """The environment lxc-attach is started with after pct's PATH reset (with --clear-env, lxc-attach
    itself leaves only `container=lxc` and its default PATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
    env["PATH"] = PCT_PATH
    return env


def attach_argv(base: Path, ctid: int, argv: list[str], keep_env: bool) -> list[str]:
    """pve-container's `pct exec`: lxc-attach with --keep-env or --clear-env, argv after `--`, no shell."""
    return lxc_argv(base, "attach", ctid, "--keep-env" if keep_env else "--clear-env", "--", *argv)


def run_in(base: Path, ctid: int, argv: list[str], keep_env: bool) -> int:
    """Run argv inside the (running: cmd_exec checked) container; return its status (lxc-attach's:
    128+signo when killed by a signal)."""
    proc = subprocess.Popen(attach_argv(base, ctid, argv, keep_env), env=exec_env(keep_env))
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:  # pragma: no cover - interactive use only
            continue
    return 128 - code if code < 0 else code


# --------------------------------------------------------------------------------------------- verbs


def parse_options(args: list[str], known: dict[str, bool]) -> tuple[dict[str, str], list[str], list[str]]:
    """Getopt-like: options anywhere before `--` (permute), values for those that take one.

    Args:
        known: option name -> takes a value.
    Returns:
        (options, positionals before `--`, args after `--`).
    """
    opts: dict[str, str] = {}
    pos: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            rest = args[i + 1:]
            break
        if a.startswith("-") and len(a) > 1:
            name, eq, val = a.lstrip("-").partition("=")
            if name not in known:
                raise Die(f"Unknown option: {name}\n400 unable to parse option\n")
            if known[name]:
                if not eq:
                    i += 1
                    if i >= len(args):
                        raise Die(f"Option {name} requires an argument\n400 unable to parse option\n")
                    val = args[i]
                opts[name] = val
            else:
                opts[name] = "1"
        else:
            pos.append(a)
        i += 1
    return opts, pos, rest


def need_vmid(verb: str, pos: list[str]) -> int:
    if not pos:
        raise Die(f"400 not enough arguments\n{USAGE[verb]}\n")
    return parse_vmid(pos[0])


def cmd_list(base: Path, args: list[str]) -> int:
    parse_options(args, {})
    rows = []
    lxc = conf_path_dir(base)
    for path in sorted(lxc.glob("*.conf"), key=lambda p: int(p.stem)):
        ctid = int(path.stem)
        conf = dict(read_conf(base, ctid))
        state = "running" if lxc_state(base, ctid) == "RUNNING" else "stopped"
        rows.append((str(ctid), state, conf.get("lock", ""), conf.get("hostname", f"CT{ctid}")))
    if not rows:
        return 0  # real pct prints nothing at all, not even the header
    fmt = "%-10s %-10s %-12s %-20s\n"
    sys.stdout.write(fmt % ("VMID", "Status", "Lock", "Name"))
    for row in rows:
        sys.stdout.write(fmt % row)
    return 0


def conf_path_dir(base: Path) -> Path:
    return base / "etc" / "pve" / "nodes" / node_name(base) / "lxc"


def cmd_status(base: Path, args: list[str]) -> int:
    opts, pos, _ = parse_options(args, {"verbose": False})
    ctid = need_vmid("status", pos)
    conf = dict(read_conf(base, ctid))
    state = "running" if lxc_state(base, ctid) == "RUNNING" else "stopped"
    pid = init_pid(base, ctid) if state == "running" else None
    if opts.get("verbose"):
        info = {"status": state, "name": conf.get("hostname", ""), "cpus": conf.get("cores", "1"),
                "maxmem": str(int(conf.get("memory", "512")) * 1024 * 1024), "pid": str(pid or "")}
        for key in sorted(info):
            sys.stdout.write(f"{key}: {info[key]}\n")
    else:
        sys.stdout.write(f"status: {state}\n")
    return 0


def cmd_start(base: Path, args: list[str]) -> int:
    _, pos, _ = parse_options(args, {"debug": False, "skiplock": False})
    start(base, need_vmid("start", pos))
    return 0


def cmd_stop(base: Path, args: list[str]) -> int:
    _, pos, _ = parse_options(args, {"skiplock": False, "timeout": True, "overrule-shutdown": False})
    stop(base, need_vmid("stop", pos))
    return 0


def cmd_config(base: Path, args: list[str]) -> int:
    _, pos, _ = parse_options(args, {"current": False, "snapshot": True})
    pairs = read_conf(base, need_vmid("config", pos))
    # Sorted key: value lines, then the raw lxc.* entries in file order (pct.pm `config`).
    plain = sorted((k, v) for k, v in pairs if not k.startswith("lxc.") and k != "digest")
    for key, value in plain:
        sys.stdout.write(f"{key}: {value}\n")
    for key, value in pairs:
        if key.startswith("lxc."):
            sys.stdout.write(f"{key}: {value}\n")
    return 0


def cmd_exec(base: Path, args: list[str]) -> int:
    opts, pos, rest = parse_options(args, {"keep-env": True})
    ctid = need_vmid("exec", pos)
    command = pos[1:] + rest
    keep = opts.get("keep-env", "1")
    if keep not in ("0", "1"):
        raise Die(f"400 Parameter verification failed.\nkeep-env: type check ('boolean') failed - got '{keep}'\n")
    read_conf(base, ctid)
    if lxc_state(base, ctid) != "RUNNING":
        raise Die(f"container '{ctid}' not running!")
    if not command:
        raise Die("missing command")
    return run_in(base, ctid, command, keep == "1")


def cmd_push(base: Path, args: list[str]) -> int:
    opts, pos, _ = parse_options(args, {"user": True, "group": True, "perms": True})
    ctid = need_vmid("push", pos)
    if len(pos) != 3:
        raise Die(f"400 not enough arguments\n{USAGE['push']}\n")
    read_conf(base, ctid)
    if lxc_state(base, ctid) != "RUNNING":
        raise Die("can only push files to a running CT")
    src, dest = pos[1], pos[2]
    try:
        data = Path(src).read_bytes()
    except OSError as exc:
        raise Die(f"failed to open {src} for reading: {exc.strerror}") from None
    perms = opts.get("perms", "0644")
    # Write inside the container's mount namespace (its /tmp is private), temp + rename.
    script = 'set -e; tmp="$1.pct-push.$$"; cat > "$tmp"; chmod "$2" "$tmp"; mv -f "$tmp" "$1"'
    proc = subprocess.run(attach_argv(base, ctid, ["sh", "-c", script, "push", dest, perms], False),
                          input=data, env=exec_env(False), capture_output=True)
    if proc.returncode != 0:
        raise Die(f"failed to write {dest}: {proc.stderr.decode(errors='replace').strip()}")
    return 0


def cmd_pull(base: Path, args: list[str]) -> int:
    _, pos, _ = parse_options(args, {"user": True, "group": True, "perms": True})
    ctid = need_vmid("pull", pos)
    if len(pos) != 3:
        raise Die(f"400 not enough arguments\n{USAGE['pull']}\n")
    read_conf(base, ctid)
    if lxc_state(base, ctid) != "RUNNING":
        raise Die("can only pull files from a running VM")  # sic, as in pct.pm
    src, dest = pos[1], pos[2]
    proc = subprocess.run(attach_argv(base, ctid, ["cat", "--", src], False),
                          env=exec_env(False), capture_output=True)
    if proc.returncode != 0:
        raise Die(f"failed to open {src} for reading")
    tmp = Path(f"{dest}.pct-pull.{os.getpid()}")
    tmp.write_bytes(proc.stdout)
    os.replace(tmp, dest)
    return 0


VERBS = {"list": cmd_list, "status": cmd_status, "start": cmd_start, "stop": cmd_stop, "config": cmd_config,
         "exec": cmd_exec, "push": cmd_push, "pull": cmd_pull}


def log_call(base: Path, argv: list[str]) -> None:
    line = json.dumps({"argv": ["pct", *argv], "time": time.time()}) + "\n"
    # One write() on an O_APPEND descriptor: concurrent calls never interleave within a line.
    fd = os.open(base / "pct-calls.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def delay(base: Path) -> None:
    try:
        seconds = float((base / "pct-delay").read_text().strip() or 0)
    except (OSError, ValueError):
        seconds = 0.0
    if seconds > 0:
        time.sleep(seconds)


def forced_error(base: Path) -> str | None:
    """The text in `<base>/pct-error`, if any: every call prints it and dies."""
    try:
        return (base / "pct-error").read_text() or None
    except OSError:
        return None


def main(argv: list[str] | None = None, base: Path | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    base = base or default_base()
    log_call(base, argv)
    # Real pct resets PATH before running anything (PVE::CLIHandler::run_cli_handler).
    os.environ["PATH"] = PCT_PATH
    delay(base)
    failure = forced_error(base)
    if failure:  # a host-side failure that no verb can escape (see FakePVE.set_pct_error)
        sys.stderr.write(failure)
        return PERL_DIE
    if not argv or argv[0] not in VERBS:
        sys.stderr.write("ERROR: unknown command 'pct %s'\nUSAGE: pct <COMMAND> [ARGS] [OPTIONS]\n"
                         % (argv[0] if argv else ""))
        for usage in USAGE.values():
            sys.stderr.write(f"       {usage}\n")
        return PERL_DIE
    try:
        sys.stdout.flush()
        code = VERBS[argv[0]](base, argv[1:])
        sys.stdout.flush()
        return code
    except Die as exc:
        sys.stdout.flush()
        msg = str(exc)
        sys.stderr.write(msg if msg.endswith("\n") else msg + "\n")
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
