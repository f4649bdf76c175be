"""Compile policy and warm-up: `python -m trainer.warmup --config FILE [--device auto|cpu|cuda]`.

Training uses a few fixed input shapes (packed rows x row length, a fixed number of anchors per row), so a
warm-up can compile exactly those shapes before training and training never recompiles. What is compiled:

- CUDA: flex_attention (trainer.attention compiles it on first use, behind the compile guard), and with
  `compile.enabled` the whole drafter forward;
- CPU: SDPA, nothing compiled unless `compile.enabled`.

The warm-up runs one forward + backward per shape (that call compiles), then a second one (steady state),
and prints one JSON line per shape and a summary line:

    {"event": "warmup_shape", "shape": {...}, "compile_s": .., "first_call_s": .., "steady_s": ..,
     "fxgraph_cache_hit": .., "fxgraph_cache_miss": .., "autograd_cache_hit": .., "autograd_cache_miss": .., "graphs": ..}
    {"event": "warmup_done", "device": .., "cache_dir": .., "compile_s": .., "cache_hits": .., "cache_misses": .., "compiled": ..}

Compiled artifacts persist in TORCHINDUCTOR_CACHE_DIR (compile.cache_dir, else the environment's), so the
training processes (one per GPU, each seeing cuda:0: same cache keys) load them instead of compiling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.config import CompileConfig, TrainConfig

_COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_bypass"),
    ("stats", "unique_graphs"),
)


def configure_compile(ccfg: CompileConfig, environ: dict[str, str] | None = None) -> str:
    """Point the inductor caches at a persistent directory and set Dynamo's recompile limit.

    Must run before the first compile in the process. The FX-graph and AOTAutograd caches are switched on
    explicitly (both are what makes a second process's compile cheap).

    Returns:
        The cache directory in effect.
    """
    env = os.environ if environ is None else environ
    if ccfg.cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(ccfg.cache_dir).expanduser())
    env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    import torch._dynamo

    torch._dynamo.config.recompile_limit = ccfg.recompile_limit
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return env.get("TORCHINDUCTOR_CACHE_DIR") or cache_dir()


def compile_drafter(drafter: torch.nn.Module, ccfg: CompileConfig) -> bool:
    """Apply the compile policy to a drafter (in place) and say whether its forward is compiled.

    The compiled forward goes behind the process-wide compile guard: its first call per input signature
    runs exclusively, so a thread that FX-traces meanwhile cannot trip Dynamo's tracing check.
    """
    if not ccfg.enabled:
        return False
    from trainer.compile_guard import GUARD

    drafter.forward = GUARD.compiled(torch.compile(drafter.forward, dynamic=False))  # type: ignore[method-assign]
    return True


def compile_counters() -> dict[str, int]:
    """The Dynamo / inductor / AOTAutograd counters that tell compiles and cache hits apart."""
    from torch._dynamo.utils import counters

    return {name: int(counters[group][name]) for group, name in _COUNTERS}


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


@dataclass(frozen=True)
class Shape:
    """One fixed training input shape."""

    rows: int
    row_len: int
    num_anchors: int

    def to_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "row_len": self.row_len, "num_anchors": self.num_anchors}


def training_shapes(cfg: TrainConfig) -> list[Shape]:
    """The shapes training uses: every batch is padded to rows_per_step rows of row_len tokens with
    num_anchors anchors per row (trainer.loop pads), so there is exactly one."""
    return [Shape(cfg.rows_per_step, cfg.row_len, cfg.data.num_anchors)]


class _ShapeTarget:
    """What `DFlashDrafter.from_target` reads of a target, built from its config.json without weights.

    The warm-up compiles shapes, not values: random embedding / LM head of the right size and dtype do.
    """

    def __init__(self, target_dir: Path, layer_ids: list[int] | None, num_features: int, device, dtype):
        from transformers import AutoConfig

        from trainer.config import default_target_layer_ids
        from trainer.features import rope_theta_of

        self.config = AutoConfig.from_pretrained(str(target_dir))
        c = self.config
        self.num_layers = int(c.num_hidden_layers)
        self.hidden_size = int(c.hidden_size)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        self.vocab_size = int(c.vocab_size)
        self.rope_theta = rope_theta_of(c)
        self.layer_ids = list(layer_ids) if layer_ids is not None else default_target_layer_ids(self.num_layers, num_features)
        self.device = device
        self.embed_tokens = torch.nn.Embedding(self.vocab_size, self.hidden_size, device=device, dtype=dtype)
        self.lm_head = torch.nn.Linear(self.hidden_size, self.vocab_size, bias=False, device=device, dtype=dtype)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)


def _target_dir(cfg: TrainConfig, log: Callable[[str], None]) -> Path:
    if cfg.model.target == "tiny":
        from trainer.tiny import build_tiny

        return build_tiny(cfg.model.tiny_target, log=log).target_dir
    return Path(cfg.model.target)


def synthetic_batch(shape: Shape, feat_dim: int, vocab: int, device, dtype, seed: int = 0):
    """A valid PackedBatch of the given shape: one document per row, the second half supervised."""
    from trainer.objective import PackedBatch

    g = torch.Generator().manual_seed(seed)
    R, L = shape.rows, shape.row_len
    ids = torch.randint(0, vocab, (R, L), generator=g)
    loss_mask = torch.zeros((R, L), dtype=torch.long)
    loss_mask[:, L // 2 :] = 1
    doc_ids = torch.arange(R).unsqueeze(1).expand(R, L).contiguous()
    pos = torch.arange(L).unsqueeze(0).expand(R, L).contiguous()
    feats = torch.randn((R, L, feat_dim), generator=g).to(dtype)
    return PackedBatch(ids, loss_mask, doc_ids, pos, feats).to(device)


def warm_up(cfg: TrainConfig, device: torch.device | None = None, emit: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Compile every training shape once on `device`; report compile seconds and cache hits per shape.

    Args:
        cfg: the training config (shapes, drafter geometry, compile section).
        device: default cuda:0 when CUDA is available, else CPU.
        emit: receives each JSON event (default: print it as one line).

    Returns:
        The summary event.
    """
    from trainer.model import DFlashDrafter
    from trainer.objective import dflash_loss
    from trainer.precision import resolve_precision

    emit = emit or (lambda ev: print(json.dumps(ev), flush=True))
    device = device or (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    cache = configure_compile(cfg.compile)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - stdout carries JSON only
    tdir = _target_dir(cfg, log)
    tdtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = _ShapeTarget(tdir, cfg.model.target_layer_ids, cfg.model.num_target_features, device, tdtype)
    mask_id = cfg.model.mask_token_id if cfg.model.mask_token_id is not None else target.vocab_size - 1
    torch.manual_seed(cfg.seed)
    precision = resolve_precision(cfg.precision, device)  # autocast state is part of what compiles: train's own
    drafter = DFlashDrafter.from_target(cfg.model, target, mask_id, precision.master_dtype_name)
    compiled = compile_drafter(drafter, cfg.compile)
    flex = drafter.backend == "flex"
    total_compile, hits, misses = 0.0, 0, 0
    for i, shape in enumerate(training_shapes(cfg)):
        batch = synthetic_batch(shape, drafter.fc.in_features, target.vocab_size, device, tdtype, seed=cfg.seed + i)
        times = []
        before = compile_counters()
        for call in range(2):
            gen = torch.Generator().manual_seed(cfg.seed)
            t0 = time.perf_counter()
            with precision.autocast():
                res = dflash_loss(drafter, batch, num_anchors=shape.num_anchors, gamma=cfg.resolved_gamma, generator=gen)
            res.loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()  # CPU-GPU sync point: the time must include the kernels
            times.append(time.perf_counter() - t0)
            drafter.zero_grad(set_to_none=True)
            if call == 0:
                first = counters_delta(before, compile_counters())
        c_s = max(0.0, times[0] - times[1])
        ev = {
            "event": "warmup_shape",
            "shape": shape.to_dict(),
            "device": str(device),
            "compile_s": round(c_s, 4),
            "first_call_s": round(times[0], 4),
            "steady_s": round(times[1], 4),
            **first,
        }
        emit(ev)
        total_compile += c_s
        hits += first["fxgraph_cache_hit"] + first["autograd_cache_hit"]
        misses += first["fxgraph_cache_miss"] + first["autograd_cache_miss"]
    summary = {
        "event": "warmup_done",
        "device": str(device),
        "cache_dir": cache,
        "compile_s": round(total_compile, 4),
        "cache_hits": hits,
        "cache_misses": misses,
        "compiled": {"drafter_forward": compiled, "flex_attention": flex and device.type == "cuda"},
    }
    emit(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 warmed up, 2 bad config (the message says what to fix), 1 anything else."""
    p = argparse.ArgumentParser(prog="python -m trainer.warmup", description="Compile the training shapes once.")
    p.add_argument("--config", required=True, help="TrainConfig as JSON or YAML (runs/<id>/config.json)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to compile (default: auto)")
    args = p.parse_args(argv)
    from trainer.config import ConfigError, load_config
    from trainer.data import DataError

    try:
        cfg = load_config(args.config)
        device = None if args.device == "auto" else torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
        warm_up(cfg, device)
    except (ConfigError, DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
