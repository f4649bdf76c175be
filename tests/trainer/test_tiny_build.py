"""The tiny assets built by several processes at once (the drafter ranks of a node without the data builder
all need them at the same moment): one builds, the others wait and reuse it; nobody sees it half there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

BUILD = """
import os, sys
from trainer.config import TinyTargetConfig
from trainer.tiny import build_tiny
a = build_tiny(TinyTargetConfig(num_prompts=40, held_out=4, response_tokens=24), sys.argv[1])
print("has config.json:", (a.target_dir / "config.json").is_file(), flush=True)
"""


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_concurrent_builders_build_once_and_all_see_it_complete(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(tmp_path / "cache")], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for _ in range(3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all("has config.json: True" in o for o in outs), outs
    assert sum("tiny target: building" in o for o in outs) == 1, outs


RANKED = """
import sys, datetime, torch.distributed as dist
from trainer.config import TinyTargetConfig
from trainer.tiny import build_tiny
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
a = build_tiny(TinyTargetConfig(num_prompts=40, held_out=4, response_tokens=24), sys.argv[1] + str(rank))
print("has config.json:", (a.target_dir / "config.json").is_file(), flush=True)
dist.barrier()
"""


@pytest.mark.slow  # over ~4 s on a loaded 2-core machine: out of the fast subset
def test_a_process_of_rank_above_0_writes_its_tiny_target_too(tmp_path):
    # transformers' save_pretrained writes nothing on a global rank > 0 once torch.distributed is up: the
    # drafter ranks of node 1 (ranks 1, 2) would find a target directory without config.json.
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANKED, str(tmp_path / "cache"), str(r), str(tmp_path / "store")],
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("has config.json: True" in o for o, _ in outs), outs
