#!/usr/bin/env bash
# Long head training in sittings, a snapshot of the head after each (for the tau curve).
#
#   bench/train_sittings.sh OUT MINUTES SITTINGS -- ARGS...
#
# runs `specplug train ARGS --out OUT --minutes MINUTES` SITTINGS times (each later
# sitting with --resume: same data order and LR schedule; an --init HEAD (and --revocab)
# in ARGS starts the first sitting only, the checkpoint holds it after), and after each
# copies the head (config, weights, training.json) to OUT.snapshots/step-NNNNNN. Stops early when the
# schedule is done. Pause it with `kill -STOP -PGID` (e.g. while benchmarking), go on
# with `kill -CONT -PGID`; `kill -TERM` makes the sitting under way checkpoint and exit.
# SPECPLUG (default: `specplug`) is the command to run.
set -uo pipefail
[ $# -ge 4 ] && [ "$4" = "--" ] || { sed -n 2,11p "$0"; exit 2; }
out=$1 minutes=$2 sittings=$3
shift 4
specplug=${SPECPLUG:-specplug}
without_init() {  # ARGS less "--init HEAD" and --revocab (a resumed sitting continues from its checkpoint)
    args=()
    while [ $# -gt 0 ]; do
        case $1 in --init) shift 2 ;; --init=*|--revocab) shift ;; *) args+=("$1"); shift ;; esac
    done
}
for i in $(seq 1 "$sittings"); do
    resume=() args=("$@")
    [ -f "$out/checkpoint/state.json" ] && { resume=(--resume); without_init "$@"; }
    echo "$(date '+%F %T') sitting $i of $sittings${resume:+ (resume)}"
    $specplug train "${args[@]}" --out "$out" --minutes "$minutes" "${resume[@]}"
    rc=$?
    [ $rc -ne 0 ] && { echo "sitting $i ended with exit code $rc"; exit $rc; }
    step=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['steps'])" "$out/training.json")
    snap="$out.snapshots/step-$(printf %06d "$step")"
    mkdir -p "$snap" && cp "$out"/*.json "$out"/*.safetensors "$snap"/ 2>/dev/null
    echo "$(date '+%F %T') snapshot $snap"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d.get('stopped') else 1)" \
        "$out/training.json" || { echo "schedule done"; break; }
done
