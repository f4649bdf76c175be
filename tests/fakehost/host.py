"""The fake Proxmox VE host: a real sshd on 127.0.0.1 and the `pct` / `nvidia-smi` stand-ins.

Everything lives under one base directory (NOT under /tmp: every container bind-mounts its own
directory over /tmp, so paths under the host's /tmp would vanish inside it):

  <base>/ssh/        host keys, sshd_config, authorized_keys, sshd.log
  <base>/client/     the client key (id_ed25519) and a known_hosts that trusts the host key
  <base>/home/       HOME of ssh sessions: empty, so bash reads no rc file
  <base>/bin/        pct, ctinit (first on the ssh session's PATH)
  <base>/etc/pve/nodes/<node>/lxc/<id>.conf
  <base>/lxc/<id>/config   the LXC config `pct start` writes (lxcpath <base>/lxc)
  <base>/ct/<id>/    a container: tmp/, sbin/ (nvidia-smi + .gpus.json), work/ (the target workdir),
                     proc-driver/nvidia/version (the host's kernel module, seen as /proc/driver inside),
                     lxc.log; a stock one also rootfs.json, overlay/delta and overlay/work (its disk), rootfs/ (the
                     overlay, mounted while it runs)
  <base>/pct-calls.jsonl, <base>/pct-delay

See tests/fakehost/README.md.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import pct as pct_impl

HERE = Path(__file__).resolve().parent

DEFAULT_NODE = "pve-test"
GPU_NAME = "NVIDIA H100 80GB HBM3"
GPU_MEM_TOTAL = 81559
DRIVER = "570.133.20"
DRIVER_CUDA = "12.8"  # the newest CUDA the R570 driver runs, as its nvidia-smi prints it
SESSION_PATH_TAIL = "/usr/sbin:/usr/bin:/sbin:/bin"
# Images of stock containers (own Debian 12 root file system; see rootfs.py): as the template ships, and
# with tmux installed (for tests of launching rather than of installing tmux).
STOCK = "debian-12"
STOCK_TMUX = "debian-12+tmux"
IMAGES = (STOCK, STOCK_TMUX)
STOCK_PYTHON = "/usr/bin/python3"  # the image's interpreter, for the stand-ins' shebangs inside


def _python() -> str:
    """An interpreter path for the stand-ins' shebangs: a real binary, never a pyenv shim (a bash script
    that would add ~50 ms per call)."""
    for cand in ("/usr/bin/python3", os.path.realpath(sys.executable)):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise RuntimeError("no python3 interpreter found for the fake host stand-ins")


def _install(src: Path, dest: Path, python: str) -> None:
    body = src.read_text()
    tmp = dest.with_name(dest.name + ".tmp")
    # -I: ignore PYTHON* variables and the user site; -S: no site-packages (stdlib only, faster start).
    tmp.write_text(f"#!{python} -IS\n" + body)
    tmp.chmod(0o755)
    os.replace(tmp, dest)


def _die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to this child when the test process dies (even by SIGKILL),
    so no sshd outlives a crashed test run."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _discard(path: Path) -> None:
    """Remove a directory without waiting: renamed away at once (the name is free), deleted in the background
    (a workdir with a few torch venvs is tens of thousands of unlinks). Leftovers go with the next call."""
    if path.exists():
        os.replace(path, path.parent / f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    trash = [str(p) for p in path.parent.glob(".trash-*")]
    if trash:
        subprocess.Popen(["rm", "-rf", "--", *trash], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)


def _size(mib: float) -> str:
    """A volume's size as Proxmox writes it (`size=2M`, `size=512K`)."""
    kib = int(mib * 1024)
    return f"{kib // 1024}M" if kib % 1024 == 0 else f"{kib}K"


def _mount_volume(path: Path, mib: float, owner: int) -> None:
    """A tmpfs of `mib` MiB at `path` (made), its root owned by uid/gid `owner`."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={int(mib * 1024)}k,mode=0755,uid={owner},gid={owner}"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"mounting a {mib} MiB volume at {path}: {proc.stderr.strip()}")


def _unmount_volumes(workdir: Path) -> None:
    """Unmount every mount at or under `workdir` (its volumes), deepest first."""
    base = str(workdir)
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    for point in sorted((p for p in points if p == base or p.startswith(base + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def cleanup_stale(parent: Path) -> list[Path]:
    """Stop what earlier, crashed test runs left under `parent` (their owner pid is gone): container inits
    and sshd; remove their directories unless they were kept on purpose (a `keep` file).

    Returns:
        The base directories cleaned.
    """
    cleaned = []
    for base in parent.glob("dflash-fakepve-*"):
        try:
            owner = int((base / "owner.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if Path(f"/proc/{owner}").exists():
            continue
        FakePVE(base).close(remove=not (base / "keep").exists())
        cleaned.append(base)
    return cleaned


def lxc_missing() -> str | None:
    """Why this machine cannot run the fake host's LXC containers (None when it can): root, sshd, lxc's
    tools, and the id range Proxmox maps unprivileged containers to (root:100000:65536 in /etc/subuid and
    /etc/subgid). .ci/run installs and writes all of it."""
    if os.geteuid() != 0:
        return "the fake Proxmox host needs root (lxc-start, sshd)"
    for tool in ("lxc-start", "lxc-attach", "lxc-stop", "lxc-info", "ssh-keygen", "ssh"):
        if shutil.which(tool) is None:
            return f"the fake Proxmox host needs `{tool}` on PATH (apt-get install lxc openssh-client)"
    if not os.path.exists("/usr/sbin/sshd"):
        return "the fake Proxmox host needs /usr/sbin/sshd (apt-get install openssh-server)"
    want = f"root:{pct_impl.ID_SHIFT}:{pct_impl.ID_RANGE}"
    for path in ("/etc/subuid", "/etc/subgid"):
        try:
            lines = Path(path).read_text().split()
        except OSError:
            lines = []
        if want not in lines:
            return (f"unprivileged containers need `{want}` in {path}, as on a Proxmox node "
                    f"(echo {want} >> {path})")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)


def sshd_config(base: Path, port: int) -> str:
    """The sshd_config text: absolute paths only, key auth only, a clean session environment."""
    ssh = base / "ssh"
    return "\n".join([
        f"Port {port}",
        "ListenAddress 127.0.0.1",
        f"HostKey {ssh / 'ssh_host_ed25519_key'}",
        f"PidFile {ssh / 'sshd.pid'}",
        f"AuthorizedKeysFile {ssh / 'authorized_keys'}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "PrintLastLog no",
        "UseDNS no",
        "MaxSessions 100",
        "MaxStartups 100:30:200",
        # HOME points at an empty directory: bash started by sshd would otherwise source root's ~/.bashrc
        # (pyenv init etc., ~120 ms per command). PATH puts the fake pct first, as /usr/sbin is on a PVE host.
        f'SetEnv HOME={base / "home"} PATH={base / "bin"}:{SESSION_PATH_TAIL} FAKE_PVE_BASE={base}',
        "Subsystem sftp internal-sftp",
        "LogLevel VERBOSE",
        "",
    ])


class FakeContainer:
    """One container of the fake host. `workdir` is usable as a ContainerTarget workdir, the same path inside
    and outside: `<ct>/work` for a shared-root container (it sees the host's file system except /tmp and
    /usr/local/sbin); for a stock one, a directory of the host storage that is mounted into it at the same
    path (its only view of the host)."""

    def __init__(self, host: "FakePVE", ctid: int):
        self.host = host
        self.ctid = ctid
        self.dir = host.base / "ct" / str(ctid)

    def _rootfs(self) -> dict | None:
        try:
            return json.loads((self.dir / "rootfs.json").read_text())
        except (OSError, ValueError):
            return None

    @property
    def image(self) -> str | None:
        """STOCK / STOCK_TMUX for a container with its own root file system; None for a shared root."""
        spec = self._rootfs()
        return spec["image"] if spec else None

    @property
    def workdir(self) -> str:
        spec = self._rootfs()
        return spec["workdir"] if spec else str(self.dir / "work")

    def host_path(self, path: str) -> Path:
        """Where the host reaches `path` of the running container's own file system (through its init's
        root); for a shared-root container, `path` itself."""
        if self.image is None:
            return Path(path)
        pid = self.pid
        if pid is None:
            raise RuntimeError(f"CT {self.ctid} is not running")
        return Path(f"/proc/{pid}/root") / path.lstrip("/")

    @property
    def running(self) -> bool:
        """lxc's own state (`lxc-info -s`) is RUNNING."""
        return pct_impl.lxc_state(self.host.base, self.ctid) == "RUNNING"

    @property
    def pid(self) -> int | None:
        """Host pid of the container's init (None when stopped)."""
        return pct_impl.init_pid(self.host.base, self.ctid)

    def start(self) -> None:
        """Start it (no pct call is logged)."""
        pct_impl.start(self.host.base, self.ctid)

    def stop(self) -> None:
        """Stop it: everything inside dies with the init (no pct call is logged)."""
        if self.running:
            pct_impl.stop(self.host.base, self.ctid)
        pct_impl.unmount_rootfs(self.host.base, self.ctid)  # also after a container that died on its own

    def _gpu_file(self) -> Path:
        return self.dir / "sbin" / ".gpus.json"

    def gpu_state(self) -> dict:
        return json.loads(self._gpu_file().read_text())

    def _write_gpu_state(self, state: dict) -> None:
        tmp = self._gpu_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self._gpu_file())

    def set_gpu_used(self, index: int, mib: int) -> None:
        """Set memory.used of GPU `index` as nvidia-smi will report it."""
        state = self.gpu_state()
        for gpu in state["gpus"]:
            if gpu["index"] == index:
                gpu["memory_used"] = int(mib)
                break
        else:
            raise IndexError(f"CT {self.ctid} has no GPU {index} (it has {len(state['gpus'])})")
        self._write_gpu_state(state)

    def set_driver(self, version: str, cuda: str | None = None) -> None:
        """Install NVIDIA user-space driver `version` in the container (libnvidia-ml, libcuda, nvidia-smi),
        running CUDA up to `cuda` (nvidia-smi's "CUDA Version"; None prints N/A)."""
        state = self.gpu_state()
        state["driver_version"], state["cuda_version"] = version, cuda
        self._write_gpu_state(state)

    def set_kernel_module(self, version: str) -> None:
        """Make the host's loaded NVIDIA kernel module `version`, as this container sees it in
        /proc/driver/nvidia/version (one module per real host; the fake keeps a copy per container, so
        tests stay independent)."""
        d = self.dir / "proc-driver" / "nvidia"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "version.tmp"
        tmp.write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Tue Mar  4 21:08:24 UTC 2025\n"
                       "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
        os.replace(tmp, d / "version")

    def set_nvidia_error(self, text: str | None) -> None:
        """Make nvidia-smi fail with `text` (exit 9), e.g. a driver/library mismatch; None heals it."""
        state = self.gpu_state()
        state["error"] = text
        self._write_gpu_state(state)

    def exec(self, argv: list[str], *, input: bytes | None = None, timeout: float = 60,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run argv inside the container from the test process, as `pct exec --keep-env 0` would (no pct
        call is logged). Raises RuntimeError when the container is not running."""
        if not self.running:
            raise RuntimeError(f"CT {self.ctid} is not running")
        argv = pct_impl.attach_argv(self.host.base, self.ctid, list(argv), keep_env=env is not None)
        return subprocess.run(argv, input=input, capture_output=True, timeout=timeout,
                              env=env if env is not None else pct_impl.exec_env(False))

    def to_container(self, path: Path | str) -> None:
        """Give `path` (a file or directory the test made from the host, recursively) to the container's
        root: an unprivileged container's root is uid/gid 100000 outside and cannot write what the host's
        root owns, as on a real node (an admin chowns a bind-mounted directory the same way)."""
        if not self.unprivileged:
            return
        for dirpath, dirnames, filenames in os.walk(path):
            for name in [None, *dirnames, *filenames]:
                p = dirpath if name is None else os.path.join(dirpath, name)
                os.lchown(p, pct_impl.ID_SHIFT, pct_impl.ID_SHIFT)
        if not os.path.isdir(path):
            os.lchown(path, pct_impl.ID_SHIFT, pct_impl.ID_SHIFT)

    @property
    def unprivileged(self) -> bool:
        """`unprivileged: 1` in its PVE config (every stock container by default, as Proxmox creates them)."""
        try:
            return dict(pct_impl.read_conf(self.host.base, self.ctid)).get("unprivileged") == "1"
        except pct_impl.Die:
            return False

    def __repr__(self) -> str:
        return f"FakeContainer({self.ctid}, running={self.running})"


class FakePVE:
    """A fake Proxmox VE host. `start()` brings up sshd; `close()` stops containers and sshd.

    Attributes: hostname, port, user, identity_file, known_hosts, base, node.
    """

    def __init__(self, base: Path | None = None, node: str = DEFAULT_NODE):
        if base is None:
            parent = Path(os.environ.get("FAKE_PVE_PARENT", "/var/tmp"))
            parent.mkdir(parents=True, exist_ok=True)
            cleanup_stale(parent)
            base = Path(tempfile.mkdtemp(prefix="dflash-fakepve-", dir=parent))
            base.chmod(0o755)  # an unprivileged container's root (100000) must reach its overlay's upper dir
            (base / "owner.pid").write_text(f"{os.getpid()}\n")
        self.base = Path(base)
        self.node = node
        self.hostname = "127.0.0.1"
        self.port = 0
        self.user = "root"
        self.identity_file = str(self.base / "client" / "id_ed25519")
        self.known_hosts = str(self.base / "client" / "known_hosts")
        self.host_key_file = str(self.base / "ssh" / "ssh_host_ed25519_key")
        self._sshd: subprocess.Popen | None = None
        self._log = None

    # ------------------------------------------------------------------------------------------ setup

    def start(self) -> "FakePVE":
        missing = lxc_missing()
        if missing:
            raise RuntimeError(missing)
        b = self.base
        for sub in ("ssh", "client", "home", "bin", "ct", "lxc", f"etc/pve/nodes/{self.node}/lxc"):
            (b / sub).mkdir(parents=True, exist_ok=True)
        (b / "node").write_text(self.node + "\n")
        (b / "pct-delay").write_text("0\n")
        (b / "pct-calls.jsonl").touch()
        py = _python()
        _install(HERE / "pct.py", b / "bin" / "pct", py)
        _install(HERE / "ctinit.py", b / "bin" / "ctinit", py)
        _keygen(b / "ssh" / "ssh_host_ed25519_key", "fake-pve-host")
        _keygen(b / "client" / "id_ed25519", "fake-pve-client")
        (b / "ssh" / "authorized_keys").write_text((b / "client" / "id_ed25519.pub").read_text())
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
        last = ""
        for _attempt in range(5):
            self.port = _free_port()
            cfg = b / "ssh" / "sshd_config"
            cfg.write_text(sshd_config(b, self.port))
            self._log = open(b / "ssh" / "sshd.log", "ab")
            self._sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(cfg)],
                                          stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                          preexec_fn=_die_with_parent)
            if self._wait_banner(10.0):
                break
            last = (b / "ssh" / "sshd.log").read_text(errors="replace")[-2000:]
            self._stop_sshd()
        else:
            raise RuntimeError(f"sshd did not start:\n{last}")
        pub = (b / "ssh" / "ssh_host_ed25519_key.pub").read_text().split()
        (b / "client" / "known_hosts").write_text(f"[{self.hostname}]:{self.port} {pub[0]} {pub[1]}\n")
        return self

    def _wait_banner(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._sshd.poll() is not None:
                return False
            try:
                with socket.create_connection((self.hostname, self.port), timeout=1) as s:
                    if s.recv(64).startswith(b"SSH-"):
                        return True
            except OSError:
                time.sleep(0.05)
        return False

    def _stop_sshd(self) -> None:
        if self._sshd is not None and self._sshd.poll() is None:
            self._sshd.terminate()
            try:
                self._sshd.wait(5)
            except subprocess.TimeoutExpired:
                self._sshd.kill()
                self._sshd.wait()
        else:
            self._stop_foreign_sshd()
        self._sshd = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _stop_foreign_sshd(self) -> None:
        """Stop an sshd that an earlier process started on this base (found by its pid file, and only if
        its command line names this base's config, so a recycled pid is never hit)."""
        pidfile = self.base / "ssh" / "sshd.pid"
        try:
            pid = int(pidfile.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return
        if str(self.base / "ssh" / "sshd_config").encode() in cmdline:
            os.kill(pid, signal.SIGTERM)

    def close(self, remove: bool = True) -> None:
        """Stop every container and sshd; remove the base directory unless `remove` is False (then a
        `keep` file marks it, so a later run's stale-cleanup leaves it alone)."""
        for d in (self.base / "ct").glob("*"):
            if d.name.isdigit():
                FakeContainer(self, int(d.name)).stop()
        self._stop_sshd()
        if remove:
            for wd in self._stock_workdirs():
                _unmount_volumes(wd)
                _discard(wd)
            shutil.rmtree(self.base, ignore_errors=True)
        elif self.base.exists():
            (self.base / "keep").touch()

    # ----------------------------------------------------------------------------------- containers

    def _stock_workdirs(self) -> list[Path]:
        from . import rootfs  # imported late: `python -m fakehost.rootfs` must not find it imported already

        storage = rootfs.cache_root() / "storage" / "work"
        return list(storage.glob(f"{self.base.name}-*")) if storage.is_dir() else []

    def storage(self) -> Path:
        """The host storage mounted into every stock container at the same path (their workdirs live in
        `work/`; tests may keep a shared uv cache there, as a PVE admin might bind-mount a cache)."""
        from . import rootfs

        return rootfs.storage_dir()

    def create_container(self, ctid: int, gpus: int = 8, running: bool = True, hostname: str | None = None,
                         image: str | None = None, memory_mib: int = 65536, swap_mib: int = 0,
                         network: bool = False, unprivileged: bool | None = None,
                         volumes: dict[str, float] | None = None) -> FakeContainer:
        """Create (or re-create, fresh) LXC container `ctid` with `gpus` stand-in GPUs, all at 0 MiB used.

        Args:
            image: None: a privileged container over the host's file system (fast; for tests of pct, ssh,
                the agent protocol). STOCK: its own Debian 12 root file system (systemd as PID 1, python3
                under PEP 668; no pip, uv or tmux), built once and cached (rootfs.py). STOCK_TMUX: the same
                with tmux installed.
            memory_mib, swap_mib: the `memory:` / `swap:` keys (MiB), the cgroup's limits as Proxmox sets
                them (v1: memory.limit_in_bytes / memory.memsw.limit_in_bytes; v2: memory.max /
                memory.swap.max). Proxmox's own default is 512; the fake's is 64 GiB, i.e. no limit here.
            network: False: no network at all (lxc.net.0.type = empty, loopback only), as a container whose
                net0 reaches nothing. True: the host's network namespace (lxc.net.0.type = none): for tests
                that download from PyPI or Debian inside; a `net0:` line appears in its config.
            unprivileged: default True for a stock container (uid 0 inside is 100000 outside), as Proxmox
                creates them; a shared-root one is always privileged.
            volumes: mount points of a size of their own, {path under the workdir: MiB} (Proxmox's `mpN:
                STORAGE:vm-CTID-disk-N,mp=PATH,size=...`, a small disk that can fill while the root cannot):
                a tmpfs of that size mounted on the host at the workdir's path before the container starts
                (the storage's recursive bind brings it in), owned by the container's root; unmounted by
                remove_container. Stock containers only.
        """
        if image is not None and image not in IMAGES:
            raise ValueError(f"unknown image {image!r}; use one of {IMAGES}")
        if unprivileged is None:
            unprivileged = image is not None
        if unprivileged and image is None:
            raise ValueError("a shared-root container (image=None) is privileged: it shares the host's files")
        if volumes and image is None:
            raise ValueError("volumes are for stock containers (a shared-root one has the host's file systems)")
        ct = FakeContainer(self, ctid)
        self.remove_container(ctid)
        for sub in ("tmp", "sbin", "work"):
            (ct.dir / sub).mkdir(parents=True, exist_ok=True)
        (ct.dir / "tmp").chmod(0o1777)
        ct.set_kernel_module(DRIVER)
        if image is not None:
            from . import rootfs

            built = rootfs.ensure_image()
            storage = self.storage()
            workdir = storage / "work" / f"{self.base.name}-{ctid}"
            _discard(workdir)
            workdir.mkdir(parents=True)
            # lxc's overlay rootfs: the upper layer `overlay/delta` and its work dir `overlay/work` beside it
            # (lxc's own snapshot layout), owned by the container's root as its writes are.
            for d in (ct.dir / "overlay", pct_impl.upper_dir(self.base, ctid), ct.dir / "overlay" / "work"):
                d.mkdir()
                if unprivileged:
                    os.chown(d, pct_impl.ID_SHIFT, pct_impl.ID_SHIFT)
            for i, (rel, mib) in enumerate(sorted((volumes or {}).items()), start=1):
                _mount_volume(workdir / rel, mib, pct_impl.ID_SHIFT if unprivileged else 0)
            if unprivileged:
                os.chown(workdir, pct_impl.ID_SHIFT, pct_impl.ID_SHIFT)
                os.chown(ct.dir / "tmp", pct_impl.ID_SHIFT, pct_impl.ID_SHIFT)
                # /usr/local/sbin is the container's own (the stand-in's hold point renames a file in it).
                os.chown(ct.dir / "sbin", pct_impl.ID_SHIFT, pct_impl.ID_SHIFT)
            spec = {"image": image, "lower": built.lowerdirs(tmux=image == STOCK_TMUX), "workdir": str(workdir),
                    "mounts": [[str(storage), str(storage)]]}
            (ct.dir / "rootfs.json").write_text(json.dumps(spec, indent=1) + "\n")
        state = {
            "driver_version": DRIVER,
            "cuda_version": DRIVER_CUDA,
            "name": GPU_NAME,
            "error": None,
            "gpus": [
                {"index": i, "uuid": f"GPU-{ctid:08x}-{i:04x}-4000-8000-{i:012x}",
                 "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0", "memory_used": 0,
                 "memory_total": GPU_MEM_TOTAL}
                for i in range(gpus)
            ],
        }
        ct._write_gpu_state(state)
        if gpus > 0:
            _install(HERE / "nvidia_smi.py", ct.dir / "sbin" / "nvidia-smi", STOCK_PYTHON if image else _python())
        lines = [
            "arch: amd64",
            "cores: 16",
            f"hostname: {hostname or f'ct{ctid}'}",
            f"memory: {int(memory_mib)}",
        ]
        if network:
            lines.append("net0: name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:00:01,ip=dhcp,type=veth")
        lines += ["ostype: debian", f"rootfs: local-lvm:vm-{ctid}-disk-0,size=64G", f"swap: {int(swap_mib)}"]
        if unprivileged:
            lines.append("unprivileged: 1")
        devs = [f"/dev/nvidia{i}" for i in range(gpus)]
        if gpus:
            devs += ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        lines += [f"dev{i}: {path}" for i, path in enumerate(devs)]
        if image is not None:
            lines.append(f"mp0: {self.storage()},mp={self.storage()}")
            lines += [f"mp{i}: local-lvm:vm-{ctid}-disk-{i},mp={Path(ct.workdir) / rel},size={_size(mib)}"
                      for i, (rel, mib) in enumerate(sorted((volumes or {}).items()), start=1)]
        conf = pct_impl.conf_path(self.base, ctid)
        tmp = conf.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, conf)
        if running:
            ct.start()
        return ct

    def remove_container(self, ctid: int) -> None:
        """Stop and delete container `ctid` (its config too): pct then says the config does not exist."""
        ct = FakeContainer(self, ctid)
        ct.stop()
        if ct.image is not None:
            _unmount_volumes(Path(ct.workdir))
            _discard(Path(ct.workdir))
        pct_impl.conf_path(self.base, ctid).unlink(missing_ok=True)
        shutil.rmtree(pct_impl.lxc_path(self.base) / str(ctid), ignore_errors=True)
        shutil.rmtree(ct.dir, ignore_errors=True)

    def container(self, ctid: int) -> FakeContainer:
        return FakeContainer(self, ctid)

    # ---------------------------------------------------------------------------------------- knobs

    def pct_calls(self) -> list[list[str]]:
        """argv (starting with "pct") of every pct call since the last clear, in order."""
        text = (self.base / "pct-calls.jsonl").read_text()
        return [json.loads(line)["argv"] for line in text.splitlines() if line.strip()]

    def pct_exec_calls(self, ctid: int | None = None) -> list[list[str]]:
        """The `pct exec` calls among pct_calls(), optionally only those for `ctid`."""
        return [c for c in self.pct_calls() if len(c) > 2 and c[1] == "exec" and (ctid is None or c[2] == str(ctid))]

    def clear_pct_calls(self) -> None:
        path = self.base / "pct-calls.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("")
        os.replace(tmp, path)

    def set_delay(self, seconds: float) -> None:
        """Every later pct call sleeps `seconds` first (models pct's Perl start-up)."""
        tmp = self.base / "pct-delay.tmp"
        tmp.write_text(f"{float(seconds)}\n")
        os.replace(tmp, self.base / "pct-delay")

    def set_pct_error(self, text: str | None) -> None:
        """Make every later pct call die with `text` on stderr (exit 255), as real pct does when the host
        itself is wrong, e.g. run by a non-root user without sudo: `ipcc_send_rec[1] failed: Unknown error
        -1` ... `Unable to load access control list: Unknown error -1`. None: pct works again."""
        path = self.base / "pct-error"
        if text is None:
            path.unlink(missing_ok=True)
            return
        tmp = self.base / "pct-error.tmp"
        tmp.write_text(text if text.endswith("\n") else text + "\n")
        os.replace(tmp, path)

    def host_entry(self) -> dict:
        """An inventory `hosts:` entry for this host."""
        return {
            "ssh": self.hostname,
            "port": self.port,
            "user": self.user,
            "identity_file": self.identity_file,
            "known_hosts": self.known_hosts,
            "pct": "pct",
            "sudo": False,
        }

    def ssh_transport(self, **kw):
        """An orchestrator SSHTransport to this host (the caller closes it)."""
        from orchestrator.transport.ssh import SSHTransport

        args = dict(port=self.port, user=self.user, identity_file=self.identity_file, known_hosts=self.known_hosts)
        args.update(kw)
        return SSHTransport(self.hostname, **args)

    def pct_transport(self, ctid: int, **kw):
        """An orchestrator PctTransport into container `ctid` over a new SSHTransport (the caller closes it)."""
        from orchestrator.transport.pct import PctTransport

        return PctTransport(self.ssh_transport(), ctid, **kw)

    def ssh_argv(self, *remote: str) -> list[str]:
        """argv of the OpenSSH client for one command on this host (BatchMode, this host's key files)."""
        return ["ssh", "-p", str(self.port), "-i", self.identity_file, "-o", "BatchMode=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR", f"{self.user}@{self.hostname}", *remote]

    def __enter__(self) -> "FakePVE":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

