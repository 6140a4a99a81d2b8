/* bench/attention.cu — the attention kernels of moetrain_kernels.cu on their own: correctness
 * against a float64 CPU reference over many shapes (outputs poisoned, NaN never passes), bitwise
 * determinism, and timing (TFLOP/s, counting the causal half) per kernel; plain causal and with
 * document masking (packed documents, block-causal; FLOPs counted over the unmasked part).
 *
 *   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I. -o /tmp/attn bench/attention.cu \
 *        -lcublasLt -lnccl && /tmp/attn          (FOLD_ONLY=1: only the folded-against-unfolded timings;
 *   ONLY_SHAPE=B,T,H,dq,dv[,doc]: only that shape's tests, e.g. under compute-sanitizer)
 */
#define MOETRAIN_IMPLEMENTATION   /* mt_errf and friends, for the kernels file */
#include "../moetrain_kernels.cu"
#include "kernel_variants.cuh"   /* fa_bwd_dkdv_wg_kernel: the dK/dV kernel the split one replaced */
#undef CK

/* ========================================================================================== */
/* Self test                                                                                  */
/* ========================================================================================== */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <vector>
#include <algorithm>

#define CK(x)                                                                                             \
    do {                                                                                                  \
        cudaError_t e_ = (x);                                                                             \
        if (e_ != cudaSuccess) {                                                                          \
            fprintf(stderr, "CUDA error '%s' at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(2);                                                                                      \
        }                                                                                                 \
    } while (0)
#define CKAPI(x)                                                                      \
    do {                                                                              \
        int r_ = (x);                                                                 \
        if (r_ != 0) {                                                                \
            fprintf(stderr, "API call '%s' failed (%d) at %s:%d\n", #x, r_, __FILE__, __LINE__); \
            cudaError_t e_ = cudaGetLastError();                                      \
            fprintf(stderr, "  last CUDA error: %s\n", cudaGetErrorString(e_));       \
            exit(2);                                                                  \
        }                                                                             \
    } while (0)

static int g_pass = 0, g_fail = 0;

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static inline uint64_t rng_next() {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline double rng_uniform() { return ((rng_next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static void fill_normal(std::vector<uint16_t> &v) {
    for (size_t i = 0; i < v.size(); i += 2) {
        const double u1 = rng_uniform(), u2 = rng_uniform();
        const double r = sqrt(-2.0 * log(u1));
        v[i] = f2bf((float)(r * cos(6.283185307179586 * u2)));
        if (i + 1 < v.size()) v[i + 1] = f2bf((float)(r * sin(6.283185307179586 * u2)));
    }
}

struct Shape {
    int B, T, H, dq, dv;
    int doc; /* 0: plain causal; > 0: packed documents of random lengths 1..2*doc (fixed length doc when timing) */
};

/* document starts [B*T] (see mt_cpu_doc_starts): random lengths in 1..2*doc, or all of length doc */
static std::vector<int> make_doc_starts(const Shape &s, bool fixed) {
    std::vector<int> ds((size_t)s.B * s.T);
    for (int b = 0; b < s.B; ++b) {
        int start = 0, left = 0;
        for (int t = 0; t < s.T; ++t) {
            if (left == 0) { start = t; left = fixed ? s.doc : 1 + (int)(rng_next() % (uint64_t)(2 * s.doc)); }
            ds[(size_t)b * s.T + t] = start;
            --left;
        }
    }
    return ds;
}

struct Err {
    double num = 0, den = 0;
    size_t count = 0;
    void add(double gpu, double ref) {
        num += (gpu - ref) * (gpu - ref);
        den += ref * ref;
        ++count;
    }
    /* relative L2 error; the reference norm is floored at RMS 1e-2 so that exactly-zero references
       (e.g. dQ when T == 1) compare against an absolute scale instead of dividing by zero */
    double rel() const {
        const double floor_ = 1e-4 * (double)count;
        return sqrt(num) / sqrt(std::max(den, floor_));
    }
};

static void report(const char *tag, const char *name, const Err &e, double tol, size_t nonfinite) {
    const double r = e.rel();
    const bool ok = (nonfinite == 0) && (r <= tol) && e.count > 0;
    printf("  %-28s %-4s rel_err=%.3e (tol %.0e, %zu checked, %zu non-finite) %s\n", tag, name, r, tol, e.count, nonfinite,
           ok ? "PASS" : "FAIL");
    if (ok) ++g_pass; else ++g_fail;
}
static void check(bool ok, const char *what) {
    printf("  %-60s %s\n", what, ok ? "PASS" : "FAIL");
    if (ok) ++g_pass; else ++g_fail;
}

static size_t count_nonfinite_bf(const std::vector<uint16_t> &v) {
    size_t n = 0;
    for (uint16_t x : v) n += ((x & 0x7f80u) == 0x7f80u);
    return n;
}
static size_t count_nonfinite_f(const std::vector<float> &v) {
    size_t n = 0;
    for (float x : v) n += !std::isfinite(x);
    return n;
}

struct DevBufs {
    __nv_bfloat16 *q = 0, *k = 0, *v = 0, *o = 0, *dout = 0, *dq = 0, *dk = 0, *dv = 0;
    float *lse = 0;
    int *ds = 0; /* document starts, or null */
    void *ws = 0;
    size_t nq = 0, nv = 0, nl = 0, wsb = 0;
    void alloc(const Shape &s) {
        const size_t N = (size_t)s.B * s.T;
        nq = N * s.H * s.dq;
        nv = N * s.H * s.dv;
        nl = N * s.H;
        wsb = mt__fa_backward_workspace(s.B, s.T, s.H, s.dq, s.dv);
        CK(cudaMalloc(&q, nq * 2)); CK(cudaMalloc(&k, nq * 2)); CK(cudaMalloc(&v, nv * 2));
        CK(cudaMalloc(&o, nv * 2)); CK(cudaMalloc(&dout, nv * 2));
        CK(cudaMalloc(&dq, nq * 2)); CK(cudaMalloc(&dk, nq * 2)); CK(cudaMalloc(&dv, nv * 2));
        CK(cudaMalloc(&lse, nl * 4)); CK(cudaMalloc(&ws, wsb));
    }
    void release() {
        CK(cudaFree(q)); CK(cudaFree(k)); CK(cudaFree(v)); CK(cudaFree(o)); CK(cudaFree(dout));
        CK(cudaFree(dq)); CK(cudaFree(dk)); CK(cudaFree(dv)); CK(cudaFree(lse)); CK(cudaFree(ws));
        if (ds) CK(cudaFree(ds));
    }
    void set_docs(const std::vector<int> &h) {
        CK(cudaMalloc(&ds, h.size() * 4));
        CK(cudaMemcpy(ds, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
    void poison() {
        CK(cudaMemset(o, 0xFF, nv * 2)); CK(cudaMemset(lse, 0xFF, nl * 4));
        CK(cudaMemset(dq, 0xFF, nq * 2)); CK(cudaMemset(dk, 0xFF, nq * 2)); CK(cudaMemset(dv, 0xFF, nv * 2));
        CK(cudaMemset(ws, 0xFF, wsb));
    }
};

struct HostOut {
    std::vector<uint16_t> o, dq, dk, dv;
    std::vector<float> lse;
};

static void run_gpu(const Shape &s, DevBufs &d, float scale, HostOut &out) {
    d.poison();
    CKAPI(mt__fa_forward(d.q, d.k, d.v, d.ds, d.o, d.lse, s.B, s.T, s.H, s.dq, s.dv, scale, 0));
    CKAPI(mt__fa_backward(d.q, d.k, d.v, d.o, d.lse, d.dout, d.ds, d.dq, d.dk, d.dv, d.ws, s.B, s.T, s.H, s.dq, s.dv,
                                     scale, 0));
    CK(cudaDeviceSynchronize());
    out.o.resize(d.nv); out.dv.resize(d.nv); out.dq.resize(d.nq); out.dk.resize(d.nq); out.lse.resize(d.nl);
    CK(cudaMemcpy(out.o.data(), d.o, d.nv * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(out.dv.data(), d.dv, d.nv * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(out.dq.data(), d.dq, d.nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(out.dk.data(), d.dk, d.nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(out.lse.data(), d.lse, d.nl * 4, cudaMemcpyDeviceToHost));
}

/* the backward with dQ recomputing S and dP (p.ds null: the path taken when the dS tiles would pass
   MT_FA_DS_MAX_BYTES), from the forward's O and lse in d */
static void run_bwd_recompute(const Shape &s, DevBufs &d, float scale) {
    using namespace mt_fa;
    BwdParams p;
    const int cfg = setup_bwd(p, d.q, d.k, d.v, d.o, d.lse, d.dout, d.ds, d.dq, d.dk, d.dv, d.ws, s.B, s.T, s.H, s.dq, s.dv, scale);
    if (cfg < 0) { check(false, "setup_bwd for the recomputing dQ"); return; }
    p.ds = nullptr;
    p.ntri = 0;
    const int BH = s.B * s.H;
    CKAPI(launch_dot_kernel(p, (long long)BH * s.T, 0));
    switch (cfg) {
    case 0: CKAPI((launch_bwd<32, 32>(p, BH, 0))); break;
    case 1: CKAPI((launch_bwd<64, 64>(p, BH, 0))); break;
    case 2: CKAPI((launch_bwd<128, 128>(p, BH, 0))); break;
    case 3: CKAPI((launch_bwd<192, 128>(p, BH, 0))); break;
    default: CKAPI((launch_bwd<256, 256>(p, BH, 0))); break;
    }
    CK(cudaDeviceSynchronize());
}

static void test_shape(const Shape &s) {
    char tag[96];
    snprintf(tag, sizeof tag, "B=%d T=%d H=%d dq=%d dv=%d%s", s.B, s.T, s.H, s.dq, s.dv, s.doc ? " docs" : "");
    printf("shape %s\n", tag);
    fflush(stdout);
    const int B = s.B, T = s.T, H = s.H, dq = s.dq, dv = s.dv;
    const size_t N = (size_t)B * T;
    const float scale = 1.0f / sqrtf((float)dq);
    std::vector<uint16_t> hq(N * H * dq), hk(N * H * dq), hv(N * H * dv), hdo(N * H * dv);
    fill_normal(hq); fill_normal(hk); fill_normal(hv); fill_normal(hdo);

    std::vector<int> hds;
    if (s.doc) hds = make_doc_starts(s, false);
    DevBufs d;
    d.alloc(s);
    if (s.doc) d.set_docs(hds);
    CK(cudaMemcpy(d.q, hq.data(), d.nq * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.k, hk.data(), d.nq * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.v, hv.data(), d.nv * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.dout, hdo.data(), d.nv * 2, cudaMemcpyHostToDevice));

    HostOut r1, r2;
    run_gpu(s, d, scale, r1);

    /* ---- which (b,h) pairs / rows / keys to check ---- */
    const bool full = (double)B * H * (double)T * T <= 4.0e6;
    std::vector<std::pair<int, int>> pairs;
    if (full) {
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < H; ++h) pairs.push_back({b, h});
    } else {
        pairs.push_back({0, 0});
        pairs.push_back({B - 1, H - 1});
        pairs.push_back({(int)(rng_next() % B), (int)(rng_next() % H)});
        std::sort(pairs.begin(), pairs.end());
        pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
    }
    std::vector<int> sel;
    if (full) {
        for (int t = 0; t < T; ++t) sel.push_back(t);
    } else {
        const int fixed[] = {0, 1, 2, 15, 16, 63, 64, 65, 127, 128, 129, T / 2, T - 65, T - 64, T - 2, T - 1};
        for (int t : fixed)
            if (t >= 0 && t < T) sel.push_back(t);
        for (int i = 0; i < 48; ++i) sel.push_back((int)(rng_next() % T));
        std::sort(sel.begin(), sel.end());
        sel.erase(std::unique(sel.begin(), sel.end()), sel.end());
    }

    Err eo, el, edq, edk, edv;
    std::vector<double> Qd((size_t)T * dq), Kd((size_t)T * dq), Vd((size_t)T * dv), Gd((size_t)T * dv);
    std::vector<double> Od((size_t)T * dv), L(T), Dd(T), srow(T);
    std::vector<int> lo(T, 0); /* first key each query sees */
    for (auto bh : pairs) {
        const int b = bh.first, h = bh.second;
        for (int t = 0; t < T; ++t) lo[t] = s.doc ? hds[(size_t)b * T + t] : 0;
        for (int t = 0; t < T; ++t) {
            const size_t n = (size_t)b * T + t;
            for (int x = 0; x < dq; ++x) {
                Qd[(size_t)t * dq + x] = bf2f(hq[(n * H + h) * dq + x]);
                Kd[(size_t)t * dq + x] = bf2f(hk[(n * H + h) * dq + x]);
            }
            for (int x = 0; x < dv; ++x) {
                Vd[(size_t)t * dv + x] = bf2f(hv[(n * H + h) * dv + x]);
                Gd[(size_t)t * dv + x] = bf2f(hdo[(n * H + h) * dv + x]);
            }
        }
        /* forward for every row (needed for D and for dK/dV) */
        for (int i = 0; i < T; ++i) {
            double mx = -1e300;
            const double *qi = &Qd[(size_t)i * dq];
            for (int j = lo[i]; j <= i; ++j) {
                const double *kj = &Kd[(size_t)j * dq];
                double acc = 0;
                for (int x = 0; x < dq; ++x) acc += qi[x] * kj[x];
                srow[j] = acc * (double)scale;
                mx = std::max(mx, srow[j]);
            }
            double sum = 0;
            for (int j = lo[i]; j <= i; ++j) { srow[j] = exp(srow[j] - mx); sum += srow[j]; }
            L[i] = mx + log(sum);
            double *oi = &Od[(size_t)i * dv];
            for (int x = 0; x < dv; ++x) oi[x] = 0;
            for (int j = lo[i]; j <= i; ++j) {
                const double pj = srow[j] / sum;
                const double *vj = &Vd[(size_t)j * dv];
                for (int x = 0; x < dv; ++x) oi[x] += pj * vj[x];
            }
            double D = 0;
            for (int x = 0; x < dv; ++x) D += oi[x] * Gd[(size_t)i * dv + x];
            Dd[i] = D;
        }
        auto P = [&](int i, int j, double *dpij) {
            double acc = 0, dp = 0;
            for (int x = 0; x < dq; ++x) acc += Qd[(size_t)i * dq + x] * Kd[(size_t)j * dq + x];
            for (int x = 0; x < dv; ++x) dp += Gd[(size_t)i * dv + x] * Vd[(size_t)j * dv + x];
            *dpij = dp;
            return exp(acc * (double)scale - L[i]);
        };
        std::vector<double> g((size_t)std::max(dq, dv));
        for (int i : sel) {
            const size_t n = (size_t)b * T + i;
            for (int x = 0; x < dv; ++x) eo.add(bf2f(r1.o[(n * H + h) * dv + x]), Od[(size_t)i * dv + x]);
            el.add(r1.lse[n * H + h], L[i]);
            /* dQ_i */
            std::fill(g.begin(), g.end(), 0.0);
            for (int j = lo[i]; j <= i; ++j) {
                double dp;
                const double pij = P(i, j, &dp);
                const double ds = pij * (dp - Dd[i]);
                for (int x = 0; x < dq; ++x) g[x] += ds * Kd[(size_t)j * dq + x];
            }
            for (int x = 0; x < dq; ++x) edq.add(bf2f(r1.dq[(n * H + h) * dq + x]), g[x] * scale);
            /* dK_j, dV_j for j = i (key rows use the same selection) */
            const int j = i;
            std::vector<double> gk(dq, 0.0), gv(dv, 0.0);
            for (int ii = j; ii < T && lo[ii] <= j; ++ii) {
                double dp;
                const double pij = P(ii, j, &dp);
                const double ds = pij * (dp - Dd[ii]);
                for (int x = 0; x < dq; ++x) gk[x] += ds * Qd[(size_t)ii * dq + x];
                for (int x = 0; x < dv; ++x) gv[x] += pij * Gd[(size_t)ii * dv + x];
            }
            for (int x = 0; x < dq; ++x) edk.add(bf2f(r1.dk[(n * H + h) * dq + x]), gk[x] * scale);
            for (int x = 0; x < dv; ++x) edv.add(bf2f(r1.dv[(n * H + h) * dv + x]), gv[x]);
        }
    }
    report(tag, "O", eo, 1e-2, count_nonfinite_bf(r1.o));
    report(tag, "lse", el, 1e-3, count_nonfinite_f(r1.lse));
    report(tag, "dQ", edq, 1e-2, count_nonfinite_bf(r1.dq));
    report(tag, "dK", edk, 1e-2, count_nonfinite_bf(r1.dk));
    report(tag, "dV", edv, 1e-2, count_nonfinite_bf(r1.dv));

    /* determinism: run again from poisoned outputs and compare bitwise */
    run_gpu(s, d, scale, r2);
    const bool same = r1.o == r2.o && r1.dq == r2.dq && r1.dk == r2.dk && r1.dv == r2.dv &&
                      memcmp(r1.lse.data(), r2.lse.data(), r1.lse.size() * 4) == 0;
    char what[160];
    snprintf(what, sizeof what, "%s bitwise identical rerun", tag);
    check(same, what);

    /* dQ recomputed instead of read from the stored dS: dK and dV bitwise the same (the dK/dV kernel only
       adds the stores), dQ within bf16 rounding of the default's */
    CK(cudaMemset(d.dq, 0xFF, d.nq * 2)); CK(cudaMemset(d.dk, 0xFF, d.nq * 2)); CK(cudaMemset(d.dv, 0xFF, d.nv * 2));
    run_bwd_recompute(s, d, scale);
    {
        std::vector<uint16_t> rq(d.nq), rk(d.nq), rv(d.nv);
        CK(cudaMemcpy(rq.data(), d.dq, d.nq * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(rk.data(), d.dk, d.nq * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(rv.data(), d.dv, d.nv * 2, cudaMemcpyDeviceToHost));
        double md = 0, mx = 0;
        for (size_t i = 0; i < rq.size(); ++i) {
            md = std::max(md, (double)fabsf(bf2f(rq[i]) - bf2f(r1.dq[i])));
            mx = std::max(mx, (double)fabsf(bf2f(r1.dq[i])));
        }
        snprintf(what, sizeof what, "%s dQ recomputed: dK, dV bitwise; max |dQ - dQ(dS)| = %.3g (max |dQ| %.3g)", tag, md, mx);
        check(rk == r1.dk && rv == r1.dv && count_nonfinite_bf(rq) == 0 && md <= 1e-2 * mx + 1e-6, what);
    }
    d.release();
    fflush(stdout);
}

__global__ void fill_random_bf16(__nv_bfloat16 *x, size_t n, uint32_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
        uint32_t h2 = h * 0x27d4eb2fu + 0x165667b1u;
        h2 ^= h2 >> 15;
        /* sum of two uniforms - approx normal-ish, std ~1 */
        const float u1 = (h & 0xffffff) * (1.0f / 16777216.0f), u2 = (h2 & 0xffffff) * (1.0f / 16777216.0f);
        x[i] = __float2bfloat16_rn((u1 + u2 - 1.0f) * 2.449f);
    }
}

/* f() 13 times on the default stream, timed by events: the median of the last 10 (ms) */
template <class F>
static float median_ms(F &&f) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int it = 0; it < 13; ++it) {
        CK(cudaEventRecord(e0, 0));
        f();
        CK(cudaEventRecord(e1, 0));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (it >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return 0.5f * (ms[4] + ms[5]);
}

static void bench_shape(const Shape &s) {
    DevBufs d;
    d.alloc(s);
    double pairs = (double)s.B * ((double)s.T * s.T / 2.0); /* causal: the C bench's count */
    if (s.doc) {
        const std::vector<int> hds = make_doc_starts(s, true);
        d.set_docs(hds);
        pairs = 0;
        for (size_t n = 0; n < hds.size(); ++n) pairs += (double)((int)(n % s.T) - hds[n] + 1);
    }
    fill_random_bf16<<<1024, 256>>>(d.q, d.nq, 1u);
    fill_random_bf16<<<1024, 256>>>(d.k, d.nq, 2u);
    fill_random_bf16<<<1024, 256>>>(d.v, d.nv, 3u);
    fill_random_bf16<<<1024, 256>>>(d.dout, d.nv, 4u);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    const float scale = 1.0f / sqrtf((float)s.dq);
    const double flops_fwd = 2.0 * s.H * pairs * (s.dq + s.dv);
    const double flops_bwd = 2.5 * flops_fwd;
    double med[2];
    med[0] = median_ms([&] { CKAPI(mt__fa_forward(d.q, d.k, d.v, d.ds, d.o, d.lse, s.B, s.T, s.H, s.dq, s.dv, scale, 0)); });
    med[1] = median_ms([&] {
        CKAPI(mt__fa_backward(d.q, d.k, d.v, d.o, d.lse, d.dout, d.ds, d.dq, d.dk, d.dv, d.ws, s.B, s.T, s.H, s.dq, s.dv, scale, 0));
    });
    char docs[48] = "";
    if (s.doc) snprintf(docs, sizeof docs, " docs=%d", s.doc);
    printf("timing B=%d T=%d H=%d dq=%d dv=%d%s: forward %.3f ms (%.1f TFLOP/s), backward %.3f ms (%.1f TFLOP/s)\n", s.B, s.T,
           s.H, s.dq, s.dv, docs, med[0], flops_fwd / (med[0] * 1e-3) / 1e12, med[1], flops_bwd / (med[1] * 1e-3) / 1e12);
    d.release();
}

/* Per-kernel breakdown of the backward plus an alternative dK/dV configuration (2 CTAs/SM, single
   buffered, K/V fragments reloaded from smem) so the two can be compared on the real hardware. */
template <class P>
static float time_launcher(int (*f)(const P &, int, cudaStream_t), const P &p, int BH) {
    return median_ms([&] { CKAPI(f(p, BH, 0)); });
}
static int launch_dot_only(const mt_fa::BwdParams &p, int BH, cudaStream_t st) {
    return mt_fa::launch_dot_kernel(p, (long long)p.T * BH, st); /* BH here is B*H: rows = B*T*H */
}
static int launch_dot_scalar(const mt_fa::BwdParams &p, int BH, cudaStream_t st) { /* the one-lane-per-element D kernel */
    const long long rows = (long long)p.T * BH;
    mt_fa::fa_bwd_dot_kernel<<<(unsigned)((rows + 7) / 8), 256, 0, st>>>(p.o, p.dout, p.dsum, rows, p.dimv, p.ds ? p.tick : nullptr);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
/* heads of 256: the wgmma forward (64-key tiles) against the mma.sync one, same inputs */
static void bench_fwd256(const Shape &s) {
    using namespace mt_fa;
    typedef Cfg<256, 256> C;
    DevBufs d;
    d.alloc(s);
    fill_random_bf16<<<1024, 256>>>(d.q, d.nq, 31u);
    fill_random_bf16<<<1024, 256>>>(d.k, d.nq, 32u);
    fill_random_bf16<<<1024, 256>>>(d.v, d.nv, 33u);
    CK(cudaGetLastError());
    const float scale = 1.0f / sqrtf((float)s.dq);
    FwdParams fp;
    fp.q = d.q; fp.k = d.k; fp.v = d.v; fp.o = d.o; fp.lse = d.lse; fp.dstart = nullptr;
    fp.T = s.T; fp.H = s.H; fp.dimq = s.dq; fp.dimv = s.dv;
    fp.scale_log2 = scale * MT_FA_LOG2E;
    fp.vec_qk = 1; fp.vec_v = 1; fp.pair_o = 1;
    const int BH = s.B * s.H;
    std::vector<uint16_t> o1(d.nv), o2(d.nv);
    const float t_mma = time_launcher(launch_fwd_kernel<256, 256, C::F_NW, C::F_BN, C::F_ST, C::F_QREG, C::F_MT>, fp, BH);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(o1.data(), d.o, d.nv * 2, cudaMemcpyDeviceToHost));
    const float t_wg = time_launcher(launch_fwd_wg_kernel<256, 256, 64>, fp, BH);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(o2.data(), d.o, d.nv * 2, cudaMemcpyDeviceToHost));
    double md = 0;
    for (size_t i = 0; i < o1.size(); ++i) md = std::max(md, (double)fabsf(bf2f(o2[i]) - bf2f(o1[i])));
    const double fl = 2.0 * s.B * s.H * ((double)s.T * s.T / 2.0) * (s.dq + s.dv);
    printf("timing-256 B=%d T=%d H=%d %d/%d: forward wgmma (64-key tiles) %.3f ms (%.1f TFLOP/s), mma.sync %.3f ms (%.1f TFLOP/s); "
           "max |O - O(mma.sync)| = %.3g\n", s.B, s.T, s.H, s.dq, s.dv, t_wg, fl / (t_wg * 1e-3) / 1e12, t_mma, fl / (t_mma * 1e-3) / 1e12, md);
    check(md < 0.02, "forward at heads of 256: wgmma agrees with mma.sync");
    d.release();
}
/* heads of 256: the backward with dK and dV on separate warpgroups (fa_bwd_dkdv_split_kernel) and dQ from
   its dS, or recomputing (mma.sync dQ), against the mma.sync pair, same inputs */
static int launch_bwd256_mma(const mt_fa::BwdParams &p, int BH, cudaStream_t st) {
    using namespace mt_fa;
    typedef Cfg<256, 256> C;
    if (launch_dkdv_kernel<256, 256, C::K_BMQ, C::K_ST, C::K_MINB, C::K_QC, C::K_KVREG, C::K_MT>(p, BH, st)) return -1;
    return launch_dq_kernel<256, 256, C::Q_NW, C::Q_BN, C::Q_ST>(p, BH, st);
}
static void bench_bwd256(const Shape &s) {
    using namespace mt_fa;
    DevBufs d;
    d.alloc(s);
    fill_random_bf16<<<1024, 256>>>(d.q, d.nq, 41u);
    fill_random_bf16<<<1024, 256>>>(d.k, d.nq, 42u);
    fill_random_bf16<<<1024, 256>>>(d.v, d.nv, 43u);
    fill_random_bf16<<<1024, 256>>>(d.dout, d.nv, 44u);
    CK(cudaGetLastError());
    const float scale = 1.0f / sqrtf((float)s.dq);
    CKAPI(mt__fa_forward(d.q, d.k, d.v, nullptr, d.o, d.lse, s.B, s.T, s.H, s.dq, s.dv, scale, 0));
    BwdParams p;
    const int cfg = setup_bwd(p, d.q, d.k, d.v, d.o, d.lse, d.dout, nullptr, d.dq, d.dk, d.dv, d.ws, s.B, s.T, s.H, s.dq, s.dv, scale);
    if (cfg != 4 || !p.ds) { check(false, "backward at heads of 256: config 4 with the dS tiles"); d.release(); return; }
    const int BH = s.B * s.H;
    CKAPI(launch_dot_only(p, BH, 0));
    BwdParams pr = p;
    pr.ds = nullptr;
    std::vector<uint16_t> r[3][3]; /* [run][dq, dk, dv] */
    float ms[3], ms_kv = 0;
    for (int k = 0; k < 3; ++k) {
        int (*f)(const BwdParams &, int, cudaStream_t) = k == 2 ? launch_bwd256_mma : launch_bwd<256, 256, true>;
        ms[k] = time_launcher(f, k == 1 ? pr : p, BH);
        CK(cudaDeviceSynchronize());
        __nv_bfloat16 *src[3] = {d.dq, d.dk, d.dv};
        for (int o = 0; o < 3; ++o) {
            r[k][o].resize(o == 2 ? d.nv : d.nq);
            CK(cudaMemcpy(r[k][o].data(), src[o], r[k][o].size() * 2, cudaMemcpyDeviceToHost));
        }
    }
    ms_kv = time_launcher(launch_dkdv_split_kernel<256, 256>, p, BH);
    double md[3] = {0, 0, 0}, mx[3] = {0, 0, 0};
    size_t bad = 0; /* non-finite values in any run's outputs */
    for (int o = 0; o < 3; ++o)
        for (size_t i = 0; i < r[0][o].size(); ++i) {
            const float a = bf2f(r[0][o][i]), b = bf2f(r[2][o][i]), c = bf2f(r[1][o][i]);
            if (!std::isfinite(a) || !std::isfinite(b) || !std::isfinite(c)) { ++bad; continue; }
            md[o] = std::max(md[o], (double)fabsf(a - b));
            mx[o] = std::max(mx[o], (double)fabsf(b));
        }
    const bool kv_same = r[0][1] == r[1][1] && r[0][2] == r[1][2];
    printf("  heads of 256: max |d(mma.sync)| dQ %.3g dK %.3g dV %.3g; non-finite values %zu\n", mx[0], mx[1], mx[2], bad);
    const double fl = 2.5 * 2.0 * s.B * s.H * ((double)s.T * s.T / 2.0) * (s.dq + s.dv);
    printf("timing-256 B=%d T=%d H=%d %d/%d: backward wgmma (dK, dV split, dQ from dS) %.3f ms (%.1f TFLOP/s; dK/dV kernel %.3f ms), "
           "dQ recomputed (mma.sync) %.3f ms (%.1f), mma.sync %.3f ms (%.1f); max |d - d(mma.sync)| dQ %.3g dK %.3g dV %.3g; "
           "dK dV bitwise the same either way: %s\n",
           s.B, s.T, s.H, s.dq, s.dv, ms[0], fl / (ms[0] * 1e-3) / 1e12, ms_kv, ms[1], fl / (ms[1] * 1e-3) / 1e12, ms[2],
           fl / (ms[2] * 1e-3) / 1e12, md[0], md[1], md[2], kv_same ? "yes" : "NO");
    check(bad == 0 && mx[0] > 0 && mx[1] > 0 && mx[2] > 0, "backward at heads of 256: finite, non-zero gradients");
    check(md[0] <= 0.02 * mx[0] && md[1] <= 0.02 * mx[1] && md[2] <= 0.02 * mx[2], "backward at heads of 256: wgmma agrees with mma.sync");
    check(kv_same, "backward at heads of 256: dK, dV the same with dQ from dS or recomputed");
    d.release();
}
static void bench_breakdown(const Shape &s) {
    using namespace mt_fa;
    if (s.dq != 192 || s.dv != 128) return;
    DevBufs d;
    d.alloc(s);
    fill_random_bf16<<<1024, 256>>>(d.q, d.nq, 11u);
    fill_random_bf16<<<1024, 256>>>(d.k, d.nq, 12u);
    fill_random_bf16<<<1024, 256>>>(d.v, d.nv, 13u);
    fill_random_bf16<<<1024, 256>>>(d.dout, d.nv, 14u);
    CK(cudaGetLastError());
    const float scale = 1.0f / sqrtf((float)s.dq);
    CKAPI(mt__fa_forward(d.q, d.k, d.v, d.ds, d.o, d.lse, s.B, s.T, s.H, s.dq, s.dv, scale, 0));
    CKAPI(mt__fa_backward(d.q, d.k, d.v, d.o, d.lse, d.dout, d.ds, d.dq, d.dk, d.dv, d.ws, s.B, s.T, s.H, s.dq, s.dv,
                                     scale, 0));
    CK(cudaDeviceSynchronize());
    std::vector<uint16_t> dk1(d.nq), dv1(d.nv), dk2(d.nq), dv2(d.nv);
    CK(cudaMemcpy(dk1.data(), d.dk, d.nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dv1.data(), d.dv, d.nv * 2, cudaMemcpyDeviceToHost));
    BwdParams p;
    const int cfg = setup_bwd(p, d.q, d.k, d.v, d.o, d.lse, d.dout, nullptr, d.dq, d.dk, d.dv, d.ws, s.B, s.T, s.H, s.dq, s.dv, scale);
    if (cfg != 3) { printf("breakdown: unexpected config %d\n", cfg); d.release(); return; }
    const int BH = s.B * s.H;
    typedef Cfg<192, 128> C;
    const float t_dot = time_launcher(launch_dot_only, p, BH);
    {   /* D by 16-byte loads against one lane per element: the same sums in another order, so only close */
        std::vector<float> a((size_t)p.T * BH), b((size_t)p.T * BH);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(a.data(), p.dsum, a.size() * 4, cudaMemcpyDeviceToHost));
        const float t_dot1 = time_launcher(launch_dot_scalar, p, BH);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(b.data(), p.dsum, b.size() * 4, cudaMemcpyDeviceToHost));
        double md = 0, mx = 0;
        for (size_t i = 0; i < a.size(); ++i) md = std::max(md, (double)fabsf(a[i] - b[i])), mx = std::max(mx, (double)fabsf(b[i]));
        printf("  D = rowsum(dO * O): 16-byte loads %.4f ms, one lane per element %.4f ms; max |difference| %.3g (max |D| %.3g)\n",
               t_dot, t_dot1, md, mx);
        check(md <= 1e-5 * std::max(1.0, mx), "D by 16-byte loads agrees with one lane per element");
        CKAPI(launch_dot_only(p, BH, 0));
    }
    {   /* the wgmma backward kernels (the default) one by one, against the mma.sync ones */
        BwdParams pr = p; /* dQ recomputing S and dP */
        pr.ds = nullptr;
        const float t_kv_ds = time_launcher(launch_dkdv_split_kernel<192, 128>, p, BH);
        const float t_q_ds = time_launcher(launch_dq_ds_kernel<192>, p, BH);
        const float t_pair_ds = time_launcher(launch_bwd<192, 128, true>, p, BH);
        const float t_pair_rec = time_launcher(launch_bwd<192, 128, true>, pr, BH);
        const double fl0 = 2.0 * s.B * s.H * ((double)s.T * s.T / 2.0);
        printf("  wgmma backward, dS stored: dK/dV %.3f ms (%.1f TFLOP/s of mma work), dQ from dS %.3f ms (%.1f TFLOP/s); "
               "the pair %.3f ms (%.1f TFLOP/s as counted); dQ recomputing S and dP instead: the pair %.3f ms (%.1f)\n",
               t_kv_ds, fl0 * 2 * (192 + 128) / (t_kv_ds * 1e-3) / 1e12, t_q_ds, fl0 * 192 / (t_q_ds * 1e-3) / 1e12, t_pair_ds,
               2.5 * fl0 * (192 + 128) / (t_pair_ds * 1e-3) / 1e12, t_pair_rec, 2.5 * fl0 * (192 + 128) / (t_pair_rec * 1e-3) / 1e12);
        {   /* dK/dV on separate warpgroups (64-key blocks) against the two-warpgroup kernel: close, and the dS tiles
               the same up to rounding */
            std::vector<uint16_t> k0(d.nq), v0(d.nv), k1(d.nq), v1(d.nv);
            CKAPI((launch_dkdv_wg_kernel<192, 128>(p, BH, 0)));
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(k0.data(), d.dk, d.nq * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(v0.data(), d.dv, d.nv * 2, cudaMemcpyDeviceToHost));
            const float t_sp = time_launcher(launch_dkdv_split_kernel<192, 128>, p, BH);
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(k1.data(), d.dk, d.nq * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(v1.data(), d.dv, d.nv * 2, cudaMemcpyDeviceToHost));
            const float t_sp0 = time_launcher(launch_dkdv_split_kernel<192, 128>, pr, BH);
            const float t_np = time_launcher(launch_dkdv_split_kernel<192, 128, false>, p, BH); /* without PIPE */
            std::vector<uint16_t> k2(d.nq), v2(d.nv);
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(k2.data(), d.dk, d.nq * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(v2.data(), d.dv, d.nv * 2, cudaMemcpyDeviceToHost));
            printf("  dK/dV on separate warpgroups without the next tile's first product issued early: %.3f ms; same dK, dV: %s\n", t_np,
                   k2 == k1 && v2 == v1 ? "yes" : "NO");
            check(k2 == k1 && v2 == v1, "dK/dV split, with and without PIPE: bitwise the same");
            double mk = 0, mv = 0, xk = 0, xv = 0;
            size_t bad = 0;
            for (size_t i = 0; i < k0.size(); ++i) {
                const float a = bf2f(k0[i]), b = bf2f(k1[i]);
                if (!std::isfinite(a) || !std::isfinite(b)) { ++bad; continue; }
                mk = std::max(mk, (double)fabsf(a - b)); xk = std::max(xk, (double)fabsf(a));
            }
            for (size_t i = 0; i < v0.size(); ++i) {
                const float a = bf2f(v0[i]), b = bf2f(v1[i]);
                if (!std::isfinite(a) || !std::isfinite(b)) { ++bad; continue; }
                mv = std::max(mv, (double)fabsf(a - b)); xv = std::max(xv, (double)fabsf(a));
            }
            printf("  dK/dV on separate warpgroups (64-key blocks): %.3f ms with the dS stores, %.3f ms without (%.1f TFLOP/s); "
                   "max |dK - dK(two warpgroups)| %.3g (max %.3g), dV %.3g (max %.3g), non-finite %zu\n",
                   t_sp, t_sp0, fl0 * 2 * (192 + 128) / (t_sp * 1e-3) / 1e12, mk, xk, mv, xv, bad);
            check(bad == 0 && xk > 0 && xv > 0 && mk <= 0.02 * xk && mv <= 0.02 * xv, "dK/dV split across warpgroups agrees");
            CKAPI((launch_dkdv_wg_kernel<192, 128>(p, BH, 0)));
        }
        {   /* the ways of storing dS^T (store_ds): same tiles, so dQ bitwise the same */
            std::vector<uint16_t> q0(d.nq), q1(d.nq);
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(q0.data(), d.dq, d.nq * 2, cudaMemcpyDeviceToHost));
            float tv[4];
            bool same = true;
            int (*const ks[3])(const BwdParams &, int, cudaStream_t) = {launch_dkdv_wg_kernel<192, 128, 0, 1>,
                                                                          launch_dkdv_wg_kernel<192, 128, 0, 2>,
                                                                          launch_dkdv_wg_kernel<192, 128, 0, 3>};
            for (int v = 0; v < 3; ++v) {
                CK(cudaMemset(d.ws, 0xFF, d.wsb));
                CKAPI(launch_dot_kernel(p, (long long)BH * s.T, 0));
                tv[v + 1] = time_launcher(ks[v], p, BH);
                CKAPI((launch_dq_ds_kernel<192, false>(p, BH, 0)));
                CK(cudaDeviceSynchronize());
                CK(cudaMemcpy(q1.data(), d.dq, d.nq * 2, cudaMemcpyDeviceToHost));
                same = same && q1 == q0;
            }
            tv[0] = time_launcher(launch_dkdv_wg_kernel<192, 128>, pr, BH);
            printf("  dK/dV storing dS^T: none %.3f ms; 4-byte stores %.3f ms; quad-transposed 16-byte stores %.3f ms; stmatrix + TMA "
                   "store %.3f ms\n", tv[0], tv[1], tv[2], tv[3]);
            check(same, "dS^T stored three ways: dQ bitwise the same");
        }
        const float t_kv_wg = time_launcher(launch_dkdv_wg_kernel<192, 128>, pr, BH);
        const float t_q_wg = time_launcher(launch_dq_wg_kernel<192, 128>, pr, BH);
        CK(cudaDeviceSynchronize());
        std::vector<uint16_t> a(d.nq), bq(d.nq);
        CK(cudaMemcpy(a.data(), d.dq, d.nq * 2, cudaMemcpyDeviceToHost));
        CKAPI((launch_dq_kernel<192, 128, C::Q_NW, C::Q_BN, C::Q_ST>(p, BH, 0)));
        CK(cudaMemcpy(bq.data(), d.dq, d.nq * 2, cudaMemcpyDeviceToHost));
        double md = 0;
        for (size_t i = 0; i < a.size(); ++i) md = std::max(md, (double)fabsf(bf2f(a[i]) - bf2f(bq[i])));
        printf("  wgmma backward, dQ recomputing: dK/dV %.3f ms (%.1f TFLOP/s of mma work), dQ %.3f ms (%.1f TFLOP/s of mma work); "
               "max |dQ - dQ(mma.sync)| = %.3g\n",
               t_kv_wg, fl0 * 2 * (192 + 128) / (t_kv_wg * 1e-3) / 1e12, t_q_wg, fl0 * (192 + 128 + 192) / (t_q_wg * 1e-3) / 1e12, md);
    }
    const float t_kv = time_launcher(launch_dkdv_kernel<192, 128, C::K_BMQ, C::K_ST, C::K_MINB, C::K_QC, C::K_KVREG, C::K_MT>, p, BH);
    const float t_q = time_launcher(launch_dq_kernel<192, 128, C::Q_NW, C::Q_BN, C::Q_ST>, p, BH);
    const float t_kv_alt = time_launcher(launch_dkdv_kernel<192, 128, 64, 1, 2, 16, false, 2>, p, BH);
    CK(cudaDeviceSynchronize());
    {   /* dQ alternatives (same key order, so bitwise the same dQ), and dK/dV || dQ on two streams */
        std::vector<uint16_t> q1(d.nq), q2(d.nq);
        CKAPI((launch_dq_kernel<192, 128, C::Q_NW, C::Q_BN, C::Q_ST>(p, BH, 0)));
        CK(cudaMemcpy(q1.data(), d.dq, d.nq * 2, cudaMemcpyDeviceToHost));
        struct { const char *name; int (*f)(const BwdParams &, int, cudaStream_t); } alts[] = {
            {"8 warps, 32-key tiles", launch_dq_kernel<192, 128, 8, 32, 2>},
            {"4 warps, 64-key tiles", launch_dq_kernel<192, 128, 4, 64, 2>},
            {"4 warps, 32-key tiles (2 CTAs/SM)", launch_dq_kernel<192, 128, 4, 32, 2>},
        };
        for (auto &a : alts) {
            const float t = time_launcher(a.f, p, BH);
            CK(cudaMemcpy(q2.data(), d.dq, d.nq * 2, cudaMemcpyDeviceToHost));
            printf("  alternative dQ config (%s): %.3f ms vs %.3f ms; dQ bitwise %s\n", a.name, t, t_q, q1 == q2 ? "identical" : "DIFFERENT");
        }
        cudaStream_t s1;
        cudaEvent_t fork, join, e0, e1;
        CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
        CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        std::vector<float> ms[2];
        for (int it = 0; it < 26; ++it) {
            const bool par = it & 1;
            CK(cudaEventRecord(e0, 0));
            if (par) { CK(cudaEventRecord(fork, 0)); CK(cudaStreamWaitEvent(s1, fork, 0)); }
            CKAPI((launch_dq_kernel<192, 128, C::Q_NW, C::Q_BN, C::Q_ST>(p, BH, par ? s1 : 0)));
            CKAPI((launch_dkdv_kernel<192, 128, C::K_BMQ, C::K_ST, C::K_MINB, C::K_QC, C::K_KVREG, C::K_MT>(p, BH, 0)));
            if (par) { CK(cudaEventRecord(join, s1)); CK(cudaStreamWaitEvent(0, join, 0)); }
            CK(cudaEventRecord(e1, 0));
            CK(cudaEventSynchronize(e1));
            float t;
            CK(cudaEventElapsedTime(&t, e0, e1));
            if (it >= 6) ms[par].push_back(t);
        }
        for (auto &v : ms) std::sort(v.begin(), v.end());
        CK(cudaMemcpy(q2.data(), d.dq, d.nq * 2, cudaMemcpyDeviceToHost));
        printf("  dQ then dK/dV on one stream: %.3f ms; on two streams, concurrently: %.3f ms; dQ bitwise %s\n",
               0.5f * (ms[0][4] + ms[0][5]), 0.5f * (ms[1][4] + ms[1][5]), q1 == q2 ? "identical" : "DIFFERENT");
        CK(cudaStreamDestroy(s1));
        CK(cudaEventDestroy(fork)); CK(cudaEventDestroy(join)); CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
    }
    /* forward: default vs. 4 warps x 2 m-tiles (BM = 128, K/V fragments reused by two m-tiles) */
    FwdParams fp;
    fp.q = d.q; fp.k = d.k; fp.v = d.v; fp.o = d.o; fp.lse = d.lse; fp.dstart = nullptr;
    fp.T = s.T; fp.H = s.H; fp.dimq = s.dq; fp.dimv = s.dv;
    fp.scale_log2 = scale * MT_FA_LOG2E;
    fp.vec_qk = 1; fp.vec_v = 1; fp.pair_o = 1;
    std::vector<uint16_t> o1(d.nv), o2(d.nv);
    const double fl = 2.0 * s.B * s.H * ((double)s.T * s.T / 2.0);
    const float t_f = time_launcher(launch_fwd_kernel<192, 128, C::F_NW, C::F_BN, C::F_ST, C::F_QREG, C::F_MT>, fp, BH);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(o1.data(), d.o, d.nv * 2, cudaMemcpyDeviceToHost));
    const float t_f_alt = time_launcher(launch_fwd_kernel<192, 128, 4, 64, 2, false, 2>, fp, BH);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(o2.data(), d.o, d.nv * 2, cudaMemcpyDeviceToHost));
    {   /* wgmma forward against the mma.sync one: max |difference| of O (both bf16) */
        const float t_wg = time_launcher(launch_fwd_wg_kernel<192, 128, 128>, fp, BH);
        CK(cudaDeviceSynchronize());
        std::vector<uint16_t> o3(d.nv);
        CK(cudaMemcpy(o3.data(), d.o, d.nv * 2, cudaMemcpyDeviceToHost));
        double md = 0;
        for (size_t i = 0; i < o3.size(); ++i) md = std::max(md, (double)fabsf(bf2f(o3[i]) - bf2f(o1[i])));
        printf("  forward wgmma (2 warpgroups x 64 rows, 128-key tiles): %.3f ms (%.1f TFLOP/s); max |O - O(mma.sync)| = %.3g\n",
               t_wg, fl * (192 + 128) / (t_wg * 1e-3) / 1e12, md);
    }
    CK(cudaMemcpy(dk2.data(), d.dk, d.nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dv2.data(), d.dv, d.nv * 2, cudaMemcpyDeviceToHost));
    printf("breakdown B=%d T=%d H=%d 192/128: D %.3f ms | dK/dV %.3f ms (%.1f TFLOP/s of mma work) | dQ %.3f ms (%.1f TFLOP/s "
           "of mma work)\n",
           s.B, s.T, s.H, t_dot, t_kv, fl * 2 * (192 + 128) / (t_kv * 1e-3) / 1e12, t_q, fl * (192 + 128 + 192) / (t_q * 1e-3) / 1e12);
    printf("  alternative dK/dV config (ST=1, 2 CTAs/SM, no K/V register cache): %.3f ms; outputs bitwise %s to the default\n",
           t_kv_alt, (dk1 == dk2 && dv1 == dv2) ? "identical" : "DIFFERENT (info only)");
    printf("  forward default (8 warps x 16 rows): %.3f ms (%.1f TFLOP/s); alternative (4 warps x 32 rows): %.3f ms (%.1f "
           "TFLOP/s), O bitwise %s\n",
           t_f, fl * (192 + 128) / (t_f * 1e-3) / 1e12, t_f_alt, fl * (192 + 128) / (t_f_alt * 1e-3) / 1e12,
           o1 == o2 ? "identical" : "DIFFERENT (info only)");
    {   /* wgmma kernels: the launch order of the backward pair, then ablations that leave a stage out (their
           outputs are wrong: timing only, so they run last) */
        BwdParams pn = p; /* the ablations below: the kernels without the dS path */
        pn.ds = nullptr;
        const float b1 = time_launcher(launch_bwd<192, 128, true>, p, BH);
        const float b0 = time_launcher(launch_bwd<192, 128, false>, p, BH);
        printf("backward kernels (dK/dV, then dQ; wgmma): %.3f ms with dQ launched early, %.3f ms after dK/dV\n", b1, b0);
        /* the dQ and forward kernels' ablations (VAR bits) left the product: docs/KERNELS.md has what they
           measured; the two-warpgroup dK/dV kernel (bench/kernel_variants.cuh) keeps its own */
        const float k0 = time_launcher(launch_dkdv_wg_kernel<192, 128, 0>, pn, BH);
        const float k1 = time_launcher(launch_dkdv_wg_kernel<192, 128, 1>, pn, BH);
        const float k4 = time_launcher(launch_dkdv_wg_kernel<192, 128, 4>, pn, BH);
        const float k8 = time_launcher(launch_dkdv_wg_kernel<192, 128, 8>, pn, BH);
        const float k12 = time_launcher(launch_dkdv_wg_kernel<192, 128, 12>, pn, BH);
        const float k16 = time_launcher(launch_dkdv_wg_kernel<192, 128, 16>, pn, BH);
        const float k20 = time_launcher(launch_dkdv_wg_kernel<192, 128, 20>, pn, BH);
        printf("ablations dK/dV (two-warpgroup kernel, wgmma): %.3f ms, without the copies in the loop %.3f ms; without the "
               "warpgroups' turns at S/dP %.3f ms, turns at dV/dK too %.3f ms, at dV/dK only %.3f ms; refilling at a tile's "
               "start %.3f ms (and no turns %.3f ms)\n", k0, k1, k4, k8, k12, k16, k20);
    }
    d.release();
}

/* RoPE folded into attention (MLA_ATTENTION): the same work with Q's tiles from q + qr, K's from kv +
   the shared kr, V's from kv, and the backward writing q's and kv's gradients (dQ's rope columns
   rotated back) and each head's kr gradient; beside the unfolded kernels on separate Q, K, V of the
   same shape, and per kernel (dK/dV, dQ) */
static void bench_fold(int B, int T, int H, int dn, int dr, int dv) {
    using namespace mt_fa;
    const int dq = dn + dr;
    const size_t N = (size_t)B * T, nq = N * H * dq, nkv = N * H * (dn + dv), nr = N * H * dr, nv = N * H * dv, nl = N * H;
    __nv_bfloat16 *q, *kv, *qr, *kr, *o, *dout, *gq, *gkv, *gkr, *Q, *K, *V, *dQ, *dK, *dV;
    float *lse, *cs, *sn;
    void *ws;
    const size_t wsb = mt__fa_backward_workspace(B, T, H, dq, dv);
    CK(cudaMalloc(&q, nq * 2)); CK(cudaMalloc(&kv, nkv * 2)); CK(cudaMalloc(&qr, nr * 2)); CK(cudaMalloc(&kr, N * dr * 2));
    CK(cudaMalloc(&o, nv * 2)); CK(cudaMalloc(&dout, nv * 2)); CK(cudaMalloc(&gq, nq * 2)); CK(cudaMalloc(&gkv, nkv * 2));
    CK(cudaMalloc(&gkr, nr * 2)); CK(cudaMalloc(&Q, nq * 2)); CK(cudaMalloc(&K, nq * 2)); CK(cudaMalloc(&V, nv * 2));
    CK(cudaMalloc(&dQ, nq * 2)); CK(cudaMalloc(&dK, nq * 2)); CK(cudaMalloc(&dV, nv * 2));
    CK(cudaMalloc(&lse, nl * 4)); CK(cudaMalloc(&cs, (size_t)T * dr / 2 * 4)); CK(cudaMalloc(&sn, (size_t)T * dr / 2 * 4)); CK(cudaMalloc(&ws, wsb));
    fill_random_bf16<<<1024, 256>>>(q, nq, 21u); fill_random_bf16<<<1024, 256>>>(kv, nkv, 22u);
    fill_random_bf16<<<1024, 256>>>(qr, nr, 23u); fill_random_bf16<<<1024, 256>>>(kr, N * dr, 24u);
    fill_random_bf16<<<1024, 256>>>(dout, nv, 25u); fill_random_bf16<<<1024, 256>>>(Q, nq, 26u);
    fill_random_bf16<<<1024, 256>>>(K, nq, 27u); fill_random_bf16<<<1024, 256>>>(V, nv, 28u);
    CK(cudaMemset(cs, 0, (size_t)T * dr / 2 * 4)); CK(cudaMemset(sn, 0, (size_t)T * dr / 2 * 4));
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    const float scale = 1.0f / sqrtf((float)dq);
    float t[4];
    t[0] = median_ms([&] { CKAPI(mt__fa_mla_forward(q, kv, qr, kr, nullptr, o, lse, B, T, H, dn, dr, dv, scale, 0)); });
    t[1] = median_ms([&] { CKAPI(mt__fa_mla_backward(q, kv, qr, kr, o, lse, dout, nullptr, cs, sn, gq, gkv, gkr, ws, B, T, H, dn, dr, dv, scale, 0)); });
    t[2] = median_ms([&] { CKAPI(mt__fa_forward(Q, K, V, nullptr, o, lse, B, T, H, dq, dv, scale, 0)); });
    t[3] = median_ms([&] { CKAPI(mt__fa_backward(Q, K, V, o, lse, dout, nullptr, dQ, dK, dV, ws, B, T, H, dq, dv, scale, 0)); });
    /* per kernel: the same parameter blocks the entry points build */
    BwdParams pf, pu;
    setup_bwd(pu, Q, K, V, o, lse, dout, nullptr, dQ, dK, dV, ws, B, T, H, dq, dv, scale);
    setup_bwd(pf, q, kv, kv, o, lse, dout, nullptr, gq, gkv, gkv + dn, ws, B, T, H, dq, dv, scale);
    pf.q = pf.k = pf.v = nullptr; pf.vec_qk = 1; pf.pair_qk = pf.pair_v = 1;
    pf.fold.q = q; pf.fold.kv = kv; pf.fold.qr = qr; pf.fold.kr = kr; pf.fold.dn = dn;
    pf.dk2 = gkr; pf.rcos = cs; pf.rsin = sn;
    const int BH = B * H;
    int (*const kv_rt)(const BwdParams &, int, cudaStream_t) = launch_dkdv_split_kernel<192, 128>;
    const float kf = time_launcher(kv_rt, pf, BH), ku = time_launcher(kv_rt, pu, BH);
    {   /* the runtime's dK/dV kernel, folded and not, without the dS^T stores */
        BwdParams pn = pf;
        pn.ds = nullptr;
        BwdParams un = pu;
        un.ds = nullptr;
        const float k0 = time_launcher(kv_rt, pn, BH), k1 = time_launcher(kv_rt, un, BH);
        printf("  dK/dV without the dS^T stores: folded %.3f ms, unfolded %.3f ms\n", k0, k1);
    }
    const float qf = time_launcher(launch_dq_ds_kernel<192>, pf, BH), qu = time_launcher(launch_dq_ds_kernel<192>, pu, BH);
    const double ffwd = 2.0 * H * ((double)B * T * T / 2.0) * (dq + dv), fbwd = 2.5 * ffwd;
    printf("timing-fold B=%d T=%d H=%d %d+%d/%d: folded forward %.3f ms (%.1f TFLOP/s), backward %.3f ms (%.1f TFLOP/s); unfolded "
           "forward %.3f ms, backward %.3f ms; kernels folded / unfolded: dK/dV %.3f / %.3f ms, dQ %.3f / %.3f ms\n", B, T, H, dn, dr, dv,
           t[0], ffwd / (t[0] * 1e-3) / 1e12, t[1], fbwd / (t[1] * 1e-3) / 1e12, t[2], t[3], kf, ku, qf, qu);
    void *bufs[] = {q, kv, qr, kr, o, dout, gq, gkv, gkr, Q, K, V, dQ, dK, dV, lse, cs, sn, ws};
    for (void *b : bufs) CK(cudaFree(b));
}

int main(int argc, char **argv) {
    (void)argc; (void)argv;
    int dev = 0;
    CK(cudaGetDevice(&dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);

    if (getenv("TIMING_ONLY")) { /* only the two timed shapes (A/B runs of builds) */
        bench_shape({8, 2048, 16, 192, 128});
        bench_shape({2, 4096, 16, 192, 128});
        bench_shape({8, 2048, 16, 128, 128});
        bench_shape({8, 2048, 16, 64, 64});
        bench_fwd256({4, 2048, 16, 256, 256});
        bench_bwd256({4, 2048, 16, 256, 256});
        return 0;
    }
    if (const char *only = getenv("ONLY_SHAPE")) { /* one test shape "B,T,H,dq,dv[,doc]" (e.g. under compute-sanitizer) */
        Shape s = {0, 0, 0, 0, 0, 0};
        if (sscanf(only, "%d,%d,%d,%d,%d,%d", &s.B, &s.T, &s.H, &s.dq, &s.dv, &s.doc) < 5 || s.B < 1 || s.T < 1 || s.H < 1 ||
            s.dq < 1 || s.dq > 256 || s.dv < 1 || s.dv > 256 || s.doc < 0) {
            printf("ONLY_SHAPE: expected B,T,H,dq,dv[,doc] with heads up to 256, got \"%s\"\n", only);
            return 2;
        }
        test_shape(s);
        printf("FLASH_ATTN: %d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    if (getenv("FOLD_ONLY")) { /* only the folded-against-unfolded timings */
        bench_fold(8, 2048, 16, 128, 64, 128);
        bench_fold(2, 4096, 16, 128, 64, 128);
        return 0;
    }
    const Shape shapes[] = {
        {2, 64, 4, 24, 16}, {1, 7, 2, 12, 8}, {2, 100, 3, 64, 64}, {1, 130, 2, 128, 128}, {2, 256, 4, 192, 128},
        {1, 1, 1, 192, 128}, {8, 2048, 16, 192, 128},
        /* extra coverage: other padding configurations and odd sizes */
        {1, 130, 2, 256, 256}, {2, 77, 3, 40, 72}, {1, 33, 2, 20, 7}, {1, 300, 2, 192, 128},
        /* document masking: packed documents of random lengths */
        {2, 256, 4, 192, 128, 40}, {1, 300, 2, 192, 128, 70}, {2, 100, 3, 64, 64, 10}, {1, 130, 2, 256, 256, 25},
        {2, 2048, 16, 192, 128, 300},
        /* odd lengths and very short documents on the wgmma kernels */
        {1, 1000, 3, 192, 128}, {1, 257, 2, 192, 128, 3}, {3, 333, 2, 128, 128, 50}, {1, 515, 2, 64, 64, 200},
        /* heads of 256 (dK and dV on separate warpgroups), and head dims padded to them */
        {2, 300, 3, 256, 256}, {1, 700, 2, 256, 256, 90}, {1, 200, 2, 224, 160},
    };
    for (const Shape &s : shapes) test_shape(s);

    /* argument validation */
    {
        DevBufs d;
        Shape s = {1, 4, 1, 32, 32};
        d.alloc(s);
        check(mt__fa_forward(d.q, d.k, d.v, nullptr, d.o, d.lse, 1, 4, 1, 300, 32, 1.f, 0) == -1, "forward rejects dq > 256");
        check(mt__fa_backward(d.q, d.k, d.v, d.o, d.lse, d.dout, nullptr, d.dq, d.dk, d.dv, 0, 1, 4, 1, 32, 32, 1.f, 0) == -1,
              "backward rejects NULL workspace");
        check(mt__fa_forward(d.q, d.k, d.v, nullptr, d.o, d.lse, -1, 4, 1, 32, 32, 1.f, 0) == -1, "forward rejects B < 0");
        CK(cudaDeviceSynchronize());
        d.release();
    }

    bench_shape({8, 2048, 16, 192, 128});
    bench_shape({2, 4096, 16, 192, 128});
    bench_shape({8, 2048, 16, 192, 128, 512});
    bench_shape({2, 4096, 16, 192, 128, 1024});
    bench_breakdown({8, 2048, 16, 192, 128});
    bench_fwd256({4, 2048, 16, 256, 256});
    bench_bwd256({4, 2048, 16, 256, 256});
    bench_fold(8, 2048, 16, 128, 64, 128);
    bench_fold(2, 4096, 16, 128, 64, 128);

    printf("FLASH_ATTN: %d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

