"""Property tests of the one quoting function (orchestrator.quoting): ANY text a command
line can carry arrives byte-exact as one argv element through the local shell, through ssh (the fake host's
real sshd and its login shell) and through ssh + `pct exec`; a NUL byte, which no argv can carry, is refused
by name before anything runs. Each example is one exec carrying a whole list of strings, so the ssh and pct
properties run in seconds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fakehost.strings import HOSTILE
from orchestrator.transport.local import LocalTransport
from orchestrator.quoting import render, render_line

# Prints the exact bytes of each argument (hex of the file-system encoding): byte-exact, whatever the locale.
PRINT_BYTES = "import json, os, sys; sys.stdout.write(json.dumps([os.fsencode(a).hex() for a in sys.argv[1:]]))"
# Any text an argv element can be: every code point but NUL (and lone surrogates, which have no UTF-8 form),
# with the characters shells and bash's $'...' treat specially drawn often, so they meet in one element.
SPECIAL = "\\'\"$`!*?[]{}()~#&;|<>= -%^\t\n\r\x01\x1b\x1f\x7f\x80\u00a0\u00e9\u2028\U0001f600"
ARG = st.text(st.one_of(st.sampled_from(SPECIAL),
                        st.characters(exclude_characters="\x00", exclude_categories=("Cs",))), max_size=60)
ARGS = st.lists(st.one_of(ARG, st.sampled_from(HOSTILE)), min_size=1, max_size=12)


# The local properties' receiver: coreutils' printf, an exec'd program like python but started in a
# millisecond (180 examples here), writes each argv element after the format as is, each ended by a NUL.
PRINTF = ["/usr/bin/printf", "%s\\0"]


def _hex(args: list[str]) -> list[str]:
    return [a.encode("utf-8").hex() for a in args]


def _printed(out: bytes) -> list[str]:
    """The hex of each NUL-ended element printf wrote."""
    assert out.endswith(b"\0"), out
    return [part.hex() for part in out[:-1].split(b"\0")]


@pytest.mark.parametrize("shell", ["/bin/sh", "bash"])
@settings(max_examples=60, deadline=None)
@given(args=ARGS)
@example(args=["", "-", "--", "'", "\\'", "a\nb", "\r", "$'x'", "\x7f", "\U0001f600", "~", "!!"])
def test_any_text_through_the_local_shell_arrives_byte_exact(shell, args):
    line = render([*PRINTF, *args])
    out = subprocess.run([shell, "-c", line], capture_output=True, check=True).stdout
    assert _printed(out) == _hex(args)


@settings(max_examples=60, deadline=None)
@given(args=ARGS)
def test_any_text_through_render_line_and_bash_arrives_byte_exact(args):
    line = render_line([*PRINTF, *args])
    # ONE line a terminal shows as it is: no control character at all (C0 or DEL) survives unescaped.
    assert not any(ord(c) < 0x20 or ord(c) == 0x7F for c in line)
    out = subprocess.run(["bash", "-c", line], capture_output=True, check=True).stdout
    assert _printed(out) == _hex(args)


@pytest.fixture(scope="module")
def ssh(fake_pve):
    transport = fake_pve.ssh_transport()
    yield transport
    transport.close()


@pytest.fixture(scope="module")
def pct(fake_pve):
    fake_pve.create_container(261, gpus=0)
    transport = fake_pve.pct_transport(261)
    yield transport
    transport.close()
    fake_pve.remove_container(261)


@settings(max_examples=25, deadline=None)
@given(args=ARGS)
def test_any_text_through_ssh_arrives_byte_exact(ssh, args):
    res = ssh.run([sys.executable, "-c", PRINT_BYTES, *args], timeout=60)
    assert res.exit_code == 0, res.describe()
    assert json.loads(res.stdout) == _hex(args)


@settings(max_examples=25, deadline=None)
@given(args=ARGS)
@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_any_text_through_ssh_and_pct_exec_arrives_byte_exact(pct, args):
    # python3 of the container's PATH, under pct's reset environment (C locale): bytes still exact.
    res = pct.run(["python3", "-c", PRINT_BYTES, *args], timeout=60)
    assert res.exit_code == 0, res.describe()
    assert json.loads(res.stdout) == _hex(args)


@settings(max_examples=50, deadline=None)
@given(before=ARG, after=ARG, at=st.integers(0, 3))
def test_a_nul_byte_is_refused_by_name_before_anything_runs(fake_pve, ssh, pct, before, after, at):
    bad = before + "\x00" + after
    argv = ["echo", "a", "b", "c"]
    argv.insert(at + 1, bad)
    for build in (render, render_line):
        with pytest.raises(ValueError, match=f"argv element {at + 1} contains a NUL byte"):
            build(argv)
    with pytest.raises(ValueError, match="contains a NUL byte"):
        LocalTransport().run(argv)
    ssh_calls = ssh.calls
    fake_pve.clear_pct_calls()
    for transport in (ssh, pct):
        with pytest.raises(ValueError, match="contains a NUL byte"):
            transport.run(argv)
    assert ssh.calls == ssh_calls and fake_pve.pct_calls() == []  # refused here: no command was sent
