"""DDTree: the best-first tree, the ancestor mask against one forward per path, the cache after acceptance,
lossless decoding, the top-1 tree == the chain, and τ rising with the budget on a trained drafter."""

from __future__ import annotations

import itertools

import pytest
import torch

from tiny_targets import MASK_ID, build_target, small_model_config
from trainer.ddtree import ancestor_mask, build_tree, keep_path, verify_inputs, walk
from trainer.evaluate import acceptance_length, greedy_generate
from trainer.model import DFlashDrafter
from trainer.objective import PackedBatch, dflash_loss

BS = 8


def _log_q(depth, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, dim=-1)


def _brute_force_best(log_q, budget):
    """Every path of every depth, scored by its summed log q, best `budget` of them."""
    depth, vocab = log_q.shape
    paths = []
    for d in range(1, depth + 1):
        for toks in itertools.product(range(vocab), repeat=d):
            paths.append((sum(float(log_q[i, t]) for i, t in enumerate(toks)), toks))
    paths.sort(key=lambda x: -x[0])
    return paths[:budget]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 5, 17, 40])
def test_tree_is_the_best_budget_paths(seed, budget):
    log_q = _log_q(4, 4, seed)
    tree = build_tree(log_q, root=99, budget=budget)
    assert len(tree) == budget + 1 and tree.tokens[0] == 99 and tree.parents[0] == -1
    found = {tuple(tree.tokens[e] for e in tree.path(i)[1:]) for i in range(1, len(tree))}
    best = _brute_force_best(log_q, budget)
    assert found == {toks for _, toks in best}
    # prefix-closed, parents first, depth = path length, scores = sum of log q, non-increasing
    for i in range(1, len(tree)):
        p = tree.parents[i]
        assert 0 <= p < i and tree.depths[i] == tree.depths[p] + 1
        toks = [tree.tokens[e] for e in tree.path(i)[1:]]
        assert tree.scores[i] == pytest.approx(sum(float(log_q[k, t]) for k, t in enumerate(toks)), abs=1e-5)
    assert all(a >= b - 1e-6 for a, b in zip(tree.scores[1:], tree.scores[2:]))


def test_top1_tree_is_the_greedy_chain_and_budget_limits():
    log_q = _log_q(5, 7, 0)
    tree = build_tree(log_q, root=3, budget=5, top_k=1)
    assert tree.tokens[1:] == log_q.argmax(-1).tolist() and tree.parents == [-1, 0, 1, 2, 3, 4]
    assert len(build_tree(log_q, root=3, budget=100, top_k=1)) == 6  # a chain cannot outgrow the block
    assert len(build_tree(log_q, root=3, budget=0)) == 1
    with pytest.raises(ValueError, match="budget must be >= 0"):
        build_tree(log_q, root=3, budget=-1)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        build_tree(log_q, root=3, budget=4, top_k=0)


def test_ancestor_mask_and_walk():
    tree = build_tree(_log_q(3, 3, 1), root=0, budget=8)
    mask = ancestor_mask(tree)
    for i in range(len(tree)):
        assert mask[i].nonzero().flatten().tolist() == sorted(tree.path(i))
    # walk follows the children the choices name, and stops at the first choice that is no child
    leaf = max(range(len(tree)), key=lambda i: tree.depths[i])
    path = tree.path(leaf)
    choice = [0] * len(tree)
    for a, b in zip(path, path[1:]):
        choice[a] = tree.tokens[b]
    choice[leaf] = 12345
    assert walk(tree, choice) == (path, 12345)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3 eager"])
def test_one_tree_forward_equals_a_forward_per_path(family, qwen3_target, llama_target):
    """The ancestor mask against dense brute force: each entry verified by its own forward of prompt + path.
    Eager attention adds the mask to the scores (a bool mask there silently attended everywhere)."""
    target = {"qwen3": qwen3_target, "llama": llama_target}.get(family)
    if family == "qwen3 eager":
        target = build_target("qwen3")
        target.hf.set_attn_implementation("eager")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, MASK_ID, (1, 9), generator=g)
    tree = build_tree(torch.log_softmax(torch.randn(5, MASK_ID, generator=g) * 8, -1), root=7, budget=24)
    assert max(tree.depths) >= 3 and len(tree.children[0]) >= 2  # deep and branching
    cache = target.new_cache()
    target.logits_and_features(prompt, cache)
    ids, pos, mask = verify_inputs(tree, start=9, past_len=9)
    logits, feats = target.logits_and_features(ids, cache, position_ids=pos, attention_mask=mask)
    for i in range(len(tree)):
        seq = torch.cat([prompt, torch.tensor([[tree.tokens[e] for e in tree.path(i)]])], dim=1)
        ref_logits, ref_feats = target.logits_and_features(seq)
        assert torch.allclose(logits[0, i], ref_logits[0, -1], atol=1e-4), i
        assert torch.allclose(feats[0, i], ref_feats[0, -1], atol=1e-4), i


def test_keep_path_leaves_the_cache_of_the_accepted_sequence(qwen3_target):
    target = qwen3_target
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, MASK_ID, (1, 6), generator=g)
    tree = build_tree(torch.log_softmax(torch.randn(4, MASK_ID, generator=g) * 3, -1), root=5, budget=20)
    leaf = max(range(len(tree)), key=lambda i: (tree.depths[i], i))  # a deep entry, not on the first branch
    path = tree.path(leaf)
    assert path != list(range(len(path)))
    cache = target.new_cache()
    target.logits_and_features(prompt, cache)
    ids, pos, mask = verify_inputs(tree, start=6, past_len=6)
    target.logits_and_features(ids, cache, position_ids=pos, attention_mask=mask)
    keep_path(cache, 6, path)
    assert cache.get_seq_length() == 6 + len(path)
    nxt = torch.tensor([[11]])
    got, _ = target.logits_and_features(nxt, cache)
    seq = torch.cat([prompt, torch.tensor([[tree.tokens[e] for e in path]]), nxt], dim=1)
    ref, _ = target.logits_and_features(seq)
    assert torch.allclose(got[0, -1], ref[0, -1], atol=1e-4)


# -- decoding with a drafter that has learnt something ---------------------------------------------
@pytest.fixture(scope="module")
def trained(qwen3_target):
    """A block-8 drafter fitted to the target's greedy continuations of 6 prompts (τ ≈ 5.7 on them), those
    prompts, 6 others, and the target's greedy continuations of all 12 (the lossless reference, made once)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, MASK_ID, (8,), generator=g).tolist() for _ in range(6)]
    responses = [greedy_generate(qwen3_target, p, 40) for p in prompts]
    ids = torch.tensor([p + r for p, r in zip(prompts, responses)])
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 8:] = 1
    batch = PackedBatch(ids, loss_mask, torch.zeros_like(ids), torch.arange(48).expand(6, 48), qwen3_target.features(ids))
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(small_model_config(block_size=BS), qwen3_target, MASK_ID)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(60):
        out = dflash_loss(drafter, batch, num_anchors=16, gamma=2.0, generator=g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    others = [torch.randint(0, MASK_ID, (8,), generator=g).tolist() for _ in range(6)]
    greedy = responses + [greedy_generate(qwen3_target, p, 40) for p in others]
    return drafter.eval(), prompts, others, greedy


@pytest.fixture(scope="module")
def tree_decoded(trained, qwen3_target):
    """tree_decoded(prompts, budget): their DDTree decoding at that budget, made once for the module (greedy
    decoding is deterministic; the lossless test and the τ test read the same decodes at budgets 1, 16, 64)."""
    drafter, made = trained[0], {}

    def get(ps, budget):
        key = (tuple(map(tuple, ps)), budget)
        if key not in made:
            made[key] = acceptance_length(drafter, qwen3_target, ps, 40, budget=budget)
        return made[key]

    return get


@pytest.fixture(scope="module")
def chain(trained, qwen3_target):
    """Chain decoding of the 12 prompts (the reference the top-1 tree and the budgets are held against)."""
    drafter, prompts, others, _ = trained
    return acceptance_length(drafter, qwen3_target, prompts + others, 40)


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_tree_decoding_is_lossless(trained, tree_decoded):
    _, prompts, others, greedy = trained
    for ps, ref in ((prompts, greedy[:6]), (others, greedy[6:])):
        for budget in (1, 3, 16, 64):
            rep = tree_decoded(ps, budget)
            assert rep.outputs == ref, budget


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_top1_budget_equals_chain_decoding(trained, chain, qwen3_target):
    drafter, prompts, others, _ = trained
    top1 = acceptance_length(drafter, qwen3_target, prompts + others, 40, budget=BS - 1, top_k=1)
    assert top1.outputs == chain.outputs and top1.rounds == chain.rounds
    assert top1.per_prompt == chain.per_prompt and top1.histogram == chain.histogram
    assert chain.mean > 2  # rounds that accept several drafts were compared, not only misses


def test_tau_grows_with_the_budget(trained, chain, tree_decoded):
    _, prompts, _, _ = trained
    chain_mean = sum(chain.per_prompt[:6]) / 6  # τ of the chain on the 6 fitted prompts
    taus = [tree_decoded(prompts, b) for b in (1, 4, 16, 64)]
    means = [r.mean for r in taus]
    assert means == sorted(means) and means[-1] > chain_mean > means[0], (chain_mean, means)
    assert [r.verify_width for r in taus] == [2, 5, 17, 65]


def test_tree_needs_an_attention_that_takes_a_4d_mask(trained):
    drafter, prompts, _, _ = trained
    target = build_target("qwen3")
    target.hf.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="'flash_attention_2' does not take; load the target with attn_implementation='sdpa'"):
        acceptance_length(drafter, target, prompts[:1], 8, budget=4)
