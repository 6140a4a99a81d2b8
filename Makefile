# moetrain — `make` builds ./train and ./precompile; `make test` runs the CPU tests.
#
# Where the CUDA toolkit is found (CUDA_HOME, default /usr/local/cuda, or nvcc
# on PATH), ./train is built with the CUDA backend (it still runs on the CPU
# when no GPU is visible); NCCL is looked for in CUDA_HOME, /usr/include,
# /usr/local/include and /usr/lib/x86_64-linux-gnu. Without CUDA everything
# except test-gpu and bench builds on the CPU alone.
#
#   make test       CPU tests (float32 and float64 builds); compiles + links the CUDA code if present
#   make sanitize   the CPU tests (fuzzing included), train and precompile under AddressSanitizer and
#                   UndefinedBehaviorSanitizer, plus a short training run with a save and an exact resume
#   make test-gpu   GPU tests (every CUDA op against the CPU reference, whole steps, determinism;
#                   with 2+ GPUs also NCCL ranks, the launcher, torchrun and failure handling)
#   make bench      the benchmark table (bench/run.sh)
#   make bench-attention  attention kernels: tests, then timing next to torch SDPA on cuDNN (bench/attention.sh)
#   make bench_gg   the grouped expert GEMM's checks and timings (bench/grouped_gemm.cu), as ./bench_gg
#   make bench_fp8  the FP8 GEMMs' errors, bounds and timings next to bf16 (bench/fp8.cu), as ./bench_fp8

CC       ?= cc
CXX      ?= c++
CFLAGS   ?= -O3 -std=c11 -Wall -Wextra -Wno-format-truncation -Wno-alloc-size-larger-than -Wno-array-bounds
LDLIBS   := -lm -lpthread

CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(firstword $(wildcard /usr/local/cuda/bin/nvcc) $(shell command -v nvcc 2>/dev/null)))
NVCC      := $(if $(CUDA_HOME),$(wildcard $(CUDA_HOME)/bin/nvcc),)
NCCL_INC  := $(patsubst %/nccl.h,%,$(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h /usr/local/include/nccl.h)))
NCCL_LIB  := $(patsubst %/libnccl.so,%,$(firstword $(wildcard $(CUDA_HOME)/lib64/libnccl.so $(CUDA_HOME)/lib/libnccl.so /usr/lib/x86_64-linux-gnu/libnccl.so /usr/local/lib/libnccl.so)))
CUDA_LIB  := $(firstword $(wildcard $(CUDA_HOME)/lib64 $(CUDA_HOME)/lib))
GENCODE   ?= -gencode arch=compute_90a,code=sm_90a
NVFLAGS   ?= -O3 -std=c++17 $(GENCODE) -Xcompiler -Wall
CUDA_LDLIBS := -L$(CUDA_LIB) $(if $(NCCL_LIB),-L$(NCCL_LIB)) -Wl,-rpath,$(CUDA_LIB)$(if $(NCCL_LIB),:$(NCCL_LIB)) \
               -lcublasLt -lcudart -lnccl -lm -lpthread

HEADERS := moetrain.h

.PHONY: all test test-gpu bench bench-attention clean cuda-link cxx-check sanitize
all: train precompile

ifeq ($(NVCC),)
train: train.c $(HEADERS)
	$(CC) $(CFLAGS) -o $@ train.c $(LDLIBS)
else
train: train.c $(HEADERS) moetrain_kernels.o
	$(CC) $(CFLAGS) -DMT_CUDA -c -o train.o train.c
	$(CXX) -o $@ train.o moetrain_kernels.o $(CUDA_LDLIBS)
endif

# precompile builds and plans on the CPU; with CUDA it can also tune on a GPU (--device cuda)
ifeq ($(NVCC),)
precompile: precompile.c $(HEADERS)
	$(CC) $(CFLAGS) -o $@ precompile.c $(LDLIBS)
else
precompile: precompile.c $(HEADERS) moetrain_kernels.o
	$(CC) $(CFLAGS) -DMT_CUDA -c -o precompile.o precompile.c
	$(CXX) -o $@ precompile.o moetrain_kernels.o $(CUDA_LDLIBS)
endif

test_f32: test.c $(HEADERS)
	$(CC) $(CFLAGS) -o $@ test.c $(LDLIBS)

# the same tests in float64: gradient checks against finite differences
test_f64: test.c $(HEADERS)
	$(CC) $(CFLAGS) -DMT_REAL=double -DMT_TEST_F64=1 -o $@ test.c $(LDLIBS)

# the header must also compile as C++
cxx-check: $(HEADERS)
	printf '#define MOETRAIN_IMPLEMENTATION\n#include "moetrain.h"\nint main(void){return 0;}\n' > .cxx_check.cpp
	$(CXX) -std=c++17 -O1 -Wall -Wno-format-truncation -I. -o .cxx_check .cxx_check.cpp $(LDLIBS)
	rm -f .cxx_check .cxx_check.cpp

moetrain_kernels.o: moetrain_kernels.cu $(HEADERS)
	$(NVCC) $(NVFLAGS) $(if $(NCCL_INC),-I$(NCCL_INC)) -I. -c -o $@ moetrain_kernels.cu

# the CUDA code compiles and links wherever the toolkit is installed (no GPU needed)
cuda-link: train
	@echo "cuda-link: moetrain_kernels.cu compiled and linked into ./train (cuBLASLt, NCCL)"

test: test_f32 test_f64 train precompile cxx-check $(if $(NVCC),cuda-link)
	@sh tools/run_tests.sh ./test_f64 ./test_f32

# AddressSanitizer + UndefinedBehaviorSanitizer builds (CPU only) in .san/; any report fails the run
SAN_CFLAGS ?= -std=c11 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined \
              -Wall -Wextra -Wno-format-truncation -Wno-alloc-size-larger-than -Wno-array-bounds
SAN_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1 UBSAN_OPTIONS=print_stacktrace=1
.san/train: train.c $(HEADERS)
	@mkdir -p .san
	$(CC) $(SAN_CFLAGS) -o $@ train.c $(LDLIBS)
.san/precompile: precompile.c $(HEADERS)
	@mkdir -p .san
	$(CC) $(SAN_CFLAGS) -o $@ precompile.c $(LDLIBS)
.san/test_f32: test.c $(HEADERS)
	@mkdir -p .san
	$(CC) $(SAN_CFLAGS) -o $@ test.c $(LDLIBS)
.san/test_f64: test.c $(HEADERS)
	@mkdir -p .san
	$(CC) $(SAN_CFLAGS) -DMT_REAL=double -DMT_TEST_F64=1 -o $@ test.c $(LDLIBS)

sanitize: .san/train .san/precompile .san/test_f32 .san/test_f64
	@rm -rf .san/run && echo "sanitize: a short training run, a save every 4 steps, an exact resume with --nan-check"
	$(SAN_ENV) .san/train --steps 6 --seed 2 --threads 2 --save .san/run/ck --save-every 4 --metrics .san/run/a.jsonl
	$(SAN_ENV) .san/train --steps 10 --load .san/run/ck --nan-check --metrics .san/run/b.jsonl --svg .san/run/loss.svg
	$(SAN_ENV) .san/precompile --preset tiny -o .san/run/tiny.mtg && $(SAN_ENV) .san/train --graph .san/run/tiny.mtg --steps 2
	$(SAN_ENV) .san/train --device cpu --nproc 4 --dp-replicate 2 --ep 2 --steps 3 --batch 2
	@echo "sanitize: the test suite (fuzzing included) with the sanitized train and precompile"
	@$(SAN_ENV) MT_BIN=.san/ sh tools/run_tests.sh .san/test_f64 .san/test_f32

test_gpu: test.c $(HEADERS) moetrain_kernels.o
	$(CC) $(CFLAGS) -DMT_CUDA -DMT_TEST_GPU=1 -c -o test_gpu.o test.c
	$(CXX) -o $@ test_gpu.o moetrain_kernels.o $(CUDA_LDLIBS)

test-gpu: test_gpu train precompile
	@sh tools/run_tests.sh ./test_gpu tools/test_multi_gpu.sh

bench: train precompile
	sh bench/run.sh

bench_attention: bench/attention.cu bench/kernel_variants.cuh moetrain_kernels.cu $(HEADERS)
	$(NVCC) $(NVFLAGS) -Xcompiler -Wno-format-truncation,-Wno-alloc-size-larger-than,-Wno-array-bounds $(if $(NCCL_INC),-I$(NCCL_INC)) -I. -c -o bench_attention.o bench/attention.cu
	$(CXX) -o $@ bench_attention.o $(CUDA_LDLIBS)

bench-attention: bench_attention
	BIN=./bench_attention sh bench/attention.sh

# the grouped expert GEMM on its own (bench/grouped_gemm.cu: checks, then timing next to cuBLASLt)
bench_gg: bench/grouped_gemm.cu bench/kernel_variants.cuh moetrain_kernels.cu $(HEADERS)
	$(NVCC) $(NVFLAGS) -Xcompiler -Wno-format-truncation,-Wno-alloc-size-larger-than,-Wno-array-bounds $(if $(NCCL_INC),-I$(NCCL_INC)) -I. -c -o bench_gg.o bench/grouped_gemm.cu
	$(CXX) -o $@ bench_gg.o $(CUDA_LDLIBS)

# the FP8 GEMMs on mid's shapes (bench/fp8.cu: errors against float64, the bound, determinism, TFLOP/s next to bf16)
bench_fp8: bench/fp8.cu moetrain_kernels.cu $(HEADERS)
	$(NVCC) $(NVFLAGS) -Xcompiler -Wno-format-truncation,-Wno-alloc-size-larger-than,-Wno-array-bounds $(if $(NCCL_INC),-I$(NCCL_INC)) -I. -c -o bench_fp8.o bench/fp8.cu
	$(CXX) -o $@ bench_fp8.o $(CUDA_LDLIBS)

clean:
	rm -f train precompile test_f32 test_f64 test_gpu bench_attention bench_gg bench_fp8 *.o .cxx_check* .cuda_link*
	rm -rf .san
