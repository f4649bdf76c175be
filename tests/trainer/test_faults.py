"""Causes a failed rank cannot report itself, named by its launcher (trainer.faults, trainer.launch): an OOM kill
by a real memory cgroup's limit, a full file system under the run directory; and the memory cgroup read as the
kernel writes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.test_trainer_launch import REPO, SPLIT, env, small_config, write  # noqa: F401
from orchestrator.agent import runprocs
from orchestrator.sigmatch import Matcher
from orchestrator.signatures import load_catalogue
from trainer import faults

pytestmark = pytest.mark.slow  # runs real processes: `-m "not slow"` leaves it out

MEMCG = Path("/sys/fs/cgroup/memory")
LIMIT = 3 << 30


def _named(text: str) -> list[str]:
    m = Matcher(load_catalogue())
    return [e.signature for line in text.splitlines() for e in m.feed_line(line)]


def _start_in(cg: Path | None, cfg: Path, env: dict, run_dir: Path) -> subprocess.Popen:
    def enter():
        if cg is not None:
            (cg / "cgroup.procs").write_text(str(os.getpid()))
    return subprocess.Popen([sys.executable, "-m", "trainer.launch", "--config", str(cfg)],
                            env={**env, "DFLASHCTL_RUN_DIR": str(run_dir)}, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=enter)


def _read_until(proc: subprocess.Popen, prefix: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError("".join(lines)[-3000:])


@pytest.mark.skipif(not (MEMCG / "memory.limit_in_bytes").exists() or os.geteuid() != 0,
                    reason="needs root and cgroup v1's memory controller")
def test_a_rank_killed_by_the_cgroups_oom_killer_is_named_with_the_limit(tmp_path, env):
    """A real run in a memory cgroup of 3 GiB; a second process of the cgroup takes what is left, and the kernel's
    OOM killer kills a rank (oom_score_adj makes it the victim). The launcher names the OOM kill, the limit, the
    counter and the fix; root_cause.json carries it; the catalogue names it."""
    cg = MEMCG / f"dflash-test-{os.getpid()}"
    cg.mkdir()
    hog = None
    run_dir = tmp_path / "run"
    try:
        (cg / "memory.limit_in_bytes").write_text(str(LIMIT))
        cfg = write(tmp_path / "c.json", small_config(run_dir, SPLIT, max_steps=400, epochs=100))
        proc = _start_in(cg, cfg, env, run_dir)
        lines = _read_until(proc, "[rank 1] step 2/")
        ranks = [p for p in runprocs.run_processes(run_dir) if "trainer.rank" in p.argv]
        victim = ranks[-1].pid
        Path(f"/proc/{victim}/oom_score_adj").write_text("1000")
        # The run's resident memory, not usage_in_bytes: that counts page cache the kernel reclaims before it
        # kills anything, so a hog sized by it could fit and the run would finish unharmed.
        stat = dict(line.split() for line in (cg / "memory.stat").read_text().splitlines())
        used = int(stat["total_rss"]) + int(stat.get("total_mapped_file", 0))
        take = LIMIT - used + (64 << 20)
        hog = subprocess.Popen([sys.executable, "-c", (
            "import os, time\nopen('/proc/self/oom_score_adj', 'w').write('-1000')\n"
            f"open('{cg}/cgroup.procs', 'w').write(str(os.getpid()))\n"
            f"x = bytearray(b'\\x01') * {take}\nprint('taken', flush=True)\ntime.sleep(120)\n")],
            stdout=subprocess.PIPE, text=True)
        rest = proc.stdout.read()
        code = proc.wait(timeout=120)
        out = "".join(lines) + rest
        assert code == 1, out[-3000:]
        assert f"pid {victim}) was killed by SIGKILL" in out, out[-3000:]
        # The kernel's own count, read after the run: usually 1, but the OOM killer may take a second process of
        # the run before the first one's memory is given back, and the launcher must report what happened.
        kills = int(dict(ln.split() for ln in (cg / "memory.oom_control").read_text().splitlines())["oom_kill"])
        assert kills >= 1
        oom_lines = [ln for ln in out.splitlines() if "killed by the container's OOM killer" in ln]
        assert oom_lines and oom_lines[0].startswith(
            f"[launch] killed by the container's OOM killer: {kills} process(es) of this run at its memory limit "
            f"3072 MiB (memory.oom_control oom_kill 0 -> {kills}); raise the limit on the Proxmox host: pct set "
        ), out[-3000:]
        assert "--memory 6144" in oom_lines[0]
        doc = json.loads((run_dir / "root_cause.json").read_text())
        assert doc["oom"]["kills"] == kills and doc["oom"]["limit_mib"] == 3072 and doc["oom"]["cgroup"] == str(cg)
        assert "container-oom-kill" in _named(out)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        for p in runprocs.run_processes(run_dir):
            os.kill(p.pid, signal.SIGKILL)
        for _ in range(100):
            if not (cg / "cgroup.procs").read_text().strip():
                break
            time.sleep(0.1)
        cg.rmdir()


def test_the_memory_cgroup_is_read_as_the_kernel_writes_it(tmp_path):
    """cgroup v2 (memory.events, memory.max) and v1 (memory.oom_control, memory.limit_in_bytes, ~2^63 for none)."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    (v2 / "memory.max").write_text("536870912\n")
    got = faults.memory_cgroup_at(v2, 2)
    assert (got.limit_bytes, got.oom_kills, got.counter_file) == (512 << 20, 2, "memory.events")
    (v2 / "memory.max").write_text("max\n")
    assert faults.memory_cgroup_at(v2, 2).limit_bytes is None
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    got = faults.memory_cgroup_at(v1, 1)
    assert (got.limit_bytes, got.oom_kills) == (None, 4)
    before = faults.MemoryCgroup(1, v1, None, 3)
    assert faults.oom_since(before)["counter"] == "memory.oom_control oom_kill 3 -> 4"
    assert faults.oom_since(faults.MemoryCgroup(1, v1, None, 4)) is None


def _can_mount_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True).returncode:
        return False
    subprocess.run(["umount", str(path)], check=True)
    return True


def test_a_disk_the_run_fills_at_its_end_is_named_and_the_cause_survives(tmp_path, env):
    """The run directory on a 2 MiB tmpfs: the final checkpoint (the third of ~620 KiB) fills it. The launcher
    names the full file system, root_cause.json still fits (the space reserved at launch is given back first),
    and no temporary `*.tmp-PID` file of a dead writer is left."""
    mnt = tmp_path / "small"
    if os.geteuid() != 0 or not _can_mount_tmpfs(mnt):
        pytest.skip("needs root to mount a tmpfs")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        run_dir = mnt / "run"
        cfg = write(tmp_path / "c.json", small_config(run_dir, SPLIT, save_every=2))
        (run_dir / "ranks").mkdir(parents=True)
        (run_dir / "ranks" / f"left.tmp-{_dead_pid()}").write_text("half a write")  # a writer that died
        proc = _start_in(None, cfg, env, run_dir)
        out = proc.communicate(timeout=600)[0]
        assert proc.returncode != 0, out[-3000:]
        full = [ln for ln in out.splitlines() if ln.startswith("[launch] No space left on device: ")]
        assert full and full[0].startswith(f"[launch] No space left on device: the file system of {run_dir} is full ("), \
            out[-4000:]
        assert f"`df -h {run_dir}`" in full[0]
        doc = json.loads((run_dir / "root_cause.json").read_text())
        assert doc["disk_full"]["path"] == str(run_dir) and doc["disk_full"]["free_bytes"] < faults.FULL_BYTES
        assert "disk-full" in _named(out)
        assert list(run_dir.rglob("*.tmp-*")) == [] or all(
            not p.name.split(".tmp-")[-1].isdigit() for p in run_dir.rglob("*.tmp-*"))
        assert not (run_dir / faults.RESERVE_NAME).exists()
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.parametrize(("mountinfo", "cgroup", "hostname", "in_lxc", "want"), [
    # local-lvm (LVM-thin, Proxmox's default storage): device-mapper doubles the dashes of vm-200-disk-0.
    ("215 106 253:7 / / rw,relatime shared:134 - ext4 /dev/mapper/pve-vm--200--disk--0 rw", "0::/", "box", True,
     "200"),
    ("30 1 0:26 / / rw shared:1 - zfs rpool/data/subvol-201-disk-0 rw,xattr", "0::/", "box", True, "201"),
    ("30 1 7:0 / / rw - ext4 /dev/loop0 rw", "4:memory:/lxc/202/ns\n0::/lxc/202/ns", "box", True, "202"),
    ("30 1 7:0 / / rw - ext4 /dev/loop0 rw", "0::/lxc.payload.203/init.scope", "box", True, "203"),
    ("30 1 7:0 / / rw - ext4 /dev/rbd0 rw", "0::/", "CT204", True, "204"),  # pve-container's default hostname
    ("30 1 7:0 / / rw - ext4 /dev/rbd0 rw", "0::/", "CT204", False, None),  # not in a container: not a CTID
    ("30 1 7:0 / / rw - ext4 /dev/rbd0 rw", "0::/", "gpu-box-1", True, None),
])
def test_the_ctid_is_read_from_what_the_container_shows(mountinfo, cgroup, hostname, in_lxc, want):
    assert faults.container_id_from(None, mountinfo, cgroup, hostname, in_lxc) == want
    assert faults.container_id_from("77", mountinfo, cgroup, hostname, in_lxc) == "77"  # DFLASHCTL_CTID first


def test_the_oom_fix_names_the_ctid_inside_a_real_lxc_container(fake_pve):
    """In an unprivileged LXC container whose root is no Proxmox volume and whose environment has no
    DFLASHCTL_CTID, the OOM fix still names its CTID: PID 1 says `container=lxc`, the hostname is Proxmox's
    default `CT<CTID>`."""
    from fakehost import STOCK

    ct = fake_pve.create_container(353, gpus=0, image=STOCK, hostname="CT353")
    here = fake_pve.storage() / f"faults-{os.getpid()}"
    try:
        here.mkdir(exist_ok=True)
        (here / "faults.py").write_text((REPO / "trainer" / "faults.py").read_text())
        res = ct.exec(["env", "-u", "DFLASHCTL_CTID", "python3", "-c",
                       f"import sys; sys.path.insert(0, {str(here)!r}); import faults; "
                       "print(faults.raise_memory_fix(512 << 20))"])
        assert res.returncode == 0, res.stderr.decode()
        assert res.stdout.decode().strip() == "on the Proxmox host: pct set 353 --memory 1024"
    finally:
        fake_pve.remove_container(353)
        import shutil

        shutil.rmtree(here, ignore_errors=True)


def test_an_oom_kill_by_a_real_lxc_containers_memory_limit_is_counted_and_named_inside_it(fake_pve):
    """Inside an unprivileged LXC container with Proxmox's `memory: 256` (no swap), the launcher's view of its
    memory cgroup (trainer.faults, read from the container's cgroup namespace, v1 or v2 as the host runs) has
    the container's limit; a child that allocates past it is SIGKILLed by the container's OOM killer, and the
    counter read before and after names that kill with the limit and the `pct set` that raises it."""
    from fakehost import STOCK

    ct = fake_pve.create_container(354, gpus=0, image=STOCK, hostname="CT354", memory_mib=256)
    here = fake_pve.storage() / f"faults-oom-{os.getpid()}"
    probe = (
        "import json, subprocess, sys\n"
        f"sys.path.insert(0, {str(here)!r})\n"
        "import faults\n"
        "before = faults.memory_cgroup()\n"
        "hog = subprocess.run([sys.executable, '-c', 'x = bytearray(512 << 20); x[::4096] = b\"\\\\x01\" * (len(x) // 4096)'])\n"
        "oom = faults.oom_since(before)\n"
        "print(json.dumps({'limit': before.limit_bytes, 'version': before.version, 'hog': hog.returncode,\n"
        "                  'oom': oom, 'fix': faults.raise_memory_fix(before.limit_bytes)}))\n")
    try:
        here.mkdir(exist_ok=True)
        (here / "faults.py").write_text((REPO / "trainer" / "faults.py").read_text())
        res = ct.exec(["env", "-u", "DFLASHCTL_CTID", "python3", "-c", probe])
        assert res.returncode == 0, res.stderr.decode()
        got = json.loads(res.stdout.decode().strip().splitlines()[-1])
        assert got["limit"] == 256 << 20, got
        assert got["hog"] == -signal.SIGKILL, got  # the kernel's OOM killer, not a MemoryError
        assert got["oom"] is not None and got["oom"]["kills"] >= 1 and got["oom"]["limit_mib"] == 256, got
        assert got["oom"]["counter"].startswith(("memory.oom_control oom_kill ", "memory.events oom_kill ")), got
        assert got["fix"] == "on the Proxmox host: pct set 354 --memory 512", got
    finally:
        fake_pve.remove_container(354)
        import shutil

        shutil.rmtree(here, ignore_errors=True)
