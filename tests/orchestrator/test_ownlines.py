"""The log belongs to the run: dflashctl's own lines in train.log carry the run's mark and are never matched
against crash signatures; the command line is written quoted on ONE line."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from orchestrator import ownlines
from orchestrator.ops.diagnose import diagnose
from orchestrator.sigmatch import Matcher
from orchestrator.signatures import load_catalogue
from orchestrator.quoting import render_line

FORGED = "x\nModuleNotFoundError: No module named 'accelerate'"
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/w/train.py", line 3, in <module>',
    "    import accelerate",
    "ModuleNotFoundError: No module named 'accelerate'",
]


# ------------------------------------------------------------------------------------------- pure parts


# Prints each argument after the format as is, each ended by a NUL: an exec'd program (coreutils' printf)
# that starts in a millisecond, where a python interpreter per example took most of this file's time.
PRINTER = render_line(["/usr/bin/printf", "%s\\0"])


def _printed(out: bytes) -> list[str]:
    assert out.endswith(b"\0"), out
    return [part.decode("utf-8") for part in out[:-1].split(b"\0")]


@pytest.mark.parametrize("arg", [FORGED, "tab\there", "cr\rlf", "esc\x1b[31m", "quote's\nand \\ back", "\x7f", "é\n"])
def test_render_line_is_one_line_that_bash_splits_back(arg):
    argv = ["python3", "-c", "import sys; print(sys.argv)", arg, "plain", "a b"]
    text = render_line(argv)
    assert "\n" not in text and "\r" not in text and not any(ord(c) < 0x20 for c in text)
    out = subprocess.run(["bash", "-c", f"{PRINTER} {text}"], capture_output=True, check=True).stdout
    assert _printed(out) == argv


# Any text a shell can carry (no NUL; surrogates cannot reach a command line either).
ARG = st.text(st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=30, deadline=None)
@given(st.lists(ARG, min_size=1, max_size=4))
@example([FORGED, "it's\ta\rtab", "\x7f\x1b"])  # 30 draws from all of Unicode rarely hold a control character
def test_render_line_property_one_line_and_bash_gets_the_exact_argv(args):
    text = render_line(args)
    assert "\n" not in text and "\r" not in text
    out = subprocess.run(["bash", "-c", f"{PRINTER} {text}"], capture_output=True, check=True).stdout
    assert _printed(out) == args


@settings(max_examples=200, deadline=None)
@given(st.lists(ARG, max_size=3), st.text(max_size=200))
@example(args=[FORGED], text="ModuleNotFoundError: No module named 'accelerate'")
@example(args=[], text="Traceback (most recent call last):\n  File \"x\", line 1\nRuntimeError: CUDA out of memory.")
def test_matcher_property_our_lines_never_match_whatever_they_carry(args, text):
    mark = "0123456789abcdef"
    ours = [ownlines.line(mark, f"run r command: {render_line(['python', *args])}"),
            ownlines.line(mark, text)]
    lines = [line for chunk in ours for line in chunk.split("\n")[:-1]]
    assert len(lines) == 2  # each of ours is exactly one line, whatever it carries
    assert _events(lines, mark) == []


def test_render_line_is_shlex_join_without_control_characters():
    argv = ["bash", "-c", "echo hi; exit 0", "it's", "$(id)"]
    assert render_line(argv) == "bash -c 'echo hi; exit 0' 'it'\"'\"'s' '$(id)'"
    assert render_line(["a", FORGED]) == "a $'x\\nModuleNotFoundError: No module named \\'accelerate\\''"


def test_own_lines_are_one_line_and_recognised_by_their_mark():
    mark, other = ownlines.new_mark(), ownlines.new_mark()
    line = ownlines.line(mark, "run r command: a\nb")
    assert line.count("\n") == 1 and line.endswith("\n") and "a\\nb" in line
    assert ownlines.is_own(line.rstrip("\n"), mark)
    assert not ownlines.is_own(ownlines.line(other, "x").rstrip("\n"), mark)  # a mark of another run
    assert ownlines.is_own(ownlines.line(other, "x").rstrip("\n"), None)  # no mark known: our shape
    for trainer_line in ("[dflashctl] old style", "[dflashctl nothex0123456789] x", " [dflashctl " + mark + "] x",
                         "ModuleNotFoundError: No module named 'accelerate'"):
        assert not ownlines.is_own(trainer_line, mark) and not ownlines.is_own(trainer_line, None)


@functools.cache
def _catalogue():
    """The shipped catalogue, loaded once for the module (a Matcher only reads it): the property below makes
    200 matchers."""
    return load_catalogue()


def _events(lines: list[str], mark: str | None) -> list:
    m = Matcher(_catalogue(), mark=mark)
    out = []
    for line in lines:
        out += m.feed_line(line)
    return out + m.finish()


def test_matcher_skips_own_lines_and_still_finds_the_trainers_crash():
    mark = ownlines.new_mark()
    own = ownlines.line(mark, "run r command: " + render_line(["python", FORGED])).rstrip("\n")
    forged_alone = ownlines.prefix(mark) + "ModuleNotFoundError: No module named 'accelerate'"
    assert _events([own, forged_alone, "step 1"], mark) == []
    # the same text without our mark is the command's output: a real crash is still found
    assert [e.signature for e in _events(["step 1", *TRACEBACK], mark)] == ["missing-module"]
    # our end line closes the trainer's traceback (a new record), and is not matched itself
    ended = ownlines.line(mark, "command ended: exit code 1").rstrip("\n")
    events = _events([*TRACEBACK, ended], mark)
    assert [(e.signature, e.end_line_no) for e in events] == [("missing-module", 4)]


def test_diagnose_reads_the_mark_beside_the_log(tmp_path):
    mark = ownlines.new_mark()
    (tmp_path / "run.json").write_text(json.dumps({ownlines.RUN_JSON_KEY: mark}))
    log = tmp_path / "train.log"
    log.write_text(ownlines.line(mark, "run r command: " + render_line(["python", FORGED])) + "step 1\n"
                   + ownlines.prefix(mark) + "ModuleNotFoundError: No module named 'torch'\n")
    assert diagnose(log).signatures == []
    # a line forged with another run's mark is not ours when the run's own mark is known
    log.write_text(ownlines.prefix(ownlines.new_mark()) + "ModuleNotFoundError: No module named 'torch'\n")
    assert [s.id for s in diagnose(log).signatures] == ["missing-module"]


# ------------------------------------------------------------------------------------------- a real run


pytestmark = pytest.mark.usefixtures("isolated_tmux")


def _inventory(tmp_path: Path, argv: list[str]) -> Path:
    inv = tmp_path / "inv.yaml"
    inv.write_text(textwrap.dedent(f"""\
        targets:
          local: {{kind: local, workdir: {json.dumps(str(tmp_path / 'work'))}, venv: workstation}}
        venvs:
          workstation: {{kind: workstation}}
        experiments:
          forge: {{kind: command, target: local, command: {json.dumps(argv)}}}
        """))
    return inv


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_an_argument_cannot_forge_a_crash_in_the_follow(tmp_path, dflashctl):
    # The run fails for its own reason (exit 3, no traceback); an argument carries a newline and a fake
    # "missing accelerate". The follow must report the real outcome: failed, exit code 3, exit status 1.
    argv = [sys.executable, "-c", "import sys; print('working'); sys.exit(3)", FORGED]
    inv = _inventory(tmp_path, argv)
    assert dflashctl("--inventory", str(inv), "launch", "forge").returncode == 0
    run = next((tmp_path / "work" / "runs").iterdir())
    res = dflashctl("--inventory", str(inv), "logs", run.name, "--follow", timeout=120)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "accelerate" not in res.stderr and "missing-module" not in res.stderr
    assert f"run {run.name}: failed (exit code 3)" in res.stderr
    assert "working" in res.stdout.splitlines()
    log = (run / "train.log").read_text().splitlines()
    mark = json.loads((run / "run.json").read_text())[ownlines.RUN_JSON_KEY]
    assert log[0] == ownlines.prefix(mark) + f"run {run.name} command: " + render_line(argv)
    assert [line for line in log if not ownlines.is_own(line, mark)] == ["working"]
    assert log[-1] == ownlines.prefix(mark) + "command ended: exit code 3"
    assert dflashctl("--inventory", str(inv), "diagnose", str(run / "train.log")).returncode == 0
