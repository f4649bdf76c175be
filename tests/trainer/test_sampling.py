"""Speculative sampling is lossless in distribution: on a 4-token vocabulary the sequences it emits follow
the target's own sampling distribution (chi-square against exact enumeration), for the chain (rejection
rule) and for DDTree (the target samples at every tree entry)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tiny_targets import build_target, small_model_config
from trainer.evaluate import acceptance_length, decode
from trainer.model import DFlashDrafter
from trainer.sampling import accept_greedy, accept_sampled, choose, probabilities, residual

VOCAB, MASK = 4, 3
PROMPT = [1, 2, 0, 1]
N = 3  # tokens per decode: 4^3 = 64 cells
RUNS = 1500
ALPHA = 1e-3  # a correct implementation fails one seed in a thousand; the seed is fixed, so no flakes


@pytest.fixture(scope="module")
def small():
    """A target whose next-token distributions over 4 tokens are spread (its head scaled down), and a
    random block-4 drafter whose q is sharper and different: every round mixes accepts and rejections.
    One layer each: the test decodes 3 x 1500 times and the distributions' shape, not depth, is the point."""
    target = build_target("qwen3", layers=1, layer_ids=(0,), vocab=VOCAB)
    with torch.no_grad():
        target.hf.lm_head.weight.mul_(0.25)
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(small_model_config(block_size=4, num_draft_layers=1), target, MASK).eval()
    with torch.no_grad():
        drafter.norm.weight.mul_(2.0)
    return target, drafter


def _exact(target, temperature):
    """P(t_1..t_N) under the target's own sampling at `temperature`, by enumeration."""
    prefixes = list(itertools.product(range(VOCAB), repeat=N - 1))
    ids = torch.tensor([PROMPT + list(p) for p in prefixes])
    with torch.no_grad():
        logp = torch.log_softmax(target.hf(ids).logits.double() / temperature, dim=-1)
    out = {}
    for i, pre in enumerate(prefixes):
        head = sum(logp[i, len(PROMPT) - 1 + k, pre[k]] for k in range(N - 1))
        for x in range(VOCAB):
            out[pre + (x,)] = float((head + logp[i, -1, x]).exp())
    return out


def _chi_square_p(counts, exact, runs):
    """Pearson's test; cells expecting < 5 are pooled. Returns the p-value (chi-square survival function)."""
    stat, dof, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for cell, prob in exact.items():
        e = prob * runs
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + counts.get(cell, 0)
            continue
        stat, dof = stat + (counts.get(cell, 0) - e) ** 2 / e, dof + 1
    if pooled_e > 0:
        stat, dof = stat + (pooled_o - pooled_e) ** 2 / pooled_e, dof + 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _emitted(target, drafter, temperature, budget, block_size=None):
    gen = torch.Generator().manual_seed(0)
    counts, lens = {}, []
    for _ in range(RUNS):
        d = decode(drafter, target, PROMPT, max_new_tokens=N, temperature=temperature, budget=budget, generator=gen,
                   block_size=block_size)
        counts[tuple(d.tokens)] = counts.get(tuple(d.tokens), 0) + 1
        lens += d.accept_lens
    return counts, lens


@pytest.mark.slow
@pytest.mark.parametrize("temperature,budget", [(1.0, None), (0.7, None), (1.0, 6)])
def test_emitted_sequences_follow_the_target_distribution(small, temperature, budget):
    target, drafter = small
    counts, lens = _emitted(target, drafter, temperature, budget)
    assert sum(counts.values()) == RUNS and all(len(c) == N for c in counts)
    # both branches of the rule ran many times: rounds that kept no draft, rounds that kept several
    assert lens.count(1) > 100 and sum(n >= 3 for n in lens) > 100, [lens.count(i) for i in range(1, 5)]
    p = _chi_square_p(counts, _exact(target, temperature), RUNS)
    assert p > ALPHA, p


@pytest.mark.slow
def test_the_bonus_token_after_every_draft_kept_follows_the_target_distribution(small):
    """Block 2 at decode time: one draft per round, so a round that keeps it emits the bonus token (the target's
    sample after the last draft) as the 3rd token, inside the 64 cells compared. A bonus taken as the argmax
    instead of a sample makes the third token a function of the first two in those rounds: chi-square p ~ 0."""
    target, drafter = small
    counts, lens = _emitted(target, drafter, 1.0, None, block_size=2)
    assert sum(counts.values()) == RUNS and all(len(c) == N for c in counts)
    assert lens.count(2) > 300, [lens.count(i) for i in (1, 2)]  # hundreds of rounds kept their draft
    p = _chi_square_p(counts, _exact(target, 1.0), RUNS)
    assert p > ALPHA, p


def test_the_bonus_token_is_sampled_from_the_targets_next_distribution():
    """Every draft kept (q == p, so every ratio is 1): the emitted token is a SAMPLE of p[n], the target's
    distribution after the last draft, not its argmax. Fixed seed, 4000 draws of p = (0.5, 0.3, 0.2, 0): each
    count within 5 standard deviations of 4000 p (a correct rule fails that about once in 10^6 seeds)."""
    gen = torch.Generator().manual_seed(0)
    after = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]])
    p = torch.cat([q, after[None]])
    runs, counts = 4000, [0] * 4
    for _ in range(runs):
        kept, token = accept_sampled(torch.tensor([1, 0]), q, p, gen)
        assert kept == 2
        counts[token] += 1
    for x, prob in enumerate(after.tolist()):
        sd = (runs * prob * (1 - prob)) ** 0.5
        assert abs(counts[x] - runs * prob) <= 5 * sd, (x, counts)


def test_rejection_rule_parts():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.6, 0.2, 0.0])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.equal(residual(p, p), p)  # nothing left to correct: the target itself
    # a draft the target cannot emit is always rejected; one it prefers over the drafter always kept
    gen = torch.Generator().manual_seed(0)
    zero = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    for _ in range(20):
        assert accept_sampled(torch.tensor([0]), torch.tensor([[0.5, 0.5, 0, 0]]), torch.cat([zero, zero]), gen) == (0, 1)
        assert accept_sampled(torch.tensor([1]), torch.tensor([[0.5, 0.5, 0, 0]]), torch.cat([zero, zero]), gen) == (1, 1)
    assert accept_greedy([4, 5, 6], [4, 5, 9, 7]) == (2, 9)
    assert accept_greedy([], [3]) == (0, 3)


def test_sampled_tau_is_reproducible_and_greedy_is_unchanged(small):
    target, drafter = small
    a = acceptance_length(drafter, target, [PROMPT, [0, 1]], 12, temperature=0.7, seed=3)
    b = acceptance_length(drafter, target, [PROMPT, [0, 1]], 12, temperature=0.7, seed=3)
    assert a.outputs == b.outputs and a.per_prompt == b.per_prompt and a.temperature == 0.7
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        decode(drafter, target, PROMPT, temperature=-1.0)


def test_greedy_acceptance_counts_each_kept_draft_once():
    """One draft kept of two: the count is 1 and the token is the target's choice after it (an odd count, so a
    step of 2 per kept draft cannot land on the same answer)."""
    assert accept_greedy([4, 5], [4, 9, 1]) == (1, 9)
    assert accept_greedy([4, 5], [4, 5, 1]) == (2, 1)


def test_a_draft_is_kept_only_when_u_is_below_the_ratio():
    """Kept with probability min(1, p/q): kept iff u < p/q. The generator's next u is read from a copy of its
    state and the ratio set to exactly u (q = 1 at the draft), so u == ratio: the draft is rejected."""
    gen = torch.Generator().manual_seed(7)
    u = torch.rand(1, generator=torch.Generator().set_state(gen.get_state())).item()
    q = torch.tensor([[0.0, 1.0, 0.0]])
    p = torch.tensor([[1.0 - u, u, 0.0], [0.0, 0.0, 1.0]])
    assert accept_sampled(torch.tensor([1]), q, p, gen) == (0, 0)  # the residual max(p - q, 0) is all on token 0


def test_choose_and_probabilities_at_the_temperature_edges():
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 4.0]],
                           [[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 7.0, 0.0], [0.0, 1.0, 2.0, 3.0]]])  # [2, 3, 4]
    assert torch.equal(choose(logits, 0.0, None), torch.tensor([[1, 0, 3], [0, 2, 3]]))  # argmax per row at T = 0
    with pytest.raises(ValueError, match="temperature must be > 0 for a sampling distribution, got 0"):
        probabilities(logits, 0.0)
    assert torch.allclose(probabilities(logits, 2.0), torch.softmax(logits / 2.0, dim=-1))


def test_residual_normalises_each_row():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]])
    q = torch.tensor([[0.2, 0.6, 0.2, 0.0], [0.4, 0.4, 0.1, 0.1]])
    assert torch.allclose(residual(p, q), torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]]))
