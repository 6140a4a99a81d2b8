/* moetrain_kernels.cu — every CUDA kernel of moetrain and its host launcher,
 * with C linkage. moetrain.h (section 10) dispatches graph nodes to them.
 *
 * Conventions
 *   - activations are bf16 (__nv_bfloat16), statistics and master state f32;
 *     every kernel accumulates in f32.
 *   - matrices are row-major; GEMMs go through cuBLASLt (bf16 in, f32
 *     accumulate) using the transpose identity C^T = B^T A^T.
 *   - determinism: no floating-point atomics. Reductions run in a fixed order
 *     over a fixed grid; integer counters (expert histograms) may use atomics
 *     because integer sums do not depend on order.
 *   - every launcher runs on the context's stream and returns 0, or -1 with
 *     a message for mt_cuda_error().
 *
 * TABLE OF CONTENTS
 *   1. context, memory, errors
 *   2. GEMMs (cuBLASLt)
 *   3. elementwise: cast, add, SwiGLU
 *   4. embedding
 *   5. RMSNorm
 *   6. MLA RoPE assembly
 *   7. attention
 *   8. router, permutation, expert exchange, grouped GEMM, combine
 *   9. cross-entropy
 *   10. optimizer: gradient norm, schedule, clip, AdamW, expert bias
 */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <nccl.h>
#include <cub/cub.cuh>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define MT_CUDA 1
#include "moetrain.h"

typedef __nv_bfloat16 bf16;

/* ========================================================================
 * 1. context, memory, errors
 * ====================================================================== */

#define MT_GEMM_CACHE 1024
struct mt__gemm_entry {
    int used, ta, tb, mb, n, k, at, bt, ct;   /* mb: rows bucket */
    cublasLtMatmulDesc_t desc;
    cublasLtMatmulAlgo_t algo;
};

struct mt_cuda {
    int device;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_ws;
    size_t lt_ws_bytes;
    mt__gemm_entry *cache;
    int *flag;               /* device: non-zero when a kernel saw invalid data */
    cudaEvent_t *ev;         /* timing events (profiling) */
    int n_ev;
    size_t in_use, peak;
    char err[512];
};

static int mt__fail(mt_cuda *c, const char *what, const char *why) {
    snprintf(c->err, sizeof c->err, "%s: %s", what, why);
    return -1;
}
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) return mt__fail(c, #x, cudaGetErrorString(e_)); } while (0)
#define LAUNCHED() do { cudaError_t e_ = cudaGetLastError(); if (e_ != cudaSuccess) return mt__fail(c, __func__, cudaGetErrorString(e_)); } while (0)

static unsigned mt__blocks(int64_t n, int per) {
    int64_t b = (n + per - 1) / per;
    if (b < 1) b = 1;
    if (b > (1 << 30)) b = 1 << 30;
    return (unsigned)b;
}
__device__ __forceinline__ float bf(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 tobf(float x) { return __float2bfloat16(x); }
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* fixed-order block reduction (blockDim.x a multiple of 32, <= 1024) */
__device__ float block_sum(float v, float *sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = threadIdx.x < (unsigned)nw ? sh[threadIdx.x] : 0.0f;
    if (w == 0) t = warp_sum(t);
    if (threadIdx.x == 0) sh[0] = t;
    __syncthreads();
    return sh[0];
}
__device__ float block_max(float v, float *sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = threadIdx.x < (unsigned)nw ? sh[threadIdx.x] : -INFINITY;
    if (w == 0) t = warp_max(t);
    if (threadIdx.x == 0) sh[0] = t;
    __syncthreads();
    return sh[0];
}

extern "C" {

int mt_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; }
    return n;
}

int mt_cuda_describe(char *out, int n) {
    int rt = 0, drv = 0, dev = 0, nccl = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    cudaError_t e = cudaGetDeviceCount(&dev);
    if (e != cudaSuccess) { dev = 0; cudaGetLastError(); }
    ncclGetVersion(&nccl);
    size_t lt = cublasLtGetVersion();
    return snprintf(out, (size_t)n, "%s: CUDA runtime %d, driver %d, cuBLASLt %zu, NCCL %d, %d device(s)", MT_KERNELS_VERSION,
                    rt, drv, lt, nccl, dev);
}

int mt_cuda_create(mt_cuda **out, int device, mt_err *err) {
    *out = NULL;
    int n = mt_cuda_device_count();
    if (device < 0 || device >= n) return mt_errf(err, "CUDA device %d requested, %d visible", device, n);
    mt_cuda *c = (mt_cuda *)calloc(1, sizeof *c);
    if (!c) return mt_errf(err, "out of memory");
    c->device = device;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) { c->lt_ws_bytes = 64u << 20; e = cudaMalloc(&c->lt_ws, c->lt_ws_bytes); }
    if (e == cudaSuccess) e = cudaMalloc((void **)&c->flag, sizeof(int));
    if (e == cudaSuccess) e = cudaMemset(c->flag, 0, sizeof(int));
    if (e != cudaSuccess) { mt_cuda_destroy(c); return mt_errf(err, "CUDA device %d: %s", device, cudaGetErrorString(e)); }
    c->in_use = c->peak = c->lt_ws_bytes;
    if (cublasLtCreate(&c->lt) != CUBLAS_STATUS_SUCCESS) { mt_cuda_destroy(c); return mt_errf(err, "cublasLtCreate failed"); }
    c->cache = (mt__gemm_entry *)calloc(MT_GEMM_CACHE, sizeof(mt__gemm_entry));
    if (!c->cache) { mt_cuda_destroy(c); return mt_errf(err, "out of memory"); }
    *out = c;
    return 0;
}

void mt_cuda_destroy(mt_cuda *c) {
    if (!c) return;
    cudaSetDevice(c->device);
    if (c->cache)
        for (int i = 0; i < MT_GEMM_CACHE; i++)
            if (c->cache[i].used) cublasLtMatmulDescDestroy(c->cache[i].desc);
    free(c->cache);
    if (c->lt) cublasLtDestroy(c->lt);
    if (c->lt_ws) cudaFree(c->lt_ws);
    if (c->flag) cudaFree(c->flag);
    for (int i = 0; i < c->n_ev; i++) cudaEventDestroy(c->ev[i]);
    free(c->ev);
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c);
}

const char *mt_cuda_error(const mt_cuda *c) { return c->err; }

int mt_cuda_malloc(mt_cuda *c, void **p, size_t n) {
    *p = NULL;
    cudaError_t e = cudaMalloc(p, n ? n : 256);
    if (e != cudaSuccess) {
        char why[256];
        snprintf(why, sizeof why, "%s (asked %.2f GiB, %.2f GiB already in use)", cudaGetErrorString(e), n / 1073741824.0,
                 c->in_use / 1073741824.0);
        cudaGetLastError();
        return mt__fail(c, "cudaMalloc", why);
    }
    c->in_use += n;
    if (c->in_use > c->peak) c->peak = c->in_use;
    return 0;
}
void mt_cuda_free(mt_cuda *c, void *p) { (void)c; if (p) cudaFree(p); }
size_t mt_cuda_peak_bytes(mt_cuda *c) { return c->peak; }

int mt_cuda_copy(mt_cuda *c, void *dst, const void *src, size_t n, int kind) {
    if (!n) return 0;
    cudaMemcpyKind k = kind == 0 ? cudaMemcpyHostToDevice : kind == 1 ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
    CK(cudaMemcpyAsync(dst, src, n, k, c->stream));
    if (kind != 2) CK(cudaStreamSynchronize(c->stream));   /* host buffers may be reused at once */
    return 0;
}
int mt_cuda_memset(mt_cuda *c, void *p, int byte, size_t n) {
    if (n) CK(cudaMemsetAsync(p, byte, n, c->stream));
    return 0;
}
int mt_cuda_sync(mt_cuda *c) {
    CK(cudaStreamSynchronize(c->stream));
    return 0;
}
int mt_cuda_events(mt_cuda *c, int n) {
    if (n <= c->n_ev) return 0;
    cudaEvent_t *ev = (cudaEvent_t *)realloc(c->ev, sizeof(cudaEvent_t) * (size_t)n);
    if (!ev) return mt__fail(c, "events", "out of memory");
    c->ev = ev;
    for (; c->n_ev < n; c->n_ev++) CK(cudaEventCreate(&c->ev[c->n_ev]));
    return 0;
}
int mt_cuda_event_record(mt_cuda *c, int i) {
    CK(cudaEventRecord(c->ev[i], c->stream));
    return 0;
}
float mt_cuda_event_ms(mt_cuda *c, int i, int j) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, c->ev[i], c->ev[j]) != cudaSuccess) { cudaGetLastError(); return 0; }
    return ms;
}
int mt_cuda_capture_begin(mt_cuda *c) {
    CK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    return 0;
}
int mt_cuda_capture_end(mt_cuda *c, void **graph) {
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (!graph) { if (g) cudaGraphDestroy(g); cudaGetLastError(); return 0; }
    if (e != cudaSuccess) return mt__fail(c, "cudaStreamEndCapture", cudaGetErrorString(e));
    cudaGraphExec_t x = NULL;
    e = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) return mt__fail(c, "cudaGraphInstantiate", cudaGetErrorString(e));
    *graph = (void *)x;
    return 0;
}
int mt_cuda_graph_launch(mt_cuda *c, void *graph) {
    CK(cudaGraphLaunch((cudaGraphExec_t)graph, c->stream));
    return 0;
}
void mt_cuda_graph_destroy(void *graph) { if (graph) cudaGraphExecDestroy((cudaGraphExec_t)graph); }

int mt_cuda_check_flag(mt_cuda *c) {
    int f = 0;
    CK(cudaMemcpyAsync(&f, c->flag, sizeof f, cudaMemcpyDeviceToHost, c->stream));
    CK(cudaStreamSynchronize(c->stream));
    if (!f) return 0;
    CK(cudaMemsetAsync(c->flag, 0, sizeof(int), c->stream));
    return mt__fail(c, "step", f == 1 ? "an expert index was out of range" : "a kernel reported invalid data");
}

/* ========================================================================
 * 2. GEMMs (cuBLASLt)
 * Row-major C[M,N] = op(A)[M,K] op(B)[K,N] is the column-major product
 * C^T = op(B)^T op(A)^T: cuBLAS sees B first, with m = N, n = M.
 * The algorithm is chosen once per (transposes, types, N, K, bucket of M)
 * and reused, so a shape always runs the same kernel: bitwise reproducible.
 * ====================================================================== */

static cudaDataType_t mt__cu_type(int dt) { return dt == MT_BF16 ? CUDA_R_16BF : CUDA_R_32F; }
static int mt__bucket(int m) { int b = 1; while (b < m) b <<= 1; return b; }

static int mt__lt_gemm(mt_cuda *c, int ta, int tb, int M, int N, int K, const void *A, int at, const void *B, int bt,
                       void *C, int ct) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) { CK(cudaMemsetAsync(C, 0, (size_t)M * N * (ct == MT_BF16 ? 2 : 4), c->stream)); return 0; }
    int mb = mt__bucket(M);
    unsigned h = (unsigned)(ta * 31 + tb * 17 + mb * 131 + N * 7919 + K * 104729 + at * 3 + bt * 5 + ct * 11);
    mt__gemm_entry *e = NULL;
    for (int p = 0; p < MT_GEMM_CACHE; p++) {
        mt__gemm_entry *x = &c->cache[(h + p) % MT_GEMM_CACHE];
        if (!x->used) { e = x; break; }
        if (x->ta == ta && x->tb == tb && x->mb == mb && x->n == N && x->k == K && x->at == at && x->bt == bt && x->ct == ct) { e = x; break; }
    }
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    /* first operand = B: col-major rows x cols with ld = B's row-major row length */
    if (cublasLtMatrixLayoutCreate(&la, mt__cu_type(bt), tb ? K : N, tb ? N : K, tb ? K : N) ||
        cublasLtMatrixLayoutCreate(&lb, mt__cu_type(at), ta ? M : K, ta ? K : M, ta ? M : K) ||
        cublasLtMatrixLayoutCreate(&lc, mt__cu_type(ct), N, M, N)) {
        if (la) cublasLtMatrixLayoutDestroy(la);
        if (lb) cublasLtMatrixLayoutDestroy(lb);
        return mt__fail(c, "cublasLtMatrixLayoutCreate", "failed");
    }
    int rc = 0;
    mt__gemm_entry local;
    memset(&local, 0, sizeof local);
    if (!e || !e->used) {
        mt__gemm_entry *n = e ? e : &local;
        cublasLtMatmulPreference_t pref = NULL;
        cublasLtMatmulHeuristicResult_t res;
        int found = 0;
        if (cublasLtMatmulDescCreate(&n->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) ||
            cublasLtMatmulDescSetAttribute(n->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa) ||
            cublasLtMatmulDescSetAttribute(n->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb) ||
            cublasLtMatmulPreferenceCreate(&pref) ||
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &c->lt_ws_bytes, sizeof c->lt_ws_bytes) ||
            cublasLtMatmulAlgoGetHeuristic(c->lt, n->desc, la, lb, lc, lc, pref, 1, &res, &found) || found < 1) {
            rc = mt__fail(c, "cuBLASLt", "no GEMM algorithm for this shape");
        } else {
            n->algo = res.algo;
            n->used = 1; n->ta = ta; n->tb = tb; n->mb = mb; n->n = N; n->k = K; n->at = at; n->bt = bt; n->ct = ct;
        }
        if (pref) cublasLtMatmulPreferenceDestroy(pref);
        e = n;
    }
    if (!rc) {
        float one = 1.0f, zero = 0.0f;
        cublasStatus_t st = cublasLtMatmul(c->lt, e->desc, &one, B, la, A, lb, &zero, C, lc, C, lc, &e->algo, c->lt_ws,
                                           c->lt_ws_bytes, c->stream);
        if (st != CUBLAS_STATUS_SUCCESS) {   /* the bucket's algorithm does not fit this M: ask for this exact shape */
            cublasLtMatmulPreference_t pref = NULL;
            cublasLtMatmulHeuristicResult_t res;
            int found = 0;
            if (!cublasLtMatmulPreferenceCreate(&pref) &&
                !cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &c->lt_ws_bytes, sizeof c->lt_ws_bytes) &&
                !cublasLtMatmulAlgoGetHeuristic(c->lt, e->desc, la, lb, lc, lc, pref, 1, &res, &found) && found)
                st = cublasLtMatmul(c->lt, e->desc, &one, B, la, A, lb, &zero, C, lc, C, lc, &res.algo, c->lt_ws, c->lt_ws_bytes, c->stream);
            if (pref) cublasLtMatmulPreferenceDestroy(pref);
            if (st != CUBLAS_STATUS_SUCCESS) {
                char why[128];
                snprintf(why, sizeof why, "status %d for M=%d N=%d K=%d", (int)st, M, N, K);
                rc = mt__fail(c, "cublasLtMatmul", why);
            }
        }
    }
    if (local.used) cublasLtMatmulDescDestroy(local.desc);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    return rc;
}

static size_t mt__al(size_t x) { return (x + 255) & ~(size_t)255; }

size_t mt_cuda_matmul_workspace(int M, int N, int K, int ct, int at, int bt) {
    if (at == MT_BF16 && bt == MT_BF16) return 0;
    size_t w = 0;
    if (at == MT_BF16) w += mt__al((size_t)M * K * 4);
    if (bt == MT_BF16) w += mt__al((size_t)K * N * 4);
    if (ct == MT_BF16) w += mt__al((size_t)M * N * 4);
    return w;
}

/* C = op(A) op(B). bf16 x bf16 -> bf16 or f32 on tensor cores; any f32
 * operand -> everything in exact f32 (the router's small GEMMs). */
int mt_cuda_matmul(mt_cuda *c, void *C, int ct, const void *A, int at, const void *B, int bt, int M, int N, int K, int ta,
                   int tb, void *ws) {
    if (at == MT_BF16 && bt == MT_BF16) return mt__lt_gemm(c, ta, tb, M, N, K, A, at, B, bt, C, ct);
    char *w = (char *)ws;
    const void *A32 = A, *B32 = B;
    void *C32 = C;
    if (at == MT_BF16) { A32 = w; if (mt_cuda_cast(c, w, MT_F32, A, MT_BF16, (int64_t)M * K)) return -1; w += mt__al((size_t)M * K * 4); }
    if (bt == MT_BF16) { B32 = w; if (mt_cuda_cast(c, w, MT_F32, B, MT_BF16, (int64_t)K * N)) return -1; w += mt__al((size_t)K * N * 4); }
    if (ct == MT_BF16) C32 = w;
    if (mt__lt_gemm(c, ta, tb, M, N, K, A32, MT_F32, B32, MT_F32, C32, MT_F32)) return -1;
    if (ct == MT_BF16) return mt_cuda_cast(c, C, MT_BF16, C32, MT_F32, (int64_t)M * N);
    return 0;
}

/* ========================================================================
 * 3. elementwise
 * ====================================================================== */

__global__ void k_f32_to_bf16(bf16 *y, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) y[i] = tobf(x[i]);
}
__global__ void k_bf16_to_f32(float *y, const bf16 *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) y[i] = bf(x[i]);
}
int mt_cuda_cast(mt_cuda *c, void *dst, int dst_dtype, const void *src, int src_dtype, int64_t n) {
    if (n <= 0) return 0;
    unsigned g = mt__blocks(n, 256);
    if (g > 65536) g = 65536;
    if (dst_dtype == src_dtype) { CK(cudaMemcpyAsync(dst, src, (size_t)n * (dst_dtype == MT_BF16 ? 2 : 4), cudaMemcpyDeviceToDevice, c->stream)); return 0; }
    if (dst_dtype == MT_BF16) k_f32_to_bf16<<<g, 256, 0, c->stream>>>((bf16 *)dst, (const float *)src, n);
    else k_bf16_to_f32<<<g, 256, 0, c->stream>>>((float *)dst, (const bf16 *)src, n);
    LAUNCHED();
    return 0;
}

__global__ void k_add_bf16(bf16 *o, const bf16 *a, const bf16 *b, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) o[i] = tobf(bf(a[i]) + bf(b[i]));
}
__global__ void k_add_f32(float *o, const float *a, const float *b, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) o[i] = a[i] + b[i];
}
int mt_cuda_add(mt_cuda *c, void *out, const void *a, const void *b, int64_t n, int dtype) {
    if (n <= 0) return 0;
    unsigned g = mt__blocks(n, 256);
    if (g > 65536) g = 65536;
    if (dtype == MT_BF16) k_add_bf16<<<g, 256, 0, c->stream>>>((bf16 *)out, (const bf16 *)a, (const bf16 *)b, n);
    else k_add_f32<<<g, 256, 0, c->stream>>>((float *)out, (const float *)a, (const float *)b, n);
    LAUNCHED();
    return 0;
}

__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + __expf(-x)); }
__global__ void k_swiglu(bf16 *h, const bf16 *g, const bf16 *u, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float x = bf(g[i]);
        h[i] = tobf(x * sigm(x) * bf(u[i]));
    }
}
__global__ void k_swiglu_bwd(bf16 *dg, bf16 *du, const bf16 *g, const bf16 *u, const bf16 *dh, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float x = bf(g[i]), s = sigm(x), d = bf(dh[i]), y = bf(u[i]);
        dg[i] = tobf(d * y * s * (1.0f + x * (1.0f - s)));
        du[i] = tobf(d * x * s);
    }
}
int mt_cuda_swiglu_forward(mt_cuda *c, void *h, const void *g, const void *u, int64_t n) {
    if (n <= 0) return 0;
    unsigned gr = mt__blocks(n, 256);
    if (gr > 65536) gr = 65536;
    k_swiglu<<<gr, 256, 0, c->stream>>>((bf16 *)h, (const bf16 *)g, (const bf16 *)u, n);
    LAUNCHED();
    return 0;
}
int mt_cuda_swiglu_backward(mt_cuda *c, void *dg, void *du, const void *g, const void *u, const void *dh, int64_t n) {
    if (n <= 0) return 0;
    unsigned gr = mt__blocks(n, 256);
    if (gr > 65536) gr = 65536;
    k_swiglu_bwd<<<gr, 256, 0, c->stream>>>((bf16 *)dg, (bf16 *)du, (const bf16 *)g, (const bf16 *)u, (const bf16 *)dh, n);
    LAUNCHED();
    return 0;
}

int mt_cuda_split(mt_cuda *c, void *x1, void *x2, const void *x, int N, int a, int b, int esz) {
    size_t row = (size_t)(a + b) * esz;
    CK(cudaMemcpy2DAsync(x1, (size_t)a * esz, x, row, (size_t)a * esz, N, cudaMemcpyDeviceToDevice, c->stream));
    CK(cudaMemcpy2DAsync(x2, (size_t)b * esz, (const char *)x + (size_t)a * esz, row, (size_t)b * esz, N, cudaMemcpyDeviceToDevice, c->stream));
    return 0;
}
int mt_cuda_concat(mt_cuda *c, void *x, const void *x1, const void *x2, int N, int a, int b, int esz) {
    size_t row = (size_t)(a + b) * esz;
    if (x1) CK(cudaMemcpy2DAsync(x, row, x1, (size_t)a * esz, (size_t)a * esz, N, cudaMemcpyDeviceToDevice, c->stream));
    else CK(cudaMemset2DAsync(x, row, 0, (size_t)a * esz, N, c->stream));
    if (x2) CK(cudaMemcpy2DAsync((char *)x + (size_t)a * esz, row, x2, (size_t)b * esz, (size_t)b * esz, N, cudaMemcpyDeviceToDevice, c->stream));
    else CK(cudaMemset2DAsync((char *)x + (size_t)a * esz, row, 0, (size_t)b * esz, N, c->stream));
    return 0;
}

/* ========================================================================
 * 4. embedding
 * The backward sums the rows of each token id in token order: a stable
 * radix sort of (token, position) groups them, then one block per group.
 * ====================================================================== */

__global__ void k_embed(bf16 *x, const int32_t *tok, const bf16 *wte, int D) {
    int n = blockIdx.x;
    const bf16 *src = wte + (int64_t)tok[n] * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) x[(int64_t)n * D + d] = src[d];
}
int mt_cuda_embed_forward(mt_cuda *c, void *x, const int32_t *tok, const void *wte, int N, int D) {
    if (N <= 0) return 0;
    k_embed<<<N, 128, 0, c->stream>>>((bf16 *)x, tok, (const bf16 *)wte, D);
    LAUNCHED();
    return 0;
}
__global__ void k_iota(int32_t *v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = i;
}
__global__ void k_embed_bwd(float *dwte, const bf16 *dx, const int32_t *keys, const int32_t *pos, int N, int D) {
    int i = blockIdx.x;
    if (i > 0 && keys[i] == keys[i - 1]) return;       /* not the first of its group */
    int v = keys[i], end = i;
    while (end < N && keys[end] == v) end++;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0;
        for (int j = i; j < end; j++) acc += bf(dx[(int64_t)pos[j] * D + d]);
        dwte[(int64_t)v * D + d] = acc;
    }
}
size_t mt_cuda_embed_backward_workspace(int N) {
    size_t tmp = 0;
    cub::DeviceRadixSort::SortPairs(NULL, tmp, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL, (int32_t *)NULL, N);
    return mt__al(tmp) + 3 * mt__al((size_t)N * 4);
}
int mt_cuda_embed_backward(mt_cuda *c, float *dwte, const void *dx, const int32_t *tok, int N, int V, int D, void *ws) {
    CK(cudaMemsetAsync(dwte, 0, (size_t)V * D * 4, c->stream));
    if (N <= 0) return 0;
    size_t tmp = 0;
    cub::DeviceRadixSort::SortPairs(NULL, tmp, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL, (int32_t *)NULL, N);
    char *w = (char *)ws;
    int32_t *iota = (int32_t *)(w + mt__al(tmp)), *keys = iota + mt__al((size_t)N * 4) / 4, *pos = keys + mt__al((size_t)N * 4) / 4;
    k_iota<<<mt__blocks(N, 256), 256, 0, c->stream>>>(iota, N);
    LAUNCHED();
    int bits = 1;
    while ((1 << bits) < V && bits < 31) bits++;
    CK(cub::DeviceRadixSort::SortPairs(w, tmp, tok, keys, iota, pos, N, 0, bits, c->stream));
    k_embed_bwd<<<N, 128, 0, c->stream>>>(dwte, (const bf16 *)dx, keys, pos, N, D);
    LAUNCHED();
    return 0;
}

/* ========================================================================
 * 5. RMSNorm: one warp per row; dw by fixed chunks of rows, then a
 *    fixed-order sum of the chunks.
 * ====================================================================== */

#define MT_RMS_CHUNK 64
__global__ void k_rms_fwd(bf16 *y, float *rstd, const bf16 *x, const float *w, int N, int D, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const bf16 *xr = x + (int64_t)row * D;
    float ss = 0;
    for (int d = lane; d < D; d += 32) { float v = bf(xr[d]); ss += v * v; }
    ss = warp_sum(ss);
    float r = rsqrtf(ss / D + eps);
    if (lane == 0) rstd[row] = r;
    for (int d = lane; d < D; d += 32) y[(int64_t)row * D + d] = tobf(bf(xr[d]) * r * w[d]);
}
__global__ void k_rms_bwd_dx(bf16 *dx, const bf16 *dy, const bf16 *x, const float *w, const float *rstd, int N, int D) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    const bf16 *xr = x + (int64_t)row * D, *g = dy + (int64_t)row * D;
    float dot = 0;
    for (int d = lane; d < D; d += 32) dot += w[d] * bf(g[d]) * bf(xr[d]);
    dot = warp_sum(dot);
    float r = rstd[row], cc = r * r * r * dot / D;
    for (int d = lane; d < D; d += 32) dx[(int64_t)row * D + d] = tobf(r * w[d] * bf(g[d]) - cc * bf(xr[d]));
}
__global__ void k_rms_bwd_dw_part(float *part, const bf16 *dy, const bf16 *x, const float *rstd, int N, int D) {
    int d = blockIdx.y * blockDim.x + threadIdx.x, ch = blockIdx.x;
    if (d >= D) return;
    float acc = 0;
    int end = min(N, (ch + 1) * MT_RMS_CHUNK);
    for (int n = ch * MT_RMS_CHUNK; n < end; n++) acc += bf(dy[(int64_t)n * D + d]) * bf(x[(int64_t)n * D + d]) * rstd[n];
    part[(int64_t)ch * D + d] = acc;
}
__global__ void k_colsum(float *out, const float *part, int chunks, int D) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    float acc = 0;
    for (int ch = 0; ch < chunks; ch++) acc += part[(int64_t)ch * D + d];
    out[d] = acc;
}
size_t mt_cuda_rmsnorm_backward_workspace(int N, int D) { return mt__al((size_t)((N + MT_RMS_CHUNK - 1) / MT_RMS_CHUNK) * D * 4); }
int mt_cuda_rmsnorm_forward(mt_cuda *c, void *y, float *rstd, const void *x, const float *w, int N, int D, float eps) {
    if (N <= 0) return 0;
    k_rms_fwd<<<mt__blocks(N, 8), 256, 0, c->stream>>>((bf16 *)y, rstd, (const bf16 *)x, w, N, D, eps);
    LAUNCHED();
    return 0;
}
int mt_cuda_rmsnorm_backward(mt_cuda *c, void *dx, float *dw, const void *dy, const void *x, const float *w,
                             const float *rstd, int N, int D, void *ws) {
    if (N <= 0) { CK(cudaMemsetAsync(dw, 0, (size_t)D * 4, c->stream)); return 0; }
    k_rms_bwd_dx<<<mt__blocks(N, 8), 256, 0, c->stream>>>((bf16 *)dx, (const bf16 *)dy, (const bf16 *)x, w, rstd, N, D);
    LAUNCHED();
    int chunks = (N + MT_RMS_CHUNK - 1) / MT_RMS_CHUNK;
    dim3 g(chunks, (D + 127) / 128);
    k_rms_bwd_dw_part<<<g, 128, 0, c->stream>>>((float *)ws, (const bf16 *)dy, (const bf16 *)x, rstd, N, D);
    LAUNCHED();
    k_colsum<<<mt__blocks(D, 128), 128, 0, c->stream>>>(dw, (const float *)ws, chunks, D);
    LAUNCHED();
    return 0;
}

/* ========================================================================
 * 6. MLA RoPE assembly (see mt_cpu_mla_rope_forward): one block per token
 * ====================================================================== */

__global__ void k_rope_fwd(bf16 *Q, bf16 *K, bf16 *V, const bf16 *q, const bf16 *kv, const bf16 *kpe, const float *cosv,
                           const float *sinv, int T, int H, int dn, int dr, int dv) {
    int n = blockIdx.x, half = dr / 2, dq = dn + dr;
    const float *cs = cosv + (int64_t)(n % T) * half, *sn = sinv + (int64_t)(n % T) * half;
    for (int idx = threadIdx.x; idx < H * dq; idx += blockDim.x) {
        int h = idx / dq, d = idx % dq;
        const bf16 *qh = q + ((int64_t)n * H + h) * dq, *kvh = kv + ((int64_t)n * H + h) * (dn + dv);
        float qo, ko;
        if (d < dn) { qo = bf(qh[d]); ko = bf(kvh[d]); }
        else {
            int i = (d - dn) >> 1, odd = (d - dn) & 1;
            float c = cs[i], s = sn[i];
            float x0 = bf(qh[dn + 2 * i]), x1 = bf(qh[dn + 2 * i + 1]);
            float k0 = bf(kpe[(int64_t)n * dr + 2 * i]), k1 = bf(kpe[(int64_t)n * dr + 2 * i + 1]);
            qo = odd ? x0 * s + x1 * c : x0 * c - x1 * s;
            ko = odd ? k0 * s + k1 * c : k0 * c - k1 * s;
        }
        Q[((int64_t)n * H + h) * dq + d] = tobf(qo);
        K[((int64_t)n * H + h) * dq + d] = tobf(ko);
    }
    for (int idx = threadIdx.x; idx < H * dv; idx += blockDim.x) {
        int h = idx / dv, e = idx % dv;
        V[((int64_t)n * H + h) * dv + e] = kv[((int64_t)n * H + h) * (dn + dv) + dn + e];
    }
}
__global__ void k_rope_bwd(bf16 *dq, bf16 *dkv, bf16 *dkpe, const bf16 *dQ, const bf16 *dK, const bf16 *dV,
                           const float *cosv, const float *sinv, int T, int H, int dn, int dr, int dv) {
    int n = blockIdx.x, half = dr / 2, dqq = dn + dr;
    const float *cs = cosv + (int64_t)(n % T) * half, *sn = sinv + (int64_t)(n % T) * half;
    for (int idx = threadIdx.x; idx < H * dqq; idx += blockDim.x) {
        int h = idx / dqq, d = idx % dqq;
        const bf16 *g = dQ + ((int64_t)n * H + h) * dqq;
        float o;
        if (d < dn) o = bf(g[d]);
        else {
            int i = (d - dn) >> 1, odd = (d - dn) & 1;
            float d0 = bf(g[dn + 2 * i]), d1 = bf(g[dn + 2 * i + 1]);
            o = odd ? -d0 * sn[i] + d1 * cs[i] : d0 * cs[i] + d1 * sn[i];
        }
        dq[((int64_t)n * H + h) * dqq + d] = tobf(o);
    }
    for (int idx = threadIdx.x; idx < H * (dn + dv); idx += blockDim.x) {
        int h = idx / (dn + dv), d = idx % (dn + dv);
        bf16 v = d < dn ? dK[((int64_t)n * H + h) * dqq + d] : dV[((int64_t)n * H + h) * dv + d - dn];
        dkv[((int64_t)n * H + h) * (dn + dv) + d] = v;
    }
    for (int d = threadIdx.x; d < dr; d += blockDim.x) {   /* k_pe is shared: sum heads in order */
        int i = d >> 1, odd = d & 1;
        float acc = 0;
        for (int h = 0; h < H; h++) {
            const bf16 *g = dK + ((int64_t)n * H + h) * dqq + dn;
            float d0 = bf(g[2 * i]), d1 = bf(g[2 * i + 1]);
            acc += odd ? -d0 * sn[i] + d1 * cs[i] : d0 * cs[i] + d1 * sn[i];
        }
        dkpe[(int64_t)n * dr + d] = tobf(acc);
    }
}
int mt_cuda_mla_rope_forward(mt_cuda *c, void *Q, void *K, void *V, const void *q, const void *kv, const void *kpe,
                             const float *cosv, const float *sinv, int N, int T, int H, int dn, int dr, int dv) {
    if (N <= 0) return 0;
    k_rope_fwd<<<N, 256, 0, c->stream>>>((bf16 *)Q, (bf16 *)K, (bf16 *)V, (const bf16 *)q, (const bf16 *)kv, (const bf16 *)kpe,
                                         cosv, sinv, T, H, dn, dr, dv);
    LAUNCHED();
    return 0;
}
int mt_cuda_mla_rope_backward(mt_cuda *c, void *dq, void *dkv, void *dkpe, const void *dQ, const void *dK, const void *dV,
                              const float *cosv, const float *sinv, int N, int T, int H, int dn, int dr, int dv) {
    if (N <= 0) return 0;
    k_rope_bwd<<<N, 256, 0, c->stream>>>((bf16 *)dq, (bf16 *)dkv, (bf16 *)dkpe, (const bf16 *)dQ, (const bf16 *)dK,
                                         (const bf16 *)dV, cosv, sinv, T, H, dn, dr, dv);
    LAUNCHED();
    return 0;
}

/* ========================================================================
 * 7. attention
 * Reference kernels: one warp per query (forward, dQ) or key (dK, dV) row,
 * lanes split the head dims, online softmax, nothing T x T stored.
 * ====================================================================== */

#define MT_ATT_MAXD 8   /* per-lane registers: head dims up to 256 */
__global__ void k_att_fwd_ref(bf16 *O, float *lse, const bf16 *Q, const bf16 *K, const bf16 *V, int B, int T, int H, int dq,
                              int dv, float scale) {
    int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= (int64_t)B * T * H) return;
    int h = (int)(row % H);
    int64_t n = row / H;
    int b = (int)(n / T), i = (int)(n % T);
    float q[MT_ATT_MAXD], o[MT_ATT_MAXD];
    for (int r = 0; r < MT_ATT_MAXD; r++) {
        int d = lane + 32 * r;
        q[r] = d < dq ? bf(Q[(n * H + h) * dq + d]) : 0.0f;
        o[r] = 0;
    }
    float m = -INFINITY, l = 0;
    for (int j = 0; j <= i; j++) {
        int64_t nj = (int64_t)b * T + j;
        float s = 0;
        for (int r = 0; r < MT_ATT_MAXD; r++) { int d = lane + 32 * r; if (d < dq) s += q[r] * bf(K[(nj * H + h) * dq + d]); }
        s = warp_sum(s) * scale;
        float mn = fmaxf(m, s), a = __expf(m - mn), p = __expf(s - mn);
        l = l * a + p;
        for (int r = 0; r < MT_ATT_MAXD; r++) { int d = lane + 32 * r; if (d < dv) o[r] = o[r] * a + p * bf(V[(nj * H + h) * dv + d]); }
        m = mn;
    }
    for (int r = 0; r < MT_ATT_MAXD; r++) { int d = lane + 32 * r; if (d < dv) O[(n * H + h) * dv + d] = tobf(o[r] / l); }
    if (lane == 0) lse[n * H + h] = m + logf(l);
}
__global__ void k_att_D(float *Dv, const bf16 *O, const bf16 *dO, int64_t rows, int dv) {
    int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float s = 0;
    for (int d = lane; d < dv; d += 32) s += bf(O[row * dv + d]) * bf(dO[row * dv + d]);
    s = warp_sum(s);
    if (lane == 0) Dv[row] = s;
}
/* one warp per key row j: dK_j, dV_j over queries i >= j */
__global__ void k_att_bwd_kv_ref(bf16 *dK, bf16 *dV, const bf16 *Q, const bf16 *K, const bf16 *V, const float *lse,
                                 const bf16 *dO, const float *Dv, int B, int T, int H, int dq, int dv, float scale) {
    int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= (int64_t)B * T * H) return;
    int h = (int)(row % H);
    int64_t n = row / H;
    int b = (int)(n / T), j = (int)(n % T);
    float k[MT_ATT_MAXD], v[MT_ATT_MAXD], dk[MT_ATT_MAXD], dvv[MT_ATT_MAXD];
    for (int r = 0; r < MT_ATT_MAXD; r++) {
        int d = lane + 32 * r;
        k[r] = d < dq ? bf(K[(n * H + h) * dq + d]) : 0.0f;
        v[r] = d < dv ? bf(V[(n * H + h) * dv + d]) : 0.0f;
        dk[r] = dvv[r] = 0;
    }
    for (int i = j; i < T; i++) {
        int64_t ni = (int64_t)b * T + i;
        float s = 0, dp = 0;
        for (int r = 0; r < MT_ATT_MAXD; r++) {
            int d = lane + 32 * r;
            if (d < dq) s += k[r] * bf(Q[(ni * H + h) * dq + d]);
            if (d < dv) dp += v[r] * bf(dO[(ni * H + h) * dv + d]);
        }
        s = warp_sum(s); dp = warp_sum(dp);
        float p = __expf(s * scale - lse[ni * H + h]), ds = p * (dp - Dv[ni * H + h]) * scale;
        for (int r = 0; r < MT_ATT_MAXD; r++) {
            int d = lane + 32 * r;
            if (d < dq) dk[r] += ds * bf(Q[(ni * H + h) * dq + d]);
            if (d < dv) dvv[r] += p * bf(dO[(ni * H + h) * dv + d]);
        }
    }
    for (int r = 0; r < MT_ATT_MAXD; r++) {
        int d = lane + 32 * r;
        if (d < dq) dK[(n * H + h) * dq + d] = tobf(dk[r]);
        if (d < dv) dV[(n * H + h) * dv + d] = tobf(dvv[r]);
    }
}
/* one warp per query row i: dQ_i over keys j <= i */
__global__ void k_att_bwd_q_ref(bf16 *dQ, const bf16 *Q, const bf16 *K, const bf16 *V, const float *lse, const bf16 *dO,
                                const float *Dv, int B, int T, int H, int dq, int dv, float scale) {
    int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (row >= (int64_t)B * T * H) return;
    int h = (int)(row % H);
    int64_t n = row / H;
    int b = (int)(n / T), i = (int)(n % T);
    float q[MT_ATT_MAXD], g[MT_ATT_MAXD], dqv[MT_ATT_MAXD];
    for (int r = 0; r < MT_ATT_MAXD; r++) {
        int d = lane + 32 * r;
        q[r] = d < dq ? bf(Q[(n * H + h) * dq + d]) : 0.0f;
        g[r] = d < dv ? bf(dO[(n * H + h) * dv + d]) : 0.0f;
        dqv[r] = 0;
    }
    float L = lse[n * H + h], Di = Dv[n * H + h];
    for (int j = 0; j <= i; j++) {
        int64_t nj = (int64_t)b * T + j;
        float s = 0, dp = 0;
        for (int r = 0; r < MT_ATT_MAXD; r++) {
            int d = lane + 32 * r;
            if (d < dq) s += q[r] * bf(K[(nj * H + h) * dq + d]);
            if (d < dv) dp += g[r] * bf(V[(nj * H + h) * dv + d]);
        }
        s = warp_sum(s); dp = warp_sum(dp);
        float p = __expf(s * scale - L), ds = p * (dp - Di) * scale;
        for (int r = 0; r < MT_ATT_MAXD; r++) { int d = lane + 32 * r; if (d < dq) dqv[r] += ds * bf(K[(nj * H + h) * dq + d]); }
    }
    for (int r = 0; r < MT_ATT_MAXD; r++) { int d = lane + 32 * r; if (d < dq) dQ[(n * H + h) * dq + d] = tobf(dqv[r]); }
}

size_t mt_cuda_attention_backward_workspace(int B, int T, int H, int dq, int dv) {
    (void)dq; (void)dv;
    return mt__al((size_t)B * T * H * 4);
}
int mt_cuda_attention_forward(mt_cuda *c, const void *Q, const void *K, const void *V, void *O, float *lse, int B, int T,
                              int H, int dq, int dv, float scale) {
    if (dq > 32 * MT_ATT_MAXD || dv > 32 * MT_ATT_MAXD) return mt__fail(c, "attention", "head dims above 256 are not supported");
    int64_t rows = (int64_t)B * T * H;
    if (rows <= 0) return 0;
    k_att_fwd_ref<<<mt__blocks(rows, 4), 128, 0, c->stream>>>((bf16 *)O, lse, (const bf16 *)Q, (const bf16 *)K, (const bf16 *)V,
                                                              B, T, H, dq, dv, scale);
    LAUNCHED();
    return 0;
}
int mt_cuda_attention_backward(mt_cuda *c, const void *Q, const void *K, const void *V, const void *O, const float *lse,
                               const void *dO, void *dQ, void *dK, void *dV, void *ws, int B, int T, int H, int dq, int dv,
                               float scale) {
    if (dq > 32 * MT_ATT_MAXD || dv > 32 * MT_ATT_MAXD) return mt__fail(c, "attention", "head dims above 256 are not supported");
    int64_t rows = (int64_t)B * T * H;
    if (rows <= 0) return 0;
    float *Dv = (float *)ws;
    k_att_D<<<mt__blocks(rows, 4), 128, 0, c->stream>>>(Dv, (const bf16 *)O, (const bf16 *)dO, rows, dv);
    LAUNCHED();
    k_att_bwd_kv_ref<<<mt__blocks(rows, 4), 128, 0, c->stream>>>((bf16 *)dK, (bf16 *)dV, (const bf16 *)Q, (const bf16 *)K,
                                                                 (const bf16 *)V, lse, (const bf16 *)dO, Dv, B, T, H, dq, dv, scale);
    LAUNCHED();
    k_att_bwd_q_ref<<<mt__blocks(rows, 4), 128, 0, c->stream>>>((bf16 *)dQ, (const bf16 *)Q, (const bf16 *)K, (const bf16 *)V,
                                                                lse, (const bf16 *)dO, Dv, B, T, H, dq, dv, scale);
    LAUNCHED();
    return 0;
}

/* ========================================================================
 * 8. MoE: router, permutation, expert exchange, grouped GEMM, combine
 * ====================================================================== */

#define MT_ROUTER_MAXE 1024      /* one warp per token, up to 32 experts per lane */
#define MT_ROUTER_MAXG 64
/* (value, index) argmax across the warp; ties go to the lower index */
__device__ __forceinline__ void warp_argmax(float &v, int &i) {
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        if (v2 > v || (v2 == v && i2 >= 0 && (i < 0 || i2 < i))) { v = v2; i = i2; }
    }
}
}  /* extern "C": templates need C++ linkage */
/* R = experts per lane (compile time, so the arrays stay in registers) */
template <int R>
__global__ void k_router_fwd(int32_t *idx, float *w, float *scores, int32_t *counts, const float *logits, const float *bias,
                             int N, int E, int K, int score_func, int route_norm, float route_scale, int G, int Gl) {
    int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (n >= N) return;
    float s[R], sel[R];
    const float *l = logits + (int64_t)n * E;
    if (score_func == MT_SCORE_SIGMOID) {
#pragma unroll
        for (int r = 0; r < R; r++) { int e = lane + 32 * r; s[r] = e < E ? 1.0f / (1.0f + expf(-l[e])) : 0.0f; }
    } else {
        float mx = -INFINITY;
#pragma unroll
        for (int r = 0; r < R; r++) { int e = lane + 32 * r; if (e < E) mx = fmaxf(mx, l[e]); }
        mx = warp_max(mx);
        float z = 0;
#pragma unroll
        for (int r = 0; r < R; r++) { int e = lane + 32 * r; s[r] = e < E ? expf(l[e] - mx) : 0.0f; z += s[r]; }
        z = warp_sum(z);
#pragma unroll
        for (int r = 0; r < R; r++) s[r] /= z;
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        int e = lane + 32 * r;
        sel[r] = e < E ? s[r] + bias[e] : -INFINITY;
        if (e < E) scores[(int64_t)n * E + e] = s[r];
    }
    if (G > 1) {                              /* group-limited: keep the best Gl groups */
        int per = E / G;
        unsigned long long keep = 0;
        float gs[MT_ROUTER_MAXG];
        for (int g = 0; g < G; g++) {
            float b1 = -INFINITY, b2 = -INFINITY;
#pragma unroll
            for (int r = 0; r < R; r++) {
                int e = lane + 32 * r;
                if (e < E && e / per == g) { float v = sel[r]; if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) b2 = v; }
            }
            for (int o = 16; o > 0; o >>= 1) {  /* merge top-2 pairs across lanes */
                float o1 = __shfl_xor_sync(0xffffffffu, b1, o), o2 = __shfl_xor_sync(0xffffffffu, b2, o);
                float n1 = fmaxf(b1, o1), n2 = fmaxf(fminf(b1, o1), fmaxf(b2, o2));
                b1 = n1; b2 = n2;
            }
            gs[g] = per >= 2 ? b1 + b2 : b1;
        }
        for (int r = 0; r < Gl; r++) {
            int best = -1;
            for (int g = 0; g < G; g++) if (!(keep >> g & 1ull) && (best < 0 || gs[g] > gs[best])) best = g;
            keep |= 1ull << best;
        }
#pragma unroll
        for (int r = 0; r < R; r++) { int e = lane + 32 * r; if (e < E && !(keep >> (e / per) & 1ull)) sel[r] = -INFINITY; }
    }
    float sum = 0;
    for (int k = 0; k < K; k++) {
        float bv = -INFINITY;
        int bi = -1;
#pragma unroll
        for (int r = 0; r < R; r++) { int e = lane + 32 * r; if (e < E && sel[r] != -INFINITY && (bi < 0 || sel[r] > bv)) { bv = sel[r]; bi = e; } }
        warp_argmax(bv, bi);
        if (bi < 0) bi = 0;
        float raw = 0;
#pragma unroll
        for (int r = 0; r < R; r++) if (lane + 32 * r == bi) { raw = s[r]; sel[r] = -INFINITY; }
        raw = warp_sum(raw);               /* exactly one lane holds it */
        sum += raw;
        if (lane == 0) {
            idx[(int64_t)n * K + k] = bi;
            w[(int64_t)n * K + k] = raw;
            atomicAdd(&counts[bi], 1);     /* integer: order-independent */
        }
    }
    if (lane == 0)
        for (int k = 0; k < K; k++) {
            float x = w[(int64_t)n * K + k];
            if (route_norm) x = x / (sum + 1e-20f);
            w[(int64_t)n * K + k] = x * route_scale;
        }
}
template <int R>
__global__ void k_router_bwd(float *dlogits, const float *scores, const int32_t *idx, const float *dw, int N, int E, int K,
                             int score_func, int route_norm, float route_scale) {
    int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (n >= N) return;
    const float *s = scores + (int64_t)n * E;
    const int32_t *ix = idx + (int64_t)n * K;
    const float *g = dw + (int64_t)n * K;
    float S = 0, gr = 0;
    for (int k = 0; k < K; k++) { S += s[ix[k]]; gr += g[k] * s[ix[k]]; }
    float ds[R], dot = 0;
#pragma unroll
    for (int r = 0; r < R; r++) {
        int e = lane + 32 * r;
        ds[r] = 0;
        if (e >= E) continue;
        for (int k = 0; k < K; k++)
            if (ix[k] == e) ds[r] += route_norm ? route_scale * (g[k] / (S + 1e-20f) - gr / ((S + 1e-20f) * (S + 1e-20f)))
                                                : route_scale * g[k];
        dot += ds[r] * s[e];
    }
    dot = warp_sum(dot);
#pragma unroll
    for (int r = 0; r < R; r++) {
        int e = lane + 32 * r;
        if (e >= E) continue;
        dlogits[(int64_t)n * E + e] = score_func == MT_SCORE_SIGMOID ? ds[r] * s[e] * (1 - s[e]) : s[e] * (ds[r] - dot);
    }
}
extern "C" {
int mt_cuda_router_forward(mt_cuda *c, int32_t *idx, float *w, float *scores, int32_t *counts, const float *logits,
                           const float *bias, int N, int E, int K, int score_func, int route_norm, float route_scale,
                           int n_groups, int n_limited) {
    if (E > MT_ROUTER_MAXE || n_groups > MT_ROUTER_MAXG || K > 64)
        return mt__fail(c, "router", "the CUDA router supports up to 1024 experts, 64 groups and top-64");
    CK(cudaMemsetAsync(counts, 0, (size_t)E * 4, c->stream));
    if (N <= 0) return 0;
    unsigned g = mt__blocks(N, 4);
#define MT__ROUTE(R) k_router_fwd<R><<<g, 128, 0, c->stream>>>(idx, w, scores, counts, logits, bias, N, E, K, score_func, route_norm, \
                                                             route_scale, n_groups, n_limited)
    if (E <= 32) MT__ROUTE(1);
    else if (E <= 64) MT__ROUTE(2);
    else if (E <= 128) MT__ROUTE(4);
    else if (E <= 256) MT__ROUTE(8);
    else if (E <= 512) MT__ROUTE(16);
    else MT__ROUTE(32);
#undef MT__ROUTE
    LAUNCHED();
    return 0;
}
int mt_cuda_router_backward(mt_cuda *c, float *dlogits, const float *scores, const int32_t *idx, const float *dw, int N, int E,
                            int K, int score_func, int route_norm, float route_scale) {
    if (E > MT_ROUTER_MAXE) return mt__fail(c, "router", "the CUDA router supports up to 1024 experts");
    if (N <= 0) return 0;
    unsigned g = mt__blocks(N, 4);
#define MT__ROUTE(R) k_router_bwd<R><<<g, 128, 0, c->stream>>>(dlogits, scores, idx, dw, N, E, K, score_func, route_norm, route_scale)
    if (E <= 32) MT__ROUTE(1);
    else if (E <= 64) MT__ROUTE(2);
    else if (E <= 128) MT__ROUTE(4);
    else if (E <= 256) MT__ROUTE(8);
    else if (E <= 512) MT__ROUTE(16);
    else MT__ROUTE(32);
#undef MT__ROUTE
    LAUNCHED();
    return 0;
}

/* permutation: a stable radix sort of (expert, assignment) gives the
 * expert-major order with tokens in order inside each expert; offsets come
 * from an integer histogram. Deterministic. */
__global__ void k_hist(int32_t *cnt, const int32_t *idx, int64_t NK, int E, int *flag) {
    for (int64_t a = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; a < NK; a += (int64_t)gridDim.x * blockDim.x) {
        int e = idx[a];
        if (e < 0 || e >= E) { atomicExch(flag, 1); continue; }
        atomicAdd(&cnt[e], 1);
    }
}
__global__ void k_offsets(int32_t *offs, const int32_t *cnt, int E) {
    if (threadIdx.x || blockIdx.x) return;
    offs[0] = 0;
    for (int e = 0; e < E; e++) offs[e + 1] = offs[e] + cnt[e];   /* cnt aliases offs + 1: read before write */
}
/* row i of xs is assignment perm[i]: its token's row of x; slot is the inverse */
__global__ void k_gather_rows(bf16 *xs, int32_t *slot, const bf16 *x, const int32_t *perm, int K, int D) {
    int64_t i = blockIdx.x;
    int64_t a = perm[i];
    if (threadIdx.x == 0) slot[a] = (int32_t)i;
    const bf16 *src = x + (a / K) * D;
    bf16 *dst = xs + i * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) dst[d] = src[d];
}
size_t mt_cuda_moe_permute_workspace(int64_t NK) {
    size_t tmp = 0;
    cub::DeviceRadixSort::SortPairs(NULL, tmp, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL, (int32_t *)NULL, (int)NK);
    return mt__al(tmp) + 3 * mt__al((size_t)NK * 4);
}
int mt_cuda_moe_permute(mt_cuda *c, void *xs, int32_t *slot, int32_t *offs, const void *x, const int32_t *idx, int N, int D,
                        int K, int E, void *ws) {
    int64_t NK = (int64_t)N * K;
    int32_t *cnt = offs + 1;
    CK(cudaMemsetAsync(offs, 0, (size_t)(E + 1) * 4, c->stream));
    if (NK <= 0) return 0;
    unsigned g = mt__blocks(NK, 256);
    if (g > 4096) g = 4096;
    k_hist<<<g, 256, 0, c->stream>>>(cnt, idx, NK, E, c->flag);
    LAUNCHED();
    k_offsets<<<1, 1, 0, c->stream>>>(offs, cnt, E);
    LAUNCHED();
    size_t tmp = 0;
    cub::DeviceRadixSort::SortPairs(NULL, tmp, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL, (int32_t *)NULL, (int)NK);
    char *w = (char *)ws;
    int32_t *iota = (int32_t *)(w + mt__al(tmp)), *keys = iota + mt__al((size_t)NK * 4) / 4, *perm = keys + mt__al((size_t)NK * 4) / 4;
    k_iota<<<mt__blocks(NK, 256), 256, 0, c->stream>>>(iota, (int)NK);
    LAUNCHED();
    int bits = 1;
    while ((1 << bits) < E && bits < 31) bits++;
    CK(cub::DeviceRadixSort::SortPairs(w, tmp, idx, keys, iota, perm, (int)NK, 0, bits, c->stream));
    k_gather_rows<<<(unsigned)NK, 128, 0, c->stream>>>((bf16 *)xs, slot, (const bf16 *)x, perm, K, D);
    LAUNCHED();
    return 0;
}
__global__ void k_permute_bwd(bf16 *dx, const bf16 *dxs, const int32_t *slot, int D, int K) {
    int64_t n = blockIdx.x;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0;
        for (int k = 0; k < K; k++) acc += bf(dxs[(int64_t)slot[n * K + k] * D + d]);
        dx[n * D + d] = tobf(acc);
    }
}
int mt_cuda_moe_permute_backward(mt_cuda *c, void *dx, const void *dxs, const int32_t *slot, int N, int D, int K) {
    if (N <= 0) return 0;
    k_permute_bwd<<<N, 128, 0, c->stream>>>((bf16 *)dx, (const bf16 *)dxs, slot, D, K);
    LAUNCHED();
    return 0;
}
__global__ void k_combine(bf16 *y, const bf16 *ys, const int32_t *slot, const float *w, int D, int K) {
    int64_t n = blockIdx.x;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0;
        for (int k = 0; k < K; k++) acc += w[n * K + k] * bf(ys[(int64_t)slot[n * K + k] * D + d]);
        y[n * D + d] = tobf(acc);
    }
}
__global__ void k_combine_bwd(bf16 *dys, float *dw, const bf16 *dy, const bf16 *ys, const int32_t *slot, const float *w, int D, int K) {
    __shared__ float sh[32];
    int64_t n = blockIdx.x;
    for (int k = 0; k < K; k++) {
        int64_t s = slot[n * K + k];
        float wk = w[n * K + k], part = 0;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float g = bf(dy[n * D + d]);
            dys[s * D + d] = tobf(wk * g);
            part += g * bf(ys[s * D + d]);
        }
        float tot = block_sum(part, sh);
        if (threadIdx.x == 0) dw[n * K + k] = tot;
    }
}
int mt_cuda_moe_combine_forward(mt_cuda *c, void *y, const void *ys, const int32_t *slot, const float *w, int N, int D, int K) {
    if (N <= 0) return 0;
    k_combine<<<N, 128, 0, c->stream>>>((bf16 *)y, (const bf16 *)ys, slot, w, D, K);
    LAUNCHED();
    return 0;
}
int mt_cuda_moe_combine_backward(mt_cuda *c, void *dys, float *dw, const void *dy, const void *ys, const int32_t *slot,
                                 const float *w, int N, int D, int K) {
    if (N <= 0) return 0;
    k_combine_bwd<<<N, 128, 0, c->stream>>>((bf16 *)dys, dw, (const bf16 *)dy, (const bf16 *)ys, slot, w, D, K);
    LAUNCHED();
    return 0;
}

/* expert-parallel exchange on one rank: my experts' counts and offsets */
__global__ void k_ep_counts(int32_t *recv, const int32_t *offs, int El, int first) {
    int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e < El) recv[e] = offs[first + e + 1] - offs[first + e];
}
int mt_cuda_ep_counts(mt_cuda *c, int32_t *recv, const int32_t *offs, int E_local, int first_expert) {
    k_ep_counts<<<mt__blocks(E_local, 128), 128, 0, c->stream>>>(recv, offs, E_local, first_expert);
    LAUNCHED();
    return 0;
}
__global__ void k_ep_offsets(int32_t *roffs, const int32_t *recv, int El) {
    if (threadIdx.x || blockIdx.x) return;
    roffs[0] = 0;
    for (int e = 0; e < El; e++) roffs[e + 1] = roffs[e] + recv[e];
}
int mt_cuda_ep_offsets(mt_cuda *c, int32_t *roffs, const int32_t *recv, int E_local) {
    k_ep_offsets<<<1, 1, 0, c->stream>>>(roffs, recv, E_local);
    LAUNCHED();
    return 0;
}

/* grouped GEMM: one cuBLASLt call per expert that received tokens; an expert
 * with none costs a memset of its weight gradient (mode 2) or nothing */
int mt_cuda_gmm(mt_cuda *c, int mode, void *out, const void *a, const void *b, const int32_t *offs, int E, int M, int K, void *ws) {
    (void)ws;
    for (int e = 0; e < E; e++) {
        int r0 = offs[e], rows = offs[e + 1] - offs[e];
        if (mode == 0) {          /* Y[r0.., M] = X[r0.., K] W_e[M,K]^T */
            if (rows && mt__lt_gemm(c, 0, 1, rows, M, K, (const bf16 *)a + (int64_t)r0 * K, MT_BF16,
                                    (const bf16 *)b + (int64_t)e * M * K, MT_BF16, (bf16 *)out + (int64_t)r0 * M, MT_BF16)) return -1;
        } else if (mode == 1) {   /* dX[r0.., K] = dY[r0.., M] W_e[M,K] */
            if (rows && mt__lt_gemm(c, 0, 0, rows, K, M, (const bf16 *)a + (int64_t)r0 * M, MT_BF16,
                                    (const bf16 *)b + (int64_t)e * M * K, MT_BF16, (bf16 *)out + (int64_t)r0 * K, MT_BF16)) return -1;
        } else {                  /* dW_e[M,K] = dY[r0..,M]^T X[r0..,K], f32 */
            float *dw = (float *)out + (int64_t)e * M * K;
            if (!rows) { CK(cudaMemsetAsync(dw, 0, (size_t)M * K * 4, c->stream)); continue; }
            if (mt__lt_gemm(c, 1, 0, M, K, rows, (const bf16 *)a + (int64_t)r0 * M, MT_BF16, (const bf16 *)b + (int64_t)r0 * K,
                            MT_BF16, dw, MT_F32)) return -1;
        }
    }
    return 0;
}

/* ========================================================================
 * 9. cross-entropy: one block per row; the mean is a fixed-order sum
 * ====================================================================== */

__global__ void k_ce_fwd(float *per, float *lse, const bf16 *logits, const int32_t *tgt, int V) {
    __shared__ float sh[32];
    int64_t n = blockIdx.x;
    const bf16 *l = logits + n * V;
    float mx = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, bf(l[v]));
    mx = block_max(mx, sh);
    float z = 0;
    for (int v = threadIdx.x; v < V; v += blockDim.x) z += __expf(bf(l[v]) - mx);
    z = block_sum(z, sh);
    if (threadIdx.x == 0) {
        float L = mx + logf(z);
        lse[n] = L;
        per[n] = L - bf(l[tgt[n]]);
    }
}
__global__ void k_mean(float *out, const float *x, int N) {
    __shared__ float sh[32];
    float acc = 0;
    for (int i = threadIdx.x; i < N; i += blockDim.x) acc += x[i];
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0) out[0] = acc / N;
}
__global__ void k_ce_bwd(bf16 *dl, const bf16 *logits, const float *lse, const int32_t *tgt, int V, float inv) {
    int64_t n = blockIdx.x;
    float L = lse[n];
    int t = tgt[n];
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float p = __expf(bf(logits[n * V + v]) - L);
        dl[n * V + v] = tobf((p - (v == t ? 1.0f : 0.0f)) * inv);
    }
}
size_t mt_cuda_cross_entropy_workspace(int N) { return mt__al((size_t)N * 4); }
int mt_cuda_cross_entropy_forward(mt_cuda *c, float *loss, float *lse, const void *logits, const int32_t *tgt, int N, int V, void *ws) {
    if (N <= 0) return 0;
    k_ce_fwd<<<N, 256, 0, c->stream>>>((float *)ws, lse, (const bf16 *)logits, tgt, V);
    LAUNCHED();
    k_mean<<<1, 1024, 0, c->stream>>>(loss, (const float *)ws, N);
    LAUNCHED();
    return 0;
}
int mt_cuda_cross_entropy_backward(mt_cuda *c, void *dlogits, const void *logits, const float *lse, const int32_t *tgt, int N, int V) {
    if (N <= 0) return 0;
    k_ce_bwd<<<N, 256, 0, c->stream>>>((bf16 *)dlogits, (const bf16 *)logits, lse, tgt, V, 1.0f / N);
    LAUNCHED();
    return 0;
}

/* ========================================================================
 * 10. optimizer
 * ====================================================================== */

#define MT_SUMSQ_BLOCKS 256
__global__ void k_sumsq_part(float *part, const float *g, int64_t n) {
    __shared__ float sh[32];
    float acc = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) acc += g[i] * g[i];
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}
__global__ void k_sumsq_final(float *out, const float *in, const float *part) {
    __shared__ float sh[32];
    float acc = block_sum(part[threadIdx.x], sh);
    if (threadIdx.x == 0) out[0] = (in ? in[0] : 0.0f) + acc;
}
size_t mt_cuda_sumsq_workspace(void) { return mt__al(MT_SUMSQ_BLOCKS * 4); }
int mt_cuda_sumsq(mt_cuda *c, float *acc_out, const float *acc_in, const float *g, int64_t n, void *ws) {
    k_sumsq_part<<<MT_SUMSQ_BLOCKS, 256, 0, c->stream>>>((float *)ws, g, n);
    LAUNCHED();
    k_sumsq_final<<<1, MT_SUMSQ_BLOCKS, 0, c->stream>>>(acc_out, acc_in, (const float *)ws);
    LAUNCHED();
    return 0;
}

__global__ void k_lr(float *lr, const float *hp, const int32_t *step) {
    double base = hp[MT_HP_LR], warm = hp[MT_HP_WARMUP], decay = hp[MT_HP_DECAY], lo = base * hp[MT_HP_MIN_LR_RATIO];
    int s = step[0];
    double v;
    if (s < warm) v = base * (s + 1) / warm;
    else if (decay <= warm || s >= decay) v = s >= decay ? lo : base;
    else v = lo + 0.5 * (base - lo) * (1.0 + cos(3.141592653589793 * (s - warm) / (decay - warm)));
    lr[0] = (float)v;
}
int mt_cuda_lr_schedule(mt_cuda *c, float *lr, const float *hp, const int32_t *step) {
    k_lr<<<1, 1, 0, c->stream>>>(lr, hp, step);
    LAUNCHED();
    return 0;
}
__global__ void k_clip(float *coef, float *norm, const float *sumsq, const float *hp) {
    double nrm = sqrt((double)sumsq[0]), clip = hp[MT_HP_CLIP];
    coef[0] = (float)(clip > 0 && nrm > clip ? clip / (nrm + 1e-6) : 1.0);
    norm[0] = (float)nrm;
}
int mt_cuda_clip(mt_cuda *c, float *coef, float *norm, const float *sumsq, const float *hp) {
    k_clip<<<1, 1, 0, c->stream>>>(coef, norm, sumsq, hp);
    LAUNCHED();
    return 0;
}
__global__ void k_adamw(float *p, float *m, float *v, bf16 *p16, const float *g, int64_t n, const float *lrp, const float *coefp,
                        const float *hp, const int32_t *step, int decay) {
    float b1 = hp[MT_HP_BETA1], b2 = hp[MT_HP_BETA2], eps = hp[MT_HP_EPS], wd = decay ? hp[MT_HP_WD] : 0.0f;
    float lr = lrp[0], coef = coefp[0];
    int t = step[0] + 1;
    float bc1 = 1.0f - powf(b1, (float)t), bc2s = sqrtf(1.0f - powf(b2, (float)t)), step_size = lr / bc1;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float gi = g[i] * coef;
        float mi = b1 * m[i] + (1 - b1) * gi, vi = b2 * v[i] + (1 - b2) * gi * gi;
        m[i] = mi; v[i] = vi;
        float pi = p[i] * (1 - lr * wd);
        pi = pi - step_size * mi / (sqrtf(vi) / bc2s + eps);
        p[i] = pi;
        if (p16) p16[i] = tobf(pi);
    }
}
int mt_cuda_adamw(mt_cuda *c, float *p, float *m, float *v, void *p_bf16, const float *g, int64_t n, const float *lr,
                  const float *coef, const float *hp, const int32_t *step, int decay) {
    if (n <= 0) return 0;
    unsigned gr = mt__blocks(n, 256);
    if (gr > 65536) gr = 65536;
    k_adamw<<<gr, 256, 0, c->stream>>>(p, m, v, (bf16 *)p_bf16, g, n, lr, coef, hp, step, decay);
    LAUNCHED();
    return 0;
}
__global__ void k_bias_update(float *bias, const int32_t *counts, int E, float coeff) {
    if (threadIdx.x || blockIdx.x) return;
    double mean = 0, dmean = 0;
    for (int e = 0; e < E; e++) mean += counts[e];
    mean /= E;
    for (int e = 0; e < E; e++) { double d = mean - counts[e]; dmean += coeff * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0); }
    dmean /= E;
    for (int e = 0; e < E; e++) {
        double d = mean - counts[e];
        bias[e] += (float)(coeff * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0) - dmean);
    }
}
int mt_cuda_expert_bias_update(mt_cuda *c, float *bias, const int32_t *counts, int E, float coeff) {
    k_bias_update<<<1, 1, 0, c->stream>>>(bias, counts, E, coeff);
    LAUNCHED();
    return 0;
}

}  /* extern "C" */
