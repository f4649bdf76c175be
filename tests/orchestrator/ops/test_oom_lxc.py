"""A run killed by its LXC container's memory limit, end to end: the installed `dflashctl` launches the tiny
experiment into an unprivileged LXC container with Proxmox's `memory:` and no swap, a process of the container
then takes the memory the run has left, and the kernel's OOM killer (the container's memory cgroup, not the
host's) kills a rank. The follow names the OOM kill with the container's limit and the `pct set` that raises
it, and `dflashctl diagnose` of the run's log names the same signature."""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path

import pytest
from cpu_venv import link_shared_cpu_venv, tiny_inventory

CTID = 355
LIMIT_MIB = 2048

# Run inside the container: make the newest rank (`python -m trainer.rank`, by its argv, not this script's text)
# the OOM killer's victim, then take what the container has left
# (its limit less the resident memory of everything in it) and 64 MiB more, touching every page.
HOG = r"""
import glob, os, sys, time
def argv(path):
    try:
        return open(path, 'rb').read().split(b'\0')
    except OSError:
        return []
ranks = sorted(int(p.split('/')[2]) for p in glob.glob('/proc/[0-9]*/cmdline') if b'trainer.rank' in argv(p)[1:4])
assert ranks, 'no rank to make the victim'
open(f'/proc/{ranks[-1]}/oom_score_adj', 'w').write('1000')
def read(*names):
    for n in names:
        try:
            return open('/sys/fs/cgroup/' + n).read()
        except OSError:
            pass
limit = int(read('memory.max', 'memory/memory.limit_in_bytes').strip())
stat = dict(line.split() for line in read('memory.stat', 'memory/memory.stat').splitlines())
used = int(stat.get('total_rss', stat.get('anon', 0))) + int(stat.get('total_mapped_file', stat.get('file_mapped', 0)))
x = bytearray(max(limit - used + (64 << 20), 64 << 20))
for i in range(0, len(x), 4096):
    x[i] = 1
print('taken', len(x) >> 20, 'MiB', flush=True)
time.sleep(300)
"""


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_an_oom_kill_by_the_containers_memory_limit_is_named_with_the_limit_and_the_pct_fix(
        fake_pve, stock_cpu_venv, tmp_path, dflashctl):
    from fakehost import STOCK_TMUX

    shared, _lock = stock_cpu_venv
    ct = fake_pve.create_container(CTID, gpus=0, image=STOCK_TMUX, hostname=f"CT{CTID}", memory_mib=LIMIT_MIB)
    try:
        link_shared_cpu_venv(ct, shared)
        inv = tiny_inventory(tmp_path / "inv.yaml", fake_pve, ct, max_steps=100000, save_every=100000, log_every=5)
        env = {**os.environ, "DFLASHCTL_STATE_DIR": str(tmp_path / "state"), "DFLASHCTL_INVENTORY": str(inv)}
        la = dflashctl("launch", "tiny", env=env, timeout=600)
        assert la.returncode == 0, la.stdout + la.stderr
        run_id = re.search(r"\b(tiny-\d{8}T\d{6}Z)\b", la.stdout).group(1)
        log = Path(ct.workdir) / "runs" / run_id / "train.log"
        deadline = time.monotonic() + 900
        while not (log.exists() and re.search(r"step \d+/", log.read_text(errors="replace"))):
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:] if log.exists() else "no log"
            time.sleep(1)
        hog = ct.exec(["sh", "-c", f"nohup python3 -c {shlex.quote(HOG)} >/tmp/hog.log 2>&1 &"])
        assert hog.returncode == 0, hog.stderr.decode()
        fo = dflashctl("logs", run_id, "--follow", env=env, timeout=900)
        out = fo.stdout + fo.stderr
        assert fo.returncode != 0, out[-3000:]
        text = log.read_text(errors="replace")
        oom = [ln for ln in text.splitlines() if "killed by the container's OOM killer" in ln]
        assert oom and f"at its memory limit {LIMIT_MIB} MiB" in oom[0], text[-3000:]
        assert f"pct set {CTID} --memory {2 * LIMIT_MIB}" in oom[0], oom[0]
        assert f"Killed by the container's OOM killer (memory limit {LIMIT_MIB} MiB)" in out, out[-3000:]
        assert f"pct set {CTID} --memory {2 * LIMIT_MIB}" in out, out[-3000:]
        diag = dflashctl("diagnose", "--json", str(log), env=env)
        assert json.loads(diag.stdout)["worst"] == "container-oom-kill", diag.stdout[-2000:]
    finally:
        ct.exec(["sh", "-c", "pkill -9 -f 'import glob, os, sys, time' || true"])
        fake_pve.remove_container(CTID)
