"""Training precision: what the `precision` setting of the trainer config means for the drafter.

    fp32        float32 weights, AdamW state and compute
    bf16-mixed  float32 master weights and AdamW state; the forward and the loss run under
                torch.autocast(bfloat16) (matmuls and attention in bfloat16, reductions and the loss in
                float32), the backward outside it; the default for GPU experiments
    bf16-true   bfloat16 weights, AdamW state and compute (no float32 copy: small updates round away)
    auto        bf16-mixed on CUDA, fp32 on CPU

Only the trained drafter is concerned: the frozen target keeps its own dtype (float32 on CPU, bfloat16 on
GPUs; trainer.setup.target_dtype) and the export keeps its own (bfloat16 by default; trainer.export).
Checkpoints hold the master weights in their dtype; a checkpoint resumes under any precision (weights and
AdamW state are cast to the new master dtype, and the log says so).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from trainer.config import check_precision


@dataclass(frozen=True)
class Precision:
    """A resolved precision (never `auto`) on one device type.

    Attributes:
        name: fp32, bf16-mixed or bf16-true.
        device_type: "cpu" or "cuda" (torch.autocast's device_type).
    """

    name: str
    device_type: str

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the drafter's parameters, of AdamW's state and of the checkpointed weights."""
        return torch.bfloat16 if self.name == "bf16-true" else torch.float32

    @property
    def master_dtype_name(self) -> str:
        """master_dtype as trainer.model.DrafterConfig spells it."""
        return "bfloat16" if self.name == "bf16-true" else "float32"

    def autocast(self):
        """The context the forward and the loss run in: bfloat16 autocast under bf16-mixed, else nothing."""
        if self.name == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def resolve_precision(setting: str, device: torch.device | str) -> Precision:
    """The precision a drafter on `device` trains in (`auto`: bf16-mixed on CUDA, fp32 elsewhere).

    Raises:
        ValueError: not a precision (see check_precision).
    """
    device_type = torch.device(device).type
    name = check_precision(setting)
    if name == "auto":
        name = "bf16-mixed" if device_type == "cuda" else "fp32"
    return Precision(name, device_type)
