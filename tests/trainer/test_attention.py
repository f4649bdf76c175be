"""The training mask (docs/dflash.md §2.3): its rule on a hand-built example, dense == mask_mod, flex == SDPA, no NaN."""

from __future__ import annotations

import pytest
import torch

from trainer.attention import attend, block_mask, build_mask, dense_mask, dflash_mask_mod, resolve_backend

# Outside the project: the installed torch. flex_attention came with torch 2.5; the trainer extra allows 2.4,
# where `auto` picks SDPA (trainer.attention), so these tests have nothing to compare against there.
flex = pytest.importorskip("torch.nn.attention.flex_attention",
                           reason=f"torch {torch.__version__} has no flex_attention (torch >= 2.5 has it)")

BS = 4


def _example():
    """2 rows of 12 context tokens. Row 0: docs [0]*7 + [1]*5; row 1: [0]*9 + padding; last block padded."""
    doc = torch.tensor([[0] * 7 + [1] * 5, [0] * 9 + [-1] * 3])
    anchors = torch.tensor([[3, 8, 0], [5, 2, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    return anchors, keep, doc


def test_dense_mask_rule_by_hand():
    anchors, keep, doc = _example()
    m = dense_mask(anchors, keep, doc, BS)
    S, Q = 12, 3 * BS
    assert m.shape == (2, 1, Q, S + Q)
    m = m[:, 0]
    # Row 0, block 0 (anchor 3, doc 0): context 0,1,2 only; STRICT: the anchor position 3 is hidden.
    for q in range(0, 4):
        assert m[0, q, :S].nonzero().flatten().tolist() == [0, 1, 2]
        # its own block, all four slots (bidirectional), nothing of the other blocks
        assert m[0, q, S:].nonzero().flatten().tolist() == [0, 1, 2, 3]
    # Row 0, block 1 (anchor 8, doc 1): only doc-1 positions before 8 -> 7; doc 0 (0..6) is another document.
    assert m[0, 4, :S].nonzero().flatten().tolist() == [7]
    assert m[0, 4, S:].nonzero().flatten().tolist() == [4, 5, 6, 7]
    # Row 0, block 2 (anchor 0): no context at all, but its own block -> never a fully masked row.
    assert not m[0, 8, :S].any()
    assert m[0, 8, S:].nonzero().flatten().tolist() == [8, 9, 10, 11]
    # Row 1, padded block 2: no context, own block only.
    assert not m[1, 8:, :S].any()
    assert m[1, 11, S:].nonzero().flatten().tolist() == [8, 9, 10, 11]
    # Row 1, block 0 (anchor 5): 0..4; padding (-1) never visible.
    assert m[1, 0, :S].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert m.any(dim=-1).all(), "every query row sees at least its own block"


def test_dense_mask_equals_mask_mod_on_every_cell():
    g = torch.Generator().manual_seed(0)
    R, S, N = 3, 40, 5
    doc = torch.sort(torch.randint(0, 3, (R, S), generator=g), dim=1).values
    doc[2, 30:] = -1
    anchors = torch.sort(torch.randint(0, S, (R, N), generator=g), dim=1).values
    keep = torch.rand(R, N, generator=g) > 0.3
    dense = dense_mask(anchors, keep, doc, BS)
    mod = dflash_mask_mod(anchors, keep, doc, BS)
    grid = flex.create_mask(mod, R, 1, N * BS, S + N * BS, device="cpu")
    assert torch.equal(grid.bool(), dense)


def test_mask_mod_clamps_padded_queries():
    # create_block_mask pads Q up to 128; q past the last block must not index out of range and is False.
    anchors, keep, doc = _example()
    mod = dflash_mask_mod(anchors, keep, doc, BS)
    q = torch.tensor(200)
    for kv in (0, 5, 12, 23, 300):
        assert not bool(mod(torch.tensor(0), torch.tensor(0), q, torch.tensor(kv)))


def _qkv(R, Q, KV, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, hq, Q, d, generator=g)
    k = torch.randn(R, hkv, KV, d, generator=g)
    v = torch.randn(R, hkv, KV, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("N,S", [(3, 12), (37, 150)])  # Q = N*bs both below and past flex's 128 tile
def test_flex_block_mask_equals_dense_sdpa(N, S):
    g = torch.Generator().manual_seed(N)
    R = 2
    doc = torch.sort(torch.randint(0, 3, (R, S), generator=g), dim=1).values
    doc[1, S - 10 :] = -1
    anchors = torch.sort(torch.randint(0, S - 10, (R, N), generator=g), dim=1).values
    keep = torch.rand(R, N, generator=g) > 0.2
    keep[0, 0] = True
    q, k, v = _qkv(R, N * BS, S + N * BS)
    scale = 16**-0.5
    with torch.no_grad():  # flex has no CPU backward; eager flex forward is what can run here
        out_dense = attend(q, k, v, dense_mask(anchors, keep, doc, BS), scale)
        out_flex = attend(q, k, v, block_mask(anchors, keep, doc, BS), scale)
    assert torch.isfinite(out_dense).all()
    assert torch.allclose(out_dense, out_flex, atol=1e-5), (out_dense - out_flex).abs().max()


def test_padded_blocks_and_contextless_blocks_give_no_nan_with_grad():
    anchors, keep, doc = _example()
    q, k, v = _qkv(2, 3 * BS, 12 + 3 * BS)
    q.requires_grad_(True)
    out = attend(q, k, v, dense_mask(anchors, keep, doc, BS), 0.25)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()


def test_backend_resolution():
    assert resolve_backend("auto", "cpu") == "sdpa"
    assert resolve_backend("flex", "cpu") == "flex"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("eager", "cpu")  # type: ignore[arg-type]
    anchors, keep, doc = _example()
    assert isinstance(build_mask(anchors, keep, doc, BS, "auto"), torch.Tensor)
    assert isinstance(build_mask(anchors, keep, doc, BS, "flex"), flex.BlockMask)


def test_bad_shapes_are_named():
    anchors, keep, doc = _example()
    with pytest.raises(ValueError, match="anchors and keep"):
        dense_mask(anchors, keep[:, :2], doc, BS)
    with pytest.raises(ValueError, match="doc_ids must be"):
        dense_mask(anchors, keep, doc[:1], BS)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled flex forward + backward)")
def test_compiled_flex_matches_sdpa_forward_and_backward_on_cuda():
    g = torch.Generator().manual_seed(0)
    R, S, N = 2, 300, 40  # Q = 160, KV = 460: several 128 tiles, padded on both axes
    doc = torch.sort(torch.randint(0, 3, (R, S), generator=g), dim=1).values
    doc[1, S - 20 :] = -1
    anchors = torch.sort(torch.randint(0, S - 20, (R, N), generator=g), dim=1).values
    keep = torch.rand(R, N, generator=g) > 0.2
    anchors, keep, doc = anchors.cuda(), keep.cuda(), doc.cuda()
    q, k, v = (t.cuda().requires_grad_(True) for t in _qkv(R, N * BS, S + N * BS))
    scale = 16**-0.5
    out_flex = attend(q, k, v, block_mask(anchors, keep, doc, BS, compile=True), scale)
    grads_flex = torch.autograd.grad(out_flex.square().sum(), (q, k, v))
    out_sdpa = attend(q, k, v, dense_mask(anchors, keep, doc, BS), scale)
    grads_sdpa = torch.autograd.grad(out_sdpa.square().sum(), (q, k, v))
    assert torch.allclose(out_flex, out_sdpa, atol=2e-3)
    for a, b in zip(grads_flex, grads_sdpa):
        assert torch.isfinite(a).all() and torch.allclose(a, b, atol=2e-3)
