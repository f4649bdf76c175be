#!/usr/bin/env bash
# Build .gpu_deps/: the pure-Python packages (and pydantic's compiled core) that bench/gpu_check.sh needs
# beside a GPU image's own torch and transformers, for CPython 3.12 on x86_64 Linux. Run it on a machine with
# PyPI access, in the checkout, then bring .gpu_deps/ along to the GPU machine (it is git-ignored).
#
#   bash bench/gpu_deps.sh [PYTHON_VERSION]     # default 3.12
set -eu
cd "$(dirname "$0")/.."
py=${1:-3.12}
abi=cp${py/./}
rm -rf .gpu_deps.tmp
python3 -m pip install --quiet --target .gpu_deps.tmp --no-deps --only-binary=:all: \
    --python-version "$py" --implementation cp --abi "$abi" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    'pydantic==2.13.4' 'pydantic-core==2.46.4' 'annotated-types==0.7.0' 'typing-inspection==0.4.2' \
    'typing-extensions==4.16.0' 'pytest==9.0.3' 'pluggy==1.6.0' 'iniconfig==2.3.0' 'pytest-timeout==2.4.0'
rm -rf .gpu_deps && mv .gpu_deps.tmp .gpu_deps  # complete or absent
du -sh .gpu_deps
