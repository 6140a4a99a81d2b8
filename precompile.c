/* precompile — build and optimize the training-step graph once, on one rank,
 * and write it as a rank- and device-agnostic artifact.
 *
 *   ./precompile --preset tiny -o tiny.mtg
 *   ./precompile --preset debug --device cuda --arch sm_90a -o debug.mtg
 *   ./precompile --dump tiny.mtg            print the plan readably
 *
 * No GPU is touched: the target names an architecture, never a device, so
 * the same command gives the same bytes on any machine.
 */
#define MOETRAIN_IMPLEMENTATION
#include "moetrain.h"

#include <stdlib.h>
#include <string.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: precompile [options] -o FILE\n"
            "       precompile --dump FILE\n"
            "  --preset NAME         %s (default tiny)\n"
            "  --<field> VALUE       override any config field (see train --help)\n"
            "  --device cpu|cuda     backend the plan is for (default cpu)\n"
            "  --arch NAME           CUDA architecture (default sm_90a)\n"
            "  --dp-replicate N --dp-shard N --tp N --ep N   mesh (default 1 1 1 1)\n"
            "  --forward             a forward-only graph (logits as output) instead of a training step\n"
            "  --eager               no optimizing passes\n"
            "  -o, --out FILE        where to write the artifact\n"
            "  --dump FILE           validate an artifact and print nodes, queues, memory plan, collectives, symbols\n",
            mt_config_preset_names());
}

static int parse_pos(const char *flag, const char *v, int *out) {
    char *end;
    long x = strtol(v, &end, 10);
    if (!*v || *end || x < 1 || x > 4096) { fprintf(stderr, "precompile: %s takes an integer in 1..4096, not '%s'\n", flag, v); return -1; }
    *out = (int)x;
    return 0;
}

int main(int argc, char **argv) {
    const char *preset = "tiny", *out = NULL, *dump = NULL, *device = "cpu", *arch = "sm_90a";
    int eager = 0, forward = 0, mesh_in[4] = {1, 1, 1, 1};
    const char *ov_key[128], *ov_val[128];
    int n_ov = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!strcmp(a, "--eager")) { eager = 1; continue; }
        if (!strcmp(a, "--forward")) { forward = 1; continue; }
        if (strncmp(a, "-", 1)) { fprintf(stderr, "precompile: unexpected argument '%s' (see --help)\n", a); return 2; }
        if (i + 1 >= argc) { fprintf(stderr, "precompile: %s needs a value\n", a); return 2; }
        const char *v = argv[++i];
        if (!strcmp(a, "-o") || !strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--dump")) dump = v;
        else if (!strcmp(a, "--preset")) preset = v;
        else if (!strcmp(a, "--device")) device = v;
        else if (!strcmp(a, "--arch")) arch = v;
        else if (!strcmp(a, "--dp-replicate")) { if (parse_pos(a, v, &mesh_in[0])) return 2; }
        else if (!strcmp(a, "--dp-shard")) { if (parse_pos(a, v, &mesh_in[1])) return 2; }
        else if (!strcmp(a, "--tp")) { if (parse_pos(a, v, &mesh_in[2])) return 2; }
        else if (!strcmp(a, "--ep")) { if (parse_pos(a, v, &mesh_in[3])) return 2; }
        else if (!strncmp(a, "--", 2) && n_ov < 128) { ov_key[n_ov] = a + 2; ov_val[n_ov++] = v; }
        else { fprintf(stderr, "precompile: unknown option '%s' (see --help)\n", a); return 2; }
    }
    mt_err err;
    if (dump) {
        mt_graph g;
        if (mt_artifact_load(&g, dump, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); return 1; }
        mt_graph_dump(&g, stdout);
        mt_graph_free(&g);
        return 0;
    }
    if (!out) { fprintf(stderr, "precompile: say where to write the artifact with -o FILE (see --help)\n"); return 2; }
    mt_config cfg;
    if (mt_config_preset(&cfg, preset, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); return 2; }
    for (int i = 0; i < n_ov; i++)
        if (mt_config_set(&cfg, ov_key[i], ov_val[i], &err)) { fprintf(stderr, "precompile: %s\n", err.msg); return 2; }
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
    mt_graph g;
    double t0 = mt_now();
    if (mt_compile(&g, &cfg, &mesh, &tgt, forward ? MT_GRAPH_FORWARD : MT_GRAPH_TRAIN, &passes, &err)) {
        fprintf(stderr, "precompile: %s\n", err.msg);
        return 1;
    }
    double t1 = mt_now();
    if (mt_artifact_save(&g, out, &err)) { fprintf(stderr, "precompile: %s\n", err.msg); mt_graph_free(&g); return 1; }
    char h1[32], h2[32], h3[32];
    printf("wrote %s: %d nodes, %d values, fingerprint %016llx (compiled in %.2f s)\n", out, g.n_nodes, g.n_values,
           (unsigned long long)mt_fingerprint(&g), t1 - t0);
    printf("memory: %s persistent + %s arena (naive arena %s)\n", mt__human((double)g.persist_bytes, h1),
           mt__human((double)g.arena_bytes, h2), mt__human((double)g.naive_arena_bytes, h3));
    mt_graph_free(&g);
    return 0;
}
