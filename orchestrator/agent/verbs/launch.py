"""`launch`: preflight, run directory, warm-up, tmux session, all in ONE agent call inside the target.

Request (built by orchestrator/ops/launch.py; names were checked on the workstation and are checked again):
  {workdir, experiment, run_id, tag, target, kind: "dflash"|"command",
   command: [argv] (kind command), env: {K: V}, gpus: [int], gpu_idle_mib: int,
   config: {...} (kind dflash: the resolved TrainConfig, layout section included), layout: {...},
   resume: run id | null (continue that run of this experiment in a new run),
   venv_profile: {...}, lock_hash: str|null, bundle_hash: str|null, cli: str, created: iso,
   replace: bool, grace_s: float, release_timeout_s: float, dry_run: bool, warmup_device: "cuda"|"cpu",
   claim_wait_s: float (how long to wait for another launch's preflight holding a GPU; default 5),
   requested_by: {by: "user@workstation"} (recorded in the stop.json of a run --replace stops)}
Events: progress steps lock, session, stop, resume, claim, gpus, venv, rundir, layout, warmup, tmux (each with
a message).
Result: {run_id, run_dir, session, command, gpus, gpus_seen, replaced: run id | null, replaced_stopped: its
         exit.json "stopped" | null, resumed_from, dry_run,
         config (kind dflash: as written to config.json), env_fingerprint, bundle_hash, plan: {...} (dry run)}
Refusals (AgentFailure types): LockHeld (a launch of this experiment is in its preflight), SessionExists,
GpuClaimed (a launch in its preflight or a running run holds one of the GPUs: waited for up to claim_wait_s
while it is a launch), DriverTooOld and DriverLibraryMismatch (a run on GPUs whose NVIDIA driver cannot run
the venv's torch: orchestrator.agent.driver), GpuBusy, VenvMismatch, ResumeNotFound, ResumeMismatch,
NothingToResume, BadRequest, BadName, BadRunId. A failed warm-up is WarmupFailed and a failed seeding of a
resumed run ResumeFailed: either way the run's exit.json is written and no session is started.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from orchestrator import assets, ownlines
from orchestrator.agent import claims, gpu, preflight, resume, runs, stopping, tmuxctl
from orchestrator.agent import warmup as warmups
from orchestrator.agent.protocol import AgentFailure, need
from orchestrator.agent.runcommand import (  # noqa: F401 - build_command and run_environment: tests use them here
    ENV_FILE,
    SCRIPT_NAME,
    build_command,
    run_config,
    run_environment,
)
from orchestrator.quoting import render, render_line


def _need(request: dict, key: str, kind: type):
    return need(request, key, kind, "launch")


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


def warm_up(request: dict, run_dir: Path, env: dict[str, str], emit, device: str = "cuda") -> list[dict]:
    """Compile the training shapes on each drafter GPU, one process per GPU, one GPU after the other (never
    two compiles racing in one interpreter), so training starts from a warm cache. Streams one progress event
    per shape and per GPU (orchestrator.agent.warmup, shared with the `warmup` verb); the warm-ups' stderr
    goes to runs/<id>/warmup.log, the summaries to runs/<id>/warmup.json.

    Returns:
        The `warmup_done` summaries, one per GPU.
    Raises:
        AgentFailure("WarmupFailed"): a warm-up exited non-zero; exit.json records it (phase "warmup").
    """
    if not warmups.available():
        emit.progress("warmup", "warm-up skipped: this bundle's trainer has no warm-up module", skipped=True)
        return []
    config = runs.read_json(run_dir / "config.json") or {}
    targets, why = warmup_targets(request.get("layout") or {}, config)
    if not targets:
        emit.progress("warmup", f"warm-up skipped: {why}", skipped=True)
        return []
    import json

    cache = (config.get("compile") or {}).get("cache_dir")
    try:
        done = warmups.run_warmups(run_dir / "config.json", targets, env, emit, run_dir / "warmup.log",
                                   device=device, cwd=run_dir, cache_dir=cache)
    except AgentFailure as exc:
        if exc.type == "WarmupFailed":
            rc, sig = int(exc.data.get("exit_code", 1)), None
            if rc < 0:  # killed by a signal: record it the way start_training.sh does (128 + N, SIGNAME)
                import signal as _signal

                try:
                    sig = _signal.Signals(-rc).name
                except ValueError:
                    sig = None
                rc = 128 - rc
            runs.write_json(run_dir / "exit.json", {"exit_code": rc, "signal": sig, "started": exc.data.get("started"),
                                                    "ended": runs.utc_now(), "phase": "warmup"})
        raise
    runs.write_bytes(run_dir / "warmup.json", (json.dumps(done, indent=2) + "\n").encode())
    return done


def _script_bytes() -> bytes:
    try:
        return assets.read_bytes(SCRIPT_NAME)
    except FileNotFoundError:  # pragma: no cover - a broken bundle
        raise AgentFailure("BundleBroken", f"templates/{SCRIPT_NAME} is missing from the bundle") from None


def _env_blob(env: dict[str, str]) -> bytes:
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())


def run(request: dict, emit) -> dict:
    workdir = _need(request, "workdir", str)
    experiment = _need(request, "experiment", str)
    run_id = runs.check_run_id(_need(request, "run_id", str))
    session = tmuxctl.session_name(runs.check_name("experiment", experiment))
    threshold = int(request.get("gpu_idle_mib", 1024))
    replace = bool(request.get("replace"))

    if request.get("dry_run"):
        return preflight.plan(request, workdir, run_id, session, threshold, replace, emit).to_json()

    # Held across the whole preflight, until the session runs: one launch of this experiment at a time.
    lock = runs.LaunchLock(workdir, experiment)
    lock.acquire({"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id, "experiment": experiment,
                  "since": runs.utc_now()})
    emit.progress("lock", f"holding {lock.path}")
    token = None
    try:
        replaced, replaced_stop = _clear_session(request, workdir, session, experiment, replace, threshold, emit)
        # After a --replace stop, so `--replace --resume <the live run>` continues from its final checkpoint.
        src = preflight.resume_source(workdir, request, emit)
        gpus = preflight.run_gpus(request, src, emit)
        if gpus:
            token = claims.claim(workdir, gpus, {"run_id": run_id, "experiment": experiment}, emit,
                                 float(request.get("claim_wait_s", claims.DEFAULT_WAIT_S)))
            emit.progress("claim", f"claimed GPUs {gpus} for run {run_id}")
        preflight.check_driver(workdir, request, gpus, emit)
        seen = gpu.preflight_gpus(gpus, threshold)
        if gpus:
            emit.progress("gpus", f"GPUs {gpus} idle (under {threshold} MiB)")
        fingerprint = preflight.check_venv(workdir, request, emit)
        result = _start_run({**request, "gpus": gpus}, workdir, run_id, session, src, replaced, fingerprint, seen,
                            emit)
        if token is not None:
            claims.promote(workdir, token, result["run_id"])  # the run holds its GPUs now, until it ends
            token = None
        return {**result, "replaced_stopped": replaced_stop}
    finally:
        if token is not None:
            claims.release(workdir, token)  # the launch failed: its GPUs are free again
        lock.release()


def _clear_session(request: dict, workdir: str, session: str, experiment: str, replace: bool, threshold: int,
                   emit) -> tuple[str | None, dict | None]:
    """Clear a finished session of this experiment, or with --replace stop its live run and wait for that
    run's GPUs (refused with SessionExists otherwise).

    Returns:
        (the replaced run id, its exit.json "stopped" record: who stopped it and when), or (None, None).
    """
    old = preflight.check_session(session, experiment, replace)
    if old is None:
        emit.progress("session", f"no live session {session}")
        return None, None
    if old.get("dead_only"):
        tmuxctl.kill_session(session)
        emit.progress("session", f"cleared the finished session {session} (run {old.get('run_id')})")
        return None, None
    replaced, stopped = old.get("run_id"), None
    emit.progress("stop", f"replacing run {replaced} in session {session}")
    if replaced:
        by = {"via": f"dflashctl launch {experiment} --replace", **(request.get("requested_by") or {})}
        res = stopping.stop_run(workdir, replaced, float(request.get("grace_s", stopping.DEFAULT_GRACE_S)), emit, by)
        stopped = (res.get("exit") or {}).get("stopped") if res.get("state") == "stopped" else None
    else:  # a session we did not start (no run id): end it the blunt way
        tmuxctl.kill_session(session)
    if request.get("gpus"):
        gpu.wait_gpus_idle([int(g) for g in request["gpus"]], threshold,
                                float(request.get("release_timeout_s", 120)), emit)
    return replaced, stopped


def _seed_resumed(src: resume.ResumeSource, run_id: str, run_dir: Path, emit) -> None:
    """Fill a resumed dflash run's directory from the old run; a failure ends the new run (exit.json)."""
    started = runs.utc_now()
    try:
        seeded = resume.seed(src, run_dir)
    except OSError as exc:  # disk full, permissions: the new run ends here, and says so
        runs.write_json(run_dir / "exit.json", {"exit_code": 1, "signal": None, "started": started,
                                                "ended": runs.utc_now(), "phase": "resume"})
        raise AgentFailure("ResumeFailed", f"could not seed {run_dir} from run {src.run_id}: {exc}",
                           fix=f"free space or fix permissions under {run_dir.parent}, then launch again",
                           data={"run_id": run_id, "resumed_from": src.run_id}) from None
    emit.progress("resume", f"seeded {run_dir.name} from {src.run_id}: {', '.join(seeded)}")


def _start_run(request: dict, workdir: str, run_id: str, session: str, src: resume.ResumeSource | None,
               replaced: str | None, fingerprint: dict, seen: list[dict], emit) -> dict:
    """After the preflight: the run directory, its files, the warm-up, then the tmux session."""
    dflash = request.get("kind") == "dflash"
    gpus = request["gpus"]
    run_id, run_dir = runs.create_run_dir(workdir, run_id)
    config = None
    if dflash:
        config = run_config(request, workdir, run_dir, src)
        if src is not None:
            _seed_resumed(src, run_id, run_dir, emit)
        runs.write_json(run_dir / "config.json", config)
    resume_dir = None if src is None else (run_dir if dflash else src.run_dir)
    argv, extra = build_command(request, run_dir, config, resume_dir)
    env = run_environment(dict(os.environ), extra, request)
    script = run_dir / SCRIPT_NAME
    runs.write_bytes(script, _script_bytes(), 0o755)
    # The environment travels in a file only the owner reads: values never reach a command line.
    runs.write_bytes(run_dir / ENV_FILE, _env_blob(env), 0o600)
    tmux_command = render(["bash", str(script), str(run_dir), "--", *argv])
    mark = ownlines.new_mark()
    info = {
        "experiment": request["experiment"],
        "run_id": run_id,
        "tag": request.get("tag"),
        "target": request.get("target"),
        "kind": request.get("kind"),
        "session": session,
        "created": request.get("created") or runs.utc_now(),
        "bundle_hash": request.get("bundle_hash") or os.environ.get("DFLASHCTL_BUNDLE_HASH"),
        "env_fingerprint": fingerprint,
        "command": argv,
        "command_line": render(argv),
        "cli": request.get("cli"),
        "gpus": gpus,
        "gpus_seen": seen,
        "layout": (config or {}).get("layout") if dflash else request.get("layout"),
        "env_keys": sorted(extra),
        "replaced": replaced,
        "resumed_from": None if src is None else src.run_id,
        "resumed_step": None if src is None else src.step,
        "node": request.get("node"),
        ownlines.RUN_JSON_KEY: mark,
    }
    runs.write_json(run_dir / "run.json", info)
    _start_log(run_dir, mark, argv)
    emit.progress("rundir", f"wrote {run_dir}", run_dir=str(run_dir))

    if dflash:
        emit.progress("layout", _describe_layout(gpus, (config or {}).get("layout") or {}, request.get("node")))
        # Across nodes the request's layout is this node's GPUs; on one node, the config's.
        lay = request.get("layout") if request.get("node") else (config or {}).get("layout")
        warm_up({**request, "layout": lay or {}}, run_dir, env, emit,
                device=str(request.get("warmup_device") or "cuda"))

    s = tmuxctl.new_session(session, tmux_command, str(run_dir), run_id)
    emit.progress("tmux", f"session {session} started (pane pid {s['pane_pid']})", session=session)
    return {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "session": session,
        "command": argv,
        "gpus": gpus,
        "replaced": replaced,
        "resumed_from": info["resumed_from"],
        "config": config,
        "dry_run": False,
        "env_fingerprint": fingerprint,
        "bundle_hash": info["bundle_hash"],
        "gpus_seen": seen,
    }


def _start_log(run_dir: Path, mark: str, argv: list[str]) -> None:
    """Give the run its mark (log.mark, read by start_training.sh) and begin train.log with the command line,
    quoted on ONE line: an argument holding a newline cannot start a line of its own there, so it cannot
    pass for the command's output (orchestrator/ownlines.py)."""
    runs.write_bytes(run_dir / ownlines.MARK_FILE, (mark + "\n").encode("ascii"))
    header = ownlines.line(mark, f"run {run_dir.name} command: {render_line(argv)}")
    fd = os.open(run_dir / "train.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, header.encode("utf-8", errors="surrogateescape"))
    finally:
        os.close(fd)


def _describe_layout(gpus: list[int], layout: dict, node: dict | None = None) -> str:
    if node and layout.get("nodes"):
        n = layout["nodes"][int(node["index"])]
        return (f"node {node['index']} of {node['count']} (rendezvous {layout.get('rendezvous')}): "
                + _describe_layout(gpus, {k: v for k, v in n.items() if k != "name"}))
    t, d = layout.get("target_gpus") or [], layout.get("drafter_gpus") or []
    if t or d:
        return f"{len(t)} target process(es) on GPUs {t}, {len(d)} drafter process(es) on GPUs {d}: one process per GPU"
    if layout.get("num_target_procs"):
        return (f"{layout['num_target_procs']} target + {layout.get('num_drafter_procs')} drafter process(es) "
                "on the CPU (gloo)")
    return "colocated: target and drafter in one CPU process"


