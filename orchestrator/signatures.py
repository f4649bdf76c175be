"""The crash-signature catalogue (data in templates/signatures.yaml, extended by the inventory's `signatures:`).

The catalogue compiles one alternation of every signature's cheap prefilter (plain literals, mostly) plus the
traceback header: the matcher (orchestrator/sigmatch.py, which imports this module) searches it per line,
and only a line that hits runs the full patterns.

The inventory's own patterns (`signatures:`) are the user's regexes, which may backtrack for ever on one line
(`(a+)+$`): they run with the `regex` module under a time bound per line (USER_PATTERN_TIMEOUT_S), and one that
times out is named in one warning and skipped from then on. The shipped catalogue's patterns are vetted and
run on `re`. Matching runs on the workstation only (diagnose, the follower), never in the agent.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator import assets
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
