"""τ by real greedy speculative decoding: lossless, exact accounting, and a trained drafter's τ rises."""

from __future__ import annotations

import pytest
import torch

from tiny_targets import MASK_ID, small_model_config
from trainer.evaluate import acceptance_length, decode, greedy_generate
from trainer.model import DFlashDrafter
from trainer.objective import PackedBatch, dflash_loss

BS = 4


def _prompts(n=3, length=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK_ID, (length,), generator=g).tolist() for _ in range(n)]


def _drafter(target, seed=0, **kw):
    torch.manual_seed(seed)
    return DFlashDrafter.from_target(small_model_config(**kw), target, MASK_ID)


@pytest.fixture(scope="module")
def greedy():
    """greedy(target, prompt, n): the target's plain greedy continuation (the lossless reference), made once per
    target and prompt for the module. Greedy decoding is a prefix of itself: its first n tokens do not depend
    on how many follow, so one 40-token continuation answers every n <= 40."""
    made: dict = {}

    def get(target, prompt, n):
        assert n <= 40, n
        key = (id(target), tuple(prompt))
        if key not in made:
            made[key] = greedy_generate(target, prompt, 40)
        return made[key][:n]

    return get


class OracleDrafter(DFlashDrafter):
    """A drafter that 'knows' the target's greedy continuation and drafts it right for the first
    ``good`` slots of each block (wrong after), so τ is known exactly. It still goes through
    acceptance_length's real loop: positions, verification, acceptance, cache cropping."""

    def setup(self, prompt, continuation, good):
        self.seq = list(prompt) + list(continuation)
        self.good = good

    def draft_step(self, block_ids, new_target_hidden, new_positions, block_positions, cache):
        start = int(block_positions[0, 0])
        assert int(block_ids[0, 0]) == self.seq[start], "slot 0 must be the clean token at the block start"
        if new_positions.numel():  # the drafter never sees a feature at or after the block start
            assert int(new_positions.max()) < start
        drafts = []
        for k in range(block_ids.shape[1]):
            tok = self.seq[start + k] if start + k < len(self.seq) else 0
            drafts.append(tok if k <= self.good else (tok + 1) % MASK_ID)
        return torch.tensor([drafts], dtype=torch.float32)[..., None]

    def logits(self, hidden):
        return torch.nn.functional.one_hot(hidden[..., 0].long(), self.cfg.vocab_size).float()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [None, 2])
def test_speculative_output_equals_target_greedy(family, block_size, qwen3_target, llama_target, greedy):
    target = qwen3_target if family == "qwen3" else llama_target
    drafter = _drafter(target)
    prompts = _prompts()
    report = acceptance_length(drafter, target, prompts, max_new_tokens=24, block_size=block_size)
    for prompt, out in zip(prompts, report.outputs):
        assert out == greedy(target, prompt, 24)


@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("good,expected", [(BS - 1, BS), (2, 3), (0, 1)])
def test_tau_accounting_is_exact(qwen3_target, good, expected, extra, greedy):
    """The published benchmark's counting: rounds go on while fewer than N tokens went through a verify
    round (the prefill's token counts once verified), so N = 6 τ takes exactly 6 rounds and one token
    more a 7th. (Counting the prefill's token against N stopped one round early: 2.527 vs 2.555.)"""
    prompt = _prompts(1)[0]
    n_new = expected * 6 + extra
    ref = greedy(qwen3_target, prompt, n_new + 2 * BS)
    oracle = OracleDrafter(_drafter(qwen3_target).cfg, qwen3_target.embed_tokens, qwen3_target.lm_head)
    oracle.setup(prompt, ref, good)
    report = acceptance_length(oracle, qwen3_target, [prompt], max_new_tokens=n_new)
    assert report.outputs[0] == ref[:n_new]
    rounds = 6 + extra
    assert report.rounds == [rounds] and report.per_prompt == [float(expected)] and report.mean == expected
    hist = [0] * (BS + 1)
    hist[expected] = rounds
    assert report.histogram == hist


def test_random_drafter_tau_is_about_one(qwen3_target):
    report = acceptance_length(_drafter(qwen3_target, seed=3), qwen3_target, _prompts(4), max_new_tokens=24)
    assert 1.0 <= report.mean < 1.3
    assert len(report.histogram) == BS + 1 and report.histogram[0] == 0
    assert sum(report.histogram) == sum(report.rounds)


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_training_on_target_outputs_raises_tau(qwen3_target):
    """The objective and the inference loop agree: fitting the target's own continuations lifts τ.

    (With a leaking mask or shifted labels the loss would still fall, but τ would stay ≈ 1.)
    """
    prompts = _prompts(6, seed=1)
    responses = [greedy_generate(qwen3_target, p, 40) for p in prompts]
    ids = torch.tensor([p + r for p, r in zip(prompts, responses)])
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 8:] = 1
    batch = PackedBatch(
        ids, loss_mask, torch.zeros_like(ids), torch.arange(48).expand(6, 48), qwen3_target.features(ids)
    )
    drafter = _drafter(qwen3_target)
    before = acceptance_length(drafter, qwen3_target, prompts, max_new_tokens=40)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(120):
        out = dflash_loss(drafter, batch, num_anchors=16, gamma=2.0, generator=g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    after = acceptance_length(drafter, qwen3_target, prompts, max_new_tokens=40)
    assert before.mean < 1.3
    assert after.mean > 3.0, after
    assert after.outputs == [r for r in responses]  # still lossless


def test_stop_tokens_end_generation(qwen3_target, greedy):
    prompt = _prompts(1)[0]
    ref = greedy(qwen3_target, prompt, 20)
    stop = ref[5]
    first = ref.index(stop)
    out = decode(_drafter(qwen3_target), qwen3_target, prompt, max_new_tokens=20, stop_token_ids=[stop]).tokens
    assert out == ref[: first + 1]


def test_bad_arguments_are_named(qwen3_target):
    drafter = _drafter(qwen3_target)
    with pytest.raises(ValueError, match="block_size 5 must be in 1..4"):
        acceptance_length(drafter, qwen3_target, _prompts(1), block_size=5)
    with pytest.raises(ValueError, match="at least one prompt"):
        acceptance_length(drafter, qwen3_target, [])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        acceptance_length(drafter, qwen3_target, [[1, 2], []])


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_periodic_eval_measures_the_shipped_bf16_artifact(qwen3_target, tmp_path):
    """periodic_eval runs the exported remote code on the weights cast to the export dtype: the very numbers
    `load_export` of the bf16 file gives, for the chain and every budget and temperature."""
    from trainer.config import EvalConfig
    from trainer.export_eval import load_export, periodic_eval, shipped_model
    from trainer.export import export_drafter

    drafter = _drafter(qwen3_target)
    with torch.no_grad():
        drafter.norm.weight.mul_(4.0)
    prompts = _prompts(2)
    cfg = EvalConfig(budgets=[2, 8], temperatures=[0.0, 1.0])
    report = periodic_eval(drafter, qwen3_target, prompts, cfg, max_new_tokens=16)
    assert [(r.budget, r.temperature) for r in report.reports] == [
        (None, 0.0), (2, 0.0), (8, 0.0), (None, 1.0), (2, 1.0), (8, 1.0)
    ]
    export = export_drafter(drafter, qwen3_target, tmp_path / "export")
    exported = load_export(export)
    assert exported.fc.weight.dtype == torch.bfloat16
    assert torch.equal(shipped_model(drafter, qwen3_target).fc.weight, exported.fc.weight)
    for r in report.reports:
        same = acceptance_length(exported, qwen3_target, prompts, 16, budget=r.budget, temperature=r.temperature)
        assert same.outputs == r.outputs and same.per_prompt == r.per_prompt, (r.budget, r.temperature)
    from_disk = periodic_eval(drafter, qwen3_target, prompts, cfg, max_new_tokens=16, export_dir=export)
    assert from_disk.to_dict() == report.to_dict()
    rec = report.to_record()
    assert rec["tau"] == rec["tau_chain"] == report.get().mean
    assert rec["tau_tree8_t1"] == report.get(8, 1.0).mean and rec["verify_tree8"] == report.get(8).verify_width
    assert rec["verify_chain"] == BS
    assert "B=8" in report.table() and periodic_eval(drafter, qwen3_target, [], cfg, max_new_tokens=4) is None
    d = report.to_dict()  # the eval json: the greedy chain at the top, every mode in results
    assert d["tau"] == report.tau and d["per_prompt"] == report.get().per_prompt and d["num_prompts"] == 2
    assert len(d["results"]) == 6 and d["results"][4]["budget"] == 2 and d["results"][4]["temperature"] == 1.0


def test_load_export_names_a_wrong_directory(tmp_path):
    from trainer.export_eval import load_export

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not an exported drafter \\(missing model.safetensors, dflash.py\\)"):
        load_export(tmp_path)
