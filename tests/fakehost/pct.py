"""A stand-in for Proxmox VE's `pct`, for tests. Stdlib only; installed as `<base>/bin/pct`.

Texts, exit codes and the PATH reset follow docs/remote-stack.md §1 (pve-container
6.1.10): pct-level failures are Perl `die`s (exit 255 here), `exec` passes the command's own status
through (128+signo when a signal killed it), and `pct` resets PATH to /sbin:/bin:/usr/sbin:/usr/bin
before anything runs.

A container is a directory `<base>/ct/<id>/` whose init process holds its own mount+pid+uts namespaces
(`unshare`); `exec` joins them with `nsenter`, like lxc-attach, and runs argv without a shell.

Knobs (files, so the fixture can change them between calls):
  <base>/pct-delay        seconds to sleep before every call (models Perl start-up)
  <base>/pct-error        when present, every call prints its text on stderr and exits 255
  <base>/pct-calls.jsonl  every call appended as {"argv": [...], "time": epoch}
"""

from __future__ import annotations

import json
import os
import signal
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


def init_pid(base: Path, ctid: int) -> int | None:
    """The host pid of the container's init, or None when it is not running.

    The pid file holds `pid pidns-inode`; the inode check makes a recycled pid read as stopped.
    """
    try:
        pid_s, ns = (ct_dir(base, ctid) / "init.pid").read_text().split()
        pid = int(pid_s)
        if os.readlink(f"/proc/{pid}/ns/pid") != ns:
            return None
        with open(f"/proc/{pid}/stat") as fh:  # a zombie init means the namespace is gone
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
        return pid
    except (OSError, ValueError):
        return None


def parse_vmid(text: str) -> int:
    if not text.isdigit() or not 100 <= int(text) <= 999999999:
        raise Die("400 Parameter verification failed.\nvmid: invalid format - value does not look like a valid VM ID\n")
    return int(text)


# ------------------------------------------------------------------------------------------- lifecycle


def start(base: Path, ctid: int, timeout: float = 10.0) -> int:
    """Start the container's init in new mount+pid+uts namespaces; return its host pid."""
    conf = dict(read_conf(base, ctid))
    if init_pid(base, ctid) is not None:
        raise Die(f"CT {ctid} already running")
    root = ct_dir(base, ctid)
    ready = root / "ready"
    ready.unlink(missing_ok=True)
    init = base / "bin" / "ctinit"
    hostname = conf.get("hostname", f"ct{ctid}")
    log = open(root / "init.log", "ab")
    proc = subprocess.Popen(
        ["unshare", "--mount", "--pid", "--uts", "--fork", "--mount-proc", "--propagation", "private",
         str(init), str(root), hostname],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
    )
    log.close()
    deadline = time.monotonic() + timeout
    child = None
    while time.monotonic() < deadline:
        if child is None:
            try:
                kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                child = int(kids[0]) if kids else None
            except OSError:
                child = None
        if child is not None and ready.exists():
            ns = os.readlink(f"/proc/{child}/ns/pid")
            tmp = root / "init.pid.tmp"
            tmp.write_text(f"{child} {ns}\n")
            os.replace(tmp, root / "init.pid")
            return child
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    detail = (root / "init.log").read_text(errors="replace").strip().splitlines()[-3:]
    raise Die(f"startup for container '{ctid}' failed: {' | '.join(detail) or 'init did not become ready'}")


def stop(base: Path, ctid: int, timeout: float = 10.0) -> None:
    """Kill the init: the pid namespace dies with it, and so does everything inside (tmux too)."""
    read_conf(base, ctid)
    pid = init_pid(base, ctid)
    if pid is None:
        raise Die(f"CT {ctid} not running")
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and init_pid(base, ctid) is not None:
        time.sleep(0.01)
    (ct_dir(base, ctid) / "init.pid").unlink(missing_ok=True)


def exec_env(keep_env: bool) -> dict[str, str]:
    """The environment the command gets, like lxc-attach --keep-env / --clear-env after pct's PATH reset."""
    if keep_env:
        env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
        env["PATH"] = PCT_PATH
        return env
    return {"container": "lxc", "PATH": CLEAR_ENV_PATH}


def nsenter_argv(pid: int, argv: list[str]) -> list[str]:
    """Join the container's namespaces with its init's root and working directory (both its "/"; a path
    given to --root/--wd would be opened in the host's mount namespace, outside a stock container's root)."""
    return ["nsenter", "-t", str(pid), "-m", "-p", "-u", "-r", "-w", "--", *argv]


def run_in(base: Path, ctid: int, argv: list[str], keep_env: bool) -> int:
    """Run argv inside the container; return its status (128+signo when killed by a signal)."""
    pid = init_pid(base, ctid)
    if pid is None:
        raise Die(f"container '{ctid}' not running!")
    # nsenter resolves argv[0] with the PATH it is given, like lxc-attach inside the container.
    proc = subprocess.Popen(nsenter_argv(pid, argv), env=exec_env(keep_env))
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
        state = "running" if init_pid(base, ctid) is not None else "stopped"
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
    pid = init_pid(base, ctid)
    state = "running" if pid is not None else "stopped"
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
    if init_pid(base, ctid) is None:
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
    if init_pid(base, ctid) is None:
        raise Die("can only push files to a running CT")
    src, dest = pos[1], pos[2]
    try:
        data = Path(src).read_bytes()
    except OSError as exc:
        raise Die(f"failed to open {src} for reading: {exc.strerror}") from None
    perms = opts.get("perms", "0644")
    # Write inside the container's mount namespace (its /tmp is private), temp + rename.
    script = 'set -e; tmp="$1.pct-push.$$"; cat > "$tmp"; chmod "$2" "$tmp"; mv -f "$tmp" "$1"'
    proc = subprocess.run(nsenter_argv(init_pid(base, ctid), ["sh", "-c", script, "push", dest, perms]),
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
    if init_pid(base, ctid) is None:
        raise Die("can only pull files from a running VM")  # sic, as in pct.pm
    src, dest = pos[1], pos[2]
    proc = subprocess.run(nsenter_argv(init_pid(base, ctid), ["cat", "--", src]),
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
