#!/bin/sh
# A/B of one switch: PRESET compiled, with and without FLAG (e.g. --no-fold-rope), alternately,
# REPS times each, on one GPU; then the summary lines side by side (median step, tokens/s, MFU, memory).
# Usage: sh bench/ab.sh PRESET REPS FLAG [more train options]
# Environment: STEPS (steps per run; default 20), OUT (log folder, default .).
set -u
[ $# -ge 3 ] || { echo "usage: sh bench/ab.sh PRESET REPS FLAG [train options]"; exit 2; }
preset=$1; reps=$2; flag=$3; shift 3
steps=${STEPS:-20}
out=${OUT:-.}
export NCCL_NVLS_ENABLE=0
a=""; b=""
i=0
while [ "$i" -lt "$reps" ]; do
    for side in A B; do
        extra=""; [ "$side" = B ] && extra=$flag
        log="$out/ab_${preset}_${side}_$i.log"
        ./train --preset "$preset" --nproc 1 --steps "$steps" --log-every 10 --seed 1 $extra "$@" > "$log" 2>&1 ||
            { echo "ab: run $side $i failed:"; tail -n 5 "$log"; exit 1; }
        line=$(grep '^summary:' "$log" | tail -n 1 | sed 's/^summary: //')
        if [ "$side" = A ]; then a="$a
A (default)   $line"; else b="$b
B ($flag)  $line"; fi
    done
    i=$((i + 1))
done
echo "== $preset: A = default, B = $flag ($steps steps a run) =="
printf '%s\n%s\n' "$a" "$b" | sed '/^$/d'
