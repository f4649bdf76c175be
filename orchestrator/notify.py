"""Notifications: a JSON POST to a webhook and/or a local command with the event as JSON on stdin.

A notification must never break the follow that sends it: every failure (unreachable URL, HTTP error,
timeout, command missing or failing) is reported in the returned outcomes, never raised.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

EVENT_KINDS = ("crash", "hang", "regression", "completion")


@dataclass
class Outcome:
    """What happened to one delivery: channel is "webhook" or "command"; `fix` says what to check when it
    failed. No text of it holds more of a webhook URL than `redact_url` keeps."""

    channel: str
    ok: bool
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def warning(self, kind: str, source: str) -> str:
        """The one warning line of a failed delivery: what failed, where, and what to check in `source`."""
        fix = self.fix or f"check notify.{self.channel} in {source}"
        return f"warning: the {kind} notification by {self.channel} failed: {self.detail}; fix: {fix}"


def redact_url(url: str) -> str:
    """`scheme://host[:port]/...` of a URL: webhook URLs carry their secret in the user part, the path
    (Slack's /services/T/B/SECRET, Discord's /api/webhooks/ID/TOKEN) or the query, so only where it goes is
    shown."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<a malformed URL>"
    if not parts.scheme or not host:
        return "<not a URL>"
    more = "/..." if (parts.path not in ("", "/") or parts.query or parts.fragment or parts.username) else ""
    return f"{parts.scheme}://{host}{port}{more}"


def make_event(kind: str, run_id: str, *, experiment: str | None = None, message: str = "",
               diagnosis: dict | None = None, **extra: Any) -> dict:
    """Build a notification event.

    Args:
        kind: one of crash, hang, regression, completion.
        run_id: the run it concerns.
        experiment: its experiment.
        message: one human line (also sent as `text`, which chat webhooks display).
        diagnosis: e.g. a signature Match's to_dict() plus title/diagnosis/fix, or an Alert's to_dict().
        **extra: more fields (exit_code, target, ...).

    Returns:
        The event dict.

    Raises:
        ValueError: unknown kind.
    """
    if kind not in EVENT_KINDS:
        raise ValueError(f"unknown notification kind {kind!r}; use one of {', '.join(EVENT_KINDS)}")
    text = f"dflashctl {kind}: run {run_id}" + (f" ({experiment})" if experiment else "")
    if message:
        text += f": {message}"
    return {"event": kind, "run_id": run_id, "experiment": experiment, "message": message,
            "diagnosis": diagnosis, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "text": text, **extra}


def _get(cfg: Any, name: str) -> Any:
    if cfg is None:
        return None
    if isinstance(cfg, dict):
        return cfg.get(name)
    return getattr(cfg, name, None)


def notify(cfg: Any, event: dict, timeout: float = 10.0) -> list[Outcome]:
    """Deliver `event` to the webhook and/or command configured in `cfg` (the inventory's `notify:`).

    Args:
        cfg: a mapping or object with optional `webhook` (URL) and `command` (argv list).
        event: from `make_event`.
        timeout: seconds per delivery.

    Returns:
        One Outcome per configured channel (empty when none is configured). Never raises for delivery
        failures.
    """
    body = json.dumps(event, default=str).encode("utf-8")
    outcomes = []
    url = _get(cfg, "webhook")
    if url:
        outcomes.append(_post(url, body, timeout))
    command = _get(cfg, "command")
    if command:
        outcomes.append(_run(list(command), body, timeout))
    return outcomes


def _post(url: str, body: bytes, timeout: float) -> Outcome:
    shown = redact_url(url)
    if not url.startswith(("http://", "https://")):
        return Outcome("webhook", False, f"{shown} is not an http(s) URL",
                       "make notify.webhook an http:// or https:// URL")
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "dflashctl"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Outcome("webhook", True, f"HTTP {response.status}")
    except urllib.error.HTTPError as exc:
        why = "the URL or its token" if 400 <= exc.code < 500 else "the receiving service"
        return Outcome("webhook", False, f"{shown} answered HTTP {exc.code} {exc.reason}",
                       f"check {why} (notify.webhook)")
    except (urllib.error.URLError, socket.timeout, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return Outcome("webhook", False, f"{shown} unreachable: {reason}",
                       f"check that this workstation reaches {shown.removesuffix('/...')} (notify.webhook)")


def _run(argv: list[str], body: bytes, timeout: float) -> Outcome:
    try:
        proc = subprocess.run(argv, input=body, capture_output=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return Outcome("command", False, f"{argv[0]!r} not found", "give notify.command an existing program")
    except subprocess.TimeoutExpired:
        return Outcome("command", False, f"{argv[0]} did not finish within {timeout:.0f} s")
    except OSError as exc:
        return Outcome("command", False, f"{argv[0]} could not run: {exc}")
    if proc.returncode != 0:
        tail = proc.stderr.decode("utf-8", errors="replace").strip().splitlines()[-3:]
        return Outcome("command", False, f"{argv[0]} exited {proc.returncode}: {' | '.join(tail)}")
    return Outcome("command", True, "exit 0")
