"""SSHTransport against the real sshd of the fake Proxmox host."""

import json
import socket
import threading
import time

import paramiko
import pytest

from fakehost.strings import HOSTILE, PRINT_ARGV
from orchestrator.errors import ConnectError, HostKeyError
from orchestrator.transport.base import CommandTimeout
from orchestrator.transport.ssh import SSHTransport
from orchestrator.transport.sshconn import transport_over

PY = "/usr/bin/python3"


@pytest.fixture
def ssh(pve_ssh):
    return pve_ssh


def test_hostile_strings_arrive_byte_exact_on_the_host(ssh):
    res = ssh.run([PY, "-c", PRINT_ARGV, *HOSTILE])
    assert res.exit_code == 0, res.describe()
    assert json.loads(res.stdout) == HOSTILE


@pytest.mark.parametrize("code", [0, 1, 42])
def test_exit_codes_pass_through(ssh, code):
    res = ssh.run(["sh", "-c", f"echo out; echo err >&2; exit {code}"])
    assert (res.exit_code, res.stdout, res.stderr) == (code, b"out\n", b"err\n")


def test_ten_mb_stdout_and_ten_mb_stderr_at_once(ssh):
    # Interleaved writes: a reader that drains one stream first would stall once the other's window fills.
    script = ("import sys\nfor _ in range(160):\n sys.stdout.buffer.write(b'o'*65536)\n"
              " sys.stderr.buffer.write(b'e'*65536)\n")
    t0 = time.monotonic()
    res = ssh.run([PY, "-c", script], timeout=120)
    assert res.exit_code == 0
    assert (len(res.stdout), len(res.stderr)) == (10 * 1024 * 1024, 10 * 1024 * 1024)
    assert res.stdout.count(b"o") == len(res.stdout) and res.stderr.count(b"e") == len(res.stderr)
    assert time.monotonic() - t0 < 60


def test_stdin_is_sent_then_closed(ssh):
    data = b"x" * (3 * 1024 * 1024 + 7)
    res = ssh.run([PY, "-c", "import sys; print(len(sys.stdin.buffer.read()))"], stdin=data)
    assert res.stdout.strip() == str(len(data)).encode()
    # No stdin: EOF at once, so a reader does not hang.
    assert ssh.run(["cat"], timeout=20).stdout == b""


def test_no_pty_streams_stay_separate(ssh):
    res = ssh.run(["sh", "-c", "test -t 0 || echo notty; printf 'a\\n'; printf 'b\\n' >&2"])
    assert res.stdout == b"notty\na\n" and res.stderr == b"b\n"  # no CRLF, no merged streams


def test_streaming_callbacks_get_chunks_as_they_come(ssh):
    got, times = [], []

    def on_out(chunk):
        got.append(chunk)
        times.append(time.monotonic())

    t0 = time.monotonic()
    res = ssh.run(["sh", "-c", "echo first; sleep 1; echo second"], on_stdout=on_out)
    assert b"".join(got) == b"first\nsecond\n"
    assert res.stdout == b""  # streamed, not kept
    assert times[0] - t0 < 0.8  # the first line arrived before the command finished


def test_callback_error_propagates(ssh):
    def boom(chunk):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        ssh.run(["sh", "-c", "yes | head -c 2000000"], on_stdout=boom, timeout=30)
    assert ssh.run(["true"]).exit_code == 0  # the connection is still usable


def test_timeout_raises_and_keeps_partial_output(ssh):
    t0 = time.monotonic()
    with pytest.raises(CommandTimeout) as info:
        ssh.run(["sh", "-c", "echo started; sleep 30"], timeout=1.0)
    assert time.monotonic() - t0 < 5
    assert info.value.result.stdout == b"started\n"
    assert ssh.run(["echo", "ok"]).stdout == b"ok\n"


def test_killed_remote_process_reads_as_255(ssh):
    # The login shell kills itself: sshd sends exit-signal, not exit-status; like OpenSSH's client: 255.
    res = ssh.run(["sh", "-c", "kill -KILL $$"])
    assert res.exit_code == 255
    assert b"without an exit status" in res.stderr_tail


def test_one_connection_many_commands_and_a_call_counter(fake_pve):
    ssh = fake_pve.ssh_transport()
    try:
        for _ in range(5):
            assert ssh.run(["true"]).exit_code == 0
        assert (ssh.calls, ssh.connects) == (5, 1)
        # Concurrent commands share the one connection too (a channel each).
        threads = [threading.Thread(target=ssh.run, args=(["sleep", "0.2"],)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert (ssh.calls, ssh.connects) == (9, 1)
    finally:
        ssh.close()


def test_tcp_nodelay_and_keepalive_are_on(ssh):
    ssh.connect()
    transport = ssh._conn.client.get_transport()
    assert transport.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    assert transport.packetizer._Packetizer__keepalive_interval == 15


class _RecordingSocket(socket.socket):
    """A TCP socket that notes each setsockopt call, and whether it came after a byte was sent."""

    def __init__(self, *args):
        super().__init__(*args)
        self.options: list[tuple] = []
        self.sent = False

    def setsockopt(self, level, option, value):
        self.options.append((level, option, value, self.sent))
        return super().setsockopt(level, option, value)

    def send(self, data, *flags):
        self.sent = True
        return super().send(data, *flags)


def test_nodelay_before_the_handshake_and_the_hosts_global_request_acknowledged_at_once(fake_pve):
    # Each of the two is a ~40 ms stall of every connection: a handshake packet held by Nagle, and the first
    # channel's confirmation held by sshd's Nagle until our delayed ACK of its hostkeys-00 request.
    sock = _RecordingSocket(socket.AF_INET, socket.SOCK_STREAM)
    sock.connect((fake_pve.hostname, fake_pve.port))
    transport = transport_over(sock)
    try:
        assert sock.options == [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1, False)]
        transport.start_client(timeout=10)
        transport.auth_publickey(fake_pve.user, paramiko.Ed25519Key.from_private_key_file(fake_pve.identity_file))
        transport.open_session(timeout=10).close()  # sshd sends hostkeys-00 before it confirms the channel
        assert sock.options[1:] == [(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1, True)]
    finally:
        transport.close()


def test_aes_gcm_is_negotiated_first(ssh):
    # One AEAD call per packet in paramiko's Python loop instead of CTR + HMAC (follow latency).
    ssh.connect()
    transport = ssh._conn.client.get_transport()
    assert transport.remote_cipher.endswith("-gcm@openssh.com"), transport.remote_cipher
    assert transport.local_cipher.endswith("-gcm@openssh.com"), transport.local_cipher
    assert ssh.run(["echo", "ok"]).stdout == b"ok\n"


def test_reconnects_once_when_the_connection_died(ssh):
    assert ssh.run(["true"]).exit_code == 0
    ssh._conn.client.get_transport().sock.shutdown(socket.SHUT_RDWR)  # the network dropped
    time.sleep(0.2)
    assert ssh.run(["echo", "back"]).stdout == b"back\n"
    assert ssh.connects == 2


def test_session_skips_roots_bashrc(ssh):
    # root's ~/.bashrc exports PYENV_ROOT; the fake host's sessions must not read it (it costs ~120 ms).
    res = ssh.run(["bash", "-c", "echo ${PYENV_ROOT-unset}"])
    assert res.stdout == b"unset\n"


def test_connection_refused_is_a_readable_connect_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ssh = SSHTransport("127.0.0.1", port=port, user="root", connect_timeout=3)
    with pytest.raises(ConnectError) as info:
        ssh.run(["true"])
    assert "refused" in str(info.value) and str(port) in str(info.value)


def test_banner_timeout_is_a_connect_error():
    # A TCP listener that never speaks SSH.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:
        ssh = SSHTransport("127.0.0.1", port=server.getsockname()[1], user="root", connect_timeout=1)
        t0 = time.monotonic()
        with pytest.raises(ConnectError, match="handshake"):
            ssh.run(["true"])
        assert time.monotonic() - t0 < 10
    finally:
        server.close()


def test_wrong_key_is_an_authentication_error(fake_pve, tmp_path):
    import subprocess

    key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    ssh = fake_pve.ssh_transport(identity_file=str(key))
    with pytest.raises(ConnectError, match="authentication failed") as info:
        ssh.run(["true"])
    assert "authorized_keys" in str(info.value)


def _alias_config(fake_pve, tmp_path, extra: str = "") -> str:
    cfg = tmp_path / "ssh_config"
    cfg.write_text(
        f"Host pve-alias\n  HostName 127.0.0.1\n  Port {fake_pve.port}\n  User root\n"
        f"  IdentityFile {fake_pve.identity_file}\n" + extra
    )
    return str(cfg)


def test_ssh_config_alias_resolves_host_port_user_and_key(fake_pve, tmp_path):
    cfg = _alias_config(fake_pve, tmp_path)
    ssh = SSHTransport("pve-alias", ssh_config_alias="pve-alias", known_hosts=fake_pve.known_hosts,
                       ssh_config_file=cfg)
    try:
        assert ssh.run(["sh", "-c", 'echo "$SSH_CONNECTION"']).text().split()[2:] == ["127.0.0.1", str(fake_pve.port)]
    finally:
        ssh.close()


def test_proxyjump_goes_through_the_jump_host_and_checks_both_keys(fake_pve, tmp_path):
    # The target is reached by a direct-tcpip channel from the jump host (the same sshd here), under
    # another name, so known_hosts must vouch for both names.
    cfg = _alias_config(fake_pve, tmp_path, extra=(
        f"Host behind\n  HostName localhost\n  Port {fake_pve.port}\n  User root\n"
        f"  IdentityFile {fake_pve.identity_file}\n  ProxyJump pve-alias\n"))
    line = open(fake_pve.known_hosts).read().split(" ", 1)[1]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{fake_pve.port} {line}")
    ssh = SSHTransport("behind", ssh_config_alias="behind", known_hosts=str(kh), ssh_config_file=cfg, name="behind")
    try:
        with pytest.raises(HostKeyError) as info:  # the inner hop's key is unknown under "localhost"
            ssh.run(["true"])
        assert "dflashctl trust behind" in str(info.value)
        kh.write_text(kh.read_text() + f"[localhost]:{fake_pve.port} {line}")
        res = ssh.run(["sh", "-c", 'echo "$SSH_CONNECTION"'])
        assert res.exit_code == 0
        assert res.text().split()[0] == "127.0.0.1"  # the jump host's sshd connected to itself
    finally:
        ssh.close()


def test_connection_lost_during_a_command_is_a_connect_error(fake_pve, ssh):
    import os
    import signal


    ssh.connect()
    before = set(_sshd_children(fake_pve._sshd.pid))
    result = {}

    def run():
        try:
            result["res"] = ssh.run(["sleep", "30"], timeout=60)
        except Exception as exc:  # noqa: BLE001 - inspected below
            result["exc"] = exc

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    for pid in set(_sshd_children(fake_pve._sshd.pid)) | before:
        try:
            os.kill(pid, signal.SIGKILL)  # the per-connection sshd: the network "drops"
        except ProcessLookupError:  # a child listed before that has exited since (e.g. an earlier session's)
            pass
    t.join(30)
    assert isinstance(result.get("exc"), ConnectError), result
    assert "lost during a command" in str(result["exc"])
    assert ssh.run(["echo", "again"]).stdout == b"again\n"  # and the next command reconnects


def _sshd_children(main_pid: int) -> list[int]:
    from pathlib import Path

    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == main_pid:
                out.append(int(entry.name))
    return out


def test_ssh_argv_quotes_the_remote_command_once():
    import subprocess

    from orchestrator.transport.openssh import openssh_argv

    argv = openssh_argv("pve1", ["pct", "exec", "200", "--", "echo", "a b", "$(id)"], tty=True)
    assert argv == ["ssh", "-t", "pve1", "pct exec 200 -- echo 'a b' '$(id)'"]
    assert subprocess.run(["sh", "-c", "printf '%s\\n' " + argv[-1].split(" -- ", 1)[1]],
                          capture_output=True, text=True).stdout == "echo\na b\n$(id)\n"
