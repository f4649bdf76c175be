"""The DFlash training objective (docs/dflash.md §2.2): random anchors, masked blocks, decayed CE.

For a packed batch of R rows of length L and N anchors per row:

    blocks     [R, N, bs]   slot 0 = clean token at the anchor a, slots 1..bs-1 = MASK
    positions  [R, L + N*bs] context positions, then pos[a] + k for each block slot k
    labels     [R, N, bs]   slot k -> token at a + k (SAME position, not shifted: inference verifies
                            draft[k] against the target's token at a+k, §1.5)
    weights    w_k = exp(-(k-1)/γ) for k >= 1, 0 for slot 0, 0 where the label is past the row, past the
               anchor's document, not an assistant token (loss_mask 0), or the block is padding
    loss       Σ w·CE / Σ w   (weighted mean, decay weights in the denominator)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.attention import build_mask
from trainer.config import default_gamma  # re-exported: the one table of γ by block size


@dataclass
class PackedBatch:
    """Packed training rows with their target features. Shapes: R rows, L tokens, F = n_feat * H.

    Attributes:
        input_ids: [R, L] token ids.
        loss_mask: [R, L] 1 on assistant tokens (the only ones supervised or used as anchors).
        doc_ids: [R, L] document id per token, -1 = padding.
        position_ids: [R, L] positions restarting at 0 in every document.
        target_hidden: [R, L, F] target features (HF hidden_states[l+1] for the feature layers, concatenated).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    target_hidden: torch.Tensor

    def __post_init__(self):
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"PackedBatch.input_ids must be [R, L], got {shape}")
        for name in ("loss_mask", "doc_ids", "position_ids"):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"PackedBatch.{name} has shape {got}, expected {shape} like input_ids")
        if tuple(self.target_hidden.shape[:2]) != shape or self.target_hidden.ndim != 3:
            raise ValueError(
                f"PackedBatch.target_hidden must be [R, L, F] with [R, L] = {shape}, got {tuple(self.target_hidden.shape)}"
            )

    def to(self, device) -> "PackedBatch":
        """A copy with every tensor on ``device``."""
        return PackedBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())


@dataclass
class StepOutput:
    """One objective evaluation. Everything but ``loss`` is detached (metrics; sum across ranks as-is).

    Attributes:
        loss: scalar weighted-mean CE (with grad).
        n_tokens: supervised labels (weight > 0).
        slot_correct: [bs-1] argmax hits per block slot k = 1..bs-1 (over supervised labels).
        slot_count: [bs-1] supervised labels per slot.
        sim_accept_len: 1 + mean over kept blocks of Σ_k Π_{i<=k} correct_i (an unsupervised slot ends the chain).
        accept_sum: Σ over kept blocks of (1 + accepted): sim_accept_len = accept_sum / n_blocks.
        n_blocks: kept (non-padding) blocks.
        weight_sum: Σ w (the loss denominator).
    """

    loss: torch.Tensor
    n_tokens: torch.Tensor
    slot_correct: torch.Tensor
    slot_count: torch.Tensor
    sim_accept_len: torch.Tensor
    accept_sum: torch.Tensor
    n_blocks: torch.Tensor
    weight_sum: torch.Tensor

    @property
    def accuracy(self) -> float:
        """Top-1 accuracy over all supervised labels."""
        return float(self.slot_correct.sum() / self.slot_count.sum().clamp_min(1))


def anchor_candidates(batch: PackedBatch, block_size: int) -> torch.Tensor:
    """Positions that may be anchors: [R, L] bool.

    p is a candidate iff it is an assistant token (loss_mask 1) with an assistant token after it (so the
    block has at least one label), in a real document, and the whole block p..p+bs-1 stays inside that
    document and row (a block never crosses its document).
    """
    R, L = batch.input_ids.shape
    lm = batch.loss_mask.bool()
    doc = batch.doc_ids
    cand = torch.zeros_like(lm)
    if L < block_size:
        return cand
    span = L - block_size + 1
    end = torch.arange(span, device=doc.device) + block_size - 1
    cand[:, :span] = (
        lm[:, :span]
        & lm[:, 1 : span + 1]
        & (doc[:, :span] >= 0)
        & (doc[:, end] == doc[:, :span])
    )
    return cand


def sample_anchors(
    batch: PackedBatch,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
    *,
    fixed: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw anchors uniformly without replacement among `anchor_candidates`, re-drawn on every call.

    Args:
        batch: the packed rows.
        num_anchors: anchors per row.
        block_size: tokens per block.
        generator: RNG (its device is where the random keys are drawn); None = global RNG.
        fixed: True -> always ``num_anchors`` columns (constant shapes: compiled kernels are reused);
            False -> ``min(num_anchors, most candidates in any row)`` columns (at least 1).

    Returns:
        (anchors [R, N] long ascending per row, keep [R, N] bool). Columns a row cannot fill have keep
        False and anchor 0.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    cand = anchor_candidates(batch, block_size)
    R, L = cand.shape
    n = num_anchors if fixed else max(1, min(num_anchors, int(cand.sum(1).max())))
    gen_device = generator.device if generator is not None else cand.device
    keys = torch.rand(R, L, generator=generator, device=gen_device).to(cand.device)
    keys = torch.where(cand, keys, torch.full_like(keys, 2.0))  # non-candidates sort last
    if n > L:  # more anchors than positions: pad the key matrix so topk has enough columns
        keys = torch.cat([keys, torch.full((R, n - L), 3.0, device=keys.device)], dim=1)
    picked_keys, idx = torch.topk(keys, n, dim=1, largest=False)
    keep = picked_keys < 2.0
    anchors = torch.where(keep, idx, torch.zeros_like(idx))
    # Ascending anchors (padding last): neighbouring blocks read neighbouring context, which keeps
    # flex's block-sparse mask dense in few tiles.
    order = torch.where(keep, anchors, torch.full_like(anchors, L + 1)).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def block_inputs(
    batch: PackedBatch, anchors: torch.Tensor, keep: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise ids and RoPE positions for the blocks.

    Returns:
        noise_ids [R, N*bs] (slot 0 = token at the anchor, MASK elsewhere and in padded blocks),
        position_ids [R, L + N*bs] (row positions, then pos[a] + k).
    """
    R, N = anchors.shape
    bs = block_size
    noise = torch.full((R, N, bs), mask_token_id, dtype=batch.input_ids.dtype, device=anchors.device)
    first = batch.input_ids.gather(1, anchors)
    noise[:, :, 0] = torch.where(keep, first, torch.full_like(first, mask_token_id))
    k = torch.arange(bs, device=anchors.device)
    block_pos = batch.position_ids.gather(1, anchors)[:, :, None] + k  # [R, N, bs]
    positions = torch.cat([batch.position_ids, block_pos.reshape(R, N * bs)], dim=1)
    return noise.reshape(R, N * bs), positions


def block_labels(
    batch: PackedBatch, anchors: torch.Tensor, keep: torch.Tensor, block_size: int, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels and decayed weights.

    Returns:
        labels [R, N, bs] (token at anchor + k; clamped index where out of range, weight 0 there),
        weights [R, N, bs] float32: exp(-(k-1)/γ) where supervised, else 0; slot 0 always 0.
    """
    R, L = batch.input_ids.shape
    k = torch.arange(block_size, device=anchors.device)
    idx = anchors[:, :, None] + k  # [R, N, bs]
    in_row = idx < L
    idx_c = idx.clamp(max=L - 1).reshape(R, -1)
    labels = batch.input_ids.gather(1, idx_c).view_as(idx)
    supervised = batch.loss_mask.gather(1, idx_c).view_as(idx).bool()
    same_doc = batch.doc_ids.gather(1, idx_c).view_as(idx) == batch.doc_ids.gather(1, anchors)[:, :, None]
    valid = keep[:, :, None] & in_row & supervised & same_doc & (k > 0)
    decay = torch.exp(-(k.float() - 1).clamp_min(0) / gamma)
    weights = torch.where(valid, decay.expand_as(valid), torch.zeros((), device=anchors.device))
    return labels, weights


def _ce_and_pred(drafter, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = drafter.logits(hidden).float()
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def _chunked_ce(drafter, hidden: torch.Tensor, labels: torch.Tensor, chunk: int | None):
    """CE and argmax over [M, H] rows; past ``chunk`` rows each chunk is checkpointed so at most one chunk
    of [chunk, V] logits is alive (full logits of 8192 slots x 152K vocab would be GBs per row)."""
    if chunk is None or hidden.shape[0] <= chunk:
        return _ce_and_pred(drafter, hidden, labels)
    ces, preds = [], []
    for s in range(0, hidden.shape[0], chunk):
        ce, pred = checkpoint(_ce_and_pred, drafter, hidden[s : s + chunk], labels[s : s + chunk], use_reentrant=False)
        ces.append(ce)
        preds.append(pred)
    return torch.cat(ces), torch.cat(preds)


def simulated_acceptance(correct: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over kept blocks of (1 + leading run of correct slots), and the number of kept blocks.

    Args:
        correct: [R, N, bs-1] bool, slot k = 1..bs-1 predicted right (False where unsupervised, which ends
            the run as a rejection would).
        keep: [R, N] bool.

    Returns:
        (accept_sum, n_blocks) as float tensors; their ratio is the simulated acceptance length.
    """
    accepted = correct.long().cumprod(dim=2).sum(dim=2).float()  # [R, N]
    return ((1.0 + accepted) * keep).sum(), keep.sum().float()


def dflash_loss(
    drafter,
    batch: PackedBatch,
    *,
    num_anchors: int,
    gamma: float,
    generator: torch.Generator | None = None,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    fixed_anchors: bool = True,
    logits_chunk: int | None = 8192,
) -> StepOutput:
    """Sample anchors, run the drafter over all blocks in one forward, return the weighted CE and metrics.

    Args:
        drafter: a `trainer.model.DFlashDrafter`.
        batch: packed rows with target features.
        num_anchors: anchors per row.
        gamma: decay γ of w_k = exp(-(k-1)/γ).
        generator: RNG for anchors.
        anchors: optional precomputed (anchors, keep) (tests; evaluation with fixed anchors).
        fixed_anchors: see `sample_anchors` ``fixed``.
        logits_chunk: rows of logits computed at once (checkpointed past this); None = all at once.

    Returns:
        StepOutput (loss with grad; detached metrics).

    Raises:
        ValueError: gamma <= 0, shapes inconsistent with the drafter, or the flex backend when training on CPU.
    """
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    bs = drafter.block_size
    device = drafter.device
    batch = batch.to(device)
    if anchors is None:
        anchors, keep = sample_anchors(batch, num_anchors, bs, generator, fixed=fixed_anchors)
    else:
        anchors, keep = anchors[0].to(device), anchors[1].to(device)
    R, N = anchors.shape

    if drafter.backend == "flex" and device.type == "cpu" and torch.is_grad_enabled():
        raise ValueError("attention_backend 'flex' has no CPU backward in torch; use 'auto' or 'sdpa' for CPU training")
    noise_ids, positions = block_inputs(batch, anchors, keep, bs, drafter.mask_token_id)
    mask = build_mask(anchors, keep, batch.doc_ids, bs, drafter.cfg.attention_backend)
    hidden = drafter(noise_ids, batch.target_hidden, positions, mask)  # [R, N*bs, H]

    labels, weights = block_labels(batch, anchors, keep, bs, gamma)  # [R, N, bs]
    sel = weights.reshape(-1) > 0
    # Only supervised slots go through the LM head: slot 0 and padding never cost a vocab projection.
    h_sel = hidden.reshape(R * N * bs, -1)[sel]
    y_sel = labels.reshape(-1)[sel]
    w_sel = weights.reshape(-1)[sel]
    ce, pred = _chunked_ce(drafter, h_sel, y_sel, logits_chunk)
    w_sum = w_sel.sum()
    loss = (ce * w_sel).sum() / w_sum.clamp_min(1e-6)

    with torch.no_grad():
        correct = torch.zeros(R * N * bs, dtype=torch.bool, device=device)
        correct[sel] = pred == y_sel
        correct = correct.view(R, N, bs)[:, :, 1:]  # slots 1..bs-1
        valid = (weights > 0)[:, :, 1:]
        slot_correct = correct.sum(dim=(0, 1)).float()
        slot_count = valid.sum(dim=(0, 1)).float()
        accept_sum, n_blocks = simulated_acceptance(correct, keep)
        sim_accept_len = accept_sum / n_blocks.clamp_min(1)
    return StepOutput(
        loss=loss,
        n_tokens=sel.sum(),
        slot_correct=slot_correct,
        slot_count=slot_count,
        sim_accept_len=sim_accept_len,
        accept_sum=accept_sum,
        n_blocks=n_blocks,
        weight_sum=w_sum.detach(),
    )


__all__ = [
    "PackedBatch",
    "StepOutput",
    "anchor_candidates",
    "sample_anchors",
    "block_inputs",
    "block_labels",
    "dflash_loss",
    "simulated_acceptance",
    "default_gamma",
]
