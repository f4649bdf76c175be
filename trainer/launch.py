"""`python -m trainer.launch --config FILE [--resume RUN_DIR]`: every layout's ranks under torch's elastic launcher.

This process is the node's elastic agent (`torch.distributed.launcher.api.elastic_launch`, what `torchrun`
runs): it joins a c10d rendezvous, starts `python -m trainer.rank --config FILE` once per rank of the node,
watches them, stops the others when one fails, and restarts them all up to `max_restarts` times (each restart
resumes from the newest complete checkpoint). Every layout goes through it, the colocated one too (one rank).
One node: the rendezvous on 127.0.0.1, port chosen by the agent. A layout across nodes (`layout.nodes`) runs
one such agent per node, `--node I` on node I, all against node 0's `layout.rendezvous` (HOST:PORT), which
node 0's agent hosts (`Node`); each agent starts its node's ranks, and a failure on any node ends every
node's agent (the ranks of the others lose their peers, torch ends the rendezvous).

Output: the agent tees each rank's stdout and stderr into <run>/ranks/ and prints every line here with the
prefix `[rank N] ` (its log-line prefix template), across nodes `[node I local rank L] ` (torch's RANK is not
the layout's rank there; the launcher prints the mapping first). When the run fails, the launcher ranks the agent's
failures (trainer.failures), writes <run>/root_cause.json and prints one block, `[launch] run failed: ...`,
with the root cause's traceback from its error file.

A root cause that only lost a peer on another node (a PeerLostError naming that rank) is reported as that
node's loss: `lost rank R (drafter, node 1 (ct201), ...)`, in root_cause.json's `lost`.

A run whose config asks for the vLLM evaluation (evaluation.engine: vllm) needs a vLLM interpreter in
$DFLASH_VLLM_PYTHON (dflashctl passes the experiment's data venv) and is refused (exit 2) before any rank
starts without one. Once every rank has finished, the node that holds the export judges it there
(`judge_in_vllm`: `python -m trainer eval --engine vllm` in that interpreter, on the end-of-training
evaluation's prompts and numbers); a lossy output or a prompt beyond evaluation.vllm_tolerance fails the run
(exit 1), naming the prompts.

`--resume RUN_DIR` continues RUN_DIR from its newest complete checkpoint (config: --config, else
RUN_DIR/config.json). Exit codes: 0 done; 2 bad config, layout or data, or nothing to resume (the message
says what to fix); the root-cause rank's exit code (1 when it was killed by a signal); 128 + N when this
process was stopped by signal N (the ranks are stopped with it). A rank dies with this process, also when it is
SIGKILLed (trainer.rank.die_with_launcher).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from trainer.atomic import write_json
from trainer.config import ConfigError, TrainConfig, load_config, parse_endpoint
from trainer.distributed import NODE_ENV
from trainer.layout import Layout
from trainer.rank import LAUNCHER_PID_ENV

SHUTDOWN_TIMEOUT_S = 10
"""Seconds the agent gives the other ranks between SIGTERM and SIGKILL after a failure or a stop."""

RANK_PREFIX = "[rank ${rank}] "
"""The agent's log-line prefix template for the ranks' output (torch substitutes ${rank})."""

NODE_RANK_PREFIX = "[node {node} local rank ${{local_rank}}] "
"""The prefix across nodes (torch's ${rank} follows its own node order, not the layout's)."""

JOIN_TIMEOUT_S = 300
"""Seconds an agent waits for every node to join the rendezvous (torch's default is 600)."""


class LaunchError(RuntimeError):
    """The run cannot be launched as asked; the message says what to change."""


@dataclass(frozen=True)
class Node:
    """This agent's place among the nodes of a run.

    Attributes:
        index: the node's position in the layout (0: the node that hosts the rendezvous).
        count: nodes in the run; the rendezvous waits for all of them.
        rdzv_endpoint: host:port of the c10d rendezvous, reachable from every node (one node: 127.0.0.1:0,
            the agent picks a free port).
        local_addr: this node's address as the other nodes reach it (the store of the ranks lives on the
            node torch numbers first); None: its FQDN (one node: 127.0.0.1, so a container whose host name does
            not resolve still works).
    """

    index: int = 0
    count: int = 1
    rdzv_endpoint: str = "127.0.0.1:0"
    local_addr: str | None = "127.0.0.1"


def node_of(cfg: TrainConfig, index: int) -> Node:
    """Node `index` of the config's layout, with the rendezvous it joins (pure).

    Raises:
        LaunchError: `index` is not a node of the layout.
    """
    count = cfg.layout.to_layout().num_nodes
    if not 0 <= index < count:
        raise LaunchError(f"--node {index}: the layout has {count} node(s), numbered 0..{count - 1}")
    if count == 1:
        return Node()
    host, port = parse_endpoint(cfg.layout.rendezvous or "")
    own = cfg.layout.nodes[index].addr
    return Node(index, count, f"{host}:{port}", own or (host if index == 0 else None))


def launch_config(cfg: TrainConfig, layout: Layout, run_dir: Path, node: Node = Node()):
    """The elastic agent's configuration for this node (pure: nothing starts).

    Raises:
        LaunchError: the node is not one of the layout's.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    if node.count != layout.num_nodes:
        raise LaunchError(f"node {node.index} of {node.count}, but the layout has {layout.num_nodes} node(s)")
    many = node.count > 1
    return LaunchConfig(
        min_nodes=node.count,
        max_nodes=node.count,
        nproc_per_node=len(layout.node_ranks(node.index)),
        # Every node of a run must use the same id: the run directory's name is it (dflashctl gives each node's
        # run directory the run id; by hand, name every node's output_dir alike, or the nodes never meet).
        run_id=run_dir.name,
        rdzv_backend="c10d",
        rdzv_endpoint=node.rdzv_endpoint,
        # Node 0 hosts the rendezvous store, explicitly: where the nodes share an address (containers on
        # one network namespace) torch's guess from the host name would make every node try to host it.
        rdzv_configs={"is_host": node.index == 0, "join_timeout": JOIN_TIMEOUT_S} if many else {},
        local_addr=node.local_addr,
        max_restarts=cfg.max_restarts,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "ranks"), tee=Std.ALL),
        log_line_prefix_template=NODE_RANK_PREFIX.format(node=node.index) if many else RANK_PREFIX,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


def rank_environment(layout: Layout, base: dict[str, str], node: int = 0) -> dict[str, str]:
    """What this process adds to its environment before the agent copies it into every rank (pure).

    Lines reach the log as they happen (PYTHONUNBUFFERED) and whole: no progress bars (transformers' `Loading
    weights` bar writes a line without its newline, and the agent's tee glued the next line onto it, so a log
    reader missed `step 6/6` behind `[node 1 local rank 0] Loading weights: 0%|...`). Every attempt gets its
    own rendezvous store; GPU indices are nvidia-smi's (PCI bus order). CPU ranks get one intra-op thread each unless OMP_NUM_THREADS
    is set: CPU layouts are the tiny demo and the tests, whose matmuls take microseconds, so more threads only
    add synchronisation (a τ evaluation of the tiny drafter on a busy 2-core machine: 1.5 s with one thread,
    55 s with two). Each rank picks its own GPU (trainer.distributed.select_device).
    """
    # A fresh rendezvous store per attempt, hosted by rank 0: with the store shared with the agent (torch's
    # default), a restarted attempt read the previous attempt's gloo addresses and failed to connect
    # ("connectFullMesh ... Connection refused"; pytorch/pytorch#135712).
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           NODE_ENV: str(node)}
    if layout.uses_gpus:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    elif "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    return env


def launch(cfg: TrainConfig, config_path: Path, out: TextIO = sys.stdout, node: Node = Node()) -> int:
    """Run every rank of this node under the elastic agent until the run ends; see the module docstring.

    Returns:
        The launcher's exit code.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from trainer import failures, faults

    def log(msg: str) -> None:
        out.write(f"[launch] {msg}\n")
        out.flush()

    layout = cfg.layout.to_layout()
    vllm_python = vllm_interpreter(cfg, node)  # before anything starts: a run to be judged in vLLM needs it
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / failures.ROOT_CAUSE_FILE).unlink(missing_ok=True)  # a cause of an earlier attempt is not this one's
    cgroup = faults.memory_cgroup()  # its OOM-kill count now: more when a rank fails means an OOM kill
    reserve = faults.reserve_space(run_dir)  # freed when the run ends: room for its last words on a full disk
    os.environ.update(rank_environment(layout, dict(os.environ), node.index))
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # each rank dies with this process (trainer.rank)
    mine = layout.node_ranks(node.index)
    where = f" on node {node.index} of {node.count} (rendezvous {node.rdzv_endpoint})" if node.count > 1 else ""
    log(f"{len(mine)} of {layout.world_size} rank(s){where}, max_restarts {cfg.max_restarts}, "
        f"rank logs in {run_dir / 'ranks'}")
    for local, r in enumerate(mine):  # each rank takes this device itself (trainer.distributed.select_device)
        at = f"local rank {local}: " if node.count > 1 else ""
        log(f"{at}rank {r} ({layout.role(r)}) on " + (f"GPU {layout.gpu(r)}" if layout.uses_gpus else "the CPU"))
    try:
        elastic_launch(launch_config(cfg, layout, run_dir, node), sys.executable)(
            "-u", "-m", "trainer.rank", "--config", str(config_path)
        )
    except ChildFailedError as err:
        found = failures.failures_of(err, [(r, layout.role(r)) for r in mine], node.index)
        doc = failures.name_lost_peer(failures.report(found), layout, node.index)
        hidden = name_hidden_cause(doc, cgroup, [run_dir])  # read before the reserve is freed
        faults.release(reserve)
        faults.remove_stale_temporaries(run_dir)
        for line in failures.summary_lines(doc) + hidden:
            log(line)
        try:
            path = failures.write_report(run_dir, doc)
        except OSError as exc:
            log(f"cannot write {run_dir / failures.ROOT_CAUSE_FILE}: {exc.strerror}")
        else:
            log(f"root cause written to {path}")
        return failures.root_cause(found).launcher_exit_code
    except SignalException as exc:
        log(f"stopped by {exc.sigval.name}: every rank was stopped")
        return 128 + int(exc.sigval)
    finally:
        faults.release(reserve)
    faults.remove_stale_temporaries(run_dir)
    log("all ranks finished")
    if vllm_python is not None:
        return judge_in_vllm(cfg, run_dir, vllm_python, layout, log)
    return 0


def vllm_interpreter(cfg: TrainConfig, node: Node = Node()) -> str | None:
    """The vLLM interpreter that judges the export after training on this node ($DFLASH_VLLM_PYTHON), None when
    the run asks for no vLLM evaluation or another node holds the export (the node of the first drafter rank
    writes it).

    Raises:
        LaunchError: evaluation.engine is vllm and there is no such interpreter (before any rank starts).
    """
    from trainer.vllm_eval import VLLM_PYTHON_ENV

    if cfg.evaluation.engine != "vllm":
        return None
    layout = cfg.layout.to_layout()
    if layout.place(layout.drafter_ranks()[0]).node != node.index:
        return None
    python = os.environ.get(VLLM_PYTHON_ENV, "")
    if python and (Path(python).is_file() or shutil.which(python)):
        return python
    what = f"${VLLM_PYTHON_ENV} is not set" if not python else f"${VLLM_PYTHON_ENV}={python}: no such interpreter"
    raise LaunchError(
        f"evaluation.engine is vllm, but {what}: the export is judged in vLLM after training, in a venv of its own "
        "(vLLM pins its own torch). dflashctl launch passes the experiment's data_venv (build it with `dflashctl "
        f"rebuild-venv --target T --profile vllm`); by hand: {VLLM_PYTHON_ENV}=/path/to/vllm-venv/bin/python "
        "python -m trainer.launch --config FILE. Or set evaluation.engine: own")


def judge_in_vllm(cfg: TrainConfig, run_dir: Path, python: str, layout: Layout, log) -> int:
    """After the final export: `python -m trainer eval --engine vllm` of it in the vLLM interpreter, on the
    held-out prompts and settings of the run's own end-of-training evaluation (trainer.vllm_eval
    .end_of_training_argv), its numbers into metrics.jsonl and eval_vllm.json. A process of its own because
    vLLM lives in another venv (its own torch and transformers), and here, after the ranks, because only then
    is the export final and the devices free (a GPU run's vLLM gets the first drafter rank's GPU).

    Returns:
        0 when vLLM's run agrees with the project's; 1 (the message names the prompts) or the evaluation's own
        exit code otherwise.
    """
    import subprocess

    from trainer.setup import resolve_sources
    from trainer.vllm_eval import REPORT_FILE, EngineError, VllmReport, end_of_training_argv, judge

    src = resolve_sources(cfg, lambda _: None)  # the tiny target was built by the ranks: found in its cache
    argv = end_of_training_argv(python, cfg, run_dir, src.target_dir, src.eval_files)
    env = dict(os.environ)
    if layout.uses_gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(layout.gpu(layout.drafter_ranks()[0]))
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vLLM's CPU default takes far more
    report_path = run_dir / REPORT_FILE
    report_path.unlink(missing_ok=True)  # an earlier attempt's verdict is not this export's
    log(f"judging the export in vLLM ({python}): {' '.join(argv[1:])}")
    sys.stdout.flush()
    code = subprocess.run(argv, env=env).returncode
    if not report_path.is_file():
        log(f"run failed: the vLLM evaluation of {run_dir / 'export'} exited {code} before its report (its error "
            "is above)")
        return code or 1
    report = VllmReport(**json.loads(report_path.read_text()))
    log(f"vLLM: τ {report.tau_vllm:.3f} per-prompt mean ({report.tau_vllm_pooled:.3f} pooled) against the "
        f"project's {report.tau_own:.3f}; lossless {'yes' if report.lossless else 'NO'}; "
        f"{report.tokens_per_s_plain:.1f} -> {report.tokens_per_s_spec:.1f} tokens/s ({report.speedup:.2f}x)")
    try:
        judge(report, run_dir / "export")
    except EngineError as exc:
        log(f"run failed: the export judged in vLLM: {exc}")
        return 1
    return code


def name_hidden_cause(doc: dict, cgroup, paths: list[Path]) -> list[str]:
    """Add to a failure report (in place) what the failed rank could not say itself, and return the lines that
    say it: an OOM kill by the container's memory limit (trainer.faults.oom_since: `oom`), a full file system
    (`disk_full`)."""
    from trainer import faults

    lines = []
    oom = faults.oom_since(cgroup)
    if oom is not None:
        doc["oom"] = oom
        limit = "no memory limit" if oom["limit_mib"] is None else f"memory limit {oom['limit_mib']} MiB"
        fix = faults.raise_memory_fix(oom["limit_bytes"])
        doc["oom"]["fix"] = fix
        lines.append(f"killed by the container's OOM killer: {oom['kills']} process(es) of this run at its {limit} "
                     f"({oom['counter']}); raise the limit {fix}")
    full = faults.full_filesystem(paths)
    if full is not None:
        doc["disk_full"] = full
        lines.append(f"No space left on device: the file system of {full['path']} is full ({full['free_bytes']} of "
                     f"{full['total_bytes']} bytes free); free space there (`df -h {full['path']}`), then resume "
                     "from the last complete checkpoint")
    return lines


def resolve_config(config: str | None, resume: str | None, node: int = 0) -> tuple[TrainConfig, Path]:
    """The config to run and the file the ranks read (for --resume: output_dir forced to RUN_DIR; across
    nodes only the node of the first drafter rank, which saves them, must hold a checkpoint).

    Raises:
        ConfigError: no config given, or a bad one.
        LaunchError: --resume of a directory with no complete checkpoint.
    """
    if resume is None:
        if config is None:
            raise ConfigError("give --config FILE (or --resume RUN_DIR)")
        cfg = load_config(config)
        path = Path(config)
    else:
        from trainer.checkpoint import CheckpointManager

        run_dir = Path(resume)
        path = Path(config) if config else run_dir / "config.json"
        cfg = load_config(path).model_copy(update={"output_dir": str(run_dir)})
        lay = cfg.layout.to_layout()
        saver = lay.place(lay.drafter_ranks()[0]).node
        if saver == node and not CheckpointManager(run_dir / "checkpoints").list_complete():
            raise LaunchError(
                f"nothing to resume in {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}; "
                "launch without --resume to start fresh"
            )
    if Path(cfg.output_dir).resolve() != Path(load_config(path).output_dir).resolve():
        # Ranks read the file: write the resolved config (new output_dir) into the run directory.
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = write_json(out / "config.launch.json", cfg.model_dump(mode="json"))
    return cfg, path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.launch", description="Run a training layout under torch's elastic launcher.")
    p.add_argument("--config", help="TrainConfig as JSON or YAML (runs/<id>/config.json)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its last complete checkpoint")
    p.add_argument("--node", type=int, default=0, metavar="I", help="this node's index in layout.nodes (default 0)")
    args = p.parse_args(argv)
    from trainer.layout import LayoutError

    try:
        cfg, path = resolve_config(args.config, args.resume, args.node)
        node = node_of(cfg, args.node)
        vllm_interpreter(cfg, node)
    except (ConfigError, LayoutError, LaunchError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return launch(cfg, path, node=node)


if __name__ == "__main__":
    sys.exit(main())
