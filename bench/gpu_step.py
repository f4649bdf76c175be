"""One drafter training step at Qwen3-8B drafter size: compiled flex vs SDPA, tokens/s and MFU.

Called by bench/gpu_check.sh; runnable on its own:

    python bench/gpu_step.py step [--size qwen3-8b|tiny] [--device cuda|cpu] [--precision auto] [--lengths 16384,8192]
    python bench/gpu_step.py warmup-config DIR [--size ...] [--row-len N]   # files for `python -m trainer.warmup`
    python bench/gpu_step.py warmup-summary LOG [--label TEXT]             # one line from a warm-up's log

A step is what a drafter rank does per batch: `trainer.objective.dflash_loss` (anchors, masked blocks, the
drafter forward, decayed CE through the frozen LM head) under the trainer's precision (`auto`: bf16-mixed on
CUDA, fp32 on the CPU; trainer/precision.py), backward, AdamW step. Each backend is timed over `--steps`
steps after two untimed ones (the first compiles). The row length is the longest of `--lengths` that fits in
memory (an out-of-memory step moves to the next shorter length), found per backend; a backend that fits a
longer row than SDPA is measured again at SDPA's row, and the ratio to SDPA is printed there.

tokens/s counts the packed row's tokens (what the trainer's `tokens_per_s` counts). MFU = model FLOPs per
step / step time / the GPU's dense bf16 peak. The FLOP count is our own, from the drafter's geometry
(`step_flops`): 2·m·n·k per matmul; backward twice the forward for trainable weights, once for the frozen
LM head (input gradient only) and for fc (weight gradient only: features carry no gradient); attention over
the key/query pairs the DFlash mask lets through (what flex computes; SDPA also computes the masked ones);
the checkpointed LM-head chunks' recompute is not counted (model FLOPs, not hardware FLOPs). Norms, RoPE,
softmax and the optimizer are left out (well under 1% here). tests/bench/test_gpu_check.py checks the
matmul part, forward and backward, against torch's own FlopCounterMode on the tiny size.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Geometry:
    """Drafter and target sizes for one benchmark size."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    block: int
    features: int
    target_layers: int
    vocab: int
    anchors: int
    precision: str
    lengths: tuple[int, ...]


SIZES = {
    # Qwen3-8B-DFlash-b16: the target's hidden size, 5 draft layers, 32/8 heads of 128, block 16, 5 taps of
    # 36 target layers, 512 anchors per row (docs/dflash.md).
    "qwen3-8b": Geometry(4096, 12288, 5, 32, 8, 128, 16, 5, 36, 151936, 512, "auto", (32768, 16384, 8192, 4096, 2048)),
    "tiny": Geometry(64, 128, 2, 4, 2, 16, 4, 3, 6, 256, 8, "auto", (128, 64)),
}

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, in TFLOPS; the first name contained
# in torch.cuda.get_device_name() wins, so the specific names come first.
PEAK_BF16_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # H200 SXM: 1,979 with sparsity
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # H100 SXM5 (reports as "H100 80GB HBM3")
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name, or None when the name is not in the table."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def step_flops(g: Geometry, rows: int, row_len: int, supervised: int, pairs: int, backward: bool = True) -> dict[str, int]:
    """Model FLOPs of one drafter step, by part (see the module docstring for the convention).

    Args:
        g: geometry.
        rows, row_len: the packed batch (S = row_len context tokens per row).
        supervised: block slots that go through the LM head (StepOutput.n_tokens).
        pairs: visible (query, key) pairs over all rows, one head (the mask's count of True).
        backward: False gives the forward only.
    """
    S, Q = rows * row_len, rows * g.anchors * g.block  # context tokens, query slots (all rows)
    q_dim, kv_dim, H = g.heads * g.head_dim, g.kv_heads * g.head_dim, g.hidden
    per_layer = 2 * Q * H * q_dim + 2 * 2 * (S + Q) * H * kv_dim + 2 * Q * q_dim * H + 3 * 2 * Q * H * g.intermediate
    fwd = {
        "fc": 2 * S * g.features * H * H,
        "layers": g.layers * per_layer,
        "attention": g.layers * 2 * 2 * pairs * g.heads * g.head_dim,  # scores and weighted values
        "lm_head": 2 * supervised * H * g.vocab,
    }
    if not backward:
        return {**fwd, "total": sum(fwd.values())}
    mult = {"fc": 2, "layers": 3, "attention": 3, "lm_head": 2}
    out = {k: v * mult[k] for k, v in fwd.items()}
    return {**out, "total": sum(out.values())}


class _Frozen:
    """The target parts a drafter borrows (embedding, LM head), random: the step times shapes, not values."""

    def __init__(self, g: Geometry, device: torch.device, dtype: torch.dtype):
        self.embed_tokens = torch.nn.Embedding(g.vocab, g.hidden, device=device, dtype=dtype).requires_grad_(False)
        self.lm_head = torch.nn.Linear(g.hidden, g.vocab, bias=False, device=device, dtype=dtype).requires_grad_(False)


def build_drafter(g: Geometry, backend: str, device: torch.device):
    """A DFlashDrafter of geometry ``g`` with the given attention backend, on ``device``: its weights in the
    precision's master dtype, the borrowed embedding and head in the target's dtype (as the trainer has them)."""
    from trainer.config import default_target_layer_ids
    from trainer.model import DFlashDrafter, DrafterConfig
    from trainer.precision import resolve_precision
    from trainer.setup import target_dtype

    cfg = DrafterConfig(
        hidden_size=g.hidden, intermediate_size=g.intermediate, num_layers=g.layers,
        num_attention_heads=g.heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
        block_size=g.block, mask_token_id=g.vocab - 1,
        target_layer_ids=tuple(default_target_layer_ids(g.target_layers, g.features)),
        num_target_layers=g.target_layers, vocab_size=g.vocab, rope_theta=1e6,
        attention_backend=backend, dtype=resolve_precision(g.precision, device).master_dtype_name,
    )  # fmt: skip
    parts = _Frozen(g, device, target_dtype(device))
    with torch.device(device):  # initialise the ~1 B parameters where they live, not on the CPU first
        return DFlashDrafter(cfg, parts.embed_tokens, parts.lm_head)


def make_batch(g: Geometry, rows: int, row_len: int, device: torch.device):
    """The warm-up's synthetic packed batch (trainer.warmup.synthetic_batch) and fixed anchors for it."""
    from trainer.objective import sample_anchors
    from trainer.setup import target_dtype
    from trainer.warmup import Shape, synthetic_batch

    # Features arrive in the target's dtype, as a target rank sends them.
    batch = synthetic_batch(Shape(rows, row_len, g.anchors), g.features * g.hidden, g.vocab, device, target_dtype(device))
    anchors = sample_anchors(batch, g.anchors, g.block, torch.Generator(device=device).manual_seed(0))
    return batch, anchors


def visible_pairs(g: Geometry, batch, anchors) -> int:
    """How many (query, key) pairs the DFlash mask lets through, over all rows (one head)."""
    from trainer.attention import dense_mask

    return int(dense_mask(anchors[0], anchors[1], batch.doc_ids, g.block).sum())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # CPU-GPU sync point: a step's time must include its kernels


def time_steps(drafter, batch, anchors, steps: int, precision, gamma: float = 7.0) -> tuple[float, int]:
    """Seconds per step (mean of ``steps`` after two untimed ones) and the supervised slot count.

    The forward and the loss run in ``precision.autocast()`` (a trainer.precision.Precision), the backward
    outside it, as trainer.loop does."""
    from trainer.objective import dflash_loss

    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    device = drafter.device

    def one() -> int:
        with precision.autocast():
            out = dflash_loss(drafter, batch, num_anchors=anchors[0].shape[1], gamma=gamma, anchors=anchors)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return int(out.n_tokens)

    for _ in range(2):
        supervised = one()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    _sync(device)
    return (time.perf_counter() - t0) / steps, supervised


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)


def measure(g: Geometry, name: str, device: torch.device, rows: int, row_len: int, steps: int, peak: float | None) -> dict:
    """One backend at one row length: seconds per step, tokens/s, TFLOP/s, MFU, peak memory."""
    from trainer.config import CompileConfig
    from trainer.precision import resolve_precision
    from trainer.warmup import compile_drafter

    precision = resolve_precision(g.precision, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    drafter = build_drafter(g, name.split("+")[0], device)
    compile_drafter(drafter, CompileConfig(enabled=name.endswith("+compile")))
    batch, anchors = make_batch(g, rows, row_len, device)
    sec, supervised = time_steps(drafter, batch, anchors, steps, precision)
    flops = step_flops(g, rows, row_len, supervised, visible_pairs(g, batch, anchors))
    return {
        "backend": name, "precision": precision.name, "row_len": row_len, "rows": rows, "step_s": sec,
        "tokens_per_s": rows * row_len / sec, "tflops_per_s": flops["total"] / sec / 1e12,
        "mfu": None if peak is None else flops["total"] / sec / (peak * 1e12), "flops": flops,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }  # fmt: skip


def run_backend(g: Geometry, name: str, device: torch.device, rows: int, steps: int, peak: float | None,
                deadline: float = float("inf")) -> list[dict]:  # fmt: skip
    """Time ``name`` (sdpa, flex, flex+compile, sdpa+compile) at the longest of ``g.lengths`` that fits in
    memory; one record per length tried (an out-of-memory error moves to the next shorter length)."""
    records = []
    for row_len in g.lengths:
        if time.monotonic() > deadline:
            records.append({"backend": name, "row_len": row_len, "error": "skipped: out of time (--budget-s)"})
            return records
        oom = False
        try:
            records.append(measure(g, name, device, rows, row_len, steps, peak))
        except Exception as exc:  # noqa: BLE001 - recorded; out of memory tries a shorter row
            records.append({"backend": name, "row_len": row_len, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            oom = _oom(exc)
        # Outside the except block: the exception (and the frames holding the tensors) is gone, so the
        # memory can really go back before the next, shorter attempt.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if not oom:
            return records
    return records


def _line(rec: dict) -> str:
    if "error" in rec:
        return f"  {rec['backend']:<13} row {rec['row_len']:>6}: {rec['error']}"
    mfu = "n/a" if rec["mfu"] is None else f"{100 * rec['mfu']:.1f}%"
    mem = "" if rec["peak_mem_gib"] is None else f"  peak {rec['peak_mem_gib']:.1f} GiB"
    return (
        f"  {rec['backend']:<13} row {rec['row_len']:>6}: {rec['step_s'] * 1e3:9.1f} ms/step  "
        f"{rec['tokens_per_s']:10.0f} tok/s  {rec['tflops_per_s']:7.1f} TFLOP/s  MFU {mfu}{mem}"
    )


def step_main(a: argparse.Namespace) -> int:
    from trainer.precision import resolve_precision

    g = Geometry(**{**asdict(SIZES[a.size]), "precision": a.precision})
    if a.lengths:
        g = Geometry(**{**asdict(g), "lengths": tuple(int(x) for x in a.lengths.split(","))})
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_step: --device cuda but torch sees no CUDA GPU; use --device cpu", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = a.peak_tflops or (peak_tflops(name) if device.type == "cuda" else None)
    # flex has no CPU backward in torch: on CPU only SDPA (eager and compiled) can take a training step.
    backends = a.backends.split(",") if a.backends else (["sdpa", "flex", "flex+compile"] if device.type == "cuda" else ["sdpa"])
    peak_txt = f"{peak:.0f} TFLOPS" if peak else "unknown: pass --peak-tflops" if device.type == "cuda" else "n/a on the CPU"
    print(f"device {name}; dense bf16 peak {peak_txt}")
    print(f"size {a.size}: hidden {g.hidden}, {g.layers} layers, {g.heads}/{g.kv_heads} heads x {g.head_dim}, "
          f"block {g.block}, {g.anchors} anchors/row, {g.features} target features, precision "
          f"{resolve_precision(g.precision, device).name}")  # fmt: skip
    if device.type == "cuda":
        import torch._dynamo as dynamo  # `as`: a bare `import torch._dynamo` would make torch local here

        dynamo.config.recompile_limit = 64  # one compile per backend and row length tried
    deadline = time.monotonic() + a.budget_s
    results = []
    for b in backends:
        recs = run_backend(g, b, device, a.rows, a.steps, peak, deadline)
        results.extend(recs)
        for rec in recs:
            print(_line(rec), flush=True)
    results.extend(at_baseline_length(g, results, device, a.rows, a.steps, peak, deadline))
    base = next((r for r in results if r["backend"] == "sdpa" and "error" not in r), None)
    for r in results:
        if base is not None and "error" not in r and r["backend"] != "sdpa" and r["row_len"] == base["row_len"]:
            print(f"  {r['backend']} / sdpa at row {r['row_len']}: step time ratio {r['step_s'] / base['step_s']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": name, "peak_tflops": peak, "size": a.size, "results": results}, indent=1))
    done = {r["backend"] for r in results if "error" not in r}
    return 0 if done == set(backends) else 1


def at_baseline_length(g: Geometry, results: list[dict], device, rows: int, steps: int, peak, deadline: float) -> list[dict]:
    """A backend whose longest row is longer than SDPA's is measured again at SDPA's row, so the two compare
    at one shape (time allowing)."""
    base = next((r for r in results if r["backend"] == "sdpa" and "error" not in r), None)
    extra = []
    for r in [r for r in results if "error" not in r and r["backend"] != "sdpa"]:
        if base is None or r["row_len"] == base["row_len"] or time.monotonic() > deadline:
            continue
        try:
            rec = measure(g, r["backend"], device, rows, base["row_len"], steps, peak)
        except Exception as exc:  # noqa: BLE001 - reported like any other attempt
            rec = {"backend": r["backend"], "row_len": base["row_len"], "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(_line(rec), flush=True)
        extra.append(rec)
    return extra


def warmup_config(a: argparse.Namespace) -> int:
    """Write DIR/target/config.json (a Qwen3 config, no weights: the warm-up reads only shapes) and
    DIR/train.json (a TrainConfig: one row of --row-len, compiled drafter, caches in DIR/inductor)."""
    g, d = SIZES[a.size], Path(a.dir)
    (d / "target").mkdir(parents=True, exist_ok=True)
    target = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": g.hidden,
        "intermediate_size": g.intermediate, "num_hidden_layers": g.target_layers,
        "num_attention_heads": g.heads, "num_key_value_heads": g.kv_heads, "head_dim": g.head_dim,
        "vocab_size": g.vocab, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    }  # fmt: skip
    (d / "target" / "config.json").write_text(json.dumps(target, indent=1))
    row = a.row_len or g.lengths[-1]
    train = {
        "model": {"target": str(d / "target"), "block_size": g.block, "num_draft_layers": g.layers,
                  "num_target_features": g.features, "mask_token_id": g.vocab - 1},
        "precision": g.precision,  # the warm-up compiles the step this script times, in the same precision
        "data": {"max_len": row, "token_budget": row, "max_batch_size": 1, "num_anchors": g.anchors},
        "compile": {"enabled": True, "cache_dir": str(d / "inductor")},
        "output_dir": str(d / "out"),
    }  # fmt: skip
    (d / "train.json").write_text(json.dumps(train, indent=1))
    print(d / "train.json")
    return 0


def warmup_summary(a: argparse.Namespace) -> int:
    """One line from a `python -m trainer.warmup` log: compile seconds and cache hits of its summary."""
    events = []
    for line in Path(a.log).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    done = [e for e in events if e.get("event") == "warmup_done"]
    shapes = [e for e in events if e.get("event") == "warmup_shape"]
    if not done or not shapes:
        print(f"{a.label}: no warm-up summary in {a.log}")
        return 1
    d, s = done[-1], shapes[-1]
    print(
        f"{a.label}: compile {d['compile_s']:.1f} s (first call {s['first_call_s']:.1f} s, steady {s['steady_s']:.2f} s), "
        f"cache hits {d['cache_hits']}, misses {d['cache_misses']}, graphs {s.get('unique_graphs')}, "
        f"compiled {', '.join(k for k, v in d.get('compiled', {}).items() if v) or 'nothing'}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_step.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step", help="time flex vs SDPA drafter steps")
    s.add_argument("--size", choices=sorted(SIZES), default="qwen3-8b")
    s.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    s.add_argument("--backends", default="", help="comma list of sdpa, flex, flex+compile, sdpa+compile")
    s.add_argument("--lengths", default="", help="row lengths to try, longest first (default: by size)")
    from trainer.config import PRECISIONS

    s.add_argument("--precision", choices=sorted(PRECISIONS), default="auto",
                   help="as the trainer's setting (auto: bf16-mixed on CUDA, fp32 on the CPU; trainer/precision.py)")
    s.add_argument("--rows", type=int, default=1)
    s.add_argument("--steps", type=int, default=5)
    s.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not in the table")
    s.add_argument("--json", default="", help="also write the records here")
    s.add_argument("--budget-s", type=float, default=float("inf"), help="start no attempt after this many seconds")
    w = sub.add_parser("warmup-config", help="write a target config.json and a TrainConfig for trainer.warmup")
    w.add_argument("dir")
    w.add_argument("--size", choices=sorted(SIZES), default="qwen3-8b")
    w.add_argument("--row-len", type=int, default=0)
    m = sub.add_parser("warmup-summary", help="one line from a trainer.warmup log")
    m.add_argument("log")
    m.add_argument("--label", default="warm-up")
    a = p.parse_args(argv)
    return {"step": step_main, "warmup-config": warmup_config, "warmup-summary": warmup_summary}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
