"""A container without tmux: `launch` fails with ONE error saying tmux is missing, and its fix, pasted as
printed on the workstation (`dflashctl rebuild-venv --target T`), installs it: with apt-get in a container that
reaches a Debian mirror, with Debian's packages brought from the workstation in one that has no network."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_launch_on_a_container_without_tmux_is_one_error_whose_fix_works(fake_pve, tmp_path, dflashctl):
    from fakehost import STOCK

    # The printed fix installs tmux from Debian's mirror: this container has a network (the host's).
    ct = fake_pve.create_container(336, gpus=0, image=STOCK, network=True)
    try:
        assert ct.exec(["sh", "-c", "command -v tmux"]).returncode == 127
        inv = tmp_path / "inv.yaml"
        inv.write_text(yaml.safe_dump({
            "hosts": {"pve": fake_pve.host_entry()},
            "targets": {"ct": {"kind": "container", "host": "pve", "ctid": 336, "workdir": ct.workdir,
                               "venv": "sys"}},
            "venvs": {"sys": {"kind": "system"}},
            "experiments": {"cmd": {"kind": "command", "target": "ct", "command": ["true"]}},
        }))
        env_state = {"DFLASHCTL_STATE_DIR": str(tmp_path / "state")}
        import os

        env = {**os.environ, **env_state, "DFLASHCTL_INVENTORY": str(inv)}
        res = dflashctl("launch", "cmd", env=env, timeout=300)
        assert res.returncode == 1, res.stdout + res.stderr
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        assert len(errors) == 1 and "tmux is not installed in the target" in errors[0], res.stderr
        assert "rebuild-venv installs it: with apt-get there" in errors[0], res.stderr
        fixes = [line.removeprefix("fix: ") for line in lines if line.startswith("fix: ")]
        assert fixes == ["dflashctl rebuild-venv --target ct"], res.stderr
        pasted = subprocess.run(["bash", "-c", fixes[0]], capture_output=True, text=True, timeout=600, env=env)
        assert pasted.returncode == 0, pasted.stdout[-2000:] + pasted.stderr[-2000:]
        assert ct.exec(["tmux", "-V"]).returncode == 0
        again = dflashctl("launch", "cmd", env=env, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        fake_pve.remove_container(ct.ctid)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_rebuild_venv_brings_debians_tmux_to_a_networkless_container_and_tiny_then_launches(
        fake_pve, stock_cpu_venv, tmp_path, dflashctl):
    """No network in the container, so its apt-get cannot install tmux: the installed `dflashctl rebuild-venv`
    fetches Debian's tmux packages for the container's release here (cached in the state dir, checked against
    the Packages index), installs them there with dpkg -i, and the tiny experiment then launches and ends."""
    import json
    import os
    import re
    from fakehost import STOCK

    from cpu_venv import link_shared_cpu_venv, tiny_inventory

    shared, _lock = stock_cpu_venv
    ct = fake_pve.create_container(337, gpus=2, image=STOCK)  # no network: loopback only
    try:
        link_shared_cpu_venv(ct, shared)
        assert ct.exec(["sh", "-c", "command -v tmux"]).returncode == 127
        assert ct.exec(["sh", "-c", "apt-get -q update 2>&1 | grep -q 'Temporary failure resolving'"]).returncode == 0
        inv = tiny_inventory(tmp_path / "inv.yaml", fake_pve, ct, max_steps=20, save_every=10, log_every=5)
        state = tmp_path / "state"
        env = {**os.environ, "DFLASHCTL_STATE_DIR": str(state), "DFLASHCTL_INVENTORY": str(inv)}

        rb = dflashctl("rebuild-venv", "--target", "ct", env=env, timeout=900)
        assert rb.returncode == 0, rb.stdout + rb.stderr
        line = next(ln for ln in rb.stdout.splitlines() if "tmux installed" in ln)
        assert re.fullmatch(r"ct: tmux installed \(tmux 3\.3a, Debian's packages from this workstation: "
                            r"libevent-core-2\.1-7_[^,]+_amd64\.deb, libutempter0_[^,]+_amd64\.deb, "
                            r"tmux_3\.3a-[^,]+_amd64\.deb\)", line), line
        assert "TmuxMissing" not in rb.stdout + rb.stderr and "warning" not in rb.stderr.lower(), rb.stderr
        assert ct.exec(["tmux", "-V"]).stdout.decode().strip() == "tmux 3.3a"
        status = ct.exec(["dpkg-query", "-W", "-f", "${Status}", "tmux"]).stdout.decode()
        assert status == "install ok installed"  # dpkg knows it: a later apt-get upgrade updates it
        cached = sorted(p.name for p in (state / "debs" / "debian-bookworm-amd64" / "archives").glob("*.deb"))
        assert [c.split("_")[0] for c in cached] == ["libevent-core-2.1-7", "libutempter0", "tmux"]

        la = dflashctl("launch", "tiny", env=env, timeout=600)
        assert la.returncode == 0, la.stdout + la.stderr
        run_id = re.search(r"\b(tiny-\d{8}T\d{6}Z)\b", la.stdout).group(1)
        fo = dflashctl("logs", run_id, "--follow", env=env, timeout=1800)
        assert fo.returncode == 0, fo.stdout[-3000:] + fo.stderr[-3000:]
        exit_json = json.loads((Path(ct.workdir) / "runs" / run_id / "exit.json").read_text())
        assert exit_json["exit_code"] == 0
    finally:
        fake_pve.remove_container(ct.ctid)


@pytest.mark.slow
def test_rebuild_venv_of_a_system_profile_brings_tmux_and_a_command_then_runs(fake_pve, tmp_path, dflashctl):
    """A `kind: system` profile builds no venv, but its runs live in tmux too: on a networkless container the
    installed `dflashctl rebuild-venv` installs Debian's tmux (one command for the check, one for the
    packages) and a command experiment on the container's python3 then launches and ends well."""
    import os
    import re

    from fakehost import STOCK

    ct = fake_pve.create_container(338, gpus=0, image=STOCK)  # no network
    try:
        assert ct.exec(["sh", "-c", "command -v tmux"]).returncode == 127
        inv = tmp_path / "inv.yaml"
        inv.write_text(yaml.safe_dump({
            "hosts": {"pve": fake_pve.host_entry()},
            "targets": {"ct": {"kind": "container", "host": "pve", "ctid": 338, "workdir": ct.workdir,
                               "venv": "sys"}},
            "venvs": {"sys": {"kind": "system"}},
            "experiments": {"hello": {"kind": "command", "target": "ct", "command": ["python3", "-c", "print(6 * 7)"]}},
        }))
        env = {**os.environ, "DFLASHCTL_STATE_DIR": str(tmp_path / "state"), "DFLASHCTL_INVENTORY": str(inv)}
        fake_pve.clear_pct_calls()
        rb = dflashctl("rebuild-venv", "--target", "ct", env=env, timeout=600)
        assert rb.returncode == 0, rb.stdout + rb.stderr
        assert "profile 'sys' is the target's python3 as is: nothing to build" in rb.stdout
        assert "ct: tmux installed (tmux 3.3a, Debian's packages from this workstation: " in rb.stdout, rb.stdout
        assert "warning" not in rb.stderr, rb.stderr
        assert len(fake_pve.pct_exec_calls(338)) == 2
        la = dflashctl("launch", "hello", env=env, timeout=300)
        assert la.returncode == 0, la.stdout + la.stderr
        run_id = re.search(r"\b(hello-\d{8}T\d{6}Z)\b", la.stdout).group(1)
        fo = dflashctl("logs", run_id, "--target", "ct", "--follow", env=env, timeout=300)
        assert fo.returncode == 0 and "42" in fo.stdout.splitlines(), fo.stdout + fo.stderr
    finally:
        fake_pve.remove_container(ct.ctid)
