"""The pct layer: pure builders with golden strings, stderr classification, and end-to-end runs through the
real sshd into containers of the fake Proxmox host."""

import json

import pytest

from fakehost.strings import HOSTILE, PRINT_ARGV
from orchestrator.errors import ContainerMissing, ContainerStopped, PctError, PctNotFound, SudoRequired, UserError
from orchestrator.transport.base import Result
from orchestrator.transport.pct import PctTransport, classify, pct_argv, pct_exec_argv
from orchestrator.transport.pvehost import PveHost
from orchestrator.quoting import render

# ------------------------------------------------------------------------------------------ golden (pure)


def test_pct_exec_argv_golden():
    assert pct_exec_argv(200, ["true"]) == ["pct", "exec", "200", "--keep-env", "0", "--", "true"]
    assert pct_exec_argv(200, ["ls", "-la"], sudo=True) == [
        "sudo", "-n", "pct", "exec", "200", "--keep-env", "0", "--", "ls", "-la"]
    assert pct_exec_argv("201", ["x"], pct="/usr/sbin/pct")[:3] == ["/usr/sbin/pct", "exec", "201"]


def test_rendered_pct_exec_golden():
    argv = pct_exec_argv(200, ["bash", "-c", 'echo "$HOME" && ls *', "it's"])
    assert render(argv) == (
        "pct exec 200 --keep-env 0 -- bash -c 'echo \"$HOME\" && ls *' 'it'\"'\"'s'"
    )
    assert render(pct_exec_argv(200, ["tmux", "new-session", "-d", "-s", "dflash-exp"], sudo=True)) == (
        "sudo -n pct exec 200 --keep-env 0 -- tmux new-session -d -s dflash-exp"
    )


def test_pct_argv_golden():
    assert pct_argv(200, "status") == ["pct", "status", "200"]
    assert pct_argv(200, "stop", sudo=True) == ["sudo", "-n", "pct", "stop", "200"]
    assert pct_argv(200, "push", "/a", "/b") == ["pct", "push", "200", "/a", "/b"]
    with pytest.raises(ValueError, match="unsupported pct verb"):
        pct_argv(200, "exec")


@pytest.mark.parametrize("bad", [0, 99, -1, "abc", "200; id", 1_000_000_000, True])
def test_bad_ctid_is_a_user_error(bad):
    with pytest.raises(UserError, match="bad container id"):
        pct_exec_argv(bad, ["true"])


def test_empty_command_refused():
    with pytest.raises(ValueError, match="needs a command"):
        pct_exec_argv(200, [])


def _res(code, stderr):
    return Result(["pct"], code, b"", stderr.encode(), "test")


@pytest.mark.parametrize(
    "code, stderr, sudo, expected",
    [
        (255, "container '200' not running!\n", False, ContainerStopped),
        (2, "container '200' not running!\n", False, ContainerStopped),  # errno-ish exit: text decides
        (255, "Configuration file 'nodes/pve1/lxc/200.conf' does not exist\n", False, ContainerMissing),
        (127, "bash: line 1: pct: command not found\n", False, PctNotFound),
        (127, "sh: 1: pct: not found\n", False, PctNotFound),
        (1, "sudo: a password is required\n", True, SudoRequired),
        (1, "alice is not in the sudoers file.\n", True, SudoRequired),
        (1, "sudo: pct: command not found\n", True, PctNotFound),
        (127, "bash: line 1: sudo: command not found\n", True, SudoRequired),
    ],
)
def test_classify_by_text(code, stderr, sudo, expected):
    err = classify(_res(code, stderr), 200, "pve1", sudo=sudo)
    assert type(err) is expected
    assert err.fix


@pytest.mark.parametrize(
    "code, stderr",
    [
        (0, "container '200' not running!\n"),  # success is never an error
        (1, "some command failed\n"),  # the command's own failure
        (255, "container '201' not running!\n"),  # about another container (the command printed it)
        (42, "Configuration file 'nodes/pve1/lxc/999.conf' does not exist\n"),
        (127, "bash: line 1: uv: command not found\n"),  # missing in the container, not pct
    ],
)
def test_classify_leaves_command_failures_alone(code, stderr):
    assert classify(_res(code, stderr), 200, "pve1") is None


def test_classify_uses_the_tail_when_stderr_was_streamed():
    res = Result(["pct"], 255, b"", b"", "t", stderr_tail=b"container '200' not running!\n")
    assert isinstance(classify(res, 200, "pve1"), ContainerStopped)


# --------------------------------------------------------------------------------- end to end (real sshd)


def host_of(pct: PctTransport) -> PveHost:
    """The host-side pct verbs of the container `pct` runs in (what doctor asks the host)."""
    return PveHost(pct.parent, pct.ctid, pct=pct.pct, sudo=pct.sudo)


@pytest.fixture(scope="module")
def ct(fake_pve):
    return fake_pve.create_container(210, gpus=2)


@pytest.fixture
def pct(fake_pve, ct):
    if not ct.running:
        ct.start()
    transport = fake_pve.pct_transport(ct.ctid)
    yield transport
    transport.close()


def test_hostile_strings_arrive_byte_exact_through_ssh_and_pct(pct, fake_pve):
    fake_pve.clear_pct_calls()
    res = pct.run(["python3", "-c", PRINT_ARGV, *HOSTILE])
    assert res.exit_code == 0, res.describe()
    assert json.loads(res.stdout) == HOSTILE
    # One pct call, and pct saw each element as one argv entry (the host shell split it exactly once).
    calls = fake_pve.pct_calls()
    assert len(calls) == 1
    assert calls[0][-len(HOSTILE):] == HOSTILE


@pytest.mark.parametrize("code", [0, 1, 42])
def test_exit_codes_pass_through(pct, code):
    res = pct.run(["sh", "-c", f"echo out; echo err >&2; exit {code}"])
    assert (res.exit_code, res.stdout, res.stderr) == (code, b"out\n", b"err\n")


def test_signal_death_is_128_plus_signo(pct):
    assert pct.run(["sh", "-c", "kill -KILL $$"]).exit_code == 137


def test_command_not_found_inside_is_a_result_not_pct_not_found(pct):
    res = pct.run(["no-such-program-xyz"])
    assert res.exit_code == 127


def test_stdin_reaches_the_command(pct):
    data = bytes(range(256)) * 1000
    res = pct.run(["python3", "-c", "import sys; d=sys.stdin.buffer.read(); sys.stdout.write(str(len(d)))"],
                  stdin=data)
    assert res.stdout == str(len(data)).encode()


def test_ten_mb_on_both_streams_through_pct(pct):
    script = ("import sys\nfor _ in range(160):\n sys.stdout.buffer.write(b'o'*65536)\n"
              " sys.stderr.buffer.write(b'e'*65536)\n")
    res = pct.run(["python3", "-c", script], timeout=120)
    assert res.exit_code == 0
    assert (len(res.stdout), len(res.stderr)) == (160 * 65536, 160 * 65536)
    assert set(res.stdout) == {ord("o")} and set(res.stderr) == {ord("e")}


def test_environment_is_clean_inside(pct):
    # --keep-env 0: the SSH session's variables (FAKE_PVE_BASE, HOME) must not leak in.
    env = dict(line.split("=", 1) for line in pct.run(["env"]).text().splitlines())
    assert "FAKE_PVE_BASE" not in env and "HOME" not in env
    assert env["container"] == "lxc"


def test_stopped_container_is_a_typed_error(fake_pve, ct, pct):
    ct.stop()
    with pytest.raises(ContainerStopped) as info:
        pct.run(["true"])
    text = str(info.value)
    assert "container 210" in text and "not running" in text and "pct start 210" in text
    assert info.value.result.exit_code == 255
    assert host_of(pct).status() == "stopped"
    ct.start()
    assert host_of(pct).status() == "running"
    assert pct.run(["true"]).exit_code == 0


def test_missing_container_is_a_typed_error(fake_pve):
    transport = fake_pve.pct_transport(999)
    try:
        with pytest.raises(ContainerMissing) as info:
            transport.run(["true"])
        text = str(info.value)
        assert "container 999 does not exist" in text and f"nodes/{fake_pve.node}/lxc/999.conf" in text
        with pytest.raises(ContainerMissing):
            host_of(transport).status()
    finally:
        transport.close()


def test_pct_not_found_is_a_typed_error(fake_pve):
    transport = fake_pve.pct_transport(210, pct="not-pct")
    try:
        with pytest.raises(PctNotFound, match="not-pct"):
            transport.run(["true"])
    finally:
        transport.close()


def test_sudo_without_sudo_on_the_host_is_a_typed_error(fake_pve):
    import shutil

    transport = fake_pve.pct_transport(210, sudo=True)
    try:
        if shutil.which("sudo") is None:
            with pytest.raises(SudoRequired, match="has no sudo"):
                transport.run(["true"])
        else:  # root with sudo installed: `sudo -n pct` just works
            assert transport.run(["true"]).exit_code == 0
            assert fake_pve.pct_calls()[-1][:2] == ["pct", "exec"]
    finally:
        transport.close()


def test_pct_config_shows_gpu_devices(pct):
    conf = host_of(pct).config()
    assert conf["dev0"] == "/dev/nvidia0" and conf["dev1"] == "/dev/nvidia1"
    assert conf["hostname"] == "ct210"


def test_pct_command_failure_is_pct_error(pct, ct):
    assert host_of(pct).status() == "running"
    with pytest.raises(PctError, match="start 210"):
        host_of(pct).pct_command("start")  # CT 210 already running
