"""attach (orchestrator.ops.attach): which session and which target a run or an experiment name leads to, what
the user reads when it leads nowhere, and the command itself on a real terminal: the installed `dflashctl
attach` on a pty reaches the tmux session inside a container of the fake Proxmox host (real sshd, real
OpenSSH client, pct stand-in, real tmux), and so does the argv it executes when pasted into a shell."""

from __future__ import annotations

import fcntl
import os
import pty
import shutil
import struct
import subprocess
import termios
import threading
import time
from pathlib import Path

import pytest
import yaml

from orchestrator import records
from orchestrator.errors import RunNotFound, UserError
from orchestrator.inventory import load_inventory
from orchestrator.ops.attach import attach_command, exec_attach, session_for
from orchestrator.quoting import render

pytestmark = pytest.mark.usefixtures("isolated_tmux")  # own run records (DFLASHCTL_STATE_DIR) per test


def inventory(tmp_path: Path, host: dict | None = None, ctid: int = 341) -> Path:
    """Targets `local` (the default) and, with `host`, the container `ct` on it; experiments `att` on ct and
    `loc` on local."""
    targets = {"local": {"kind": "local", "workdir": str(tmp_path / "work"), "venv": "ws"}}
    if host is not None:
        targets["ct"] = {"kind": "container", "host": "pve", "ctid": ctid, "workdir": "/root/dflash", "venv": "sys"}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump({
        **({"hosts": {"pve": host}} if host else {}),
        "targets": targets,
        "venvs": {"ws": {"kind": "workstation"}, "sys": {"kind": "system"}},
        "experiments": {"att": {"kind": "command", "target": "ct" if host else "local", "command": ["true"]},
                        "loc": {"kind": "command", "target": "local", "command": ["true"]}},
    }))
    return path


def test_an_experiment_of_the_inventory_leads_to_its_session_on_its_target(tmp_path):
    inv = load_inventory(inventory(tmp_path))
    assert session_for("loc", inv) == ("dflash-loc", "loc", "local")
    assert attach_command(inv, "loc", read_only=True) == ["tmux", "attach-session", "-r", "-t", "=dflash-loc"]


def test_a_recorded_run_leads_to_its_own_experiment_and_target_and_node(tmp_path):
    path = inventory(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["hosts"] = {"pve": {"ssh": "pve.lan"}}
    data["targets"].update({t: {"kind": "container", "host": "pve", "ctid": i, "venv": "sys"}
                            for i, t in ((200, "ct200"), (201, "ct201"))})
    path.write_text(yaml.safe_dump(data))
    inv = load_inventory(path)
    records.append_record({"run_id": "exp.v2-20261201T100000Z", "experiment": "exp.v2", "target": "local"})
    records.append_record({"run_id": "two-20261201T100000Z", "experiment": "two", "target": "ct200",
                           "nodes": [{"target": "ct200"}, {"target": "ct201"}]})
    assert session_for("exp.v2-20261201T100000Z", inv) == ("dflash-exp_v2", "exp.v2", "local")
    assert session_for("two-20261201T100000Z", inv) == ("dflash-two", "two", "ct200")
    assert session_for("two-20261201T100000Z", inv, node=1) == ("dflash-two", "two", "ct201")
    with pytest.raises(UserError) as info:
        session_for("two-20261201T100000Z", inv, node=2)
    assert "runs on 2 node(s): there is no node 2" in info.value.message
    assert info.value.fix == "dflashctl attach two-20261201T100000Z --node N with N from 0 to 1"
    with pytest.raises(UserError, match="there is no node 1"):
        session_for("exp.v2-20261201T100000Z", inv, node=1)  # a run on one target has node 0 only


def test_neither_a_run_nor_an_experiment_and_a_bad_name_are_refused_before_any_connection(tmp_path):
    inv = load_inventory(inventory(tmp_path))
    with pytest.raises(RunNotFound, match="no run 'nothing-1'"):
        attach_command(inv, "nothing-1")
    with pytest.raises(UserError, match="run id or experiment"):
        attach_command(inv, "../loc")
    assert not (tmp_path / "work").exists()  # no target was opened (a local one makes its workdir)


def test_a_missing_client_program_is_named_with_its_package(tmp_path, monkeypatch):
    with monkeypatch.context() as m, pytest.raises(UserError) as info:  # PATH back before the fixtures' teardown
        m.setenv("PATH", str(tmp_path))
        exec_attach(["ssh", "-t", "root@pve1", "pct exec 200 -- tmux attach-session -t =dflash-x"])
    assert info.value.message == "`ssh` is not installed on this machine"
    assert info.value.fix == "install ssh (apt-get install -y openssh-client)"


def attach_on_a_pty(argv: list[str], ct, session: str, env: dict) -> None:
    """Run `argv` on a pty as a terminal would: it must reach `session` in container `ct` (a tmux client
    appears there), and end with exit 0 when that client is detached."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    shown = bytearray()  # what the terminal showed: read all along, so the client never blocks on a full pty

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every process on the pty is gone
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def clients() -> str:
        return ct.exec(["tmux", "list-clients", "-t", "=" + session]).stdout.decode().strip()

    try:
        deadline = time.monotonic() + 60
        while not clients() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None and clients(), shown.decode(errors="replace")[-2000:]
        assert ct.exec(["tmux", "detach-client", "-s", "=" + session]).returncode == 0
        assert proc.wait(timeout=60) == 0, shown.decode(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        reader.join(10)


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_attach_reaches_the_session_inside_a_container_from_the_cli_and_as_pasted(pve, tmp_path):
    ct = pve.create_container(341, gpus=0)
    try:
        inv_path = inventory(tmp_path, pve.host_entry(), 341)
        made = ct.exec(["tmux", "new-session", "-d", "-s", "dflash-att", "sleep 600"])
        assert made.returncode == 0, made.stderr
        env = {**os.environ, "TERM": "xterm", "COLUMNS": "200"}
        env.pop("TMUX", None)
        exe = shutil.which("dflashctl")
        assert exe, "the dflashctl console script is not on PATH: pip install -e . (see .ci/run)"
        repo = str(Path(__file__).resolve().parents[3])
        attach_on_a_pty([exe, "-i", str(inv_path), "attach", "att", "--read-only"], ct, "dflash-att",
                        {**env, "PYTHONPATH": repo})
        argv = attach_command(load_inventory(inv_path), "att", read_only=True)
        assert argv[0] == "ssh" and "-t" in argv
        attach_on_a_pty(["bash", "-c", render(argv)], ct, "dflash-att", env)  # the argv, pasted as one line
    finally:
        pve.remove_container(341)
