"""A new user's first hour on a stock container, with zero hand steps: `doctor` -> `rebuild-venv` -> `launch`
-> `logs --follow`, through the installed `dflashctl` console script, against a fresh stock Debian 12
container of the fake Proxmox host (python3 under PEP 668, no pip, no uv, no tmux, nothing of this
workstation). The real trainer runs the `tiny` dflash experiment (fewer steps) and exports; the export must
load through AutoModel(trust_remote_code=True). A `command` experiment runs the same way on the container's
own python3 (`kind: system`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TORCH_WHEELS = "/opt/wheels"


def first_hour_inventory(tmp_path: Path, fake_pve, ct) -> Path:
    shipped = yaml.safe_load((REPO / "inventory.yaml").read_text())
    tiny = shipped["experiments"]["tiny"]
    tiny["target"] = "ct"
    # The real trainer and the shipped tiny sizes; fewer steps so a shared 2-core box finishes in minutes.
    tiny["trainer"].update(max_steps=60, save_every=30, log_every=10)
    inv = {
        "hosts": {"pve": fake_pve.host_entry()},
        "targets": {"ct": {"kind": "container", "host": "pve", "ctid": ct.ctid, "workdir": ct.workdir, "venv": "cpu"}},
        "venvs": {
            # The shipped cpu profile plus where this machine keeps torch's CPU wheel (it travels to the
            # container) and the fake host's shared uv cache (mounted in, so PyPI is asked once per machine).
            "cpu": {**shipped["venvs"]["cpu"], "wheelhouse": [TORCH_WHEELS],
                    "uv_cache_dir": str(fake_pve.storage() / "uv-cache")},
            "system": {"kind": "system"},
        },
        "experiments": {
            "tiny": tiny,
            "hello": {"kind": "command", "target": "ct", "venv": "system",
                      "command": ["python3", "-c", "import sys, sysconfig; print('hello from', sys.executable, "
                                  "sys.version.split()[0], sysconfig.get_path('stdlib'))"]},
        },
    }
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


@pytest.mark.slow
@pytest.mark.timeout(3000)  # several minutes alone (a full import check, the tiny run); far longer on a busy box
def test_doctor_rebuild_launch_follow_on_a_stock_container_with_zero_hand_steps(fake_pve, dflashctl, tmp_path):
    from fakehost import STOCK

    # A newcomer's container with a network: rebuild-venv installs tmux from Debian and the lock from PyPI.
    ct = fake_pve.create_container(341, gpus=2, image=STOCK, network=True)
    env = dict(os.environ, DFLASHCTL_STATE_DIR=str(tmp_path / "state"), DFLASHCTL_INVENTORY=str(
        first_hour_inventory(tmp_path, fake_pve, ct)))
    env.pop("DFLASHCTL_WORKDIR", None)
    try:
        def run(*args, timeout=120):
            res = dflashctl(*args, env=env, timeout=timeout)
            assert "Traceback" not in res.stderr, res.stderr
            return res

        # 1. doctor: the container lacks tmux and uv, and says the next step fixes both.
        doc = run("doctor", "--target", "ct")
        assert doc.returncode == 0, doc.stdout + doc.stderr
        assert doc.stdout.count("dflashctl rebuild-venv --target ct") >= 2, doc.stdout

        # 2. rebuild-venv: uv, torch's wheel and tmux arrive; one pct exec.
        fake_pve.clear_pct_calls()
        rb = run("rebuild-venv", "--target", "ct", timeout=2400)
        assert rb.returncode == 0, rb.stdout + rb.stderr
        assert len(fake_pve.pct_exec_calls(341)) == 1
        assert "ct: built " in rb.stdout and "tmux installed" in rb.stdout and "brought along: uv, torch-" in rb.stdout
        again = run("doctor", "--target", "ct")
        assert again.returncode == 0 and "rebuild-venv" not in again.stdout, again.stdout

        # 3. launch the tiny dflash experiment, 4. follow it to its end.
        la = run("launch", "tiny")
        assert la.returncode == 0, la.stdout + la.stderr
        run_id = re.search(r"\b(tiny-\d{8}T\d{6}Z)\b", la.stdout).group(1)
        fo = run("logs", run_id, "--target", "ct", "--follow", timeout=2700)
        assert fo.returncode == 0, fo.stdout[-3000:] + fo.stderr[-3000:]
        done = [ln for ln in fo.stdout.splitlines() if "done:" in ln and "τ before" in ln]
        assert done, fo.stdout[-3000:]
        tau_after = float(re.search(r"-> after ([0-9.]+)", done[-1]).group(1))
        assert tau_after >= 1.0

        run_dir = Path(ct.workdir) / "runs" / run_id
        assert json.loads((run_dir / "exit.json").read_text())["exit_code"] == 0
        fp = json.loads((run_dir / "run.json").read_text())["env_fingerprint"]
        assert fp["torch"] == "2.13.0+cpu" and fp["python"].startswith("3.11.")
        from transformers import AutoModel

        model = AutoModel.from_pretrained(str(run_dir / "export"), trust_remote_code=True)
        assert sum(p.numel() for p in model.parameters()) > 0

        # The same way, a command experiment on the container's own python3 (a `kind: system` profile).
        hl = run("launch", "hello")
        assert hl.returncode == 0, hl.stdout + hl.stderr
        hello_id = re.search(r"\b(hello-\d{8}T\d{6}Z)\b", hl.stdout).group(1)
        fh = run("logs", hello_id, "--target", "ct", "--follow", timeout=300)
        assert fh.returncode == 0, fh.stdout + fh.stderr
        own = ct.exec(["python3", "-c", "import platform; print(platform.python_version())"]).stdout.decode().strip()
        assert f"hello from /usr/bin/python3 {own} /usr/lib/python3.11" in fh.stdout
        fp = json.loads((Path(ct.workdir) / "runs" / hello_id / "run.json").read_text())["env_fingerprint"]
        assert fp["kind"] == "system" and fp["python"] == own and fp["executable"] == "/usr/bin/python3"
    finally:
        fake_pve.remove_container(ct.ctid)
