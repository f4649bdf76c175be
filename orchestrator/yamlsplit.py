"""Where a large YAML text can be cut into two documents whose data, merged, is the text's own: the first pass
of a large inventory (orchestrator.yamlload) parses the halves in two processes, one per core.

The cut is made only where it cannot change what the text means:

- at a line that starts an entry of the text's largest top-level section, a block mapping (`experiments:` with
  nothing after the colon): exactly that mapping's indentation, then a plain key and a colon;
- in a text without directives (`%`), document markers (`---`, `...`) or a tab at the start of a line.

The second document is the section's header line followed by the rest of the text. Why that is safe: the
scanner's state at the cut (block context, the top-level mapping and the section's mapping open) is the state
the header line gives the second document. A block scalar or a multi-line plain scalar before the cut belongs
to an entry indented at least as deep as the cut line, so the cut line ends it in the whole text too. A flow
collection or a quoted scalar still open at the cut leaves the first half unterminated, which is a parse error
there. Any error, in either half, and the caller parses the whole text, so every message comes from the one
whole parse. `merge` then refuses halves that do not fit together (a key in both halves, which the whole parse
names as a duplicate).
"""

from __future__ import annotations

import re
from typing import Any

SPLIT_MIN_BYTES = 2 << 20
"""Smaller texts parse in one process faster than a second interpreter starts."""
FIRST_SHARE = 0.48
"""The first half's share of the nodes (it parses in this process). The second half's interpreter starts
~0.05 s later and its data is still to be read back when it ends, but it frees neither its node graph nor
itself (yamlload._second_half), while this process frees its half's graph and makes the cache entry's bytes
of its half (yamlload._first_half_and_merge). A first load of a 10 MB inventory, its cache entry written, took
2.24 s at 0.48 against 2.29 s at 0.46 and 2.31 s at 0.50 (bench/inventory_load.py's text, a slow hour)."""

# Anchored on the newline before a line, not on `^` under re.M: the scan of a 10 MB text is 7x faster.
_NO_SPLIT = re.compile(r"\n(?:%|---|\.\.\.|\t)")
_TOP_LINE = re.compile(r"\n(?=[^\s#])")
_HEADER = re.compile(r"([A-Za-z0-9_.\-]+):[ \t]*(?:#.*)?")
_FIRST_ENTRY = re.compile(r"^( +)([^ \n#])", re.M)
_KEY = r"[A-Za-z0-9_.\-]+:(?:[ \t]|$)"


def split_point(text: str) -> tuple[str, str, int] | None:
    """(the section's key, its header line, the offset of the line the second document starts at), or None
    where the text has no such cut (see the module's docstring)."""
    if _NO_SPLIT.search("\n" + text):
        return None
    starts = [m.end() - 1 for m in _TOP_LINE.finditer("\n" + text)]  # where each top-level line starts in text
    if not starts:
        return None
    _size, start, end = max((end - start, start, end) for start, end in zip(starts, starts[1:] + [len(text)]))
    stop = text.find("\n", start)
    header = text[start:stop if stop >= 0 else len(text)]
    head = _HEADER.fullmatch(header)
    if head is None:
        return None
    first = _FIRST_ENTRY.search(text, start + len(header), end)
    if first is None:
        return None  # an empty section (a sequence has no cut: its lines at its indentation start with "- ")
    indent = len(first.group(1))
    entry = re.compile(f"^ {{{indent}}}{_KEY}", re.M)
    cut = entry.search(text, max(_middle(text), first.end()), end)
    if cut is None:
        return None
    return head.group(1), header, cut.start()


def _middle(text: str, block: int = 1 << 16, share: float = FIRST_SHARE) -> int:
    """The offset with `share` of the text's YAML nodes before it (FIRST_SHARE): a node is about one `:`, `,` or line
    (a dense `{kind: container, ...}` line holds three times the nodes per byte of a block of keys), so the
    two halves take about as long to parse. Counted per 64 KiB block (str.count, a few ms for 10 MB)."""
    weights = [sum(text.count(c, i, i + block) for c in ":,\n") for i in range(0, len(text), block)]
    half, seen = sum(weights) * share, 0
    for i, w in enumerate(weights):
        if seen + w >= half:
            start = i * block
            return start + int(min(block, len(text) - start) * (half - seen) / max(w, 1))
        seen += w
    return 0  # an empty text (otherwise the last block always crosses the half)


def halves(text: str, cut: tuple[str, str, int]) -> tuple[str, str]:
    """The two documents of `text` cut at `cut` (split_point's answer)."""
    _key, header, at = cut
    return text[:at], f"{header}\n{text[at:]}"


def merge(first: Any, second: Any, key: str) -> dict | None:
    """The whole text's data from its halves' data, or None when they do not fit together: the section is not
    a mapping in both, or a key is in both halves (then the whole parse names the duplicate)."""
    if not (isinstance(first, dict) and isinstance(second, dict) and isinstance(first.get(key), dict)
            and next(iter(second), None) == key and isinstance(second[key], dict)):
        return None
    rest = {k: v for k, v in second.items() if k != key}
    if first[key].keys() & second[key].keys() or first.keys() & rest.keys():
        return None
    first[key].update(second[key])
    first.update(rest)
    return first
