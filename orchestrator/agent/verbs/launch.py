"""`launch`: preflight, run directory, warm-up, tmux session, all in ONE agent call inside the target.

Request (built by orchestrator/ops/launch.py; names were checked on the workstation and are checked again):
  {workdir, experiment, run_id, tag, target, kind: "dflash"|"command",
   command: [argv] (kind command), env: {K: V}, gpus: [int], gpu_idle_mib: int,
   config: {...} (kind dflash: the resolved TrainConfig), layout: {...},
   venv_profile: {...}, lock_hash: str|null, bundle_hash: str|null, cli: str, created: iso,
   replace: bool, grace_s: float, release_timeout_s: float, dry_run: bool}
Events: progress steps lock, session, stop, gpus, venv, rundir, layout, warmup, tmux (each with a message).
Result: {run_id, run_dir, session, command, gpus, gpus_seen, replaced: run id | null, dry_run,
         env_fingerprint, bundle_hash, plan: {...} (dry run only)}
Refusals (AgentFailure types): LockHeld, SessionExists, GpuBusy, VenvMismatch, BadRequest; a failed warm-up
is WarmupFailed (its exit.json is written, no session is started).
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import socket
import sys
from pathlib import Path

from orchestrator.agent import runs, tmuxctl
from orchestrator.agent.protocol import AgentFailure
from orchestrator.agent.verbs import stop as stopverb
from orchestrator.transport.quoting import render

SCRIPT_NAME = "start_training.sh"
ENV_FILE = "launch.env0"
# Variables of the agent's own environment that must not leak into a run.
_DROP_ENV = ("TMUX", "TMUX_PANE")


def _need(request: dict, key: str, kind: type):
    value = request.get(key)
    if not isinstance(value, kind):
        raise AgentFailure("BadRequest", f"launch request: {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _check_env(env: dict) -> dict[str, str]:
    for k, v in env.items():
        if not k or not (k[0].isalpha() or k[0] == "_") or not all(c.isalnum() or c == "_" for c in k):
            raise AgentFailure("BadRequest", f"bad environment variable name {k!r}", fix="use [A-Za-z_][A-Za-z0-9_]*")
        if not isinstance(v, str) or "\x00" in v:
            raise AgentFailure("BadRequest", f"environment variable {k}: value must be a string without NUL bytes")
    return env


def build_command(request: dict, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The argv the session runs and the extra environment it gets (on top of the agent's own).

    kind dflash: `<this python> -m trainer train --config <run>/config.json --output-dir <run>`; PYTHONPATH
    stays the agent's (the bundle zip in a container, the source tree locally); CUDA_VISIBLE_DEVICES is the
    layout's GPUs (none for the colocated CPU layout). kind command: the experiment's argv with its env and
    CUDA_VISIBLE_DEVICES from its gpus.
    """
    kind = request.get("kind")
    extra = {"PYTHONUNBUFFERED": "1", "DFLASHCTL_RUN_ID": run_dir.name, "DFLASHCTL_RUN_DIR": str(run_dir)}
    gpus = [int(g) for g in request.get("gpus") or []]
    if kind == "dflash":
        argv = [sys.executable, "-m", "trainer", "train", "--config", str(run_dir / "config.json"),
                "--output-dir", str(run_dir)]
        # Empty layout: the colocated CPU process sees no GPU. A GPU layout: the trainer's CLI has no layout
        # option yet, so it runs as one process; it must at least never touch GPUs outside the layout.
        extra["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        return argv, extra
    if kind == "command":
        argv = _need(request, "command", list)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise AgentFailure("BadRequest", "launch request: command must be a non-empty list of strings")
        env = _check_env(dict(request.get("env") or {}))
        if gpus:
            extra["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        return list(argv), {**env, **extra}
    raise AgentFailure("BadRequest", f"launch request: unknown experiment kind {kind!r} (dflash or command)")


def _preflight_session(name: str, replace: bool) -> dict | None:
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
            fix=f"dflashctl launch {name[len(tmuxctl.SESSION_PREFIX):]} --replace   (or: dflashctl stop {rid})",
            data={"session": name, "run_id": rid},
        )
    return s


def _preflight_gpus(gpus: list[int], threshold: int) -> list[dict]:
    if not gpus:
        return []
    busy, seen, reason = stopverb.busy_gpus(gpus, threshold)
    if busy:
        raise AgentFailure(
            "GpuBusy",
            "GPUs of this experiment are busy: " + stopverb.describe_busy(busy, threshold) + (f"; {reason}" if reason else ""),
            fix="stop what holds them (`dflashctl status` shows runs), or change the experiment's layout",
            data={"busy": busy, "threshold_mib": threshold, "gpus": seen},
        )
    return seen


def _fingerprint(workdir: str, request: dict, emit) -> dict:
    """The venv fingerprint, refused when it differs from the experiment's lock."""
    if importlib.util.find_spec("orchestrator.agent.venvinfo") is None:
        emit.progress("venv", "venv check skipped: this bundle has no venvinfo module", skipped=True)
        return {"python": sys.version.split()[0], "executable": sys.executable}
    from orchestrator.agent import venvinfo

    actual = venvinfo.current_fingerprint(workdir, request.get("venv_profile") or {})
    diff = venvinfo.fingerprint_diff(actual, request.get("lock_hash"))
    if diff:
        raise AgentFailure(
            "VenvMismatch",
            "the venv does not match the experiment's lock: " + "; ".join(diff[:12])
            + (f" (and {len(diff) - 12} more)" if len(diff) > 12 else ""),
            fix="dflashctl rebuild-venv" + (f" --target {request['target']}" if request.get("target") else ""),
            data={"differences": diff},
        )
    emit.progress("venv", "venv matches the lock", lock_hash=actual.get("lock_hash"))
    return actual


def warmup_argv(python: str, config: Path, device: str = "cuda") -> list[str]:
    """The trainer's warm-up for one device: `python -m trainer.warmup --config FILE --device DEVICE`."""
    return [python, "-m", "trainer.warmup", "--config", str(config), "--device", device]


def warm_up(request: dict, run_dir: Path, env: dict[str, str], emit, device: str = "cuda") -> list[dict]:
    """Compile the training shapes on each drafter GPU, one process per GPU, one GPU after the other (never
    two compiles racing in one interpreter), so training starts from a warm cache. Streams one progress event
    per shape and per GPU; the warm-up's stderr goes to runs/<id>/warmup.log.

    Returns:
        The `warmup_done` summaries, one per GPU.
    Raises:
        AgentFailure("WarmupFailed"): a warm-up exited non-zero; exit.json records it (phase "warmup").
    """
    if importlib.util.find_spec("trainer.warmup") is None:
        emit.progress("warmup", "warm-up skipped: this bundle's trainer has no warm-up module", skipped=True)
        return []
    drafters = [int(g) for g in (request.get("layout") or {}).get("drafter_gpus") or []]
    if not drafters:
        emit.progress("warmup", "warm-up skipped: no drafter GPUs (colocated CPU layout)", skipped=True)
        return []
    import json
    import subprocess
    import time

    done = []
    log_path = run_dir / "warmup.log"
    for gpu in drafters:
        started = runs.utc_now()
        t0 = time.monotonic()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                warmup_argv(sys.executable, run_dir / "config.json", device), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=log, cwd=str(run_dir),
                env={**env, "CUDA_VISIBLE_DEVICES": str(gpu)},  # the process sees its GPU as cuda:0
            )
            for raw in proc.stdout:
                try:
                    ev = json.loads(raw)
                except ValueError:
                    continue
                if not isinstance(ev, dict):
                    continue
                kind = ev.pop("event", "")
                if kind == "warmup_shape":
                    emit.progress("warmup", f"GPU {gpu}: shape {ev.get('shape')} compiled in {ev.get('compile_s')} s "
                                  f"(fx cache hit {ev.get('fxgraph_cache_hit')}, miss {ev.get('fxgraph_cache_miss')})",
                                  gpu=gpu, **ev)
                elif kind == "warmup_done":
                    done.append({"gpu": gpu, **ev})
                    emit.progress("warmup", f"GPU {gpu}: warm in {time.monotonic() - t0:.1f} s, compile "
                                  f"{ev.get('compile_s')} s, cache hits {ev.get('cache_hits')} / misses "
                                  f"{ev.get('cache_misses')}", gpu=gpu, **ev)
            rc = proc.wait()
        if rc != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            runs.write_json(run_dir / "exit.json", {"exit_code": rc, "signal": None, "started": started,
                                                    "ended": runs.utc_now(), "phase": "warmup"})
            raise AgentFailure(
                "WarmupFailed",
                f"warm-up on GPU {gpu} failed with exit code {rc}: " + " | ".join(tail),
                fix=f"read {log_path}; `dflashctl diagnose` it if it is a known crash",
                data={"gpu": gpu, "log": str(log_path)},
            )
    runs.write_bytes(run_dir / "warmup.json", (json.dumps(done, indent=2) + "\n").encode())
    return done


def _script_bytes() -> bytes:
    data = pkgutil.get_data("orchestrator", f"templates/{SCRIPT_NAME}")
    if data is None:  # pragma: no cover - a broken bundle
        raise AgentFailure("BundleBroken", f"templates/{SCRIPT_NAME} is missing from the bundle")
    return data


def _env_blob(env: dict[str, str]) -> bytes:
    return b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())


def run(request: dict, emit) -> dict:
    workdir = _need(request, "workdir", str)
    experiment = _need(request, "experiment", str)
    run_id = runs.check_run_id(_need(request, "run_id", str))
    runs.check_run_id(experiment)
    session = tmuxctl.session_name(experiment)
    gpus = [int(g) for g in request.get("gpus") or []]
    threshold = int(request.get("gpu_idle_mib", 1024))
    replace = bool(request.get("replace"))
    dry_run = bool(request.get("dry_run"))

    if dry_run:
        return _plan(request, workdir, run_id, session, gpus, threshold, replace, emit)

    lock = runs.LaunchLock(workdir)
    lock.acquire({"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id, "experiment": experiment,
                  "since": runs.utc_now()})
    emit.progress("lock", f"holding {lock.path}")
    try:
        replaced = None
        old = _preflight_session(session, replace)
        if old is not None and old.get("dead_only"):
            tmuxctl.kill_session(session)
            emit.progress("session", f"cleared the finished session {session} (run {old.get('run_id')})")
        elif old is not None:
            replaced = old.get("run_id")
            emit.progress("stop", f"replacing run {replaced} in session {session}")
            if replaced:
                stopverb.stop_run(workdir, replaced, float(request.get("grace_s", stopverb.DEFAULT_GRACE_S)), emit)
            else:  # a session we did not start (no run id): end it the blunt way
                tmuxctl.kill_session(session)
            if gpus:
                stopverb.wait_gpus_idle(gpus, threshold, float(request.get("release_timeout_s", 120)), emit)
        else:
            emit.progress("session", f"no live session {session}")

        seen = _preflight_gpus(gpus, threshold)
        if gpus:
            emit.progress("gpus", f"GPUs {gpus} idle (under {threshold} MiB)")
        fingerprint = _fingerprint(workdir, request, emit)

        run_id, run_dir = runs.create_run_dir(workdir, run_id)
        argv, extra = build_command(request, run_dir)
        env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
        env.update(extra)
        if request.get("kind") == "dflash":
            config = dict(request.get("config") or {})
            config["output_dir"] = str(run_dir)
            runs.write_json(run_dir / "config.json", config)
        script = run_dir / SCRIPT_NAME
        runs.write_bytes(script, _script_bytes(), 0o755)
        # The environment travels in a file only the owner reads: values never reach a command line.
        runs.write_bytes(run_dir / ENV_FILE, _env_blob(env), 0o600)
        tmux_command = render(["bash", str(script), str(run_dir), "--", *argv])
        info = {
            "experiment": experiment,
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
            "layout": request.get("layout"),
            "env_keys": sorted(extra),
            "replaced": replaced,
        }
        runs.write_json(run_dir / "run.json", info)
        emit.progress("rundir", f"wrote {run_dir}", run_dir=str(run_dir))

        if request.get("kind") == "dflash" and gpus:
            emit.progress("layout", f"the trainer CLI takes no GPU layout yet: one process on GPUs {gpus}",
                          warning=True)
        if request.get("kind") == "dflash":
            warm_up(request, run_dir, env, emit)

        s = tmuxctl.new_session(session, tmux_command, str(run_dir), run_id)
        emit.progress("tmux", f"session {session} started (pane pid {s['pane_pid']})", session=session)
        return {
            "run_id": run_id,
            "run_dir": str(run_dir),
            "session": session,
            "command": argv,
            "gpus": gpus,
            "replaced": replaced,
            "dry_run": False,
            "env_fingerprint": fingerprint,
            "bundle_hash": info["bundle_hash"],
            "gpus_seen": seen,
        }
    finally:
        lock.release()


def _plan(request, workdir, run_id, session, gpus, threshold, replace, emit) -> dict:
    """--dry-run: the same checks, read-only; what would be stopped, written and started."""
    old = tmuxctl.find_session(session)
    would_stop = None
    if old is not None and not old["dead"]:
        if not replace:
            _preflight_session(session, False)  # raises SessionExists like the real launch
        would_stop = old.get("run_id") or session
    elif old is not None:
        emit.progress("session", f"would clear the finished session {session}")
    if would_stop is None:
        _preflight_gpus(gpus, threshold)
    fingerprint = _fingerprint(workdir, request, emit)
    run_dir = runs.runs_root(workdir) / run_id
    argv, extra = build_command(request, run_dir)
    script = run_dir / SCRIPT_NAME
    return {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "session": session,
        "command": argv,
        "gpus": gpus,
        "replaced": would_stop,
        "dry_run": True,
        "env_fingerprint": fingerprint,
        "bundle_hash": request.get("bundle_hash"),
        "plan": {
            "would_stop": would_stop,
            "files": [str(run_dir / n) for n in ("run.json", "config.json", SCRIPT_NAME, ENV_FILE)
                      if n != "config.json" or request.get("kind") == "dflash"],
            "env": {k: v for k, v in extra.items() if k in ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED")},
            "env_keys": sorted({*extra, *(request.get("env") or {})}),
            "tmux": ["tmux", "new-session", "-d", "-s", session, render(["bash", str(script), str(run_dir), "--", *argv])],
            "gpu_idle_mib": threshold,
        },
    }
