"""The DFlash training mask (docs/dflash.md §2.3) and the attention call that uses it.

Axes. Keys/values: ``[context 0..S-1 | block_0 | block_1 | ... | block_{N-1}]`` (KV = S + N*bs).
Queries: ``[block_0 | ... | block_{N-1}]`` (Q = N*bs). For a query in block j with anchor a_j:

- a context key kv < S is visible iff kv < a_j (STRICT: the anchor's own target feature does not exist yet
  at inference, §1.5; ``<=`` is the leak that gives 99% train accuracy and τ≈1, §4), it is in the same
  document as the anchor (packed rows), and the block is kept;
- a draft key is visible iff it is in block j (all slots: bidirectional inside the block);
- every other block is invisible.

A padded block (``keep`` False) still sees its own block, so no query row is ever fully masked: a fully
masked row is NaN under dense SDPA, and multiplying a NaN loss by a zero weight is still NaN.

The same rule exists twice: as a ``mask_mod`` for flex_attention's BlockMask and as a dense bool mask for
SDPA. Tests check that both give the same attention output.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F

try:  # flex_attention appeared in torch 2.5; the SDPA path works without it.
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - old torch
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = None  # type: ignore[assignment]
    flex_attention = None  # type: ignore[assignment]

Backend = Literal["auto", "flex", "sdpa"]


def _check(anchors: torch.Tensor, keep: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> None:
    if anchors.ndim != 2 or keep.shape != anchors.shape:
        raise ValueError(f"anchors and keep must both be [R, N]; got {tuple(anchors.shape)} and {tuple(keep.shape)}")
    if doc_ids.ndim != 2 or doc_ids.shape[0] != anchors.shape[0]:
        raise ValueError(f"doc_ids must be [R, S] with R={anchors.shape[0]}; got {tuple(doc_ids.shape)}")
    if anchors.shape[1] < 1:
        raise ValueError("need at least one anchor per row (N >= 1)")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def resolve_backend(backend: Backend, device: torch.device | str) -> Literal["flex", "sdpa"]:
    """`auto` -> flex on CUDA, SDPA elsewhere (flex has no CPU backward).

    Raises:
        ValueError: an unknown backend, or `flex` when this torch has no flex_attention.
    """
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" and flex_attention is not None else "sdpa"
    if backend == "flex" and flex_attention is None:
        raise ValueError("attention_backend 'flex' needs torch >= 2.5 (flex_attention); use 'sdpa'")
    if backend not in ("flex", "sdpa"):
        raise ValueError(f"unknown attention backend {backend!r}; use auto, flex or sdpa")
    return backend


def dflash_mask_mod(
    anchors: torch.Tensor, keep: torch.Tensor, doc_ids: torch.Tensor, block_size: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The §2.3 rule as a flex_attention ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    Args:
        anchors: [R, N] anchor positions (row-local, into the context axis).
        keep: [R, N] False for padded blocks (they see only their own block).
        doc_ids: [R, S] document id of each context position (-1 = padding).
        block_size: tokens per block.

    Returns:
        The mask_mod. It clamps out-of-range q (create_block_mask pads Q to its 128 sparse block) and kv
        before indexing, and answers False for q past the last block.
    """
    _check(anchors, keep, doc_ids, block_size)
    num_blocks = anchors.shape[1]
    ctx_len = doc_ids.shape[1]
    q_len = num_blocks * block_size
    block_doc = doc_ids.gather(1, anchors.clamp(0, ctx_len - 1))  # [R, N]

    def mask_mod(b, h, q_idx, kv_idx):
        j = torch.clamp(q_idx // block_size, max=num_blocks - 1)
        anchor = anchors[b, j]
        kv_ctx = torch.clamp(kv_idx, max=ctx_len - 1)
        is_ctx = kv_idx < ctx_len
        ctx_ok = is_ctx & (kv_idx < anchor) & (doc_ids[b, kv_ctx] == block_doc[b, j]) & keep[b, j]
        own_block = (~is_ctx) & ((kv_idx - ctx_len) // block_size == j)
        return (q_idx < q_len) & (ctx_ok | own_block)

    return mask_mod


def dense_mask(anchors: torch.Tensor, keep: torch.Tensor, doc_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """The §2.3 rule as a dense bool mask for SDPA (True = may attend).

    Args:
        anchors: [R, N]; keep: [R, N]; doc_ids: [R, S]; block_size: tokens per block.

    Returns:
        Bool tensor [R, 1, N*bs, S + N*bs] on the device of ``anchors``.
    """
    _check(anchors, keep, doc_ids, block_size)
    R, N = anchors.shape
    S = doc_ids.shape[1]
    dev = anchors.device
    q_block = torch.arange(N * block_size, device=dev) // block_size  # [Q]
    anchor_q = anchors[:, q_block]  # [R, Q]
    keep_q = keep[:, q_block]  # [R, Q]
    block_doc_q = doc_ids.gather(1, anchors.clamp(0, S - 1))[:, q_block]  # [R, Q]
    kv = torch.arange(S, device=dev)
    ctx = (kv[None, None, :] < anchor_q[:, :, None]) & (doc_ids[:, None, :] == block_doc_q[:, :, None])
    ctx &= keep_q[:, :, None]  # [R, Q, S]
    kv_block = torch.arange(N * block_size, device=dev) // block_size
    own = (q_block[:, None] == kv_block[None, :]).expand(R, -1, -1)  # [R, Q, N*bs]
    return torch.cat([ctx, own], dim=2).unsqueeze(1)


def block_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    *,
    compile: bool = False,
):
    """The §2.3 rule as a flex_attention BlockMask (head-independent: H=None).

    Args:
        anchors, keep, doc_ids, block_size: as in `dflash_mask_mod`.
        compile: build it with the compiled builder (block-sparse, no dense [Q, KV] grid; use on CUDA).

    Returns:
        A BlockMask for Q = N*bs, KV = S + N*bs.

    Raises:
        ValueError: this torch has no flex_attention.
    """
    if create_block_mask is None:
        raise ValueError("flex_attention is not available in this torch; use the sdpa backend")
    R, N = anchors.shape
    S = doc_ids.shape[1]
    mod = dflash_mask_mod(anchors, keep, doc_ids, block_size)
    if not compile:
        return create_block_mask(mod, B=R, H=None, Q_LEN=N * block_size, KV_LEN=S + N * block_size, device=anchors.device)
    from trainer.compile_guard import GUARD

    # The compiled builder traces mask_mod: exclusive against compiled calls in other threads (docs/remote-stack.md §3).
    with GUARD.tracing():
        return create_block_mask(
            mod, B=R, H=None, Q_LEN=N * block_size, KV_LEN=S + N * block_size, device=anchors.device, _compile=True
        )


def build_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    doc_ids: torch.Tensor,
    block_size: int,
    backend: Backend = "auto",
):
    """The mask in the form the chosen backend needs (BlockMask for flex, dense bool for SDPA).

    Raises:
        ValueError: unknown backend or flex unavailable.
    """
    kind = resolve_backend(backend, anchors.device)
    if kind == "flex":
        return block_mask(anchors, keep, doc_ids, block_size, compile=anchors.is_cuda)
    return dense_mask(anchors, keep, doc_ids, block_size)


_compiled_flex = None


def _flex(q, k, v, mask, scale):
    # Uncompiled flex materializes the full score matrix; on CUDA use one compiled instance (fixed shapes:
    # the loop pads rows and anchors to constant sizes, so this compiles once per shape).
    global _compiled_flex
    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            from trainer.compile_guard import GUARD

            # Behind the process-wide guard: the first call per shape compiles, and must not overlap an FX
            # trace in another thread (docs/remote-stack.md §3).
            _compiled_flex = GUARD.compiled(torch.compile(flex_attention, dynamic=False))
        fn = _compiled_flex
    return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """Non-causal attention with the DFlash mask.

    Args:
        q: [B, Hq, Q, D]; k, v: [B, Hkv, KV, D] with Hq a multiple of Hkv (GQA).
        mask: a BlockMask (flex), a bool tensor broadcastable to [B, Hq, Q, KV] (SDPA; True = attend), or
            None (every key visible: the inference path, whose keys are all legal by construction).
        scale: softmax scale (head_dim ** -0.5).

    Returns:
        [B, Hq, Q, D].
    """
    if torch.is_autocast_enabled(q.device.type):
        # Mixed precision: the q/k norms give float32 (their float32 weights) while v_proj gives bfloat16;
        # attention runs in the autocast dtype on every backend (flex needs one dtype for q, k and v).
        dt = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if BlockMask is not None and isinstance(mask, BlockMask):
        return _flex(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=False, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
