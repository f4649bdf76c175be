"""Property tests of the signature matcher (orchestrator.sigmatch): a known traceback from
tests/fixtures/signatures/, placed anywhere among arbitrary healthy training output, is found exactly once,
with its own signature, at its own line, also when it is chained and when every line carries torchrun's
`[rankN]: ` tag; healthy output alone never matches. The block scanner (`diagnose`'s fast path) must agree
with the line-by-line matcher at any block size. (dflashctl's own marked lines: test_ownlines.py.)"""

from __future__ import annotations

from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from orchestrator.sigmatch import Matcher
from orchestrator.signatures import load_catalogue

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "signatures"
CATALOGUE = load_catalogue()

# (fixture, first line, exception line): the traceback as the fixture logs it, header to exception line.
TRACEBACKS = {
    "missing-module": (2, 9),
    "disk-full": (3, 27),  # three chained tracebacks ("During handling of the above exception, ...")
    "fx-tracing-race": (5, 36),
    "illegal-memory-access": (2, 6),
    "ecc-uncorrectable": (2, 12),
    "device-side-assert": (4, 14),
    "cuda-oom": (3, 13),  # logged with "[rank5]: " on every line
    "nccl-error": (2, 11),  # the same
}


def _traceback(sig_id: str) -> list[str]:
    first, last = TRACEBACKS[sig_id]
    return (FIXTURES / f"{sig_id}.log").read_text().split("\n")[first - 1:last]


# ------------------------------------------------------------------------------------ healthy output

_num = st.integers(0, 10**6)
_frac = st.floats(0, 1, allow_nan=False)
_loss = st.floats(0.0001, 20, allow_nan=False, allow_infinity=False)
_WORDS = ["saving", "checkpoint", "to", "/root/dflash/runs/r1", "epoch", "warm-up", "compiling", "drafter", "gpu",
          "data", "tokens", "done", "shard", "loaded", "resuming", "from", "step", "prompts", "held-out", "ok",
          "lr", "schedule", "cosine", "eval", "tau", "budget", "ddtree", "chain", "(cached)", "[info]", "=", ":"]

STEP = st.builds(
    "[train] step {} | epoch {} | loss {:.4f} | acc {:.3f} | tokens_per_s {} | lr {:.2e} | rss_mb {}".format,
    _num, st.integers(0, 99), _loss, _frac, _num, _frac, _num)
STEP2 = st.builds(
    "step {}/{} loss {:.4f} acc {:.3f} sim_tau {:.2f} {} tok/s lr {:.2e} peak {}MB recompiles 0".format,
    _num, _num, _loss, _frac, st.floats(1, 16), _num, _frac, _num)
GLOG = st.builds("I0611 12:{:02d}:{:02d}.{:06d} {} trainer/loop.py:{}] saved checkpoint step {}".format,
                 st.integers(0, 59), st.integers(0, 59), st.integers(0, 999999), _num, st.integers(1, 999), _num)
PROGRESS = st.lists(st.integers(0, 100), min_size=1, max_size=6).map(
    lambda ps: "\r".join(f"Map: {p:3d}%|{'#' * (p // 10):<10}| {p * 10}/1000 [00:01<00:00, 900.00 examples/s]"
                         for p in ps))
WORDS = st.lists(st.one_of(st.sampled_from(_WORDS), _num.map(str)), max_size=12).map(" ".join)
# Free text with no capital letters: no exception type, no "Traceback", no catalogue phrase can form in it.
FREE = st.text("abcdefghijklmnopqrstuvwxyz0123456789 .,:;/=_-+()[]{}'\"#%", max_size=80)
HEALTHY_LINE = st.tuples(
    st.one_of(st.none(), st.integers(0, 7)),
    st.one_of(STEP, STEP2, GLOG, PROGRESS, WORDS, FREE, st.just("")),
).map(lambda t: (f"[rank{t[0]}]: " if t[0] is not None and t[1] else "") + t[1])
HEALTHY = st.lists(HEALTHY_LINE, max_size=25)


# ------------------------------------------------------------------------------------ matching


def _stream(lines: list[str]) -> list:
    m = Matcher(CATALOGUE)
    events = []
    for line in lines:
        events.extend(m.feed_line(line))
    return events + m.finish()


def _blocks(lines: list[str], size: int) -> list:
    """The same text through scan_chunk, cut into blocks of about `size` bytes at line ends."""
    data = "".join(line + "\n" for line in lines).encode()
    m, events, start = Matcher(CATALOGUE), [], 0
    while start < len(data):
        cut = data.rfind(b"\n", start, start + size) + 1
        cut = len(data) if cut <= start else cut
        events.extend(m.scan_chunk(data[start:cut]))
        start = cut
    return events + m.finish()


def _frame_gaps(tb: list[str], prefix: str) -> list[int]:
    """Indices i where another process's line may come between tb[i-1] and tb[i]: inside the frames."""
    body = [line[len(prefix):] for line in tb]
    return [i for i in range(1, len(tb))
            if body[i][:1] == " " and (body[i - 1][:1] == " " or "Traceback (most recent" in body[i - 1])]


@st.composite
def placed_traceback(draw, sig_id=None):
    """A fixture's traceback, maybe tagged `[rankN]: ` on every line (torchrun), maybe with other ranks' healthy
    lines interleaved among its frames; returns (signature id, lines, its number of lines)."""
    sig_id = sig_id or draw(st.sampled_from(sorted(TRACEBACKS)))
    tb = _traceback(sig_id)
    rank = 5 if tb[0].startswith("[rank5]: ") else draw(st.one_of(st.none(), st.integers(0, 63)))
    if rank is None:
        return sig_id, tb
    prefix = f"[rank{rank}]: "
    if not tb[0].startswith(prefix):
        tb = [prefix + line for line in tb]
    gaps = _frame_gaps(tb, prefix)
    # Another rank's line fits anywhere among the frames; an untagged one (the launcher's own output) only once
    # a frame has shown that the tag repeats (before that, text before the header may be glued progress output).
    other_rank = st.tuples(st.integers(0, 63).filter(lambda r: r != rank), st.one_of(STEP, STEP2, WORDS, FREE)).map(
        lambda t: f"[rank{t[0]}]: {t[1]}")
    untagged = st.one_of(STEP, GLOG, st.sampled_from(["", "W0611 12:00:01.000000 7001 api.py:900] Sending SIGTERM"]))
    inserts = draw(st.lists(st.sampled_from(gaps).flatmap(
        lambda i: st.tuples(st.just(i), other_rank if i < 2 else st.one_of(other_rank, untagged))), max_size=4))
    for i, text in sorted(inserts, key=lambda t: t[0], reverse=True):
        tb.insert(i, text)
    return sig_id, tb


@settings(max_examples=100, deadline=None)
@given(placed=placed_traceback(), before=HEALTHY, after=HEALTHY, block=st.integers(16, 4096))
@example(placed=("missing-module", _traceback("missing-module")), before=[], after=["[rank1]: step 2"], block=16)
def test_a_known_traceback_anywhere_among_healthy_lines_is_found_exactly_once(placed, before, after, block):
    sig_id, tb = placed
    lines = [*before, *tb, *after]
    events = _stream(lines)
    assert [(e.signature, e.kind, e.line_no) for e in events] == [(sig_id, "traceback", len(before) + 1)]
    assert events[0].end_line_no >= len(before) + len(tb)
    assert events[0].exception and tb[-1].endswith(events[0].exception)
    tag = tb[0].split("Traceback")[0]
    last_frame = next(line for line in reversed(tb) if line.startswith(tag + '  File "'))
    assert f'File "{events[0].last_frame.file}", line {events[0].last_frame.line}, in ' in last_frame
    if sig_id == "disk-full":
        assert len(events[0].exceptions) == 3  # all three chained exceptions in the one event
    assert [e.to_dict() for e in _blocks(lines, block)] == [e.to_dict() for e in events]


@settings(max_examples=60, deadline=None)
@given(first=placed_traceback(), second=placed_traceback(), before=HEALTHY, between=HEALTHY, after=HEALTHY)
def test_two_tracebacks_are_two_events_in_order_even_back_to_back(first, second, before, between, after):
    lines = [*before, *first[1], *between, *second[1], *after]
    events = _stream(lines)
    at = [len(before) + 1, len(before) + len(first[1]) + len(between) + 1]
    assert [(e.signature, e.line_no) for e in events] == [(first[0], at[0]), (second[0], at[1])]


@settings(max_examples=100, deadline=None)
@given(lines=st.lists(HEALTHY_LINE, min_size=1, max_size=60), block=st.integers(16, 4096))
def test_healthy_lines_alone_never_match(lines, block):
    assert _stream(lines) == []
    assert _blocks(lines, block) == []
