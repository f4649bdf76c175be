"""Training checkpoints: complete or absent, resumable, newest K kept.

Layout under the run directory::

    checkpoints/step_00000200/state.pt    model, optimizer, step, data position, RNG states
    checkpoints/step_00000200/meta.json   written LAST: step, and size + sha256 of state.pt

A checkpoint is written into `checkpoints/.tmp-step_...`, every file fsynced, then the directory is renamed
into place (rename is atomic on one filesystem) and the parent fsynced. So a SIGKILL at any moment leaves
either the old set of checkpoints or the old set plus one complete new one, never a half one under a final
name. Resume still verifies meta.json (size and hash) and that the file loads, and skips with a warning
anything that does not: a disk can lie, and a user can copy a directory half-way.

The run's policy lives here too (`RunCheckpoints`): when the loop saves (every `save_every` steps before the
last; the last step's checkpoint is written with the export), how many are kept (`keep_checkpoints`), what a
checkpoint holds (one format for every layout: the drafter module's state, never DDP's, AdamW's state, the
step, G = batches per step, the RNG states and the precision) and which one a run resumes from (the newest
complete one, the same step on every rank, of this format and this G).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from trainer.atomic import fsync_dir as _fsync_dir
from trainer.config import TrainConfig
from trainer.precision import Precision
from trainer.setup import TrainError

_NAME = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk."""

    step: int
    path: Path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _warn(msg: str) -> None:
    print(f"[checkpoint] warning: {msg}", file=sys.stderr, flush=True)


class CheckpointManager:
    """Saves and finds checkpoints in one directory.

    Args:
        root: the checkpoints directory (created if missing).
        keep: how many complete checkpoints to keep; older ones are deleted after a successful save.
    """

    def __init__(self, root: str | Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    # -- writing -----------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write a checkpoint atomically and prune old ones.

        Args:
            step: the optimizer step the state is AFTER (resume continues with step + 1).
            state: a dict of tensors / plain Python values (must load with `weights_only=True`).

        Returns:
            The final checkpoint directory.
        """
        self._recover()
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-step_{step:08d}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            self._write(tmp, step, state)
        except BaseException:
            # A failed write (a full disk, a kill signal turned into an exception) leaves no partial step
            # behind: the space goes back to the file system now, not at the next save.
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            # Same step saved again (a resumed run reaching a step it had saved): swap, never mix files. A kill
            # between the two renames leaves the step only under .old-: _recover puts it back.
            old = self.root / f".old-step_{step:08d}-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return final

    @staticmethod
    def _write(tmp: Path, step: int, state: dict[str, Any]) -> None:
        """state.pt and meta.json (its size and sha256) into `tmp`, every file and `tmp` itself fsynced."""
        state_path = tmp / "state.pt"
        with open(state_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        meta = {"step": step, "files": {"state.pt": {"size": state_path.stat().st_size, "sha256": _sha256(state_path)}}}
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)

    def _prune(self) -> None:
        complete = self.list_complete()
        for info in complete[: -self.keep]:
            shutil.rmtree(info.path, ignore_errors=True)
        # Leftovers of a process killed mid-save: never complete, safe to delete (ours have a pid suffix,
        # and a live writer of the same run cannot exist: one trainer per run directory).
        for p in self.root.iterdir():
            if p.name.startswith((".tmp-step_", ".old-step_")) and not p.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(p, ignore_errors=True)

    def _recover(self) -> None:
        """Put back a checkpoint that a process killed in the middle of a same-step swap left under
        `.old-step_N-<pid>` with no `step_N` beside it (it was complete under its final name)."""
        if not self.root.exists():
            return
        for p in sorted(self.root.iterdir()):
            m = re.match(r"^\.old-(step_\d{8})-\d+$", p.name)
            if m and p.is_dir() and not (self.root / m.group(1)).exists():
                try:
                    os.rename(p, self.root / m.group(1))
                except OSError:  # another rank of the same run, resuming at the same moment, put it back
                    continue
                _warn(f"recovered {self.root / m.group(1)} from {p.name} (a re-save of that step was interrupted)")
                _fsync_dir(self.root)

    # -- reading -----------------------------------------------------------------------------------
    def _verify(self, path: Path) -> str | None:
        """Why a checkpoint directory is not usable, or None if it is complete and intact."""
        meta_path = path / "meta.json"
        if not meta_path.exists():
            return "no meta.json (incomplete write)"
        try:
            meta = json.loads(meta_path.read_text())
            files = meta["files"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            return f"meta.json unreadable ({exc})"
        for name, info in files.items():
            f = path / name
            if not f.exists():
                return f"{name} missing"
            if f.stat().st_size != info.get("size"):
                return f"{name} has {f.stat().st_size} bytes, meta.json says {info.get('size')} (truncated?)"
            if _sha256(f) != info.get("sha256"):
                return f"{name} does not match its sha256 (corrupt)"
        return None

    def list_complete(self) -> list[CheckpointInfo]:
        """Checkpoints whose directory name is final and whose meta.json exists, oldest first.

        (Cheap: does not hash; `latest` verifies fully.)
        """
        out = []
        if not self.root.exists():
            return out
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and (p / "meta.json").exists():
                out.append(CheckpointInfo(int(m.group(1)), p))
        return sorted(out, key=lambda c: c.step)

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[int, dict[str, Any]] | None:
        """Load the newest checkpoint that is complete and intact.

        Partial or corrupt checkpoints are skipped with a warning on stderr (and left on disk for a
        human to look at).

        Returns:
            (step, state) or None when there is no usable checkpoint.
        """
        self._recover()
        candidates = []
        for p in self.root.iterdir() if self.root.exists() else []:
            m = _NAME.match(p.name)
            if m and p.is_dir():
                candidates.append((int(m.group(1)), p))
        for step, path in sorted(candidates, reverse=True):
            why = self._verify(path)
            if why is None:
                try:
                    state = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
                except Exception as exc:  # noqa: BLE001 - any unpickling failure means "unusable"
                    why = f"state.pt does not load ({type(exc).__name__}: {exc})"
                else:
                    return step, state
            _warn(f"skipping {path}: {why}")
        return None


# -- RNG state --------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), Python and numpy RNG states, in a form `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    # torch.load gives lists back where tuples went in; random.setstate wants the exact tuple shape.
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- the run's policy: when to save, how many to keep, what to resume from ---------------------------------
CHECKPOINT_FORMAT = 2
"""Version of the checkpoint contents a run writes (others are refused with a reason)."""


class Trainable(Protocol):
    """What a checkpoint holds of the drafter being trained (trainer.loop.Drafter)."""

    module: torch.nn.Module
    opt: torch.optim.Optimizer
    precision: Precision


class RunCheckpoints:
    """A run's checkpoints: `<output_dir>/checkpoints`, saved every `save_every` steps, the newest
    `keep_checkpoints` kept, resumed only under the same batches per step.

    Args:
        cfg: the run's config (output_dir, save_every, keep_checkpoints).
        per_step: G, the global batches per optimizer step of this run.
    """

    def __init__(self, cfg: TrainConfig, per_step: int):
        self.root = Path(cfg.output_dir) / "checkpoints"
        self.save_every = cfg.save_every
        self.per_step = per_step
        self.manager = CheckpointManager(self.root, keep=cfg.keep_checkpoints)

    def due(self, step: int, total_steps: int) -> bool:
        """Whether the loop saves after `step` steps: every `save_every`, never at the last step (the run's end
        saves that one, beside the export)."""
        return step % self.save_every == 0 and step < total_steps

    def save(self, drafter: Trainable, step: int, log: Callable[[str], None]) -> Path:
        """Save the drafter's training state after `step` steps; older checkpoints beyond keep are pruned."""
        state = {
            "format": CHECKPOINT_FORMAT,
            "model": drafter.module.state_dict(),
            "optimizer": drafter.opt.state_dict(),
            "rng": capture_rng_state(),
            "data": {"batches_per_step": self.per_step},
            "step": step,
            "precision": drafter.precision.name,  # the weights above are its master weights, in its dtype
        }
        path = self.manager.save(step, state)
        log(f"[ckpt] step {step} -> {path}")
        return path

    def resume(self, drafter: Trainable, agree_step: Callable[[int], int], log: Callable[[str], None]) -> int:
        """Load the newest complete checkpoint (if any) into the drafter and restore the RNG states.

        Args:
            agree_step: every rank's call returns the main drafter rank's step (trainer.distributed.World).

        Returns:
            The step to continue from (0: nothing to resume).

        Raises:
            TrainError: the ranks see different checkpoints, or one of another format or batches per step.
        """
        resumed = self.manager.load_latest(map_location="cpu")
        step = agree_step(resumed[0] if resumed else 0)
        if not step:
            return 0
        out = self.root.parent
        if resumed is None or resumed[0] != step:
            raise TrainError(f"ranks disagree on the checkpoint to resume from (main: step {step}); is {out} shared?")
        state = resumed[1]
        where = f"checkpoint step {step} in {self.root}"
        if state.get("format") != CHECKPOINT_FORMAT:
            raise TrainError(f"{where} was written by an older trainer (format {state.get('format', 1)}, this one "
                             f"reads {CHECKPOINT_FORMAT}); start a fresh run")
        got = state["data"]["batches_per_step"]
        if got != self.per_step:
            raise TrainError(f"{where} was trained with {got} batch(es) per step, this config has {self.per_step}: "
                             f"the global batches would not line up; set data.batches_per_step: {got}")
        load_weights(drafter, state, where, log)
        restore_rng_state(state["rng"])
        log(f"resumed from step {step}")
        return step


def load_weights(drafter: Trainable, state: dict, where: str, log: Callable[[str], None]) -> None:
    """The checkpoint's weights and AdamW state into the drafter, cast to its master dtype: a checkpoint of
    any precision resumes under any other (bf16 -> float32 is exact; float32 -> bf16 rounds, as bf16-true
    training itself does)."""
    saved = state.get("precision")
    drafter.module.load_state_dict(state["model"])  # copies into the existing parameters: their dtype stays
    drafter.opt.load_state_dict(state["optimizer"])  # torch casts floating state to each parameter's dtype
    now = drafter.precision
    if saved != now.name:
        log(f"[precision] {where} was trained in {saved or 'a precision it does not record'}; continuing in "
            f"{now.name}: master weights and AdamW state now {str(now.master_dtype).removeprefix('torch.')}")
