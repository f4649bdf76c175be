"""The tailer's offset arithmetic at its edges (orchestrator.agent.tailer): a newline at the first byte of a
65,536-byte block, files with no newline, the final read's partial tail, events capped at EVENT_BYTES, repeated
truncation. Each test kills mutants the mutation run (tests/mutation/run.py) found alive."""

from __future__ import annotations

from orchestrator.agent import tailer
from orchestrator.agent.tailer import EVENT_BYTES, LineCursor, tail_offset

BLOCK = 65536


def test_a_newline_at_the_first_byte_of_a_block_is_found(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"a" * 9 + b"\n" + b"x" * (BLOCK - 1))  # the last block starts exactly at the newline
    assert tail_offset(path, 0) == 10
    path.write_bytes(b"\n" + b"x" * BLOCK)  # the block before the last is one byte: the newline itself
    assert tail_offset(path, 0) == 1
    path.write_bytes(b"\nabc\n")
    assert tail_offset(path, 1) == 1 and tail_offset(path, 2) == 0
    path.write_bytes(b"\n" + b"y" * (BLOCK - 1) + b"\nlast\n")  # the (lines+1)-th newline is a block's first byte
    assert tail_offset(path, 2) == 1


def test_no_newline_anywhere_is_offset_zero(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"partial")
    assert tail_offset(path, 0) == 0 and tail_offset(path, 3) == 0
    path.write_bytes(b"one\ntwo\n")
    assert tail_offset(path, 5) == 0  # fewer lines than asked: from the start
    assert tail_offset(tmp_path / "missing", 3) == 0 and tail_offset(tmp_path / "missing", 0) == 0


def test_a_cursor_starts_at_zero_and_hands_out_all_whole_lines_in_one_chunk(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"a\nb\nc\npartial")
    cur = LineCursor(path)
    assert cur.read() == [(0, b"a\nb\nc\n")]
    assert cur.offset == 6


def test_the_final_read_hands_out_the_partial_tail_with_the_lines_before_it(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"a\nb")
    assert LineCursor(path).read(final=True) == [(0, b"a\nb")]
    path.write_bytes(b"ab\ncd\nef")
    cur = LineCursor(path)
    # a read cut short by its limit is not the end of the file: the line it cut stays whole
    assert cur.read(final=True, limit=4) == [(0, b"ab\n")]
    assert cur.read(final=True) == [(3, b"cd\nef")]


def test_events_are_capped_at_event_bytes_and_end_at_newlines(tmp_path):
    path = tmp_path / "log"
    line = b"z" * 99 + b"\n"
    path.write_bytes(line * (3 * EVENT_BYTES // len(line)))
    chunks = LineCursor(path).read()
    assert len(chunks) >= 3
    pos = 0
    for i, (start, data) in enumerate(chunks):
        assert start == pos and data.endswith(b"\n") and len(data) <= EVENT_BYTES
        assert i == len(chunks) - 1 or len(data) > EVENT_BYTES - len(line)  # as full as whole lines allow
        pos += len(data)
    assert pos == path.stat().st_size


def test_every_truncation_is_counted_and_a_missing_file_has_size_zero(tmp_path):
    path = tmp_path / "log"
    path.write_bytes(b"one\ntwo\n")
    cur = LineCursor(path)
    cur.read()
    for n in (1, 2):
        with open(path, "wb"):
            pass  # truncated in place
        assert cur.read() == [] and cur.truncations == n and cur.offset == 0
        path.write_bytes(b"new\n" * (n + 3))
        cur.read()
    assert LineCursor(tmp_path / "missing").size() == 0
    assert tailer.LineCursor(tmp_path / "missing").read(final=True) == []


def test_the_line_boundary_in_the_first_byte_of_the_file_is_found_by_tail_offset(tmp_path):
    # end = 65,537: the scan's last window is byte 0 alone, and that newline starts the last line.
    path = tmp_path / "log"
    path.write_bytes(b"\n" + b"x" * (BLOCK - 1) + b"\n")
    assert tail_offset(path, 1) == 1 and tail_offset(path, 2) == 0


def test_an_event_that_starts_with_an_empty_line_is_that_line_alone(tmp_path):
    # The window after a full event starts with a newline and holds no other: that newline is one event,
    # and the over-long line after it is the next (never glued onto the empty line past EVENT_BYTES).
    path = tmp_path / "log"
    first = b"a" * (EVENT_BYTES - 1) + b"\n"
    long = b"b" * (EVENT_BYTES + 10) + b"\n"
    path.write_bytes(first + b"\n" + long)
    assert LineCursor(path).read() == [(0, first), (EVENT_BYTES, b"\n"), (EVENT_BYTES + 1, long)]


def test_size_is_the_files_size_and_close_lets_go_of_the_file(tmp_path):
    import os

    path = tmp_path / "log"
    path.write_bytes(b"one\ntwo\n")
    fds = len(os.listdir("/proc/self/fd"))
    cur = LineCursor(path)
    assert cur.size() == 8 and len(os.listdir("/proc/self/fd")) == fds + 1
    assert cur.read() == [(0, b"one\ntwo\n")]
    cur.close()
    assert len(os.listdir("/proc/self/fd")) == fds  # closed, not leaked
    cur.close()  # twice is fine
    with open(path, "ab") as fh:
        fh.write(b"three\n")
    assert cur.read() == [(8, b"three\n")] and cur.size() == 14  # reopened at its offset
    cur.close()
