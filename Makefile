# moetrain — `make` builds ./train and ./precompile; `make test` runs the CPU tests.
#
# CUDA (optional here, required for test-gpu and bench) is found through
# CUDA_HOME (default /usr/local/cuda) or nvcc on PATH; NCCL in CUDA_HOME,
# /usr/include or /usr/local/include, and /usr/lib/x86_64-linux-gnu.

CC       ?= cc
CFLAGS   ?= -O3 -std=c11 -Wall -Wextra -Wno-format-truncation -Wno-alloc-size-larger-than -Wno-array-bounds
LDLIBS   := -lm -lpthread

CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(firstword $(wildcard /usr/local/cuda/bin/nvcc) $(shell command -v nvcc 2>/dev/null)))
NVCC      := $(if $(CUDA_HOME),$(CUDA_HOME)/bin/nvcc,)
NCCL_INC  := $(patsubst %/nccl.h,%,$(firstword $(wildcard $(CUDA_HOME)/include/nccl.h /usr/include/nccl.h /usr/local/include/nccl.h)))
NCCL_LIB  := $(patsubst %/libnccl.so,%,$(firstword $(wildcard $(CUDA_HOME)/lib64/libnccl.so /usr/lib/x86_64-linux-gnu/libnccl.so /usr/local/lib/libnccl.so)))
CUDA_LIB  := $(firstword $(wildcard $(CUDA_HOME)/lib64 $(CUDA_HOME)/lib))
GENCODE   ?= -gencode arch=compute_90a,code=sm_90a
NVFLAGS   ?= -O3 -std=c++17 $(GENCODE) -Xcompiler -Wall
CUDA_LDLIBS := -L$(CUDA_LIB) $(if $(NCCL_LIB),-L$(NCCL_LIB)) -lcublasLt -lcublas -lcudart -lnccl -lm -lpthread

HEADERS := moetrain.h

.PHONY: all test clean cuda-link cxx-check
all: train precompile

train: train.c $(HEADERS)
	$(CC) $(CFLAGS) -o $@ train.c $(LDLIBS)

precompile: precompile.c $(HEADERS)
	$(CC) $(CFLAGS) -o $@ precompile.c $(LDLIBS)

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

# the CUDA code compiles and links wherever the toolkit is installed (no GPU needed)
moetrain_kernels.o: moetrain_kernels.cu $(HEADERS)
	$(NVCC) $(NVFLAGS) $(if $(NCCL_INC),-I$(NCCL_INC)) -I. -c -o $@ moetrain_kernels.cu

cuda-link: moetrain_kernels.o
	printf '#include <stdio.h>\nint mt_cuda_describe(char*,int);\nint main(void){char b[512];mt_cuda_describe(b,512);puts(b);return 0;}\n' > .cuda_link.c
	$(NVCC) $(GENCODE) -o .cuda_link .cuda_link.c moetrain_kernels.o $(CUDA_LDLIBS)
	rm -f .cuda_link .cuda_link.c
	@echo "cuda-link: moetrain_kernels.cu compiled and linked against cuBLASLt and NCCL"

test: test_f32 test_f64 train precompile cxx-check $(if $(NVCC),cuda-link)
	@sh tools/run_tests.sh ./test_f64 ./test_f32

clean:
	rm -f train precompile test_f32 test_f64 *.o .cxx_check* .cuda_link*
