/* test.c — moetrain's test suite. Prints "N passed, N failed" last.
 *
 * Built twice by `make test`:
 *   test_f32  (mt_real = float):  graph, passes, artifact (+ fuzzing), bitwise
 *             reproducibility, MoE edge cases, checkpoints, data, training, CLIs
 *   test_f64  (mt_real = double): float64 finite-difference gradient checks of
 *             every op's backward and of the whole model
 */
#define _POSIX_C_SOURCE 200809L   /* popen, for the CLI tests */
#define MOETRAIN_IMPLEMENTATION
#include "moetrain.h"

#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

static int n_pass, n_fail;
static void report(const char *name, int ok, const char *fmt, ...) {
    char msg[1024] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        for (char *q = msg; *q; q++) if (*q == '\n') *q = ' ';
    }
    printf("%s %-44s %s\n", ok ? "PASS" : "FAIL", name, msg);
    fflush(stdout);
    if (ok) n_pass++; else n_fail++;
}

static mt_rng R;
static void fill_normal(mt_real *x, int64_t n, double scale) { for (int64_t i = 0; i < n; i++) x[i] = (mt_real)(scale * mt_rng_normal(&R)); }


static int compile_cpu(mt_graph *g, const mt_config *c, int kind, int planned, mt_err *err) {
    mt_mesh m;
    mt_target t;
    mt_passes p;
    mt_mesh_single(&m);
    mt_target_cpu(&t);
    if (planned) mt_passes_all(&p); else mt_passes_none(&p);
    return mt_compile(g, c, &m, &t, kind, &p, err);
}

static mt_runtime *make_runtime(const mt_graph *g, int threads, int poison, uint64_t seed) {
    mt_binding b;
    mt_err e;
    mt_runtime *rt;
    mt_binding_single(&b);
    b.n_threads = threads; b.poison = poison;
    if (mt_runtime_create(&rt, g, &b, &e)) { printf("  runtime: %s\n", e.msg); return NULL; }
    if (mt_runtime_init_params(rt, seed, &e)) { printf("  init: %s\n", e.msg); mt_runtime_destroy(rt); return NULL; }
    return rt;
}

/* Deterministic batches from a fixed generator (independent of the runtime). */
static void make_batch(const mt_config *c, int step, int32_t *tok, int32_t *tgt) {
    mt_rng r;
    mt_rng_seed(&r, 1000 + (uint64_t)step);
    int64_t n = (int64_t)c->batch * c->seq_len;
    for (int64_t i = 0; i < n; i++) {
        tok[i] = (int32_t)(mt_rng_u64(&r) % (uint64_t)c->vocab_size);
        tgt[i] = (int32_t)((tok[i] * 7 + 3) % c->vocab_size);   /* learnable */
    }
}

#if MT_TEST_F64
/* A small model that runs in milliseconds. */
static void small_config(mt_config *c) {
    mt_err e;
    mt_config_preset(c, "tiny", &e);
    c->dim = 32; c->n_layers = 3; c->n_dense_layers = 1; c->n_heads = 2;
    c->kv_lora_rank = 16; c->qk_nope_head_dim = 8; c->qk_rope_head_dim = 4; c->v_head_dim = 8;
    c->inter_dim = 48; c->moe_inter_dim = 16; c->n_routed_experts = 4; c->top_k = 2; c->n_shared_experts = 1;
    c->vocab_size = 32; c->seq_len = 8; c->batch = 2; c->original_seq_len = 8;
}

static mt_real *alloc_real(int64_t n) { return (mt_real *)calloc((size_t)(n ? n : 1), sizeof(mt_real)); }
/* ======================================================================
 * float64 gradient checks
 * ==================================================================== */

/* Max |finite difference - analytic| over sampled elements, relative to the
 * largest gradient magnitude seen. */
typedef double (*loss_fn)(void *ctx);
static double fd_error(loss_fn L, void *ctx, mt_real *x, int64_t n, const mt_real *g, int max_samples) {
    const double h = 1e-5;
    double maxerr = 0, gmax = 1e-30;
    for (int s = 0; s < (n < max_samples ? n : max_samples); s++) {
        int64_t i = n <= max_samples ? s : (int64_t)(mt_rng_u64(&R) % (uint64_t)n);
        mt_real xi = x[i];
        x[i] = xi + h; double lp = L(ctx);
        x[i] = xi - h; double lm = L(ctx);
        x[i] = xi;
        double fd = (lp - lm) / (2 * h), err = fabs(fd - (double)g[i]);
        if (err > maxerr) maxerr = err;
        if (fabs(fd) > gmax) gmax = fabs(fd);
        if (fabs((double)g[i]) > gmax) gmax = fabs((double)g[i]);
    }
    return maxerr / gmax;
}
static double dot(const mt_real *a, const mt_real *b, int64_t n) { double s = 0; for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i]; return s; }
#define GC_TOL 1e-7

/* each op: loss = sum(r * outputs) for fixed random r */
typedef struct { int N, D, V, M, K, Nn, ta, tb, T, H, dn, dr, dv, B, E, topk, sf, norm, groups, limited; float scale, eps;
                 mt_real *a, *b, *c, *d, *e, *r0, *r1, *r2, *o0, *o1, *o2, *o3; int32_t *i0, *i1, *i2; } gc;

static double L_embed(void *p) { gc *c = (gc *)p; mt_cpu_embed_forward(c->o0, c->i0, c->a, c->N, c->D); return dot(c->o0, c->r0, (int64_t)c->N * c->D); }
static double L_rms(void *p) { gc *c = (gc *)p; mt_cpu_rmsnorm_forward(c->o0, c->o1, c->a, c->b, c->N, c->D, c->eps); return dot(c->o0, c->r0, (int64_t)c->N * c->D); }
static double L_mm(void *p) { gc *c = (gc *)p; mt_cpu_matmul(NULL, c->o0, c->a, c->b, c->M, c->Nn, c->K, c->ta, c->tb); return dot(c->o0, c->r0, (int64_t)c->M * c->Nn); }
static double L_rope(void *p) {
    gc *c = (gc *)p;
    mt_cpu_mla_rope_forward(c->o0, c->o1, c->o2, c->a, c->b, c->c, c->d, c->e, c->N, c->T, c->H, c->dn, c->dr, c->dv);
    int64_t nq = (int64_t)c->N * c->H * (c->dn + c->dr), nv = (int64_t)c->N * c->H * c->dv;
    return dot(c->o0, c->r0, nq) + dot(c->o1, c->r1, nq) + dot(c->o2, c->r2, nv);
}
static double L_attn(void *p) {
    gc *c = (gc *)p;
    mt_cpu_attention_forward(NULL, c->o0, c->o1, c->a, c->b, c->c, c->B, c->T, c->H, c->K, c->dv, c->scale);
    return dot(c->o0, c->r0, (int64_t)c->B * c->T * c->H * c->dv);
}
static double L_swiglu(void *p) { gc *c = (gc *)p; mt_cpu_swiglu_forward(c->o0, c->a, c->b, c->N); return dot(c->o0, c->r0, c->N); }
static double L_router(void *p) {
    gc *c = (gc *)p;
    mt_cpu_router_forward(c->i0, c->o0, c->o1, c->i1, c->a, c->b, c->N, c->E, c->topk, c->sf, c->norm, c->scale, c->groups, c->limited);
    return dot(c->o0, c->r0, (int64_t)c->N * c->topk);
}
static double L_permute(void *p) {
    gc *c = (gc *)p;
    mt_cpu_moe_permute(c->o0, c->i1, c->i2, c->a, c->i0, c->N, c->D, c->topk, c->E);
    return dot(c->o0, c->r0, (int64_t)c->N * c->topk * c->D);
}
static double L_gmm(void *p) { gc *c = (gc *)p; mt_cpu_gmm(NULL, c->o0, c->a, c->b, c->i0, c->E, c->M, c->K); return dot(c->o0, c->r0, (int64_t)c->N * c->M); }
static double L_combine(void *p) { gc *c = (gc *)p; mt_cpu_moe_combine_forward(c->o0, c->a, c->i0, c->b, c->N, c->D, c->topk); return dot(c->o0, c->r0, (int64_t)c->N * c->D); }
static double L_ce(void *p) { gc *c = (gc *)p; mt_real loss; mt_cpu_cross_entropy_forward(NULL, &loss, c->o1, c->a, c->i0, c->N, c->V); return (double)loss; }

static void test_gradcheck_ops(void) {
    gc c;
    double e1, e2, e3;
    /* embedding */
    memset(&c, 0, sizeof c); c.N = 7; c.D = 5; c.V = 6;
    c.a = alloc_real(c.V * c.D); c.o0 = alloc_real(c.N * c.D); c.r0 = alloc_real(c.N * c.D); c.i0 = (int32_t *)calloc(7, 4);
    mt_real *g = alloc_real(c.V * c.D);
    fill_normal(c.a, c.V * c.D, 1); fill_normal(c.r0, c.N * c.D, 1);
    for (int i = 0; i < c.N; i++) c.i0[i] = (int32_t)(mt_rng_u64(&R) % 6);
    c.i0[3] = c.i0[1];  /* repeated token: gradients accumulate */
    mt_cpu_embed_backward(g, c.r0, c.i0, c.N, c.V, c.D);
    e1 = fd_error(L_embed, &c, c.a, c.V * c.D, g, 1000);
    report("gradcheck embedding", e1 < GC_TOL, "rel err %.2e", e1);
    free(c.a); free(c.o0); free(c.r0); free(c.i0); free(g);

    /* RMSNorm */
    memset(&c, 0, sizeof c); c.N = 4; c.D = 9; c.eps = 1e-6f;
    c.a = alloc_real(36); c.b = alloc_real(9); c.o0 = alloc_real(36); c.o1 = alloc_real(4); c.r0 = alloc_real(36);
    mt_real *gx = alloc_real(36), *gw = alloc_real(9);
    fill_normal(c.a, 36, 1); fill_normal(c.b, 9, 1); fill_normal(c.r0, 36, 1);
    L_rms(&c);
    mt_cpu_rmsnorm_backward(gx, gw, c.r0, c.a, c.b, c.o1, c.N, c.D);
    e1 = fd_error(L_rms, &c, c.a, 36, gx, 100); e2 = fd_error(L_rms, &c, c.b, 9, gw, 100);
    report("gradcheck rmsnorm (x, w)", e1 < GC_TOL && e2 < GC_TOL, "rel err %.2e %.2e", e1, e2);
    free(c.a); free(c.b); free(c.o0); free(c.o1); free(c.r0); free(gx); free(gw);

    /* matmul, all four transposition cases, backward as the graph builds it */
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            memset(&c, 0, sizeof c); c.M = 5; c.Nn = 4; c.K = 11; c.ta = ta; c.tb = tb;
            c.a = alloc_real(55); c.b = alloc_real(44); c.o0 = alloc_real(20); c.r0 = alloc_real(20);
            mt_real *gA = alloc_real(55), *gB = alloc_real(44);
            fill_normal(c.a, 55, 1); fill_normal(c.b, 44, 1); fill_normal(c.r0, 20, 1);
            /* dA: ta=0 -> dC op(B)^T; ta=1 -> op(B) dC^T.  dB: tb=0 -> op(A)^T dC; tb=1 -> dC^T op(A) */
            if (!ta) mt_cpu_matmul(NULL, gA, c.r0, c.b, c.M, c.K, c.Nn, 0, !tb);
            else mt_cpu_matmul(NULL, gA, c.b, c.r0, c.K, c.M, c.Nn, tb, 1);
            if (!tb) mt_cpu_matmul(NULL, gB, c.a, c.r0, c.K, c.Nn, c.M, !ta, 0);
            else mt_cpu_matmul(NULL, gB, c.r0, c.a, c.Nn, c.K, c.M, 1, ta);
            e1 = fd_error(L_mm, &c, c.a, 55, gA, 100); e2 = fd_error(L_mm, &c, c.b, 44, gB, 100);
            char nm[64];
            snprintf(nm, sizeof nm, "gradcheck matmul ta=%d tb=%d", ta, tb);
            report(nm, e1 < GC_TOL && e2 < GC_TOL, "rel err %.2e %.2e", e1, e2);
            free(c.a); free(c.b); free(c.o0); free(c.r0); free(gA); free(gB);
        }

    /* MLA RoPE assembly */
    {
        mt_config cf;
        small_config(&cf);
        cf.seq_len = 3; cf.qk_rope_head_dim = 6;
        memset(&c, 0, sizeof c); c.N = 6; c.T = 3; c.H = 2; c.dn = 3; c.dr = 6; c.dv = 4;
        int64_t nq = c.N * c.H * (c.dn + c.dr), nkv = c.N * c.H * (c.dn + c.dv), nv = c.N * c.H * c.dv;
        c.a = alloc_real(nq); c.b = alloc_real(nkv); c.c = alloc_real(c.N * c.dr); c.d = alloc_real(c.T * 3); c.e = alloc_real(c.T * 3);
        c.o0 = alloc_real(nq); c.o1 = alloc_real(nq); c.o2 = alloc_real(nv); c.r0 = alloc_real(nq); c.r1 = alloc_real(nq); c.r2 = alloc_real(nv);
        mt_real *gq = alloc_real(nq), *gkv = alloc_real(nkv), *gk = alloc_real(c.N * c.dr);
        mt_cpu_rope_tables(c.d, c.e, &cf);
        fill_normal(c.a, nq, 1); fill_normal(c.b, nkv, 1); fill_normal(c.c, c.N * c.dr, 1);
        fill_normal(c.r0, nq, 1); fill_normal(c.r1, nq, 1); fill_normal(c.r2, nv, 1);
        mt_cpu_mla_rope_backward(gq, gkv, gk, c.r0, c.r1, c.r2, c.d, c.e, c.N, c.T, c.H, c.dn, c.dr, c.dv);
        e1 = fd_error(L_rope, &c, c.a, nq, gq, 200); e2 = fd_error(L_rope, &c, c.b, nkv, gkv, 200);
        e3 = fd_error(L_rope, &c, c.c, c.N * c.dr, gk, 200);
        report("gradcheck MLA rope (q, kv, k_pe)", e1 < GC_TOL && e2 < GC_TOL && e3 < GC_TOL, "rel err %.2e %.2e %.2e", e1, e2, e3);
        free(c.a); free(c.b); free(c.c); free(c.d); free(c.e); free(c.o0); free(c.o1); free(c.o2);
        free(c.r0); free(c.r1); free(c.r2); free(gq); free(gkv); free(gk);
    }

    /* causal attention */
    {
        memset(&c, 0, sizeof c); c.B = 2; c.T = 5; c.H = 2; c.K = 6; c.dv = 4; c.scale = 0.4f;
        int64_t n = c.B * c.T, nq = n * c.H * c.K, nv = n * c.H * c.dv;
        c.a = alloc_real(nq); c.b = alloc_real(nq); c.c = alloc_real(nv); c.o0 = alloc_real(nv); c.o1 = alloc_real(n * c.H); c.r0 = alloc_real(nv);
        mt_real *dQ = alloc_real(nq), *dK = alloc_real(nq), *dV = alloc_real(nv);
        fill_normal(c.a, nq, 1); fill_normal(c.b, nq, 1); fill_normal(c.c, nv, 1); fill_normal(c.r0, nv, 1);
        L_attn(&c);
        mt_cpu_attention_backward(NULL, dQ, dK, dV, c.a, c.b, c.c, c.o0, c.o1, c.r0, c.B, c.T, c.H, c.K, c.dv, c.scale);
        e1 = fd_error(L_attn, &c, c.a, nq, dQ, 300); e2 = fd_error(L_attn, &c, c.b, nq, dK, 300); e3 = fd_error(L_attn, &c, c.c, nv, dV, 300);
        report("gradcheck attention (Q, K, V)", e1 < GC_TOL && e2 < GC_TOL && e3 < GC_TOL, "rel err %.2e %.2e %.2e", e1, e2, e3);
        free(c.a); free(c.b); free(c.c); free(c.o0); free(c.o1); free(c.r0); free(dQ); free(dK); free(dV);
    }

    /* SwiGLU */
    memset(&c, 0, sizeof c); c.N = 30;
    c.a = alloc_real(30); c.b = alloc_real(30); c.o0 = alloc_real(30); c.r0 = alloc_real(30);
    mt_real *dg = alloc_real(30), *du = alloc_real(30);
    fill_normal(c.a, 30, 2); fill_normal(c.b, 30, 1); fill_normal(c.r0, 30, 1);
    mt_cpu_swiglu_backward(dg, du, c.a, c.b, c.r0, 30);
    e1 = fd_error(L_swiglu, &c, c.a, 30, dg, 30); e2 = fd_error(L_swiglu, &c, c.b, 30, du, 30);
    report("gradcheck swiglu (g, u)", e1 < GC_TOL && e2 < GC_TOL, "rel err %.2e %.2e", e1, e2);
    free(c.a); free(c.b); free(c.o0); free(c.r0); free(dg); free(du);

    /* router: both score functions, with and without renormalisation, with groups */
    for (int v = 0; v < 4; v++) {
        memset(&c, 0, sizeof c); c.N = 5; c.E = 8; c.topk = 3;
        c.sf = v & 1 ? MT_SCORE_SIGMOID : MT_SCORE_SOFTMAX; c.norm = (v >> 1) & 1; c.scale = v == 3 ? 2.5f : 1.0f;
        c.groups = v == 3 ? 4 : 1; c.limited = v == 3 ? 2 : 1;
        c.a = alloc_real(40); c.b = alloc_real(8); c.o0 = alloc_real(15); c.o1 = alloc_real(40); c.r0 = alloc_real(15);
        c.i0 = (int32_t *)calloc(15, 4); c.i1 = (int32_t *)calloc(8, 4);
        mt_real *dl = alloc_real(40);
        fill_normal(c.a, 40, 1); fill_normal(c.b, 8, 0.3); fill_normal(c.r0, 15, 1);
        L_router(&c);
        mt_cpu_router_backward(dl, c.o1, c.i0, c.o0, c.r0, c.N, c.E, c.topk, c.sf, c.norm, c.scale);
        e1 = fd_error(L_router, &c, c.a, 40, dl, 40);
        char nm[64];
        snprintf(nm, sizeof nm, "gradcheck router %s norm=%d groups=%d", c.sf ? "sigmoid" : "softmax", c.norm, c.groups);
        report(nm, e1 < GC_TOL, "rel err %.2e", e1);
        free(c.a); free(c.b); free(c.o0); free(c.o1); free(c.r0); free(c.i0); free(c.i1); free(dl);
    }

    /* permutation, grouped GEMM (with an empty expert), combine */
    {
        memset(&c, 0, sizeof c); c.N = 6; c.D = 5; c.topk = 2; c.E = 4;
        int64_t NK = 12;
        c.a = alloc_real(30); c.o0 = alloc_real(NK * 5); c.r0 = alloc_real(NK * 5);
        c.i0 = (int32_t *)calloc(NK, 4); c.i1 = (int32_t *)calloc(NK, 4); c.i2 = (int32_t *)calloc(5, 4);
        for (int i = 0; i < NK; i++) c.i0[i] = (i % 2) ? 3 : (i / 2) % 2;   /* expert 2 gets nothing */
        mt_real *dx = alloc_real(30);
        fill_normal(c.a, 30, 1); fill_normal(c.r0, NK * 5, 1);
        L_permute(&c);
        mt_cpu_moe_permute_backward(dx, c.r0, c.i1, c.N, c.D, c.topk);
        e1 = fd_error(L_permute, &c, c.a, 30, dx, 30);
        report("gradcheck moe permute", e1 < GC_TOL, "rel err %.2e", e1);
        /* grouped GEMM over the permuted rows, offsets from the permutation */
        gc m;
        memset(&m, 0, sizeof m); m.N = (int)NK; m.E = 4; m.M = 3; m.K = 5;
        m.a = alloc_real(NK * 5); m.b = alloc_real(4 * 3 * 5); m.o0 = alloc_real(NK * 3); m.r0 = alloc_real(NK * 3); m.i0 = c.i2;
        mt_real *gX = alloc_real(NK * 5), *gW = alloc_real(60);
        fill_normal(m.a, NK * 5, 1); fill_normal(m.b, 60, 1); fill_normal(m.r0, NK * 3, 1);
        for (int i = 0; i < 60; i++) gW[i] = (mt_real)NAN;   /* poisoned: the empty expert must be written */
        mt_cpu_gmm_dx(NULL, gX, m.r0, m.b, m.i0, 4, 3, 5);
        mt_cpu_gmm_dw(NULL, gW, m.r0, m.a, m.i0, 4, 3, 5);
        e1 = fd_error(L_gmm, &m, m.a, NK * 5, gX, 100); e2 = fd_error(L_gmm, &m, m.b, 60, gW, 100);
        int empty_zero = 1;
        for (int i = 2 * 15; i < 3 * 15; i++) empty_zero &= gW[i] == 0;
        report("gradcheck grouped GEMM (X, W; empty expert)", e1 < GC_TOL && e2 < GC_TOL && empty_zero && c.i2[3] == c.i2[2],
               "rel err %.2e %.2e, empty expert grad zero: %d", e1, e2, empty_zero);
        /* combine */
        gc k;
        memset(&k, 0, sizeof k); k.N = 6; k.D = 5; k.topk = 2;
        k.a = alloc_real(NK * 5); k.b = alloc_real(NK); k.o0 = alloc_real(30); k.r0 = alloc_real(30); k.i0 = c.i1;
        mt_real *gys = alloc_real(NK * 5), *gw = alloc_real(NK);
        fill_normal(k.a, NK * 5, 1); fill_normal(k.b, NK, 1); fill_normal(k.r0, 30, 1);
        mt_cpu_moe_combine_backward(gys, gw, k.r0, k.a, k.i0, k.b, k.N, k.D, k.topk);
        e1 = fd_error(L_combine, &k, k.a, NK * 5, gys, 100); e2 = fd_error(L_combine, &k, k.b, NK, gw, 100);
        report("gradcheck moe combine (ys, w)", e1 < GC_TOL && e2 < GC_TOL, "rel err %.2e %.2e", e1, e2);
        free(c.a); free(c.o0); free(c.r0); free(c.i0); free(c.i1); free(c.i2); free(dx);
        free(m.a); free(m.b); free(m.o0); free(m.r0); free(gX); free(gW);
        free(k.a); free(k.b); free(k.o0); free(k.r0); free(gys); free(gw);
    }

    /* cross-entropy */
    memset(&c, 0, sizeof c); c.N = 4; c.V = 7;
    c.a = alloc_real(28); c.o1 = alloc_real(4); c.i0 = (int32_t *)calloc(4, 4);
    mt_real *dl = alloc_real(28);
    fill_normal(c.a, 28, 2);
    for (int i = 0; i < 4; i++) c.i0[i] = (int32_t)(mt_rng_u64(&R) % 7);
    L_ce(&c);
    mt_cpu_cross_entropy_backward(NULL, dl, c.a, c.o1, c.i0, c.N, c.V);
    e1 = fd_error(L_ce, &c, c.a, 28, dl, 28);
    report("gradcheck cross-entropy", e1 < GC_TOL, "rel err %.2e", e1);
    free(c.a); free(c.o1); free(c.i0); free(dl);
}

/* whole model: analytic gradients from the train graph (lr = 0) against
 * central differences of the forward graph's loss, in float64 */
typedef struct { mt_runtime *fwd; int32_t *tok, *tgt; } model_ctx;
static double L_model(void *p) {
    model_ctx *m = (model_ctx *)p;
    mt_step_stats st;
    mt_err e;
    if (mt_runtime_step(m->fwd, m->tok, m->tgt, 0, NULL, &st, &e)) return NAN;
    return st.loss;
}
static void gradcheck_model(const char *name, const mt_config *cf) {
    mt_graph gt, gf;
    mt_err e;
    if (compile_cpu(&gt, cf, MT_GRAPH_TRAIN, 1, &e) || compile_cpu(&gf, cf, MT_GRAPH_FORWARD, 1, &e)) { report(name, 0, "%s", e.msg); return; }
    mt_runtime *rt = make_runtime(&gt, 1, 1, 7), *fw = make_runtime(&gf, 1, 1, 7);
    int64_t N = (int64_t)cf->batch * cf->seq_len;
    int32_t *tok = (int32_t *)malloc(4 * (size_t)N), *tgt = (int32_t *)malloc(4 * (size_t)N);
    make_batch(cf, 0, tok, tgt);
    mt_hparams hp;
    mt_hparams_default(&hp);
    hp.lr = 0; hp.weight_decay = 0; hp.grad_clip = 0; hp.warmup_steps = 0;
    /* a well-conditioned point: matrices with std 1/sqrt(fan_in) (so attention
     * and routing are far from uniform and every gradient is O(1)), norm
     * weights near 1, and a small random expert bias */
    for (int i = 0; i < gt.n_values; i++) {
        const mt_value *v = &gt.values[i];
        if (v->role != MT_ROLE_PARAM) continue;
        mt_real *x = (mt_real *)mt_runtime_value(rt, i);
        int64_t n = mt_value_numel_max(&gt, v);
        if (strstr(v->name, "e_score_correction_bias")) fill_normal(x, n, 0.1);
        else if (v->ndim == 1) for (int64_t j = 0; j < n; j++) x[j] = (mt_real)(1 + 0.2 * mt_rng_normal(&R));
        else fill_normal(x, n, 1.0 / sqrt((double)v->dims[v->ndim - 1]));
    }
    mt_step_stats st;
    if (!rt || !fw || mt_runtime_step(rt, tok, tgt, 0, &hp, &st, &e) || mt_runtime_copy_params(fw, rt, &e)) {
        report(name, 0, "setup failed");
        return;
    }
    model_ctx m = {fw, tok, tgt};
    double worst = 0;
    char worst_name[MT_NAME_LEN] = "";
    int checked = 0;
    for (int i = 0; i < gt.n_values; i++) {
        const mt_value *gv = &gt.values[i];
        if (gv->role != MT_ROLE_GRAD) continue;
        const mt_value *pv = &gt.values[gv->param];
        int fi = mt_graph_find(&gf, pv->name);
        mt_real *x = (mt_real *)mt_runtime_value(fw, fi);
        double err = fd_error(L_model, &m, x, mt_value_numel_max(&gt, pv), (const mt_real *)mt_runtime_value(rt, i), 6);
        checked++;
        if (!(err <= worst)) { worst = err; snprintf(worst_name, sizeof worst_name, "%s", pv->name); }
    }
    report(name, worst < 1e-6 && checked > 20, "%d params, worst rel err %.2e (%s)", checked, worst, worst_name);
    free(tok); free(tgt);
    mt_runtime_destroy(rt); mt_runtime_destroy(fw);
    mt_graph_free(&gt); mt_graph_free(&gf);
}

static void test_gradcheck_model(void) {
    mt_config c;
    small_config(&c);
    c.load_balance_coeff = 0;
    c.q_lora_rank = 12; c.score_func = MT_SCORE_SIGMOID; c.route_norm = 1; c.n_expert_groups = 2; c.n_limited_groups = 1;
    gradcheck_model("gradcheck whole model (sigmoid, q_lora, groups)", &c);
    small_config(&c);
    c.load_balance_coeff = 0;
    c.score_func = MT_SCORE_SOFTMAX; c.route_norm = 0; c.route_scale = 2.5f; c.rope_factor = 4; c.original_seq_len = 4;
    c.n_shared_experts = 0;
    gradcheck_model("gradcheck whole model (softmax, YaRN, no shared)", &c);
}

int main(void) {
    mt_rng_seed(&R, 42);
    test_gradcheck_ops();
    test_gradcheck_model();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

#else /* float32 tests */

/* Run n steps; losses[i] out. Returns 0 on success. */
static int run_steps(mt_runtime *rt, const mt_config *c, int step0, int n, double *losses, const mt_hparams *hp) {
    int64_t N = (int64_t)c->batch * c->seq_len;
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)N), *tgt = (int32_t *)malloc(sizeof(int32_t) * (size_t)N);
    mt_err e;
    int rc = 0;
    for (int s = 0; s < n && !rc; s++) {
        mt_step_stats st;
        make_batch(c, step0 + s, tok, tgt);
        if (mt_runtime_step(rt, tok, tgt, step0 + s, hp, &st, &e)) { printf("  step: %s\n", e.msg); rc = -1; }
        else losses[s] = st.loss;
    }
    free(tok); free(tgt);
    return rc;
}

static int bitwise_equal(const double *a, const double *b, int n) { return memcmp(a, b, sizeof(double) * (size_t)n) == 0; }


/* ======================================================================
 * config, counts, graph
 * ==================================================================== */

static void test_presets(void) {
    const char *names[] = {"tiny", "debug", "mid", "16b"};
    int ok = 1;
    mt_err e;
    for (int i = 0; i < 4; i++) {
        mt_config c;
        ok &= mt_config_preset(&c, names[i], &e) == 0 && mt_config_validate(&c, &e) == 0;
    }
    mt_config c;
    ok &= mt_config_preset(&c, "nope", &e) != 0 && strstr(e.msg, "unknown preset") != NULL;
    report("presets validate, unknown preset refused", ok, NULL);

    mt_config_preset(&c, "debug", &e);
    mt_param_count pc;
    mt_count_params(&c, &pc);
    double f = mt_flops_per_token(&c);
    mt_config m;
    mt_config_preset(&m, "mid", &e);
    double fm = mt_flops_per_token(&m);
    report("torchtitan FLOPs/token: debug and mid", pc.total == 33014016 && f == 542934528.0 && fm == 6241357824.0,
           "debug %lld params, %.0f FLOPs/token; mid %.0f", (long long)pc.total, f, fm);

    mt_config_preset(&c, "tiny", &e);
    int rc1 = mt_config_set(&c, "top-k", "3", &e), rc2 = mt_config_set(&c, "score_func", "sigmoid", &e);
    int rc3 = mt_config_set(&c, "dim", "abc", &e), rc4 = mt_config_set(&c, "nonsense", "1", &e);
    c.top_k = 99;
    int rc5 = mt_config_validate(&c, &e);
    report("config overrides and validation", !rc1 && !rc2 && rc3 && rc4 && rc5 && strstr(e.msg, "top_k"), "%s", e.msg);
}

static void test_graph_structure(void) {
    mt_config c;
    mt_err e;
    mt_graph g;
    mt_config_preset(&c, "tiny", &e);
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("graph builds", 0, "%s", e.msg); return; }
    int bad = 0, ep = 0, dp = 0, adamw = 0, bias = 0, sym_ep = 0;
    for (int i = 0; i < g.n_nodes; i++) {
        const mt_node *n = &g.nodes[i];
        if (mt_check_node(&g, n, &e)) bad++;
        if (n->queue == MT_Q_EP) { ep++; if (n->sym_mask && !strcmp(g.syms[n->iattr[4]].name, "coord.ep")) sym_ep++; }
        if (n->queue == MT_Q_DP) dp++;
        adamw += n->op == MT_OP_ADAMW;
        bias += n->op == MT_OP_EXPERT_BIAS_UPDATE;
    }
    int n_trainable = 0;
    for (int i = 0; i < g.n_values; i++) n_trainable += g.values[i].role == MT_ROLE_GRAD;
    /* 2 MoE layers: counts + dispatch + combine forward, dispatch + combine backward */
    report("graph: forward, backward, optimizer, collectives", !bad && ep == 10 && sym_ep == 10 && adamw == n_trainable &&
           bias == 2 && dp == n_trainable + 1 + 2 && g.n_forward_nodes > 0 && g.n_forward_nodes < g.n_nodes,
           "%d nodes (%d forward), %d EP, %d DP collectives, %d AdamW", g.n_nodes, g.n_forward_nodes, ep, dp, adamw);
    /* a node with a wrong shape is refused by the check the loader runs */
    mt_node n = g.nodes[5];
    int was = n.op;
    n.out[0] = n.in[0] == 0 ? 1 : 0;
    int refused = mt_check_node(&g, &n, &e) != 0;
    report("node shape check refuses a miswired node", refused, "%s: %s", mt_ops[was].name, e.msg);
    mt_graph_free(&g);

    /* precompiling for a larger mesh: coordinates are symbols, never literals */
    mt_mesh m;
    mt_target t;
    mt_passes p;
    mt_target_cpu(&t);
    mt_passes_all(&p);
    mt_mesh_init(&m, 1, 4, 1, 4, &e);
    int ok = mt_compile(&g, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) == 0;
    if (ok) {
        ok = g.syms[3].max == 3 && !strcmp(g.syms[3].name, "coord.ep");
        for (int i = 0; i < g.n_nodes; i++) {
            const mt_node *x = &g.nodes[i];
            if (x->op == MT_OP_EP_DISPATCH) ok &= (x->sym_mask >> 4 & 1) && x->iattr[2] == 4 && x->iattr[3] == 2;
        }
        mt_graph_free(&g);
    }
    report("ep=4 graph: coordinate symbols, 2 local experts", ok, "%s", ok ? "" : e.msg);
}

/* ======================================================================
 * memory planning
 * ==================================================================== */

static void test_memory_plan(void) {
    mt_err e;
    const char *presets[] = {"tiny", "debug"};
    for (int i = 0; i < 2; i++) {
        mt_config c;
        mt_graph g;
        mt_config_preset(&c, presets[i], &e);
        if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("memory plan", 0, "%s", e.msg); continue; }
        int ok = mt_plan_check(&g, &e) == 0 && g.arena_bytes < g.naive_arena_bytes && g.planned;
        char nm[64];
        snprintf(nm, sizeof nm, "memory plan %s: no live overlap, smaller", presets[i]);
        report(nm, ok, "arena %.1f MiB vs naive %.1f MiB (%.1f%% saved)%s%s", g.arena_bytes / 1048576.0,
               g.naive_arena_bytes / 1048576.0, 100.0 * (1 - (double)g.arena_bytes / (double)g.naive_arena_bytes), ok ? "" : ": ",
               ok ? "" : e.msg);
        if (i == 0) {   /* the check can fail: force two values that are alive together onto one offset */
            int a = -1, b = -1;
            for (int n = 0; n < g.n_nodes && b < 0; n++) {
                const mt_node *x = &g.nodes[n];
                if (x->op == MT_OP_RMSNORM) { a = x->out[0]; b = x->out[1]; }
            }
            g.values[b].offset = g.values[a].offset;
            int caught = mt_plan_check(&g, &e) != 0 && strstr(e.msg, "overlap");
            report("memory plan check detects an overlap", caught, "%s", e.msg);
        }
        mt_graph_free(&g);
    }
}

/* ======================================================================
 * bitwise reproducibility
 * ==================================================================== */

static void test_bitwise(void) {
    mt_config c;
    mt_err e;
    mt_graph planned, eager;
    mt_config_preset(&c, "tiny", &e);
    c.batch = 4; c.seq_len = 32;
    mt_hparams hp;
    mt_hparams_default(&hp);
    enum { S = 6 };
    double a[S] = {0}, b[S] = {0}, d[S] = {0}, f[S] = {0}, p[S] = {0}, q[S] = {0};
    if (compile_cpu(&planned, &c, MT_GRAPH_TRAIN, 1, &e) || compile_cpu(&eager, &c, MT_GRAPH_TRAIN, 0, &e)) { report("bitwise", 0, "%s", e.msg); return; }
    mt_runtime *r1 = make_runtime(&planned, 1, 0, 3), *r2 = make_runtime(&planned, 1, 0, 3), *r3 = make_runtime(&planned, 2, 0, 3);
    mt_runtime *r4 = make_runtime(&eager, 2, 0, 3), *r5 = make_runtime(&planned, 2, 1, 3);
    int ok = r1 && r2 && r3 && r4 && r5 && !run_steps(r1, &c, 0, S, a, &hp) && !run_steps(r2, &c, 0, S, b, &hp) &&
             !run_steps(r3, &c, 0, S, d, &hp) && !run_steps(r4, &c, 0, S, f, &hp) && !run_steps(r5, &c, 0, S, p, &hp);
    report("same seed twice: bitwise-identical losses", ok && bitwise_equal(a, b, S), "loss %.7f -> %.7f", a[0], a[S - 1]);
    report("1 thread vs 2 threads: bitwise identical", ok && bitwise_equal(a, d, S), NULL);
    report("eager (naive memory) vs planned: bitwise identical", ok && bitwise_equal(a, f, S), NULL);
    report("arena poisoned with NaN before each step: identical", ok && bitwise_equal(a, p, S), "no value read before written");
    /* weights too, not only losses */
    int wsame = 1;
    for (int i = 0; ok && i < planned.n_values; i++)
        if (planned.values[i].role == MT_ROLE_PARAM)
            wsame &= !memcmp(mt_runtime_value(r1, i), mt_runtime_value(r2, i), (size_t)planned.values[i].nbytes);
    report("same seed twice: bitwise-identical weights", ok && wsame, NULL);

    /* precompiled artifact (written, read back) vs in-process compile */
    uint8_t *bytes = NULL, *bytes2 = NULL;
    size_t len = 0, len2 = 0;
    mt_graph loaded, again;
    int ok2 = mt_artifact_write(&planned, &bytes, &len, &e) == 0 && mt_artifact_read(&loaded, bytes, len, &e) == 0;
    if (ok2) {
        mt_runtime *r6 = make_runtime(&loaded, 2, 0, 3);
        ok2 = r6 && !run_steps(r6, &c, 0, S, q, &hp) && bitwise_equal(a, q, S);
        mt_runtime_destroy(r6);
        ok2 &= mt_artifact_write(&loaded, &bytes2, &len2, &e) == 0 && len2 == len && !memcmp(bytes, bytes2, len);
        mt_graph_free(&loaded);
    }
    report("artifact round trip: same bytes, bitwise losses", ok2, "%zu bytes%s%s", len, ok2 ? "" : ": ", ok2 ? "" : e.msg);
    free(bytes2);
    int same_again = compile_cpu(&again, &c, MT_GRAPH_TRAIN, 1, &e) == 0;
    if (same_again) {
        same_again = mt_artifact_write(&again, &bytes2, &len2, &e) == 0 && len2 == len && !memcmp(bytes, bytes2, len);
        free(bytes2);
        mt_graph_free(&again);
    }
    report("compiling twice gives byte-identical artifacts", same_again, NULL);
    free(bytes);
    mt_runtime_destroy(r1); mt_runtime_destroy(r2); mt_runtime_destroy(r3); mt_runtime_destroy(r4); mt_runtime_destroy(r5);
    mt_graph_free(&planned); mt_graph_free(&eager);
}

/* ======================================================================
 * artifact validation and fuzzing
 * ==================================================================== */

static uint64_t rd64(const uint8_t *p) { uint64_t x = 0; for (int i = 0; i < 8; i++) x |= (uint64_t)p[i] << (8 * i); return x; }
static void wr64(uint8_t *p, uint64_t x) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(x >> (8 * i)); }
/* recompute every checksum, so that semantic validation is what is tested */
static void fix_checksums(uint8_t *b, size_t len) {
    (void)len;
    uint32_t ns = b[12] | b[13] << 8 | b[14] << 16 | (uint32_t)b[15] << 24;
    size_t hdr = 24 + 32 * (size_t)ns + 8;
    for (uint32_t i = 0; i < ns; i++) {
        uint8_t *ent = b + 24 + 32 * i;
        uint64_t off = rd64(ent + 8), l = rd64(ent + 16);
        wr64(ent + 24, mt_hash(b + off, (size_t)l, MT_HASH_INIT));
    }
    wr64(b + hdr - 8, mt_hash(b, hdr - 8, MT_HASH_INIT));
}

static void test_artifact_rejects(void) {
    mt_config c;
    mt_err e;
    mt_graph g, out;
    mt_config_preset(&c, "tiny", &e);
    c.batch = 2; c.seq_len = 16; c.original_seq_len = 16;
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("artifact", 0, "%s", e.msg); return; }
    uint8_t *good;
    size_t len;
    mt_artifact_write(&g, &good, &len, &e);
    uint8_t *b = (uint8_t *)malloc(len);
    uint32_t ns = 9;
    size_t hdr = 24 + 32 * ns + 8;

    /* truncated at every section boundary (and one byte either side) */
    int trunc_ok = 1, trunc_n = 0;
    char last[1100] = "";
    for (uint32_t i = 0; i <= ns; i++) {
        size_t at = i < ns ? (size_t)rd64(good + 24 + 32 * i + 8) : len;
        for (int d = -1; d <= 1; d++) {
            size_t cut = at + (size_t)d;
            if (cut >= len || (d == 1 && i == ns)) continue;
            trunc_n++;
            if (mt_artifact_read(&out, good, cut, &e) == 0 || !e.msg[0]) { trunc_ok = 0; mt_graph_free(&out); }
            else snprintf(last, sizeof last, "%s", e.msg);
        }
    }
    for (size_t cut = 0; cut < hdr; cut++) {
        trunc_n++;
        if (mt_artifact_read(&out, good, cut, &e) == 0) { trunc_ok = 0; mt_graph_free(&out); }
    }
    report("artifact truncated anywhere: refused", trunc_ok, "%d cuts; e.g. \"%s\"", trunc_n, last);

    /* single-byte flips: every byte of the header, and a stride through the body */
    int flip_ok = 1, flips = 0;
    for (size_t i = 0; i < len; i += (i < hdr ? 1 : 61)) {
        memcpy(b, good, len);
        b[i] ^= (uint8_t)(1u << (i % 8));
        flips++;
        if (mt_artifact_read(&out, b, len, &e) == 0) { flip_ok = 0; mt_graph_free(&out); printf("  flip at %zu accepted\n", i); }
    }
    report("artifact byte flips: refused (checksums)", flip_ok, "%d flips of %zu bytes", flips, len);

    /* another format version */
    memcpy(b, good, len);
    b[8] = 99;
    fix_checksums(b, len);
    int v = mt_artifact_read(&out, b, len, &e) != 0 && strstr(e.msg, "format version 99");
    report("artifact of another format version: refused", v, "%s", e.msg);

    /* another fingerprint: a config field changed, checksums made consistent */
    memcpy(b, good, len);
    size_t cfg_off = (size_t)rd64(b + 24 + 8);
    /* config section: backend, real bytes, arch[16], kind, count (32 bytes),
     * then per field name[32], type, value: change load_balance_coeff's last bit */
    size_t lb_value = cfg_off + 32 + (size_t)(mt_n_config_fields - 1) * 40 + 36;
    b[lb_value] ^= 0x01;
    fix_checksums(b, len);
    int fp = mt_artifact_read(&out, b, len, &e) != 0 && strstr(e.msg, "fingerprint mismatch");
    report("artifact with another fingerprint: refused", fp, "%.120s...", e.msg);

    /* not an artifact at all */
    int magic = mt_artifact_read(&out, (const uint8_t *)"hello world, this is not a graph", 32, &e) != 0 && strstr(e.msg, "magic");
    report("non-artifact file: refused", magic, "%s", e.msg);

    /* semantic fuzzing: random field mutations with valid checksums never crash */
    int survived = 0, accepted = 0;
    mt_rng r;
    mt_rng_seed(&r, 99);
    for (int it = 0; it < 3000; it++) {
        memcpy(b, good, len);
        int nmut = 1 + (int)(mt_rng_u64(&r) % 3);
        for (int k = 0; k < nmut; k++) {
            size_t at = hdr + (size_t)(mt_rng_u64(&r) % (len - hdr));
            uint64_t kind = mt_rng_u64(&r) % 4;
            if (kind == 0) b[at] ^= (uint8_t)(1u << (mt_rng_u64(&r) % 8));
            else if (kind == 1) b[at] = 0xff;
            else if (kind == 2) b[at] = 0;
            else b[at] = (uint8_t)(b[at] + 1);
        }
        fix_checksums(b, len);
        if (mt_artifact_read(&out, b, len, &e) == 0) {
            accepted++;   /* a benign change: it must then also run without crashing */
            if (accepted <= 20) {
                mt_runtime *rt = make_runtime(&out, 1, 1, 1);
                if (rt) {
                    double l;
                    mt_hparams hp;
                    mt_hparams_default(&hp);
                    run_steps(rt, &out.cfg, 0, 1, &l, &hp);
                    mt_runtime_destroy(rt);
                }
            }
            mt_graph_free(&out);
        }
        survived++;
    }
    report("artifact fuzzing (valid checksums): no crash", survived == 3000, "%d mutants, %d accepted as benign", survived, accepted);
    free(b); free(good);
    mt_graph_free(&g);
}

/* ======================================================================
 * MoE edge cases and the expert-bias update
 * ==================================================================== */

static void test_moe_edge_cases(void) {
    mt_err e;
    /* op level: all tokens routed to one expert equals that expert applied densely */
    int N = 6, D = 4, E = 4, F = 3;
    mt_real logits[24], bias[4] = {0, 0, 10, 0}, w[6], scores[24], x[24], xs[24], g[18], u[18], h[18], yr[24], y[24];
    int32_t idx[6], counts[4], slot[6], offs[5];
    mt_real Wg[48], Wu[48], Wd[48];
    fill_normal(logits, 24, 1); fill_normal(x, 24, 1); fill_normal(Wg, 48, 1); fill_normal(Wu, 48, 1); fill_normal(Wd, 48, 1);
    mt_cpu_router_forward(idx, w, scores, counts, logits, bias, N, E, 1, MT_SCORE_SIGMOID, 0, 1.0f, 1, 1);
    int all_one = counts[2] == N && counts[0] == 0 && counts[1] == 0 && counts[3] == 0;
    mt_cpu_moe_permute(xs, slot, offs, x, idx, N, D, 1, E);
    mt_cpu_gmm(NULL, g, xs, Wg, offs, E, F, D);
    mt_cpu_gmm(NULL, u, xs, Wu, offs, E, F, D);
    mt_cpu_swiglu_forward(h, g, u, (int64_t)N * F);
    mt_cpu_gmm(NULL, yr, h, Wd, offs, E, D, F);
    mt_cpu_moe_combine_forward(y, yr, slot, w, N, D, 1);
    double maxerr = 0;
    for (int n = 0; n < N; n++) {   /* dense reference with expert 2's weights */
        mt_real gg[3], uu[3], hh[3];
        for (int f = 0; f < F; f++) {
            gg[f] = uu[f] = 0;
            for (int d = 0; d < D; d++) { gg[f] += x[n * D + d] * Wg[2 * 12 + f * D + d]; uu[f] += x[n * D + d] * Wu[2 * 12 + f * D + d]; }
            hh[f] = gg[f] / (1 + expf(-gg[f])) * uu[f];
        }
        for (int d = 0; d < D; d++) {
            mt_real o = 0;
            for (int f = 0; f < F; f++) o += hh[f] * Wd[2 * 12 + d * F + f];
            double err = fabs((double)(w[n] * o - y[n * D + d]));
            if (err > maxerr) maxerr = err;
        }
    }
    report("all tokens to one expert = that expert, dense", all_one && maxerr < 1e-5, "max err %.2e, counts %d %d %d %d", maxerr,
           counts[0], counts[1], counts[2], counts[3]);

    /* whole training step with six of eight experts receiving zero tokens */
    mt_config c;
    mt_graph gr;
    mt_config_preset(&c, "tiny", &e);
    c.batch = 2; c.seq_len = 16; c.load_balance_coeff = 0.001f;
    if (compile_cpu(&gr, &c, MT_GRAPH_TRAIN, 1, &e)) { report("zero-token experts", 0, "%s", e.msg); return; }
    mt_runtime *rt = make_runtime(&gr, 2, 1, 5);
    for (int i = 0; i < gr.n_values; i++)
        if (strstr(gr.values[i].name, "e_score_correction_bias")) {
            mt_real *bb = (mt_real *)mt_runtime_value(rt, i);
            bb[0] = 10; bb[5] = 10;
        }
    mt_hparams hp;
    mt_hparams_default(&hp);
    double loss;
    int ok = rt && run_steps(rt, &c, 0, 1, &loss, &hp) == 0 && isfinite(loss);
    int32_t cnt[8];
    int n_moe = mt_runtime_n_moe_layers(rt), counts_ok = 1;
    for (int l = 0; l < n_moe; l++) {
        mt_runtime_expert_counts(rt, l, cnt);
        int sum = 0;
        for (int k = 0; k < 8; k++) sum += cnt[k];
        counts_ok &= cnt[0] == 32 && cnt[5] == 32 && sum == 64;   /* each token counted once per choice, not twice */
    }
    int grads_ok = 1, checked = 0;
    for (int i = 0; i < gr.n_values; i++) {
        const mt_value *v = &gr.values[i];
        if (v->role != MT_ROLE_GRAD || !(gr.values[v->param].flags & MT_VF_EXPERTS)) continue;
        const mt_real *gp = (const mt_real *)mt_runtime_value(rt, i);
        int64_t per = mt_value_numel_max(&gr, v) / v->dims[0];
        for (int ex = 0; ex < 8; ex++) {
            double s = 0;
            for (int64_t j = 0; j < per; j++) s += fabs((double)gp[ex * per + j]);
            if ((ex == 0 || ex == 5) ? !(s > 0) : s != 0) grads_ok = 0;
            if (!isfinite(s)) grads_ok = 0;
        }
        checked++;
    }
    report("zero-token experts: finite loss, exact-zero grads", ok && counts_ok && grads_ok && checked == 6,
           "loss %.4f, counts per layer sum to N*K, %d expert grads checked", loss, checked);
    /* the bias moved against the load: overloaded experts down, idle ones up */
    int moved = 1;
    for (int i = 0; i < gr.n_values; i++)
        if (strstr(gr.values[i].name, "e_score_correction_bias")) {
            const mt_real *bb = (const mt_real *)mt_runtime_value(rt, i);
            moved &= bb[0] < 10 && bb[5] < 10 && bb[1] > 0 && bb[7] > 0;
        }
    report("expert-bias update after a step moves against load", moved, NULL);
    mt_runtime_destroy(rt);
    mt_graph_free(&gr);

    /* the update rule itself */
    mt_real bb[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    int32_t cc[4] = {10, 0, 5, 5};
    mt_cpu_expert_bias_update(bb, cc, 4, 0.25f);
    double sum = bb[0] + bb[1] + bb[2] + bb[3];
    report("expert-bias update: direction and centring", bb[0] < 0.5f && bb[1] > 0.5f && bb[2] == 0.5f && fabs(sum - 2.0) < 1e-6,
           "%.3f %.3f %.3f %.3f", bb[0], bb[1], bb[2], bb[3]);
}

/* ======================================================================
 * checkpoints
 * ==================================================================== */

static void test_checkpoint(void) {
    mt_config c, c2;
    mt_err e;
    mt_graph g;
    mt_config_preset(&c, "tiny", &e);
    c.batch = 2; c.seq_len = 16; c.q_lora_rank = 16;
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("checkpoint", 0, "%s", e.msg); return; }
    mt_hparams hp;
    mt_hparams_default(&hp);
    double straight[6], resumed[6];
    mt_runtime *a = make_runtime(&g, 2, 0, 11), *b = make_runtime(&g, 2, 0, 999);
    int ok = a && b && run_steps(a, &c, 0, 3, straight, &hp) == 0;
    const char *dir = "/tmp/moetrain_test_ckpt";
    ok &= mt_checkpoint_save(a, dir, 3, &e) == 0;
    int step = -1;
    ok &= mt_checkpoint_read_config(dir, &c2, &e) == 0 && mt_config_equal(&c, &c2);
    ok &= mt_checkpoint_load(b, dir, &step, &e) == 0 && step == 3;
    int same = 1;
    for (int i = 0; ok && i < g.n_values; i++)
        if (g.values[i].role == MT_ROLE_PARAM || g.values[i].role == MT_ROLE_OPT)
            same &= !memcmp(mt_runtime_value(a, i), mt_runtime_value(b, i), (size_t)g.values[i].nbytes);
    report("safetensors round trip: weights and moments bitwise", ok && same, "%s", ok ? "" : e.msg);
    ok &= run_steps(a, &c, 3, 3, straight + 3, &hp) == 0 && run_steps(b, &c, 3, 3, resumed + 3, &hp) == 0;
    report("resume from checkpoint = uninterrupted run", ok && bitwise_equal(straight + 3, resumed + 3, 3), NULL);

    /* Hugging Face names and per-expert tensors are what is on disk */
    mt__st s;
    int names = mt__st_open(&s, "/tmp/moetrain_test_ckpt/model.safetensors", &e) == 0;
    if (names) {
        names = mt__st_find(&s, "model.layers.1.mlp.experts.7.down_proj.weight") &&
                mt__st_find(&s, "model.layers.2.self_attn.kv_a_proj_with_mqa.weight") &&
                mt__st_find(&s, "model.layers.1.mlp.gate.e_score_correction_bias") &&
                mt__st_find(&s, "model.layers.0.self_attn.q_a_layernorm.weight") &&
                mt__st_find(&s, "lm_head.weight") && !mt__st_find(&s, "model.layers.1.mlp.experts.*.down_proj.weight");
        const mt__st_t *t = mt__st_find(&s, "model.layers.1.mlp.experts.7.down_proj.weight");
        names &= t && t->ndim == 2 && t->shape[0] == 64 && t->shape[1] == 48;
        mt__st_free(&s);
    }
    report("checkpoint uses Hugging Face names and layouts", names, NULL);

    /* a damaged or mismatched checkpoint is refused, the runtime untouched */
    uint8_t *bytes;
    size_t len;
    mt_read_file("/tmp/moetrain_test_ckpt/model.safetensors", &bytes, &len, &e);
    FILE *f = fopen("/tmp/moetrain_test_bad.safetensors", "wb");
    fwrite(bytes, 1, len / 2, f);
    fclose(f);
    int r1 = mt_checkpoint_load(b, "/tmp/moetrain_test_bad.safetensors", NULL, &e) != 0;
    char m1[256];
    snprintf(m1, sizeof m1, "%s", e.msg);
    bytes[20] = '{';   /* break the JSON */
    f = fopen("/tmp/moetrain_test_bad.safetensors", "wb");
    fwrite(bytes, 1, len, f);
    fclose(f);
    int r2 = mt_checkpoint_load(b, "/tmp/moetrain_test_bad.safetensors", NULL, &e) != 0;
    free(bytes);
    mt_config c3 = c;
    c3.dim = 96;
    mt_graph g3;
    compile_cpu(&g3, &c3, MT_GRAPH_TRAIN, 1, &e);
    mt_runtime *d = make_runtime(&g3, 1, 0, 1);
    int r3 = d && mt_checkpoint_load(d, dir, NULL, &e) != 0 && strstr(e.msg, "shape");
    report("bad checkpoints refused with a reason", r1 && r2 && r3, "%s | %s", m1, e.msg);
    mt_runtime_destroy(d);
    mt_graph_free(&g3);
    remove("/tmp/moetrain_test_bad.safetensors");
    mt_runtime_destroy(a); mt_runtime_destroy(b);
    mt_graph_free(&g);
}

/* ======================================================================
 * data, schedule, training
 * ==================================================================== */

static void test_data(void) {
    mt_err e;
    const char *p = "/tmp/moetrain_test.bin";
    int32_t hdr[256];
    memset(hdr, 0, sizeof hdr);
    hdr[0] = 20240520; hdr[1] = 1; hdr[2] = 5;
    uint16_t toks[5] = {1, 50000, 3, 4, 65535};
    FILE *f = fopen(p, "wb");
    fwrite(hdr, 4, 256, f);
    fwrite(toks, 2, 5, f);
    fclose(f);
    mt_dataset d;
    int ok = mt_data_load(&d, p, &e) == 0 && d.n == 5 && d.tokens[1] == 50000 && d.max_token == 65535;
    mt_data_free(&d);
    hdr[2] = 6;   /* header disagrees with the file */
    f = fopen(p, "wb");
    fwrite(hdr, 4, 256, f);
    fwrite(toks, 2, 5, f);
    fclose(f);
    int bad = mt_data_load(&d, p, &e) != 0 && strstr(e.msg, "header says");
    f = fopen(p, "wb");
    fputs("hello", f);
    fclose(f);
    int raw = mt_data_load(&d, p, &e) == 0 && d.n == 5 && d.tokens[0] == 'h';
    int32_t tk[8], tg[8];
    mt_rng r;
    mt_rng_seed(&r, 1);
    int small = raw && mt_data_batch(&d, &r, 1, 8, tk, tg, &e) != 0;
    mt_data_free(&d);
    remove(p);
    report("data: llm.c shard, raw bytes, bad header", ok && bad && raw && small, NULL);
    int def = mt_data_default(&d, &e) == 0 && d.n > 100000 && d.max_token < 128;
    mt_data_free(&d);
    report("embedded default corpus", def, NULL);

    float hp[MT_HP_COUNT];
    mt_hparams h;
    mt_hparams_default(&h);
    h.lr = 1; h.warmup_steps = 10; h.decay_steps = 110; h.min_lr_ratio = 0.1f;
    mt_hparams_pack(&h, hp);
    double l0 = mt_lr_at(hp, 0), l9 = mt_lr_at(hp, 9), l60 = mt_lr_at(hp, 60), l110 = mt_lr_at(hp, 110);
    report("lr schedule: warmup, cosine, floor", fabs(l0 - 0.1) < 1e-9 && l9 == 1 && fabs(l60 - 0.55) < 1e-9 && fabs(l110 - 0.1) < 1e-7,
           "%.3f %.3f %.3f %.3f", l0, l9, l60, l110);
}

static void test_training_falls(void) {
    mt_config c;
    mt_err e;
    mt_graph g;
    mt_config_preset(&c, "tiny", &e);
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("training", 0, "%s", e.msg); return; }
    mt_runtime *rt = make_runtime(&g, 0, 0, 1);
    mt_dataset d;
    mt_data_default(&d, &e);
    mt_hparams hp;
    mt_hparams_default(&hp);
    hp.decay_steps = 60;
    int64_t N = (int64_t)c.batch * c.seq_len;
    int32_t *tok = (int32_t *)malloc(4 * (size_t)N), *tgt = (int32_t *)malloc(4 * (size_t)N);
    mt_rng r;
    mt_rng_seed(&r, 5);
    double first = 0, last = 0;
    int ok = rt != NULL;
    for (int s = 0; s < 60 && ok; s++) {
        mt_step_stats st = {0, 0, 0, 0};
        ok = mt_data_batch(&d, &r, c.batch, c.seq_len, tok, tgt, &e) == 0 && mt_runtime_step(rt, tok, tgt, s, &hp, &st, &e) == 0;
        if (s == 0) first = st.loss;
        last = st.loss;
    }
    report("tiny trains: loss falls well below uniform", ok && first > 5 && last < 2.8, "loss %.3f -> %.3f in 60 steps (uniform %.3f)",
           first, last, log(256.0));
    free(tok); free(tgt);
    mt_data_free(&d);
    mt_runtime_destroy(rt);
    mt_graph_free(&g);
}

/* ======================================================================
 * the command-line tools
 * ==================================================================== */

static int run_cmd(const char *cmd, char *out, size_t cap) {
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    if (!WIFEXITED(st)) return 1000;   /* killed by a signal */
    return WEXITSTATUS(st);
}
static void keep_loss_lines(char *s) {   /* keep only "step N | loss X" */
    char *w = s, *line = s;
    while (*line) {
        char *nl = strchr(line, '\n');
        size_t n = nl ? (size_t)(nl - line + 1) : strlen(line);
        if (!strncmp(line, "step ", 5)) {
            char *bar = strstr(line, "| grad_norm");
            size_t keep = bar ? (size_t)(bar - line) : n;
            memmove(w, line, keep);
            w += keep;
            *w++ = '\n';
        }
        line += n;
    }
    *w = 0;
}

static void test_cli(void) {
    static char a[65536], b[65536], c[4 << 20];
    int ra = run_cmd("./precompile --preset tiny -o /tmp/moetrain_cli.mtg 2>&1 && ./train --graph /tmp/moetrain_cli.mtg --steps 8 --seed 1 2>&1", a, sizeof a);
    int rb = run_cmd("./train --preset tiny --steps 8 --seed 1 2>&1", b, sizeof b);
    keep_loss_lines(a); keep_loss_lines(b);
    report("CLI: precompile + train --graph = in-process", ra == 0 && rb == 0 && strlen(a) > 50 && !strcmp(a, b), "%s",
           ra || rb ? "a command failed" : "");
    int rd = run_cmd("./precompile --dump /tmp/moetrain_cli.mtg 2>&1", c, sizeof c);
    report("CLI: precompile --dump prints the plan", rd == 0 && strstr(c, "== nodes") && strstr(c, "== memory plan") &&
           strstr(c, "== collectives") && strstr(c, "ep_recv_tokens"), NULL);
    /* a corrupted artifact: non-zero exit, no signal, a message naming the problem */
    uint8_t *bytes;
    size_t len;
    mt_err e;
    mt_read_file("/tmp/moetrain_cli.mtg", &bytes, &len, &e);
    bytes[len / 2] ^= 0x10;
    FILE *f = fopen("/tmp/moetrain_cli_bad.mtg", "wb");
    fwrite(bytes, 1, len, f);
    fclose(f);
    free(bytes);
    int rc = run_cmd("./train --graph /tmp/moetrain_cli_bad.mtg --steps 1 2>&1", c, sizeof c);
    report("CLI: corrupted artifact -> clean refusal", rc != 0 && rc != 1000 && strstr(c, "checksum mismatch"), "exit %d: %.100s", rc, c);
    rc = run_cmd("./train --steps x 2>&1", c, sizeof c);
    int rc2 = run_cmd("./train --preset tiny --top-k 99 --steps 1 2>&1", b, sizeof b);
    int rc3 = run_cmd("./train --data /nonexistent --steps 1 2>&1", a, sizeof a);
    report("CLI: bad flags and files refused", rc == 2 && rc2 == 2 && rc3 == 1 && strstr(b, "top_k") && strstr(a, "cannot open"),
           "%d %d %d", rc, rc2, rc3);
    f = fopen("/tmp/moetrain_cli_data.bin", "wb");
    for (int i = 0; i < 300; i++) fputc(i & 255, f);
    fclose(f);
    rc = run_cmd("./train --data /tmp/moetrain_cli_data.bin --vocab-size 200 --steps 1 2>&1", a, sizeof a);
    report("CLI: token beyond vocabulary refused", rc == 1 && strstr(a, "vocabulary"), "%.100s", a);
    remove("/tmp/moetrain_cli.mtg"); remove("/tmp/moetrain_cli_bad.mtg"); remove("/tmp/moetrain_cli_data.bin");
}

int main(void) {
    mt_rng_seed(&R, 42);
    test_presets();
    test_graph_structure();
    test_memory_plan();
    test_bitwise();
    test_artifact_rejects();
    test_moe_edge_cases();
    test_checkpoint();
    test_data();
    test_training_falls();
    test_cli();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
#endif
