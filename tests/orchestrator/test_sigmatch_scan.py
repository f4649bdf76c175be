"""The matcher's line scanning, exactly: the fields of a line event, the line numbers `scan_chunk` counts
(a last line without a newline, an empty block, a block that opens with a traceback's blank line), bytes
that are not UTF-8, and the traceback grouping limits (blank lines between chained tracebacks, the
message continuation cap, tab-indented frames, interleaved lines of another rank).

Each test drives orchestrator.sigmatch.Matcher with the shipped catalogue and checks exact values; every one
was checked to fail on the mutant of tests/mutation/run.py's "signatures (line scanning)" row it names."""

from __future__ import annotations

import pytest

from orchestrator.sigmatch import _MAX_MESSAGE_LINES, Matcher
from orchestrator.signatures import TRACEBACK_HEADER, UNCLASSIFIED, load_catalogue

OOM = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
FRAME = '  File "/opt/train.py", line 12, in step'
MARKER = "During handling of the above exception, another exception occurred:"


@pytest.fixture(scope="module")
def catalogue():
    return load_catalogue()


def feed(catalogue, lines: list[str]) -> list:
    m = Matcher(catalogue)
    out = []
    for line in lines:
        out.extend(m.feed_line(line))
    return out + m.finish()


def scan(catalogue, *chunks: bytes) -> tuple[list, Matcher]:
    m = Matcher(catalogue)
    out = []
    for chunk in chunks:
        out.extend(m.scan_chunk(chunk))
    return out + m.finish(), m


def test_a_line_event_carries_its_line_its_text_and_the_other_ids_it_matched(catalogue):
    line = "RuntimeError: CUDA out of memory; NCCL error in the same line"
    (ev,) = feed(catalogue, ["step 1", line])
    assert (ev.signature, ev.kind, ev.line_no, ev.end_line_no) == ("cuda-oom", "line", 2, 2)
    assert ev.text == line and ev.lines == [line]
    assert ev.also == ["nccl-error"]


def test_the_last_line_without_a_newline_is_matched_whole_and_counted(catalogue):
    (ev,), m = scan(catalogue, b"step 1\n" + OOM.encode())
    assert (ev.signature, ev.line_no, ev.text) == ("cuda-oom", 2, OOM)
    # A last line with no hit is counted too: the matcher has read three lines.
    _, m = scan(catalogue, b"a\nb\nc")
    assert m.line_no == 3
    _, m = scan(catalogue, b"a\nb\nc\n")
    assert m.line_no == 3


def test_an_empty_block_counts_no_line(catalogue):
    events, m = scan(catalogue, b"a\n", b"", b"", OOM.encode() + b"\n")
    assert m.line_no == 2
    assert [(e.signature, e.line_no) for e in events] == [("cuda-oom", 2)]


def test_a_block_that_opens_with_a_blank_line_of_an_open_traceback(catalogue):
    first = f"{TRACEBACK_HEADER}\n{FRAME}\nValueError: bad shape\n".encode()
    second = f"\n{OOM}\nafter\n".encode()
    events, m = scan(catalogue, first, second)
    tb, line = events
    assert (tb.kind, tb.line_no, tb.end_line_no, tb.exception) == ("traceback", 1, 4, "ValueError: bad shape")
    assert tb.lines == [TRACEBACK_HEADER, FRAME, "ValueError: bad shape", ""]
    assert (line.signature, line.kind, line.line_no, line.text) == ("cuda-oom", "line", 5, OOM)
    assert m.line_no == 6


def test_bytes_that_are_not_utf8_are_replaced_not_fatal(catalogue):
    (ev,), _ = scan(catalogue, b"ok\n" + OOM.encode() + b" \xff\xfe\n")
    assert (ev.signature, ev.line_no) == ("cuda-oom", 2)
    assert ev.text == OOM + " \ufffd\ufffd"


def test_three_blank_lines_keep_a_chained_traceback_together_four_split_it(catalogue):
    def lines(blanks_after_message: int, blanks_after_marker: int) -> list[str]:
        return ([TRACEBACK_HEADER, FRAME, "KeyError: 'a'"] + [""] * blanks_after_message + [MARKER]
                + [""] * blanks_after_marker + [TRACEBACK_HEADER, FRAME, OOM])

    (ev,) = feed(catalogue, lines(3, 3))
    assert ev.signature == "cuda-oom" and ev.kind == "traceback"
    assert ev.exceptions == ["KeyError: 'a'", OOM]
    assert (ev.line_no, ev.end_line_no) == (1, 13)
    # Only the first blank after the message and the marker are kept (later blanks are not lines of it).
    assert ev.lines == [TRACEBACK_HEADER, FRAME, "KeyError: 'a'", "", MARKER, TRACEBACK_HEADER, FRAME, OOM]

    first, second = feed(catalogue, lines(4, 1))
    assert (first.signature, first.line_no, first.end_line_no) == (UNCLASSIFIED, 1, 4)
    assert first.exceptions == ["KeyError: 'a'"]
    assert (second.signature, second.line_no, second.end_line_no) == ("cuda-oom", 10, 12)

    first, second = feed(catalogue, lines(1, 4))
    assert (first.line_no, first.end_line_no, first.exceptions) == (1, 5, ["KeyError: 'a'"])
    assert (second.line_no, second.exceptions) == (10, [OOM])


def test_a_header_after_a_gap_without_a_chain_marker_starts_a_new_traceback(catalogue):
    first, second = feed(catalogue, [TRACEBACK_HEADER, FRAME, "KeyError: 'a'", "", TRACEBACK_HEADER, FRAME, OOM])
    assert (first.line_no, first.end_line_no, first.exceptions) == (1, 4, ["KeyError: 'a'"])
    assert (second.signature, second.line_no, second.end_line_no) == ("cuda-oom", 5, 7)


def test_a_traceback_cut_off_after_a_blank_a_marker_or_a_chained_header_ends_there(catalogue):
    head = [TRACEBACK_HEADER, FRAME, "KeyError: 'a'", ""]
    (ev,) = feed(catalogue, head)
    assert (ev.end_line_no, ev.lines) == (4, head)
    (ev,) = feed(catalogue, head + [MARKER])
    assert (ev.end_line_no, ev.lines) == (5, head + [MARKER])
    (ev,) = feed(catalogue, head + [MARKER, "", TRACEBACK_HEADER])
    assert (ev.end_line_no, ev.lines) == (7, head + [MARKER, TRACEBACK_HEADER])
    assert ev.last_frame is None  # the chained traceback's frames start afresh


def test_an_exception_message_continues_for_at_most_its_cap_of_lines(catalogue):
    more = [f"detail {k}" for k in range(_MAX_MESSAGE_LINES + 1)]
    (tb,) = feed(catalogue, [TRACEBACK_HEADER, FRAME, "ValueError: long message"] + more)
    assert (tb.line_no, tb.end_line_no) == (1, 3 + _MAX_MESSAGE_LINES)
    assert tb.lines == [TRACEBACK_HEADER, FRAME, "ValueError: long message"] + more[:_MAX_MESSAGE_LINES]
    # The line past the cap is a line of its own: a hit there is a line event.
    tb, line = feed(catalogue, [TRACEBACK_HEADER, FRAME, "ValueError: long message"] + more[:-1] + [OOM])
    assert tb.end_line_no == 3 + _MAX_MESSAGE_LINES and tb.signature == UNCLASSIFIED
    assert (line.signature, line.kind, line.line_no) == ("cuda-oom", "line", 4 + _MAX_MESSAGE_LINES)


def test_tab_indented_frames_are_frames(catalogue):
    (ev,) = feed(catalogue, [TRACEBACK_HEADER, '\tFile "/opt/a.py", line 3, in main', "\t  main()",
                             '\tFile "/opt/b.py", line 9, in step', OOM])
    assert ev.exceptions == [OOM] and ev.signature == "cuda-oom"
    assert (ev.last_frame.file, ev.last_frame.line, ev.last_frame.function) == ("/opt/b.py", 9, "step")


def test_a_hit_on_another_ranks_line_inside_a_tagged_traceback_is_its_own_event(catalogue):
    events = feed(catalogue, [f"[rank0]: {TRACEBACK_HEADER}", f"[rank0]: {FRAME}", f"[rank1]: {OOM}",
                              "[rank1]: nothing to see", "[rank0]: ValueError: bad shape"])
    line, tb = events
    assert (line.signature, line.kind, line.line_no, line.text) == ("cuda-oom", "line", 3, f"[rank1]: {OOM}")
    assert (tb.kind, tb.signature, tb.line_no, tb.end_line_no) == ("traceback", UNCLASSIFIED, 1, 5)
    assert tb.exceptions == ["ValueError: bad shape"]


def test_a_glued_prefix_that_is_not_a_tag_is_dropped_after_the_header(catalogue):
    # "it 7/9]" ends like a tag but the next line does not repeat it: it was text glued before the header.
    # Had the prefix been kept, a later line starting with the same text would lose it.
    (ev,) = feed(catalogue, [f"it 7/9]{TRACEBACK_HEADER}", FRAME, "it 7/9]Error: glued"])
    assert ev.exceptions == ["it 7/9]Error: glued"]
    assert ev.lines == [f"it 7/9]{TRACEBACK_HEADER}", FRAME, "it 7/9]Error: glued"]
    # Whatever the dropped prefix is replaced with must match no later line: not even one of letters only.
    (ev,) = feed(catalogue, [f"it 7/9]{TRACEBACK_HEADER}", FRAME, "XXXXError: glued"])
    assert ev.exceptions == ["XXXXError: glued"]
