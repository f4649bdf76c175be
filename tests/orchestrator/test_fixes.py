"""Printed fixes work when pasted as printed: the ssh destination is the one the user's ssh reaches (port,
user, identity, known_hosts of the inventory; or the ~/.ssh/config alias alone), never the inventory's name
for the host. Each fix printed against the fake Proxmox host is run through a shell and must do its job."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from orchestrator.transport.openssh import openssh_argv, paste_line


def test_openssh_argv_and_its_paste_line_golden():
    argv = openssh_argv("pve1.lan", ["pct", "start", "200"], port=2222, user="root")
    assert argv == ["ssh", "-p", "2222", "root@pve1.lan", "pct start 200"]
    assert paste_line(argv) == "ssh -p 2222 root@pve1.lan pct start 200"
    assert paste_line(openssh_argv("pve1", ["pct", "start", "200"], port=22)) == "ssh pve1 pct start 200"
    # a remote word that needs quoting: the whole remote command is printed as the one argument it is
    argv = openssh_argv("pve1", ["pct", "exec", "200", "--", "echo", "a b", "$(id)"], identity_file="/k/my key")
    assert paste_line(argv) == ("ssh -i '/k/my key' -o IdentitiesOnly=yes pve1 "
                                "'pct exec 200 -- echo '\"'\"'a b'\"'\"' '\"'\"'$(id)'\"'\"''")
    assert shlex.split(paste_line(argv)) == argv
    for bad in ("-oProxyCommand=x", "pve 1", ""):
        with pytest.raises(ValueError, match="bad ssh destination"):
            openssh_argv(bad, ["true"])


def _inventory(tmp_path: Path, host: dict, ctid: int, workdir: str = "/root/dflash") -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({
        "hosts": {"pve": host},
        "targets": {"ct": {"kind": "container", "host": "pve", "ctid": ctid, "workdir": workdir,
                           "venv": "system"}},
        "venvs": {"system": {"kind": "system"}},
        "experiments": {"e": {"kind": "command", "target": "ct", "command": ["true"]}},
    }))
    return path


def _checks(dflashctl, inv: Path, env: dict | None = None) -> dict:
    r = dflashctl("-i", str(inv), "doctor", "-t", "ct", "--json", env=env)
    return {c["name"]: c for c in json.loads(r.stdout)["checks"]}


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_doctors_pct_start_fix_is_the_ssh_command_and_works_as_pasted(pve, tmp_path, dflashctl):
    pve.create_container(331, gpus=1, running=False)
    fix = _checks(dflashctl, _inventory(tmp_path, pve.host_entry(), 331))["container running"]["fix"]
    assert shlex.split(fix) == ["ssh", "-p", str(pve.port), "-i", pve.identity_file, "-o", "IdentitiesOnly=yes",
                                "-o", f"UserKnownHostsFile={pve.known_hosts}", f"root@{pve.hostname}",
                                "pct", "start", "331"]
    subprocess.run(["bash", "-c", fix], check=True, capture_output=True, timeout=60)  # pasted as printed
    assert _checks(dflashctl, _inventory(tmp_path, pve.host_entry(), 331))["container running"]["status"] == "ok"


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_an_ssh_config_alias_is_printed_alone_and_works_with_that_config(pve, tmp_path, dflashctl):
    # The user's ~/.ssh/config names the host; the inventory says only `ssh: pve-alias`.
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    config = home / ".ssh" / "config"
    config.write_text(f"Host pve-alias\n  HostName {pve.hostname}\n  Port {pve.port}\n  User {pve.user}\n"
                      f"  IdentityFile {pve.identity_file}\n  IdentitiesOnly yes\n"
                      f"  UserKnownHostsFile {home / '.ssh' / 'known_hosts'}\n")
    (home / ".ssh" / "known_hosts").write_text(Path(pve.known_hosts).read_text())
    pve.create_container(332, gpus=1, running=False)
    inv = _inventory(tmp_path, {"ssh": "pve-alias"}, 332)
    fix = _checks(dflashctl, inv, env=dict(os.environ, HOME=str(home)))["container running"]["fix"]
    assert fix == "ssh pve-alias pct start 332"
    # OpenSSH reads the config of the passwd home, not $HOME: the test hands it the same file with -F.
    argv = shlex.split(fix)
    subprocess.run([argv[0], "-F", str(config), *argv[1:]], check=True, capture_output=True, timeout=60)
    assert _checks(dflashctl, inv, env=dict(os.environ, HOME=str(home)))["container running"]["status"] == "ok"


def test_a_launch_refused_for_a_stopped_container_prints_a_working_fix(pve, tmp_path, dflashctl):
    ct = pve.create_container(333, gpus=0)
    ct.stop()
    r = dflashctl("-i", str(_inventory(tmp_path, pve.host_entry(), 333, ct.workdir)), "launch", "e")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == "error: container 333 on pve is not running"
    fix = next(ln for ln in lines if ln.startswith("fix: start it: ")).removeprefix("fix: start it: ")
    assert fix.startswith(f"ssh -p {pve.port} ") and fix.endswith(f"root@{pve.hostname} pct start 333")
    subprocess.run(["bash", "-c", fix], check=True, capture_output=True, timeout=60)
    assert pve.ssh_transport().run(["pct", "status", "333"]).stdout == b"status: running\n"


def test_doctor_shows_pcts_own_words(pve, tmp_path, dflashctl):
    pve.create_container(334, gpus=1)
    pve.set_pct_error("ipcc_send_rec[1] failed: Unknown error -1\n"
                      "Unable to load access control list: Unknown error -1")
    pct = _checks(dflashctl, _inventory(tmp_path, pve.host_entry(), 334))["pct present"]
    assert pct["status"] == "fail"
    assert "Unable to load access control list: Unknown error -1" in pct["detail"]
    assert pct["detail"].startswith("`pct status 334` failed on pve: ipcc_send_rec[1] failed")


def test_an_ssh_destination_ssh_would_read_as_an_option_is_an_inventory_error(tmp_path):
    from orchestrator.errors import InventoryError
    from orchestrator.inventory import load_inventory

    inv = _inventory(tmp_path, {"ssh": "-oProxyCommand=id", "user": "ro ot"}, 335)
    with pytest.raises(InventoryError) as info:
        load_inventory(inv)
    assert "hosts.pve.ssh: '-oProxyCommand=id' cannot be given to ssh" in str(info.value)
    assert "hosts.pve.user: 'ro ot' cannot be given to ssh" in str(info.value)


@pytest.mark.usefixtures("isolated_tmux")
def test_a_venv_of_another_profile_is_named_as_such_and_the_fix_builds_the_right_profile(tmp_path, local_target):
    from orchestrator.agent import venvfingerprint
    from orchestrator.errors import PreflightError
    from orchestrator.ops.launch import LaunchSpec, launch

    # The target's current venv was built for profile `cpu` (lock hash C); the experiment uses `cuda` (U).
    venv = Path(local_target.workdir) / "venvs" / "C-0"
    venv.mkdir(parents=True)
    (venv / "dflashctl-fingerprint.json").write_text(json.dumps({"lock_hash": "C", "packages": {}}))
    (Path(local_target.workdir) / "venvs" / "current").symlink_to(venv.name)
    fp = venvfingerprint.current_fingerprint(local_target.workdir, {"kind": "uv"})
    assert venvfingerprint.fingerprint_diff(fp, "U", {"name": "cuda", "lock": "cuda"}) == [
        "the current venv C-0 was built from lock C; venv profile 'cuda' (lock cuda) needs lock U "
        "(run `dflashctl rebuild-venv`)"]

    spec = LaunchSpec(experiment="e", kind="command", target="local", command=["true"], lock_hash="U",
                      venv_profile={"name": "cuda", "kind": "uv", "lock": "cuda"})
    with pytest.raises(PreflightError) as info:
        launch(local_target, spec)
    assert "lock is now" not in info.value.message and "venv profile 'cuda' (lock cuda) needs lock U" in info.value.message
    assert info.value.fix == "dflashctl rebuild-venv --target local --profile cuda"


def test_the_missing_module_fix_names_the_commands_that_check_imports(tmp_path, dflashctl):
    # doctor imports nothing of the venv; rebuild-venv does (venvinfo.verify), after `dflashctl lock`.
    log = tmp_path / "train.log"
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                   "ModuleNotFoundError: No module named 'accelerate'\n")
    r = dflashctl("diagnose", str(log))
    assert r.returncode == 2, r.stderr
    fix = next(ln for ln in r.stdout.splitlines() if ln.startswith("fix: "))
    assert "`dflashctl lock PROFILE`" in fix and "`dflashctl rebuild-venv`" in fix and "imports every" in fix
    assert "doctor" not in fix and "`accelerate`" in fix


@pytest.mark.parametrize("fix, expected", [
    ("dflashctl runs  (lists recorded runs)", "dflashctl -i 'my inv.yaml' runs  (lists recorded runs)"),
    ("dflashctl launch tiny --replace   (or: dflashctl stop R)",
     "dflashctl -i 'my inv.yaml' launch tiny --replace   (or: dflashctl -i 'my inv.yaml' stop R)"),
    ("ssh -p 22 root@pve pct exec 200 -- apt-get install -y tmux", None),  # no dflashctl command: unchanged
    ("/usr/local/bin/dflashctl runs; see dflashctl's README", None),  # a path's tail, a possessive: unchanged
])
def test_a_dflashctl_fix_gets_the_inventory_the_user_gave(fix, expected):
    from orchestrator.errors import with_inventory

    assert with_inventory(fix, "my inv.yaml") == (fix if expected is None else expected)
    assert with_inventory(fix, None) == fix  # without --inventory the default lookup is what the fix reads
