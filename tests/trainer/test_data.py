"""Data pipeline: chat formats, assistant loss mask, skipped records with line numbers, packing limits."""

from __future__ import annotations

import json
import random

import pytest
import torch

from trainer.config import TinyTargetConfig
from trainer.data import (
    Conversation,
    DataError,
    Sample,
    SkipReport,
    read_conversations,
    tokenize,
    tokenize_conversation,
)
from trainer.packing import build_step, plan_epoch, target_features
from trainer.engines import hf_greedy_batch, regenerate
from trainer.tiny import build_target_model, build_tokenizer

CFG = TinyTargetConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, head_dim=8, num_prompts=8, held_out=2)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CFG)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_both_chat_formats_parse_to_the_same_messages(tmp_path):
    f = _write(
        tmp_path / "d.jsonl",
        [
            json.dumps({"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}),
            json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
            json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}, {"role": "assistant", "content": "hello"}]}),
        ],
    )
    rep = SkipReport()
    convs = read_conversations([f], rep)
    assert rep.total == 0
    assert convs[0].messages == convs[1].messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert convs[2].messages[0] == {"role": "user", "content": "hi"}
    assert convs[1].source == f"{f}:2"


def test_bad_records_are_skipped_and_counted_with_line_numbers(tmp_path, tok):
    good = json.dumps({"messages": [{"role": "user", "content": "ka to"}, {"role": "assistant", "content": "mi ra ne su"}]})
    f = _write(
        tmp_path / "d.jsonl",
        [
            good,
            "{not json",
            json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
            json.dumps({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}),
            "",
            json.dumps([1, 2]),
            json.dumps({"text": "no messages"}),
            json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " ".join(["ka"] * 500)}]}),
            good,
        ],
    )
    rep = SkipReport()
    convs = read_conversations([f], rep)
    samples = tokenize(convs, tok, max_len=64, report=rep)
    assert len(samples) == 2 and [s.source for s in samples] == [f"{f}:1", f"{f}:9"]
    assert rep.counts == {
        "bad JSON": 1,
        "no assistant turn": 1,
        "unknown role": 1,
        "not an object": 1,
        "no messages": 1,
        "over-long": 1,
    }
    assert rep.where["bad JSON"][0].startswith(f"{f}:2: ")
    assert rep.where["no assistant turn"][0].startswith(f"{f}:3")
    assert "'wizard'" in rep.where["unknown role"][0] and rep.where["unknown role"][0].startswith(f"{f}:4")
    assert rep.where["over-long"][0].startswith(f"{f}:8") and "> data.max_len 64" in rep.where["over-long"][0]
    assert "6 x" not in rep.summary() and "skipped 6 record(s)" in rep.summary()


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        read_conversations([tmp_path / "nope.jsonl"])


def test_loss_mask_covers_exactly_the_assistant_turns(tok):
    w = sorted(t for t in tok.get_vocab() if t.isalpha() and t not in ("user", "assistant", "system"))[:7]
    msgs = [
        {"role": "system", "content": "sort"},
        {"role": "user", "content": f"{w[0]} {w[1]}"},
        {"role": "assistant", "content": f"{w[2]} {w[3]}"},
        {"role": "user", "content": w[4]},
        {"role": "assistant", "content": f"{w[5]} {w[6]} {w[2]}"},
    ]
    ids, mask = tokenize_conversation(tok, msgs)
    toks = tok.convert_ids_to_tokens(ids)
    assert "<|endoftext|>" not in toks  # no unknown words: the check below is about real tokens
    supervised = [t for t, m in zip(toks, mask) if m]
    # Assistant content and its end-of-turn marker; never the role header or any user/system text.
    assert supervised == [w[2], w[3], "<|im_end|>", w[5], w[6], w[2], "<|im_end|>"]
    assert len(ids) == len(mask)
    first = toks.index(w[2])
    assert toks[first - 2 : first] == ["<|im_start|>", "assistant"] and mask[first - 1] == 0


def test_regenerated_responses_are_the_targets_greedy_tokens(tok):
    model = build_target_model(CFG, tok)
    convs = [Conversation([{"role": "user", "content": p}, {"role": "assistant", "content": "x"}], "p") for p in ["ka to", "mi ra ne su lo"]]
    new = regenerate(model, tok, convs, max_new_tokens=12)
    assert convs[0].messages[1]["content"] == "x"  # inputs untouched
    for c in new:
        ids, mask = tokenize_conversation(tok, c.messages)
        start = mask.index(1)
        prompt = ids[:start]
        greedy = hf_greedy_batch(model, [prompt], 12, {tok.eos_token_id}, tok.pad_token_id)[0]
        # Re-templating the decoded text gives back exactly the target's tokens (+ end of turn).
        assert ids[start : start + len(greedy)] == greedy
        assert ids[start + len(greedy)] == tok.eos_token_id


def test_the_two_greedy_decoders_give_the_same_tokens_and_differ_in_the_stop_token_only(tok):
    """engines.hf_greedy_batch (many prompts, left-padded, through transformers' generate: the stop token cut, the
    regenerated response) and evaluate.greedy_generate (one prompt through the trainer's TargetModel and its KV
    cache: the stop token kept, τ's lossless reference) decode the same tokens of the same target."""
    from trainer.evaluate import greedy_generate
    from trainer.features import TargetModel
    from trainer.tiny import generate_prompts

    model = build_target_model(CFG, tok).eval()
    prompts = [tok(p)["input_ids"] for p in generate_prompts(CFG)[:3]]
    assert len({len(p) for p in prompts}) > 1  # prompts of different lengths: the batch is left-padded
    free = hf_greedy_batch(model, prompts, 10, set(), tok.pad_token_id)
    target = TargetModel(model, [1])
    assert [greedy_generate(target, p, 10) for p in prompts] == free and all(len(t) == 10 for t in free)
    stop = next(t for t in free[0][3:] if free[0].index(t) >= 3)  # a token the target says at step >= 3
    cut = free[0].index(stop)
    assert hf_greedy_batch(model, prompts, 10, {stop}, tok.pad_token_id)[0] == free[0][:cut]
    assert greedy_generate(target, prompts[0], 10, [stop]) == free[0][: cut + 1]


def test_packing_never_exceeds_budget_or_row_length():
    rng = random.Random(0)
    lengths = [rng.randint(5, 100) for _ in range(500)]
    row_len, rows, budget = 128, 6, 6 * 128 + 50
    steps = plan_epoch(lengths, row_len, rows, budget, seed=1, epoch=0)
    seen = []
    for step in steps:
        assert 1 <= len(step) <= rows
        assert sum(lengths[i] for row in step for i in row) <= budget
        for row in step:
            assert sum(lengths[i] for i in row) <= row_len
            seen += row
    assert sorted(seen) == list(range(500))  # every document exactly once per epoch
    again = plan_epoch(lengths, row_len, rows, budget, seed=1, epoch=0)
    other = plan_epoch(lengths, row_len, rows, budget, seed=1, epoch=1)
    assert again == steps and other != steps  # reproducible, reshuffled per epoch
    # Packing is reasonably tight: rows are on average more than 92% full.
    fill = sum(lengths) / (sum(len(s) for s in steps) * row_len)
    assert fill > 0.92


def test_packing_refuses_impossible_budgets():
    with pytest.raises(DataError, match="exceeds token_budget"):
        plan_epoch([10], row_len=100, rows_per_step=4, token_budget=399, seed=0, epoch=0)
    with pytest.raises(DataError, match="longer than a packed row"):
        plan_epoch([10, 101], row_len=100, rows_per_step=1, token_budget=100, seed=0, epoch=0)


def test_build_step_doc_ids_and_positions():
    samples = [Sample([1, 2, 3], [0, 1, 1]), Sample([4, 5], [0, 1]), Sample([6, 7, 8, 9], [0, 0, 1, 1])]
    p = build_step(samples, [[0, 1], [2]], row_len=6, pad_id=0)
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    assert p.loss_mask.tolist() == [[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0]]
    assert p.doc_ids.tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert p.num_tokens == 9


class _CausalSumTarget:
    """features[t] = running sum of ids up to t within the sequence it was given (causal, per call)."""

    def features(self, ids):
        return ids.float().cumsum(dim=1).unsqueeze(-1).repeat(1, 1, 2)


def test_target_features_are_computed_per_document():
    samples = [Sample([1, 2, 3], [0, 1, 1]), Sample([10, 20], [0, 1]), Sample([5, 5, 5, 5], [0, 0, 1, 1])]
    p = build_step(samples, [[0, 1], [2]], row_len=6)
    f = target_features(_CausalSumTarget(), samples, p, max_batch_tokens=4)  # forces several batches
    assert f.shape == (2, 6, 2)
    # Document 1's sums restart at its own start: no feature sees the previous document.
    assert f[0, :, 0].tolist() == [1, 3, 6, 10, 30, 0]
    assert f[1, :, 0].tolist() == [5, 10, 15, 20, 0, 0]


def test_target_features_match_an_unpacked_real_target(tok):
    from transformers import Qwen3ForCausalLM  # noqa: F401 - the real target class

    model = build_target_model(CFG, tok)

    class Feat:
        def features(self, ids):
            with torch.no_grad():
                hs = model(ids, output_hidden_states=True).hidden_states
            return torch.cat([hs[2], hs[1]], dim=-1)

    samples = [Sample(list(range(5, 5 + n)), [1] * n) for n in (7, 3, 9)]
    p = build_step(samples, [[0, 1], [2]], row_len=12)
    f = target_features(Feat(), samples, p)
    for r, start, i in p.placements:
        alone = Feat().features(torch.tensor([samples[i].input_ids]))[0]
        assert torch.allclose(f[r, start : start + len(samples[i])], alone, atol=1e-5)
