"""doctor: pure parsers, the local target, and containers on the fake Proxmox host (real sshd + pct stand-in),
counting exactly ONE `pct exec` per doctor run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from orchestrator.inventory import load_inventory
from orchestrator.ops.doctor import CUDA_CHECK, FAIL, LIB_CHECK, OK, SKIP, WARN, doctor, gpu_devices

pytestmark = pytest.mark.slow  # runs real processes: `-m "not slow"` leaves it out

AGENT_CHECKS = ["python3", "nvidia-smi readable", LIB_CHECK, CUDA_CHECK, "tmux", "uv", "free disk",
                "workdir writable", "inductor cache dir writable"]
ALL_CHECKS = ["ssh reachable", "host key known", "pct present", "container running", "GPU devices visible",
              *AGENT_CHECKS]


GPU_EXPERIMENT = {"gpu-cmd": {"kind": "command", "target": "ct", "command": ["true"], "gpus": [0]}}


def inventory(tmp_path: Path, host: dict | None = None, ctid: int = 310, workdir: str | None = None,
              name: str = "inv.yaml", venv: str = "cpu", experiments: dict | None = None):
    """A written + loaded inventory with a `local` target and (given a host entry) a container target `ct`
    whose venv profile is `venv` (`cpu`: the cpu lock; `gpu`: the cuda lock), with `experiments` (default:
    one command experiment on GPU 0 of `ct`, so the GPU checks run)."""
    doc: dict = {
        "targets": {"local": {"kind": "local", "workdir": str(tmp_path / "local"), "venv": "workstation"}},
        "venvs": {"workstation": {"kind": "workstation"}, "cpu": {"kind": "uv", "lock": "cpu"},
                  "gpu": {"kind": "uv", "lock": "cuda"}},
        "experiments": {},
    }
    if host is not None:
        doc["experiments"] = dict(GPU_EXPERIMENT if experiments is None else experiments)
        doc["hosts"] = {"pve": host}
        doc["targets"]["ct"] = {"kind": "container", "host": "pve", "ctid": ctid,
                                "workdir": workdir or "/root/dflash", "venv": venv}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_inventory(path)


def by_name(report) -> dict:
    return {c.name: c for c in report.checks}


# ---------------------------------------------------------------- pure


def test_gpu_devices_from_pct_config():
    text = "\n".join([
        "arch: amd64",
        "dev0: /dev/nvidia0",
        "dev1: path=/dev/nvidia1,gid=44",
        "dev2: /dev/nvidiactl",
        "dev3: /dev/nvidia-uvm",
        "lxc.cgroup2.devices.allow: c 195:* rwm",
        "lxc.mount.entry: /dev/nvidia7 dev/nvidia7 none bind,optional,create=file",
        "lxc.mount.entry: /dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file",
    ])
    assert gpu_devices(text) == [0, 1, 7]
    assert gpu_devices("arch: amd64\nmemory: 4096\n") == []


# ---------------------------------------------------------------- local


def test_local_doctor_passes_here(tmp_path):
    rep = doctor(inventory(tmp_path), "local")
    assert [c.name for c in rep.checks] == AGENT_CHECKS
    assert rep.ok, rep.checks
    assert by_name(rep)["workdir writable"].detail == str(tmp_path / "local")
    assert rep.ping is not None and rep.ping["workdir"]["writable"]


def test_local_doctor_fails_on_low_disk_with_a_fix(tmp_path):
    rep = doctor(inventory(tmp_path), "local", min_free_gib=10**9)
    disk = by_name(rep)["free disk"]
    assert disk.status == FAIL and disk.fix and not rep.ok


def test_local_doctor_reports_missing_tools(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    rep = doctor(inventory(tmp_path), "local")
    checks = by_name(rep)
    assert checks["tmux"].status == FAIL and checks["tmux"].fix == "apt-get install -y tmux"
    # rebuild-venv brings the workstation's own uv: the fix is that verb, for this target, runnable as printed.
    assert checks["uv"].status == WARN and checks["uv"].fix == "dflashctl rebuild-venv --target local"
    # No experiment of this inventory runs on `local`: the GPU checks are skipped, saying so.
    assert checks["nvidia-smi readable"].status == SKIP
    assert checks["nvidia-smi readable"].detail.startswith("no experiment in ")
    assert not rep.ok


# ---------------------------------------------------------------- containers on the fake host


def test_doctor_on_a_healthy_container_makes_one_pct_exec(pve, tmp_path):
    ct = pve.create_container(310, gpus=8)
    inv = inventory(tmp_path, pve.host_entry(), ctid=310, workdir=ct.workdir)
    doctor(inv, "ct")  # first contact copies the bundle into the container once
    pve.clear_pct_calls()

    rep = doctor(inv, "ct")
    checks = by_name(rep)
    assert [c.name for c in rep.checks] == ALL_CHECKS
    for name in ("ssh reachable", "host key known", "pct present", "container running", "python3",
                 "workdir writable", "inductor cache dir writable", "free disk", "tmux"):
        assert checks[name].status == OK, (name, checks[name])
    assert checks["GPU devices visible"].detail.startswith("8 passed through")
    assert checks["nvidia-smi readable"].status == OK and checks["nvidia-smi readable"].detail.startswith("8 GPU(s)")
    assert rep.ping["hostname"] == "ct310"
    assert rep.ping["workdir"]["path"] == ct.workdir

    calls = pve.pct_calls()
    assert len(pve.pct_exec_calls(310)) == 1, calls
    assert [c[1] for c in calls if c[1] != "exec"] == ["status", "config"]


def test_doctor_on_a_stopped_container_says_pct_start(pve, tmp_path):
    pve.create_container(311, gpus=2, running=False)
    inv = inventory(tmp_path, pve.host_entry(), ctid=311)
    rep = doctor(inv, "ct")
    checks = by_name(rep)
    assert checks["ssh reachable"].status == OK and checks["pct present"].status == OK
    running = checks["container running"]
    assert running.status == FAIL and "stopped" in running.detail
    assert running.fix.startswith("ssh ") and running.fix.endswith(f"root@{pve.hostname} pct start 311")
    assert checks["GPU devices visible"].status == OK  # pct config works on a stopped container
    assert all(checks[n].status == SKIP for n in AGENT_CHECKS)
    assert pve.pct_exec_calls(311) == []
    assert not rep.ok


def test_doctor_on_a_missing_container(pve, tmp_path):
    # 398: no fixture's container (399 is the session's stock_cpu_venv container: removing it removed its venv
    # from under every later container test)
    pve.remove_container(398)
    rep = doctor(inventory(tmp_path, pve.host_entry(), ctid=398), "ct")
    running = by_name(rep)["container running"]
    assert running.status == FAIL
    assert "container 398 does not exist" in running.detail
    assert "targets.ct.ctid" in running.fix
    assert pve.pct_exec_calls(398) == []


def test_doctor_without_gpus_or_with_a_broken_driver(pve, tmp_path):
    ct = pve.create_container(312, gpus=0)
    inv = inventory(tmp_path, pve.host_entry(), ctid=312, workdir=ct.workdir)
    checks = by_name(doctor(inv, "ct"))
    assert checks["GPU devices visible"].status == FAIL and "pct set 312 -dev0 /dev/nvidia0" in checks["GPU devices visible"].fix
    assert checks["nvidia-smi readable"].status == FAIL and "not found" in checks["nvidia-smi readable"].detail

    ct = pve.create_container(312, gpus=2)
    ct.set_nvidia_error("Failed to initialize NVML: Driver/library version mismatch")
    checks = by_name(doctor(inv, "ct"))
    assert checks["GPU devices visible"].status == OK
    smi = checks["nvidia-smi readable"]
    assert smi.status == FAIL and "Driver/library version mismatch" in smi.detail and "--no-kernel-modules" in smi.fix


def test_doctor_names_a_driver_too_old_for_the_venvs_torch(pve, tmp_path, claim_cuda_venv, dflashctl):
    ct = pve.create_container(315, gpus=2)
    ct.set_driver("550.54.15", "12.4")
    ct.set_kernel_module("550.54.15")
    inv = inventory(tmp_path, pve.host_entry(), ctid=315, workdir=ct.workdir, venv="gpu")
    claim_cuda_venv(ct.workdir, lock="cuda", torch="2.13.0", cuda="13.0")  # what PyPI's torch 2.13.0 is
    checks = by_name(doctor(inv, "ct"))
    assert checks[LIB_CHECK].status == OK and checks[LIB_CHECK].detail == (
        "driver libraries 550.54.15 = kernel module 550.54.15")
    drv = checks[CUDA_CHECK]
    assert drv.status == FAIL
    assert drv.detail == ("the venv's torch 2.13.0 is built for CUDA 13.0, but the NVIDIA driver 550.54.15 runs "
                          "CUDA 12.4 at most (CUDA 13.x needs driver >= 580)")
    assert drv.fix.startswith("use a torch built for CUDA 12: dflashctl lock cuda --extra-index-url "
                              "https://download.pytorch.org/whl/cu126, add https://download.pytorch.org/whl/cu126 "
                              "to the venv profile's extra_index_urls in the inventory, then dflashctl rebuild-venv "
                              "--target ct; or upgrade the host's NVIDIA driver to >= 580")

    # The installed console script prints it, as text, and fails.
    # In a narrow terminal (60 columns) the table wraps its cells, but each fix is one whole line below it, and
    # its dflashctl commands carry the -i the user gave: pasteable as printed.
    res = dflashctl("-i", str(tmp_path / "inv.yaml"), "doctor", "-t", "ct", env=dict(os.environ, COLUMNS="60"))
    assert res.returncode == 1, res.stdout + res.stderr
    out = " ".join(res.stdout.split())
    assert "550.54.15" in out  # the detail, in a wrapped cell
    i = f"dflashctl -i {tmp_path / 'inv.yaml'}"
    [fix] = [line for line in res.stdout.splitlines() if line.startswith(f"fix for {CUDA_CHECK}: ")]
    assert fix == (f"fix for {CUDA_CHECK}: use a torch built for CUDA 12: {i} lock cuda --extra-index-url "
                   "https://download.pytorch.org/whl/cu126, add https://download.pytorch.org/whl/cu126 to the venv "
                   f"profile's extra_index_urls in the inventory, then {i} rebuild-venv --target ct; or upgrade the "
                   "host's NVIDIA driver to >= 580 and install the same version in the container without kernel modules (sh "
                   f"NVIDIA-Linux-x86_64-<version>.run --no-kernel-modules), then {i} doctor --target ct"), fix

    # A driver that runs CUDA 13 passes; so does a torch for CUDA 12.6 on the R550 driver (minor-version
    # compatibility), and a CPU torch.
    ct.set_driver("580.65.06", "13.0")
    ct.set_kernel_module("580.65.06")
    assert by_name(doctor(inv, "ct"))[CUDA_CHECK].detail == (
        "driver 580.65.06 (CUDA 13.0) runs torch 2.13.0 built for CUDA 13.0")
    ct.set_driver("550.54.15", "12.4")
    ct.set_kernel_module("550.54.15")
    claim_cuda_venv(ct.workdir, lock="cuda", torch="2.13.0+cu126", cuda="12.6")
    assert by_name(doctor(inv, "ct"))[CUDA_CHECK].status == OK
    claim_cuda_venv(ct.workdir, lock="cuda", torch="2.13.0+cpu", cuda=None)
    assert by_name(doctor(inv, "ct"))[CUDA_CHECK].detail == "torch 2.13.0+cpu is a CPU build"


def test_doctor_names_a_library_kernel_module_mismatch(pve, tmp_path, claim_cuda_venv):
    ct = pve.create_container(316, gpus=2)
    ct.set_driver("550.54.15", "12.4")   # the container's own libraries
    ct.set_kernel_module("570.133.20")   # the host's driver was upgraded (and the host rebooted)
    inv = inventory(tmp_path, pve.host_entry(), ctid=316, workdir=ct.workdir, venv="gpu")
    claim_cuda_venv(ct.workdir, lock="cuda", torch="2.13.0+cu126", cuda="12.6")
    checks = by_name(doctor(inv, "ct"))
    lib = checks[LIB_CHECK]
    assert lib.status == FAIL
    assert "libnvidia-ml 550.54" in lib.detail and "kernel module 570.133.20" in lib.detail
    assert lib.fix == ("install the host's version 570.133.20 of the NVIDIA driver in the container without kernel "
                       "modules: sh NVIDIA-Linux-x86_64-570.133.20.run --no-kernel-modules (inside the container), "
                       "then dflashctl doctor --target ct")
    assert checks["nvidia-smi readable"].fix == lib.fix  # the same cause, the same fix
    # One error for one problem: the torch check cannot ask nvidia-smi for the CUDA version meanwhile.
    assert checks[CUDA_CHECK].status == SKIP and "nvidia-smi" in checks[CUDA_CHECK].detail
    ct.set_driver("570.133.20", "12.8")  # installed as the fix says
    checks = by_name(doctor(inv, "ct"))
    assert checks[LIB_CHECK].status == OK and checks[CUDA_CHECK].status == OK


def test_doctor_before_the_first_venv_skips_the_torch_check(pve, tmp_path):
    ct = pve.create_container(317, gpus=1)
    checks = by_name(doctor(inventory(tmp_path, pve.host_entry(), ctid=317, workdir=ct.workdir, venv="gpu"), "ct"))
    assert checks[LIB_CHECK].status == OK
    assert checks[CUDA_CHECK].status == SKIP and "rebuild-venv" in checks[CUDA_CHECK].detail


def test_doctor_refuses_an_unknown_host_key_then_trust_fixes_it(pve, tmp_path):
    pve.create_container(313, gpus=1)
    entry = dict(pve.host_entry(), known_hosts=str(tmp_path / "known_hosts"))
    (tmp_path / "known_hosts").write_text("")
    inv = inventory(tmp_path, entry, ctid=313)
    rep = doctor(inv, "ct")
    checks = by_name(rep)
    assert checks["host key known"].status == FAIL
    assert "dflashctl trust pve" in (checks["host key known"].fix or "") + checks["host key known"].detail
    assert all(checks[n].status == SKIP for n in ALL_CHECKS[2:])
    assert pve.pct_calls() == []

    from orchestrator.ops.trust import trust

    out = trust(inv, "pve")
    assert out["fingerprint"].startswith("SHA256:") and out["known_hosts"] == str(tmp_path / "known_hosts")
    assert by_name(doctor(inv, "ct"))["host key known"].status == OK


def test_doctor_reports_an_unreachable_host(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    entry = {"ssh": "127.0.0.1", "port": port, "user": "root", "known_hosts": str(tmp_path / "kh")}
    rep = doctor(inventory(tmp_path, entry), "ct")
    checks = by_name(rep)
    assert checks["ssh reachable"].status == FAIL and checks["ssh reachable"].fix
    assert all(checks[n].status == SKIP for n in ALL_CHECKS[1:])


def test_doctor_cli_json_against_the_fake_host(pve, tmp_path):
    import json
    import subprocess
    import sys

    ct = pve.create_container(314, gpus=3)
    inventory(tmp_path, pve.host_entry(), ctid=314, workdir=ct.workdir)
    repo = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(repo))
    code = "import sys; from orchestrator.cli import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, "-i", str(tmp_path / "inv.yaml"), "doctor", "-t", "ct", "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    report = json.loads(res.stdout)
    assert report["target"] == "ct" and report["kind"] == "container"
    assert {c["name"]: c["status"] for c in report["checks"]}["container running"] == OK
    assert res.returncode == (0 if report["ok"] else 1)


# ---------------------------------------------------------------- the GPU checks follow the experiments


CPU_EXPERIMENTS = {"tiny-ct": {"kind": "dflash", "target": "ct"},
                   "cmd-ct": {"kind": "command", "target": "ct", "command": ["true"]},
                   "gpu-elsewhere": {"kind": "command", "target": "local", "command": ["true"], "gpus": [0]}}


def test_doctor_passes_a_cpu_only_container_whose_experiments_use_no_gpu(pve, tmp_path, dflashctl):
    """A container without GPU devices or nvidia-smi, whose experiments all run on the CPU: the GPU checks are
    skipped with that reason and doctor passes (exit 0 through the installed script); give one experiment a GPU
    and the same container fails them as before."""
    ct = pve.create_container(316, gpus=0)
    inv = inventory(tmp_path, pve.host_entry(), ctid=316, workdir=ct.workdir, experiments=CPU_EXPERIMENTS)
    rep = doctor(inv, "ct")
    checks = by_name(rep)
    for name in ("GPU devices visible", "nvidia-smi readable", LIB_CHECK, CUDA_CHECK):
        assert checks[name].status == SKIP, checks[name]
        assert checks[name].detail.startswith("no experiment on ct uses a GPU (tiny-ct, cmd-ct: CPU only)")
    assert rep.ok, [c for c in rep.checks if not c.ok]
    res = dflashctl("--inventory", str(tmp_path / "inv.yaml"), "doctor", "--target", "ct")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no experiment on ct uses a GPU" in res.stdout

    inv = inventory(tmp_path, pve.host_entry(), ctid=316, workdir=ct.workdir,
                    experiments={**CPU_EXPERIMENTS, "gpu-ct": {"kind": "dflash", "target": "ct",
                                                               "layout": {"target_gpus": [0], "drafter_gpus": [1]}}})
    checks = by_name(doctor(inv, "ct"))
    assert checks["GPU devices visible"].status == FAIL and checks["nvidia-smi readable"].status == FAIL


def test_gpu_experiments_reads_layouts_commands_and_nodes(tmp_path):
    """Which experiments use a GPU on which target: a single CPU layout, a command's gpus, each node of a
    layout across targets for its own target; a target no experiment names has none."""
    doc = {"hosts": {"pve": {"ssh": "pve.lan"}},
           "targets": {"a": {"kind": "container", "host": "pve", "ctid": 200},
                       "b": {"kind": "container", "host": "pve", "ctid": 201},
                       "c": {"kind": "container", "host": "pve", "ctid": 202}},
           "venvs": {"cuda": {"kind": "uv"}},
           "experiments": {
               "cpu-a": {"kind": "dflash", "target": "a"},
               "cmd-b": {"kind": "command", "target": "b", "command": ["x"], "gpus": [1]},
               "two": {"kind": "dflash", "target": "a", "layout": {
                   "nodes": [{"target": "a", "target_gpus": [0]}, {"target": "c", "drafter_gpus": [0]}],
                   "rendezvous": "10.0.0.1:29400"}}}}
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump(doc))
    from orchestrator.ops.doctor import gpu_experiments

    inv = load_inventory(path)
    assert gpu_experiments(inv, "a") == (["two"], ["cpu-a", "two"])
    assert gpu_experiments(inv, "b") == (["cmd-b"], ["cmd-b"])
    assert gpu_experiments(inv, "c") == (["two"], ["two"])
    assert gpu_experiments(inv, "nowhere") == ([], [])
