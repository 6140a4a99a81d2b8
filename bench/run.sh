#!/bin/sh
# The benchmark: each preset in eager (no optimizing passes) and compiled mode,
# on the GPU this machine has. Prints the per-op profile of each compiled run,
# then a short table. Usage: sh bench/run.sh [preset ...]   (default: debug)
# Environment: STEPS (timed steps, default 12), OUT (log folder, default .).
set -u
presets=${*:-debug}
steps=${STEPS:-12}
out=${OUT:-.}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
case "$gpu" in
    *H200*) roof="--roof-tflops 790 --roof-gbps 4300" ;;
    *) roof="--roof-tflops 790 --roof-gbps 3000" ;;
esac
echo "bench: ${gpu:-no GPU}, presets: $presets, $steps steps"
summary=""
for p in $presets; do
    for mode in eager compiled; do
        flag=""; prof=""
        [ "$mode" = eager ] && flag="--eager"
        [ "$mode" = compiled ] && prof="--profile $roof"
        log="$out/bench_${p}_${mode}.log"
        ./train --preset "$p" $flag --steps "$steps" --log-every 4 --seed 1 $prof > "$log" 2>&1
        rc=$?
        tail -n 40 "$log"
        line=$(grep '^summary:' "$log" | tail -n 1)
        [ $rc -ne 0 ] && line="summary: preset=$p mode=$mode FAILED (exit $rc)"
        summary="$summary
$line"
    done
done
echo
echo "== bench table (${gpu:-no GPU}) =="
printf '%s\n' "$summary" | sed '/^$/d' | sed 's/^summary: //'
