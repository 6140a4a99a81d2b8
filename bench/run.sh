#!/bin/sh
# The benchmark: each preset in eager (no optimizing passes) and compiled mode
# on one GPU; with several GPUs visible, also compiled on all of them (FSDP
# over dp_shard = GPUs, experts over ep = GPUs) with the per-op profile of
# rank 0. Prints each compiled run's profile, then a short table.
# Usage: sh bench/run.sh [preset ...]   (default: debug)
# Environment: STEPS (timed steps, default 12), OUT (log folder, default .),
#              MODES (default "eager compiled"), MULTI (GPUs for the multi-GPU row; default all, 0 = none).
# Exits non-zero when a run fails (or prints no summary line); the table still shows every row.
set -u
presets=${*:-debug}
steps=${STEPS:-12}
out=${OUT:-.}
modes=${MODES:-eager compiled}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
multi=${MULTI:-$gpus}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
case "$gpu" in
    *H200*) roof="--roof-tflops 790 --roof-gbps 4300" ;;
    *) roof="--roof-tflops 790 --roof-gbps 3000" ;;
esac
export NCCL_NVLS_ENABLE=0
echo "bench: ${gpu:-no GPU} x $gpus, presets: $presets, $steps steps"
summary=""
failed=0
run() {   # run NAME ARGS...: one training run, its log, its summary line
    name=$1; shift
    log="$out/bench_${name}.log"
    ./train "$@" --steps "$steps" --log-every 4 --seed 1 > "$log" 2>&1
    rc=$?
    tail -n 45 "$log"
    line=$(grep '^summary:' "$log" | tail -n 1)
    if [ $rc -ne 0 ] || [ -z "$line" ]; then line="summary: $name FAILED (exit $rc)"; failed=$((failed + 1)); fi
    summary="$summary
$line"
}
for p in $presets; do
    for mode in $modes; do
        flag=""; prof=""
        [ "$mode" = eager ] && flag="--eager"
        [ "$mode" = compiled ] && prof="--profile $roof"
        run "${p}_${mode}" --preset "$p" --nproc 1 $flag $prof
    done
    if [ "$multi" -gt 1 ]; then
        run "${p}_${multi}gpu" --preset "$p" --nproc "$multi" --ep "$multi" --profile $roof --metrics "$out/bench_${p}_${multi}gpu.jsonl"
    fi
done
echo
echo "== bench table (${gpu:-no GPU} x $gpus) =="
printf '%s\n' "$summary" | sed '/^$/d' | sed 's/^summary: //'
if [ "$failed" -ne 0 ]; then echo "bench: $failed run(s) FAILED"; exit 1; fi
