#!/usr/bin/env bash
# One script for a bare H100/H200 machine with python3 + torch (CUDA) + Triton + nvcc + pytest
# (no vLLM or SGLang needed, no install, no network). Each step has its own time limit, and
# every limit is cut to what is left of an 8-minute budget (BUDGET=470 s), so the script ends
# within 8 minutes; a step that would start with no time left is recorded as skipped.
#   env          GPU, driver, nvcc, python, torch and Triton versions
#   build        specplug's CUDA verify extension (torch.utils.cpp_extension.load, ninja)   150 s
#   cuda-tests   tests/cuda: the gpu ones + the fast CPU ones (kernel == torch reference)     75 s
#   tree-parity  the stage-tree Triton kernel == a float64 torch reference, engine-free:
#                tests/cuda/test_tree_attention_triton.py (CUDA fp32 / bf16 + interpreter)    45 s
#   tree-timing  that kernel vs torch SDPA with the equivalent dense mask (gpu_tree_attention) 45 s
#   sglang-mask  SGLang's Triton verify kernel reads specplug's prefix-included tree masks
#                (tests/sglang/test_triton_tree_mask.py); skipped when SGLang is not installed 40 s
#   cuda-graph   CUDA-graph capture + replay of greedy chain verification (gpu_graph_check)   30 s
#   train        5 `specplug train eagle3` steps, bf16 target, tiny Llama built here        90 s
#   verify-bench the verify kernel vs the torch path vs the HBM floor (gpu_bench.py)         90 s
# gpu_bench's table is rewritten after every cell, so a cut run keeps what it measured.
#
#   bash bench/gpu_check.sh                 # results in $OUT (default: out/gpu_check)
#   FULL=1 bash bench/gpu_check.sh          # verify-bench on the full grid (default: batch 1 64, vocab 128256)
#   SANITIZE=1 bash bench/gpu_check.sh      # also compute-sanitizer memcheck + racecheck (adds up to 10 min)
#   CPU_DRY_RUN=1 PYTHON=... bash bench/gpu_check.sh   # the steps a CPU can run: tree-parity and
#                                           # tree-timing under Triton's interpreter, cuda-graph's
#                                           # eager part, train in float32 (PYTHON needs triton + transformers;
#                                           # limits x3, budget 20 min)
#
# Results: $OUT/results.md (every step's status, time and findings, the tables included) and
# $OUT/results.json, both rewritten after every step; beside them env.txt, each step's log
# (STEP.log), the steps' own files (junit.xml, tree_parity.xml, tree_timing.{md,json},
# graph.{md,json}, train.{md,json}, gpu_bench.{md,json,png}). results.md is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/out/gpu_check}
mkdir -p "$OUT"
rm -f "$OUT/steps.jsonl" "$OUT/results.md" "$OUT/results.json"
PY=${PYTHON:-python3}
DRY=${CPU_DRY_RUN:-0}
SCALE=1  # CPU_DRY_RUN: every limit x3 and a 20-minute budget (the interpreter on a CPU is slow)
[ "$DRY" = "1" ] && SCALE=3
BUDGET=${BUDGET:-$((SCALE == 1 ? 470 : 1200))}
[ "${SANITIZE:-0}" = "1" ] && BUDGET=$((BUDGET + 600))
status=0

# Import the checkout as `specplug` without installing it: a folder `specplug` of links to
# plugins/'s entries, plus testbed_heads -> heads/ (as the wheel maps them).
SHIM=$(mktemp -d)
mkdir "$SHIM/specplug"
for entry in "$ROOT"/plugins/*; do ln -s "$entry" "$SHIM/specplug/"; done
ln -s "$ROOT/heads" "$SHIM/specplug/testbed_heads"
trap 'rm -rf "$SHIM"' EXIT
export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/specplug_torch_extensions}
export MAX_JOBS=${MAX_JOBS:-16}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# record NAME TITLE STATUS SECONDS LIMIT NOTE [report options]: into results.md / results.json
record() {
    local name=$1 title=$2 st=$3 secs=$4 limit=$5 note=$6; shift 6
    "$PY" bench/gpu_check_report.py record --out "$OUT" --name "$name" --title "$title" --status "$st" \
        --seconds "$secs" --timeout "$limit" --note "$note" "$@" || echo "(could not record step $name)"
    echo "-- $name: $st after ${secs} s${note:+: $note}"
}

# run_step NAME TITLE LIMIT [report options] -- COMMAND...: runs COMMAND under
# min(LIMIT, time left) with its output in $OUT/NAME.log; exit 3 means skipped (its last line says why).
run_step() {
    local name=$1 title=$2 limit=$(($3 * SCALE)); shift 3
    local opts=()
    while [ "$1" != "--" ]; do opts+=("$1"); shift; done; shift
    local left=$((BUDGET - SECONDS - 15))  # 10 s for timeout's KILL, 5 s for the records
    echo; echo "== $name: $title ($(date -u +%H:%M:%S), limit $limit s, $left s left)"
    if [ "$left" -lt 10 ]; then
        record "$name" "$title" skipped 0 0 "out of time: the ${BUDGET} s budget is spent"; return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    local start=$SECONDS rc st note=""
    # a process group of its own: timeout signals all of it (pytest's and bash's children too)
    timeout -k 10 "$limit" bash -c '"$@"' _ "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
        0) st=ok ;;
        3) st=skipped; note=$(grep -v '^\s*$' "$OUT/$name.log" | tail -1) ;;
        124|137) st=timeout; note="cut at $limit s"; status=1 ;;
        *) st=failed; note="exit code $rc"; status=1 ;;
    esac
    record "$name" "$title" "$st" $((SECONDS - start)) "$limit" "$note" --log "$OUT/$name.log" "${opts[@]}"
}

# skip NAME TITLE WHY
skip() { echo; echo "== $1: $2"; record "$1" "$2" skipped 0 0 "$3"; }

# The steps' shell functions run under timeout in a child bash: exported, with what they read.
export PY OUT
pytest_step() {  # pytest; exit 3 (skipped) when it collected no test (e.g. a module skipped)
    "$PY" -m pytest -q -p no:cacheprovider -rs "$@"
    local rc=$?
    [ $rc -eq 5 ] && { echo "skipped: no test ran (see the lines above)"; return 3; }
    return $rc
}
export -f pytest_step

echo "== env"
{
    if [ "$DRY" = "1" ]; then echo "CPU_DRY_RUN=1: the steps a CPU can run"; else
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
        nvcc --version 2>&1 | tail -2
    fi
    timeout 60 "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none', torch.cuda.get_device_capability() if torch.cuda.is_available() else '')"
    timeout 60 "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
    echo "budget ${BUDGET} s; checkout $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
} | tee "$OUT/env.txt"

built=0
if [ "$DRY" = "1" ]; then
    skip build "specplug's CUDA verify extension" "CPU_DRY_RUN: needs nvcc and a GPU"
    skip cuda-tests "tests/cuda parity and dispatch tests" "CPU_DRY_RUN: the CPU suite runs them (scripts/test.sh core)"
else
    run_step build "specplug's CUDA verify extension (torch.utils.cpp_extension.load, ninja)" 150 \
        -- "$PY" -m specplug.common.cuda --verbose
    built=0
    grep -q '^| build | ok ' "$OUT/results.md" && built=1
    [ $built = 1 ] || { echo "BUILD FAILED:"; tail -40 "$OUT/build.log"; }
fi
if [ "$DRY" != "1" ] && [ $built = 0 ]; then  # each would try the build again, for its whole limit
    skip cuda-tests "tests/cuda parity and dispatch tests" "the extension did not build (build.log)"
elif [ "$DRY" != "1" ]; then
    run_step cuda-tests "tests/cuda: the gpu ones + the fast CPU ones (the CI runs the slow rest)" 75 \
        --junit "$OUT/junit.xml" -- pytest_step tests/cuda -m "gpu or not slow" \
        --ignore tests/cuda/test_tree_attention_triton.py --junitxml="$OUT/junit.xml"
fi

if [ "${SANITIZE:-0}" = "1" ] && [ "$DRY" != "1" ] && [ $built = 1 ]; then
    sanitize() {
        local tool sel="test_greedy_ties_take_the_first_index or test_draft_rule_chains_match_reference"
        for tool in memcheck racecheck; do
            compute-sanitizer --tool $tool --target-processes all --error-exitcode 9 \
                "$PY" -m pytest tests/cuda/test_parity.py -q -p no:cacheprovider -k "$sel" || return 1
        done
    }
    export -f sanitize
    run_step sanitizer "compute-sanitizer memcheck + racecheck on two small parity tests" 600 -- sanitize
fi

run_step tree-parity "stage-tree Triton kernel == float64 torch reference (paged KV, trees built here)" 45 \
    --junit "$OUT/tree_parity.xml" -- pytest_step tests/cuda/test_tree_attention_triton.py \
    --junitxml="$OUT/tree_parity.xml"

if [ "$DRY" = "1" ]; then tree_args=(--device cpu); else tree_args=(); fi
run_step tree-timing "stage-tree Triton kernel vs torch SDPA with the equivalent dense mask" 45 \
    --md "$OUT/tree_timing.md" --json "$OUT/tree_timing.json" \
    -- "$PY" bench/gpu_tree_attention.py --out "$OUT/tree_timing" "${tree_args[@]}"

sglang_mask() {
    if ! "$PY" -c "import sglang" >/dev/null 2>&1; then
        echo "skipped: SGLang not installed (import sglang failed); the check needs SGLang's own Triton kernel"
        return 3
    fi
    pytest_step tests/sglang/test_triton_tree_mask.py --junitxml="$OUT/sglang_mask.xml"
}
export -f sglang_mask
run_step sglang-mask "SGLang's Triton verify kernel reads specplug's prefix-included tree masks" 40 \
    --junit "$OUT/sglang_mask.xml" -- sglang_mask

if [ "$DRY" = "1" ]; then dev=(--device cpu); else dev=(); fi
run_step cuda-graph "CUDA-graph capture + replay of greedy chain verification (B 8, K 4, V 32000)" 30 \
    --md "$OUT/graph.md" --json "$OUT/graph.json" -- "$PY" bench/gpu_graph_check.py --out "$OUT/graph" "${dev[@]}"

run_step train "5 specplug train eagle3 steps on a tiny Llama built here (bf16 target on a GPU)" 90 \
    --md "$OUT/train.md" --json "$OUT/train.json" -- "$PY" bench/gpu_train_check.py --out "$OUT/train" "${dev[@]}"

if [ "$DRY" = "1" ]; then
    skip verify-bench "verify kernel vs torch path vs bandwidth floor" "CPU_DRY_RUN: needs a GPU"
elif [ $built = 0 ]; then
    skip verify-bench "verify kernel vs torch path vs bandwidth floor" "the extension did not build (build.log)"
else
    bench_args=(--batch 1 64 --vocab 128256)
    [ "${FULL:-0}" = "1" ] && bench_args=()
    run_step verify-bench "verify kernel vs torch path vs bandwidth floor (gpu_bench.py)" 90 \
        --md "$OUT/gpu_bench.md" --json "$OUT/gpu_bench.json" \
        -- "$PY" bench/gpu_bench.py --out "$OUT/gpu_bench" "${bench_args[@]}"
fi

echo; cat "$OUT/results.md"
echo; echo "== done in $SECONDS s: status $status; results in $OUT/results.md and results.json"
exit $status
