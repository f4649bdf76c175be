"""Where things run: a LocalTarget (a directory on this machine) or a ContainerTarget (an LXC container on a
Proxmox host, reached by SSH and wrapped by `pct exec`). Both call the same agent code with the same
protocol; the only difference is the transport and how the agent's interpreter is found.

Budget: one `agent()` call is ONE command on the transport, i.e. one `pct exec` for a container (plus a
one-time bundle push when the container lacks this bundle).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.errors import AgentError, RemoteCommandError
from orchestrator.transport.base import Result, Transport

EventCallback = Callable[[dict], None]

# Exit codes of the bootstrap below (chosen outside the agent's own 0/1/2).
BUNDLE_MISSING = 75
NO_PYTHON = 76

# Runs inside the target before the agent: finds the bundle and an interpreter. A constant script: every
# value arrives as a positional argument, so nothing is ever spliced into shell text.
AGENT_BOOTSTRAP = r"""set -u
workdir=$1; hash=$2; shift 2
bundle="$workdir/bundle/$hash.zip"
if [ ! -f "$bundle" ]; then echo "dflashctl: bundle $hash is not in $workdir/bundle" >&2; exit 75; fi
py="$workdir/venvs/current/bin/python"
if [ ! -x "$py" ]; then py=$(command -v python3) || { echo "dflashctl: no python3 in PATH ($PATH)" >&2; exit 76; }; fi
export PYTHONPATH="$bundle" DFLASHCTL_WORKDIR="$workdir" DFLASHCTL_BUNDLE_HASH="$hash" PYTHONUNBUFFERED=1
exec "$py" -m orchestrator.agent "$@"
"""

BUNDLE_PUSH = r"""set -eu
mkdir -p "$1/bundle"
tmp="$1/bundle/.$2.zip.$$"
cat > "$tmp"
mv -f "$tmp" "$1/bundle/$2.zip"
"""

# The environment every command inside a container gets (pct resets PATH; --keep-env 0 clears the rest).
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/root/.local/bin"


class _EventStream:
    """Splits agent stdout into lines, parses each as one JSON event, forwards it, keeps the last one."""

    def __init__(self, on_event: EventCallback | None):
        self.on_event = on_event
        self.buf = b""
        self.events_seen = 0
        self.final: dict | None = None
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
            ev = json.loads(text)
        except ValueError:
            self.garbage.append(text)  # a library printed to stdout; keep it for the error message
            return
        self.events_seen += 1
        if ev.get("event") in ("result", "error"):
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
    ) -> dict:
        """Run one agent verb; stream non-final events to on_event; return the result's data.

        Raises:
            AgentError: the agent reported an error event (its type in `.agent_type`), or died without one.
        """
        payload = json.dumps({"workdir": self.workdir, **(request or {})}).encode()
        stream = _EventStream(on_event)
        res = self._run_agent(verb, payload, stream, timeout)
        stream.finish()
        return self._interpret(verb, res, stream)

    def _run_agent(self, verb: str, payload: bytes, stream: _EventStream, timeout: float | None) -> Result:
        return self.transport.run(self.agent_argv(verb), stdin=payload, timeout=timeout, on_stdout=stream.feed)

    def _interpret(self, verb: str, res: Result, stream: _EventStream) -> dict:
        final = stream.final
        if final is not None and final.get("event") == "result":
            return final.get("data") or {}
        if final is not None:
            raise AgentError(
                final.get("message") or f"agent {verb} failed",
                agent_type=final.get("type") or "AgentError",
                fix=final.get("fix"),
            ).with_data(final.get("data") or {})
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

    def close(self) -> None:
        self.transport.close()


@dataclass
class LocalTarget(BaseTarget):
    """A directory on this machine. The agent runs with `python` (the venv profile's interpreter, by default
    the workstation's own) from this source tree, so no bundle is needed."""

    python: str = sys.executable

    def agent_argv(self, verb: str) -> list[str]:
        return [self.python, "-m", "orchestrator.agent", verb]

    def _run_agent(self, verb, payload, stream, timeout):
        from orchestrator.bundle import source_root

        import os

        env = dict(os.environ)
        env["PYTHONPATH"] = str(source_root()) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["DFLASHCTL_WORKDIR"] = self.workdir
        env["PYTHONUNBUFFERED"] = "1"
        from orchestrator.transport.local import LocalTransport

        runner = self.transport if not isinstance(self.transport, LocalTransport) else LocalTransport(env=env)
        return runner.run(self.agent_argv(verb), stdin=payload, timeout=timeout, on_stdout=stream.feed)


@dataclass
class ContainerTarget(BaseTarget):
    """An LXC container: `transport` is a PctTransport (pct exec CTID -- argv over SSH)."""

    home: str = "/root"
    pushes: int = 0  # bundle pushes made by this object (for tests and benchmarks)

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "PATH": CONTAINER_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}

    def wrap(self, argv: list[str]) -> list[str]:
        """argv with the container environment set inside the command itself (pct resets it)."""
        from orchestrator.transport.quoting import with_env

        return with_env(self.env(), argv)

    def agent_argv(self, verb: str) -> list[str]:
        from orchestrator.bundle import build_bundle

        bundle = build_bundle()
        return self.wrap(["bash", "-c", AGENT_BOOTSTRAP, "dflashctl-agent", self.workdir, bundle.hash, verb])

    def push_bundle(self) -> None:
        from orchestrator.bundle import build_bundle

        bundle = build_bundle()
        argv = self.wrap(["bash", "-c", BUNDLE_PUSH, "dflashctl-push", self.workdir, bundle.hash])
        self.transport.run(argv, stdin=bundle.data, timeout=120).check(f"copying the bundle into {self.name}")
        self.pushes += 1

    def _run_agent(self, verb, payload, stream, timeout):
        res = self.transport.run(self.agent_argv(verb), stdin=payload, timeout=timeout, on_stdout=stream.feed)
        if res.exit_code == BUNDLE_MISSING and stream.events_seen == 0:
            # First use of this bundle in this container: copy it in once, then ask again.
            self.push_bundle()
            res = self.transport.run(self.agent_argv(verb), stdin=payload, timeout=timeout, on_stdout=stream.feed)
        if res.exit_code == NO_PYTHON:
            raise RemoteCommandError(
                f"{self.name} has no python3 on PATH", result=res, fix="install python3 in the container (apt-get install -y python3)"
            )
        return res

    def run(self, argv: list[str], **kw) -> Result:
        return self.transport.run(self.wrap(list(argv)), **kw)


# ------------------------------------------------------------------------------------ factory


def open_target(inv, name: str) -> BaseTarget:
    """Build the Target named `name` in the inventory `inv`.

    A local target gets its workdir expanded and created, and the venv profile's interpreter (the
    workstation's own, `sys.executable`, for kind `workstation`; `<workdir>/venvs/current/bin/python` once a
    uv venv exists). A container target gets `PctTransport(SSHTransport(host...), ctid)`; ssh and pct are
    imported here, lazily, so the CLI's `--help` never loads paramiko.

    Args:
        inv: an `orchestrator.inventory.Inventory`.
        name: the target's key under `targets:`.
    Returns:
        A LocalTarget or ContainerTarget (close it when done: it may hold an SSH connection).
    Raises:
        UserError / InventoryError: unsafe or unknown name (with a suggestion), or a local workdir that
            cannot be created.
    """
    from pathlib import Path

    from orchestrator.errors import UserError
    from orchestrator.inventory import ContainerTargetSpec, UvVenv

    spec = inv.target(name)
    if isinstance(spec, ContainerTargetSpec):
        host = inv.host(spec.host)
        return container_target(name, spec, host, ssh_transport(host, spec.host))

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
    from orchestrator.transport.local import LocalTransport

    return LocalTarget(name=name, workdir=str(workdir), transport=LocalTransport(), python=python)


def ssh_transport(host, name: str | None = None):
    """An SSHTransport for an inventory HostSpec named `name` (imported lazily: paramiko is heavy).

    `ssh` is either an ~/.ssh/config alias or a plain hostname; handing it as both lets the SSH layer apply
    any matching ~/.ssh/config block (as `ssh NAME` would), with the explicit fields overriding it.
    """
    import os

    from orchestrator.transport.ssh import SSHTransport

    return SSHTransport(
        host.ssh,
        port=host.port or 22,
        user=host.user,
        identity_file=os.path.expanduser(host.identity_file) if host.identity_file else None,
        known_hosts=os.path.expanduser(host.known_hosts) if host.known_hosts else None,
        ssh_config_alias=host.ssh,
        name=name,
    )


def container_target(name: str, spec, host, ssh) -> "ContainerTarget":
    """A ContainerTarget for an inventory ContainerTargetSpec whose pct calls ride on `ssh` (a Transport
    to the Proxmox host; several callers may share one connection)."""
    from orchestrator.transport.pct import PctTransport

    transport = PctTransport(ssh, spec.ctid, pct=host.pct, sudo=host.sudo)
    return ContainerTarget(name=name, workdir=spec.workdir, transport=transport, home=spec.home)
