"""Where things run: a LocalTarget (a directory on this machine) or a ContainerTarget (an LXC container on a
Proxmox host, reached by SSH and wrapped by `pct exec`). Both call the same agent code with the same
protocol; the only difference is the transport and how the agent's interpreter is found.

Budget: one `agent()` call is ONE command on the transport, i.e. one `pct exec` for a container, the first
contact included: a bundle the container may lack travels inline on stdin ahead of the request.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.agent import events
from orchestrator.bundle import build_bundle, source_root
from orchestrator.errors import AgentError, RemoteCommandError, UserError
from orchestrator.quoting import with_env
from orchestrator.records import read_state, write_state
from orchestrator.transport.base import Result, Started, Transport
from orchestrator.transport.local import LocalTransport
from orchestrator.transport.pct import PctTransport
from orchestrator.transport.pvehost import PveHost

EventCallback = Callable[[events.Event], None]

# Exit codes of the bootstrap below (chosen outside the agent's own 0/1/2).
BUNDLE_MISSING = 75
NO_PYTHON = 76
BUNDLE_WRITE_FAILED = 77

# Runs inside the target before the agent: finds the bundle and an interpreter. A constant script: every
# value arrives as a positional argument, so nothing is ever spliced into shell text. The zip is unpacked once
# into a directory named by its hash (by the interpreter itself: a container may lack unzip), where Python
# keeps the compiled modules between calls (__pycache__), instead of compiling every module from the zip on
# every call; a concurrent first call that lost the rename uses the winner's directory.
AGENT_BOOTSTRAP = r"""set -u
workdir=$1; hash=$2; inline=$3; shift 3
bundle="$workdir/bundle/$hash.zip"
if [ "$inline" != 0 ]; then
  # The first $inline bytes of stdin are the bundle zip (GNU head -c never reads past them), the rest is
  # the request. Keep an existing copy; otherwise install it atomically.
  if [ -f "$bundle" ]; then head -c "$inline" > /dev/null
  else
    mkdir -p "$workdir/bundle" && tmp="$workdir/bundle/.$hash.zip.$$" && head -c "$inline" > "$tmp" \
      && [ "$(wc -c < "$tmp")" -eq "$inline" ] && mv -f "$tmp" "$bundle" \
      || { rm -f "$tmp"; echo "dflashctl: could not write the bundle into $workdir/bundle" >&2; exit 77; }
  fi
fi
if [ ! -f "$bundle" ]; then echo "dflashctl: bundle $hash is not in $workdir/bundle" >&2; exit 75; fi
py="$workdir/venvs/current/bin/python"
if [ ! -x "$py" ]; then py=$(command -v python3) || { echo "dflashctl: no python3 in PATH ($PATH)" >&2; exit 76; }; fi
dir="$workdir/bundle/$hash"
if [ ! -d "$dir" ]; then
  tmpd="$workdir/bundle/.$hash.d.$$"
  "$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$bundle" "$tmpd" \
    && mv -T "$tmpd" "$dir" 2>/dev/null
  rm -rf "$tmpd"
  if [ ! -d "$dir" ]; then echo "dflashctl: could not unpack the bundle into $dir" >&2; exit 77; fi
fi
export PYTHONPATH="$dir" DFLASHCTL_WORKDIR="$workdir" DFLASHCTL_BUNDLE_HASH="$hash" PYTHONUNBUFFERED=1
exec "$py" -m orchestrator.agent "$@"
"""

# Workstation-side cache (in the state dir) of which bundle each container is known to hold.
KNOWN_BUNDLES = "bundles.json"

# The environment every command inside a container gets (pct resets PATH; --keep-env 0 clears the rest).
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/root/.local/bin"


class _EventStream:
    """Splits agent stdout into lines, parses each as one typed event (orchestrator.agent.events), forwards it,
    keeps the last one (Result or Error) and the first line that was not an event it can read."""

    def __init__(self, on_event: EventCallback | None):
        self.on_event = on_event
        self.buf = b""
        self.events_seen = 0
        self.final: events.Result | events.Error | None = None
        self.bad: events.BadEvent | None = None
        self.garbage: list[str] = []

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        for raw in lines:
            self._line(raw)

    def finish(self) -> None:
        if self.buf.strip():
            self._line(self.buf)
        self.buf = b""

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            return
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            self.garbage.append(text)  # a library printed to stdout; keep it for the error message
            return
        self.events_seen += 1
        try:
            ev = events.parse(data)
        except events.BadEvent as exc:
            self.bad = self.bad or exc  # the agent and this workstation disagree: the call fails, naming it
            return
        if isinstance(ev, (events.Result, events.Error)):
            self.final = ev
        elif self.on_event is not None:
            self.on_event(ev)


@dataclass
class BaseTarget:
    """Common agent-calling logic. Subclasses supply `transport` and `agent_argv`."""

    name: str
    workdir: str
    transport: Transport = field(repr=False)

    def agent_argv(self, verb: str) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def agent(
        self,
        verb: str,
        request: dict | None = None,
        on_event: EventCallback | None = None,
        timeout: float | None = None,
        answer: type | None = None,
    ):
        """Run one agent verb; stream non-final events (typed: orchestrator.agent.events) to on_event; return
        the result's data, as `answer` (an orchestrator.agent.requests.Answer class) when given.

        Raises:
            AgentError: the agent reported an error event (its type in `.agent_type`), or died without one, or
                sent an event or an answer this workstation cannot read (BadEvent, naming the field).
        """
        payload = json.dumps({"workdir": self.workdir, **(request or {})}).encode()
        stream = _EventStream(on_event)
        res = self._run_agent(verb, payload, stream, timeout)
        stream.finish()
        data = self._interpret(verb, res, stream)
        if answer is None:
            return data
        try:
            return answer.from_json(data)
        except events.BadEvent as exc:
            raise AgentError(f"agent {verb} on {self.name} answered what this workstation cannot read: {exc}",
                             agent_type="BadEvent", result=res) from None

    def _run_agent(self, verb: str, payload: bytes, stream: _EventStream, timeout: float | None) -> Result:
        return self.transport.run(self.agent_argv(verb), stdin=payload, timeout=timeout, on_stdout=stream.feed)

    def _interpret(self, verb: str, res: Result, stream: _EventStream) -> dict:
        final = stream.final
        if stream.bad is not None:
            raise AgentError(f"agent {verb} on {self.name} sent an event this workstation cannot read: {stream.bad}",
                             agent_type="BadEvent", result=res)
        if isinstance(final, events.Result):
            return final.data
        if isinstance(final, events.Error):
            raise AgentError(final.message or f"agent {verb} failed", agent_type=final.type or "AgentError",
                             fix=final.fix).with_data(final.data)
        detail = res.stderr.decode("utf-8", errors="replace").strip().splitlines()[-5:]
        raise AgentError(
            f"agent {verb} on {self.name} ended (exit {res.exit_code}) without a result"
            + (": " + " | ".join(detail) if detail else ""),
            agent_type="AgentDied",
            result=res,
        )

    def run(self, argv: list[str], **kw) -> Result:
        """Run a plain command in the target's context (for the few things the agent cannot do)."""
        return self.transport.run(argv, **kw)

    def abort(self) -> None:
        """Cut the exec in progress from another thread: closing the connection ends its channel (the next
        agent call reconnects). Best effort: the connection is being dropped anyway."""
        try:
            self.transport.close()
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        self.transport.close()


def tmux_attach_argv(session: str, read_only: bool = False) -> list[str]:
    """`tmux attach-session [-r] -t =SESSION` (`=`: the exact name, never a prefix match)."""
    return ["tmux", "attach-session", *(["-r"] if read_only else []), "-t", "=" + session]


@dataclass
class LocalTarget(BaseTarget):
    """A directory on this machine. The agent runs with `python` (the venv profile's interpreter, by default
    the workstation's own) from this source tree, so no bundle is needed: the transport open_target gives
    it runs every command with this tree on PYTHONPATH (local_env). The agent call runs through the target's
    transport like any command."""

    python: str = sys.executable

    def agent_argv(self, verb: str) -> list[str]:
        return [self.python, "-m", "orchestrator.agent", verb]

    def attach_argv(self, session: str, read_only: bool = False) -> list[str]:
        """The argv that attaches this terminal to `session` here (inside tmux already: switch the client,
        since tmux refuses to nest)."""
        if os.environ.get("TMUX") and not read_only:
            return ["tmux", "switch-client", "-t", "=" + session]
        return tmux_attach_argv(session, read_only)


@dataclass
class ContainerTarget(BaseTarget):
    """An LXC container: `transport` is a PctTransport (pct exec CTID -- argv over SSH); `host` its Proxmox
    host's pct verbs and their printed forms (transport.pvehost.PveHost), for doctor and its fixes."""

    host: PveHost | None = field(default=None, repr=False)
    home: str = "/root"
    pushes: int = 0  # agent calls that carried the bundle inline (tests and benchmarks)
    # An agent call started before the request was ready (start_agent, by orchestrator.preconnect): the next
    # agent call with exactly its argv finishes it instead of starting its own.
    started: Started | None = field(default=None, repr=False)

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "PATH": CONTAINER_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}

    def wrap(self, argv: list[str]) -> list[str]:
        """argv with the container environment set inside the command itself (pct resets it)."""
        return with_env(self.env(), argv)

    def attach_argv(self, session: str, read_only: bool = False) -> list[str]:
        """`ssh -t HOST 'pct exec CT --keep-env 0 -- env -i HOME=.. PATH=.. TERM=.. tmux attach ...'`: the real
        OpenSSH client with a tty (an interactive terminal is what paramiko's no-pty channels are not for),
        with the settings this target's connection uses; an unknown or changed host key is refused.

        TERM travels inside the command: `--keep-env 0` drops it, and tmux refuses to attach without one.
        """
        inner = with_env({**self.env(), "TERM": os.environ.get("TERM") or "xterm-256color"},
                         tmux_attach_argv(session, read_only))
        return self.transport.interactive_argv(inner)

    def command_line(self, argv: list[str]) -> str:
        """`argv` inside the container as the user pastes it (`ssh ... pct exec CT -- argv`)."""
        return self.transport.command_line(argv)

    def agent_argv(self, verb: str, inline: int = 0) -> list[str]:
        """The agent's argv; `inline` > 0 means the bundle's bytes precede the request on stdin."""
        bundle = build_bundle()
        return self.wrap(["bash", "-c", AGENT_BOOTSTRAP, "dflashctl-agent", self.workdir, bundle.hash, str(inline), verb])

    def bundle_cache_key(self) -> str:
        """Identifies this container on the workstation (host, ctid, workdir) for the known-bundles cache."""
        parent = getattr(self.transport, "parent", None)
        host = f"{getattr(parent, 'label', None) or getattr(parent, 'hostname', '?')}:{getattr(parent, 'port', '')}"
        ctid = getattr(self.transport, "ctid", "?")
        return f"{host}/{ctid}/{self.workdir}"

    def _bundle_known(self, bundle_hash: str) -> bool:
        return self._known_bundles().get(self.bundle_cache_key()) == bundle_hash

    def _remember_bundle(self, bundle_hash: str) -> None:
        """Record that the container holds this bundle, so later commands send only the request (a cache:
        losing it costs one inline bundle later, nothing else)."""
        known = self._known_bundles()
        known[self.bundle_cache_key()] = bundle_hash
        write_state(KNOWN_BUNDLES, json.dumps(known))

    @staticmethod
    def _known_bundles() -> dict:
        try:
            known = json.loads(read_state(KNOWN_BUNDLES) or "{}")
        except ValueError:
            return {}
        return known if isinstance(known, dict) else {}

    def _run_agent(self, verb, payload, stream, timeout):
        """One exec per agent call. When this workstation does not know the container holds the bundle,
        the bundle travels inline on stdin ahead of the request (still one exec); when the cache was wrong
        (bundle deleted there), one retry with the bundle inline."""
        bundle = build_bundle()
        inline = not self._bundle_known(bundle.hash)
        res = self._exec_agent(verb, payload, stream, timeout, bundle if inline else None)
        if res.exit_code == BUNDLE_MISSING and stream.events_seen == 0 and not inline:
            res = self._exec_agent(verb, payload, stream, timeout, bundle)
            inline = True
        if res.exit_code == BUNDLE_WRITE_FAILED:
            raise RemoteCommandError(f"cannot copy the dflashctl bundle into {self.workdir} on {self.name}", result=res,
                                     fix="check free disk and permissions of the target's workdir (dflashctl doctor)")
        if res.exit_code == NO_PYTHON:
            raise RemoteCommandError(
                f"{self.name} has no python3 on PATH", result=res, fix="install python3 in the container (apt-get install -y python3)"
            )
        if inline and stream.events_seen:
            self._remember_bundle(bundle.hash)
            self.pushes += 1
        return res

    def _exec_agent(self, verb, payload, stream, timeout, bundle):
        stdin = payload if bundle is None else bundle.data + payload
        argv = self.agent_argv(verb, inline=0 if bundle is None else len(bundle.data))
        started = self._take_started(argv)
        if started is not None:
            return self.transport.finish(started, stdin=stdin, timeout=timeout, on_stdout=stream.feed)
        return self.transport.run(argv, stdin=stdin, timeout=timeout, on_stdout=stream.feed)

    def start_agent(self, verb: str) -> Started:
        """Start the agent for `verb` now and return at once; the request follows when the next agent call
        (set `started` to the result) finishes it: the container enters pct, starts Python and imports the
        verb while the workstation still builds the request. Still one exec per agent call; the bundle rides
        inline exactly when agent() would send it.

        Raises:
            ConnectError: the command could not be started.
        """
        bundle = build_bundle()
        inline = 0 if self._bundle_known(bundle.hash) else len(bundle.data)
        return self.transport.start(self.agent_argv(verb, inline=inline))

    def _take_started(self, argv: list[str]) -> Started | None:
        """The early agent call when it runs exactly `argv` in this container; otherwise it is dropped (it
        reads end-of-file instead of a request and runs nothing) and None is returned."""
        started, self.started = self.started, None
        if started is None:
            return None
        if started.argv == argv and started.where == self.transport.name:
            return started
        self.transport.discard(started)
        return None

    def run(self, argv: list[str], **kw) -> Result:
        return self.transport.run(self.wrap(list(argv)), **kw)

    def close(self) -> None:
        if self.started is not None:  # started early, never used
            started, self.started = self.started, None
            self.transport.discard(started)
        self.transport.close()


# ------------------------------------------------------------------------------------ factory


def open_target(inv, name: str, early=None) -> BaseTarget:
    """Build the Target named `name` in the inventory `inv`.

    A local target gets its workdir expanded and created, and the venv profile's interpreter (the
    workstation's own, `sys.executable`, for kind `workstation`; `<workdir>/venvs/current/bin/python` once a
    uv venv exists). A container target gets `PctTransport(SSHTransport(host...), ctid)`; ssh and pct are
    imported here, lazily, so the CLI's `--help` never loads paramiko.

    Args:
        inv: an `orchestrator.inventory.Inventory`.
        name: the target's key under `targets:`.
        early: an orchestrator.preconnect.EarlyConnection started by the command, or None; its connection
            is used when it was made for this target's host exactly as the inventory says, and the agent
            call it started (if any) becomes the target's `started`.
    Returns:
        A LocalTarget or ContainerTarget (close it when done: it may hold an SSH connection).
    Raises:
        UserError / InventoryError: unsafe or unknown name (with a suggestion), or a local workdir that
            cannot be created.
        ConnectError / HostKeyError: the early connection to this target's host failed.
    """
    from orchestrator.inventory import ContainerTargetSpec, UvVenv  # pydantic: loaded by then (inv is one)

    spec = inv.target(name)
    if isinstance(spec, ContainerTargetSpec):
        host = inv.host(spec.host)
        ssh = early.take(spec.host, host) if early is not None else None
        taken = ssh is not None
        if ssh is None:
            from orchestrator.transport.ssh import SSHSettings  # lazily: the CLI's --help never loads it

            ssh = SSHSettings.of(spec.host, host).transport()
        target = container_target(name, spec, host, ssh)
        if taken:
            target.started = early.take_agent()  # used only if it runs exactly what the next agent call would
        return target

    workdir = spec.resolved_workdir()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"cannot create the workdir {str(workdir)!r} of target {name!r}: {exc}",
            fix=f"fix targets.{name}.workdir in {inv.source}",
        ) from None
    python = sys.executable
    profile = inv.venv(spec.venv)
    if isinstance(profile, UvVenv):
        venv_python = Path(workdir) / "venvs" / "current" / "bin" / "python"
        if venv_python.exists():
            python = str(venv_python)
    return LocalTarget(name=name, workdir=str(workdir), transport=LocalTransport(env=local_env()), python=python)


def local_env() -> dict[str, str]:
    """The environment of a local target's commands: this one, with this source tree first on PYTHONPATH (a
    venv's interpreter finds the agent there) and unbuffered output (events stream as they are written)."""
    path = os.pathsep.join(p for p in (str(source_root()), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def container_target(name: str, spec, host, ssh) -> "ContainerTarget":
    """A ContainerTarget for an inventory ContainerTargetSpec whose pct calls ride on `ssh` (a Transport
    to the Proxmox host; several callers may share one connection)."""
    transport = PctTransport(ssh, spec.ctid, pct=host.pct, sudo=host.sudo)
    return ContainerTarget(name=name, workdir=spec.workdir, transport=transport, home=spec.home,
                           host=PveHost(ssh, spec.ctid, pct=host.pct, sudo=host.sudo))
