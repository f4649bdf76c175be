"""inventory.yaml: hosts, targets, venv profiles, experiments, as pydantic models.

Every error points at the file, the line and the key path, in one readable InventoryError, e.g.

    inventory.yaml:12: experiments.tiny.layuot: unknown key; did you mean 'layout'?

Lookup order (first that exists wins): `--inventory PATH`, `$DFLASHCTL_INVENTORY`, `./inventory.yaml`, the
user config dir (`<platformdirs user_config_dir>/dflashctl/inventory.yaml`), the embedded default shipped
in the package: the repository's top-level inventory.yaml, read through orchestrator.assets as
`templates/inventory.yaml`.

Every name that can reach a shell or a path (host, target, venv, experiment keys; tags, sessions, run ids
given on the command line) follows the one rule of `orchestrator.names`: no slashes, no `..`, no newline,
no shell metacharacters.
"""

from __future__ import annotations

import difflib
import gc
import os
import re
import typing
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from orchestrator import names, quoting
from orchestrator.inventory_file import (  # noqa: F401 - the lookup lives there, light enough for preconnect
    CONTAINER_HOME,
    CONTAINER_WORKDIR,
    EMBEDDED,
    ENV_VAR,
    PCT,
    embedded_text,
    find_inventory,
    read_inventory,
    user_config_path,
)
from orchestrator.errors import InventoryError, UserError
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


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """The closest of `choices` to `word` (difflib), or None when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


# ---------------------------------------------------------------------------------------------- models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


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


class DflashExperiment(_Strict):
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
    trainer: TrainConfig = TrainConfig()
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
    tau_drop_fraction: float = Field(0.2, gt=0, lt=1)
    """Flag a real τ that falls by more than this fraction of the best earlier evaluation."""


class Inventory(_Strict):
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
    _lines: dict = PrivateAttr(default_factory=dict)

    @property
    def source(self) -> str:
        """The file this inventory came from (or EMBEDDED)."""
        return self._source

    def line_of(self, *path: str | int) -> int | None:
        """Line (1-based) of a key path in the source file, e.g. line_of("experiments", "tiny")."""
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

    def venv_for(self, experiment: str) -> tuple[str, WorkstationVenv | SystemVenv | UvVenv]:
        """(profile name, profile) of an experiment: its own `venv`, else its target's."""
        exp = self.experiment(experiment)
        name = exp.venv or self.target(exp.target).venv
        return name, self.venv(name)

    def default_target(self) -> str:
        """The target used when no --target is given: `local` if present, else the only/first one."""
        if "local" in self.targets:
            return "local"
        if self.targets:
            return next(iter(self.targets))
        raise InventoryError(f"{self._source} defines no targets", fix="add a `targets:` section")


# ------------------------------------------------------------------------------------ yaml with lines


# libyaml's C parser and composer (PyYAML's pure-Python composer took ~200 s on a 10 MB inventory); the
# nodes it composes keep their marks, so every error still points at its line.
class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """libyaml's loader whose implicit-tag resolution (Python, once per scalar) is remembered per distinct
    scalar: an inventory repeats the same few values (kinds, hosts, GPU numbers) thousands of times."""

    _tags: dict = {}

    def resolve(self, kind, value, implicit):
        if kind is not yaml.ScalarNode:
            return super().resolve(kind, value, implicit)
        key = (value, implicit)
        tag = self._tags.get(key)
        if tag is None:
            tag = super().resolve(kind, value, implicit)
            if len(self._tags) < 65536:  # bounded: a file of unique values gains nothing from it
                self._tags[key] = tag
        return tag

# What YAML itself refuses as text (YAML 1.1 printable set): C0 controls but TAB, LF, CR; DEL; C1 but NEL;
# surrogates; U+FFFE/U+FFFF. Found here first so the error names the line, not a byte offset.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x84\x86-\x9f\ud800-\udfff\ufffe\uffff]")


def _refuse_unprintable(text: str, source: str) -> None:
    """Raise one InventoryError naming the line and column of the first character YAML cannot hold."""
    m = _UNPRINTABLE.search(text)
    if m is None:
        return
    line = text.count("\n", 0, m.start()) + 1
    column = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
    code = ord(m.group())
    fix = f"delete the character at line {line}, column {column} of {source}"
    if code == 0 and source != EMBEDDED:  # NUL: a whole-file cleanup, runnable as printed
        f = quoting.render([source])
        fix = f"tr -d '\\000' < {f} > {f}.new && mv {f}.new {f}"
    raise InventoryError(
        f"{source}:{line}: control character U+{code:04X}{' (NUL)' if code == 0 else ''} at column {column}; "
        "YAML text cannot hold it", fix=fix)


def _refuse_aliases(text: str, source: str) -> None:
    """Refuse YAML anchors/aliases: one 300-byte alias bomb expands to billions of nodes in every walk over
    the document (line index, validation). No inventory needs them; the error names the first alias's line.

    Only a text with an `&` can define an anchor, so the usual inventory pays nothing; otherwise the C parser's
    events are read once (no nodes built) before anything is composed."""
    if "&" not in text:
        return
    scan = _Loader(text)
    try:
        while scan.check_event():
            event = scan.get_event()
            if isinstance(event, yaml.AliasEvent):
                line = event.start_mark.line + 1
                raise InventoryError(
                    f"{source}:{line}: YAML alias *{event.anchor}: anchors and aliases are not accepted in an "
                    "inventory (a few aliases can expand to billions of entries)",
                    fix=f"write the entry out in full at line {line} of {source} instead of *{event.anchor}",
                )
    finally:
        scan.dispose()


def _compose(text: str, source: str):
    """(node graph with marks, plain data) of the inventory text.

    Raises:
        InventoryError: a control character, a YAML syntax error or an alias, as one `FILE:LINE: what` line.
    """
    _refuse_unprintable(text, source)
    try:
        _refuse_aliases(text, source)
        loader = _Loader(text)
        # The cyclic GC would walk the growing node graph again and again (it holds no cycles until done).
        collecting = gc.isenabled()
        gc.disable()
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
            if collecting:
                gc.enable()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise InventoryError(f"{where}: YAML syntax error: {problem}", fix="fix the YAML at that line") from None
    except yaml.YAMLError as exc:
        raise InventoryError(f"{source}: YAML error: {' '.join(str(exc).split())}",
                             fix=f"fix the YAML in {source}") from None
    return node, data


def _index_lines(node, source: str) -> dict[tuple[str, ...], int]:
    """Map every key path (as strings) to the 1-based line of its key; refuse duplicate keys."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(n, path: tuple[str, ...]) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in n.value:
                key = str(k.value)
                line = k.start_mark.line + 1
                if key in seen:
                    dotted = ".".join((*path, key))
                    raise InventoryError(
                        f"{source}:{line}: {dotted}: duplicate key (first at line {seen[key]})",
                        fix="remove one of the two",
                    )
                seen[key] = line
                lines[(*path, key)] = line
                walk(v, (*path, key))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                lines[(*path, str(i))] = v.start_mark.line + 1
                walk(v, (*path, str(i)))

    if node is not None:
        lines[()] = node.start_mark.line + 1
        walk(node, ())
    return lines


# ------------------------------------------------------------------------------------ error mapping


def _data_path(raw: Any, loc: tuple) -> tuple[list[str], list[str]]:
    """Split a pydantic loc into the path in the YAML data and the discriminator tags it passed through.

    Pydantic inserts the union tag (e.g. 'container') into locs of discriminated unions; the YAML has no
    such key, so it is dropped from the path shown to the user.
    """
    path: list[str] = []
    tags: list[str] = []
    cur = raw
    for comp in loc:
        if isinstance(cur, dict) and comp in cur:
            cur = cur[comp]
            path.append(str(comp))
        elif isinstance(cur, dict) and isinstance(comp, str) and cur.get("kind") == comp:
            tags.append(comp)
        elif isinstance(cur, list) and isinstance(comp, int) and 0 <= comp < len(cur):
            cur = cur[comp]
            path.append(str(comp))
        else:
            path.append(str(comp))
            cur = None
    return path, tags


def _model_at(path: list[str], tags: list[str]):
    """The pydantic model class that owns the last key of `path` (for 'did you mean' on unknown keys)."""
    tp: Any = Inventory
    tag_iter = iter(tags)
    for comp in path[:-1]:
        tp = _unwrap(tp, tag_iter)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            field = tp.model_fields.get(comp)
            if field is None:
                return None
            tp = field.annotation
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        else:
            return None
    tp = _unwrap(tp, tag_iter)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unwrap(tp: Any, tags) -> Any:
    """Strip Annotated/Optional; pick the union member whose `kind` literal is the next tag."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if origin is Union or str(origin) == "types.UnionType":
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
            tag = next(tags, None)
            for m in members:
                kind = getattr(m, "model_fields", {}).get("kind")
                if kind is not None and tag in typing.get_args(kind.annotation):
                    tp = m
                    break
            else:
                return None
            continue
        return tp


def _line_for(lines: dict, path: list[str]) -> int | None:
    """Line of the deepest prefix of `path` that exists in the file (a missing key: its parent's line)."""
    for n in range(len(path), -1, -1):
        line = lines.get(tuple(path[:n]))
        if line is not None:
            return line
    return None


def _format_errors(exc: ValidationError, raw: Any, lines: dict, source: str) -> list[str]:
    out = []
    for err in exc.errors():
        path, tags = _data_path(raw, tuple(err["loc"]))
        if err["type"] == "union_tag_invalid":
            path.append("kind")  # point at the `kind:` line itself
        line = _line_for(lines, path)
        where = f"{source}:{line}" if line else source
        dotted = ".".join(path) or "(top level)"
        etype = err["type"]
        if etype == "extra_forbidden":
            model = _model_at(path, tags)
            fields = [f for f in (model.model_fields if model else {})]
            close = suggest(path[-1], fields) if path else None
            msg = "unknown key" + (f"; did you mean {close!r}?" if close else "")
            if fields and not close:
                msg += f" (allowed: {', '.join(fields)})"
        elif path and path[-1] == "[key]":
            path.pop()
            dotted = ".".join(path)
            msg = f"a name must be text, got {err.get('input')!r}; quote it (\"{err.get('input')}\")"
        elif etype == "missing":
            msg = "required key is missing"
        elif etype == "union_tag_invalid":
            ctx = err.get("ctx", {})
            msg = f"unknown kind {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"
        elif etype == "union_tag_not_found":
            msg = "missing `kind:` (what sort of entry this is)"
        else:
            msg = err["msg"]
            if "input" in err and not isinstance(err["input"], (dict, list)):
                msg += f" (got {err['input']!r})"
        out.append((line or 0, f"{where}: {dotted}: {msg}"))
    return [text for _, text in sorted(out, key=lambda item: item[0])]


# ------------------------------------------------------------------------------------ references


def _check_references(inv: Inventory, lines: dict, source: str) -> list[str]:
    """Names safe, references resolvable, container workdirs absolute, GPU lists disjoint."""
    errs: list[str] = []

    def err(path: tuple[str, ...], msg: str) -> None:
        line = _line_for(lines, list(path))
        errs.append(f"{source}:{line}: {'.'.join(path)}: {msg}" if line else f"{source}: {'.'.join(path)}: {msg}")

    def ref(path: tuple[str, ...], kind: str, name: str, table: dict) -> None:
        if name not in table:
            close = suggest(name, table)
            hint = f"; did you mean {close!r}?" if close else f" (known: {', '.join(sorted(table)) or 'none'})"
            err(path, f"no {kind} named {name!r}{hint}")

    for section in ("hosts", "targets", "venvs", "experiments"):
        for name in getattr(inv, section):
            if not names.is_valid(name):
                err((section, name), f"unsafe name: use 1-{names.NAME_MAX} characters from {names.RULE}")

    for name, h in inv.hosts.items():
        for key in ("ssh", "user"):
            if getattr(h, key) is not None and not names.is_ssh_word(getattr(h, key)):
                err(("hosts", name, key), f"{getattr(h, key)!r} cannot be given to ssh: no leading '-', no spaces")

    for name, t in inv.targets.items():
        ref(("targets", name, "venv"), "venv profile", t.venv, inv.venvs)
        if isinstance(t, ContainerTargetSpec):
            ref(("targets", name, "host"), "host", t.host, inv.hosts)
            wd = PurePosixPath(t.workdir)
            if not wd.is_absolute() or ".." in wd.parts or "\n" in t.workdir:
                err(("targets", name, "workdir"), f"must be an absolute path without '..' (got {t.workdir!r})")
        if isinstance(t, ContainerTargetSpec) and isinstance(inv.venvs.get(t.venv), WorkstationVenv):
            err(("targets", name, "venv"), f"venv profile {t.venv!r} is the workstation's own interpreter, which a "
                "container cannot run; use a `kind: system` profile (the container's python3) or a `kind: uv` one")

    for name, e in inv.experiments.items():
        ref(("experiments", name, "target"), "target", e.target, inv.targets)
        if e.venv is not None:
            ref(("experiments", name, "venv"), "venv profile", e.venv, inv.venvs)
            if isinstance(inv.targets.get(e.target), ContainerTargetSpec) and isinstance(inv.venvs.get(e.venv), WorkstationVenv):
                err(("experiments", name, "venv"), f"venv profile {e.venv!r} is the workstation's own interpreter, "
                    "which a container cannot run; use a `kind: system` profile (the container's python3)")
        if isinstance(e, DflashExperiment) and e.data_venv is not None:
            ref(("experiments", name, "data_venv"), "venv profile", e.data_venv, inv.venvs)
            if isinstance(inv.targets.get(e.target), ContainerTargetSpec) and isinstance(inv.venvs.get(e.data_venv), WorkstationVenv):
                err(("experiments", name, "data_venv"), f"venv profile {e.data_venv!r} is the workstation's own "
                    "interpreter, which a container cannot run; use a `kind: uv` profile (e.g. vllm)")
        if isinstance(e, DflashExperiment) and e.layout.nodes:
            _check_nodes(name, e, inv, err, ref)
        elif isinstance(e, DflashExperiment):
            lay = e.layout
            for key, gpus in (("target_gpus", lay.target_gpus), ("drafter_gpus", lay.drafter_gpus)):
                dup = sorted({g for g in gpus if gpus.count(g) > 1})
                if dup:
                    err(("experiments", name, "layout", key), f"GPU {dup} listed twice")
            both = sorted(set(lay.target_gpus) & set(lay.drafter_gpus))
            if both:
                err(("experiments", name, "layout"), f"GPU {both} is in both target_gpus and drafter_gpus")
            if bool(lay.target_gpus) != bool(lay.drafter_gpus):
                err(
                    ("experiments", name, "layout"),
                    "give both target_gpus and drafter_gpus, or neither (colocated on the CPU)",
                )
        else:
            dup = sorted({g for g in e.gpus if e.gpus.count(g) > 1})
            if dup:
                err(("experiments", name, "gpus"), f"GPU {dup} listed twice")
            for key in e.env:
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                    err(("experiments", name, "env", key), "not a valid environment variable name")
    return errs


def _check_nodes(name: str, e, inv: Inventory, err, ref) -> None:
    """A layout across targets: every node a known container target, each once, node 0 the experiment's
    target, one kind of venv lock, and the layout itself valid as the trainer sees it (trainer.layout, the one
    rule: its message names `nodes[i]`, and the error points at that node's line). Errors go through `err`."""
    at = ("experiments", name, "layout")
    nodes = e.layout.nodes
    seen: dict[str, int] = {}
    for i, n in enumerate(nodes):
        ref((*at, "nodes", str(i), "target"), "target", n.target, inv.targets)
        if n.target in seen:
            err((*at, "nodes", str(i), "target"), f"target {n.target!r} is already node {seen[n.target]}: each node "
                "is its own target (list all of a target's GPUs in one node)")
        seen.setdefault(n.target, i)
        if len(nodes) > 1 and n.target in inv.targets and not isinstance(inv.targets[n.target], ContainerTargetSpec):
            err((*at, "nodes", str(i), "target"), f"target {n.target!r} is not a container: every node of a layout "
                "across targets is a container (`kind: container`)")
    if nodes[0].target != e.target:
        err(("experiments", name, "target"), f"{e.target!r} is not node 0's target {nodes[0].target!r}: the "
            f"experiment's target is the first node (where the rendezvous runs); set target: {nodes[0].target}")
    if e.layout.target_gpus or e.layout.drafter_gpus:
        err(at, "with `nodes`, list every GPU under its node and drop the top-level target_gpus/drafter_gpus")
        return
    from trainer.config import ConfigError, parse_config

    try:
        parse_config({"layout": trainer_layout(e.layout)}, source="layout")
    except ConfigError as exc:
        text = str(exc)
        m = re.search(r"nodes\[(\d+)\]", text)
        where = (*at, "nodes", m.group(1)) if m else (*at, "rendezvous") if "rendezvous" in text else at
        for line in text.splitlines():  # "layout: <loc>: Value error, <the trainer's message>"
            err(where, re.sub(r"^layout: [\w.]+: (Value error, )?", "", line.strip()))


def trainer_layout(layout: Layout) -> dict:
    """The trainer's `layout` section for an inventory layout across targets (nodes named by their target)."""
    nodes = [{"target_gpus": n.target_gpus, "drafter_gpus": n.drafter_gpus, "num_target_procs": n.num_target_procs,
              "num_drafter_procs": n.num_drafter_procs, "name": n.target, "addr": n.addr} for n in layout.nodes]
    return {"nodes": nodes, "rendezvous": layout.rendezvous}


# ------------------------------------------------------------------------------------ loading


def parse_inventory(text: str, source: str = "inventory.yaml") -> Inventory:
    """Parse and validate inventory text. `source` is the name used in error messages.

    Raises:
        InventoryError: syntax, unknown keys, wrong types, bad names, dangling references; every problem
            on its own line as `FILE:LINE: key.path: what` (all of them, not just the first).
    """
    node, raw = _compose(text, source)
    lines = _index_lines(node, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InventoryError(f"{source}:1: the top level must be a mapping (hosts:, targets:, ...)")
    try:
        inv = Inventory.model_validate(raw)
    except ValidationError as exc:
        msgs = _format_errors(exc, raw, lines, source)
        raise InventoryError("\n".join(msgs), fix=f"edit {source} at the line shown") from None
    # The workstation's own interpreter needs no settings, so it is always there (a minimal inventory with
    # only a local target must not fail on a venv profile it never mentioned).
    inv.venvs.setdefault("workstation", WorkstationVenv(kind="workstation"))
    errs = _check_references(inv, lines, source)
    if errs:
        raise InventoryError("\n".join(errs), fix=f"edit {source} at the line shown")
    inv._source = source
    inv._lines = lines
    return inv


def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    """Load the inventory by the lookup order (see the module docstring).

    Args:
        path: the `--inventory` value, or None.
    Returns:
        The validated Inventory; `.source` names the file (or EMBEDDED).
    Raises:
        InventoryError: missing explicit file, unreadable file, or invalid content (file:line: key: what).
    """
    return parse_inventory(*read_inventory(path))
