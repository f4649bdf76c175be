"""A container without tmux: `launch` fails with ONE error saying tmux is missing, and its fix, pasted as
printed on the workstation (ssh + pct exec around apt-get), installs it (the fake host's containers share
this machine's network, so a Debian mirror is reachable here)."""

from __future__ import annotations

import subprocess

import yaml


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

        res = dflashctl("--inventory", str(inv), "launch", "cmd", env={**os.environ, **env_state}, timeout=300)
        assert res.returncode == 1, res.stdout + res.stderr
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        assert len(errors) == 1 and "tmux is not installed in the target" in errors[0], res.stderr
        assert "dflashctl rebuild-venv --target ct installs it too" in errors[0]
        fix = next(line for line in lines if line.startswith("fix: ")).removeprefix("fix: ")
        assert fix.startswith("ssh ") and "pct exec 336 --keep-env 0 -- sh -c" in fix, fix
        pasted = subprocess.run(["bash", "-c", fix], capture_output=True, text=True, timeout=300)
        assert pasted.returncode == 0, pasted.stderr[-2000:]
        assert ct.exec(["tmux", "-V"]).returncode == 0
    finally:
        fake_pve.remove_container(ct.ctid)
