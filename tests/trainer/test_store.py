"""The token store: the same samples and training as the list path, built once per content key, never used when
truncated, corrupt or half-built, and a rank's memory that does not grow with the dataset (8 real rank processes
against the JSON-list path)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.config import TinyTargetConfig
from trainer.data import Sample, SkipReport, read_conversations, save_samples, tokenize
from trainer.packing import plan_epoch
from trainer.store import DATASETS_ENV, StoreError, datasets_root, open_store, store_dir, verify
from trainer.storebuild import build_store
from trainer.tiny import build_tokenizer, generate_prompts

REPO = Path(__file__).resolve().parents[2]
CFG = TinyTargetConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, head_dim=8, num_prompts=8, held_out=2)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CFG)


def write_conversations(path: Path, n: int, seed: int = 0, words: tuple[int, int] = (5, 40), bad_every: int = 0) -> Path:
    """n synthetic conversations (user, assistant) of the tiny tokenizer's words; every `bad_every`-th line broken."""
    vocab = sorted(set(" ".join(generate_prompts(TinyTargetConfig())).split()))
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            if bad_every and i % bad_every == bad_every - 1:
                f.write("{not json\n" if i % 2 else json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
                continue
            u = " ".join(rng.choice(vocab) for _ in range(rng.randint(*words)))
            a = " ".join(rng.choice(vocab) for _ in range(rng.randint(*words)))
            f.write(json.dumps({"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": a}]}) + "\n")
    return path


def list_path(files, tok, max_len, kw=None):
    report = SkipReport()
    return tokenize(read_conversations(files, report), tok, max_len, report, chat_template_kwargs=kw), report


def test_store_holds_the_list_paths_samples_in_order_with_its_skip_report(tmp_path, tok):
    files = [write_conversations(tmp_path / "a.jsonl", 230, 1, bad_every=17), write_conversations(tmp_path / "b.jsonl", 90, 2)]
    want, report = list_path(files, tok, 60)
    assert report.counts["over-long"] and report.counts["bad JSON"]  # the report has something to merge
    store, built = build_store(files, tok, tmp_path / "ds", max_len=60, workers=2, lines_per_chunk=40, log=lambda _: None)
    assert built and len(store) == len(want) and store.num_tokens == sum(len(s) for s in want)
    for s, w in zip(store, want):
        assert s.input_ids.tolist() == w.input_ids and s.loss_mask.tolist() == w.loss_mask and s.source == w.source
    assert store.lengths.tolist() == [len(s) for s in want]
    assert store.skipped == json.loads(json.dumps(report.to_dict()))
    assert not store.ids.flags.writeable  # mapped read-only: no rank can change what another reads
    verify(store.path)


def _plan_reference(lengths, row_len, rows_per_step, token_budget, seed, epoch, lookahead=32):
    """The packing rule as first written (the queue rebuilt every step): the plan must not change."""
    order = list(range(len(lengths)))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    steps, queue = [], order
    while queue:
        rows, used, waiting, k = [], [], [], 0
        while k < len(queue) and len(waiting) < lookahead:
            i = queue[k]
            k += 1
            r = next((j for j, u in enumerate(used) if u + lengths[i] <= row_len), None)
            if r is None and len(rows) < rows_per_step:
                rows.append([])
                used.append(0)
                r = len(rows) - 1
            if r is None:
                waiting.append(i)
                continue
            rows[r].append(i)
            used[r] += lengths[i]
        steps.append(rows)
        queue = waiting + queue[k:]
    return steps


def test_plan_epoch_on_a_lengths_array_is_the_plan_of_the_list():
    import numpy as np

    rng = random.Random(3)
    for trial in range(6):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(50, 700))]
        rows, la = rng.randint(1, 5), rng.choice([1, 4, 32])
        want = _plan_reference(lengths, 100, rows, 100 * rows, trial, 1, la)
        assert plan_epoch(lengths, 100, rows, 100 * rows, trial, 1, lookahead=la) == want
        assert plan_epoch(np.asarray(lengths, dtype=np.int32), 100, rows, 100 * rows, trial, 1, lookahead=la) == want


def test_the_tiny_run_trains_the_same_on_the_store_as_on_the_list(tmp_path):
    """Every batch of the tiny run's plan (ids, masks, positions and the target's features) and the loss of every
    optimizer step are identical on the store and on today's list of Samples."""
    import dataclasses

    from tests.trainer.test_trainer_launch import small_config
    from trainer.config import parse_config
    from trainer.batches import anchor_generator, compute_batch, make_plan
    from trainer.model import DFlashDrafter
    from trainer.objective import dflash_loss
    from trainer.setup import load_assets, resolve_sources, seed_everything

    cfg = parse_config(small_config(tmp_path / "run"))
    assets = load_assets(cfg, torch.device("cpu"), builds_data=True, wants_eval=False, log=lambda _: None)
    assert type(assets.samples).__name__ == "TokenStore" and (tmp_path / "run" / "data" / "store.json").is_file()
    src = resolve_sources(cfg, lambda _: None)
    samples, _ = list_path(src.train_files, assets.tokenizer, cfg.data.max_len, dict(cfg.data.chat_template_kwargs))
    listed = dataclasses.replace(assets, samples=samples)
    plan = make_plan(cfg, assets.samples.lengths, cfg.batches_per_step)
    assert plan == make_plan(cfg, [len(s) for s in samples], cfg.batches_per_step)
    losses = []
    for a in (assets, listed):
        seed_everything(cfg.seed)
        drafter = DFlashDrafter.from_target(cfg.model, a.target, a.mask_token_id, "float32")
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
        curve, batches = [], []
        for b, (_, rows) in enumerate(plan.batches[: plan.steps * plan.per_step]):
            batch, _ = compute_batch(a, rows, cfg)
            batches.append(batch)
            res = dflash_loss(drafter, batch, num_anchors=cfg.data.num_anchors, gamma=cfg.resolved_gamma,
                              generator=anchor_generator(cfg.seed, b))
            res.loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(res.loss.item())
        losses.append((curve, batches))
    (c1, b1), (c2, b2) = losses
    assert c1 == c2 and len(c1) == plan.steps * plan.per_step
    for x, y in zip(b1, b2):
        for f in ("input_ids", "loss_mask", "doc_ids", "position_ids", "target_hidden"):
            assert torch.equal(getattr(x, f), getattr(y, f)), f


def test_same_inputs_reuse_the_store_and_any_changed_input_makes_a_new_one(tmp_path, tok):
    f = write_conversations(tmp_path / "a.jsonl", 60)
    root = tmp_path / "ds"
    first, built = build_store([f], tok, root, max_len=80, log=lambda _: None)
    assert built
    stamp = first.manifest["built_at"]
    copy = tmp_path / "elsewhere.jsonl"
    copy.write_bytes(f.read_bytes())
    for files in ([f], [copy]):  # the same content under another name is the same dataset
        again, built = build_store(files, tok, root, max_len=80, log=lambda _: None)
        assert not built and again.path == first.path
        assert json.loads((again.path / "manifest.json").read_text())["built_at"] == stamp
    other_max, b1 = build_store([f], tok, root, max_len=81, log=lambda _: None)
    other_kw, b2 = build_store([f], tok, root, max_len=80, chat_template_kwargs={"enable_thinking": False}, log=lambda _: None)
    with open(f, "a") as fh:
        fh.write(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b c"}]}) + "\n")
    other_file, b3 = build_store([f], tok, root, max_len=80, log=lambda _: None)
    assert b1 and b2 and b3
    assert len({first.path, other_max.path, other_kw.path, other_file.path}) == 4
    assert len(other_file) == len(first) + 1


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_truncated_or_corrupt_store_file_is_a_clear_error_naming_it_and_the_fix(tmp_path, tok):
    f = write_conversations(tmp_path / "a.jsonl", 40)
    root = tmp_path / "ds"
    store, _ = build_store([f], tok, root, max_len=80, log=lambda _: None)
    ids = store.path / "ids.npy"
    data = ids.read_bytes()
    ids.write_bytes(data[:-8])  # truncated
    with pytest.raises(StoreError, match=r"ids\.npy: \d+ bytes, the manifest says \d+.*rm -r -- ") as e:
        build_store([f], tok, root, max_len=80, log=lambda _: None)  # found by its key: refused, not used
    assert str(store.path) in str(e.value)
    ids.write_bytes(data)
    mask = store.path / "mask.npy"
    raw = bytearray(mask.read_bytes())
    raw[-1] ^= 1  # corrupt, same size: opening is cheap (sizes), verify reads every byte
    mask.write_bytes(bytes(raw))
    open_store(store.path)
    with pytest.raises(StoreError, match=r"mask\.npy: sha256 .* is not the manifest's .*corrupt"):
        verify(store.path)
    cli = subprocess.run([sys.executable, "-m", "trainer.store", "verify", str(store.path)], capture_output=True, text=True,
                         cwd=REPO)
    assert cli.returncode == 1 and "mask.npy" in cli.stderr and "rm -r -- " in cli.stderr
    # The printed fix works as printed: the store is deleted, and the next build makes it again.
    fix = cli.stderr.split("(rm -r -- ")[1].split(")")[0]
    subprocess.run(f"rm -r -- {fix}", shell=True, check=True)
    again, built = build_store([f], tok, root, max_len=80, log=lambda _: None)
    assert built and again.path == store.path
    verify(again.path)


def test_a_manifest_that_does_not_match_is_refused(tmp_path, tok):
    f = write_conversations(tmp_path / "a.jsonl", 40)
    store, _ = build_store([f], tok, tmp_path / "ds", max_len=80, log=lambda _: None)
    mf = store.path / "manifest.json"
    m = json.loads(mf.read_text())
    mf.write_text(json.dumps(dict(m, tokens=m["tokens"] + 1)))
    with pytest.raises(StoreError, match=r"ids\.npy: .*the manifest says"):
        open_store(store.path)
    mf.write_text(json.dumps(m))
    other = store_dir(tmp_path / "ds", "0" * 64)
    store.path.rename(other)  # a store filed under another key
    with pytest.raises(StoreError, match=r"manifest\.json: the manifest's key .* is not the key"):
        open_store(other, "0" * 64)
    (other / "manifest.json").unlink()
    with pytest.raises(StoreError, match=r"manifest\.json: no manifest.*rm -r -- "):
        open_store(other)


_BUILD = """
import sys
from trainer.storebuild import build_store
from trainer.tiny import build_tokenizer
from tests.trainer.test_store import CFG
build_store([sys.argv[1]], build_tokenizer(CFG), sys.argv[2], max_len=80, workers=1, lines_per_chunk=25)
print("built")
"""


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_build_killed_half_way_leaves_nothing_that_is_used(tmp_path, tok):
    f = write_conversations(tmp_path / "a.jsonl", 1500)
    root = tmp_path / "ds"
    proc = subprocess.Popen([sys.executable, "-c", _BUILD, str(f), str(root)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not list(root.glob(".tmp-tokens-*/chunks/000002.ids")):  # some chunks tokenised, far from done
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "slow"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not list(root.glob("tokens-*")) and list(root.glob(".tmp-tokens-*"))
    store, built = build_store([f], tok, root, max_len=80, log=lambda _: None)
    assert built and not list(root.glob(".tmp-tokens-*"))  # the dead build's leftovers are cleared
    verify(store.path)
    want, _ = list_path([f], tok, 80)
    assert store.lengths.tolist() == [len(s) for s in want]


def test_the_datasets_root_is_the_workdirs_shared_by_its_runs(tmp_path):
    assert datasets_root(tmp_path / "wd" / "runs" / "r1", {}) == tmp_path / "wd" / "datasets"
    assert datasets_root(tmp_path / "wd" / "runs" / "r2", {}) == datasets_root(tmp_path / "wd" / "runs" / "r1", {})
    assert datasets_root(tmp_path / "by-hand", {}) == tmp_path / "by-hand" / "datasets"
    assert datasets_root(tmp_path / "wd" / "runs" / "r1", {DATASETS_ENV: "/data/ds"}) == Path("/data/ds")


# -- memory: 8 rank processes map the store; the list path loads it ---------------------------------------------
_RANK = """
import json, os, sys
import numpy as np
from trainer.data import Sample, load_samples
from trainer.packing import build_step, plan_epoch
from trainer.store import open_store

def rss():
    # (private, file-backed) resident bytes: RssAnon is this rank's own; RssFile the pages of mapped files it
    # touched (the store's among them), which the page cache holds once for every rank of the node
    with open("/proc/self/status") as f:
        d = dict(line.split(":", 1) for line in f)
    return np.array([int(d[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")])

kind, path = sys.argv[1], sys.argv[2]
# torch's one-time start-up on full-size rows (~17 MiB of its library pages and threads), not data:
build_step([Sample(np.zeros(2048, np.int32), np.zeros(2048, np.uint8))], [[0]] * 4, 2048)
base = rss()
samples = open_store(path) if kind == "store" else load_samples(path)
lengths = samples.lengths if kind == "store" else [len(s) for s in samples]
steps = plan_epoch(lengths, 2048, 4, 8192, 0, int(os.environ["RANK"]))
for rows in steps[:30]:
    build_step(samples, rows, 2048)
print(json.dumps({"growth": (rss() - base).tolist(), "steps": len(steps)}))
"""


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_ranks_memory_does_not_grow_with_the_store_as_the_list_paths_does(tmp_path, tok):
    """Each of 8 rank processes: RSS growth per dataset token after opening, planning and building 30 steps
    (measured from after torch's start-up), in the same run for both paths. The store's private growth stays
    under 1 byte per token and its whole growth (its pages of the mapped files included, which the page cache
    holds once per node) under the store's own 5 bytes per token on disk: the list path's private growth
    (33 bytes per token measured at scale) exceeds both."""
    cache = Path(os.environ.get("DFLASH_TINY_CACHE") or Path.home() / ".cache" / "dflashctl" / "tiny") / "store-test"
    cache.mkdir(parents=True, exist_ok=True)
    f = cache / "conversations.jsonl"
    if not f.is_file():
        write_conversations(cache / "tmp.jsonl", 5000, 7, words=(150, 450)).rename(f)
    store, _ = build_store([f], tok, cache / "ds", max_len=2048, log=print)  # content-addressed: built once per machine
    assert store.num_tokens > 2_500_000
    jsonl = tmp_path / "samples.jsonl"
    save_samples([Sample(s.input_ids.tolist(), s.loss_mask.tolist(), s.source) for s in store], jsonl)
    growth = {}
    for kind, path in (("store", store.path), ("list", jsonl)):
        procs = [subprocess.Popen([sys.executable, "-c", _RANK, kind, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=dict(os.environ, RANK=str(r))) for r in range(8)]
        outs = [p.communicate(timeout=600) for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
        growth[kind] = [[g / store.num_tokens for g in json.loads(o[0].strip().splitlines()[-1])["growth"]]
                        for o in outs]
    print({k: [[round(x, 3) for x in g] for g in v] for k, v in growth.items()})
    on_disk = sum(store.manifest["files"][n]["bytes"] for n in ("ids.npy", "mask.npy")) / store.num_tokens
    assert max(anon for anon, _ in growth["store"]) < 1.0 < min(anon for anon, _ in growth["list"])
    assert max(anon + file for anon, file in growth["store"]) < on_disk + 0.5 < min(anon for anon, _ in growth["list"])
