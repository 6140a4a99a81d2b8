#!/bin/sh
# Build, run the GPU tests, train tiny on the GPU, profile one debug step.
# Logs go to $OUT (or .). Used on the GPU machine.
out=${OUT:-.}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
make -j16 train precompile test_gpu > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
./test_gpu > "$out/test_gpu.log" 2>&1; echo "test_gpu exit $?"
grep -E "FAIL|passed" "$out/test_gpu.log"
./train --steps 40 --log-every 10 > "$out/tiny_gpu.log" 2>&1; echo "tiny exit $?"; tail -4 "$out/tiny_gpu.log"
timeout 300 ./train --preset debug --steps ${DEBUG_STEPS:-4} --log-every 1 --profile ${ROOF:-} > "$out/debug_gpu.log" 2>&1; echo "debug exit $?"
tail -45 "$out/debug_gpu.log"
