"""Packing samples into training steps: which documents share a step and a row, then the packed tensors.

1. `plan_epoch(lengths, ...)`: shuffled per epoch from the seed, first-fit into `rows_per_step` rows of
   `row_len` tokens; never more than `token_budget` tokens per step.
2. `build_step(samples, rows, row_len)`: the packed tensors (input_ids, loss_mask, doc_ids with -1 on pad,
   position_ids restarting at 0 for every document); `target_features(...)` runs the target once per
   document (right-padded batch, causal, so no document sees another) and packs the features alongside.

The samples come from trainer.data (tokenised conversations, or a token store indexing to the same `Sample`s).
Anchors are NOT chosen here: the objective re-draws them every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from trainer.data import DataError, Sample


# -- 1. packing plan -------------------------------------------------------------------------------
def plan_epoch(
    lengths: Sequence[int] | Any,
    row_len: int,
    rows_per_step: int,
    token_budget: int,
    seed: int,
    epoch: int,
    *,
    lookahead: int = 32,
) -> list[list[list[int]]]:
    """Pack documents into steps of rows: steps[s][r] = sample indices in row r of step s.

    The order is a permutation drawn from (seed, epoch), so every epoch sees a new order and a resumed
    run can rebuild the exact plan. Within a step, documents go first-fit into at most `rows_per_step`
    rows. A document that fits nowhere waits for the next step (which starts with the waiting ones);
    the step closes once `lookahead` documents wait, so later short documents can fill the gaps.

    Args:
        lengths: tokens per sample (a list, or a store's numpy lengths array).

    Raises:
        DataError: the budget cannot hold rows_per_step rows, or a document is longer than a row.
    """
    if rows_per_step * row_len > token_budget:
        raise DataError(
            f"{rows_per_step} rows x {row_len} tokens = {rows_per_step * row_len} exceeds token_budget {token_budget}; "
            "lower data.max_batch_size or data.max_len, or raise data.token_budget"
        )
    lengths = lengths.tolist() if hasattr(lengths, "tolist") else list(lengths)  # numpy: Python ints, read fast
    if lengths and max(lengths) > row_len:
        i = next(i for i, n in enumerate(lengths) if n > row_len)
        raise DataError(f"sample {i} has {lengths[i]} tokens, longer than a packed row ({row_len}); filter with max_len first")
    order = list(range(len(lengths)))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    steps: list[list[list[int]]] = []
    # The queue of a step is `head` (the documents that waited, then any the last step did not reach) followed
    # by order[pos:]; kept apart so a step costs O(lookahead), not a copy of the whole remaining order.
    head: list[int] = []
    pos = 0
    while head or pos < len(order):
        rows: list[list[int]] = []
        used: list[int] = []
        waiting: list[int] = []
        h = 0
        while len(waiting) < lookahead:
            if h < len(head):
                i = head[h]
                h += 1
            elif pos < len(order):
                i = order[pos]
                pos += 1
            else:
                break
            n = lengths[i]
            r = next((j for j, u in enumerate(used) if u + n <= row_len), None)
            if r is None and len(rows) < rows_per_step:
                rows.append([])
                used.append(0)
                r = len(rows) - 1
            if r is None:
                waiting.append(i)
                continue
            rows[r].append(i)
            used[r] += n
        steps.append(rows)
        head = waiting + head[h:]
    return steps


# -- 2. packed tensors -----------------------------------------------------------------------------
@dataclass
class PackedRows:
    """The packed token tensors of one step (features are added by `target_features`).

    Attributes:
        input_ids, loss_mask, doc_ids, position_ids: [R, L] long. doc_ids is the sample index of the
            token's document, -1 on padding; position_ids restart at 0 for every document (0 on padding).
        placements: (row, start, sample index) of every document, for scattering per-document features.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    placements: list[tuple[int, int, int]]

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens in the step."""
        return int((self.doc_ids >= 0).sum())


def build_step(samples: Sequence[Sample], rows: Sequence[Sequence[int]], row_len: int, pad_id: int = 0) -> PackedRows:
    """Lay the documents of one step out in [len(rows), row_len] tensors.

    Args:
        samples: all samples (a list, or a trainer.store.TokenStore); rows hold indices into it.
        rows: the step's rows (from `plan_epoch`).
        row_len: tokens per row.
        pad_id: token id on padding (never supervised: loss_mask 0, doc_ids -1).
    """
    R = len(rows)
    input_ids = torch.full((R, row_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((R, row_len), dtype=torch.long)
    doc_ids = torch.full((R, row_len), -1, dtype=torch.long)
    position_ids = torch.zeros((R, row_len), dtype=torch.long)
    placements = []
    for r, row in enumerate(rows):
        pos = 0
        for i in row:
            s = samples[i]
            n = len(s)
            if pos + n > row_len:
                raise DataError(f"row {r} overflows: documents need more than {row_len} tokens")
            input_ids[r, pos : pos + n] = torch.tensor(s.input_ids, dtype=torch.long)
            loss_mask[r, pos : pos + n] = torch.tensor(s.loss_mask, dtype=torch.long)
            doc_ids[r, pos : pos + n] = i
            position_ids[r, pos : pos + n] = torch.arange(n)
            placements.append((r, pos, i))
            pos += n
    return PackedRows(input_ids, loss_mask, doc_ids, position_ids, placements)


@torch.no_grad()
def target_features(
    target: Any, samples: Sequence[Sample], packed: PackedRows, *, max_batch_tokens: int = 65536
) -> torch.Tensor:
    """Target features for a packed step, computed per document (no cross-document attention).

    Documents are run as a right-padded batch: the target is causal, so padding after a document cannot
    change that document's features. Batches are capped at `max_batch_tokens` padded tokens.

    Args:
        target: has `.features(input_ids[B, S]) -> [B, S, F]`.

    Returns:
        [R, L, F] features, zero on padding, on the target's output device and dtype.
    """
    R, L = packed.input_ids.shape
    docs = sorted(packed.placements, key=lambda p: len(samples[p[2]]))
    out = None
    b = 0
    while b < len(docs):
        # Greedy batch of similar lengths (sorted) under the padded-token cap.
        e = b + 1
        while e < len(docs) and (e + 1 - b) * len(samples[docs[e][2]]) <= max_batch_tokens:
            e += 1
        batch = docs[b:e]
        width = len(samples[batch[-1][2]])
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for k, (_, _, i) in enumerate(batch):
            ids[k, : len(samples[i])] = torch.tensor(samples[i].input_ids, dtype=torch.long)
        device = getattr(target, "device", None)
        feats = target.features(ids.to(device) if device is not None else ids)  # [B, width, F]
        if out is None:
            out = torch.zeros((R, L, feats.shape[-1]), dtype=feats.dtype, device=feats.device)
        for k, (r, start, i) in enumerate(batch):
            n = len(samples[i])
            out[r, start : start + n] = feats[k, :n]
        b = e
    if out is None:
        raise DataError("a step with no documents: nothing to compute features for")
    return out
