#!/bin/sh
# Meshes side by side on this machine's GPUs: each preset on one GPU, then on two as dp_shard 2 x ep 2,
# tp 2, and tp 2 x ep 2 (compiled, --seed 1), and a table of the summary lines (median step, tokens/s
# in all and per GPU, MFU, peak memory per GPU). Exits non-zero when a run fails.
# Usage: sh bench/meshes.sh [preset ...]   (default: debug mid)
# Environment: STEPS (default 10), OUT (log folder, default .).
set -u
presets=${*:-debug mid}
steps=${STEPS:-10}
out=${OUT:-.}
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 2 ] || { echo "meshes: needs 2 GPUs, sees $gpus"; exit 1; }
table=""; failed=0
for p in $presets; do
    for mesh in "1gpu:--nproc 1" "dp2ep2:--nproc 2 --dp-shard 2 --ep 2" "tp2:--nproc 2 --tp 2" "tp2ep2:--nproc 2 --tp 2 --ep 2"; do
        name=${mesh%%:*}; flags=${mesh#*:}
        log="$out/mesh_${p}_$name.log"
        if ./train --preset "$p" $flags --steps "$steps" --log-every 1 --seed 1 > "$log" 2>&1; then
            line=$(grep '^summary:' "$log" | tail -n 1 | sed 's/^summary: //')
        else
            line="preset=$p FAILED (exit $?): $(tail -n 1 "$log")"; failed=1
        fi
        table="$table
$p $name: $line"
    done
done
echo "== meshes ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1) x $gpus, $steps steps) =="
printf '%s\n' "$table" | sed '/^$/d'
exit $failed
