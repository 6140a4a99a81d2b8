/* bench/fp8.cu — the FP8 (e4m3) GEMMs of moetrain_kernels.cu section 11 on mid's shapes: every kind
 * (dense forward, dX, dW through cuBLASLt's block-scaled FP8; grouped forward, dX, dW through the
 * experts' kernel) on data with outliers, against a float64 reference, run twice for determinism, and
 * timed next to the bf16 kernels the runtime uses today (mt_cuda_matmul, mt_cuda_gmm's gg_run).
 *
 *   make bench_fp8 && ./bench_fp8
 *
 * Data: X ~ N(0, 1) with every 256th feature column (c % 256 == 5) times 100; dY ~ N(0, 1) with every
 * 1024th token row times 100; W ~ N(0, 0.02).  All bf16.
 * Reference (float64, on the GPU, over sampled output rows, every column of them):
 *   exact  = sum_k a_k b_k of the bf16 operands;
 *   deq    = sum_k â_k b̂_k of the dequantized operands (what the FP8 GEMM should compute);
 *   S      = sum_k |â_k| |b̂_k|;   Q = sum_k |â_k - a_k| |b̂_k| + |a_k| |b̂_k - b_k| (the quantization's own error
 *            of this element, an upper bound of |deq - exact| by the triangle inequality).
 * Checks per kind (all must hold: "ok"):
 *   arith  = max |y - deq| / (2^-8 |deq| + 2^-9 S) <= 1: the GEMM's arithmetic (one bf16 rounding of the output;
 *            inside a 128-block Hopper's FP8 accumulation, which reached 1.01 x 2^-10 S in one element of a
 *            test_gpu run; fp32 across blocks) -- a wrong scale layout fails it by far;
 *   bound  = max |y - exact| / (Q + 2^-8 |deq| + 2^-9 S) <= 1: every element within what the scaling implies;
 *   apri   = max |y - exact| / sum_k |a_k||b_k| <= 2^-3 + 2^-7: the a-priori bound (each e4m3 code within 2^-4 of
 *            its value, relative, in the normal range; products (1 + 2^-4)^2 - 1; plus output rounding);
 *   det    = a second run bitwise equal.
 * Reported, not bounded: nrm = ||y - exact|| / ||exact|| over the samples.  For independent rounding errors this is
 *   sqrt(2) * eps_rms with eps_rms = 2^-4 sqrt(E[1/m^2] / 3) ~ 0.026 for mantissas m in [1, 2): ~0.037,
 *   whatever K (both y and its error grow as sqrt(K)); bf16's ~0.003 beside it.
 * Timing: the GEMM alone (operands quantized beforehand), median of 3 rounds of 10 launches after 3 warm-up
 * launches; TFLOP/s = 2 M N K / t; the bf16 kernel on the same bf16 data and shapes.  The quantizers are
 * timed on their own (GB/s of bf16 read + fp8 written).
 * Environment: FP8_QUICK=1 one timing round of 3 launches; FP8_ONLY=dense|grouped one family; FP8_NO_SIMPLE=1
 * skips the simple grouped kernel's rows; FP8_VARIANT=digits runs only those grouped kernels (e.g. FP8_VARIANT=34).
 * Grouped kernels (mt_cuda_fp8_gmm's variant): 0 k_gmm_wgmma<128>, 2 k_gmm_wgmma<192>, 3 k_gmm_fast<128>,
 * 4 k_gmm_fast<256> (dW too in 128 x 256 tiles; variant 3's dW is 128 x 128), 5 the same with the stores
 * straight from the registers and more stages (direct256), 1 k_gmm_simple.
 * Without FP8_VARIANT each grouped variant runs in a process of its own (this binary again, FP8_CHILD=1): a wgmma
 * kernel whose pipeline stalls traps after ~10 s and leaves its CUDA context unusable; its process then stops with the
 * CUDA error, the other variants still run, and the table says which process stopped.  FP8_NO_ISOLATE=1 runs them all
 * in this process (as FP8_VARIANT does).
 *
 * The grouped kernels on mid's expert shapes, every variant, the short table last (~1 minute on an H200):
 *
 *   make bench_fp8 && FP8_ONLY=grouped ./bench_fp8
 *
 * ends with "==== FP8 grouped GEMMs ..." (variant, mode, layout, FP8 and bf16 TFLOP/s, speedup, max error / bound,
 * deterministic) and "FP8: all checks passed (0 failing rows)".
 */
#define MOETRAIN_IMPLEMENTATION /* mt_errf and friends, for the kernels file */
#include "../moetrain_kernels.cu"
#undef CK

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <math.h>
#include <unistd.h>
#include <sys/wait.h>
#include <vector>
#include <string>
#include <algorithm>
#include <random>

static int g_fail = 0;
static bool g_child = false;   /* FP8_CHILD: one grouped variant for a parent bench, table lines marked "@@ " */
static std::vector<std::string> g_table, g_short;
static void print_short() {   /* the grouped kernels' table: one line per (layout, variant, mode) */
    if (g_child) {
        for (const std::string &l : g_short) printf("@@ %s\n", l.c_str());
        return;
    }
    printf("\n==== FP8 grouped GEMMs, mid's expert shapes: TFLOP/s, max error / bound (<= 1), determinism ====\n");
    printf("%-11s %-5s %-16s %8s %8s %6s %8s %4s %s\n", "variant", "mode", "layout", "FP8", "bf16", "x", "err/bnd", "det", "");
    for (const std::string &l : g_short) printf("%s\n", l.c_str());
}
static void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stdout, fmt, ap);
    va_end(ap);
    if (!g_short.empty()) print_short();
    if (g_child) printf("\n@@fail %d\n", g_fail + 1);
    printf("\nFP8: stopped (failures so far %d)\n", g_fail);
    exit(2);
}
#define CK(x)                                                                                                     \
    do {                                                                                                          \
        cudaError_t e_ = (x);                                                                                     \
        if (e_ != cudaSuccess) fatal("CUDA error %s at %s:%d: %s", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
    } while (0)

static mt_cuda *g_cu;
static void *dmal(size_t n) {
    void *p = nullptr;
    CK(cudaMalloc(&p, n ? n : 16));
    return p;
}

/* ---- data ------------------------------------------------------------------------------------- */
__device__ __forceinline__ float hash_normal(unsigned long long i, unsigned seed) {
    unsigned long long z = (i + 1) * 0x9E3779B97F4A7C15ull ^ ((unsigned long long)seed << 32);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull; z = (z ^ (z >> 27)) * 0x94D049BB133111EBull; z ^= z >> 31;
    const float u1 = ((z >> 40) + 1) * (1.0f / 16777217.0f), u2 = ((z >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
    return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}
/* x [R][C] ~ N(0, sd); outliers: column c % 256 == 5 (ocol) or row r % 1024 == 7 (orow) times 100 */
__global__ void k_fill(bf16 *x, long long R, int C, float sd, unsigned seed, int ocol, int orow) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < R * C; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / C;
        const int c = (int)(i - r * C);
        float v = sd * hash_normal((unsigned long long)i, seed);
        if ((ocol && c % 256 == 5) || (orow && r % 1024 == 7)) v *= 100.f;
        x[i] = __float2bfloat16(v);
    }
}
static bf16 *fill(long long R, int C, float sd, unsigned seed, int ocol, int orow) {
    bf16 *x = (bf16 *)dmal((size_t)R * C * 2);
    k_fill<<<2048, 256>>>(x, R, C, sd, seed, ocol, orow);
    CK(cudaDeviceSynchronize());   /* the context's stream does not wait for the legacy default stream */
    return x;
}

/* ---- dequantization (the reference's view of the FP8 operands), in the bf16 tensors' coordinates -- */
__device__ __forceinline__ float e4m3_val(uint8_t b) {
    const int ex = (b >> 3) & 15, m = b & 7;
    const float s = (b & 0x80) ? -1.f : 1.f;
    if (ex == 15 && m == 7) return __int_as_float(0x7fc00000);
    return ex == 0 ? s * m * 0x1p-9f : s * (1.f + m * 0.125f) * exp2f((float)(ex - 7));
}
__global__ void k_deq_rows(float *out, const uint8_t *q, const float *s, long long R, int C) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < R * C; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / C;
        const int c = (int)(i - r * C);
        out[i] = e4m3_val(q[i]) * s[(size_t)(c / 128) * R + r];
    }
}
/* cols: x's row r of segment e at column P_e + (r - offs[e]) of qt */
__global__ void k_deq_cols(float *out, const uint8_t *qt, const float *st, const int *offs, int E, int C, long long Lp) {
    const int e = blockIdx.y;
    long long pe = 0;
    for (int i = 0; i < e; ++i) pe += 128LL * ((offs[i + 1] - offs[i] + 127) / 128);
    const int b = offs[e], n = offs[e + 1] - b;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)n * C; i += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(i / C), c = (int)(i - (long long)j * C);
        const long long p = pe + j;
        out[(size_t)(b + j) * C + c] = e4m3_val(qt[(size_t)c * Lp + p]) * st[(size_t)(p / 128) * C + c];
    }
}
/* weight [E][N][K] (transposed storage when tr) */
__global__ void k_deq_weight(float *out, const uint8_t *q, const float *s, int E, int N, int K, int tr) {
    const long long tot = (long long)E * N * K;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < tot; i += (long long)gridDim.x * blockDim.x) {
        const long long en = i / K;
        const int k = (int)(i - en * K), e = (int)(en / N), n = (int)(en - (long long)e * N);
        const uint8_t b = tr ? q[((size_t)e * K + k) * N + n] : q[i];
        const float sc = tr ? s[((size_t)e * mt_fp8::kblocks(K) + k / 128) * mt_fp8::ld_blk(N) + n / 128]
                            : s[((size_t)e * mt_fp8::kblocks(N) + n / 128) * mt_fp8::ld_blk(K) + k / 128];
        out[i] = e4m3_val(b) * sc;
    }
}

/* ---- the float64 reference over sampled output rows ------------------------------------------------
   sample i, column j: sum over k < kn[i] of A[ao[i] + k aks] * B[bo[i] + j bjs + k bks] (bf16 and dequantized);
   the FP8 output at yo[i] + j (bf16 or fp32) */
struct RefOut { double exact, deq, sabs, qerr, aabs, y; };
__global__ void k_ref(RefOut *o, int ncols, const long long *ao, const long long *bo, const long long *yo, const int *kn, long long aks,
                      long long bjs, long long bks, const bf16 *A, const float *Ad, const bf16 *B, const float *Bd, const void *Y, int y_f32) {
    const int i = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= ncols) return;
    double ex = 0, dq = 0, sa = 0, qe = 0, aa = 0;
    const long long a0 = ao[i], b0 = bo[i] + (long long)j * bjs;
    for (int k = 0; k < kn[i]; ++k) {
        const double a = __bfloat162float(A[a0 + k * aks]), ad = Ad[a0 + k * aks];
        const double b = __bfloat162float(B[b0 + k * bks]), bd = Bd[b0 + k * bks];
        ex += a * b; dq += ad * bd; sa += fabs(ad * bd); aa += fabs(a * b);
        qe += fabs(ad - a) * fabs(bd) + fabs(a) * fabs(bd - b);
    }
    RefOut r;
    r.exact = ex; r.deq = dq; r.sabs = sa; r.qerr = qe; r.aabs = aa;
    r.y = y_f32 ? (double)((const float *)Y)[yo[i] + j] : (double)__bfloat162float(((const bf16 *)Y)[yo[i] + j]);
    o[(size_t)i * ncols + j] = r;
}

struct Err { double arith = 0, bound = 0, apri = 0, nrm = 0, maxrms = 0; int nonfinite = 0; };
struct Job {   /* what k_ref reads for one kind */
    std::vector<long long> ao, bo, yo;
    std::vector<int> kn;
    long long aks, bjs, bks;
    const bf16 *A, *B;
    const float *Ad, *Bd;
};
static Err reference(const Job &j, int ncols, const void *Y, int y_f32) {
    const int ns = (int)j.ao.size();
    long long *dao = (long long *)dmal(8 * ns), *dbo = (long long *)dmal(8 * ns), *dyo = (long long *)dmal(8 * ns);
    int *dkn = (int *)dmal(4 * ns);
    RefOut *o = (RefOut *)dmal(sizeof(RefOut) * (size_t)ns * ncols);
    CK(cudaMemcpy(dao, j.ao.data(), 8 * ns, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dbo, j.bo.data(), 8 * ns, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dyo, j.yo.data(), 8 * ns, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dkn, j.kn.data(), 4 * ns, cudaMemcpyHostToDevice));
    k_ref<<<dim3((ncols + 127) / 128, ns), 128>>>(o, ncols, dao, dbo, dyo, dkn, j.aks, j.bjs, j.bks, j.A, j.Ad, j.B, j.Bd, Y, y_f32);
    CK(cudaGetLastError());
    std::vector<RefOut> h((size_t)ns * ncols);
    CK(cudaMemcpy(h.data(), o, sizeof(RefOut) * h.size(), cudaMemcpyDeviceToHost));
    Err e;
    double num = 0, den = 0;
    for (const RefOut &r : h) { num += (r.y - r.exact) * (r.y - r.exact); den += r.exact * r.exact; }
    const double rms = sqrt(den / (double)h.size());
    for (const RefOut &r : h) {
        if (!std::isfinite(r.y)) { e.nonfinite++; continue; }
        const double ar = ldexp(fabs(r.deq), -8) + ldexp(r.sabs, -9) + 1e-300;
        e.arith = std::max(e.arith, fabs(r.y - r.deq) / ar);
        e.bound = std::max(e.bound, fabs(r.y - r.exact) / (r.qerr + ar));
        if (r.aabs > 0) e.apri = std::max(e.apri, fabs(r.y - r.exact) / r.aabs);
        if (rms > 0) e.maxrms = std::max(e.maxrms, fabs(r.y - r.exact) / rms);
    }
    e.nrm = den > 0 ? sqrt(num / den) : 0;
    CK(cudaFree(dao)); CK(cudaFree(dbo)); CK(cudaFree(dyo)); CK(cudaFree(dkn)); CK(cudaFree(o));
    return e;
}
/* the bf16 GEMM's own normwise error against the same exact reference (context for nrm) */
static double bf16_nrm(const Job &j, int ncols, const void *Ybf) {
    return reference(j, ncols, Ybf, 0).nrm;
}

/* ---- determinism and timing ---------------------------------------------------------------------- */
__global__ void k_diff(const uint32_t *a, const uint32_t *b, long long n, unsigned long long *cnt) {
    unsigned long long c = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) c += a[i] != b[i];
    if (c) atomicAdd(cnt, c);   /* an integer count: order-independent */
}
/* non-finite outputs among n (bf16, or fp32 when f32): the grouped outputs are poisoned with NaN before each kernel, so
   this counts every element a kernel failed to write, sampled by the reference or not */
__global__ void k_nonfinite(const void *y, long long n, int f32, unsigned long long *cnt) {
    unsigned long long c = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = f32 ? ((const float *)y)[i] : __bfloat162float(((const bf16 *)y)[i]);
        c += !isfinite(v);
    }
    if (c) atomicAdd(cnt, c);
}
static unsigned long long nonfinite(const void *y, size_t n, int f32) {
    unsigned long long *d = (unsigned long long *)dmal(8), h = 0;
    CK(cudaMemset(d, 0, 8));
    k_nonfinite<<<1024, 256>>>(y, (long long)n, f32, d);
    CK(cudaMemcpy(&h, d, 8, cudaMemcpyDeviceToHost));
    CK(cudaFree(d));
    return h;
}
static unsigned long long ndiff(const void *a, const void *b, size_t bytes) {
    unsigned long long *d = (unsigned long long *)dmal(8), h = 0;
    CK(cudaMemset(d, 0, 8));
    k_diff<<<1024, 256>>>((const uint32_t *)a, (const uint32_t *)b, (long long)(bytes / 4), d);
    CK(cudaMemcpy(&h, d, 8, cudaMemcpyDeviceToHost));
    CK(cudaFree(d));
    return h;
}
static bool g_quick = false, g_skip_simple = false;
static std::string g_variants;   /* FP8_VARIANT: only these grouped kernels (digits, e.g. "34"); empty: all */
template <class F>
static double time_ms(F f) {   /* median of rounds of launches, per launch */
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    const int warm = g_quick ? 1 : 3, rounds = g_quick ? 1 : 3, n = g_quick ? 3 : 10;
    for (int i = 0; i < warm; ++i) f();
    CK(cudaStreamSynchronize(g_cu->stream));
    std::vector<double> t;
    for (int r = 0; r < rounds; ++r) {
        CK(cudaEventRecord(a, g_cu->stream));
        for (int i = 0; i < n; ++i) f();
        CK(cudaEventRecord(b, g_cu->stream));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms / n);
    }
    std::sort(t.begin(), t.end());
    CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
    return t[t.size() / 2];
}

static bool row(const char *kind, const char *shape, double flops, double t8, double t16, const Err &e, double n16, unsigned long long nd) {
    const double apri_max = 0.125 + 1.0 / 128;
    const bool ok = e.nonfinite == 0 && e.arith <= 1 && e.bound <= 1 && e.apri <= apri_max && nd == 0;
    if (!ok) g_fail++;
    char line[400];
    snprintf(line, sizeof line, "%-30s %-22s %7.1f %7.1f %5.2fx | nrm %.4f (bf16 %.4f) max/rms %6.3f | arith %5.3f bound %5.3f apri %5.3f | %s %s",
             kind, shape, t8 > 0 ? flops / t8 * 1e-9 : 0.0, t16 > 0 ? flops / t16 * 1e-9 : 0.0, t8 > 0 && t16 > 0 ? t16 / t8 : 0.0, e.nrm, n16,
             e.maxrms, e.arith, e.bound, e.apri, nd ? "DIFFERS" : "det", ok ? "ok" : e.nonfinite ? "FAIL (non-finite or unwritten outputs)" : "FAIL");
    printf("%s\n", line);
    fflush(stdout);
    g_table.push_back(line);
    return ok;
}

/* ---- dense: Y = X W^T, dX = dY W, dW = dY^T X, T tokens ------------------------------------------------ */
static void dense_case(const char *name, int T, int N, int K) {
    const long long Lp = mt_fp8::tpad(T, 1);
    const int Kp = (int)(mt_fp8::kblocks(T) * 128); /* dW's reduction: tokens padded to 128 (the padding is zeros) */
    bf16 *X = fill(T, K, 1.f, 11, 1, 0), *dY = fill(T, N, 1.f, 12, 0, 1), *W = fill(N, K, 0.02f, 13, 0, 0);
    uint8_t *qx = (uint8_t *)dmal((size_t)T * K), *qy = (uint8_t *)dmal((size_t)T * N), *qw = (uint8_t *)dmal((size_t)N * K),
            *qwt = (uint8_t *)dmal((size_t)N * K), *qyt = (uint8_t *)dmal((size_t)N * Lp), *qxt = (uint8_t *)dmal((size_t)K * Lp);
    float *sx = (float *)dmal(4 * (size_t)T * mt_fp8::kblocks(K)), *sy = (float *)dmal(4 * (size_t)T * mt_fp8::kblocks(N));
    float *sw = (float *)dmal(4 * (size_t)mt_fp8::kblocks(N) * mt_fp8::ld_blk(K)), *swt = (float *)dmal(4 * (size_t)mt_fp8::kblocks(K) * mt_fp8::ld_blk(N));
    float *syt = (float *)dmal(4 * (size_t)(Lp / 128) * N), *sxt = (float *)dmal(4 * (size_t)(Lp / 128) * K);
    if (mt_cuda_fp8_quant_rows(g_cu, qx, sx, X, T, K) || mt_cuda_fp8_quant_rows(g_cu, qy, sy, dY, T, N) ||
        mt_cuda_fp8_quant_weight(g_cu, qw, sw, W, 1, N, K, 0) || mt_cuda_fp8_quant_weight(g_cu, qwt, swt, W, 1, N, K, 1) ||
        mt_cuda_fp8_quant_cols(g_cu, qyt, syt, dY, nullptr, 1, T, N, Lp) || mt_cuda_fp8_quant_cols(g_cu, qxt, sxt, X, nullptr, 1, T, K, Lp))
        fatal("quantizing %s: %s", name, mt_cuda_error(g_cu));
    /* dequantized operands; W^T's must be W's exactly (the same blocks, the same scales) */
    float *Xd = (float *)dmal(4 * (size_t)T * K), *dYd = (float *)dmal(4 * (size_t)T * N), *Wd = (float *)dmal(4 * (size_t)N * K),
          *Wtd = (float *)dmal(4 * (size_t)N * K), *dYtd = (float *)dmal(4 * (size_t)T * N), *Xtd = (float *)dmal(4 * (size_t)T * K);
    int *d1 = (int *)dmal(8);
    const int h1[2] = {0, T};
    CK(cudaMemcpy(d1, h1, 8, cudaMemcpyHostToDevice));
    k_deq_rows<<<2048, 256, 0, g_cu->stream>>>(Xd, qx, sx, T, K);
    k_deq_rows<<<2048, 256, 0, g_cu->stream>>>(dYd, qy, sy, T, N);
    k_deq_weight<<<2048, 256, 0, g_cu->stream>>>(Wd, qw, sw, 1, N, K, 0);
    k_deq_weight<<<2048, 256, 0, g_cu->stream>>>(Wtd, qwt, swt, 1, N, K, 1);
    k_deq_cols<<<dim3(1024, 1), 256, 0, g_cu->stream>>>(dYtd, qyt, syt, d1, 1, N, Lp);
    k_deq_cols<<<dim3(1024, 1), 256, 0, g_cu->stream>>>(Xtd, qxt, sxt, d1, 1, K, Lp);
    CK(cudaStreamSynchronize(g_cu->stream));
    if (ndiff(Wd, Wtd, 4 * (size_t)N * K)) { printf("%s: W^T's codes and scales differ from W's\n", name); g_fail++; }

    void *Y[2], *GX[2], *GW[2];
    for (int r = 0; r < 2; ++r) { Y[r] = dmal(2 * (size_t)T * N); GX[r] = dmal(2 * (size_t)T * K); GW[r] = dmal(4 * (size_t)N * K); }
    void *Yb = dmal(2 * (size_t)T * N), *GXb = dmal(2 * (size_t)T * K), *GWb = dmal(4 * (size_t)N * K);
    mt_fp8::Dense pf, px, pw;
    const size_t wsb = g_cu->lt_ws_bytes;
    const bool okf = !pf.plan(g_cu->lt, 0, 1, T, N, K, K, K, sx, sw, wsb), okx = !px.plan(g_cu->lt, 0, 1, T, K, N, N, N, sy, swt, wsb),
               okw = !pw.plan(g_cu->lt, 1, 0, N, K, Kp, (int)Lp, (int)Lp, syt, sxt, wsb);
    auto run_f = [&](void *y) { if (pf.run(g_cu->lt, y, qx, sx, qw, sw, g_cu->lt_ws, wsb, g_cu->stream)) fatal("%s", pf.why); };
    auto run_x = [&](void *y) { if (px.run(g_cu->lt, y, qy, sy, qwt, swt, g_cu->lt_ws, wsb, g_cu->stream)) fatal("%s", px.why); };
    auto run_w = [&](void *y) { if (pw.run(g_cu->lt, y, qyt, syt, qxt, sxt, g_cu->lt_ws, wsb, g_cu->stream)) fatal("%s", pw.why); };
    auto bf_f = [&]() { if (mt_cuda_matmul(g_cu, Yb, MT_BF16, X, MT_BF16, W, MT_BF16, T, N, K, 0, 1, nullptr, nullptr)) fatal("%s", mt_cuda_error(g_cu)); };
    auto bf_x = [&]() { if (mt_cuda_matmul(g_cu, GXb, MT_BF16, dY, MT_BF16, W, MT_BF16, T, K, N, 0, 0, nullptr, nullptr)) fatal("%s", mt_cuda_error(g_cu)); };
    auto bf_w = [&]() { if (mt_cuda_matmul(g_cu, GWb, MT_F32, dY, MT_BF16, X, MT_BF16, N, K, T, 1, 0, nullptr, nullptr)) fatal("%s", mt_cuda_error(g_cu)); };

    /* samples: 16 output rows spread over the range, a quarter of them dY's outlier rows (r % 1024 == 7) */
    auto rows = [](int n) {
        std::vector<int> v;
        for (int i = 0; i < 16; ++i) {
            const int r = (int)(((long long)n * i) / 16);
            v.push_back(i % 4 == 1 ? std::min(n - 1, r / 1024 * 1024 + 7) : r);
        }
        return v;
    };
    char shape[64];
    const double fl = 2.0 * T * N * K;
    if (okf) {
        run_f(Y[0]); run_f(Y[1]); bf_f();
        Job j; j.aks = 1; j.bjs = K; j.bks = 1; j.A = X; j.Ad = Xd; j.B = W; j.Bd = Wd;
        for (int t : rows(T)) { j.ao.push_back((long long)t * K); j.bo.push_back(0); j.yo.push_back((long long)t * N); j.kn.push_back(K); }
        CK(cudaStreamSynchronize(g_cu->stream));
        const Err e = reference(j, N, Y[0], 0);
        const double n16 = bf16_nrm(j, N, Yb);
        snprintf(shape, sizeof shape, "%dx%dx%d", T, N, K);
        row((std::string(name) + " fwd").c_str(), shape, fl, time_ms([&] { run_f(Y[0]); }), time_ms(bf_f), e, n16, ndiff(Y[0], Y[1], 2 * (size_t)T * N));
    } else { printf("%s fwd: %s\n", name, pf.why); g_fail++; }
    if (okx) {
        run_x(GX[0]); run_x(GX[1]); bf_x();
        Job j; j.aks = 1; j.bjs = 1; j.bks = K; j.A = dY; j.Ad = dYd; j.B = W; j.Bd = Wd;
        for (int t : rows(T)) { j.ao.push_back((long long)t * N); j.bo.push_back(0); j.yo.push_back((long long)t * K); j.kn.push_back(N); }
        CK(cudaStreamSynchronize(g_cu->stream));
        const Err e = reference(j, K, GX[0], 0);
        const double n16 = bf16_nrm(j, K, GXb);
        snprintf(shape, sizeof shape, "%dx%dx%d", T, K, N);
        row((std::string(name) + " dX").c_str(), shape, fl, time_ms([&] { run_x(GX[0]); }), time_ms(bf_x), e, n16, ndiff(GX[0], GX[1], 2 * (size_t)T * K));
    } else { printf("%s dX: %s\n", name, px.why); g_fail++; }
    if (okw) {
        run_w(GW[0]); run_w(GW[1]); bf_w();
        Job j; j.aks = N; j.bjs = 1; j.bks = K; j.A = dY; j.Ad = dYtd; j.B = X; j.Bd = Xtd;
        for (int n : rows(N)) { j.ao.push_back(n); j.bo.push_back(0); j.yo.push_back((long long)n * K); j.kn.push_back(T); }
        CK(cudaStreamSynchronize(g_cu->stream));
        const Err e = reference(j, K, GW[0], 1);
        /* the bf16 dW is fp32 too: its error through the same path */
        const double n16 = reference(j, K, GWb, 1).nrm;
        snprintf(shape, sizeof shape, "%dx%dx%d", N, K, T);
        row((std::string(name) + " dW").c_str(), shape, fl, time_ms([&] { run_w(GW[0]); }), time_ms(bf_w), e, n16, ndiff(GW[0], GW[1], 4 * (size_t)N * K));
    } else { printf("%s dW: %s\n", name, pw.why); g_fail++; }

    void *fr[] = {X, dY, W, qx, qy, qw, qwt, qyt, qxt, sx, sy, sw, swt, syt, sxt, Xd, dYd, Wd, Wtd, dYtd, Xtd, d1, Y[0], Y[1], GX[0], GX[1], GW[0], GW[1], Yb, GXb, GWb};
    for (void *p : fr) CK(cudaFree(p));
}

/* ---- grouped: the experts, W [E][M][K], rows grouped by offs on the device ---------------------------- */
static std::vector<int> counts_skew(int E, int R, unsigned seed, double top) {
    /* one expert at `top` times the mean, the rest lognormal (sigma 0.6), summing to R */
    std::mt19937 rng(seed);
    std::lognormal_distribution<double> ln(0.0, 0.6);
    std::vector<int> c(E, 0);
    const double mean = (double)R / E;
    c[E / 3] = (int)(top * mean);
    std::vector<double> w(E, 0);
    double ws = 0;
    for (int e = 0; e < E; ++e) if (e != E / 3) { w[e] = ln(rng); ws += w[e]; }
    int used = c[E / 3], last = 0;
    for (int e = 0; e < E; ++e) if (e != E / 3) { c[e] = (int)((R - c[E / 3]) * w[e] / ws); used += c[e]; last = e; }
    c[last] += R - used;
    return c;
}
static void grouped_case(const char *name, int E, int M, int K, const std::vector<int> &cnt) {
    std::vector<int> offs(E + 1, 0);
    for (int e = 0; e < E; ++e) offs[e + 1] = offs[e] + cnt[e];
    const int R = offs[E], Rmax = R;
    const long long Lp = mt_fp8::tpad(Rmax, E);
    int *doffs = (int *)dmal(4 * (size_t)(E + 1));
    CK(cudaMemcpy(doffs, offs.data(), 4 * (size_t)(E + 1), cudaMemcpyHostToDevice));
    bf16 *X = fill(Rmax, K, 1.f, 21, 1, 0), *dY = fill(Rmax, M, 1.f, 22, 0, 1), *W = fill((long long)E * M, K, 0.02f, 23, 0, 0);
    uint8_t *qx = (uint8_t *)dmal((size_t)Rmax * K), *qy = (uint8_t *)dmal((size_t)Rmax * M), *qw = (uint8_t *)dmal((size_t)E * M * K),
            *qwt = (uint8_t *)dmal((size_t)E * M * K), *qyt = (uint8_t *)dmal((size_t)M * Lp), *qxt = (uint8_t *)dmal((size_t)K * Lp);
    float *sx = (float *)dmal(4 * (size_t)Rmax * mt_fp8::kblocks(K)), *sy = (float *)dmal(4 * (size_t)Rmax * mt_fp8::kblocks(M));
    float *sw = (float *)dmal(4 * (size_t)E * mt_fp8::kblocks(M) * mt_fp8::ld_blk(K)), *swt = (float *)dmal(4 * (size_t)E * mt_fp8::kblocks(K) * mt_fp8::ld_blk(M));
    float *syt = (float *)dmal(4 * (size_t)(Lp / 128) * M), *sxt = (float *)dmal(4 * (size_t)(Lp / 128) * K);
    /* the quantizers, timed here on mid's grouped operands */
    auto q_rows = [&]() { if (mt_cuda_fp8_quant_rows(g_cu, qx, sx, X, Rmax, K)) fatal("%s", mt_cuda_error(g_cu)); };
    auto q_cols = [&]() { if (mt_cuda_fp8_quant_cols(g_cu, qxt, sxt, X, doffs, E, Rmax, K, Lp)) fatal("%s", mt_cuda_error(g_cu)); };
    auto q_w = [&]() { if (mt_cuda_fp8_quant_weight(g_cu, qw, sw, W, E, M, K, 0)) fatal("%s", mt_cuda_error(g_cu)); };
    auto q_wt = [&]() { if (mt_cuda_fp8_quant_weight(g_cu, qwt, swt, W, E, M, K, 1)) fatal("%s", mt_cuda_error(g_cu)); };
    auto q_both = [&]() {   /* both forms from one read (into the rows' and columns' buffers, rewritten below) */
        if (mt_cuda_fp8_quant_both(g_cu, qx, sx, Rmax, qxt, sxt, X, doffs, E, Rmax, K, Lp)) fatal("%s", mt_cuda_error(g_cu));
    };
    q_both(); q_rows(); q_cols(); q_w(); q_wt();
    if (mt_cuda_fp8_quant_rows(g_cu, qy, sy, dY, Rmax, M) || mt_cuda_fp8_quant_cols(g_cu, qyt, syt, dY, doffs, E, Rmax, M, Lp))
        fatal("%s", mt_cuda_error(g_cu));
    if (!g_child || g_variants.find('0') != std::string::npos) {   /* (once, not in every variant's process) */
        const double bx = 3.0 * Rmax * K, bw = 3.0 * E * M * K;
        char line[300];
        snprintf(line, sizeof line, "%-18s quantize X %dx%d: rows %.0f GB/s, cols %.0f GB/s, both %.0f GB/s; W %dx%dx%d: %.0f GB/s, transposed %.0f GB/s",
                 name, Rmax, K, bx / time_ms(q_rows) * 1e-6, bx / time_ms(q_cols) * 1e-6, 4.0 * Rmax * K / time_ms(q_both) * 1e-6, E, M, K,
                 bw / time_ms(q_w) * 1e-6, bw / time_ms(q_wt) * 1e-6);
        printf("%s\n", line);
        g_table.push_back(line);
    }
    float *Xd = (float *)dmal(4 * (size_t)Rmax * K), *dYd = (float *)dmal(4 * (size_t)Rmax * M), *Wd = (float *)dmal(4 * (size_t)E * M * K),
          *Wtd = (float *)dmal(4 * (size_t)E * M * K), *dYtd = (float *)dmal(4 * (size_t)Rmax * M), *Xtd = (float *)dmal(4 * (size_t)Rmax * K);
    k_deq_rows<<<2048, 256, 0, g_cu->stream>>>(Xd, qx, sx, Rmax, K);
    k_deq_rows<<<2048, 256, 0, g_cu->stream>>>(dYd, qy, sy, Rmax, M);
    k_deq_weight<<<2048, 256, 0, g_cu->stream>>>(Wd, qw, sw, E, M, K, 0);
    k_deq_weight<<<2048, 256, 0, g_cu->stream>>>(Wtd, qwt, swt, E, M, K, 1);
    k_deq_cols<<<dim3(64, E), 256, 0, g_cu->stream>>>(dYtd, qyt, syt, doffs, E, M, Lp);
    k_deq_cols<<<dim3(64, E), 256, 0, g_cu->stream>>>(Xtd, qxt, sxt, doffs, E, K, Lp);
    CK(cudaStreamSynchronize(g_cu->stream));
    if (ndiff(Wd, Wtd, 4 * (size_t)E * M * K)) { printf("%s: W^T's codes and scales differ from W's\n", name); g_fail++; }

    void *Y[2], *GX[2], *GW[2];
    for (int r = 0; r < 2; ++r) { Y[r] = dmal(2 * (size_t)Rmax * M); GX[r] = dmal(2 * (size_t)Rmax * K); GW[r] = dmal(4 * (size_t)E * M * K); }
    void *Yb = dmal(2 * (size_t)Rmax * M), *GXb = dmal(2 * (size_t)Rmax * K), *GWb = dmal(4 * (size_t)E * M * K);
    size_t wsn = 0;
    for (int m = 0; m < 3; ++m) wsn = std::max(wsn, mt_ggk::gg_workspace(m, E, M, K, Rmax, g_cu->n_sms));
    void *ws = dmal(wsn + 256);
    int variant = 0;
    auto g8 = [&](int mode, void *o) {
        const int rc = mode == 0 ? mt_cuda_fp8_gmm(g_cu, 0, o, qx, sx, qw, sw, doffs, E, M, K, Rmax, Lp, variant)
                     : mode == 1 ? mt_cuda_fp8_gmm(g_cu, 1, o, qy, sy, qwt, swt, doffs, E, M, K, Rmax, Lp, variant)
                                 : mt_cuda_fp8_gmm(g_cu, 2, o, qyt, syt, qxt, sxt, doffs, E, M, K, Rmax, Lp, variant);
        if (rc) fatal("%s", mt_cuda_error(g_cu));
    };
    auto g16 = [&](int mode, void *o) {
        const void *a = mode == 0 ? (const void *)X : (const void *)dY, *b = mode == 2 ? (const void *)X : (const void *)W;
        if (mt_ggk::gg_run(2, mode, o, a, b, doffs, E, M, K, Rmax, ws, g_cu->stream, nullptr, nullptr, nullptr, 0, g_cu->n_sms))
            fatal("bf16 grouped GEMM mode %d failed", mode);
    };
    /* samples: modes 0/1 two rows of each of 8 experts (the heavy one included) and an outlier row of dY where the
       expert has one; mode 2 two (expert, m) pairs per expert */
    std::vector<int> se;
    for (int i = 0; i < 8; ++i) se.push_back((E * i) / 8 + (i == 2 ? E / 3 - (E * 2) / 8 : 0));
    const double fl = 2.0 * R * M * K;
    char shape[64];
    snprintf(shape, sizeof shape, "E%d %dx%d R%d", E, M, K, R);
    /* k_gmm_wgmma<128>, <192>, k_gmm_fast<128>, <256> (dW: <128>), <256> with direct stores, k_gmm_simple */
    static const int vorder[6] = {0, 2, 3, 4, 5, 1};
    static const char *vname[6] = {"wgmma128", "simple", "wgmma192", "fast128", "fast256", "direct256"};
    static const char *mname[3] = {"fwd", "dX", "dW"};
    double t16[3] = {0, 0, 0}, n16s[3] = {0, 0, 0};   /* the bf16 kernel's time and error per mode (once) */
    for (int mm = 0; mm < 18; ++mm) {
        const int mode = mm % 3;
        variant = vorder[mm / 3];
        if (variant == 1 && g_skip_simple) continue;
        if (!g_variants.empty() && g_variants.find((char)('0' + variant)) == std::string::npos) continue;
        void *o0 = mode == 0 ? Y[0] : mode == 1 ? GX[0] : GW[0], *o1 = mode == 0 ? Y[1] : mode == 1 ? GX[1] : GW[1];
        void *ob = mode == 0 ? Yb : mode == 1 ? GXb : GWb;
        const size_t bytes = mode == 0 ? 2 * (size_t)Rmax * M : mode == 1 ? 2 * (size_t)Rmax * K : 4 * (size_t)E * M * K;
        CK(cudaMemsetAsync(o0, 0xff, bytes, g_cu->stream));   /* NaN: what a kernel leaves unwritten fails the checks */
        CK(cudaMemsetAsync(o1, 0xff, bytes, g_cu->stream));
        g8(mode, o0); g8(mode, o1);
        if (t16[mode] == 0) g16(mode, ob);
        CK(cudaStreamSynchronize(g_cu->stream));
        Job j;
        int ncols;
        if (mode == 0) { j.aks = 1; j.bjs = K; j.bks = 1; j.A = X; j.Ad = Xd; j.B = W; j.Bd = Wd; ncols = M; }
        else if (mode == 1) { j.aks = 1; j.bjs = 1; j.bks = K; j.A = dY; j.Ad = dYd; j.B = W; j.Bd = Wd; ncols = K; }
        else { j.aks = M; j.bjs = 1; j.bks = K; j.A = dY; j.Ad = dYtd; j.B = X; j.Bd = Xtd; ncols = K; }
        for (int e : se) {
            const int n = offs[e + 1] - offs[e];
            if (n == 0) continue;
            int r7 = -1; /* an outlier row of dY in this expert, if any */
            for (int r = offs[e]; r < offs[e + 1] && r7 < 0; ++r) if (r % 1024 == 7) r7 = r;
            for (int u = 0; u < 3; ++u) {
                if (u == 2 && (mode == 2 || r7 < 0)) continue;
                if (mode != 2) {
                    const int r = u == 2 ? r7 : offs[e] + (u ? n - 1 : n / 3);
                    j.ao.push_back((long long)r * (mode == 0 ? K : M));
                    j.bo.push_back((long long)e * M * K);
                    j.yo.push_back((long long)r * ncols);
                    j.kn.push_back(mode == 0 ? K : M);
                } else {
                    const int m = u ? M - 1 : (M / 3 + 5);
                    j.ao.push_back((long long)offs[e] * M + m);
                    j.bo.push_back((long long)offs[e] * K);
                    j.yo.push_back(((long long)e * M + m) * K);
                    j.kn.push_back(n);
                }
            }
        }
        Err e = reference(j, ncols, o0, mode == 2);
        e.nonfinite += (int)std::min(nonfinite(o0, bytes / (mode == 2 ? 4 : 2), mode == 2), (unsigned long long)INT_MAX / 2);
        if (t16[mode] == 0) {
            n16s[mode] = reference(j, ncols, ob, mode == 2).nrm;
            t16[mode] = time_ms([&] { g16(mode, ob); });
        }
        const unsigned long long nd = ndiff(o0, o1, bytes);
        const double t8 = time_ms([&] { g8(mode, o0); });
        const bool ok = row((std::string(name) + " " + mname[mode] + " " + vname[variant]).c_str(), shape, fl, t8, t16[mode], e, n16s[mode], nd);
        char sl[200];
        snprintf(sl, sizeof sl, "%d %-9s %-5s %-16s %8.1f %8.1f %5.2fx %8.3f %4s %s", variant, vname[variant], mname[mode], name + 8, fl / t8 * 1e-9,
                 fl / t16[mode] * 1e-9, t16[mode] / t8, std::max(e.arith, e.bound), nd ? "NO" : "yes", ok ? "ok" : "FAIL");
        g_short.push_back(sl);
    }
    void *fr[] = {doffs, X, dY, W, qx, qy, qw, qwt, qyt, qxt, sx, sy, sw, swt, syt, sxt, Xd, dYd, Wd, Wtd, dYtd, Xtd, Y[0], Y[1], GX[0], GX[1], GW[0], GW[1], Yb, GXb, GWb, ws};
    for (void *p : fr) CK(cudaFree(p));
}

/* every grouped variant in a process of its own (this binary again, FP8_CHILD=1 FP8_VARIANT=v): a kernel that traps
   (a stalled pipeline) leaves its CUDA context unusable, and would otherwise take the other variants' rows with it */
static void run_children() {
    char self[1024];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) fatal("readlink /proc/self/exe failed");
    self[n] = 0;
    static const int vo[6] = {0, 2, 3, 4, 5, 1};
    for (int v : vo) {
        if (v == 1 && g_skip_simple) continue;
        char cmd[1400], buf[2048];
        snprintf(cmd, sizeof cmd, "FP8_CHILD=1 FP8_ONLY=grouped FP8_VARIANT=%d %s'%s' 2>&1", v, g_quick ? "FP8_QUICK=1 " : "", self);
        fflush(stdout);
        FILE *f = popen(cmd, "r");
        if (!f) { printf("variant %d: could not start %s\n", v, self); g_fail++; continue; }
        int cf = -1;
        while (fgets(buf, sizeof buf, f)) {
            if (!strncmp(buf, "@@fail ", 7)) { cf = atoi(buf + 7); continue; }
            if (!strncmp(buf, "@@ ", 3)) { buf[strcspn(buf, "\n")] = 0; g_short.push_back(buf + 3); continue; }
            fputs(buf, stdout);
            fflush(stdout);
        }
        const int st = pclose(f);
        if (cf > 0) g_fail += cf;
        if (st != 0) {
            if (cf <= 0) g_fail++;
            char l[160];
            if (WIFEXITED(st)) snprintf(l, sizeof l, "%d (variant %d's process exited with code %d: the lines above say where)", v, v, WEXITSTATUS(st));
            else snprintf(l, sizeof l, "%d (variant %d's process ended by signal %d: the lines above say where)", v, v, WTERMSIG(st));
            g_short.push_back(l);
        }
    }
}

int main() {
    mt_err err;
    char info[512];
    g_child = getenv("FP8_CHILD") != nullptr;
    mt_cuda_describe(info, sizeof info);
    if (!g_child) printf("%s\n", info);
    g_quick = getenv("FP8_QUICK") != nullptr;
    g_skip_simple = getenv("FP8_NO_SIMPLE") != nullptr;
    if (getenv("FP8_VARIANT")) g_variants = getenv("FP8_VARIANT");
    const char *only = getenv("FP8_ONLY");
    const bool dense = !only || !strcmp(only, "dense"), grouped = !only || !strcmp(only, "grouped");
    const bool isolate = grouped && !g_child && g_variants.empty() && !getenv("FP8_NO_ISOLATE");
    /* the parent of isolated variants holds no CUDA context while they run (a GPU in exclusive-process mode
       would refuse them one) */
    if ((dense || !isolate) && mt_cuda_create(&g_cu, 0, &err)) fatal("no GPU: %s", err.msg);
    if (!g_child) printf("columns: kind, shape (out rows x out cols x reduction), FP8 TFLOP/s, bf16 TFLOP/s, speedup | normwise error vs the\n"
           "bf16 operands' float64 product (bf16 GEMM's beside it), max error / rms | arith, bound <= 1, apri <= %.3f | determinism\n",
           0.125 + 1.0 / 128);
    const int T = 8192; /* mid: batch 2 x seq 4096 */
    if (dense) {
        printf("-- dense (cuBLASLt block-scaled FP8: X, dY 1x128, W 128x128; dW: dY^T, X^T 1x128 along tokens) --\n");
        dense_case("attn wq", T, 3072, 2048);
        dense_case("attn wo", T, 2048, 2048);
        dense_case("ffn up", T, 10944, 2048);
        dense_case("ffn down", T, 2048, 10944);
        dense_case("shared up", T, 2816, 2048);
        dense_case("shared down", T, 2048, 2816);
        dense_case("head", T, 102400, 2048);
    }
    if (isolate) {
        if (g_cu) { mt_cuda_destroy(g_cu); g_cu = nullptr; CK(cudaDeviceReset()); }
        printf("-- grouped (experts; mt_cuda_fp8_gmm's variants 0 wgmma128, 2 wgmma192, 3 fast128, 4 fast256, 5 direct256, 1 simple; "
               "each in a process of its own) --\n");
        run_children();
    } else if (grouped) {
        if (!g_child) printf("-- grouped (experts) --\n");
        const std::vector<int> even(64, 768), skew = counts_skew(64, 49152, 7, 5.0);
        grouped_case("experts even", 64, 1408, 2048, even);
        grouped_case("experts even dn", 64, 2048, 1408, even);
        grouped_case("experts skew", 64, 1408, 2048, skew);
        grouped_case("experts skew dn", 64, 2048, 1408, skew);
    }
    if (g_child) {
        print_short();
        printf("@@fail %d\n", g_fail);
        if (g_cu) mt_cuda_destroy(g_cu);
        return g_fail ? 1 : 0;
    }
    printf("\n==== FP8 summary (H200 expected: see docs/FP8.md) ====\n");
    for (const std::string &s : g_table) printf("%s\n", s.c_str());
    if (!g_short.empty()) print_short();
    printf("FP8: %s (%d failing rows)\n", g_fail ? "FAIL" : "all checks passed", g_fail);
    if (g_cu) mt_cuda_destroy(g_cu);
    return g_fail ? 1 : 0;
}
