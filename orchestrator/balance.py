"""Which side of a split layout waits, and the split of GPUs that the measured rates suggest (pure).

A split layout has T target ranks computing features and D drafter ranks training on them. Each training
record of `metrics.jsonl` carries the rates of both sides over its window (trainer.stats.StepStats.record):

    target_tokens_per_s    the target ranks' summed rate: tokens whose features they computed per busy second
    drafter_tokens_per_s   the drafter ranks' rate had they never waited for features: the tokens they trained
                           on per busy second of one rank (data-parallel ranks step together, so this is the
                           group's rate)
    tokens_per_s           what the run achieved

Per GPU, a target rank computes t = target_tokens_per_s / T tokens/s and a drafter rank trains d =
drafter_tokens_per_s / D (data parallel: the group's rate grows with its size). With N = T + D GPUs on the
node, a split T' + D' delivers about min(T' * t, D' * d); the advice is the T' that maximises it (ties: fewer
target GPUs). The arithmetic is printed with the advice, so a user can check it. Medians over the last
records smooth the warm-up and evaluation pauses.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Balance:
    """The measured balance of a split layout and the suggested split.

    Attributes:
        targets / drafters: ranks of each side now.
        target_per_gpu / drafter_per_gpu: median tokens/s of one rank of each side.
        waiting: "drafters" (features arrive slower than drafters train), "targets", or "neither".
        suggested_targets / suggested_drafters: the split that maximises min(T * t, D * d).
        now_tokens_per_s / suggested_tokens_per_s: that minimum for the current and the suggested split.
    """

    targets: int
    drafters: int
    target_per_gpu: float
    drafter_per_gpu: float
    waiting: str
    suggested_targets: int
    suggested_drafters: int
    now_tokens_per_s: float
    suggested_tokens_per_s: float

    def lines(self) -> list[str]:
        t, d = self.target_per_gpu, self.drafter_per_gpu
        side = {"drafters": "the drafter ranks wait for features (the target side is the bottleneck)",
                "targets": "the target ranks wait for the drafters (the drafter side is the bottleneck)",
                "neither": "both sides keep pace"}[self.waiting]
        out = [
            f"balance: {side}",
            f"  per GPU: a target rank computes {t:.0f} tokens/s of features, a drafter rank trains {d:.0f} tokens/s",
            f"  now {self.targets} target + {self.drafters} drafter: min({self.targets} x {t:.0f}, "
            f"{self.drafters} x {d:.0f}) = {self.now_tokens_per_s:.0f} tokens/s",
        ]
        if (self.suggested_targets, self.suggested_drafters) == (self.targets, self.drafters):
            out.append("  this split is already the best of the node's GPUs")
        else:
            gain = self.suggested_tokens_per_s / self.now_tokens_per_s if self.now_tokens_per_s else float("inf")
            out.append(
                f"  suggested {self.suggested_targets} target + {self.suggested_drafters} drafter: "
                f"min({self.suggested_targets} x {t:.0f}, {self.suggested_drafters} x {d:.0f}) = "
                f"{self.suggested_tokens_per_s:.0f} tokens/s ({gain:.2f}x); set the experiment's layout "
                f"target_gpus/drafter_gpus to that many")
        return out


def suggest(targets: int, drafters: int, target_tokens_per_s: float, drafter_tokens_per_s: float,
            tolerance: float = 0.1) -> Balance:
    """The balance from one pair of side rates (see the module docstring).

    Args:
        targets / drafters: the ranks of each side (both >= 1).
        target_tokens_per_s: the target side's summed rate.
        drafter_tokens_per_s: the drafter group's rate.
        tolerance: sides within this fraction of each other are "neither" waiting.

    Raises:
        ValueError: no rank on a side, or a rate that is not positive.
    """
    if targets < 1 or drafters < 1:
        raise ValueError(f"a split layout needs ranks on both sides, got {targets} target and {drafters} drafter")
    if target_tokens_per_s <= 0 or drafter_tokens_per_s <= 0:
        raise ValueError("the rates must be positive")
    t, d = target_tokens_per_s / targets, drafter_tokens_per_s / drafters
    n = targets + drafters
    now = min(targets * t, drafters * d)
    best = max(range(1, n), key=lambda k: (min(k * t, (n - k) * d), -k))
    if abs(target_tokens_per_s - drafter_tokens_per_s) <= tolerance * max(target_tokens_per_s, drafter_tokens_per_s):
        waiting = "neither"
    else:
        waiting = "drafters" if target_tokens_per_s < drafter_tokens_per_s else "targets"
    return Balance(targets, drafters, t, d, waiting, best, n - best, now, min(best * t, (n - best) * d))


@dataclass(frozen=True)
class Colocated:
    """A colocated run (one process computes the features, then trains on them, in turn) and what splitting
    it over two devices would give: 1 target + 1 drafter deliver min(t, d) where one process gets
    1 / (1/t + 1/d)."""

    target_tokens_per_s: float
    drafter_tokens_per_s: float

    def lines(self) -> list[str]:
        t, d = self.target_tokens_per_s, self.drafter_tokens_per_s
        now = 1 / (1 / t + 1 / d)
        split = min(t, d)
        return [
            f"balance: colocated (one process computes the features, then trains): features {t:.0f} tokens/s, "
            f"training {d:.0f} tokens/s; {now / t:.0%} of a step computes features",
            f"  now 1 / (1/{t:.0f} + 1/{d:.0f}) = {now:.0f} tokens/s; split over two devices, 1 target + 1 drafter: "
            f"min({t:.0f}, {d:.0f}) = {split:.0f} tokens/s ({split / now:.2f}x)",
        ]


def from_records(rows: list[dict], targets: int, drafters: int, last: int = 20) -> Balance | Colocated | None:
    """The balance from a run's metrics records (medians over the last `last` training records).

    targets = drafters = 0 is a colocated run (`Colocated`); None before any training record with both rates.
    """
    if (targets < 1) != (drafters < 1):
        return None
    pairs = [(r["target_tokens_per_s"], r["drafter_tokens_per_s"]) for r in rows
             if r.get("kind", "train") == "train"
             and all(isinstance(r.get(k), (int, float)) and r[k] > 0 for k in ("target_tokens_per_s", "drafter_tokens_per_s"))]
    if not pairs:
        return None
    pairs = pairs[-last:]
    if targets < 1:
        return Colocated(statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs))
    return suggest(targets, drafters, statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs))
