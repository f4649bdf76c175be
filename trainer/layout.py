"""The GPU layout as a validated value object: which process does what, and who sends what to whom.

One process per GPU (docs/remote-stack.md §2, §3): each process sees exactly one GPU as cuda:0 (CUDA_VISIBLE_DEVICES), so
compile-cache keys match across GPUs and no two threads share Dynamo state. Ranks 0..T-1 run the frozen
target, ranks T..T+D-1 train the drafter under DDP. An empty layout is the colocated single-process layout
(target and drafter in one process: the CPU demo).

A layout may span nodes (containers or hosts, one elastic agent each): `nodes` lists each node's target and
drafter GPUs (or CPU process counts). Global ranks still put every target first: the targets of node 0, of
node 1, ..., then the drafters of node 0, of node 1, ... A node's local ranks are its targets, then its
drafters, in list order; `place(rank)` gives a rank's node, local rank and GPU on that node, `rank_of` the
way back. GPU indices are per node (node 1's GPU 0 is not node 0's). A layout without `nodes` is one node.

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
class NodeSpec:
    """One node of a layout across nodes: its GPUs (nvidia-smi indices on that node) or CPU process counts.

    A node may hold only target ranks or only drafter ranks. `name` is what the user calls it (the
    inventory's target name), used in messages only.
    """

    target_gpus: tuple[int, ...] = ()
    drafter_gpus: tuple[int, ...] = ()
    num_target_procs: int = 0
    num_drafter_procs: int = 0
    name: str | None = None

    @property
    def num_targets(self) -> int:
        return len(self.target_gpus) or self.num_target_procs

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_gpus) or self.num_drafter_procs

    @property
    def uses_gpus(self) -> bool:
        return bool(self.target_gpus or self.drafter_gpus)

    def label(self, index: int) -> str:
        return f"node {index}" + (f" ({self.name})" if self.name else "")


@dataclass(frozen=True)
class Placement:
    """Where a global rank runs: its node, its local rank there, and its GPU on that node (None: CPU)."""

    node: int
    local_rank: int
    gpu: int | None


def _check_gpus(where: str, target_gpus: tuple, drafter_gpus: tuple) -> None:
    for name, gpus in (("target_gpus", target_gpus), ("drafter_gpus", drafter_gpus)):
        if any((not isinstance(g, int)) or isinstance(g, bool) or g < 0 for g in gpus):
            raise LayoutError(f"{where}{name} must be GPU indices >= 0, got {list(gpus)}")
        if len(set(gpus)) != len(gpus):
            raise LayoutError(f"{where}{name} lists a GPU twice: {list(gpus)}")
    both = sorted(set(target_gpus) & set(drafter_gpus))
    if both:
        raise LayoutError(
            f"{where}GPU(s) {both} are in both target_gpus and drafter_gpus; each GPU runs one process: "
            "move them to one list"
        )


def _check_node(i: int, node: NodeSpec) -> NodeSpec:
    """A node of `nodes`, normalised (tuples), or LayoutError naming `nodes[i]`."""
    node = NodeSpec(tuple(node.target_gpus), tuple(node.drafter_gpus), node.num_target_procs,
                    node.num_drafter_procs, node.name)
    where = f"nodes[{i}]" + (f" ({node.name})" if node.name else "") + ": "
    _check_gpus(where, node.target_gpus, node.drafter_gpus)
    if node.uses_gpus and (node.num_target_procs or node.num_drafter_procs):
        raise LayoutError(f"{where}num_target_procs/num_drafter_procs are for CPU nodes; with GPUs the lists decide")
    if node.num_targets + node.num_drafters == 0:
        raise LayoutError(f"{where}runs no rank: give it target_gpus and/or drafter_gpus (or drop the node)")
    return node


@dataclass(frozen=True)
class Layout:
    target_gpus: tuple[int, ...] = ()
    drafter_gpus: tuple[int, ...] = ()
    num_target_procs: int = 0
    """CPU only: target processes when no GPUs are listed (tests run 1 target + 2 drafters on gloo)."""
    num_drafter_procs: int = 0
    """CPU only: drafter processes when no GPUs are listed."""
    nodes: tuple[NodeSpec, ...] = ()
    """A layout across nodes (the four fields above stay empty); () is one node."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_gpus", tuple(self.target_gpus))
        object.__setattr__(self, "drafter_gpus", tuple(self.drafter_gpus))
        object.__setattr__(self, "nodes", tuple(_check_node(i, n) for i, n in enumerate(self.nodes)))
        if self.nodes:
            self._check_nodes()
            return
        _check_gpus("", self.target_gpus, self.drafter_gpus)
        if bool(self.target_gpus) != bool(self.drafter_gpus):
            raise LayoutError(
                "give both target_gpus and drafter_gpus (split layout) or neither (colocated single process)"
            )
        if self.target_gpus and (self.num_target_procs or self.num_drafter_procs):
            raise LayoutError("num_target_procs/num_drafter_procs are for CPU layouts; with GPUs the lists decide")
        if bool(self.num_target_procs) != bool(self.num_drafter_procs):
            raise LayoutError("give both num_target_procs and num_drafter_procs, or neither")

    def _check_nodes(self) -> None:
        if self.target_gpus or self.drafter_gpus or self.num_target_procs or self.num_drafter_procs:
            raise LayoutError("a layout with `nodes` lists every GPU under its node: drop the top-level "
                              "target_gpus/drafter_gpus/num_*_procs")
        if len({n.uses_gpus for n in self.nodes}) > 1:
            raise LayoutError("some nodes list GPUs and others CPU process counts: a run is all GPUs or all CPU")
        if not any(n.num_targets for n in self.nodes) or not any(n.num_drafters for n in self.nodes):
            raise LayoutError("the nodes together need at least one target rank and one drafter rank")

    @property
    def node_specs(self) -> tuple[NodeSpec, ...]:
        """Every node (a layout without `nodes` is its own single node)."""
        if self.nodes:
            return self.nodes
        return (NodeSpec(self.target_gpus, self.drafter_gpus, self.num_target_procs, self.num_drafter_procs),)

    @property
    def num_nodes(self) -> int:
        return len(self.node_specs)

    @property
    def colocated(self) -> bool:
        """Target and drafter in one process (no GPUs listed, no CPU process counts, one node)."""
        return not self.nodes and not self.target_gpus and not self.num_target_procs

    @property
    def uses_gpus(self) -> bool:
        return any(n.uses_gpus for n in self.node_specs)

    @property
    def num_targets(self) -> int:
        return 1 if self.colocated else sum(n.num_targets for n in self.node_specs)

    @property
    def num_drafters(self) -> int:
        return 1 if self.colocated else sum(n.num_drafters for n in self.node_specs)

    @property
    def world_size(self) -> int:
        return 1 if self.colocated else self.num_targets + self.num_drafters

    def placements(self) -> tuple[Placement, ...]:
        """Every global rank's placement, in rank order (targets of every node first, then drafters)."""
        if self.colocated:
            return (Placement(0, 0, None),)
        specs = self.node_specs
        targets = [Placement(i, j, n.target_gpus[j] if n.uses_gpus else None)
                   for i, n in enumerate(specs) for j in range(n.num_targets)]
        drafters = [Placement(i, n.num_targets + j, n.drafter_gpus[j] if n.uses_gpus else None)
                    for i, n in enumerate(specs) for j in range(n.num_drafters)]
        return tuple(targets + drafters)

    def place(self, rank: int) -> Placement:
        """Where global rank `rank` runs."""
        self._check_rank(rank)
        return self.placements()[rank]

    def node_ranks(self, node: int) -> list[int]:
        """The global ranks of node `node`, in local-rank order."""
        self._check_node(node)
        mine = [(p.local_rank, r) for r, p in enumerate(self.placements()) if p.node == node]
        return [r for _, r in sorted(mine)]

    def rank_of(self, node: int, local_rank: int) -> int:
        """The global rank of local rank `local_rank` on node `node`."""
        ranks = self.node_ranks(node)
        if not 0 <= local_rank < len(ranks):
            raise LayoutError(f"local rank {local_rank} outside node {node}'s {len(ranks)} rank(s)")
        return ranks[local_rank]

    def describe_rank(self, rank: int) -> str:
        """`rank 2 (drafter, node 1 (ct201), local rank 1)` for messages."""
        p = self.place(rank)
        where = f", {self.node_specs[p.node].label(p.node)}, local rank {p.local_rank}" if self.num_nodes > 1 else ""
        return f"rank {rank} ({self.role(rank)}{where})"

    def role(self, rank: int) -> str:
        """'colocated', 'target' or 'drafter'."""
        self._check_rank(rank)
        if self.colocated:
            return "colocated"
        return "target" if rank < self.num_targets else "drafter"

    def gpu(self, rank: int) -> int | None:
        """The physical GPU index of a rank on its node (None on CPU)."""
        return self.place(rank).gpu

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

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise LayoutError(f"node {node} outside the layout's {self.num_nodes} node(s)")


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
