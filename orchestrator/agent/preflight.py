"""The launch's preflight: every decision a launch makes, made read-only, as a LaunchPlan, and the checks of
the machine it runs on.

`plan` decides what the launch stops, writes and starts (the session it finds: refused when live unless
--replace; the resume source; the GPUs; the run id and directory; the config, the command and its
environment; the warm-up targets; the tmux command line). `checks` then checks the machine in the launch's
order: the NVIDIA driver, the GPUs (claimed and idle: the launch waits for another launch's claim, a dry run
does not), the venv against the lock. `launch --dry-run` returns the plan after its checks; the launch verb
executes the very same plan under the experiment's lock (orchestrator.agent.verbs.launch), so a dry run shows
exactly what the launch would do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# driver and venvfingerprint too, though only a run on GPUs and a venv check use them: the agent imports its verb
# before it reads the request, so their import is not on a launch's path once the request is there.
from orchestrator.agent import claims, driver, gpu, liveness, resume, rundirs, runprocs, tmuxctl, venvfingerprint
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import LaunchAnswer, LaunchRequest
from orchestrator.agent.runcommand import ENV_FILE, SCRIPT_NAME, build_command, run_config
from orchestrator.quoting import render


def check_session(name: str, experiment: str, replace: bool) -> dict | None:
    """The tmux session of this experiment (tmuxctl.find_session), or None; a live one is refused unless
    --replace.

    Raises:
        AgentFailure("SessionExists"): a live session and no --replace, naming its run and the two ways out.
    """
    s = tmuxctl.find_session(name)
    if s is not None and not s["dead"] and not replace:
        rid = s.get("run_id") or "unknown"
        raise AgentFailure(
            "SessionExists",
            f"tmux session {name} is running run {rid}",
            fix=f"dflashctl launch {experiment} --replace   (or: dflashctl stop {rid})",
            data={"session": name, "run_id": rid},
        )
    return s


def check_run_processes(workdir: str, experiment: str, replacing: str | None) -> None:
    """No process of an earlier run of this experiment may live (a rank that outlived its launcher, a child
    that left its group): it would share the GPUs and the data with the new run. The run --replace stops is
    exempt (its stop ends every process of it).

    Raises:
        AgentFailure("RunProcessesAlive"): naming the run and each process (pid, command line).
    """
    marked = runprocs.marked_processes()
    for ref in rundirs.run_refs(workdir):
        if ref.experiment != experiment or ref.run_id == replacing:
            continue
        if runprocs.of_run(marked, ref.path) or (liveness.read_pid(ref.path) is not None and liveness.command_alive(ref)):
            liveness.check_no_processes(ref, f"cannot launch {experiment}",
                                        fix=f"dflashctl stop {ref.run_id}   (ends every process of it), then launch again")


LIBRARIES_BYTES = 150 << 20
"""torch's and transformers' shared libraries and modules, mapped by every trainer process but counted once by
the container's memory cgroup (file pages)."""
PROCESS_BASE_BYTES = 270 << 20
"""A rank's own memory before its model: interpreter heap, imported modules, tokenizer, data readers."""
GPU_PROCESS_EXTRA_BYTES = 1 << 30
"""What a CUDA context and its libraries add to a process's host memory (cuBLAS, cuDNN, NCCL mapped in)."""
LAUNCHER_BYTES = 90 << 20
"""The elastic agent's own memory (trainer.launch: torch imported, no model)."""


def _dims(config: dict, workdir: str) -> dict | None:
    """The target's vocab_size, hidden_size, intermediate_size, num_hidden_layers: the tiny target's from the
    config, else the target directory's config.json; None when neither can be read."""
    model = config.get("model") or {}
    if model.get("target", "tiny") == "tiny":
        dims = model.get("tiny_target") or {}
    else:
        dims = rundirs.read_json(Path(str(model.get("target"))) / "config.json") or {}
        dims = dims.get("text_config") or dims
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    if not all(isinstance(dims.get(k), int) for k in keys):
        return None
    return {k: int(dims[k]) for k in keys}


def estimate_memory_need(config: dict, dims: dict) -> dict:
    """The host memory (RAM of the container) a dflash run needs at its peak, in bytes, with its parts.

    With h = hidden_size, I = intermediate_size, L = the target's layers, V = vocab_size, n = drafter layers:
      - a decoder layer has ~4h^2 (attention) + 3hI (gated MLP) parameters; embeddings and lm_head V*h each;
        target parameters P_t = L(4h^2 + 3hI) + 2Vh; drafter parameters P_d = n(4h^2 + 3hI) + k*h*h (the
        projection of k = num_target_features target layers);
      - the libraries once (LIBRARIES_BYTES: shared file pages, one copy for all processes), every rank its
        own PROCESS_BASE_BYTES, plus GPU_PROCESS_EXTRA_BYTES on a GPU, and the launcher LAUNCHER_BYTES;
      - on the CPU (no GPUs in the layout) the model lives in host memory: each target process P_t x 4 bytes
        (fp32); each drafter process P_d x 16 bytes (fp32 weights, gradients and AdamW's two moments) plus its
        copy of the target's embeddings and lm_head 2Vh x 4 bytes; activations per process: token_budget x
        (h x (n + k) x 16 floats + V x 3 floats (logits, softmax, their gradient)) x 4 bytes;
      - on GPUs the weights, optimizer state and activations live in GPU memory; the target's weights pass
        through host memory once while they load (safetensors mapped: page cache), P_t x 2 bytes (bf16).
      - the colocated layout is one process holding both the target and the drafter.
    Checked against the tiny run (bench/memory_need.py): the 1 target + 2 drafter CPU layout of tests/trainer
    peaks at 1042 MiB in its memory cgroup (max_usage_in_bytes; the processes' peak RSS: launcher 231 MiB,
    ranks 407-434 MiB, 1486 MiB summed, the libraries counted 4 times); this estimate says 1064 MiB.

    Returns:
        {"total_bytes", "processes", "parts": {name: bytes}}.
    """
    h, inter, layers, vocab = (dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"],
                               dims["vocab_size"])
    model = config.get("model") or {}
    n, k = int(model.get("num_draft_layers") or 5), int(model.get("num_target_features") or 5)
    layer = 4 * h * h + 3 * h * inter
    p_target = layers * layer + 2 * vocab * h
    p_drafter = n * layer + k * h * h
    lay = config.get("layout") or {}
    gpus = bool(lay.get("target_gpus") or lay.get("drafter_gpus"))
    n_target = len(lay.get("target_gpus") or []) or int(lay.get("num_target_procs") or 0)
    n_drafter = len(lay.get("drafter_gpus") or []) or int(lay.get("num_drafter_procs") or 0)
    colocated = not (n_target or n_drafter)
    procs = 1 if colocated else n_target + n_drafter
    tokens = int((config.get("data") or {}).get("token_budget") or 0)
    parts = {"libraries": LIBRARIES_BYTES,
             "processes": procs * (PROCESS_BASE_BYTES + (GPU_PROCESS_EXTRA_BYTES if gpus else 0)),
             "launcher": LAUNCHER_BYTES}
    if gpus:
        parts["target weights loading"] = p_target * 2
    else:
        drafter_each = p_drafter * 16 + 2 * vocab * h * 4
        activations = tokens * (h * (n + k) * 16 + vocab * 3) * 4
        parts["target weights"] = p_target * 4 * (1 if colocated else n_target)
        parts["drafter and optimizer"] = drafter_each * (1 if colocated else n_drafter)
        parts["activations"] = activations * (1 if colocated else n_drafter)
    return {"total_bytes": sum(parts.values()), "processes": procs, "parts": parts}


def check_memory(config: dict | None, workdir: str, emit, cgroup=None) -> dict | None:
    """Warn (a progress event `memory`, the launch goes on) when the container's memory limit is below the
    run's estimated need (estimate_memory_need); the message names both and the fix. Returns the estimate,
    or None when there is nothing to compare (no limit, no readable target config, not a dflash run).

    Args:
        cgroup: a trainer.faults.MemoryCgroup (default: this process's, read now).
    """
    from trainer import faults

    if config is None:
        return None
    dims = _dims(config, workdir)
    cg = cgroup if cgroup is not None else faults.memory_cgroup()
    if dims is None or cg is None or cg.limit_bytes is None:
        return None
    need = estimate_memory_need(config, dims)
    if cg.limit_bytes < need["total_bytes"]:
        emit.progress("memory", f"warning: the container's memory limit ({cg.limit_bytes >> 20} MiB) is below "
                      f"this run's estimated need ({need['total_bytes'] >> 20} MiB for {need['processes']} trainer "
                      f"process(es)); the kernel's OOM killer may end it. Raise the limit "
                      + faults.raise_memory_fix(cg.limit_bytes, need["total_bytes"]),
                      need_bytes=need["total_bytes"], limit_bytes=cg.limit_bytes)
    return need


def check_driver(req: LaunchRequest, gpus: list[int], emit) -> None:
    """A run on GPUs: the NVIDIA driver must run the venv's torch, and its libraries must match the kernel
    module (checked before the GPU query, which a library mismatch would only report as unreadable)."""
    if not gpus:
        return
    profile = req.venv_profile or {}
    torch = driver.venv_torch(req.workdir, profile)
    info = driver.probe()
    problems = driver.check(torch.get("cuda"), info, torch.get("torch"))
    if problems:
        p = problems[0]
        fix = p.fix(lock=driver.profile_lock(profile), target=req.target)
        raise AgentFailure(p.type, p.message, fix=fix, data={**p.data, "gpus": gpus})
    emit.progress("driver", driver.describe_ok(torch.get("torch"), torch.get("cuda"), info), driver=info.driver)


def check_venv(req: LaunchRequest, emit) -> dict:
    """The venv fingerprint, refused when it differs from the experiment's lock."""
    profile = req.venv_profile or {}
    actual = venvfingerprint.current_fingerprint(req.workdir, profile)
    diff = venvfingerprint.fingerprint_diff(actual, req.lock_hash, profile)
    if diff:
        raise AgentFailure(
            "VenvMismatch",
            "the venv does not match the experiment's lock: " + "; ".join(diff[:12])
            + (f" (and {len(diff) - 12} more)" if len(diff) > 12 else ""),
            # --profile: the experiment's profile may not be its target's default, which a bare rebuild builds
            fix="dflashctl rebuild-venv" + (f" --target {req.target}" if req.target else "")
            + (f" --profile {profile['name']}" if profile.get("name") else ""),
            data={"differences": diff},
        )
    emit.progress("venv", "venv matches the lock", lock_hash=actual.get("lock_hash"))
    return actual


def resume_source(req: LaunchRequest, emit) -> resume.ResumeSource | None:
    """The run to continue (checked), or None; announces what the new run starts from."""
    if not req.resume:
        return None
    src = resume.find_source(req.workdir, req.resume, req.experiment, req.kind, need_checkpoint=holds_checkpoints(req))
    if src.step is not None:
        emit.progress("resume", f"continuing run {src.run_id} from its checkpoint at step {src.step}",
                      resumed_from=src.run_id, checkpoint_step=src.step)
    elif src.data_stage:
        emit.progress("resume", f"continuing run {src.run_id}, which ended in its data stage (no checkpoint): the "
                      "data stage runs again, keeping the shards it finished; training starts at step 0",
                      resumed_from=src.run_id, checkpoint_step=None)
    else:
        emit.progress("resume", f"continuing run {src.run_id} ({resume.RESUME_ENV}={src.run_dir})",
                      resumed_from=src.run_id)
    return src


def holds_checkpoints(req: LaunchRequest) -> bool:
    """Whether this node's run directory holds the run's checkpoints: the node of the first drafter rank (the
    one that saves), i.e. the first node with drafters; on one node, always."""
    if not req.node:
        return True
    nodes = ((req.config or {}).get("layout") or {}).get("nodes") or []
    first = next((i for i, n in enumerate(nodes) if n.get("drafter_gpus") or n.get("num_drafter_procs")), 0)
    return int(req.node.get("index", 0)) == first


def run_gpus(req: LaunchRequest, src: resume.ResumeSource | None, emit) -> list[int]:
    """The GPUs the run occupies: the experiment's, or for a resumed dflash run its old config's layout (the
    trainer refuses another number of drafters, and those are the GPUs the copied config names)."""
    gpus = list(req.gpus)
    if src is not None and src.config is not None and not req.node:  # across nodes: this node's
        old = resume.layout_gpus(src.config)
        if old != gpus:
            emit.progress("resume", f"the resumed config's layout uses GPUs {old} (the inventory now says {gpus})")
        gpus = old
    return gpus


def warmup_targets(layout: dict, config: dict) -> tuple[list[int | None], str | None]:
    """What launch warms up: each drafter GPU; a CPU split layout with compile on: the CPU once.

    Returns:
        (targets, None) or ([], the reason it is skipped). The colocated loop compiles nothing ahead.
    """
    drafters = [int(g) for g in (layout or {}).get("drafter_gpus") or []]
    if drafters:
        return drafters, None
    lay = config.get("layout") or {}
    if lay.get("num_drafter_procs") and (config.get("compile") or {}).get("enabled"):
        return [None], None
    return [], "no drafter GPUs and nothing compiled ahead on the CPU (compile.enabled is off, or colocated)"


def describe_layout(gpus: list[int], layout: dict, node: dict | None = None) -> str:
    """The `layout` progress line: which processes run where."""
    if node and layout.get("nodes"):
        n = layout["nodes"][int(node["index"])]
        return (f"node {node['index']} of {node['count']} (rendezvous {layout.get('rendezvous')}): "
                + describe_layout(gpus, {k: v for k, v in n.items() if k != "name"}))
    t, d = layout.get("target_gpus") or [], layout.get("drafter_gpus") or []
    if t or d:
        return f"{len(t)} target process(es) on GPUs {t}, {len(d)} drafter process(es) on GPUs {d}: one process per GPU"
    if layout.get("num_target_procs"):
        return (f"{layout['num_target_procs']} target + {layout.get('num_drafter_procs')} drafter process(es) "
                "on the CPU (gloo)")
    return "colocated: target and drafter in one CPU process"


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch does: the session it finds (and stops or clears), the run it makes, the files it writes,
    the warm-up and the session it starts. Made by `plan`; executed by the launch verb; shown by --dry-run."""

    run_id: str
    run_dir: Path
    session: str
    old_session: dict | None
    """The experiment's session found (tmuxctl.find_session): a finished one is cleared, a live one stopped."""
    gpus: list[int]
    argv: list[str]
    extra: dict[str, str]
    """The run's own environment, on top of the agent's (runcommand.build_command)."""
    config: dict | None
    """kind dflash: config.json as it is written."""
    resume: resume.ResumeSource | None
    bundle_hash: str | None
    gpu_idle_mib: int
    layout: dict | None
    """The layout run.json records: the config's (kind dflash), the request's (kind command)."""
    warmup: list[int | None]
    """The devices warmed up before the session starts (None: the CPU), in order."""
    warmup_skipped: str | None
    """Why nothing is warmed up (kind dflash), or None."""

    @property
    def replaces(self) -> str | None:
        """The run id of the live run this launch stops (--replace), or None."""
        old = self.old_session
        return old.get("run_id") if old is not None and not old["dead"] else None

    @property
    def would_stop(self) -> str | None:
        """The live run (or, without a run id, the session) this launch stops, or None."""
        old = self.old_session
        return None if old is None or old["dead"] else (old.get("run_id") or self.session)

    @property
    def command_line(self) -> str:
        """What the session runs: start_training.sh around the command (one rendered shell line)."""
        return render(["bash", str(self.run_dir / SCRIPT_NAME), str(self.run_dir), "--", *self.argv])

    @property
    def tmux(self) -> list[str]:
        return ["tmux", "new-session", "-d", "-s", self.session, self.command_line]

    @property
    def files(self) -> list[str]:
        names = ("run.json", "config.json", SCRIPT_NAME, ENV_FILE) if self.config is not None else (
            "run.json", SCRIPT_NAME, ENV_FILE)
        return [str(self.run_dir / n) for n in names]

    @property
    def env(self) -> dict[str, str]:
        """The run's own variables the dry run shows (CUDA_VISIBLE_DEVICES, the compile cache, the resume dir)."""
        shown = ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR", resume.RESUME_ENV)
        return {k: v for k, v in self.extra.items() if k in shown}

    def answer(self, *, dry_run: bool, fingerprint: dict, gpus_seen: list | None = None) -> LaunchAnswer:
        """The launch's result for this plan: what a dry run returns (with the plan's details), and what the
        launch returns once it has executed the plan (with the GPUs it saw); `fingerprint`: the venv's."""
        src = self.resume
        detail = None if not dry_run else {
            "would_stop": self.would_stop,
            "resume": None if src is None else {"run_id": src.run_id, "step": src.step},
            "files": self.files, "env": self.env, "env_keys": sorted(self.extra), "tmux": self.tmux,
            "gpu_idle_mib": self.gpu_idle_mib, "warmup": self.warmup,
        }
        return LaunchAnswer(
            run_id=self.run_id, run_dir=str(self.run_dir), session=self.session, command=self.argv, gpus=self.gpus,
            replaced=self.would_stop if dry_run else self.replaces, resumed_from=None if src is None else src.run_id,
            dry_run=dry_run, config=self.config, env_fingerprint=fingerprint, bundle_hash=self.bundle_hash,
            gpus_seen=gpus_seen or [], plan=detail,
        )


def plan(req: LaunchRequest, emit) -> LaunchPlan:
    """Every decision of the launch `req` asks for, read-only: nothing is written, stopped or started.

    Raises:
        AgentFailure: the refusals a launch makes before it changes anything (BadName, BadRunId,
            SessionExists, RunProcessesAlive, ResumeNotFound, ResumeMismatch, NothingToResume, BadRequest, ...).
    """
    session = tmuxctl.session_name(rundirs.check_name("experiment", req.experiment))
    old = check_session(session, req.experiment, req.replace)
    src = resume_source(req, emit)  # first: a resume of a run with a live process is refused as a resume
    check_run_processes(req.workdir, req.experiment, old.get("run_id") if old is not None and req.replace else None)
    gpus = run_gpus(req, src, emit)
    run_id = rundirs.free_run_id(req.workdir, rundirs.check_run_id(req.run_id))
    run_dir = rundirs.runs_root(req.workdir) / run_id
    dflash = req.kind == "dflash"
    config = run_config(req, run_dir, src) if dflash else None
    # A run that ended in its data stage has nothing for the trainer to resume: it trains from step 0.
    resume_dir = None if src is None or src.data_stage else (run_dir if dflash else src.run_dir)
    argv, extra = build_command(req, gpus, run_dir, config, resume_dir)
    # Across nodes the request's layout is this node's GPUs; on one node, the config's.
    warm_layout = (req.layout if req.node else (config or {}).get("layout")) or {}
    warmup, skipped = warmup_targets(warm_layout, config) if dflash else ([], None)
    return LaunchPlan(
        run_id=run_id, run_dir=run_dir, session=session, old_session=old, gpus=gpus, argv=argv, extra=extra,
        config=config, resume=src, bundle_hash=req.bundle_hash,
        gpu_idle_mib=req.gpu_idle_mib, layout=(config or {}).get("layout") if dflash else req.layout,
        warmup=warmup, warmup_skipped=skipped,
    )


def checks(p: LaunchPlan, req: LaunchRequest, emit, gpus_free) -> tuple[dict, list[dict]]:
    """The machine's checks, in the launch's order: the NVIDIA driver, the GPUs (`gpus_free(query)`: the
    launch's idle check after its claim, or a dry run's `check_free`), the venv against the lock. A run on
    GPUs asks nvidia-smi for their memory while the driver is probed (two nvidia-smi calls, each a good part
    of a second on a GPU host); the verdicts still come in this order.

    Returns:
        (the venv's fingerprint, the GPUs as seen by the GPU check).
    Raises:
        AgentFailure: DriverTooOld, DriverLibraryMismatch, GpuClaimed, GpuBusy, VenvMismatch.
    """
    query = gpu.start_query() if p.gpus else gpu.query_gpus
    check_driver(req, p.gpus, emit)
    check_memory(p.config, req.workdir, emit)
    seen = gpus_free(query)
    return check_venv(req, emit), seen


def check_free(p: LaunchPlan, workdir: str, emit, query=gpu.query_gpus) -> list[dict]:
    """--dry-run: what the launch would wait for, checked now without waiting (GpuClaimed, GpuBusy): the
    GPUs' claims and use, unless a live run is stopped first (it holds them until then)."""
    if p.old_session is not None and p.old_session["dead"]:
        emit.progress("session", f"would clear the finished session {p.session}")
    if p.would_stop is not None:
        return []
    taken = claims.held(workdir, p.gpus)
    if taken:
        raise claims.refusal(taken)  # as the real launch would after its wait, without waiting
    return gpu.preflight_gpus(p.gpus, p.gpu_idle_mib, query)
