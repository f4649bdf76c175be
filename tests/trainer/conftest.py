"""The trainer tests' session fixtures: tiny targets (tests/trainer/tiny_targets.py builds them)."""

from __future__ import annotations

import pytest
import torch

from tiny_targets import build_target
from trainer.features import TargetModel

# Models here are tiny: a matmul is microseconds, so intra-op threads only add synchronisation, and on a
# shared 2-core box (other test processes running) that spinning made each step ~10x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def qwen3_target() -> TargetModel:
    return build_target("qwen3", layers=6, layer_ids=(1, 2, 3))


@pytest.fixture(scope="session")
def llama_target() -> TargetModel:
    return build_target("llama", layers=4, layer_ids=(0, 1, 2), seed=1)
