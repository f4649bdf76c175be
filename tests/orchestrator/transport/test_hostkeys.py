"""Host keys: unknown refused (fingerprint + `dflashctl trust`), changed refused always, trusted accepted."""

import base64
import subprocess

import paramiko
import pytest

from orchestrator.errors import HostKeyError
from orchestrator.transport import hostkeys


def _keygen_fingerprint(pub_path) -> str:
    # ssh-keygen -l prints "256 SHA256:xxxx comment (ED25519)"
    out = subprocess.run(["ssh-keygen", "-l", "-f", str(pub_path)], capture_output=True, text=True, check=True).stdout
    return out.split()[1]


def test_host_key_name():
    assert hostkeys.host_key_name("pve1", 22) == "pve1"
    assert hostkeys.host_key_name("10.0.0.5", 2222) == "[10.0.0.5]:2222"


def test_fingerprint_matches_ssh_keygen(fake_pve):
    pub = (fake_pve.base / "ssh" / "ssh_host_ed25519_key.pub").read_text().split()
    key = paramiko.PKey.from_type_string(pub[0], base64.b64decode(pub[1]))
    assert hostkeys.fingerprint(key) == _keygen_fingerprint(fake_pve.host_key_file + ".pub")


def test_unknown_host_key_is_refused_with_fingerprint_and_trust_command(fake_pve, tmp_path):
    empty = tmp_path / "known_hosts"
    ssh = fake_pve.ssh_transport(known_hosts=str(empty), name="pve-lab")
    with pytest.raises(HostKeyError) as info:
        ssh.run(["true"])
    text = str(info.value)
    assert _keygen_fingerprint(fake_pve.host_key_file + ".pub") in text
    assert "ssh-ed25519" in text and f"[127.0.0.1]:{fake_pve.port}" in text
    assert info.value.fix == "dflashctl trust pve-lab"
    assert not empty.exists()  # nothing was written behind the user's back


def test_trusted_key_is_accepted(pve_ssh):
    assert pve_ssh.run(["echo", "ok"]).stdout == b"ok\n"


def test_changed_host_key_is_refused_with_a_warning(fake_pve, tmp_path):
    other = tmp_path / "other_host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    typ, b64 = (tmp_path / "other_host_key.pub").read_text().split()[:2]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{fake_pve.port} {typ} {b64}\n")
    ssh = fake_pve.ssh_transport(known_hosts=str(kh))
    with pytest.raises(HostKeyError) as info:
        ssh.run(["true"])
    text = str(info.value)
    assert "CHANGED" in text and "attack" in text
    assert _keygen_fingerprint(fake_pve.host_key_file + ".pub") in text  # what the host offers now
    assert _keygen_fingerprint(tmp_path / "other_host_key.pub") in text  # what we expected
    assert "ssh-keygen -R" in info.value.fix
    # trust refuses to overwrite it as well: there is no bypass.
    with pytest.raises(HostKeyError, match="CHANGED"):
        hostkeys.trust_host("127.0.0.1", fake_pve.port, kh)
    assert kh.read_text().count("\n") == 1


def test_trust_host_records_the_key_then_connections_work(fake_pve, tmp_path):
    kh = tmp_path / "sub" / "known_hosts"
    keytype, fp = hostkeys.trust_host("127.0.0.1", fake_pve.port, kh)
    assert keytype == "ssh-ed25519"
    assert fp == _keygen_fingerprint(fake_pve.host_key_file + ".pub")
    line = kh.read_text()
    assert line.startswith(f"[127.0.0.1]:{fake_pve.port} ssh-ed25519 ")
    # OpenSSH's client agrees with the entry.
    out = subprocess.run(["ssh-keygen", "-F", f"[127.0.0.1]:{fake_pve.port}", "-f", str(kh)],
                         capture_output=True, text=True)
    assert out.returncode == 0
    # Trusting again does not duplicate the line.
    hostkeys.trust_host("127.0.0.1", fake_pve.port, kh)
    assert kh.read_text() == line
    ssh = fake_pve.ssh_transport(known_hosts=str(kh))
    try:
        assert ssh.run(["true"]).exit_code == 0
    finally:
        ssh.close()


def test_hashed_known_hosts_entries_are_honoured(fake_pve, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(open(fake_pve.known_hosts).read())
    subprocess.run(["ssh-keygen", "-H", "-f", str(kh)], check=True, capture_output=True)
    assert "127.0.0.1" not in kh.read_text()
    ssh = fake_pve.ssh_transport(known_hosts=str(kh))
    try:
        assert ssh.run(["true"]).exit_code == 0
    finally:
        ssh.close()


def test_trust_host_on_a_dead_port_is_a_connect_error(tmp_path):
    import socket

    from orchestrator.errors import ConnectError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectError, match="cannot fetch the host key"):
        hostkeys.trust_host("127.0.0.1", port, tmp_path / "kh", timeout=2)
