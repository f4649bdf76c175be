"""Cost of DDTree verification per target forward: one forward over a tree of B drafts (1 + B tokens, ancestor
mask) against one forward over a chain block (block_size tokens, causal), both after the same committed prefix
in the target's KV cache. Also the cost of building the tree (best-first heap) and of keeping the accepted path.

    python bench/ddtree_verify.py                      # a random Qwen3 on the CPU (fp32)
    python bench/ddtree_verify.py --device cuda        # bf16 on a GPU
    python bench/ddtree_verify.py --hidden 4096 --layers 36 --heads 32 --kv-heads 8 --device cuda   # Qwen3-8B shape

Prints the median time of each, and its ratio to the chain block's forward measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _target(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.features import TargetModel

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=args.prefix + 1024, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    hf = Qwen3ForCausalLM(cfg).to(args.device, dtype).eval()
    return TargetModel(hf, [1, args.layers // 2, args.layers - 2])


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median(fn, device, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from trainer.ddtree import build_tree, keep_path, verify_inputs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prefix", type=int, default=512, help="committed tokens in the cache before the block")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budgets", default="16,32,64,128")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (a shared box: 1 gives stable numbers)")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = _target(args)
    dev, P, bs = args.device, args.prefix, args.block_size
    g = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    target.logits_and_features(torch.randint(0, args.vocab, (1, P), generator=g).to(dev), cache)

    def chain():
        target.logits_and_features(torch.randint(0, args.vocab, (1, bs), generator=g).to(dev), cache)
        target.crop_cache(cache, P)

    base = _median(chain, dev, args.repeats)
    print(f"target h{args.hidden} x{args.layers} layers, vocab {args.vocab}, {dev}, prefix {P}")
    print(f"chain block of {bs}: {base * 1e3:8.2f} ms per verify forward (baseline 1.00x)")
    log_q = torch.log_softmax(torch.randn(bs - 1, args.vocab, generator=g) * 4, dim=-1)
    for budget in (int(b) for b in args.budgets.split(",")):
        tree = build_tree(log_q, 1, budget)
        ids, pos, mask = verify_inputs(tree, P, P, dev)
        path = tree.path(max(range(len(tree)), key=lambda i: tree.depths[i]))

        def verify():
            target.logits_and_features(ids, cache, position_ids=pos, attention_mask=mask)
            keep_path(cache, P, path)
            target.crop_cache(cache, P)

        build = _median(lambda: verify_inputs(build_tree(log_q, 1, budget), P, P, dev), "cpu", args.repeats)
        t = _median(verify, dev, args.repeats)
        print(
            f"tree B={budget:<4d} ({len(tree):4d} tokens): {t * 1e3:8.2f} ms per verify forward ({t / base:5.2f}x), "
            f"tree build + mask {build * 1e3:6.2f} ms ({build / base:5.2f}x)"
        )


if __name__ == "__main__":
    main()
