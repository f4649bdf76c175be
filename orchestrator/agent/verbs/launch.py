"""`launch`: preflight, run directory, warm-up, tmux session, all in ONE agent call inside the target.

Request: orchestrator.agent.requests.LaunchRequest (built by orchestrator/ops/launch.py; names were checked on
the workstation and are checked again). The preflight (orchestrator.agent.preflight.plan) decides everything
read-only and returns a LaunchPlan; `dry_run` returns that plan after the machine's checks, otherwise this
verb executes it under the experiment's lock: stop (--replace) or clear the old session, claim the GPUs,
the checks (driver, GPUs idle, venv), write the run directory, warm up, start the tmux session.
Events: progress steps lock, resume, session, stop, claim, driver, gpus, venv, rundir, layout, warmup, tmux
(each with a message).
Result: orchestrator.agent.requests.LaunchAnswer (the same for a dry run, with the plan's details in `plan`).
Refusals (AgentFailure types): LockHeld (a launch of this experiment is in its preflight), SessionExists,
GpuClaimed (a launch in its preflight or a running run holds one of the GPUs: waited for up to claim_wait_s
while it is a launch), DriverTooOld and DriverLibraryMismatch (a run on GPUs whose NVIDIA driver cannot run
the venv's torch: orchestrator.agent.driver), GpuBusy, VenvMismatch, ResumeNotFound, ResumeMismatch,
NothingToResume, BadRequest, BadName, BadRunId. A failed warm-up is WarmupFailed and a failed seeding of a
resumed run ResumeFailed: either way the run's exit.json is written and no session is started.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
from pathlib import Path

from orchestrator import assets, ownlines
from orchestrator.agent import atomic, claims, gpu, launchlock, preflight, resume, runcommand, rundirs, stopping, tmuxctl, venvfingerprint
from orchestrator.agent import warmup as warmups
from orchestrator.agent.preflight import LaunchPlan
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.requests import LaunchAnswer, LaunchRequest
from orchestrator.agent.runcommand import ENV_FILE, SCRIPT_NAME, SECRET_FILE, run_environment
from orchestrator.quoting import render, render_line


def run(request: dict, emit) -> dict:
    req = LaunchRequest.from_json(request)
    if req.dry_run:
        plan = preflight.plan(req, emit)
        fingerprint, _ = preflight.checks(plan, req, emit, lambda query: preflight.check_free(plan, req.workdir, emit, query))
        check_data_venv(plan, req, emit)
        return plan.answer(dry_run=True, fingerprint=fingerprint).to_json()
    # Held across the whole preflight, until the session runs: one launch of this experiment at a time.
    lock = launchlock.LaunchLock(req.workdir, req.experiment)
    lock.acquire({"pid": os.getpid(), "host": socket.gethostname(), "run_id": req.run_id,
                  "experiment": req.experiment, "since": rundirs.utc_now()})
    emit.progress("lock", f"holding {lock.path}")
    try:
        return execute(preflight.plan(req, emit), req, emit)
    finally:
        lock.release()


def execute(plan: LaunchPlan, req: LaunchRequest, emit) -> dict:
    """Do what `plan` says, in order: the old session, the GPUs' claim, the run, its session.

    Returns:
        The launch's result (the module docstring), with the plan's run id, directory, session and command.
    """
    replaced_stopped, src = _clear_session(plan, req, emit), plan.resume
    if src is not None and plan.replaces == src.run_id:  # its final checkpoint was written as it stopped
        src = dataclasses.replace(src, checkpoints=resume.complete_checkpoints(src.run_dir))
    token = None
    try:
        if plan.gpus:
            token = claims.claim(req.workdir, plan.gpus, {"run_id": plan.run_id, "experiment": req.experiment},
                                 emit, req.claim_wait_s)
            emit.progress("claim", f"claimed GPUs {plan.gpus} for run {plan.run_id}")
        fingerprint, seen = preflight.checks(plan, req, emit, lambda query: _gpus_idle(plan, emit, query))
        check_data_venv(plan, req, emit)
        result = _start_run(plan, req, src, fingerprint, seen, emit)
        if token is not None:
            claims.promote(req.workdir, token, plan.run_id)  # the run holds its GPUs now, until it ends
            token = None
        return dataclasses.replace(result, replaced_stopped=replaced_stopped).to_json()
    finally:
        if token is not None:
            claims.release(req.workdir, token)  # the launch failed: its GPUs are free again


def has_data_stage(plan: LaunchPlan, req: LaunchRequest) -> bool:
    """Whether the run's session runs the data stage (before training, or alone with --data-only)."""
    return req.kind == "dflash" and (req.data_only or runcommand.needs_data_stage(plan.config or {}))


def check_data_venv(plan: LaunchPlan, req: LaunchRequest, emit) -> dict | None:
    """A run that uses its data venv (a uv profile of its own: `<workdir>/data-venvs/<profile>`), for a data stage
    or to judge the export in vLLM after training: that venv must exist and match its lock, as the training venv
    must match its own. One rule for both uses; the message names the use.

    Returns:
        The data venv's fingerprint, or None when the run does not use one (the stage runs in the training venv,
        or there is no stage and no vLLM judgement).
    Raises:
        AgentFailure("VenvMismatch"): no data venv, or one built from another lock; the fix builds it.
    """
    profile = req.data_venv_profile or {}
    stage = has_data_stage(plan, req)
    if not (stage or runcommand.judged_in_vllm(req, plan.config or {})) or profile.get("kind") != "uv":
        return None
    use = "the data stage's venv" if stage else "the vLLM venv that judges the export"
    where = runcommand.data_venv_workdir(req.workdir, profile["name"])
    actual = venvfingerprint.current_fingerprint(where, profile)
    diff = venvfingerprint.fingerprint_diff(actual, req.data_lock_hash, profile)
    if diff:
        fix = "dflashctl rebuild-venv" + (f" --target {req.target}" if req.target else "") + f" --profile {profile['name']}"
        # venvfingerprint's lines name a bare rebuild-venv, which builds the training venv: name the data venv's.
        diff = [d.replace("`dflashctl rebuild-venv`", f"`{fix}`") for d in diff]
        raise AgentFailure("VenvMismatch", f"{use} (profile {profile['name']!r}, in {where}/venvs) does "
                           "not match its lock: " + "; ".join(diff[:6]), fix=fix,
                           data={"differences": diff, "data_venv": profile["name"]})
    emit.progress("venv", f"data venv {profile['name']} matches the lock", lock_hash=actual.get("lock_hash"))
    return actual


def _gpus_idle(plan: LaunchPlan, emit, query) -> list[dict]:
    seen = gpu.preflight_gpus(plan.gpus, plan.gpu_idle_mib, query)
    if plan.gpus:
        emit.progress("gpus", f"GPUs {plan.gpus} idle (under {plan.gpu_idle_mib} MiB)")
    return seen


def _clear_session(plan: LaunchPlan, req: LaunchRequest, emit) -> dict | None:
    """Clear the experiment's finished session, or (--replace) stop its live run and wait for that run's GPUs.

    Returns:
        The replaced run's exit.json "stopped" record (who stopped it and when), or None.
    """
    old, session = plan.old_session, plan.session
    if old is None:
        emit.progress("session", f"no live session {session}")
        return None
    if old["dead"]:
        tmuxctl.kill_session(session)
        emit.progress("session", f"cleared the finished session {session} (run {old.get('run_id')})")
        return None
    replaced, stopped = plan.replaces, None
    emit.progress("stop", f"replacing run {replaced} in session {session}")
    if replaced:
        by = {"via": f"dflashctl launch {req.experiment} --replace", **(req.requested_by or {})}
        res = stopping.stop_run(req.workdir, replaced, req.grace_s, emit, by)
        stopped = (res.get("exit") or {}).get("stopped") if res.get("state") == "stopped" else None
    else:  # a session we did not start (no run id): end it the blunt way
        tmuxctl.kill_session(session)
    if req.gpus:
        gpu.wait_gpus_idle(req.gpus, plan.gpu_idle_mib, req.release_timeout_s, emit)
    return stopped


def _start_run(plan: LaunchPlan, req: LaunchRequest, src: resume.ResumeSource | None, fingerprint: dict,
               seen: list[dict], emit) -> LaunchAnswer:
    """After the preflight: the run directory, its files, the warm-up, then the tmux session."""
    run_dir = rundirs.make_run_dir(req.workdir, plan.run_id)
    if plan.config is not None:
        warmups.make_cache_dir(plan.config)
        if src is not None:
            _seed_resumed(src, plan.run_id, run_dir, emit)
        atomic.write_json(run_dir / "config.json", plan.config)
    env = run_environment(dict(os.environ), plan.extra, req.kind, plan.gpus)
    atomic.write_bytes(run_dir / SCRIPT_NAME, assets.read_bytes(SCRIPT_NAME), 0o755)
    # The environment travels in a file only the owner reads: values never reach a command line. Secrets go
    # to a file of their own that start_training.sh deletes once read (runcommand.SECRET_FILE).
    secret = set(req.secret_env or ()) & set(req.env or {})
    atomic.write_bytes(run_dir / ENV_FILE, _env_blob({k: v for k, v in env.items() if k not in secret}), 0o600)
    if secret:
        atomic.write_bytes(run_dir / SECRET_FILE, _env_blob({k: env[k] for k in sorted(secret)}), 0o600)
    try:
        _start_session(plan, req, src, fingerprint, seen, env, run_dir, emit)
    except BaseException:
        # No session, so no start_training.sh to read the secrets and delete their file: it goes now.
        (run_dir / SECRET_FILE).unlink(missing_ok=True)
        raise
    return plan.answer(dry_run=False, fingerprint=fingerprint, gpus_seen=seen)


def _start_session(plan: LaunchPlan, req: LaunchRequest, src: resume.ResumeSource | None, fingerprint: dict,
                   seen: list[dict], env: dict[str, str], run_dir: Path, emit) -> None:
    """run.json, the start of the log, the warm-up, then the tmux session that runs start_training.sh."""
    mark = ownlines.new_mark()
    atomic.write_json(run_dir / "run.json", _run_info(plan, req, src, fingerprint, seen, mark))
    _start_log(run_dir, mark, plan.argv)
    emit.progress("rundir", f"wrote {run_dir}", run_dir=str(run_dir))
    if plan.config is not None:
        emit.progress("layout", preflight.describe_layout(plan.gpus, plan.layout or {}, req.node))
        warm_up(run_dir, plan.warmup, plan.warmup_skipped, plan.config, env, emit, device=req.warmup_device)
    s = tmuxctl.new_session(plan.session, plan.command_line, str(run_dir), plan.run_id)
    emit.progress("tmux", f"session {plan.session} started (pane pid {s['pane_pid']})", session=plan.session)


def _run_info(plan: LaunchPlan, req: LaunchRequest, src: resume.ResumeSource | None, fingerprint: dict,
              seen: list[dict], mark: str) -> dict:
    """run.json: what the run is, where it came from, what it runs."""
    return {
        "experiment": req.experiment,
        "run_id": plan.run_id,
        "tag": req.tag,
        "target": req.target,
        "kind": req.kind,
        "session": plan.session,
        "created": req.created or rundirs.utc_now(),
        "bundle_hash": plan.bundle_hash,
        "env_fingerprint": fingerprint,
        "command": plan.argv,
        "command_line": render(plan.argv),
        "cli": req.cli,
        "gpus": plan.gpus,
        "gpus_seen": seen,
        "layout": plan.layout,
        "env_keys": sorted(plan.extra),
        "replaced": plan.replaces,
        "resumed_from": None if src is None else src.run_id,
        "resumed_step": None if src is None else src.step,
        "node": req.node,
        "data_stage": {"venv": (req.data_venv_profile or {}).get("name"), "data_only": req.data_only}
        if has_data_stage(plan, req) else None,
        ownlines.RUN_JSON_KEY: mark,
    }


def _seed_resumed(src: resume.ResumeSource, run_id: str, run_dir: Path, emit) -> None:
    """Fill a resumed dflash run's directory from the old run; a failure ends the new run (exit.json)."""
    started = rundirs.utc_now()
    try:
        seeded = resume.seed(src, run_dir)
    except OSError as exc:  # disk full, permissions: the new run ends here, and says so
        atomic.write_json(run_dir / "exit.json", {"exit_code": 1, "signal": None, "started": started,
                                                  "ended": rundirs.utc_now(), "phase": "resume"})
        raise AgentFailure("ResumeFailed", f"could not seed {run_dir} from run {src.run_id}: {exc}",
                           fix=f"free space or fix permissions under {run_dir.parent}, then launch again",
                           data={"run_id": run_id, "resumed_from": src.run_id}) from None
    emit.progress("resume", f"seeded {run_dir.name} from {src.run_id}: {', '.join(seeded)}")


def warm_up(run_dir: Path, targets: list[int | None], skipped: str | None, config: dict, env: dict[str, str],
            emit, device: str = "cuda") -> list[dict]:
    """Compile the training shapes on each of `targets` (the plan's: drafter GPUs, or the CPU), one process
    per device, one after the other (never two compiles racing in one interpreter), so training starts from a
    warm cache. Streams one progress event per shape and per device (orchestrator.agent.warmup, shared with
    the `warmup` verb); the warm-ups' stderr goes to runs/<id>/warmup.log, the summaries to warmup.json.

    Returns:
        The `warmup_done` summaries, one per device.
    Raises:
        AgentFailure("WarmupFailed"): a warm-up exited non-zero; exit.json records it (phase "warmup").
    """
    if not targets:
        emit.progress("warmup", f"warm-up skipped: {skipped}", skipped=True)
        return []
    try:
        done = warmups.run_warmups(run_dir / "config.json", targets, env, emit, run_dir / "warmup.log",
                                   device=device, cwd=run_dir, cache_dir=(config.get("compile") or {}).get("cache_dir"))
    except AgentFailure as exc:
        if exc.type == "WarmupFailed":
            _warmup_exit(run_dir, int(exc.data.get("exit_code", 1)), exc.data.get("started"))
        raise
    atomic.write_bytes(run_dir / "warmup.json", (json.dumps(done, indent=2) + "\n").encode())
    return done


def _warmup_exit(run_dir: Path, rc: int, started: str | None) -> None:
    """exit.json of a run whose warm-up failed; killed by a signal: recorded the way start_training.sh does
    (128 + N, SIGNAME)."""
    sig = None
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = None
        rc = 128 - rc
    atomic.write_json(run_dir / "exit.json", {"exit_code": rc, "signal": sig, "started": started,
                                              "ended": rundirs.utc_now(), "phase": "warmup"})


def _env_blob(env: dict[str, str]) -> bytes:
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())


def _start_log(run_dir: Path, mark: str, argv: list[str]) -> None:
    """Give the run its mark (log.mark, read by start_training.sh) and begin train.log with the command line,
    quoted on ONE line: an argument holding a newline cannot start a line of its own there, so it cannot
    pass for the command's output (orchestrator/ownlines.py)."""
    atomic.write_bytes(run_dir / ownlines.MARK_FILE, (mark + "\n").encode("ascii"))
    header = ownlines.line(mark, f"run {run_dir.name} command: {render_line(argv)}")
    fd = os.open(run_dir / "train.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, header.encode("utf-8", errors="surrogateescape"))
    finally:
        os.close(fd)
