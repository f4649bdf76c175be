"""What rebuild-venv's script says back: its stdout split into JSON events, the report of a build, and a
failure turned into an error that names the step and the reason (resolution error, missing wheel, offline
cache miss, a download that failed)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.errors import AgentError

EventCallback = Callable[[dict], None]


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


class ScriptEvents:
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
