"""The crash-signature catalogue (data in templates/signatures.yaml) and the streaming matcher.

The matcher reads each line once. One alternation of every signature's cheap prefilter (plain literals,
mostly) plus the traceback header is searched per line; only a line that hits runs the full patterns.
`Matcher.scan_chunk` goes further for offline files: it runs that alternation over whole chunks and only
looks at the lines around hits, which is what makes `dflashctl diagnose` competitive with grep.

A Python traceback (from `Traceback (most recent call last):` through its exception line and message,
including chained tracebacks) is grouped into ONE event carrying the winning signature, the exception line
and the last frame. Lines outside tracebacks are events of their own.

The inventory's own patterns (`signatures:`) are the user's regexes, which may backtrack for ever on one line
(`(a+)+$`): they run with the `regex` module under a time bound per line (USER_PATTERN_TIMEOUT_S), and one that
times out is named in one warning and skipped from then on. The shipped catalogue's patterns are vetted and
run on `re`. Matching runs on the workstation only (diagnose, the follower), never in the agent.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from orchestrator import assets, ownlines
from orchestrator.errors import InventoryError

SEVERITIES = ("warning", "error", "fatal")
SEVERITY_RANK = {name: i for i, name in enumerate(SEVERITIES)}
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_FIELDS = {"id", "patterns", "prefilter", "severity", "priority", "title", "diagnosis", "fix", "not_this"}
_REQUIRED = ("id", "patterns", "severity", "title", "diagnosis", "fix")

TRACEBACK_HEADER = "Traceback (most recent call last):"
USER_PATTERN_TIMEOUT_S = 0.2
"""The most one inventory pattern may spend on one line; past it the signature is skipped for the rest."""


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
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

UNCLASSIFIED = "unclassified-traceback"


@dataclass(frozen=True)
class Signature:
    """One catalogue entry (see templates/signatures.yaml for the meaning of each field)."""

    id: str
    patterns: tuple[str, ...]
    severity: str
    title: str
    diagnosis: str
    fix: str
    not_this: tuple[str, ...] = ()
    prefilter: tuple[str, ...] = ()
    priority: int = 0
    user: bool = False
    """Its patterns come from the inventory: run under the time bound."""

    def render(self, groups: dict[str, str]) -> dict[str, Any]:
        """Title, diagnosis, fix and not_this with `{group}` placeholders filled from a match."""
        values = _Defaulting(groups)
        return {
            "title": self.title.format_map(values),
            "diagnosis": self.diagnosis.format_map(values),
            "fix": self.fix.format_map(values),
            "not_this": [n.format_map(values) for n in self.not_this],
        }


class _Defaulting(dict):
    def __missing__(self, key: str) -> str:  # a placeholder the match did not capture stays readable
        return "{" + key + "}"


_UNCLASSIFIED_SIG = Signature(
    id=UNCLASSIFIED,
    patterns=(),
    severity="error",
    title="Python traceback with no known signature",
    diagnosis="No catalogue entry matched this traceback; read its exception line and last frame.",
    fix="If it recurs, add a signature for it to the inventory's `signatures:` list.",
)


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


class Catalogue:
    """The validated signatures, in catalogue order, with the compiled prefilter and patterns."""

    def __init__(self, signatures: list[Signature], on_warning: Callable[[str], None] = _warn):
        self.signatures = list(signatures)
        self.by_id = {s.id: s for s in self.signatures}
        self.by_id.setdefault(UNCLASSIFIED, _UNCLASSIFIED_SIG)
        self._patterns = [[_compile(p, s.user) for p in s.patterns] for s in self.signatures]
        self.on_warning = on_warning
        self.timed_out: dict[str, str] = {}
        """Inventory signatures skipped after a pattern ran out of time: id -> that pattern."""
        # One alternation of every prefilter plus the traceback header; a line that misses it cannot match.
        # Deduplicated and sorted: sre tries branches in order at every candidate position, and sorted
        # literals sharing a first character sit together (measured ~2x faster on bench/diagnose_vs_grep).
        alternatives = {re.escape(TRACEBACK_HEADER)}
        for sig in self.signatures:
            alternatives.update(_prefilters(sig))
        joined = "|".join(f"(?:{a})" for a in sorted(alternatives))
        self.prefilter = re.compile(joined)
        self.prefilter_bytes = re.compile(joined.encode("utf-8"))

    def __iter__(self):
        return iter(self.signatures)

    def __len__(self) -> int:
        return len(self.signatures)

    def get(self, sig_id: str) -> Signature:
        return self.by_id[sig_id]

    def match_text(self, text: str) -> list[tuple[Signature, dict[str, str]]]:
        """Every signature whose patterns match `text` (a single line), with its named groups."""
        hits = []
        for sig, pats in zip(self.signatures, self._patterns):
            if sig.id in self.timed_out:
                continue
            for pat in pats:
                m = self._search(sig, pat, text) if sig.user else pat.search(text)
                if m:
                    hits.append((sig, {k: v for k, v in m.groupdict().items() if v is not None}))
                    break
        return hits


    def _search(self, sig: Signature, pat, text: str):
        """An inventory pattern's search under the time bound; a timeout skips its signature, once warned."""
        try:
            return pat.search(text, timeout=USER_PATTERN_TIMEOUT_S)
        except TimeoutError:
            self.timed_out[sig.id] = pat.pattern
            self.on_warning(
                f"warning: signature {sig.id!r} (inventory signatures:) skipped: its pattern {pat.pattern!r} ran "
                f"longer than {USER_PATTERN_TIMEOUT_S:g} s on one line (catastrophic backtracking); fix: rewrite "
                "it without nested repetition (e.g. (a+)+ -> a+) or anchor it on a literal")
            return None


def _compile(pattern: str, user: bool):
    """`re` for the shipped catalogue; the `regex` module (which takes a timeout) for the inventory's."""
    if not user:
        return re.compile(pattern)
    import regex

    return regex.compile(pattern)


def _prefilters(sig: Signature) -> list[str]:
    """The prefilter regexes of a signature: given ones, else a literal run of each pattern, else the
    patterns themselves (always correct, only slower). An inventory signature's regexes never enter the
    prefilter (it runs on `re`, unbounded): only their literal runs, else the empty pattern (every line is
    then checked, under the bound)."""
    if sig.user:
        lits = [_longest_literal(p) for p in (sig.prefilter or sig.patterns)]
        return [re.escape(lit) if lit and len(lit) >= 4 else "" for lit in lits]
    if sig.prefilter:
        return list(sig.prefilter)
    out = []
    for pat in sig.patterns:
        lit = _longest_literal(pat)
        out.append(re.escape(lit) if lit and len(lit) >= 4 else pat)
    return out


def _longest_literal(pattern: str) -> str | None:
    """The longest run of literal characters at the top level of a pattern without alternation at its top
    level (every match contains it), or None."""
    try:
        from re import _parser as sre_parse  # Python 3.11+
    except ImportError:  # pragma: no cover - 3.10
        import sre_parse  # type: ignore[no-redef]
    parsed = sre_parse.parse(pattern)
    if parsed.state.flags & re.IGNORECASE:
        return None
    best, run = "", []
    for op, arg in parsed:
        if str(op) == "LITERAL":
            run.append(chr(arg))
            continue
        if str(op) == "BRANCH":
            return None
        if len(run) > len(best):
            best = "".join(run)
        run = []
    if len(run) > len(best):
        best = "".join(run)
    return best or None


def _validate(entry: Any, where: str) -> Signature:
    if not isinstance(entry, dict):
        raise InventoryError(f"{where}: a signature must be a mapping, got {type(entry).__name__}",
                             fix="write it as `- id: ...` with patterns, severity, title, diagnosis, fix")
    label = f"{where} (id {entry.get('id')!r})"
    unknown = set(entry) - _FIELDS
    if unknown:
        raise InventoryError(f"{label}: unknown key(s) {', '.join(sorted(unknown))}",
                             fix=f"allowed keys: {', '.join(sorted(_FIELDS))}")
    missing = [k for k in _REQUIRED if entry.get(k) in (None, "", [])]
    if missing:
        raise InventoryError(f"{label}: missing {', '.join(missing)}",
                             fix="a new signature needs id, patterns, severity, title, diagnosis and fix")
    sig_id = entry["id"]
    if not isinstance(sig_id, str) or not _ID_RE.match(sig_id):
        raise InventoryError(f"{where}: bad id {sig_id!r}", fix="use lower-case letters, digits and '-'")
    if entry["severity"] not in SEVERITIES:
        raise InventoryError(f"{label}: severity {entry['severity']!r} is not one of {', '.join(SEVERITIES)}",
                             fix="fatal = the run dies, error = the run is wrong, warning = slow/degraded")
    lists = {}
    for key in ("patterns", "prefilter", "not_this"):
        value = entry.get(key, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise InventoryError(f"{label}: {key} must be a list of non-empty strings")
        lists[key] = tuple(value)
    for key in ("patterns", "prefilter"):
        for i, pat in enumerate(lists[key]):
            try:
                re.compile(pat)
                # Patterns are joined into one alternation (str and bytes): a global inline flag would
                # apply to all of it, and bytes need an ASCII-encodable pattern.
                re.compile(f"x|(?:{pat})".encode("utf-8"))
            except (re.error, UnicodeEncodeError) as exc:
                raise InventoryError(f"{label}: {key}[{i}] {pat!r} is not a usable regex: {exc}",
                                     fix="fix the regex; use scoped flags like (?i:...) instead of a leading (?i)")
    for key in ("title", "diagnosis", "fix"):
        if not isinstance(entry[key], str):
            raise InventoryError(f"{label}: {key} must be text")
    priority = entry.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InventoryError(f"{label}: priority must be an integer, got {priority!r}")
    return Signature(
        id=sig_id, patterns=lists["patterns"], severity=entry["severity"], title=entry["title"].strip(),
        diagnosis=entry["diagnosis"].strip(), fix=entry["fix"].strip(), not_this=lists["not_this"],
        prefilter=lists["prefilter"], priority=priority,
    )


def _shipped_entries() -> list[dict]:
    import yaml

    text = assets.read_text("signatures.yaml")
    data = yaml.safe_load(text)
    if not isinstance(data, list):  # pragma: no cover - a packaging bug
        raise InventoryError("templates/signatures.yaml must be a list of signatures")
    return data


def load_catalogue(extra: list[dict] | None = None) -> Catalogue:
    """The shipped catalogue, extended or overridden by id with `extra` (the inventory's `signatures:`).

    An extra entry with a known id overrides only the keys it gives (e.g. just `severity`); one with a
    new id must be complete.

    Args:
        extra: catalogue entries, same shape as templates/signatures.yaml.

    Returns:
        The validated Catalogue.

    Raises:
        InventoryError: an entry is malformed (names the entry, the key and the fix).
    """
    merged: dict[str, dict] = {}
    for i, entry in enumerate(_shipped_entries()):
        sig = _validate(entry, f"templates/signatures.yaml[{i}]")
        merged[sig.id] = dict(entry)
    for i, entry in enumerate(extra or []):
        where = f"inventory signatures[{i}]"
        if not isinstance(entry, dict):
            _validate(entry, where)
        base = dict(merged.get(entry.get("id"), {}))
        base.update(entry)
        _validate(base, where)
        if "patterns" in entry or "prefilter" in entry:
            base["user"] = True
            _check_user_patterns(base, where)
        merged[base["id"]] = base
    return Catalogue([_signature(e) for e in merged.values()])


def _signature(entry: dict) -> Signature:
    user = bool(entry.get("user"))
    sig = _validate({k: v for k, v in entry.items() if k != "user"}, entry["id"])
    return Signature(**{**asdict(sig), "user": user}) if user else sig


def _check_user_patterns(entry: dict, where: str) -> None:
    """An inventory pattern must also compile under the `regex` module, which runs it."""
    import regex

    for key in ("patterns", "prefilter"):
        value = entry.get(key) or []
        for i, pat in enumerate([value] if isinstance(value, str) else value):
            try:
                regex.compile(pat)
            except regex.error as exc:
                raise InventoryError(f"{where} (id {entry.get('id')!r}): {key}[{i}] {pat!r} is not a usable "
                                     f"regex: {exc}", fix="fix the regex") from None


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
