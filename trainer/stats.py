"""Step statistics of one logging window, as one dataclass that packs itself for all_reduce.

Every drafter rank adds what it trained to its own `StepStats`; at a logging step the ranks reduce them
(`reduced`), and the main rank turns the sum into a metrics record (`record`). Fields are summed over ranks,
except those marked `reduce: max` (memory snapshots, where each rank fills its own row). Packing walks the
dataclass fields in order, so adding a statistic is adding a field: there is no index arithmetic to keep in
step with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import torch

MEM_KEYS = ("alloc_mb", "peak_mb", "rss_mb", "peak_rss_mb")
"""Columns of the per-rank memory table (MiB): allocated and peak on CUDA; on CPU both are the resident set."""

_MAX = {"reduce": "max"}


def _vec(n: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.zeros(n, dtype=torch.float64)


@dataclass
class StepStats:
    """Sums over the steps of one logging window (and over drafter ranks once reduced).

    Attributes:
        loss_sum: sum of the micro-batch losses.
        batches: micro-batches trained.
        tokens: real (non-pad) tokens trained on.
        supervised: supervised block slots.
        accept_sum: simulated acceptance lengths summed over blocks (with `blocks`: the simulated τ).
        blocks: anchored blocks.
        slot_correct: [bs-1] correct predictions per block slot 1..bs-1.
        slot_count: [bs-1] supervised predictions per block slot.
        drafter_s: seconds drafter processes spent computing (summed over processes).
        wait_s: seconds drafter processes waited for features (summed over processes).
        target_s: [T] seconds each target rank spent on the batches it computed (colocated: one slot).
        target_tokens: [T] tokens of those batches.
        memory: [W, len(MEM_KEYS)] memory of every rank (max-reduced: each rank writes its own row, and a
            target's row comes with its batches).
    """

    block_size: int = field(metadata={"pack": False})
    num_targets: int = field(metadata={"pack": False})
    world_size: int = field(metadata={"pack": False})
    loss_sum: float = 0.0
    batches: float = 0.0
    tokens: float = 0.0
    supervised: float = 0.0
    accept_sum: float = 0.0
    blocks: float = 0.0
    drafter_s: float = 0.0
    wait_s: float = 0.0
    slot_correct: torch.Tensor = None  # type: ignore[assignment]
    slot_count: torch.Tensor = None  # type: ignore[assignment]
    target_s: torch.Tensor = None  # type: ignore[assignment]
    target_tokens: torch.Tensor = None  # type: ignore[assignment]
    memory: torch.Tensor = field(default=None, metadata=_MAX)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        shapes = {
            "slot_correct": (self.block_size - 1,),
            "slot_count": (self.block_size - 1,),
            "target_s": (self.num_targets,),
            "target_tokens": (self.num_targets,),
            "memory": (self.world_size, len(MEM_KEYS)),
        }
        for name, shape in shapes.items():
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(shape, dtype=torch.float64))

    # -- adding --------------------------------------------------------------------------------------
    def add_batch(self, res, tokens: int, source: int, target_s: float) -> None:
        """Add one trained micro-batch: `res` is dflash_loss's StepOutput; `source` the target slot."""
        self.loss_sum += float(res.loss.detach())  # CPU-GPU sync point: once per batch, the metrics need it
        self.batches += 1
        self.tokens += tokens
        self.supervised += float(res.n_tokens)
        self.accept_sum += float(res.accept_sum)
        self.blocks += float(res.n_blocks)
        self.slot_correct += res.slot_correct.detach().double().cpu()
        self.slot_count += res.slot_count.detach().double().cpu()
        self.target_s[source] += target_s
        self.target_tokens[source] += tokens

    def set_memory(self, rank: int, mem: dict[str, float]) -> None:
        """Record the memory snapshot of `rank` (MEM_KEYS)."""
        self.memory[rank] = torch.tensor([float(mem.get(k, 0.0)) for k in MEM_KEYS], dtype=torch.float64)

    def fresh(self) -> "StepStats":
        """An empty window of the same shapes."""
        return StepStats(self.block_size, self.num_targets, self.world_size)

    # -- packing -------------------------------------------------------------------------------------
    def _packed_fields(self, op: str) -> list[str]:
        return [f.name for f in fields(self) if f.metadata.get("pack", True) and f.metadata.get("reduce", "sum") == op]

    def pack(self, op: str) -> torch.Tensor:
        """The fields reduced with `op` ("sum" or "max") as one flat float64 tensor, in field order."""
        parts = [torch.as_tensor(getattr(self, n), dtype=torch.float64).reshape(-1) for n in self._packed_fields(op)]
        return torch.cat(parts)

    def unpack(self, op: str, flat: torch.Tensor) -> "StepStats":
        """A copy of self with the `op` fields read back from `flat` (the inverse of `pack`)."""
        flat = flat.detach().to("cpu", torch.float64)
        names = self._packed_fields(op)
        sizes = [getattr(self, n).numel() if isinstance(getattr(self, n), torch.Tensor) else 1 for n in names]
        if sum(sizes) != flat.numel():
            raise ValueError(f"packed stats have {flat.numel()} values, the fields take {sum(sizes)}")
        out: dict[str, Any] = {}
        for n, chunk in zip(names, flat.split(sizes)):
            cur = getattr(self, n)
            out[n] = chunk.reshape(cur.shape).clone() if isinstance(cur, torch.Tensor) else float(chunk[0])
        return replace(self, **out)

    def reduced(self, group=None, device: torch.device | None = None) -> "StepStats":
        """The window summed (memory: max) over the ranks of `group`; self when there is no group.

        A collective: every rank of the group must call it at the same step.
        """
        if group is None:
            return self
        import torch.distributed as dist

        out = self
        for op, red in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
            t = self.pack(op).to(device)
            dist.all_reduce(t, op=red, group=group)
            out = out.unpack(op, t)
        return out

    # -- reporting -----------------------------------------------------------------------------------
    def record(self, wall_s: float, drafter_procs: int) -> dict[str, Any]:
        """The statistics part of a `train` metrics record.

        Args:
            wall_s: wall-clock seconds of the window.
            drafter_procs: drafter processes whose busy/wait seconds were summed.
        """
        cnt = self.slot_count.clamp(min=1)
        tgt = [(s, t) for s, t in zip(self.target_s.tolist(), self.target_tokens.tolist()) if s > 0]
        return {
            "loss": self.loss_sum / max(self.batches, 1),
            "acc": float(self.slot_correct.sum() / self.slot_count.sum().clamp(min=1)),
            "acc_per_slot": (self.slot_correct / cnt).tolist(),
            "sim_tau": self.accept_sum / max(self.blocks, 1),
            "tokens_per_s": self.tokens / max(wall_s, 1e-9),
            "drafter_tokens_per_s": self.tokens / max(self.drafter_s / drafter_procs, 1e-9),
            "target_tokens_per_s": float(sum(t / s for s, t in tgt)),
            "feature_wait_s": self.wait_s / drafter_procs,
            "tokens": int(self.tokens),
            "supervised": int(self.supervised),
        }
