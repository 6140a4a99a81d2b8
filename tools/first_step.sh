#!/bin/sh
# Time to first step: a graph precompiled once (offline, on one rank) vs compiling and tuning
# in-process on every rank, run alternately REPS times each. Prints every run's split (graph ready,
# bind, weights, step; from the `first step done` line of ./train) and the medians last.
#   tools/first_step.sh PRESET [REPS] [MESH AND TRAIN OPTIONS...]
#   tools/first_step.sh mid 3
#   tools/first_step.sh debug 3 --dp-shard 2 --ep 2          (one rank per visible GPU)
#   tools/first_step.sh tiny 3 --nproc 8 --dp-shard 8 --ep 4 (CPU thread-ranks when no GPU is visible)
# The artifact is made for the same mesh and config (--dp-replicate/--dp-shard/--ep and config fields such
# as --batch go to precompile, which fixes them) and, when a GPU is visible, for CUDA (tuned there).
# Options are written as two words (--batch 4).
set -u
cd "$(dirname "$0")/.." || exit 1
preset=${1:-debug}; reps=${2:-3}; shift; [ $# -gt 0 ] && shift
T=${TMPDIR:-/tmp}/moetrain_first_step; rm -rf "$T"; mkdir -p "$T"
fields=" dp-replicate dp-shard ep $(./precompile --help | sed -n '/^config fields/,/^$/p' | tr ' ' '\n' | sed -n 's/^--//p' | tr '\n' ' ') "
mesh=""; rest=""; prev=""
for a in "$@"; do   # the mesh and config options go to precompile (the artifact fixes them), the rest to both
    case "$fields" in *" ${a#--} "*) prev=$a; continue ;; esac
    if [ -n "$prev" ]; then mesh="$mesh $prev $a"; prev=""; else rest="$rest $a"; fi
done
dev=cpu; if nvidia-smi -L >/dev/null 2>&1; then dev=cuda; fi
t0=$(date +%s.%N)
# shellcheck disable=SC2086
./precompile --preset "$preset" --device $dev $mesh -o "$T/g.mtg" > "$T/precompile.log" 2>&1 || { cat "$T/precompile.log"; exit 1; }
t1=$(date +%s.%N)
echo "precompile --preset $preset --device $dev$mesh: $(awk "BEGIN{printf \"%.2f\", $t1 - $t0}") s (once, offline)"
split() {   # the `first step done` line -> "total graph bind weights step"
    sed -n 's/^first step done \([0-9.]*\) s after launch (graph ready at \([0-9.]*\) s; bind \([0-9.]*\) s, weights \([0-9.]*\) s, step \([0-9.]*\) s).*/\1 \2 \3 \4 \5/p' "$1" | head -n 1
}
i=0
while [ $i -lt "$reps" ]; do
    for how in artifact in-process; do
        # shellcheck disable=SC2086
        if [ $how = artifact ]; then ./train --graph "$T/g.mtg" --steps 1 $rest > "$T/run.log" 2>&1
        else ./train --preset "$preset" --steps 1 "$@" > "$T/run.log" 2>&1; fi
        rc=$?; s=$(split "$T/run.log")
        if [ $rc -ne 0 ] || [ -z "$s" ]; then echo "$how run failed (exit $rc):"; tail -n 5 "$T/run.log"; exit 1; fi
        echo "$how $s" | tee -a "$T/all"
    done
    i=$((i + 1))
done
echo
echo "== time to first step, $preset $* ($dev), median of $reps: seconds =="
awk '
    { n[$1]++; for (k = 2; k <= 6; k++) v[$1, k, n[$1]] = $k }
    function med(h, k,   m, i, j, t, a) { m = n[h]; for (i = 1; i <= m; i++) a[i] = v[h, k, i];
        for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
        return m % 2 ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2 }
    END {
        printf "%-11s %8s %12s %8s %8s %8s\n", "how", "total", "graph ready", "bind", "weights", "step";
        split("artifact in-process", hs, " ");
        for (x = 1; x <= 2; x++) { h = hs[x]; printf "%-11s %8.2f %12.2f %8.2f %8.2f %8.2f\n", h, med(h, 2), med(h, 3), med(h, 4), med(h, 5), med(h, 6) }
        a = med("artifact", 2); b = med("in-process", 2);
        printf "artifact / in-process: total %.2f; graph ready + bind %.2f\n", a / b, (med("artifact", 3) + med("artifact", 4)) / (med("in-process", 3) + med("in-process", 4));
    }' "$T/all"
