"""Acceptance length τ by real greedy speculative decoding against the target (reference/dflash.md §1.5, §3).

One prompt, batch 1, temperature 0:

    prefill the prompt (P tokens) -> target logits and features for positions 0..P-1
    bonus = argmax at P-1 (the token at position P); the drafter's context = features 0..P-1
    round at cursor `start` (the bonus position):
        draft  block [bonus, MASK x (bs-1)] at positions start..start+bs-1, seeing features < start only
        verify the target on [bonus, d_1 .. d_{bs-1}] at the same positions (its cache holds 0..start-1)
        accept the longest prefix with d_k == argmax_target(position start+k-1), k = 1..n
        commit d_1..d_n and the target's next token (the new bonus) -> acceptance length n + 1
        the drafter's new context = target features of positions start..start+n from the verify pass;
        the target cache is cropped to start+n+1

Every committed token is the target's own greedy choice, so the output equals plain greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TauReport:
    """τ over a prompt set.

    Attributes:
        per_prompt: mean acceptance length (accepted drafts + 1 bonus per round) of each prompt.
        mean: mean of per_prompt (the reference benchmark's τ).
        histogram: histogram[n] = rounds with acceptance length n, n = 0..block_size (index 0 is always 0).
        outputs: generated token ids per prompt (prompt excluded).
        rounds: verify rounds per prompt.
    """

    per_prompt: list[float]
    mean: float
    histogram: list[int]
    outputs: list[list[int]] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "tau": self.mean,
            "per_prompt": self.per_prompt,
            "histogram": self.histogram,
            "rounds": self.rounds,
        }


@torch.no_grad()
def speculative_generate(
    drafter,
    target,
    prompt: list[int],
    *,
    max_new_tokens: int = 64,
    block_size: int | None = None,
    stop_token_ids: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding of one prompt.

    Args:
        drafter: a `trainer.model.DFlashDrafter` (borrowing ``target``'s embedding and head).
        target: a `trainer.features.TargetModel`.
        prompt: token ids (at least one).
        max_new_tokens: tokens to generate (the output is cut to this length).
        block_size: test-time block (<= the drafter's); default: the drafter's. 1 = plain target decoding.
        stop_token_ids: stop after committing any of these.

    Returns:
        (generated ids, acceptance length of each round).

    Raises:
        ValueError: empty prompt, or a block_size outside 1..drafter.block_size.
    """
    bs = block_size or drafter.block_size
    if not 1 <= bs <= drafter.block_size:
        raise ValueError(f"block_size {bs} must be in 1..{drafter.block_size} (the drafter's trained block)")
    if not prompt:
        raise ValueError("empty prompt: speculative decoding needs at least one prompt token")
    stop = set(stop_token_ids or [])
    dev = target.device
    was_training = drafter.training
    drafter.eval()
    try:
        ids = torch.tensor([prompt], device=dev)
        P = ids.shape[1]
        cache = target.new_cache()
        logits, feats = target.logits_and_features(ids, cache)
        bonus = int(logits[0, -1].argmax())
        out = [bonus]
        accept_lens: list[int] = []
        dcache = drafter.new_cache()
        new_feats, new_pos = feats, torch.arange(P, device=dev)[None]  # context the drafter has not seen yet
        start = P
        while len(out) < max_new_tokens and bonus not in stop:
            block = torch.full((1, bs), drafter.mask_token_id, dtype=torch.long, device=dev)
            block[0, 0] = bonus
            if bs > 1:
                block_pos = torch.arange(start, start + bs, device=dev)[None]
                hidden = drafter.draft_step(block, new_feats, new_pos, block_pos, dcache)
                block[0, 1:] = drafter.logits(hidden[:, 1:]).argmax(-1).to(dev)[0]
            logits, feats = target.logits_and_features(block, cache)
            verdict = logits[0].argmax(-1)  # verdict[i] = target's token at position start+i+1
            n = 0
            while n < bs - 1 and int(block[0, n + 1]) == int(verdict[n]):
                n += 1
            committed = block[0, 1 : n + 1].tolist() + [int(verdict[n])]
            accept_lens.append(n + 1)
            target.crop_cache(cache, start + n + 1)
            new_feats = feats[:, : n + 1]
            new_pos = torch.arange(start, start + n + 1, device=dev)[None]
            start += n + 1
            for tok in committed:
                out.append(tok)
                if tok in stop:
                    break
            bonus = out[-1]
        return out[:max_new_tokens], accept_lens
    finally:
        drafter.train(was_training)


def acceptance_length(
    drafter,
    target,
    prompts: list[list[int]],
    max_new_tokens: int = 64,
    block_size: int | None = None,
    stop_token_ids: list[int] | None = None,
) -> TauReport:
    """τ by real greedy speculative decoding (see module docstring).

    Args:
        drafter: a `trainer.model.DFlashDrafter`.
        target: a `trainer.features.TargetModel`.
        prompts: token id lists (each non-empty).
        max_new_tokens: tokens generated per prompt.
        block_size: test-time block (default: the drafter's).
        stop_token_ids: stop a prompt after committing one of these.

    Returns:
        TauReport.

    Raises:
        ValueError: no prompts, an empty prompt, or a bad block_size.
    """
    if not prompts:
        raise ValueError("acceptance_length needs at least one prompt")
    bs = block_size or drafter.block_size
    hist = [0] * (bs + 1)
    per_prompt, outputs, rounds = [], [], []
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        out, lens = speculative_generate(
            drafter, target, prompt, max_new_tokens=max_new_tokens, block_size=bs, stop_token_ids=stop_token_ids
        )
        for n in lens:
            hist[n] += 1
        # A prompt that stops right after the prefill has no rounds: its τ is undefined, count it as 1.
        per_prompt.append(sum(lens) / len(lens) if lens else 1.0)
        outputs.append(out)
        rounds.append(len(lens))
    return TauReport(
        per_prompt=per_prompt,
        mean=sum(per_prompt) / len(per_prompt),
        histogram=hist,
        outputs=outputs,
        rounds=rounds,
    )


@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new_tokens: int, stop_token_ids: list[int] | None = None) -> list[int]:
    """Plain greedy decoding of the target with its KV cache (the lossless reference)."""
    stop = set(stop_token_ids or [])
    cache = target.new_cache()
    ids = torch.tensor([prompt], device=target.device)
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits, _ = target.logits_and_features(ids, cache)
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in stop:
            break
        ids = torch.tensor([[tok]], device=target.device)
    return out
