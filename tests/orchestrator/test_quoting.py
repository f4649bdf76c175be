"""The one quoting function: golden strings, and a round trip through a real POSIX shell."""

import json
import shlex
import subprocess
import sys

import pytest

from fakehost.strings import HOSTILE, PRINT_ARGV
from orchestrator.quoting import render, with_env



@pytest.mark.parametrize(
    "argv, expected",
    [
        (["echo", "hi"], "echo hi"),
        (["echo", "a b"], "echo 'a b'"),
        (["echo", "it's"], "echo 'it'\"'\"'s'"),
        (["echo", ""], "echo ''"),
        (["echo", "$(id)"], "echo '$(id)'"),
        (["echo", "*"], "echo '*'"),
        (["ls", "-la"], "ls -la"),
        (["printf", "%s\n", "x"], "printf '%s\n' x"),
    ],
)
def test_render_golden(argv, expected):
    assert render(argv) == expected


def test_render_splits_back_into_the_same_argv():
    argv = ["python3", "-c", "x", *HOSTILE]
    assert shlex.split(render(argv)) == argv


def test_render_round_trips_through_a_real_shell():
    # /bin/sh parses the rendered line exactly once, as the SSH server's login shell does.
    argv = [sys.executable, "-c", PRINT_ARGV, *HOSTILE]
    out = subprocess.run(["/bin/sh", "-c", render(argv)], capture_output=True, check=True).stdout
    assert json.loads(out) == HOSTILE


@pytest.mark.parametrize("bad, what", [([], "empty argv"), (["a\x00b"], "NUL"), (["echo", 3], "must be str")])
def test_render_refuses_what_no_shell_can_carry(bad, what):
    with pytest.raises(ValueError, match=what):
        render(bad)


def test_with_env_golden():
    assert with_env({"HOME": "/root", "A": "x y"}, ["true"]) == ["env", "-i", "HOME=/root", "A=x y", "true"]
    assert with_env({"A": "1"}, ["true"], clear=False) == ["env", "A=1", "true"]
    assert render(with_env({"A": "$(id)"}, ["true"])) == "env -i 'A=$(id)' true"


@pytest.mark.parametrize("key", ["", "A=B", "1A", "A-B", "A B"])
def test_with_env_refuses_bad_names(key):
    with pytest.raises(ValueError, match="bad environment variable name"):
        with_env({key: "v"}, ["true"])


@pytest.mark.parametrize("key", ["_A", "A_B", "_", "a1", "__x__"])
def test_with_env_accepts_every_shell_variable_name(key):
    assert with_env({key: "v"}, ["true"]) == ["env", "-i", f"{key}=v", "true"]


def test_each_refusal_says_what_and_where():
    """The exact texts a user reads when a command line cannot be built (fast: the mutation run's selection)."""
    from orchestrator.quoting import check_argv

    with pytest.raises(ValueError) as info:
        check_argv([])
    assert str(info.value) == "empty argv"
    with pytest.raises(ValueError) as info:
        check_argv(["echo", 3])
    assert str(info.value) == "argv elements must be str, got int: 3"
    with pytest.raises(ValueError) as info:
        check_argv(["echo", "a\x00b"])
    assert str(info.value) == ("argv element 1 contains a NUL byte, which no command line can carry: 'a\\x00b' "
                               "(pass such data on stdin or in a file)")


@pytest.mark.parametrize("argv, expected", [
    (["echo", "a b", "it's", ""], "echo 'a b' 'it'\"'\"'s' ''"),  # no control character: render's quoting
    (["printf", "a b\n"], "printf $'a b\\n'"),  # a space stays a space inside $'...'
    (["x", "\t\r\\'\x1b\x7f\x1f "], "x $'\\t\\r\\\\\\'\\x1b\\x7f\\x1f '"),
    (["x", "a\x7fb"], "x $'a\\x7fb'"),  # DEL alone (0x7F, above the < 0x20 range) is a control character too
])
def test_render_line_golden(argv, expected):
    from orchestrator.quoting import render_line

    assert render_line(argv) == expected
