"""The training config: typed, one docstring per field, validated with messages that say how to fix.

The resolved config is written into the run directory (`runs/<id>/config.json`) by the orchestrator and
read back by `python -m trainer ...`. Unknown keys are errors (a typo must never be silently ignored).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


PRECISIONS = {
    "fp32": "float32 weights, AdamW state and compute",
    "bf16-mixed": "float32 master weights and AdamW state, bfloat16 autocast compute; the default on GPUs",
    "bf16-true": "bfloat16 weights, AdamW state and compute",
    "auto": "bf16-mixed on CUDA, fp32 on CPU",
}
"""Every accepted value of `precision` (trainer.precision says what each does), with what it means."""


def check_precision(value: object) -> str:
    """The `precision` setting as given, if it is one of PRECISIONS.

    Raises:
        ValueError: any other value; the message lists every accepted one.
    """
    if isinstance(value, str) and value in PRECISIONS:
        return value
    choices = "; ".join(f"{k} ({v})" for k, v in PRECISIONS.items())
    raise ValueError(f"{value!r} is not a precision; set one of: {choices}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def default_gamma(block_size: int) -> float:
    """γ from the paper for common block sizes (7/5/4 for 16/10/8), else block_size/2.3 (at least 1)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The reference formula: 1 feature -> [L//2]; else uniform between 1 and L-3 (inclusive).

    Ids are z-lab convention: id l is the OUTPUT of decoder layer l == HF hidden_states[l+1].
    """
    L = num_target_layers
    if num_features < 1:
        raise ValueError("num_features must be >= 1")
    if num_features == 1:
        return [L // 2]
    if L < 4:
        raise ValueError(f"a target with {L} layers is too shallow for {num_features} features (needs >= 4 layers)")
    return [int(round(1 + i * (L - 4) / (num_features - 1))) for i in range(num_features)]


class TinyTargetConfig(_Strict):
    """A random-weight Qwen3 target built from a config (no downloads), for the demo and tests."""

    family: Literal["qwen3", "llama"] = "qwen3"
    """Model family of the tiny target."""
    vocab_size: int = Field(512, ge=64)
    """Vocabulary of the tokenizer trained locally (and of the model)."""
    hidden_size: int = Field(64, ge=8)
    """Target (and drafter) hidden size."""
    intermediate_size: int = Field(128, ge=8)
    """Target MLP size."""
    num_hidden_layers: int = Field(6, ge=2)
    """Target depth."""
    num_attention_heads: int = Field(4, ge=1)
    """Target attention heads."""
    num_key_value_heads: int = Field(2, ge=1)
    """Target KV heads (GQA)."""
    head_dim: int = Field(16, ge=4)
    """Per-head dimension."""
    rope_theta: float = 10000.0
    """RoPE base of the target (the drafter copies it)."""
    seed: int = 0
    """Seed for the random weights, the tokenizer corpus and the prompt set."""
    num_prompts: int = Field(96, ge=4)
    """Number of generated prompts (train + held-out)."""
    held_out: int = Field(8, ge=1)
    """Prompts kept out of training for τ evaluation."""
    response_tokens: int = Field(48, ge=4)
    """Length of the target's greedy (regenerated) responses."""


class ModelConfig(_Strict):
    """Drafter geometry. Sizes not given are copied from the target."""

    target: str = "tiny"
    """Target model: a local HF model directory, or `tiny` (built from `tiny_target`)."""
    tiny_target: TinyTargetConfig = TinyTargetConfig()
    """Used when target == "tiny"."""
    block_size: int = Field(16, ge=2, le=64)
    """Draft block size (slot 0 = clean anchor token, slots 1..bs-1 = MASK)."""
    num_draft_layers: int = Field(5, ge=1)
    """Drafter decoder layers."""
    num_target_features: int = Field(5, ge=1)
    """How many target layers feed the drafter (used when target_layer_ids is not set)."""
    target_layer_ids: list[int] | None = None
    """Target layers whose OUTPUT feeds the drafter (z-lab ids; HF hidden_states[l+1]). Default: formula."""
    mask_token_id: int | None = None
    """Token id of MASK. Default: the tokenizer's mask token, else the first unused id."""
    intermediate_size: int | None = None
    """Drafter MLP size; default: the target's."""
    num_attention_heads: int | None = None
    """Drafter heads; default: the target's."""
    num_key_value_heads: int | None = None
    """Drafter KV heads; default: the target's."""
    head_dim: int | None = None
    """Drafter head dim; default: the target's."""
    attention_backend: Literal["auto", "flex", "sdpa"] = "auto"
    """auto: flex_attention on CUDA, SDPA with the equivalent dense mask on CPU (flex has no CPU backward)."""

    @model_validator(mode="before")
    @classmethod
    def _dtype_moved(cls, data):
        if isinstance(data, dict) and "dtype" in data:
            raise ValueError(
                f"model.dtype ({data['dtype']!r}) was replaced by the top-level `precision` setting: write "
                "precision: bf16-true for what model.dtype: bfloat16 did, precision: fp32 for float32, or "
                "precision: bf16-mixed (float32 master weights, bfloat16 compute), and delete model.dtype"
            )
        return data


class DataConfig(_Strict):
    """Where conversations come from and how they are packed."""

    train_files: list[str] = []
    """jsonl files of conversations (ShareGPT `conversations` or OpenAI `messages`). Empty + tiny: generated."""
    eval_files: list[str] = []
    """jsonl files of held-out prompts for τ."""
    regenerate: bool = True
    """Replace assistant responses with the target's own greedy output before training (docs/dflash.md §2.1)."""
    max_len: int = Field(3072, ge=16)
    """Max tokens per sample; longer samples are skipped and counted."""
    token_budget: int = Field(49152, ge=16)
    """Tokens per packed batch: rows x row length (49152 = 16 x 3072)."""
    batches_per_step: int | None = Field(None, ge=1)
    """Packed batches per optimizer step, over all drafter ranks (each accumulates its share); a multiple of
    the drafter count. None: one per drafter rank. Set it to resume a checkpoint under another layout."""
    max_batch_size: int = Field(16, ge=1)
    """Max packed rows per step."""
    num_anchors: int = Field(512, ge=1)
    """Anchors (blocks) per packed row, re-drawn every step."""
    regenerate_max_new_tokens: int = Field(2048, ge=1)
    """Cap on each regenerated assistant turn (tokens)."""
    eval_max_new_tokens: int = Field(256, ge=1)
    """Tokens generated per held-out prompt when measuring τ (the tiny target uses its response_tokens)."""
    chat_template_kwargs: dict[str, bool | int | float | str] = {}
    """Extra arguments to the chat template, e.g. {"enable_thinking": false}; must match deployment (docs/dflash.md §4)."""
    regenerate_engine: Literal["hf", "vllm", "openai"] = "hf"
    """What regenerates (trainer.engines): hf = transformers generate (CPU fallback); vllm = vLLM's offline
    engine, one per GPU of the layout (its own venv); openai = the endpoint at regenerate_url."""
    regenerate_shard_size: int = Field(256, ge=1)
    """Conversations per shard: each finished shard is kept, so a stopped stage redoes at most the shards in flight."""
    regenerate_workers: int | None = Field(None, ge=1)
    """Engines run side by side. None: one per GPU of the layout (per tensor-parallel group), else 1 on CPU
    (CPU workers split this machine's cores); openai: parallel clients."""
    regenerate_tensor_parallel: int = Field(1, ge=1)
    """vllm: GPUs per engine, for a target that does not fit one GPU (a divisor of the layout's GPU count)."""
    regenerate_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and compute of the hf and vllm engines; auto: float32 on CPU, bfloat16 on GPUs."""
    regenerate_batch_size: int = Field(32, ge=1)
    """hf: prompts generated together (static batches; vLLM batches continuously on its own)."""
    regenerate_url: str | None = None
    """openai: the endpoint's base URL, e.g. http://10.0.0.5:8000 (the server you run: vllm serve, SGLang, TGI)."""
    regenerate_model: str | None = None
    """openai: the served model name; None: the one model the endpoint lists at /v1/models."""
    regenerate_max_in_flight: int = Field(32, ge=1, le=4096)
    """openai: requests in flight at once per client."""
    regenerate_timeout_s: int = Field(1800, ge=10)
    """Watchdog: a worker this long on one shard (or an endpoint failing this long) stops the stage with an error."""

    @model_validator(mode="after")
    def _regenerate_engine(self):
        if self.regenerate_engine == "openai":
            url = self.regenerate_url or ""
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"regenerate_engine is openai but regenerate_url is {self.regenerate_url!r}: set it to the "
                    "endpoint's base URL, e.g. regenerate_url: http://10.0.0.5:8000"
                )
        elif self.regenerate_url or self.regenerate_model:
            raise ValueError(
                f"regenerate_url / regenerate_model are for regenerate_engine: openai (it is {self.regenerate_engine}); "
                "set regenerate_engine: openai, or delete them"
            )
        return self


class EvalConfig(_Strict):
    """τ on the held-out prompts (trainer.evaluate): the chain, DDTree budgets, temperatures."""

    budgets: list[int] = [16, 32, 64, 128]
    """DDTree node budgets B measured beside the chain (empty: chain only)."""
    temperatures: list[float] = [0.0, 0.7, 1.0]
    """0 = greedy; > 0 = speculative sampling at that temperature (lossless in distribution)."""
    seed: int = 0
    """Seed of the sampling at T > 0, so two evaluations of the same weights agree."""
    export_check: bool = True
    """At step 0 and at every save, write the export, load it as engines do and compare every tensor and config
    field with the drafter being trained (trainer.export_check); a mismatch stops the run."""
    engine: Literal["own", "vllm"] = "own"
    """Where the export will be judged and served. vllm: the launch needs a vLLM interpreter (the experiment's
    data venv, passed as $DFLASH_VLLM_PYTHON) and refuses without one; step 0 refuses a target vLLM's attention
    cannot serve on this device (e.g. head_dim 16 on CPU); after the final export the launcher judges it in
    vLLM (trainer.vllm_eval, what `python -m trainer eval --engine vllm` runs) on the held-out prompts of the
    end-of-training evaluation: its numbers go to metrics.jsonl and eval_vllm.json, a lossy output or a
    per-prompt acceptance beyond vllm_tolerance fails the run."""
    vllm_tolerance: float = Field(0.25, ge=0)
    """engine vllm: the largest per-prompt |vLLM - project| acceptance length accepted as the same drafter
    (trainer.vllm_eval.DEFAULT_TOLERANCE)."""

    @field_validator("budgets")
    @classmethod
    def _budgets_positive(cls, v):
        if any(b < 1 for b in v):
            raise ValueError(f"budgets must be >= 1 draft nodes each, got {v}")
        return sorted(set(v))

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, v):
        if not v or any(t < 0 for t in v):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0 (0 = greedy), got {v}")
        return sorted(set(float(t) for t in v))


class OptimConfig(_Strict):
    """AdamW with cosine decay and linear warm-up, as in the paper (A.1)."""

    lr: float = Field(6e-4, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    """Fraction of total steps spent warming up linearly."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Cosine floor as a fraction of lr."""
    grad_clip: float = Field(1.0, gt=0)
    """Global grad-norm clip."""


class NodeLayoutConfig(_Strict):
    """One node of a layout across nodes (a container or host running one elastic agent)."""

    target_gpus: list[int] = []
    """GPUs of this node (its nvidia-smi indices) that each run one frozen-target process."""
    drafter_gpus: list[int] = []
    """GPUs of this node that each run one drafter-training process."""
    num_target_procs: int = Field(0, ge=0)
    """CPU only: target processes on this node."""
    num_drafter_procs: int = Field(0, ge=0)
    """CPU only: drafter processes on this node."""
    name: str | None = None
    """What the user calls this node (the inventory's target name): used in messages."""
    addr: str | None = None
    """The address the other nodes reach this node at (its ranks' store and gloo/NCCL peers may live here).
    None: the rendezvous host for node 0, the node's host name (FQDN) for the others."""


def parse_endpoint(text: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[addr]:port`) -> (host, port), or ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"rendezvous {text!r} must be HOST:PORT with a port 1-65535, e.g. 10.0.0.200:29400")
    return host.strip("[]"), int(port)


class LayoutConfig(_Strict):
    """Which process does what (validated through `trainer.layout.Layout`). Empty: colocated, one process."""

    nodes: list[NodeLayoutConfig] = []
    """A layout across nodes: each node's GPUs (then the top-level GPU lists stay empty)."""
    rendezvous: str | None = None
    """HOST:PORT of node 0's rendezvous, reachable from every node (needed with two or more nodes)."""

    target_gpus: list[int] = []
    """GPUs (nvidia-smi indices) that each run one frozen-target process."""
    drafter_gpus: list[int] = []
    """GPUs that each run one drafter-training process (DDP, lockstep)."""
    num_target_procs: int = Field(0, ge=0)
    """CPU only (no GPUs listed): number of target processes, e.g. 1 for the 1 + 2 gloo test."""
    num_drafter_procs: int = Field(0, ge=0)
    """CPU only (no GPUs listed): number of drafter processes."""
    timeout_s: int = Field(900, ge=10)
    """Collective / point-to-point timeout: a rank blocked this long (a hung peer) fails instead of hanging."""
    prefetch: int = Field(2, ge=1, le=8)
    """Batches a target rank may have in flight per drafter before it waits (overlaps target and drafter)."""

    @model_validator(mode="after")
    def _valid_layout(self):
        self.to_layout()  # LayoutError is a ValueError: pydantic reports it under `layout`
        if len(self.nodes) > 1 and not self.rendezvous:
            raise ValueError(f"a layout across {len(self.nodes)} nodes needs `rendezvous: HOST:PORT` (node 0's "
                             "address as the other nodes reach it, and a free port there, e.g. 10.0.0.200:29400)")
        if self.rendezvous:
            host, _ = parse_endpoint(self.rendezvous)
            addrs = [n.addr or (host if i == 0 else None) for i, n in enumerate(self.nodes)]
            for i, a in enumerate(addrs):
                if a is not None and a in addrs[:i]:
                    raise ValueError(f"nodes[{i}] has node {addrs.index(a)}'s address {a}: give every node its own "
                                     "`addr` (torch tells nodes apart by address and pid, and containers' pids repeat)")
        return self

    def to_layout(self):
        """The validated `trainer.layout.Layout` (raises LayoutError with the fix)."""
        from trainer.layout import Layout

        from trainer.layout import NodeSpec

        nodes = tuple(NodeSpec(tuple(n.target_gpus), tuple(n.drafter_gpus), n.num_target_procs, n.num_drafter_procs,
                               n.name) for n in self.nodes)
        return Layout(
            tuple(self.target_gpus), tuple(self.drafter_gpus), self.num_target_procs, self.num_drafter_procs, nodes
        )


class CompileConfig(_Strict):
    """torch.compile of the drafter's hot path, and where compiled artifacts persist."""

    enabled: bool = False
    """Compile the whole drafter forward with inductor, on any device. Off by default: on CUDA flex_attention
    is compiled on its own regardless (uncompiled flex materialises every score); on CPU a gcc compile costs
    more than it saves for tiny models. The CPU warm-up tests turn it on."""
    cache_dir: str | None = None
    """TORCHINDUCTOR_CACHE_DIR (persistent; /tmp may be wiped). None: the environment's, else torch's default."""
    recompile_limit: int = Field(8, ge=1)
    """torch._dynamo.config.recompile_limit: past it Dynamo falls back to eager (and says so in the log)."""


class TrainConfig(_Strict):
    """The whole training run."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    layout: LayoutConfig = LayoutConfig()
    """Process layout (`python -m trainer.launch`); empty = colocated single process."""
    compile: CompileConfig = CompileConfig()
    """torch.compile and its cache."""
    precision: str = "auto"
    """How the drafter trains (trainer/precision.py): fp32; bf16-mixed (float32 master weights and AdamW
    state, bfloat16 autocast compute); bf16-true (bfloat16 weights, state and compute); auto: bf16-mixed on
    CUDA, fp32 on CPU. The export's dtype is separate (bfloat16)."""
    gamma: float | None = None
    """Loss decay γ in w_k = exp(-(k-1)/γ). Default by block size: 7 (16), 5 (10), 4 (8)."""
    epochs: int = Field(6, ge=1)
    """Passes over the training data."""
    max_steps: int | None = Field(None, ge=1)
    """Hard cap on optimizer steps (None: epochs decide)."""
    seed: int = 0
    """Seed for weights init, anchors and data order."""
    output_dir: str = "."
    """Run directory: checkpoints/, export/, metrics.jsonl go here."""
    log_every: int = Field(10, ge=1)
    """Steps between metric lines."""
    save_every: int = Field(200, ge=1)
    """Steps between checkpoints."""
    eval_every: int | None = None
    """Steps between τ evaluations (None: only at the end)."""
    evaluation: EvalConfig = EvalConfig()
    """What a τ evaluation measures (chain, DDTree budgets, temperatures)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Complete checkpoints kept on disk."""
    max_restarts: int = Field(0, ge=0)
    """Times torch's elastic agent restarts every rank after a rank fails (each restart resumes from the
    newest complete checkpoint); 0: the first failure ends the run."""

    @field_validator("precision", mode="before")
    @classmethod
    def _precision(cls, v):
        return check_precision(v)

    @field_validator("gamma")
    @classmethod
    def _gamma_positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("gamma must be > 0 (typical: 7 for block 16, 5 for 10, 4 for 8)")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        ids = self.model.target_layer_ids
        if ids is not None:
            if len(ids) == 0:
                raise ValueError("model.target_layer_ids is empty; omit it to use the default formula")
            if len(set(ids)) != len(ids):
                raise ValueError(f"model.target_layer_ids has duplicates: {ids}")
            if any(i < 0 for i in ids):
                raise ValueError(f"model.target_layer_ids must be >= 0: {ids}")
        if self.data.max_len < self.model.block_size * 2:
            raise ValueError(
                f"data.max_len ({self.data.max_len}) must be at least 2 x block_size ({self.model.block_size})"
            )
        drafters = self.layout.to_layout().num_drafters
        if self.data.batches_per_step is not None and self.data.batches_per_step % drafters:
            raise ValueError(
                f"data.batches_per_step ({self.data.batches_per_step}) must be a multiple of the {drafters} drafter "
                "process(es) of the layout: each drafter trains the same number of batches per step"
            )
        if self.data.token_budget < self.data.max_len:
            raise ValueError(
                f"data.token_budget ({self.data.token_budget}) is smaller than data.max_len ({self.data.max_len}): "
                "no row could hold one sample; raise token_budget or lower max_len"
            )
        return self

    @property
    def resolved_gamma(self) -> float:
        """γ as given, else the paper's value for this block size (7/5/4 for 16/10/8, else bs/2.3)."""
        return self.gamma if self.gamma is not None else default_gamma(self.model.block_size)

    @property
    def batches_per_step(self) -> int:
        """Global batches per optimizer step: data.batches_per_step, else one per drafter rank."""
        return self.data.batches_per_step or self.layout.to_layout().num_drafters

    @property
    def row_len(self) -> int:
        """Length of one packed row (== max_len)."""
        return self.data.max_len

    @property
    def rows_per_step(self) -> int:
        """Packed rows per step: token_budget // max_len, capped by max_batch_size."""
        return max(1, min(self.data.max_batch_size, self.data.token_budget // self.data.max_len))


class ConfigError(ValueError):
    """A config file is wrong; the message names the file and the bad key."""


def load_config(path: str | Path) -> TrainConfig:
    """Read a TrainConfig from JSON (or YAML if the suffix says so).

    Raises:
        ConfigError: missing file, bad syntax, unknown or invalid keys (each named with its dotted path).
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: no such config file")
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(p.read_text())
        else:
            raw = json.loads(p.read_text())
    except Exception as exc:  # noqa: BLE001 - syntax errors of two parsers
        raise ConfigError(f"{p}: cannot parse: {exc}") from exc
    return parse_config(raw, source=str(p))


def parse_config(raw: dict, source: str = "<config>") -> TrainConfig:
    """Validate a dict into TrainConfig, turning pydantic errors into one readable ConfigError."""
    try:
        return TrainConfig.model_validate(raw or {})
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = "unknown key (check the spelling)" if err["type"] == "extra_forbidden" else err["msg"]
            msg = msg.removeprefix("Value error, ")  # pydantic's prefix for a validator's own message
            lines.append(f"{source}: {loc}: {msg}")
        raise ConfigError("\n".join(lines)) from None

