#!/usr/bin/env bash
# The GPU checks: every `gpu`-marked test of the learner and weight-transport paths and the CUDA benchmarks, logged
# to $OUT (default runs/gpu-checks). For a machine with one CUDA GPU and this repository with its generated
# gen/ (make proto). Where the project's Python dependencies are not installed, put their wheels in .whl/
# (scripts/gpu_wheels.sh gathers them: deepspeed, hjson, pydantic, pydantic-core, annotated-types,
# typing-inspection, redis, grpcio, grpcio-health-checking, grpcio-reflection, protobuf, xxhash): they are
# installed into /tmp/site and put on the path first.
#
#   bash scripts/gpu_checks.sh            # tests, then benchmarks; exit status: the tests'
#   bash scripts/gpu_checks.sh tests      # only the tests (bench: only the benchmarks), to fit a time limit
#   bash scripts/gpu_checks.sh weights    # only the weight transport's: its gpu tests and weight_sync_gpu.py
#                                         (about 7.5 minutes on an H200, most of it the benchmark)
set -uo pipefail
PHASE=${1:-all}
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/gen${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
$PY -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"

status=0
bench() {  # name, then the script and its arguments; the last line of each is its JSON figures
    local name=$1 log="$OUT/bench-$1.log"
    shift
    $PY "$@" >"$log" 2>&1 || echo "FAILED: $*" >>"$log"
    echo "== $name: $*" | tee -a "$OUT/benchmarks.log"
    grep -v '^\[\|Warning\|warn\|Loading weights\|return func\|^weight group epoch' "$log" | tail -24 |
        tee -a "$OUT/benchmarks.log"
    rm -f "$log"  # the summary above is what comes back (a device run returns at most 8 files)
}
# issue 23: the collective transport on GPUs, until each receiver's model holds the version: one GPU shared by
# the publisher and its receivers (gloo, host memory), gloo into buffers on that GPU, NCCL from cuda:0 to
# receivers on GPUs of their own; its receive_into_gpu_gbps and load_gbps are the receive into a GPU and the load
weight_sync() { bench weight_sync_gpu benchmarks/weight_sync_gpu.py --device cuda --size-mib 2048; }
WEIGHT_TESTS="tests/test_collective_weights.py tests/test_weight_group_nccl.py"
if [ "$PHASE" = weights ]; then
    # shellcheck disable=SC2086
    $PY -m pytest -m gpu $WEIGHT_TESTS tests/test_benchmarks.py -k "weight or collective or nccl or group" \
        -p no:cacheprovider -q -rA --durations=10 2>&1 | tee "$OUT/gpu-tests.log"
    status=${PIPESTATUS[0]}
    weight_sync
    exit "$status"
fi
if [ "$PHASE" != bench ]; then
# shellcheck disable=SC2086
$PY -m pytest -m gpu tests/test_trainer.py tests/test_grad_norms.py tests/test_mm32.py tests/test_benchmarks.py \
    $WEIGHT_TESTS -p no:cacheprovider -q -rA --durations=10 2>&1 | tee "$OUT/gpu-tests.log"
status=${PIPESTATUS[0]}
fi
[ "$PHASE" = tests ] && exit "$status"

bench vcpo_step_10m_fp32 benchmarks/vcpo_step.py --device cuda --repeats 5
bench vcpo_step_10m_bf16 benchmarks/vcpo_step.py --device cuda --dtype bfloat16 --repeats 5
bench vcpo_step_200m_bf16 benchmarks/vcpo_step.py --device cuda --dtype bfloat16 --size 200m --length 1024 \
    --repeats 5
bench learner_step_10m benchmarks/learner_step.py --device cuda --rounds 5
bench learner_step_200m benchmarks/learner_step.py --device cuda --size 200m --rounds 5
bench lora_32m benchmarks/lora.py --device cuda --rounds 5
# issue 22: peak memory of VCPO (saved, recompute) and GRPO on Qwen2.5-0.5B's shape at 2k tokens in bf16; its
# estimate_over_measured is the start-up estimate against torch.cuda.max_memory_allocated (target within 15%)
bench learner_memory_0.5b benchmarks/learner_memory.py --device cuda --size 0.5b --lengths 1024 2048
bench learner_memory_0.5b_ckpt benchmarks/learner_memory.py --device cuda --size 0.5b --lengths 2048 --checkpointing
weight_sync
exit "$status"
