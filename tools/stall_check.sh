#!/bin/sh
# The in-process multi-GPU tests (thread-ranks in one process, a GPU each), run again and again, each run
# bounded: counts the runs that pass, fail, or stall (no exit within the bound; the process is then killed).
# usage: sh tools/stall_check.sh [RUNS] [SECONDS]   (defaults 50 and 90; ./test_gpu built, 2+ GPUs visible)
# ./test_gpu loads CUDA modules eagerly unless CUDA_MODULE_LOADING is set: CUDA_MODULE_LOADING=LAZY sh
# tools/stall_check.sh runs the same loop with lazy loading, to compare. The tests bound a device-side wait for
# a peer at 30 s: a stall there ends as a FAIL naming the peer, though the run may take a minute more to end.
# A stalled run gets SIGUSR2 (./test_gpu prints every thread's stack to its log, kept as stall_RUN_TEST.log under
# ${TMPDIR:-/tmp}/moetrain_stall) and 60 s more to end on its own (a device-side wait ends at 30 s) before it is
# killed. STALL_TESTS picks the tests (default "moe_chunks multi_rank").
# A stop by SIGTERM or SIGINT (timeout 300 sh tools/stall_check.sh 1000) still prints the summary of the runs
# that ended. Prints "N passed, N failed" last (a stall counts as failed).
set -u
runs=${1:-50}; bound=${2:-90}
for v in "$runs" "$bound"; do
    case "$v" in ''|*[!0-9]*|0) echo "FAIL stall check: '$v' is not a positive number"; echo "0 passed, 1 failed"; exit 1 ;; esac
done
[ -x ./test_gpu ] || { echo "FAIL stall check: ./test_gpu not built (make test_gpu)"; echo "0 passed, 1 failed"; exit 1; }
n=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$n" -lt 2 ]; then echo "SKIP stall check: $n GPU visible"; echo "0 passed, 0 failed"; exit 0; fi
export NCCL_NVLS_ENABLE=0
T=${TMPDIR:-/tmp}/moetrain_stall; rm -rf "$T"; mkdir -p "$T"
pass=0; fail=0; stall=0; i=0; t_start=$(date +%s)
summary() {
    echo "stall check: ${CUDA_MODULE_LOADING:-EAGER (set by test_gpu)} module loading, $((pass + fail)) runs in $(( $(date +%s) - t_start )) s, ${bound} s at most each: $stall stalled"
    echo "$pass passed, $fail failed"
}
trap 'kill -9 "$pid" 2>/dev/null; summary; exit 1' TERM INT
pid=
while [ "$i" -lt "$runs" ]; do
    i=$((i + 1))
    for t in ${STALL_TESTS:-moe_chunks multi_rank}; do
        MT_TEST_ONLY=$t ./test_gpu > "$T/run.log" 2>&1 &
        pid=$!; s=0
        while kill -0 "$pid" 2>/dev/null && [ "$s" -lt "$bound" ]; do sleep 1; s=$((s + 1)); done
        if kill -0 "$pid" 2>/dev/null; then
            stall=$((stall + 1)); fail=$((fail + 1))
            echo "FAIL run $i, $t: no exit in $bound s after $(grep -c '^PASS' "$T/run.log") checks; last: $(grep -E '^(PASS|FAIL)' "$T/run.log" | tail -1 | cut -c1-100)"
            for d in /proc/$pid/task/*; do echo "  thread ${d##*/} $(cat $d/comm 2>/dev/null) waits in $(cat $d/wchan 2>/dev/null)"; done
            kill -USR2 "$pid" 2>/dev/null
            while kill -0 "$pid" 2>/dev/null && [ "$s" -lt $((bound + 60)) ]; do sleep 1; s=$((s + 1)); done
            if kill -0 "$pid" 2>/dev/null; then echo "  still running after $s s: killed"; kill -9 "$pid" 2>/dev/null
            else echo "  ended on its own after $s s: $(grep -E '^(PASS|FAIL)' "$T/run.log" | tail -1 | cut -c1-160)"; fi
            wait "$pid" 2>/dev/null
            cp "$T/run.log" "$T/stall_${i}_$t.log"
        elif wait "$pid" && ! grep -q '^FAIL' "$T/run.log"; then
            pass=$((pass + 1))
        else
            fail=$((fail + 1)); echo "FAIL run $i, $t: $(grep '^FAIL' "$T/run.log" | head -1 | cut -c1-160)"
        fi
    done
done
summary
[ "$fail" -eq 0 ]
