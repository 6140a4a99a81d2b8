/* train — train a DeepSeek-V3-style MoE model, on one rank or many.
 *
 *   ./train                                   tiny model on the embedded corpus
 *   ./train --preset debug --data shard.bin   another preset, your tokens
 *   ./train --preset debug                    one rank per visible GPU (no torchrun needed)
 *   ./train --device cpu --nproc 4 --ep 2     four CPU thread-ranks
 *   ./train --graph step.mtg                  run a precompiled step graph
 *   ./train --steps 200 --save ck             ... then resume: ./train --steps 400 --load ck --save ck
 *   ./train --load ckpt --forward tok.i32 --logits-out out.f32   forward only
 *
 * Launchers: started by torchrun (RANK, WORLD_SIZE, ...), by mpirun (Open MPI's
 * OMPI_COMM_WORLD_*) or by srun (Slurm's SLURM_PROCID, ...), this process is one
 * rank of that world (mt_launch_from_env says which variables win); rank 0
 * hands out NCCL's id over TCP. --launch-check tries a launch line: every rank
 * meets the others and says where its rank came from, and nothing trains.
 * Run ./train --help for every option. Exit status: 0 done, 1 runtime error
 * (files, data, a diverged run, a failed rank), 2 usage error (options, config mismatch).
 */
#define MOETRAIN_IMPLEMENTATION
#include "moetrain.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>

typedef struct {
    const char *preset, *graph, *data, *data_format, *metrics, *svg, *save, *load, *forward, *logits_out, *device, *ep_exchange, *moments,
        *fp8_wgrad;
    int steps, log_every, threads, eager, seed, gpu, profile, save_every, nan_check, adopt_config, overlap, no_overlap, no_fold_rope, no_fuse_glu,
        attn_recompute_dq, one_launch_per_node, overwrite, fp8;
    int data_fmt;                                /* --data-format as MT_DATA_AUTO, _BIN or _RAW */
    int exchange;                                /* --ep-exchange as MT_EXCHANGE_AUTO, _HOST or _DEVICE */
    int moments_dt;                              /* --moments as MT_F32 or MT_BF16 (an artifact's or a resumed checkpoint's) */
    int fp8_mode;                                /* --fp8 [--fp8-wgrad]: MT_FP8_OFF, _ALL or _NO_WGRAD (an artifact's) */
    int moe_chunks;                              /* --moe-chunks: each MoE layer's routed experts over this many chunks of tokens */
    int nproc, dp_replicate, dp_shard, tp, ep;   /* ranks; 0 = derive */
    int launch_check;                            /* meet at the rendezvous, say where the rank came from, stop */
    float timeout;                           /* seconds without progress before a rank gives up */
    float roof_tflops, roof_gbps;
    float memory_budget;                     /* GiB; 0: no activation recompute */
    mt_hparams hp;
    int n_overrides;
    const char *ov_key[128], *ov_val[128];
    unsigned char given[64];      /* given[i]: option i of the table was on the command line */
    const char *config_from;      /* what the model config is, for the summary: a preset, an artifact, a checkpoint's */
} opts;

/* ---- the options: one table drives parsing, range checks and --help ---- */

enum { OPT_FLAG, OPT_INT, OPT_FLOAT, OPT_STR };
typedef struct {
    const char *name;    /* without the leading "--" */
    int kind;
    size_t off;          /* where the value goes in opts */
    double lo, hi;       /* numeric range; lo_open/hi_open exclude the ends */
    int lo_open, hi_open;
    const char *def;     /* the default, as --help shows it */
    const char *help;
    const char *meta;    /* what the value is, for --help (strings) */
} opt_spec;

/* ", MoE in N chunks of tokens" for the start-up line, or "" */
static const char *chunks_note(const mt_graph *g, char *buf, size_t n) {
    int c = mt_graph_moe_chunks(g);
    if (c > 1) snprintf(buf, n, ", MoE in %d chunks of tokens", c); else buf[0] = 0;
    return buf;
}

#define O_(f) offsetof(opts, f)
static const opt_spec specs[] = {
    {"preset", OPT_STR, O_(preset), 0, 0, 0, 0, "tiny", "model preset: tiny, debug, mid, 16b", "NAME"},
    {"graph", OPT_STR, O_(graph), 0, 0, 0, 0, "none", "run a precompiled step graph (it fixes the model config)", "FILE"},
    {"device", OPT_STR, O_(device), 0, 0, 0, 0, "cuda if built with it and a GPU is visible, else cpu", "cpu | cuda", "NAME"},
    {"gpu", OPT_INT, O_(gpu), 0, 1023, 0, 0, "0", "CUDA device ordinal of a one-rank run (ranks use LOCAL_RANK)", NULL},
    {"nproc", OPT_INT, O_(nproc), 1, 4096, 0, 0, "one per visible GPU; 1 on the CPU", "ranks to start (CPU ranks are threads)", NULL},
    {"dp-replicate", OPT_INT, O_(dp_replicate), 1, 4096, 0, 0, "1", "mesh: data-parallel replicas (HSDP)", NULL},
    {"dp-shard", OPT_INT, O_(dp_shard), 1, 4096, 0, 0, "ranks / (dp-replicate x tp)", "mesh: FSDP shards", NULL},
    {"tp", OPT_INT, O_(tp), 1, 4096, 0, 0, "1", "mesh: tensor-parallel ranks (heads, FFN hidden, vocab split; sequence-parallel norms)", NULL},
    {"ep", OPT_INT, O_(ep), 1, 4096, 0, 0, "1", "mesh: expert-parallel ranks (divides dp-shard x tp)", NULL},
    {"timeout", OPT_FLOAT, O_(timeout), 0, 1e6, 1, 0, "600", "a rank without progress for this many seconds stops every rank", NULL},
    {"launch-check", OPT_FLAG, O_(launch_check), 0, 0, 0, 0, "off", "a launcher's ranks meet at the rendezvous, each prints where its rank came from, and stop (no training)", NULL},
    {"data", OPT_STR, O_(data), 0, 0, 0, 0, "the embedded corpus", "raw bytes, or an llm.c/nanoGPT .bin token shard", "FILE"},
    {"data-format", OPT_STR, O_(data_format), 0, 0, 0, 0, "auto",
     "how --data is read: bin (a token shard), raw (bytes), auto (a shard by its exact header, else bytes; a near miss of a shard is refused)",
     "FORMAT"},
    {"steps", OPT_INT, O_(steps), 0, 1 << 30, 0, 0, "300", "total optimizer steps of the run (a resumed run counts the checkpoint's)", NULL},
    {"seed", OPT_INT, O_(seed), 0, 2147483647, 0, 0, "1", "initialization and data-order seed", NULL},
    {"lr", OPT_FLOAT, O_(hp.lr), 0, 10, 1, 0, "3e-3 up to dim 128, 8e-4 up to 512, 4.2e-4 beyond", "peak learning rate", NULL},
    {"warmup", OPT_INT, O_(hp.warmup_steps), 0, 1 << 30, 0, 0, "20", "linear warmup steps", NULL},
    {"decay-steps", OPT_INT, O_(hp.decay_steps), 0, 1 << 30, 0, 0, "--steps", "cosine decay ends at this step", NULL},
    {"min-lr-ratio", OPT_FLOAT, O_(hp.min_lr_ratio), 0, 1, 0, 0, "0.1", "final learning rate / peak", NULL},
    {"beta1", OPT_FLOAT, O_(hp.beta1), 0, 1, 0, 1, "0.9", "AdamW beta1", NULL},
    {"beta2", OPT_FLOAT, O_(hp.beta2), 0, 1, 0, 1, "0.95", "AdamW beta2", NULL},
    {"eps", OPT_FLOAT, O_(hp.eps), 0, 1, 1, 0, "1e-8", "AdamW epsilon", NULL},
    {"weight-decay", OPT_FLOAT, O_(hp.weight_decay), 0, 10, 0, 0, "0.1", "AdamW weight decay", NULL},
    {"grad-clip", OPT_FLOAT, O_(hp.grad_clip), 0, 1e6, 0, 0, "1.0", "clip the global gradient norm to this (0: off)", NULL},
    {"moments", OPT_STR, O_(moments), 0, 0, 0, 0, "fp32; a resumed run: the checkpoint's",
     "AdamW moments' dtype: fp32, or bf16 (half their bytes; the update in fp32, stored rounded to nearest even)", "DTYPE"},
    {"metrics", OPT_STR, O_(metrics), 0, 0, 0, 0, "none", "JSON lines: step, loss (the next-token loss), mtp_loss (with --mtp-layers), grad_norm, lr, tokens_per_s, step_ms, expert_load", "FILE"},
    {"svg", OPT_STR, O_(svg), 0, 0, 0, 0, "none", "write the loss curve at the end", "FILE"},
    {"save", OPT_STR, O_(save), 0, 0, 0, 0, "none", "checkpoint directory: model.safetensors (Hugging Face names), config.json, optimizer", "DIR"},
    {"overwrite", OPT_FLAG, O_(overwrite), 0, 0, 0, 0, "off", "let --save replace a checkpoint of another run (without it only --load's own DIR is replaced)", NULL},
    {"save-every", OPT_INT, O_(save_every), 0, 1 << 30, 0, 0, "0 (only at the end)", "also checkpoint every N steps", NULL},
    {"load", OPT_STR, O_(load), 0, 0, 0, 0, "none", "resume from a checkpoint: weights, AdamW state, step, data position, settings", "DIR"},
    {"adopt-config", OPT_FLAG, O_(adopt_config), 0, 0, 0, 0, "off", "with --load: take the checkpoint's model config where it differs", NULL},
    {"forward", OPT_STR, O_(forward), 0, 0, 0, 0, "none", "forward only: FILE holds batch*(seq_len+1) int32 tokens, or several such batches (a held-out set); prints the loss (the batches' mean)", "FILE"},
    {"logits-out", OPT_STR, O_(logits_out), 0, 0, 0, 0, "none", "with --forward: write float32 logits [batch*seq_len, vocab]", "FILE"},
    {"eager", OPT_FLAG, O_(eager), 0, 0, 0, 0, "off", "no optimizing passes (the baseline)", NULL},
    {"fp8", OPT_FLAG, O_(fp8), 0, 0, 0, 0, "off", "the linear layers' GEMMs in FP8, DeepSeek-V3's block scaling (docs/FP8.md; on the CPU emulated)", NULL},
    {"fp8-wgrad", OPT_STR, O_(fp8_wgrad), 0, 0, 0, 0, "fp8", "with --fp8: the weight gradients' GEMMs in fp8 (DeepSeek-V3's recipe), or bf16 (1.2% slower on mid, H200: docs/FP8.md)", "DTYPE"},
    {"overlap", OPT_FLAG, O_(overlap), 0, 0, 0, 0, "on with several ranks", "collectives on their own CUDA streams: FSDP prefetch, EP ahead of its host sync", NULL},
    {"ep-exchange", OPT_STR, O_(ep_exchange), 0, 0, 0, 0, "auto", "CUDA, ep > 1: auto (device-side where every ep peer is load/store accessible, "
     "else host-synchronized NCCL), device (or refuse), host (bitwise the same steps)", "MODE"},
    {"no-overlap", OPT_FLAG, O_(no_overlap), 0, 0, 0, 0, "off", "every node on the compute stream, in list order (bitwise the same steps)", NULL},
    {"no-fold-rope", OPT_FLAG, O_(no_fold_rope), 0, 0, 0, 0, "off", "CUDA: form MLA's Q, K, V apart instead of folding RoPE into attention (same results; for comparison)", NULL},
    {"no-fuse-glu", OPT_FLAG, O_(no_fuse_glu), 0, 0, 0, 0, "off", "run the experts' gate and up GEMMs and their SwiGLU as three ops (same results; for comparison)", NULL},
    {"attn-recompute-dq", OPT_FLAG, O_(attn_recompute_dq), 0, 0, 0, 0, "off", "CUDA: the attention backward recomputes S and dP for dQ instead of storing dS (B*H*T^2 bytes less workspace; slower)", NULL},
    {"one-launch-per-node", OPT_FLAG, O_(one_launch_per_node), 0, 0, 0, 0, "off", "CUDA: launch the gradient norm's and AdamW's nodes one by one instead of as multi-tensor launches (same results; for comparison)", NULL},
    {"moe-chunks", OPT_INT, O_(moe_chunks), 1, MT_MOE_CHUNKS_MAX, 0, 0, "1; an artifact: its own; a resumed run: the checkpoint's", "each MoE layer's routed experts in N chunks "
     "of its tokens: with overlap one chunk's expert exchange travels while another's experts compute (results within rounding)", "N"},
    {"memory-budget", OPT_FLOAT, O_(memory_budget), 0, 1 << 20, 0, 0, "0: off", "recompute the fewest blocks' activations so the planned peak (persistent + arena) fits (compiling here; an artifact has its own)", "GiB"},
    {"nan-check", OPT_FLAG, O_(nan_check), 0, 0, 0, 0, "off", "check every op's output for NaN/Inf and name the first (slower)", NULL},
    {"threads", OPT_INT, O_(threads), 1, 64, 0, 0, "all cores", "CPU threads (results do not depend on it)", NULL},
    {"log-every", OPT_INT, O_(log_every), 1, 1 << 30, 0, 0, "1", "print every N steps", NULL},
    {"profile", OPT_FLAG, O_(profile), 0, 0, 0, 0, "off", "after training, time one more step op by op against the roofline", NULL},
    {"roof-tflops", OPT_FLOAT, O_(roof_tflops), 0, 1e6, 1, 0, "790", "roofline compute ceiling for --profile", NULL},
    {"roof-gbps", OPT_FLOAT, O_(roof_gbps), 0, 1e8, 1, 0, "3000", "roofline bandwidth ceiling for --profile", NULL},
    {"help", OPT_FLAG, 0, 0, 0, 0, 0, "", "this text", NULL},
};
#undef O_
#define N_SPECS ((int)(sizeof specs / sizeof specs[0]))

static int spec_index(const char *name) {
    for (int i = 0; i < N_SPECS; i++) if (!strcmp(specs[i].name, name)) return i;
    return -1;
}
static int given(const opts *o, const char *name) { int i = spec_index(name); return i >= 0 && o->given[i]; }

static void usage(FILE *f) {
    fprintf(f, "usage: train [options] [--<config field> VALUE ...]\n\noptions (default in brackets):\n");
    for (int i = 0; i < N_SPECS; i++) {
        const opt_spec *s = &specs[i];
        char lhs[40];
        snprintf(lhs, sizeof lhs, "--%s%s%s", s->name, s->kind == OPT_FLAG ? "" : " ",
                 s->kind == OPT_FLAG ? "" : s->meta ? s->meta : s->kind == OPT_INT ? "N" : "X");
        fprintf(f, "  %-20s %s", lhs, s->help);
        if (s->kind == OPT_INT || s->kind == OPT_FLOAT)
            fprintf(f, ", %s%.10g..%.10g%s", s->lo_open ? "(" : "[", s->lo, s->hi, s->hi_open ? ")" : "]");
        if (s->def[0]) fprintf(f, " [%s]", s->def);
        fprintf(f, "\n");
    }
    mt_config c;
    mt_err e;
    mt_config_preset(&c, "tiny", &e);
    fprintf(f, "\nconfig fields (any of them, as --name VALUE; the default is the preset's, shown for tiny; checked by the config's rules):\n");
    for (int i = 0; i < mt_n_config_fields; i++) {
        const mt_field *fl = &mt_config_fields[i];
        char lhs[40], dash[32], def[32];
        snprintf(dash, sizeof dash, "%s", fl->name);
        for (char *q = dash; *q; q++) if (*q == '_') *q = '-';
        snprintf(lhs, sizeof lhs, "--%s %s", dash, !strcmp(fl->name, "score_func") ? "NAME" : fl->type == MT_FIELD_INT ? "N" : "X");
        const void *p = (const char *)&c + fl->offset;
        if (!strcmp(fl->name, "score_func")) snprintf(def, sizeof def, "%s", c.score_func == MT_SCORE_SIGMOID ? "sigmoid" : "softmax");
        else if (fl->type == MT_FIELD_INT) snprintf(def, sizeof def, "%d", *(const int *)p);
        else snprintf(def, sizeof def, "%g", (double)*(const float *)p);
        fprintf(f, "  %-24s %s [%s]\n", lhs, fl->help, def);
    }
    fprintf(f, "\nexit status: 0 done, 1 runtime error (files, data, a diverged run), 2 usage error\n");
}

/* Unknown --name: say so, with the closest known option (or config field). */
static void unknown_option(const char *name) {
    const char *names[N_SPECS];
    char near[64];
    for (int i = 0; i < N_SPECS; i++) names[i] = specs[i].name;
    if (mt_suggest_option(name, names, N_SPECS, near, sizeof near))
        fprintf(stderr, "train: unknown option '--%s' (did you mean '--%s'?); see --help\n", name, near);
    else fprintf(stderr, "train: unknown option '--%s'; see --help\n", name);
}


/* Parse one value of spec s into o, range-checked. */
static int set_option(opts *o, const opt_spec *s, const char *v) {
    void *dst = (char *)o + s->off;
    if (s->kind == OPT_STR) {
        if (!*v) { fprintf(stderr, "train: --%s needs a non-empty value\n", s->name); return -1; }
        *(const char **)dst = v;
        return 0;
    }
    char *end;
    double x = s->kind == OPT_INT ? (double)strtoll(v, &end, 10) : strtod(v, &end);
    int ok = *v && !*end && x == x && (s->lo_open ? x > s->lo : x >= s->lo) && (s->hi_open ? x < s->hi : x <= s->hi);
    if (!ok) {
        fprintf(stderr, "train: --%s takes %s in %s%.10g..%.10g%s, not '%s'\n", s->name, s->kind == OPT_INT ? "an integer" : "a number",
                s->lo_open ? "(" : "[", s->lo, s->hi, s->hi_open ? ")" : "]", v);
        return -1;
    }
    if (s->kind == OPT_INT) *(int *)dst = (int)x;
    else *(float *)dst = (float)x;
    return 0;
}

static int parse_args(int argc, char **argv, opts *o) {
    memset(o, 0, sizeof *o);
    o->preset = "tiny";
    o->steps = 300; o->log_every = 1; o->seed = 1;
    o->roof_tflops = 790; o->roof_gbps = 3000; o->timeout = 600;
    mt_hparams_default(&o->hp);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h")) { usage(stdout); exit(0); }
        if (strncmp(a, "--", 2) || !a[2]) { fprintf(stderr, "train: unexpected argument '%s' (options start with --; see --help)\n", a); return -1; }
        char name[64];
        const char *eq = strchr(a + 2, '='), *v = NULL;
        size_t len = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        if (len >= sizeof name) len = sizeof name - 1;
        memcpy(name, a + 2, len);
        name[len] = 0;
        int k = spec_index(name), field = k < 0 && mt_config_has_field(name);
        if (k < 0 && !field) { unknown_option(name); return -1; }
        if (k >= 0 && specs[k].kind == OPT_FLAG) {
            if (eq) { fprintf(stderr, "train: --%s takes no value\n", name); return -1; }
            if (!strcmp(name, "help")) { usage(stdout); exit(0); }
            *(int *)((char *)o + specs[k].off) = 1;
            o->given[k] = 1;
            continue;
        }
        if (eq) v = eq + 1;
        else if (i + 1 < argc) v = argv[++i];
        else { fprintf(stderr, "train: --%s needs a value\n", name); return -1; }
        if (field) {
            if (o->n_overrides >= 128) { fprintf(stderr, "train: too many config options\n"); return -1; }
            o->ov_key[o->n_overrides] = a + 2; o->ov_val[o->n_overrides++] = v;
            if (eq) { fprintf(stderr, "train: write config fields as --%s VALUE\n", name); return -1; }
            continue;
        }
        if (set_option(o, &specs[k], v)) return -1;
        o->given[k] = 1;
    }
    if (!given(o, "decay-steps")) o->hp.decay_steps = o->steps;
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
    if (o->save_every && !o->save) { fprintf(stderr, "train: --save-every needs --save DIR\n"); return -1; }
    if (o->adopt_config && !o->load) { fprintf(stderr, "train: --adopt-config needs --load DIR\n"); return -1; }
    if (o->overwrite && !o->save) { fprintf(stderr, "train: --overwrite needs --save DIR\n"); return -1; }
    if (o->ep_exchange) {
        if (!strcmp(o->ep_exchange, "auto")) o->exchange = MT_EXCHANGE_AUTO;
        else if (!strcmp(o->ep_exchange, "host")) o->exchange = MT_EXCHANGE_HOST;
        else if (!strcmp(o->ep_exchange, "device")) o->exchange = MT_EXCHANGE_DEVICE;
        else { fprintf(stderr, "train: --ep-exchange takes auto, device or host, not '%s'\n", o->ep_exchange); return -1; }
    }
    if (o->data_format && mt_data_format_parse(o->data_format, &o->data_fmt)) {
        fprintf(stderr, "train: --data-format takes auto, bin or raw, not '%s'\n", o->data_format);
        return -1;
    }
    if (o->data_format && !o->data && !o->load) { fprintf(stderr, "train: --data-format needs --data FILE\n"); return -1; }
    if (o->moments && strcmp(o->moments, "fp32") && strcmp(o->moments, "bf16")) {
        fprintf(stderr, "train: --moments takes fp32 or bf16, not '%s'\n", o->moments);
        return -1;
    }
    o->moments_dt = o->moments && !strcmp(o->moments, "bf16") ? MT_BF16 : MT_F32;
    if (o->fp8_wgrad && ((strcmp(o->fp8_wgrad, "fp8") && strcmp(o->fp8_wgrad, "bf16")) || !o->fp8)) {
        fprintf(stderr, "train: --fp8-wgrad takes fp8 or bf16, with --fp8 (not '%s'%s)\n", o->fp8_wgrad, o->fp8 ? "" : " without --fp8");
        return -1;
    }
    o->fp8_mode = !o->fp8 ? MT_FP8_OFF : o->fp8_wgrad && !strcmp(o->fp8_wgrad, "bf16") ? MT_FP8_NO_WGRAD : MT_FP8_ALL;
    o->config_from = o->graph ? o->graph : o->preset;
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

/* ---- before any work: every output path can be written ---- */

/* Can path be created or appended to? An existing file is left as it was. */
static int probe_output(const char *flag, const char *path) {
    FILE *f = fopen(path, "rb");
    int existed = f != NULL;
    if (f) fclose(f);
    f = fopen(path, "ab");
    if (!f || fclose(f)) {
        fprintf(stderr, "train: %s '%s' cannot be written: %s\n", flag, path, strerror(errno));
        return -1;
    }
    if (!existed) remove(path);
    return 0;
}
/* Are a and b one directory? A path naming a checkpoint's model file stands for its directory. */
static int same_dir(const char *a, const char *b) {
    struct stat x, y;
    char p[4096];
    const char *q[2] = {a, b};
    struct stat *st[2] = {&x, &y};
    for (int i = 0; i < 2; i++) {
        if (stat(q[i], st[i])) return 0;
        if (S_ISREG(st[i]->st_mode)) {   /* DIR/model.safetensors: DIR */
            snprintf(p, sizeof p, "%s", q[i]);
            char *slash = strrchr(p, '/');
            if (slash) *slash = 0; else snprintf(p, sizeof p, ".");
            if (stat(p, st[i])) return 0;
        }
    }
    return x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}
/* --save DIR replaces the checkpoint in DIR only when it is this run's own: DIR is the --load directory, or --overwrite. */
static int check_save_dir(const opts *o) {
    char model[4200];
    struct stat st;
    snprintf(model, sizeof model, "%s/model.safetensors", o->save);
    if (o->overwrite || stat(model, &st) || (o->load && same_dir(o->save, o->load))) return 0;
    mt_run_state r;
    mt_err e;
    char what[64] = "";
    if (!mt_checkpoint_read_run(o->save, &r, &e)) snprintf(what, sizeof what, " (step %d)", r.step);
    fprintf(stderr, "train: --save '%s' holds the checkpoint of another run%s: not replacing it; pass --load %s to continue it, "
                    "--overwrite to replace it, or another --save directory\n", o->save, what, o->save);
    return -1;
}
static int preflight(const opts *o) {
    mt_err e;
    if (o->save && check_save_dir(o)) return -1;
    if (o->save && mt_checkpoint_prepare_dir(o->save, &e)) { fprintf(stderr, "train: --save: %s\n", e.msg); return -1; }
    if (o->metrics && probe_output("--metrics", o->metrics)) return -1;
    if (o->svg && probe_output("--svg", o->svg)) return -1;
    if (o->logits_out && probe_output("--logits-out", o->logits_out)) return -1;
    return 0;
}

/* ---- the model config, and resuming ---- */

/* Is config field `name` among the --<field> options? */
static int override_given(const opts *o, const char *name) {
    for (int i = 0; i < o->n_overrides; i++) {
        const char *a = o->ov_key[i], *b = name;
        while (*a && (*a == *b || (*a == '-' && *b == '_'))) { a++; b++; }
        if (!*a && !*b) return 1;
    }
    return 0;
}

/* With --load: the model the checkpoint holds must be the one asked for (a
 * preset and --<field> options, or an artifact), or --adopt-config takes it.
 * Without --preset the checkpoint's config is the start, the --<field>
 * options on top. batch and seq_len shape the step, not the weights: they may
 * differ (reported when training). Returns an exit status (0: go on). */
static int checkpoint_config(opts *o, mt_config *cfg, int fixed_by_graph) {
    mt_err e;
    mt_config ck;
    if (mt_checkpoint_read_config(o->load, &ck, &e)) { fprintf(stderr, "train: %s\n", e.msg); return 1; }
    if (!fixed_by_graph && !given(o, "preset")) {
        *cfg = ck;
        if (apply_overrides(o, cfg)) return 2;
        o->config_from = "checkpoint";
    }
    if (mt_config_validate(cfg, &e)) { fprintf(stderr, "train: %s\n", e.msg); return 2; }
    mt_config model = ck;
    model.batch = cfg->batch; model.seq_len = cfg->seq_len; model.mtp_weight = cfg->mtp_weight;   /* the MTP loss's weight may change (0.3 -> 0.1) */
    char diff[900];
    if (mt_config_diff(&model, cfg, diff, sizeof diff)) {
        if (fixed_by_graph) {
            fprintf(stderr, "train: the checkpoint '%s' holds another model than the artifact '%s' (checkpoint vs artifact): %s\n",
                    o->load, o->graph, diff);
            return 2;
        }
        if (!o->adopt_config) {
            fprintf(stderr, "train: the checkpoint '%s' holds another model than the one asked for (checkpoint vs asked): %s\n"
                            "  ask for the checkpoint's, or pass --adopt-config to continue with it\n", o->load, diff);
            return 2;
        }
        printf("adopted the checkpoint's model config (--adopt-config); it differs from the one asked for in (checkpoint vs asked): %s\n", diff);
        int B = cfg->batch, T = cfg->seq_len;
        float W = cfg->mtp_weight;
        *cfg = ck;
        if (override_given(o, "batch")) cfg->batch = B;
        if (override_given(o, "seq_len")) cfg->seq_len = T;
        if (override_given(o, "mtp_weight")) cfg->mtp_weight = W;
        o->config_from = "checkpoint";
    }
    if (!o->forward && (cfg->batch != ck.batch || cfg->seq_len != ck.seq_len))
        printf("note: batch x seq_len %d x %d, the checkpoint's run used %d x %d: this is not its exact continuation\n", cfg->batch,
               cfg->seq_len, ck.batch, ck.seq_len);
    if (!o->forward && cfg->mtp_weight != ck.mtp_weight && cfg->mtp_layers > 0)
        printf("note: mtp_weight %g, the checkpoint's run used %g\n", (double)cfg->mtp_weight, (double)ck.mtp_weight);
    return 0;
}

/* A resumed run continues the saved run: each run setting not given on the
 * command line is the checkpoint's; one given differently is reported (the
 * continuation is then not the saved run's). --steps counts from step 0. */
static int plan_resume(opts *o, mt_run_state *ck) {
    mt_err e;
    if (mt_checkpoint_read_run(o->load, ck, &e)) { fprintf(stderr, "train: %s\n", e.msg); return 1; }
    if (!given(o, "moments") && !o->graph) o->moments_dt = ck->moments;   /* recorded with the moments (an artifact fixes them) */
    if (!given(o, "moe-chunks") && !o->graph) o->moe_chunks = ck->moe_chunks;   /* recorded with the weights (an artifact fixes them) */
    if (!ck->has_settings) {   /* saved without run settings (mt_checkpoint_save): this command line's */
        printf("resuming '%s' at step %d of %d; it records no run settings, so this command line's are used\n", o->load, ck->step, o->steps);
        return 0;
    }
    if (!strcmp(o->config_from, "checkpoint") && ck->preset[0]) o->config_from = ck->preset;
    char changed[1200] = "";
#define NOTE(...) snprintf(changed + strlen(changed), sizeof changed - strlen(changed), __VA_ARGS__)
    if (!given(o, "steps")) o->steps = ck->total_steps;
    if (!given(o, "seed") && ck->seed > 2147483647u) {
        fprintf(stderr, "train: the checkpoint's seed %llu is outside --seed's range: pass --seed\n", (unsigned long long)ck->seed);
        return 2;
    }
    if (!given(o, "seed")) o->seed = (int)ck->seed;
    else if ((uint64_t)o->seed != ck->seed) NOTE(" seed %llu -> %d;", (unsigned long long)ck->seed, o->seed);
    static const struct { const char *opt; size_t off; int is_int; } hp[] = {
        {"lr", offsetof(mt_hparams, lr), 0}, {"min-lr-ratio", offsetof(mt_hparams, min_lr_ratio), 0},
        {"warmup", offsetof(mt_hparams, warmup_steps), 1}, {"beta1", offsetof(mt_hparams, beta1), 0},
        {"beta2", offsetof(mt_hparams, beta2), 0}, {"eps", offsetof(mt_hparams, eps), 0},
        {"weight-decay", offsetof(mt_hparams, weight_decay), 0}, {"grad-clip", offsetof(mt_hparams, grad_clip), 0}};
    for (size_t i = 0; i < sizeof hp / sizeof hp[0]; i++) {
        void *mine = (char *)&o->hp + hp[i].off;
        const void *theirs = (const char *)&ck->hp + hp[i].off;
        if (!given(o, hp[i].opt)) { memcpy(mine, theirs, 4); continue; }
        if (memcmp(mine, theirs, 4)) {
            if (hp[i].is_int) NOTE(" %s %d -> %d;", hp[i].opt, *(const int *)theirs, *(int *)mine);
            else NOTE(" %s %g -> %g;", hp[i].opt, (double)*(const float *)theirs, (double)*(float *)mine);
        }
    }
    /* the cosine follows the run's length unless it was pinned (--decay-steps) */
    if (!given(o, "decay-steps")) o->hp.decay_steps = ck->hp.decay_steps != ck->total_steps ? ck->hp.decay_steps : o->steps;
    else if (o->hp.decay_steps != ck->hp.decay_steps) NOTE(" decay-steps %d -> %d;", ck->hp.decay_steps, o->hp.decay_steps);
    if (!given(o, "data")) o->data = ck->data[0] ? ck->data : NULL;
    if (o->eager != ck->eager) NOTE(" %s -> %s (on CUDA the two round differently);", ck->eager ? "eager" : "compiled", o->eager ? "eager" : "compiled");
    if (o->fp8_mode != ck->fp8) NOTE(" GEMMs %s -> %s;", mt_fp8_mode_name(ck->fp8), mt_fp8_mode_name(o->fp8_mode));
    if (o->moments_dt != ck->moments)
        NOTE(" AdamW moments %s -> %s (the saved moments %s);", ck->moments == MT_BF16 ? "bf16" : "fp32", o->moments_dt == MT_BF16 ? "bf16" : "fp32",
             o->moments_dt == MT_BF16 ? "rounded to nearest even bf16 on loading" : "widened to fp32 exactly on loading");
    if (given(o, "moe-chunks") && o->moe_chunks != ck->moe_chunks)
        NOTE(" MoE chunks %d -> %d (the experts' weight gradients round differently);", ck->moe_chunks, o->moe_chunks);
#undef NOTE
    printf("resuming '%s' at step %d of %d (%s, seed %d, data %s)\n", o->load, ck->step, o->steps, o->config_from, o->seed,
           o->data ? o->data : "the embedded corpus");
    if (changed[0]) printf("  changed from the saved run, so this is not its exact continuation:%s\n", changed);
    return 0;
}

/* The data a resumed run reads must be the data the saved run read: the data
 * position (the step) means nothing in another token stream. */
static int check_resume_data(const opts *o, const mt_run_state *ck, const mt_dataset *ds, uint64_t hash) {
    if (!ck->has_settings || (ds->n == ck->data_tokens && hash == ck->data_hash)) return 0;
    if (given(o, "data")) {
        printf("  note: --data '%s' is not the data the checkpoint was trained on: the data order restarts from position %d of it\n",
               o->data, ck->step);
        return 0;
    }
    fprintf(stderr, "train: the data '%s' has changed since the checkpoint was saved (%lld tokens then, %lld now): the data position "
                    "would point elsewhere; pass --data FILE to train on it anyway\n",
            o->data ? o->data : "embedded corpus", (long long)ck->data_tokens, (long long)ds->n);
    return 1;
}

static void run_state_now(mt_run_state *r, const opts *o, const mt_dataset *ds, uint64_t hash, int step) {
    mt_run_state_init(r);
    r->step = step; r->total_steps = o->steps; r->seed = (uint64_t)o->seed; r->hp = o->hp; r->eager = o->eager;
    snprintf(r->preset, sizeof r->preset, "%s", o->graph ? "" : o->config_from);
    if (o->data && strlen(o->data) < sizeof r->data) snprintf(r->data, sizeof r->data, "%s", o->data);
    r->data_tokens = ds->n; r->data_hash = hash;
}

/* Every rank calls this together: a sharded run's checkpoint is assembled from every rank's part. */
static int save_checkpoint(mt_runtime *rt, const opts *o, const mt_dataset *ds, uint64_t hash, int step, int rank, int world) {
    mt_err err;
    mt_run_state r;
    run_state_now(&r, o, ds, hash, step);
    if (mt_checkpoint_save_run(rt, o->save, &r, &err)) {
        char who[32] = "";
        if (world > 1) snprintf(who, sizeof who, " (rank %d)", rank);
        fprintf(stderr, "train: saving the checkpoint at step %d failed%s: %s (the previous checkpoint in '%s', if any, is intact)\n", step,
                who, err.msg, o->save);
        return -1;
    }
    if (rank == 0)
        printf("saved step %d to %s/ (model.safetensors, config.json, optimizer%s)\n", step, o->save,
               world > 1 ? "; every rank's shards, whole: any mesh can load it" : "");
    return 0;
}

/* Where a stopped run leaves its work. */
static void stop_note(const opts *o, int last_saved, const char *last_dir) {
    if (last_saved >= 0) fprintf(stderr, "  the last good checkpoint, step %d in '%s', is intact: nothing was saved after it failed\n", last_saved, last_dir);
    else if (o->save) fprintf(stderr, "  nothing was saved to '%s'\n", o->save);
}
/* A NaN or Inf loss or gradient norm stops the run: say where, and what is left. Then find the first op
 * that produced it: steps are deterministic, so replaying from the last good state (the checkpoint, or the
 * initialization) with every op's output checked meets the same value at the same op. */
static void report_nonfinite(mt_runtime *rt, const opts *o, const mt_dataset *ds, const mt_step_stats *st, int step, int last_saved,
                             const char *last_dir) {
    fprintf(stderr, "train: step %d: the %s is %g (loss %g, grad norm %g): training diverged, stopping\n", step + 1,
            isfinite(st->loss) ? "gradient norm" : "loss", isfinite(st->loss) ? st->grad_norm : st->loss, st->loss, st->grad_norm);
    stop_note(o, last_saved, last_dir);
    int from = last_saved >= 0 ? last_saved : 0;
    mt_err e;
    if (step - from >= 1000) {
        fprintf(stderr, "  re-run from that checkpoint with --nan-check to find the first op that produced it\n");
        return;
    }
    if (last_saved >= 0 ? mt_checkpoint_load(rt, last_dir, NULL, &e) : mt_runtime_init_params(rt, (uint64_t)o->seed, &e)) {
        fprintf(stderr, "  (cannot replay to find the op: %s)\n", e.msg);
        return;
    }
    fprintf(stderr, "  finding the op: replaying steps %d..%d from %s, checking every output\n", from + 1, step + 1,
            last_saved >= 0 ? "that checkpoint" : "the initialization");
    const mt_config *c = &mt_runtime_graph(rt)->cfg;
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)c->batch * c->seq_len);
    int32_t *tgt = (int32_t *)malloc(sizeof(int32_t) * (size_t)c->batch * c->seq_len);
    mt_runtime_set_nan_check(rt, 1);
    int found = 0;
    for (int s = from; s <= step && !found; s++)
        if (mt_data_batch_at(ds, (uint64_t)o->seed, s, 0, 1, c->batch, c->seq_len, tok, tgt, &e) ||
            mt_runtime_step(rt, tok, tgt, s, &o->hp, NULL, &e)) {
            fprintf(stderr, "  %s\n", e.msg);
            found = 1;
        }
    if (!found) fprintf(stderr, "  the replay did not meet it again\n");
    fprintf(stderr, "  try a smaller --lr, or --grad-clip\n");
    free(tok); free(tgt);
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
    double cm[4];
    if (mt_runtime_profile_comm(rt, cm) && cm[0] > 0)
        printf("communication: %.3f ms a step on its streams, %.3f ms exposed (the compute stream waited: %.1f%% of the %.3f ms "
               "profiled step); compute %.3f ms\n", cm[2], cm[3], 100 * cm[3] / cm[0], cm[0], cm[1]);
    int32_t wn[5];
    double wms[5];
    int nw = mt_runtime_profile_waits(rt, 5, wn, wms);
    for (int k = 0; k < nw; k++) {   /* where the exposed time went */
        const mt_node *n = &G->nodes[wn[k]];
        printf("%s %s '%s' (layer %d) %.3f ms%s", k ? ";" : "  waited longest for:", mt_ops[n->op].name,
               n->out[0] >= 0 ? G->values[n->out[0]].name : "", n->layer, wms[k], k == nw - 1 ? "\n" : "");
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
    if (o->no_fold_rope) passes.fold_rope = 0;
    if (o->no_fuse_glu) passes.fuse_glu = 0;
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
    size_t want = (size_t)B * (size_t)(T + 1) * 4, nb = len / want;   /* one batch, or several (a held-out set) */
    if (!nb || len % want || (o->logits_out && nb != 1)) {
        fprintf(stderr, "train: '%s' has %zu bytes; --batch %d --seq-len %d needs a multiple of %zu (int32 [batch, seq_len+1]%s)\n",
                o->forward, len, B, T, want, o->logits_out ? ", one batch with --logits-out" : "");
        free(bytes); mt_runtime_destroy(rt);
        return 1;
    }
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * T), *tgt_ = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * T);
    mt_step_stats st;
    int rc = 0;
    double sum = 0;
    for (size_t k = 0; k < nb && !rc; k++) {
        const uint8_t *at = bytes + k * want;
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) {
                memcpy(&tok[b * T + t], at + 4 * ((size_t)b * (T + 1) + t), 4);
                memcpy(&tgt_[b * T + t], at + 4 * ((size_t)b * (T + 1) + t + 1), 4);
            }
        if (mt_runtime_step(rt, tok, tgt_, 0, NULL, &st, &err)) { fprintf(stderr, "train: batch %zu: %s\n", k, err.msg); rc = 1; }
        sum += st.loss;
        if (!rc && nb > 1) printf("batch %zu loss %.9g\n", k, st.loss);
    }
    free(bytes);
    if (!rc) {
        if (nb > 1) printf("loss %.9g (mean of %zu batches)\n", sum / (double)nb, nb);
        else printf("loss %.9g\n", st.loss);
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
    uint64_t data_hash;        /* of ds: checkpoints record it */
    int world, local_rank;     /* process ranks: this rank's local rank */
    mt_rdv *rdv;               /* process ranks: the rendezvous (NULL for threads and one rank) */
    uint8_t nccl_id[MT_NCCL_ID_BYTES];
    double t_launch;           /* when this process started */
    mt_runtime **rts;          /* per rank of this process (thread-ranks: all of them); freed after they end */
    /* the watchdog's view of this process's rank */
    volatile double last_progress;
    volatile int finished, stop;
    int rank;
    int reported;              /* the failure was already explained on stderr */
    int last_saved;            /* the last good checkpoint: its step (-1: none) and directory */
    const char *last_dir;
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
    bind.nan_check = o->nan_check;
    bind.attn_recompute_dq = o->attn_recompute_dq;
    bind.one_launch_per_node = o->one_launch_per_node;
    bind.ep_exchange = o->exchange;
    bind.timeout_s = o->timeout;
    if (w && !o->threads) {   /* thread-ranks share the cores */
        int cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
        bind.n_threads = cores / world > 1 ? cores / world : 1;
    }
    mt_runtime *rt;
    double t_bind = mt_now();
    if (mt_runtime_create(&rt, G, &bind, err)) return -1;
    double t_bound = mt_now();
    j->rts[w ? rank : 0] = rt;   /* a failed rank's buffers stay until every rank has stopped reading them */
    int step0 = 0;   /* a resumed run starts at the checkpoint's step; --steps counts from step 0 */
    if (mt_runtime_init_params(rt, (uint64_t)o->seed, err) || (o->load && mt_checkpoint_load(rt, o->load, &step0, err)))
        return -1;
    double t_init = mt_now();
    int todo = o->steps > step0 ? o->steps - step0 : 0, last_saved = o->load ? step0 : -1;
    const char *last_dir = o->load;
    j->last_saved = last_saved; j->last_dir = last_dir;
    if (lead && o->load && !todo) printf("nothing to train: the checkpoint is at step %d and --steps is %d\n", step0, o->steps);
    int B = cfg->batch, T = cfg->seq_len, E = cfg->n_routed_experts > 0 ? cfg->n_routed_experts : 1;
    int dp = world / G->mesh.size[MT_DIM_TP], dp_rank = rank / G->mesh.size[MT_DIM_TP];
    int on_gpu = mt_runtime_backend(rt) == MT_BACKEND_CUDA;
    double flops_tok = mt_flops_per_token(cfg), tokens_global = (double)B * T * dp;
    if (lead) {
        mt_param_count pc;
        mt_count_params(cfg, &pc);
        char h1[32], h2[32], h3[32], mn[64], dd[1200];
        printf("model: %lld parameters (%lld active per token), %d layers, %d experts top-%d | data: %s\n",
               (long long)pc.total, (long long)(pc.dense + pc.sparse_active), cfg->n_layers, cfg->n_routed_experts, cfg->top_k,
               mt_data_describe(j->ds, o->data ? o->data : "", dd, sizeof dd));
        printf("memory per rank: %s persistent + %s arena (naive %s) | %s | %s | uniform loss ln(%d) = %.4f\n",
               mt__human((double)G->persist_bytes, h1), mt__human((double)G->arena_bytes, h2),
               mt__human((double)G->naive_arena_bytes, h3), G->planned ? "planned" : "eager",
               on_gpu ? "CUDA bf16" : "CPU fp32", cfg->vocab_size, log((double)cfg->vocab_size));
        if (on_gpu && mt_runtime_fp8_shared(rt))
            printf("fp8 operands: %d quantized once for several GEMMs (%d activations in both forms from one read, %d of them "
                   "written by their SwiGLU, %d by the MoE permutation or the combine's backward; %d weights by AdamW)\n",
                   mt_runtime_fp8_shared(rt), mt_runtime_fp8_both(rt), mt_runtime_fp8_by_swiglu(rt), mt_runtime_fp8_by_moe(rt),
                   mt_runtime_fp8_by_optimizer(rt));
        if (world > 1) {
            printf("ranks: %d (%s) | mesh", world, w ? "CPU threads" : on_gpu ? "one process per GPU, NCCL" : "processes");
            for (int d = 0; d < MT_NDIMS; d++) printf(" %s=%d", mt_dim_names[d], G->mesh.size[d]);
            mt_mesh_mask_name(MT_DIMBIT(MT_DIM_DP_SHARD), mn, sizeof mn);
            int tp = G->mesh.size[MT_DIM_TP];
            if (tp > 1) printf(" | global batch %d x %d (%d per data-parallel rank, %d tokens per tp rank)\n", B * dp, T, B, B * T / tp);
            else printf(" | global batch %d x %d (%d per rank)\n", B * dp, T, B);
            if (on_gpu) {
                int syncs = 0;
                for (int i = 0; i < G->n_nodes; i++) syncs += G->nodes[i].op == MT_OP_EP_COUNTS && mt_node_syncs_host(&G->nodes[i]);
                const char *ex = mt_runtime_exchange(rt);
                if (ex[0]) printf("expert exchange: %s | ", ex);
                if (mt_runtime_whole_step_graph(rt)) printf("graph: the step is one CUDA graph (captured at step 2), 0 host syncs\n");
                else printf("graph: %d host syncs a step, eager between captured regions\n", ex[0] && strncmp(ex, "device", 6) ? syncs : 0);
            }
        }
    }
    FILE *mf = NULL;
    if (lead && o->metrics && !(mf = fopen(o->metrics, "w"))) {
        return mt_errf(err, "cannot write '%s'", o->metrics);
    }
    int32_t *tok = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * T), *tgt = (int32_t *)malloc(sizeof(int32_t) * (size_t)B * T);
    int32_t *counts = (int32_t *)malloc(sizeof(int32_t) * (size_t)E);
    double *curve = (double *)malloc(sizeof(double) * (size_t)(todo + 1));
    double *times = (double *)malloc(sizeof(double) * (size_t)(todo + 1));
    int rc = 0, per_rank = world <= 31;
    double t_start = mt_now(), first_loss = 0, last_loss = 0, peak_max = 0;
    for (int s = 0; s < todo && !rc; s++) {
        int step = step0 + s;
        mt_step_stats st;
        j->last_progress = mt_now();
        if (mt_data_batch_at(j->ds, (uint64_t)o->seed, step, dp_rank, dp, B, T, tok, tgt, err) ||
            mt_runtime_step(rt, tok, tgt, step, &o->hp, &st, err)) {
            rc = -1;
            break;
        }
        if (s == 0) {   /* time to first step; on GPUs, whether every rank runs the same kernels */
            double d[4] = {0, 0, 0, 0};
            int preset = 0, derived = 0;
            uint64_t dg = mt_runtime_kernel_digest(rt, &preset, &derived);
            d[0] = (double)(dg >> 32); d[1] = (double)(dg & 0xffffffffu); d[2] = -d[0]; d[3] = -d[1];
            if (world > 1 && on_gpu && mt_runtime_allreduce_host(rt, d, 4, 1, err)) { rc = -1; break; }
            if (lead) {
                printf("first step done %.2f s after launch (graph ready at %.2f s; bind %.2f s, weights %.2f s, step %.2f s)",
                       mt_now() - j->t_launch, t_bind - j->t_launch, t_bound - t_bind, t_init - t_bound, mt_now() - t_init);
                if (on_gpu)
                    printf(" | GEMM kernels: %d from the graph's tuning, %d chosen here%s", preset, derived,
                           world == 1 ? "" : d[0] == -d[2] && d[1] == -d[3] ? ", identical on every rank" : ", DIFFERENT across ranks");
                printf("\n");
                if (mt_runtime_tuning_note(rt)[0]) printf("note: %s\n", mt_runtime_tuning_note(rt));
            }
        }
        if (!isfinite(st.loss) || !isfinite(st.grad_norm)) {   /* global values: every rank stops here */
            if (world == 1) {
                report_nonfinite(rt, o, j->ds, &st, step, last_saved, last_dir);
                mt_errf(err, "training diverged at step %d", step + 1);
                j->reported = 1;
            } else {
                mt_errf(err, "step %d: the %s is %g: training diverged (re-run with --nan-check to find the first op; try a smaller --lr)",
                        step + 1, isfinite(st.loss) ? "gradient norm" : "loss", isfinite(st.loss) ? st.grad_norm : st.loss);
            }
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
        if (lead && ((s + 1) % o->log_every == 0 || s == 0 || s + 1 == todo)) {
            printf("step %5d | loss %.6f", step + 1, st.loss);
            if (cfg->mtp_layers > 0) printf(" | mtp %.6f", st.mtp_loss);
            printf(" | grad_norm %8.4f | lr %.3e | %8.0f tok/s", st.grad_norm, st.lr, tps);
            if (world > 1) printf(" (%.0f/rank)", tps / world);
            printf(" | %7.1f ms | load max/mean %.2f", 1e3 * secs, lb);
            if (on_gpu)
                printf(" | mfu %.1f%% | mem %.2f GiB", 100.0 * tps / world * flops_tok / 989e12, peak_max / 1073741824.0);
            if (mt_runtime_host_syncs(rt)) printf(" | %d host syncs", mt_runtime_host_syncs(rt));
            printf("\n");
        }
        if (mf) {
            fprintf(mf, "{\"step\":%d,\"loss\":%.9g,", step + 1, st.loss);
            if (cfg->mtp_layers > 0) fprintf(mf, "\"mtp_loss\":%.9g,", st.mtp_loss);
            fprintf(mf, "\"grad_norm\":%.9g,\"lr\":%.9g,\"tokens_per_s\":%.1f,\"step_ms\":%.3f,\"ranks\":%d,\"host_syncs\":%d,\"peak_bytes_max\":%.0f",
                    st.grad_norm, st.lr, tps, 1e3 * secs, world, mt_runtime_host_syncs(rt), peak_max);
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
        if (o->save_every && (step + 1) % o->save_every == 0 && s + 1 < todo) {
            if (save_checkpoint(rt, o, j->ds, j->data_hash, step + 1, rank, world)) {
                stop_note(o, last_saved, last_dir);
                mt_errf(err, "stopped: the checkpoint could not be saved");
                j->reported = 1;
                rc = -1;
                break;
            }
            last_saved = step + 1; last_dir = o->save;
        }
        j->last_saved = last_saved; j->last_dir = last_dir;
    }
    j->last_progress = mt_now();
    if (!rc && todo > 0 && lead) {
        printf("done: %d steps in %.1f s, loss %.4f -> %.4f\n", todo, mt_now() - t_start, first_loss, last_loss);
        int skip = todo > 4 ? 2 : 0, nt = todo - skip;   /* the median step after two warm-up steps */
        qsort(times + skip, (size_t)nt, sizeof(double), cmp_double);
        double med = times[skip + nt / 2], tps = tokens_global / med;
        printf("summary: preset=%s device=%s mode=%s ranks=%d tokens=%.0f median_step_ms=%.2f tokens_per_s=%.0f "
               "tokens_per_s_per_rank=%.0f mfu=%.2f%% peak_mem_gib=%.2f flops_per_token=%.0f host_syncs=%d\n",
               o->config_from, on_gpu ? "cuda" : "cpu", o->eager ? "eager" : "compiled", world, tokens_global,
               1e3 * med, tps, tps / world, on_gpu ? 100.0 * tps / world * flops_tok / 989e12 : 0.0, peak_max / 1073741824.0,
               flops_tok, mt_runtime_host_syncs(rt));
    }
    if (!rc && o->profile && todo > 0) {   /* every rank steps; rank 0 prints */
        mt_step_stats st;
        mt_runtime_set_profile(rt, 1);
        if (mt_data_batch_at(j->ds, (uint64_t)o->seed, step0 + todo, dp_rank, dp, B, T, tok, tgt, err) ||
            mt_runtime_step(rt, tok, tgt, step0 + todo, &o->hp, &st, err))
            rc = -1;
        else if (lead) {
            int skip = todo > 4 ? 2 : 0;
            print_profile(rt, o, 1e3 * times[skip + (todo - skip) / 2]);
        }
        mt_runtime_set_profile(rt, 0);
    }
    if (mf) fclose(mf);
    if (!rc && lead && o->svg && todo > 0) {
        char title[128];
        snprintf(title, sizeof title, "moetrain loss (%s, seed %d)", o->config_from, o->seed);
        if (mt_write_svg(o->svg, curve, todo, title, err)) rc = -1;
    }
    if (!rc && o->save && save_checkpoint(rt, o, j->ds, j->data_hash, step0 + todo, rank, world)) {
        mt_errf(err, "stopped: the checkpoint could not be saved");
        j->reported = 1;
        rc = -1;
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

/* The rendezvous; rank 0 of our own ranks serves it on the socket the launcher listens on (mt_rdv_listen). */
static int rdv_open(mt_rdv **r, const char *addr, int port, int rank, int world, uint8_t *blob, size_t len, double timeout, mt_err *err) {
    const char *lfd = rank == 0 && getenv("MOETRAIN_SUPERVISED") ? getenv("MOETRAIN_RDV_FD") : NULL;
    return lfd ? mt_rdv_open_on(r, atoi(lfd), port, world, blob, len, timeout, err) : mt_rdv_open(r, addr, port, rank, world, blob, len, timeout, err);
}

/* One rank of a multi-process world (a launcher set RANK, WORLD_SIZE, ...). */
static int process_rank(job_t *j, int rank, const char *addr, int port) {
    mt_err err;
    j->rank = rank;
    j->last_progress = mt_now();
#ifdef MT_CUDA
    if (rank == 0 && mt_nccl_unique_id(j->nccl_id, &err)) { fprintf(stderr, "train: rank 0: %s\n", err.msg); return 1; }
#endif
    if (rdv_open(&j->rdv, addr, port, rank, j->world, j->nccl_id, sizeof j->nccl_id, j->o->timeout, &err)) {
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
    int port = 0, lfd = mt_rdv_listen(&port, &err);   /* rank 0 serves on this socket: the port is ours from now on */
    if (lfd < 0) { fprintf(stderr, "train: %s\n", err.msg); return 1; }
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
            if (r == 0) { snprintf(v, sizeof v, "%d", lfd); setenv("MOETRAIN_RDV_FD", v, 1); }
            else close(lfd);
            setenv("MOETRAIN_SUPERVISED", "1", 1);   /* our own ranks: no launch line of their own */
            execv("/proc/self/exe", argv);
            fprintf(stderr, "train: rank %d: exec: %s\n", r, strerror(errno));
            _exit(127);
        }
        alive[r] = 1;
    }
    close(lfd);   /* rank 0 has it */
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

static const char *env_get(void *ctx, const char *name) { (void)ctx; return getenv(name); }

/* --launch-check: the launcher's ranks meet as for training; rank 0 hands out
 * where it runs, each rank prints it next to its own place, and all end in order. */
static int launch_check(const mt_launch *L, double timeout) {
    char host[128] = "?", blob[256];
    gethostname(host, sizeof host - 1);
    if (L->world == 1) {
        printf("launch check: %s on %s: nothing to meet\n", L->by == MT_LAUNCH_SELF ? "no launcher, ./train starts its own ranks" : "one rank", host);
        return 0;
    }
    memset(blob, 0, sizeof blob);
    if (L->rank == 0) snprintf(blob, sizeof blob, "%s, pid %d", host, (int)getpid());
    mt_err err;
    mt_rdv *r;
    if (rdv_open(&r, L->addr, L->port, L->rank, L->world, (uint8_t *)blob, sizeof blob, timeout, &err)) {
        fprintf(stderr, "train: rank %d: %s\n", L->rank, err.msg);
        return 1;
    }
    blob[sizeof blob - 1] = 0;
    mt_rdv_done(r);
    int k = 0, who = -1;
    char why[256] = "";
    for (double t0 = mt_now(); k == 0 && mt_now() - t0 < timeout;) k = mt_rdv_poll(r, 100, &who, why, sizeof why);
    mt_rdv_close(r);
    if (k != 2) {
        fprintf(stderr, "train: rank %d: %s\n", L->rank, k == 1 ? why : "the ranks did not all finish the check");
        return 1;
    }
    printf("launch check: rank %d of %d (local %d) on %s met rank 0 (%s) at %s:%d\n", L->rank, L->world, L->local_rank, host, blob,
           L->addr, L->port);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);   /* one line per step, also into pipes and files */
    double t_launch = mt_now();
    setenv("NCCL_NVLS_ENABLE", "0", 0);  /* no NVLink multicast unless the user asks for it */
    opts o;
    if (parse_args(argc, argv, &o)) return 2;
    mt_err err;
    mt_launch L;   /* who started this process: its rank, world and rendezvous */
    if (mt_launch_from_env(&L, env_get, NULL, &err)) { fprintf(stderr, "train: %s\n", err.msg); return 2; }
    if (!getenv("MOETRAIN_SUPERVISED") && (L.by != MT_LAUNCH_SELF || o.launch_check || strcmp(L.what, "self"))) {
        printf("launch: %s", L.what);
        if (L.world > 1) printf(" | rendezvous %s:%d (%s; %s)", L.addr, L.port, L.addr_from, L.port_from);
        printf("\n");
    }
    if (o.launch_check) return launch_check(&L, o.timeout);
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
        if (o.dp_shard || o.dp_replicate || o.tp || o.ep) {
            fprintf(stderr, "train: --graph fixes the mesh; re-run precompile to change it\n");
            mt_graph_free(&g);
            return 2;
        }
        if (given(&o, "moments") && o.moments_dt != mt_graph_moments(&g)) {
            fprintf(stderr, "train: '%s' was compiled with %s AdamW moments; --moments %s cannot change them (re-run precompile with it)\n",
                    o.graph, mt_graph_moments(&g) == MT_BF16 ? "bf16" : "fp32", o.moments);
            mt_graph_free(&g);
            return 2;
        }
        o.moments_dt = mt_graph_moments(&g);
        if (o.fp8 && !mt_graph_fp8(&g)) {
            fprintf(stderr, "train: '%s' was compiled with bf16 GEMMs; --fp8 cannot change them (re-run precompile with it)\n", o.graph);
            mt_graph_free(&g);
            return 2;
        }
        if (o.fp8_wgrad && o.fp8_mode != mt_graph_fp8_mode(&g)) {
            fprintf(stderr, "train: '%s' was compiled with GEMMs %s; --fp8-wgrad %s cannot change them (re-run precompile with it)\n",
                    o.graph, mt_fp8_mode_name(mt_graph_fp8_mode(&g)), o.fp8_wgrad);
            mt_graph_free(&g);
            return 2;
        }
        o.fp8_mode = mt_graph_fp8_mode(&g);
        o.fp8 = o.fp8_mode != MT_FP8_OFF;
        if (given(&o, "moe-chunks") && o.moe_chunks != mt_graph_moe_chunks(&g)) {
            fprintf(stderr, "train: '%s' was compiled with %d MoE chunk%s; --moe-chunks %d cannot change that (re-run precompile with it)\n",
                    o.graph, mt_graph_moe_chunks(&g), mt_graph_moe_chunks(&g) > 1 ? "s" : "", o.moe_chunks);
            mt_graph_free(&g);
            return 2;
        }
        cfg = g.cfg;
        have_graph = 1;
    } else {
        if (mt_config_preset(&cfg, o.preset, &err)) { fprintf(stderr, "train: %s\n", err.msg); return 2; }
        if (apply_overrides(&o, &cfg)) return 2;
    }
    int rc_cfg = o.load ? checkpoint_config(&o, &cfg, have_graph) : 0;
    if (rc_cfg) { mt_graph_free(&g); return rc_cfg; }
    if (mt_config_validate(&cfg, &err)) { fprintf(stderr, "train: %s\n", err.msg); mt_graph_free(&g); return 2; }
    if (!given(&o, "lr")) {   /* the model's default peak learning rate */
        mt_hparams d;
        mt_hparams_for_config(&d, &cfg);
        o.hp.lr = d.lr;
    }
    if (o.forward) {
        if (o.nproc > 1 || L.world > 1) { fprintf(stderr, "train: --forward runs on one rank\n"); return 2; }
        if (preflight(&o)) return 1;
        return run_forward(&o, cfg);
    }

    /* 2. the ranks: a launcher's world, or ours */
    int launched = L.by != MT_LAUNCH_SELF;
    int world = L.world, rank = L.rank, local_rank = L.local_rank, gpus = 0, on_cuda = !strcmp(o.device, "cuda");
#ifdef MT_CUDA
    if (on_cuda) gpus = mt_cuda_device_count();
#endif
    if (launched) {
        if (o.nproc && o.nproc != world) { fprintf(stderr, "train: --nproc %d but the launcher set a world of %d: %s\n", o.nproc, world, L.what); return 2; }
        if (world > 1 && !on_cuda) {
            fprintf(stderr, "train: CPU ranks are threads of one process, not %d processes (%s): start one and run "
                    "'./train --device cpu --nproc %d' in it\n", world, L.what, world);
            return 2;
        }
        /* srun and mpirun may bind each task to its own GPU (--gpus-per-task 1): the one it sees is its own */
        if (on_cuda && gpus == 1 && L.by != MT_LAUNCH_TORCHRUN) local_rank = 0;
        if (on_cuda && local_rank >= gpus) {
            fprintf(stderr, "train: rank %d: %s but this host has %d visible GPU%s\n", rank, L.what, gpus, gpus == 1 ? "" : "s");
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
    if (rank == 0 && preflight(&o)) { mt_graph_free(&g); return 1; }   /* every output writable, before any work */
    mt_run_state ck;   /* resuming: the saved run's state and settings */
    if (o.load && (rc_cfg = plan_resume(&o, &ck))) { mt_graph_free(&g); return rc_cfg; }
    if (!launched && world > 1 && on_cuda) { mt_graph_free(&g); return supervise(argc, argv, world); }   /* one process per GPU */

    /* 3. the step graph: compiled here unless an artifact was given */
    if (!have_graph) {
        mt_mesh mesh;
        mt_target tgt;
        mt_passes passes;
        int rep = o.dp_replicate ? o.dp_replicate : 1;
        int tp = o.tp ? o.tp : 1;
        int shard = o.dp_shard ? o.dp_shard : world / (rep * tp);
        if (rep * shard * tp != world) {
            fprintf(stderr, "train: the mesh dp-replicate %d x dp-shard %d x tp %d = %d does not match %d ranks\n", rep, shard, tp,
                    rep * shard * tp, world);
            return 2;
        }
        if (mt_mesh_init(&mesh, rep, shard, tp, o.ep ? o.ep : 1, &err) || mt_mesh_validate(&mesh, &cfg, &err)) {
            fprintf(stderr, "train: %s\n", err.msg);
            return 2;
        }
        choose_target(&o, &tgt);
        if (o.eager) mt_passes_none(&passes); else mt_passes_all(&passes);
        if (o.overlap && o.no_overlap) { fprintf(stderr, "train: --overlap and --no-overlap contradict each other\n"); return 2; }
        passes.overlap = !o.eager && !o.no_overlap && (o.overlap || world > 1);   /* measured faster on every 2-GPU mesh */
        if (o.no_fold_rope) passes.fold_rope = 0;
        if (o.no_fuse_glu) passes.fuse_glu = 0;
        passes.memory_budget = (int64_t)((double)o.memory_budget * 1073741824.0);
        passes.moments = o.moments_dt;
        passes.fp8 = o.fp8_mode;
        passes.moe_chunks = o.moe_chunks ? o.moe_chunks : 1;
        double t0 = mt_now();
        if (mt_compile(&g, &cfg, &mesh, &tgt, MT_GRAPH_TRAIN, &passes, &err)) { fprintf(stderr, "train: %s\n", err.msg); return 1; }
#ifdef MT_CUDA
        if (on_cuda && mt_tune(&g, world > 1 ? local_rank : o.gpu, &err)) { fprintf(stderr, "train: %s\n", err.msg); mt_graph_free(&g); return 1; }
#endif
        char note[64];
        if (rank == 0) printf("compiled the step graph in %.2f s: %d nodes, %d values, %d of %d blocks recomputed%s%s", mt_now() - t0,
                              g.n_nodes, g.n_values, g.n_recompute, g.cfg.n_layers, o.moments_dt == MT_BF16 ? ", AdamW moments in bf16" : "",
                              chunks_note(&g, note, sizeof note));
    } else if (rank == 0) {
        char note[64];
        printf("loaded the step graph from %s: %d nodes, %d values%s%s", o.graph, g.n_nodes, g.n_values,
               o.moments_dt == MT_BF16 ? ", AdamW moments in bf16" : "", chunks_note(&g, note, sizeof note));
    }
    if (rank == 0 && mt_graph_fp8(&g))
        printf(", %d GEMMs in FP8%s", mt_graph_fp8(&g), mt_graph_fp8_mode(&g) == MT_FP8_NO_WGRAD ? " (weight gradients in bf16)" : "");
    if (rank == 0) printf("\n");
    if (rank == 0 && o.fp8 && !mt_graph_fp8(&g))
        printf("note: --fp8, but none of this model's GEMMs fits the FP8 kernels (widths multiples of 16): all run in bf16\n");

    /* 4. data */
    mt_dataset ds;
    if (o.data ? mt_data_load_as(&ds, o.data, o.data_fmt, &err) : mt_data_default(&ds, &err)) {
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
    uint64_t data_hash = mt_data_hash(&ds);
    if (o.load && check_resume_data(&o, &ck, &ds, data_hash)) { mt_data_free(&ds); mt_graph_free(&g); return 1; }

    /* 5. train: one rank here, every rank as a thread, or this process's rank */
    job_t *j = (job_t *)calloc(1, sizeof *j);
    j->o = &o; j->cfg = cfg; j->g = &g; j->ds = &ds; j->data_hash = data_hash;
    j->world = world; j->local_rank = local_rank; j->t_launch = t_launch; j->last_saved = -1;
    j->rts = (mt_runtime **)calloc((size_t)world, sizeof(mt_runtime *));
    int rc;
    if (launched && world > 1) {
        rc = process_rank(j, rank, L.addr, L.port);
    } else {
        rc = (world > 1 ? mt_run_thread_ranks(world, thread_rank, j, &err) : train_rank(j, 0, NULL, &err)) ? 1 : 0;
        if (rc && !j->reported) {
            fprintf(stderr, "train: %s\n", err.msg);
            stop_note(&o, j->last_saved, j->last_dir);
        }
    }
    for (int r = 0; r < world; r++) mt_runtime_destroy(j->rts[r]);
    free(j->rts);
    free(j);
    mt_data_free(&ds);
    mt_graph_free(&g);
    return rc;
}
