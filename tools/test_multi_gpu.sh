#!/bin/sh
# Multi-GPU checks of the command line, on every visible GPU (2 or more):
# the torchrun-free launcher, torchrun, a precompiled artifact, and failure
# (kill -9 of one rank, a rank that hangs). Prints "N passed, N failed" last.
# REQUIRE_GPUS=N: fewer than N visible GPUs is a failure, not a skip.
set -u
n=$(nvidia-smi -L 2>/dev/null | wc -l)
need=${REQUIRE_GPUS:-0}
case "$need" in ''|*[!0-9]*) echo "FAIL REQUIRE_GPUS='$need' is not a number"; echo "0 passed, 1 failed"; exit 1 ;; esac
if [ "$n" -lt "$need" ]; then echo "FAIL multi-GPU command-line checks: REQUIRE_GPUS=$need, $n GPU visible"; echo "0 passed, 1 failed"; exit 1; fi
pass=0; fail=0
check() {   # check NAME CONDITION-EXIT-STATUS DETAIL
    if [ "$2" -eq 0 ]; then echo "PASS $1 $3"; pass=$((pass + 1)); else echo "FAIL $1 $3"; fail=$((fail + 1)); fi
}
if [ "$n" -lt 2 ]; then echo "SKIP multi-GPU command-line checks: $n GPU visible"; echo "0 passed, 0 failed"; exit 0; fi
export NCCL_NVLS_ENABLE=0
T=${TMPDIR:-/tmp}/moetrain_mgpu; rm -rf "$T"; mkdir -p "$T"
losses() { grep '^step' "$1" | sed 's/ | grad_norm.*//'; }
steps=6
only=${ONLY:-1 2 3 4 5 6}   # which checks to run
want() { case " $only " in *" $1 "*) return 0 ;; esac; return 1; }

# 1. ./train alone: one rank per GPU, and the same losses as one GPU on the global batch (bf16: 2%)
if want 1; then
./train --preset debug --steps $steps --seed 1 > "$T/a.log" 2>&1; ra=$?
./train --preset debug --nproc 1 --batch $((8 * n)) --steps $steps --seed 1 > "$T/b.log" 2>&1; rb=$?
grep -q "ranks: $n (one process per GPU, NCCL)" "$T/a.log"; banner=$?
losses "$T/a.log" | awk '{print $5}' > "$T/la"; losses "$T/b.log" | awk '{print $5}' > "$T/lb"
worst=$(paste "$T/la" "$T/lb" | awk 'BEGIN{w=0;n=0} {r=($1-$2)/$2; if(r<0)r=-r; if(r>w)w=r; n++} END{if(n=='$steps') printf "%.2e", w; else print "missing"}')
[ $ra -eq 0 ] && [ $rb -eq 0 ] && [ $banner -eq 0 ] && [ "$worst" != missing ] && awk "BEGIN{exit !($worst < 0.02)}"
check "./train alone uses all $n GPUs; losses = 1 GPU on the global batch" $? "(worst relative $worst)"
fi

# 2. torchrun, the same ranks: bitwise the self-launched run
if want 2 && ! want 1; then ./train --preset debug --steps $steps --seed 1 > "$T/a.log" 2>&1; fi
if ! want 2; then :
elif command -v torchrun >/dev/null 2>&1; then
    torchrun --standalone --nproc_per_node "$n" --no-python ./train --preset debug --steps $steps --seed 1 > "$T/c.log" 2>&1; rc=$?
    losses "$T/a.log" > "$T/la2"; losses "$T/c.log" > "$T/lc"
    [ $rc -eq 0 ] && [ -s "$T/lc" ] && cmp -s "$T/la2" "$T/lc"
    check "torchrun --no-python ./train = ./train alone, bitwise" $? "(exit $rc)"
else
    echo "SKIP torchrun is not installed"
fi

# 3. precompiled on one process for the mesh, loaded by every rank: bitwise in-process
if want 3; then
./precompile --preset debug --device cuda --dp-shard "$n" --ep "$n" -o "$T/d.mtg" > "$T/p.log" 2>&1 &&
    ./train --graph "$T/d.mtg" --steps $steps --seed 1 > "$T/d.log" 2>&1; rd=$?
./train --preset debug --ep "$n" --steps $steps --seed 1 > "$T/e.log" 2>&1; re=$?
losses "$T/d.log" > "$T/ld"; losses "$T/e.log" > "$T/le"
[ $rd -eq 0 ] && [ $re -eq 0 ] && [ -s "$T/ld" ] && cmp -s "$T/ld" "$T/le"
check "precompile --dp-shard $n --ep $n, train --graph = in-process, bitwise" $? "(exit $rd $re)"
./train --graph "$T/d.mtg" --nproc 1 --steps 1 > "$T/w.log" 2>&1; rw=$?
[ $rw -eq 2 ] && grep -q "world of $n" "$T/w.log"
check "an artifact for $n ranks refuses a 1-rank launch" $? "(exit $rw)"
fi

# 6. the end-to-end check: precompiled on GPU 1 (and on GPU 0: the same bytes) vs compiled and tuned in-process on every
#    rank, debug, dp_shard = ep = n, 10 steps, fixed seed: losses and grad norms bitwise; time to first step of each
if want 6; then
./precompile --preset debug --device cuda --gpu 0 --dp-shard "$n" --ep "$n" -o "$T/g0.mtg" > "$T/g0.log" 2>&1; r0=$?
./precompile --preset debug --device cuda --gpu 1 --dp-shard "$n" --ep "$n" -o "$T/g1.mtg" > "$T/g1.log" 2>&1; r1=$?
[ $r0 -eq 0 ] && [ $r1 -eq 0 ] && cmp -s "$T/g0.mtg" "$T/g1.mtg"
check "precompile --gpu 0 and --gpu 1: byte-identical artifacts" $? "($(grep -m1 tuned "$T/g1.log"))"
./train --graph "$T/g1.mtg" --steps 10 --seed 1 --metrics "$T/m1.jsonl" > "$T/t1.log" 2>&1; ra=$?
./train --graph "$T/g0.mtg" --steps 10 --seed 1 --metrics "$T/m0.jsonl" > "$T/t0.log" 2>&1; rb=$?
./train --preset debug --dp-shard "$n" --ep "$n" --steps 10 --seed 1 --metrics "$T/mi.jsonl" > "$T/ti.log" 2>&1; rc=$?
core() { sed 's/,"tokens_per_s".*//' "$1"; }
core "$T/m1.jsonl" > "$T/c1"; core "$T/m0.jsonl" > "$T/c0"; core "$T/mi.jsonl" > "$T/ci"
echo "  step | precompiled (GPU 1): loss, grad_norm | in-process: loss, grad_norm"
paste -d'|' "$T/c1" "$T/ci" | sed 's/{"step":\([0-9]*\),"loss":\([^,]*\),"grad_norm":\([^,]*\),"lr":[^|]*|{"step":[0-9]*,"loss":\([^,]*\),"grad_norm":\([^,]*\),.*/  \1 | \2 \3 | \4 \5/'
[ $ra -eq 0 ] && [ $rb -eq 0 ] && [ $rc -eq 0 ] && [ "$(wc -l < "$T/c1")" -eq 10 ] && cmp -s "$T/c1" "$T/ci" && cmp -s "$T/c1" "$T/c0"
check "debug dp_shard $n ep $n, 10 steps: precompiled (GPU 1, GPU 0) = in-process, losses and grad norms bitwise" $? "(exit $ra $rb $rc)"
f1=$(grep -m1 'first step done' "$T/t1.log" | awk '{print $4}'); fi_=$(grep -m1 'first step done' "$T/ti.log" | awk '{print $4}')
echo "  time to first step: artifact $f1 s, in-process compile + tune $fi_ s | $(grep -m1 'GEMM kernels' "$T/t1.log" | sed 's/.*| //')"
fi

# 4. kill -9 of one rank: every rank stops within 10 s, non-zero exit, the rank named
wait_steps() { i=0; while [ $i -lt 600 ] && ! grep -q '^step' "$1"; do sleep 0.2; i=$((i + 1)); done; }
if want 4; then
./train --preset debug --steps 1000000 --log-every 50 --seed 1 > "$T/k.log" 2>&1 &
sup=$!
wait_steps "$T/k.log"
victim=$(pgrep -P $sup | sort -n | tail -n 1)
t0=$(date +%s.%N); kill -9 "$victim"
i=0; while kill -0 $sup 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
kill -0 $sup 2>/dev/null && { pkill -KILL -P $sup; kill -KILL $sup; }
wait $sup; rk=$?; t1=$(date +%s.%N)
dt=$(awk "BEGIN{printf \"%.2f\", $t1 - $t0}")
left=$(pgrep -P $sup | wc -l)
[ $rk -ne 0 ] && [ "$left" -eq 0 ] && awk "BEGIN{exit !($dt < 10)}" && grep -q "killed by signal 9" "$T/k.log"
check "kill -9 of one rank stops every rank" $? "(${dt} s, exit $rk, $(grep -m1 'stopping' "$T/k.log" | cut -c1-100))"
fi

# 5. a rank that hangs (SIGSTOP) with --timeout 5: every rank stops
if want 5; then
./train --preset debug --steps 1000000 --log-every 50 --seed 1 --timeout 5 > "$T/h.log" 2>&1 &
sup=$!
wait_steps "$T/h.log"
victim=$(pgrep -P $sup | sort -n | tail -n 1)
t0=$(date +%s.%N); kill -STOP "$victim"
i=0; while kill -0 $sup 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
kill -0 $sup 2>/dev/null && { pkill -KILL -P $sup; kill -KILL $sup; }
wait $sup; rh=$?; t1=$(date +%s.%N)
dt=$(awk "BEGIN{printf \"%.2f\", $t1 - $t0}")
[ $rh -ne 0 ] && awk "BEGIN{exit !($dt < 15)}" && grep -q "no progress" "$T/h.log"
check "a hung rank (SIGSTOP, --timeout 5) stops every rank" $? "(${dt} s, exit $rh)"
fi

cp "$T"/*.log "${OUT:-$T}/" 2>/dev/null
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
