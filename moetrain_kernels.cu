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
 *   11. FP8 (e4m3): quantizers, dense GEMM (cuBLASLt block-scaled), grouped GEMM
 */
#include <cuda.h>            /* CUtensorMap (the encoder is reached through the runtime) */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <nccl.h>
#if __has_include(<nccl_device.h>) && (NCCL_MAJOR > 2 || (NCCL_MAJOR == 2 && NCCL_MINOR >= 28))
#include <nccl_device.h>       /* symmetric windows: the device-side expert exchange */
#define MT_HAVE_LSA 1
#else
#define MT_HAVE_LSA 0
#endif
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

#define MT_SIDE_STREAMS 4          /* grouped GEMMs spread experts over these */
#define MT_SIDE_WS (32u << 20)
struct mt_cuda {
    int device;              /* the binding's device: every call makes it current first */
    int n_sms, split_sms;    /* this GPU's multiprocessors; the count the grouped GEMM's split choice uses (tuning) */
    int attn_recompute_dq;   /* the attention backward recomputes S and dP for dQ instead of storing dS (less workspace) */
    int gemm_preset, gemm_derived;   /* cuBLASLt choices taken from the graph's tuning, and chosen here */
    cudaStream_t stream;     /* where launches go now: one of queue[] */
    cudaStream_t queue[MT_NQUEUES];   /* one stream per queue; [MT_Q_COMPUTE] is created with the context, the
                                         others on first use at the highest priority */
    cudaEvent_t *qev;        /* per graph node: recorded after it, for the other streams to wait on */
    int n_qev;
    cudaStream_t side[MT_SIDE_STREAMS];
    void *side_ws[MT_SIDE_STREAMS];
    cudaEvent_t fork, join[MT_SIDE_STREAMS];
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

/* Rows of bf16 in chunks of 8 elements (16 bytes). On the vector path (V: the row length is a multiple of 8 and
 * every row pointer 16-byte aligned) a chunk is one 16-byte load or store; otherwise it is read element by element
 * with the row end checked (elements past it read as zero bits and are never stored). Both paths give the same
 * values per element; the memory-bound kernels below use them to keep 16 bytes per load in flight. */
template <bool V>
__device__ __forceinline__ uint4 ld8(const bf16 *row, int d, int D) {
    if constexpr (V) return *(const uint4 *)(row + d);
    unsigned short e[8];
    const unsigned short *r = (const unsigned short *)row;
#pragma unroll
    for (int j = 0; j < 8; j++) e[j] = d + j < D ? r[d + j] : (unsigned short)0;
    uint4 u;
    u.x = e[0] | (unsigned)e[1] << 16; u.y = e[2] | (unsigned)e[3] << 16;
    u.z = e[4] | (unsigned)e[5] << 16; u.w = e[6] | (unsigned)e[7] << 16;
    return u;
}
template <bool V>
__device__ __forceinline__ void st8raw(bf16 *row, int d, int D, uint4 u) {
    if constexpr (V) { *(uint4 *)(row + d) = u; return; }
    const unsigned short *e = (const unsigned short *)&u;
    unsigned short *r = (unsigned short *)row;
#pragma unroll
    for (int j = 0; j < 8; j++) if (d + j < D) r[d + j] = e[j];
}
__device__ __forceinline__ void unpack8(float (&f)[8], uint4 u) {
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
    for (int k = 0; k < 4; k++) { f[2 * k] = __low2float(h[k]); f[2 * k + 1] = __high2float(h[k]); }
}
/* round to bf16 (nearest even, as tobf) and pack */
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
    uint4 u;
    __nv_bfloat162 *h = (__nv_bfloat162 *)&u;
#pragma unroll
    for (int k = 0; k < 4; k++) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
    return u;
}
template <bool V>
__device__ __forceinline__ void st8(bf16 *row, int d, int D, const float (&f)[8]) { st8raw<V>(row, d, D, pack8(f)); }
/* 8 f32 (a weight vector) at element d: two 16-byte loads on the vector path */
template <bool V>
__device__ __forceinline__ void ld8f(float (&f)[8], const float *w, int d, int D) {
    if constexpr (V) {
        float4 a = *(const float4 *)(w + d), b = *(const float4 *)(w + d + 4);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) f[j] = d + j < D ? w[d + j] : 0.0f;
    }
}
/* host: may rows of D elements of esz bytes at these pointers take the vector path */
static inline bool mt__rows16(int64_t D, int esz, const void *a, const void *b = NULL, const void *c = NULL, const void *d = NULL,
                              const void *e = NULL) {
    return (D * esz) % 16 == 0 && !(((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | (uintptr_t)e) & 15);
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
    c->queue[MT_Q_COMPUTE] = c->stream;
    if (e == cudaSuccess) { c->lt_ws_bytes = MT_SIDE_WS; /* all workspaces equal: a cached algorithm fits any stream */ e = cudaMalloc(&c->lt_ws, c->lt_ws_bytes); }
    if (e == cudaSuccess) e = cudaMalloc((void **)&c->flag, sizeof(int));
    if (e == cudaSuccess) e = cudaMemset(c->flag, 0, sizeof(int));
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->fork, cudaEventDisableTiming);
    for (int i = 0; i < MT_SIDE_STREAMS && e == cudaSuccess; i++) {
        e = cudaStreamCreateWithFlags(&c->side[i], cudaStreamNonBlocking);
        if (e == cudaSuccess) e = cudaMalloc(&c->side_ws[i], MT_SIDE_WS);
        if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->join[i], cudaEventDisableTiming);
    }
    if (e != cudaSuccess) { mt_cuda_destroy(c); return mt_errf(err, "CUDA device %d: %s", device, cudaGetErrorString(e)); }
    c->in_use = c->peak = c->lt_ws_bytes + (size_t)MT_SIDE_STREAMS * MT_SIDE_WS;
    if (cublasLtCreate(&c->lt) != CUBLAS_STATUS_SUCCESS) { mt_cuda_destroy(c); return mt_errf(err, "cublasLtCreate failed"); }
    c->cache = (mt__gemm_entry *)calloc(MT_GEMM_CACHE, sizeof(mt__gemm_entry));
    if (!c->cache) { mt_cuda_destroy(c); return mt_errf(err, "out of memory"); }
    if (cudaDeviceGetAttribute(&c->n_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || c->n_sms < 1) {
        mt_cuda_destroy(c);
        return mt_errf(err, "CUDA device %d: cannot read its multiprocessor count", device);
    }
    c->split_sms = c->n_sms;
    *out = c;
    return 0;
}

/* Make the binding's device current on the calling thread: a runtime may be
 * driven from any thread, whatever device that thread used last. */
int mt_cuda_use(mt_cuda *c) {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == c->device) return 0;
    CK(cudaSetDevice(c->device));
    return 0;
}
int mt_cuda_device_of(mt_cuda *c, const void *p, int *device) {
    cudaPointerAttributes a;
    CK(cudaPointerGetAttributes(&a, p));
    *device = a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
    return 0;
}
int mt_cuda_device_info(mt_cuda *c, mt_tuning_info *t) {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, c->device));
    memset(t, 0, sizeof *t);
    for (size_t i = 0; i + 1 < sizeof t->device && p.name[i]; i++) t->device[i] = p.name[i];   /* NUL-padded, terminated */
    t->sm = p.major * 10 + p.minor;
    t->n_sms = p.multiProcessorCount;
    t->blas_version = (int64_t)cublasLtGetVersion();
    return 0;
}
void mt_cuda_set_split_sms(mt_cuda *c, int n) { c->split_sms = n > 0 ? n : c->n_sms; }
void mt_cuda_set_attn_recompute_dq(mt_cuda *c, int on) { c->attn_recompute_dq = on != 0; }

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
    for (int i = 0; i < MT_SIDE_STREAMS; i++) {
        if (c->side_ws[i]) cudaFree(c->side_ws[i]);
        if (c->side[i]) cudaStreamDestroy(c->side[i]);
        if (c->join[i]) cudaEventDestroy(c->join[i]);
    }
    if (c->fork) cudaEventDestroy(c->fork);
    for (int i = 0; i < c->n_ev; i++) cudaEventDestroy(c->ev[i]);
    free(c->ev);
    for (int i = 0; i < c->n_qev; i++) cudaEventDestroy(c->qev[i]);
    free(c->qev);
    for (int q = 0; q < MT_NQUEUES; q++) if (c->queue[q]) cudaStreamDestroy(c->queue[q]);
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
int mt_cuda_event_record(mt_cuda *c, int i) {   /* a timing event: in a stream capture, a record node of the graph */
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    CK(cudaStreamIsCapturing(c->stream, &st));
    if (st == cudaStreamCaptureStatusActive) CK(cudaEventRecordWithFlags(c->ev[i], c->stream, cudaEventRecordExternal));
    else CK(cudaEventRecord(c->ev[i], c->stream));
    return 0;
}
float mt_cuda_event_ms(mt_cuda *c, int i, int j) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, c->ev[i], c->ev[j]) != cudaSuccess) { cudaGetLastError(); return 0; }
    return ms;
}
/* Queues: launches go to the current queue's stream; events order the streams. */
int mt_cuda_set_queue(mt_cuda *c, int q) {
    if (q < 0 || q >= MT_NQUEUES) return mt__fail(c, "queue", "no such queue");
    if (!c->queue[q]) {
        int least = 0, greatest = 0;
        CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
        CK(cudaStreamCreateWithPriority(&c->queue[q], cudaStreamNonBlocking, greatest));
    }
    c->stream = c->queue[q];
    return 0;
}
int mt_cuda_queue_events(mt_cuda *c, int n) {
    if (n <= c->n_qev) return 0;
    cudaEvent_t *ev = (cudaEvent_t *)realloc(c->qev, sizeof(cudaEvent_t) * (size_t)n);
    if (!ev) return mt__fail(c, "events", "out of memory");
    c->qev = ev;
    for (; c->n_qev < n; c->n_qev++) CK(cudaEventCreateWithFlags(&c->qev[c->n_qev], cudaEventDisableTiming));
    return 0;
}
int mt_cuda_queue_record(mt_cuda *c, int i) {
    CK(cudaEventRecord(c->qev[i], c->stream));
    return 0;
}
int mt_cuda_queue_wait(mt_cuda *c, int i) {
    CK(cudaStreamWaitEvent(c->stream, c->qev[i], 0));
    return 0;
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
    if (f >= MT_CUDA_FLAG_PEER) {
        char why[160];
        snprintf(why, sizeof why, "ep peer %d did not answer the expert exchange within the timeout (a rank died or hangs)",
                 f - MT_CUDA_FLAG_PEER);
        return mt__fail(c, "step", why);
    }
    return mt__fail(c, "step", f == 1 ? "an expert index was out of range" : f == MT_CUDA_FLAG_BOUND ?
                    "the expert exchange received more rows than planned" : "a kernel reported invalid data");
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

/* The cache slot of a key: its entry, or the empty slot it would take (NULL: the cache is full). */
static mt__gemm_entry *mt__gemm_slot(mt_cuda *c, int ta, int tb, int mb, int N, int K, int at, int bt, int ct) {
    unsigned h = (unsigned)(ta * 31 + tb * 17 + mb * 131 + N * 7919 + K * 104729 + at * 3 + bt * 5 + ct * 11);
    for (int p = 0; p < MT_GEMM_CACHE; p++) {
        mt__gemm_entry *x = &c->cache[(h + p) % MT_GEMM_CACHE];
        if (!x->used) return x;
        if (x->ta == ta && x->tb == tb && x->mb == mb && x->n == N && x->k == K && x->at == at && x->bt == bt && x->ct == ct) return x;
    }
    return NULL;
}

/* cuBLAS's view of a row-major GEMM: layouts of B (its first operand: col-major rows x cols with ld = B's
 * row-major row length), A and C; a descriptor with the transposes; the heuristic's first algorithm. */
static void mt__gemm_layouts_free(cublasLtMatrixLayout_t l[3]) {
    for (int i = 0; i < 3; i++) if (l[i]) cublasLtMatrixLayoutDestroy(l[i]);
}
static int mt__gemm_layouts(int ta, int tb, int M, int N, int K, int at, int bt, int ct, cublasLtMatrixLayout_t l[3]) {
    l[0] = l[1] = l[2] = NULL;
    if (cublasLtMatrixLayoutCreate(&l[0], mt__cu_type(bt), tb ? K : N, tb ? N : K, tb ? K : N) ||
        cublasLtMatrixLayoutCreate(&l[1], mt__cu_type(at), ta ? M : K, ta ? K : M, ta ? M : K) ||
        cublasLtMatrixLayoutCreate(&l[2], mt__cu_type(ct), N, M, N)) {
        mt__gemm_layouts_free(l);
        return -1;
    }
    return 0;
}
static int mt__gemm_desc(int ta, int tb, cublasLtMatmulDesc_t *d) {
    cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    *d = NULL;
    if (cublasLtMatmulDescCreate(d, CUBLAS_COMPUTE_32F, CUDA_R_32F) ||
        cublasLtMatmulDescSetAttribute(*d, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa) ||
        cublasLtMatmulDescSetAttribute(*d, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb)) {
        if (*d) cublasLtMatmulDescDestroy(*d);
        *d = NULL;
        return -1;
    }
    return 0;
}
static int mt__gemm_heuristic(mt_cuda *c, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t l[3], size_t ws_bytes, cublasLtMatmulAlgo_t *algo) {
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    int bad = cublasLtMatmulPreferenceCreate(&pref) ||
              cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes) ||
              cublasLtMatmulAlgoGetHeuristic(c->lt, d, l[0], l[1], l[2], l[2], pref, 1, &res, &found) || found < 1;
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (!bad) *algo = res.algo;
    return bad ? -1 : 0;
}

/* C = op(A) op(B), or with acc (same layout as C): C = acc + op(A) op(B) in one pass (the epilogue
 * reads acc: beta = 1), so a residual or gradient sum costs no separate kernel. */
static int mt__lt_gemm_on(mt_cuda *c, cudaStream_t stream, void *ws, size_t ws_bytes, int ta, int tb, int M, int N, int K,
                          const void *A, int at, const void *B, int bt, void *C, int ct, const void *acc) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) {
        size_t bytes = (size_t)M * N * (ct == MT_BF16 ? 2 : 4);
        if (acc) CK(cudaMemcpyAsync(C, acc, bytes, cudaMemcpyDeviceToDevice, stream));
        else CK(cudaMemsetAsync(C, 0, bytes, stream));
        return 0;
    }
    int mb = mt__bucket(M);
    mt__gemm_entry *e = mt__gemm_slot(c, ta, tb, mb, N, K, at, bt, ct);
    cublasLtMatrixLayout_t l[3];
    if (mt__gemm_layouts(ta, tb, M, N, K, at, bt, ct, l)) return mt__fail(c, "cublasLtMatrixLayoutCreate", "failed");
    int rc = 0;
    mt__gemm_entry local;
    memset(&local, 0, sizeof local);
    if (!e || !e->used) {
        mt__gemm_entry *n = e ? e : &local;
        if (mt__gemm_desc(ta, tb, &n->desc) || mt__gemm_heuristic(c, n->desc, l, ws_bytes, &n->algo)) {
            if (n->desc) cublasLtMatmulDescDestroy(n->desc);
            n->desc = NULL;
            rc = mt__fail(c, "cuBLASLt", "no GEMM algorithm for this shape");
        } else {
            n->used = 1; n->ta = ta; n->tb = tb; n->mb = mb; n->n = N; n->k = K; n->at = at; n->bt = bt; n->ct = ct;
            c->gemm_derived++;
        }
        e = n;
    }
    if (!rc) {
        float one = 1.0f, beta = acc ? 1.0f : 0.0f;
        const void *Cin = acc ? acc : C;
        cublasStatus_t st = cublasLtMatmul(c->lt, e->desc, &one, B, l[0], A, l[1], &beta, Cin, l[2], C, l[2], &e->algo, ws, ws_bytes, stream);
        if (st != CUBLAS_STATUS_SUCCESS) {   /* the bucket's algorithm does not fit this M: ask for this exact shape */
            cublasLtMatmulAlgo_t exact;
            if (!mt__gemm_heuristic(c, e->desc, l, ws_bytes, &exact))
                st = cublasLtMatmul(c->lt, e->desc, &one, B, l[0], A, l[1], &beta, Cin, l[2], C, l[2], &exact, ws, ws_bytes, stream);
            if (st != CUBLAS_STATUS_SUCCESS) {
                char why[128];
                snprintf(why, sizeof why, "status %d for M=%d N=%d K=%d", (int)st, M, N, K);
                rc = mt__fail(c, "cublasLtMatmul", why);
            }
        }
    }
    if (local.used) cublasLtMatmulDescDestroy(local.desc);
    mt__gemm_layouts_free(l);
    return rc;
}
static int mt__lt_gemm(mt_cuda *c, int ta, int tb, int M, int N, int K, const void *A, int at, const void *B, int bt, void *C,
                       int ct, const void *acc) {
    return mt__lt_gemm_on(c, c->stream, c->lt_ws, c->lt_ws_bytes, ta, tb, M, N, K, A, at, B, bt, C, ct, acc);
}

static_assert(sizeof(cublasLtMatmulAlgo_t) == 8 * MT_ALGO_WORDS, "cuBLASLt algorithm size");

/* The choice the runtime would make for this key (the same heuristic, deterministic for a GPU model and
 * library version), without touching the cache: precompile records it in the graph's tuning. */
int mt_cuda_gemm_choose(mt_cuda *c, mt_tuning *t, int M) {
    cublasLtMatrixLayout_t l[3];
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatmulAlgo_t algo;
    int bad = mt__gemm_layouts(t->ta, t->tb, M, t->n, t->k, t->at, t->bt, t->ct, l);
    bad = bad || mt__gemm_desc(t->ta, t->tb, &desc) || mt__gemm_heuristic(c, desc, l, c->lt_ws_bytes, &algo);
    if (!bad) memcpy(t->algo, &algo, sizeof algo);
    if (desc) cublasLtMatmulDescDestroy(desc);
    mt__gemm_layouts_free(l);
    if (bad) {
        char why[96];
        snprintf(why, sizeof why, "no algorithm for M=%d N=%d K=%d", M, t->n, t->k);
        return mt__fail(c, "cuBLASLt", why);
    }
    return 0;
}
/* Take these choices instead of choosing: a loading rank runs the kernels precompile chose. */
int mt_cuda_gemm_preset(mt_cuda *c, const mt_tuning *t, int n) {
    for (int i = 0; i < n; i++) {
        mt__gemm_entry *e = mt__gemm_slot(c, t[i].ta, t[i].tb, t[i].mb, t[i].n, t[i].k, t[i].at, t[i].bt, t[i].ct);
        if (!e) return mt__fail(c, "tuning", "the GEMM cache is full");
        if (e->used) continue;
        if (mt__gemm_desc(t[i].ta, t[i].tb, &e->desc)) return mt__fail(c, "tuning", "cublasLtMatmulDescCreate failed");
        memcpy(&e->algo, t[i].algo, sizeof e->algo);
        e->used = 1; e->ta = t[i].ta; e->tb = t[i].tb; e->mb = t[i].mb; e->n = t[i].n; e->k = t[i].k;
        e->at = t[i].at; e->bt = t[i].bt; e->ct = t[i].ct;
        c->gemm_preset++;
    }
    return 0;
}
/* What this rank runs: choices taken from the tuning and made here, and a digest of every (key, algorithm)
 * (order-free), so ranks can compare their kernels. */
uint64_t mt_cuda_gemm_digest(mt_cuda *c, int *preset, int *derived) {
    uint64_t d = 0;
    for (int i = 0; i < MT_GEMM_CACHE; i++) {
        const mt__gemm_entry *e = &c->cache[i];
        if (!e->used) continue;
        int32_t key[8] = {e->ta, e->tb, e->mb, e->n, e->k, e->at, e->bt, e->ct};
        uint64_t h = 1469598103934665603ull;
        const uint8_t *p = (const uint8_t *)key;
        for (size_t k = 0; k < sizeof key; k++) h = (h ^ p[k]) * 1099511628211ull;
        p = (const uint8_t *)&e->algo;
        for (size_t k = 0; k < sizeof e->algo; k++) h = (h ^ p[k]) * 1099511628211ull;
        d += h;
    }
    if (preset) *preset = c->gemm_preset;
    if (derived) *derived = c->gemm_derived;
    return d;
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

/* C = op(A) op(B) (+ acc when given). bf16 x bf16 -> bf16 or f32 on tensor
 * cores, acc added in the GEMM epilogue before the one rounding; any f32
 * operand -> everything in exact f32 (the router's small GEMMs), then acc
 * added as a separate ADD would. */
int mt_cuda_matmul(mt_cuda *c, void *C, int ct, const void *A, int at, const void *B, int bt, int M, int N, int K, int ta,
                   int tb, void *ws, const void *acc) {
    if (at == MT_BF16 && bt == MT_BF16) return mt__lt_gemm(c, ta, tb, M, N, K, A, at, B, bt, C, ct, acc);
    char *w = (char *)ws;
    const void *A32 = A, *B32 = B;
    void *C32 = C;
    if (at == MT_BF16) { A32 = w; if (mt_cuda_cast(c, w, MT_F32, A, MT_BF16, (int64_t)M * K)) return -1; w += mt__al((size_t)M * K * 4); }
    if (bt == MT_BF16) { B32 = w; if (mt_cuda_cast(c, w, MT_F32, B, MT_BF16, (int64_t)K * N)) return -1; w += mt__al((size_t)K * N * 4); }
    if (ct == MT_BF16) C32 = w;
    if (mt__lt_gemm(c, ta, tb, M, N, K, A32, MT_F32, B32, MT_F32, C32, MT_F32, NULL)) return -1;
    if (ct == MT_BF16 && mt_cuda_cast(c, C, MT_BF16, C32, MT_F32, (int64_t)M * N)) return -1;
    return acc ? mt_cuda_add(c, C, C, acc, (int64_t)M * N, ct) : 0;
}

/* ========================================================================
 * 3. elementwise
 * ====================================================================== */

/* casts: 8 elements a thread (one 16-byte bf16 chunk, two float4) where n and the pointers allow, else one */
__global__ void k_f32_to_bf16(bf16 *y, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) y[i] = tobf(x[i]);
}
__global__ void k_bf16_to_f32(float *y, const bf16 *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) y[i] = bf(x[i]);
}
__global__ void k_f32_to_bf16_8(uint4 *y, const float4 *x, int64_t n8) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8; i += (int64_t)gridDim.x * blockDim.x) {
        float4 a = x[2 * i], b = x[2 * i + 1];
        float f[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        y[i] = pack8(f);
    }
}
__global__ void k_bf16_to_f32_8(float4 *y, const uint4 *x, int64_t n8) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8; i += (int64_t)gridDim.x * blockDim.x) {
        float f[8];
        unpack8(f, x[i]);
        y[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
        y[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
}
int mt_cuda_cast(mt_cuda *c, void *dst, int dst_dtype, const void *src, int src_dtype, int64_t n) {
    if (n <= 0) return 0;
    if (dst_dtype == src_dtype) { CK(cudaMemcpyAsync(dst, src, (size_t)n * (dst_dtype == MT_BF16 ? 2 : 4), cudaMemcpyDeviceToDevice, c->stream)); return 0; }
    bool v = n % 8 == 0 && !(((uintptr_t)dst | (uintptr_t)src) & 15);
    unsigned g = mt__blocks(v ? n / 8 : n, 256);
    if (g > 65536) g = 65536;
    if (v && dst_dtype == MT_BF16) k_f32_to_bf16_8<<<g, 256, 0, c->stream>>>((uint4 *)dst, (const float4 *)src, n / 8);
    else if (v) k_bf16_to_f32_8<<<g, 256, 0, c->stream>>>((float4 *)dst, (const uint4 *)src, n / 8);
    else if (dst_dtype == MT_BF16) k_f32_to_bf16<<<g, 256, 0, c->stream>>>((bf16 *)dst, (const float *)src, n);
    else k_bf16_to_f32<<<g, 256, 0, c->stream>>>((float *)dst, (const bf16 *)src, n);
    LAUNCHED();
    return 0;
}

/* Parameter initialization on the device: the CPU's bits (mt_init_draw in moetrain.h), with no host
 * buffer and no upload. */
__global__ void k_init_fill(float *dst, int64_t stored, int64_t lo, int64_t n, int64_t per, int init,
                            const uint64_t *keys, int64_t c0, const float *table, double std) {
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < stored; k += stride) {
        int64_t l = lo + k;
        double x = 0;
        if (l < n) {
            if (init == MT_INIT_ONE) x = 1;
            else if (init == MT_INIT_NORMAL) {
                int64_t ch = l / per;
                x = mt_init_draw(table, mt_init_bits(keys[ch - c0], (uint64_t)(l - ch * per))) * std;
            }
        }
        dst[k] = (float)x;
    }
}
int mt_cuda_init_fill(mt_cuda *c, float *dst, int64_t stored, int64_t lo, int64_t n, int64_t per, int init,
                      const uint64_t *keys, int64_t first_chunk, const float *table, float std) {
    if (stored <= 0) return 0;
    if (init == MT_INIT_NORMAL && (per <= 0 || !keys || !table)) return mt__fail(c, __func__, "normal init needs chunks, keys and a table");
    unsigned g = mt__blocks(stored, 256);
    if (g > 65536) g = 65536;
    k_init_fill<<<g, 256, 0, c->stream>>>(dst, stored, lo, n, per, init, keys, first_chunk, table, (double)std);
    LAUNCHED();
    return 0;
}

/* 8 bf16 at a time (16-byte loads) when the length and pointers allow */
struct bf8 { __nv_bfloat162 h[4]; };
__device__ __forceinline__ bool mt__vec8(const void *a, const void *b, const void *c, const void *d, int64_t n) {
    return n % 8 == 0 && !(((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d) & 15);
}
__global__ void k_add_bf16(bf16 *o, const bf16 *a, const bf16 *b, int64_t n) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    if (mt__vec8(o, a, b, b, n)) {
        for (int64_t i = t; i < n / 8; i += stride) {
            bf8 x = ((const bf8 *)a)[i], y = ((const bf8 *)b)[i], z;
#pragma unroll
            for (int k = 0; k < 4; k++) z.h[k] = __floats2bfloat162_rn(__low2float(x.h[k]) + __low2float(y.h[k]), __high2float(x.h[k]) + __high2float(y.h[k]));
            ((bf8 *)o)[i] = z;
        }
        return;
    }
    for (int64_t i = t; i < n; i += stride) o[i] = tobf(bf(a[i]) + bf(b[i]));
}
__global__ void k_add_f32(float *o, const float *a, const float *b, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) o[i] = a[i] + b[i];
}
int mt_cuda_add(mt_cuda *c, void *out, const void *a, const void *b, int64_t n, int dtype) {
    if (n <= 0) return 0;
    unsigned g = mt__blocks(n / 8 + 1, 256);
    if (g > 65536) g = 65536;
    if (dtype == MT_BF16) k_add_bf16<<<g, 256, 0, c->stream>>>((bf16 *)out, (const bf16 *)a, (const bf16 *)b, n);
    else k_add_f32<<<g, 256, 0, c->stream>>>((float *)out, (const float *)a, (const float *)b, n);
    LAUNCHED();
    return 0;
}

/* the logistic with the approximate reciprocal (rcp.approx: a few ulp, 0 past 2^126; the IEEE division's
   sequence, unrolled 64 times in the grouped GEMM's SwiGLU epilogue, cost that kernel a fifth of its rate) */
__device__ __forceinline__ float sigm(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
__device__ __forceinline__ float swiglu1(float x, float y) { return x * sigm(x) * y; }
/* rows (optional, on the device): only the first *rows rows of cols elements are live (the expert exchange's
   actual count under a planned bound); n stays the bound the launch was sized for */
__device__ __forceinline__ int64_t live_elems(int64_t n, const int32_t *rows, int64_t cols) {
    if (!rows) return n;
    int64_t m = (int64_t)*rows * cols;
    return m < n ? m : n;
}
__global__ void k_swiglu(bf16 *h, const bf16 *g, const bf16 *u, int64_t n, const int32_t *rows, int64_t cols) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    n = live_elems(n, rows, cols);
    if (mt__vec8(h, g, u, u, n)) {
        for (int64_t i = t; i < n / 8; i += stride) {
            bf8 x = ((const bf8 *)g)[i], y = ((const bf8 *)u)[i], z;
#pragma unroll
            for (int k = 0; k < 4; k++)
                z.h[k] = __floats2bfloat162_rn(swiglu1(__low2float(x.h[k]), __low2float(y.h[k])), swiglu1(__high2float(x.h[k]), __high2float(y.h[k])));
            ((bf8 *)h)[i] = z;
        }
        return;
    }
    for (int64_t i = t; i < n; i += stride) h[i] = tobf(swiglu1(bf(g[i]), bf(u[i])));
}
__device__ __forceinline__ void swiglu1_bwd(float x, float y, float d, float &dg, float &du) {
    const float s = sigm(x);   /* (each rounding spelled out: k_quant_cols<., Q8_SWIGLU_BWD> makes the same bits) */
    dg = __fmul_rn(__fmul_rn(__fmul_rn(d, y), s), __fmaf_rn(x, 1.0f - s, 1.0f));
    du = __fmul_rn(__fmul_rn(d, x), s);
}
__global__ void k_swiglu_bwd(bf16 *dg, bf16 *du, const bf16 *g, const bf16 *u, const bf16 *dh, int64_t n, const int32_t *rows,
                             int64_t cols) {
    int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    n = live_elems(n, rows, cols);
    if (mt__vec8(dg, du, g, u, n) && mt__vec8(dh, dh, dh, dh, n)) {
        for (int64_t i = t; i < n / 8; i += stride) {
            bf8 x = ((const bf8 *)g)[i], y = ((const bf8 *)u)[i], d = ((const bf8 *)dh)[i], a, b;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float a0, b0, a1, b1;
                swiglu1_bwd(__low2float(x.h[k]), __low2float(y.h[k]), __low2float(d.h[k]), a0, b0);
                swiglu1_bwd(__high2float(x.h[k]), __high2float(y.h[k]), __high2float(d.h[k]), a1, b1);
                a.h[k] = __floats2bfloat162_rn(a0, a1);
                b.h[k] = __floats2bfloat162_rn(b0, b1);
            }
            ((bf8 *)dg)[i] = a;
            ((bf8 *)du)[i] = b;
        }
        return;
    }
    for (int64_t i = t; i < n; i += stride) {
        float a, b;
        swiglu1_bwd(bf(g[i]), bf(u[i]), bf(dh[i]), a, b);
        dg[i] = tobf(a);
        du[i] = tobf(b);
    }
}
int mt_cuda_swiglu_forward(mt_cuda *c, void *h, const void *g, const void *u, int64_t n, const int32_t *rows, int64_t cols) {
    if (n <= 0) return 0;
    unsigned gr = mt__blocks(n / 8 + 1, 256);
    if (gr > 65536) gr = 65536;
    k_swiglu<<<gr, 256, 0, c->stream>>>((bf16 *)h, (const bf16 *)g, (const bf16 *)u, n, rows, cols);
    LAUNCHED();
    return 0;
}
int mt_cuda_swiglu_backward(mt_cuda *c, void *dg, void *du, const void *g, const void *u, const void *dh, int64_t n,
                            const int32_t *rows, int64_t cols) {
    if (n <= 0) return 0;
    unsigned gr = mt__blocks(n / 8 + 1, 256);
    if (gr > 65536) gr = 65536;
    k_swiglu_bwd<<<gr, 256, 0, c->stream>>>((bf16 *)dg, (bf16 *)du, (const bf16 *)g, (const bf16 *)u, (const bf16 *)dh, n, rows, cols);
    LAUNCHED();
    return 0;
}

/* split / concat of rows whose parts are whole 16-byte chunks: one warp per row, all of a row's loads in flight
 * before its stores (a 2D copy moves the narrow part in short rows, well under the bandwidth). In 16-byte units:
 * a row of x is ca chunks of x1, then cb of x2; a NULL source of the concat writes zeros. */
#define MT_SPLIT_UNROLL 4
__global__ void __launch_bounds__(256) k_split16(uint4 *x1, uint4 *x2, uint4 *x, int N, int ca, int cb, int concat) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31, cr = ca + cb;
    if (r >= N) return;
    for (int k0 = lane; k0 < cr; k0 += 32 * MT_SPLIT_UNROLL) {
        uint4 v[MT_SPLIT_UNROLL];
#pragma unroll
        for (int u = 0; u < MT_SPLIT_UNROLL; u++) {
            int k = k0 + 32 * u;
            if (k >= cr) continue;
            if (!concat) v[u] = x[(int64_t)r * cr + k];
            else {
                const uint4 *src = k < ca ? x1 : x2;
                v[u] = src ? src[k < ca ? (int64_t)r * ca + k : (int64_t)r * cb + k - ca] : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < MT_SPLIT_UNROLL; u++) {
            int k = k0 + 32 * u;
            if (k >= cr) continue;
            if (concat) x[(int64_t)r * cr + k] = v[u];
            else if (k < ca) x1[(int64_t)r * ca + k] = v[u];
            else x2[(int64_t)r * cb + k - ca] = v[u];
        }
    }
}
static bool mt__split16(int a, int b, int esz, const void *x, const void *x1, const void *x2) {
    return (int64_t)a * esz % 16 == 0 && (int64_t)b * esz % 16 == 0 && !(((uintptr_t)x | (uintptr_t)x1 | (uintptr_t)x2) & 15);
}
int mt_cuda_split(mt_cuda *c, void *x1, void *x2, const void *x, int N, int a, int b, int esz) {
    if (N > 0 && mt__split16(a, b, esz, x, x1, x2)) {   /* x is only read */
        k_split16<<<mt__blocks(N, 8), 256, 0, c->stream>>>((uint4 *)x1, (uint4 *)x2, (uint4 *)x, N, a * esz / 16, b * esz / 16, 0);
        LAUNCHED();
        return 0;
    }
    size_t row = (size_t)(a + b) * esz;
    CK(cudaMemcpy2DAsync(x1, (size_t)a * esz, x, row, (size_t)a * esz, N, cudaMemcpyDeviceToDevice, c->stream));
    CK(cudaMemcpy2DAsync(x2, (size_t)b * esz, (const char *)x + (size_t)a * esz, row, (size_t)b * esz, N, cudaMemcpyDeviceToDevice, c->stream));
    return 0;
}
int mt_cuda_concat(mt_cuda *c, void *x, const void *x1, const void *x2, int N, int a, int b, int esz) {
    if (N > 0 && mt__split16(a, b, esz, x, x1, x2)) {
        k_split16<<<mt__blocks(N, 8), 256, 0, c->stream>>>((uint4 *)x1, (uint4 *)x2, (uint4 *)x, N, a * esz / 16, b * esz / 16, 1);
        LAUNCHED();
        return 0;
    }
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
 * It writes the whole [V,D] gradient or a flat range of it (an FSDP shard).
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
/* a shard's rows: elements [lo, hi) of the table, -0.0 outside (the reduce-scatter's other terms) */
__global__ void k_embed_range(bf16 *x, const int32_t *tok, const bf16 *wte, int D, long long lo, long long hi) {
    int n = blockIdx.x;
    long long r0 = (long long)tok[n] * D;
    bf16 *y = x + (int64_t)n * D;
    if (r0 + D <= lo || r0 >= hi) {   /* the row lies outside: -0.0 */
        for (int d = threadIdx.x; d < D; d += blockDim.x) y[d] = __float2bfloat16(-0.0f);
        return;
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) y[d] = r0 + d >= lo && r0 + d < hi ? wte[r0 + d - lo] : __float2bfloat16(-0.0f);
}
int mt_cuda_embed_forward_range(mt_cuda *c, void *x, const int32_t *tok, const void *wte, int N, int D, long long lo, long long len) {
    if (N <= 0) return 0;
    k_embed_range<<<N, 128, 0, c->stream>>>((bf16 *)x, tok, (const bf16 *)wte, D, lo, lo + len);
    LAUNCHED();
    return 0;
}
__global__ void k_iota(int32_t *v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = i;
}
/* pass 1: within each chunk of MT_EMB_CHUNK sorted positions, sum each run of
 * equal tokens into part[run start]; pass 2: each token's first position sums
 * its runs' partials in order. Both orders are fixed: deterministic. */
#define MT_EMB_CHUNK 32
/* An FSDP shard of the gradient keeps its elements [lo, hi) of the [V,D] table: a chunk whose sorted
 * tokens all lie outside is skipped, and only elements inside are stored, at dw[index - lo]. The
 * whole table is lo = 0, hi = V*D. */
__device__ __forceinline__ bool embed_chunk_outside(const int32_t *keys, int i0, int i1, int D, long long lo, long long hi) {
    return (long long)(keys[i1 - 1] + 1) * D <= lo || (long long)keys[i0] * D >= hi;
}
__global__ void k_embed_bwd_part(float *part, const bf16 *dx, const int32_t *keys, const int32_t *pos, int N, int D,
                                 long long lo, long long hi) {
    int i0 = blockIdx.x * MT_EMB_CHUNK, i1 = min(N, i0 + MT_EMB_CHUNK);
    if (embed_chunk_outside(keys, i0, i1, D, lo, hi)) return;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0;
        int start = i0;
        for (int i = i0; i < i1; i++) {
            acc += bf(dx[(int64_t)pos[i] * D + d]);
            if (i + 1 == i1 || keys[i + 1] != keys[i]) { part[(int64_t)start * D + d] = acc; acc = 0; start = i + 1; }
        }
    }
}
__global__ void k_embed_bwd(float *dw, const float *part, const int32_t *keys, int N, int D, long long lo, long long hi) {
    int i = blockIdx.x;
    if (i > 0 && keys[i] == keys[i - 1]) return;       /* not the first of its token */
    int v = keys[i];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        long long at = (long long)v * D + d;
        if (at < lo || at >= hi) continue;
        float acc = 0;
        for (int j = i; j < N && keys[j] == v; j = (j / MT_EMB_CHUNK + 1) * MT_EMB_CHUNK) acc += part[(int64_t)j * D + d];
        dw[at - lo] = acc;
    }
}
}  /* extern "C": the 16-byte variants use the row helpers (templates) */
/* the same two passes on 8 columns per thread (16-byte loads of dx, 32-byte stores of the partials), for D a
 * multiple of 8 and aligned rows; every column sums in the same order as above (bitwise the same). The rows of a
 * step of MT_EMB_STEP positions are loaded before any partial is stored. */
#define MT_EMB_STEP 4
__global__ void __launch_bounds__(256) k_embed_bwd_part8(float *part, const bf16 *dx, const int32_t *keys, const int32_t *pos, int N, int D,
                                                         long long lo, long long hi) {
    int i0 = blockIdx.x * MT_EMB_CHUNK, i1 = min(N, i0 + MT_EMB_CHUNK);
    if (embed_chunk_outside(keys, i0, i1, D, lo, hi)) return;
    for (int d = threadIdx.x * 8; d < D; d += blockDim.x * 8) {
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] = 0;
        int start = i0;
        for (int s0 = i0; s0 < i1; s0 += MT_EMB_STEP) {
            uint4 u[MT_EMB_STEP];
#pragma unroll
            for (int k = 0; k < MT_EMB_STEP; k++)
                if (s0 + k < i1) u[k] = *(const uint4 *)(dx + (int64_t)pos[s0 + k] * D + d);
#pragma unroll
            for (int k = 0; k < MT_EMB_STEP; k++) {
                int i = s0 + k;
                if (i >= i1) break;
                float f[8];
                unpack8(f, u[k]);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[j] += f[j];
                if (i + 1 == i1 || keys[i + 1] != keys[i]) {
                    float4 *o = (float4 *)(part + (int64_t)start * D + d);
                    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[j] = 0;
                    start = i + 1;
                }
            }
        }
    }
}
__global__ void __launch_bounds__(256) k_embed_bwd4(float *dw, const float *part, const int32_t *keys, int N, int D, long long lo, long long hi) {
    int i = blockIdx.x;
    if (i > 0 && keys[i] == keys[i - 1]) return;       /* not the first of its token */
    int v = keys[i];
    for (int d = threadIdx.x * 4; d < D; d += blockDim.x * 4) {
        long long at = (long long)v * D + d;           /* lo, hi and D multiples of 4: the 4 lie inside or outside together */
        if (at < lo || at >= hi) continue;
        float4 acc = make_float4(0, 0, 0, 0);
        for (int j = i; j < N && keys[j] == v; j = (j / MT_EMB_CHUNK + 1) * MT_EMB_CHUNK) {
            float4 p = *(const float4 *)(part + (int64_t)j * D + d);
            acc.x += p.x; acc.y += p.y; acc.z += p.z; acc.w += p.w;
        }
        *(float4 *)(dw + (at - lo)) = acc;
    }
}
extern "C" {
size_t mt_cuda_embed_backward_workspace(int N, int D) {
    size_t tmp = 0;
    cub::DeviceRadixSort::SortPairs(NULL, tmp, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL, (int32_t *)NULL, N);
    return mt__al(tmp) + 3 * mt__al((size_t)N * 4) + mt__al((size_t)N * D * 4);
}
int mt_cuda_embed_backward(mt_cuda *c, float *dwte, const void *dx, const int32_t *tok, int N, int V, int D, void *ws) {
    return mt_cuda_embed_backward_range(c, dwte, dx, tok, N, V, D, 0, (long long)V * D, ws);
}
int mt_cuda_embed_backward_range(mt_cuda *c, float *dw, const void *dx, const int32_t *tok, int N, int V, int D,
                                 long long lo, long long len, void *ws) {
    if (lo < 0 || len < 0) return mt__fail(c, "mt_cuda_embed_backward_range", "negative range");
    CK(cudaMemsetAsync(dw, 0, (size_t)len * 4, c->stream));
    if (N <= 0 || len == 0) return 0;
    long long hi = lo + len;
    size_t tmp = 0;
    cub::DeviceRadixSort::SortPairs(NULL, tmp, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL, (int32_t *)NULL, N);
    char *w = (char *)ws;
    int32_t *iota = (int32_t *)(w + mt__al(tmp)), *keys = iota + mt__al((size_t)N * 4) / 4, *pos = keys + mt__al((size_t)N * 4) / 4;
    k_iota<<<mt__blocks(N, 256), 256, 0, c->stream>>>(iota, N);
    LAUNCHED();
    int bits = 1;
    while ((1 << bits) < V && bits < 31) bits++;
    CK(cub::DeviceRadixSort::SortPairs(w, tmp, tok, keys, iota, pos, N, 0, bits, c->stream));
    float *part = (float *)(pos + mt__al((size_t)N * 4) / 4);
    if (mt__rows16(D, 2, dx, part, dw) && lo % 4 == 0 && len % 4 == 0) {
        k_embed_bwd_part8<<<(N + MT_EMB_CHUNK - 1) / MT_EMB_CHUNK, 256, 0, c->stream>>>(part, (const bf16 *)dx, keys, pos, N, D, lo, hi);
        LAUNCHED();
        k_embed_bwd4<<<N, 256, 0, c->stream>>>(dw, part, keys, N, D, lo, hi);
        LAUNCHED();
        return 0;
    }
    k_embed_bwd_part<<<(N + MT_EMB_CHUNK - 1) / MT_EMB_CHUNK, 256, 0, c->stream>>>(part, (const bf16 *)dx, keys, pos, N, D, lo, hi);
    LAUNCHED();
    k_embed_bwd<<<N, 256, 0, c->stream>>>(dw, part, keys, N, D, lo, hi);
    LAUNCHED();
    return 0;
}

/* ========================================================================
 * 5. RMSNorm: one warp per row; dw by fixed chunks of rows, then a
 *    fixed-order sum of the chunks.
 * ====================================================================== */

#define MT_RMS_CHUNK 32        /* rows per dw partial (rows of up to 1024: MT_RMS_CHUNK_NARROW, more blocks in flight) */
#define MT_RMS_CHUNK_NARROW 8
#define MT_RMS_CACHE 8         /* 8-element chunks per lane held in registers between a row's two passes
                                  (rows up to 2048 wide; longer rows read the rest again); the forward and
                                  the fused backward hold 1 for rows up to 256 and 2 up to 512 (fewer
                                  registers, more rows in flight; the same operations) */
/* the cached chunks a lane for rows D wide (see MT_RMS_CACHE): launch L(V, ADD, C) */
#define MT__RMS_WIDTH(L, V, ADD) do { if (D <= 256) L(V, ADD, 1); else if (D <= 512) L(V, ADD, 2); else L(V, ADD, MT_RMS_CACHE); } while (0)
}  /* extern "C": the RMSNorm kernels are templates */
/* one chunk of the norm's input; ADD: the residual sum h = a + b, rounded to bf16 and stored, is the input */
template <bool V, bool ADD>
__device__ __forceinline__ uint4 mt__rms_in(bf16 *h, const bf16 *a, const bf16 *b, int64_t o, int d, int D) {
    if (!ADD) return ld8<V>(a + o, d, D);
    float x[8], y[8];
    unpack8(x, ld8<V>(a + o, d, D));
    unpack8(y, ld8<V>(b + o, d, D));
#pragma unroll
    for (int j = 0; j < 8; j++) x[j] += y[j];
    uint4 u = pack8(x);
    st8raw<V>(h + o, d, D, u);
    return u;
}
__device__ __forceinline__ float mt__ss8(float ss, uint4 u) {
    float x[8];
    unpack8(x, u);
#pragma unroll
    for (int j = 0; j < 8; j++) ss += x[j] * x[j];
    return ss;
}
template <bool V>
__device__ __forceinline__ void mt__rms_out(bf16 *y, int d, int D, uint4 u, float r, const float *w) {
    float x[8], wv[8];
    unpack8(x, u);
    ld8f<V>(wv, w, d, D);
#pragma unroll
    for (int j = 0; j < 8; j++) x[j] = x[j] * r * wv[j];
    st8<V>(y, d, D, x);
}
/* one warp per row, 8-element chunks. ADD: the fused residual add + RMSNorm; both instantiations perform the
 * same operations on the same values, so the fused node equals the unfused pair (add, then norm) bit for bit */
template <bool V, bool ADD, int C>
__global__ void __launch_bounds__(256, 2) k_rms_fwd(bf16 *h, bf16 *y, float *rstd, const bf16 *a, const bf16 *b, const float *w, int N,
                                                 int D, float eps) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    int64_t o = (int64_t)row * D;
    uint4 c[C], cb[ADD ? C : 1];
    float ss = 0;
#pragma unroll
    for (int i = 0; i < C; i++) {   /* every load of the cached chunks first: none waits for a store */
        int d = (lane + 32 * i) * 8;
        if (d < D) {
            c[i] = ld8<V>(a + o, d, D);
            if (ADD) cb[ADD ? i : 0] = ld8<V>(b + o, d, D);
        }
    }
#pragma unroll
    for (int i = 0; i < C; i++) {
        int d = (lane + 32 * i) * 8;
        if (d < D) {
            if (ADD) {
                float x[8], y[8];
                unpack8(x, c[i]);
                unpack8(y, cb[ADD ? i : 0]);
#pragma unroll
                for (int j = 0; j < 8; j++) x[j] += y[j];
                c[i] = pack8(x);
                st8raw<V>(h + o, d, D, c[i]);
            }
            ss = mt__ss8(ss, c[i]);
        }
    }
    for (int d = (lane + 32 * C) * 8; d < D; d += 256) ss = mt__ss8(ss, mt__rms_in<V, ADD>(h, a, b, o, d, D));
    ss = warp_sum(ss);
    float r = rsqrtf(ss / D + eps);
    if (lane == 0) rstd[row] = r;
#pragma unroll
    for (int i = 0; i < C; i++) {
        int d = (lane + 32 * i) * 8;
        if (d < D) mt__rms_out<V>(y + o, d, D, c[i], r, w);
    }
    for (int d = (lane + 32 * C) * 8; d < D; d += 256) mt__rms_out<V>(y + o, d, D, ld8<V>((ADD ? h : a) + o, d, D), r, w);
}
__device__ __forceinline__ float mt__dot8(float dot, uint4 ug, uint4 ux, const float (&wv)[8]) {
    float g[8], x[8];
    unpack8(g, ug);
    unpack8(x, ux);
#pragma unroll
    for (int j = 0; j < 8; j++) dot += wv[j] * g[j] * x[j];
    return dot;
}
/* dx of one chunk; ADD: dx rounds to bf16 before the residual gradient acc is added, as the unfused pair does */
template <bool V, bool ADD>
__device__ __forceinline__ void mt__rms_dx(bf16 *dx, const bf16 *acc, int d, int D, uint4 ug, uint4 ux, float r, float cc, const float *w) {
    float g[8], x[8], wv[8];
    unpack8(g, ug);
    unpack8(x, ux);
    ld8f<V>(wv, w, d, D);
#pragma unroll
    for (int j = 0; j < 8; j++) g[j] = r * wv[j] * g[j] - cc * x[j];
    if (ADD) {
        float own[8];
        unpack8(own, pack8(g));
        unpack8(g, ld8<V>(acc, d, D));
#pragma unroll
        for (int j = 0; j < 8; j++) g[j] += own[j];
    }
    st8<V>(dx, d, D, g);
}
/* two warps per block: a row's dy and x stay in registers (~170 per thread), so few warps fit an SM; small blocks
 * let them retire independently */
template <bool V, bool ADD>
__global__ void __launch_bounds__(64) k_rms_bwd_dx(bf16 *dx, const bf16 *dy, const bf16 *x, const float *w, const float *rstd,
                                                    const bf16 *acc, int N, int D) {
    int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N) return;
    int64_t o = (int64_t)row * D;
    uint4 cg[MT_RMS_CACHE], cx[MT_RMS_CACHE];
    float dot = 0, wv[8];
#pragma unroll
    for (int i = 0; i < MT_RMS_CACHE; i++) {
        int d = (lane + 32 * i) * 8;
        if (d < D) {
            cg[i] = ld8<V>(dy + o, d, D);
            cx[i] = ld8<V>(x + o, d, D);
            ld8f<V>(wv, w, d, D);
            dot = mt__dot8(dot, cg[i], cx[i], wv);
        }
    }
    for (int d = (lane + 32 * MT_RMS_CACHE) * 8; d < D; d += 256) {
        ld8f<V>(wv, w, d, D);
        dot = mt__dot8(dot, ld8<V>(dy + o, d, D), ld8<V>(x + o, d, D), wv);
    }
    dot = warp_sum(dot);
    float r = rstd[row], cc = r * r * r * dot / D;
#pragma unroll
    for (int i = 0; i < MT_RMS_CACHE; i++) {
        int d = (lane + 32 * i) * 8;
        if (d < D) mt__rms_dx<V, ADD>(dx + o, acc + o, d, D, cg[i], cx[i], r, cc, w);
    }
    for (int d = (lane + 32 * MT_RMS_CACHE) * 8; d < D; d += 256)
        mt__rms_dx<V, ADD>(dx + o, acc + o, d, D, ld8<V>(dy + o, d, D), ld8<V>(x + o, d, D), r, cc, w);
}
/* dw[d] += g x r for one chunk, in a warp's shared-memory row */
template <bool V>
__device__ __forceinline__ void mt__dw8(float *my, int d, int D, uint4 ug, uint4 ux, float r) {
    float g[8], x[8];
    unpack8(g, ug);
    unpack8(x, ux);
    if constexpr (V) {
        float4 *p = (float4 *)(my + d), a = p[0], b = p[1];
        a.x += g[0] * x[0] * r; a.y += g[1] * x[1] * r; a.z += g[2] * x[2] * r; a.w += g[3] * x[3] * r;
        b.x += g[4] * x[4] * r; b.y += g[5] * x[5] * r; b.z += g[6] * x[6] * r; b.w += g[7] * x[7] * r;
        p[0] = a; p[1] = b;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) if (d + j < D) my[d + j] += g[j] * x[j] * r;
    }
}
/* The whole backward in one pass over dy and x: a block takes `rows` consecutive rows, warp k the rows
 * k, k + MT_RMS_WARPS, ... of them in order, one at a time as in k_rms_bwd_dx, and adds g x rstd to its own row
 * of shared memory; the block's dw partial is then the sum of those rows in warp order (fixed, as the chunk's
 * rows are). w is staged in shared memory too: (1 + MT_RMS_WARPS) D floats. */
#define MT_RMS_WARPS 4
#define MT_RMS_FUSED_MAXD 2456   /* (1 + MT_RMS_WARPS) * D * 4 bytes within the default 48 KB */
template <bool V, bool ADD, int C>
__global__ void __launch_bounds__(32 * MT_RMS_WARPS) k_rms_bwd_fused(bf16 *dx, float *part, const bf16 *dy, const bf16 *x, const float *w,
                                                                     const float *rstd, const bf16 *acc, int N, int D, int rows) {
    extern __shared__ float mt_rms_sh[];
    int wp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *sw = mt_rms_sh, *my = mt_rms_sh + (1 + wp) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) sw[d] = w[d];
    for (int d = lane; d < D; d += 32) my[d] = 0;
    __syncthreads();
    for (int j = 0; j < rows / MT_RMS_WARPS; j++) {
        int row = blockIdx.x * rows + j * MT_RMS_WARPS + wp;
        if (row >= N) break;
        int64_t o = (int64_t)row * D;
        float r = rstd[row], dot = 0, wv[8];
        uint4 cg[C], cx[C], ca[ADD ? C : 1];
#pragma unroll
        for (int i = 0; i < C; i++) {   /* every load of the cached chunks first */
            int d = (lane + 32 * i) * 8;
            if (d < D) {
                cg[i] = ld8<V>(dy + o, d, D);
                cx[i] = ld8<V>(x + o, d, D);
                if (ADD) ca[ADD ? i : 0] = ld8<V>(acc + o, d, D);
            }
        }
#pragma unroll
        for (int i = 0; i < C; i++) {
            int d = (lane + 32 * i) * 8;
            if (d < D) {
                ld8f<V>(wv, sw, d, D);
                dot = mt__dot8(dot, cg[i], cx[i], wv);
                mt__dw8<V>(my, d, D, cg[i], cx[i], r);
            }
        }
        for (int d = (lane + 32 * C) * 8; d < D; d += 256) {
            uint4 g = ld8<V>(dy + o, d, D), xx = ld8<V>(x + o, d, D);
            ld8f<V>(wv, sw, d, D);
            dot = mt__dot8(dot, g, xx, wv);
            mt__dw8<V>(my, d, D, g, xx, r);
        }
        dot = warp_sum(dot);
        float cc = r * r * r * dot / D;
#pragma unroll
        for (int i = 0; i < C; i++) {
            int d = (lane + 32 * i) * 8;
            if (d < D) {
                float g[8], xv[8];
                unpack8(g, cg[i]);
                unpack8(xv, cx[i]);
                ld8f<V>(wv, sw, d, D);
#pragma unroll
                for (int k = 0; k < 8; k++) g[k] = r * wv[k] * g[k] - cc * xv[k];
                if (ADD) {
                    float own[8];
                    unpack8(own, pack8(g));
                    unpack8(g, ca[ADD ? i : 0]);
#pragma unroll
                    for (int k = 0; k < 8; k++) g[k] += own[k];
                }
                st8<V>(dx + o, d, D, g);
            }
        }
        for (int d = (lane + 32 * C) * 8; d < D; d += 256)
            mt__rms_dx<V, ADD>(dx + o, acc + o, d, D, ld8<V>(dy + o, d, D), ld8<V>(x + o, d, D), r, cc, sw);
    }
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float t = 0;
        for (int k = 0; k < MT_RMS_WARPS; k++) t += mt_rms_sh[(1 + k) * D + d];
        part[(int64_t)blockIdx.x * D + d] = t;
    }
}
/* dw partials: part[chunk][d] = sum over the chunk's rows, in row order; one thread per 8 columns */
template <bool V>
__global__ void __launch_bounds__(64) k_rms_bwd_dw_part(float *part, const bf16 *dy, const bf16 *x, const float *rstd, int N, int D) {
    int d = (blockIdx.y * blockDim.x + threadIdx.x) * 8, ch = blockIdx.x;
    if (d >= D) return;
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] = 0;
    int end = min(N, (ch + 1) * MT_RMS_CHUNK);
#pragma unroll 4
    for (int n = ch * MT_RMS_CHUNK; n < end; n++) {
        float g[8], xv[8], r = rstd[n];
        unpack8(g, ld8<V>(dy + (int64_t)n * D, d, D));
        unpack8(xv, ld8<V>(x + (int64_t)n * D, d, D));
#pragma unroll
        for (int j = 0; j < 8; j++) acc[j] += g[j] * xv[j] * r;
    }
    float *p = part + (int64_t)ch * D + d;
    if constexpr (V) {
        ((float4 *)p)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        ((float4 *)p)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) if (d + j < D) p[j] = acc[j];
    }
}
extern "C" {
/* out[d] = sum of part[ch][d] over the chunks: 32 columns x 32 groups per block, group t sums chunks t, t + 32,
 * ... in order, then the 32 group sums add in order */
__global__ void __launch_bounds__(1024) k_colsum(float *out, const float *part, int chunks, int D) {
    __shared__ float sh[32][33];
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5, d = blockIdx.x * 32 + tx;
    float acc = 0;
    if (d < D)
#pragma unroll 16
        for (int ch = ty; ch < chunks; ch += 32) acc += part[(int64_t)ch * D + d];   /* 16 loads in flight, then their adds in order */
    sh[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && d < D) {
        float t = 0;
        for (int k = 0; k < 32; k++) t += sh[k][tx];
        out[d] = t;
    }
}
static int mt__rms_fwd(mt_cuda *c, void *h, void *y, float *rstd, const void *a, const void *b, const float *w, int N, int D, float eps) {
    if (N <= 0) return 0;
    bool v = mt__rows16(D, 2, h, y, a, b, w);
#define MT__RMS_C(V, ADD, C) k_rms_fwd<V, ADD, C><<<mt__blocks(N, 8), 256, 0, c->stream>>>((bf16 *)h, (bf16 *)y, rstd, (const bf16 *)a, \
                                                                                          (const bf16 *)b, w, N, D, eps)
#define MT__RMS(V, ADD) MT__RMS_WIDTH(MT__RMS_C, V, ADD)
    if (h) { if (v) MT__RMS(true, true); else MT__RMS(false, true); }
    else { if (v) MT__RMS(true, false); else MT__RMS(false, false); }
#undef MT__RMS
#undef MT__RMS_C
    LAUNCHED();
    return 0;
}
int mt_cuda_add_rmsnorm_forward(mt_cuda *c, void *h, void *y, float *rstd, const void *a, const void *b, const float *w, int N,
                                int D, float eps) {
    return mt__rms_fwd(c, h, y, rstd, a, b, w, N, D, eps);
}
/* rows per dw partial */
static int mt__rms_rows(int D) { return D <= 1024 ? MT_RMS_CHUNK_NARROW : MT_RMS_CHUNK; }
size_t mt_cuda_rmsnorm_backward_workspace(int N, int D) { return mt__al((size_t)((N + mt__rms_rows(D) - 1) / mt__rms_rows(D)) * D * 4); }
int mt_cuda_rmsnorm_forward(mt_cuda *c, void *y, float *rstd, const void *x, const float *w, int N, int D, float eps) {
    return mt__rms_fwd(c, NULL, y, rstd, x, NULL, w, N, D, eps);
}
static int mt__rms_bwd(mt_cuda *c, void *dx, float *dw, const void *dy, const void *x, const float *w, const float *rstd,
                       const void *acc, int N, int D, void *ws) {
    if (N <= 0) { CK(cudaMemsetAsync(dw, 0, (size_t)D * 4, c->stream)); return 0; }
    bool v = mt__rows16(D, 2, dx, dy, x, w, acc) && !((uintptr_t)ws & 15);
    int chunks = (N + MT_RMS_CHUNK - 1) / MT_RMS_CHUNK;
    if (D <= MT_RMS_FUSED_MAXD) {   /* one pass: dx and the chunks' dw partials */
        int rows = mt__rms_rows(D);
        chunks = (N + rows - 1) / rows;
        size_t sm = (size_t)(1 + MT_RMS_WARPS) * D * 4;
#define MT__RMS_C(V, ADD, C) k_rms_bwd_fused<V, ADD, C><<<chunks, 32 * MT_RMS_WARPS, sm, c->stream>>>((bf16 *)dx, (float *)ws, \
                                                         (const bf16 *)dy, (const bf16 *)x, w, rstd, (const bf16 *)acc, N, D, rows)
#define MT__RMS(V, ADD) MT__RMS_WIDTH(MT__RMS_C, V, ADD)
        if (acc) { if (v) MT__RMS(true, true); else MT__RMS(false, true); }
        else { if (v) MT__RMS(true, false); else MT__RMS(false, false); }
#undef MT__RMS
#undef MT__RMS_C
        LAUNCHED();
        k_colsum<<<mt__blocks(D, 32), 1024, 0, c->stream>>>(dw, (const float *)ws, chunks, D);
        LAUNCHED();
        return 0;
    }
#define MT__RMS(V, ADD) k_rms_bwd_dx<V, ADD><<<mt__blocks(N, 2), 64, 0, c->stream>>>((bf16 *)dx, (const bf16 *)dy, (const bf16 *)x, w, \
                                                                                       rstd, (const bf16 *)acc, N, D)
    if (acc) { if (v) MT__RMS(true, true); else MT__RMS(false, true); }
    else { if (v) MT__RMS(true, false); else MT__RMS(false, false); }
#undef MT__RMS
    LAUNCHED();
    dim3 g(chunks, mt__blocks((D + 7) / 8, 64));
    if (v) k_rms_bwd_dw_part<true><<<g, 64, 0, c->stream>>>((float *)ws, (const bf16 *)dy, (const bf16 *)x, rstd, N, D);
    else k_rms_bwd_dw_part<false><<<g, 64, 0, c->stream>>>((float *)ws, (const bf16 *)dy, (const bf16 *)x, rstd, N, D);
    LAUNCHED();
    k_colsum<<<mt__blocks(D, 32), 1024, 0, c->stream>>>(dw, (const float *)ws, chunks, D);
    LAUNCHED();
    return 0;
}
int mt_cuda_rmsnorm_backward_add(mt_cuda *c, void *dx, float *dw, const void *dy, const void *x, const float *w,
                                 const float *rstd, const void *acc, int N, int D, void *ws) {
    return mt__rms_bwd(c, dx, dw, dy, x, w, rstd, acc, N, D, ws);
}
int mt_cuda_rmsnorm_backward(mt_cuda *c, void *dx, float *dw, const void *dy, const void *x, const float *w,
                             const float *rstd, int N, int D, void *ws) {
    return mt__rms_bwd(c, dx, dw, dy, x, w, rstd, NULL, N, D, ws);
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
/* the same two kernels on bf16 pairs, which are exactly the rotation pairs
 * (needs even dn and dv; the element kernels above handle the rest) */
/* The rotation's arithmetic is pinned (explicit roundings, no contraction left to the compiler), so
 * that the attention kernels' folded RoPE (MLA_ATTENTION_BWD's dQ epilogue, ROPE_PE) computes the very
 * bits of these kernels wherever it is inlined. */
__device__ __forceinline__ __nv_bfloat162 rot2(__nv_bfloat162 x, float c, float s, int inverse) {
    float x0 = __low2float(x), x1 = __high2float(x);
    if (inverse) s = -s;
    return __floats2bfloat162_rn(__fmaf_rn(x0, c, -__fmul_rn(x1, s)), __fmaf_rn(x0, s, __fmul_rn(x1, c)));
}
/* one pair of a rope gradient rotated back (the rotation's transpose), in f32: k_pe's heads are summed after */
__device__ __forceinline__ float2 unrot_f(float d0, float d1, float c, float s) {
    return make_float2(__fmaf_rn(d0, c, __fmul_rn(d1, s)), __fmaf_rn(-d0, s, __fmul_rn(d1, c)));
}
__global__ void k_rope_fwd2(__nv_bfloat162 *Q, __nv_bfloat162 *K, __nv_bfloat162 *V, const __nv_bfloat162 *q, const __nv_bfloat162 *kv,
                            const __nv_bfloat162 *kpe, const float *cosv, const float *sinv, int T, int H, int dn, int dr, int dv) {
    int n = blockIdx.x, half = dr / 2, pq = (dn + dr) / 2, pn = dn / 2, pkv = (dn + dv) / 2, pv = dv / 2;
    const float *cs = cosv + (int64_t)(n % T) * half, *sn = sinv + (int64_t)(n % T) * half;
    for (int idx = threadIdx.x; idx < H * pq; idx += blockDim.x) {
        int h = idx / pq, p = idx % pq;
        int64_t o = ((int64_t)n * H + h) * pq + p;
        if (p < pn) { Q[o] = q[o]; K[o] = kv[((int64_t)n * H + h) * pkv + p]; }
        else { int i = p - pn; Q[o] = rot2(q[o], cs[i], sn[i], 0); K[o] = rot2(kpe[(int64_t)n * half + i], cs[i], sn[i], 0); }
    }
    for (int idx = threadIdx.x; idx < H * pv; idx += blockDim.x) {
        int h = idx / pv, e = idx % pv;
        V[((int64_t)n * H + h) * pv + e] = kv[((int64_t)n * H + h) * pkv + pn + e];
    }
}
__global__ void k_rope_bwd2(__nv_bfloat162 *dq, __nv_bfloat162 *dkv, __nv_bfloat162 *dkpe, const __nv_bfloat162 *dQ, const __nv_bfloat162 *dK,
                            const __nv_bfloat162 *dV, const float *cosv, const float *sinv, int T, int H, int dn, int dr, int dv) {
    int n = blockIdx.x, half = dr / 2, pq = (dn + dr) / 2, pn = dn / 2, pkv = (dn + dv) / 2, pv = dv / 2;
    const float *cs = cosv + (int64_t)(n % T) * half, *sn = sinv + (int64_t)(n % T) * half;
    for (int idx = threadIdx.x; idx < H * pq; idx += blockDim.x) {
        int h = idx / pq, p = idx % pq;
        int64_t o = ((int64_t)n * H + h) * pq + p;
        dq[o] = p < pn ? dQ[o] : rot2(dQ[o], cs[p - pn], sn[p - pn], 1);
    }
    for (int idx = threadIdx.x; idx < H * pkv; idx += blockDim.x) {
        int h = idx / pkv, p = idx % pkv;
        dkv[((int64_t)n * H + h) * pkv + p] = p < pn ? dK[((int64_t)n * H + h) * pq + p] : dV[((int64_t)n * H + h) * pv + p - pn];
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {   /* k_pe is shared: sum heads in order */
        float a0 = 0, a1 = 0;
        for (int h = 0; h < H; h++) {
            __nv_bfloat162 g = dK[((int64_t)n * H + h) * pq + pn + i];
            const float2 r = unrot_f(__low2float(g), __high2float(g), cs[i], sn[i]);
            a0 = __fadd_rn(a0, r.x);
            a1 = __fadd_rn(a1, r.y);
        }
        dkpe[(int64_t)n * half + i] = __floats2bfloat162_rn(a0, a1);
    }
}
/* the same two kernels on 16-byte chunks of 8 elements (4 rotation pairs), for dn, dr and dv multiples of 8 and
 * 16-byte aligned tensors and tables; every element is computed as in the pair kernels (bitwise the same) */
}  /* extern "C": the chunk kernels use the row helpers (templates) */
__device__ __forceinline__ uint4 rot8(uint4 x, float4 c, float4 s, int inverse) {
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&x;
    uint4 o;
    __nv_bfloat162 *r = (__nv_bfloat162 *)&o;
    r[0] = rot2(h[0], c.x, s.x, inverse); r[1] = rot2(h[1], c.y, s.y, inverse);
    r[2] = rot2(h[2], c.z, s.z, inverse); r[3] = rot2(h[3], c.w, s.w, inverse);
    return o;
}
/* Each token's outputs are a list of 16-byte items; a thread loads MT_ROPE_UNROLL items before it stores any
 * (the stores could alias the next loads as far as the compiler knows). */
#define MT_ROPE_UNROLL 4
/* items: Q chunks (H cq), K chunks (H cq), V chunks (H cv) */
__global__ void __launch_bounds__(256) k_rope_fwd8(bf16 *Q, bf16 *K, bf16 *V, const bf16 *q, const bf16 *kv, const bf16 *kpe, const float *cosv,
                                                   const float *sinv, int T, int H, int dn, int dr, int dv) {
    int n = blockIdx.x, half = dr / 2, cq = (dn + dr) / 8, cn = dn / 8, ckv = (dn + dv) / 8, cv = dv / 8;
    int nq = H * cq, total = 2 * nq + H * cv;
    const float *cs = cosv + (int64_t)(n % T) * half, *sn = sinv + (int64_t)(n % T) * half;
    const uint4 *q8 = (const uint4 *)q + (int64_t)n * H * cq, *kv8 = (const uint4 *)kv + (int64_t)n * H * ckv, *kpe8 = (const uint4 *)kpe + (int64_t)n * (dr / 8);
    uint4 *Q8 = (uint4 *)Q + (int64_t)n * H * cq, *K8 = (uint4 *)K + (int64_t)n * H * cq, *V8 = (uint4 *)V + (int64_t)n * H * cv;
    for (int b0 = threadIdx.x; b0 < total; b0 += MT_ROPE_UNROLL * blockDim.x) {
        uint4 v[MT_ROPE_UNROLL];
#pragma unroll
        for (int u = 0; u < MT_ROPE_UNROLL; u++) {
            int idx = b0 + u * blockDim.x;
            if (idx >= total) continue;
            if (idx < nq) v[u] = q8[idx];
            else if (idx < 2 * nq) {
                int j = idx - nq, h = j / cq, p = j - h * cq;
                v[u] = p < cn ? kv8[h * ckv + p] : kpe8[p - cn];
            } else {
                int j = idx - 2 * nq, h = j / cv, e = j - h * cv;
                v[u] = kv8[h * ckv + cn + e];
            }
        }
#pragma unroll
        for (int u = 0; u < MT_ROPE_UNROLL; u++) {
            int idx = b0 + u * blockDim.x;
            if (idx >= total) continue;
            if (idx < 2 * nq) {
                int j = idx < nq ? idx : idx - nq, p = j % cq;
                uint4 o = v[u];
                if (p >= cn) {
                    int i = (p - cn) * 4;
                    o = rot8(o, *(const float4 *)(cs + i), *(const float4 *)(sn + i), 0);
                }
                (idx < nq ? Q8 : K8)[j] = o;
            } else {
                V8[idx - 2 * nq] = v[u];
            }
        }
    }
}
/* items: dq chunks (H cq), dkv chunks (H ckv), and the rope chunks of dK (H dr/8), whose rotated values go to
 * shared memory [H][dr] in f32; k_pe is shared by the heads, so each of its elements then sums the heads in order */
__global__ void __launch_bounds__(256) k_rope_bwd8(bf16 *dq, bf16 *dkv, bf16 *dkpe, const bf16 *dQ, const bf16 *dK, const bf16 *dV,
                                                   const float *cosv, const float *sinv, int T, int H, int dn, int dr, int dv) {
    extern __shared__ float mt_rope_sh[];
    int n = blockIdx.x, half = dr / 2, cq = (dn + dr) / 8, cn = dn / 8, ckv = (dn + dv) / 8, cv = dv / 8, cr = dr / 8;
    int nq = H * cq, nkv = H * ckv, total = nq + nkv + H * cr;
    const float *cs = cosv + (int64_t)(n % T) * half, *sn = sinv + (int64_t)(n % T) * half;
    const uint4 *dQ8 = (const uint4 *)dQ + (int64_t)n * H * cq, *dK8 = (const uint4 *)dK + (int64_t)n * H * cq, *dV8 = (const uint4 *)dV + (int64_t)n * H * cv;
    uint4 *dq8 = (uint4 *)dq + (int64_t)n * H * cq, *dkv8 = (uint4 *)dkv + (int64_t)n * H * ckv;
    for (int b0 = threadIdx.x; b0 < total; b0 += MT_ROPE_UNROLL * blockDim.x) {
        uint4 v[MT_ROPE_UNROLL];
#pragma unroll
        for (int u = 0; u < MT_ROPE_UNROLL; u++) {
            int idx = b0 + u * blockDim.x;
            if (idx >= total) continue;
            if (idx < nq) v[u] = dQ8[idx];
            else if (idx < nq + nkv) {
                int j = idx - nq, h = j / ckv, p = j - h * ckv;
                v[u] = p < cn ? dK8[h * cq + p] : dV8[h * cv + p - cn];
            } else {
                int j = idx - nq - nkv, h = j / cr, k = j - h * cr;
                v[u] = dK8[h * cq + cn + k];
            }
        }
#pragma unroll
        for (int u = 0; u < MT_ROPE_UNROLL; u++) {
            int idx = b0 + u * blockDim.x;
            if (idx >= total) continue;
            if (idx < nq) {
                int p = idx % cq;
                uint4 o = v[u];
                if (p >= cn) {
                    int i = (p - cn) * 4;
                    o = rot8(o, *(const float4 *)(cs + i), *(const float4 *)(sn + i), 1);
                }
                dq8[idx] = o;
            } else if (idx < nq + nkv) {
                dkv8[idx - nq] = v[u];
            } else {
                int j = idx - nq - nkv, h = j / cr, k = j - h * cr, i = k * 4;
                float g[8], *o = mt_rope_sh + h * dr + k * 8;
                unpack8(g, v[u]);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 r = unrot_f(g[2 * e], g[2 * e + 1], cs[i + e], sn[i + e]);
                    o[2 * e] = r.x;
                    o[2 * e + 1] = r.y;
                }
            }
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < dr; t += blockDim.x) {
        float a = 0;
        for (int h = 0; h < H; h++) a = __fadd_rn(a, mt_rope_sh[h * dr + t]);
        dkpe[(int64_t)n * dr + t] = tobf(a);
    }
}
/* RoPE folded into attention (ROPE_PE, see the pass mt_pass_fold_rope): only the rotary parts are
 * formed, qr [N, H*dr] = the rotated rope columns of q and kr [N, dr] = rotated k_pe; the attention
 * kernels read q, kv, qr and kr in place of Q, K and V.  16-byte items: H dr/8 of qr, then dr/8 of kr,
 * each rotated as k_rope_fwd8 rotates it (bitwise the same Q and K columns). */
__global__ void __launch_bounds__(256) k_rope_pe_fwd8(bf16 *qr, bf16 *kr, const bf16 *q, const bf16 *kpe, const float *cosv,
                                                      const float *sinv, int64_t N, int T, int H, int dn, int dr) {
    const int cr = dr / 8, cq = (dn + dr) / 8, cn = dn / 8, per = (H + 1) * cr;
    const int64_t total = N * per;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total; idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t n = idx / per;
        const int j = (int)(idx - n * per), h = j / cr, k = j - h * cr, i = k * 4;
        const float *cs = cosv + (int64_t)(n % T) * (dr / 2) + i, *sn = sinv + (int64_t)(n % T) * (dr / 2) + i;
        const uint4 x = h < H ? ((const uint4 *)q)[(n * H + h) * cq + cn + k] : ((const uint4 *)kpe)[n * cr + k];
        const uint4 o = rot8(x, *(const float4 *)cs, *(const float4 *)sn, 0);
        if (h < H) ((uint4 *)qr)[(n * H + h) * cr + k] = o;
        else ((uint4 *)kr)[n * cr + k] = o;
    }
}
/* the same on bf16 pairs (dn, dr even, 4-byte aligned) */
__global__ void k_rope_pe_fwd2(__nv_bfloat162 *qr, __nv_bfloat162 *kr, const __nv_bfloat162 *q, const __nv_bfloat162 *kpe, const float *cosv,
                               const float *sinv, int64_t N, int T, int H, int dn, int dr) {
    const int half = dr / 2, pq = (dn + dr) / 2, pn = dn / 2, per = (H + 1) * half;
    const int64_t total = N * per;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total; idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t n = idx / per;
        const int j = (int)(idx - n * per), h = j / half, i = j - h * half;
        const float c = cosv[(n % T) * half + i], s = sinv[(n % T) * half + i];
        if (h < H) qr[(n * H + h) * half + i] = rot2(q[(n * H + h) * pq + pn + i], c, s, 0);
        else kr[n * half + i] = rot2(kpe[n * half + i], c, s, 0);
    }
}
/* ROPE_PE_BWD: dkpe [N, dr] = the heads' rope gradients dkr [N, H*dr] rotated back and summed in head
 * order, each head's value rounded to f32 first: as k_rope_bwd8 sums them (bitwise the same).  One
 * thread per (token, pair). */
__global__ void k_rope_pe_bwd(__nv_bfloat162 *dkpe, const __nv_bfloat162 *dkr, const float *cosv, const float *sinv, int64_t N, int T,
                              int H, int dr) {
    const int half = dr / 2;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < N * half; idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t n = idx / half;
        const int i = (int)(idx - n * half);
        const float c = cosv[(n % T) * half + i], s = sinv[(n % T) * half + i];
        float a0 = 0, a1 = 0;
        for (int h0 = 0; h0 < H; h0 += 8) {   /* eight heads' loads in flight, then their sums in head order */
            __nv_bfloat162 g[8];
#pragma unroll
            for (int k = 0; k < 8; k++) if (h0 + k < H) g[k] = dkr[(n * H + h0 + k) * half + i];
#pragma unroll
            for (int k = 0; k < 8; k++)
                if (h0 + k < H) {
                    const float2 r = unrot_f(__low2float(g[k]), __high2float(g[k]), c, s);
                    a0 = __fadd_rn(a0, r.x);
                    a1 = __fadd_rn(a1, r.y);
                }
        }
        dkpe[idx] = __floats2bfloat162_rn(a0, a1);
    }
}
extern "C" {
static int mt__pairs_ok(int dn, int dv, const void *a, const void *b, const void *c3, const void *d, const void *e, const void *f) {
    return dn % 2 == 0 && dv % 2 == 0 && !(((uintptr_t)a | (uintptr_t)b | (uintptr_t)c3 | (uintptr_t)d | (uintptr_t)e | (uintptr_t)f) & 3);
}
int mt_cuda_mla_rope_forward(mt_cuda *c, void *Q, void *K, void *V, const void *q, const void *kv, const void *kpe,
                             const float *cosv, const float *sinv, int N, int T, int H, int dn, int dr, int dv) {
    if (N <= 0) return 0;
    if (dn % 8 == 0 && dr % 8 == 0 && dv % 8 == 0 && !(((uintptr_t)Q | (uintptr_t)K | (uintptr_t)V | (uintptr_t)q | (uintptr_t)kv | (uintptr_t)kpe |
                                                       (uintptr_t)cosv | (uintptr_t)sinv) & 15)) {
        k_rope_fwd8<<<N, 256, 0, c->stream>>>((bf16 *)Q, (bf16 *)K, (bf16 *)V, (const bf16 *)q, (const bf16 *)kv, (const bf16 *)kpe, cosv, sinv,
                                              T, H, dn, dr, dv);
        LAUNCHED();
        return 0;
    }
    if (mt__pairs_ok(dn, dv, Q, K, V, q, kv, kpe)) {
        k_rope_fwd2<<<N, 256, 0, c->stream>>>((__nv_bfloat162 *)Q, (__nv_bfloat162 *)K, (__nv_bfloat162 *)V, (const __nv_bfloat162 *)q,
                                              (const __nv_bfloat162 *)kv, (const __nv_bfloat162 *)kpe, cosv, sinv, T, H, dn, dr, dv);
        LAUNCHED();
        return 0;
    }
    k_rope_fwd<<<N, 256, 0, c->stream>>>((bf16 *)Q, (bf16 *)K, (bf16 *)V, (const bf16 *)q, (const bf16 *)kv, (const bf16 *)kpe,
                                         cosv, sinv, T, H, dn, dr, dv);
    LAUNCHED();
    return 0;
}
int mt_cuda_mla_rope_backward(mt_cuda *c, void *dq, void *dkv, void *dkpe, const void *dQ, const void *dK, const void *dV,
                              const float *cosv, const float *sinv, int N, int T, int H, int dn, int dr, int dv) {
    if (N <= 0) return 0;
    if (dn % 8 == 0 && dr % 8 == 0 && dv % 8 == 0 && (size_t)H * dr * 4 <= 32768 &&
        !(((uintptr_t)dq | (uintptr_t)dkv | (uintptr_t)dkpe | (uintptr_t)dQ | (uintptr_t)dK | (uintptr_t)dV | (uintptr_t)cosv | (uintptr_t)sinv) & 15)) {
        k_rope_bwd8<<<N, 256, (size_t)H * dr * 4, c->stream>>>((bf16 *)dq, (bf16 *)dkv, (bf16 *)dkpe, (const bf16 *)dQ, (const bf16 *)dK, (const bf16 *)dV, cosv,
                                              sinv, T, H, dn, dr, dv);
        LAUNCHED();
        return 0;
    }
    if (mt__pairs_ok(dn, dv, dq, dkv, dkpe, dQ, dK, dV)) {
        k_rope_bwd2<<<N, 256, 0, c->stream>>>((__nv_bfloat162 *)dq, (__nv_bfloat162 *)dkv, (__nv_bfloat162 *)dkpe, (const __nv_bfloat162 *)dQ,
                                              (const __nv_bfloat162 *)dK, (const __nv_bfloat162 *)dV, cosv, sinv, T, H, dn, dr, dv);
        LAUNCHED();
        return 0;
    }
    k_rope_bwd<<<N, 256, 0, c->stream>>>((bf16 *)dq, (bf16 *)dkv, (bf16 *)dkpe, (const bf16 *)dQ, (const bf16 *)dK,
                                         (const bf16 *)dV, cosv, sinv, T, H, dn, dr, dv);
    LAUNCHED();
    return 0;
}
static unsigned mt__grid_for(int64_t n, int per_block) {   /* grid-stride kernels: enough blocks to fill the GPU */
    int64_t b = (n + per_block - 1) / per_block;
    return (unsigned)(b < 1 ? 1 : b > 65536 ? 65536 : b);
}
int mt_cuda_rope_pe_forward(mt_cuda *c, void *qr, void *kr, const void *q, const void *kpe, const float *cosv, const float *sinv,
                            int N, int T, int H, int dn, int dr) {
    if (N <= 0) return 0;
    if (dr % 2 || dn % 2 || (((uintptr_t)qr | (uintptr_t)kr | (uintptr_t)q | (uintptr_t)kpe) & 3))
        return mt__fail(c, "rope_pe", "needs even widths and 4-byte aligned tensors");
    if (dn % 8 == 0 && dr % 8 == 0 && !(((uintptr_t)qr | (uintptr_t)kr | (uintptr_t)q | (uintptr_t)kpe | (uintptr_t)cosv | (uintptr_t)sinv) & 15)) {
        k_rope_pe_fwd8<<<mt__grid_for((int64_t)N * (H + 1) * (dr / 8), 256), 256, 0, c->stream>>>(
            (bf16 *)qr, (bf16 *)kr, (const bf16 *)q, (const bf16 *)kpe, cosv, sinv, N, T, H, dn, dr);
    } else {
        k_rope_pe_fwd2<<<mt__grid_for((int64_t)N * (H + 1) * (dr / 2), 256), 256, 0, c->stream>>>(
            (__nv_bfloat162 *)qr, (__nv_bfloat162 *)kr, (const __nv_bfloat162 *)q, (const __nv_bfloat162 *)kpe, cosv, sinv, N, T, H, dn, dr);
    }
    LAUNCHED();
    return 0;
}
int mt_cuda_rope_pe_backward(mt_cuda *c, void *dkpe, const void *dkr, const float *cosv, const float *sinv, int N, int T, int H, int dr) {
    if (N <= 0) return 0;
    if (dr % 2 || (((uintptr_t)dkpe | (uintptr_t)dkr) & 3)) return mt__fail(c, "rope_pe backward", "needs an even width and 4-byte aligned tensors");
    k_rope_pe_bwd<<<mt__grid_for((int64_t)N * (dr / 2), 256), 256, 0, c->stream>>>((__nv_bfloat162 *)dkpe, (const __nv_bfloat162 *)dkr, cosv, sinv,
                                                                                 N, T, H, dr);
    LAUNCHED();
    return 0;
}

/* ========================================================================
 * 7. attention: causal flash attention, forward and deterministic backward
 *
 * Layouts (token-major, row-major, bf16): Q,K [N, H*dq], V,O,dO [N, H*dv],
 * lse [N, H] f32, N = B*T; causal within each sequence of T tokens. The forward stores
 * nothing T x T; the Hopper backward stores dS once (bf16 tiles of the causal half, ds_tile)
 * unless its workspace would pass MT_FA_DS_MAX_BYTES or the caller turned it off.
 *
 * Document masking (optional dstart [N] i32, see mt_cpu_doc_starts): query i sees keys
 * dstart[i]..i. dstart is non-decreasing within a sequence, so a query block's smallest
 * document start is that of its first row, and a key block's last useful query is found by
 * binary search: the forward and dQ kernels start at the key tile holding that start, the
 * dK/dV kernel stops after the last query block that can see its keys. Whole tiles outside
 * the document are never visited; partial ones are masked element by element.
 *
 * Kernels (all tensor-core mma.sync.m16n8k16 bf16 -> f32, ldmatrix / ldmatrix.trans from shared
 * memory with rows padded by 16 bytes (conflict-free), cp.async double buffering of streamed tiles):
 *   fa_fwd_kernel      one CTA per (128-query block, b*h): 8 warps x 16 query rows, online softmax
 *                      with quad shuffles, K/V tiles of 64 keys double buffered, Q fragments kept in
 *                      registers, P converted in registers to the A operand of P.V.  Only key tiles
 *                      at or below the diagonal are visited; the mask is applied only where needed.
 *   fa_bwd_dot_kernel  D[n,h] = <dO, O> (fixed-order warp reduction) into the workspace;
 *                      fa_bwd_dot16_kernel the same by 16-byte loads (dv a multiple of 8, aligned).
 *   fa_bwd_dkdv_kernel one CTA per (64-key block, b*h), 8 warps, streams the query blocks at or
 *                      after the key block, recomputes P^T / dS^T from lse (stored as bf16 tiles in
 *                      smem), accumulates dK, dV in registers, writes them once.
 *   fa_bwd_dq_kernel   one CTA per (128-query block, b*h), 8 warps x 16 rows, streams key blocks,
 *                      recomputes P, dP, dS in registers, accumulates dQ in registers, writes once.
 * Hopper kernels (wgmma, sm_90a; same work split, same masking and skipping, see their own comments):
 *   fa_fwd_wg_kernel       persistent: one CTA per SM takes (128-query block, b*h) items in turn; two
 *                          warpgroups x 64 query rows, 128-key tiles (64 at heads of 256); S = Q K^T and
 *                          O += P V on wgmma, P from registers; a third
 *                          warpgroup loads Q, K and V with TMA (mbarriers, no CTA barrier in the loop);
 *                          the two consumer warpgroups take turns issuing their wgmmas (ping-pong).
 *   fa_bwd_dkdv_split_kernel  (the runtime's dK/dV) one CTA per (64-key block, b*h): one warpgroup forms
 *                          P^T and dV, the other dP^T, dS^T (P^T passed through shared memory) and dK,
 *                          64-query tiles (Q, dO, lse / D / document starts from a TMA producer warpgroup,
 *                          a ring of stages); with DS it also writes dS^T tiles (stmatrix, then a TMA
 *                          tensor store).
 *   fa_bwd_dq_ds_kernel    (the default after DS) persistent, work items by ticket: dQ += dS K over the
 *                          stored tiles, K and dS by a TMA producer warp.
 *   fa_bwd_dq_wg_kernel    (without DS) one CTA per (128-query block, b*h), two warpgroups x 64 rows,
 *                          64-key tiles, S and dP formed again, K and V from a TMA producer warpgroup,
 *                          turns, as in the forward.
 * The launchers take them for the configurations (64,64), (128,128), (192,128) and (256,256) on the
 * 16-byte load path (at (256,256) dQ from dS, or the mma.sync dQ kernel without DS); every other case
 * takes the mma.sync kernels above.
 * Why dQ has its own kernel: fused into the dK/dV kernel, dQ's fixed-order fp32 adds through L2 cost
 * more than the recomputation (or the stored dS) they save (docs/KERNELS.md).
 * No atomics anywhere: every output element is produced by exactly one thread with a fixed
 * reduction order, so results are bitwise reproducible run to run.
 *
 * Head dims are padded (zero-filled on load) to one of the compiled configurations
 * (DQ,DV) in {(32,32), (64,64), (128,128), (192,128), (256,256)}; the first that fits is used.
 * Dims that are not multiples of 8 (or misaligned pointers) use a slower synchronous load path.
 *
 * ====================================================================== */
}  /* extern "C": the attention kernels are templates */

/* PTX helpers shared by the attention and grouped-GEMM kernels */
namespace mt_ptx {
__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
/* 4 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i; r[i] = matrix i fragment */
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
/* generic-proxy shared-memory writes (cp.async) -> visible to the async proxy (wgmma operand reads) */
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* shared-memory matrix descriptor for wgmma, 128-byte swizzle (layout type 1 in bits 62..63) */
__device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}
/* D[64 x 128] (+)= A(desc) B(desc), bf16 -> f32 (attention and the grouped GEMM) */
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
/* mbarriers and TMA tensor loads (attention and the grouped GEMM) */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* mbar_arrive by the lane that passes `lane == 0`, predicated rather than branched around (no divergent path
   between a wgmma and its wait) */
__device__ __forceinline__ void mbar_arrive_lane0(uint32_t bar, int lane) {
    asm volatile("{\n.reg .pred p;\nsetp.eq.s32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar), "r"(lane) : "memory");
}
/* named CTA barriers (id 1..15; id 0 is __syncthreads) over n threads: sync waits, arrive does not */
__device__ __forceinline__ void named_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
/* The dQ kernel's CTAs of a (blocks, b*h) grid in launch order, heaviest block first: heads in groups
   of 8, and within a group block 0 of each head, then block 1, ...  Head after head instead, the last
   heads' heaviest CTAs start in the last wave and run on alone: 0.471 against 0.434 ms (H200, B=8
   T=2048 H=16, 192/128).  A group's K, V, Q and dO stay in L2. */
__device__ __forceinline__ void heavy_first(int &blk, int &bh) {
    const int nb = (int)gridDim.x, nbh = (int)gridDim.y;
    constexpr int G = 8;
    const int L = (int)blockIdx.y * nb + (int)blockIdx.x;
    const int grp = L / (G * nb), r = L - grp * G * nb, gs = min(G, nbh - grp * G);
    blk = r / gs;
    bh = grp * G + r % gs;
}
/* Two warpgroups (0 and 1) taking turns at issuing their wgmmas (ping-pong), on named barriers 1 and
   2: begin() waits for this warpgroup's turn, end() hands the turn over.  Warpgroup 1 arrives once
   ahead in start(), so warpgroup 0 goes first; warpgroup 0 absorbs the last hand-over in finish(), so
   every sync meets exactly one arrive of the other warpgroup (both must take the same number of turns). */
struct Turns {
    int wg;
    __device__ __forceinline__ void start() const { if (wg == 1) named_bar_arrive(1, 256); }
    __device__ __forceinline__ void begin() const { named_bar_sync(1 + wg, 256); }
    __device__ __forceinline__ void end() const { named_bar_arrive(2 - wg, 256); }
    __device__ __forceinline__ void finish() const { if (wg == 0) named_bar_sync(1, 256); }
};
/* wait until the phase of parity `parity` of the barrier has completed */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}
/* TMA tensor stores from shared memory (bulk groups: commit, then wait until read or done) */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, uint32_t src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1)
                 : "memory");
}
__device__ __forceinline__ void tma_store_3d(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(map)),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
__device__ __forceinline__ void tma_store_5d(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2, int c3, int c4) {
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read1() { asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap *map, uint32_t bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

/* cuTensorMapEncodeTiled, reached through the runtime (no link against the driver library) */
typedef CUresult (*EncodeTiledFn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *, const cuuint64_t *,
                                  const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiledFn tma_encoder() {
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
        return nullptr;
    return reinterpret_cast<EncodeTiledFn>(fn);
}

/* A bf16 row-major tensor of `rank` dims (dims[0] innermost, elements; strides[i] in bytes between
   consecutive indices of dim i + 1), read in boxes of box[] elements with the 128-byte swizzle;
   elements outside the tensor read as zeros. */
static int tma_map(EncodeTiledFn enc, CUtensorMap *m, const void *base, int rank, const cuuint64_t *dims, const cuuint64_t *strides,
                   const cuuint32_t *box, CUtensorMapDataType dt = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
    const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
    return enc(m, dt, (cuuint32_t)rank, const_cast<void *>(base), dims, strides, box, ones,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS ? 0 : -1;
}
} /* namespace mt_ptx */

namespace mt_fa {
using namespace mt_ptx;

typedef __nv_bfloat16 bf16;

#define MT_FA_LOG2E 1.4426950408889634f
#define MT_FA_LN2 0.6931471805599453f

/* ------------------------------------------------------------------------------------------ */
/* PTX helpers                                                                                */
/* ------------------------------------------------------------------------------------------ */
/* (cp.async, ldmatrix and shared-address helpers: namespace mt_ptx) */
/* D = A(16x16 row) * B(16x8 col) + D, bf16 inputs, f32 accumulate */
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (low 16 bits) = lo */
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

/* ------------------------------------------------------------------------------------------ */
/* Tile loader: ROWS x DP (padded width, multiple of 8) tile into smem (row stride LDS elems). */
/* g points at (row 0, col 0) of the tile in global memory, gstride = elements between rows.   */
/* Rows >= rows_valid and columns >= cols_valid are zero filled.  vec: 16-byte cp.async path    */
/* allowed (cols_valid % 8 == 0, gstride % 8 == 0, 16-byte aligned base); otherwise synchronous */
/* element loads.  safe: any valid global address (used as the dummy source of zero-fills).    */
/* ------------------------------------------------------------------------------------------ */
template <int ROWS, int DP, int LDS, int NT>
__device__ __forceinline__ void load_tile(bf16 *s, const bf16 *g, size_t gstride, int rows_valid, int cols_valid, bool vec,
                                          const bf16 *safe, int tid) {
    constexpr int CPR = DP / 8;
    constexpr int TOTAL = ROWS * CPR;
    if (vec) {
#pragma unroll
        for (int i = 0; i < (TOTAL + NT - 1) / NT; ++i) {
            const int c = tid + i * NT;
            if ((TOTAL % NT) == 0 || c < TOTAL) {
                const int r = c / CPR, col = (c % CPR) * 8;
                const bool ok = (r < rows_valid) && (col < cols_valid);
                const bf16 *src = ok ? (g + (size_t)r * gstride + col) : safe;
                cp_async_16(smem_u32(s + r * LDS + col), src, ok ? 16 : 0);
            }
        }
    } else {
        const unsigned short *gs = reinterpret_cast<const unsigned short *>(g);
        for (int c = tid; c < TOTAL; c += NT) {
            const int r = c / CPR, col = (c % CPR) * 8;
            uint32_t w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c0 = col + 2 * e, c1 = c0 + 1;
                uint32_t lo = 0, hi = 0;
                if (r < rows_valid) {
                    if (c0 < cols_valid) lo = gs[(size_t)r * gstride + c0];
                    if (c1 < cols_valid) hi = gs[(size_t)r * gstride + c1];
                }
                w[e] = lo | (hi << 16);
            }
            *reinterpret_cast<uint4 *>(s + r * LDS + col) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

/* Store two adjacent output columns (col, col+1) of one row. */
__device__ __forceinline__ void store2(bf16 *row, int col, int ncols, bool pair, float v0, float v1) {
    if (pair) {
        if (col < ncols) *reinterpret_cast<__nv_bfloat162 *>(row + col) = __floats2bfloat162_rn(v0, v1);
    } else {
        if (col < ncols) row[col] = __float2bfloat16_rn(v0);
        if (col + 1 < ncols) row[col + 1] = __float2bfloat16_rn(v1);
    }
}

/* one row of an m64nN wgmma accumulator (this thread's columns 8j + 2c, 8j + 2c + 1 at acc[4j + 2hh],
   acc[4j + 2hh + 1]) times sc, into the bf16 row `row` of ncols columns (ok: the row exists).  wide
   (16-byte aligned rows, ncols % 8 == 0): a 4 x 4 transpose over the quad (xor shuffles) hands
   thread c the whole 8-column chunks 4q + c, stored 16 bytes at a time (4-byte stores in the
   accumulator's layout cost the forward 0.359 against 0.310 ms at B=8 T=2048 H=16, 192/128, H200);
   else store2.  Every lane of the warp calls it (the shuffles); wide is the same for all. */
/* SPLIT > 0 (folded RoPE; a multiple of 32; wide rows only: the folded tensors are 16-byte aligned):
   columns >= SPLIT go to row2 at col - SPLIT instead, and with ROT (cos, sin of the row's position: rc[i],
   rs[i] for the pair at row2's columns 2i, 2i + 1) are first rounded to bf16 and rotated back as
   k_rope_bwd8 does (MLA_ATTENTION_BWD's dQ: bitwise the unfolded dq).  Thread c's chunk 4q + c lies
   below SPLIT exactly when q < SPLIT / 32, so the routing is decided at compile time. */
template <int N, int SPLIT = 0, bool ROT = false>
__device__ __forceinline__ void store_acc_row(bf16 *row, bool ok, int ncols, bool wide, bool pair, const float (&acc)[N / 2],
                                              int hh, float sc, int c, bf16 *row2 = nullptr, const float *rc = nullptr,
                                              const float *rs = nullptr) {
    static_assert(N % 32 == 0 && SPLIT % 32 == 0 && SPLIT < N, "store_acc_row: N, SPLIT");
    if (SPLIT || wide) {
        uint32_t v[N / 8];
#pragma unroll
        for (int j = 0; j < N / 8; ++j) v[j] = pack_bf16(acc[4 * j + 2 * hh] * sc, acc[4 * j + 2 * hh + 1] * sc);
#pragma unroll
        for (int q = 0; q < N / 32; ++q) {
            uint32_t w[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = c ^ r; /* thread c sends its part of chunk 4q + i and receives thread i's of 4q + c */
                const uint32_t y = (i & 2) ? ((i & 1) ? v[4 * q + 3] : v[4 * q + 2]) : ((i & 1) ? v[4 * q + 1] : v[4 * q]);
                const uint32_t x = r ? __shfl_xor_sync(0xffffffffu, y, r) : y;
#pragma unroll
                for (int e = 0; e < 4; ++e) w[e] = i == e ? x : (r ? w[e] : 0u);
            }
            const int col = 8 * (4 * q + c);
            if (ok && col < ncols) {
                uint4 val = make_uint4(w[0], w[1], w[2], w[3]);
                if (!SPLIT || q < SPLIT / 32) {
                    *reinterpret_cast<uint4 *>(row + col) = val;
                } else {
                    const int i = (col - SPLIT) >> 1;
                    if (ROT) val = rot8(val, make_float4(rc[i], rc[i + 1], rc[i + 2], rc[i + 3]), make_float4(rs[i], rs[i + 1], rs[i + 2], rs[i + 3]), 1);
                    *reinterpret_cast<uint4 *>(row2 + (col - SPLIT)) = val;
                }
            }
        }
    } else if (ok) {
#pragma unroll
        for (int j = 0; j < N / 8; ++j) store2(row, 8 * j + 2 * c, ncols, pair, acc[4 * j + 2 * hh] * sc, acc[4 * j + 2 * hh + 1] * sc);
    }
}
/* rows of ncols bf16 at base (aligned as given) take 16-byte stores */
__device__ __forceinline__ bool rows16(const void *base, int ncols, bool pair) {
    return pair && (ncols & 7) == 0 && ((uintptr_t)base & 15) == 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Parameters                                                                                 */
/* ------------------------------------------------------------------------------------------ */
/* MLA with its RoPE folded in (MLA_ATTENTION, wgmma kernels only; fold.dn = 0: not folded): Q's tiles
   come from q [N, H*dimq] (its first fold_dn columns) and qr [N, H*(dimq - fold_dn)] (the rotated rest),
   K's from kv [N, H*(fold_dn + dimv)] (its first fold_dn columns per head) and kr [N, dimq - fold_dn]
   (one rotated row per token, shared by the heads), V's from kv's last dimv columns per head; q, k and
   v are unused.  See tma_qkv_tile. */
struct Fold {
    const bf16 *q = nullptr, *kv = nullptr, *qr = nullptr, *kr = nullptr;
    int dn = 0;
};
/* What the kernels take (FwdCore, BwdCore) and what the launchers take: the same plus the fold, which
   only the launchers read (it shapes the TMA maps; the folded kernels find the rest in their maps'
   struct).  Kept apart so that the kernels' parameter block stays as small as it was: grown by the
   fold's fields, it cost the unfolded backward 4% on an H200 (1.209 -> 1.256 ms at B=8 T=2048). */
struct FwdCore {
    const bf16 *q, *k, *v;
    bf16 *o;
    float *lse;
    const int *dstart; /* [N] document starts, or null: plain causal */
    int T, H, dimq, dimv;
    float scale_log2; /* scale * log2(e) */
    int vec_qk, vec_v, pair_o;
    int nbh = 0; /* B * H (set by the persistent wgmma forward's launcher) */
};
struct FwdParams : FwdCore {
    Fold fold;
};

struct BwdCore {
    const bf16 *q, *k, *v, *o, *dout;
    const float *lse;
    float *dsum; /* D [N*H] */
    const int *dstart; /* [N] document starts, or null: plain causal */
    bf16 *dq, *dk, *dv;
    int T, H, dimq, dimv;
    float scale, scale_log2;
    int vec_qk, vec_v, pair_qk, pair_v;
};
struct BwdParams : BwdCore {
    /* folded (fold.dn > 0): dq is q's gradient [N, H*dimq], its rope columns rotated back by (rcos,
       rsin) [T, (dimq - dn) / 2]; dk is kv's gradient [N, H*(dn + dimv)] (dK's first dn columns per
       head), dv = that + dn (dV, same rows), dk2 [N, H*(dimq - dn)] the rest of dK per head (kr's
       gradient before the heads are summed) */
    Fold fold;
    bf16 *dk2 = nullptr;
    const float *rcos = nullptr, *rsin = nullptr;
    /* the wgmma dK/dV kernel also writes dS^T (ds_tile) and dQ is formed from it (fa_bwd_dq_ds_kernel);
       null: the dQ kernel recomputes S and dP (see ds_workspace for when) */
    bf16 *ds = nullptr;
    int ntri = 0;
    int *tick = nullptr; /* with ds: the dQ kernel's two work counters (zeroed by the D kernel) */
};

/* ldmatrix per-lane offsets (see header comment of each kernel):
 *  A operand (16x16, row-major [m][k] in smem):              row = lane%16,            col = (lane/16)*8
 *  B operand, smem holds [n][k] (e.g. K for Q K^T):          row = (lane/16)*8+lane%8,  col = ((lane/8)%2)*8
 *     -> r0,r1 = (b0,b1) of n-tile 0, r2,r3 = (b0,b1) of n-tile 1
 *  B operand, smem holds [k][n] (e.g. V for P V), .trans:     row = ((lane/8)%2)*8+lane%8, col = (lane/16)*8
 *     -> r0,r1 = (b0,b1) of n-tile 0, r2,r3 = (b0,b1) of n-tile 1
 */

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                    */
/* ------------------------------------------------------------------------------------------ */
/* Key/value streaming shared by the forward and dQ kernels: start loading
 * tile j+1 into the other stage (double buffering), wait for tile j, and
 * return the stage that holds it. */
template <int BN, int DQ, int DV, int LDQ, int LDV, int NT, int ST>
__device__ __forceinline__ int prefetch_kv(bf16 *sK, bf16 *sV, const bf16 *kbase, const bf16 *vbase, size_t ldqk, size_t ldv,
                                           int T, int dimq, int dimv, bool vqk, bool vv, int j, int n_blocks, int tid) {
    const int stage = (ST == 2) ? (j & 1) : 0;
    if (ST == 2 && j + 1 < n_blocks) {
        const int n1 = (j + 1) * BN, st1 = (j + 1) & 1;
        load_tile<BN, DQ, LDQ, NT>(sK + st1 * BN * LDQ, kbase + (size_t)n1 * ldqk, ldqk, T - n1, dimq, vqk, kbase, tid);
        load_tile<BN, DV, LDV, NT>(sV + st1 * BN * LDV, vbase + (size_t)n1 * ldv, ldv, T - n1, dimv, vv, vbase, tid);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
    return stage;
}

/* Document masking: the first key tile a query block starting at row m0 can see. */
template <int BN>
__device__ __forceinline__ int first_key_tile(const int *dsb, int m0) {
    if (!dsb) return 0;
    const int lo = dsb[m0];
    return max(0, min(lo, m0)) / BN;
}

template <int DQ, int DV, int NW, int BN, int ST, bool QREG, int MT>
__global__ void __launch_bounds__(NW * 32, (NW <= 4 && MT == 1 ? 2 : 1)) fa_fwd_kernel(const FwdCore p) {
    /* NW warps, each owning MT m16 tiles (16*MT consecutive query rows); BM = 16*NW*MT rows per CTA */
    constexpr int BM = NW * 16 * MT;
    constexpr int NT = NW * 32;
    constexpr int LDQ = DQ + 8, LDV = DV + 8;
    static_assert(DQ % 16 == 0 && DV % 16 == 0 && BN % 16 == 0, "tile dims");
    static_assert(MT == 1 || !QREG, "Q register cache only with one m-tile per warp");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *sQ = reinterpret_cast<bf16 *>(smem_raw);
    bf16 *sK = sQ + BM * LDQ;
    bf16 *sV = sK + ST * BN * LDQ;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int T = p.T, H = p.H;
    /* grid: x = query block (heaviest = last block first), y = b*H + h.  All blocks of one head are
       adjacent in launch order, so the K/V of the heads in flight stay L2 resident. */
    const int bh = blockIdx.y, b = bh / H, h = bh - b * H;
    const int m_block = (int)gridDim.x - 1 - (int)blockIdx.x;
    const int m0 = m_block * BM;
    const size_t ldqk = (size_t)H * p.dimq, ldv = (size_t)H * p.dimv;
    const bf16 *qbase = p.q + (size_t)b * T * ldqk + (size_t)h * p.dimq;
    const bf16 *kbase = p.k + (size_t)b * T * ldqk + (size_t)h * p.dimq;
    const bf16 *vbase = p.v + (size_t)b * T * ldv + (size_t)h * p.dimv;
    const bool vqk = p.vec_qk != 0, vv = p.vec_v != 0;

    const int kv_end = min(T, m0 + BM);
    const int n_blocks = (kv_end + BN - 1) / BN;
    const int *dsb = p.dstart ? p.dstart + (size_t)b * T : nullptr;
    const int j0 = first_key_tile<BN>(dsb, m0); /* 0 without document masking */

    load_tile<BM, DQ, LDQ, NT>(sQ, qbase + (size_t)m0 * ldqk, ldqk, T - m0, p.dimq, vqk, qbase, tid);
    cp_async_commit();
    {
        const int st0 = (ST == 2) ? (j0 & 1) : 0, k0 = j0 * BN;
        load_tile<BN, DQ, LDQ, NT>(sK + st0 * BN * LDQ, kbase + (size_t)k0 * ldqk, ldqk, T - k0, p.dimq, vqk, kbase, tid);
        load_tile<BN, DV, LDV, NT>(sV + st0 * BN * LDV, vbase + (size_t)k0 * ldv, ldv, T - k0, p.dimv, vv, vbase, tid);
    }
    cp_async_commit();

    const int a_row = lane & 15, a_col = (lane >> 4) << 3;
    const int b_row = ((lane >> 4) << 3) + (lane & 7), b_col = ((lane >> 3) & 1) << 3;
    const int t_row = (((lane >> 3) & 1) << 3) + (lane & 7), t_col = (lane >> 4) << 3;

    const int wrow0 = warp * 16 * MT; /* first local row of this warp */
    const uint32_t sQ_warp = smem_u32(sQ + (wrow0 + a_row) * LDQ + a_col);

    uint32_t qf[QREG ? DQ / 16 : 1][4];
    if (QREG) {
        cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < (QREG ? DQ / 16 : 0); ++kk) ldsm_x4(qf[kk], sQ_warp + kk * 32);
    }

    float acc[MT][DV / 8][4];
    float mrow[MT][2], lrow[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < DV / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
        mrow[mt][0] = mrow[mt][1] = neg_inf();
        lrow[mt][0] = lrow[mt][1] = 0.f;
    }
    const int row_lo = m0 + wrow0 + g; /* m-tile mt: rows row_lo + 16*mt and row_lo + 16*mt + 8 */
    const float sl2 = p.scale_log2;
    /* the largest document start among this warp's rows: its last row's (starts grow with the row) */
    const int dmax = dsb ? dsb[min(m0 + wrow0 + 16 * MT, T) - 1] : 0;

    for (int j = j0; j < n_blocks; ++j) {
        const int stage = prefetch_kv<BN, DQ, DV, LDQ, LDV, NT, ST>(sK, sV, kbase, vbase, ldqk, ldv, T, p.dimq, p.dimv, vqk, vv, j, n_blocks, tid);

        const uint32_t cK = smem_u32(sK + stage * BN * LDQ);
        const uint32_t cV = smem_u32(sV + stage * BN * LDV);

        /* S = Q K^T  (16*MT x BN per warp) */
        float s[MT][BN / 8][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < DQ / 16; ++kk) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (QREG) {
                    a[mt][0] = qf[QREG ? kk : 0][0]; a[mt][1] = qf[QREG ? kk : 0][1];
                    a[mt][2] = qf[QREG ? kk : 0][2]; a[mt][3] = qf[QREG ? kk : 0][3];
                } else {
                    ldsm_x4(a[mt], sQ_warp + (mt * 16 * LDQ + kk * 16) * 2);
                }
            }
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                uint32_t bb[4];
                ldsm_x4(bb, cK + ((nn * 16 + b_row) * LDQ + kk * 16 + b_col) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(s[mt][2 * nn], a[mt], bb[0], bb[1]);
                    mma_bf16(s[mt][2 * nn + 1], a[mt], bb[2], bb[3]);
                }
            }
        }

        const int n0 = j * BN;
        uint32_t pa[MT][BN / 16][4]; /* P as bf16 A fragments */
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            /* scale (to log2 domain) + causal mask + document mask */
            const int rlo = row_lo + mt * 16;
            const bool need_mask = (n0 + BN - 1) > (m0 + wrow0 + mt * 16) || n0 < dmax;
            int dlo[2] = {0, 0}; /* document starts of rows rlo, rlo + 8, read only where a mask applies */
            if (need_mask && p.dstart) {
                const int *d = p.dstart + (size_t)b * T;
                dlo[0] = rlo < T ? d[rlo] : 0;
                dlo[1] = rlo + 8 < T ? d[rlo + 8] : 0;
            }
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[mt][nt][e] * sl2;
                    if (need_mask) {
                        const int key = n0 + nt * 8 + 2 * c + (e & 1);
                        const int row = rlo + ((e >> 1) << 3);
                        if (key > row || key < dlo[e >> 1]) x = neg_inf();
                    }
                    s[mt][nt][e] = x;
                }
            }
            /* online softmax */
            float mx0 = mrow[mt][0], mx1 = mrow[mt][1];
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                mx0 = fmaxf(mx0, fmaxf(s[mt][nt][0], s[mt][nt][1]));
                mx1 = fmaxf(mx1, fmaxf(s[mt][nt][2], s[mt][nt][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            /* a row may have seen no key of its document yet (mx = -inf, document masking):
               subtract 0 instead so that exp2 gives 0, not NaN; otherwise this is mx itself */
            const float mr0 = mx0 == neg_inf() ? 0.f : mx0, mr1 = mx1 == neg_inf() ? 0.f : mx1;
            const float alpha0 = fast_exp2(mrow[mt][0] - mr0), alpha1 = fast_exp2(mrow[mt][1] - mr1);
            mrow[mt][0] = mx0;
            mrow[mt][1] = mx1;
            float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                s[mt][nt][0] = fast_exp2(s[mt][nt][0] - mr0);
                s[mt][nt][1] = fast_exp2(s[mt][nt][1] - mr0);
                s[mt][nt][2] = fast_exp2(s[mt][nt][2] - mr1);
                s[mt][nt][3] = fast_exp2(s[mt][nt][3] - mr1);
                ls0 += s[mt][nt][0] + s[mt][nt][1];
                ls1 += s[mt][nt][2] + s[mt][nt][3];
            }
            lrow[mt][0] = lrow[mt][0] * alpha0 + ls0;
            lrow[mt][1] = lrow[mt][1] * alpha1 + ls1;
#pragma unroll
            for (int i = 0; i < DV / 8; ++i) {
                acc[mt][i][0] *= alpha0; acc[mt][i][1] *= alpha0;
                acc[mt][i][2] *= alpha1; acc[mt][i][3] *= alpha1;
            }
            /* C layout of n-tiles (2kk, 2kk+1) == A layout of k-tile kk */
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                pa[mt][kk][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][kk][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][kk][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][kk][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
        }

        /* O += P V */
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int dn = 0; dn < DV / 16; ++dn) {
                uint32_t bb[4];
                ldsm_x4_t(bb, cV + ((kk * 16 + t_row) * LDV + dn * 16 + t_col) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(acc[mt][2 * dn], pa[mt][kk], bb[0], bb[1]);
                    mma_bf16(acc[mt][2 * dn + 1], pa[mt][kk], bb[2], bb[3]);
                }
            }
        }
        __syncthreads(); /* everyone done with this stage before it is refilled */
        if (ST == 1 && j + 1 < n_blocks) {
            const int n1 = (j + 1) * BN;
            load_tile<BN, DQ, LDQ, NT>(sK, kbase + (size_t)n1 * ldqk, ldqk, T - n1, p.dimq, vqk, kbase, tid);
            load_tile<BN, DV, LDV, NT>(sV, vbase + (size_t)n1 * ldv, ldv, T - n1, p.dimv, vv, vbase, tid);
            cp_async_commit();
        }
    }

    /* epilogue */
    bf16 *obase = p.o + (size_t)b * T * ldv + (size_t)h * p.dimv;
    const bool pair = p.pair_o != 0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            float l = lrow[mt][hf];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = 1.f / l;
            const int row = row_lo + mt * 16 + hf * 8;
            if (row < T) {
                bf16 *orow = obase + (size_t)row * ldv;
#pragma unroll
                for (int nt = 0; nt < DV / 8; ++nt)
                    store2(orow, nt * 8 + 2 * c, p.dimv, pair, acc[mt][nt][2 * hf] * inv, acc[mt][nt][2 * hf + 1] * inv);
                if (c == 0) p.lse[((size_t)b * T + row) * H + h] = (mrow[mt][hf] + log2f(l)) * MT_FA_LN2;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Hopper (sm_90a) warpgroup MMA building blocks for the wgmma kernels below                  */
/*                                                                                            */
/* Shared-memory tiles use the canonical 128-byte-swizzled (SW128) layouts of wgmma; every    */
/* tile starts on a 1024-byte boundary.  A tile of R rows x D columns (bf16) is stored as     */
/* D/64 column blocks of R x 64:                                                              */
/*   block kb at kb*R*128 bytes, row r at r*128, 16-byte chunk cc (columns 8cc..8cc+7) at     */
/*   ((cc ^ (r & 7)) << 4)                                                                    */
/* Read as an operand whose reduction dimension runs along the columns ("K-major", e.g. Q and  */
/* K for S = Q K^T): descriptor at block kb + 32 bytes per k16 step, SBO = 1024 (8-row       */
/* groups).  Read as an operand whose reduction dimension runs along the rows ("MN-major",    */
/* transpose bit set, e.g. V for O = P V): descriptor at row 16*kk (2048 bytes per k16 step),  */
/* LBO = R*128 (the next 64 columns of N), SBO = 1024.                                        */
/* Accumulators of m64nNk16 (per warp w of the warpgroup, lane = 4g + c):                     */
/*   d[4j + 2h + b] = D[16w + g + 8h][8j + 2c + b]                                            */
/* which, for two adjacent n8 tiles (j = 2kk, 2kk+1) packed to bf16 pairs, is exactly the      */
/* register A fragment of m64nNk16 for reduction columns 16kk..16kk+15 (as in mma.sync).       */
/* ------------------------------------------------------------------------------------------ */
/* Pin registers across the asynchronous wgmma window: accumulators must not be read (and A
   fragments must not be reused) by ordinary instructions before the wait that retires them. */
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(r[i][e])::"memory");
}
/* wgmma.mma_async m64nNk16, bf16 x bf16 -> f32: D = A * B + (scale_d ? D : 0).
   _ss: A and B from shared-memory descriptors (TA/TB = 1: operand is MN-major);
   _rs: A from registers (the four 32-bit A fragment registers of this thread), B from a descriptor. */
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wgmma_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, "
        "%8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, "
        "%24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, "
        "%56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

/* the 96 accumulator registers of an m64n192 wgmma: the operand list and the constraints */
#define MT_WG_R96 "%0, %1, %2, %3, %4, %5, %6, %7, " \
    "%8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, " \
    "%72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, " \
    "%88, %89, %90, %91, %92, %93, %94, %95"
#define MT_WG_D96 "{" MT_WG_R96 "}"
#define MT_WG_OUT96(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
template <int TB>
__device__ __forceinline__ void wgmma_rs_n192(float (&d)[96], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 " MT_WG_D96 ", {%96, %97, %98, %99}, %100, p, 1, 1, %102;\n}\n"
                 : MT_WG_OUT96(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}
/* the 128 accumulator registers of an m64n256 wgmma (the forward's O at a value head of 256) */
#define MT_WG_D128 "{" MT_WG_R96 ", " \
    "%96, %97, %98, %99, %100, %101, %102, %103, " \
    "%104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, " \
    "%120, %121, %122, %123, %124, %125, %126, %127" "}"
#define MT_WG_OUT128(d) MT_WG_OUT96(d), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
template <int TB>
__device__ __forceinline__ void wgmma_rs_n256(float (&d)[128], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " MT_WG_D128 ", {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n"
                 : MT_WG_OUT128(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}
/* D[64 x 192] (+)= A(desc) B(desc) (the dQ kernel that reads dS: A MN-major, B MN-major) */
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n192(float (&d)[96], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 " MT_WG_D96 ", %96, %97, p, 1, 1, %99, %100;\n}\n"
                 : MT_WG_OUT96(d)
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
/* D[64 x 256] (+)= A(desc) B(desc) (the same at a q/k head of 256) */
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n256(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " MT_WG_D128 ", %128, %129, p, 1, 1, %131, %132;\n}\n"
                 : MT_WG_OUT128(d)
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
/* m64nNk16 by N (64, 128, 192, 256) */
template <int N, int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
    static_assert(N == 64 || N == 128 || N == 192 || N == 256, "wgmma_ss: N");
    if constexpr (N == 64) wgmma_ss_n64<TA, TB>(d, da, db, scale_d);
    else if constexpr (N == 128) wgmma_ss_n128<TA, TB>(d, da, db, scale_d);
    else if constexpr (N == 192) wgmma_ss_n192<TA, TB>(d, da, db, scale_d);
    else wgmma_ss_n256<TA, TB>(d, da, db, scale_d);
}
template <int N, int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db, int scale_d) {
    static_assert(N == 64 || N == 128 || N == 192 || N == 256, "wgmma_rs: N");
    if constexpr (N == 64) wgmma_rs_n64<TB>(d, a, db, scale_d);
    else if constexpr (N == 128) wgmma_rs_n128<TB>(d, a, db, scale_d);
    else if constexpr (N == 192) wgmma_rs_n192<TB>(d, a, db, scale_d);
    else wgmma_rs_n256<TB>(d, a, db, scale_d);
}

/* acc (64 x N) = A B^T over D columns, issued (not committed): A is warpgroup wg's 64 rows of an
   SW128 tile of RA rows, B an SW128 tile of N rows (RB per 64-column panel); both K-major. */
template <int N, int D, int RA, int RB>
__device__ __forceinline__ void wgmma_abt(float (&acc)[N / 2], uint32_t sA, uint32_t sB, int wg) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint64_t da = sw128_desc(sA + (uint32_t)((kk >> 2) * RA * 128 + wg * 64 * 128 + (kk & 3) * 32), 16, 1024);
        const uint64_t db = sw128_desc(sB + (uint32_t)((kk >> 2) * RB * 128 + (kk & 3) * 32), 16, 1024);
        wgmma_ss<N, 0, 0>(acc, da, db, kk > 0);
    }
}
/* acc (64 x N) += P B over KS k16 steps, issued (not committed): P in registers (A fragments), B an
   SW128 tile whose rows run along k (MN-major: 16 rows = 2048 bytes a step; RB rows a panel). */
template <int N, int KS, int RB>
__device__ __forceinline__ void wgmma_pb(float (&acc)[N / 2], const uint32_t (&a)[KS][4], uint32_t sB, int scale_d = 1) {
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
        wgmma_rs<N, 1>(acc, a[kk], sw128_desc(sB + (uint32_t)(kk * 2048), RB * 128, 1024), kk > 0 || scale_d);
}
/* ------------------------------------------------------------------------------------------ */
/* Forward, Hopper: fa_fwd_wg_kernel                                                          */
/*                                                                                            */
/* Heads: q/k up to 256, v 64, 128 or 256 (key tiles of 128, or 64 above 192/128: O of 64 x 256 and */
/* S of 64 x 64 a warpgroup fit the registers; 4 x 2048 x 16 heads of 256/256 on an H200: 0.248 ms, */
/* against 0.737 ms on the mma.sync kernel).                                                   */
/* Work items (128-query block, b*h), two warpgroups; warpgroup wg owns query rows             */
/* [64wg, 64wg + 64) of the block.  Shared memory (SW128 tiles): Q [128 x DQ], two stages of   */
/* K [BN x DQ] and two of V [BN x DV].  Per key tile j, each warpgroup:                        */
/*   S_j = Q K_j^T               wgmma m64nBNk16, Q and K from shared memory                   */
/*   O  += P_{j-1} V_{j-1}       wgmma m64nDVk16, P from registers (bf16 A fragments), V       */
/*                               from shared memory read MN-major (transpose bit)              */
/* Both are issued back to back; the warpgroup waits for S_j only (wait_group 1), runs the     */
/* masking, the running max and exp2 of S_j while P_{j-1} V_{j-1} still runs on the tensor     */
/* cores, then waits for it, rescales O and packs P_j.  The two warpgroups take turns issuing   */
/* their products (ping-pong on named barriers 1 and 2), so that one's softmax runs while the   */
/* other's wgmmas keep the tensor cores busy: 0.446 -> 0.367 ms on an H200 (B=8 T=2048 H=16,    */
/* 192/128); left to themselves the two fell into step and softmaxed at the same time.          */
/* Loads: a third warpgroup (the producer; one thread works) issues TMA tensor loads (4-D maps over [B][T][H][D], so   */
/* rows past T and columns past the head dim read as zeros) into two K and two V stages, each   */
/* with a "full" mbarrier (transaction bytes) and an "empty" one that the eight consumer warps  */
/* arrive on once the wgmma reading the stage has completed.  The consumers never meet at a     */
/* CTA barrier: a warpgroup waits only for the stage it reads next.  setmaxnreg moves the       */
/* producer's registers to the consumers (40 / 232 a thread).                                  */
/* Persistent: one CTA per SM takes work items in turn (head by head, heaviest query block     */
/* first, snaking over the CTAs); the K/V ring runs on from one item to the next, and Q has its own "empty" */
/* barrier, so the next item's Q and first tiles load while this one's last products and its   */
/* epilogue run.                                                                               */
/* Masking as in fa_fwd_kernel (causal + document starts), applied only to tiles that need it. */
/* ------------------------------------------------------------------------------------------ */
/* The wgmma kernels run their causal / document masks on separate code for the tiles that need them
   (BoolC below): folded into one loop under a run-time flag, the mask becomes selects executed on every
   tile (docs/KERNELS.md). */
template <bool B>
struct BoolC { static constexpr bool value = B; };
/* TMA producer side (fa_fwd_wg_kernel, fa_bwd_dq_wg_kernel): the R x D tile of head h at rows
   [row, row + R) of sequence b into SW128 panels of R rows at s, announced on barrier bar */
template <int R, int D>
__device__ __forceinline__ void tma_head_tile(uint32_t s, const CUtensorMap *map, uint32_t bar, int h, int row, int b) {
#pragma unroll
    for (int kb = 0; kb < D / 64; ++kb) tma_load_4d(s + (uint32_t)(kb * R * 128), map, bar, 64 * kb, h, row, b);
}
/* Folded RoPE (Fold, rope width 64): a Q tile's panels but the last from q, the last from qr (KIND 0);
   a K tile's from kv, the last from the shared kr through a 3-D map (dim, T, B; KIND 1); a V tile's
   from kv's columns [C0, C0 + D) (KIND 2, C0 = dn).  Compile-time, like the unfolded loads: with the
   panels' sources read at run time, the folded kernels ran 4% (dK/dV) and 10% (dQ) slower than the
   unfolded ones even on the unfolded tensors (H200, B=8 T=2048 H=16). */
template <int R, int D, bool FOLD, int KIND, int C0 = 0>
__device__ __forceinline__ void tma_qkv_tile(uint32_t s, const CUtensorMap *map, const CUtensorMap *map2, uint32_t bar, int h, int row,
                                             int b) {
    if constexpr (!FOLD) {
        tma_head_tile<R, D>(s, map, bar, h, row, b);
    } else if constexpr (KIND == 2) {
#pragma unroll
        for (int kb = 0; kb < D / 64; ++kb) tma_load_4d(s + (uint32_t)(kb * R * 128), map, bar, C0 + 64 * kb, h, row, b);
    } else {
#pragma unroll
        for (int kb = 0; kb < D / 64 - 1; ++kb) tma_load_4d(s + (uint32_t)(kb * R * 128), map, bar, 64 * kb, h, row, b);
        const uint32_t last = s + (uint32_t)((D / 64 - 1) * R * 128);
        if constexpr (KIND == 1) tma_load_3d(last, map2, bar, 0, row, b);
        else tma_load_4d(last, map2, bar, 0, h, row, b);
    }
}
/* use u of a ring of NS such tiles (stage u % NS at s0, full / empty barriers 8 bytes apart): wait for
   the stage's previous use to be released, then load */
template <int NS, int R, int D, bool FOLD, int KIND, int C0 = 0>
__device__ __forceinline__ void ring_fill(uint32_t s0, uint32_t full, uint32_t empty, const CUtensorMap *map, const CUtensorMap *map2,
                                          int u, int h, int row, int b) {
    constexpr uint32_t BYTES = R * D * 2;
    const int st = NS == 2 ? (u & 1) : u % NS;
    if (u >= NS) mbar_wait(empty + 8 * st, (NS == 2 ? ((u - 2) >> 1) : (u / NS) - 1) & 1);
    mbar_expect_tx(full + 8 * st, BYTES);
    tma_qkv_tile<R, D, FOLD, KIND, C0>(s0 + (uint32_t)st * BYTES, map, map2, full + 8 * st, h, row, b);
}

template <int DQ, int DV, int BN>
__host__ __device__ constexpr size_t fwd_wg_smem_bytes() {
    return 1024 + (size_t)(128 * DQ + 2 * BN * DQ + 2 * BN * DV) * sizeof(bf16) + 16 * 8;
}
/* the TMA maps of Q, K and V (4-D: head dim, heads, T, B; boxes of 64 columns x 1 x rows x 1) and, folded,
   the second maps of Q and K (see tma_qkv_tile) */
struct FwdMaps {
    CUtensorMap q, k, v, q2, k2;
};

template <int DQ, int DV, int BN, bool FOLD>
__global__ void __launch_bounds__(384, 1) fa_fwd_wg_kernel(const FwdCore p, const __grid_constant__ FwdMaps tm) {
    constexpr int BM = 128;
    static_assert(DQ % 64 == 0 && DQ <= 256 && (BN == 64 || BN == 128) && (DV == 64 || DV == 128 || DV == 256), "wgmma tiles");
    static_assert(fwd_wg_smem_bytes<DQ, DV, BN>() <= 227 * 1024 && DV / 2 + BN / 2 + BN / 4 <= 176, "shared memory, registers");
    constexpr uint32_t Q_BYTES = BM * DQ * 2, K_BYTES = BN * DQ * 2, V_BYTES = BN * DV * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[]; /* aligned to 1024 below */
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t sQ = raw + ((1024u - (raw & 1023u)) & 1023u);
    const uint32_t sK = sQ + Q_BYTES, sV = sK + 2 * K_BYTES, sBar = sV + 2 * V_BYTES;
    /* mbarriers: Q full; K full [2]; V full [2]; K empty [2]; V empty [2]; Q empty */
    const uint32_t barQ = sBar, barKf = sBar + 8, barVf = sBar + 24, barKe = sBar + 40, barVe = sBar + 56, barQe = sBar + 72;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0); /* warp-uniform for ptxas */
    const int g = lane >> 2, c = lane & 3;
    const int T = p.T, H = p.H, nbh = p.nbh;
    const int nqb = (T + BM - 1) / BM, items = nqb * nbh, G = (int)gridDim.x;
    const size_t ldv = (size_t)H * p.dimv;
    /* work item k of this CTA: rank r = kG + (k even ? x : G - 1 - x) (a snake over the CTAs, so
       that the rounds' unequal sizes even out) of the list ordered by head, then heaviest query block
       first: the CTAs running at one time share a few heads' K and V in L2.  (Ordered by query block
       first instead, 128 heads at a time stream their K/V from memory again in every round: B=8
       T=2048 H=16 took 0.401 ms instead of 0.37; at B=2 T=4096, 32 heads, it measured 0.316 ms.) */
    auto item = [&](int k, int &m0, int &b, int &h) {
        const int r = k * G + ((k & 1) ? G - 1 - (int)blockIdx.x : (int)blockIdx.x);
        if (r >= items) return false;
        const int bh = r / nqb;
        m0 = (nqb - 1 - r % nqb) * BM;
        b = bh / H;
        h = bh - b * H;
        return true;
    };
    auto key_tiles = [&](int m0, int b, int &j0) {
        j0 = first_key_tile<BN>(p.dstart ? p.dstart + (size_t)b * T : nullptr, m0);
        return (min(T, m0 + BM) + BN - 1) / BN;
    };

    if (tid == 0) {
        mbar_init(barQ, 1);
        mbar_init(barQe, 8);
        for (int i = 0; i < 2; ++i) {
            mbar_init(barKf + 8 * i, 1);
            mbar_init(barVf + 8 * i, 1);
            mbar_init(barKe + 8 * i, 8);
            mbar_init(barVe + 8 * i, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads(); /* the last CTA-wide barrier: the producer warp leaves below */
    if (warp >= 8) { /* producer warpgroup (its registers go to the consumers); one thread loads, item after
                        item, Q once the consumers are done with the previous one's, then K_j and V_j for
                        every key tile, two stages ahead at most (the ring runs on across items) */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (warp == 8 && lane == 0) {
            int m0, b, h, u = 0;
            for (int k = 0; item(k, m0, b, h); ++k) {
                int j0;
                const int n_blocks = key_tiles(m0, b, j0);
                if (k > 0) mbar_wait(barQe, (k - 1) & 1);
                mbar_expect_tx(barQ, Q_BYTES);
                tma_qkv_tile<BM, DQ, FOLD, 0>(sQ, &tm.q, &tm.q2, barQ, h, m0, b);
                for (int j = j0; j < n_blocks; ++j, ++u) {
                    ring_fill<2, BN, DQ, FOLD, 1>(sK, barKf, barKe, &tm.k, &tm.k2, u, h, j * BN, b);
                    ring_fill<2, BN, DV, FOLD, 2, DQ - 64>(sV, barVf, barVe, &tm.v, &tm.v, u, h, j * BN, b);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

    const float sl2 = p.scale_log2;
    float s[BN / 2];         /* S_j accumulators, then P_j in f32 */
    float o[DV / 2];         /* O accumulators */
    uint32_t pa[BN / 16][4]; /* P_{j-1} as bf16 A fragments */

    /* ping-pong: the warpgroups take turns issuing their matrix work, so that one's softmax runs
       while the other's wgmmas keep the tensor cores busy */
    const Turns turns{wg};
    turns.start();

    /* the current work item: its query block m0, sequence b, head h, key tiles [j0, n_blocks); the
       rows of this thread, r0w + 8hh for hh = 0, 1 (block-local rows 64wg + 16(warp%4) + g + 8hh),
       their document starts and the largest among the warpgroup's rows */
    int m0, b, h, j0 = 0, n_blocks = 0, r0w = 0, wg_first = 0, dlo[2] = {0, 0}, dmax = 0;
    auto setup = [&]() {
        n_blocks = key_tiles(m0, b, j0);
        r0w = m0 + 64 * wg + 16 * (warp & 3) + g;
        wg_first = m0 + 64 * wg;
        const int wg_last = min(m0 + 64 * wg + 63, T - 1);
        if (p.dstart) {
            const int *dsb = p.dstart + (size_t)b * T;
            dlo[0] = r0w < T ? dsb[r0w] : 0;
            dlo[1] = r0w + 8 < T ? dsb[r0w + 8] : 0;
            dmax = wg_first < T ? dsb[wg_last] : 0;
        }
    };
    float mrow[2], lrow[2];

    /* ring use u of K / V: stage (u & 1), fill (u >> 1) */
    /* S = Q K_u^T for this warpgroup (issued and committed, not waited for) */
    auto issue_s = [&](int u) {
        wgmma_abt<BN, DQ, BM, BN>(s, sQ, sK + (uint32_t)(u & 1) * K_BYTES, wg);
        wgmma_commit();
    };
    /* O += P V_u, or O = P V_u for the item's first tile (issued and committed; O is never zeroed by
       other instructions while a product may be in flight, which would serialize the wgmmas) */
    auto issue_pv = [&](int u, bool first) {
        wgmma_pb<DV, BN / 16, BN>(o, pa, sV + (uint32_t)(u & 1) * V_BYTES, first ? 0 : 1);
        wgmma_commit();
    };
    /* mask + scale S_j (log2 domain), new running max; exponentiate in place; returns the
       rescale factors of the old state and the row sums of the new P */
    auto softmax = [&](int j, float (&alpha)[2], float (&ls)[2]) {
        /* the maximum is taken on the unscaled scores (the scale is positive: the launcher sends
           other scales to the mma.sync kernel), the scale rides in the exponent's FMA */
        const int n0 = j * BN;
        const bool need_mask = (n0 + BN - 1 > wg_first) || (n0 < dmax);
        /* masked and unmasked tiles run separate copies of the whole softmax (folded into one loop under
           the tile's flag, the mask is if-converted and its selects run on every tile) */
        auto body = [&](auto masked) {
            (void)need_mask; /* captured as before the masks' flag went: ptxas schedules this kernel by the closure */
            float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) {
                if (decltype(masked)::value) {
                    const int hh = (i >> 1) & 1;
                    const int key = n0 + 8 * (i >> 2) + 2 * c + (i & 1);
                    if (key > r0w + 8 * hh || key < dlo[hh]) s[i] = neg_inf();
                }
                mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
                mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
            }
            /* running max in the log2 domain; a row that has seen no key of its document yet keeps
               -inf: subtract 0 instead so that exp2 gives 0, not NaN */
            float mr[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float mnew = fmaxf(mrow[hh], mx[hh] * sl2);
                mr[hh] = mnew == neg_inf() ? 0.f : mnew;
                alpha[hh] = fast_exp2(mrow[hh] - mr[hh]);
                mrow[hh] = mnew;
                ls[hh] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) {
                const int hh = (i >> 1) & 1;
                s[i] = fast_exp2(fmaf(s[i], sl2, -mr[hh]));
                ls[hh] += s[i];
            }
        };
        if (need_mask) body(BoolC<true>{});
        else body(BoolC<false>{});
    };
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            pa[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };
    /* O / l and lse (natural log) of the item at (b, h) whose rows of this thread are r0w + 8hh */
    auto epilogue = [&]() {
        bf16 *obase = p.o + (size_t)b * T * ldv + (size_t)h * p.dimv;
        const bool pair = p.pair_o != 0;
        const bool wide = rows16(p.o, p.dimv, pair);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = lrow[hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int row = r0w + 8 * hh;
            store_acc_row<DV>(obase + (size_t)row * ldv, row < T, p.dimv, wide, pair, o, hh, 1.f / l, c);
            if (row < T && c == 0) p.lse[((size_t)b * T + row) * H + h] = (mrow[hh] + log2f(l)) * MT_FA_LN2;
        }
    };

    /* consumers: use u of K / V waits for fill (u >> 1) of stage u & 1; lane 0 of each warp releases
       the stage once the warpgroup's wgmma reading it has completed, and Q once the item's last S has */
    auto wait_k = [&](int u) { mbar_wait(barKf + 8 * (u & 1), (u >> 1) & 1); };
    auto wait_v = [&](int u) { mbar_wait(barVf + 8 * (u & 1), (u >> 1) & 1); };
    auto free_k = [&](int u) { if (lane == 0) mbar_arrive(barKe + 8 * (u & 1)); };
    auto free_v = [&](int u) { if (lane == 0) mbar_arrive(barVe + 8 * (u & 1)); };
    auto free_q = [&]() { if (lane == 0) mbar_arrive(barQe); };
    auto rescale = [&](const float (&alpha)[2], const float (&ls)[2]) {
#pragma unroll
        for (int i = 0; i < DV / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
        lrow[0] = lrow[0] * alpha[0] + ls[0];
        lrow[1] = lrow[1] * alpha[1] + ls[1];
    };

    /* Item after item: the first S, then per further key tile the product of tile u issued with the
       P V of tile u - 1, then the last P V and the epilogue.  The first S and the last P V take turns
       too, so the warpgroups stay out of step from one item to the next; Q is released as soon as the
       item's last S has completed, so the next item's Q loads while this one's last softmax, P V and
       epilogue run. */
    int u = 0; /* ring use of the next K / V tile */
#pragma unroll 1
    for (int k = 0; item(k, m0, b, h); ++k) {
        setup();
        mrow[0] = mrow[1] = neg_inf();
        mbar_wait(barQ, k & 1);
        wait_k(u);
        turns.begin();
        wgmma_fence();
        issue_s(u);
        turns.end();
        wgmma_wait<0>();
        fence_regs(s);
        free_k(u);
        if (n_blocks == j0 + 1) free_q();
        {
            float alpha[2], ls[2];
            softmax(j0, alpha, ls);
            lrow[0] = ls[0];
            lrow[1] = ls[1];
        }
        pack_p();
        /* tile j's S with tile j - 1's P V (ring use u) */
#pragma unroll 1
        for (int j = j0 + 1; j < n_blocks; ++j, ++u) {
            wait_k(u + 1);
            wait_v(u);
            fence_regs(o);
            fence_regs(pa);
            turns.begin();
            wgmma_fence();
            issue_s(u + 1);
            issue_pv(u, j - 1 == j0);
            turns.end();
            wgmma_wait<1>(); /* S_j done, P_{j-1} V_{j-1} may still run */
            fence_regs(s);
            free_k(u + 1);
            if (j == n_blocks - 1) free_q();
            float alpha[2], ls[2];
            softmax(j, alpha, ls);
            wgmma_wait<0>();
            fence_regs(o);
            fence_regs(pa);
            free_v(u);
            rescale(alpha, ls);
            pack_p();
        }
        /* the last P V */
        wait_v(u);
        fence_regs(o);
        fence_regs(pa);
        turns.begin();
        wgmma_fence();
        issue_pv(u, n_blocks - 1 == j0);
        turns.end();
        wgmma_wait<0>();
        fence_regs(o);
        free_v(u);
        ++u;
        epilogue();
    }
    turns.finish();
}

/* ------------------------------------------------------------------------------------------ */
/* Backward, Hopper: fa_bwd_dkdv_split_kernel (dK/dV), fa_bwd_dq_ds_kernel and fa_bwd_dq_wg_kernel */
/*                                                                                            */
/* Same split as the mma.sync backward (no atomics: dK/dV per key block, dQ per query block,   */
/* each output element written once by one thread after a fixed-order reduction), on wgmma.    */
/* With the dS tiles (DS, see fa_bwd_dq_ds_kernel) dQ is formed from what dK/dV stored instead. */
/* lse is used in the log2 domain (lse * log2 e), so P = exp2(S * scale * log2 e - lse2).      */
/* The dK/dV kernel's query tiles (Q_i and dO_i by TMA; lse, D and document starts, strided by  */
/* H, by 4-byte cp.async: fill_aux) stream through a ring of stages, each with a "full"        */
/* mbarrier (the TMA bytes plus one cp.async.mbarrier.arrive per lane of the filling warp) and  */
/* an "empty" one the readers arrive on once their wgmmas reading the stage have completed.     */
/* ------------------------------------------------------------------------------------------ */
/* 4-byte cp.async (lse, D and document starts of a query tile), zero-filled when !ok */
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void *src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
/* 16-byte cp.async, zero-filled when !ok */
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
/* arrive on the mbarrier once this thread's earlier cp.async copies have landed (counted in its init) */
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
/* a dK/dV query tile's lse, D and document starts (64 rows each, strided by H: no TMA box) into a stage's
   aux area at a (lse [64], D [64], starts [64]) by the 32 lanes of one warp, 4-byte cp.async zero-filled
   past T, each lane arriving on the stage's full barrier once its copies have landed */
__device__ __forceinline__ void fill_aux(uint32_t a, uint32_t full, const float *lseb, const float *dsumb, const int *dsb, int q0, int T,
                                         int H, int lane) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int r = lane + 32 * rr, q = q0 + r;
        const bool ok = q < T;
        cp_async_4(a + 4 * r, lseb + (size_t)(ok ? q : 0) * H, ok);
        cp_async_4(a + 4 * (64 + r), dsumb + (size_t)(ok ? q : 0) * H, ok);
        if (dsb) cp_async_4(a + 4 * (128 + r), dsb + (ok ? q : 0), ok);
    }
    cp_async_mbar_arrive(full);
}
/* dS^T tiles (DS): the dK/dV kernel writes, for each (b, h), query tile i and key tile kt <= i (64 rows
   each), the 64 x 64 tile dS^T[key][query] (row-major bf16, 8 KB) at tile index i (i + 1) / 2 + kt of the
   (b, h)'s ntri = n (n + 1) / 2 (n = ceil(T / 64)); the dQ kernel reads them back by TMA */
__host__ __device__ __forceinline__ size_t ds_tile(int bh, int ntri, int i, int kt) {
    return ((size_t)bh * (size_t)ntri + (size_t)i * (size_t)(i + 1) / 2 + (size_t)kt) * 4096;
}
/* the TMA maps of the dK/dV kernel: K and V in boxes of 128 rows, Q and dO in boxes of 64 (second maps as
   in FwdMaps) */
struct DkdvMaps {
    CUtensorMap q, dout, k, v, q2, k2;
    CUtensorMap dsm;   /* DS 3: the dS^T tiles (as the dQ kernel's map) */
    bf16 *dk2;   /* folded: dK's rope columns (see BwdParams) */
    int fold_dn;
    bf16 *ds;    /* DS: where dS^T goes, in 64 x 64 tiles (see ds_tile) */
    int ntri;    /* DS: tiles per (b, h) */
};

/* dS^T tiles through shared memory: stmatrix writes the A fragments into an SW128 tile (fragment kk, e
   is the 8 x 8 matrix at rows 16(warp & 3) + 8(e & 1), columns 16kk + 8(e >> 1)), and one thread
   stores it with a TMA tensor store (the copy engine does the global writes). */
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]),
                 "r"(r[3])
                 : "memory");
}

/* P^T of a dK/dV tile in place (x: S^T on entry, element 4j + 2hh + bb = key kr + 8hh, query q0 + 8j + 2c
   + bb): exp2(S^T sl2 - lse2[q]); M 1 with the causal / document / sequence-end mask, 0 without */
template <int M>
__device__ __forceinline__ void split_pt(float (&x)[32], const float *sL, const int *sS, const int *dsb, int q0, int kr, int c, int T,
                                         float sl2) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float2 l2 = *reinterpret_cast<const float2 *>(sL + 8 * j + 2 * c);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int bb = e & 1, hh = e >> 1;
            float y = fast_exp2(x[4 * j + e] * sl2 - (bb ? l2.y : l2.x) * MT_FA_LOG2E);
            if (M == 1) {
                const int q = q0 + 8 * j + 2 * c + bb, key = kr + 8 * hh;
                if (key > q || q >= T || (dsb && key < sS[8 * j + 2 * c + bb])) y = 0.f;
            }
            x[4 * j + e] = y;
        }
    }
}

/* dK/dV with dK and dV on separate warpgroups (the runtime's, at every wgmma head size, and the only one at
   heads of 256, where dK and dV of 64 keys x 256 would take 256 accumulator registers a thread in one
   warpgroup).  Two warpgroups work on the same 64 keys.  One CTA per (64-key block, b*h), 384 threads;
   per query tile i (64 rows of Q and dO, streamed as above):
     warpgroup 0:  S^T = K Q_i^T (m64n64),  P^T = exp2(S^T sl2 - lse2[q]) masked  ->  shared memory
                   (f32, in fragment order), then  dV += P^T dO_i  (m64nDV, P^T from registers)
     warpgroup 1:  dP^T = V dO_i^T (m64n64),  P^T from shared memory,  dS^T = P^T (dP^T - D[q]),
                   then  dK += dS^T Q_i  (m64nDQ),  and dS^T to memory for the dQ kernel (DS 3)
   so each does two of the tile's four products, and warpgroup 1's dP^T runs while warpgroup 0 forms P.
   P^T passes through one 16 KB buffer: named barrier 5 says it is full, 6 that it has been read.  The
   third warpgroup loads: K and V once, Q_i and dO_i with lse, D and document starts into NS stages
   (warp 8, fill_aux).  Deterministic as the 192/128 kernel (each element of dK and dV summed in
   query-tile order by one thread): dK, dV and the dS tiles are bitwise those of the two-warpgroup kernel
   it replaced (fa_bwd_dkdv_wg_kernel, bench/kernel_variants.cuh): the same products in the same order.
   It is faster because each warpgroup's two products and its exponentials or dS make one chain the
   other warpgroup's chain overlaps, with 64 + 96 accumulator registers at 192/128 instead of 160 in
   each warpgroup (H200, 8 x 2048 x 16, 192/128: 0.69-0.71 ms against 0.85 for the two-warpgroup
   kernel; docs/KERNELS.md). */
template <int DQ, int DV>
__host__ __device__ constexpr int dkdv_split_stages() {
    return 1024 + 64 * (DQ + DV) * 2 * 4 + 16384 + 8192 + 4 * 3 * 256 + 128 <= 227 * 1024 ? 3 : 2;
}
template <int DQ, int DV>
constexpr size_t dkdv_split_smem_bytes(bool ds_stage) {
    return 1024 + (size_t)64 * (DQ + DV) * 2 * (1 + dkdv_split_stages<DQ, DV>()) + 16384 +
           (size_t)dkdv_split_stages<DQ, DV>() * 3 * 64 * 4 + 128 + (ds_stage ? 1024 + 8192 : 0);
}
/* fa_bwd_dkdv_split_kernel's epilogue: warpgroup W's accumulator (dV for 0, dK for 1) to memory */
template <int DQ, int DV, bool FOLD, int W>
__device__ __forceinline__ void dkdv_split_epilogue(const BwdCore &p, const DkdvMaps &tm, const float (&acc)[(W == 0 ? DV : DQ) / 2], int kr,
                                                    int b, int h, int c) {
    const int T = p.T, H = p.H;
    /* warpgroup 0 dV, warpgroup 1 dK * scale; acc[4j + 2hh + bb] = (key kr + 8hh, column 8j + 2c + bb) */
    const size_t ldqk = (size_t)H * p.dimq, ldv = (size_t)H * p.dimv;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int key = kr + 8 * hh;
        const size_t row = (size_t)b * T + key;
        if constexpr (FOLD) { /* dK's first dn columns and dV to kv's gradient rows, dK's rope columns to dk2 */
            const size_t tk = row * H + h, khs = (size_t)(tm.fold_dn + p.dimv), k2hs = (size_t)(p.dimq - tm.fold_dn);
            if constexpr (W == 0) store_acc_row<DV>(p.dv + tk * khs, key < T, p.dimv, true, p.pair_v != 0, acc, hh, 1.f, c);
            else store_acc_row<DQ, DQ - 64>(p.dk + tk * khs, key < T, p.dimq, true, p.pair_qk != 0, acc, hh, p.scale, c, tm.dk2 + tk * k2hs);
        } else if constexpr (W == 0)
            store_acc_row<DV>(p.dv + row * ldv + (size_t)h * p.dimv, key < T, p.dimv, rows16(p.dv, p.dimv, p.pair_v != 0), p.pair_v != 0,
                              acc, hh, 1.f, c);
        else
            store_acc_row<DQ>(p.dk + row * ldqk + (size_t)h * p.dimq, key < T, p.dimq, rows16(p.dk, p.dimq, p.pair_qk != 0),
                              p.pair_qk != 0, acc, hh, p.scale, c);
    }
}
/* fa_bwd_dkdv_split_kernel's consumer warpgroups: W 0 forms P^T and dV, W 1 dP^T, dS^T and dK (compile-time
   roles, so that each runs straight-line code around its wgmmas).  Per query tile u, in order:
     wait for the stage;  first product (S^T or dP^T);  P^T (handed over) or dS^T (P^T taken);
     accumulation (dV += P^T dO or dK += dS^T Q);  release the stage;  (W 1) store dS^T
   With PIPE (three stages or more, so the next query tile is loaded a tile ahead) each warpgroup issues
   its next tile's first product together with this tile's accumulation:
     warpgroup 0:  issue S^T_{u+1}, dV += P^T_u dO_u;  wait for S^T_{u+1};  P^T_{u+1};  wait for dV
     warpgroup 1:  issue dP^T_{u+1}, dK += dS^T_u Q_u;  wait for dP^T_{u+1};  dS^T_{u+1};  wait for dK
   so the exponentials (and dS) of tile u + 1 run while tile u's accumulation does. */
template <int DQ, int DV, int DS, bool FOLD, bool PIPE, int W>
__device__ __forceinline__ void dkdv_split_role(const BwdCore &p, const DkdvMaps &tm, const float *aux, float4 *pbuf, uint32_t sK,
                                                uint32_t sV, uint32_t sQ, uint32_t sdO, uint32_t sDs, uint32_t barKV, uint32_t barF,
                                                uint32_t barE, int n0, int i_first, int n_tiles, int bh, int b, int h,
                                                const int *dsb) {
    constexpr int BN = 64, BMQ = 64, NS = dkdv_split_stages<DQ, DV>();
    constexpr int NA = W == 0 ? DV : DQ; /* the accumulator: dV (warpgroup 0) or dK (1), 64 keys x NA */
    constexpr uint32_t Q_BYTES = BMQ * DQ * 2, O_BYTES = BMQ * DV * 2;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3, t = tid & 127;
    const int T = p.T;
    float acc[NA / 2];
#pragma unroll
    for (int i = 0; i < NA / 2; ++i) acc[i] = 0.f;
    const int kr = n0 + 16 * (warp & 3) + g; /* this thread's keys: kr + 8hh */
    const float sl2 = p.scale_log2;
    /* P^T's hand-over: named barriers 5 (full) and 6 (empty); compute-sanitizer's racecheck does not model
       bar.arrive and reports this hand-over as a race (an mbarrier build that runs clean under it:
       docs/KERNELS.md) */
    auto p_wait_empty = [&](int) { named_bar_sync(6, 256); };
    auto p_arrive_full = [&]() { named_bar_arrive(5, 256); };
    auto p_wait_full = [&](int) { named_bar_sync(5, 256); };
    auto p_arrive_empty = [&]() { named_bar_arrive(6, 256); };
    auto qst = [&](int u) { return sQ + (uint32_t)(u % NS) * Q_BYTES; };
    auto ost = [&](int u) { return sdO + (uint32_t)(u % NS) * O_BYTES; };
    /* the first product of tile u: S^T (warpgroup 0) or dP^T (1) */
    auto issue_first = [&](float (&x)[32], int u) {
        if constexpr (W == 0) wgmma_abt<64, DQ, BN, BMQ>(x, sK, qst(u), 0);
        else wgmma_abt<64, DV, BN, BMQ>(x, sV, ost(u), 0);
    };
    /* P^T of tile u from its S^T, handed over (warpgroup 0); dS^T from dP^T and the P^T handed over (1) */
    auto form = [&](float (&x)[32], int u) {
        const int q0 = (i_first + u) * BMQ;
        const float *sL = aux + (u % NS) * 3 * BMQ;
        const float *sD = sL + BMQ;
        const int *sS = reinterpret_cast<const int *>(sD + BMQ);
        if constexpr (W == 0) {
            const int dlast = dsb ? sS[min(BMQ, T - q0) - 1] : 0;
            const bool need_mask = (n0 + BN - 1 > q0) || (q0 + BMQ > T) || (dlast > n0);
            if (need_mask) split_pt<1>(x, sL, sS, dsb, q0, kr, c, T, sl2); /* separate code for masked tiles (see BoolC) */
            else split_pt<0>(x, sL, sS, dsb, q0, kr, c, T, sl2);
            if (u > 0) p_wait_empty(u); /* warpgroup 1 has read the previous tile's P^T */
#pragma unroll
            for (int j = 0; j < 8; ++j) pbuf[j * 128 + t] = make_float4(x[4 * j], x[4 * j + 1], x[4 * j + 2], x[4 * j + 3]);
            p_arrive_full();
        } else {
            p_wait_full(u); /* P^T of this tile is in */
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float4 pv = pbuf[j * 128 + t];
                const float2 d2 = *reinterpret_cast<const float2 *>(sD + 8 * j + 2 * c);
                x[4 * j] = pv.x * (x[4 * j] - d2.x);
                x[4 * j + 1] = pv.y * (x[4 * j + 1] - d2.y);
                x[4 * j + 2] = pv.z * (x[4 * j + 2] - d2.x);
                x[4 * j + 3] = pv.w * (x[4 * j + 3] - d2.y);
            }
            p_arrive_empty();
        }
    };
    auto pack = [&](uint32_t (&fa)[4][4], const float (&x)[32]) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) fa[kk][e] = pack_bf16(x[8 * kk + 2 * e], x[8 * kk + 2 * e + 1]);
    };

    mbar_wait(barKV, 0);
    float s[32];       /* element 4j + 2hh + bb: (key kr + 8hh, query q0 + 8j + 2c + bb) */
    uint32_t fa[4][4]; /* P^T or dS^T of the tile being accumulated, as A fragments */
    /* tile u's accumulation has completed: release its stage, and (warpgroup 1) store its dS^T for the dQ kernel */
    auto done = [&](int u) {
        /* every thread releases the stage after its own reads of the stage's lse / D / starts (a
           __syncwarp and lane 0 alone: racecheck reported the refill of D against those reads at
           256/256; the same speed, H200: backward 0.921-0.926 against 0.923-0.926 ms at 8 x 2048,
           192/128, 0.630-0.637 against 0.631-0.634 at 256/256) */
        mbar_arrive(barE + 8 * (u % NS));
        if constexpr (DS == 3)
            if constexpr (W == 1) {
                const bool issuer = t == 0;
                if (issuer) bulk_wait_read0(); /* the previous tile's store has read the buffer */
                named_bar_sync(4, 128);
                const int m = lane >> 3, rr = lane & 7, row = 16 * (warp & 3) + 8 * (m & 1) + rr;
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) stmatrix_x4(sDs + (uint32_t)(row * 128 + (((2 * kk + (m >> 1)) ^ rr) << 4)), fa[kk]);
                fence_proxy_async();
                named_bar_sync(4, 128);
                if (issuer) {
                    tma_store_2d(&tm.dsm, sDs, 0, (int)(ds_tile(bh, tm.ntri, i_first + u, n0 / 64) / 64));
                    bulk_commit();
                }
            }
    };
    if constexpr (!PIPE) {
#pragma unroll 1
        for (int u = 0; u < n_tiles; ++u) {
            mbar_wait(barF + 8 * (u % NS), (u / NS) & 1);
            fence_regs(acc);
            wgmma_fence();
            issue_first(s, u);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(s);
            form(s, u);
            pack(fa, s);
            wgmma_fence();
            wgmma_pb<NA, 4, BMQ>(acc, fa, W == 0 ? ost(u) : qst(u));
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(acc);
            fence_regs(fa);
            done(u);
        }
    } else {
        if (n_tiles > 0) {
            mbar_wait(barF, 0);
            wgmma_fence();
            issue_first(s, 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(s);
            form(s, 0);
            pack(fa, s);
        }
        /* every tile but the last: no branch between the wgmmas (a conditional product serializes them) */
#pragma unroll 1
        for (int u = 0; u + 1 < n_tiles; ++u) {
            mbar_wait(barF + 8 * ((u + 1) % NS), ((u + 1) / NS) & 1);
            fence_regs(acc);
            fence_regs(fa);
            fence_regs(s);
            wgmma_fence();
            issue_first(s, u + 1);
            wgmma_commit();
            wgmma_pb<NA, 4, BMQ>(acc, fa, W == 0 ? ost(u) : qst(u));
            wgmma_commit();
            wgmma_wait<1>(); /* the next tile's first product; this one's accumulation may still run */
            fence_regs(s);
            form(s, u + 1);
            wgmma_wait<0>();
            fence_regs(acc);
            fence_regs(fa);
            done(u);
            pack(fa, s);
        }
        if (n_tiles > 0) {
            fence_regs(acc);
            fence_regs(fa);
            wgmma_fence();
            wgmma_pb<NA, 4, BMQ>(acc, fa, W == 0 ? ost(n_tiles - 1) : qst(n_tiles - 1));
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(acc);
            fence_regs(fa);
            done(n_tiles - 1);
        }
    }
    if (W == 0 && n_tiles > 0) named_bar_sync(6, 256); /* warpgroup 1's last "read" */
    if constexpr (DS == 3)
        if (W == 1 && t == 0) bulk_wait0();
    dkdv_split_epilogue<DQ, DV, FOLD, W>(p, tm, acc, kr, b, h, c);
}

template <int DQ, int DV, int DS, bool FOLD, bool PIPE>
__global__ void __launch_bounds__(384, 1) fa_bwd_dkdv_split_kernel(const BwdCore p, const __grid_constant__ DkdvMaps tm) {
    constexpr int BN = 64, BMQ = 64, NS = dkdv_split_stages<DQ, DV>();
    static_assert(DQ % 64 == 0 && DV % 64 == 0 && DQ <= 256 && DV <= 256, "wgmma tiles");
    constexpr uint32_t K_BYTES = BN * DQ * 2, V_BYTES = BN * DV * 2, Q_BYTES = BMQ * DQ * 2, O_BYTES = BMQ * DV * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[]; /* aligned to 1024 below */
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
    const uint32_t sK = raw + pad, sV = sK + K_BYTES, sQ = sV + V_BYTES, sdO = sQ + NS * Q_BYTES;
    const uint32_t sP = sdO + NS * O_BYTES; /* P^T: [8][128 threads] float4 */
    const uint32_t sAux = sP + 16384;       /* per stage: lse [64], D [64], document start [64] */
    const float *aux = reinterpret_cast<const float *>(smem_raw + pad + (sAux - sK));
    float4 *pbuf = reinterpret_cast<float4 *>(smem_raw + pad + (sP - sK));
    const uint32_t sBar = sAux + NS * 3 * BMQ * 4;
    const uint32_t barKV = sBar, barF = sBar + 8, barE = sBar + 8 + 8 * NS;
    const uint32_t sDs = (sBar + 128 + 1023u) & ~1023u; /* DS 3: warpgroup 1's 8 KB tile */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int T = p.T, H = p.H;
    const int bh = blockIdx.y, b = bh / H, h = bh - b * H;
    const int n0 = (int)blockIdx.x * BN;
    const int *dsb = p.dstart ? p.dstart + (size_t)b * T : nullptr;

    /* query tiles: from the one holding the block's first key to the last query that sees a key */
    const int i_first = n0 / BMQ;
    int q_end = T;
    if (dsb) {
        const int kmax = min(n0 + BN, T) - 1;
        int lo = kmax + 1, hi = T;
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (dsb[mid] > kmax) hi = mid; else lo = mid + 1;
        }
        q_end = lo;
    }
    const int n_tiles = (q_end + BMQ - 1) / BMQ - i_first;

    if (tid == 0) {
        mbar_init(barKV, 1);
        for (int i = 0; i < NS; ++i) {
            mbar_init(barF + 8 * i, 33);
            mbar_init(barE + 8 * i, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads(); /* the last CTA-wide barrier: the producer warpgroup leaves below */
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    if (warp >= 8) { /* producer: K and V, then the query tiles through the ring */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (warp == 8) {
            const float *lseb = p.lse + (size_t)b * T * H + h, *dsumb = p.dsum + (size_t)b * T * H + h;
            if (lane == 0) {
                mbar_expect_tx(barKV, K_BYTES + V_BYTES);
                tma_qkv_tile<BN, DQ, FOLD, 1>(sK, &tm.k, &tm.k2, barKV, h, n0, b);
                tma_qkv_tile<BN, DV, FOLD, 2, DQ - 64>(sV, &tm.v, &tm.v, barKV, h, n0, b);
            }
            for (int u = 0; u < n_tiles; ++u) {
                const int st = u % NS, q0 = (i_first + u) * BMQ;
                if (u >= NS) mbar_wait(barE + 8 * st, ((u / NS) - 1) & 1);
                const uint32_t full = barF + 8 * st, a = sAux + (uint32_t)(st * 3 * BMQ) * 4;
                fill_aux(a, full, lseb, dsumb, dsb, q0, T, H, lane);
                if (lane == 0) {
                    mbar_expect_tx(full, Q_BYTES + O_BYTES);
                    tma_qkv_tile<BMQ, DQ, FOLD, 0>(sQ + (uint32_t)st * Q_BYTES, &tm.q, &tm.q2, full, h, q0, b);
                    tma_head_tile<BMQ, DV>(sdO + (uint32_t)st * O_BYTES, &tm.dout, full, h, q0, b);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

#define MT_SPLIT_ARGS p, tm, aux, pbuf, sK, sV, sQ, sdO, sDs, barKV, barF, barE, n0, i_first, n_tiles, bh, b, h, dsb
    if (wg == 0) dkdv_split_role<DQ, DV, DS, FOLD, PIPE, 0>(MT_SPLIT_ARGS);
    else dkdv_split_role<DQ, DV, DS, FOLD, PIPE, 1>(MT_SPLIT_ARGS);
#undef MT_SPLIT_ARGS
}

/* The dQ kernels' epilogue: this thread's rows r0w and r0w + 8 of dQ * scale into dqbase (rows ldqk
   apart); folded RoPE: the rope columns rotated back as q's gradient, by the tables of row r at
   rot + (r - rfirst) * half (cos) and sin_off floats further (sin). */
template <int DQ, bool FOLD>
__device__ __forceinline__ void dq_epilogue(const BwdCore &p, const float (&dq)[DQ / 2], bf16 *dqbase, size_t ldqk, int r0w, int c, int fd,
                                            const float *rot, int rfirst, int half, int sin_off) {
    const bool pq = p.pair_qk != 0, wq = rows16(p.dq, p.dimq, pq);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = r0w + 8 * hh;
        bf16 *dqrow = dqbase + (size_t)row * ldqk;
        if constexpr (!FOLD) {
            store_acc_row<DQ>(dqrow, row < p.T, p.dimq, wq, pq, dq, hh, p.scale, c);
        } else {
            const float *rc = rot + (row - rfirst) * half;
            store_acc_row<DQ, DQ - 64, true>(dqrow, row < p.T, p.dimq, wq, pq, dq, hh, p.scale, c, dqrow + fd, rc, rc + sin_off);
        }
    }
}

/* dQ: one CTA per (128-query block, b*h), two warpgroups x 64 query rows; Q and dO stay in shared */
/* memory, key tiles of 64 stream through a 3-stage K ring and a 2-stage V ring, loaded with TMA by */
/* a producer warpgroup through full/empty mbarriers as in fa_fwd_wg_kernel.  Per key tile j:      */
/*   S_j = Q K_j^T, dP_j = dO V_j^T      m64n64 each (issued first)                                */
/*   dQ += dS_{j-1} K_{j-1}              m64nDQ, dS from registers, K read MN-major (issued next)  */
/* then, while dQ += dS_{j-1} K_{j-1} runs, P_j and dS_j are formed in registers.  K_j lives two   */
/* iterations (S_j, then dS_j K_j), hence the third K stage.                                       */
template <int DQ, int DV>
constexpr size_t dq_wg_smem_bytes() {
    return 1024 + (size_t)(128 * DQ + 128 * DV + 3 * 64 * DQ + 2 * 64 * DV) * sizeof(bf16) + 16 * 8;
}
/* the TMA maps of the dQ kernel: Q and dO in boxes of 128 rows, K and V in boxes of 64 (second maps as in
   FwdMaps) */
struct DqMaps {
    CUtensorMap q, dout, k, v, q2, k2;
    const float *rcos, *rsin;   /* folded: the rotation tables (see BwdParams) */
    int fold_dn;
};

template <int DQ, int DV, bool FOLD>
__global__ void __launch_bounds__(384, 1) fa_bwd_dq_wg_kernel(const BwdCore p, const __grid_constant__ DqMaps tm) {
    constexpr int BM = 128, BN = 64;
    static_assert(DQ % 64 == 0 && DV % 64 == 0 && DQ <= 192 && DV <= 128, "wgmma tiles");
    constexpr uint32_t Q_BYTES = BM * DQ * 2, O_BYTES = BM * DV * 2, K_BYTES = BN * DQ * 2, V_BYTES = BN * DV * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[]; /* aligned to 1024 below */
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t sQ = raw + ((1024u - (raw & 1023u)) & 1023u);
    const uint32_t sdO = sQ + Q_BYTES, sK = sdO + O_BYTES, sV = sK + 3 * K_BYTES, sBar = sV + 2 * V_BYTES;
    /* mbarriers: Q+dO full; K full [3]; V full [2]; K empty [3]; V empty [2]; the rotation tables */
    const uint32_t barQ = sBar, barKf = sBar + 8, barVf = sBar + 32, barKe = sBar + 48, barVe = sBar + 72, barRot = sBar + 88;
    /* folded RoPE: cos and sin of the block's 128 rows [128][half] each, staged by an idle producer warp
       with cp.async (read straight from memory in the epilogue, their latency showed: 0.465 -> 0.497 ms on
       an H100; staged by plain loads and stores, the copy loop outlasted the CTA: 0.996 ms on an H200) */
    float *sRot = reinterpret_cast<float *>(smem_raw + (sBar + 128 - raw));

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int g = lane >> 2, c = lane & 3;
    const int T = p.T, H = p.H;
    int qb, bh;
    heavy_first(qb, bh);
    const int b = bh / H, h = bh - b * H;
    const int m0 = ((int)gridDim.x - 1 - qb) * BM; /* the last query block has the most work */
    const size_t ldqk = (size_t)H * p.dimq, ldv = (size_t)H * p.dimv;
    const size_t qoff = (size_t)b * T * ldqk + (size_t)h * p.dimq;
    const size_t voff = (size_t)b * T * ldv + (size_t)h * p.dimv;
    const bf16 *qbase = p.q + qoff, *kbase = p.k + qoff;
    const bf16 *vbase = p.v + voff, *dobase = p.dout + voff;

    const int n_blocks = (min(T, m0 + BM) + BN - 1) / BN;
    const int *dsb = p.dstart ? p.dstart + (size_t)b * T : nullptr;
    const int j0 = first_key_tile<BN>(dsb, m0);
    (void)qbase; (void)kbase; (void)vbase; (void)dobase;

    if (tid == 0) {
        mbar_init(barQ, 1);
        for (int i = 0; i < 3; ++i) {
            mbar_init(barKf + 8 * i, 1);
            mbar_init(barKe + 8 * i, 8);
        }
        for (int i = 0; i < 2; ++i) {
            mbar_init(barVf + 8 * i, 1);
            mbar_init(barVe + 8 * i, 8);
        }
        if (FOLD) mbar_init(barRot, 32);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads(); /* the last CTA-wide barrier: the producer warpgroup leaves below */
    const int fd = FOLD ? tm.fold_dn : 0, half = (p.dimq - fd) / 2;
    if (warp >= 8) { /* producer: Q and dO, then K_j (3 stages) and V_j (2 stages) for every key tile */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (FOLD && warp == 9) { /* the rotation tables of rows [m0, m0 + 128): 16-byte cp.async (rows past T
                                      zero-filled), each lane arriving once its copies have landed */
            const int per = half / 4;
            const uint32_t sRotU = sBar + 128;
            for (int i = lane; i < BM * per; i += 32) {
                const int r = m0 + i / per, k = i - (i / per) * per;
                const bool ok = r < T;
                const size_t src = (size_t)(ok ? r : 0) * half + 4 * k;
                cp_async_16(sRotU + 16 * i, tm.rcos + src, ok);
                cp_async_16(sRotU + 16 * (BM * per + i), tm.rsin + src, ok);
            }
            cp_async_mbar_arrive(barRot);
        }
        if (warp == 8 && lane == 0) {
            mbar_expect_tx(barQ, Q_BYTES + O_BYTES);
            tma_qkv_tile<BM, DQ, FOLD, 0>(sQ, &tm.q, &tm.q2, barQ, h, m0, b);
            tma_head_tile<BM, DV>(sdO, &tm.dout, barQ, h, m0, b);
            for (int j = j0; j < n_blocks; ++j) {
                const int u = j - j0;
                ring_fill<3, BN, DQ, FOLD, 1>(sK, barKf, barKe, &tm.k, &tm.k2, u, h, j * BN, b);
                ring_fill<2, BN, DV, FOLD, 2, DQ - 64>(sV, barVf, barVe, &tm.v, &tm.v, u, h, j * BN, b);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

    const int r0w = m0 + 64 * wg + 16 * (warp & 3) + g; /* this thread's rows: r0w + 8hh */
    const int wg_first = m0 + 64 * wg, wg_last = min(m0 + 64 * wg + 63, T - 1);
    int dlo[2] = {0, 0}, dmax = 0;
    float lse2[2], dd[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = r0w + 8 * hh;
        const bool ok = r < T;
        lse2[hh] = ok ? p.lse[((size_t)b * T + r) * H + h] * MT_FA_LOG2E : 0.f;
        dd[hh] = ok ? p.dsum[((size_t)b * T + r) * H + h] : 0.f;
        if (dsb) dlo[hh] = ok ? dsb[r] : 0;
    }
    if (dsb) dmax = wg_first < T ? dsb[wg_last] : 0;
    const float sl2 = p.scale_log2;

    /* stage use u = j - j0: K_j in stage u % 3 (fill u / 3), V_j in stage u & 1 (fill u >> 1); lane 0 of
       each warp releases a stage once the warpgroup's wgmma reading it has completed */
    auto kstage = [&](int j) { return sK + (uint32_t)((j - j0) % 3) * K_BYTES; };
    auto wait_kv = [&](int j) {
        const int u = j - j0;
        mbar_wait(barKf + 8 * (u % 3), (u / 3) & 1);
        mbar_wait(barVf + 8 * (u & 1), (u >> 1) & 1);
    };
    auto free_k = [&](int j) { if (lane == 0) mbar_arrive(barKe + 8 * ((j - j0) % 3)); };
    auto free_v = [&](int j) { if (lane == 0) mbar_arrive(barVe + 8 * ((j - j0) & 1)); };

    float dq[DQ / 2];
#pragma unroll
    for (int i = 0; i < DQ / 2; ++i) dq[i] = 0.f;
    uint32_t da4[4][4]; /* dS_{j-1} as A fragments (reduction over its 64 keys) */
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) da4[kk][0] = da4[kk][1] = da4[kk][2] = da4[kk][3] = 0u;

    auto issue_dq = [&](int j) {
        wgmma_pb<DQ, 4, BN>(dq, da4, kstage(j));
        wgmma_commit();
    };

    mbar_wait(barQ, 0);
    /* the warpgroups take turns issuing their products, as in the forward (named barriers 1 and 2;
       H100: 0.498 -> 0.479 ms for B=8 T=2048 H=16, 192/128) */
    const Turns turns{wg};
    turns.start();

#pragma unroll 1
    for (int j = j0; j < n_blocks; ++j) {
        wait_kv(j);
        const uint32_t kst = kstage(j), vst = sV + (uint32_t)((j - j0) & 1) * V_BYTES;
        float s[32], dp[32];
        fence_regs(dq);
        fence_regs(da4);
        turns.begin();
        wgmma_fence();
        wgmma_abt<64, DQ, BM, BN>(s, sQ, kst, wg);
        wgmma_commit();
        wgmma_abt<64, DV, BM, BN>(dp, sdO, vst, wg);
        wgmma_commit();
        /* dS_{j-1} K_{j-1}: for j == j0, da4 is zero and K_{j0 - 1}'s stage holds whatever it holds
           (finite or not, 0 x it would still poison dq with NaN), so it reads the current stage */
        issue_dq(j > j0 ? j - 1 : j);
        turns.end();

        const int n0 = j * BN;
        const bool need_mask = (n0 + BN - 1 > wg_first) || (n0 < dmax);
        wgmma_wait<2>();
        fence_regs(s);
        auto form_p = [&](auto masked) { /* separate code for masked tiles (see BoolC) */
            (void)need_mask; /* captured as before the masks' flag went: ptxas schedules this kernel by the closure */
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int hh = (i >> 1) & 1;
                float x = fast_exp2(s[i] * sl2 - lse2[hh]);
                if (decltype(masked)::value) {
                    const int key = n0 + 8 * (i >> 2) + 2 * c + (i & 1);
                    if (key > r0w + 8 * hh || key < dlo[hh]) x = 0.f;
                }
                s[i] = x;
            }
        };
        if (need_mask) form_p(BoolC<true>{});
        else form_p(BoolC<false>{});
        wgmma_wait<1>();
        fence_regs(dp);
        free_v(j);
#pragma unroll
        for (int i = 0; i < 32; ++i) dp[i] = s[i] * (dp[i] - dd[(i >> 1) & 1]);
        wgmma_wait<0>();
        fence_regs(dq);
        fence_regs(da4);
        if (j > j0) free_k(j - 1);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) da4[kk][e] = pack_bf16(dp[8 * kk + 2 * e], dp[8 * kk + 2 * e + 1]);
    }
    turns.finish();
    if (j0 < n_blocks) {
        fence_regs(dq);
        fence_regs(da4);
        wgmma_fence();
        issue_dq(n_blocks - 1);
        wgmma_wait<0>();
        fence_regs(dq);
    }

    /* epilogue: dQ * scale (folded RoPE: its rope columns rotated back, as q's gradient) */
    if (FOLD) mbar_wait(barRot, 0);
    dq_epilogue<DQ, FOLD>(p, dq, p.dq + qoff, ldqk, r0w, c, fd, sRot, m0, half, BM * half);
    /* launched early (after the dK/dV kernel, see launch_bwd): do not complete before it has, so that
       what follows on the stream sees dK and dV as well (a no-op when launched normally) */
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

/* dQ from the stored dS (the default with the dK/dV kernel's DS): dQ = scale * dS K, nothing recomputed.
   The dQ kernel above forms S and dP again (two of its three products); here the dK/dV kernel has
   written each dS^T tile (ds_tile) and this kernel only multiplies.  Work items (128-query block, b*h),
   warpgroup wg owns query tile i = m0 / 64 + wg.  Per key tile j the producer loads K_j (64 x DQ) and
   the dS^T tiles (j, i) of the warpgroups that see key tile j (from their first document's tile to i)
   into one of NS stages; each such warpgroup issues
     dQ += dS_ij K_j      m64nDQk16 x 4, A = dS^T read MN-major, B = K read MN-major
   and releases the stage once the next tile's products have been issued and this one's completed.  Key
   tiles are summed in order, so the result is bitwise the same run to run.
   Persistent: one CTA per SM takes items dq_item(t): first t = blockIdx.x, then tickets (gridDim.x + an
   atomic counter's count, handed out in order: the heaviest first, whichever CTA is free; a static
   round robin measured 0.369 against 0.222 ms for one CTA per item, its CTAs' work differing by 2.8x).
   The producer passes each ticket to the consumers through a 4-slot ring in shared memory.  The stage
   ring runs on from one item to the next, so the next item's first loads overlap this one's epilogue.
   Which CTA takes which item changes nothing in the results.
   Folded, each consumer warp stages the rotation tables of its 16 rows by cp.async when it starts an
   item (its own 4 KB of shared memory; waited for before the epilogue).
   Launched right after the dK/dV kernel with programmatic stream serialization: its setup overlaps that
   kernel's last wave; the producer waits for it (griddepcontrol.wait) before its first load.  (What
   was measured and not kept: docs/KERNELS.md.) */
/* as many stages (K_j and two dS tiles) as shared memory holds, at most 6; folded, the rotation tables
   (8 warps x 16 rows x 64 floats) take 32 KB of it */
template <int DQ, bool FOLD>
__host__ __device__ constexpr int dqds_stages() {
    return (227 * 1024 - 1024 - 256 - (FOLD ? 128 * 64 * 4 : 0)) / (64 * DQ * 2 + 2 * 8192) < 6
               ? (227 * 1024 - 1024 - 256 - (FOLD ? 128 * 64 * 4 : 0)) / (64 * DQ * 2 + 2 * 8192) : 6;
}
template <int DQ, bool FOLD>
constexpr size_t dqds_smem_bytes() {
    return 1024 + (size_t)dqds_stages<DQ, FOLD>() * (64 * DQ * 2 + 2 * 8192) + 256 + (FOLD ? 128 * 64 * 4 : 0);
}
struct DqdsMaps {
    CUtensorMap k, k2, ds;
    const float *rcos, *rsin;   /* folded: the rotation tables (see BwdParams) */
    int fold_dn, ntri, nbh;
    int *tick;   /* [0]: work items handed out past the first wave; [1]: CTAs done taking them (the last resets both) */
};
/* work item t of nb query blocks x nbh heads: heads in groups of 8 (their K and dS in L2 together), the
   last group first (the dK/dV kernel wrote its dS last: some of it is still in L2), and within a group
   the heaviest query block of each head first (as heavy_first) */
__device__ __forceinline__ void dq_item(int t, int nb, int nbh, int &m0, int &bh) {
    constexpr int G = 8;
    const int rem = nbh % G, first = rem * nb; /* the partial group (the last heads) comes first */
    int gb, gs, r;
    if (t < first) {
        gb = nbh - rem; gs = rem; r = t;
    } else {
        const int t2 = t - first, grp = t2 / (G * nb);
        r = t2 - grp * G * nb; gs = G; gb = nbh - rem - (grp + 1) * G;
    }
    m0 = (nb - 1 - r / gs) * 128;
    bh = gb + r % gs;
}
template <int DQ, bool FOLD>
__global__ void __launch_bounds__(384, 1) fa_bwd_dq_ds_kernel(const BwdCore p, const __grid_constant__ DqdsMaps tm) {
    constexpr int BM = 128, BN = 64, NS = dqds_stages<DQ, FOLD>();
    static_assert(DQ % 64 == 0 && DQ <= 256 && (!FOLD || DQ <= 192), "wgmma tiles");
    constexpr uint32_t K_BYTES = BN * DQ * 2, S_BYTES = 64 * 64 * 2, ST_BYTES = K_BYTES + 2 * S_BYTES;
    extern __shared__ __align__(16) unsigned char smem_raw[]; /* aligned to 1024 below */
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t sSt = raw + ((1024u - (raw & 1023u)) & 1023u), sBar = sSt + NS * ST_BYTES;
    /* mbarriers: full [NS]; empty [NS]; item full [R]; item empty [R]; the item ring [R] (ints); then
       (folded) each consumer warp's rotation tables */
    constexpr int R = 4;
    const uint32_t barF = sBar, barE = sBar + 8 * NS, barIF = sBar + 16 * NS, barIE = barIF + 8 * R;
    volatile int *sItem = reinterpret_cast<volatile int *>(smem_raw + (barIE + 8 * R - raw));

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int g = lane >> 2, c = lane & 3;
    const int T = p.T, H = p.H, nb = (T + BM - 1) / BM, nbh = tm.nbh, items = nb * nbh;
    struct Item {
        int m0, bh, b, h, i0, lo0, lo1, j_end; /* warpgroup w's key tiles: [lo_w, i0 + w]; j_end: one past the last */
        bool has1;                             /* warpgroup 1 has rows (before T) */
    };
    auto item_of = [&](int t) {
        Item it;
        dq_item(t, nb, nbh, it.m0, it.bh);
        it.b = it.bh / H;
        it.h = it.bh - it.b * H;
        const int *dsb = p.dstart ? p.dstart + (size_t)it.b * T : nullptr;
        it.i0 = it.m0 / 64;
        it.has1 = 64 * (it.i0 + 1) < T;
        it.lo0 = first_key_tile<BN>(dsb, it.m0);
        it.lo1 = it.has1 ? first_key_tile<BN>(dsb, 64 * (it.i0 + 1)) : 0;
        it.j_end = it.has1 ? it.i0 + 2 : it.i0 + 1;
        return it;
    };

    if (tid == 0) {
        for (int i = 0; i < NS; ++i) {
            mbar_init(barF + 8 * i, 1);
            mbar_init(barE + 8 * i, 8);
        }
        for (int i = 0; i < R; ++i) {
            mbar_init(barIF + 8 * i, 1);
            mbar_init(barIE + 8 * i, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads(); /* the last CTA-wide barrier: the producer warpgroup leaves below */
    if (warp >= 8) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (warp == 8 && lane == 0) {
            asm volatile("griddepcontrol.wait;\n" ::: "memory"); /* dS is the dK/dV kernel's (and the tickets' zeros) */
            int u = 0;
            for (int q = 0, t = (int)blockIdx.x;; ++q) {
                const int slot = q % R;
                if (q >= R) mbar_wait(barIE + 8 * slot, ((q / R) - 1) & 1);
                sItem[slot] = t;
                mbar_arrive(barIF + 8 * slot);
                if (t >= items) break;
                const Item it = item_of(t);
                for (int j = it.lo0; j < it.j_end; ++j, ++u) {
                    const int st = u % NS;
                    if (u >= NS) mbar_wait(barE + 8 * st, ((u / NS) - 1) & 1);
                    const bool in0 = j <= it.i0, in1 = it.has1 && j >= it.lo1;
                    const uint32_t s0 = sSt + (uint32_t)st * ST_BYTES, full = barF + 8 * st;
                    mbar_expect_tx(full, K_BYTES + S_BYTES * ((int)in0 + (int)in1));
                    tma_qkv_tile<BN, DQ, FOLD, 1>(s0, &tm.k, &tm.k2, full, it.h, j * BN, it.b);
                    if (in0) tma_load_2d(s0 + K_BYTES, &tm.ds, full, 0, (int)(ds_tile(it.bh, tm.ntri, it.i0, j) / 64));
                    if (in1) tma_load_2d(s0 + K_BYTES + S_BYTES, &tm.ds, full, 0, (int)(ds_tile(it.bh, tm.ntri, it.i0 + 1, j) / 64));
                }
                t = (int)gridDim.x + atomicAdd(tm.tick, 1);
            }
            __threadfence();
            if (atomicAdd(tm.tick + 1, 1) == (int)gridDim.x - 1) { /* every CTA has taken its last ticket */
                __threadfence();
                atomicExch(tm.tick, 0);
                atomicExch(tm.tick + 1, 0);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");

    const int fd = FOLD ? tm.fold_dn : 0, half = (p.dimq - fd) / 2;
    float *sRotW = reinterpret_cast<float *>(smem_raw + (sBar + 256 - raw)) + (size_t)warp * 32 * half; /* [2][16][half] */
    int u = 0;
    for (int q = 0;; ++q) {
        const int slot = q % R;
        mbar_wait(barIF + 8 * slot, (q / R) & 1);
        const int t = sItem[slot];
        __syncwarp();
        if (lane == 0) mbar_arrive(barIE + 8 * slot);
        if (t >= items) break;
        const Item it = item_of(t);
        const int r0w = it.m0 + 64 * wg + 16 * (warp & 3) + g; /* this thread's rows: r0w + 8hh */
        if constexpr (FOLD) { /* cos, sin of this warp's 16 rows (rows past T zero-filled) */
            const int per = half / 4, rbase = r0w - g;
            const uint32_t dst = smem_u32(sRotW);
            for (int k = lane; k < 16 * per; k += 32) {
                const int r = rbase + k / per, q = k - (k / per) * per;
                const bool ok = r < T;
                const size_t src = (size_t)(ok ? r : 0) * half + 4 * q;
                cp_async_16(dst + 16 * k, tm.rcos + src, ok);
                cp_async_16(dst + 16 * (16 * per + k), tm.rsin + src, ok);
            }
            cp_async_commit();
        }
        const int lo = wg ? it.lo1 : it.lo0, hi = wg ? (it.has1 ? it.i0 + 1 : -1) : it.i0;
        float dq[DQ / 2];
#pragma unroll
        for (int i = 0; i < DQ / 2; ++i) dq[i] = 0.f;
        int prev = -1; /* the stage of the last tile issued, released once the next one's products are issued */
#pragma unroll 1
        for (int j = it.lo0; j < it.j_end; ++j, ++u) {
            const int st = u % NS;
            mbar_wait(barF + 8 * st, (u / NS) & 1);
            if (j >= lo && j <= hi) {
                const uint32_t sk = sSt + (uint32_t)st * ST_BYTES, sa = sk + K_BYTES + (uint32_t)wg * S_BYTES;
                fence_regs(dq);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
                    wgmma_ss<DQ, 1, 1>(dq, sw128_desc(sa + (uint32_t)(kk * 2048), 64 * 128, 1024),
                                       sw128_desc(sk + (uint32_t)(kk * 2048), BN * 128, 1024), 1);
                wgmma_commit();
                wgmma_wait<1>();
                fence_regs(dq);
                if (prev >= 0 && lane == 0) mbar_arrive(barE + 8 * prev);
                prev = st;
            } else if (lane == 0) {
                mbar_arrive(barE + 8 * st); /* not this warpgroup's tile */
            }
        }
        wgmma_wait<0>();
        fence_regs(dq);
        if (prev >= 0 && lane == 0) mbar_arrive(barE + 8 * prev);

        /* epilogue: dQ * scale (folded RoPE: its rope columns rotated back, as q's gradient) */
        const size_t ldqk = (size_t)H * p.dimq, qoff = (size_t)it.b * T * ldqk + (size_t)it.h * p.dimq;
        if (FOLD) {
            cp_async_wait<0>();
            __syncwarp();
        }
        dq_epilogue<DQ, FOLD>(p, dq, p.dq + qoff, ldqk, r0w, c, fd, sRotW, r0w - g, half, 16 * half);
        if (FOLD) __syncwarp(); /* the tables are read before the next item's copies overwrite them */
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Backward preprocessing: D[r] = sum_d dO[r,d] * O[r,d], r = n*H + h (rows of dv contiguous) */
/* ------------------------------------------------------------------------------------------ */
__global__ void __launch_bounds__(256) fa_bwd_dot_kernel(const bf16 *__restrict__ o, const bf16 *__restrict__ dout,
                                                          float *__restrict__ D, long long rows, int dv, int *tick) {
    if (tick && blockIdx.x == 0 && threadIdx.x < 2) tick[threadIdx.x] = 0; /* the dQ kernel's tickets (fa_bwd_dq_ds_kernel) */
    const long long r = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return; /* warp-uniform */
    const bf16 *po = o + r * dv, *pd = dout + r * dv;
    float s = 0.f;
    for (int d = lane; d < dv; d += 32) s = fmaf(__bfloat162float(po[d]), __bfloat162float(pd[d]), s);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) D[r] = s;
}

/* The same with 16-byte loads (dv a multiple of 8, both tensors 16-byte aligned): LPR lanes a row (the
   power of two at least dv / 8, at most 32), each lane summing its 8-element chunks lane, lane + LPR, ...
   then a shuffle tree over the row's lanes; each thread takes RPT rows (RPT x 2 loads in flight).  A
   fixed order: bitwise the same run to run.  At 8 x 2048 x 16 heads x 128 on an H200
   (bench/attention.cu): 0.0384 ms (3.5 TB/s) against 0.0465 ms for the one-lane-per-element kernel
   above (still used for other dv or alignments). */
template <int LPR>
__global__ void __launch_bounds__(256) fa_bwd_dot16_kernel(const uint4 *__restrict__ o, const uint4 *__restrict__ dout,
                                                            float *__restrict__ D, long long rows, int ch, int *tick) {
    constexpr int RPW = 32 / LPR, RPT = 2; /* rows a warp (at once), rows a thread */
    if (tick && blockIdx.x == 0 && threadIdx.x < 2) tick[threadIdx.x] = 0; /* the dQ kernel's tickets (fa_bwd_dq_ds_kernel) */
    const int lane = threadIdx.x & 31, sub = lane % LPR;
    const long long r0 = ((long long)blockIdx.x * 8 + (threadIdx.x >> 5)) * (RPW * RPT) + lane / LPR;
    float s[RPT];
#pragma unroll
    for (int k = 0; k < RPT; ++k) {
        s[k] = 0.f;
        const long long r = r0 + (long long)k * RPW;
        if (r >= rows) continue;
        for (int cc = sub; cc < ch; cc += LPR) {
            const uint4 a = __ldg(o + r * ch + cc), b = __ldg(dout + r * ch + cc);
            const __nv_bfloat162 *pa = reinterpret_cast<const __nv_bfloat162 *>(&a), *pb = reinterpret_cast<const __nv_bfloat162 *>(&b);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 fa = __bfloat1622float2(pa[e]), fb = __bfloat1622float2(pb[e]);
                s[k] = fmaf(fa.x, fb.x, s[k]);
                s[k] = fmaf(fa.y, fb.y, s[k]);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < RPT; ++k) {
#pragma unroll
        for (int off = LPR / 2; off > 0; off >>= 1) s[k] += __shfl_xor_sync(0xffffffffu, s[k], off);
        const long long r = r0 + (long long)k * RPW;
        if (sub == 0 && r < rows) D[r] = s[k];
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Backward dQ: one CTA per (b*h, BM-query block), NW warps x 16 rows, streams key blocks.     */
/* ------------------------------------------------------------------------------------------ */
template <int DQ, int DV, int NW, int BN, int ST>
__global__ void __launch_bounds__(NW * 32, 1) fa_bwd_dq_kernel(const BwdCore p) {
    constexpr int BM = NW * 16;
    constexpr int NT = NW * 32;
    constexpr int LDQ = DQ + 8, LDV = DV + 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *sQ = reinterpret_cast<bf16 *>(smem_raw);
    bf16 *sdO = sQ + BM * LDQ;
    bf16 *sK = sdO + BM * LDV;
    bf16 *sV = sK + ST * BN * LDQ;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int T = p.T, H = p.H;
    const int bh = blockIdx.y, b = bh / H, h = bh - b * H;
    const int m_block = (int)gridDim.x - 1 - (int)blockIdx.x; /* heaviest first */
    const int m0 = m_block * BM;
    const size_t ldqk = (size_t)H * p.dimq, ldv = (size_t)H * p.dimv;
    const size_t qoff = (size_t)b * T * ldqk + (size_t)h * p.dimq;
    const size_t voff = (size_t)b * T * ldv + (size_t)h * p.dimv;
    const bf16 *qbase = p.q + qoff, *kbase = p.k + qoff;
    const bf16 *vbase = p.v + voff, *dobase = p.dout + voff;
    const bool vqk = p.vec_qk != 0, vv = p.vec_v != 0;

    const int kv_end = min(T, m0 + BM);
    const int n_blocks = (kv_end + BN - 1) / BN;
    const int *dsb = p.dstart ? p.dstart + (size_t)b * T : nullptr;
    const int j0 = first_key_tile<BN>(dsb, m0); /* 0 without document masking */

    load_tile<BM, DQ, LDQ, NT>(sQ, qbase + (size_t)m0 * ldqk, ldqk, T - m0, p.dimq, vqk, qbase, tid);
    load_tile<BM, DV, LDV, NT>(sdO, dobase + (size_t)m0 * ldv, ldv, T - m0, p.dimv, vv, dobase, tid);
    {
        const int st0 = (ST == 2) ? (j0 & 1) : 0, k0 = j0 * BN;
        load_tile<BN, DQ, LDQ, NT>(sK + st0 * BN * LDQ, kbase + (size_t)k0 * ldqk, ldqk, T - k0, p.dimq, vqk, kbase, tid);
        load_tile<BN, DV, LDV, NT>(sV + st0 * BN * LDV, vbase + (size_t)k0 * ldv, ldv, T - k0, p.dimv, vv, vbase, tid);
    }
    cp_async_commit();

    const int a_row = lane & 15, a_col = (lane >> 4) << 3;
    const int b_row = ((lane >> 4) << 3) + (lane & 7), b_col = ((lane >> 3) & 1) << 3;
    const int t_row = (((lane >> 3) & 1) << 3) + (lane & 7), t_col = (lane >> 4) << 3;
    const uint32_t sQ_warp = smem_u32(sQ + (warp * 16 + a_row) * LDQ + a_col);
    const uint32_t sdO_warp = smem_u32(sdO + (warp * 16 + a_row) * LDV + a_col);

    const int row_lo = m0 + warp * 16 + g;
    float lse2[2], Dr[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int row = row_lo + hf * 8;
        const size_t idx = ((size_t)b * T + row) * H + h;
        lse2[hf] = row < T ? p.lse[idx] * MT_FA_LOG2E : 0.f;
        Dr[hf] = row < T ? p.dsum[idx] : 0.f;
    }
    /* the largest document start among this warp's rows: its last row's (starts grow with the row) */
    const int dmax = dsb ? dsb[min(m0 + warp * 16 + 16, T) - 1] : 0;

    float acc[DQ / 8][4];
#pragma unroll
    for (int i = 0; i < DQ / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    const float sl2 = p.scale_log2;

    for (int j = j0; j < n_blocks; ++j) {
        const int stage = prefetch_kv<BN, DQ, DV, LDQ, LDV, NT, ST>(sK, sV, kbase, vbase, ldqk, ldv, T, p.dimq, p.dimv, vqk, vv, j, n_blocks, tid);
        const uint32_t cK = smem_u32(sK + stage * BN * LDQ);
        const uint32_t cV = smem_u32(sV + stage * BN * LDV);

        float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
            s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
            dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
        }
        /* S = Q K^T */
#pragma unroll
        for (int kk = 0; kk < DQ / 16; ++kk) {
            uint32_t a[4];
            ldsm_x4(a, sQ_warp + kk * 32);
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                uint32_t bb[4];
                ldsm_x4(bb, cK + ((nn * 16 + b_row) * LDQ + kk * 16 + b_col) * 2);
                mma_bf16(s[2 * nn], a, bb[0], bb[1]);
                mma_bf16(s[2 * nn + 1], a, bb[2], bb[3]);
            }
        }
        /* dP = dO V^T */
#pragma unroll
        for (int kk = 0; kk < DV / 16; ++kk) {
            uint32_t a[4];
            ldsm_x4(a, sdO_warp + kk * 32);
#pragma unroll
            for (int nn = 0; nn < BN / 16; ++nn) {
                uint32_t bb[4];
                ldsm_x4(bb, cV + ((nn * 16 + b_row) * LDV + kk * 16 + b_col) * 2);
                mma_bf16(dp[2 * nn], a, bb[0], bb[1]);
                mma_bf16(dp[2 * nn + 1], a, bb[2], bb[3]);
            }
        }
        /* dS = P * (dP - D), P = exp(scale*s - lse) */
        const int n0 = j * BN;
        const bool need_mask = (n0 + BN - 1) > (m0 + warp * 16) || n0 < dmax;
        int dlo[2] = {0, 0}; /* document starts of rows row_lo, row_lo + 8, read only where a mask applies */
        if (need_mask && p.dstart) {
            const int *d = p.dstart + (size_t)b * T;
            dlo[0] = row_lo < T ? d[row_lo] : 0;
            dlo[1] = row_lo + 8 < T ? d[row_lo + 8] : 0;
        }
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int hf = e >> 1;
                float pv = fast_exp2(fmaf(s[nt][e], sl2, -lse2[hf]));
                if (need_mask) {
                    const int key = n0 + nt * 8 + 2 * c + (e & 1);
                    if (key > row_lo + hf * 8 || key < dlo[hf]) pv = 0.f;
                }
                s[nt][e] = pv * (dp[nt][e] - Dr[hf]);
            }
        }
        /* dQ += dS K */
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t a[4];
            a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dn = 0; dn < DQ / 16; ++dn) {
                uint32_t bb[4];
                ldsm_x4_t(bb, cK + ((kk * 16 + t_row) * LDQ + dn * 16 + t_col) * 2);
                mma_bf16(acc[2 * dn], a, bb[0], bb[1]);
                mma_bf16(acc[2 * dn + 1], a, bb[2], bb[3]);
            }
        }
        __syncthreads();
        if (ST == 1 && j + 1 < n_blocks) {
            const int n1 = (j + 1) * BN;
            load_tile<BN, DQ, LDQ, NT>(sK, kbase + (size_t)n1 * ldqk, ldqk, T - n1, p.dimq, vqk, kbase, tid);
            load_tile<BN, DV, LDV, NT>(sV, vbase + (size_t)n1 * ldv, ldv, T - n1, p.dimv, vv, vbase, tid);
            cp_async_commit();
        }
    }

    bf16 *dqbase = p.dq + qoff;
    const bool pair = p.pair_qk != 0;
    const float sc = p.scale;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int row = row_lo + hf * 8;
        if (row < T) {
            bf16 *drow = dqbase + (size_t)row * ldqk;
#pragma unroll
            for (int nt = 0; nt < DQ / 8; ++nt)
                store2(drow, nt * 8 + 2 * c, p.dimq, pair, acc[nt][2 * hf] * sc, acc[nt][2 * hf + 1] * sc);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Backward dK, dV: one CTA (8 warps) per (b*h, 64-key block); streams query blocks of BMQ.    */
/*  phase 1: warp (kw = warp%4, wh = warp/4) computes S^T = K Q^T, dP^T = V dO^T for keys      */
/*           kw*16..+16 and queries wh*BMQ/2..+BMQ/2 (in chunks of QC), writes P^T and dS^T    */
/*           (bf16) to smem.  KVREG: the warp's K/V A-fragments stay in registers.             */
/*  phase 2: warp (kg = warp%KG, dsp = warp/KG) accumulates, for keys kg*16*MT..+16*MT and the  */
/*           dsp-th 1/DS slice of the head dims, dV += P^T dO and dK += dS^T Q.               */
/* ------------------------------------------------------------------------------------------ */
template <int DQ, int DV, int BMQ, int ST, int MINB, int QC, bool KVREG, int MT>
__global__ void __launch_bounds__(256, MINB) fa_bwd_dkdv_kernel(const BwdCore p) {
    constexpr int NT = 256, BNK = 64;
    constexpr int LDQ = DQ + 8, LDV = DV + 8, LDP = BMQ + 8;
    constexpr int QW = BMQ / 2; /* queries per warp in phase 1 */
    /* phase 2 warp grid: KG key groups of MT m16-tiles each, DS dim splits */
    constexpr int KG = 4 / MT, DS = 8 / KG, DQS = DQ / DS, DVS = DV / DS;
    static_assert(QW % QC == 0 && QC % 16 == 0, "query tiling");
    static_assert((MT == 1 || MT == 2) && DQS % 16 == 0 && DVS % 16 == 0, "phase-2 dim split");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16 *sK = reinterpret_cast<bf16 *>(smem_raw);
    bf16 *sV = sK + BNK * LDQ;
    bf16 *sQ = sV + BNK * LDV;        /* ST x [BMQ][LDQ] */
    bf16 *sdO = sQ + ST * BMQ * LDQ;  /* ST x [BMQ][LDV] */
    bf16 *sP = sdO + ST * BMQ * LDV;  /* [64][LDP]  P^T */
    bf16 *sdS = sP + BNK * LDP;       /* [64][LDP]  dS^T */
    float *sL = reinterpret_cast<float *>(sdS + BNK * LDP); /* ST x [BMQ]  lse * log2e */
    float *sD = sL + ST * BMQ;                               /* ST x [BMQ]  D */
    int *sS = reinterpret_cast<int *>(sD + ST * BMQ);         /* ST x [BMQ]  document starts (T past the end) */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, c = lane & 3;
    const int kw = warp & 3, wh = warp >> 2;
    const int T = p.T, H = p.H;
    const int bh = blockIdx.y, b = bh / H, h = bh - b * H;
    const int n0 = (int)blockIdx.x * BNK; /* key block 0 (most work) first */
    const size_t ldqk = (size_t)H * p.dimq, ldv = (size_t)H * p.dimv;
    const size_t qoff = (size_t)b * T * ldqk + (size_t)h * p.dimq;
    const size_t voff = (size_t)b * T * ldv + (size_t)h * p.dimv;
    const bf16 *qbase = p.q + qoff, *kbase = p.k + qoff;
    const bf16 *vbase = p.v + voff, *dobase = p.dout + voff;
    const float *lsebase = p.lse + (size_t)b * T * H + h;
    const float *dsbase = p.dsum + (size_t)b * T * H + h;
    const bool vqk = p.vec_qk != 0, vv = p.vec_v != 0;

    const int m_first = n0 / BMQ;
    int m_count = (T + BMQ - 1) / BMQ;
    const int *dsb = p.dstart ? p.dstart + (size_t)b * T : nullptr;
    if (dsb) { /* queries from the first one whose document starts after this block's last key see none of it */
        const int kmax = min(n0 + BNK, T) - 1;
        int lo = kmax + 1, hi = T;
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (dsb[mid] > kmax) hi = mid; else lo = mid + 1;
        }
        m_count = (lo + BMQ - 1) / BMQ;
    }

    load_tile<BNK, DQ, LDQ, NT>(sK, kbase + (size_t)n0 * ldqk, ldqk, T - n0, p.dimq, vqk, kbase, tid);
    load_tile<BNK, DV, LDV, NT>(sV, vbase + (size_t)n0 * ldv, ldv, T - n0, p.dimv, vv, vbase, tid);
    cp_async_commit();
    {
        const int q0 = m_first * BMQ;
        load_tile<BMQ, DQ, LDQ, NT>(sQ, qbase + (size_t)q0 * ldqk, ldqk, T - q0, p.dimq, vqk, qbase, tid);
        load_tile<BMQ, DV, LDV, NT>(sdO, dobase + (size_t)q0 * ldv, ldv, T - q0, p.dimv, vv, dobase, tid);
        if (tid < BMQ) {
            const int q = q0 + tid;
            sL[tid] = q < T ? lsebase[(size_t)q * H] * MT_FA_LOG2E : 0.f;
            sD[tid] = q < T ? dsbase[(size_t)q * H] : 0.f;
            if (dsb) sS[tid] = q < T ? dsb[q] : T;
        }
    }
    cp_async_commit();

    const int a_row = lane & 15, a_col = (lane >> 4) << 3;
    const int b_row = ((lane >> 4) << 3) + (lane & 7), b_col = ((lane >> 3) & 1) << 3;
    const int t_row = (((lane >> 3) & 1) << 3) + (lane & 7), t_col = (lane >> 4) << 3;
    const uint32_t sK_warp = smem_u32(sK + (kw * 16 + a_row) * LDQ + a_col);
    const uint32_t sV_warp = smem_u32(sV + (kw * 16 + a_row) * LDV + a_col);
    const int kg = warp % KG, dsp = warp / KG; /* phase-2 role */
    const uint32_t sP_warp = smem_u32(sP + (kg * 16 * MT + a_row) * LDP + a_col);
    const uint32_t sdS_warp = smem_u32(sdS + (kg * 16 * MT + a_row) * LDP + a_col);

    /* optionally keep this warp's K / V A-fragments (16 keys) in registers for the whole kernel */
    uint32_t kf[KVREG ? DQ / 16 : 1][4], vf[KVREG ? DV / 16 : 1][4];
    if (KVREG) {
        cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < (KVREG ? DQ / 16 : 0); ++kk) ldsm_x4(kf[kk], sK_warp + kk * 32);
#pragma unroll
        for (int kk = 0; kk < (KVREG ? DV / 16 : 0); ++kk) ldsm_x4(vf[kk], sV_warp + kk * 32);
    }

    float dk[MT][DQS / 8][4], dv[MT][DVS / 8][4]; /* (16*MT keys) x DQS, (16*MT keys) x DVS */
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < DQS / 8; ++i) dk[mt][i][0] = dk[mt][i][1] = dk[mt][i][2] = dk[mt][i][3] = 0.f;
#pragma unroll
        for (int i = 0; i < DVS / 8; ++i) dv[mt][i][0] = dv[mt][i][1] = dv[mt][i][2] = dv[mt][i][3] = 0.f;
    }

    const int key_lo = n0 + kw * 16 + g; /* keys key_lo and key_lo + 8 */
    const float sl2 = p.scale_log2;

    for (int mb = m_first, it = 0; mb < m_count; ++mb, ++it) {
        const int stage = (ST == 2) ? (it & 1) : 0;
        if (ST == 2 && mb + 1 < m_count) {
            const int q1 = (mb + 1) * BMQ, st1 = (it + 1) & 1;
            load_tile<BMQ, DQ, LDQ, NT>(sQ + st1 * BMQ * LDQ, qbase + (size_t)q1 * ldqk, ldqk, T - q1, p.dimq, vqk, qbase, tid);
            load_tile<BMQ, DV, LDV, NT>(sdO + st1 * BMQ * LDV, dobase + (size_t)q1 * ldv, ldv, T - q1, p.dimv, vv, dobase,
                                        tid);
            if (tid < BMQ) {
                const int q = q1 + tid;
                sL[st1 * BMQ + tid] = q < T ? lsebase[(size_t)q * H] * MT_FA_LOG2E : 0.f;
                sD[st1 * BMQ + tid] = q < T ? dsbase[(size_t)q * H] : 0.f;
                if (dsb) sS[st1 * BMQ + tid] = q < T ? dsb[q] : T;
            }
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint32_t cQ = smem_u32(sQ + stage * BMQ * LDQ);
        const uint32_t cdO = smem_u32(sdO + stage * BMQ * LDV);
        const float *cL = sL + stage * BMQ, *cD = sD + stage * BMQ;
        const int *cS = sS + stage * BMQ;
        const int qb0 = mb * BMQ;

        /* ---- phase 1: S^T = K Q^T, dP^T = V dO^T for 16 keys x QW queries, in chunks of QC ---- */
#pragma unroll 1
        for (int ch = 0; ch < QW / QC; ++ch) {
            const int qw0 = wh * QW + ch * QC; /* first local query of this chunk */
            float s[QC / 8][4], dp[QC / 8][4];
#pragma unroll
            for (int i = 0; i < QC / 8; ++i) {
                s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
                dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < DQ / 16; ++kk) {
                uint32_t a[4];
                if (KVREG) {
                    a[0] = kf[KVREG ? kk : 0][0]; a[1] = kf[KVREG ? kk : 0][1];
                    a[2] = kf[KVREG ? kk : 0][2]; a[3] = kf[KVREG ? kk : 0][3];
                } else {
                    ldsm_x4(a, sK_warp + kk * 32);
                }
#pragma unroll
                for (int nn = 0; nn < QC / 16; ++nn) {
                    uint32_t bb[4];
                    ldsm_x4(bb, cQ + ((qw0 + nn * 16 + b_row) * LDQ + kk * 16 + b_col) * 2);
                    mma_bf16(s[2 * nn], a, bb[0], bb[1]);
                    mma_bf16(s[2 * nn + 1], a, bb[2], bb[3]);
                }
            }
#pragma unroll
            for (int kk = 0; kk < DV / 16; ++kk) {
                uint32_t a[4];
                if (KVREG) {
                    a[0] = vf[KVREG ? kk : 0][0]; a[1] = vf[KVREG ? kk : 0][1];
                    a[2] = vf[KVREG ? kk : 0][2]; a[3] = vf[KVREG ? kk : 0][3];
                } else {
                    ldsm_x4(a, sV_warp + kk * 32);
                }
#pragma unroll
                for (int nn = 0; nn < QC / 16; ++nn) {
                    uint32_t bb[4];
                    ldsm_x4(bb, cdO + ((qw0 + nn * 16 + b_row) * LDV + kk * 16 + b_col) * 2);
                    mma_bf16(dp[2 * nn], a, bb[0], bb[1]);
                    mma_bf16(dp[2 * nn + 1], a, bb[2], bb[3]);
                }
            }
            const int qmin = qb0 + qw0;
            /* document starts grow with the query: the chunk's last one is its largest */
            const bool need_mask = (qmin < n0 + kw * 16 + 15) || (qb0 + BMQ > T) || (dsb && cS[qw0 + QC - 1] > n0 + kw * 16);
#pragma unroll
            for (int nt = 0; nt < QC / 8; ++nt) {
                const int ql = qw0 + nt * 8 + 2 * c; /* local query of elements e=0,2 (e=1,3: +1) */
                const float L0 = cL[ql], L1 = cL[ql + 1], D0 = cD[ql], D1 = cD[ql + 1];
                float pv[4], ds[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float L = (e & 1) ? L1 : L0, Dq = (e & 1) ? D1 : D0;
                    float pe = fast_exp2(fmaf(s[nt][e], sl2, -L));
                    if (need_mask) {
                        const int q = qb0 + ql + (e & 1);
                        const int key = key_lo + ((e >> 1) << 3);
                        if (q < key || q >= T || (dsb && cS[ql + (e & 1)] > key)) pe = 0.f;
                    }
                    pv[e] = pe;
                    ds[e] = pe * (dp[nt][e] - Dq);
                }
                const int r0 = (kw * 16 + g) * LDP + ql, r1 = r0 + 8 * LDP;
                *reinterpret_cast<uint32_t *>(sP + r0) = pack_bf16(pv[0], pv[1]);
                *reinterpret_cast<uint32_t *>(sP + r1) = pack_bf16(pv[2], pv[3]);
                *reinterpret_cast<uint32_t *>(sdS + r0) = pack_bf16(ds[0], ds[1]);
                *reinterpret_cast<uint32_t *>(sdS + r1) = pack_bf16(ds[2], ds[3]);
            }
        }
        __syncthreads();
        /* ---- phase 2: dV += P^T dO, dK += dS^T Q (this warp: 16*MT keys x 1/DS of the dims) ---- */
#pragma unroll
        for (int kk = 0; kk < BMQ / 16; ++kk) {
            uint32_t a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], sP_warp + (mt * 16 * LDP + kk * 16) * 2);
#pragma unroll
            for (int dn = 0; dn < DVS / 16; ++dn) {
                uint32_t bb[4];
                ldsm_x4_t(bb, cdO + ((kk * 16 + t_row) * LDV + dsp * DVS + dn * 16 + t_col) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(dv[mt][2 * dn], a[mt], bb[0], bb[1]);
                    mma_bf16(dv[mt][2 * dn + 1], a[mt], bb[2], bb[3]);
                }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], sdS_warp + (mt * 16 * LDP + kk * 16) * 2);
#pragma unroll
            for (int dn = 0; dn < DQS / 16; ++dn) {
                uint32_t bb[4];
                ldsm_x4_t(bb, cQ + ((kk * 16 + t_row) * LDQ + dsp * DQS + dn * 16 + t_col) * 2);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(dk[mt][2 * dn], a[mt], bb[0], bb[1]);
                    mma_bf16(dk[mt][2 * dn + 1], a[mt], bb[2], bb[3]);
                }
            }
        }
        __syncthreads();
        if (ST == 1 && mb + 1 < m_count) {
            const int q1 = (mb + 1) * BMQ;
            load_tile<BMQ, DQ, LDQ, NT>(sQ, qbase + (size_t)q1 * ldqk, ldqk, T - q1, p.dimq, vqk, qbase, tid);
            load_tile<BMQ, DV, LDV, NT>(sdO, dobase + (size_t)q1 * ldv, ldv, T - q1, p.dimv, vv, dobase, tid);
            if (tid < BMQ) {
                const int q = q1 + tid;
                sL[tid] = q < T ? lsebase[(size_t)q * H] * MT_FA_LOG2E : 0.f;
                sD[tid] = q < T ? dsbase[(size_t)q * H] : 0.f;
                if (dsb) sS[tid] = q < T ? dsb[q] : T;
            }
            cp_async_commit();
        }
    }

    /* epilogue: this warp's phase-2 keys n0 + kg*16*MT + mt*16 + g (+8) */
    bf16 *dkbase = p.dk + qoff, *dvbase = p.dv + voff;
    const bool pq = p.pair_qk != 0, pv2 = p.pair_v != 0;
    const float sc = p.scale;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int key = n0 + kg * 16 * MT + mt * 16 + g + hf * 8;
            if (key < T) {
                bf16 *krow = dkbase + (size_t)key * ldqk, *vrow = dvbase + (size_t)key * ldv;
#pragma unroll
                for (int nt = 0; nt < DQS / 8; ++nt)
                    store2(krow, dsp * DQS + nt * 8 + 2 * c, p.dimq, pq, dk[mt][nt][2 * hf] * sc, dk[mt][nt][2 * hf + 1] * sc);
#pragma unroll
                for (int nt = 0; nt < DVS / 8; ++nt)
                    store2(vrow, dsp * DVS + nt * 8 + 2 * c, p.dimv, pv2, dv[mt][nt][2 * hf], dv[mt][nt][2 * hf + 1]);
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Configurations                                                                             */
/* ------------------------------------------------------------------------------------------ */
template <int DQ_, int DV_>
struct Cfg {
    static constexpr int DQ = DQ_, DV = DV_;
    static constexpr bool BIG = (DQ_ > 192 || DV_ > 128);
    /* forward: 8 warps (128 queries; 4 warps / 64 for the 256 config), BN keys per tile,
       double-buffered K/V, Q fragments in registers */
    static constexpr int F_NW = BIG ? 4 : 8, F_BN = BIG ? 32 : 64, F_ST = 2, F_MT = 1;
    static constexpr bool F_QREG = !BIG;
    /* dQ: 8 warps (128 queries), double-buffered K/V */
    static constexpr int Q_NW = 8, Q_BN = BIG ? 32 : 64, Q_ST = 2;
    /* dK/dV: 64 keys, K_BMQ-query tiles double buffered, one CTA per SM */
    static constexpr int K_BMQ = BIG ? 32 : 64, K_ST = 2, K_MINB = 1, K_QC = K_BMQ / 2;
    static constexpr bool K_KVREG = !BIG;
    static constexpr int K_MT = (DQ_ % 64 == 0 && DV_ % 64 == 0) ? 2 : 1;
};

template <int DQ, int DV, int NW, int BN, int ST, int MT>
constexpr size_t fwd_smem_bytes() {
    return (size_t)(NW * 16 * MT * (DQ + 8) + ST * BN * (DQ + 8 + DV + 8)) * sizeof(bf16);
}
template <int DQ, int DV, int NW, int BN, int ST>
constexpr size_t dq_smem_bytes() {
    return (size_t)(NW * 16 * (DQ + 8 + DV + 8) + ST * BN * (DQ + 8 + DV + 8)) * sizeof(bf16);
}
template <int DQ, int DV, int BMQ, int ST>
constexpr size_t dkdv_smem_bytes() {
    return (size_t)(64 * (DQ + 8 + DV + 8) + ST * BMQ * (DQ + 8 + DV + 8) + 2 * 64 * (BMQ + 8)) * sizeof(bf16) +
           (size_t)2 * ST * BMQ * sizeof(float) + (size_t)ST * BMQ * sizeof(int);
}

template <int DQ, int DV, int NW, int BN, int ST, bool QREG, int MT>
static int launch_fwd_kernel(const FwdParams &p, int BH, cudaStream_t stream) {
    void (*kern)(const FwdCore) = fa_fwd_kernel<DQ, DV, NW, BN, ST, QREG, MT>;
    const size_t smem = fwd_smem_bytes<DQ, DV, NW, BN, ST, MT>();
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return -1;
    const int BM = NW * 16 * MT;
    const int mblocks = (p.T + BM - 1) / BM;
    if (BH > 65535) return -1;
    dim3 grid((unsigned)mblocks, (unsigned)BH);
    kern<<<grid, NW * 32, smem, stream>>>(p);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
template <int DQ, int DV, int BMQ, int ST, int MINB, int QC, bool KVREG, int MT>
static int launch_dkdv_kernel(const BwdParams &p, int BH, cudaStream_t stream) {
    void (*kern)(const BwdCore) = fa_bwd_dkdv_kernel<DQ, DV, BMQ, ST, MINB, QC, KVREG, MT>;
    const size_t smem = dkdv_smem_bytes<DQ, DV, BMQ, ST>();
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return -1;
    const int nblocks = (p.T + 63) / 64;
    if (BH > 65535) return -1;
    dim3 grid((unsigned)nblocks, (unsigned)BH);
    kern<<<grid, 256, smem, stream>>>(p);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
template <int DQ, int DV, int NW, int BN, int ST>
static int launch_dq_kernel(const BwdParams &p, int BH, cudaStream_t stream) {
    void (*kern)(const BwdCore) = fa_bwd_dq_kernel<DQ, DV, NW, BN, ST>;
    const size_t smem = dq_smem_bytes<DQ, DV, NW, BN, ST>();
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return -1;
    const int BM = NW * 16;
    const int mblocks = (p.T + BM - 1) / BM;
    if (BH > 65535) return -1;
    dim3 grid((unsigned)mblocks, (unsigned)BH);
    kern<<<grid, NW * 32, smem, stream>>>(p);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
static int launch_dot_kernel(const BwdParams &p, long long rows, cudaStream_t stream) {
    int *tick = p.ds ? p.tick : nullptr;
    const int dv = p.dimv;
    if (dv % 8 == 0 && !(((uintptr_t)p.o | (uintptr_t)p.dout) & 15u)) {
        const int ch = dv / 8, lpr = ch <= 4 ? 4 : ch <= 8 ? 8 : ch <= 16 ? 16 : 32;
        const long long per_blk = 8LL * (32 / lpr) * 2, nblk = (rows + per_blk - 1) / per_blk;
        if (nblk > 0x7fffffffLL) return -1;
        const uint4 *o = reinterpret_cast<const uint4 *>(p.o), *d = reinterpret_cast<const uint4 *>(p.dout);
        if (lpr == 4) fa_bwd_dot16_kernel<4><<<(unsigned)nblk, 256, 0, stream>>>(o, d, p.dsum, rows, ch, tick);
        else if (lpr == 8) fa_bwd_dot16_kernel<8><<<(unsigned)nblk, 256, 0, stream>>>(o, d, p.dsum, rows, ch, tick);
        else if (lpr == 16) fa_bwd_dot16_kernel<16><<<(unsigned)nblk, 256, 0, stream>>>(o, d, p.dsum, rows, ch, tick);
        else fa_bwd_dot16_kernel<32><<<(unsigned)nblk, 256, 0, stream>>>(o, d, p.dsum, rows, ch, tick);
        return cudaGetLastError() == cudaSuccess ? 0 : -1;
    }
    const long long nblk = (rows + 7) / 8;
    if (nblk > 0x7fffffffLL) return -1;
    fa_bwd_dot_kernel<<<(unsigned)nblk, 256, 0, stream>>>(p.o, p.dout, p.dsum, rows, p.dimv, tick);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

/* a [B][T][H][D] bf16 tensor as a TMA map over (D, H, T, B), boxes of 64 x 1 x rows x 1 */
static int fa_map(EncodeTiledFn enc, CUtensorMap *m, const void *base, int D, int H, int T, int B, int rows) {
    const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)H, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[3] = {(cuuint64_t)D * 2, (cuuint64_t)H * D * 2, (cuuint64_t)T * H * D * 2};
    const cuuint32_t box[4] = {64, 1, (cuuint32_t)rows, 1};
    return tma_map(enc, m, base, 4, dims, strides, box);
}
/* a [B][T][D] bf16 tensor (one row per token, shared by the heads) as a TMA map over (D, T, B), boxes of
   64 x rows x 1: the same shared-memory panels as fa_map's boxes */
static int fa_map_shared(EncodeTiledFn enc, CUtensorMap *m, const void *base, int D, int T, int B, int rows) {
    const cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[2] = {(cuuint64_t)D * 2, (cuuint64_t)T * D * 2};
    const cuuint32_t box[3] = {64, (cuuint32_t)rows, 1};
    return tma_map(enc, m, base, 3, dims, strides, box);
}
/* Q's, K's and V's maps for any of the three kernels' map sets: Q in boxes of qrows rows, K and V of
   krows; from p.q, p.k, p.v, or with the RoPE folded (p.fold.dn > 0, rope width 64) from q + qr, kv +
   kr and kv's value columns (the dims must then be the kernel's DQ, DV exactly: a panel past them would
   read the next head's columns, not zeros) */
template <class P, class M>
static int qkv_maps(EncodeTiledFn enc, M &m, const P &p, int B, int qrows, int krows) {
    memset(&m.q2, 0, sizeof m.q2);
    memset(&m.k2, 0, sizeof m.k2);
    const int fd = p.fold.dn;
    if (!fd)
        return fa_map(enc, &m.q, p.q, p.dimq, p.H, p.T, B, qrows) || fa_map(enc, &m.k, p.k, p.dimq, p.H, p.T, B, krows) ||
               fa_map(enc, &m.v, p.v, p.dimv, p.H, p.T, B, krows);
    if (p.dimq - fd != 64 || fd % 64 || p.dimv % 64) return -1;
    return fa_map(enc, &m.q, p.fold.q, p.dimq, p.H, p.T, B, qrows) || fa_map(enc, &m.q2, p.fold.qr, 64, p.H, p.T, B, qrows) ||
           fa_map(enc, &m.k, p.fold.kv, fd + p.dimv, p.H, p.T, B, krows) || fa_map_shared(enc, &m.k2, p.fold.kr, 64, p.T, B, krows) ||
           fa_map(enc, &m.v, p.fold.kv, fd + p.dimv, p.H, p.T, B, krows);
}
/* -2: no tensor-map encoder, a map it refuses or a scale <= 0 (the caller takes the mma.sync kernel) */
template <int DQ, int DV, int BN>
static int launch_fwd_wg_kernel(const FwdParams &p, int BH, cudaStream_t stream) {
    void (*kern)(const FwdCore, const FwdMaps) = fa_fwd_wg_kernel<DQ, DV, BN, false>;
    if constexpr (DV == 128) if (p.fold.dn) kern = fa_fwd_wg_kernel<DQ, DV, BN, true>;
    if (DV != 128 && p.fold.dn) return -1;
    const size_t smem = fwd_wg_smem_bytes<DQ, DV, BN>();
    const int mblocks = (p.T + 127) / 128;
    if (BH > 65535 || p.H <= 0) return -1;
    if (!(p.scale_log2 > 0.f)) return -2; /* the softmax takes its maximum before scaling */
    const int B = BH / p.H;
    EncodeTiledFn enc = tma_encoder();
    FwdMaps tm;
    if (p.fold.dn && (p.dimq != DQ || p.dimv != DV)) return -1;
    if (!enc || qkv_maps(enc, tm, p, B, 128, BN)) return -2;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return -1;
    /* persistent: one CTA per SM (at most one per work item), each takes its items in turn */
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        sms <= 0)
        return -1;
    const long long items = (long long)mblocks * BH;
    if (items > 0x7fffffffLL) return -1;
    FwdParams q = p;
    q.nbh = BH;
    kern<<<(unsigned)(items < sms ? items : sms), 384, smem, stream>>>(q, tm);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

/* The wgmma kernels cover the configurations whose padded dims are multiples of 64 with a value
   head of at most 128, on the 16-byte load path, and heads of 256 (split_config); everything else
   takes the mma.sync kernels. */
template <int DQ, int DV>
constexpr bool wg_config() { return DQ % 64 == 0 && DV % 64 == 0 && DV <= 128 && DQ <= 192; }
/* the forward also up to heads of 256 (q/k and v): key tiles of 64 there, so that O (64 x 256 a
   warpgroup, 128 registers a thread) and S fit the registers and Q, K and V shared memory */
/* the backward's dK/dV at heads of 256 (fa_bwd_dkdv_split_kernel; dQ from its dS, or the mma.sync kernel) */
template <int DQ, int DV>
constexpr bool split_config() { return !wg_config<DQ, DV>() && DQ == 256 && DV == 256; }
template <int DQ, int DV>
constexpr bool fwd_wg_config() { return DQ % 64 == 0 && DQ <= 256 && (DV == 64 || DV == 128 || DV == 256); }
template <int DQ, int DV>
constexpr int fwd_wg_bn() { return DQ <= 192 && DV <= 128 ? 128 : 64; }

template <int DQ, int DV>
static int launch_fwd(const FwdParams &p, int BH, cudaStream_t stream) {
    typedef Cfg<DQ, DV> C;
    if constexpr (fwd_wg_config<DQ, DV>())
        if (p.vec_qk && p.vec_v) {
            const int r = launch_fwd_wg_kernel<DQ, DV, fwd_wg_bn<DQ, DV>()>(p, BH, stream);
            if (r != -2) return r;
        }
    if (p.fold.dn) return -1; /* folded RoPE: the wgmma kernel only */
    return launch_fwd_kernel<DQ, DV, C::F_NW, C::F_BN, C::F_ST, C::F_QREG, C::F_MT>(p, BH, stream);
}
/* -2: no tensor-map encoder or a map it refuses (the caller takes the mma.sync kernel) */
/* kern(p, tm) on grid x threads; early: with programmatic stream serialization (it may start while the
   kernel before it runs its last CTAs, and waits for it itself: griddepcontrol.wait) */
template <class M>
static int launch_pss(void (*kern)(const BwdCore, const M), dim3 grid, int threads, size_t smem, cudaStream_t stream, bool early,
                      const BwdParams &p, const M &tm) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = early ? attr : nullptr;
    cfg.numAttrs = early ? 1 : 0;
    if (cudaLaunchKernelEx(&cfg, kern, p, tm) != cudaSuccess) return -1;
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
/* the dS^T tiles (ds_tile) as a TMA map: 64-column rows, boxes of 64 x 64 */
static int ds_map(EncodeTiledFn enc, CUtensorMap *m, const void *ds, int BH, int ntri) {
    const cuuint64_t dims[2] = {64, (cuuint64_t)BH * (cuuint64_t)ntri * 64};
    const cuuint64_t strides[1] = {128};
    const cuuint32_t box[2] = {64, 64};
    return tma_map(enc, m, ds, 2, dims, strides, box);
}
/* heads above 192/128: dK and dV on separate warpgroups (fa_bwd_dkdv_split_kernel), dS^T stored when p.ds
   is set; -2 as above */
template <int DQ, int DV, bool PIPE = (dkdv_split_stages<DQ, DV>() >= 3)>
static int launch_dkdv_split_kernel(const BwdParams &p, int BH, cudaStream_t stream) {
    static_assert(!PIPE || dkdv_split_stages<DQ, DV>() >= 3, "PIPE loads a tile ahead: three stages");
    void (*kern)(const BwdCore, const DkdvMaps) = p.ds ? fa_bwd_dkdv_split_kernel<DQ, DV, 3, false, PIPE>
                                                       : fa_bwd_dkdv_split_kernel<DQ, DV, 0, false, PIPE>;
    if constexpr (DV == 128)
        if (p.fold.dn) kern = p.ds ? fa_bwd_dkdv_split_kernel<DQ, DV, 3, true, PIPE> : fa_bwd_dkdv_split_kernel<DQ, DV, 0, true, PIPE>;
    const size_t smem = dkdv_split_smem_bytes<DQ, DV>(p.ds != nullptr);
    if ((p.fold.dn && (DV != 128 || p.dimq != DQ || p.dimv != DV)) || BH > 65535 || p.H <= 0 || smem > 227 * 1024) return -1;
    const int B = BH / p.H;
    EncodeTiledFn enc = tma_encoder();
    DkdvMaps tm;
    memset(&tm, 0, sizeof tm);
    tm.ds = p.ds;
    tm.ntri = p.ntri;
    tm.dk2 = p.dk2;
    tm.fold_dn = p.fold.dn;
    if (!enc || (p.ds && ds_map(enc, &tm.dsm, p.ds, BH, p.ntri)) || qkv_maps(enc, tm, p, B, 64, 64) ||
        fa_map(enc, &tm.dout, p.dout, p.dimv, p.H, p.T, B, 64))
        return -2;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return -1;
    kern<<<dim3((unsigned)((p.T + 63) / 64), (unsigned)BH), 384, smem, stream>>>(p, tm);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
/* -2: no tensor-map encoder or a map it refuses (the caller takes the mma.sync kernel) */
template <int DQ, int DV, bool EARLY = false>
static int launch_dq_wg_kernel(const BwdParams &p, int BH, cudaStream_t stream) {
    void (*kern)(const BwdCore, const DqMaps) = fa_bwd_dq_wg_kernel<DQ, DV, false>;
    if constexpr (DV == 128) if (p.fold.dn) kern = fa_bwd_dq_wg_kernel<DQ, DV, true>;
    if (DV != 128 && p.fold.dn) return -1;
    const size_t smem = dq_wg_smem_bytes<DQ, DV>() + (p.fold.dn ? (size_t)128 * (p.dimq - p.fold.dn) * 4 : 0);
    if (BH > 65535 || p.H <= 0) return -1;
    const int B = BH / p.H;
    EncodeTiledFn enc = tma_encoder();
    DqMaps tm;
    if (p.fold.dn && (p.dimq != DQ || p.dimv != DV)) return -1;
    tm.rcos = p.rcos; tm.rsin = p.rsin;
    tm.fold_dn = p.fold.dn;
    if (!enc || qkv_maps(enc, tm, p, B, 128, 64) || fa_map(enc, &tm.dout, p.dout, p.dimv, p.H, p.T, B, 128)) return -2;
    if (smem > 227 * 1024 || cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return -1;
    /* EARLY: programmatic stream serialization, so that it may start while the kernel before it
       (the dK/dV kernel, which triggers at its start) is still running its last CTAs */
    return launch_pss(kern, dim3((unsigned)((p.T + 127) / 128), (unsigned)BH), 384, smem, stream, EARLY, p, tm);
}

/* dQ from the stored dS (p.ds, after launch_dkdv_split_kernel wrote it); -2 as above */
template <int DQ, bool EARLY = true>
static int launch_dq_ds_kernel(const BwdParams &p, int BH, cudaStream_t stream) {
    void (*kern)(const BwdCore, const DqdsMaps) = fa_bwd_dq_ds_kernel<DQ, false>;
    size_t smem = dqds_smem_bytes<DQ, false>();
    if constexpr (DQ <= 192)
        if (p.fold.dn) {
            kern = fa_bwd_dq_ds_kernel<DQ, true>;
            smem = dqds_smem_bytes<DQ, true>();
        }
    if (p.fold.dn && (DQ > 192 || p.dimq - p.fold.dn != 64)) return -1; /* the tables' room is for a rope width of 64 */
    if (BH > 65535 || p.H <= 0 || !p.ds) return -1;
    const int B = BH / p.H;
    EncodeTiledFn enc = tma_encoder();
    DqdsMaps tm;
    memset(&tm, 0, sizeof tm);
    if (p.fold.dn && p.dimq != DQ) return -1;
    tm.rcos = p.rcos; tm.rsin = p.rsin;
    tm.fold_dn = p.fold.dn;
    tm.ntri = p.ntri;
    tm.nbh = BH;
    tm.tick = p.tick;
    if (!enc || !p.tick) return -2;
    const int fd = p.fold.dn;
    int rc = fd ? (fa_map(enc, &tm.k, p.fold.kv, fd + p.dimv, p.H, p.T, B, 64) || fa_map_shared(enc, &tm.k2, p.fold.kr, 64, p.T, B, 64))
                : fa_map(enc, &tm.k, p.k, p.dimq, p.H, p.T, B, 64);
    rc = rc || ds_map(enc, &tm.ds, p.ds, BH, p.ntri);
    if (rc) return -2;
    if (smem > 227 * 1024 || cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return -1;
    int dev = 0, sms = 0; /* persistent: one CTA per SM (at most one per work item) */
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0)
        return -1;
    const long long items = (long long)((p.T + 127) / 128) * BH;
    if (items > 0x7fffffffLL) return -1;
    return launch_pss(kern, dim3((unsigned)(items < sms ? items : sms)), 384, smem, stream, EARLY, p, tm);
}

/* EARLY: the dQ kernel may start while the dK/dV kernel finishes (bench/attention.cu times both) */
template <int DQ, int DV, bool EARLY = true>
static int launch_bwd(const BwdParams &p, int BH, cudaStream_t stream) {
    typedef Cfg<DQ, DV> C;
    if constexpr (wg_config<DQ, DV>())
        if (p.vec_qk && p.vec_v) {
            int r = launch_dkdv_split_kernel<DQ, DV>(p, BH, stream);
            if (r == -2 && p.fold.dn) return -1; /* folded RoPE: the wgmma kernels only */
            if (r == 0 && p.ds) return launch_dq_ds_kernel<DQ, EARLY>(p, BH, stream) ? -1 : 0; /* dS written: dQ from it */
            if (r == -2) r = launch_dkdv_kernel<DQ, DV, C::K_BMQ, C::K_ST, C::K_MINB, C::K_QC, C::K_KVREG, C::K_MT>(p, BH, stream);
            if (r) return -1;
            r = launch_dq_wg_kernel<DQ, DV, EARLY>(p, BH, stream);
            if (r != -2) return r;
            if (p.fold.dn) return -1;
            return launch_dq_kernel<DQ, DV, C::Q_NW, C::Q_BN, C::Q_ST>(p, BH, stream);
        }
    if (p.fold.dn) return -1;
    int r = -2;
    if constexpr (split_config<DQ, DV>())
        if (p.vec_qk && p.vec_v) {
            r = launch_dkdv_split_kernel<DQ, DV>(p, BH, stream);
            if (r == 0 && p.ds) return launch_dq_ds_kernel<DQ, EARLY>(p, BH, stream) ? -1 : 0; /* dS written: dQ from it */
        }
    if (r == -2) r = launch_dkdv_kernel<DQ, DV, C::K_BMQ, C::K_ST, C::K_MINB, C::K_QC, C::K_KVREG, C::K_MT>(p, BH, stream);
    if (r) return -1;
    return launch_dq_kernel<DQ, DV, C::Q_NW, C::Q_BN, C::Q_ST>(p, BH, stream);
}

/* configuration index for head dims, -1 if unsupported */
static int pick_cfg(int dq, int dv) {
    if (dq <= 0 || dv <= 0) return -1;
    if (dq <= 32 && dv <= 32) return 0;
    if (dq <= 64 && dv <= 64) return 1;
    if (dq <= 128 && dv <= 128) return 2;
    if (dq <= 192 && dv <= 128) return 3;
    if (dq <= 256 && dv <= 256) return 4;
    return -1;
}
static inline bool aligned_to(const void *ptr, size_t a) { return ((uintptr_t)ptr % a) == 0; }

} /* namespace mt_fa */

/* ------------------------------------------------------------------------------------------ */
/* Entry points (wrapped by mt_cuda_attention_* below)                                        */
/* ------------------------------------------------------------------------------------------ */
static int mt__fa_forward(const __nv_bfloat16 *Q, const __nv_bfloat16 *K, const __nv_bfloat16 *V, const int32_t *dstart,
                          __nv_bfloat16 *O, float *lse, int B, int T, int H, int dq, int dv, float scale,
                          cudaStream_t stream) {
    using namespace mt_fa;
    if (B < 0 || T < 0 || H < 0) return -1;
    const int cfg = pick_cfg(dq, dv);
    if (cfg < 0) return -1;
    if ((long long)B * T * H == 0) return 0;
    if (!Q || !K || !V || !O || !lse) return -1;
    if ((long long)B * H > 0x7fffffffLL || (long long)B * T > 0x7fffffffLL) return -1;
    if (!(scale == scale)) return -1;
    FwdParams p;
    p.q = Q; p.k = K; p.v = V; p.o = O; p.lse = lse; p.dstart = dstart;
    p.T = T; p.H = H; p.dimq = dq; p.dimv = dv;
    p.scale_log2 = scale * MT_FA_LOG2E;
    p.vec_qk = (dq % 8 == 0) && aligned_to(Q, 16) && aligned_to(K, 16);
    p.vec_v = (dv % 8 == 0) && aligned_to(V, 16);
    p.pair_o = (dv % 2 == 0) && aligned_to(O, 4);
    const int BH = B * H;
    switch (cfg) {
    case 0: return launch_fwd<32, 32>(p, BH, stream);
    case 1: return launch_fwd<64, 64>(p, BH, stream);
    case 2: return launch_fwd<128, 128>(p, BH, stream);
    case 3: return launch_fwd<192, 128>(p, BH, stream);
    default: return launch_fwd<256, 256>(p, BH, stream);
    }
}

/* The backward's workspace: D [B*T*H] f32, then (when ds_bytes says so) the dS^T tiles of the wgmma
   kernels (ds_tile): B*H*n(n+1)/2 tiles of 8 KB, n = ceil(T / 64), e.g. 0.55 GB for B=8 T=2048 H=16.
   Storing dS once instead of recomputing S and dP for dQ: H200, B=8 T=2048 H=16, 192/128, see
   fa_bwd_dq_ds_kernel.  Above MT_FA_DS_MAX_BYTES (long sequences: the tiles grow as T^2) the dQ
   kernel recomputes them instead. */
#define MT_FA_DS_MAX_BYTES ((size_t)4 << 30)
static size_t mt__fa_ds_offset(int B, int T, int H) {   /* D, then the dQ kernel's two counters */
    return ((size_t)B * T * H * sizeof(float) + 16 + 1023) & ~(size_t)1023;
}
static size_t mt__fa_ds_bytes(int B, int T, int H, int dq, int dv) {
    const int cfg = mt_fa::pick_cfg(dq, dv);
    if (B <= 0 || T <= 0 || H <= 0 || cfg < 1 || cfg > 4) return 0; /* the wgmma configurations */
    const size_t n = ((size_t)T + 63) / 64, bytes = (size_t)B * H * (n * (n + 1) / 2) * 8192;
    return bytes <= MT_FA_DS_MAX_BYTES ? bytes : 0;
}
static size_t mt__fa_backward_workspace(int B, int T, int H, int dq, int dv, bool store_ds = true) {
    if (B <= 0 || T <= 0 || H <= 0) return 256;
    const size_t ds = store_ds ? mt__fa_ds_bytes(B, T, H, dq, dv) : 0;
    return ds ? mt__fa_ds_offset(B, T, H) + ds : mt__fa_ds_offset(B, T, H);
}

namespace mt_fa {
/* argument checks + parameter block for the backward; returns the config index or -1 (0 size: -2) */
static int setup_bwd(BwdParams &p, const __nv_bfloat16 *Q, const __nv_bfloat16 *K, const __nv_bfloat16 *V,
                     const __nv_bfloat16 *O, const float *lse, const __nv_bfloat16 *dO, const int32_t *dstart, __nv_bfloat16 *dQ,
                     __nv_bfloat16 *dK, __nv_bfloat16 *dV, void *workspace, int B, int T, int H, int dq, int dv,
                     float scale, bool store_ds = true) {
    if (B < 0 || T < 0 || H < 0) return -1;
    const int cfg = pick_cfg(dq, dv);
    if (cfg < 0) return -1;
    if ((long long)B * T * H == 0) return -2;
    if (!Q || !K || !V || !O || !lse || !dO || !dQ || !dK || !dV || !workspace) return -1;
    if ((long long)B * H > 0x7fffffffLL || (long long)B * T > 0x7fffffffLL) return -1;
    if (!aligned_to(workspace, 4)) return -1;
    if (!(scale == scale)) return -1;
    p.q = Q; p.k = K; p.v = V; p.o = O; p.dout = dO; p.lse = lse;
    p.dsum = (float *)workspace;
    p.dstart = dstart;
    p.dq = dQ; p.dk = dK; p.dv = dV;
    p.T = T; p.H = H; p.dimq = dq; p.dimv = dv;
    p.scale = scale;
    p.scale_log2 = scale * MT_FA_LOG2E;
    if (store_ds && mt__fa_ds_bytes(B, T, H, dq, dv) && aligned_to(workspace, 16)) {
        const size_t n = ((size_t)T + 63) / 64;
        p.ds = (bf16 *)((char *)workspace + mt__fa_ds_offset(B, T, H));
        p.ntri = (int)(n * (n + 1) / 2);
        p.tick = (int *)((char *)workspace + (size_t)B * T * H * sizeof(float));
    }
    p.vec_qk = (dq % 8 == 0) && aligned_to(Q, 16) && aligned_to(K, 16);
    p.vec_v = (dv % 8 == 0) && aligned_to(V, 16) && aligned_to(dO, 16);
    p.pair_qk = (dq % 2 == 0) && aligned_to(dQ, 4) && aligned_to(dK, 4);
    p.pair_v = (dv % 2 == 0) && aligned_to(dV, 4);
    return cfg;
}
} /* namespace mt_fa */

static int mt__fa_backward(const __nv_bfloat16 *Q, const __nv_bfloat16 *K, const __nv_bfloat16 *V,
                           const __nv_bfloat16 *O, const float *lse, const __nv_bfloat16 *dO, const int32_t *dstart,
                           __nv_bfloat16 *dQ, __nv_bfloat16 *dK, __nv_bfloat16 *dV, void *workspace, int B,
                           int T, int H, int dq, int dv, float scale, cudaStream_t stream, bool store_ds = true) {
    using namespace mt_fa;
    BwdParams p;
    const int cfg = setup_bwd(p, Q, K, V, O, lse, dO, dstart, dQ, dK, dV, workspace, B, T, H, dq, dv, scale, store_ds);
    if (cfg == -2) return 0;
    if (cfg < 0) return -1;
    if (launch_dot_kernel(p, (long long)B * T * H, stream)) return -1;
    const int BH = B * H;
    switch (cfg) {
    case 0: return launch_bwd<32, 32>(p, BH, stream);
    case 1: return launch_bwd<64, 64>(p, BH, stream);
    case 2: return launch_bwd<128, 128>(p, BH, stream);
    case 3: return launch_bwd<192, 128>(p, BH, stream);
    default: return launch_bwd<256, 256>(p, BH, stream);
    }
}

/* MLA attention with its RoPE folded in (MLA_ATTENTION / MLA_ATTENTION_BWD): the wgmma kernels take
   their tiles from q [N, H*(dn+dr)], kv [N, H*(dn+dv)], qr [N, H*dr] and kr [N, dr] (see Fold), so Q, K,
   V and their gradients are never formed; the backward writes q's gradient (rope columns rotated back
   in the dQ epilogue), kv's, and dkr [N, H*dr] (each head's gradient of the shared kr).  Bitwise the
   results of MLA_ROPE + attention + MLA_ROPE_BWD.  Only the head dims of mt_rope_fold_fits, with
   16-byte aligned tensors. */
namespace mt_fa {
static bool fold_ok(int dn, int dr, int dv, const void *a, const void *b, const void *c, const void *d) {
    return mt_rope_fold_fits(dn, dr, dv) && aligned_to(a, 16) && aligned_to(b, 16) && aligned_to(c, 16) && aligned_to(d, 16);
}
} /* namespace mt_fa */

static int mt__fa_mla_forward(const __nv_bfloat16 *q, const __nv_bfloat16 *kv, const __nv_bfloat16 *qr, const __nv_bfloat16 *kr,
                              const int32_t *dstart, __nv_bfloat16 *O, float *lse, int B, int T, int H, int dn, int dr, int dv,
                              float scale, cudaStream_t stream) {
    using namespace mt_fa;
    if (B < 0 || T < 0 || H < 0) return -1;
    if ((long long)B * T * H == 0) return 0;
    if (!fold_ok(dn, dr, dv, q, kv, qr, kr) || !O || !lse || !aligned_to(O, 4)) return -1;
    if ((long long)B * H > 0x7fffffffLL || (long long)B * T > 0x7fffffffLL) return -1;
    if (!(scale > 0.f)) return -1;
    FwdParams p;
    p.q = p.k = p.v = nullptr; p.o = O; p.lse = lse; p.dstart = dstart;
    p.T = T; p.H = H; p.dimq = dn + dr; p.dimv = dv;
    p.scale_log2 = scale * MT_FA_LOG2E;
    p.vec_qk = p.vec_v = 1;
    p.pair_o = 1;
    p.fold.q = q; p.fold.kv = kv; p.fold.qr = qr; p.fold.kr = kr; p.fold.dn = dn;
    const int BH = B * H;
    return p.dimq == 192 ? launch_fwd<192, 128>(p, BH, stream) : launch_fwd<128, 128>(p, BH, stream);
}
static int mt__fa_mla_backward(const __nv_bfloat16 *q, const __nv_bfloat16 *kv, const __nv_bfloat16 *qr, const __nv_bfloat16 *kr,
                               const __nv_bfloat16 *O, const float *lse, const __nv_bfloat16 *dO, const int32_t *dstart,
                               const float *cosv, const float *sinv, __nv_bfloat16 *dq, __nv_bfloat16 *dkv, __nv_bfloat16 *dkr,
                               void *workspace, int B, int T, int H, int dn, int dr, int dv, float scale, cudaStream_t stream,
                               bool store_ds = true) {
    using namespace mt_fa;
    if (B < 0 || T < 0 || H < 0) return -1;
    if ((long long)B * T * H == 0) return 0;
    if (!fold_ok(dn, dr, dv, q, kv, qr, kr) || !cosv || !sinv || !aligned_to(dq, 16) || !aligned_to(dkv, 16) || !aligned_to(dkr, 16))
        return -1;
    BwdParams p;
    /* q, kv stand in for Q, K, V in the checks (they are not read); dV is dkv's value columns */
    const int cfg = setup_bwd(p, q, kv, kv, O, lse, dO, dstart, dq, dkv, dkv + dn, workspace, B, T, H, dn + dr, dv, scale, store_ds);
    if (cfg == -2) return 0;
    if (cfg < 0 || !p.vec_v || !(scale > 0.f)) return -1;
    p.q = p.k = p.v = nullptr;
    p.vec_qk = 1;
    p.pair_qk = p.pair_v = 1;
    p.fold.q = q; p.fold.kv = kv; p.fold.qr = qr; p.fold.kr = kr; p.fold.dn = dn;
    p.dk2 = dkr; p.rcos = cosv; p.rsin = sinv;
    if (launch_dot_kernel(p, (long long)B * T * H, stream)) return -1;
    const int BH = B * H;
    return p.dimq == 192 ? launch_bwd<192, 128>(p, BH, stream) : launch_bwd<128, 128>(p, BH, stream);
}

extern "C" {
size_t mt_cuda_attention_backward_workspace(const mt_cuda *c, int B, int T, int H, int dq, int dv) {
    return mt__fa_backward_workspace(B, T, H, dq, dv, !c->attn_recompute_dq);
}
int mt_cuda_attention_forward(mt_cuda *c, const void *Q, const void *K, const void *V, const int32_t *dstart, void *O,
                              float *lse, int B, int T, int H, int dq, int dv, float scale) {
    if (dq > 256 || dv > 256) return mt__fail(c, "attention", "head dims above 256 are not supported on CUDA");
    if (mt__fa_forward((const bf16 *)Q, (const bf16 *)K, (const bf16 *)V, dstart, (bf16 *)O, lse, B, T, H, dq, dv, scale, c->stream))
        return mt__fail(c, "attention forward", cudaGetErrorString(cudaGetLastError()));
    return 0;
}
int mt_cuda_attention_backward(mt_cuda *c, const void *Q, const void *K, const void *V, const void *O, const float *lse,
                               const void *dO, const int32_t *dstart, void *dQ, void *dK, void *dV, void *ws, int B, int T,
                               int H, int dq, int dv, float scale) {
    if (dq > 256 || dv > 256) return mt__fail(c, "attention", "head dims above 256 are not supported on CUDA");
    if (mt__fa_backward((const bf16 *)Q, (const bf16 *)K, (const bf16 *)V, (const bf16 *)O, lse, (const bf16 *)dO, dstart,
                        (bf16 *)dQ, (bf16 *)dK, (bf16 *)dV, ws, B, T, H, dq, dv, scale, c->stream, !c->attn_recompute_dq))
        return mt__fail(c, "attention backward", cudaGetErrorString(cudaGetLastError()));
    return 0;
}
int mt_cuda_mla_attention_forward(mt_cuda *c, const void *q, const void *kv, const void *qr, const void *kr, const int32_t *dstart,
                                  void *O, float *lse, int B, int T, int H, int dn, int dr, int dv, float scale) {
    if (!mt_rope_fold_fits(dn, dr, dv))
        return mt__fail(c, "attention (RoPE folded)", "these head dims have no folded kernels: compile without the fold_rope pass");
    if (mt__fa_mla_forward((const bf16 *)q, (const bf16 *)kv, (const bf16 *)qr, (const bf16 *)kr, dstart, (bf16 *)O, lse, B, T, H, dn, dr,
                           dv, scale, c->stream))
        return mt__fail(c, "attention forward (RoPE folded)", cudaGetLastError() != cudaSuccess ? "a launch failed"
                                                                                              : "misaligned tensors or no TMA tensor-map encoder");
    return 0;
}
int mt_cuda_mla_attention_backward(mt_cuda *c, const void *q, const void *kv, const void *qr, const void *kr, const void *O,
                                   const float *lse, const void *dO, const int32_t *dstart, const float *cosv, const float *sinv,
                                   void *dq, void *dkv, void *dkr, void *ws, int B, int T, int H, int dn, int dr, int dv, float scale) {
    if (!mt_rope_fold_fits(dn, dr, dv))
        return mt__fail(c, "attention (RoPE folded)", "these head dims have no folded kernels: compile without the fold_rope pass");
    if (mt__fa_mla_backward((const bf16 *)q, (const bf16 *)kv, (const bf16 *)qr, (const bf16 *)kr, (const bf16 *)O, lse, (const bf16 *)dO,
                            dstart, cosv, sinv, (bf16 *)dq, (bf16 *)dkv, (bf16 *)dkr, ws, B, T, H, dn, dr, dv, scale, c->stream, !c->attn_recompute_dq))
        return mt__fail(c, "attention backward (RoPE folded)", cudaGetLastError() != cudaSuccess ? "a launch failed"
                                                                                               : "misaligned tensors or no TMA tensor-map encoder");
    return 0;
}

/* Document starts (see mt_cpu_doc_starts): one block per sequence; each thread takes a chunk of
   positions, the position after the chunk's last end-of-text token is max-scanned across the
   block, then each chunk is walked again from its prefix. Integer max: order-free. */
__global__ void k_doc_starts(int32_t *ds, const int32_t *tok, int T, int eot) {
    __shared__ int part[1024];
    const size_t s0 = (size_t)blockIdx.x * T;
    const int tid = threadIdx.x, nt = blockDim.x, chunk = (T + nt - 1) / nt;
    const int t0 = min(tid * chunk, T), t1 = min(t0 + chunk, T);
    int m = 0;
    for (int t = t0; t < t1; t++) if (tok[s0 + t] == eot) m = t + 1;
    part[tid] = m;
    __syncthreads();
    for (int off = 1; off < nt; off <<= 1) {   /* inclusive max-scan */
        const int v = tid >= off ? part[tid - off] : 0;
        __syncthreads();
        part[tid] = max(part[tid], v);
        __syncthreads();
    }
    int start = tid ? part[tid - 1] : 0;
    for (int t = t0; t < t1; t++) {
        ds[s0 + t] = start;
        if (tok[s0 + t] == eot) start = t + 1;
    }
}
int mt_cuda_doc_starts(mt_cuda *c, int32_t *dstart, const int32_t *tok, int N, int T, int eot) {
    if (N <= 0) return 0;
    if (T <= 0 || N % T) return mt__fail(c, "doc starts", "token count is not a multiple of seq_len");
    k_doc_starts<<<N / T, 1024, 0, c->stream>>>(dstart, tok, T, eot);
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
/* R = experts per lane (compile time, so the arrays stay in registers). One warp per token, a block's
 * warps striding over the tokens; the expert counts add up in shared memory (integers: any order), one
 * global add per expert a block. Round k's choice stays with lane k % 32 (slot k / 32) until the sum of
 * the chosen scores is known, and the lanes write idx and w together. */
template <int R>
__global__ void __launch_bounds__(256) k_router_fwd(int32_t *idx, float *w, float *scores, int32_t *counts, const float *logits,
                                                    const float *bias, int N, int E, int K, int score_func, int route_norm,
                                                    float route_scale, int G, int Gl) {
    __shared__ int cnt[MT_ROUTER_MAXE];
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int n = blockIdx.x * nw + (threadIdx.x >> 5); n < N; n += gridDim.x * nw) {
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
        float sum = 0, myraw[2] = {0, 0};
        int myidx[2] = {0, 0};
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
            if (lane == (k & 31)) { myraw[k >> 5] = raw; myidx[k >> 5] = bi; atomicAdd(&cnt[bi], 1); }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int k = lane + 32 * h;
            if (k >= K) break;
            float x = myraw[h];
            if (route_norm) x = x / (sum + 1e-20f);
            idx[(int64_t)n * K + k] = myidx[h];
            w[(int64_t)n * K + k] = x * route_scale;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        if (cnt[e]) atomicAdd(&counts[e], cnt[e]);
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
    unsigned g = mt__blocks(N, 8);
    if (g > 512) g = 512;   /* a few tokens a warp: fewer global adds to the counts */
#define MT__ROUTE(R) k_router_fwd<R><<<g, 256, 0, c->stream>>>(idx, w, scores, counts, logits, bias, N, E, K, score_func, route_norm, \
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
#define MT_HIST_SMEM 8192   /* experts counted in shared memory first (one global add per expert a block) */
__global__ void k_hist(int32_t *cnt, int32_t *iota, const int32_t *idx, int64_t NK, int E, int *flag) {
    extern __shared__ int hs[];   /* E counts, when E <= MT_HIST_SMEM */
    const bool sm = E <= MT_HIST_SMEM;
    if (sm) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) hs[e] = 0;
        __syncthreads();
    }
    for (int64_t a = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; a < NK; a += (int64_t)gridDim.x * blockDim.x) {
        iota[a] = (int32_t)a;   /* the sort's values */
        int e = idx[a];
        if (e < 0 || e >= E) { atomicExch(flag, 1); continue; }
        atomicAdd(sm ? &hs[e] : &cnt[e], 1);
    }
    if (sm) {
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (hs[e]) atomicAdd(&cnt[e], hs[e]);
    }
}
__global__ void k_offsets(int32_t *offs, const int32_t *cnt, int E) {
    if (threadIdx.x || blockIdx.x) return;
    offs[0] = 0;
    for (int e = 0; e < E; e++) offs[e + 1] = offs[e] + cnt[e];   /* cnt aliases offs + 1: read before write */
}
}  /* extern "C": the row kernels are templates */
/* chunks of 8 elements per lane per group: a group's loads are independent, and are all issued before its stores.
   The row kernels take the group's chunks U as a template argument: 1 for rows up to 256 wide, 2 up to 512, else
   MT_ROWS_UNROLL (fewer registers for narrow rows, so more rows in flight; the same operations in the same order) */
#define MT_ROWS_UNROLL 8
#define MT__ROWS_DISPATCH(L, v) do {                                                                  \
        if (D <= 256) { if (v) L(true, 1); else L(false, 1); }                                      \
        else if (D <= 512) { if (v) L(true, 2); else L(false, 2); }                                 \
        else { if (v) L(true, MT_ROWS_UNROLL); else L(false, MT_ROWS_UNROLL); }                     \
    } while (0)
/* row i of xs is assignment perm[i]: its token's row of x; slot is the inverse. One warp per row, 16-byte chunks. */
template <bool V, int U>
__global__ void __launch_bounds__(256) k_gather_rows(bf16 *xs, int32_t *slot, const bf16 *x, const int32_t *perm, int64_t NK, int K, int D) {
    int64_t i = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (i >= NK) return;
    int64_t a = perm[i];
    if (lane == 0) slot[a] = (int32_t)i;
    const bf16 *src = x + (a / K) * D;
    bf16 *dst = xs + i * D;
    for (int base = 0; base < D; base += 256 * U) {   /* all loads of a group, then its stores */
        uint4 u[U];
#pragma unroll
        for (int k = 0; k < U; k++) {
            int d = base + (lane + 32 * k) * 8;
            if (d < D) u[k] = ld8<V>(src, d, D);
        }
#pragma unroll
        for (int k = 0; k < U; k++) {
            int d = base + (lane + 32 * k) * 8;
            if (d < D) st8raw<V>(dst, d, D, u[k]);
        }
    }
}
/* y[n] = sum over k, in order, of w[n, k] * ys[slot[n, k]]; one warp per token.  w NULL: weights of 1
   (the permutation's backward, dx[n] = sum over k of dxs[slot[n, k]]; 1 * f is exact, so the sums are
   those of plain adds) */
template <bool V, int U>
__global__ void __launch_bounds__(256) k_combine(bf16 *y, const bf16 *ys, const int32_t *slot, const float *w, int N, int D, int K) {
    int64_t n = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (n >= N) return;
    for (int base = 0; base < D; base += 256 * U) {
        float acc[U][8];
#pragma unroll
        for (int i = 0; i < U; i++)
#pragma unroll
            for (int j = 0; j < 8; j++) acc[i][j] = 0;
        for (int k = 0; k < K; k++) {
            const bf16 *src = ys + (int64_t)slot[n * K + k] * D;
            const float wk = w ? w[n * K + k] : 1.f;
#pragma unroll
            for (int i = 0; i < U; i++) {
                int d = base + (lane + 32 * i) * 8;
                if (d < D) {
                    float f[8];
                    unpack8(f, ld8<V>(src, d, D));
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[i][j] += wk * f[j];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < U; i++) {
            int d = base + (lane + 32 * i) * 8;
            if (d < D) st8<V>(y + n * D, d, D, acc[i]);
        }
    }
}
/* dys[slot[n, k]] = w[n, k] dy[n]; dw[n, k] = <dy[n], ys[slot[n, k]]> (each lane sums its chunks in order, then a
 * fixed butterfly across the warp). One warp per token; dy's first chunks stay in registers across k. dys NULL: dw
 * alone (dys's FP8 forms are made from dy and w by mt_cuda_moe_combine_backward_fp8). */
template <bool V, int U>
__global__ void __launch_bounds__(128) k_combine_bwd(bf16 *dys, float *dw, const bf16 *dy, const bf16 *ys, const int32_t *slot, const float *w,
                                                     int N, int D, int K) {
    int64_t n = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (n >= N) return;
    const bf16 *g = dy + n * D;
    uint4 cg[U];
#pragma unroll
    for (int i = 0; i < U; i++) {
        int d = (lane + 32 * i) * 8;
        if (d < D) cg[i] = ld8<V>(g, d, D);
    }
    for (int k = 0; k < K; k++) {
        int64_t s = slot[n * K + k];
        float wk = w[n * K + k], part = 0;
        const bf16 *src = ys + s * D;
        bf16 *dst = dys + s * D;
        uint4 cy[U];
#pragma unroll
        for (int i = 0; i < U; i++) {
            int d = (lane + 32 * i) * 8;
            if (d < D) cy[i] = ld8<V>(src, d, D);
        }
#pragma unroll
        for (int i = 0; i < U; i++) {
            int d = (lane + 32 * i) * 8;
            if (d < D) {
                float gf[8], yf[8];
                unpack8(gf, cg[i]);
                unpack8(yf, cy[i]);
#pragma unroll
                for (int j = 0; j < 8; j++) { part += gf[j] * yf[j]; gf[j] *= wk; }
                if (dys) st8<V>(dst, d, D, gf);
            }
        }
        for (int d = (lane + 32 * U) * 8; d < D; d += 256) {
            float gf[8], yf[8];
            unpack8(gf, ld8<V>(g, d, D));
            unpack8(yf, ld8<V>(src, d, D));
#pragma unroll
            for (int j = 0; j < 8; j++) { part += gf[j] * yf[j]; gf[j] *= wk; }
            if (dys) st8<V>(dst, d, D, gf);
        }
        part = warp_sum(part);
        if (lane == 0) dw[n * K + k] = part;
    }
}
extern "C" {
size_t mt_cuda_moe_permute_workspace(int64_t NK) {
    size_t tmp = 0;
    cub::DeviceRadixSort::SortPairs(NULL, tmp, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL, (int32_t *)NULL, (int)NK);
    return mt__al(tmp) + 3 * mt__al((size_t)NK * 4);
}
/* the permutation's order: the experts' counts and offsets, and perm (in ws) the assignments sorted by expert, stable */
static int moe_sort(mt_cuda *c, int32_t *offs, const int32_t *idx, int64_t NK, int E, void *ws, int32_t **perm_out) {
    int32_t *cnt = offs + 1;
    CK(cudaMemsetAsync(offs, 0, (size_t)(E + 1) * 4, c->stream));
    *perm_out = NULL;
    if (NK <= 0) return 0;
    size_t tmp = 0;
    cub::DeviceRadixSort::SortPairs(NULL, tmp, (const int32_t *)NULL, (int32_t *)NULL, (const int32_t *)NULL, (int32_t *)NULL, (int)NK);
    char *w = (char *)ws;
    int32_t *iota = (int32_t *)(w + mt__al(tmp)), *keys = iota + mt__al((size_t)NK * 4) / 4, *perm = keys + mt__al((size_t)NK * 4) / 4;
    unsigned g = mt__blocks(NK, 256);
    if (g > 4096) g = 4096;
    if (g > 512) g = 512;
    k_hist<<<g, 256, E <= MT_HIST_SMEM ? (size_t)E * 4 : 0, c->stream>>>(cnt, iota, idx, NK, E, c->flag);
    LAUNCHED();
    k_offsets<<<1, 1, 0, c->stream>>>(offs, cnt, E);
    LAUNCHED();
    int bits = 1;
    while ((1 << bits) < E && bits < 31) bits++;
    CK(cub::DeviceRadixSort::SortPairs(w, tmp, idx, keys, iota, perm, (int)NK, 0, bits, c->stream));
    *perm_out = perm;
    return 0;
}
int mt_cuda_moe_permute(mt_cuda *c, void *xs, int32_t *slot, int32_t *offs, const void *x, const int32_t *idx, int N, int D,
                        int K, int E, void *ws) {
    int64_t NK = (int64_t)N * K;
    int32_t *perm;
    if (moe_sort(c, offs, idx, NK, E, ws, &perm)) return -1;
    if (NK <= 0) return 0;
#define MT__GATHER(V, U) k_gather_rows<V, U><<<mt__blocks(NK, 8), 256, 0, c->stream>>>((bf16 *)xs, slot, (const bf16 *)x, perm, NK, K, D)
    MT__ROWS_DISPATCH(MT__GATHER, mt__rows16(D, 2, xs, x));
#undef MT__GATHER
    LAUNCHED();
    return 0;
}
int mt_cuda_moe_permute_backward(mt_cuda *c, void *dx, const void *dxs, const int32_t *slot, int N, int D, int K) {
    if (N <= 0) return 0;
#define MT__COMB(V, U) k_combine<V, U><<<mt__blocks(N, 8), 256, 0, c->stream>>>((bf16 *)dx, (const bf16 *)dxs, slot, nullptr, N, D, K)
    MT__ROWS_DISPATCH(MT__COMB, mt__rows16(D, 2, dx, dxs));
#undef MT__COMB
    LAUNCHED();
    return 0;
}
int mt_cuda_moe_combine_forward(mt_cuda *c, void *y, const void *ys, const int32_t *slot, const float *w, int N, int D, int K) {
    if (N <= 0) return 0;
#define MT__COMB(V, U) k_combine<V, U><<<mt__blocks(N, 8), 256, 0, c->stream>>>((bf16 *)y, (const bf16 *)ys, slot, w, N, D, K)
    MT__ROWS_DISPATCH(MT__COMB, mt__rows16(D, 2, y, ys));
#undef MT__COMB
    LAUNCHED();
    return 0;
}
int mt_cuda_moe_combine_backward(mt_cuda *c, void *dys, float *dw, const void *dy, const void *ys, const int32_t *slot,
                                 const float *w, int N, int D, int K) {
    if (N <= 0) return 0;
#define MT__COMB(V, U) k_combine_bwd<V, U><<<mt__blocks(N, 4), 128, 0, c->stream>>>((bf16 *)dys, dw, (const bf16 *)dy, (const bf16 *)ys, slot, w, N, D, K)
    MT__ROWS_DISPATCH(MT__COMB, mt__rows16(D, 2, dys, dy, ys));
#undef MT__COMB
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

/* --- grouped GEMM on the device -------------------------------------------
 *
 * E experts; expert e owns rows [offs[e], offs[e+1]) of the token dimension, offs (int32, E+1
 * entries) lives in DEVICE memory and is never read by the host (no host synchronization; the
 * launch is CUDA-graph capturable: the grid depends only on E, M, K, Rmax and the SM count).
 *   mode 0 (forward):  Y [r, m]     = sum_k X [r, k] * W[e, m, k]      bf16 out
 *   mode 1 (grad in):  dX[r, k]     = sum_m dY[r, m] * W[e, m, k]      bf16 out
 *   mode 2 (grad W):   dW[e, m, k]  = sum_{r in e} dY[r, m] * X[r, k]  fp32 out (empty expert: zeros)
 * bf16 inputs, fp32 accumulation, row-major, M and K multiples of 8, 16-byte aligned pointers.
 *
 * Design
 *   Two kernels share the tiles, stage layouts, wgmma batches, schedule and reduction order below,
 *   and give bitwise the same results:
 *     gg_tma_kernel (the default for modes 0/1): a producer warp loads the stages with the copy
 *       engine (TMA, mbarriers) while two consumer warpgroups only multiply and store (see its own
 *       comment); on H200, on mid's expert shapes, 600-700 TFLOP/s forward and dX;
 *     gg_kernel (drivers without tensor maps: the same tiles through cp.async): described here.
 *   Mode 2 without row splits (the default dW) runs gg_pp_kernel: the same TMA producer, but each
 *   consumer warpgroup owns whole 128 x 192 tiles and the two take turns at the tensor cores, so one
 *   stores while the other multiplies; bitwise the same dW (see its comment).
 *   One persistent kernel per mode, 256 threads (2 warpgroups), one CTA per SM (~207 KB smem).
 *   CTA tile 128 x 256 (BM x BN) of the output, reduction in steps of 64 (BK); operands are staged
 *   by cp.async (zero-filled outside the valid rows / columns) into a 4-stage ring of 128-byte
 *   swizzled tiles (48 KB per stage), prefetch distance 2 steps.  The stage layouts are the
 *   canonical SW128 layouts of wgmma:
 *     K-major  tile [rows][64]:  16-byte chunk c of row r at  r*128 + ((c ^ (r&7)) << 4)
 *     MN-major tile [64][cols]:  64-column block j at j*8192, row r at r*128, chunk c of the block
 *                                at ((c ^ (r&7)) << 4)                       (LBO 8192, SBO 1024)
 *   operand majorness:   mode 0: A = X  K-major,  B = W   K-major
 *                        mode 1: A = dY K-major,  B = W   MN-major (transposed)
 *                        mode 2: A = dY MN-major, B = X   MN-major  (reduction over the rows)
 *   Math (default): wgmma.mma_async m64n256k16 (m64n128k16 for tiles with <= 128 valid columns),
 *   warpgroup g owns tile rows [64g, 64g+64); one wgmma batch (4 x k16) stays in flight across the
 *   barrier of the next step.
 *   Scheduling: work items ("tiles") form a linear list derived on the device from offs:
 *     modes 0/1: (expert, 128-row tile, 256-col tile), experts in order, per-expert row-tile counts
 *                prefix-summed in smem at kernel start, tile -> expert by binary search;
 *     mode 2:    (expert, row split s, 128-m tile, 256-k tile), experts sorted by row count,
 *                largest first (bitonic sort in smem), so the list ends with cheap tiles; the
 *                reduction walks the expert's rows in order (ragged tail zero-filled); experts
 *                without rows get zero tiles.  When E*ceil(M/128)*ceil(K/256) < #SMs the rows of
 *                each expert are split into S fixed chunks (S from E, M, K, Rmax, #SMs only),
 *                partial tiles go to the workspace and a second kernel sums them in order s=0..S-1.
 *   Wide tiles (TMA kernel): when the last column tile has <= 128 valid columns (mid's 1408 = 5.5 x
   256), its rows go in pairs of row tiles (modes 0/1: 256 token rows; mode 2: 256 m) as one 256 x 128
   tile in the same 48 KB stages, computed as D^T = B^T A^T with the same m64n256k16 products (bitwise
   the results of 128 x 128 tiles): a 128 x 128 tile reads as many bytes per step for half the work.
   (Figures: docs/KERNELS.md.)
   Every mode: CTA b takes one tile of each round of gridDim tiles, in serpentine order (b in even
 *   rounds, gridDim - 1 - b in odd ones; mode 2's list is sorted largest expert first, and the
 *   serpentine balances the unequal tiles: on mid's shapes with the largest expert at 5 to 7
 *   times the mean, the busiest CTA gets 1-2% more steps than the mean, and the bench's layout
 *   with the largest expert at 6.1 times the mean runs as fast as the one at 5.0). The id of the tile after next is
 *   published through a small smem ring, so the loads of the next tile are issued while the
 *   current one finishes (the cp.async pipeline runs across tile boundaries).
 * Determinism: every output element is produced by one thread of one CTA with a fixed reduction
 *   order (and, for S > 1, a fixed-order second pass), and the schedule is static. Results are
 *   bitwise reproducible.
 * ------------------------------------------------------------------------ */
}  /* extern "C": the grouped GEMM kernels are templates */

namespace mt_ggk {
using namespace mt_ptx;

typedef __nv_bfloat16 bf16;

constexpr int BM = 128;                        /* tile rows                                  */
constexpr int BN = 256;                        /* tile columns                               */
constexpr int BK = 64;                         /* reduction per step (one 128-byte row)      */
constexpr int ST = 4;                          /* smem stages                                */
constexpr int PD = 2;                          /* prefetch distance in steps (<= ST - 2)     */
constexpr int NT = 256;                        /* threads per CTA                            */
constexpr int A_BYTES = BM * BK * 2;           /* 16 KB                                      */
constexpr int B_BYTES = BN * BK * 2;           /* 32 KB                                      */
constexpr int STAGE_BYTES = A_BYTES + B_BYTES; /* 48 KB                                      */
constexpr int MAX_E = 1024;
constexpr int RING = 8;                        /* tile-id ring (power of two)                */
constexpr int MISC_INTS = 2 * (MAX_E + 1) + NT + RING + 8;
constexpr size_t SMEM_BYTES = 1024 + (size_t)ST * STAGE_BYTES + (size_t)MISC_INTS * sizeof(int);
constexpr size_t WS_HEADER = 256;              /* reserved bytes before the partial tiles in ws */
static_assert(PD <= ST - 2, "a stage may still be read by the wgmma batch in flight");

/* ------------------------------------------------------------------------------------------ */
/* PTX helpers                                                                                */
/* ------------------------------------------------------------------------------------------ */
/* (cp.async, ldmatrix and shared-address helpers: namespace mt_ptx) */
/* named barrier over nthreads threads (multiple of 32) */
__device__ __forceinline__ void bar_sync_named(int id, int nthreads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}
/* keeps the compiler from moving accumulator accesses across the asynchronous wgmma window */
__device__ __forceinline__ void fence_acc(float &r) { asm volatile("" : "+f"(r)::"memory"); }
/* D[64 x N] = A(desc) * B(desc) + (scale_d ? D : 0); TA/TB = 1: operand is MN-major (transposed) in smem.
   Accumulator layout (per warp w of the warpgroup, lane = 4g + c): d[4j + 2h + b] =
   D[16w + g + 8h][8j + 2c + b].  m64n128k16 uses d[0..63] only. */
template <int TA, int TB>
__device__ __forceinline__ void wgmma_n256(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "
        "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, "
        "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, "
        "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]),
          "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
          "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]),
          "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]),
          "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
template <int TA, int TB>
__device__ __forceinline__ void wgmma_n128(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {   /* d[0..63] */
    wgmma_ss_n128<TA, TB>(*reinterpret_cast<float (*)[64]>(&d[0]), da, db, scale_d);
}
template <int TA, int TB>
__device__ __forceinline__ void wgmma_n8(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3"
        "}, %4, %5, p, 1, 1, %7, %8;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
/* ------------------------------------------------------------------------------------------ */
/* end of PTX helpers                                                                         */
/* ------------------------------------------------------------------------------------------ */


struct Params {
    void *out;           /* Y / dX (bf16) or dW (fp32)                                        */
    const bf16 *a;       /* X (mode 0) or dY (modes 1, 2)                                     */
    const bf16 *b;       /* W (modes 0, 1) or X (mode 2)                                      */
    const int *offs;     /* [E + 1], device                                                   */
    float *part;         /* mode 2: [S][E][M][K] partials when S > 1, else == out             */
    const bf16 *a2, *b2; /* mode 1, optional second pair: dX = dY W + dY2 W2, one reduction loop  */
    int nkh;             /* mode 1 with a second pair: steps per pair (nk01 = 2 nkh)           */
    float *ssq;          /* mode 2, optional: partial sums of dW^2, [tile * 8 + warp] (S == 1) */
    int ssq_z0, ssq_z1;  /* gg_pp_kernel: the entries [z0, z1) of ssq that no tile writes, zeroed by the kernel */
    void *out2, *out3;   /* gate/up in one launch (gg_run_glu): out = g, out2 = u, out3 = silu(g) u (optional) */
    int E, M, K, Rmax;
    int ncols;           /* output columns: M (mode 0), K (modes 1, 2)                        */
    int ct;              /* column tiles ceil(ncols / BN)                                     */
    int nk01;            /* modes 0/1: reduction steps ceil(K / BK) or ceil(M / BK)            */
    int S, ntm;          /* mode 2: row splits, m tiles ceil(M / BM)                           */
    int T2;              /* mode 2: number of tiles E * S * (ntm * ctf + half * ceil(ntm / 2))   */
    int pair;            /* gg_pp_kernel's tile pairs: always 0 (pairs served clusters of 2, measured and not
                            kept: docs/KERNELS.md; the decode still reads it, as the measured kernel did) */
    int half, ctf;       /* half = 1: the last column tile has <= 128 columns and pairs its rows   */
                         /* into 256 x 128 tiles (TMA kernel); ctf = ct - half full-width tiles    */
};

struct Tile {
    int valid, e, nk;
    int wide;   /* 256 x 128 tile (two 128-row tiles of the last, half-wide column tile)          */
    int t;      /* the tile's index in the work list                                              */
    int r0, r1; /* modes 0/1: output rows [r0, r1), r1 <= r0 + BM; mode 2: reduction rows [r0, r1) */
    int m0;     /* mode 2: first output row (m)                                                   */
    int c0;     /* first output column                                                            */
    int s;      /* mode 2: split index                                                            */
};

template <int MODE>
__device__ __forceinline__ Tile decode_tile(const Params &p, const int *s_offs, const int *s_aux, int T, int t) {
    Tile ti;
    ti.valid = (t >= 0 && t < T) ? 1 : 0;
    ti.t = t;
    ti.e = 0; ti.nk = 0; ti.r0 = 0; ti.r1 = 0; ti.m0 = 0; ti.c0 = 0; ti.s = 0; ti.wide = 0;
    if (!ti.valid) return ti;
    if (MODE != 2) {
        /* largest e with pref[e] <= t (pref non-decreasing, pref[0] = 0) */
        int lo = 0, hi = p.E - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_aux[mid] <= t) lo = mid; else hi = mid - 1;
        }
        const int local = t - s_aux[lo];
        const int nrt = (s_offs[lo + 1] - s_offs[lo] + BM - 1) / BM;
        ti.e = lo;
        if (local < nrt * p.ctf) {
            const int rt = local / p.ctf, cti = local - rt * p.ctf;
            ti.r0 = s_offs[lo] + rt * BM;
            ti.r1 = min(ti.r0 + BM, s_offs[lo + 1]);
            ti.c0 = cti * BN;
        } else { /* the half-wide last column: rows in pairs of row tiles */
            ti.r0 = s_offs[lo] + (local - nrt * p.ctf) * 2 * BM;
            ti.r1 = min(ti.r0 + 2 * BM, s_offs[lo + 1]);
            ti.c0 = p.ctf * BN;
            ti.wide = ti.r1 - ti.r0 > BM;
        }
        ti.nk = p.nk01;
    } else {
        const int per_s = p.ntm * p.ctf + p.half * ((p.ntm + 1) >> 1), per_e = p.S * per_s;
        const int pos = t / per_e;
        int rem = t - pos * per_e;
        const int s = rem / per_s;
        rem -= s * per_s;
        if (rem < p.ntm * p.ctf) {
            const int mt = rem / p.ctf, kt = rem - mt * p.ctf;
            ti.m0 = mt * BM;
            ti.c0 = kt * BN;
        } else { /* the half-wide last column: m in pairs of m tiles */
            ti.m0 = (rem - p.ntm * p.ctf) * 2 * BM;
            ti.c0 = p.ctf * BN;
            ti.wide = p.M - ti.m0 > BM;
        }
        const int e = (int)((unsigned)s_aux[pos] & (unsigned)(MAX_E - 1));
        const int beg = s_offs[e], n = max(0, s_offs[e + 1] - beg);
        ti.e = e;
        ti.s = s;
        if (p.S == 1) { /* no 64-bit divisions on the common path */
            ti.r0 = beg;
            ti.r1 = beg + n;
        } else {
            ti.r0 = beg + (int)(((long long)n * s) / p.S);
            ti.r1 = beg + (int)(((long long)n * (s + 1)) / p.S);
        }
        ti.nk = (ti.r1 - ti.r0 + BK - 1) / BK;
    }
    return ti;
}

/* Issue the cp.async of reduction step kt of tile ti into the stage at smem address sA. */
template <int MODE>
__device__ __forceinline__ void load_step(const Params &p, const Tile &ti, int kt, uint32_t sA, int tid) {
    const uint32_t sB = sA + A_BYTES;
    if (MODE == 0 || MODE == 1) {
        /* mode 1 with a second pair: steps [nkh, 2 nkh) reduce dY2 W2 into the same accumulators */
        const bf16 *pa = p.a, *pb = p.b;
        if (MODE == 1 && p.a2 && kt >= p.nkh) { pa = p.a2; pb = p.b2; kt -= p.nkh; }
        /* A: 128 token rows x 64 reduction columns, K-major; thread: chunk tid&7 of rows tid/8 + 32u */
        const int lda = (MODE == 0) ? p.K : p.M; /* X [R, K] or dY [R, M]; also the reduction extent */
        const int kc = kt * BK + (tid & 7) * 8;
        const bool kok = kc < lda;
        const int rl = tid >> 3;
        const uint32_t swz = (uint32_t)(((tid & 7) ^ (rl & 7)) << 4);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int r = ti.r0 + rl + 32 * u;
            const bool ok = kok && r < ti.r1;
            const bf16 *src = ok ? pa + (size_t)r * lda + kc : pa;
            cp_async_16(sA + (uint32_t)((rl + 32 * u) * 128) + swz, src, ok ? 16 : 0);
        }
        const bf16 *wb = pb + (size_t)ti.e * p.M * p.K;
        if (MODE == 0) {
            /* B: W[e] rows m = tile columns (256) x 64 k, K-major */
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int m = ti.c0 + rl + 32 * u;
                const bool ok = kok && m < p.M;
                const bf16 *src = ok ? wb + (size_t)m * p.K + kc : pb;
                cp_async_16(sB + (uint32_t)((rl + 32 * u) * 128) + swz, src, ok ? 16 : 0);
            }
        } else {
            /* B: W[e] rows m = reduction (64) x 256 k columns, MN-major; thread: chunk tid&31 of rows tid/32 + 8u */
            const int cc = tid & 31, rr = tid >> 5;
            const int col = ti.c0 + cc * 8;
            const bool cok = col < p.K;
            const uint32_t off = (uint32_t)((cc >> 3) * 8192 + rr * 128 + (((cc & 7) ^ (rr & 7)) << 4));
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int m = kt * BK + rr + 8 * u;
                const bool ok = cok && m < p.M;
                const bf16 *src = ok ? wb + (size_t)m * p.K + col : pb;
                cp_async_16(sB + off + (uint32_t)(u * 1024), src, ok ? 16 : 0);
            }
        }
    } else {
        const int rbase = ti.r0 + kt * BK;
        {
            /* A: dY rows r (64, reduction) x 128 m columns, MN-major; thread: chunk tid&15 of rows tid/16 + 16u */
            const int cc = tid & 15, rr = tid >> 4;
            const int col = ti.m0 + cc * 8;
            const bool cok = col < p.M;
            const uint32_t off = (uint32_t)((cc >> 3) * 8192 + rr * 128 + (((cc & 7) ^ (rr & 7)) << 4));
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int r = rbase + rr + 16 * u;
                const bool ok = cok && r < ti.r1;
                const bf16 *src = ok ? p.a + (size_t)r * p.M + col : p.a;
                cp_async_16(sA + off + (uint32_t)(u * 2048), src, ok ? 16 : 0);
            }
        }
        {
            /* B: X rows r (64) x 256 k columns, MN-major */
            const int cc = tid & 31, rr = tid >> 5;
            const int col = ti.c0 + cc * 8;
            const bool cok = col < p.K;
            const uint32_t off = (uint32_t)((cc >> 3) * 8192 + rr * 128 + (((cc & 7) ^ (rr & 7)) << 4));
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int r = rbase + rr + 8 * u;
                const bool ok = cok && r < ti.r1;
                const bf16 *src = ok ? p.b + (size_t)r * p.K + col : p.b;
                cp_async_16(sB + off + (uint32_t)(u * 1024), src, ok ? 16 : 0);
            }
        }
    }
}

template <int N>
__device__ __forceinline__ void fence_acc_all(float (&acc)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) fence_acc(acc[i]);
}

/* NKK k16 slices of one step as one wgmma batch (N256: m64n256k16, else m64n128k16) */
template <int TA, int TB, bool N256, int NKK>
__device__ __forceinline__ void wgmma_batch(float (&acc)[128], uint64_t da, uint64_t db, int sd0) {
    constexpr uint64_t DA = TA ? 128 : 2, DB = TB ? 128 : 2;
    wgmma_fence();
    if (N256) wgmma_n256<TA, TB>(acc, da, db, sd0);
    else wgmma_n128<TA, TB>(acc, da, db, sd0);
#pragma unroll
    for (int kk = 1; kk < NKK; ++kk) {
        if (N256) wgmma_n256<TA, TB>(acc, da + kk * DA, db + kk * DB, 1);
        else wgmma_n128<TA, TB>(acc, da + kk * DA, db + kk * DB, 1);
    }
    wgmma_commit();
}

/* One reduction step (BK = 64) with wgmma: warpgroup wg computes tile rows [64wg, 64wg + 64).
   SHORT: only the first nkk k16 slices (mode 2's last step of a tile: the rows that are left).
   SWAP (the TMA kernel's wide tiles: 256 rows x 128 columns, A's 256 rows then B's 128 columns in
   the stage): the transposed product D^T = B^T A^T, warpgroup wg computing tile columns [64wg,
   64wg + 64) over all 256 rows, so acc[4j + 2h + b] = D[8j + 2c + b][64wg + 16w + g + 8h] (see
   epilogue_wide).  The same m64n256k16 products; each output element sees the same k16 slices in
   the same order as in a 128 x 128 tile. */
template <int MODE, bool SHORT = false, bool SWAP = false>
__device__ __forceinline__ void step_wgmma(float (&acc)[128], uint32_t sA, int wg, bool active, bool full, bool first, int nkk = 4) {
    constexpr int TA0 = (MODE == 2) ? 1 : 0, TB0 = (MODE == 0) ? 0 : 1;
    constexpr int TA = SWAP ? TB0 : TA0, TB = SWAP ? TA0 : TB0;
    /* K-major: +32 bytes per k16; MN-major: +16 rows * 128 bytes = 2048 bytes (in 16-byte units) */
    constexpr uint64_t DA = TA ? 128 : 2, DB = TB ? 128 : 2;
    /* K-major rows of 128 bytes or MN-major 64-wide blocks of 8 KB: 64 j at 8 KB j either way */
    const uint32_t a_addr = SWAP ? sA + 2u * (uint32_t)A_BYTES + (uint32_t)wg * 8192u : sA + (uint32_t)wg * 8192u;
    const uint32_t b_addr = SWAP ? sA : sA + (uint32_t)A_BYTES;
    const uint64_t da = sw128_desc(a_addr, TA ? 8192u : 16u, 1024u);
    const uint64_t db = sw128_desc(b_addr, TB ? 8192u : 16u, 1024u);
    const int sd0 = first ? 0 : 1;
    fence_acc_all(acc);
    if (SHORT && active && nkk < BK / 16) {
        /* separate straight-line batches: a conditional wgmma inside a batch makes ptxas fence each one */
        if (full) {
            if (nkk == 1) wgmma_batch<TA, TB, true, 1>(acc, da, db, sd0);
            else if (nkk == 2) wgmma_batch<TA, TB, true, 2>(acc, da, db, sd0);
            else wgmma_batch<TA, TB, true, 3>(acc, da, db, sd0);
        } else {
            if (nkk == 1) wgmma_batch<TA, TB, false, 1>(acc, da, db, sd0);
            else if (nkk == 2) wgmma_batch<TA, TB, false, 2>(acc, da, db, sd0);
            else wgmma_batch<TA, TB, false, 3>(acc, da, db, sd0);
        }
    } else if (active && full) {
        wgmma_fence();
        wgmma_n256<TA, TB>(acc, da, db, sd0);
#pragma unroll
        for (int kk = 1; kk < BK / 16; ++kk) wgmma_n256<TA, TB>(acc, da + kk * DA, db + kk * DB, 1);
        wgmma_commit();
    } else if (active) {
        wgmma_fence();
        wgmma_n128<TA, TB>(acc, da, db, sd0);
#pragma unroll
        for (int kk = 1; kk < BK / 16; ++kk) wgmma_n128<TA, TB>(acc, da + kk * DA, db + kk * DB, 1);
        wgmma_commit();
    } else {
        /* all rows of this warpgroup are outside the tile: a token m64n8k16 whose result is never
           stored (issuing no wgmma at all on this path makes ptxas serialize every wgmma).  Its
           scale-d is 0, so ptxas takes acc[0..3] for dead before it and may build the descriptors
           in their registers while the previous step's token (left in flight by the caller's
           wait<1>) still writes them: seen as a descriptor of garbage and an out-of-bounds shared
           read under compute-sanitizer, illegal addresses without it.  So the token waits for
           the one before it first (this warpgroup has nothing else in flight). */
        wgmma_wait<0>();
        fence_acc_all(acc);
        wgmma_fence();
        wgmma_n8<0, 0>(acc, da, db, 0);
        wgmma_commit();
    }
    fence_acc_all(acc);
}

/* The gradient-norm partial of one warp's part of a dW tile: a fixed-order warp sum. */
__device__ __forceinline__ void store_ssq(const Params &p, const Tile &ti, int warp, int lane, float ss) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) p.ssq[(size_t)ti.t * 8 + warp] = ss;
}

/* wgmma kernels: the accumulators of each warp (16 rows x 256 columns) leave through a private
   shared-memory buffer of 16 rows x RB bytes, in passes of RB / ESZ columns (16-byte chunks
   XOR-swizzled by row: conflict-free), as 16-byte coalesced stores (RB / 16 lanes per row segment).
   The cp.async kernel uses 4 KB buffers (RB = 256: 128 bf16 or 64 fp32 columns a pass), the TMA
   kernel 2 KB ones (RB = 128).  The warp's rows start at tile row wrow.  Returns the sum of the
   squares of what it stored (mode 2), in a fixed order. */
/* TS (modes 0/1, RB 128, called for a warp whose 16 rows all lie in the tile's expert, not
   for the wide tiles; GLU has its own, epilogue_glu): each pass of 64 columns is written to the warp's 2 KB buffer as above
   (row r's 16-byte chunks XOR-swizzled by r mod 8, which is the TMA's 128-byte swizzle), then leaves as
   one TMA tensor store of 64 columns x 16 rows (tmap; columns past the tensor clipped), the warp going on while
   the copy engine drains it; the buffer is rewritten once the store before it has read it.  The same
   bytes as the staged stores (a slab holding an expert's last row goes that way: the rows past it are
   the next expert's).  epilogue_glu has the same TS path. */
/* GLU's TS: rows 8h..8h+7 of a warp's slab are the buffer's h-th KB (row r at r * 128), so a pass
   leaves as two boxes of 64 columns x 8 rows, and the warp writes one half while the store of the
   other still reads it: before writing half h it waits only until the one store after half h's last
   (the other half's) may still be reading (wait_group.read 1).  Modes 0/1 keep one 64 x 16 box a pass
   (the halves measured mixed there). */
/* the TS steps of epilogue_staged and epilogue_glu: wait before writing the buffer, then store from it */
__device__ __forceinline__ void ts_wait(int lane, bool half) {
    if (lane == 0) {
        if (half) bulk_wait_read1();
        else bulk_wait_read0();
    }
    __syncwarp();
}
__device__ __forceinline__ void ts_issue(int lane, const CUtensorMap *map, const unsigned char *src, int c0, int r0) {
    fence_proxy_async();
    __syncwarp();
    if (lane == 0) {
        tma_store_2d(map, smem_u32(src), c0, r0);
        bulk_commit();
    }
}
template <int MODE, int RB, bool TS = false>
__device__ __forceinline__ float epilogue_staged(const Params &p, const float (&acc)[128], const Tile &ti, int wrow, int lane,
                                                 int rows_valid, int cols_valid, unsigned char *buf,
                                                 const CUtensorMap *tmap = nullptr) {
    static_assert(!TS || (MODE != 2 && RB == 128), "TMA stores: modes 0/1 through 2 KB buffers");
    constexpr int ESZ = (MODE == 2) ? 4 : 2;                /* output element bytes                        */
    constexpr int JB = RB / (8 * ESZ);                      /* n8 column blocks per pass                   */
    constexpr int NP = 32 / JB;                             /* passes                                      */
    constexpr int SW = (RB == 256 && ESZ == 4) ? 1 : 0;     /* swizzle shift (fp32 lanes write 8 bytes)    */
    constexpr int CH = RB / 16, LG = CH == 16 ? 4 : 3;      /* 16-byte chunks per row = lanes per row; log2 */
    static_assert(RB == 128 || RB == 256, "row buffers of 128 or 256 bytes");
    const int g = lane >> 2, c = lane & 3;
    /* no reduction steps (mode 2, an expert without rows): the accumulators were never written -> zeros;
       modes 0/1 always take at least one step (K, M >= 8), so no select per value there */
    const bool has = MODE != 2 || ti.nk > 0;
    float ss = 0.f;
    char *obase;
    size_t ld;
    if (MODE == 2) {
        obase = reinterpret_cast<char *>(p.part + ((size_t)(ti.s * p.E + ti.e) * p.M + ti.m0) * p.K + ti.c0);
        ld = (size_t)p.K * 4;
    } else {
        obase = reinterpret_cast<char *>(reinterpret_cast<bf16 *>(p.out) + (size_t)ti.r0 * p.ncols + ti.c0);
        ld = (size_t)p.ncols * 2;
    }
#pragma unroll
    for (int pass = 0; pass < NP; ++pass) {
        if (pass * JB * 8 >= cols_valid) break; /* tile-uniform */
        if (TS) ts_wait(lane, false); /* the buffer's last store has read it */
#pragma unroll
        for (int jj = 0; jj < JB; ++jj) {
            const int j = pass * JB + jj;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = g + 8 * h;
                const float v0 = has ? acc[4 * j + 2 * h] : 0.f, v1 = has ? acc[4 * j + 2 * h + 1] : 0.f;
                const int byte = (8 * jj + 2 * c) * ESZ;
                const int off = r * RB + ((((byte >> 4) ^ ((r & 7) << SW))) << 4) + (byte & 15);
                if (ESZ == 2) {
                    *reinterpret_cast<__nv_bfloat162 *>(buf + off) = __floats2bfloat162_rn(v0, v1);
                } else {
                    *reinterpret_cast<float2 *>(buf + off) = make_float2(v0, v1);
                    if (wrow + r < rows_valid && pass * JB * 8 + 8 * jj + 2 * c < cols_valid) ss += v0 * v0 + v1 * v1;
                }
            }
        }
        if (TS) {
            ts_issue(lane, tmap, buf, ti.c0 + pass * JB * 8, ti.r0 + wrow);
            continue;
        }
        __syncwarp();
#pragma unroll
        for (int it = 0; it < CH / 2; ++it) {
            const int r = (32 / CH) * it + (lane >> LG), ch = lane & (CH - 1);
            const uint4 v = *reinterpret_cast<const uint4 *>(buf + r * RB + ((ch ^ ((r & 7) << SW)) << 4));
            const int row = wrow + r, col = pass * JB * 8 + ch * (16 / ESZ);
            if (row < rows_valid && col < cols_valid)
                *reinterpret_cast<uint4 *>(obase + (size_t)row * ld + (size_t)col * ESZ) = v;
        }
        __syncwarp();
    }
    return ss;
}

/* The TMA kernel's wide tiles (see step_wgmma with SWAP): warp w holds the tile's columns
   [16w, 16w + 16) of all 256 rows, acc[4j + 2h + b] at row 8j + 2c + b, column 16w + g + 8h.  They
   leave through the warp's 2 KB buffer in passes of 2048 / (16 ESZ) rows (row r's 16-byte chunks
   XOR-swizzled by (r / 2) mod the chunks of a row: at most two lanes on a bank when written), as
   16-byte stores (64 or 32 contiguous bytes a row).  Returns the sum of the squares it stored
   (mode 2). */
template <int MODE>
__device__ __forceinline__ float epilogue_wide(const Params &p, const float (&acc)[128], const Tile &ti, int warp, int lane,
                                               int rows_valid, int cols_valid, unsigned char *buf) {
    constexpr int ESZ = (MODE == 2) ? 4 : 2;  /* output element bytes                         */
    constexpr int RW = 16 * ESZ;              /* bytes of a buffer row: the warp's 16 columns */
    constexpr int RP = 2048 / RW;             /* rows per pass (32 or 64)                     */
    constexpr int JP = RP / 8;                /* n8 blocks of acc per pass                    */
    constexpr int CPR = RW / 16;              /* 16-byte chunks per row (4 or 2)              */
    const int g = lane >> 2, c = lane & 3, col0 = 16 * warp;
    float ss = 0.f;
    if (col0 >= cols_valid) return ss; /* warp-uniform */
    const bool has = MODE != 2 || ti.nk > 0; /* as in epilogue_staged */
    char *obase;
    size_t ld;
    if (MODE == 2) {
        obase = reinterpret_cast<char *>(p.part + ((size_t)(ti.s * p.E + ti.e) * p.M + ti.m0) * p.K + ti.c0 + col0);
        ld = (size_t)p.K * 4;
    } else {
        obase = reinterpret_cast<char *>(reinterpret_cast<bf16 *>(p.out) + (size_t)ti.r0 * p.ncols + ti.c0 + col0);
        ld = (size_t)p.ncols * 2;
    }
#pragma unroll
    for (int pass = 0; pass < 32 / JP; ++pass) {
        if (pass * RP >= rows_valid) break; /* tile-uniform */
#pragma unroll
        for (int jj = 0; jj < JP; ++jj) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const int r = 8 * jj + 2 * c + b, cl = g + 8 * h;
                    const float v = has ? acc[4 * (pass * JP + jj) + 2 * h + b] : 0.f;
                    const int byte = cl * ESZ;
                    const int off = r * RW + ((((byte >> 4) ^ ((r >> 1) & (CPR - 1)))) << 4) + (byte & 15);
                    if (ESZ == 4) {
                        *reinterpret_cast<float *>(buf + off) = v;
                        if (pass * RP + r < rows_valid && col0 + cl < cols_valid) ss += v * v;
                    } else {
                        *reinterpret_cast<bf16 *>(buf + off) = __float2bfloat16_rn(v);
                    }
                }
            }
        }
        __syncwarp();
#pragma unroll
        for (int it = 0; it < 4; ++it) {
            const int idx = 32 * it + lane, r = idx / CPR, ch = idx % CPR;
            const uint4 v = *reinterpret_cast<const uint4 *>(buf + r * RW + ((ch ^ ((r >> 1) & (CPR - 1))) << 4));
            const int row = pass * RP + r, col = ch * (16 / ESZ);
            if (row < rows_valid && col0 + col < cols_valid)
                *reinterpret_cast<uint4 *>(obase + (size_t)row * ld + (size_t)col * ESZ) = v;
        }
        __syncwarp();
    }
    return ss;
}

/* Gate and up in one launch (gg_run_glu): tile columns [0, 128) are g's columns [c0 / 2, c0 / 2 + 128),
   [128, 256) u's same columns, so a thread holds g and u of the same elements (acc[4j + 2h + b] and
   acc[4 (j + 16) + 2h + b]).  Six passes of 64 columns through the warp's 2 KB buffer, as
   epilogue_staged<0, 128> stores: g's two, u's two, then h = silu(g) u's two (out3, when given),
   each from the bf16-rounded g and u as k_swiglu computes it: the same bits as the two GEMMs and
   the SwiGLU apart.  h's sigmoid (ex2 and rcp on the MUFU pipe) costs ~2K cycles of a ~34K-cycle
   tile with the tensor cores idle (docs/KERNELS.md). */
__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
/* TS: as epilogue_staged's TS, each pass's boxes leave as TMA stores through the map of their output
   (g, u or h; [Rmax][M], columns past M clipped); slabs holding an expert's last row stay staged.  The
   same bytes, and one store path across the three bf16 epilogues. */
template <bool TS = false>
__device__ __forceinline__ void epilogue_glu(const Params &p, const float (&acc)[128], const Tile &ti, int wrow, int lane,
                                             int rows_valid, unsigned char *buf, const CUtensorMap *tm0 = nullptr,
                                             const CUtensorMap *tm1 = nullptr, const CUtensorMap *tm2 = nullptr) {
    const int g = lane >> 2, c = lane & 3, c0h = ti.c0 >> 1, hv = min(128, p.M - c0h);
    const size_t ld = (size_t)p.M * 2, o0 = ((size_t)ti.r0 * p.M + c0h) * 2;
    char *base[3] = {reinterpret_cast<char *>(p.out) + o0, reinterpret_cast<char *>(p.out2) + o0,
                     p.out3 ? reinterpret_cast<char *>(p.out3) + o0 : nullptr};
#pragma unroll
    for (int pass = 0; pass < 6; ++pass) {
        const int half = pass & 1, which = pass >> 1;
        if (which == 2 && !p.out3) break;
        if (64 * half >= hv) continue; /* tile-uniform */
        /* TS: each half (rows 8h..8h+7, the buffer's h-th KB) is a box of its own */
        const CUtensorMap *map = which == 0 ? tm0 : which == 1 ? tm1 : tm2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (TS) ts_wait(lane, true);
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                const int j = 8 * half + jj, r = g + 8 * h, i = 4 * j + 2 * h, byte = (8 * jj + 2 * c) * 2;
                __nv_bfloat162 v;
                if (which == 0) v = __floats2bfloat162_rn(acc[i], acc[i + 1]);
                else if (which == 1) v = __floats2bfloat162_rn(acc[i + 64], acc[i + 65]);
                else v = __floats2bfloat162_rn(swiglu1(bf16_round(acc[i]), bf16_round(acc[i + 64])),
                                               swiglu1(bf16_round(acc[i + 1]), bf16_round(acc[i + 65])));
                *reinterpret_cast<__nv_bfloat162 *>(buf + r * 128 + ((((byte >> 4) ^ (r & 7))) << 4) + (byte & 15)) = v;
            }
            if (TS) ts_issue(lane, map, buf + 1024 * h, c0h + 64 * half, ti.r0 + wrow + 8 * h);
        }
        if (TS) continue;
        __syncwarp();
#pragma unroll
        for (int it = 0; it < 4; ++it) {
            const int r = 4 * it + (lane >> 3), ch = lane & 7;
            const uint4 v = *reinterpret_cast<const uint4 *>(buf + r * 128 + ((ch ^ (r & 7)) << 4));
            const int row = wrow + r, col = 64 * half + 8 * ch;
            if (row < rows_valid && col < hv) *reinterpret_cast<uint4 *>(base[which] + (size_t)row * ld + (size_t)col * 2) = v;
        }
        __syncwarp();
    }
}

/* the q-th tile of this CTA: a static serpentine round robin over the work list. Round q hands
 * tiles [q G, q G + G) to the G CTAs, forwards in even rounds and backwards in odd ones, so a CTA
 * that got one of the cheaper tiles of a round (a narrow last column tile; mode 2's list is sorted
 * most rows first) gets one of the dearer tiles of the next: with G a multiple of the column tiles
 * a plain round robin would give the narrow column tile to the same CTAs in every round. */
__device__ __forceinline__ int next_ticket(const Params &p, int q) {
    (void)p;
    const int G = (int)gridDim.x, b = (int)blockIdx.x;
    return q * G + ((q & 1) ? G - 1 - b : b);
}

/* The work list from the device offsets, built in shared memory by threads [0, NT) (any
   further threads only join the barriers); returns the number of tiles T.
     s_offs [E + 1]: the offsets, clamped to [0, Rmax]
     s_aux  [E]    : modes 0/1: first tile of each expert (exclusive prefix of its tile count);
                     mode 2: sort keys, most rows first (expert id in the low 10 bits)
     s_scan [NT]   : scratch */
template <int MODE>
__device__ __forceinline__ int build_work_list(const Params &p, int *s_offs, int *s_aux, int *s_scan, int tid) {
    const bool act = tid < NT;
    const int E = p.E;
    if (act)
        for (int i = tid; i <= E; i += NT) s_offs[i] = min(max(p.offs[i], 0), p.Rmax);
    __syncthreads();
    if (MODE != 2) {
        int loc[4], sum = 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int e = 4 * tid + q;
            int cnt = 0;
            if (act && e < E) {
                const int n = s_offs[e + 1] - s_offs[e];
                const int nrt = (n + BM - 1) / BM;
                if (n > 0) cnt = nrt * p.ctf + p.half * ((nrt + 1) >> 1);
            }
            loc[q] = cnt;
            sum += cnt;
        }
        if (act) s_scan[tid] = sum;
        __syncthreads();
        for (int off = 1; off < NT; off <<= 1) {
            const int v = (act && tid >= off) ? s_scan[tid - off] : 0;
            __syncthreads();
            if (act) s_scan[tid] += v;
            __syncthreads();
        }
        if (act) {
            int ex = s_scan[tid] - sum;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int e = 4 * tid + q;
                if (e < E) s_aux[e] = ex;
                ex += loc[q];
            }
        }
        const int T = s_scan[NT - 1];
        __syncthreads();
        return T;
    } else {
        /* keys: (0x3FFFFF - min(rows, 0x3FFFFF)) << 10 | e, ascending = most rows first, ties by e */
        unsigned *keys = reinterpret_cast<unsigned *>(s_aux);
        int P = 2;
        while (P < E) P <<= 1;
        if (act)
            for (int i = tid; i < P; i += NT) {
                unsigned k = 0xFFFFFFFFu;
                if (i < E) {
                    const int n = min(max(s_offs[i + 1] - s_offs[i], 0), 0x3FFFFF);
                    k = ((unsigned)(0x3FFFFF - n) << 10) | (unsigned)i;
                }
                keys[i] = k;
            }
        __syncthreads();
        for (int k = 2; k <= P; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                if (act)
                    for (int i = tid; i < (P >> 1); i += NT) {
                        const int i1 = ((i & ~(j - 1)) << 1) | (i & (j - 1)), i2 = i1 + j;
                        const unsigned x = keys[i1], y = keys[i2];
                        if ((x > y) == ((i1 & k) == 0)) { keys[i1] = y; keys[i2] = x; }
                    }
                __syncthreads();
            }
        }
        return p.T2;
    }
}

template <int MODE>
__global__ void __launch_bounds__(NT, 1) gg_kernel(const Params p) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t pad = (1024u - (raw & 1023u)) & 1023u; /* SW128 tiles need 1024-byte alignment */
    const uint32_t sbase = raw + pad;
    int *s_offs = reinterpret_cast<int *>(smem_raw + pad + (size_t)ST * STAGE_BYTES);
    int *s_aux = s_offs + (MAX_E + 1); /* modes 0/1: tile prefix per expert; mode 2: sorted keys */
    int *s_scan = s_aux + (MAX_E + 1);
    int *s_ring = s_scan + NT;

    /* ---- work list from the device offsets ---- */
    const int T = build_work_list<MODE>(p, s_offs, s_aux, s_scan, tid);
    if (tid == 0) {
        s_ring[0] = (int)blockIdx.x;
        s_ring[1] = next_ticket(p, 1);
    }
    __syncthreads();

    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;

    /* ---- producer: runs PD steps ahead of the consumer along the same (tile, step) sequence ---- */
    int pq = 0, pkt = 0, pstep = 0;
    bool pneed = false;
    Tile pt = decode_tile<MODE>(p, s_offs, s_aux, T, s_ring[0]);
    int pend = 0, pend_slot = 0;
    bool pend_v = false;
    if (tid == 0 && pt.valid) { pend = next_ticket(p, 2); pend_slot = 2; pend_v = true; }
    auto produce = [&]() {
        if (pend_v) { s_ring[pend_slot] = pend; pend_v = false; } /* thread 0: publish a requested ticket */
        if (pneed) {
            ++pq;
            pt = decode_tile<MODE>(p, s_offs, s_aux, T, s_ring[pq & (RING - 1)]);
            pkt = 0;
            pneed = false;
            if (tid == 0 && pt.valid) { pend = next_ticket(p, pq + 2); pend_slot = (pq + 2) & (RING - 1); pend_v = true; }
        }
        if (pt.valid) {
            if (pt.nk > 0) load_step<MODE>(p, pt, pkt, sbase + (uint32_t)((pstep % ST) * STAGE_BYTES), tid);
            if (++pkt >= max(pt.nk, 1)) pneed = true;
        }
        cp_async_commit();
        ++pstep;
    };
#pragma unroll 1
    for (int d = 0; d < PD; ++d) produce();

    /* ---- consumer ---- */
    int cq = 0, ckt = 0, cstep = 0;
    Tile ct = decode_tile<MODE>(p, s_offs, s_aux, T, s_ring[0]);
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0); /* warpgroup index, warp-uniform for ptxas */
#pragma unroll 1
    while (ct.valid) {
        cp_async_wait<PD - 1>();
        fence_proxy_async();
        __syncthreads();
        const uint32_t stA = sbase + (uint32_t)((cstep % ST) * STAGE_BYTES);
        const int rows_valid = (MODE == 2) ? min(BM, p.M - ct.m0) : (ct.r1 - ct.r0);
        const int cols_valid = min(BN, p.ncols - ct.c0);
        step_wgmma<MODE>(acc, stA, wg, 64 * wg < rows_valid, cols_valid > 128, ckt == 0);
        produce();
        wgmma_wait<1>();
        fence_acc_all(acc);
        ++cstep;
        if (++ckt >= max(ct.nk, 1)) {
            wgmma_wait<0>();
            fence_acc_all(acc);
            {
                /* staging: this warpgroup's A half (8 KB) of the stages of the last two steps.  Only this
                   warpgroup's wgmma read them; a warp past wgmma.wait_group 0 only knows that ITS slice of
                   the warpgroup MMA is done, hence the warpgroup barrier.  The producer refills these
                   stages only after the next CTA barrier. */
                bar_sync_named(1 + wg, 128);
                const int sst = (cstep - 1 - ((warp & 3) >> 1) + ST) % ST;
                unsigned char *buf = smem_raw + pad + (size_t)sst * STAGE_BYTES + (size_t)wg * 8192 + (size_t)(warp & 1) * 4096;
                const float ss = epilogue_staged<MODE, 256>(p, acc, ct, 64 * (warp >> 2) + 16 * (warp & 3), lane, rows_valid, cols_valid, buf);
                if (MODE == 2 && p.ssq) store_ssq(p, ct, warp, lane, ss);
            }
            ++cq;
            ct = decode_tile<MODE>(p, s_offs, s_aux, T, s_ring[cq & (RING - 1)]);
            ckt = 0;
        }
    }
    cp_async_wait<0>();
}

/* mode 2 with S > 1: out = part[0] + part[1] + ... + part[S-1], in this order; with ssq, each
   block's sum of out^2 (fixed order) goes to ssq[block] */
__global__ void __launch_bounds__(256) gg_reduce_kernel(float4 *out, const float4 *part, long long n4, int S, float *ssq) {
    float ss = 0.f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 acc = part[i];
        for (int s = 1; s < S; ++s) {
            const float4 v = part[(size_t)s * (size_t)n4 + (size_t)i];
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
        out[i] = acc;
        ss += acc.x * acc.x + acc.y * acc.y + acc.z * acc.z + acc.w * acc.w;
    }
    if (ssq) {
        __shared__ float sh[8];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = ss;
        __syncthreads();
        if (threadIdx.x == 0) {
            float t = 0.f;
            for (int w = 0; w < 8; ++w) t += sh[w];
            ssq[blockIdx.x] = t;
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* The TMA kernel (default on sm_90a): a producer warp feeds the stages with the copy engine,  */
/* two consumer warpgroups only multiply and store.                                           */
/*                                                                                            */
/* 384 threads: warpgroup 0 is the producer (one thread issues every load; the warpgroup gives */
/* back its registers with setmaxnreg), warpgroups 1 and 2 are the consumers (tile rows [0, 64) */
/* and [64, 128)).  Same tiles, stage layouts, wgmma batches, schedule and reduction order as   */
/* gg_kernel; what changes is how the stages are filled and handed over:                      */
/*   - each stage is filled by cp.async.bulk.tensor (TMA) with the 128-byte swizzle, which     */
/*     writes exactly the SW128 layouts above; rows and columns outside the tensors are zeros; */
/*   - stage s has two mbarriers: full[s] (the producer's expect_tx of the bytes it loads,      */
/*     completed by the copy engine) and                                                        */
/*     empty[s] (one arrival per consumer warp once its wgmma reading the stage completed);    */
/*   - the consumers keep one wgmma batch in flight and release a stage one step later;         */
/*   - each consumer warp stores its accumulators through its own 2 KB smem buffer, so the      */
/*     producer keeps loading the next tile while the consumers store this one.                 */
/* Rows of a box beyond the tile's rows: modes 0/1 load other tokens' rows into A (harmless:   */
/* row i of the product depends on row i of A only, and such rows are never stored); the W     */
/* tensor is 3-D [E][M][K], so W rows beyond M are zeros, never the next expert's.  Mode 2     */
/* reduces over the rows, so the consumers zero the rows past the tile's end in both operands  */
/* of the last step before multiplying; that step issues only the k16 slices that hold rows    */
/* (the skipped slices would add exact zeros: the same sums, up to the sign of a zero).        */
/* What bounds it: dW's ~12 steps a tile pay for a 128 KB fp32 epilogue while the tensor cores */
/* wait (H200, mid's shapes: 880-910 TFLOP/s without the epilogue, 477-515 with it), and an SM */
/* drains stores at ~18-31 bytes a cycle (bench/store_rate.cu); hence dW in turns            */
/* (gg_pp_kernel).  Modes 0/1 run at 600-700 TFLOP/s, their epilogue ~8% of a launch.  What   */
/* else was tried, with its figures: docs/KERNELS.md.                                         */
/* ------------------------------------------------------------------------------------------ */
constexpr int NT_TMA = 384;
constexpr int EPI_BYTES = 2048;                /* per consumer warp: 16 rows x 128 bytes     */
constexpr size_t SMEM_TMA = 1024 + (size_t)ST * STAGE_BYTES + 8 * EPI_BYTES + 2 * ST * 8 +
                            (size_t)(2 * (MAX_E + 1) + NT) * sizeof(int);

struct TmaParams {
    CUtensorMap ta, tb;    /* A and B operands (see launch_tma for their shapes and boxes)    */
    CUtensorMap ta2, tb2;  /* mode 1, second pair                                             */
    CUtensorMap tbh;       /* mode 0: W with boxes of 128 rows (the wide tiles' B)              */
    CUtensorMap tc;        /* gg_pp_kernel's TMA stores: dW [E][M][K] fp32, boxes 32 k x 8 m    */
    CUtensorMap to;        /* modes 0/1 (not GLU): the bf16 output [Rmax][ncols], boxes 64 x 16 rows */
    CUtensorMap to2, to3;  /* GLU: to = g, to2 = u, to3 = h, each [Rmax][M], boxes 64 x TSG_BOX rows */
    int tso;               /* the output maps made: a warp's whole 16-row slabs leave as TMA stores (TS) */
    int perm;              /* tc is the 5-D view with the 8 rows of a box in the order 0 4 1 5 2 6 3 7 (see pp_store_tma) */
    Params p;
};

/* The producer's loads of reduction step kt of tile ti into the stage at sA, announced on its full
   barrier first.  Column blocks that start past the tensor's columns are not loaded (what the stage
   holds there meets only output rows or columns that are never stored). */
/* A wide tile (256 x 128) fills the same stage bytes: A 256 rows (32 KB), then B 128 columns. */
/* GLU (mode 0, gate and up in one launch): B is W_gate's 128 rows from c0 / 2, then W_up's same rows. */
template <int MODE, bool GLU = false>
__device__ __forceinline__ void tma_step(const TmaParams &tp, const Tile &ti, int kt, uint32_t sA, uint32_t bar) {
    const int w = ti.wide;
    const uint32_t sB = sA + (w ? 2u : 1u) * A_BYTES;
    if (MODE == 0 && GLU) {
        mbar_expect_tx(bar, (uint32_t)STAGE_BYTES);
        tma_load_2d(sA, &tp.ta, bar, kt * BK, ti.r0);                /* X: box 64 x 128 rows             */
        tma_load_3d(sB, &tp.tbh, bar, kt * BK, ti.c0 >> 1, ti.e);    /* W_gate: box 64 x 128 x 1         */
        tma_load_3d(sB + A_BYTES, &tp.tb2, bar, kt * BK, ti.c0 >> 1, ti.e); /* W_up: the same rows       */
    } else if (MODE == 0) {
        mbar_expect_tx(bar, (uint32_t)STAGE_BYTES);
        tma_load_2d(sA, &tp.ta, bar, kt * BK, ti.r0);               /* X [Rmax][K]: box 64 x 128 rows   */
        if (w) {
            tma_load_2d(sA + A_BYTES, &tp.ta, bar, kt * BK, ti.r0 + BM);
            tma_load_3d(sB, &tp.tbh, bar, kt * BK, ti.c0, ti.e);     /* W: box 64 x 128 x 1              */
        } else {
            tma_load_3d(sB, &tp.tb, bar, kt * BK, ti.c0, ti.e);      /* W [E][M][K]: box 64 x 256 x 1    */
        }
    } else if (MODE == 1) {
        const CUtensorMap *ma = &tp.ta, *mb = &tp.tb;
        if (tp.p.a2 && kt >= tp.p.nkh) { ma = &tp.ta2; mb = &tp.tb2; kt -= tp.p.nkh; }
        const int nb = min(4, (tp.p.K - ti.c0 + 63) / 64);
        mbar_expect_tx(bar, (uint32_t)((w + 1) * A_BYTES + nb * 8192));
        tma_load_2d(sA, ma, bar, kt * BK, ti.r0);                    /* dY [Rmax][M]: box 64 x 128 rows  */
        if (w) tma_load_2d(sA + A_BYTES, ma, bar, kt * BK, ti.r0 + BM);
        for (int j = 0; j < nb; ++j)                                 /* W [E][M][K]: box 64 x 64 x 1     */
            tma_load_3d(sB + (uint32_t)j * 8192u, mb, bar, ti.c0 + 64 * j, kt * BK, ti.e);
    } else {
        const int r = ti.r0 + kt * BK;
        const int na = min(2 + 2 * w, (tp.p.M - ti.m0 + 63) / 64), nb = min(4, (tp.p.K - ti.c0 + 63) / 64);
        mbar_expect_tx(bar, (uint32_t)((na + nb) * 8192));
        for (int j = 0; j < na; ++j) tma_load_2d(sA + (uint32_t)j * 8192u, &tp.ta, bar, ti.m0 + 64 * j, r); /* dY: 64 x 64 */
        for (int j = 0; j < nb; ++j) tma_load_2d(sB + (uint32_t)j * 8192u, &tp.tb, bar, ti.c0 + 64 * j, r); /* X: 64 x 64 */
    }
}

/* Mode 2, last step of a tile: zero stage rows [nv, nend) of both operands (6 column blocks of
   64 rows x 128 bytes); threads 0..255 of the consumers. */
__device__ __forceinline__ void zero_tail_rows(unsigned char *stage, int nv, int nend, int ctid) {
#pragma unroll 4
    for (int i = ctid; i < (nend - nv) * 48; i += 256) {
        const int r = nv + i / 48, blk = (i % 48) >> 3, ch = i & 7;
        *reinterpret_cast<uint4 *>(stage + blk * 8192 + r * 128 + ch * 16) = make_uint4(0u, 0u, 0u, 0u);
    }
}


/* The stage ring's mbarriers: full[s] completes on the producer's expect_tx and the copies' bytes,
   empty[s] on `readers` arrivals (one per consumer warp that reads the stage). */
__device__ __forceinline__ void init_ring(uint32_t full0, uint32_t empty0, int n, int readers) {
#pragma unroll 1
    for (int s = 0; s < n; ++s) {
        mbar_init(full0 + 8u * s, 1);
        mbar_init(empty0 + 8u * s, readers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

/* mode 2: short last steps (only the k16 slices that hold rows); GLU (mode 0): gate and up in one
   launch, the SwiGLU in the epilogue (see gg_run_glu) */
template <int MODE, bool GLU = false>
__global__ void __launch_bounds__(NT_TMA, 1) gg_tma_kernel(const __grid_constant__ TmaParams tp) {
    constexpr bool SHORT = MODE == 2;
    constexpr bool TS = MODE != 2; /* whole 16-row slabs leave as TMA stores (epilogue_staged, epilogue_glu) */
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const Params &p = tp.p;
    const int tid = threadIdx.x;
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t pad = (1024u - (raw & 1023u)) & 1023u; /* SW128 tiles need 1024-byte alignment */
    const uint32_t sbase = raw + pad;
    unsigned char *stages = smem_raw + pad;
    unsigned char *epi = stages + (size_t)ST * STAGE_BYTES;
    const uint32_t full0 = sbase + (uint32_t)(ST * STAGE_BYTES + 8 * EPI_BYTES); /* full[s] = full0 + 8 s  */
    const uint32_t empty0 = full0 + 8u * ST;                                     /* empty[s] = empty0 + 8 s */
    int *s_offs = reinterpret_cast<int *>(epi + 8 * EPI_BYTES + 2 * ST * 8);
    int *s_aux = s_offs + (MAX_E + 1);
    int *s_scan = s_aux + (MAX_E + 1);

    if (tid == NT) init_ring(full0, empty0, ST, 8);
    const int T = build_work_list<MODE>(p, s_offs, s_aux, s_scan, tid); /* ends with a CTA barrier */

    if (tid < 128) {
        /* ---- producer warpgroup: one thread walks this CTA's (tile, step) sequence ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {
            int step = 0;
#pragma unroll 1
            for (int q = 0;; ++q) {
                const Tile ti = decode_tile<MODE>(p, s_offs, s_aux, T, next_ticket(p, q));
                if (!ti.valid) break;
#pragma unroll 1
                for (int kt = 0; kt < ti.nk; ++kt, ++step) {
                    const int s = step % ST;
                    mbar_wait(empty0 + 8u * s, ((step / ST) & 1) ^ 1);
                    tma_step<MODE, GLU>(tp, ti, kt, sbase + (uint32_t)(s * STAGE_BYTES), full0 + 8u * s);
                }
            }
        }
    } else {
        /* ---- consumer warpgroups ---- */
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const int ctid = tid - 128, warp = ctid >> 5, lane = ctid & 31;
        const int wg = __shfl_sync(0xffffffffu, ctid >> 7, 0); /* warp-uniform for ptxas */
        unsigned char *buf = epi + (size_t)warp * EPI_BYTES;
        float acc[128];
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
        int step = 0;
        /* the next tile is decoded while the first wgmma batch of the current one runs: between
           tiles, mode 2's decode measured ~1200 cycles of a ~21000-cycle tile on mid's shapes.
           q0 is opaque to the compiler: decoding ticket 0 here and in the producer must not merge
           into one computation before the branch, whose registers the producer gives back
           (setmaxnreg) while still using them -- seen as illegal addresses */
        int q0 = 0;
        asm volatile("" : "+r"(q0));
        Tile nxt = decode_tile<MODE>(p, s_offs, s_aux, T, next_ticket(p, q0));
#pragma unroll 1
        for (int q = q0; nxt.valid; ++q) {
            const Tile ti = nxt;
            if (ti.nk == 0) nxt = decode_tile<MODE>(p, s_offs, s_aux, T, next_ticket(p, q + 1));
            const int rows_valid = (MODE == 2) ? min(BM << ti.wide, p.M - ti.m0) : (ti.r1 - ti.r0);
            const int cols_valid = min(BN, p.ncols - ti.c0);
#pragma unroll 1
            for (int kt = 0; kt < ti.nk; ++kt, ++step) {
                const int s = step % ST;
                mbar_wait(full0 + 8u * s, (step / ST) & 1);
                int nkk = BK / 16;
                if (MODE == 2 && kt == ti.nk - 1) {
                    const int nv = ti.r1 - (ti.r0 + kt * BK);
                    if (SHORT) nkk = (nv + 15) >> 4; /* only the k16 slices holding rows */
                    const int nend = SHORT ? 16 * nkk : BK;
                    if (nv < nend) { /* tile-uniform */
                        zero_tail_rows(stages + (size_t)s * STAGE_BYTES, nv, nend, ctid);
                        fence_proxy_async();
                        bar_sync_named(1, 256);
                    }
                }
                if (ti.wide)
                    step_wgmma<MODE, SHORT, true>(acc, sbase + (uint32_t)(s * STAGE_BYTES), wg, 64 * wg < cols_valid, true, kt == 0, nkk);
                else
                    step_wgmma<MODE, SHORT>(acc, sbase + (uint32_t)(s * STAGE_BYTES), wg, 64 * wg < rows_valid, cols_valid > 128, kt == 0, nkk);
                if (kt == 0) nxt = decode_tile<MODE>(p, s_offs, s_aux, T, next_ticket(p, q + 1));
                wgmma_wait<1>();
                fence_acc_all(acc);
                /* the previous step's batch is complete: its stage goes back to the producer */
                if (kt > 0 && lane == 0) mbar_arrive(empty0 + 8u * ((step + ST - 1) % ST));
            }
            wgmma_wait<0>();
            fence_acc_all(acc);
            if (ti.nk > 0 && lane == 0) mbar_arrive(empty0 + 8u * ((step + ST - 1) % ST));
            /* consumer warp w: tile rows 64 (w / 4) + 16 (w % 4) + [0, 16); in a wide tile columns 16 w + [0, 16) */
            if (TS && tp.tso) {
                const int wrow = 64 * wg + 16 * (warp & 3);
                if (!ti.wide && wrow + 16 <= rows_valid) {
                    if constexpr (GLU) epilogue_glu<TS>(p, acc, ti, wrow, lane, rows_valid, buf, &tp.to, &tp.to2, &tp.to3);
                    else epilogue_staged<MODE, 128, TS>(p, acc, ti, wrow, lane, rows_valid, cols_valid, buf, &tp.to);
                    continue;
                }
                if (lane == 0) bulk_wait_read0(); /* the buffer's last TMA store has read it */
                __syncwarp();
            }
            if (GLU) {
                epilogue_glu(p, acc, ti, 64 * wg + 16 * (warp & 3), lane, rows_valid, buf);
                continue;
            }
            const float ss = ti.wide ? epilogue_wide<MODE>(p, acc, ti, warp, lane, rows_valid, cols_valid, buf)
                                     : epilogue_staged<MODE, 128>(p, acc, ti, 64 * wg + 16 * (warp & 3), lane, rows_valid, cols_valid, buf);
            if (MODE == 2 && p.ssq) store_ssq(p, ti, warp, lane, ss);
        }
        if (TS && tp.tso && lane == 0) bulk_wait0(); /* the warp's stores done before the CTA ends */
    }
}

/* ------------------------------------------------------------------------------------------ */
/* dW in turns (mode 2, the default when no row split is needed): each consumer warpgroup owns   */
/* whole 128 x 192 tiles, and the two take turns at the tensor cores, so one warpgroup's        */
/* epilogue (96 KB of fp32) drains while the other multiplies.  384 threads: warpgroup 0 is the  */
/* producer (one thread issues the TMA loads), 1 and 2 the consumers; the CTA's tiles alternate   */
/* between them (j even: 1, odd: 2).                                                            */
/*   - a stage is one 64-row step of one tile: dY's 128 m columns as two MN-major 64 x 64       */
/*     blocks, then X's 192 columns as 3 (40 KB, 5 stages) in one ring, filled in the order the */
/*     tiles are taken, each released by the 4 warps of the warpgroup that read it;            */
/*   - turns on named barriers 1 and 2 (as in attention's Turns): a warpgroup issues its tile's */
/*     products only between begin (the other finished issuing) and end;                        */
/*   - each k16 slice is two m64n192k16 products (tile rows [0, 64) and [64, 128)) over the    */
/*     same slices in the same order as the gg_tma_kernel's m64n256k16: dW is bitwise the same; */
/*     a last column tile with <= 64 or <= 128 columns in K multiplies only those (m64n64 /     */
/*     m64n128 on the accumulators' first registers, which hold the same columns);             */
/*   - mode 2's short last step and tail-row zeroing as in gg_tma_kernel;                      */
/*   - each warp's accumulators leave as TMA tensor stores of 2 KB, its whole buffer (16 rows x */
/*     32 columns; with the 3-D map, where the driver refuses the 5-D one: 1 KB from each half  */
/*     in turn; pp_store_tma);                                                                 */
/*   - the norm partial of warp w of a tile goes to entry 4 ((e ntm + mt) nct + ct) + w (all    */
/*     within ssq_need; those no tile writes are zeroed by the kernel).                        */
/* Why 128 x 192: 17% fewer operand bytes per product than 128 x 128 (40 KB a step for 1.5     */
/* times the work), a gain at the power-capped clocks the training step runs at.  What bounds it */
/* (H200, cycle counts of an instrumented build, equal experts): a warpgroup's life is ~20.5K   */
/* cycles a tile against 9216 at the tensor rate; dW's fp32 stores cost 5% there and 12-13% on  */
/* unequal layouts, the rest is the mainloop's operand supply (~7 TB/s from L2 against cuBLASLt's */
/* up to 10.8).  Everything measured on it, kept or not: docs/KERNELS.md.                       */
/* ------------------------------------------------------------------------------------------ */
/* a step's stage: dY's 128 m as 2 blocks of 64 x 64, then X's PP_BN columns as PP_BN / 64 blocks; 5 stages of 40 KB */
constexpr int PP_BN = 192;                     /* the tiles' columns */
constexpr int PP_BLK = 128 * BK;               /* one 64-column block of a step: BK rows of 128 bytes (8 KB) */
constexpr int PP_STAGE = (2 + PP_BN / 64) * PP_BLK;
constexpr int PP_NST = 5;
constexpr size_t PP_SMEM = 1024 + (size_t)PP_NST * PP_STAGE + 2 * PP_NST * 8 + 8 * EPI_BYTES + (size_t)(2 * (MAX_E + 1) + NT) * sizeof(int);
static_assert(PP_SMEM <= 232448, "gg_pp_kernel's shared memory");

struct PpTile {
    int valid, e, m0, c0, r0, r1, nk, sq;
};

/* n / d for 0 <= n < 2^31 and a divisor d >= 1 fixed for the kernel: a multiply-high, an add and a
   shift (m = floor(2^32 (2^l - d) / d) + 1, l = ceil(log2 d)); the tile decode's divisions */
struct FastDiv {
    uint32_t m, l;
    __host__ __device__ explicit FastDiv(uint32_t d) {
        l = 0;
        while (l < 32 && (1ull << l) < d) ++l;
        m = (uint32_t)((((1ull << l) - d) << 32) / d + 1);
    }
    __host__ __device__ uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
        const uint32_t t = __umulhi(m, n);
#else
        const uint32_t t = (uint32_t)(((uint64_t)m * n) >> 32);
#endif
        return (t + n) >> l;
    }
};

/* the decode's divisors: the tiles (or pairs) of an expert and the column tiles (or pairs) of an m tile */
template <int BNP>
__device__ __forceinline__ void pp_divisors(const Params &p, int &per_e, int &ncp) {
    const int nct = (p.K + BNP - 1) / BNP, nmp = p.pair == 2 ? p.ntm / 2 : p.ntm;
    ncp = p.pair == 1 ? nct / 2 : nct;
    per_e = nmp * ncp;
}
/* tile t of the list: experts most rows first (s_aux), then m tiles, then BNP-wide column tiles; dpe,
   dnc: per_e and ncp as FastDivs.  (With p.pair, always 0 now, t counted pairs of tiles for CTA
   clusters, rank the tile of the pair: docs/KERNELS.md.) */
template <int BNP>
__device__ __forceinline__ PpTile pp_decode(const Params &p, const int *s_offs, const int *s_aux, int t, int rank, const FastDiv &dpe,
                                            const FastDiv &dnc) {
    PpTile ti;
    ti.valid = (t >= 0 && t < p.T2) ? 1 : 0;
    ti.e = ti.m0 = ti.c0 = ti.r0 = ti.r1 = ti.nk = ti.sq = 0;
    if (!ti.valid) return ti;
    int per_e, ncp;
    pp_divisors<BNP>(p, per_e, ncp);
    const int nct = (p.K + BNP - 1) / BNP;
    const int pos = (int)dpe.div((uint32_t)t), rem = t - pos * per_e, mp = (int)dnc.div((uint32_t)rem), cp = rem - mp * ncp;
    const int mt = p.pair == 2 ? 2 * mp + rank : mp, ct = p.pair == 1 ? 2 * cp + rank : cp;
    const int e = (int)((unsigned)s_aux[pos] & (unsigned)(MAX_E - 1));
    ti.e = e;
    ti.m0 = mt * BM;
    ti.c0 = ct * BNP;
    ti.r0 = s_offs[e];
    ti.r1 = max(ti.r0, s_offs[e + 1]);
    ti.nk = (ti.r1 - ti.r0 + BK - 1) / BK;
    ti.sq = ((e * p.ntm + mt) * nct + ct) * 4; /* the norm partials: 4 entries a tile */
    return ti;
}

/* the NKK k16 slices of one step: rows [0, 64) into a0, [64, 128) into a1 */
template <int NKK, int N>
__device__ __forceinline__ void pp_batch(float (&a0)[N], float (&a1)[N], uint64_t da0, uint64_t da1, uint64_t db, int sd0) {
    wgmma_fence();
    mt_fa::wgmma_ss<2 * N, 1, 1>(a0, da0, db, sd0);
    mt_fa::wgmma_ss<2 * N, 1, 1>(a1, da1, db, sd0);
#pragma unroll
    for (int kk = 1; kk < NKK; ++kk) {
        mt_fa::wgmma_ss<2 * N, 1, 1>(a0, da0 + kk * 128, db + kk * 128, 1);
        mt_fa::wgmma_ss<2 * N, 1, 1>(a1, da1 + kk * 128, db + kk * 128, 1);
    }
    wgmma_commit();
}
/* one step's nkk k16 slices on the first 2N columns of the accumulators (the rest keep their values:
   a tile's last columns past K are neither stored nor summed) */
template <int N, int M>
__device__ __forceinline__ void pp_step(float (&a0)[M], float (&a1)[M], uint64_t da0, uint64_t da1, uint64_t db, int sd0, int nkk) {
    static_assert(N <= M, "pp_step");
    float (&b0)[N] = *reinterpret_cast<float (*)[N]>(&a0[0]);
    float (&b1)[N] = *reinterpret_cast<float (*)[N]>(&a1[0]);
    if (nkk == 4) pp_batch<4, N>(b0, b1, da0, da1, db, sd0);
    else if (nkk == 3) pp_batch<3, N>(b0, b1, da0, da1, db, sd0);
    else if (nkk == 2) pp_batch<2, N>(b0, b1, da0, da1, db, sd0);
    else pp_batch<1, N>(b0, b1, da0, da1, db, sd0);
}

/* The sum of the squares of a warp's 16 rows of a (rows < rows_valid, columns < cols_valid), pass by pass
   (32 columns), row pair by row pair: the order of the staged stores' sums, so the TMA stores' norm
   partials are bitwise theirs; whole rows and columns without the bounds tests (the same sums in the
   same order) */
template <int N>
__device__ __forceinline__ float pp_ssq(const float (&a)[N], int rows_valid, int cols_valid, int lane) {
    const int g = lane >> 2, c = lane & 3;
    float ss = 0.f;
    if (rows_valid >= 16 && cols_valid >= 2 * N) { /* one fma a value, in four chains */
        float q[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 2 * (N / 4) * 2; i += 4)
#pragma unroll
            for (int k = 0; k < 4; ++k) q[k] = fmaf(a[i + k], a[i + k], q[k]);
        return (q[0] + q[1]) + (q[2] + q[3]);
    }
#pragma unroll
    for (int pass = 0; pass < N / 16; ++pass) {
        if (32 * pass >= cols_valid) break;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = 4 * pass + jj;
                const float v0 = a[4 * j + 2 * h], v1 = a[4 * j + 2 * h + 1];
                if (g + 8 * h < rows_valid && 32 * pass + 8 * jj + 2 * c < cols_valid) ss += v0 * v0 + v1 * v1;
            }
    }
    return ss;
}

/* The same 16 rows x 128 columns as TMA tensor stores (the copy engine does the global writes):
   8 rows x 32 columns (1 KB) at a time from the two 1 KB halves of the warp's buffer in turn, a half
   rewritten once the store before last has read it (wait_group.read 1).  Rows and columns past the
   expert's M x K are clipped by the map (dims K, M, E).  The halves hold 128-byte rows with the
   16-byte chunks XOR-swizzled by row (the map's 128-byte swizzle; the buffer is 1024-aligned).
   Bank conflicts: with the rows in order, rows g and g ^ 1 of a half-warp's 8-byte writes fall on
   the same banks (their 32-byte pieces share a swizzled pair of chunks): 2-way conflicts.  perm (the
   default where the driver takes the map): the map is a 5-D view of dW whose box lists a group's
   8 rows in the order 0 4 1 5 2 6 3 7 (dims K, 2 rows 4 apart, 4 rows 1 apart, M / 8, E), so row g
   sits in buffer row s = 2 (g % 4) + g / 4, and the four rows of each half-warp take four different
   pairs of chunks: no conflicts, and no selects (earlier, a per-lane order of the column blocks
   avoided them at the cost of a select per value, and dropping it with the other per-value selects
   took equal experts from 556-573 to 579-581 TFLOP/s).
   With perm the map's box is both groups (dims' box {32, 2, 4, 2, 1}), and a pass writes its 16 rows x
   32 columns into the whole 2 KB buffer once the previous store has read it (wait_group.read 0) and
   leaves as one 2 KB store: half the stores and fences of the 1 KB halves, and a shorter epilogue.  sq
   (a whole tile's accumulator with the norm partials): its squares, one fma a value in four chains, are
   summed into ss pass by pass while the pass's store reads the buffer.  Figures: docs/KERNELS.md.
   c0: the tile's first column, m0: the warp's first row. */
/* a lane's 8 values of rows g + 8 h, columns 32 pass + [0, 32) into a 1 KB half at hb (buffer row sr, the
   16-byte chunks XOR-swizzled by row) */
template <int N>
__device__ __forceinline__ void pp_stage_rows(const float (&a)[N], unsigned char *hb, int pass, int h, int sr, int c) {
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * pass + jj;
        const int byte = (8 * jj + 2 * c) * 4;
        *reinterpret_cast<float2 *>(hb + sr * 128 + (((byte >> 4) ^ sr) << 4) + (byte & 15)) = make_float2(a[4 * j + 2 * h], a[4 * j + 2 * h + 1]);
    }
}
template <int N>
__device__ __forceinline__ void pp_store_tma(const float (&a)[N], const CUtensorMap *map, int c0, int m0, int e, int rows_valid,
                                             int cols_valid, int lane, unsigned char *buf, bool perm, bool sq, float &ss) {
    const int g = lane >> 2, c = lane & 3;
    const int sr = perm ? 2 * (g & 3) + (g >> 2) : g; /* the buffer row of this lane's row g */
    const uint32_t sbuf = smem_u32(buf);
    if (perm) { /* 2 KB boxes: both row groups of a pass in one store (rows past M are clipped) */
        float q[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int pass = 0; pass < N / 16; ++pass) {
            if (32 * pass >= cols_valid) break; /* tile-uniform */
            if (lane == 0) bulk_wait_read0();
            __syncwarp();
#pragma unroll
            for (int h = 0; h < 2; ++h) pp_stage_rows(a, buf + h * 1024, pass, h, sr, c);
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) {
                tma_store_5d(map, sbuf, c0 + 32 * pass, 0, 0, m0 >> 3, e);
                bulk_commit();
            }
            if (sq) /* warp-uniform (a whole tile): the pass's squares while its store reads the buffer */
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj) {
                        const int j = 4 * pass + jj;
                        q[jj] = fmaf(a[4 * j + 2 * h], a[4 * j + 2 * h], q[jj]);
                        q[jj] = fmaf(a[4 * j + 2 * h + 1], a[4 * j + 2 * h + 1], q[jj]);
                    }
        }
        if (sq) ss += (q[0] + q[1]) + (q[2] + q[3]);
        return;
    }
#pragma unroll
    for (int pass = 0; pass < N / 16; ++pass) {
        if (32 * pass >= cols_valid) break; /* tile-uniform */
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (8 * h >= rows_valid) break; /* warp-uniform: nothing of these rows is in the expert */
            unsigned char *hb = buf + h * 1024;
            if (lane == 0) bulk_wait_read1();
            __syncwarp();
            pp_stage_rows(a, hb, pass, h, sr, c);
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) {
                if (perm) tma_store_5d(map, sbuf + (uint32_t)(h * 1024), c0 + 32 * pass, 0, 0, (m0 + 8 * h) >> 3, e);
                else tma_store_3d(map, sbuf + (uint32_t)(h * 1024), c0 + 32 * pass, m0 + 8 * h, e);
                bulk_commit();
            }
        }
    }
}

__global__ void __launch_bounds__(NT_TMA, 1) gg_pp_kernel(const __grid_constant__ TmaParams tp) {
    constexpr int BNP = PP_BN, NST = PP_NST, STB = PP_STAGE, NBB = BNP / 64;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const Params &p = tp.p;
    const int tid = threadIdx.x;
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
    const uint32_t sbase = raw + pad;
    unsigned char *stages = smem_raw + pad;
    /* stages, the 8 consumer warps' buffers (1024-aligned: the stores' 128-byte swizzle), barriers */
    const uint32_t full0 = sbase + (uint32_t)(NST * STB + 8 * EPI_BYTES), empty0 = full0 + 8u * NST;
    int *s_offs = reinterpret_cast<int *>(stages + (size_t)NST * STB + 8 * EPI_BYTES + 2 * NST * 8);
    int *s_aux = s_offs + (MAX_E + 1);
    int *s_scan = s_aux + (MAX_E + 1);
    if (tid == NT) init_ring(full0, empty0, NST, 4); /* a stage is read by one warpgroup's 4 warps */
    /* the norm partials no tile writes read as zero (in place of a memset launch before the kernel;
       mid's GMM_DW_SQ within the step's noise: 529.1 / 516.9 / 541.6 against 534.4 / 544.5 / 534.9) */
    for (int i = p.ssq_z0 + (int)blockIdx.x * NT_TMA + tid; i < p.ssq_z1; i += (int)gridDim.x * NT_TMA) p.ssq[i] = 0.f;
    build_work_list<2>(p, s_offs, s_aux, s_scan, tid); /* ends with a CTA barrier */
    int per_e, ncp;
    pp_divisors<BNP>(p, per_e, ncp);
    const FastDiv dpe((uint32_t)max(per_e, 1)), dnc((uint32_t)max(ncp, 1));
    auto tile = [&](int q) -> PpTile { return pp_decode<BNP>(p, s_offs, s_aux, next_ticket(p, q), 0, dpe, dnc); };

    if (tid < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {
            int step = 0;
#pragma unroll 1
            for (int q = 0;; ++q) {
                const PpTile ti = tile(q);
                if (!ti.valid) break;
                const int na = min(2, (p.M - ti.m0 + 63) / 64), nb = min(NBB, (p.K - ti.c0 + 63) / 64);
#pragma unroll 1
                for (int kt = 0; kt < ti.nk; ++kt, ++step) {
                    const int s = step % NST;
                    const uint32_t sA = sbase + (uint32_t)(s * STB), bar = full0 + 8u * s;
                    const int r = ti.r0 + kt * BK;
                    mbar_wait(empty0 + 8u * s, ((step / NST) & 1) ^ 1);
                    mbar_expect_tx(bar, (uint32_t)((na + nb) * PP_BLK));
                    for (int j = 0; j < na; ++j) tma_load_2d(sA + (uint32_t)(j * PP_BLK), &tp.ta, bar, ti.m0 + 64 * j, r);
                    for (int j = 0; j < nb; ++j) tma_load_2d(sA + (uint32_t)(2 * PP_BLK) + (uint32_t)(j * PP_BLK), &tp.tb, bar, ti.c0 + 64 * j, r);
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const int ctid = tid - 128, lane = ctid & 31;
        const int wg = __shfl_sync(0xffffffffu, ctid >> 7, 0), v = __shfl_sync(0xffffffffu, (ctid >> 5) & 3, 0);
        unsigned char *buf = stages + (size_t)NST * STB + (size_t)(ctid >> 5) * EPI_BYTES;
        float a0[BNP / 2], a1[BNP / 2];
#pragma unroll
        for (int i = 0; i < BNP / 2; ++i) { a0[i] = 0.f; a1[i] = 0.f; }
        if (wg == 1) named_bar_arrive(1, 256); /* warpgroup 1 (the first) may begin */
        /* warpgroup wg takes the CTA's tiles q = wg, wg + 2, ...; the other's tile q + 1 (its steps in
           the ring) and this one's next, q + 2, are decoded under the drain of tile q */
        int step = 0, q = wg, ov = 1; /* ov: the tile before q (the other warpgroup's) exists */
        if (wg == 1) { const PpTile t0 = tile(0); ov = t0.valid; step = t0.nk; }
        PpTile ti = tile(q);
#pragma unroll 1
        for (;; q += 2) {
            if (!ti.valid) break;
            named_bar_sync(1 + wg, 256); /* begin: the other warpgroup has issued its products */
            const int cw = min(BNP, p.K - ti.c0); /* the tile's valid columns (mainloop and epilogue) */
#pragma unroll 1
            for (int kt = 0; kt < ti.nk; ++kt, ++step) {
                const int s = step % NST;
                const uint32_t sA = sbase + (uint32_t)(s * STB);
                mbar_wait(full0 + 8u * s, (step / NST) & 1);
                int nkk = BK / 16;
                if (kt == ti.nk - 1) {
                    const int nv = ti.r1 - (ti.r0 + kt * BK);
                    nkk = (nv + 15) >> 4; /* only the k16 slices holding rows */
                    const int nend = 16 * nkk;
                    if (nv < nend) { /* tile-uniform: zero rows [nv, nend) of the 2 + NBB blocks */
                        unsigned char *st = stages + (size_t)s * STB;
                        for (int i = ctid & 127; i < (nend - nv) * 8 * (2 + NBB); i += 128) {
                            const int rr = nv + i / (8 * (2 + NBB)), blk = (i >> 3) % (2 + NBB), ch = i & 7;
                            *reinterpret_cast<uint4 *>(st + blk * PP_BLK + rr * 128 + ch * 16) = make_uint4(0u, 0u, 0u, 0u);
                        }
                        fence_proxy_async();
                        named_bar_sync(3 + wg, 128);
                    }
                }
                const uint64_t da0 = sw128_desc(sA, PP_BLK, 1024u), da1 = sw128_desc(sA + PP_BLK, PP_BLK, 1024u);
                const uint64_t db = sw128_desc(sA + 2 * PP_BLK, PP_BLK, 1024u);
                const int sd0 = kt == 0 ? 0 : 1;
                fence_acc_all(a0);
                fence_acc_all(a1);
                /* 192 columns: a last tile with <= 64 or <= 128 columns in K multiplies only those */
                if (cw <= 64) pp_step<32>(a0, a1, da0, da1, db, sd0, nkk);
                else if (cw <= 128) pp_step<64>(a0, a1, da0, da1, db, sd0, nkk);
                else pp_step<BNP / 2>(a0, a1, da0, da1, db, sd0, nkk);
                fence_acc_all(a0);
                fence_acc_all(a1);
                wgmma_wait<1>();
                fence_acc_all(a0);
                fence_acc_all(a1);
                if (kt > 0 && lane == 0) mbar_arrive(empty0 + 8u * ((step + NST - 1) % NST));
            }
            named_bar_arrive(2 - wg, 256); /* end: the other warpgroup may issue */
            const PpTile to = tile(q + 1), tn = tile(q + 2);
            ov = to.valid;
            wgmma_wait<0>();
            fence_acc_all(a0);
            fence_acc_all(a1);
            if (ti.nk > 0 && lane == 0) mbar_arrive(empty0 + 8u * ((step + NST - 1) % NST));
            /* warp v: tile rows 16 v + [0, 16) from a0 and 64 + 16 v + [0, 16) from a1 (an expert
               without rows: zeros) */
            const int rv = p.M - ti.m0 - 16 * v;
            float ss = 0.f;
            if (ti.nk == 0) /* tile-uniform: an expert without rows */
#pragma unroll
                for (int i = 0; i < BNP / 2; ++i) a0[i] = a1[i] = 0.f;
            /* the norm partial: a whole accumulator's squares summed in the 2 KB stores, else here */
            const bool f = p.ssq && tp.perm && cw >= BNP, f0 = f && rv >= 16, f1 = f && rv - 64 >= 16;
            if (p.ssq && !f0) ss += pp_ssq(a0, rv, cw, lane);
            if (p.ssq && !f1) ss += pp_ssq(a1, rv - 64, cw, lane);
            pp_store_tma(a0, &tp.tc, ti.c0, ti.m0 + 16 * v, ti.e, rv, cw, lane, buf, tp.perm != 0, f0, ss);
            pp_store_tma(a1, &tp.tc, ti.c0, ti.m0 + 64 + 16 * v, ti.e, rv - 64, cw, lane, buf, tp.perm != 0, f1, ss);
            if (p.ssq) {
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                if (lane == 0) p.ssq[ti.sq + v] = ss;
            }
            step += to.nk;
            ti = tn;
        }
        const int n = ov ? q : q - 1; /* the CTA's tiles */
        /* equal turns: after an odd number of tiles warpgroup 2 takes an empty one */
        if ((n & 1) && wg == 1) {
            named_bar_sync(2, 256);
            named_bar_arrive(1, 256);
        }
        if (wg == 0) named_bar_sync(1, 256);
        if (lane == 0) bulk_wait0(); /* the warp's stores done before the CTA ends */
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Host side                                                                                  */
/* ------------------------------------------------------------------------------------------ */
static bool args_ok(int mode, int E, int M, int K, int Rmax) {
    if (mode < 0 || mode > 2) return false;
    if (E < 1 || E > MAX_E) return false;
    if (M < 8 || K < 8 || (M % 8) != 0 || (K % 8) != 0) return false;
    if (M > (1 << 24) || K > (1 << 24)) return false;
    if (Rmax < 0 || Rmax > INT_MAX - 4 * BM) return false;
    return true;
}

static int num_sms(int *n) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return -1;
    if (cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return -1;
    return *n >= 1 ? 0 : -1;
}

/* mode 2 row splits: only when the output tiles alone cannot fill the GPU */
static int split_count(int mode, int E, int M, int K, int Rmax, int nsm) {
    if (mode != 2) return 1;
    const long long tiles = (long long)E * ((M + BM - 1) / BM) * ((K + BN - 1) / BN);
    if (tiles >= nsm) return 1;
    long long s = nsm / tiles;
    long long smax = ((long long)Rmax / E) / 256; /* at least ~4 steps per split on average */
    if (smax < 1) smax = 1;
    if (smax > 16) smax = 16;
    if (s > smax) s = smax;
    return (int)(s < 1 ? 1 : s);
}

template <int MODE>
static int launch_main(const Params &p, int grid, cudaStream_t stream) {
    void (*kern)(const Params) = gg_kernel<MODE>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_BYTES) != cudaSuccess) return -1;
    kern<<<grid, NT, SMEM_BYTES, stream>>>(p);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

/* The operand maps of one mode (see tma_step for how they are read):
     rows [Rmax][C] (X: C = K, dY: C = M), boxes of 64 columns x `rows_box` rows;
     W [E][M][K] as 3-D (K, M, E), boxes of 64 k x `w_box` m x 1 expert. */
static int tma_row_map(EncodeTiledFn enc, CUtensorMap *m, const void *base, int C, int Rmax, int rows_box) {
    const cuuint64_t dims[2] = {(cuuint64_t)C, (cuuint64_t)(Rmax > 0 ? Rmax : 1)}; /* Rmax = 0: no box is ever read */
    const cuuint64_t strides[1] = {(cuuint64_t)C * 2};
    const cuuint32_t box[2] = {64, (cuuint32_t)rows_box};
    return tma_map(enc, m, base, 2, dims, strides, box);
}
static int tma_w_map(EncodeTiledFn enc, CUtensorMap *m, const void *base, int E, int M, int K, int w_box) {
    const cuuint64_t dims[3] = {(cuuint64_t)K, (cuuint64_t)M, (cuuint64_t)E};
    const cuuint64_t strides[2] = {(cuuint64_t)K * 2, (cuuint64_t)M * K * 2};
    const cuuint32_t box[3] = {64, (cuuint32_t)w_box, 1};
    return tma_map(enc, m, base, 3, dims, strides, box);
}

constexpr int TSG_BOX = 8; /* the rows of GLU's TMA store boxes (epilogue_glu's TS: a box per 1 KB half of a warp's buffer) */
template <int MODE, bool GLU = false>
static int launch_tma(EncodeTiledFn enc, const Params &p, int grid, cudaStream_t stream) {
    TmaParams tp;
    memset(&tp, 0, sizeof tp);
    tp.p = p;
    int rc;
    if (MODE == 0 && GLU) {
        rc = tma_row_map(enc, &tp.ta, p.a, p.K, p.Rmax, BM) | tma_w_map(enc, &tp.tbh, p.b, p.E, p.M, p.K, BN / 2) |
             tma_w_map(enc, &tp.tb2, p.b2, p.E, p.M, p.K, BN / 2);
    } else if (MODE == 0) {
        rc = tma_row_map(enc, &tp.ta, p.a, p.K, p.Rmax, BM) | tma_w_map(enc, &tp.tb, p.b, p.E, p.M, p.K, BN);
        if (p.half) rc |= tma_w_map(enc, &tp.tbh, p.b, p.E, p.M, p.K, BN / 2);
    } else if (MODE == 1) {
        rc = tma_row_map(enc, &tp.ta, p.a, p.M, p.Rmax, BM) | tma_w_map(enc, &tp.tb, p.b, p.E, p.M, p.K, BK);
        if (p.a2) rc |= tma_row_map(enc, &tp.ta2, p.a2, p.M, p.Rmax, BM) | tma_w_map(enc, &tp.tb2, p.b2, p.E, p.M, p.K, BK);
    } else {
        rc = tma_row_map(enc, &tp.ta, p.a, p.M, p.Rmax, BK) | tma_row_map(enc, &tp.tb, p.b, p.K, p.Rmax, BK);
    }
    if (rc) return -1;
    if (MODE != 2 && !GLU && p.Rmax > 0) /* the output's map (without it: staged stores) */
        tp.tso = tma_row_map(enc, &tp.to, p.out, p.ncols, p.Rmax, 16) == 0;
    if (GLU && p.Rmax > 0)
        tp.tso = (tma_row_map(enc, &tp.to, p.out, p.M, p.Rmax, TSG_BOX) | tma_row_map(enc, &tp.to2, p.out2, p.M, p.Rmax, TSG_BOX) |
                   (p.out3 ? tma_row_map(enc, &tp.to3, p.out3, p.M, p.Rmax, TSG_BOX) : 0)) == 0;
    void (*kern)(const TmaParams) = gg_tma_kernel<MODE, GLU>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_TMA) != cudaSuccess) return -1;
    kern<<<grid, NT_TMA, SMEM_TMA, stream>>>(tp);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

/* dW's map for the TMA stores: the 5-D view (pp_store_tma's perm) where the driver takes it, else the
   3-D one; -1 when neither can be made */
static int launch_pp(EncodeTiledFn enc, const Params &p, int grid, cudaStream_t stream) {
    TmaParams tp;
    memset(&tp, 0, sizeof tp);
    tp.p = p;
    if (tma_row_map(enc, &tp.ta, p.a, p.M, p.Rmax, BK) | tma_row_map(enc, &tp.tb, p.b, p.K, p.Rmax, BK)) return -1;
    { /* the 5-D view (pp_store_tma): dims K, 2 rows 4 apart, 4 rows 1 apart, M / 8, E */
        const cuuint64_t r = (cuuint64_t)p.K * 4;
        const cuuint64_t dims[5] = {(cuuint64_t)p.K, 2, 4, (cuuint64_t)(p.M / 8), (cuuint64_t)p.E};
        const cuuint64_t strides[4] = {4 * r, r, 8 * r, (cuuint64_t)p.M * r};
        const cuuint32_t box[5] = {32, 2, 4, 2, 1};
        tp.perm = tma_map(enc, &tp.tc, p.out, 5, dims, strides, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32) == 0;
    }
    if (!tp.perm) {
        const cuuint64_t dims[3] = {(cuuint64_t)p.K, (cuuint64_t)p.M, (cuuint64_t)p.E};
        const cuuint64_t strides[2] = {(cuuint64_t)p.K * 4, (cuuint64_t)p.M * p.K * 4};
        const cuuint32_t box[3] = {32, 8, 1};
        if (tma_map(enc, &tp.tc, p.out, 3, dims, strides, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32) != 0) return -1;
    }
    if (cudaFuncSetAttribute(gg_pp_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PP_SMEM) != cudaSuccess) return -1;
    gg_pp_kernel<<<grid, NT_TMA, PP_SMEM, stream>>>(tp);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

/* entries of the dW^2 partials: 8 per tile without row splits, SSQ_BLOCKS with them */
constexpr long long SSQ_BLOCKS = 1024;
static long long ssq_need(int E, int M, int K) {
    const long long t8 = (long long)E * ((M + BM - 1) / BM) * ((K + BN - 1) / BN) * 8;
    return t8 > SSQ_BLOCKS ? t8 : SSQ_BLOCKS;
}

/* variant: 2 = TMA + wgmma (warp-specialized; mode 2 without row splits: gg_pp_kernel), the runtime's;
   1 = cp.async + wgmma (gg_kernel), what variant 2 falls back to on a driver without tensor maps (the
   benches also ask for it, to check it) */
static int gg_run(int variant, int mode, void *out, const void *a, const void *b, const int *d_offs, int E, int M, int K,
                  int Rmax, void *ws, cudaStream_t stream, const void *a2 = nullptr, const void *b2 = nullptr,
                  float *ssq = nullptr, long long ssq_len = 0, int nsm = 0) {
    if (!args_ok(mode, E, M, K, Rmax)) return -1;
    if (variant < 1 || variant > 2) return -1;
    bool pp = mode == 2 && variant == 2;
    if (ssq && (mode != 2 || ssq_len < ssq_need(E, M, K))) return -1;
    if (!out || !a || !b || !d_offs || (!a2 != !b2) || (a2 && mode != 1)) return -1;
    if ((((uintptr_t)out) | ((uintptr_t)a) | ((uintptr_t)b) | ((uintptr_t)ws) | ((uintptr_t)a2) | ((uintptr_t)b2)) & 15u) return -1;
    if (nsm <= 0 && num_sms(&nsm) != 0) return -1;   /* the library passes the binding's count; benches use the current device */
    const int S = split_count(mode, E, M, K, Rmax, nsm);
    if (S > 1 && !ws) return -1;
    EncodeTiledFn enc = variant == 2 ? tma_encoder() : nullptr;
    if (variant == 2 && !enc) variant = 1; /* a driver without tensor maps: the same tiles through cp.async */
    if (S > 1 || variant != 2) pp = false;

    Params p;
    p.out = out;
    p.a = reinterpret_cast<const bf16 *>(a);
    p.b = reinterpret_cast<const bf16 *>(b);
    p.offs = d_offs;
    p.a2 = reinterpret_cast<const bf16 *>(a2);
    p.ssq = (ssq && S == 1) ? ssq : nullptr;
    p.out2 = p.out3 = nullptr;
    p.b2 = reinterpret_cast<const bf16 *>(b2);
    /* every mode: a static round robin. (A dynamic ticket counter for mode 2 was
     * measured on H200 to change bits between runs; the static schedule does not.) */
    p.part = (S > 1) ? reinterpret_cast<float *>(reinterpret_cast<char *>(ws) + WS_HEADER) : reinterpret_cast<float *>(out);
    p.E = E; p.M = M; p.K = K; p.Rmax = Rmax;
    p.ncols = (mode == 0) ? M : K;
    p.ct = (p.ncols + BN - 1) / BN;
    /* the TMA kernel pairs the rows of a last column tile of <= 128 columns into 256 x 128 tiles */
    p.half = (variant == 2 && p.ncols % BN != 0 && p.ncols % BN <= BN / 2) ? 1 : 0;
    p.ctf = p.ct - p.half;
    p.nk01 = (mode == 0) ? (K + BK - 1) / BK : (M + BK - 1) / BK;
    p.nkh = p.nk01;
    if (a2) p.nk01 *= 2;
    p.S = S;
    p.ntm = (M + BM - 1) / BM;
    long long tiles;
    p.pair = 0;
    if (pp) {
        tiles = (long long)E * p.ntm * ((K + PP_BN - 1) / PP_BN);
        if (tiles > INT_MAX / 8) return -1;
        p.T2 = (int)tiles;
    } else if (mode == 2) {
        tiles = (long long)E * S * ((long long)p.ntm * p.ctf + p.half * ((p.ntm + 1) / 2));
        if (tiles > INT_MAX / 2) return -1;
        p.T2 = (int)tiles;
    } else {
        tiles = ((long long)Rmax / BM + E) * p.ct; /* upper bound on the row tiles */
        if (tiles > INT_MAX / 2) return -1;
        p.T2 = 0;
        if (Rmax == 0) return 0; /* nothing to write */
    }
    const int grid = (int)(tiles < nsm ? tiles : nsm);
    /* entries no tile or block writes read as zero; gg_pp_kernel writes entries [0, 4 tiles) and zeroes
       the rest itself */
    p.ssq_z0 = p.ssq_z1 = 0;
    if (ssq && pp && ssq_len <= INT_MAX) {
        p.ssq_z0 = (int)(4 * tiles);
        p.ssq_z1 = (int)ssq_len;
    } else if (ssq && (S > 1 || tiles * (pp ? 4 : 8) < ssq_len))
        if (cudaMemsetAsync(ssq, 0, (size_t)ssq_len * sizeof(float), stream) != cudaSuccess) return -1;
    int rc;
    if (pp) {
        rc = launch_pp(enc, p, grid, stream);
    } else if (variant == 2) {
        rc = mode == 0 ? launch_tma<0>(enc, p, grid, stream)
           : mode == 1 ? launch_tma<1>(enc, p, grid, stream) : launch_tma<2>(enc, p, grid, stream);
    } else {
        rc = mode == 0 ? launch_main<0>(p, grid, stream)
           : mode == 1 ? launch_main<1>(p, grid, stream) : launch_main<2>(p, grid, stream);
    }
    if (rc != 0) return -1;
    if (S > 1) {
        const long long n4 = (long long)E * M * K / 4;
        long long blocks = (n4 + 255) / 256;
        if (blocks > (long long)nsm * 8) blocks = (long long)nsm * 8;
        if (ssq && blocks > SSQ_BLOCKS) blocks = SSQ_BLOCKS;
        gg_reduce_kernel<<<(int)blocks, 256, 0, stream>>>(reinterpret_cast<float4 *>(out), reinterpret_cast<const float4 *>(p.part),
                                                          n4, S, ssq);
        if (cudaGetLastError() != cudaSuccess) return -1;
    }
    return 0;
}

/* Gate and up projections of the same rows in one launch, and the SwiGLU (GMM_GLU):
 *   g[r, m] = sum_k X[r, k] Wg[e, m, k],  u likewise with Wu,  h = silu(g) u  (h optional: NULL)
 * On the TMA kernel (variant 2) as one work list: 256-column tiles whose first 128 columns are g's
 * and last 128 u's same columns, so ceil(M / 128) full-width column tiles (mid's 1408: 11, where
 * two launches take 5 full and a half-wide one each) and the SwiGLU in the epilogue from the
 * bf16-rounded g and u, as k_swiglu computes it.  Each element of g and u sees the same k16 slices
 * in the same order as in its own launch: the same bits as two launches and k_swiglu, which is what
 * the cp.async variant runs (and the tests compare against).
 * On H200, mid's shapes, 600-610 TFLOP/s against 565-570 for two launches and k_swiglu (figures, and the
 * backward's counterpart that was measured and not kept: docs/KERNELS.md). */
static int gg_run_glu(int variant, void *g, void *u, void *h, const void *x, const void *wg, const void *wu, const int *d_offs,
                      int E, int M, int K, int Rmax, cudaStream_t stream, int nsm = 0) {
    if (!args_ok(0, E, M, K, Rmax) || !g || !u || !x || !wg || !wu || !d_offs || variant < 1 || variant > 2) return -1;
    if ((((uintptr_t)g) | ((uintptr_t)u) | ((uintptr_t)h) | ((uintptr_t)x) | ((uintptr_t)wg) | ((uintptr_t)wu)) & 15u) return -1;
    if (nsm <= 0 && num_sms(&nsm) != 0) return -1;
    EncodeTiledFn enc = variant == 2 ? tma_encoder() : nullptr;
    if (variant != 2 || !enc) { /* two launches of the cp.async kernel and k_swiglu */
        const int v = 1;
        if (gg_run(v, 0, g, x, wg, d_offs, E, M, K, Rmax, nullptr, stream, nullptr, nullptr, nullptr, 0, nsm) ||
            gg_run(v, 0, u, x, wu, d_offs, E, M, K, Rmax, nullptr, stream, nullptr, nullptr, nullptr, 0, nsm))
            return -1;
        const long long n = (long long)Rmax * M;
        if (h && n > 0) {
            long long blocks = (n / 8 + 1 + 255) / 256;
            if (blocks > 65536) blocks = 65536;
            k_swiglu<<<(unsigned)blocks, 256, 0, stream>>>((bf16 *)h, (const bf16 *)g, (const bf16 *)u, n, NULL, 0);
            if (cudaGetLastError() != cudaSuccess) return -1;
        }
        return 0;
    }
    Params p;
    memset(&p, 0, sizeof p);
    p.out = g; p.out2 = u; p.out3 = h;
    p.a = reinterpret_cast<const bf16 *>(x);
    p.b = reinterpret_cast<const bf16 *>(wg);
    p.b2 = reinterpret_cast<const bf16 *>(wu);
    p.offs = d_offs;
    p.part = nullptr;
    p.E = E; p.M = M; p.K = K; p.Rmax = Rmax;
    p.ct = (M + BN / 2 - 1) / (BN / 2);
    p.ncols = p.ct * BN;   /* virtual: 256 columns a tile, the half of g's and the half of u's */
    p.half = 0;
    p.ctf = p.ct;
    p.nk01 = p.nkh = (K + BK - 1) / BK;
    p.S = 1;
    p.ntm = (M + BM - 1) / BM;
    const long long tiles = ((long long)Rmax / BM + E) * p.ct;
    if (tiles > INT_MAX / 2) return -1;
    if (Rmax == 0) return 0;
    const int grid = (int)(tiles < nsm ? tiles : nsm);
    return launch_tma<0, true>(enc, p, grid, stream);
}

static size_t gg_workspace(int mode, int E, int M, int K, int Rmax, int nsm) {
    if (!args_ok(mode, E, M, K, Rmax)) return 0;
    if (mode != 2) return 0;
    const int S = split_count(mode, E, M, K, Rmax, nsm);
    return WS_HEADER + (S > 1 ? (size_t)S * E * M * K * sizeof(float) : 0);
}

} /* namespace mt_ggk */

extern "C" {
size_t mt_cuda_gmm_workspace(mt_cuda *c, int mode, int E, int M, int K, int Rmax) { return mt_ggk::gg_workspace(mode, E, M, K, Rmax, c->split_sms); }
/* The expert offsets stay on the device: no host synchronization; an expert
 * with no tokens costs nothing (modes 0/1) or a zero tile (mode 2). */
int mt_cuda_gmm(mt_cuda *c, int mode, void *out, const void *a, const void *b, const int32_t *d_offs, int E, int M, int K, int Rmax,
                void *ws, const void *a2, const void *b2, float *ssq, int64_t ssq_len) {
    if (ssq && ssq_len != mt_ggk::ssq_need(E, M, K)) return mt__fail(c, "grouped GEMM", "gradient-norm partials of the wrong length");
    if (mt_ggk::gg_run(2, mode, out, a, b, d_offs, E, M, K, Rmax, ws, c->stream, a2, b2, ssq, ssq_len, c->split_sms)) {
        cudaError_t e = cudaGetLastError();
        return mt__fail(c, "grouped GEMM", e != cudaSuccess ? cudaGetErrorString(e) : "bad arguments (dims must be multiples of 8)");
    }
    return 0;
}

int mt_cuda_gmm_glu(mt_cuda *c, void *g, void *u, void *h, const void *x, const void *wg, const void *wu, const int32_t *d_offs,
                    int E, int M, int K, int Rmax) {
    if (mt_ggk::gg_run_glu(2, g, u, h, x, wg, wu, d_offs, E, M, K, Rmax, c->stream, c->split_sms)) {
        cudaError_t e = cudaGetLastError();
        return mt__fail(c, "grouped GEMM (gate and up)", e != cudaSuccess ? cudaGetErrorString(e) : "bad arguments (dims must be multiples of 8)");
    }
    return 0;
}

/* ========================================================================
 * 9. cross-entropy: one block per row; the mean is a fixed-order sum
 * ====================================================================== */

/* (max, sum of exp) pairs merge associatively; the merge order is fixed */
__device__ __forceinline__ void ms_merge(float &m, float &s, float m2, float s2) {
    float mn = fmaxf(m, m2);
    if (mn == -INFINITY) return;
    s = s * __expf(m - mn) + s2 * __expf(m2 - mn);
    m = mn;
}
}  /* extern "C": the cross-entropy kernels are templates */
#define MT_CE_UNROLL 4          /* 16-byte chunks per thread in flight */
/* chunk d of a row of logits as floats; past the row end -inf (contributes nothing) */
template <bool V>
__device__ __forceinline__ void mt__ce_ld(float (&f)[8], const bf16 *l, int d, int V_) {
    if constexpr (V) {
        unpack8(f, *(const uint4 *)(l + d));
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) f[j] = d + j < V_ ? bf(l[d + j]) : -INFINITY;
    }
}
/* One row's (max, sum of exp), one block per row, one pass: each thread folds MT_CE_UNROLL chunks at a
 * time into its running pair with one rescale, then the threads' pairs merge in a fixed order. Thread 0
 * returns the row's pair. */
template <bool V>
__device__ __forceinline__ void mt__ce_row(float &m_out, float &z_out, const bf16 *l, int V_) {
    __shared__ float shm[32], shs[32];
    float m = -INFINITY, z = 0;
    for (int d0 = threadIdx.x * 8; d0 < V_; d0 += MT_CE_UNROLL * 8 * blockDim.x) {
        float f[MT_CE_UNROLL][8];
#pragma unroll
        for (int u = 0; u < MT_CE_UNROLL; u++) {
            int d = d0 + u * 8 * blockDim.x;
            if (d < V_) mt__ce_ld<V>(f[u], l, d, V_);
            else
#pragma unroll
                for (int j = 0; j < 8; j++) f[u][j] = -INFINITY;
        }
        float lm = m;
#pragma unroll
        for (int u = 0; u < MT_CE_UNROLL; u++)
#pragma unroll
            for (int j = 0; j < 8; j++) lm = fmaxf(lm, f[u][j]);
        if (lm == -INFINITY) continue;
        float s = 0;
#pragma unroll
        for (int u = 0; u < MT_CE_UNROLL; u++)
#pragma unroll
            for (int j = 0; j < 8; j++) s += __expf(f[u][j] - lm);
        z = z * __expf(m - lm) + s;
        m = lm;
    }
    for (int o = 16; o > 0; o >>= 1) ms_merge(m, z, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, z, o));
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) { shm[w] = m; shs[w] = z; }
    __syncthreads();
    if (w == 0) {
        m = lane < (int)(blockDim.x >> 5) ? shm[lane] : -INFINITY;
        z = lane < (int)(blockDim.x >> 5) ? shs[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) ms_merge(m, z, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, z, o));
    }
    m_out = m; z_out = z;
}
template <bool V>
__global__ void __launch_bounds__(256) k_ce_fwd(float *per, float *lse, const bf16 *logits, const int32_t *tgt, int V_) {
    int64_t n = blockIdx.x;
    const bf16 *l = logits + n * V_;
    float m, z;
    mt__ce_row<V>(m, z, l, V_);
    if (threadIdx.x == 0) {
        float L = m + logf(z);
        lse[n] = L;
        per[n] = tgt[n] < 0 ? 0.0f : L - bf(l[tgt[n]]);   /* a target < 0 (multi-token prediction past the sequence) counts nothing */
    }
}
/* dlogits = (softmax - onehot) * inv, element by element as before; 16-byte chunks, MT_CE_UNROLL in flight.
 * t0: the row's first vocab entry (a vocab shard under tensor parallelism; 0 for the whole vocabulary).
 * A row whose target is < 0 is not in the loss: its dlogits are 0 (inv 0 there gives exact zeros). */
template <bool V>
__global__ void __launch_bounds__(256) k_ce_bwd(bf16 *dl, const bf16 *logits, const float *lse, const int32_t *tgt, int V_, float inv,
                                                int t0) {
    int64_t n = blockIdx.x;
    float L = lse[n];
    int t = tgt[n] - t0;
    if (tgt[n] < 0) { inv = 0.0f; t = -1; }
    const bf16 *l = logits + n * V_;
    bf16 *o = dl + n * V_;
    for (int d0 = threadIdx.x * 8; d0 < V_; d0 += MT_CE_UNROLL * 8 * blockDim.x) {
        uint4 u[MT_CE_UNROLL];
#pragma unroll
        for (int k = 0; k < MT_CE_UNROLL; k++) {
            int d = d0 + k * 8 * blockDim.x;
            if (d < V_) u[k] = ld8<V>(l, d, V_);
        }
#pragma unroll
        for (int k = 0; k < MT_CE_UNROLL; k++) {
            int d = d0 + k * 8 * blockDim.x;
            if (d < V_) {
                float f[8];
                unpack8(f, u[k]);
#pragma unroll
                for (int j = 0; j < 8; j++) f[j] = (__expf(f[j] - L) - (d + j == t ? 1.0f : 0.0f)) * inv;
                st8<V>(o, d, V_, f);
            }
        }
    }
}
extern "C" {
__global__ void k_mean(float *out, const float *x, int N, int count) {   /* the sum of x over count rows */
    __shared__ float sh[32];
    float acc = 0;
    for (int i = threadIdx.x; i < N; i += blockDim.x) acc += x[i];
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0) out[0] = acc / count;
}
size_t mt_cuda_cross_entropy_workspace(int N) { return mt__al((size_t)N * 4); }
int mt_cuda_cross_entropy_forward(mt_cuda *c, float *loss, float *lse, const void *logits, const int32_t *tgt, int N, int V, int count,
                                  void *ws) {
    if (N <= 0) return 0;
    if (mt__rows16(V, 2, logits)) k_ce_fwd<true><<<N, 256, 0, c->stream>>>((float *)ws, lse, (const bf16 *)logits, tgt, V);
    else k_ce_fwd<false><<<N, 256, 0, c->stream>>>((float *)ws, lse, (const bf16 *)logits, tgt, V);
    LAUNCHED();
    k_mean<<<1, 1024, 0, c->stream>>>(loss, (const float *)ws, N, count > 0 ? count : N);
    LAUNCHED();
    return 0;
}
int mt_cuda_cross_entropy_backward(mt_cuda *c, void *dlogits, const void *logits, const float *lse, const int32_t *tgt, int N, int V,
                                   float inv) {
    return mt_cuda_ce_shard_backward(c, dlogits, logits, lse, tgt, N, V, 0, inv);
}
int mt_cuda_ce_shard_backward(mt_cuda *c, void *dlogits, const void *logits, const float *lse, const int32_t *tgt, int N, int Vl, int v0,
                              float inv) {
    if (N <= 0) return 0;
    if (mt__rows16(Vl, 2, dlogits, logits))
        k_ce_bwd<true><<<N, 256, 0, c->stream>>>((bf16 *)dlogits, (const bf16 *)logits, lse, tgt, Vl, inv, v0);
    else k_ce_bwd<false><<<N, 256, 0, c->stream>>>((bf16 *)dlogits, (const bf16 *)logits, lse, tgt, Vl, inv, v0);
    LAUNCHED();
    return 0;
}
/* Multi-token prediction's shifted tokens and targets (see mt_cpu_shift_tokens): one thread per position. */
__global__ void k_shift_tokens(int32_t *y, const int32_t *x, int N, int T, int k, int fill) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    y[i] = i % T + k < T ? x[i + k] : fill;
}
int mt_cuda_shift_tokens(mt_cuda *c, int32_t *y, const int32_t *x, int N, int T, int k, int fill) {
    if (N <= 0) return 0;
    k_shift_tokens<<<(N + 255) / 256, 256, 0, c->stream>>>(y, x, N, T, k, fill);
    LAUNCHED();
    return 0;
}
}  /* extern "C": the shard statistics kernel is a template */

/* The cross-entropy on a vocab shard (tensor parallelism), one block per row: the shard's (max, sum of exp)
 * as the whole-vocabulary kernel forms them, and the target's logit where this shard holds it (else 0).
 * The shards' rows are then gathered and combined in shard order, the same bits on every rank. */
template <bool V>
__global__ void __launch_bounds__(256) k_ce_stats(float *st, const bf16 *logits, const int32_t *tgt, int V_, int v0) {
    int64_t n = blockIdx.x;
    const bf16 *l = logits + n * V_;
    float m, z;
    mt__ce_row<V>(m, z, l, V_);
    if (threadIdx.x == 0) {
        int t = tgt[n] - v0;
        st[3 * n] = m; st[3 * n + 1] = z; st[3 * n + 2] = t >= 0 && t < V_ ? bf(l[t]) : 0.0f;
    }
}
extern "C" {
/* lse[n] = M + log(sum_k z_k exp(m_k - M)) over the S shards in order; per[n] = lse - the target's logit */
__global__ void k_ce_combine(float *per, float *lse, const float *st, const int32_t *tgt, int S, int N) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    float m = st[3 * n], z = 0, t = 0;
    for (int k = 1; k < S; k++) m = fmaxf(m, st[3 * ((int64_t)k * N + n)]);
    for (int k = 0; k < S; k++) {
        const float *x = st + 3 * ((int64_t)k * N + n);
        z += x[1] * __expf(x[0] - m);
        t += x[2];
    }
    float L = m + logf(z);
    lse[n] = L;
    per[n] = tgt[n] < 0 ? 0.0f : L - t;
}
int mt_cuda_ce_stats(mt_cuda *c, float *st, const void *logits, const int32_t *tgt, int N, int Vl, int v0) {
    if (N <= 0) return 0;
    if (mt__rows16(Vl, 2, logits)) k_ce_stats<true><<<N, 256, 0, c->stream>>>(st, (const bf16 *)logits, tgt, Vl, v0);
    else k_ce_stats<false><<<N, 256, 0, c->stream>>>(st, (const bf16 *)logits, tgt, Vl, v0);
    LAUNCHED();
    return 0;
}
int mt_cuda_ce_combine(mt_cuda *c, float *loss, float *lse, const float *st, const int32_t *tgt, int S, int N, int count, void *ws) {
    if (N <= 0) return 0;
    k_ce_combine<<<(N + 255) / 256, 256, 0, c->stream>>>((float *)ws, lse, st, tgt, S, N);
    LAUNCHED();
    k_mean<<<1, 1024, 0, c->stream>>>(loss, (const float *)ws, N, count > 0 ? count : N);
    LAUNCHED();
    return 0;
}

/* ========================================================================
 * 10. optimizer
 * ====================================================================== */

#define MT_SUMSQ_BLOCKS 1024   /* at most; the count depends on n only, never on the GPU: a fixed summation order */
#define MT_SUMSQ_PER 16384     /* elements per block before another block is added */
#define MT_SUMSQ_ONE 65536     /* up to this many elements one block sums them and adds acc_in itself (one launch) */
#define MT_MULTI_PARTS 16384   /* partials of one multi-tensor launch (its workspace, then one sum a tensor) */
#define MT_MULTI_SUMSQ 96      /* tensors of one multi-tensor launch (its table: under 4 KB of parameters) */
#define MT_MULTI_ADAMW 64
/* squares = 0: g already holds squares (a GEMM epilogue's partials): a plain sum.
 * Each thread folds four float4 per step (64 bytes in flight), in index order within the step.
 * One block (out set): out[0] = in[0] + the sum; otherwise part[block] = the block's sum. */
/* one block's share of a sum of n floats (squares: of their squares) as block lb of nb: the thread's
   partial, before the block's reduction (the single- and multi-tensor kernels share it: the same bits) */
__device__ __forceinline__ float sumsq_fold(const float *g, int64_t n, int squares, int64_t lb, int64_t nb) {
    float acc = 0;
    int64_t t = lb * (int64_t)blockDim.x + threadIdx.x, stride = nb * blockDim.x;
    if (n % 4 == 0 && !((uintptr_t)g & 15)) {
        const float4 *g4 = (const float4 *)g;
        int64_t n4 = n / 4, i = t;
        for (; i + 3 * stride < n4; i += 4 * stride) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) v[u] = g4[i + u * stride];
#pragma unroll
            for (int u = 0; u < 4; u++)
                acc += squares ? v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w : v[u].x + v[u].y + v[u].z + v[u].w;
        }
        for (; i < n4; i += stride) {
            float4 v = g4[i];
            acc += squares ? v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w : v.x + v.y + v.z + v.w;
        }
    } else if (!squares) {
        for (int64_t i = t; i < n; i += stride) acc += g[i];
    } else {
        for (int64_t i = t; i < n; i += stride) acc += g[i] * g[i];
    }
    return acc;
}
__global__ void __launch_bounds__(256) k_sumsq_part(float *part, float *out, const float *in, const float *g, int64_t n, int squares) {
    __shared__ float sh[32];
    float acc = block_sum(sumsq_fold(g, n, squares, blockIdx.x, gridDim.x), sh);
    if (threadIdx.x) return;
    if (out) out[0] = (in ? in[0] : 0.0f) + acc;
    else part[blockIdx.x] = acc;
}
__global__ void k_sumsq_final(float *out, const float *in, const float *part, int nb) {
    __shared__ float sh[32];
    float acc = block_sum(threadIdx.x < (unsigned)nb ? part[threadIdx.x] : 0.0f, sh);
    if (threadIdx.x == 0) out[0] = (in ? in[0] : 0.0f) + acc;
}
/* the blocks a tensor of n floats is summed in: one up to MT_SUMSQ_ONE (it adds acc_in itself), else
   one per MT_SUMSQ_PER, at most MT_SUMSQ_BLOCKS, whose partials one block of MT_SUMSQ_BLOCKS sums */
static int64_t mt__sumsq_blocks(int64_t n) {
    if (n <= MT_SUMSQ_ONE) return 1;
    int64_t nb = (n + MT_SUMSQ_PER - 1) / MT_SUMSQ_PER;
    return nb > MT_SUMSQ_BLOCKS ? MT_SUMSQ_BLOCKS : nb;
}
size_t mt_cuda_sumsq_workspace(void) { return mt__al((MT_MULTI_PARTS + MT_MULTI_SUMSQ) * 4); }
int mt_cuda_sumsq(mt_cuda *c, float *acc_out, const float *acc_in, const float *g, int64_t n, int squares, void *ws) {
    int64_t nb = mt__sumsq_blocks(n);
    if (nb == 1) {
        k_sumsq_part<<<1, 256, 0, c->stream>>>(NULL, acc_out, acc_in, g, n, squares);
        LAUNCHED();
        return 0;
    }
    k_sumsq_part<<<(unsigned)nb, 256, 0, c->stream>>>((float *)ws, NULL, NULL, g, n, squares);
    LAUNCHED();
    k_sumsq_final<<<1, MT_SUMSQ_BLOCKS, 0, c->stream>>>(acc_out, acc_in, (const float *)ws, (int)nb);   /* one thread per partial */
    LAUNCHED();
    return 0;
}
/* Multi-tensor launches: a run of nodes as one launch, each tensor's blocks a contiguous range of
 * the grid (boff), the table passed by value (under 4 KB). A block does what block lb of the
 * tensor's own launch of nb blocks would (the same fold, the same reduction), so the results are
 * bitwise those of the launches one by one. */
struct SumsqTab {
    int count;
    const float *acc_in;                      /* the chain's input (NULL: 0) */
    int boff[MT_MULTI_SUMSQ + 1];             /* tensor e's blocks: [boff[e], boff[e + 1]) */
    const float *g[MT_MULTI_SUMSQ];
    float *out[MT_MULTI_SUMSQ];               /* acc_out of tensor e = acc_out of e - 1 + its sum */
    int64_t n[MT_MULTI_SUMSQ];
    int sq[MT_MULTI_SUMSQ];
};
struct AdamwTab {                             /* 3.7 KB: kernel parameters stay under the classic 4 KB */
    int count;
    int boff[MT_MULTI_ADAMW + 1];
    float *p[MT_MULTI_ADAMW];
    void *m[MT_MULTI_ADAMW], *v[MT_MULTI_ADAMW];   /* f32, or bf16 where bf16m[e] */
    bf16 *p16[MT_MULTI_ADAMW];
    const float *g[MT_MULTI_ADAMW];
    int64_t n[MT_MULTI_ADAMW];
    int decay[MT_MULTI_ADAMW];
    unsigned char bf16m[MT_MULTI_ADAMW];
};
__device__ __forceinline__ int multi_entry(const int *boff, int count) {   /* the tensor block blockIdx.x belongs to */
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (boff[mid] <= (int)blockIdx.x) lo = mid; else hi = mid - 1;
    }
    return lo;
}
__global__ void __launch_bounds__(256) k_sumsq_multi_part(float *part, const __grid_constant__ SumsqTab t) {
    __shared__ float sh[32];
    int e = multi_entry(t.boff, t.count), b0 = t.boff[e];
    float acc = block_sum(sumsq_fold(t.g[e], t.n[e], t.sq[e], (int64_t)blockIdx.x - b0, t.boff[e + 1] - b0), sh);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}
/* each tensor's sum, one block a tensor: a one-block tensor's partial is its sum (k_sumsq_part added it
   to acc_in), a larger one's partials sum as k_sumsq_final sums them (one block of MT_SUMSQ_BLOCKS) */
__global__ void k_sumsq_multi_sums(float *sums, const __grid_constant__ SumsqTab t, const float *part) {
    __shared__ float sh[32];
    int e = blockIdx.x, b0 = t.boff[e], nb = t.boff[e + 1] - b0;
    float s = nb == 1 ? part[b0] : block_sum(threadIdx.x < (unsigned)nb ? part[b0 + threadIdx.x] : 0.0f, sh);
    if (threadIdx.x == 0) sums[e] = s;
}
/* the chain, in order: acc_out of tensor e = acc_out of e - 1 + its sum */
__global__ void k_sumsq_multi_chain(const __grid_constant__ SumsqTab t, const float *sums) {
    __shared__ float sh[MT_MULTI_SUMSQ];
    for (int e = threadIdx.x; e < t.count; e += blockDim.x) sh[e] = sums[e];
    __syncthreads();
    if (threadIdx.x) return;
    float acc = t.acc_in ? t.acc_in[0] : 0.0f;
    for (int e = 0; e < t.count; e++) {
        acc = acc + sh[e];
        t.out[e][0] = acc;
    }
}
int mt_cuda_sumsq_multi(mt_cuda *c, const float *acc_in, const mt_cuda_sumsq_item *it, int count, void *ws) {
    for (int i = 0; i < count;) {   /* chunks of at most MT_MULTI_SUMSQ tensors and MT_MULTI_PARTS partials */
        SumsqTab t;
        memset(&t, 0, sizeof t);
        t.acc_in = i ? it[i - 1].acc_out : acc_in;
        int nb = 0;
        while (i < count && t.count < MT_MULTI_SUMSQ && nb + mt__sumsq_blocks(it[i].n) <= MT_MULTI_PARTS) {
            int e = t.count++;
            t.boff[e] = nb;
            t.g[e] = it[i].g; t.out[e] = it[i].acc_out; t.n[e] = it[i].n; t.sq[e] = it[i].squares;
            nb += (int)mt__sumsq_blocks(it[i].n);
            i++;
        }
        t.boff[t.count] = nb;
        k_sumsq_multi_part<<<(unsigned)nb, 256, 0, c->stream>>>((float *)ws, t);
        LAUNCHED();
        k_sumsq_multi_sums<<<(unsigned)t.count, MT_SUMSQ_BLOCKS, 0, c->stream>>>((float *)ws + MT_MULTI_PARTS, t, (const float *)ws);
        LAUNCHED();
        k_sumsq_multi_chain<<<1, 128, 0, c->stream>>>(t, (const float *)ws + MT_MULTI_PARTS);
        LAUNCHED();
    }
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
/* AdamW with fp32 moments, one step's constants and one element (every kernel that updates a weight with
 * fp32 moments takes these, so they all give the same bits: each operation spelled out, fmas included, so that no
 * kernel's surroundings change how the compiler contracts them) */
struct AdamwF32 { float b1, b2, eps, wd, lr, coef, bc2s, step_size; };
__device__ __forceinline__ AdamwF32 adamw_f32_setup(const float *lrp, const float *coefp, const float *hp, const int32_t *step, int decay) {
    AdamwF32 k;
    k.b1 = hp[MT_HP_BETA1]; k.b2 = hp[MT_HP_BETA2]; k.eps = hp[MT_HP_EPS]; k.wd = decay ? hp[MT_HP_WD] : 0.0f;
    k.lr = lrp[0]; k.coef = coefp[0];
    int ts = step[0] + 1;
    float bc1 = 1.0f - powf(k.b1, (float)ts);
    k.bc2s = sqrtf(1.0f - powf(k.b2, (float)ts)); k.step_size = k.lr / bc1;
    return k;
}
__device__ __forceinline__ float adamw_f32_elem(const AdamwF32 &k, float p, float g, float &m, float &v) {
    const float gi = __fmul_rn(g, k.coef), c1 = __fsub_rn(1.f, k.b1), c2 = __fsub_rn(1.f, k.b2);
    m = __fmaf_rn(k.b1, m, __fmul_rn(c1, gi));
    v = __fmaf_rn(k.b2, v, __fmul_rn(__fmul_rn(c2, gi), gi));
    const float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bc2s), k.eps);
    return __fmaf_rn(p, __fsub_rn(1.f, __fmul_rn(k.lr, k.wd)), -__fdiv_rn(__fmul_rn(k.step_size, m), den));
}
/* AdamW on the elements block lb of nb covers (grid-stride over float4 when aligned) */
__device__ __forceinline__ void adamw_elems(float *p, float *m, float *v, bf16 *p16, const float *g, int64_t n, const float *lrp,
                                            const float *coefp, const float *hp, const int32_t *step, int decay, int64_t lb, int64_t nb) {
    const AdamwF32 k = adamw_f32_setup(lrp, coefp, hp, step, decay);
    int64_t t = lb * (int64_t)blockDim.x + threadIdx.x, stride = nb * blockDim.x;
    if (n % 4 == 0 && !(((uintptr_t)p | (uintptr_t)m | (uintptr_t)v | (uintptr_t)g) & 15) && !((uintptr_t)p16 & 7)) {
        for (int64_t i = t; i < n / 4; i += stride) {
            float4 P = ((float4 *)p)[i], G = ((const float4 *)g)[i], Mv = ((float4 *)m)[i], Vv = ((float4 *)v)[i];
            float *pp = &P.x, *gg = &G.x, *mm = &Mv.x, *vv = &Vv.x;
#pragma unroll
            for (int j = 0; j < 4; j++) pp[j] = adamw_f32_elem(k, pp[j], gg[j], mm[j], vv[j]);
            ((float4 *)p)[i] = P; ((float4 *)m)[i] = Mv; ((float4 *)v)[i] = Vv;
            if (p16) {
                __nv_bfloat162 lo = __floats2bfloat162_rn(P.x, P.y), hi = __floats2bfloat162_rn(P.z, P.w);
                uint2 u;
                memcpy(&u.x, &lo, 4); memcpy(&u.y, &hi, 4);
                ((uint2 *)p16)[i] = u;
            }
        }
        return;
    }
    for (int64_t i = t; i < n; i += stride) {
        float mi = m[i], vi = v[i], pi = adamw_f32_elem(k, p[i], g[i], mi, vi);
        m[i] = mi; v[i] = vi; p[i] = pi;
        if (p16) p16[i] = tobf(pi);
    }
}
/* AdamW with bf16 moments (mt_pass_bf16_moments): mt_adamw_bf16_elem (moetrain.h) per element, the
 * float32 CPU build's operations one for one (each rounded once, no FMA), so p, m and v come out with
 * its bits. 22 bytes an element move instead of fp32 moments' 30: the step is bandwidth-bound, so
 * this is the saving. Four elements a step where aligned (float4 of p and g, 8 bytes of each moment). */
__device__ __forceinline__ void adamw_elems_bf16(float *p, uint16_t *m, uint16_t *v, bf16 *p16, const float *g, int64_t n,
                                                 const float *lrp, const float *coefp, const float *hp, const int32_t *step, int decay,
                                                 int64_t lb, int64_t nb) {
    mt_adamw_k k;
    mt_adamw_bf16_setup(&k, hp, lrp[0], coefp[0], step[0], decay);
    int64_t t = lb * (int64_t)blockDim.x + threadIdx.x, stride = nb * blockDim.x;
    if (n % 4 == 0 && !(((uintptr_t)p | (uintptr_t)g) & 15) && !(((uintptr_t)m | (uintptr_t)v | (uintptr_t)p16) & 7)) {
        for (int64_t i = t; i < n / 4; i += stride) {
            float4 P = ((float4 *)p)[i], G = ((const float4 *)g)[i];
            uint2 M = ((uint2 *)m)[i], V = ((uint2 *)v)[i];
            float *pp = &P.x, *gg = &G.x;
            uint16_t mm[4] = {(uint16_t)M.x, (uint16_t)(M.x >> 16), (uint16_t)M.y, (uint16_t)(M.y >> 16)};
            uint16_t vv[4] = {(uint16_t)V.x, (uint16_t)(V.x >> 16), (uint16_t)V.y, (uint16_t)(V.y >> 16)};
#pragma unroll
            for (int j = 0; j < 4; j++) pp[j] = mt_adamw_bf16_elem(&k, pp[j], gg[j], &mm[j], &vv[j]);
            ((float4 *)p)[i] = P;
            ((uint2 *)m)[i] = make_uint2(mm[0] | (uint32_t)mm[1] << 16, mm[2] | (uint32_t)mm[3] << 16);
            ((uint2 *)v)[i] = make_uint2(vv[0] | (uint32_t)vv[1] << 16, vv[2] | (uint32_t)vv[3] << 16);
            if (p16) {
                __nv_bfloat162 lo = __floats2bfloat162_rn(P.x, P.y), hi = __floats2bfloat162_rn(P.z, P.w);
                uint2 u;
                memcpy(&u.x, &lo, 4); memcpy(&u.y, &hi, 4);
                ((uint2 *)p16)[i] = u;
            }
        }
        return;
    }
    for (int64_t i = t; i < n; i += stride) {
        float pi = mt_adamw_bf16_elem(&k, p[i], g[i], &m[i], &v[i]);
        p[i] = pi;
        if (p16) p16[i] = tobf(pi);
    }
}
__global__ void k_adamw(float *p, float *m, float *v, bf16 *p16, const float *g, int64_t n, const float *lrp, const float *coefp,
                        const float *hp, const int32_t *step, int decay) {
    adamw_elems(p, m, v, p16, g, n, lrp, coefp, hp, step, decay, blockIdx.x, gridDim.x);
}
__global__ void k_adamw_bf16(float *p, uint16_t *m, uint16_t *v, bf16 *p16, const float *g, int64_t n, const float *lrp, const float *coefp,
                             const float *hp, const int32_t *step, int decay) {
    adamw_elems_bf16(p, m, v, p16, g, n, lrp, coefp, hp, step, decay, blockIdx.x, gridDim.x);
}
__global__ void k_adamw_multi(const __grid_constant__ AdamwTab t, const float *lrp, const float *coefp, const float *hp, const int32_t *step) {
    int e = multi_entry(t.boff, t.count), b0 = t.boff[e];
    if (t.bf16m[e])
        adamw_elems_bf16(t.p[e], (uint16_t *)t.m[e], (uint16_t *)t.v[e], t.p16[e], t.g[e], t.n[e], lrp, coefp, hp, step, t.decay[e],
                         (int64_t)blockIdx.x - b0, t.boff[e + 1] - b0);
    else
        adamw_elems(t.p[e], (float *)t.m[e], (float *)t.v[e], t.p16[e], t.g[e], t.n[e], lrp, coefp, hp, step, t.decay[e],
                    (int64_t)blockIdx.x - b0, t.boff[e + 1] - b0);
}
static unsigned mt__adamw_blocks(int64_t n) {
    unsigned gr = mt__blocks(n / 4 + 1, 256);
    return gr > 65536 ? 65536 : gr;
}
int mt_cuda_adamw(mt_cuda *c, float *p, float *m, float *v, void *p_bf16, const float *g, int64_t n, const float *lr,
                  const float *coef, const float *hp, const int32_t *step, int decay) {
    if (n <= 0) return 0;
    k_adamw<<<mt__adamw_blocks(n), 256, 0, c->stream>>>(p, m, v, (bf16 *)p_bf16, g, n, lr, coef, hp, step, decay);
    LAUNCHED();
    return 0;
}
int mt_cuda_adamw_bf16(mt_cuda *c, float *p, void *m, void *v, void *p_bf16, const float *g, int64_t n, const float *lr,
                       const float *coef, const float *hp, const int32_t *step, int decay) {
    if (n <= 0) return 0;
    k_adamw_bf16<<<mt__adamw_blocks(n), 256, 0, c->stream>>>(p, (uint16_t *)m, (uint16_t *)v, (bf16 *)p_bf16, g, n, lr, coef, hp, step, decay);
    LAUNCHED();
    return 0;
}
int mt_cuda_adamw_multi(mt_cuda *c, const mt_cuda_adamw_item *it, int count, const float *lr, const float *coef, const float *hp,
                        const int32_t *step) {
    for (int i = 0; i < count;) {   /* chunks of at most MT_MULTI_ADAMW tensors; empty ones launch nothing, as alone */
        AdamwTab t;
        memset(&t, 0, sizeof t);
        int64_t nb = 0;
        for (; i < count && t.count < MT_MULTI_ADAMW && nb + mt__adamw_blocks(it[i].n) < INT32_MAX; i++) {
            if (it[i].n <= 0) continue;
            int e = t.count++;
            t.boff[e] = (int)nb;
            t.p[e] = it[i].p; t.m[e] = it[i].m; t.v[e] = it[i].v; t.p16[e] = (bf16 *)it[i].p_bf16; t.g[e] = it[i].g;
            t.n[e] = it[i].n; t.decay[e] = it[i].decay; t.bf16m[e] = it[i].bf16_moments != 0;
            nb += mt__adamw_blocks(it[i].n);
        }
        if (!t.count) continue;
        t.boff[t.count] = (int)nb;
        k_adamw_multi<<<(unsigned)nb, 256, 0, c->stream>>>(t, lr, coef, hp, step);
        LAUNCHED();
    }
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

/* ========================================================================
 * Collectives: the expert exchange's local regrouping, and NCCL
 * ====================================================================== */

__global__ void k_scale(float *x, int64_t n, float s) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) x[i] *= s;
}
int mt_cuda_scale(mt_cuda *c, float *x, int64_t n, float s) {
    if (n <= 0) return 0;
    k_scale<<<mt__blocks(n < (1 << 22) ? n : (1 << 22), 256), 256, 0, c->stream>>>(x, n, s);
    LAUNCHED();
    return 0;
}

/* roffs[e] = rows of my experts before expert e, from recv[P, El] */
__global__ void k_ep_offsets_table(int32_t *roffs, const int32_t *recv, int P, int El) {
    if (threadIdx.x || blockIdx.x) return;
    roffs[0] = 0;
    for (int e = 0; e < El; e++) {
        int32_t n = 0;
        for (int s = 0; s < P; s++) n += recv[s * El + e];
        roffs[e + 1] = roffs[e] + n;
    }
}
int mt_cuda_ep_offsets_table(mt_cuda *c, int32_t *roffs, const int32_t *recv, int P, int El) {
    k_ep_offsets_table<<<1, 1, 0, c->stream>>>(roffs, recv, P, El);
    LAUNCHED();
    return 0;
}

/* Rows arrive from (and leave for) the peers in sender order: chunk (s, e)
 * holds recv[s, e] rows. The grouped GEMMs want them expert-major: chunk
 * (e, s). Each block builds both chunk-start tables in shared memory, then
 * copies whole rows; a destination row finds its chunk by binary search. */
__global__ void k_ep_regroup(uint8_t *dst, const uint8_t *src, const int32_t *recv, int P, int El, int64_t row_bytes,
                             int64_t rows, int to_expert_major) {
    extern __shared__ int32_t tab[];
    const int C = P * El;
    int32_t *em = tab, *sm = tab + C + 1;    /* chunk starts: expert-major (e*P+s), sender-major (s*El+e) */
    if (threadIdx.x == 0) {
        int32_t a = 0;
        for (int e = 0; e < El; e++)
            for (int s = 0; s < P; s++) { em[e * P + s] = a; a += recv[s * El + e]; }
        em[C] = a;
        a = 0;
        for (int s = 0; s < P; s++)
            for (int e = 0; e < El; e++) { sm[s * El + e] = a; a += recv[s * El + e]; }
        sm[C] = a;
    }
    __syncthreads();
    const int32_t *dt = to_expert_major ? em : sm;
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int lo = 0, hi = C - 1;          /* the last chunk starting at or before r: it holds r */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (dt[mid] <= r) lo = mid; else hi = mid - 1;
        }
        int e = to_expert_major ? lo / P : lo % El, s = to_expert_major ? lo % P : lo / El;
        int64_t srow = (to_expert_major ? sm[s * El + e] : em[e * P + s]) + (r - dt[lo]);
        const uint8_t *from = src + srow * row_bytes;
        uint8_t *to = dst + r * row_bytes;
        if (row_bytes % 16 == 0) {
            for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x)
                ((int4 *)to)[i] = ((const int4 *)from)[i];
        } else {
            for (int64_t i = threadIdx.x; i < row_bytes; i += blockDim.x) to[i] = from[i];
        }
    }
}
int mt_cuda_ep_regroup(mt_cuda *c, void *dst, const void *src, const int32_t *recv, int P, int El, int64_t row_bytes,
                       int64_t rows, int to_expert_major) {
    if (rows <= 0) return 0;
    if (P * El > 4096 || rows > INT32_MAX) return mt__fail(c, "mt_cuda_ep_regroup", "more than 4096 chunks or 2^31 rows");
    size_t smem = sizeof(int32_t) * 2 * (size_t)(P * El + 1);
    int grid = rows < 1056 ? (int)rows : 1056;
    k_ep_regroup<<<grid, 128, smem, c->stream>>>((uint8_t *)dst, (const uint8_t *)src, recv, P, El, row_bytes, rows, to_expert_major);
    LAUNCHED();
    return 0;
}

#define NK(x) do { ncclResult_t r_ = (x); if (r_ != ncclSuccess) return mt__fail(c, #x, ncclGetErrorString(r_)); } while (0)

/* --- the device-side expert exchange -------------------------------------
 * (moetrain.h section 9a tells the whole exchange.) One per ep group whose
 * ranks are all load/store accessible (NCCL's LSA team: one node, NVLink or
 * PCIe peer access). Two NCCL symmetric windows over the group's
 * communicator: the arena (so a value has the same offset on every rank and
 * a sender writes rows straight into the receiver's xr or ys) and a small
 * control window:
 *   ctl: ready[P] u64 | data[P] u64 | counts int32 [P][E]
 * Slot ready[s] / data[s] on rank r is written by rank s only. Each exchange
 * op of the group is one round k (a device counter, the same sequence on
 * every rank):
 *   counts  one block: tell every peer "ready k" (my counts area is free),
 *           wait for theirs, write my counts row into every peer's area,
 *           "data k", wait, read the [P][E] matrix into the layer's plan and
 *           lay out both directions (mt_ep_layout).
 *   rows    k_lsa_ready (one block: "ready k": the destination value is free
 *           here, this node's waits are met; then wait for every peer's
 *           ready), k_lsa_rows (warps copy whole rows into the peers'
 *           destination values; the last block to finish tells every peer
 *           "data k"), k_lsa_finish (wait for every peer's data; dispatch
 *           writes roffs; round k done).
 * Only one-block kernels wait. A copy whose every block waited for the
 * peers' ready (one block per SM) could hold every SM while a kernel the
 * peer needs first (an FSDP collective) found no room to start: two GPUs
 * with two MoE chunks stalled so until the timeout, now and then.
 * Signals are release stores and acquire loads at system scope after a
 * system fence. Every wait is bounded (the binding's timeout): a peer that
 * died or hangs sets the error flag (MT_CUDA_FLAG_PEER + its index) and the
 * waiting kernels return; every later wait returns at once; the step
 * reports it. NCCL's own LSA barrier would wait without bound. */
#define MT_LSA_THREADS 512
struct mt_cuda_lsa {
    ncclComm_t comm;
    int P, me, E, grid;
    void *ctl;
    size_t ctl_bytes;
    ncclWindow_t ctl_win, arena_win;
    uint8_t **peer_ctl, **peer_arena;   /* device [P]: each peer's window base as mapped here */
    unsigned long long *epoch;          /* device: rounds done */
    unsigned int *arrive;               /* device: blocks of k_lsa_rows done */
    long long timeout_ns;
};
struct LsaArgs {
    uint8_t *const *peer_ctl, *const *peer_arena;
    unsigned long long *epoch;
    unsigned int *arrive;
    int *flag;
    int P, me, E;
    long long timeout_ns;
};
static LsaArgs lsa_args(mt_cuda *c, const mt_cuda_lsa *l) {
    LsaArgs a = {l->peer_ctl, l->peer_arena, l->epoch, l->arrive, c->flag, l->P, l->me, l->E, l->timeout_ns};
    return a;
}
__device__ __forceinline__ unsigned long long lsa_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void lsa_put(unsigned long long *p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long lsa_get(const unsigned long long *p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
/* after every thread's writes so far: thread t < P sets slot `which` (0 ready, 1 data) of mine on peer t to k */
__device__ void lsa_signal(const LsaArgs &a, int which, unsigned long long k) {
    __threadfence_system();
    __syncthreads();
    for (int t = threadIdx.x; t < a.P; t += blockDim.x) lsa_put((unsigned long long *)a.peer_ctl[t] + which * a.P + a.me, k);
}
/* until every peer has set its slot `which` here to k or more; false (flagged) when one did not in time */
__device__ bool lsa_wait(const LsaArgs &a, int which, unsigned long long k) {
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    const unsigned long long *mine = (const unsigned long long *)a.peer_ctl[a.me] + which * a.P;
    for (int t = threadIdx.x; t < a.P; t += blockDim.x) {
        unsigned long long t0 = lsa_now();
        while (lsa_get(mine + t) < k) {
            if (*(volatile int *)a.flag) { bad = 1; break; }
            if ((long long)(lsa_now() - t0) > a.timeout_ns) { atomicCAS(a.flag, 0, MT_CUDA_FLAG_PEER + t); bad = 1; break; }
            __nanosleep(128);
        }
    }
    __syncthreads();
    return !bad;
}
__global__ void k_lsa_peers(ncclWindow_t ctl, ncclWindow_t arena, uint8_t **pc, uint8_t **pa, int P) {
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        pc[p] = (uint8_t *)ncclGetPeerPointer(ctl, 0, p);
        pa[p] = (uint8_t *)ncclGetPeerPointer(arena, 0, p);
    }
}
/* plan: M [P][E] | dispatch src [E+1], dst [E] | combine src [E+1], dst [E] (El*P = E chunks each way) */
__global__ void __launch_bounds__(MT_LSA_THREADS) k_lsa_counts(LsaArgs a, const int32_t *offs, int32_t *plan, int32_t *recv, int El) {
    const int P = a.P, E = a.E;
    const unsigned long long k = *a.epoch + 1;
    lsa_signal(a, 0, k);
    if (!lsa_wait(a, 0, k)) return;
    for (int i = threadIdx.x; i < P * E; i += blockDim.x) {
        int p = i / E, j = i % E;
        ((int32_t *)(a.peer_ctl[p] + 16 * P))[a.me * E + j] = offs[j + 1] - offs[j];
    }
    lsa_signal(a, 1, k);
    if (!lsa_wait(a, 1, k)) return;
    const volatile int32_t *cnt = (const volatile int32_t *)(a.peer_ctl[a.me] + 16 * P);
    for (int i = threadIdx.x; i < P * E; i += blockDim.x) plan[i] = cnt[i];
    __syncthreads();
    for (int i = threadIdx.x; i < P * El; i += blockDim.x) recv[i] = plan[(i / El) * E + a.me * El + i % El];
    if (threadIdx.x == 0) mt_ep_layout(plan, P, El, a.me, 1, plan + P * E, plan + P * E + E + 1);
    if (threadIdx.x == 32) mt_ep_layout(plan, P, El, a.me, 0, plan + P * E + 2 * E + 1, plan + P * E + 3 * E + 2);
    if (threadIdx.x == 0) *a.epoch = k;
}
__global__ void k_lsa_ready(LsaArgs a) {
    const unsigned long long k = *a.epoch + 1;
    lsa_signal(a, 0, k);
    lsa_wait(a, 0, k);   /* a late peer flags; k_lsa_rows then copies nothing */
}
__global__ void __launch_bounds__(MT_LSA_THREADS) k_lsa_rows(LsaArgs a, int dispatch, const uint8_t *src, size_t dst_off,
                                                             int64_t row_bytes, const int32_t *plan, int El, int64_t cap) {
    extern __shared__ int32_t tab[];    /* chunk starts [E+1], destinations [E] */
    __shared__ int last;
    const int P = a.P, C = a.E;
    const unsigned long long k = *a.epoch + 1;
    if (*(volatile int *)a.flag) return;   /* k_lsa_ready waited for every peer's ready, or flagged */
    const int32_t *ps = plan + P * C + (dispatch ? 0 : 2 * C + 1);
    for (int i = threadIdx.x; i < 2 * C + 1; i += blockDim.x) tab[i] = ps[i];
    __syncthreads();
    const int32_t *cs = tab, *cd = tab + C + 1;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (int64_t r = (int64_t)blockIdx.x * warps + (threadIdx.x >> 5); r < cs[C]; r += (int64_t)gridDim.x * warps) {
        int lo = 0, hi = C - 1;          /* the last chunk starting at or before r: it holds r */
        while (lo < hi) {
            int m = (lo + hi + 1) >> 1;
            if (cs[m] <= r) lo = m; else hi = m - 1;
        }
        int64_t d = cd[lo] + (r - cs[lo]);
        if (d >= cap) { if (lane == 0) atomicCAS(a.flag, 0, MT_CUDA_FLAG_BOUND); continue; }
        const uint8_t *from = src + r * row_bytes;
        uint8_t *to = a.peer_arena[dispatch ? lo / El : lo % P] + dst_off + d * row_bytes;
        if (row_bytes % 16 == 0) {
            const int64_t nv = row_bytes / 16;
            int64_t i = lane;
            for (; i + 96 < nv; i += 128) {   /* four 16-byte loads in flight per lane */
                int4 x0 = ((const int4 *)from)[i], x1 = ((const int4 *)from)[i + 32], x2 = ((const int4 *)from)[i + 64],
                     x3 = ((const int4 *)from)[i + 96];
                ((int4 *)to)[i] = x0; ((int4 *)to)[i + 32] = x1; ((int4 *)to)[i + 64] = x2; ((int4 *)to)[i + 96] = x3;
            }
            for (; i < nv; i += 32) ((int4 *)to)[i] = ((const int4 *)from)[i];
        } else {
            for (int64_t i = lane; i < row_bytes; i += 32) to[i] = from[i];
        }
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.arrive, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) *a.arrive = 0;
    lsa_signal(a, 1, k);
}
__global__ void k_lsa_finish(LsaArgs a, int dispatch, const int32_t *plan, int El, int32_t *roffs, long long *rows_acc) {
    const unsigned long long k = *a.epoch + 1;
    if (!lsa_wait(a, 1, k)) return;
    if (threadIdx.x) return;
    if (dispatch) {   /* my experts' row offsets, summed over the senders */
        int32_t at = 0;
        roffs[0] = 0;
        for (int e = 0; e < El; e++) {
            for (int s = 0; s < a.P; s++) at += plan[s * a.E + a.me * El + e];
            roffs[e + 1] = at;
        }
        if (rows_acc) *rows_acc += at;
    }
    *a.epoch = k;
}

size_t mt_cuda_lsa_plan_ints(int P, int El) { return (size_t)P * P * El + 4 * (size_t)P * El + 2; }

#define MT_SYM_ROUND(n) (((n) + ((size_t)2 << 20) - 1) / ((size_t)2 << 20) * ((size_t)2 << 20))   /* whole 2 MiB pages */
int mt_cuda_malloc_symmetric(mt_cuda *c, void **p, size_t n) {
    *p = NULL;
    n = MT_SYM_ROUND(n ? n : 1);
    CK(cudaSetDevice(c->device));
    ncclResult_t r = ncclMemAlloc(p, n);
    if (r != ncclSuccess) {
        char why[256];
        snprintf(why, sizeof why, "%s (asked %.2f GiB, %.2f GiB already in use)", ncclGetErrorString(r), n / 1073741824.0,
                 c->in_use / 1073741824.0);
        cudaGetLastError();
        return mt__fail(c, "ncclMemAlloc", why);
    }
    c->in_use += n;
    if (c->in_use > c->peak) c->peak = c->in_use;
    return 0;
}
void mt_cuda_free_symmetric(mt_cuda *c, void *p) { (void)c; if (p) ncclMemFree(p); }

int mt_cuda_lsa_create(mt_cuda *c, void *comm, int P, int E, void *arena, size_t arena_bytes, double timeout_s, mt_cuda_lsa **out,
                       char *why, size_t nwhy) {
    *out = NULL;
#if !MT_HAVE_LSA
    (void)comm; (void)P; (void)E; (void)arena; (void)arena_bytes; (void)timeout_s;
    snprintf(why, nwhy, "this NCCL has no device API (2.28 or later)");
    return 1;
#else
    CK(cudaSetDevice(c->device));
    ncclComm_t cm = (ncclComm_t)comm;
    int n = 0, me = 0;
    NK(ncclCommCount(cm, &n));
    NK(ncclCommUserRank(cm, &me));
    ncclTeam_t t = ncclTeamLsa(cm);
    if (n != P) return mt__fail(c, "mt_cuda_lsa_create", "the communicator's size is not the group's");
    if (t.nRanks != P) {
        snprintf(why, nwhy, "only %d of the %d ranks are load/store accessible", t.nRanks, P);
        return 1;
    }
    mt_cuda_lsa *l = (mt_cuda_lsa *)calloc(1, sizeof *l);
    if (!l) return mt__fail(c, "mt_cuda_lsa_create", "out of memory");
    l->comm = cm; l->P = P; l->me = me; l->E = E;
    l->grid = c->n_sms;   /* one block per SM: faster than 66 or 32 (debug dp2 x ep2 on H200s: 18.45, 18.64, 19.32 ms) */
    l->timeout_ns = (long long)((timeout_s > 0 ? timeout_s : 600.0) * 1e9);
    l->ctl_bytes = ((size_t)16 * P + (size_t)4 * P * E + 4095) / 4096 * 4096;
    *out = l;   /* mt_cuda_lsa_destroy frees what follows, made or not */
    NK(ncclMemAlloc(&l->ctl, l->ctl_bytes));
    CK(cudaMalloc((void **)&l->peer_ctl, sizeof(void *) * 2 * (size_t)P));
    CK(cudaMalloc((void **)&l->epoch, 64));
    CK(cudaMemsetAsync(l->ctl, 0, l->ctl_bytes, c->stream));
    CK(cudaMemsetAsync(l->epoch, 0, 64, c->stream));
    l->peer_arena = l->peer_ctl + P;
    l->arrive = (unsigned int *)(l->epoch + 1);
    CK(cudaStreamSynchronize(c->stream));   /* zeroed before any peer can write (the registration is collective) */
    NK(ncclCommWindowRegister(cm, l->ctl, l->ctl_bytes, &l->ctl_win, NCCL_WIN_COLL_SYMMETRIC));
    NK(ncclCommWindowRegister(cm, arena, MT_SYM_ROUND(arena_bytes ? arena_bytes : 1), &l->arena_win, NCCL_WIN_COLL_SYMMETRIC));
    k_lsa_peers<<<1, 256, 0, c->stream>>>(l->ctl_win, l->arena_win, l->peer_ctl, l->peer_arena, P);
    LAUNCHED();
    CK(cudaStreamSynchronize(c->stream));
    return 0;
#endif
}
void mt_cuda_lsa_destroy(mt_cuda *c, mt_cuda_lsa *l, int abort) {
    if (!l) return;
#if MT_HAVE_LSA
    cudaSetDevice(c->device);
    if (!abort) {   /* a deregistration is collective: not with a dead peer */
        if (l->arena_win) ncclCommWindowDeregister(l->comm, l->arena_win);
        if (l->ctl_win) ncclCommWindowDeregister(l->comm, l->ctl_win);
    }
    if (l->ctl) ncclMemFree(l->ctl);
    if (l->peer_ctl) cudaFree(l->peer_ctl);
    if (l->epoch) cudaFree(l->epoch);
#endif
    (void)c; (void)abort;
    free(l);
}
int mt_cuda_lsa_counts(mt_cuda *c, mt_cuda_lsa *l, const int32_t *offs, int32_t *plan, int32_t *recv, int El) {
#if MT_HAVE_LSA
    if (l->P * El != l->E) return mt__fail(c, "mt_cuda_lsa_counts", "experts per rank do not match the window's");
    k_lsa_counts<<<1, MT_LSA_THREADS, 0, c->stream>>>(lsa_args(c, l), offs, plan, recv, El);
    LAUNCHED();
#endif
    (void)c; (void)l; (void)offs; (void)plan; (void)recv; (void)El;
    return 0;
}
int mt_cuda_lsa_rows(mt_cuda *c, mt_cuda_lsa *l, int dispatch, const void *src, size_t dst_offset, int64_t row_bytes,
                     const int32_t *plan, int El, int64_t cap_rows, int32_t *roffs, long long *rows_acc) {
#if MT_HAVE_LSA
    if (l->P * El != l->E) return mt__fail(c, "mt_cuda_lsa_rows", "experts per rank do not match the window's");
    LsaArgs a = lsa_args(c, l);
    size_t smem = sizeof(int32_t) * (2 * (size_t)l->E + 1);
    if (smem > 48 * 1024) return mt__fail(c, "mt_cuda_lsa_rows", "more than 6144 experts");
    k_lsa_ready<<<1, 32, 0, c->stream>>>(a);
    k_lsa_rows<<<l->grid, MT_LSA_THREADS, smem, c->stream>>>(a, dispatch, (const uint8_t *)src, dst_offset, row_bytes, plan, El, cap_rows);
    k_lsa_finish<<<1, 32, 0, c->stream>>>(a, dispatch, plan, El, roffs, rows_acc);
    LAUNCHED();
#endif
    (void)c; (void)l; (void)dispatch; (void)src; (void)dst_offset; (void)row_bytes; (void)plan; (void)El; (void)cap_rows;
    (void)roffs; (void)rows_acc;
    return 0;
}

void *mt_cuda_stream_handle(mt_cuda *c) { return (void *)c->stream; }

static int mt__nccl_type(int dtype, ncclDataType_t *t) {
    switch (dtype) {
    case MT_F32: *t = ncclFloat32; return 0;
    case MT_BF16: *t = ncclBfloat16; return 0;
    case MT_I32: *t = ncclInt32; return 0;
    case -1: *t = ncclFloat64; return 0;
    }
    return -1;
}
int mt_nccl_unique_id(void *id, mt_err *err) {
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess) return mt_errf(err, "ncclGetUniqueId: %s", ncclGetErrorString(r));
    static_assert(sizeof u == MT_NCCL_ID_BYTES, "NCCL unique id size");
    memcpy(id, &u, sizeof u);
    return 0;
}
int mt_nccl_init(mt_cuda *c, void **comm, const void *id, int nranks, int rank) {
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclComm_t cm;
    CK(cudaSetDevice(c->device));
    NK(ncclCommInitRank(&cm, nranks, u, rank));
    *comm = (void *)cm;
    return 0;
}
int mt_nccl_split(mt_cuda *c, void *parent, int color, int key, void **comm) {
    ncclComm_t cm = NULL;
    NK(ncclCommSplit((ncclComm_t)parent, color, key, &cm, NULL));
    *comm = (void *)cm;
    return 0;
}
void mt_nccl_free(void *comm, int abort) {
    if (!comm) return;
    if (abort) ncclCommAbort((ncclComm_t)comm);
    else ncclCommDestroy((ncclComm_t)comm);
}
int mt_nccl_async_error(void *comm, char *msg, size_t n) {
    ncclResult_t r = ncclSuccess;
    if (ncclCommGetAsyncError((ncclComm_t)comm, &r) != ncclSuccess || (r != ncclSuccess && r != ncclInProgress)) {
        snprintf(msg, n, "%s (%s)", ncclGetErrorString(r), ncclGetLastError((ncclComm_t)comm));
        return 1;
    }
    return 0;
}
int mt_nccl_allreduce(mt_cuda *c, void *comm, void *buf, int64_t n, int dtype, int op_max) {
    ncclDataType_t t;
    if (mt__nccl_type(dtype, &t)) return mt__fail(c, "mt_nccl_allreduce", "unsupported dtype");
    if (n > 0) NK(ncclAllReduce(buf, buf, (size_t)n, t, op_max ? ncclMax : ncclSum, (ncclComm_t)comm, c->stream));
    return 0;
}
int mt_nccl_allgather(mt_cuda *c, void *comm, const void *in, void *out, int64_t n, int dtype) {
    ncclDataType_t t;
    if (mt__nccl_type(dtype, &t)) return mt__fail(c, "mt_nccl_allgather", "unsupported dtype");
    if (n > 0) NK(ncclAllGather(in, out, (size_t)n, t, (ncclComm_t)comm, c->stream));
    return 0;
}
int mt_nccl_reduce_scatter(mt_cuda *c, void *comm, const void *in, void *out, int64_t n, int dtype) {
    ncclDataType_t t;
    if (mt__nccl_type(dtype, &t)) return mt__fail(c, "mt_nccl_reduce_scatter", "unsupported dtype");
    if (n > 0) NK(ncclReduceScatter(in, out, (size_t)n, t, ncclSum, (ncclComm_t)comm, c->stream));
    return 0;
}
/* per-peer byte ranges, one NCCL group: every send meets its peer's recv of the same size */
int mt_nccl_exchange(mt_cuda *c, void *comm, int P, const void *send, const int64_t *soff, const int64_t *sbytes,
                     void *recv, const int64_t *roff, const int64_t *rbytes) {
    NK(ncclGroupStart());
    for (int p = 0; p < P; p++) {
        if (sbytes[p] > 0) NK(ncclSend((const uint8_t *)send + soff[p], (size_t)sbytes[p], ncclUint8, p, (ncclComm_t)comm, c->stream));
        if (rbytes[p] > 0) NK(ncclRecv((uint8_t *)recv + roff[p], (size_t)rbytes[p], ncclUint8, p, (ncclComm_t)comm, c->stream));
    }
    NK(ncclGroupEnd());
    return 0;
}

}  /* extern "C" */

/* ========================================================================
 * 11. FP8 (e4m3) GEMMs with DeepSeek-V3's fine-grained scaling
 *
 * What is here: the quantizers (bf16 -> e4m3 + fp32 scales), the dense FP8 GEMM through cuBLASLt's
 * block-scaled FP8 (CUDA 12.9+, Hopper), and a grouped FP8 GEMM for the experts (offsets on the
 * device).  The graph pass --fp8 (moetrain.h) calls them; bench/fp8.cu measures them, test_gpu checks them.
 *
 * Format: e4m3 (1 sign, 4 exponent bits, bias 7, 3 mantissa bits, max 448, no infinities).  A
 * block's scale is s = amax / 448 (fp32, IEEE division), an element's code q = e4m3(x / s): the
 * fp32 quotient rounded to nearest even, saturated at +-448; a block with amax = 0 has s = 0 and all
 * codes 0 (so it dequantizes to exact zeros and no 0/0 is ever formed).  Dequantized: q * s.
 *
 * Layouts (docs/FP8.md has the picture; they are the ones cuBLASLt reads for VEC128_32F and
 * BLK128x128_32F):
 *   rows   ("1 x 128", activations and gradients along their feature axis): x [R][C] -> q [R][C],
 *          s[kb * R + r] for the 128 columns [128 kb, 128 kb + 128) of row r.
 *   cols   ("128 x 1", along the token axis, for dW = dY^T X): x [R][C] with its rows grouped by
 *          offs into E segments -> qt [C][Lp] (transposed), segment e's rows at columns [P_e, P_e +
 *          n_e), P_e = sum_{j<e} roundup(n_j, 128), zero up to P_e + roundup(n_e, 128), so no
 *          128-block straddles two experts; st[(p / 128) * C + c] for the 128 columns [p, p + 128)
 *          of row c.  Lp = mt_cuda_fp8_tpad(Rmax, E) bounds every layout of R <= Rmax rows.
 *   weight ("128 x 128"): w [E][N][K] -> q [E][N][K], s[e][nb][ldk] at (e * nbN + nb) * ldk + kb,
 *          ldk = roundup(ceil(K / 128), 4) (cuBLASLt wants 16-byte aligned scale rows; the padding
 *          entries are written 0).  transpose = 1 gives W^T for dX = dY W: q [E][K][N] and
 *          s[e][kb][ldn] -- the same blocks with the same scales, transposed.
 * GEMMs (both operands K-major, the only FP8 layout of Hopper's tensor cores):
 *   dense  out[Mr][Nc] = sum_k A[Mr][k] B[Nc][k], A "rows"-quantized, B "weight" (forward: X, W;
 *          dX: dY, W^T) or "rows" of the transposed tensors (dW: dY^T, X^T from the "cols" quantizer).
 *   grouped (experts, W [E][M][K], offsets on the device as mt_cuda_gmm):
 *          mode 0  Y[r][m]   = X[r][:] . W[e][m][:]       a = X rows,  b = W weight
 *          mode 1  dX[r][k]  = dY[r][:] . W[e][:][k]      a = dY rows, b = W^T weight (transpose 1)
 *          mode 2  dW[e][m][k] = sum_{r in e} dY[r][m] X[r][k]   a = dY cols, b = X cols;  fp32 out
 * Accumulation: each 128-long slice of the reduction is summed in fp32 by the tensor cores, then
 * promoted: acc += slice * (sa * sb) in fp32 (DeepSeek-V3's promotion every 128 products).
 * ====================================================================== */
#include <cuda_fp8.h>

namespace mt_fp8 {
typedef __nv_bfloat16 bf16;

__host__ __device__ inline int kblocks(int n) { return (n + 127) / 128; }
__host__ __device__ inline int ld_blk(int n) { return (kblocks(n) + 3) & ~3; }
static inline long long tpad(int Rmax, int E) { return ((long long)Rmax + 127LL * E + 127) / 128 * 128; }

__device__ __forceinline__ float scale_of(float amax) { return __fdiv_rn(amax, 448.f); }
/* A block's scale with its reciprocal r = fp32(1 / s); r = 0 where s is outside [2^-125, 2^125] (or 0, or not
   finite): there every quotient is a division. */
struct Q8s { float s, r; };
__device__ __forceinline__ Q8s q8s(float s) { return {s, s >= 0x1p-125f && s <= 0x1p125f ? __frcp_rn(s) : 0.f}; }
/* fp32(x / s) without the division: y = fp32(x r), then one correction by the residual x - y s, which an fma forms
   exactly: fp32(y + (x - y s) r) is the rounded quotient (Markstein's correction with a correctly rounded
   reciprocal) wherever the quotient is a normal float, and the codes of smaller quotients are all +-0, the sign kept
   from x. The residual is exact only for |x| >= 2^-100; smaller (and NaN) x divide. No x in the block exceeds its
   amax, so an infinite x has s infinite and r = 0. */
__device__ __noinline__ float quot_div(float x, float s) { return __fdiv_rn(x, s); }   /* the rare path, out of line */
__device__ __forceinline__ float quot(float x, Q8s k) {
    if (k.r == 0.f || !(fabsf(x) >= 0x1p-100f)) return quot_div(x, k.s);
    const float y = __fmul_rn(x, k.r);
    return copysignf(__fmaf_rn(__fmaf_rn(-k.s, y, x), k.r, y), x);
}
/* the codes of a and b at scale s, e4m3(fp32(x / s)) rounded to nearest even and saturated (0 where s is not > 0),
   as one 16-bit word, a's in the low byte */
__device__ __forceinline__ uint32_t code2(float a, float b, Q8s k) {
    if (!(k.s > 0.f)) return 0u;
    uint16_t h;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(quot(b, k)), "f"(quot(a, k)));
    return h;
}

/* two floats as the bf16 pair of one 32-bit word (rounded to nearest even, the first in the low half) */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}
/* element i (0..7) of 8 bf16 held in one 16-byte word, as a float (exact) */
__device__ __forceinline__ float el8(const uint4 &u, int i) {
    const uint32_t w = i < 2 ? u.x : i < 4 ? u.y : i < 6 ? u.z : u.w;
    return __uint_as_float(i & 1 ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ float amax8(const uint4 &u) {
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(el8(u, i)));
    return m;
}
__device__ __forceinline__ uint4 ld8(const bf16 *p, bool ok) { return ok ? *reinterpret_cast<const uint4 *>(p) : make_uint4(0u, 0u, 0u, 0u); }
/* the codes of 8 values (one 16-byte word) at scale s, as 8 bytes in order */
__device__ __forceinline__ uint2 codes8(const uint4 &u, Q8s k) {
    return make_uint2(code2(el8(u, 0), el8(u, 1), k) | code2(el8(u, 2), el8(u, 3), k) << 16,
                      code2(el8(u, 4), el8(u, 5), k) | code2(el8(u, 6), el8(u, 7), k) << 16);
}
/* The same codes without quot's checks, for a thread whose values are none of them odd (odd8: tiny and not zero, or
   NaN) at a scale with a reciprocal (k.r != 0, so s > 0): there the correction is the IEEE quotient (quot), zero
   included (+-0, the sign of x). One test for a thread's values instead of one per value and per form; the kernels
   that write two forms of each value (k_quant_cols<true>) were bound by those instructions. */
/* the oddity of a word of two |x| (bf16, sign bits cleared), as bits 15 and 31: each half h is odd where 1 <= h < 0x0d80
   (|x| < 2^-100 and not zero) or h > 0x7f80 (NaN); each sum below stays inside its half (h <= 0x7fff) */
__device__ __forceinline__ uint32_t odd2(uint32_t w) {
    const uint32_t big = w + 0x72807280u, nonzero = w + 0x7fff7fffu, nan = w + 0x007f007fu;
    return (nonzero & ~big) | nan;
}
__device__ __forceinline__ bool odd8(const uint4 &u) {
    const uint32_t m = 0x7fff7fffu;
    return ((odd2(u.x & m) | odd2(u.y & m) | odd2(u.z & m) | odd2(u.w & m)) & 0x80008000u) != 0u;
}
/* the larger of two bf16 pairs, half by half; a NaN half loses to the other (fmaxf's rule) */
__device__ __forceinline__ uint32_t hmax2u(uint32_t a, uint32_t b) {
    __nv_bfloat162 x, y;
    memcpy(&x, &a, 4); memcpy(&y, &b, 4);
    const __nv_bfloat162 z = __hmax2(x, y);
    uint32_t r;
    memcpy(&r, &z, 4);
    return r;
}
__device__ __forceinline__ float quot_fast(float x, Q8s k) {
    const float y = __fmul_rn(x, k.r);
    return copysignf(__fmaf_rn(__fmaf_rn(-k.s, y, x), k.r, y), x);
}
__device__ __forceinline__ uint32_t code2_fast(float a, float b, Q8s k) {
    uint16_t h;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(quot_fast(b, k)), "f"(quot_fast(a, k)));
    return h;
}
__device__ __forceinline__ uint2 codes8_fast(const uint4 &u, Q8s k) {
    return make_uint2(code2_fast(el8(u, 0), el8(u, 1), k) | code2_fast(el8(u, 2), el8(u, 3), k) << 16,
                      code2_fast(el8(u, 4), el8(u, 5), k) | code2_fast(el8(u, 6), el8(u, 7), k) << 16);
}
__device__ __noinline__ uint2 codes8_exact(uint4 u, Q8s k) { return codes8(u, k); }   /* the rare path, out of line */

/* rows: one warp a row, each half-warp a 128-column block (half-warp j of step i: block 2 i + j), 8 columns a lane in
   one 16-byte load (C % 16 == 0: a lane's 8 are all in or all out); a lane's loads of 8 steps (16 blocks, 2048
   columns) in flight together */
__global__ void k_quant_rows(uint8_t *__restrict__ q, float *__restrict__ s, const bf16 *__restrict__ x, int R, int C) {
    const int lane = threadIdx.x & 31, l = lane & 15, nkb = kblocks(C);
    const long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (r >= R) return;   /* the whole warp */
    const bf16 *xr = x + r * C;
    uint8_t *qr = q + r * C;
    for (int kb0 = 0; kb0 < nkb; kb0 += 16) {
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int c = (kb0 + 2 * i + (lane >> 4)) * 128 + l * 8;
            v[i] = ld8(xr + c, c < C);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int kb = kb0 + 2 * i + (lane >> 4), c = kb * 128 + l * 8;
            float amax = amax8(v[i]);
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            const float sc = scale_of(amax);
            const Q8s ks = q8s(sc);
            if (c < C) *reinterpret_cast<uint2 *>(qr + c) = !odd8(v[i]) && ks.r != 0.f ? codes8_fast(v[i], ks) : codes8_exact(v[i], ks);
            if (l == 0 && kb < nkb) s[(size_t)kb * R + r] = sc;
        }
    }
}

/* the segment and 128-row chunk of chunk slot `slot` (segments in order, chunks in order within each), found by one
   warp (every lane gets it): rows [r0, r0 + n) of x, columns [p, p + 128) of qt (p = 128 slot: the chunks lie end to
   end); n = -1 when the slot is past the last chunk. The lanes take 32 segments at a time, count their chunks and
   scan the counts; the first lane whose running count passes the slot holds it. */
__device__ __forceinline__ void chunk_of(const int *offs, int E, int R, int slot, int lane, int &r0, int &n, long long &p) {
    n = -1; r0 = 0; p = 128LL * slot;
    if (!offs) {
        if (slot * 128LL < R) { r0 = slot * 128; n = min(128, R - r0); }
        return;
    }
    int acc = 0;   /* the chunks of the segments before this group of 32 */
    for (int e0 = 0; e0 < E; e0 += 32) {
        const int e = e0 + lane;
        int b = 0, ne = 0;
        if (e < E) { b = offs[e]; ne = max(0, offs[e + 1] - b); }
        const int nc = (ne + 127) / 128;
        int inc = nc;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o) inc += v;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, slot < acc + inc);
        if (hit) {
            const int l = __ffs(hit) - 1, first = acc + __shfl_sync(0xffffffffu, inc - nc, l), j = slot - first;
            r0 = __shfl_sync(0xffffffffu, b, l) + 128 * j;
            n = min(128, __shfl_sync(0xffffffffu, ne, l) - 128 * j);
            return;
        }
        acc += __shfl_sync(0xffffffffu, inc, 31);
    }
}

/* cols: CTA = one 128-row chunk x 128 columns, 16 x 128 / RPT threads (RPT = 8: 256), C % 8 == 0. Thread (g = tid / 16,
   c8 = tid % 16) reads rows RPT g .. RPT g + RPT - 1 of columns 8 c8 .. 8 c8 + 7 into registers (16-byte loads, one pass
   over x; RPT = 4 takes twice the threads, so that each has its loads in flight where it reads three inputs);
   the columns' amax meet in shared memory, and so do the codes: column j's 128 as 32 words, word w at
   index w ^ swz(j), so that neither the threads' writes nor a warp's read of a column conflict; a warp
   then writes each column's 128 bytes of qt as one coalesced row.
   ROWS: the rows form too, from the same registers (one read of x for both): a row's 128 columns of the tile are
   one 1 x 128 block, held by the 16 lanes of a half-warp; their amax meet by shuffles, and each lane writes its 8
   codes to q (row-major [.][C], the scale of row r's block kb at s[kb * Rq + r]) as k_quant_rows would: the same
   codes and scales, for the rows of the chunks (rows outside every chunk are not written).
   SRC: what the tile holds. Q8_X: x. Q8_SWIGLU: the SwiGLU of gate x and up u, as k_swiglu would write it (bf16), never
   written itself: its two forms are what its readers take. Q8_SWIGLU_BWD: its backward from x, u and dh, dgate and dup
   (k_swiglu_bwd's) from one read, quantized in turn; dup's forms in (q2, s2, qt2, st2). The same bits as those kernels then
   k_quant_cols<true>. Q8_GATHER: row r of the tile is row map[r] / topk of x (the MoE permutation's k_gather_rows, never
   written); Q8_GATHER_W: that row times wt[map[r]], rounded to bf16 (the combine's backward, k_combine_bwd's dys). */
enum { Q8_X = 0, Q8_SWIGLU = 1, Q8_SWIGLU_BWD = 2, Q8_GATHER = 3, Q8_GATHER_W = 4 };
/* 8 bf16 times w, rounded to bf16 (k_combine_bwd's `gf[j] *= wk` then st8) */
__device__ __forceinline__ uint4 mul8(const uint4 &u, float w) {
    uint32_t r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) r[k] = pack_bf16(el8(u, 2 * k) * w, el8(u, 2 * k + 1) * w);
    return make_uint4(r[0], r[1], r[2], r[3]);
}
/* 8 bf16 of the SwiGLU from gate and up as 16-byte words, and of its backward's dgate and dup from gate, up and dh:
   the values and roundings of k_swiglu and k_swiglu_bwd */
__device__ __forceinline__ uint4 swiglu8(const uint4 &g, const uint4 &u) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = pack_bf16(swiglu1(el8(g, 2 * k), el8(u, 2 * k)), swiglu1(el8(g, 2 * k + 1), el8(u, 2 * k + 1)));
    return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ void swiglu8_bwd(const uint4 &g, const uint4 &u, const uint4 &d, uint4 &dg, uint4 &du) {
    uint32_t a[4], b[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float x[2], y[2];
        swiglu1_bwd(el8(g, 2 * k), el8(u, 2 * k), el8(d, 2 * k), x[0], y[0]);
        swiglu1_bwd(el8(g, 2 * k + 1), el8(u, 2 * k + 1), el8(d, 2 * k + 1), x[1], y[1]);
        a[k] = pack_bf16(x[0], x[1]);
        b[k] = pack_bf16(y[0], y[1]);
    }
    dg = make_uint4(a[0], a[1], a[2], a[3]);
    du = make_uint4(b[0], b[1], b[2], b[3]);
}
/* k_quant_cols' codes of a thread's 8 columns (8 c8 + k) over its RPT rows (v) into the staging tile qs, RPT / 4 words
   of 4 rows' codes a column (word RPT / 4 g + h), the word index XOR-swizzled by col_swz of the column's 8-group so that
   neither a warp's writes (2 row groups x 16 column groups) nor its reads of one column conflict; FAST: codes8_fast's
   coding, where none of the values is odd and every scale has a reciprocal */
template <int W>
__device__ __forceinline__ int col_swz(int c8) { return W == 2 ? (c8 & 1) | (c8 >> 1) << 2 : c8 << 1; }
template <bool FAST, int RPT>
__device__ __forceinline__ void col_codes(const uint4 (&v)[RPT], const float *sc, const float *rc, uint32_t (*qs)[32], int c8, int g, int swz) {
#pragma unroll(FAST ? 8 : 1)
    for (int k = 0; k < 8; ++k) {
        const Q8s s = {sc[c8 * 8 + k], rc[c8 * 8 + k]};
        uint32_t w[RPT / 2];
#pragma unroll
        for (int h = 0; h < RPT / 2; ++h) w[h] = FAST ? code2_fast(el8(v[2 * h], k), el8(v[2 * h + 1], k), s) : code2(el8(v[2 * h], k), el8(v[2 * h + 1], k), s);
#pragma unroll
        for (int h = 0; h < RPT / 4; ++h) qs[c8 * 8 + k][(RPT / 4 * g + h) ^ swz] = w[2 * h] | w[2 * h + 1] << 16;
    }
}
template <bool ROWS, int SRC = Q8_X, int RPT = 8>
__global__ void __launch_bounds__(2048 / RPT, RPT / 2)
    k_quant_cols(uint8_t *__restrict__ qt, float *__restrict__ st, const bf16 *__restrict__ x, const int *__restrict__ offs, int E, int R,
                 int C, long long Lp, uint8_t *__restrict__ q, float *__restrict__ s, int Rq, const bf16 *__restrict__ u = nullptr,
                 const bf16 *__restrict__ dh = nullptr, uint8_t *__restrict__ q2 = nullptr, float *__restrict__ s2 = nullptr,
                 uint8_t *__restrict__ qt2 = nullptr, float *__restrict__ st2 = nullptr, const int32_t *__restrict__ map = nullptr,
                 const float *__restrict__ wt = nullptr, int topk = 1) {
    constexpr int NG = 128 / RPT, NT = 16 * NG, W = RPT / 4;   /* row groups, threads, words of codes a thread and column */
    __shared__ float part[NG][128];   /* [g][column], column j of the tile at (j % 8) * 16 + j / 8 (no bank conflicts) */
    __shared__ float sc[128], rc[128];   /* the columns' scales and their reciprocals */
    __shared__ uint32_t qs[128][32];  /* [column][word of 4 rows' codes, swizzled] */
    __shared__ int s_r0, s_n;
    __shared__ long long s_p;
    const int tid = threadIdx.x;
    if (tid < 32) {
        int r0, n;
        long long p;
        chunk_of(offs, E, R, blockIdx.x, tid, r0, n, p);
        if (tid == 0) { s_r0 = r0; s_n = n; s_p = p; }
    }
    __syncthreads();
    const int r0 = s_r0, n = s_n;
    const long long p = s_p;
    if (n < 0) return;
    const int c8 = tid & 15, g = tid >> 4, c = blockIdx.y * 128 + c8 * 8;
    const bool cok = c < C;
    constexpr int NO = SRC == Q8_SWIGLU_BWD ? 2 : 1;   /* the outputs quantized, one after the other */
    uint4 vd[NO > 1 ? RPT : 1];   /* dup, held while dgate is quantized */
#pragma unroll 1
    for (int out = 0; out < NO; ++out) {   /* (the shared arrays' last readers of one output pass its barriers before the next writes) */
        uint4 v[RPT];
#pragma unroll
        for (int j = 0; j < RPT; ++j) {
            const int i = RPT * g + j;
            const size_t o = (size_t)(r0 + i) * C + c;
            const bool ok = cok && i < n;
            const uint4 z = make_uint4(0u, 0u, 0u, 0u);
            if constexpr (SRC == Q8_X) v[j] = ld8(x + o, ok);
            else if constexpr (SRC == Q8_SWIGLU) v[j] = ok ? swiglu8(ld8(x + o, true), ld8(u + o, true)) : z;
            else if constexpr (SRC == Q8_GATHER || SRC == Q8_GATHER_W) {
                const int a = ok ? map[r0 + i] : 0;
                const uint4 t = ld8(x + (size_t)(a / topk) * C + c, ok);
                v[j] = SRC == Q8_GATHER || !ok ? t : mul8(t, wt[a]);
            }
            else if (out) v[j] = vd[j];
            else if (ok) swiglu8_bwd(ld8(x + o, true), ld8(u + o, true), ld8(dh + o, true), v[j], vd[j]);
            else v[j] = vd[j] = z;
        }
        uint8_t *const qo = out ? q2 : q, *const qto = out ? qt2 : qt;
        float *const so = out ? s2 : s, *const sto = out ? st2 : st;
        /* The amax and the oddity test on bf16 pairs (|x|: the sign bits cleared): a column's amax over the thread's RPT
           rows, a row's over its 8 columns (ra), from 0 and skipping NaN as fmaxf does, each value tested by odd2 */
        uint32_t mw[4] = {0u, 0u, 0u, 0u}, oddw = 0u;
        float ra[RPT];
#pragma unroll
        for (int j = 0; j < RPT; ++j) {
            const uint32_t w[4] = {v[j].x & 0x7fff7fffu, v[j].y & 0x7fff7fffu, v[j].z & 0x7fff7fffu, v[j].w & 0x7fff7fffu};
            uint32_t r2 = 0u;
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                mw[t] = hmax2u(mw[t], w[t]);
                r2 = hmax2u(r2, w[t]);
                oddw |= odd2(w[t]);
            }
            ra[j] = fmaxf(__uint_as_float(r2 << 16), __uint_as_float(r2 & 0xffff0000u));
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            part[g][(2 * t) * 16 + c8] = __uint_as_float(mw[t] << 16);
            part[g][(2 * t + 1) * 16 + c8] = __uint_as_float(mw[t] & 0xffff0000u);
        }
        const bool odd = (oddw & 0x80008000u) != 0u;   /* (codes8_fast) */
        if constexpr (ROWS) {
            /* Row RPT g + j's amax over the half-warp, reduced so that the 16 / RPT lanes j * 16 / RPT + [0, 16 / RPT) end
               with it (each exchange halves the rows a lane keeps: 2 RPT - 2 shuffles, not 4 RPT, then the lanes that hold
               the same row meet); the first of them forms its scale and reciprocal, and every lane takes all RPT back.
               The same maxima, so the same scales as k_quant_rows. */
#pragma unroll
            for (int m = RPT / 2, o = 8; m >= 1; m /= 2, o /= 2) {   /* keep m of the 2 m rows in ra: the upper half where bit o is set */
                const bool up = (c8 & o) != 0;
#pragma unroll
                for (int t = 0; t < m; ++t) {
                    const float keep = up ? ra[t + m] : ra[t], send = up ? ra[t] : ra[t + m];
                    ra[t] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, send, o));
                }
            }
            float a = ra[0];
#pragma unroll
            for (int o = 8 / RPT; o >= 1; o /= 2) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
            constexpr int LR = 16 / RPT;   /* lanes a row */
            const float sr = scale_of(a), rr = q8s(sr).r;
            const int im = RPT * g + c8 / LR;   /* the row this lane's scale is */
            if (c8 % LR == 0 && im < n) so[(size_t)blockIdx.y * Rq + r0 + im] = sr;
#pragma unroll
            for (int j = 0; j < RPT; ++j) {
                const int i = RPT * g + j, src = (tid & 16) | (LR * j);
                const Q8s ks = {__shfl_sync(0xffffffffu, sr, src), __shfl_sync(0xffffffffu, rr, src)};
                if (i < n && cok)
                    *reinterpret_cast<uint2 *>(qo + (size_t)(r0 + i) * C + c) = !odd && ks.r != 0.f ? codes8_fast(v[j], ks) : codes8_exact(v[j], ks);
            }
        }
        __syncthreads();
        if (tid < 128) {
            float a = 0.f;
            for (int h = 0; h < NG; ++h) a = fmaxf(a, part[h][(tid & 7) * 16 + (tid >> 3)]);
            const float s = scale_of(a);
            sc[tid] = s;
            rc[tid] = q8s(s).r;
            if (blockIdx.y * 128 + tid < C) sto[(size_t)(p / 128) * C + blockIdx.y * 128 + tid] = s;
        }
        __syncthreads();
        const int swz = col_swz<W>(c8);   /* this thread's columns' (j / 8 = c8) */
        bool fast = !odd;
#pragma unroll
        for (int k = 0; k < 8; ++k) fast &= rc[c8 * 8 + k] != 0.f;
        if (fast) col_codes<true, RPT>(v, sc, rc, qs, c8, g, swz);
        else col_codes<false, RPT>(v, sc, rc, qs, c8, g, swz);
        __syncthreads();
        const int lane = tid & 31;
        for (int j = tid >> 5; j < 128; j += NT / 32) {
            if (blockIdx.y * 128 + j < C)
                *reinterpret_cast<uint32_t *>(qto + (size_t)(blockIdx.y * 128 + j) * Lp + p + 4 * lane) = qs[j][lane ^ col_swz<W>(j >> 3)];
        }
    }
}

/* weight: CTA = one 128 x 128 block (grid kb, nb, e), 256 threads, K % 8 == 0, N % 4 == 0. Thread (g = tid / 16,
   c8 = tid % 16) holds rows 4 (g + 16 h) .. + 3, h = 0, 1, of columns 8 c8 .. 8 c8 + 7 (16-byte words, zeros outside
   the weight): one pass over the block. The transposed form goes through shared memory as 32-bit words of 4 rows'
   codes, their word index XOR-swizzled by the column's 8-group so that neither the writes nor the row reads conflict.
   forms: bit 0 writes W to (q, s), bit 1 writes W^T to (qt, st). weight_block_out quantizes the block so held (m: the
   thread's amax); k_quant_weight reads it from w (bf16), k_adamw_q8 forms it from AdamW's update. */
__device__ __forceinline__ void weight_block_out(const uint4 (&v)[2][4], float m, uint8_t *__restrict__ q, float *__restrict__ s,
                                                 uint8_t *__restrict__ qt, float *__restrict__ st, int N, int K, int forms,
                                                 uint32_t (*tq)[32], float *red) {
    /* shared: tq [128][32] (k in the block, word of 4 n ^ 2 (k / 8)), red [32] */
    const int kb = blockIdx.x, nb = blockIdx.y, e = blockIdx.z, tid = threadIdx.x;
    const int c8 = tid & 15, g = tid >> 4, k = kb * 128 + c8 * 8;
    const bool kok = k < K;
    const float sc = scale_of(block_max(m, red));
    const Q8s ks = q8s(sc);
    uint2 cw[2][4];   /* the codes, each value's once: row (h, r)'s 8 columns, byte j = column j */
    bool fast = ks.r != 0.f;   /* (codes8_fast) */
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 4; ++r) fast &= !odd8(v[h][r]);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 4; ++r) cw[h][r] = fast ? codes8_fast(v[h][r], ks) : codes8_exact(v[h][r], ks);
    if (forms & 1) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int n = nb * 128 + 4 * (g + 16 * h) + r;
                if (kok && n < N) *reinterpret_cast<uint2 *>(q + ((size_t)e * N + n) * K + k) = cw[h][r];
            }
    }
    if (forms & 2) {   /* column i's word: its 4 rows' codes, a 4 x 4 byte transpose of each half of the rows' words */
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const uint32_t a = half ? cw[h][0].y : cw[h][0].x, b = half ? cw[h][1].y : cw[h][1].x;
                const uint32_t c = half ? cw[h][2].y : cw[h][2].x, d = half ? cw[h][3].y : cw[h][3].x;
                const uint32_t t0 = __byte_perm(a, b, 0x5140), t1 = __byte_perm(a, b, 0x7362);   /* a0 b0 a1 b1, a2 b2 a3 b3 */
                const uint32_t u0 = __byte_perm(c, d, 0x5140), u1 = __byte_perm(c, d, 0x7362);
                const int i = c8 * 8 + 4 * half, wd = (g + 16 * h) ^ (2 * c8);
                tq[i][wd] = __byte_perm(t0, u0, 0x5410);
                tq[i + 1][wd] = __byte_perm(t0, u0, 0x7632);
                tq[i + 2][wd] = __byte_perm(t1, u1, 0x5410);
                tq[i + 3][wd] = __byte_perm(t1, u1, 0x7632);
            }
        __syncthreads();
        const int lane = tid & 31, n = nb * 128 + 4 * lane;
        for (int kl = tid >> 5; kl < 128; kl += 8) {
            const int kk = kb * 128 + kl;
            if (kk < K && n < N) *reinterpret_cast<uint32_t *>(qt + ((size_t)e * K + kk) * N + n) = tq[kl][lane ^ (2 * (kl >> 3))];
        }
    }
    if (tid == 0) {
        if (forms & 1) {
            const int ld = ld_blk(K);
            float *row = s + ((size_t)e * kblocks(N) + nb) * ld;
            row[kb] = sc;
            if (kb == kblocks(K) - 1) for (int j = kb + 1; j < ld; ++j) row[j] = 0.f;
        }
        if (forms & 2) {
            const int ld = ld_blk(N);
            float *row = st + ((size_t)e * kblocks(K) + kb) * ld;
            row[nb] = sc;
            if (nb == kblocks(N) - 1) for (int j = nb + 1; j < ld; ++j) row[j] = 0.f;
        }
    }
}
/* skip: where given and nonzero, nothing is done (the slot already holds these forms: k_adamw_q8 wrote them) */
__global__ void __launch_bounds__(256, 4) k_quant_weight(uint8_t *__restrict__ q, float *__restrict__ s, uint8_t *__restrict__ qt,
                                                      float *__restrict__ st, const bf16 *__restrict__ w, int N, int K, int forms,
                                                      const int *skip) {
    if (skip && *skip) return;
    const int kb = blockIdx.x, nb = blockIdx.y, e = blockIdx.z, tid = threadIdx.x;
    const int c8 = tid & 15, g = tid >> 4, k = kb * 128 + c8 * 8;
    const bool kok = k < K;
    const bf16 *we = w + (size_t)e * N * K;
    uint4 v[2][4];
    float m = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int n = nb * 128 + 4 * (g + 16 * h) + r;
            v[h][r] = ld8(we + (size_t)n * K + k, kok && n < N);
            m = fmaxf(m, amax8(v[h][r]));
        }
    __shared__ uint32_t tq[128][32];
    __shared__ float red[32];
    weight_block_out(v, m, q, s, qt, st, N, K, forms, tq, red);
}

/* AdamW on a weight whose FP8 forms a slot keeps (mt__q8_plan), one CTA per 128 x 128 block of p [E][N][K] (k_quant_weight's
   grid): first AdamW over the block, each warp a row at a time, 4 elements a lane (float4 of p and g, the moments' 4),
   each element updated as adamw_elems / adamw_elems_bf16 update it (adamw_f32_elem, mt_adamw_bf16_elem), p16 written
   where given, and the bf16 values kept in shared memory (zeros outside the weight); then each thread takes
   k_quant_weight's share of the block from there and weight_block_out quantizes it: the codes and scales
   k_quant_weight would make from p16, without a second pass over the weight. fresh[0] = 1 at the end: the slot holds
   the new weight's forms. */
template <bool BF16M> struct MomOf { typedef float4 T; };   /* 4 elements of a moment */
template <> struct MomOf<true> { typedef uint2 T; };
template <bool BF16M>
__global__ void __launch_bounds__(256, 4) k_adamw_q8(float *__restrict__ p, void *__restrict__ m, void *__restrict__ v, bf16 *__restrict__ p16,
                                                  const float *__restrict__ gr, int N, int K, const float *lrp, const float *coefp,
                                                  const float *hp, const int32_t *step, int decay, uint8_t *__restrict__ q,
                                                  float *__restrict__ s, uint8_t *__restrict__ qt, float *__restrict__ st, int forms,
                                                  int *fresh) {
    __shared__ uint4 tile[128 * 16];   /* the block's bf16 values, row-major (16 words a row); then weight_block_out's */
    const int kb = blockIdx.x, nb = blockIdx.y, e = blockIdx.z, tid = threadIdx.x, lane = tid & 31;
    AdamwF32 kf;
    mt_adamw_k kb16;
    if constexpr (BF16M) mt_adamw_bf16_setup(&kb16, hp, lrp[0], coefp[0], step[0], decay);
    else kf = adamw_f32_setup(lrp, coefp, hp, step, decay);
    const int k = kb * 128 + 4 * lane;
    /* row 8 it + warp of the block: its loads (zeros outside the weight) issued a row ahead of its update, so that
       each warp has two rows' loads in flight (at 4 CTAs an SM, one row a warp left DRAM a third idle) */
    typedef typename MomOf<BF16M>::T Mom;
    struct Row { float4 P, G; Mom M, V; bool ok; size_t i; };
    auto load = [&](int it, bool any) {
        Row r;
        const int n = nb * 128 + 8 * it + (tid >> 5);
        r.ok = any && n < N && k < K;
        r.i = ((size_t)e * N + (r.ok ? n : 0)) * K + (r.ok ? k : 0);
        const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
        Mom zm;
        memset(&zm, 0, sizeof zm);
        r.P = r.ok ? *reinterpret_cast<const float4 *>(p + r.i) : z4;
        r.G = r.ok ? *reinterpret_cast<const float4 *>(gr + r.i) : z4;
        r.M = r.ok ? reinterpret_cast<const Mom *>(m)[r.i / 4] : zm;
        r.V = r.ok ? reinterpret_cast<const Mom *>(v)[r.i / 4] : zm;
        return r;
    };
    Row cur = load(0, true);
#pragma unroll 1
    for (int it = 0; it < 16; ++it) {
        const Row nxt = load(it + 1, it + 1 < 16);
        uint2 b = make_uint2(0u, 0u);
        if (cur.ok) {
            float4 P = cur.P;
            float *pp = &P.x;
            const float *gg = &cur.G.x;
            if constexpr (BF16M) {
                uint16_t mm[4] = {(uint16_t)cur.M.x, (uint16_t)(cur.M.x >> 16), (uint16_t)cur.M.y, (uint16_t)(cur.M.y >> 16)};
                uint16_t vv[4] = {(uint16_t)cur.V.x, (uint16_t)(cur.V.x >> 16), (uint16_t)cur.V.y, (uint16_t)(cur.V.y >> 16)};
#pragma unroll
                for (int j = 0; j < 4; ++j) pp[j] = mt_adamw_bf16_elem(&kb16, pp[j], gg[j], &mm[j], &vv[j]);
                reinterpret_cast<uint2 *>(m)[cur.i / 4] = make_uint2(mm[0] | (uint32_t)mm[1] << 16, mm[2] | (uint32_t)mm[3] << 16);
                reinterpret_cast<uint2 *>(v)[cur.i / 4] = make_uint2(vv[0] | (uint32_t)vv[1] << 16, vv[2] | (uint32_t)vv[3] << 16);
            } else {
                float4 M = cur.M, V = cur.V;
                float *mm = &M.x, *vv = &V.x;
#pragma unroll
                for (int j = 0; j < 4; ++j) pp[j] = adamw_f32_elem(kf, pp[j], gg[j], mm[j], vv[j]);
                reinterpret_cast<float4 *>(m)[cur.i / 4] = M;
                reinterpret_cast<float4 *>(v)[cur.i / 4] = V;
            }
            *reinterpret_cast<float4 *>(p + cur.i) = P;
            b = make_uint2(pack_bf16(P.x, P.y), pack_bf16(P.z, P.w));
            if (p16) *reinterpret_cast<uint2 *>(p16 + cur.i) = b;
        }
        reinterpret_cast<uint2 *>(tile)[(8 * it + (tid >> 5)) * 32 + lane] = b;
        cur = nxt;
    }
    __syncthreads();
    const int c8 = tid & 15, g = tid >> 4;
    uint4 w[2][4];
    float amax = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            w[h][r] = tile[(4 * (g + 16 * h) + r) * 16 + c8];
            amax = fmaxf(amax, amax8(w[h][r]));
        }
    __syncthreads();   /* the tile's memory is weight_block_out's from here */
    weight_block_out(w, amax, q, s, qt, st, N, K, forms, reinterpret_cast<uint32_t (*)[32]>(tile), reinterpret_cast<float *>(tile) + 128 * 32);
    if (fresh && tid == 0 && kb == 0 && nb == 0 && e == 0) *fresh = 1;
}

/* ---- dense: cuBLASLt block-scaled FP8 (VEC128_32F / BLK128x128_32F, Hopper, CUDA 12.9+) ----------
   Row-major out[Mr][Nc] = A[Mr][:] . B[Nc][:] is, column-major, D (Nc x Mr) = B^T(T) A(N): cuBLASLt's
   A is our B (TRANSA = T: the "TN" layout FP8 needs), its B is our A.  The scale pointers are set in
   plan() (the heuristic sees the real ones) and again in run(). */
struct Dense {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulAlgo_t algo;
    size_t ws = 0;
    char why[160] = "";
    ~Dense() {
        if (desc) cublasLtMatmulDescDestroy(desc);
        if (la) cublasLtMatrixLayoutDestroy(la);
        if (lb) cublasLtMatrixLayoutDestroy(lb);
        if (lc) cublasLtMatrixLayoutDestroy(lc);
    }
    /* out_f32: fp32 output (dW), else bf16; b_blk: B has 128 x 128 block scales, else 1 x 128 */
    bool set_scales(const float *sa, const float *sb) {
        return cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof sb) == CUBLAS_STATUS_SUCCESS &&
               cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa, sizeof sa) == CUBLAS_STATUS_SUCCESS;
    }
    int plan(cublasLtHandle_t lt, int out_f32, int b_blk, int Mr, int Nc, int K, int lda, int ldb, const float *sa, const float *sb,
             size_t ws_bytes) {
        if (Mr < 1 || Nc < 1 || K < 1 || K % 16 || Nc % 16 || lda % 16 || ldb % 16 || lda < K || ldb < K) {
            snprintf(why, sizeof why, "FP8 GEMM: K, Nc, lda, ldb must be multiples of 16 (Mr %d Nc %d K %d lda %d ldb %d)", Mr, Nc, K, lda, ldb);
            return -1;
        }
        const cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
        const int32_t ma = b_blk ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        const int32_t mb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        const cudaDataType_t ot = out_f32 ? CUDA_R_32F : CUDA_R_16BF;
        cublasLtMatmulPreference_t pref = nullptr;
        cublasLtMatmulHeuristicResult_t hr;
        int n = 0;
        memset(&hr, 0, sizeof hr);
        bool ok = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof tB) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, (uint64_t)K, (uint64_t)Nc, ldb) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, (uint64_t)K, (uint64_t)Mr, lda) == CUBLAS_STATUS_SUCCESS &&
                  cublasLtMatrixLayoutCreate(&lc, ot, (uint64_t)Nc, (uint64_t)Mr, Nc) == CUBLAS_STATUS_SUCCESS;
        if (!ok) { snprintf(why, sizeof why, "FP8 GEMM: cuBLASLt descriptors (this cuBLASLt has no block-scaled FP8?)"); return -1; }
        ok = set_scales(sa, sb) &&
             cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes) == CUBLAS_STATUS_SUCCESS &&
             cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &hr, &n) == CUBLAS_STATUS_SUCCESS && n > 0;
        if (pref) cublasLtMatmulPreferenceDestroy(pref);
        if (!ok) {
            snprintf(why, sizeof why, "FP8 GEMM: cuBLASLt has no block-scaled FP8 algorithm for %d x %d x %d (%s B, %s out) on this device",
                     Mr, Nc, K, b_blk ? "128x128" : "1x128", out_f32 ? "fp32" : "bf16");
            return -1;
        }
        algo = hr.algo;
        ws = hr.workspaceSize;
        return 0;
    }
    int run(cublasLtHandle_t lt, void *out, const uint8_t *a, const float *sa, const uint8_t *b, const float *sb, void *wsp,
            size_t ws_bytes, cudaStream_t st) {
        const float alpha = 1.f, beta = 0.f;
        if (ws > ws_bytes) { snprintf(why, sizeof why, "FP8 GEMM: workspace %zu > %zu", ws, ws_bytes); return -1; }
        if (!set_scales(sa, sb)) {
            snprintf(why, sizeof why, "FP8 GEMM: setting the scale pointers");
            return -1;
        }
        const cublasStatus_t r = cublasLtMatmul(lt, desc, &alpha, b, la, a, lb, &beta, out, lc, out, lc, &algo, wsp, ws, st);
        if (r != CUBLAS_STATUS_SUCCESS) { snprintf(why, sizeof why, "FP8 GEMM: cublasLtMatmul status %d", (int)r); return -1; }
        return 0;
    }
};

/* ---- grouped: the simple kernel ----------------------------------------------------------------
   "simple" because it is the correct baseline, not the fast one: no shared-memory staging, no TMA,
   no wgmma.  mma.sync m16n8k32 (e4m3 x e4m3 -> fp32) with fragments read straight from global
   memory (L1/L2 serve the reuse).  CTA: 4 warps, a 64 x 64 output tile, warp w rows 16 w + [0, 16),
   8 n8 column slices.  Each 128-long reduction block: 4 k32 products into a fresh fp32 slice, then
   promoted into the accumulator with the two scales.  Work: modes 0/1 (expert, 64-row tile) slots
   in grid.x (a CTA finds its tile by walking offs; slots past the last tile exit), 64-column tiles
   in grid.y; mode 2 (m tile, k tile) in grid.x, expert in grid.y; the reduction walks the expert's
   padded 128-blocks in order.  Every output element is written by one thread with a fixed order:
   bitwise reproducible.  Bounds: K, M multiples of 16 (whole 4-byte fragments); E <= 65535. */
struct Gmm {
    void *out;
    const uint8_t *a, *b;
    const float *sa, *sb;
    const int *offs;
    int E, M, K, Rmax;
    long long Lp;
    float *ssq;   /* mode 2, k_gmm_fast: each consumer warp's sum of its dW^2 at [tile * 8 + warp] (mt_cuda_fp8_gmm_dw), or NULL */
    /* modes 0/1, a second pair (a2: NULL for none) in the same accumulators: out = a b + a2 b2, the operands of each
       pair in a / b's layouts and shapes; its reduction blocks follow the first pair's */
    const uint8_t *a2, *b2;
    const float *sa2, *sb2;
};
/* reduction block kb of a modes 0/1 tile whose pairs have nk1 blocks each: the block within its pair, and which pair */
__device__ __forceinline__ int pair_kb(int kb, int nk1, bool &second) {
    second = kb >= nk1;
    return second ? kb - nk1 : kb;
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t ld4(const uint8_t *base, long long ld, int row, int nrows, long long k, long long kend) {
    return (row < nrows && k < kend) ? __ldg(reinterpret_cast<const uint32_t *>(base + (size_t)row * ld + k)) : 0u;
}

template <int MODE>
__global__ void __launch_bounds__(128) k_gmm_simple(const Gmm p) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, cq = lane & 3;
    /* output tile: rows [r0, r1) (modes 0/1: tokens; mode 2: m of expert e), columns [c0, c0 + 64) */
    int e = 0, r0 = 0, r1 = 0, c0 = 0, ncols;
    long long k0 = 0, kend; /* the reduction range, in the operands' own column coordinates */
    __shared__ int s_e, s_r0, s_r1;
    __shared__ long long s_k0;
    if (MODE != 2) {
        if (tid == 0) {
            int acc = 0, found = -1, b = 0, n = 0;
            for (int i = 0; i < p.E && found < 0; ++i) {
                b = p.offs[i]; n = max(0, p.offs[i + 1] - b);
                const int nt = (n + 63) / 64;
                if ((int)blockIdx.x < acc + nt) found = i; else acc += nt;
            }
            s_e = found;
            s_r0 = found < 0 ? 0 : b + 64 * ((int)blockIdx.x - acc);
            s_r1 = found < 0 ? 0 : min(b + 64 * ((int)blockIdx.x - acc) + 64, b + n);
        }
        __syncthreads();
        if (s_e < 0) return;
        e = s_e; r0 = s_r0; r1 = s_r1;
        c0 = blockIdx.y * 64;
        ncols = MODE == 0 ? p.M : p.K;
        kend = MODE == 0 ? p.K : p.M;
    } else {
        e = blockIdx.y;
        const int ntk = (p.K + 63) / 64;
        r0 = (blockIdx.x / ntk) * 64; r1 = p.M;
        c0 = (blockIdx.x % ntk) * 64;
        ncols = p.K;
        if (tid == 0) {
            long long pe = 0;
            for (int i = 0; i < e; ++i) pe += 128LL * ((max(0, p.offs[i + 1] - p.offs[i]) + 127) / 128);
            s_k0 = pe;
            s_r0 = max(0, p.offs[e + 1] - p.offs[e]);
        }
        __syncthreads();
        k0 = s_k0;
        kend = k0 + 128LL * ((s_r0 + 127) / 128);
    }
    /* operand rows: A row ra / rb (tile rows), B row = output column; ld: bytes per row */
    const long long lda = MODE == 2 ? p.Lp : (MODE == 0 ? p.K : p.M);
    const long long ldb = MODE == 2 ? p.Lp : (MODE == 0 ? p.K : p.M);
    const uint8_t *A = p.a, *B = p.b, *B2 = p.b2;
    if (MODE != 2) { B += (size_t)e * p.M * p.K; if (B2) B2 += (size_t)e * p.M * p.K; }
    const int nbrows = MODE == 2 ? p.K : ncols; /* rows of B */
    const int ra = r0 + 16 * warp + g, rb = ra + 8;
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const int nkb1 = (int)((kend - k0 + 127) / 128), nkb = MODE != 2 && p.a2 ? 2 * nkb1 : nkb1;
    const int ldsb = MODE == 0 ? ld_blk(p.K) : ld_blk(p.M); /* weight scales: per-row stride */
#pragma unroll 1
    for (int kb2 = 0; kb2 < nkb; ++kb2) {
        bool sec = false;
        const int kb = MODE != 2 ? pair_kb(kb2, nkb1, sec) : kb2;
        const uint8_t *Ak = sec ? p.a2 : A, *Bk = sec ? B2 : B;
        float t[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) t[j][0] = t[j][1] = t[j][2] = t[j][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            const long long k = k0 + 128LL * kb + 32 * ks + 4 * cq;
            uint32_t a[4];
            a[0] = ld4(Ak, lda, ra, r1, k, kend);
            a[1] = ld4(Ak, lda, rb, r1, k, kend);
            a[2] = ld4(Ak, lda, ra, r1, k + 16, kend);
            a[3] = ld4(Ak, lda, rb, r1, k + 16, kend);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int col = c0 + 8 * j + g;
                mma_e4m3(t[j], a, ld4(Bk, ldb, col, nbrows, k, kend), ld4(Bk, ldb, col, nbrows, k + 16, kend));
            }
        }
        /* promotion: the slice times its scales into the fp32 accumulator */
        if (MODE != 2) {
            const float *sa = (sec ? p.sa2 : p.sa) + (size_t)kb * p.Rmax;
            const float xa = ra < r1 ? sa[ra] : 0.f, xb = rb < r1 ? sa[rb] : 0.f;
            const float w = (sec ? p.sb2 : p.sb)[((size_t)e * kblocks(ncols) + c0 / 128) * ldsb + kb];
            const float fa = xa * w, fb = xb * w;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                acc[j][0] += t[j][0] * fa; acc[j][1] += t[j][1] * fa;
                acc[j][2] += t[j][2] * fb; acc[j][3] += t[j][3] * fb;
            }
        } else {
            const long long pb = k0 / 128 + kb;
            const float *sa = p.sa + (size_t)pb * p.M, *sb = p.sb + (size_t)pb * p.K;
            const float xa = ra < r1 ? sa[ra] : 0.f, xb = rb < r1 ? sa[rb] : 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int col = c0 + 8 * j + 2 * cq;
                const float w0 = col < ncols ? sb[col] : 0.f, w1 = col + 1 < ncols ? sb[col + 1] : 0.f;
                acc[j][0] += t[j][0] * (xa * w0); acc[j][1] += t[j][1] * (xa * w1);
                acc[j][2] += t[j][2] * (xb * w0); acc[j][3] += t[j][3] * (xb * w1);
            }
        }
    }
    /* store: thread holds rows ra, rb, columns c0 + 8 j + 2 cq + {0, 1} (ncols % 16 == 0: both or neither) */
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int col = c0 + 8 * j + 2 * cq;
        if (col >= ncols) continue;
        if (MODE != 2) {
            bf16 *y = (bf16 *)p.out;
            if (ra < r1) *reinterpret_cast<__nv_bfloat162 *>(y + (size_t)ra * ncols + col) = __floats2bfloat162_rn(acc[j][0], acc[j][1]);
            if (rb < r1) *reinterpret_cast<__nv_bfloat162 *>(y + (size_t)rb * ncols + col) = __floats2bfloat162_rn(acc[j][2], acc[j][3]);
        } else {
            float *dw = (float *)p.out + (size_t)e * p.M * p.K;
            if (ra < r1) *reinterpret_cast<float2 *>(dw + (size_t)ra * p.K + col) = make_float2(acc[j][0], acc[j][1]);
            if (rb < r1) *reinterpret_cast<float2 *>(dw + (size_t)rb * p.K + col) = make_float2(acc[j][2], acc[j][3]);
        }
    }
}

static bool gmm_check(int mode, const Gmm &p) {
    if (mode < 0 || mode > 2 || p.E < 1 || p.E > 65535 || p.M < 16 || p.K < 16 || p.M % 16 || p.K % 16 || p.Rmax < 0) return false;
    if (!p.out || !p.a || !p.b || !p.sa || !p.sb || !p.offs) return false;
    if ((((uintptr_t)p.out) | ((uintptr_t)p.a) | ((uintptr_t)p.b)) & 15u) return false;
    if (p.a2 && (mode == 2 || !p.b2 || !p.sa2 || !p.sb2 || ((((uintptr_t)p.a2) | ((uintptr_t)p.b2)) & 15u))) return false;
    return mode != 2 || (p.Lp >= tpad(p.Rmax, p.E) && p.Lp % 16 == 0);
}
static int gmm_simple(int mode, const Gmm &p, cudaStream_t st) {
    if (!gmm_check(mode, p)) return -1;
    if (mode == 2) {
        const dim3 grid((unsigned)(((p.M + 63) / 64) * ((p.K + 63) / 64)), (unsigned)p.E);
        k_gmm_simple<2><<<grid, 128, 0, st>>>(p);
    } else {
        const int ncols = mode == 0 ? p.M : p.K;
        const long long slots = (long long)(p.Rmax + 63) / 64 + p.E;
        if (slots > INT_MAX || slots < 1) return -1;
        const dim3 grid((unsigned)slots, (unsigned)((ncols + 63) / 64));
        if (mode == 0) k_gmm_simple<0><<<grid, 128, 0, st>>>(p);
        else k_gmm_simple<1><<<grid, 128, 0, st>>>(p);
    }
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
/* ---- grouped: the wgmma kernel -----------------------------------------------------------------
   Warp-specialized and persistent, after gg_tma_kernel: 384 threads, warpgroup 0's thread 0 issues
   the TMA loads, warpgroups 1 and 2 multiply; one CTA per SM, CTA b takes tiles b, b + grid, ...
   A tile is 128 x BN outputs (consumer c: rows 64 c + [0, 64)); a stage is one 128-long reduction
   block, i.e. one scale block: A 128 rows x 128 bytes and B BN rows x 128 bytes, both K-major with
   the 128-byte swizzle (an e4m3 row of a block is exactly one 128-byte line).
   Per stage: 4 x wgmma m64nBNk32 e4m3 into a fresh fp32 slice, wait, release the stage, then the
   promotion acc += slice * (sa * sb).  Slice and accumulator are BN / 2 + BN / 2 registers a thread:
   BN = 128 (6 stages of 32 KB, the default) or 192 (5 of 40 KB: fewer operand bytes per product,
   ragged last column tiles on mid's 1408 and 2048); n = 256 would need 256 registers.
   Tiles: modes 0/1 (expert, 128-row tile, BN-column tile), experts in order (per-expert tile counts
   prefix-summed in shared memory, tile -> expert by binary search); mode 2 (expert, m tile, k tile),
   the reduction over the expert's padded 128-blocks [P_e, P_e + roundup(n_e, 128)).  Rows of a box
   past the expert's rows (or past the tensor: zeros) are loaded and multiplied but never stored.
   Each output element is produced by one thread in a fixed order: bitwise reproducible.
   Measured on an H200 (docs/FP8.md): 400-500 TFLOP/s forward and dX, 115-177 dW; k_gmm_fast below is what
   should take it further. */
constexpr int WG_MAXE = 1024;
template <int BN>
struct WgCfg {
    static constexpr int ST = BN == 128 ? 6 : 5;                   /* stages                        */
    static constexpr int STAGE = 128 * 128 + BN * 128;             /* A + B bytes of one stage      */
    static constexpr size_t SMEM = 1024 + (size_t)ST * STAGE + 2 * ST * 8 + 2 * (WG_MAXE + 1) * sizeof(int);
    static_assert(SMEM <= 232448, "shared memory");
};

struct WgParams {
    CUtensorMap ta, tb;
    CUtensorMap ta2, tb2;   /* the second pair's (p.a2) */
    CUtensorMap to;         /* k_gmm_fast's dW in 128 x 256 tiles: the output fp32 [E][M][K], 16 rows x 32 columns a box */
    Gmm p;
    int mode, ncols, nct, ntm;
};

/* D[64 x N] (+)= A(desc) B(desc), e4m3 x e4m3 -> f32, both K-major (the only FP8 form) */
template <int N>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d);
template <>
__device__ __forceinline__ void wgmma_e4m3<128>(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_e4m3<192>(float (&d)[96], uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
        "}, %96, %97, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
        : "l"(da), "l"(db), "r"(scale_d));
}
struct WgTile { int valid, e, r0, r1, c0, nk; long long k0; };

/* mbar_wait that traps after ~10 s (2e10 cycles): a pipeline that lost a stage fails its launch (an error
   the caller sees) instead of hanging the process */
__device__ __forceinline__ void wait_or_trap(uint32_t bar, uint32_t parity) {
    const long long t0 = clock64();
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
        if (!done && clock64() - t0 > 20000000000LL) __trap();
    } while (!done);
}

/* tile t: modes 0/1 rows [r0, r1) of expert e, reduction blocks from k0 = 0; mode 2 rows (m) [r0, r0 + 128),
   the reduction from column k0 (= P_e) of the transposed operands, nk blocks */
template <int BN>
__device__ __forceinline__ WgTile wg_tile(const WgParams &w, const int *s_offs, const int *s_pref, int T, int t) {
    WgTile ti;
    ti.valid = t < T; ti.e = 0; ti.r0 = 0; ti.r1 = 0; ti.c0 = 0; ti.nk = 0; ti.k0 = 0;
    if (!ti.valid) return ti;
    if (w.mode != 2) {
        int lo = 0, hi = w.p.E - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_pref[mid] <= t) lo = mid; else hi = mid - 1;
        }
        const int local = t - s_pref[lo], rt = local / w.nct, ct = local - rt * w.nct;
        ti.e = lo;
        ti.r0 = s_offs[lo] + 128 * rt;
        ti.r1 = min(ti.r0 + 128, s_offs[lo + 1]);
        ti.c0 = BN * ct;
        ti.nk = kblocks(w.mode == 0 ? w.p.K : w.p.M) * (w.p.a2 ? 2 : 1);   /* (two pairs: pair_kb) */
    } else {
        const int per = w.ntm * w.nct, e = t / per, rem = t - e * per, mt = rem / w.nct;
        ti.e = e;
        ti.r0 = 128 * mt;
        ti.r1 = w.p.M;
        ti.c0 = BN * (rem - mt * w.nct);
        ti.k0 = 128LL * s_pref[e];
        ti.nk = (s_offs[e + 1] - s_offs[e] + 127) / 128;
    }
    return ti;
}

template <int BN>
__global__ void __launch_bounds__(384, 1) k_gmm_wgmma(const __grid_constant__ WgParams w) {
    using namespace mt_ptx;
    constexpr int ST = WgCfg<BN>::ST, STAGE = WgCfg<BN>::STAGE, NR = BN / 2, NJ = BN / 8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const int tid = threadIdx.x;
    const uint32_t raw = smem_u32(smem_raw), pad = (1024u - (raw & 1023u)) & 1023u, sbase = raw + pad;
    const uint32_t full0 = sbase + (uint32_t)(ST * STAGE), empty0 = full0 + 8u * ST;
    int *s_offs = reinterpret_cast<int *>(smem_raw + pad + ST * STAGE + 2 * ST * 8);
    int *s_pref = s_offs + (WG_MAXE + 1);
    const Gmm &p = w.p;
    for (int i = tid; i <= p.E; i += blockDim.x) s_offs[i] = p.offs[i];
    __syncthreads();
    if (tid == 0) {
        /* modes 0/1: s_pref[e] = tiles before expert e (s_pref[E] = all); mode 2: 128-blocks before expert e */
        int acc = 0;
        for (int e = 0; e < p.E; ++e) {
            s_pref[e] = acc;
            const int n = max(0, s_offs[e + 1] - s_offs[e]);
            acc += w.mode != 2 ? ((n + 127) / 128) * w.nct : (n + 127) / 128;
        }
        s_pref[p.E] = acc;
        for (int s = 0; s < ST; ++s) { mbar_init(full0 + 8u * s, 1); mbar_init(empty0 + 8u * s, 8); }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int T = w.mode != 2 ? s_pref[p.E] : p.E * w.ntm * w.nct;
    const int nk1 = kblocks(w.mode == 0 ? p.K : p.M);   /* modes 0/1: a pair's reduction blocks */
    if (tid < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (tid == 0) {   /* producer */
            int step = 0;
#pragma unroll 1
            for (int t = blockIdx.x; t < T; t += gridDim.x) {
                const WgTile ti = wg_tile<BN>(w, s_offs, s_pref, T, t);
#pragma unroll 1
                for (int kb = 0; kb < ti.nk; ++kb, ++step) {
                    const int s = step % ST;
                    const uint32_t sa = sbase + (uint32_t)(s * STAGE), bar = full0 + 8u * s;
                    wait_or_trap(empty0 + 8u * s, ((step / ST) & 1) ^ 1);
                    mbar_expect_tx(bar, (uint32_t)STAGE);
                    if (w.mode != 2) {
                        bool sec;
                        const int kl = pair_kb(kb, nk1, sec);
                        tma_load_2d(sa, sec ? &w.ta2 : &w.ta, bar, kl * 128, ti.r0);                /* X / dY [Rmax][red]  */
                        tma_load_3d(sa + 16384u, sec ? &w.tb2 : &w.tb, bar, kl * 128, ti.c0, ti.e); /* W / W^T [E][cols][red] */
                    } else {
                        const int k = (int)(ti.k0 + 128LL * kb);
                        tma_load_2d(sa, &w.ta, bar, k, ti.r0);                              /* dY^T [M][Lp] */
                        tma_load_2d(sa + 16384u, &w.tb, bar, k, ti.c0);                     /* X^T [K][Lp]  */
                    }
                }
            }
        }
        return;
    }
    /* consumers: warpgroup c = 0, 1; warp w of it holds rows 64 c + 16 w + g (+ 8), columns 8 j + 2 q + {0, 1} */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int ctid = tid - 128, c = __shfl_sync(0xffffffffu, ctid >> 7, 0), warp = ctid >> 5, lane = ctid & 31;
    const int g = lane >> 2, q = lane & 3;
    const int ldsb = w.mode == 0 ? ld_blk(p.K) : ld_blk(p.M);
    int step = 0;
#pragma unroll 1
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const WgTile ti = wg_tile<BN>(w, s_offs, s_pref, T, t);
        const int ra = ti.r0 + 64 * c + 16 * (warp & 3) + g, rb = ra + 8;
        const int bnd = (ti.c0 / 128 + 1) * 128; /* modes 0/1: columns from here take the weight's next 128-block */
        float acc[NR], tmp[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) acc[i] = tmp[i] = 0.f;
#pragma unroll 1
        for (int kb = 0; kb < ti.nk; ++kb, ++step) {
            const int s = step % ST;
            const uint32_t sa = sbase + (uint32_t)(s * STAGE);
            wait_or_trap(full0 + 8u * s, (step / ST) & 1);
            const uint64_t da = sw128_desc(sa + (uint32_t)c * 8192u, 16u, 1024u), db = sw128_desc(sa + 16384u, 16u, 1024u);
#pragma unroll
            for (int i = 0; i < NR; ++i) asm volatile("" : "+f"(tmp[i])::"memory");
            wgmma_fence();
            wgmma_e4m3<BN>(tmp, da, db, 0);
            wgmma_e4m3<BN>(tmp, da + 2, db + 2, 1);
            wgmma_e4m3<BN>(tmp, da + 4, db + 4, 1);
            wgmma_e4m3<BN>(tmp, da + 6, db + 6, 1);
            wgmma_commit();
            /* the row scales (and modes 0/1: the weight's one or two block scales), while the products run */
            float xa, xb, w0 = 0.f, w1 = 0.f;
            const float *sbr = nullptr;
            if (w.mode != 2) {
                bool sec;
                const int kl = pair_kb(kb, nk1, sec);
                const float *sar = (sec ? p.sa2 : p.sa) + (size_t)kl * p.Rmax;
                const float *wr = (sec ? p.sb2 : p.sb) + ((size_t)ti.e * kblocks(w.ncols) + ti.c0 / 128) * ldsb + kl;
                xa = ra < ti.r1 ? __ldg(sar + ra) : 0.f;
                xb = rb < ti.r1 ? __ldg(sar + rb) : 0.f;
                w0 = __ldg(wr);
                if (BN > 128 && bnd < w.ncols) w1 = __ldg(wr + ldsb);
            } else {
                const long long pb = ti.k0 / 128 + kb;
                const float *sar = p.sa + (size_t)pb * p.M;
                sbr = p.sb + (size_t)pb * p.K;
                xa = ra < p.M ? __ldg(sar + ra) : 0.f;
                xb = rb < p.M ? __ldg(sar + rb) : 0.f;
            }
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < NR; ++i) asm volatile("" : "+f"(tmp[i])::"memory");
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8u * s);
            /* promotion: tmp[4 j + 2 h + b] is (row 8 h + g of the warp's 16, column 8 j + 2 q + b) */
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int col = ti.c0 + 8 * j + 2 * q;
                float s0, s1;
                if (w.mode != 2) {
                    s0 = s1 = (BN > 128 && col >= bnd) ? w1 : w0;
                } else {
                    s0 = col < p.K ? __ldg(sbr + col) : 0.f;
                    s1 = col + 1 < p.K ? __ldg(sbr + col + 1) : 0.f;
                }
                acc[4 * j] += tmp[4 * j] * (xa * s0); acc[4 * j + 1] += tmp[4 * j + 1] * (xa * s1);
                acc[4 * j + 2] += tmp[4 * j + 2] * (xb * s0); acc[4 * j + 3] += tmp[4 * j + 3] * (xb * s1);
            }
        }
        /* store (ncols % 16 == 0: a column pair is in or out together) */
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const int col = ti.c0 + 8 * j + 2 * q;
            if (col >= w.ncols) continue;
            if (w.mode != 2) {
                bf16 *y = (bf16 *)p.out;
                if (ra < ti.r1) *reinterpret_cast<__nv_bfloat162 *>(y + (size_t)ra * w.ncols + col) = __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
                if (rb < ti.r1) *reinterpret_cast<__nv_bfloat162 *>(y + (size_t)rb * w.ncols + col) = __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
            } else {
                float *dw = (float *)p.out + (size_t)ti.e * p.M * p.K;
                if (ra < p.M) *reinterpret_cast<float2 *>(dw + (size_t)ra * p.K + col) = make_float2(acc[4 * j], acc[4 * j + 1]);
                if (rb < p.M) *reinterpret_cast<float2 *>(dw + (size_t)rb * p.K + col) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
            }
        }
    }
}

/* the operand maps (and the second pair's, p.a2): e4m3 bytes, boxes of 128 bytes x 128 rows (B: x BN rows; 3-D for
   the weights: x 1 expert); nonzero when they cannot be made */
template <int BN>
static int wg_maps(mt_ptx::EncodeTiledFn enc, WgParams &w, int mode, const Gmm &p) {
    const cuuint32_t boxa[2] = {128, 128}, boxb2[2] = {128, (cuuint32_t)BN}, boxb3[3] = {128, (cuuint32_t)BN, 1};
    if (mode == 2) {
        const cuuint64_t da[2] = {(cuuint64_t)p.Lp, (cuuint64_t)p.M}, db[2] = {(cuuint64_t)p.Lp, (cuuint64_t)p.K}, s1[1] = {(cuuint64_t)p.Lp};
        return mt_ptx::tma_map(enc, &w.ta, p.a, 2, da, s1, boxa, CU_TENSOR_MAP_DATA_TYPE_UINT8) |
               mt_ptx::tma_map(enc, &w.tb, p.b, 2, db, s1, boxb2, CU_TENSOR_MAP_DATA_TYPE_UINT8);
    }
    const int red = mode == 0 ? p.K : p.M;
    const cuuint64_t da[2] = {(cuuint64_t)red, (cuuint64_t)(p.Rmax > 0 ? p.Rmax : 1)}, sa[1] = {(cuuint64_t)red};
    const cuuint64_t db[3] = {(cuuint64_t)red, (cuuint64_t)w.ncols, (cuuint64_t)p.E}, sb[2] = {(cuuint64_t)red, (cuuint64_t)red * w.ncols};
    int rc = mt_ptx::tma_map(enc, &w.ta, p.a, 2, da, sa, boxa, CU_TENSOR_MAP_DATA_TYPE_UINT8) |
             mt_ptx::tma_map(enc, &w.tb, p.b, 3, db, sb, boxb3, CU_TENSOR_MAP_DATA_TYPE_UINT8);
    if (p.a2)
        rc |= mt_ptx::tma_map(enc, &w.ta2, p.a2, 2, da, sa, boxa, CU_TENSOR_MAP_DATA_TYPE_UINT8) |
              mt_ptx::tma_map(enc, &w.tb2, p.b2, 3, db, sb, boxb3, CU_TENSOR_MAP_DATA_TYPE_UINT8);
    return rc;
}
/* returns 1 when tensor maps cannot be made (the caller takes the simple kernel) */
template <int BN>
static int gmm_wgmma(int mode, const Gmm &p, cudaStream_t st, int nsm) {
    mt_ptx::EncodeTiledFn enc = mt_ptx::tma_encoder();
    if (!enc || p.E > WG_MAXE) return 1;
    WgParams w;
    memset(&w, 0, sizeof w);
    w.p = p;
    w.mode = mode;
    w.ncols = mode == 0 ? p.M : p.K;
    w.nct = (w.ncols + BN - 1) / BN;
    w.ntm = (p.M + 127) / 128;
    if (wg_maps<BN>(enc, w, mode, p)) return 1;
    void (*kern)(const WgParams) = k_gmm_wgmma<BN>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)WgCfg<BN>::SMEM) != cudaSuccess) return -1;
    kern<<<nsm, 384, WgCfg<BN>::SMEM, st>>>(w);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
/* ---- grouped: the fast kernel ------------------------------------------------------------------
   k_gmm_fast<BN> (variants 3 and 4): k_gmm_wgmma's pipeline with what kept its tensor cores waiting
   taken off the critical path.
   - Scales in shared memory with the stage: warp 1 of the producer warpgroup copies each stage's
     scales (128 row scales of A; modes 0/1 the weight's one or two block scales, mode 2 the BN
     column scales of X^T) with 4-byte cp.async and arrives on the stage's full barrier when they
     land (cp.async.mbarrier.arrive.noinc: the barrier expects 1 TMA arrival + 32 of these).  The
     consumers read them with ld.shared after the wait: no global load between the wgmma and the
     promotion (k_gmm_wgmma's mode 2 made 32 dependent L1/L2 loads a thread per 128-block there).
   - Tiles of 128 x BN with BN = 256 (modes 0/1, variant 4): each consumer warpgroup owns 64 rows
     and multiplies them in two waves of m64n128k32 (columns 0-127, then 128-255) into one 64-register
     slice, promoting after each wave: slice 64 + accumulator 128 registers.  A 256-column tile spans
     exactly two of the weight's 128-blocks, one per wave.  While one warpgroup waits and promotes,
     the other's wgmmas keep the tensor cores busy.  Mode 2 (dW, fp32 out) in 128 x 256 tiles
     (variants 4 and 5, where the tiles still fill the GPU: dw_wide) promotes each wave with its 128
     column scales the same way; a 128 x 256 fp32 staging tile does not fit beside the stages, so
     variant 4 stores a warp's rows a 128-column half at a time, through TMA boxes.  Variant 3's dW
     (128 x 128) instead runs a 128-block's wgmmas while the block before it is promoted, two slices
     in turn (dw_step): 64 + 64 + 64 registers.  The 128 x 256 tile reads 2/3 of the operand bytes a
     product from L2 (at 1,000 TFLOP/s the 128 x 128 tiles' operands would need ~7.8 TB/s of it).
   - The epilogue through shared memory (modes 0/1, and dW in 128 x 128 tiles): each consumer warp
     writes its 16 rows into a padded staging tile (bank-conflict free) and issues one bulk copy per row
     (cp.async.bulk global <- shared, rows past the expert or M skipped) and goes on with the next
     tile at once; it waits for its previous copies to have read the staging rows before
     overwriting them.  No CTA-wide barrier anywhere after the setup.
   - Stage count from the shared memory left (BN 128: 5 stages, 4 in mode 2; BN 256: 3).
   DIRECT (variant 5, BN 256; dW BN 128): the stores straight from the registers as k_gmm_wgmma's, no
   staging tile, its memory taken as stages (4; dW 6): whether more bytes in flight beat the overlapped
   epilogue is for the bench to say.
   The arithmetic is k_gmm_wgmma's (the same slice order and promotion formula); each output element
   is produced by one thread in a fixed order: bitwise reproducible. */
struct FastParams {
    WgParams w;
    int st;                      /* stages                                            */
    int pitch;                   /* staging row pitch, bytes                          */
    uint32_t off_sc, off_stg, off_bar, off_offs; /* shared-memory offsets from the 1024-aligned base */
};
template <int BN>
struct FastCfg {
    static constexpr int NW = BN / 128;                   /* n128 waves per 128-block          */
    static constexpr int AB = 128 * 128 + BN * 128;       /* operand bytes of a stage           */
    static constexpr int SC = 128 + BN;                   /* scale floats of a stage            */
};
/* the layout for `mode` and E experts (direct: no staging tile); st = 0 when not even 2 stages fit */
template <int BN>
static size_t fast_layout(int mode, int E, bool direct, FastParams &f) {
    typedef FastCfg<BN> C;
    /* the staging tile's row pitch (bytes); dW in 128 x 256 tiles: 128 fp32 columns (a half of the tile) in TMA boxes */
    f.pitch = direct ? 0 : mode == 2 ? (BN > 128 ? 128 * 4 : 128 * 4 + 32) : BN * 2 + 16;
    const size_t stg = (size_t)128 * f.pitch, fixed = 2048 + stg + (size_t)2 * (E + 1) * sizeof(int) + 16;
    const size_t per = (size_t)C::AB + (size_t)C::SC * 4 + 16;
    const size_t cap = 232448;
    int st = fixed < cap ? (int)((cap - fixed) / per) : 0;
    if (st > 8) st = 8;
    f.st = st < 2 ? 0 : st;
    f.off_sc = (uint32_t)((size_t)st * C::AB);
    f.off_stg = (f.off_sc + (uint32_t)((size_t)st * C::SC * 4) + 1023u) & ~1023u;   /* (the 128-byte swizzle's 1 KB pattern) */
    f.off_bar = f.off_stg + (uint32_t)stg;
    f.off_offs = f.off_bar + (uint32_t)(16 * st);
    return (size_t)f.off_offs + (size_t)2 * (E + 1) * sizeof(int) + 1024;
}

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/* arrive on `bar` once this thread's earlier cp.asyncs have landed (the barrier's count includes it) */
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_store(void *gdst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(gdst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ float lds_f32(uint32_t a) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ void lds_v2(uint32_t a, float &x, float &y) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(x), "=f"(y) : "r"(a) : "memory");
}
__device__ __forceinline__ void sts_b32(uint32_t a, uint32_t v) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(v) : "memory"); }
__device__ __forceinline__ void sts_v2(uint32_t a, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(a), "f"(x), "f"(y) : "memory");
}

/* one 128-block of a wave: the four m64n128k32 (k 32 each) of operands da, db into the slice t, committed */
__device__ __forceinline__ void slice_issue(float (&t)[64], uint64_t da, uint64_t db) {
    using namespace mt_ptx;
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(t[i])::"memory");
    wgmma_fence();
    wgmma_e4m3<128>(t, da, db, 0);
    wgmma_e4m3<128>(t, da + 2, db + 2, 1);
    wgmma_e4m3<128>(t, da + 4, db + 4, 1);
    wgmma_e4m3<128>(t, da + 6, db + 6, 1);
    wgmma_commit();
}
/* dW's 128-block: the stage at sa into the slice t (the warpgroup's rows at da0) */
__device__ __forceinline__ void dw_issue(float (&t)[64], uint32_t sa, uint32_t da0) {
    slice_issue(t, mt_ptx::sw128_desc(sa + da0, 16u, 1024u), mt_ptx::sw128_desc(sa + 16384u, 16u, 1024u));
}
/* dW's promotion of wave v's slice t: acc[64 v + ...] += t (xa | xb) sb_col, the column scales from the stage's (at sc);
   t[4 j + 2 h + b] is row 8 h + g of the warp's 16 (row scale xa for h = 0, xb for h = 1), column 128 v + 8 j + 2 q + b */
template <int N>
__device__ __forceinline__ void dw_scale_add(float (&acc)[N], const float (&t)[64], uint32_t sc, float xa, float xb, int v, int q) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        float s0, s1;
        lds_v2(sc + 4u * (128 + 128 * v + 8 * j + 2 * q), s0, s1);
        acc[64 * v + 4 * j] += t[4 * j] * (xa * s0); acc[64 * v + 4 * j + 1] += t[4 * j + 1] * (xa * s1);
        acc[64 * v + 4 * j + 2] += t[4 * j + 2] * (xb * s0); acc[64 * v + 4 * j + 3] += t[4 * j + 3] * (xb * s1);
    }
}
/* a 128 x 128 tile's promotion of a finished slice (its row scales read here; the warp's rows start at wr0) */
__device__ __forceinline__ void dw_promote(float (&acc)[64], float (&t)[64], uint32_t sc, int wr0, int g, int q) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(t[i])::"memory");
    const float xa = lds_f32(sc + 4u * (wr0 + g)), xb = lds_f32(sc + 4u * (wr0 + g + 8));
    dw_scale_add(acc, t, sc, xa, xb, 0, q);
}
/* the dW consumers' view of the stage ring */
struct DwRing {
    uint32_t full0, empty0, sbase, scb, da0;
    int ab, scbytes, st, wr0, g, q, lane;
};
/* promote slice t (its block at stage st) into acc and release the stage */
__device__ __forceinline__ void dw_done(const DwRing &r, float (&acc)[64], float (&t)[64], uint32_t st) {
    dw_promote(acc, t, r.scb + st * (uint32_t)r.scbytes, r.wr0, r.g, r.q);
    __syncwarp();
    mt_ptx::mbar_arrive_lane0(r.empty0 + 8u * st, r.lane);
}
/* dW's step: issue the next block (the ring's stage) into nxt, promote cur (the block before, at stage *st) while
   its wgmmas run, wait for them; *st becomes nxt's stage */
__device__ __forceinline__ void dw_step(const DwRing &r, float (&acc)[64], float (&nxt)[64], float (&cur)[64], uint32_t &st,
                                        int &stage, uint32_t &phase) {
    const uint32_t sn = (uint32_t)stage;
    wait_or_trap(r.full0 + 8u * sn, phase);
    dw_issue(nxt, r.sbase + sn * (uint32_t)r.ab, r.da0);
    if (++stage == r.st) { stage = 0; phase ^= 1; }
    dw_done(r, acc, cur, st);
    mt_ptx::wgmma_wait<0>();
    st = sn;
}
template <int BN, bool DW, bool DIRECT>
__global__ void __launch_bounds__(384, 1) k_gmm_fast(const __grid_constant__ FastParams f) {
    using namespace mt_ptx;
    typedef FastCfg<BN> C;
    constexpr int NW = C::NW, NR = BN / 2, NJ = BN / 8;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const WgParams &w = f.w;
    const Gmm &p = w.p;
    const int tid = threadIdx.x, ST = f.st;
    const uint32_t raw = smem_u32(smem_raw), pad = (1024u - (raw & 1023u)) & 1023u, sbase = raw + pad;
    const uint32_t scb = sbase + f.off_sc, stg = sbase + f.off_stg, full0 = sbase + f.off_bar, empty0 = full0 + 8u * ST;
    int *s_offs = reinterpret_cast<int *>(smem_raw + pad + f.off_offs);
    int *s_pref = s_offs + (p.E + 1);
    for (int i = tid; i <= p.E; i += blockDim.x) s_offs[i] = p.offs[i];
    __syncthreads();
    if (tid == 0) {
        int acc = 0;
        for (int e = 0; e < p.E; ++e) {
            s_pref[e] = acc;
            const int n = max(0, s_offs[e + 1] - s_offs[e]);
            acc += !DW ? ((n + 127) / 128) * w.nct : (n + 127) / 128;
        }
        s_pref[p.E] = acc;
        for (int s = 0; s < ST; ++s) { mbar_init(full0 + 8u * s, 1 + 32); mbar_init(empty0 + 8u * s, 8); }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        const int T = !DW ? s_pref[p.E] : p.E * w.ntm * w.nct;   /* (read after the register split: nothing kept across it) */
        const int ldsb = w.mode == 0 ? ld_blk(p.K) : ld_blk(p.M), nk1 = kblocks(w.mode == 0 ? p.K : p.M);
        if (tid == 0) {   /* operands: TMA */
            int stage = 0;
            uint32_t phase = 0;
#pragma unroll 1
            for (int t = blockIdx.x; t < T; t += gridDim.x) {
                const WgTile ti = wg_tile<BN>(w, s_offs, s_pref, T, t);
#pragma unroll 1
                for (int kb = 0; kb < ti.nk; ++kb) {
                    const uint32_t sa = sbase + (uint32_t)(stage * C::AB), bar = full0 + 8u * stage;
                    wait_or_trap(empty0 + 8u * stage, phase ^ 1);
                    mbar_expect_tx(bar, (uint32_t)C::AB);
                    if (!DW) {
                        bool sec;
                        const int kl = pair_kb(kb, nk1, sec);
                        tma_load_2d(sa, sec ? &w.ta2 : &w.ta, bar, kl * 128, ti.r0);
                        tma_load_3d(sa + 16384u, sec ? &w.tb2 : &w.tb, bar, kl * 128, ti.c0, ti.e);
                    } else {
                        const int k = (int)(ti.k0 + 128LL * kb);
                        tma_load_2d(sa, &w.ta, bar, k, ti.r0);
                        tma_load_2d(sa + 16384u, &w.tb, bar, k, ti.c0);
                    }
                    if (++stage == ST) { stage = 0; phase ^= 1; }
                }
            }
        } else if (tid >= 32 && tid < 64) {   /* scales: cp.async, one arrival a lane */
            const int lane = tid - 32;
            int stage = 0;
            uint32_t phase = 0;
#pragma unroll 1
            for (int t = blockIdx.x; t < T; t += gridDim.x) {
                const WgTile ti = wg_tile<BN>(w, s_offs, s_pref, T, t);
#pragma unroll 1
                for (int kb = 0; kb < ti.nk; ++kb) {
                    const uint32_t sc = scb + (uint32_t)(stage * C::SC * 4);
                    wait_or_trap(empty0 + 8u * stage, phase ^ 1);
                    if constexpr (!DW) {
                        bool sec;
                        const int kl = pair_kb(kb, nk1, sec);
                        const float *sar = (sec ? p.sa2 : p.sa) + (size_t)kl * p.Rmax;
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int r = ti.r0 + lane + 32 * i;
                            const bool ok = r < ti.r1;
                            cp_async_4(sc + 4u * (lane + 32 * i), ok ? (const void *)(sar + r) : (const void *)p.sa, ok ? 4 : 0);
                        }
                        if (lane < NW) {
                            const int nb = ti.c0 / 128 + lane;
                            const bool ok = nb * 128 < w.ncols;
                            const float *src = (sec ? p.sb2 : p.sb) + ((size_t)ti.e * kblocks(w.ncols) + (ok ? nb : 0)) * ldsb + kl;
                            cp_async_4(sc + 4u * (128 + lane), src, ok ? 4 : 0);
                        }
                    } else {
                        const long long pb = ti.k0 / 128 + kb;
                        const float *sar = p.sa + (size_t)pb * p.M, *sbr = p.sb + (size_t)pb * p.K;
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int m = ti.r0 + lane + 32 * i;
                            const bool ok = m < p.M;
                            cp_async_4(sc + 4u * (lane + 32 * i), ok ? (const void *)(sar + m) : (const void *)p.sa, ok ? 4 : 0);
                        }
#pragma unroll 1   /* (unrolled, 8 columns' addresses at once spill the producer's 40 registers) */
                        for (int i = 0; i < BN / 32; ++i) {
                            const int col = ti.c0 + lane + 32 * i;
                            const bool ok = col < p.K;
                            cp_async_4(sc + 4u * (128 + lane + 32 * i), ok ? (const void *)(sbr + col) : (const void *)p.sb, ok ? 4 : 0);
                        }
                    }
                    cp_async_arrive_noinc(full0 + 8u * stage);
                    if (++stage == ST) { stage = 0; phase ^= 1; }
                }
            }
            asm volatile("cp.async.wait_all;\n" ::: "memory");   /* nothing in flight when the warp exits */
        }
        return;
    }
    /* consumers: warpgroup c = 0, 1 (rows 64 c + [0, 64) of the tile); warp wl of it rows 16 wl + g (+ 8) */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int T = !DW ? s_pref[p.E] : p.E * w.ntm * w.nct;
    const int ctid = tid - 128, c = __shfl_sync(0xffffffffu, ctid >> 7, 0), wl = (ctid >> 5) & 3, lane = ctid & 31;
    const int g = lane >> 2, q = lane & 3, wr0 = 64 * c + 16 * wl;   /* the warp's first row in the tile */
    const int esz = DW ? 4 : 2;
    int stage = 0;
    uint32_t phase = 0;
    float tmp[64];   /* one wave's slice (wgmma overwrites it: scale_d 0 on its first k32) */
    constexpr bool DW2 = DW && BN == 128;   /* dW in 128 x 128 tiles: two slices in turn */
    float tmp2[DW2 ? 64 : 1];   /* the next 128-block's slice */
#pragma unroll
    for (int i = 0; i < 64; ++i) tmp[i] = 0.f;
#pragma unroll
    for (int i = 0; i < (DW2 ? 64 : 1); ++i) tmp2[i] = 0.f;
#pragma unroll 1
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const WgTile ti = wg_tile<BN>(w, s_offs, s_pref, T, t);
        const bool wave1 = NW > 1 && ti.c0 + 128 < w.ncols;   /* the tile's second 128 columns hold outputs */
        float acc[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) acc[i] = 0.f;
        if constexpr (DW2) {
            /* dW: a 128-block's wgmmas run while the block before it is promoted, two slices in turn (tmp, tmp2):
               wait for block kb's stage, issue it, promote block kb - 1 into acc and release its stage, wait for the
               wgmmas. Nothing but the promotion's straight-line code runs while they are in flight (ptxas serializes
               wgmmas with a barrier wait or a branch between issue and wait). The same products and promotion order
               as one block at a time. */
            const uint32_t da0 = (uint32_t)c * 8192u;
            if (ti.nk > 0) {   /* (an empty expert's tiles have no blocks: zeros) */
                uint32_t st = stage;   /* the stage of the block in the slice last issued */
                wait_or_trap(full0 + 8u * stage, phase);
                dw_issue(tmp, sbase + (uint32_t)(stage * C::AB), da0);
                if (++stage == ST) { stage = 0; phase ^= 1; }
                wgmma_wait<0>();
                const DwRing r = {full0, empty0, sbase, scb, da0, C::AB, C::SC * 4, ST, wr0, g, q, lane};
                int kb = 1;
#pragma unroll 1
                for (; kb + 1 < ti.nk; kb += 2) {
                    dw_step(r, acc, tmp2, tmp, st, stage, phase);
                    dw_step(r, acc, tmp, tmp2, st, stage, phase);
                }
                if (kb < ti.nk) {   /* one block left */
                    dw_step(r, acc, tmp2, tmp, st, stage, phase);
                    dw_done(r, acc, tmp2, st);
                } else {
                    dw_done(r, acc, tmp, st);
                }
            }
        } else {
#pragma unroll 1
            for (int kb = 0; kb < ti.nk; ++kb) {
                const uint32_t sa = sbase + (uint32_t)(stage * C::AB), sc = scb + (uint32_t)(stage * C::SC * 4);
                wait_or_trap(full0 + 8u * stage, phase);
                const float xa = lds_f32(sc + 4u * (wr0 + g)), xb = lds_f32(sc + 4u * (wr0 + g + 8));
                float sw[NW];   /* modes 0/1: the weight's block scale of each wave (dW: a scale a column, below) */
#pragma unroll
                for (int v = 0; v < NW; ++v) sw[v] = DW ? 0.f : lds_f32(sc + 4u * (128 + v));
                const uint64_t da = sw128_desc(sa + (uint32_t)c * 8192u, 16u, 1024u);
#pragma unroll
                for (int v = 0; v < NW; ++v) {
                    if (v > 0 && !wave1) break;
                    slice_issue(tmp, da, sw128_desc(sa + 16384u + (uint32_t)v * 16384u, 16u, 1024u));
                    wgmma_wait<0>();
#pragma unroll
                    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(tmp[i])::"memory");
                    /* promotion: tmp[4 j + 2 h + b] is (row 8 h + g of the warp's 16, column 128 v + 8 j + 2 q + b) */
                    const bool last = v == NW - 1 || !wave1;   /* the stage's last wave */
                    if constexpr (!DW) {
                        if (last) {   /* its operands and scales all read */
                            __syncwarp();
                            if (lane == 0) mbar_arrive(empty0 + 8u * stage);
                        }
                        const float fa = xa * sw[v], fb = xb * sw[v];
#pragma unroll
                        for (int j = 0; j < 16; ++j) {
                            acc[64 * v + 4 * j] += tmp[4 * j] * fa; acc[64 * v + 4 * j + 1] += tmp[4 * j + 1] * fa;
                            acc[64 * v + 4 * j + 2] += tmp[4 * j + 2] * fb; acc[64 * v + 4 * j + 3] += tmp[4 * j + 3] * fb;
                        }
                    } else {   /* dW: a scale a column, read from the stage, which is released after */
                        dw_scale_add(acc, tmp, sc, xa, xb, v, q);
                        if (last) {
                            __syncwarp();
                            if (lane == 0) mbar_arrive(empty0 + 8u * stage);
                        }
                    }
                }
                if (++stage == ST) { stage = 0; phase ^= 1; }
            }
        }
        if constexpr (DW) {   /* the gradient norm's part: the squares of what this warp stores, in a fixed order */
            if (p.ssq) {
                const int ra = ti.r0 + wr0 + g, rb = ra + 8;
                float ss = 0.f;
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    if (ti.c0 + 8 * j + 2 * q >= w.ncols) continue;
                    if (ra < p.M) ss += acc[4 * j] * acc[4 * j] + acc[4 * j + 1] * acc[4 * j + 1];
                    if (rb < p.M) ss += acc[4 * j + 2] * acc[4 * j + 2] + acc[4 * j + 3] * acc[4 * j + 3];
                }
                ss = warp_sum(ss);   /* (a butterfly: every lane the same bits) */
                if (lane == 0) p.ssq[(size_t)t * 8 + 4 * c + wl] = ss;
            }
        }
        if constexpr (DIRECT) {   /* epilogue: stores straight from the registers (k_gmm_wgmma's) */
            const int ra = ti.r0 + wr0 + g, rb = ra + 8;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int col = ti.c0 + 8 * j + 2 * q;
                if (col >= w.ncols) continue;
                if constexpr (!DW) {
                    bf16 *y = (bf16 *)p.out;
                    if (ra < ti.r1) *reinterpret_cast<uint32_t *>(y + (size_t)ra * w.ncols + col) = pack_bf16(acc[4 * j], acc[4 * j + 1]);
                    if (rb < ti.r1) *reinterpret_cast<uint32_t *>(y + (size_t)rb * w.ncols + col) = pack_bf16(acc[4 * j + 2], acc[4 * j + 3]);
                } else {
                    float *dw = (float *)p.out + (size_t)ti.e * p.M * p.K;
                    if (ra < p.M) *reinterpret_cast<float2 *>(dw + (size_t)ra * p.K + col) = make_float2(acc[4 * j], acc[4 * j + 1]);
                    if (rb < p.M) *reinterpret_cast<float2 *>(dw + (size_t)rb * p.K + col) = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
                }
            }
            continue;
        }
        if constexpr (DW && BN > 128) {
            /* dW's epilogue: the warp's 16 rows a 128-column half at a time through its 8 KB of the staging tile, as four
               16 x 32 boxes (2 KB, 128 bytes a row, the 16-byte chunks XOR-swizzled by the row), each written by one TMA
               store that clips what lies past M and K. Row g (g + 8) of the warp sits at box row sr = 2 (g % 4) + g / 4
               (+ 8), undone by the map's 5-D view (launch_pp's, the bf16 kernel's dW): a half-warp's 64-bit stores
               (rows 0-3) then meet 8 distinct chunks, 1 wavefront instead of 2. (One bulk copy a row instead costs a
               serialized loop of 16 copies a half, which ptxas forms for a per-lane address: ~13% of the kernel's
               samples in ncu.) */
            const uint32_t reg = stg + (uint32_t)(wr0 * f.pitch);
            const int sr = 2 * (g & 3) + (g >> 2);
#pragma unroll
            for (int h = 0; h < NW; ++h) {
                const int ch = ti.c0 + 128 * h;
                if (ch >= w.ncols) break;
                if (lane == 0) bulk_wait_read0();   /* the stores before have read the boxes */
                __syncwarp();
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    const uint32_t a = reg + (uint32_t)((j >> 2) * 2048 + sr * 128 + (((2 * (j & 3) + (q >> 1)) ^ sr) << 4) + (q & 1) * 8);
                    sts_v2(a, acc[64 * h + 4 * j], acc[64 * h + 4 * j + 1]);
                    sts_v2(a + 1024u, acc[64 * h + 4 * j + 2], acc[64 * h + 4 * j + 3]);
                }
                fence_proxy_async();
                __syncwarp();
                if (lane == 0) {
#pragma unroll
                    for (int b = 0; b < 4; ++b)
                        if (ch + 32 * b < w.ncols) tma_store_5d(&w.to, reg + (uint32_t)(b * 2048), ch + 32 * b, 0, 0, (ti.r0 + wr0) >> 3, ti.e);
                    bulk_commit();
                }
            }
            if (lane == 0 && t + (int)gridDim.x >= T) bulk_wait0();
            continue;
        }
        /* epilogue: this warp's 16 rows through the staging tile, one bulk copy a row */
        if (lane < 16) bulk_wait_read0();   /* the previous tile's copies of these rows have read them */
        __syncwarp();
        const uint32_t r_g = stg + (uint32_t)((wr0 + g) * f.pitch), r_g8 = r_g + 8u * (uint32_t)f.pitch;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            if constexpr (!DW) {
                const uint32_t o = (uint32_t)((8 * j + 2 * q) * 2);
                sts_b32(r_g + o, pack_bf16(acc[4 * j], acc[4 * j + 1]));
                sts_b32(r_g8 + o, pack_bf16(acc[4 * j + 2], acc[4 * j + 3]));
            } else {
                const uint32_t o = (uint32_t)((8 * j + 2 * q) * 4);
                sts_v2(r_g + o, acc[4 * j], acc[4 * j + 1]);
                sts_v2(r_g8 + o, acc[4 * j + 2], acc[4 * j + 3]);
            }
        }
        fence_proxy_async();   /* the staging writes -> visible to the bulk copies (async proxy) */
        __syncwarp();
        if (lane < 16) {
            const int row = ti.r0 + wr0 + lane;
            if (row < ti.r1 && ti.c0 < w.ncols) {
                const uint32_t bytes = (uint32_t)(min(BN, w.ncols - ti.c0) * esz);
                char *dst = !DW ? (char *)p.out + ((size_t)row * w.ncols + ti.c0) * 2
                                        : (char *)p.out + (((size_t)ti.e * p.M + row) * p.K + ti.c0) * 4;
                bulk_store(dst, stg + (uint32_t)((wr0 + lane) * f.pitch), bytes);
            }
            bulk_commit();
            if (t + (int)gridDim.x >= T) bulk_wait0();   /* the last tile: every copy done before the CTA ends */
        }
    }
}

/* dW in 128 x 256 tiles where they still give each of the n CTAs 4 or more (mid: 42-47 on an H200); fewer, wider tiles
   would leave multiprocessors idle (debug's experts: 16 tiles against 32) */
static long long dw_tiles(const Gmm &p, int bn) { return (long long)p.E * kblocks(p.M) * ((p.K + bn - 1) / bn); }
static bool dw_wide(const Gmm &p, int n) { return dw_tiles(p, 256) >= 4LL * n; }
template <int BN, bool DIRECT>
static int gmm_fast(int mode, const Gmm &p, cudaStream_t st, int nsm) {
    static_assert(BN == 128 || BN == 256, "tile width");
    if constexpr (BN > 128)
        if (mode == 2 && !dw_wide(p, nsm)) return gmm_fast<128, DIRECT>(mode, p, st, nsm);
    mt_ptx::EncodeTiledFn enc = mt_ptx::tma_encoder();
    if (!enc) return 1;
    FastParams f;
    memset(&f, 0, sizeof f);
    WgParams &w = f.w;
    w.p = p;
    w.mode = mode;
    w.ncols = mode == 0 ? p.M : p.K;
    w.nct = (w.ncols + BN - 1) / BN;
    w.ntm = (p.M + 127) / 128;
    const size_t smem = fast_layout<BN>(mode, p.E, DIRECT, f);
    if (f.st < 2) return 1;   /* too many experts for the offsets beside two stages: the simple kernel */
    if (wg_maps<BN>(enc, w, mode, p)) return 1;
    if (mode == 2 && BN > 128 && !DIRECT) {   /* the output's boxes (k_gmm_fast's dW epilogue): K, 2 rows 4 apart, 4 rows 1 apart, M / 8, E */
        const cuuint64_t r = (cuuint64_t)p.K * 4, d[5] = {(cuuint64_t)p.K, 2, 4, (cuuint64_t)(p.M / 8), (cuuint64_t)p.E};
        const cuuint64_t s[4] = {4 * r, r, 8 * r, (cuuint64_t)p.M * r};
        const cuuint32_t box[5] = {32, 2, 4, 2, 1};
        if (mt_ptx::tma_map(enc, &w.to, p.out, 5, d, s, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32))
            return gmm_fast<128, DIRECT>(mode, p, st, nsm);   /* (a driver without the view: 128-wide tiles) */
    }
    void (*kern)(const FastParams) = mode == 2 ? k_gmm_fast<BN, true, DIRECT> : k_gmm_fast<BN, false, DIRECT>;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return -1;
    kern<<<nsm, 384, smem, st>>>(f);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
/* dst[src[i]] = i for i < n: a permutation's inverse (the permutation's slot from its order, the combine's order from slot) */
__global__ void k_invert(int32_t *__restrict__ dst, const int32_t *__restrict__ src, int64_t n) {
    const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) dst[src[i]] = (int32_t)i;
}
} /* namespace mt_fp8 */

/* dW's partial sums of squares where no epilogue formed them: block b of gridDim.x sums the squares of its
   contiguous share of x in a fixed order (block_sum) into ssq[b]; the entries past gridDim.x are zeroed */
__global__ void __launch_bounds__(256) k_sq_parts(float *ssq, const float *x, int64_t n, int64_t len) {
    __shared__ float sh[32];
    const int64_t per = (n + gridDim.x - 1) / gridDim.x, lo = per * blockIdx.x, hi = lo + per < n ? lo + per : n;
    float s = 0.f;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) s += x[i] * x[i];
    s = block_sum(s, sh);
    if (threadIdx.x == 0) ssq[blockIdx.x] = s;
    for (int64_t i = gridDim.x + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (int64_t)gridDim.x * blockDim.x) ssq[i] = 0.f;
}
extern "C" {
long long mt_cuda_fp8_tpad(int Rmax, int E) { return mt_fp8::tpad(Rmax, E); }

int mt_cuda_fp8_quant_rows(mt_cuda *c, uint8_t *q, float *s, const void *x, int R, int C) {
    if (R < 0 || C < 16 || C % 16 || (((uintptr_t)x | (uintptr_t)q) & 15u)) return mt__fail(c, "fp8 quant rows", "C must be a multiple of 16, pointers 16-byte aligned");
    if (R == 0) return 0;
    mt_fp8::k_quant_rows<<<mt__blocks(R, 8), 256, 0, c->stream>>>(q, s, (const bf16 *)x, R, C);   /* a warp a row */
    LAUNCHED();
    return 0;
}
int mt_cuda_fp8_quant_cols(mt_cuda *c, uint8_t *qt, float *st, const void *x, const int32_t *d_offs, int E, int R, int C, long long Lp) {
    if (R < 0 || C < 8 || C % 8 || E < 1 || Lp < mt_fp8::tpad(R, d_offs ? E : 1) || Lp % 16 || (((uintptr_t)qt | (uintptr_t)x) & 15u))
        return mt__fail(c, "fp8 quant cols", "bad sizes (C a multiple of 8, Lp a multiple of 16 and at least mt_cuda_fp8_tpad(R, E), "
                                             "pointers 16-byte aligned)");
    const long long slots = Lp / 128;
    if (R == 0 || slots < 1) return 0;
    const dim3 grid((unsigned)slots, (unsigned)((C + 127) / 128));
    mt_fp8::k_quant_cols<false><<<grid, 256, 0, c->stream>>>(qt, st, (const bf16 *)x, d_offs, E, R, C, Lp, nullptr, nullptr, 0);
    LAUNCHED();
    return 0;
}
int mt_cuda_fp8_quant_both(mt_cuda *c, uint8_t *q, float *s, int Rq, uint8_t *qt, float *st, const void *x, const int32_t *d_offs, int E,
                           int R, int C, long long Lp) {
    if (R < 0 || C < 16 || C % 16 || E < 1 || Lp < mt_fp8::tpad(R, d_offs ? E : 1) || Lp % 16 || Rq < R ||
        (((uintptr_t)qt | (uintptr_t)q | (uintptr_t)x) & 15u))
        return mt__fail(c, "fp8 quant both", "bad sizes (C a multiple of 16, Lp a multiple of 16 and at least mt_cuda_fp8_tpad(R, E), "
                                             "Rq >= R, pointers 16-byte aligned)");
    const long long slots = Lp / 128;
    if (R == 0 || slots < 1) return 0;
    const dim3 grid((unsigned)slots, (unsigned)((C + 127) / 128));
    mt_fp8::k_quant_cols<true><<<grid, 256, 0, c->stream>>>(qt, st, (const bf16 *)x, d_offs, E, R, C, Lp, q, s, Rq);
    LAUNCHED();
    return 0;
}
int mt_cuda_fp8_quant_swiglu(mt_cuda *c, uint8_t *q, float *s, uint8_t *qt, float *st, uint8_t *q2, float *s2, uint8_t *qt2, float *st2,
                             const void *g, const void *u, const void *dh, const int32_t *d_offs, int E, int R, int C, long long Lp, int Rq) {
    if (R < 0 || C < 16 || C % 16 || E < 1 || Lp < mt_fp8::tpad(R, d_offs ? E : 1) || Lp % 16 || Rq < R || (!d_offs && Rq != R) ||
        (((uintptr_t)qt | (uintptr_t)q | (uintptr_t)g | (uintptr_t)u | (uintptr_t)dh | (uintptr_t)(dh ? qt2 : qt) | (uintptr_t)(dh ? q2 : q)) & 15u))
        return mt__fail(c, "fp8 quant swiglu", "bad sizes (C a multiple of 16, Lp a multiple of 16 and at least mt_cuda_fp8_tpad(R, E), "
                                               "Rq >= R (= R without groups), pointers 16-byte aligned)");
    const long long slots = Lp / 128;
    if (R == 0 || slots < 1) return 0;
    const dim3 grid((unsigned)slots, (unsigned)((C + 127) / 128));
    if (!dh) mt_fp8::k_quant_cols<true, mt_fp8::Q8_SWIGLU><<<grid, 256, 0, c->stream>>>(qt, st, (const bf16 *)g, d_offs, E, R, C, Lp, q, s, Rq,
                                                                                       (const bf16 *)u);
    else mt_fp8::k_quant_cols<true, mt_fp8::Q8_SWIGLU_BWD, 4><<<grid, 512, 0, c->stream>>>(   /* (4 rows a thread: 12 loads, all in flight) */qt, st, (const bf16 *)g, d_offs, E, R, C, Lp, q, s, Rq,
                                                                                       (const bf16 *)u, (const bf16 *)dh, q2, s2, qt2, st2);
    LAUNCHED();
    return 0;
}
int mt_cuda_fp8_quant_gather(mt_cuda *c, uint8_t *q, float *s, int Rq, uint8_t *qt, float *st, const void *x, const int32_t *map,
                             const float *w, int topk, const int32_t *d_offs, int E, int R, int C, long long Lp) {
    if (R < 0 || C < 16 || C % 16 || E < 1 || topk < 1 || Lp < mt_fp8::tpad(R, d_offs ? E : 1) || Lp % 16 || Rq < R || (!d_offs && Rq != R) ||
        !map || (((uintptr_t)qt | (uintptr_t)q | (uintptr_t)x) & 15u))
        return mt__fail(c, "fp8 quant gather", "bad sizes (C a multiple of 16, Lp a multiple of 16 and at least mt_cuda_fp8_tpad(R, E), "
                                               "Rq >= R (= R without groups), topk >= 1, a map, pointers 16-byte aligned)");
    const long long slots = Lp / 128;
    if (R == 0 || slots < 1) return 0;
    const dim3 grid((unsigned)slots, (unsigned)((C + 127) / 128));
    if (!w) mt_fp8::k_quant_cols<true, mt_fp8::Q8_GATHER><<<grid, 256, 0, c->stream>>>(qt, st, (const bf16 *)x, d_offs, E, R, C, Lp, q, s, Rq,
                                                                                      nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, map, nullptr, topk);
    else mt_fp8::k_quant_cols<true, mt_fp8::Q8_GATHER_W><<<grid, 256, 0, c->stream>>>(qt, st, (const bf16 *)x, d_offs, E, R, C, Lp, q, s, Rq,
                                                                                     nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, map, w, topk);
    LAUNCHED();
    return 0;
}
int mt_cuda_moe_permute_fp8(mt_cuda *c, int32_t *slot, int32_t *offs, const void *x, const int32_t *idx, int N, int D, int K, int E,
                            void *ws, uint8_t *q, float *s, int Rq, uint8_t *qt, float *st, long long Lp) {
    const int64_t NK = (int64_t)N * K;
    int32_t *perm;
    if (moe_sort(c, offs, idx, NK, E, ws, &perm)) return -1;
    if (NK <= 0) return 0;
    mt_fp8::k_invert<<<mt__blocks(NK, 256), 256, 0, c->stream>>>(slot, perm, NK);
    LAUNCHED();
    return mt_cuda_fp8_quant_gather(c, q, s, Rq, qt, st, x, perm, NULL, K, offs, E, (int)NK, D, Lp);
}
int mt_cuda_moe_combine_backward_fp8(mt_cuda *c, float *dw, const void *dy, const void *ys, const int32_t *slot, const float *w, int N,
                                     int D, int K, int32_t *map, uint8_t *q, float *s, int Rq, uint8_t *qt, float *st,
                                     const int32_t *d_offs, int E, long long Lp) {
    const int64_t NK = (int64_t)N * K;
    if (N <= 0) return 0;
    if (mt_cuda_moe_combine_backward(c, NULL, dw, dy, ys, slot, w, N, D, K)) return -1;
    mt_fp8::k_invert<<<mt__blocks(NK, 256), 256, 0, c->stream>>>(map, slot, NK);
    LAUNCHED();
    return mt_cuda_fp8_quant_gather(c, q, s, Rq, qt, st, dy, map, w, K, d_offs, E, (int)NK, D, Lp);
}
int mt_cuda_fp8_quant_weight2(mt_cuda *c, uint8_t *q, float *s, uint8_t *qt, float *st, const void *w, int E, int N, int K,
                              const int *skip) {
    if (E < 1 || E > 65535 || N < 4 || N % 4 || K < 8 || K % 8 || (((uintptr_t)q | (uintptr_t)qt | (uintptr_t)w) & 15u) || (!q && !qt))
        return mt__fail(c, "fp8 quant weight", "bad sizes (N a multiple of 4, K of 8, pointers 16-byte aligned)");
    const dim3 grid((unsigned)mt_fp8::kblocks(K), (unsigned)mt_fp8::kblocks(N), (unsigned)E);
    mt_fp8::k_quant_weight<<<grid, 256, 0, c->stream>>>(q, s, qt, st, (const bf16 *)w, N, K, (q ? 1 : 0) | (qt ? 2 : 0), skip);
    LAUNCHED();
    return 0;
}
int mt_cuda_fp8_quant_weight(mt_cuda *c, uint8_t *q, float *s, const void *w, int E, int N, int K, int transpose) {
    return transpose ? mt_cuda_fp8_quant_weight2(c, NULL, NULL, q, s, w, E, N, K, NULL) : mt_cuda_fp8_quant_weight2(c, q, s, NULL, NULL, w, E, N, K, NULL);
}
int mt_cuda_adamw_fp8(mt_cuda *c, float *p, void *m, void *v, int bf16_moments, void *p_bf16, const float *g, int E, int N, int K,
                      const float *lr, const float *coef, const float *hp, const int32_t *step, int decay, uint8_t *q, float *s,
                      uint8_t *qt, float *st, int *fresh) {
    if (E < 1 || E > 65535 || N < 4 || N % 4 || K < 8 || K % 8 || (!q && !qt) ||
        (((uintptr_t)q | (uintptr_t)qt | (uintptr_t)p | (uintptr_t)g | (uintptr_t)m | (uintptr_t)v | (uintptr_t)p_bf16) & 15u))
        return mt__fail(c, "AdamW with FP8 weight forms", "bad sizes (N a multiple of 4, K of 8, pointers 16-byte aligned)");
    const dim3 grid((unsigned)mt_fp8::kblocks(K), (unsigned)mt_fp8::kblocks(N), (unsigned)E);
    const int forms = (q ? 1 : 0) | (qt ? 2 : 0);
    if (bf16_moments)
        mt_fp8::k_adamw_q8<true><<<grid, 256, 0, c->stream>>>(p, m, v, (bf16 *)p_bf16, g, N, K, lr, coef, hp, step, decay, q, s, qt, st, forms, fresh);
    else
        mt_fp8::k_adamw_q8<false><<<grid, 256, 0, c->stream>>>(p, m, v, (bf16 *)p_bf16, g, N, K, lr, coef, hp, step, decay, q, s, qt, st, forms, fresh);
    LAUNCHED();
    return 0;
}
/* out[Mr][Nc] (bf16, or fp32 when out_f32) = A[Mr][:K] . B[Nc][:K]; A rows-quantized (scales kb * Mr + r), B weight-
   quantized (b_blk = 1) or rows-quantized (b_blk = 0, scales kb * Nc + n); lda, ldb: bytes per row */
int mt_cuda_fp8_gemm(mt_cuda *c, void *out, int out_f32, const uint8_t *a, const float *sa, int lda, const uint8_t *b,
                     const float *sb, int b_blk, int ldb, int Mr, int Nc, int K) {
    mt_fp8::Dense d;
    if (d.plan(c->lt, out_f32, b_blk, Mr, Nc, K, lda, ldb, sa, sb, c->lt_ws_bytes) ||
        d.run(c->lt, out, a, sa, b, sb, c->lt_ws, c->lt_ws_bytes, c->stream))
        return mt__fail(c, "mt_cuda_fp8_gemm", d.why);
    return 0;
}
/* the experts' FP8 GEMM: variant 0 k_gmm_wgmma<128> (the default), 2 k_gmm_wgmma<192>, 3 k_gmm_fast<128>,
   4 k_gmm_fast<256> (dW: where dw_wide, else <128>), 5 the same as 4 with the stores straight from the registers
   and the staging tile's memory as stages, 1 (or no tensor maps) k_gmm_simple; W [E][M][K]; mode 0: out Y [Rmax][M] bf16,
   a = X rows (scales over Rmax rows), b = W weight; mode 1: out dX [Rmax][K] bf16, a = dY rows, b = W^T weight;
   mode 2: out dW [E][M][K] fp32, a = dY cols [M][Lp], b = X cols [K][Lp].  ctas: the persistent kernels' grid (0: one
   CTA per multiprocessor; the tests take a few so that every CTA walks many tiles) */
static int fp8_gmm_run(mt_cuda *c, int mode, const mt_fp8::Gmm &p, int variant, int ctas) {
    const int n = ctas > 0 ? ctas : c->n_sms;
    int rc = 1;
    if (variant != 1 && mt_fp8::gmm_check(mode, p)) {
        if (variant == 3) rc = mt_fp8::gmm_fast<128, false>(mode, p, c->stream, n);
        else if (variant == 4) rc = mt_fp8::gmm_fast<256, false>(mode, p, c->stream, n);
        else if (variant == 5) rc = mt_fp8::gmm_fast<256, true>(mode, p, c->stream, n);
        else if (variant == 2) rc = mt_fp8::gmm_wgmma<192>(mode, p, c->stream, n);
        else rc = mt_fp8::gmm_wgmma<128>(mode, p, c->stream, n);
    }
    if (rc > 0) rc = mt_fp8::gmm_simple(mode, p, c->stream);   /* asked for, or no tensor maps */
    if (rc) return mt__fail(c, "mt_cuda_fp8_gmm", "bad arguments or launch failure");
    return 0;
}
int mt_cuda_fp8_gmm_ctas(mt_cuda *c, int mode, void *out, const uint8_t *a, const float *sa, const uint8_t *b, const float *sb,
                         const int32_t *d_offs, int E, int M, int K, int Rmax, long long Lp, int variant, int ctas) {
    mt_fp8::Gmm p;
    memset(&p, 0, sizeof p);
    p.out = out; p.a = a; p.b = b; p.sa = sa; p.sb = sb; p.offs = d_offs;
    p.E = E; p.M = M; p.K = K; p.Rmax = Rmax; p.Lp = Lp;
    return fp8_gmm_run(c, mode, p, variant, ctas);
}
int mt_cuda_fp8_gmm(mt_cuda *c, int mode, void *out, const uint8_t *a, const float *sa, const uint8_t *b, const float *sb,
                    const int32_t *d_offs, int E, int M, int K, int Rmax, long long Lp, int variant) {
    return mt_cuda_fp8_gmm_ctas(c, mode, out, a, sa, b, sb, d_offs, E, M, K, Rmax, Lp, variant, 0);
}
int mt_cuda_fp8_gmm2(mt_cuda *c, int mode, void *out, const uint8_t *a, const float *sa, const uint8_t *b, const float *sb,
                     const uint8_t *a2, const float *sa2, const uint8_t *b2, const float *sb2, const int32_t *d_offs, int E, int M,
                     int K, int Rmax, int variant, int ctas) {
    if (mode != 0 && mode != 1) return mt__fail(c, "mt_cuda_fp8_gmm2", "two pairs are for modes 0 and 1");
    mt_fp8::Gmm p;
    memset(&p, 0, sizeof p);
    p.out = out; p.a = a; p.b = b; p.sa = sa; p.sb = sb; p.offs = d_offs;
    p.a2 = a2; p.b2 = b2; p.sa2 = sa2; p.sb2 = sb2;
    p.E = E; p.M = M; p.K = K; p.Rmax = Rmax;
    return fp8_gmm_run(c, mode, p, variant, ctas);
}
int mt_cuda_fp8_gmm_dw(mt_cuda *c, void *out, const uint8_t *a, const float *sa, const uint8_t *b, const float *sb, const int32_t *d_offs,
                       int E, int M, int K, int Rmax, long long Lp, int variant, int ctas, float *ssq, int64_t ssq_len) {
    mt_fp8::Gmm p;
    memset(&p, 0, sizeof p);
    p.out = out; p.a = a; p.b = b; p.sa = sa; p.sb = sb; p.offs = d_offs;
    p.E = E; p.M = M; p.K = K; p.Rmax = Rmax; p.Lp = Lp;
    const long long tiles = mt_fp8::dw_tiles(p, 128), need = tiles * 8 > 1024 ? tiles * 8 : 1024;
    if (ssq && ssq_len < need) return mt__fail(c, "mt_cuda_fp8_gmm_dw", "fewer partial sums than tiles x 8");
    const int n = ctas > 0 ? ctas : c->n_sms;
    int rc = 1;
    bool fused = false;
    if (variant >= 3 && variant <= 5 && mt_fp8::gmm_check(2, p)) {
        /* the fast kernels write 8 partials a tile; those past the fewest tiles they may run (variants 4, 5: 128 x 256
           where dw_wide) are zeroed first, and a kernel with more tiles writes over the zeros */
        const long long t8 = 8 * (variant != 3 && mt_fp8::dw_wide(p, n) ? mt_fp8::dw_tiles(p, 256) : tiles);
        if (ssq && ssq_len > t8 && cudaMemsetAsync(ssq + t8, 0, (size_t)(ssq_len - t8) * sizeof(float), c->stream) != cudaSuccess)
            return mt__fail(c, "mt_cuda_fp8_gmm_dw", "zeroing the partial sums");
        p.ssq = ssq;
        rc = variant == 3 ? mt_fp8::gmm_fast<128, false>(2, p, c->stream, n) : variant == 4 ? mt_fp8::gmm_fast<256, false>(2, p, c->stream, n)
                                                                                           : mt_fp8::gmm_fast<256, true>(2, p, c->stream, n);
        fused = rc == 0;
        p.ssq = nullptr;
    } else if (variant != 1 && mt_fp8::gmm_check(2, p)) {
        rc = variant == 2 ? mt_fp8::gmm_wgmma<192>(2, p, c->stream, n) : mt_fp8::gmm_wgmma<128>(2, p, c->stream, n);
    }
    if (rc > 0) rc = mt_fp8::gmm_simple(2, p, c->stream);
    if (rc) return mt__fail(c, "mt_cuda_fp8_gmm_dw", "bad arguments or launch failure");
    if (!ssq) return 0;
    if (fused) return 0;
    const int64_t nel = (int64_t)E * M * K;   /* another kernel: the partial sums in a pass over dW */
    k_sq_parts<<<(unsigned)(ssq_len < 1024 ? ssq_len : 1024), 256, 0, c->stream>>>(ssq, (const float *)out, nel, ssq_len);
    LAUNCHED();
    return 0;
}
}  /* extern "C" */
