"""The data path at scale: synthetic conversations -> tokenise -> token store -> 8 rank processes map it ->
plan_epoch -> 100 steps of batch building, beside today's JSON-list path (load_samples) in the same run.

    python bench/data_scale.py                          # the seed's 1.1M conversations (hours on 2 cores)
    python bench/data_scale.py --conversations 4000     # a few minutes on a shared 2-core machine

Conversations are generated text of the tiny tokenizer's words (trainer/tiny.py), one user and one assistant
turn of --words-per-turn words each (default 150..1000: ~1,150 tokens a conversation, the seed's mean of
~1.3 billion tokens over 1.1M). The steps build the packed batches (trainer.packing.build_step) and skip the
model forward: it reads nothing from the data path. The list path runs on the first --list-conversations
samples of the same store (default: as many as 8 ranks can hold in half the machine's free memory at 34
bytes per token), written as samples.jsonl.

Printed per path: wall per stage, per rank the RSS growth per dataset token (private RssAnon, and RssFile:
pages of mapped files the rank touched, which the page cache holds once for every rank of a node), and the
seconds from the store existing to each rank's first step built. Goals: private RSS growth per rank <= 0.5
byte per token (the list path: ~33), the first step within 60 s of the store existing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROW_LEN = 4096
ROWS = 4


def _rss() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return int(d["RssAnon"].split()[0]) * 1024, int(d["RssFile"].split()[0]) * 1024


def rank_child(kind: str, path: str, ready_at: float, steps_wanted: int, rank: int) -> None:
    """One rank: open (store) or load (list), plan one epoch, build `steps_wanted` steps; print JSON."""
    import numpy as np

    from trainer.data import Sample, load_samples
    from trainer.packing import build_step, plan_epoch
    from trainer.store import open_store

    # torch's one-time start-up on full-size rows (its library pages, its threads): not the data's
    build_step([Sample(np.zeros(ROW_LEN, np.int32), np.zeros(ROW_LEN, np.uint8))], [[0]] * ROWS, ROW_LEN)
    base = _rss()
    t0 = time.time()
    samples = open_store(path) if kind == "store" else load_samples(path)
    lengths = samples.lengths if kind == "store" else [len(s) for s in samples]
    t1 = time.time()
    plan = plan_epoch(lengths, ROW_LEN, ROWS, ROW_LEN * ROWS, 0, rank)
    t2 = time.time()
    first = None
    for rows in plan[:steps_wanted]:
        build_step(samples, rows, ROW_LEN)
        first = first or time.time()
    t3 = time.time()
    anon, file = (a - b for a, b in zip(_rss(), base))
    print(json.dumps({"open_s": t1 - t0, "plan_s": t2 - t1, "steps_s": t3 - t2, "steps": min(steps_wanted, len(plan)),
                      "first_step_after_ready_s": first - ready_at, "first_step_after_open_s": first - t0,
                      "anon": anon, "file": file}))


def write_conversations(path: Path, n: int, words_per_turn: tuple[int, int], seed: int = 0) -> None:
    from trainer.config import TinyTargetConfig
    from trainer.tiny import generate_prompts

    vocab = sorted(set(" ".join(generate_prompts(TinyTargetConfig())).split()))
    rng = random.Random(seed)
    lo, hi = words_per_turn
    with open(path, "w") as f:
        for _ in range(n):
            u = " ".join(rng.choices(vocab, k=rng.randint(lo, hi)))
            a = " ".join(rng.choices(vocab, k=rng.randint(lo, hi)))
            f.write(json.dumps({"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]}) + "\n")


def run_ranks(kind: str, path: Path, ready_at: float, ranks: int, steps: int) -> tuple[float, list[dict]]:
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-child", kind, str(path), str(ready_at), str(steps), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for r in range(ranks)]
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            sys.exit(f"a {kind} rank failed (exit {p.returncode}):\n{err[-3000:]}")
    return time.time() - t0, [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def summarize(name: str, tokens: int, wall: float, res: list[dict]) -> dict:
    anon = [r["anon"] / tokens for r in res]
    file = [r["file"] / tokens for r in res]
    first = max(r["first_step_after_ready_s"] for r in res)
    own = max(r["first_step_after_open_s"] for r in res)
    print(f"{name}: {tokens:,} tokens; {len(res)} ranks in {wall:.1f} s wall; per rank: open/load "
          f"{max(r['open_s'] for r in res):.2f} s, plan_epoch {max(r['plan_s'] for r in res):.2f} s, "
          f"{res[0]['steps']} steps {max(r['steps_s'] for r in res):.2f} s; first step {first:.1f} s after the data existed "
          f"({own:.2f} s after the rank began opening it; the rest is 8 interpreters importing torch)")
    print(f"  RSS growth per token, per rank: private {min(anon):.3f}..{max(anon):.3f} B, "
          f"mapped file pages {min(file):.3f}..{max(file):.3f} B")
    return {"anon": max(anon), "file": max(file), "first": first, "open": max(r["open_s"] for r in res)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=1_100_000)
    p.add_argument("--words-per-turn", default="150,1000", help="LO,HI words of each turn (uniform)")
    p.add_argument("--list-conversations", type=int, default=None, help="samples on the list path (default: fit memory)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--workers", type=int, default=None, help="tokenising processes (default: the cores)")
    p.add_argument("--workdir", default=None, help="where the files go (default: a temporary directory)")
    p.add_argument("--rank-child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_child:
        kind, path, ready, steps, rank = args.rank_child
        rank_child(kind, path, float(ready), int(steps), int(rank))
        return

    from trainer.config import TinyTargetConfig
    from trainer.data import Sample, save_samples
    from trainer.storebuild import build_store
    from trainer.tiny import build_tokenizer

    work = Path(args.workdir or tempfile.mkdtemp(prefix="data_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    lo, hi = (int(x) for x in args.words_per_turn.split(","))
    print(f"data_scale: {args.conversations:,} conversations of {lo}..{hi} words a turn in {work}; {args.ranks} ranks, "
          f"{args.steps} steps of {ROWS} x {ROW_LEN} (batch building; the model forward is skipped)")
    conv = work / "conversations.jsonl"
    t = time.time()
    write_conversations(conv, args.conversations, (lo, hi))
    print(f"generate: {time.time() - t:.1f} s, {conv.stat().st_size / 2**20:.0f} MiB of jsonl")
    tok = build_tokenizer(TinyTargetConfig())
    t = time.time()
    store, _ = build_store([conv], tok, work / "datasets", max_len=ROW_LEN, workers=args.workers, log=lambda _: None)
    build_s = time.time() - t
    ready = time.time()
    disk = sum(f["bytes"] for f in store.manifest["files"].values())
    print(f"tokenise -> store: {build_s:.1f} s with {store.manifest['workers']} process(es): {len(store):,} samples, "
          f"{store.num_tokens:,} tokens ({store.num_tokens / build_s:,.0f} tokens/s), {disk / store.num_tokens:.2f} B/token on disk")
    wall, res = run_ranks("store", store.path, ready, args.ranks, args.steps)
    s = summarize("store", store.num_tokens, wall, res)

    n_list = args.list_conversations
    if n_list is None:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        per_sample = 34 * store.num_tokens / len(store)
        n_list = int(min(len(store), free / 2 / args.ranks / per_sample))
    n_list = min(n_list, len(store))
    jsonl = work / "samples.jsonl"
    t = time.time()
    save_samples([Sample(store[i].input_ids.tolist(), store[i].loss_mask.tolist(), store[i].source) for i in range(n_list)], jsonl)
    list_tokens = int(store.offsets[n_list])
    print(f"list path: {n_list:,} samples ({list_tokens:,} tokens) written as samples.jsonl in {time.time() - t:.1f} s "
          f"({jsonl.stat().st_size / list_tokens:.1f} B/token)")
    ready = time.time()
    wall, res = run_ranks("list", jsonl, ready, args.ranks, args.steps)
    ls = summarize("list", list_tokens, wall, res)
    print(f"ratios (list / store): private RSS per token {ls['anon'] / max(s['anon'], 1e-9):,.0f}x "
          f"({ls['anon']:.2f} vs {s['anon']:.4f} B/token); open/load per token "
          f"{(ls['open'] / list_tokens) / max(s['open'] / store.num_tokens, 1e-12):,.0f}x")
    print(f"goals: private RSS growth <= 0.5 B/token: {'met' if s['anon'] <= 0.5 else 'MISSED'} ({s['anon']:.4f}); "
          f"first step <= 60 s after the store exists: {'met' if s['first'] <= 60 else 'MISSED'} ({s['first']:.1f} s)")


if __name__ == "__main__":
    main()
