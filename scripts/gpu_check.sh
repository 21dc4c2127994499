#!/usr/bin/env bash
# GPU checks of kvps's CUDA kernels, in one go, for a machine with an NVIDIA GPU:
#   1. build the C and CUDA libraries in place (setup.py build_ext --inplace; no pip needed)
#   2. kvps.kernels.describe()             -> CUDA must be "usable"
#   3. pytest tests/gpu                     -> CUDA parity with the numpy reference, bit for bit
#   4. the CUDA kernel benchmark            -> GB/s beside torch on the same GPU
# About 2-4 minutes on one H100/H200 (the build is ~10 s, the tests ~1-2 min).
#
#   bash scripts/gpu_check.sh               # logs and tables go to $OUT (default /tmp/kvps-gpu-check)
#
# Needs python3 with torch (CUDA), numpy, ml_dtypes, pytest, setuptools, and what `import kvps`
# imports (pyzmq, msgpack). A machine without network can get missing wheels from .whl/ in the
# repository root: from a machine with network, `python3 -m pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl pyzmq`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvps-gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

step() { echo; echo "=== $* ==="; }

step "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "(nvidia-smi failed)"
nvcc --version | tail -1 || echo "(no nvcc: the CUDA library cannot be built)"
if ! $PY -c "import zmq, msgpack, ml_dtypes, numpy, pytest" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvps-site .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:/tmp/kvps-site"
    fi
    $PY -c "import zmq, msgpack, ml_dtypes, numpy, pytest" || {
        echo "missing Python packages (see the header of this script for .whl/)"; exit 2; }
fi

step "build (C and CUDA, in place)"
start=$(date +%s)
KVPS_BUILD_CUDA=1 $PY setup.py -q build_ext --inplace 2>&1 | tee "$OUT/build.log" | grep -E "kvps build|error|warning" || true
echo "build took $(( $(date +%s) - start )) s"
ls -l kvps/kernels/_kvps_kernels.so kvps/kernels/_kvps_cuda.so || status=1

step "kvps.kernels.describe()"
$PY -c "from kvps import kernels; print(kernels.describe())" | tee "$OUT/describe.txt"
grep -q "CUDA: usable" "$OUT/describe.txt" || { echo "CUDA is not usable: stopping"; exit 1; }

step "CUDA parity tests"
timeout 600 $PY -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "CUDA kernel benchmark"
timeout 300 $PY -m kvps.tools.bench.kernels --backend cuda --size-mb 256 --repeat 10 2>&1 | tee "$OUT/bench_cuda.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "done (status $status); logs in $OUT"
exit $status
