"""The launch's preflight: each check a launch makes before it changes anything, and the plan of a launch.

`plan` is what `launch --dry-run` returns: every check, read-only (a live session refused unless --replace,
the resume source, the driver, GPU claims and use, the venv against the lock), and what would be stopped,
written and started (LaunchPlan). The launch verb runs the same checks in its own order, under the
experiment's lock, around the steps that change things (stop the replaced run, claim GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# driver and venvinfo too, though only a run on GPUs and a venv check use them: the agent imports its verb
# before it reads the request, so their import is not on a launch's path once the request is there.
from orchestrator.agent import claims, driver, gpu, resume, runs, tmuxctl, venvinfo
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.runcommand import ENV_FILE, SCRIPT_NAME, build_command, run_config
from orchestrator.quoting import render


def check_session(name: str, experiment: str, replace: bool) -> dict | None:
    """Refuse (or mark for replacement) a live session of this experiment; clear a dead one.

    Returns the live session to replace, or None.
    """
    s = tmuxctl.find_session(name)
    if s is None:
        return None
    if s["dead"]:
        return {**s, "dead_only": True}
    if not replace:
        rid = s.get("run_id") or "unknown"
        raise AgentFailure(
            "SessionExists",
            f"tmux session {name} is running run {rid}",
            fix=f"dflashctl launch {experiment} --replace   (or: dflashctl stop {rid})",
            data={"session": name, "run_id": rid},
        )
    return s


def check_driver(workdir: str, request: dict, gpus: list[int], emit) -> None:
    """A run on GPUs: the NVIDIA driver must run the venv's torch, and its libraries must match the kernel
    module (checked before the GPU query, which a library mismatch would only report as unreadable)."""
    if not gpus:
        return
    profile = request.get("venv_profile") or {}
    torch = driver.venv_torch(workdir, profile)
    info = driver.probe()
    problems = driver.check(torch.get("cuda"), info, torch.get("torch"))
    if problems:
        p = problems[0]
        fix = p.fix(lock=driver.profile_lock(profile), target=request.get("target"))
        raise AgentFailure(p.type, p.message, fix=fix, data={**p.data, "gpus": gpus})
    emit.progress("driver", driver.describe_ok(torch.get("torch"), torch.get("cuda"), info), driver=info.driver)


def check_venv(workdir: str, request: dict, emit) -> dict:
    """The venv fingerprint, refused when it differs from the experiment's lock."""
    profile = request.get("venv_profile") or {}
    actual = venvinfo.current_fingerprint(workdir, profile)
    diff = venvinfo.fingerprint_diff(actual, request.get("lock_hash"), profile)
    if diff:
        raise AgentFailure(
            "VenvMismatch",
            "the venv does not match the experiment's lock: " + "; ".join(diff[:12])
            + (f" (and {len(diff) - 12} more)" if len(diff) > 12 else ""),
            # --profile: the experiment's profile may not be its target's default, which a bare rebuild builds
            fix="dflashctl rebuild-venv" + (f" --target {request['target']}" if request.get("target") else "")
            + (f" --profile {profile['name']}" if profile.get("name") else ""),
            data={"differences": diff},
        )
    emit.progress("venv", "venv matches the lock", lock_hash=actual.get("lock_hash"))
    return actual


def resume_source(workdir: str, request: dict, emit) -> resume.ResumeSource | None:
    """The run to continue (checked), or None; announces what the new run starts from."""
    rid = request.get("resume")
    if not rid:
        return None
    src = resume.find_source(workdir, str(rid), request["experiment"], str(request.get("kind")),
                             need_checkpoint=holds_checkpoints(request))
    if src.step is not None:
        emit.progress("resume", f"continuing run {src.run_id} from its checkpoint at step {src.step}",
                      resumed_from=src.run_id, checkpoint_step=src.step)
    else:
        emit.progress("resume", f"continuing run {src.run_id} ({resume.RESUME_ENV}={src.run_dir})",
                      resumed_from=src.run_id)
    return src


def holds_checkpoints(request: dict) -> bool:
    """Whether this node's run directory holds the run's checkpoints: the node of the first drafter rank (the
    one that saves), i.e. the first node with drafters; on one node, always."""
    node = request.get("node")
    if not node:
        return True
    nodes = ((request.get("config") or {}).get("layout") or {}).get("nodes") or []
    first = next((i for i, n in enumerate(nodes) if n.get("drafter_gpus") or n.get("num_drafter_procs")), 0)
    return int(node.get("index", 0)) == first


def run_gpus(request: dict, src: resume.ResumeSource | None, emit) -> list[int]:
    """The GPUs the run occupies: the experiment's, or for a resumed dflash run its old config's layout (the
    trainer refuses another number of drafters, and those are the GPUs the copied config names)."""
    gpus = [int(g) for g in request.get("gpus") or []]
    if src is not None and src.config is not None and not request.get("node"):  # across nodes: this node's
        old = resume.layout_gpus(src.config)
        if old != gpus:
            emit.progress("resume", f"the resumed config's layout uses GPUs {old} (the inventory now says {gpus})")
        gpus = old
    return gpus


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch would do: the run, what it stops, the files it writes and the session it starts."""

    run_id: str
    run_dir: Path
    session: str
    argv: list[str]
    gpus: list[int]
    would_stop: str | None
    resume: resume.ResumeSource | None
    fingerprint: dict
    bundle_hash: str | None
    files: list[str]
    env: dict[str, str]
    """The run's own variables the plan shows (CUDA_VISIBLE_DEVICES, the compile cache, the resume dir)."""
    env_keys: list[str]
    gpu_idle_mib: int
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def tmux(self) -> list[str]:
        script = self.run_dir / SCRIPT_NAME
        return ["tmux", "new-session", "-d", "-s", self.session,
                render(["bash", str(script), str(self.run_dir), "--", *self.argv])]

    def to_json(self) -> dict:
        """The dry run's result (what `dflashctl launch --dry-run` prints)."""
        src = self.resume
        return {
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "session": self.session,
            "command": self.argv,
            "gpus": self.gpus,
            "replaced": self.would_stop,
            "resumed_from": None if src is None else src.run_id,
            "dry_run": True,
            "env_fingerprint": self.fingerprint,
            "bundle_hash": self.bundle_hash,
            "plan": {
                "would_stop": self.would_stop,
                "resume": None if src is None else {"run_id": src.run_id, "step": src.step},
                "files": self.files,
                "env": self.env,
                "env_keys": self.env_keys,
                "tmux": self.tmux,
                "gpu_idle_mib": self.gpu_idle_mib,
            },
        }


def plan(request: dict, workdir: str, run_id: str, session: str, threshold: int, replace: bool, emit) -> LaunchPlan:
    """--dry-run: every check of a launch, read-only, and what it would stop, write and start.

    Raises:
        AgentFailure: each refusal the launch itself would make (SessionExists, GpuClaimed without waiting,
            GpuBusy, DriverTooOld, VenvMismatch, ResumeNotFound, ...).
    """
    would_stop = _would_stop(session, request["experiment"], replace, emit)
    src = resume_source(workdir, request, emit)
    gpus = run_gpus(request, src, emit)
    check_driver(workdir, request, gpus, emit)
    if would_stop is None:
        taken = claims.held(workdir, gpus)
        if taken:
            raise claims.refusal(taken)  # as the real launch would after its wait, without waiting
        gpu.preflight_gpus(gpus, threshold)
    fingerprint = check_venv(workdir, request, emit)
    run_dir = runs.runs_root(workdir) / run_id
    request = {**request, "gpus": gpus}
    dflash = request.get("kind") == "dflash"
    config = run_config(request, workdir, run_dir, src, create=False) if dflash else None
    resume_dir = None if src is None else (run_dir if dflash else src.run_dir)
    argv, extra = build_command(request, run_dir, config, resume_dir)
    return LaunchPlan(
        run_id=run_id, run_dir=run_dir, session=session, argv=argv, gpus=gpus, would_stop=would_stop,
        resume=src, fingerprint=fingerprint, bundle_hash=request.get("bundle_hash"),
        files=[str(run_dir / n) for n in ("run.json", "config.json", SCRIPT_NAME, ENV_FILE)
               if n != "config.json" or dflash],
        env={k: v for k, v in extra.items()
             if k in ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR", resume.RESUME_ENV)},
        env_keys=sorted({*extra, *(request.get("env") or {})}),
        gpu_idle_mib=threshold, extra=extra,
    )


def _would_stop(session: str, experiment: str, replace: bool, emit) -> str | None:
    """The run (or session) a launch would stop: a live session of the experiment with --replace; without
    it, SessionExists as the real launch raises. A finished session would just be cleared."""
    old = tmuxctl.find_session(session)
    if old is not None and not old["dead"]:
        if not replace:
            check_session(session, experiment, False)  # raises SessionExists like the real launch
        return old.get("run_id") or session
    if old is not None:
        emit.progress("session", f"would clear the finished session {session}")
    return None
