"""Agent verbs ping and gpus, and the nvidia-smi parser, through a real LocalTarget subprocess and a container of
the fake Proxmox host. (open_target itself: tests/orchestrator/test_target.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.agent.gpu import parse_gpu_csv
from orchestrator.bundle import build_bundle
from orchestrator.errors import AgentError
from orchestrator.target import LocalTarget
from orchestrator.transport.local import LocalTransport

SMI_OK = """#!/bin/sh
# stand-in nvidia-smi: two GPUs, the second one busy; only the query dflashctl uses is accepted
case "$*" in
  "--query-gpu=index,uuid,memory.used,memory.total --format=csv,noheader,nounits")
    printf '1, GPU-bbbb, 40960, 81559\\n0, GPU-aaaa, 3, 81559\\n' ;;
  *) echo "Invalid combination of input arguments."; exit 2 ;;
esac
"""

SMI_BROKEN = """#!/bin/sh
echo "Failed to initialize NVML: Driver/library version mismatch"
exit 9
"""


def stand_in(tmp_path: Path, script: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / "nvidia-smi"
    exe.write_text(script)
    exe.chmod(0o755)
    return bindir


@pytest.fixture
def local(tmp_path):
    t = LocalTarget(name="local", workdir=str(tmp_path / "work"), transport=LocalTransport())
    yield t
    t.close()


# ---------------------------------------------------------------- parser (pure)


def test_parse_gpu_csv_sorts_and_keeps_na_as_none():
    gpus, problems = parse_gpu_csv("1, GPU-b, 100, 81559\n0, GPU-a, [N/A], [Not Supported]\n\n")
    assert problems == []
    assert gpus == [
        {"index": 0, "uuid": "GPU-a", "used_mib": None, "total_mib": None},
        {"index": 1, "uuid": "GPU-b", "used_mib": 100, "total_mib": 81559},
    ]


def test_parse_gpu_csv_reports_bad_lines_instead_of_guessing():
    gpus, problems = parse_gpu_csv("0, GPU-a, 5, 10\nNo devices were found\nx, GPU-c, 1, 2\n")
    assert [g["index"] for g in gpus] == [0]
    assert len(problems) == 2
    assert "line 2" in problems[0] and "line 3" in problems[1]


# ---------------------------------------------------------------- through the LocalTarget


def test_ping_reports_the_environment(local, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{stand_in(tmp_path, SMI_OK)}{os.pathsep}{os.environ['PATH']}")
    ping = local.agent("ping")
    assert ping["python"]["executable"] == sys.executable
    assert ping["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    tmux = shutil.which("tmux")
    expected_tmux = subprocess.run([tmux, "-V"], capture_output=True, text=True).stdout.strip() if tmux else None
    assert ping["tmux"] == expected_tmux
    assert ping["gpus"] == {
        "gpus": [
            {"index": 0, "uuid": "GPU-aaaa", "used_mib": 3, "total_mib": 81559},
            {"index": 1, "uuid": "GPU-bbbb", "used_mib": 40960, "total_mib": 81559},
        ],
        "reason": None,
    }
    assert ping["workdir"] == {"path": local.workdir, "writable": True, "error": None}
    assert ping["inductor_cache_dir"]["writable"] is True
    assert Path(local.workdir, "inductor-cache").is_dir()
    assert ping["disk"]["total_bytes"] == shutil.disk_usage(local.workdir).total
    assert 0 < ping["disk"]["free_bytes"] <= ping["disk"]["total_bytes"]
    assert ping["bundle_hash"] == build_bundle().hash
    assert ping["hostname"] == os.uname().nodename
    assert ping["venv"] is None
    if shutil.which("uv"):
        assert ping["uv"]["path"] and ping["uv"]["version"].startswith("uv ")


def test_ping_reports_the_current_venv(local):
    real = Path(local.workdir) / "venvs" / "abc-20250101T000000Z"
    real.mkdir(parents=True)
    (Path(local.workdir) / "venvs" / "current").symlink_to(real.name)
    assert local.agent("ping")["venv"] == str(real)


def test_ping_prefers_the_bundle_hash_from_the_environment(local, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_BUNDLE_HASH", "0123456789abcdef")
    assert local.agent("ping")["bundle_hash"] == "0123456789abcdef"


def test_ping_reports_an_unwritable_workdir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    t = LocalTarget(name="local", workdir=str(blocker / "work"), transport=LocalTransport())
    ping = t.agent("ping")
    assert ping["workdir"]["writable"] is False and "NotADirectoryError" in ping["workdir"]["error"]
    assert ping["inductor_cache_dir"]["writable"] is False
    assert ping["disk"]["free_bytes"] > 0  # measured on the nearest existing parent


def test_ping_refuses_a_relative_workdir(tmp_path):
    t = LocalTarget(name="local", workdir="relative/dir", transport=LocalTransport())
    with pytest.raises(AgentError) as info:
        t.agent("ping")
    assert info.value.agent_type == "BadRequest" and "absolute workdir" in info.value.message


def test_gpus_verb_lists_gpus(local, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{stand_in(tmp_path, SMI_OK)}{os.pathsep}{os.environ['PATH']}")
    out = local.agent("gpus")
    assert [(g["index"], g["used_mib"]) for g in out["gpus"]] == [(0, 3), (1, 40960)]
    assert out["reason"] is None


def test_gpus_verb_reports_a_broken_driver(local, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{stand_in(tmp_path, SMI_BROKEN)}{os.pathsep}{os.environ['PATH']}")
    out = local.agent("gpus")
    assert out["gpus"] == []
    assert "exit code 9" in out["reason"] and "Driver/library version mismatch" in out["reason"]


def test_gpus_verb_without_nvidia_smi(local, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHCTL_NVIDIA_SMI", str(tmp_path / "no-such-nvidia-smi"))
    out = local.agent("gpus")
    assert out["gpus"] == [] and "cannot run" in out["reason"]


def test_gpus_verb_when_nvidia_smi_is_absent(local, monkeypatch, tmp_path):
    if any(os.access(os.path.join(d, "nvidia-smi"), os.X_OK) for d in ("/usr/bin", "/usr/local/bin", "/usr/sbin", "/usr/local/sbin")):
        pytest.skip("this machine has a real nvidia-smi")
    monkeypatch.setenv("PATH", str(tmp_path))
    out = local.agent("gpus")
    assert out["gpus"] == [] and "nvidia-smi not found" in out["reason"]


# ---------------------------------------------------------------- through ssh + pct (fake Proxmox host)


def container_inventory(tmp_path: Path, pve, ctid: int, workdir: str):
    import yaml

    from orchestrator.inventory import load_inventory

    doc = {
        "hosts": {"pve": pve.host_entry()},
        "targets": {"ct": {"kind": "container", "host": "pve", "ctid": ctid, "workdir": workdir, "venv": "cpu"}},
        "venvs": {"cpu": {"kind": "uv", "lock": "cpu"}},
    }
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_inventory(path)


def test_open_target_builds_ssh_pct_and_ping_runs_inside(pve, tmp_path):
    from orchestrator.target import ContainerTarget, open_target
    from orchestrator.transport.pct import PctTransport

    ct = pve.create_container(320, gpus=4)
    ct.set_gpu_used(2, 30000)
    target = open_target(container_inventory(tmp_path, pve, 320, ct.workdir), "ct")
    try:
        assert isinstance(target, ContainerTarget) and isinstance(target.transport, PctTransport)
        assert target.transport.ctid == 320 and target.workdir == ct.workdir
        target.agent("echo")  # first contact copies the bundle in
        pve.clear_pct_calls()

        ping = target.agent("ping")
        assert len(pve.pct_exec_calls(320)) == 1
        assert ping["hostname"] == "ct320"  # really ran in the container's uts namespace
        assert ping["bundle_hash"] == build_bundle().hash  # from DFLASHCTL_BUNDLE_HASH set by the bootstrap
        assert [g["used_mib"] for g in ping["gpus"]["gpus"]] == [0, 0, 30000, 0]
        assert ping["gpus"]["reason"] is None
        assert ping["workdir"]["writable"] and ping["inductor_cache_dir"]["path"] == ct.workdir + "/inductor-cache"

        gpus = target.agent("gpus")
        assert [g["index"] for g in gpus["gpus"]] == [0, 1, 2, 3]
        assert gpus["gpus"][2]["used_mib"] == 30000 and gpus["gpus"][2]["total_mib"] > 30000
        assert all(g["uuid"].startswith("GPU-") for g in gpus["gpus"])
        assert len(pve.pct_exec_calls(320)) == 2
    finally:
        target.close()


def test_gpus_in_a_container_without_nvidia_smi(pve, tmp_path):
    from orchestrator.target import open_target

    if any(os.access(os.path.join(d, "nvidia-smi"), os.X_OK) for d in ("/usr/bin", "/usr/sbin", "/usr/local/bin")):
        pytest.skip("the fake containers share this machine's /usr, which has a real nvidia-smi")

    ct = pve.create_container(321, gpus=0)
    target = open_target(container_inventory(tmp_path, pve, 321, ct.workdir), "ct")
    try:
        out = target.agent("gpus")
    finally:
        target.close()
    assert out["gpus"] == [] and "nvidia-smi not found" in out["reason"]
