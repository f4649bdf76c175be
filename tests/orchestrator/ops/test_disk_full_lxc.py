"""A run that fills its disk at its end, end to end in a real unprivileged LXC container: the installed
`dflashctl` launches the tiny experiment into a container whose run directories live on a mount point of their
own of 2 MiB (Proxmox's `mpN: ...,size=`), the root file system having room to spare. The first checkpoint fits,
the last does not. The follow's outcome names the full file system (the agent's word, which needs no byte of
the full disk), train.log keeps the launcher's last line with the `df -h` that shows it, `dflashctl diagnose`
names `disk-full`, and the run directory holds no half-written file nor the space the launcher reserved."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from cpu_venv import link_shared_cpu_venv, tiny_inventory

CTID = 356
VOLUME_MIB = 2


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_disk_the_run_fills_at_its_end_in_a_container_is_named_by_the_follow_and_diagnose(
        fake_pve, stock_cpu_venv, tmp_path, dflashctl):
    from fakehost import STOCK_TMUX

    shared, _lock = stock_cpu_venv
    ct = fake_pve.create_container(CTID, gpus=0, image=STOCK_TMUX, hostname=f"CT{CTID}",
                                   volumes={"runs": VOLUME_MIB})
    try:
        link_shared_cpu_venv(ct, shared)
        # ~1 MiB a checkpoint: step 20's fits beside the launcher's reserve, step 40's (the last) does not.
        inv = tiny_inventory(tmp_path / "inv.yaml", fake_pve, ct, max_steps=40, save_every=20, log_every=10)
        env = {**os.environ, "DFLASHCTL_STATE_DIR": str(tmp_path / "state"), "DFLASHCTL_INVENTORY": str(inv)}
        la = dflashctl("launch", "tiny", env=env, timeout=600)
        assert la.returncode == 0, la.stdout + la.stderr
        run_id = re.search(r"\b(tiny-\d{8}T\d{6}Z)\b", la.stdout).group(1)
        run_dir = Path(ct.workdir) / "runs" / run_id

        fo = dflashctl("logs", run_id, "--follow", env=env, timeout=900)
        out = fo.stdout + fo.stderr
        assert fo.returncode != 0, out[-3000:]
        [outcome] = [ln for ln in fo.stderr.splitlines() if ln.startswith(f"run {run_id}: ")]
        assert outcome.startswith(f"run {run_id}: failed"), outcome
        assert f"its file system is full ({run_dir}: " in outcome and f"free of {VOLUME_MIB}.0 MiB" in outcome, outcome

        text = (run_dir / "train.log").read_text(errors="replace")
        assert "[ckpt] step 20 -> " in text, text[-3000:]  # the first checkpoint fitted: the disk filled later
        [last] = [ln for ln in text.splitlines() if ln.startswith("[launch] No space left on device: ")]
        assert last.startswith(f"[launch] No space left on device: the file system of {run_dir} is full ("), last
        fix = re.search(r"`(df -h [^`]+)`", last).group(1)
        df = ct.exec(["sh", "-c", fix])  # the printed check, pasted as printed inside the container
        # It shows the volume (the launcher removed the torn checkpoint since, so it is no longer at 100 %).
        assert df.returncode == 0 and df.stdout.split(b"\n")[1].split()[:2] == [b"tmpfs", b"2.0M"], df.stdout + df.stderr

        doc = json.loads((run_dir / "root_cause.json").read_text())
        assert doc["disk_full"]["path"] == str(run_dir), doc
        diag = dflashctl("diagnose", "--json", str(run_dir / "train.log"), env=env)
        assert json.loads(diag.stdout)["worst"] == "disk-full", diag.stdout[-2000:]
        # Nothing half-written by a process that is gone, and the launcher's reserve given back.
        assert not (run_dir / ".reserved-space").exists()
        torn = [p for p in run_dir.rglob("*") if ".tmp-" in p.name]  # the atomic writers' temporary names
        assert torn == [], torn
        steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert steps == ["step_00000020"], steps  # the complete checkpoint kept, no partial step_00000040
    finally:
        fake_pve.remove_container(CTID)
