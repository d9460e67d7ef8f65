#!/usr/bin/env bash
# One pass over what needs an NVIDIA GPU: the full Triton kernel tests on the GPU, then the benchmark.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; results go to benchmarks/results/
#   RESULTS_DIR=/some/dir bash benchmarks/gpu_check.sh
#
# Installs nothing from the network. If flash-linear-attention wheels (fla-core) are shipped under
# benchmarks/wheels/, they are installed offline and the benchmark compares against chunk_simple_gla;
# otherwise that comparison is skipped (and the table says so). Budget: tests <= 7 min, benchmark <= 6 min.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
RESULTS_DIR="${RESULTS_DIR:-$ROOT/benchmarks/results}"
STAMP="$(date +%Y-%m-%d)"
mkdir -p "$RESULTS_DIR"
status=0

echo "== GPU"
if ! nvidia-smi; then
    echo "nvidia-smi failed: no NVIDIA GPU visible, nothing to check" >&2
    exit 1
fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'torch sees no GPU')" || exit 1

echo "== flash-linear-attention"
if compgen -G "benchmarks/wheels/*.whl" > /dev/null; then
    "$PY" -m pip install --no-index --no-deps benchmarks/wheels/*.whl \
        || echo "installing the shipped wheels failed: the fla comparison will be skipped"
else
    echo "no wheels under benchmarks/wheels/: the comparison with fla's chunk_simple_gla is skipped"
fi

echo "== Triton kernel tests on the GPU (full set)"
TTT2LA_FULL_KERNEL_TESTS=1 timeout 420 "$PY" -m pytest tests/test_triton_kernels.py -q -p no:cacheprovider \
    --durations=10 2>&1 | tee "$RESULTS_DIR/gpu-tests-$STAMP.txt"
test_status=${PIPESTATUS[0]}
[ "$test_status" -eq 0 ] || { echo "kernel tests FAILED (exit $test_status)"; status=1; }

echo "== Benchmark"
timeout 360 "$PY" benchmarks/gpu_bench.py --out "$RESULTS_DIR/gpu-$STAMP.md"
bench_status=$?
[ "$bench_status" -eq 0 ] || { echo "benchmark FAILED (exit $bench_status)"; status=1; }

echo "== Done: results in $RESULTS_DIR (exit $status)"
exit $status
