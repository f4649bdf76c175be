"""The fake Proxmox host behaves like the real parts it stands in for (docs/remote-stack.md §1): its `pct` ends
in real LXC containers as pve-container's does, and those containers are what Proxmox makes."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from fakehost import pct as pct_impl

pytestmark = pytest.mark.slow  # runs real processes: `-m "not slow"` leaves it out


@pytest.fixture(scope="module")
def ct(fake_pve):
    return fake_pve.create_container(220, gpus=3)


@pytest.fixture(scope="module")
def stock_ct(fake_pve):
    """An unprivileged stock container (Debian 12, systemd) with Proxmox's default 512 MiB memory limit."""
    from fakehost import STOCK

    ct = fake_pve.create_container(225, gpus=1, image=STOCK, memory_mib=512)
    yield ct
    fake_pve.remove_container(225)


@pytest.fixture
def stock(stock_ct):
    """stock_ct, running at the start of the test."""
    if not stock_ct.running:
        stock_ct.start()
    return stock_ct


@pytest.fixture(params=["shared-root", "stock"])
def either(request, ct, stock_ct):
    """Each of the two kinds of container: the privileged one over the host's files and the unprivileged
    stock one. Running at the start of the test."""
    which = ct if request.param == "shared-root" else stock_ct
    if not which.running:
        which.start()
    return which


@pytest.fixture
def host(pve_ssh, ct):
    """Run argv on the fake host over SSH; the container is running at the start of each test."""
    if not ct.running:
        ct.start()

    def run(*argv, **kw):
        return pve_ssh.run(list(argv), **kw)

    return run


# ------------------------------------------------------------------------------------------------ pct


def test_pct_list_format(host, ct, fake_pve):
    fake_pve.create_container(221, gpus=0, running=False)
    try:
        lines = host("pct", "list").text().splitlines()
        assert lines[0] == "%-10s %-10s %-12s %-20s" % ("VMID", "Status", "Lock", "Name")
        rows = {line.split()[0]: line for line in lines[1:]}
        assert rows["220"] == "%-10s %-10s %-12s %-20s" % ("220", "running", "", "ct220")
        assert rows["221"].split() == ["221", "stopped", "ct221"]  # empty Lock: 3 fields
        assert [int(r) for r in rows] == sorted(int(r) for r in rows)
    finally:
        fake_pve.remove_container(221)


def test_pct_list_on_an_empty_node_prints_nothing(tmp_path, capsys, monkeypatch):
    # main() resets PATH like real pct does; in-process that would leak into every later test.
    monkeypatch.setenv("PATH", os.environ["PATH"])
    (tmp_path / "node").write_text("empty\n")
    (tmp_path / "etc/pve/nodes/empty/lxc").mkdir(parents=True)
    assert pct_impl.main(["list"], base=tmp_path) == 0
    assert capsys.readouterr().out == ""


def test_status_start_stop_texts(host, either):
    i = str(either.ctid)
    assert host("pct", "status", i).stdout == b"status: running\n"
    res = host("pct", "start", i)
    assert (res.exit_code, res.stderr) == (255, f"CT {i} already running\n".encode())
    assert host("pct", "stop", i).exit_code == 0
    assert host("pct", "status", i).stdout == b"status: stopped\n"
    assert lxc_info_state(either) == "STOPPED"  # the status is lxc's own
    res = host("pct", "stop", i)
    assert (res.exit_code, res.stderr) == (255, f"CT {i} not running\n".encode())
    res = host("pct", "exec", i, "--", "true")
    assert (res.exit_code, res.stderr) == (255, f"container '{i}' not running!\n".encode())
    assert host("pct", "start", i).exit_code == 0
    assert either.running and lxc_info_state(either) == "RUNNING"


def lxc_info_state(ct) -> str:
    import subprocess

    return subprocess.run(["lxc-info", "-n", str(ct.ctid), "-P", str(ct.host.base / "lxc"), "-s", "-H"],
                          capture_output=True, text=True).stdout.strip()


def test_exec_passes_the_status_through(host, either):
    i = str(either.ctid)
    assert host("pct", "exec", i, "--", "sh", "-c", "exit 7").exit_code == 7
    assert host("pct", "exec", i, "--", "sh", "-c", "kill -9 $$").exit_code == 137  # 128 + SIGKILL
    assert host("pct", "exec", i, "--", "no-such-program").exit_code == 127


def test_missing_container_texts(host, fake_pve):
    for argv in (["status", "404"], ["exec", "404", "--", "true"], ["start", "404"], ["config", "404"]):
        res = host("pct", *argv)
        assert res.exit_code == 255
        assert res.stderr == f"Configuration file 'nodes/{fake_pve.node}/lxc/404.conf' does not exist\n".encode()


def test_exec_argument_handling(host):
    res = host("pct", "exec", "220")
    assert (res.exit_code, res.stderr) == (255, b"missing command\n")
    # Without `--`, Getopt takes `-la` as a pct option, as real pct does.
    res = host("pct", "exec", "220", "ls", "-la")
    assert res.exit_code == 255 and b"Unknown option: la" in res.stderr
    assert host("pct", "exec", "220", "echo", "plain").stdout == b"plain\n"


def test_exec_environment_and_path_reset(host, either):
    i = str(either.ctid)
    keep = dict(l.split("=", 1) for l in host("pct", "exec", i, "--keep-env", "1", "--", "env").text().splitlines())
    assert keep["PATH"] == "/sbin:/bin:/usr/sbin:/usr/bin"  # pct's reset, not the session's PATH
    assert "FAKE_PVE_BASE" in keep  # keep-env leaks the SSH session's variables
    assert host("pct", "exec", i, "--", "env").text() == host("pct", "exec", i, "--keep-env", "1", "--", "env").text()
    clear = dict(l.split("=", 1) for l in host("pct", "exec", i, "--keep-env", "0", "--", "env").text().splitlines())
    clear.pop("PWD", None)  # lxc-attach keeps the caller's directory when the container has it
    assert clear == {"container": "lxc", "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    res = host("pct", "exec", i, "--keep-env", "2", "--", "true")
    assert res.exit_code == 255 and b"keep-env" in res.stderr


def test_container_namespaces(host, ct):
    out = host("pct", "exec", "220", "--", "sh", "-c", "hostname; cat /proc/1/cmdline | tr '\\0' ' '").text()
    name, init = out.splitlines()
    assert name == "ct220"
    assert "ctinit" in init  # the container's own pid 1
    # Private /tmp: a file made inside is in <ct>/tmp on the host, not in the host's /tmp.
    assert host("pct", "exec", "220", "--", "touch", "/tmp/inside-220").exit_code == 0
    assert (ct.dir / "tmp" / "inside-220").exists()
    import os

    assert not os.path.exists("/tmp/inside-220")


def test_a_tmux_server_outlives_the_exec_and_dies_with_the_container(host, ct):
    start = host("pct", "exec", "220", "--", "tmux", "new-session", "-d", "-s", "job", "sleep 600")
    assert start.exit_code == 0, start.describe()
    assert host("pct", "exec", "220", "--", "tmux", "has-session", "-t", "job").exit_code == 0
    assert list((ct.dir / "tmp").glob("tmux-*/default"))  # its socket is in the container's own /tmp
    assert host("tmux", "has-session", "-t", "job").exit_code != 0  # the host's tmux does not see it
    ct.stop()
    ct.start()
    res = host("pct", "exec", "220", "--", "tmux", "has-session", "-t", "job")
    assert res.exit_code == 1


def test_delay_knob_and_call_log(host, fake_pve):
    fake_pve.clear_pct_calls()
    fake_pve.set_delay(1.0)
    try:
        t0 = time.monotonic()
        host("pct", "status", "220")
        slow = time.monotonic() - t0
    finally:
        fake_pve.set_delay(0)
    fast = []
    for _ in range(3):  # the quickest of three: a loaded machine can stall any one call
        t0 = time.monotonic()
        host("pct", "status", "220")
        fast.append(time.monotonic() - t0)
    assert slow >= 1.0 and min(fast) < slow - 0.5
    assert fake_pve.pct_calls() == [["pct", "status", "220"]] * 4
    host("pct", "exec", "220", "--keep-env", "0", "--", "true")
    assert fake_pve.pct_exec_calls(220) == [["pct", "exec", "220", "--keep-env", "0", "--", "true"]]
    fake_pve.clear_pct_calls()
    assert fake_pve.pct_calls() == []


def test_push_and_pull(host, either, fake_pve):
    i, ct = str(either.ctid), either
    src = fake_pve.base / "push-src"
    src.write_bytes(b"payload\x00\xff")
    assert host("pct", "push", i, str(src), "/tmp/pushed").exit_code == 0
    assert (ct.dir / "tmp" / "pushed").read_bytes() == b"payload\x00\xff"
    # Written by the container's root: 100000 outside an unprivileged container, 0 outside a privileged one.
    assert (ct.dir / "tmp" / "pushed").stat().st_uid == (100000 if ct.unprivileged else 0)
    dest = fake_pve.base / "pull-dest"
    assert host("pct", "pull", i, "/tmp/pushed", str(dest)).exit_code == 0
    assert dest.read_bytes() == b"payload\x00\xff"
    ct.stop()
    res = host("pct", "push", i, str(src), "/tmp/x")
    assert res.stderr == b"can only push files to a running CT\n"


def test_config_lists_gpu_devices_sorted(host):
    lines = host("pct", "config", "220").text().splitlines()
    keys = [l.split(":")[0] for l in lines]
    assert keys == sorted(keys)
    assert "dev0: /dev/nvidia0" in lines and "dev3: /dev/nvidiactl" in lines


# ----------------------------------------------------------------------------------------- nvidia-smi


QUERY = ["nvidia-smi", "--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"]


def test_nvidia_smi_reports_the_memory_a_test_sets(host, ct):
    ct.set_gpu_used(1, 4321)
    lines = host("pct", "exec", "220", "--keep-env", "0", "--", *QUERY).text().splitlines()
    assert len(lines) == 3
    idx, uuid, used, total = lines[1].split(", ")
    assert (idx, used, total) == ("1", "4321", "81559") and uuid.startswith("GPU-")
    assert lines[0].split(", ")[2] == "0"
    ct.set_gpu_used(1, 0)
    with pytest.raises(IndexError):
        ct.set_gpu_used(7, 1)


def test_nvidia_smi_is_on_the_clear_env_path_only(host):
    # pct's default --keep-env 1 resets PATH to /sbin:/bin:/usr/sbin:/usr/bin: no /usr/local/sbin, as on PVE.
    assert host("pct", "exec", "220", "--", "nvidia-smi", "-L").exit_code == 127
    assert host("pct", "exec", "220", "--keep-env", "0", "--", "nvidia-smi", "-L").exit_code == 0


def test_nvidia_smi_other_forms(host, ct):
    out = host("pct", "exec", "220", "--keep-env", "0", "--", "nvidia-smi", "--query-gpu=index,pci.bus_id,name,driver_version",
               "--format=csv").text().splitlines()
    assert out[0] == "index, pci.bus_id, name, driver_version"
    assert out[1].startswith("0, 00000000:") and "NVIDIA" in out[1]
    units = host("pct", "exec", "220", "--keep-env", "0", "--", "nvidia-smi", "--query-gpu=memory.used", "--format=csv").text()
    assert units.splitlines() == ["memory.used [MiB]", "0 MiB", "0 MiB", "0 MiB"]
    listing = host("pct", "exec", "220", "--keep-env", "0", "--", "nvidia-smi", "-L").text().splitlines()
    assert listing[2].startswith("GPU 2: NVIDIA") and "(UUID: GPU-" in listing[2]
    bad = host("pct", "exec", "220", "--keep-env", "0", "--", "nvidia-smi", "--bogus")
    assert bad.exit_code != 0 and b"Invalid combination of input arguments" in bad.stdout
    field = host("pct", "exec", "220", "--keep-env", "0", "--", "nvidia-smi", "--query-gpu=nope", "--format=csv")
    assert field.exit_code != 0 and b'Field "nope" is not a valid field to query.' in field.stdout
    ct.set_nvidia_error("Failed to initialize NVML: Driver/library version mismatch")
    try:
        broken = host("pct", "exec", "220", "--keep-env", "0", "--", *QUERY)
        assert broken.exit_code == 9 and b"Driver/library version mismatch" in broken.stdout
    finally:
        ct.set_nvidia_error(None)


def test_gpu_less_container_has_no_nvidia_smi(host, fake_pve):
    fake_pve.create_container(222, gpus=0)
    try:
        res = host("pct", "exec", "222", "--keep-env", "0", "--", "nvidia-smi", "-L")
        assert res.exit_code == 127
        assert "dev0" not in host("pct", "config", "222").text()
    finally:
        fake_pve.remove_container(222)


def test_fixture_exec_runs_inside(ct):
    res = ct.exec(["hostname"])
    assert res.stdout == b"ct220\n"
    ct.stop()
    with pytest.raises(RuntimeError, match="not running"):
        ct.exec(["true"])


def test_nvidia_smi_reports_driver_and_cuda_and_fails_on_a_kernel_module_mismatch(host, ct):
    smi = ["pct", "exec", "220", "--keep-env", "0", "--", "nvidia-smi"]
    ct.set_driver("550.54.15", "12.4")
    ct.set_kernel_module("550.54.15")
    try:
        table = host(*smi).text()
        assert "Driver Version: 550.54.15" in table and "CUDA Version: 12.4" in table
        assert host(*smi, "--query-gpu=driver_version", "--format=csv,noheader").text().splitlines()[0] == "550.54.15"
        # The container sees the host's kernel module in its own /proc.
        proc = host("pct", "exec", "220", "--keep-env", "0", "--", "cat", "/proc/driver/nvidia/version").text()
        assert "Kernel Module  550.54.15" in proc
        # The host's module moves on (a host upgrade), the container's libraries stay: NVML refuses.
        ct.set_kernel_module("570.133.20")
        for argv in (smi, [*smi, *QUERY[1:]]):
            res = host(*argv)
            assert res.exit_code == 18
            assert res.stdout == (b"Failed to initialize NVML: Driver/library version mismatch\n"
                                  b"NVML library version: 550.54\n")
    finally:
        ct.set_driver("570.133.20", "12.8")
        ct.set_kernel_module("570.133.20")
    assert host(*smi).exit_code == 0


# ------------------------------------------------------------------------------- stock containers


def test_a_stock_container_is_debian_12_as_the_template_ships_and_sees_nothing_of_the_host(host, fake_pve):
    from fakehost import STOCK, STOCK_TMUX

    ct = fake_pve.create_container(223, gpus=2, image=STOCK)
    try:
        def inside(*argv):
            return host("pct", "exec", "223", "--keep-env", "0", "--", *argv)

        assert 'VERSION_CODENAME=bookworm' in inside("cat", "/etc/os-release").text()
        assert inside("hostname").text() == "ct223\n"
        # As Proxmox writes them at every start: localhost and the container's own name resolve (torch's
        # rendezvous looks up `localhost`; a debootstrap image alone has no /etc/hosts).
        assert inside("cat", "/etc/hostname").text() == "ct223\n"
        resolve = "import socket; print(socket.gethostbyname('localhost'), socket.gethostbyname('ct223'))"
        assert inside("python3", "-c", resolve).text() == "127.0.0.1 127.0.1.1\n"
        # Debian's python3 under PEP 668, without pip, uv or tmux.
        assert inside("python3", "-c", "import sys; print(sys.executable)").text() == "/usr/bin/python3\n"
        assert inside("test", "-f", "/usr/lib/python3.11/EXTERNALLY-MANAGED").exit_code == 0
        assert b"No module named pip" in inside("python3", "-m", "pip", "install", "--user", "uv").stderr
        assert inside("sh", "-c", "command -v uv || command -v tmux || command -v pip3").exit_code == 127
        # Nothing of the host (the workstation here) by path: not its wheels, not this checkout, not its uv.
        here = str(Path(__file__).resolve())
        for path in ("/opt/wheels", here, os.path.realpath(shutil.which("uv")), str(fake_pve.base)):
            assert inside("test", "-e", path).exit_code == 1, path
        # The stand-in nvidia-smi and the workdir (one mount point of the host's storage, same path) are there.
        assert inside("nvidia-smi", "-L").text().startswith("GPU 0: ")
        Path(ct.workdir, "probe").write_text("from the host")
        assert inside("cat", f"{ct.workdir}/probe").text() == "from the host"
        assert f"mp0: {fake_pve.storage()},mp={fake_pve.storage()}" in host("pct", "config", "223").text()
        # Writes go to the container's own layer: the cached image stays as built.
        assert inside("sh", "-c", "echo x > /usr/local/bin/mine").exit_code == 0
        assert ct.host_path("/usr/local/bin/mine").read_text() == "x\n"
        assert not any(Path(d, "usr/local/bin/mine").exists() for d in json.loads((ct.dir / "rootfs.json").read_text())["lower"])

        with_tmux = fake_pve.create_container(224, gpus=0, image=STOCK_TMUX)
        assert with_tmux.exec(["tmux", "-V"]).stdout.startswith(b"tmux 3.3")
        assert with_tmux.exec(["sh", "-c", "command -v uv"]).returncode == 127
    finally:
        fake_pve.remove_container(223)
        fake_pve.remove_container(224)


def test_the_image_is_built_once_atomically_and_reused(tmp_path, monkeypatch):
    from fakehost import rootfs

    built: list[Path] = []

    def fake_build(tmp: Path, log) -> None:  # stands in for debootstrap (minutes): the caching is under test
        built.append(tmp)
        (tmp / "root" / "usr/bin").mkdir(parents=True)
        (tmp / "tmux").mkdir()
        if len(built) == 1:
            raise RuntimeError("mirror unreachable")

    monkeypatch.setattr(rootfs, "_build", fake_build)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    key = rootfs.recipe_key()
    stale = tmp_path / "rootfs" / f".build-debian-12-{key}-1"
    (stale / "root").mkdir(parents=True)  # an interrupted build (no built.json): never reused
    with pytest.raises(RuntimeError, match="mirror unreachable"):
        rootfs.ensure_image(tmp_path)
    assert sorted(p.name for p in (tmp_path / "rootfs").iterdir()) == [".lock"]  # nothing half-built left
    image = rootfs.ensure_image(tmp_path)
    assert image.path == tmp_path / "rootfs" / f"debian-12-{key}" and image.built()["seconds"] >= 0
    assert rootfs.ensure_image(tmp_path).path == image.path and len(built) == 2  # reused, not rebuilt
    assert image.lowerdirs(tmux=True) == [str(image.tmux), str(image.root)]


# ------------------------------------------------------------------------------- LXC as Proxmox makes it


def test_a_stock_container_is_unprivileged_and_booted_by_systemd(host, stock):
    def inside(*argv):
        return host("pct", "exec", "225", "--keep-env", "0", "--", *argv)

    assert inside("cat", "/proc/1/comm").text() == "systemd\n"
    assert inside("id", "-u").text() == "0\n"
    assert inside("cat", "/proc/self/uid_map").text().split() == ["0", "100000", "65536"]
    # uid 0 inside is 100000 outside: the init's owner as the host sees it, and a file made inside.
    status = Path(f"/proc/{stock.pid}/status").read_text()
    assert [l.split()[1] for l in status.splitlines() if l.startswith("Uid:")] == ["100000"]
    assert inside("touch", "/tmp/made-inside").exit_code == 0
    made = (stock.dir / "tmp" / "made-inside").stat()
    assert (made.st_uid, made.st_gid) == (100000, 100000)
    # The host's root is nobody inside: its files cannot be written (as on a real node).
    Path(stock.workdir, "hosts-file").write_text("host")
    res = inside("sh", "-c", f"echo x > {stock.workdir}/hosts-file")
    assert res.exit_code != 0 and b"Permission denied" in res.stderr
    stock.to_container(Path(stock.workdir, "hosts-file"))
    assert inside("sh", "-c", f"echo x > {stock.workdir}/hosts-file").exit_code == 0
    assert "unprivileged: 1" in host("pct", "config", "225").text().splitlines()


def test_the_memory_limit_is_the_containers_cgroup_limit(host, stock):
    assert "memory: 512" in host("pct", "config", "225").text().splitlines()
    # One of the two controllers' files, whichever the host runs (cgroup v1 here, v2 on Proxmox VE 7+).
    read = "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
    assert host("pct", "exec", "225", "--", "sh", "-c", read).text() == f"{512 * 1024 * 1024}\n"


def test_a_volume_of_its_own_size_fills_inside_while_the_root_does_not(host, fake_pve):
    """A mount point with `size=` (a small disk under the workdir): the container's root writes it until ENOSPC
    at its size, the host sees the same bytes, `pct config` lists it, and removing the container unmounts it."""
    from fakehost import STOCK

    ct = fake_pve.create_container(227, gpus=0, image=STOCK, volumes={"runs": 1})
    runs = Path(ct.workdir) / "runs"
    try:
        assert f"mp1: local-lvm:vm-227-disk-1,mp={runs},size=1M" in host("pct", "config", "227").text().splitlines()
        fill = host("pct", "exec", "227", "--", "sh", "-c",
                    f"dd if=/dev/zero of={runs}/fill bs=64k count=64 2>&1; stat -c %u {runs}/fill")
        assert fill.exit_code == 0 and b"No space left on device" in fill.stdout, fill.stdout
        assert fill.stdout.splitlines()[-1] == b"0"  # the container's root owns what it wrote
        assert (runs / "fill").stat().st_size == 1 << 20  # the whole MiB, and not a byte more
        assert (runs / "fill").stat().st_uid == 100000
        root = host("pct", "exec", "227", "--", "sh", "-c", "head -c 2097152 /dev/zero > /root/big && echo ok")
        assert root.text() == "ok\n"  # the root file system is not that volume
    finally:
        fake_pve.remove_container(227)
    with open("/proc/self/mountinfo") as fh:
        assert not [line for line in fh if f"{fake_pve.base.name}-227" in line]


def test_no_network_by_default_and_the_hosts_network_when_asked(host, stock, fake_pve):
    from fakehost import STOCK

    probe = ("import socket; s = socket.socket(); s.settimeout(5)\n"
             f"try: s.connect(('127.0.0.1', {fake_pve.port})); print('reached')\n"
             "except OSError as e: print(type(e).__name__)")
    devs = host("pct", "exec", "225", "--", "cat", "/proc/net/dev").text().splitlines()[2:]
    assert [d.split(":")[0].strip() for d in devs] == ["lo"]
    assert host("pct", "exec", "225", "--", "python3", "-c", probe).text() == "ConnectionRefusedError\n"
    assert "net0" not in host("pct", "config", "225").text()
    net = fake_pve.create_container(226, gpus=0, image=STOCK, network=True)
    try:
        assert net.exec(["python3", "-c", probe]).stdout == b"reached\n"  # the fake host's sshd
        assert "net0: " in host("pct", "config", "226").text()
    finally:
        fake_pve.remove_container(226)


def test_stop_kills_everything_in_the_container(host, either):
    i = str(either.ctid)
    start = host("pct", "exec", i, "--", "sh", "-c", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo started")
    assert start.text() == "started\n"
    ns = os.readlink(f"/proc/{either.pid}/ns/pid")

    def sleepers():
        found = []
        for d in Path("/proc").iterdir():
            try:
                if (d.name.isdigit() and (d / "cmdline").read_bytes() == b"sleep\x00600\x00"
                        and os.readlink(d / "ns" / "pid") == ns):
                    found.append(int(d.name))
            except OSError:
                continue
        return found

    deadline = time.monotonic() + 5
    while not sleepers() and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = sleepers()
    assert pids, "the detached sleep never showed up"
    assert host("pct", "stop", i).exit_code == 0
    assert host("pct", "status", i).text() == "status: stopped\n"
    assert not any(Path(f"/proc/{p}").exists() for p in pids)
