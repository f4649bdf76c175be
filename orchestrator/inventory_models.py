"""inventory.yaml's models: hosts, targets, venv profiles, experiments, notifications and thresholds (pydantic).

What the fields mean and their defaults live here, with the lookups of an Inventory by name (`experiment`,
`target`, `venv`, `host`: an unknown name gets the closest one as a suggestion). Loading a file and placing
its errors at FILE:LINE is orchestrator.located's; the checks across sections (references, names, GPU lists)
are orchestrator.inventory_refs'; orchestrator.inventory puts the three together.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from orchestrator import located, names
from orchestrator.errors import InventoryError, UserError
from orchestrator.inventory_file import CONTAINER_HOME, CONTAINER_WORKDIR, EMBEDDED, PCT
from orchestrator.located import suggest

if TYPE_CHECKING:
    from trainer.config import TrainConfig


def check_name(kind: str, value: str) -> str:
    """Return `value` if it is a valid `kind` name (experiment, target, tag, host, venv ...): names.check.

    Raises:
        UserError: the name is empty, too long, has `..`, or any character outside [A-Za-z0-9._-].
    """
    try:
        return names.check(kind, value)
    except names.BadName as exc:
        raise UserError(exc.message, fix=exc.fix) from None


def check_run_ref(value: str, kind: str = "run id") -> str:
    """Return `value` if it can name a run (a run id, its prefix, or an experiment): names.check_run_id.

    Raises:
        UserError: it breaks the name rule or is longer than the longest run id launch can make.
    """
    try:
        return names.check_run_id(value, kind)
    except names.BadName as exc:
        raise UserError(exc.message, fix=exc.fix) from None


# ---------------------------------------------------------------------------------------------- models


class _Strict(BaseModel):
    # defer_build: the validators are built on first use (`complete`), not when the module is imported: a
    # command that never validates an inventory does not pay for them (nor for importing trainer.config).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, defer_build=True)


def complete() -> None:
    """Make the models usable (once per process): bind TrainConfig, whose import builds the trainer config's
    own validators, for DflashExperiment's `trainer` field, and build the Inventory's validator. Called by
    orchestrator.inventory before it validates anything."""
    if Inventory.__pydantic_complete__:
        return
    from trainer.config import TrainConfig

    globals()["TrainConfig"] = TrainConfig  # the name `trainer: TrainConfig` is resolved by, at build time
    DflashExperiment.model_rebuild()  # its fields' types resolved (located's "did you mean" walks them)
    Inventory.model_rebuild()


def _train_config() -> TrainConfig:
    from trainer.config import TrainConfig

    return TrainConfig()


class HostSpec(_Strict):
    """A Proxmox VE host reached by SSH."""

    ssh: str
    """An `~/.ssh/config` alias, or a hostname / IP address."""
    port: int | None = Field(None, ge=1, le=65535)
    """SSH port (default: from ~/.ssh/config, else 22)."""
    user: str | None = None
    """SSH user (default: from ~/.ssh/config, else the local user). Not root: set `sudo: true`."""
    identity_file: str | None = None
    """Private key file (default: ssh-agent and the usual ~/.ssh/id_* keys)."""
    known_hosts: str | None = None
    """known_hosts file to trust and record keys in (default: ~/.ssh/known_hosts)."""
    pct: str = PCT
    """The pct command on the host (an absolute path if the login PATH lacks /usr/sbin)."""
    sudo: bool = False
    """Run pct through `sudo -n` (for a non-root user with passwordless sudo for pct)."""


class LocalTargetSpec(_Strict):
    """A directory on this machine; the agent runs with the venv profile's interpreter."""

    kind: Literal["local"]
    """`local`: runs here, no SSH, no Proxmox."""
    workdir: str | None = None
    """Working directory (`~` and $VARS expanded; created on use). Default: the user data dir."""
    venv: str = "workstation"
    """Venv profile name (key of `venvs:`)."""

    def resolved_workdir(self) -> Path:
        """The workdir with `~` and $VARS expanded; the platformdirs user data dir when not set."""
        if self.workdir:
            return Path(os.path.expandvars(os.path.expanduser(self.workdir)))
        import platformdirs

        return Path(platformdirs.user_data_dir("dflashctl")) / "local"


class ContainerTargetSpec(_Strict):
    """An LXC container on a Proxmox host, reached as `ssh HOST pct exec CTID -- ...`."""

    kind: Literal["container"]
    """`container`: an LXC container on a Proxmox host."""
    host: str
    """Host name (key of `hosts:`)."""
    ctid: int = Field(ge=100, le=999_999_999)
    """Container id (Proxmox VMIDs start at 100)."""
    workdir: str = CONTAINER_WORKDIR
    """Absolute working directory inside the container (runs/, venvs/, bundle/, uv-cache/)."""
    venv: str = "cuda"
    """Venv profile name (key of `venvs:`)."""
    gpu_idle_mib: int = Field(1024, ge=0)
    """A GPU using less memory than this (MiB) counts as idle for launch preflight."""
    home: str = CONTAINER_HOME
    """HOME inside the container (pct does not set it)."""


TargetSpec = Annotated[Union[LocalTargetSpec, ContainerTargetSpec], Field(discriminator="kind")]


class WorkstationVenv(_Strict):
    """The workstation's own interpreter (sys.executable); for the local target only."""

    kind: Literal["workstation"]
    """`workstation`: use the interpreter running dflashctl."""


class SystemVenv(_Strict):
    """The target's own `python3` as it is (no venv, nothing built, no lock compared); for `command`
    experiments, e.g. on a container whose python3 has what the command needs."""

    kind: Literal["system"]
    """`system`: the target's python3 on PATH, as is."""


class UvVenv(_Strict):
    """A venv built by uv from a lock, inside the target (`<workdir>/venvs/<lock-hash>-<time>/`)."""

    kind: Literal["uv"]
    """`uv`: built with `uv venv` + `uv pip sync` from the lock."""
    python: str = "3.11"
    """Python version uv provides for the venv."""
    lock: str = "cuda"
    """`cpu`, `cuda` (locks shipped in templates/locks/) or a path to a requirements lock file."""
    uv_cache_dir: str | None = None
    """uv cache directory inside the target (default `<workdir>/uv-cache`)."""
    find_links: list[str] = []
    """Extra `--find-links` locations (wheel directories or URLs)."""
    index_url: str | None = None
    """Replaces the default package index (`--index-url`)."""
    extra_index_urls: list[str] = []
    """Extra indexes (`--extra-index-url`), e.g. the PyTorch CUDA index."""
    keep: int = Field(3, ge=1)
    """Old venvs kept for `rebuild-venv --rollback`."""
    wheelhouse: list[str] = []
    """Directories on THIS workstation: each wheel there that the lock pins (same version and hash) goes to
    the target with rebuild-venv (once; the target keeps it beside its uv cache), so a target without a
    network can build the venv when every wheel of the lock is here."""


VenvSpec = Annotated[Union[WorkstationVenv, SystemVenv, UvVenv], Field(discriminator="kind")]


class NodeLayout(_Strict):
    """One node of a layout across targets: a target (container) and the GPUs its processes use there."""

    target: str
    """Target name (key of `targets:`): the container this node runs in."""
    target_gpus: list[Annotated[int, Field(ge=0)]] = []
    """GPUs of THIS target (its nvidia-smi indexes) running the frozen target model."""
    drafter_gpus: list[Annotated[int, Field(ge=0)]] = []
    """GPUs of this target training the drafter. A node may have only target or only drafter GPUs."""
    num_target_procs: int = Field(0, ge=0)
    """CPU only (no GPUs anywhere in the layout): target processes on this node (the tests, the demo)."""
    num_drafter_procs: int = Field(0, ge=0)
    """CPU only: drafter processes on this node."""
    addr: str | None = None
    """The address the other nodes reach this target at (default: node 0 the rendezvous host, the others
    their host name, which must then resolve on every node)."""

    @property
    def gpus(self) -> list[int]:
        return [*self.target_gpus, *self.drafter_gpus]


class Layout(_Strict):
    """Which GPUs (nvidia-smi indexes in the container) run the frozen target and which train the drafter."""

    target_gpus: list[Annotated[int, Field(ge=0)]] = []
    """GPUs running the frozen target model (one process each)."""
    drafter_gpus: list[Annotated[int, Field(ge=0)]] = []
    """GPUs training the drafter (one DDP process each). Both empty: one colocated CPU process."""
    nodes: list[NodeLayout] = []
    """A layout across targets: one entry per target (node), node 0 first; then the two lists above stay
    empty. See "Layouts across targets" in the README for the networking this needs."""
    rendezvous: str | None = None
    """HOST:PORT of node 0 (the first entry of `nodes`) where the other nodes meet it: the address they
    reach its container at and a free TCP port there (e.g. 10.0.0.200:29400)."""

    @property
    def colocated(self) -> bool:
        """True for the CPU layout: no GPUs, target and drafter in one process."""
        return not self.target_gpus and not self.drafter_gpus and not self.nodes

    @property
    def gpus(self) -> list[int]:
        """All GPUs of the layout, target first (one node; across nodes: node 0's)."""
        if self.nodes:
            return self.nodes[0].gpus
        return [*self.target_gpus, *self.drafter_gpus]

    def node_targets(self) -> list[str]:
        """The target of every node, node 0 first ([] without `nodes`)."""
        return [n.target for n in self.nodes]


class _NeedsTrainer(_Strict):
    """A model whose validator needs TrainConfig: `complete` runs before its first construction or validation,
    however it is reached (orchestrator.inventory calls it too)."""

    def __init__(self, **data: Any):
        complete()
        super().__init__(**data)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any):
        complete()
        return super().model_validate(obj, **kwargs)


class DflashExperiment(_NeedsTrainer):
    """Train a DFlash drafter with the bundled trainer."""

    kind: Literal["dflash"]
    """`dflash`: the bundled trainer (`python -m trainer.launch`: one process per GPU of `layout`)."""
    target: str
    """Target name (key of `targets:`)."""
    venv: str | None = None
    """Venv profile (default: the target's)."""
    data_venv: str | None = None
    """Venv profile the data stage (`python -m trainer regenerate`) runs in, e.g. `vllm` for
    trainer.data.regenerate_engine: vllm (vLLM pins its own torch); default: the training venv."""
    layout: Layout = Layout()
    """GPU layout; empty lists: colocated on the CPU."""
    trainer: TrainConfig = Field(default_factory=_train_config)
    """The trainer config (trainer/config.py TrainConfig); written to runs/<id>/config.json."""

    @property
    def gpus(self) -> list[int]:
        """Every GPU the experiment occupies."""
        return self.layout.gpus


class SecretEnv(_Strict):
    """An environment value read from THIS workstation's environment at launch (an API key, a token): it
    reaches the run through the agent's stdin and never a record, a log, the dry-run plan or a file that stays
    on disk (orchestrator.agent.runcommand.SECRET_FILE)."""

    secret: Literal[True]
    """`true`: the value is secret."""
    from_env: str | None = None
    """The workstation's variable to read (default: the same name)."""


def resolve_env(env: dict, where: str) -> tuple[dict[str, str], list[str]]:
    """(every value as text, the names of the secret ones) of an experiment's `env`, the secrets read from
    this process's environment now.

    Raises:
        UserError: a secret's variable is not set here (names it, `where` and the export that fixes it).
    """
    out: dict[str, str] = {}
    secret: list[str] = []
    for key, value in env.items():
        if isinstance(value, SecretEnv):
            var = value.from_env or key
            if var not in os.environ:
                raise UserError(f"{where}.env.{key} is secret (read from this workstation's ${var} at launch), "
                                f"but ${var} is not set", fix=f"export {var}=... in this shell, then launch again")
            out[key] = os.environ[var]
            secret.append(key)
        else:
            out[key] = value
    return out, secret


class CommandExperiment(_Strict):
    """Any training command (bring your own trainer), run in tmux with the same run directory."""

    kind: Literal["command"]
    """`command`: run `command` as given."""
    target: str
    """Target name (key of `targets:`)."""
    venv: str | None = None
    """Venv profile (default: the target's)."""
    command: list[str] = Field(min_length=1)
    """The argv to run (no shell; use ["bash", "-c", "..."] for one)."""
    gpus: list[Annotated[int, Field(ge=0)]] = []
    """GPUs it uses (sets CUDA_VISIBLE_DEVICES; checked idle before launch)."""
    env: dict[str, Union[str, SecretEnv]] = {}
    """Extra environment variables; `NAME: {secret: true}` takes NAME's value from the workstation's
    environment at launch and keeps it out of every record, log and plan."""


ExperimentSpec = Annotated[Union[DflashExperiment, CommandExperiment], Field(discriminator="kind")]


class Notify(_Strict):
    """Where the follower reports a finished or crashed run."""

    webhook: str | None = None
    """URL that receives a JSON POST."""
    command: list[str] | None = None
    """argv run on the workstation with the event as JSON on stdin."""


class Monitor(_Strict):
    """Thresholds of the log follower's health checks."""

    regression_fraction: float = Field(0.7, gt=0, le=1)
    """Flag tokens/s below this fraction of the last good run."""
    regression_seconds: float = Field(300, gt=0)
    """...sustained for this long."""
    hang_seconds: float = Field(600, gt=0)
    """A live session whose log is silent this long is a hang."""
    memory_growth_seconds: float = Field(600, gt=0)
    """Window over which steady memory growth is flagged."""
    tau_near_one: float = Field(1.25, ge=1)
    """Flag a real τ at or below this during training while the token accuracy rises (a train/serve mismatch)."""
    tau_sim_ratio: float = Field(0.5, gt=0, lt=1)
    """Flag a real τ below this fraction of the training's simulated τ (sim_tau) while the accuracy rises."""
    tau_drop_fraction: float = Field(0.2, gt=0, lt=1)
    """Flag a real τ that falls by more than this fraction of the best earlier evaluation."""


class Inventory(_NeedsTrainer):
    """The whole inventory.yaml."""

    hosts: dict[str, HostSpec] = {}
    """Proxmox hosts by name."""
    targets: dict[str, TargetSpec] = {}
    """Targets (local directories or containers) by name."""
    venvs: dict[str, VenvSpec] = {}
    """Venv profiles by name."""
    experiments: dict[str, ExperimentSpec] = {}
    """Experiments by name."""
    notify: Notify = Notify()
    """Notifications."""
    signatures: list[dict[str, Any]] = []
    """Extra crash-signature catalogue entries (same shape as templates/signatures.yaml)."""
    monitor: Monitor = Monitor()
    """Follower thresholds."""

    _source: str = PrivateAttr(default=EMBEDDED)
    _text: str | None = PrivateAttr(default=None)
    _lines: dict | None = PrivateAttr(default=None)

    def from_source(self, source: str, text: str | None, lines: located.Lines | None = None) -> Inventory:
        """This inventory, told the file it came from and its text (line_of reads the lines from it when
        first asked, or uses `lines` when the loader already had them). Returns self."""
        self._source, self._text, self._lines = source, text, lines
        return self

    @property
    def source(self) -> str:
        """The file this inventory came from (or EMBEDDED)."""
        return self._source

    def line_of(self, *path: str | int) -> int | None:
        """Line (1-based) of a key path in the source file, e.g. line_of("experiments", "tiny"): the second,
        located pass over the text (located.key_lines), made once, when first asked."""
        if self._lines is None:
            self._lines = located.key_lines(self._text, self._source) if self._text is not None else {}
        return self._lines.get(tuple(str(p) for p in path))

    def _lookup(self, kind: str, table: dict, name: str, fix_cmd: str):
        check_name(kind, name)
        if name in table:
            return table[name]
        close = suggest(name, table)
        hint = f"; did you mean {close!r}?" if close else ""
        known = ", ".join(sorted(table)) or "none"
        raise InventoryError(
            f"no {kind} {name!r} in {self._source}{hint} (known: {known})",
            fix=f"{fix_cmd} {close}" if close else f"add it under `{kind}s:` in {self._source}",
        )

    def experiment(self, name: str) -> DflashExperiment | CommandExperiment:
        """The experiment `name`.

        Raises:
            UserError: unsafe name. InventoryError: unknown (with the closest name as a suggestion).
        """
        return self._lookup("experiment", self.experiments, name, "dflashctl launch")

    def target(self, name: str) -> LocalTargetSpec | ContainerTargetSpec:
        """The target `name` (raises like `experiment`)."""
        return self._lookup("target", self.targets, name, "--target")

    def venv(self, name: str) -> WorkstationVenv | SystemVenv | UvVenv:
        """The venv profile `name` (raises like `experiment`)."""
        return self._lookup("venv", self.venvs, name, "--profile")

    def host(self, name: str) -> HostSpec:
        """The host `name` (raises like `experiment`)."""
        return self._lookup("host", self.hosts, name, "dflashctl trust")

    def default_target(self) -> str:
        """The target used when no --target is given: `local` if present, else the only/first one."""
        if "local" in self.targets:
            return "local"
        if self.targets:
            return next(iter(self.targets))
        raise InventoryError(f"{self._source} defines no targets", fix="add a `targets:` section")


def trainer_layout(layout: Layout) -> dict:
    """The trainer's `layout` section for an inventory layout across targets (nodes named by their target)."""
    nodes = [{"target_gpus": n.target_gpus, "drafter_gpus": n.drafter_gpus, "num_target_procs": n.num_target_procs,
              "num_drafter_procs": n.num_drafter_procs, "name": n.target, "addr": n.addr} for n in layout.nodes]
    return {"nodes": nodes, "rendezvous": layout.rendezvous}
