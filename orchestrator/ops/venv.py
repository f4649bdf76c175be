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

Why a wheel for the bundle: it joins the lock in one exact, hash-checked `uv pip sync`, shows up in
`uv pip freeze` and the fingerprint as `dflashctl-bundle==0+b<hash>`, and its RECORD names the files, so
the verifier finds its top-level modules like any other distribution's. (A zip on PYTHONPATH or a .pth
would work too, but would be invisible to uv and to the fingerprint.)
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import os
import re
import tarfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from orchestrator.agent import driver
from orchestrator.agent.runcommand import data_venv_workdir
from orchestrator.agent.venvfingerprint import FINGERPRINT, profile_kind
from orchestrator.agent.venvinfo import BUNDLE_DIST, STAMP
from orchestrator import assets
from orchestrator.errors import AgentError, UserError
from orchestrator.ops import carry, debs
from orchestrator.ops.carry import CarriedWheel, UvBinary
from orchestrator.ops.lockfile import LockFile, resolve_lock
from orchestrator.ops.tmuxfix import tmux_fix

SCRIPT_NAME = "rebuild_venv.sh"
# A python request reaches `uv venv --python` and the one-line stamp: a version or a name, no spaces.
_PY_REQUEST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+@/-]{0,63}$")
_EPOCH = (2020, 1, 1, 0, 0, 0)

EventCallback = Callable[[dict], None]


def script_text() -> str:
    """The rebuild script (constant text; every value is passed as an argument)."""
    return assets.read_text(SCRIPT_NAME)


# -------------------------------------------------------------------------------------------- profile


@dataclass(frozen=True)
class UvProfile:
    """The fields of a `kind: uv` venv profile that rebuild-venv uses (see inventory.UvVenv)."""

    lock: str = "cuda"
    python: str = "3.11"
    uv_cache_dir: str | None = None
    find_links: tuple[str, ...] = ()
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    keep: int = 3
    wheelhouse: tuple[str, ...] = ()
    """Workstation directories whose wheels of the lock travel to the target (see inventory.UvVenv)."""


# Profiles that use an interpreter as it is: nothing to build.
AS_IS_KINDS = ("workstation", "system")


def as_profile(profile) -> UvProfile | None:
    """A UvProfile from an inventory model or a dict; None for the `workstation` and `system` kinds.

    Raises:
        UserError: an unknown kind, a python request with spaces or shell characters, keep < 1.
    """
    kind = profile_kind(profile)  # the agent's one rule: no profile is the running interpreter
    if kind in AS_IS_KINDS:
        return None
    data = profile.model_dump() if hasattr(profile, "model_dump") else dict(profile)
    if kind != "uv":
        raise UserError(f"venv profile kind {kind!r} cannot be rebuilt", fix="use kind: uv (or system / workstation)")
    p = UvProfile(
        lock=str(data.get("lock") or "cuda"),
        python=str(data.get("python") or "3.11"),
        uv_cache_dir=data.get("uv_cache_dir") or None,
        find_links=tuple(data.get("find_links") or ()),
        index_url=data.get("index_url") or None,
        extra_index_urls=tuple(data.get("extra_index_urls") or ()),
        keep=int(data.get("keep") or 3),
        wheelhouse=tuple(data.get("wheelhouse") or ()),
    )
    if not _PY_REQUEST.match(p.python):
        raise UserError(f"bad python request {p.python!r} in the venv profile", fix='use a version like "3.11"')
    if p.keep < 1:
        raise UserError(f"venv profile keep must be >= 1, got {p.keep}", fix="keep: 3")
    return p


def sync_options(profile: UvProfile, lock: LockFile) -> list[str]:
    """`uv pip sync` options from the profile (pure; golden-tested).

    A lock with hashes is installed in hash-checking mode, so a wheel that differs from the one locked
    (another index, a tampered mirror) is refused instead of installed.
    """
    opts: list[str] = ["--require-hashes"] if lock.has_hashes else []
    if profile.index_url:
        opts += ["--index-url", profile.index_url]
    for url in profile.extra_index_urls:
        opts += ["--extra-index-url", url]
    for link in profile.find_links:
        opts += ["--find-links", link]
    return opts


# --------------------------------------------------------------------------------------------- bundle


@dataclass(frozen=True)
class Wheel:
    name: str
    data: bytes = field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@lru_cache(maxsize=4)
def bundle_wheel(bundle_hash: str, bundle_zip: bytes) -> Wheel:
    """The bundle (orchestrator + trainer packages) as a pure-Python wheel `dflashctl-bundle==0+b<hash>`.

    Deterministic: same bundle, same bytes (fixed timestamps, sorted entries).
    """
    version = f"0+b{bundle_hash}"
    distinfo = f"dflashctl_bundle-{version}.dist-info"
    files: list[tuple[str, bytes]] = []
    with zipfile.ZipFile(io.BytesIO(bundle_zip)) as src:
        for info in sorted(src.infolist(), key=lambda i: i.filename):
            if not info.is_dir():
                files.append((info.filename, src.read(info)))
    tops = sorted({name.split("/")[0] for name, _ in files})
    files += [
        (f"{distinfo}/METADATA", f"Metadata-Version: 2.1\nName: {BUNDLE_DIST}\nVersion: {version}\n"
         "Summary: dflashctl's orchestrator and trainer packages, as shipped to a target\n".encode()),
        (f"{distinfo}/WHEEL", b"Wheel-Version: 1.0\nGenerator: dflashctl\nRoot-Is-Purelib: true\nTag: py3-none-any\n"),
        (f"{distinfo}/top_level.txt", ("\n".join(tops) + "\n").encode()),
    ]
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files) + f"{distinfo}/RECORD,,\n"
    files.append((f"{distinfo}/RECORD", record.encode()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files:
            info = zipfile.ZipInfo(name, _EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return Wheel(f"dflashctl_bundle-{version}-py3-none-any.whl", buf.getvalue())


def payload(lock: LockFile, wheel: Wheel, wheels: list[CarriedWheel] = (), *, send_wheels: list[CarriedWheel] = (),
            uv: UvBinary | None = None) -> bytes:
    """The tar the script reads on stdin (deterministic): `lock.txt`, the bundle wheel, `wheels.sha256` (the
    wheelhouse wheels the target must hold, sha256sum's format), then inline what the target lacks: `uv`
    (the workstation's binary) and `wheels/<file>` for each of `send_wheels`."""
    buf = io.BytesIO()
    listing = "".join(f"{w.sha256}  {w.file}\n" for w in wheels).encode()

    def add(tf, name: str, data: bytes | None = None, path: str | None = None, mode: int = 0o644) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data) if data is not None else os.stat(path).st_size
        info.mode, info.mtime = mode, 0
        if data is not None:
            tf.addfile(info, io.BytesIO(data))
        else:
            with open(path, "rb") as fh:
                tf.addfile(info, fh)

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "lock.txt", lock.data)
        add(tf, wheel.name, wheel.data)
        add(tf, "wheels.sha256", listing)
        if uv is not None:
            add(tf, "uv", path=uv.path, mode=0o755)
        for w in send_wheels:
            add(tf, f"wheels/{w.file}", path=w.path)
    return buf.getvalue()


def script_argv(mode: str, workdir: str, *, lock_hash: str = "-", bundle_hash: str = "-", python: str = "-",
                keep: int = 3, force: bool = False, offline: bool = False, cache: str | None = None,
                wheel: str = "-", wheel_sha: str = "-", uv_bin: str = "-", uv_version: str = "-", uv_sha: str = "-",
                tmux: bool = False, sync_opts: list[str] | None = None, wheels_only: bool = False) -> list[str]:
    """The ONE command: `bash -c SCRIPT rebuild-venv MODE WORKDIR ...` (pure; argument order is the script's).

    Args:
        offline: --offline: uv uses no index, no Python download, no apt-get update.
        wheels_only: the wheelhouse holds every wheel of the lock: uv asks no index (as offline), but apt-get
            may still update its lists for tmux (a container that reaches only a Debian mirror).
        uv_bin: a uv path the target can run as is (a local target: the workstation's own); `-` for a
            container, which uses <workdir>/bin/uv (sha256 `uv_sha`) or a uv of exactly `uv_version`.
        tmux: install tmux with apt-get when it is missing (containers).
    """
    return ["bash", "-c", script_text(), "rebuild-venv", mode, workdir, lock_hash, bundle_hash, python, str(keep),
            "1" if force else "0", "1" if offline else "2" if wheels_only else "0", cache or "", wheel, wheel_sha, uv_bin, uv_version, uv_sha,
            "1" if tmux else "0", *(sync_opts or [])]


# ---------------------------------------------------------------------------------------------- report


@dataclass
class VenvReport:
    """What rebuild-venv did."""

    action: str
    """`built`, `noop` (current already matches), `rollback`, or the as-is kinds `workstation` / `system`
    (nothing to build)."""
    target: str
    venv: str | None = None
    """Directory name under `<workdir>/venvs/` that `current` now points to."""
    previous: str | None = None
    lock_hash: str | None = None
    bundle_hash: str | None = None
    lock: str | None = None
    fingerprint: dict | None = None
    pruned: list[str] = field(default_factory=list)
    timings_ms: dict = field(default_factory=dict)
    wall_s: float = 0.0
    commands: int = 0
    """Transport commands made (1, or 2 when the target lacked what this workstation believed it held)."""
    carried: list[str] = field(default_factory=list)
    """What travelled inline besides the lock and the bundle: `uv`, wheel file names."""
    carried_bytes: int = 0
    tmux: str | None = None
    """Container targets: `present`, `installed` (now, see tmux_via), `missing` (then a warning says why)."""
    tmux_via: str | None = None
    """How tmux was installed: `apt-get` in the target, or Debian's package files brought from here (named)."""
    warnings: list[dict] = field(default_factory=list)
    """{type, message, fix}: things that do not stop the build but will stop a launch (tmux missing)."""

    @property
    def torch(self) -> str | None:
        return (self.fingerprint or {}).get("torch")

    @property
    def cuda(self) -> str | None:
        return (self.fingerprint or {}).get("cuda")


# ------------------------------------------------------------------------------------------- failures

_CLASSES = [
    # (agent type, pattern over uv's output, reason, fix)
    ("OfflineCacheMiss", r"network (connectivity )?(is|was) disabled|not found in the cache|--offline",
     "--offline, but the uv cache lacks what the lock needs",
     "run once without --offline to fill the cache (or add the wheels with the profile's find_links)"),
    ("ResolutionError", r"no version of|No solution found|unsatisfiable",
     "uv cannot resolve a pin of the lock", "fix the pin and regenerate the lock: dflashctl lock PROFILE"),
    ("MissingWheel", r"doesn't have a (source distribution or )?wheel|no wheels? (with|for) a matching|"
     r"only has wheels with the following|not compatible with the current platform",
     "a locked package has no wheel for the target's python/platform",
     "lock for the target's python (profile `python`) or add find_links/index_url with that wheel"),
    ("HashMismatch", r"[Hh]ash mismatch|hashes? (do|does) not match",
     "a downloaded file's hash differs from the lock", "check the profile's index_url/find_links serve the locked files"),
    ("DownloadFailed", r"Failed to (download|fetch)|dns error|Could not connect|connection (refused|reset)|timed out",
     "uv could not download a package", "check the target's network, or put every wheel of the lock in the venv "
     "profile's wheelhouse (pip download --no-deps --only-binary=:all: -r LOCK -d DIR): rebuild-venv then asks no "
     "index; or point the profile's index_url/find_links at a mirror the target reaches"),
]


def classify(event: dict, last_import: str | None = None) -> AgentError:
    """Turn the script's error event into an AgentError whose message names the step and the reason.

    Args:
        event: the final `{"event": "error", ...}` from the script or the verifier.
        last_import: the module the verifier was importing last (named when the verifier died).
    """
    step = event.get("step") or (event.get("data") or {}).get("step") or "?"
    etype = event.get("type") or "RebuildFailed"
    message = event.get("message") or "rebuild-venv failed"
    fix = event.get("fix")
    tail = [ln for ln in (event.get("data") or {}).get("tail") or [] if ln.strip()]
    if etype == "SyncFailed":
        text = "\n".join(tail)
        for t, pattern, reason, cls_fix in _CLASSES:
            if re.search(pattern, text):
                etype, message, fix = t, f"{reason} ({message})", cls_fix
                break
    if etype == "VerifyCrashed" and last_import:
        message += f" while importing {last_import!r}"
    cause = [ln.strip() for ln in tail if re.search(r"error|cause|because|hint|No such|not found", ln, re.I)]
    detail = "; ".join(cause[:3]) if cause else (tail[-1].strip() if tail else "")
    text = f"rebuild-venv failed at step `{step}`: {message}"
    if detail and detail not in text:
        text += f": {detail}"
    fix = fix or "fix the cause above, then run `dflashctl rebuild-venv` again"
    err = AgentError(text + " (the current venv is unchanged)", agent_type=etype, fix=fix)
    return err.with_data({**(event.get("data") or {}), "step": step})


class _Events:
    """Splits the script's stdout into JSON events (a plain line becomes a `log` event)."""

    def __init__(self, on_event: EventCallback | None):
        self.on_event = on_event
        self.buf = b""
        self.final: dict | None = None
        self.fingerprint: dict | None = None
        self.last_import: str | None = None
        self.need: dict | None = None
        self.warnings: list[dict] = []

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for raw in lines:
            self._line(raw.decode("utf-8", errors="replace"))

    def finish(self) -> None:
        if self.buf.strip():
            self._line(self.buf.decode("utf-8", errors="replace"))
        self.buf = b""

    def _line(self, text: str) -> None:
        text = text.strip()
        if not text:
            return
        try:
            ev = json.loads(text)
            if not isinstance(ev, dict):
                raise ValueError
        except ValueError:
            ev = {"event": "log", "source": "stdout", "line": text}
        kind = ev.get("event")
        if kind in ("result", "error"):
            self.final = ev
            return
        if kind == "need":
            self.need = ev
            return
        if kind == "warning":
            self.warnings.append(ev)
        if kind == "fingerprint":
            self.fingerprint = ev.get("data")
        if kind == "progress" and ev.get("module"):
            self.last_import = ev["module"]
        if self.on_event is not None:
            self.on_event(ev)


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
    events = _Events(on_event)
    res = target.run(argv, stdin=stdin, timeout=timeout, on_stdout=events.feed)
    events.finish()
    return events, res


def _carry_tmux(target, events: _Events, on_event, timeout: float, offline: bool) -> debs.Carried | None:
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


__all__ = ["AS_IS_KINDS", "FINGERPRINT", "STAMP", "UvProfile", "VenvReport", "Wheel", "as_profile", "bundle_wheel",
           "classify", "payload", "profile_kind", "rebuild_venv", "script_argv", "sync_options", "tmux_fix"]
