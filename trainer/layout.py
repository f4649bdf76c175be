"""The GPU layout as a validated value object: which process does what, and who sends what to whom.

One process per GPU (docs/remote-stack.md §2, §3): each process sees exactly one GPU as cuda:0 (CUDA_VISIBLE_DEVICES), so
compile-cache keys match across GPUs and no two threads share Dynamo state. Ranks 0..T-1 run the frozen
target, ranks T..T+D-1 train the drafter under DDP. An empty layout is the colocated single-process layout
(target and drafter in one process: the CPU demo).

The feature schedule (`Schedule`) is a pure function of the step: optimizer step s trains the global batches
s*G .. s*G+G-1 (G = batches per step, a setting of the experiment, not of the layout); drafter d trains the
d-th run of G/D consecutive ones, and target rank b % T computes batch b. Every rank can enumerate what it
sends and receives at every step without talking to anyone, so all ranks run the same number of steps and
nobody waits for a message that never comes. Because G does not depend on the layout, a checkpoint resumes
under any layout whose drafter count divides G.
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

    def env(self, rank: int) -> dict[str, str]:
        """Environment of a rank's process: exactly one GPU visible, PCI bus order (nvidia-smi's numbering)."""
        gpu = self.gpu(rank)
        if gpu is None:
            return {"CUDA_VISIBLE_DEVICES": ""}
        return {"CUDA_VISIBLE_DEVICES": str(gpu), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world size {self.world_size}")


@dataclass(frozen=True)
class Schedule:
    """Which global batch each drafter trains and each target computes, step by step (pure).

    Args:
        layout: the process layout.
        per_step: global batches per optimizer step (G); a multiple of the drafter count.

    Raises:
        LayoutError: per_step is not a positive multiple of the layout's drafter count.
    """

    layout: Layout
    per_step: int

    def __post_init__(self) -> None:
        D = self.layout.num_drafters
        if self.per_step < 1 or self.per_step % D:
            raise LayoutError(
                f"{self.per_step} batch(es) per step cannot be split evenly over {D} drafter process(es): "
                f"set data.batches_per_step to a multiple of {D}"
            )

    @property
    def per_drafter(self) -> int:
        """Batches one drafter trains per step (gradient accumulation when > 1)."""
        return self.per_step // self.layout.num_drafters

    def batches(self, step: int, drafter: int) -> list[int]:
        """The global batches drafter `drafter` (0-based) trains at `step`, in training order."""
        first = step * self.per_step + drafter * self.per_drafter
        return list(range(first, first + self.per_drafter))

    def drafter_of(self, batch: int) -> int:
        """The drafter index (0-based) that trains global batch `batch`."""
        return (batch % self.per_step) // self.per_drafter

    def source(self, batch: int) -> int:
        """The target rank that computes the features of global batch `batch` (0 when colocated)."""
        return 0 if self.layout.colocated else batch % self.layout.num_targets

    def sends(self, rank: int, step: int) -> list[tuple[int, int]]:
        """What target rank `rank` sends at `step`: [(global batch, destination rank)], in send order.

        Between one target and one drafter the batches go in increasing order, the order in which the
        drafter posts its receives, so messages of one pair never overtake each other.
        """
        if self.layout.role(rank) != "target":
            return []
        first = step * self.per_step
        return [
            (b, self.layout.num_targets + self.drafter_of(b))
            for b in range(first, first + self.per_step)
            if self.source(b) == rank
        ]
