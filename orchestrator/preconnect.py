"""A command's SSH connection, started while the inventory is still being validated.

Validating the inventory (pydantic) and importing the SSH stack cost a few hundred milliseconds on the
workstation; opening the connection waits mostly on the host (sshd start, key exchange, authentication).
So a command that will reach a container starts a thread at once, from its command line
(orchestrator.commands.early, before typer's parse): it reads the inventory's raw YAML, finds the host of the
command's target and connects; the main thread waits for that (see `start`) and then validates the inventory.
`open_target` then takes the connection if the validated host has exactly the settings the thread
used (else the thread's connection is closed and a fresh one is made), and an error the thread met
(unknown host key, refused, ...) is raised there as if the connection had been opened then.
Anything the raw read cannot make sense of just means no early connection: validation reports it.

A command that knows its one agent call (launch) also has the thread START that call once connected: the
container enters pct, starts Python and imports the verb (a good part of a second on a Proxmox host) while
the workstation still validates and builds the request. The agent reads its request from stdin, so the
started call simply waits for it. open_target hands the started call to the Target, whose next agent call
finishes it when its command line is exactly the one started (same container, workdir, bundle, verb); any
other is dropped unfinished, and a dropped agent reads end-of-file instead of a request and runs nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from orchestrator.errors import DflashError
from orchestrator.inventory_file import CONTAINER_HOME, CONTAINER_WORKDIR, PCT, cache_dir, read_inventory
from orchestrator.transport.ssh import SETTINGS, SSHSettings

READY_WAIT_S = 0.5
"""How long a command waits for its early connection (and agent call) before it goes on with its own work."""


@dataclass(frozen=True)
class EarlyAgent:
    """The agent call to start early: the verb, and the container target as the raw inventory describes it
    (the fields orchestrator.target.container_target reads, with the inventory's defaults)."""

    verb: str
    target: str
    ctid: int
    workdir: str = CONTAINER_WORKDIR
    home: str = CONTAINER_HOME
    pct: str = PCT
    sudo: bool = False


class EarlyConnection:
    """One background connection attempt (and agent call, when `agent` is given); `take` and `take_agent`
    hand them over once (see the module docstring)."""

    def __init__(self, key: SSHSettings, agent: EarlyAgent | None = None):
        self.key = key
        self.agent = agent
        self._transport = None
        self._started = None
        self._error: BaseException | None = None
        self.ready = threading.Event()  # connected and the agent call started, or failed (see start)
        self._thread = threading.Thread(target=self._connect, name="dflashctl-preconnect", daemon=True)
        self._thread.start()

    def _connect(self) -> None:
        try:
            self._open()
        finally:
            self.ready.set()

    def _open(self) -> None:
        try:
            self._prepare()
        except BaseException as exc:  # take() returns None for it: the command connects and reports it itself
            self._error = exc
            return
        transport = self.key.transport()
        try:
            transport.connect()
        except BaseException as exc:  # handed to the main thread by take()
            transport.close()
            self._error = exc
            return
        self._transport = transport
        if self.agent is not None:
            self._start_agent(transport)

    def _prepare(self) -> None:
        """The thread's CPU work before it waits on the network: the SSH stack's imports and, for an agent
        call, the bundle's hash and the modules that start it (the target, pct, the workstation's records).
        Imported here, while the command waits: imported after the connection, they would wait for the GIL
        while the command imports its own modules, and the agent would start that much later."""
        from orchestrator.transport.sshimport import import_ssh_stack

        import_ssh_stack()
        if self.agent is not None:
            from orchestrator import target  # noqa: F401 - with transport.pct and records: what starts the call
            from orchestrator.bundle import build_bundle

            build_bundle()

    def _start_agent(self, transport) -> None:
        from orchestrator.target import container_target

        try:
            a = self.agent  # the target's fields and the host's pct/sudo, as container_target reads them
            self._started = container_target(a.target, a, a, transport).start_agent(a.verb)
        except Exception:  # noqa: BLE001 - no early call: the command's own call meets the problem and reports it
            self._started = None

    def take_agent(self):
        """The agent call started early (a transport Started), once; None when none was started. Only for the
        caller that took the connection (it rides on it)."""
        self._thread.join()
        started, self._started = self._started, None
        return started

    def take(self, name: str, host):
        """The connected SSHTransport if it was made for host `name` with `host`'s connection fields (an
        inventory HostSpec, or SSHSettings), else None (and it is closed).

        Raises:
            DflashError: the connection for `key` failed (ConnectError, HostKeyError) in the thread.
        """
        key = SSHSettings.of(name, host)
        self._thread.join()
        transport, error = self._transport, self._error
        self._transport = self._error = None
        if key != self.key:
            self._started = None  # it rode on the connection closed here
            if transport is not None:
                transport.close()
            return None
        if isinstance(error, DflashError):
            raise error
        return transport  # None after any other error: the caller connects again and reports it

    def close(self) -> None:
        """Close a connection nobody took (the command ended first, or failed)."""
        self._thread.join()
        self._started = None  # closing the connection drops it: the agent reads end-of-file, runs nothing
        if self._transport is not None:
            self._transport.close()
            self._transport = None


def start(inventory: str | None, target: str | None, experiment: str | None = None,
          verb: str | None = None) -> EarlyConnection | None:
    """Start connecting to the host of `target` (else the experiment's target) when it is a container; with
    `verb`, also start that agent call in the container once connected. Returns once the connection is made
    and the agent call started (or either failed), or after READY_WAIT_S.

    Returns None when the raw inventory names no such container target, or cannot be read: the command
    then connects as usual and validation reports any problem.
    """
    found = _host_key(inventory, target, experiment)
    if found is None:
        return None
    key, name, spec, host = found
    early = EarlyConnection(key, _early_agent(verb, name, spec, host) if verb else None)
    # Two threads of one process share one CPU (the GIL). The thread's work (paramiko's imports, the key
    # exchange and authentication, opening the channel) is CPU between waits on the host; done side by side
    # with the command's own imports and validation it took twice as long, and the container started the
    # agent that much later. What the container does next (pct, Python, the agent's imports: half a second
    # on a Proxmox host) outlasts the command's own work, so the command waits until the call is started,
    # up to READY_WAIT_S (a slow host: the command's work overlaps the rest of the wait).
    early.ready.wait(READY_WAIT_S)
    return early


def _early_agent(verb: str, target: str, spec: dict, host: dict) -> EarlyAgent | None:
    """The EarlyAgent of a raw target and host entry; None when a field is not of its type (validation will
    say so)."""
    fields = {"ctid": spec.get("ctid"), "workdir": spec.get("workdir", CONTAINER_WORKDIR),
              "home": spec.get("home", CONTAINER_HOME), "pct": host.get("pct", PCT), "sudo": host.get("sudo", False)}
    types = {"ctid": int, "workdir": str, "home": str, "pct": str, "sudo": bool}
    if any(type(fields[k]) is not t for k, t in types.items()):  # noqa: E721 - exact: a bool is no ctid
        return None
    return EarlyAgent(verb, target, **fields)


def _host_key(inventory: str | None, target: str | None, experiment: str | None):
    """(SSHSettings, target name, raw target entry, raw host entry) of the container target, else None."""
    try:
        # The command's own first pass, its data lent to the command's load, which takes it instead of parsing
        # again (and the cache's, where the command's load would look): a large inventory is read once.
        from orchestrator import yamlload

        text, source = read_inventory(inventory)
        raw = yamlload.load_plain(text, source, cache_dir=cache_dir(), lend=True)
        if target is None:
            target = raw["experiments"][experiment]["target"]
        spec = raw["targets"][target]
        if spec.get("kind") != "container":
            return None
        name = spec["host"]
        host = raw["hosts"][name]
        key = SSHSettings(name, *(host.get(f) for f in SETTINGS))
    except Exception:  # noqa: BLE001 - any surprise: no early connection, validation will say what is wrong
        return None
    if not isinstance(key.ssh, str) or not all(isinstance(getattr(key, f), (str, type(None))) for f in SETTINGS[2:]):
        return None
    if key.port is not None and (not isinstance(key.port, int) or isinstance(key.port, bool)):
        return None
    return key, target, spec, host
