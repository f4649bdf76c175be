"""The trainer's one atomic write (trainer.atomic): a reader sees the old file or the new one, never a mix; a
writer killed, or failing, half-way leaves the old file and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.atomic import write_atomic, write_json, write_lines

REPO = Path(__file__).resolve().parents[2]


def test_text_bytes_json_and_lines_land_whole_and_leave_no_temporary_file(tmp_path):
    p = tmp_path / "f"
    assert write_atomic(p, "héllo") == p and p.read_bytes() == "héllo".encode()
    write_atomic(p, b"\x00\xff")
    assert p.read_bytes() == b"\x00\xff"
    write_json(p, {"a": [1]})
    assert p.read_text() == '{\n  "a": [\n    1\n  ]\n}'
    write_json(p, {"a": 1}, indent=None, end="\n")
    assert p.read_text() == '{"a": 1}\n'
    write_lines(p, (f"{i}\n" for i in range(3)))
    assert p.read_text() == "0\n1\n2\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f"]


def test_a_write_that_fails_half_way_keeps_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "f.jsonl"
    write_lines(p, ["old\n"])

    def lines():
        yield "new 1\n"
        raise RuntimeError("the producer failed")

    with pytest.raises(RuntimeError, match="the producer failed"):
        write_lines(p, lines())
    assert p.read_text() == "old\n" and sorted(x.name for x in tmp_path.iterdir()) == ["f.jsonl"]
    with pytest.raises(TypeError):
        write_json(p, {"not json": object()})
    assert p.read_text() == "old\n" and sorted(x.name for x in tmp_path.iterdir()) == ["f.jsonl"]


def test_a_writer_killed_mid_write_leaves_the_old_file_whole(tmp_path):
    """A real process SIGKILLed while streaming lines (it stops itself in the middle): the file keeps the old
    content, and only the dead writer's `.tmp-PID` is left, for trainer.faults to clear."""
    p = tmp_path / "metrics.jsonl"
    write_lines(p, ["old\n"])
    script = textwrap.dedent(f"""
        import os, signal
        from trainer.atomic import write_lines
        def lines():
            for i in range(1000):
                if i == 500:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield f"new {{i}}\\n"
        write_lines({str(p)!r}, lines())
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == -9
    assert p.read_text() == "old\n"
    left = sorted(x.name for x in tmp_path.iterdir())
    assert len(left) == 2 and left[1].startswith("metrics.jsonl.tmp-"), left
