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
#include <float.h>
#include <string.h>
#include <dirent.h>
#include <signal.h>
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
static inline int bitwise_equal(const double *a, const double *b, int n) { return memcmp(a, b, sizeof(double) * (size_t)n) == 0; }
static inline void fill_normal(mt_real *x, int64_t n, double scale) { for (int64_t i = 0; i < n; i++) x[i] = (mt_real)(scale * mt_rng_normal(&R)); }


static int moe_chunks = 1;   /* mt_passes.moe_chunks of the graphs compile_cpu, mr_compile_mesh and ov_compile_mesh make */
#if !MT_TEST_GPU
/* moments: the AdamW moments' dtype (MT_F32 or MT_BF16) */
static int compile_cpu_moments(mt_graph *g, const mt_config *c, int kind, int planned, int moments, mt_err *err) {
    mt_mesh m;
    mt_target t;
    mt_passes p;
    mt_mesh_single(&m);
    mt_target_cpu(&t);
    if (planned) mt_passes_all(&p); else mt_passes_none(&p);
    p.moments = moments; p.moe_chunks = moe_chunks;
    return mt_compile(g, c, &m, &t, kind, &p, err);
}
static int compile_cpu(mt_graph *g, const mt_config *c, int kind, int planned, mt_err *err) {
    return compile_cpu_moments(g, c, kind, planned, MT_F32, err);
}
/* A value read as reals: bf16 (AdamW moments) widened exactly. */
static int read_reals(mt_runtime *rt, int v, mt_real *out, mt_err *e) {
    const mt_value *x = &mt_runtime_graph(rt)->values[v];
    if (x->dtype != MT_BF16) return mt_runtime_read(rt, v, out, e);
    int64_t n = mt_value_numel_max(mt_runtime_graph(rt), x);
    uint16_t *h = (uint16_t *)malloc(2 * (size_t)n + 2);
    int rc = mt_runtime_read(rt, v, h, e);
    for (int64_t k = 0; k < n; k++) out[k] = (mt_real)mt_bf16_float(h[k]);
    free(h);
    return rc;
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

/* ======================================================================
 * AdamW against the textbook update, written out here in float64 (both
 * builds): the step's own gradients go in, every parameter and both moments
 * come out. Nothing of the optimizer's code is reused: the learning-rate
 * schedule, global-norm clipping, bias corrections and decoupled weight
 * decay (matrices only) are spelled out below. With bf16 moments the
 * reference is the same update from the stored (bf16) moments; the stored
 * results are that update's moments rounded to bf16 (relative error at most
 * 2^-8, bf16's unit roundoff, on top of the arithmetic's), and the weights
 * follow from the moments before that rounding.
 * ==================================================================== */
/* linear warmup to lr (step 0 at lr / warmup), cosine to lr * min_lr_ratio at decay_steps, flat after */
static double aw_lr(const mt_hparams *h, int step) {
    double lr = h->lr, lo = (double)h->lr * h->min_lr_ratio;
    if (step < h->warmup_steps) return lr * (step + 1) / h->warmup_steps;
    if (step >= h->decay_steps) return lo;
    double t = (double)(step - h->warmup_steps) / (h->decay_steps - h->warmup_steps);
    return lo + (lr - lo) * 0.5 * (1 + cos(acos(-1.0) * t));
}
static double aw_rel(double x, double ref, double scale) { double d = fabs(x - ref); return d == 0 ? 0 : d / (scale > 0 ? scale : 1e-300); }
static void test_adamw_reference_for(int moments) {
    enum { STEPS = 9, MAXP = 64 };
    mt_config c;
    mt_err e;
    mt_graph g;
    char name[80];
    int bf = moments == MT_BF16;
    snprintf(name, sizeof name, "AdamW = textbook float64 reference%s", bf ? ", bf16 moments" : "");
    e.msg[0] = 0;
    mt_config_preset(&c, "tiny", &e);
    c.dim = 16; c.n_layers = 2; c.n_dense_layers = 1; c.n_heads = 2;
    c.kv_lora_rank = 8; c.qk_nope_head_dim = 4; c.qk_rope_head_dim = 2; c.v_head_dim = 4;
    c.inter_dim = 24; c.moe_inter_dim = 8; c.n_routed_experts = 4; c.top_k = 2; c.n_shared_experts = 1;
    c.vocab_size = 32; c.seq_len = 8; c.batch = 2; c.original_seq_len = 8;
    if (compile_cpu_moments(&g, &c, MT_GRAPH_TRAIN, 1, moments, &e)) { report(name, 0, "%s", e.msg); return; }
    mt_runtime *rt = make_runtime(&g, 1, 1, 11);
    /* every trainable master has exactly one ADAMW node: (param, grad, exp_avg, exp_avg_sq) */
    int np = 0, cover = rt != NULL, n_train = 0;
    struct { int p, g, m, v, decay; int64_t n; mt_real *p0, *m0, *v0, *p1, *m1, *v1, *g1; } P[MAXP];
    memset(P, 0, sizeof P);
    for (int i = 0; i < g.n_values; i++) {
        const mt_value *x = &g.values[i];
        if (x->role != MT_ROLE_PARAM || x->param >= 0 || !(x->flags & MT_VF_TRAINABLE)) continue;
        n_train++;
        int found = 0;
        for (int k = 0; k < g.n_nodes; k++) {
            const mt_node *nd = &g.nodes[k];
            if (nd->op != MT_OP_ADAMW || nd->in[0] != i) continue;
            if (found++ || np == MAXP) { cover = 0; break; }
            P[np].p = i; P[np].g = nd->in[1]; P[np].m = nd->in[2]; P[np].v = nd->in[3];
            if (g.values[nd->in[2]].dtype != moments || g.values[nd->in[3]].dtype != moments) cover = 0;
            P[np].decay = x->ndim >= 2;   /* decay on matrices (and expert stacks), never on norms */
            P[np].n = mt_value_numel_max(&g, x);
            np++;
        }
        cover &= found == 1;
    }
    for (int i = 0; i < np; i++) {
        size_t b = sizeof(mt_real) * (size_t)P[i].n;
        P[i].p0 = (mt_real *)malloc(b); P[i].m0 = (mt_real *)malloc(b); P[i].v0 = (mt_real *)malloc(b);
        P[i].p1 = (mt_real *)malloc(b); P[i].m1 = (mt_real *)malloc(b); P[i].v1 = (mt_real *)malloc(b); P[i].g1 = (mt_real *)malloc(b);
    }
    mt_hparams hp;
    mt_hparams_default(&hp);
    hp.lr = 2e-2f; hp.min_lr_ratio = 0.25f; hp.warmup_steps = 3; hp.decay_steps = 7;   /* warmup, cosine, then flat */
    hp.beta1 = 0.8f; hp.beta2 = 0.97f; hp.eps = 1e-5f; hp.weight_decay = 0.3f; hp.grad_clip = 1.25f;
    const double tol = 8 * (sizeof(mt_real) == 4 ? (double)FLT_EPSILON : DBL_EPSILON), ur = bf ? 1.0 / 256 : 0;   /* bf16's unit roundoff */
    double wp = 0, wm = 0, wv = 0, wn = 0, wl = 0;
    int ok = cover && np > 0, clipped = 0, decayed = 0;
    int32_t tok[16], tgt[16];
    for (int s = 0; s < STEPS && ok; s++) {
        for (int i = 0; i < np && ok; i++)
            ok = !mt_runtime_read(rt, P[i].p, P[i].p0, &e) && !read_reals(rt, P[i].m, P[i].m0, &e) && !read_reals(rt, P[i].v, P[i].v0, &e);
        mt_step_stats st;
        make_batch(&c, s, tok, tgt);
        ok = ok && !mt_runtime_step(rt, tok, tgt, s, &hp, &st, &e);
        for (int i = 0; i < np && ok; i++)
            ok = !mt_runtime_read(rt, P[i].p, P[i].p1, &e) && !read_reals(rt, P[i].m, P[i].m1, &e) &&
                 !read_reals(rt, P[i].v, P[i].v1, &e) && !mt_runtime_read(rt, P[i].g, P[i].g1, &e);
        if (!ok) break;
        /* the global gradient norm, clipped to grad_clip: torch's clip_grad_norm_ */
        double ss = 0;
        for (int i = 0; i < np; i++) for (int64_t k = 0; k < P[i].n; k++) ss += (double)P[i].g1[k] * (double)P[i].g1[k];
        double norm = sqrt(ss), clip = hp.grad_clip, coef = norm > clip ? clip / (norm + 1e-6) : 1.0;
        clipped += norm > clip;
        double lr = aw_lr(&hp, s), b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, t = s + 1;
        double bc1 = 1 - pow(b1, t), bc2 = 1 - pow(b2, t);
        wn = fmax(wn, aw_rel(st.grad_norm, norm, norm));
        wl = fmax(wl, aw_rel(st.lr, lr, lr));
        for (int i = 0; i < np; i++) {
            double wd = P[i].decay ? hp.weight_decay : 0;
            decayed += P[i].decay && s == 0;
            for (int64_t k = 0; k < P[i].n; k++) {
                double gk = coef * (double)P[i].g1[k], m0 = P[i].m0[k], v0 = P[i].v0[k], p0 = P[i].p0[k];
                double m = b1 * m0 + (1 - b1) * gk, v = b2 * v0 + (1 - b2) * gk * gk;
                /* f32 moments are stored in mt_real (as torch keeps them in the parameter's dtype) and the update reads them back;
                   bf16 moments: the update uses them before they are rounded for storage */
                double mhat = (bf ? m : (double)(mt_real)m) / bc1, vhat = (bf ? v : (double)(mt_real)v) / bc2, upd = lr * mhat / (sqrt(vhat) + eps);
                double p = p0 - lr * wd * p0 - upd;
                /* errors relative to the terms' magnitudes (rounding of the stored scalars is amplified where m cancels);
                   bf16 moments: as a fraction of the bound their storage rounding adds, 2^-8 |x| on top of tol */
                double mterms = fabs(b1 * m0) + fabs((1 - b1) * gk), uterms = lr * mterms / bc1 / (sqrt(vhat) + eps);
                wm = fmax(wm, bf ? aw_rel(P[i].m1[k], m, ur * fabs(m) + tol * mterms) : aw_rel(P[i].m1[k], m, mterms));
                wv = fmax(wv, bf ? aw_rel(P[i].v1[k], v, ur * v + tol * v) : aw_rel(P[i].v1[k], v, v));
                wp = fmax(wp, aw_rel(P[i].p1[k], p, fabs(p0) + uterms));
                if (P[i].p1[k] != P[i].p1[k] || P[i].m1[k] != P[i].m1[k] || P[i].v1[k] != P[i].v1[k]) wp = 1e30;
            }
        }
    }
    double mtol = bf ? 1 : tol;
    ok = ok && wp <= tol && wm <= mtol && wv <= mtol && wl <= tol && wn <= tol && clipped > 0 && clipped < STEPS && decayed > 0 && decayed < np;
    report(name, ok,
           "%d of %d trainable tensors, %d steps (%d clipped; warmup, cosine, flat lr); worst relative error: weights %.1e, exp_avg %.2g, "
           "exp_avg_sq %.2g, lr %.1e, grad norm %.1e (bound %.1e%s)%s%s", np, n_train, STEPS, clipped, wp, wm, wv, wl, wn, tol,
           bf ? "; the moments' as a fraction of theirs, 2^-8 |x| + it" : "",
           cover ? "" : "; NOT every trainable tensor has one ADAMW node (with the moments' dtype)", ok || !e.msg[0] ? "" : e.msg);
    for (int i = 0; i < np; i++) { free(P[i].p0); free(P[i].m0); free(P[i].v0); free(P[i].p1); free(P[i].m1); free(P[i].v1); free(P[i].g1); }
    mt_runtime_destroy(rt);
    mt_graph_free(&g);
}
static void test_adamw_reference(void) {
    test_adamw_reference_for(MT_F32);
    test_adamw_reference_for(MT_BF16);
}

#endif

/* ======================================================================
 * Many ranks as threads of this process: CPU ranks share a world; CUDA
 * ranks (one GPU each) share NCCL's id. Against one rank that trains on the
 * same global batch.
 * ==================================================================== */
#define MR_MAX 8
typedef struct {
    const mt_graph *g;
    int steps;
    uint64_t seed;
    int route_to_first;          /* expert biases make every token pick experts 0..K-1 (rank 0's) */
    int fail_rank, fail_step;    /* this rank gets a token outside the vocabulary at that step (-1: none) */
    double loss[32], gnorm[32];  /* rank 0's view: the global loss and norm */
    double mtp[32];              /* and the mean MTP loss (mr_mtp > 0) */
    char err[MR_MAX][300];
    int64_t recv_rows[MR_MAX];   /* most rows a rank's experts received in one step */
    uint8_t *params[MR_MAX];     /* every master parameter (this rank's part), concatenated */
    size_t param_bytes[MR_MAX];
    mt_runtime *rt[MR_MAX];
    int n_comms[MR_MAX];         /* communicators each rank made at bind */
    uint64_t digest[MR_MAX];     /* the GEMM kernels each rank ran (CUDA), and how many it chose itself */
    int chosen[MR_MAX];
    uint8_t nccl_id[MT_NCCL_ID_BYTES];   /* CUDA ranks */
} mr_job;

/* Global batch of step s: Bg sequences; rank r of dp trains on its B = Bg/dp. */
static void mr_batch(const mt_config *c, int step, int Bg, int32_t *tok, int32_t *tgt) {
    mt_rng r;
    mt_rng_seed(&r, 5000 + (uint64_t)step);
    int64_t n = (int64_t)Bg * c->seq_len;
    for (int64_t i = 0; i < n; i++) {
        tok[i] = (int32_t)(mt_rng_u64(&r) % (uint64_t)c->vocab_size);
        tgt[i] = (int32_t)((tok[i] * 5 + 1 + (i % 3)) % c->vocab_size);
    }
}

static int mr_rank(void *ctx, int rank, mt_world *w, mt_err *err) {
    mr_job *j = (mr_job *)ctx;
    const mt_graph *g = j->g;
    const mt_config *c = &g->cfg;
    mt_binding b;
    mt_binding_single(&b);
    b.rank = rank; b.world = mt_mesh_world(&g->mesh); b.n_threads = 1;
    if (g->target.backend == MT_BACKEND_CPU) { b.cpu_world = b.world > 1 ? w : NULL; b.device = rank; }   /* a virtual device per rank */
    else {   /* device-side waits for a peer end after 30 s (not 600): a stalled exchange fails, naming the peer */
        b.device = rank; b.local_rank = rank; b.timeout_s = 30;
        memcpy(b.nccl_id, j->nccl_id, sizeof b.nccl_id);
    }
    mt_runtime *rt;
    int rc = mt_runtime_create(&rt, g, &b, err);
    if (rc) { snprintf(j->err[rank], sizeof j->err[rank], "%s", err->msg); return -1; }
    j->rt[rank] = rt;   /* freed after every rank has stopped */
    j->n_comms[rank] = mt_runtime_n_communicators(rt);
    if (mt_runtime_init_params(rt, j->seed, err)) { snprintf(j->err[rank], sizeof j->err[rank], "%s", err->msg); return -1; }
    if (j->route_to_first)
        for (int v = 0; v < g->n_values; v++)
            if (strstr(g->values[v].name, "e_score_correction_bias")) {
                mt_real bias[4096];
                float fb[4096];
                for (int e = 0; e < c->n_routed_experts; e++) fb[e] = (float)(bias[e] = e < c->top_k ? 100 : 0);
                mt_runtime_write(rt, v, g->target.backend == MT_BACKEND_CPU ? (void *)bias : (void *)fb, err);
            }
    int tp = g->mesh.size[MT_DIM_TP], dp = b.world / tp, B = c->batch, T = c->seq_len;   /* tp ranks share their batch */
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * dp * T), *tgt = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * dp * T);
    mt_hparams hp;
    mt_hparams_default(&hp);
    hp.warmup_steps = 2;
    for (int s = 0; s < j->steps && !rc; s++) {
        mr_batch(c, s, B * dp, tok, tgt);
        int32_t *mine = tok + (size_t)(rank / tp) * B * T, *mt = tgt + (size_t)(rank / tp) * B * T;
        if (rank == j->fail_rank && s == j->fail_step) mine[3] = c->vocab_size;   /* bad input on one rank */
        mt_step_stats st;
        rc = mt_runtime_step(rt, mine, mt, s, &hp, &st, err);
        if (rc) { snprintf(j->err[rank], sizeof j->err[rank], "%s", err->msg); break; }
        if (rank == 0) { j->loss[s] = st.loss; j->gnorm[s] = st.grad_norm; j->mtp[s] = st.mtp_loss; }
        if (mt_runtime_received_rows(rt) > j->recv_rows[rank]) j->recv_rows[rank] = mt_runtime_received_rows(rt);
    }
    free(tok); free(tgt);
    if (rc) return -1;
    j->digest[rank] = mt_runtime_kernel_digest(rt, NULL, &j->chosen[rank]);
    size_t total = 0;
    for (int v = 0; v < g->n_values; v++)
        if (g->values[v].role == MT_ROLE_PARAM && g->values[v].param < 0) total += (size_t)g->values[v].nbytes;
    j->params[rank] = (uint8_t *)malloc(total + 1);
    j->param_bytes[rank] = total;
    total = 0;
    for (int v = 0; v < g->n_values; v++)
        if (g->values[v].role == MT_ROLE_PARAM && g->values[v].param < 0) {
            mt_runtime_read(rt, v, j->params[rank] + total, err);
            total += (size_t)g->values[v].nbytes;
        }
    return 0;
}

static void mr_free(mr_job *j) {
    for (int r = 0; r < MR_MAX; r++) { free(j->params[r]); mt_runtime_destroy(j->rt[r]); j->params[r] = NULL; j->rt[r] = NULL; }
}
/* Train on the graph's mesh; returns 0 or -1 with err naming the failed rank. */
static int mr_run(mr_job *j, const mt_graph *g, int steps, mt_err *err) {
    memset(j->loss, 0, sizeof j->loss);
    memset(j->err, 0, sizeof j->err);
    memset(j->recv_rows, 0, sizeof j->recv_rows);
    j->g = g; j->steps = steps;
    if (!j->seed) j->seed = 7;
#ifdef MT_CUDA
    if (g->target.backend == MT_BACKEND_CUDA && mt_mesh_world(&g->mesh) > 1 && mt_nccl_unique_id(j->nccl_id, err)) return -1;
#endif
    return mt_run_thread_ranks(mt_mesh_world(&g->mesh), mr_rank, j, err);
}
/* The step graph of the small model for a mesh (per-data-parallel-rank batch b); overlap 0: that pass off.
 * mr_q_lora: the low-rank query path (q_a_proj, q_a_layernorm, q_b_proj) of that rank; 0: tiny's plain q_proj. */
static int mr_q_lora = 0;
static int mr_mtp = 0;   /* multi-token prediction depths, with document masking (eot_id 3) */
static int mr_moments = MT_F32;   /* the AdamW moments' dtype of the graphs mr_compile_mesh makes */
static int mr_compile_mesh(mt_graph *g, int rep, int shard, int tp, int ep, int b, int eager, int cuda, int overlap, mt_err *err) {
    mt_config c;
    mt_config_preset(&c, "tiny", err);
    c.seq_len = 32; c.original_seq_len = 32; c.batch = b; c.q_lora_rank = mr_q_lora;
    if (mr_mtp) { c.mtp_layers = mr_mtp; c.doc_mask = 1; c.eot_id = 3; }
    mt_mesh m;
    mt_target t;
    mt_passes p;
    if (cuda) mt_target_cuda(&t, "sm_90a"); else mt_target_cpu(&t);
    if (eager) mt_passes_none(&p); else mt_passes_all(&p);
    if (!overlap) p.overlap = 0;
    p.moments = mr_moments; p.moe_chunks = moe_chunks;
    if (mt_mesh_init(&m, rep, shard, tp, ep, err)) return -1;
    return mt_compile(g, &c, &m, &t, MT_GRAPH_TRAIN, &p, err);
}
static int mr_compile_opts(mt_graph *g, int rep, int shard, int ep, int b, int eager, int cuda, int overlap, mt_err *err) {
    return mr_compile_mesh(g, rep, shard, 1, ep, b, eager, cuda, overlap, err);
}
static int mr_compile_for(mt_graph *g, int rep, int shard, int ep, int b, int eager, int cuda, mt_err *err) {
    return mr_compile_opts(g, rep, shard, ep, b, eager, cuda, 1, err);
}
static double max_rel(const double *a, const double *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) { double r = fabs(a[i] - b[i]) / fabs(b[i]); if (r > m || r != r) m = r != r ? 1e30 : r; }
    return m;
}

#if !MT_TEST_GPU
static int mr_compile(mt_graph *g, int rep, int shard, int ep, int b, int eager, mt_err *err) {
    return mr_compile_for(g, rep, shard, ep, b, eager, 0, err);
}

/* Every master parameter of a finished run, whole and in value order, as float64: each rank's FSDP
 * shard at its group index, its experts at its ep coordinate. Replicas of a part must agree bitwise
 * (*agree = 0 otherwise). Returns the element count; *ends gets each tensor's end (up to cap). */
static int64_t mr_whole(const mr_job *j, const mt_graph *g, double **out, int64_t *ends, int cap, int *n_tensors, int *agree) {
    const mt_mesh *m = &g->mesh;
    int ep = m->size[MT_DIM_EP], world = mt_mesh_world(m), nt = 0;
    int64_t total = 0;
    for (int v = 0; v < g->n_values; v++) {
        const mt_value *x = &g->values[v];
        if (x->role != MT_ROLE_PARAM || x->param >= 0) continue;
        total += mt_value_numel_logical(g, x) * ((x->flags & MT_VF_EXPERTS) ? ep : 1);
        if (nt < cap) ends[nt] = total;
        nt++;
    }
    double *w = (double *)malloc(sizeof(double) * (size_t)(total + 1));
    uint8_t *set = (uint8_t *)calloc((size_t)(total + 1), 1);
    *agree = 1;
    for (int r = 0; r < world; r++) {
        int co[MT_NDIMS];
        mt_mesh_coords(m, r, co);
        const uint8_t *part = j->params[r];
        int64_t base = 0;
        for (int v = 0; v < g->n_values && part; v++) {
            const mt_value *x = &g->values[v];
            if (x->role != MT_ROLE_PARAM || x->param >= 0) continue;
            int experts = (x->flags & MT_VF_EXPERTS) != 0;
            int64_t len = mt_value_numel_logical(g, x), stored = mt_value_numel_max(g, x);
            int64_t lo = x->shard ? (int64_t)mt_mesh_group(m, x->shard, r, NULL) * stored : 0, at = base + (experts ? co[MT_DIM_EP] * len : 0) + lo;
            const mt_real *src = (const mt_real *)part;
            for (int64_t k = 0; lo + k < len && k < stored; k++) {
                if (set[at + k] && w[at + k] != (double)src[k]) *agree = 0;
                w[at + k] = (double)src[k]; set[at + k] = 1;
            }
            part += x->nbytes;
            base += len * (experts ? ep : 1);
        }
    }
    for (int64_t k = 0; k < total; k++) if (!set[k]) { *agree = 0; w[k] = NAN; }   /* a part nobody holds */
    free(set);
    *out = w; *n_tensors = nt;
    return total;
}
/* The worst over tensors of max |a - b| / max |b|: weights of two runs of one model. */
static double mr_weight_err(const double *a, const double *b, const int64_t *ends, int nt) {
    double worst = 0;
    for (int t = 0, k = 0; t < nt; t++) {
        double d = 0, mx = 1e-300;
        for (; k < ends[t]; k++) { d = fmax(d, fabs(a[k] - b[k])); mx = fmax(mx, fabs(b[k])); if (a[k] != a[k] || b[k] != b[k]) d = 1e30; }
        worst = fmax(worst, d / mx);
    }
    return worst;
}

/* Several ranks against one rank on the same global batch: losses (step 1 and every step), gradient
 * norms and every weight after the last step; replicas of each part bitwise equal. tol_w bounds the
 * weights' worst max |diff| / max |w| over tensors. */
static void mr_equivalence(int rep, int shard, int ep, int steps, double tol1, double tol, double tol_g, double tol_w) {
    mt_err e;
    mt_graph g1, gm;
    int dp = rep * shard;
    char name[128];
    snprintf(name, sizeof name, "%d ranks (dp_replicate %d, dp_shard %d, ep %d) = one rank on the global batch%s%s", dp, rep, shard, ep,
             mr_mtp ? " (MTP, doc mask)" : "", mr_moments == MT_BF16 ? ", bf16 moments" : "");
    if (mr_compile(&g1, 1, 1, 1, 2 * dp, 0, &e) || mr_compile(&gm, rep, shard, ep, 2, 0, &e)) { report(name, 0, "%s", e.msg); return; }
    mr_job a, b;
    memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
    a.fail_rank = b.fail_rank = -1;
    int ok = mr_run(&a, &g1, steps, &e) == 0 && mr_run(&b, &gm, steps, &e) == 0;
    double r1 = ok ? fabs(a.loss[0] - b.loss[0]) / a.loss[0] : 1, rn = ok ? max_rel(b.loss, a.loss, steps) : 1;
    if (ok && mr_mtp) rn = fmax(rn, max_rel(b.mtp, a.mtp, steps));   /* the MTP losses as the main one */
    double rg = ok ? max_rel(b.gnorm, a.gnorm, steps) : 1, rw = 1;
    int agree = 0, agree1 = 0;
    if (ok) {
        double *wa = NULL, *wb = NULL;
        int64_t ea[512], eb[512];
        int na = 0, nb = 0;
        int64_t la = mr_whole(&a, &g1, &wa, ea, 512, &na, &agree1), lb = mr_whole(&b, &gm, &wb, eb, 512, &nb, &agree);
        if (la == lb && na == nb && na <= 512 && !memcmp(ea, eb, sizeof(int64_t) * (size_t)na)) rw = mr_weight_err(wb, wa, ea, na);
        free(wa); free(wb);
    }
    report(name, ok && r1 <= tol1 && rn <= tol && rg <= tol_g && rw <= tol_w && agree && agree1,
           "worst relative: loss step 1 %.2e, %d steps %.2e (bounds %.1e, %.1e); grad norm %.2e (%.1e); weights %.2e (%.1e)%s %s", r1, steps, rn,
           tol1, tol, rg, tol_g, rw, tol_w, agree && agree1 ? "" : "; replicas DIFFER or a part is missing", ok ? "" : e.msg);
    mr_free(&a); mr_free(&b);
    mt_graph_free(&g1); mt_graph_free(&gm);
}

/* Tensor parallelism: ranks dp_shard x tp (experts over ep of them) train as one rank does on the
 * same global batch: every step's loss and gradient norm within tol (relative). */
static void mr_equivalence_tp(int shard, int tp, int ep, int steps, double tol) {
    mt_err e;
    mt_graph g1, gm;
    char name[160];
    snprintf(name, sizeof name, "tp: %d ranks (dp_shard %d x tp %d, ep %d) = one rank on the global batch, %d steps%s", shard * tp, shard, tp, ep, steps,
             mr_mtp ? " (MTP, doc mask)" : "");
    if (mr_compile_mesh(&g1, 1, 1, 1, 1, 2 * shard, 0, 0, 1, &e)) { report(name, 0, "%s", e.msg); return; }
    if (mr_compile_mesh(&gm, 1, shard, tp, ep, 2, 0, 0, 1, &e)) { report(name, 0, "%s", e.msg); mt_graph_free(&g1); return; }
    mr_job a, b;
    memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
    a.fail_rank = b.fail_rank = -1;
    int ok = mr_run(&a, &g1, steps, &e) == 0 && mr_run(&b, &gm, steps, &e) == 0;
    double rl = ok ? max_rel(b.loss, a.loss, steps) : 1, rg = ok ? max_rel(b.gnorm, a.gnorm, steps) : 1;
    if (ok && mr_mtp) rl = fmax(rl, max_rel(b.mtp, a.mtp, steps));
    report(name, ok && rl <= tol && rg <= tol, "worst relative: loss %.2e, grad norm %.2e (tolerance %.0e); losses %.6f .. %.6f %s", rl, rg,
           tol, b.loss[0], b.loss[steps - 1], ok ? "" : e.msg);
    mr_free(&a); mr_free(&b);
    mt_graph_free(&g1); mt_graph_free(&gm);
}

/* MoE layers in `chunks` chunks of tokens against all tokens at once, on one mesh (eager: with the exchange
 * nodes even on one rank, and no overlap): step 1's loss bitwise (the forward computes the same bits), then
 * every step's loss and gradient norm, and the weights, within bounds: each expert's weight gradient sums its
 * chunks' parts, the same sums in another order, and training carries the rounding on. */
static void mc_vs_whole_n(int chunks, int rep, int shard, int ep, int eager, int steps, double tol, double tol_g, double tol_w) {
    mt_err e;
    mt_graph g1, g2;
    int dp = rep * shard;
    char name[160];
    snprintf(name, sizeof name, "MoE in %d chunks of tokens = all at once, %d rank%s (dp_replicate %d, dp_shard %d, ep %d%s), %d steps", chunks,
             dp, dp > 1 ? "s" : "", rep, shard, ep, eager ? ", eager" : "", steps);
    if (mr_compile(&g1, rep, shard, ep, 2, eager, &e)) { report(name, 0, "%s", e.msg); return; }
    moe_chunks = chunks;
    int built = mr_compile(&g2, rep, shard, ep, 2, eager, &e) == 0;
    moe_chunks = 1;
    if (!built) { report(name, 0, "%s", e.msg); mt_graph_free(&g1); return; }
    mr_job a, b;
    memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
    a.fail_rank = b.fail_rank = -1;
    int ok = mt_graph_moe_chunks(&g1) == 1 && mt_graph_moe_chunks(&g2) == chunks && mr_run(&a, &g1, steps, &e) == 0 && mr_run(&b, &g2, steps, &e) == 0;
    double rn = ok ? max_rel(b.loss, a.loss, steps) : 1, rg = ok ? max_rel(b.gnorm, a.gnorm, steps) : 1, rw = 1;
    int first = ok && a.loss[0] == b.loss[0], agree = 0, agree1 = 0;
    if (ok) {
        double *wa = NULL, *wb = NULL;
        int64_t ea[512], eb[512];
        int na = 0, nb = 0;
        int64_t la = mr_whole(&a, &g1, &wa, ea, 512, &na, &agree1), lb = mr_whole(&b, &g2, &wb, eb, 512, &nb, &agree);
        if (la == lb && na == nb && na <= 512 && !memcmp(ea, eb, sizeof(int64_t) * (size_t)na)) rw = mr_weight_err(wb, wa, ea, na);
        free(wa); free(wb);
    }
    report(name, ok && first && rn <= tol && rg <= tol_g && rw <= tol_w && agree && agree1,
           "step 1's loss %s; worst relative: loss %.2e (bound %.1e), grad norm %.2e (%.1e), weights %.2e (%.1e); losses %.6f .. %.6f%s %s",
           first ? "bitwise" : "DIFFERS", rn, tol, rg, tol_g, rw, tol_w, b.loss[0], b.loss[steps - 1],
           agree && agree1 ? "" : "; replicas DIFFER or a part is missing", ok ? "" : e.msg);
    mr_free(&a); mr_free(&b);
    mt_graph_free(&g1); mt_graph_free(&g2);
}
static void mc_vs_whole(int rep, int shard, int ep, int eager, int steps, double tol, double tol_g, double tol_w) {
    mc_vs_whole_n(2, rep, shard, ep, eager, steps, tol, tol_g, tol_w);
}

/* ======================================================================
 * Activation recompute: the same numbers from less memory (both builds)
 * ==================================================================== */

/* The step graph with the first n blocks recomputed (n < 0: every block),
 * through the passes one by one; or with mt_compile and a memory budget. */
static int compile_rc(mt_graph *g, const mt_config *c, const mt_mesh *m, int n, int64_t budget, mt_err *err) {
    mt_target t;
    mt_passes p;
    mt_target_cpu(&t);
    mt_passes_all(&p);
    p.overlap = 0;   /* as the hand-built path below: recompute alone (overlap's longer lifetimes take some of its savings) */
    if (budget > 0 || n == 0) { p.memory_budget = budget; return mt_compile(g, c, m, &t, MT_GRAPH_TRAIN, &p, err); }
    int32_t layers[256];
    if (n < 0 || n > c->n_layers) n = c->n_layers;
    for (int i = 0; i < n; i++) layers[i] = i;
    if (mt_build(g, c, m, &t, MT_GRAPH_TRAIN, err)) return -1;
    if (mt_pass_elide_collectives(g, err) || mt_pass_recompute(g, layers, n, err) || mt_pass_fuse(g, err) ||
        mt_pass_plan_memory(g, err)) { mt_graph_free(g); return -1; }
    return 0;
}

enum { RC_STEPS = 6 };
typedef struct {
    double loss[RC_STEPS], gnorm[RC_STEPS];
    uint8_t *params, *biases;    /* every master parameter / every expert bias, concatenated */
    size_t n_params, n_biases;
    uint64_t counts;             /* hash of every MoE layer's counts after every step */
    int n_moe, counts_once;      /* counts_once: each step's counts add up to tokens x top-k (never twice) */
} rc_result;
static void rc_free(rc_result *r) { free(r->params); free(r->biases); memset(r, 0, sizeof *r); }

/* Train RC_STEPS steps on one rank, the arena poisoned with NaN before each. */
static int rc_train(const mt_graph *g, rc_result *r, mt_err *err) {
    memset(r, 0, sizeof *r);
    const mt_config *c = &g->cfg;
    mt_runtime *rt = make_runtime(g, 2, 1, 5);
    if (!rt) return mt_errf(err, "runtime");
    int64_t N = (int64_t)c->batch * c->seq_len;
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)N), *tgt = (int32_t *)malloc(sizeof(int32_t) * (size_t)N);
    mt_hparams hp;
    mt_hparams_default(&hp);
    hp.warmup_steps = 2; hp.lr = 1e-2f;
    int rc = 0;
    r->counts = MT_HASH_INIT; r->counts_once = 1;
    r->n_moe = mt_runtime_n_moe_layers(rt);
    for (int s = 0; s < RC_STEPS && !rc; s++) {
        mt_step_stats st;
        make_batch(c, s, tok, tgt);
        if (mt_runtime_step(rt, tok, tgt, s, &hp, &st, err)) { rc = -1; break; }
        r->loss[s] = st.loss; r->gnorm[s] = st.grad_norm;
        for (int i = 0; i < r->n_moe; i++) {
            int32_t cnt[1024];
            int E = mt_runtime_expert_counts(rt, i, cnt);
            int64_t sum = 0;
            for (int e = 0; e < E; e++) sum += cnt[e];
            r->counts_once &= E > 0 && sum == N * c->top_k;
            r->counts = mt_hash(cnt, sizeof(int32_t) * (size_t)(E > 0 ? E : 0), r->counts);
        }
    }
    for (int pass = 0; pass < 2 && !rc; pass++) {   /* sizes, then bytes */
        size_t np = 0, nb = 0;
        for (int v = 0; v < g->n_values; v++) {
            const mt_value *x = &g->values[v];
            if (x->role != MT_ROLE_PARAM || x->param >= 0) continue;
            int bias = strstr(x->name, "e_score_correction_bias") != NULL;
            if (pass) {
                memcpy(r->params + np, mt_runtime_value(rt, v), (size_t)x->nbytes);
                if (bias) memcpy(r->biases + nb, mt_runtime_value(rt, v), (size_t)x->nbytes);
            }
            np += (size_t)x->nbytes;
            if (bias) nb += (size_t)x->nbytes;
        }
        if (!pass) { r->params = (uint8_t *)malloc(np + 1); r->biases = (uint8_t *)malloc(nb + 1); }
        r->n_params = np; r->n_biases = nb;
    }
    free(tok); free(tgt);
    mt_runtime_destroy(rt);
    return rc;
}
static int rc_same(const rc_result *a, const rc_result *b) {
    return bitwise_equal(a->loss, b->loss, RC_STEPS) && bitwise_equal(a->gnorm, b->gnorm, RC_STEPS) && a->n_params == b->n_params &&
           !memcmp(a->params, b->params, a->n_params);
}
static int rc_same_experts(const rc_result *a, const rc_result *b) {
    return a->n_biases > 0 && a->n_biases == b->n_biases && !memcmp(a->biases, b->biases, a->n_biases) && a->counts == b->counts &&
           a->n_moe == b->n_moe && a->counts_once && b->counts_once;
}

/* (a, b) Every block recomputed, and the budget's choice: losses, grad
 * norms, every weight and every expert bias bitwise those without recompute;
 * each step's expert counts are the forward's, counted once. */
/* Parameter init draws: the table is odd, increasing and exact enough that t0 + d * f rounds once
 * (the CPU and the GPU then agree bit for bit), and the draws follow the truncated normal. */
static void test_init_draws(void) {
    float *t = (float *)malloc(sizeof(float) * (MT_INIT_TABLE + 1));
    mt_init_table(t);
    int ok = t[0] == -3 && t[MT_INIT_TABLE] == 3 && t[MT_INIT_TABLE / 2] == 0, maxbits = 0;
    for (int k = 0; k < MT_INIT_TABLE && ok; k++) {
        double d = (double)t[k + 1] - (double)t[k];
        if (!(d > 0) || t[k] != -t[MT_INIT_TABLE - k]) { ok = 0; break; }
        int ex; double m = frexp(d, &ex) * 9007199254740992.0;   /* d's 53-bit integer mantissa */
        int bits = 53;
        while (bits > 0 && fmod(m, 2.0) == 0) { m /= 2; bits--; }
        if (bits > maxbits) maxbits = bits;
    }
    double s1 = 0, s2 = 0, lo = 0, hi = 0, tail = 0, n = 1 << 21;
    for (int64_t i = 0; i < (int64_t)n; i++) {
        double x = mt_init_draw(t, mt_init_bits(0x1234567ull, (uint64_t)i));
        s1 += x; s2 += x * x; if (x < lo) lo = x; if (x > hi) hi = x; if (fabs(x) > 2) tail++;
    }
    double mean = s1 / n, var = s2 / n - mean * mean;   /* N(0,1) cut at 3: var 0.97334, P(|x|>2) 0.04292 */
    ok = ok && maxbits <= 27 && fabs(mean) < 0.003 && fabs(var - 0.97334) < 0.004 && fabs(tail / n - 0.04292) < 0.001 &&
         lo >= -3 && hi <= 3 && lo < -2.9 && hi > 2.9;
    report("init draws (table, exactness, statistics)", ok, "neighbours' difference <= %d of 27 bits; 2^21 draws: mean %.5f var %.5f "
           "(0.97334) P(|x|>2) %.5f (0.04292) range [%.3f, %.3f]", maxbits, mean, var, tail / n, lo, hi);
    free(t);
}

/* tiny at batch 4 x 32 tokens */
static void rc_tiny(mt_config *c) {
    mt_err e;
    mt_config_preset(c, "tiny", &e);
    c->batch = 4; c->seq_len = 32; c->original_seq_len = 32;
}

static void test_recompute_bitwise_for(const char *tag, const mt_config *c) {
    mt_err e;
    mt_mesh m;
    mt_graph g0, ga, gb;
    char name[128];
    mt_mesh_single(&m);
    snprintf(name, sizeof name, "recompute %s: every block: bitwise losses, norms, weights", tag);
    if (compile_rc(&g0, c, &m, 0, 0, &e)) { report(name, 0, "%s", e.msg); return; }
    if (compile_rc(&ga, c, &m, -1, 0, &e)) { report(name, 0, "%s", e.msg); mt_graph_free(&g0); return; }
    /* a budget halfway between the peaks with and without recomputing every block */
    int64_t p0 = mt_graph_peak_bytes(&g0), pa = mt_graph_peak_bytes(&ga), budget = pa + (p0 - pa) / 2;
    if (compile_rc(&gb, c, &m, 0, budget, &e)) { report(name, 0, "%s", e.msg); mt_graph_free(&g0); mt_graph_free(&ga); return; }
    rc_result r0, ra, rb;
    int ok = rc_train(&g0, &r0, &e) == 0 && rc_train(&ga, &ra, &e) == 0 && rc_train(&gb, &rb, &e) == 0;
    report(name, ok && ga.n_recompute == c->n_layers && rc_same(&r0, &ra), "%d blocks, loss %.7f -> %.7f, peak %.2f -> %.2f MiB %s",
           ga.n_recompute, r0.loss[0], r0.loss[RC_STEPS - 1], p0 / 1048576.0, pa / 1048576.0, ok ? "" : e.msg);
    snprintf(name, sizeof name, "recompute %s: budget's choice: bitwise", tag);
    report(name, ok && gb.n_recompute > 0 && mt_graph_peak_bytes(&gb) <= budget && rc_same(&r0, &rb), "%d of %d blocks, peak %.2f MiB <= %.2f",
           gb.n_recompute, c->n_layers, mt_graph_peak_bytes(&gb) / 1048576.0, budget / 1048576.0);
    snprintf(name, sizeof name, "recompute %s: expert biases bitwise, counts once", tag);
    report(name, ok && rc_same_experts(&r0, &ra) && rc_same_experts(&r0, &rb), "%d MoE layers, %zu bias bytes", r0.n_moe, r0.n_biases);
    rc_free(&r0); rc_free(&ra); rc_free(&rb);
    mt_graph_free(&g0); mt_graph_free(&ga); mt_graph_free(&gb);
}
static void test_recompute_bitwise(void) {
    mt_config c;
    rc_tiny(&c);
    test_recompute_bitwise_for("tiny", &c);
    /* all MoE, softmax scores, group-limited routing, low-rank q, packed documents */
    c.n_dense_layers = 0; c.score_func = MT_SCORE_SOFTMAX; c.route_norm = 0; c.n_expert_groups = 4; c.n_limited_groups = 2;
    c.q_lora_rank = 24; c.doc_mask = 1; c.eot_id = 10; c.top_k = 3;
    test_recompute_bitwise_for("all-MoE", &c);
    rc_tiny(&c);   /* the main blocks recomputed beside two MTP depths (which keep their activations) */
    c.mtp_layers = 2;
    test_recompute_bitwise_for("tiny + 2 MTP depths", &c);
}

/* ======================================================================
 * RoPE folded into attention (mt_pass_fold_rope): bitwise the same step
 * ==================================================================== */

/* The step graph through the passes one by one: fold 1: RoPE folded (any target); n_rc blocks recomputed. */
static int compile_fold(mt_graph *g, const mt_config *c, int cuda, int fold, int n_rc, int kind, int *folded, mt_err *err) {
    mt_mesh m;
    mt_target t;
    mt_mesh_single(&m);
    if (cuda) mt_target_cuda(&t, "sm_90a"); else mt_target_cpu(&t);
    int32_t layers[256];
    for (int i = 0; i < n_rc; i++) layers[i] = i;
    *folded = 0;
    if (mt_build(g, c, &m, &t, kind, err)) return -1;
    if (mt_pass_elide_collectives(g, err) || (n_rc && mt_pass_recompute(g, layers, n_rc, err))) { mt_graph_free(g); return -1; }
    if (fold && (*folded = mt_pass_fold_rope(g, err)) < 0) { mt_graph_free(g); return -1; }
    if (mt_pass_fuse(g, err) || mt_pass_plan_memory(g, err)) { mt_graph_free(g); return -1; }
    return 0;
}
static void count_ops(const mt_graph *g, int *unfolded, int *fwd, int *bwd) {
    *unfolded = *fwd = *bwd = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        int op = g->nodes[i].op;
        *unfolded += op == MT_OP_MLA_ROPE || op == MT_OP_MLA_ROPE_BWD || op == MT_OP_ATTENTION || op == MT_OP_ATTENTION_BWD;
        *fwd += op == MT_OP_MLA_ATTENTION;
        *bwd += op == MT_OP_MLA_ATTENTION_BWD;
    }
}
static void test_fold_rope_for(const char *tag, const mt_config *c, int n_rc) {
    mt_err e;
    mt_graph g0, g1;
    char name[128];
    int f0, f1;
    snprintf(name, sizeof name, "fold RoPE %s%s: bitwise losses, norms, weights, biases", tag, n_rc ? ", recomputed" : "");
    if (compile_fold(&g0, c, 0, 0, n_rc, MT_GRAPH_TRAIN, &f0, &e) || compile_fold(&g1, c, 0, 1, n_rc, MT_GRAPH_TRAIN, &f1, &e)) {
        report(name, 0, "%s", e.msg);
        return;
    }
    int unfolded, nf, nb;
    count_ops(&g1, &unfolded, &nf, &nb);
    /* the artifact carries the folded ops (10 inputs): train from its round trip */
    uint8_t *bytes = NULL;
    size_t len = 0;
    mt_graph g2;
    int art = !mt_artifact_write(&g1, &bytes, &len, &e) && !mt_artifact_read(&g2, bytes, len, &e);
    free(bytes);
    rc_result r0, r1, r2;
    memset(&r2, 0, sizeof r2);
    int ok = rc_train(&g0, &r0, &e) == 0 && rc_train(&g1, &r1, &e) == 0 && art && rc_train(&g2, &r2, &e) == 0;
    int want = c->n_layers + n_rc;   /* the recomputed blocks' MLA_ROPE fold too */
    report(name, ok && f1 == want && unfolded == 0 && nf == want && nb == c->n_layers && rc_same(&r0, &r1) && rc_same_experts(&r0, &r1) &&
                     rc_same(&r0, &r2),
           "%d folded, %d unfolded nodes left, loss %.7f -> %.7f, peak %.2f -> %.2f MiB %s", f1, unfolded, r0.loss[0], r0.loss[RC_STEPS - 1],
           mt_graph_peak_bytes(&g0) / 1048576.0, mt_graph_peak_bytes(&g1) / 1048576.0, ok ? "" : e.msg);
    rc_free(&r0); rc_free(&r1); rc_free(&r2);
    mt_graph_free(&g0); mt_graph_free(&g1);
    if (art) mt_graph_free(&g2);
}
static void test_fold_rope(void) {
    mt_config c;
    rc_tiny(&c);
    test_fold_rope_for("tiny", &c, 0);
    test_fold_rope_for("tiny", &c, 2);
    c.n_dense_layers = 0; c.q_lora_rank = 24; c.doc_mask = 1; c.eot_id = 10;
    test_fold_rope_for("low-rank q, documents", &c, 0);
#if !MT_TEST_F64
    /* where it applies: a reader of K other than attention keeps that layer unfolded; CUDA graphs fold
       only head dims the folded kernels take (debug's 128 + 64 / 128, not tiny's); mt_compile folds CUDA
       graphs by default and the pass's switch turns it off */
    mt_err e;
    mt_graph g;
    mt_mesh m;
    mt_target t;
    mt_mesh_single(&m);
    mt_target_cpu(&t);
    rc_tiny(&c);
    int ok = !mt_build(&g, &c, &m, &t, MT_GRAPH_TRAIN, &e), k = ok ? mt_graph_find(&g, "L0.attn.K") : -1, folded = -1, unf = 0, nf = 0, nb = 0;
    if (ok && k >= 0) {
        g.io[MT_IO_LOGITS] = k;
        folded = mt_pass_fold_rope(&g, &e);
        count_ops(&g, &unf, &nf, &nb);
    }
    if (ok) mt_graph_free(&g);
    report("fold RoPE: a K read elsewhere stays unfolded", ok && k >= 0 && folded == c.n_layers - 1 && unf == 4 && nf == c.n_layers - 1,
           "%d of %d layers folded, %d unfolded nodes", folded, c.n_layers, unf);
    int f_tiny = -1, f_debug = -1, f_fwd = -1, dflt = -1, off = -1;
    mt_config d;
    mt_config_preset(&d, "debug", &e);
    d.batch = 1; d.seq_len = 256;
    if (!compile_fold(&g, &c, 1, 1, 0, MT_GRAPH_TRAIN, &f_tiny, &e)) mt_graph_free(&g);
    if (!compile_fold(&g, &d, 1, 1, 0, MT_GRAPH_TRAIN, &f_debug, &e)) mt_graph_free(&g);
    if (!compile_fold(&g, &d, 1, 1, 0, MT_GRAPH_FORWARD, &f_fwd, &e)) {
        count_ops(&g, &unf, &nf, &nb);
        mt_graph_free(&g);
    }
    mt_passes p;
    mt_target_cuda(&t, "sm_90a");
    mt_passes_all(&p);
    if (!mt_compile(&g, &d, &m, &t, MT_GRAPH_TRAIN, &p, &e)) { count_ops(&g, &unf, &dflt, &nb); mt_graph_free(&g); }
    p.fold_rope = 0;
    if (!mt_compile(&g, &d, &m, &t, MT_GRAPH_TRAIN, &p, &e)) { count_ops(&g, &unf, &off, &nb); mt_graph_free(&g); }
    report("fold RoPE: CUDA head dims, forward graphs, the switch", f_tiny == 0 && f_debug == d.n_layers && f_fwd == d.n_layers &&
                                                                      dflt == d.n_layers && off == 0,
           "tiny %d, debug %d (forward graph %d), mt_compile %d, switched off %d", f_tiny, f_debug, f_fwd, dflt, off);
#endif
}
#endif

#if MT_TEST_GPU
/* ======================================================================
 * GPU tests: every CUDA op against the CPU reference, whole steps
 * ==================================================================== */

static mt_cuda *CU;
static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static float *randn(int64_t n, double sd) { float *x = (float *)malloc(sizeof(float) * (size_t)(n ? n : 1)); for (int64_t i = 0; i < n; i++) x[i] = (float)(sd * mt_rng_normal(&R)); return x; }
static void round_bf(float *x, int64_t n) { for (int64_t i = 0; i < n; i++) x[i] = bf2f(f2bf(x[i])); }
static void *dalloc(size_t n) { void *p = NULL; if (mt_cuda_malloc(CU, &p, n ? n : 4)) return NULL; mt_cuda_memset(CU, p, 0xff, n); return p; }  /* NaN-poisoned */
static void *up_bf(const float *x, int64_t n) {
    uint16_t *h = (uint16_t *)malloc(2 * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) h[i] = f2bf(x[i]);
    void *d = dalloc(2 * (size_t)n);
    mt_cuda_copy(CU, d, h, 2 * (size_t)n, 0);
    free(h);
    return d;
}
static void *up(const void *x, size_t bytes) { void *d = dalloc(bytes); mt_cuda_copy(CU, d, x, bytes, 0); return d; }
static float *down_bf(const void *d, int64_t n) {
    uint16_t *h = (uint16_t *)malloc(2 * (size_t)(n ? n : 1));
    float *f = (float *)malloc(4 * (size_t)(n ? n : 1));
    mt_cuda_copy(CU, h, d, 2 * (size_t)n, 1);
    for (int64_t i = 0; i < n; i++) f[i] = bf2f(h[i]);
    free(h);
    return f;
}
static void *down(const void *d, size_t bytes) { void *h = malloc(bytes ? bytes : 4); mt_cuda_copy(CU, h, d, bytes, 1); return h; }
/* ||a - ref|| / ||ref||; NaN anywhere gives infinity */
static double rel(const float *a, const float *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
#define BF_TOL 1e-2
#define F32_TOL 1e-5
static void dfree(void *p) { mt_cuda_free(CU, p); }

static void gpu_test_basic_ops(void) {
    int N = 300, D = 96, V = 50;
    /* embedding */
    float *wte = randn((int64_t)V * D, 1);
    round_bf(wte, (int64_t)V * D);
    int32_t *tok = (int32_t *)malloc(4 * (size_t)N);
    for (int i = 0; i < N; i++) tok[i] = (int32_t)(mt_rng_u64(&R) % 7);   /* many repeats */
    float *x = (float *)malloc(4 * (size_t)N * D), *dx = randn((int64_t)N * D, 1), *dw = (float *)malloc(4 * (size_t)V * D);
    round_bf(dx, (int64_t)N * D);
    mt_cpu_embed_forward(x, tok, wte, N, D);
    mt_cpu_embed_backward(dw, dx, tok, N, V, D);
    void *dwte = up_bf(wte, (int64_t)V * D), *dtok = up(tok, 4 * (size_t)N), *dxo = dalloc(2 * (size_t)N * D), *ddx = up_bf(dx, (int64_t)N * D);
    void *ddw = dalloc(4 * (size_t)V * D), *ws = dalloc(mt_cuda_embed_backward_workspace(N, D));
    int ok = !mt_cuda_embed_forward(CU, dxo, (int32_t *)dtok, dwte, N, D) && !mt_cuda_embed_backward(CU, (float *)ddw, ddx, (int32_t *)dtok, N, V, D, ws);
    float *gx = down_bf(dxo, (int64_t)N * D), *gw = (float *)down(ddw, 4 * (size_t)V * D);
    double e1 = rel(gx, x, (int64_t)N * D), e2 = rel(gw, dw, (int64_t)V * D);
    report("gpu embedding fwd/bwd", ok && e1 == 0 && e2 < F32_TOL, "%.1e %.1e", e1, e2);
    /* the lookup in FSDP shards (S = 3: ceil(V*D/3) elements each, rows cut mid-way): every element the
     * table's where the shard holds it, -0.0 elsewhere, and = the CPU's bitwise */
    {
        int S = 3, fine = ok;
        int64_t L = ((int64_t)V * D + S - 1) / S;
        uint16_t *wb = (uint16_t *)down(dwte, 2 * (size_t)V * D);
        float *cx = (float *)malloc(4 * (size_t)N * D);
        for (int r = 0; r < S; r++) {
            int64_t n_here = r * L + L <= (int64_t)V * D ? L : (int64_t)V * D - r * L;
            void *SH = dalloc(2 * (size_t)L);
            mt_cuda_copy(CU, SH, wb + r * L, 2 * (size_t)n_here, 0);
            fine &= !mt_cuda_embed_forward_range(CU, dxo, (int32_t *)dtok, SH, N, D, r * L, L);
            float *sx = down_bf(dxo, (int64_t)N * D);
            mt_cpu_embed_forward_range(cx, tok, wte + r * L, N, D, r * L, n_here);
            fine &= !memcmp(sx, cx, 4 * (size_t)N * D);
            for (int64_t i = 0; i < (int64_t)N * D && fine; i++) {
                int64_t at = (int64_t)tok[i / D] * D + i % D;
                float want = at >= r * L && at < r * L + L ? x[i] : -0.0f;
                fine = !memcmp(&sx[i], &want, 4);
            }
            free(sx); dfree(SH);
        }
        report("gpu embedding lookup in FSDP shards = the table's rows, -0.0 elsewhere", fine, "S = %d, bitwise, = CPU", S);
        free(wb); free(cx);
    }
    free(gx); free(gw); free(x); free(dw); free(wte); free(tok); free(dx);
    dfree(dwte); dfree(dtok); dfree(dxo); dfree(ddx); dfree(ddw); dfree(ws);

    /* RMSNorm */
    float *xr = randn((int64_t)N * D, 2), *w = randn(D, 1), *dy = randn((int64_t)N * D, 1);
    round_bf(xr, (int64_t)N * D); round_bf(dy, (int64_t)N * D);
    float *y = (float *)malloc(4 * (size_t)N * D), *rs = (float *)malloc(4 * (size_t)N), *dxr = (float *)malloc(4 * (size_t)N * D), *dwr = (float *)malloc(4 * (size_t)D);
    mt_cpu_rmsnorm_forward(y, rs, xr, w, N, D, 1e-6f);
    mt_cpu_rmsnorm_backward(dxr, dwr, dy, xr, w, rs, N, D);
    void *dX = up_bf(xr, (int64_t)N * D), *dW = up(w, 4 * (size_t)D), *dY = dalloc(2 * (size_t)N * D), *dR = dalloc(4 * (size_t)N);
    void *dDY = up_bf(dy, (int64_t)N * D), *dDX = dalloc(2 * (size_t)N * D), *dDW = dalloc(4 * (size_t)D), *ws2 = dalloc(mt_cuda_rmsnorm_backward_workspace(N, D));
    ok = !mt_cuda_rmsnorm_forward(CU, dY, (float *)dR, dX, (float *)dW, N, D, 1e-6f) &&
         !mt_cuda_rmsnorm_backward(CU, dDX, (float *)dDW, dDY, dX, (float *)dW, (float *)dR, N, D, ws2);
    float *gy = down_bf(dY, (int64_t)N * D), *gr = (float *)down(dR, 4 * (size_t)N), *gdx = down_bf(dDX, (int64_t)N * D), *gdw = (float *)down(dDW, 4 * (size_t)D);
    double r1 = rel(gy, y, (int64_t)N * D), r2 = rel(gr, rs, N), r3 = rel(gdx, dxr, (int64_t)N * D), r4 = rel(gdw, dwr, D);
    report("gpu rmsnorm fwd/bwd", ok && r1 < BF_TOL && r2 < F32_TOL && r3 < BF_TOL && r4 < F32_TOL, "y %.1e rstd %.1e dx %.1e dw %.1e", r1, r2, r3, r4);
    /* the fused residual add + RMSNorm and RMSNorm backward + add equal the unfused pairs bit for bit */
    float *xb = randn((int64_t)N * D, 1), *acc = randn((int64_t)N * D, 1);
    round_bf(xb, (int64_t)N * D); round_bf(acc, (int64_t)N * D);
    void *dB = up_bf(xb, (int64_t)N * D), *dAcc = up_bf(acc, (int64_t)N * D), *h1 = dalloc(2 * (size_t)N * D), *h2 = dalloc(2 * (size_t)N * D);
    void *y1 = dalloc(2 * (size_t)N * D), *y2 = dalloc(2 * (size_t)N * D), *r1_ = dalloc(4 * (size_t)N), *r2_ = dalloc(4 * (size_t)N);
    void *g1 = dalloc(2 * (size_t)N * D), *g2 = dalloc(2 * (size_t)N * D), *gsum = dalloc(2 * (size_t)N * D), *w1 = dalloc(4 * (size_t)D), *w2 = dalloc(4 * (size_t)D);
    ok = !mt_cuda_add(CU, h1, dX, dB, (int64_t)N * D, MT_BF16) && !mt_cuda_rmsnorm_forward(CU, y1, (float *)r1_, h1, (float *)dW, N, D, 1e-6f) &&
         !mt_cuda_add_rmsnorm_forward(CU, h2, y2, (float *)r2_, dX, dB, (float *)dW, N, D, 1e-6f) &&
         !mt_cuda_rmsnorm_backward(CU, g1, (float *)w1, dDY, h1, (float *)dW, (float *)r1_, N, D, ws2) &&
         !mt_cuda_add(CU, gsum, dAcc, g1, (int64_t)N * D, MT_BF16) &&
         !mt_cuda_rmsnorm_backward_add(CU, g2, (float *)w2, dDY, h1, (float *)dW, (float *)r1_, dAcc, N, D, ws2);
    void *a1 = down(h1, 2 * (size_t)N * D), *a2 = down(h2, 2 * (size_t)N * D), *b1 = down(y1, 2 * (size_t)N * D), *b2 = down(y2, 2 * (size_t)N * D);
    void *c1 = down(gsum, 2 * (size_t)N * D), *c2 = down(g2, 2 * (size_t)N * D), *e1_ = down(w1, 4 * (size_t)D), *e2_ = down(w2, 4 * (size_t)D);
    int same = !memcmp(a1, a2, 2 * (size_t)N * D) && !memcmp(b1, b2, 2 * (size_t)N * D) && !memcmp(c1, c2, 2 * (size_t)N * D) && !memcmp(e1_, e2_, 4 * (size_t)D);
    report("gpu fused add+rmsnorm, rmsnorm_bwd+add: bitwise", ok && same, NULL);
    free(xb); free(acc); free(a1); free(a2); free(b1); free(b2); free(c1); free(c2); free(e1_); free(e2_);
    dfree(dB); dfree(dAcc); dfree(h1); dfree(h2); dfree(y1); dfree(y2); dfree(r1_); dfree(r2_); dfree(g1); dfree(g2); dfree(gsum); dfree(w1); dfree(w2);
    free(xr); free(w); free(dy); free(y); free(rs); free(dxr); free(dwr); free(gy); free(gr); free(gdx); free(gdw);
    dfree(dX); dfree(dW); dfree(dY); dfree(dR); dfree(dDY); dfree(dDX); dfree(dDW); dfree(ws2);

    /* SwiGLU and add: a length the 8-wide path takes, and one it does not */
    for (int64_t n = 5000; n <= 5001; n++) {
    float *g = randn(n, 2), *u = randn(n, 1), *dh = randn(n, 1);
    round_bf(g, n); round_bf(u, n); round_bf(dh, n);
    float *h = (float *)malloc(4 * n), *dg = (float *)malloc(4 * n), *du = (float *)malloc(4 * n), *ad = (float *)malloc(4 * n);
    mt_cpu_swiglu_forward(h, g, u, n); mt_cpu_swiglu_backward(dg, du, g, u, dh, n); mt_cpu_add(ad, g, u, n);
    void *Dg = up_bf(g, n), *Du = up_bf(u, n), *Ddh = up_bf(dh, n), *Dh = dalloc(2 * n), *Ddg = dalloc(2 * n), *Ddu = dalloc(2 * n), *Dad = dalloc(2 * n);
    ok = !mt_cuda_swiglu_forward(CU, Dh, Dg, Du, n, NULL, 0) && !mt_cuda_swiglu_backward(CU, Ddg, Ddu, Dg, Du, Ddh, n, NULL, 0) && !mt_cuda_add(CU, Dad, Dg, Du, n, MT_BF16);
    float *gh = down_bf(Dh, n), *gdg = down_bf(Ddg, n), *gdu = down_bf(Ddu, n), *gad = down_bf(Dad, n);
    r1 = rel(gh, h, n); r2 = rel(gdg, dg, n); r3 = rel(gdu, du, n); r4 = rel(gad, ad, n);
    char nm[64];
    snprintf(nm, sizeof nm, "gpu swiglu fwd/bwd, add (n=%lld)", (long long)n);
    report(nm, ok && r1 < BF_TOL && r2 < BF_TOL && r3 < BF_TOL && r4 < BF_TOL, "%.1e %.1e %.1e %.1e", r1, r2, r3, r4);
    free(g); free(u); free(dh); free(h); free(dg); free(du); free(ad); free(gh); free(gdg); free(gdu); free(gad);
    dfree(Dg); dfree(Du); dfree(Ddh); dfree(Dh); dfree(Ddg); dfree(Ddu); dfree(Dad);
    }
}

/* The row kernels (RMSNorm, MoE permute / combine, cross-entropy, embedding backward, split / concat, gradient
 * norm) on shapes that take their 16-byte path (rows a multiple of 8 elements), their element path (not), rows
 * longer than a lane's register cache (over 2048) or than the one-pass RMSNorm backward takes (over 2456), and
 * odd row counts: each against the CPU, and each rerun bitwise. */
static int dsame(const void *a, const void *b, size_t bytes) {
    void *x = down(a, bytes), *y = down(b, bytes);
    int s = !memcmp(x, y, bytes);
    free(x); free(y);
    return s;
}
static void gpu_test_rows(void) {
    static const int rms[][2] = {{37, 2048}, {70, 2056}, {41, 1024}, {19, 100}, {9, 2601}, {7, 3080}, {5, 8}, {3, 7}};
    for (int t = 0; t < (int)(sizeof rms / sizeof rms[0]); t++) {
        int N = rms[t][0], D = rms[t][1];
        int64_t ND = (int64_t)N * D;
        float *x = randn(ND, 2), *b = randn(ND, 1), *w = randn(D, 1), *dy = randn(ND, 1), *acc = randn(ND, 1);
        round_bf(x, ND); round_bf(b, ND); round_bf(dy, ND); round_bf(acc, ND);
        float *y = (float *)malloc(4 * (size_t)ND), *rs = (float *)malloc(4 * (size_t)N), *dx = (float *)malloc(4 * (size_t)ND), *dw = (float *)malloc(4 * (size_t)D);
        mt_cpu_rmsnorm_forward(y, rs, x, w, N, D, 1e-6f);
        mt_cpu_rmsnorm_backward(dx, dw, dy, x, w, rs, N, D);
        void *X = up_bf(x, ND), *B = up_bf(b, ND), *W = up(w, 4 * (size_t)D), *DY = up_bf(dy, ND), *ACC = up_bf(acc, ND);
        void *ws = dalloc(mt_cuda_rmsnorm_backward_workspace(N, D));
        void *Y[2], *RS[2], *DX[2], *DW[2], *H[2], *DXA[2], *DWA[2], *HY[2], *HR[2];
        int ok = 1;
        for (int r = 0; r < 2; r++) {
            Y[r] = dalloc(2 * (size_t)ND); RS[r] = dalloc(4 * (size_t)N); DX[r] = dalloc(2 * (size_t)ND); DW[r] = dalloc(4 * (size_t)D);
            H[r] = dalloc(2 * (size_t)ND); DXA[r] = dalloc(2 * (size_t)ND); DWA[r] = dalloc(4 * (size_t)D); HY[r] = dalloc(2 * (size_t)ND); HR[r] = dalloc(4 * (size_t)N);
            ok &= !mt_cuda_rmsnorm_forward(CU, Y[r], (float *)RS[r], X, (float *)W, N, D, 1e-6f) &&
                  !mt_cuda_rmsnorm_backward(CU, DX[r], (float *)DW[r], DY, X, (float *)W, (float *)RS[r], N, D, ws) &&
                  !mt_cuda_add_rmsnorm_forward(CU, H[r], HY[r], (float *)HR[r], X, B, (float *)W, N, D, 1e-6f) &&
                  !mt_cuda_rmsnorm_backward_add(CU, DXA[r], (float *)DWA[r], DY, X, (float *)W, (float *)RS[r], ACC, N, D, ws);
        }
        /* the unfused pairs, for the fused nodes' bitwise equality */
        void *h1 = dalloc(2 * (size_t)ND), *y1 = dalloc(2 * (size_t)ND), *r1 = dalloc(4 * (size_t)N), *g1 = dalloc(2 * (size_t)ND);
        ok &= !mt_cuda_add(CU, h1, X, B, ND, MT_BF16) && !mt_cuda_rmsnorm_forward(CU, y1, (float *)r1, h1, (float *)W, N, D, 1e-6f) &&
              !mt_cuda_add(CU, g1, ACC, DX[0], ND, MT_BF16);
        float *gy = down_bf(Y[0], ND), *gr = (float *)down(RS[0], 4 * (size_t)N), *gdx = down_bf(DX[0], ND), *gdw = (float *)down(DW[0], 4 * (size_t)D);
        double e1 = rel(gy, y, ND), e2 = rel(gr, rs, N), e3 = rel(gdx, dx, ND), e4 = rel(gdw, dw, D);
        int rerun = 1, fused = dsame(h1, H[0], 2 * (size_t)ND) && dsame(y1, HY[0], 2 * (size_t)ND) && dsame(r1, HR[0], 4 * (size_t)N) &&
                              dsame(g1, DXA[0], 2 * (size_t)ND) && dsame(DW[0], DWA[0], 4 * (size_t)D);
        void *p0[] = {Y[0], RS[0], DX[0], DW[0], H[0], DXA[0], DWA[0], HY[0], HR[0]}, *p1[] = {Y[1], RS[1], DX[1], DW[1], H[1], DXA[1], DWA[1], HY[1], HR[1]};
        size_t nb[] = {2 * (size_t)ND, 4 * (size_t)N, 2 * (size_t)ND, 4 * (size_t)D, 2 * (size_t)ND, 2 * (size_t)ND, 4 * (size_t)D, 2 * (size_t)ND, 4 * (size_t)N};
        for (int i = 0; i < 9; i++) rerun &= dsame(p0[i], p1[i], nb[i]);
        char nm[96];
        snprintf(nm, sizeof nm, "gpu rmsnorm rows N=%d D=%d", N, D);
        report(nm, ok && e1 < BF_TOL && e2 < F32_TOL && e3 < BF_TOL && e4 < F32_TOL && rerun && fused,
               "y %.1e rstd %.1e dx %.1e dw %.1e, fused = pair %s, rerun %s", e1, e2, e3, e4, fused ? "bitwise" : "DIFFERS", rerun ? "bitwise" : "DIFFERS");
        free(x); free(b); free(w); free(dy); free(acc); free(y); free(rs); free(dx); free(dw); free(gy); free(gr); free(gdx); free(gdw);
        dfree(X); dfree(B); dfree(W); dfree(DY); dfree(ACC); dfree(ws); dfree(h1); dfree(y1); dfree(r1); dfree(g1);
        for (int r = 0; r < 2; r++) { dfree(Y[r]); dfree(RS[r]); dfree(DX[r]); dfree(DW[r]); dfree(H[r]); dfree(DXA[r]); dfree(DWA[r]); dfree(HY[r]); dfree(HR[r]); }
    }

    static const int moe[][4] = {{37, 2048, 6, 8}, {21, 2056, 3, 5}, {23, 100, 2, 4}, {9, 2601, 6, 8}, {1, 8, 1, 1}};
    for (int t = 0; t < (int)(sizeof moe / sizeof moe[0]); t++) {
        int N = moe[t][0], D = moe[t][1], K = moe[t][2], E = moe[t][3];
        int64_t NK = (int64_t)N * K, ND = (int64_t)N * D;
        int32_t *idx = (int32_t *)malloc(4 * (size_t)NK), *slot = (int32_t *)malloc(4 * (size_t)NK), offs[16];
        for (int n = 0; n < N; n++)
            for (int k = 0; k < K; k++) idx[n * K + k] = (n * 7 + k) % E;   /* distinct experts per token */
        float *x = randn(ND, 1), *w = randn(NK, 1), *ys = randn(NK * D, 1), *dy = randn(ND, 1);
        round_bf(x, ND); round_bf(ys, NK * D); round_bf(dy, ND);
        float *xs = (float *)malloc(4 * (size_t)(NK * D)), *yo = (float *)malloc(4 * (size_t)ND), *dys = (float *)malloc(4 * (size_t)(NK * D));
        float *dwk = (float *)malloc(4 * (size_t)NK), *dxp = (float *)malloc(4 * (size_t)ND);
        mt_cpu_moe_permute(xs, slot, offs, x, idx, N, D, K, E);
        mt_cpu_moe_combine_forward(yo, ys, slot, w, N, D, K);
        mt_cpu_moe_combine_backward(dys, dwk, dy, ys, slot, w, N, D, K);
        round_bf(dys, NK * D);
        mt_cpu_moe_permute_backward(dxp, dys, slot, N, D, K);
        void *X = up_bf(x, ND), *I = up(idx, 4 * (size_t)NK), *W = up(w, 4 * (size_t)NK), *YS = up_bf(ys, NK * D), *DY = up_bf(dy, ND);
        void *pws = dalloc(mt_cuda_moe_permute_workspace(NK));
        void *XS[2], *SL[2], *OF[2], *YO[2], *DYS[2], *DWK[2], *DXP[2];
        int ok = 1;
        for (int r = 0; r < 2; r++) {
            XS[r] = dalloc(2 * (size_t)(NK * D)); SL[r] = dalloc(4 * (size_t)NK); OF[r] = dalloc(4 * (size_t)(E + 1)); YO[r] = dalloc(2 * (size_t)ND);
            DYS[r] = dalloc(2 * (size_t)(NK * D)); DWK[r] = dalloc(4 * (size_t)NK); DXP[r] = dalloc(2 * (size_t)ND);
            ok &= !mt_cuda_moe_permute(CU, XS[r], (int32_t *)SL[r], (int32_t *)OF[r], X, (int32_t *)I, N, D, K, E, pws) &&
                  !mt_cuda_moe_combine_forward(CU, YO[r], YS, (int32_t *)SL[r], (float *)W, N, D, K) &&
                  !mt_cuda_moe_combine_backward(CU, DYS[r], (float *)DWK[r], DY, YS, (int32_t *)SL[r], (float *)W, N, D, K) &&
                  !mt_cuda_moe_permute_backward(CU, DXP[r], DYS[r], (int32_t *)SL[r], N, D, K);
        }
        int32_t *gslot = (int32_t *)down(SL[0], 4 * (size_t)NK), *goffs = (int32_t *)down(OF[0], 4 * (size_t)(E + 1));
        float *gxs = down_bf(XS[0], NK * D), *gyo = down_bf(YO[0], ND), *gdys = down_bf(DYS[0], NK * D), *gdw = (float *)down(DWK[0], 4 * (size_t)NK), *gdx = down_bf(DXP[0], ND);
        int exact = !memcmp(gslot, slot, 4 * (size_t)NK) && !memcmp(goffs, offs, 4 * (size_t)(E + 1)) && rel(gxs, xs, NK * D) == 0;
        double c1 = rel(gyo, yo, ND), c2 = rel(gdys, dys, NK * D), c3 = rel(gdw, dwk, NK), c4 = rel(gdx, dxp, ND);
        int rerun = dsame(XS[0], XS[1], 2 * (size_t)(NK * D)) && dsame(YO[0], YO[1], 2 * (size_t)ND) && dsame(DYS[0], DYS[1], 2 * (size_t)(NK * D)) &&
                    dsame(DWK[0], DWK[1], 4 * (size_t)NK) && dsame(DXP[0], DXP[1], 2 * (size_t)ND);
        char nm[96];
        snprintf(nm, sizeof nm, "gpu moe permute/combine rows N=%d D=%d K=%d", N, D, K);
        report(nm, ok && exact && c1 < BF_TOL && c2 < BF_TOL && c3 < F32_TOL && c4 < BF_TOL && rerun,
               "permute %s, combine %.1e dys %.1e dw %.1e dx %.1e, rerun %s", exact ? "exact" : "DIFFERS", c1, c2, c3, c4, rerun ? "bitwise" : "DIFFERS");
        free(idx); free(slot); free(x); free(w); free(ys); free(dy); free(xs); free(yo); free(dys); free(dwk); free(dxp);
        free(gslot); free(goffs); free(gxs); free(gyo); free(gdys); free(gdw); free(gdx);
        dfree(X); dfree(I); dfree(W); dfree(YS); dfree(DY); dfree(pws);
        for (int r = 0; r < 2; r++) { dfree(XS[r]); dfree(SL[r]); dfree(OF[r]); dfree(YO[r]); dfree(DYS[r]); dfree(DWK[r]); dfree(DXP[r]); }
    }

    static const int ce[][2] = {{5, 40000}, {3, 40001}, {7, 4096}, {2, 9}};
    for (int t = 0; t < (int)(sizeof ce / sizeof ce[0]); t++) {
        int N = ce[t][0], V = ce[t][1];
        int64_t NV = (int64_t)N * V;
        float *lg = randn(NV, 3);
        round_bf(lg, NV);
        int32_t *tg = (int32_t *)malloc(4 * (size_t)N);
        for (int i = 0; i < N; i++) tg[i] = (int32_t)(mt_rng_u64(&R) % (uint64_t)V);
        float loss, *lse = (float *)malloc(4 * (size_t)N), *dl = (float *)malloc(4 * (size_t)NV);
        mt_cpu_cross_entropy_forward(NULL, &loss, lse, lg, tg, N, V, N);
        mt_cpu_cross_entropy_backward(NULL, dl, lg, lse, tg, N, V, 1.0 / N);
        void *L = up_bf(lg, NV), *T = up(tg, 4 * (size_t)N), *ws = dalloc(mt_cuda_cross_entropy_workspace(N));
        void *LOSS[2], *LSE[2], *DL[2];
        int ok = 1;
        for (int r = 0; r < 2; r++) {
            LOSS[r] = dalloc(4); LSE[r] = dalloc(4 * (size_t)N); DL[r] = dalloc(2 * (size_t)NV);
            ok &= !mt_cuda_cross_entropy_forward(CU, (float *)LOSS[r], (float *)LSE[r], L, (int32_t *)T, N, V, N, ws) &&
                  !mt_cuda_cross_entropy_backward(CU, DL[r], L, (float *)LSE[r], (int32_t *)T, N, V, 1.0f / N);
        }
        float gl, *glse = (float *)down(LSE[0], 4 * (size_t)N), *gdl = down_bf(DL[0], NV);
        mt_cuda_copy(CU, &gl, LOSS[0], 4, 1);
        double e1 = fabs(gl - loss) / loss, e2 = rel(glse, lse, N), e3 = rel(gdl, dl, NV);
        int rerun = dsame(LOSS[0], LOSS[1], 4) && dsame(LSE[0], LSE[1], 4 * (size_t)N) && dsame(DL[0], DL[1], 2 * (size_t)NV);
        char nm[96];
        snprintf(nm, sizeof nm, "gpu cross-entropy rows N=%d V=%d", N, V);
        report(nm, ok && e1 < F32_TOL && e2 < F32_TOL && e3 < BF_TOL && rerun, "loss %.1e lse %.1e dlogits %.1e, rerun %s", e1, e2, e3, rerun ? "bitwise" : "DIFFERS");
        free(lg); free(tg); free(lse); free(dl); free(glse); free(gdl);
        dfree(L); dfree(T); dfree(ws);
        for (int r = 0; r < 2; r++) { dfree(LOSS[r]); dfree(LSE[r]); dfree(DL[r]); }
    }

    /* embedding backward: the 16-byte path (D a multiple of 8) and the element path, many repeated tokens */
    static const int emb[][3] = {{300, 2056, 50}, {77, 100, 9}};
    for (int t = 0; t < (int)(sizeof emb / sizeof emb[0]); t++) {
        int N = emb[t][0], D = emb[t][1], V = emb[t][2];
        int64_t ND = (int64_t)N * D;
        int32_t *tok = (int32_t *)malloc(4 * (size_t)N);
        for (int i = 0; i < N; i++) tok[i] = (int32_t)(mt_rng_u64(&R) % 7) * (V / 7);
        float *dx = randn(ND, 1), *dw = (float *)malloc(4 * (size_t)V * D);
        round_bf(dx, ND);
        mt_cpu_embed_backward(dw, dx, tok, N, V, D);
        void *TK = up(tok, 4 * (size_t)N), *DX = up_bf(dx, ND), *ws = dalloc(mt_cuda_embed_backward_workspace(N, D)), *DW[2];
        int ok = 1;
        for (int r = 0; r < 2; r++) { DW[r] = dalloc(4 * (size_t)V * D); ok &= !mt_cuda_embed_backward(CU, (float *)DW[r], DX, (int32_t *)TK, N, V, D, ws); }
        float *gw = (float *)down(DW[0], 4 * (size_t)V * D);
        double e = rel(gw, dw, (int64_t)V * D);
        int rerun = dsame(DW[0], DW[1], 4 * (size_t)V * D);
        char nm[96];
        snprintf(nm, sizeof nm, "gpu embedding bwd rows N=%d D=%d", N, D);
        report(nm, ok && e < F32_TOL && rerun, "%.1e, rerun %s", e, rerun ? "bitwise" : "DIFFERS");
        /* FSDP shards of the gradient (S = 2, 3, 4: ceil(V*D/S) each, the last padded with zeros; rows cut
         * mid-way, and ranges not a multiple of 4 for the element path) = the whole one's elements, bitwise */
        int shards_ok = ok, bad_at = -1;
        for (int S = 2; S <= 4; S++) {
            int64_t L = ((int64_t)V * D + S - 1) / S;
            void *SH = dalloc(4 * (size_t)L);
            for (int r = 0; r < S; r++) {
                shards_ok &= !mt_cuda_embed_backward_range(CU, (float *)SH, DX, (int32_t *)TK, N, V, D, r * L, L, ws);
                float *sh = (float *)down(SH, 4 * (size_t)L);
                for (int64_t i = 0; i < L; i++) {
                    int64_t at = r * L + i;
                    float want = at < (int64_t)V * D ? gw[at] : 0.0f;
                    if (memcmp(&sh[i], &want, 4)) { shards_ok = 0; bad_at = (int)at; break; }
                }
                free(sh);
            }
            dfree(SH);
        }
        snprintf(nm, sizeof nm, "gpu embedding bwd FSDP shards = the whole, N=%d D=%d", N, D);
        report(nm, shards_ok, "S = 2, 3, 4%s", bad_at >= 0 ? ": DIFFERS" : ": bitwise");
        free(tok); free(dx); free(dw); free(gw);
        dfree(TK); dfree(DX); dfree(ws); dfree(DW[0]); dfree(DW[1]);
    }

    /* split / concat: parts of whole 16-byte chunks (one kernel) or not (2D copies); concat with a missing part
     * writes zeros. Exact. */
    static const int sp[][4] = {{33, 40, 24, 2}, {300, 512, 64, 2}, {5, 300, 4, 4}, {3, 4096, 8, 2}, {9, 13, 7, 2}, {4, 8, 3, 4}};
    for (int t = 0; t < (int)(sizeof sp / sizeof sp[0]); t++) {
        int N = sp[t][0], a = sp[t][1], b = sp[t][2], esz = sp[t][3];
        size_t ra = (size_t)a * esz, rb = (size_t)b * esz, rr = ra + rb;
        uint8_t *x = (uint8_t *)malloc(rr * N), *e1 = (uint8_t *)malloc(ra * N), *e2 = (uint8_t *)malloc(rb * N), *z = (uint8_t *)malloc(rr * N);
        for (size_t i = 0; i < rr * N; i++) x[i] = (uint8_t)mt_rng_u64(&R);
        for (int r = 0; r < N; r++) { memcpy(e1 + r * ra, x + r * rr, ra); memcpy(e2 + r * rb, x + r * rr + ra, rb); }
        void *X = up(x, rr * N), *X1 = dalloc(ra * N), *X2 = dalloc(rb * N), *C = dalloc(rr * N), *C1 = dalloc(rr * N), *C2 = dalloc(rr * N);
        int ok = !mt_cuda_split(CU, X1, X2, X, N, a, b, esz) && !mt_cuda_concat(CU, C, X1, X2, N, a, b, esz) &&
                 !mt_cuda_concat(CU, C1, NULL, X2, N, a, b, esz) && !mt_cuda_concat(CU, C2, X1, NULL, N, a, b, esz);
        uint8_t *g1 = (uint8_t *)down(X1, ra * N), *g2 = (uint8_t *)down(X2, rb * N), *gc = (uint8_t *)down(C, rr * N);
        uint8_t *h1 = (uint8_t *)down(C1, rr * N), *h2 = (uint8_t *)down(C2, rr * N);
        int exact = !memcmp(g1, e1, ra * N) && !memcmp(g2, e2, rb * N) && !memcmp(gc, x, rr * N);
        memcpy(z, x, rr * N);
        for (int r = 0; r < N; r++) memset(z + r * rr, 0, ra);
        exact &= !memcmp(h1, z, rr * N);
        memcpy(z, x, rr * N);
        for (int r = 0; r < N; r++) memset(z + r * rr + ra, 0, rb);
        exact &= !memcmp(h2, z, rr * N);
        char nm[96];
        snprintf(nm, sizeof nm, "gpu split/concat rows N=%d a=%d b=%d esz=%d", N, a, b, esz);
        report(nm, ok && exact, exact ? "exact, zeros for a missing part" : "DIFFERS");
        free(x); free(e1); free(e2); free(z); free(g1); free(g2); free(gc); free(h1); free(h2);
        dfree(X); dfree(X1); dfree(X2); dfree(C); dfree(C1); dfree(C2);
    }

    /* gradient norm: one block, many blocks with the unrolled steps and their remainder, the element path, and
     * the plain sum of partials (squares = 0), added to an incoming value */
    static const int64_t ssn[][2] = {{1000, 1}, {70000, 1}, {3000000, 1}, {3000001, 1}, {20000000, 1}, {5000, 0}, {5003, 0}};
    for (int t = 0; t < (int)(sizeof ssn / sizeof ssn[0]); t++) {
        int64_t n = ssn[t][0];
        int squares = (int)ssn[t][1];
        float *g = randn(n, 0.1), in = 0.25f;
        if (!squares) for (int64_t i = 0; i < n; i++) g[i] = g[i] * g[i];
        double ref = in;
        for (int64_t i = 0; i < n; i++) ref += squares ? (double)g[i] * g[i] : (double)g[i];
        void *G = up(g, 4 * (size_t)n), *IN = up(&in, 4), *ws = dalloc(mt_cuda_sumsq_workspace()), *O[2];
        int ok = 1;
        for (int r = 0; r < 2; r++) { O[r] = dalloc(4); ok &= !mt_cuda_sumsq(CU, (float *)O[r], (float *)IN, (float *)G, n, squares, ws); }
        float got;
        mt_cuda_copy(CU, &got, O[0], 4, 1);
        double e = fabs(got - ref) / ref;
        int rerun = dsame(O[0], O[1], 4);
        char nm[96];
        snprintf(nm, sizeof nm, "gpu grad-norm sum n=%lld squares=%d", (long long)n, squares);
        report(nm, ok && e < F32_TOL && rerun, "%.1e, rerun %s", e, rerun ? "bitwise" : "DIFFERS");
        free(g);
        dfree(G); dfree(IN); dfree(ws); dfree(O[0]); dfree(O[1]);
    }
}

static void gpu_test_matmul(void) {
    int M = 130, Nn = 72, K = 200;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int mode = 0; mode < 3; mode++) {   /* bf16->bf16, bf16->f32, f32 x bf16 -> bf16 (exact f32 path) */
                float *A = randn((int64_t)M * K, 1), *B = randn((int64_t)K * Nn, 1), *C = (float *)malloc(4 * (size_t)M * Nn);
                round_bf(B, (int64_t)K * Nn);
                if (mode < 2) round_bf(A, (int64_t)M * K);
                mt_cpu_matmul(NULL, C, A, B, M, Nn, K, ta, tb);
                int at = mode < 2 ? MT_BF16 : MT_F32, ct = mode == 1 ? MT_F32 : MT_BF16;
                void *dA = at == MT_BF16 ? up_bf(A, (int64_t)M * K) : up(A, 4 * (size_t)M * K), *dB = up_bf(B, (int64_t)K * Nn);
                void *dC = dalloc((ct == MT_BF16 ? 2 : 4) * (size_t)M * Nn), *ws = dalloc(mt_cuda_matmul_workspace(M, Nn, K, ct, at, MT_BF16));
                int ok = !mt_cuda_matmul(CU, dC, ct, dA, at, dB, MT_BF16, M, Nn, K, ta, tb, ws, NULL);
                float *gc = ct == MT_BF16 ? down_bf(dC, (int64_t)M * Nn) : (float *)down(dC, 4 * (size_t)M * Nn);
                double e = rel(gc, C, (int64_t)M * Nn), tol = ct == MT_BF16 ? BF_TOL : F32_TOL;
                char nm[80];
                snprintf(nm, sizeof nm, "gpu matmul ta=%d tb=%d %s", ta, tb, mode == 0 ? "bf16->bf16" : mode == 1 ? "bf16->f32" : "f32 path");
                report(nm, ok && e < tol, "rel %.1e", e);
                free(A); free(B); free(C); free(gc);
                dfree(dA); dfree(dB); dfree(dC); dfree(ws);
            }
    /* the GEMM epilogue sum (MATMUL_ACC): acc + op(A) op(B). bf16 path: one rounding, close to the
       reference; f32 path: bitwise the GEMM followed by the ADD it replaces */
    for (int mode = 0; mode < 3; mode++) {
        int ta = 0, tb = mode != 1;
        float *A = randn((int64_t)M * K, 1), *B = randn((int64_t)K * Nn, 1), *C = (float *)malloc(4 * (size_t)M * Nn), *Acc = randn((int64_t)M * Nn, 1);
        round_bf(B, (int64_t)K * Nn); round_bf(Acc, (int64_t)M * Nn);
        if (mode < 2) round_bf(A, (int64_t)M * K);
        mt_cpu_matmul(NULL, C, A, B, M, Nn, K, ta, tb);
        for (int64_t i = 0; i < (int64_t)M * Nn; i++) C[i] += Acc[i];
        int at = mode < 2 ? MT_BF16 : MT_F32, ct = mode == 1 ? MT_F32 : MT_BF16;
        size_t cb = (ct == MT_BF16 ? 2 : 4) * (size_t)M * Nn;
        void *dA = at == MT_BF16 ? up_bf(A, (int64_t)M * K) : up(A, 4 * (size_t)M * K), *dB = up_bf(B, (int64_t)K * Nn);
        void *dAcc = ct == MT_BF16 ? up_bf(Acc, (int64_t)M * Nn) : up(Acc, cb);
        void *dC = dalloc(cb), *dU = dalloc(cb), *ws = dalloc(mt_cuda_matmul_workspace(M, Nn, K, ct, at, MT_BF16));
        int ok = !mt_cuda_matmul(CU, dC, ct, dA, at, dB, MT_BF16, M, Nn, K, ta, tb, ws, dAcc) &&
                 !mt_cuda_matmul(CU, dU, ct, dA, at, dB, MT_BF16, M, Nn, K, ta, tb, ws, NULL) && !mt_cuda_add(CU, dU, dAcc, dU, M * Nn, ct);
        float *gc = ct == MT_BF16 ? down_bf(dC, (int64_t)M * Nn) : (float *)down(dC, cb);
        void *hc = down(dC, cb), *hu = down(dU, cb);
        double e = rel(gc, C, (int64_t)M * Nn), tol = ct == MT_BF16 ? BF_TOL : F32_TOL;
        int same = !memcmp(hc, hu, cb);
        char nm[80];
        snprintf(nm, sizeof nm, "gpu matmul + acc (epilogue) %s", mode == 0 ? "bf16->bf16" : mode == 1 ? "bf16->f32" : "f32 path");
        report(nm, ok && e < tol && (mode < 2 || same), "rel %.1e, %s the unfused pair", e, same ? "bitwise" : "not bitwise");
        free(A); free(B); free(C); free(Acc); free(gc); free(hc); free(hu);
        dfree(dA); dfree(dB); dfree(dAcc); dfree(dC); dfree(dU); dfree(ws);
    }
    /* split / concat */
    int N = 33, a = 40, b = 24;
    float *x = randn((int64_t)N * (a + b), 1), *x1 = (float *)malloc(4 * (size_t)N * a), *x2 = (float *)malloc(4 * (size_t)N * b);
    round_bf(x, (int64_t)N * (a + b));
    mt_cpu_split(x1, x2, x, N, a, b);
    void *dx = up_bf(x, (int64_t)N * (a + b)), *d1 = dalloc(2 * (size_t)N * a), *d2 = dalloc(2 * (size_t)N * b), *dc = dalloc(2 * (size_t)N * (a + b));
    int ok = !mt_cuda_split(CU, d1, d2, dx, N, a, b, 2) && !mt_cuda_concat(CU, dc, d1, d2, N, a, b, 2);
    float *g1 = down_bf(d1, (int64_t)N * a), *g2 = down_bf(d2, (int64_t)N * b), *gc = down_bf(dc, (int64_t)N * (a + b));
    report("gpu split/concat exact", ok && rel(g1, x1, (int64_t)N * a) == 0 && rel(g2, x2, (int64_t)N * b) == 0 && rel(gc, x, (int64_t)N * (a + b)) == 0, NULL);
    free(x); free(x1); free(x2); free(g1); free(g2); free(gc);
    dfree(dx); dfree(d1); dfree(d2); dfree(dc);
}

/* docs = 0: plain causal. docs > 0: about one end-of-text token per `docs` positions, plus
 * documents that start exactly on key-tile boundaries (32, 64, 128) and length-1 documents,
 * so that whole tiles are skipped and partial ones masked. Also checks a bitwise rerun. */
static void gpu_test_attention_shape(int B, int T, int H, int dq, int dv, int docs) {
    int64_t N = (int64_t)B * T, nq = N * H * dq, nv = N * H * dv;
    float scale = 1.0f / sqrtf((float)dq);
    float *Q = randn(nq, 1), *K = randn(nq, 1), *V = randn(nv, 1), *dO = randn(nv, 1);
    round_bf(Q, nq); round_bf(K, nq); round_bf(V, nv); round_bf(dO, nv);
    int32_t *ds = NULL;
    if (docs > 0) {
        int32_t *tok = (int32_t *)malloc(4 * (size_t)N);
        for (int64_t i = 0; i < N; i++) tok[i] = mt_rng_u64(&R) % (uint64_t)docs == 0 ? 0 : 1;
        const int at[] = {31, 63, 64, 127, 128, 129, 255};   /* documents start at at[i] + 1 */
        for (int b = 0; b < B; b += 2)
            for (int i = 0; i < (int)(sizeof at / sizeof at[0]); i++) if (at[i] < T) tok[(int64_t)b * T + at[i]] = 0;
        ds = (int32_t *)malloc(4 * (size_t)N);
        mt_cpu_doc_starts(ds, tok, (int)N, T, 0);
        free(tok);
    }
    float *O = (float *)malloc(4 * nv), *L = (float *)malloc(4 * N * H), *dQ = (float *)malloc(4 * nq), *dK = (float *)malloc(4 * nq), *dV = (float *)malloc(4 * nv);
    mt_cpu_attention_forward(NULL, O, L, Q, K, V, ds, B, T, H, dq, dv, scale);
    round_bf(O, nv);   /* the GPU backward reads the bf16 output */
    mt_cpu_attention_backward(NULL, dQ, dK, dV, Q, K, V, O, L, dO, ds, B, T, H, dq, dv, scale);
    void *dQ_ = up_bf(Q, nq), *dK_ = up_bf(K, nq), *dV_ = up_bf(V, nv), *ddO = up_bf(dO, nv), *dOo = dalloc(2 * nv), *dL = dalloc(4 * N * H);
    void *gQ = dalloc(2 * nq), *gK = dalloc(2 * nq), *gV = dalloc(2 * nv), *ws = dalloc(mt_cuda_attention_backward_workspace(CU, B, T, H, dq, dv));
    int32_t *dds = ds ? (int32_t *)up(ds, 4 * (size_t)N) : NULL;
    int ok = !mt_cuda_attention_forward(CU, dQ_, dK_, dV_, dds, dOo, (float *)dL, B, T, H, dq, dv, scale);
    float *go = down_bf(dOo, nv), *gl = (float *)down(dL, 4 * N * H);
    double e1 = rel(go, O, nv), e2 = rel(gl, L, N * H);
    ok = ok && !mt_cuda_attention_backward(CU, dQ_, dK_, dV_, dOo, (float *)dL, ddO, dds, gQ, gK, gV, ws, B, T, H, dq, dv, scale);
    float *gq = down_bf(gQ, nq), *gk = down_bf(gK, nq), *gv = down_bf(gV, nv);
    double e3 = rel(gq, dQ, nq), e4 = rel(gk, dK, nq), e5 = rel(gv, dV, nv);
    /* rerun into freshly poisoned outputs: bitwise the same */
    void *dO2 = dalloc(2 * nv), *dL2 = dalloc(4 * N * H), *gQ2 = dalloc(2 * nq), *gK2 = dalloc(2 * nq), *gV2 = dalloc(2 * nv);
    mt_cuda_memset(CU, ws, 0xff, mt_cuda_attention_backward_workspace(CU, B, T, H, dq, dv));
    ok = ok && !mt_cuda_attention_forward(CU, dQ_, dK_, dV_, dds, dO2, (float *)dL2, B, T, H, dq, dv, scale) &&
         !mt_cuda_attention_backward(CU, dQ_, dK_, dV_, dO2, (float *)dL2, ddO, dds, gQ2, gK2, gV2, ws, B, T, H, dq, dv, scale);
    void *h1[5] = {down(dOo, 2 * nv), down(dL, 4 * N * H), down(gQ, 2 * nq), down(gK, 2 * nq), down(gV, 2 * nv)};
    void *h2[5] = {down(dO2, 2 * nv), down(dL2, 4 * N * H), down(gQ2, 2 * nq), down(gK2, 2 * nq), down(gV2, 2 * nv)};
    size_t nb[5] = {2 * (size_t)nv, 4 * (size_t)(N * H), 2 * (size_t)nq, 2 * (size_t)nq, 2 * (size_t)nv};
    int same = 1;
    for (int i = 0; i < 5; i++) { same &= !memcmp(h1[i], h2[i], nb[i]); free(h1[i]); free(h2[i]); }
    /* the backward again with dQ recomputing S and dP instead of reading the stored dS: dK and dV bitwise the
       same, dQ within the tolerance */
    mt_cuda_set_attn_recompute_dq(CU, 1);
    int ok_r = !mt_cuda_attention_backward(CU, dQ_, dK_, dV_, dOo, (float *)dL, ddO, dds, gQ2, gK2, gV2, ws, B, T, H, dq, dv, scale);
    mt_cuda_set_attn_recompute_dq(CU, 0);
    float *rq = down_bf(gQ2, nq);
    void *rk = down(gK2, 2 * nq), *rv = down(gV2, 2 * nv), *k1 = down(gK, 2 * nq), *v1 = down(gV, 2 * nv);
    double e6 = rel(rq, dQ, nq);
    ok_r = ok_r && e6 < BF_TOL && !memcmp(rk, k1, 2 * (size_t)nq) && !memcmp(rv, v1, 2 * (size_t)nv);
    free(rq); free(rk); free(rv); free(k1); free(v1);
    char nm[96];
    snprintf(nm, sizeof nm, "gpu attention%s B%d T%d H%d %d/%d", docs ? " doc-masked" : "", B, T, H, dq, dv);
    report(nm, ok && same && ok_r && e1 < BF_TOL && e2 < 1e-4 && e3 < BF_TOL && e4 < BF_TOL && e5 < BF_TOL,
           "O %.1e lse %.1e dQ %.1e dK %.1e dV %.1e; rerun bitwise %s; dQ recomputed %.1e, dK dV bitwise %s", e1, e2, e3, e4, e5,
           same ? "yes" : "NO", e6, ok_r ? "yes" : "NO");
    free(Q); free(K); free(V); free(dO); free(O); free(L); free(dQ); free(dK); free(dV); free(go); free(gl); free(gq); free(gk); free(gv); free(ds);
    dfree(dQ_); dfree(dK_); dfree(dV_); dfree(ddO); dfree(dOo); dfree(dL); dfree(gQ); dfree(gK); dfree(gV); dfree(ws); dfree(dds);
    dfree(dO2); dfree(dL2); dfree(gQ2); dfree(gK2); dfree(gV2);
}

/* DOC_STARTS on the device: exactly the CPU's, long sequences (many positions per thread) too */
static void gpu_test_doc_starts(void) {
    const int shapes[3][2] = {{3, 5000}, {4, 7}, {1, 1500}};
    int ok = 1;
    for (int k = 0; k < 3; k++) {
        int B = shapes[k][0], T = shapes[k][1], N = B * T;
        int32_t *tok = (int32_t *)malloc(4 * (size_t)N), *want = (int32_t *)malloc(4 * (size_t)N);
        for (int i = 0; i < N; i++) tok[i] = (int32_t)(mt_rng_u64(&R) % (k == 1 ? 3 : 60));
        tok[0] = 0; tok[N - 1] = 0;   /* end-of-text first and last */
        mt_cpu_doc_starts(want, tok, N, T, 0);
        int32_t *dt = (int32_t *)up(tok, 4 * (size_t)N), *dd = (int32_t *)dalloc(4 * (size_t)N);
        ok &= !mt_cuda_doc_starts(CU, dd, dt, N, T, 0);
        int32_t *got = (int32_t *)down(dd, 4 * (size_t)N);
        ok &= !memcmp(got, want, 4 * (size_t)N);
        free(tok); free(want); free(got); dfree(dt); dfree(dd);
    }
    report("gpu document starts = CPU", ok, NULL);
}

static void gpu_test_rope(int dn, int dv) {
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "tiny", &e);
    c.seq_len = 20; c.qk_rope_head_dim = 16; c.rope_factor = 4; c.original_seq_len = 8;
    int T = 20, N = 40, H = 3, dr = 16, half = 8;
    float *cs = (float *)malloc(4 * T * half), *sn = (float *)malloc(4 * T * half);
    mt_cpu_rope_tables(cs, sn, &c);
    int64_t nq = (int64_t)N * H * (dn + dr), nkv = (int64_t)N * H * (dn + dv), nv = (int64_t)N * H * dv;
    float *q = randn(nq, 1), *kv = randn(nkv, 1), *kpe = randn((int64_t)N * dr, 1), *gQ = randn(nq, 1), *gK = randn(nq, 1), *gV = randn(nv, 1);
    round_bf(q, nq); round_bf(kv, nkv); round_bf(kpe, (int64_t)N * dr); round_bf(gQ, nq); round_bf(gK, nq); round_bf(gV, nv);
    float *Q = (float *)malloc(4 * nq), *K = (float *)malloc(4 * nq), *Vv = (float *)malloc(4 * nv);
    float *dq = (float *)malloc(4 * nq), *dkv = (float *)malloc(4 * nkv), *dkpe = (float *)malloc(4 * (size_t)N * dr);
    mt_cpu_mla_rope_forward(Q, K, Vv, q, kv, kpe, cs, sn, N, T, H, dn, dr, dv);
    mt_cpu_mla_rope_backward(dq, dkv, dkpe, gQ, gK, gV, cs, sn, N, T, H, dn, dr, dv);
    void *Dq = up_bf(q, nq), *Dkv = up_bf(kv, nkv), *Dkpe = up_bf(kpe, (int64_t)N * dr), *Dc = up(cs, 4 * T * half), *Ds = up(sn, 4 * T * half);
    void *DQ = dalloc(2 * nq), *DK = dalloc(2 * nq), *DV = dalloc(2 * nv), *DgQ = up_bf(gQ, nq), *DgK = up_bf(gK, nq), *DgV = up_bf(gV, nv);
    void *Ddq = dalloc(2 * nq), *Ddkv = dalloc(2 * nkv), *Ddkpe = dalloc(2 * (size_t)N * dr);
    int ok = !mt_cuda_mla_rope_forward(CU, DQ, DK, DV, Dq, Dkv, Dkpe, (float *)Dc, (float *)Ds, N, T, H, dn, dr, dv) &&
             !mt_cuda_mla_rope_backward(CU, Ddq, Ddkv, Ddkpe, DgQ, DgK, DgV, (float *)Dc, (float *)Ds, N, T, H, dn, dr, dv);
    float *a1 = down_bf(DQ, nq), *a2 = down_bf(DK, nq), *a3 = down_bf(DV, nv), *a4 = down_bf(Ddq, nq), *a5 = down_bf(Ddkv, nkv), *a6 = down_bf(Ddkpe, (int64_t)N * dr);
    double e1 = rel(a1, Q, nq), e2 = rel(a2, K, nq), e3 = rel(a3, Vv, nv), e4 = rel(a4, dq, nq), e5 = rel(a5, dkv, nkv), e6 = rel(a6, dkpe, (int64_t)N * dr);
    /* rerun into fresh buffers: bitwise the same */
    void *RQ = dalloc(2 * nq), *RK = dalloc(2 * nq), *RV = dalloc(2 * nv), *Rdq = dalloc(2 * nq), *Rdkv = dalloc(2 * nkv), *Rdkpe = dalloc(2 * (size_t)N * dr);
    ok = ok && !mt_cuda_mla_rope_forward(CU, RQ, RK, RV, Dq, Dkv, Dkpe, (float *)Dc, (float *)Ds, N, T, H, dn, dr, dv) &&
         !mt_cuda_mla_rope_backward(CU, Rdq, Rdkv, Rdkpe, DgQ, DgK, DgV, (float *)Dc, (float *)Ds, N, T, H, dn, dr, dv);
    int rerun = dsame(RQ, DQ, 2 * nq) && dsame(RK, DK, 2 * nq) && dsame(RV, DV, 2 * nv) && dsame(Rdq, Ddq, 2 * nq) && dsame(Rdkv, Ddkv, 2 * nkv) &&
                dsame(Rdkpe, Ddkpe, 2 * (size_t)N * dr);
    dfree(RQ); dfree(RK); dfree(RV); dfree(Rdq); dfree(Rdkv); dfree(Rdkpe);
    char nm[64];
    snprintf(nm, sizeof nm, "gpu MLA rope (YaRN) fwd/bwd dn=%d dv=%d", dn, dv);
    report(nm, ok && e1 < BF_TOL && e2 < BF_TOL && e3 == 0 && e4 < BF_TOL && e5 < BF_TOL && e6 < BF_TOL && rerun,
           "%.1e %.1e %.1e %.1e %.1e %.1e, rerun %s", e1, e2, e3, e4, e5, e6, rerun ? "bitwise" : "DIFFERS");
    free(cs); free(sn); free(q); free(kv); free(kpe); free(gQ); free(gK); free(gV); free(Q); free(K); free(Vv); free(dq); free(dkv); free(dkpe);
    free(a1); free(a2); free(a3); free(a4); free(a5); free(a6);
    dfree(Dq); dfree(Dkv); dfree(Dkpe); dfree(Dc); dfree(Ds); dfree(DQ); dfree(DK); dfree(DV); dfree(DgQ); dfree(DgK); dfree(DgV);
    dfree(Ddq); dfree(Ddkv); dfree(Ddkpe);
}

/* RoPE folded into attention (ROPE_PE -> MLA_ATTENTION -> MLA_ATTENTION_BWD -> ROPE_PE_BWD on the
 * wgmma kernels' folded loads and epilogues): every output bitwise the unfolded chain's (MLA_ROPE ->
 * attention -> attention backward -> MLA_ROPE_BWD, itself checked against the CPU above), with YaRN
 * tables, document masking and lengths off the tile grid. */
static void gpu_test_fold_rope(int B, int T, int H, int dn, int dr, int dv, int docs) {
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "tiny", &e);
    c.seq_len = T; c.qk_rope_head_dim = dr; c.rope_factor = 4; c.original_seq_len = T / 2;
    const int half = dr / 2, dq = dn + dr;
    const int64_t N = (int64_t)B * T, nq = N * H * dq, nkv = N * H * (dn + dv), nv = N * H * dv, nr = N * H * dr;
    float *cs = (float *)malloc(4 * (size_t)T * half), *sn = (float *)malloc(4 * (size_t)T * half);
    mt_cpu_rope_tables(cs, sn, &c);
    float *q = randn(nq, 1), *kv = randn(nkv, 1), *kpe = randn(N * dr, 1), *dO = randn(nv, 1);
    int32_t *ds = NULL;
    if (docs) {
        int32_t *tok = (int32_t *)malloc(4 * (size_t)N);
        for (int64_t i = 0; i < N; i++) tok[i] = mt_rng_u64(&R) % (uint64_t)docs == 0 ? 0 : 1;
        ds = (int32_t *)malloc(4 * (size_t)N);
        mt_cpu_doc_starts(ds, tok, (int)N, T, 0);
        free(tok);
    }
    void *Dq = up_bf(q, nq), *Dkv = up_bf(kv, nkv), *Dkpe = up_bf(kpe, N * dr), *DdO = up_bf(dO, nv), *Dc = up(cs, 4 * (size_t)T * half),
         *Ds = up(sn, 4 * (size_t)T * half);
    int32_t *Dds = ds ? (int32_t *)up(ds, 4 * (size_t)N) : NULL;
    const float scale = 1.0f / sqrtf((float)dq);
    const size_t wsb = mt_cuda_attention_backward_workspace(CU, B, T, H, dq, dv);
    /* unfolded */
    void *Q = dalloc(2 * nq), *K = dalloc(2 * nq), *V = dalloc(2 * nv), *O0 = dalloc(2 * nv), *L0 = dalloc(4 * N * H), *dQ = dalloc(2 * nq),
         *dK = dalloc(2 * nq), *dV = dalloc(2 * nv), *dq0 = dalloc(2 * nq), *dkv0 = dalloc(2 * nkv), *dkpe0 = dalloc(2 * N * dr), *ws = dalloc(wsb);
    int ok = !mt_cuda_mla_rope_forward(CU, Q, K, V, Dq, Dkv, Dkpe, (float *)Dc, (float *)Ds, (int)N, T, H, dn, dr, dv) &&
             !mt_cuda_attention_forward(CU, Q, K, V, Dds, O0, (float *)L0, B, T, H, dq, dv, scale) &&
             !mt_cuda_attention_backward(CU, Q, K, V, O0, (float *)L0, DdO, Dds, dQ, dK, dV, ws, B, T, H, dq, dv, scale) &&
             !mt_cuda_mla_rope_backward(CU, dq0, dkv0, dkpe0, dQ, dK, dV, (float *)Dc, (float *)Ds, (int)N, T, H, dn, dr, dv);
    /* folded, into freshly poisoned buffers */
    void *qr = dalloc(2 * nr), *kr = dalloc(2 * N * dr), *O1 = dalloc(2 * nv), *L1 = dalloc(4 * N * H), *dq1 = dalloc(2 * nq),
         *dkv1 = dalloc(2 * nkv), *dkr = dalloc(2 * nr), *dkpe1 = dalloc(2 * N * dr);
    mt_cuda_memset(CU, ws, 0xff, wsb);
    int ok1 = !mt_cuda_rope_pe_forward(CU, qr, kr, Dq, Dkpe, (float *)Dc, (float *)Ds, (int)N, T, H, dn, dr) &&
              !mt_cuda_mla_attention_forward(CU, Dq, Dkv, qr, kr, Dds, O1, (float *)L1, B, T, H, dn, dr, dv, scale) &&
              !mt_cuda_mla_attention_backward(CU, Dq, Dkv, qr, kr, O1, (float *)L1, DdO, Dds, (float *)Dc, (float *)Ds, dq1, dkv1, dkr, ws, B, T, H,
                                              dn, dr, dv, scale) &&
              !mt_cuda_rope_pe_backward(CU, dkpe1, dkr, (float *)Dc, (float *)Ds, (int)N, T, H, dr);
    if (!ok1) printf("  folded: %s\n", mt_cuda_error(CU));
    int same[5] = {dsame(O0, O1, 2 * nv), dsame(L0, L1, 4 * N * H), dsame(dq0, dq1, 2 * nq), dsame(dkv0, dkv1, 2 * nkv), dsame(dkpe0, dkpe1, 2 * N * dr)};
    char nm[96];
    snprintf(nm, sizeof nm, "gpu RoPE folded into attention B%d T%d H%d %d+%d/%d%s", B, T, H, dn, dr, dv, docs ? " doc-masked" : "");
    report(nm, ok && ok1 && same[0] && same[1] && same[2] && same[3] && same[4], "bitwise the unfolded O %d lse %d dq %d dkv %d dkpe %d", same[0],
           same[1], same[2], same[3], same[4]);
    free(cs); free(sn); free(q); free(kv); free(kpe); free(dO); free(ds);
    void *bufs[] = {Dq, Dkv, Dkpe, DdO, Dc, Ds, Dds, Q, K, V, O0, L0, dQ, dK, dV, dq0, dkv0, dkpe0, ws, qr, kr, O1, L1, dq1, dkv1, dkr, dkpe1};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) if (bufs[i]) dfree(bufs[i]);
}

/* GMM_DW_SQ: dW unchanged, its partial sums of squares add up to sum(dW^2); S = 1 and row splits */
static void gpu_test_gmm_dw_sumsq(int E, int F, int D, int64_t NK) {
    int32_t *offs = (int32_t *)malloc(4 * (size_t)(E + 1));
    offs[0] = 0;
    for (int e = 0; e < E; e++) offs[e + 1] = (int32_t)(NK * (e + 1) / E - (e == 1 ? NK / (4 * E) : 0));
    offs[E] = (int32_t)NK;
    float *dY = randn(NK * F, 1), *X = randn(NK * D, 1), *dW = (float *)malloc(4 * (size_t)E * F * D);
    round_bf(dY, NK * F); round_bf(X, NK * D);
    mt_cpu_gmm_dw(NULL, dW, dY, X, offs, E, F, D);
    double ref = 0;
    for (int64_t i = 0; i < (int64_t)E * F * D; i++) ref += (double)dW[i] * dW[i];
    int64_t L = mt_gmm_ssq_len(E, F, D);
    void *DdY = up_bf(dY, NK * F), *DX = up_bf(X, NK * D), *Doffs = up(offs, 4 * (size_t)(E + 1));
    void *DdW = dalloc(4 * (size_t)E * F * D), *DdW2 = dalloc(4 * (size_t)E * F * D), *Dssq = dalloc(4 * (size_t)L);
    void *ws = dalloc(mt_cuda_gmm_workspace(CU, 2, E, F, D, (int)NK) + 256);
    int ok = !mt_cuda_gmm(CU, 2, DdW, DdY, DX, (int32_t *)Doffs, E, F, D, (int)NK, ws, NULL, NULL, (float *)Dssq, L) &&
             !mt_cuda_gmm(CU, 2, DdW2, DdY, DX, (int32_t *)Doffs, E, F, D, (int)NK, ws, NULL, NULL, NULL, 0);
    float *g1 = (float *)down(DdW, 4 * (size_t)E * F * D), *g2 = (float *)down(DdW2, 4 * (size_t)E * F * D), *q = (float *)down(Dssq, 4 * (size_t)L);
    double sum = 0;
    int finite = 1;
    for (int64_t i = 0; i < L; i++) { sum += q[i]; finite &= isfinite(q[i]) != 0; }
    int same = !memcmp(g1, g2, 4 * (size_t)E * F * D);
    double e = fabs(sum - ref) / ref, edw = rel(g1, dW, (int64_t)E * F * D);
    char nm[96];
    snprintf(nm, sizeof nm, "gpu grouped GEMM dW + norm partials (E=%d, %lld rows)", E, (long long)NK);
    report(nm, ok && finite && same && e < F32_TOL && edw < F32_TOL, "sum of squares rel %.1e, dW rel %.1e, dW %s", e, edw,
           same ? "bitwise as without" : "DIFFERS");
    free(offs); free(dY); free(X); free(dW); free(g1); free(g2); free(q);
    dfree(DdY); dfree(DX); dfree(Doffs); dfree(DdW); dfree(DdW2); dfree(Dssq); dfree(ws);
}

/* Grouped GEMM on unequal, empty and odd-sized experts, dims not multiples of the tiles: forward,
 * dX (one and two pairs) and dW against the CPU reference. The rows past the routed ones are NaN
 * in every input (dW's reduction must not touch them) and stay unwritten in the outputs; reruns
 * are bitwise identical. */
static void gpu_test_gmm_shapes(int E, int M, int K, const int *counts) {
    int32_t *offs = (int32_t *)malloc(4 * (size_t)(E + 1));
    offs[0] = 0;
    for (int e = 0; e < E; e++) offs[e + 1] = offs[e] + counts[e];
    const int R = offs[E], Rmax = R + 37;
    float *X = randn((int64_t)R * K, 1), *dY = randn((int64_t)R * M, 1), *dY2 = randn((int64_t)R * M, 1);
    float *W = randn((int64_t)E * M * K, 0.1), *W2 = randn((int64_t)E * M * K, 0.1);
    round_bf(X, (int64_t)R * K); round_bf(dY, (int64_t)R * M); round_bf(dY2, (int64_t)R * M);
    round_bf(W, (int64_t)E * M * K); round_bf(W2, (int64_t)E * M * K);
    float *Y = (float *)malloc(4 * (size_t)(R ? R : 1) * M), *dX = (float *)malloc(4 * (size_t)(R ? R : 1) * K);
    float *dX2 = (float *)malloc(4 * (size_t)(R ? R : 1) * K), *dW = (float *)malloc(4 * (size_t)E * M * K);
    mt_cpu_gmm(NULL, Y, X, W, offs, E, M, K);
    mt_cpu_gmm_dx(NULL, dX, dY, W, offs, E, M, K);
    memcpy(dX2, dX, 4 * (size_t)R * K);
    mt_cpu_gmm_dx_add(NULL, dX2, dY2, W2, offs, E, M, K);
    mt_cpu_gmm_dw(NULL, dW, dY, X, offs, E, M, K);
    /* inputs: Rmax rows, the last 37 NaN (dalloc's poison), the routed rows copied over */
    void *DX = dalloc(2 * (size_t)Rmax * K), *DdY = dalloc(2 * (size_t)Rmax * M), *DdY2 = dalloc(2 * (size_t)Rmax * M);
    void *tX = up_bf(X, (int64_t)R * K), *tY = up_bf(dY, (int64_t)R * M), *tY2 = up_bf(dY2, (int64_t)R * M);
    mt_cuda_copy(CU, DX, tX, 2 * (size_t)R * K, 2); mt_cuda_copy(CU, DdY, tY, 2 * (size_t)R * M, 2); mt_cuda_copy(CU, DdY2, tY2, 2 * (size_t)R * M, 2);
    void *DW = up_bf(W, (int64_t)E * M * K), *DW2 = up_bf(W2, (int64_t)E * M * K), *Doffs = up(offs, 4 * (size_t)(E + 1));
    void *ws = dalloc(mt_cuda_gmm_workspace(CU, 2, E, M, K, Rmax) + 256);
    size_t by = 2 * (size_t)Rmax * M, bx = 2 * (size_t)Rmax * K, bw = 4 * (size_t)E * M * K;
    void *out[2][4];   /* [run][Y, dX, dX2, dW] */
    int ok = 1;
    for (int run = 0; run < 2; run++) {
        out[run][0] = dalloc(by); out[run][1] = dalloc(bx); out[run][2] = dalloc(bx); out[run][3] = dalloc(bw);
        ok &= !mt_cuda_gmm(CU, 0, out[run][0], DX, DW, (int32_t *)Doffs, E, M, K, Rmax, ws, NULL, NULL, NULL, 0) &&
              !mt_cuda_gmm(CU, 1, out[run][1], DdY, DW, (int32_t *)Doffs, E, M, K, Rmax, ws, NULL, NULL, NULL, 0) &&
              !mt_cuda_gmm(CU, 1, out[run][2], DdY, DW, (int32_t *)Doffs, E, M, K, Rmax, ws, DdY2, DW2, NULL, 0) &&
              !mt_cuda_gmm(CU, 2, out[run][3], DdY, DX, (int32_t *)Doffs, E, M, K, Rmax, ws, NULL, NULL, NULL, 0);
    }
    const size_t bytes[4] = {by, bx, bx, bw};
    int same = 1, untouched = 1;
    for (int i = 0; i < 4; i++) {
        unsigned char *h0 = (unsigned char *)down(out[0][i], bytes[i]), *h1 = (unsigned char *)down(out[1][i], bytes[i]);
        same &= !memcmp(h0, h1, bytes[i]);
        if (i < 3) {   /* bf16 rows [R, Rmax) keep the poison */
            size_t from = 2 * (size_t)R * (i == 0 ? M : K);
            for (size_t j = from; j < bytes[i]; j++) untouched &= h0[j] == 0xff;
        }
        free(h0); free(h1);
    }
    float *gY = down_bf(out[0][0], (int64_t)R * M), *gdX = down_bf(out[0][1], (int64_t)R * K), *gdX2 = down_bf(out[0][2], (int64_t)R * K);
    float *gdW = (float *)down(out[0][3], bw);
    double e1 = rel(gY, Y, (int64_t)R * M), e2 = rel(gdX, dX, (int64_t)R * K), e3 = rel(gdX2, dX2, (int64_t)R * K), e4 = rel(gdW, dW, (int64_t)E * M * K);
    int zero_ok = 1;
    for (int e = 0; e < E; e++)
        if (!counts[e]) for (int64_t i = 0; i < (int64_t)M * K; i++) zero_ok &= gdW[(int64_t)e * M * K + i] == 0;
    char nm[96];
    snprintf(nm, sizeof nm, "gpu grouped GEMM shapes (E=%d M=%d K=%d, %d rows)", E, M, K, R);
    report(nm, ok && same && untouched && zero_ok && e1 < BF_TOL && e2 < BF_TOL && e3 < BF_TOL && e4 < F32_TOL,
           "fwd %.1e dX %.1e dX2 %.1e dW %.1e, idle dW zero %d, tail rows untouched %d, rerun %s", e1, e2, e3, e4, zero_ok, untouched,
           same ? "bitwise" : "DIFFERS");
    {   /* the experts' gate (W) and up (W2) GEMMs and their SwiGLU in one launch (GMM_GLU): bitwise the forward
           above, a second forward and the SwiGLU kernel over the R rows; rows [R, Rmax) untouched */
        void *g = dalloc(by), *u = dalloc(by), *h = dalloc(by), *u2 = dalloc(by), *h2 = dalloc(by);
        int okg = !mt_cuda_gmm_glu(CU, g, u, h, DX, DW, DW2, (int32_t *)Doffs, E, M, K, Rmax) &&
                  !mt_cuda_gmm(CU, 0, u2, DX, DW2, (int32_t *)Doffs, E, M, K, Rmax, ws, NULL, NULL, NULL, 0) &&
                  !mt_cuda_swiglu_forward(CU, h2, out[0][0], u2, (int64_t)R * M, NULL, 0);
        unsigned char *hg = (unsigned char *)down(g, by), *hu = (unsigned char *)down(u, by), *hh = (unsigned char *)down(h, by);
        unsigned char *ry = (unsigned char *)down(out[0][0], by), *ru = (unsigned char *)down(u2, by), *rh = (unsigned char *)down(h2, by);
        size_t nr = 2 * (size_t)R * M;
        int bit = okg && !memcmp(hg, ry, by) && !memcmp(hu, ru, by) && !memcmp(hh, rh, nr), tail = 1;
        for (size_t j = nr; j < by; j++) tail &= hh[j] == 0xff;
        /* h against silu(g) u from the CPU's g and u (bf16 tolerance) */
        float *U = (float *)malloc(4 * (size_t)(R ? R : 1) * M), *H = (float *)malloc(4 * (size_t)(R ? R : 1) * M);
        mt_cpu_gmm(NULL, U, X, W2, offs, E, M, K);
        mt_cpu_swiglu_forward(H, Y, U, (int64_t)R * M);
        float *gh = down_bf(h, (int64_t)R * M);
        double eh = rel(gh, H, (int64_t)R * M);
        char nm2[96];
        snprintf(nm2, sizeof nm2, "gpu grouped gate/up + SwiGLU, one launch (E=%d M=%d K=%d)", E, M, K);
        report(nm2, bit && tail && eh < BF_TOL, "g, u, h = two launches + SwiGLU bitwise %s, h's tail rows untouched %d, h vs CPU %.1e",
               bit ? "yes" : "NO", tail, eh);
        free(hg); free(hu); free(hh); free(ry); free(ru); free(rh); free(U); free(H); free(gh);
        dfree(g); dfree(u); dfree(h); dfree(u2); dfree(h2);
    }
    for (int run = 0; run < 2; run++) for (int i = 0; i < 4; i++) dfree(out[run][i]);
    free(offs); free(X); free(dY); free(dY2); free(W); free(W2); free(Y); free(dX); free(dX2); free(dW);
    free(gY); free(gdX); free(gdX2); free(gdW);
    dfree(DX); dfree(DdY); dfree(DdY2); dfree(tX); dfree(tY); dfree(tY2); dfree(DW); dfree(DW2); dfree(Doffs); dfree(ws);
}

static void gpu_test_moe_ops(void) {
    /* router: every variant, indices and counts exact, weights within f32 rounding */
    for (int v = 0; v < 4; v++) {
        int N = 257, E = v == 3 ? 64 : 16, K = v == 3 ? 6 : 3, G = v == 3 ? 8 : 1, Gl = v == 3 ? 3 : 1;
        int sf = v & 1 ? MT_SCORE_SIGMOID : MT_SCORE_SOFTMAX, norm = (v >> 1) & 1;
        float scale = v == 3 ? 2.5f : 1.0f;
        float *lg = randn((int64_t)N * E, 1), *bias = randn(E, 0.2), *dwv = randn((int64_t)N * K, 1);
        int32_t *idx = (int32_t *)malloc(4 * (size_t)N * K), *cnt = (int32_t *)malloc(4 * (size_t)E);
        float *w = (float *)malloc(4 * (size_t)N * K), *sc = (float *)malloc(4 * (size_t)N * E), *dl = (float *)malloc(4 * (size_t)N * E);
        mt_cpu_router_forward(idx, w, sc, cnt, lg, bias, N, E, K, sf, norm, scale, G, Gl);
        mt_cpu_router_backward(dl, sc, idx, w, dwv, N, E, K, sf, norm, scale);
        void *Dl = up(lg, 4 * (size_t)N * E), *Db = up(bias, 4 * (size_t)E), *Ddw = up(dwv, 4 * (size_t)N * K);
        void *Di = dalloc(4 * (size_t)N * K), *Dw = dalloc(4 * (size_t)N * K), *Ds = dalloc(4 * (size_t)N * E), *Dc = dalloc(4 * (size_t)E), *Ddl = dalloc(4 * (size_t)N * E);
        int ok = !mt_cuda_router_forward(CU, (int32_t *)Di, (float *)Dw, (float *)Ds, (int32_t *)Dc, (float *)Dl, (float *)Db, N, E, K, sf, norm, scale, G, Gl) &&
                 !mt_cuda_router_backward(CU, (float *)Ddl, (float *)Ds, (int32_t *)Di, (float *)Ddw, N, E, K, sf, norm, scale);
        int32_t *gi = (int32_t *)down(Di, 4 * (size_t)N * K), *gc = (int32_t *)down(Dc, 4 * (size_t)E);
        float *gw = (float *)down(Dw, 4 * (size_t)N * K), *gs = (float *)down(Ds, 4 * (size_t)N * E), *gdl = (float *)down(Ddl, 4 * (size_t)N * E);
        int same_idx = !memcmp(gi, idx, 4 * (size_t)N * K) && !memcmp(gc, cnt, 4 * (size_t)E);
        double e1 = rel(gw, w, (int64_t)N * K), e2 = rel(gs, sc, (int64_t)N * E), e3 = rel(gdl, dl, (int64_t)N * E);
        char nm[96];
        snprintf(nm, sizeof nm, "gpu router %s norm=%d E=%d K=%d groups=%d", sf ? "sigmoid" : "softmax", norm, E, K, G);
        report(nm, ok && same_idx && e1 < F32_TOL && e2 < F32_TOL && e3 < F32_TOL, "indices %s, w %.1e scores %.1e dlogits %.1e", same_idx ? "equal" : "DIFFER", e1, e2, e3);
        free(lg); free(bias); free(dwv); free(idx); free(cnt); free(w); free(sc); free(dl); free(gi); free(gc); free(gw); free(gs); free(gdl);
        dfree(Dl); dfree(Db); dfree(Ddw); dfree(Di); dfree(Dw); dfree(Ds); dfree(Dc); dfree(Ddl);
    }
    /* permute -> grouped GEMMs (zero-token experts) -> combine, and backward */
    int N = 200, D = 64, K = 2, E = 8, F = 48;
    int64_t NK = (int64_t)N * K;
    int32_t *idx = (int32_t *)malloc(4 * (size_t)NK);
    for (int64_t a = 0; a < NK; a++) { int r = (int)(mt_rng_u64(&R) % 10); idx[a] = r < 5 ? 1 : r < 8 ? 4 : 6; }  /* 5 experts idle */
    float *x = randn((int64_t)N * D, 1), *W = randn((int64_t)E * F * D, 0.1), *w = randn(NK, 1), *dy = randn((int64_t)N * D, 1);
    round_bf(x, (int64_t)N * D); round_bf(W, (int64_t)E * F * D); round_bf(dy, (int64_t)N * D);
    float *xs = (float *)malloc(4 * (size_t)NK * D), *Y = (float *)malloc(4 * (size_t)NK * F), *dX = (float *)malloc(4 * (size_t)NK * D), *dW = (float *)malloc(4 * (size_t)E * F * D);
    int32_t *slot = (int32_t *)malloc(4 * (size_t)NK), offs[9];
    mt_cpu_moe_permute(xs, slot, offs, x, idx, N, D, K, E);
    mt_cpu_gmm(NULL, Y, xs, W, offs, E, F, D);
    float *dYr = randn(NK * F, 1);
    round_bf(dYr, NK * F);
    mt_cpu_gmm_dx(NULL, dX, dYr, W, offs, E, F, D);
    mt_cpu_gmm_dw(NULL, dW, dYr, xs, offs, E, F, D);
    void *Dx = up_bf(x, (int64_t)N * D), *Di = up(idx, 4 * (size_t)NK), *Dxs = dalloc(2 * (size_t)NK * D), *Dslot = dalloc(4 * (size_t)NK), *Doffs = dalloc(4 * 9);
    void *DW = up_bf(W, (int64_t)E * F * D), *DY = dalloc(2 * (size_t)NK * F), *DdY = up_bf(dYr, NK * F), *DdX = dalloc(2 * (size_t)NK * D), *DdW = dalloc(4 * (size_t)E * F * D);
    void *pws = dalloc(mt_cuda_moe_permute_workspace(NK));
    int ok = !mt_cuda_moe_permute(CU, Dxs, (int32_t *)Dslot, (int32_t *)Doffs, Dx, (int32_t *)Di, N, D, K, E, pws);
    dfree(pws);
    int32_t *goffs = (int32_t *)down(Doffs, 4 * 9), *gslot = (int32_t *)down(Dslot, 4 * (size_t)NK);
    float *gxs = down_bf(Dxs, NK * D);
    int exact = !memcmp(goffs, offs, 4 * 9) && !memcmp(gslot, slot, 4 * (size_t)NK) && rel(gxs, xs, NK * D) == 0;
    report("gpu moe permute (slots, offsets, rows exact)", ok && exact, NULL);
    void *gws = dalloc(mt_cuda_gmm_workspace(CU, 2, E, F, D, (int)NK) + 256);
    ok = ok && !mt_cuda_gmm(CU, 0, DY, Dxs, DW, (int32_t *)Doffs, E, F, D, (int)NK, gws, NULL, NULL, NULL, 0) &&
         !mt_cuda_gmm(CU, 1, DdX, DdY, DW, (int32_t *)Doffs, E, F, D, (int)NK, gws, NULL, NULL, NULL, 0) &&
         !mt_cuda_gmm(CU, 2, DdW, DdY, Dxs, (int32_t *)Doffs, E, F, D, (int)NK, gws, NULL, NULL, NULL, 0);
    {   /* GMM_DX2: dX = dY W + dY2 W2 in one reduction loop, against the reference sum */
        float *dY2 = randn(NK * F, 1), *W2 = randn((int64_t)E * F * D, 0.1), *ref = (float *)malloc(4 * (size_t)NK * D);
        round_bf(dY2, NK * F); round_bf(W2, (int64_t)E * F * D);
        memcpy(ref, dX, 4 * (size_t)NK * D);
        mt_cpu_gmm_dx_add(NULL, ref, dY2, W2, offs, E, F, D);
        void *DdY2 = up_bf(dY2, NK * F), *DW2 = up_bf(W2, (int64_t)E * F * D), *D2 = dalloc(2 * (size_t)NK * D), *D2b = dalloc(2 * (size_t)NK * D);
        int ok2 = !mt_cuda_gmm(CU, 1, D2, DdY, DW, (int32_t *)Doffs, E, F, D, (int)NK, gws, DdY2, DW2, NULL, 0) &&
                  !mt_cuda_gmm(CU, 1, D2b, DdY, DW, (int32_t *)Doffs, E, F, D, (int)NK, gws, DdY2, DW2, NULL, 0);
        float *g2 = down_bf(D2, NK * D);
        void *h1 = down(D2, 2 * (size_t)NK * D), *h2 = down(D2b, 2 * (size_t)NK * D);
        double ea = rel(g2, ref, NK * D);
        int same = !memcmp(h1, h2, 2 * (size_t)NK * D);
        report("gpu grouped GEMM dX of two pairs in one loop (GMM_DX2)", ok2 && ea < BF_TOL && same, "rel %.1e, rerun %s", ea, same ? "bitwise" : "DIFFERS");
        free(dY2); free(W2); free(ref); free(g2); free(h1); free(h2);
        dfree(DdY2); dfree(DW2); dfree(D2); dfree(D2b);
    }
    dfree(gws);
    float *gY = down_bf(DY, NK * F), *gdX = down_bf(DdX, NK * D), *gdW = (float *)down(DdW, 4 * (size_t)E * F * D);
    double e1 = rel(gY, Y, NK * F), e2 = rel(gdX, dX, NK * D), e3 = rel(gdW, dW, (int64_t)E * F * D);
    int zero_ok = 1;
    for (int64_t i = 0; i < (int64_t)F * D; i++) zero_ok &= gdW[i] == 0 && gdW[2 * F * D + i] == 0;   /* experts 0, 2 idle */
    report("gpu grouped GEMM fwd/dX/dW (idle experts)", ok && e1 < BF_TOL && e2 < BF_TOL && e3 < F32_TOL && zero_ok, "%.1e %.1e %.1e, idle grads zero %d", e1, e2, e3, zero_ok);
    /* combine and backwards of permute/combine */
    float *ys = randn(NK * D, 1), *yo = (float *)malloc(4 * (size_t)N * D), *dys = (float *)malloc(4 * (size_t)NK * D), *dwk = (float *)malloc(4 * (size_t)NK), *dxp = (float *)malloc(4 * (size_t)N * D);
    round_bf(ys, NK * D);
    mt_cpu_moe_combine_forward(yo, ys, slot, w, N, D, K);
    mt_cpu_moe_combine_backward(dys, dwk, dy, ys, slot, w, N, D, K);
    round_bf(dys, NK * D);
    mt_cpu_moe_permute_backward(dxp, dys, slot, N, D, K);
    void *Dys = up_bf(ys, NK * D), *Dw = up(w, 4 * (size_t)NK), *Dyo = dalloc(2 * (size_t)N * D), *Ddy = up_bf(dy, (int64_t)N * D), *Ddys = dalloc(2 * (size_t)NK * D), *Ddw = dalloc(4 * (size_t)NK), *Ddxp = dalloc(2 * (size_t)N * D);
    ok = !mt_cuda_moe_combine_forward(CU, Dyo, Dys, (int32_t *)Dslot, (float *)Dw, N, D, K) &&
         !mt_cuda_moe_combine_backward(CU, Ddys, (float *)Ddw, Ddy, Dys, (int32_t *)Dslot, (float *)Dw, N, D, K) &&
         !mt_cuda_moe_permute_backward(CU, Ddxp, Ddys, (int32_t *)Dslot, N, D, K);
    float *g1 = down_bf(Dyo, (int64_t)N * D), *g2 = down_bf(Ddys, NK * D), *g3 = (float *)down(Ddw, 4 * (size_t)NK), *g4 = down_bf(Ddxp, (int64_t)N * D);
    double c1 = rel(g1, yo, (int64_t)N * D), c2 = rel(g2, dys, NK * D), c3 = rel(g3, dwk, NK), c4 = rel(g4, dxp, (int64_t)N * D);
    report("gpu combine fwd/bwd, permute bwd", ok && c1 < BF_TOL && c2 < BF_TOL && c3 < F32_TOL && c4 < BF_TOL, "%.1e %.1e %.1e %.1e", c1, c2, c3, c4);
    free(idx); free(x); free(W); free(w); free(dy); free(xs); free(Y); free(dX); free(dW); free(slot); free(dYr); free(goffs); free(gslot); free(gxs);
    free(gY); free(gdX); free(gdW); free(ys); free(yo); free(dys); free(dwk); free(dxp); free(g1); free(g2); free(g3); free(g4);
    dfree(Dx); dfree(Di); dfree(Dxs); dfree(Dslot); dfree(Doffs); dfree(DW); dfree(DY); dfree(DdY); dfree(DdX); dfree(DdW);
    dfree(Dys); dfree(Dw); dfree(Dyo); dfree(Ddy); dfree(Ddys); dfree(Ddw); dfree(Ddxp);
}

static void gpu_test_loss_and_optimizer(void) {
    int N = 77, V = 3001;
    float *lg = randn((int64_t)N * V, 3);
    round_bf(lg, (int64_t)N * V);
    int32_t *t = (int32_t *)malloc(4 * (size_t)N);
    for (int i = 0; i < N; i++) t[i] = (int32_t)(mt_rng_u64(&R) % (uint64_t)V);
    float loss, *lse = (float *)malloc(4 * (size_t)N), *dl = (float *)malloc(4 * (size_t)N * V);
    mt_cpu_cross_entropy_forward(NULL, &loss, lse, lg, t, N, V, N);
    mt_cpu_cross_entropy_backward(NULL, dl, lg, lse, t, N, V, 1.0 / N);
    void *Dl = up_bf(lg, (int64_t)N * V), *Dt = up(t, 4 * (size_t)N), *Dloss = dalloc(4), *Dlse = dalloc(4 * (size_t)N), *Ddl = dalloc(2 * (size_t)N * V), *ws = dalloc(mt_cuda_cross_entropy_workspace(N));
    int ok = !mt_cuda_cross_entropy_forward(CU, (float *)Dloss, (float *)Dlse, Dl, (int32_t *)Dt, N, V, N, ws) &&
             !mt_cuda_cross_entropy_backward(CU, Ddl, Dl, (float *)Dlse, (int32_t *)Dt, N, V, 1.0f / N);
    float gl, *glse = (float *)down(Dlse, 4 * (size_t)N), *gdl = down_bf(Ddl, (int64_t)N * V);
    mt_cuda_copy(CU, &gl, Dloss, 4, 1);
    double e1 = fabs(gl - loss) / loss, e2 = rel(glse, lse, N), e3 = rel(gdl, dl, (int64_t)N * V);
    report("gpu cross-entropy fwd/bwd", ok && e1 < F32_TOL && e2 < F32_TOL && e3 < BF_TOL, "loss %.1e lse %.1e dlogits %.1e", e1, e2, e3);
    /* the first 3000 entries of the same rows on 3 vocab shards of 1000 (tensor parallelism's equal widths),
     * the targets folded into them: each shard's statistics, the combine, two shards' backward */
    {
        int S = 3, Vl = 1000, Vs = S * Vl;
        float *blk = (float *)malloc(4 * (size_t)N * Vl), *st = (float *)malloc(4 * (size_t)S * N * 3), *ref = (float *)malloc(4 * (size_t)N * Vs);
        float *gst = NULL, sl, *slse = (float *)malloc(4 * (size_t)N), *sdl = (float *)malloc(4 * (size_t)N * Vl);
        for (int i = 0; i < N; i++) t[i] %= Vs;
        float *whole = (float *)malloc(4 * (size_t)N * Vs);
        for (int i = 0; i < N; i++) memcpy(whole + (size_t)i * Vs, lg + (size_t)i * V, 4 * (size_t)Vs);
        void *Dst = dalloc(4 * (size_t)S * N * 3), *Db = dalloc(2 * (size_t)N * Vl), *Ddb = dalloc(2 * (size_t)N * Vl), *Dt2 = up(t, 4 * (size_t)N);
        void *Dsl = dalloc(4), *Dslse = dalloc(4 * (size_t)N), *ws2 = dalloc(mt_cuda_cross_entropy_workspace(N));
        int ok2 = 1;
        for (int k = 0; k < S; k++) {
            for (int i = 0; i < N; i++) memcpy(blk + (size_t)i * Vl, whole + (size_t)i * Vs + (size_t)k * Vl, 4 * (size_t)Vl);
            mt_cpu_ce_stats(st + (size_t)k * N * 3, blk, t, N, Vl, k * Vl);
            void *Dk = up_bf(blk, (int64_t)N * Vl);
            ok2 &= !mt_cuda_ce_stats(CU, (float *)Dst + (size_t)k * N * 3, Dk, (int32_t *)Dt2, N, Vl, k * Vl);
            dfree(Dk);
        }
        ok2 &= !mt_cuda_ce_combine(CU, (float *)Dsl, (float *)Dslse, (float *)Dst, (int32_t *)Dt2, S, N, N, ws2);
        float sloss, *lse2 = (float *)malloc(4 * (size_t)N);
        mt_cpu_ce_combine(&sloss, lse2, st, t, S, N, N);
        gst = (float *)down(Dst, 4 * (size_t)S * N * 3);
        mt_cuda_copy(CU, &sl, Dsl, 4, 1);
        float *gslse = (float *)down(Dslse, 4 * (size_t)N);
        double f1 = rel(gst, st, (int64_t)S * N * 3), f2 = fabs(sl - sloss) / sloss, f3 = rel(gslse, lse2, N), f4 = 0;
        for (int k = 1; k < S; k++) {   /* the middle and last shards' backward against the CPU's */
            for (int i = 0; i < N; i++) memcpy(blk + (size_t)i * Vl, whole + (size_t)i * Vs + (size_t)k * Vl, 4 * (size_t)Vl);
            mt_cpu_ce_shard_backward(sdl, blk, lse2, t, N, Vl, k * Vl, 1.0 / N);
            void *Dk = up_bf(blk, (int64_t)N * Vl);
            ok2 &= !mt_cuda_ce_shard_backward(CU, Ddb, Dk, (float *)Dslse, (int32_t *)Dt2, N, Vl, k * Vl, 1.0f / N);
            float *g = down_bf(Ddb, (int64_t)N * Vl);
            double r = rel(g, sdl, (int64_t)N * Vl);
            if (r > f4) f4 = r;
            free(g); dfree(Dk);
        }
        report("gpu cross-entropy on 3 vocab shards: stats, combine, backward", ok2 && f1 < F32_TOL && f2 < F32_TOL && f3 < F32_TOL && f4 < BF_TOL,
               "stats %.1e loss %.1e lse %.1e dlogits %.1e", f1, f2, f3, f4);
        free(blk); free(st); free(ref); free(gst); free(slse); free(sdl); free(whole); free(lse2); free(gslse);
        dfree(Dst); dfree(Db); dfree(Ddb); dfree(Dt2); dfree(Dsl); dfree(Dslse); dfree(ws2);
    }
    {   /* multi-token prediction: targets shifted k = 2 ahead in sequences of 11 (-1 past their ends), the loss's mean over
         * the rows counted and its weighted backward, zero on the rows left out; and the shifted tokens themselves */
        int T = 11, k = 2, cnt = N / T * (T - k), Nm = N / T * T;
        int32_t *sh = (int32_t *)malloc(4 * (size_t)Nm), *gsh;
        mt_cpu_shift_tokens(sh, t, Nm, T, k, -1);
        void *Dsh = dalloc(4 * (size_t)Nm), *Dtm = up(t, 4 * (size_t)Nm);
        int ok3 = !mt_cuda_shift_tokens(CU, (int32_t *)Dsh, (int32_t *)Dtm, Nm, T, k, -1);
        gsh = (int32_t *)down(Dsh, 4 * (size_t)Nm);
        int same = !memcmp(gsh, sh, 4 * (size_t)Nm);
        mt_cpu_cross_entropy_forward(NULL, &loss, lse, lg, sh, Nm, V, cnt);
        mt_cpu_cross_entropy_backward(NULL, dl, lg, lse, sh, Nm, V, 0.3 / cnt);
        ok3 &= !mt_cuda_cross_entropy_forward(CU, (float *)Dloss, (float *)Dlse, Dl, (int32_t *)Dsh, Nm, V, cnt, ws) &&
               !mt_cuda_cross_entropy_backward(CU, Ddl, Dl, (float *)Dlse, (int32_t *)Dsh, Nm, V, 0.3f / cnt);
        float *gd = down_bf(Ddl, (int64_t)Nm * V);
        mt_cuda_copy(CU, &gl, Dloss, 4, 1);
        double zero = 0;
        for (int i = 0; i < Nm; i++) if (sh[i] < 0) for (int v = 0; v < V; v++) zero += fabs(gd[(size_t)i * V + v]);
        double m1 = fabs(gl - loss) / loss, m2 = rel(gd, dl, (int64_t)Nm * V);
        report("gpu shifted tokens; cross-entropy with rows left out, weighted", ok3 && same && m1 < F32_TOL && m2 < BF_TOL && zero == 0,
               "shift %s, loss %.1e dlogits %.1e, |dlogits| of rows left out %.1e", same ? "bitwise" : "DIFFERS", m1, m2, zero);
        free(sh); free(gsh); free(gd); dfree(Dsh); dfree(Dtm);
    }
    free(lg); free(t); free(lse); free(dl); free(glse); free(gdl);
    dfree(Dl); dfree(Dt); dfree(Dloss); dfree(Dlse); dfree(Ddl); dfree(ws);

    /* gradient norm, schedule, clip, AdamW (with bf16 shadow): a length the
     * 4-wide paths take, and one they do not */
    for (int64_t n = 100000; n <= 100003; n += 3) {
    float *p = randn(n, 1), *g = randn(n, 0.1), *m = randn(n, 0.01), *v = (float *)malloc(4 * n);
    for (int64_t i = 0; i < n; i++) v[i] = (float)fabs(mt_rng_normal(&R)) * 1e-3f;
    mt_hparams h;
    mt_hparams_default(&h);
    float hp[MT_HP_COUNT];
    mt_hparams_pack(&h, hp);
    int32_t step = 7;
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)g[i] * g[i];
    void *Dp = up(p, 4 * n), *Dg = up(g, 4 * n), *Dm = up(m, 4 * n), *Dv = up(v, 4 * n), *Dp16 = dalloc(2 * n), *Dhp = up(hp, sizeof hp), *Dst = up(&step, 4);
    void *Dacc = dalloc(4), *Dlr = dalloc(4), *Dcoef = dalloc(4), *Dnorm = dalloc(4), *ws2 = dalloc(mt_cuda_sumsq_workspace());
    int ok2 = !mt_cuda_sumsq(CU, (float *)Dacc, NULL, (float *)Dg, n, 1, ws2) && !mt_cuda_lr_schedule(CU, (float *)Dlr, (float *)Dhp, (int32_t *)Dst) &&
         !mt_cuda_clip(CU, (float *)Dcoef, (float *)Dnorm, (float *)Dacc, (float *)Dhp) &&
         !mt_cuda_adamw(CU, (float *)Dp, (float *)Dm, (float *)Dv, Dp16, (float *)Dg, n, (float *)Dlr, (float *)Dcoef, (float *)Dhp, (int32_t *)Dst, 1);
    float acc, lr, coef, nrm;
    mt_cuda_copy(CU, &acc, Dacc, 4, 1); mt_cuda_copy(CU, &lr, Dlr, 4, 1); mt_cuda_copy(CU, &coef, Dcoef, 4, 1); mt_cuda_copy(CU, &nrm, Dnorm, 4, 1);
    double ref_coef = sqrt(ss) > h.grad_clip ? h.grad_clip / (sqrt(ss) + 1e-6) : 1.0;
    mt_cpu_adamw(p, m, v, g, n, mt_lr_at(hp, step), ref_coef, hp, step, 1);
    float *gp = (float *)down(Dp, 4 * n), *gm = (float *)down(Dm, 4 * n), *gv = (float *)down(Dv, 4 * n), *gp16 = down_bf(Dp16, n);
    double a1 = fabs(acc - ss) / ss, a2 = fabs(lr - mt_lr_at(hp, step)) / mt_lr_at(hp, step), a3 = fabs(coef - ref_coef), a4 = rel(gp, p, n), a5 = rel(gm, m, n), a6 = rel(gv, v, n), a7 = rel(gp16, p, n);
    char nm[64];
    snprintf(nm, sizeof nm, "gpu grad norm, schedule, clip, AdamW (n=%lld)", (long long)n);
    report(nm, ok2 && a1 < F32_TOL && a2 < F32_TOL && a3 < F32_TOL && a4 < F32_TOL && a5 < F32_TOL && a6 < F32_TOL && a7 < BF_TOL,
           "sumsq %.1e lr %.1e coef %.1e p %.1e m %.1e v %.1e p16 %.1e", a1, a2, a3, a4, a5, a6, a7);
    free(p); free(g); free(m); free(v); free(gp); free(gm); free(gv); free(gp16);
    dfree(Dp); dfree(Dg); dfree(Dm); dfree(Dv); dfree(Dp16); dfree(Dhp); dfree(Dst); dfree(Dacc); dfree(Dlr); dfree(Dcoef); dfree(Dnorm); dfree(ws2);
    }
    float bias[6] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
    int32_t cnt[6] = {10, 0, 7, 3, 5, 5};
    void *Db = up(bias, sizeof bias), *Dc = up(cnt, sizeof cnt);
    ok = !mt_cuda_expert_bias_update(CU, (float *)Db, (int32_t *)Dc, 6, 0.01f);
    mt_cpu_expert_bias_update(bias, cnt, 6, 0.01f);
    float *gb = (float *)down(Db, sizeof bias);
    report("gpu expert-bias update", ok && rel(gb, bias, 6) < F32_TOL, NULL);
    free(gb);
    dfree(Db); dfree(Dc);
}

static int gpu_same_params(const mt_graph *ga, mt_runtime *ra, const mt_graph *gb, mt_runtime *rb);
static int gpu_compile(mt_graph *g, const mt_config *c, int cuda, int planned, mt_err *e);
static mt_runtime *gpu_runtime(const mt_graph *g, int poison);
static int gpu_steps(mt_runtime *rt, const mt_config *c, int n, double *loss, double *gnorm);

/* The gradient norm's and AdamW's multi-tensor launches against one launch per tensor, bitwise:
 * more tensors than one launch's table holds, sums past one launch's partials (one 17M-float
 * gradient read by 18 entries), empty, one-block, unaligned and odd lengths, both flags. */
static void gpu_test_multi_tensor(void) {
    enum { NS = 160, NA = 70 };
    static const int64_t sizes[] = {0, 1, 3, 17, 1000, 4096, 65536, 65537, 70001, 200003, 1100000, 3};
    const int64_t big = 17000000;
    float *hb = randn(big, 0.05), *hs = randn(1200000, 0.1);
    void *Dbig = up(hb, 4 * (size_t)big), *Dsmall = up(hs, 4 * 1200000), *ws = dalloc(mt_cuda_sumsq_workspace());
    void *Dacc1 = dalloc(4 * NS), *Dacc2 = dalloc(4 * NS), *Din = up(&(float){0.25f}, 4);
    mt_cuda_sumsq_item it[NS];
    int ok = Dbig && Dsmall && ws && Dacc1 && Dacc2 && Din;
    for (int k = 0; k < NS; k++) {
        int64_t n = k < 18 ? big : sizes[k % 12];
        const float *g = k < 18 ? (const float *)Dbig : (const float *)Dsmall + (k % 5 == 4 ? 1 : 0);   /* some unaligned */
        it[k].g = g; it[k].n = n; it[k].squares = k % 3 != 1; it[k].acc_out = (float *)Dacc2 + k;
        ok = ok && !mt_cuda_sumsq(CU, (float *)Dacc1 + k, k ? (float *)Dacc1 + k - 1 : (const float *)Din, g, n, it[k].squares, ws);
    }
    ok = ok && !mt_cuda_sumsq_multi(CU, (const float *)Din, it, NS, ws);
    float *a1 = (float *)down(Dacc1, 4 * NS), *a2 = (float *)down(Dacc2, 4 * NS);
    report("gpu grad norm: multi-tensor launches = one per tensor, bitwise", ok && !memcmp(a1, a2, 4 * NS) && isfinite(a1[NS - 1]),
           "%d tensors, sum %.6g", NS, (double)a1[NS - 1]);
    free(a1); free(a2); free(hb); free(hs);
    dfree(Dbig); dfree(Dsmall); dfree(ws); dfree(Dacc1); dfree(Dacc2); dfree(Din);

    mt_hparams h;
    mt_hparams_default(&h);
    float hp[MT_HP_COUNT], lr = 3e-4f, coef = 0.7f;
    mt_hparams_pack(&h, hp);
    int32_t step = 4;
    void *Dhp = up(hp, sizeof hp), *Dst = up(&step, 4), *Dlr = up(&lr, 4), *Dcoef = up(&coef, 4);
    mt_cuda_adamw_item A[2][NA];
    int64_t tot = 0, n_of[NA];
    for (int k = 0; k < NA; k++) { n_of[k] = sizes[k % 12] + (k == 5 ? 2500000 : 0); tot += n_of[k] + 1; }
    float *p = randn(tot, 1), *g = randn(tot, 0.1), *m = randn(tot, 0.01), *v = (float *)malloc(4 * (size_t)tot);
    for (int64_t i = 0; i < tot; i++) v[i] = (float)fabs(mt_rng_normal(&R)) * 1e-3f;
    void *D[2][5];
    for (int s = 0; s < 2; s++) {
        D[s][0] = up(p, 4 * (size_t)tot); D[s][1] = up(g, 4 * (size_t)tot); D[s][2] = up(m, 4 * (size_t)tot); D[s][3] = up(v, 4 * (size_t)tot);
        D[s][4] = dalloc(2 * (size_t)tot);
        int64_t o = 0;
        for (int k = 0; k < NA; k++) {
            int64_t at = o + (k % 7 == 6 ? 1 : 0);   /* some unaligned */
            A[s][k].p = (float *)D[s][0] + at; A[s][k].g = (const float *)D[s][1] + at;
            A[s][k].m = (float *)D[s][2] + at; A[s][k].v = (float *)D[s][3] + at;
            A[s][k].p_bf16 = k % 4 == 3 ? NULL : (void *)((uint16_t *)D[s][4] + at);
            A[s][k].n = k % 7 == 6 && n_of[k] ? n_of[k] - 1 : n_of[k];
            A[s][k].decay = k % 2;
            A[s][k].bf16_moments = 0;   /* f32 moments (the mixed case is below): the field is read */
            o += n_of[k] + 1;
        }
    }
    int oka = 1;
    for (int k = 0; k < NA; k++)
        oka = oka && !mt_cuda_adamw(CU, A[0][k].p, A[0][k].m, A[0][k].v, A[0][k].p_bf16, A[0][k].g, A[0][k].n, (float *)Dlr,
                                    (float *)Dcoef, (float *)Dhp, (int32_t *)Dst, A[0][k].decay);
    oka = oka && !mt_cuda_adamw_multi(CU, A[1], NA, (float *)Dlr, (float *)Dcoef, (float *)Dhp, (int32_t *)Dst);
    int same = oka, changed = 0;
    char where[200] = "";
    for (int b = 0; b < 5 && same; b++) {
        if (b == 1) continue;
        size_t bytes = (b == 4 ? 2 : 4) * (size_t)tot;
        void *x = down(D[0][b], bytes), *y = down(D[1][b], bytes);
        same = !memcmp(x, y, bytes);
        if (b == 0) changed = memcmp(x, p, bytes) != 0;
        for (int64_t i = 0; !same && !where[0] && i < (int64_t)bytes / (b == 4 ? 2 : 4); i++) {   /* the first difference, and its tensor */
            uint32_t u = 0, w = 0;
            memcpy(&u, (char *)x + i * (b == 4 ? 2 : 4), b == 4 ? 2 : 4); memcpy(&w, (char *)y + i * (b == 4 ? 2 : 4), b == 4 ? 2 : 4);
            if (u == w) continue;
            int k = 0;
            for (int64_t o = 0; k < NA && o + n_of[k] + 1 <= i; k++) o += n_of[k] + 1;
            snprintf(where, sizeof where, "; buffer %d (p m v - p16) element %lld (tensor %d): %08x one per tensor, %08x multi", b, (long long)i, k, u, w);
        }
        free(x); free(y);
    }
    report("gpu AdamW: multi-tensor launches = one per tensor, bitwise", same && changed, "%d tensors, %lld elements%s%s", NA, (long long)tot,
           oka ? "" : "; a launch failed: ", oka ? where : mt_cuda_error(CU));
    for (int s = 0; s < 2; s++) for (int b = 0; b < 5; b++) dfree(D[s][b]);
    free(p); free(g); free(m); free(v);
    dfree(Dhp); dfree(Dst); dfree(Dlr); dfree(Dcoef);
}

/* AdamW with bf16 moments: the CUDA kernels against mt_cpu_adamw_bf16 (this float32 build), bitwise in
 * p, m and v (the header's mt_adamw_bf16_elem on both sides, one rounding per operation), p's bf16 copy
 * its round to nearest even; the 4-wide and the element paths (lengths, alignments), steps 0, 7 and
 * 100000, with and without decay, moments at zero, subnormal, large and ordinary; then multi-tensor
 * launches mixing bf16 and f32 moments against one launch per tensor, bitwise. */
static void gpu_test_adamw_bf16(void) {
    mt_hparams h;
    mt_hparams_default(&h);
    h.weight_decay = 0.1f;
    float hp[MT_HP_COUNT], lr = 3e-4f, coef = 0.7f;
    mt_hparams_pack(&h, hp);
    static const int32_t steps[3] = {0, 7, 100000};
    int cases = 0, same_all = 1, ok = 1;
    int64_t worst_at = -1;
    for (int k = 0; k < 6 && ok; k++) {
        int64_t n = k < 2 ? 100000 : k < 4 ? 100003 : 4096, off = k == 4 || k == 5 ? 1 : 0;   /* 4096 at an odd offset: unaligned */
        int32_t step = steps[k % 3];
        int decay = k % 2;
        float *p = randn(n + off, 1), *g = randn(n + off, 0.1), *pc = (float *)malloc(4 * (size_t)(n + off));
        uint16_t *m = (uint16_t *)malloc(2 * (size_t)(n + off)), *v = (uint16_t *)malloc(2 * (size_t)(n + off));
        for (int64_t i = 0; i < n + off; i++) {
            double r = mt_rng_normal(&R);
            int kind = (int)(i % 5);   /* zero, subnormal, large, and twice ordinary */
            m[i] = f2bf(kind == 0 ? 0.0f : kind == 1 ? (float)(r * 1e-39) : kind == 2 ? (float)(r * 1e3) : (float)(r * 0.01));
            v[i] = f2bf(kind == 0 ? 0.0f : kind == 1 ? (float)fabs(r * 1e-39) : kind == 2 ? (float)fabs(r * 1e5) : (float)fabs(r * 1e-3));
            if (i % 97 == 0) g[i] = 0;
        }
        memcpy(pc, p, 4 * (size_t)(n + off));
        void *Dp = up(p, 4 * (size_t)(n + off)), *Dg = up(g, 4 * (size_t)(n + off)), *Dm = up(m, 2 * (size_t)(n + off)), *Dv = up(v, 2 * (size_t)(n + off));
        void *Dp16 = dalloc(2 * (size_t)(n + off)), *Dhp = up(hp, sizeof hp), *Dst = up(&step, 4), *Dlr = up(&lr, 4), *Dcoef = up(&coef, 4);
        ok = !mt_cuda_adamw_bf16(CU, (float *)Dp + off, (uint16_t *)Dm + off, (uint16_t *)Dv + off, (uint16_t *)Dp16 + off, (const float *)Dg + off, n,
                                 (float *)Dlr, (float *)Dcoef, (float *)Dhp, (int32_t *)Dst, decay);
        mt_cpu_adamw_bf16(pc + off, m + off, v + off, g + off, n, (double)lr, (double)coef, hp, step, decay);
        float *gp = (float *)down(Dp, 4 * (size_t)(n + off));
        uint16_t *gm = (uint16_t *)down(Dm, 2 * (size_t)(n + off)), *gv = (uint16_t *)down(Dv, 2 * (size_t)(n + off)), *g16 = (uint16_t *)down(Dp16, 2 * (size_t)(n + off));
        int same = ok && !memcmp(gp + off, pc + off, 4 * (size_t)n) && !memcmp(gm + off, m + off, 2 * (size_t)n) && !memcmp(gv + off, v + off, 2 * (size_t)n);
        for (int64_t i = 0; same && i < n; i++) same = g16[off + i] == f2bf(pc[off + i]);
        for (int64_t i = 0; !same && worst_at < 0 && i < n; i++)
            if (memcmp(gp + off + i, pc + off + i, 4) || gm[off + i] != m[off + i] || gv[off + i] != v[off + i]) worst_at = i;
        same_all &= same;
        cases++;
        free(p); free(g); free(pc); free(m); free(v); free(gp); free(gm); free(gv); free(g16);
        dfree(Dp); dfree(Dg); dfree(Dm); dfree(Dv); dfree(Dp16); dfree(Dhp); dfree(Dst); dfree(Dlr); dfree(Dcoef);
    }
    report("gpu AdamW, bf16 moments = CPU float32 reference, bitwise", ok && same_all,
           "%d cases (n 100000, 100003, 4096 unaligned; steps 0, 7, 100000): weights, moments, bf16 copies; first difference at element %lld",
           cases, (long long)worst_at);

    /* multi-tensor launches, bf16 and f32 moments mixed, against one launch per tensor */
    enum { NA = 70 };
    static const int64_t sizes[] = {0, 1, 3, 17, 1000, 4096, 65536, 65537, 70001, 200003, 1100000, 3};
    int32_t step = 9;
    void *Dhp = up(hp, sizeof hp), *Dst = up(&step, 4), *Dlr = up(&lr, 4), *Dcoef = up(&coef, 4);
    mt_cuda_adamw_item A[2][NA];
    int64_t tot = 0, n_of[NA];
    for (int k = 0; k < NA; k++) { n_of[k] = sizes[k % 12]; tot += n_of[k] + 1; }
    float *p = randn(tot, 1), *g = randn(tot, 0.1), *m = randn(tot, 0.01), *v = (float *)malloc(4 * (size_t)tot);
    for (int64_t i = 0; i < tot; i++) v[i] = (float)fabs(mt_rng_normal(&R)) * 1e-3f;
    uint16_t *m16 = (uint16_t *)malloc(2 * (size_t)tot), *v16 = (uint16_t *)malloc(2 * (size_t)tot);
    for (int64_t i = 0; i < tot; i++) { m16[i] = f2bf(m[i]); v16[i] = f2bf(v[i]); }
    void *D[2][7];
    for (int s = 0; s < 2; s++) {
        D[s][0] = up(p, 4 * (size_t)tot); D[s][1] = up(g, 4 * (size_t)tot); D[s][2] = up(m, 4 * (size_t)tot); D[s][3] = up(v, 4 * (size_t)tot);
        D[s][4] = dalloc(2 * (size_t)tot); D[s][5] = up(m16, 2 * (size_t)tot); D[s][6] = up(v16, 2 * (size_t)tot);
        int64_t o = 0;
        for (int k = 0; k < NA; k++) {
            int64_t at = o + (k % 7 == 6 ? 1 : 0);   /* some unaligned */
            int bf = k % 3 != 2;
            A[s][k].p = (float *)D[s][0] + at; A[s][k].g = (const float *)D[s][1] + at;
            A[s][k].m = bf ? (void *)((uint16_t *)D[s][5] + at) : (void *)((float *)D[s][2] + at);
            A[s][k].v = bf ? (void *)((uint16_t *)D[s][6] + at) : (void *)((float *)D[s][3] + at);
            A[s][k].bf16_moments = bf;
            A[s][k].p_bf16 = k % 4 == 3 ? NULL : (void *)((uint16_t *)D[s][4] + at);
            A[s][k].n = k % 7 == 6 && n_of[k] ? n_of[k] - 1 : n_of[k];
            A[s][k].decay = k % 2;
            o += n_of[k] + 1;
        }
    }
    int oka = 1;
    for (int k = 0; k < NA; k++)
        oka = oka && !(A[0][k].bf16_moments ? mt_cuda_adamw_bf16(CU, A[0][k].p, A[0][k].m, A[0][k].v, A[0][k].p_bf16, A[0][k].g, A[0][k].n, (float *)Dlr,
                                                                  (float *)Dcoef, (float *)Dhp, (int32_t *)Dst, A[0][k].decay)
                                            : mt_cuda_adamw(CU, A[0][k].p, (float *)A[0][k].m, (float *)A[0][k].v, A[0][k].p_bf16, A[0][k].g, A[0][k].n,
                                                            (float *)Dlr, (float *)Dcoef, (float *)Dhp, (int32_t *)Dst, A[0][k].decay));
    oka = oka && !mt_cuda_adamw_multi(CU, A[1], NA, (float *)Dlr, (float *)Dcoef, (float *)Dhp, (int32_t *)Dst);
    int same = oka, changed = 0;
    for (int b = 0; b < 7 && same; b++) {
        if (b == 1) continue;
        size_t bytes = (b >= 4 ? 2 : 4) * (size_t)tot;
        void *x = down(D[0][b], bytes), *y = down(D[1][b], bytes);
        same = !memcmp(x, y, bytes);
        if (b == 5) changed = memcmp(x, m16, bytes) != 0;
        free(x); free(y);
    }
    report("gpu AdamW: multi-tensor launches, bf16 and f32 moments mixed = one per tensor, bitwise", same && changed, "%d tensors, %lld elements", NA,
           (long long)tot);
    for (int s = 0; s < 2; s++) for (int b = 0; b < 7; b++) dfree(D[s][b]);
    free(p); free(g); free(m); free(v); free(m16); free(v16);
    dfree(Dhp); dfree(Dst); dfree(Dlr); dfree(Dcoef);

    /* whole steps with bf16 moments: half the moments' bytes; multi-tensor launches = one launch per node, bitwise */
    mt_config c;
    mt_err e;
    mt_graph gf, gb;
    mt_config_preset(&c, "tiny", &e);
    if (gpu_compile(&gf, &c, 1, 1, &e) || gpu_compile(&gb, &c, 1, 5, &e)) { report("gpu steps with bf16 moments", 0, "%s", e.msg); return; }
    int64_t of = 0, ob = 0;
    for (int i = 0; i < gf.n_values; i++) of += gf.values[i].role == MT_ROLE_OPT ? gf.values[i].nbytes : 0;
    for (int i = 0; i < gb.n_values; i++) ob += gb.values[i].role == MT_ROLE_OPT ? gb.values[i].nbytes : 0;
    enum { S = 5 };
    double l1[S] = {0}, l2[S] = {0}, lf[S] = {0};
    mt_binding b;
    mt_binding_single(&b);
    b.one_launch_per_node = 1;
    mt_runtime *r1 = gpu_runtime(&gb, 1), *r2 = NULL, *rf = gpu_runtime(&gf, 0);
    int okw = r1 && rf && !gpu_steps(r1, &c, S, l1, NULL) && !mt_runtime_create(&r2, &gb, &b, &e) && !mt_runtime_init_params(r2, 5, &e) &&
              !gpu_steps(r2, &c, S, l2, NULL) && !gpu_steps(rf, &c, S, lf, NULL);
    int same_moments = okw;
    for (int i = 0; same_moments && i < gb.n_values; i++) {
        if (gb.values[i].role != MT_ROLE_OPT) continue;
        size_t nb = (size_t)gb.values[i].nbytes;
        void *x = malloc(nb), *y = malloc(nb);
        same_moments = !mt_runtime_read(r1, i, x, &e) && !mt_runtime_read(r2, i, y, &e) && !memcmp(x, y, nb);
        free(x); free(y);
    }
    double w = okw ? max_rel(l1, lf, S) : 1;
    report("gpu steps with bf16 moments: multi-tensor = one launch per node, bitwise; near fp32 moments",
           okw && of == 2 * ob && mt_runtime_multi_tensor_nodes(r1) > 0 && bitwise_equal(l1, l2, S) && gpu_same_params(&gb, r1, &gb, r2) &&
           same_moments && w < 1e-3, "moments %lld -> %lld bytes; %d steps; worst rel loss vs fp32 moments %.1e", (long long)of, (long long)ob, S, w);
    mt_runtime_destroy(r1); mt_runtime_destroy(r2); mt_runtime_destroy(rf);
    mt_graph_free(&gf); mt_graph_free(&gb);
}

/* whole steps: CPU (f32) vs CUDA (bf16), bitwise determinism, artifact vs in-process */
static int gpu_compile(mt_graph *g, const mt_config *c, int cuda, int planned, mt_err *e) {
    mt_mesh m;
    mt_target t;
    mt_passes p;
    mt_mesh_single(&m);
    if (cuda) mt_target_cuda(&t, "sm_90a"); else mt_target_cpu(&t);
    if (planned) mt_passes_all(&p); else mt_passes_none(&p);
    if (planned == 2) p.fuse = 0;   /* every pass but fusion: bitwise the eager step */
    if (planned == 3) p.overlap = 0;   /* every pass but overlap */
    if (planned == 4) p.fuse_glu = 0;  /* every pass but the gate/up + SwiGLU fusion */
    if (planned == 5) p.moments = MT_BF16;   /* every pass, bf16 AdamW moments */
    if (planned == 6) p.fp8 = 1;             /* every pass, FP8 GEMMs */
    if (planned == 7) { mt_passes_none(&p); p.fp8 = 1; }   /* FP8 GEMMs alone: no fusion, no plan */
    if (planned == 8) p.fp8 = MT_FP8_NO_WGRAD;          /* every pass, FP8 GEMMs but the weight gradients' */
    if (planned == 9) { p.fp8 = 1; p.moments = MT_BF16; }   /* every pass, FP8 GEMMs, bf16 AdamW moments */
    if (planned == 10) { p.fp8 = 1; p.moe_chunks = 2; }    /* every pass, FP8 GEMMs, each MoE layer in 2 chunks of tokens */
    return mt_compile(g, c, &m, &t, MT_GRAPH_TRAIN, &p, e);
}
static mt_runtime *gpu_runtime(const mt_graph *g, int poison) {
    mt_binding b;
    mt_err e;
    mt_runtime *rt;
    mt_binding_single(&b);
    b.poison = poison;
    if (mt_runtime_create(&rt, g, &b, &e)) { printf("  runtime: %s\n", e.msg); return NULL; }
    if (mt_runtime_init_params(rt, 5, &e)) { printf("  init: %s\n", e.msg); mt_runtime_destroy(rt); return NULL; }
    return rt;
}
static int gpu_steps(mt_runtime *rt, const mt_config *c, int n, double *loss, double *gnorm) {
    int64_t N = (int64_t)c->batch * c->seq_len;
    int32_t *tok = (int32_t *)malloc(4 * (size_t)N), *tgt = (int32_t *)malloc(4 * (size_t)N);
    mt_hparams hp;
    mt_hparams_default(&hp);
    mt_err e;
    int rc = 0;
    for (int s = 0; s < n && !rc; s++) {
        mt_rng r;
        mt_rng_seed(&r, 77 + (uint64_t)s);
        for (int64_t i = 0; i < N; i++) {
            tok[i] = (int32_t)(mt_rng_u64(&r) % (uint64_t)c->vocab_size);
            if (c->doc_mask && mt_rng_u64(&r) % 12 == 0) tok[i] = c->eot_id;   /* documents of ~12 tokens */
            tgt[i] = (tok[i] * 5 + 1) % c->vocab_size;
        }
        mt_step_stats st;
        if (mt_runtime_step(rt, tok, tgt, s, &hp, &st, &e)) { printf("  step: %s\n", e.msg); rc = -1; break; }
        loss[s] = st.loss;
        if (gnorm) gnorm[s] = st.grad_norm;
    }
    free(tok); free(tgt);
    return rc;
}
/* Multi-token prediction on the GPU (2 depths, document masks): the main and MTP losses and grad norms follow the CPU's
 * float32 steps, and two GPU runs are bitwise the same. */
static void gpu_test_mtp(void) {
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "tiny", &e);
    c.mtp_layers = 2; c.doc_mask = 1; c.eot_id = 3;
    mt_graph gc, gg;
    if (gpu_compile(&gc, &c, 0, 1, &e) || gpu_compile(&gg, &c, 1, 1, &e)) { report("gpu MTP steps", 0, "%s", e.msg); return; }
    enum { S = 5 };
    double l[3][S], m[3][S], g[3][S];
    mt_runtime *rt[3] = {gpu_runtime(&gc, 0), gpu_runtime(&gg, 1), gpu_runtime(&gg, 0)};
    int64_t N = (int64_t)c.batch * c.seq_len;
    int32_t *tok = (int32_t *)malloc(4 * (size_t)N), *tgt = (int32_t *)malloc(4 * (size_t)N);
    mt_hparams hp;
    mt_hparams_default(&hp);
    int ok = rt[0] && rt[1] && rt[2];
    for (int k = 0; ok && k < 3; k++)
        for (int s = 0; ok && s < S; s++) {
            mt_rng r;
            mt_rng_seed(&r, 77 + (uint64_t)s);
            for (int64_t i = 0; i < N; i++) {
                tok[i] = (int32_t)(mt_rng_u64(&r) % (uint64_t)c.vocab_size);
                if (mt_rng_u64(&r) % 12 == 0) tok[i] = c.eot_id;
                tgt[i] = (tok[i] * 5 + 1) % c.vocab_size;
            }
            mt_step_stats st;
            ok = !mt_runtime_step(rt[k], tok, tgt, s, &hp, &st, &e);
            l[k][s] = st.loss; m[k][s] = st.mtp_loss; g[k][s] = st.grad_norm;
        }
    double wl = 0, wm = 0, wg = 0;
    for (int s = 0; ok && s < S; s++) {
        wl = fmax(wl, fabs(l[1][s] - l[0][s]) / l[0][s]);
        wm = fmax(wm, fabs(m[1][s] - m[0][s]) / m[0][s]);
        wg = fmax(wg, fabs(g[1][s] - g[0][s]) / g[0][s]);
    }
    report("gpu MTP (2 depths, document masks) steps vs CPU", ok && wl < 2e-2 && wm < 2e-2 && wg < 1e-1 && m[1][S - 1] < m[1][0],
           "MTP loss %.5f -> %.5f (CPU %.5f -> %.5f); worst rel loss %.1e, MTP loss %.1e, grad norm %.1e %s", ok ? m[1][0] : 0,
           ok ? m[1][S - 1] : 0, ok ? m[0][0] : 0, ok ? m[0][S - 1] : 0, wl, wm, wg, ok ? "" : e.msg);
    report("gpu MTP steps bitwise run to run (poisoned arena too)", ok && bitwise_equal(l[1], l[2], S) && bitwise_equal(m[1], m[2], S) &&
           bitwise_equal(g[1], g[2], S), NULL);
    free(tok); free(tgt);
    for (int k = 0; k < 3; k++) mt_runtime_destroy(rt[k]);
    mt_graph_free(&gc); mt_graph_free(&gg);
}

/* The FP8 step (mt_pass_fp8) on the GPU: against the CPU's emulation (same quantization, other accumulation
 * order), fused (MATMUL_ACC, GMM_GLU, GMM_DX2) against unfused, bitwise run to run, and not the bf16 step. */
static void gpu_test_fp8_steps(void) {
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "tiny", &e);
    c.qk_rope_head_dim = 16;   /* every linear layer's widths multiples of 16: all of them FP8 */
    mt_graph gc, gf, gu, gb;
    if (gpu_compile(&gc, &c, 0, 6, &e) || gpu_compile(&gf, &c, 1, 6, &e) || gpu_compile(&gu, &c, 1, 7, &e) || gpu_compile(&gb, &c, 1, 1, &e)) {
        report("gpu FP8 steps", 0, "%s", e.msg);
        return;
    }
    enum { S = 6 };
    double l[5][S], g[5][S];
    mt_runtime *rt[5] = {gpu_runtime(&gc, 0), gpu_runtime(&gf, 1), gpu_runtime(&gf, 0), gpu_runtime(&gu, 0), gpu_runtime(&gb, 0)};
    int ok = 1;
    for (int k = 0; k < 5; k++) ok = ok && rt[k] && !gpu_steps(rt[k], &c, S, l[k], g[k]);
    double wl = 0, wg = 0, ul = 0;
    for (int s = 0; ok && s < S; s++) {
        wl = fmax(wl, fabs(l[1][s] - l[0][s]) / l[0][s]);
        wg = fmax(wg, fabs(g[1][s] - g[0][s]) / g[0][s]);
        ul = fmax(ul, fabs(l[3][s] - l[1][s]) / l[1][s]);
    }
    int nodes = mt_graph_fp8(&gf) > 0 && mt_graph_fp8(&gu) > mt_graph_fp8(&gf);
    report("gpu FP8 steps vs the CPU's emulation, fused vs unfused", ok && nodes && wl < 2e-2 && wg < 1e-1 && ul < 2e-2 && l[1][S - 1] < l[1][0],
           "loss %.5f -> %.5f (CPU %.5f -> %.5f); worst rel loss %.1e, grad norm %.1e; unfused loss %.1e; %d / %d FP8 nodes %s",
           ok ? l[1][0] : 0, ok ? l[1][S - 1] : 0, ok ? l[0][0] : 0, ok ? l[0][S - 1] : 0, wl, wg, ul, mt_graph_fp8(&gf), mt_graph_fp8(&gu),
           ok ? "" : e.msg);
    report("gpu FP8 steps bitwise run to run (poisoned arena too), not bf16's", ok && bitwise_equal(l[1], l[2], S) && bitwise_equal(g[1], g[2], S) &&
           !bitwise_equal(g[1], g[4], S), "grad norm step 0: fp8 %.9g, bf16 %.9g", ok ? g[1][0] : 0, ok ? g[4][0] : 0);
    {   /* operands quantized once for several nodes (weights in both forms, the weight gradients' shared X) = each node its own */
        mt_binding b;
        mt_runtime *rq = NULL;
        double lq[S], gq[S];
        mt_binding_single(&b);
        b.fp8_requantize = 1;
        int okq = ok && !mt_runtime_create(&rq, &gf, &b, &e) && !mt_runtime_init_params(rq, 5, &e) && !gpu_steps(rq, &c, S, lq, gq);
        int shared = rt[2] ? mt_runtime_fp8_shared(rt[2]) : 0, both = rt[2] ? mt_runtime_fp8_both(rt[2]) : 0;
        int sw = rt[2] ? mt_runtime_fp8_by_swiglu(rt[2]) : 0, swu = rt[3] ? mt_runtime_fp8_by_swiglu(rt[3]) : 0;
        int mo = rt[2] ? mt_runtime_fp8_by_moe(rt[2]) : 0;
        report("gpu FP8 shared operands = quantized by every node, bitwise", okq && shared > 0 && both > 0 && sw > 0 && swu > 0 && mo > 0 &&
               mt_runtime_fp8_shared(rq) == 0 && mt_runtime_fp8_by_swiglu(rq) == 0 && mt_runtime_fp8_by_moe(rq) == 0 &&
               bitwise_equal(lq, l[2], S) && bitwise_equal(gq, g[2], S),
               "%d operands shared (%d activations' rows and columns from one read, %d of them written by their SwiGLU, %d by the MoE "
               "permutation or the combine's backward; unfused graph %d by a SwiGLU); loss step %d %.9g", shared, both, sw, mo, swu, S - 1,
               okq ? lq[S - 1] : 0);
        mt_runtime_destroy(rq);
    }
    {   /* the MoE in 2 chunks: each chunk's permutation and combine backward write its slots = quantized by every node */
        mt_graph gk;
        mt_binding b;
        mt_runtime *ra = NULL, *rb = NULL;
        double la[S], ga[S], lb[S], gb2[S];
        int compiled = !gpu_compile(&gk, &c, 1, 10, &e), okk = compiled;
        mt_binding_single(&b);
        okk = okk && !mt_runtime_create(&ra, &gk, &b, &e) && !mt_runtime_init_params(ra, 5, &e);
        b.fp8_requantize = 1;
        okk = okk && !mt_runtime_create(&rb, &gk, &b, &e) && !mt_runtime_init_params(rb, 5, &e);
        okk = okk && !gpu_steps(ra, &c, S, la, ga) && !gpu_steps(rb, &c, S, lb, gb2);
        int mo = okk ? mt_runtime_fp8_by_moe(ra) : 0;
        report("gpu FP8 with the MoE in 2 chunks: the permutation's and combine's forms = quantized by every node, bitwise",
               okk && mt_graph_moe_chunks(&gk) == 2 && mo >= 4 * c.n_layers - 4 * c.n_dense_layers && bitwise_equal(la, lb, S) &&
               bitwise_equal(ga, gb2, S), "%d slots written by the chunks' permutations and combine backwards; loss step %d %.9g %s", mo,
               S - 1, okk ? la[S - 1] : 0, okk ? "" : e.msg);
        mt_runtime_destroy(ra); mt_runtime_destroy(rb);
        if (compiled) mt_graph_free(&gk);
    }
    for (int bm = 0; bm < 2; bm++) {   /* weights' forms written by AdamW; new weights from the host make them stale */
        mt_graph gm;
        mt_binding b;
        mt_runtime *ra = NULL, *rb = NULL;
        double la[2][3], ga[2][3], lb[2][3], gb2[2][3];
        int compiled = !gpu_compile(&gm, &c, 1, bm ? 9 : 6, &e), okm = compiled, small = -1;
        mt_binding_single(&b);
        if (okm && !mt_runtime_create(&ra, &gm, &b, &e)) {   /* tiny's weights: all below MT_FP8_ADAMW_MIN */
            small = mt_runtime_fp8_by_optimizer(ra);
            mt_runtime_destroy(ra);
            ra = NULL;
        }
        b.fp8_adamw_min = 1;
        okm = okm && !mt_runtime_create(&ra, &gm, &b, &e) && !mt_runtime_init_params(ra, 5, &e);
        b.fp8_requantize = 1;
        okm = okm && !mt_runtime_create(&rb, &gm, &b, &e) && !mt_runtime_init_params(rb, 5, &e);
        for (int r = 0; okm && r < 2; r++)
            okm = !gpu_steps(ra, &c, 3, la[r], ga[r]) && !gpu_steps(rb, &c, 3, lb[r], gb2[r]) &&
                  (r || (!mt_runtime_init_params(ra, 9, &e) && !mt_runtime_init_params(rb, 9, &e)));
        int by = okm ? mt_runtime_fp8_by_optimizer(ra) : 0, copies = 0, same = okm;
        for (int i = 0; same && i < gm.n_values; i++) {   /* the bf16 weights read back: the same (refreshed where AdamW left them) */
            const mt_value *v = &gm.values[i];
            if (v->role != MT_ROLE_PARAM || v->param < 0) continue;
            void *x = malloc((size_t)v->nbytes), *y = malloc((size_t)v->nbytes);
            same = !mt_runtime_read(ra, i, x, &e) && !mt_runtime_read(rb, i, y, &e) && !memcmp(x, y, (size_t)v->nbytes);
            copies++;
            free(x); free(y);
        }
        report(bm ? "gpu FP8 weights quantized by AdamW = by every node, bitwise; new weights from the host (bf16 moments)"
                  : "gpu FP8 weights quantized by AdamW = by every node, bitwise; new weights from the host",
               okm && by > 0 && small == 0 && same && bitwise_equal(la[0], lb[0], 3) && bitwise_equal(ga[0], gb2[0], 3) && bitwise_equal(la[1], lb[1], 3) &&
               bitwise_equal(ga[1], gb2[1], 3) && !bitwise_equal(la[0], la[1], 3),
               "%d weights by AdamW (the least 1 element; %d at the default least); 3 steps, new weights, 3 steps; %d bf16 weights read "
               "back the same %s", by, small, copies, okm ? "" : e.msg);
        mt_runtime_destroy(ra); mt_runtime_destroy(rb);
        if (compiled) mt_graph_free(&gm);
    }
    {   /* --fp8-wgrad bf16 against its CPU emulation */
        mt_graph hc, hg;
        double lc[S], gcn[S], lg[S], ggn[S], w8 = 1, g8 = 1;
        int okw = !gpu_compile(&hc, &c, 0, 8, &e) && !gpu_compile(&hg, &c, 1, 8, &e);
        mt_runtime *qc = okw ? gpu_runtime(&hc, 0) : NULL, *qg = okw ? gpu_runtime(&hg, 0) : NULL;
        okw = okw && qc && qg && !gpu_steps(qc, &c, S, lc, gcn) && !gpu_steps(qg, &c, S, lg, ggn);
        for (int s = 0; okw && s < S; s++) {
            w8 = s ? fmax(w8, fabs(lg[s] - lc[s]) / lc[s]) : fabs(lg[s] - lc[s]) / lc[s];
            g8 = s ? fmax(g8, fabs(ggn[s] - gcn[s]) / gcn[s]) : fabs(ggn[s] - gcn[s]) / gcn[s];
        }
        report("gpu FP8 steps with bf16 weight gradients vs the CPU's emulation", okw && mt_graph_fp8_mode(&hg) == MT_FP8_NO_WGRAD && w8 < 2e-2 && g8 < 1e-1 &&
               !bitwise_equal(lg, l[1], S), "worst rel loss %.1e, grad norm %.1e; %d FP8 nodes (all: %d)", w8, g8, okw ? mt_graph_fp8(&hg) : 0, mt_graph_fp8(&gf));
        mt_runtime_destroy(qc); mt_runtime_destroy(qg);
        if (okw) { mt_graph_free(&hc); mt_graph_free(&hg); }
    }
    for (int k = 0; k < 5; k++) mt_runtime_destroy(rt[k]);
    mt_graph_free(&gc); mt_graph_free(&gf); mt_graph_free(&gu); mt_graph_free(&gb);
}

static void gpu_test_whole_steps(void) {
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "tiny", &e);
    c.q_lora_rank = 24;
    mt_graph gc, gg, ge, gn;
    if (gpu_compile(&gc, &c, 0, 1, &e) || gpu_compile(&gg, &c, 1, 1, &e) || gpu_compile(&ge, &c, 1, 0, &e) || gpu_compile(&gn, &c, 1, 2, &e)) {
        report("gpu whole step", 0, "%s", e.msg);
        return;
    }
    enum { S = 5 };
    double lc[S] = {0}, lg[S] = {0}, lg2[S] = {0}, le[S] = {0}, ln[S] = {0}, la[S] = {0}, nc[S] = {0}, ng[S] = {0};
    mt_runtime *rc = gpu_runtime(&gc, 0), *r1 = gpu_runtime(&gg, 1), *r2 = gpu_runtime(&gg, 0), *r3 = gpu_runtime(&ge, 0), *r5 = gpu_runtime(&gn, 1);
    for (int on_device = 0; on_device < 2; on_device++) {   /* host fill + upload, and in place on the GPU: the CPU's bits */
        mt_binding b;
        mt_binding_single(&b);
        b.init_on_host = !on_device;
        mt_runtime *ri = NULL;
        int same = rc && !mt_runtime_create(&ri, &gg, &b, &e) && !mt_runtime_init_params(ri, 5, &e), nv = 0;
        for (int i = 0; same && i < gg.n_values; i++) {
            const mt_value *v = &gg.values[i];
            if (!((v->role == MT_ROLE_PARAM && v->param < 0) || v->role == MT_ROLE_OPT)) continue;
            int j = mt_graph_find(&gc, v->name);
            if (j < 0 || gc.values[j].nbytes != v->nbytes) { same = 0; break; }
            void *a = malloc((size_t)v->nbytes), *x = malloc((size_t)v->nbytes);
            same = !mt_runtime_read(ri, i, a, &e) && !mt_runtime_read(rc, j, x, &e) && !memcmp(a, x, (size_t)v->nbytes);
            free(a); free(x);
            nv++;
        }
        report(on_device ? "gpu parameter init on the device = CPU init, bitwise" : "gpu parameter init (host fill) = CPU init, bitwise",
               same && nv > 0, "%d masters and moments%s%s", nv, same ? "" : ": ", same ? "" : e.msg);
        mt_runtime_destroy(ri);
    }
    int ok = rc && r1 && r2 && r3 && r5 && !gpu_steps(rc, &c, S, lc, nc) && !gpu_steps(r1, &c, S, lg, ng) && !gpu_steps(r2, &c, S, lg2, NULL) &&
             !gpu_steps(r3, &c, S, le, NULL) && !gpu_steps(r5, &c, S, ln, NULL);
    int fused_gemm = 0;
    for (int i = 0; i < gg.n_nodes; i++) fused_gemm += gg.nodes[i].op == MT_OP_MATMUL_ACC || gg.nodes[i].op == MT_OP_GMM_DX2;
    double worst_ec = 0;
    for (int s = 0; ok && s < S; s++)
        if (fabs(lg[s] - le[s]) / le[s] > worst_ec) worst_ec = fabs(lg[s] - le[s]) / le[s];
    double worst = 0, worst_n = 0;
    for (int s = 0; ok && s < S; s++) {
        if (fabs(lg[s] - lc[s]) / lc[s] > worst) worst = fabs(lg[s] - lc[s]) / lc[s];
        if (fabs(ng[s] - nc[s]) / nc[s] > worst_n) worst_n = fabs(ng[s] - nc[s]) / nc[s];
    }
    report("gpu tiny training steps vs CPU reference", ok && worst < 2e-2 && worst_n < 1e-1, "loss %.5f vs %.5f .. %.5f vs %.5f; worst rel loss %.1e, grad norm %.1e",
           lg[0], lc[0], lg[S - 1], lc[S - 1], worst, worst_n);
    report("gpu bitwise determinism (poisoned arena too)", ok && bitwise_equal(lg, lg2, S), NULL);
    report("gpu eager = compiled without fusion (elision, plan, capture), bitwise", ok && bitwise_equal(ln, le, S), NULL);
    report("gpu eager vs compiled: GEMM-epilogue sums round once, close", ok && fused_gemm > 0 && worst_ec < 1e-3,
           "%d fused GEMM sums; worst rel loss difference %.1e (bitwise: %s)", fused_gemm, worst_ec, bitwise_equal(lg, le, S) ? "yes" : "no");
    int wsame = ok;
    for (int i = 0; wsame && i < gg.n_values; i++)
        if (gg.values[i].role == MT_ROLE_PARAM) {
            size_t nb = (size_t)gg.values[i].nbytes;
            void *a = malloc(nb), *b = malloc(nb);
            wsame = !mt_runtime_read(r1, i, a, &e) && !mt_runtime_read(r2, i, b, &e) && !memcmp(a, b, nb);
            free(a); free(b);
        }
    report("gpu bitwise-identical weights after 5 steps", wsame, NULL);
    uint8_t *bytes;
    size_t len;
    mt_graph gl;
    int ok2 = !mt_artifact_write(&gg, &bytes, &len, &e) && !mt_artifact_read(&gl, bytes, len, &e);
    if (ok2) {
        mt_runtime *r4 = gpu_runtime(&gl, 0);
        ok2 = r4 && !gpu_steps(r4, &c, S, la, NULL) && bitwise_equal(lg, la, S);
        mt_runtime_destroy(r4);
        mt_graph_free(&gl);
        free(bytes);
    }
    report("gpu precompiled artifact = in-process, bitwise", ok2, NULL);
    {   /* overlap on (gg) vs off: one GPU has no collective worth a stream, so the steps must agree (bitwise, in fact) */
        mt_graph go;
        double lo[S] = {0}, lo2[S] = {0};
        int ok3 = ok && !gpu_compile(&go, &c, 1, 3, &e);
        mt_runtime *ro = ok3 ? gpu_runtime(&go, 0) : NULL;
        ok3 = ok3 && ro && !gpu_steps(ro, &c, S, lo, NULL);
        mt_runtime *rp = ok3 ? gpu_runtime(&gg, 0) : NULL;
        ok3 = ok3 && rp && !gpu_steps(rp, &c, S, lo2, NULL);
        double w = ok3 ? max_rel(lg, lo, S) : 1;
        report("gpu overlap on vs off: within bf16 tolerance; on twice bitwise", ok3 && w < 1e-3 && bitwise_equal(lg, lo2, S),
               "worst rel loss %.1e (bitwise: %s)", w, ok3 && bitwise_equal(lg, lo, S) ? "yes" : "no");
        mt_runtime_destroy(ro); mt_runtime_destroy(rp);
        if (ok && ok3) mt_graph_free(&go);
    }
    {   /* the experts' gate and up GEMMs and their SwiGLU as one op (gg) against three ops: bitwise */
        mt_graph gu;
        double lu[S] = {0};
        int glu = 0, left = 0, made = ok && !gpu_compile(&gu, &c, 1, 4, &e), oku = made;
        for (int i = 0; i < gg.n_nodes; i++) glu += gg.nodes[i].op == MT_OP_GMM_GLU;
        for (int i = 0; oku && i < gu.n_nodes; i++) left += gu.nodes[i].op == MT_OP_GMM_GLU;
        mt_runtime *ru = oku ? gpu_runtime(&gu, 1) : NULL;
        oku = oku && ru && !gpu_steps(ru, &c, S, lu, NULL);
        report("gpu experts' gate/up GEMMs + SwiGLU as one op (GMM_GLU) = three ops, bitwise", oku && glu == 2 && !left && bitwise_equal(lg, lu, S),
               "%d fused (%d without the pass); worst rel loss %.1e", glu, left, oku ? max_rel(lg, lu, S) : 1.0);
        mt_runtime_destroy(ru);
        if (made) mt_graph_free(&gu);
    }
    {   /* the gradient norm's and AdamW's runs as multi-tensor launches (r2) against one launch per node: bitwise */
        mt_binding b;
        mt_binding_single(&b);
        b.one_launch_per_node = 1;
        mt_runtime *rl = NULL;
        double ll[S] = {0};
        int okl = ok && !mt_runtime_create(&rl, &gg, &b, &e) && !mt_runtime_init_params(rl, 5, &e) && !gpu_steps(rl, &c, S, ll, NULL);
        int64_t batched = r2 ? mt_runtime_multi_tensor_nodes(r2) : 0;
        report("gpu multi-tensor grad norm + AdamW = one launch per node, bitwise (losses, weights)",
               okl && batched > 0 && rl && !mt_runtime_multi_tensor_nodes(rl) && bitwise_equal(lg2, ll, S) && gpu_same_params(&gg, r2, &gg, rl),
               "%lld nodes in multi-tensor launches", (long long)batched);
        mt_runtime_destroy(rl);
    }
    for (int eager = 0; eager < 2; eager++) {   /* profiled steps (node by node, an event after each): the same bits, every node timed */
        const mt_graph *gp = eager ? &ge : &gg;
        double lp[S] = {0}, ms[MT_NOPS], tot = 0;
        int64_t calls[MT_NOPS], nc = 0;
        mt_runtime *rq = ok ? gpu_runtime(gp, 0) : NULL;
        int okp = rq != NULL;
        if (okp) mt_runtime_set_profile(rq, 1);
        okp = okp && !gpu_steps(rq, &c, S, lp, NULL);
        if (okp) {
            mt_runtime_profile(rq, ms, calls);
            for (int i = 0; i < MT_NOPS; i++) { tot += ms[i]; nc += calls[i]; okp = okp && isfinite(ms[i]) && ms[i] >= 0; }
        }
        report(eager ? "gpu profiled eager steps = unprofiled, bitwise" : "gpu profiled compiled steps = unprofiled, bitwise",
               okp && bitwise_equal(eager ? le : lg, lp, S) && nc == (int64_t)S * gp->n_nodes && tot > 0, "%lld node calls timed, %.2f ms", (long long)nc, tot);
        mt_runtime_destroy(rq);
    }
    mt_runtime_destroy(rc); mt_runtime_destroy(r1); mt_runtime_destroy(r2); mt_runtime_destroy(r3); mt_runtime_destroy(r5);
    mt_graph_free(&gc); mt_graph_free(&gg); mt_graph_free(&ge); mt_graph_free(&gn);
}

/* Every parameter (expert biases too) of runtime ra over graph ga bitwise that of rb over gb, matched by name */
static int gpu_same_params(const mt_graph *ga, mt_runtime *ra, const mt_graph *gb, mt_runtime *rb) {
    mt_err e;
    int same = 1;
    for (int i = 0; same && i < ga->n_values; i++) {
        const mt_value *v = &ga->values[i];
        if (v->role != MT_ROLE_PARAM) continue;
        int j = mt_graph_find(gb, v->name);
        size_t nb = (size_t)v->nbytes;
        void *a = malloc(nb), *b = malloc(nb);
        same = j >= 0 && (size_t)gb->values[j].nbytes == nb && !mt_runtime_read(ra, i, a, &e) && !mt_runtime_read(rb, j, b, &e) && !memcmp(a, b, nb);
        free(a); free(b);
    }
    return same;
}

/* Training steps with the RoPE folded into attention (the default for these head dims) against the
 * same graph with the pass off: bitwise losses, grad norms and weights; with packed documents too. */
static void gpu_test_fold_rope_steps(int docs) {
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "tiny", &e);
    c.n_heads = 2; c.qk_nope_head_dim = 128; c.qk_rope_head_dim = 64; c.v_head_dim = 128;
    c.seq_len = 256; c.original_seq_len = 256; c.batch = 2;
    if (docs) { c.doc_mask = 1; c.eot_id = 10; }
    mt_mesh m;
    mt_target t;
    mt_passes p;
    mt_graph g0, g1;
    mt_mesh_single(&m);
    mt_target_cuda(&t, "sm_90a");
    mt_passes_all(&p);
    char name[96];
    snprintf(name, sizeof name, "gpu steps with RoPE folded = unfolded, bitwise%s", docs ? " (documents)" : "");
    if (mt_compile(&g1, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e)) { report(name, 0, "%s", e.msg); return; }
    p.fold_rope = 0;
    if (mt_compile(&g0, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e)) { report(name, 0, "%s", e.msg); mt_graph_free(&g1); return; }
    int folded = 0;
    for (int i = 0; i < g1.n_nodes; i++) folded += g1.nodes[i].op == MT_OP_MLA_ATTENTION_BWD;
    enum { S = 5 };
    double l0[S] = {0}, l1[S] = {0}, n0[S] = {0}, n1[S] = {0};
    mt_runtime *r0 = gpu_runtime(&g0, 1), *r1 = gpu_runtime(&g1, 1);
    int ok = r0 && r1 && !gpu_steps(r0, &c, S, l0, n0) && !gpu_steps(r1, &c, S, l1, n1);
    int same = ok && bitwise_equal(l0, l1, S) && bitwise_equal(n0, n1, S) && gpu_same_params(&g0, r0, &g1, r1);
    report(name, same && folded == c.n_layers, "%d layers folded; loss %.6f -> %.6f; peak %.2f -> %.2f MiB", folded, l1[0], l1[S - 1],
           mt_graph_peak_bytes(&g0) / 1048576.0, mt_graph_peak_bytes(&g1) / 1048576.0);
    mt_runtime_destroy(r0); mt_runtime_destroy(r1);
    mt_graph_free(&g0); mt_graph_free(&g1);
}

/* Activation recompute on the GPU: every block recomputed (bf16 activations
 * re-run by the same kernels, graph capture on), bitwise the step without. */
static void gpu_test_recompute(void) {
    mt_config c;
    mt_err e;
    mt_mesh m;
    mt_target t;
    mt_graph g0, ga;
    mt_config_preset(&c, "tiny", &e);
    c.q_lora_rank = 24;
    mt_mesh_single(&m);
    mt_target_cuda(&t, "sm_90a");
    int32_t all[64];
    for (int i = 0; i < c.n_layers; i++) all[i] = i;
    if (gpu_compile(&g0, &c, 1, 1, &e)) { report("gpu recompute", 0, "%s", e.msg); return; }
    if (mt_build(&ga, &c, &m, &t, MT_GRAPH_TRAIN, &e)) { report("gpu recompute", 0, "%s", e.msg); mt_graph_free(&g0); return; }
    if (mt_pass_elide_collectives(&ga, &e) || mt_pass_recompute(&ga, all, c.n_layers, &e) || mt_pass_fuse(&ga, &e) ||
        mt_pass_plan_memory(&ga, &e)) { report("gpu recompute", 0, "%s", e.msg); mt_graph_free(&g0); return; }
    ga.capture = 1;   /* as mt_run_passes sets it for CUDA */
    enum { S = 5 };
    double l0[S] = {0}, la[S] = {0}, n0[S] = {0}, na[S] = {0};
    mt_runtime *r0 = gpu_runtime(&g0, 1), *ra = gpu_runtime(&ga, 1);
    int ok = r0 && ra && !gpu_steps(r0, &c, S, l0, n0) && !gpu_steps(ra, &c, S, la, na);
    int same = ok && bitwise_equal(l0, la, S) && bitwise_equal(n0, na, S) && gpu_same_params(&g0, r0, &ga, ra);
    report("gpu recompute every block: bitwise losses, norms, weights", same, "planned peak %.2f -> %.2f MiB",
           mt_graph_peak_bytes(&g0) / 1048576.0, mt_graph_peak_bytes(&ga) / 1048576.0);
    mt_runtime_destroy(r0); mt_runtime_destroy(ra);
    mt_graph_free(&g0); mt_graph_free(&ga);
}

/* Many GPUs (thread-ranks in this process, one GPU each, NCCL): the same
 * checks as the CPU's, with bf16 tolerances against one GPU. */
static void gpu_test_multi_rank(void) {
    int ndev = mt_cuda_device_count();
    if (ndev < 2) { printf("SKIP multi-GPU tests: %d GPU visible, they need 2\n", ndev); return; }
    mt_err e;
    mt_graph g1, g2, gf;
    int ok = mr_compile_for(&g1, 1, 1, 1, 4, 0, 1, &e) == 0 && mr_compile_for(&g2, 1, 2, 2, 2, 0, 1, &e) == 0 &&
             mr_compile_for(&gf, 1, 2, 1, 2, 0, 1, &e) == 0;
    if (!ok) { report("multi-GPU graphs", 0, "%s", e.msg); return; }
    mr_job a, b, c;
    memset(&a, 0, sizeof a); memset(&b, 0, sizeof b); memset(&c, 0, sizeof c);
    a.fail_rank = b.fail_rank = c.fail_rank = -1;
    ok = mr_run(&a, &g1, 10, &e) == 0 && mr_run(&b, &g2, 10, &e) == 0 && mr_run(&c, &gf, 10, &e) == 0;
    double r1 = ok ? fabs(a.loss[0] - b.loss[0]) / a.loss[0] : 1, rn = ok ? max_rel(b.loss, a.loss, 10) : 1;
    double f1 = ok ? fabs(a.loss[0] - c.loss[0]) / a.loss[0] : 1, fn = ok ? max_rel(c.loss, a.loss, 10) : 1;
    report("2 GPUs (dp_shard 2, ep 2) = 1 GPU on the global batch (bf16)", ok && r1 < 1e-3 && rn < 2e-2,
           "step 1 %.1e, 10 steps %.1e; losses %.5f .. %.5f %s", r1, rn, b.loss[0], b.loss[9], ok ? "" : e.msg);
    report("2 GPUs (dp_shard 2, FSDP only) = 1 GPU on the global batch (bf16)", ok && f1 < 1e-3 && fn < 2e-2,
           "step 1 %.1e, 10 steps %.1e", f1, fn);
    mr_job d;
    memset(&d, 0, sizeof d);
    d.fail_rank = -1;
    int ok2 = ok && mr_run(&d, &g2, 10, &e) == 0;
    int same = ok2 && bitwise_equal(b.loss, d.loss, 10) && bitwise_equal(b.gnorm, d.gnorm, 10);
    for (int r = 0; ok2 && r < 2; r++) same &= b.param_bytes[r] == d.param_bytes[r] && !memcmp(b.params[r], d.params[r], b.param_bytes[r]);
    report("2 GPUs: two runs bitwise equal (losses, norms, weights)", same, "%s", ok2 ? "" : e.msg);
    mr_free(&d);
    /* the artifact: precompiled once, loaded by both ranks */
    uint8_t *bytes = NULL;
    size_t len = 0;
    mt_graph gl;
    int ok3 = ok && mt_artifact_write(&g2, &bytes, &len, &e) == 0 && mt_artifact_read(&gl, bytes, len, &e) == 0;
    free(bytes);
    memset(&d, 0, sizeof d);
    d.fail_rank = -1;
    ok3 = ok3 && mr_run(&d, &gl, 10, &e) == 0;
    int pre = ok3 && bitwise_equal(b.loss, d.loss, 10) && bitwise_equal(b.gnorm, d.gnorm, 10);
    report("2 GPUs: precompiled artifact = in-process compile, bitwise", pre, "%s", ok3 ? "" : e.msg);
    /* tuned once on GPU 1, or on GPU 0: the same bytes; both ranks run the recorded kernels, none chosen at bind */
    {
        mt_graph t0, t1;
        uint8_t *x = NULL, *y = NULL;
        size_t lx = 0, ly = 0;
        int tok = mr_compile_for(&t0, 1, 2, 2, 2, 0, 1, &e) == 0 && mr_compile_for(&t1, 1, 2, 2, 2, 0, 1, &e) == 0 && !mt_tune(&t0, 0, &e) &&
                  !mt_tune(&t1, 1, &e) && !mt_artifact_write(&t0, &x, &lx, &e) && !mt_artifact_write(&t1, &y, &ly, &e);
        int bytes_eq = tok && lx == ly && !memcmp(x, y, lx);
        free(x); free(y);
        mr_job p0, p1;
        memset(&p0, 0, sizeof p0); memset(&p1, 0, sizeof p1);
        p0.fail_rank = p1.fail_rank = -1;
        int run = tok && mr_run(&p0, &t0, 10, &e) == 0 && mr_run(&p1, &t1, 10, &e) == 0;
        int eq = run && bitwise_equal(p0.loss, p1.loss, 10) && bitwise_equal(p0.gnorm, p1.gnorm, 10) && bitwise_equal(p0.loss, b.loss, 10);
        report("2 GPUs: tuned on GPU 1 = tuned on GPU 0 (bytes, losses), = untuned; ranks' kernels identical, none chosen at bind",
               bytes_eq && eq && p0.digest[0] == p0.digest[1] && p1.digest[0] == p0.digest[0] && !p0.chosen[0] && !p0.chosen[1],
               "%zu vs %zu bytes; digests %016llx %016llx; chosen at bind %d %d %s", lx, ly, (unsigned long long)p0.digest[0],
               (unsigned long long)p0.digest[1], p0.chosen[0], p0.chosen[1], run ? "" : e.msg);
        mr_free(&p0); mr_free(&p1);
        if (tok) { mt_graph_free(&t0); mt_graph_free(&t1); }
    }
    if (ok3) mt_graph_free(&gl);
    {   /* overlap (g2: collectives on their own streams, prefetch, EP ahead) vs one stream in list order */
        mt_graph go;
        mr_job o;
        memset(&o, 0, sizeof o);
        o.fail_rank = -1;
        int ok4 = ok && mr_compile_opts(&go, 1, 2, 2, 2, 0, 1, 0, &e) == 0 && mr_run(&o, &go, 10, &e) == 0;
        double wl = ok4 ? max_rel(b.loss, o.loss, 10) : 1, wg = ok4 ? max_rel(b.gnorm, o.gnorm, 10) : 1;
        report("2 GPUs: overlap on vs off within bf16 tolerance", ok4 && wl < 1e-3 && wg < 1e-2, "worst rel loss %.1e, grad norm %.1e "
               "(bitwise: %s) %s", wl, wg, ok4 && bitwise_equal(b.loss, o.loss, 10) ? "yes" : "no", ok4 ? "" : e.msg);
        report("2 GPUs: overlap on, two runs bitwise", same && g2.overlap, "(the rerun above, with the overlap schedule)");
        mr_free(&o);
        if (ok4) mt_graph_free(&go);
    }
    mr_free(&a); mr_free(&b); mr_free(&c); mr_free(&d);
    /* every token to rank 0's experts: rank 1's experts receive nothing */
    memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
    a.fail_rank = b.fail_rank = -1; a.route_to_first = b.route_to_first = 1;
    ok = mr_run(&a, &g1, 2, &e) == 0 && mr_run(&b, &g2, 2, &e) == 0;
    int64_t want = (int64_t)4 * 32 * 2 * (g2.cfg.n_layers - g2.cfg.n_dense_layers);
    report("2 GPUs: every token to one rank's experts, none to the other", ok && b.recv_rows[0] == want && b.recv_rows[1] == 0 &&
           fabs(a.loss[0] - b.loss[0]) < 1e-3 * a.loss[0], "rows %lld / %lld, loss %.5f vs %.5f %s", (long long)b.recv_rows[0],
           (long long)b.recv_rows[1], b.loss[0], a.loss[0], ok ? "" : e.msg);
    mr_free(&a); mr_free(&b);
    mt_graph_free(&g1); mt_graph_free(&g2); mt_graph_free(&gf);
}

/* MoE in 2 chunks of tokens on GPUs (the CUDA ops' row ranges and zero rows, two exchanges a layer in flight): one GPU
 * (compiled, and eager: the exchange as copies) and dp_shard 2 x ep 2 on 2 GPUs, against one chunk on the same mesh within
 * bf16 tolerance (the grouped GEMMs may round another way at another row bound), and two runs bitwise. */
static void gpu_test_moe_chunks(void) {
    mt_err e;
    int ndev = mt_cuda_device_count();
    struct { int shard, ep, eager; } cases[] = {{1, 1, 0}, {1, 1, 1}, {2, 2, 0}};
    for (int i = 0; i < 3; i++) {
        int world = cases[i].shard;
        char nm[160];
        snprintf(nm, sizeof nm, "%d GPU%s (dp_shard %d, ep %d%s): MoE in 2 chunks = 1 chunk (bf16), two runs bitwise", world, world > 1 ? "s" : "",
                 cases[i].shard, cases[i].ep, cases[i].eager ? ", eager" : "");
        if (world > ndev) { printf("SKIP %s: %d GPU visible\n", nm, ndev); continue; }
        mt_graph g1, g2;
        if (mr_compile_for(&g1, 1, cases[i].shard, cases[i].ep, 4 / world, cases[i].eager, 1, &e)) { report(nm, 0, "%s", e.msg); continue; }
        moe_chunks = 2;
        int built = mr_compile_for(&g2, 1, cases[i].shard, cases[i].ep, 4 / world, cases[i].eager, 1, &e) == 0;
        moe_chunks = 1;
        if (!built) { report(nm, 0, "%s", e.msg); mt_graph_free(&g1); continue; }
        mr_job a, b, c;
        memset(&a, 0, sizeof a); memset(&b, 0, sizeof b); memset(&c, 0, sizeof c);
        a.fail_rank = b.fail_rank = c.fail_rank = -1;
        int ok = mr_run(&a, &g1, 10, &e) == 0 && mr_run(&b, &g2, 10, &e) == 0 && mr_run(&c, &g2, 10, &e) == 0;
        double r1 = ok ? fabs(a.loss[0] - b.loss[0]) / a.loss[0] : 1, rn = ok ? max_rel(b.loss, a.loss, 10) : 1;
        int same = ok && bitwise_equal(b.loss, c.loss, 10) && bitwise_equal(b.gnorm, c.gnorm, 10);
        for (int r = 0; ok && r < world; r++) same &= b.param_bytes[r] == c.param_bytes[r] && !memcmp(b.params[r], c.params[r], b.param_bytes[r]);
        report(nm, ok && mt_graph_moe_chunks(&g2) == 2 && r1 < 1e-3 && rn < 2e-2 && same, "step 1 %.1e (bitwise: %s), 10 steps %.1e; reruns %s; "
               "losses %.5f .. %.5f %s", r1, ok && a.loss[0] == b.loss[0] ? "yes" : "no", rn, same ? "bitwise" : "DIFFER", b.loss[0], b.loss[9],
               ok ? "" : e.msg);
        mr_free(&a); mr_free(&b); mr_free(&c);
        mt_graph_free(&g1); mt_graph_free(&g2);
    }
}

/* Tuning and device hoisting on GPUs: a graph tuned once runs with no choice made at bind and the same
 * kernels as choosing would give; the same bytes whichever GPU tuned it; another model re-derives or, strict,
 * refuses; runtimes on GPUs 0 and 1 driven from one thread each run on their own device, bitwise alike. */
static mt_runtime *gpu_runtime_on(const mt_graph *g, int device, int strict, mt_err *e) {
    mt_binding b;
    mt_runtime *rt;
    mt_binding_single(&b);
    b.device = device; b.strict_tuning = strict;
    if (mt_runtime_create(&rt, g, &b, e)) return NULL;
    if (mt_runtime_init_params(rt, 5, e)) { mt_runtime_destroy(rt); return NULL; }
    return rt;
}
static void gpu_test_tuning(void) {
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "debug", &e);
    c.batch = 2; c.seq_len = 256; c.original_seq_len = 256;
    mt_graph gu, gt;
    if (gpu_compile(&gu, &c, 1, 1, &e) || gpu_compile(&gt, &c, 1, 1, &e) || mt_tune(&gt, 0, &e)) { report("gpu tuning", 0, "%s", e.msg); return; }
    enum { S = 3 };
    double lu[S], nu[S], lt[S], nt[S];
    mt_runtime *ru = gpu_runtime_on(&gu, 0, 0, &e), *rt = ru ? gpu_runtime_on(&gt, 0, 0, &e) : NULL;
    int ok = ru && rt && !gpu_steps(ru, &c, S, lu, nu) && !gpu_steps(rt, &c, S, lt, nt);
    int pu = 0, du = 0, pt = 0, dt = 0;
    uint64_t hu = ok ? mt_runtime_kernel_digest(ru, &pu, &du) : 0, ht = ok ? mt_runtime_kernel_digest(rt, &pt, &dt) : 1;
    report("gpu tuning: a tuned graph chooses nothing at bind and runs the kernels choosing would give", ok && gt.n_tuning > 0 && dt == 0 &&
           pt == gt.n_tuning && du == gt.n_tuning && hu == ht && bitwise_equal(lu, lt, S) && bitwise_equal(nu, nt, S) &&
           !mt_runtime_tuning_note(rt)[0] && mt_runtime_tuning_note(ru)[0], "%d choices for %s; preset %d / chosen %d (untuned: %d / %d); digests %s %s",
           gt.n_tuning, gt.tuned_for.device, pt, dt, pu, du, hu == ht ? "equal" : "DIFFER", ok ? "" : e.msg);
    mt_runtime_destroy(ru); mt_runtime_destroy(rt);
    /* another GPU model: re-derived with a note, or refused when strict */
    mt_graph go;
    int rok = gpu_compile(&go, &c, 1, 1, &e) == 0 && mt_tune(&go, 0, &e) == 0;
    if (rok) {
        go.tuned_for.n_sms += 2;
        snprintf(go.tuned_for.device, sizeof go.tuned_for.device, "Another GPU");
        mt_err e2;
        mt_runtime *r1 = gpu_runtime_on(&go, 0, 0, &e), *r2 = gpu_runtime_on(&go, 0, 1, &e2);
        double l1[S], n1[S];
        int ran = r1 && !gpu_steps(r1, &c, S, l1, n1);
        int p1 = 0, d1 = 0;
        uint64_t h1 = r1 ? mt_runtime_kernel_digest(r1, &p1, &d1) : 0;
        report("gpu tuning for another GPU model: re-derived with a note, or refused when strict", ran && !r2 && p1 == 0 && h1 == ht &&
               strstr(mt_runtime_tuning_note(r1), "re-derived") && strstr(e2.msg, "Another GPU") && bitwise_equal(l1, lu, S),
               "note: %.120s | strict: %.120s", r1 ? mt_runtime_tuning_note(r1) : e.msg, r2 ? "accepted" : e2.msg);
        mt_runtime_destroy(r1); mt_runtime_destroy(r2);
        mt_graph_free(&go);
    }
    /* two GPUs: tuned on either, the same bytes; runtimes on 0 and 1 driven alternately from this thread */
    if (mt_cuda_device_count() >= 2) {
        mt_graph g1;
        uint8_t *x = NULL, *y = NULL;
        size_t lx = 0, ly = 0;
        int same = gpu_compile(&g1, &c, 1, 1, &e) == 0 && mt_tune(&g1, 1, &e) == 0 && !mt_artifact_write(&gt, &x, &lx, &e) &&
                   !mt_artifact_write(&g1, &y, &ly, &e) && lx == ly && !memcmp(x, y, lx);
        free(x); free(y);
        report("gpu tuning on GPU 0 and on GPU 1: byte-identical artifacts", same, "%zu bytes %s", lx, same ? "" : e.msg);
        if (same) mt_graph_free(&g1);
        mt_runtime *a = gpu_runtime_on(&gt, 1, 0, &e), *b = a ? gpu_runtime_on(&gt, 0, 0, &e) : NULL;
        double la[S], na[S], lb[S], nb[S];
        int ok2 = a && b;
        for (int s = 0; ok2 && s < S; s++)   /* alternate: each call must make its own device current */
            ok2 = !gpu_steps(a, &c, 1, la + s, na + s) && !gpu_steps(b, &c, 1, lb + s, nb + s);
        ok2 = ok2 && !mt_runtime_check_devices(a, &e) && !mt_runtime_check_devices(b, &e);
        report("gpu devices: runtimes on GPU 1 and GPU 0 from one thread, each on its own device, bitwise alike", ok2 &&
               bitwise_equal(la, lb, S) && bitwise_equal(na, nb, S), "%s", ok2 ? "" : e.msg);
        mt_runtime_destroy(a); mt_runtime_destroy(b);
    } else {
        printf("SKIP two-GPU tuning and device checks: %d GPU visible\n", mt_cuda_device_count());
    }
    mt_graph_free(&gu); mt_graph_free(&gt);
}

/* doc_mask training steps: CUDA against the CPU reference, bitwise rerun */
static void gpu_test_doc_mask_steps(void) {
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "tiny", &e);
    c.doc_mask = 1; c.eot_id = 3;
    mt_graph gc, gg;
    if (gpu_compile(&gc, &c, 0, 1, &e) || gpu_compile(&gg, &c, 1, 1, &e)) { report("gpu doc_mask steps", 0, "%s", e.msg); return; }
    enum { S = 4 };
    double lc[S] = {0}, lg[S] = {0}, lg2[S] = {0};
    mt_runtime *rc = gpu_runtime(&gc, 0), *r1 = gpu_runtime(&gg, 1), *r2 = gpu_runtime(&gg, 0);
    int ok = rc && r1 && r2 && !gpu_steps(rc, &c, S, lc, NULL) && !gpu_steps(r1, &c, S, lg, NULL) && !gpu_steps(r2, &c, S, lg2, NULL);
    double worst = 0;
    for (int s = 0; ok && s < S; s++) if (fabs(lg[s] - lc[s]) / lc[s] > worst) worst = fabs(lg[s] - lc[s]) / lc[s];
    report("gpu doc_mask training steps vs CPU, bitwise rerun", ok && worst < 2e-2 && bitwise_equal(lg, lg2, S),
           "loss %.5f vs %.5f .. %.5f vs %.5f; worst rel %.1e; rerun bitwise %s", lg[0], lc[0], lg[S - 1], lc[S - 1], worst,
           bitwise_equal(lg, lg2, S) ? "yes" : "NO");
    mt_runtime_destroy(rc); mt_runtime_destroy(r1); mt_runtime_destroy(r2);
    mt_graph_free(&gc); mt_graph_free(&gg);
}

/* Exact resume on the GPU: 20 steps = 10 + save + load + 10, bitwise (losses, grad norms, weights, bf16 copies, moments). */
static int gpu_steps_from(mt_runtime *rt, const mt_config *c, int step0, int n, const mt_hparams *hp, double *loss, double *gnorm) {
    int64_t N = (int64_t)c->batch * c->seq_len;
    int32_t *tok = (int32_t *)malloc(4 * (size_t)N), *tgt = (int32_t *)malloc(4 * (size_t)N);
    mt_err e;
    int rc = 0;
    for (int s = step0; s < step0 + n && !rc; s++) {
        mt_rng r;
        mt_rng_seed(&r, 177 + (uint64_t)s);
        for (int64_t i = 0; i < N; i++) { tok[i] = (int32_t)(mt_rng_u64(&r) % (uint64_t)c->vocab_size); tgt[i] = (tok[i] * 5 + 1) % c->vocab_size; }
        mt_step_stats st;
        if (mt_runtime_step(rt, tok, tgt, s, hp, &st, &e)) { printf("  step: %s\n", e.msg); rc = -1; break; }
        loss[s - step0] = st.loss;
        gnorm[s - step0] = st.grad_norm;
    }
    free(tok); free(tgt);
    return rc;
}
static void gpu_test_resume(int moments) {
    mt_config c;
    mt_err e;
    mt_graph g;
    char name[96];
    snprintf(name, sizeof name, "gpu exact resume: 20 steps = 10 + save + load + 10%s", moments == MT_BF16 ? ", bf16 moments" : "");
    mt_config_preset(&c, "tiny", &e);
    if (gpu_compile(&g, &c, 1, moments == MT_BF16 ? 5 : 1, &e)) { report(name, 0, "%s", e.msg); return; }
    mt_hparams hp;
    mt_hparams_default(&hp);
    hp.warmup_steps = 4; hp.decay_steps = 20;
    enum { S = 20, H = 10 };
    double la[S], na[S], lb[S], nb[S], lc[S], nc[S];
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/mt_gpu_resume_%ld", (long)getpid());
    mt_runtime *a = gpu_runtime(&g, 0), *b = gpu_runtime(&g, 0), *r = gpu_runtime(&g, 1);
    mt_run_state rs, back;
    mt_run_state_init(&rs);
    rs.step = H; rs.total_steps = S; rs.seed = 5; rs.hp = hp;
    int step = -1;
    int ok = a && b && r && !gpu_steps_from(a, &c, 0, S, &hp, la, na) && !gpu_steps_from(b, &c, 0, H, &hp, lb, nb) &&
             !mt_runtime_init_params(r, 999, &e) && !mt_checkpoint_save_run(b, dir, &rs, &e) && !mt_checkpoint_read_run(dir, &back, &e) &&
             !mt_checkpoint_load(r, dir, &step, &e) && step == H && !gpu_steps_from(r, &c, back.step, S - H, &back.hp, lc + H, nc + H);
    memcpy(lc, lb, sizeof(double) * H); memcpy(nc, nb, sizeof(double) * H);
    int same = ok && bitwise_equal(la, lc, S) && bitwise_equal(na, nc, S);
    for (int i = 0; same && i < g.n_values; i++) {
        const mt_value *v = &g.values[i];
        if (v->role != MT_ROLE_PARAM && v->role != MT_ROLE_OPT) continue;
        void *x = malloc((size_t)v->nbytes), *y = malloc((size_t)v->nbytes);
        same = !mt_runtime_read(a, i, x, &e) && !mt_runtime_read(r, i, y, &e) && !memcmp(x, y, (size_t)v->nbytes);
        free(x); free(y);
    }
    report(name, same && back.moments == moments, "losses, grad norms, weights (f32 and bf16), moments bitwise%s%s",
           ok ? "" : ": ", ok ? "" : e.msg);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) printf("  could not remove %s\n", dir);
    mt_runtime_destroy(a); mt_runtime_destroy(b); mt_runtime_destroy(r);
    mt_graph_free(&g);
}

/* ---- FP8 (e4m3) kernels: moetrain_kernels.cu section 11, against a CPU reference in float64 ------------ */
/* (the grouped GEMM with its persistent grid given: the tests' few-CTA runs; not in the header) */
int mt_cuda_fp8_gmm_ctas(mt_cuda *c, int mode, void *out, const uint8_t *a, const float *sa, const uint8_t *b, const float *sb,
                         const int32_t *d_offs, int E, int M, int K, int Rmax, long long Lp, int variant, int ctas);

/* e4m3 ("fn": bias 7, 3 mantissa bits, max 448, no infinities, S.1111.111 NaN): v rounded to nearest even,
   saturated at +-448 */
static uint8_t fp8_enc(double v) {
    const uint8_t sg = signbit(v) ? 0x80 : 0;
    double a = fabs(v);
    if (a != a) return (uint8_t)(sg | 0x7f);
    if (a >= 448) return (uint8_t)(sg | 0x7e);
    int e;
    frexp(a, &e);                  /* a in [2^(e-1), 2^e) */
    int E = e - 1 < -6 ? -6 : e - 1;
    const double qn = ldexp(1.0, E - 3);
    const double r = nearbyint(a / qn) * qn;   /* a / qn exact; nearest even */
    if (r == 0) return sg;
    frexp(r, &e);
    E = e - 1;
    if (E < -6) return (uint8_t)(sg | (int)(r / ldexp(1.0, -9)));               /* subnormal: m 2^-9 */
    return (uint8_t)(sg | ((E + 7) << 3) | (int)((r / ldexp(1.0, E) - 1) * 8));
}
static double fp8_val(uint8_t b) {
    const int ex = (b >> 3) & 15, m = b & 7;
    const double s = (b & 0x80) ? -1 : 1;
    if (ex == 15 && m == 7) return NAN;
    return ex == 0 ? s * m * ldexp(1.0, -9) : s * (1 + m / 8.0) * ldexp(1.0, ex - 7);
}
/* a block's scale and codes as the kernels define them: s = fp32(amax / 448), q = e4m3(fp32(x / s)), s = 0 -> codes 0 */
static float fp8_scale(float amax) { volatile float a = amax; return a / 448.0f; }
static uint8_t fp8_code(float x, float s) { volatile float q = x / s; return s > 0 ? fp8_enc((double)q) : 0; }

/* fp8_within: every element of the reference quantizations since the last call within the e4m3 rounding bound
   |q s - x| <= max(2^-4 |x|, 2^-10 s) (half an ulp of 3 mantissa bits; subnormal codes 2^-9 s apart), with 1e-6 |x| for
   the fp32 quotient's rounding; worst: the largest |q s - x| / |x| of normal codes */
static int fp8_nbad;
static double fp8_worst;
static double fp8_deq(uint8_t q, float x, float s) {
    const double d = fp8_val(q) * s, err = fabs(d - x);
    if (!(err <= fmax(fabs(x) / 16, ldexp(s, -10)) + 1e-6 * fabs(x))) fp8_nbad++;
    if (x != 0 && fabs(x) >= ldexp(s, -6) && err / fabs(x) > fp8_worst) fp8_worst = err / fabs(x);
    return d;
}
static int fp8_within(double *worst) {
    const int ok = fp8_nbad == 0;
    *worst = fp8_worst;
    fp8_nbad = 0; fp8_worst = 0;
    return ok;
}
/* rows: x [R][C] -> q [R][C], s[kb R + r]; dq: q s (doubles) */
static void fp8_ref_rows(uint8_t *q, float *s, double *dq, const float *x, int R, int C) {
    for (int r = 0; r < R; r++)
        for (int kb = 0; kb * 128 < C; kb++) {
            float m = 0;
            for (int c = kb * 128; c < C && c < kb * 128 + 128; c++) m = fabsf(x[(size_t)r * C + c]) > m ? fabsf(x[(size_t)r * C + c]) : m;
            const float sc = fp8_scale(m);
            s[(size_t)kb * R + r] = sc;
            for (int c = kb * 128; c < C && c < kb * 128 + 128; c++) {
                q[(size_t)r * C + c] = fp8_code(x[(size_t)r * C + c], sc);
                dq[(size_t)r * C + c] = fp8_deq(q[(size_t)r * C + c], x[(size_t)r * C + c], sc);
            }
        }
}
/* cols: x [R][C], rows grouped by offs -> qt [C][Lp], st[(p / 128) C + c]; dq [R][C] in x's coordinates */
static void fp8_ref_cols(uint8_t *qt, float *st, double *dq, const float *x, const int32_t *offs, int E, int C, long long Lp) {
    long long pe = 0;
    for (int e = 0; e < E; e++) {
        const int b = offs[e], n = offs[e + 1] - offs[e];
        for (int j = 0; j * 128 < n; j++)
            for (int c = 0; c < C; c++) {
                float m = 0;
                for (int i = j * 128; i < n && i < j * 128 + 128; i++) m = fabsf(x[(size_t)(b + i) * C + c]) > m ? fabsf(x[(size_t)(b + i) * C + c]) : m;
                const float sc = fp8_scale(m);
                st[(size_t)((pe + 128 * j) / 128) * C + c] = sc;
                for (int i = j * 128; i < j * 128 + 128; i++) {
                    const uint8_t v = i < n ? fp8_code(x[(size_t)(b + i) * C + c], sc) : 0;
                    qt[(size_t)c * Lp + pe + i] = v;
                    if (i < n) dq[(size_t)(b + i) * C + c] = fp8_deq(v, x[(size_t)(b + i) * C + c], sc);
                }
            }
        pe += 128LL * ((n + 127) / 128);
    }
}
/* weight: w [E][N][K] -> q [E][N][K] (or [E][K][N] transposed) and 128 x 128 block scales with rows of roundup(blocks, 4) */
static int fp8_ld(int n) { return ((n + 127) / 128 + 3) & ~3; }
static void fp8_ref_weight(uint8_t *q, float *s, double *dq, const float *w, int E, int N, int K, int tr) {
    const int nbN = (N + 127) / 128, nbK = (K + 127) / 128;
    for (int e = 0; e < E; e++)
        for (int nb = 0; nb < nbN; nb++)
            for (int kb = 0; kb < nbK; kb++) {
                float m = 0;
                for (int n = nb * 128; n < N && n < nb * 128 + 128; n++)
                    for (int k = kb * 128; k < K && k < kb * 128 + 128; k++) {
                        const float a = fabsf(w[((size_t)e * N + n) * K + k]);
                        m = a > m ? a : m;
                    }
                const float sc = fp8_scale(m);
                if (!tr) s[((size_t)e * nbN + nb) * fp8_ld(K) + kb] = sc;
                else s[((size_t)e * nbK + kb) * fp8_ld(N) + nb] = sc;
                for (int n = nb * 128; n < N && n < nb * 128 + 128; n++)
                    for (int k = kb * 128; k < K && k < kb * 128 + 128; k++) {
                        const size_t i = ((size_t)e * N + n) * K + k;
                        const uint8_t v = fp8_code(w[i], sc);
                        q[tr ? ((size_t)e * K + k) * N + n : i] = v;
                        dq[i] = fp8_deq(v, w[i], sc);
                    }
            }
}
/* test data with outliers: normal(sd), columns (cols = 1) or rows with index % 41 == 3 times 100, and one 128-block
   of every row / column set to exact zeros when there are two or more (amax = 0) */
static float *fp8_data(int R, int C, double sd, int cols) {
    float *x = randn((int64_t)R * C, sd);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float *v = &x[(size_t)r * C + c];
            if ((cols ? c : r) % 41 == 3) *v *= 100;
            if ((cols ? r : c) >= 128 && (cols ? r : c) < 256 && (cols ? R : C) > 256) *v = 0;
        }
    round_bf(x, (int64_t)R * C);
    return x;
}
/* max over elements of |a - ref| / (2^-8 |ref| + tol * sum_abs): the GEMM's arithmetic against the exact product of
   the dequantized operands (fp32 accumulation, one bf16 rounding); <= 1 passes */
static double fp8_gemm_ratio(const float *a, const double *ref, const double *sabs, int64_t n, double tol) {
    double w = 0;
    for (int64_t i = 0; i < n; i++) {
        const double r = fabs(a[i] - ref[i]) / (ldexp(fabs(ref[i]), -8) + tol * sabs[i] + 1e-30);
        if (!(r <= w)) w = r != r ? INFINITY : r;
    }
    return w;
}
static float *down_f(const void *d, int64_t n, int is_bf) {
    if (is_bf) return down_bf(d, n);
    return (float *)down(d, 4 * (size_t)n);
}

/* rows of 128 bf16 values whose quotients fp32(x / s) fall on or next to an e4m3 rounding midpoint (within 12 steps
   of its fp32 bit pattern): each row's amax first, then such x of both signs, -0, and values drawn below the amax.
   *naive counts the x whose product fp32(x * fp32(1 / s)) has another code than the quotient: a quantizer that
   multiplied by the reciprocal without correcting would get those wrong. */
static float *fp8_midpoint_rows(int rows, long *naive) {
    float *x = (float *)malloc(sizeof(float) * 128 * (size_t)rows);
    *naive = 0;
    for (int r = 0; r < rows; r++) {
        float *row = x + (size_t)r * 128;
        const float amax = bf2f((uint16_t)((107 + mt_rng_u64(&R) % 40) << 7 | (mt_rng_u64(&R) & 127)));
        const float s = fp8_scale(amax);
        volatile float rc = 1.0f / s;
        int n = 0;
        row[n++] = r & 1 ? -amax : amax;
        for (int c = 0; c < 0x7e && n < 126; c++) {
            const float m = (float)((fp8_val((uint8_t)c) + fp8_val((uint8_t)(c + 1))) / 2), t = m * s;
            uint32_t um, ut;
            memcpy(&um, &m, 4); memcpy(&ut, &t, 4);
            for (int d = -1; d <= 2 && n < 126; d++) {
                const float v = bf2f((uint16_t)((ut >> 16) + d));
                if (!(v > 0) || v > amax) continue;
                volatile float q = v / s, y = v * rc;
                const float qq = q;
                uint32_t uq;
                memcpy(&uq, &qq, 4);
                if (uq + 12 < um || uq > um + 12) continue;
                row[n] = n & 1 ? -v : v;
                n++;
                *naive += fp8_enc((double)q) != fp8_enc((double)y);
            }
        }
        row[n++] = -0.0f;
        while (n < 128) row[n++] = bf2f(f2bf((float)(amax * (2 * mt_rng_uniform(&R) - 1))));
    }
    return x;
}
/* cols and rows from one read (mt_cuda_fp8_quant_both): the columns bitwise quant_cols' (the CPU's), the rows of every
   chunk bitwise quant_rows' (the CPU's) at Rq > R rows, the rows past the groups untouched. Expert layouts as the
   column test's (5 experts, one empty; 70, every fifth empty) and one group (offsets NULL); ragged column blocks */
static void gpu_test_fp8_quant_both(void) {
    for (int t = 0; t < 3; t++) {
        static const int cnt5[5] = {0, 17, 300, 128, 1};
        const int E = t == 1 ? 70 : t == 0 ? 5 : 1, C = t == 1 ? 48 : t == 0 ? 272 : 160, nkb = (C + 127) / 128;
        int32_t offs[71] = {0};
        long long used = 0;
        for (int e = 0; e < E; e++) {
            const int n = t == 1 ? (e % 5 == 2 ? 0 : (e * 37 + 11) % 300) : t == 0 ? cnt5[e] : 300;
            offs[e + 1] = offs[e] + n;
            used += 128LL * ((n + 127) / 128);
        }
        const int R = offs[E], Rq = R + 14;
        const long long Lp = mt_cuda_fp8_tpad(R, E);
        float *x = fp8_data(R, C, 1, t);
        for (int c = 0; c < 8; c++) x[(size_t)(R - 1) * C + c] = 0;
        uint8_t *qt = (uint8_t *)calloc((size_t)C * Lp, 1), *q = (uint8_t *)malloc((size_t)R * C);
        float *st = (float *)calloc((size_t)(Lp / 128) * C, 4), *s = (float *)malloc(4 * (size_t)R * nkb);
        double *dq = (double *)malloc(8 * (size_t)R * C);
        fp8_ref_cols(qt, st, dq, x, offs, E, C, Lp);
        fp8_ref_rows(q, s, dq, x, R, C);
        void *dx = dalloc(2 * (size_t)Rq * C), *tx = up_bf(x, (int64_t)R * C), *doffs = up(offs, 4 * (E + 1));
        mt_cuda_copy(CU, dx, tx, 2 * (size_t)R * C, 2);
        void *dqt = dalloc((size_t)C * Lp), *dst = dalloc(4 * (size_t)(Lp / 128) * C), *dq8 = dalloc((size_t)Rq * C), *ds = dalloc(4 * (size_t)Rq * nkb);
        int ok = !mt_cuda_fp8_quant_both(CU, (uint8_t *)dq8, (float *)ds, Rq, (uint8_t *)dqt, (float *)dst, dx, t == 2 ? NULL : (const int32_t *)doffs,
                                         E, R, C, Lp);
        uint8_t *gqt = (uint8_t *)down(dqt, (size_t)C * Lp), *gq = (uint8_t *)down(dq8, (size_t)Rq * C);
        float *gst = (float *)down(dst, 4 * (size_t)(Lp / 128) * C), *gs = (float *)down(ds, 4 * (size_t)Rq * nkb);
        int okc = ok, okr = ok, untouched = 1;
        for (int c = 0; c < C; c++) okc &= !memcmp(gqt + (size_t)c * Lp, qt + (size_t)c * Lp, (size_t)used);
        okc &= !memcmp(gst, st, 4 * (size_t)(used / 128) * C);
        okr &= !memcmp(gq, q, (size_t)R * C);
        for (int kb = 0; kb < nkb; kb++) {
            okr &= !memcmp(gs + (size_t)kb * Rq, s + (size_t)kb * R, 4 * (size_t)R);
            for (int r = R; r < Rq; r++) untouched &= ((const uint32_t *)gs)[(size_t)kb * Rq + r] == 0xffffffffu;
        }
        for (size_t i = (size_t)R * C; i < (size_t)Rq * C; i++) untouched &= gq[i] == 0xff;
        char nm[96];
        snprintf(nm, sizeof nm, "gpu fp8 quantize rows and token blocks in one read, %s", t == 2 ? "one group" : t ? "70 experts" : "5 experts");
        report(nm, okc && okr && untouched && fp8_within(&(double){0}), "%d x %d: cols %s, rows %s (scales over %d rows), rows past the groups %s", R, C,
               okc ? "bitwise = CPU" : "DIFFER", okr ? "bitwise = CPU" : "DIFFER", Rq, untouched ? "untouched" : "WRITTEN");
        free(gqt); free(gq); free(gst); free(gs); free(qt); free(q); free(st); free(s); free(dq); free(x);
        dfree(dx); dfree(tx); dfree(doffs); dfree(dqt); dfree(dst); dfree(dq8); dfree(ds);
    }
}
/* the forms a SwiGLU writes in place of its output (mt_cuda_fp8_quant_swiglu): forward h and backward dgate, dup, bitwise
   mt_cuda_swiglu_forward / _backward's bf16 output quantized by quant_both; the same expert layouts and one group.
   Gates of -80 (up 1) give values below 2^-100, which the quantizer codes by the exact division; outlier rows 100x. */
static void gpu_test_fp8_quant_swiglu(void) {
    for (int t = 0; t < 3; t++) {
        static const int cnt5[5] = {0, 17, 300, 128, 1};
        const int E = t == 1 ? 70 : t == 0 ? 5 : 1, C = t == 1 ? 48 : t == 0 ? 272 : 160, nkb = (C + 127) / 128;
        int32_t offs[71] = {0};
        for (int e = 0; e < E; e++) offs[e + 1] = offs[e] + (t == 1 ? (e % 5 == 2 ? 0 : (e * 37 + 11) % 300) : t == 0 ? cnt5[e] : 300);
        const int R = offs[E], Rq = t == 2 ? R : R + 14;
        const long long Lp = mt_cuda_fp8_tpad(R, E);
        const int64_t n = (int64_t)R * C;
        float *g = fp8_data(R, C, 2, t), *u = fp8_data(R, C, 1, 0), *d = fp8_data(R, C, 1, 1);
        for (int64_t i = 5; i < n; i += 97) { g[i] = -80; u[i] = 1; d[i] = 1; }
        void *dg = up_bf(g, n), *du = up_bf(u, n), *dd = up_bf(d, n), *doffs = up(offs, 4 * (E + 1));
        const int32_t *o = t == 2 ? NULL : (const int32_t *)doffs;
        const size_t bq = (size_t)Rq * C, bs = 4 * (size_t)Rq * nkb, bqt = (size_t)C * Lp, bst = 4 * (size_t)(Lp / 128) * C;
        void *x[3], *q[2][3], *sc[2][3], *qt[2][3], *st[2][3];   /* [reference, fused][h, dgate, dup] */
        for (int k = 0; k < 3; k++) x[k] = dalloc(2 * (size_t)n);
        for (int f = 0; f < 2; f++)
            for (int k = 0; k < 3; k++) { q[f][k] = dalloc(bq); sc[f][k] = dalloc(bs); qt[f][k] = dalloc(bqt); st[f][k] = dalloc(bst); }
        int ok = !mt_cuda_swiglu_forward(CU, x[0], dg, du, n, NULL, C) && !mt_cuda_swiglu_backward(CU, x[1], x[2], dg, du, dd, n, NULL, C);
        for (int k = 0; ok && k < 3; k++)
            ok = !mt_cuda_fp8_quant_both(CU, (uint8_t *)q[0][k], (float *)sc[0][k], Rq, (uint8_t *)qt[0][k], (float *)st[0][k], x[k], o, E, R, C, Lp);
        ok = ok && !mt_cuda_fp8_quant_swiglu(CU, (uint8_t *)q[1][0], (float *)sc[1][0], (uint8_t *)qt[1][0], (float *)st[1][0], NULL, NULL, NULL, NULL,
                                             dg, du, NULL, o, E, R, C, Lp, Rq) &&
             !mt_cuda_fp8_quant_swiglu(CU, (uint8_t *)q[1][1], (float *)sc[1][1], (uint8_t *)qt[1][1], (float *)st[1][1], (uint8_t *)q[1][2],
                                       (float *)sc[1][2], (uint8_t *)qt[1][2], (float *)st[1][2], dg, du, dd, o, E, R, C, Lp, Rq);
        int same[3] = {ok, ok, ok}, odd = 0;
        for (int k = 0; ok && k < 3; k++) {
            void *a[4] = {down(q[0][k], bq), down(sc[0][k], bs), down(qt[0][k], bqt), down(st[0][k], bst)};
            void *b[4] = {down(q[1][k], bq), down(sc[1][k], bs), down(qt[1][k], bqt), down(st[1][k], bst)};
            const size_t sz[4] = {bq, bs, bqt, bst};
            for (int j = 0; j < 4; j++) same[k] &= !memcmp(a[j], b[j], sz[j]);
            uint16_t *h = (uint16_t *)down(x[k], 2 * (size_t)n);
            for (int64_t i = 0; i < n; i++) odd += (h[i] & 0x7fff) > 0 && (h[i] & 0x7fff) < 0x0d80;
            free(h);
            for (int j = 0; j < 4; j++) { free(a[j]); free(b[j]); }
        }
        char nm[96];
        snprintf(nm, sizeof nm, "gpu fp8 forms from the SwiGLU and its backward, %s", t == 2 ? "one group" : t ? "70 experts" : "5 experts");
        report(nm, ok && same[0] && same[1] && same[2] && odd > 0, "%d x %d: h %s, dgate %s, dup %s (against the bf16 kernels, then quant_both); "
               "%d values below 2^-100", R, C, same[0] ? "bitwise" : "DIFFER", same[1] ? "bitwise" : "DIFFER", same[2] ? "bitwise" : "DIFFER", odd);
        for (int k = 0; k < 3; k++) dfree(x[k]);
        for (int f = 0; f < 2; f++)
            for (int k = 0; k < 3; k++) { dfree(q[f][k]); dfree(sc[f][k]); dfree(qt[f][k]); dfree(st[f][k]); }
        dfree(dg); dfree(du); dfree(dd); dfree(doffs);
        free(g); free(u); free(d);
    }
}
/* the forms the MoE permutation and the combine's backward write in place of their routed rows (mt_cuda_moe_permute_fp8,
   mt_cuda_moe_combine_backward_fp8): bitwise the plain kernels' xs / dys quantized by quant_both, and the same slot,
   offsets and router-weight gradient. N tokens, top-k K, E experts (expert 3 empty, one expert past 128 rows), C columns
   with a ragged last block; weights in (0, 1] that round the products; rows past the groups untouched. */
static void gpu_test_fp8_moe_forms(void) {
    for (int t = 0; t < 2; t++) {
        const int N = t ? 300 : 77, K = t ? 6 : 2, E = t ? 8 : 5, C = t ? 272 : 160, nkb = (C + 127) / 128;
        const int NK = N * K, Rq = NK + 9;
        const long long Lp = mt_cuda_fp8_tpad(NK, E);
        int32_t *idx = (int32_t *)malloc(4 * (size_t)NK);
        float *w = (float *)malloc(4 * (size_t)NK);
        for (int i = 0; i < NK; i++) {
            int e = (i / K * 7 + i % K * 13 + (i % 5 == 0 ? 0 : 1)) % E;
            idx[i] = e == 3 ? (i % 2 ? 1 : 0) : e;
            w[i] = (float)((i * 37 % 101) + 1) / 101.0f;
        }
        float *x = fp8_data(N, C, 1, t), *dy = fp8_data(N, C, 2, !t), *ys = fp8_data(NK, C, 1, 0);
        void *dx = up_bf(x, (int64_t)N * C), *ddy = up_bf(dy, (int64_t)N * C), *dys_in = up_bf(ys, (int64_t)NK * C);
        void *didx = up(idx, 4 * (size_t)NK), *dw = up(w, 4 * (size_t)NK);
        void *ws = dalloc(mt_cuda_moe_permute_workspace(NK)), *map = dalloc(4 * (size_t)NK);
        const size_t bq = (size_t)Rq * C, bs = 4 * (size_t)Rq * nkb, bqt = (size_t)C * Lp, bst = 4 * (size_t)(Lp / 128) * C;
        void *xs = dalloc(2 * (size_t)NK * C), *dxs = dalloc(2 * (size_t)NK * C), *slot[2], *offs[2], *gw[2], *q[2][2], *sc[2][2], *qt[2][2], *st[2][2];
        for (int f = 0; f < 2; f++) {
            slot[f] = dalloc(4 * (size_t)NK); offs[f] = dalloc(4 * (size_t)(E + 1)); gw[f] = dalloc(4 * (size_t)NK);
            for (int k = 0; k < 2; k++) { q[f][k] = dalloc(bq); sc[f][k] = dalloc(bs); qt[f][k] = dalloc(bqt); st[f][k] = dalloc(bst); }
        }
        /* [0]: the plain kernels then quant_both; [1]: fused. k = 0 the permutation's xs, k = 1 the combine backward's dys */
        int ok = !mt_cuda_moe_permute(CU, xs, (int32_t *)slot[0], (int32_t *)offs[0], dx, (const int32_t *)didx, N, C, K, E, ws) &&
                 !mt_cuda_fp8_quant_both(CU, (uint8_t *)q[0][0], (float *)sc[0][0], Rq, (uint8_t *)qt[0][0], (float *)st[0][0], xs,
                                         (const int32_t *)offs[0], E, NK, C, Lp) &&
                 !mt_cuda_moe_combine_backward(CU, dxs, (float *)gw[0], ddy, dys_in, (const int32_t *)slot[0], (const float *)dw, N, C, K) &&
                 !mt_cuda_fp8_quant_both(CU, (uint8_t *)q[0][1], (float *)sc[0][1], Rq, (uint8_t *)qt[0][1], (float *)st[0][1], dxs,
                                         (const int32_t *)offs[0], E, NK, C, Lp) &&
                 !mt_cuda_moe_permute_fp8(CU, (int32_t *)slot[1], (int32_t *)offs[1], dx, (const int32_t *)didx, N, C, K, E, ws,
                                          (uint8_t *)q[1][0], (float *)sc[1][0], Rq, (uint8_t *)qt[1][0], (float *)st[1][0], Lp) &&
                 !mt_cuda_moe_combine_backward_fp8(CU, (float *)gw[1], ddy, dys_in, (const int32_t *)slot[1], (const float *)dw, N, C, K,
                                                   (int32_t *)map, (uint8_t *)q[1][1], (float *)sc[1][1], Rq, (uint8_t *)qt[1][1],
                                                   (float *)st[1][1], (const int32_t *)offs[1], E, Lp);
        int same[2] = {ok, ok}, meta = ok, untouched = ok;
        const size_t sz[4] = {bq, bs, bqt, bst};
        for (int k = 0; ok && k < 2; k++) {
            void *a[4] = {down(q[0][k], bq), down(sc[0][k], bs), down(qt[0][k], bqt), down(st[0][k], bst)};
            void *b[4] = {down(q[1][k], bq), down(sc[1][k], bs), down(qt[1][k], bqt), down(st[1][k], bst)};
            for (int j = 0; j < 4; j++) same[k] &= !memcmp(a[j], b[j], sz[j]);
            for (size_t i = (size_t)NK * C; i < bq; i++) untouched &= ((uint8_t *)b[0])[i] == 0xff;
            for (int j = 0; j < 4; j++) { free(a[j]); free(b[j]); }
        }
        const size_t mb[3] = {4 * (size_t)NK, 4 * (size_t)(E + 1), 4 * (size_t)NK};
        void *const *mv[3] = {slot, offs, gw};
        for (int j = 0; ok && j < 3; j++) {
            void *a = down(mv[j][0], mb[j]), *b = down(mv[j][1], mb[j]);
            meta &= !memcmp(a, b, mb[j]);
            free(a); free(b);
        }
        char nm[96];
        snprintf(nm, sizeof nm, "gpu fp8 forms from the MoE permutation and the combine's backward, %d x top-%d", N, K);
        report(nm, ok && same[0] && same[1] && meta && untouched, "%d routed rows x %d: xs %s, dys %s (against the plain kernels, then quant_both); "
               "slot, offsets, dw %s; rows past the groups %s", NK, C, same[0] ? "bitwise" : "DIFFER", same[1] ? "bitwise" : "DIFFER",
               meta ? "bitwise" : "DIFFER", untouched ? "untouched" : "WRITTEN");
        for (int f = 0; f < 2; f++) {
            dfree(slot[f]); dfree(offs[f]); dfree(gw[f]);
            for (int k = 0; k < 2; k++) { dfree(q[f][k]); dfree(sc[f][k]); dfree(qt[f][k]); dfree(st[f][k]); }
        }
        dfree(xs); dfree(dxs); dfree(dx); dfree(ddy); dfree(dys_in); dfree(didx); dfree(dw); dfree(ws); dfree(map);
        free(idx); free(w); free(x); free(dy); free(ys);
    }
}
static void gpu_test_fp8_quant(void) {
    /* rows: 37 x 320 (a half-wide last block), outlier columns, zero blocks; then 129 x 16 */
    int ok = 1;
    double worst = 0, w1;
    for (int t = 0; t < 2; t++) {
        const int Rr = t ? 129 : 37, C = t ? 16 : 320, nkb = (C + 127) / 128;
        float *x = fp8_data(Rr, C, 1, 1);
        if (!t) {
            for (int c = 0; c < C; c++) x[5 * C + c] = (float)ldexp((double)x[5 * C + c], -120);   /* tiny row: subnormal scale */
            for (int c = 128; c < 256; c++) x[7 * C + c] = 0;                                       /* a zero block: s = 0 */
        }
        round_bf(x, (int64_t)Rr * C);
        uint8_t *q = (uint8_t *)malloc((size_t)Rr * C);
        float *s = (float *)malloc(4 * (size_t)Rr * nkb);
        double *dq = (double *)malloc(8 * (size_t)Rr * C);
        fp8_ref_rows(q, s, dq, x, Rr, C);
        void *dx = up_bf(x, (int64_t)Rr * C), *dqq = dalloc((size_t)Rr * C), *ds = dalloc(4 * (size_t)Rr * nkb);
        ok &= !mt_cuda_fp8_quant_rows(CU, (uint8_t *)dqq, (float *)ds, dx, Rr, C);
        uint8_t *gq = (uint8_t *)down(dqq, (size_t)Rr * C);
        float *gs = (float *)down(ds, 4 * (size_t)Rr * nkb);
        ok &= !memcmp(gq, q, (size_t)Rr * C) && !memcmp(gs, s, 4 * (size_t)Rr * nkb);
        ok &= fp8_within(&w1);
        if (w1 > worst) worst = w1;
        free(gq); free(gs); free(q); free(s); free(dq); free(x);
        dfree(dx); dfree(dqq); dfree(ds);
    }
    report("gpu fp8 quantize 1x128 rows", ok, "codes and scales bitwise = CPU; worst |dq - x| / |x| %.4f (bound 1/16 normal codes)", worst);

    /* quotients on and next to the rounding midpoints of e4m3, through each quantizer: rows (256 x 128), cols (the
       transpose, one segment of 128 tokens), weight (128 x 128 blocks, each a midpoint row over 127 small rows) */
    {
        const int nr = 256, nb = 64;
        long naive;
        float *x = fp8_midpoint_rows(nr, &naive);
        uint8_t *q = (uint8_t *)malloc((size_t)nr * 128 * 128), *gq;
        float *s = (float *)malloc(4 * (size_t)nr * 128), *gs;
        double *dq = (double *)malloc(8 * (size_t)nr * 128 * 128);
        int okr, okc = 1, okw;
        void *dx = up_bf(x, (int64_t)nr * 128), *d8 = dalloc((size_t)nr * 256), *ds = dalloc(4 * (size_t)nr * 2);
        fp8_ref_rows(q, s, dq, x, nr, 128);
        okr = !mt_cuda_fp8_quant_rows(CU, (uint8_t *)d8, (float *)ds, dx, nr, 128);
        gq = (uint8_t *)down(d8, (size_t)nr * 128); gs = (float *)down(ds, 4 * (size_t)nr);
        okr &= !memcmp(gq, q, (size_t)nr * 128) && !memcmp(gs, s, 4 * (size_t)nr);
        free(gq); free(gs); dfree(dx);
        float *xt = (float *)malloc(sizeof(float) * (size_t)nr * 128);   /* [128 tokens][nr columns] */
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < 128; c++) xt[(size_t)c * nr + r] = x[(size_t)r * 128 + c];
        const int32_t offs[2] = {0, 128};
        const long long Lp = mt_cuda_fp8_tpad(128, 1);
        fp8_ref_cols(q, s, dq, xt, offs, 1, nr, Lp);
        dx = up_bf(xt, (int64_t)nr * 128);
        okc = !mt_cuda_fp8_quant_cols(CU, (uint8_t *)d8, (float *)ds, dx, NULL, 1, 128, nr, Lp);
        gq = (uint8_t *)down(d8, (size_t)nr * Lp); gs = (float *)down(ds, 4 * (size_t)nr);
        for (int c = 0; c < nr; c++) okc &= !memcmp(gq + (size_t)c * Lp, q + (size_t)c * Lp, 128);
        okc &= !memcmp(gs, s, 4 * (size_t)nr);
        free(gq); free(gs); dfree(dx); dfree(d8); dfree(ds);
        float *w = (float *)malloc(sizeof(float) * 128 * 128 * (size_t)nb);   /* [128][nb * 128]: block b's row 0 is midpoint row b */
        for (int n = 0; n < 128; n++)
            for (int k = 0; k < nb * 128; k++)
                w[(size_t)n * nb * 128 + k] = n ? bf2f(f2bf(x[(size_t)(k / 128) * 128 + (k * 7 + n) % 128] / 4)) : x[(size_t)(k / 128) * 128 + k % 128];
        const size_t nq = (size_t)128 * 128 * nb, ns = (size_t)fp8_ld(nb * 128);
        okw = 1;
        for (int tr = 0; tr < 2; tr++) {
            const size_t nsc = tr ? (size_t)nb * fp8_ld(128) : ns;
            memset(s, 0, 4 * nsc);   /* the scale rows' padding: 0 */
            fp8_ref_weight(q, s, dq, w, 1, 128, nb * 128, tr);
            dx = up_bf(w, (int64_t)nq); d8 = dalloc(nq); ds = dalloc(4 * nsc);
            okw &= !mt_cuda_fp8_quant_weight(CU, (uint8_t *)d8, (float *)ds, dx, 1, 128, nb * 128, tr);
            gq = (uint8_t *)down(d8, nq); gs = (float *)down(ds, 4 * nsc);
            okw &= !memcmp(gq, q, nq) && !memcmp(gs, s, 4 * nsc);
            free(gq); free(gs); dfree(dx); dfree(d8); dfree(ds);
        }
        report("gpu fp8 quantizers at e4m3's rounding midpoints", okr && okc && okw && naive > 0 && fp8_within(&w1),
               "%d rows of quotients within 12 fp32 steps of a midpoint (%ld where x * (1 / s) rounds to another code): rows %s, "
               "cols %s, weight and W^T %s, bitwise = CPU", nr, naive, okr ? "ok" : "DIFFER", okc ? "ok" : "DIFFER", okw ? "ok" : "DIFFER");
        free(x); free(xt); free(w); free(q); free(s); free(dq);
    }

    /* cols: 5 experts {0, 17, 300, 128, 1} (R 446, Rmax 460) x 72 columns; then 70 experts (every fifth empty, the
       others 0..299 rows) x 40 columns: the chunk lookup over more than one warp's 32 experts */
    for (int t = 0; t < 2; t++) {
        static const int cnt5[5] = {0, 17, 300, 128, 1};
        const int E = t ? 70 : 5, C = t ? 40 : 72;
        int32_t offs[71] = {0};
        long long used = 0;
        for (int e = 0; e < E; e++) {
            const int n = t ? (e % 5 == 2 ? 0 : (e * 37 + 11) % 300) : cnt5[e];
            offs[e + 1] = offs[e] + n;
            used += 128LL * ((n + 127) / 128);
        }
        const int R = offs[E], Rmax = R + 14;
        const long long Lp = mt_cuda_fp8_tpad(Rmax, E);
        float *x = fp8_data(R, C, 1, 0);
        for (int c = 0; c < 8; c++) x[(size_t)(R - 1) * C + c] = 0;   /* the last expert's last row: (t = 0: zero blocks, s = 0) */
        uint8_t *qt = (uint8_t *)calloc((size_t)C * Lp, 1);
        float *st = (float *)calloc((size_t)(Lp / 128) * C, 4);
        double *dq = (double *)malloc(8 * (size_t)R * C);
        fp8_ref_cols(qt, st, dq, x, offs, E, C, Lp);
        void *dx = dalloc(2 * (size_t)Rmax * C), *tx = up_bf(x, (int64_t)R * C), *doffs = up(offs, 4 * (E + 1));
        mt_cuda_copy(CU, dx, tx, 2 * (size_t)R * C, 2);
        void *dq8 = dalloc((size_t)C * Lp), *dst = dalloc(4 * (size_t)(Lp / 128) * C);
        ok = !mt_cuda_fp8_quant_cols(CU, (uint8_t *)dq8, (float *)dst, dx, (const int32_t *)doffs, E, Rmax, C, Lp);
        uint8_t *gq = (uint8_t *)down(dq8, (size_t)C * Lp);
        float *gs = (float *)down(dst, 4 * (size_t)(Lp / 128) * C);
        for (int c = 0; c < C; c++) ok &= !memcmp(gq + (size_t)c * Lp, qt + (size_t)c * Lp, (size_t)used);   /* padding zeros included */
        ok &= !memcmp(gs, st, 4 * (size_t)(used / 128) * C);
        ok &= fp8_within(&w1);
        if (t) report("gpu fp8 quantize 128x1 token blocks, 70 experts", ok, "%d rows, 14 empty experts, %lld chunks: bitwise = CPU; worst rel %.4f",
                      R, used / 128, w1);
        else report("gpu fp8 quantize 128x1 token blocks", ok, "5 experts (one empty), padded to 128 rows each: bitwise = CPU; worst rel %.4f", w1);
        free(gq); free(gs); free(qt); free(st); free(dq); free(x);
        dfree(dx); dfree(tx); dfree(doffs); dfree(dq8); dfree(dst);
    }
    /* weight: 2 x 200 x 328 and its transpose */
    {
        const int E = 2, N = 200, K = 328, nbN = 2, nbK = 3;
        float *w = fp8_data(E * N, K, 0.05, 1);
        ok = 1;
        for (int tr = 0; tr < 2; tr++) {
            const size_t ns = (size_t)E * (tr ? nbK * fp8_ld(N) : nbN * fp8_ld(K));
            uint8_t *q = (uint8_t *)malloc((size_t)E * N * K);
            float *s = (float *)calloc(ns, 4);
            double *dq = (double *)malloc(8 * (size_t)E * N * K);
            fp8_ref_weight(q, s, dq, w, E, N, K, tr);
            void *dw = up_bf(w, (int64_t)E * N * K), *dq8 = dalloc((size_t)E * N * K), *ds = dalloc(4 * ns);
            ok &= !mt_cuda_fp8_quant_weight(CU, (uint8_t *)dq8, (float *)ds, dw, E, N, K, tr);
            uint8_t *gq = (uint8_t *)down(dq8, (size_t)E * N * K);
            float *gs = (float *)down(ds, 4 * ns);
            ok &= !memcmp(gq, q, (size_t)E * N * K) && !memcmp(gs, s, 4 * ns);   /* the padding entries: 0 */
            ok &= fp8_within(&w1);
            free(gq); free(gs); free(q); free(s); free(dq);
            dfree(dw); dfree(dq8); dfree(ds);
        }
        {   /* both forms from one read = one form at a time */
            const size_t n0 = (size_t)E * nbN * fp8_ld(K), n1 = (size_t)E * nbK * fp8_ld(N), nq = (size_t)E * N * K;
            void *dw = up_bf(w, (int64_t)nq), *a0 = dalloc(nq), *a1 = dalloc(nq), *b0 = dalloc(nq), *b1 = dalloc(nq);
            void *x0 = dalloc(4 * n0), *x1 = dalloc(4 * n1), *y0 = dalloc(4 * n0), *y1 = dalloc(4 * n1);
            ok &= !mt_cuda_fp8_quant_weight(CU, (uint8_t *)a0, (float *)x0, dw, E, N, K, 0) && !mt_cuda_fp8_quant_weight(CU, (uint8_t *)a1, (float *)x1, dw, E, N, K, 1) &&
                  !mt_cuda_fp8_quant_weight2(CU, (uint8_t *)b0, (float *)y0, (uint8_t *)b1, (float *)y1, dw, E, N, K, NULL);
            uint8_t *h[4] = {(uint8_t *)down(a0, nq), (uint8_t *)down(b0, nq), (uint8_t *)down(a1, nq), (uint8_t *)down(b1, nq)};
            float *hs[4] = {(float *)down(x0, 4 * n0), (float *)down(y0, 4 * n0), (float *)down(x1, 4 * n1), (float *)down(y1, 4 * n1)};
            ok &= !memcmp(h[0], h[1], nq) && !memcmp(h[2], h[3], nq) && !memcmp(hs[0], hs[1], 4 * n0) && !memcmp(hs[2], hs[3], 4 * n1);
            for (int k = 0; k < 4; k++) { free(h[k]); free(hs[k]); }
            dfree(dw); dfree(a0); dfree(a1); dfree(b0); dfree(b1); dfree(x0); dfree(x1); dfree(y0); dfree(y1);
        }
        report("gpu fp8 quantize 128x128 weights (and W^T)", ok, "2 x 200 x 328: codes, scales, padding bitwise = CPU; both forms in one pass = "
               "one at a time; worst rel %.4f", w1);
        free(w);
    }
    /* AdamW writing the weight's FP8 forms = AdamW, then the quantizer on its bf16 copy; a fresh slot's quantizer does nothing */
    for (int bm = 0; bm < 2; bm++) {
        const int E = 3, N = 204, K = 264, nbN = 2, nbK = 3;
        const size_t n = (size_t)E * N * K, n0 = (size_t)E * nbN * fp8_ld(K), n1 = (size_t)E * nbK * fp8_ld(N), mb = bm ? 2 : 4;
        float *p = fp8_data(E * N, K, 0.05, 1), *g = fp8_data(E * N, K, 0.01, 0), *m = fp8_data(E * N, K, 0.001, 0);
        float *v = (float *)malloc(4 * n);
        uint16_t *m16 = (uint16_t *)malloc(2 * n), *v16 = (uint16_t *)malloc(2 * n);
        for (size_t i = 0; i < n; i++) { v[i] = m[i] * m[i] + 1e-6f; m16[i] = mt_bf16_round(m[i]); v16[i] = mt_bf16_round(v[i]); }
        mt_hparams h;
        mt_hparams_default(&h);
        float hp[MT_HP_COUNT], lr = 3e-3f, coef = 0.75f;
        mt_hparams_pack(&h, hp);
        int32_t step = 4, one = 1;
        void *Dhp = up(hp, sizeof hp), *Dlr = up(&lr, 4), *Dcoef = up(&coef, 4), *Dst = up(&step, 4), *Dg = up(g, 4 * n);
        void *P[2], *M[2], *V[2], *B16[2], *Q0[2], *S0[2], *Q1[2], *S1[2], *fresh = up(&one, 4);
        int zero = 0, fr = -1;
        for (int k = 0; k < 2; k++) {
            P[k] = up(p, 4 * n); M[k] = bm ? up(m16, 2 * n) : up(m, 4 * n); V[k] = bm ? up(v16, 2 * n) : up(v, 4 * n);
            B16[k] = dalloc(2 * n); Q0[k] = dalloc(n); Q1[k] = dalloc(n); S0[k] = dalloc(4 * n0); S1[k] = dalloc(4 * n1);
        }
        mt_cuda_copy(CU, fresh, &zero, 4, 0);
        ok = !(bm ? mt_cuda_adamw_bf16(CU, (float *)P[0], M[0], V[0], B16[0], (float *)Dg, (int64_t)n, (float *)Dlr, (float *)Dcoef, (float *)Dhp,
                                       (int32_t *)Dst, 1)
                  : mt_cuda_adamw(CU, (float *)P[0], (float *)M[0], (float *)V[0], B16[0], (float *)Dg, (int64_t)n, (float *)Dlr, (float *)Dcoef,
                                  (float *)Dhp, (int32_t *)Dst, 1)) &&
             !mt_cuda_fp8_quant_weight2(CU, (uint8_t *)Q0[0], (float *)S0[0], (uint8_t *)Q1[0], (float *)S1[0], B16[0], E, N, K, NULL) &&
             !mt_cuda_adamw_fp8(CU, (float *)P[1], M[1], V[1], bm, B16[1], (float *)Dg, E, N, K, (float *)Dlr, (float *)Dcoef, (float *)Dhp,
                                (int32_t *)Dst, 1, (uint8_t *)Q0[1], (float *)S0[1], (uint8_t *)Q1[1], (float *)S1[1], (int *)fresh);
        mt_cuda_copy(CU, &fr, fresh, 4, 1);
        int same = ok && fr == 1;
        const void *a[7] = {P[0], M[0], V[0], B16[0], Q0[0], Q1[0], S0[0]}, *b[7] = {P[1], M[1], V[1], B16[1], Q0[1], Q1[1], S0[1]};
        const size_t nb[7] = {4 * n, mb * n, mb * n, 2 * n, n, n, 4 * n0};
        int differ = 0;   /* bit k: buffer k differs (p, m, v, bf16 copy, W, W^T, their scales) */
        for (int k = 0; k < 8 && ok; k++) {
            size_t bytes = k < 7 ? nb[k] : 4 * n1;
            void *x = down(k < 7 ? a[k] : S1[0], bytes), *y = down(k < 7 ? b[k] : S1[1], bytes);
            differ |= memcmp(x, y, bytes) ? 1 << k : 0;
            free(x); free(y);
        }
        same &= !differ;
        /* fresh: the quantizer leaves the forms alone (poisoned: nothing written) */
        mt_cuda_memset(CU, Q0[0], 0x5a, n);
        int skipped = !mt_cuda_fp8_quant_weight2(CU, (uint8_t *)Q0[0], (float *)S0[0], (uint8_t *)Q1[0], (float *)S1[0], B16[1], E, N, K, (int *)fresh);
        uint8_t *q0 = (uint8_t *)down(Q0[0], n);
        for (size_t i = 0; i < n && skipped; i++) skipped = q0[i] == 0x5a;
        free(q0);
        /* without the bf16 copy: the same forms */
        int nocopy = 1;
        {
            void *P2 = up(p, 4 * n), *M2 = bm ? up(m16, 2 * n) : up(m, 4 * n), *V2 = bm ? up(v16, 2 * n) : up(v, 4 * n), *Q2 = dalloc(n);
            int rc = mt_cuda_adamw_fp8(CU, (float *)P2, M2, V2, bm, NULL, (float *)Dg, E, N, K, (float *)Dlr, (float *)Dcoef, (float *)Dhp,
                                       (int32_t *)Dst, 1, (uint8_t *)Q2, (float *)S0[0], NULL, NULL, NULL);
            uint8_t *u = (uint8_t *)down(Q2, n), *w2 = (uint8_t *)down(Q0[1], n);
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < n; i++) if (u[i] != w2[i] && !bad++) first = i;
            nocopy = !rc && !bad;
            if (!nocopy) printf("  no bf16 copy: rc %d (%s), %zu bytes differ, the first at %zu: %02x against %02x\n", rc, rc ? mt_cuda_error(CU) : "",
                                bad, first, bad ? u[first] : 0, bad ? w2[first] : 0);
            free(u); free(w2);
            dfree(P2); dfree(M2); dfree(V2); dfree(Q2);
        }
        report(bm ? "gpu AdamW with FP8 weight forms = AdamW + quantizer, bitwise (bf16 moments)" : "gpu AdamW with FP8 weight forms = AdamW + quantizer, bitwise",
               same && skipped && nocopy, "3 x 204 x 264: p, m, v, bf16 copy, W, W^T and their scales (launched %d, differ: mask %d, flag %d); a fresh slot's "
               "quantizer writes nothing %d; no bf16 copy, the same W %d", ok, differ, fr, skipped, nocopy);
        for (int k = 0; k < 2; k++) { dfree(P[k]); dfree(M[k]); dfree(V[k]); dfree(B16[k]); dfree(Q0[k]); dfree(Q1[k]); dfree(S0[k]); dfree(S1[k]); }
        dfree(Dhp); dfree(Dlr); dfree(Dcoef); dfree(Dst); dfree(Dg); dfree(fresh);
        free(p); free(g); free(m); free(v); free(m16); free(v16);
    }
}

/* the GEMMs: the kernels' outputs against the float64 product of the CPU-dequantized operands (arithmetic:
   <= 2^-8 |ref| + tol sum |a||b|, tol 2^-9: one bf16 rounding, and Hopper's FP8 accumulation inside a 128-block,
   which reached 1.01 x 2^-10 sum |a||b| in one element of a fast256 forward), and against the bf16 operands' exact
   product (quantization: normwise) */
static void fp8_check(const char *name, const void *dout, int is_bf, const double *ref, const double *sabs, const double *exact,
                      int64_t n, int launched, double tol) {
    float *g = down_f(dout, n, is_bf);
    const double r = fp8_gemm_ratio(g, ref, sabs, n, tol);
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) { num += (g[i] - exact[i]) * (g[i] - exact[i]); den += exact[i] * exact[i]; }
    const double nrm = den > 0 ? sqrt(num / den) : 0;
    report(name, launched && r <= 1 && nrm < 0.08, "arithmetic %.3f of its bound; vs bf16 inputs: normwise %.4f (expected ~0.037, < 0.08)%s",
           r, nrm, launched ? "" : mt_cuda_error(CU));
    free(g);
}

static void gpu_test_fp8_dense(int T, int N, int K) {
    /* Y = X W^T, dX = dY W, dW = dY^T X through cuBLASLt's block-scaled FP8 */
    float *X = fp8_data(T, K, 1, 1), *W = fp8_data(N, K, 0.05, 0), *dY = fp8_data(T, N, 1, 0);
    const int nbT = (T + 127) / 128;
    const long long Lp = mt_cuda_fp8_tpad(T, 1);
    uint8_t *qx = malloc((size_t)T * K), *qw = malloc((size_t)N * K), *qwt = malloc((size_t)N * K), *qy = malloc((size_t)T * N);
    uint8_t *qyt = calloc((size_t)N * Lp, 1), *qxt = calloc((size_t)K * Lp, 1);
    float *sx = malloc(4 * (size_t)T * ((K + 127) / 128)), *sy = malloc(4 * (size_t)T * ((N + 127) / 128));
    float *sw = calloc((size_t)((N + 127) / 128) * fp8_ld(K), 4), *swt = calloc((size_t)((K + 127) / 128) * fp8_ld(N), 4);
    float *syt = calloc((size_t)(Lp / 128) * N, 4), *sxt = calloc((size_t)(Lp / 128) * K, 4);
    double *dx = malloc(8 * (size_t)T * K), *dw = malloc(8 * (size_t)N * K), *dwt = malloc(8 * (size_t)N * K), *dy = malloc(8 * (size_t)T * N);
    double *dyt = malloc(8 * (size_t)T * N), *dxt = malloc(8 * (size_t)T * K);
    int32_t offs[2] = {0, T};
    fp8_ref_rows(qx, sx, dx, X, T, K);
    fp8_ref_rows(qy, sy, dy, dY, T, N);
    fp8_ref_weight(qw, sw, dw, W, 1, N, K, 0);
    fp8_ref_weight(qwt, swt, dwt, W, 1, N, K, 1);
    fp8_ref_cols(qyt, syt, dyt, dY, offs, 1, N, Lp);
    fp8_ref_cols(qxt, sxt, dxt, X, offs, 1, K, Lp);
    /* references: ref (dequantized), sabs (sum |a||b| of the dequantized), exact (bf16 inputs) */
    double *r0 = malloc(8 * (size_t)T * N), *a0 = malloc(8 * (size_t)T * N), *e0 = malloc(8 * (size_t)T * N);
    double *r1 = malloc(8 * (size_t)T * K), *a1 = malloc(8 * (size_t)T * K), *e1 = malloc(8 * (size_t)T * K);
    double *r2 = malloc(8 * (size_t)N * K), *a2 = malloc(8 * (size_t)N * K), *e2 = malloc(8 * (size_t)N * K);
    for (int t = 0; t < T; t++)
        for (int n = 0; n < N; n++) {
            double r = 0, a = 0, e = 0;
            for (int k = 0; k < K; k++) {
                r += dx[(size_t)t * K + k] * dw[(size_t)n * K + k];
                a += fabs(dx[(size_t)t * K + k] * dw[(size_t)n * K + k]);
                e += (double)X[(size_t)t * K + k] * W[(size_t)n * K + k];
            }
            r0[(size_t)t * N + n] = r; a0[(size_t)t * N + n] = a; e0[(size_t)t * N + n] = e;
        }
    for (int t = 0; t < T; t++)
        for (int k = 0; k < K; k++) {
            double r = 0, a = 0, e = 0;
            for (int n = 0; n < N; n++) {
                r += dy[(size_t)t * N + n] * dw[(size_t)n * K + k];
                a += fabs(dy[(size_t)t * N + n] * dw[(size_t)n * K + k]);
                e += (double)dY[(size_t)t * N + n] * W[(size_t)n * K + k];
            }
            r1[(size_t)t * K + k] = r; a1[(size_t)t * K + k] = a; e1[(size_t)t * K + k] = e;
        }
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            double r = 0, a = 0, e = 0;
            for (int t = 0; t < T; t++) {
                r += dyt[(size_t)t * N + n] * dxt[(size_t)t * K + k];
                a += fabs(dyt[(size_t)t * N + n] * dxt[(size_t)t * K + k]);
                e += (double)dY[(size_t)t * N + n] * X[(size_t)t * K + k];
            }
            r2[(size_t)n * K + k] = r; a2[(size_t)n * K + k] = a; e2[(size_t)n * K + k] = e;
        }
    void *gqx = up(qx, (size_t)T * K), *gsx = up(sx, 4 * (size_t)T * ((K + 127) / 128)), *gqw = up(qw, (size_t)N * K);
    void *gsw = up(sw, 4 * (size_t)((N + 127) / 128) * fp8_ld(K)), *gqwt = up(qwt, (size_t)N * K);
    void *gswt = up(swt, 4 * (size_t)((K + 127) / 128) * fp8_ld(N)), *gqy = up(qy, (size_t)T * N), *gsy = up(sy, 4 * (size_t)T * ((N + 127) / 128));
    void *gqyt = up(qyt, (size_t)N * Lp), *gsyt = up(syt, 4 * (size_t)(Lp / 128) * N), *gqxt = up(qxt, (size_t)K * Lp);
    void *gsxt = up(sxt, 4 * (size_t)(Lp / 128) * K);
    void *y = dalloc(2 * (size_t)T * N), *gdx = dalloc(2 * (size_t)T * K), *gdw = dalloc(4 * (size_t)N * K);
    char nm[96];
    int l0 = !mt_cuda_fp8_gemm(CU, y, 0, gqx, gsx, K, gqw, gsw, 1, K, T, N, K);
    snprintf(nm, sizeof nm, "gpu fp8 dense fwd %dx%dx%d (cuBLASLt)", T, N, K);
    fp8_check(nm, y, 1, r0, a0, e0, (int64_t)T * N, l0, 1.0 / 512);
    int l1 = !mt_cuda_fp8_gemm(CU, gdx, 0, gqy, gsy, N, gqwt, gswt, 1, N, T, K, N);
    snprintf(nm, sizeof nm, "gpu fp8 dense dX %dx%dx%d (cuBLASLt)", T, K, N);
    fp8_check(nm, gdx, 1, r1, a1, e1, (int64_t)T * K, l1, 1.0 / 512);
    int l2 = !mt_cuda_fp8_gemm(CU, gdw, 1, gqyt, gsyt, (int)Lp, gqxt, gsxt, 0, (int)Lp, N, K, nbT * 128);
    snprintf(nm, sizeof nm, "gpu fp8 dense dW %dx%dx%d (cuBLASLt)", N, K, T);
    fp8_check(nm, gdw, 0, r2, a2, e2, (int64_t)N * K, l2, 1.0 / 512);
    void *ptrs[] = {gqx, gsx, gqw, gsw, gqwt, gswt, gqy, gsy, gqyt, gsyt, gqxt, gsxt, y, gdx, gdw};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) dfree(ptrs[i]);
    void *hp[] = {X, W, dY, qx, qw, qwt, qy, qyt, qxt, sx, sy, sw, swt, syt, sxt, dx, dw, dwt, dy, dyt, dxt, r0, a0, e0, r1, a1, e1, r2, a2, e2};
    for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++) free(hp[i]);
}

/* ctas > 0: the persistent kernels on that many CTAs (each walks many tiles: the pipeline's phases and the
   epilogue's staging carry over from tile to tile) */
static void gpu_test_fp8_grouped(int E, int M, int K, const int *cnt, int variant, int ctas) {
    static const char *vn[6] = {"wgmma", "simple", "wgmma192", "fast128", "fast256", "direct256"};
    int32_t *offs = malloc(4 * (size_t)(E + 1));
    offs[0] = 0;
    for (int e = 0; e < E; e++) offs[e + 1] = offs[e] + cnt[e];
    const int R = offs[E], Rmax = R + 21, nbK = (K + 127) / 128, nbM = (M + 127) / 128;
    const long long Lp = mt_cuda_fp8_tpad(Rmax, E);
    float *X = fp8_data(R, K, 1, 1), *W = fp8_data(E * M, K, 0.05, 0), *dY = fp8_data(R, M, 1, 0);
    /* CPU quantization (the kernels' codes are checked bitwise above; here the GPU quantizes its own operands) */
    uint8_t *tq = malloc((size_t)E * M * K + (size_t)(M + K) * Lp + (size_t)R * (M + K));
    float *ts = malloc(4 * ((size_t)E * (nbM * fp8_ld(K) + nbK * fp8_ld(M)) + (size_t)(Lp / 128) * (M + K) + (size_t)R * (nbK + nbM)));
    double *dx = malloc(8 * (size_t)R * K), *dy = malloc(8 * (size_t)R * M), *dw = malloc(8 * (size_t)E * M * K);
    double *dyt = malloc(8 * (size_t)R * M), *dxt = malloc(8 * (size_t)R * K);
    fp8_ref_rows(tq, ts, dx, X, R, K);
    fp8_ref_rows(tq, ts, dy, dY, R, M);
    fp8_ref_weight(tq, ts, dw, W, E, M, K, 0);
    fp8_ref_cols(tq, ts, dyt, dY, offs, E, M, Lp);   /* (codes overwritten: only the dequantized values are kept) */
    fp8_ref_cols(tq, ts, dxt, X, offs, E, K, Lp);
    double *ry = malloc(8 * (size_t)R * M), *ay = malloc(8 * (size_t)R * M), *ey = malloc(8 * (size_t)R * M);
    double *rx = malloc(8 * (size_t)R * K), *ax = malloc(8 * (size_t)R * K), *ex = malloc(8 * (size_t)R * K);
    double *rw = malloc(8 * (size_t)E * M * K), *aw = malloc(8 * (size_t)E * M * K), *ew = malloc(8 * (size_t)E * M * K);
    for (int e = 0; e < E; e++) {
        const double *we = dw + (size_t)e * M * K;
        const float *wf = W + (size_t)e * M * K;
        for (int r = offs[e]; r < offs[e + 1]; r++) {
            for (int m = 0; m < M; m++) {
                double s = 0, a = 0, x = 0;
                for (int k = 0; k < K; k++) { s += dx[(size_t)r * K + k] * we[(size_t)m * K + k]; a += fabs(dx[(size_t)r * K + k] * we[(size_t)m * K + k]); x += (double)X[(size_t)r * K + k] * wf[(size_t)m * K + k]; }
                ry[(size_t)r * M + m] = s; ay[(size_t)r * M + m] = a; ey[(size_t)r * M + m] = x;
            }
            for (int k = 0; k < K; k++) {
                double s = 0, a = 0, x = 0;
                for (int m = 0; m < M; m++) { s += dy[(size_t)r * M + m] * we[(size_t)m * K + k]; a += fabs(dy[(size_t)r * M + m] * we[(size_t)m * K + k]); x += (double)dY[(size_t)r * M + m] * wf[(size_t)m * K + k]; }
                rx[(size_t)r * K + k] = s; ax[(size_t)r * K + k] = a; ex[(size_t)r * K + k] = x;
            }
        }
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) {
                double s = 0, a = 0, x = 0;
                for (int r = offs[e]; r < offs[e + 1]; r++) { s += dyt[(size_t)r * M + m] * dxt[(size_t)r * K + k]; a += fabs(dyt[(size_t)r * M + m] * dxt[(size_t)r * K + k]); x += (double)dY[(size_t)r * M + m] * X[(size_t)r * K + k]; }
                rw[((size_t)e * M + m) * K + k] = s; aw[((size_t)e * M + m) * K + k] = a; ew[((size_t)e * M + m) * K + k] = x;
            }
    }
    /* device: operands quantized by the GPU kernels; Rmax rows, those past R NaN (poisoned) and never read */
    void *gX = dalloc(2 * (size_t)Rmax * K), *gY = dalloc(2 * (size_t)Rmax * M), *t1 = up_bf(X, (int64_t)R * K), *t2 = up_bf(dY, (int64_t)R * M);
    mt_cuda_copy(CU, gX, t1, 2 * (size_t)R * K, 2); mt_cuda_copy(CU, gY, t2, 2 * (size_t)R * M, 2);
    void *gW = up_bf(W, (int64_t)E * M * K), *goffs = up(offs, 4 * (size_t)(E + 1));
    uint8_t *qx = dalloc((size_t)Rmax * K), *qy = dalloc((size_t)Rmax * M), *qw = dalloc((size_t)E * M * K), *qwt = dalloc((size_t)E * M * K);
    uint8_t *qyt = dalloc((size_t)M * Lp), *qxt = dalloc((size_t)K * Lp);
    float *sx = dalloc(4 * (size_t)Rmax * nbK), *sy = dalloc(4 * (size_t)Rmax * nbM), *sw = dalloc(4 * (size_t)E * nbM * fp8_ld(K));
    float *swt = dalloc(4 * (size_t)E * nbK * fp8_ld(M)), *syt = dalloc(4 * (size_t)(Lp / 128) * M), *sxt = dalloc(4 * (size_t)(Lp / 128) * K);
    int ok = !mt_cuda_fp8_quant_rows(CU, qx, sx, gX, Rmax, K) && !mt_cuda_fp8_quant_rows(CU, qy, sy, gY, Rmax, M) &&
             !mt_cuda_fp8_quant_weight(CU, qw, sw, gW, E, M, K, 0) && !mt_cuda_fp8_quant_weight(CU, qwt, swt, gW, E, M, K, 1) &&
             !mt_cuda_fp8_quant_cols(CU, qyt, syt, gY, (const int32_t *)goffs, E, Rmax, M, Lp) &&
             !mt_cuda_fp8_quant_cols(CU, qxt, sxt, gX, (const int32_t *)goffs, E, Rmax, K, Lp);
    int codes = 1;   /* the operands the GEMMs read are the CPU's codes: X and dY rows, dY down the tokens */
    {
        uint8_t *cq = (uint8_t *)calloc((size_t)M * Lp + (size_t)R * (K > M ? K : M), 1);
        float *cs = (float *)calloc((size_t)(Lp / 128) * M + (size_t)R * (nbK > nbM ? nbK : nbM), 4);
        double *cd = (double *)malloc(8 * (size_t)R * (K > M ? K : M));
        for (int w = 0; w < 2; w++) {
            const int C = w ? M : K, nb = (C + 127) / 128;
            fp8_ref_rows(cq, cs, cd, w ? dY : X, R, C);
            uint8_t *hq = (uint8_t *)down(w ? qy : qx, (size_t)R * C);
            float *hs = (float *)down(w ? sy : sx, 4 * (size_t)Rmax * nb);
            codes &= !memcmp(hq, cq, (size_t)R * C);
            for (int kb = 0; kb < nb; kb++) codes &= !memcmp(hs + (size_t)kb * Rmax, cs + (size_t)kb * R, 4 * (size_t)R);
            free(hq); free(hs);
        }
        memset(cq, 0, (size_t)M * Lp);
        fp8_ref_cols(cq, cs, cd, dY, offs, E, M, Lp);
        uint8_t *hq = (uint8_t *)down(qyt, (size_t)M * Lp);
        long long used = 0;
        for (int e = 0; e < E; e++) used += 128LL * ((offs[e + 1] - offs[e] + 127) / 128);
        for (int m = 0; m < M; m++) codes &= !memcmp(hq + (size_t)m * Lp, cq + (size_t)m * Lp, (size_t)used);
        free(hq); free(cq); free(cs); free(cd);
        fp8_within(&(double){0});
    }
    void *o[2][3];
    for (int run = 0; run < 2; run++) {
        o[run][0] = dalloc(2 * (size_t)Rmax * M); o[run][1] = dalloc(2 * (size_t)Rmax * K); o[run][2] = dalloc(4 * (size_t)E * M * K);
        ok &= !mt_cuda_fp8_gmm_ctas(CU, 0, o[run][0], qx, sx, qw, sw, (const int32_t *)goffs, E, M, K, Rmax, Lp, variant, ctas) &&
              !mt_cuda_fp8_gmm_ctas(CU, 1, o[run][1], qy, sy, qwt, swt, (const int32_t *)goffs, E, M, K, Rmax, Lp, variant, ctas) &&
              !mt_cuda_fp8_gmm_ctas(CU, 2, o[run][2], qyt, syt, qxt, sxt, (const int32_t *)goffs, E, M, K, Rmax, Lp, variant, ctas);
    }
    char nm[96], cn[24] = "";
    if (ctas > 0) snprintf(cn, sizeof cn, " on %d CTAs", ctas);
    snprintf(nm, sizeof nm, "gpu fp8 grouped fwd E%d %dx%d %s%s", E, M, K, vn[variant], cn);
    fp8_check(nm, o[0][0], 1, ry, ay, ey, (int64_t)R * M, ok, 1.0 / 512);
    snprintf(nm, sizeof nm, "gpu fp8 grouped dX E%d %dx%d %s%s", E, M, K, vn[variant], cn);
    fp8_check(nm, o[0][1], 1, rx, ax, ex, (int64_t)R * K, ok, 1.0 / 512);
    snprintf(nm, sizeof nm, "gpu fp8 grouped dW E%d %dx%d %s%s", E, M, K, vn[variant], cn);
    fp8_check(nm, o[0][2], 0, rw, aw, ew, (int64_t)E * M * K, ok, 1.0 / 512);
    /* reruns bitwise; rows past R untouched (still the poison) */
    const size_t bytes[3] = {2 * (size_t)Rmax * M, 2 * (size_t)Rmax * K, 4 * (size_t)E * M * K};
    int same = 1, untouched = 1;
    for (int i = 0; i < 3; i++) {
        unsigned char *a = down(o[0][i], bytes[i]), *b = down(o[1][i], bytes[i]);
        same &= !memcmp(a, b, bytes[i]);
        if (i < 2) {
            const size_t row = i ? 2 * (size_t)K : 2 * (size_t)M;
            for (size_t j = (size_t)R * row; j < bytes[i]; j++) untouched &= a[j] == 0xff;
        }
        free(a); free(b);
    }
    snprintf(nm, sizeof nm, "gpu fp8 grouped %s%s: operands, reruns, rows past R", vn[variant], cn);
    report(nm, same && untouched && codes, "operands %s; %s %s", codes ? "= CPU codes" : "DIFFER from the CPU's codes", same ? "bitwise" : "DIFFER",
           untouched ? "untouched" : "rows past R written");
    {   /* dW with the partial sums of its squares (GMM_DW_SQ): dW bitwise the plain call's, the partials add up to sum(dW^2),
           the entries past the tiles' 0 (the buffer poisoned, 37 more than needed) */
        const int64_t len = mt_gmm_ssq_len_fp8(E, M, K) + 37, nw = (int64_t)E * M * K;
        void *dws = dalloc(4 * (size_t)nw);
        float *ssq = dalloc(4 * (size_t)len);
        int oks = ok && !mt_cuda_fp8_gmm_dw(CU, dws, qyt, syt, qxt, sxt, (const int32_t *)goffs, E, M, K, Rmax, Lp, variant, ctas, ssq, len);
        float *w1 = down(o[0][2], 4 * (size_t)nw), *w2 = down(dws, 4 * (size_t)nw), *hs = down(ssq, 4 * (size_t)len);
        double want = 0, got = 0;
        int finite = 1;
        for (int64_t i = 0; i < nw; i++) want += (double)w1[i] * w1[i];
        for (int64_t i = 0; i < len; i++) { got += hs[i]; finite &= isfinite(hs[i]); }
        int bw = oks && !memcmp(w1, w2, 4 * (size_t)nw);
        double rel = fabs(got - want) / (want > 0 ? want : 1);
        snprintf(nm, sizeof nm, "gpu fp8 grouped dW + sum of squares %s%s", vn[variant], cn);
        report(nm, bw && finite && rel < 1e-5, "dW %s; partials %.9g against %.9g (rel %.1e), %s", bw ? "bitwise" : "DIFFER", got, want, rel,
               finite ? "all finite" : "NOT ALL WRITTEN");
        free(w1); free(w2); free(hs);
        dfree(dws); dfree(ssq);
    }
    {   /* two pairs in one accumulator (GMM_DX2): dX = dY W + dY2 W2, the second pair other data at other scales */
        float *dY2 = fp8_data(R, M, 0.5, 0), *W2 = fp8_data(E * M, K, 0.02, 0);
        double *dy2 = malloc(8 * (size_t)R * M), *dw2 = malloc(8 * (size_t)E * M * K);
        double *r2 = malloc(8 * (size_t)R * K), *a2 = malloc(8 * (size_t)R * K), *e2 = malloc(8 * (size_t)R * K);
        fp8_ref_rows(tq, ts, dy2, dY2, R, M);
        fp8_ref_weight(tq, ts, dw2, W2, E, M, K, 0);
        for (int e = 0; e < E; e++)
            for (int r = offs[e]; r < offs[e + 1]; r++)
                for (int k = 0; k < K; k++) {
                    const size_t i = (size_t)r * K + k;
                    double s2 = rx[i], a = ax[i], x = ex[i];
                    for (int m = 0; m < M; m++) {
                        const size_t iy = (size_t)r * M + m, iw = ((size_t)e * M + m) * K + k;
                        s2 += dy2[iy] * dw2[iw]; a += fabs(dy2[iy] * dw2[iw]); x += (double)dY2[iy] * W2[iw];
                    }
                    r2[i] = s2; a2[i] = a; e2[i] = x;
                }
        void *gY2 = dalloc(2 * (size_t)Rmax * M), *t3 = up_bf(dY2, (int64_t)R * M), *gW2 = up_bf(W2, (int64_t)E * M * K);
        mt_cuda_copy(CU, gY2, t3, 2 * (size_t)R * M, 2);
        uint8_t *qy2 = dalloc((size_t)Rmax * M), *qwt2 = dalloc((size_t)E * M * K);
        float *sy2 = dalloc(4 * (size_t)Rmax * nbM), *swt2 = dalloc(4 * (size_t)E * nbK * fp8_ld(M));
        void *o2[2] = {dalloc(2 * (size_t)Rmax * K), dalloc(2 * (size_t)Rmax * K)};
        int ok2 = ok && !mt_cuda_fp8_quant_rows(CU, qy2, sy2, gY2, Rmax, M) && !mt_cuda_fp8_quant_weight(CU, qwt2, swt2, gW2, E, M, K, 1);
        for (int run = 0; run < 2; run++)
            ok2 = ok2 && !mt_cuda_fp8_gmm2(CU, 1, o2[run], qy, sy, qwt, swt, qy2, sy2, qwt2, swt2, (const int32_t *)goffs, E, M, K, Rmax,
                                           variant, ctas);
        snprintf(nm, sizeof nm, "gpu fp8 grouped dX of two pairs E%d %dx%d %s%s", E, M, K, vn[variant], cn);
        fp8_check(nm, o2[0], 1, r2, a2, e2, (int64_t)R * K, ok2, 1.0 / 512);
        const size_t nb = 2 * (size_t)Rmax * K;
        unsigned char *h0 = down(o2[0], nb), *h1 = down(o2[1], nb);
        int same2 = !memcmp(h0, h1, nb), untouched2 = 1;
        for (size_t j = 2 * (size_t)R * K; j < nb; j++) untouched2 &= h0[j] == 0xff;
        snprintf(nm, sizeof nm, "gpu fp8 grouped dX of two pairs %s%s: reruns, rows past R", vn[variant], cn);
        report(nm, ok2 && same2 && untouched2, "%s, %s", same2 ? "bitwise" : "DIFFER", untouched2 ? "untouched" : "rows past R written");
        free(h0); free(h1);
        void *dq[] = {gY2, t3, gW2, qy2, qwt2, sy2, swt2, o2[0], o2[1]};
        for (size_t i = 0; i < sizeof dq / sizeof dq[0]; i++) dfree(dq[i]);
        void *hq[] = {dY2, W2, dy2, dw2, r2, a2, e2};
        for (size_t i = 0; i < sizeof hq / sizeof hq[0]; i++) free(hq[i]);
    }
    for (int run = 0; run < 2; run++) for (int i = 0; i < 3; i++) dfree(o[run][i]);
    void *dp[] = {gX, gY, t1, t2, gW, goffs, qx, qy, qw, qwt, qyt, qxt, sx, sy, sw, swt, syt, sxt};
    for (size_t i = 0; i < sizeof dp / sizeof dp[0]; i++) dfree(dp[i]);
    void *hp[] = {offs, X, W, dY, tq, ts, dx, dy, dw, dyt, dxt, ry, ay, ey, rx, ax, ex, rw, aw, ew};
    for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++) free(hp[i]);
}

/* SIGUSR2 prints every thread's stack to stderr (tools/stall_check.sh sends it to a run that stalls): the
 * signalled thread hands SIGUSR1 to each thread of the process in turn; each prints its own frames, which
 * `addr2line -f -e test_gpu OFFSET` names (the binary's frames show as test_gpu(+OFFSET)). */
#include <execinfo.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
extern long syscall(long number, ...);
static void stack_print_mine(int sig) {
    (void)sig;
    void *pc[64];
    char head[64];
    int n = backtrace(pc, 64), l = snprintf(head, sizeof head, "--- thread %ld\n", syscall(SYS_gettid));
    if (write(2, head, (size_t)l) < 0) return;
    backtrace_symbols_fd(pc, n, 2);
}
static void stack_print_all(int sig) {
    (void)sig;
    DIR *d = opendir("/proc/self/task");
    struct dirent *t;
    struct timespec pause = {0, 100000000};
    while (d && (t = readdir(d)) != NULL) {
        long tid = atol(t->d_name);
        if (tid <= 0) continue;
        syscall(SYS_tgkill, (long)getpid(), tid, SIGUSR1);
        nanosleep(&pause, NULL);
    }
    if (d) closedir(d);
}
static void stack_dump_install(void) {
    void *pc[4];
    backtrace(pc, 4);   /* loads the unwinder now, not inside a handler */
    struct sigaction a;
    memset(&a, 0, sizeof a);
    sigemptyset(&a.sa_mask);
    a.sa_flags = SA_RESTART;
    a.sa_handler = stack_print_mine;
    sigaction(SIGUSR1, &a, NULL);
    a.sa_handler = stack_print_all;
    sigaction(SIGUSR2, &a, NULL);
}

int main(void) {
    mt_err e;
    mt_rng_seed(&R, 42);
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    stack_dump_install();
    /* Thread-ranks on GPUs share one process: a kernel loaded lazily (CUDA's default) may wait for the
     * process's GPUs to go idle while another rank's exchange waits for this rank; load every module at start. */
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    char info[512];
    mt_cuda_describe(info, sizeof info);
    printf("%s\n", info);
    if (mt_cuda_create(&CU, 0, &e)) { report("gpu present", 0, "%s", e.msg); printf("%d passed, %d failed\n", n_pass, n_fail); return 1; }
    if (getenv("MOETRAIN_TEST_MULTI_ONLY")) {   /* just the many-GPU part */
        gpu_test_multi_rank();
        gpu_test_moe_chunks();
        mt_cuda_destroy(CU);
        printf("%d passed, %d failed\n", n_pass, n_fail);
        return n_fail ? 1 : 0;
    }
    const char *only = getenv("MT_TEST_ONLY");   /* run the tests whose calls contain this, e.g. "rows" or "rope(11" */
#define GPU_RUN(call) do { if (!only || strstr(#call, only)) call; } while (0)
    GPU_RUN(gpu_test_basic_ops());
    GPU_RUN(gpu_test_rows());
    GPU_RUN(gpu_test_matmul());
    GPU_RUN(gpu_test_rope(16, 24));   /* 16-byte chunk kernels */
    GPU_RUN(gpu_test_rope(12, 10));   /* bf16-pair kernels */
    GPU_RUN(gpu_test_rope(11, 9));    /* element kernels */
    GPU_RUN(gpu_test_attention_shape(2, 64, 4, 24, 16, 0));
    GPU_RUN(gpu_test_attention_shape(1, 7, 2, 12, 8, 0));
    GPU_RUN(gpu_test_attention_shape(2, 100, 3, 64, 64, 0));
    GPU_RUN(gpu_test_attention_shape(1, 130, 2, 192, 128, 0));
    GPU_RUN(gpu_test_attention_shape(2, 256, 4, 192, 128, 0));
    GPU_RUN(gpu_test_doc_starts());
    GPU_RUN(gpu_test_attention_shape(2, 100, 3, 64, 64, 20));
    GPU_RUN(gpu_test_attention_shape(2, 300, 2, 192, 128, 40));
    GPU_RUN(gpu_test_attention_shape(2, 520, 4, 192, 128, 150));
    GPU_RUN(gpu_test_attention_shape(1, 130, 2, 256, 256, 30));
    GPU_RUN(gpu_test_attention_shape(2, 300, 3, 256, 256, 0));    /* heads of 256: dK, dV on separate warpgroups */
    GPU_RUN(gpu_test_attention_shape(1, 200, 2, 224, 160, 0));    /* head dims padded to 256 */
    GPU_RUN(gpu_test_attention_shape(2, 77, 3, 40, 72, 9));
    GPU_RUN(gpu_test_attention_shape(1, 1000, 2, 128, 128, 0));   /* wgmma kernels: odd length, several key blocks */
    GPU_RUN(gpu_test_attention_shape(1, 257, 2, 192, 128, 3));    /* wgmma kernels: many very short documents */
    GPU_RUN(gpu_test_attention_shape(3, 300, 16, 192, 128, 37));  /* persistent forward: 144 work items, more than SMs */
    GPU_RUN(gpu_test_fold_rope(2, 300, 3, 128, 64, 128, 0));
    GPU_RUN(gpu_test_fold_rope(2, 300, 3, 128, 64, 128, 40));
    GPU_RUN(gpu_test_fold_rope(3, 1000, 16, 128, 64, 128, 0));   /* persistent forward: more work items than SMs */
    GPU_RUN(gpu_test_fold_rope(1, 257, 2, 64, 64, 128, 3));
    GPU_RUN(gpu_test_moe_ops());
    GPU_RUN(gpu_test_gmm_dw_sumsq(8, 48, 64, 400));      /* few rows per expert: no row splits */
    GPU_RUN(gpu_test_gmm_dw_sumsq(2, 64, 64, 16384));    /* few tiles, many rows: split rows, reduce kernel */
    GPU_RUN(gpu_test_gmm_dw_sumsq(64, 1408, 256, 6144));
    GPU_RUN(gpu_test_gmm_dw_sumsq(16, 1408, 512, 8000));  /* an odd number of m tiles, an even one of k tiles */
    GPU_RUN(gpu_test_gmm_dw_sumsq(8, 256, 320, 3000));    /* a ragged k tile */
    GPU_RUN(gpu_test_gmm_dw_sumsq(2, 256, 256, 16384));   /* two m tiles per expert, row splits */
    {
        static const int c5[5] = {0, 17, 0, 200, 1}, c3[3] = {130, 0, 70};
        static const int c12[12] = {301, 0, 129, 1, 640, 77, 0, 1500, 255, 256, 63, 400};
        GPU_RUN(gpu_test_gmm_shapes(5, 72, 40, c5));       /* dims under one tile, idle experts, single rows */
        GPU_RUN(gpu_test_gmm_shapes(3, 136, 264, c3));     /* ragged last row / column tiles               */
        GPU_RUN(gpu_test_gmm_shapes(12, 200, 328, c12));   /* unequal experts, one heavy, rows around 64 and 128 multiples */
        static const int c6[6] = {65, 0, 700, 16, 129, 48};
        GPU_RUN(gpu_test_gmm_shapes(6, 72, 264, c6));      /* one m tile, a second k tile 8 columns wide */
    }
    GPU_RUN(gpu_test_loss_and_optimizer());
    GPU_RUN(gpu_test_multi_tensor());
    GPU_RUN(gpu_test_adamw_bf16());
    GPU_RUN(gpu_test_whole_steps());
    GPU_RUN(gpu_test_mtp());
    GPU_RUN(gpu_test_fp8_steps());
    GPU_RUN(gpu_test_fold_rope_steps(0));
    GPU_RUN(gpu_test_fold_rope_steps(1));
    GPU_RUN(gpu_test_recompute());
    GPU_RUN(gpu_test_doc_mask_steps());
    GPU_RUN(gpu_test_tuning());
    GPU_RUN(gpu_test_multi_rank());
    GPU_RUN(gpu_test_moe_chunks());
    GPU_RUN(gpu_test_resume(MT_F32));
    GPU_RUN(gpu_test_resume(MT_BF16));
    /* FP8 last: a kernel that traps (k_gmm_wgmma's stalled pipeline) leaves the context unusable */
    GPU_RUN(gpu_test_fp8_quant());
    GPU_RUN(gpu_test_fp8_quant_both());
    GPU_RUN(gpu_test_fp8_quant_swiglu());
    GPU_RUN(gpu_test_fp8_moe_forms());
    GPU_RUN(gpu_test_fp8_dense(200, 272, 336));   /* partial 128-blocks in every dimension */
    GPU_RUN(gpu_test_fp8_dense(256, 256, 384));
    {
        static const int f5[5] = {0, 17, 300, 128, 1}, f3[3] = {130, 0, 70};
        static const int f4[4] = {700, 1, 0, 385};
        /* k_gmm_simple, k_gmm_wgmma<128>, k_gmm_wgmma<192>, k_gmm_fast<128>, k_gmm_fast<256> (dW: <128>), the latter
           with direct stores */
        static const int order[6] = {1, 0, 2, 3, 4, 5};
        for (int i = 0; i < 6; i++) {
            GPU_RUN(gpu_test_fp8_grouped(5, 144, 272, f5, order[i], 0));   /* an empty expert, single rows, ragged tiles */
            GPU_RUN(gpu_test_fp8_grouped(3, 256, 128, f3, order[i], 0));
            GPU_RUN(gpu_test_fp8_grouped(4, 400, 656, f4, order[i], 0));   /* several tiles, a partial last reduction block */
        }
        for (int i = 1; i < 6; i++) {   /* the persistent kernels, each CTA many tiles */
            GPU_RUN(gpu_test_fp8_grouped(5, 144, 272, f5, order[i], 2));
            GPU_RUN(gpu_test_fp8_grouped(4, 400, 656, f4, order[i], 3));
        }
    }
#undef GPU_RUN
    mt_cuda_destroy(CU);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

#elif MT_TEST_F64
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
    mt_cpu_attention_forward(NULL, c->o0, c->o1, c->a, c->b, c->c, c->i0, c->B, c->T, c->H, c->K, c->dv, c->scale);
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
static double L_ce(void *p) { gc *c = (gc *)p; mt_real loss; mt_cpu_cross_entropy_forward(NULL, &loss, c->o1, c->a, c->i0, c->N, c->V, c->T); return (double)loss; }
/* The cross-entropy on c->E vocab shards: logits c->a [N,V] cut into column blocks, each shard's stats,
 * then the combine; the lse lands in c->o1. */
static double L_ce_shards(void *p) {
    gc *c = (gc *)p;
    int S = c->E, Vl = c->V / S;
    mt_real *blk = alloc_real((int64_t)c->N * Vl), *st = alloc_real((int64_t)S * c->N * 3), loss;
    for (int k = 0; k < S; k++) {
        for (int n = 0; n < c->N; n++) memcpy(blk + n * Vl, c->a + n * c->V + k * Vl, sizeof(mt_real) * (size_t)Vl);
        mt_cpu_ce_stats(st + (int64_t)k * c->N * 3, blk, c->i0, c->N, Vl, k * Vl);
    }
    mt_cpu_ce_combine(&loss, c->o1, st, c->i0, S, c->N, c->N);
    free(blk); free(st);
    return (double)loss;
}

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
        mt_cpu_attention_backward(NULL, dQ, dK, dV, c.a, c.b, c.c, c.o0, c.o1, c.r0, c.i0, c.B, c.T, c.H, c.K, c.dv, c.scale);
        e1 = fd_error(L_attn, &c, c.a, nq, dQ, 300); e2 = fd_error(L_attn, &c, c.b, nq, dK, 300); e3 = fd_error(L_attn, &c, c.c, nv, dV, 300);
        report("gradcheck attention (Q, K, V)", e1 < GC_TOL && e2 < GC_TOL && e3 < GC_TOL, "rel err %.2e %.2e %.2e", e1, e2, e3);
        free(c.a); free(c.b); free(c.c); free(c.o0); free(c.o1); free(c.r0); free(dQ); free(dK); free(dV);
    }

    /* document-masked attention: several packed documents per sequence, length-1 ones too */
    {
        memset(&c, 0, sizeof c); c.B = 2; c.T = 7; c.H = 2; c.K = 6; c.dv = 4; c.scale = 0.5f;
        int64_t n = c.B * c.T, nq = n * c.H * c.K, nv = n * c.H * c.dv;
        const int32_t tok[14] = {1, 9, 2, 3, 9, 4, 5,   9, 9, 1, 2, 3, 9, 1}, want[14] = {0, 0, 2, 2, 2, 5, 5,   0, 1, 2, 2, 2, 2, 6};
        c.i0 = (int32_t *)calloc((size_t)n, 4);
        mt_cpu_doc_starts(c.i0, tok, (int)n, c.T, 9);
        int starts_ok = !memcmp(c.i0, want, sizeof want);
        c.a = alloc_real(nq); c.b = alloc_real(nq); c.c = alloc_real(nv); c.o0 = alloc_real(nv); c.o1 = alloc_real(n * c.H); c.r0 = alloc_real(nv);
        mt_real *dQ = alloc_real(nq), *dK = alloc_real(nq), *dV = alloc_real(nv);
        fill_normal(c.a, nq, 1); fill_normal(c.b, nq, 1); fill_normal(c.c, nv, 1); fill_normal(c.r0, nv, 1);
        L_attn(&c);
        mt_cpu_attention_backward(NULL, dQ, dK, dV, c.a, c.b, c.c, c.o0, c.o1, c.r0, c.i0, c.B, c.T, c.H, c.K, c.dv, c.scale);
        e1 = fd_error(L_attn, &c, c.a, nq, dQ, 400); e2 = fd_error(L_attn, &c, c.b, nq, dK, 400); e3 = fd_error(L_attn, &c, c.c, nv, dV, 400);
        report("gradcheck document-masked attention (Q, K, V)", starts_ok && e1 < GC_TOL && e2 < GC_TOL && e3 < GC_TOL,
               "doc starts %s; rel err %.2e %.2e %.2e", starts_ok ? "ok" : "WRONG", e1, e2, e3);
        free(c.a); free(c.b); free(c.c); free(c.o0); free(c.o1); free(c.r0); free(c.i0); free(dQ); free(dK); free(dV);
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
    mt_cpu_cross_entropy_backward(NULL, dl, c.a, c.o1, c.i0, c.N, c.V, 1.0 / c.N);
    e1 = fd_error(L_ce, &c, c.a, 28, dl, 28);
    report("gradcheck cross-entropy", e1 < GC_TOL, "rel err %.2e", e1);
    {   /* rows whose target is -1 are left out (multi-token prediction past a sequence's end): the mean over the
         * counted rows, the backward scaled by a weight over that count, zero on the rows left out */
        int32_t keep = c.i0[1];
        c.i0[1] = -1; c.T = 3;
        L_ce(&c);
        mt_cpu_cross_entropy_backward(NULL, dl, c.a, c.o1, c.i0, c.N, c.V, 1.0 / 3);
        double em = fd_error(L_ce, &c, c.a, 28, dl, 28), z = 0;
        for (int v = 0; v < 7; v++) z += fabs((double)dl[7 + v]);
        report("gradcheck cross-entropy with a row left out", em < GC_TOL && z == 0, "rel err %.2e; |dlogits| of the row %.1e", em, z);
        c.i0[1] = keep; c.T = 0;
    }
    /* the same loss on 3 vocab shards (tensor parallelism): each shard's backward from the combined lse */
    {
        mt_real loss1, *lse1 = alloc_real(4), *blk = alloc_real(4 * 4), *dblk = alloc_real(4 * 4), *dv = alloc_real(4 * 12);
        gc v;
        memset(&v, 0, sizeof v); v.N = 4; v.V = 12; v.E = 3;
        v.a = alloc_real(48); v.o1 = alloc_real(4); v.i0 = c.i0;
        fill_normal(v.a, 48, 2);
        c.i0[2] = 11; c.i0[3] = 4;   /* targets on the last shard and on a middle one */
        double lv = L_ce_shards(&v);
        mt_cpu_cross_entropy_forward(NULL, &loss1, lse1, v.a, v.i0, v.N, v.V, v.N);
        for (int k = 0; k < 3; k++) {
            for (int n = 0; n < 4; n++) memcpy(blk + n * 4, v.a + n * 12 + k * 4, sizeof(mt_real) * 4);
            mt_cpu_ce_shard_backward(dblk, blk, v.o1, v.i0, 4, 4, k * 4, 1.0 / 4);
            for (int n = 0; n < 4; n++) memcpy(dv + n * 12 + k * 4, dblk + n * 4, sizeof(mt_real) * 4);
        }
        e2 = fd_error(L_ce_shards, &v, v.a, 48, dv, 48);
        e3 = fabs(lv - (double)loss1) / fabs((double)loss1);
        report("gradcheck cross-entropy on 3 vocab shards", e2 < GC_TOL && e3 < 1e-14, "rel err %.2e; loss vs unsharded %.1e", e2, e3);
        free(lse1); free(blk); free(dblk); free(dv); free(v.a); free(v.o1);
    }
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
    return st.loss + mt_runtime_graph(m->fwd)->cfg.mtp_weight * st.mtp_loss;   /* what the train graph differentiates */
}
/* A well-conditioned point: matrices with std 1/sqrt(fan_in) (so attention
 * and routing are far from uniform and every gradient is O(1)), norm
 * weights near 1, and a small random expert bias. */
static void init_well_conditioned(const mt_graph *g, mt_runtime *rt) {
    for (int i = 0; i < g->n_values; i++) {
        const mt_value *v = &g->values[i];
        if (v->role != MT_ROLE_PARAM) continue;
        mt_real *x = (mt_real *)mt_runtime_value(rt, i);
        int64_t n = mt_value_numel_max(g, v);
        if (strstr(v->name, "e_score_correction_bias")) fill_normal(x, n, 0.1);
        else if (v->ndim == 1) for (int64_t j = 0; j < n; j++) x[j] = (mt_real)(1 + 0.2 * mt_rng_normal(&R));
        else fill_normal(x, n, 1.0 / sqrt((double)v->dims[v->ndim - 1]));
    }
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
    mt_step_stats st;
    if (rt) init_well_conditioned(&gt, rt);
    if (!rt || !fw || mt_runtime_step(rt, tok, tgt, 0, &hp, &st, &e) || mt_runtime_copy_params(fw, rt, &e)) {
        report(name, 0, "setup failed");
        return;
    }
    model_ctx m = {fw, tok, tgt};
    double worst = 0;
    char worst_name[MT_NAME_LEN] = "";
    int checked = 0;
    for (int k = 0; k < gt.n_nodes; k++) {   /* each parameter's whole gradient: the one its AdamW reads (a weight used twice,
                                               * as MTP uses the embedding and lm_head, sums partial ones first) */
        if (gt.nodes[k].op != MT_OP_ADAMW) continue;
        int i = gt.nodes[k].in[1];
        const mt_value *pv = &gt.values[gt.nodes[k].in[0]];
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
    small_config(&c);
    c.load_balance_coeff = 0;
    c.doc_mask = 1;
    {   /* an end-of-text token that occurs in the batch: several documents per sequence */
        int32_t tok[16], tgt[16];
        make_batch(&c, 0, tok, tgt);
        c.eot_id = tok[2];
    }
    gradcheck_model("gradcheck whole model (document mask)", &c);
    /* multi-token prediction: eh_proj, enorm, hnorm, shared_head.norm and the MTP blocks, and what the MTP
     * losses add to the main model's gradients (its last hidden state, the embedding, lm_head) */
    small_config(&c);
    c.load_balance_coeff = 0;
    c.mtp_layers = 2; c.mtp_weight = 0.7f;
    gradcheck_model("gradcheck whole model (2 MTP depths)", &c);
    c.doc_mask = 1;
    {
        int32_t tok[16], tgt[16];
        make_batch(&c, 0, tok, tgt);
        c.eot_id = tok[2];
    }
    c.mtp_layers = 1; c.n_dense_layers = c.n_layers;   /* a dense main model: its MTP block is still MoE */
    gradcheck_model("gradcheck whole model (MTP, document mask, dense main blocks)", &c);
    /* each MoE layer in 2 chunks of tokens (--moe-chunks 2): the chunks' row ranges, zero rows and summed parts;
     * an odd token count makes the chunks unequal (7 and 8 of 15) */
    small_config(&c);
    c.load_balance_coeff = 0;
    moe_chunks = 2;
    gradcheck_model("gradcheck whole model (MoE in 2 chunks of tokens)", &c);
    c.seq_len = 5; c.batch = 3; c.original_seq_len = 5;
    gradcheck_model("gradcheck whole model (MoE in 2 chunks of tokens: 7 and 8 of 15)", &c);
    moe_chunks = 1;
}

/* Packed documents: with doc_mask, a sequence holding several documents gives
 * each document exactly the logits, hence the loss, it gets alone at the start
 * of a sequence (RoPE scores depend only on relative positions). The same
 * weights without the mask must fail the check for every document that does
 * not open its sequence, or the test would prove nothing. */
static int run_forward_logits(mt_runtime *rt, const mt_graph *g, const int32_t *tok, const int32_t *tgt, mt_real *logits) {
    mt_step_stats st;
    mt_err e;
    if (mt_runtime_step(rt, tok, tgt, 0, NULL, &st, &e) || mt_runtime_read(rt, g->io[MT_IO_LOGITS], logits, &e)) {
        printf("  forward: %s\n", e.msg);
        return -1;
    }
    return 0;
}
static double doc_loss(const mt_real *logits, const int32_t *tgt, int first, int len, int V) {
    double sum = 0;
    for (int t = first; t < first + len; t++) {
        const mt_real *l = logits + (int64_t)t * V;
        double mx = l[0], z = 0;
        for (int v = 1; v < V; v++) if (l[v] > mx) mx = l[v];
        for (int v = 0; v < V; v++) z += exp((double)l[v] - mx);
        sum += mx + log(z) - (double)l[tgt[t]];
    }
    return sum / len;
}
static void test_doc_packing(void) {
    mt_config c, cn;
    mt_err e;
    small_config(&c);
    c.seq_len = 16; c.original_seq_len = 16; c.batch = 2; c.load_balance_coeff = 0;
    c.doc_mask = 1; c.eot_id = 0;
    cn = c; cn.doc_mask = 0;
    mt_graph gf, gn;
    if (compile_cpu(&gf, &c, MT_GRAPH_FORWARD, 1, &e) || compile_cpu(&gn, &cn, MT_GRAPH_FORWARD, 1, &e)) { report("document packing", 0, "%s", e.msg); return; }
    mt_runtime *fw = make_runtime(&gf, 1, 1, 7), *fn = make_runtime(&gn, 1, 1, 7);
    if (!fw || !fn) { report("document packing", 0, "runtime"); return; }
    init_well_conditioned(&gf, fw);
    if (mt_runtime_copy_params(fn, fw, &e)) { report("document packing", 0, "%s", e.msg); return; }
    enum { T = 16, N = 32, V = 32, ND = 5 };
    /* (sequence, first position, length): three documents, then two */
    const int docs[ND][3] = {{0, 0, 5}, {0, 5, 6}, {0, 11, 5}, {1, 0, 3}, {1, 3, 13}};
    int32_t tok[N], tgt[N], atok[N], atgt[N];
    for (int i = 0; i < N; i++) { tok[i] = 1 + (int32_t)(mt_rng_u64(&R) % (V - 1)); tgt[i] = (int32_t)(mt_rng_u64(&R) % V); }
    for (int d = 0; d < ND; d++)   /* every document but the last of its sequence ends with end-of-text */
        if (docs[d][1] + docs[d][2] < T) tok[docs[d][0] * T + docs[d][1] + docs[d][2] - 1] = 0;
    mt_real *packed = alloc_real((int64_t)N * V), *plain = alloc_real((int64_t)N * V), *alone = alloc_real((int64_t)N * V);
    int ok = !run_forward_logits(fw, &gf, tok, tgt, packed) && !run_forward_logits(fn, &gn, tok, tgt, plain);
    double worst = 0, worst_logit = 0, least_plain = INFINITY;
    for (int d = 0; ok && d < ND; d++) {
        int first = docs[d][0] * T + docs[d][1], len = docs[d][2];
        for (int i = 0; i < N; i++) { atok[i] = 1 + (int32_t)(mt_rng_u64(&R) % (V - 1)); atgt[i] = (int32_t)(mt_rng_u64(&R) % V); }
        memcpy(atok, tok + first, sizeof(int32_t) * (size_t)len);   /* alone, at the start of sequence 0 */
        memcpy(atgt, tgt + first, sizeof(int32_t) * (size_t)len);
        if (run_forward_logits(fw, &gf, atok, atgt, alone)) { ok = 0; break; }
        double la = doc_loss(alone, atgt, 0, len, V), lp = doc_loss(packed, tgt, first, len, V), ln = doc_loss(plain, tgt, first, len, V);
        if (fabs(lp - la) > worst) worst = fabs(lp - la);
        for (int i = 0; i < len * V; i++)
            if (fabs((double)packed[(int64_t)first * V + i] - alone[i]) > worst_logit) worst_logit = fabs((double)packed[(int64_t)first * V + i] - alone[i]);
        if (docs[d][1] > 0 && fabs(ln - la) < least_plain) least_plain = fabs(ln - la);
    }
    report("packed documents = each document alone (doc_mask)", ok && worst < 1e-11 && worst_logit < 1e-10 && least_plain > 1e-4,
           "worst |loss diff| %.1e, logit diff %.1e; without the mask the later documents differ by >= %.1e", worst, worst_logit, least_plain);
    free(packed); free(plain); free(alone);
    mt_runtime_destroy(fw); mt_runtime_destroy(fn);
    mt_graph_free(&gf); mt_graph_free(&gn);
}

static void test_multirank_f64(void) {
    mr_equivalence(1, 2, 1, 3, 2e-15, 2e-15, 5e-15, 5e-13);
    mr_equivalence(1, 2, 2, 3, 2e-15, 2e-15, 5e-15, 5e-13);
    mr_equivalence(1, 4, 4, 3, 2e-15, 2e-15, 5e-15, 5e-13);
    mr_equivalence(1, 8, 8, 3, 2e-15, 2e-15, 5e-15, 5e-13);
    mr_equivalence(2, 2, 2, 3, 2e-15, 2e-15, 5e-15, 5e-13);
    mr_moments = MT_BF16;                    /* bf16 moments: FSDP shards of them too, the same bounds */
    mr_equivalence(1, 2, 1, 3, 2e-15, 2e-15, 5e-15, 5e-13);
    mr_equivalence(1, 4, 4, 3, 2e-15, 2e-15, 5e-15, 5e-13);
    mr_equivalence(2, 2, 2, 3, 2e-15, 2e-15, 5e-15, 5e-13);
    mr_equivalence(1, 4, 4, 20, 2e-15, 2e-15, 1e-14, 5e-13);
    mr_moments = MT_F32;
    mr_equivalence_tp(1, 2, 1, 20, 1e-12);   /* tp 2 */
    mr_equivalence_tp(2, 2, 1, 20, 1e-12);   /* tp 2 x dp_shard 2 */
    mr_equivalence_tp(1, 2, 2, 20, 1e-12);   /* tp 2 x ep 2: experts across tp */
    mr_equivalence_tp(4, 2, 4, 20, 1e-12);   /* the seeds' mesh: dp_shard 4 x tp 2 x ep 4 */
    mr_q_lora = 24;                          /* the low-rank query (q_a replicated, q_b column-parallel) */
    mr_equivalence_tp(2, 2, 2, 20, 1e-12);
    mr_q_lora = 0;
    mr_mtp = 2;                              /* multi-token prediction (and document masks): FSDP + EP, then tp; the */
    mr_equivalence(1, 4, 4, 3, 2e-15, 2e-15, 1e-13, 5e-12);   /* norm's and weights' bounds allow for the sums' orders */
    mr_equivalence_tp(2, 2, 2, 20, 1e-12);
    mr_mtp = 0;
    /* MoE in 2 chunks of tokens: float64 rounding of the experts' weight-gradient sums, carried by 10 steps (measured:
     * losses 1.5e-16, grad norms 1.9e-16, weights 2.1e-14; bounds 10 times that) */
    mc_vs_whole(1, 1, 1, 1, 10, 1e-15, 2e-15, 2e-13);
    mc_vs_whole(1, 2, 2, 0, 10, 1e-15, 2e-15, 2e-13);
    mc_vs_whole(1, 4, 2, 0, 10, 1e-15, 2e-15, 2e-13);
    mc_vs_whole_n(3, 1, 2, 2, 0, 10, 1e-15, 2e-15, 2e-13);   /* 3 chunks of 64 tokens: 21, 21, 22 */
}
int main(void) {
    mt_rng_seed(&R, 42);
    test_gradcheck_ops();
    test_gradcheck_model();
    test_adamw_reference();
    test_doc_packing();
    test_multirank_f64();
    test_recompute_bitwise();
    test_fold_rope();
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

#else /* float32 tests */

/* A per-process scratch path in /tmp: concurrent test runs do not collide. */
static const char *TP(const char *name) {
    static char buf[8][256];
    static int k;
    char *b = buf[k++ % 8];
    snprintf(b, 256, "/tmp/mt_%ld_%s", (long)getpid(), name);
    return b;
}

/* Run n steps; losses[i] out. Returns 0 on success. */
static int run_steps_(mt_runtime *rt, const mt_config *c, int step0, int n, double *losses, const mt_hparams *hp, int quiet);
static int run_steps(mt_runtime *rt, const mt_config *c, int step0, int n, double *losses, const mt_hparams *hp) {
    return run_steps_(rt, c, step0, n, losses, hp, 0);
}
static int run_steps_quiet(mt_runtime *rt, const mt_config *c, int step0, int n, double *losses, const mt_hparams *hp) {
    return run_steps_(rt, c, step0, n, losses, hp, 1);
}
static int run_steps_(mt_runtime *rt, const mt_config *c, int step0, int n, double *losses, const mt_hparams *hp, int quiet) {
    int64_t N = (int64_t)c->batch * c->seq_len;
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)N), *tgt = (int32_t *)malloc(sizeof(int32_t) * (size_t)N);
    mt_err e;
    int rc = 0;
    for (int s = 0; s < n && !rc; s++) {
        mt_step_stats st;
        make_batch(c, step0 + s, tok, tgt);
        if (mt_runtime_step(rt, tok, tgt, step0 + s, hp, &st, &e)) { if (!quiet) printf("  step: %s\n", e.msg); rc = -1; }
        else losses[s] = st.loss;
    }
    free(tok); free(tgt);
    return rc;
}



/* ======================================================================
 * the header's op index
 * ==================================================================== */

static int oi_word(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }
/* name, as a whole word followed by '(' (a definition, declaration or call), in text outside [skip0, skip1) */
static int oi_called(const char *text, size_t skip0, size_t skip1, const char *name) {
    size_t n = strlen(name);
    for (const char *p = strstr(text, name); p; p = strstr(p + 1, name)) {
        size_t at = (size_t)(p - text);
        if ((at >= skip0 && at < skip1) || (at > 0 && oi_word(p[-1]))) continue;
        if (p[n] == '(') return 1;
    }
    return 0;
}
static char *oi_read(const char *path) {   /* the file, NUL-terminated; NULL if unreadable */
    uint8_t *b = NULL;
    size_t n = 0;
    mt_err e;
    if (mt_read_file(path, &b, &n, &e)) return NULL;
    char *s = (char *)malloc(n + 1);
    if (s) { memcpy(s, b, n); s[n] = 0; }
    free(b);
    return s;
}
static int oi_op(const char *w) {   /* the op named w, or -1 */
    for (int i = 0; i < MT_NOPS; i++) if (!strcmp(mt_ops[i].name, w)) return i;
    return -1;
}

/* moetrain.h's op index (the comment after the table of contents) cannot rot: every op of MT_OPS has
 * its two lines there, in MT_OPS order; every op it names is an op; every function it names (mt_...)
 * is defined, declared or called in moetrain.h outside the index or in moetrain_kernels.cu. */
/* The expert exchange's layout (mt_ep_layout), which the device-side exchange
 * runs on the GPU: on random count matrices (empty experts and ranks
 * included), every sender's dispatch chunks must land each row exactly where
 * the CPU engine (mt__cpu_ep) puts it (an owner's rows expert-major, inside an
 * expert in sender order), cover the owner's rows once, and stay inside the
 * planned bound; and combine must send every row back to the slot it came from. */
static void test_ep_layout(void) {
    static const int Ps[] = {1, 2, 3, 4, 8}, Els[] = {1, 2, 5};
    int cases = 0, bad = 0;
    char why[200] = "";
    for (int pi = 0; pi < 5; pi++)
        for (int ei = 0; ei < 3; ei++)
            for (int rep = 0; rep < 4; rep++) {
                int P = Ps[pi], El = Els[ei], E = P * El;
                int32_t *M = (int32_t *)calloc((size_t)P * E, sizeof(int32_t));
                int32_t *src = (int32_t *)calloc((size_t)E + 1, sizeof(int32_t)), *dst = (int32_t *)calloc((size_t)E, sizeof(int32_t));
                int64_t cap = 0;   /* the plan's bound on an owner's rows: every sender's rows */
                for (int i = 0; i < P * E; i++) M[i] = rep == 3 && i % 3 ? 0 : (int32_t)(mt_rng_u64(&R) % 7);
                for (int s = 0; s < P; s++) { int64_t t = 0; for (int j = 0; j < E; j++) t += M[s * E + j]; if (t > cap) cap = t; }
                cap *= P;
                /* the CPU engine's order: owner p's row list of (sender, sender's row) */
                int64_t *ref = (int64_t *)malloc(sizeof(int64_t) * (size_t)(cap + 1) * P), *got = (int64_t *)malloc(sizeof(int64_t) * (size_t)(cap + 1) * P);
                int64_t *nref = (int64_t *)calloc((size_t)P, sizeof(int64_t));
                for (int p = 0; p < P; p++)
                    for (int e = 0; e < El; e++)
                        for (int s = 0; s < P; s++) {
                            int64_t off = 0;
                            for (int j = 0; j < p * El + e; j++) off += M[s * E + j];
                            for (int k = 0; k < M[s * E + p * El + e]; k++) ref[p * (cap + 1) + nref[p]++] = (int64_t)s << 32 | (off + k);
                        }
                for (int64_t i = 0; i < (cap + 1) * P; i++) got[i] = -1;
                for (int s = 0; s < P && !bad; s++) {   /* dispatch: sender s's chunks */
                    mt_ep_layout(M, P, El, s, 1, src, dst);
                    for (int c = 0; c < E && !bad; c++) {
                        int p = mt_ep_chunk_peer(1, c, P, El);
                        for (int64_t r = src[c]; r < src[c + 1]; r++) {
                            int64_t d = dst[c] + (r - src[c]);
                            if (d < 0 || d >= cap || got[p * (cap + 1) + d] != -1) { bad = 1; snprintf(why, sizeof why, "P %d El %d: sender %d row %lld lands outside or twice", P, El, s, (long long)r); break; }
                            got[p * (cap + 1) + d] = (int64_t)s << 32 | r;
                        }
                    }
                }
                for (int p = 0; p < P && !bad; p++)
                    for (int64_t i = 0; i < nref[p] && !bad; i++)
                        if (got[p * (cap + 1) + i] != ref[p * (cap + 1) + i]) { bad = 1; snprintf(why, sizeof why, "P %d El %d: owner %d row %lld differs from the CPU engine's", P, El, p, (long long)i); }
                for (int p = 0; p < P && !bad; p++) {   /* combine: owner p's rows go back where they came from */
                    mt_ep_layout(M, P, El, p, 0, src, dst);
                    if (src[E] != nref[p]) { bad = 1; snprintf(why, sizeof why, "P %d El %d: owner %d combines %d rows, holds %lld", P, El, p, src[E], (long long)nref[p]); }
                    for (int c = 0; c < E && !bad; c++)
                        for (int64_t r = src[c]; r < src[c + 1]; r++) {
                            int64_t from = ref[p * (cap + 1) + r];
                            if ((int)(from >> 32) != mt_ep_chunk_peer(0, c, P, El) || (from & 0xffffffff) != dst[c] + (r - src[c])) {
                                bad = 1; snprintf(why, sizeof why, "P %d El %d: owner %d row %lld goes back to the wrong place", P, El, p, (long long)r); break;
                            }
                        }
                }
                cases++;
                free(M); free(src); free(dst); free(ref); free(got); free(nref);
            }
    report("expert exchange layout (mt_ep_layout) = the CPU engine's order, each row once, combine its inverse", !bad, "%d cases%s%s", cases,
           bad ? ": " : "", why);
}

static void test_op_index(void) {
    char *H = oi_read("moetrain.h"), *K = oi_read("moetrain_kernels.cu");
    const char *b = H ? strstr(H, "/* OP INDEX") : NULL, *end = b ? strstr(b, "*/") : NULL;
    const char *table = b && end ? strstr(b, "\n * op ") : NULL;
    if (!H || !K || !table || table > end) {
        report("op index: every op listed, every name exists", 0, "%s", !H || !K ? "run from the repository root: moetrain.h or "
               "moetrain_kernels.cu unreadable" : "no OP INDEX block with its ' * op ' header in moetrain.h");
        free(H); free(K);
        return;
    }
    size_t skip0 = (size_t)(b - H), skip1 = (size_t)(end - H);
    char bad[400] = "";
    int rows = 0, names = 0, missing = 0, line = 0;
#define OI_BAD(...) do { size_t l_ = strlen(bad); if (l_ < sizeof bad - 1) snprintf(bad + l_, sizeof bad - l_, __VA_ARGS__); } while (0)
    /* the table: after its two header lines, an op's line (the op first) and its CPU/CUDA line */
    const char *p = strchr(table + 1, '\n');
    p = p ? strchr(p + 1, '\n') : NULL;
    for (; p && p < end; p = strchr(p + 1, '\n'), line++) {
        const char *q = p + 1;
        if (strncmp(q, " * ", 3)) { OI_BAD(" line %d is not ' * ...';", line); break; }
        q += 3;
        char w[64];
        int n = 0;
        while (oi_word(q[n]) && n < 63) { w[n] = q[n]; n++; }
        w[n] = 0;
        if (line % 2 == 0) {
            if (!strcmp(w, "") && strstr(q, "(end of the op index)") == q) break;
            if (rows >= MT_NOPS || strcmp(w, mt_ops[rows].name)) OI_BAD(" row %d is '%s', MT_OPS has %s there;", rows, w, rows < MT_NOPS ? mt_ops[rows].name : "nothing");
            rows++;
        } else if (n) {
            OI_BAD(" the line after %s starts with '%s';", rows ? mt_ops[rows - 1].name : "?", w);
        }
        /* upper-case words on table lines are ops */
        for (const char *r = q; *r && *r != '\n'; r++) {
            if (!(*r >= 'A' && *r <= 'Z') || (r > q && oi_word(r[-1]))) continue;
            int m = 0;
            while (oi_word(r[m]) && m < 63) { w[m] = r[m]; m++; }
            w[m] = 0;
            if (oi_op(w) < 0) OI_BAD(" '%s' is not an op;", w);
            r += m - 1;
        }
    }
    if (rows != MT_NOPS) OI_BAD(" %d rows for %d ops;", rows, MT_NOPS);
    /* every mt_... name in the whole block */
    for (const char *r = b; r < end; r++) {
        if (strncmp(r, "mt_", 3) || (r > H && oi_word(r[-1]))) continue;
        char w[64];
        int m = 0;
        while (oi_word(r[m]) && m < 63) { w[m] = r[m]; m++; }
        w[m] = 0;
        r += m - 1;
        if (w[m - 1] == '_') continue;   /* a family: mt_cpu_*, mt__check_* */
        names++;
        if (oi_called(H, skip0, skip1, w) || oi_called(K, 0, 0, w)) continue;
        missing++;
        if (!strstr(bad, w)) OI_BAD(" %s not found;", w);
    }
#undef OI_BAD
    report("op index: every op listed, every name exists", !bad[0] && names > 100,
           "%d ops, %d names cited, %d not found%s", rows, names, missing, bad);
    free(H); free(K);
}

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

/* doc_mask: config checks, one DOC_STARTS node that every attention (forward
 * and backward) reads, through the passes and an artifact round trip */
static void test_doc_mask_graph(void) {
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "tiny", &e);
    int v1 = !mt_config_set(&c, "doc-mask", "1", &e) && mt_config_validate(&c, &e) && strstr(e.msg, "eot_id");
    c.eot_id = c.vocab_size;
    int v2 = mt_config_validate(&c, &e) != 0;
    c.eot_id = 10;
    int v3 = !mt_config_validate(&c, &e);
    mt_graph g, gl;
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("doc_mask graph", 0, "%s", e.msg); return; }
    int docs = 0, doc_v = -1, fwd = 0, bwd = 0, wired = 0;
    for (int i = 0; i < g.n_nodes; i++)
        if (g.nodes[i].op == MT_OP_DOC_STARTS) { docs++; doc_v = g.nodes[i].out[0]; wired += g.nodes[i].in[0] == g.io[MT_IO_TOKENS]; }
    for (int i = 0; i < g.n_nodes; i++) {
        if (g.nodes[i].op == MT_OP_ATTENTION) { fwd++; wired += g.nodes[i].in[3] == doc_v; }
        if (g.nodes[i].op == MT_OP_ATTENTION_BWD) { bwd++; wired += g.nodes[i].in[6] == doc_v; }
    }
    uint8_t *bytes = NULL;
    size_t len = 0;
    int rt_ok = !mt_artifact_write(&g, &bytes, &len, &e) && !mt_artifact_read(&gl, bytes, len, &e);
    if (rt_ok) {
        rt_ok = gl.cfg.doc_mask == 1 && gl.cfg.eot_id == 10 && gl.n_nodes == g.n_nodes && !memcmp(gl.nodes, g.nodes, sizeof(mt_node) * (size_t)g.n_nodes);
        mt_graph_free(&gl);
    }
    free(bytes);
    report("doc_mask: config checks, DOC_STARTS feeds every attention", v1 && v2 && v3 && docs == 1 && fwd == c.n_layers && bwd == c.n_layers &&
           wired == 1 + 2 * c.n_layers && rt_ok, "%d DOC_STARTS, %d/%d attention fwd/bwd, %d wired, artifact round trip %s",
           docs, fwd, bwd, wired, rt_ok ? "ok" : e.msg);
    mt_graph_free(&g);
}

/* FSDP on dp_shard 2: the loss's seed carries the 1/DP (no all-reduce or rescaling of a gradient afterwards), the
 * embedding table is not gathered again for the backward, and where the ranks' tokens are fewer than the table's
 * rows its rows are looked up in the shards (EMBED on the shard, the rows reduce-scattered; the backward: the token
 * gradients all-gathered, EMBED_BWD into the shard) instead of gathering the table and reduce-scattering its
 * gradient. Which way follows from the sizes (mt__embed_in_shards): a 4096-entry vocabulary and 2 x 64 tokens
 * take the shards; tiny's 256 entries and 2 x 512 tokens the whole table. */
static void test_fsdp_gradient_graph(void) {
    static const struct { int vocab, batch, by_tokens; } cs[] = {{4096, 1, 1}, {256, 8, 0}};
    for (int k = 0; k < 2; k++) {
        mt_config c;
        mt_err e;
        mt_mesh m;
        mt_target t;
        mt_passes p;
        mt_graph g;
        mt_config_preset(&c, "tiny", &e);
        c.vocab_size = cs[k].vocab; c.batch = cs[k].batch;
        mt_target_cpu(&t); mt_passes_all(&p);
        if (mt_mesh_init(&m, 1, 2, 1, 1, &e) || mt_compile(&g, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e)) {
            report("FSDP gradients: graph builds", 0, "%s", e.msg);
            return;
        }
        int emb_shard = 0, emb_whole = 0, fwd_shard = 0, gathers_dp = 0, scatters_dp = 0, rs_emb = 0, ag_emb = 0, regather = 0, grad_ar = 0, ce = 0, bad = 0;
        float seed = -1;
        for (int i = 0; i < g.n_nodes; i++) {
            const mt_node *n = &g.nodes[i];
            const char *in0 = n->in[0] >= 0 ? g.values[n->in[0]].name : "", *out0 = n->out[0] >= 0 ? g.values[n->out[0]].name : "";
            if (mt_check_node(&g, n, &e)) bad++;
            if (n->op == MT_OP_EMBED_BWD) {
                if (n->iattr[2] == 2 && !strcmp(out0, "grad.model.embed_tokens.weight")) emb_shard++; else emb_whole++;
            }
            if (n->op == MT_OP_EMBED && n->iattr[2] == 2 && strstr(g.values[n->in[1]].name, "embed_tokens")) fwd_shard++;
            if (n->op == MT_OP_SP_GATHER && n->queue == MT_Q_DP) gathers_dp++;
            if (n->op == MT_OP_SP_SCATTER && n->queue == MT_Q_DP) scatters_dp++;
            if (n->op == MT_OP_REDUCE_SCATTER && strstr(in0, "embed_tokens")) rs_emb++;
            if (n->op == MT_OP_ALLGATHER && strstr(out0, "embed_tokens")) { ag_emb++; regather += n->phase == MT_PHASE_BACKWARD; }
            if (n->op == MT_OP_ALLREDUCE && g.values[n->in[0]].role == MT_ROLE_GRAD) grad_ar++;
            if (n->op == MT_OP_CROSS_ENTROPY) { ce++; seed = n->fattr[0]; }
        }
        int ok = !bad && ce == 1 && seed == 0.5f && !regather && !grad_ar &&
                 (cs[k].by_tokens ? emb_shard == 1 && fwd_shard == 1 && !emb_whole && gathers_dp == 2 && scatters_dp == 1 && !rs_emb && !ag_emb
                                  : !emb_shard && !fwd_shard && emb_whole == 1 && !gathers_dp && !scatters_dp && rs_emb == 1 && ag_emb == 1);
        char nm[160];
        snprintf(nm, sizeof nm, "FSDP gradients, dp_shard 2, vocab %d x %d tokens a rank: 1/DP at the seed, embedding %s", c.vocab_size,
                 c.batch * c.seq_len, cs[k].by_tokens ? "looked up in the shards" : "gathered whole");
        report(nm, ok, "seed %g, EMBED shard %d, EMBED_BWD shard %d whole %d, DP row gathers %d scatters %d, table gathers %d (backward %d) "
               "reduce-scatters %d, gradient all-reduces %d, bad %d", seed, fwd_shard, emb_shard, emb_whole, gathers_dp, scatters_dp, ag_emb, regather,
               rs_emb, grad_ar, bad);
        mt_graph_free(&g);
    }
}

static void test_graph_structure(void) {
    mt_config c;
    mt_err e;
    mt_graph g;
    mt_config_preset(&c, "tiny", &e);
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 0, &e)) { report("graph builds", 0, "%s", e.msg); return; }
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
    /* 2 MoE layers: counts + dispatch + combine forward, dispatch + combine backward; on one rank the DP queue
     * holds the loss's mean and the 2 layers' counts (no gradient all-reduce: no group of several ranks) */
    report("graph: forward, backward, optimizer, collectives", !bad && ep == 10 && sym_ep == 10 && adamw == n_trainable &&
           bias == 2 && dp == 1 + 2 && g.n_forward_nodes > 0 && g.n_forward_nodes < g.n_nodes,
           "%d nodes (%d forward), %d EP, %d DP collectives, %d AdamW", g.n_nodes, g.n_forward_nodes, ep, dp, adamw);
    int eager_nodes = g.n_nodes;
    mt_graph_free(&g);
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("graph compiles", 0, "%s", e.msg); return; }
    /* elision: on ep = 1 the expert exchange is a copy onto itself; it goes, nothing else does */
    int ep_left = 0, bad2 = 0, dyn = 0;
    for (int i = 0; i < g.n_nodes; i++) { ep_left += g.nodes[i].queue == MT_Q_EP; bad2 += mt_check_node(&g, &g.nodes[i], &e) != 0; }
    for (int i = 0; i < g.n_values; i++) dyn += g.values[i].dims[0] < 0;
    report("elision pass: no expert exchange on ep = 1", ep_left == 0 && !bad2 && !dyn,
           "%d EP nodes left, %d symbolic row counts, %d -> %d nodes (with fusion)", ep_left, dyn, eager_nodes, g.n_nodes);
    /* a node with a wrong shape is refused by the check the loader runs */
    mt_node n = g.nodes[5];
    int was = n.op;
    n.out[0] = n.in[0] == 0 ? 1 : 0;
    int refused = mt_check_node(&g, &n, &e) != 0;
    report("node shape check refuses a miswired node", refused, "%s: %s", mt_ops[was].name, e.msg);
    int fused_f = 0, fused_b = 0;
    for (int i = 0; i < g.n_nodes; i++) { fused_f += g.nodes[i].op == MT_OP_ADD_RMSNORM; fused_b += g.nodes[i].op == MT_OP_RMSNORM_BWD_ADD; }
    report("fusion pass: residual add + RMSNorm, fwd and bwd", fused_f == 6 && fused_b == 6, "%d forward, %d backward fusions", fused_f, fused_b);
    int acc_mm = 0, dx2 = 0, adds = 0;
    for (int i = 0; i < g.n_nodes; i++) {
        acc_mm += g.nodes[i].op == MT_OP_MATMUL_ACC; dx2 += g.nodes[i].op == MT_OP_GMM_DX2; adds += g.nodes[i].op == MT_OP_ADD;
    }
    /* per MoE layer: shared + routed (fwd); q/kv, shared gate/up, router (bwd); dense layer: q/kv, gate/up */
    report("fusion pass: GEMM + ADD -> epilogue sums, expert dX pairs", acc_mm == 2 * 4 + 2 && dx2 == 2 && adds == 2,
           "%d MATMUL_ACC, %d GMM_DX2, %d ADD left", acc_mm, dx2, adds);
    {   /* per MoE layer the routed experts' gate, up and SwiGLU become one GMM_GLU; the shared experts' and the
           dense layer's SwiGLU stay (their GEMMs are dense); the backward still reads g and u */
        int glu = 0, gmm = 0, sw = 0, swb = 0, okg = 1;
        for (int i = 0; i < g.n_nodes; i++) {
            const mt_node *x = &g.nodes[i];
            glu += x->op == MT_OP_GMM_GLU; gmm += x->op == MT_OP_GMM; sw += x->op == MT_OP_SWIGLU;
            if (x->op != MT_OP_SWIGLU_BWD) continue;
            swb++;
            for (int k = 0; k < 2; k++) {   /* the routed experts' g and u come from a GMM_GLU before it */
                int from = -1;
                for (int j = 0; j < i; j++)
                    for (int o = 0; o < g.nodes[j].n_out; o++) if (g.nodes[j].out[o] == x->in[k]) from = j;
                okg &= from >= 0;
            }
        }
        report("fusion pass: the experts' gate/up GEMMs + SwiGLU -> GMM_GLU", okg && glu == 2 && gmm == 2 && sw == 3 && swb == 5,
               "%d GMM_GLU, %d GMM (down) and %d SWIGLU left, %d SWIGLU_BWD", glu, gmm, sw, swb);
    }
    {   /* on the CUDA target, expert weight gradients' norm partials come from the dW GEMM; over 2 data-parallel
           ranks (gradients all-reduced first) they do not */
        mt_graph gc2;
        mt_mesh m1;
        mt_target tc;
        mt_passes pa;
        mt_target_cuda(&tc, "sm_90a");
        mt_passes_all(&pa);
        int sq[2] = {0, 0}, plain[2] = {0, 0}, okc = 1;
        for (int dp = 1; dp <= 2 && okc; dp++) {
            okc = !mt_mesh_init(&m1, 1, dp, 1, 1, &e) && !mt_compile(&gc2, &c, &m1, &tc, MT_GRAPH_TRAIN, &pa, &e);
            for (int i = 0; okc && i < gc2.n_nodes; i++) {
                sq[dp - 1] += gc2.nodes[i].op == MT_OP_GMM_DW_SQ;
                plain[dp - 1] += gc2.nodes[i].op == MT_OP_SUMSQ && gc2.nodes[i].iattr[0];
                okc &= !mt_check_node(&gc2, &gc2.nodes[i], &e);
            }
            if (okc) mt_graph_free(&gc2);
        }
        report("fusion pass (CUDA): expert dW GEMMs give the norm partials", okc && sq[0] == 6 && plain[0] == 6 && !sq[1] && !plain[1],
               "1 rank: %d GMM_DW_SQ, %d SUMSQ of partials; 2 ranks: %d, %d%s%s", sq[0], plain[0], sq[1], plain[1], okc ? "" : ": ", okc ? "" : e.msg);
    }
    mt_graph_free(&g);

    /* precompiling for a larger mesh: coordinates are symbols, never literals */
    mt_mesh m;
    mt_target t;
    mt_passes p;
    mt_target_cpu(&t);
    mt_passes_all(&p);
    mt_mesh_init(&m, 1, 4, 1, 4, &e);
    int ok = mt_compile(&g, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) == 0;
    ep = 0;
    if (ok) {
        ok = g.syms[3].max == 3 && !strcmp(g.syms[3].name, "coord.ep");
        for (int i = 0; i < g.n_nodes; i++) {
            const mt_node *x = &g.nodes[i];
            if (x->op == MT_OP_EP_DISPATCH) ok &= (x->sym_mask >> 4 & 1) && x->iattr[2] == 4 && x->iattr[3] == 2;
            ep += x->queue == MT_Q_EP;
        }
        ok &= ep == 10;   /* over 4 ranks the exchange is real and stays */
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

/* The attention backward in float32 against the same backward written out in float64 (the float64
 * build checks it against finite differences; this checks the arithmetic the float32 build runs):
 * causal and document-masked, forward outputs and the three gradients. */
static mt_real *attn_real(int64_t n) { return (mt_real *)calloc((size_t)n, sizeof(mt_real)); }
static double attn_err(const mt_real *x, const double *ref, int64_t n) {
    double d = 0, m = 1e-300;
    for (int64_t i = 0; i < n; i++) { d = fmax(d, fabs((double)x[i] - ref[i])); m = fmax(m, fabs(ref[i])); if (x[i] != x[i]) d = 1e30; }
    return d / m;
}
static void test_attention_backward_f32(void) {
    enum { B = 2, T = 40, H = 3, DQ = 12, DV = 8 };
    const int64_t N = (int64_t)B * T, nq = N * H * DQ, nv = N * H * DV, nl = N * H;
    const float scale = 1.0f / sqrtf((float)DQ);
    mt_real *Q = attn_real(nq), *K = attn_real(nq), *V = attn_real(nv), *dO = attn_real(nv), *O = attn_real(nv), *L = attn_real(nl);
    mt_real *dQ = attn_real(nq), *dK = attn_real(nq), *dV = attn_real(nv);
    double *rO = (double *)calloc((size_t)nv, 8), *rL = (double *)calloc((size_t)nl, 8), *rdQ = (double *)calloc((size_t)nq, 8),
           *rdK = (double *)calloc((size_t)nq, 8), *rdV = (double *)calloc((size_t)nv, 8), *p = (double *)calloc(T, 8);
    int32_t ds[2 * T];
    mt_rng keep = R;   /* fixed inputs, whatever ran before; the other tests' draws unchanged */
    mt_rng_seed(&R, 2024);
    for (int masked = 0; masked < 2; masked++) {
        fill_normal(Q, nq, 1.5); fill_normal(K, nq, 1.5); fill_normal(V, nv, 1.0); fill_normal(dO, nv, 1.0);
        for (int b = 0; b < B; b++)   /* documents of lengths 1, 7, 13, ... (masked), or none */
            for (int i = 0, start = 0, len = 1; i < T; i++) {
                if (masked && i - start == len) { start = i; len += 6; }
                ds[b * T + i] = masked ? start : 0;
            }
        mt_cpu_attention_forward(NULL, O, L, Q, K, V, masked ? ds : NULL, B, T, H, DQ, DV, scale);
        mt_cpu_attention_backward(NULL, dQ, dK, dV, Q, K, V, O, L, dO, masked ? ds : NULL, B, T, H, DQ, DV, scale);
        memset(rdK, 0, sizeof(double) * (size_t)nq); memset(rdV, 0, sizeof(double) * (size_t)nv);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < T; i++) {
                    int64_t ri = ((int64_t)b * T + i) * H + h;
                    const mt_real *q = Q + ri * DQ, *g = dO + ri * DV;
                    int lo = ds[b * T + i];
                    double mx = -1e300, z = 0, dsum = 0;
                    for (int j = lo; j <= i; j++) {   /* s_ij = scale q_i.k_j over the keys it may see */
                        const mt_real *k = K + (((int64_t)b * T + j) * H + h) * DQ;
                        double s = 0;
                        for (int d = 0; d < DQ; d++) s += (double)q[d] * (double)k[d];
                        p[j] = s * (double)scale;
                        mx = fmax(mx, p[j]);
                    }
                    for (int j = lo; j <= i; j++) z += exp(p[j] - mx);
                    rL[ri] = mx + log(z);
                    for (int j = lo; j <= i; j++) p[j] = exp(p[j] - rL[ri]);   /* P_ij */
                    for (int d = 0; d < DV; d++) {
                        double o = 0;
                        for (int j = lo; j <= i; j++) o += p[j] * (double)V[(((int64_t)b * T + j) * H + h) * DV + d];
                        rO[ri * DV + d] = o;
                        dsum += o * (double)g[d];   /* D_i = dO_i . O_i */
                    }
                    for (int d = 0; d < DQ; d++) rdQ[ri * DQ + d] = 0;
                    for (int j = lo; j <= i; j++) {
                        int64_t rj = ((int64_t)b * T + j) * H + h;
                        double dp = 0;
                        for (int d = 0; d < DV; d++) dp += (double)g[d] * (double)V[rj * DV + d];
                        double dsij = p[j] * (dp - dsum) * (double)scale;   /* dS_ij, with the scale of s_ij */
                        for (int d = 0; d < DQ; d++) { rdQ[ri * DQ + d] += dsij * (double)K[rj * DQ + d]; rdK[rj * DQ + d] += dsij * (double)q[d]; }
                        for (int d = 0; d < DV; d++) rdV[rj * DV + d] += p[j] * (double)g[d];
                    }
                }
        double eo = attn_err(O, rO, nv), el = attn_err(L, rL, nl), eq = attn_err(dQ, rdQ, nq), ek = attn_err(dK, rdK, nq), ev = attn_err(dV, rdV, nv);
        const double tol = 2e-6;
        report(masked ? "float32 document-masked attention = float64 reference" : "float32 causal attention = float64 reference",
               eo <= tol && el <= tol && eq <= tol && ek <= tol && ev <= tol,
               "B%d T%d H%d %d/%d; max error / max value: O %.1e, lse %.1e, dQ %.1e, dK %.1e, dV %.1e (bound %.0e)", B, T, H, DQ, DV, eo, el, eq,
               ek, ev, tol);
    }
    free(Q); free(K); free(V); free(dO); free(O); free(L); free(dQ); free(dK); free(dV);
    free(rO); free(rL); free(rdQ); free(rdK); free(rdV); free(p);
    R = keep;
}

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
    /* eager layout: gradients keep their own bytes, so they can be read after the step */
    if (compile_cpu(&gr, &c, MT_GRAPH_TRAIN, 0, &e)) { report("zero-token experts", 0, "%s", e.msg); return; }
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
    char dir[256];
    snprintf(dir, sizeof dir, "%s", TP("ckpt"));
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
    int names = mt__st_open(&s, TP("ckpt/model.safetensors"), 1, &e) == 0;
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
    mt_read_file(TP("ckpt/model.safetensors"), &bytes, &len, &e);
    FILE *f = fopen(TP("bad.safetensors"), "wb");
    fwrite(bytes, 1, len / 2, f);
    fclose(f);
    int r1 = mt_checkpoint_load(b, TP("bad.safetensors"), NULL, &e) != 0;
    char m1[256];
    snprintf(m1, sizeof m1, "%s", e.msg);
    bytes[20] = '{';   /* break the JSON */
    f = fopen(TP("bad.safetensors"), "wb");
    fwrite(bytes, 1, len, f);
    fclose(f);
    int r2 = mt_checkpoint_load(b, TP("bad.safetensors"), NULL, &e) != 0;
    free(bytes);
    mt_config c3 = c;
    c3.dim = 96;
    mt_graph g3;
    compile_cpu(&g3, &c3, MT_GRAPH_TRAIN, 1, &e);
    mt_runtime *d = make_runtime(&g3, 1, 0, 1);
    int r3 = d && mt_checkpoint_load(d, dir, NULL, &e) != 0 && strstr(e.msg, "another model config") && strstr(e.msg, "dim 64 vs 96");
    report("bad checkpoints refused with a reason", r1 && r2 && r3, "%s | %s", m1, e.msg);
    mt_runtime_destroy(d);
    mt_graph_free(&g3);
    remove(TP("bad.safetensors"));
    mt_runtime_destroy(a); mt_runtime_destroy(b);
    mt_graph_free(&g);
}

/* ======================================================================
 * data, schedule, training
 * ==================================================================== */

static void test_data(void) {
    mt_err e;
    const char *p = TP("test.bin");
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
    remove(p);
    p = TP("test.txt");
    f = fopen(p, "wb");
    fputs("hello", f);
    fclose(f);
    int raw = mt_data_load(&d, p, &e) == 0 && d.n == 5 && d.tokens[0] == 'h';
    int32_t tk[8], tg[8];
    int small = raw && mt_data_batch_at(&d, 1, 0, 0, 1, 1, 8, tk, tg, &e) != 0;
    mt_data_free(&d);
    remove(p);
    report("data: llm.c shard, raw bytes, bad header", ok && bad && raw && small, NULL);
    int def = mt_data_default(&d, &e) == 0 && d.n > 100000 && d.max_token < 128;
    mt_data_free(&d);
    report("embedded default corpus", def, NULL);
    {   /* the data order: a permutation per epoch; ranks read disjoint parts of one global batch */
        mt_dataset t;
        int n = 1000, T = 7, W = (n - 1) / T, okp = 1;
        t.n = n; t.max_token = 0;
        t.tokens = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
        for (int i = 0; i < n; i++) t.tokens[i] = i;
        unsigned char *seen = (unsigned char *)calloc((size_t)W, 1);
        for (int ep = 0; ep < 2 && okp; ep++) {
            memset(seen, 0, (size_t)W);
            for (int i = 0; i < W; i++) {
                int64_t w = mt_data_window(&t, 3, (int64_t)ep * W + i, T);
                if (w < 0 || w >= W || seen[w]) { okp = 0; break; }
                seen[w] = 1;
            }
        }
        int differ = mt_data_window(&t, 3, 0, T) != mt_data_window(&t, 4, 0, T) || mt_data_window(&t, 3, 1, T) != mt_data_window(&t, 4, 1, T);
        int32_t one[4 * 7], two[4 * 7], tg1[4 * 7], tg2[4 * 7];
        int same = 1;
        for (int step = 0; step < 5 && same; step++) {
            same = mt_data_batch_at(&t, 9, step, 0, 1, 4, T, one, tg1, &e) == 0 &&
                   mt_data_batch_at(&t, 9, step, 0, 2, 2, T, two, tg2, &e) == 0 &&
                   mt_data_batch_at(&t, 9, step, 1, 2, 2, T, two + 2 * T, tg2 + 2 * T, &e) == 0 &&
                   !memcmp(one, two, sizeof one) && !memcmp(tg1, tg2, sizeof tg1) && tg1[0] == one[0] + 1 && one[0] % T == 0;
        }
        int refuse = mt_data_batch_at(&t, 9, 0, 2, 2, 2, T, two, tg2, &e) != 0;
        report("data order: per-epoch permutation, ranks share one global batch", okp && differ && same && refuse,
               "%d windows", W);
        free(seen); free(t.tokens);
    }

    float hp[MT_HP_COUNT];
    mt_hparams h;
    mt_hparams_default(&h);
    h.lr = 1; h.warmup_steps = 10; h.decay_steps = 110; h.min_lr_ratio = 0.1f;
    mt_hparams_pack(&h, hp);
    double l0 = mt_lr_at(hp, 0), l9 = mt_lr_at(hp, 9), l60 = mt_lr_at(hp, 60), l110 = mt_lr_at(hp, 110);
    report("lr schedule: warmup, cosine, floor", fabs(l0 - 0.1) < 1e-9 && l9 == 1 && fabs(l60 - 0.55) < 1e-9 && fabs(l110 - 0.1) < 1e-7,
           "%.3f %.3f %.3f %.3f", l0, l9, l60, l110);
}

/* An llm.c-style shard: a 256-int32 header (magic, version, count as given) and n tokens of width bytes. */
static void write_shard(const char *path, int32_t magic, int32_t version, int32_t count, int n, int width) {
    int32_t hdr[256];
    memset(hdr, 0, sizeof hdr);
    hdr[0] = magic; hdr[1] = version; hdr[2] = count;
    FILE *f = fopen(path, "wb");
    fwrite(hdr, 4, 256, f);
    for (int i = 0; i < n; i++) { uint32_t t = (uint32_t)(i * 7 % 97); fwrite(&t, (size_t)width, 1, f); }
    fclose(f);
}

/* The data format: a token shard only by its exact header, a near miss refused (never trained on as
 * bytes by accident) unless raw bytes are asked for, and what was read named. */
static void test_data_format(void) {
    mt_err e;
    mt_dataset d;
    char desc[600], why[600] = "";
    const char *shard = TP("fmt_ok.bin"), *near = TP("fmt_near.bin"), *ver = TP("fmt_ver.bin"), *lay = TP("fmt_layout.dat");
    const char *rawbin = TP("fmt_raw.bin"), *txt = TP("fmt_text.txt"), *cut = TP("fmt_cut.bin");
    write_shard(shard, 20240520, 1, 300, 300, 2);
    write_shard(near, 20240521, 1, 300, 300, 2);   /* the magic one off */
    write_shard(ver, 20240801, 1, 300, 300, 4);    /* a Llama-3 shard's magic with another version */
    write_shard(lay, 12345, 1, 300, 300, 2);       /* a shard's layout under an unknown magic */
    write_shard(cut, 20240520, 1, 400, 300, 2);    /* a shard cut short */
    FILE *f = fopen(rawbin, "wb");
    for (int i = 0; i < 3000; i++) fputc(i % 200, f);
    fclose(f);
    f = fopen(txt, "wb");
    for (int i = 0; i < 100; i++) fputs("Once upon a time. ", f);
    fclose(f);
    /* exact: a shard, named so */
    int ok = !mt_data_load(&d, shard, &e) && d.format == MT_DATA_BIN && d.token_bytes == 2 && d.n == 300 && d.tokens[2] == 14 &&
             strstr(mt_data_describe(&d, shard, desc, sizeof desc), "(llm.c token shard, uint16, 300 tokens)");
    mt_data_free(&d);
    ok = ok && !mt_data_load_as(&d, shard, MT_DATA_BIN, &e) && d.format == MT_DATA_BIN;
    mt_data_free(&d);
    /* near misses: refused in auto, with the way out in the message; read as bytes when asked */
    const char *nm[4] = {near, ver, lay, rawbin};
    int refused = 0, as_raw = 0, not_bin = 0;
    for (int i = 0; i < 4; i++) {
        if (mt_data_load(&d, nm[i], &e) && strstr(e.msg, "--data-format raw") && strstr(e.msg, "looks like")) refused++;
        else { snprintf(why, sizeof why, "'%s' %s", nm[i], e.msg); mt_data_free(&d); }
        struct stat st;
        stat(nm[i], &st);
        if (!mt_data_load_as(&d, nm[i], MT_DATA_RAW, &e) && d.format == MT_DATA_RAW && d.n == (int64_t)st.st_size &&
            strstr(mt_data_describe(&d, nm[i], desc, sizeof desc), "(raw bytes,"))
            as_raw++;
        mt_data_free(&d);
        if (mt_data_load_as(&d, nm[i], MT_DATA_BIN, &e) && strstr(e.msg, "not an llm.c")) not_bin++;
        else mt_data_free(&d);
    }
    /* nothing like a shard: raw bytes without a word */
    int text = !mt_data_load(&d, txt, &e) && d.format == MT_DATA_RAW && d.n == 1800 &&
               !strcmp(mt_data_describe(&d, txt, desc, sizeof desc), TP("fmt_text.txt (raw bytes, 1,800 tokens)"));
    mt_data_free(&d);
    int trunc = mt_data_load(&d, cut, &e) && strstr(e.msg, "is truncated: 1624 bytes, its header says 1824");
    char tmsg[300];
    snprintf(tmsg, sizeof tmsg, "%s", e.msg);
    int emb = !mt_data_default(&d, &e) && d.format == MT_DATA_EMBEDDED &&
              !strncmp(mt_data_describe(&d, NULL, desc, sizeof desc), "embedded default corpus (", 25);
    mt_data_free(&d);
    int k = -1;
    int fmt = !mt_data_format_parse("auto", &k) && k == MT_DATA_AUTO && !mt_data_format_parse("bin", &k) && k == MT_DATA_BIN &&
          !mt_data_format_parse("raw", &k) && k == MT_DATA_RAW && mt_data_format_parse("text", &k);
    report("data: near-miss shards refused, raw when asked", ok && refused == 4 && as_raw == 4 && not_bin == 4 && text && fmt,
           "%d of 4 refused, %d read raw, %d refused as bin%s%s", refused, as_raw, not_bin, why[0] ? ": " : "", why);
    report("data: what was read is named", ok && text && emb, NULL);
    report("data: a shard cut short is called truncated", trunc, "\"%s\"", tmsg);
    remove(shard); remove(near); remove(ver); remove(lay); remove(rawbin); remove(txt); remove(cut);
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
    double first = 0, last = 0;
    int ok = rt != NULL;
    for (int s = 0; s < 60 && ok; s++) {
        mt_step_stats st = {0};
        ok = mt_data_batch_at(&d, 5, s, 0, 1, c.batch, c.seq_len, tok, tgt, &e) == 0 && mt_runtime_step(rt, tok, tgt, s, &hp, &st, &e) == 0;
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
 * exact resume, atomic checkpoints, refusals, non-finite values
 * ==================================================================== */

/* Scratch directories carry the process id: concurrent test runs do not collide. */
static void scratch_dir(char *out, size_t n, const char *tag) {
    snprintf(out, n, "/tmp/mt_%s_%ld_XXXXXX", tag, (long)getpid());
    if (!mkdtemp(out)) snprintf(out, n, "/tmp/mt_%s_%ld", tag, (long)getpid());
}
static void remove_tree(const char *d) {
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", d);
    if (system(cmd)) printf("  could not remove %s\n", d);
}
static int count_files(const char *dir, const char *prefix, const char *suffix) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        size_t l = strlen(e->d_name), ls = strlen(suffix);
        n += !strncmp(e->d_name, prefix, strlen(prefix)) && l >= ls && !strcmp(e->d_name + l - ls, suffix);
    }
    if (d) closedir(d);
    return n;
}

/* Weights (masters and compute copies) and AdamW moments of two runtimes of one graph: bitwise equal? */
static int same_state(mt_runtime *a, mt_runtime *b) {
    const mt_graph *g = mt_runtime_graph(a);
    mt_err e;
    int same = 1, n = 0;
    for (int i = 0; same && i < g->n_values; i++) {
        const mt_value *v = &g->values[i];
        if (v->role != MT_ROLE_PARAM && v->role != MT_ROLE_OPT) continue;
        void *x = malloc((size_t)v->nbytes), *y = malloc((size_t)v->nbytes);
        same = !mt_runtime_read(a, i, x, &e) && !mt_runtime_read(b, i, y, &e) && !memcmp(x, y, (size_t)v->nbytes);
        free(x); free(y);
        n++;
    }
    return same && n > 0;
}

/* n steps on the data loader's batches from step0; losses and grad norms out. */
static int data_steps(mt_runtime *rt, const mt_dataset *d, uint64_t seed, int step0, int n, const mt_hparams *hp, double *loss, double *gnorm) {
    const mt_config *c = &mt_runtime_graph(rt)->cfg;
    int64_t N = (int64_t)c->batch * c->seq_len;
    int32_t *tok = (int32_t *)malloc(4 * (size_t)N), *tgt = (int32_t *)malloc(4 * (size_t)N);
    mt_err e;
    int rc = 0;
    for (int s = 0; s < n && !rc; s++) {
        mt_step_stats st;
        if (mt_data_batch_at(d, seed, step0 + s, 0, 1, c->batch, c->seq_len, tok, tgt, &e) || mt_runtime_step(rt, tok, tgt, step0 + s, hp, &st, &e)) {
            printf("  step %d: %s\n", step0 + s, e.msg);
            rc = -1;
        } else {
            loss[s] = st.loss;
            if (gnorm) gnorm[s] = st.grad_norm;
        }
    }
    free(tok); free(tgt);
    return rc;
}

static void small_tiny(mt_config *c) {
    mt_err e;
    mt_config_preset(c, "tiny", &e);
    c->batch = 2; c->seq_len = 16; c->original_seq_len = 16;
}

/* The optimizer file of a checkpoint: how many of its tensors have safetensors dtype `dtype` (of *n). */
static int opt_file_dtype(const char *dir, int dtype, int *n) {
    char path[700];
    mt__st s, so;
    mt_err e;
    int k = 0;
    *n = 0;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (mt__st_open(&s, path, 0, &e)) return 0;
    const char *o = mt__st_meta(&s, "mt.optimizer");
    snprintf(path, sizeof path, "%s/%s", dir, o ? o : "none");
    mt__st_free(&s);
    if (mt__st_open(&so, path, 0, &e)) return 0;
    for (int i = 0; i < so.n; i++) k += so.t[i].dtype == dtype;
    *n = so.n;
    mt__st_free(&so);
    return k;
}

static void test_resume_exact_for(int moments) {
    mt_config c;
    mt_err e;
    mt_graph g;
    int bf = moments == MT_BF16;
    char name[80];
    snprintf(name, sizeof name, "exact resume: 20 steps = 10 + save + load + 10%s", bf ? ", bf16 moments" : "");
    rc_tiny(&c);
    if (compile_cpu_moments(&g, &c, MT_GRAPH_TRAIN, 1, moments, &e)) { report(name, 0, "%s", e.msg); return; }
    mt_dataset d;
    mt_data_default(&d, &e);
    mt_hparams hp;
    mt_hparams_default(&hp);
    hp.warmup_steps = 4; hp.decay_steps = 20;   /* steps 10..19 are on the cosine */
    enum { S = 20, H = 10 };
    double la[S], na[S], lb[S], nb[S], lc[S], nc[S];
    char dir[256];
    scratch_dir(dir, sizeof dir, "resume");
    mt_runtime *a = make_runtime(&g, 2, 0, 7), *b = make_runtime(&g, 2, 0, 7), *r = make_runtime(&g, 1, 1, 12345);
    int ok = a && b && r && !data_steps(a, &d, 7, 0, S, &hp, la, na) && !data_steps(b, &d, 7, 0, H, &hp, lb, nb);
    mt_run_state rs, back;
    mt_run_state_init(&rs);
    rs.step = H; rs.total_steps = S; rs.seed = 7; rs.hp = hp; rs.data_tokens = d.n; rs.data_hash = mt_data_hash(&d);
    snprintf(rs.preset, sizeof rs.preset, "tiny");
    int step = -1;
    ok = ok && !mt_checkpoint_save_run(b, dir, &rs, &e) && !mt_checkpoint_read_run(dir, &back, &e) && !mt_checkpoint_load(r, dir, &step, &e) &&
         step == H;
    int same_run = ok && back.has_settings && back.step == H && back.total_steps == S && back.seed == 7 && !memcmp(&back.hp, &hp, sizeof hp) &&
                   back.data_tokens == d.n && back.data_hash == rs.data_hash && !strcmp(back.preset, "tiny") && back.moments == moments;
    int n_opt = 0, n_bf = opt_file_dtype(dir, MT__ST_BF16, &n_opt);   /* the moments keep their dtype on disk */
    same_run &= n_opt > 20 && n_bf == (bf ? n_opt : 0);
    /* the resumed run: a fresh runtime (other init seed, 1 thread, poisoned arena) driven only by the checkpoint */
    ok = ok && !data_steps(r, &d, back.seed, back.step, back.total_steps - back.step, &back.hp, lc + H, nc + H);
    memcpy(lc, lb, sizeof(double) * H); memcpy(nc, nb, sizeof(double) * H);
    int same = ok && bitwise_equal(la, lc, S) && bitwise_equal(na, nc, S) && same_state(a, r);
    report(name, same && same_run, "losses, grad norms, weights, moments bitwise; loss %.6f at step 11; %d of %d optimizer tensors BF16%s%s",
           ok ? la[H] : 0.0, n_bf, n_opt, ok ? "" : ": ", ok ? "" : e.msg);
    remove_tree(dir);
    mt_runtime_destroy(a); mt_runtime_destroy(b); mt_runtime_destroy(r);
    mt_data_free(&d);
    mt_graph_free(&g);
}

static void test_resume_exact(void) {
    test_resume_exact_for(MT_F32);
    test_resume_exact_for(MT_BF16);
}

/* Moments saved in one dtype load into a graph of the other: fp32 -> bf16 rounded to nearest even,
 * bf16 -> fp32 exactly; weights bitwise either way; the run state says which dtype was saved. */
static void test_checkpoint_moments(void) {
    mt_config c;
    mt_err e;
    mt_graph gf, gb;
    small_tiny(&c);
    if (compile_cpu_moments(&gf, &c, MT_GRAPH_TRAIN, 1, MT_F32, &e) || compile_cpu_moments(&gb, &c, MT_GRAPH_TRAIN, 1, MT_BF16, &e)) {
        report("checkpoint moments convert between fp32 and bf16", 0, "%s", e.msg);
        return;
    }
    mt_hparams hp;
    mt_hparams_default(&hp);
    double l[4];
    char d1[256], d2[256];
    scratch_dir(d1, sizeof d1, "momf"); scratch_dir(d2, sizeof d2, "momb");
    mt_runtime *a = make_runtime(&gf, 2, 0, 3), *b = make_runtime(&gb, 2, 0, 99), *x = make_runtime(&gb, 2, 0, 3), *y = make_runtime(&gf, 2, 0, 99);
    mt_run_state r1, r2;
    int ok = a && b && x && y && !run_steps(a, &c, 0, 3, l, &hp) && !mt_checkpoint_save(a, d1, 3, &e) && !mt_checkpoint_load(b, d1, NULL, &e) &&
             !run_steps(x, &c, 0, 3, l, &hp) && !mt_checkpoint_save(x, d2, 3, &e) && !mt_checkpoint_load(y, d2, NULL, &e) &&
             !mt_checkpoint_read_run(d1, &r1, &e) && !mt_checkpoint_read_run(d2, &r2, &e);
    int64_t n = 0, rounded = 0, widened = 0, inexact = 0, params = 1;
    for (int i = 0; ok && i < gf.n_values; i++) {
        const mt_value *v = &gf.values[i];
        int j = mt_graph_find(&gb, v->name);
        if (j < 0) { ok = 0; break; }
        if (v->role == MT_ROLE_PARAM && v->param < 0)
            params &= !memcmp(mt_runtime_value(a, i), mt_runtime_value(b, j), (size_t)v->nbytes) &&
                      !memcmp(mt_runtime_value(x, j), mt_runtime_value(y, i), (size_t)v->nbytes);
        if (v->role != MT_ROLE_OPT) continue;
        const float *f32 = (const float *)mt_runtime_value(a, i), *w32 = (const float *)mt_runtime_value(y, i);
        const uint16_t *b16 = (const uint16_t *)mt_runtime_value(b, j), *x16 = (const uint16_t *)mt_runtime_value(x, j);
        for (int64_t k = 0; k < mt_value_numel_max(&gf, v); k++, n++) {
            rounded += b16[k] == mt_bf16_round(f32[k]);
            widened += w32[k] == mt_bf16_float(x16[k]);
            inexact += mt_bf16_float(b16[k]) != f32[k];
        }
    }
    ok = ok && !run_steps(b, &c, 3, 1, l, &hp) && isfinite(l[0]) && !run_steps(y, &c, 3, 1, l + 1, &hp) && isfinite(l[1]);
    report("checkpoint moments convert between fp32 and bf16", ok && n > 0 && rounded == n && widened == n && inexact > n / 2 && params &&
           r1.moments == MT_F32 && r2.moments == MT_BF16,
           "%lld moments: fp32 -> bf16 rounded to nearest even %lld (%lld of them inexact), bf16 -> fp32 exact %lld; weights %s; "
           "saved dtype read back %s, %s%s", (long long)n, (long long)rounded, (long long)inexact, (long long)widened, params ? "bitwise" : "DIFFER",
           r1.moments == MT_F32 ? "f32" : "?", r2.moments == MT_BF16 ? "bf16" : "?", ok ? "" : e.msg);
    remove_tree(d1); remove_tree(d2);
    mt_runtime_destroy(a); mt_runtime_destroy(b); mt_runtime_destroy(x); mt_runtime_destroy(y);
    mt_graph_free(&gf); mt_graph_free(&gb);
}

/* Save, then saves that fail or are killed half-way: the last committed checkpoint always loads, whole. */
static void test_checkpoint_atomic(void) {
    mt_config c;
    mt_err e;
    mt_graph g;
    small_tiny(&c);
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("atomic checkpoints", 0, "%s", e.msg); return; }
    mt_hparams hp;
    mt_hparams_default(&hp);
    char dir[256], blocker[320];
    scratch_dir(dir, sizeof dir, "atomic");
    double l[64];
    mt_runtime *a = make_runtime(&g, 1, 0, 3), *ref = make_runtime(&g, 1, 0, 99), *x = make_runtime(&g, 1, 0, 98);
    int ok = a && ref && x && !run_steps(a, &c, 0, 3, l, &hp) && !mt_checkpoint_save(a, dir, 3, &e) && !mt_checkpoint_load(ref, dir, NULL, &e);
    /* a save that fails half-way (model.safetensors cannot be written) */
    snprintf(blocker, sizeof blocker, "%s/model.safetensors.tmp", dir);
    ok = ok && !run_steps(a, &c, 3, 2, l, &hp) && mkdir(blocker, 0755) == 0;
    int failed = ok && mt_checkpoint_save(a, dir, 5, &e) != 0 && e.msg[0];
    char why[300];
    snprintf(why, sizeof why, "%s", e.msg);
    int step = -1;
    int kept = failed && !mt_checkpoint_load(x, dir, &step, &e) && step == 3 && same_state(x, ref);
    rmdir(blocker);
    int again = !mt_checkpoint_save(a, dir, 5, &e) && !mt_checkpoint_load(x, dir, &step, &e) && step == 5 && same_state(x, a) &&
                count_files(dir, "optimizer", ".safetensors") == 1 && count_files(dir, "", ".tmp") == 0;
    report("failed save leaves the previous checkpoint whole", kept && again, "\"%s\"; then saved and tidied", why);

    /* saves killed at arbitrary moments: the reference trajectory from step 5 says what each step's loss must be */
    enum { K = 48 };
    double want[K + 2];
    mt_runtime *tr = make_runtime(&g, 1, 0, 97);
    ok = tr && !mt_checkpoint_load(tr, dir, NULL, &e) && !run_steps(tr, &c, 5, K + 2, want, &hp);
    int rounds = 0, good = ok, seen_mid = 0, steps_seen = 0;
    for (int round = 0; ok && round < 8; round++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {   /* keep training and saving until killed */
            double ll;
            mt_err ce;
            for (int s = 5; s < 5 + K; s++)
                if (run_steps(a, &c, s, 1, &ll, &hp) || mt_checkpoint_save(a, dir, s + 1, &ce)) _exit(3);
            _exit(0);
        }
        struct timespec ts = {0, 4000000L * (round + 1) + 1700000L * (round % 3)};
        nanosleep(&ts, NULL);
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        seen_mid += count_files(dir, "", ".tmp") > 0 || count_files(dir, "optimizer", ".safetensors") > 1;
        mt_runtime *y = make_runtime(&g, 1, 0, 96);
        double got[2];
        int s = -1;
        good &= y && !mt_checkpoint_load(y, dir, &s, &e) && s >= 5 && s < 5 + K && !run_steps(y, &c, s, 2, got, &hp) &&
                got[0] == want[s - 5] && got[1] == want[s - 5 + 1];
        if (!good) printf("  round %d: step %d: %s\n", round, s, e.msg);
        steps_seen += s;
        mt_runtime_destroy(y);
        rounds++;
    }
    report("saves killed mid-way: the last committed checkpoint loads", good && rounds == 8,
           "%d kills (%d left partial files); each load continued the reference run bitwise", rounds, seen_mid);
    remove_tree(dir);
    mt_runtime_destroy(a); mt_runtime_destroy(ref); mt_runtime_destroy(x); mt_runtime_destroy(tr);
    mt_graph_free(&g);
}

/* A safetensors file as the previous moetrain (and other tools) wrote them: no checksums. */
static int write_plain_safetensors(const char *path, const mt__tensor *t, int n, const char *meta) {
    mt__buf h;
    memset(&h, 0, sizeof h);
    mt__jfmt(&h, "{\"__metadata__\":{\"format\":\"pt\"");
    mt__put(&h, meta, strlen(meta));
    mt__put(&h, "}", 1);
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        mt__jfmt(&h, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[", t[i].name);
        for (int d = 0; d < t[i].ndim; d++) mt__jfmt(&h, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        mt__jfmt(&h, "],\"data_offsets\":[%lld,%lld]}", (long long)off, (long long)(off + 4 * t[i].numel));
        off += 4 * t[i].numel;
    }
    mt__put(&h, "}", 1);
    FILE *f = fopen(path, "wb");
    uint8_t len8[8];
    wr64(len8, h.n);
    int ok = f && fwrite(len8, 1, 8, f) == 8 && fwrite(h.p, 1, h.n, f) == h.n;
    for (int i = 0; ok && i < n; i++)
        for (int64_t k = 0; ok && k < t[i].numel; k++) { float x = (float)t[i].src[k]; ok = fwrite(&x, 4, 1, f) == 1; }
    if (f) ok &= !fclose(f);
    free(h.p);
    return ok ? 0 : -1;
}

/* What a checkpoint load refuses, each with a reason. */
static void test_checkpoint_refusals(void) {
    mt_config c;
    mt_err e;
    mt_graph g;
    small_tiny(&c);
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("checkpoint refusals", 0, "%s", e.msg); return; }
    char d1[256], d2[256], p[600], q[600];
    scratch_dir(d1, sizeof d1, "ref1");
    scratch_dir(d2, sizeof d2, "ref2");
    mt_runtime *a = make_runtime(&g, 1, 0, 1), *b = make_runtime(&g, 1, 0, 2);
    double l[2];
    mt_hparams hp;
    mt_hparams_default(&hp);
    int ok = a && b && !run_steps(a, &c, 0, 1, l, &hp) && !mt_checkpoint_save(a, d1, 1, &e) && !mt_checkpoint_save(b, d2, 1, &e);
    /* the optimizer file of another checkpoint, under the name this one expects */
    mt_run_state rs;
    int no_run = ok && !mt_checkpoint_read_run(d1, &rs, &e) && rs.step == 1 && !rs.has_settings;
    snprintf(p, sizeof p, "cp %s/optimizer-step1.safetensors %s/optimizer-step1.safetensors", d2, d1);
    int pair = ok && !system(p) && mt_checkpoint_load(b, d1, NULL, &e) != 0 && strstr(e.msg, "does not belong");
    char m_pair[300];
    snprintf(m_pair, sizeof m_pair, "%s", e.msg);
    /* a missing optimizer file */
    snprintf(p, sizeof p, "%s/optimizer-step1.safetensors", d1);
    remove(p);
    int missing = ok && mt_checkpoint_load(b, d1, NULL, &e) != 0 && strstr(e.msg, "optimizer-step1");
    /* a tensor the model does not have (a well-formed, checksummed file) */
    mt__tensor *t = NULL, *t2;
    mt__staged *st = NULL;
    int n = 0, ns = 0, extra = 0;
    if (ok && !mt__tensors(b, MT_ROLE_PARAM, "", NULL, &t, &n, &st, &ns, &e) && (t2 = (mt__tensor *)realloc(t, sizeof *t * (size_t)(n + 1)))) {
        t = t2;
        t[n] = t[0];
        snprintf(t[n].name, sizeof t[n].name, "model.layers.0.mlp.extra.weight");
        mt__buf meta, file;
        memset(&meta, 0, sizeof meta);
        mt__meta_model(&meta, b, 1, NULL, NULL, 0);
        uint64_t sum;
        snprintf(q, sizeof q, "%s/model.safetensors", d2);
        extra = !mt__st_build(&file, t, n + 1, &meta, &sum, &e) && !mt__write_atomic(q, file.p, file.n, NULL, 0, &e);
        free(meta.p); free(file.p);
        extra = extra && mt_checkpoint_load(b, d2, NULL, &e) != 0 && strstr(e.msg, "not part of this model");
    }
    char m_extra[300];
    snprintf(m_extra, sizeof m_extra, "%s", e.msg);
    free(t);
    mt__staged_free(st, ns);
    report("checkpoint refusals: foreign optimizer, missing file, extra tensor", pair && missing && extra && no_run,
           "%.100s | %.100s", m_pair, m_extra);
    /* the previous format (no checksums, optimizer.safetensors) still loads: weights and moments */
    int legacy = 0;
    mt__tensor *tm = NULL, *tv = NULL, *tp = NULL;
    mt__staged *sm = NULL, *sv = NULL, *sp = NULL;
    int nm = 0, nv = 0, np = 0, nsm = 0, nsv = 0, nsp = 0;
    char d3[256];
    scratch_dir(d3, sizeof d3, "legacy");
    if (ok && !mt__tensors(a, MT_ROLE_PARAM, "", NULL, &tp, &np, &sp, &nsp, &e) && !mt__tensors(a, MT_ROLE_OPT, "exp_avg.", NULL, &tm, &nm, &sm, &nsm, &e) &&
        !mt__tensors(a, MT_ROLE_OPT, "exp_avg_sq.", NULL, &tv, &nv, &sv, &nsv, &e)) {
        mt__tensor *all = (mt__tensor *)malloc(sizeof *all * (size_t)(nm + nv));
        for (int i = 0; i < nm + nv; i++) {
            all[i] = i < nm ? tm[i] : tv[i - nm];
            snprintf(all[i].name, sizeof all[i].name, "%s%.80s", i < nm ? "exp_avg." : "exp_avg_sq.", i < nm ? tm[i].name : tv[i - nm].name);
        }
        char meta[4096] = ",\"mt.step\":\"1\"";
        for (int i = 0; i < mt_n_config_fields; i++) {
            const mt_field *fl = &mt_config_fields[i];
            const void *v = (const char *)&c + fl->offset;
            if (fl->type == MT_FIELD_INT) snprintf(meta + strlen(meta), sizeof meta - strlen(meta), ",\"mt.%s\":\"%d\"", fl->name, *(const int *)v);
            else snprintf(meta + strlen(meta), sizeof meta - strlen(meta), ",\"mt.%s\":\"%.9g\"", fl->name, (double)*(const float *)v);
        }
        snprintf(p, sizeof p, "%s/model.safetensors", d3);
        snprintf(q, sizeof q, "%s/optimizer.safetensors", d3);
        mt_runtime *y = make_runtime(&g, 1, 0, 77);
        int step = -1;
        legacy = y && !write_plain_safetensors(p, tp, np, meta) && !write_plain_safetensors(q, all, nm + nv, "") &&
                 !mt_checkpoint_load(y, d3, &step, &e) && step == 1 && same_state(y, a) && !mt_checkpoint_read_run(d3, &rs, &e) &&
                 !rs.has_settings;
        if (!legacy) printf("  legacy: %s\n", e.msg);
        mt_runtime_destroy(y);
        free(all);
    }
    free(tm); free(tv); free(tp);
    mt__staged_free(sm, nsm); mt__staged_free(sv, nsv); mt__staged_free(sp, nsp);
    report("a checkpoint of the previous format (no checksums) still loads", legacy, NULL);
    remove_tree(d3);
    remove_tree(d1); remove_tree(d2);
    mt_runtime_destroy(a); mt_runtime_destroy(b);
    mt_graph_free(&g);
}

static int write_bytes(const char *path, const uint8_t *b, size_t n) {
    FILE *f = fopen(path, "wb");
    int ok = f && fwrite(b, 1, n, f) == n;
    if (f) ok &= !fclose(f);
    return ok ? 0 : -1;
}
static int exists(const char *dir, const char *name) {
    char p[700];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return !stat(p, &st);
}

/* What interrupted saves leave is removed: when the save directory is prepared, and by the next save. */
static void test_checkpoint_stale_tmp(void) {
    mt_config c;
    mt_err e;
    mt_graph g;
    small_tiny(&c);
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("stale .tmp files", 0, "%s", e.msg); return; }
    char dir[256], p[600];
    scratch_dir(dir, sizeof dir, "stale");
    mt_runtime *a = make_runtime(&g, 1, 0, 1), *b = make_runtime(&g, 1, 0, 2);
    double l[2];
    mt_hparams hp;
    mt_hparams_default(&hp);
    int ok = a && b && !run_steps(a, &c, 0, 1, l, &hp) && !mt_checkpoint_save(a, dir, 1, &e);
    /* stale files of interrupted saves: a killed atomic write's .tmp, a write probe, a sharded save's part */
    static const char *const stale[] = {"model.safetensors.tmp", "optimizer-step9.safetensors.tmp", "config.json.tmp", ".mt-probe-4242.tmp",
                                        ".mt-part-1-of-2"};
    static const char *const kept[] = {"model.safetensors", "optimizer-step1.safetensors", "config.json", "notes.tmp"};
    const uint8_t junk[5] = "junk";
    for (int i = 0; i < 5; i++) { snprintf(p, sizeof p, "%s/%s", dir, stale[i]); ok = ok && !write_bytes(p, junk, 4); }
    snprintf(p, sizeof p, "%s/notes.tmp", dir);
    ok = ok && !write_bytes(p, junk, 4);
    int gone = 0, stay = 0, gone2 = 0;
    if (ok && !mt_checkpoint_prepare_dir(dir, &e)) {
        for (int i = 0; i < 5; i++) gone += !exists(dir, stale[i]);
        for (int i = 0; i < 4; i++) stay += exists(dir, kept[i]);
    }
    int loads = ok && !mt_checkpoint_load(b, dir, NULL, &e) && same_state(a, b);
    for (int i = 0; i < 4; i++) { snprintf(p, sizeof p, "%s/%s", dir, stale[i]); ok = ok && !write_bytes(p, junk, 4); }
    if (ok && !run_steps(a, &c, 1, 1, l, &hp) && !mt_checkpoint_save(a, dir, 2, &e))   /* the next save tidies too */
        for (int i = 0; i < 4; i++) gone2 += !exists(dir, stale[i]);
    report("stale .tmp files and parts of killed saves removed", ok && gone == 5 && stay == 4 && loads && gone2 == 4,
           "%d of 5 removed at start, %d of 4 kept (the checkpoint, notes.tmp), %d of 4 by the next save", gone, stay, gone2);
    remove_tree(dir);
    mt_runtime_destroy(a); mt_runtime_destroy(b);
    mt_graph_free(&g);
}

/* A checkpoint file cut short is called truncated, with its size and the size its header says:
 * cut in the data, in the header, the optimizer file; restored, it loads. */
static void test_checkpoint_truncated(void) {
    mt_config c;
    mt_err e;
    mt_graph g;
    small_tiny(&c);
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("truncated checkpoint files", 0, "%s", e.msg); return; }
    char dir[256], p[600], q[600];
    scratch_dir(dir, sizeof dir, "trunc");
    mt_runtime *a = make_runtime(&g, 1, 0, 1), *b = make_runtime(&g, 1, 0, 2);
    double l[2];
    mt_hparams hp;
    mt_hparams_default(&hp);
    int ok = a && b && !run_steps(a, &c, 0, 2, l, &hp) && !mt_checkpoint_save(a, dir, 2, &e);
    uint8_t *m = NULL, *o = NULL;
    size_t nm = 0, no = 0;
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    snprintf(q, sizeof q, "%s/optimizer-step2.safetensors", dir);
    ok = ok && !mt_read_file(p, &m, &nm, &e) && !mt_read_file(q, &o, &no, &e) && nm > 1000 && no > 1000;
    uint64_t hl = 0;
    for (int i = 0; ok && i < 8; i++) hl |= (uint64_t)m[i] << (8 * i);
    char want[200], m1[400] = "", m2[400] = "", m3[400] = "", m4[400] = "";
    int cut_data = 0, cut_head = 0, cut_cfg = 0, cut_opt = 0, whole = 0;
    if (ok && !write_bytes(p, m, nm - 100)) {
        snprintf(want, sizeof want, "model.safetensors' is truncated: %zu bytes, its header says %zu", nm - 100, nm);
        cut_data = mt_checkpoint_load(b, dir, NULL, &e) && strstr(e.msg, want);
        snprintf(m1, sizeof m1, "%s", e.msg);
        mt_config rc;
        cut_cfg = mt_checkpoint_read_config(dir, &rc, &e) && strstr(e.msg, want);   /* the header alone is read */
        snprintf(m2, sizeof m2, "%s", e.msg);
    }
    if (ok && !write_bytes(p, m, 8 + (size_t)hl / 2)) {
        snprintf(want, sizeof want, "is truncated: %zu bytes, its header says at least %zu", 8 + (size_t)hl / 2, 8 + (size_t)hl);
        cut_head = mt_checkpoint_load(b, dir, NULL, &e) && strstr(e.msg, want);
        snprintf(m3, sizeof m3, "%s", e.msg);
    }
    if (ok && !write_bytes(p, m, nm) && !write_bytes(q, o, no - 4)) {
        snprintf(want, sizeof want, "optimizer-step2.safetensors' is truncated: %zu bytes, its header says %zu", no - 4, no);
        cut_opt = mt_checkpoint_load(b, dir, NULL, &e) && strstr(e.msg, want);
        snprintf(m4, sizeof m4, "%s", e.msg);
    }
    whole = ok && !write_bytes(q, o, no) && !mt_checkpoint_load(b, dir, NULL, &e) && same_state(a, b);
    report("truncated checkpoint files called truncated", cut_data && cut_head && cut_cfg && cut_opt && whole, "\"%s\"%s%s%s%s%s%s",
           m1, cut_cfg ? "" : " | ", cut_cfg ? "" : m2, cut_head ? "" : " | ", cut_head ? "" : m3, cut_opt ? "" : " | ", cut_opt ? "" : m4);
    free(m); free(o);
    remove_tree(dir);
    mt_runtime_destroy(a); mt_runtime_destroy(b);
    mt_graph_free(&g);
}

/* binding.nan_check: silent on healthy steps, names the first op on a sick one. */
static void test_nan_check(void) {
    mt_config c;
    mt_err e;
    mt_graph g;
    small_tiny(&c);
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { report("nan check", 0, "%s", e.msg); return; }
    mt_hparams hp;
    mt_hparams_default(&hp);
    double l1[4], l2[4];
    mt_runtime *a = make_runtime(&g, 1, 1, 4), *b = make_runtime(&g, 1, 0, 4);
    if (!a || !b) { report("nan check", 0, "no runtime"); return; }
    mt_runtime_set_nan_check(a, 1);
    int quiet = !run_steps(a, &c, 0, 4, l1, &hp) && !run_steps(b, &c, 0, 4, l2, &hp) && bitwise_equal(l1, l2, 4);
    /* a NaN weight in layer 1: the first op that reads it is named, with the weight as its non-finite input */
    int w = mt_graph_find(&g, "model.layers.1.self_attn.kv_b_proj.weight");
    mt_real *buf = (mt_real *)malloc((size_t)g.values[w].nbytes);
    mt_runtime_read(a, w, buf, &e);
    mt_real keep = buf[5];
    buf[5] = (mt_real)NAN;
    mt_runtime_write(a, w, buf, &e);
    int32_t tok[32], tgt[32];
    make_batch(&c, 4, tok, tgt);
    int found = mt_runtime_step(a, tok, tgt, 4, &hp, NULL, &e) != 0 && strstr(e.msg, "layer 1") && strstr(e.msg, "MATMUL") &&
                strstr(e.msg, "input already non-finite") && strstr(e.msg, "kv_b_proj");
    char m1[300];
    snprintf(m1, sizeof m1, "%s", e.msg);
    /* an overflow from finite inputs: a huge weight in layer 0 */
    buf[5] = keep;
    mt_runtime_write(a, w, buf, &e);
    int w0 = mt_graph_find(&g, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
    mt_real *big = (mt_real *)malloc((size_t)g.values[w0].nbytes);
    for (int64_t i = 0; i < g.values[w0].nbytes / (int64_t)sizeof(mt_real); i++) big[i] = (mt_real)3e38;
    mt_runtime_write(a, w0, big, &e);
    int over = mt_runtime_step(a, tok, tgt, 4, &hp, NULL, &e) != 0 && strstr(e.msg, "layer 0") && strstr(e.msg, "inputs were finite");
    report("--nan-check: quiet when healthy, names the first bad op", quiet && found && over, "%s | %.120s", m1, e.msg);
    free(buf); free(big);
    mt_runtime_destroy(a); mt_runtime_destroy(b);
    mt_graph_free(&g);
}

/* ======================================================================
 * fuzzing: the artifact loader, the safetensors loader, the data loaders
 * Deterministic (seeded), bounded (a fixed number of inputs, and an alarm),
 * run in a child process so that a signal or a hang is caught and reported
 * with the input that caused it. Every input must be refused with a message,
 * or (data) handled, or be loaded to exactly what the pristine file gives.
 * ==================================================================== */

typedef struct { int32_t kind, target; int64_t index; char msg[112]; } fuzz_rec;   /* child -> parent, 128 bytes */
enum { FZ_PROGRESS, FZ_FAIL, FZ_DONE };
enum { FZ_ARTIFACT, FZ_SAFETENSORS, FZ_DATA, FZ_NTARGETS };
static const char *const fz_names[FZ_NTARGETS] = {"artifact loader", "safetensors loader", "data loaders"};
/* Each input ends one way: refused (with a message); accepted as the pristine input (the change carried no
 * meaning); or accepted as a different input, which only a mutant made consistent again (checksums
 * recomputed) may be, and which must then run safely (a step runs, or is refused with a message) or be
 * read back exactly as written. Anything else is a failure: a crash, a hang, a refusal without a message,
 * a corrupt input accepted, a loaded artifact that is neither its file nor the pristine one. */
typedef struct {
    int fd, target, scale;
    int64_t index, n[FZ_NTARGETS], refused[FZ_NTARGETS], same[FZ_NTARGETS], differ[FZ_NTARGETS], ran, step_refused, fails;
    mt_rng r;
} fuzzer;

static void fz_send(fuzzer *z, int kind, const char *msg) {
    fuzz_rec rec;
    memset(&rec, 0, sizeof rec);
    rec.kind = kind; rec.target = z->target; rec.index = z->index;
    if (msg) snprintf(rec.msg, sizeof rec.msg, "%s", msg);
    if (write(z->fd, &rec, sizeof rec) != (ssize_t)sizeof rec) _exit(4);
}
static void fz_next(fuzzer *z) { z->index++; z->n[z->target]++; fz_send(z, FZ_PROGRESS, NULL); }
static void fz_fail(fuzzer *z, const char *fmt, ...) {
    char m[112];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    z->fails++;
    fz_send(z, FZ_FAIL, m);
}
static uint64_t fz_u(fuzzer *z, uint64_t n) { return n ? mt_rng_u64(&z->r) % n : 0; }
/* 1..4 random bytes set to random values (or bit flips); returns 1 if anything changed */
static int fz_flip(fuzzer *z, uint8_t *b, const uint8_t *orig, size_t len, size_t lo, size_t hi) {
    int k = 1 + (int)fz_u(z, 4);
    for (int i = 0; i < k && hi > lo; i++) {
        size_t at = lo + (size_t)fz_u(z, hi - lo);
        b[at] = fz_u(z, 2) ? (uint8_t)(b[at] ^ (1u << fz_u(z, 8))) : (uint8_t)fz_u(z, 256);
    }
    return memcmp(b, orig, len) != 0;
}
static int fz_write(const char *path, const uint8_t *b, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = n ? fwrite(b, 1, n, f) : 0;
    return (fclose(f) || w != n) ? -1 : 0;
}

/* recompute an artifact's checksums where its table allows (semantic fuzzing) */
static void fix_checksums_safe(uint8_t *b, size_t len) {
    if (len < 24) return;
    uint32_t ns = b[12] | b[13] << 8 | b[14] << 16 | (uint32_t)b[15] << 24;
    if (ns > 64 || 24 + 32 * (size_t)ns + 8 > len) return;
    size_t hdr = 24 + 32 * (size_t)ns + 8;
    for (uint32_t i = 0; i < ns; i++) {
        uint8_t *ent = b + 24 + 32 * i;
        uint64_t off = rd64(ent + 8), l = rd64(ent + 16);
        if (off <= len && l <= len - off) wr64(ent + 24, mt_hash(b + off, (size_t)l, MT_HASH_INIT));
    }
    wr64(b + hdr - 8, mt_hash(b, hdr - 8, MT_HASH_INIT));
}

/* Bytes of an artifact its reader does not interpret, which a mutant made consistent again may change
 * without changing the graph: a config field name's padding after its NUL (the names are compared with
 * strncmp) and the fingerprint's text (its hash is what is checked). */
static void fz_dont_care(const uint8_t *good, size_t len, uint8_t *mask) {
    memset(mask, 0, len);
    size_t cfg = (size_t)rd64(good + 24 + 8), fp = (size_t)rd64(good + 24 + 32 * 8 + 8);   /* sections 1 and 9 */
    uint32_t nf = (uint32_t)good[cfg + 28] | (uint32_t)good[cfg + 29] << 8 | (uint32_t)good[cfg + 30] << 16 | (uint32_t)good[cfg + 31] << 24;
    for (uint32_t i = 0; i < nf && cfg + 32 + 40 * (size_t)(i + 1) <= len; i++) {
        size_t at = cfg + 32 + 40 * (size_t)i, l = strnlen((const char *)good + at, 32);
        for (size_t k = at + l + 1; k < at + 32; k++) mask[k] = 1;
    }
    for (size_t k = fp + 12; k < len; k++) mask[k] = 1;
}

/* base 0: a compiled training step (every kind of input); 1: eager; 2: forward only; 3: a 2-rank mesh
 * with expert parallelism (the exchange nodes and coordinate symbols; loads, cannot run on one rank); 4: every
 * block recomputed (the recompute phase and the choice in the plan) */
static void fuzz_artifact(fuzzer *z, int base) {
    mt_config c;
    mt_err e;
    mt_graph g, out;
    mt_mesh mesh;
    mt_target tgt;
    mt_passes passes;
    small_tiny(&c);
    z->target = FZ_ARTIFACT;
    mt_mesh_single(&mesh);
    mt_target_cpu(&tgt);
    if (base == 1) mt_passes_none(&passes); else mt_passes_all(&passes);
    if (base == 3 && mt_mesh_init(&mesh, 1, 2, 1, 2, &e)) { fz_fail(z, "mesh: %s", e.msg); return; }
    int folded = 0;
    if (base == 4 ? compile_rc(&g, &c, &mesh, -1, 0, &e)   /* every block recomputed */
        : base == 5 ? compile_fold(&g, &c, 0, 1, 0, MT_GRAPH_TRAIN, &folded, &e)   /* RoPE folded: the 10-input nodes */
                    : mt_compile(&g, &c, &mesh, &tgt, base == 2 ? MT_GRAPH_FORWARD : MT_GRAPH_TRAIN, &passes, &e)) { fz_fail(z, "compile: %s", e.msg); return; }
    uint8_t *good;
    size_t len;
    if (mt_artifact_write(&g, &good, &len, &e)) { fz_fail(z, "write: %s", e.msg); mt_graph_free(&g); return; }
    uint8_t *b = (uint8_t *)malloc(2 * len + 64), *canon = (uint8_t *)malloc(len), *dont_care = (uint8_t *)malloc(len);
    fz_dont_care(good, len, dont_care);
    const uint32_t ns = 9;
    const size_t hdr = 24 + 32 * ns + 8;
    int runs = 0;
    /* the oracle: refused with a message; or (checksums fixed) accepted, and then a step runs or is refused */
#define FZ_REFUSED(bytes, n) do { e.msg[0] = 0; \
        if (mt_artifact_read(&out, (bytes), (n), &e) == 0) { mt_graph_free(&out); fz_fail(z, "accepted a corrupt artifact"); } \
        else if (!e.msg[0]) fz_fail(z, "refused without a message"); \
        else z->refused[FZ_ARTIFACT]++; } while (0)
    /* 1. truncated at every section boundary (and a byte either side), through the header, and at random */
    for (uint32_t i = 0; base == 0 && i <= ns; i++) {
        size_t at = i < ns ? (size_t)rd64(good + 24 + 32 * i + 8) : len;
        for (int d = -1; d <= 1; d++) {
            if (at + (size_t)d >= len || (i == ns && d >= 0)) continue;
            fz_next(z); FZ_REFUSED(good, at + (size_t)d);
        }
    }
    for (size_t cut = 0; base == 0 && cut < hdr; cut += 3) { fz_next(z); FZ_REFUSED(good, cut); }
    for (int i = 0; i < (base ? 50 : 300); i++) { fz_next(z); FZ_REFUSED(good, (size_t)fz_u(z, len)); }
    /* 2. random byte changes anywhere (the checksums must catch them) */
    for (int i = 0; i < (base ? 300 : 1500) * z->scale; i++) {
        memcpy(b, good, len);
        int hdr_only = i % 3 == 0;
        if (!fz_flip(z, b, good, len, 0, hdr_only ? hdr : len)) continue;
        fz_next(z); FZ_REFUSED(b, len);
    }
    /* 3. garbage: random bytes, and random bytes behind a valid magic and version */
    for (int i = 0; base == 0 && i < 300; i++) {
        size_t n = (size_t)fz_u(z, 2 * len);
        for (size_t k = 0; k < n; k++) b[k] = (uint8_t)fz_u(z, 256);
        if (i % 2 && n >= 16) { memcpy(b, good, 16); if (n >= 24) wr64(b + 16, (uint64_t)n); }
        fz_next(z); FZ_REFUSED(b, n);
    }
    /* 4. oversized length fields: file size, section count, section offsets and lengths, and the
     *    counts inside sections, each with the checksums made consistent again */
    const uint64_t huge[] = {0xffffffffffffffffull, 0x8000000000000000ull, 0xffffffffull, 0x7fffffffull, 0x80000000ull,
                             (uint64_t)len, (uint64_t)len + 1, (uint64_t)len * 2, 1ull << 40};
    for (size_t h = 0; base == 0 && h < sizeof huge / sizeof huge[0]; h++) {
        size_t fields[2 + 2 * 9];
        int nf = 0;
        fields[nf++] = 16;   /* file size */
        for (uint32_t s = 0; s < ns; s++) { fields[nf++] = 24 + 32 * s + 8; fields[nf++] = 24 + 32 * s + 16; }
        for (int f = 0; f < nf; f++)
            for (int fix = 0; fix < 2; fix++) {
                memcpy(b, good, len);
                wr64(b + fields[f], huge[h]);
                if (fix) fix_checksums_safe(b, len);
                if (!memcmp(b, good, len)) continue;   /* the value it already had */
                fz_next(z);
                if (mt_artifact_read(&out, b, len, &e) == 0) {
                    mt_graph_free(&out);
                    fz_fail(z, "accepted %llu at byte %zu of the header", (unsigned long long)huge[h], fields[f]);
                } else z->refused[FZ_ARTIFACT]++;
            }
        /* the section count (u32) and the counts inside sections (u32): config fields, mesh dimensions,
         * symbols, values, nodes, tuning entries, well-known values, fingerprint text length */
        const size_t count_at[9] = {28, 0, 0, 0, 0, (size_t)-1, 0, 32, 8};
        for (uint32_t s = 0; s <= ns; s++) {
            memcpy(b, good, len);
            if (s < ns && count_at[s] == (size_t)-1) continue;   /* the constants section is raw bytes */
            size_t at = s == ns ? 12 : (size_t)rd64(good + 24 + 32 * s + 8) + count_at[s];
            if (at + 4 > len) continue;
            uint32_t v = (uint32_t)huge[h];
            for (int k = 0; k < 4; k++) b[at + (size_t)k] = (uint8_t)(v >> (8 * k));
            if (!memcmp(b, good, len)) continue;
            fix_checksums_safe(b, len);
            fz_next(z);
            if (mt_artifact_read(&out, b, len, &e) == 0) { mt_graph_free(&out); fz_fail(z, "accepted a count of %u in section %u", v, s); }
            else z->refused[FZ_ARTIFACT]++;
        }
    }
    /* 5. semantic fuzzing: integer fields of the sections set to boundary values, checksums consistent */
    const int32_t edge[] = {0, 1, -1, -2, 2, 3, 7, 64, 65536, 0x7fffffff, (int32_t)0x80000000, g.n_values, g.n_values - 1, g.n_nodes};
    for (int i = 0; i < (base ? 800 : 2500) * z->scale; i++) {
        memcpy(b, good, len);
        int k = 1 + (int)fz_u(z, 3);
        for (int m = 0; m < k; m++) {
            size_t at = (hdr + (size_t)fz_u(z, len - hdr)) & ~(size_t)3;
            int32_t v = fz_u(z, 3) ? edge[fz_u(z, sizeof edge / sizeof edge[0])] : (int32_t)fz_u(z, (uint64_t)g.n_values + 2) - 1;   /* or another value id */
            for (int q = 0; q < 4 && at + (size_t)q < len; q++) b[at + (size_t)q] = (uint8_t)((uint32_t)v >> (8 * q));
        }
        if (!memcmp(b, good, len)) continue;
        fix_checksums_safe(b, len);
        fz_next(z);
        e.msg[0] = 0;
        if (mt_artifact_read(&out, b, len, &e) == 0) {
            /* what was loaded must be what the file says: it writes back to the file's bytes (those the reader does not
             * interpret as the writer writes them); the pristine graph if only those changed */
            uint8_t *back = NULL;
            size_t blen = 0;
            int wrote = !mt_artifact_write(&out, &back, &blen, &e);
            memcpy(canon, b, len);
            for (size_t k = 0; k < len; k++) if (dont_care[k]) canon[k] = good[k];
            fix_checksums_safe(canon, len);
            if (!wrote || blen != len || memcmp(back, canon, len)) {
                size_t at = 24 + 32 * ns + 8;
                while (wrote && at < len && at < blen && back[at] == canon[at]) at++;
                if (!wrote) fz_fail(z, "a loaded graph does not write: %.60s", e.msg);
                else fz_fail(z, "read other than its file says: byte %zu is %d in the file, %d as read", at, at < len ? canon[at] : -1, at < blen ? back[at] : -1);
            } else if (!memcmp(canon, good, len)) {
                z->same[FZ_ARTIFACT]++;
            } else {   /* a consistent graph that differs: it must run, or refuse to with a message, without a crash */
                z->differ[FZ_ARTIFACT]++;
                if (base != 3 && runs++ < 40 * z->scale) {
                    mt_binding bd;
                    mt_runtime *rt = NULL;
                    mt_binding_single(&bd);
                    bd.n_threads = 1; bd.poison = 1;
                    e.msg[0] = 0;
                    int rc = mt_runtime_create(&rt, &out, &bd, &e) || mt_runtime_init_params(rt, 1, &e);
                    if (!rc) {
                        mt_hparams hp;
                        mt_hparams_default(&hp);
                        int64_t N = (int64_t)out.cfg.batch * out.cfg.seq_len;
                        int32_t *tok = (int32_t *)calloc((size_t)(N > 0 ? N : 1), 4), *tgt = (int32_t *)calloc((size_t)(N > 0 ? N : 1), 4);
                        make_batch(&out.cfg, 0, tok, tgt);
                        rc = mt_runtime_step(rt, tok, tgt, 0, &hp, NULL, &e);
                        free(tok); free(tgt);
                    }
                    if (!rc) z->ran++;
                    else if (e.msg[0]) z->step_refused++;
                    else fz_fail(z, "a loaded mutant was refused without a message");
                    mt_runtime_destroy(rt);
                }
            }
            free(back);
            mt_graph_free(&out);
        } else if (!e.msg[0]) {
            fz_fail(z, "refused without a message");
        } else z->refused[FZ_ARTIFACT]++;
    }
#undef FZ_REFUSED
    free(b); free(good); free(canon); free(dont_care);
    mt_graph_free(&g);
}

/* A model that saves in a few kilobytes. */
static void micro_config(mt_config *c) {
    mt_err e;
    mt_config_preset(c, "tiny", &e);
    c->dim = 16; c->n_layers = 2; c->n_dense_layers = 1; c->n_heads = 2;
    c->kv_lora_rank = 8; c->qk_nope_head_dim = 4; c->qk_rope_head_dim = 2; c->v_head_dim = 4;
    c->inter_dim = 24; c->moe_inter_dim = 8; c->n_routed_experts = 4; c->top_k = 2; c->n_shared_experts = 1;
    c->vocab_size = 32; c->seq_len = 8; c->batch = 2; c->original_seq_len = 8;
}

/* Positions worth cutting a safetensors file at: the header length, the header's end, every tensor's data range. */
static int st_cuts(const uint8_t *f, size_t len, size_t *cuts, int cap) {
    mt__st s;
    mt_err e;
    memset(&s, 0, sizeof s);
    s.file = (uint8_t *)f; s.len = len; s.borrowed = 1;
    s.hl = rd64(f); s.data = f + 8 + s.hl; s.data_len = len - 8 - (size_t)s.hl;
    int n = 0;
    if (!mt__st_parse(&s, "fuzz", &e)) {
        cuts[n++] = 8; cuts[n++] = 8 + (size_t)s.hl;
        for (int i = 0; i < s.n && n + 2 < cap; i++) { cuts[n++] = 8 + (size_t)s.hl + (size_t)s.t[i].begin; cuts[n++] = 8 + (size_t)s.hl + (size_t)s.t[i].end; }
    }
    mt__st_free(&s);
    return n;
}

static void fuzz_safetensors(fuzzer *z) {
    mt_config c, c2;
    mt_err e;
    mt_graph g;
    micro_config(&c);
    z->target = FZ_SAFETENSORS;
    if (compile_cpu(&g, &c, MT_GRAPH_TRAIN, 1, &e)) { fz_fail(z, "compile: %s", e.msg); return; }
    char dir[256], work[256], mpath[400], opath[400], fpath[400];
    scratch_dir(dir, sizeof dir, "fzst");
    scratch_dir(work, sizeof work, "fzwk");
    mt_hparams hp;
    mt_hparams_default(&hp);
    double l[2];
    mt_run_state rs, back;
    mt_run_state_init(&rs);
    rs.step = 2; rs.total_steps = 9; rs.seed = 5; snprintf(rs.data, sizeof rs.data, "some \"quoted\\path\"\n.bin");
    mt_runtime *a = make_runtime(&g, 1, 0, 1), *ref = make_runtime(&g, 1, 0, 2), *x = make_runtime(&g, 1, 0, 3);
    if (!a || !ref || !x || run_steps(a, &c, 0, 2, l, &hp) || mt_checkpoint_save_run(a, dir, &rs, &e) || mt_checkpoint_load(ref, dir, NULL, &e)) {
        fz_fail(z, "setup: %s", e.msg);
        return;
    }
    /* the pristine files */
    uint8_t *gm, *go, *b;
    size_t lm, lo;
    snprintf(mpath, sizeof mpath, "%s/model.safetensors", dir);
    snprintf(opath, sizeof opath, "%s/optimizer-step2.safetensors", dir);
    if (mt_read_file(mpath, &gm, &lm, &e) || mt_read_file(opath, &go, &lo, &e)) { fz_fail(z, "read: %s", e.msg); return; }
    b = (uint8_t *)malloc(2 * (lm > lo ? lm : lo) + 64);
    snprintf(mpath, sizeof mpath, "%s/model.safetensors", work);
    snprintf(opath, sizeof opath, "%s/optimizer-step2.safetensors", work);
    mt_checkpoint_read_run(dir, &back, &e);
    int roundtrip = !strcmp(back.data, rs.data);
    if (!roundtrip) fz_fail(z, "run state did not round-trip: '%s'", back.data);
    /* one input: the model file (which = 0) or the optimizer file (1) replaced by bytes[0, n) */
#define FZ_INPUT(which, bytes, n) do { \
        fz_next(z); \
        if (fz_write(mpath, (which) ? gm : (bytes), (which) ? lm : (n)) || fz_write(opath, (which) ? (bytes) : go, (which) ? (n) : lo)) { \
            fz_fail(z, "cannot write %s", work); break; } \
        int ok_c = !mt_checkpoint_read_config(work, &c2, &e), ok_r; \
        if (ok_c && !mt_config_equal(&c, &c2)) fz_fail(z, "read a different config from a corrupt file"); \
        if (!ok_c && !e.msg[0]) fz_fail(z, "config refused without a message"); \
        mt_run_state rr; \
        e.msg[0] = 0; ok_r = !mt_checkpoint_read_run(work, &rr, &e); \
        if (ok_r && (rr.step != back.step || rr.seed != back.seed || strcmp(rr.data, back.data) || memcmp(&rr.hp, &back.hp, sizeof rr.hp))) \
            fz_fail(z, "read a different run state from a corrupt file"); \
        if (!ok_r && !e.msg[0]) fz_fail(z, "run state refused without a message"); \
        e.msg[0] = 0; \
        if (!mt_checkpoint_load(x, work, NULL, &e)) { \
            if (!same_state(x, ref)) fz_fail(z, "loaded different weights from a corrupt file"); \
            else z->same[FZ_SAFETENSORS]++; \
        } else if (!e.msg[0]) fz_fail(z, "load refused without a message"); \
        else z->refused[FZ_SAFETENSORS]++; \
    } while (0)
    for (int which = 0; which < 2; which++) {
        const uint8_t *base = which ? go : gm;
        size_t len = which ? lo : lm;
        size_t hl = (size_t)rd64(base), cuts[4096];
        int nc = st_cuts(base, len, cuts, 4096);
        /* 1. truncations: at every section and tensor boundary (and a byte either side), and at random */
        for (int i = 0; i < nc; i += (nc > 400 ? 3 : 1))
            for (int d = -1; d <= 1; d++)
                if (cuts[i] + (size_t)d < len) FZ_INPUT(which, base, cuts[i] + (size_t)d);
        for (int i = 0; i < 150; i++) FZ_INPUT(which, base, (size_t)fz_u(z, len));
        /* 2. random byte changes: in the header (most), anywhere */
        for (int i = 0; i < (which ? 250 : 700) * z->scale; i++) {
            memcpy(b, base, len);
            if (!fz_flip(z, b, base, len, 0, i % 4 ? 8 + hl : len)) continue;
            FZ_INPUT(which, b, len);
        }
        /* 3. JSON edits: a digit changed, a character deleted or doubled */
        for (int i = 0; i < (which ? 100 : 300) * z->scale; i++) {
            size_t at = 8 + (size_t)fz_u(z, hl), n = len;
            memcpy(b, base, len);
            int kind = (int)fz_u(z, 3);
            if (kind == 0) { size_t k = at; while (k < 8 + hl && !(b[k] >= '0' && b[k] <= '9')) k++; if (k == 8 + hl) continue; b[k] = (uint8_t)('0' + (b[k] - '0' + 1 + fz_u(z, 9)) % 10); }
            else if (kind == 1) { memmove(b + at, b + at + 1, len - at - 1); n = len - 1; }
            else { memmove(b + at + 1, b + at, len - at); n = len + 1; }
            FZ_INPUT(which, b, n);
        }
        /* 4. garbage, and oversized or wrong header lengths */
        for (int i = 0; i < 60; i++) {
            size_t n = (size_t)fz_u(z, len + 64);
            for (size_t k = 0; k < n; k++) b[k] = (uint8_t)fz_u(z, 256);
            if (i % 2 && n > 16) { memcpy(b, base, 8); memcpy(b + 8, "{\"", 2); }
            FZ_INPUT(which, b, n);
        }
        const uint64_t hls[] = {0, 1, 2, 7, hl - 1, hl + 1, hl + 8, len - 8, len - 7, len, 1ull << 31, 100000001ull, 0x7fffffffffffffffull, ~0ull};
        for (size_t i = 0; i < sizeof hls / sizeof hls[0]; i++) {
            memcpy(b, base, len);
            wr64(b, hls[i]);
            FZ_INPUT(which, b, len);
        }
    }
    /* 5. header edits with the header checksum made consistent again: the tensor table's own checks
     *    (dtype, shape, byte ranges tiling the data, names) must refuse, or the load must go through safely */
    {
        size_t hl = (size_t)rd64(gm);
        const char *key = "\"mt.header_sum\":\"";
        const uint8_t *hs = NULL;
        for (size_t k = 8; k + strlen(key) + 16 < 8 + hl && !hs; k++) if (!memcmp(gm + k, key, strlen(key))) hs = gm + k + strlen(key);
        for (int i = 0; hs && i < 400 * z->scale; i++) {
            memcpy(b, gm, lm);
            int k = 1 + (int)fz_u(z, 2);
            for (int m = 0; m < k; m++) {   /* a digit, or a dtype letter, changed in place */
                size_t at = 8 + (size_t)fz_u(z, hl), q = at;
                while (q < 8 + hl && !(b[q] >= '0' && b[q] <= '9') && b[q] != 'F') q++;
                if (q == 8 + hl || (size_t)(hs - gm) <= q + 16) continue;
                if (b[q] == 'F') { if (q + 2 < 8 + hl && b[q + 1] == '3') { b[q + 1] = fz_u(z, 2) ? '6' : '1'; b[q + 2] = fz_u(z, 2) ? '4' : '6'; } }
                else b[q] = (uint8_t)('0' + fz_u(z, 10));
            }
            mt__st ps;
            memset(&ps, 0, sizeof ps);
            ps.file = b; ps.len = lm; ps.borrowed = 1; ps.hl = hl; ps.data = b + 8 + hl; ps.data_len = lm - 8 - hl;
            if (!mt__st_parse(&ps, "fuzz", &e)) {
                char hex[24];
                snprintf(hex, sizeof hex, "%016llx", (unsigned long long)ps.header_sum);
                memcpy(b + (hs - gm), hex, 16);
            }
            mt__st_free(&ps);
            if (!memcmp(b, gm, lm)) continue;
            fz_next(z);
            if (fz_write(mpath, b, lm) || fz_write(opath, go, lo)) { fz_fail(z, "cannot write %s", work); break; }
            e.msg[0] = 0;
            if (mt_checkpoint_read_config(work, &c2, &e) && !e.msg[0]) fz_fail(z, "config refused without a message");
            e.msg[0] = 0;
            if (!mt_checkpoint_load(x, work, NULL, &e)) z->same[FZ_SAFETENSORS] += same_state(x, ref), z->differ[FZ_SAFETENSORS] += !same_state(x, ref);
            else if (!e.msg[0]) fz_fail(z, "refused without a message");
            else z->refused[FZ_SAFETENSORS]++;
        }
    }
    /* 6. a foreign file (no moetrain metadata, so no checksums): anything may load, nothing may crash */
    {
        const char *hdrs[] = {
            "{\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[16],\"data_offsets\":[0,64]}}",
            "{\"__metadata__\":{\"format\":\"pt\"},\"model.norm.weight\":{\"dtype\":\"BF16\",\"shape\":[16],\"data_offsets\":[0,32]},"
            "\"lm_head.weight\":{\"dtype\":\"F16\",\"shape\":[32,16],\"data_offsets\":[32,1056]}}",
            "{\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[16],\"data_offsets\":[0,64]},"   /* overlapping */
            "\"model.layers.0.input_layernorm.weight\":{\"dtype\":\"F32\",\"shape\":[16],\"data_offsets\":[0,64]}}"};
        snprintf(fpath, sizeof fpath, "%s/foreign.safetensors", work);
        mt_graph gf;
        mt_runtime *f = !compile_cpu(&gf, &c, MT_GRAPH_FORWARD, 1, &e) ? make_runtime(&gf, 1, 0, 4) : NULL;
        for (int h = 0; f && h < 3; h++) {
            size_t hl = strlen(hdrs[h]), len = 8 + hl + 1056 + 64;
            uint8_t *base = (uint8_t *)calloc(len, 1);
            wr64(base, hl);
            memcpy(base + 8, hdrs[h], hl);
            len = 8 + hl + (h == 1 ? 1056 : 64);
            if (h == 2) {   /* the file as it is: the overlap must be refused */
                fz_next(z);
                if (fz_write(fpath, base, len) || !mt_checkpoint_load(f, fpath, NULL, &e) || !strstr(e.msg, "overlapping"))
                    fz_fail(z, "overlapping tensors not refused: %s", e.msg);
                else z->refused[FZ_SAFETENSORS]++;
            }
            for (int i = 0; i < 200 * z->scale; i++) {
                memcpy(b, base, len);
                size_t n = len;
                if (i % 5 == 0) n = (size_t)fz_u(z, len);
                else fz_flip(z, b, base, len, 0, 8 + hl);
                fz_next(z);
                if (fz_write(fpath, b, n)) { fz_fail(z, "cannot write"); break; }
                e.msg[0] = 0;
                if (!mt_checkpoint_load(f, fpath, NULL, &e)) z->differ[FZ_SAFETENSORS]++;   /* no checksums: it may load */
                else if (!e.msg[0]) fz_fail(z, "foreign file refused without a message");
                else z->refused[FZ_SAFETENSORS]++;
            }
            free(base);
        }
        if (f) { mt_runtime_destroy(f); mt_graph_free(&gf); }
    }
#undef FZ_INPUT
    free(gm); free(go); free(b);
    remove_tree(dir); remove_tree(work);
    mt_runtime_destroy(a); mt_runtime_destroy(ref); mt_runtime_destroy(x);
    mt_graph_free(&g);
}

/* Data: an accepted file must give tokens the batches can read safely. */
static void fz_check_data(fuzzer *z, const char *path) {
    mt_dataset d;
    mt_err e;
    e.msg[0] = 0;
    if (mt_data_load(&d, path, &e)) { if (!e.msg[0]) fz_fail(z, "data refused without a message"); else z->refused[FZ_DATA]++; return; }
    z->differ[FZ_DATA]++;   /* no checksums: any file is read, and must be read safely */
    int mx = 0, bad = d.n < 2;
    for (int64_t i = 0; i < d.n && !bad; i++) { bad = d.tokens[i] < 0; if (d.tokens[i] > mx) mx = d.tokens[i]; }
    if (bad || mx != d.max_token) fz_fail(z, "data accepted with inconsistent tokens (n %lld)", (long long)d.n);
    int T = d.n - 1 < 16 ? (int)(d.n - 1) : 16;
    int32_t tok[2 * 16], tgt[2 * 16];
    for (int s = 0; s < 4 && !bad; s++) {
        if (mt_data_batch_at(&d, 1, s, 0, 1, 2, T, tok, tgt, &e)) { fz_fail(z, "batch refused on accepted data: %s", e.msg); break; }
        for (int i = 0; i < 2 * T; i++) if (tok[i] < 0 || tok[i] > d.max_token || tgt[i] < 0 || tgt[i] > d.max_token) { fz_fail(z, "batch out of the data"); break; }
    }
    (void)mt_data_hash(&d);
    mt_data_free(&d);
}
static void fuzz_data(fuzzer *z) {
    char dir[256], path[400];
    z->target = FZ_DATA;
    scratch_dir(dir, sizeof dir, "fzdt");
    snprintf(path, sizeof path, "%s/shard.bin", dir);
    for (int kind = 0; kind < 2; kind++) {   /* llm.c uint16 (v1) and uint32 (v7) shards */
        int width = kind ? 4 : 2, n = 700;
        size_t len = 1024 + (size_t)n * (size_t)width;
        uint8_t *base = (uint8_t *)calloc(len + 16, 1), *b = (uint8_t *)calloc(2 * len + 16, 1);
        int32_t hdr[3] = {kind ? 20240801 : 20240520, kind ? 7 : 1, n};
        memcpy(base, hdr, sizeof hdr);
        for (int i = 0; i < n; i++) {
            uint32_t t = (uint32_t)fz_u(z, kind ? 100000 : 65536);
            memcpy(base + 1024 + (size_t)i * (size_t)width, &t, (size_t)width);
        }
        const size_t cuts[] = {0, 1, 2, 4, 8, 11, 12, 13, 1023, 1024, 1025, 1024 + (size_t)width, len - 1};
        for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) { fz_next(z); fz_write(path, base, cuts[i]); fz_check_data(z, path); }
        for (int i = 0; i < 120; i++) { fz_next(z); fz_write(path, base, (size_t)fz_u(z, len)); fz_check_data(z, path); }
        for (int i = 0; i < 250 * z->scale; i++) {   /* changes in the header fields, and anywhere */
            memcpy(b, base, len);
            fz_flip(z, b, base, len, 0, i % 2 ? 12 : len);
            fz_next(z); fz_write(path, b, len); fz_check_data(z, path);
        }
        const int32_t counts[] = {0, 1, 2, -1, -700, n - 1, n + 1, 0x7fffffff, (int32_t)0x80000000, (int32_t)(len / 2)};
        for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {   /* oversized (and undersized) length fields */
            memcpy(b, base, len);
            memcpy(b + 8, &counts[i], 4);
            fz_next(z); fz_write(path, b, len); fz_check_data(z, path);
        }
        free(base); free(b);
    }
    uint8_t *g = (uint8_t *)malloc(5000);
    for (int i = 0; i < 150; i++) {   /* garbage: raw bytes of any length, some behind a shard magic */
        size_t n = (size_t)fz_u(z, i % 3 ? 40 : 5000);
        for (size_t k = 0; k < n; k++) g[k] = (uint8_t)fz_u(z, 256);
        if (i % 4 == 0 && n >= 12) { int32_t m = i % 8 ? 20240520 : 20240801; memcpy(g, &m, 4); }
        fz_next(z); fz_write(path, g, n); fz_check_data(z, path);
    }
    free(g);
    remove_tree(dir);
}

static void test_fuzz(void) {
    int fds[2];
    if (pipe(fds)) { report("fuzz", 0, "no pipe"); return; }
    fflush(stdout);
    double t0 = mt_now();
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        alarm(600);   /* a hang ends here: the parent reports it */
        fuzzer z;
        memset(&z, 0, sizeof z);
        z.fd = fds[1];
        z.scale = getenv("MT_FUZZ_SCALE") ? atoi(getenv("MT_FUZZ_SCALE")) : 1;   /* longer campaigns: more inputs of each kind */
        if (z.scale < 1) z.scale = 1;
        alarm(600 * (unsigned)z.scale);
        mt_rng_seed(&z.r, 20240909);
        for (int base = 0; base < 6; base++) fuzz_artifact(&z, base);
        fuzz_safetensors(&z);
        fuzz_data(&z);
        fuzz_rec rec;
        memset(&rec, 0, sizeof rec);
        rec.kind = FZ_DONE;
        int64_t counts[14];   /* per target: inputs, refused, same, differ; then steps run and refused */
        for (int t = 0; t < FZ_NTARGETS; t++) { counts[t] = z.n[t]; counts[3 + t] = z.refused[t]; counts[6 + t] = z.same[t]; counts[9 + t] = z.differ[t]; }
        counts[12] = z.ran; counts[13] = z.step_refused;
        memcpy(rec.msg, counts, sizeof counts);
        if (write(fds[1], &rec, sizeof rec) != (ssize_t)sizeof rec) _exit(4);
        _exit(0);
    }
    close(fds[1]);
    fuzz_rec rec, last;
    memset(&last, 0, sizeof last);
    int64_t c[14] = {0}, *n = c, *refused = c + 3, *same = c + 6, *differ = c + 9;
    int fails[FZ_NTARGETS] = {0, 0, 0}, done = 0;
    char first[FZ_NTARGETS][200];
    memset(first, 0, sizeof first);
    ssize_t got;
    while ((got = read(fds[0], &rec, sizeof rec)) == (ssize_t)sizeof rec) {
        if (rec.kind == FZ_PROGRESS) last = rec;
        else if (rec.kind == FZ_FAIL && rec.target >= 0 && rec.target < FZ_NTARGETS) {
            if (!fails[rec.target]++) snprintf(first[rec.target], sizeof first[0], "input #%lld: %s", (long long)rec.index, rec.msg);
        } else if (rec.kind == FZ_DONE) {
            memcpy(c, rec.msg, sizeof c);
            done = 1;
        }
    }
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    double secs = mt_now() - t0;
    if (!done || !WIFEXITED(status) || WEXITSTATUS(status)) {
        char why[64];
        if (WIFSIGNALED(status)) snprintf(why, sizeof why, "%s %d", WTERMSIG(status) == SIGALRM ? "hang or too slow: signal" : "signal", WTERMSIG(status));
        else snprintf(why, sizeof why, "exit status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        report("fuzz: the fuzzer finished", 0, "%s at input #%lld (%s)", why, (long long)last.index, fz_names[last.target]);
        return;
    }
    int all[FZ_NTARGETS];   /* every input ended one of the three ways */
    for (int t = 0; t < FZ_NTARGETS; t++) all[t] = n[t] == refused[t] + same[t] + differ[t];
    report("fuzz: artifact loader", !fails[0] && all[0] && n[0] > 5000,
           "%lld inputs: %lld refused with a message; of the mutants made consistent again, %lld read as the pristine graph, %lld as the "
           "graph they write (%lld stepped: %lld ran, %lld refused with a message)%s%s%s", (long long)n[0], (long long)refused[0], (long long)same[0],
           (long long)differ[0], (long long)(c[12] + c[13]), (long long)c[12], (long long)c[13], all[0] || fails[0] ? "" : "; NOT EVERY INPUT ENDED ONE WAY",
           fails[0] ? "; FIRST FAILURE " : "", first[0]);
    report("fuzz: safetensors loader", !fails[1] && all[1] && n[1] > 2000,
           "%lld inputs: %lld refused with a message, %lld loaded as the pristine checkpoint, %lld header edits made consistent again or "
           "foreign files loaded as other tensors%s%s%s", (long long)n[1], (long long)refused[1], (long long)same[1], (long long)differ[1],
           all[1] || fails[1] ? "" : "; NOT EVERY INPUT ENDED ONE WAY", fails[1] ? "; FIRST FAILURE " : "", first[1]);
    report("fuzz: data loaders", !fails[2] && all[2] && n[2] > 800, "%lld inputs: %lld refused with a message, %lld read safely%s%s%s",
           (long long)n[2], (long long)refused[2], (long long)differ[2], all[2] || fails[2] ? "" : "; NOT EVERY INPUT ENDED ONE WAY",
           fails[2] ? "; FIRST FAILURE " : "", first[2]);
    printf("fuzz: %lld inputs in %.1f s (artifact %lld, safetensors %lld, data %lld)%s\n", (long long)(n[0] + n[1] + n[2]), secs,
           (long long)n[0], (long long)n[1], (long long)n[2], fails[0] || fails[1] || fails[2] ? "" : ", no signal, hang or silent acceptance");
}

/* ======================================================================
 * the command-line tools
 * ==================================================================== */

/* The launch layer without GPUs: ranks as forked processes meeting at a
 * rendezvous; an orderly end, a rank that reports a failure, and a rank
 * killed with SIGKILL, which the others must learn of within seconds. */
static int rdv_child(int port, int rank, int world, int mode, int lfd) {
    mt_err e;
    uint8_t blob[300];
    for (int i = 0; i < 300; i++) blob[i] = rank == 0 ? (uint8_t)(i * 7 + 1) : 0;
    mt_rdv *r;
    if (lfd >= 0 && rank) close(lfd);
    if (lfd >= 0 && !rank ? mt_rdv_open_on(&r, lfd, port, world, blob, sizeof blob, 20, &e)
                          : mt_rdv_open(&r, "127.0.0.1", port, rank, world, blob, sizeof blob, 20, &e)) return 90;
    for (int i = 0; i < 300; i++) if (blob[i] != (uint8_t)(i * 7 + 1)) return 91;
    if (mode == 1 && rank == 2) raise(SIGKILL);                          /* dies without a word */
    if (mode == 2 && rank == 1) { mt_rdv_fail(r, "boom"); mt_rdv_close(r); return 50; }
    if (mode == 0) mt_rdv_done(r);
    int who = -1;
    char why[256] = "";
    double t0 = mt_now();
    while (mt_now() - t0 < 20) {
        int k = mt_rdv_poll(r, 100, &who, why, sizeof why);
        if (k == 2) { mt_rdv_close(r); return mode == 0 ? 0 : 92; }
        if (k == 1) {
            mt_rdv_close(r);
            if (mode == 2 && !strstr(why, "boom")) return 93;
            return 10 + who;
        }
    }
    return 94;
}
/* listen: as train's own launcher, which listens before it starts its ranks and hands rank 0 the socket */
static int rdv_world_on(int world, int mode, int listen, int *codes, double *secs) {
    mt_err e;
    int port = 0, lfd = listen ? mt_rdv_listen(&port, &e) : -1;
    if (!listen) port = mt_free_port(&e);
    if (port <= 0 || (listen && lfd < 0)) return -1;
    pid_t pid[8];
    fflush(stdout);
    double t0 = mt_now();
    for (int r = 0; r < world; r++) {
        pid[r] = fork();
        if (pid[r] == 0) _exit(rdv_child(port, r, world, mode, lfd));
    }
    if (lfd >= 0) close(lfd);
    for (int r = 0; r < world; r++) {
        int st;
        waitpid(pid[r], &st, 0);
        codes[r] = WIFSIGNALED(st) ? 100 + WTERMSIG(st) : WEXITSTATUS(st);
    }
    *secs = mt_now() - t0;
    return 0;
}
static int rdv_world(int world, int mode, int *codes, double *secs) { return rdv_world_on(world, mode, 0, codes, secs); }
static void test_launch_rendezvous(void) {
    int c[8] = {0};
    double t;
    {   /* the launcher's own socket: rank 0 serves on it; while it listens nobody else can take the port */
        mt_err e;
        int port = 0, lfd = mt_rdv_listen(&port, &e), busy = 0, bad = 0;
        if (lfd >= 0) {
            mt_rdv *r = NULL;
            busy = mt_rdv_open(&r, "127.0.0.1", port, 0, 2, (uint8_t *)&port, sizeof port, 1, &e) != 0 && strstr(e.msg, "cannot listen");
            bad = mt_rdv_open_on(&r, 0, port, 2, (uint8_t *)&port, sizeof port, 1, &e) != 0 && strstr(e.msg, "not a socket listening");
            close(lfd);
        }
        int ok = lfd >= 0 && busy && bad && rdv_world_on(3, 0, 1, c, &t) == 0 && c[0] == 0 && c[1] == 0 && c[2] == 0;
        report("rendezvous: rank 0 on the launcher's listening socket; the port held, a bad descriptor refused", ok,
               "port %d, busy %d, bad %d, exit %d %d %d", port, busy, bad, c[0], c[1], c[2]);
    }
    int ok = rdv_world(4, 0, c, &t) == 0 && c[0] == 0 && c[1] == 0 && c[2] == 0 && c[3] == 0;
    report("rendezvous: 4 processes share rank 0's blob and end in order", ok, "exit %d %d %d %d, %.2f s", c[0], c[1], c[2], c[3], t);
    ok = rdv_world(4, 2, c, &t) == 0 && c[0] == 11 && c[1] == 50 && c[2] == 11 && c[3] == 11;
    report("rendezvous: a failure a rank reports reaches every rank", ok, "exit %d %d %d %d, %.2f s", c[0], c[1], c[2], c[3], t);
    ok = rdv_world(4, 1, c, &t) == 0 && c[0] == 12 && c[1] == 12 && c[2] == 100 + SIGKILL && c[3] == 12 && t < 10;
    report("rendezvous: kill -9 of one rank stops the others within 10 s", ok, "exit %d %d %d %d, %.2f s", c[0], c[1], c[2], c[3], t);
}

/* Device hoisting on the CPU: ranks bound to virtual devices; a value bound to another device's buffer is
 * caught before any op runs; artifacts carry no device; a tuning section for another GPU model is named. */
static void test_devices(void) {
    mt_err e;
    mt_graph g;
    mt_config c;
    mt_config_preset(&c, "tiny", &e);
    mt_mesh m;
    mt_target t;
    mt_passes p;
    mt_mesh_single(&m); mt_target_cpu(&t); mt_passes_all(&p);
    if (mt_compile(&g, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e)) { report("devices", 0, "%s", e.msg); return; }
    mt_binding b0, b1;
    mt_binding_single(&b0); mt_binding_single(&b1);
    b0.device = 0; b1.device = 1; b0.n_threads = b1.n_threads = 1;
    mt_runtime *r0 = NULL, *r1 = NULL;
    mt_hparams hp;
    mt_hparams_default(&hp);
    memset(&e, 0, sizeof e);
    int ok = !mt_runtime_create(&r0, &g, &b0, &e) && !mt_runtime_create(&r1, &g, &b1, &e) && !mt_runtime_init_params(r0, 3, &e) &&
             !mt_runtime_init_params(r1, 3, &e) && !mt_runtime_check_devices(r0, &e) && !mt_runtime_check_devices(r1, &e);
    double l0[2], l1[2];
    ok = ok && !run_steps_quiet(r0, &c, 0, 1, l0, &hp) && !run_steps_quiet(r1, &c, 0, 1, l1, &hp) && l0[0] == l1[0];
    /* provoke: rank 0's copy of a weight points at device 1's buffer */
    int v = mt_graph_find(&g, "model.layers.0.self_attn.o_proj.weight");
    mt_err caught;
    memset(&caught, 0, sizeof caught);
    int provoked = 0;
    if (ok && v >= 0) {
        void *mine = r0->ptr[v];
        r0->ptr[v] = r1->ptr[v];
        provoked = mt_runtime_check_devices(r0, &caught) != 0 && run_steps_quiet(r0, &c, 1, 1, l0 + 1, &hp) != 0;
        r0->ptr[v] = mine;
        provoked = provoked && !run_steps_quiet(r0, &c, 1, 1, l0 + 1, &hp);
    }
    report("devices: a value bound to another (virtual) device's buffer is caught before any op runs", ok && provoked &&
           strstr(caught.msg, "o_proj.weight") && strstr(caught.msg, "virtual device 0"), "%s", ok ? caught.msg : e.msg);
    mt_runtime_destroy(r0); mt_runtime_destroy(r1);
    /* the artifact is device-free: two compiles write the same bytes, and nothing in it names a device */
    uint8_t *x = NULL, *y = NULL;
    size_t lx = 0, ly = 0;
    mt_graph g2;
    int same = !mt_compile(&g2, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) && !mt_artifact_write(&g, &x, &lx, &e) &&
               !mt_artifact_write(&g2, &y, &ly, &e) && lx == ly && !memcmp(x, y, lx);
    mt_graph_free(&g2);
    free(x); free(y);
    report("devices: artifacts are device-free (two compiles, identical bytes)", same, NULL);
    /* tuning for another GPU model: named field by field; a tuned artifact round-trips its choices */
    mt_tuning_info a, h;
    memset(&a, 0, sizeof a); memset(&h, 0, sizeof h);
    snprintf(a.device, sizeof a.device, "NVIDIA H200"); a.sm = 90; a.n_sms = 132; a.blas_version = 130100;
    h = a;
    char why[400] = "";
    int fits = !mt_tuning_mismatch(&a, &h, why, sizeof why);
    snprintf(h.device, sizeof h.device, "NVIDIA H100 80GB HBM3"); h.n_sms = 132;
    int named = mt_tuning_mismatch(&a, &h, why, sizeof why) && strstr(why, "H200") && strstr(why, "H100");
    mt_graph gc;
    mt_target tc;
    mt_target_cuda(&tc, "sm_90a");
    int rt_ok = !mt_compile(&gc, &c, &m, &tc, MT_GRAPH_TRAIN, &p, &e);
    if (rt_ok) {
        gc.tuned_for = a;
        gc.tuning = (mt_tuning *)calloc(2, sizeof(mt_tuning));
        gc.n_tuning = 2;
        for (int i = 0; i < 2; i++) {
            mt_tuning *q = &gc.tuning[i];
            q->ta = i; q->tb = 1; q->mb = 512; q->n = 64 << i; q->k = 256; q->at = q->bt = MT_BF16; q->ct = MT_F32;
            for (int w = 0; w < MT_ALGO_WORDS; w++) q->algo[w] = 0x0123456789abcdefull * (uint64_t)(w + 1 + i);
        }
        uint8_t *bytes = NULL;
        size_t len = 0;
        mt_graph back;
        rt_ok = !mt_artifact_write(&gc, &bytes, &len, &e) && !mt_artifact_read(&back, bytes, len, &e);
        if (rt_ok) {
            rt_ok = back.n_tuning == 2 && !memcmp(back.tuning, gc.tuning, 2 * sizeof(mt_tuning)) && !strcmp(back.tuned_for.device, "NVIDIA H200") &&
                    back.tuned_for.n_sms == 132 && mt_fingerprint(&back) == mt_fingerprint(&gc);
            mt_graph_free(&back);
        }
        /* a bad entry is refused */
        if (rt_ok) {
            gc.tuning[1].mb = 500;   /* not a power of two */
            free(bytes); bytes = NULL;
            rt_ok = !mt_artifact_write(&gc, &bytes, &len, &e) && mt_artifact_read(&back, bytes, len, &e) != 0 && strstr(e.msg, "tuning entry 1");
        }
        free(bytes);
        mt_graph_free(&gc);
    }
    report("tuning: another GPU model is named; the choices round-trip the artifact; a bad entry is refused", fits && named && rt_ok, "%s", why);
    mt_graph_free(&g);
}

/* The EP isolation pass on the node list: it moves the expert exchange to a channel of its own exactly
 * when its groups coincide with another collective's, leaves everything else alone, keeps rank order. */
static void test_isolate_ep(void) {
    static const struct { int rep, shard, ep, want; } cs[] = {{1, 2, 2, 1}, {2, 2, 2, 1}, {1, 4, 4, 1}, {2, 4, 4, 1},
                                                              {1, 4, 2, 0}, {2, 4, 2, 0}, {1, 2, 1, 0}, {1, 1, 1, 0}};
    int ok = 1;
    char why[300] = "";
    for (size_t c = 0; c < sizeof cs / sizeof cs[0] && ok; c++) {
        mt_err e;
        mt_graph on, off;
        mt_config cfg;
        mt_mesh m;
        mt_target t;
        mt_passes p;
        mt_config_preset(&cfg, "tiny", &e);
        mt_target_cpu(&t);
        mt_passes_all(&p);
        p.overlap = 0;   /* the node order as built: isolation alone */
        if (mt_mesh_init(&m, cs[c].rep, cs[c].shard, 1, cs[c].ep, &e) || mt_compile(&on, &cfg, &m, &t, MT_GRAPH_TRAIN, &p, &e)) { ok = 0; snprintf(why, sizeof why, "%s", e.msg); break; }
        p.isolate_ep = 0; p.overlap = 0;   /* overlap implies isolation */
        if (mt_compile(&off, &cfg, &m, &t, MT_GRAPH_TRAIN, &p, &e)) { ok = 0; mt_graph_free(&on); break; }
        int moved = 0, other_changed = 0, ep_nodes = 0;
        uint32_t epmask = 0;
        ok = on.n_nodes == off.n_nodes;
        for (int i = 0; ok && i < on.n_nodes; i++) {
            mt_node a = on.nodes[i], b = off.nodes[i];
            if (mt_op_is_ep_exchange(a.op)) {
                ep_nodes++;
                epmask = (uint32_t)a.iattr[0];
                moved += a.iattr[1] == MT_CHANNEL_EP;
                a.iattr[1] = b.iattr[1];
            }
            other_changed += memcmp(&a, &b, sizeof a) != 0;
        }
        int expect = cs[c].want ? ep_nodes : 0;
        /* the pass's premise, checked independently: some other collective's groups equal the exchange's, rank for rank */
        int coincide = 0, world = mt_mesh_world(&m);
        for (int i = 0; i < off.n_nodes && epmask && mt_mesh_group_size(&m, epmask) > 1; i++) {
            const mt_node *n = &off.nodes[i];
            if (mt_op_is_ep_exchange(n->op) || !(n->op == MT_OP_ALLGATHER || n->op == MT_OP_REDUCE_SCATTER || n->op == MT_OP_ALLREDUCE)) continue;
            int same = mt_mesh_group_size(&m, (uint32_t)n->iattr[0]) == mt_mesh_group_size(&m, epmask);
            for (int r = 0; r < world && same; r++) {
                int a[64], b[64];
                mt_mesh_group(&m, (uint32_t)n->iattr[0], r, a);
                mt_mesh_group(&m, epmask, r, b);
                same = !memcmp(a, b, sizeof(int) * (size_t)mt_mesh_group_size(&m, epmask));
            }
            coincide |= same;
        }
        if (!ok || moved != expect || other_changed || coincide != cs[c].want) {
            ok = 0;
            snprintf(why, sizeof why, "mesh %dx%d ep %d: moved %d of %d EP nodes (want %s), %d other nodes changed, groups coincide %d",
                     cs[c].rep, cs[c].shard, cs[c].ep, moved, ep_nodes, cs[c].want ? "all" : "none", other_changed, coincide);
        }
        mt_graph_free(&on); mt_graph_free(&off);
    }
    report("EP isolation pass: moves the exchange exactly when its groups coincide; other nodes untouched", ok, "%s",
           ok ? "8 meshes (1-8 ranks, ep 1/2/4)" : why);
    /* bound on 2 thread-ranks (dp_shard 2, ep 2): one communicator more, in mesh order; the same numbers */
    mt_err e;
    mt_graph gi, gs;
    mr_job a, b;
    memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
    a.fail_rank = b.fail_rank = -1;
    int built = mr_compile_for(&gi, 1, 2, 2, 2, 0, 0, &e) == 0;
    mt_config cfg = gi.cfg;
    mt_mesh m = gi.mesh;
    mt_target t;
    mt_passes p;
    mt_target_cpu(&t);
    mt_passes_all(&p);
    p.isolate_ep = 0; p.overlap = 0;
    built = built && mt_compile(&gs, &cfg, &m, &t, MT_GRAPH_TRAIN, &p, &e) == 0;
    int ran = built && mr_run(&a, &gi, 4, &e) == 0 && mr_run(&b, &gs, 4, &e) == 0;
    int order = ran;
    for (int r = 0; ran && r < 2; r++) {
        mt_runtime *rt = a.rt[r];
        int members[8], found = 0;
        mt_mesh_group(&m, MT_DIMBIT(MT_DIM_EP), r, members);
        for (int i = 0; i < rt->n_groups; i++)
            if (rt->groups[i].id == MT_CHANNEL_EP) {
                found = rt->groups[i].owner == i && rt->groups[i].size == 2;
                for (int k = 0; found && k < 2; k++) found = rt->groups[i].members[k] == members[k];
            }
        order &= found;
    }
    int same = ran && bitwise_equal(a.loss, b.loss, 4) && bitwise_equal(a.gnorm, b.gnorm, 4);
    report("EP isolation bound: its own communicator, ranks in mesh order, numbers bitwise unchanged",
           ran && order && same && a.n_comms[0] == 2 && b.n_comms[0] == 1, "communicators per rank %d isolated vs %d shared %s",
           a.n_comms[0], b.n_comms[0], ran ? "" : e.msg);
    mr_free(&a); mr_free(&b);
    if (built) { mt_graph_free(&gi); mt_graph_free(&gs); }
}

/* ======================================================================
 * overlap: queues, events, the hazard checker, FSDP prefetch, EP ahead
 * ==================================================================== */

static int ov_side_nodes(const mt_schedule *s) {
    int k = 0;
    for (int i = 0; i < s->n_nodes; i++) k += s->queue[i] != MT_Q_COMPUTE;
    return k;
}
/* build + check the schedule of g; returns 0 when hazard-free */
static int ov_check(const mt_graph *g, int *side, int *waits, mt_err *e) {
    mt_schedule s;
    if (mt_schedule_build(g, &s, e)) return -1;
    int rc = mt_schedule_check(g, &s, e);
    if (side) *side = ov_side_nodes(&s);
    if (waits) *waits = s.n_wait;
    mt_schedule_free(&s);
    return rc;
}
static int ov_compile_mesh(mt_graph *g, const char *preset, int rep, int shard, int ep, int overlap, int elide, mt_err *e) {
    mt_config c;
    mt_mesh m;
    mt_target t;
    mt_passes p;
    if (mt_config_preset(&c, preset, e) || mt_mesh_init(&m, rep, shard, 1, ep, e)) return -1;
    mt_target_cpu(&t);
    mt_passes_all(&p);
    p.overlap = overlap; p.elide = elide; p.moe_chunks = moe_chunks;
    return mt_compile(g, &c, &m, &t, MT_GRAPH_TRAIN, &p, e);
}
/* a multi-rank run's results, bitwise: losses, norms, every rank's weights */
static int ov_same_run(const mr_job *a, const mr_job *b, int steps, int ranks) {
    int same = bitwise_equal(a->loss, b->loss, steps) && bitwise_equal(a->gnorm, b->gnorm, steps);
    for (int r = 0; r < ranks; r++)
        same &= a->param_bytes[r] == b->param_bytes[r] && !memcmp(a->params[r], b->params[r], a->param_bytes[r]);
    return same;
}

/* overlap on vs off on thread-ranks (rep x shard, ep): some nodes reordered; losses, norms and every rank's
 * weights over 5 steps bitwise */
static void ov_on_off(const char *nm, int rep, int shard, int ep) {
    mt_err e;
    mt_graph a1, a0;
    if (mr_compile_opts(&a1, rep, shard, ep, 2, 0, 0, 1, &e) || mr_compile_opts(&a0, rep, shard, ep, 2, 0, 0, 0, &e)) {
        report(nm, 0, "%s", e.msg);
        return;
    }
    mr_job ja, jb;
    memset(&ja, 0, sizeof ja); memset(&jb, 0, sizeof jb);
    ja.fail_rank = jb.fail_rank = -1;
    int okr = mr_run(&ja, &a1, 5, &e) == 0 && mr_run(&jb, &a0, 5, &e) == 0;
    int diff = 0;
    for (int k = 0; k < a1.n_nodes; k++) diff += memcmp(&a1.nodes[k], &a0.nodes[k], sizeof(mt_node)) != 0;
    report(nm, okr && diff > 0 && ov_same_run(&ja, &jb, 5, rep * shard), "%d nodes reordered; losses, norms, every rank's weights "
           "over 5 steps; loss %.7f -> %.7f %s", diff, ja.loss[0], ja.loss[4], okr ? "" : e.msg);
    mr_free(&ja); mr_free(&jb);
    mt_graph_free(&a1); mt_graph_free(&a0);
}
static void test_overlap(void) {
    mt_err e;
    /* 1. the checker passes on the schedules the pass makes: 1 rank, 2 and 4 ranks, tiny and debug */
    struct { const char *preset; int rep, shard, ep, elide; } cases[] = {
        {"tiny", 1, 1, 1, 1}, {"tiny", 1, 1, 1, 0}, {"debug", 1, 1, 1, 1}, {"tiny", 1, 2, 2, 1}, {"debug", 1, 2, 2, 1},
        {"tiny", 1, 4, 2, 1}, {"tiny", 2, 2, 2, 1}, {"debug", 1, 4, 4, 1},
    };
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        mt_graph g, off;
        char nm[128];
        int world = cases[i].rep * cases[i].shard;
        snprintf(nm, sizeof nm, "overlap checker: %s, %d rank%s (shard %d, ep %d)%s", cases[i].preset, world, world > 1 ? "s" : "",
                 cases[i].shard, cases[i].ep, cases[i].elide ? "" : ", no elision");
        if (ov_compile_mesh(&g, cases[i].preset, cases[i].rep, cases[i].shard, cases[i].ep, 1, cases[i].elide, &e) ||
            ov_compile_mesh(&off, cases[i].preset, cases[i].rep, cases[i].shard, cases[i].ep, 0, cases[i].elide, &e)) {
            report(nm, 0, "%s", e.msg);
            continue;
        }
        int side = 0, waits = 0, rc = ov_check(&g, &side, &waits, &e);
        int plan_ok = mt_plan_check(&g, &e) == 0 || (rc = -1);
        report(nm, g.overlap && rc == 0 && plan_ok && (world == 1 ? side == 0 : side > 0 && waits > 0),
               "%d nodes on dp/ep streams, %d waits; arena %.1f MiB (%.1f without overlap)%s%s", side, waits,
               g.arena_bytes / 1048576.0, off.arena_bytes / 1048576.0, rc ? ": " : "", rc ? e.msg : "");
        mt_graph_free(&g); mt_graph_free(&off);
    }

    /* 2. the checker catches broken schedules and plans */
    mt_graph g;
    if (ov_compile_mesh(&g, "tiny", 1, 2, 2, 1, 1, &e)) { report("overlap graph", 0, "%s", e.msg); return; }
    mt_schedule s;
    int built = mt_schedule_build(&g, &s, &e) == 0, removed = -1;
    for (int i = 0; built && i < g.n_nodes && removed < 0; i++)   /* a compute node's wait for the exchange it reads */
        for (int k = s.wait_at[i]; k < s.wait_at[i + 1] && removed < 0; k++) {
            const mt_node *w = &g.nodes[s.wait[k]], *x = &g.nodes[i];
            if (s.queue[i] != MT_Q_COMPUTE || w->op != MT_OP_EP_DISPATCH || x->in[0] != w->out[0]) continue;
            memmove(&s.wait[k], &s.wait[k + 1], sizeof(int32_t) * (size_t)(s.n_wait - k - 1));
            for (int j = i + 1; j <= g.n_nodes; j++) s.wait_at[j]--;
            s.n_wait--;
            removed = i;
        }
    int caught = built && removed >= 0 && mt_schedule_check(&g, &s, &e) != 0 && strstr(e.msg, "reads") && strstr(e.msg, "no wait");
    report("overlap checker: a removed wait is caught", caught, "%s", e.msg);
    if (built) mt_schedule_free(&s);
    /* a collective issued with no fence may run arbitrarily early (its issue-point wait removed): a gather
     * whose output shares bytes (a region of their own past the arena) with a value its issue point reads
     * last is safe with the fence, and caught without it */
    built = mt_schedule_build(&g, &s, &e) == 0;
    int safe = 0;
    caught = 0;
    for (int i = 0; built && i < g.n_nodes && !safe; i++) {
        if (s.queue[i] == MT_Q_COMPUTE || g.nodes[i].op != MT_OP_ALLGATHER || s.wait_at[i + 1] - s.wait_at[i] != 1) continue;
        const int fence = s.wait[s.wait_at[i]];   /* its one wait: the compute node just before it */
        if (s.queue[fence] != MT_Q_COMPUTE) continue;
        mt_value *o = &g.values[g.nodes[i].out[0]];
        for (int k = 0; k < g.nodes[fence].n_in + g.nodes[fence].n_out && !safe; k++) {
            int v = k < g.nodes[fence].n_in ? g.nodes[fence].in[k] : g.nodes[fence].out[k - g.nodes[fence].n_in], first, last;
            if (v < 0 || v == g.nodes[i].out[0] || !MT_ROLE_IN_ARENA(g.values[v].role)) continue;
            mt_value_live_range(&g, v, &first, &last);
            if (last != fence) continue;
            const int64_t o0 = o->offset, v0 = g.values[v].offset;
            o->offset = g.values[v].offset = g.arena_bytes;
            if (mt_schedule_check(&g, &s, &e) == 0) {   /* safe with the fence: now without it */
                safe = 1;
                int w = s.wait_at[i];
                memmove(&s.wait[w], &s.wait[w + 1], sizeof(int32_t) * (size_t)(s.n_wait - w - 1));
                for (int j = i + 1; j <= g.n_nodes; j++) s.wait_at[j]--;
                s.n_wait--;
                caught = mt_schedule_check(&g, &s, &e) != 0 && strstr(e.msg, "hazard");
            }
            o->offset = o0; g.values[v].offset = v0;
        }
    }
    report("overlap checker: a gather without its issue-point fence is caught", safe && caught, "%s", safe ? e.msg : "no placement safe with the fence");
    if (built) mt_schedule_free(&s);
    /* live ranges shrunk to node order (a plan that ignores the other streams) */
    g.overlap = 0;
    mt_pass_plan_memory(&g, &e);
    g.overlap = 1;
    caught = mt_plan_check(&g, &e) == 0 && ov_check(&g, NULL, NULL, &e) != 0 && strstr(e.msg, "hazard");
    report("overlap checker: a node-order memory plan is caught", caught, "%s", e.msg);
    uint8_t *bytes = NULL;
    size_t len = 0;
    mt_graph back;
    int refused = mt_artifact_write(&g, &bytes, &len, &e) == 0 && mt_artifact_read(&back, bytes, len, &e) != 0 && strstr(e.msg, "schedule");
    report("artifact with a hazardous overlap plan is refused", refused, "%s", e.msg);
    free(bytes);
    mt_graph_free(&g);

    /* 3. the reorder: prefetch and EP-ahead happen, and CPU results stay bitwise (1 rank, 2 and 4 thread-ranks) */
    mt_graph on, off;
    if (ov_compile_mesh(&on, "debug", 1, 2, 2, 1, 1, &e) || ov_compile_mesh(&off, "debug", 1, 2, 2, 0, 1, &e)) {
        report("overlap reorder", 0, "%s", e.msg);
        return;
    }
    int moved = 0, prefetched = 0, shared_ahead = 0;
    for (int i = 0; i < on.n_nodes; i++) moved += memcmp(&on.nodes[i], &off.nodes[i], sizeof(mt_node)) != 0;
    for (int i = 0; i < on.n_nodes; i++) {
        const mt_node *x = &on.nodes[i];
        int nx = i + 1;
        while (nx < on.n_nodes && on.nodes[nx].op == MT_OP_ALLGATHER) nx++;
        if (x->op == MT_OP_ALLGATHER && nx < on.n_nodes && on.nodes[nx].layer != x->layer) prefetched++;
        if (x->op == MT_OP_EP_DISPATCH && x->phase == MT_PHASE_FORWARD)   /* the shared experts' GEMMs follow the dispatch, before the experts' */
            for (int k = i + 1; k < on.n_nodes && on.nodes[k].layer == x->layer && on.nodes[k].op != MT_OP_GMM_GLU && on.nodes[k].op != MT_OP_GMM; k++)
                if (on.nodes[k].op == MT_OP_MATMUL && strstr(on.values[on.nodes[k].out[0]].name, "shared")) { shared_ahead++; break; }
    }
    report("overlap pass: FSDP gathers a stage early, shared experts between the dispatch and the experts' GEMMs", on.n_nodes == off.n_nodes && moved > 0 &&
           prefetched > 20 && shared_ahead == on.cfg.n_layers - on.cfg.n_dense_layers, "%d nodes moved, %d gathers prefetched, "
           "%d of %d MoE layers' shared experts under the dispatch", moved, prefetched, shared_ahead, on.cfg.n_layers - on.cfg.n_dense_layers);
    mt_graph_free(&on); mt_graph_free(&off);

    /* one rank (no elision, so the exchange nodes stay): overlap on vs off, bitwise over several steps */
    mt_config c;
    mt_config_preset(&c, "tiny", &e);
    c.batch = 2; c.seq_len = 32;
    mt_graph g1, g0;
    mt_mesh m;
    mt_target t;
    mt_passes p;
    mt_mesh_single(&m); mt_target_cpu(&t);
    mt_passes_all(&p);
    p.elide = 0;
    int ok = mt_compile(&g1, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) == 0;
    p.overlap = 0;
    ok = ok && mt_compile(&g0, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) == 0;
    enum { S = 4 };
    double l1[S] = {0}, l0[S] = {0};
    mt_hparams hp;
    mt_hparams_default(&hp);
    mt_runtime *r1 = ok ? make_runtime(&g1, 1, 1, 3) : NULL, *r0 = ok ? make_runtime(&g0, 1, 1, 3) : NULL;
    ok = ok && r1 && r0 && !run_steps(r1, &c, 0, S, l1, &hp) && !run_steps(r0, &c, 0, S, l0, &hp);
    int wsame = ok;
    for (int i = 0; wsame && i < g1.n_values; i++)
        if (g1.values[i].role == MT_ROLE_PARAM) wsame = !memcmp(mt_runtime_value(r1, i), mt_runtime_value(r0, i), (size_t)g1.values[i].nbytes);
    report("overlap on vs off, 1 rank: bitwise losses and weights", ok && bitwise_equal(l1, l0, S) && wsame, "loss %.7f -> %.7f%s%s",
           l1[0], l1[S - 1], ok ? "" : ": ", ok ? "" : e.msg);
    mt_runtime_destroy(r1); mt_runtime_destroy(r0);
    if (ok) { mt_graph_free(&g1); mt_graph_free(&g0); }

    int meshes[2][3] = {{1, 2, 2}, {1, 4, 2}};
    for (int i = 0; i < 2; i++) {
        char nm[128];
        int world = meshes[i][0] * meshes[i][1];
        snprintf(nm, sizeof nm, "overlap on vs off, %d thread-ranks (shard %d, ep %d): bitwise", world, meshes[i][1], meshes[i][2]);
        ov_on_off(nm, meshes[i][0], meshes[i][1], meshes[i][2]);
    }
}

static void test_multirank(void) {
    mt_err e;
    /* the same global batch, any layout: FSDP, EP, HSDP */
    mr_equivalence(1, 2, 1, 20, 1.1e-7, 1.1e-7, 2e-7, 2e-4);
    mr_equivalence(1, 2, 2, 20, 1.1e-7, 1.1e-7, 2e-7, 2e-4);
    mr_equivalence(1, 4, 4, 20, 1.1e-7, 1.1e-7, 2e-7, 2e-4);
    mr_equivalence(1, 8, 8, 20, 1.1e-7, 1.1e-7, 2e-7, 2e-4);
    mr_equivalence(2, 2, 2, 20, 1.1e-7, 1.1e-7, 2e-7, 2e-4);
    /* bf16 moments: the reduced gradients' last-bit differences flip some moments' bf16 rounding (2^-8
     * of the moment), so the weights drift further apart than with f32 moments (measured: losses 4.2e-7,
     * grad norms 9.3e-7, weights 2.1e-3); float64's differences are too small to flip any (test_f64) */
    mr_moments = MT_BF16;
    mr_equivalence(1, 2, 1, 20, 1.1e-7, 1e-6, 2e-6, 5e-3);
    mr_equivalence(1, 4, 4, 20, 1.1e-7, 1e-6, 2e-6, 5e-3);
    mr_equivalence(2, 2, 2, 20, 1.1e-7, 1e-6, 2e-6, 5e-3);
    mr_moments = MT_F32;

    /* RoPE folded into attention on many ranks (dp_shard 4, ep 2): bitwise the unfolded run */
    {
        mt_graph gf[2];
        int nf = -1, built = 0;
        for (int f = 0; f < 2; f++) {
            mt_config c;
            mt_mesh m;
            mt_target t;
            mt_config_preset(&c, "tiny", &e);
            c.seq_len = 32; c.original_seq_len = 32; c.batch = 2;
            mt_target_cpu(&t);
            if (mt_mesh_init(&m, 1, 4, 1, 2, &e) || mt_build(&gf[f], &c, &m, &t, MT_GRAPH_TRAIN, &e)) break;
            int k = 0;
            if (mt_pass_elide_collectives(&gf[f], &e) || (f && (k = mt_pass_fold_rope(&gf[f], &e)) < 0) || mt_pass_fuse(&gf[f], &e) ||
                mt_pass_isolate_ep(&gf[f], &e) < 0 || mt_pass_plan_memory(&gf[f], &e)) { mt_graph_free(&gf[f]); break; }
            if (f) nf = k;
            built++;
        }
        mr_job a, b;
        memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
        a.fail_rank = b.fail_rank = -1;
        int ok = built == 2 && mr_run(&a, &gf[0], 6, &e) == 0 && mr_run(&b, &gf[1], 6, &e) == 0;
        int same = ok && nf == gf[1].cfg.n_layers && bitwise_equal(a.loss, b.loss, 6) && bitwise_equal(a.gnorm, b.gnorm, 6);
        for (int r = 0; same && r < 4; r++) same = a.param_bytes[r] == b.param_bytes[r] && !memcmp(a.params[r], b.params[r], a.param_bytes[r]);
        report("4 ranks (dp_shard 4, ep 2): RoPE folded = unfolded, bitwise", same, "%d layers folded; losses, norms, every rank's weights %s", nf,
               ok ? "" : e.msg);
        mr_free(&a); mr_free(&b);
        for (int f = 0; f < built; f++) mt_graph_free(&gf[f]);
    }

    /* two runs bitwise equal; replicas hold bitwise equal weights */
    mt_graph g;
    if (mr_compile(&g, 2, 2, 2, 2, 0, &e)) { report("multi-rank graph", 0, "%s", e.msg); return; }
    mr_job a, b;
    memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
    a.fail_rank = b.fail_rank = -1;
    int ok = mr_run(&a, &g, 5, &e) == 0 && mr_run(&b, &g, 5, &e) == 0;
    int same = ok && bitwise_equal(a.loss, b.loss, 5) && bitwise_equal(a.gnorm, b.gnorm, 5);
    for (int r = 0; ok && r < 4; r++) same &= a.param_bytes[r] == b.param_bytes[r] && !memcmp(a.params[r], b.params[r], a.param_bytes[r]);
    report("4 ranks: two runs bitwise equal (losses, norms, every rank's weights)", same, "%s", ok ? "" : e.msg);
    /* rank r and r+2 differ only in dp_replicate: the same shards, bitwise */
    int rep = ok && a.param_bytes[0] == a.param_bytes[2] && a.param_bytes[1] == a.param_bytes[3] &&
              !memcmp(a.params[0], a.params[2], a.param_bytes[0]) && !memcmp(a.params[1], a.params[3], a.param_bytes[1]) &&
              memcmp(a.params[0], a.params[1], a.param_bytes[0] < a.param_bytes[1] ? a.param_bytes[0] : a.param_bytes[1]);
    report("HSDP: replicas' weights bitwise equal after 5 steps (shards differ)", rep, NULL);
    mr_free(&a); mr_free(&b);

    /* precompiled on one rank, loaded by every rank: bitwise the in-process run (losses, grad norms, weights) */
    static const int meshes[3][3] = {{1, 4, 2}, {1, 4, 4}, {2, 4, 4}};
    for (int k = 0; k < 3; k++) {
        mt_graph g4, gl;
        uint8_t *bytes = NULL;
        size_t len = 0;
        int world = meshes[k][0] * meshes[k][1];
        int built = mr_compile(&g4, meshes[k][0], meshes[k][1], meshes[k][2], 2, 0, &e) == 0;
        int loaded = built && mt_artifact_write(&g4, &bytes, &len, &e) == 0 && mt_artifact_read(&gl, bytes, len, &e) == 0;
        free(bytes);
        memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
        a.fail_rank = b.fail_rank = -1;
        ok = loaded && mr_run(&a, &g4, 10, &e) == 0 && mr_run(&b, &gl, 10, &e) == 0;
        int pre = ok && bitwise_equal(a.loss, b.loss, 10) && bitwise_equal(a.gnorm, b.gnorm, 10);
        for (int r = 0; ok && r < world; r++) pre &= !memcmp(a.params[r], b.params[r], a.param_bytes[r]);
        report("precompiled artifact = in-process compile, bitwise over 10 steps", pre, "%d ranks (dp_replicate %d, dp_shard %d, ep %d); "
               "losses %.6f .. %.6f %s", world, meshes[k][0], meshes[k][1], meshes[k][2], a.loss[0], a.loss[9], ok ? "" : e.msg);
        mr_free(&a); mr_free(&b);
        if (loaded) mt_graph_free(&gl);
        if (built) mt_graph_free(&g4);
    }

    /* every token to rank 0's experts: rank 1 receives none, and the step still equals one rank's */
    mt_graph g1, g2;
    ok = mr_compile(&g1, 1, 1, 1, 4, 0, &e) == 0 && mr_compile(&g2, 1, 2, 2, 2, 0, &e) == 0;
    memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
    a.fail_rank = b.fail_rank = -1; a.route_to_first = b.route_to_first = 1;
    ok = ok && mr_run(&a, &g1, 1, &e) == 0 && mr_run(&b, &g2, 1, &e) == 0;
    int64_t want = (int64_t)4 * 32 * 2 * (g2.cfg.n_layers - g2.cfg.n_dense_layers);   /* tokens x top-k x MoE layers */
    report("EP: every token routed to one rank; the other receives none", ok && b.recv_rows[0] == want && b.recv_rows[1] == 0 &&
           fabs(a.loss[0] - b.loss[0]) <= 1.1e-7 * a.loss[0] && fabs(a.gnorm[0] - b.gnorm[0]) <= 2e-7 * a.gnorm[0],
           "rows %lld / %lld (want %lld / 0); as one rank: loss %.9g vs %.9g, grad norm %.9g vs %.9g %s", (long long)b.recv_rows[0],
           (long long)b.recv_rows[1], (long long)want, b.loss[0], a.loss[0], b.gnorm[0], a.gnorm[0], ok ? "" : e.msg);
    mr_free(&a); mr_free(&b);
    mt_graph_free(&g1); mt_graph_free(&g2);

    /* a rank that fails mid-run stops every rank, each with an error naming it */
    memset(&a, 0, sizeof a);
    a.fail_rank = 2; a.fail_step = 2;
    int rc = mr_run(&a, &g, 5, &e);
    int named = rc != 0 && strstr(e.msg, "rank 2") && strstr(a.err[2], "outside the vocabulary");
    for (int r = 0; r < 4; r++) if (r != 2) named = named && strstr(a.err[r], "rank 2 failed");
    report("a failing rank stops the others, each naming it", named, "%s | rank 0: %.80s", e.msg, a.err[0]);
    mr_free(&a);

    /* the graph keeps ranks symbolic: shards and coordinates, no literal rank */
    int ag = 0, rs = 0, sym = 1, sharded = 0;
    for (int i = 0; i < g.n_nodes; i++) {
        const mt_node *n = &g.nodes[i];
        ag += n->op == MT_OP_ALLGATHER; rs += n->op == MT_OP_REDUCE_SCATTER;
        if (n->op == MT_OP_EP_COUNTS || n->op == MT_OP_EP_DISPATCH || n->op == MT_OP_EP_COMBINE) sym &= (n->sym_mask >> 4) & 1;
    }
    for (int v = 0; v < g.n_values; v++) sharded += g.values[v].role == MT_ROLE_PARAM && g.values[v].shard != 0;
    report("FSDP + EP graph: gathers, reduce-scatters, symbolic coordinates", ag > 0 && rs > 0 && sym && sharded > 20,
           "%d all-gathers, %d reduce-scatters, %d sharded params", ag, rs, sharded);
    mt_graph_free(&g);
}

/* Tensor parallelism. (a) tp meshes train as one rank on the same global batch (float32: 2e-7).
 * (b) The seeds' check on the seeds' mesh: dp_shard 4 x tp 2 x ep 4 on 8 thread-ranks, a
 * debug-shaped model (torchtitan's debugmodel layout: 16 heads, MLA without q_lora, 8 experts top-3,
 * 2 shared, one dense layer, softmax routing; widths cut for CI), precompiled to an artifact and
 * loaded by every rank vs compiled in-process: losses, grad norms and every rank's weights bitwise
 * over 10 steps. (c) The graph: tp collectives over the tp mask, coordinates as symbols, split
 * weights stored as their part, the expert exchange isolated from tp collectives over the same
 * ranks. (d) What tp cannot split is refused with the reason. */
static void test_tensor_parallel(void) {
    mt_err e;
    mr_equivalence_tp(1, 2, 1, 20, 2e-7);
    mr_equivalence_tp(2, 2, 1, 20, 2e-7);
    mr_equivalence_tp(1, 2, 2, 20, 2e-7);
    mr_equivalence_tp(4, 2, 4, 20, 2e-7);
    {   /* (b) */
        mt_config c;
        mt_mesh m;
        mt_target t;
        mt_passes p;
        mt_graph g, gl;
        mt_config_preset(&c, "debug", &e);
        c.dim = 64; c.n_layers = 3; c.kv_lora_rank = 32; c.qk_nope_head_dim = 8; c.qk_rope_head_dim = 4; c.v_head_dim = 8;
        c.inter_dim = 128; c.moe_inter_dim = 32; c.vocab_size = 256; c.seq_len = 32; c.original_seq_len = 64; c.batch = 1;
        mt_target_cpu(&t);
        mt_passes_all(&p);
        uint8_t *bytes = NULL, *bytes2 = NULL;
        size_t len = 0, len2 = 0;
        int built = mt_mesh_init(&m, 1, 4, 2, 4, &e) == 0 && mt_compile(&g, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) == 0;
        int loaded = built && mt_artifact_write(&g, &bytes, &len, &e) == 0 && mt_artifact_read(&gl, bytes, len, &e) == 0;
        int same_bytes = loaded && mt_artifact_write(&gl, &bytes2, &len2, &e) == 0 && len == len2 && !memcmp(bytes, bytes2, len);
        free(bytes); free(bytes2);
        mr_job a, b;
        memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
        a.fail_rank = b.fail_rank = -1;
        int ok = loaded && mr_run(&a, &g, 10, &e) == 0 && mr_run(&b, &gl, 10, &e) == 0;
        int same = ok && bitwise_equal(a.loss, b.loss, 10) && bitwise_equal(a.gnorm, b.gnorm, 10);
        for (int r = 0; same && r < 8; r++) same = a.param_bytes[r] == b.param_bytes[r] && !memcmp(a.params[r], b.params[r], a.param_bytes[r]);
        report("the seeds' check: dp_shard 4 x tp 2 x ep 4 on 8 ranks, precompiled = in-process, bitwise over 10 steps",
               same && same_bytes && a.loss[9] < a.loss[0], "losses, grad norms, every rank's weights %s; artifact %zu bytes, rewritten %s %s",
               same ? "bitwise" : "DIFFER", len, same_bytes ? "identical" : "DIFFERS", ok ? "" : e.msg);
        if (ok) {   /* the two columns, for the record */
            printf("  step  loss (in-process)    loss (precompiled)   grad norm (in-process)  grad norm (precompiled)\n");
            for (int s = 0; s < 10; s++) printf("  %4d  %.17g  %.17g  %.17g  %.17g\n", s + 1, a.loss[s], b.loss[s], a.gnorm[s], b.gnorm[s]);
        }
        mr_free(&a); mr_free(&b);
        if (loaded) mt_graph_free(&gl);
        if (built) mt_graph_free(&g);
    }
    {   /* (c) */
        mt_graph g;
        if (mr_compile_mesh(&g, 1, 1, 2, 2, 2, 0, 0, 1, &e)) { report("tp graph", 0, "%s", e.msg); return; }
        int gathers = 0, scatters = 0, on_tp = 1, sym = 1, split = 0, local = 1, moved = 0, tp_sym = -1;
        for (int s = 0; s < g.n_syms; s++) if (g.syms[s].kind == MT_SYM_COORD && g.syms[s].mesh_dim == MT_DIM_TP) tp_sym = s;
        for (int i = 0; i < g.n_nodes; i++) {
            const mt_node *n = &g.nodes[i];
            if (n->op == MT_OP_SP_GATHER || n->op == MT_OP_SP_SCATTER) {
                gathers += n->op == MT_OP_SP_GATHER; scatters += n->op == MT_OP_SP_SCATTER;
                on_tp &= n->iattr[0] == (int)MT_DIMBIT(MT_DIM_TP);
            }
            if (n->op == MT_OP_EMBED || n->op == MT_OP_EMBED_BWD) sym &= n->sym_mask == 2u && n->iattr[1] == tp_sym;
            if (n->op == MT_OP_CE_STATS || n->op == MT_OP_CE_SHARD_BWD) sym &= n->sym_mask == 1u && n->iattr[0] == tp_sym;
            if (mt_op_is_ep_exchange(n->op)) moved += n->iattr[1] == MT_CHANNEL_EP;
        }
        for (int v = 0; v < g.n_values; v++) {
            const mt_value *x = &g.values[v];
            if (x->role != MT_ROLE_PARAM || x->param >= 0 || !(x->flags & MT_VF_TP)) continue;
            split++;
            if (strstr(x->name, "o_proj")) local &= x->dims[1] == (int64_t)g.cfg.n_heads / 2 * g.cfg.v_head_dim && x->dims[0] == g.cfg.dim;
            if (strstr(x->name, "lm_head")) local &= x->dims[0] == g.cfg.vocab_size / 2;
        }
        report("tp graph: gathers and reduce-scatters over tp, symbolic coordinates, split weights, EP isolated",
               gathers > 2 * g.cfg.n_layers && scatters > 2 * g.cfg.n_layers && on_tp && sym && tp_sym >= 0 && split >= 4 * g.cfg.n_layers && local && moved > 0,
               "%d gathers, %d reduce-scatters, %d split weights, %d exchange nodes on their own channel", gathers, scatters, split, moved);
        mt_graph_free(&g);
    }
    {   /* (d) */
        mt_config c;
        mt_mesh m;
        mt_target t;
        mt_graph g;
        mt_err e1, e2;
        mt_config_preset(&c, "tiny", &e);
        mt_target_cpu(&t);
        mt_mesh_init(&m, 1, 1, 3, 1, &e);
        int r1 = mt_build(&g, &c, &m, &t, MT_GRAPH_TRAIN, &e1);
        if (!r1) mt_graph_free(&g);
        mt_mesh_init(&m, 1, 1, 2, 1, &e);
        int r2 = mt_build(&g, &c, &m, &t, MT_GRAPH_FORWARD, &e2);
        if (!r2) mt_graph_free(&g);
        report("tp refuses what it cannot split", r1 && strstr(e1.msg, "tp=3 must divide") && r2 && strstr(e2.msg, "tp = 1"), "%s | %s", e1.msg, e2.msg);
    }
}

static int run_cmd(const char *cmd, char *out, size_t cap) {
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    if (!WIFEXITED(st)) return 1000;   /* killed by a signal */
    return WEXITSTATUS(st);
}

/* The CLIs under test: ./train and ./precompile, or those in $MT_BIN (the sanitizer build). */
static const char *BIN = "./";
static int sh(char *out, size_t cap, const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return run_cmd(cmd, out, cap);
}

/* The GPU scripts fail loudly where they cannot do their work: the benchmark on a failed run, the
 * multi-GPU checks when asked for more GPUs than are visible (REQUIRE_GPUS). */
static void test_scripts(void) {
    static char a[1 << 16], b[1 << 12];
    char d[256];
    scratch_dir(d, sizeof d, "bench");
    int rb = sh(a, sizeof a, "OUT=%s STEPS=1 MODES=eager MULTI=0 sh bench/run.sh no-such-preset 2>&1", d);
    int rg = sh(b, sizeof b, "REQUIRE_GPUS=4097 sh tools/test_multi_gpu.sh 2>&1");
    int rz = sh(b + 2048, sizeof b - 2048, "REQUIRE_GPUS=x sh tools/test_multi_gpu.sh 2>&1");
    report("scripts: bench/run.sh and test_multi_gpu.sh fail when they cannot run", rb != 0 && strstr(a, "no-such-preset_eager FAILED") &&
           rg != 0 && strstr(b, "FAIL ") && strstr(b, "0 passed, 1 failed") && rz != 0 && strstr(b + 2048, "0 passed, 1 failed"),
           "bench exit %d; REQUIRE_GPUS=4097: exit %d, %.80s", rb, rg, b);
    remove_tree(d);
}

/* The JSON-lines metrics from step `from` on: step, loss, grad_norm, lr (what must match bitwise). */
static void metrics_core(const char *path, int from, char *out, size_t cap) {
    FILE *f = fopen(path, "r");
    char line[4096];
    out[0] = 0;
    while (f && fgets(line, sizeof line, f)) {
        int step = atoi(line + 8);
        char *cut = strstr(line, ",\"tokens_per_s\"");
        if (!strncmp(line, "{\"step\":", 8) && step >= from && cut) {
            *cut = 0;
            snprintf(out + strlen(out), cap - strlen(out), "%s\n", line);
        }
    }
    if (f) fclose(f);
}
static int same_file(const char *p, const char *q) {
    uint8_t *a, *b;
    size_t la, lb;
    mt_err e;
    if (mt_read_file(p, &a, &la, &e)) return 0;
    if (mt_read_file(q, &b, &lb, &e)) { free(a); return 0; }
    int same = la == lb && !memcmp(a, b, la);
    free(a); free(b);
    return same;
}

/* Lines of text. */
static int n_lines(const char *s) { int n = 0; for (; *s; s++) n += *s == '\n'; return n; }
/* A metrics file's loss and grad norm by step (1-based); returns how many steps it holds. */
typedef struct { int n; double loss[64], gnorm[64]; } cli_curve;
static int cli_curve_read(const char *path, cli_curve *c) {
    FILE *f = fopen(path, "r");
    char line[4096];
    memset(c, 0, sizeof *c);
    while (f && fgets(line, sizeof line, f)) {
        int st;
        double lo, gn;
        if (sscanf(line, "{\"step\":%d,\"loss\":%lf,\"grad_norm\":%lf", &st, &lo, &gn) == 3 && st >= 1 && st < 64) {
            c->loss[st] = lo; c->gnorm[st] = gn;
            c->n++;
        }
    }
    if (f) fclose(f);
    return c->n;
}
/* Worst relative difference of a's losses (or grad norms) from b's over steps [from, to]; 1 if a step is missing. */
static double cli_curve_err(const cli_curve *a, const cli_curve *b, int from, int to, int gnorm) {
    double w = 0;
    for (int s = from; s <= to; s++) {
        double x = gnorm ? a->gnorm[s] : a->loss[s], y = gnorm ? b->gnorm[s] : b->loss[s];
        if (!(y > 0) || !(x > 0)) return 1;
        w = fmax(w, fabs(x - y) / y);
    }
    return w;
}
/* Two float32 safetensors files of one model: the worst over tensors of max |p - q| / max |q|; -1 if they
 * do not hold the same tensors. */
static double st_weights_err(const char *p, const char *q, int *n) {
    mt__st x, y;
    mt_err e;
    double worst = -1;
    *n = 0;
    if (mt__st_open(&x, p, 1, &e)) return -1;
    if (!mt__st_open(&y, q, 1, &e)) {
        worst = x.n == y.n && x.n > 20 ? 0 : -1;
        for (int i = 0; worst >= 0 && i < x.n; i++, ++*n) {
            const mt__st_t *t = mt__st_find(&y, x.t[i].name);
            if (!t || t->dtype != MT__ST_F32 || x.t[i].dtype != MT__ST_F32 || t->end - t->begin != x.t[i].end - x.t[i].begin) { worst = -1; break; }
            double d = 0, mx = 1e-300;
            for (int64_t k = 0; k < (t->end - t->begin) / 4; k++) {
                float u, v;
                memcpy(&u, x.data + x.t[i].begin + 4 * k, 4); memcpy(&v, y.data + t->begin + 4 * k, 4);
                d = fmax(d, fabs((double)u - v)); mx = fmax(mx, fabs((double)v));
                if (u != u || v != v) d = 1e30;
            }
            worst = fmax(worst, d / mx);
        }
        mt__st_free(&y);
    }
    mt__st_free(&x);
    return worst;
}

static void test_cli(void) {
    static char a[65536], b[65536], c[4 << 20];
    const char *mtg = TP("cli.mtg"), *bad = TP("cli_bad.mtg"), *data = TP("cli_data.bin");
    /* "= in-process" claims are bitwise: every step's loss, grad norm and lr from --metrics (%.9g of float32 values: exact) */
    static char ma[1 << 14], mb[1 << 14];
    const char *fa = TP("cli_a.jsonl"), *fb = TP("cli_b.jsonl");
    int ra = sh(a, sizeof a, "%sprecompile --preset tiny -o %s 2>&1 && %strain --graph %s --steps 8 --seed 1 --metrics %s 2>&1", BIN, mtg, BIN,
                mtg, fa);
    int rb = sh(b, sizeof b, "%strain --preset tiny --steps 8 --seed 1 --metrics %s 2>&1", BIN, fb);
    metrics_core(fa, 1, ma, sizeof ma); metrics_core(fb, 1, mb, sizeof mb);
    report("CLI: precompile + train --graph = in-process, bitwise", ra == 0 && rb == 0 && n_lines(ma) == 8 && !strcmp(ma, mb),
           "%d steps: loss, grad norm, lr %s", n_lines(ma), ra || rb ? "(a command failed)" : strcmp(ma, mb) ? "DIFFER" : "identical");
    int rd = sh(c, sizeof c, "%sprecompile --dump %s 2>&1", BIN, mtg);
    report("CLI: precompile --dump prints the plan", rd == 0 && strstr(c, "== nodes") && strstr(c, "== memory plan") &&
           strstr(c, "== collectives") && strstr(c, "ep_recv_tokens"), NULL);
    /* a corrupted artifact: non-zero exit, no signal, a message naming the problem */
    uint8_t *bytes;
    size_t len;
    mt_err e;
    mt_read_file(mtg, &bytes, &len, &e);
    bytes[len / 2] ^= 0x10;
    FILE *f = fopen(bad, "wb");
    fwrite(bytes, 1, len, f);
    fclose(f);
    free(bytes);
    int rc = sh(c, sizeof c, "%strain --graph %s --steps 1 2>&1", BIN, bad);
    report("CLI: corrupted artifact -> clean refusal", rc == 1 && strstr(c, "checksum mismatch"), "exit %d: %.100s", rc, c);
    rc = sh(c, sizeof c, "%strain --steps x 2>&1", BIN);
    int rc2 = sh(b, sizeof b, "%strain --preset tiny --top-k 99 --steps 1 2>&1", BIN);
    int rc3 = sh(a, sizeof a, "%strain --data /nonexistent --steps 1 2>&1", BIN);
    report("CLI: bad flags and files refused", rc == 2 && rc2 == 2 && rc3 == 1 && strstr(b, "top_k") && strstr(a, "cannot open"),
           "%d %d %d", rc, rc2, rc3);
    f = fopen(data, "wb");
    for (int i = 0; i < 300; i++) fputc(i & 255, f);
    fclose(f);
    rc = sh(a, sizeof a, "%strain --data %s --data-format raw --vocab-size 200 --steps 1 2>&1", BIN, data);
    report("CLI: token beyond vocabulary refused", rc == 1 && strstr(a, "vocabulary"), "%.100s", a);

    /* many ranks from the command line: CPU thread-ranks */
    const char *mesh = TP("cli_mesh.mtg");
    /* as one rank on the global batch: losses within the README's 1.1e-7, grad norms and the saved weights too */
    char d4[256], d1[256], p4[600], p1[600];
    scratch_dir(d4, sizeof d4, "cli4"); scratch_dir(d1, sizeof d1, "cli1r");
    ra = sh(a, sizeof a, "%strain --device cpu --nproc 4 --ep 2 --batch 2 --steps 4 --seed 1 --metrics %s/m.jsonl --save %s/ck 2>&1", BIN, d4, d4);
    rb = sh(b, sizeof b, "%strain --device cpu --batch 8 --steps 4 --seed 1 --metrics %s/m.jsonl --save %s/ck 2>&1", BIN, d1, d1);
    int banner = strstr(a, "ranks: 4 (CPU threads)") && strstr(a, "global batch 8 x 64 (2 per rank)") != NULL;
    cli_curve c4 = {0}, c1 = {0};
    snprintf(p4, sizeof p4, "%s/m.jsonl", d4); snprintf(p1, sizeof p1, "%s/m.jsonl", d1);
    int lines = cli_curve_read(p4, &c4) == 4 && cli_curve_read(p1, &c1) == 4 ? 4 : 0, nt = 0;
    double wl = cli_curve_err(&c4, &c1, 1, 4, 0), wg = cli_curve_err(&c4, &c1, 1, 4, 1);
    snprintf(p4, sizeof p4, "%s/ck/model.safetensors", d4); snprintf(p1, sizeof p1, "%s/ck/model.safetensors", d1);
    double ww = st_weights_err(p4, p1, &nt);
    report("CLI: --nproc 4 --ep 2 (thread-ranks) = one rank on the global batch", !ra && !rb && banner && lines == 4 && wl <= 1.1e-7 &&
           wg <= 2e-7 && ww >= 0 && ww <= 1e-5, "4 steps, worst relative: loss %.2e (bound 1.1e-7), grad norm %.2e (2e-7); %d saved tensors %.2e (1e-5)",
           wl, wg, nt, ww);
    remove_tree(d4); remove_tree(d1);
    /* FSDP with the embedding's rows looked up in the shards (a 4096-entry vocabulary, 64 tokens a rank:
     * test_fsdp_gradient_graph) = one rank on the global batch; the logged loss, a mean of the ranks' means, may
     * differ from the mean over all tokens by 2 float ulps (2.4e-7) */
    scratch_dir(d4, sizeof d4, "cliemb2"); scratch_dir(d1, sizeof d1, "cliemb1");
    ra = sh(a, sizeof a, "%strain --device cpu --nproc 2 --dp-shard 2 --vocab-size 4096 --batch 1 --steps 4 --seed 3 --metrics %s/m.jsonl "
            "--save %s/ck 2>&1", BIN, d4, d4);
    rb = sh(b, sizeof b, "%strain --device cpu --vocab-size 4096 --batch 2 --steps 4 --seed 3 --metrics %s/m.jsonl --save %s/ck 2>&1", BIN, d1, d1);
    snprintf(p4, sizeof p4, "%s/m.jsonl", d4); snprintf(p1, sizeof p1, "%s/m.jsonl", d1);
    lines = cli_curve_read(p4, &c4) == 4 && cli_curve_read(p1, &c1) == 4 ? 4 : 0;
    wl = cli_curve_err(&c4, &c1, 1, 4, 0); wg = cli_curve_err(&c4, &c1, 1, 4, 1);
    snprintf(p4, sizeof p4, "%s/ck/model.safetensors", d4); snprintf(p1, sizeof p1, "%s/ck/model.safetensors", d1);
    nt = 0; ww = st_weights_err(p4, p1, &nt);
    report("CLI: FSDP embedding looked up in the shards = one rank on the global batch", !ra && !rb && lines == 4 && wl <= 2.4e-7 &&
           wg <= 2e-7 && ww >= 0 && ww <= 1e-5, "4 steps, worst relative: loss %.2e (bound 2.4e-7), grad norm %.2e (2e-7); %d saved tensors %.2e (1e-5)",
           wl, wg, nt, ww);
    remove_tree(d4); remove_tree(d1);
    const char *f2 = TP("cli_2r.jsonl"), *f2g = TP("cli_2g.jsonl"), *f2o = TP("cli_2o.jsonl");
    ra = sh(a, sizeof a, "%sprecompile --preset tiny --dp-shard 2 --ep 2 -o %s 2>&1 && %strain --device cpu --graph %s --steps 4 --seed 1 "
            "--metrics %s 2>&1", BIN, mesh, BIN, mesh, f2g);
    rb = sh(b, sizeof b, "%strain --device cpu --nproc 2 --ep 2 --steps 4 --seed 1 --metrics %s 2>&1", BIN, f2);
    metrics_core(f2g, 1, ma, sizeof ma); metrics_core(f2, 1, mb, sizeof mb);
    report("CLI: precompile --dp-shard 2 --ep 2, train --graph = in-process on 2 ranks, bitwise", !ra && !rb && n_lines(ma) == 4 && !strcmp(ma, mb),
           "%d steps: loss, grad norm, lr %s", n_lines(ma), ra || rb ? "(a command failed)" : strcmp(ma, mb) ? "DIFFER" : "identical");
    rc = sh(a, sizeof a, "%strain --device cpu --graph %s --nproc 3 --steps 1 2>&1", BIN, mesh);
    report("CLI: an artifact for another world size is refused, naming both", rc == 2 && strstr(a, "world of 2") && strstr(a, "3 ranks"),
           "exit %d: %.160s", rc, a);
    rd = sh(c, sizeof c, "%sprecompile --preset tiny --dp-shard 2 --ep 2 -o %s 2>&1 && %sprecompile --dump %s 2>&1", BIN,
            mesh, BIN, mesh);   /* overlap: the default with several ranks */
    report("CLI: --dump shows the communicator groups", rd == 0 && strstr(c, "== communicator groups") && strstr(c, "{0,1}") &&
           strstr(c, "ALLGATHER") && strstr(c, "shard over dp_shard"), NULL);
    report("CLI: --dump shows each node's queue and the overlap schedule", rd == 0 && strstr(c, "== overlap schedule (streams") &&
           strstr(c, " dp      L") && strstr(c, " ep      L") && strstr(c, "  wait n") && strstr(c, "prefetch: issued during L") &&
           strstr(c, "compute joins at n") && strstr(c, "EP_DISPATCH"), NULL);
    ra = sh(c, sizeof c, "%sprecompile --preset tiny --dp-shard 2 --ep 2 --no-overlap -o %s 2>&1 && %sprecompile --dump %s 2>&1", BIN, mesh, BIN, mesh);
    report("CLI: precompile --no-overlap: one stream, said in --dump", ra == 0 && strstr(c, "== overlap schedule: off") &&
           !strstr(c, "  wait n"), NULL);
    ra = sh(a, sizeof a, "%strain --device cpu --nproc 2 --ep 2 --steps 4 --seed 1 --no-overlap --metrics %s 2>&1", BIN, f2o);
    metrics_core(f2o, 1, ma, sizeof ma);   /* mb: the default run, overlap on with 2 ranks */
    report("CLI: train --no-overlap on 2 thread-ranks: bitwise the default (overlap) steps", !ra && n_lines(ma) == 4 && !strcmp(ma, mb),
           "%d steps: loss, grad norm, lr %s", n_lines(ma), ra ? "(the command failed)" : strcmp(ma, mb) ? "DIFFER" : "identical");
    remove(f2); remove(f2g); remove(f2o); remove(fa); remove(fb);
    rc = sh(a, sizeof a, "%strain --device cpu --nproc 2 --ep 3 --steps 1 2>&1", BIN);
    rc2 = sh(b, sizeof b, "%strain --device cpu --nproc 2 --graph %s --ep 2 --steps 1 2>&1", BIN, mesh);
    report("CLI: bad meshes and unsupported combinations refused", rc == 2 && strstr(a, "ep=3") && rc2 == 2 && strstr(b, "fixes the mesh"),
           "%d %d: %.80s | %.80s", rc, rc2, a, b);
    remove(mesh);
    remove(mtg); remove(bad); remove(data);
}

/* Every option of the CLIs: unknown ones named (with a suggestion), ranges, --help, exit status. */
static void test_cli_options(void) {
    static char a[1 << 16], b[1 << 16];
    int r1 = sh(a, sizeof a, "%strain --bogus 2>&1", BIN);
    int ok1 = r1 == 2 && strstr(a, "unknown option '--bogus'") && !strstr(a, "needs a value");
    int r2 = sh(b, sizeof b, "%strain --stpes 5 2>&1", BIN);
    int ok2 = r2 == 2 && strstr(b, "did you mean '--steps'");
    int r3 = sh(a, sizeof a, "%strain --n-layer 2 2>&1", BIN);
    int ok3 = r3 == 2 && strstr(a, "did you mean '--n-layers'");
    report("CLI: unknown options named, closest suggested", ok1 && ok2 && ok3, "%d %d %d", r1, r2, r3);
    /* ranges: each of these is refused with exit 2 before any work */
    const char *badv[] = {"--steps -1", "--seed -3", "--lr 0", "--lr nan", "--lr 1e99", "--warmup 1.5", "--beta1 1", "--beta2 -0.1",
                          "--eps 0", "--weight-decay -1", "--grad-clip inf", "--threads 0", "--threads 65", "--log-every 0",
                          "--gpu -1", "--save-every -2", "--min-lr-ratio 2", "--roof-gbps 0", "--dim 0", "--top-k 1000", "--steps=",
                          "--lr", "--eager=1", "--save-every 5", "--adopt-config", "--logits-out x"};
    int nbad = (int)(sizeof badv / sizeof badv[0]), refused = 0;
    char worst[200] = "";
    for (int i = 0; i < nbad; i++) {
        int rc = sh(a, sizeof a, "%strain %s --steps 0 2>&1", BIN, badv[i]);
        if (rc == 2 && !strstr(a, "step ")) refused++;
        else snprintf(worst, sizeof worst, "'%s' gave %d: %.80s", badv[i], rc, a);
    }
    report("CLI: every numeric flag range-checked (exit 2)", refused == nbad, "%d of %d refused %s", refused, nbad, worst);
    int rh = sh(a, sizeof a, "%strain --help 2>&1", BIN);
    const char *must[] = {"--save-every N", "--nan-check", "--adopt-config", "--steps N", "[300]", "--top-k N", "--load DIR", "exit status"};
    int all = rh == 0;
    for (int i = 0; i < 8; i++) all &= strstr(a, must[i]) != NULL;
    int ph = sh(b, sizeof b, "%sprecompile --help 2>&1", BIN);
    int pall = ph == 0 && strstr(b, "--dp-shard N") && strstr(b, "[1..4096]") && strstr(b, "exit status");
    report("CLI: --help lists every option with its default", all && pall, NULL);
    int p1 = sh(a, sizeof a, "%sprecompile --presett tiny -o x 2>&1", BIN);
    int okp1 = p1 == 2 && strstr(a, "did you mean '--preset'");
    int p2 = sh(a, sizeof a, "%sprecompile --ep 0 -o x 2>&1", BIN);
    int p3 = sh(b, sizeof b, "%sprecompile -o /dev/full/x 2>&1", BIN);
    report("CLI: precompile: unknown options, ranges, unwritable output", okp1 && p2 == 2 && p3 == 1 && strstr(b, "/dev/full/x"), "%d %d %d", p1, p2, p3);
    /* an unwritable --save is found before training, not after */
    int rs = sh(a, sizeof a, "%strain --save /dev/full/x --steps 50 2>&1", BIN);
    report("CLI: unwritable --save refused before training", rs == 1 && strstr(a, "/dev/full") && !strstr(a, "step "), "exit %d: %.100s", rs, a);
}

/* Launchers: the variables of torchrun, mpirun (Open MPI) and srun (Slurm) as
 * rank, world, local rank and rendezvous; which wins; Slurm's host lists; the
 * errors. The environment is an array here: nothing of this process's own. */
static int launch_of(const char **env, mt_launch *l, mt_err *e) { return mt_launch_from_env(l, mt_env_get, (void *)env, e); }
static int launch_is(const char **env, mt_launcher by, int rank, int world, int local, const char *addr, int port, const char *what) {
    mt_launch l;
    mt_err e;
    if (launch_of(env, &l, &e)) { printf("  %s: unexpected error: %s\n", env[0], e.msg); return 0; }
    int ok = l.by == by && l.rank == rank && l.world == world && l.local_rank == local && (!addr || !strcmp(l.addr, addr)) &&
             (!port || l.port == port) && (!what || !strcmp(l.what, what));
    if (!ok) printf("  %s: by %d rank %d of %d local %d at %s:%d (%s, %s): %s\n", env[0], (int)l.by, l.rank, l.world, l.local_rank, l.addr, l.port,
                    l.addr_from, l.port_from, l.what);
    return ok;
}
static int launch_fails(const char **env, const char *says1, const char *says2) {
    mt_launch l;
    mt_err e;
    e.msg[0] = 0;
    int ok = launch_of(env, &l, &e) != 0 && strstr(e.msg, says1) && (!says2 || strstr(e.msg, says2));
    if (!ok) printf("  %s ...: expected an error saying '%s': got '%s'\n", env[0], says1, e.msg);
    return ok;
}
static int host_is(const char *list, int64_t count, int64_t i, const char *want) {
    char h[64];
    mt_err e;
    int64_t n = mt_hostlist_host(list, i, h, sizeof h, &e);
    int ok = n == count && !strcmp(h, want);
    if (!ok) printf("  host list '%s': %lld hosts, host %lld '%s' (want %lld, '%s')%s%s\n", list, (long long)n, (long long)i, h, (long long)count,
                    want, n < 0 ? ": " : "", n < 0 ? e.msg : "");
    return ok;
}
static void test_launch_env(void) {
    /* each launcher alone */
    const char *tr[] = {"RANK=3", "WORLD_SIZE=8", "LOCAL_RANK=3", "MASTER_ADDR=10.0.0.1", "MASTER_PORT=1234", NULL};
    const char *tr_min[] = {"RANK=5", "WORLD_SIZE=8", NULL};
    const char *tr_agent[] = {"RANK=0", "WORLD_SIZE=2", "LOCAL_RANK=0", "MASTER_PORT=29400", "TORCHELASTIC_USE_AGENT_STORE=True", NULL};
    const char *sl[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=3", "SLURM_NTASKS=8", "SLURM_LOCALID=3", "SLURM_JOB_NODELIST=gpu-a[07-08],gpu-b3",
                        "SLURM_JOB_ID=123456", NULL};
    const char *sl_step[] = {"SLURM_STEP_ID=1", "SLURM_PROCID=9", "SLURM_NTASKS=16", "SLURM_LOCALID=1", "SLURM_JOB_NODELIST=node[01-04]",
                             "SLURM_STEP_NODELIST=node[03-04]", "SLURM_JOB_ID=123456", NULL};
    const char *sl_master[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=0", "SLURM_JOB_NODELIST=n[1-2]",
                               "SLURM_JOB_ID=7", "MASTER_ADDR=head", "MASTER_PORT=4444", NULL};
    const char *sl_ours[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=0", "SLURM_JOB_NODELIST=n[1-2]",
                             "SLURM_JOB_ID=7", "MASTER_PORT=4444", "MOETRAIN_PORT=5555", NULL};
    const char *mpi[] = {"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=1", "OMPI_COMM_WORLD_LOCAL_SIZE=4", NULL};
    const char *mpi2[] = {"OMPI_COMM_WORLD_RANK=6", "OMPI_COMM_WORLD_SIZE=8", "OMPI_COMM_WORLD_LOCAL_RANK=2", "OMPI_COMM_WORLD_LOCAL_SIZE=4",
                          "MASTER_ADDR=h0", "MASTER_PORT=4000", NULL};
    int ok = launch_is(tr, MT_LAUNCH_TORCHRUN, 3, 8, 3, "10.0.0.1", 1234, "torchrun (RANK=3 of 8, LOCAL_RANK=3)") &&
             launch_is(tr_min, MT_LAUNCH_TORCHRUN, 5, 8, 5, "127.0.0.1", 29500, NULL) &&
             launch_is(tr_agent, MT_LAUNCH_TORCHRUN, 0, 2, 0, NULL, 29401, NULL);
    report("launch: torchrun's variables (defaults, its store's port)", ok, NULL);
    ok = launch_is(sl, MT_LAUNCH_SLURM, 3, 8, 3, "gpu-a07", 10000 + (16 * 123456) % 20000, "slurm (SLURM_PROCID=3 of 8, SLURM_LOCALID=3)") &&
         launch_is(sl_step, MT_LAUNCH_SLURM, 9, 16, 1, "node03", 10000 + (16 * 123456 + 1) % 20000, NULL) &&
         launch_is(sl_master, MT_LAUNCH_SLURM, 1, 2, 0, "head", 4444, NULL) && launch_is(sl_ours, MT_LAUNCH_SLURM, 1, 2, 0, "n1", 5555, NULL);
    report("launch: srun's variables, rank 0's host from the node list", ok, "port from SLURM_JOB_ID 123456: %d", 10000 + (16 * 123456) % 20000);
    ok = launch_is(mpi, MT_LAUNCH_OPENMPI, 1, 4, 1, "127.0.0.1", 29500, "open mpi (OMPI_COMM_WORLD_RANK=1 of 4, OMPI_COMM_WORLD_LOCAL_RANK=1)") &&
         launch_is(mpi2, MT_LAUNCH_OPENMPI, 6, 8, 2, "h0", 4000, NULL);
    report("launch: mpirun's variables, one host and several", ok, NULL);

    /* precedence: the innermost launcher; no step, no launch; a world of one starts its own ranks */
    const char *all[] = {"RANK=1", "WORLD_SIZE=4", "LOCAL_RANK=1", "SLURM_STEP_ID=0", "SLURM_PROCID=0", "SLURM_NTASKS=2", "SLURM_LOCALID=0",
                         "SLURM_JOB_NODELIST=n1", "OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_RANK=0",
                         "OMPI_COMM_WORLD_LOCAL_SIZE=2", NULL};
    const char **mpi_slurm = all + 3;   /* without torchrun's: mpirun's, whatever Slurm's say */
    const char *mpi_in_slurm[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=1", "SLURM_NTASKS=1", "SLURM_LOCALID=0", "SLURM_JOB_NODELIST=n[1-2]",
                                  "OMPI_COMM_WORLD_RANK=3", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=1",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE=2", "MASTER_ADDR=n1", NULL};
    const char *batch[] = {"SLURM_PROCID=0", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_JOB_NODELIST=n[1-2]", "SLURM_JOB_ID=5", NULL};
    const char *one[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=0", "SLURM_NTASKS=1", "SLURM_LOCALID=0", "SLURM_JOB_NODELIST=n1", NULL};
    const char *mpi_one[] = {"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=1", "OMPI_COMM_WORLD_LOCAL_RANK=0", NULL};
    const char *tr_one[] = {"RANK=0", "WORLD_SIZE=1", NULL};
    const char *none[] = {"PATH=/bin", "SLURM_JOB_ID=5", NULL};
    ok = launch_is(all, MT_LAUNCH_TORCHRUN, 1, 4, 1, NULL, 0, NULL) && launch_is(mpi_slurm, MT_LAUNCH_OPENMPI, 0, 2, 0, NULL, 0, NULL) &&
         launch_is(mpi_in_slurm, MT_LAUNCH_OPENMPI, 3, 4, 1, "n1", 29500, NULL) && launch_is(batch, MT_LAUNCH_SELF, 0, 1, 0, NULL, 0, "self") &&
         launch_is(one, MT_LAUNCH_SELF, 0, 1, 0, NULL, 0, "self (a world of one from slurm (SLURM_PROCID=0 of 1, SLURM_LOCALID=0))") &&
         launch_is(mpi_one, MT_LAUNCH_SELF, 0, 1, 0, NULL, 0, NULL) && launch_is(tr_one, MT_LAUNCH_TORCHRUN, 0, 1, 0, NULL, 0, NULL) &&
         launch_is(none, MT_LAUNCH_SELF, 0, 1, 0, NULL, 0, "self");
    report("launch: torchrun, then mpirun, then srun (a step), then self", ok, NULL);

    /* errors: each names the variables */
    const char *e1[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=8", "SLURM_NTASKS=8", "SLURM_LOCALID=0", "SLURM_JOB_NODELIST=n1", NULL};
    const char *e2[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=1", "SLURM_NTASKS=8", "SLURM_JOB_NODELIST=n1", NULL};
    const char *e3[] = {"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2", NULL};
    const char *e4[] = {"RANK=0", "MASTER_PORT=1", NULL};
    const char *e5[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=1", "SLURM_NTASKS=x", "SLURM_LOCALID=0", NULL};
    const char *e6[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", NULL};
    const char *e7[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=1", "SLURM_NTASKS=2", "SLURM_LOCALID=1", "SLURM_JOB_NODELIST=node[1-", NULL};
    const char *e8[] = {"SLURM_STEP_ID=0", "SLURM_PROCID=1", "SLURM_NTASKS=8", "SLURM_LOCALID=8", "SLURM_JOB_NODELIST=n1", NULL};
    const char *e9[] = {"OMPI_COMM_WORLD_RANK=4", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=0", NULL};
    const char *e10[] = {"OMPI_COMM_WORLD_RANK=1", "OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_LOCAL_RANK=1", "OMPI_COMM_WORLD_LOCAL_SIZE=2", NULL};
    const char *e11[] = {"RANK=1", "WORLD_SIZE=2", "MASTER_PORT=70000", NULL};
    const char *e12[] = {"RANK=-1", "WORLD_SIZE=2", NULL};
    ok = launch_fails(e1, "SLURM_PROCID=8 but SLURM_NTASKS=8", "below") && launch_fails(e2, "SLURM_LOCALID is not set", NULL) &&
         launch_fails(e3, "OMPI_COMM_WORLD_LOCAL_RANK is not set", NULL) && launch_fails(e4, "RANK is set but WORLD_SIZE is not", NULL) &&
         launch_fails(e5, "SLURM_NTASKS=x is not an integer", NULL) && launch_fails(e6, "SLURM_JOB_NODELIST", "MASTER_ADDR") &&
         launch_fails(e7, "SLURM_JOB_NODELIST", "node[1-") && launch_fails(e8, "SLURM_LOCALID=8 but SLURM_NTASKS=8", NULL) &&
         launch_fails(e9, "OMPI_COMM_WORLD_RANK=4 but OMPI_COMM_WORLD_SIZE=4", NULL) && launch_fails(e10, "set MASTER_ADDR", NULL) &&
         launch_fails(e11, "MASTER_PORT=70000", NULL) && launch_fails(e12, "RANK=-1", NULL);
    report("launch: missing, malformed, inconsistent values named", ok, NULL);

    /* Slurm's host lists */
    ok = host_is("node1,node2", 2, 0, "node1") && host_is("node1,node2", 2, 1, "node2") && host_is("node[01-04,07]", 5, 0, "node01") &&
         host_is("node[01-04,07]", 5, 3, "node04") && host_is("node[01-04,07]", 5, 4, "node07") && host_is("gpu-a[1-2],gpu-b3", 3, 0, "gpu-a1") &&
         host_is("gpu-a[1-2],gpu-b3", 3, 2, "gpu-b3") && host_is("r[1-2]-n[01-02]", 4, 1, "r1-n02") && host_is("r[1-2]-n[01-02]", 4, 2, "r2-n01") &&
         host_is("n[8-11]", 4, 3, "n11") && host_is("n[098-100]", 3, 2, "n100") && host_is("n[098-100]", 3, 0, "n098") &&
         host_is("solo", 1, 0, "solo") && host_is("a,b[1-3]x,c", 5, 3, "b3x") && host_is("a,b", 2, 2, "");
    const char *bad[] = {"", "n[1-", "n[]", "n[2-1]", "n1,,n2", "n[a-b]", "n]1[", "n[1[2]]", "a,", "n[1-2", "n[1,]", "n[-3]"};
    int refused = 0;
    for (int i = 0; i < (int)(sizeof bad / sizeof bad[0]); i++) {
        char h[64];
        mt_err e;
        e.msg[0] = 0;
        if (mt_hostlist_host(bad[i], 0, h, sizeof h, &e) < 0 && e.msg[0]) refused++;
        else printf("  host list '%s' was read\n", bad[i]);
    }
    char tiny[5];
    mt_err e;
    int small = mt_hostlist_host("longhostname", 0, tiny, sizeof tiny, &e) < 0 && strstr(e.msg, "longer than 4");
    report("launch: Slurm host lists: ranges, padding, products; malformed refused", ok && small && refused == (int)(sizeof bad / sizeof bad[0]),
           "%d of %d malformed refused", refused, (int)(sizeof bad / sizeof bad[0]));
}

/* ./train as launched ranks on the CPU. CPU ranks are threads of one process,
 * so two launched processes cannot train together: with --launch-check they
 * meet at the rendezvous (the address from the host list, the port from the
 * job id, or MASTER_PORT) and end, each naming its rank; without it they are
 * refused. A world of one from srun or mpirun, and a batch script's variables,
 * start their own ranks: the same losses as without any launcher, bitwise. */
#define LAUNCH_CLEAN "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u MASTER_PORT -u MOETRAIN_PORT -u TORCHELASTIC_USE_AGENT_STORE " \
    "-u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_LOCAL_RANK -u OMPI_COMM_WORLD_LOCAL_SIZE -u SLURM_STEP_ID " \
    "-u SLURM_PROCID -u SLURM_NTASKS -u SLURM_LOCALID -u SLURM_STEP_NODELIST -u SLURM_JOB_NODELIST -u SLURM_NODELIST -u SLURM_JOB_ID " \
    "-u MOETRAIN_SUPERVISED "
static int port_bindable(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), ok;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_ANY); a.sin_port = htons((uint16_t)port);
    ok = fd >= 0 && !bind(fd, (struct sockaddr *)&a, sizeof a);
    if (fd >= 0) close(fd);
    return ok;
}
static void metrics_core(const char *path, int from, char *out, size_t cap);
static void test_cli_launch(void) {
    static char a[1 << 16], b[1 << 16], c[1 << 16], ma[1 << 14], mb[1 << 14];
    const char *f0 = TP("launch0.log"), *f1 = TP("launch1.log");
    /* srun's variables only: 2 tasks; the port derived from a job id whose port is free now */
    int job = (int)(getpid() % 1250), port = 0;
    for (int k = 0; k < 1250 && !port; k++)
        if (port_bindable(10000 + 16 * job)) port = 10000 + 16 * job;
        else job = (job + 1) % 1250;
    const char *slurm = "SLURM_STEP_ID=0 SLURM_JOB_ID=%d SLURM_JOB_NODELIST='127.0.0.[1-2]' SLURM_NTASKS=2";
    char v0[256], v1[256];
    snprintf(v0, sizeof v0, slurm, job);
    int rc = sh(a, sizeof a, LAUNCH_CLEAN "%s SLURM_PROCID=0 SLURM_LOCALID=0 %strain --device cpu --launch-check --timeout 30 > %s 2>&1 & p0=$!; "
                LAUNCH_CLEAN "%s SLURM_PROCID=1 SLURM_LOCALID=1 %strain --device cpu --launch-check --timeout 30 > %s 2>&1 & p1=$!; "
                "wait $p0; r0=$?; wait $p1; echo \"exit $r0 $?\"; cat %s %s", v0, BIN, f0, v0, BIN, f1, f0, f1);
    snprintf(v0, sizeof v0, "launch: slurm (SLURM_PROCID=0 of 2, SLURM_LOCALID=0) | rendezvous 127.0.0.1:%d (SLURM_JOB_NODELIST; SLURM_JOB_ID)", port);
    snprintf(v1, sizeof v1, "launch: slurm (SLURM_PROCID=1 of 2, SLURM_LOCALID=1) | rendezvous 127.0.0.1:%d", port);
    char *met = strstr(a, "met rank 0 ("), *met2 = met ? strstr(met + 1, "met rank 0 (") : NULL;
    int same = met && met2 && !strncmp(met, met2, (size_t)(strchr(met, ')') - met));
    report("CLI: 2 processes from srun's variables meet at rank 0", rc == 0 && port && strstr(a, "exit 0 0") && strstr(a, v0) && strstr(a, v1) &&
           strstr(a, "launch check: rank 0 of 2 (local 0)") && strstr(a, "launch check: rank 1 of 2 (local 1)") && same,
           "job %d -> port %d: %.300s", job, port, a);
    /* mpirun's variables only: one host, MASTER_PORT given */
    mt_err e;
    port = mt_free_port(&e);
    snprintf(v0, sizeof v0, "OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_SIZE=2 MASTER_PORT=%d", port);
    rc = sh(b, sizeof b, LAUNCH_CLEAN "%s OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_LOCAL_RANK=1 %strain --device cpu --launch-check --timeout 30 > %s 2>&1 & p1=$!; "
            LAUNCH_CLEAN "%s OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_LOCAL_RANK=0 %strain --device cpu --launch-check --timeout 30 > %s 2>&1 & p0=$!; "
            "wait $p0; r0=$?; wait $p1; echo \"exit $r0 $?\"; cat %s %s", v0, BIN, f1, v0, BIN, f0, f0, f1);
    snprintf(v1, sizeof v1, "launch: open mpi (OMPI_COMM_WORLD_RANK=1 of 2, OMPI_COMM_WORLD_LOCAL_RANK=1) | rendezvous 127.0.0.1:%d "
             "(default (every rank on this host); MASTER_PORT)", port);
    report("CLI: 2 processes from mpirun's variables meet at rank 0", rc == 0 && strstr(b, "exit 0 0") && strstr(b, v1) &&
           strstr(b, "launch check: rank 0 of 2") && strstr(b, "launch check: rank 1 of 2 (local 1)"), "%.300s", b);
    /* training on launched CPU processes: refused, naming the launcher; inconsistent variables: refused */
    int r1 = sh(a, sizeof a, LAUNCH_CLEAN "%s OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_LOCAL_RANK=1 %strain --device cpu --steps 1 2>&1", v0, BIN);
    int r2 = sh(b, sizeof b, LAUNCH_CLEAN "SLURM_STEP_ID=0 SLURM_PROCID=2 SLURM_NTASKS=2 SLURM_LOCALID=0 %strain --device cpu --steps 1 2>&1", BIN);
    report("CLI: launched CPU processes and inconsistent variables refused", r1 == 2 && strstr(a, "CPU ranks are threads of one process") &&
           strstr(a, "open mpi (OMPI_COMM_WORLD_RANK=1 of 2") && !strstr(a, "step ") && r2 == 2 && strstr(b, "SLURM_PROCID=2 but SLURM_NTASKS=2"),
           "%d %d: %.120s | %.120s", r1, r2, a, b);
    /* a world of one from srun or mpirun, a batch script's variables: the ranks started here, bitwise */
    const char *mself = TP("launch_self.jsonl"), *mslurm = TP("launch_slurm.jsonl"), *mmpi = TP("launch_mpi.jsonl"), *mbatch = TP("launch_batch.jsonl");
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%strain --device cpu --nproc 2 --ep 2 --steps 4 --seed 1", BIN);
    int ra = sh(a, sizeof a, LAUNCH_CLEAN "%s --metrics %s 2>&1", cmd, mself);
    int rb = sh(b, sizeof b, LAUNCH_CLEAN "SLURM_STEP_ID=3 SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0 SLURM_JOB_NODELIST=n1 %s --metrics %s 2>&1",
                cmd, mslurm);
    metrics_core(mself, 1, ma, sizeof ma); metrics_core(mslurm, 1, mb, sizeof mb);
    int rs = strstr(b, "launch: self (a world of one from slurm (SLURM_PROCID=0 of 1") != NULL;
    int rc2 = sh(c, sizeof c, LAUNCH_CLEAN "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=1 OMPI_COMM_WORLD_LOCAL_RANK=0 %s --metrics %s 2>&1", cmd, mmpi);
    int rm = strstr(c, "launch: self (a world of one from open mpi") != NULL;
    static char mc[1 << 14], md[1 << 14];
    metrics_core(mmpi, 1, mc, sizeof mc);
    int same3 = !ra && !rb && !rc2 && strstr(ma, "{\"step\":4,") && !strcmp(ma, mb) && !strcmp(ma, mc);
    int rd = sh(b, sizeof b, LAUNCH_CLEAN "SLURM_PROCID=0 SLURM_NTASKS=8 SLURM_LOCALID=0 SLURM_JOB_ID=9 %s --metrics %s 2>&1", cmd, mbatch);
    int quiet = !strstr(b, "launch:") && strstr(b, "ranks: 2 (CPU threads)");
    metrics_core(mbatch, 1, md, sizeof md);
    report("CLI: a world of one from srun or mpirun, a batch script: = self-launched", same3 && rs && rm && !rd && quiet && !strcmp(ma, md),
           "%d %d %d %d%s", ra, rb, rc2, rd, same3 ? ", 4 steps' losses and grad norms bitwise" : "");
    remove(f0); remove(f1); remove(mself); remove(mslurm); remove(mmpi); remove(mbatch);
}


/* ./train: 20 steps straight = 10 + --save + --load + 10, to the byte; a mismatched config refused; divergence stops cleanly. */
static void test_cli_resume(void) {
    static char a[1 << 16], b[1 << 16], m1[1 << 15], m2[1 << 15];
    char d1[256], d2[256], p[600], q[600];
    scratch_dir(d1, sizeof d1, "cli1");
    scratch_dir(d2, sizeof d2, "cli2");
    int r1 = sh(a, sizeof a, "%strain --steps 20 --seed 3 --warmup 4 --metrics %s/m.jsonl --save %s/ck 2>&1", BIN, d1, d1);
    int r2 = sh(a, sizeof a, "%strain --steps 10 --seed 3 --warmup 4 --decay-steps 20 --save %s/ck 2>&1", BIN, d2);
    int r3 = sh(b, sizeof b, "%strain --steps 20 --load %s/ck --save %s/ck --metrics %s/m.jsonl 2>&1", BIN, d2, d2, d2);
    snprintf(p, sizeof p, "%s/m.jsonl", d1); metrics_core(p, 11, m1, sizeof m1);
    snprintf(q, sizeof q, "%s/m.jsonl", d2); metrics_core(q, 1, m2, sizeof m2);
    int same_metrics = strlen(m1) > 100 && !strcmp(m1, m2) && strstr(m2, "{\"step\":11,") && !strstr(m2, "{\"step\":10,");
    snprintf(p, sizeof p, "%s/ck/model.safetensors", d1); snprintf(q, sizeof q, "%s/ck/model.safetensors", d2);
    int same_model = same_file(p, q);
    snprintf(p, sizeof p, "%s/ck/optimizer-step20.safetensors", d1); snprintf(q, sizeof q, "%s/ck/optimizer-step20.safetensors", d2);
    int same_opt = same_file(p, q);
    report("CLI: 20 steps = 10 + --save + --load + 10, bitwise", !r1 && !r2 && !r3 && same_metrics && same_model && same_opt,
           "steps 11..20 %s; checkpoints %s%s", same_metrics ? "identical" : "DIFFER", same_model && same_opt ? "byte-identical" : "DIFFER",
           strstr(b, "resuming") ? "" : " (no resume line)");
    /* another preset than the checkpoint's: refused, naming fields; --adopt-config continues with the checkpoint's */
    int rc = sh(a, sizeof a, "%strain --preset debug --load %s/ck --steps 21 2>&1", BIN, d2);
    int named = rc == 2 && strstr(a, "dim 64 vs 256") && strstr(a, "n_layers 3 vs 6") && !strstr(a, "step ");
    int ra = sh(b, sizeof b, "%strain --preset debug --load %s/ck --steps 21 --adopt-config 2>&1", BIN, d2);
    int adopted = ra == 0 && strstr(b, "adopted the checkpoint's model config") && strstr(b, "step    21") && strstr(b, "preset=tiny");
    report("CLI: checkpoint config differs: refused, or adopted when asked", named && adopted, "%d %d: %.150s", rc, ra, a);
    /* divergence: stops at the step, names what is intact, saved nothing after it */
    rc = sh(a, sizeof a, "%strain --lr 10 --weight-decay 10 --warmup 0 --steps 40 --save %s/nan --save-every 2 2>&1", BIN, d1);
    snprintf(p, sizeof p, "%s/nan", d1);
    mt_run_state rs;
    mt_err e;
    mt_run_state_init(&rs);
    int stopped = rc == 1 && strstr(a, "diverged") && strstr(a, "is intact") && !mt_checkpoint_read_run(p, &rs, &e) && rs.step >= 2 &&
                  rs.step < 40 && !strstr(a, "done:") && strstr(a, "replaying") && strstr(a, " wrote ");
    char want[64];
    snprintf(want, sizeof want, "step %d in", rs.step);
    stopped = stopped && strstr(a, want);
    int rn = sh(b, sizeof b, "%strain --lr 10 --weight-decay 10 --warmup 0 --steps 40 --nan-check 2>&1", BIN);
    int located = rn == 1 && strstr(b, "node ") && strstr(b, " wrote ");
    report("CLI: NaN/Inf stops the run, names the first op; the last checkpoint intact", stopped && located, "%.300s | %.160s",
           strstr(a, "train:") ? strstr(a, "train:") : a, strstr(b, "train:") ? strstr(b, "train:") : b);
    remove_tree(d1); remove_tree(d2);
}

/* ./train: the data format on the start-up line, a near-miss shard refused unless --data-format raw. */
static void test_cli_data_format(void) {
    static char a[1 << 16], b[1 << 16], c[1 << 16];
    char d[256], p[600], q[600], want[700];
    scratch_dir(d, sizeof d, "clidf");
    snprintf(p, sizeof p, "%s/shard.bin", d);
    write_shard(p, 20240520, 1, 600, 600, 2);
    snprintf(q, sizeof q, "%s/near.bin", d);
    write_shard(q, 20240502, 1, 600, 600, 2);   /* two digits swapped */
    int r1 = sh(a, sizeof a, "%strain --data %s --vocab-size 256 --steps 1 2>&1", BIN, p);
    snprintf(want, sizeof want, "data: %s (llm.c token shard, uint16, 600 tokens)", p);
    int named_bin = r1 == 0 && strstr(a, want);
    int r2 = sh(b, sizeof b, "%strain --data %s --vocab-size 256 --steps 1 2>&1", BIN, q);
    int refused = r2 == 1 && strstr(b, "looks like an llm.c/nanoGPT token shard") && strstr(b, "--data-format raw") && !strstr(b, "| loss");
    int r3 = sh(c, sizeof c, "%strain --data %s --data-format raw --vocab-size 256 --steps 1 2>&1", BIN, q);
    snprintf(want, sizeof want, "data: %s (raw bytes, 2,224 tokens)", q);
    int named_raw = r3 == 0 && strstr(c, want) && strstr(c, "step     1");
    int r4 = sh(a + strlen(a), sizeof a - strlen(a), "%strain --steps 1 2>&1", BIN);
    int named_emb = r4 == 0 && strstr(a, "data: embedded default corpus (");
    report("CLI: data format named; a near-miss shard refused", named_bin && refused && named_raw && named_emb,
           "%d %d %d %d: %.240s", r1, r2, r3, r4, strstr(b, "train:") ? strstr(b, "train:") : b);
    remove_tree(d);
}

/* ./train --save refuses to replace another run's checkpoint unless it is --load's directory or --overwrite. */
static void test_cli_save_refuses(void) {
    static char a[1 << 16], b[1 << 16], c[1 << 16];
    char d[256], ck[400], model[500], saved[600];
    scratch_dir(d, sizeof d, "clisv");
    snprintf(ck, sizeof ck, "%s/ck", d);
    snprintf(model, sizeof model, "%s/model.safetensors", ck);
    snprintf(saved, sizeof saved, "%s/before.safetensors", d);
    int s1 = sh(a, sizeof a, "%strain --steps 3 --seed 1 --save %s 2>&1 && cp %s %s", BIN, ck, model, saved);
    int s2 = sh(b, sizeof b, "%strain --steps 2 --seed 2 --save %s/ 2>&1", BIN, ck);
    int kept = s1 == 0 && s2 == 1 && strstr(b, "holds the checkpoint of another run (step 3)") && strstr(b, "--overwrite") &&
               !strstr(b, "| loss") && same_file(model, saved) && exists(ck, "optimizer-step3.safetensors");
    int s3 = sh(c, sizeof c, "%strain --steps 4 --load %s --save %s 2>&1", BIN, model, ck);   /* continuing it: its own */
    mt_run_state rs;
    mt_err e;
    int cont = s3 == 0 && !mt_checkpoint_read_run(ck, &rs, &e) && rs.step == 4;
    int s4 = sh(c, sizeof c, "%strain --steps 2 --seed 2 --save %s --overwrite 2>&1", BIN, ck);
    int over = s4 == 0 && !mt_checkpoint_read_run(ck, &rs, &e) && rs.step == 2 && rs.seed == 2 && !exists(ck, "optimizer-step4.safetensors");
    report("CLI: --save keeps another run's checkpoint", kept && cont && over, "%d %d %d %d: %.240s", s1, s2, s3, s4,
           strstr(b, "train:") ? strstr(b, "train:") : b);
    remove_tree(d);
}


/* Two safetensors files hold the same tensors, byte for byte (their metadata may differ). */
static int same_tensors(const char *p, const char *q, int *n) {
    mt__st x, y;
    mt_err e;
    int same = 0;
    *n = 0;
    if (mt__st_open(&x, p, 1, &e)) return 0;
    if (!mt__st_open(&y, q, 1, &e)) {
        same = x.n == y.n && x.n > 20;
        for (int i = 0; same && i < x.n; i++, ++*n) {
            const mt__st_t *t = mt__st_find(&y, x.t[i].name);
            same = t && t->end - t->begin == x.t[i].end - x.t[i].begin && !memcmp(x.data + x.t[i].begin, y.data + t->begin, (size_t)(t->end - t->begin));
        }
        mt__st_free(&y);
    }
    mt__st_free(&x);
    return same;
}

/* Tensor parallelism on the command line. (a) Checkpoints across meshes with tp: a state trained at
 * dp_shard 4 x tp 2 x ep 4 (it differs from the initial one) loads at 1 rank, at tp 2 alone and at ep 2
 * alone, each saving it again tensor for tensor (weights and AdamW moments), and the ep 2 copy loads
 * back at the seeds' mesh, the same again. (b) precompile --tp 2 --ep 2, then train --graph: the
 * weights after 4 steps bitwise those of the in-process run. */
static void test_cli_tensor_parallel(void) {
    static char a[1 << 16];
    char d[256], p[600], q[600];
    scratch_dir(d, sizeof d, "clitp");
    const char *run = "--preset tiny --seed 3 --warmup 2 --decay-steps 12", *seeds = "--nproc 8 --dp-shard 4 --tp 2 --ep 4";
    int r0 = sh(a, sizeof a, "%strain %s %s --steps 3 --save %s/seeds 2>&1", BIN, run, seeds, d);
    int r1 = sh(a, sizeof a, "%strain %s --steps 0 --save %s/init 2>&1", BIN, run, d);
    static const char *const at[3][2] = {{"one", "--nproc 1"}, {"tp2", "--nproc 2 --tp 2"}, {"ep2", "--nproc 2 --ep 2"}};
    int ok = !r0 && !r1, n = 0, m = 0, k;
    snprintf(p, sizeof p, "%s/seeds/model.safetensors", d); snprintf(q, sizeof q, "%s/init/model.safetensors", d);
    int trained = ok && !same_tensors(p, q, &n);
    char got[256] = "";
    for (k = 0; k < 4 && ok; k++) {   /* from the seeds' mesh to each; then from ep 2 back to the seeds' mesh */
        const char *name = k < 3 ? at[k][0] : "back", *flags = k < 3 ? at[k][1] : seeds, *from = k < 3 ? "seeds" : "ep2";
        ok = !sh(a, sizeof a, "%strain %s %s --steps 3 --load %s/%s --save %s/%s 2>&1", BIN, run, flags, d, from, d, name);
        snprintf(p, sizeof p, "%s/seeds/model.safetensors", d); snprintf(q, sizeof q, "%s/%s/model.safetensors", d, name);
        ok = ok && same_tensors(p, q, &n);
        snprintf(p, sizeof p, "%s/seeds/optimizer-step3.safetensors", d); snprintf(q, sizeof q, "%s/%s/optimizer-step3.safetensors", d, name);
        ok = ok && same_tensors(p, q, &m);
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%s", k ? ", " : "", name);
    }
    report("CLI: a dp_shard 4 x tp 2 x ep 4 checkpoint loads at 1 rank, tp 2, ep 2 and back, tensor for tensor", ok && trained,
           "%d weights and %d moments equal through %s; trained state %s the initial one %.200s", n, m, got, trained ? "differs from" : "EQUALS",
           ok ? "" : a);
    int r2 = sh(a, sizeof a, "%sprecompile --preset tiny --tp 2 --ep 2 -o %s/tp.mtg 2>&1", BIN, d);
    int r3 = r2 ? -1 : sh(a, sizeof a, "%strain --graph %s/tp.mtg --seed 3 --steps 4 --save %s/pre 2>&1", BIN, d, d);
    int r4 = sh(a, sizeof a, "%strain --preset tiny --nproc 2 --tp 2 --ep 2 --seed 3 --steps 4 --save %s/inproc 2>&1", BIN, d);
    snprintf(p, sizeof p, "%s/pre/model.safetensors", d); snprintf(q, sizeof q, "%s/inproc/model.safetensors", d);
    int same = !r2 && !r3 && !r4 && same_tensors(p, q, &n);
    report("CLI: precompile --tp 2 --ep 2, train --graph = in-process, weights bitwise after 4 steps", same, "%d tensors (exit %d %d %d) %.200s", n, r2, r3,
           r4, same ? "" : a);
    remove_tree(d);
}

/* Checkpoints of sharded runs: every rank's shards assembled whole by rank 0 (the files one rank
 * writes), any mesh loads them. (a) 4 ranks (dp_shard 4, ep 2), 12 = 6 + save + load + 6: metrics
 * and checkpoint bytes bitwise; (b) a 4-rank checkpoint of the initial state holds the bytes one
 * rank's has; (c) across meshes, trained states: a checkpoint loaded on another mesh and saved again
 * holds the same tensors bitwise, and the run continued from it follows the original mesh's run. */
static void test_cli_sharded_checkpoint(void) {
    static char a[1 << 16], m1[1 << 15], m2[1 << 15];
    char d[256], p[600], q[600];
    scratch_dir(d, sizeof d, "clish");
    const char *four = "--nproc 4 --dp-shard 4 --ep 2", *run = "--preset tiny --seed 5 --warmup 2 --decay-steps 12";
    int r1 = sh(a, sizeof a, "%strain %s %s --steps 12 --metrics %s/m1.jsonl --save %s/full 2>&1", BIN, run, four, d, d);
    int r2 = sh(a, sizeof a, "%strain %s %s --steps 6 --save %s/half 2>&1", BIN, run, four, d);
    int r3 = sh(a, sizeof a, "%strain %s %s --steps 12 --load %s/half --save %s/cont --metrics %s/m2.jsonl 2>&1", BIN, run, four, d, d, d);
    snprintf(p, sizeof p, "%s/m1.jsonl", d); metrics_core(p, 7, m1, sizeof m1);
    snprintf(q, sizeof q, "%s/m2.jsonl", d); metrics_core(q, 1, m2, sizeof m2);
    int same_metrics = strlen(m1) > 100 && !strcmp(m1, m2) && strstr(m2, "{\"step\":7,");
    snprintf(p, sizeof p, "%s/full/model.safetensors", d); snprintf(q, sizeof q, "%s/cont/model.safetensors", d);
    int same_model = same_file(p, q);
    snprintf(p, sizeof p, "%s/full/optimizer-step12.safetensors", d); snprintf(q, sizeof q, "%s/cont/optimizer-step12.safetensors", d);
    int same_opt = same_file(p, q);
    int parts_left = 0;
    snprintf(p, sizeof p, "%s/cont", d);
    DIR *dir = opendir(p);
    for (struct dirent *de; dir && (de = readdir(dir));) parts_left += !strncmp(de->d_name, ".mt-part", 8);
    if (dir) closedir(dir);
    report("CLI: 4 ranks, 12 steps = 6 + --save + --load + 6, bitwise", !r1 && !r2 && !r3 && same_metrics && same_model && same_opt && !parts_left,
           "steps 7..12 %s; checkpoints %s; %d parts left", same_metrics ? "identical" : "DIFFER", same_model && same_opt ? "byte-identical" : "DIFFER",
           parts_left);
    /* (b) the initial state: the tensors one rank saves (metadata names the mesh, so compare tensors) */
    int r4 = sh(a, sizeof a, "%strain %s %s --steps 0 --save %s/init4 2>&1", BIN, run, four, d);
    int r5 = sh(a, sizeof a, "%strain %s --steps 0 --save %s/init1 2>&1", BIN, run, d);
    int r8x = sh(a, sizeof a, "%strain %s --nproc 8 --dp-replicate 2 --dp-shard 4 --ep 4 --steps 0 --save %s/init8 2>&1", BIN, run, d);
    int n4 = 0, n8 = 0;
    snprintf(q, sizeof q, "%s/init1/model.safetensors", d);
    snprintf(p, sizeof p, "%s/init4/model.safetensors", d);
    int same4 = !r4 && !r5 && same_tensors(p, q, &n4);
    snprintf(p, sizeof p, "%s/init8/model.safetensors", d);
    int same8 = !r8x && !r5 && same_tensors(p, q, &n8);
    report("CLI: 4- and 8-rank checkpoints hold one rank's tensors (initial state)", same4 && same8,
           "4 ranks (dp_shard 4, ep 2): %d tensors %s; 8 (2 x dp_shard 4, ep 4): %d %s", n4, same4 ? "equal" : "DIFFER", n8, same8 ? "equal" : "DIFFER");
    /* (c) across meshes, from trained states (a --load that did nothing would start from the initial weights):
     * 1 -> 4: one rank's step-3 checkpoint, loaded by 4 ranks and saved again at once, holds the same tensors
     * (weights and moments) byte for byte, and 4 ranks continuing from it follow one rank's straight run;
     * 4 -> 1 and 4 -> 2: the 4-rank step-6 checkpoint likewise, against the 4-rank run's steps 7..12 */
    static char l5[1 << 16];
    int rt1 = sh(a, sizeof a, "%strain %s --batch 32 --steps 3 --save %s/t1 2>&1", BIN, run, d);
    int rs1 = sh(a, sizeof a, "%strain %s --batch 32 --steps 6 --metrics %s/s1.jsonl 2>&1", BIN, run, d);
    int r14 = sh(a, sizeof a, "%strain %s %s --steps 6 --load %s/t1 --metrics %s/m14.jsonl 2>&1", BIN, run, four, d, d);
    int rr4 = sh(a, sizeof a, "%strain %s %s --steps 3 --load %s/t1 --save %s/t1as4 2>&1", BIN, run, four, d, d);
    int r41 = sh(a, sizeof a, "%strain %s --batch 32 --steps 12 --load %s/half --metrics %s/m41.jsonl 2>&1", BIN, run, d, d);
    int rr1 = sh(a, sizeof a, "%strain %s --batch 32 --steps 6 --load %s/half --save %s/halfas1 2>&1", BIN, run, d, d);
    int r42 = sh(l5, sizeof l5, "%strain %s --nproc 2 --dp-shard 2 --ep 2 --batch 16 --steps 12 --load %s/half --metrics %s/m42.jsonl 2>&1", BIN, run, d, d);
    int nm = 0, no = 0, nm4 = 0, no4 = 0;
    snprintf(p, sizeof p, "%s/t1as4/model.safetensors", d); snprintf(q, sizeof q, "%s/t1/model.safetensors", d);
    int same14 = !rt1 && !rr4 && same_tensors(p, q, &nm);
    snprintf(p, sizeof p, "%s/t1as4/optimizer-step3.safetensors", d); snprintf(q, sizeof q, "%s/t1/optimizer-step3.safetensors", d);
    same14 = same14 && same_tensors(p, q, &no);
    snprintf(p, sizeof p, "%s/halfas1/model.safetensors", d); snprintf(q, sizeof q, "%s/half/model.safetensors", d);
    int same41 = !r2 && !rr1 && same_tensors(p, q, &nm4);
    snprintf(p, sizeof p, "%s/halfas1/optimizer-step6.safetensors", d); snprintf(q, sizeof q, "%s/half/optimizer-step6.safetensors", d);
    same41 = same41 && same_tensors(p, q, &no4);
    cli_curve cs1, c14, cm1, c41, c42;
    char path[5][600];
    const char *names[5] = {"s1", "m14", "m1", "m41", "m42"};
    cli_curve *cv[5] = {&cs1, &c14, &cm1, &c41, &c42};
    for (int k = 0; k < 5; k++) { snprintf(path[k], sizeof path[k], "%s/%s.jsonl", d, names[k]); cli_curve_read(path[k], cv[k]); }
    double e14 = !rs1 && !r14 && c14.n == 3 ? cli_curve_err(&c14, &cs1, 4, 6, 0) : 1, e41 = !r41 && c41.n == 6 ? cli_curve_err(&c41, &cm1, 7, 12, 0) : 1;
    double e42 = !r42 && c42.n == 6 ? cli_curve_err(&c42, &cm1, 7, 12, 0) : 1;
    double moved = cs1.n == 6 ? fabs(cs1.loss[4] - cs1.loss[1]) / cs1.loss[1] : 0;   /* the state at step 3 is not the initial one */
    report("CLI: trained checkpoints move across meshes (1 -> 4, 4 -> 1 bitwise; 4 -> 2)", same14 && same41 && e14 <= 2.5e-7 && e41 <= 2.5e-7 &&
           e42 <= 2.5e-7 && moved > 1e-3,
           "1 rank's step 3 saved by 4 ranks: %d + %d tensors %s, continued: worst rel loss %.1e; 4 ranks' step 6 saved by 1 rank: %d + %d %s, "
           "continued on 1 rank %.1e, on 2 ranks %.1e (bound 2.5e-7: two ulps of the loss)%s%.200s", nm, no, same14 ? "bitwise" : "DIFFER", e14, nm4, no4,
           same41 ? "bitwise" : "DIFFER", e41, e42, r42 ? ": " : "", r42 ? l5 : "");
    remove_tree(d);
}

/* --moments bf16 on the command line: (a) 4 ranks (dp_shard 4, ep 2), 8 = 4 + save + load + 4 bitwise (the
 * resumed run takes the checkpoint's moments' dtype), every optimizer tensor BF16; (b) that checkpoint loaded
 * by one rank and saved again: the same tensors, byte for byte; (c) resuming it with --moments fp32: said;
 * (d) precompile --moments bf16 then train --graph = the in-process run, bitwise; the artifact's dtype is
 * not overridden; malformed values refused. */
static void test_cli_moments(void) {
    static char a[1 << 16], b[1 << 16], m1[1 << 14], m2[1 << 14];
    char d[256], p[600], q[600];
    scratch_dir(d, sizeof d, "climo");
    const char *four = "--nproc 4 --dp-shard 4 --ep 2", *run = "--preset tiny --seed 4 --warmup 2 --decay-steps 8";
    int r1 = sh(a, sizeof a, "%strain %s %s --moments bf16 --steps 8 --metrics %s/m1.jsonl --save %s/full 2>&1", BIN, run, four, d, d);
    int banner = strstr(a, "AdamW moments in bf16") != NULL;
    int r2 = sh(b, sizeof b, "%strain %s %s --moments bf16 --steps 4 --save %s/half 2>&1", BIN, run, four, d);
    int r3 = sh(b, sizeof b, "%strain %s %s --steps 8 --load %s/half --save %s/cont --metrics %s/m2.jsonl 2>&1", BIN, run, four, d, d, d);
    int adopted = strstr(b, "AdamW moments in bf16") && !strstr(b, "changed from the saved run");
    snprintf(p, sizeof p, "%s/m1.jsonl", d); metrics_core(p, 5, m1, sizeof m1);
    snprintf(q, sizeof q, "%s/m2.jsonl", d); metrics_core(q, 1, m2, sizeof m2);
    int same_metrics = n_lines(m1) == 4 && !strcmp(m1, m2);
    snprintf(p, sizeof p, "%s/full/model.safetensors", d); snprintf(q, sizeof q, "%s/cont/model.safetensors", d);
    int same_ck = same_file(p, q);
    snprintf(p, sizeof p, "%s/full/optimizer-step8.safetensors", d); snprintf(q, sizeof q, "%s/cont/optimizer-step8.safetensors", d);
    same_ck = same_ck && same_file(p, q);
    snprintf(p, sizeof p, "%s/full", d);
    int n_opt = 0, n_bf = opt_file_dtype(p, MT__ST_BF16, &n_opt);
    report("CLI: --moments bf16, 4 ranks, 8 steps = 4 + --save + --load + 4, bitwise", !r1 && !r2 && !r3 && banner && adopted && same_metrics &&
           same_ck && n_opt > 20 && n_bf == n_opt, "steps 5..8 %s; checkpoints %s; %d of %d optimizer tensors BF16; dtype %s on resuming %.200s",
           same_metrics ? "identical" : "DIFFER", same_ck ? "byte-identical" : "DIFFER", n_bf, n_opt, adopted ? "kept" : "NOT kept",
           r1 || r2 || r3 ? b : "");
    /* (b) 4 ranks' bf16 parts assembled by rank 0, loaded by one rank, saved again */
    int r4 = sh(a, sizeof a, "%strain %s --batch 32 --steps 4 --load %s/half --save %s/as1 2>&1", BIN, run, d, d);
    int nm = 0, no = 0;
    snprintf(p, sizeof p, "%s/half/model.safetensors", d); snprintf(q, sizeof q, "%s/as1/model.safetensors", d);
    int same1 = !r4 && same_tensors(p, q, &nm);
    snprintf(p, sizeof p, "%s/half/optimizer-step4.safetensors", d); snprintf(q, sizeof q, "%s/as1/optimizer-step4.safetensors", d);
    same1 = same1 && same_tensors(p, q, &no);
    report("CLI: a 4-rank bf16-moment checkpoint loads at 1 rank and saves again, tensor for tensor", same1, "%d weights, %d moments %s %.200s",
           nm, no, same1 ? "equal" : "DIFFER", r4 ? a : "");
    /* (c) another dtype on resuming: converted, and said */
    int r5 = sh(a, sizeof a, "%strain %s %s --moments fp32 --steps 5 --load %s/half 2>&1", BIN, run, four, d);
    int said = !r5 && strstr(a, "AdamW moments bf16 -> fp32 (the saved moments widened to fp32 exactly on loading)") &&
               !strstr(a, "AdamW moments in bf16") && strstr(a, "step     5");
    /* (d) the artifact */
    int r6 = sh(b, sizeof b, "%sprecompile --preset tiny --moments bf16 -o %s/bf.mtg 2>&1", BIN, d);
    int sized = !r6 && strstr(b, "AdamW moments 1.10 MiB (bf16)");
    int r7 = sh(b, sizeof b, "%strain --graph %s/bf.mtg --seed 4 --steps 3 --metrics %s/g.jsonl 2>&1", BIN, d, d);
    int r8 = sh(b, sizeof b, "%strain --preset tiny --moments bf16 --seed 4 --steps 3 --metrics %s/i.jsonl 2>&1", BIN, d);
    snprintf(p, sizeof p, "%s/g.jsonl", d); metrics_core(p, 1, m1, sizeof m1);
    snprintf(q, sizeof q, "%s/i.jsonl", d); metrics_core(q, 1, m2, sizeof m2);
    int same_graph = !r7 && !r8 && n_lines(m1) == 3 && !strcmp(m1, m2);
    int r9 = sh(b, sizeof b, "%strain --graph %s/bf.mtg --moments fp32 --steps 1 2>&1", BIN, d);
    int fixed = r9 == 2 && strstr(b, "compiled with bf16 AdamW moments");
    int r10 = sh(b, sizeof b, "%strain --moments fp16 --steps 1 2>&1", BIN), r11 = sh(b + 4096, sizeof b - 4096, "%sprecompile --moments x -o %s/x.mtg 2>&1", BIN, d);
    int refused = r10 == 2 && strstr(b, "--moments takes fp32 or bf16") && r11 == 2 && strstr(b + 4096, "--moments takes fp32 or bf16");
    report("CLI: --moments: a resume in fp32 said; precompile --moments bf16 + train --graph = in-process; refusals", said && sized && same_graph &&
           fixed && refused, "resume note %s; precompile %s; 3 steps %s; --graph + --moments fp32 exit %d; malformed exit %d %d",
           said ? "printed" : "MISSING", sized ? "sized the moments" : "NO moment size", same_graph ? "identical" : "DIFFER", r9, r10, r11);
    remove_tree(d);
}

/* ======================================================================
 * activation recompute: the budget, many ranks, the artifact, the CLIs
 * ==================================================================== */

/* (c) The planned peak fits the budget and is lower than without; the
 * fewest blocks are taken; an impossible budget is refused, naming it and
 * the smallest peak there is. */
static void test_recompute_budget(void) {
    mt_config c;
    mt_mesh m;
    mt_err e;
    mt_graph g0, ga, g1, g2, gn;
    rc_tiny(&c);
    mt_mesh_single(&m);
    if (compile_rc(&g0, &c, &m, 0, 0, &e) || compile_rc(&ga, &c, &m, -1, 0, &e)) { report("recompute: budget", 0, "%s", e.msg); return; }
    int64_t p0 = mt_graph_peak_bytes(&g0), pa = mt_graph_peak_bytes(&ga);
    /* a budget just below the peak without recompute: one block is enough */
    int ok1 = compile_rc(&g1, &c, &m, 0, p0 - 1, &e) == 0;
    int64_t p1 = ok1 ? mt_graph_peak_bytes(&g1) : 0;
    report("recompute: a budget just under the peak: one block, fits", ok1 && g1.n_recompute == 1 && p1 <= p0 - 1 && p1 < p0 &&
           g1.memory_budget == p0 - 1 && g1.peak_no_recompute == p0 && mt_plan_check(&g1, &e) == 0,
           "block %d, %.3f -> %.3f MiB %s", ok1 && g1.n_recompute ? g1.recompute[0].layer : -1, p0 / 1048576.0, p1 / 1048576.0, ok1 ? "" : e.msg);
    /* the smallest peak there is: an impossible budget names it; it is met, and one byte less is not */
    int r1 = compile_rc(&gn, &c, &m, 0, 1, &e) != 0;
    const char *at = strstr(e.msg, "the smallest planned peak is ");
    at = at ? strchr(at, '(') : NULL;
    long long smallest = at ? atoll(at + 1) : 0;
    int ok2 = r1 && smallest > g0.persist_bytes && smallest <= pa && compile_rc(&g2, &c, &m, 0, smallest, &e) == 0;
    int64_t saved = 0;
    for (int i = 0; ok2 && i < g2.n_recompute; i++) saved += g2.recompute[i].saved_bytes;
    report("recompute: the smallest peak there is: met, under every block's", ok2 && g2.n_recompute >= 1 &&
           mt_graph_peak_bytes(&g2) <= smallest && pa < p0 && saved > 0 && mt_plan_check(&g2, &e) == 0,
           "%.3f MiB with %d blocks (every block %.3f, none %.3f MiB), %.3f MiB of activations not held %s", smallest / 1048576.0,
           ok2 ? g2.n_recompute : -1, pa / 1048576.0, p0 / 1048576.0, saved / 1048576.0, ok2 ? "" : e.msg);
    char want_b[64], want_p[64];
    snprintf(want_b, sizeof want_b, "(%lld bytes)", smallest - 1);
    snprintf(want_p, sizeof want_p, "(%lld bytes", smallest);
    int refused = compile_rc(&gn, &c, &m, 0, smallest - 1, &e) != 0 && strstr(e.msg, "cannot be met") && strstr(e.msg, want_b) &&
                  strstr(e.msg, want_p);
    report("recompute: an impossible budget is refused, naming budget and smallest peak", refused, "%.200s", e.msg);
    /* a budget the plan meets as it is: no recompute, the same graph */
    mt_graph gb;
    uint8_t *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    int ok3 = compile_rc(&gb, &c, &m, 0, p0, &e) == 0;
    ok3 = ok3 && gb.n_recompute == 0 && gb.n_nodes == g0.n_nodes && gb.arena_bytes == g0.arena_bytes;
    gb.memory_budget = 0; gb.peak_no_recompute = 0;   /* the only difference */
    ok3 = ok3 && mt_artifact_write(&gb, &x, &nx, &e) == 0 && mt_artifact_write(&g0, &y, &ny, &e) == 0 && nx == ny && !memcmp(x, y, nx);
    report("recompute: a budget that fits already changes nothing", ok3, NULL);
    free(x); free(y);
    if (ok3 || gb.values) mt_graph_free(&gb);
    /* eager plans give every value its own bytes: a budget needs the planner */
    mt_target t;
    mt_passes p;
    mt_graph ge;
    mt_target_cpu(&t);
    mt_passes_none(&p);
    p.memory_budget = p0;
    int eager = mt_compile(&ge, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) != 0 && strstr(e.msg, "memory planner");
    mt_passes_all(&p);
    p.memory_budget = 1;
    int fwd = mt_compile(&ge, &c, &m, &t, MT_GRAPH_FORWARD, &p, &e) != 0 && strstr(e.msg, "forward-only");
    int32_t bad[2] = {1, 1}, out[1] = {7};
    mt_graph gx;
    int ok4 = mt_build(&gx, &c, &m, &t, MT_GRAPH_TRAIN, &e) == 0;
    int twice = ok4 && mt_pass_recompute(&gx, bad, 2, &e) != 0 && strstr(e.msg, "twice");
    int range = ok4 && mt_pass_recompute(&gx, out, 1, &e) != 0 && strstr(e.msg, "no block 7");
    int fused = ok4 && mt_pass_fuse(&gx, &e) == 0 && mt_pass_recompute(&gx, bad, 1, &e) != 0 && strstr(e.msg, "before fusion");
    if (ok4) mt_graph_free(&gx);
    report("recompute: eager, forward-only, bad block lists, fused graphs refused", eager && fwd && twice && range && fused,
           "%d %d %d %d %d", eager, fwd, twice, range, fused);
    mt_graph_free(&g0); mt_graph_free(&ga);
    if (ok1) mt_graph_free(&g1);
    if (ok2) mt_graph_free(&g2);
}

/* (d) Many thread-ranks, FSDP + expert parallelism: the same bitwise run
 * with every block recomputed (the expert exchange and the all-gathers
 * re-run on every rank); received rows and expert counts not doubled. */
static int mr_compile_rc(mt_graph *g, int shard, int ep, int n, int64_t budget, mt_err *err) {
    mt_config c;
    mt_mesh m;
    mt_config_preset(&c, "tiny", err);
    c.seq_len = 32; c.original_seq_len = 32; c.batch = 2;
    if (mt_mesh_init(&m, 1, shard, 1, ep, err)) return -1;
    return compile_rc(g, &c, &m, n, budget, err);
}
/* FSDP at the turn from forward to backward: the weights the forward reads in its last block and after
 * (that block's, the final norm's, the output head's) keep their forward copies for the backward, which
 * reads them there; every earlier block's weights are gathered again. (Recompute: test_recompute_multirank
 * checks it gathers nothing itself and stays bitwise.) */
static void test_fsdp_turn(void) {
    mt_err e;
    mt_graph g;
    if (ov_compile_mesh(&g, "tiny", 1, 2, 2, 1, 1, &e)) { report("FSDP: the turn keeps its gathers", 0, "%s", e.msg); return; }
    int last = -1, again_last = 0, again_before = 0, kept_read = 0;
    for (int i = 0; i < g.n_forward_nodes; i++) if (g.nodes[i].layer > last) last = g.nodes[i].layer;
    for (int i = g.n_forward_nodes; i < g.n_nodes; i++) {
        const mt_node *n = &g.nodes[i];
        if (n->phase != MT_PHASE_BACKWARD) continue;
        if (n->op == MT_OP_ALLGATHER) {
            const char *w = g.values[n->out[0]].name;
            if (n->layer == last || !strncmp(w, "lm_head", 7) || !strncmp(w, "model.norm", 10)) again_last++;
            else again_before++;
        }
        for (int k = 0; k < n->n_in; k++)
            kept_read += n->in[k] >= 0 && !strcmp(g.values[n->in[k]].name, "lm_head.weight@full");
    }
    report("FSDP: the last block and the head keep their forward gathers for the backward", again_last == 0 && again_before > 0 && kept_read > 0,
           "gathered again: %d of the last block and head, %d earlier; the forward's head copy read %d times by the backward",
           again_last, again_before, kept_read);
    mt_graph_free(&g);
}

static void test_recompute_multirank(void) {
    const int meshes[2][2] = {{2, 2}, {4, 2}};   /* dp_shard, ep */
    for (int k = 0; k < 2; k++) {
        int shard = meshes[k][0], ep = meshes[k][1];
        mt_err e;
        mt_graph g0, ga, gb;
        char name[128];
        snprintf(name, sizeof name, "recompute on %d ranks (FSDP, ep %d): bitwise, counts once", shard, ep);
        if (mr_compile_rc(&g0, shard, ep, 0, 0, &e) || mr_compile_rc(&ga, shard, ep, -1, 0, &e)) { report(name, 0, "%s", e.msg); continue; }
        int64_t p0 = mt_graph_peak_bytes(&g0), pa = mt_graph_peak_bytes(&ga);
        int okb = mr_compile_rc(&gb, shard, ep, 0, pa + (p0 - pa) / 3, &e) == 0;
        int regather = 0, reexchange = 0;   /* the recompute reads the backward's gathers; its exchange re-runs */
        for (int i = 0; i < ga.n_nodes; i++) {
            const mt_node *n = &ga.nodes[i];
            if (n->phase != MT_PHASE_RECOMPUTE) continue;
            reexchange += n->op == MT_OP_EP_DISPATCH;
            for (int j = 0; j < n->n_in; j++) regather += n->in[j] >= 0 && strstr(ga.values[n->in[j]].name, "@full#2") != NULL;
            if (n->op == MT_OP_ALLGATHER) regather = -1000;   /* a second gather of a weight that is gathered anyway */
        }
        mr_job a, b, d;
        memset(&a, 0, sizeof a); memset(&b, 0, sizeof b); memset(&d, 0, sizeof d);
        a.fail_rank = b.fail_rank = d.fail_rank = -1;
        int ok = okb && mr_run(&a, &g0, 5, &e) == 0 && mr_run(&b, &ga, 5, &e) == 0 && mr_run(&d, &gb, 5, &e) == 0;
        int same = ok && bitwise_equal(a.loss, b.loss, 5) && bitwise_equal(a.gnorm, b.gnorm, 5) && bitwise_equal(a.loss, d.loss, 5) &&
                   bitwise_equal(a.gnorm, d.gnorm, 5);
        int counts = ok;
        for (int r = 0; ok && r < shard; r++) {
            same &= a.param_bytes[r] == b.param_bytes[r] && !memcmp(a.params[r], b.params[r], a.param_bytes[r]) &&
                    a.param_bytes[r] == d.param_bytes[r] && !memcmp(a.params[r], d.params[r], a.param_bytes[r]);
            counts &= a.recv_rows[r] == b.recv_rows[r] && a.recv_rows[r] == d.recv_rows[r] && a.recv_rows[r] > 0 &&
                      mt_runtime_n_moe_layers(a.rt[r]) == mt_runtime_n_moe_layers(b.rt[r]);
            for (int l = 0; l < mt_runtime_n_moe_layers(a.rt[r]); l++) {
                int32_t x[64], y[64];
                int E = mt_runtime_expert_counts(a.rt[r], l, x);
                counts &= E > 0 && mt_runtime_expert_counts(b.rt[r], l, y) == E && !memcmp(x, y, sizeof(int32_t) * (size_t)E);
            }
        }
        report(name, same && counts && regather > 0 && reexchange == g0.cfg.n_layers - g0.cfg.n_dense_layers,
               "%d blocks (budget: %d), peak %.2f -> %.2f MiB/rank, rows %lld, %d re-gathered weights read %s",
               ga.n_recompute, okb ? gb.n_recompute : -1, p0 / 1048576.0, pa / 1048576.0, (long long)a.recv_rows[0], regather,
               ok ? "" : e.msg);
        snprintf(name, sizeof name, "recompute on %d ranks: the budget's peak fits, lower", shard);
        report(name, okb && gb.n_recompute > 0 && mt_graph_peak_bytes(&gb) <= pa + (p0 - pa) / 3 && mt_graph_peak_bytes(&gb) < p0,
               "%.2f MiB", okb ? mt_graph_peak_bytes(&gb) / 1048576.0 : 0);
        mr_free(&a); mr_free(&b); mr_free(&d);
        mt_graph_free(&g0); mt_graph_free(&ga);
        if (okb) mt_graph_free(&gb);
    }
}

/* (e) The choice survives the artifact: precompiled with recompute = in
 * process with recompute, bitwise; the bytes are stable; the loader checks
 * the choice and keeps re-run routers away from the step's counts. */
static void test_recompute_artifact(void) {
    mt_config c;
    mt_mesh m;
    mt_err e;
    mt_graph g, g0, ld;
    rc_tiny(&c);
    mt_mesh_single(&m);
    if (compile_rc(&g0, &c, &m, 0, 0, &e)) { report("recompute artifact", 0, "%s", e.msg); return; }
    int64_t p0 = mt_graph_peak_bytes(&g0);
    if (compile_rc(&g, &c, &m, 0, p0 - 1, &e)) { report("recompute artifact", 0, "%s", e.msg); mt_graph_free(&g0); return; }
    uint8_t *bytes = NULL, *again = NULL;
    size_t len = 0, len2 = 0;
    rc_result r1, r2;
    int ok = mt_artifact_write(&g, &bytes, &len, &e) == 0 && mt_artifact_read(&ld, bytes, len, &e) == 0;
    int kept = ok && ld.n_recompute == g.n_recompute && ld.recompute[0].layer == g.recompute[0].layer &&
               ld.recompute[0].saved_bytes == g.recompute[0].saved_bytes && ld.memory_budget == p0 - 1 && ld.peak_no_recompute == p0;
    ok = ok && rc_train(&g, &r1, &e) == 0 && rc_train(&ld, &r2, &e) == 0;
    int same = ok && rc_same(&r1, &r2) && rc_same_experts(&r1, &r2);
    ok = ok && mt_artifact_write(&ld, &again, &len2, &e) == 0;
    report("recompute: artifact keeps the choice; precompiled = in-process, bitwise", kept && same && len2 == len && !memcmp(bytes, again, len),
           "%zu bytes, block %d %s", len, kept ? ld.recompute[0].layer : -1, ok ? "" : e.msg);
    report("recompute: the fingerprint covers the choice", mt_fingerprint(&g) != mt_fingerprint(&g0), NULL);
    if (ok) { rc_free(&r1); rc_free(&r2); }
    free(again);
    if (kept || ld.values) mt_graph_free(&ld);
    /* corrupt choices, written consistently: refused with a message */
    const char *why[4] = {"not a block", "no node re-runs it", "does not list", "only the forward router"};
    int refused = 0;
    char last[300] = "";
    for (int k = 0; k < 4; k++) {
        mt_graph x;
        uint8_t *b = NULL;
        size_t n = 0;
        if (mt_graph_copy(&x, &g, &e)) break;
        if (k == 0) x.recompute[0].layer = c.n_layers;
        if (k == 1) x.recompute[0].layer = (g.recompute[0].layer + 1) % c.n_layers;
        if (k == 2) x.n_recompute = 0;
        if (k == 3)   /* a re-run router that writes the step's counts: what would count its tokens twice */
            for (int i = 0; i < x.n_nodes; i++)
                if (x.nodes[i].op == MT_OP_ROUTER && x.nodes[i].phase == MT_PHASE_RECOMPUTE)
                    for (int j = 0; j < x.n_forward_nodes; j++)
                        if (x.nodes[j].op == MT_OP_ROUTER && x.nodes[j].layer == x.nodes[i].layer) x.nodes[i].out[3] = x.nodes[j].out[3];
        if (mt_artifact_write(&x, &b, &n, &e) == 0 && mt_artifact_read(&ld, b, n, &e) != 0 && strstr(e.msg, why[k])) refused++;
        else snprintf(last, sizeof last, "case %d: %s", k, e.msg);
        free(b);
        mt_graph_free(&x);
    }
    report("recompute: the loader refuses inconsistent choices", refused == 4, "%d of 4 %.200s", refused, last);
    free(bytes);
    mt_graph_free(&g); mt_graph_free(&g0);
}

/* (f) precompile --memory-budget, --dump shows the choice, train
 * --memory-budget and train --graph give the run without recompute. */
static void test_cli_recompute(void) {
    static char a[1 << 16], b[1 << 16], d[1 << 16], dump[1 << 22];
    const char *mtg = TP("rc.mtg");
    /* tiny on the CPU plans 12.28 MiB without recompute, 7.44 MiB recomputing all 3 blocks */
    static char ma[1 << 14], mb[1 << 14], md[1 << 14];
    const char *fa = TP("rc_a.jsonl"), *fb = TP("rc_b.jsonl"), *fd = TP("rc_d.jsonl");
    int ra = sh(a, sizeof a, "%sprecompile --preset tiny --memory-budget 0.0095 -o %s 2>&1 && %strain --graph %s --steps 4 --seed 1 --metrics %s 2>&1",
                BIN, mtg, BIN, mtg, fa);
    int rb = sh(b, sizeof b, "%strain --preset tiny --memory-budget 0.0095 --steps 4 --seed 1 --metrics %s 2>&1", BIN, fb);
    int banner = strstr(b, "blocks recomputed") && !strstr(b, " 0 of 3 blocks recomputed");
    int rd = sh(d, sizeof d, "%strain --preset tiny --steps 4 --seed 1 --metrics %s 2>&1", BIN, fd);
    metrics_core(fa, 1, ma, sizeof ma); metrics_core(fb, 1, mb, sizeof mb); metrics_core(fd, 1, md, sizeof md);
    report("CLI: --memory-budget: precompiled = in-process = no recompute, bitwise", !ra && !rb && !rd && banner && n_lines(ma) == 4 &&
           !strcmp(ma, mb) && !strcmp(ma, md), "4 steps: loss, grad norm, lr %s", ra || rb || rd ? "(a command failed)" :
           strcmp(ma, mb) || strcmp(ma, md) ? "DIFFER" : "identical");
    remove(fa); remove(fb); remove(fd);
    int rp = sh(dump, sizeof dump, "%sprecompile --dump %s 2>&1", BIN, mtg);
    report("CLI: --dump shows the recompute choice", rp == 0 && strstr(dump, "== recompute (2 of 3 blocks") && strstr(dump, "L1   (MoE)") &&
           strstr(dump, "not held from forward to backward") && strstr(dump, " rc  compute L1") && strstr(dump, "@rc") &&
           strstr(dump, "budget 9.73 MiB"), "%.120s", strstr(dump, "== recompute") ? strstr(dump, "== recompute") : "no section");
    int r1 = sh(a, sizeof a, "%sprecompile --preset tiny --memory-budget 0.001 -o %s 2>&1", BIN, mtg);
    int r2 = sh(b, sizeof b, "%strain --preset tiny --memory-budget 0.001 --steps 1 2>&1", BIN);
    int r3 = sh(d, sizeof d, "%sprecompile --memory-budget -1 -o %s 2>&1", BIN, mtg);
    int r4 = sh(dump, sizeof dump, "%strain --memory-budget x --steps 1 2>&1", BIN);
    report("CLI: impossible or malformed budgets refused", r1 == 1 && r2 == 1 && strstr(a, "cannot be met") && strstr(b, "7.44 MiB") &&
           r3 == 2 && r4 == 2 && strstr(d, "--memory-budget"), "%d %d %d %d: %.120s", r1, r2, r3, r4, b);
    remove(mtg);
}

/* ======================================================================
 * Multi-token prediction: the graph, the checkpoint's names, the artifact
 * ==================================================================== */

static void test_mtp(void) {
    mt_config c;
    mt_err e;
    mt_graph g0, g2;
    mt_config_preset(&c, "tiny", &e);
    c.batch = 2; c.seq_len = 16;
    /* (a) D = 0 builds none of it (no SHIFT_TOKENS, the loss ops' count and weight 0); D = 2: the depths' layers under
     * DeepSeek-V3's names, MoE blocks, the shared head not duplicated, each depth's loss over B*(T-k) rows with weight lambda/D */
    int ok = !compile_cpu(&g0, &c, MT_GRAPH_TRAIN, 1, &e);
    c.mtp_layers = 2;
    ok = ok && !compile_cpu(&g2, &c, MT_GRAPH_TRAIN, 1, &e);
    int shifts0 = 0, attrs0 = 0, shifts = 0, losses = 0, counts_ok = 1, moe = 0;
    for (int i = 0; ok && i < g0.n_nodes; i++) {
        const mt_node *n = &g0.nodes[i];
        shifts0 += n->op == MT_OP_SHIFT_TOKENS;
        if (n->op == MT_OP_CROSS_ENTROPY || n->op == MT_OP_CROSS_ENTROPY_BWD) attrs0 += n->iattr[1] != 0 || n->fattr[0] != 0;
    }
    for (int i = 0; ok && i < g2.n_nodes; i++) {
        const mt_node *n = &g2.nodes[i];
        shifts += n->op == MT_OP_SHIFT_TOKENS;
        moe += n->op == MT_OP_ROUTER && n->layer >= c.n_layers;
        if (n->op == MT_OP_CROSS_ENTROPY && n->layer >= c.n_layers) {
            int k = n->layer - c.n_layers + 1;
            losses++;
            counts_ok &= n->iattr[1] == c.batch * (c.seq_len - k) && n->fattr[0] == c.mtp_weight / 2;
        }
    }
    int names = ok;
    static const char *const want[] = {"model.layers.3.enorm.weight", "model.layers.3.hnorm.weight", "model.layers.3.eh_proj.weight",
                                       "model.layers.3.shared_head.norm.weight", "model.layers.4.self_attn.kv_a_proj_with_mqa.weight",
                                       "model.layers.4.mlp.experts.*.gate_proj.weight", "model.layers.4.post_attention_layernorm.weight",
                                       "mtp_loss.1", "mtp_loss.2"};
    for (size_t i = 0; names && i < sizeof want / sizeof want[0]; i++) names &= mt_graph_find(&g2, want[i]) >= 0;
    names = names && mt_graph_find(&g2, "model.layers.3.shared_head.head.weight") < 0 && mt_graph_find(&g2, "model.layers.5.enorm.weight") < 0;
    int eh = ok ? mt_graph_find(&g2, "model.layers.3.eh_proj.weight") : -1;
    names = names && eh >= 0 && g2.values[eh].dims[0] == c.dim && g2.values[eh].dims[1] == 2 * c.dim;
    report("MTP graph: none at D = 0; at D = 2 the layers 3, 4 by DeepSeek-V3's names, MoE, losses over B*(T-k)",
           ok && shifts0 == 0 && attrs0 == 0 && shifts == 4 && losses == 2 && counts_ok && moe == 2 && names,
           "D=0: %d shifts, %d loss attributes; D=2: %d shifts, %d MTP losses (counts/weights %s), %d MTP routers, names %s %s", shifts0, attrs0,
           shifts, losses, counts_ok ? "ok" : "WRONG", moe, names ? "ok" : "MISSING", ok ? "" : e.msg);
    if (ok) mt_graph_free(&g0);

    /* (b) checkpoint: the MTP layers on disk under their names, no copy of the shared head or embedding; config.json's
     * num_nextn_predict_layers; the round trip bitwise, and the resumed run the uninterrupted one (MTP loss included) */
    mt_hparams hp;
    mt_hparams_default(&hp);
    mt_runtime *a = ok ? make_runtime(&g2, 2, 0, 11) : NULL, *b = ok ? make_runtime(&g2, 2, 0, 999) : NULL;
    char dir[256];
    snprintf(dir, sizeof dir, "%s", TP("mtp_ckpt"));
    double la[6], lb[6], ma[6] = {0}, mb[6] = {0};
    int64_t N = (int64_t)c.batch * c.seq_len;
    int32_t *tok = (int32_t *)malloc(4 * (size_t)N), *tgt = (int32_t *)malloc(4 * (size_t)N);
    int rt_ok = a && b;
    for (int s = 0; rt_ok && s < 3; s++) {
        mt_step_stats st;
        make_batch(&c, s, tok, tgt);
        rt_ok = !mt_runtime_step(a, tok, tgt, s, &hp, &st, &e);
        la[s] = st.loss; ma[s] = st.mtp_loss;
    }
    int step = -1;
    mt_config c2;
    rt_ok = rt_ok && !mt_checkpoint_save(a, dir, 3, &e) && !mt_checkpoint_read_config(dir, &c2, &e) && mt_config_equal(&c, &c2) &&
            !mt_checkpoint_load(b, dir, &step, &e) && step == 3;
    int same = rt_ok;
    for (int i = 0; same && i < g2.n_values; i++)
        if (g2.values[i].role == MT_ROLE_PARAM || g2.values[i].role == MT_ROLE_OPT)
            same &= !memcmp(mt_runtime_value(a, i), mt_runtime_value(b, i), (size_t)g2.values[i].nbytes);
    for (int s = 3; same && s < 6; s++) {
        mt_step_stats sa, sb;
        memset(&sb, 0, sizeof sb);
        make_batch(&c, s, tok, tgt);
        same = !mt_runtime_step(a, tok, tgt, s, &hp, &sa, &e) && !mt_runtime_step(b, tok, tgt, s, &hp, &sb, &e);
        la[s] = sa.loss; lb[s] = sb.loss; ma[s] = sa.mtp_loss; mb[s] = sb.mtp_loss;
    }
    same = same && bitwise_equal(la + 3, lb + 3, 3) && bitwise_equal(ma + 3, mb + 3, 3) && ma[5] > 0 && ma[5] < ma[0];
    mt__st st;
    int disk = rt_ok && mt__st_open(&st, TP("mtp_ckpt/model.safetensors"), 1, &e) == 0;
    if (disk) {
        const mt__st_t *t = mt__st_find(&st, "model.layers.3.eh_proj.weight");
        disk = t && t->ndim == 2 && t->shape[0] == c.dim && t->shape[1] == 2 * c.dim && mt__st_find(&st, "model.layers.3.enorm.weight") &&
               mt__st_find(&st, "model.layers.4.hnorm.weight") && mt__st_find(&st, "model.layers.4.shared_head.norm.weight") &&
               mt__st_find(&st, "model.layers.4.mlp.experts.7.down_proj.weight") && mt__st_find(&st, "model.layers.4.self_attn.o_proj.weight") &&
               mt__st_find(&st, "model.layers.3.mlp.gate.e_score_correction_bias") && !mt__st_find(&st, "model.layers.3.shared_head.head.weight") &&
               !mt__st_find(&st, "model.layers.3.embed_tokens.weight");
        mt__st_free(&st);
    }
    uint8_t *json = NULL;
    size_t jl = 0;
    int cfg = rt_ok && !mt_read_file(TP("mtp_ckpt/config.json"), &json, &jl, &e);
    uint8_t *z = cfg ? (uint8_t *)realloc(json, jl + 1) : NULL;   /* the file's bytes are not a C string */
    if (z) { json = z; json[jl] = 0; }
    cfg = z && strstr((const char *)json, "\"num_nextn_predict_layers\": 2,") && strstr((const char *)json, "\"num_hidden_layers\": 3,");
    free(json);
    report("MTP checkpoint: DeepSeek-V3's names on disk, config.json, round trip and resume bitwise", rt_ok && same && disk && cfg,
           "loss %.4f -> %.4f, MTP loss %.4f -> %.4f; names %s, config.json %s %s", la[0], la[5], ma[0], ma[5], disk ? "ok" : "WRONG",
           cfg ? "ok" : "WRONG", rt_ok ? "" : e.msg);
    /* a model without MTP does not take this checkpoint (nor the reverse): the config names the difference */
    int refused = 0;
    c2 = c; c2.mtp_layers = 0;
    if (ok && !compile_cpu(&g0, &c2, MT_GRAPH_TRAIN, 1, &e)) {
        mt_runtime *d = make_runtime(&g0, 1, 0, 1);
        refused = d && mt_checkpoint_load(d, dir, NULL, &e) != 0 && strstr(e.msg, "mtp_layers 2 vs 0") != NULL;
        mt_runtime_destroy(d);
        mt_graph_free(&g0);
    }
    char why[300];
    snprintf(why, sizeof why, "%s", e.msg);
    c2 = c; c2.mtp_weight = 0.1f;   /* the report's second phase: the same weights under another lambda */
    int taken = 0;
    if (ok && !compile_cpu(&g0, &c2, MT_GRAPH_TRAIN, 1, &e)) {
        mt_runtime *d = make_runtime(&g0, 1, 0, 1);
        taken = d && mt_checkpoint_load(d, dir, NULL, &e) == 0;
        mt_runtime_destroy(d);
        mt_graph_free(&g0);
    }
    report("MTP checkpoint: refused by a model without MTP (naming mtp_layers), taken under another mtp_weight", refused && taken, "%s%s", why,
           taken ? "" : e.msg);
    free(tok); free(tgt);
    mt_runtime_destroy(a); mt_runtime_destroy(b);
    if (ok) mt_graph_free(&g2);
    remove_tree(dir);

    /* (c) the artifact carries it: precompile + train --graph = in-process, bitwise (losses, MTP losses, grad norms, lr),
     * under tp 2 x ep 2 with document masks; and the tp run's checkpoint loads at one rank tensor for tensor */
    static char o[1 << 16], mta[1 << 14], mtb[1 << 14];
    char d2[256], p[600], q[600];
    scratch_dir(d2, sizeof d2, "climtp");
    const char *run = "--preset tiny --mtp-layers 2 --mtp-weight 0.5 --doc-mask 1 --eot-id 3";
    int r1 = sh(o, sizeof o, "%sprecompile %s --tp 2 --ep 2 -o %s/mtp.mtg 2>&1", BIN, run, d2);
    int r2 = r1 ? -1 : sh(o, sizeof o, "%strain --graph %s/mtp.mtg --seed 3 --steps 4 --metrics %s/a.jsonl --save %s/pre 2>&1", BIN, d2, d2, d2);
    int r3 = sh(o, sizeof o, "%strain %s --seed 3 --nproc 2 --tp 2 --ep 2 --steps 4 --metrics %s/b.jsonl --save %s/inproc 2>&1", BIN, run, d2, d2);
    int logged = strstr(o, "| mtp ") != NULL;
    snprintf(p, sizeof p, "%s/a.jsonl", d2); snprintf(q, sizeof q, "%s/b.jsonl", d2);
    metrics_core(p, 1, mta, sizeof mta); metrics_core(q, 1, mtb, sizeof mtb);
    int n = 0, m = 0;
    snprintf(p, sizeof p, "%s/pre/model.safetensors", d2); snprintf(q, sizeof q, "%s/inproc/model.safetensors", d2);
    int same_w = !r1 && !r2 && !r3 && same_tensors(p, q, &n);
    report("CLI: precompile --mtp-layers 2 --tp 2 --ep 2, train --graph = in-process, bitwise", same_w && n_lines(mta) == 4 && !strcmp(mta, mtb) &&
           strstr(mta, "\"mtp_loss\":") && logged, "%d steps (mtp_loss in the metrics: %s, in the log: %s), %d tensors; exit %d %d %d %.200s", n_lines(mta),
           strstr(mta, "\"mtp_loss\":") ? "yes" : "NO", logged ? "yes" : "NO", n, r1, r2, r3, same_w ? "" : o);
    int r4 = sh(o, sizeof o, "%strain %s --steps 0 --load %s/inproc --save %s/one 2>&1", BIN, run, d2, d2);
    char p2[600], q2[600];
    snprintf(p, sizeof p, "%s/inproc/model.safetensors", d2); snprintf(q, sizeof q, "%s/one/model.safetensors", d2);
    snprintf(p2, sizeof p2, "%s/inproc/optimizer-step4.safetensors", d2); snprintf(q2, sizeof q2, "%s/one/optimizer-step4.safetensors", d2);
    int moved = !r4 && same_tensors(p, q, &n) && same_tensors(p2, q2, &m);
    report("CLI: a tp 2 x ep 2 checkpoint with MTP layers loads at one rank, tensor for tensor", moved, "%d weights, %d moments %.200s", n, m,
           moved ? "" : o);
    remove_tree(d2);
}

/* ======================================================================
 * FP8 GEMMs (mt_pass_fp8): e4m3 rounding against the code table, the
 * quantizers' tiles and bounds, which nodes the pass marks, and training
 * with the CPU's emulation (the FP8 step's reference)
 * ==================================================================== */
static void test_fp8(void) {
    /* (a) mt_e4m3 is the nearest of the 253 finite codes' values (ties: even mantissa), saturated at 448: decoded
     * here from the bits, compared on random values over every binade, on every midpoint and next to it */
    double tab[127];
    int nt = 0;
    for (int c = 0; c < 127; c++) {   /* the non-negative codes but NaN (0x7f) */
        int e = c >> 3, m = c & 7;
        tab[nt++] = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
    }
    int bad = 0, tried = 0;
    double worst = 0;
    for (int i = 0; i < 200000 + 2 * 126; i++) {
        double x;
        if (i < 200000) x = ldexp(mt_rng_uniform(&R) + 0.5, (int)(mt_rng_u64(&R) % 24) - 14) * (i & 1 ? -1 : 1);
        else { int k = (i - 200000) / 2; x = (tab[k] + tab[k + 1]) / 2 * (i & 1 ? 1 + 1e-12 : 1); }
        double a = fabs(x), best = 448;
        int bk = 126;
        for (int k = 0; k < nt; k++) {
            double d = fabs(tab[k] - a), db = fabs(best - a);
            if (d < db || (d == db && (k & 1) == 0)) { best = tab[k]; bk = k; }
        }
        (void)bk;
        if (a >= 448) best = 448;
        double want = x < 0 ? -best : best, got = mt_e4m3(x);
        tried++;
        if (got != want) { if (!bad) worst = x; bad++; }
    }
    int specials = mt_e4m3(1e9) == 448 && mt_e4m3(-500) == -448 && mt_e4m3(0.0) == 0 && isnan(mt_e4m3(NAN)) &&
                   mt_e4m3(ldexp(1, -10)) == 0 && mt_e4m3(ldexp(3, -11)) == ldexp(1, -9) && mt_e4m3(ldexp(1, -9)) == ldexp(1, -9);
    report("fp8: mt_e4m3 = the nearest code (ties even), saturating", !bad && specials, "%d values, %d wrong (first %.17g); specials %s", tried,
           bad, worst, specials ? "ok" : "WRONG");

    /* (a') the CUDA quantizers' quotient without a division (moetrain_kernels.cu, quot): y = fp32(x r) with r = fp32(1 / s),
     * then fp32(y + (x - y s) r) by two fmas, its sign x's; used where s is in [2^-125, 2^125] and |x| >= 2^-100. Against
     * the IEEE quotient for every bf16 x up to the amax of 1,500 random bf16 amax (s = amax / 448) over 2^-126..2^126:
     * the same float wherever the quotient is a normal float, the same e4m3 code everywhere */
    {
        long long n = 0, same = 0, codes_bad = 0;
        for (int it = 0; it < 1500; it++) {
            uint32_t ab = (uint32_t)(1 + mt_rng_u64(&R) % 253) << 23 | (uint32_t)(mt_rng_u64(&R) & 127) << 16;
            float amax, s, r;
            memcpy(&amax, &ab, 4);
            s = amax / 448.0f;
            if (!(s >= 0x1p-125f && s <= 0x1p125f)) continue;
            r = 1.0f / s;
            for (uint32_t xb = 0; xb < 0x7f80; xb++) {
                uint32_t u = xb << 16 | (it & 1 ? 0x80000000u : 0);
                float x, q, y, q1;
                memcpy(&x, &u, 4);
                if (fabsf(x) > amax) break;
                if (!(fabsf(x) >= 0x1p-100f) && x != 0) continue;
                q = x / s;
                y = x * r;
                q1 = copysignf(fmaf(fmaf(-s, y, x), r, y), x);
                n++;
                if (!memcmp(&q, &q1, 4)) { same++; continue; }
                const double c0 = mt_e4m3((double)q), c1 = mt_e4m3((double)q1);
                if (fabsf(q) >= 0x1p-126f || c0 != c1 || signbit(c0) != signbit(c1)) codes_bad++;
            }
        }
        report("fp8: the quantizers' quotient by reciprocal and correction = the IEEE quotient's code", n > 1000000 && !codes_bad,
               "%lld (amax, x) pairs: %lld the same float, the rest below 2^-126 with the same code; %lld wrong", n, same, codes_bad);
    }

    /* (b) the quantizers: every element within its tile's bound (half an e4m3 step: 2^-4 relative above the tile's
     * smallest normal, s 2^-10 below), each tile's largest element kept to an ulp, tiles independent (an outlier
     * changes only its own), and cols' groups each tiled from their first row */
    enum { QR = 37, QC = 300 };
    static mt_real x[QR * QC], y[QR * QC], z[QR * QC], y2[QR * QC];
    fill_normal(x, QR * QC, 1.0);
    x[5 * QC + 7] = 3e4; x[20 * QC + 250] = -1e-3;   /* an outlier in one row tile (and in one column tile) */
    int within = 1, kept = 1, indep = 1, groups = 1;
    mt_cpu_fp8_rows(y, x, QR, QC);
    for (int r = 0; r < QR; r++)
        for (int c0 = 0; c0 < QC; c0 += 128) {
            int w = QC - c0 < 128 ? QC - c0 : 128;
            double amax = 0;
            for (int j = 0; j < w; j++) amax = fmax(amax, fabs((double)x[r * QC + c0 + j]));
            double s = amax / 448;
            for (int j = 0; j < w; j++) {
                double xv = x[r * QC + c0 + j], yv = y[r * QC + c0 + j];
                double lim = fmax(fabs(xv) * 0.0625, s * ldexp(1, -10)) * (1 + 1e-6) + 1e-30;
                within &= fabs(yv - xv) <= lim;
                if (fabs(xv) == amax) kept &= fabs(yv - xv) <= amax * 1e-6;
            }
        }
    memcpy(z, x, sizeof x);
    z[5 * QC + 7] = 0.5;   /* without the outlier: only that row's first tile may change */
    mt_cpu_fp8_rows(y2, z, QR, QC);
    for (int i = 0; i < QR * QC; i++)
        if (i / QC != 5 || i % QC >= 128) indep &= y[i] == y2[i];
    const int32_t offs[4] = {0, 3, 3, QR};   /* three groups, one empty */
    mt_cpu_fp8_cols(y, x, offs, 3, QR, QC);
    mt_cpu_fp8_cols(y2, x, NULL, 1, 3, QC);                      /* group 0 alone */
    mt_cpu_fp8_cols(y2 + 3 * QC, x + 3 * QC, NULL, 1, QR - 3, QC); /* group 2 alone */
    groups = !memcmp(y, y2, sizeof y);
    mt_cpu_fp8_blocks(y, x, 1, QR, QC);
    double bamax = 0;
    for (int r = 0; r < QR; r++) for (int c = 128; c < 256; c++) bamax = fmax(bamax, fabs((double)x[r * QC + c]));
    int blocks = 1;
    for (int r = 0; r < QR; r++)
        for (int c = 128; c < 256; c++)
            blocks &= fabs((double)y[r * QC + c] - x[r * QC + c]) <= fmax(fabs((double)x[r * QC + c]) * 0.0625, bamax / 448 * ldexp(1, -10)) * (1 + 1e-6);
    report("fp8: rows/cols/blocks quantizers: bounds, outliers, tiles", within && kept && indep && groups && blocks,
           "within %d, tile max kept %d, tiles independent %d, groups tiled apart %d, 128x128 bound %d", within, kept, indep, groups, blocks);

    /* (c) the pass marks the linear layers' GEMMs (forward, input and weight gradients, the experts' grouped ones
     * and their fusions), never the head, the router or the embedding; the graph says so (fingerprint, dump) */
    mt_config c;
    mt_err e;
    mt_graph g, gb;
    mt_config_preset(&c, "tiny", &e);
    c.batch = 2; c.seq_len = 32; c.qk_rope_head_dim = 16;   /* every linear layer's widths multiples of 16: all in FP8 */
    mt_mesh m;
    mt_target t;
    mt_passes ps;
    mt_mesh_single(&m);
    mt_target_cpu(&t);
    mt_passes_all(&ps);
    ps.fp8 = 1;
    int ok = !mt_compile(&g, &c, &m, &t, MT_GRAPH_TRAIN, &ps, &e);
    ok = ok && !compile_cpu(&gb, &c, MT_GRAPH_TRAIN, 1, &e);
    int marked = 0, gemm = 0, wrong = 0, fwd = 0, dx = 0, dw = 0, grouped = 0;
    for (int i = 0; ok && i < g.n_nodes; i++) {
        const mt_node *n = &g.nodes[i];
        int mm = n->op == MT_OP_MATMUL || n->op == MT_OP_MATMUL_ACC;
        if (!mm && n->op != MT_OP_GMM && n->op != MT_OP_GMM_DX && n->op != MT_OP_GMM_DW && n->op != MT_OP_GMM_DX2 && n->op != MT_OP_GMM_GLU &&
            n->op != MT_OP_GMM_DW_SQ) {
            wrong += n->iattr[MT_IATTR_FP8] != 0;
            continue;
        }
        gemm++;
        char names[4 * MT_NAME_LEN] = "";
        for (int k = 0; k < n->n_in; k++) if (n->in[k] >= 0) strcat(names, g.values[n->in[k]].name);
        strcat(names, g.values[n->out[0]].name);
        int keep = strstr(names, "lm_head") || strstr(names, "mlp.gate.weight") || strstr(names, "embed");
        if (mt_node_fp8(n) == keep) wrong++;
        marked += mt_node_fp8(n);
        if (mt_node_fp8(n)) {
            if (!mm) grouped++;
            else if (n->iattr[0]) dw++;
            else if (n->iattr[1]) fwd++;
            else dx++;
        }
    }
    int said = ok && mt_graph_fp8(&g) == marked && mt_graph_fp8(&gb) == 0 && mt_fingerprint(&g) != mt_fingerprint(&gb);
    /* the checker (artifacts) refuses a mark where the FP8 GEMMs cannot run: an attention node, a 2 = mark */
    int refused = 0, tries = 0;
    for (int i = 0; ok && i < g.n_nodes; i++) {
        mt_node x = g.nodes[i];
        if (x.op == MT_OP_ATTENTION || (x.op == MT_OP_GMM && mt_node_fp8(&x))) {
            x.iattr[MT_IATTR_FP8] = x.op == MT_OP_GMM ? 2 : 1;
            tries++;
            refused += mt_check_node(&g, &x, &e) != 0 && strstr(e.msg, "FP8 mark") != NULL;
        }
    }
    said = said && tries > 0 && refused == tries;
    char *dump = NULL;
    size_t dl = 0;
    FILE *f = ok ? open_memstream(&dump, &dl) : NULL;
    if (f) { mt_graph_dump(&g, f); fclose(f); }
    said = said && dump && strstr(dump, " fp8\n");
    free(dump);
    report("fp8: the pass marks the linear layers' GEMMs, not head/router", ok && !wrong && fwd > 0 && dx > 0 && dw > 0 && grouped >= 6 * (c.n_layers - c.n_dense_layers) && said,
           "%d of %d GEMM nodes marked (%d forward, %d dX, %d dW, %d grouped), %d wrong; fingerprint/dump/checker %s (%d of %d misplaced marks refused)",
           marked, gemm, fwd, dx, dw, grouped, wrong, said ? "ok" : "WRONG", refused, tries);
    {   /* MT_FP8_NO_WGRAD: the same marks but the weight gradients'; the modes as the graph and the checkpoint name them */
        mt_graph gw;
        ps.fp8 = MT_FP8_NO_WGRAD;
        int okw = ok && !mt_compile(&gw, &c, &m, &t, MT_GRAPH_TRAIN, &ps, &e), wmarked = 0, expect = 0, wgrads = 0;
        ps.fp8 = MT_FP8_ALL;
#define WG(x) ((x)->op == MT_OP_GMM_DW || (x)->op == MT_OP_GMM_DW_SQ || (((x)->op == MT_OP_MATMUL || (x)->op == MT_OP_MATMUL_ACC) && (x)->iattr[0]))
        for (int i = 0; okw && i < g.n_nodes; i++) expect += mt_node_fp8(&g.nodes[i]) && !WG(&g.nodes[i]);
        for (int i = 0; okw && i < gw.n_nodes; i++) { wmarked += mt_node_fp8(&gw.nodes[i]); wgrads += mt_node_fp8(&gw.nodes[i]) && WG(&gw.nodes[i]); }
#undef WG
        int same = okw && wmarked == expect && !wgrads;
        int bad = okw ? mt_pass_fp8(&gw, 3, &e) : 0;
        report("fp8: --fp8-wgrad bf16 marks the forward and dX GEMMs only", okw && same && mt_graph_fp8_mode(&gw) == MT_FP8_NO_WGRAD &&
               mt_graph_fp8_mode(&g) == MT_FP8_ALL && mt_graph_fp8_mode(&gb) == MT_FP8_OFF && bad < 0 && !strcmp(mt_fp8_mode_name(MT_FP8_NO_WGRAD), "fp8-bf16-wgrad"),
               "%d marked, %d expected (--fp8's marks but the weight gradients'), %d weight gradients marked; mode 3 refused: %s", wmarked,
               expect, wgrads, bad < 0 ? e.msg : "NOT REFUSED");
        if (okw) mt_graph_free(&gw);
    }
    {   /* CUDA target: the FP8 expert weight gradients sum their squares in their epilogue (GMM_DW_SQ, FP8, the FP8
           kernel's partials); with bf16 weight gradients the bf16 GMM_DW_SQ forms as before */
        mt_target tc;
        mt_target_cuda(&tc, "sm_90a");
        int nsq[2] = {0, 0}, nfp8[2] = {0, 0}, lens[2] = {0, 0}, parts[2] = {0, 0}, okc = ok;
        for (int k = 0; k < 2 && okc; k++) {
            mt_graph gc;
            ps.fp8 = k ? MT_FP8_NO_WGRAD : MT_FP8_ALL;
            int compiled = !mt_compile(&gc, &c, &m, &tc, MT_GRAPH_TRAIN, &ps, &e);
            okc = compiled;
            for (int i = 0; okc && i < gc.n_nodes; i++) {
                const mt_node *x = &gc.nodes[i];
                okc &= !mt_check_node(&gc, x, &e);
                parts[k] += x->op == MT_OP_SUMSQ && x->iattr[0];
                if (x->op != MT_OP_GMM_DW_SQ) { okc &= x->op != MT_OP_GMM_DW; continue; }
                const mt_value *W = &gc.values[x->out[0]];
                int64_t want = (k ? mt_gmm_ssq_len : mt_gmm_ssq_len_fp8)(W->dims[0], W->dims[1], W->dims[2]);
                nsq[k]++; nfp8[k] += mt_node_fp8(x); lens[k] += gc.values[x->out[1]].dims[0] == want;
            }
            if (compiled) mt_graph_free(&gc);
        }
        ps.fp8 = MT_FP8_ALL;
        int nmoe = c.n_layers - c.n_dense_layers;
        report("fp8 (CUDA target): the weight gradients' GEMMs sum their squares, FP8 or bf16", okc && nsq[0] == 3 * nmoe && nfp8[0] == nsq[0] &&
               lens[0] == nsq[0] && parts[0] == nsq[0] && nsq[1] == 3 * nmoe && !nfp8[1] && lens[1] == nsq[1] && parts[1] == nsq[1] &&
               mt_gmm_ssq_len_fp8(64, 1408, 2048) == 64 * 11 * 16 * 8 && mt_gmm_ssq_len(64, 1408, 2048) == 64 * 11 * 8 * 8 &&
               mt_gmm_ssq_len_fp8(8, 272, 336) == 1024,
               "--fp8: %d GMM_DW_SQ, %d FP8, %d of the FP8 length, %d SUMSQ of partials; --fp8-wgrad bf16: %d, %d, %d, %d%s%s", nsq[0], nfp8[0],
               lens[0], parts[0], nsq[1], nfp8[1], lens[1], parts[1], okc ? "" : ": ", okc ? "" : e.msg);
    }

    /* (d) training with the emulation: deterministic (two runtimes, bitwise), close to the float step and not it */
    mt_hparams hp;
    mt_hparams_default(&hp);
    mt_runtime *a = ok ? make_runtime(&g, 2, 0, 5) : NULL, *b = ok ? make_runtime(&g, 1, 1, 5) : NULL, *r = ok ? make_runtime(&gb, 2, 0, 5) : NULL;
    int64_t N = (int64_t)c.batch * c.seq_len;
    int32_t *tok = (int32_t *)malloc(4 * (size_t)N), *tgt = (int32_t *)malloc(4 * (size_t)N);
    double la[40], lb[40], lr[40];
    int run = a && b && r;
    for (int s = 0; run && s < 40; s++) {
        mt_step_stats sa, sb, sr;
        memset(&sr, 0, sizeof sr);
        make_batch(&c, s, tok, tgt);
        run = !mt_runtime_step(a, tok, tgt, s, &hp, &sa, &e) && !mt_runtime_step(b, tok, tgt, s, &hp, &sb, &e) &&
              !mt_runtime_step(r, tok, tgt, s, &hp, &sr, &e);
        la[s] = sa.loss; lb[s] = sb.loss; lr[s] = sr.loss;
    }
    double d0 = run ? fabs(la[0] - lr[0]) / lr[0] : 1, dend = run ? fabs(la[39] - lr[39]) / lr[39] : 1;
    report("fp8: CPU emulation trains, deterministic, near the float step", run && bitwise_equal(la, lb, 40) && la[0] != lr[0] && d0 < 0.01 &&
           dend < 0.05 && la[39] < 0.6 * la[0], "loss %.4f -> %.4f (float %.4f -> %.4f): step 0 off by %.2e, step 39 by %.2e; two runs %s %s",
           la[0], la[39], lr[0], lr[39], d0, dend, run && bitwise_equal(la, lb, 40) ? "bitwise" : "DIFFER", run ? "" : e.msg);
    free(tok); free(tgt);
    mt_runtime_destroy(a); mt_runtime_destroy(b); mt_runtime_destroy(r);
    if (ok) { mt_graph_free(&g); mt_graph_free(&gb); }
}

/* The CLI: --fp8 over 4 thread-ranks (FSDP x EP), precompiled = in-process bitwise; the checkpoint records it and
 * a resume continues exactly; a resume without --fp8 says the GEMMs changed. */
static void test_cli_fp8(void) {
    static char o[1 << 16], ma[1 << 14], mb[1 << 14], mc[1 << 14];
    char d[256], p[600], q[600];
    scratch_dir(d, sizeof d, "clifp8");
    const char *run = "--preset tiny --qk-rope-head-dim 16";
    int r1 = sh(o, sizeof o, "%sprecompile %s --fp8 --dp-shard 2 --ep 2 --tp 2 -o %s/f.mtg 2>&1", BIN, run, d);
    int said = strstr(o, "fp8: ") != NULL;
    int r2 = r1 ? -1 : sh(o, sizeof o, "%strain --graph %s/f.mtg --seed 4 --steps 6 --metrics %s/a.jsonl 2>&1", BIN, d, d);
    int r3 = sh(o, sizeof o, "%strain %s --seed 4 --fp8 --nproc 4 --dp-shard 2 --ep 2 --tp 2 --steps 6 --metrics %s/b.jsonl 2>&1", BIN, run, d);
    said = said && strstr(o, "GEMMs in FP8") != NULL;
    snprintf(p, sizeof p, "%s/a.jsonl", d); snprintf(q, sizeof q, "%s/b.jsonl", d);
    metrics_core(p, 1, ma, sizeof ma); metrics_core(q, 1, mb, sizeof mb);
    report("CLI: precompile --fp8 (dp_shard 2 x tp 2 x ep 2) = in-process, bitwise", !r1 && !r2 && !r3 && n_lines(ma) == 6 && !strcmp(ma, mb) && said,
           "%d steps; exit %d %d %d; said %d %.200s", n_lines(ma), r1, r2, r3, said, r3 ? o : "");
    /* resume from step 3: steps 4..6 bitwise the uninterrupted run's; the checkpoint says fp8 */
    int r0 = sh(o, sizeof o, "%strain %s --seed 4 --fp8 --nproc 4 --dp-shard 2 --ep 2 --tp 2 --steps 3 --decay-steps 6 --save %s/k3 2>&1", BIN, run, d);
    int r4 = r0 ? -1 : sh(o, sizeof o, "%strain %s --seed 4 --fp8 --nproc 4 --dp-shard 2 --ep 2 --tp 2 --steps 6 --load %s/k3 --metrics %s/c.jsonl 2>&1", BIN, run, d, d);
    snprintf(p, sizeof p, "%s/c.jsonl", d);
    metrics_core(p, 4, mc, sizeof mc);
    metrics_core(q, 4, mb, sizeof mb);
    int exact = !r4 && n_lines(mc) == 3 && !strcmp(mc, mb) && !strstr(o, "not its exact continuation");
    int r5 = sh(o, sizeof o, "%strain %s --nproc 4 --dp-shard 2 --ep 2 --tp 2 --steps 4 --load %s/k3 2>&1", BIN, run, d);
    int noted = !r5 && strstr(o, "GEMMs fp8 -> bf16") != NULL;
    int r6 = sh(o + 8192, sizeof o - 8192, "%strain --graph %s/f.mtg --steps 1 --fp8 --save %s/x 2>&1 && %sprecompile %s -o %s/b.mtg >/dev/null && "
                "%strain --graph %s/b.mtg --fp8 --steps 1 2>&1", BIN, d, d, BIN, run, d, BIN, d);
    int refused = r6 != 0 && strstr(o + 8192, "compiled with bf16 GEMMs; --fp8 cannot change them") != NULL;
    report("CLI: an FP8 checkpoint resumes exactly; without --fp8 the change is named", exact && noted && refused,
           "resumed steps %d (%s), note %s, bf16 artifact with --fp8 %s; exit %d %d %d %.200s", n_lines(mc), exact ? "bitwise" : "DIFFER",
           noted ? "ok" : "MISSING", refused ? "refused" : "NOT REFUSED", r4, r5, r6, exact && noted ? o + 8192 : o);
    /* --fp8-wgrad bf16: said at start, artifact = in-process bitwise, recorded in the checkpoint and named on a change; refused without --fp8 */
    {
        static char w1[1 << 14], w2[1 << 14];
        int a1 = sh(o, sizeof o, "%sprecompile %s --fp8 --fp8-wgrad bf16 -o %s/w.mtg 2>&1", BIN, run, d);
        int saidp = strstr(o, "and the weight gradients") != NULL;
        int a2 = a1 ? -1 : sh(o, sizeof o, "%strain --graph %s/w.mtg --seed 4 --steps 3 --metrics %s/w1.jsonl 2>&1", BIN, d, d);
        int a3 = sh(o, sizeof o, "%strain %s --seed 4 --fp8 --fp8-wgrad bf16 --steps 3 --decay-steps 6 --metrics %s/w2.jsonl --save %s/w3 2>&1",
                    BIN, run, d, d);
        int saidt = strstr(o, "GEMMs in FP8 (weight gradients in bf16)") != NULL;
        snprintf(p, sizeof p, "%s/w1.jsonl", d); snprintf(q, sizeof q, "%s/w2.jsonl", d);
        metrics_core(p, 1, w1, sizeof w1); metrics_core(q, 1, w2, sizeof w2);
        int same = !a1 && !a2 && !a3 && n_lines(w1) == 3 && !strcmp(w1, w2);
        int a4 = sh(o, sizeof o, "%strain %s --fp8 --steps 4 --load %s/w3 2>&1", BIN, run, d);
        int named = !a4 && strstr(o, "GEMMs fp8-bf16-wgrad -> fp8") != NULL;
        int a5 = sh(o + 8192, sizeof o - 8192, "%strain %s --fp8-wgrad bf16 --steps 1 2>&1", BIN, run);
        int refused = a5 != 0 && strstr(o + 8192, "with --fp8") != NULL;
        report("CLI: --fp8-wgrad bf16: artifact = in-process, checkpoint names it", same && saidp && saidt && named && refused,
               "%d steps %s; said %d %d; resume note %s; without --fp8 %s; exit %d %d %d %d %.200s", n_lines(w1), same ? "bitwise" : "DIFFER",
               saidp, saidt, named ? "ok" : "MISSING", refused ? "refused" : "NOT REFUSED", a1, a2, a3, a4, named ? "" : o);
    }
    /* a held-out set: --forward over 3 batches in one file = the mean of the 3 alone (the FP8 run's weights, a bf16 forward);
       2.5 batches refused */
    {
        enum { B = 8, T = 64, NB = 3 };
        int32_t tok[NB][B * (T + 1)];
        uint64_t s = 7;
        for (int k = 0; k < NB; k++)
            for (int i = 0; i < B * (T + 1); i++) { s = s * 6364136223846793005ULL + 1442695040888963407ULL; tok[k][i] = (int32_t)(s >> 56); }
        double one[NB] = {0}, all = -1;
        int ok = 1, lines = 0;
        for (int k = 0; k <= NB + 1 && ok; k++) {   /* k < NB: batch k alone; NB: all three; NB + 1: two and a half */
            snprintf(p, sizeof p, "%s/h%d.i32", d, k);
            FILE *f = fopen(p, "wb");
            size_t n = k < NB ? sizeof tok[0] : k == NB ? sizeof tok : sizeof tok - sizeof tok[0] / 2;
            ok = f && fwrite(k < NB ? tok[k] : tok[0], 1, n, f) == n && !fclose(f);
            int r = sh(o, sizeof o, "%strain %s --load %s/k3 --forward %s 2>&1", BIN, run, d, p);
            const char *at = strstr(o, "\nloss ") ? strstr(o, "\nloss ") + 1 : strncmp(o, "loss ", 5) ? NULL : o;
            if (k < NB) ok = ok && !r && at && sscanf(at, "loss %lf", &one[k]) == 1;
            else if (k == NB) {
                ok = ok && !r && at && sscanf(at, "loss %lf", &all) == 1 && strstr(at, "(mean of 3 batches)");
                for (const char *c = o; (c = strstr(c, "batch ")); c++) lines++;
            } else ok = ok && r && strstr(o, "needs a multiple of");
        }
        double mean = (one[0] + one[1] + one[2]) / 3;
        report("CLI: --forward over a held-out file of several batches = the batches' mean", ok && lines == NB && fabs(all - mean) <= 1e-6 * mean,
               "%.9g vs %.9g (alone: %.5f %.5f %.5f); %d batch lines; 2.5 batches refused; %.200s", all, mean, one[0], one[1], one[2], lines, ok ? "" : o);
    }
    remove_tree(d);
}

/* ======================================================================
 * MoE in chunks of tokens (--moe-chunks 2): the graph, its order under overlap, the numbers, the artifact
 * ==================================================================== */
/* the chunk a node of mt__moe's routed path belongs to, by its first input's name (".c0", ".c1"); -1: none */
static int mc_chunk(const mt_graph *g, const mt_node *n) {
    if (n->in[0] < 0) return -1;
    const char *nm = g->values[n->in[0]].name;
    return strstr(nm, ".c0") ? 0 : strstr(nm, ".c1") ? 1 : -1;
}
static int mc_is_expert_gemm(int op) {
    return op == MT_OP_GMM || op == MT_OP_GMM_GLU || op == MT_OP_GMM_DX || op == MT_OP_GMM_DX2 || op == MT_OP_GMM_DW || op == MT_OP_GMM_DW_SQ;
}
/* May side-stream node x run while some (all: every) compute node of the list runs (after[x] < j < done[x])? */
static int mc_under_all(const mt_schedule *s, const int32_t *list, int n, int x, int all) {
    int k = 0;
    for (int i = 0; i < n; i++) k += s->after[x] < list[i] && list[i] < s->done[x];
    return all ? n > 0 && k == n : k > 0;
}
static int mc_under(const mt_schedule *s, const int32_t *list, int n, int x) { return mc_under_all(s, list, n, x, 0); }
/* Every MoE layer's order, forward and backward: the exchange nodes in the order chunk 0 counts + dispatch, chunk 1
 * counts + dispatch, chunk 0's combine, chunk 1's combine (forward; backward: the gradient's dispatches of chunk 1
 * then 0, its combines of chunk 1 then 0), chunk 0's experts first (backward: chunk 1's), and by the schedule's events: chunk
 * 1's dispatch runs under chunk 0's expert GEMMs and chunk 0's combine under chunk 1's (backward: chunk 0's dispatch
 * under chunk 1's GEMMs, chunk 1's combine under chunk 0's, chunk 0's under some, and without FSDP over the experts
 * (edp 1) under all, weight-gradient GEMMs). Returns the layers
 * and phases that pass; why in `why`. */
static int mc_order(const mt_graph *g, char *why, size_t cap) {
    mt_schedule s;
    mt_err e;
    if (mt_schedule_build(g, &s, &e)) { snprintf(why, cap, "%s", e.msg); return 0; }
    int good = 0, edp1 = mt_mesh_group_size(&g->mesh, MT_DIMBIT(MT_DIM_EDP)) == 1;   /* (else reduce-scatters pin the sums) */
    why[0] = 0;
    for (int L = 0; L < g->cfg.n_layers; L++) {
        if (!mt_config_is_moe_layer(&g->cfg, L)) continue;
        for (int ph = MT_PHASE_FORWARD; ph <= MT_PHASE_BACKWARD; ph++) {
            int32_t ex[8], gem[2][64], dws[64];
            int nex = 0, ng[2] = {0, 0}, ndw = 0, exch[8], ok = 1;
            for (int i = 0; i < g->n_nodes; i++) {
                const mt_node *x = &g->nodes[i];
                int ch = mc_chunk(g, x);
                if (x->layer != L || x->phase != ph || ch < 0) continue;
                if (mt_op_is_ep_exchange(x->op) && nex < 8) { ex[nex] = i; exch[nex++] = x->op * 2 + ch; }
                if (mc_is_expert_gemm(x->op) && ng[ch] < 64) gem[ch][ng[ch]++] = i;
                if ((x->op == MT_OP_GMM_DW || x->op == MT_OP_GMM_DW_SQ) && ndw < 64) dws[ndw++] = i;
            }
            const int C = MT_OP_EP_COUNTS * 2, D = MT_OP_EP_DISPATCH * 2, B = MT_OP_EP_COMBINE * 2;
            const int fwd[6] = {C, D, C + 1, D + 1, B, B + 1}, bwd[4] = {D + 1, D, B + 1, B};
            const int *want = ph == MT_PHASE_FORWARD ? fwd : bwd, nw = ph == MT_PHASE_FORWARD ? 6 : 4;
            ok = nex == nw && ng[0] > 0 && ng[1] > 0 && (ph == MT_PHASE_FORWARD ? gem[0][0] < gem[1][0] : gem[1][0] < gem[0][0]);
            for (int k = 0; ok && k < nw; k++) ok = exch[k] == want[k];
            if (ok && ph == MT_PHASE_FORWARD) ok = mc_under(&s, gem[0], ng[0], ex[3]) && mc_under(&s, gem[1], ng[1], ex[4]);
            if (ok && ph == MT_PHASE_BACKWARD)
                ok = mc_under(&s, gem[1], ng[1], ex[1]) && mc_under(&s, gem[0], ng[0], ex[2]) && mc_under_all(&s, dws, ndw, ex[3], edp1);
            if (ok) good++;
            else if (!why[0]) snprintf(why, cap, "layer %d %s: %d exchange nodes, %d + %d expert GEMMs, not in order or not overlapped", L,
                                       ph == MT_PHASE_FORWARD ? "forward" : "backward", nex, ng[0], ng[1]);
        }
    }
    mt_schedule_free(&s);
    return good;
}

static void test_moe_chunks(void) {
    mt_err e;
    char why[300];
    /* 1. the graph: per MoE layer two of each exchange node, a received-rows symbol per chunk, the whole layer's
     *    counts output; the fingerprint says it; chunks 1 is the default graph, node for node */
    {
        mt_graph g1, g2, g0;
        mt_config c;
        mt_mesh m;
        mt_target t;
        mt_passes p;
        mt_config_preset(&c, "tiny", &e);
        mt_mesh_init(&m, 1, 2, 1, 2, &e);
        mt_target_cpu(&t);
        mt_passes_all(&p);
        int ok = mt_compile(&g0, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) == 0;
        p.moe_chunks = 1;
        ok = ok && mt_compile(&g1, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) == 0;
        p.moe_chunks = 2;
        ok = ok && mt_compile(&g2, &c, &m, &t, MT_GRAPH_TRAIN, &p, &e) == 0;
        int moe = c.n_layers - c.n_dense_layers, counts1 = 0, counts2 = 0, n_counts = 0, syms = 0;
        uint8_t *b0 = NULL, *b1 = NULL;
        size_t l0 = 0, l1 = 0;
        int same1 = ok && mt_artifact_write(&g0, &b0, &l0, &e) == 0 && mt_artifact_write(&g1, &b1, &l1, &e) == 0 && l0 == l1 && !memcmp(b0, b1, l0);
        free(b0); free(b1);
        for (int i = 0; ok && i < g2.n_nodes; i++) counts2 += g2.nodes[i].op == MT_OP_EP_COUNTS && g2.nodes[i].phase == MT_PHASE_FORWARD;
        for (int i = 0; ok && i < g1.n_nodes; i++) counts1 += g1.nodes[i].op == MT_OP_EP_COUNTS && g1.nodes[i].phase == MT_PHASE_FORWARD;
        for (int v = 0; ok && v < g2.n_values; v++)
            n_counts += (g2.values[v].flags & MT_VF_COUNTS) && g2.values[v].dims[0] == c.n_routed_experts;
        for (int s = 0; ok && s < g2.n_syms; s++)
            syms += g2.syms[s].kind == MT_SYM_SIZE && g2.syms[s].max == (int64_t)c.batch * c.seq_len / 2 * c.top_k * 2 &&
                    !strncmp(g2.syms[s].name, "ep_recv_tokens.c", 16);
        char fp[4096];
        mt__fingerprint_text(ok ? &g2 : &g1, fp, sizeof fp);
        report("MoE in 2 chunks: the graph (2 counts, dispatches, combines a layer; a symbol a chunk; the layer's counts whole)",
               ok && same1 && counts1 == moe && counts2 == 2 * moe && n_counts == moe && syms == 2 && mt_graph_moe_chunks(&g2) == 2 &&
               mt_graph_moe_chunks(&g1) == 1 && strstr(fp, " moe_chunks=2") && mt_fingerprint(&g1) != mt_fingerprint(&g2),
               "chunks 1 = the default graph, byte for byte: %s; EP_COUNTS %d -> %d for %d MoE layers; %d whole counts outputs; %d chunk symbols%s%s",
               same1 ? "yes" : "NO", counts1, counts2, moe, n_counts, syms, ok ? "" : ": ", ok ? "" : e.msg);
        if (ok) { mt_graph_free(&g0); mt_graph_free(&g1); mt_graph_free(&g2); }
    }
    /* 2. the order under overlap, and the checker's proof of the schedule and plan */
    moe_chunks = 2;
    struct { const char *preset; int shard, ep; } cases[] = {{"tiny", 2, 2}, {"debug", 2, 2}, {"tiny", 4, 2}, {"debug", 4, 4}};
    for (int i = 0; i < 4; i++) {
        mt_graph g;
        char nm[160];
        snprintf(nm, sizeof nm, "MoE in 2 chunks, overlap: %s, dp_shard %d x ep %d: chunk 1's dispatch under chunk 0's experts, "
                 "chunk 0's combine under chunk 1's (and back)", cases[i].preset, cases[i].shard, cases[i].ep);
        if (ov_compile_mesh(&g, cases[i].preset, 1, cases[i].shard, cases[i].ep, 1, 1, &e)) { report(nm, 0, "%s", e.msg); continue; }
        int want = 2 * (g.cfg.n_layers - g.cfg.n_dense_layers), got = mc_order(&g, why, sizeof why);
        int rc = ov_check(&g, NULL, NULL, &e), plan = rc == 0 && mt_plan_check(&g, &e) == 0;
        report(nm, got == want && rc == 0 && plan, "%d of %d layer phases%s%s; schedule and plan %s%s", got, want, why[0] ? ": " : "", why,
               rc == 0 && plan ? "hazard-free" : "REFUSED: ", rc == 0 && plan ? "" : e.msg);
        mt_graph_free(&g);
    }
    moe_chunks = 1;
    /* 3. the numbers: one rank (eager: with the exchange nodes; and compiled: elided) and thread-ranks against all tokens at
     *    once. float32 rounding of the experts' weight-gradient sums, carried by 10 steps of AdamW (measured: losses
     *    <= 7.9e-8, grad norms equal, weights <= 1.3e-5 of each tensor's largest; test_f64's are 1e-16 and 2e-14) */
    mc_vs_whole(1, 1, 1, 1, 10, 2e-6, 2e-6, 2e-4);
    mc_vs_whole(1, 1, 1, 0, 10, 2e-6, 2e-6, 2e-4);
    mc_vs_whole(1, 2, 2, 0, 10, 2e-6, 2e-6, 2e-4);
    mc_vs_whole(1, 4, 2, 0, 10, 2e-6, 2e-6, 2e-4);
    /* the layer's counts (EXPERT_BIAS_UPDATE's and the metrics' input): the whole layer's, bitwise, after a step */
    {
        mt_config c;
        mt_config_preset(&c, "tiny", &e);
        c.batch = 2; c.seq_len = 32;
        mt_graph g1, g2;
        int ok = compile_cpu(&g1, &c, MT_GRAPH_TRAIN, 1, &e) == 0;
        moe_chunks = 2;
        ok = ok && compile_cpu(&g2, &c, MT_GRAPH_TRAIN, 1, &e) == 0;
        moe_chunks = 1;
        mt_hparams hp;
        mt_hparams_default(&hp);
        double l1[1], l2[1];
        mt_runtime *r1 = ok ? make_runtime(&g1, 1, 1, 3) : NULL, *r2 = ok ? make_runtime(&g2, 1, 1, 3) : NULL;
        ok = ok && r1 && r2 && !run_steps_quiet(r1, &c, 0, 1, l1, &hp) && !run_steps_quiet(r2, &c, 0, 1, l2, &hp);
        int layers = 0, same = ok && l1[0] == l2[0];
        for (int v = 0; same && v < g1.n_values; v++) {
            if (!(g1.values[v].flags & MT_VF_COUNTS)) continue;
            int v2 = mt_graph_find(&g2, g1.values[v].name);
            int32_t a[256], b[256];
            same = v2 >= 0 && !mt_runtime_read(r1, v, a, &e) && !mt_runtime_read(r2, v2, b, &e) && !memcmp(a, b, 4 * (size_t)c.n_routed_experts);
            layers++;
        }
        report("MoE in 2 chunks: each layer's expert counts are the whole layer's, bitwise", same && layers == c.n_layers - c.n_dense_layers,
               "%d layers; step 1's loss %s", layers, same ? "bitwise" : "DIFFERS");
        mt_runtime_destroy(r1); mt_runtime_destroy(r2);
        if (ok) { mt_graph_free(&g1); mt_graph_free(&g2); }
    }
    /* 4. overlap on vs off with 2 chunks: bitwise, one rank (no elision: the exchange nodes stay) and thread-ranks */
    moe_chunks = 2;
    {
        mt_graph g1, g0;
        int ok = ov_compile_mesh(&g1, "tiny", 1, 1, 1, 1, 0, &e) == 0 && ov_compile_mesh(&g0, "tiny", 1, 1, 1, 0, 0, &e) == 0;
        mr_job a, b;
        memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
        a.fail_rank = b.fail_rank = -1;
        ok = ok && mr_run(&a, &g1, 3, &e) == 0 && mr_run(&b, &g0, 3, &e) == 0;
        report("MoE in 2 chunks: overlap on vs off, 1 rank (exchange kept): bitwise", ok && ov_same_run(&a, &b, 3, 1), "loss %.7f -> %.7f %s",
               a.loss[0], a.loss[2], ok ? "" : e.msg);
        mr_free(&a); mr_free(&b);
        if (ok) { mt_graph_free(&g1); mt_graph_free(&g0); }
    }
    int meshes[2][2] = {{2, 2}, {4, 2}};
    for (int i = 0; i < 2; i++) {
        char nm[128];
        snprintf(nm, sizeof nm, "MoE in 2 chunks: overlap on vs off, %d thread-ranks (dp_shard %d, ep %d): bitwise", meshes[i][0], meshes[i][0], meshes[i][1]);
        ov_on_off(nm, 1, meshes[i][0], meshes[i][1]);
    }
    /* 5. the artifact carries the chunks: loaded = in-process, bitwise over 10 steps on 4 thread-ranks */
    {
        mt_graph g4, gl;
        uint8_t *bytes = NULL;
        size_t len = 0;
        int built = mr_compile(&g4, 1, 4, 2, 2, 0, &e) == 0;
        int loaded = built && mt_artifact_write(&g4, &bytes, &len, &e) == 0 && mt_artifact_read(&gl, bytes, len, &e) == 0;
        free(bytes);
        mr_job a, b;
        memset(&a, 0, sizeof a); memset(&b, 0, sizeof b);
        a.fail_rank = b.fail_rank = -1;
        int ok = loaded && mt_graph_moe_chunks(&gl) == 2 && mt_fingerprint(&gl) == mt_fingerprint(&g4) && mr_run(&a, &g4, 10, &e) == 0 &&
                 mr_run(&b, &gl, 10, &e) == 0;
        report("MoE in 2 chunks: the artifact = in-process compile, bitwise over 10 steps (4 ranks: dp_shard 4, ep 2)", ok && ov_same_run(&a, &b, 10, 4),
               "chunks read back %d; losses %.6f .. %.6f %s", loaded ? mt_graph_moe_chunks(&gl) : 0, a.loss[0], a.loss[9], ok ? "" : e.msg);
        mr_free(&a); mr_free(&b);
        if (loaded) mt_graph_free(&gl);
        if (built) mt_graph_free(&g4);
    }
    moe_chunks = 1;
    /* 6. the command lines: precompile --moe-chunks 2 + train --graph = train --moe-chunks 2 in-process (4 ranks), bitwise;
     *    an artifact's chunks are not overridden; out-of-range refused */
    {
        static char o[1 << 15], ma[1 << 14], mb[1 << 14];
        char d[256], p[600], q[600];
        scratch_dir(d, sizeof d, "clich");
        const char *four = "--nproc 4 --dp-shard 4 --ep 2", *run = "--preset tiny --seed 4 --warmup 2 --decay-steps 8";
        int r1 = sh(o, sizeof o, "%sprecompile --preset tiny --dp-shard 4 --ep 2 --moe-chunks 2 -o %s/c.mtg 2>&1", BIN, d);
        int said = !r1 && strstr(o, "in 2 chunks of tokens");
        int r2 = sh(o, sizeof o, "%strain --graph %s/c.mtg --nproc 4 --seed 4 --warmup 2 --decay-steps 8 --steps 3 --metrics %s/g.jsonl 2>&1", BIN, d, d);
        int r3 = sh(o, sizeof o, "%strain %s %s --moe-chunks 2 --steps 3 --metrics %s/i.jsonl 2>&1", BIN, run, four, d);
        said = said && strstr(o, "MoE in 2 chunks of tokens");
        snprintf(p, sizeof p, "%s/g.jsonl", d); metrics_core(p, 1, ma, sizeof ma);
        snprintf(q, sizeof q, "%s/i.jsonl", d); metrics_core(q, 1, mb, sizeof mb);
        int same = !r1 && !r2 && !r3 && n_lines(ma) == 3 && !strcmp(ma, mb);
        int r4 = sh(o, sizeof o, "%strain --graph %s/c.mtg --nproc 4 --moe-chunks 1 --steps 1 2>&1", BIN, d);
        int fixed = r4 == 2 && strstr(o, "compiled with 2 MoE chunks");
        int r5 = sh(o, sizeof o, "%strain --moe-chunks 5 --steps 1 2>&1", BIN), r6 = sh(o + 8192, sizeof o - 8192, "%sprecompile --moe-chunks 0 -o %s/x.mtg 2>&1", BIN, d);
        report("CLI: precompile --moe-chunks 2 + train --graph = train --moe-chunks 2, 4 ranks, bitwise; refusals", same && said && fixed && r5 == 2 && r6 == 2,
               "3 steps %s; said %s; --graph + --moe-chunks 1 exit %d; out of range exit %d %d %.300s", same ? "identical" : "DIFFER", said ? "yes" : "NO",
               r4, r5, r6, same ? "" : o);
        /* a resumed run takes the checkpoint's chunks: 8 steps = 4 + --save + --load (no --moe-chunks) + 4, bitwise */
        int a1 = sh(o, sizeof o, "%strain %s %s --moe-chunks 2 --steps 8 --metrics %s/f.jsonl --save %s/full 2>&1", BIN, run, four, d, d);
        int a2 = sh(o, sizeof o, "%strain %s %s --moe-chunks 2 --steps 4 --save %s/half 2>&1", BIN, run, four, d);
        int a3 = sh(o, sizeof o, "%strain %s %s --steps 8 --load %s/half --save %s/cont --metrics %s/c.jsonl 2>&1", BIN, run, four, d, d, d);
        int kept = strstr(o, "MoE in 2 chunks of tokens") && !strstr(o, "changed from the saved run");
        snprintf(p, sizeof p, "%s/f.jsonl", d); metrics_core(p, 5, ma, sizeof ma);
        snprintf(q, sizeof q, "%s/c.jsonl", d); metrics_core(q, 1, mb, sizeof mb);
        int resumed = !a1 && !a2 && !a3 && n_lines(ma) == 4 && !strcmp(ma, mb);
        snprintf(p, sizeof p, "%s/full/model.safetensors", d); snprintf(q, sizeof q, "%s/cont/model.safetensors", d);
        resumed = resumed && same_file(p, q);
        int a4 = sh(o, sizeof o, "%strain %s %s --moe-chunks 1 --steps 5 --load %s/half 2>&1", BIN, run, four, d);
        int noted = !a4 && strstr(o, "MoE chunks 2 -> 1") && !strstr(o, "MoE in 2 chunks");
        report("CLI: --moe-chunks 2, 4 ranks: 8 steps = 4 + --save + --load + 4, bitwise (the checkpoint's chunks kept); another said",
               resumed && kept && noted, "steps 5..8 and weights %s; chunks %s on resuming; --moe-chunks 1 on resuming %s (exit %d %d %d %d) %.200s",
               resumed ? "identical" : "DIFFER", kept ? "kept" : "NOT kept", noted ? "said" : "NOT said", a1, a2, a3, a4, resumed && kept && noted ? "" : o);
        remove_tree(d);
    }
}

int main(void) {
    mt_rng_seed(&R, 42);
    if (getenv("MT_BIN")) BIN = getenv("MT_BIN");
    if (getenv("MT_OVERLAP_ONLY")) {   /* the overlap tests alone */
        test_overlap();
        printf("%d passed, %d failed\n", n_pass, n_fail);
        return n_fail ? 1 : 0;
    }
    const char *only = getenv("MT_TEST_ONLY");   /* run the test functions whose names contain this */
#define RUN(f) do { if (!only || strstr(#f, only)) f(); } while (0)
    if (getenv("MT_FUZZ_ONLY")) {   /* a fuzzing campaign alone (with MT_FUZZ_SCALE=N for a longer one) */
        test_fuzz();
        printf("%d passed, %d failed\n", n_pass, n_fail);
        return n_fail ? 1 : 0;
    }
    RUN(test_presets);
    RUN(test_op_index);
    RUN(test_ep_layout);
    RUN(test_init_draws);
    RUN(test_graph_structure);
    RUN(test_fsdp_gradient_graph);
    RUN(test_doc_mask_graph);
    RUN(test_memory_plan);
    RUN(test_bitwise);
    RUN(test_adamw_reference);
    RUN(test_attention_backward_f32);
    RUN(test_recompute_bitwise);
    RUN(test_fold_rope);
    RUN(test_recompute_budget);
    RUN(test_recompute_artifact);
    RUN(test_artifact_rejects);
    RUN(test_moe_edge_cases);
    RUN(test_checkpoint);
    RUN(test_resume_exact);
    RUN(test_checkpoint_moments);
    RUN(test_checkpoint_atomic);
    RUN(test_checkpoint_refusals);
    RUN(test_checkpoint_stale_tmp);
    RUN(test_checkpoint_truncated);
    RUN(test_nan_check);
    RUN(test_data);
    RUN(test_data_format);
    RUN(test_fuzz);
    RUN(test_training_falls);
    RUN(test_overlap);
    RUN(test_multirank);
    RUN(test_tensor_parallel);
    RUN(test_fsdp_turn);
    RUN(test_recompute_multirank);
    RUN(test_isolate_ep);
    RUN(test_devices);
    RUN(test_launch_rendezvous);
    RUN(test_launch_env);
    RUN(test_cli);
    RUN(test_cli_options);
    RUN(test_cli_launch);
    RUN(test_scripts);
    RUN(test_cli_resume);
    RUN(test_cli_data_format);
    RUN(test_cli_save_refuses);
    RUN(test_cli_sharded_checkpoint);
    RUN(test_cli_moments);
    RUN(test_moe_chunks);
    RUN(test_cli_tensor_parallel);
    RUN(test_cli_recompute);
    RUN(test_mtp);
    RUN(test_fp8);
    RUN(test_cli_fp8);
#undef RUN
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
#endif
