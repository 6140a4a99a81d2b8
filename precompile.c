/* precompile — build and optimize the training-step graph once, on one rank,
 * and write it as a rank- and device-agnostic artifact.
 *
 *   ./precompile --preset tiny -o tiny.mtg
 *   ./precompile --preset debug --device cuda --arch sm_90a -o debug.mtg
 *   ./precompile --dump tiny.mtg            print the plan readably
 *
 * No GPU is touched: the target names an architecture, never a device, so
 * the same command gives the same bytes on any machine. Run ./precompile --help
 * for every option. Exit status: 0 done, 1 runtime error, 2 usage error.
 */
#define MOETRAIN_IMPLEMENTATION
#include "moetrain.h"

#include <stdlib.h>
#include <string.h>

/* The options: one table drives parsing, range checks and --help. */
enum { OPT_FLAG, OPT_INT, OPT_STR, OPT_FLOAT };
typedef struct { const char *name, *meta; int kind, lo, hi; const char *def, *help; } opt_spec;
static const opt_spec specs[] = {
    {"preset", "NAME", OPT_STR, 0, 0, "tiny", "model preset: tiny, debug, mid, 16b"},
    {"device", "NAME", OPT_STR, 0, 0, "cpu", "backend the plan is for: cpu | cuda"},
    {"arch", "NAME", OPT_STR, 0, 0, "sm_90a", "CUDA architecture (with --device cuda)"},
    {"dp-replicate", "N", OPT_INT, 1, 4096, "1", "mesh: data-parallel replicas"},
    {"dp-shard", "N", OPT_INT, 1, 4096, "1", "mesh: data-parallel shards (FSDP)"},
    {"tp", "N", OPT_INT, 1, 4096, "1", "mesh: tensor parallelism"},
    {"ep", "N", OPT_INT, 1, 4096, "1", "mesh: expert parallelism (borrows ranks from dp-shard x tp)"},
    {"forward", NULL, OPT_FLAG, 0, 0, "off", "a forward-only graph (logits as output) instead of a training step"},
    {"eager", NULL, OPT_FLAG, 0, 0, "off", "no optimizing passes"},
    {"out", "FILE", OPT_STR, 0, 0, "", "where to write the artifact (also -o FILE)"},
    {"dump", "FILE", OPT_STR, 0, 0, "", "validate an artifact and print nodes, queues, memory plan, collectives, symbols"},
    {"gpu", "N", OPT_INT, 0, 1023, "0", "with --device cuda: the GPU that tunes (any of one model gives the same bytes)"},
    {"no-tune", NULL, OPT_FLAG, 0, 0, "off", "with --device cuda: record no tuning (each rank then chooses at bind)"},
    {"dot", "FILE", OPT_STR, 0, 0, "", "also write the graph for Graphviz (dot -Tsvg FILE); with --dump FILE too"},
    {"overlap", NULL, OPT_FLAG, 0, 0, "on with several ranks", "collectives on their own streams: FSDP prefetch, EP ahead of its host sync"},
    {"no-overlap", NULL, OPT_FLAG, 0, 0, "off", "every node on the compute stream, in list order (bitwise the same steps)"},
    {"no-fold-rope", NULL, OPT_FLAG, 0, 0, "off", "CUDA: form MLA's Q, K, V apart instead of folding RoPE into attention"},
    {"no-fuse-glu", NULL, OPT_FLAG, 0, 0, "off", "the experts' gate and up GEMMs and their SwiGLU as three ops"},
    {"memory-budget", "GiB", OPT_FLOAT, 0, 1 << 20, "0: off", "recompute the fewest blocks' activations so the planned peak (persistent + arena) fits"},
    {"moments", "DTYPE", OPT_STR, 0, 0, "fp32", "AdamW moments' dtype: fp32, or bf16 (half their bytes; the update in fp32)"},
    {"fp8", NULL, OPT_FLAG, 0, 0, "off", "the linear layers' GEMMs in FP8, DeepSeek-V3's block scaling (docs/FP8.md)"},
    {"fp8-wgrad", "DTYPE", OPT_STR, 0, 0, "fp8", "with --fp8: the weight gradients' GEMMs in fp8 (DeepSeek-V3's recipe) or bf16"},
    {"moe-chunks", "N", OPT_INT, 1, MT_MOE_CHUNKS_MAX, "1", "each MoE layer's routed experts in N chunks of its tokens (with overlap: one chunk's exchange under another's experts)"},
    {"help", NULL, OPT_FLAG, 0, 0, "", "this text"},
};
#define N_SPECS ((int)(sizeof specs / sizeof specs[0]))
static int at(const char *name) {   /* the table row of an option */
    for (int i = 0; i < N_SPECS; i++) if (!strcmp(specs[i].name, name)) return i;
    return N_SPECS - 1;
}

static void usage(FILE *f) {
    fprintf(f, "usage: precompile [options] [--<config field> VALUE ...] -o FILE\n       precompile --dump FILE\n\noptions (default in brackets):\n");
    for (int i = 0; i < N_SPECS; i++) {
        char lhs[40];
        snprintf(lhs, sizeof lhs, "--%s%s%s", specs[i].name, specs[i].meta ? " " : "", specs[i].meta ? specs[i].meta : "");
        fprintf(f, "  %-20s %s", lhs, specs[i].help);
        if (specs[i].kind == OPT_INT || specs[i].kind == OPT_FLOAT) fprintf(f, ", [%d..%d]", specs[i].lo, specs[i].hi);
        if (specs[i].def[0]) fprintf(f, " [%s]", specs[i].def);
        fprintf(f, "\n");
    }
    fprintf(f, "\nconfig fields (as --name VALUE, default the preset's; train --help lists them with tiny's values):\n ");
    for (int i = 0; i < mt_n_config_fields; i++) {
        char dash[32];
        snprintf(dash, sizeof dash, "%s", mt_config_fields[i].name);
        for (char *q = dash; *q; q++) if (*q == '_') *q = '-';
        fprintf(f, " --%s%s", dash, i % 6 == 5 && i + 1 < mt_n_config_fields ? "\n " : "");
    }
    fprintf(f, "\n\nexit status: 0 done, 1 runtime error (files, compile), 2 usage error\n");
}

static void unknown_option(const char *name) {
    const char *names[N_SPECS];
    char near[64];
    for (int i = 0; i < N_SPECS; i++) names[i] = specs[i].name;
    if (mt_suggest_option(name, names, N_SPECS, near, sizeof near))
        fprintf(stderr, "precompile: unknown option '--%s' (did you mean '--%s'?); see --help\n", name, near);
    else fprintf(stderr, "precompile: unknown option '--%s'; see --help\n", name);
}

int main(int argc, char **argv) {
    const char *str[N_SPECS] = {0};
    int num[N_SPECS] = {0}, flag[N_SPECS] = {0};
    double fnum[N_SPECS] = {0};
    const char *ov_key[128], *ov_val[128];
    int n_ov = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h")) { usage(stdout); return 0; }
        const char *name = !strcmp(a, "-o") ? "out" : a + 2;
        if (strcmp(a, "-o") && (strncmp(a, "--", 2) || !a[2])) {
            fprintf(stderr, "precompile: unexpected argument '%s' (options start with --; see --help)\n", a);
            return 2;
        }
        int k = -1;
        for (int j = 0; j < N_SPECS; j++) if (!strcmp(specs[j].name, name)) k = j;
        if (k < 0 && !mt_config_has_field(name)) { unknown_option(name); return 2; }
        if (k >= 0 && specs[k].kind == OPT_FLAG) {
            if (!strcmp(name, "help")) { usage(stdout); return 0; }
            flag[k] = 1;
            continue;
        }
        if (i + 1 >= argc) { fprintf(stderr, "precompile: %s needs a value\n", a); return 2; }
        const char *v = argv[++i];
        if (k < 0) {
            if (n_ov >= 128) { fprintf(stderr, "precompile: too many config options\n"); return 2; }
            ov_key[n_ov] = name; ov_val[n_ov++] = v;
        } else if (specs[k].kind == OPT_INT) {
            char *end;
            long long x = strtoll(v, &end, 10);
            if (!*v || *end || x < specs[k].lo || x > specs[k].hi) {
                fprintf(stderr, "precompile: --%s takes an integer in [%d..%d], not '%s'\n", name, specs[k].lo, specs[k].hi, v);
                return 2;
            }
            num[k] = (int)x;
        } else if (specs[k].kind == OPT_FLOAT) {
            char *end;
            double x = strtod(v, &end);
            if (!*v || *end || !(x >= specs[k].lo && x <= specs[k].hi)) {
                fprintf(stderr, "precompile: --%s takes a number in [%d..%d], not '%s'\n", name, specs[k].lo, specs[k].hi, v);
                return 2;
            }
            fnum[k] = x;
        } else {
            if (!*v) { fprintf(stderr, "precompile: --%s needs a non-empty value\n", name); return 2; }
            str[k] = v;
        }
    }
#define STR(o, d) (str[at(o)] ? str[at(o)] : (d))
#define NUM(o) (num[at(o)] ? num[at(o)] : 1)
    const char *preset = STR("preset", "tiny"), *device = STR("device", "cpu"), *arch = STR("arch", "sm_90a"), *out = str[at("out")],
               *dump = str[at("dump")], *dot = str[at("dot")];
    int mesh_in[4] = {NUM("dp-replicate"), NUM("dp-shard"), NUM("tp"), NUM("ep")}, forward = flag[at("forward")], eager = flag[at("eager")],
        gpu = num[at("gpu")], no_tune = flag[at("no-tune")];
#undef STR
#undef NUM
    mt_err err;
    if (dump) {
        mt_graph g;
        if (mt_artifact_load(&g, dump, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); return 1; }
        mt_graph_dump(&g, stdout);
        int rc = dot && mt_graph_dot(&g, dot, &err) ? 1 : 0;
        if (rc) fprintf(stderr, "precompile: %s\n", err.msg);
        mt_graph_free(&g);
        return rc;
    }
    if (!out) { fprintf(stderr, "precompile: say where to write the artifact with -o FILE (see --help)\n"); return 2; }
    FILE *probe = fopen(out, "rb");   /* before compiling: can the artifact be written there? */
    int existed = probe != NULL;
    if (probe) fclose(probe);
    if (!(probe = fopen(out, "ab")) || fclose(probe)) { fprintf(stderr, "precompile: cannot write '%s': %s\n", out, strerror(errno)); return 1; }
    if (!existed) remove(out);
    mt_config cfg;
    if (mt_config_preset(&cfg, preset, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); return 2; }
    for (int i = 0; i < n_ov; i++)
        if (mt_config_set(&cfg, ov_key[i], ov_val[i], &err)) { fprintf(stderr, "precompile: %s (see --help)\n", err.msg); return 2; }
    mt_target tgt;
    if (!strcmp(device, "cpu")) mt_target_cpu(&tgt);
    else if (!strcmp(device, "cuda")) {
        if (strlen(arch) >= sizeof tgt.arch || strncmp(arch, "sm_", 3)) { fprintf(stderr, "precompile: --arch takes a name like sm_90a\n"); return 2; }
        mt_target_cuda(&tgt, arch);
    } else { fprintf(stderr, "precompile: --device takes cpu or cuda, not '%s'\n", device); return 2; }
    mt_mesh mesh;
    if (mt_mesh_init(&mesh, mesh_in[0], mesh_in[1], mesh_in[2], mesh_in[3], &err)) { fprintf(stderr, "precompile: %s\n", err.msg); return 2; }
    mt_passes passes;
    if (eager) mt_passes_none(&passes); else mt_passes_all(&passes);
    if (flag[at("overlap")] && flag[at("no-overlap")]) { fprintf(stderr, "precompile: --overlap and --no-overlap contradict each other\n"); return 2; }
    passes.overlap = !eager && !flag[at("no-overlap")] && (flag[at("overlap")] || mt_mesh_world(&mesh) > 1);
    if (flag[at("no-fold-rope")]) passes.fold_rope = 0;
    if (flag[at("no-fuse-glu")]) passes.fuse_glu = 0;
    passes.memory_budget = (int64_t)(fnum[at("memory-budget")] * 1073741824.0);
    const char *moments = str[at("moments")];
    if (moments && strcmp(moments, "fp32") && strcmp(moments, "bf16")) { fprintf(stderr, "precompile: --moments takes fp32 or bf16, not '%s'\n", moments); return 2; }
    passes.moments = moments && !strcmp(moments, "bf16") ? MT_BF16 : MT_F32;
    const char *wgrad = str[at("fp8-wgrad")];
    if (wgrad && ((strcmp(wgrad, "fp8") && strcmp(wgrad, "bf16")) || !flag[at("fp8")])) {
        fprintf(stderr, "precompile: --fp8-wgrad takes fp8 or bf16, with --fp8 (not '%s')\n", wgrad);
        return 2;
    }
    passes.fp8 = !flag[at("fp8")] ? MT_FP8_OFF : wgrad && !strcmp(wgrad, "bf16") ? MT_FP8_NO_WGRAD : MT_FP8_ALL;
    passes.moe_chunks = num[at("moe-chunks")] ? num[at("moe-chunks")] : 1;
    mt_graph g;
    double t0 = mt_now();
    if (mt_config_validate(&cfg, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); return 2; }
    if (mt_mesh_validate(&mesh, &cfg, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); return 2; }
    if (mt_compile(&g, &cfg, &mesh, &tgt, forward ? MT_GRAPH_FORWARD : MT_GRAPH_TRAIN, &passes, &err)) {
        fprintf(stderr, "precompile: %s\n", err.msg);
        return 1;
    }
    double t1 = mt_now();
    if (tgt.backend == MT_BACKEND_CUDA && !no_tune) {   /* choose once what every rank would choose */
#ifdef MT_CUDA
        int ngpu = mt_cuda_device_count();
        if (ngpu > 0 && gpu >= ngpu) {
            fprintf(stderr, "precompile: --gpu %d but %d GPU%s visible\n", gpu, ngpu, ngpu == 1 ? " is" : "s are");
            mt_graph_free(&g);
            return 2;
        }
        if (ngpu > 0) {
            double t2 = mt_now();
            if (mt_tune(&g, gpu, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); mt_graph_free(&g); return 1; }
            printf("tuned on GPU %d (%s): %d GEMM choices in %.2f s\n", gpu, g.tuned_for.device, g.n_tuning, mt_now() - t2);
        } else
#endif
            printf("no GPU visible here: the artifact carries no tuning (each rank chooses its GEMM algorithms at bind)\n");
    }
    if (mt_artifact_save(&g, out, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); mt_graph_free(&g); return 1; }
    char h1[32], h2[32], h3[32];
    printf("wrote %s: %d nodes, %d values, fingerprint %016llx (compiled in %.2f s)\n", out, g.n_nodes, g.n_values,
           (unsigned long long)mt_fingerprint(&g), t1 - t0);
    printf("memory: %s persistent + %s arena (naive arena %s)\n", mt__human((double)g.persist_bytes, h1),
           mt__human((double)g.arena_bytes, h2), mt__human((double)g.naive_arena_bytes, h3));
    int64_t opt = 0;
    for (int i = 0; i < g.n_values; i++) opt += g.values[i].role == MT_ROLE_OPT ? g.values[i].nbytes : 0;
    if (opt) printf("  of the persistent: AdamW moments %s (%s)\n", mt__human((double)opt, h1), mt_graph_moments(&g) == MT_BF16 ? "bf16" : "fp32");
    if (mt_graph_fp8(&g))
        printf("fp8: %d GEMMs with e4m3 inputs (the embedding, output head, router and attention in bf16%s)\n", mt_graph_fp8(&g),
               mt_graph_fp8_mode(&g) == MT_FP8_NO_WGRAD ? ", and the weight gradients" : "");
    if (mt_graph_moe_chunks(&g) > 1) printf("MoE: each layer's routed experts in %d chunks of tokens\n", mt_graph_moe_chunks(&g));
    if (g.memory_budget)
        printf("recompute: %d of %d blocks for a budget of %s (planned peak %s, without recompute %s); --dump lists them\n",
               g.n_recompute, g.cfg.n_layers, mt__human((double)g.memory_budget, h1), mt__human((double)mt_graph_peak_bytes(&g), h2),
               mt__human((double)g.peak_no_recompute, h3));
    if (dot && mt_graph_dot(&g, dot, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); mt_graph_free(&g); return 1; }
    mt_graph_free(&g);
    return 0;
}
