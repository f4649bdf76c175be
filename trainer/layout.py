"""The GPU layout as a validated value object: which process does what, and who sends what to whom.

One process per GPU (DESIGN.md): each process sees exactly one GPU as cuda:0 (CUDA_VISIBLE_DEVICES), so
compile-cache keys match across GPUs and no two threads share Dynamo state. Ranks 0..T-1 run the frozen
target, ranks T..T+D-1 train the drafter under DDP. An empty layout is the colocated single-process layout
(target and drafter in one process: the CPU demo).

The feature schedule is a pure function of the step: at global step s, drafter d consumes global batch
b = s*D + d, computed by target rank b % T. Every rank can enumerate what it sends and receives at every step
without talking to anyone, so all ranks run the same number of steps and nobody waits for a message that
never comes.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """The layout is inconsistent; the message says how to fix it."""


@dataclass(frozen=True)
class Layout:
    target_gpus: tuple[int, ...] = ()
    drafter_gpus: tuple[int, ...] = ()
    num_target_procs: int = 0
    """CPU only: target processes when no GPUs are listed (tests run 1 target + 2 drafters on gloo)."""
    num_drafter_procs: int = 0
    """CPU only: drafter processes when no GPUs are listed."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_gpus", tuple(self.target_gpus))
        object.__setattr__(self, "drafter_gpus", tuple(self.drafter_gpus))
        for name, gpus in (("target_gpus", self.target_gpus), ("drafter_gpus", self.drafter_gpus)):
            if any((not isinstance(g, int)) or g < 0 for g in gpus):
                raise LayoutError(f"{name} must be GPU indices >= 0, got {list(gpus)}")
            if len(set(gpus)) != len(gpus):
                raise LayoutError(f"{name} lists a GPU twice: {list(gpus)}")
        both = sorted(set(self.target_gpus) & set(self.drafter_gpus))
        if both:
            raise LayoutError(
                f"GPU(s) {both} are in both target_gpus and drafter_gpus; each GPU runs one process: "
                "move them to one list"
            )
        if bool(self.target_gpus) != bool(self.drafter_gpus):
            raise LayoutError(
                "give both target_gpus and drafter_gpus (split layout) or neither (colocated single process)"
            )
        if self.target_gpus and (self.num_target_procs or self.num_drafter_procs):
            raise LayoutError("num_target_procs/num_drafter_procs are for CPU layouts; with GPUs the lists decide")
        if bool(self.num_target_procs) != bool(self.num_drafter_procs):
            raise LayoutError("give both num_target_procs and num_drafter_procs, or neither")

    @property
    def colocated(self) -> bool:
        """Target and drafter in one process (no GPUs listed, no CPU process counts)."""
        return not self.target_gpus and not self.num_target_procs

    @property
    def uses_gpus(self) -> bool:
        return bool(self.target_gpus)

    @property
    def num_targets(self) -> int:
        return len(self.target_gpus) or self.num_target_procs or (1 if self.colocated else 0)

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_gpus) or self.num_drafter_procs or (1 if self.colocated else 0)

    @property
    def world_size(self) -> int:
        return 1 if self.colocated else self.num_targets + self.num_drafters

    def role(self, rank: int) -> str:
        """'colocated', 'target' or 'drafter'."""
        self._check_rank(rank)
        if self.colocated:
            return "colocated"
        return "target" if rank < self.num_targets else "drafter"

    def gpu(self, rank: int) -> int | None:
        """The physical GPU index of a rank (None on CPU)."""
        self._check_rank(rank)
        if not self.uses_gpus:
            return None
        return (self.target_gpus + self.drafter_gpus)[rank]

    def drafter_index(self, rank: int) -> int:
        """0..D-1 for a drafter rank (its DDP rank)."""
        if self.role(rank) == "target":
            raise LayoutError(f"rank {rank} is a target rank")
        return 0 if self.colocated else rank - self.num_targets

    def drafter_ranks(self) -> list[int]:
        return [0] if self.colocated else list(range(self.num_targets, self.world_size))

    def target_ranks(self) -> list[int]:
        return [0] if self.colocated else list(range(self.num_targets))

    def batch_index(self, step: int, drafter: int) -> int:
        """The global batch drafter `drafter` (0-based) trains on at `step`."""
        return step * self.num_drafters + drafter

    def source_of(self, step: int, drafter: int) -> int:
        """The target rank that computes features for drafter `drafter` at `step`."""
        if self.colocated:
            return 0
        return self.batch_index(step, drafter) % self.num_targets

    def sends(self, rank: int, step: int) -> list[tuple[int, int]]:
        """What a target rank sends at `step`: [(global batch index, destination rank)], in send order."""
        if self.role(rank) != "target":
            return []
        out = []
        for d in range(self.num_drafters):
            if self.source_of(step, d) == rank:
                out.append((self.batch_index(step, d), self.num_targets + d))
        return out

    def env(self, rank: int) -> dict[str, str]:
        """Environment of a rank's process: exactly one GPU visible, PCI bus order (nvidia-smi's numbering)."""
        gpu = self.gpu(rank)
        if gpu is None:
            return {"CUDA_VISIBLE_DEVICES": ""}
        return {"CUDA_VISIBLE_DEVICES": str(gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world size {self.world_size}")
