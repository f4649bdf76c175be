"""Structured metrics: one JSON object per line in `metrics.jsonl`, never a half line.

The orchestrator follows this file while training runs (and compares runs), so every line must be a
complete JSON object the moment it becomes visible: each record is serialised first and written with a
single `write` + flush + fsync on a file opened in append mode.

When the `tensorboard` package is installed (the optional extra), the same records also go to TensorBoard
event files in `<run>/tensorboard/` (torch's own SummaryWriter), so `tensorboard --logdir <run>` shows them:
tag `<kind>/<key>` (`train/loss`, `eval/tau_tree64`), a list as one tag per element, and a "τ" chart of the
training's simulated τ beside the evaluations' real τ.
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import sys
from pathlib import Path
from typing import Any

from trainer.atomic import write_lines


def _clean(value: Any) -> Any:
    """Make a value JSON-safe: tensors/numpy scalars to Python numbers, NaN/inf to strings.

    JSON has no NaN; a diverged loss must still produce a valid line (as the string "nan").
    """
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "tolist"):
        return _clean(value.tolist())
    return value


# -- τ of an evaluation in a metrics record: one naming rule, read back by `dflashctl metrics` ---------------
_TAU_KEY = re.compile(r"^tau_(chain|tree(\d+))(?:_t(\d+(?:\.\d+)?))?$")


def _mode(budget: int | None, temperature: float) -> str:
    mode = "chain" if budget is None else f"tree{budget}"
    return mode if temperature == 0 else f"{mode}_t{temperature:g}"


def tau_key(budget: int | None, temperature: float = 0.0) -> str:
    """Record key of a real τ: ``tau_chain``, ``tau_tree64``, ``tau_chain_t0.7``, ``tau_tree64_t1``."""
    return f"tau_{_mode(budget, temperature)}"


def width_key(budget: int | None, temperature: float = 0.0) -> str:
    """Record key of the mean tokens per verifying target forward of the same mode (``verify_tree64``)."""
    return f"verify_{_mode(budget, temperature)}"


def parse_tau_key(key: str) -> tuple[int | None, float] | None:
    """(budget or None for the chain, temperature) of a `tau_key`, or None for any other key."""
    m = _TAU_KEY.match(key)
    if m is None:
        return None
    return (int(m.group(2)) if m.group(2) else None, float(m.group(3) or 0.0))


class _TensorBoard:
    """TensorBoard event files of the metrics records (torch.utils.tensorboard.SummaryWriter)."""

    def __init__(self, log_dir: Path, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or after it, logged by a killed process after the checkpoint this run resumes
        # from, are hidden by the viewer (metrics.jsonl drops the same records with rewind_metrics).
        self._w = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        if purge_step is None:
            self._w.add_custom_scalars(
                {"τ": {"simulated (train) and real (eval)": ["Multiline", ["train/sim_tau", r"eval/tau_(chain|tree\d+)$"]]}}
            )

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        kind = str(record.get("kind", "train"))
        when = record.get("time") if isinstance(record.get("time"), (int, float)) else None
        for key, value in record.items():
            if key in ("step", "time", "kind"):
                continue
            values = value if isinstance(value, list) else [value]
            for i, v in enumerate(values):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    tag = f"{kind}/{key}" if not isinstance(value, list) else f"{kind}/{key}/{i}"
                    self._w.add_scalar(tag, v, global_step=step, walltime=when)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _last_step(path: Path) -> int | None:
    steps = [r["step"] for r in read_metrics(path) if isinstance(r.get("step"), int)]
    return max(steps) if steps else None


class MetricsWriter:
    """Appends one JSON object per line to a file, flushed and fsynced per line.

    Args:
        path: the jsonl file (created with its parent directory if missing; appended to otherwise,
            so a resumed run continues the same file).
        echo: also print a short human line to stdout per record (the orchestrator tees stdout to
            train.log).
        tensorboard: also write TensorBoard events to `tensorboard/` beside the file: None = when the
            `tensorboard` package is installed, True = always (an error without it), False = never.

    Raises:
        RuntimeError: tensorboard=True without the `tensorboard` package.
    """

    def __init__(self, path: str | Path, echo: bool = False, tensorboard: bool | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self._tb = self._open_tensorboard(tensorboard)
        # Append mode: the OS positions every write at the end, so a concurrent reader sees whole lines.
        self._f = open(self.path, "a", encoding="utf-8")
        self._repair_tail()

    def _open_tensorboard(self, wanted: bool | None) -> _TensorBoard | None:
        if wanted is False:
            return None
        try:
            import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
        except ImportError:
            if wanted:
                raise RuntimeError("TensorBoard events need the tensorboard package: pip install tensorboard") from None
            return None
        last = _last_step(self.path) if self.path.exists() else None
        return _TensorBoard(self.path.parent / "tensorboard", None if last is None else last + 1)

    def _repair_tail(self) -> None:
        """If a previous process died mid-line (should not happen, but disks lie), end that line first.

        Without this the next record would be glued to the fragment and both lines would be unreadable.
        """
        try:
            size = self.path.stat().st_size
        except OSError:
            return
        if size == 0:
            return
        with open(self.path, "rb") as r:
            r.seek(size - 1)
            if r.read(1) != b"\n":
                self._f.write("\n")
                self._f.flush()

    def write(self, record: dict[str, Any]) -> None:
        """Append one record as a single line.

        Args:
            record: a flat-ish dict; tensors, numpy scalars and non-finite floats are converted.
        """
        line = json.dumps(_clean(record), separators=(",", ":"), sort_keys=False) + "\n"
        self._f.write(line)
        self._f.flush()
        os.fsync(self._f.fileno())
        if self._tb is not None:
            self._tb.write(_clean(record))
        if self.echo:
            print(format_human(record), flush=True)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read every complete line of a metrics file (a trailing partial line is ignored).

    Returns:
        The records in file order.
    """
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def format_human(record: dict[str, Any]) -> str:
    """One human-readable log line for a metrics record (the keys that exist, in a fixed order)."""
    parts = []
    for key, fmt in (
        ("step", "{}"),
        ("epoch", "{}"),
        ("loss", "{:.4f}"),
        ("acc", "{:.3f}"),
        ("sim_tau", "{:.3f}"),
        ("tokens_per_s", "{:.0f}"),
        ("lr", "{:.2e}"),
        ("rss_mb", "{:.0f}"),
    ):
        if key in record and isinstance(record[key], (int, float)):
            parts.append(f"{key} " + fmt.format(record[key]))
    kind = record.get("kind", "train")
    return f"[{kind}] " + " | ".join(parts)


def run_facts(cfg, target, drafter, mask_token_id: int) -> dict[str, Any]:
    """The `facts` record written once at the start of training: what a train/serve mismatch is made of.

    The follower's silent-failure alert (orchestrator.monitor.SilentFailure) quotes these values when real τ
    stays near 1 while the accuracy rises. Every value is what this run trains with: the target's feature
    layers and depth, the MASK id, both RoPE bases, the chat-template arguments of the training data (the
    held-out prompts the run evaluates on go through the same ones).
    """
    dcfg = getattr(drafter, "cfg", None)
    layout = cfg.layout.to_layout()
    split = not layout.colocated
    return _clean({
        "kind": "facts",
        "target_ranks": layout.num_targets if split else 0,  # 0: colocated, one process does both sides
        "drafter_ranks": layout.num_drafters if split else 0,
        "target_layer_ids": list(getattr(dcfg, "target_layer_ids", None) or getattr(target, "layer_ids", [])),
        "num_target_layers": getattr(target, "num_layers", None),
        "mask_token_id": int(mask_token_id),
        "rope_theta_target": getattr(target, "rope_theta", None),
        "rope_theta_drafter": getattr(dcfg, "rope_theta", None),
        "chat_template_kwargs": dict(cfg.data.chat_template_kwargs),  # the held-out prompts' too
    })


def memory_stats() -> dict[str, float]:
    """Current and peak resident memory of this process in MiB (and CUDA peak when on a GPU).

    RSS comes from /proc (Linux); the peak from getrusage (KiB on Linux, bytes on macOS).
    """
    stats: dict[str, float] = {}
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        stats["rss_mb"] = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    stats["peak_rss_mb"] = peak / 2**20 if sys.platform == "darwin" else peak / 1024
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stats["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    except ImportError:
        pass
    return stats


def rewind_metrics(path: str | Path, step: int) -> int:
    """Drop records logged after `step` (a resumed run repeats those steps); temp file + rename.

    Records without a step are kept. Returns the number of records dropped.
    """
    p = Path(path)
    if not p.exists():
        return 0
    records = read_metrics(p)
    keep = [r for r in records if not isinstance(r.get("step"), int) or r["step"] <= step]
    if len(keep) == len(records):
        return 0
    write_lines(p, (json.dumps(r, separators=(",", ":")) + "\n" for r in keep))
    return len(records) - len(keep)
