"""Acceptance length τ by real speculative decoding against the target (docs/dflash.md §1.5, §3, §5).

One prompt, batch 1:

    prefill the prompt (P tokens) -> the target's token at position P (argmax, or a sample at T > 0)
    round at cursor `start` (the last committed token's position):
        draft   one drafter forward over [token@start, MASK x (bs-1)] seeing features < start only
                -> per-position logits for positions start+1 .. start+bs-1
        verify  chain: the target on [token, d_1 .. d_{bs-1}] (drafts = argmax, or samples of q at T > 0)
                tree:  the target on a DDTree of at most B drafts in one forward (trainer.ddtree)
        accept  greedy: longest run of drafts equal to the target's argmax; T > 0: speculative sampling
                (trainer.sampling); then the target's next token
        commit  the kept drafts and the next token; acceptance length = kept + 1; the target's cache keeps
                the prefix and the accepted path; the drafter's new context = their target features
    rounds continue while fewer than N tokens went through a verify round (start < P + N); the output is
    cut to N tokens and after the first stop token; a round that commits a stop token is the last.

This is the counting of the published DFlash benchmark: τ = mean over prompts of the per-prompt mean
acceptance length, and the token from the prefill counts only once a round has verified it.

The drafter is either the trainer's in-memory `DFlashDrafter` or the shipped artifact: the exported
directory loaded with ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` (`load_export`), or the
same remote code built in memory from the trainer's weights cast to the export dtype (`shipped_model`);
both, the periodic evaluation of training and `python -m trainer eval` live in trainer.export_eval.
Every committed token is the target's own choice: greedy output equals plain greedy target decoding, and
sampled output is distributed as the target's own sampling at that temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.atomic import write_json
from trainer.ddtree import build_tree, keep_path, verify_inputs, walk
from trainer.metrics import tau_key, width_key
from trainer.sampling import accept_greedy, accept_sampled, choose, draw, probabilities


@dataclass
class TauReport:
    """τ over a prompt set for one decoding mode.

    Attributes:
        per_prompt: mean acceptance length (accepted drafts + 1 per round) of each prompt.
        mean: mean of per_prompt (the reference benchmark's τ).
        histogram: histogram[n] = rounds with acceptance length n, n = 0..block_size (index 0 is always 0).
        outputs: generated token ids per prompt (prompt excluded).
        rounds: verify rounds per prompt.
        budget: DDTree node budget (None: chain).
        temperature: 0 = greedy.
        verify_width: mean tokens fed to one verifying target forward (chain: the block; tree: 1 + nodes).
    """

    per_prompt: list[float]
    mean: float
    histogram: list[int]
    outputs: list[list[int]] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    budget: int | None = None
    temperature: float = 0.0
    verify_width: float = 0.0

    def to_dict(self) -> dict:
        return {
            "tau": self.mean,
            "mode": "chain" if self.budget is None else "tree",
            "budget": self.budget,
            "temperature": self.temperature,
            "verify_width": self.verify_width,
            "per_prompt": self.per_prompt,
            "histogram": self.histogram,
            "rounds": self.rounds,
        }


@dataclass
class EvalReport:
    """τ for the chain and every DDTree budget, at every temperature (one `TauReport` each)."""

    reports: list[TauReport]

    def get(self, budget: int | None = None, temperature: float = 0.0) -> TauReport | None:
        """The report of one mode (budget None = chain), or None if it was not measured."""
        for r in self.reports:
            if r.budget == budget and r.temperature == temperature:
                return r
        return None

    @property
    def tau(self) -> float:
        """Greedy chain τ (the published benchmark's headline number)."""
        chain = self.get(None, 0.0) or self.reports[0]
        return chain.mean

    def to_record(self) -> dict:
        """Flat numbers for a metrics.jsonl line (key names: `trainer.metrics.tau_key` / `width_key`)."""
        rec: dict = {"tau": self.tau}
        for r in self.reports:
            rec[tau_key(r.budget, r.temperature)] = r.mean
            rec[width_key(r.budget, r.temperature)] = r.verify_width
        return rec

    def to_dict(self) -> dict:
        """The greedy chain's report at the top (the eval json's long-standing keys), every mode in "results"."""
        chain = self.get(None, 0.0) or self.reports[0]
        top = {k: v for k, v in chain.to_dict().items() if k in ("tau", "per_prompt", "histogram", "rounds")}
        return {**top, "num_prompts": len(chain.per_prompt), "results": [r.to_dict() for r in self.reports]}

    def save(self, path: str | Path) -> Path:
        """Write `to_dict` as JSON, whole or not at all (temp file + rename)."""
        return write_json(path, self.to_dict(), end="\n")

    def table(self) -> str:
        """A human table: one row per temperature, one column per mode (τ, then tokens per verify forward)."""
        modes = sorted({r.budget for r in self.reports}, key=lambda b: -1 if b is None else b)
        temps = sorted({r.temperature for r in self.reports})
        head = ["T"] + ["chain" if b is None else f"B={b}" for b in modes]
        rows = [head]
        for t in temps:
            row = [f"{t:g}"]
            for b in modes:
                r = self.get(b, t)
                row.append("-" if r is None else f"{r.mean:.3f} ({r.verify_width:.0f})")
            rows.append(row)
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
        return "τ (tokens per verify forward)\n" + "\n".join(lines)


# -- drafters ---------------------------------------------------------------------------------------
class _TrainerDraft:
    """The trainer's in-memory `DFlashDrafter` (its context cache and `draft_step`)."""

    def __init__(self, drafter):
        self.d = drafter

    def new_state(self):
        return self.d.new_cache()

    def logits(self, state, token: int, start: int, ctx, ctx_pos, bs: int) -> torch.Tensor:
        dev = self.d.device
        block = torch.full((1, bs), self.d.mask_token_id, dtype=torch.long, device=dev)
        block[0, 0] = token
        block_pos = torch.arange(start, start + bs, device=dev)[None]
        hidden = self.d.draft_step(block, ctx, ctx_pos, block_pos, state)
        return self.d.logits(hidden[0, 1:]).float()


class _ShippedDraft:
    """The exported remote code (`trainer/reference/dflash.py`) with transformers' own DynamicCache."""

    def __init__(self, model, target):
        self.m, self.target = model, target

    def new_state(self):
        from transformers import DynamicCache

        return DynamicCache()

    def logits(self, state, token: int, start: int, ctx, ctx_pos, bs: int) -> torch.Tensor:
        return self.m.draft_block(self.target.hf, token, start, ctx, ctx_pos, state, bs)


def _draft_source(drafter, target):
    if hasattr(drafter, "draft_block"):
        return _ShippedDraft(drafter, target)
    return _TrainerDraft(drafter)


# -- one decoding round -----------------------------------------------------------------------------
@dataclass
class _Round:
    kept: list[int]  # accepted draft tokens
    next: int  # the target's token after them
    feats: torch.Tensor  # [1, kept + 1, F] target features of the committed entries (root first)
    width: int  # tokens in the verify forward


def _chain_round(target, cache, root, q_logits, start, temperature, gen) -> _Round:
    dev = target.device
    q = None
    if q_logits is None:  # block size 1: plain target decoding
        drafts = torch.empty(0, dtype=torch.long, device=dev)
    elif temperature <= 0:
        drafts = q_logits.argmax(-1).to(dev)
    else:
        q = probabilities(q_logits, temperature).to(dev)
        drafts = draw(q, gen)
    ids = torch.cat([torch.tensor([root], device=dev), drafts])[None]
    logits, feats = target.logits_and_features(ids, cache)
    if temperature <= 0:
        n, nxt = accept_greedy(drafts.tolist(), logits[0].argmax(-1).tolist())
    else:
        n, nxt = accept_sampled(drafts, q, probabilities(logits[0], temperature), gen)
    target.crop_cache(cache, start + n + 1)
    return _Round(drafts[:n].tolist(), nxt, feats[:, : n + 1], ids.shape[1])


def _tree_round(target, cache, root, q_logits, start, budget, top_k, temperature, gen) -> _Round:
    if q_logits is None:
        log_q = torch.zeros(0, 1)
    else:
        log_q = torch.log_softmax(q_logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)
    tree = build_tree(log_q, root, budget, top_k)
    ids, pos, mask = verify_inputs(tree, start, start, target.device, target.hf.dtype)
    logits, feats = target.logits_and_features(ids, cache, position_ids=pos, attention_mask=mask)
    entries, nxt = walk(tree, choose(logits[0], temperature, gen).tolist())
    keep_path(cache, start, entries)
    idx = torch.tensor(entries, device=feats.device)
    return _Round([tree.tokens[e] for e in entries[1:]], nxt, feats.index_select(1, idx), len(tree))


# -- one prompt -------------------------------------------------------------------------------------
@dataclass
class Decoded:
    """One prompt's speculative decoding: its tokens, and per round the acceptance length and verify width."""

    tokens: list[int]
    accept_lens: list[int]
    widths: list[int]


def _block_size(drafter, block_size: int | None) -> int:
    bs = block_size or drafter.block_size
    if not 1 <= bs <= drafter.block_size:
        raise ValueError(f"block_size {bs} must be in 1..{drafter.block_size} (the drafter's trained block)")
    return bs


def _check_tree_attention(target) -> None:
    impl = getattr(target.config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        raise ValueError(
            f"DDTree verification passes the target an ancestor-only 4-D attention mask, which its attention "
            f"implementation {impl!r} does not take; load the target with attn_implementation='sdpa'"
        )


def _cut(tokens: list[int], n: int, stop: set[int]) -> list[int]:
    tokens = tokens[:n]
    for i, tok in enumerate(tokens):
        if tok in stop:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def decode(
    drafter,
    target,
    prompt: list[int],
    *,
    max_new_tokens: int = 64,
    block_size: int | None = None,
    budget: int | None = None,
    top_k: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_token_ids: list[int] | None = None,
) -> Decoded:
    """Speculative decoding of one prompt (see the module docstring).

    Args:
        drafter: a `trainer.model.DFlashDrafter`, or the shipped model (`load_export` / `shipped_model`).
        target: a `trainer.features.TargetModel`.
        prompt: token ids (at least one).
        max_new_tokens: N, the tokens to generate.
        block_size: test-time block (<= the drafter's); default: the drafter's. 1 = plain target decoding.
        budget: None = chain; else DDTree with at most this many draft nodes per round.
        top_k: DDTree candidates per position (default: the budget); 1 = the greedy chain as a tree.
        temperature: 0 = greedy; > 0 = speculative sampling at this temperature.
        generator: random source for T > 0 (on the target's device); None = torch's global one.
        stop_token_ids: end after the round that commits one of these.

    Returns:
        Decoded.

    Raises:
        ValueError: empty prompt, a block_size outside 1..drafter.block_size, a negative temperature.
    """
    bs = _block_size(drafter, block_size)
    if not prompt:
        raise ValueError("empty prompt: speculative decoding needs at least one prompt token")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if budget is not None:
        _check_tree_attention(target)
    source, stop, dev = _draft_source(drafter, target), set(stop_token_ids or []), target.device
    was_training = getattr(drafter, "training", False)
    # A drafter already all in eval mode (every decode of an evaluation after the first) is left alone: two
    # walks setting every module's mode per decoded prompt were ~5% of a tiny model's decode.
    switch = any(m.training for m in drafter.modules()) if hasattr(drafter, "modules") else was_training
    if switch:
        drafter.eval()
    try:
        cache = target.new_cache()
        logits, ctx = target.logits_and_features(torch.tensor([prompt], device=dev), cache)
        tokens = [int(choose(logits[0, -1], temperature, generator))]
        ctx_pos = torch.arange(len(prompt), device=dev)[None]
        state, start, lens, widths = source.new_state(), len(prompt), [], []
        while start < len(prompt) + max_new_tokens:
            q_logits = source.logits(state, tokens[-1], start, ctx, ctx_pos, bs) if bs > 1 else None
            if budget is None:
                r = _chain_round(target, cache, tokens[-1], q_logits, start, temperature, generator)
            else:
                r = _tree_round(target, cache, tokens[-1], q_logits, start, budget, top_k, temperature, generator)
            tokens += r.kept + [r.next]
            ctx, ctx_pos = r.feats, torch.arange(start, start + len(r.kept) + 1, device=dev)[None]
            start += len(r.kept) + 1
            lens.append(len(r.kept) + 1)
            widths.append(r.width)
            if stop.intersection(tokens):
                break
        return Decoded(_cut(tokens, max_new_tokens, stop), lens, widths)
    finally:
        if switch:
            drafter.train(was_training)


# -- a prompt set -----------------------------------------------------------------------------------
def acceptance_length(
    drafter,
    target,
    prompts: list[list[int]],
    max_new_tokens: int = 64,
    block_size: int | None = None,
    stop_token_ids: list[int] | None = None,
    *,
    budget: int | None = None,
    top_k: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> TauReport:
    """τ by real speculative decoding (see the module docstring) in one mode.

    Args:
        drafter: a `trainer.model.DFlashDrafter` or the shipped model.
        target: a `trainer.features.TargetModel`.
        prompts: token id lists (each non-empty).
        max_new_tokens: tokens generated per prompt.
        block_size: test-time block (default: the drafter's).
        stop_token_ids: stop a prompt after the round that commits one of these.
        budget: None = chain, else the DDTree node budget.
        top_k: DDTree candidates per position (default: the budget).
        temperature: 0 = greedy.
        seed: seeds the sampling generator (T > 0), so a report is reproducible.

    Returns:
        TauReport.

    Raises:
        ValueError: no prompts, an empty prompt, or a bad block_size.
    """
    if not prompts:
        raise ValueError("acceptance_length needs at least one prompt")
    bs = _block_size(drafter, block_size)
    gen = torch.Generator(device=target.device).manual_seed(seed) if temperature > 0 else None
    hist = [0] * (bs + 1)
    per_prompt, outputs, rounds, widths = [], [], [], []
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        d = decode(
            drafter, target, prompt, max_new_tokens=max_new_tokens, block_size=bs, budget=budget, top_k=top_k,
            temperature=temperature, generator=gen, stop_token_ids=stop_token_ids,
        )
        for n in d.accept_lens:
            hist[n] += 1
        per_prompt.append(sum(d.accept_lens) / len(d.accept_lens) if d.accept_lens else 1.0)
        outputs.append(d.tokens)
        rounds.append(len(d.accept_lens))
        widths += d.widths
    return TauReport(
        per_prompt=per_prompt,
        mean=sum(per_prompt) / len(per_prompt),
        histogram=hist,
        outputs=outputs,
        rounds=rounds,
        budget=budget,
        temperature=float(temperature),
        verify_width=sum(widths) / len(widths) if widths else 0.0,
    )


def evaluate(
    drafter,
    target,
    prompts: list[list[int]],
    *,
    budgets=(16, 32, 64, 128),
    temperatures=(0.0,),
    max_new_tokens: int = 64,
    stop_token_ids: list[int] | None = None,
    seed: int = 0,
) -> EvalReport:
    """τ of the chain and of every DDTree budget, at every temperature (same prompts, same seed)."""
    reports = []
    for t in temperatures:
        for b in [None, *budgets]:
            reports.append(
                acceptance_length(
                    drafter, target, prompts, max_new_tokens, stop_token_ids=stop_token_ids, budget=b,
                    temperature=float(t), seed=seed,
                )
            )
    return EvalReport(reports)


@torch.no_grad()
def greedy_generate(target, prompt: list[int], max_new_tokens: int, stop_token_ids: list[int] | None = None) -> list[int]:
    """Plain greedy decoding of one prompt by the trainer's TargetModel with its KV cache, up to and including
    the first stop token: the lossless reference τ's decoding must reproduce. (trainer.engines.hf_greedy_batch
    is the regeneration's: many prompts through transformers' generate, the end-of-sequence token cut.)"""
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

