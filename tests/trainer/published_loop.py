"""Drive an exported drafter the way the published DFlash decode loop does, under whatever transformers this
interpreter has (test_export runs it under 5.x and under a 4.57 venv).

The published loop's calling convention (facts, not its code): the drafter gets a ``transformers.DynamicCache()``
as ``past_key_values``, is called with keywords ``target_hidden``, ``noise_embedding``, ``position_ids`` (from
the draft cache's length to the block's end), ``use_cache=True``, ``is_causal=False``; its cache is cropped to
the block start after each draft; the target's LM head turns the last bs-1 hidden states into logits.

Usage: python published_loop.py EXPORT_DIR_PARENT   (prints one JSON line; `run` returns it, in process)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModel, DynamicCache, Qwen3Config, Qwen3ForCausalLM

from trainer.config import ModelConfig
from trainer.engines import hf_greedy_batch as batched_greedy
from trainer.evaluate import acceptance_length, greedy_generate
from trainer.export_eval import load_export
from trainer.export import export_drafter
from trainer.features import TargetModel
from trainer.model import DFlashDrafter
from trainer.objective import PackedBatch, dflash_loss

MASK, BS, N = 255, 4, 24
torch.set_num_threads(1)  # tiny models: intra-op threads only add contention on a shared box


def _target() -> TargetModel:
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    hf = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    return TargetModel(hf, [1, 2, 3])


def _crop(cache, length: int) -> None:
    if transformers.__version__.startswith("4."):
        cache.crop(length)  # exactly what the published loop calls (4.57 keeps the first `length`)
    else:
        cache.crop(length - cache.get_seq_length())  # 5.x refuses a positive crop


@torch.no_grad()
def published_decode(model, target: TargetModel, prompt: list[int]) -> tuple[list[int], list[int]]:
    hf, dev = target.hf, target.device
    tcache, dcache = DynamicCache(), DynamicCache()
    ids = torch.tensor([prompt], device=dev)
    out = hf(input_ids=ids, past_key_values=tcache, use_cache=True, output_hidden_states=True)
    tokens = [int(out.logits[0, -1].argmax())]
    ctx = model.extract_context_feature(out.hidden_states)
    start, lens = len(prompt), []
    while start < len(prompt) + N:
        block = torch.full((1, BS), MASK, dtype=torch.long, device=dev)
        block[0, 0] = tokens[-1]
        pos = torch.arange(dcache.get_seq_length(), start + BS, device=dev)[None]
        hidden = model(
            target_hidden=ctx, noise_embedding=hf.get_input_embeddings()(block), position_ids=pos,
            past_key_values=dcache, use_cache=True, is_causal=False,
        )
        _crop(dcache, start)
        block[0, 1:] = hf.get_output_embeddings()(hidden[:, 1 - BS :].to(hf.dtype)).argmax(-1)[0]
        out = hf(input_ids=block, position_ids=torch.arange(start, start + BS, device=dev)[None],
                 past_key_values=tcache, use_cache=True, output_hidden_states=True)
        verdict = out.logits[0].argmax(-1)
        n = 0
        while n < BS - 1 and int(block[0, n + 1]) == int(verdict[n]):
            n += 1
        tokens += block[0, 1 : n + 1].tolist() + [int(verdict[n])]
        start += n + 1
        _crop(tcache, start)
        ctx = model.extract_context_feature(out.hidden_states)[:, : n + 1]
        lens.append(n + 1)
    return tokens[:N], lens


def _fitted_drafter(target: TargetModel, prompts: list[list[int]]) -> DFlashDrafter:
    """A drafter fitted to the target's continuations of ``prompts``, so rounds accept several drafts.

    The continuations are only training data: generated in one batch (the prompts have one length), 40
    forwards instead of 40 per prompt."""
    ids = torch.tensor([p + r for p, r in zip(prompts, batched_greedy(target, prompts, 40, set(), pad_id=0))])
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 8:] = 1
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    batch = PackedBatch(ids, loss_mask, torch.zeros_like(ids), pos, target.features(ids))
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(ModelConfig(block_size=BS, num_draft_layers=2, attention_backend="sdpa"), target, MASK)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        loss = dflash_loss(drafter, batch, num_anchors=16, gamma=2.0, generator=g).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def run(root: str) -> dict:
    """Export a fitted drafter under ``root`` and decode 4 prompts every way; the JSON-able result."""
    target = _target()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, MASK, (8,), generator=g).tolist() for _ in range(4)]
    out = export_drafter(_fitted_drafter(target, prompts), target, Path(root) / "export")  # bf16, as shipped
    via_auto = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.bfloat16).eval()
    shipped = load_export(out)
    result = {"transformers": transformers.__version__, "dtype": str(shipped.fc.weight.dtype), "prompts": []}
    ours = acceptance_length(shipped, target, prompts, N)
    for i, p in enumerate(prompts):
        toks, lens = published_decode(via_auto, target, p)
        gen, sg_lens = via_auto.spec_generate(target.hf, torch.tensor([p]), max_new_tokens=N, return_stats=True)
        result["prompts"].append({
            "greedy": greedy_generate(target, p, N), "published": toks, "published_lens": lens,
            "spec_generate": gen[0, len(p):].tolist(), "spec_generate_lens": sg_lens,
            "ours": ours.outputs[i], "ours_tau": ours.per_prompt[i],
        })
    return result


def main(root: str) -> None:
    print(json.dumps(run(root)))


if __name__ == "__main__":
    main(sys.argv[1])
