"""`launch --resume RUN`: find the run to continue and seed a new run directory from it. Standard library only.

A resumed run is a NEW run (its own id, run.json, train.log, exit.json) that starts where the old one's last
complete checkpoint left off. Its directory is seeded from the old one so the trainer (`python -m
trainer.launch --resume <new run dir>`) finds everything in place and the old run stays as it was:

    checkpoints/step_*/   every complete checkpoint, hard-linked (checkpoints are written to a temporary
                          name and renamed, never modified in place, so a link is as good as a copy and
                          costs nothing for a multi-GB state.pt); copied across filesystems
    data/                 the prepared samples (a resumed run must see the very same samples), linked
    metrics.jsonl         COPIED, never linked: the trainer rewinds and appends to it
    eval_before.json      copied (τ of the untrained drafter, measured once)

A checkpoint is complete when its meta.json exists: trainer/checkpoint.py writes meta.json last, inside a
temporary directory that is renamed into place. The trainer verifies sizes and hashes again on load.

A dflash run that ended in its data stage (regeneration, before any training step: no checkpoint, no step
record in metrics.jsonl) is resumable too: the new run runs the data stage again, which keeps every shard the
old one finished (they are in the datasets root, keyed by content, not in the run directory), and training
starts at step 0 (`ResumeSource.data_stage`: the trainer gets no --resume).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.agent import atomic, liveness, rundirs
from orchestrator.agent.protocol import AgentFailure

_CHECKPOINT = re.compile(r"^step_(\d{8})$")
_LINKED_DIRS = ("data",)
_COPIED_FILES = ("metrics.jsonl", "eval_before.json")
RESUME_ENV = "DFLASHCTL_RESUME_DIR"
"""kind command: the old run's directory, for a bring-your-own trainer to resume from."""


@dataclass
class ResumeSource:
    """The run being continued."""

    run_id: str
    run_dir: Path
    kind: str
    config: dict | None = None
    """kind dflash: the old run's config.json."""
    checkpoints: list[tuple[int, Path]] = field(default_factory=list)
    """kind dflash: complete checkpoints, oldest first."""
    data_stage: bool = False
    """kind dflash: the run ended in its data stage, before training (no checkpoint): the new run does the
    data stage again and trains from step 0."""

    @property
    def step(self) -> int | None:
        """The step the trainer resumes from (the newest complete checkpoint)."""
        return self.checkpoints[-1][0] if self.checkpoints else None


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint of a run whose meta.json exists, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _CHECKPOINT.match(p.name)
        if m and (p / "meta.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def find_source(workdir: str | Path, run_id: str, experiment: str, kind: str,
                need_checkpoint: bool = True) -> ResumeSource:
    """The run `run_id` of `experiment`, checked resumable.

    Raises:
        AgentFailure: BadRunId; ResumeNotFound (no such run directory); ResumeMismatch (another experiment
            or kind); RunProcessesAlive (a process of the run still lives, named); NothingToResume (kind dflash without config.json or without a complete checkpoint).
    """
    rundirs.check_run_id(run_id)
    run_dir = rundirs.runs_root(workdir) / run_id
    if not run_dir.is_dir():
        raise AgentFailure("ResumeNotFound", f"no run {run_id} in {rundirs.runs_root(workdir)}",
                           fix="`dflashctl status` lists the runs of this target", data={"run_id": run_id})
    info = rundirs.read_json(run_dir / "run.json") or {}
    other = info.get("experiment")
    if other != experiment:
        raise AgentFailure(
            "ResumeMismatch",
            f"run {run_id} belongs to experiment {other!r}, not {experiment!r}",
            fix=f"dflashctl launch {other} --resume {run_id}" if other else "resume a run of this experiment",
            data={"run_id": run_id, "experiment": other},
        )
    if info.get("kind") not in (None, kind):
        raise AgentFailure("ResumeMismatch", f"run {run_id} is a kind {info.get('kind')} run; {experiment} is now kind {kind}",
                           fix="launch without --resume", data={"run_id": run_id})
    # Two trainers must never write one run's checkpoints: a rank of the old run that outlived its launcher
    # (or a run still going) would keep saving into what is seeded here.
    liveness.check_no_processes(rundirs.load_ref(run_dir), f"cannot resume run {run_id}",
                                fix=f"dflashctl stop {run_id}   (then resume it again)")
    src = ResumeSource(run_id, run_dir, kind)
    if kind != "dflash":
        return src
    src.config = rundirs.read_json(run_dir / "config.json")
    if src.config is None:
        raise AgentFailure("NothingToResume", f"run {run_id} has no readable config.json in {run_dir}",
                           fix="launch without --resume to start fresh", data={"run_id": run_id})
    src.checkpoints = complete_checkpoints(run_dir)
    if not src.checkpoints and need_checkpoint and ended_in_data_stage(run_dir, src.config):
        src.data_stage = True
    elif not src.checkpoints and need_checkpoint:  # a node without drafters keeps none: it resumes from nothing
        raise AgentFailure(
            "NothingToResume",
            f"run {run_id} has no complete checkpoint under {run_dir / 'checkpoints'} (it ended before its first "
            f"save; save_every is {src.config.get('save_every', '?')} steps)",
            fix="launch without --resume to start fresh",
            data={"run_id": run_id},
        )
    return src


def ended_in_data_stage(run_dir: Path, config: dict) -> bool:
    """Whether a dflash run ended before training started, in its data stage: its config regenerates its data
    (runcommand.needs_data_stage's rule: data.regenerate, default true, and data.train_files) and its
    metrics.jsonl has no training step record (the stage's own records, `"kind": "regen"`, carry no step)."""
    data = config.get("data") or {}
    if not (data.get("regenerate", True) and data.get("train_files")):
        return False
    try:
        text = (run_dir / "metrics.jsonl").read_text(errors="replace")
    except FileNotFoundError:
        return True
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if isinstance(rec, dict) and "step" in rec:
            return False
    return True


def layout_gpus(config: dict) -> list[int]:
    """Every GPU of a TrainConfig dict's layout, target first."""
    lay = config.get("layout") or {}
    return [int(g) for g in [*(lay.get("target_gpus") or []), *(lay.get("drafter_gpus") or [])]]


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copy2(src, dst)


def seed(src: ResumeSource, new_dir: Path) -> list[str]:
    """Fill `new_dir` (a fresh run directory) from the old run, as the module docstring says.

    Each checkpoint is assembled under a temporary name and renamed, so an interrupted seed never leaves a
    checkpoint that looks complete. Returns the names seeded.
    """
    seeded = []
    ckroot = new_dir / "checkpoints"
    ckroot.mkdir(exist_ok=True)
    for _step, path in src.checkpoints:
        tmp = ckroot / f".seed-{path.name}"
        shutil.copytree(path, tmp, copy_function=_link_or_copy)
        os.replace(tmp, ckroot / path.name)
        seeded.append(f"checkpoints/{path.name}")
    for name in _LINKED_DIRS:
        if (src.run_dir / name).is_dir():
            shutil.copytree(src.run_dir / name, new_dir / name, copy_function=_link_or_copy)
            seeded.append(name)
    for name in _COPIED_FILES:
        if (src.run_dir / name).is_file():
            atomic.write_bytes(new_dir / name, (src.run_dir / name).read_bytes())
            seeded.append(name)
    return seeded


def resumed_config(src: ResumeSource, new_dir: Path) -> dict:
    """The old run's config, writing into the new run directory."""
    return {**(src.config or {}), "output_dir": str(new_dir)}
