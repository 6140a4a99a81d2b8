#!/bin/sh
# Attention side by side: moetrain's kernels (bench/attention.cu: tests, then timing) and torch's
# scaled_dot_product_attention on the cuDNN backend (bench/attention.py), same shapes, same FLOP
# count (the causal half; backward = 2.5 x forward). Prints both outputs, then one table.
#   sh bench/attention.sh            or   make bench-attention
# Environment: BIN (the C bench's binary, built here when missing or older than its sources),
# NVCC, NVFLAGS, LDLIBS (how to build it).
set -u
cd "$(dirname "$0")/.." || exit 1
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
flags=${NVFLAGS:--O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a}
libs=${LDLIBS:--lcublasLt -lnccl}
bin=${BIN:-./bench_attention}
if [ ! -x "$bin" ] || [ bench/attention.cu -nt "$bin" ] || [ moetrain_kernels.cu -nt "$bin" ] || [ moetrain.h -nt "$bin" ]; then
    # shellcheck disable=SC2086
    "$nvcc" $flags -I. -o "$bin" bench/attention.cu $libs || { echo "bench/attention.sh: build failed"; exit 1; }
fi
ours=$("$bin" 2>&1); rc=$?
printf '%s\n' "$ours"
theirs=$(python3 bench/attention.py 2>&1); trc=$?
printf '%s\n' "$theirs"
gpu=$(printf '%s\n' "$ours" | sed -n 's/^device: //p' | head -n 1)
echo
echo "== attention, causal bf16: moetrain vs torch SDPA (cuDNN), TFLOP/s (ms) on ${gpu:-?} =="
{ printf '%s\n' "$ours" | grep '^timing '; printf '%s\n' "$theirs" | grep '^torch-timing '; } | awk '
    function num(s, what,   m) {   # "forward 1.234 ms (123.4 TFLOP/s)" -> "123.4 (1.234)"
        if (!match(s, what " [0-9.]+ ms \\([0-9.]+ TFLOP/s\\)")) return "-";
        m = substr(s, RSTART + length(what) + 1, RLENGTH - length(what) - 1);
        split(m, f, " "); gsub(/\(/, "", f[3]);
        return f[3] " (" f[1] ")";
    }
    {
        torch = ($1 == "torch-timing"); line = $0; sub(/^[a-z-]+ /, "", line);
        key = substr(line, 1, index(line, ":") - 1); rest = substr(line, index(line, ":") + 1);
        if (!(key in seen)) { seen[key] = 1; order[n++] = key; }
        if (torch) { tf[key] = num(rest, "forward"); tb[key] = num(rest, "backward"); }
        else { of[key] = num(rest, "forward"); ob[key] = num(rest, "backward"); }
    }
    END {
        printf "%-38s %-18s %-18s %-18s %-18s\n", "shape", "ours fwd", "cuDNN fwd", "ours bwd", "cuDNN bwd";
        for (i = 0; i < n; i++) {
            k = order[i];
            printf "%-38s %-18s %-18s %-18s %-18s\n", k, (k in of) ? of[k] : "-", (k in tf) ? tf[k] : "-",
                   (k in ob) ? ob[k] : "-", (k in tb) ? tb[k] : "-";
        }
    }'
printf '%s\n' "$ours" | grep '^FLASH_ATTN:'
[ "$rc" -eq 0 ] && [ "$trc" -eq 0 ]
