"""Generation engines of the regeneration stage: `hf` (transformers generate), `vllm` (vLLM's offline `LLM`),
`openai` (an OpenAI-compatible completions endpoint the user runs).

Every engine answers one call, `generate(prompts) -> [Completion]`: the greedy continuation of each token
prompt, cut at the first end-of-turn token (excluded), as text decoded WITHOUT dropping special tokens (so
re-templating gives back the same tokens) and its token count. `regenerate_conversations` turns that into
regenerated conversations, the same way for every engine (docs/dflash.md §2.1).

Heavy imports (vllm, transformers' models) happen inside the engine that needs them: the `openai` engine runs
where neither is installed.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Protocol, Sequence

from trainer.data import Conversation

ENGINES = {
    "hf": "transformers generate in static batches (the CPU fallback; no extra venv)",
    "vllm": "vLLM's offline LLM, one engine per GPU (or per CPU worker); needs the vLLM venv",
    "openai": "an OpenAI-compatible /v1/completions endpoint you run (vllm serve, SGLang, TGI)",
}
"""Every accepted value of `data.regenerate_engine`, with what it does."""


class EngineError(RuntimeError):
    """An engine cannot start or answer; the message names the engine (or URL) and the fix."""


@dataclass(frozen=True)
class Completion:
    """One generated turn: its text (special tokens kept, end-of-turn cut) and how many tokens it took."""

    text: str
    tokens: int


class Engine(Protocol):
    """What the stage needs of an engine."""

    name: str

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        """Greedy continuations of token prompts, in the input order."""
        ...


@dataclass(frozen=True)
class EngineSpec:
    """Everything a worker process needs to open its engine (picklable: it crosses to spawned workers).

    Attributes:
        engine: a key of ENGINES.
        target_dir: the target's HF model directory (weights and tokenizer).
        max_new_tokens: cap per assistant turn.
        dtype: float32 / bfloat16 / float16 (resolved; `auto` is decided before this is built).
        batch_size: hf: prompts generated together.
        url, model: openai: the endpoint's base URL and the served model name.
        max_in_flight: openai: requests in flight at once.
        timeout_s: openai: how long one request may keep failing (with retries) before the stage stops.
        tensor_parallel: vllm: GPUs per engine.
    """

    engine: str
    target_dir: str
    max_new_tokens: int
    dtype: str = "float32"
    batch_size: int = 32
    url: str | None = None
    model: str | None = None
    max_in_flight: int = 32
    timeout_s: float = 600.0
    tensor_parallel: int = 1


def eos_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """End-of-sequence ids: the generation config's (one or several) and the tokenizer's eos."""
    ids: set[int] = set()
    for src in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return ids


def _cut(tokens: Sequence[int], stop: set[int]) -> list[int]:
    """Tokens up to (not including) the first stop token."""
    out = list(tokens)
    return out[: next((k for k, t in enumerate(out) if t in stop), len(out))]


# -- hf ----------------------------------------------------------------------------------------------------
def _hf_model(target: Any) -> Any:
    """The HF causal LM behind `target` (a bare HF model, or a wrapper holding one)."""
    if hasattr(target, "generate"):
        return target
    for name in ("hf", "hf_model", "model"):
        inner = getattr(target, name, None)
        if inner is not None and hasattr(inner, "generate"):
            return inner
    raise TypeError(f"{type(target).__name__} has no `generate` and wraps no HF model (hf / hf_model / model)")


def hf_greedy_batch(
    target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int, batch_size: int = 32
) -> list[list[int]]:
    """Greedy continuations of many token prompts with a transformers model's generate, cut at the first
    end-of-sequence token (excluded): the regenerated responses. (trainer.evaluate.greedy_generate is τ's
    reference: one prompt through the trainer's TargetModel, its stop token included.)

    Batches are left-padded (with an attention mask) and sorted by length so padding stays small.

    Returns:
        One list of new token ids per prompt, in the input order.
    """
    import torch

    model = _hf_model(target)
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            att = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                n = len(prompts[i])
                ids[r, width - n :] = torch.tensor(list(prompts[i]), dtype=torch.long)
                att[r, width - n :] = 1
            gen = model.generate(
                input_ids=ids.to(device),
                attention_mask=att.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=sorted(eos_ids) or None,
            )
            for r, i in enumerate(idx):
                out[i] = _cut(gen[r, width:].tolist(), eos_ids)
    return out


class HFEngine:
    """transformers generate on one device, in static batches of `batch_size`."""

    name = "hf"

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int, batch_size: int = 32):
        self.model = _hf_model(model)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.eos = eos_ids(tokenizer, getattr(self.model, "generation_config", None))
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos), 0)

    @classmethod
    def open(cls, spec: EngineSpec, device: str = "cpu") -> "HFEngine":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(spec.target_dir)
        model = AutoModelForCausalLM.from_pretrained(spec.target_dir, dtype=getattr(torch, spec.dtype)).to(device).eval()
        return cls(model, tok, spec.max_new_tokens, spec.batch_size)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        new = hf_greedy_batch(self.model, prompts, self.max_new_tokens, self.eos, self.pad, self.batch_size)
        return [Completion(self.tokenizer.decode(t, skip_special_tokens=False), len(t)) for t in new]


# -- vllm --------------------------------------------------------------------------------------------------
class VLLMEngine:
    """vLLM's offline `LLM` over the visible devices (CUDA_VISIBLE_DEVICES / VLLM_CPU_OMP_THREADS_BIND are set
    by the worker before this is opened); continuous batching over every prompt of a call."""

    name = "vllm"

    def __init__(self, spec: EngineSpec):
        import os

        # The engine core in this process: a worker is already a process of its own, and a second one would
        # outlive a kill -9 of the stage.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoTokenizer
        from vllm import LLM, SamplingParams

        self.tokenizer = AutoTokenizer.from_pretrained(spec.target_dir)
        self.llm = LLM(model=spec.target_dir, tokenizer=spec.target_dir, dtype=spec.dtype, seed=0,
                       tensor_parallel_size=spec.tensor_parallel)
        gen_cfg = None
        try:
            from transformers import GenerationConfig

            gen_cfg = GenerationConfig.from_pretrained(spec.target_dir)
        except OSError:
            pass
        self.eos = eos_ids(self.tokenizer, gen_cfg)
        self.params = SamplingParams(temperature=0.0, max_tokens=spec.max_new_tokens, stop_token_ids=sorted(self.eos),
                                     detokenize=False)

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], self.params, use_tqdm=False)
        done = []
        for o in outs:
            toks = _cut(o.outputs[0].token_ids, self.eos)
            done.append(Completion(self.tokenizer.decode(toks, skip_special_tokens=False), len(toks)))
        return done


# -- openai ------------------------------------------------------------------------------------------------
def _http_json(url: str, body: dict | None, timeout_s: float) -> Any:
    """GET (body None) or POST JSON; the parsed answer. Raises urllib's errors as they come."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def _retrying(what: str, url: str, call, timeout_s: float, sleep=time.sleep) -> Any:
    """`call()` retried with exponential backoff (0.25 s doubling to 8 s) on connection errors, timeouts and
    5xx answers, for at most `timeout_s`; a 4xx answer is not retried.

    Raises:
        EngineError: naming `url`, the last error and the fix.
    """
    deadline = time.monotonic() + timeout_s
    delay, attempts = 0.25, 0
    while True:
        attempts += 1
        try:
            return call()
        except urllib.error.HTTPError as exc:
            body = exc.read()[:300].decode(errors="replace")
            if exc.code < 500:
                raise EngineError(f"openai engine: {url} answered {what} with HTTP {exc.code}: {body} (check "
                                  "data.regenerate_url and data.regenerate_model)") from None
            last = f"HTTP {exc.code}: {body}"
        except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, reset, timed out, bad JSON
            last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        left = deadline - time.monotonic()
        if left <= 0:
            raise EngineError(
                f"openai engine: {url} did not answer {what} in {timeout_s:.0f} s ({attempts} attempts; last: {last}); "
                "check that the server is up and healthy (curl it), or raise data.regenerate_timeout_s"
            )
        sleep(min(delay, left))
        delay = min(delay * 2, 8.0)


def served_model(url: str, timeout_s: float) -> str:
    """The one model an endpoint serves (GET /v1/models).

    Raises:
        EngineError: no answer, or not exactly one model (then data.regenerate_model must name it).
    """
    models = _retrying("GET /v1/models", url, lambda: _http_json(f"{url}/v1/models", None, 30), timeout_s)
    ids = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
    if len(ids) != 1:
        raise EngineError(f"openai engine: {url} serves {len(ids)} models ({', '.join(map(str, ids))}); "
                          "set data.regenerate_model to the one to use")
    return ids[0]


def server_version(url: str) -> str:
    """The endpoint's `/version` (vLLM answers it), or "unknown"."""
    try:
        return str(_http_json(f"{url}/version", None, 10).get("version", "unknown"))
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return "unknown"


class OpenAIEngine:
    """POST /v1/completions with the token prompt, greedy, at most `max_in_flight` requests at once."""

    name = "openai"

    def __init__(self, spec: EngineSpec, tokenizer: Any = None):
        from transformers import AutoTokenizer

        if not spec.url:
            raise EngineError("openai engine: no endpoint; set data.regenerate_url, e.g. http://10.0.0.5:8000")
        self.url = spec.url.rstrip("/")
        self.spec = spec
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(spec.target_dir)
        self.eos = eos_ids(self.tokenizer)
        self.model = spec.model or served_model(self.url, spec.timeout_s)

    def _one(self, prompt: Sequence[int]) -> Completion:
        body = {
            "model": self.model, "prompt": list(prompt), "max_tokens": self.spec.max_new_tokens, "temperature": 0.0,
            "n": 1, "stream": False,
            # vLLM's extensions (others ignore them): the token ids, so the text is decoded here like the other
            # engines' (special tokens kept), not by the server's detokenizer.
            "return_token_ids": True, "skip_special_tokens": False, "spaces_between_special_tokens": False,
        }
        ans = _retrying("POST /v1/completions", self.url,
                        lambda: _http_json(f"{self.url}/v1/completions", body, self.spec.timeout_s), self.spec.timeout_s)
        try:
            choice = ans["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"openai engine: {self.url} answered /v1/completions without choices: "
                              f"{json.dumps(ans)[:200]}") from None
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            toks = _cut(ids, self.eos)
            return Completion(self.tokenizer.decode(toks, skip_special_tokens=False), len(toks))
        tokens = (ans.get("usage") or {}).get("completion_tokens") or len(self.tokenizer(choice["text"])["input_ids"])
        return Completion(choice["text"], int(tokens))

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Completion]:
        with ThreadPoolExecutor(max_workers=self.spec.max_in_flight) as pool:
            return list(pool.map(self._one, prompts))


def open_engine(spec: EngineSpec, device: str = "cpu") -> Engine:
    """The engine `spec` names, started (a vLLM engine compiles for ~1 min on CPU, less when cached)."""
    if spec.engine == "hf":
        return HFEngine.open(spec, device)
    if spec.engine == "vllm":
        return VLLMEngine(spec)
    if spec.engine == "openai":
        return OpenAIEngine(spec)
    raise EngineError(f"unknown engine {spec.engine!r}; set data.regenerate_engine to one of {', '.join(ENGINES)}")


def engine_version(spec: EngineSpec) -> str:
    """What the dataset key records of the engine: its package versions, or the endpoint's server and model.

    Read from the installed distributions' metadata (no import of vllm: 12 s on CPU)."""
    def dist(*names: str) -> str | None:
        for n in names:
            try:
                return f"{n} {metadata.version(n)}"
            except metadata.PackageNotFoundError:
                continue
        return None

    if spec.engine == "hf":
        return f"{dist('transformers')}, {dist('torch')}"
    if spec.engine == "vllm":
        found = dist("vllm", "vllm-cpu")
        if found is None:
            raise EngineError("vllm engine: vLLM is not installed in this Python; run the stage in the vLLM venv")
        return found
    url = (spec.url or "").rstrip("/")
    model = spec.model or served_model(url, spec.timeout_s)
    return f"server {server_version(url)}, model {model}"


def regenerate_conversations(
    engine: Engine, tokenizer: Any, conversations: Sequence[Conversation], chat_template_kwargs: dict | None = None
) -> tuple[list[Conversation], int]:
    """Replace every assistant turn with the engine's greedy output (docs/dflash.md §2.1).

    Turns are regenerated in order, each conditioned on the already regenerated earlier turns, so a
    multi-turn conversation stays one the target would have produced.

    Returns:
        (new Conversation objects, the inputs unmodified; the number of tokens generated). A turn that
        regenerates to empty text keeps its conversation; `tokenize` then skips it if nothing is left.
    """
    kw = dict(chat_template_kwargs or {})
    convs = [Conversation([dict(m) for m in c.messages], c.source) for c in conversations]
    max_turns = max((sum(m["role"] == "assistant" for m in c.messages) for c in convs), default=0)
    tokens = 0
    for turn in range(max_turns):
        jobs = []  # (conversation index, message index) of each conversation's `turn`-th assistant message
        for ci, c in enumerate(convs):
            assistant = [mi for mi, m in enumerate(c.messages) if m["role"] == "assistant"]
            if turn < len(assistant):
                jobs.append((ci, assistant[turn]))
        prompts = [
            tokenizer.apply_chat_template(convs[ci].messages[:mi], add_generation_prompt=True, tokenize=False, **kw)
            for ci, mi in jobs
        ]
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        for (ci, mi), done in zip(jobs, engine.generate(prompt_ids)):
            convs[ci].messages[mi]["content"] = done.text
            tokens += done.tokens
    return convs, tokens


def regenerate(
    target: Any,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    max_new_tokens: int,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    batch_size: int = 32,
) -> list[Conversation]:
    """Every assistant turn replaced by an in-memory HF target's greedy output (the tiny build's data).

    Args:
        target: an HF causal LM, or a wrapper with `.hf` / `.hf_model` / `.model`.
        tokenizer: the target's tokenizer (with a chat template and a pad or eos token).
        max_new_tokens: cap per assistant turn.
        chat_template_kwargs: passed to apply_chat_template (e.g. {"enable_thinking": False}).
        batch_size: prompts generated together.
    """
    engine = HFEngine(target, tokenizer, max_new_tokens, batch_size)
    return regenerate_conversations(engine, tokenizer, conversations, chat_template_kwargs)[0]
