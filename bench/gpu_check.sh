#!/usr/bin/env bash
# One script for a bare H100/H200 machine with python3 + torch (CUDA) + nvcc + pytest:
# builds specplug's CUDA verify extension, runs the parity tests (kernel == torch
# reference, bit-exact tokens) and times the kernels against the torch path and the HBM
# bandwidth floor. Needs no install and no network; ~5 minutes on an H200 (each step has
# a timeout: build 200 s, tests 150 s, bench 240 s, so it ends within 10 minutes;
# the bench rewrites its table after every cell, so a cut run keeps what it measured).
#
#   bash bench/gpu_check.sh                 # results in $OUT (default: out/gpu_check)
#   SANITIZE=1 bash bench/gpu_check.sh      # also compute-sanitizer memcheck + racecheck
#   QUICK=1 bash bench/gpu_check.sh         # bench grid cut to batch 1 64, vocab 128256
#
# Files written to $OUT: env.txt, build.log, pytest.log, junit.xml, gpu_bench.{md,json,png},
# sanitizer.log (SANITIZE=1). The markdown table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0

# Import the checkout as `specplug` without installing it (plugins/ is the package).
SHIM=$(mktemp -d)
ln -s "$ROOT/plugins" "$SHIM/specplug"
export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/specplug_torch_extensions}
export MAX_JOBS=${MAX_JOBS:-16}

step() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

step "environment"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
    nvcc --version 2>&1 | tail -2
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
} | tee "$OUT/env.txt"

step "build the extension (torch.utils.cpp_extension.load, ninja)"
start=$SECONDS
if timeout 200 "$PY" -m specplug.common.cuda --verbose >"$OUT/build.log" 2>&1; then
    echo "built in $((SECONDS - start)) s"; tail -1 "$OUT/build.log"
else
    echo "BUILD FAILED after $((SECONDS - start)) s:"; tail -40 "$OUT/build.log"; exit 1
fi

step "parity and dispatch tests (tests/cuda: the gpu ones + the fast CPU ones; CI runs the slow rest)"
timeout 150 "$PY" -m pytest tests/cuda -q -p no:cacheprovider -m "gpu or not slow" -rs \
    --junitxml="$OUT/junit.xml" >"$OUT/pytest.log" 2>&1 || status=1
tail -25 "$OUT/pytest.log"

if [ "${SANITIZE:-0}" = "1" ]; then
    step "compute-sanitizer memcheck + racecheck on two small parity tests"
    sel="test_greedy_ties_take_the_first_index or test_draft_rule_chains_match_reference"
    for tool in memcheck racecheck; do
        timeout 300 compute-sanitizer --tool $tool --target-processes all --error-exitcode 9 \
            "$PY" -m pytest tests/cuda/test_parity.py -q -p no:cacheprovider -k "$sel" >>"$OUT/sanitizer.log" 2>&1 \
            || { echo "$tool: problems (see sanitizer.log)"; status=1; }
    done
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer.log" | tail -4
fi

step "timings: kernel vs torch path vs bandwidth floor"
bench_args=()
[ "${QUICK:-0}" = "1" ] && bench_args=(--batch 1 64 --vocab 128256)
timeout 240 "$PY" bench/gpu_bench.py --out "$OUT/gpu_bench" "${bench_args[@]}" 2>"$OUT/bench.err" || {
    echo "bench failed:"; tail -30 "$OUT/bench.err"; status=1; }

rm -rf "$SHIM"
echo; echo "== done: status $status; files in $OUT"
exit $status
