/* moetrain_kernels.cu — every CUDA kernel of moetrain and its host launcher,
 * with C linkage so that moetrain.h (C) can call them.
 *
 * This file currently holds the build skeleton: a device query and one
 * kernel with its launcher, so that the CUDA toolchain, cuBLAS and NCCL are
 * compiled and linked on every build. The op kernels follow the CPU
 * reference ops of moetrain.h section 8 one for one.
 */
#include <cuda_runtime.h>
#include <cublasLt.h>
#include <nccl.h>
#include <stdio.h>

#include "moetrain.h"

extern "C" {

/* Describe the CUDA runtime, cuBLASLt, NCCL and the device count into out. */
int mt_cuda_describe(char *out, int n) {
    int rt = 0, drv = 0, dev = 0, nccl = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    cudaError_t e = cudaGetDeviceCount(&dev);
    if (e != cudaSuccess) dev = 0;
    ncclGetVersion(&nccl);
    size_t lt = cublasLtGetVersion();
    return snprintf(out, (size_t)n, "%s: CUDA runtime %d, driver %d, cuBLASLt %zu, NCCL %d, %d device(s)%s%s",
                    MT_KERNELS_VERSION, rt, drv, lt, nccl, dev, e != cudaSuccess ? ": " : "",
                    e != cudaSuccess ? cudaGetErrorString(e) : "");
}

/* y[i] = value, for poisoning outputs in tests. */
static __global__ void mt_fill_kernel(float *y, long long n, float value) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = value;
}
int mt_cuda_fill(float *y, long long n, float value, cudaStream_t s) {
    if (n <= 0) return 0;
    mt_fill_kernel<<<(unsigned)((n + 255) / 256), 256, 0, s>>>(y, n, value);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

}  /* extern "C" */
