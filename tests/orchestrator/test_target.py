"""orchestrator.target: open_target from the inventory, the attach argv each target builds, an agent call that
ends without a result, abort() cutting a call in progress, and the environment a container's commands get.
Real subprocesses, and containers of the fake Proxmox host (real sshd, pct stand-in). The typed event stream
of an agent call: tests/orchestrator/agent/test_events.py; the bundle's trip into a container:
tests/orchestrator/test_bundle.py; attach end to end on a terminal: tests/orchestrator/ops/test_attach.py."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from orchestrator.errors import AgentError, ConnectError
from orchestrator.target import CONTAINER_PATH, ContainerTarget, LocalTarget, tmux_attach_argv
from orchestrator.transport.local import LocalTransport
from orchestrator.transport.pct import PctTransport
from orchestrator.transport.ssh import SSHTransport


# ------------------------------------------------------------------------------------------- open_target


def _local_inventory(tmp_path: Path, workdir: str, venv: str = "workstation"):
    from orchestrator.inventory import parse_inventory

    return parse_inventory(
        f"targets:\n  here: {{kind: local, workdir: '{workdir}', venv: {venv}}}\n"
        "venvs:\n  workstation: {kind: workstation}\n  cpu: {kind: uv, lock: cpu}\n"
    )


def test_open_target_local_creates_the_workdir_and_uses_this_interpreter(tmp_path):
    from orchestrator.target import LocalTarget, open_target

    target = open_target(_local_inventory(tmp_path, str(tmp_path / "a" / "b")), "here")
    assert isinstance(target, LocalTarget)
    assert Path(target.workdir).is_dir() and target.workdir == str(tmp_path / "a" / "b")
    assert target.python == sys.executable
    assert target.agent("echo")["python"] == sys.executable


def test_open_target_local_uv_profile_uses_the_current_venv(tmp_path):
    from orchestrator.target import open_target

    inv = _local_inventory(tmp_path, str(tmp_path / "w"), venv="cpu")
    assert open_target(inv, "here").python == sys.executable  # no venv built yet
    bindir = tmp_path / "w" / "venvs" / "v1" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").symlink_to(sys.executable)
    (tmp_path / "w" / "venvs" / "current").symlink_to("v1")
    assert open_target(inv, "here").python == str(tmp_path / "w" / "venvs" / "current" / "bin" / "python")


def test_open_target_local_unusable_workdir(tmp_path):
    from orchestrator.errors import UserError
    from orchestrator.target import open_target

    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=r"cannot create the workdir .*file/sub.* of target 'here'"):
        open_target(_local_inventory(tmp_path, str(tmp_path / "file" / "sub")), "here")


# ------------------------------------------------------------------------------------------- attach argv


def test_attach_argv_local_and_container_golden():
    assert tmux_attach_argv("dflash-x") == ["tmux", "attach-session", "-t", "=dflash-x"]
    assert tmux_attach_argv("dflash-x", read_only=True) == ["tmux", "attach-session", "-r", "-t", "=dflash-x"]
    ssh = SSHTransport("pve1.lan", port=2222, user="root", identity_file="/k/id", known_hosts="/k/kh")
    ct = ContainerTarget(name="ct", workdir="/w", transport=PctTransport(ssh, 200))
    ct.env = lambda: {"HOME": "/root", "PATH": "/usr/bin:/bin"}  # the golden line below, short
    argv = ct.attach_argv("dflash-exp", read_only=True)  # builds the argv; connects to nothing
    assert argv[:-1] == ["ssh", "-t", "-p", "2222", "-i", "/k/id", "-o", "IdentitiesOnly=yes",
                         "-o", "UserKnownHostsFile=/k/kh", "-o", "StrictHostKeyChecking=yes", "root@pve1.lan"]
    term = argv[-1].split("TERM=", 1)[1].split()[0]
    assert argv[-1] == (f"pct exec 200 --keep-env 0 -- env -i HOME=/root PATH=/usr/bin:/bin TERM={term} "
                        "tmux attach-session -r -t =dflash-exp")


def test_attach_builds_the_argv_from_a_container_target(fake_pve):
    t = ContainerTarget(name="ct", workdir="/w", transport=fake_pve.pct_transport(200))
    argv = t.attach_argv("dflash-e")
    assert argv[-2] == f"{fake_pve.user}@{fake_pve.hostname}" and "StrictHostKeyChecking=yes" in argv
    assert f"UserKnownHostsFile={fake_pve.known_hosts}" in argv and argv[-1].startswith("pct exec 200 --keep-env 0 -- env -i HOME=/root")


def test_inside_tmux_a_local_attach_switches_the_client(monkeypatch, tmp_path):
    t = LocalTarget(name="here", workdir=str(tmp_path), transport=LocalTransport())
    monkeypatch.delenv("TMUX", raising=False)
    assert t.attach_argv("dflash-e") == ["tmux", "attach-session", "-t", "=dflash-e"]
    monkeypatch.setenv("TMUX", "/tmp/tmux-0/default,123,0")  # tmux refuses to nest a client in a client
    assert t.attach_argv("dflash-e") == ["tmux", "switch-client", "-t", "=dflash-e"]
    assert t.attach_argv("dflash-e", read_only=True) == ["tmux", "attach-session", "-r", "-t", "=dflash-e"]


# ------------------------------------------------------------------------------------------- agent calls


def test_an_agent_that_dies_without_a_result_is_named_with_its_exit_and_last_words(tmp_path):
    # What a broken interpreter, a killed agent or an import error at start-up looks like from here.
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\ncat > /dev/null\nfor i in 1 2 3 4 5 6 7; do echo \"[rank0]: line $i\" >&2; done\nexit 3\n")
    python.chmod(0o755)
    t = LocalTarget(name="here", workdir=str(tmp_path), transport=LocalTransport(), python=str(python))
    with pytest.raises(AgentError) as info:
        t.agent("ping")
    assert info.value.agent_type == "AgentDied"
    assert info.value.message == ("agent ping on here ended (exit 3) without a result: "
                                  "[rank0]: line 3 | [rank0]: line 4 | [rank0]: line 5 | [rank0]: line 6 | [rank0]: line 7")


def test_commands_in_a_container_get_the_container_environment_only(pve, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_WORKSTATION_ONLY", "1")  # nothing of this process may leak in
    pve.create_container(342, gpus=0)
    t = ContainerTarget(name="ct", workdir="/root/dflash", transport=pve.pct_transport(342))
    try:
        res = t.run(["env"])
    finally:
        t.close()
        pve.remove_container(342)
    assert res.exit_code == 0, res.stderr
    assert sorted(res.stdout.decode().splitlines()) == sorted(
        ["HOME=/root", f"PATH={CONTAINER_PATH}", "LANG=C.UTF-8", "LC_ALL=C.UTF-8"])


def test_abort_cuts_a_call_in_progress_and_the_next_call_reconnects(pve):
    # ops/logs' watchdog calls abort() from another thread when a follow goes silent: the blocked call must end
    # (as a lost connection, which the follow reconnects from), and the target must stay usable.
    pve.create_container(343, gpus=0)
    t = ContainerTarget(name="ct", workdir="/root/dflash", transport=pve.pct_transport(343))
    outcome: list = []

    def blocked() -> None:
        try:
            outcome.append(t.run(["sleep", "600"]))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    try:
        call = threading.Thread(target=blocked, daemon=True)
        call.start()
        for _ in range(600):  # until the exec is running inside: its pct call is logged
            if any("sleep" in c for c in pve.pct_exec_calls(343)) or not call.is_alive():
                break
            call.join(0.1)
        assert call.is_alive(), outcome
        t.abort()
        call.join(60)
        assert not call.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], ConnectError), outcome
        assert t.run(["echo", "again"]).stdout == b"again\n"
    finally:
        t.close()
        pve.remove_container(343)


def test_a_local_agent_call_runs_through_the_targets_own_transport(tmp_path):
    # No second path for the local target: the agent call is the transport's start and finish, with the
    # environment the transport was made with (open_target's local_env).
    class Counting(LocalTransport):
        def __init__(self):
            super().__init__()
            self.started: list[list[str]] = []

        def start(self, argv):
            self.started.append(list(argv))
            return super().start(argv)

    transport = Counting()
    t = LocalTarget(name="here", workdir=str(tmp_path), transport=transport)
    answer = t.agent("echo", {"x": 1})
    assert answer["request"]["x"] == 1 and answer["python"] == sys.executable
    assert transport.started == [[sys.executable, "-m", "orchestrator.agent", "echo"]]


def test_a_container_targets_host_verbs_and_their_printed_lines(pve):
    # What doctor asks the host, and prints as fixes, is the target's `host` (transport.pvehost.PveHost).
    from orchestrator.inventory import parse_inventory
    from orchestrator.target import open_target

    pve.create_container(343, gpus=1)
    inv = parse_inventory("hosts:\n  pve: " + __import__("json").dumps(pve.host_entry()) + "\n"
                          "targets:\n  ct: {kind: container, host: pve, ctid: 343, venv: sys}\n"
                          "venvs:\n  sys: {kind: system}\n")
    t = open_target(inv, "ct")
    try:
        assert t.host.status() == "running" and t.host.config()["dev0"] == "/dev/nvidia0"
        assert t.host.words("status") == "pct status 343"
        start = t.host.line("start")
        assert start.startswith("ssh ") and start.endswith(" pct start 343")
        assert t.host.list_line().endswith(" pct list") and t.host.host_line(["true"]).endswith(" true")
    finally:
        t.close()
        pve.remove_container(343)
