"""The streaming matcher: a log's lines through the crash-signature catalogue (orchestrator/signatures.py).

The matcher reads each line once. One alternation of every signature's cheap prefilter (plain literals,
mostly) plus the traceback header is searched per line; only a line that hits runs the full patterns.
`Matcher.scan_chunk` goes further for offline files: it runs that alternation over whole chunks and only
looks at the lines around hits, which is what makes `dflashctl diagnose` competitive with grep.

A Python traceback (from `Traceback (most recent call last):` through its exception line and message,
including chained tracebacks) is grouped into ONE event carrying the winning signature, the exception line
and the last frame. Lines outside tracebacks are events of their own. Matching runs on the workstation only
(diagnose, the follower), never in the agent.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from orchestrator import ownlines
from orchestrator.signatures import SEVERITY_RANK, TRACEBACK_HEADER, UNCLASSIFIED, Catalogue, Signature

_CHAIN_MARKERS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
_FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+?)\s*$')
# A prefix before the traceback header that may be a tag every line of it repeats (torchrun's "[rank5]: ",
# a glog "W0611 11:20:03.118000 5120 file.py:1370] "). It is confirmed or dropped by the next line: a
# progress bar glued to the header ends in "]" too, but the frames after it do not repeat it.
_RANK_PREFIX_RE = re.compile(r"^[^\t]{1,160}[\]:] ?$")
# A line that starts a new log record ends an exception's message continuation.
_RECORD_START_RE = re.compile(r"^(?:\d{4}-\d\d-\d\d[ T]|[IWEF]\d{4} \d\d:|\[\w+\] )")
_MAX_MESSAGE_LINES = 40
_MAX_EVENT_LINES = 400
_MAX_FOREIGN_LINES = 200


@dataclass
class Frame:
    """One `File "...", line N, in func` frame of a traceback."""

    file: str
    line: int
    function: str


@dataclass
class Match:
    """One event: a matching line, or a whole traceback (kind "traceback").

    `signature` is the winning catalogue id (UNCLASSIFIED for a traceback no entry matched); `also` lists
    the other ids matched inside the same event. Line numbers are 1-based (`\\n`-separated lines).
    """

    signature: str
    severity: str
    title: str
    kind: str
    line_no: int
    end_line_no: int
    text: str
    groups: dict[str, str] = field(default_factory=dict)
    also: list[str] = field(default_factory=list)
    exception: str | None = None
    exceptions: list[str] = field(default_factory=list)
    last_frame: Frame | None = None
    lines: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _winner(hits: Iterable[tuple[Signature, dict]]) -> tuple[Signature, dict] | None:
    best = None
    for sig, groups in hits:
        key = (SEVERITY_RANK[sig.severity], sig.priority)
        if best is None or key > best[0]:
            best = (key, sig, groups)
    return None if best is None else (best[1], best[2])


def _same_tag(seg: str, prefix: str) -> bool:
    """Whether `seg` starts with a tag of `prefix`'s shape with other numbers (`[rank3]: ` for `[rank5]: `):
    another process's line interleaved with a tagged traceback, even before its first frame confirmed the tag."""
    return re.match(re.sub(r"\d+", r"\\d+", re.escape(prefix)), seg) is not None


class _Traceback:
    """The traceback being collected (possibly several chained ones)."""

    def __init__(self, prefix: str, line_no: int, text: str):
        self.prefix = prefix
        self.line_no = line_no
        self.end_line_no = line_no
        self.lines = [text]
        self.frames: list[Frame] = []
        self.exceptions: list[str] = []
        self.hits: dict[str, tuple[Signature, dict]] = {}
        self.state = "frames"  # frames -> message -> gap -> chain -> frames ...
        self.message_lines = 0
        self.blank_run = 0
        self.confirmed = False
        self.foreign = 0

    def add(self, text: str, line_no: int) -> None:
        self.end_line_no = line_no
        if len(self.lines) < _MAX_EVENT_LINES:
            self.lines.append(text)


class Matcher:
    """Streams lines through the catalogue. Feed lines in order; call `finish()` at the end.

    dflashctl's own lines in the log (orchestrator/ownlines.py) are never matched: each ends an open
    traceback (a new record begins) and is otherwise passed over, whatever text it carries.

    Args:
        catalogue: from `load_catalogue()`.
        mark: the run's log mark (run.json `log_mark`); None: lines of our shape with any mark are ours.
            A follower learns it from the agent and sets `self.mark` before the first line.
    """

    def __init__(self, catalogue: Catalogue, mark: str | None = None):
        self.catalogue = catalogue
        self.mark = mark
        self.line_no = 0
        self._tb: _Traceback | None = None

    @property
    def busy(self) -> bool:
        """True while a traceback is open (its next lines matter even if they match nothing)."""
        return self._tb is not None

    def feed_line(self, line: str) -> list[Match]:
        """Process the next `\\n`-terminated line (the newline itself optional).

        Carriage returns split a line into segments (progress bars redraw with `\\r`); each segment is
        matched, all under the same line number.

        Returns:
            The events this line completed (usually none; a traceback completes at a later line).
        """
        self.line_no += 1
        line = line.rstrip("\n")
        if ownlines.is_own(line, self.mark):
            return self.finish()
        if "\r" not in line:
            return self._segment(line)
        out: list[Match] = []
        for seg in line.split("\r"):
            if seg:
                out.extend(self._segment(seg))
        return out

    def finish(self) -> list[Match]:
        """Close the open traceback, if any (end of file or end of run)."""
        return [self._close()] if self._tb is not None else []

    def _segment(self, seg: str) -> list[Match]:
        tb = self._tb
        if tb is None:
            if not self.catalogue.prefilter.search(seg):
                return []
            return self._idle_line(seg)
        body = seg
        if tb.prefix:
            if seg.startswith(tb.prefix):
                tb.confirmed = True
                body = seg[len(tb.prefix):]
            elif not tb.confirmed and not _same_tag(seg, tb.prefix):
                tb.prefix = ""  # not a repeated tag: text glued before the header
            elif tb.state != "frames" or tb.foreign >= _MAX_FOREIGN_LINES:
                return self._close_then(seg)  # the tagged traceback has ended
            else:
                # Another rank's (or process's) line interleaved with this traceback (before its first frame
                # too: a tag of our tag's shape): match it alone.
                tb.foreign += 1
                return self._line_event(seg) if self.catalogue.prefilter.search(seg) else []
        return self._traceback_line(tb, seg, body)

    def _idle_line(self, seg: str) -> list[Match]:
        pos = seg.find(TRACEBACK_HEADER)
        if pos >= 0:
            prefix = seg[:pos]
            if prefix and not _RANK_PREFIX_RE.match(prefix):
                prefix = ""  # glued progress-bar text, not a tag the next lines repeat
            self._tb = _Traceback(prefix, self.line_no, seg)
            return []
        return self._line_event(seg)

    def _line_event(self, seg: str) -> list[Match]:
        hits = self.catalogue.match_text(seg)
        if not hits:
            return []
        sig, groups = _winner(hits)
        return [Match(
            signature=sig.id, severity=sig.severity, title=sig.render(groups)["title"], kind="line",
            line_no=self.line_no, end_line_no=self.line_no, text=seg, groups=groups,
            also=[s.id for s, _ in hits if s.id != sig.id], lines=[seg],
        )]

    def _traceback_line(self, tb: _Traceback, seg: str, body: str) -> list[Match]:
        stripped = body.strip()
        if tb.state == "frames":
            if body[:1] in (" ", "\t") or not stripped:
                frame = _FRAME_RE.match(body)
                if frame:
                    tb.frames.append(Frame(frame["file"], int(frame["line"]), frame["function"]))
                self._absorb(tb, seg, body)
                return []
            tb.exceptions.append(stripped)  # the exception line: `Type: message`
            tb.state, tb.message_lines = "message", 0
            self._absorb(tb, seg, body)
            return []
        if tb.state == "message":
            if not stripped:
                tb.state, tb.blank_run = "gap", 1
                tb.add(seg, self.line_no)
                return []
            if TRACEBACK_HEADER in body or _RECORD_START_RE.match(body) or tb.message_lines >= _MAX_MESSAGE_LINES:
                return self._close_then(seg)
            tb.message_lines += 1
            self._absorb(tb, seg, body)
            return []
        if tb.state in ("gap", "chain"):
            if not stripped:
                tb.blank_run += 1
                if tb.blank_run > 3:
                    return self._close_then(seg)
                return []
            if tb.state == "gap" and stripped in _CHAIN_MARKERS:
                tb.state, tb.blank_run = "chain", 0
                tb.add(seg, self.line_no)
                return []
            if tb.state == "chain" and stripped == TRACEBACK_HEADER:
                tb.state = "frames"
                tb.frames = []  # the last frame reported is that of the exception that propagated
                tb.add(seg, self.line_no)
                return []
            return self._close_then(seg)
        raise AssertionError(tb.state)  # pragma: no cover

    def _absorb(self, tb: _Traceback, seg: str, body: str) -> None:
        tb.add(seg, self.line_no)
        if self.catalogue.prefilter.search(body):
            for sig, groups in self.catalogue.match_text(body):
                tb.hits.setdefault(sig.id, (sig, groups))

    def _close_then(self, seg: str) -> list[Match]:
        """Close the traceback before this line, then treat the line as a fresh one."""
        done = self._close()
        return [done] + self._segment(seg)

    def _close(self) -> Match:
        tb, self._tb = self._tb, None
        assert tb is not None
        win = _winner(tb.hits.values())
        sig, groups = win if win else (self.catalogue.get(UNCLASSIFIED), {})
        exception = tb.exceptions[-1] if tb.exceptions else None
        return Match(
            signature=sig.id, severity=sig.severity, title=sig.render(groups)["title"], kind="traceback",
            line_no=tb.line_no, end_line_no=tb.end_line_no, text=exception or tb.lines[0], groups=groups,
            also=[i for i in tb.hits if i != sig.id], exception=exception, exceptions=tb.exceptions,
            last_frame=tb.frames[-1] if tb.frames else None, lines=tb.lines,
        )

    def scan_chunk(self, data: bytes) -> list[Match]:
        """Feed a block of whole lines (`data` ends with `\\n`, or is the final block of a file).

        Equivalent to `feed_line` over every line, but runs the prefilter over the whole block and only
        decodes the lines around hits; lines that cannot match are counted, not read.

        Returns:
            The events completed within the block.
        """
        out: list[Match] = []
        pos, n, counted_to = 0, len(data), 0
        search = self.catalogue.prefilter_bytes.search
        while pos < n:
            if self._tb is None:
                hit = search(data, pos)
                if hit is None:
                    break
                nl = data.rfind(b"\n", pos, hit.start())
                start = nl + 1 if nl >= 0 else pos
            else:
                start = pos
            # Line numbers: count the lines skipped since the last line fed (feed_line adds the +1).
            self.line_no += data.count(b"\n", counted_to, start)
            end = data.find(b"\n", start)
            end = n if end < 0 else end
            out.extend(self.feed_line(data[start:end].decode("utf-8", errors="replace")))
            pos = counted_to = end + 1
        if counted_to < n:
            self.line_no += data.count(b"\n", counted_to, n)
            if not data.endswith(b"\n"):
                self.line_no += 1  # the file's last line, without a newline
        return out


def match_exit(catalogue: Catalogue, exit_code: int | None, signal: str | None) -> Match | None:
    """A signature implied by how the run ended when the log itself named none: exit 137/SIGKILL is
    host-oom-kill, 139/SIGSEGV is segfault.

    Returns:
        A Match of kind "exit", or None.
    """
    sig_id = None
    if exit_code in (137, -9) or signal == "SIGKILL":
        sig_id = "host-oom-kill"
    elif exit_code in (139, -11) or signal == "SIGSEGV":
        sig_id = "segfault"
    if sig_id is None or sig_id not in catalogue.by_id:
        return None
    sig = catalogue.get(sig_id)
    text = f"exit code {exit_code}" + (f", signal {signal}" if signal else "")
    return Match(signature=sig.id, severity=sig.severity, title=sig.title, kind="exit", line_no=0,
                 end_line_no=0, text=text, lines=[text])
