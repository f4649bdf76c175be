"""The launch's memory check (orchestrator.agent.preflight.estimate_memory_need, check_memory): the estimate's
arithmetic, and a warning naming the container's limit, the need and the fix when the limit is below it."""

from __future__ import annotations

from pathlib import Path

from orchestrator.agent import preflight
from trainer import faults

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6}
SPLIT_CFG = {"model": {"target": "tiny", "tiny_target": TINY, "num_draft_layers": 1, "num_target_features": 3},
             "data": {"token_budget": 256}, "layout": {"num_target_procs": 1, "num_drafter_procs": 2}}


class Emit:
    def __init__(self):
        self.events = []

    def progress(self, step, message="", **fields):
        self.events.append((step, message, fields))


def limit_cgroup(tmp_path: Path, limit_bytes: int) -> faults.MemoryCgroup:
    """A cgroup v2 directory as the kernel writes it, read back by trainer.faults."""
    (tmp_path / "memory.max").write_text(f"{limit_bytes}\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    return faults.memory_cgroup_at(tmp_path, 2)


def test_the_estimate_adds_its_parts_as_its_docstring_says():
    est = preflight.estimate_memory_need(SPLIT_CFG, TINY)
    layer = 4 * 64 * 64 + 3 * 64 * 128
    p_target, p_drafter = 6 * layer + 2 * 512 * 64, 1 * layer + 3 * 64 * 64
    assert est["processes"] == 3
    assert est["parts"] == {
        "libraries": preflight.LIBRARIES_BYTES,
        "processes": 3 * preflight.PROCESS_BASE_BYTES,
        "launcher": preflight.LAUNCHER_BYTES,
        "target weights": p_target * 4,
        "drafter and optimizer": 2 * (p_drafter * 16 + 2 * 512 * 64 * 4),
        "activations": 2 * 256 * (64 * 4 * 16 + 512 * 3) * 4,
    }
    assert est["total_bytes"] == sum(est["parts"].values())
    # the tiny run measured at 1042 MiB in its memory cgroup (bench/memory_need.py): within 10 %
    assert 0.9 < est["total_bytes"] / (1042 << 20) < 1.1
    gpu = preflight.estimate_memory_need({**SPLIT_CFG, "layout": {"target_gpus": [0], "drafter_gpus": [1, 2]}}, TINY)
    assert gpu["parts"]["processes"] == 3 * (preflight.PROCESS_BASE_BYTES + preflight.GPU_PROCESS_EXTRA_BYTES)
    assert gpu["parts"]["target weights loading"] == p_target * 2 and "activations" not in gpu["parts"]


def test_a_limit_below_the_need_is_warned_with_both_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_CTID", "200")
    emit = Emit()
    need = preflight.check_memory(SPLIT_CFG, str(tmp_path), emit, limit_cgroup(tmp_path, 512 << 20))
    [(step, message, fields)] = emit.events
    mib = need["total_bytes"] >> 20
    assert step == "memory" and fields == {"need_bytes": need["total_bytes"], "limit_bytes": 512 << 20}
    assert message == (f"warning: the container's memory limit (512 MiB) is below this run's estimated need ({mib} "
                       "MiB for 3 trainer process(es)); the kernel's OOM killer may end it. Raise the limit on the "
                       f"Proxmox host: pct set 200 --memory {-(-mib // 256) * 256}")


def test_a_limit_above_the_need_or_no_limit_says_nothing(tmp_path):
    emit = Emit()
    assert preflight.check_memory(SPLIT_CFG, str(tmp_path), emit, limit_cgroup(tmp_path, 4 << 30)) is not None
    (tmp_path / "memory.max").write_text("max\n")
    assert preflight.check_memory(SPLIT_CFG, str(tmp_path), emit, faults.memory_cgroup_at(tmp_path, 2)) is None
    assert emit.events == []
