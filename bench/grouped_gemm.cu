/* bench/grouped_gemm.cu — the grouped expert GEMM of moetrain_kernels.cu on its own:
 * correctness against a float64 CPU reference over many expert layouts (outputs poisoned,
 * untouched rows checked, empty experts' gradients exactly zero), bitwise reruns, CUDA-graph
 * capture, bad arguments, dW with the squared-norm partials (GMM_DW_SQ), and timing against one
 * cuBLASLt call per expert.  Timed layouts: mid's experts with the largest at 5 and at 6.1 times
 * the mean (the loads of mid's training steps run from 3.5 to 7.3), and all at the mean (also
 * against cuBLASLt's strided-batched GEMM, the same work in one call); for dW also with the norm
 * partials (also timed alternating with the default without them: the "dW (+norm)" line, what
 * GMM_DW_SQ adds).  Also the cp.async kernel (gg_run's variant 1, the fallback without tensor maps).
 *
 *   make bench_gg && ./bench_gg
 * Environment: GG_ONLY_TIME=1 skips the checks (timing-only builds); GG_SOAK=S also runs dW back to
 * back for S seconds per layout (the power-limited rate; it slows the timings after it: alone only);
 * GG_EXTRA=1 adds layouts with 1536 in place of 1408, and "even1536": 32 experts of 1536 rows;
 * GG_LONG=1 adds "long": the same work as "even" in 8 experts of 6144 rows; GG_NSM=N runs the
 * persistent kernels on N CTAs (scaling runs; the split choice sees N SMs too);
 * GG_SMALL=1 runs only the small untimed layouts (for compute-sanitizer); GG_NOTIME=1 runs the checks only, GG_CASE=name one layout (e.g. even),
 * GG_MODE=m the timings of one mode (0 forward, 1 dX, 2 dW); GG_LTB=1 (equal layouts) our kernel once, then only cuBLASLt's batched
 * GEMM, each algorithm launched once (for ncu -k regex:nvjet).
 * Every layout also checks the gate/up launch with the SwiGLU (gg_run_glu, GMM_GLU) bitwise against two
 * launches and k_swiglu; GG_GLU=1 runs only the layout's own checks and that one, timed on the timed
 * layouts (with GG_ONLY_TIME=1: only the gate/up checks and timing).
 */
#define MOETRAIN_IMPLEMENTATION   /* mt_errf and friends, for the kernels file */
#include "../moetrain_kernels.cu"
#undef CK

/* the SM count the split choice uses: the bench's device (the library passes the binding's tuned count) */
static int g_nsm = 0;
static size_t mt_gg_workspace(int mode, int E, int M, int K, int Rmax) { return mt_ggk::gg_workspace(mode, E, M, K, Rmax, g_nsm); }
static int mt_gg(int mode, void *out, const void *a, const void *b, const int *d_offs, int E, int M, int K, int Rmax, void *ws,
                 cudaStream_t stream) {
    return mt_ggk::gg_run(2, mode, out, a, b, d_offs, E, M, K, Rmax, ws, stream, nullptr, nullptr, nullptr, 0, g_nsm);
}
/* gg_run's variants: 2 the runtime's (TMA; dW in turns, gg_pp_kernel), 1 the cp.async kernel it falls back to
   without tensor maps.  (The other kernels and tilings these benches once timed: docs/KERNELS.md.) */
static const char *variant_name[3] = {"-", "wgmma", "tma"};

/* ========================================================================================== */
/* Test harness: make bench_gg && ./bench_gg                                                  */
/* ========================================================================================== */
#include <cublasLt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <math.h>
#include <vector>
#include <algorithm>
#include <random>
#include <thread>
#include <string>

static int g_pass = 0, g_fail = 0;
static std::vector<std::string> g_table; /* timing lines, repeated at the end */
static void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stdout, fmt, ap);
    va_end(ap);
    printf("\nGG: %d passed, %d failed\n", g_pass, g_fail + 1);
    exit(2);
}
#define CK(x)                                                                                           \
    do {                                                                                                \
        cudaError_t e_ = (x);                                                                           \
        if (e_ != cudaSuccess) fatal("CUDA error %s at %s:%d: %s", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
    } while (0)
#define CKL(x)                                                                                          \
    do {                                                                                                \
        cublasStatus_t s_ = (x);                                                                        \
        if (s_ != CUBLAS_STATUS_SUCCESS) fatal("cuBLASLt error %d at %s:%d (%s)", (int)s_, __FILE__, __LINE__, #x); \
    } while (0)

static void report(bool ok, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    printf("  %-108s %s\n", buf, ok ? "PASS" : "FAIL");
    fflush(stdout);
    if (ok) ++g_pass; else ++g_fail;
}

static inline float bf2f(uint16_t u) {
    uint32_t x = (uint32_t)u << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* counter-based normal(0,1) bf16 generator */
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
__global__ void fill_normal_kernel(__nv_bfloat16 *p, size_t n, uint64_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint64_t h = splitmix64(seed * 0x100000001B3ull + i);
        const float u1 = ((float)(h >> 40) + 1.0f) * (1.0f / 16777217.0f); /* (0, 1] */
        const float u2 = (float)((h >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
        p[i] = __float2bfloat16_rn(sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2));
    }
}
/* cudaMemset runs on the legacy default stream, which does not order with the bench's non-blocking
   stream: wait for it, so that no later launch on that stream can run before (or under) the fill.
   (Without the wait, the graph-capture check failed under racecheck's slower launches: the fill
   landed after the eager launch.) */
static cudaError_t memset_dev(void *p, int v, size_t n) {
    const cudaError_t e = cudaMemset(p, v, n);
    return e != cudaSuccess ? e : cudaDeviceSynchronize();
}
static void fill_normal(__nv_bfloat16 *p, size_t n, uint64_t seed) {
    fill_normal_kernel<<<1024, 256>>>(p, n, seed);
    CK(cudaGetLastError());
}

template <class F>
static void parallel_for(int n, F f) {
    int nt = (int)std::thread::hardware_concurrency();
    if (nt < 1) nt = 1;
    if (nt > 64) nt = 64;
    std::vector<std::thread> th;
    for (int t = 0; t < nt; ++t)
        th.emplace_back([&, t]() {
            for (int i = t; i < n; i += nt) f(i);
        });
    for (auto &x : th) x.join();
}

struct Case {
    std::string name;
    int E, M, K;
    std::vector<int> counts;
    bool timed;
};

struct Bufs {
    int E, M, K, R, Rmax;
    std::vector<int> offs, rexp;
    int *d_offs = nullptr;
    __nv_bfloat16 *X = nullptr, *W = nullptr, *dY = nullptr, *Y = nullptr, *dX = nullptr;
    float *dW = nullptr;
    void *ws = nullptr;
    size_t ws_bytes = 0;
    std::vector<uint16_t> hX, hW, hdY;
};

static const char *mode_name[3] = {"fwd  Y=XW^T", "dX=dY W", "dW=dY^T X"};

/* Compare one mode's output against a double-precision CPU reference.
   Checks: rel L2 error on the sampled set, no non-finite value anywhere in the written range, rows
   R..Rmax-1 untouched (modes 0/1), experts without rows exactly zero (mode 2). */
static bool check_mode(const Bufs &b, int mode, const void *hout, bool full, std::mt19937 &rng, char *msg, size_t msglen) {
    const int E = b.E, M = b.M, K = b.K, R = b.R, Rmax = b.Rmax;
    double num = 0, den = 0;
    long long nonfin = 0, untouched_bad = 0, zero_bad = 0, checked = 0;
    if (mode == 0 || mode == 1) {
        const int N = mode == 0 ? M : K;
        const uint16_t *o = (const uint16_t *)hout;
        for (size_t i = 0; i < (size_t)R * N; ++i) if (!std::isfinite(bf2f(o[i]))) ++nonfin;
        for (size_t i = (size_t)R * N; i < (size_t)Rmax * N; ++i) if (o[i] != 0xFFFF) ++untouched_bad;
        std::vector<int> rows;
        if (full) {
            for (int r = 0; r < R; ++r) rows.push_back(r);
        } else {
            for (int e = 0; e < E; ++e)
                if (b.offs[e + 1] > b.offs[e]) {
                    rows.push_back(b.offs[e]);
                    rows.push_back(b.offs[e + 1] - 1);
                    rows.push_back(b.offs[e] + (int)(rng() % (unsigned)(b.offs[e + 1] - b.offs[e])));
                }
            for (int i = 0; i < 96 && R > 0; ++i) rows.push_back((int)(rng() % (unsigned)R));
        }
        std::vector<double> pn(rows.size(), 0.0), pd(rows.size(), 0.0);
        parallel_for((int)rows.size(), [&](int i) {
            const int r = rows[i], e = b.rexp[r];
            std::vector<float> arow(mode == 0 ? K : M);
            if (mode == 0) for (int k = 0; k < K; ++k) arow[k] = bf2f(b.hX[(size_t)r * K + k]);
            else for (int m = 0; m < M; ++m) arow[m] = bf2f(b.hdY[(size_t)r * M + m]);
            double nn = 0, dd = 0;
            if (mode == 0) {
                for (int m = 0; m < M; ++m) {
                    const uint16_t *w = &b.hW[((size_t)e * M + m) * K];
                    double ref = 0;
                    for (int k = 0; k < K; ++k) ref += (double)arow[k] * bf2f(w[k]);
                    const double g = bf2f(o[(size_t)r * N + m]);
                    nn += (g - ref) * (g - ref); dd += ref * ref;
                }
            } else {
                std::vector<double> ref(K, 0.0);
                for (int m = 0; m < M; ++m) {
                    const uint16_t *w = &b.hW[((size_t)e * M + m) * K];
                    const double a = arow[m];
                    for (int k = 0; k < K; ++k) ref[k] += a * bf2f(w[k]);
                }
                for (int k = 0; k < K; ++k) {
                    const double g = bf2f(o[(size_t)r * N + k]);
                    nn += (g - ref[k]) * (g - ref[k]); dd += ref[k] * ref[k];
                }
            }
            pn[i] = nn; pd[i] = dd;
        });
        for (size_t i = 0; i < rows.size(); ++i) { num += pn[i]; den += pd[i]; }
        checked = (long long)rows.size() * N;
    } else {
        const float *o = (const float *)hout;
        const size_t per = (size_t)M * K;
        for (size_t i = 0; i < (size_t)E * per; ++i) if (!std::isfinite(o[i])) ++nonfin;
        for (int e = 0; e < E; ++e)
            if (b.offs[e + 1] == b.offs[e])
                for (size_t i = 0; i < per; ++i) if (o[e * per + i] != 0.0f) ++zero_bad;
        std::vector<std::pair<int, int>> els; /* (e, m*K + k) */
        for (int e = 0; e < E; ++e) {
            if (full) {
                for (size_t i = 0; i < per; ++i) els.push_back({e, (int)i});
            } else {
                for (int i = 0; i < 256; ++i) els.push_back({e, (int)(rng() % (unsigned)per)});
                els.push_back({e, 0});
                els.push_back({e, (int)per - 1});
            }
        }
        const int chunk = 4096;
        const int nchunks = (int)((els.size() + chunk - 1) / chunk);
        std::vector<double> pn(nchunks, 0.0), pd(nchunks, 0.0);
        parallel_for(nchunks, [&](int ci) {
            double nn = 0, dd = 0;
            for (size_t j = (size_t)ci * chunk; j < std::min(els.size(), (size_t)(ci + 1) * chunk); ++j) {
                const int e = els[j].first, mk = els[j].second, m = mk / K, k = mk % K;
                double ref = 0;
                for (int r = b.offs[e]; r < b.offs[e + 1]; ++r)
                    ref += (double)bf2f(b.hdY[(size_t)r * M + m]) * bf2f(b.hX[(size_t)r * K + k]);
                const double g = o[(size_t)e * per + mk];
                nn += (g - ref) * (g - ref); dd += ref * ref;
            }
            pn[ci] = nn; pd[ci] = dd;
        });
        for (int i = 0; i < nchunks; ++i) { num += pn[i]; den += pd[i]; }
        checked = (long long)els.size();
    }
    const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    const double tol = mode == 2 ? 1e-4 : 1e-2;
    const bool ok = std::isfinite(rel) && rel <= tol && nonfin == 0 && untouched_bad == 0 && zero_bad == 0;
    snprintf(msg, msglen, "rel=%.2e (tol %.0e, %lld checked) nonfinite=%lld untouched_bad=%lld zero_bad=%lld", rel, tol, checked,
             nonfin, untouched_bad, zero_bad);
    return ok;
}

static void mode_io(const Bufs &b, int mode, void **out, const void **a, const void **bb, size_t *bytes) {
    if (mode == 0) { *out = b.Y; *a = b.X; *bb = b.W; *bytes = (size_t)b.Rmax * b.M * 2; }
    else if (mode == 1) { *out = b.dX; *a = b.dY; *bb = b.W; *bytes = (size_t)b.Rmax * b.K * 2; }
    else { *out = b.dW; *a = b.dY; *bb = b.X; *bytes = (size_t)b.E * b.M * b.K * 4; }
}

/* pair: mode 1 with the second pair (dY, W) again, as GMM_DX2 runs it: dX = dY W + dY W */
static int run_variant(int variant, const Bufs &b, int mode, void *ws, cudaStream_t st, bool pair = false, float *ssq = nullptr,
                       long long ssq_len = 0) {
    void *out; const void *a, *bb; size_t bytes;
    mode_io(b, mode, &out, &a, &bb, &bytes);
    return mt_ggk::gg_run(variant, mode, out, a, bb, b.d_offs, b.E, b.M, b.K, b.Rmax, ws, st, pair ? a : nullptr, pair ? bb : nullptr,
                          ssq, ssq_len, g_nsm);
}

/* ---------------- cuBLASLt baseline: one matmul per expert (bf16 in, fp32 compute) ---------------- */
struct LtPlan {
    cublasLtHandle_t lt = nullptr;
    cublasLtMatmulDesc_t op = nullptr;
    std::vector<cublasLtMatrixLayout_t> la, lb, lc;
    std::vector<cublasLtMatmulAlgo_t> algo;
    std::vector<int> ex;
    void *ws = nullptr;
    size_t wsz = 64u << 20;
    int mode = 0;
};
static void lt_plan(LtPlan &P, const Bufs &b, int mode) {
    P.mode = mode;
    CKL(cublasLtCreate(&P.lt));
    CKL(cublasLtMatmulDescCreate(&P.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = mode == 0 ? CUBLAS_OP_T : CUBLAS_OP_N, tb = mode == 2 ? CUBLAS_OP_T : CUBLAS_OP_N;
    CKL(cublasLtMatmulDescSetAttribute(P.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CKL(cublasLtMatmulDescSetAttribute(P.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CK(cudaMalloc(&P.ws, P.wsz));
    cublasLtMatmulPreference_t pref;
    CKL(cublasLtMatmulPreferenceCreate(&pref));
    CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &P.wsz, sizeof P.wsz));
    const int M = b.M, K = b.K;
    for (int e = 0; e < b.E; ++e) {
        const int n = b.offs[e + 1] - b.offs[e];
        if (n == 0) continue;
        cublasLtMatrixLayout_t A, B, C;
        /* column-major views of the row-major buffers */
        if (mode == 0) { /* Y^T (M x n) = op(W^T stored K x M) * X^T (K x n) */
            CKL(cublasLtMatrixLayoutCreate(&A, CUDA_R_16BF, K, M, K));
            CKL(cublasLtMatrixLayoutCreate(&B, CUDA_R_16BF, K, n, K));
            CKL(cublasLtMatrixLayoutCreate(&C, CUDA_R_16BF, M, n, M));
        } else if (mode == 1) { /* dX^T (K x n) = W^T (K x M) * dY^T (M x n) */
            CKL(cublasLtMatrixLayoutCreate(&A, CUDA_R_16BF, K, M, K));
            CKL(cublasLtMatrixLayoutCreate(&B, CUDA_R_16BF, M, n, M));
            CKL(cublasLtMatrixLayoutCreate(&C, CUDA_R_16BF, K, n, K));
        } else { /* dW^T (K x M) = X^T (K x n) * op(dY^T stored M x n) */
            CKL(cublasLtMatrixLayoutCreate(&A, CUDA_R_16BF, K, n, K));
            CKL(cublasLtMatrixLayoutCreate(&B, CUDA_R_16BF, M, n, M));
            CKL(cublasLtMatrixLayoutCreate(&C, CUDA_R_32F, K, M, K));
        }
        cublasLtMatmulHeuristicResult_t res;
        int nres = 0;
        CKL(cublasLtMatmulAlgoGetHeuristic(P.lt, P.op, A, B, C, C, pref, 1, &res, &nres));
        if (nres < 1) fatal("cuBLASLt: no algorithm for expert %d", e);
        P.la.push_back(A); P.lb.push_back(B); P.lc.push_back(C); P.algo.push_back(res.algo); P.ex.push_back(e);
    }
    CKL(cublasLtMatmulPreferenceDestroy(pref));
}
static void lt_run(LtPlan &P, const Bufs &b, void *out, cudaStream_t st) {
    const float alpha = 1.f, beta = 0.f;
    const int M = b.M, K = b.K;
    for (size_t i = 0; i < P.ex.size(); ++i) {
        const int e = P.ex[i];
        const size_t r0 = (size_t)b.offs[e];
        const void *A, *B;
        void *C;
        if (P.mode == 0) { A = b.W + (size_t)e * M * K; B = b.X + r0 * K; C = (__nv_bfloat16 *)out + r0 * M; }
        else if (P.mode == 1) { A = b.W + (size_t)e * M * K; B = b.dY + r0 * M; C = (__nv_bfloat16 *)out + r0 * K; }
        else { A = b.X + r0 * K; B = b.dY + r0 * M; C = (float *)out + (size_t)e * M * K; }
        CKL(cublasLtMatmul(P.lt, P.op, &alpha, A, P.la[i], B, P.lb[i], &beta, C, P.lc[i], C, P.lc[i], &P.algo[i], P.ws, P.wsz, st));
    }
    if (P.mode == 2) /* experts without rows: zeros, as the grouped kernel writes */
        for (int e = 0; e < b.E; ++e)
            if (b.offs[e + 1] == b.offs[e]) CK(cudaMemsetAsync((float *)out + (size_t)e * M * K, 0, (size_t)M * K * 4, st));
}
template <class F>
static float time_median(F f, cudaStream_t st);

/* ---------------- cuBLASLt anchor for equal experts: one strided-batched call --------------------
   The same work as one grouped call when every expert has n rows: cuBLASLt's batched GEMM, the best
   of its first 16 heuristic algorithms (each timed; bitwise-irrelevant, only a rate to compare with).
   Returns the best time in ms and checks its output against the grouped result (rel <= tol). */
static float lt_batched(const Bufs &b, int mode, int n, void *out, const void *ref, size_t bytes, cudaStream_t st, double *rel_out,
                        int *nalgo) {
    const int M = b.M, K = b.K, E = b.E;
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t op;
    CKL(cublasLtCreate(&lt));
    CKL(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = mode == 0 ? CUBLAS_OP_T : CUBLAS_OP_N, tb = mode == 2 ? CUBLAS_OP_T : CUBLAS_OP_N;
    CKL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CKL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    /* rows, cols, ld, batch stride of A, B, C in column-major views (as lt_plan, one expert) */
    long long d[3][4];
    cudaDataType_t ct = CUDA_R_16BF;
    const void *A, *B;
    if (mode == 0) {
        long long t[3][4] = {{K, M, K, (long long)M * K}, {K, n, K, (long long)n * K}, {M, n, M, (long long)n * M}};
        memcpy(d, t, sizeof d); A = b.W; B = b.X;
    } else if (mode == 1) {
        long long t[3][4] = {{K, M, K, (long long)M * K}, {M, n, M, (long long)n * M}, {K, n, K, (long long)n * K}};
        memcpy(d, t, sizeof d); A = b.W; B = b.dY;
    } else {
        long long t[3][4] = {{K, n, K, (long long)n * K}, {M, n, M, (long long)n * M}, {K, M, K, (long long)M * K}};
        memcpy(d, t, sizeof d); A = b.X; B = b.dY; ct = CUDA_R_32F;
    }
    cublasLtMatrixLayout_t L[3];
    for (int i = 0; i < 3; ++i) {
        CKL(cublasLtMatrixLayoutCreate(&L[i], i == 2 ? ct : CUDA_R_16BF, d[i][0], d[i][1], d[i][2]));
        CKL(cublasLtMatrixLayoutSetAttribute(L[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &E, sizeof E));
        CKL(cublasLtMatrixLayoutSetAttribute(L[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &d[i][3], sizeof d[i][3]));
    }
    void *ws;
    size_t wsz = 64u << 20;
    CK(cudaMalloc(&ws, wsz));
    cublasLtMatmulPreference_t pref;
    CKL(cublasLtMatmulPreferenceCreate(&pref));
    CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz));
    cublasLtMatmulHeuristicResult_t res[16];
    int nres = 0;
    CKL(cublasLtMatmulAlgoGetHeuristic(lt, op, L[0], L[1], L[2], L[2], pref, 16, res, &nres));
    if (nres < 1) fatal("cuBLASLt: no batched algorithm for mode %d", mode);
    const float alpha = 1.f, beta = 0.f;
    float best = 1e30f;
    int besti = 0;
    for (int i = 0; i < nres; ++i) {
        const float t = time_median([&]() {
            CKL(cublasLtMatmul(lt, op, &alpha, A, L[0], B, L[1], &beta, out, L[2], out, L[2], &res[i].algo, ws, wsz, st));
        }, st);
        if (t < best) { best = t; besti = i; }
    }
    CK(memset_dev(out, 0xFF, bytes));
    CKL(cublasLtMatmul(lt, op, &alpha, A, L[0], B, L[1], &beta, out, L[2], out, L[2], &res[besti].algo, ws, wsz, st));
    CK(cudaStreamSynchronize(st));
    std::vector<unsigned char> h(bytes);
    CK(cudaMemcpy(h.data(), out, bytes, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    const size_t cnt = mode == 2 ? bytes / 4 : (size_t)b.R * (mode == 0 ? M : K);
    for (size_t i = 0; i < cnt; ++i) {
        const double g = mode == 2 ? ((const float *)ref)[i] : bf2f(((const uint16_t *)ref)[i]);
        const double r = mode == 2 ? ((const float *)h.data())[i] : bf2f(((const uint16_t *)h.data())[i]);
        num += (g - r) * (g - r);
        den += r * r;
    }
    *rel_out = den > 0 ? sqrt(num / den) : sqrt(num);
    *nalgo = nres;
    CKL(cublasLtMatmulPreferenceDestroy(pref));
    for (int i = 0; i < 3; ++i) CKL(cublasLtMatrixLayoutDestroy(L[i]));
    CKL(cublasLtMatmulDescDestroy(op));
    CKL(cublasLtDestroy(lt));
    CK(cudaFree(ws));
    return best;
}

static void lt_free(LtPlan &P) {
    for (size_t i = 0; i < P.ex.size(); ++i) {
        CKL(cublasLtMatrixLayoutDestroy(P.la[i]));
        CKL(cublasLtMatrixLayoutDestroy(P.lb[i]));
        CKL(cublasLtMatrixLayoutDestroy(P.lc[i]));
    }
    CKL(cublasLtMatmulDescDestroy(P.op));
    CKL(cublasLtDestroy(P.lt));
    CK(cudaFree(P.ws));
}

template <class F>
static float time_median(F f, cudaStream_t st) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const bool once = getenv("GG_LTB") != nullptr;   /* profiler runs: one launch each */
    for (int i = 0; i < (once ? 0 : 3); ++i) f();
    CK(cudaStreamSynchronize(st));
    std::vector<float> ts;
    for (int i = 0; i < (once ? 1 : 10); ++i) {
        CK(cudaEventRecord(e0, st));
        f();
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        ts.push_back(ms);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    std::sort(ts.begin(), ts.end());
    return once ? ts[0] : 0.5f * (ts[4] + ts[5]);
}

/* GMM_GLU (gate and up in one launch, the SwiGLU in the epilogue) against two launches of the default
   kernel and k_swiglu, bitwise over every row of g, u and h (rows past R poisoned and untouched); the
   cp.async fallback likewise; h against silu(g) u from the bf16 g and u on the host.  Timed layouts:
   the fused launch against the two launches with and without the SwiGLU, alternating. */
static void glu_case(const Case &c, const Bufs &b, uint64_t seed, cudaStream_t st) {
    const int E = b.E, M = b.M, K = b.K, Rmax = b.Rmax;
    const size_t n = (size_t)Rmax * M, bytes = n * 2;
    __nv_bfloat16 *W2, *o[6];
    CK(cudaMalloc(&W2, (size_t)E * M * K * 2));
    fill_normal(W2, (size_t)E * M * K, seed * 7919 + 5);
    for (int i = 0; i < 6; ++i) { CK(cudaMalloc(&o[i], bytes)); CK(memset_dev(o[i], 0xFF, bytes)); }
    auto sep = [&](bool h) {
        if (mt_ggk::gg_run(2, 0, o[3], b.X, b.W, b.d_offs, E, M, K, Rmax, nullptr, st, nullptr, nullptr, nullptr, 0, g_nsm) ||
            mt_ggk::gg_run(2, 0, o[4], b.X, W2, b.d_offs, E, M, K, Rmax, nullptr, st, nullptr, nullptr, nullptr, 0, g_nsm))
            fatal("launch failed");
        if (h) {
            const size_t nr = (size_t)b.R * M;   /* the rows the GEMMs write */
            k_swiglu<<<(unsigned)std::min<size_t>((nr / 8 + 1 + 255) / 256, 65536), 256, 0, st>>>(o[5], o[3], o[4], (int64_t)nr, NULL, 0);
            CK(cudaGetLastError());
        }
    };
    auto glu = [&](int variant, bool h) {
        if (mt_ggk::gg_run_glu(variant, o[0], o[1], h ? o[2] : nullptr, b.X, b.W, W2, b.d_offs, E, M, K, Rmax, st, g_nsm)) fatal("launch failed");
    };
    sep(true);
    std::vector<uint16_t> ref(3 * n), got(3 * n);
    CK(cudaStreamSynchronize(st));
    for (int i = 0; i < 3; ++i) CK(cudaMemcpy(&ref[i * n], o[3 + i], bytes, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    long long untouched = 0;
    for (size_t i = 0; i < (size_t)b.R * M; ++i) {
        const double gg = bf2f(ref[i]), uu = bf2f(ref[n + i]), want = gg / (1.0 + exp(-gg)) * uu, h = bf2f(ref[2 * n + i]);
        num += (h - want) * (h - want); den += want * want;
    }
    for (size_t i = (size_t)b.R * M; i < n; ++i) untouched += ref[i] != 0xFFFF || ref[n + i] != 0xFFFF || ref[2 * n + i] != 0xFFFF;
    const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    report(rel <= 1e-2 && untouched == 0, "%s GLU reference: h = silu(g) u from the bf16 g, u: rel=%.2e, untouched rows bad=%lld", c.name.c_str(), rel, untouched);
    for (int variant = 2; variant >= 1; --variant) {
        for (int i = 0; i < 3; ++i) CK(memset_dev(o[i], 0xFF, bytes));
        glu(variant, true);
        CK(cudaStreamSynchronize(st));
        for (int i = 0; i < 3; ++i) CK(cudaMemcpy(&got[i * n], o[i], bytes, cudaMemcpyDeviceToHost));
        /* g and u over every row; h over the rows the GEMMs write (the fallback's k_swiglu runs over all
           Rmax rows, from the untouched rows of g and u), and untouched past them by the TMA kernel */
        long long diff = 0;
        for (size_t i = 0; i < 2 * n + (size_t)b.R * M; ++i) diff += got[i] != ref[i];
        if (variant == 2)
            for (size_t i = 2 * n + (size_t)b.R * M; i < 3 * n; ++i) diff += got[i] != 0xFFFF;
        const bool same = diff == 0;
        /* without h: g and u the same, h's buffer untouched */
        CK(memset_dev(o[2], 0xFF, bytes));
        glu(variant, false);
        CK(cudaStreamSynchronize(st));
        std::vector<uint16_t> h2(n);
        CK(cudaMemcpy(h2.data(), o[2], bytes, cudaMemcpyDeviceToHost));
        long long htouched = 0;
        for (size_t i = 0; i < n; ++i) htouched += h2[i] != 0xFFFF;
        report(same && htouched == 0, "%s GLU %-6s g, u, h = two launches + k_swiglu, bitwise (%lld of %zu differ); without h, h untouched (%lld)",
               c.name.c_str(), variant_name[variant], diff, 3 * n, htouched);
    }
    if (c.timed && !getenv("GG_NOTIME")) {
        const double flops = 2.0 * 2.0 * b.R * M * K;
        for (int r = 0; r < 3; ++r) {
            const float t0 = time_median([&]() { glu(2, true); }, st);
            const float t1 = time_median([&]() { sep(true); }, st);
            const float t2 = time_median([&]() { glu(2, false); }, st);
            const float t3 = time_median([&]() { sep(false); }, st);
            char line[400];
            snprintf(line, sizeof line, "%-9s %-11s round %d: with the SwiGLU: one launch %5.1f, two launches + k_swiglu %5.1f; without: one launch %5.1f, two launches %5.1f TFLOP/s",
                     c.name.c_str(), "gate+up", r, flops / t0 * 1e-9, flops / t1 * 1e-9, flops / t2 * 1e-9, flops / t3 * 1e-9);
            printf("  timing %s\n", line);
            g_table.push_back(line);
        }
    }
    for (int i = 0; i < 6; ++i) CK(cudaFree(o[i]));
    CK(cudaFree(W2));
}

static void run_case(const Case &c, uint64_t seed, std::mt19937 &rng, cudaStream_t st) {
    Bufs b;
    b.E = c.E; b.M = c.M; b.K = c.K;
    b.offs.assign(c.E + 1, 0);
    for (int e = 0; e < c.E; ++e) b.offs[e + 1] = b.offs[e] + c.counts[e];
    b.R = b.offs[c.E];
    b.Rmax = b.R + 37;
    b.rexp.assign(b.R, 0);
    int nempty = 0, cmax = 0, cmin = 1 << 30;
    for (int e = 0; e < c.E; ++e) {
        for (int r = b.offs[e]; r < b.offs[e + 1]; ++r) b.rexp[r] = e;
        nempty += c.counts[e] == 0;
        cmax = std::max(cmax, c.counts[e]);
        cmin = std::min(cmin, c.counts[e]);
    }
    const int E = b.E, M = b.M, K = b.K, Rmax = b.Rmax;
    printf("case %s: E=%d M=%d K=%d R=%d Rmax=%d (empty experts %d, largest %d rows, mean %.1f)\n", c.name.c_str(), E, M, K,
           b.R, Rmax, nempty, cmax, (double)b.R / E);
    CK(cudaMalloc(&b.d_offs, (E + 1) * sizeof(int)));
    CK(cudaMemcpy(b.d_offs, b.offs.data(), (E + 1) * sizeof(int), cudaMemcpyHostToDevice));
    const size_t nX = (size_t)Rmax * K, nW = (size_t)E * M * K, ndY = (size_t)Rmax * M;
    CK(cudaMalloc(&b.X, nX * 2));
    CK(cudaMalloc(&b.W, nW * 2));
    CK(cudaMalloc(&b.dY, ndY * 2));
    CK(cudaMalloc(&b.Y, ndY * 2));
    CK(cudaMalloc(&b.dX, nX * 2));
    CK(cudaMalloc(&b.dW, nW * 4));
    for (int mode = 0; mode < 3; ++mode) b.ws_bytes = std::max(b.ws_bytes, mt_gg_workspace(mode, E, M, K, Rmax));
    CK(cudaMalloc(&b.ws, b.ws_bytes));
    fill_normal(b.X, nX, seed * 3 + 0);
    fill_normal(b.W, nW, seed * 3 + 1);
    fill_normal(b.dY, ndY, seed * 3 + 2);
    CK(cudaDeviceSynchronize());
    b.hX.resize(nX); b.hW.resize(nW); b.hdY.resize(ndY);
    CK(cudaMemcpy(b.hX.data(), b.X, nX * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.hW.data(), b.W, nW * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.hdY.data(), b.dY, ndY * 2, cudaMemcpyDeviceToHost));
    const bool full = (long long)b.R * M * K <= (1ll << 28);

    std::vector<unsigned char> first[3]; /* each mode's output of the first variant, for the cross-variant comparison */
    const int variants[2] = {2, 1};
    for (int variant : variants) {
        if (getenv("GG_ONLY_TIME")) break;   /* timings only (bench builds that give wrong results) */
        const char *vname = variant_name[variant];
        for (int mode = 0; mode < 3; ++mode) {
            void *out; const void *a, *bb; size_t bytes;
            mode_io(b, mode, &out, &a, &bb, &bytes);
            std::vector<unsigned char> h1(bytes), h2(bytes);
            CK(memset_dev(out, 0xFF, bytes));
            CK(memset_dev(b.ws, 0xFF, b.ws_bytes));
            const int rc1 = run_variant(variant, b, mode, b.ws, st);
            CK(cudaStreamSynchronize(st));
            CK(cudaGetLastError());
            CK(cudaMemcpy(h1.data(), out, bytes, cudaMemcpyDeviceToHost));
            CK(memset_dev(out, 0xFF, bytes));
            CK(memset_dev(b.ws, 0x7F, b.ws_bytes));
            const int rc2 = run_variant(variant, b, mode, b.ws, st);
            CK(cudaStreamSynchronize(st));
            CK(cudaGetLastError());
            CK(cudaMemcpy(h2.data(), out, bytes, cudaMemcpyDeviceToHost));
            char msg[300];
            bool ok = rc1 == 0 && rc2 == 0;
            if (ok) ok = check_mode(b, mode, h1.data(), full, rng, msg, sizeof msg);
            else snprintf(msg, sizeof msg, "launch returned %d / %d", rc1, rc2);
            report(ok, "%s %-8s mode %d %-11s %s", c.name.c_str(), vname, mode, mode_name[mode], msg);
            report(rc1 == 0 && memcmp(h1.data(), h2.data(), bytes) == 0, "%s %-8s mode %d bitwise identical rerun", c.name.c_str(),
                   vname, mode);
            if (mode == 2 && variant == 2) {
                /* with the norm partials (GMM_DW_SQ): dW bitwise the same, the partials sum to sum(dW^2) */
                const long long L = mt_ggk::ssq_need(E, M, K);
                float *ssq;
                CK(cudaMalloc(&ssq, (size_t)L * sizeof(float)));
                CK(memset_dev(ssq, 0xFF, (size_t)L * sizeof(float)));
                CK(memset_dev(out, 0xFF, bytes));
                const int rc4 = run_variant(variant, b, mode, b.ws, st, false, ssq, L);
                CK(cudaStreamSynchronize(st));
                std::vector<float> hq((size_t)L);
                CK(cudaMemcpy(h2.data(), out, bytes, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(hq.data(), ssq, (size_t)L * sizeof(float), cudaMemcpyDeviceToHost));
                CK(cudaFree(ssq));
                double sq = 0, ref = 0;
                for (long long i = 0; i < L; ++i) sq += hq[i];
                const float *o = (const float *)h2.data();
                for (size_t i = 0; i < bytes / 4; ++i) ref += (double)o[i] * o[i];
                const double rel = ref > 0 ? fabs(sq - ref) / ref : fabs(sq);
                report(rc4 == 0 && std::isfinite(sq) && rel < 1e-5 && memcmp(h1.data(), h2.data(), bytes) == 0,
                       "%s %-8s mode 2 with norm partials: dW bitwise as without, sum rel %.1e", c.name.c_str(), vname, rel);
            }
            if (variant == 2) first[mode] = h1;
            else printf("  (info) %s %-8s mode %d bitwise equal to tma: %s\n", c.name.c_str(), vname, mode,
                        memcmp(h1.data(), first[mode].data(), bytes) == 0 ? "yes" : "no");
            if (mt_gg_workspace(mode, E, M, K, Rmax) <= 256) {
                /* without a workspace (possible when mode 2 needs no row split) mode 2 assigns its tiles
                   ws=NULL where allowed: must give the same bits */
                CK(memset_dev(out, 0xFF, bytes));
                const int rc3 = run_variant(variant, b, mode, nullptr, st);
                CK(cudaStreamSynchronize(st));
                CK(cudaMemcpy(h2.data(), out, bytes, cudaMemcpyDeviceToHost));
                report(rc3 == 0 && memcmp(h1.data(), h2.data(), bytes) == 0, "%s %-8s mode %d ws=NULL (round robin) identical",
                       c.name.c_str(), vname, mode);
            }
        }
        if (variant == 1 || variant == 2) {
            /* mode 1 with a second pair (GMM_DX2), here (dY, W) twice: against twice the single result */
            const size_t n = (size_t)b.Rmax * K, bytes = n * 2;
            std::vector<uint16_t> hs(n), hp(n), hp2(n);
            CK(memset_dev(b.dX, 0xFF, bytes));
            int rc = run_variant(variant, b, 1, b.ws, st);
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(hs.data(), b.dX, bytes, cudaMemcpyDeviceToHost));
            CK(memset_dev(b.dX, 0xFF, bytes));
            rc |= run_variant(variant, b, 1, b.ws, st, true);
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(hp.data(), b.dX, bytes, cudaMemcpyDeviceToHost));
            CK(memset_dev(b.dX, 0xFF, bytes));
            rc |= run_variant(variant, b, 1, b.ws, st, true);
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(hp2.data(), b.dX, bytes, cudaMemcpyDeviceToHost));
            double num = 0, den = 0;
            long long bad = 0;
            for (size_t i = 0; i < (size_t)b.R * K; ++i) {
                const double r = 2.0 * bf2f(hs[i]), g = bf2f(hp[i]);
                if (!std::isfinite(g)) ++bad;
                num += (g - r) * (g - r); den += r * r;
            }
            for (size_t i = (size_t)b.R * K; i < n; ++i) bad += hp[i] != 0xFFFF;
            const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
            report(rc == 0 && bad == 0 && rel <= 1e-2 && memcmp(hp.data(), hp2.data(), bytes) == 0,
                   "%s %-8s mode 1 two pairs (DX2) vs 2 x one pair: rel=%.2e, bad=%lld, rerun bitwise", c.name.c_str(), vname, rel, bad);
        }
    }

    if (!getenv("GG_ONLY_TIME") || (getenv("GG_GLU") && c.timed)) glu_case(c, b, seed, st);
    if (getenv("GG_GLU")) goto done;           /* GG_GLU=1: only the gate/up checks and timing after the layout's own checks */
    if (c.timed && !getenv("GG_NOTIME")) {   /* GG_NOTIME=1: the checks only (sanitizer runs of the big layouts) */
        const double flops = 2.0 * b.R * M * K;
        for (int mode = 0; mode < 3; ++mode) {
            if (getenv("GG_MODE") && mode != atoi(getenv("GG_MODE"))) continue;   /* GG_MODE=m: that mode only (profiler runs) */
            void *out; const void *a, *bb; size_t bytes;
            mode_io(b, mode, &out, &a, &bb, &bytes);
            if (getenv("GG_LTB") && cmin == cmax) {   /* GG_LTB=1: our kernel once, then only cuBLASLt's batched GEMM (profiler runs) */
                if (run_variant(2, b, mode, b.ws, st) != 0) fatal("launch failed");
                CK(cudaStreamSynchronize(st));
                std::vector<unsigned char> hr(bytes);
                CK(cudaMemcpy(hr.data(), out, bytes, cudaMemcpyDeviceToHost));
                double brel = 0;
                int nalgo = 0;
                const float t_b = lt_batched(b, mode, cmax, out, hr.data(), bytes, st, &brel, &nalgo);
                printf("  timing %s mode %d cuBLASLt strided-batched %.3f ms %.1f TFLOP/s\n", c.name.c_str(), mode, t_b, flops / t_b * 1e-9);
                continue;
            }
            const float t_tma = time_median([&]() { if (run_variant(2, b, mode, b.ws, st) != 0) fatal("launch failed"); }, st);
            {
                const float t_w = time_median([&]() { if (run_variant(2, b, mode, b.ws, st) != 0) fatal("launch failed"); }, st);
                char line[400];
                snprintf(line, sizeof line, "%-9s %-11s %5.1f, %5.1f TFLOP/s", c.name.c_str(), mode_name[mode], flops / t_tma * 1e-9,
                         flops / t_w * 1e-9);
                printf("  timing %s\n", line);
                g_table.push_back(line);
            }
            if (mode == 2 && getenv("GG_SOAK")) {
                /* GG_SOAK=S: dW with the norm partials back to back for about S seconds, the rate of each
                   100 launches: the steady (power-limited) rate, against the median of 10 above */
                const double soak = atof(getenv("GG_SOAK"));
                const long long L = mt_ggk::ssq_need(E, M, K);
                float *ssq;
                CK(cudaMalloc(&ssq, (size_t)L * sizeof(float)));
                cudaEvent_t e0, e1;
                CK(cudaEventCreate(&e0));
                CK(cudaEventCreate(&e1));
                double spent = 0, lo = 1e30, hi = 0;
                std::vector<double> rates;
                while (spent < soak * 1e3) {
                    CK(cudaEventRecord(e0, st));
                    for (int i = 0; i < 100; ++i)
                        if (run_variant(2, b, 2, b.ws, st, false, ssq, L) != 0) fatal("launch failed");
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float ms = 0;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    spent += ms;
                    const double r = 100 * flops / ms * 1e-9;
                    rates.push_back(r);
                    lo = std::min(lo, r); hi = std::max(hi, r);
                }
                CK(cudaEventDestroy(e0));
                CK(cudaEventDestroy(e1));
                CK(cudaFree(ssq));
                char line[400];
                snprintf(line, sizeof line, "%-9s %-11s soaked %.1f s: first 100 launches %5.1f, last 100 %5.1f (min %5.1f, max %5.1f) TFLOP/s",
                         c.name.c_str(), "dW+norm", spent * 1e-3, rates.front(), rates.back(), lo, hi);
                printf("  timing %s\n", line);
                g_table.push_back(line);
            }
            if (mode == 2) {
                /* the other dW kernels, and the default one with the norm partials (GMM_DW_SQ) */
                const long long L = mt_ggk::ssq_need(E, M, K);
                float *ssq;
                CK(cudaMalloc(&ssq, (size_t)L * sizeof(float)));
                /* first the default with and without the partials, alternating (what GMM_DW_SQ adds) */
                float t_ab[3][2];
                for (int r = 0; r < 3; ++r) {
                    t_ab[r][0] = time_median([&]() { if (run_variant(2, b, 2, b.ws, st) != 0) fatal("launch failed"); }, st);
                    t_ab[r][1] = time_median([&]() { if (run_variant(2, b, 2, b.ws, st, false, ssq, L) != 0) fatal("launch failed"); }, st);
                }
                char ab[400];
                snprintf(ab, sizeof ab, "%-9s %-11s without / with the norm partials, alternating: %5.1f / %5.1f, %5.1f / %5.1f, %5.1f / %5.1f TFLOP/s",
                         c.name.c_str(), "dW (+norm)", flops / t_ab[0][0] * 1e-9, flops / t_ab[0][1] * 1e-9, flops / t_ab[1][0] * 1e-9,
                         flops / t_ab[1][1] * 1e-9, flops / t_ab[2][0] * 1e-9, flops / t_ab[2][1] * 1e-9);
                printf("  timing %s\n", ab);
                g_table.push_back(ab);
                const float t_sq = time_median([&]() { if (run_variant(2, b, 2, b.ws, st, false, ssq, L) != 0) fatal("launch failed"); }, st);
                CK(cudaFree(ssq));
                char line[400];
                snprintf(line, sizeof line, "%-9s %-11s max/mean %.1f: with the norm partials %5.1f TFLOP/s", c.name.c_str(), "dW",
                         (double)cmax * E / std::max(b.R, 1), flops / t_sq * 1e-9);
                printf("  timing %s\n", line);
                g_table.push_back(line);
            }
            const float t_wg = time_median([&]() { if (run_variant(1, b, mode, b.ws, st) != 0) fatal("launch failed"); }, st);
            /* keep the grouped result to compare the baseline against (all elements) */
            CK(memset_dev(out, 0xFF, bytes));
            if (run_variant(2, b, mode, b.ws, st) != 0) fatal("launch failed");
            CK(cudaStreamSynchronize(st));
            std::vector<unsigned char> hg(bytes), hc(bytes);
            CK(cudaMemcpy(hg.data(), out, bytes, cudaMemcpyDeviceToHost));
            LtPlan P;
            lt_plan(P, b, mode);
            void *cout;
            CK(cudaMalloc(&cout, bytes));
            CK(memset_dev(cout, 0xFF, bytes));
            const float t_lt = time_median([&]() { lt_run(P, b, cout, st); }, st);
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(hc.data(), cout, bytes, cudaMemcpyDeviceToHost));
            /* full comparison grouped vs cuBLASLt over the written range */
            double num = 0, den = 0;
            const size_t n = mode == 2 ? (size_t)E * M * K : (size_t)b.R * (mode == 0 ? M : K);
            for (size_t i = 0; i < n; ++i) {
                const double g = mode == 2 ? ((const float *)hg.data())[i] : bf2f(((const uint16_t *)hg.data())[i]);
                const double r = mode == 2 ? ((const float *)hc.data())[i] : bf2f(((const uint16_t *)hc.data())[i]);
                num += (g - r) * (g - r);
                den += r * r;
            }
            const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
            char line[400];
            snprintf(line, sizeof line, "%-8s %-11s E=%d M=%d K=%d R=%d: tma %7.3f ms %6.1f | wgmma %7.3f ms %6.1f | cuBLASLt x%zu %7.3f ms %6.1f TFLOP/s",
                     c.name.c_str(), mode_name[mode], E, M, K, b.R, t_tma, flops / t_tma * 1e-9, t_wg, flops / t_wg * 1e-9,
                     P.ex.size(), t_lt, flops / t_lt * 1e-9);
            printf("  timing %s\n", line);
            g_table.push_back(line);
            if (cmin == cmax) {
                /* equal experts: cuBLASLt's own batched GEMM on the same work (the rate cuBLAS gets) */
                double brel = 0;
                int nalgo = 0;
                const float t_b = lt_batched(b, mode, cmax, cout, hg.data(), bytes, st, &brel, &nalgo);
                snprintf(line, sizeof line, "%-8s %-11s cuBLASLt strided-batched (E=%d x %d rows, best of %d algos) %7.3f ms %6.1f TFLOP/s",
                         c.name.c_str(), mode_name[mode], E, cmax, nalgo, t_b, flops / t_b * 1e-9);
                printf("  timing %s\n", line);
                g_table.push_back(line);
                report(std::isfinite(brel) && brel <= (mode == 2 ? 1e-4 : 1e-2), "%s mode %d grouped vs cuBLASLt batched: rel=%.2e",
                       c.name.c_str(), mode, brel);
            }
            if (mode == 1) {
                const float p_tma = time_median([&]() { if (run_variant(2, b, 1, b.ws, st, true) != 0) fatal("launch failed"); }, st);
                const float p_wg = time_median([&]() { if (run_variant(1, b, 1, b.ws, st, true) != 0) fatal("launch failed"); }, st);
                snprintf(line, sizeof line, "%-8s %-11s E=%d M=%d K=%d R=%d: tma %7.3f ms %6.1f | wgmma %7.3f ms %6.1f TFLOP/s",
                         c.name.c_str(), "dX2 (pairs)", E, M, K, b.R, p_tma, 2 * flops / p_tma * 1e-9, p_wg, 2 * flops / p_wg * 1e-9);
                printf("  timing %s\n", line);
                g_table.push_back(line);
            }
            report(std::isfinite(rel) && rel <= (mode == 2 ? 1e-4 : 1e-2), "%s mode %d grouped vs cuBLASLt, all %zu outputs: rel=%.2e",
                   c.name.c_str(), mode, n, rel);
            CK(cudaFree(cout));
            lt_free(P);
        }
    }

done:
    CK(cudaFree(b.d_offs));
    CK(cudaFree(b.X)); CK(cudaFree(b.W)); CK(cudaFree(b.dY));
    CK(cudaFree(b.Y)); CK(cudaFree(b.dX)); CK(cudaFree(b.dW)); CK(cudaFree(b.ws));
}

/* counts summing to R: n_zero experts without rows, heavy experts at the given multiples of the mean,
   the rest lognormal, none a multiple of 128 where avoidable */
static std::vector<int> imbalanced_counts(int E, int R, std::mt19937 &rng, int n_zero, std::vector<double> heavy) {
    std::vector<int> cnt(E, 0);
    std::vector<int> idx(E);
    for (int i = 0; i < E; ++i) idx[i] = i;
    std::shuffle(idx.begin(), idx.end(), rng);
    const double mean = (double)R / E;
    int used = 0, p = 0;
    for (int i = 0; i < n_zero; ++i) cnt[idx[p++]] = 0;
    for (double h : heavy) { cnt[idx[p]] = (int)(h * mean) + 1 + (int)(rng() % 97); used += cnt[idx[p]]; ++p; }
    std::lognormal_distribution<double> ln(0.0, 0.6);
    std::vector<double> w(E, 0.0);
    double ws = 0;
    for (int i = p; i < E; ++i) { w[idx[i]] = ln(rng); ws += w[idx[i]]; }
    const int rest = R - used;
    int acc = 0, last = -1;
    for (int i = p; i < E; ++i) { cnt[idx[i]] = (int)(rest * w[idx[i]] / ws); acc += cnt[idx[i]]; last = idx[i]; }
    if (last >= 0) cnt[last] += rest - acc;
    return cnt;
}

static void test_graph_capture(std::mt19937 &rng) {
    /* capture a launch in a CUDA graph, replay it, compare bitwise with an eager launch */
    const int E = 5, M = 72, K = 40;
    const int counts[5] = {0, 17, 0, 200, 1};
    std::vector<int> offs(E + 1, 0);
    for (int e = 0; e < E; ++e) offs[e + 1] = offs[e] + counts[e];
    const int R = offs[E], Rmax = R + 37;
    int *d_offs; __nv_bfloat16 *X, *W, *dY; void *Y, *ws;
    CK(cudaMalloc(&d_offs, (E + 1) * 4));
    CK(cudaMemcpy(d_offs, offs.data(), (E + 1) * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&X, (size_t)Rmax * K * 2)); CK(cudaMalloc(&W, (size_t)E * M * K * 2)); CK(cudaMalloc(&dY, (size_t)Rmax * M * 2));
    const size_t ybytes = (size_t)E * M * K * 4 > (size_t)Rmax * M * 2 ? (size_t)E * M * K * 4 : (size_t)Rmax * M * 2;
    CK(cudaMalloc(&Y, ybytes));
    size_t wsb = 0;
    for (int m = 0; m < 3; ++m) wsb = std::max(wsb, mt_gg_workspace(m, E, M, K, Rmax));
    CK(cudaMalloc(&ws, wsb));
    fill_normal(X, (size_t)Rmax * K, rng()); fill_normal(W, (size_t)E * M * K, rng()); fill_normal(dY, (size_t)Rmax * M, rng());
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int mode = 0; mode < 3; ++mode) {
        const void *a = mode == 0 ? (const void *)X : (const void *)dY, *b = mode == 2 ? (const void *)X : (const void *)W;
        std::vector<unsigned char> h1(ybytes), h2(ybytes);
        CK(memset_dev(Y, 0xFF, ybytes));
        int rc = mt_gg(mode, Y, a, b, d_offs, E, M, K, Rmax, ws, st);
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(h1.data(), Y, ybytes, cudaMemcpyDeviceToHost));
        CK(memset_dev(Y, 0xFF, ybytes));
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        const int rc2 = mt_gg(mode, Y, a, b, d_offs, E, M, K, Rmax, ws, st);
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(h2.data(), Y, ybytes, cudaMemcpyDeviceToHost));
        size_t ndiff = 0, first = 0;
        for (size_t i = 0; i < ybytes; ++i)
            if (h1[i] != h2[i] && ndiff++ == 0) first = i;
        report(rc == 0 && rc2 == 0 && ndiff == 0, "graph capture + replay, mode %d, identical to eager (rc %d %d, %zu bytes differ, first %zu)",
               mode, rc, rc2, ndiff, first);
        CK(cudaGraphExecDestroy(ge));
        CK(cudaGraphDestroy(g));
    }
    CK(cudaStreamDestroy(st));
    CK(cudaFree(d_offs)); CK(cudaFree(X)); CK(cudaFree(W)); CK(cudaFree(dY)); CK(cudaFree(Y)); CK(cudaFree(ws));
}

static void test_bad_args() {
    void *p;
    int *o;
    CK(cudaMalloc(&p, 1 << 20));
    CK(cudaMalloc(&o, 64));
    CK(memset_dev(o, 0, 64));
    char *c = (char *)p;
    report(mt_gg(0, p, p, p, o, 1, 12, 16, 10, nullptr, 0) == -1, "rejects M %% 8 != 0");
    report(mt_gg(1, p, p, p, o, 1, 16, 20, 10, nullptr, 0) == -1, "rejects K %% 8 != 0");
    report(mt_gg(3, p, p, p, o, 1, 16, 16, 10, nullptr, 0) == -1, "rejects mode 3");
    report(mt_gg(0, p, p, p, o, 0, 16, 16, 10, nullptr, 0) == -1, "rejects E = 0");
    report(mt_gg(0, p, p, p, o, 1025, 16, 16, 10, nullptr, 0) == -1, "rejects E > 1024");
    report(mt_gg(0, p, p, p, o, 1, 16, 16, -1, nullptr, 0) == -1, "rejects Rmax < 0");
    report(mt_gg(0, c + 2, p, p, o, 1, 16, 16, 10, nullptr, 0) == -1, "rejects misaligned out");
    report(mt_gg(0, p, c + 8, p, o, 1, 16, 16, 10, nullptr, 0) == -1, "rejects misaligned a");
    report(mt_gg(0, p, p, nullptr, o, 1, 16, 16, 10, nullptr, 0) == -1, "rejects NULL b");
    report(mt_gg(0, p, p, p, nullptr, 1, 16, 16, 10, nullptr, 0) == -1, "rejects NULL offs");
    CK(cudaFree(p));
    CK(cudaFree(o));
}

int main() {
    int dev = 0;
    CK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("device: %s (sm_%d%d, %d SMs), kernel smem %zu bytes, %d threads/CTA, tile %dx%dx%d, %d stages\n", prop.name, prop.major,
           prop.minor, prop.multiProcessorCount, mt_ggk::SMEM_TMA, mt_ggk::NT_TMA, mt_ggk::BM, mt_ggk::BN, mt_ggk::BK, mt_ggk::ST);
    if (prop.major != 9) {
        printf("this test needs an sm_90 GPU\nGG: 0 passed, 1 failed\n");
        return 1;
    }
    g_nsm = prop.multiProcessorCount;
    if (getenv("GG_NSM")) g_nsm = atoi(getenv("GG_NSM"));   /* CTAs of the persistent kernels (scaling runs) */
    std::mt19937 rng(20240611);
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    std::vector<Case> cases;
    /* mid's experts: dim 2048, moe_inter 1408, 64 experts, 8192 tokens x top-6 routed rows */
    {
        std::vector<int> cnt = imbalanced_counts(64, 49152, rng, 3, {3.0, 4.0, 5.0});
        cases.push_back({"big", 64, 1408, 2048, cnt, true});        /* gate / up projections */
        cases.push_back({"big-down", 64, 2048, 1408, cnt, true});   /* down projection       */
    }
    {
        /* the loads of mid's training steps: the largest expert 3.5 to 7 times the mean */
        std::vector<int> cnt = imbalanced_counts(64, 49152, rng, 2, {6.0, 4.0, 3.0, 2.5});
        cases.push_back({"skew", 64, 1408, 2048, cnt, true});
        cases.push_back({"skew-down", 64, 2048, 1408, cnt, true});
    }
    {
        /* mid's shapes with every expert at the mean (768 rows): also timed against cuBLASLt's batched GEMM */
        std::vector<int> cnt(64, 768);
        cases.push_back({"even", 64, 1408, 2048, cnt, true});
        cases.push_back({"even-down", 64, 2048, 1408, cnt, true});
    }
    if (getenv("GG_EXTRA")) {   /* the same loads with 1536 in place of 1408: no half-wide column tiles */
        std::vector<int> cnt = imbalanced_counts(64, 49152, rng, 3, {3.0, 4.0, 5.0});
        cases.push_back({"w1536", 64, 1536, 2048, cnt, true});
        cases.push_back({"w1536-down", 64, 2048, 1536, cnt, true});
        /* the same work as "even" in half as many experts of twice the rows (as ep = 2 gives each rank) */
        std::vector<int> c32(32, 1536);
        cases.push_back({"even1536", 32, 1408, 2048, c32, true});
        cases.push_back({"even1536-down", 32, 2048, 1408, c32, true});
    }
    if (getenv("GG_LONG")) {   /* long reductions: the same work as "even" in 8 experts of 6144 rows */
        std::vector<int> c8(8, 6144);
        cases.push_back({"long", 8, 1408, 2048, c8, true});
        cases.push_back({"long-down", 8, 2048, 1408, c8, true});
    }
    {
        std::vector<int> cnt(8);
        int s = 0;
        for (int e = 0; e < 7; ++e) { cnt[e] = 6144 - 300 + (int)(rng() % 601); s += cnt[e]; }
        cnt[7] = 49152 - s;
        cases.push_back({"small8", 8, 256, 256, cnt, true});
    }
    cases.push_back({"e1", 1, 64, 128, {300}, false});
    cases.push_back({"e5", 5, 72, 40, {0, 17, 0, 200, 1}, false});
    {
        std::vector<int> cnt(16, 0);
        cnt[3] = 1000;
        cases.push_back({"one-hot", 16, 128, 64, cnt, false});
    }
    cases.push_back({"e1024", 1024, 64, 64, imbalanced_counts(1024, 4000, rng, 300, {20.0, 8.0}), false});
    cases.push_back({"odd", 3, 136, 264, {130, 0, 70}, false});

    uint64_t seed = 1;
    for (const Case &c : cases) {
        if (getenv("GG_SMALL") && c.timed) { ++seed; continue; }   /* the untimed layouts only (sanitizer runs) */
        if (getenv("GG_CASE") && c.name != getenv("GG_CASE")) { ++seed; continue; }   /* GG_CASE=name: that layout only (profiler runs) */
        run_case(c, seed++, rng, st);
    }
    test_graph_capture(rng);
    test_bad_args();
    CK(cudaStreamDestroy(st));
    printf("\n== grouped GEMM timings (%s, %d SMs; median of 10) ==\n", prop.name, prop.multiProcessorCount);
    for (const std::string &l : g_table) printf("%s\n", l.c_str());
    printf("GG: %d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

