#!/bin/sh
# Multi-GPU checks of the command line, on every visible GPU (2 or more):
# the torchrun-free launcher, torchrun, a precompiled artifact, failure (kill -9
# of one rank, a rank that hangs), ranks from srun's and mpirun's variables on
# two one-GPU "nodes" over sockets, tensor parallelism, and the device-side
# expert exchange (bitwise the host-synchronized one; the fallback over
# sockets; a dead or hung peer in the middle of it; with MoE layers in 2 chunks of tokens; with FP8 GEMMs). Prints "N passed,
# N failed" last. REQUIRE_GPUS=N: fewer than N visible GPUs is a failure, not a skip.
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
core() { sed 's/,"tokens_per_s".*//' "$1"; }   # a metrics line's loss, grad norm and lr
steps=6
# dev_host P FLAGS...: debug, 10 steps, the device-side exchange ($T/P_d) and the host-synchronized one ($T/P_h);
# sets rd and rh (exits) and same (0: every saved tensor file equal), writes the metrics' cores to $T/P_cd, $T/P_ch
dev_host() {
    p=$1; shift
    ./train --preset debug "$@" --steps 10 --seed 1 --metrics "$T/${p}_d.jsonl" --save "$T/${p}_d" > "$T/${p}_d.log" 2>&1; rd=$?
    ./train --preset debug "$@" --ep-exchange host --steps 10 --seed 1 --metrics "$T/${p}_h.jsonl" --save "$T/${p}_h" > "$T/${p}_h.log" 2>&1; rh=$?
    core "$T/${p}_d.jsonl" > "$T/${p}_cd"; core "$T/${p}_h.jsonl" > "$T/${p}_ch"
    same=0; for f in "$T/${p}_d"/*.safetensors; do cmp -s "$f" "$T/${p}_h/$(basename "$f")" || same=1; done
}
only=${ONLY:-1 2 3 4 5 6 7 8 9 10 11 12 13}   # which checks to run
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
core "$T/m1.jsonl" > "$T/c1"; core "$T/m0.jsonl" > "$T/c0"; core "$T/mi.jsonl" > "$T/ci"
echo "  step | precompiled (GPU 1): loss, grad_norm | in-process: loss, grad_norm"
paste -d'|' "$T/c1" "$T/ci" | sed 's/{"step":\([0-9]*\),"loss":\([^,]*\),"grad_norm":\([^,]*\),"lr":[^|]*|{"step":[0-9]*,"loss":\([^,]*\),"grad_norm":\([^,]*\),.*/  \1 | \2 \3 | \4 \5/'
[ $ra -eq 0 ] && [ $rb -eq 0 ] && [ $rc -eq 0 ] && [ "$(wc -l < "$T/c1")" -eq 10 ] && cmp -s "$T/c1" "$T/ci" && cmp -s "$T/c1" "$T/c0"
check "debug dp_shard $n ep $n, 10 steps: precompiled (GPU 1, GPU 0) = in-process, losses and grad norms bitwise" $? "(exit $ra $rb $rc)"
f1=$(grep -m1 'first step done' "$T/t1.log" | awk '{print $4}'); fi_=$(grep -m1 'first step done' "$T/ti.log" | awk '{print $4}')
echo "  time to first step: artifact $f1 s, in-process compile + tune $fi_ s | $(grep -m1 'GEMM kernels' "$T/t1.log" | sed 's/.*| //')"
fi

# 7. launchers beyond torchrun: two one-GPU "nodes" talking over sockets (no P2P, no shared memory), each
#    process finding its rank from srun's variables alone, then from mpirun's: bitwise the self-launched run
#    on the same two GPUs and transport (losses and grad norms)
if want 7; then
sock="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
clean="env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u MOETRAIN_PORT -u SLURM_STEP_NODELIST"
$clean $sock CUDA_VISIBLE_DEVICES=0,1 ./train --preset debug --nproc 2 --steps $steps --seed 1 --metrics "$T/n0.jsonl" > "$T/n0.log" 2>&1; rn=$?
core "$T/n0.jsonl" > "$T/c_n0"
two_nodes() {   # two_nodes NAME VARIABLES-OF-RANK-0 VARIABLES-OF-RANK-1
    $clean $sock CUDA_VISIBLE_DEVICES=0 $2 ./train --preset debug --steps $steps --seed 1 --metrics "$T/$1.jsonl" > "$T/$1_0.log" 2>&1 &
    p0=$!
    $clean $sock CUDA_VISIBLE_DEVICES=1 $3 ./train --preset debug --steps $steps --seed 1 > "$T/$1_1.log" 2>&1 &
    p1=$!
    wait $p0; x0=$?; wait $p1; x1=$?
    core "$T/$1.jsonl" > "$T/c_$1"
    [ $rn -eq 0 ] && [ $x0 -eq 0 ] && [ $x1 -eq 0 ] && [ "$(wc -l < "$T/c_n0")" -eq $steps ] && cmp -s "$T/c_n0" "$T/c_$1"
}
slurm="SLURM_STEP_ID=0 SLURM_JOB_ID=$$ SLURM_JOB_NODELIST=127.0.0.1 SLURM_NTASKS=2 SLURM_LOCALID=0"
two_nodes slurm "$slurm SLURM_PROCID=0" "$slurm SLURM_PROCID=1"
check "srun's variables: 2 one-GPU nodes over sockets = ./train --nproc 2, bitwise" $? "(exit $rn $x0 $x1; $(grep -m1 '^launch:' "$T/slurm_1.log"))"
mpi="OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + $$ % 10000))"
two_nodes mpi "$mpi OMPI_COMM_WORLD_RANK=0" "$mpi OMPI_COMM_WORLD_RANK=1"
check "mpirun's variables: 2 one-GPU nodes over sockets = ./train --nproc 2, bitwise" $? "(exit $rn $x0 $x1; $(grep -m1 '^launch:' "$T/mpi_1.log"))"
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

# 8. tensor parallelism: debug with tp = n (and with ep = n too) precompiled on one process = in-process, 10 steps,
#    losses and grad norms bitwise; the losses within bf16 tolerance (2%) of one GPU on the same global batch
#    (dp = 1: the same batch). With 8 GPUs also the seeds' mesh, dp_shard 4 x tp 2 x ep 4.
if want 8; then
tpcheck() {   # tpcheck NAME MESH-FLAGS...
    name=$1; shift
    ./precompile --preset debug --device cuda "$@" -o "$T/tp_$name.mtg" > "$T/tp_p_$name.log" 2>&1 &&
        ./train --graph "$T/tp_$name.mtg" --steps 10 --seed 1 --metrics "$T/tp_g_$name.jsonl" > "$T/tp_g_$name.log" 2>&1; rg=$?
    ./train --preset debug "$@" --steps 10 --seed 1 --metrics "$T/tp_i_$name.jsonl" > "$T/tp_i_$name.log" 2>&1; ri=$?
    core "$T/tp_g_$name.jsonl" > "$T/tp_cg"; core "$T/tp_i_$name.jsonl" > "$T/tp_ci"
    [ $rg -eq 0 ] && [ $ri -eq 0 ] && [ "$(wc -l < "$T/tp_cg")" -eq 10 ] && cmp -s "$T/tp_cg" "$T/tp_ci"
    check "debug $*, 10 steps: precompiled = in-process, losses and grad norms bitwise" $? "(exit $rg $ri)"
}
tpcheck tp --tp "$n"
tpcheck tpep --tp "$n" --ep "$n"
./train --preset debug --nproc 1 --steps 10 --seed 1 > "$T/tp_one.log" 2>&1; r1=$?
losses "$T/tp_i_tp.log" | awk '{print $5}' > "$T/la"; losses "$T/tp_one.log" | awk '{print $5}' > "$T/lb"
worst=$(paste "$T/la" "$T/lb" | awk 'BEGIN{w=0;n=0} {r=($1-$2)/$2; if(r<0)r=-r; if(r>w)w=r; n++} END{if(n==10) printf "%.2e", w; else print "missing"}')
[ $r1 -eq 0 ] && [ "$worst" != missing ] && awk "BEGIN{exit !($worst < 0.02)}"
check "debug --tp $n: losses = one GPU on the same batch (bf16: 2%)" $? "(worst relative $worst)"
if [ "$n" -ge 8 ]; then tpcheck seeds --dp-shard 4 --tp 2 --ep 4; fi
fi

# 9. the device-side expert exchange (NCCL symmetric memory, one CUDA graph a step, no host sync) against the
#    host-synchronized one: debug with dp_shard n x ep n and tp n x ep n, 10 steps: losses, grad norms and every
#    weight and moment (the saved checkpoints) bitwise; and precompiled = in-process with it
if want 9; then
excheck() {   # excheck NAME MESH-FLAGS...
    name=$1; shift
    ./train --preset debug "$@" --steps 10 --seed 1 --metrics "$T/x_d_$name.jsonl" --save "$T/x_d_$name" > "$T/x_d_$name.log" 2>&1; rd=$?
    ./train --preset debug "$@" --ep-exchange host --steps 10 --seed 1 --metrics "$T/x_h_$name.jsonl" --save "$T/x_h_$name" > "$T/x_h_$name.log" 2>&1; rh=$?
    core "$T/x_d_$name.jsonl" > "$T/x_cd"; core "$T/x_h_$name.jsonl" > "$T/x_ch"
    same=0; for f in "$T/x_d_$name"/*.safetensors; do cmp -s "$f" "$T/x_h_$name/$(basename "$f")" || same=1; done
    grep -q "^expert exchange: device-side" "$T/x_d_$name.log" && grep -q "graph: the step is one CUDA graph (captured at step 2), 0 host syncs" "$T/x_d_$name.log" &&
        grep -q "host_syncs=0" "$T/x_d_$name.log" && grep -q "^expert exchange: host-synchronized" "$T/x_h_$name.log"; banner=$?
    [ $rd -eq 0 ] && [ $rh -eq 0 ] && [ $banner -eq 0 ] && [ $same -eq 0 ] && [ "$(wc -l < "$T/x_cd")" -eq 10 ] && cmp -s "$T/x_cd" "$T/x_ch"
    check "debug $*, 10 steps: device-side exchange (one graph, 0 host syncs) = host-synchronized, losses, grad norms, weights bitwise" $? \
        "(exit $rd $rh; $(grep -o 'median_step_ms=[^ ]*' "$T/x_d_$name.log") vs $(grep -o 'median_step_ms=[^ ]*' "$T/x_h_$name.log"))"
}
excheck dpep --dp-shard "$n" --ep "$n"
excheck tpep --tp "$n" --ep "$n"
./precompile --preset debug --device cuda --dp-shard "$n" --ep "$n" -o "$T/x.mtg" > "$T/x_p.log" 2>&1 &&
    ./train --graph "$T/x.mtg" --steps 10 --seed 1 --metrics "$T/x_g.jsonl" > "$T/x_g.log" 2>&1; rg=$?
core "$T/x_g.jsonl" > "$T/x_cg"; core "$T/x_d_dpep.jsonl" > "$T/x_cd"
[ $rg -eq 0 ] && grep -q "^expert exchange: device-side" "$T/x_g.log" && [ "$(wc -l < "$T/x_cg")" -eq 10 ] && cmp -s "$T/x_cg" "$T/x_cd"
check "the device-side exchange from an artifact = in-process, bitwise" $? "(exit $rg)"
fi

# 10. two one-GPU "nodes" over sockets: no load/store access, so the host-synchronized exchange is chosen (and
#    named), and the losses and grad norms are bitwise those of the device-side exchange over NVLink
if want 10; then
sock="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1"
clean="env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u MOETRAIN_PORT -u SLURM_STEP_NODELIST"
port=$((21000 + $$ % 10000))
$clean $sock CUDA_VISIBLE_DEVICES=0 RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    ./train --preset debug --ep 2 --steps $steps --seed 1 --metrics "$T/f_s.jsonl" > "$T/f_s0.log" 2>&1 &
p0=$!
$clean $sock CUDA_VISIBLE_DEVICES=1 RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    ./train --preset debug --ep 2 --steps $steps --seed 1 > "$T/f_s1.log" 2>&1 &
p1=$!
wait $p0; x0=$?; wait $p1; x1=$?
$clean CUDA_VISIBLE_DEVICES=0,1 ./train --preset debug --nproc 2 --ep 2 --steps $steps --seed 1 --metrics "$T/f_n.jsonl" > "$T/f_n.log" 2>&1; rn=$?
core "$T/f_s.jsonl" > "$T/f_cs"; core "$T/f_n.jsonl" > "$T/f_cn"
[ $x0 -eq 0 ] && [ $x1 -eq 0 ] && [ $rn -eq 0 ] && grep -q "^expert exchange: host-synchronized" "$T/f_s0.log" &&
    grep -q "^expert exchange: device-side" "$T/f_n.log" && [ "$(wc -l < "$T/f_cs")" -eq $steps ] && cmp -s "$T/f_cs" "$T/f_cn"
check "over sockets the host-synchronized exchange is chosen; losses = the device-side exchange over NVLink, bitwise" $? \
    "(exit $x0 $x1 $rn; $(grep -m1 '^expert exchange' "$T/f_s0.log" | cut -c1-120))"
fi

# 11. a peer lost in the middle of the device-side exchange: kill -9 stops every rank within 10 s; a peer that
#    hangs (SIGSTOP) with --timeout 5 stops every rank within 15 s (the device-side waits are bounded too)
if want 11; then
for sig in KILL STOP; do
    ./train --preset debug --ep "$n" --steps 1000000 --log-every 50 --seed 1 --timeout 5 > "$T/xk_$sig.log" 2>&1 &
    sup=$!
    wait_steps "$T/xk_$sig.log"
    grep -q "^expert exchange: device-side" "$T/xk_$sig.log"; dev=$?
    victim=$(pgrep -P $sup | sort -n | tail -n 1)
    t0=$(date +%s.%N); kill -$sig "$victim"
    i=0; while kill -0 $sup 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
    kill -0 $sup 2>/dev/null && { pkill -KILL -P $sup; kill -KILL $sup; }
    wait $sup; rk=$?; t1=$(date +%s.%N)
    dt=$(awk "BEGIN{printf \"%.2f\", $t1 - $t0}")
    left=$(pgrep -P $sup | wc -l)
    lim=10; [ $sig = STOP ] && lim=15
    [ $dev -eq 0 ] && [ $rk -ne 0 ] && [ "$left" -eq 0 ] && awk "BEGIN{exit !($dt < $lim)}"
    check "kill -$sig of a rank during device-side exchanges stops every rank" $? "(${dt} s, exit $rk, $(grep -m1 'stopping\|no progress\|did not answer' "$T/xk_$sig.log" | cut -c1-110))"
done
fi

# 12. MoE layers in 2 chunks of tokens (--moe-chunks 2: two exchanges a layer in flight): the device-side exchange
#    against the host-synchronized one on dp_shard 2 x ep 2, 10 steps, losses, grad norms, every weight and moment
#    bitwise; and precompiled = in-process
if want 12; then
mc="--nproc 2 --dp-shard 2 --ep 2 --moe-chunks 2"
dev_host c $mc
grep -q "MoE in 2 chunks of tokens" "$T/c_d.log" && grep -q "^expert exchange: device-side" "$T/c_d.log" &&
    grep -q "graph: the step is one CUDA graph (captured at step 2), 0 host syncs" "$T/c_d.log" && grep -q "host_syncs=0" "$T/c_d.log" &&
    grep -q "^expert exchange: host-synchronized" "$T/c_h.log"; banner=$?
[ $rd -eq 0 ] && [ $rh -eq 0 ] && [ $banner -eq 0 ] && [ $same -eq 0 ] && [ "$(wc -l < "$T/c_cd")" -eq 10 ] && cmp -s "$T/c_cd" "$T/c_ch"
check "debug $mc, 10 steps: device-side exchange = host-synchronized, losses, grad norms, weights bitwise" $? \
    "(exit $rd $rh; $(grep -o 'median_step_ms=[^ ]*' "$T/c_d.log") vs $(grep -o 'median_step_ms=[^ ]*' "$T/c_h.log"))"
./precompile --preset debug --device cuda --dp-shard 2 --ep 2 --moe-chunks 2 -o "$T/c.mtg" > "$T/c_p.log" 2>&1 &&
    ./train --graph "$T/c.mtg" --nproc 2 --steps 10 --seed 1 --metrics "$T/c_g.jsonl" > "$T/c_g.log" 2>&1; rg=$?
core "$T/c_g.jsonl" > "$T/c_cg"
[ $rg -eq 0 ] && grep -q "MoE in 2 chunks of tokens" "$T/c_g.log" && [ "$(wc -l < "$T/c_cg")" -eq 10 ] && cmp -s "$T/c_cg" "$T/c_cd"
check "--moe-chunks 2 from an artifact = in-process, bitwise" $? "(exit $rg)"
fi

# 13. FP8 GEMMs (--fp8; operands quantized once for several nodes) on dp_shard 2 x ep 2: the device-side exchange
#    against the host-synchronized one, 10 steps, losses, grad norms, weights bitwise; precompiled = in-process;
#    --fp8-wgrad bf16 from an artifact = in-process
if want 13; then
f8="--nproc 2 --dp-shard 2 --ep 2 --fp8"
dev_host f $f8
grep -q "GEMMs in FP8" "$T/f_d.log" && grep -q "^expert exchange: device-side" "$T/f_d.log" && grep -q "host_syncs=0" "$T/f_d.log"; banner=$?
[ $rd -eq 0 ] && [ $rh -eq 0 ] && [ $banner -eq 0 ] && [ $same -eq 0 ] && [ "$(wc -l < "$T/f_cd")" -eq 10 ] && cmp -s "$T/f_cd" "$T/f_ch"
check "debug $f8, 10 steps: device-side exchange = host-synchronized, losses, grad norms, weights bitwise" $? \
    "(exit $rd $rh; $(grep -o 'median_step_ms=[^ ]*' "$T/f_d.log") vs $(grep -o 'median_step_ms=[^ ]*' "$T/f_h.log"))"
./precompile --preset debug --device cuda --dp-shard 2 --ep 2 --fp8 -o "$T/f.mtg" > "$T/f_p.log" 2>&1 &&
    ./train --graph "$T/f.mtg" --nproc 2 --steps 10 --seed 1 --metrics "$T/f_g.jsonl" > "$T/f_g.log" 2>&1; rg=$?
core "$T/f_g.jsonl" > "$T/f_cg"
./precompile --preset debug --device cuda --dp-shard 2 --ep 2 --fp8 --fp8-wgrad bf16 -o "$T/w.mtg" > "$T/w_p.log" 2>&1 &&
    ./train --graph "$T/w.mtg" --nproc 2 --steps 10 --seed 1 --metrics "$T/w_g.jsonl" > "$T/w_g.log" 2>&1; rw=$?
./train --preset debug $f8 --fp8-wgrad bf16 --steps 10 --seed 1 --metrics "$T/w_i.jsonl" > "$T/w_i.log" 2>&1; ri=$?
core "$T/w_g.jsonl" > "$T/w_cg"; core "$T/w_i.jsonl" > "$T/w_ci"
[ $rg -eq 0 ] && [ "$(wc -l < "$T/f_cg")" -eq 10 ] && cmp -s "$T/f_cg" "$T/f_cd" && [ $rw -eq 0 ] && [ $ri -eq 0 ] &&
    grep -q "weight gradients in bf16" "$T/w_g.log" && [ "$(wc -l < "$T/w_cg")" -eq 10 ] && cmp -s "$T/w_cg" "$T/w_ci" && ! cmp -s "$T/w_ci" "$T/f_cd"
check "--fp8 and --fp8 --fp8-wgrad bf16 from artifacts = in-process, bitwise" $? "(exit $rg $rw $ri)"
fi

cp "$T"/*.log "${OUT:-$T}/" 2>/dev/null
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
