"""`diagnose`: the signature matcher over a log file, offline.

The file is read in large binary blocks (decode errors replaced, `\\r` progress-bar redraws split), the
catalogue's prefilter runs over whole blocks and only lines around hits are decoded, so a 1 GB log takes
seconds. Memory stays bounded: per signature a count, the first event and a few examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator import ownlines
from orchestrator.errors import UserError
from orchestrator.sigmatch import Match, Matcher
from orchestrator.signatures import SEVERITY_RANK, Catalogue, load_catalogue

BLOCK_SIZE = 8 << 20
# A "line" longer than this without a newline (a progress bar redrawn for hours) is matched in pieces.
MAX_LINE = 64 << 20
EXAMPLES_PER_SIGNATURE = 5


@dataclass
class SignatureSummary:
    """All events of one signature in the file."""

    id: str
    severity: str
    title: str
    count: int
    first_line: int
    diagnosis: str
    fix: str
    not_this: list[str]
    priority: int = 0
    examples: list[Match] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "examples"}
        d["examples"] = [m.to_dict() for m in self.examples]
        return d


@dataclass
class DiagnoseReport:
    """What `diagnose` found: per-signature summaries, most severe first."""

    path: str
    lines: int
    bytes: int
    signatures: list[SignatureSummary]

    @property
    def worst(self) -> SignatureSummary | None:
        """The most severe (then highest-priority, then earliest) signature, or None."""
        return self.signatures[0] if self.signatures else None

    @property
    def exit_code(self) -> int:
        """0 nothing matched, 2 a fatal signature matched, 1 only errors/warnings matched."""
        if not self.signatures:
            return 0
        return 2 if any(s.severity == "fatal" for s in self.signatures) else 1

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst
        return {"path": self.path, "lines": self.lines, "bytes": self.bytes, "exit_code": self.exit_code,
                "worst": worst.id if worst else None, "signatures": [s.to_dict() for s in self.signatures]}


class _Collector:
    def __init__(self, catalogue: Catalogue):
        self.catalogue = catalogue
        self.by_id: dict[str, SignatureSummary] = {}

    def add(self, matches: list[Match]) -> None:
        for m in matches:
            summary = self.by_id.get(m.signature)
            if summary is None:
                sig = self.catalogue.get(m.signature)
                text = sig.render(m.groups)
                summary = self.by_id[m.signature] = SignatureSummary(
                    id=sig.id, severity=sig.severity, title=text["title"], count=0, first_line=m.line_no,
                    diagnosis=text["diagnosis"], fix=text["fix"], not_this=text["not_this"], priority=sig.priority,
                )
            summary.count += 1
            if len(summary.examples) < EXAMPLES_PER_SIGNATURE:
                summary.examples.append(m)

    def ordered(self) -> list[SignatureSummary]:
        return sorted(self.by_id.values(),
                      key=lambda s: (-SEVERITY_RANK[s.severity], -s.priority, s.first_line))


def diagnose(path: str | Path, catalogue: Catalogue | None = None, block_size: int = BLOCK_SIZE) -> DiagnoseReport:
    """Match every line of a log file against the catalogue.

    Args:
        path: the log file (train.log or any captured output).
        catalogue: from `load_catalogue()`; the shipped one when None.
        block_size: bytes read per block.

    Returns:
        The DiagnoseReport.

    Raises:
        UserError: the file does not exist or cannot be read.
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"no such log file: {p}", fix="pass the path of a train.log (or any captured output)")
    catalogue = catalogue or load_catalogue()
    # dflashctl's own lines are not the trainer's: skipped by the run's mark when run.json is beside the log.
    matcher = Matcher(catalogue, mark=ownlines.mark_beside(p))
    found = _Collector(catalogue)
    total = 0
    carry = b""
    try:
        with open(p, "rb") as fh:
            while True:
                block = fh.read(block_size)
                if not block:
                    break
                total += len(block)
                data = carry + block if carry else block
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    if len(data) < MAX_LINE:
                        carry = data  # no complete line yet
                        continue
                    cut = len(data)  # a giant line without a newline: matched in pieces, each counted as a line
                found.add(matcher.scan_chunk(data[:cut] if cut < len(data) else data))
                carry = data[cut:]
    except OSError as exc:
        raise UserError(f"cannot read {p}: {exc.strerror or exc}", fix="check the path and its permissions") from exc
    if carry:  # the last line has no newline
        found.add(matcher.scan_chunk(carry))
    found.add(matcher.finish())
    return DiagnoseReport(path=str(p), lines=matcher.line_no, bytes=total, signatures=found.ordered())


def catalogue_for(inventory_path: str | None) -> Catalogue:
    """The shipped catalogue extended by the inventory's `signatures:` (the embedded default has none).

    Raises:
        InventoryError: the inventory or one of its signatures is malformed.
    """
    from orchestrator.inventory import load_inventory

    inv = load_inventory(inventory_path)
    return load_catalogue(list(inv.signatures))
