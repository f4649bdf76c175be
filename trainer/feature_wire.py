"""The feature wire protocol: how a target rank sends one batch's hidden-state features to a drafter rank.

A batch travels as one frame of four point-to-point messages, posted in this order, whose shapes both sides
know in advance from the run's FeatureSpec (fixed shapes: packed rows x row length), so no size is ever
negotiated:

    header  [8] int64        MAGIC, VERSION, batch index, R, L, F, dtype code, REPORT_LEN      tag 0
    ids     [4, R, L] int64  input_ids, loss_mask, doc_ids, position_ids                        tag 1
    feats   [R, L, F] dtype  target features (the target's dtype: float32 CPU, bfloat16 CUDA)    tag 2
    report  [6] float64      BatchReport of the sending target rank (time, tokens, memory)      tag 3

The receiver waits for the header first and checks it against what it expects: this protocol, the batch its
schedule says comes next from that rank, its own shapes and dtype. A peer running another trainer, started
from another config, or walking another schedule is named (WireError, saying which field differs and what
to fix) before the rest is waited for, instead of a size error deep in gloo or NCCL, or features of the
wrong batch trained on. Messages between one pair of ranks arrive in the order they were posted, and both
sides walk the same deterministic schedule (trainer.layout.Schedule), so a receive never waits for a batch
that will not come.

`encode` and `decode` are the framing, pure (no process group): `send_batch` and `PendingBatch` put a frame
on the wire and take it off, every wait inside `talking_to` (a failure there is the peer's: PeerLostError).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from trainer.distributed import DistributedError, talking_to
from trainer.objective import PackedBatch

MAGIC = 0x0DF1A5F7
"""The header's first word: a frame of this protocol."""

VERSION = 1
"""The protocol's version, in every header (a change of the frame's layout increments it)."""

TAGS = (0, 1, 2, 3)
"""The point-to-point tags of a frame's header, ids, features and report (trainer.distributed uses 7 and 8)."""

DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
"""The feature dtypes a frame can carry, by their code in the header."""

HEADER_LEN = 8


class WireError(DistributedError):
    """A frame that is not what this rank expects from its peer; the message names the field and the fix."""


@dataclass(frozen=True)
class BatchReport:
    """What a target rank reports with every batch it sends (MiB for memory)."""

    target_s: float
    tokens: float
    alloc_mb: float = 0.0
    peak_mb: float = 0.0
    rss_mb: float = 0.0
    peak_rss_mb: float = 0.0

    def memory(self) -> dict[str, float]:
        return {"alloc_mb": self.alloc_mb, "peak_mb": self.peak_mb, "rss_mb": self.rss_mb, "peak_rss_mb": self.peak_rss_mb}

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(astuple(self), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "BatchReport":
        return cls(*[float(x) for x in t.tolist()])


REPORT_LEN = len(astuple(BatchReport(0.0, 0.0)))


@dataclass(frozen=True)
class FeatureSpec:
    """The fixed shapes of one frame (known to sender and receiver without talking)."""

    rows: int
    row_len: int
    feat_dim: int
    feat_dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class Header:
    """A frame's first message: which batch, in which shapes and dtype."""

    index: int
    rows: int
    row_len: int
    feat_dim: int
    feat_dtype: torch.dtype

    @classmethod
    def of(cls, index: int, spec: FeatureSpec) -> "Header":
        return cls(index, spec.rows, spec.row_len, spec.feat_dim, spec.feat_dtype)

    def shape(self) -> str:
        return f"[{self.rows}, {self.row_len}, {self.feat_dim}] {str(self.feat_dtype).removeprefix('torch.')}"

    def to_tensor(self) -> torch.Tensor:
        if self.feat_dtype not in DTYPES:
            raise ValueError(f"features of dtype {self.feat_dtype} cannot travel: the wire carries "
                             f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)}")
        words = (MAGIC, VERSION, self.index, self.rows, self.row_len, self.feat_dim, DTYPES[self.feat_dtype], REPORT_LEN)
        return torch.tensor(words, dtype=torch.long)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, src: int) -> "Header":
        """Read a received header.

        Raises:
            WireError: not a frame of this protocol, another version, an unknown dtype or report length.
        """
        words = [int(x) for x in t.tolist()]
        magic, version, index, rows, row_len, feat_dim, code, report_len = words
        if magic != MAGIC:
            raise WireError(f"rank {src} sent a header that is not a feature frame (magic {magic:#x}, expected "
                            f"{MAGIC:#x}): another program is talking on the run's feature tags")
        if version != VERSION or report_len != REPORT_LEN:
            raise WireError(f"rank {src} speaks feature protocol version {version} (report of {report_len}), this "
                            f"rank version {VERSION} (report of {REPORT_LEN}): the nodes run different trainers; "
                            "launch every node from the same bundle")
        dtypes = {c: d for d, c in DTYPES.items()}
        if code not in dtypes:
            raise WireError(f"rank {src} sent features of dtype code {code}, which this trainer does not know "
                            f"(known: {sorted(dtypes)}): the nodes run different trainers; launch every node from "
                            "the same bundle")
        return cls(index, rows, row_len, feat_dim, dtypes[code])

    def check(self, want: "Header", src: int) -> None:
        """Raise WireError unless this received header is the expected one (`want`)."""
        if (self.rows, self.row_len, self.feat_dim, self.feat_dtype) != (want.rows, want.row_len, want.feat_dim,
                                                                        want.feat_dtype):
            raise WireError(f"rank {src} sends features {self.shape()}, this rank expects {want.shape()}: the ranks "
                            "were started from different configs (data.max_batch_size, data.max_len, the target or "
                            "its dtype); launch every node from the same config")
        if self.index != want.index:
            raise WireError(f"rank {src} sent batch {self.index} where this rank's schedule expects batch "
                            f"{want.index}: the ranks walk different schedules (layout or data.batches_per_step "
                            "differ); launch every node from the same config")


Frame = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""header, ids, feats, report: one batch on the wire, in tag order."""


def encode(batch: PackedBatch, report: BatchReport, index: int, spec: FeatureSpec) -> Frame:
    """Global batch `index` as the four message tensors of a frame, on the spec's device.

    Raises:
        ValueError: the batch does not have the spec's shapes (every batch must be padded to them).
    """
    want = (spec.rows, spec.row_len)
    if tuple(batch.input_ids.shape) != want or batch.target_hidden.shape[-1] != spec.feat_dim:
        raise ValueError(
            f"batch {tuple(batch.target_hidden.shape)} does not match the fixed shape {want + (spec.feat_dim,)}; "
            "pad every batch to data.max_batch_size rows of data.max_len tokens"
        )
    header = Header.of(index, spec).to_tensor().to(spec.device)
    ids = torch.stack([batch.input_ids, batch.loss_mask, batch.doc_ids, batch.position_ids]).to(spec.device, torch.long)
    feats = batch.target_hidden.to(spec.device, spec.feat_dtype).contiguous()
    return header, ids, feats, report.to_tensor().to(spec.device)


def empty_frame(spec: FeatureSpec) -> Frame:
    """Receive buffers of one frame in the spec's shapes."""
    R, L = spec.rows, spec.row_len
    return (torch.empty((HEADER_LEN,), dtype=torch.long, device=spec.device),
            torch.empty((4, R, L), dtype=torch.long, device=spec.device),
            torch.empty((R, L, spec.feat_dim), dtype=spec.feat_dtype, device=spec.device),
            torch.empty((REPORT_LEN,), dtype=torch.float64, device=spec.device))


def check_header(frame: Frame, spec: FeatureSpec, index: int, src: int) -> None:
    """The received frame's header is batch `index` in the spec's shapes, or WireError."""
    Header.from_tensor(frame[0].cpu(), src).check(Header.of(index, spec), src)


def decode(frame: Frame, spec: FeatureSpec, index: int, src: int) -> tuple[PackedBatch, BatchReport]:
    """The batch and report of a received frame, after its header is checked (WireError if it is not the
    frame of batch `index` in the spec's shapes)."""
    check_header(frame, spec, index, src)
    _, ids, feats, report = frame
    batch = PackedBatch(input_ids=ids[0], loss_mask=ids[1], doc_ids=ids[2], position_ids=ids[3], target_hidden=feats)
    return batch, BatchReport.from_tensor(report.cpu())


# -- on the wire ----------------------------------------------------------------------------------------------
def send_batch(batch: PackedBatch, report: BatchReport, index: int, dst: int, spec: FeatureSpec) -> list:
    """Post the frame of global batch `index` to rank `dst` (non-blocking).

    Returns:
        [(work, tensor)] pairs: keep them (the tensors must live until `work.wait()` returns).
    """
    out = []
    frame = encode(batch, report, index, spec)  # a shape error is this rank's own, not a lost peer
    with talking_to(f"sending features to rank {dst}", dst):  # posting fails at once on a pair already broken
        for tag, t in zip(TAGS, frame):
            out.append((dist.isend(t, dst=dst, tag=tag), t))
    return out


def wait_sent(works: list, dst: int) -> None:
    """Wait until every message of one `send_batch` went out (raises PeerLostError if `dst` is gone)."""
    with talking_to(f"sending features to rank {dst}", dst):
        for work, _ in works:
            work.wait()


class PendingBatch:
    """The frame of global batch `index` from rank `src`, being received; `wait()` returns its batch."""

    def __init__(self, src: int, spec: FeatureSpec, index: int):
        self.src, self.spec, self.index = src, spec, index
        self._frame = empty_frame(spec)
        with talking_to(f"receiving features from rank {src}", src):
            self._works = [dist.irecv(t, src=src, tag=tag) for tag, t in zip(TAGS, self._frame)]

    def wait(self) -> tuple[PackedBatch, BatchReport]:
        """Block until the frame is in: its header first, checked (WireError), then the rest (PeerLostError
        on a peer failure or the collective timeout)."""
        what = f"receiving features from rank {self.src}"
        with talking_to(what, self.src):
            self._works[0].wait()
        check_header(self._frame, self.spec, self.index, self.src)
        with talking_to(what, self.src):
            for w in self._works[1:]:
                w.wait()
        return decode(self._frame, self.spec, self.index, self.src)
