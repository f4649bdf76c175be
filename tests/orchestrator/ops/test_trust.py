"""trust (orchestrator.ops.trust) for a host the inventory names by its ~/.ssh/config alias: the key is recorded
for the address ssh really reaches (the alias's HostName and Port), so the OpenSSH client of a pasted fix or
of `attach` and dflashctl's own connections both accept the host afterwards, with strict checking. The fake
Proxmox host's real sshd. (`dflashctl trust` on a plain host entry, a changed key refused, an unknown name
suggested: tests/orchestrator/test_cli.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from orchestrator.inventory import load_inventory
from orchestrator.transport.ssh import SSHSettings


def test_trusting_an_ssh_config_alias_records_the_address_ssh_reaches(pve, tmp_path, monkeypatch, dflashctl):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    config = home / ".ssh" / "config"
    config.write_text(f"Host pve-alias\n  HostName {pve.hostname}\n  Port {pve.port}\n  User {pve.user}\n"
                      f"  IdentityFile {pve.identity_file}\n  IdentitiesOnly yes\n")
    known = tmp_path / "known_hosts"
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {"pve": {"ssh": "pve-alias", "known_hosts": str(known)}}}))

    env = dict(os.environ, HOME=str(home))
    res = dflashctl("-i", str(inv), "trust", "pve", env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"trusted pve ({pve.hostname}:{pve.port}): ssh-ed25519 SHA256:")
    assert known.read_text().startswith(f"[{pve.hostname}]:{pve.port} ssh-ed25519 ")

    # OpenSSH reads the config of the passwd home, not $HOME: it gets the same file with -F.
    ssh = subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={known}",
                          "-o", "StrictHostKeyChecking=yes", "pve-alias", "echo", "reached"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert (ssh.returncode, ssh.stdout) == (0, "reached\n"), ssh.stderr

    monkeypatch.setenv("HOME", str(home))  # dflashctl's own transport reads ~/.ssh/config too
    t = SSHSettings.of("pve", load_inventory(inv).host("pve")).transport()
    try:
        assert t.run(["echo", "reached"]).stdout == b"reached\n"
    finally:
        t.close()
    assert Path(known).read_text().count("\n") == 1  # nothing added by connecting: the key was already there
