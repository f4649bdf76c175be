"""rebuild-venv: a locked, verified uv venv in the target, swapped in atomically, in ONE target command.

The work happens in `templates/rebuild_venv.sh` (bash and coreutils: no venv, no pip, no uv needed in the
target), run once with the lock and this project's bundle (as a wheel) in a tar on stdin. The target's
NVIDIA driver must run the lock's torch (checked before the sync, and again from the fingerprint before
the switch). It streams JSON events; this module builds its argv and payload, forwards progress, and
turns a failure into an error naming the step and the reason (resolution error, missing wheel, offline
cache miss, the module that does not import).

What a container lacks travels in the same payload (orchestrator/ops/carry.py): the workstation's own uv
binary and the wheels of the profile's `wheelhouse`, each only while this workstation does not know the
container holds it; when that belief is wrong, the script says what it needs and the one retry brings it.

What is sent (the profile's fields, sync options, the bundle wheel, the tar, the argv) is `ops.venvpayload`;
what comes back (the events, the report, a failure's class) is `ops.venvreport`; this module is the verb.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from orchestrator.agent import driver
from orchestrator.agent.runcommand import data_venv_workdir
from orchestrator.agent.venvfingerprint import profile_kind
from orchestrator.errors import AgentError
from orchestrator.ops import carry, debs
from orchestrator.ops.lockfile import LockFile, resolve_lock
from orchestrator.ops.tmuxfix import tmux_fix
from orchestrator.ops.venvpayload import UvProfile, as_profile, bundle_wheel, payload, script_argv, sync_options
from orchestrator.ops.venvreport import EventCallback, ScriptEvents, VenvReport, classify

# -------------------------------------------------------------------------------------------------- op


def profile_for(inv, target: str | None, profile: str | None):
    """(target name, profile name, profile model) for `rebuild-venv [--target T] [--profile P]`.

    The target defaults to the inventory's default target, the profile to the target's `venv`.

    Raises:
        UserError / InventoryError: unknown or unsafe names (with suggestions).
    """
    tname = target or inv.default_target()
    pname = profile or inv.target(tname).venv
    return tname, pname, inv.venv(pname)



def is_data_venv(inv, profile_name: str) -> bool:
    """Whether a profile is a data-stage venv: some experiment's `data_venv`, no target's or experiment's `venv`.
    rebuild-venv builds one beside the trainer's (runcommand.data_venv_workdir), never as the target's `current`."""
    exps = list(inv.experiments.values())
    training = {t.venv for t in inv.targets.values()} | {e.venv for e in exps if e.venv}
    return profile_name not in training and any(getattr(e, "data_venv", None) == profile_name for e in exps)


def rebuild_venv(target, profile, *, offline: bool = False, force: bool = False, rollback: bool = False,
                 on_event: EventCallback | None = None, locks_dir: Path | None = None,
                 timeout: float = 3600.0, data_venv: str | None = None) -> VenvReport:
    """Build (or keep, or roll back) the target's venv from the profile's lock, in ONE target command (two
    when the target lacked the uv or wheels this workstation believed it held).

    Args:
        target: a LocalTarget or ContainerTarget (`.run(argv, stdin=, on_stdout=, timeout=)`, `.workdir`).
        profile: the venv profile (inventory model or dict); kinds `workstation` and `system` build nothing
            (`system` on a container: tmux only, as for a build).
        offline: uv uses only its cache and the carried/local wheels; no Python download, no apt-get update.
        force: rebuild even when `current` already matches the lock and the bundle.
        rollback: switch `current` back to the previous venv instead of building.
        on_event: receives progress, log and warning events (uv's and apt's lines, the imports) as they come.
        locks_dir: where shipped locks are looked up (tests).
        timeout: seconds for the whole command.
        data_venv: the profile's name when it is a data-stage venv (is_data_venv): built in its own directory
            (<workdir>/data-venvs/<name>, sharing the target's uv cache), not as the target's `current`.
    Returns:
        A VenvReport (`action` built / noop / rollback / workstation / system).
    Raises:
        UserError: bad profile, lock or wheelhouse. AgentError: a step failed (its type and step in the
        message; DriverTooOld / DriverLibraryMismatch: the target's NVIDIA driver cannot run the lock's
        torch); `current` is then as it was. ConnectError / PctError: the target cannot be reached.
    """
    start = time.monotonic()
    p = as_profile(profile)
    if p is None:
        if profile_kind(profile) == "system" and _is_container(target):  # nothing to build, but runs need tmux
            ran = _run_script(target, script_argv("tmux", target.workdir, tmux=True), None, on_event, timeout)
            tmux = _carry_tmux(target, ran[0], on_event, timeout, offline)
            return _finish(target, None, ran, start, 1 + (tmux is not None), [], 0, tmux=tmux)
        return VenvReport(profile_kind(profile), target.name, wall_s=time.monotonic() - start)
    workdir = target.workdir
    if data_venv is not None:
        workdir = data_venv_workdir(target.workdir, data_venv)
        p = dataclasses.replace(p, uv_cache_dir=p.uv_cache_dir or f"{target.workdir}/uv-cache")
    if rollback:
        return _finish(target, None, _run_script(target, script_argv("rollback", workdir), None, on_event,
                                                 timeout), start, 1, [], 0)
    plan = _BuildPlan(target, p, resolve_lock(p.lock, locks_dir), offline, force, workdir)
    events, res = _run_script(target, plan.argv(), plan.stdin(), on_event, timeout)
    commands = 1
    need = events.need if events.final and events.final.get("type") == "NeedFiles" else None
    if need is not None:  # this workstation's memory of the target was wrong: send exactly what it asks for
        plan.send(uv=bool(need.get("uv")), wheels=set(need.get("wheels") or ()))
        events, res = _run_script(target, plan.argv(), plan.stdin(), on_event, timeout)
        commands = 2
    tmux = _carry_tmux(target, events, on_event, timeout, offline)  # before the verdict: a failed build gets it too
    commands += tmux is not None
    try:
        report = _finish(target, plan.lock, (events, res), start, commands, plan.sent_names(), plan.sent_bytes(),
                         p.lock, tmux)
    except AgentError:
        # Past the wheels step the target keeps every wheel sent (dflashctl-wheels/): the next try sends none.
        if (events.final or {}).get("step") not in (None, "workdir", "tmux", "stage", "wheels"):
            plan.remember()
        raise
    plan.remember()
    return report


def _is_container(target) -> bool:
    """A target that does not see this workstation's files (a container: tmux and uv must travel there)."""
    return hasattr(target, "bundle_cache_key") and target.bundle_cache_key() is not None


class _BuildPlan:
    """What one build sends: the argv, and which of uv / the wheelhouse wheels travel inline."""

    def __init__(self, target, profile: UvProfile, lock: LockFile, offline: bool, force: bool,
                 workdir: str | None = None):
        from orchestrator.bundle import build_bundle

        self.target, self.profile, self.lock, self.offline, self.force = target, profile, lock, offline, force
        self.workdir = workdir or target.workdir
        bundle = build_bundle()
        self.bundle_hash = bundle.hash
        self.wheel = bundle_wheel(bundle.hash, bundle.data)
        self.uv = carry.workstation_uv()
        self.key = target.bundle_cache_key() if hasattr(target, "bundle_cache_key") else None
        # A local target sees the workstation's files: its uv and wheelhouse are used where they are.
        self.wheels = carry.lock_wheels(lock, profile.wheelhouse) if self.key else []
        held = carry.known(self.key) if self.key else {"uv": None, "wheels": {}}
        self.send_uv = self.key is not None and held["uv"] != self.uv.sha256
        self.send_wheels = [w for w in self.wheels if held["wheels"].get(w.file) != w.sha256]
        # Every pin of the lock has its wheel here: uv asks no index, with no flag to guess.
        self.whole_lock = bool(self.wheels) and set(lock.pins()) <= {carry.wheel_pin(w.file)[0] for w in self.wheels}

    def send(self, uv: bool, wheels: set[str]) -> None:
        self.send_uv = self.send_uv or uv
        self.send_wheels = [w for w in self.wheels if w.file in wheels or w in self.send_wheels]

    def argv(self) -> list[str]:
        p, lock = self.profile, self.lock
        opts = sync_options(p, lock)
        if not self.key:
            for d in p.wheelhouse:
                opts += ["--find-links", os.path.expanduser(d)]
        return script_argv("build", self.workdir, lock_hash=lock.hash, bundle_hash=self.bundle_hash,
                           python=p.python, keep=p.keep, force=self.force, offline=self.offline, cache=p.uv_cache_dir,
                           wheel=self.wheel.name, wheel_sha=self.wheel.sha256,
                           uv_bin="-" if self.key else self.uv.path, uv_version=self.uv.version,
                           uv_sha=self.uv.sha256, tmux=self.key is not None, sync_opts=opts,
                           wheels_only=self.whole_lock)

    def stdin(self) -> bytes:
        return payload(self.lock, self.wheel, self.wheels, send_wheels=self.send_wheels,
                       uv=self.uv if self.send_uv else None)

    def sent_names(self) -> list[str]:
        return (["uv"] if self.send_uv else []) + [w.file for w in self.send_wheels]

    def sent_bytes(self) -> int:
        return (os.stat(self.uv.path).st_size if self.send_uv else 0) + sum(w.size for w in self.send_wheels)

    def remember(self) -> None:
        """After a build that succeeded (or found nothing to do with everything sent): the target holds them."""
        if self.key:
            carry.remember(self.key, self.uv.sha256, self.wheels)


def rebuild(inv, target: str | None, profile: str | None, **kw) -> tuple[str, str, VenvReport]:
    """`dflashctl rebuild-venv`: (target name, profile name, report) of rebuild_venv (`kw`) on `target`
    (default: the inventory's) with `profile` (default: the target's), the target opened and closed."""
    from orchestrator.target import open_target

    tname, pname, prof = profile_for(inv, target, profile)
    tgt = open_target(inv, tname)
    try:
        return tname, pname, rebuild_venv(tgt, prof, data_venv=pname if is_data_venv(inv, pname) else None, **kw)
    finally:
        tgt.close()


def _run_script(target, argv: list[str], stdin: bytes | None, on_event, timeout: float):
    events = ScriptEvents(on_event)
    res = target.run(argv, stdin=stdin, timeout=timeout, on_stdout=events.feed)
    events.finish()
    return events, res


def _carry_tmux(target, events: ScriptEvents, on_event, timeout: float, offline: bool) -> debs.Carried | None:
    """The script's TmuxMissing warning with the target's release (apt-get there could not install tmux):
    Debian's packages for that release, fetched and checked here, installed there (ops/debs.py; one more
    command; `offline`: only packages this workstation already holds). Carried, the warning is gone; failing,
    the warning says why, and its fix is debs' own (under --offline the apt-get line stays)."""
    warn = next((w for w in events.warnings if w.get("type") == "TmuxMissing" and (w.get("data") or {}).get("os")),
                None)
    if warn is None:
        return None
    data = warn["data"]
    if on_event is not None:
        on_event({"event": "progress", "step": "tmux", "message": "bringing tmux: Debian's packages for "
                  f"{data.get('os')} {data.get('codename')}/{data.get('arch')}, fetched and checked here"})
    try:
        carried = debs.carry_tmux(target, data, timeout=min(timeout, 600.0), offline=offline)
    except debs.DebsError as exc:
        warn["message"] = f"{warn.get('message')}; bringing Debian's tmux packages from here failed: {exc.message}"
        if not offline:
            warn["fix"] = exc.fix
        return None
    events.warnings.remove(warn)
    return carried


def _finish(target, lock: LockFile | None, ran, start: float, commands: int, carried: list[str],
            carried_bytes: int, lock_spec: str | None = None, tmux: debs.Carried | None = None) -> VenvReport:
    """The report of the script's final event; an AgentError for its error (or for no final event).
    `lock_spec`: the profile's `lock` as written (a driver fix names it); `tmux`: tmux's packages carried."""
    events, res = ran
    final = events.final
    if final is None:
        err = res.stderr.decode("utf-8", errors="replace").strip().splitlines()[-5:]
        extra = f" while importing {events.last_import!r}" if events.last_import else ""
        raise AgentError(f"rebuild-venv on {target.name} ended (exit {res.exit_code}) without a result{extra}"
                         + (": " + " | ".join(err) if err else ""), agent_type="RebuildDied", result=res)
    if final.get("event") == "error":
        if final.get("type") in driver.PROBLEM_TYPES:  # the target does not know the lock's or the target's name
            final = {**final, "fix": driver.fix_text(final["type"], final.get("data") or {},
                                                     lock=lock_spec, target=target.name)}
        raise classify(final, events.last_import)
    data = final.get("data") or {}
    warnings = [{"type": w.get("type"), "message": w.get("message"), "fix": _warning_fix(target, w)}
                for w in events.warnings]
    tmux_state = data.get("tmux") if data.get("tmux") not in (None, "unchecked") else None
    tmux_via = "apt-get" if tmux_state == "installed" else None
    if tmux is not None:
        tmux_state, tmux_via = "installed", f"{tmux.version}, Debian's packages from this workstation: " + \
            ", ".join(tmux.files)
    return VenvReport(
        action=data.get("action", "?"), target=target.name, venv=data.get("venv"), previous=data.get("previous") or None,
        lock_hash=data.get("lock_hash"), bundle_hash=data.get("bundle_hash"), lock=lock.name if lock else None,
        fingerprint=events.fingerprint or data.get("fingerprint"), pruned=list(data.get("pruned") or []),
        timings_ms=dict(data.get("timings") or {}), wall_s=time.monotonic() - start, commands=commands,
        carried=carried if data.get("action") == "built" else [], carried_bytes=carried_bytes,
        tmux=tmux_state, tmux_via=tmux_via, warnings=warnings,
    )


def _warning_fix(target, warning: dict) -> str | None:
    if warning.get("fix"):
        return warning["fix"]
    if warning.get("type") == "TmuxMissing":
        return tmux_fix(target)
    return None


__all__ = ["VenvReport", "is_data_venv", "profile_for", "rebuild", "rebuild_venv"]
