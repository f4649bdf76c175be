"""The export judged where it will be served: vLLM's DFlash speculative decoding beside plain vLLM decoding.

``python -m trainer eval --engine vllm`` runs this in a venv that has vLLM (its own torch and transformers:
the vLLM venv profile). On the same held-out prompts and settings as the project's own loop
(`trainer.evaluate`), at T = 0:

    spec   vLLM with speculative_config {"method": "dflash", "model": EXPORT, "num_speculative_tokens": k}
           -> every prompt's output tokens and its acceptance histogram (vLLM's per-request
              spec-decode metrics: rounds with j accepted drafts, j = 0..k)
    plain  vLLM without a drafter -> every prompt's output tokens
    own    the project's loop on the same prompts (chain, greedy) -> its per-prompt acceptance

and reports, per prompt and in all:

- acceptance length counted two ways: the per-prompt mean (the published benchmark's τ: mean over prompts of
  each prompt's mean acceptance length) and pooled over every round of every prompt (what vLLM's log calls
  "mean acceptance length");
- lossless: spec output == plain output, token for token;
- tokens/s of both engines (all prompts in one batch) and the speedup.

A prompt whose vLLM acceptance differs from the project's by more than ``tolerance`` (absolute, in tokens per
round) is an error naming the prompts: vLLM's DFlash loader reports nothing for a tensor missing from an export
(it stays zero, and only acceptance shows it), and a wrong ``target_layer_ids`` or ``mask_token_id`` loads
without a word too. The two loops count a round the same way (accepted drafts + 1) but stop at slightly
different points at the end of a response, hence a tolerance rather than equality; see `DEFAULT_TOLERANCE`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# vLLM's CPU attention kernels serve these head sizes only (vllm/v1/attention/backends/cpu_attn.py); a GPU
# backend (flash attention) serves any multiple of 8 up to 256.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
GPU_MAX_HEAD_DIM = 256

DEFAULT_TOLERANCE = 0.25
"""Largest |vLLM - project| per-prompt acceptance length accepted as the same drafter. Measured on a trained
tiny export: the two loops differ by at most ~0.1 per prompt (their last round ends differently); a zeroed
tensor or a wrong target layer moves acceptance by 1 or more."""


VLLM_PYTHON_ENV = "DFLASH_VLLM_PYTHON"
"""The vLLM interpreter of a run whose experiment asks for the vLLM evaluation (evaluation.engine: vllm):
dflashctl sets it to the experiment's data venv's python (orchestrator.agent.runcommand.build_command)."""
REPORT_FILE = "eval_vllm.json"
"""The end-of-training vLLM report in the run directory, beside eval_after.json."""


class EngineError(ValueError):
    """The export cannot be judged in vLLM: vLLM missing, a geometry it cannot serve, or a mismatch."""


@dataclass
class VllmReport:
    """vLLM's verdict on an export, beside the project's own loop.

    Attributes:
        per_prompt_vllm: vLLM's mean acceptance length of each prompt (accepted drafts + 1 per round).
        per_prompt_own: the project's loop's, same prompts.
        tau_vllm: mean of per_prompt_vllm (the published benchmark's counting).
        tau_vllm_pooled: 1 + all accepted drafts / all rounds (vLLM's "mean acceptance length").
        tau_own: mean of per_prompt_own.
        lossless: every prompt's speculative output equals the plain output.
        mismatched_outputs: indices of prompts whose outputs differ.
        tokens_per_s_spec / tokens_per_s_plain: generated tokens per wall second, all prompts in one batch.
        speedup: tokens_per_s_spec / tokens_per_s_plain.
        num_speculative_tokens: k (the block size - 1).
        tolerance: the largest accepted per-prompt |vLLM - project|.
        disagreeing: indices of prompts beyond the tolerance.
    """

    per_prompt_vllm: list[float]
    per_prompt_own: list[float]
    tau_vllm: float
    tau_vllm_pooled: float
    tau_own: float
    lossless: bool
    mismatched_outputs: list[int]
    tokens_per_s_spec: float
    tokens_per_s_plain: float
    speedup: float
    num_speculative_tokens: int
    tolerance: float
    disagreeing: list[int] = field(default_factory=list)

    def to_record(self) -> dict:
        """The metrics line's payload (``kind: "eval_vllm"``), read back by ``dflashctl metrics``."""
        return {
            "tau_vllm": self.tau_vllm, "tau_vllm_pooled": self.tau_vllm_pooled, "tau_own": self.tau_own,
            "lossless": self.lossless, "tokens_per_s_spec": self.tokens_per_s_spec,
            "tokens_per_s_plain": self.tokens_per_s_plain, "speedup": self.speedup,
            "per_prompt_vllm": self.per_prompt_vllm, "per_prompt_own": self.per_prompt_own,
            "disagreeing": self.disagreeing, "mismatched_outputs": self.mismatched_outputs,
            "tolerance": self.tolerance, "num_speculative_tokens": self.num_speculative_tokens,
        }

    def table(self) -> str:
        lines = [
            f"{'':24} {'project loop':>14} {'vLLM':>10}",
            f"{'τ (per-prompt mean)':24} {self.tau_own:>14.3f} {self.tau_vllm:>10.3f}",
            f"{'τ (pooled)':24} {'':>14} {self.tau_vllm_pooled:>10.3f}",
            f"lossless at T=0: {'yes' if self.lossless else 'NO, prompts ' + str(self.mismatched_outputs)}",
            f"tokens/s: {self.tokens_per_s_plain:.1f} without the drafter, {self.tokens_per_s_spec:.1f} with it "
            f"(speedup {self.speedup:.2f}x, k = {self.num_speculative_tokens})",
        ]
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        from trainer.setup import write_json

        write_json(Path(path), asdict(self))
        return Path(path)


def servable_head_dim(head_dim: int, device: str) -> str | None:
    """None when vLLM's attention on ``device`` ("cpu" or "cuda") serves ``head_dim``, else the reason."""
    if device == "cpu":
        if head_dim in CPU_HEAD_DIMS:
            return None
        return (f"head_dim {head_dim}: vLLM's CPU attention serves head_dim in {list(CPU_HEAD_DIMS)} only "
                "(it loads the model and dies at the first step: \"Unsupported CPU attention configuration\")")
    if head_dim % 8 == 0 and head_dim <= GPU_MAX_HEAD_DIM:
        return None
    return f"head_dim {head_dim}: vLLM's GPU attention serves multiples of 8 up to {GPU_MAX_HEAD_DIM}"


def check_servable(target_config: dict, drafter_config: dict | None, device: str) -> list[str]:
    """Why vLLM could not serve this target (and drafter), as a list of reasons (empty: it can).

    Args:
        target_config: the target's config.json as a dict.
        drafter_config: the export's config.json, or None before there is one.
        device: "cpu" or "cuda".
    """
    reasons = []
    head_dim = target_config.get("head_dim") or (
        target_config["hidden_size"] // target_config["num_attention_heads"])
    why = servable_head_dim(int(head_dim), device)
    if why:
        reasons.append(f"the target's {why}")
    if drafter_config is not None:
        for key in ("vocab_size", "hidden_size"):
            if drafter_config.get(key) != target_config.get(key):
                reasons.append(f"{key}: the drafter has {drafter_config.get(key)}, the target "
                               f"{target_config.get(key)} (vLLM shares the target's embedding and LM head)")
    return reasons


def _acceptance(metrics) -> tuple[float, int, int]:
    """(mean acceptance length, rounds, accepted drafts) of one request's vLLM spec-decode metrics."""
    d = metrics.to_dict()
    return float(d["mean_acceptance_length"]), int(d["num_spec_steps"]), int(d["num_accepted_draft_tokens"])


def _generate(llm, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stop_ids or None,
                            ignore_eos=not stop_ids, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    return outs, wall


def _engine(target_dir: str, dtype: str, max_len: int, speculative: dict | None, seed: int):
    from vllm import LLM

    # The engine in this process: no engine-core subprocess to start (spawn re-imports the caller's main
    # module) or to leak; one engine at a time anyway.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    kwargs = dict(model=str(target_dir), dtype=dtype, max_model_len=max_len, seed=seed, enforce_eager=True,
                  max_num_seqs=64, gpu_memory_utilization=0.5)
    if speculative is not None:
        kwargs["speculative_config"] = speculative
        kwargs["per_request_spec_decode_metrics"] = "summary"
    return LLM(**kwargs)


def _release(llm) -> None:
    """Free one engine before the next starts (two engines side by side double the KV-cache reservation)."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort: the engine's own atexit does it otherwise
        pass
    del llm
    gc.collect()


def _timed(llm, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]):
    _generate(llm, prompts[:1], min(4, max_new_tokens), stop_ids)  # warm-up: the first step builds kernels
    return _generate(llm, prompts, max_new_tokens, stop_ids)


def run_plain(target_dir: str | Path, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int],
              dtype: str = "float32", seed: int = 0) -> dict:
    """Plain vLLM decoding of ``prompts`` (the lossless reference): {"plain": [tokens], "wall_plain": s}."""
    max_len = max(len(p) for p in prompts) + max_new_tokens + 64
    llm = _engine(str(target_dir), dtype, max_len, None, seed)
    outs, wall = _timed(llm, prompts, max_new_tokens, stop_ids)
    _release(llm)
    return {"plain": [list(o.outputs[0].token_ids) for o in outs], "wall_plain": wall}


def run_vllm(export_dir: str | Path, target_dir: str | Path, prompts: list[list[int]], *, max_new_tokens: int,
             stop_ids: list[int], dtype: str = "float32", seed: int = 0, plain: dict | None = None) -> dict:
    """vLLM's DFlash speculative decoding of ``prompts`` with the export, and plain decoding (or ``plain``, a
    `run_plain` result of the same prompts, reused): outputs, per-prompt acceptance, walls. No project loop.

    Returns:
        {"spec": [tokens per prompt], "plain": [...], "acceptance": [(mean, rounds, accepted) per prompt],
         "wall_spec": s, "wall_plain": s, "k": num_speculative_tokens}
    """
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    k = int(cfg.get("block_size", 8)) - 1
    max_len = max(len(p) for p in prompts) + max_new_tokens + 64
    spec_cfg = {"method": "dflash", "model": str(export_dir), "num_speculative_tokens": k}
    llm = _engine(str(target_dir), dtype, max_len, spec_cfg, seed)
    spec_outs, wall_spec = _timed(llm, prompts, max_new_tokens, stop_ids)
    _release(llm)
    if plain is None:
        plain = run_plain(target_dir, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, dtype=dtype,
                          seed=seed)
    plain_outs, wall_plain = plain["plain"], plain["wall_plain"]
    acceptance = []
    for i, out in enumerate(spec_outs):
        m = out.outputs[0].spec_decode_metrics
        if m is None:
            raise EngineError(f"prompt {i}: vLLM reported no speculative-decoding metrics (is this vLLM older "
                              "than 0.32, without per_request_spec_decode_metrics?)")
        acceptance.append(_acceptance(m))
    return {
        "spec": [list(o.outputs[0].token_ids) for o in spec_outs], "plain": plain_outs,
        "acceptance": acceptance, "wall_spec": wall_spec, "wall_plain": wall_plain, "k": k,
    }


def compare(vllm: dict, own_per_prompt: list[float], tolerance: float = DEFAULT_TOLERANCE) -> VllmReport:
    """The report from vLLM's run and the project's per-prompt acceptance (a pure function).

    Raises nothing: ``report.disagreeing`` and ``report.lossless`` carry the verdict; `judge` raises.
    """
    per_vllm = [a[0] for a in vllm["acceptance"]]
    rounds = sum(a[1] for a in vllm["acceptance"])
    accepted = sum(a[2] for a in vllm["acceptance"])
    mismatched = [i for i, (s, p) in enumerate(zip(vllm["spec"], vllm["plain"])) if s != p]
    toks_spec = sum(len(s) for s in vllm["spec"])
    toks_plain = sum(len(p) for p in vllm["plain"])
    tps_spec = toks_spec / vllm["wall_spec"] if vllm["wall_spec"] > 0 else 0.0
    tps_plain = toks_plain / vllm["wall_plain"] if vllm["wall_plain"] > 0 else 0.0
    disagreeing = [i for i, (v, o) in enumerate(zip(per_vllm, own_per_prompt)) if abs(v - o) > tolerance]
    return VllmReport(
        per_prompt_vllm=per_vllm, per_prompt_own=list(own_per_prompt),
        tau_vllm=sum(per_vllm) / len(per_vllm) if per_vllm else 0.0,
        tau_vllm_pooled=1.0 + accepted / rounds if rounds else 1.0,
        tau_own=sum(own_per_prompt) / len(own_per_prompt) if own_per_prompt else 0.0,
        lossless=not mismatched, mismatched_outputs=mismatched,
        tokens_per_s_spec=tps_spec, tokens_per_s_plain=tps_plain,
        speedup=tps_spec / tps_plain if tps_plain else 0.0,
        num_speculative_tokens=int(vllm["k"]), tolerance=tolerance, disagreeing=disagreeing,
    )


def judge(report: VllmReport, export_dir: str | Path) -> None:
    """Raise `EngineError` when vLLM's run says the export is not what the trainer made.

    A lossy speculative output, or prompts whose acceptance in vLLM differs from the project's beyond the
    tolerance, each named with both numbers and the usual causes.
    """
    problems = []
    if not report.lossless:
        problems.append(f"speculative output differs from plain decoding on prompts {report.mismatched_outputs} "
                        "(at T = 0 they must be equal: a vLLM bug or a non-deterministic dtype; use float32)")
    if report.disagreeing:
        shown = ", ".join(f"prompt {i}: vLLM {report.per_prompt_vllm[i]:.2f} vs project "
                          f"{report.per_prompt_own[i]:.2f}" for i in report.disagreeing[:8])
        problems.append(
            f"vLLM's acceptance differs from the project's beyond {report.tolerance} on "
            f"{len(report.disagreeing)} of {len(report.per_prompt_own)} prompts ({shown}): vLLM loaded a different "
            f"drafter than the trainer saved. Usual causes: a tensor missing from {export_dir}/model.safetensors "
            "(vLLM's DFlash loader leaves it zero without a word), dflash_config.target_layer_ids or "
            "mask_token_id in config.json not what the drafter was trained with, a rope_theta the engine reads "
            "differently")
    if problems:
        raise EngineError("; ".join(problems))


def evaluate_in_vllm(export_dir: str | Path, target_dir: str | Path, prompt_files: list[str], *,
                     max_new_tokens: int = 256, max_prompts: int | None = None,
                     chat_template_kwargs: dict | None = None, tolerance: float = DEFAULT_TOLERANCE,
                     dtype: str = "float32", reference_export: str | Path | None = None,
                     own_per_prompt: list[float] | None = None) -> VllmReport:
    """``python -m trainer eval --engine vllm``: vLLM's numbers beside the project's, judged.

    The project's loop runs on the CPU in fp32 with ``reference_export`` (default: the export itself) loaded as
    users load it (`load_export`); vLLM serves ``export_dir`` in ``dtype``. Give the trainer's own export as the
    reference when vLLM serves a converted or re-saved copy: what vLLM reads differently then shows up.
    ``own_per_prompt``: the project's per-prompt greedy-chain acceptance measured already on these prompts (the
    end-of-training evaluation's, `own_chain` of eval_after.json): the project's loop is not run again.

    Raises:
        EngineError: vLLM is not importable here, cannot serve the target, or disagrees with the project.
        ValueError / DataError: as `trainer.export_eval.evaluate_export` (not an export, unusable prompts).
    """
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise EngineError(
            f"vLLM is not importable in this interpreter ({exc}); run the evaluation with the vLLM venv's python "
            "(`dflashctl rebuild-venv --target T --profile vllm` builds it), e.g. "
            "<workdir>/venvs/vllm/current/bin/python -m trainer eval --engine vllm ...") from None
    import torch
    from transformers import AutoTokenizer

    from trainer.evaluate import acceptance_length
    from trainer.export_eval import load_export, load_prompts
    from trainer.features import TargetModel

    target_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    export_cfg = json.loads((Path(export_dir) / "config.json").read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reasons = check_servable(target_cfg, export_cfg, device)
    if reasons:
        raise EngineError(f"vLLM cannot serve {target_dir} with {export_dir}: " + "; ".join(reasons))
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = load_prompts(prompt_files, tokenizer, chat_template_kwargs)[:max_prompts]
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if own_per_prompt is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # batch-1 decoding of a small model is latency-bound: more threads only contend
        drafter = load_export(reference_export or export_dir, "cpu").float()
        target = TargetModel.from_pretrained(target_dir, layer_ids=drafter.target_layer_ids, dtype=torch.float32,
                                             device="cpu")
        own_per_prompt = acceptance_length(drafter, target, prompts, max_new_tokens=max_new_tokens,
                                           stop_token_ids=stop).per_prompt
        del drafter, target
        torch.set_num_threads(threads)
    elif len(own_per_prompt) != len(prompts):
        raise EngineError(f"the project's evaluation measured {len(own_per_prompt)} prompts, {', '.join(prompt_files)} "
                          f"gives {len(prompts)} here: not the same held-out prompts")
    result = run_vllm(export_dir, target_dir, prompts, max_new_tokens=max_new_tokens, stop_ids=stop, dtype=dtype)
    report = compare(result, own_per_prompt, tolerance)
    return report


def own_chain(eval_json: str | Path) -> list[float] | None:
    """The project's greedy-chain per-prompt acceptance in an evaluation json (eval_after.json), None when that
    evaluation did not measure the greedy chain (evaluation.temperatures without 0)."""
    doc = json.loads(Path(eval_json).read_text())
    for r in doc.get("results", []):
        if r.get("budget") is None and r.get("temperature") == 0.0:
            return [float(x) for x in r["per_prompt"]]
    return None


def end_of_training_argv(python: str, cfg, run_dir: str | Path, target_dir: str | Path,
                         eval_files: list[str]) -> list[str]:
    """The end-of-training vLLM evaluation of ``run_dir``'s export, as ``python -m trainer eval --engine vllm``
    in the vLLM interpreter (pure): the held-out prompts, chat-template arguments and response length of the
    run's own end-of-training evaluation, its per-prompt numbers from eval_after.json, the report and the
    metrics line written into the run."""
    run = Path(run_dir)
    tiny = cfg.model.target == "tiny"
    max_new = cfg.model.tiny_target.response_tokens if tiny else cfg.data.eval_max_new_tokens
    argv = [python, "-m", "trainer", "eval", "--engine", "vllm", "--export", str(run / "export"),
            "--target", str(target_dir)]
    for f in eval_files:
        argv += ["--prompts", str(f)]
    argv += ["--max-new-tokens", str(max_new), "--chat-template-kwargs", json.dumps(dict(cfg.data.chat_template_kwargs)),
             "--tolerance", repr(float(cfg.evaluation.vllm_tolerance)), "--json", str(run / REPORT_FILE),
             "--metrics", str(run / "metrics.jsonl")]
    if (run / "eval_after.json").is_file() and own_chain(run / "eval_after.json") is not None:
        argv += ["--own-report", str(run / "eval_after.json")]
    return argv
