"""LocalTransport (orchestrator.transport.local): the local target's commands run as real subprocesses, no
shell: every argv element arrives byte-exact, stdin reaches the command, both streams drain at once, exit
codes read like a shell's, and a timeout takes the command's whole process group with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fakehost.strings import HOSTILE, PRINT_ARGV
from orchestrator.transport.base import CommandTimeout
from orchestrator.transport.local import LocalTransport

BRACKETS = ["[localhost]:2222", "[rank0]: x", "filenames=[f]", "[bold]x[/]", "it's \"quoted\" [a-z]*"]


def test_every_text_arrives_byte_exact_as_one_argv_element():
    texts = [*HOSTILE, *BRACKETS]
    res = LocalTransport().run([sys.executable, "-c", PRINT_ARGV, *texts])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout) == texts


def test_the_pasteable_command_line_runs_the_same_argv_in_a_shell():
    # command_line is what a fix prints for the local target: pasted into a shell, the same argv arrives.
    texts = [*HOSTILE, *BRACKETS]
    line = LocalTransport().command_line([sys.executable, "-c", PRINT_ARGV, *texts])
    out = subprocess.run(["bash", "-c", line], capture_output=True, check=True).stdout
    assert json.loads(out) == texts


def test_stdin_reaches_the_command_and_is_closed_after_it():
    data = bytes(range(256)) * 4096  # 1 MiB, every byte value
    res = LocalTransport().run(["sh", "-c", "cat; echo end"], stdin=data)  # `cat` returns only at EOF
    assert res.exit_code == 0 and res.stdout == data + b"end\n"


def test_both_streams_drain_at_once_and_a_callback_gets_stdout_in_order():
    # 4 MiB on each stream, written alternately: a transport reading one pipe to its end first would block
    # the writer on the other pipe (64 KiB) forever.
    code = ("import sys\nfor i in range(64):\n    sys.stdout.write(str(i % 10) * 65536); sys.stdout.flush()\n"
            "    sys.stderr.write('e' * 65536); sys.stderr.flush()\n")
    chunks: list[bytes] = []
    res = LocalTransport().run([sys.executable, "-c", code], on_stdout=chunks.append, timeout=120)
    assert res.exit_code == 0
    assert b"".join(chunks) == b"".join(str(i % 10).encode() * 65536 for i in range(64))
    assert res.stdout == b""  # handed to the callback, not kept twice
    assert res.stderr == b"e" * (64 * 65536)
    assert res.stderr_tail == b"e" * 16384  # the bounded tail every error message quotes


def test_exit_codes_read_like_a_shells():
    t = LocalTransport()
    assert t.run(["sh", "-c", "exit 42"]).exit_code == 42
    assert t.run(["sh", "-c", "kill -KILL $$"]).exit_code == 128 + 9
    missing = t.run(["dflashctl-no-such-program", "x"])
    assert missing.exit_code == 127 and b"dflashctl-no-such-program: command not found" in missing.stderr


def test_a_nul_byte_is_refused_by_name_before_anything_runs(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match="argv element 4 contains a NUL byte"):
        LocalTransport().run(["sh", "-c", f"touch {marker}", "x", "a\x00b"])
    assert not marker.exists()


def test_env_and_cwd_are_the_commands(tmp_path):
    t = LocalTransport(env={"PATH": os.environ["PATH"], "ONLY": "[this]"}, cwd=str(tmp_path))
    res = t.run(["sh", "-c", 'printf "%s|%s|%s" "$ONLY" "$(pwd)" "${HOME-unset}"'])
    assert res.stdout.decode() == f"[this]|{tmp_path}|unset"


def _gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie waiting for its new parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_timeout_kills_the_whole_process_group_and_keeps_the_output_so_far():
    # The command starts a grandchild and waits for it: killing only the direct child would leave the
    # grandchild running (a launch's helper, a stuck `uv`), holding the target's GPUs or files.
    with pytest.raises(CommandTimeout, match="timed out after 3 s on local") as info:
        LocalTransport().run(["sh", "-c", "sleep 300 & echo $!; wait"], timeout=3)
    out = info.value.result.stdout
    assert out.strip().isdigit(), out  # kept: what the command printed before it was cut
    grandchild = int(out)
    deadline = time.monotonic() + 30
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)


def test_a_started_command_waits_for_its_stdin_and_finishes_as_run_would():
    # The early start of an agent call: the process runs before its request exists, reads it when finish
    # sends it, and the Result is what run gives.
    t = LocalTransport()
    started = t.start(["sh", "-c", "echo started; read line; echo \"got $line\"; exit 3"])
    assert started.argv[:2] == ["sh", "-c"] and started.where == "local"
    seen: list[bytes] = []
    res = t.finish(started, stdin=b"request\n", on_stdout=seen.append)
    assert res.exit_code == 3 and b"".join(seen) == b"started\ngot request\n" and res.stdout == b""


def test_a_discarded_command_reads_end_of_file_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    t = LocalTransport()
    started = t.start(["sh", "-c", f'read line || exit 0; touch "{marker}"'])
    t.discard(started)
    assert started.handle.wait(timeout=30) == 0 and not marker.exists()


def test_a_program_that_is_not_there_is_exit_127_through_start_and_finish(tmp_path):
    t = LocalTransport()
    res = t.finish(t.start([str(tmp_path / "nothing-here")]), stdin=b"x")
    assert res.exit_code == 127 and b"command not found" in res.stderr


def test_every_transport_implements_the_whole_protocol():
    # The Transport protocol is the whole contract (start/finish/discard included): each transport has
    # every method of it, so a target never asks which transport it holds.
    from orchestrator.transport.base import Transport
    from orchestrator.transport.pct import PctTransport
    from orchestrator.transport.ssh import SSHTransport

    wanted = {name for name in vars(Transport) if not name.startswith("_") and callable(getattr(Transport, name))}
    assert wanted == {"run", "start", "finish", "discard", "command_line", "close"}
    for cls in (LocalTransport, SSHTransport, PctTransport):
        assert {name for name in wanted if callable(getattr(cls, name, None))} == wanted, cls.__name__
