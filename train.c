/* train — train a DeepSeek-V3-style MoE model, on one rank or many.
 *
 *   ./train                                   tiny model on the embedded corpus
 *   ./train --preset debug --data shard.bin   another preset, your tokens
 *   ./train --preset debug                    one rank per visible GPU (no torchrun needed)
 *   ./train --device cpu --nproc 4 --ep 2     four CPU thread-ranks
 *   ./train --graph step.mtg                  run a precompiled step graph
 *   ./train --load ckpt --forward tok.i32 --logits-out out.f32   forward only
 *
 * Launchers: with RANK, WORLD_SIZE (and LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
 * set, as torchrun, Slurm wrappers and mpirun scripts do, this process is one
 * rank of that world; rank 0 hands out NCCL's id over TCP.
 * Run ./train --help for every option.
 */
#define MOETRAIN_IMPLEMENTATION
#include "moetrain.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>

typedef struct {
    const char *preset, *graph, *data, *metrics, *svg, *save, *load, *forward, *logits_out, *device;
    int steps, log_every, threads, eager, seed, gpu, profile;
    int nproc, dp_replicate, dp_shard, ep;   /* ranks; 0 = derive */
    float timeout;                           /* seconds without progress before a rank gives up */
    float roof_tflops, roof_gbps;
    mt_hparams hp;
    int lr_set, decay_set;
    int n_overrides;
    const char *ov_key[128], *ov_val[128];
} opts;

static void usage(FILE *f) {
    fprintf(f,
            "usage: train [options]\n"
            "  --preset NAME        model preset: %s (default tiny)\n"
            "  --graph FILE         run a precompiled step graph (its config is used)\n"
            "  --device cpu|cuda    backend (default: cuda when this build has CUDA and a GPU is visible)\n"
            "  --gpu N              CUDA device ordinal of a one-rank run (default 0; ranks use LOCAL_RANK)\n"
            "  --nproc N            ranks to start (default: one per visible GPU; 1 on the CPU, where ranks are threads)\n"
            "  --dp-replicate N --dp-shard N --ep N   mesh (defaults: 1, world / dp-replicate, 1); ep divides dp-shard\n"
            "  --timeout S          a rank that makes no progress for S seconds stops every rank (default 600)\n"
            "  --data FILE          raw bytes, or an llm.c/nanoGPT .bin token shard (default: embedded corpus)\n"
            "  --steps N            optimizer steps (default 300)\n"
            "  --seed N             initialization and data-order seed (default 1)\n"
            "  --lr X --warmup N --decay-steps N --min-lr-ratio X\n"
            "  --beta1 X --beta2 X --eps X --weight-decay X --grad-clip X   AdamW (defaults: lr 3e-3 up to dim 128,\n"
            "                       8e-4 up to dim 512, 4.2e-4 beyond; warmup 20, decay over --steps, 0.1, 0.9, 0.95,\n"
            "                       1e-8, weight decay 0.1, clip 1.0)\n"
            "  --metrics FILE       JSON lines: step, loss, grad_norm, lr, tokens_per_s, expert_load\n"
            "  --svg FILE           write the loss curve at the end\n"
            "  --save DIR           write DIR/model.safetensors (Hugging Face names), config.json, optimizer\n"
            "  --load DIR           start from a checkpoint written by --save\n"
            "  --forward FILE       forward only: FILE holds batch*(seq_len+1) int32 tokens; prints the loss\n"
            "  --logits-out FILE    with --forward: write float32 logits [batch*seq_len, vocab]\n"
            "  --eager              no optimizing passes (the baseline)\n"
            "  --threads N          CPU threads (default: all cores; results do not depend on it)\n"
            "  --log-every N        print every N steps (default 1)\n"
            "  --profile            after training, time one more step op by op against the roofline\n"
            "  --roof-tflops X --roof-gbps X   roofline ceilings for --profile (default 790, 3000)\n"
            "  --<field> VALUE      any config field, e.g. --dim 128 --top-k 4 --score-func sigmoid\n"
            "config fields:",
            mt_config_preset_names());
    for (int i = 0; i < mt_n_config_fields; i++) fprintf(f, "%s %s", i % 6 ? "" : "\n   ", mt_config_fields[i].name);
    fprintf(f, "\n");
}

static int parse_int(const char *flag, const char *v, int lo, int hi, int *out) {
    char *end;
    long x = strtol(v, &end, 10);
    if (!*v || *end || x < lo || x > hi) {
        fprintf(stderr, "train: %s takes an integer in %d..%d, not '%s'\n", flag, lo, hi, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}
static int parse_float(const char *flag, const char *v, float *out) {
    char *end;
    double x = strtod(v, &end);
    if (!*v || *end || !(x == x) || x > 1e30 || x < -1e30) {
        fprintf(stderr, "train: %s takes a number, not '%s'\n", flag, v);
        return -1;
    }
    *out = (float)x;
    return 0;
}

static int parse_args(int argc, char **argv, opts *o) {
    memset(o, 0, sizeof *o);
    o->preset = "tiny"; o->device = NULL;
    o->steps = 300; o->log_every = 1; o->seed = 1;
    o->roof_tflops = 790; o->roof_gbps = 3000; o->timeout = 600;
    mt_hparams_default(&o->hp);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); exit(0); }
        if (!strcmp(a, "--eager")) { o->eager = 1; continue; }
        if (!strcmp(a, "--profile")) { o->profile = 1; continue; }
        if (strncmp(a, "--", 2)) { fprintf(stderr, "train: unexpected argument '%s' (see --help)\n", a); return -1; }
        if (i + 1 >= argc) { fprintf(stderr, "train: %s needs a value\n", a); return -1; }
        const char *v = argv[++i];
        const char *k = a + 2;
        int rc = 0;
        if (!strcmp(k, "preset")) o->preset = v;
        else if (!strcmp(k, "graph")) o->graph = v;
        else if (!strcmp(k, "device")) o->device = v;
        else if (!strcmp(k, "data")) o->data = v;
        else if (!strcmp(k, "metrics")) o->metrics = v;
        else if (!strcmp(k, "svg")) o->svg = v;
        else if (!strcmp(k, "save")) o->save = v;
        else if (!strcmp(k, "load")) o->load = v;
        else if (!strcmp(k, "forward")) o->forward = v;
        else if (!strcmp(k, "logits-out")) o->logits_out = v;
        else if (!strcmp(k, "steps")) rc = parse_int(a, v, 0, 1 << 30, &o->steps);
        else if (!strcmp(k, "seed")) rc = parse_int(a, v, 0, 0x7fffffff, &o->seed);
        else if (!strcmp(k, "threads")) rc = parse_int(a, v, 1, 64, &o->threads);
        else if (!strcmp(k, "gpu")) rc = parse_int(a, v, 0, 1023, &o->gpu);
        else if (!strcmp(k, "nproc")) rc = parse_int(a, v, 1, 4096, &o->nproc);
        else if (!strcmp(k, "dp-replicate")) rc = parse_int(a, v, 1, 4096, &o->dp_replicate);
        else if (!strcmp(k, "dp-shard")) rc = parse_int(a, v, 1, 4096, &o->dp_shard);
        else if (!strcmp(k, "ep")) rc = parse_int(a, v, 1, 4096, &o->ep);
        else if (!strcmp(k, "timeout")) { rc = parse_float(a, v, &o->timeout); if (!rc && !(o->timeout > 0)) { fprintf(stderr, "train: --timeout takes seconds > 0\n"); rc = -1; } }
        else if (!strcmp(k, "log-every")) rc = parse_int(a, v, 1, 1 << 30, &o->log_every);
        else if (!strcmp(k, "lr")) { rc = parse_float(a, v, &o->hp.lr); o->lr_set = 1; }
        else if (!strcmp(k, "warmup")) rc = parse_int(a, v, 0, 1 << 30, &o->hp.warmup_steps);
        else if (!strcmp(k, "decay-steps")) { rc = parse_int(a, v, 0, 1 << 30, &o->hp.decay_steps); o->decay_set = 1; }
        else if (!strcmp(k, "min-lr-ratio")) rc = parse_float(a, v, &o->hp.min_lr_ratio);
        else if (!strcmp(k, "beta1")) rc = parse_float(a, v, &o->hp.beta1);
        else if (!strcmp(k, "beta2")) rc = parse_float(a, v, &o->hp.beta2);
        else if (!strcmp(k, "eps")) rc = parse_float(a, v, &o->hp.eps);
        else if (!strcmp(k, "weight-decay")) rc = parse_float(a, v, &o->hp.weight_decay);
        else if (!strcmp(k, "grad-clip")) rc = parse_float(a, v, &o->hp.grad_clip);
        else if (!strcmp(k, "roof-tflops")) rc = parse_float(a, v, &o->roof_tflops);
        else if (!strcmp(k, "roof-gbps")) rc = parse_float(a, v, &o->roof_gbps);
        else {
            if (o->n_overrides >= 128) { fprintf(stderr, "train: too many options\n"); return -1; }
            o->ov_key[o->n_overrides] = k; o->ov_val[o->n_overrides++] = v;
        }
        if (rc) return -1;
    }
    if (!o->decay_set) o->hp.decay_steps = o->steps;
    if (!(o->hp.lr > 0) || o->hp.beta1 < 0 || o->hp.beta1 >= 1 || o->hp.beta2 < 0 || o->hp.beta2 >= 1 || !(o->hp.eps > 0) ||
        o->hp.weight_decay < 0 || o->hp.min_lr_ratio < 0 || o->hp.min_lr_ratio > 1) {
        fprintf(stderr, "train: AdamW settings out of range (need lr > 0, 0 <= betas < 1, eps > 0, weight decay >= 0, "
                        "0 <= min-lr-ratio <= 1)\n");
        return -1;
    }
    if (!o->device) {
#ifdef MT_CUDA
        o->device = mt_cuda_device_count() > 0 ? "cuda" : "cpu";
#else
        o->device = "cpu";
#endif
    }
    if (strcmp(o->device, "cpu") && strcmp(o->device, "cuda")) { fprintf(stderr, "train: --device takes cpu or cuda, not '%s'\n", o->device); return -1; }
#ifndef MT_CUDA
    if (!strcmp(o->device, "cuda")) { fprintf(stderr, "train: this build has no CUDA support (build where nvcc is installed)\n"); return -1; }
#endif
    if (o->logits_out && !o->forward) { fprintf(stderr, "train: --logits-out needs --forward\n"); return -1; }
    return 0;
}

static int apply_overrides(const opts *o, mt_config *c) {
    mt_err err;
    for (int i = 0; i < o->n_overrides; i++)
        if (mt_config_set(c, o->ov_key[i], o->ov_val[i], &err)) {
            fprintf(stderr, "train: %s (see --help)\n", err.msg);
            return -1;
        }
    return 0;
}

static void choose_target(const opts *o, mt_target *t) {
    if (!strcmp(o->device, "cuda")) mt_target_cuda(t, "sm_90a");
    else mt_target_cpu(t);
}

/* tokens/s, memory and load balance for one step's log line */
static double load_imbalance(mt_runtime *rt, int32_t *counts, int E) {
    int n = mt_runtime_n_moe_layers(rt);
    if (!n) return 1.0;
    double acc = 0;
    for (int i = 0; i < n; i++) {
        mt_runtime_expert_counts(rt, i, counts);
        double mx = 0, sum = 0;
        for (int e = 0; e < E; e++) { sum += counts[e]; if (counts[e] > mx) mx = counts[e]; }
        acc += sum > 0 ? mx / (sum / E) : 1.0;
    }
    return acc / n;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One profiled step: time per op, with FLOPs/bytes against the roofline. */
static void print_profile(mt_runtime *rt, const opts *o, double step_ms) {
    const mt_graph *G = mt_runtime_graph(rt);
    double ms[MT_NOPS], fl[MT_NOPS] = {0}, by[MT_NOPS] = {0}, floor_ms[MT_NOPS] = {0}, total = 0;
    int64_t calls[MT_NOPS];
    mt_runtime_profile(rt, ms, calls);
    for (int i = 0; i < G->n_nodes; i++) {
        double f, b;
        mt_node_cost(G, &G->nodes[i], &f, &b);
        int op = G->nodes[i].op;
        fl[op] += f; by[op] += b;
        double t = f / (o->roof_tflops * 1e12) > b / (o->roof_gbps * 1e9) ? f / (o->roof_tflops * 1e12) : b / (o->roof_gbps * 1e9);
        floor_ms[op] += 1e3 * t;
    }
    for (int i = 0; i < MT_NOPS; i++) total += ms[i];
    int order[MT_NOPS];
    for (int i = 0; i < MT_NOPS; i++) order[i] = i;
    for (int i = 0; i < MT_NOPS; i++)
        for (int j = i + 1; j < MT_NOPS; j++)
            if (ms[order[j]] > ms[order[i]]) { int t = order[i]; order[i] = order[j]; order[j] = t; }
    printf("profile (one synchronized step, %.1f ms op time; the unprofiled step took %.1f ms; roofline %.0f TFLOP/s, %.0f GB/s)\n",
           total, step_ms, (double)o->roof_tflops, (double)o->roof_gbps);
    printf("  %-18s %6s %10s %6s %10s %9s %9s %10s %7s\n", "op", "calls", "ms", "%", "GFLOP", "TFLOP/s", "GB/s", "floor ms", "x floor");
    for (int k = 0; k < MT_NOPS; k++) {
        int i = order[k];
        if (!calls[i]) continue;
        printf("  %-18s %6lld %10.3f %5.1f%% %10.1f %9.1f %9.1f %10.3f %7.1f\n", mt_ops[i].name, (long long)calls[i], ms[i],
               100 * ms[i] / total, fl[i] / 1e9, ms[i] > 0 ? fl[i] / (ms[i] * 1e9) : 0, ms[i] > 0 ? by[i] / (ms[i] * 1e6) : 0,
               floor_ms[i], floor_ms[i] > 0 ? ms[i] / floor_ms[i] : 0);
    }
}

static int run_forward(const opts *o, mt_config cfg) {
    mt_err err;
    mt_graph g;
    mt_mesh mesh;
    mt_target tgt;
    mt_passes passes;
    mt_mesh_single(&mesh);
    choose_target(o, &tgt);
    if (o->eager) mt_passes_none(&passes); else mt_passes_all(&passes);
    if (mt_compile(&g, &cfg, &mesh, &tgt, MT_GRAPH_FORWARD, &passes, &err)) { fprintf(stderr, "train: %s\n", err.msg); return 1; }
    mt_binding bind;
    mt_binding_single(&bind);
    bind.n_threads = o->threads;
    bind.device = o->gpu;
    mt_runtime *rt;
    if (mt_runtime_create(&rt, &g, &bind, &err)) { fprintf(stderr, "train: %s\n", err.msg); mt_graph_free(&g); return 1; }
    mt_graph_free(&g);
    if (o->load) {
        if (mt_checkpoint_load(rt, o->load, NULL, &err)) { fprintf(stderr, "train: %s\n", err.msg); mt_runtime_destroy(rt); return 1; }
    } else if (mt_runtime_init_params(rt, (uint64_t)o->seed, &err)) {
        fprintf(stderr, "train: %s\n", err.msg);
        mt_runtime_destroy(rt);
        return 1;
    }
    uint8_t *bytes; size_t len;
    if (mt_read_file(o->forward, &bytes, &len, &err)) { fprintf(stderr, "train: %s\n", err.msg); mt_runtime_destroy(rt); return 1; }
    int B = cfg.batch, T = cfg.seq_len;
    size_t want = (size_t)B * (size_t)(T + 1) * 4;
    if (len != want) {
        fprintf(stderr, "train: '%s' has %zu bytes; --batch %d --seq-len %d needs %zu (int32 [batch, seq_len+1])\n", o->forward,
                len, B, T, want);
        free(bytes); mt_runtime_destroy(rt);
        return 1;
    }
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * T), *tgt_ = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * T);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            memcpy(&tok[b * T + t], bytes + 4 * ((size_t)b * (T + 1) + t), 4);
            memcpy(&tgt_[b * T + t], bytes + 4 * ((size_t)b * (T + 1) + t + 1), 4);
        }
    free(bytes);
    mt_step_stats st;
    int rc = 0;
    if (mt_runtime_step(rt, tok, tgt_, 0, NULL, &st, &err)) { fprintf(stderr, "train: %s\n", err.msg); rc = 1; }
    if (!rc) {
        printf("loss %.9g\n", st.loss);
        if (o->logits_out) {
            const mt_graph *G = mt_runtime_graph(rt);
            int lv = G->io[MT_IO_LOGITS];
            int64_t n = (int64_t)B * T * cfg.vocab_size;
            void *raw = malloc((size_t)G->values[lv].nbytes);
            float *f32 = (float *)malloc(sizeof(float) * (size_t)n);
            if (mt_runtime_read(rt, lv, raw, &err)) { fprintf(stderr, "train: %s\n", err.msg); rc = 1; }
            for (int64_t i = 0; i < n && !rc; i++) {
                if (G->values[lv].dtype == MT_BF16) {   /* bf16 logits (CUDA) */
                    uint32_t u = (uint32_t)((uint16_t *)raw)[i] << 16;
                    memcpy(&f32[i], &u, 4);
                } else {
                    f32[i] = (float)((mt_real *)raw)[i];
                }
            }
            free(raw);
            FILE *f = rc ? NULL : fopen(o->logits_out, "wb");
            if (rc) {
            } else if (!f || fwrite(f32, sizeof(float), (size_t)n, f) != (size_t)n || fclose(f)) {
                fprintf(stderr, "train: cannot write '%s'\n", o->logits_out);
                rc = 1;
            }
            free(f32);
        }
    }
    free(tok); free(tgt_);
    mt_runtime_destroy(rt);
    return rc;
}

/* ------------------------------------------------------------------------
 * Many ranks. A job is the model, its compiled (or loaded) step graph and
 * the data, shared read-only by the ranks of this process: one rank per
 * process on GPUs, every rank as a thread on the CPU.
 * ---------------------------------------------------------------------- */

typedef struct {
    const opts *o;
    mt_config cfg;
    const mt_graph *g;         /* the step graph every rank binds */
    const mt_dataset *ds;
    int world, local_rank;     /* process ranks: this rank's local rank */
    mt_rdv *rdv;               /* process ranks: the rendezvous (NULL for threads and one rank) */
    uint8_t nccl_id[MT_NCCL_ID_BYTES];
    double t_launch;           /* when this process started */
    mt_runtime **rts;          /* per rank of this process (thread-ranks: all of them); freed after they end */
    /* the watchdog's view of this process's rank */
    volatile double last_progress;
    volatile int finished, stop;
    int rank;
} job_t;

/* What every rank does: bind, initialize, train; rank 0 reports. */
static int train_rank(job_t *j, int rank, mt_world *w, mt_err *err) {
    const opts *o = j->o;
    const mt_config *cfg = &j->cfg;
    const mt_graph *G = j->g;
    int world = j->world, lead = rank == 0;
    mt_binding bind;
    mt_binding_single(&bind);
    bind.rank = rank; bind.world = world; bind.local_rank = w ? rank : j->local_rank;
    bind.device = world > 1 ? bind.local_rank : o->gpu;
    bind.cpu_world = w;
    memcpy(bind.nccl_id, j->nccl_id, sizeof bind.nccl_id);
    bind.n_threads = o->threads;
    if (w && !o->threads) {   /* thread-ranks share the cores */
        int cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
        bind.n_threads = cores / world > 1 ? cores / world : 1;
    }
    mt_runtime *rt;
    if (mt_runtime_create(&rt, G, &bind, err)) return -1;
    j->rts[w ? rank : 0] = rt;   /* a failed rank's buffers stay until every rank has stopped reading them */
    int step0 = 0;
    if (mt_runtime_init_params(rt, (uint64_t)o->seed, err) || (o->load && mt_checkpoint_load(rt, o->load, &step0, err)))
        return -1;
    int B = cfg->batch, T = cfg->seq_len, E = cfg->n_routed_experts > 0 ? cfg->n_routed_experts : 1;
    int dp = world / G->mesh.size[MT_DIM_TP], dp_rank = rank / G->mesh.size[MT_DIM_TP];
    int on_gpu = mt_runtime_backend(rt) == MT_BACKEND_CUDA;
    double flops_tok = mt_flops_per_token(cfg), tokens_global = (double)B * T * dp;
    if (lead) {
        mt_param_count pc;
        mt_count_params(cfg, &pc);
        char h1[32], h2[32], h3[32], mn[64];
        printf("model: %lld parameters (%lld active per token), %d layers, %d experts top-%d | data: %s, %lld tokens\n",
               (long long)pc.total, (long long)(pc.dense + pc.sparse_active), cfg->n_layers, cfg->n_routed_experts, cfg->top_k,
               o->data ? o->data : "embedded corpus", (long long)j->ds->n);
        printf("memory per rank: %s persistent + %s arena (naive %s) | %s | %s | uniform loss ln(%d) = %.4f\n",
               mt__human((double)G->persist_bytes, h1), mt__human((double)G->arena_bytes, h2),
               mt__human((double)G->naive_arena_bytes, h3), G->planned ? "planned" : "eager",
               on_gpu ? "CUDA bf16" : "CPU fp32", cfg->vocab_size, log((double)cfg->vocab_size));
        if (world > 1) {
            printf("ranks: %d (%s) | mesh", world, w ? "CPU threads" : on_gpu ? "one process per GPU, NCCL" : "processes");
            for (int d = 0; d < MT_NDIMS; d++) printf(" %s=%d", mt_dim_names[d], G->mesh.size[d]);
            mt_mesh_mask_name(MT_DIMBIT(MT_DIM_DP_SHARD), mn, sizeof mn);
            printf(" | global batch %d x %d (%d per rank)\n", B * dp, T, B);
        }
    }
    FILE *mf = NULL;
    if (lead && o->metrics && !(mf = fopen(o->metrics, "w"))) {
        return mt_errf(err, "cannot write '%s'", o->metrics);
    }
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * T), *tgt = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * T);
    int32_t *counts = (int32_t *)malloc(sizeof(int32_t) * (size_t)E);
    double *curve = (double *)malloc(sizeof(double) * (size_t)(o->steps + 1));
    double *times = (double *)malloc(sizeof(double) * (size_t)(o->steps + 1));
    int rc = 0, per_rank = world <= 31;
    double t_start = mt_now(), first_loss = 0, last_loss = 0, peak_max = 0;
    for (int s = 0; s < o->steps && !rc; s++) {
        int step = step0 + s;
        mt_step_stats st;
        j->last_progress = mt_now();
        if (mt_data_batch_at(j->ds, (uint64_t)o->seed, step, dp_rank, dp, B, T, tok, tgt, err) ||
            mt_runtime_step(rt, tok, tgt, step, &o->hp, &st, err)) {
            rc = -1;
            break;
        }
        if (s == 0 && lead && world > 1)
            printf("first step done %.2f s after launch\n", mt_now() - j->t_launch);
        if (!isfinite(st.loss)) {
            mt_errf(err, "the loss is %g at step %d: training diverged (try a smaller --lr)", st.loss, step + 1);
            rc = -1;
            break;
        }
        /* across ranks: the slowest step, the largest memory, and per rank its time and received rows */
        double x[64] = {0};
        x[0] = st.seconds; x[1] = (double)mt_runtime_peak_bytes(rt);
        if (per_rank) { x[2 + rank] = st.seconds; x[2 + world + rank] = (double)mt_runtime_received_rows(rt); }
        double mx[2] = {x[0], x[1]};
        if (world > 1 && (mt_runtime_allreduce_host(rt, mx, 2, 1, err) ||
                          (per_rank && mt_runtime_allreduce_host(rt, x + 2, 2 * world, 0, err)))) { rc = -1; break; }
        double secs = mx[0];
        peak_max = mx[1];
        curve[s] = st.loss;
        times[s] = secs;
        if (s == 0) first_loss = st.loss;
        last_loss = st.loss;
        double tps = tokens_global / secs;
        double lb = load_imbalance(rt, counts, E);
        if (lead && ((s + 1) % o->log_every == 0 || s == 0 || s + 1 == o->steps)) {
            printf("step %5d | loss %.6f | grad_norm %8.4f | lr %.3e | %8.0f tok/s", step + 1, st.loss, st.grad_norm, st.lr, tps);
            if (world > 1) printf(" (%.0f/rank)", tps / world);
            printf(" | %7.1f ms | load max/mean %.2f", 1e3 * secs, lb);
            if (on_gpu)
                printf(" | mfu %.1f%% | mem %.2f GiB", 100.0 * tps / world * flops_tok / 989e12, peak_max / 1073741824.0);
            if (mt_runtime_host_syncs(rt)) printf(" | %d host syncs", mt_runtime_host_syncs(rt));
            printf("\n");
        }
        if (mf) {
            fprintf(mf, "{\"step\":%d,\"loss\":%.9g,\"grad_norm\":%.9g,\"lr\":%.9g,\"tokens_per_s\":%.1f,\"step_ms\":%.3f,"
                        "\"ranks\":%d,\"host_syncs\":%d,\"peak_bytes_max\":%.0f",
                    step + 1, st.loss, st.grad_norm, st.lr, tps, 1e3 * secs, world, mt_runtime_host_syncs(rt), peak_max);
            if (world > 1 && per_rank) {
                fprintf(mf, ",\"rank_step_ms\":[");
                for (int r = 0; r < world; r++) fprintf(mf, "%s%.3f", r ? "," : "", 1e3 * x[2 + r]);
                fprintf(mf, "],\"rank_received_rows\":[");
                for (int r = 0; r < world; r++) fprintf(mf, "%s%.0f", r ? "," : "", x[2 + world + r]);
                fprintf(mf, "]");
            }
            fprintf(mf, ",\"expert_load\":[");
            for (int i = 0; i < mt_runtime_n_moe_layers(rt); i++) {
                mt_runtime_expert_counts(rt, i, counts);
                fprintf(mf, "%s[", i ? "," : "");
                for (int e = 0; e < E; e++) fprintf(mf, "%s%d", e ? "," : "", counts[e]);
                fprintf(mf, "]");
            }
            fprintf(mf, "]}\n");
            fflush(mf);
        }
    }
    j->last_progress = mt_now();
    if (!rc && o->steps > 0 && lead) {
        printf("done: %d steps in %.1f s, loss %.4f -> %.4f\n", o->steps, mt_now() - t_start, first_loss, last_loss);
        int skip = o->steps > 4 ? 2 : 0, nt = o->steps - skip;   /* the median step after two warm-up steps */
        qsort(times + skip, (size_t)nt, sizeof(double), cmp_double);
        double med = times[skip + nt / 2], tps = tokens_global / med;
        printf("summary: preset=%s device=%s mode=%s ranks=%d tokens=%.0f median_step_ms=%.2f tokens_per_s=%.0f "
               "tokens_per_s_per_rank=%.0f mfu=%.2f%% peak_mem_gib=%.2f flops_per_token=%.0f host_syncs=%d\n",
               o->graph ? o->graph : o->preset, on_gpu ? "cuda" : "cpu", o->eager ? "eager" : "compiled", world, tokens_global,
               1e3 * med, tps, tps / world, on_gpu ? 100.0 * tps / world * flops_tok / 989e12 : 0.0, peak_max / 1073741824.0,
               flops_tok, mt_runtime_host_syncs(rt));
    }
    if (!rc && o->profile && o->steps > 0) {   /* every rank steps; rank 0 prints */
        mt_step_stats st;
        mt_runtime_set_profile(rt, 1);
        if (mt_data_batch_at(j->ds, (uint64_t)o->seed, step0 + o->steps, dp_rank, dp, B, T, tok, tgt, err) ||
            mt_runtime_step(rt, tok, tgt, step0 + o->steps, &o->hp, &st, err))
            rc = -1;
        else if (lead) {
            int skip = o->steps > 4 ? 2 : 0;
            print_profile(rt, o, 1e3 * times[skip + (o->steps - skip) / 2]);
        }
        mt_runtime_set_profile(rt, 0);
    }
    if (mf) fclose(mf);
    if (!rc && lead && o->svg && o->steps > 0) {
        char title[128];
        snprintf(title, sizeof title, "moetrain loss (%s, seed %d)", o->graph ? o->graph : o->preset, o->seed);
        if (mt_write_svg(o->svg, curve, o->steps, title, err)) rc = -1;
    }
    if (!rc && o->save) {
        if (mt_checkpoint_save(rt, o->save, step0 + o->steps, err)) rc = -1;
        else printf("saved %s/model.safetensors, config.json, optimizer.safetensors\n", o->save);
    }
    free(tok); free(tgt); free(counts); free(curve); free(times);
    return rc ? -1 : 0;
}

static int thread_rank(void *ctx, int rank, mt_world *w, mt_err *err) { return train_rank((job_t *)ctx, rank, w, err); }

/* Stop this process now: abort the communicators (pending NCCL calls return)
 * on a thread of its own, give it a second, and exit either way: an abort
 * that blocks must not keep a failed job alive. */
static void *abort_comms(void *arg) { mt_runtime_abort((mt_runtime *)arg); return NULL; }
static void stop_process(job_t *j) {
    fflush(stderr); fflush(stdout);
    pthread_t th;
    if (j->rts[0] && !pthread_create(&th, NULL, abort_comms, j->rts[0])) {
        pthread_detach(th);
        mt__sleep_ms(1000);
    }
    _exit(1);
}

/* The watchdog of a process rank: it relays failures between ranks, and if
 * any rank fails, dies, or this one stops making progress, it stops this
 * process within seconds (a blocked collective never returns by itself). */
static void *watchdog(void *arg) {
    job_t *j = (job_t *)arg;
    char why[300], msg[512];
    int who = -1;
    while (!j->stop) {
        int k = mt_rdv_poll(j->rdv, 200, &who, why, sizeof why);
        if (k == 2) { j->finished = 1; return NULL; }
        mt_err e;
        int fail = 0;
        if (k == 1) {
            snprintf(msg, sizeof msg, "rank %d: stopping: rank %d failed: %s", j->rank, who, why);
            fail = 1;
        } else if (j->rts[0] && mt_runtime_comm_error(j->rts[0], &e)) {
            snprintf(msg, sizeof msg, "rank %d: %s", j->rank, e.msg);
            mt_rdv_fail(j->rdv, e.msg);
            fail = 1;
        } else if (!j->finished && mt_now() - j->last_progress > j->o->timeout) {
            snprintf(why, sizeof why, "no progress for %.0f s (stuck in a collective? see --timeout)", (double)j->o->timeout);
            snprintf(msg, sizeof msg, "rank %d: %s", j->rank, why);
            mt_rdv_fail(j->rdv, why);
            fail = 1;
        }
        if (fail) {
            fprintf(stderr, "train: %s\n", msg);
            stop_process(j);
        }
    }
    return NULL;
}

/* One rank of a multi-process world (a launcher set RANK, WORLD_SIZE, ...). */
static int process_rank(job_t *j, int rank, const char *addr, int port) {
    mt_err err;
    j->rank = rank;
    j->last_progress = mt_now();
#ifdef MT_CUDA
    if (rank == 0 && mt_nccl_unique_id(j->nccl_id, &err)) { fprintf(stderr, "train: rank 0: %s\n", err.msg); return 1; }
#endif
    if (mt_rdv_open(&j->rdv, addr, port, rank, j->world, j->nccl_id, sizeof j->nccl_id, j->o->timeout, &err)) {
        fprintf(stderr, "train: rank %d: %s\n", rank, err.msg);
        return 1;
    }
    pthread_t th;
    if (pthread_create(&th, NULL, watchdog, j)) { fprintf(stderr, "train: rank %d: cannot start the watchdog\n", rank); return 1; }
    if (train_rank(j, rank, NULL, &err)) {
        fprintf(stderr, "train: rank %d: %s\n", rank, err.msg);
        mt_rdv_fail(j->rdv, err.msg);
        stop_process(j);
    }
    mt_rdv_done(j->rdv);   /* the orderly end: every rank done, then rank 0 says bye */
    double t0 = mt_now();
    while (!j->finished && mt_now() - t0 < 60) mt__sleep_ms(20);
    j->stop = 1;
    pthread_join(th, NULL);
    mt_rdv_close(j->rdv);
    return 0;
}

/* ./train with no launcher and several GPUs: start one process per rank (this
 * same program, with the launcher's variables set), watch them, and if one
 * fails or dies, stop the rest. */
static volatile sig_atomic_t g_signal;
static void on_signal(int s) { g_signal = s; }
static int supervise(int argc, char **argv, int n) {
    (void)argc;
    mt_err err;
    int port = mt_free_port(&err);
    if (port < 0) { fprintf(stderr, "train: %s\n", err.msg); return 1; }
    pid_t parent = getpid(), *pid = (pid_t *)calloc((size_t)n, sizeof(pid_t));
    int *alive = (int *)calloc((size_t)n, sizeof(int));
    char v[32];
    fflush(stdout); fflush(stderr);
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        if (pid[r] < 0) { fprintf(stderr, "train: fork: %s\n", strerror(errno)); for (int q = 0; q < r; q++) kill(pid[q], SIGKILL); return 1; }
        if (pid[r] == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);   /* no orphans if the launcher dies */
            if (getppid() != parent) _exit(1);
            snprintf(v, sizeof v, "%d", r); setenv("RANK", v, 1); setenv("LOCAL_RANK", v, 1);
            snprintf(v, sizeof v, "%d", n); setenv("WORLD_SIZE", v, 1); setenv("LOCAL_WORLD_SIZE", v, 1);
            snprintf(v, sizeof v, "%d", port); setenv("MASTER_PORT", v, 1);
            setenv("MASTER_ADDR", "127.0.0.1", 1);
            execv("/proc/self/exe", argv);
            fprintf(stderr, "train: rank %d: exec: %s\n", r, strerror(errno));
            _exit(127);
        }
        alive[r] = 1;
    }
    signal(SIGINT, on_signal); signal(SIGTERM, on_signal);
    int failed = 0, left = n, forwarded = 0;
    double deadline = 0;
    while (left > 0) {
        int st;
        pid_t p = waitpid(-1, &st, WNOHANG);
        if (p > 0) {
            int r = 0;
            while (r < n && pid[r] != p) r++;
            if (r == n) continue;
            alive[r] = 0; left--;
            if (WIFSIGNALED(st)) fprintf(stderr, "train: rank %d was killed by signal %d (%s)\n", r, WTERMSIG(st), strsignal(WTERMSIG(st)));
            else if (WEXITSTATUS(st)) fprintf(stderr, "train: rank %d exited with status %d\n", r, WEXITSTATUS(st));
            if ((WIFSIGNALED(st) || WEXITSTATUS(st)) && !failed) { failed = 1; deadline = mt_now() + 5; }
            continue;
        }
        if (g_signal && !forwarded) {
            for (int r = 0; r < n; r++) if (alive[r]) kill(pid[r], (int)g_signal);
            forwarded = 1; failed = 1; deadline = mt_now() + 5;
        }
        if (failed && mt_now() > deadline) {   /* the ranks stop themselves; these did not */
            for (int r = 0; r < n; r++)
                if (alive[r]) { fprintf(stderr, "train: rank %d did not stop: killing it\n", r); kill(pid[r], SIGKILL); }
            deadline = mt_now() + 1e9;
        }
        mt__sleep_ms(20);
    }
    free(pid); free(alive);
    return failed ? 1 : 0;
}

static int env_int(const char *name, int dflt, int lo, int hi, int *out) {
    const char *v = getenv(name);
    if (!v || !*v) { *out = dflt; return 0; }
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < lo || x > hi) { fprintf(stderr, "train: %s=%s is not an integer in %d..%d\n", name, v, lo, hi); return -1; }
    *out = (int)x;
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);   /* one line per step, also into pipes and files */
    double t_launch = mt_now();
    setenv("NCCL_NVLS_ENABLE", "0", 0);  /* no NVLink multicast unless the user asks for it */
    opts o;
    if (parse_args(argc, argv, &o)) return 2;
    mt_err err;
    mt_config cfg;
    mt_graph g;
    memset(&g, 0, sizeof g);
    int have_graph = 0;

    /* 1. the model: from an artifact, a checkpoint, or a preset (+ overrides) */
    if (o.graph) {
        if (o.n_overrides) {
            fprintf(stderr, "train: --graph fixes the model; '--%s' cannot change it (re-run precompile instead)\n", o.ov_key[0]);
            return 2;
        }
        if (mt_artifact_load(&g, o.graph, &err)) { fprintf(stderr, "train: %s\n", err.msg); return 1; }
        if (g.kind != MT_GRAPH_TRAIN) { fprintf(stderr, "train: '%s' is a forward-only graph\n", o.graph); mt_graph_free(&g); return 1; }
        if (!strcmp(o.device, "cuda") != (g.target.backend == MT_BACKEND_CUDA)) {
            fprintf(stderr, "train: '%s' was compiled for %s; this run is on %s (precompile with --device %s)\n", o.graph,
                    g.target.backend == MT_BACKEND_CUDA ? "cuda" : "cpu", o.device, o.device);
            mt_graph_free(&g);
            return 2;
        }
        cfg = g.cfg;
        have_graph = 1;
    } else if (o.load) {
        if (mt_checkpoint_read_config(o.load, &cfg, &err)) { fprintf(stderr, "train: %s\n", err.msg); return 1; }
        if (apply_overrides(&o, &cfg)) return 2;
    } else {
        if (mt_config_preset(&cfg, o.preset, &err)) { fprintf(stderr, "train: %s\n", err.msg); return 2; }
        if (apply_overrides(&o, &cfg)) return 2;
    }
    if (mt_config_validate(&cfg, &err)) { fprintf(stderr, "train: %s\n", err.msg); return 2; }
    if (!o.lr_set) {   /* the model's default peak learning rate */
        mt_hparams d;
        mt_hparams_for_config(&d, &cfg);
        o.hp.lr = d.lr;
    }
    if (o.forward) {
        if (o.nproc > 1 || getenv("WORLD_SIZE")) { fprintf(stderr, "train: --forward runs on one rank\n"); return 2; }
        return run_forward(&o, cfg);
    }

    /* 2. the ranks: a launcher's world, or ours */
    int launched = getenv("RANK") && getenv("WORLD_SIZE");
    int world = 1, rank = 0, local_rank = 0, port = 29500, gpus = 0, on_cuda = !strcmp(o.device, "cuda");
#ifdef MT_CUDA
    if (on_cuda) gpus = mt_cuda_device_count();
#endif
    if (launched) {
        if (env_int("WORLD_SIZE", 1, 1, 1 << 20, &world) || env_int("RANK", 0, 0, world - 1, &rank) ||
            env_int("LOCAL_RANK", rank, 0, 1 << 20, &local_rank) || env_int("MASTER_PORT", 29500, 1, 65535, &port))
            return 2;
        /* torchrun's agent keeps its own store on MASTER_PORT: ours takes the next port (MOETRAIN_PORT overrides) */
        const char *agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
        if (agent && (!strcmp(agent, "True") || !strcmp(agent, "true") || !strcmp(agent, "1")) && port < 65535) port++;
        if (env_int("MOETRAIN_PORT", port, 1, 65535, &port)) return 2;
        if (o.nproc && o.nproc != world) { fprintf(stderr, "train: --nproc %d but the launcher set WORLD_SIZE=%d\n", o.nproc, world); return 2; }
        if (world > 1 && !on_cuda) {
            fprintf(stderr, "train: CPU ranks are threads of one process: run './train --device cpu --nproc %d' without RANK/WORLD_SIZE\n", world);
            return 2;
        }
        if (on_cuda && local_rank >= gpus) {
            fprintf(stderr, "train: rank %d: LOCAL_RANK=%d but this host has %d visible GPU%s\n", rank, local_rank, gpus, gpus == 1 ? "" : "s");
            return 2;
        }
    } else {
        world = o.nproc ? o.nproc : have_graph ? mt_mesh_world(&g.mesh) : on_cuda ? (gpus > 0 ? gpus : 1) : 1;
        if (on_cuda && world > gpus) {
            fprintf(stderr, "train: %d ranks need %d GPUs; %d %s visible (one rank per GPU)\n", world, world, gpus, gpus == 1 ? "is" : "are");
            return 2;
        }
    }
    if (have_graph && mt_mesh_world(&g.mesh) != world) {
        fprintf(stderr, "train: '%s' was precompiled for a world of %d ranks (mesh", o.graph, mt_mesh_world(&g.mesh));
        for (int d = 0; d < MT_NDIMS; d++) fprintf(stderr, " %s=%d", mt_dim_names[d], g.mesh.size[d]);
        fprintf(stderr, "); this launch has %d ranks\n", world);
        mt_graph_free(&g);
        return 2;
    }
    if (world > 1 && (o.save || o.load)) {
        fprintf(stderr, "train: --save and --load work on one rank for now (checkpoints of sharded runs are not written yet)\n");
        mt_graph_free(&g);
        return 2;
    }
    if (!launched && world > 1 && on_cuda) return supervise(argc, argv, world);   /* one process per GPU */

    /* 3. the step graph: compiled here unless an artifact was given */
    if (!have_graph) {
        mt_mesh mesh;
        mt_target tgt;
        mt_passes passes;
        int rep = o.dp_replicate ? o.dp_replicate : 1;
        int shard = o.dp_shard ? o.dp_shard : world / rep;
        if (rep * shard != world) {
            fprintf(stderr, "train: the mesh dp-replicate %d x dp-shard %d = %d does not match %d ranks\n", rep, shard, rep * shard, world);
            return 2;
        }
        if (mt_mesh_init(&mesh, rep, shard, 1, o.ep ? o.ep : 1, &err) || mt_mesh_validate(&mesh, &cfg, &err)) {
            fprintf(stderr, "train: %s\n", err.msg);
            return 2;
        }
        choose_target(&o, &tgt);
        if (o.eager) mt_passes_none(&passes); else mt_passes_all(&passes);
        double t0 = mt_now();
        if (mt_compile(&g, &cfg, &mesh, &tgt, MT_GRAPH_TRAIN, &passes, &err)) { fprintf(stderr, "train: %s\n", err.msg); return 1; }
        if (rank == 0) printf("compiled the step graph in %.2f s: %d nodes, %d values\n", mt_now() - t0, g.n_nodes, g.n_values);
    } else if (rank == 0) {
        printf("loaded the step graph from %s: %d nodes, %d values\n", o.graph, g.n_nodes, g.n_values);
    } else if (o.dp_shard || o.dp_replicate || o.ep) {
        fprintf(stderr, "train: --graph fixes the mesh; re-run precompile to change it\n");
        return 2;
    }

    /* 4. data */
    mt_dataset ds;
    if (o.data ? mt_data_load(&ds, o.data, &err) : mt_data_default(&ds, &err)) {
        fprintf(stderr, "train: %s\n", err.msg);
        mt_graph_free(&g);
        return 1;
    }
    if (ds.max_token >= cfg.vocab_size || ds.n < (int64_t)cfg.seq_len + 1) {
        if (ds.max_token >= cfg.vocab_size)
            fprintf(stderr, "train: the data holds token %d but the vocabulary has %d entries (set --vocab-size)\n", ds.max_token, cfg.vocab_size);
        else
            fprintf(stderr, "train: the data has %lld tokens, fewer than one sequence of %d\n", (long long)ds.n, cfg.seq_len + 1);
        mt_data_free(&ds); mt_graph_free(&g);
        return 1;
    }

    /* 5. train: one rank here, every rank as a thread, or this process's rank */
    job_t *j = (job_t *)calloc(1, sizeof *j);
    j->o = &o; j->cfg = cfg; j->g = &g; j->ds = &ds; j->world = world; j->local_rank = local_rank; j->t_launch = t_launch;
    j->rts = (mt_runtime **)calloc((size_t)world, sizeof(mt_runtime *));
    int rc;
    if (launched && world > 1) {
        const char *addr = getenv("MASTER_ADDR");
        rc = process_rank(j, rank, addr && *addr ? addr : "127.0.0.1", port);
    } else if (world > 1) {
        rc = mt_run_thread_ranks(world, thread_rank, j, &err) ? 1 : 0;
        if (rc) fprintf(stderr, "train: %s\n", err.msg);
    } else {
        rc = train_rank(j, 0, NULL, &err) ? 1 : 0;
        if (rc) fprintf(stderr, "train: %s\n", err.msg);
    }
    for (int r = 0; r < world; r++) mt_runtime_destroy(j->rts[r]);
    free(j->rts);
    free(j);
    mt_data_free(&ds);
    mt_graph_free(&g);
    return rc;
}
