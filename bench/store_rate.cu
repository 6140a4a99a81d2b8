/* bench/store_rate.cu — how fast one SM can write a grouped-dW tile's worth of fp32 (128 KB) to
 * global memory, and how much of that a CTA pays when independent work follows the stores.
 * It bounds the dW epilogue of the grouped GEMM (see the TMA kernel's comment in
 * moetrain_kernels.cu): one CTA per SM (or per second / fourth SM), 256 threads, each tile
 * written by 32 lane-contiguous 16-byte stores a thread into its own 128 KB of a 738 MB buffer
 * (the size of mid's gate/up dW), then `spin` cycles of busy waiting standing in for the next
 * tile's multiplications.
 *
 *   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/store_rate bench/store_rate.cu && /tmp/store_rate
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int TILE_F4 = 8192;   /* 128 KB of fp32 as float4 */

/* CTA b writes tiles (q * gridDim + b) mod ntiles, q < tiles; cyc[b]: its clock cycles in all */
__global__ void __launch_bounds__(256, 1) write_tiles(float4 *out, int tiles, long long ntiles, long long spin,
                                                      long long *cyc) {
    const long long t0 = clock64();
    for (int q = 0; q < tiles; ++q) {
        const long long t = ((long long)q * gridDim.x + blockIdx.x) % ntiles;
        float4 *o = out + t * TILE_F4 + threadIdx.x;
        const float4 v = make_float4((float)q, (float)t, 1.f, 2.f);
#pragma unroll
        for (int i = 0; i < 32; ++i) o[i * 256] = v;
        const long long s = clock64();
        while (clock64() - s < spin) {}
    }
    __syncthreads();
    if (threadIdx.x == 0) cyc[blockIdx.x] = clock64() - t0;
}

int main() {
    int nsm = 0;
    CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    if (nsm > 4096) nsm = 4096;   /* h[] below */
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const size_t bytes = (size_t)64 * 1408 * 2048 * 4;   /* mid's gate/up dW: 738 MB */
    const long long ntiles = (long long)(bytes / (TILE_F4 * 16));
    float4 *out = nullptr;
    long long *cyc = nullptr;
    CK(cudaMalloc(&out, bytes));
    CK(cudaMalloc(&cyc, sizeof(long long) * nsm));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    printf("%s, %d SMs: 128 KB tiles, 40 per CTA, third of three runs\n", prop.name, nsm);
    printf("%6s %6s | %8s %10s | %16s %22s\n", "CTAs", "spin", "ms", "TB/s", "cycles per tile", "bytes/cycle (no spin)");
    const int tiles = 40;
    const long long spins[2] = {0, 8000};
    for (long long spin : spins)
        for (int div = 1; div <= 4; div *= 2) {
            const int grid = nsm / div;
            float ms = 0.f;
            for (int rep = 0; rep < 3; ++rep) {
                CK(cudaEventRecord(a));
                write_tiles<<<grid, 256>>>(out, tiles, ntiles, spin, cyc);
                CK(cudaEventRecord(b));
                CK(cudaEventSynchronize(b));
                CK(cudaGetLastError());
                CK(cudaEventElapsedTime(&ms, a, b));
            }
            long long h[4096];
            CK(cudaMemcpy(h, cyc, sizeof(long long) * grid, cudaMemcpyDeviceToHost));
            double mean = 0;
            for (int i = 0; i < grid; ++i) mean += (double)h[i];
            mean /= grid * (double)tiles;
            const double total = (double)grid * tiles * TILE_F4 * 16;
            printf("%6d %6lld | %8.3f %10.2f | %16.0f %22.1f\n", grid, spin, ms, total / ms / 1e9, mean,
                   TILE_F4 * 16 / (mean - (double)spin));
        }
    CK(cudaFree(out));
    CK(cudaFree(cyc));
    return 0;
}
