"""Token choice for speculative decoding: greedy, or sampling at a temperature, lossless either way.

Greedy (temperature 0): the target's argmax decides; a draft token is kept while it equals it.

Sampling (temperature T > 0), the standard speculative-sampling rule for a chain of drafts x_1..x_n drawn
from the drafter's distributions q_1..q_n, with p_k the target's distribution at the same position
(both softmax(logits / T)):

    for k = 1..n:  keep x_k with probability min(1, p_k(x_k) / q_k(x_k));
                   on the first rejection emit a token from norm(max(p_k - q_k, 0)) and stop;
    all kept:      emit a token from p_{n+1} (the target's next token after the last draft).

Every emitted token is then distributed exactly as the target's own sample at that position:
P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p(x), q(x))) * max(p(y) - q(y), 0) / sum_x max(p(x) - q(x), 0)
          = min(p(y), q(y)) + max(p(y) - q(y), 0) = p(y).
DFlash drafts every position independently (q_k does not depend on x_1..x_{k-1}), which the rule allows:
the proposal at step k may be any distribution fixed before x_k is drawn.
"""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in float32 over the last dimension.

    Raises:
        ValueError: temperature <= 0 (greedy decoding uses argmax, not a distribution).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for a sampling distribution, got {temperature}")
    return torch.softmax(logits.float() / temperature, dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of ``probs`` ([..., V]) -> [...] long, from ``generator`` (on the probs' device)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token(s) at ``temperature``: argmax at 0, else a sample of softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return draw(probabilities(logits, temperature), generator)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): where to sample after rejecting a draft.

    When p <= q everywhere (only possible when p == q up to rounding, where a rejection has probability ~0)
    the residual is empty; p itself is then the right distribution.
    """
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def accept_greedy(drafts: list[int], target_choice: list[int]) -> tuple[int, int]:
    """Greedy chain acceptance.

    Args:
        drafts: x_1..x_n.
        target_choice: the target's argmax at the block's positions, n + 1 of them (index k = after x_k).

    Returns:
        (number of drafts kept, the target's next token after them).
    """
    n = 0
    while n < len(drafts) and drafts[n] == target_choice[n]:
        n += 1
    return n, target_choice[n]


def accept_sampled(
    drafts: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative-sampling chain acceptance (see the module docstring).

    Args:
        drafts: [n] draft tokens, x_k drawn from q[k].
        q: [n, V] the drafter's distributions (None when n == 0).
        p: [n + 1, V] the target's distributions (row k = after the first k drafts).
        generator: random source (its device must be p's).

    Returns:
        (number of drafts kept, the emitted token after them).
    """
    n = int(drafts.shape[0])
    if n:
        idx = torch.arange(n, device=p.device)
        ratio = p[idx, drafts] / q[idx, drafts].clamp_min(torch.finfo(q.dtype).tiny)
        u = torch.rand(n, generator=generator, device=p.device)
        rejected = (u >= ratio).nonzero()
        if rejected.numel():
            k = int(rejected[0, 0])
            return k, int(draw(residual(p[k], q[k]), generator))
    return n, int(draw(p[n], generator))
