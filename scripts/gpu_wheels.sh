#!/usr/bin/env bash
# Gather into .whl/ the wheels that scripts/gpu_checks.sh installs on a GPU machine that has torch, CUDA and
# transformers but not this project's other Python dependencies (and no network): the versions this
# repository's environment pins, for CPython 3.12 on x86-64 Linux (override: PYVER=3.11). DeepSpeed ships no
# wheel, so one is built from its source without compiled ops (they are built just in time where needed).
#
#   bash scripts/gpu_wheels.sh        # then carry .whl/ to the GPU machine and run scripts/gpu_checks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
mkdir -p .whl
version() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
for pkg in hjson pydantic pydantic-core annotated-types typing-inspection redis grpcio grpcio-health-checking \
    grpcio-reflection protobuf xxhash; do
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$pkg==$(version "$pkg")"
done
ls .whl/deepspeed-*.whl >/dev/null 2>&1 ||
    DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(version deepspeed)"
ls -1 .whl
