/* moetrain.h — a minimal trainer for DeepSeek-V3-style Mixture-of-Experts models.
 *
 * stb-style single header. In exactly one C (or C++) file:
 *     #define MOETRAIN_IMPLEMENTATION
 *     #include "moetrain.h"
 * Everywhere else include it plainly. Override MT_MALLOC / MT_REALLOC / MT_FREE
 * before the implementation to use your allocator. Nothing in here calls exit();
 * every function that can fail returns non-zero and fills an mt_err message.
 * There is no global mutable state.
 *
 * The training step is a GRAPH: a flat list of nodes over a table of values.
 * It is built once (forward from the model code, backward by a reverse pass,
 * then gradient reduction, clipping, AdamW and the expert-bias update),
 * optimized by passes, written to a rank- and device-agnostic ARTIFACT, and
 * executed by an interpreter bound to one rank's mesh coordinates and device.
 *
 * TABLE OF CONTENTS
 *   1.  Basics: allocation, errors, hashing, random numbers, thread pool
 *   2.  Config, presets, run hyper-parameters
 *   3.  Mesh
 *   4.  Graph IR: dtypes, roles, queues, symbols, values, nodes, the op table
 *   5.  Builder: the model forward, reverse-mode autodiff, optimizer
 *   6.  Passes: elision, activation recompute, RoPE folding, fusion, memory planning, capture
 *   7.  Artifact: write, validate + load, fingerprint, dump
 *   8.  CPU reference ops (forward/backward pairs, plain C)
 *   9.  Collectives
 *       9a.  THE EXPERT EXCHANGE: dispatch and combine, end to end (implementation part)
 *   10. Runtime: bind, init, step
 *       10a. DEVICE HOISTING: one rank, one device, named by its binding (implementation part)
 *   11. Checkpoints: safetensors with Hugging Face DeepSeek-V3 names
 *   12. Data: token shards, raw bytes, the embedded default corpus
 *   13. Metrics: FLOPs per token, MFU, SVG loss curve
 *   14. Launch: the rendezvous that hands out NCCL's id and relays failures
 *   Op index: right below; for each op, where it is checked, built, differentiated, rewritten by
 *   passes, and run on the CPU and on CUDA
 *
 * Shapes are written in comments as [rows, cols]; N = batch*seq_len tokens,
 * D = dim, H = heads, E = routed experts, K = top_k, V = vocab.
 *
 * Precision: the CPU reference computes in mt_real, float by default. Build
 * with -DMT_REAL=double to run everything in float64 (gradient checks do).
 */

/* OP INDEX: for each op of MT_OPS (section 4), where it is
 *   checked in   the mt__check_* function mt_check_node hands it to (every op also passes
 *                mt__check_refs, and mt__index_operands says which operands are indices);
 *   built by     the builder function that emits it (section 5); "<- X": emitted by X's backward
 *                rule; "fuse: A + B" and the like: made by that pass from those ops;
 *   backward     what its case in mt__backward_rule emits ("-": none: not differentiable, or made
 *                after autodiff);
 *   passes       the passes that rewrite it or treat it apart (section 6): elide
 *                (mt_pass_elide_collectives), fuse (mt_pass_fuse), fuse_glu (mt_pass_fuse_glu),
 *                fold_rope (mt_pass_fold_rope), recompute (mt_pass_recompute: it re-runs every
 *                forward op of a block; named only where it treats an op apart), isolate_ep
 *                (mt_pass_isolate_ep), overlap (mt_pass_overlap, mt_node_queue: a stream of its
 *                own), capture (mt_node_capturable: runs eagerly between captured CUDA graphs),
 *                tune (mt_tune), fp8 (mt_pass_fp8: FP8 inputs, quantized by the CPU and CUDA cases);
 *                mt_pass_plan_memory and mt__validate_graph see every op;
 *   CPU, CUDA    what its case in mt__exec_cpu and mt__exec_cuda calls: an mt_cpu_* reference op
 *                (section 8), an mt_cuda_* launcher (moetrain_kernels.cu); collectives go through
 *                mt__cpu_collective and mt__cuda_collective to the engines of section 9, the
 *                expert exchange to section 9a.
 * Names, not line numbers: test_op_index (test.c) checks that every op of MT_OPS has its two lines
 * here, in MT_OPS order, and that every function named here exists.
 *
 * op                 checked in           built by                     backward           passes
 *                                         CPU (mt__exec_cpu)                       CUDA (mt__exec_cuda)
 * EMBED              mt__check_dense      mt__forward, mt__mtp         EMBED_BWD          -
 *                                         mt_cpu_embed_forward                     mt_cuda_embed_forward
 * EMBED_BWD          mt__check_dense      <- EMBED                     -                  -
 *                                         mt_cpu_embed_backward                    mt_cuda_embed_backward
 * RMSNORM            mt__check_dense      mt__rmsnorm_eps              RMSNORM_BWD        fuse
 *                                         mt_cpu_rmsnorm_forward                   mt_cuda_rmsnorm_forward
 * RMSNORM_BWD        mt__check_dense      <- RMSNORM                   -                  fuse
 *                                         mt_cpu_rmsnorm_backward                  mt_cuda_rmsnorm_backward
 * MATMUL             mt__check_dense      mt__linear, <- MATMUL        MATMUL x 2         fuse, tune, fp8
 *                                         mt_cpu_matmul                            mt_cuda_matmul
 * SPLIT              mt__check_dense      mt__mla, <- CONCAT           CONCAT             -
 *                                         mt_cpu_split                             mt_cuda_split
 * CONCAT             mt__check_dense      mt__mtp, <- SPLIT            SPLIT              -
 *                                         mt_cpu_concat                            mt_cuda_concat
 * MLA_ROPE           mt__check_attention  mt__mla                      MLA_ROPE_BWD       fold_rope
 *                                         mt_cpu_mla_rope_forward                  mt_cuda_mla_rope_forward
 * MLA_ROPE_BWD       mt__check_attention  <- MLA_ROPE                  -                  fold_rope
 *                                         mt_cpu_mla_rope_backward                 mt_cuda_mla_rope_backward
 * ATTENTION          mt__check_attention  mt__mla                      ATTENTION_BWD      fold_rope
 *                                         mt_cpu_attention_forward                 mt_cuda_attention_forward
 * ATTENTION_BWD      mt__check_attention  <- ATTENTION                 -                  fold_rope
 *                                         mt_cpu_attention_backward                mt_cuda_attention_backward
 * SWIGLU             mt__check_dense      mt__ffn, mt__moe             SWIGLU_BWD         fuse_glu
 *                                         mt_cpu_swiglu_forward                    mt_cuda_swiglu_forward
 * SWIGLU_BWD         mt__check_dense      <- SWIGLU                    -                  -
 *                                         mt_cpu_swiglu_backward                   mt_cuda_swiglu_backward
 * ADD                mt__check_dense      mt__block, mt__moe, mt__acc  (dy to both)       fuse
 *                                         mt_cpu_add                               mt_cuda_add
 * ROUTER             mt__check_moe        mt__moe                      ROUTER_BWD         recompute
 *                                         mt_cpu_router_forward                    mt_cuda_router_forward
 * ROUTER_BWD         mt__check_moe        <- ROUTER                    -                  -
 *                                         mt_cpu_router_backward                   mt_cuda_router_backward
 * MOE_PERMUTE        mt__check_moe        mt__moe                      MOE_PERMUTE_BWD    -
 *                                         mt_cpu_moe_permute                       mt_cuda_moe_permute
 * MOE_PERMUTE_BWD    mt__check_moe        <- MOE_PERMUTE               -                  -
 *                                         mt_cpu_moe_permute_backward              mt_cuda_moe_permute_backward
 * EP_COUNTS          mt__check_moe        mt__moe                      -                  elide, isolate_ep, overlap, capture
 *                                         mt__cpu_ep                               mt__cuda_ep; ep = 1: mt_cuda_ep_counts
 * EP_DISPATCH        mt__check_moe        mt__moe, <- EP_COMBINE       EP_COMBINE         elide, isolate_ep, overlap, capture
 *                                         mt__cpu_ep                               mt__cuda_ep; ep = 1: mt_cuda_ep_offsets
 * EP_COMBINE         mt__check_moe        mt__moe, <- EP_DISPATCH      EP_DISPATCH        elide, isolate_ep, overlap, capture
 *                                         mt__cpu_ep                               mt__cuda_ep; ep = 1: mt_cuda_copy
 * GMM                mt__check_moe        mt__moe                      GMM_DX, GMM_DW     fuse_glu, fp8
 *                                         mt_cpu_gmm                               mt_cuda_gmm (mode 0)
 * GMM_DX             mt__check_moe        <- GMM                       -                  fuse, fp8
 *                                         mt_cpu_gmm_dx                            mt_cuda_gmm (mode 1)
 * GMM_DW             mt__check_moe        <- GMM                       -                  fuse, fp8
 *                                         mt_cpu_gmm_dw                            mt_cuda_gmm (mode 2)
 * MOE_COMBINE        mt__check_moe        mt__moe                      MOE_COMBINE_BWD    -
 *                                         mt_cpu_moe_combine_forward               mt_cuda_moe_combine_forward
 * MOE_COMBINE_BWD    mt__check_moe        <- MOE_COMBINE               -                  -
 *                                         mt_cpu_moe_combine_backward              mt_cuda_moe_combine_backward
 * CROSS_ENTROPY      mt__check_loss       mt__cross_entropy (tp = 1)   CROSS_ENTROPY_BWD  -
 *                                         mt_cpu_cross_entropy_forward             mt_cuda_cross_entropy_forward
 * CROSS_ENTROPY_BWD  mt__check_loss       <- CROSS_ENTROPY             -                  -
 *                                         mt_cpu_cross_entropy_backward            mt_cuda_cross_entropy_backward
 * SUMSQ              mt__check_optimizer  mt__optimizer                -                  fuse
 *                                         mt__exec_cpu (in double)                 mt_cuda_sumsq, mt_cuda_sumsq_multi
 * ALLREDUCE          mt__check_collective mt__optimizer                -                  overlap, capture
 *                                         mt__cpu_allreduce                        mt_nccl_allreduce + mt_cuda_scale
 * LR_SCHEDULE        mt__check_optimizer  mt__optimizer                -                  -
 *                                         mt_lr_at                                 mt_cuda_lr_schedule
 * CLIP               mt__check_optimizer  mt__optimizer                -                  -
 *                                         mt__exec_cpu                             mt_cuda_clip
 * ADAMW              mt__check_optimizer  mt__optimizer                -                  -
 *                                         mt_cpu_adamw, mt_cpu_adamw_bf16          mt_cuda_adamw, mt_cuda_adamw_multi
 * EXPERT_BIAS_UPDATE mt__check_optimizer  mt__optimizer                -                  -
 *                                         mt_cpu_expert_bias_update                mt_cuda_expert_bias_update
 * ADD_RMSNORM        mt__check_dense      fuse: ADD + RMSNORM          -                  -
 *                                         mt_cpu_add_rmsnorm_forward               mt_cuda_add_rmsnorm_forward
 * RMSNORM_BWD_ADD    mt__check_dense      fuse: RMSNORM_BWD + ADD      -                  -
 *                                         mt_cpu_rmsnorm_backward_add              mt_cuda_rmsnorm_backward_add
 * MATMUL_ACC         mt__check_dense      fuse: MATMUL + ADD           -                  tune, fp8
 *                                         mt_cpu_matmul + mt_cpu_add               mt_cuda_matmul (acc)
 * GMM_DX2            mt__check_moe        fuse: GMM_DX x 2 + ADD       -                  fp8
 *                                         mt_cpu_gmm_dx + mt_cpu_gmm_dx_add        mt_cuda_gmm (mode 1, a2 b2)
 * GMM_DW_SQ          mt__check_moe        fuse: GMM_DW + SUMSQ         -                  fp8
 *                                         mt_cpu_gmm_dw + mt__exec_cpu             mt_cuda_gmm (mode 2, ssq)
 * DOC_STARTS         mt__check_dense      mt__forward                  -                  -
 *                                         mt_cpu_doc_starts                        mt_cuda_doc_starts
 * ALLGATHER          mt__check_collective mt__param, mt__regather      REDUCE_SCATTER     overlap, recompute, capture
 *                                         mt__cpu_allgather                        mt_nccl_allgather
 * REDUCE_SCATTER     mt__check_collective <- ALLGATHER                 -                  overlap, capture
 *                                         mt__cpu_reduce_scatter                   mt_nccl_reduce_scatter + mt_cuda_scale
 * ROPE_PE            mt__check_attention  fold_rope: MLA_ROPE          -                  -
 *                                         mt_cpu_rope_pe_forward                   mt_cuda_rope_pe_forward
 * MLA_ATTENTION      mt__check_attention  fold_rope: ATTENTION         -                  -
 *                                         mt_cpu_mla_attention_forward             mt_cuda_mla_attention_forward
 * MLA_ATTENTION_BWD  mt__check_attention  fold_rope: ATTENTION_BWD     -                  -
 *                                         mt_cpu_mla_attention_backward            mt_cuda_mla_attention_backward
 * ROPE_PE_BWD        mt__check_attention  fold_rope: MLA_ROPE_BWD      -                  -
 *                                         mt_cpu_rope_pe_backward                  mt_cuda_rope_pe_backward
 * GMM_GLU            mt__check_moe        fuse_glu: GMM x 2 + SWIGLU   -                  fp8
 *                                         mt_cpu_gmm x 2 + mt_cpu_swiglu_forward   mt_cuda_gmm_glu
 * SP_GATHER          mt__check_collective mt__sp, <- SP_SCATTER        SP_SCATTER         overlap, capture
 *                                         mt__cpu_allgather                        mt_nccl_allgather
 * SP_SCATTER         mt__check_collective mt__sp, <- SP_GATHER         SP_GATHER          overlap, capture
 *                                         mt__cpu_reduce_scatter                   mt_nccl_reduce_scatter
 * CE_STATS           mt__check_loss       mt__cross_entropy (tp > 1)   (via CE_COMBINE)   -
 *                                         mt_cpu_ce_stats                          mt_cuda_ce_stats
 * CE_COMBINE         mt__check_loss       mt__cross_entropy (tp > 1)   CE_SHARD_BWD       -
 *                                         mt_cpu_ce_combine                        mt_cuda_ce_combine
 * CE_SHARD_BWD       mt__check_loss       <- CE_COMBINE                -                  -
 *                                         mt_cpu_ce_shard_backward                 mt_cuda_ce_shard_backward
 * SHIFT_TOKENS       mt__check_dense      mt__mtp                      -                  -
 *                                         mt_cpu_shift_tokens                      mt_cuda_shift_tokens
 * (end of the op index) */
#ifndef MOETRAIN_H
#define MOETRAIN_H

/* The implementation uses POSIX (threads, clocks, sockets): ask for it when
 * nothing else did (this only works if moetrain.h is the first include). */
#if defined(MOETRAIN_IMPLEMENTATION) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE) && !defined(_DEFAULT_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef MT_REAL
#define MT_REAL float
#endif
typedef MT_REAL mt_real;

#define MT_VERSION_STRING "moetrain 0.1"
#define MT_KERNELS_VERSION "moetrain-kernels 3"   /* bump when any kernel's numerics change (2: RoPE rotations with pinned roundings; 3: the SwiGLU's logistic with the approximate reciprocal) */
#define MT_FORMAT_VERSION 10u                      /* artifact format (2: doc_mask, eot_id, DOC_STARTS; 3: value shard masks, ALLGATHER/REDUCE_SCATTER;
                                                      4: activation recompute: the recompute phase, the choice and budget in the plan; 5: tuning by GPU model;
                                                      6: RoPE folded into attention: ROPE_PE, MLA_ATTENTION(_BWD), ROPE_PE_BWD, 10 inputs a node;
                                                      7: tensor parallelism: SP_GATHER/SP_SCATTER, CE_STATS/CE_COMBINE/CE_SHARD_BWD, EMBED's
                                                         token slice, the TP_ROWS/TP_COLS value flags;
                                                      8: multi-token prediction: SHIFT_TOKENS, the loss ops' counted rows and weight,
                                                         the config fields mtp_layers and mtp_weight;
                                                      9: FP8 GEMMs: a GEMM node's iattr[MT_IATTR_FP8];
                                                      10: EMBED/EMBED_BWD on FSDP shards (iattr 2, 3), SP_GATHER of token ids) */

/* ========================================================================
 * 1. Basics
 * ====================================================================== */

typedef struct { char msg[1024]; } mt_err;

int mt_errf(mt_err *e, const char *fmt, ...);          /* set message, return -1 */
uint64_t mt_hash(const void *p, size_t n, uint64_t h); /* FNV-1a 64; h = MT_HASH_INIT to start */
#define MT_HASH_INIT 0xcbf29ce484222325ull

typedef struct { uint64_t s[4]; } mt_rng;               /* xoshiro256** */
void mt_rng_seed(mt_rng *r, uint64_t seed);
uint64_t mt_rng_u64(mt_rng *r);
double mt_rng_uniform(mt_rng *r);                       /* [0, 1) */
double mt_rng_normal(mt_rng *r);                        /* N(0, 1) */

/* Parameter initialization draws, the same bits on the CPU and on a GPU.
 * Element i of a parameter (or of one expert's slice) whose stream key is
 * `key` takes h = mt_init_bits(key, i) and maps it through the inverse CDF of
 * the normal truncated at 3 std, tabulated at MT_INIT_TABLE + 1 points
 * (mt_init_table) and linear in between. Every element is independent (any
 * order, any shard, any device), and the arithmetic rounds exactly once:
 * the table's neighbours differ by a double with <= 27 significant bits and the
 * fraction has 26, so d * f is exact and t0 + d * f (fused or not) rounds once. */
#define MT_INIT_TABLE_BITS 16
#define MT_INIT_TABLE (1 << MT_INIT_TABLE_BITS)
#if defined(__CUDACC__)
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif
void mt_init_table(float *t);   /* t[MT_INIT_TABLE + 1]: t[0] = -3, t[MT_INIT_TABLE / 2] = 0, t[MT_INIT_TABLE] = 3, odd */
static inline MT_HOST_DEVICE uint64_t mt_init_bits(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * 0x9e3779b97f4a7c15ull;    /* splitmix64's finalizer over a counter */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline MT_HOST_DEVICE double mt_init_draw(const float *t, uint64_t h) {   /* in [-3, 3] */
    uint64_t k = h >> (64 - MT_INIT_TABLE_BITS);                                    /* interval */
    double f = (double)((h >> (64 - MT_INIT_TABLE_BITS - 26)) & ((1u << 26) - 1)) * (1.0 / 67108864.0);
    double t0 = (double)t[k], d = (double)t[k + 1] - t0;
    return t0 + d * f;
}

/* A small fixed pool of worker threads. Work is split by index ranges that do
 * not depend on the thread count's timing, and every output element is
 * computed by exactly one thread in a fixed order, so results are bitwise
 * identical for any number of threads. */
typedef struct mt_pool mt_pool;
typedef void (*mt_pool_fn)(void *ctx, int64_t begin, int64_t end);
int mt_pool_create(mt_pool **p, int n_threads, mt_err *err);  /* n_threads <= 1: no threads */
void mt_pool_destroy(mt_pool *p);
void mt_pool_for(mt_pool *p, int64_t n, mt_pool_fn fn, void *ctx); /* fn over [0,n) in chunks */
int mt_pool_threads(const mt_pool *p);
double mt_now(void);                                    /* wall-clock seconds */

/* ========================================================================
 * 2. Config, presets, run hyper-parameters
 * ====================================================================== */

enum { MT_SCORE_SOFTMAX = 0, MT_SCORE_SIGMOID = 1 };

/* The DeepSeek-V3 family. Field names follow torchtitan's ModelArgs. */
typedef struct {
    int dim;                 /* model width D */
    int n_layers;            /* transformer blocks */
    int n_dense_layers;      /* the first n_dense_layers use a dense SwiGLU FFN, the rest MoE */
    int n_heads;             /* attention heads H */
    int q_lora_rank;         /* 0: q = x Wq; else q = norm(x Wqa) Wqb */
    int kv_lora_rank;        /* compressed kv width */
    int qk_nope_head_dim;    /* per-head q/k width without rotary */
    int qk_rope_head_dim;    /* per-head q/k rotary width (k's rotary part is shared by heads) */
    int v_head_dim;          /* per-head value width */
    int inter_dim;           /* dense FFN hidden width */
    int moe_inter_dim;       /* one expert's hidden width */
    int n_routed_experts;    /* E */
    int n_shared_experts;    /* shared expert hidden = n_shared_experts * moe_inter_dim */
    int top_k;               /* experts per token K */
    int score_func;          /* MT_SCORE_SOFTMAX | MT_SCORE_SIGMOID */
    int route_norm;          /* renormalise the top-k weights to sum 1 */
    float route_scale;       /* multiply routing weights */
    int n_expert_groups;     /* group-limited routing: experts split in groups ... */
    int n_limited_groups;    /* ... and each token may use experts of this many groups */
    float rope_theta;
    float rope_factor;       /* YaRN factor; applies when > 1 and seq_len > original_seq_len */
    float beta_fast, beta_slow;
    int original_seq_len;    /* YaRN: the context the model was trained at */
    float mscale;            /* YaRN attention-scale coefficient */
    int vocab_size;          /* V */
    int seq_len;             /* T */
    int batch;               /* B */
    int doc_mask;            /* 1: attention stays inside each packed document (block-causal) */
    int eot_id;              /* end-of-text token: a document starts after it; -1 = none */
    float norm_eps;
    float load_balance_coeff;/* auxiliary-loss-free bias step; 0 disables the update */
    int mtp_layers;          /* multi-token prediction depths D (HF num_nextn_predict_layers); 0: none */
    float mtp_weight;        /* lambda: loss = main + lambda * mean over the D depths of their losses */
} mt_config;

/* One table describes every config field: the CLI (--name value), the artifact,
 * checkpoint metadata and --dump all walk it. */
enum { MT_FIELD_INT = 0, MT_FIELD_FLOAT = 1 };
typedef struct { const char *name; int type; size_t offset; const char *help; } mt_field;
extern const mt_field mt_config_fields[];
extern const int mt_n_config_fields;

int mt_config_preset(mt_config *c, const char *name, mt_err *err); /* tiny | debug | mid | 16b */
const char *mt_config_preset_names(void);
int mt_config_set(mt_config *c, const char *key, const char *value, mt_err *err); /* one field */
int mt_config_validate(const mt_config *c, mt_err *err);
int mt_config_is_moe_layer(const mt_config *c, int layer);
int mt_config_yarn(const mt_config *c);   /* YaRN applies: rope_factor > 1 and seq_len > original_seq_len */
int mt_config_equal(const mt_config *a, const mt_config *b);
/* The fields where a and b differ, as "dim 64 vs 256, top_k 2 vs 3" in out; returns how many. */
int mt_config_diff(const mt_config *a, const mt_config *b, char *out, size_t n);
/* The candidate closest to word by edit distance ('-' and '_' alike), or NULL if none is close. */
const char *mt_suggest(const char *word, const char *const *candidates, int n);
int mt_config_has_field(const char *name);   /* a config field's name, '-' or '_' alike */
/* For a command line's unknown --name: the closest of its options and the config fields, written
 * with dashes into out; NULL if none is close. */
const char *mt_suggest_option(const char *name, const char *const *options, int n, char *out, size_t cap);

/* Run hyper-parameters. They are not part of the step graph's structure: they
 * are fed to it every step as the `hparams` input, so one artifact serves any
 * learning rate or schedule. */
typedef struct {
    float lr, min_lr_ratio;        /* peak learning rate; final = lr * min_lr_ratio */
    int warmup_steps, decay_steps; /* linear warmup, then cosine decay over decay_steps */
    float beta1, beta2, eps, weight_decay, grad_clip; /* AdamW; grad_clip <= 0: off */
} mt_hparams;
enum { MT_HP_LR, MT_HP_MIN_LR_RATIO, MT_HP_WARMUP, MT_HP_DECAY, MT_HP_BETA1, MT_HP_BETA2,
       MT_HP_EPS, MT_HP_WD, MT_HP_CLIP, MT_HP_COUNT = 16 };
void mt_hparams_default(mt_hparams *h);
/* Defaults for a model: the peak learning rate shrinks with width (3e-3 up to
 * dim 128, 8e-4 up to dim 512 as torchtitan's debug model, 4.2e-4 beyond). */
void mt_hparams_for_config(mt_hparams *h, const mt_config *c);
void mt_hparams_pack(const mt_hparams *h, float out[MT_HP_COUNT]);
double mt_lr_at(const float hp[MT_HP_COUNT], int step);  /* the schedule (also used by the graph) */

/* ========================================================================
 * 3. Mesh
 * World = dp_replicate x dp_shard x tp; expert parallelism borrows ep ranks
 * from dp_shard x tp. Ranks are numbered row-major over (dp_replicate,
 * dp_shard, tp). Within dp_shard x tp (flat index f = shard*tp + tp_coord),
 * a rank's EP coordinate is f % ep and its expert-data-parallel (edp)
 * coordinate f / ep: ranks with the same edp coordinate hold all experts
 * between them; ranks with the same ep coordinate hold the same experts.
 * ====================================================================== */

enum { MT_DIM_DP_REPLICATE = 0, MT_DIM_DP_SHARD = 1, MT_DIM_TP = 2, MT_DIM_EP = 3,
       MT_DIM_EDP = 4, MT_NDIMS = 5 };
#define MT_DIMBIT(d) (1u << (d))
typedef struct { int32_t size[MT_NDIMS]; } mt_mesh;   /* size[MT_DIM_EDP] is derived */
extern const char *const mt_dim_names[MT_NDIMS];

void mt_mesh_single(mt_mesh *m);                       /* 1 x 1 x 1, ep 1 */
int mt_mesh_init(mt_mesh *m, int dp_replicate, int dp_shard, int tp, int ep, mt_err *err);
int mt_mesh_world(const mt_mesh *m);
int mt_mesh_validate(const mt_mesh *m, const mt_config *c, mt_err *err);
void mt_mesh_coords(const mt_mesh *m, int rank, int coord[MT_NDIMS]);
/* Groups. A collective names a mask of mesh dimensions; rank's group along
 * it is the ranks that differ from it only along those dimensions. Masks
 * over ep/edp are read in the (dp_replicate, edp, ep) basis, the others in
 * (dp_replicate, dp_shard, tp); a mask may not mix dp_shard/tp with ep/edp.
 * Group order is mesh order (row-major over the masked dimensions). */
int mt_mesh_mask_valid(uint32_t mask);
int mt_mesh_group_size(const mt_mesh *m, uint32_t mask);
int mt_mesh_group(const mt_mesh *m, uint32_t mask, int rank, int *members); /* fills members, returns rank's index */
void mt_mesh_mask_name(uint32_t mask, char *out, size_t n);                 /* "dp_replicate+edp", "-" for 0 */
/* Do two masks split the world into the same groups, in the same order, for every rank? Then one
 * communicator serves both (the runtime shares it unless the nodes name different channels). */
int mt_mesh_groups_equal(const mt_mesh *m, uint32_t a, uint32_t b);

/* ========================================================================
 * 4. Graph IR
 * ====================================================================== */

/* dtypes. F32 is the master/statistics precision (mt_real on the CPU
 * backend); BF16 appears in CUDA-target graphs, and in any graph as AdamW
 * moments (mt_pass_bf16_moments); I32 for indices. */
enum { MT_F32 = 0, MT_BF16 = 1, MT_I32 = 2, MT_NDTYPES = 3 };

/* roles: where a value lives and who owns it. */
enum {
    MT_ROLE_PARAM = 0,   /* trainable or persistent model state (persistent region) */
    MT_ROLE_GRAD,        /* gradient of a param (arena: born in the backward as activations die) */
    MT_ROLE_OPT,         /* AdamW moments (persistent) */
    MT_ROLE_INPUT,       /* written by the host before each step (persistent) */
    MT_ROLE_CONST,       /* bytes stored in the artifact, uploaded at bind (persistent) */
    MT_ROLE_OUTPUT,      /* read by the host after each step (persistent) */
    MT_ROLE_ACT,         /* forward activation (arena) */
    MT_ROLE_AGRAD,       /* gradient of an activation (arena) */
    MT_ROLE_SCRATCH,     /* op workspace (arena) */
    MT_NROLES
};
#define MT_ROLE_IN_ARENA(r) ((r) >= MT_ROLE_ACT || (r) == MT_ROLE_GRAD)

/* queues: which stream a node runs on. */
enum { MT_Q_COMPUTE = 0, MT_Q_DP = 1, MT_Q_EP = 2, MT_NQUEUES = 3 };
extern const char *const mt_queue_names[MT_NQUEUES];

/* value flags */
enum {
    MT_VF_TRAINABLE = 1u << 0,  /* param with a gradient and AdamW state */
    MT_VF_DECAY = 1u << 1,      /* weight decay applies */
    MT_VF_EXPERTS = 1u << 2,    /* param stacked over local experts: dims[0] = E_local; name has '*' */
    MT_VF_COUNTS = 1u << 3,     /* output: tokens per expert of one MoE layer */
    MT_VF_GATHERED = 1u << 4,   /* a whole weight all-gathered from shards (or its gradient): storage padded */
    MT_VF_TP_ROWS = 1u << 5,    /* param split over tp along dim 0 (column-parallel): dims are this rank's rows */
    MT_VF_TP_COLS = 1u << 6,    /* param split over tp along dim 1 (row-parallel): dims are this rank's columns */
};
#define MT_VF_TP (MT_VF_TP_ROWS | MT_VF_TP_COLS)
enum { MT_INIT_NONE = 0, MT_INIT_ZERO, MT_INIT_ONE, MT_INIT_NORMAL };

/* Symbols: what a rank learns only at bind or run time. */
enum { MT_SYM_COORD = 0, MT_SYM_SIZE = 1 };
typedef struct {
    char name[32];
    int32_t kind;      /* MT_SYM_COORD: this rank's coordinate on mesh_dim; MT_SYM_SIZE: data-dependent */
    int32_t mesh_dim;  /* for COORD */
    int64_t max;       /* upper bound (COORD: size-1; SIZE: memory is planned at this bound) */
} mt_symbol;

#define MT_MAX_DIMS 4
#define MT_NAME_LEN 80
typedef struct {
    char name[MT_NAME_LEN];   /* unique; params use Hugging Face names ('*' = expert index) */
    int32_t dtype, role, ndim, init;
    uint32_t flags;
    uint32_t shard;           /* FSDP: mesh-dim mask of the S ranks sharing this tensor (0: whole). The value
                                 holds this rank's flat 1/S part, ceil(numel/S) elements; with MT_VF_GATHERED
                                 it holds the whole tensor, stored padded to S * ceil(numel/S) elements */
    int64_t dims[MT_MAX_DIMS];/* >= 0: literal; < 0: symbol -(dim+1); the logical shape, also for shards */
    float init_std;
    int32_t param;            /* GRAD/OPT: the param it belongs to; else -1 */
    int64_t offset;           /* byte offset in its region (persistent or arena); -1 = unplanned */
    int64_t nbytes;           /* bytes at the symbols' upper bounds */
    int64_t data_offset;      /* CONST: offset of its bytes in the constants blob; else -1 */
} mt_value;

#define MT_MAX_IN 10
#define MT_MAX_OUT 4
#define MT_MAX_ATTR 8
/* phases. RECOMPUTE: a forward op of a block re-run in the backward, just
 * before that block's backward, from the block's input (activation recompute). */
enum { MT_PHASE_FORWARD = 0, MT_PHASE_BACKWARD = 1, MT_PHASE_OPTIMIZER = 2, MT_PHASE_RECOMPUTE = 3 };
typedef struct {
    int32_t op, queue, phase, layer;   /* layer: -1 outside blocks */
    int32_t n_in, n_out;
    int32_t in[MT_MAX_IN];             /* value ids; -1 = absent optional input */
    int32_t out[MT_MAX_OUT];
    int32_t iattr[MT_MAX_ATTR];
    uint32_t sym_mask;                 /* bit i: iattr[i] is a symbol id, resolved at bind */
    float fattr[4];
} mt_node;

/* The op table. Each op has a CPU reference in section 8, a shape check,
 * and (for forward ops) a backward rule in section 5; the OP INDEX after the
 * table of contents names, for each, the functions that check, build,
 * differentiate, rewrite and run it.
 *   X(name, n_in, n_out, differentiable) */
#define MT_OPS(X)                                                                 \
    X(EMBED, 2, 1, 1)            /* tokens[N] i32, wte[V,D] -> x[N,D]; i2 > 1: wte my shard of S = i2 (i3 coord) */ \
    X(EMBED_BWD, 2, 1, 0)        /* dx[N,D], tokens -> dwte[V,D]; i2, i3 as EMBED's */ \
    X(RMSNORM, 2, 2, 1)          /* x[N,D], w[D] -> y[N,D], rstd[N] f32; f0 eps */\
    X(RMSNORM_BWD, 4, 2, 0)      /* dy, x, w, rstd -> dx, dw */                   \
    X(MATMUL, 2, 1, 1)           /* A, B -> C = op(A) op(B); i0 transA i1 transB */\
    X(SPLIT, 1, 2, 1)            /* x[N,a+b] -> x1[N,a], x2[N,b] */               \
    X(CONCAT, 2, 1, 1)           /* x1[N,a], x2[N,b] -> x[N,a+b]; i0 a */         \
    X(MLA_ROPE, 5, 3, 1)         /* q, kv, kpe, cos, sin -> Q, K, V */            \
    X(MLA_ROPE_BWD, 5, 3, 0)     /* dQ, dK, dV, cos, sin -> dq, dkv, dkpe */      \
    X(ATTENTION, 4, 2, 1)        /* Q, K, V, dstart (optional) -> O[N,H*dv], lse[N,H] f32 */ \
    X(ATTENTION_BWD, 7, 3, 0)    /* Q, K, V, O, lse, dO, dstart (optional) -> dQ, dK, dV */ \
    X(SWIGLU, 2, 1, 1)           /* g, u -> silu(g)*u */                          \
    X(SWIGLU_BWD, 3, 2, 0)       /* g, u, dh -> dg, du */                         \
    X(ADD, 2, 1, 1)              /* a, b -> a+b */                                \
    X(ROUTER, 2, 4, 1)           /* logits[N,E] f32, bias[E] -> idx, w, scores, counts */ \
    X(ROUTER_BWD, 4, 1, 0)       /* scores, idx, w, dw -> dlogits[N,E] */         \
    X(MOE_PERMUTE, 2, 3, 1)      /* x[N,D], idx[N,K] -> xs[nK,D], slot[nK], offs[E+1]: rows [i1, i1+n) (a chunk; n = N, i1 = 0: all); i0 E */ \
    X(MOE_PERMUTE_BWD, 2, 1, 0)  /* dxs, slot -> dx[N,D]: rows [i1, i1+n), the others 0; i0 K */ \
    X(EP_COUNTS, 1, 1, 0)        /* offs[E+1] -> recv[ep,E_local] i32 (all-to-all) */ \
    X(EP_DISPATCH, 3, 2, 1)      /* xs, offs, recv -> xr[R,D], roffs[E_local+1] (all-to-all-v) */ \
    X(EP_COMBINE, 3, 1, 1)       /* yr[R,D], offs, recv -> ys[NK,D] (reverse all-to-all-v) */ \
    X(GMM, 3, 1, 1)              /* X[R,K], W[E,M,K], offs[E+1] -> Y[R,M] = X_e W_e^T */ \
    X(GMM_DX, 3, 1, 0)           /* dY[R,M], W[E,M,K], offs -> dX[R,K] = dY_e W_e */ \
    X(GMM_DW, 3, 1, 0)           /* dY[R,M], X[R,K], offs -> dW[E,M,K] = dY_e^T X_e */ \
    X(MOE_COMBINE, 3, 1, 1)      /* ys[nK,D], slot[nK], w[N,K] -> y[N,D]: rows [i1, i1+n), the others 0 */ \
    X(MOE_COMBINE_BWD, 4, 2, 0)  /* dy, ys, slot, w -> dys, dw[N,K] (rows [i1, i1+n), the others 0) */ \
    X(CROSS_ENTROPY, 2, 2, 1)    /* logits[N,V], targets[N] -> loss[1] f32, lse[N] f32; i1 rows counted (0: N), f0 weight (0: 1) */ \
    X(CROSS_ENTROPY_BWD, 3, 1, 0)/* logits, lse, targets -> dlogits; i1, f0 as CROSS_ENTROPY's */ \
    X(SUMSQ, 2, 1, 0)            /* g, acc_in (optional) -> acc_out[1] f32; i0 1: g holds squares */ \
    X(ALLREDUCE, 1, 1, 0)        /* x -> x (in place); i0 mesh-dim mask, i1 group, i2 mean; f0 scale (0: none) */ \
    X(LR_SCHEDULE, 2, 1, 0)      /* hparams[16] f32, step[1] i32 -> lr[1] f32 */  \
    X(CLIP, 2, 2, 0)             /* sumsq[1], hparams -> coef[1], norm[1] */      \
    X(ADAMW, 8, 4, 0)            /* p, g, m, v (f32, or bf16: mt_pass_bf16_moments), lr, coef, hparams, step -> p, m, v, p_bf16 (optional) */ \
    X(EXPERT_BIAS_UPDATE, 2, 1, 0) /* bias[E], counts[E] i32 -> bias; f0 coeff */   \
    X(ADD_RMSNORM, 3, 3, 0)      /* fused: a, b, w -> h = a+b, y = rmsnorm(h), rstd; f0 eps */ \
    X(RMSNORM_BWD_ADD, 5, 2, 0)  /* fused: dy, x, w, rstd, acc -> acc + dx, dw */    \
    X(MATMUL_ACC, 3, 1, 0)       /* fused: A, B, acc -> acc + op(A) op(B) (GEMM epilogue) */ \
    X(GMM_DX2, 5, 1, 0)          /* fused: dY, W, offs, dY2, W2 -> dY_e W_e + dY2_e W2_e (one K loop) */ \
    X(GMM_DW_SQ, 3, 2, 0)        /* fused: dY, X, offs -> dW, ssq[mt_gmm_ssq_len] f32 partial sums of dW^2 */ \
    X(DOC_STARTS, 1, 1, 0)       /* tokens[N] i32 -> dstart[N] i32: where each token's document starts; i0 T, i1 eot */ \
    X(ALLGATHER, 1, 1, 1)        /* shard[ceil(n/S)] -> whole (padded); i0 mesh-dim mask, i1 group */ \
    X(REDUCE_SCATTER, 1, 1, 0)   /* whole f32 (padded) -> my shard of the sum; i0 mask, i1 group; f0 scale (0: none) */ \
    X(ROPE_PE, 4, 2, 0)          /* fold_rope: q, kpe, cos, sin -> qr[N,H*dr], kr[N,dr] (rotated rope parts); i as MLA_ROPE */ \
    X(MLA_ATTENTION, 5, 2, 0)    /* fold_rope: q, kv, qr, kr, dstart (optional) -> O, lse: ATTENTION of MLA_ROPE's Q, K, V; i0 H i1 dq i2 dv i3 T i4 dn */ \
    X(MLA_ATTENTION_BWD, 10, 3, 0) /* fold_rope: q, kv, qr, kr, O, lse, dO, dstart (optional), cos, sin -> dq, dkv, dkr[N,H*dr] */ \
    X(ROPE_PE_BWD, 3, 1, 0)      /* fold_rope: dkr, cos, sin -> dkpe[N,dr] (the heads' kr gradients rotated back and summed) */ \
    X(GMM_GLU, 4, 3, 0)          /* fused: X, Wg, offs, Wu -> g = X_e Wg_e^T, u = X_e Wu_e^T, h = silu(g) u (one launch) */ \
    X(SP_GATHER, 1, 1, 1)        /* x[n,D] (or [n]) -> y[n*S,D]: the group's rows in group order; i0 mesh-dim mask, i1 group */ \
    X(SP_SCATTER, 1, 1, 1)       /* x[n*S,D] -> y[n,D]: my rows of the group's sum; i0 mask, i1 group */ \
    X(CE_STATS, 2, 1, 0)         /* logits[N,Vl] (a vocab shard), targets[N] -> st[N,3] f32: max, sum exp(x - max), target logit; i0 coord (symbol) */ \
    X(CE_COMBINE, 3, 2, 1)       /* st[S*N,3] (every shard's), logits (for the backward), targets -> loss[1] f32, lse[N] f32; i1, f0 as CROSS_ENTROPY's */ \
    X(CE_SHARD_BWD, 3, 1, 0)     /* logits[N,Vl], lse[N], targets -> dlogits[N,Vl]; i0 coord (symbol); i1, f0 as CROSS_ENTROPY's */ \
    X(SHIFT_TOKENS, 1, 1, 0)     /* x[N] i32 -> y[N]: y[b*T+t] = x[b*T+t+k] where t+k < T, else fill; i0 T, i1 k, i2 fill */

enum {
#define MT_OP_ENUM(name, ni, no, d) MT_OP_##name,
    MT_OPS(MT_OP_ENUM)
#undef MT_OP_ENUM
    MT_NOPS
};
typedef struct { const char *name; int n_in, n_out, differentiable; } mt_op_info;
extern const mt_op_info mt_ops[MT_NOPS];

/* Well-known values of a graph, by slot. */
enum {
    MT_IO_TOKENS = 0,  /* input  [N] i32 */
    MT_IO_TARGETS,     /* input  [N] i32 */
    MT_IO_STEP,        /* input  [1] i32: 0-based optimizer step */
    MT_IO_HPARAMS,     /* input  [16] f32: mt_hparams_pack() */
    MT_IO_LOSS,        /* output [1] f32 */
    MT_IO_GRAD_NORM,   /* output [1] f32 (train graphs) */
    MT_IO_LR,          /* output [1] f32 (train graphs) */
    MT_IO_LOGITS,      /* output [N,V] (forward graphs) */
    MT_NIO
};

/* The compile target: which backend the plan is for. It is part of the
 * fingerprint; it names an architecture, never a device ordinal. */
enum { MT_BACKEND_CPU = 0, MT_BACKEND_CUDA = 1 };
typedef struct {
    int32_t backend;
    int32_t real_bytes;   /* CPU: sizeof(mt_real) of the build; CUDA: 4 */
    char arch[16];        /* "cpu" or e.g. "sm_90a" */
} mt_target;
void mt_target_cpu(mt_target *t);
void mt_target_cuda(mt_target *t, const char *arch);

enum { MT_GRAPH_TRAIN = 0, MT_GRAPH_FORWARD = 1 };

/* Tuning: what precompile chose once so that loading ranks never choose.
 * One entry per GEMM key the step runs (transposes, dtypes, N, K, bucket of
 * M): the cuBLASLt algorithm, opaque bytes. mt_tuning_info says which GPU
 * model (never an ordinal) the choices were made for; a rank on another
 * model re-derives them (or refuses, with binding.strict_tuning). */
#define MT_ALGO_WORDS 8
typedef struct { int32_t ta, tb, mb, n, k, at, bt, ct; uint64_t algo[MT_ALGO_WORDS]; } mt_tuning;
typedef struct {
    char device[64];       /* the GPU model's name; "" = the graph is not tuned */
    int32_t sm, n_sms;     /* compute capability (90 = 9.0) and multiprocessors: the grouped GEMM's split choice */
    int64_t blas_version;  /* cuBLASLt's version: its algorithms mean nothing to another */
} mt_tuning_info;
/* 0: choices made for `tuned` fit the device `here`; 1: they do not (why says how). */
int mt_tuning_mismatch(const mt_tuning_info *tuned, const mt_tuning_info *here, char *why, size_t n);
/* One recomputed block: its forward activations are not kept for the
 * backward but re-run (MT_PHASE_RECOMPUTE nodes) from the block's input. */
typedef struct {
    int32_t layer;
    int64_t saved_bytes;   /* activations of the block no longer held from its forward to its backward */
} mt_recompute;

typedef struct {
    mt_config cfg;
    mt_mesh mesh;
    mt_target target;
    int32_t kind;              /* MT_GRAPH_TRAIN | MT_GRAPH_FORWARD */
    mt_value *values; int n_values, cap_values;
    mt_node *nodes; int n_nodes, cap_nodes;
    mt_symbol *syms; int n_syms;
    uint8_t *consts; int64_t consts_bytes;
    mt_tuning_info tuned_for;
    mt_tuning *tuning; int n_tuning;
    int32_t io[MT_NIO];        /* value ids of the well-known values; -1 = absent */
    int32_t n_forward_nodes;   /* nodes [0, n_forward_nodes) are the forward */
    int64_t persist_bytes;     /* persistent region (params, grads, moments, io, consts) */
    int64_t arena_bytes;       /* activations and scratch, as planned */
    int64_t naive_arena_bytes; /* sum of all arena values: the plan's baseline */
    int32_t planned;           /* 0: naive (eager) layout, 1: liveness-planned */
    int32_t capture;           /* 1: replay the regions between host synchronizations as CUDA graphs */
    int32_t overlap;           /* 1: collectives run on their own queues (streams), fenced by events (mt_schedule) */
    mt_recompute *recompute; int32_t n_recompute;  /* recomputed blocks, by increasing layer */
    int64_t memory_budget;     /* bytes the plan was asked to fit (0: none) */
    int64_t peak_no_recompute; /* planned peak (persistent + arena) without recompute; 0 when not planned for a budget */
} mt_graph;

void mt_graph_free(mt_graph *g);
int mt_graph_copy(mt_graph *dst, const mt_graph *src, mt_err *err);   /* a deep copy */
int64_t mt_graph_peak_bytes(const mt_graph *g);                       /* planned peak: persistent + arena */
int64_t mt_dtype_bytes(const mt_graph *g, int dtype);
int64_t mt_value_numel_max(const mt_graph *g, const mt_value *v);  /* stored elements, symbols at their bounds */
int64_t mt_value_numel_logical(const mt_graph *g, const mt_value *v); /* elements of the logical shape */
int mt_graph_find(const mt_graph *g, const char *name);           /* value id or -1 */
int mt_check_node(const mt_graph *g, const mt_node *n, mt_err *err); /* arity + shapes */
/* GMM_DW_SQ's partial sums: 8 per 128 x 256 output tile of the grouped GEMM, at least 1024; in FP8
 * (mt_node_fp8), 8 per 128 x 128 tile of the FP8 kernel (mt_gmm_ssq_len_fp8) */
int64_t mt_gmm_ssq_len(int64_t E, int64_t M, int64_t K);
int64_t mt_gmm_ssq_len_fp8(int64_t E, int64_t M, int64_t K);

/* ========================================================================
 * 5. Builder
 * ====================================================================== */

/* Build a step graph: MT_GRAPH_TRAIN = forward + backward + gradient
 * reduction + clipping + AdamW + expert-bias update; MT_GRAPH_FORWARD =
 * forward with logits as an output. The memory layout is naive (eager). */
int mt_build(mt_graph *g, const mt_config *c, const mt_mesh *m, const mt_target *t,
             int kind, mt_err *err);
/* The same with each MoE layer's routed experts over `chunks` chunks of its tokens (mt_passes.moe_chunks). */
int mt_build_chunked(mt_graph *g, const mt_config *c, const mt_mesh *m, const mt_target *t,
                     int kind, int chunks, mt_err *err);

/* ========================================================================
 * 6. Passes
 * ====================================================================== */

void mt_plan_naive(mt_graph *g);                     /* eager: every value its own bytes */
int mt_pass_plan_memory(mt_graph *g, mt_err *err);   /* liveness-based arena reuse */
void mt_value_live_range(const mt_graph *g, int v, int *first, int *last);
typedef struct {
    int elide, fuse, plan_memory, capture, isolate_ep, overlap;   /* which optimizing passes run */
    int fold_rope;           /* CUDA graphs: MLA's RoPE assembly folded into the attention kernels (mt_pass_fold_rope) */
    int fuse_glu;            /* with fuse: the experts' gate and up GEMMs and their SwiGLU as one op (mt_pass_fuse_glu) */
    int64_t memory_budget;   /* bytes (persistent + arena, as planned); > 0: recompute the fewest blocks that fit it */
    int moments;             /* the AdamW moments' dtype: MT_F32 (mt_passes_all and _none), or MT_BF16 (mt_pass_bf16_moments) */
    int fp8;                 /* MT_FP8_ALL: the linear layers' GEMMs in FP8; MT_FP8_NO_WGRAD: their forward and input-gradient
                                GEMMs, the weight gradients in bf16 (mt_pass_fp8; neither mt_passes_all nor _none turns it on) */
    int moe_chunks;          /* mt_compile builds each MoE layer's routed experts over this many chunks of its tokens
                                (1: all at once, the default; 0 counts as 1; up to MT_MOE_CHUNKS_MAX): see mt__moe */
} mt_passes;
#define MT_MOE_CHUNKS_MAX 4
int mt_graph_moe_chunks(const mt_graph *g);          /* the chunks its MoE layers route in (1: whole), from its symbols */
int mt_pass_elide_collectives(mt_graph *g, mt_err *err); /* the expert exchange over one rank is a copy: gone */
int mt_pass_fuse(mt_graph *g, mt_err *err);          /* residual add + RMSNorm, forward and backward */
/* AdamW's two moments stored in bf16 (half their bytes); each ADAMW reads them into float, updates
 * in float and stores them rounded to nearest even (mt_adamw_bf16_elem). Changes numerics: a run
 * setting, not an optimization (mt_passes.moments; neither mt_passes_all nor _none turns it on).
 * Rounding to nearest keeps a moment only while a step moves it by more than half its bf16 ulp
 * (2^-9 to 2^-8 of it): beta2 = 0.95 (the default, DeepSeek-V3's) moves v by ~5% a step; with beta2 near
 * 0.999 many steps' (1 - beta2) g^2 would be rounded away. Before memory planning. Returns the
 * number of moment values changed, -1 on error. */
int mt_pass_bf16_moments(mt_graph *g, mt_err *err);
int mt_graph_moments(const mt_graph *g);             /* the AdamW moments' dtype: MT_F32 (also with none), MT_BF16 */
/* FP8 GEMMs, DeepSeek-V3's recipe (docs/FP8.md): the GEMMs of the linear layers, forward and both
 * backward ones, take e4m3 inputs with one fp32 scale per block, amax / 448: activations and
 * gradients per 1 x 128 tile along the GEMM's reduction axis (for a weight gradient that is the
 * token axis, 128 tokens of one expert), weights per 128 x 128 block. Products accumulate in fp32
 * (the CUDA kernels promote every 128 along K); outputs stay bf16 (weight gradients fp32); master
 * weights, gradient reductions and AdamW are untouched. The embedding, the output head, the router
 * and attention stay bf16, as do GEMMs whose sizes the FP8 kernels do not take (a reduction or
 * output width not a multiple of 16). The pass marks GEMM-family nodes (MATMUL, MATMUL_ACC, GMM,
 * GMM_DX, GMM_DW and what fusion makes of them) with iattr[MT_IATTR_FP8] = 1: CUDA runs them through
 * the FP8 kernels (moetrain_kernels.cu section 11), quantizing their inputs into scratch; the CPU
 * emulates them exactly as specified (quantize, dequantize, then its float GEMM), so the CPU graph is
 * the FP8 step's reference. Changes numerics: a run setting. Before fusion. Returns the number of
 * nodes marked, -1 on error. */
#define MT_IATTR_FP8 7
enum { MT_FP8_OFF = 0, MT_FP8_ALL = 1, MT_FP8_NO_WGRAD = 2 };   /* mt_passes.fp8, mt_pass_fp8's mode */
int mt_pass_fp8(mt_graph *g, int mode, mt_err *err);   /* MT_FP8_NO_WGRAD leaves the weight gradients' GEMMs bf16 */
int mt_node_fp8(const mt_node *n);                   /* a GEMM-family node marked by mt_pass_fp8 */
int mt_graph_fp8(const mt_graph *g);                 /* how many nodes run in FP8 (0: a bf16 step) */
int mt_graph_fp8_mode(const mt_graph *g);            /* MT_FP8_OFF, _ALL, or _NO_WGRAD (FP8 nodes, none a weight gradient) */
const char *mt_fp8_mode_name(int mode);              /* "bf16", "fp8", "fp8-bf16-wgrad" (checkpoints' mt.gemms) */
/* The routed experts' GMM (x, W_gate) -> g, GMM (x, W_up) -> u, SWIGLU (g, u) -> h become one GMM_GLU
 * (x, W_gate, offs, W_up) -> g, u, h: on CUDA one grouped GEMM whose tiles hold g's and u's same
 * columns, the SwiGLU in its epilogue; on the CPU the three ops in order. Bitwise the same results.
 * Returns the number of fusions, -1 on error. */
int mt_pass_fuse_glu(mt_graph *g, mt_err *err);
/* RoPE folded into attention: MLA_ROPE -> ATTENTION -> ATTENTION_BWD -> MLA_ROPE_BWD become ROPE_PE ->
 * MLA_ATTENTION -> MLA_ATTENTION_BWD -> ROPE_PE_BWD, which never form Q, K, V or their gradients (the
 * CUDA kernels load their tiles from q, kv and the rotated parts). Bitwise the same results. Any
 * target when called; mt_run_passes runs it on CUDA graphs whose head dims the folded kernels take
 * (mt_rope_fold_fits). Returns the number of attention layers folded, -1 on error. */
int mt_pass_fold_rope(mt_graph *g, mt_err *err);
static inline int mt_rope_fold_fits(int dn, int dr, int dv) {   /* the folded CUDA kernels' head dims */
    return dr == 64 && dv == 128 && (dn == 128 || dn == 64);
}
/* Collectives name a channel (iattr[1]); at bind, groups with the same ranks in the same order and
 * the same channel share one communicator. When the expert exchange's groups coincide with another
 * collective's (dp_shard = ep: FSDP and EP over the same ranks), this pass moves the exchange to
 * channel MT_CHANNEL_EP: a communicator of its own, so the all-to-alls never queue behind an
 * all-gather. Returns the number of nodes moved (0: nothing to isolate), -1 on error. */
enum { MT_CHANNEL_SHARED = 0, MT_CHANNEL_EP = 1 };
int mt_pass_isolate_ep(mt_graph *g, mt_err *err);
int mt_op_is_ep_exchange(int op);                    /* EP_COUNTS, EP_DISPATCH, EP_COMBINE */
/* Activation recompute (train graphs, before fusion): the n blocks in layers
 * keep only their input; their activations are re-run just before their
 * backward. The choice is recorded in g->recompute. */
int mt_pass_recompute(mt_graph *g, const int32_t *layers, int n, mt_err *err);
int mt_node_syncs_host(const mt_node *n);            /* needs data on the host before launching */
int mt_node_capturable(const mt_graph *g, const mt_node *n);  /* may replay inside a captured CUDA graph */
int mt_pass_overlap(mt_graph *g, mt_err *err);       /* reorder for overlap: FSDP prefetch, EP work ahead of the host sync */
void mt_passes_all(mt_passes *p);
void mt_passes_none(mt_passes *p);                   /* eager */
int mt_plan_check(const mt_graph *g, mt_err *err);   /* no two values alive at once share a byte (node order) */

/* Queues, events and the hazard rule (see the section comment in the
 * implementation). The schedule is derived from the node list alone, the same
 * on every rank: which stream each node runs on, and which nodes on other
 * streams it must wait for (CUDA events). */
typedef struct {
    int n_nodes;
    int32_t *queue;        /* [n_nodes] the stream a node runs on (MT_Q_*) */
    int32_t *wait_at;      /* [n_nodes+1] node i waits on wait[wait_at[i] .. wait_at[i+1]) */
    int32_t *wait;         /* node ids on other queues, each completed before node i starts */
    int32_t *after;        /* [n_nodes] the last compute node a node happens after (-1: the step's start) */
    int32_t *done;         /* [n_nodes] the first compute node that happens after it (n_nodes: the step's end) */
    int n_wait;
} mt_schedule;
int mt_node_queue(const mt_graph *g, const mt_node *n);   /* the stream it runs on: MT_Q_COMPUTE unless g->overlap */
int mt_schedule_build(const mt_graph *g, mt_schedule *s, mt_err *err);
void mt_schedule_free(mt_schedule *s);
/* Walk the nodes with their queues, waits and the memory plan, as if every
 * stream ran as far ahead as its waits allow: 0, or -1 naming the first hazard
 * (a read before its producer surely finished, a write while another stream
 * may still use the value, or bytes reused while another stream may still use
 * their old value). */
int mt_schedule_check(const mt_graph *g, const mt_schedule *s, mt_err *err);
int mt_run_passes(mt_graph *g, const mt_passes *p, mt_err *err);

/* One call: build + passes. This is what `precompile` and in-process compile do. */
int mt_compile(mt_graph *g, const mt_config *c, const mt_mesh *m, const mt_target *t,
               int kind, const mt_passes *p, mt_err *err);
/* Tune a CUDA graph once, on GPU `device` (CUDA builds): record in g->tuning the cuBLASLt algorithm of
 * every GEMM key its step runs and, in g->tuned_for, the GPU model (name, compute capability, SMs,
 * cuBLASLt version). Deterministic: the same model gives the same bytes, whichever ordinal. */
int mt_tune(mt_graph *g, int device, mt_err *err);

/* ========================================================================
 * 7. Artifact
 * ====================================================================== */

int mt_artifact_write(const mt_graph *g, uint8_t **bytes, size_t *len, mt_err *err);
int mt_artifact_save(const mt_graph *g, const char *path, mt_err *err);
int mt_artifact_read(mt_graph *g, const uint8_t *bytes, size_t len, mt_err *err);
int mt_artifact_load(mt_graph *g, const char *path, mt_err *err);
uint64_t mt_fingerprint(const mt_graph *g);          /* config, mesh, format, kernels, target, recompute, moments, MoE chunks */
void mt_graph_dump(const mt_graph *g, FILE *f);      /* the readable plan */
int mt_graph_dot(const mt_graph *g, const char *path, mt_err *err);   /* Graphviz: nodes by queue, edges by value */
int mt_read_file(const char *path, uint8_t **bytes, size_t *len, mt_err *err);

/* ========================================================================
 * 8. CPU reference ops (declared here so tests and the CUDA tests can call them)
 * ====================================================================== */

void mt_cpu_embed_forward(mt_real *x, const int32_t *tok, const mt_real *wte, int N, int D);
/* from elements [lo, lo + len) of the [V,D] table (an FSDP shard, wte[0] = element lo); -0.0 elsewhere */
void mt_cpu_embed_forward_range(mt_real *x, const int32_t *tok, const mt_real *wte, int N, int D, int64_t lo, int64_t len);
void mt_cpu_embed_backward(mt_real *dwte, const mt_real *dx, const int32_t *tok, int N, int V, int D);
/* elements [lo, lo + len) of the [V,D] gradient (row-major; past V*D: 0), summed in token order */
void mt_cpu_embed_backward_range(mt_real *dw, const mt_real *dx, const int32_t *tok, int N, int D, int64_t lo, int64_t len);
void mt_cpu_rmsnorm_forward(mt_real *y, mt_real *rstd, const mt_real *x, const mt_real *w,
                            int N, int D, float eps);
void mt_cpu_rmsnorm_backward(mt_real *dx, mt_real *dw, const mt_real *dy, const mt_real *x,
                             const mt_real *w, const mt_real *rstd, int N, int D);
void mt_cpu_matmul(mt_pool *pool, mt_real *C, const mt_real *A, const mt_real *B,
                   int M, int Nn, int K, int ta, int tb);  /* C[M,Nn] = op(A)[M,K] op(B)[K,Nn] */
void mt_cpu_split(mt_real *x1, mt_real *x2, const mt_real *x, int N, int a, int b);
void mt_cpu_concat(mt_real *x, const mt_real *x1, const mt_real *x2, int N, int a, int b);
void mt_cpu_rope_tables(mt_real *cosv, mt_real *sinv, const mt_config *c); /* [T, dr/2] each */
double mt_attention_scale(const mt_config *c);
void mt_cpu_mla_rope_forward(mt_real *Q, mt_real *K, mt_real *Vv, const mt_real *q, const mt_real *kv,
                             const mt_real *kpe, const mt_real *cosv, const mt_real *sinv,
                             int N, int T, int H, int dn, int dr, int dv);
void mt_cpu_mla_rope_backward(mt_real *dq, mt_real *dkv, mt_real *dkpe, const mt_real *dQ,
                              const mt_real *dK, const mt_real *dV, const mt_real *cosv,
                              const mt_real *sinv, int N, int T, int H, int dn, int dr, int dv);
/* RoPE folded into attention (mt_pass_fold_rope): qr [N,H*dr] and kr [N,dr] are the rotated rope
 * parts of Q and K; the attention ops assemble Q = [q's nope columns, qr], K = [kv's nope columns, kr],
 * V = kv's value columns as mt_cpu_mla_rope_forward does, and the backward returns q's and kv's
 * gradients and dkr [N,H*dr] (each head's gradient of kr), which ROPE_PE_BWD rotates back and sums
 * over the heads into dkpe. Bitwise the unfolded ops. The attention ones return -1 when out of memory. */
void mt_cpu_rope_pe_forward(mt_real *qr, mt_real *kr, const mt_real *q, const mt_real *kpe, const mt_real *cosv,
                            const mt_real *sinv, int N, int T, int H, int dn, int dr);
void mt_cpu_rope_pe_backward(mt_real *dkpe, const mt_real *dkr, const mt_real *cosv, const mt_real *sinv,
                             int N, int T, int H, int dr);
int mt_cpu_mla_attention_forward(mt_pool *pool, mt_real *O, mt_real *lse, const mt_real *q, const mt_real *kv,
                                 const mt_real *qr, const mt_real *kr, const int32_t *dstart, int B, int T, int H,
                                 int dn, int dr, int dv, float scale);
int mt_cpu_mla_attention_backward(mt_pool *pool, mt_real *dq, mt_real *dkv, mt_real *dkr, const mt_real *q,
                                  const mt_real *kv, const mt_real *qr, const mt_real *kr, const mt_real *O,
                                  const mt_real *lse, const mt_real *dO, const int32_t *dstart, const mt_real *cosv,
                                  const mt_real *sinv, int B, int T, int H, int dn, int dr, int dv, float scale);
/* Document masking: dstart[N] gives, for each token, the position (within its
 * sequence) where its document starts: a document starts at position 0 and
 * after every end-of-text token (which ends the document it is in). Query i
 * attends to keys j with dstart[i] <= j <= i. dstart NULL: plain causal. */
void mt_cpu_doc_starts(int32_t *dstart, const int32_t *tok, int N, int T, int eot);
void mt_cpu_attention_forward(mt_pool *pool, mt_real *O, mt_real *lse, const mt_real *Q,
                              const mt_real *K, const mt_real *Vv, const int32_t *dstart, int B,
                              int T, int H, int dq, int dv, float scale);
void mt_cpu_attention_backward(mt_pool *pool, mt_real *dQ, mt_real *dK, mt_real *dV,
                               const mt_real *Q, const mt_real *K, const mt_real *Vv,
                               const mt_real *O, const mt_real *lse, const mt_real *dO,
                               const int32_t *dstart, int B, int T, int H, int dq, int dv,
                               float scale);
void mt_cpu_swiglu_forward(mt_real *h, const mt_real *g, const mt_real *u, int64_t n);
void mt_cpu_swiglu_backward(mt_real *dg, mt_real *du, const mt_real *g, const mt_real *u,
                            const mt_real *dh, int64_t n);
void mt_cpu_add(mt_real *c, const mt_real *a, const mt_real *b, int64_t n);
void mt_cpu_add_rmsnorm_forward(mt_real *h, mt_real *y, mt_real *rstd, const mt_real *a, const mt_real *b, const mt_real *w,
                                int N, int D, float eps);   /* h = a + b; y, rstd = rmsnorm(h) */
void mt_cpu_rmsnorm_backward_add(mt_real *dx, mt_real *dw, const mt_real *dy, const mt_real *x, const mt_real *w,
                                 const mt_real *rstd, const mt_real *acc, int N, int D);   /* dx = acc + rmsnorm dx */
void mt_cpu_router_forward(int32_t *idx, mt_real *w, mt_real *scores, int32_t *counts,
                           const mt_real *logits, const mt_real *bias, int N, int E, int K,
                           int score_func, int route_norm, float route_scale, int n_groups,
                           int n_limited);
void mt_cpu_router_backward(mt_real *dlogits, const mt_real *scores, const int32_t *idx,
                            const mt_real *w, const mt_real *dw, int N, int E, int K,
                            int score_func, int route_norm, float route_scale);
int mt_cpu_moe_permute(mt_real *xs, int32_t *slot, int32_t *offs, const mt_real *x,
                       const int32_t *idx, int N, int D, int K, int E);
void mt_cpu_moe_permute_backward(mt_real *dx, const mt_real *dxs, const int32_t *slot, int N,
                                 int D, int K);
void mt_cpu_gmm(mt_pool *pool, mt_real *Y, const mt_real *X, const mt_real *W, const int32_t *offs,
                int E, int M, int K);                       /* Y_e = X_e W_e^T */
void mt_cpu_gmm_dx(mt_pool *pool, mt_real *dX, const mt_real *dY, const mt_real *W,
                   const int32_t *offs, int E, int M, int K); /* dX_e = dY_e W_e */
void mt_cpu_gmm_dx_add(mt_pool *pool, mt_real *dX, const mt_real *dY, const mt_real *W,
                       const int32_t *offs, int E, int M, int K); /* dX += dY_e W_e, as an ADD after GMM_DX */
void mt_cpu_gmm_dw(mt_pool *pool, mt_real *dW, const mt_real *dY, const mt_real *X,
                   const int32_t *offs, int E, int M, int K); /* dW_e = dY_e^T X_e */
/* FP8 (e4m3) quantization as the CUDA kernels do it, each value replaced by what it dequantizes to:
 * a block's scale s = amax / 448 (fp32), each x by e4m3(x / s) * s (round to nearest even, saturated
 * at 448; s = 0: zeros). mt_e4m3 rounds one value. rows: [R,C] in 1 x 128 tiles along each row;
 * cols: [R,C] in 128 x 1 tiles down each column, the rows grouped by offs[E+1] (NULL: one group),
 * each group's tiles starting at its first row; blocks: E matrices [N,K] in 128 x 128 blocks. In
 * place (y may be x). */
double mt_e4m3(double x);
void mt_cpu_fp8_rows(mt_real *y, const mt_real *x, int64_t R, int64_t C);
void mt_cpu_fp8_cols(mt_real *y, const mt_real *x, const int32_t *offs, int E, int64_t R, int64_t C);
void mt_cpu_fp8_blocks(mt_real *y, const mt_real *x, int64_t E, int64_t N, int64_t K);
void mt_cpu_moe_combine_forward(mt_real *y, const mt_real *ys, const int32_t *slot,
                                const mt_real *w, int N, int D, int K);
void mt_cpu_moe_combine_backward(mt_real *dys, mt_real *dw, const mt_real *dy, const mt_real *ys,
                                 const int32_t *slot, const mt_real *w, int N, int D, int K);
/* The loss: rows whose target is < 0 count nothing (their dlogits are 0); the mean divides by
 * count (<= 0: N), and the backward scales by `scale` (1/N for the plain mean; weight/count). */
void mt_cpu_cross_entropy_forward(mt_pool *pool, mt_real *loss, mt_real *lse,
                                  const mt_real *logits, const int32_t *tgt, int N, int V, int count);
void mt_cpu_cross_entropy_backward(mt_pool *pool, mt_real *dlogits, const mt_real *logits,
                                   const mt_real *lse, const int32_t *tgt, int N, int V, double scale);
/* The cross-entropy on vocab shards (tensor parallelism): logits [N,Vl] hold vocab entries
 * [v0, v0+Vl). Stats: st[n] = {max, sum exp(x - max), the target's logit or 0 when another shard
 * holds it}. Combine: S shards' stats [S,N,3] in shard order -> the mean loss and lse [N]. */
void mt_cpu_ce_stats(mt_real *st, const mt_real *logits, const int32_t *tgt, int N, int Vl, int v0);
void mt_cpu_ce_combine(mt_real *loss, mt_real *lse, const mt_real *st, const int32_t *tgt, int S, int N, int count);
void mt_cpu_ce_shard_backward(mt_real *dlogits, const mt_real *logits, const mt_real *lse, const int32_t *tgt,
                              int N, int Vl, int v0, double scale);
/* Multi-token prediction's inputs: y[b*T+t] = x[b*T+t+k] while t+k < T (the same sequence), else fill. */
void mt_cpu_shift_tokens(int32_t *y, const int32_t *x, int N, int T, int k, int fill);
void mt_cpu_adamw(mt_real *p, mt_real *m, mt_real *v, const mt_real *g, int64_t n, double lr,
                  double coef, const float hp[MT_HP_COUNT], int step, int decay);
/* AdamW with bf16 moments (m, v: bf16 bit patterns). The update is AdamW's, from the moments read
 * back as floats; the new moments are stored rounded to nearest even, and the weight update uses
 * them before that rounding. Float32 builds compute it in float with mt_adamw_bf16_elem, so the
 * CUDA kernels give the same bits; float64 builds compute it in double and round the moments to
 * bf16 straight from double (no float in between). */
void mt_cpu_adamw_bf16(mt_real *p, uint16_t *m, uint16_t *v, const mt_real *g, int64_t n, double lr,
                       double coef, const float hp[MT_HP_COUNT], int step, int decay);

/* bf16 bits: from a float rounded to nearest even (a NaN stays a quiet NaN), and back (exact). */
static inline MT_HOST_DEVICE uint16_t mt_bf16_round(float f) {
    uint32_t u;
#if defined(__CUDA_ARCH__)
    u = __float_as_uint(f);
#else
    memcpy(&u, &f, 4);
#endif
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline MT_HOST_DEVICE float mt_bf16_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float((uint32_t)h << 16);
#else
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}
/* Arithmetic rounded once per operation on both sides: CUDA would otherwise fuse a product and a
 * sum into one FMA (one rounding); the C builds (-std=c11: no contraction) round each already. */
static inline MT_HOST_DEVICE float mt__fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
static inline MT_HOST_DEVICE float mt__fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
static inline MT_HOST_DEVICE float mt__fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
static inline MT_HOST_DEVICE float mt__fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
static inline MT_HOST_DEVICE float mt__fsqrt(float a) {
#if defined(__CUDA_ARCH__)
    return __fsqrt_rn(a);
#else
    return sqrtf(a);
#endif
}
static inline MT_HOST_DEVICE double mt__dpowi(double x, int n) {   /* x^n, n >= 0, by squaring: the same products everywhere */
    double r = 1.0;
    for (; n > 0; n >>= 1) {
#if defined(__CUDA_ARCH__)
        if (n & 1) r = __dmul_rn(r, x);
        x = __dmul_rn(x, x);
#else
        if (n & 1) r = r * x;
        x = x * x;
#endif
    }
    return r;
}
/* One step's constants of AdamW with bf16 moments: bias corrections in double (powers by squaring,
 * correctly rounded sqrt and division), rounded to float once. */
typedef struct { float b1, b2, omb1, omb2, eps, keep, step_size, bc2s, coef; } mt_adamw_k;
static inline MT_HOST_DEVICE void mt_adamw_bf16_setup(mt_adamw_k *k, const float *hp, float lr, float coef, int step, int decay) {
    k->b1 = hp[MT_HP_BETA1]; k->b2 = hp[MT_HP_BETA2]; k->eps = hp[MT_HP_EPS]; k->coef = coef;
    k->omb1 = mt__fsub(1.0f, k->b1); k->omb2 = mt__fsub(1.0f, k->b2);
    k->keep = mt__fsub(1.0f, mt__fmul(lr, decay ? hp[MT_HP_WD] : 0.0f));   /* decoupled weight decay */
    double bc1 = 1.0 - mt__dpowi((double)k->b1, step + 1), bc2 = 1.0 - mt__dpowi((double)k->b2, step + 1);
    k->step_size = (float)((double)lr / bc1);
    k->bc2s = (float)sqrt(bc2);
}
/* One element: p's new value returned, *m and *v (bf16) updated. The order of operations is fixed:
 * g' = g coef; m' = b1 m + (1 - b1) g'; v' = b2 v + ((1 - b2) g') g'; p' = p keep - (step_size m') /
 * (sqrt(v') / bc2s + eps), then m = bf16(m'), v = bf16(v'). */
static inline MT_HOST_DEVICE float mt_adamw_bf16_elem(const mt_adamw_k *k, float p, float g, uint16_t *m, uint16_t *v) {
    float gi = mt__fmul(g, k->coef);
    float mi = mt__fadd(mt__fmul(k->b1, mt_bf16_float(*m)), mt__fmul(k->omb1, gi));
    float vi = mt__fadd(mt__fmul(k->b2, mt_bf16_float(*v)), mt__fmul(mt__fmul(k->omb2, gi), gi));
    *m = mt_bf16_round(mi); *v = mt_bf16_round(vi);
    float den = mt__fadd(mt__fdiv(mt__fsqrt(vi), k->bc2s), k->eps);
    return mt__fsub(mt__fmul(p, k->keep), mt__fdiv(mt__fmul(k->step_size, mi), den));
}
void mt_cpu_expert_bias_update(mt_real *bias, const int32_t *counts, int E, float coeff);

/* ========================================================================
 * 9. Collectives
 * A collective node names mesh dimensions, never a communicator; at bind each
 * rank resolves every (mask, group id) the graph uses to its group (section
 * 3) and to one communicator per group. Two engines with one semantics:
 *  - CPU ranks are threads of one process sharing an mt_world: each rank
 *    posts pointers to its buffers, and after a barrier reads its peers'
 *    directly. Sums run over the group in group order, in the same order on
 *    every rank, so replicas stay bitwise identical.
 *  - CUDA ranks are processes, one per GPU; NCCL communicators made with
 *    ncclCommSplit from one world communicator (color: the group, key: the
 *    position in it, so NCCL's order is mesh order).
 * A group of one rank is an identity (a scaled sum scales).
 * ====================================================================== */

/* The expert exchange's layout (section 9a), one function for the CUDA
 * device-side exchange and the tests (test_ep_layout holds it to the CPU
 * engine's order). M[s*E + j], E = P*El: the rows rank s routes to global
 * expert j, which lives on rank j / El. Rank me's source rows, in the order
 * it holds them, form chunks c = 0..C-1; chunk c is source rows
 * [src[c], src[c+1]) and lands at rows dst[c].. of peer mt_ep_chunk_peer(c):
 *  - dispatch (xs -> the owners' xr): C = E, chunk c is global expert c,
 *    peer c / El; an owner holds its rows expert-major and, inside an
 *    expert, in sender order.
 *  - combine (my yr -> the senders' ys): C = El*P, chunk c = e*P + s (my
 *    local expert e, sender s), peer s; rows go back where the sender's
 *    MOE_PERMUTE put them, from offs_s[me*El + e] = sum of M[s][j < me*El+e].
 * src has C+1 entries, dst C; O(P*E) work, no scratch. */
#if defined(__CUDACC__)
#define MT_HD __host__ __device__
#else
#define MT_HD
#endif
MT_HD static inline int mt_ep_chunk_peer(int dispatch, int c, int P, int El) { return dispatch ? c / El : c % P; }
MT_HD static inline void mt_ep_layout(const int32_t *M, int P, int El, int me, int dispatch, int32_t *src, int32_t *dst) {
    int E = P * El;
    int32_t at = 0;
    if (dispatch) {
        int32_t base = 0;                       /* on the owner: rows of its experts before this one */
        for (int j = 0; j < E; j++) {
            if (j % El == 0) base = 0;
            int32_t before = 0, all = 0;        /* senders before me for expert j; every sender */
            for (int s = 0; s < P; s++) { if (s == me) before = all; all += M[s * E + j]; }
            src[j] = at; at += M[me * E + j];
            dst[j] = base + before;
            base += all;
        }
        src[E] = at;
        return;
    }
    for (int s = 0; s < P; s++) {               /* e = 0: sender s's rows for my experts start after its rows for lower ranks' */
        int32_t off = 0;
        for (int j = 0; j < me * El; j++) off += M[s * E + j];
        dst[s] = off;
    }
    for (int e = 0; e < El; e++)
        for (int s = 0; s < P; s++) {
            int c = e * P + s;
            if (e) dst[c] = dst[c - P] + M[s * E + me * El + e - 1];
            src[c] = at; at += M[s * E + me * El + e];
        }
    src[El * P] = at;
}

typedef struct mt_world mt_world;   /* the shared state of CPU thread-ranks */
int mt_world_create(mt_world **w, int n_ranks, mt_err *err);
void mt_world_destroy(mt_world *w);
/* Mark rank as failed (first caller wins): every rank blocked in or entering a
 * collective returns an error naming it. */
void mt_world_fail(mt_world *w, int rank, const char *why);
int mt_world_failed(mt_world *w, char *why, size_t n);  /* the failed rank, or -1 */
/* Run fn(ctx, rank, world) on n thread-ranks sharing one world and join them.
 * A rank whose fn fails marks the world failed; the first failure is returned,
 * naming its rank. Thread-ranks on GPUs (one process, a GPU each): run with
 * CUDA_MODULE_LOADING=EAGER: lazy loading may make one rank's first launch of a
 * kernel wait for the process's GPUs to go idle while another rank's expert
 * exchange waits for that rank. */
typedef int (*mt_rank_fn)(void *ctx, int rank, mt_world *w, mt_err *err);
int mt_run_thread_ranks(int n, mt_rank_fn fn, void *ctx, mt_err *err);

/* ========================================================================
 * 10. Runtime
 * ====================================================================== */

#define MT_NCCL_ID_BYTES 128
typedef struct {
    int rank, world, local_rank;
    int coord[MT_NDIMS];
    int device;        /* CUDA device ordinal (the local rank); every launch, stream and allocation uses it */
    int n_threads;     /* CPU worker threads; 0 = number of cores */
    int poison;        /* fill the arena with NaN before each step (tests) */
    int profile;       /* time every node (synchronizing): mt_runtime_profile() */
    mt_world *cpu_world;                 /* CPU, world > 1: the world the thread-ranks share */
    uint8_t nccl_id[MT_NCCL_ID_BYTES];   /* CUDA, world > 1: NCCL's unique id, from rank 0 */
    int strict_tuning; /* CUDA: refuse a graph tuned for another GPU model instead of re-deriving its choices */
    int init_on_host;  /* CUDA: mt_runtime_init_params fills on the host and uploads (default: on the GPU in place, the same bits) */
    int nan_check;     /* stop at the first node that writes a NaN or Inf (scans every output: slow) */
    int attn_recompute_dq; /* CUDA: the attention backward recomputes S and dP for dQ instead of reading the dS
                              its dK/dV kernel stored (B*H*T^2 bytes less workspace: 0.5 GB for 2 x 4096, 16 heads; slower) */
    int one_launch_per_node; /* CUDA: no multi-tensor launches (runs of SUMSQ and of ADAMW nodes otherwise launch
                                together, bitwise the same; for comparisons) */
    int ep_exchange;   /* CUDA, ep > 1: MT_EXCHANGE_AUTO (device-side where the ep ranks are load/store accessible),
                          MT_EXCHANGE_HOST (host-synchronized NCCL), MT_EXCHANGE_DEVICE (device-side or refuse to bind) */
    double timeout_s;  /* CUDA: the longest a device-side wait for a peer lasts before the step fails (0: 600 s) */
    int fp8_requantize; /* CUDA, FP8: every node quantizes its own operands (no sharing between nodes: the same
                           bits, more passes; for comparisons) */
    int64_t fp8_adamw_min; /* CUDA, FP8: the fewest elements of a weight whose FP8 forms its AdamW writes
                              (0: MT_FP8_ADAMW_MIN); a smaller one is updated with the others in one
                              multi-tensor launch and quantized by its first reader */
} mt_binding;
/* A launch of its own per weight costs a small one more than it saves: debug's 50-odd weights took
 * ADAMW from 0.35 to 1.65 ms. 2^24: mid's experts and dense FFN; its attention and shared experts not. */
#define MT_FP8_ADAMW_MIN ((int64_t)1 << 24)
enum { MT_EXCHANGE_AUTO = 0, MT_EXCHANGE_HOST = 1, MT_EXCHANGE_DEVICE = 2 };
void mt_binding_single(mt_binding *b);   /* rank 0 of 1, device 0 */

typedef struct mt_runtime mt_runtime;
typedef struct {
    double loss, grad_norm, lr;   /* loss: the main (next-token) loss, without the MTP term */
    double mtp_loss;              /* mtp_layers > 0: the mean over the depths of their losses (mtp_loss.<k>); else 0 */
    double seconds;
} mt_step_stats;

int mt_runtime_create(mt_runtime **rt, const mt_graph *g, const mt_binding *b, mt_err *err);
void mt_runtime_destroy(mt_runtime *rt);
const mt_graph *mt_runtime_graph(const mt_runtime *rt);
int mt_runtime_init_params(mt_runtime *rt, uint64_t seed, mt_err *err); /* deterministic per param */
int mt_runtime_step(mt_runtime *rt, const int32_t *tokens, const int32_t *targets, int step,
                    const mt_hparams *hp, mt_step_stats *st, mt_err *err);
void *mt_runtime_value(mt_runtime *rt, int value_id);          /* its bytes (host on CPU, device on CUDA) */
int mt_runtime_read(mt_runtime *rt, int value_id, void *dst, mt_err *err);        /* all bytes to host */
int mt_runtime_write(mt_runtime *rt, int value_id, const void *src, mt_err *err); /* all bytes from host */
int mt_runtime_sync_shadows(mt_runtime *rt, mt_err *err);      /* bf16 compute copies from the f32 masters */
int mt_runtime_copy_params(mt_runtime *dst, mt_runtime *src, mt_err *err); /* by name */
int mt_runtime_expert_counts(mt_runtime *rt, int moe_index, int32_t *counts); /* E counts */
int mt_runtime_n_moe_layers(const mt_runtime *rt);
int64_t mt_runtime_multi_tensor_nodes(const mt_runtime *rt);   /* CUDA: nodes issued in multi-tensor launches so far */
int mt_runtime_backend(const mt_runtime *rt);                  /* MT_BACKEND_CPU or MT_BACKEND_CUDA */
/* With binding.profile: milliseconds and calls per op, summed over profiled steps. */
void mt_runtime_profile(const mt_runtime *rt, double ms[MT_NOPS], int64_t calls[MT_NOPS]);
/* CUDA, after profiled steps (timestamped by events on every stream, no synchronization between nodes): per
 * step, ms of the step, of compute, of communication (collectives and the expert exchange, each timed on
 * its own stream), and of communication the compute stream waited for (exposed). 0 without profiled steps. */
int mt_runtime_profile_comm(const mt_runtime *rt, double out[4]);
/* CUDA, after profiled steps: the (at most k) nodes on other streams the compute stream waited for longest,
 * longest first, and those waits in ms per step; returns how many. */
int mt_runtime_profile_waits(const mt_runtime *rt, int k, int32_t *node, double *ms);
void mt_runtime_set_profile(mt_runtime *rt, int on);
void mt_runtime_set_nan_check(mt_runtime *rt, int on);         /* see mt_binding.nan_check */
size_t mt_runtime_peak_bytes(const mt_runtime *rt);            /* device (or host) memory of the plan at peak */
int mt_runtime_fp8_shared(const mt_runtime *rt);               /* CUDA, FP8: operands quantized once for several nodes */
int mt_runtime_fp8_both(const mt_runtime *rt);                 /* CUDA, FP8: of those, activations whose rows and columns one read makes */
int mt_runtime_fp8_by_optimizer(const mt_runtime *rt);         /* CUDA, FP8: weights whose FP8 forms AdamW writes */
int mt_runtime_fp8_by_swiglu(const mt_runtime *rt);            /* CUDA, FP8: activations whose forms their SwiGLU writes */
int mt_runtime_fp8_by_moe(const mt_runtime *rt);               /* ... the MoE permutation or the combine's backward writes */
/* Host numbers across every rank of the world (logging): op 0 sum, 1 max. */
int mt_runtime_allreduce_host(mt_runtime *rt, double *x, int n, int op, mt_err *err);
/* Host synchronizations in the last step (the expert exchange's counts) and
 * the rows this rank's experts received in its forward (over all MoE layers). */
int mt_runtime_host_syncs(const mt_runtime *rt);
int64_t mt_runtime_received_rows(const mt_runtime *rt);
/* The expert exchange this rank runs: "device-side ..." or "host-synchronized NCCL ..." with the reason;
 * "" without an exchange over several ranks. And whether the step replays as one captured CUDA graph. */
const char *mt_runtime_exchange(const mt_runtime *rt);
int mt_runtime_whole_step_graph(const mt_runtime *rt);
int mt_runtime_n_communicators(const mt_runtime *rt);   /* made at bind: one per distinct rank group and channel */
/* Devices. Everything device-bound (constants, initial state, buffers, streams, handles, tuning) is
 * materialized at bind on the binding's device (CPU: a virtual device id), never on "the current
 * device". This checks that every value's bytes lie in this rank's own memory on its device. */
int mt_runtime_check_devices(const mt_runtime *rt, mt_err *err);
/* Tuning at bind: how the graph's tuning applied ("" when it did: the rank chose nothing itself), and
 * a digest of the kernels this rank runs with the count of choices preset vs made here (CUDA). */
const char *mt_runtime_tuning_note(const mt_runtime *rt);
uint64_t mt_runtime_kernel_digest(mt_runtime *rt, int *preset, int *derived);
/* After a failure elsewhere: make this rank's pending and future collectives
 * return (NCCL: ncclCommAbort). Safe to call from another thread. */
void mt_runtime_abort(mt_runtime *rt);
int mt_runtime_comm_error(mt_runtime *rt, mt_err *err);   /* an asynchronous communicator error, if any */

/* CUDA launchers (moetrain_kernels.cu). Declared when the build defines
 * MT_CUDA; each mirrors the CPU reference op of section 8 with device
 * pointers; "bf16" arguments are __nv_bfloat16 arrays. All run on the
 * context's stream and return 0, or -1 with mt_cuda_error() set. */
#ifdef MT_CUDA
typedef struct mt_cuda mt_cuda;
int mt_cuda_device_count(void);
int mt_cuda_create(mt_cuda **c, int device, mt_err *err);
void mt_cuda_destroy(mt_cuda *c);
const char *mt_cuda_error(const mt_cuda *c);
int mt_cuda_describe(char *out, int n);
int mt_cuda_malloc(mt_cuda *c, void **p, size_t n);
void mt_cuda_free(mt_cuda *c, void *p);
int mt_cuda_copy(mt_cuda *c, void *dst, const void *src, size_t n, int kind); /* 0 h2d, 1 d2h, 2 d2d */
int mt_cuda_memset(mt_cuda *c, void *p, int byte, size_t n);
int mt_cuda_sync(mt_cuda *c);
int mt_cuda_check_flag(mt_cuda *c);     /* data errors kernels flagged (bad expert index...), then clears */
#define MT_CUDA_FLAG_BOUND 2                 /* flag values: 1 an expert index out of range, 2 more rows than planned, */
#define MT_CUDA_FLAG_PEER 0x10000            /* MT_CUDA_FLAG_PEER + i: ep peer i did not answer within the timeout */
int mt_cuda_events(mt_cuda *c, int n);  /* make n timing events */
int mt_cuda_set_queue(mt_cuda *c, int q);   /* later launches go to queue q's stream (MT_Q_*; DP, EP: high priority) */
int mt_cuda_queue_events(mt_cuda *c, int n);/* make n ordering events (one per graph node) */
int mt_cuda_queue_record(mt_cuda *c, int i);/* record ordering event i on the current stream */
int mt_cuda_queue_wait(mt_cuda *c, int i);  /* the current stream waits for ordering event i */
int mt_cuda_capture_begin(mt_cuda *c);  /* start recording the stream into a graph */
int mt_cuda_capture_end(mt_cuda *c, void **graph);   /* stop; instantiate into *graph (NULL: discard) */
int mt_cuda_graph_launch(mt_cuda *c, void *graph);
void mt_cuda_graph_destroy(void *graph);
int mt_cuda_event_record(mt_cuda *c, int i);
float mt_cuda_event_ms(mt_cuda *c, int i, int j);   /* after a sync */
size_t mt_cuda_peak_bytes(mt_cuda *c);   /* device memory in use at the high-water mark */
int mt_cuda_cast(mt_cuda *c, void *dst, int dst_dtype, const void *src, int src_dtype, int64_t n);
/* Fill an f32 parameter on the device (see mt_init_draw): dst[k] for k < stored holds logical element
 * lo + k of a tensor of n elements in chunks of `per` (one per expert); elements past n are 0.
 * init: MT_INIT_ZERO, MT_INIT_ONE or MT_INIT_NORMAL (keys[chunk - first_chunk] per chunk, table on
 * the device, times std). */
int mt_cuda_init_fill(mt_cuda *c, float *dst, int64_t stored, int64_t lo, int64_t n, int64_t per, int init,
                      const uint64_t *keys, int64_t first_chunk, const float *table, float std);
size_t mt_cuda_embed_backward_workspace(int N, int D);
int mt_cuda_embed_forward(mt_cuda *c, void *x, const int32_t *tok, const void *wte, int N, int D);
/* from elements [lo, lo + len) of the [V,D] table (an FSDP shard, wte's first element is lo); -0.0 elsewhere */
int mt_cuda_embed_forward_range(mt_cuda *c, void *x, const int32_t *tok, const void *wte, int N, int D, long long lo, long long len);
int mt_cuda_embed_backward(mt_cuda *c, float *dwte, const void *dx, const int32_t *tok, int N, int V, int D, void *ws);
/* elements [lo, lo + len) of the [V,D] gradient (an FSDP shard; past V*D: 0): the same sums as the whole one's */
int mt_cuda_embed_backward_range(mt_cuda *c, float *dw, const void *dx, const int32_t *tok, int N, int V, int D,
                                 long long lo, long long len, void *ws);
size_t mt_cuda_rmsnorm_backward_workspace(int N, int D);
int mt_cuda_rmsnorm_forward(mt_cuda *c, void *y, float *rstd, const void *x, const float *w, int N, int D, float eps);
int mt_cuda_rmsnorm_backward(mt_cuda *c, void *dx, float *dw, const void *dy, const void *x, const float *w,
                             const float *rstd, int N, int D, void *ws);
int mt_cuda_add_rmsnorm_forward(mt_cuda *c, void *h, void *y, float *rstd, const void *a, const void *b, const float *w, int N,
                                int D, float eps);
int mt_cuda_rmsnorm_backward_add(mt_cuda *c, void *dx, float *dw, const void *dy, const void *x, const float *w,
                                 const float *rstd, const void *acc, int N, int D, void *ws);
size_t mt_cuda_matmul_workspace(int M, int N, int K, int ct, int at, int bt);
int mt_cuda_matmul(mt_cuda *c, void *C, int ct, const void *A, int at, const void *B, int bt, int M, int N, int K,
                   int ta, int tb, void *ws, const void *acc);   /* acc: optional, C = acc + op(A) op(B) */
int mt_cuda_split(mt_cuda *c, void *x1, void *x2, const void *x, int N, int a, int b, int esz);
int mt_cuda_concat(mt_cuda *c, void *x, const void *x1, const void *x2, int N, int a, int b, int esz);
int mt_cuda_mla_rope_forward(mt_cuda *c, void *Q, void *K, void *V, const void *q, const void *kv, const void *kpe,
                             const float *cosv, const float *sinv, int N, int T, int H, int dn, int dr, int dv);
int mt_cuda_mla_rope_backward(mt_cuda *c, void *dq, void *dkv, void *dkpe, const void *dQ, const void *dK,
                              const void *dV, const float *cosv, const float *sinv, int N, int T, int H, int dn, int dr, int dv);
/* the attention backward's workspace: D, and the dS^T tiles that dQ is formed from (unless
 * mt_cuda_set_attn_recompute_dq: dQ recomputes S and dP, B*H*T^2 bytes less, slower) */
size_t mt_cuda_attention_backward_workspace(const mt_cuda *c, int B, int T, int H, int dq, int dv);
void mt_cuda_set_attn_recompute_dq(mt_cuda *c, int on);
int mt_cuda_rope_pe_forward(mt_cuda *c, void *qr, void *kr, const void *q, const void *kpe, const float *cosv, const float *sinv,
                            int N, int T, int H, int dn, int dr);
int mt_cuda_rope_pe_backward(mt_cuda *c, void *dkpe, const void *dkr, const float *cosv, const float *sinv, int N, int T, int H, int dr);
int mt_cuda_mla_attention_forward(mt_cuda *c, const void *q, const void *kv, const void *qr, const void *kr, const int32_t *dstart,
                                  void *O, float *lse, int B, int T, int H, int dn, int dr, int dv, float scale);
int mt_cuda_mla_attention_backward(mt_cuda *c, const void *q, const void *kv, const void *qr, const void *kr, const void *O,
                                   const float *lse, const void *dO, const int32_t *dstart, const float *cosv, const float *sinv,
                                   void *dq, void *dkv, void *dkr, void *ws, int B, int T, int H, int dn, int dr, int dv, float scale);
int mt_cuda_doc_starts(mt_cuda *c, int32_t *dstart, const int32_t *tok, int N, int T, int eot);
int mt_cuda_attention_forward(mt_cuda *c, const void *Q, const void *K, const void *V, const int32_t *dstart, void *O,
                              float *lse, int B, int T, int H, int dq, int dv, float scale);  /* dstart NULL: causal */
int mt_cuda_attention_backward(mt_cuda *c, const void *Q, const void *K, const void *V, const void *O, const float *lse,
                               const void *dO, const int32_t *dstart, void *dQ, void *dK, void *dV, void *ws, int B, int T,
                               int H, int dq, int dv, float scale);
/* rows (may be NULL): a device count; only its first *rows rows of cols elements are computed (n: the bound) */
int mt_cuda_swiglu_forward(mt_cuda *c, void *h, const void *g, const void *u, int64_t n, const int32_t *rows, int64_t cols);
int mt_cuda_swiglu_backward(mt_cuda *c, void *dg, void *du, const void *g, const void *u, const void *dh, int64_t n,
                            const int32_t *rows, int64_t cols);
int mt_cuda_add(mt_cuda *c, void *out, const void *a, const void *b, int64_t n, int dtype);
int mt_cuda_router_forward(mt_cuda *c, int32_t *idx, float *w, float *scores, int32_t *counts, const float *logits,
                           const float *bias, int N, int E, int K, int score_func, int route_norm, float route_scale,
                           int n_groups, int n_limited);
int mt_cuda_router_backward(mt_cuda *c, float *dlogits, const float *scores, const int32_t *idx, const float *dw, int N,
                            int E, int K, int score_func, int route_norm, float route_scale);
size_t mt_cuda_moe_permute_workspace(int64_t NK);
int mt_cuda_moe_permute(mt_cuda *c, void *xs, int32_t *slot, int32_t *offs, const void *x, const int32_t *idx, int N,
                        int D, int K, int E, void *ws);
int mt_cuda_moe_permute_backward(mt_cuda *c, void *dx, const void *dxs, const int32_t *slot, int N, int D, int K);
int mt_cuda_ep_counts(mt_cuda *c, int32_t *recv, const int32_t *offs, int E_local, int first_expert);
int mt_cuda_ep_offsets(mt_cuda *c, int32_t *roffs, const int32_t *recv, int E_local);
size_t mt_cuda_gmm_workspace(mt_cuda *c, int mode, int E, int M, int K, int Rmax);   /* split choice: c's tuned SM count */
/* Device hoisting and tuning: the binding's device made current; where a pointer lives; the GPU model;
 * cuBLASLt choices made, preset from a graph's tuning, and digested for comparison across ranks. */
int mt_cuda_use(mt_cuda *c);
int mt_cuda_device_of(mt_cuda *c, const void *p, int *device);
int mt_cuda_device_info(mt_cuda *c, mt_tuning_info *t);
void mt_cuda_set_split_sms(mt_cuda *c, int n);
int mt_cuda_gemm_choose(mt_cuda *c, mt_tuning *t, int M);
int mt_cuda_gemm_preset(mt_cuda *c, const mt_tuning *t, int n);
uint64_t mt_cuda_gemm_digest(mt_cuda *c, int *preset, int *derived);
int mt_cuda_gmm(mt_cuda *c, int mode, void *out, const void *a, const void *b, const int32_t *d_offs, int E, int M, int K,
                int Rmax, void *ws, const void *a2, const void *b2, float *ssq, int64_t ssq_len);
                /* mode 0: Y=X W^T, 1: dX = dY W, 2: dW = dY^T X (f32 out); offsets on the device; mode 1 with
                   a2, b2: dX = dY W + a2 b2; mode 2 with ssq: partial sums of dW^2 (mt_gmm_ssq_len entries) */
int mt_cuda_gmm_glu(mt_cuda *c, void *g, void *u, void *h, const void *x, const void *wg, const void *wu, const int32_t *d_offs,
                    int E, int M, int K, int Rmax);
                /* gate and up in one launch: g = X Wg^T, u = X Wu^T, h = silu(g) u (h may be NULL) */
/* FP8 GEMMs (section 11 of moetrain_kernels.cu; layouts, bounds and kernels in docs/FP8.md). Quantizers from
 * bf16: rows: x [R][C] -> q [R][C], scale of row r's block kb at s[kb * R + r]; cols: x [R][C], rows grouped by
 * d_offs (NULL: one group) -> qt [C][Lp], each group's 128-token blocks padded with zero codes (Lp >=
 * mt_cuda_fp8_tpad(R, E)); weight: w [E][N][K] -> q [E][N][K] (transpose 0) or its transpose [E][K][N], one
 * scale per 128 x 128 block (quant_weight2: either or both, qt and st the transpose's, from one read; NULL: not
 * that form). Dense: out[Mr][Nc] (bf16, or fp32) = A[Mr][:K] . B[Nc][:K] through cuBLASLt's
 * block-scaled FP8 (b_blk: B weight-quantized, else rows-quantized). Grouped: mode 0 Y [Rmax][M] = X W^T
 * (a = X rows, b = W), 1 dX [Rmax][K] = dY W (a = dY rows, b = W transposed), 2 dW [E][M][K] fp32 (a = dY
 * cols [M][Lp], b = X cols [K][Lp]); variant: which kernel (docs/FP8.md); the graph pass runs MT_FP8_GMM_KERNEL,
 * k_gmm_fast with 128 x 256 tiles (128 x 128 for dW), the fastest measured on an H200. */
#define MT_FP8_GMM_KERNEL 4
long long mt_cuda_fp8_tpad(int Rmax, int E);
int mt_cuda_fp8_quant_rows(mt_cuda *c, uint8_t *q, float *s, const void *x, int R, int C);
int mt_cuda_fp8_quant_cols(mt_cuda *c, uint8_t *qt, float *st, const void *x, const int32_t *d_offs, int E, int R, int C, long long Lp);
/* cols and rows from one read: quant_cols' (qt, st) and, for the rows of the groups' 128-row chunks, quant_rows' (q, s)
   over Rq >= R rows (C a multiple of 16) */
int mt_cuda_fp8_quant_both(mt_cuda *c, uint8_t *q, float *s, int Rq, uint8_t *qt, float *st, const void *x, const int32_t *d_offs, int E,
                           int R, int C, long long Lp);
/* quant_both of what a SwiGLU kernel would write, without writing it: dh NULL, h = SwiGLU(g, u) into (q, s, qt, st);
   else its backward from g, u and dh, dgate's forms into (q, s, qt, st) and dup's into (q2, s2, qt2, st2). The bits of
   mt_cuda_swiglu_forward / _backward then quant_both (without groups: Rq = R) */
int mt_cuda_fp8_quant_swiglu(mt_cuda *c, uint8_t *q, float *s, uint8_t *qt, float *st, uint8_t *q2, float *s2, uint8_t *qt2, float *st2,
                             const void *g, const void *u, const void *dh, const int32_t *d_offs, int E, int R, int C, long long Lp, int Rq);
/* quant_both of rows gathered by map: row r is row map[r] / topk of x, times w[map[r]] rounded to bf16 where w is given */
int mt_cuda_fp8_quant_gather(mt_cuda *c, uint8_t *q, float *s, int Rq, uint8_t *qt, float *st, const void *x, const int32_t *map,
                             const float *w, int topk, const int32_t *d_offs, int E, int R, int C, long long Lp);
/* mt_cuda_moe_permute writing xs's two forms (quant_both over Rq rows, columns Lp long) in place of xs; and
   mt_cuda_moe_combine_backward writing dys's forms in place of dys (map: N K ints of scratch). The same bits as the
   plain kernel then mt_cuda_fp8_quant_both. */
int mt_cuda_moe_permute_fp8(mt_cuda *c, int32_t *slot, int32_t *offs, const void *x, const int32_t *idx, int N, int D, int K, int E,
                            void *ws, uint8_t *q, float *s, int Rq, uint8_t *qt, float *st, long long Lp);
int mt_cuda_moe_combine_backward_fp8(mt_cuda *c, float *dw, const void *dy, const void *ys, const int32_t *slot, const float *w, int N,
                                     int D, int K, int32_t *map, uint8_t *q, float *s, int Rq, uint8_t *qt, float *st,
                                     const int32_t *d_offs, int E, long long Lp);
int mt_cuda_fp8_quant_weight(mt_cuda *c, uint8_t *q, float *s, const void *w, int E, int N, int K, int transpose);
/* both forms from one read; skip: where given and *skip != 0 on the device, nothing is done (the forms are there) */
int mt_cuda_fp8_quant_weight2(mt_cuda *c, uint8_t *q, float *s, uint8_t *qt, float *st, const void *w, int E, int N, int K,
                              const int *skip);
/* AdamW (fp32 or bf16 moments, as mt_cuda_adamw / _bf16, the same bits) on a weight p [E][N][K] that also writes
   its bf16 value's FP8 forms, W to (q, s) and W^T to (qt, st) (either NULL: not that form), as quant_weight2 would
   from p_bf16 (which may be NULL: not written); then *fresh = 1 */
int mt_cuda_adamw_fp8(mt_cuda *c, float *p, void *m, void *v, int bf16_moments, void *p_bf16, const float *g, int E, int N, int K,
                      const float *lr, const float *coef, const float *hp, const int32_t *step, int decay, uint8_t *q, float *s,
                      uint8_t *qt, float *st, int *fresh);
int mt_cuda_fp8_gemm(mt_cuda *c, void *out, int out_f32, const uint8_t *a, const float *sa, int lda, const uint8_t *b,
                     const float *sb, int b_blk, int ldb, int Mr, int Nc, int K);
int mt_cuda_fp8_gmm(mt_cuda *c, int mode, void *out, const uint8_t *a, const float *sa, const uint8_t *b, const float *sb,
                    const int32_t *d_offs, int E, int M, int K, int Rmax, long long Lp, int variant);
/* modes 0/1 with a second pair in the same fp32 accumulators, one rounding: out = a b + a2 b2 (GMM_DX2); ctas as
   mt_cuda_fp8_gmm_ctas's (0: one CTA a multiprocessor) */
int mt_cuda_fp8_gmm2(mt_cuda *c, int mode, void *out, const uint8_t *a, const float *sa, const uint8_t *b, const float *sb,
                     const uint8_t *a2, const float *sa2, const uint8_t *b2, const float *sb2, const int32_t *d_offs, int E, int M,
                     int K, int Rmax, int variant, int ctas);
/* mode 2 (dW) with ssq (or NULL): the partial sums of dW^2 that GMM_DW_SQ's SUMSQ adds up, ssq_len >=
   mt_gmm_ssq_len_fp8 entries: the fast kernels (variants 3-5) sum each warp's part of each tile while it is
   in registers (8 a 128 x 128 tile, the rest zero), the others in a pass over dW after it; ctas as _ctas */
int mt_cuda_fp8_gmm_dw(mt_cuda *c, void *out, const uint8_t *a, const float *sa, const uint8_t *b, const float *sb, const int32_t *d_offs,
                       int E, int M, int K, int Rmax, long long Lp, int variant, int ctas, float *ssq, int64_t ssq_len);
int mt_cuda_moe_combine_forward(mt_cuda *c, void *y, const void *ys, const int32_t *slot, const float *w, int N, int D, int K);
int mt_cuda_moe_combine_backward(mt_cuda *c, void *dys, float *dw, const void *dy, const void *ys, const int32_t *slot,
                                 const float *w, int N, int D, int K);
size_t mt_cuda_cross_entropy_workspace(int N);
/* targets < 0 count nothing; count: the rows the mean divides by; inv: the backward's scale (1.0f / N for the plain mean) */
int mt_cuda_cross_entropy_forward(mt_cuda *c, float *loss, float *lse, const void *logits, const int32_t *tgt, int N, int V, int count, void *ws);
int mt_cuda_cross_entropy_backward(mt_cuda *c, void *dlogits, const void *logits, const float *lse, const int32_t *tgt, int N, int V, float inv);
/* The cross-entropy on vocab shards (tensor parallelism; see mt_cpu_ce_stats): logits [N,Vl] bf16 hold entries [v0, v0+Vl). */
int mt_cuda_ce_stats(mt_cuda *c, float *st, const void *logits, const int32_t *tgt, int N, int Vl, int v0);
int mt_cuda_ce_combine(mt_cuda *c, float *loss, float *lse, const float *st, const int32_t *tgt, int S, int N, int count,
                       void *ws);   /* ws: mt_cuda_cross_entropy_workspace(N) */
int mt_cuda_ce_shard_backward(mt_cuda *c, void *dlogits, const void *logits, const float *lse, const int32_t *tgt, int N, int Vl, int v0,
                              float inv);
int mt_cuda_shift_tokens(mt_cuda *c, int32_t *y, const int32_t *x, int N, int T, int k, int fill);   /* see mt_cpu_shift_tokens */
size_t mt_cuda_sumsq_workspace(void);
int mt_cuda_sumsq(mt_cuda *c, float *acc_out, const float *acc_in, const float *g, int64_t n, int squares, void *ws);
/* a run of SUMSQ nodes chained on one accumulator (item i's input is item i-1's acc_out; item 0's is acc_in)
   and a run of ADAMW nodes sharing lr, clip coefficient, hyperparameters and step, each as a few
   multi-tensor launches: bitwise the nodes one by one */
typedef struct { float *acc_out; const float *g; int64_t n; int squares; } mt_cuda_sumsq_item;
int mt_cuda_sumsq_multi(mt_cuda *c, const float *acc_in, const mt_cuda_sumsq_item *it, int count, void *ws);
typedef struct {
    float *p; void *m, *v;   /* m, v: f32, or bf16 with bf16_moments */
    void *p_bf16; const float *g; int64_t n; int decay, bf16_moments;
} mt_cuda_adamw_item;
int mt_cuda_adamw_multi(mt_cuda *c, const mt_cuda_adamw_item *it, int count, const float *lr, const float *coef, const float *hp,
                        const int32_t *step);
int mt_cuda_lr_schedule(mt_cuda *c, float *lr, const float *hp, const int32_t *step);
int mt_cuda_clip(mt_cuda *c, float *coef, float *norm, const float *sumsq, const float *hp);
int mt_cuda_adamw(mt_cuda *c, float *p, float *m, float *v, void *p_bf16, const float *g, int64_t n, const float *lr,
                  const float *coef, const float *hp, const int32_t *step, int decay);
/* with bf16 moments m, v: mt_adamw_bf16_elem per element, bitwise mt_cpu_adamw_bf16 of a float32 build */
int mt_cuda_adamw_bf16(mt_cuda *c, float *p, void *m, void *v, void *p_bf16, const float *g, int64_t n, const float *lr,
                       const float *coef, const float *hp, const int32_t *step, int decay);
int mt_cuda_expert_bias_update(mt_cuda *c, float *bias, const int32_t *counts, int E, float coeff);
int mt_cuda_scale(mt_cuda *c, float *x, int64_t n, float s);
/* expert-parallel exchange: rows of a [P, El] count table, src-major <-> expert-major */
int mt_cuda_ep_offsets_table(mt_cuda *c, int32_t *roffs, const int32_t *recv, int P, int El);
int mt_cuda_ep_regroup(mt_cuda *c, void *dst, const void *src, const int32_t *recv, int P, int El, int64_t row_bytes,
                       int64_t rows, int to_expert_major);
/* NCCL: communicators are opaque pointers; counts in elements of dtype (MT_F32, MT_BF16, MT_I32) */
int mt_nccl_unique_id(void *id, mt_err *err);                        /* MT_NCCL_ID_BYTES bytes */
int mt_nccl_init(mt_cuda *c, void **comm, const void *id, int nranks, int rank);
int mt_nccl_split(mt_cuda *c, void *parent, int color, int key, void **comm);
void mt_nccl_free(void *comm, int abort);
int mt_nccl_async_error(void *comm, char *msg, size_t n);           /* 0: none */
int mt_nccl_allreduce(mt_cuda *c, void *comm, void *buf, int64_t n, int dtype, int op_max); /* dtype -1: f64 */
int mt_nccl_allgather(mt_cuda *c, void *comm, const void *in, void *out, int64_t n, int dtype);
int mt_nccl_reduce_scatter(mt_cuda *c, void *comm, const void *in, void *out, int64_t n, int dtype);
/* per-peer byte ranges in one group: send[p] = (offset, bytes) to peer p, recv likewise */
int mt_nccl_exchange(mt_cuda *c, void *comm, int P, const void *send, const int64_t *soff, const int64_t *sbytes,
                     void *recv, const int64_t *roff, const int64_t *rbytes);
/* The device-side expert exchange over NCCL symmetric windows (section 9a): one per ep group whose ranks
   are all load/store accessible. The arena must come from mt_cuda_malloc_symmetric (ncclMemAlloc), the
   same size on every rank. create: 0 made, 1 not possible here (why says), -1 error. plan: per EP_COUNTS,
   mt_cuda_lsa_plan_ints(P, El) ints on the device (the count matrix and both directions' layouts). */
typedef struct mt_cuda_lsa mt_cuda_lsa;
int mt_cuda_malloc_symmetric(mt_cuda *c, void **p, size_t n);
void mt_cuda_free_symmetric(mt_cuda *c, void *p);
int mt_cuda_lsa_create(mt_cuda *c, void *comm, int P, int E, void *arena, size_t arena_bytes, double timeout_s,
                       mt_cuda_lsa **out, char *why, size_t nwhy);
void mt_cuda_lsa_destroy(mt_cuda *c, mt_cuda_lsa *l, int abort);
size_t mt_cuda_lsa_plan_ints(int P, int El);
int mt_cuda_lsa_counts(mt_cuda *c, mt_cuda_lsa *l, const int32_t *offs, int32_t *plan, int32_t *recv, int El);
int mt_cuda_lsa_rows(mt_cuda *c, mt_cuda_lsa *l, int dispatch, const void *src, size_t dst_offset, int64_t row_bytes,
                     const int32_t *plan, int El, int64_t cap_rows, int32_t *roffs, long long *rows_acc);
void *mt_cuda_stream_handle(mt_cuda *c);
#endif

/* ========================================================================
 * 11. Checkpoints (safetensors, Hugging Face DeepSeek-V3 names and layouts)
 * DIR/model.safetensors     weights (F32; F64 in float64 builds); its
 *                           __metadata__ holds the config, the run state and
 *                           the name + checksum of the optimizer file
 * DIR/optimizer-stepN.safetensors   AdamW moments (exp_avg.*, exp_avg_sq.*), in the
 *                           weights' dtype, or BF16 for a run with bf16 moments
 * DIR/config.json           transformers' DeepseekV3Config
 * Every file carries checksums of its header and data. Saving is atomic: a
 * failed or killed save leaves the previous checkpoint loadable. Weights fit
 * a model of the same config with any batch and seq_len.
 * ====================================================================== */

/* What the next step depends on besides the tensors. A step draws no random
 * numbers and the data order is a pure function of (seed, step, dp_rank,
 * dp_size), so there is no RNG state to keep and every data-parallel rank's
 * data position is `step`. The rest are the run settings that change numerics. */
typedef struct {
    int32_t step;          /* optimizer steps taken = the next step's 0-based index = the data position */
    int32_t total_steps;   /* the run's planned length */
    uint64_t seed;         /* initialization and data order */
    mt_hparams hp;         /* learning-rate schedule and AdamW settings */
    int32_t eager;         /* no optimizing passes (rounds differently on CUDA) */
    char preset[32];       /* the preset the config came from ("" unknown) */
    char data[1024];       /* the data: "" for the embedded corpus, else its path */
    int64_t data_tokens;   /* length and hash of the token stream: a position means */
    uint64_t data_hash;    /* nothing in other data */
    int32_t has_settings;  /* read back: 0 if the checkpoint recorded only the step (mt_checkpoint_save) */
    int32_t moments;       /* read back: the saved AdamW moments' dtype, MT_F32 or MT_BF16 (saving writes the graph's) */
    int32_t fp8;           /* read back: the run's FP8 mode, MT_FP8_* (mt_pass_fp8; saving writes the graph's) */
    int32_t moe_chunks;    /* read back: the saved run's MoE chunks (saving writes the graph's where not 1) */
} mt_run_state;
void mt_run_state_init(mt_run_state *r);                              /* zeros, default hparams */

/* With many ranks (binding.world > 1) saving is collective: every rank calls it; rank 0 writes the
 * whole tensors (Hugging Face names) from every rank's shards, so any mesh, one rank included, loads
 * the checkpoint; loading takes each rank's own shard of every tensor. */
int mt_checkpoint_save(mt_runtime *rt, const char *dir, int step, mt_err *err);  /* tensors + step */
int mt_checkpoint_save_run(mt_runtime *rt, const char *dir, const mt_run_state *run, mt_err *err); /* + run state */
int mt_checkpoint_prepare_dir(const char *dir, mt_err *err);          /* create DIR (and parents), prove it writable, remove what
                                                                         interrupted saves left (.tmp files, sharded saves' parts) */
int mt_checkpoint_read_config(const char *dir, mt_config *c, mt_err *err);
int mt_checkpoint_read_run(const char *dir, mt_run_state *run, mt_err *err); /* step, and settings if saved */
/* step may be NULL. Moments saved in the other dtype than the graph's convert: bf16 to f32 exactly, f32
 * to bf16 rounded to nearest even (then not the saved run's exact continuation; train says so). */
int mt_checkpoint_load(mt_runtime *rt, const char *dir, int *step, mt_err *err);

/* ========================================================================
 * 12. Data
 * ====================================================================== */

typedef struct {
    int32_t *tokens;
    int64_t n;
    int max_token;      /* largest token id present */
    int format;         /* what was read: MT_DATA_BIN, MT_DATA_RAW or MT_DATA_EMBEDDED */
    int token_bytes;    /* bytes a token took in the file: 2 or 4 (shards), 1 (bytes) */
} mt_dataset;
/* How a data file is read. MT_DATA_BIN: an llm.c / nanoGPT token shard, its
 * header exactly right. MT_DATA_RAW: every byte a token. MT_DATA_AUTO: a shard
 * when its magic and version are exactly a shard's, raw bytes when nothing
 * about it looks like one; a near miss (a .bin name, a magic a few digits
 * off, a wrong version, a shard's header layout) is refused, never read as
 * bytes by accident. */
enum { MT_DATA_AUTO = 0, MT_DATA_BIN = 1, MT_DATA_RAW = 2, MT_DATA_EMBEDDED = 3 };
int mt_data_load(mt_dataset *d, const char *path, mt_err *err); /* MT_DATA_AUTO */
int mt_data_load_as(mt_dataset *d, const char *path, int format, mt_err *err);
int mt_data_format_parse(const char *name, int *format);        /* "auto", "bin", "raw"; -1 for anything else */
int mt_data_default(mt_dataset *d, mt_err *err);                /* the embedded corpus */
/* What was read, for a start-up line: "f.bin (llm.c token shard, uint16, 1,234 tokens)",
 * "f.txt (raw bytes, 5,000 tokens)", "embedded default corpus (600,034 tokens)". */
const char *mt_data_describe(const mt_dataset *d, const char *path, char *buf, size_t cap);
void mt_data_free(mt_dataset *d);
uint64_t mt_data_hash(const mt_dataset *d);                     /* identifies the token stream (checkpoints record it) */
/* The data order is a pure function of (seed, step): the token stream is cut
 * into W = (n-1)/T windows of T tokens (targets: the next token), and each
 * epoch visits every window once in a seeded random order. Step s's global
 * batch is samples [s*B*dp_size, (s+1)*B*dp_size) of that order; data-parallel
 * rank r reads its own disjoint B of them, [r*B, (r+1)*B). So a run of
 * dp_size ranks sees the same global batch as one rank with batch B*dp_size,
 * and resuming at step s needs nothing but s.
 * tokens[b*T+t], targets[b*T+t] = the token after it. */
int mt_data_batch_at(const mt_dataset *d, uint64_t seed, int64_t step, int dp_rank, int dp_size, int B, int T,
                     int32_t *tokens, int32_t *targets, mt_err *err);
int64_t mt_data_window(const mt_dataset *d, uint64_t seed, int64_t sample, int T);  /* sample -> window index */

/* ========================================================================
 * 13. Metrics
 * ====================================================================== */

typedef struct { int64_t total, embedding, dense, sparse_active, sparse_total; } mt_param_count;
void mt_count_params(const mt_config *c, mt_param_count *pc);
double mt_flops_per_token(const mt_config *c);   /* torchtitan's DeepSeek-V3 formula */
/* What one node must do at least: floating-point operations actually
 * executed (causal attention counts its half) and bytes it must move
 * (inputs read once, outputs written once). For roofline comparisons. */
void mt_node_cost(const mt_graph *g, const mt_node *n, double *flops, double *bytes);
int mt_write_svg(const char *path, const double *loss, int n, const char *title, mt_err *err);

/* ========================================================================
 * 14. Launch
 * Ranks find each other without torchrun: rank 0 listens on MASTER_ADDR:
 * MASTER_PORT, every other rank connects and says who it is, and rank 0
 * hands each the same blob (NCCL's unique id). The connections stay open for
 * the whole run: they are how a failure reaches every rank. A rank that fails
 * tells rank 0, which tells the others; a rank that dies closes its socket,
 * which rank 0 sees at once; if rank 0 dies the others see theirs close. An
 * orderly end is a handshake (each rank: done; rank 0: bye), so a closed
 * socket after it is not a failure.
 * ====================================================================== */

typedef struct mt_rdv mt_rdv;
/* Join: rank 0 serves blob (len bytes), the others receive it into blob. */
int mt_rdv_open(mt_rdv **r, const char *addr, int port, int rank, int world, uint8_t *blob, size_t len,
                double timeout_s, mt_err *err);
/* Wait up to ms for news. Returns 1 when a rank failed (*who, why), 2 when the
 * orderly end completed, 0 on nothing. Call from one thread (a watchdog). */
int mt_rdv_poll(mt_rdv *r, int ms, int *who, char *why, size_t n);
void mt_rdv_fail(mt_rdv *r, const char *why);            /* this rank failed: tell every rank */
void mt_rdv_done(mt_rdv *r);                             /* this rank finished its work */
void mt_rdv_close(mt_rdv *r);
int mt_free_port(mt_err *err);                           /* a free TCP port on this host */
/* Self-launch without a race for the port: the launcher listens first (a socket on a free port, *port),
 * starts its ranks, and rank 0 serves the rendezvous on that inherited socket (mt_rdv_open_on), so no
 * other process can take the port between choosing it and listening on it. Returns the socket, -1 on error. */
int mt_rdv_listen(int *port, mt_err *err);
/* mt_rdv_open for rank 0 on a socket that listens already (mt_rdv_listen's, on port) */
int mt_rdv_open_on(mt_rdv **r, int listen_fd, int port, int world, uint8_t *blob, size_t len, double timeout_s, mt_err *err);

/* Where this process's rank comes from: the variables of the launcher that
 * started it, read through get (getenv-like; ctx is passed through) so that any
 * set of variables can be tested. The innermost launcher wins:
 *  1. torchrun, and scripts on its conventions: RANK, WORLD_SIZE, LOCAL_RANK
 *     [RANK]; MASTER_ADDR [127.0.0.1]; MASTER_PORT [29500], the next port when
 *     TORCHELASTIC_USE_AGENT_STORE says torchrun's own store holds it;
 *  2. mpirun (Open MPI): OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK; MASTER_ADDR
 *     [127.0.0.1 when every rank is on this host (_LOCAL_SIZE = _SIZE), else
 *     required]; MASTER_PORT [29500];
 *  3. srun (Slurm), in a job step (SLURM_STEP_ID set): SLURM_PROCID,
 *     SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR [the first host of
 *     SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST, else SLURM_NODELIST];
 *     MASTER_PORT [10000 + (16 * SLURM_JOB_ID + SLURM_STEP_ID) mod 20000];
 *  4. none of them: self (the program starts its own ranks).
 * Open MPI before Slurm: mpirun in a Slurm allocation starts ranks under
 * daemons that srun started, and they inherit those daemons' Slurm variables.
 * A batch script has SLURM_PROCID but no SLURM_STEP_ID: not a launch. A world
 * of one from mpirun or srun (srun -n 1, or a shell from srun --pty) is self
 * too: that one task owns the GPUs it sees. MOETRAIN_PORT, when set, is the
 * port in every case. Missing, malformed or inconsistent values are an error
 * naming the variables (a rank or local rank not below the world size, a local
 * rank missing, no host for the rendezvous). */
typedef enum { MT_LAUNCH_SELF, MT_LAUNCH_TORCHRUN, MT_LAUNCH_OPENMPI, MT_LAUNCH_SLURM } mt_launcher;
typedef struct {
    mt_launcher by;                      /* who set the rank and the world */
    int rank, world, local_rank;         /* self: 0, 1, 0 */
    char addr[256];                      /* the rendezvous: rank 0's host ... */
    int port;                            /* ... and port */
    const char *addr_from, *port_from;   /* the variable each came from, or "default" */
    char what[224];                      /* for the start-up line: "slurm (SLURM_PROCID=3 of 8, SLURM_LOCALID=3)" */
} mt_launch;
typedef const char *(*mt_getenv_fn)(void *ctx, const char *name);
const char *mt_env_get(void *env, const char *name);   /* an mt_getenv_fn over env, a NULL-ended array of "NAME=value" */
int mt_launch_from_env(mt_launch *l, mt_getenv_fn get, void *ctx, mt_err *err);
/* Slurm's compressed host list ("node1,node2", "node[01-04,07]", "gpu-a[1-2],gpu-b3",
 * "r[1-2]-n[1-2]"): the number of hosts, or -1 when malformed (err says why);
 * host i (from 0, zero padding kept) into host[n] when 0 <= i < that number. */
int64_t mt_hostlist_host(const char *list, int64_t i, char *host, size_t n, mt_err *err);

#ifdef __cplusplus
}
#endif
#endif /* MOETRAIN_H */

/* ************************************************************************
 *
 *                           IMPLEMENTATION
 *
 * ********************************************************************** */
#ifdef MOETRAIN_IMPLEMENTATION
#ifndef MOETRAIN_IMPLEMENTATION_DONE
#define MOETRAIN_IMPLEMENTATION_DONE

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>

#ifndef MT_MALLOC
#define MT_MALLOC(n) malloc(n)
#define MT_REALLOC(p, n) realloc(p, n)
#define MT_FREE(p) free(p)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ========================================================================
 * 1. Basics
 * ====================================================================== */

int mt_errf(mt_err *e, const char *fmt, ...) {
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
    }
    return -1;
}

uint64_t mt_hash(const void *p, size_t n, uint64_t h) {
    const uint8_t *b = (const uint8_t *)p;
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001b3ull; }
    return h;
}

static uint64_t mt__splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
void mt_rng_seed(mt_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = mt__splitmix(&seed);
}
static uint64_t mt__rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
uint64_t mt_rng_u64(mt_rng *r) {
    uint64_t *s = r->s, out = mt__rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t; s[3] = mt__rotl(s[3], 45);
    return out;
}
double mt_rng_uniform(mt_rng *r) { return (double)(mt_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }
double mt_rng_normal(mt_rng *r) {
    double u1 = mt_rng_uniform(r), u2 = mt_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* The inverse CDF of N(0, 1) truncated to [-3, 3] at u = k / MT_INIT_TABLE: Newton's method on
 * Phi(x) = q from the previous point (the function is increasing), half the table mirrored. */
void mt_init_table(float *t) {
    const int n = MT_INIT_TABLE, h = n / 2;
    double lo = 0.5 * erfc(3.0 / sqrt(2.0)), span = 1.0 - 2.0 * lo, x = 0;
    t[h] = 0;
    for (int k = h + 1; k < n; k++) {
        double q = lo + span * ((double)k / n);
        for (int it = 0; it < 50; it++) {
            double dx = (0.5 * erfc(-x / sqrt(2.0)) - q) / (exp(-0.5 * x * x) * 0.3989422804014327);
            x -= dx;
            if (fabs(dx) < 1e-15 * (1 + fabs(x))) break;
        }
        if (x > 3) x = 3;
        t[k] = (float)x;
        t[n - k] = -t[k];
    }
    t[0] = -3; t[n] = 3;
}

double mt_now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *mt__calloc(size_t n) { void *p = MT_MALLOC(n ? n : 1); if (p) memset(p, 0, n ? n : 1); return p; }

/* --- thread pool: the caller thread takes chunk 0, workers the rest --- */
struct mt_pool {
    int n;                      /* total threads including the caller */
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    uint64_t generation;        /* bumped for each parallel-for */
    int pending, quit;
    mt_pool_fn fn; void *ctx; int64_t total;
};
typedef struct { mt_pool *p; int id; } mt__worker_arg;

static void mt__pool_chunk(int64_t total, int nthreads, int id, int64_t *b, int64_t *e) {
    int64_t per = total / nthreads, rem = total % nthreads;
    *b = id * per + (id < rem ? id : rem);
    *e = *b + per + (id < rem ? 1 : 0);
}
static void *mt__pool_main(void *arg) {
    mt__worker_arg *wa = (mt__worker_arg *)arg;
    mt_pool *p = wa->p; int id = wa->id;
    MT_FREE(wa);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->quit && p->generation == seen) pthread_cond_wait(&p->cv_work, &p->mu);
        if (p->quit) { pthread_mutex_unlock(&p->mu); return NULL; }
        seen = p->generation;
        mt_pool_fn fn = p->fn; void *ctx = p->ctx; int64_t total = p->total;
        pthread_mutex_unlock(&p->mu);
        int64_t b, e;
        mt__pool_chunk(total, p->n, id, &b, &e);
        if (b < e) fn(ctx, b, e);
        pthread_mutex_lock(&p->mu);
        if (--p->pending == 0) pthread_cond_signal(&p->cv_done);
        pthread_mutex_unlock(&p->mu);
    }
}
int mt_pool_create(mt_pool **out, int n_threads, mt_err *err) {
    *out = NULL;
    if (n_threads <= 1) return 0;  /* NULL pool = run inline */
    mt_pool *p = (mt_pool *)mt__calloc(sizeof *p);
    if (!p) return mt_errf(err, "out of memory creating the thread pool");
    p->n = n_threads;
    p->th = (pthread_t *)mt__calloc(sizeof(pthread_t) * (size_t)n_threads);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    for (int i = 1; i < n_threads; i++) {
        mt__worker_arg *wa = (mt__worker_arg *)MT_MALLOC(sizeof *wa);
        wa->p = p; wa->id = i;
        if (pthread_create(&p->th[i], NULL, mt__pool_main, wa) != 0) {
            MT_FREE(wa);
            p->n = i;  /* destroy joins only the started ones */
            mt_pool_destroy(p);
            return mt_errf(err, "could not start worker thread %d of %d", i, n_threads);
        }
    }
    *out = p;
    return 0;
}
void mt_pool_destroy(mt_pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->n; i++) pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    MT_FREE(p->th);
    MT_FREE(p);
}
int mt_pool_threads(const mt_pool *p) { return p ? p->n : 1; }
void mt_pool_for(mt_pool *p, int64_t n, mt_pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (!p || n == 1) { fn(ctx, 0, n); return; }
    pthread_mutex_lock(&p->mu);
    p->fn = fn; p->ctx = ctx; p->total = n;
    p->pending = p->n - 1;
    p->generation++;
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    int64_t b, e;
    mt__pool_chunk(n, p->n, 0, &b, &e);
    if (b < e) fn(ctx, b, e);
    pthread_mutex_lock(&p->mu);
    while (p->pending > 0) pthread_cond_wait(&p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* ========================================================================
 * 2. Config, presets, run hyper-parameters
 * ====================================================================== */

#define MT__F(name, type, help) { #name, type, offsetof(mt_config, name), help }
const mt_field mt_config_fields[] = {
    MT__F(dim, MT_FIELD_INT, "model width"),
    MT__F(n_layers, MT_FIELD_INT, "transformer blocks"),
    MT__F(n_dense_layers, MT_FIELD_INT, "leading blocks with a dense FFN"),
    MT__F(n_heads, MT_FIELD_INT, "attention heads"),
    MT__F(q_lora_rank, MT_FIELD_INT, "query low-rank width (0 = none)"),
    MT__F(kv_lora_rank, MT_FIELD_INT, "compressed key/value width"),
    MT__F(qk_nope_head_dim, MT_FIELD_INT, "per-head q/k width without RoPE"),
    MT__F(qk_rope_head_dim, MT_FIELD_INT, "per-head q/k RoPE width"),
    MT__F(v_head_dim, MT_FIELD_INT, "per-head value width"),
    MT__F(inter_dim, MT_FIELD_INT, "dense FFN hidden width"),
    MT__F(moe_inter_dim, MT_FIELD_INT, "expert hidden width"),
    MT__F(n_routed_experts, MT_FIELD_INT, "routed experts"),
    MT__F(n_shared_experts, MT_FIELD_INT, "shared experts (0 = none)"),
    MT__F(top_k, MT_FIELD_INT, "experts per token"),
    MT__F(score_func, MT_FIELD_INT, "router scores: softmax | sigmoid"),
    MT__F(route_norm, MT_FIELD_INT, "renormalise top-k weights (0/1)"),
    MT__F(route_scale, MT_FIELD_FLOAT, "routing weight scale"),
    MT__F(n_expert_groups, MT_FIELD_INT, "expert groups for group-limited routing"),
    MT__F(n_limited_groups, MT_FIELD_INT, "groups a token may use"),
    MT__F(rope_theta, MT_FIELD_FLOAT, "RoPE base"),
    MT__F(rope_factor, MT_FIELD_FLOAT, "YaRN factor (1 = off)"),
    MT__F(beta_fast, MT_FIELD_FLOAT, "YaRN beta_fast"),
    MT__F(beta_slow, MT_FIELD_FLOAT, "YaRN beta_slow"),
    MT__F(original_seq_len, MT_FIELD_INT, "YaRN original context"),
    MT__F(mscale, MT_FIELD_FLOAT, "YaRN attention mscale"),
    MT__F(vocab_size, MT_FIELD_INT, "vocabulary"),
    MT__F(seq_len, MT_FIELD_INT, "sequence length"),
    MT__F(batch, MT_FIELD_INT, "sequences per step (per data-parallel rank)"),
    MT__F(doc_mask, MT_FIELD_INT, "attend only within each document (0/1; needs eot_id)"),
    MT__F(eot_id, MT_FIELD_INT, "end-of-text token id; a document starts after it (-1 = none)"),
    MT__F(norm_eps, MT_FIELD_FLOAT, "RMSNorm epsilon"),
    MT__F(load_balance_coeff, MT_FIELD_FLOAT, "expert-bias step (0 = off)"),
    MT__F(mtp_layers, MT_FIELD_INT, "multi-token prediction depths, HF num_nextn_predict_layers (0 = none)"),
    MT__F(mtp_weight, MT_FIELD_FLOAT, "lambda: the mean MTP loss's weight (DeepSeek-V3: 0.3, later 0.1)"),
};
#undef MT__F
const int mt_n_config_fields = (int)(sizeof mt_config_fields / sizeof mt_config_fields[0]);

static void mt__config_common(mt_config *c) {
    memset(c, 0, sizeof *c);
    c->score_func = MT_SCORE_SOFTMAX;
    c->route_norm = 0;
    c->route_scale = 1.0f;
    c->n_expert_groups = 1;
    c->n_limited_groups = 1;
    c->rope_theta = 10000.0f;
    c->rope_factor = 1.0f;
    c->beta_fast = 32.0f;
    c->beta_slow = 1.0f;
    c->mscale = 1.0f;
    c->norm_eps = 1e-6f;
    c->load_balance_coeff = 1e-3f;
    c->doc_mask = 0;
    c->eot_id = -1;
    c->mtp_layers = 0;
    c->mtp_weight = 0.3f;   /* DeepSeek-V3's lambda for its first 10T tokens (then 0.1) */
}

const char *mt_config_preset_names(void) { return "tiny, debug, mid, 16b"; }

int mt_config_preset(mt_config *c, const char *name, mt_err *err) {
    mt__config_common(c);
    if (!strcmp(name, "tiny")) {          /* CPU tests: seconds per step on 2 cores */
        c->dim = 64; c->n_layers = 3; c->n_dense_layers = 1; c->n_heads = 4;
        c->q_lora_rank = 0; c->kv_lora_rank = 32;
        c->qk_nope_head_dim = 16; c->qk_rope_head_dim = 8; c->v_head_dim = 16;
        c->inter_dim = 192; c->moe_inter_dim = 48;
        c->n_routed_experts = 8; c->n_shared_experts = 1; c->top_k = 2;
        c->score_func = MT_SCORE_SIGMOID; c->route_norm = 1; c->route_scale = 1.0f;
        c->vocab_size = 256; c->seq_len = 64; c->batch = 8;
        c->original_seq_len = 64;
    } else if (!strcmp(name, "debug")) { /* torchtitan's DeepSeek-V3 debugmodel */
        c->dim = 256; c->n_layers = 6; c->n_dense_layers = 1; c->n_heads = 16;
        c->q_lora_rank = 0; c->kv_lora_rank = 512;
        c->qk_nope_head_dim = 128; c->qk_rope_head_dim = 64; c->v_head_dim = 128;
        c->inter_dim = 1024; c->moe_inter_dim = 256;
        c->n_routed_experts = 8; c->n_shared_experts = 2; c->top_k = 3;
        c->score_func = MT_SCORE_SOFTMAX; c->route_norm = 0; c->route_scale = 1.0f;
        c->vocab_size = 2048; c->seq_len = 2048; c->batch = 8;
        c->original_seq_len = 4096;
    } else if (!strcmp(name, "mid")) {   /* a single-GPU benchmark config */
        c->dim = 2048; c->n_layers = 8; c->n_dense_layers = 1; c->n_heads = 16;
        c->q_lora_rank = 0; c->kv_lora_rank = 512;
        c->qk_nope_head_dim = 128; c->qk_rope_head_dim = 64; c->v_head_dim = 128;
        c->inter_dim = 10944; c->moe_inter_dim = 1408;
        c->n_routed_experts = 64; c->n_shared_experts = 2; c->top_k = 6;
        c->score_func = MT_SCORE_SOFTMAX; c->route_norm = 0; c->route_scale = 1.0f;
        c->vocab_size = 102400; c->seq_len = 4096; c->batch = 2;
        c->original_seq_len = 4096;
    } else if (!strcmp(name, "16b")) {   /* DeepSeek-V3 16B / V2-Lite-like */
        c->dim = 2048; c->n_layers = 27; c->n_dense_layers = 1; c->n_heads = 16;
        c->q_lora_rank = 0; c->kv_lora_rank = 512;
        c->qk_nope_head_dim = 128; c->qk_rope_head_dim = 64; c->v_head_dim = 128;
        c->inter_dim = 10944; c->moe_inter_dim = 1408;
        c->n_routed_experts = 64; c->n_shared_experts = 2; c->top_k = 6;
        c->score_func = MT_SCORE_SOFTMAX; c->route_norm = 0; c->route_scale = 1.0f;
        c->vocab_size = 102400; c->seq_len = 4096; c->batch = 8;
        c->original_seq_len = 4096;
    } else {
        return mt_errf(err, "unknown preset '%s' (known: %s)", name, mt_config_preset_names());
    }
    return 0;
}

static const mt_field *mt__find_field(const char *key) {
    for (int i = 0; i < mt_n_config_fields; i++) {
        const char *a = mt_config_fields[i].name, *b = key;
        while (*a && (*a == *b || (*a == '_' && *b == '-'))) { a++; b++; }
        if (!*a && !*b) return &mt_config_fields[i];
    }
    return NULL;
}

int mt_config_has_field(const char *name) { return mt__find_field(name) != NULL; }

const char *mt_suggest_option(const char *name, const char *const *options, int n, char *out, size_t cap) {
    const char *cand[256];
    int k = 0;
    for (int i = 0; i < n && k < 256; i++) cand[k++] = options[i];
    for (int i = 0; i < mt_n_config_fields && k < 256; i++) cand[k++] = mt_config_fields[i].name;
    const char *near = mt_suggest(name, cand, k);
    if (!near || !cap) return NULL;
    snprintf(out, cap, "%s", near);
    for (char *q = out; *q; q++) if (*q == '_') *q = '-';
    return out;
}

static int mt__parse_int(const char *s, long long lo, long long hi, long long *out) {
    char *end; errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}
static int mt__parse_float(const char *s, double *out) {
    char *end; errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

int mt_config_set(mt_config *c, const char *key, const char *value, mt_err *err) {
    const mt_field *f = mt__find_field(key);
    if (!f) {
        const char *names[64];
        int n = mt_n_config_fields < 64 ? mt_n_config_fields : 64;
        for (int i = 0; i < n; i++) names[i] = mt_config_fields[i].name;
        const char *near = mt_suggest(key, names, n);
        return near ? mt_errf(err, "unknown config field '%s' (did you mean '%s'?)", key, near) : mt_errf(err, "unknown config field '%s'", key);
    }
    if (!strcmp(f->name, "score_func")) {
        if (!strcmp(value, "softmax")) c->score_func = MT_SCORE_SOFTMAX;
        else if (!strcmp(value, "sigmoid")) c->score_func = MT_SCORE_SIGMOID;
        else return mt_errf(err, "--score-func takes softmax or sigmoid, not '%s'", value);
        return 0;
    }
    if (f->type == MT_FIELD_INT) {
        long long v;
        if (mt__parse_int(value, INT_MIN, INT_MAX, &v))
            return mt_errf(err, "--%s takes an integer, not '%s'", f->name, value);
        *(int *)((char *)c + f->offset) = (int)v;
    } else {
        double v;
        if (mt__parse_float(value, &v))
            return mt_errf(err, "--%s takes a number, not '%s'", f->name, value);
        *(float *)((char *)c + f->offset) = (float)v;
    }
    return 0;
}

int mt_config_yarn(const mt_config *c) { return c->rope_factor > 1.0f && c->seq_len > c->original_seq_len; }

int mt_config_is_moe_layer(const mt_config *c, int layer) {
    return layer >= c->n_dense_layers && c->n_routed_experts > 0;
}
/* Blocks with a MoE FFN exist: a main block past the dense ones, or an MTP block (layer >= n_layers,
 * MoE as DeepSeek-V3's is, unless the model has no experts at all). */
static int mt__config_has_moe(const mt_config *c) {
    return c->n_dense_layers < c->n_layers || (c->mtp_layers > 0 && c->n_routed_experts > 0);
}

int mt_config_validate(const mt_config *c, mt_err *err) {
#define MT__REQ(cond, ...) do { if (!(cond)) return mt_errf(err, "invalid config: " __VA_ARGS__); } while (0)
    MT__REQ(c->dim >= 1 && c->dim <= 65536, "dim %d must be in 1..65536", c->dim);
    MT__REQ(c->n_layers >= 1 && c->n_layers <= 1024, "n_layers %d must be in 1..1024", c->n_layers);
    MT__REQ(c->n_dense_layers >= 0 && c->n_dense_layers <= c->n_layers,
            "n_dense_layers %d must be in 0..n_layers", c->n_dense_layers);
    MT__REQ(c->n_heads >= 1 && c->n_heads <= 1024, "n_heads %d must be in 1..1024", c->n_heads);
    MT__REQ(c->q_lora_rank >= 0 && c->q_lora_rank <= 65536, "q_lora_rank %d out of range", c->q_lora_rank);
    MT__REQ(c->kv_lora_rank >= 1 && c->kv_lora_rank <= 65536, "kv_lora_rank %d out of range", c->kv_lora_rank);
    MT__REQ(c->qk_nope_head_dim >= 1 && c->qk_nope_head_dim <= 1024, "qk_nope_head_dim %d out of range", c->qk_nope_head_dim);
    MT__REQ(c->qk_rope_head_dim >= 2 && c->qk_rope_head_dim <= 1024 && c->qk_rope_head_dim % 2 == 0,
            "qk_rope_head_dim %d must be even, 2..1024", c->qk_rope_head_dim);
    MT__REQ(c->v_head_dim >= 1 && c->v_head_dim <= 1024, "v_head_dim %d out of range", c->v_head_dim);
    MT__REQ(c->n_dense_layers == 0 || (c->inter_dim >= 1 && c->inter_dim <= 1 << 20), "inter_dim %d out of range", c->inter_dim);
    int has_moe = mt__config_has_moe(c);
    if (has_moe) {
        MT__REQ(c->n_routed_experts >= 1 && c->n_routed_experts <= 4096, "n_routed_experts %d must be in 1..4096", c->n_routed_experts);
        MT__REQ(c->top_k >= 1 && c->top_k <= c->n_routed_experts && c->top_k <= 64,
                "top_k %d must be in 1..min(64, n_routed_experts)", c->top_k);
        MT__REQ(c->moe_inter_dim >= 1 && c->moe_inter_dim <= 1 << 20, "moe_inter_dim %d out of range", c->moe_inter_dim);
        MT__REQ(c->n_shared_experts >= 0 && c->n_shared_experts <= 64, "n_shared_experts %d out of range", c->n_shared_experts);
        MT__REQ(c->n_expert_groups >= 1 && c->n_routed_experts % c->n_expert_groups == 0,
                "n_expert_groups %d must divide n_routed_experts %d", c->n_expert_groups, c->n_routed_experts);
        MT__REQ(c->n_limited_groups >= 1 && c->n_limited_groups <= c->n_expert_groups,
                "n_limited_groups %d must be in 1..n_expert_groups", c->n_limited_groups);
        MT__REQ(c->n_limited_groups * (c->n_routed_experts / c->n_expert_groups) >= c->top_k,
                "the %d limited groups hold fewer than top_k=%d experts", c->n_limited_groups, c->top_k);
    }
    MT__REQ(c->score_func == MT_SCORE_SOFTMAX || c->score_func == MT_SCORE_SIGMOID, "score_func %d unknown", c->score_func);
    MT__REQ(c->route_norm == 0 || c->route_norm == 1, "route_norm must be 0 or 1");
    MT__REQ(isfinite(c->route_scale) && c->route_scale > 0, "route_scale must be > 0");
    MT__REQ(isfinite(c->rope_theta) && c->rope_theta > 1, "rope_theta must be > 1");
    MT__REQ(isfinite(c->rope_factor) && c->rope_factor >= 1, "rope_factor must be >= 1");
    MT__REQ(isfinite(c->beta_fast) && isfinite(c->beta_slow) && c->beta_fast > 0 && c->beta_slow > 0,
            "beta_fast and beta_slow must be > 0");
    MT__REQ(c->rope_factor == 1 || c->original_seq_len >= 1, "original_seq_len must be >= 1 with YaRN");
    MT__REQ(isfinite(c->mscale) && c->mscale >= 0, "mscale must be >= 0");
    MT__REQ(c->vocab_size >= 2 && c->vocab_size <= (1 << 24), "vocab_size %d must be in 2..2^24", c->vocab_size);
    MT__REQ(c->seq_len >= 1 && c->seq_len <= (1 << 20), "seq_len %d must be in 1..2^20", c->seq_len);
    MT__REQ(c->batch >= 1 && c->batch <= (1 << 16), "batch %d must be in 1..65536", c->batch);
    MT__REQ((int64_t)c->batch * c->seq_len <= (1 << 24), "batch*seq_len must be <= 2^24 tokens");
    MT__REQ(c->doc_mask == 0 || c->doc_mask == 1, "doc_mask must be 0 or 1");
    MT__REQ(c->eot_id >= -1 && c->eot_id < c->vocab_size, "eot_id %d must be -1 (none) or a token below vocab_size", c->eot_id);
    MT__REQ(!c->doc_mask || c->eot_id >= 0, "doc_mask needs eot_id (the end-of-text token)");
    MT__REQ(isfinite(c->norm_eps) && c->norm_eps > 0, "norm_eps must be > 0");
    MT__REQ(isfinite(c->load_balance_coeff) && c->load_balance_coeff >= 0, "load_balance_coeff must be >= 0");
    MT__REQ(c->mtp_layers >= 0 && c->mtp_layers <= 16 && c->mtp_layers < c->seq_len,
            "mtp_layers %d must be in 0..16 and below seq_len", c->mtp_layers);
    MT__REQ(isfinite(c->mtp_weight) && (c->mtp_weight > 0 || (c->mtp_layers == 0 && c->mtp_weight == 0)),
            "mtp_weight must be > 0 (mtp_layers 0 turns multi-token prediction off)");
#undef MT__REQ
    return 0;
}

int mt_config_equal(const mt_config *a, const mt_config *b) {
    for (int i = 0; i < mt_n_config_fields; i++) {
        const mt_field *f = &mt_config_fields[i];
        if (memcmp((const char *)a + f->offset, (const char *)b + f->offset, 4)) return 0;
    }
    return 1;
}
static void mt__field_str(const mt_config *c, const mt_field *f, char *out, size_t n) {
    const void *p = (const char *)c + f->offset;
    if (!strcmp(f->name, "score_func")) snprintf(out, n, "%s", *(const int *)p == MT_SCORE_SIGMOID ? "sigmoid" : "softmax");
    else if (f->type == MT_FIELD_INT) snprintf(out, n, "%d", *(const int *)p);
    else snprintf(out, n, "%.9g", (double)*(const float *)p);
}
int mt_config_diff(const mt_config *a, const mt_config *b, char *out, size_t n) {
    int k = 0;
    size_t at = 0;
    if (n) out[0] = 0;
    for (int i = 0; i < mt_n_config_fields; i++) {
        const mt_field *f = &mt_config_fields[i];
        if (!memcmp((const char *)a + f->offset, (const char *)b + f->offset, 4)) continue;
        char x[32], y[32];
        mt__field_str(a, f, x, sizeof x);
        mt__field_str(b, f, y, sizeof y);
        if (at < n) {
            int w = snprintf(out + at, n - at, "%s%s %s vs %s", k ? ", " : "", f->name, x, y);
            at = w < 0 ? n : at + (size_t)w;
        }
        k++;
    }
    return k;
}

/* Edit distance (adjacent swaps count one) with '-' and '_' alike; for option names. */
static int mt__edit_distance(const char *a, const char *b) {
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 63 || lb > 63) return 1 << 20;
    int d[64][64];
    for (int i = 0; i <= la; i++) d[i][0] = i;
    for (int j = 0; j <= lb; j++) d[0][j] = j;
    for (int i = 1; i <= la; i++)
        for (int j = 1; j <= lb; j++) {
            char x = a[i - 1] == '_' ? '-' : a[i - 1], y = b[j - 1] == '_' ? '-' : b[j - 1];
            int best = d[i - 1][j - 1] + (x != y);
            if (d[i - 1][j] + 1 < best) best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best) best = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < best) best = d[i - 2][j - 2] + 1;
            d[i][j] = best;
        }
    return d[la][lb];
}
const char *mt_suggest(const char *word, const char *const *cand, int n) {
    const char *best = NULL;
    int bd = 1 << 20, len = (int)strlen(word);
    for (int i = 0; i < n; i++) {
        int dd = mt__edit_distance(word, cand[i]);
        if (dd < bd) { bd = dd; best = cand[i]; }
    }
    int limit = len <= 4 ? 1 : len <= 8 ? 2 : 3;   /* close enough to be a typo */
    return bd <= limit ? best : NULL;
}

void mt_hparams_default(mt_hparams *h) {
    h->lr = 3e-3f; h->min_lr_ratio = 0.1f;
    h->warmup_steps = 20; h->decay_steps = 1000;
    h->beta1 = 0.9f; h->beta2 = 0.95f; h->eps = 1e-8f;
    h->weight_decay = 0.1f; h->grad_clip = 1.0f;
}
void mt_hparams_for_config(mt_hparams *h, const mt_config *c) {
    mt_hparams_default(h);
    h->lr = c->dim <= 128 ? 3e-3f : c->dim <= 512 ? 8e-4f : 4.2e-4f;
}
void mt_hparams_pack(const mt_hparams *h, float out[MT_HP_COUNT]) {
    memset(out, 0, sizeof(float) * MT_HP_COUNT);
    out[MT_HP_LR] = h->lr; out[MT_HP_MIN_LR_RATIO] = h->min_lr_ratio;
    out[MT_HP_WARMUP] = (float)h->warmup_steps; out[MT_HP_DECAY] = (float)h->decay_steps;
    out[MT_HP_BETA1] = h->beta1; out[MT_HP_BETA2] = h->beta2; out[MT_HP_EPS] = h->eps;
    out[MT_HP_WD] = h->weight_decay; out[MT_HP_CLIP] = h->grad_clip;
}
/* Linear warmup from lr/warmup to lr, then cosine decay to lr*min_lr_ratio at
 * step decay_steps, constant after. */
double mt_lr_at(const float hp[MT_HP_COUNT], int step) {
    double lr = hp[MT_HP_LR], warm = hp[MT_HP_WARMUP], decay = hp[MT_HP_DECAY];
    double lo = lr * hp[MT_HP_MIN_LR_RATIO];
    if (step < warm) return lr * (step + 1) / warm;
    if (decay <= warm || step >= decay) return step >= decay ? lo : lr;
    double t = (step - warm) / (decay - warm);
    return lo + 0.5 * (lr - lo) * (1.0 + cos(3.141592653589793 * t));
}

/* ========================================================================
 * 3. Mesh
 * ====================================================================== */

const char *const mt_dim_names[MT_NDIMS] = {"dp_replicate", "dp_shard", "tp", "ep", "edp"};

void mt_mesh_single(mt_mesh *m) { for (int d = 0; d < MT_NDIMS; d++) m->size[d] = 1; }
int mt_mesh_init(mt_mesh *m, int dp_replicate, int dp_shard, int tp, int ep, mt_err *err) {
    m->size[MT_DIM_DP_REPLICATE] = dp_replicate; m->size[MT_DIM_DP_SHARD] = dp_shard;
    m->size[MT_DIM_TP] = tp; m->size[MT_DIM_EP] = ep;
    m->size[MT_DIM_EDP] = (ep >= 1 && (dp_shard * tp) % ep == 0) ? dp_shard * tp / ep : 0;
    for (int d = 0; d < MT_DIM_EDP; d++)
        if (m->size[d] < 1 || m->size[d] > 4096)
            return mt_errf(err, "mesh %s size %d must be in 1..4096", mt_dim_names[d], m->size[d]);
    if (!m->size[MT_DIM_EDP])
        return mt_errf(err, "ep=%d must divide dp_shard*tp=%d", ep, dp_shard * tp);
    return 0;
}
int mt_mesh_world(const mt_mesh *m) {
    return m->size[MT_DIM_DP_REPLICATE] * m->size[MT_DIM_DP_SHARD] * m->size[MT_DIM_TP];
}
int mt_mesh_validate(const mt_mesh *m, const mt_config *c, mt_err *err) {
    mt_mesh chk;
    if (mt_mesh_init(&chk, m->size[0], m->size[1], m->size[2], m->size[3], err)) return -1;
    if (chk.size[MT_DIM_EDP] != m->size[MT_DIM_EDP])
        return mt_errf(err, "mesh edp size %d should be dp_shard*tp/ep = %d", m->size[MT_DIM_EDP],
                       chk.size[MT_DIM_EDP]);
    if (mt__config_has_moe(c) && c->n_routed_experts % m->size[MT_DIM_EP])
        return mt_errf(err, "ep=%d must divide n_routed_experts=%d", m->size[MT_DIM_EP], c->n_routed_experts);
    int tp = m->size[MT_DIM_TP];
    if (tp > 1) {   /* what tensor parallelism splits must split evenly */
        int moe = mt__config_has_moe(c);
        struct { const char *what; int64_t n; int used; } need[] = {
            {"n_heads", c->n_heads, 1},
            {"vocab_size", c->vocab_size, 1},
            {"batch * seq_len (tokens a rank holds)", (int64_t)c->batch * c->seq_len, 1},
            {"inter_dim (the dense FFN)", c->inter_dim, c->n_dense_layers > 0},
            {"n_shared_experts * moe_inter_dim", (int64_t)c->n_shared_experts * c->moe_inter_dim, moe && c->n_shared_experts > 0},
        };
        for (size_t i = 0; i < sizeof need / sizeof need[0]; i++)
            if (need[i].used && need[i].n % tp)
                return mt_errf(err, "tp=%d must divide %s = %lld", tp, need[i].what, (long long)need[i].n);
    }
    return 0;
}
void mt_mesh_coords(const mt_mesh *m, int rank, int coord[MT_NDIMS]) {
    int tp = m->size[MT_DIM_TP], sh = m->size[MT_DIM_DP_SHARD];
    coord[MT_DIM_TP] = rank % tp;
    coord[MT_DIM_DP_SHARD] = (rank / tp) % sh;
    coord[MT_DIM_DP_REPLICATE] = rank / (tp * sh);
    int f = coord[MT_DIM_DP_SHARD] * tp + coord[MT_DIM_TP];
    coord[MT_DIM_EP] = f % m->size[MT_DIM_EP];
    coord[MT_DIM_EDP] = f / m->size[MT_DIM_EP];
}

int mt_mesh_mask_valid(uint32_t mask) {
    uint32_t a = MT_DIMBIT(MT_DIM_DP_SHARD) | MT_DIMBIT(MT_DIM_TP), e = MT_DIMBIT(MT_DIM_EP) | MT_DIMBIT(MT_DIM_EDP);
    return mask < (1u << MT_NDIMS) && !((mask & a) && (mask & e));
}
int mt_mesh_group_size(const mt_mesh *m, uint32_t mask) {
    int s = 1;
    for (int d = 0; d < MT_NDIMS; d++) if (mask >> d & 1) s *= m->size[d];
    return s;
}
/* the basis a mask is read in: three dimensions that number the ranks */
static void mt__mask_basis(uint32_t mask, int basis[3]) {
    int ep = (mask & (MT_DIMBIT(MT_DIM_EP) | MT_DIMBIT(MT_DIM_EDP))) != 0;
    basis[0] = MT_DIM_DP_REPLICATE;
    basis[1] = ep ? MT_DIM_EDP : MT_DIM_DP_SHARD;
    basis[2] = ep ? MT_DIM_EP : MT_DIM_TP;
}
int mt_mesh_group(const mt_mesh *m, uint32_t mask, int rank, int *members) {
    int basis[3], me[MT_NDIMS], c[MT_NDIMS], world = mt_mesh_world(m), mine = 0;
    mt__mask_basis(mask, basis);
    mt_mesh_coords(m, rank, me);
    for (int r = 0; r < world; r++) {
        mt_mesh_coords(m, r, c);
        int same = 1, key = 0;
        for (int i = 0; i < 3; i++) {
            int d = basis[i];
            if (mask >> d & 1) key = key * m->size[d] + c[d];
            else same &= c[d] == me[d];
        }
        if (!same) continue;
        if (members) members[key] = r;
        if (r == rank) mine = key;
    }
    return mine;
}
void mt_mesh_mask_name(uint32_t mask, char *out, size_t n) {
    size_t k = 0;
    out[0] = 0;
    for (int d = 0; d < MT_NDIMS; d++)
        if (mask >> d & 1) k += (size_t)snprintf(out + k, k < n ? n - k : 0, "%s%s", k ? "+" : "", mt_dim_names[d]);
    if (!mask) snprintf(out, n, "-");
}
#define MT__WORLD_MASK (MT_DIMBIT(MT_DIM_DP_REPLICATE) | MT_DIMBIT(MT_DIM_DP_SHARD) | MT_DIMBIT(MT_DIM_TP))
int mt_mesh_groups_equal(const mt_mesh *m, uint32_t a, uint32_t b) {
    if (a == b) return 1;
    int world = mt_mesh_world(m), n = mt_mesh_group_size(m, a), eq = n == mt_mesh_group_size(m, b);
    int *x = (int *)MT_MALLOC(sizeof(int) * (size_t)(2 * n + 1));
    if (!x) return 0;
    for (int r = 0; r < world && eq; r++) {
        mt_mesh_group(m, a, r, x);
        mt_mesh_group(m, b, r, x + n);
        eq = !memcmp(x, x + n, sizeof(int) * (size_t)n);
    }
    MT_FREE(x);
    return eq;
}

/* ========================================================================
 * 4. Graph IR
 * ====================================================================== */

const mt_op_info mt_ops[MT_NOPS] = {
#define MT_OP_INFO(name, ni, no, d) {#name, ni, no, d},
    MT_OPS(MT_OP_INFO)
#undef MT_OP_INFO
};
const char *const mt_queue_names[MT_NQUEUES] = {"compute", "dp", "ep"};
static const char *const mt__dtype_names[MT_NDTYPES] = {"f32", "bf16", "i32"};
static const char *const mt__role_names[MT_NROLES] = {"param", "grad", "opt", "input", "const",
                                                     "output", "act", "agrad", "scratch"};

void mt_target_cpu(mt_target *t) {
    memset(t, 0, sizeof *t);
    t->backend = MT_BACKEND_CPU;
    t->real_bytes = (int32_t)sizeof(mt_real);
    snprintf(t->arch, sizeof t->arch, "cpu");
}
void mt_target_cuda(mt_target *t, const char *arch) {
    memset(t, 0, sizeof *t);
    t->backend = MT_BACKEND_CUDA;
    t->real_bytes = 4;
    snprintf(t->arch, sizeof t->arch, "%s", arch ? arch : "sm_90a");
}
int mt_tuning_mismatch(const mt_tuning_info *tuned, const mt_tuning_info *here, char *why, size_t n) {
    if (strcmp(tuned->device, here->device) || tuned->sm != here->sm || tuned->n_sms != here->n_sms ||
        tuned->blas_version != here->blas_version) {
        snprintf(why, n, "tuned for %s (sm %d, %d SMs, cuBLASLt %lld); this GPU is %s (sm %d, %d SMs, cuBLASLt %lld)", tuned->device,
                 tuned->sm, tuned->n_sms, (long long)tuned->blas_version, here->device, here->sm, here->n_sms, (long long)here->blas_version);
        return 1;
    }
    return 0;
}

int64_t mt_dtype_bytes(const mt_graph *g, int dtype) {
    switch (dtype) {
    case MT_F32: return g->target.real_bytes;
    case MT_BF16: return 2;
    case MT_I32: return 4;
    }
    return 0;
}

/* A dim as an upper bound: literal, or its symbol's max. */
static int64_t mt__dim_max(const mt_graph *g, int64_t d) {
    if (d >= 0) return d;
    int s = (int)(-d - 1);
    return (s < g->n_syms) ? g->syms[s].max : 0;
}
int64_t mt_gmm_ssq_len(int64_t E, int64_t M, int64_t K) {
    int64_t t8 = E * ((M + 127) / 128) * ((K + 255) / 256) * 8;
    return t8 > 1024 ? t8 : 1024;
}
int64_t mt_gmm_ssq_len_fp8(int64_t E, int64_t M, int64_t K) {
    int64_t t8 = E * ((M + 127) / 128) * ((K + 127) / 128) * 8;
    return t8 > 1024 ? t8 : 1024;
}
int64_t mt_value_numel_logical(const mt_graph *g, const mt_value *v) {
    int64_t n = 1;
    for (int i = 0; i < v->ndim; i++) n *= mt__dim_max(g, v->dims[i]);
    return n;
}
int64_t mt_value_numel_max(const mt_graph *g, const mt_value *v) {
    int64_t n = mt_value_numel_logical(g, v);
    if (!v->shard) return n;
    int64_t S = mt_mesh_group_size(&g->mesh, v->shard), L = (n + S - 1) / S;
    return (v->flags & MT_VF_GATHERED) ? L * S : L;
}
int mt_graph_find(const mt_graph *g, const char *name) {
    for (int i = 0; i < g->n_values; i++)
        if (!strcmp(g->values[i].name, name)) return i;
    return -1;
}
void mt_graph_free(mt_graph *g) {
    if (!g) return;
    MT_FREE(g->values); MT_FREE(g->nodes); MT_FREE(g->syms);
    MT_FREE(g->consts); MT_FREE(g->tuning); MT_FREE(g->recompute);
    memset(g, 0, sizeof *g);
}
static void *mt__dup(const void *p, size_t n) {   /* n bytes of p (at least 1 allocated) */
    void *q = MT_MALLOC(n ? n : 1);
    if (q && n) memcpy(q, p, n);
    return q;
}
int mt_graph_copy(mt_graph *dst, const mt_graph *src, mt_err *err) {
    *dst = *src;
    dst->values = (mt_value *)mt__dup(src->values, sizeof(mt_value) * (size_t)src->n_values);
    dst->nodes = (mt_node *)mt__dup(src->nodes, sizeof(mt_node) * (size_t)src->n_nodes);
    dst->syms = (mt_symbol *)mt__dup(src->syms, sizeof(mt_symbol) * (size_t)src->n_syms);
    dst->consts = (uint8_t *)mt__dup(src->consts, (size_t)src->consts_bytes);
    dst->tuning = (mt_tuning *)mt__dup(src->tuning, sizeof(mt_tuning) * (size_t)src->n_tuning);
    dst->recompute = (mt_recompute *)mt__dup(src->recompute, sizeof(mt_recompute) * (size_t)src->n_recompute);
    dst->cap_values = src->n_values; dst->cap_nodes = src->n_nodes;
    if (!dst->values || !dst->nodes || !dst->syms || !dst->consts || !dst->tuning || !dst->recompute) {
        mt_graph_free(dst);
        return mt_errf(err, "out of memory copying the graph");
    }
    return 0;
}
int64_t mt_graph_peak_bytes(const mt_graph *g) { return g->persist_bytes + g->arena_bytes; }

/* --- shape checks: one per op, used by the builder and the loader --- */

typedef struct { const mt_graph *g; const mt_node *n; mt_err *err; } mt__ck;

static const mt_value *mt__in(const mt__ck *c, int i) {
    int v = c->n->in[i];
    return v >= 0 ? &c->g->values[v] : NULL;
}
static const mt_value *mt__out(const mt__ck *c, int i) {
    int v = c->n->out[i];
    return v >= 0 ? &c->g->values[v] : NULL;
}
/* dims of v must equal the list (use MT__ANY to skip one); symbols compare by identity */
#define MT__ANY INT64_MIN
static int mt__shape(const mt__ck *c, const mt_value *v, const char *what, int ndim, int64_t d0,
                     int64_t d1, int64_t d2) {
    int64_t want[3] = {d0, d1, d2};
    if (!v) return mt_errf(c->err, "%s: %s is missing", mt_ops[c->n->op].name, what);
    int ok = v->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = want[i] == MT__ANY || v->dims[i] == want[i];
    if (!ok) {
        char got[96] = "", exp[96] = "";
        for (int i = 0; i < v->ndim; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? "," : "", (long long)v->dims[i]);
        for (int i = 0; i < ndim; i++) {
            if (want[i] == MT__ANY) snprintf(exp + strlen(exp), sizeof exp - strlen(exp), "%s?", i ? "," : "");
            else snprintf(exp + strlen(exp), sizeof exp - strlen(exp), "%s%lld", i ? "," : "", (long long)want[i]);
        }
        return mt_errf(c->err, "%s: %s '%s' has shape [%s], expected [%s]", mt_ops[c->n->op].name,
                       what, v->name, got, exp);
    }
    return 0;
}
static int mt__is_index(const mt__ck *c, const mt_value *v, const char *what, int want_index) {
    if (!v) return mt_errf(c->err, "%s: %s is missing", mt_ops[c->n->op].name, what);
    if ((v->dtype == MT_I32) != want_index)
        return mt_errf(c->err, "%s: %s '%s' must be %s", mt_ops[c->n->op].name, what, v->name,
                       want_index ? "i32" : "floating point");
    return 0;
}
static int mt__same_numel(const mt__ck *c, const mt_value *a, const mt_value *b) {
    if (mt_value_numel_max(c->g, a) != mt_value_numel_max(c->g, b))
        return mt_errf(c->err, "%s: '%s' and '%s' differ in size", mt_ops[c->n->op].name, a->name, b->name);
    return 0;
}
static int mt__persistent(const mt__ck *c, const mt_value *v) {
    if (MT_ROLE_IN_ARENA(v->role))
        return mt_errf(c->err, "%s updates '%s' in place, which must not be an arena value",
                       mt_ops[c->n->op].name, v->name);
    return 0;
}
/* MoE rows by token: nk = n * K rows (n tokens, K each) of tokens [i1, i1 + n) of N (mt__moe's chunks) */
static int mt__row_chunk(const mt__ck *c, int64_t nk, int64_t K, int64_t N) {
    int64_t r0 = c->n->iattr[1];
    if (K < 1 || nk < 0 || nk % K || r0 < 0 || r0 + nk / K > N)
        return mt_errf(c->err, "%s: %lld rows of %lld per token from token %lld are not tokens of %lld", mt_ops[c->n->op].name,
                       (long long)nk, (long long)K, (long long)r0, (long long)N);
    return 0;
}
static int mt__int_attr(const mt__ck *c, int i, int lo, int hi) {
    if (c->n->sym_mask & (1u << i)) return 0; /* checked at bind */
    int v = c->n->iattr[i];
    if (v < lo || v > hi)
        return mt_errf(c->err, "%s: attribute %d = %d outside %d..%d", mt_ops[c->n->op].name, i, v, lo, hi);
    return 0;
}

/* Which operands are i32 indices (bit i set) and which are floating point.
 * Returns 1 for ops whose operand may be either (ALLREDUCE). */
static int mt__index_operands(int op, uint32_t *in, uint32_t *out) {
    *in = 0; *out = 0;
    switch (op) {
    case MT_OP_EMBED: *in = 1u; break;
    case MT_OP_EMBED_BWD: *in = 2u; break;
    case MT_OP_ROUTER: *out = 1u | 8u; break;
    case MT_OP_ROUTER_BWD: *in = 2u; break;
    case MT_OP_MOE_PERMUTE: *in = 2u; *out = 2u | 4u; break;
    case MT_OP_MOE_PERMUTE_BWD: *in = 2u; break;
    case MT_OP_EP_COUNTS: *in = 1u; *out = 1u; break;
    case MT_OP_EP_DISPATCH: *in = 2u | 4u; *out = 2u; break;
    case MT_OP_EP_COMBINE: *in = 2u | 4u; break;
    case MT_OP_GMM: case MT_OP_GMM_DX: case MT_OP_GMM_DW: case MT_OP_GMM_DX2: case MT_OP_GMM_DW_SQ: case MT_OP_GMM_GLU: *in = 4u; break;
    case MT_OP_MOE_COMBINE: *in = 2u; break;
    case MT_OP_MOE_COMBINE_BWD: *in = 4u; break;
    case MT_OP_CROSS_ENTROPY: *in = 2u; break;
    case MT_OP_CROSS_ENTROPY_BWD: *in = 4u; break;
    case MT_OP_LR_SCHEDULE: *in = 2u; break;
    case MT_OP_ADAMW: *in = 128u; break;
    case MT_OP_EXPERT_BIAS_UPDATE: *in = 2u; break;
    case MT_OP_ATTENTION: *in = 8u; break;
    case MT_OP_ATTENTION_BWD: *in = 64u; break;
    case MT_OP_MLA_ATTENTION: *in = 16u; break;
    case MT_OP_MLA_ATTENTION_BWD: *in = 128u; break;
    case MT_OP_DOC_STARTS: case MT_OP_SHIFT_TOKENS: *in = 1u; *out = 1u; break;
    case MT_OP_CE_STATS: *in = 2u; break;
    case MT_OP_CE_COMBINE: *in = 4u; break;
    case MT_OP_CE_SHARD_BWD: *in = 4u; break;
    case MT_OP_ALLREDUCE: case MT_OP_SP_GATHER: case MT_OP_SP_SCATTER: return 1;
    }
    return 0;
}

/* mt_check_node: what every op must satisfy (mt__check_refs), then the shape rules of its family
 * (one of the mt__check_* below, which take the mt__ck by value so that their cases read as they
 * would in one function), then which operands are indices (mt__index_operands). */
#define MT__T(x) do { if (x) return -1; } while (0)
/* Arity, value and symbol references, attributes, required operands: what every op must satisfy. */
static int mt__check_refs(const mt_graph *g, const mt_node *n, mt_err *err) {
    if (n->op < 0 || n->op >= MT_NOPS) return mt_errf(err, "unknown op %d", n->op);
    const mt_op_info *oi = &mt_ops[n->op];
    if (n->n_in != oi->n_in || n->n_out != oi->n_out)
        return mt_errf(err, "%s has %d inputs/%d outputs, expected %d/%d", oi->name, n->n_in, n->n_out,
                       oi->n_in, oi->n_out);
    if (n->queue < 0 || n->queue >= MT_NQUEUES) return mt_errf(err, "%s: bad queue %d", oi->name, n->queue);
    if (n->phase < 0 || n->phase > MT_PHASE_RECOMPUTE) return mt_errf(err, "%s: bad phase %d", oi->name, n->phase);
    for (int i = 0; i < MT_MAX_IN; i++)
        if (n->in[i] < -1 || n->in[i] >= g->n_values || (i >= n->n_in && n->in[i] != -1))
            return mt_errf(err, "%s: input %d refers to value %d of %d", oi->name, i, n->in[i], g->n_values);
    for (int i = 0; i < MT_MAX_OUT; i++)
        if (n->out[i] < -1 || n->out[i] >= g->n_values || (i >= n->n_out && n->out[i] != -1))
            return mt_errf(err, "%s: output %d refers to value %d of %d", oi->name, i, n->out[i], g->n_values);
    for (int i = 0; i < MT_MAX_ATTR; i++)
        if ((n->sym_mask & (1u << i)) && (n->iattr[i] < 0 || n->iattr[i] >= g->n_syms))
            return mt_errf(err, "%s: attribute %d names symbol %d of %d", oi->name, i, n->iattr[i], g->n_syms);
    if (n->sym_mask >> MT_MAX_ATTR) return mt_errf(err, "%s: bad symbol mask", oi->name);
    for (int i = 0; i < 4; i++)
        if (!isfinite(n->fattr[i])) return mt_errf(err, "%s: attribute f%d is not finite", oi->name, i);
    /* required inputs/outputs (optional ones handled per op below) */
    for (int i = 0; i < n->n_in; i++) {
        int optional = (n->op == MT_OP_SUMSQ && i == 1) || (n->op == MT_OP_CONCAT) ||
                       (n->op == MT_OP_ATTENTION && i == 3) || (n->op == MT_OP_ATTENTION_BWD && i == 6) ||
                       (n->op == MT_OP_MLA_ATTENTION && i == 4) || (n->op == MT_OP_MLA_ATTENTION_BWD && i == 7);
        if (n->in[i] < 0 && !optional) return mt_errf(err, "%s: input %d missing", oi->name, i);
    }
    for (int i = 0; i < n->n_out; i++) {
        int optional = (n->op == MT_OP_ADAMW && i == 3);
        if (n->out[i] < 0 && !optional) return mt_errf(err, "%s: output %d missing", oi->name, i);
    }
    return 0;
}
/* The residual stream and the dense layers: embedding, norms, GEMMs, splits, SwiGLU, adds. */
static int mt__check_dense(mt__ck c) {
    const mt_node *n = c.n;
    const mt_op_info *oi = &mt_ops[n->op];
    const mt_value *a = mt__in(&c, 0), *b = mt__in(&c, 1), *o = mt__out(&c, 0);
    mt_err *err = c.err;
    switch (n->op) {
    case MT_OP_EMBED: case MT_OP_EMBED_BWD: {   /* i0 parts (0, 1: all tokens), i1 which part (a symbol): rows [i1*n, (i1+1)*n) */
        MT__T(mt__int_attr(&c, 0, 0, 4096));
        int64_t parts = n->iattr[0] > 1 ? n->iattr[0] : 1;
        const mt_value *tab = n->op == MT_OP_EMBED ? b : o;   /* the table, or its gradient */
        if (n->iattr[2] > 1) {   /* i2 shards S, i3 mine (a symbol): the table is my FSDP shard, the tokens every rank's */
            MT__T(mt__int_attr(&c, 2, 0, 4096));
            int sy = n->iattr[3];
            if (parts > 1 || !(n->sym_mask & 8u) || sy < 0 || sy >= c.g->n_syms || c.g->syms[sy].kind != MT_SYM_COORD ||
                c.g->syms[sy].max != n->iattr[2] - 1)
                return mt_errf(err, "%s: a table in %d shards needs this rank's coordinate over %d ranks (and one token slice)", oi->name,
                               n->iattr[2], n->iattr[2]);
            if (!tab || !tab->shard || (tab->flags & MT_VF_GATHERED) || mt_mesh_group_size(&c.g->mesh, tab->shard) != n->iattr[2] ||
                tab->shard != MT_DIMBIT(c.g->syms[sy].mesh_dim))
                return mt_errf(err, "%s: '%s' is not a shard over the %d ranks of the coordinate", oi->name, tab ? tab->name : "-", n->iattr[2]);
        } else if (tab && tab->shard && !(tab->flags & MT_VF_GATHERED)) {
            return mt_errf(err, "%s: '%s' is a shard: name the shards (i2) and this rank's (i3)", oi->name, tab->name);
        }
        if (parts > 1 && (!(n->sym_mask & 2u) || n->iattr[1] < 0 || n->iattr[1] >= c.g->n_syms || c.g->syms[n->iattr[1]].kind != MT_SYM_COORD ||
                          c.g->syms[n->iattr[1]].max != parts - 1))
            return mt_errf(err, "%s: a token slice of %lld parts needs a coordinate symbol over %lld ranks", oi->name, (long long)parts, (long long)parts);
        const mt_value *tk = n->op == MT_OP_EMBED ? a : b;
        MT__T(mt__is_index(&c, tk, "tokens", 1));
        MT__T(mt__shape(&c, tk, "tokens", 1, MT__ANY, 0, 0));
        if (tk->dims[0] % parts) return mt_errf(err, "%s: %lld tokens do not split in %lld parts", oi->name, (long long)tk->dims[0], (long long)parts);
        if (n->op == MT_OP_EMBED) {
            MT__T(mt__shape(&c, b, "wte", 2, MT__ANY, MT__ANY, 0));
            MT__T(mt__shape(&c, o, "x", 2, a->dims[0] / parts, b->dims[1], 0));
        } else {
            MT__T(mt__shape(&c, a, "dx", 2, tk->dims[0] / parts, MT__ANY, 0));
            MT__T(mt__shape(&c, o, "dwte", 2, MT__ANY, a->dims[1], 0));
        }
        break;
    }
    case MT_OP_RMSNORM:
        MT__T(mt__shape(&c, a, "x", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__shape(&c, b, "w", 1, a->dims[1], 0, 0));
        MT__T(mt__shape(&c, o, "y", 2, a->dims[0], a->dims[1], 0));
        MT__T(mt__shape(&c, mt__out(&c, 1), "rstd", 1, a->dims[0], 0, 0));
        if (!(n->fattr[0] > 0)) return mt_errf(err, "RMSNORM: eps must be > 0");
        break;
    case MT_OP_RMSNORM_BWD:
        MT__T(mt__shape(&c, b, "x", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__shape(&c, a, "dy", 2, b->dims[0], b->dims[1], 0));
        MT__T(mt__shape(&c, mt__in(&c, 2), "w", 1, b->dims[1], 0, 0));
        MT__T(mt__shape(&c, mt__in(&c, 3), "rstd", 1, b->dims[0], 0, 0));
        MT__T(mt__shape(&c, o, "dx", 2, b->dims[0], b->dims[1], 0));
        MT__T(mt__shape(&c, mt__out(&c, 1), "dw", 1, b->dims[1], 0, 0));
        break;
    case MT_OP_MATMUL: case MT_OP_MATMUL_ACC: {
        MT__T(mt__int_attr(&c, 0, 0, 1)); MT__T(mt__int_attr(&c, 1, 0, 1));
        MT__T(mt__shape(&c, a, "A", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__shape(&c, b, "B", 2, MT__ANY, MT__ANY, 0));
        int64_t M = a->dims[n->iattr[0] ? 1 : 0], K = a->dims[n->iattr[0] ? 0 : 1];
        int64_t Kb = b->dims[n->iattr[1] ? 1 : 0], Nn = b->dims[n->iattr[1] ? 0 : 1];
        if (K != Kb) return mt_errf(err, "MATMUL: inner sizes of '%s' and '%s' differ", a->name, b->name);
        MT__T(mt__shape(&c, o, "C", 2, M, Nn, 0));
        if (n->op == MT_OP_MATMUL_ACC) {
            MT__T(mt__shape(&c, mt__in(&c, 2), "acc", 2, M, Nn, 0));
            if (mt__in(&c, 2)->dtype != o->dtype) return mt_errf(err, "MATMUL_ACC: acc and C differ in dtype");
        }
        break;
    }
    case MT_OP_SPLIT: {
        const mt_value *o1 = mt__out(&c, 1);
        MT__T(mt__shape(&c, a, "x", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__shape(&c, o, "x1", 2, a->dims[0], MT__ANY, 0));
        MT__T(mt__shape(&c, o1, "x2", 2, a->dims[0], a->dims[1] - o->dims[1], 0));
        break;
    }
    case MT_OP_CONCAT: {
        MT__T(mt__shape(&c, o, "x", 2, MT__ANY, MT__ANY, 0));
        int64_t wa = n->iattr[0];
        if (wa < 0 || wa > o->dims[1]) return mt_errf(err, "CONCAT: split point %lld outside 0..%lld", (long long)wa, (long long)o->dims[1]);
        if (a) MT__T(mt__shape(&c, a, "x1", 2, o->dims[0], wa, 0));
        if (b) MT__T(mt__shape(&c, b, "x2", 2, o->dims[0], o->dims[1] - wa, 0));
        break;
    }
    case MT_OP_DOC_STARTS:
        MT__T(mt__int_attr(&c, 0, 1, 1 << 20)); MT__T(mt__int_attr(&c, 1, 0, INT_MAX));
        MT__T(mt__shape(&c, a, "tokens", 1, MT__ANY, 0, 0));
        if (a->dims[0] % n->iattr[0]) return mt_errf(err, "DOC_STARTS: %lld tokens is not a multiple of seq_len %d", (long long)a->dims[0], n->iattr[0]);
        MT__T(mt__shape(&c, o, "dstart", 1, a->dims[0], 0, 0));
        break;
    case MT_OP_SHIFT_TOKENS:
        MT__T(mt__int_attr(&c, 0, 1, 1 << 20)); MT__T(mt__int_attr(&c, 1, 0, 1 << 20)); MT__T(mt__int_attr(&c, 2, -1, INT_MAX));
        MT__T(mt__shape(&c, a, "x", 1, MT__ANY, 0, 0));
        if (a->dims[0] % n->iattr[0]) return mt_errf(err, "SHIFT_TOKENS: %lld tokens is not a multiple of seq_len %d", (long long)a->dims[0], n->iattr[0]);
        MT__T(mt__shape(&c, o, "y", 1, a->dims[0], 0, 0));
        break;
    case MT_OP_SWIGLU: case MT_OP_ADD: {   /* ADD also of 3-dim tensors: expert weight gradients (mt__moe's chunks) */
        int nd = n->op == MT_OP_ADD && a->ndim == 3 ? 3 : 2;
        int64_t d2 = nd == 3 ? a->dims[2] : 0;
        MT__T(mt__shape(&c, a, "a", nd, MT__ANY, MT__ANY, nd == 3 ? MT__ANY : 0));
        MT__T(mt__shape(&c, b, "b", nd, a->dims[0], a->dims[1], d2));
        MT__T(mt__shape(&c, o, "out", nd, a->dims[0], a->dims[1], d2));
        break;
    }
    case MT_OP_SWIGLU_BWD:
        MT__T(mt__shape(&c, a, "g", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__shape(&c, b, "u", 2, a->dims[0], a->dims[1], 0));
        MT__T(mt__shape(&c, mt__in(&c, 2), "dh", 2, a->dims[0], a->dims[1], 0));
        MT__T(mt__shape(&c, o, "dg", 2, a->dims[0], a->dims[1], 0));
        MT__T(mt__shape(&c, mt__out(&c, 1), "du", 2, a->dims[0], a->dims[1], 0));
        break;
    case MT_OP_ADD_RMSNORM:
        MT__T(mt__shape(&c, a, "a", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__shape(&c, b, "b", 2, a->dims[0], a->dims[1], 0));
        MT__T(mt__shape(&c, mt__in(&c, 2), "w", 1, a->dims[1], 0, 0));
        MT__T(mt__shape(&c, o, "h", 2, a->dims[0], a->dims[1], 0));
        MT__T(mt__shape(&c, mt__out(&c, 1), "y", 2, a->dims[0], a->dims[1], 0));
        MT__T(mt__shape(&c, mt__out(&c, 2), "rstd", 1, a->dims[0], 0, 0));
        if (!(n->fattr[0] > 0)) return mt_errf(err, "ADD_RMSNORM: eps must be > 0");
        break;
    case MT_OP_RMSNORM_BWD_ADD:
        MT__T(mt__shape(&c, b, "x", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__shape(&c, a, "dy", 2, b->dims[0], b->dims[1], 0));
        MT__T(mt__shape(&c, mt__in(&c, 2), "w", 1, b->dims[1], 0, 0));
        MT__T(mt__shape(&c, mt__in(&c, 3), "rstd", 1, b->dims[0], 0, 0));
        MT__T(mt__shape(&c, mt__in(&c, 4), "acc", 2, b->dims[0], b->dims[1], 0));
        MT__T(mt__shape(&c, o, "dx", 2, b->dims[0], b->dims[1], 0));
        MT__T(mt__shape(&c, mt__out(&c, 1), "dw", 1, b->dims[1], 0, 0));
        break;
    }
    return 0;
}
/* Attention: MLA's RoPE assembly and the attention ops, unfolded and folded (mt_pass_fold_rope). */
static int mt__check_attention(mt__ck c) {
    const mt_node *n = c.n;
    const mt_op_info *oi = &mt_ops[n->op];
    const mt_value *a = mt__in(&c, 0), *b = mt__in(&c, 1), *o = mt__out(&c, 0);
    mt_err *err = c.err;
    switch (n->op) {
    case MT_OP_MLA_ROPE: case MT_OP_MLA_ROPE_BWD: {
        MT__T(mt__int_attr(&c, 0, 1, 1024)); MT__T(mt__int_attr(&c, 1, 1, 1024));
        MT__T(mt__int_attr(&c, 2, 2, 1024)); MT__T(mt__int_attr(&c, 3, 1, 1024));
        MT__T(mt__int_attr(&c, 4, 1, 1 << 20));
        int64_t H = n->iattr[0], dn = n->iattr[1], dr = n->iattr[2], dv = n->iattr[3], T = n->iattr[4];
        if (dr % 2) return mt_errf(err, "%s: rope width %lld is odd", oi->name, (long long)dr);
        int fwd = n->op == MT_OP_MLA_ROPE;
        const mt_value *q = fwd ? a : o, *kv = fwd ? b : mt__out(&c, 1), *kpe = fwd ? mt__in(&c, 2) : mt__out(&c, 2);
        const mt_value *Q = fwd ? o : a, *K = fwd ? mt__out(&c, 1) : b, *V = fwd ? mt__out(&c, 2) : mt__in(&c, 2);
        MT__T(mt__shape(&c, q, "q", 2, MT__ANY, H * (dn + dr), 0));
        int64_t N = q->dims[0];
        if (N % T) return mt_errf(err, "%s: %lld tokens is not a multiple of seq_len %lld", oi->name, (long long)N, (long long)T);
        MT__T(mt__shape(&c, kv, "kv", 2, N, H * (dn + dv), 0));
        MT__T(mt__shape(&c, kpe, "kpe", 2, N, dr, 0));
        MT__T(mt__shape(&c, Q, "Q", 2, N, H * (dn + dr), 0));
        MT__T(mt__shape(&c, K, "K", 2, N, H * (dn + dr), 0));
        MT__T(mt__shape(&c, V, "V", 2, N, H * dv, 0));
        MT__T(mt__shape(&c, mt__in(&c, fwd ? 3 : 3), "cos", 2, T, dr / 2, 0));
        MT__T(mt__shape(&c, mt__in(&c, 4), "sin", 2, T, dr / 2, 0));
        break;
    }
    case MT_OP_ATTENTION: case MT_OP_ATTENTION_BWD: {
        MT__T(mt__int_attr(&c, 0, 1, 1024)); MT__T(mt__int_attr(&c, 1, 1, 2048));
        MT__T(mt__int_attr(&c, 2, 1, 2048)); MT__T(mt__int_attr(&c, 3, 1, 1 << 20));
        int64_t H = n->iattr[0], dq = n->iattr[1], dv = n->iattr[2], T = n->iattr[3];
        MT__T(mt__shape(&c, a, "Q", 2, MT__ANY, H * dq, 0));
        int64_t N = a->dims[0];
        if (N % T) return mt_errf(err, "%s: %lld tokens is not a multiple of seq_len %lld", oi->name, (long long)N, (long long)T);
        MT__T(mt__shape(&c, b, "K", 2, N, H * dq, 0));
        MT__T(mt__shape(&c, mt__in(&c, 2), "V", 2, N, H * dv, 0));
        if (n->op == MT_OP_ATTENTION) {
            MT__T(mt__shape(&c, o, "O", 2, N, H * dv, 0));
            MT__T(mt__shape(&c, mt__out(&c, 1), "lse", 2, N, H, 0));
        } else {
            MT__T(mt__shape(&c, mt__in(&c, 3), "O", 2, N, H * dv, 0));
            MT__T(mt__shape(&c, mt__in(&c, 4), "lse", 2, N, H, 0));
            MT__T(mt__shape(&c, mt__in(&c, 5), "dO", 2, N, H * dv, 0));
            MT__T(mt__shape(&c, o, "dQ", 2, N, H * dq, 0));
            MT__T(mt__shape(&c, mt__out(&c, 1), "dK", 2, N, H * dq, 0));
            MT__T(mt__shape(&c, mt__out(&c, 2), "dV", 2, N, H * dv, 0));
        }
        const mt_value *ds = mt__in(&c, n->op == MT_OP_ATTENTION ? 3 : 6);
        if (ds) MT__T(mt__shape(&c, ds, "dstart", 1, N, 0, 0));
        if (!(n->fattr[0] > 0)) return mt_errf(err, "%s: scale must be > 0", oi->name);
        break;
    }
    case MT_OP_ROPE_PE: case MT_OP_ROPE_PE_BWD: {
        MT__T(mt__int_attr(&c, 0, 1, 1024)); MT__T(mt__int_attr(&c, 1, 1, 1024));
        MT__T(mt__int_attr(&c, 2, 2, 1024)); MT__T(mt__int_attr(&c, 3, 1, 1024));
        MT__T(mt__int_attr(&c, 4, 1, 1 << 20));
        int64_t H = n->iattr[0], dn = n->iattr[1], dr = n->iattr[2], T = n->iattr[4];
        if (dr % 2) return mt_errf(err, "%s: rope width %lld is odd", oi->name, (long long)dr);
        int fwd = n->op == MT_OP_ROPE_PE;
        const mt_value *first = fwd ? a : o;   /* q [N, H*(dn+dr)] or dkpe [N, dr] */
        MT__T(mt__shape(&c, first, fwd ? "q" : "dkpe", 2, MT__ANY, fwd ? H * (dn + dr) : dr, 0));
        int64_t N = first->dims[0];
        if (N % T) return mt_errf(err, "%s: %lld tokens is not a multiple of seq_len %lld", oi->name, (long long)N, (long long)T);
        if (fwd) {
            MT__T(mt__shape(&c, b, "kpe", 2, N, dr, 0));
            MT__T(mt__shape(&c, o, "qr", 2, N, H * dr, 0));
            MT__T(mt__shape(&c, mt__out(&c, 1), "kr", 2, N, dr, 0));
        } else {
            MT__T(mt__shape(&c, a, "dkr", 2, N, H * dr, 0));
        }
        MT__T(mt__shape(&c, mt__in(&c, fwd ? 2 : 1), "cos", 2, T, dr / 2, 0));
        MT__T(mt__shape(&c, mt__in(&c, fwd ? 3 : 2), "sin", 2, T, dr / 2, 0));
        break;
    }
    case MT_OP_MLA_ATTENTION: case MT_OP_MLA_ATTENTION_BWD: {
        MT__T(mt__int_attr(&c, 0, 1, 1024)); MT__T(mt__int_attr(&c, 1, 2, 2048));
        MT__T(mt__int_attr(&c, 2, 1, 2048)); MT__T(mt__int_attr(&c, 3, 1, 1 << 20));
        MT__T(mt__int_attr(&c, 4, 1, 2047));
        int64_t H = n->iattr[0], dq = n->iattr[1], dv = n->iattr[2], T = n->iattr[3], dn = n->iattr[4], dr = dq - dn;
        if (dr <= 0 || dr % 2) return mt_errf(err, "%s: rope width %lld (dq %lld - dn %lld) is not positive and even", oi->name,
                                              (long long)dr, (long long)dq, (long long)dn);
        MT__T(mt__shape(&c, a, "q", 2, MT__ANY, H * dq, 0));
        int64_t N = a->dims[0];
        if (N % T) return mt_errf(err, "%s: %lld tokens is not a multiple of seq_len %lld", oi->name, (long long)N, (long long)T);
        MT__T(mt__shape(&c, b, "kv", 2, N, H * (dn + dv), 0));
        MT__T(mt__shape(&c, mt__in(&c, 2), "qr", 2, N, H * dr, 0));
        MT__T(mt__shape(&c, mt__in(&c, 3), "kr", 2, N, dr, 0));
        const mt_value *ds;
        if (n->op == MT_OP_MLA_ATTENTION) {
            MT__T(mt__shape(&c, o, "O", 2, N, H * dv, 0));
            MT__T(mt__shape(&c, mt__out(&c, 1), "lse", 2, N, H, 0));
            ds = mt__in(&c, 4);
        } else {
            MT__T(mt__shape(&c, mt__in(&c, 4), "O", 2, N, H * dv, 0));
            MT__T(mt__shape(&c, mt__in(&c, 5), "lse", 2, N, H, 0));
            MT__T(mt__shape(&c, mt__in(&c, 6), "dO", 2, N, H * dv, 0));
            MT__T(mt__shape(&c, mt__in(&c, 8), "cos", 2, T, dr / 2, 0));
            MT__T(mt__shape(&c, mt__in(&c, 9), "sin", 2, T, dr / 2, 0));
            MT__T(mt__shape(&c, o, "dq", 2, N, H * dq, 0));
            MT__T(mt__shape(&c, mt__out(&c, 1), "dkv", 2, N, H * (dn + dv), 0));
            MT__T(mt__shape(&c, mt__out(&c, 2), "dkr", 2, N, H * dr, 0));
            ds = mt__in(&c, 7);
        }
        if (ds) MT__T(mt__shape(&c, ds, "dstart", 1, N, 0, 0));
        if (!(n->fattr[0] > 0)) return mt_errf(err, "%s: scale must be > 0", oi->name);
        break;
    }
    }
    return 0;
}
/* Mixture of experts: router, permutation, the expert exchange, grouped GEMMs, combine. */
static int mt__check_moe(mt__ck c) {
    const mt_node *n = c.n;
    const mt_value *a = mt__in(&c, 0), *b = mt__in(&c, 1), *o = mt__out(&c, 0);
    mt_err *err = c.err;
    switch (n->op) {
    case MT_OP_ROUTER: case MT_OP_ROUTER_BWD: {
        MT__T(mt__int_attr(&c, 0, 1, 64)); MT__T(mt__int_attr(&c, 1, 0, 1)); MT__T(mt__int_attr(&c, 2, 0, 1));
        MT__T(mt__int_attr(&c, 3, 1, 4096)); MT__T(mt__int_attr(&c, 4, 1, 4096));
        int64_t K = n->iattr[0];
        const mt_value *lg = n->op == MT_OP_ROUTER ? a : o;
        MT__T(mt__shape(&c, lg, "logits", 2, MT__ANY, MT__ANY, 0));
        int64_t N = lg->dims[0], E = lg->dims[1];
        if (K > E || E % n->iattr[3] || n->iattr[4] > n->iattr[3])
            return mt_errf(err, "ROUTER: top_k/groups inconsistent with %lld experts", (long long)E);
        if (n->op == MT_OP_ROUTER) {
            MT__T(mt__shape(&c, b, "bias", 1, E, 0, 0));
            MT__T(mt__is_index(&c, o, "idx", 1)); MT__T(mt__shape(&c, o, "idx", 2, N, K, 0));
            MT__T(mt__shape(&c, mt__out(&c, 1), "w", 2, N, K, 0));
            MT__T(mt__shape(&c, mt__out(&c, 2), "scores", 2, N, E, 0));
            MT__T(mt__is_index(&c, mt__out(&c, 3), "counts", 1));
            MT__T(mt__shape(&c, mt__out(&c, 3), "counts", 1, E, 0, 0));
        } else {
            MT__T(mt__shape(&c, a, "scores", 2, N, E, 0));
            MT__T(mt__is_index(&c, b, "idx", 1)); MT__T(mt__shape(&c, b, "idx", 2, N, K, 0));
            MT__T(mt__shape(&c, mt__in(&c, 2), "w", 2, N, K, 0));
            MT__T(mt__shape(&c, mt__in(&c, 3), "dw", 2, N, K, 0));
        }
        break;
    }
    case MT_OP_MOE_PERMUTE: {
        MT__T(mt__int_attr(&c, 0, 1, 4096));
        MT__T(mt__shape(&c, a, "x", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__is_index(&c, b, "idx", 1)); MT__T(mt__shape(&c, b, "idx", 2, a->dims[0], MT__ANY, 0));
        MT__T(mt__shape(&c, o, "xs", 2, MT__ANY, a->dims[1], 0));
        int64_t NK = o->dims[0];
        MT__T(mt__row_chunk(&c, NK, b->dims[1], a->dims[0]));
        MT__T(mt__is_index(&c, mt__out(&c, 1), "slot", 1)); MT__T(mt__shape(&c, mt__out(&c, 1), "slot", 1, NK, 0, 0));
        MT__T(mt__is_index(&c, mt__out(&c, 2), "offs", 1)); MT__T(mt__shape(&c, mt__out(&c, 2), "offs", 1, n->iattr[0] + 1, 0, 0));
        break;
    }
    case MT_OP_MOE_PERMUTE_BWD:
        MT__T(mt__int_attr(&c, 0, 1, 64));
        MT__T(mt__shape(&c, a, "dxs", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__is_index(&c, b, "slot", 1)); MT__T(mt__shape(&c, b, "slot", 1, a->dims[0], 0, 0));
        MT__T(mt__shape(&c, o, "dx", 2, MT__ANY, a->dims[1], 0));
        MT__T(mt__row_chunk(&c, a->dims[0], n->iattr[0], o->dims[0]));
        break;
    case MT_OP_EP_COUNTS: /* i0 mesh mask, i1 channel, i2 ep size, i3 E_local, i4 ep coord (symbol) */
        MT__T(mt__int_attr(&c, 1, 0, MT_CHANNEL_EP)); MT__T(mt__int_attr(&c, 2, 1, 4096)); MT__T(mt__int_attr(&c, 3, 1, 4096));
        MT__T(mt__is_index(&c, a, "offs", 1));
        MT__T(mt__shape(&c, a, "offs", 1, (int64_t)n->iattr[2] * n->iattr[3] + 1, 0, 0));
        MT__T(mt__is_index(&c, o, "recv", 1));
        MT__T(mt__shape(&c, o, "recv", 2, n->iattr[2], n->iattr[3], 0));
        break;
    case MT_OP_EP_DISPATCH: case MT_OP_EP_COMBINE: {
        MT__T(mt__int_attr(&c, 1, 0, MT_CHANNEL_EP)); MT__T(mt__int_attr(&c, 2, 1, 4096)); MT__T(mt__int_attr(&c, 3, 1, 4096));
        int64_t ep = n->iattr[2], El = n->iattr[3];
        const mt_value *src = a, *dst = o;
        MT__T(mt__shape(&c, src, "x", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__shape(&c, dst, "y", 2, MT__ANY, src->dims[1], 0));
        MT__T(mt__is_index(&c, b, "offs", 1)); MT__T(mt__shape(&c, b, "offs", 1, ep * El + 1, 0, 0));
        MT__T(mt__is_index(&c, mt__in(&c, 2), "recv", 1)); MT__T(mt__shape(&c, mt__in(&c, 2), "recv", 2, ep, El, 0));
        if (n->op == MT_OP_EP_DISPATCH) {
            MT__T(mt__is_index(&c, mt__out(&c, 1), "roffs", 1));
            MT__T(mt__shape(&c, mt__out(&c, 1), "roffs", 1, El + 1, 0, 0));
        }
        break;
    }
    case MT_OP_GMM_GLU: {
        const mt_value *offs = mt__in(&c, 2), *W2 = mt__in(&c, 3);
        MT__T(mt__shape(&c, b, "Wg", 3, MT__ANY, MT__ANY, MT__ANY));
        int64_t E = b->dims[0], M = b->dims[1], K = b->dims[2];
        MT__T(mt__is_index(&c, offs, "offs", 1)); MT__T(mt__shape(&c, offs, "offs", 1, E + 1, 0, 0));
        MT__T(mt__shape(&c, W2, "Wu", 3, E, M, K));
        MT__T(mt__shape(&c, a, "X", 2, MT__ANY, K, 0));
        MT__T(mt__shape(&c, o, "g", 2, a->dims[0], M, 0));
        MT__T(mt__shape(&c, mt__out(&c, 1), "u", 2, a->dims[0], M, 0));
        MT__T(mt__shape(&c, mt__out(&c, 2), "h", 2, a->dims[0], M, 0));
        if (W2->dtype != b->dtype || mt__out(&c, 1)->dtype != o->dtype || mt__out(&c, 2)->dtype != o->dtype)
            return mt_errf(err, "GMM_GLU: gate and up differ in dtype");
        break;
    }
    case MT_OP_GMM: case MT_OP_GMM_DX: case MT_OP_GMM_DW: case MT_OP_GMM_DX2: case MT_OP_GMM_DW_SQ: {
        const mt_value *W = (n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ) ? o : b, *offs = mt__in(&c, 2);
        MT__T(mt__shape(&c, W, "W", 3, MT__ANY, MT__ANY, MT__ANY));
        int64_t E = W->dims[0], M = W->dims[1], K = W->dims[2];
        MT__T(mt__is_index(&c, offs, "offs", 1)); MT__T(mt__shape(&c, offs, "offs", 1, E + 1, 0, 0));
        if (n->op == MT_OP_GMM) {
            MT__T(mt__shape(&c, a, "X", 2, MT__ANY, K, 0));
            MT__T(mt__shape(&c, o, "Y", 2, a->dims[0], M, 0));
        } else if (n->op == MT_OP_GMM_DX || n->op == MT_OP_GMM_DX2) {
            MT__T(mt__shape(&c, a, "dY", 2, MT__ANY, M, 0));
            MT__T(mt__shape(&c, o, "dX", 2, a->dims[0], K, 0));
            if (n->op == MT_OP_GMM_DX2) {   /* the second pair has the first one's shapes */
                MT__T(mt__shape(&c, mt__in(&c, 3), "dY2", 2, a->dims[0], M, 0));
                MT__T(mt__shape(&c, mt__in(&c, 4), "W2", 3, E, M, K));
                if (mt__in(&c, 3)->dtype != a->dtype || mt__in(&c, 4)->dtype != W->dtype)
                    return mt_errf(err, "GMM_DX2: the two pairs differ in dtype");
            }
        } else {
            MT__T(mt__shape(&c, a, "dY", 2, MT__ANY, M, 0));
            MT__T(mt__shape(&c, b, "X", 2, a->dims[0], K, 0));
            if (n->op == MT_OP_GMM_DW_SQ) {
                const mt_value *q = mt__out(&c, 1);
                MT__T(mt__shape(&c, q, "ssq", 1, mt_node_fp8(n) ? mt_gmm_ssq_len_fp8(E, M, K) : mt_gmm_ssq_len(E, M, K), 0, 0));
                if (q->dtype != MT_F32 || o->dtype != MT_F32) return mt_errf(err, "GMM_DW_SQ: dW and ssq must be f32");
            }
        }
        break;
    }
    case MT_OP_MOE_COMBINE:
        MT__T(mt__is_index(&c, b, "slot", 1)); MT__T(mt__shape(&c, b, "slot", 1, MT__ANY, 0, 0));
        MT__T(mt__shape(&c, mt__in(&c, 2), "w", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__shape(&c, a, "ys", 2, b->dims[0], MT__ANY, 0));
        MT__T(mt__row_chunk(&c, b->dims[0], mt__in(&c, 2)->dims[1], mt__in(&c, 2)->dims[0]));
        MT__T(mt__shape(&c, o, "y", 2, mt__in(&c, 2)->dims[0], a->dims[1], 0));
        break;
    case MT_OP_MOE_COMBINE_BWD: {
        const mt_value *ys = b, *slot = mt__in(&c, 2), *w = mt__in(&c, 3);
        MT__T(mt__is_index(&c, slot, "slot", 1)); MT__T(mt__shape(&c, slot, "slot", 1, MT__ANY, 0, 0));
        MT__T(mt__shape(&c, w, "w", 2, MT__ANY, MT__ANY, 0));
        MT__T(mt__row_chunk(&c, slot->dims[0], w->dims[1], w->dims[0]));
        MT__T(mt__shape(&c, ys, "ys", 2, slot->dims[0], MT__ANY, 0));
        MT__T(mt__shape(&c, a, "dy", 2, w->dims[0], ys->dims[1], 0));
        MT__T(mt__shape(&c, o, "dys", 2, slot->dims[0], ys->dims[1], 0));
        MT__T(mt__shape(&c, mt__out(&c, 1), "dw", 2, w->dims[0], w->dims[1], 0));
        break;
    }
    }
    return 0;
}
/* The loss: cross-entropy, whole or on vocab shards (tensor parallelism). */
static int mt__check_loss(mt__ck c) {
    const mt_node *n = c.n;
    const mt_op_info *oi = &mt_ops[n->op];
    const mt_value *a = mt__in(&c, 0), *b = mt__in(&c, 1), *o = mt__out(&c, 0);
    mt_err *err = c.err;
    /* i1: the rows the mean counts (0: all; targets < 0 are left out), f0: the loss's weight in the backward (0: 1) */
    if (n->op != MT_OP_CE_STATS) {
        const mt_value *tg = mt__in(&c, n->op == MT_OP_CROSS_ENTROPY ? 1 : 2);
        MT__T(mt__int_attr(&c, 1, 0, tg ? (int)tg->dims[0] : 0));
        if (n->fattr[0] < 0) return mt_errf(err, "%s: the loss weight %g is negative", oi->name, (double)n->fattr[0]);
    }
    switch (n->op) {
    case MT_OP_CE_STATS: case MT_OP_CE_COMBINE: case MT_OP_CE_SHARD_BWD: {   /* the vocab-parallel cross-entropy */
        const mt_value *lg = n->op == MT_OP_CE_COMBINE ? b : a;
        const mt_value *tg = n->op == MT_OP_CE_STATS ? b : mt__in(&c, 2);
        MT__T(mt__shape(&c, lg, "logits", 2, MT__ANY, MT__ANY, 0));
        int64_t N = lg->dims[0];
        MT__T(mt__is_index(&c, tg, "targets", 1)); MT__T(mt__shape(&c, tg, "targets", 1, N, 0, 0));
        if (n->op != MT_OP_CE_COMBINE && !(n->sym_mask & 1u)) return mt_errf(err, "%s: the shard's coordinate must be a symbol", oi->name);
        if (n->op == MT_OP_CE_STATS) {
            MT__T(mt__shape(&c, o, "stats", 2, N, 3, 0));
            if (o->dtype != MT_F32) return mt_errf(err, "CE_STATS: stats must be f32");
        } else if (n->op == MT_OP_CE_COMBINE) {
            MT__T(mt__shape(&c, a, "stats", 2, MT__ANY, 3, 0));
            if (a->dims[0] < N || a->dims[0] % N) return mt_errf(err, "CE_COMBINE: stats of %lld rows for %lld tokens", (long long)a->dims[0], (long long)N);
            MT__T(mt__shape(&c, o, "loss", 1, 1, 0, 0));
            MT__T(mt__shape(&c, mt__out(&c, 1), "lse", 1, N, 0, 0));
            if (a->dtype != MT_F32 || o->dtype != MT_F32 || mt__out(&c, 1)->dtype != MT_F32) return mt_errf(err, "CE_COMBINE: stats, loss and lse must be f32");
        } else {
            MT__T(mt__shape(&c, b, "lse", 1, N, 0, 0));
            MT__T(mt__shape(&c, o, "dlogits", 2, N, lg->dims[1], 0));
        }
        break;
    }
    case MT_OP_CROSS_ENTROPY: case MT_OP_CROSS_ENTROPY_BWD: {
        MT__T(mt__shape(&c, a, "logits", 2, MT__ANY, MT__ANY, 0));
        const mt_value *tg = n->op == MT_OP_CROSS_ENTROPY ? b : mt__in(&c, 2);
        MT__T(mt__is_index(&c, tg, "targets", 1)); MT__T(mt__shape(&c, tg, "targets", 1, a->dims[0], 0, 0));
        if (n->op == MT_OP_CROSS_ENTROPY) {
            MT__T(mt__shape(&c, o, "loss", 1, 1, 0, 0));
            MT__T(mt__shape(&c, mt__out(&c, 1), "lse", 1, a->dims[0], 0, 0));
        } else {
            MT__T(mt__shape(&c, b, "lse", 1, a->dims[0], 0, 0));
            MT__T(mt__shape(&c, o, "dlogits", 2, a->dims[0], a->dims[1], 0));
        }
        break;
    }
    }
    return 0;
}
/* Collectives over mesh groups: all-reduce, FSDP's all-gather and reduce-scatter, sequence parallelism. */
static int mt__check_collective(mt__ck c) {
    const mt_graph *g = c.g;
    const mt_node *n = c.n;
    const mt_op_info *oi = &mt_ops[n->op];
    const mt_value *a = mt__in(&c, 0), *o = mt__out(&c, 0);
    mt_err *err = c.err;
    switch (n->op) {
    case MT_OP_SP_GATHER: case MT_OP_SP_SCATTER: {   /* rows split over the group: y = [x_0; x_1; ...] or my rows of the sum */
        MT__T(mt__int_attr(&c, 0, 1, (1 << MT_NDIMS) - 1)); MT__T(mt__int_attr(&c, 1, 0, 7));
        uint32_t mask = (uint32_t)n->iattr[0];
        if (!mt_mesh_mask_valid(mask)) return mt_errf(err, "%s: mesh mask 0x%x mixes bases", oi->name, n->iattr[0]);
        int64_t S = mt_mesh_group_size(&g->mesh, mask);
        const mt_value *part = n->op == MT_OP_SP_GATHER ? a : o, *whole = n->op == MT_OP_SP_GATHER ? o : a;
        if (n->op == MT_OP_SP_GATHER && part && part->ndim == 1) {   /* token ids [n] -> [n*S] */
            MT__T(mt__shape(&c, whole, "whole", 1, part->dims[0] * S, 0, 0));
        } else {
            MT__T(mt__shape(&c, part, "part", 2, MT__ANY, MT__ANY, 0));
            MT__T(mt__shape(&c, whole, "whole", 2, part->dims[0] * S, part->dims[1], 0));
        }
        if (part->dtype != whole->dtype) return mt_errf(err, "%s: '%s' and '%s' differ in dtype", oi->name, part->name, whole->name);
        if (part->dims[0] < 0 || part->shard || whole->shard) return mt_errf(err, "%s: '%s' must be a plain, fixed-size activation", oi->name, part->name);
        break;
    }
    case MT_OP_ALLREDUCE:
        MT__T(mt__int_attr(&c, 0, 0, (1 << MT_NDIMS) - 1)); MT__T(mt__int_attr(&c, 1, 0, 7));
        MT__T(mt__int_attr(&c, 2, 0, 1));
        if (!mt_mesh_mask_valid((uint32_t)n->iattr[0])) return mt_errf(err, "ALLREDUCE: mesh mask 0x%x mixes bases", n->iattr[0]);
        if (n->in[0] != n->out[0]) return mt_errf(err, "ALLREDUCE must be in place");
        break;
    case MT_OP_ALLGATHER: case MT_OP_REDUCE_SCATTER: {   /* i0: the mask the shards are spread over */
        MT__T(mt__int_attr(&c, 0, 1, (1 << MT_NDIMS) - 1)); MT__T(mt__int_attr(&c, 1, 0, 7));
        uint32_t mask = (uint32_t)n->iattr[0];
        if (!mt_mesh_mask_valid(mask)) return mt_errf(err, "%s: mesh mask 0x%x mixes bases", oi->name, n->iattr[0]);
        const mt_value *part = n->op == MT_OP_ALLGATHER ? a : o, *whole = n->op == MT_OP_ALLGATHER ? o : a;
        if (part->shard != mask || (part->flags & MT_VF_GATHERED))
            return mt_errf(err, "%s: '%s' is not a shard over mask 0x%x", oi->name, part->name, mask);
        if (whole->shard != mask || !(whole->flags & MT_VF_GATHERED))
            return mt_errf(err, "%s: '%s' is not a gathered tensor over mask 0x%x", oi->name, whole->name, mask);
        if (part->dtype != whole->dtype || (n->op == MT_OP_REDUCE_SCATTER && part->dtype != MT_F32))
            return mt_errf(err, "%s: '%s' and '%s' differ in dtype (reduce-scatter is f32)", oi->name, part->name, whole->name);
        MT__T(mt__shape(&c, whole, "whole", part->ndim, part->dims[0], part->dims[1], part->dims[2]));
        for (int d = 0; d < part->ndim; d++)
            if (part->dims[d] < 0) return mt_errf(err, "%s: '%s' has a symbolic size", oi->name, part->name);
        break;
    }
    }
    return 0;
}
/* The optimizer: gradient norm, learning rate, clipping, AdamW, the expert-bias update. */
static int mt__check_optimizer(mt__ck c) {
    const mt_node *n = c.n;
    const mt_value *a = mt__in(&c, 0), *b = mt__in(&c, 1), *o = mt__out(&c, 0);
    mt_err *err = c.err;
    switch (n->op) {
    case MT_OP_SUMSQ:
        MT__T(mt__int_attr(&c, 0, 0, 1));
        MT__T(mt__is_index(&c, a, "g", 0));
        if (b) MT__T(mt__shape(&c, b, "acc_in", 1, 1, 0, 0));
        MT__T(mt__shape(&c, o, "acc_out", 1, 1, 0, 0));
        break;
    case MT_OP_LR_SCHEDULE:
        MT__T(mt__shape(&c, a, "hparams", 1, MT_HP_COUNT, 0, 0));
        MT__T(mt__is_index(&c, b, "step", 1)); MT__T(mt__shape(&c, b, "step", 1, 1, 0, 0));
        MT__T(mt__shape(&c, o, "lr", 1, 1, 0, 0));
        break;
    case MT_OP_CLIP:
        MT__T(mt__shape(&c, a, "sumsq", 1, 1, 0, 0));
        MT__T(mt__shape(&c, b, "hparams", 1, MT_HP_COUNT, 0, 0));
        MT__T(mt__shape(&c, o, "coef", 1, 1, 0, 0));
        MT__T(mt__shape(&c, mt__out(&c, 1), "norm", 1, 1, 0, 0));
        break;
    case MT_OP_ADAMW: {
        MT__T(mt__int_attr(&c, 0, 0, 1));
        const mt_value *p = a, *gr = b, *m = mt__in(&c, 2), *v = mt__in(&c, 3);
        if (p->dtype != MT_F32 || gr->dtype != MT_F32 || (m->dtype != MT_F32 && m->dtype != MT_BF16) || v->dtype != m->dtype)
            return mt_errf(err, "ADAMW: param and grad of '%s' must be f32, its moments both f32 or both bf16", p->name);
        MT__T(mt__same_numel(&c, p, gr)); MT__T(mt__same_numel(&c, p, m)); MT__T(mt__same_numel(&c, p, v));
        MT__T(mt__shape(&c, mt__in(&c, 4), "lr", 1, 1, 0, 0));
        MT__T(mt__shape(&c, mt__in(&c, 5), "coef", 1, 1, 0, 0));
        MT__T(mt__shape(&c, mt__in(&c, 6), "hparams", 1, MT_HP_COUNT, 0, 0));
        MT__T(mt__is_index(&c, mt__in(&c, 7), "step", 1));
        if (n->out[0] != n->in[0] || n->out[1] != n->in[2] || n->out[2] != n->in[3])
            return mt_errf(err, "ADAMW must update param and moments in place");
        MT__T(mt__persistent(&c, p)); MT__T(mt__persistent(&c, m)); MT__T(mt__persistent(&c, v));
        if (n->out[3] >= 0) { MT__T(mt__same_numel(&c, p, mt__out(&c, 3))); MT__T(mt__persistent(&c, mt__out(&c, 3))); }
        break;
    }
    case MT_OP_EXPERT_BIAS_UPDATE:
        MT__T(mt__shape(&c, a, "bias", 1, MT__ANY, 0, 0));
        MT__T(mt__is_index(&c, b, "counts", 1)); MT__T(mt__shape(&c, b, "counts", 1, a->dims[0], 0, 0));
        if (n->out[0] != n->in[0]) return mt_errf(err, "EXPERT_BIAS_UPDATE must be in place");
        MT__T(mt__persistent(&c, a));
        break;
    }
    return 0;
}
/* FP8 GEMMs (mt_pass_fp8): the ops it may mark, and the FP8 kernels' rules for such a node: a forward,
 * input-gradient or weight-gradient form, every width a multiple of 16 (a grouped GEMM's rows may be
 * anything), bf16 operands on CUDA. */
static int mt__fp8_gemm_op(int op) {
    return op == MT_OP_MATMUL || op == MT_OP_MATMUL_ACC || op == MT_OP_GMM || op == MT_OP_GMM_DX || op == MT_OP_GMM_DW ||
           op == MT_OP_GMM_DX2 || op == MT_OP_GMM_GLU || op == MT_OP_GMM_DW_SQ;
}
int mt_node_fp8(const mt_node *n) { return mt__fp8_gemm_op(n->op) && n->iattr[MT_IATTR_FP8] == 1; }
static int mt__w16(const mt_value *x, int from) {   /* dims from `from` on: literal multiples of 16 */
    for (int d = from; d < x->ndim; d++) if (x->dims[d] < 16 || x->dims[d] % 16) return 0;
    return 1;
}
static int mt__fp8_shapes(const mt_graph *g, const mt_node *n) {
    if (!mt__fp8_gemm_op(n->op)) return 0;
    int ops[4] = {n->in[0], n->in[1], -1, -1};   /* the GEMM operands */
    if (n->op == MT_OP_MATMUL || n->op == MT_OP_MATMUL_ACC) {
        if (n->iattr[0] && n->iattr[1]) return 0;
        if (!mt__w16(&g->values[n->in[0]], 0) || !mt__w16(&g->values[n->in[1]], 0) || !mt__w16(&g->values[n->out[0]], 0)) return 0;
    } else {
        const mt_value *W = &g->values[n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ ? n->out[0] : n->in[1]];   /* [E, M, K] */
        if (W->ndim != 3 || !mt__w16(W, 1)) return 0;
        if (n->op == MT_OP_GMM_DX2) { ops[2] = n->in[3]; ops[3] = n->in[4]; }   /* shaped as the first pair (mt__check_moe) */
        if (n->op == MT_OP_GMM_GLU) ops[2] = n->in[3];
    }
    for (int k = 0; k < 4; k++)
        if (ops[k] >= 0 && g->target.backend == MT_BACKEND_CUDA && g->values[ops[k]].dtype != MT_BF16) return 0;
    return 1;
}
int mt_check_node(const mt_graph *g, const mt_node *n, mt_err *err) {
    MT__T(mt__check_refs(g, n, err));
    mt__ck c = {g, n, err};
    switch (n->op) {   /* the op's own shape rules, by family */
    case MT_OP_EMBED: case MT_OP_EMBED_BWD: case MT_OP_RMSNORM: case MT_OP_RMSNORM_BWD: case MT_OP_MATMUL:
    case MT_OP_MATMUL_ACC: case MT_OP_SPLIT: case MT_OP_CONCAT: case MT_OP_DOC_STARTS: case MT_OP_SWIGLU:
    case MT_OP_ADD: case MT_OP_SWIGLU_BWD: case MT_OP_ADD_RMSNORM: case MT_OP_RMSNORM_BWD_ADD: case MT_OP_SHIFT_TOKENS:
        MT__T(mt__check_dense(c));
        break;
    case MT_OP_MLA_ROPE: case MT_OP_MLA_ROPE_BWD: case MT_OP_ATTENTION: case MT_OP_ATTENTION_BWD: case MT_OP_ROPE_PE:
    case MT_OP_ROPE_PE_BWD: case MT_OP_MLA_ATTENTION: case MT_OP_MLA_ATTENTION_BWD:
        MT__T(mt__check_attention(c));
        break;
    case MT_OP_ROUTER: case MT_OP_ROUTER_BWD: case MT_OP_MOE_PERMUTE: case MT_OP_MOE_PERMUTE_BWD:
    case MT_OP_EP_COUNTS: case MT_OP_EP_DISPATCH: case MT_OP_EP_COMBINE: case MT_OP_GMM_GLU: case MT_OP_GMM:
    case MT_OP_GMM_DX: case MT_OP_GMM_DW: case MT_OP_GMM_DX2: case MT_OP_GMM_DW_SQ: case MT_OP_MOE_COMBINE:
    case MT_OP_MOE_COMBINE_BWD:
        MT__T(mt__check_moe(c));
        break;
    case MT_OP_CE_STATS: case MT_OP_CE_COMBINE: case MT_OP_CE_SHARD_BWD: case MT_OP_CROSS_ENTROPY:
    case MT_OP_CROSS_ENTROPY_BWD:
        MT__T(mt__check_loss(c));
        break;
    case MT_OP_SP_GATHER: case MT_OP_SP_SCATTER: case MT_OP_ALLREDUCE: case MT_OP_ALLGATHER:
    case MT_OP_REDUCE_SCATTER:
        MT__T(mt__check_collective(c));
        break;
    case MT_OP_SUMSQ: case MT_OP_LR_SCHEDULE: case MT_OP_CLIP: case MT_OP_ADAMW: case MT_OP_EXPERT_BIAS_UPDATE:
        MT__T(mt__check_optimizer(c));
        break;
    }
    /* the FP8 mark: only where the FP8 GEMMs can run the node */
    if (n->iattr[MT_IATTR_FP8] && (!mt_node_fp8(n) || !mt__fp8_shapes(g, n)))
        return mt_errf(err, "%s: FP8 mark %d where the FP8 GEMMs cannot run it", mt_ops[n->op].name, n->iattr[MT_IATTR_FP8]);
    /* every operand is an index (i32) or floating point, as the op says */
    uint32_t in_idx, out_idx;
    if (mt__index_operands(n->op, &in_idx, &out_idx) == 0) {
        for (int i = 0; i < n->n_in; i++) {
            const mt_value *v = mt__in(&c, i);
            if (v) MT__T(mt__is_index(&c, v, "input", (int)((in_idx >> i) & 1)));
        }
        for (int i = 0; i < n->n_out; i++) {
            const mt_value *v = mt__out(&c, i);
            if (v) MT__T(mt__is_index(&c, v, "output", (int)((out_idx >> i) & 1)));
        }
    }
    return 0;
}
#undef MT__T

/* ========================================================================
 * 5. Builder
 * The model code below reads like a forward pass, but each call appends a
 * node to the graph instead of computing. The backward is then derived by
 * walking the forward nodes in reverse and applying each op's rule.
 * ====================================================================== */

typedef struct {
    int32_t grad;            /* id of dLoss/dvalue, or -1 */
    int32_t master;          /* for a compute shadow: its f32 master; else -1 */
    int32_t req;             /* depends on a trainable param */
    int32_t shard_of;        /* for an all-gathered weight: the shard it was gathered from; else -1 */
    int32_t again;           /* what the backward reads for it: its re-gather (FSDP reshards after the forward),
                                itself where the forward's copy is kept (mt__regather), or -1 before the first ask */
} mt__vinfo;
typedef struct {
    mt_graph *g;
    mt_err *err;
    int failed;
    int phase, layer;
    int act;                 /* activation dtype: MT_F32 (CPU) or MT_BF16 (CUDA) */
    mt__vinfo *vi;           /* per value */
    int cap;
    int32_t *params; int n_params, cap_params;   /* trainable masters, creation order */
    int32_t *counts; int32_t *biases; int n_moe; /* per MoE layer */
    uint64_t *names; int names_cap, n_names;     /* hash set of value names */
    int cos, sin;            /* RoPE tables */
    int doc;                 /* document starts [N] i32 (doc_mask), else -1 */
    int sym_coord[MT_NDIMS], sym_recv[MT_MOE_CHUNKS_MAX];   /* sym_recv: per chunk of tokens */
    int chunks;              /* each MoE layer's routed experts run over this many chunks of its tokens */
    int keep_from;           /* backward: a gathered weight read by the forward at or after this node keeps its copy */
} mt__builder;

static int mt__grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return 0;
    int nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    void *q = MT_REALLOC(*p, (size_t)nc * elem);
    if (!q) return -1;
    memset((char *)q + (size_t)*cap * elem, 0, (size_t)(nc - *cap) * elem);
    *p = q; *cap = nc;
    return 0;
}

static int mt__fail(mt__builder *b, const char *fmt, const char *a) {
    if (!b->failed) { mt_errf(b->err, fmt, a); b->failed = 1; }
    return -1;
}

/* name set: returns 1 if newly inserted */
static int mt__name_insert(mt__builder *b, const char *name) {
    if (b->n_names * 2 + 2 > b->names_cap) {
        int nc = b->names_cap ? b->names_cap * 2 : 1024;
        uint64_t *t = (uint64_t *)mt__calloc(sizeof(uint64_t) * (size_t)nc);
        if (!t) return -1;
        for (int i = 0; i < b->names_cap; i++)
            if (b->names[i]) {
                int j = (int)(b->names[i] % (uint64_t)nc);
                while (t[j]) j = (j + 1) % nc;
                t[j] = b->names[i];
            }
        MT_FREE(b->names); b->names = t; b->names_cap = nc;
    }
    uint64_t h = mt_hash(name, strlen(name), MT_HASH_INIT) | 1;
    int j = (int)(h % (uint64_t)b->names_cap);
    while (b->names[j]) { if (b->names[j] == h) return 0; j = (j + 1) % b->names_cap; }
    b->names[j] = h; b->n_names++;
    return 1;
}

/* Create a value. Names are made unique by appending '#2', '#3', ... */
static int mt__value(mt__builder *b, const char *name, int dtype, int role, int ndim, int64_t d0,
                     int64_t d1, int64_t d2) {
    if (b->failed) return -1;
    mt_graph *g = b->g;
    if (mt__grow((void **)&g->values, &g->cap_values, g->n_values + 1, sizeof(mt_value)) ||
        mt__grow((void **)&b->vi, &b->cap, g->n_values + 1, sizeof(mt__vinfo)))
        return mt__fail(b, "%sout of memory", "");
    int id = g->n_values++;
    mt_value *v = &g->values[id];
    memset(v, 0, sizeof *v);
    char nm[MT_NAME_LEN];
    snprintf(nm, sizeof nm, "%s", name);
    for (int k = 2; mt__name_insert(b, nm) == 0; k++) snprintf(nm, sizeof nm, "%.*s#%d", MT_NAME_LEN - 8, name, k);
    memcpy(v->name, nm, sizeof nm);
    v->dtype = dtype; v->role = role; v->ndim = ndim;
    v->dims[0] = d0; v->dims[1] = d1; v->dims[2] = d2;
    v->param = -1; v->offset = -1; v->data_offset = -1;
    v->nbytes = mt_value_numel_max(g, v) * mt_dtype_bytes(g, dtype);
    b->vi[id].grad = -1; b->vi[id].req = 0; b->vi[id].master = -1;
    b->vi[id].shard_of = -1; b->vi[id].again = -1;
    return id;
}

/* Mark v as sharded over mask (gathered: whole but padded) and size its storage. */
static void mt__set_shard(mt__builder *b, int v, uint32_t flags, uint32_t mask) {
    if (v < 0) return;
    mt_value *x = &b->g->values[v];
    x->flags |= flags; x->shard = mask;
    x->nbytes = mt_value_numel_max(b->g, x) * mt_dtype_bytes(b->g, x->dtype);
}

/* An activation named "L<layer>.<suffix>" (or "<suffix>" outside blocks). */
static int mt__act(mt__builder *b, const char *suffix, int dtype, int ndim, int64_t d0, int64_t d1,
                   int64_t d2) {
    char nm[MT_NAME_LEN];
    if (b->layer >= 0) snprintf(nm, sizeof nm, "L%d.%s", b->layer, suffix);
    else snprintf(nm, sizeof nm, "%s", suffix);
    int role = b->phase == MT_PHASE_FORWARD ? MT_ROLE_ACT : MT_ROLE_AGRAD;
    return mt__value(b, nm, dtype, role, ndim, d0, d1, d2);
}

static mt_node mt__node(mt__builder *b, int op) {
    mt_node n;
    memset(&n, 0, sizeof n);
    n.op = op; n.queue = MT_Q_COMPUTE; n.phase = b->phase; n.layer = b->layer;
    n.n_in = mt_ops[op].n_in; n.n_out = mt_ops[op].n_out;
    for (int i = 0; i < MT_MAX_IN; i++) n.in[i] = -1;
    for (int i = 0; i < MT_MAX_OUT; i++) n.out[i] = -1;
    return n;
}

static void mt__push(mt__builder *b, mt_node *n) {
    if (b->failed) return;
    mt_graph *g = b->g;
    mt_err e;
    if (mt_check_node(g, n, &e)) { mt__fail(b, "internal error building the graph: %s", e.msg); return; }
    if (mt__grow((void **)&g->nodes, &g->cap_nodes, g->n_nodes + 1, sizeof(mt_node))) { mt__fail(b, "%sout of memory", ""); return; }
    g->nodes[g->n_nodes++] = *n;
    if (n->phase == MT_PHASE_FORWARD && mt_ops[n->op].differentiable) {
        int r = 0;
        for (int i = 0; i < n->n_in; i++) if (n->in[i] >= 0 && b->vi[n->in[i]].req) r = 1;
        for (int i = 0; i < n->n_out; i++) if (n->out[i] >= 0) b->vi[n->out[i]].req = r;
    }
}

/* --- parameters --- */

/* FSDP: the mesh dimensions a trainable parameter is sharded over, or 0
 * when it stays whole. Dense weights shard over dp_shard; expert weights,
 * already split by expert over ep, shard over edp. */
static uint32_t mt__fsdp_mask(const mt_graph *g, uint32_t flags) {
    uint32_t m = (flags & MT_VF_EXPERTS) ? MT_DIMBIT(MT_DIM_EDP) : MT_DIMBIT(MT_DIM_DP_SHARD);
    return mt_mesh_group_size(&g->mesh, m) > 1 ? m : 0;
}

/* A parameter (f32 master). mt__param returns the id the forward computes
 * with: the master itself, or on a bf16 target a bf16 shadow that AdamW
 * refreshes. Under FSDP the master, its shadow, gradient and moments are
 * this rank's flat shard, and the forward computes with the whole weight,
 * all-gathered (bf16 on the GPU) right there, just before its first use.
 * mt__param_shard stops short of the gather (the embedding may look its
 * rows up in the shards: mt__embed). */
static int mt__param_shard(mt__builder *b, const char *name, int init, float std, uint32_t flags,
                           int compute_dtype, int ndim, int64_t d0, int64_t d1, int64_t d2) {
    int p = mt__value(b, name, MT_F32, MT_ROLE_PARAM, ndim, d0, d1, d2);
    if (p < 0) return -1;
    mt_value *v = &b->g->values[p];
    v->init = init; v->init_std = std; v->flags = flags;
    if (!(flags & MT_VF_TRAINABLE)) return p;
    uint32_t shard = mt__fsdp_mask(b->g, flags);
    mt__set_shard(b, p, 0, shard);
    b->vi[p].req = 1;
    if (mt__grow((void **)&b->params, &b->cap_params, b->n_params + 1, sizeof(int32_t))) return mt__fail(b, "%sout of memory", "");
    b->params[b->n_params++] = p;
    char nm[MT_NAME_LEN];
    int s = p;
    if (compute_dtype != MT_F32) {
        snprintf(nm, sizeof nm, "%.*s@bf16", MT_NAME_LEN - 8, name);
        s = mt__value(b, nm, compute_dtype, MT_ROLE_PARAM, ndim, d0, d1, d2);
        if (s < 0) return -1;
        b->g->values[s].param = p;
        b->g->values[s].flags = flags & MT_VF_EXPERTS;
        mt__set_shard(b, s, 0, shard);
        b->vi[s].req = 1; b->vi[s].master = p;
    }
    return s;
}
/* The whole weight of shard s (a parameter or its shadow), all-gathered here; s itself when whole. */
static int mt__gather(mt__builder *b, int s) {
    if (s < 0 || b->failed || !b->g->values[s].shard) return s;
    const mt_value w = b->g->values[s];
    int m = b->vi[s].master >= 0 ? b->vi[s].master : s;
    char nm[MT_NAME_LEN];
    snprintf(nm, sizeof nm, "%.*s@full", MT_NAME_LEN - 8, b->g->values[m].name);
    int full = mt__value(b, nm, w.dtype, MT_ROLE_ACT, w.ndim, w.dims[0], w.dims[1], w.dims[2]);
    mt__set_shard(b, full, MT_VF_GATHERED, w.shard);
    mt_node n = mt__node(b, MT_OP_ALLGATHER);
    n.queue = MT_Q_DP; n.in[0] = s; n.out[0] = full; n.iattr[0] = (int)w.shard;
    mt__push(b, &n);
    if (full >= 0) b->vi[full].shard_of = s;
    return full;
}
static int mt__param(mt__builder *b, const char *name, int init, float std, uint32_t flags,
                     int compute_dtype, int ndim, int64_t d0, int64_t d1, int64_t d2) {
    return mt__gather(b, mt__param_shard(b, name, init, std, flags, compute_dtype, ndim, d0, d1, d2));
}
static int mt__weight(mt__builder *b, const char *name, float std, int64_t rows, int64_t cols) {
    return mt__param(b, name, MT_INIT_NORMAL, std, MT_VF_TRAINABLE | MT_VF_DECAY, b->act, 2, rows, cols, 0);
}

/* --- tensor parallelism (Megatron-style, with sequence parallelism) ---
 * With tp > 1 the residual stream, the RMSNorms and the router hold this rank's
 * n = N / tp tokens: rows [coord.tp * n, (coord.tp + 1) * n) of the batch. A
 * column-parallel GEMM (this rank's output columns: heads, hidden units, vocab
 * entries) reads the whole batch, gathered over tp (SP_GATHER); a row-parallel
 * GEMM's output is this rank's partial sum over its columns, summed over tp and
 * cut back to this rank's rows (SP_SCATTER). Each is the other's backward.
 * Replicated weights (norms, the latent projections, the router, the
 * embedding) get partial gradients on every tp rank, summed over tp. With
 * tp = 1 every helper here is an identity and the graph is unchanged. */
static int mt__tp(const mt__builder *b) { return b->g->mesh.size[MT_DIM_TP]; }
/* A weight split over tp: split = MT_VF_TP_ROWS (column-parallel: rows/tp of its rows) or
 * MT_VF_TP_COLS (row-parallel: cols/tp of its columns). */
static int mt__weight_tp(mt__builder *b, const char *name, float std, int64_t rows, int64_t cols, uint32_t split) {
    int tp = mt__tp(b);
    if (tp == 1) return mt__weight(b, name, std, rows, cols);
    if (split == MT_VF_TP_ROWS) rows /= tp; else cols /= tp;
    return mt__param(b, name, MT_INIT_NORMAL, std, MT_VF_TRAINABLE | MT_VF_DECAY | split, b->act, 2, rows, cols, 0);
}
static int mt__sp(mt__builder *b, int op, int x, const char *name) {   /* SP_GATHER: [n,D] -> [N,D]; SP_SCATTER: back */
    int tp = mt__tp(b);
    if (tp == 1 || b->failed) return x;
    const mt_value *xv = &b->g->values[x];
    int64_t rows = op == MT_OP_SP_GATHER ? xv->dims[0] * tp : xv->dims[0] / tp;
    int y = mt__act(b, name, xv->dtype, 2, rows, xv->dims[1], 0);
    mt_node n = mt__node(b, op);
    n.in[0] = x; n.out[0] = y; n.iattr[0] = (int)MT_DIMBIT(MT_DIM_TP);
    mt__push(b, &n);
    return y;
}
static int mt__norm_weight(mt__builder *b, const char *name, int64_t n) {
    return mt__param(b, name, MT_INIT_ONE, 0, MT_VF_TRAINABLE, MT_F32, 1, n, 0, 0);
}

/* --- the forward vocabulary: one function per op --- */

static int mt__linear(mt__builder *b, int x, int W, const char *name) {  /* [N,in] x [out,in]^T */
    if (b->failed) return -1;
    const mt_value *xv = &b->g->values[x], *wv = &b->g->values[W];
    int dt = wv->dtype == MT_F32 && b->act != MT_F32 ? MT_F32 : b->act;
    int y = mt__act(b, name, dt, 2, xv->dims[0], wv->dims[0], 0);
    mt_node n = mt__node(b, MT_OP_MATMUL);
    n.in[0] = x; n.in[1] = W; n.out[0] = y; n.iattr[0] = 0; n.iattr[1] = 1;
    mt__push(b, &n);
    return y;
}
static int mt__rmsnorm_eps(mt__builder *b, int x, int w, const char *name, float eps) {
    if (b->failed) return -1;
    const mt_value *xv = &b->g->values[x];
    char nm[MT_NAME_LEN];
    int y = mt__act(b, name, b->act, 2, xv->dims[0], xv->dims[1], 0);
    snprintf(nm, sizeof nm, "%s.rstd", name);
    int r = mt__act(b, nm, MT_F32, 1, b->g->values[x].dims[0], 0, 0);
    mt_node n = mt__node(b, MT_OP_RMSNORM);
    n.in[0] = x; n.in[1] = w; n.out[0] = y; n.out[1] = r; n.fattr[0] = eps;
    mt__push(b, &n);
    return y;
}
static int mt__rmsnorm(mt__builder *b, int x, int w, const char *name) {
    return mt__rmsnorm_eps(b, x, w, name, b->g->cfg.norm_eps);
}
/* The latent norms (q_a, kv_a) use eps 1e-6 whatever norm_eps is, as in
 * DeepSeek-V3's reference code and transformers. */
#define MT_LATENT_NORM_EPS 1e-6f
static int mt__binary(mt__builder *b, int op, int x, int y, const char *name) { /* ADD, SWIGLU */
    if (b->failed) return -1;
    const mt_value *xv = &b->g->values[x];
    int o = mt__act(b, name, xv->dtype, 2, xv->dims[0], xv->dims[1], 0);
    mt_node n = mt__node(b, op);
    n.in[0] = x; n.in[1] = y; n.out[0] = o;
    mt__push(b, &n);
    return o;
}

/* SwiGLU FFN: down(silu(gate(x)) * up(x)). prefix = "model.layers.L.mlp."; x [n,D] -> [n,D]. */
static int mt__ffn(mt__builder *b, int x, const char *prefix, int hidden, const char *tag) {
    const mt_config *c = &b->g->cfg;
    char nm[MT_NAME_LEN], an[64];
    float std = 0.02f, out_std = 0.02f / sqrtf(2.0f * (float)(b->layer + 1));
    snprintf(nm, sizeof nm, "%sgate_proj.weight", prefix);   /* gate and up column-parallel, down row-parallel */
    int wg = mt__weight_tp(b, nm, std, hidden, c->dim, MT_VF_TP_ROWS);
    snprintf(nm, sizeof nm, "%sup_proj.weight", prefix);
    int wu = mt__weight_tp(b, nm, std, hidden, c->dim, MT_VF_TP_ROWS);
    snprintf(nm, sizeof nm, "%sdown_proj.weight", prefix);
    int wd = mt__weight_tp(b, nm, out_std, c->dim, hidden, MT_VF_TP_COLS);
    snprintf(an, sizeof an, "%s.x", tag); x = mt__sp(b, MT_OP_SP_GATHER, x, an);   /* [N,D] */
    snprintf(an, sizeof an, "%s.gate", tag); int g = mt__linear(b, x, wg, an);
    snprintf(an, sizeof an, "%s.up", tag); int u = mt__linear(b, x, wu, an);
    snprintf(an, sizeof an, "%s.h", tag); int h = mt__binary(b, MT_OP_SWIGLU, g, u, an);
    snprintf(an, sizeof an, "%s.out", tag);
    int y = mt__linear(b, h, wd, an);                      /* [N,D]: this rank's partial sum under tp */
    snprintf(an, sizeof an, "%s.out_sp", tag);
    return mt__sp(b, MT_OP_SP_SCATTER, y, an);
}

/* Multi-head latent attention. x: normed input [n,D] -> [n,D]. Under tp this
 * rank computes H / tp heads: q_b (or q) and kv_b column-parallel, o row-parallel,
 * the latent projections and norms replicated over the gathered batch. */
static int mt__mla(mt__builder *b, int x) {
    const mt_config *c = &b->g->cfg;
    int64_t N = (int64_t)c->batch * c->seq_len, D = c->dim, H = c->n_heads / mt__tp(b);
    int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim, dq = dn + dr;
    int64_t kvl = c->kv_lora_rank;
    char p[MT_NAME_LEN], nm[MT_NAME_LEN];
    snprintf(p, sizeof p, "model.layers.%d.self_attn.", b->layer);
#define MT__PN(s) (snprintf(nm, sizeof nm, "%s" s, p), nm)
    x = mt__sp(b, MT_OP_SP_GATHER, x, "attn.x");          /* [N,D] */
    int q;
    if (c->q_lora_rank > 0) {                             /* q = norm(x Wqa) Wqb */
        int wqa = mt__weight(b, MT__PN("q_a_proj.weight"), 0.02f, c->q_lora_rank, D);
        int qa = mt__linear(b, x, wqa, "attn.q_a");
        int wqn = mt__norm_weight(b, MT__PN("q_a_layernorm.weight"), c->q_lora_rank);
        int qan = mt__rmsnorm_eps(b, qa, wqn, "attn.q_a_norm", MT_LATENT_NORM_EPS);
        int wqb = mt__weight_tp(b, MT__PN("q_b_proj.weight"), 0.02f, H * dq * mt__tp(b), c->q_lora_rank, MT_VF_TP_ROWS);
        q = mt__linear(b, qan, wqb, "attn.q");            /* [N, H*dq] */
    } else {
        int wq = mt__weight_tp(b, MT__PN("q_proj.weight"), 0.02f, H * dq * mt__tp(b), D, MT_VF_TP_ROWS);
        q = mt__linear(b, x, wq, "attn.q");               /* [N, H*dq] */
    }
    int wkva = mt__weight(b, MT__PN("kv_a_proj_with_mqa.weight"), 0.02f, kvl + dr, D);
    int kva = mt__linear(b, x, wkva, "attn.kv_a");        /* [N, kvl+dr] */
    int ckv = mt__act(b, "attn.ckv", b->act, 2, N, kvl, 0);
    int kpe = mt__act(b, "attn.kpe", b->act, 2, N, dr, 0);
    mt_node n = mt__node(b, MT_OP_SPLIT);
    n.in[0] = kva; n.out[0] = ckv; n.out[1] = kpe;
    mt__push(b, &n);
    int wkvn = mt__norm_weight(b, MT__PN("kv_a_layernorm.weight"), kvl);
    int ckvn = mt__rmsnorm_eps(b, ckv, wkvn, "attn.ckv_norm", MT_LATENT_NORM_EPS);
    int wkvb = mt__weight_tp(b, MT__PN("kv_b_proj.weight"), 0.02f, H * (dn + dv) * mt__tp(b), kvl, MT_VF_TP_ROWS);
    int kv = mt__linear(b, ckvn, wkvb, "attn.kv");        /* [N, H*(dn+dv)] */
    int Q = mt__act(b, "attn.Q", b->act, 2, N, H * dq, 0);
    int K = mt__act(b, "attn.K", b->act, 2, N, H * dq, 0);
    int V = mt__act(b, "attn.V", b->act, 2, N, H * dv, 0);
    n = mt__node(b, MT_OP_MLA_ROPE);
    n.in[0] = q; n.in[1] = kv; n.in[2] = kpe; n.in[3] = b->cos; n.in[4] = b->sin;
    n.out[0] = Q; n.out[1] = K; n.out[2] = V;
    n.iattr[0] = (int)H; n.iattr[1] = (int)dn; n.iattr[2] = (int)dr; n.iattr[3] = (int)dv; n.iattr[4] = c->seq_len;
    mt__push(b, &n);
    int O = mt__act(b, "attn.O", b->act, 2, N, H * dv, 0);
    int lse = mt__act(b, "attn.lse", MT_F32, 2, N, H, 0);
    n = mt__node(b, MT_OP_ATTENTION);
    n.in[0] = Q; n.in[1] = K; n.in[2] = V; n.in[3] = b->doc; n.out[0] = O; n.out[1] = lse;
    n.iattr[0] = (int)H; n.iattr[1] = (int)dq; n.iattr[2] = (int)dv; n.iattr[3] = c->seq_len;
    n.fattr[0] = (float)mt_attention_scale(c);
    mt__push(b, &n);
    int wo = mt__weight_tp(b, MT__PN("o_proj.weight"), 0.02f / sqrtf(2.0f * (float)(b->layer + 1)), D, H * dv * mt__tp(b), MT_VF_TP_COLS);
#undef MT__PN
    int y = mt__linear(b, O, wo, "attn.out");             /* [N,D]: this rank's partial sum under tp */
    return mt__sp(b, MT_OP_SP_SCATTER, y, "attn.out_sp");
}

/* Mixture of experts. x: normed input [N,D] -> [N,D] (under tp, this rank's
 * N / tp tokens: each token is routed once, by the rank that holds it).
 * route -> permute by expert -> EP exchange -> grouped SwiGLU -> EP exchange
 * back -> weighted combine, plus shared experts. */
static int mt__moe(mt__builder *b, int x) {
    const mt_config *c = &b->g->cfg;
    const mt_mesh *m = &b->g->mesh;
    int64_t N = b->g->values[x].dims[0], D = c->dim, E = c->n_routed_experts, K = c->top_k;
    int64_t ep = m->size[MT_DIM_EP], El = E / ep, F = c->moe_inter_dim;
    float out_std = 0.02f / sqrtf(2.0f * (float)(b->layer + 1));
    char p[MT_NAME_LEN], nm[MT_NAME_LEN];
    snprintf(p, sizeof p, "model.layers.%d.mlp.", b->layer);
#define MT__PN(s) (snprintf(nm, sizeof nm, "%s" s, p), nm)
    /* router: fp32 logits and scores */
    int wr = mt__param(b, MT__PN("gate.weight"), MT_INIT_NORMAL, out_std, MT_VF_TRAINABLE | MT_VF_DECAY,
                       MT_F32, 2, E, D, 0);
    int bias = mt__param(b, MT__PN("gate.e_score_correction_bias"), MT_INIT_ZERO, 0, 0, MT_F32, 1, E, 0, 0);
    int logits = mt__linear(b, x, wr, "moe.logits");      /* [N,E] f32 */
    int idx = mt__act(b, "moe.topk_idx", MT_I32, 2, N, K, 0);
    int w = mt__act(b, "moe.topk_w", MT_F32, 2, N, K, 0);
    int scores = mt__act(b, "moe.scores", MT_F32, 2, N, E, 0);
    snprintf(nm, sizeof nm, "L%d.moe.counts", b->layer);
    int counts = mt__value(b, nm, MT_I32, MT_ROLE_OUTPUT, 1, E, 0, 0);
    if (counts >= 0) b->g->values[counts].flags = MT_VF_COUNTS;
    mt_node n = mt__node(b, MT_OP_ROUTER);
    n.in[0] = logits; n.in[1] = bias;
    n.out[0] = idx; n.out[1] = w; n.out[2] = scores; n.out[3] = counts;
    n.iattr[0] = (int)K; n.iattr[1] = c->score_func; n.iattr[2] = c->route_norm;
    n.iattr[3] = c->n_expert_groups; n.iattr[4] = c->n_limited_groups; n.fattr[0] = c->route_scale;
    mt__push(b, &n);
    b->counts[b->n_moe] = counts; b->biases[b->n_moe] = bias; b->n_moe++;
    /* permute tokens into expert-major order, then the expert-parallel exchange: counts, then tokens
     * (identity when ep = 1). With b->chunks = C > 1 each chunk of rows [N*c/C, N*(c+1)/C) is permuted,
     * exchanged, computed and combined apart: every chunk's permutation, then every chunk's counts and
     * dispatch, then chunk by chunk the experts and their combine. Under mt_pass_overlap one chunk's
     * exchange travels on the EP stream while another chunk's experts compute (the backward, derived in
     * reverse, likewise). A chunk's combine writes its rows and zeros (summed below), so the forward is
     * the same bits. */
    int C = b->chunks, xs[MT_MOE_CHUNKS_MAX], slot[MT_MOE_CHUNKS_MAX], offs[MT_MOE_CHUNKS_MAX], recv[MT_MOE_CHUNKS_MAX];
    int xr[MT_MOE_CHUNKS_MAX], roffs[MT_MOE_CHUNKS_MAX], back[MT_MOE_CHUNKS_MAX], part[MT_MOE_CHUNKS_MAX] = {0};
    char cn[MT_NAME_LEN];
    if (N < C) return mt__fail(b, "%sfewer tokens than MoE chunks", "");
#define MT__CN(s) (C == 1 ? (s) : (snprintf(cn, sizeof cn, "%s.c%d", (s), ch), cn))
#define MT__ROW0(ch) (N * (ch) / C)
    for (int ch = 0; ch < C; ch++) {
        int64_t rows = MT__ROW0(ch + 1) - MT__ROW0(ch);
        xs[ch] = mt__act(b, MT__CN("moe.xs"), b->act, 2, rows * K, D, 0);
        slot[ch] = mt__act(b, MT__CN("moe.slot"), MT_I32, 1, rows * K, 0, 0);
        offs[ch] = mt__act(b, MT__CN("moe.offs"), MT_I32, 1, E + 1, 0, 0);
        n = mt__node(b, MT_OP_MOE_PERMUTE);
        n.in[0] = x; n.in[1] = idx; n.out[0] = xs[ch]; n.out[1] = slot[ch]; n.out[2] = offs[ch];
        n.iattr[0] = (int)E; n.iattr[1] = (int)MT__ROW0(ch);
        mt__push(b, &n);
    }
    for (int ch = 0; ch < C; ch++) {
        recv[ch] = mt__act(b, MT__CN("moe.ep_recv_counts"), MT_I32, 2, ep, El, 0);
        n = mt__node(b, MT_OP_EP_COUNTS);
        n.queue = MT_Q_EP; n.in[0] = offs[ch]; n.out[0] = recv[ch];
        n.iattr[0] = (int)MT_DIMBIT(MT_DIM_EP); n.iattr[2] = (int)ep; n.iattr[3] = (int)El;
        n.iattr[4] = b->sym_coord[MT_DIM_EP]; n.sym_mask = 1u << 4;
        mt__push(b, &n);
        int64_t R = -(int64_t)b->sym_recv[ch] - 1;        /* tokens my experts receive */
        xr[ch] = mt__act(b, MT__CN("moe.xr"), b->act, 2, R, D, 0);
        roffs[ch] = mt__act(b, MT__CN("moe.roffs"), MT_I32, 1, El + 1, 0, 0);
        n = mt__node(b, MT_OP_EP_DISPATCH);
        n.queue = MT_Q_EP; n.in[0] = xs[ch]; n.in[1] = offs[ch]; n.in[2] = recv[ch]; n.out[0] = xr[ch]; n.out[1] = roffs[ch];
        n.iattr[0] = (int)MT_DIMBIT(MT_DIM_EP); n.iattr[2] = (int)ep; n.iattr[3] = (int)El;
        n.iattr[4] = b->sym_coord[MT_DIM_EP]; n.sym_mask = 1u << 4;
        mt__push(b, &n);
    }
    /* grouped SwiGLU experts over my El local experts */
    int wg = mt__param(b, MT__PN("experts.*.gate_proj.weight"), MT_INIT_NORMAL, 0.02f,
                       MT_VF_TRAINABLE | MT_VF_DECAY | MT_VF_EXPERTS, b->act, 3, El, F, D);
    int wu = mt__param(b, MT__PN("experts.*.up_proj.weight"), MT_INIT_NORMAL, 0.02f,
                       MT_VF_TRAINABLE | MT_VF_DECAY | MT_VF_EXPERTS, b->act, 3, El, F, D);
    int wd = mt__param(b, MT__PN("experts.*.down_proj.weight"), MT_INIT_NORMAL, out_std,
                       MT_VF_TRAINABLE | MT_VF_DECAY | MT_VF_EXPERTS, b->act, 3, El, D, F);
    for (int ch = 0; ch < C; ch++) {
        int64_t R = -(int64_t)b->sym_recv[ch] - 1;
        int gm[3] = {wg, wu, wd}, gout[3];
        const char *gname[3] = {"moe.gate", "moe.up", "moe.yr"};
        int gin = xr[ch];
        for (int i = 0; i < 3; i++) {
            if (i == 2) gin = mt__binary(b, MT_OP_SWIGLU, gout[0], gout[1], MT__CN("moe.h"));
            gout[i] = mt__act(b, MT__CN(gname[i]), b->act, 2, R, i == 2 ? D : F, 0);
            n = mt__node(b, MT_OP_GMM);
            n.in[0] = gin; n.in[1] = gm[i]; n.in[2] = roffs[ch]; n.out[0] = gout[i];
            mt__push(b, &n);
        }
        back[ch] = mt__act(b, MT__CN("moe.ys"), b->act, 2, (MT__ROW0(ch + 1) - MT__ROW0(ch)) * K, D, 0);
        n = mt__node(b, MT_OP_EP_COMBINE);
        n.queue = MT_Q_EP; n.in[0] = gout[2]; n.in[1] = offs[ch]; n.in[2] = recv[ch]; n.out[0] = back[ch];
        n.iattr[0] = (int)MT_DIMBIT(MT_DIM_EP); n.iattr[2] = (int)ep; n.iattr[3] = (int)El;
        n.iattr[4] = b->sym_coord[MT_DIM_EP]; n.sym_mask = 1u << 4;
        mt__push(b, &n);
    }
    for (int ch = 0; ch < C; ch++) {
        part[ch] = mt__act(b, MT__CN("moe.routed"), b->act, 2, N, D, 0);
        n = mt__node(b, MT_OP_MOE_COMBINE);
        n.in[0] = back[ch]; n.in[1] = slot[ch]; n.in[2] = w; n.out[0] = part[ch]; n.iattr[1] = (int)MT__ROW0(ch);
        mt__push(b, &n);
    }
    int y = part[0];
    for (int ch = 1; ch < C; ch++) y = mt__binary(b, MT_OP_ADD, y, part[ch], "moe.routed");
#undef MT__ROW0
#undef MT__CN
    if (c->n_shared_experts > 0) {
        int s = mt__ffn(b, x, MT__PN("shared_experts."), c->n_shared_experts * c->moe_inter_dim, "moe.shared");
        y = mt__binary(b, MT_OP_ADD, y, s, "moe.out");
    }
#undef MT__PN
    return y;
}

/* Block: x + attn(norm(x)), then + ffn(norm(.)). */
static int mt__block(mt__builder *b, int x) {
    const mt_config *c = &b->g->cfg;
    char nm[MT_NAME_LEN];
    snprintf(nm, sizeof nm, "model.layers.%d.input_layernorm.weight", b->layer);
    int h = mt__rmsnorm(b, x, mt__norm_weight(b, nm, c->dim), "attn_norm");
    x = mt__binary(b, MT_OP_ADD, x, mt__mla(b, h), "resid1");
    snprintf(nm, sizeof nm, "model.layers.%d.post_attention_layernorm.weight", b->layer);
    h = mt__rmsnorm(b, x, mt__norm_weight(b, nm, c->dim), "ffn_norm");
    int f;
    if (mt_config_is_moe_layer(c, b->layer)) {
        f = mt__moe(b, h);
    } else {
        snprintf(nm, sizeof nm, "model.layers.%d.mlp.", b->layer);
        f = mt__ffn(b, h, nm, c->inter_dim, "ffn");
    }
    return mt__binary(b, MT_OP_ADD, x, f, "resid2");
}

/* Constant: copies n reals into the constants blob in the target's f32 format. */
static int mt__const(mt__builder *b, const char *name, const mt_real *data, int64_t rows, int64_t cols) {
    int v = mt__value(b, name, MT_F32, MT_ROLE_CONST, 2, rows, cols, 0);
    if (v < 0) return -1;
    mt_graph *g = b->g;
    int64_t n = rows * cols, rb = g->target.real_bytes, at = (g->consts_bytes + 63) & ~(int64_t)63;
    uint8_t *blob = (uint8_t *)MT_REALLOC(g->consts, (size_t)(at + n * rb));
    if (!blob) return mt__fail(b, "%sout of memory", "");
    memset(blob + g->consts_bytes, 0, (size_t)(at - g->consts_bytes));
    for (int64_t i = 0; i < n; i++) {
        if (rb == 4) { float f = (float)data[i]; memcpy(blob + at + i * 4, &f, 4); }
        else { double d = (double)data[i]; memcpy(blob + at + i * 8, &d, 8); }
    }
    g->consts = blob; g->consts_bytes = at + n * rb;
    g->values[v].data_offset = at;
    return v;
}

/* The cross-entropy of logits [N,V] (under tp [N,V/tp], this rank's vocab entries) against targets
 * into loss[1]: the mean over `count` rows (0: all N; targets < 0 are left out), its gradient
 * scaled by `weight` (0: 1). The step's loss is the mean over the DP ranks: the gradient's seed
 * carries that 1/DP too, so that every gradient leaves the backward already the rank's share
 * (the reductions only add; nothing rescales the gradients after them). Under tp each rank's row
 * statistics (max, sum of exp, the target's logit where it holds it) are gathered over tp and
 * combined in rank order (every rank the same bits), so the whole [N,V] logits never exist on
 * one rank. */
static int mt__cross_entropy(mt__builder *b, int logits, int targets, int loss, int count, float weight) {
    mt_graph *g = b->g;
    int64_t N = (int64_t)g->cfg.batch * g->cfg.seq_len;
    int dp = mt_mesh_group_size(&g->mesh, MT_DIMBIT(MT_DIM_DP_REPLICATE) | MT_DIMBIT(MT_DIM_DP_SHARD));
    if (dp > 1) weight = (weight > 0 ? weight : 1.0f) / (float)dp;
    int lse = mt__act(b, "loss.lse", MT_F32, 1, N, 0, 0);
    mt_node n;
    if (mt__tp(b) == 1) {
        n = mt__node(b, MT_OP_CROSS_ENTROPY);
        n.in[0] = logits; n.in[1] = targets; n.out[0] = loss; n.out[1] = lse;
        n.iattr[1] = count; n.fattr[0] = weight;
        mt__push(b, &n);
        return b->failed ? -1 : 0;
    }
    int st = mt__act(b, "loss.stats", MT_F32, 2, N, 3, 0);
    n = mt__node(b, MT_OP_CE_STATS);
    n.in[0] = logits; n.in[1] = targets; n.out[0] = st;
    n.iattr[0] = b->sym_coord[MT_DIM_TP]; n.sym_mask = 1u;
    mt__push(b, &n);
    st = mt__sp(b, MT_OP_SP_GATHER, st, "loss.stats_all");   /* [tp*N,3] */
    n = mt__node(b, MT_OP_CE_COMBINE);
    n.in[0] = st; n.in[1] = logits; n.in[2] = targets; n.out[0] = loss; n.out[1] = lse;
    n.iattr[1] = count; n.fattr[0] = weight;
    mt__push(b, &n);
    return b->failed ? -1 : 0;
}

/* x[N] i32 shifted k positions ahead within each sequence, `fill` past its end (SHIFT_TOKENS). */
static int mt__shift_tokens(mt__builder *b, int x, int k, int fill, const char *name) {
    const mt_config *c = &b->g->cfg;
    int y = mt__act(b, name, MT_I32, 1, (int64_t)c->batch * c->seq_len, 0, 0);
    mt_node n = mt__node(b, MT_OP_SHIFT_TOKENS);
    n.in[0] = x; n.out[0] = y; n.iattr[0] = c->seq_len; n.iattr[1] = k; n.iattr[2] = fill;
    mt__push(b, &n);
    return y;
}

/* Embedding rows of tokens[N] (under tp: this rank's slice of them, as its residual rows). */
static int mt__embed(mt__builder *b, int tokens, int wte, const char *name) {
    const mt_config *c = &b->g->cfg;
    int tp = mt__tp(b);
    const mt_value w = b->g->values[wte];
    if (w.shard && !(w.flags & MT_VF_GATHERED)) {   /* rows looked up in the shards (mt__embed_in_shards) */
        int S = mt_mesh_group_size(&b->g->mesh, w.shard);
        int64_t N = (int64_t)c->batch * c->seq_len;
        char nm[MT_NAME_LEN];
        snprintf(nm, sizeof nm, "%.*s.tokens_all", MT_NAME_LEN - 12, name);
        int tk = mt__act(b, nm, MT_I32, 1, N * S, 0, 0);
        snprintf(nm, sizeof nm, "%.*s.parts", MT_NAME_LEN - 8, name);
        int part = mt__act(b, nm, b->act, 2, N * S, c->dim, 0);
        int x = mt__act(b, name, b->act, 2, N, c->dim, 0);
        mt_node n = mt__node(b, MT_OP_SP_GATHER);
        n.queue = MT_Q_DP; n.in[0] = tokens; n.out[0] = tk; n.iattr[0] = (int)w.shard;
        mt__push(b, &n);
        n = mt__node(b, MT_OP_EMBED);
        n.in[0] = tk; n.in[1] = wte; n.out[0] = part;
        n.iattr[2] = S; n.iattr[3] = b->sym_coord[MT_DIM_DP_SHARD]; n.sym_mask = 8u;
        mt__push(b, &n);
        n = mt__node(b, MT_OP_SP_SCATTER);
        n.queue = MT_Q_DP; n.in[0] = part; n.out[0] = x; n.iattr[0] = (int)w.shard;
        mt__push(b, &n);
        return x;
    }
    int x = mt__act(b, name, b->act, 2, (int64_t)c->batch * c->seq_len / tp, c->dim, 0);
    mt_node n = mt__node(b, MT_OP_EMBED);
    n.in[0] = tokens; n.in[1] = wte; n.out[0] = x;
    if (tp > 1) { n.iattr[0] = tp; n.iattr[1] = b->sym_coord[MT_DIM_TP]; n.sym_mask = 2u; }
    mt__push(b, &n);
    return x;
}
/* The embedding under FSDP, two ways. Gather the whole table (V*D) for the lookup and reduce-scatter
 * its whole f32 gradient. Or look the rows up in the shards: every rank's token ids all-gathered, each
 * rank fills the rows of its shard (-0.0 elsewhere: x + -0.0 = x, bitwise) and a reduce-scatter over
 * the shards hands every rank its own tokens' rows, exactly the table's; the backward all-gathers
 * the token gradients and each rank sums those that fall in its shard into its shard's gradient.
 * That moves S*N*D activations each way instead of the table, and the backward no longer ends on the
 * table's reduce-scatter: the second where S*N < V (mid on 2 GPUs: 16,384 tokens, 102,400 entries),
 * with one token slice (tp = 1) and the table sharded over dp_shard alone. */
static int mt__embed_in_shards(const mt__builder *b, int wte) {
    const mt_graph *g = b->g;
    const mt_value *w = &g->values[wte];
    int64_t S = mt_mesh_group_size(&g->mesh, w->shard);
    return mt__tp(b) == 1 && w->shard == MT_DIMBIT(MT_DIM_DP_SHARD) && S > 1 &&
           S * (int64_t)g->cfg.batch * g->cfg.seq_len < (int64_t)g->cfg.vocab_size;
}

/* Multi-token prediction (DeepSeek-V3 section 2.2), depths k = 1..D in layers L+k-1 (Hugging Face
 * names model.layers.{L+k-1}.*). Depth k at position i: h_k = block(eh_proj([enorm(emb(token i+k)),
 * hnorm(h_{k-1})])), h_0 the main model's last hidden state (before its final norm); its logits
 * lm_head(shared_head.norm(h_k)) are scored against token i+k+1. The embedding and lm_head are the
 * main model's. Positions i >= T-k of a sequence have no token i+k+1 in the window: their target is
 * -1 and the mean counts B*(T-k) rows. The loss added is mtp_weight * mean over k (the weight of
 * each depth's cross-entropy in the backward); each depth's own mean is the output mtp_loss.<k>.
 * Under tp h and the embedding rows are this rank's (sequence parallel), eh_proj is replicated. */
static int mt__mtp(mt__builder *b, int h, int wte, int wout) {
    mt_graph *g = b->g;
    const mt_config *c = &g->cfg;
    int64_t D = c->dim;
    char p[MT_NAME_LEN], nm[MT_NAME_LEN];
#define MT__PN(s) (snprintf(nm, sizeof nm, "%s" s, p), nm)
    for (int k = 1; k <= c->mtp_layers && !b->failed; k++) {
        b->layer = c->n_layers + k - 1;
        snprintf(p, sizeof p, "model.layers.%d.", b->layer);
        int tok = mt__shift_tokens(b, g->io[MT_IO_TOKENS], k, 0, "mtp.tokens");       /* token i+k */
        int tgt = mt__shift_tokens(b, g->io[MT_IO_TARGETS], k, -1, "mtp.targets");    /* token i+k+1 */
        int e = mt__embed(b, tok, wte, "mtp.embed");
        e = mt__rmsnorm(b, e, mt__norm_weight(b, MT__PN("enorm.weight"), D), "mtp.enorm");
        int hn = mt__rmsnorm(b, h, mt__norm_weight(b, MT__PN("hnorm.weight"), D), "mtp.hnorm");
        if (b->failed) break;
        int cat = mt__act(b, "mtp.cat", b->act, 2, g->values[e].dims[0], 2 * D, 0);
        mt_node n = mt__node(b, MT_OP_CONCAT);
        n.in[0] = e; n.in[1] = hn; n.out[0] = cat; n.iattr[0] = (int)D;
        mt__push(b, &n);
        int x = mt__linear(b, cat, mt__weight(b, MT__PN("eh_proj.weight"), 0.02f, D, 2 * D), "mtp.proj");
        h = mt__block(b, x);
        int xn = mt__rmsnorm(b, h, mt__norm_weight(b, MT__PN("shared_head.norm.weight"), D), "mtp.norm");
        xn = mt__sp(b, MT_OP_SP_GATHER, xn, "mtp.norm.x");  /* [N,D] */
        int logits = mt__linear(b, xn, wout, "mtp.logits");
        snprintf(nm, sizeof nm, "mtp_loss.%d", k);
        int loss = mt__value(b, nm, MT_F32, MT_ROLE_OUTPUT, 1, 1, 0, 0);
        mt__cross_entropy(b, logits, tgt, loss, c->batch * (c->seq_len - k), c->mtp_weight / (float)c->mtp_layers);
    }
#undef MT__PN
    b->layer = -1;
    return b->failed ? -1 : 0;
}

static int mt__forward(mt__builder *b) {
    mt_graph *g = b->g;
    const mt_config *c = &g->cfg;
    int64_t N = (int64_t)c->batch * c->seq_len, D = c->dim, V = c->vocab_size;
    b->phase = MT_PHASE_FORWARD; b->layer = -1;
    g->io[MT_IO_TOKENS] = mt__value(b, "tokens", MT_I32, MT_ROLE_INPUT, 1, N, 0, 0);
    g->io[MT_IO_TARGETS] = mt__value(b, "targets", MT_I32, MT_ROLE_INPUT, 1, N, 0, 0);
    {   /* RoPE tables, computed once here and shipped in the artifact */
        int64_t half = c->qk_rope_head_dim / 2;
        mt_real *cs = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)(2 * c->seq_len * half));
        if (!cs) return mt__fail(b, "%sout of memory", "");
        mt_cpu_rope_tables(cs, cs + c->seq_len * half, c);
        b->cos = mt__const(b, "rope.cos", cs, c->seq_len, half);
        b->sin = mt__const(b, "rope.sin", cs + c->seq_len * half, c->seq_len, half);
        MT_FREE(cs);
    }
    int wte = mt__param_shard(b, "model.embed_tokens.weight", MT_INIT_NORMAL, 1.0f,
                              MT_VF_TRAINABLE | MT_VF_DECAY, b->act, 2, V, D, 0);
    if (wte >= 0 && !mt__embed_in_shards(b, wte)) wte = mt__gather(b, wte);
    int x = mt__embed(b, g->io[MT_IO_TOKENS], wte, "embed");   /* under tp: this rank's slice of the tokens */
    mt_node n;
    b->doc = -1;
    if (c->doc_mask) {   /* where each token's document starts: every attention reads it */
        b->doc = mt__act(b, "doc_start", MT_I32, 1, N, 0, 0);
        n = mt__node(b, MT_OP_DOC_STARTS);
        n.in[0] = g->io[MT_IO_TOKENS]; n.out[0] = b->doc; n.iattr[0] = c->seq_len; n.iattr[1] = c->eot_id;
        mt__push(b, &n);
    }
    for (int l = 0; l < c->n_layers && !b->failed; l++) {
        b->layer = l;
        x = mt__block(b, x);
    }
    b->layer = -1;
    int xn = mt__rmsnorm(b, x, mt__norm_weight(b, "model.norm.weight", D), "final_norm");
    xn = mt__sp(b, MT_OP_SP_GATHER, xn, "final_norm.x");  /* [N,D] */
    int wout = mt__weight_tp(b, "lm_head.weight", 1.0f / sqrtf((float)D), V, D, MT_VF_TP_ROWS);  /* vocab-parallel */
    int logits = mt__linear(b, xn, wout, "logits");      /* [N,V], under tp [N,V/tp]: this rank's vocab entries */
    if (g->kind == MT_GRAPH_FORWARD && logits >= 0) g->values[logits].role = MT_ROLE_OUTPUT;
    g->io[MT_IO_LOGITS] = g->kind == MT_GRAPH_FORWARD ? logits : -1;
    g->io[MT_IO_LOSS] = mt__value(b, "loss", MT_F32, MT_ROLE_OUTPUT, 1, 1, 0, 0);
    if (mt__cross_entropy(b, logits, g->io[MT_IO_TARGETS], g->io[MT_IO_LOSS], 0, 0.0f)) return -1;
    return c->mtp_layers > 0 ? mt__mtp(b, x, wte, wout) : 0;
}

/* --- reverse mode --- */

/* The value that holds dLoss/dv: a GRAD (f32, persistent) for params and
 * their shadows, an activation gradient otherwise. */
static int mt__grad_value(mt__builder *b, int v) {
    if (b->failed) return -1;
    int m = b->vi[v].master >= 0 ? b->vi[v].master : v;
    const mt_value *mv = &b->g->values[m];
    char nm[MT_NAME_LEN];
    if (mv->role == MT_ROLE_PARAM) {   /* f32, a shard like its param under FSDP */
        snprintf(nm, sizeof nm, "grad.%.*s", MT_NAME_LEN - 8, mv->name);
        uint32_t shard = mv->shard;
        int gv = mt__value(b, nm, MT_F32, MT_ROLE_GRAD, mv->ndim, mv->dims[0], mv->dims[1], mv->dims[2]);
        if (gv >= 0) b->g->values[gv].param = m;
        mt__set_shard(b, gv, 0, shard);
        return gv;
    }
    snprintf(nm, sizeof nm, "d.%.*s", MT_NAME_LEN - 8, mv->name);
    if (mv->flags & MT_VF_GATHERED) {  /* a whole weight's gradient: f32, padded for the reduce-scatter */
        uint32_t shard = mv->shard;
        int gv = mt__value(b, nm, MT_F32, MT_ROLE_AGRAD, mv->ndim, mv->dims[0], mv->dims[1], mv->dims[2]);
        mt__set_shard(b, gv, MT_VF_GATHERED, shard);
        return gv;
    }
    return mt__value(b, nm, mv->dtype, MT_ROLE_AGRAD, mv->ndim, mv->dims[0], mv->dims[1], mv->dims[2]);
}
/* A gradient output for input v, or -1 if v needs none. */
static int mt__gout(mt__builder *b, int v) { return (v >= 0 && b->vi[v].req) ? mt__grad_value(b, v) : -1; }

/* Record gv as (a contribution to) dLoss/dv. */
static void mt__acc(mt__builder *b, int v, int gv) {
    if (b->failed || v < 0 || gv < 0 || !b->vi[v].req) return;
    int m = b->vi[v].master >= 0 ? b->vi[v].master : v;
    if (b->vi[m].grad < 0) { b->vi[m].grad = gv; return; }
    const mt_value old = b->g->values[b->vi[m].grad];   /* copy: mt__value may move the table */
    int sum = mt__value(b, old.name, old.dtype, old.role, old.ndim, old.dims[0], old.dims[1], old.dims[2]);
    if (sum < 0) return;
    b->g->values[sum].param = old.param;
    if (old.shard) mt__set_shard(b, sum, old.flags & MT_VF_GATHERED, old.shard);
    mt_node n = mt__node(b, MT_OP_ADD);
    n.in[0] = b->vi[m].grad; n.in[1] = gv; n.out[0] = sum;
    mt__push(b, &n);
    b->vi[m].grad = sum;
}

/* The backward rule of one forward node. Emits nodes that read the node's
 * inputs/outputs and the gradients of its outputs, and accumulates the
 * gradients of its inputs. */
static void mt__backward_rule(mt__builder *b, const mt_node *f) {
    const int32_t *in = f->in, *out = f->out;
    int dy = b->vi[out[0]].grad;
    mt_node n;
    switch (f->op) {
    case MT_OP_EMBED: {
        int dw = mt__gout(b, in[1]);
        if (dw < 0 || dy < 0) return;
        n = mt__node(b, MT_OP_EMBED_BWD);
        n.in[0] = dy; n.in[1] = in[0]; n.out[0] = dw;
        memcpy(n.iattr, f->iattr, sizeof n.iattr); n.sym_mask = f->sym_mask;
        mt__push(b, &n); mt__acc(b, in[1], dw);
        return;
    }
    case MT_OP_RMSNORM: {
        if (dy < 0) return;
        n = mt__node(b, MT_OP_RMSNORM_BWD);
        n.in[0] = dy; n.in[1] = in[0]; n.in[2] = in[1]; n.in[3] = out[1];
        n.out[0] = mt__gout(b, in[0]); n.out[1] = mt__gout(b, in[1]);
        if (n.out[0] < 0 || n.out[1] < 0) { mt__fail(b, "internal error: RMSNORM input '%s' without gradient", b->g->values[in[0]].name); return; }
        mt__push(b, &n); mt__acc(b, in[0], n.out[0]); mt__acc(b, in[1], n.out[1]);
        return;
    }
    case MT_OP_MATMUL: {     /* C = op(A) op(B) */
        if (dy < 0) return;
        int ta = f->iattr[0], tb = f->iattr[1];
        int dA = mt__gout(b, in[0]), dB = mt__gout(b, in[1]);
        if (dA >= 0) {       /* ta=0: dA = dC op(B)^T ; ta=1: dA = op(B) dC^T */
            n = mt__node(b, MT_OP_MATMUL);
            if (!ta) { n.in[0] = dy; n.in[1] = in[1]; n.iattr[0] = 0; n.iattr[1] = !tb; }
            else { n.in[0] = in[1]; n.in[1] = dy; n.iattr[0] = tb; n.iattr[1] = 1; }
            n.out[0] = dA; mt__push(b, &n); mt__acc(b, in[0], dA);
        }
        if (dB >= 0) {       /* tb=0: dB = op(A)^T dC ; tb=1: dB = dC^T op(A) */
            n = mt__node(b, MT_OP_MATMUL);
            if (!tb) { n.in[0] = in[0]; n.in[1] = dy; n.iattr[0] = !ta; n.iattr[1] = 0; }
            else { n.in[0] = dy; n.in[1] = in[0]; n.iattr[0] = 1; n.iattr[1] = ta; }
            n.out[0] = dB; mt__push(b, &n); mt__acc(b, in[1], dB);
        }
        return;
    }
    case MT_OP_SPLIT: {
        int dx = mt__gout(b, in[0]);
        if (dx < 0) return;
        n = mt__node(b, MT_OP_CONCAT);
        n.in[0] = b->vi[out[0]].grad; n.in[1] = b->vi[out[1]].grad; n.out[0] = dx;
        n.iattr[0] = (int)b->g->values[out[0]].dims[1];
        mt__push(b, &n); mt__acc(b, in[0], dx);
        return;
    }
    case MT_OP_CONCAT: {     /* the gradient splits back into its two parts */
        if (dy < 0) return;
        n = mt__node(b, MT_OP_SPLIT);
        n.in[0] = dy;
        for (int i = 0; i < 2; i++) {
            n.out[i] = mt__gout(b, in[i]);
            if (n.out[i] < 0) n.out[i] = mt__act(b, "concat.dx_unused", b->g->values[in[i]].dtype, 2, b->g->values[in[i]].dims[0],
                                                 b->g->values[in[i]].dims[1], 0);
        }
        mt__push(b, &n); mt__acc(b, in[0], n.out[0]); mt__acc(b, in[1], n.out[1]);
        return;
    }
    case MT_OP_MLA_ROPE: {
        int dQ = b->vi[out[0]].grad, dK = b->vi[out[1]].grad, dV = b->vi[out[2]].grad;
        if (dQ < 0 || dK < 0 || dV < 0) { mt__fail(b, "internal error: attention inputs of '%s' lack gradients", b->g->values[out[0]].name); return; }
        n = mt__node(b, MT_OP_MLA_ROPE_BWD);
        n.in[0] = dQ; n.in[1] = dK; n.in[2] = dV; n.in[3] = in[3]; n.in[4] = in[4];
        n.out[0] = mt__gout(b, in[0]); n.out[1] = mt__gout(b, in[1]); n.out[2] = mt__gout(b, in[2]);
        memcpy(n.iattr, f->iattr, sizeof n.iattr);
        mt__push(b, &n);
        for (int i = 0; i < 3; i++) mt__acc(b, in[i], n.out[i]);
        return;
    }
    case MT_OP_ATTENTION: {
        if (dy < 0) return;
        n = mt__node(b, MT_OP_ATTENTION_BWD);
        n.in[0] = in[0]; n.in[1] = in[1]; n.in[2] = in[2]; n.in[3] = out[0]; n.in[4] = out[1]; n.in[5] = dy; n.in[6] = in[3];
        for (int i = 0; i < 3; i++) n.out[i] = mt__gout(b, in[i]);
        memcpy(n.iattr, f->iattr, sizeof n.iattr);
        n.fattr[0] = f->fattr[0];
        mt__push(b, &n);
        for (int i = 0; i < 3; i++) mt__acc(b, in[i], n.out[i]);
        return;
    }
    case MT_OP_SWIGLU: {
        if (dy < 0) return;
        n = mt__node(b, MT_OP_SWIGLU_BWD);
        n.in[0] = in[0]; n.in[1] = in[1]; n.in[2] = dy;
        n.out[0] = mt__gout(b, in[0]); n.out[1] = mt__gout(b, in[1]);
        mt__push(b, &n); mt__acc(b, in[0], n.out[0]); mt__acc(b, in[1], n.out[1]);
        return;
    }
    case MT_OP_ADD:
        mt__acc(b, in[0], dy); mt__acc(b, in[1], dy);
        return;
    case MT_OP_ROUTER: {      /* only the weights carry gradient; selection is discrete */
        int dw = b->vi[out[1]].grad, dl = mt__gout(b, in[0]);
        if (dw < 0 || dl < 0) return;
        n = mt__node(b, MT_OP_ROUTER_BWD);
        n.in[0] = out[2]; n.in[1] = out[0]; n.in[2] = out[1]; n.in[3] = dw; n.out[0] = dl;
        memcpy(n.iattr, f->iattr, sizeof n.iattr); n.fattr[0] = f->fattr[0];
        mt__push(b, &n); mt__acc(b, in[0], dl);
        return;
    }
    case MT_OP_MOE_PERMUTE: {
        int dx = mt__gout(b, in[0]);
        if (dy < 0 || dx < 0) return;
        n = mt__node(b, MT_OP_MOE_PERMUTE_BWD);
        n.in[0] = dy; n.in[1] = out[1]; n.out[0] = dx;
        n.iattr[0] = (int)b->g->values[in[1]].dims[1]; n.iattr[1] = f->iattr[1];   /* K, the chunk's first row */
        mt__push(b, &n); mt__acc(b, in[0], dx);
        return;
    }
    case MT_OP_EP_DISPATCH: case MT_OP_EP_COMBINE: {  /* each is the other's adjoint */
        int dx = mt__gout(b, in[0]);
        if (dy < 0 || dx < 0) return;
        n = mt__node(b, f->op == MT_OP_EP_DISPATCH ? MT_OP_EP_COMBINE : MT_OP_EP_DISPATCH);
        n.queue = f->queue;
        n.in[0] = dy; n.in[1] = in[1]; n.in[2] = in[2]; n.out[0] = dx;
        if (n.op == MT_OP_EP_DISPATCH) n.out[1] = mt__act(b, "moe.roffs.bwd", MT_I32, 1, b->g->values[in[2]].dims[1] + 1, 0, 0);
        memcpy(n.iattr, f->iattr, sizeof n.iattr); n.sym_mask = f->sym_mask;
        mt__push(b, &n); mt__acc(b, in[0], dx);
        return;
    }
    case MT_OP_GMM: {
        if (dy < 0) return;
        int dX = mt__gout(b, in[0]), dW = mt__gout(b, in[1]);
        if (dX >= 0) {
            n = mt__node(b, MT_OP_GMM_DX);
            n.in[0] = dy; n.in[1] = in[1]; n.in[2] = in[2]; n.out[0] = dX;
            mt__push(b, &n); mt__acc(b, in[0], dX);
        }
        if (dW >= 0) {
            n = mt__node(b, MT_OP_GMM_DW);
            n.in[0] = dy; n.in[1] = in[0]; n.in[2] = in[2]; n.out[0] = dW;
            mt__push(b, &n); mt__acc(b, in[1], dW);
        }
        return;
    }
    case MT_OP_MOE_COMBINE: {
        if (dy < 0) return;
        n = mt__node(b, MT_OP_MOE_COMBINE_BWD);
        n.in[0] = dy; n.in[1] = in[0]; n.in[2] = in[1]; n.in[3] = in[2];
        n.out[0] = mt__gout(b, in[0]); n.out[1] = mt__gout(b, in[2]); n.iattr[1] = f->iattr[1];
        if (n.out[0] < 0 || n.out[1] < 0) { mt__fail(b, "internal error: MoE combine of '%s' lacks gradients", b->g->values[out[0]].name); return; }
        mt__push(b, &n); mt__acc(b, in[0], n.out[0]); mt__acc(b, in[2], n.out[1]);
        return;
    }
    case MT_OP_ALLGATHER: {       /* the adjoint of an all-gather is a reduce-scatter (sum) */
        int ds = mt__gout(b, in[0]);
        if (dy < 0 || ds < 0) return;
        n = mt__node(b, MT_OP_REDUCE_SCATTER);
        n.queue = MT_Q_DP; n.in[0] = dy; n.out[0] = ds;
        n.iattr[0] = f->iattr[0]; n.iattr[1] = f->iattr[1];
        mt__push(b, &n); mt__acc(b, in[0], ds);
        return;
    }
    case MT_OP_SP_GATHER: case MT_OP_SP_SCATTER: {   /* each is the other's adjoint */
        int dx = mt__gout(b, in[0]);
        if (dy < 0 || dx < 0) return;
        n = mt__node(b, f->op == MT_OP_SP_GATHER ? MT_OP_SP_SCATTER : MT_OP_SP_GATHER);
        n.queue = f->queue; n.in[0] = dy; n.out[0] = dx;
        n.iattr[0] = f->iattr[0]; n.iattr[1] = f->iattr[1];
        mt__push(b, &n); mt__acc(b, in[0], dx);
        return;
    }
    case MT_OP_CE_COMBINE: {      /* the loss on vocab shards: each rank's logits' gradient from the combined lse */
        int dl = mt__gout(b, in[1]);
        if (dl < 0) return;
        n = mt__node(b, MT_OP_CE_SHARD_BWD);
        n.in[0] = in[1]; n.in[1] = out[1]; n.in[2] = in[2]; n.out[0] = dl;
        n.iattr[0] = b->sym_coord[MT_DIM_TP]; n.sym_mask = 1u;
        n.iattr[1] = f->iattr[1]; n.fattr[0] = f->fattr[0];
        mt__push(b, &n); mt__acc(b, in[1], dl);
        return;
    }
    case MT_OP_CROSS_ENTROPY: {   /* the loss: dLoss/dloss = 1 */
        int dl = mt__gout(b, in[0]);
        if (dl < 0) return;
        n = mt__node(b, MT_OP_CROSS_ENTROPY_BWD);
        n.in[0] = in[0]; n.in[1] = out[1]; n.in[2] = in[1]; n.out[0] = dl;
        n.iattr[1] = f->iattr[1]; n.fattr[0] = f->fattr[0];
        mt__push(b, &n); mt__acc(b, in[0], dl);
        return;
    }
    }
    mt__fail(b, "internal error: no backward rule for %s", mt_ops[f->op].name);
}

/* FSDP reshards after the forward: the backward gathers a weight again just
 * before its first backward use, so the forward's copy dies with the
 * forward. The re-gathered copy sends its gradient to the original.
 * Except at the turn: a weight the forward reads in its last block or after
 * (that block's, the final norm's, the output head's) keeps its forward copy
 * for the backward, which starts right there: gathering it again could not
 * be prefetched (mid, 2 H200s: 2.5 ms a step the compute stream waited). */
static int mt__regather(mt__builder *b, int full) {
    if (b->vi[full].again >= 0) return b->vi[full].again;
    const mt_graph *g = b->g;
    for (int i = g->n_forward_nodes - 1; i >= b->keep_from; i--)
        for (int k = 0; k < g->nodes[i].n_in; k++)
            if (g->nodes[i].in[k] == full) { b->vi[full].again = full; return full; }
    const mt_value w = b->g->values[full];
    int again = mt__value(b, w.name, w.dtype, MT_ROLE_ACT, w.ndim, w.dims[0], w.dims[1], w.dims[2]);
    if (again < 0) return full;
    mt__set_shard(b, again, MT_VF_GATHERED, w.shard);
    mt_node n = mt__node(b, MT_OP_ALLGATHER);
    n.queue = MT_Q_DP; n.in[0] = b->vi[full].shard_of; n.out[0] = again; n.iattr[0] = (int)w.shard;
    mt__push(b, &n);
    b->vi[again].master = full; b->vi[again].req = 1;
    b->vi[full].again = again;
    return again;
}

/* Whether op's backward rule reads its input k; an FSDP weight it does not read is not gathered
 * again for the backward (the embedding's backward needs the token ids, not the table). */
static int mt__backward_reads(int op, int k) { return !(op == MT_OP_EMBED && k == 1); }

static int mt__backward(mt__builder *b) {
    mt_graph *g = b->g;
    int n_fwd = g->n_forward_nodes, last = -1;
    b->phase = MT_PHASE_BACKWARD;
    for (int i = 0; i < n_fwd; i++) if (g->nodes[i].layer > last) last = g->nodes[i].layer;
    b->keep_from = n_fwd;   /* the first forward node of the last block (the highest layer: MTP's, if any) */
    for (int i = 0; i < n_fwd; i++) if (g->nodes[i].layer == last) { b->keep_from = i; break; }
    for (int i = n_fwd - 1; i >= 0 && !b->failed; i--) {
        mt_node f = g->nodes[i];   /* copy: pushing may move the array */
        if (!mt_ops[f.op].differentiable) continue;
        int any = f.op == MT_OP_CROSS_ENTROPY || f.op == MT_OP_CE_COMBINE;
        for (int k = 0; k < f.n_out; k++) if (f.out[k] >= 0 && b->vi[f.out[k]].grad >= 0) any = 1;
        if (!any) continue;
        b->layer = f.layer;
        for (int k = 0; k < f.n_in; k++)
            if (f.op != MT_OP_ALLGATHER && f.in[k] >= 0 && b->vi[f.in[k]].shard_of >= 0 && mt__backward_reads(f.op, k))
                f.in[k] = mt__regather(b, f.in[k]);
        mt__backward_rule(b, &f);
    }
    b->layer = -1;
    return b->failed ? -1 : 0;
}

/* --- gradient reduction, clipping, AdamW, expert-bias update --- */

static int mt__optimizer(mt__builder *b) {
    mt_graph *g = b->g;
    b->phase = MT_PHASE_OPTIMIZER; b->layer = -1;
    int hp = g->io[MT_IO_HPARAMS], step = g->io[MT_IO_STEP];
    uint32_t dense_dims = MT_DIMBIT(MT_DIM_DP_REPLICATE) | MT_DIMBIT(MT_DIM_DP_SHARD);
    uint32_t expert_dims = MT_DIMBIT(MT_DIM_DP_REPLICATE) | MT_DIMBIT(MT_DIM_EDP);
    int tp = mt__tp(b);
    uint32_t tp_dim = tp > 1 ? MT_DIMBIT(MT_DIM_TP) : 0;   /* replicated weights' partial gradients, and counts, add over tp */
    /* The loss is the mean over the data-parallel ranks, so every gradient is
     * the sum of the ranks' gradients over DP, each already scaled by 1/DP at
     * the loss (mt__cross_entropy). A sharded gradient was summed over its
     * shard dims by the reduce-scatter; an expert's gradient already holds the
     * tokens of its whole ep group. What remains is a sum over the ranks that
     * hold the same part: an all-reduce where that group has several ranks. */
    mt_node n;
    /* the logged loss is the mean over data-parallel ranks */
    n = mt__node(b, MT_OP_ALLREDUCE);
    n.queue = MT_Q_DP; n.in[0] = n.out[0] = g->io[MT_IO_LOSS]; n.iattr[0] = (int)dense_dims; n.iattr[2] = 1;
    mt__push(b, &n);
    for (int k = 1; k <= g->cfg.mtp_layers && !b->failed; k++) {   /* and so are the MTP depths' */
        char nm[32];
        snprintf(nm, sizeof nm, "mtp_loss.%d", k);
        n.in[0] = n.out[0] = mt_graph_find(g, nm);
        mt__push(b, &n);
    }
    for (int i = 0; i < b->n_params && !b->failed; i++) {
        int p = b->params[i], gv = b->vi[p].grad;
        if (gv < 0) return mt__fail(b, "internal error: parameter '%s' received no gradient", g->values[p].name);
        uint32_t fl = g->values[p].flags;
        uint32_t over = ((fl & MT_VF_EXPERTS) ? expert_dims : dense_dims | ((fl & MT_VF_TP) ? 0 : tp_dim)) & ~g->values[p].shard;
        if (mt_mesh_group_size(&g->mesh, over) == 1) continue;
        n = mt__node(b, MT_OP_ALLREDUCE);         /* sum over the ranks that hold the same part of p */
        n.queue = MT_Q_DP; n.in[0] = n.out[0] = gv; n.iattr[0] = (int)over;
        mt__push(b, &n);
    }
    /* The global gradient norm, fixed order. dp_shard ranks hold disjoint parts of the gradients
     * (FSDP shards, and experts split over ep x edp): the squares add up across them. Under tp the
     * split weights and the experts are disjoint over dp_shard x tp too (chain 0), while the
     * replicated weights' reduced gradients are the same on every tp rank (chain 1, counted once). */
    int acc = -1, chain[2] = {-1, -1};
    for (int i = 0; i < b->n_params && !b->failed; i++) {
        uint32_t fl = g->values[b->params[i]].flags;
        int k = tp > 1 && !(fl & (MT_VF_TP | MT_VF_EXPERTS));
        int o = mt__value(b, "gnorm.sumsq", MT_F32, MT_ROLE_SCRATCH, 1, 1, 0, 0);
        n = mt__node(b, MT_OP_SUMSQ);
        n.in[0] = b->vi[b->params[i]].grad; n.in[1] = chain[k]; n.out[0] = o;
        mt__push(b, &n);
        chain[k] = o;
    }
    for (int k = 0; k < 2; k++) {
        uint32_t over = MT_DIMBIT(MT_DIM_DP_SHARD) | (k ? 0 : tp_dim);
        if (mt_mesh_group_size(&g->mesh, over) > 1 && chain[k] >= 0) {
            n = mt__node(b, MT_OP_ALLREDUCE);
            n.queue = MT_Q_DP; n.in[0] = n.out[0] = chain[k]; n.iattr[0] = (int)over;
            mt__push(b, &n);
        }
    }
    acc = chain[0];
    if (chain[1] >= 0) {   /* the two partial sums, as one SUMSQ of squares (chain 0 first) */
        int o = mt__value(b, "gnorm.sumsq", MT_F32, MT_ROLE_SCRATCH, 1, 1, 0, 0);
        n = mt__node(b, MT_OP_SUMSQ);
        n.in[0] = chain[1]; n.in[1] = chain[0]; n.out[0] = o; n.iattr[0] = 1;
        mt__push(b, &n);
        acc = o;
    }
    g->io[MT_IO_LR] = mt__value(b, "lr", MT_F32, MT_ROLE_OUTPUT, 1, 1, 0, 0);
    n = mt__node(b, MT_OP_LR_SCHEDULE);
    n.in[0] = hp; n.in[1] = step; n.out[0] = g->io[MT_IO_LR];
    mt__push(b, &n);
    int coef = mt__value(b, "clip.coef", MT_F32, MT_ROLE_SCRATCH, 1, 1, 0, 0);
    g->io[MT_IO_GRAD_NORM] = mt__value(b, "grad_norm", MT_F32, MT_ROLE_OUTPUT, 1, 1, 0, 0);
    n = mt__node(b, MT_OP_CLIP);
    n.in[0] = acc; n.in[1] = hp; n.out[0] = coef; n.out[1] = g->io[MT_IO_GRAD_NORM];
    mt__push(b, &n);
    for (int i = 0; i < b->n_params && !b->failed; i++) {
        int p = b->params[i];
        const mt_value pv = g->values[p];
        char nm[MT_NAME_LEN];
        snprintf(nm, sizeof nm, "exp_avg.%.*s", MT_NAME_LEN - 10, pv.name);
        int m = mt__value(b, nm, MT_F32, MT_ROLE_OPT, pv.ndim, pv.dims[0], pv.dims[1], pv.dims[2]);
        snprintf(nm, sizeof nm, "exp_avg_sq.%.*s", MT_NAME_LEN - 12, pv.name);
        int v = mt__value(b, nm, MT_F32, MT_ROLE_OPT, pv.ndim, pv.dims[0], pv.dims[1], pv.dims[2]);
        if (m < 0 || v < 0) return -1;
        g->values[m].param = p; g->values[v].param = p;
        g->values[m].init = g->values[v].init = MT_INIT_ZERO;
        mt__set_shard(b, m, 0, pv.shard); mt__set_shard(b, v, 0, pv.shard);
        int shadow = -1;
        for (int s = 0; s < g->n_values; s++)
            if (b->vi[s].master == p) { shadow = s; break; }
        n = mt__node(b, MT_OP_ADAMW);
        n.in[0] = p; n.in[1] = b->vi[p].grad; n.in[2] = m; n.in[3] = v; n.in[4] = g->io[MT_IO_LR];
        n.in[5] = coef; n.in[6] = hp; n.in[7] = step;
        n.out[0] = p; n.out[1] = m; n.out[2] = v; n.out[3] = shadow;
        n.iattr[0] = (pv.flags & MT_VF_DECAY) ? 1 : 0;
        mt__push(b, &n);
    }
    /* auxiliary-loss-free balancing: counts summed over every rank that sees
     * different tokens, then bias += coeff * sign(mean - count), centred */
    for (int i = 0; i < b->n_moe && !b->failed; i++) {
        if (g->cfg.load_balance_coeff <= 0) break;
        b->layer = (int)(g->cfg.n_dense_layers + i);
        n = mt__node(b, MT_OP_ALLREDUCE);
        n.queue = MT_Q_DP; n.in[0] = n.out[0] = b->counts[i]; n.iattr[0] = (int)(dense_dims | tp_dim);
        mt__push(b, &n);
        n = mt__node(b, MT_OP_EXPERT_BIAS_UPDATE);
        n.in[0] = n.out[0] = b->biases[i]; n.in[1] = b->counts[i]; n.fattr[0] = g->cfg.load_balance_coeff;
        mt__push(b, &n);
    }
    b->layer = -1;
    return b->failed ? -1 : 0;
}

int mt_build(mt_graph *g, const mt_config *c, const mt_mesh *m, const mt_target *t, int kind,
             mt_err *err) {
    return mt_build_chunked(g, c, m, t, kind, 1, err);
}
int mt_build_chunked(mt_graph *g, const mt_config *c, const mt_mesh *m, const mt_target *t, int kind,
                     int chunks, mt_err *err) {
    memset(g, 0, sizeof *g);
    if (mt_config_validate(c, err) || mt_mesh_validate(m, c, err)) return -1;
    if (chunks < 1 || chunks > MT_MOE_CHUNKS_MAX) return mt_errf(err, "MoE chunks: %d, not 1 to %d", chunks, MT_MOE_CHUNKS_MAX);
    if (kind != MT_GRAPH_TRAIN && kind != MT_GRAPH_FORWARD) return mt_errf(err, "unknown graph kind %d", kind);
    if (kind == MT_GRAPH_FORWARD && m->size[MT_DIM_TP] > 1)
        return mt_errf(err, "a forward graph's logits are whole on every rank: build it with tp = 1 (tp = %d splits them)", m->size[MT_DIM_TP]);
    g->cfg = *c; g->mesh = *m; g->target = *t; g->kind = kind;
    for (int i = 0; i < MT_NIO; i++) g->io[i] = -1;
    mt__builder bb;
    memset(&bb, 0, sizeof bb);
    mt__builder *b = &bb;
    b->g = g; b->err = err; b->layer = -1; b->chunks = chunks;
    b->act = t->backend == MT_BACKEND_CUDA ? MT_BF16 : MT_F32;
    b->counts = (int32_t *)mt__calloc(sizeof(int32_t) * (size_t)(c->n_layers + c->mtp_layers + 1));
    b->biases = (int32_t *)mt__calloc(sizeof(int32_t) * (size_t)(c->n_layers + c->mtp_layers + 1));
    /* symbols: one coordinate per mesh dimension, and the data-dependent
     * number of tokens this rank's experts receive (per chunk of tokens) */
    g->syms = (mt_symbol *)mt__calloc(sizeof(mt_symbol) * (MT_NDIMS + MT_MOE_CHUNKS_MAX));
    if (!g->syms || !b->counts || !b->biases) { mt_errf(err, "out of memory"); goto fail; }
    for (int d = 0; d < MT_NDIMS; d++) {
        mt_symbol *s = &g->syms[g->n_syms];
        snprintf(s->name, sizeof s->name, "coord.%s", mt_dim_names[d]);
        s->kind = MT_SYM_COORD; s->mesh_dim = d; s->max = m->size[d] - 1;
        b->sym_coord[d] = g->n_syms++;
    }
    for (int ch = 0; ch < chunks; ch++) {   /* mt__moe's chunk ch: rows [N*ch/C, N*(ch+1)/C) of N */
        mt_symbol *s = &g->syms[g->n_syms];
        int64_t N = (int64_t)c->batch * c->seq_len / m->size[MT_DIM_TP];
        if (chunks == 1) snprintf(s->name, sizeof s->name, "ep_recv_tokens");
        else snprintf(s->name, sizeof s->name, "ep_recv_tokens.c%d", ch);
        s->kind = MT_SYM_SIZE; s->mesh_dim = MT_DIM_EP;
        s->max = (N * (ch + 1) / chunks - N * ch / chunks) * c->top_k * m->size[MT_DIM_EP];
        b->sym_recv[ch] = g->n_syms++;
    }
    if (kind == MT_GRAPH_TRAIN) {
        g->io[MT_IO_STEP] = mt__value(b, "step", MT_I32, MT_ROLE_INPUT, 1, 1, 0, 0);
        g->io[MT_IO_HPARAMS] = mt__value(b, "hparams", MT_F32, MT_ROLE_INPUT, 1, MT_HP_COUNT, 0, 0);
    }
    if (mt__forward(b)) goto fail;
    g->n_forward_nodes = g->n_nodes;
    if (kind == MT_GRAPH_TRAIN && (mt__backward(b) || mt__optimizer(b))) goto fail;
    MT_FREE(b->vi); MT_FREE(b->params);
    MT_FREE(b->counts); MT_FREE(b->biases); MT_FREE(b->names);
    mt_plan_naive(g);
    return 0;
fail:
    MT_FREE(b->vi); MT_FREE(b->params);
    MT_FREE(b->counts); MT_FREE(b->biases); MT_FREE(b->names);
    mt_graph_free(g);
    return -1;
}

/* ========================================================================
 * 6. Passes
 * ====================================================================== */

static const char *mt__human(double bytes, char *buf);   /* "1.50 GiB" (section 7) */
#define MT_ALIGN 256
static int64_t mt__align(int64_t x) { return (x + MT_ALIGN - 1) & ~(int64_t)(MT_ALIGN - 1); }

/* first[v] = index of the node that writes v first, last[v] = index of the
 * last node that reads or writes it; -1 if no node touches v. */
static void mt__live_ranges(const mt_graph *g, int32_t *first, int32_t *last) {
    for (int v = 0; v < g->n_values; v++) first[v] = last[v] = -1;
    for (int i = 0; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        for (int k = 0; k < n->n_in; k++) {
            int v = n->in[k];
            if (v < 0) continue;
            if (first[v] < 0) first[v] = i;
            last[v] = i;
        }
        for (int k = 0; k < n->n_out; k++) {
            int v = n->out[k];
            if (v < 0) continue;
            if (first[v] < 0) first[v] = i;
            last[v] = i;
        }
    }
}
void mt_value_live_range(const mt_graph *g, int v, int *first, int *last) {
    *first = *last = -1;
    for (int i = 0; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        int touch = 0;
        for (int k = 0; k < n->n_in; k++) touch |= n->in[k] == v;
        for (int k = 0; k < n->n_out; k++) touch |= n->out[k] == v;
        if (touch) { if (*first < 0) *first = i; *last = i; }
    }
}

/* Persistent values always get their own bytes, in value order. */
static void mt__plan_persistent(mt_graph *g) {
    int64_t p = 0;
    for (int v = 0; v < g->n_values; v++) {
        mt_value *x = &g->values[v];
        if (MT_ROLE_IN_ARENA(x->role)) continue;
        x->offset = p;
        p = mt__align(p + x->nbytes);
    }
    g->persist_bytes = p;
}

void mt_plan_naive(mt_graph *g) {
    mt__plan_persistent(g);
    int64_t a = 0;
    for (int v = 0; v < g->n_values; v++) {
        mt_value *x = &g->values[v];
        if (!MT_ROLE_IN_ARENA(x->role)) continue;
        x->offset = a;
        a = mt__align(a + x->nbytes);
    }
    g->arena_bytes = g->naive_arena_bytes = a;
    g->planned = 0;
}

typedef struct { int64_t size, offset; int32_t first, last, id; } mt__slot;
static int mt__by_size_desc(const void *a, const void *b) {
    const mt__slot *x = (const mt__slot *)a, *y = (const mt__slot *)b;
    if (x->size != y->size) return x->size > y->size ? -1 : 1;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    return x->id - y->id;
}
static int mt__by_offset(const void *a, const void *b) {
    const mt__slot *x = *(const mt__slot *const *)a, *y = *(const mt__slot *const *)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return x->id - y->id;
}

static int mt__overlap_ranges(const mt_graph *g, int32_t *first, int32_t *last, mt_err *err);

/* Liveness-based arena reuse: place the largest values first, each at the
 * lowest offset that does not overlap a placed value alive at the same time.
 * With g->overlap, "alive" spans the whole time another stream may touch the
 * value (the hazard rule, below mt_node_capturable). */
int mt_pass_plan_memory(mt_graph *g, mt_err *err) {
    mt_plan_naive(g);
    int nv = g->n_values, n = 0;
    int32_t *first = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));
    int32_t *last = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));
    mt__slot *s = (mt__slot *)MT_MALLOC(sizeof(mt__slot) * (size_t)(nv + 1));
    mt__slot **busy = (mt__slot **)MT_MALLOC(sizeof(mt__slot *) * (size_t)(nv + 1));
    if (!first || !last || !s || !busy) {
        MT_FREE(first); MT_FREE(last); MT_FREE(s); MT_FREE(busy);
        return mt_errf(err, "out of memory planning memory");
    }
    mt__live_ranges(g, first, last);
    if (g->overlap && mt__overlap_ranges(g, first, last, err)) {
        MT_FREE(first); MT_FREE(last); MT_FREE(s); MT_FREE(busy);
        return -1;
    }
    for (int v = 0; v < nv; v++) {
        if (!MT_ROLE_IN_ARENA(g->values[v].role)) continue;
        mt__slot x = {mt__align(g->values[v].nbytes), 0, first[v], last[v], v};
        if (x.first < 0) x.first = x.last = INT32_MAX;  /* never touched: alone at the end of time */
        s[n++] = x;
    }
    qsort(s, (size_t)n, sizeof *s, mt__by_size_desc);
    int64_t top = 0;
    for (int i = 0; i < n; i++) {
        int nb = 0;
        for (int j = 0; j < i; j++)
            if (s[j].first <= s[i].last && s[i].first <= s[j].last) busy[nb++] = &s[j];
        qsort(busy, (size_t)nb, sizeof *busy, mt__by_offset);
        int64_t at = 0;
        for (int j = 0; j < nb; j++) {
            if (busy[j]->offset >= at + s[i].size) break;     /* fits in the gap before it */
            int64_t end = busy[j]->offset + busy[j]->size;
            if (end > at) at = end;
        }
        s[i].offset = at;
        if (at + s[i].size > top) top = at + s[i].size;
        g->values[s[i].id].offset = at;
    }
    g->arena_bytes = top;
    g->planned = 1;
    MT_FREE(first); MT_FREE(last); MT_FREE(s); MT_FREE(busy);
    return 0;
}

/* No two values that are alive at the same time share a byte; persistent
 * values never share bytes; everything lies inside its region. */
int mt_plan_check(const mt_graph *g, mt_err *err) {
    int nv = g->n_values;
    int32_t *first = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));
    int32_t *last = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));
    mt__slot *s = (mt__slot *)MT_MALLOC(sizeof(mt__slot) * (size_t)(nv + 1));
    mt__slot **ord = (mt__slot **)MT_MALLOC(sizeof(mt__slot *) * (size_t)(nv + 1));
    int rc = 0;
    if (!first || !last || !s || !ord) { rc = mt_errf(err, "out of memory checking the plan"); goto done; }
    mt__live_ranges(g, first, last);
    for (int pass = 0; pass < 2 && !rc; pass++) {     /* 0: persistent, 1: arena */
        int n = 0;
        int64_t limit = pass ? g->arena_bytes : g->persist_bytes;
        for (int v = 0; v < nv; v++) {
            const mt_value *x = &g->values[v];
            if (MT_ROLE_IN_ARENA(x->role) != pass) continue;
            if (x->offset < 0 || x->nbytes < 0 || x->offset > limit - x->nbytes) {
                rc = mt_errf(err, "value '%s' (%lld bytes at %lld) lies outside its %s region of %lld bytes",
                             x->name, (long long)x->nbytes, (long long)x->offset, pass ? "arena" : "persistent",
                             (long long)limit);
                break;
            }
            mt__slot e = {x->nbytes, x->offset, pass ? first[v] : 0, pass ? last[v] : INT32_MAX, v};
            if (pass && e.first < 0) continue;   /* never alive */
            s[n] = e; ord[n] = &s[n]; n++;
        }
        if (rc) break;
        qsort(ord, (size_t)n, sizeof *ord, mt__by_offset);
        /* sweep by offset; compare each value with the later ones that start before it ends */
        for (int i = 0; i < n && !rc; i++)
            for (int j = i + 1; j < n && ord[j]->offset < ord[i]->offset + ord[i]->size; j++) {
                if (ord[i]->size == 0 || ord[j]->size == 0) continue;
                if (ord[i]->first <= ord[j]->last && ord[j]->first <= ord[i]->last) {
                    rc = mt_errf(err, "memory plan overlap: '%s' and '%s' are alive at the same time and share bytes",
                                 g->values[ord[i]->id].name, g->values[ord[j]->id].name);
                    break;
                }
            }
    }
done:
    MT_FREE(first); MT_FREE(last); MT_FREE(s); MT_FREE(ord);
    return rc;
}

/* Ops that need data on the host before they can launch. None on one rank:
 * the grouped GEMMs read the expert offsets on the device. The expert
 * exchange over several ranks will (an all-to-all-v takes host counts). */
int mt_node_syncs_host(const mt_node *n) {
    return (n->op == MT_OP_EP_DISPATCH || n->op == MT_OP_EP_COMBINE || n->op == MT_OP_EP_COUNTS) && n->iattr[2] > 1;
}
static int mt__is_collective(int op) {
    return op == MT_OP_ALLREDUCE || op == MT_OP_ALLGATHER || op == MT_OP_REDUCE_SCATTER || op == MT_OP_EP_COUNTS ||
           op == MT_OP_EP_DISPATCH || op == MT_OP_EP_COMBINE || op == MT_OP_SP_GATHER || op == MT_OP_SP_SCATTER;
}
/* A node can be recorded into a CUDA graph and replayed when what it does
 * does not depend on this step's data on the host: not the expert exchange
 * over several ranks (host counts), not a node whose rows are data-dependent
 * (a replay would keep the captured count), not a collective over several
 * ranks (they run eagerly between the captured regions). */
int mt_node_capturable(const mt_graph *G, const mt_node *n) {
    if (mt_node_syncs_host(n)) return 0;
    if (mt__is_collective(n->op) && mt_mesh_group_size(&G->mesh, (uint32_t)n->iattr[0]) > 1) return 0;
    for (int k = 0; k < n->n_in; k++) if (n->in[k] >= 0 && G->values[n->in[k]].dims[0] < 0) return 0;
    for (int k = 0; k < n->n_out; k++) if (n->out[k] >= 0 && G->values[n->out[k]].dims[0] < 0) return 0;
    return 1;
}

/* --- Queues, events and the hazard rule ------------------------------------
 * Every node names a queue: MT_Q_COMPUTE (kernels), MT_Q_DP (FSDP all-gathers,
 * gradient reduce-scatters and all-reduces) or MT_Q_EP (the expert exchange).
 * With g->overlap each queue is a CUDA stream (DP and EP at high priority); a
 * collective over one rank stays on the compute stream (it is a copy or a
 * scale: nothing to hide). Each stream runs its nodes in list order, and the
 * host issues them in list order. mt_schedule_build() derives the events:
 *
 *   node i on queue q waits for (the event recorded after) node w when w is
 *     - the last earlier writer of a value i reads, on another queue (RAW);
 *     - the last earlier reader or writer, on each other queue, of a value
 *       i writes (WAR, WAW);
 *     - for a collective with no wait on the compute stream: the compute node
 *       just before it (its issue point; a prefetch starts there, no earlier);
 *     - for a compute node: every collective issued two stages before
 *       (stage: a run of compute nodes with one phase and layer) that it has
 *       not waited for yet (a join). So a block's gradient reduce-scatters
 *       overlap the next block's backward, and at most two blocks' gathered
 *       weights (or whole gradients) are alive at once.
 *   The runtime also fences each step: the side streams wait for its start,
 *   the compute stream for all of them at its end.
 *
 * Time is the compute stream's position. A node on another stream may run at
 * any moment after the last compute node it happens after (after[i], through
 * waits and stream order) and before the first compute node that happens
 * after it (done[i]).
 *
 * THE HAZARD RULE (memory planner): a value a compute node j touches is alive
 * at j; a value a side node i touches is alive over [after[i]+1, done[i]].
 * Two values share arena bytes only when these spans are disjoint. Then every
 * access of the earlier value happens before every access of the later one in
 * every interleaving the events allow. mt_schedule_check() verifies exactly
 * that (and the RAW/WAR/WAW waits) with vector clocks.
 * Not modelled: the op workspace (rt->scratch), which only compute nodes use
 * (the EP exchange stages in its own buffer, on its own stream).
 * ------------------------------------------------------------------------- */
int mt_node_queue(const mt_graph *g, const mt_node *n) {
    if (!g->overlap || n->queue == MT_Q_COMPUTE || !mt__is_collective(n->op)) return MT_Q_COMPUTE;
    if (n->queue < 0 || n->queue >= MT_NQUEUES) return MT_Q_COMPUTE;
    return mt_mesh_group_size(&g->mesh, (uint32_t)n->iattr[0]) > 1 ? n->queue : MT_Q_COMPUTE;
}
void mt_schedule_free(mt_schedule *s) {
    MT_FREE(s->queue); MT_FREE(s->wait_at); MT_FREE(s->wait); MT_FREE(s->after); MT_FREE(s->done);
    memset(s, 0, sizeof *s);
}
static int mt__reads(const mt_node *n, int v) {
    for (int k = 0; k < n->n_in; k++) if (n->in[k] == v) return 1;
    return 0;
}
static int mt__writes(const mt_node *n, int v) {
    for (int k = 0; k < n->n_out; k++) if (n->out[k] == v) return 1;
    return 0;
}
/* vector clocks: vc[i*Q + q] = the last node on queue q that node i happens after (itself on its own queue) */
static void mt__merge_vc(int32_t *dst, const int32_t *src) {
    for (int q = 0; q < MT_NQUEUES; q++) if (src[q] > dst[q]) dst[q] = src[q];
}
/* compute-stream stages: a new one where the (phase, layer) of compute nodes changes; side nodes take the current one */
static void mt__stages(const mt_graph *g, const int32_t *queue, int32_t *stage) {
    int st = -1, ph = -1, ly = -2;
    for (int i = 0; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        if (queue[i] == MT_Q_COMPUTE && (n->phase != ph || n->layer != ly)) { st++; ph = n->phase; ly = n->layer; }
        stage[i] = st;
    }
}
int mt_schedule_build(const mt_graph *g, mt_schedule *s, mt_err *err) {
    memset(s, 0, sizeof *s);
    int n = g->n_nodes, nv = g->n_values, cap = 64, rc = 0;
    s->n_nodes = n;
    s->queue = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(n + 1));
    s->wait_at = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(n + 2));
    s->after = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(n + 1));
    s->done = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(n + 1));
    s->wait = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)cap);
    int32_t *stage = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(n + 1));
    int32_t *vc = (int32_t *)MT_MALLOC(sizeof(int32_t) * MT_NQUEUES * (size_t)(n + 1));
    int32_t *lw = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));                 /* last writer */
    int32_t *la = (int32_t *)MT_MALLOC(sizeof(int32_t) * MT_NQUEUES * (size_t)(nv + 1));    /* last access per queue */
    int32_t *side = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(n + 1));                /* side nodes, per queue in order */
    if (!s->queue || !s->wait_at || !s->after || !s->done || !s->wait || !stage || !vc || !lw || !la || !side) {
        MT_FREE(stage); MT_FREE(vc); MT_FREE(lw); MT_FREE(la); MT_FREE(side);
        mt_schedule_free(s);
        return mt_errf(err, "out of memory scheduling");
    }
    for (int i = 0; i < n; i++) s->queue[i] = mt_node_queue(g, &g->nodes[i]);
    mt__stages(g, s->queue, stage);
    for (int v = 0; v < nv; v++) lw[v] = -1;
    for (int v = 0; v < nv * MT_NQUEUES; v++) la[v] = -1;
    int32_t cur[MT_NQUEUES][MT_NQUEUES];
    for (int q = 0; q < MT_NQUEUES; q++) for (int r = 0; r < MT_NQUEUES; r++) cur[q][r] = -1;
    int nside[MT_NQUEUES] = {0}, at[MT_NQUEUES] = {0}, start[MT_NQUEUES];
    for (int i = 0; i < n; i++) if (s->queue[i] != MT_Q_COMPUTE) nside[s->queue[i]]++;
    for (int q = 0, k = 0; q < MT_NQUEUES; q++) { start[q] = k; k += nside[q]; nside[q] = 0; }
    for (int i = 0; i < n; i++) if (s->queue[i] != MT_Q_COMPUTE) { int q = s->queue[i]; side[start[q] + nside[q]++] = i; }
    int last_compute = -1;
    s->n_wait = 0;
    for (int i = 0; i < n && !rc; i++) {
        const mt_node *x = &g->nodes[i];
        int q = s->queue[i], w0 = s->n_wait;
        int32_t *me = &vc[(size_t)i * MT_NQUEUES];
        for (int r = 0; r < MT_NQUEUES; r++) me[r] = cur[q][r];
        int cand[MT_MAX_IN + MT_MAX_OUT * MT_NQUEUES + MT_NQUEUES + 1], nc = 0;
        for (int k = 0; k < x->n_in; k++) if (x->in[k] >= 0) cand[nc++] = lw[x->in[k]];
        for (int k = 0; k < x->n_out; k++)
            if (x->out[k] >= 0) for (int r = 0; r < MT_NQUEUES; r++) cand[nc++] = la[(size_t)x->out[k] * MT_NQUEUES + r];
        int on_compute = 0;
        for (int c = 0; c < nc; c++) on_compute |= cand[c] >= 0 && s->queue[cand[c]] == MT_Q_COMPUTE && q != MT_Q_COMPUTE;
        if (q != MT_Q_COMPUTE && !on_compute) cand[nc++] = last_compute;      /* the issue point */
        for (int c = 0; c < nc && !rc; c++) {
            int w = cand[c];
            if (w < 0 || s->queue[w] == q || me[s->queue[w]] >= w) continue;   /* same stream, or already after it */
            if (s->n_wait + 1 > cap) {
                int32_t *nw = (int32_t *)MT_REALLOC(s->wait, sizeof(int32_t) * (size_t)(cap *= 2));
                if (!nw) { rc = mt_errf(err, "out of memory scheduling"); break; }
                s->wait = nw;
            }
            s->wait[s->n_wait++] = w;
            mt__merge_vc(me, &vc[(size_t)w * MT_NQUEUES]);
        }
        if (q == MT_Q_COMPUTE)   /* joins: collectives issued two stages ago */
            for (int r = 1; r < MT_NQUEUES && !rc; r++) {
                int j = -1;
                while (at[r] < nside[r] && side[start[r] + at[r]] < i && stage[side[start[r] + at[r]]] + 2 <= stage[i]) j = side[start[r] + at[r]++];
                if (j < 0 || me[r] >= j) continue;
                if (s->n_wait + 1 > cap) {
                    int32_t *nw = (int32_t *)MT_REALLOC(s->wait, sizeof(int32_t) * (size_t)(cap *= 2));
                    if (!nw) { rc = mt_errf(err, "out of memory scheduling"); break; }
                    s->wait = nw;
                }
                s->wait[s->n_wait++] = j;
                mt__merge_vc(me, &vc[(size_t)j * MT_NQUEUES]);
            }
        s->wait_at[i] = w0;
        me[q] = i;
        for (int r = 0; r < MT_NQUEUES; r++) cur[q][r] = me[r];
        for (int k = 0; k < x->n_in; k++) if (x->in[k] >= 0) la[(size_t)x->in[k] * MT_NQUEUES + q] = i;
        for (int k = 0; k < x->n_out; k++) if (x->out[k] >= 0) { la[(size_t)x->out[k] * MT_NQUEUES + q] = i; lw[x->out[k]] = i; }
        if (q == MT_Q_COMPUTE) last_compute = i;
    }
    s->wait_at[n] = s->n_wait;
    /* after[i]: the compute clock of i; done[i]: the first compute node whose clock covers i */
    for (int i = 0; i < n; i++) { s->after[i] = vc[(size_t)i * MT_NQUEUES + MT_Q_COMPUTE]; s->done[i] = s->queue[i] == MT_Q_COMPUTE ? i : n; }
    for (int q = 0; q < MT_NQUEUES; q++) at[q] = 0;
    for (int j = 0; j < n && !rc; j++) {
        if (s->queue[j] != MT_Q_COMPUTE) continue;
        for (int r = 1; r < MT_NQUEUES; r++)
            while (at[r] < nside[r] && side[start[r] + at[r]] <= vc[(size_t)j * MT_NQUEUES + r]) s->done[side[start[r] + at[r]++]] = j;
    }
    MT_FREE(stage); MT_FREE(vc); MT_FREE(lw); MT_FREE(la); MT_FREE(side);
    if (rc) mt_schedule_free(s);
    return rc;
}

/* The hazard rule's spans, widened into the planner's node-order live ranges. */
static int mt__overlap_ranges(const mt_graph *g, int32_t *first, int32_t *last, mt_err *err) {
    mt_schedule s;
    if (mt_schedule_build(g, &s, err)) return -1;
    for (int i = 0; i < g->n_nodes; i++) {
        if (s.queue[i] == MT_Q_COMPUTE) continue;
        const mt_node *n = &g->nodes[i];
        int lo = s.after[i] + 1, hi = s.done[i];
        for (int k = 0; k < n->n_in + n->n_out; k++) {
            int v = k < n->n_in ? n->in[k] : n->out[k - n->n_in];
            if (v < 0) continue;
            if (first[v] < 0 || lo < first[v]) first[v] = lo;
            if (hi > last[v]) last[v] = hi;
        }
    }
    mt_schedule_free(&s);
    return 0;
}

int mt_schedule_check(const mt_graph *g, const mt_schedule *s, mt_err *err) {
    int n = g->n_nodes, nv = g->n_values, rc = 0;
    if (s->n_nodes != n) return mt_errf(err, "schedule: %d nodes, the graph has %d", s->n_nodes, n);
    int32_t *vc = (int32_t *)MT_MALLOC(sizeof(int32_t) * MT_NQUEUES * (size_t)(n + 1));
    int32_t *lw = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));
    int32_t *la = (int32_t *)MT_MALLOC(sizeof(int32_t) * MT_NQUEUES * (size_t)(nv + 1));   /* last access per queue */
    int32_t *fa = (int32_t *)MT_MALLOC(sizeof(int32_t) * MT_NQUEUES * (size_t)(nv + 1));   /* first access per queue */
    int32_t *lo = (int32_t *)MT_MALLOC(sizeof(int32_t) * 2 * (size_t)(nv + 1));            /* first, last access */
    mt__slot *sl = (mt__slot *)MT_MALLOC(sizeof(mt__slot) * (size_t)(nv + 1));
    mt__slot **ord = (mt__slot **)MT_MALLOC(sizeof(mt__slot *) * (size_t)(nv + 1));
    if (!vc || !lw || !la || !fa || !lo || !sl || !ord) {
        MT_FREE(vc); MT_FREE(lw); MT_FREE(la); MT_FREE(fa); MT_FREE(lo); MT_FREE(sl); MT_FREE(ord);
        return mt_errf(err, "out of memory checking the schedule");
    }
    for (int v = 0; v < nv; v++) { lw[v] = -1; lo[2 * v] = lo[2 * v + 1] = -1; }
    for (int v = 0; v < nv * MT_NQUEUES; v++) la[v] = fa[v] = -1;
    int32_t cur[MT_NQUEUES][MT_NQUEUES];
    for (int q = 0; q < MT_NQUEUES; q++) for (int r = 0; r < MT_NQUEUES; r++) cur[q][r] = -1;
    /* 1. the happens-before order the streams and the waits give, and the data hazards of each value */
    for (int i = 0; i < n && !rc; i++) {
        const mt_node *x = &g->nodes[i];
        int q = s->queue[i];
        if (q < 0 || q >= MT_NQUEUES) { rc = mt_errf(err, "schedule: node %d has queue %d", i, q); break; }
        int32_t *me = &vc[(size_t)i * MT_NQUEUES];
        for (int r = 0; r < MT_NQUEUES; r++) me[r] = cur[q][r];
        for (int k = s->wait_at[i]; k < s->wait_at[i + 1]; k++) {
            int w = s->wait[k];
            if (w < 0 || w >= i) { rc = mt_errf(err, "schedule: node %d waits on node %d, which is not earlier", i, w); break; }
            mt__merge_vc(me, &vc[(size_t)w * MT_NQUEUES]);
        }
        if (rc) break;
        me[q] = i;
        for (int r = 0; r < MT_NQUEUES; r++) cur[q][r] = me[r];
        for (int k = 0; k < x->n_in && !rc; k++) {
            int v = x->in[k], w = v >= 0 ? lw[v] : -1;
            if (w >= 0 && me[s->queue[w]] < w)
                rc = mt_errf(err, "hazard: node %d (%s, queue %s) reads '%s', written by node %d (%s, queue %s) with no wait for it",
                             i, mt_ops[x->op].name, mt_queue_names[q], g->values[v].name, w, mt_ops[g->nodes[w].op].name,
                             mt_queue_names[s->queue[w]]);
        }
        for (int k = 0; k < x->n_out && !rc; k++) {
            int v = x->out[k];
            if (v < 0) continue;
            for (int r = 0; r < MT_NQUEUES && !rc; r++) {
                int w = la[(size_t)v * MT_NQUEUES + r];
                if (w >= 0 && w != i && me[r] < w)
                    rc = mt_errf(err, "hazard: node %d (%s, queue %s) writes '%s' while node %d (%s, queue %s) may still use it",
                                 i, mt_ops[x->op].name, mt_queue_names[q], g->values[v].name, w, mt_ops[g->nodes[w].op].name,
                                 mt_queue_names[r]);
            }
        }
        for (int k = 0; k < x->n_in + x->n_out; k++) {
            int v = k < x->n_in ? x->in[k] : x->out[k - x->n_in];
            if (v < 0) continue;
            if (k >= x->n_in) lw[v] = i;
            la[(size_t)v * MT_NQUEUES + q] = i;
            if (fa[(size_t)v * MT_NQUEUES + q] < 0) fa[(size_t)v * MT_NQUEUES + q] = i;
            if (lo[2 * v] < 0) lo[2 * v] = i;
            lo[2 * v + 1] = i;
        }
    }
    /* 2. arena bytes shared by two values: every use of the earlier one happens before every use of the later one */
    int m = 0;
    for (int v = 0; v < nv && !rc; v++) {
        const mt_value *x = &g->values[v];
        if (!MT_ROLE_IN_ARENA(x->role) || lo[2 * v] < 0 || x->nbytes <= 0) continue;
        mt__slot e = {x->nbytes, x->offset, lo[2 * v], lo[2 * v + 1], v};
        sl[m] = e; ord[m] = &sl[m]; m++;
    }
    if (!rc) qsort(ord, (size_t)m, sizeof *ord, mt__by_offset);
    for (int i = 0; i < m && !rc; i++)
        for (int j = i + 1; j < m && ord[j]->offset < ord[i]->offset + ord[i]->size && !rc; j++) {
            const mt__slot *a = ord[i], *b = ord[j];
            if (a->first <= b->last && b->first <= a->last) {
                rc = mt_errf(err, "hazard: '%s' and '%s' share bytes and are alive at the same time",
                             g->values[a->id].name, g->values[b->id].name);
                break;
            }
            if (a->first > b->last) { const mt__slot *t = a; a = b; b = t; }   /* a: the earlier value */
            for (int r = 0; r < MT_NQUEUES && !rc; r++) {
                int la_ = la[(size_t)a->id * MT_NQUEUES + r];
                if (la_ < 0) continue;
                for (int r2 = 0; r2 < MT_NQUEUES && !rc; r2++) {
                    int fb = fa[(size_t)b->id * MT_NQUEUES + r2];
                    if (fb >= 0 && vc[(size_t)fb * MT_NQUEUES + r] < la_)
                        rc = mt_errf(err, "hazard: '%s' reuses the bytes of '%s', but node %d (%s, queue %s) may touch it "
                                          "before node %d (%s, queue %s) is done with the old value",
                                     g->values[b->id].name, g->values[a->id].name, fb, mt_ops[g->nodes[fb].op].name,
                                     mt_queue_names[r2], la_, mt_ops[g->nodes[la_].op].name, mt_queue_names[r]);
                }
            }
        }
    MT_FREE(vc); MT_FREE(lw); MT_FREE(la); MT_FREE(fa); MT_FREE(lo); MT_FREE(sl); MT_FREE(ord);
    return rc;
}

/* --- the overlap pass: reorder so the streams have work to overlap -------- */

/* a and b conflict: one writes a value the other reads or writes */
static int mt__conflict(const mt_node *a, const mt_node *b) {
    for (int k = 0; k < a->n_out; k++) if (a->out[k] >= 0 && (mt__reads(b, a->out[k]) || mt__writes(b, a->out[k]))) return 1;
    for (int k = 0; k < b->n_out; k++) if (b->out[k] >= 0 && mt__reads(a, b->out[k])) return 1;
    return 0;
}
static int mt__is_ep_sync(const mt_graph *g, const mt_node *n) {
    return n->queue == MT_Q_EP && mt__is_collective(n->op) && mt_mesh_group_size(&g->mesh, (uint32_t)n->iattr[0]) > 1;
}
/* EP: in each (phase, layer) run, the nodes after its first expert exchange
 * that depend on no exchange (the shared experts; in the backward the router's
 * gradient) move up to just after the exchange nodes that lead the run (the
 * counts and the dispatch: with MoE chunks, the first chunk's), so they run
 * on the compute stream while the tokens travel on the EP stream. A stable
 * partition: "depends" is the transitive closure of conflicts, so every
 * conflict keeps its order and results do not change. (The host-synchronized
 * exchange blocks the host at the counts; these nodes then still overlap the
 * rows' all-to-all.) */
static void mt__ep_ahead(mt_graph *g, mt_node *tmp, uint8_t *taint) {
    int n = g->n_nodes;
    for (int i = 0; i < n;) {
        int e = i;
        while (e < n && g->nodes[e].phase == g->nodes[i].phase && g->nodes[e].layer == g->nodes[i].layer) e++;
        int f = i;
        while (f < e && !mt__is_ep_sync(g, &g->nodes[f])) f++;
        if (f < e) {
            for (int j = f; j < e; j++) {
                taint[j] = j == f || g->nodes[j].queue == MT_Q_EP;
                for (int k = f; k < j && !taint[j]; k++) taint[j] = taint[k] && mt__conflict(&g->nodes[k], &g->nodes[j]);
            }
            int w = 0, lead = f;
            while (lead < e && g->nodes[lead].queue == MT_Q_EP && taint[lead])   /* the exchange nodes that lead, to the first dispatch */
                if (g->nodes[lead++].op == MT_OP_EP_DISPATCH) break;
            for (int j = f; j < lead; j++) tmp[w++] = g->nodes[j];
            for (int j = lead; j < e; j++) if (!taint[j]) tmp[w++] = g->nodes[j];
            for (int j = lead; j < e; j++) if (taint[j]) tmp[w++] = g->nodes[j];
            memcpy(&g->nodes[f], tmp, sizeof(mt_node) * (size_t)(e - f));
        }
        i = e;
    }
}
/* EP, backward: the experts' weight gradients (GMM_DW, and the ADDs that sum
 * their MoE chunks' parts) that come before an exchange of their run and that
 * nothing up to it but each other depends on move to just after it, in their
 * order, so the gradient's exchange leaves as soon as its input is ready and
 * travels while they compute. Only moves past nodes they do not conflict with. */
static void mt__dw_behind(mt_graph *g, mt_node *tmp) {
    int n = g->n_nodes;
    for (int p = 0; p < n; p++) {
        const mt_node *x = &g->nodes[p];
        if (x->phase != MT_PHASE_BACKWARD || !mt__is_ep_sync(g, x)) continue;
        int lo = p;   /* back to the run's start or its previous exchange */
        while (lo > 0 && g->nodes[lo - 1].phase == x->phase && g->nodes[lo - 1].layer == x->layer && !mt__is_ep_sync(g, &g->nodes[lo - 1])) lo--;
        int w = 0, m = 0;
        uint8_t dw[64] = {0}, late[64] = {0};
        for (int i = lo; i < p && i - lo < 64; i++) {   /* weight gradients, and sums of two of them */
            const mt_node *d = &g->nodes[i];
            int sums = 0;
            for (int a = lo; a < i && d->op == MT_OP_ADD; a++) sums += dw[a - lo] && mt__reads(d, g->nodes[a].out[0]);
            dw[i - lo] = d->op == MT_OP_GMM_DW || d->op == MT_OP_GMM_DW_SQ || sums == 2;
        }
        for (int i = p - 1; i >= lo; i--) {   /* last first: a node may pass the moved nodes that read it */
            if (i - lo >= 64 || !dw[i - lo]) continue;
            int ok = 1;
            for (int k = i + 1; k <= p && ok; k++) ok = (k - lo < 64 && late[k - lo]) || !mt__conflict(&g->nodes[i], &g->nodes[k]);
            late[i - lo] = (uint8_t)ok;
            m += ok;
        }
        if (!m) continue;
        for (int i = lo; i <= p; i++) if (i == p || i - lo >= 64 || !late[i - lo]) tmp[w++] = g->nodes[i];
        for (int i = lo; i < p; i++) if (i - lo < 64 && late[i - lo]) tmp[w++] = g->nodes[i];
        memcpy(&g->nodes[lo], tmp, sizeof(mt_node) * (size_t)w);
        p = lo + w - 1;   /* past the moved nodes */
    }
}
static int mt__is_fsdp_gather(const mt_graph *g, const mt_node *n) {
    return n->op == MT_OP_ALLGATHER && (n->phase == MT_PHASE_FORWARD || n->phase == MT_PHASE_BACKWARD) &&
           mt_mesh_group_size(&g->mesh, (uint32_t)n->iattr[0]) > 1;
}
/* FSDP prefetch: every weight all-gather of a stage (a run of other nodes with
 * one phase and layer: a block's forward, or its backward) moves to the start
 * of the stage before it in the same phase. Block L+1's weights travel while
 * block L computes; in the backward, block L-1's re-gathers while block L's
 * backward computes. A gather moves only past nodes it does not conflict with
 * (it reads a parameter shard, which nothing writes before the optimizer). */
static void mt__prefetch(mt_graph *g, mt_node *tmp, int32_t *stage, int32_t *dest, int32_t *first) {
    int n = g->n_nodes, st = -1, ph = -1, ly = -2;
    for (int i = 0; i < n; i++) {   /* stages of the other nodes; first[s]: where stage s starts */
        const mt_node *x = &g->nodes[i];
        if (mt__is_fsdp_gather(g, x)) { stage[i] = -1; continue; }
        if (x->phase != ph || x->layer != ly) { st++; ph = x->phase; ly = x->layer; first[st] = i; }
        stage[i] = st;
    }
    for (int i = n - 1, next = st + 1; i >= 0; i--) {   /* a gather belongs to the stage of the next other node */
        if (stage[i] >= 0) { next = stage[i]; dest[i] = -1; continue; }
        dest[i] = -1;
        int s = next, t = s - 1;
        if (s > st || t < 0 || g->nodes[first[t]].phase != g->nodes[i].phase) continue;
        int ok = 1;
        for (int k = first[t]; k < i && ok; k++) ok = !mt__conflict(&g->nodes[k], &g->nodes[i]);
        if (ok) dest[i] = t;
    }
    int w = 0;
    for (int i = 0; i < n; i++) {
        if (stage[i] >= 0 && first[stage[i]] == i)   /* a stage starts: the gathers of the next one go first */
            for (int j = i; j < n; j++) if (stage[j] < 0 && dest[j] == stage[i]) tmp[w++] = g->nodes[j];
        if (stage[i] < 0 && dest[i] >= 0) continue;
        tmp[w++] = g->nodes[i];
    }
    memcpy(g->nodes, tmp, sizeof(mt_node) * (size_t)n);
}
int mt_pass_overlap(mt_graph *g, mt_err *err) {
    int n = g->n_nodes;
    mt_node *tmp = (mt_node *)MT_MALLOC(sizeof(mt_node) * (size_t)(n + 1));
    int32_t *a = (int32_t *)MT_MALLOC(sizeof(int32_t) * 3 * (size_t)(n + 1));
    uint8_t *taint = (uint8_t *)mt__calloc((size_t)n + 1);
    if (!tmp || !a || !taint) { MT_FREE(tmp); MT_FREE(a); MT_FREE(taint); return mt_errf(err, "out of memory"); }
    mt__ep_ahead(g, tmp, taint);
    mt__dw_behind(g, tmp);
    mt__prefetch(g, tmp, a, a + n + 1, a + 2 * (n + 1));
    MT_FREE(tmp); MT_FREE(a); MT_FREE(taint);
    g->overlap = 1;
    return 0;
}

/* Drop values no node or well-known slot refers to (what fusion orphaned),
 * renumbering the rest in order. */
static int mt__compact_values(mt_graph *g, mt_err *err) {
    int32_t *map = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(g->n_values + 1));
    uint8_t *used = (uint8_t *)mt__calloc((size_t)g->n_values + 1);
    if (!map || !used) { MT_FREE(map); MT_FREE(used); return mt_errf(err, "out of memory"); }
    for (int i = 0; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        for (int k = 0; k < n->n_in; k++) if (n->in[k] >= 0) used[n->in[k]] = 1;
        for (int k = 0; k < n->n_out; k++) if (n->out[k] >= 0) used[n->out[k]] = 1;
    }
    for (int i = 0; i < MT_NIO; i++) if (g->io[i] >= 0) used[g->io[i]] = 1;
    for (int v = 0; v < g->n_values; v++)   /* params and their moments stay, used or not */
        if (!MT_ROLE_IN_ARENA(g->values[v].role)) used[v] = 1;
    int n = 0;
    for (int v = 0; v < g->n_values; v++) map[v] = used[v] ? n++ : -1;
    for (int v = 0; v < g->n_values; v++)
        if (map[v] >= 0) {
            g->values[map[v]] = g->values[v];
            if (g->values[map[v]].param >= 0) g->values[map[v]].param = map[g->values[map[v]].param];
        }
    g->n_values = n;
    for (int i = 0; i < g->n_nodes; i++) {
        mt_node *x = &g->nodes[i];
        for (int k = 0; k < x->n_in; k++) if (x->in[k] >= 0) x->in[k] = map[x->in[k]];
        for (int k = 0; k < x->n_out; k++) if (x->out[k] >= 0) x->out[k] = map[x->out[k]];
    }
    for (int i = 0; i < MT_NIO; i++) if (g->io[i] >= 0) g->io[i] = map[g->io[i]];
    MT_FREE(map); MT_FREE(used);
    return 0;
}

/* Elision: a collective over a group of one rank is an identity. On ep = 1
 * the expert exchange (EP_COUNTS, EP_DISPATCH, EP_COMBINE, forward and
 * backward) copies every routed row onto itself: here those nodes go, their
 * consumers read the source rows directly, and the data-dependent "tokens my
 * experts receive" is pinned to its only possible value, N*K. Results are
 * bitwise unchanged; the step moves 4 x N*K*D fewer elements per MoE layer.
 * Graphs for ep > 1 are left as they are. (Gradient all-reduces over one
 * rank stay: they are in place and cost nothing.) */
int mt_pass_elide_collectives(mt_graph *g, mt_err *err) {
    if (g->mesh.size[MT_DIM_EP] != 1) return 0;
    for (int s = 0; s < g->n_syms; s++) {          /* pin the received-token count: it is N*K */
        if (g->syms[s].kind != MT_SYM_SIZE || g->syms[s].mesh_dim != MT_DIM_EP) continue;
        for (int v = 0; v < g->n_values; v++)
            for (int d = 0; d < g->values[v].ndim; d++)
                if (g->values[v].dims[d] == -(int64_t)s - 1) g->values[v].dims[d] = g->syms[s].max;
    }
    int32_t *map = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(g->n_values + 1));
    if (!map) return mt_errf(err, "out of memory");
    for (int v = 0; v < g->n_values; v++) map[v] = v;
    int w = 0, rc = 0;
    for (int i = 0; i < g->n_nodes && !rc; i++) {
        mt_node *n = &g->nodes[i];
        int exch = n->op == MT_OP_EP_DISPATCH || n->op == MT_OP_EP_COMBINE;
        if (exch && n->iattr[2] == 1) {
            /* out[0] <- in[0] (rows), and for a dispatch out[1] (received offsets) <- in[1] (offsets) */
            for (int k = 0; k < (n->op == MT_OP_EP_DISPATCH ? 2 : 1) && !rc; k++) {
                int src = map[n->in[k]], dst = n->out[k];
                const mt_value *a = &g->values[src], *b = &g->values[dst];
                if (a->dtype != b->dtype || a->ndim != b->ndim || memcmp(a->dims, b->dims, sizeof a->dims))
                    rc = mt_errf(err, "elide: %s '%s' -> '%s' is not a same-shape copy", mt_ops[n->op].name, a->name, b->name);
                map[dst] = src;
            }
            continue;
        }
        g->nodes[w++] = *n;
    }
    g->n_nodes = w;
    for (int i = 0; i < g->n_nodes; i++)
        for (int k = 0; k < g->nodes[i].n_in; k++)
            if (g->nodes[i].in[k] >= 0) g->nodes[i].in[k] = map[g->nodes[i].in[k]];
    for (int i = 0; i < MT_NIO; i++) if (g->io[i] >= 0) g->io[i] = map[g->io[i]];
    /* the counts exchange now feeds nothing */
    w = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        int used = 0;
        if (n->op == MT_OP_EP_COUNTS && n->iattr[2] == 1) {
            for (int j = i + 1; j < g->n_nodes && !used; j++)
                for (int k = 0; k < g->nodes[j].n_in; k++) used |= g->nodes[j].in[k] == n->out[0];
            if (!used) continue;
        }
        g->nodes[w++] = *n;
    }
    g->n_nodes = w;
    int fwd = 0;
    for (int i = 0; i < g->n_nodes; i++) fwd += g->nodes[i].phase == MT_PHASE_FORWARD;
    g->n_forward_nodes = fwd;
    MT_FREE(map);
    if (rc) return -1;
    return mt__compact_values(g, err);
}

/* How many nodes after node i read value v. */
static int mt__uses_after(const mt_graph *g, int i, int v) {
    int uses = 0;
    for (int k = i + 1; k < g->n_nodes; k++)
        for (int j = 0; j < g->nodes[k].n_in; j++) uses += g->nodes[k].in[j] == v;
    return uses;
}

/* The experts' gate/up GEMMs and their SwiGLU as one op: see the declaration (section 6). */
int mt_pass_fuse_glu(mt_graph *g, mt_err *err) {
    (void)err;
    int fused = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        mt_node *s = &g->nodes[i];
        if (s->op != MT_OP_SWIGLU) continue;
        int jg = -1, ju = -1;   /* the nodes that produce g and u */
        for (int j = i - 1; j >= 0 && (jg < 0 || ju < 0); j--) {
            const mt_node *x = &g->nodes[j];
            for (int k = 0; k < x->n_out; k++) {
                if (x->out[k] == s->in[0] && jg < 0) jg = j;
                if (x->out[k] == s->in[1] && ju < 0) ju = j;
            }
        }
        if (jg < 0 || ju < 0 || jg == ju) continue;
        mt_node *a = &g->nodes[jg], *b = &g->nodes[ju];
        if (a->op != MT_OP_GMM || b->op != MT_OP_GMM || a->in[0] != b->in[0] || a->in[2] != b->in[2] ||
            a->phase != b->phase || a->phase != s->phase || a->queue != b->queue || a->queue != s->queue ||
            mt_node_fp8(a) != mt_node_fp8(b))
            continue;
        const mt_value *wg = &g->values[a->in[1]], *wu = &g->values[b->in[1]];
        if (wg->dtype != wu->dtype || memcmp(wg->dims, wu->dims, sizeof wg->dims) ||
            g->values[a->out[0]].dtype != g->values[b->out[0]].dtype || g->values[s->out[0]].dtype != g->values[a->out[0]].dtype)
            continue;
        /* the fused node stands where the later GEMM stood: nothing between the two may read the earlier one's result */
        int lo = jg < ju ? jg : ju, hi = jg < ju ? ju : jg, early = g->nodes[lo].out[0], clash = 0;
        for (int k = lo + 1; k < hi && !clash; k++)
            for (int j = 0; j < g->nodes[k].n_in; j++) clash |= g->nodes[k].in[j] == early;
        if (clash) continue;
        mt_node f = g->nodes[hi];
        f.op = MT_OP_GMM_GLU; f.n_in = 4; f.n_out = 3;
        f.in[0] = a->in[0]; f.in[1] = a->in[1]; f.in[2] = a->in[2]; f.in[3] = b->in[1];
        f.out[0] = a->out[0]; f.out[1] = b->out[0]; f.out[2] = s->out[0];
        g->nodes[hi] = f;
        g->nodes[lo].op = -1;
        s->op = -1;
        fused++;
    }
    int w = 0, fwd = 0;
    for (int i = 0; i < g->n_nodes; i++) if (g->nodes[i].op >= 0) g->nodes[w++] = g->nodes[i];
    g->n_nodes = w;
    for (int i = 0; i < g->n_nodes; i++) fwd += g->nodes[i].phase == MT_PHASE_FORWARD;
    g->n_forward_nodes = fwd;
    return fused;
}

/* Fusion, over pairs the builder emits next to each other:
 *  - the residual add and the RMSNorm that reads it: one pass over the rows
 *    (ADD_RMSNORM); RMSNorm's backward adds its input gradient into the
 *    residual gradient directly (RMSNORM_BWD_ADD). Bitwise those of the pair.
 *  - two expert GEMMs dX = dY W over the same offsets whose results only
 *    meet in an ADD (the routed experts' gate and up inputs): one grouped
 *    GEMM that runs both reductions into the same accumulators (GMM_DX2;
 *    one rounding instead of three on the GPU, bitwise the trio on the CPU).
 *  - a GEMM whose result only feeds an ADD: the sum moves into the GEMM's
 *    epilogue (MATMUL_ACC: cuBLASLt with beta = 1, one rounding instead of
 *    two). These are the gradient sums where one activation feeds several
 *    GEMMs (q and kv, gate and up, shared experts and router) and the
 *    shared + routed expert sum. An ADD that an RMSNorm reads stays for
 *    ADD_RMSNORM, which saves more.
 *  - CUDA: an expert weight gradient's share of the global norm is summed in
 *    the grouped GEMM's epilogue while the tile is in registers (GMM_DW_SQ),
 *    and its SUMSQ adds those partials instead of re-reading the gradient.
 *    Only where every all-reduce of that gradient is over one rank (the
 *    norm is of the reduced gradient). Not on the CPU, whose SUMSQ sums in
 *    double and stays the reference. */
/* The node fusion pairs with node i: the next one, past collectives on streams of their own that
 * neither read node i's outputs nor write what it reads (under FSDP the gathers of the next block's
 * weights sit between a block's residual add and the next block's norm). */
static int mt__fuse_next(const mt_graph *g, int i) {
    const mt_node *a = &g->nodes[i];
    int j = i + 1;
    for (; j < g->n_nodes; j++) {
        const mt_node *x = &g->nodes[j];
        int dep = !mt__is_collective(x->op) || x->queue == MT_Q_COMPUTE;
        for (int k = 0; k < x->n_in && !dep; k++)
            for (int o = 0; o < a->n_out; o++) dep |= x->in[k] >= 0 && x->in[k] == a->out[o];
        for (int k = 0; k < x->n_out && !dep; k++)
            for (int m = 0; m < a->n_in; m++) dep |= x->out[k] >= 0 && x->out[k] == a->in[m];
        if (dep) break;
    }
    return j;
}
int mt_pass_fuse(mt_graph *g, mt_err *err) {
    int w = 0;
    for (int i = 0; g->target.backend == MT_BACKEND_CUDA && i < g->n_nodes; i++) {
        if (g->nodes[i].op != MT_OP_GMM_DW) continue;
        int gv = g->nodes[i].out[0], ok = g->values[gv].role == MT_ROLE_GRAD && g->values[gv].dtype == MT_F32, sq = -1;
        for (int k = i + 1; k < g->n_nodes && ok; k++) {
            const mt_node *x = &g->nodes[k];
            int reads = 0;
            for (int j = 0; j < x->n_in; j++) reads |= x->in[j] == gv;
            if (!reads) continue;
            if (x->op == MT_OP_SUMSQ && x->in[0] == gv && x->iattr[0] == 0 && sq < 0) {
                sq = k;
            } else if (x->op == MT_OP_ALLREDUCE) {   /* an identity: over one rank, unscaled */
                for (int d = 0; d < MT_NDIMS; d++) if (x->iattr[0] >> d & 1) ok &= g->mesh.size[d] == 1;
                ok &= x->fattr[0] == 0.0f || x->fattr[0] == 1.0f;
            } else if (x->op != MT_OP_ADAMW) {
                ok = 0;
            }
        }
        char nm[MT_NAME_LEN];
        snprintf(nm, sizeof nm, "ssq.%s", g->values[gv].name);
        if (!ok || sq < 0 || mt_graph_find(g, nm) >= 0) continue;
        if (mt__grow((void **)&g->values, &g->cap_values, g->n_values + 1, sizeof(mt_value))) return mt_errf(err, "out of memory");
        const mt_value *W = &g->values[gv];
        mt_value *v = &g->values[g->n_values];
        memset(v, 0, sizeof *v);
        memcpy(v->name, nm, sizeof nm);
        v->dtype = MT_F32; v->role = MT_ROLE_SCRATCH; v->ndim = 1;
        v->dims[0] = (mt_node_fp8(&g->nodes[i]) ? mt_gmm_ssq_len_fp8 : mt_gmm_ssq_len)(W->dims[0], W->dims[1], W->dims[2]);
        v->param = -1; v->offset = -1; v->data_offset = -1;
        v->nbytes = v->dims[0] * 4;
        mt_node *d = &g->nodes[i];
        d->op = MT_OP_GMM_DW_SQ; d->n_out = 2; d->out[1] = g->n_values++;
        g->nodes[sq].in[0] = d->out[1]; g->nodes[sq].iattr[0] = 1;
    }
    /* GMM_DX (x) ... GMM_DX (y), ADD(x, y): the first moves to the second */
    for (int i = 1; i + 1 < g->n_nodes; i++) {
        mt_node *y = &g->nodes[i], *s = &g->nodes[i + 1];
        if (y->op != MT_OP_GMM_DX || s->op != MT_OP_ADD || (s->in[0] == y->out[0]) == (s->in[1] == y->out[0])) continue;
        int xv = s->in[0] == y->out[0] ? s->in[1] : s->in[0], j = i - 1;
        while (j >= 0 && !(g->nodes[j].n_out > 0 && g->nodes[j].out[0] == xv)) j--;
        if (j < 0) continue;
        mt_node *x = &g->nodes[j];
        if (x->op != MT_OP_GMM_DX) continue;
        const mt_value *wx = &g->values[x->in[1]], *wy = &g->values[y->in[1]];
        if (x->in[2] != y->in[2] || x->phase != y->phase || wx->dtype != wy->dtype || mt_node_fp8(x) != mt_node_fp8(y) ||
            memcmp(wx->dims, wy->dims, sizeof wx->dims) || g->values[x->in[0]].dtype != g->values[y->in[0]].dtype ||
            mt__uses_after(g, i, y->out[0]) != 1 || mt__uses_after(g, j, xv) != 1)
            continue;
        mt_node f = *y;
        f.op = MT_OP_GMM_DX2; f.n_in = 5;
        f.in[0] = x->in[0]; f.in[1] = x->in[1];   /* x's pair first: x + y, as the ADD had it */
        f.in[3] = y->in[0]; f.in[4] = y->in[1];
        if (s->in[0] != xv) { f.in[0] = y->in[0]; f.in[1] = y->in[1]; f.in[3] = x->in[0]; f.in[4] = x->in[1]; }
        f.out[0] = s->out[0];
        *y = f;
        s->op = -1;           /* dropped below */
        x->op = -1;
    }
    for (int i = 0; i < g->n_nodes; i++) if (g->nodes[i].op >= 0) g->nodes[w++] = g->nodes[i];
    g->n_nodes = w;
    w = 0;
    /* pairs: a node and the next one (mt__fuse_next); the fused node takes the second's place, after the
     * collectives skipped between them */
#define MT__FUSED(f) do { for (int k_ = i + 1; k_ < j; k_++) g->nodes[w++] = g->nodes[k_]; g->nodes[w++] = (f); i = j; } while (0)
    for (int i = 0; i < g->n_nodes; i++) {
        int j = mt__fuse_next(g, i), j3 = j < g->n_nodes ? mt__fuse_next(g, j) : j;
        mt_node *a = &g->nodes[i], *b = j < g->n_nodes ? &g->nodes[j] : NULL;
        const mt_node *c3 = j3 < g->n_nodes ? &g->nodes[j3] : NULL;
        if (b && a->op == MT_OP_MATMUL && b->op == MT_OP_ADD && a->phase == b->phase &&
            (b->in[0] == a->out[0]) != (b->in[1] == a->out[0]) &&
            !(c3 && c3->op == MT_OP_RMSNORM && c3->in[0] == b->out[0]) && mt__uses_after(g, i, a->out[0]) == 1) {
            int acc = b->in[0] == a->out[0] ? b->in[1] : b->in[0];
            if (g->values[acc].dtype == g->values[a->out[0]].dtype) {
                mt_node f = *a;
                f.op = MT_OP_MATMUL_ACC;
                f.n_in = mt_ops[f.op].n_in;
                f.in[f.n_in - 1] = acc;
                f.out[0] = b->out[0];
                MT__FUSED(f);
                continue;
            }
        }
        if (b && a->op == MT_OP_ADD && b->op == MT_OP_RMSNORM && b->in[0] == a->out[0] && a->phase == b->phase) {
            mt_node f = *a;
            f.op = MT_OP_ADD_RMSNORM; f.n_in = 3; f.n_out = 3;
            f.in[2] = b->in[1];
            f.out[1] = b->out[0]; f.out[2] = b->out[1];
            f.fattr[0] = b->fattr[0];
            f.layer = b->layer;
            MT__FUSED(f);
            continue;
        }
        /* RMSNORM_BWD -> dx, then ADD(acc, dx) or ADD(dx, acc): dx is used nowhere else */
        if (b && a->op == MT_OP_RMSNORM_BWD && b->op == MT_OP_ADD && a->phase == b->phase &&
            (b->in[0] == a->out[0] || b->in[1] == a->out[0]) && b->in[0] != b->in[1]) {
            int dx = a->out[0];
            if (mt__uses_after(g, i, dx) == 1) {
                mt_node f = *a;
                f.op = MT_OP_RMSNORM_BWD_ADD; f.n_in = 5; f.n_out = 2;
                f.in[4] = b->in[0] == dx ? b->in[1] : b->in[0];
                f.out[0] = b->out[0];
                MT__FUSED(f);
                continue;
            }
        }
        g->nodes[w++] = *a;
    }
#undef MT__FUSED
    int fwd = 0;
    g->n_nodes = w;
    for (int i = 0; i < g->n_nodes; i++) fwd += g->nodes[i].phase == MT_PHASE_FORWARD;
    g->n_forward_nodes = fwd;
    return mt__compact_values(g, err);
}

/* RoPE folded into attention. MLA_ROPE forms Q, K, V [N, H*dq], [N, H*dq], [N, H*dv] from q, kv and
 * k_pe only for the attention to read them (and MLA_ROPE_BWD takes dQ, dK, dV apart again): on `debug`
 * that is four passes over 1.5 GB a step. Folded, ROPE_PE forms only the rotated parts (qr [N, H*dr],
 * kr [N, dr]); MLA_ATTENTION's kernels load Q's tiles from q and qr, K's from kv and the shared kr,
 * V's from kv; MLA_ATTENTION_BWD writes q's and kv's gradients directly (dQ's rope columns rotated back
 * in its epilogue) and each head's gradient of kr, which ROPE_PE_BWD rotates back and sums over the
 * heads. The arithmetic is the unfolded ops', so results are bitwise the same.
 * Applies to an MLA_ROPE whose three outputs are read only by attention nodes (as their Q, K, V),
 * and whose backward nodes' gradients are read only by one MLA_ROPE_BWD of the same attributes
 * (with recompute, the forward's and the recomputed MLA_ROPE each fold on their own). */
/* a new [rows, cols] value named like's name + "_rope", of like's dtype and role; -1 on error */
static int mt__fold_value(mt_graph *g, int like, int64_t rows, int64_t cols, mt_err *err) {
    if (mt__grow((void **)&g->values, &g->cap_values, g->n_values + 1, sizeof(mt_value))) return mt_errf(err, "out of memory");
    const mt_value *l = &g->values[like];
    char nm[MT_NAME_LEN + 8];
    snprintf(nm, sizeof nm, "%s_rope", l->name);
    mt_value *v = &g->values[g->n_values];
    memset(v, 0, sizeof *v);
    memcpy(v->name, nm, MT_NAME_LEN - 1);
    v->dtype = l->dtype; v->role = l->role; v->ndim = 2; v->dims[0] = rows; v->dims[1] = cols;
    v->param = -1; v->offset = -1; v->data_offset = -1;
    v->nbytes = rows * cols * mt_dtype_bytes(g, l->dtype);
    return g->n_values++;
}
static int mt__fold_name_free(const mt_graph *g, int like) {   /* like's name + "_rope" fits and is unused */
    char nm[MT_NAME_LEN + 8];
    snprintf(nm, sizeof nm, "%s_rope", g->values[like].name);
    return strlen(nm) < MT_NAME_LEN && mt_graph_find(g, nm) < 0;
}
int mt_pass_fold_rope(mt_graph *g, mt_err *err) {
    int folded = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        if (g->nodes[i].op != MT_OP_MLA_ROPE) continue;
        const mt_node R = g->nodes[i];
        int Q = R.out[0], K = R.out[1], V = R.out[2], ok = 1, rb = -1, n_att = 0;
        int H = R.iattr[0], dn = R.iattr[1], dr = R.iattr[2], dv = R.iattr[3], T = R.iattr[4];
        if (g->target.backend == MT_BACKEND_CUDA && !mt_rope_fold_fits(dn, dr, dv)) continue;
        for (int k = 0; k < MT_NIO; k++) ok &= g->io[k] != Q && g->io[k] != K && g->io[k] != V;
        /* every reader of Q, K, V: an attention node reading them as (Q, K, V), of the same dims */
        for (int j = 0; j < g->n_nodes && ok; j++) {
            const mt_node *x = &g->nodes[j];
            int reads = 0;
            for (int k = 0; k < x->n_in; k++) reads |= x->in[k] == Q || x->in[k] == K || x->in[k] == V;
            if (!reads) continue;
            ok = j > i && (x->op == MT_OP_ATTENTION || x->op == MT_OP_ATTENTION_BWD) && x->in[0] == Q && x->in[1] == K && x->in[2] == V &&
                 x->iattr[0] == H && x->iattr[1] == dn + dr && x->iattr[2] == dv && x->iattr[3] == T;
            for (int k = 3; k < x->n_in && ok; k++) ok = x->in[k] != Q && x->in[k] != K && x->in[k] != V;
            n_att++;
            if (!ok || x->op != MT_OP_ATTENTION_BWD) continue;
            /* its dQ, dK, dV: read only by one MLA_ROPE_BWD, as its (dQ, dK, dV) with R's tables and attributes */
            for (int o = 0; o < 3 && ok; o++)
                for (int k = 0; k < MT_NIO; k++) ok &= g->io[k] != x->out[o];
            for (int m = j + 1; m < g->n_nodes && ok; m++) {
                const mt_node *y = &g->nodes[m];
                int r2 = 0;
                for (int k = 0; k < y->n_in; k++) r2 |= y->in[k] == x->out[0] || y->in[k] == x->out[1] || y->in[k] == x->out[2];
                if (!r2) continue;
                ok = rb < 0 && y->op == MT_OP_MLA_ROPE_BWD && y->in[0] == x->out[0] && y->in[1] == x->out[1] && y->in[2] == x->out[2] &&
                     y->in[3] == R.in[3] && y->in[4] == R.in[4] && !memcmp(y->iattr, R.iattr, sizeof R.iattr) && y->out[0] >= 0 &&
                     y->out[1] >= 0 && y->out[2] >= 0;
                rb = m;
            }
            ok &= rb >= 0;
        }
        if (!ok || !n_att) continue;
        const int dK = rb >= 0 ? g->nodes[rb].in[1] : -1;
        if (!mt__fold_name_free(g, Q) || !mt__fold_name_free(g, K) || (dK >= 0 && !mt__fold_name_free(g, dK))) continue;
        /* the rotated parts, and kr's per-head gradient */
        const int64_t N = g->values[R.in[0]].dims[0];
        const int qr = mt__fold_value(g, Q, N, (int64_t)H * dr, err), kr = qr < 0 ? -1 : mt__fold_value(g, K, N, dr, err);
        const int dkr = kr < 0 || dK < 0 ? -1 : mt__fold_value(g, dK, N, (int64_t)H * dr, err);
        if (qr < 0 || kr < 0 || (dK >= 0 && dkr < 0)) return -1;
        mt_node *r = &g->nodes[i];
        r->op = MT_OP_ROPE_PE; r->n_in = 4; r->n_out = 2;
        r->in[1] = R.in[2]; r->in[2] = R.in[3]; r->in[3] = R.in[4]; r->in[4] = -1;
        r->out[0] = qr; r->out[1] = kr; r->out[2] = -1;
        for (int j = i + 1; j < g->n_nodes; j++) {
            mt_node *x = &g->nodes[j];
            if (!((x->op == MT_OP_ATTENTION || x->op == MT_OP_ATTENTION_BWD) && x->in[0] == Q)) continue;
            const mt_node a = *x;
            x->in[0] = R.in[0]; x->in[1] = R.in[1]; x->in[2] = qr; x->in[3] = kr;
            x->iattr[4] = dn;
            if (a.op == MT_OP_ATTENTION) {
                x->op = MT_OP_MLA_ATTENTION; x->n_in = 5;
                x->in[4] = a.in[3];
            } else {
                mt_node *y = &g->nodes[rb];
                x->op = MT_OP_MLA_ATTENTION_BWD; x->n_in = 10;
                x->in[4] = a.in[3]; x->in[5] = a.in[4]; x->in[6] = a.in[5]; x->in[7] = a.in[6]; x->in[8] = R.in[3]; x->in[9] = R.in[4];
                x->out[0] = y->out[0]; x->out[1] = y->out[1]; x->out[2] = dkr;
                const int dkpe = y->out[2];
                y->op = MT_OP_ROPE_PE_BWD; y->n_in = 3; y->n_out = 1;
                y->in[0] = dkr; y->in[1] = R.in[3]; y->in[2] = R.in[4]; y->in[3] = y->in[4] = -1;
                y->out[0] = dkpe; y->out[1] = y->out[2] = -1;
            }
        }
        folded++;
    }
    if (!folded) return 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (mt_check_node(g, &g->nodes[i], err)) return -1;
    return mt__compact_values(g, err) ? -1 : folded;
}

int mt_op_is_ep_exchange(int op) { return op == MT_OP_EP_COUNTS || op == MT_OP_EP_DISPATCH || op == MT_OP_EP_COMBINE; }

int mt_pass_isolate_ep(mt_graph *g, mt_err *err) {
    (void)err;
    uint32_t ep = 0;
    int found = 0, clash = 0, moved = 0;
    for (int i = 0; i < g->n_nodes; i++) {   /* the exchange's mask (recognized by op, over more than one rank) */
        const mt_node *n = &g->nodes[i];
        if (mt_op_is_ep_exchange(n->op) && mt_mesh_group_size(&g->mesh, (uint32_t)n->iattr[0]) > 1) { ep = (uint32_t)n->iattr[0]; found = 1; }
    }
    if (!found) return 0;
    for (int i = 0; i < g->n_nodes && !clash; i++) {   /* another collective over the same ranks, same channel? */
        const mt_node *n = &g->nodes[i];
        clash = mt__is_collective(n->op) && !mt_op_is_ep_exchange(n->op) && n->iattr[1] == MT_CHANNEL_SHARED &&
                mt_mesh_group_size(&g->mesh, (uint32_t)n->iattr[0]) > 1 && mt_mesh_groups_equal(&g->mesh, (uint32_t)n->iattr[0], ep);
    }
    if (!clash) return 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (mt_op_is_ep_exchange(g->nodes[i].op) && g->nodes[i].iattr[1] == MT_CHANNEL_SHARED) { g->nodes[i].iattr[1] = MT_CHANNEL_EP; moved++; }
    return moved;
}

/* Activation recompute. A block's forward activations are held from its
 * forward until its backward reads them: at the turn from forward to
 * backward they are most of the arena. A recomputed block keeps only its
 * input (the residual stream entering it, which its backward reads anyway):
 * the forward nodes that produce what its backward reads are cloned, with
 * new values, as MT_PHASE_RECOMPUTE nodes just before the block's first
 * backward node, and the backward reads the clones; the originals then die
 * inside the forward.
 *  - "In the block": written by a forward node of the block and read by no
 *    forward node outside it (the block's output is the next block's input:
 *    kept). Only what the backward reads, and what that needs, re-runs.
 *  - The router re-runs for its indices, weights and scores. Its per-expert
 *    counts go to a new value that nothing reads, so the counts' all-reduce,
 *    the expert-bias update and mt_runtime_expert_counts see the forward's
 *    counts, once; re-run expert exchanges are not counted as received rows
 *    (the runtime counts forward-phase ones).
 *  - Re-run collectives (the expert exchange, FSDP all-gathers) run on every
 *    rank alike: all ranks run the same rewritten graph. A weight that the
 *    backward gathers again anyway (FSDP, mt__regather) is gathered once,
 *    before the recompute, and serves both; one it does not gather again
 *    (the last block's) is read from the forward's copy.
 * It runs before fusion, while blocks are still apart (fusion joins a
 * block's last add to the next block's first norm); the clones then fuse as
 * the forward did, and compute bitwise what the forward computed. */

typedef struct {
    int32_t *prod;    /* per value: the forward node that writes it first, or -1 */
    uint8_t *ext;     /* per value: read by a forward node outside the block, or a well-known value */
} mt__rc_info;

static int mt__rc_internal(const mt_graph *g, const mt__rc_info *ri, int layer, int v) {
    return v >= 0 && ri->prod[v] >= 0 && g->nodes[ri->prod[v]].layer == layer && !ri->ext[v] &&
           g->values[v].role == MT_ROLE_ACT;
}
static int mt__rc_scan(const mt_graph *g, int layer, mt__rc_info *ri, mt_err *err) {
    int nv = g->n_values;
    ri->prod = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));
    ri->ext = (uint8_t *)mt__calloc((size_t)nv + 1);
    if (!ri->prod || !ri->ext) { MT_FREE(ri->prod); MT_FREE(ri->ext); return mt_errf(err, "out of memory"); }
    for (int v = 0; v < nv; v++) ri->prod[v] = -1;
    for (int i = 0; i < g->n_forward_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        for (int k = 0; k < n->n_out; k++) if (n->out[k] >= 0 && ri->prod[n->out[k]] < 0) ri->prod[n->out[k]] = i;
        for (int k = 0; k < n->n_in; k++) if (n->in[k] >= 0 && n->layer != layer) ri->ext[n->in[k]] = 1;
    }
    for (int i = 0; i < MT_NIO; i++) if (g->io[i] >= 0) ri->ext[g->io[i]] = 1;
    return 0;
}
/* The block's activations its backward reads (want[v] = 1), their bytes,
 * and where the recompute goes: the first non-forward node of the block. */
static int64_t mt__rc_wanted(const mt_graph *g, const mt__rc_info *ri, int layer, uint8_t *want, int *ins) {
    int64_t bytes = 0;
    *ins = -1;
    for (int i = g->n_forward_nodes; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        if (n->layer == layer && *ins < 0) *ins = i;
        for (int k = 0; k < n->n_in; k++) {
            int u = n->in[k];
            if (!mt__rc_internal(g, ri, layer, u) || want[u]) continue;
            want[u] = 1;
            bytes += g->values[u].nbytes;
            if (*ins < 0) *ins = i;
        }
    }
    return bytes;
}

/* A new arena value like v, for its recomputed copy. */
static int mt__rc_value(mt_graph *g, int v, mt_err *err) {
    if (mt__grow((void **)&g->values, &g->cap_values, g->n_values + 1, sizeof(mt_value))) return mt_errf(err, "out of memory");
    mt_value *x = &g->values[g->n_values];
    char nm[MT_NAME_LEN];
    snprintf(nm, sizeof nm, "%.*s@rc", MT_NAME_LEN - 4, g->values[v].name);
    *x = g->values[v];
    memcpy(x->name, nm, sizeof nm);
    x->role = MT_ROLE_ACT;
    x->flags &= ~(uint32_t)MT_VF_COUNTS;   /* a re-run router's counts are nobody's: the forward's are the step's */
    x->param = -1; x->offset = -1; x->data_offset = -1; x->init = MT_INIT_NONE; x->init_std = 0;
    return g->n_values++;
}

static int mt__recompute_block(mt_graph *g, int layer, int64_t *saved, mt_err *err) {
    mt__rc_info ri;
    if (mt__rc_scan(g, layer, &ri, err)) return -1;
    int nv = g->n_values, nn = g->n_nodes, nf = g->n_forward_nodes, ins, rc = 0, n_new = 0, w = 0;
    uint8_t *want = (uint8_t *)mt__calloc((size_t)nv + 1), *need = (uint8_t *)mt__calloc((size_t)nn + 1);
    uint8_t *move = (uint8_t *)mt__calloc((size_t)nn + 1);
    int32_t *map = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));
    mt_node *clones = (mt_node *)MT_MALLOC(sizeof(mt_node) * (size_t)(nf + 1)), *nodes = NULL;
    if (!want || !need || !move || !map || !clones) { rc = mt_errf(err, "out of memory"); goto done; }
    for (int v = 0; v < nv; v++) map[v] = -1;
    *saved = mt__rc_wanted(g, &ri, layer, want, &ins);
    if (ins < 0 || *saved == 0) { rc = mt_errf(err, "recompute: block %d has no activations its backward reads", layer); goto done; }
    /* what to re-run: the producers of what the backward reads, and of their block inputs (one reverse sweep) */
    for (int v = 0; v < nv; v++) if (want[v]) need[ri.prod[v]] = 1;
    for (int i = nf - 1; i >= 0; i--) {
        if (!need[i]) continue;
        const mt_node *n = &g->nodes[i];
        for (int k = 0; k < n->n_in; k++) if (mt__rc_internal(g, &ri, layer, n->in[k])) need[ri.prod[n->in[k]]] = 1;
    }
    for (int i = 0; i < nf && !rc; i++) {
        if (!need[i]) continue;
        mt_node c = g->nodes[i];   /* copy: new values may move the table */
        if (c.op == MT_OP_ALLGATHER) {   /* the backward's own gather of this weight, if it has one */
            int j = nf;
            while (j < nn && !(g->nodes[j].op == MT_OP_ALLGATHER && g->nodes[j].in[0] == c.in[0] &&
                               g->nodes[j].iattr[0] == c.iattr[0] && g->nodes[j].iattr[1] == c.iattr[1])) j++;
            if (j < nn) {
                map[c.out[0]] = g->nodes[j].out[0];
                if (j >= ins) move[j] = 1;
            }   /* else the backward reads the forward's copy (mt__regather keeps it): so do the clones */
            continue;
        }
        c.phase = MT_PHASE_RECOMPUTE;
        for (int k = 0; k < c.n_in; k++) if (c.in[k] >= 0 && map[c.in[k]] >= 0) c.in[k] = map[c.in[k]];
        for (int k = 0; k < c.n_out && !rc; k++) {
            if (c.out[k] < 0) continue;
            int v = mt__rc_value(g, c.out[k], err);
            if (v < 0) rc = -1;
            else { map[c.out[k]] = v; c.out[k] = v; }
        }
        clones[n_new++] = c;
    }
    if (rc) goto done;
    /* the backward reads the recomputed activations */
    for (int i = ins; i < nn; i++) {
        mt_node *n = &g->nodes[i];
        for (int k = 0; k < n->n_in; k++)
            if (mt__rc_internal(g, &ri, layer, n->in[k]) && map[n->in[k]] >= 0) n->in[k] = map[n->in[k]];
    }
    /* nodes: [0, ins), the moved gathers, the clones, the rest */
    if (!(nodes = (mt_node *)MT_MALLOC(sizeof(mt_node) * (size_t)(nn + n_new + 1)))) { rc = mt_errf(err, "out of memory"); goto done; }
    for (int i = 0; i < ins; i++) nodes[w++] = g->nodes[i];
    for (int i = ins; i < nn; i++) if (move[i]) nodes[w++] = g->nodes[i];
    for (int i = 0; i < n_new; i++) nodes[w++] = clones[i];
    for (int i = ins; i < nn; i++) if (!move[i]) nodes[w++] = g->nodes[i];
    MT_FREE(g->nodes);
    g->nodes = nodes; g->n_nodes = g->cap_nodes = w;
done:
    MT_FREE(ri.prod); MT_FREE(ri.ext);
    MT_FREE(want); MT_FREE(need); MT_FREE(move); MT_FREE(map); MT_FREE(clones);
    return rc;
}

int mt_pass_recompute(mt_graph *g, const int32_t *layers, int n, mt_err *err) {
    if (n <= 0) return 0;
    if (g->kind != MT_GRAPH_TRAIN) return mt_errf(err, "recompute: a forward-only graph keeps no activations for a backward");
    for (int i = 0; i < g->n_forward_nodes; i++)
        if (g->nodes[i].op == MT_OP_ADD_RMSNORM || g->nodes[i].op == MT_OP_MATMUL_ACC)
            return mt_errf(err, "recompute: the graph is already fused (recompute runs before fusion)");
    uint8_t *pick = (uint8_t *)mt__calloc((size_t)g->cfg.n_layers + 1);
    if (!pick) return mt_errf(err, "out of memory");
    for (int i = 0; i < g->n_recompute; i++) pick[g->recompute[i].layer] = 2;
    int rc = 0;
    for (int i = 0; i < n && !rc; i++) {
        if (layers[i] < 0 || layers[i] >= g->cfg.n_layers) rc = mt_errf(err, "recompute: no block %d (the model has %d)", layers[i], g->cfg.n_layers);
        else if (pick[layers[i]]) rc = mt_errf(err, "recompute: block %d is %s", layers[i], pick[layers[i]] == 2 ? "recomputed already" : "named twice");
        else pick[layers[i]] = 1;
    }
    /* in layer order, whatever the order asked: the same choice gives the same graph */
    mt_recompute *rec = rc ? NULL : (mt_recompute *)MT_REALLOC(g->recompute, sizeof(mt_recompute) * (size_t)(g->n_recompute + n));
    if (!rc && !rec) rc = mt_errf(err, "out of memory");
    if (!rc) g->recompute = rec;
    for (int l = 0; l < g->cfg.n_layers && !rc; l++) {
        if (pick[l] != 1) continue;
        int64_t saved = 0;
        if (mt__recompute_block(g, l, &saved, err)) { rc = -1; break; }
        int at = g->n_recompute++;
        while (at > 0 && g->recompute[at - 1].layer > l) { g->recompute[at] = g->recompute[at - 1]; at--; }
        g->recompute[at].layer = l; g->recompute[at].saved_bytes = saved;
    }
    MT_FREE(pick);
    return rc;
}

/* After elision: fusion and the memory plan, as mt_run_passes runs them. */
static int mt__late_passes(mt_graph *g, const mt_passes *p, mt_err *err) {
    if (p->fold_rope && g->target.backend == MT_BACKEND_CUDA && mt_pass_fold_rope(g, err) < 0) return -1;
    if (p->fuse && mt_pass_fuse(g, err)) return -1;
    if (p->fuse && p->fuse_glu && mt_pass_fuse_glu(g, err) < 0) return -1;
    /* streams that run collectives side by side need them on separate communicators: overlap implies isolation */
    if ((p->isolate_ep || p->overlap) && mt_pass_isolate_ep(g, err) < 0) return -1;
    g->overlap = 0;
    if (p->overlap && mt_pass_overlap(g, err)) return -1;   /* before planning: the plan follows the schedule */
    if (p->plan_memory) return mt_pass_plan_memory(g, err);
    mt_plan_naive(g);
    return 0;
}

/* The budget policy: few blocks to recompute so that the planned peak
 * (persistent + arena) fits. Greedy, guided by where the peak is: each
 * round finds the node where the most arena bytes are alive (in the graph
 * as recomputed so far) and recomputes the block that holds the most bytes
 * of activations there for a backward that has not begun yet (ties, and
 * when no block holds any: the block with the most saved bytes overall,
 * then the earlier one); then the memory planner plans the step for real,
 * and the first plan that fits wins. A block whose backward is already
 * running at the peak would hold its re-run activations there anyway, so
 * recomputing it would not help; the peak of a large model's step is often
 * late in the backward, where the weight gradients have piled up, and there
 * only the first blocks' activations are still held. The graph that is kept
 * is rebuilt from the chosen set in one go, so a budget's choice gives the
 * same graph as naming those blocks. */
static int64_t mt__rc_peak_node(const mt_graph *g, int32_t *first, int32_t *last, int64_t *acc) {
    mt__live_ranges(g, first, last);
    for (int i = 0; i <= g->n_nodes; i++) acc[i] = 0;
    for (int v = 0; v < g->n_values; v++)
        if (MT_ROLE_IN_ARENA(g->values[v].role) && first[v] >= 0) { acc[first[v]] += g->values[v].nbytes; acc[last[v] + 1] -= g->values[v].nbytes; }
    int64_t run = 0, top = -1;
    int at = 0;
    for (int i = 0; i < g->n_nodes; i++) { run += acc[i]; if (run > top) { top = run; at = i; } }
    return at;
}
static int mt__recompute_for_budget(mt_graph *g, const mt_passes *p, mt_err *err) {
    int64_t budget = p->memory_budget;
    char h1[32], h2[32], h3[32], h4[32], h5[32];
    if (!p->plan_memory) return mt_errf(err, "a memory budget needs the memory planner (an eager plan gives every value its own bytes)");
    mt_graph t, cur;
    if (mt_graph_copy(&t, g, err)) return -1;
    if (mt__late_passes(&t, p, err)) { mt_graph_free(&t); return -1; }
    int64_t peak0 = mt_graph_peak_bytes(&t), best = peak0, persist = t.persist_bytes;
    int L = g->cfg.n_layers, best_k = 0, rc = 0, done = 0, n_chosen = 0;
    if (peak0 <= budget || g->kind != MT_GRAPH_TRAIN) {
        if (peak0 > budget) {
            mt_graph_free(&t);
            return mt_errf(err, "memory budget %s (%lld bytes) cannot be met: a forward-only graph plans %s and has nothing to recompute",
                           mt__human((double)budget, h1), (long long)budget, mt__human((double)peak0, h2));
        }
        mt_graph_free(g);
        *g = t;
        g->memory_budget = budget; g->peak_no_recompute = peak0;
        return 0;
    }
    mt_graph_free(&t);
    if (mt_graph_copy(&cur, g, err)) return -1;
    int32_t *chosen = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(L + 1));
    uint8_t *taken = (uint8_t *)mt__calloc((size_t)L + 1), *want = NULL;
    int32_t *first = NULL, *last = NULL;
    int64_t *acc = NULL;
    if (!chosen || !taken) { rc = mt_errf(err, "out of memory"); goto out; }
    while (n_chosen < L && !done && !rc) {
        int nv = cur.n_values;
        MT_FREE(want); MT_FREE(first); MT_FREE(last); MT_FREE(acc);
        want = (uint8_t *)MT_MALLOC((size_t)nv + 1);
        first = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));
        last = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(nv + 1));
        acc = (int64_t *)MT_MALLOC(sizeof(int64_t) * (size_t)(cur.n_nodes + 2));
        if (!want || !first || !last || !acc) { rc = mt_errf(err, "out of memory"); break; }
        int pk = (int)mt__rc_peak_node(&cur, first, last, acc), pick = -1;
        int64_t pick_alive = -1, pick_total = -1;
        for (int l = 0; l < L && !rc; l++) {
            if (taken[l]) continue;
            mt__rc_info ri;
            int ins;
            if (mt__rc_scan(&cur, l, &ri, err)) { rc = -1; break; }
            memset(want, 0, (size_t)nv + 1);
            int64_t total = mt__rc_wanted(&cur, &ri, l, want, &ins), alive = 0;
            MT_FREE(ri.prod); MT_FREE(ri.ext);
            for (int v = 0; v < nv && ins >= 0 && pk < ins; v++)
                if (want[v] && first[v] <= pk && last[v] >= pk) alive += cur.values[v].nbytes;
            if (alive > pick_alive || (alive == pick_alive && total > pick_total)) { pick = l; pick_alive = alive; pick_total = total; }
        }
        if (rc) break;
        int32_t one = pick;
        taken[pick] = 1;
        int at = n_chosen++;   /* kept in increasing layer order, as the pass records them */
        while (at > 0 && chosen[at - 1] > pick) { chosen[at] = chosen[at - 1]; at--; }
        chosen[at] = pick;
        if (mt_pass_recompute(&cur, &one, 1, err) || mt_graph_copy(&t, g, err)) { rc = -1; break; }
        /* measured as it will be built: the chosen set in one go from the graph as it came */
        if (mt_pass_recompute(&t, chosen, n_chosen, err) || mt__late_passes(&t, p, err)) { mt_graph_free(&t); rc = -1; break; }
        int64_t peak = mt_graph_peak_bytes(&t);
        mt_graph_free(&t);
        if (peak < best) { best = peak; best_k = n_chosen; }
        done = peak <= budget;
    }
    if (done && !rc) {   /* the chosen blocks, in one go from the graph as it came */
        if (mt_graph_copy(&t, g, err)) rc = -1;
        else if (mt_pass_recompute(&t, chosen, n_chosen, err) || mt__late_passes(&t, p, err)) { mt_graph_free(&t); rc = -1; }
        else if (mt_graph_peak_bytes(&t) > budget) {
            rc = mt_errf(err, "internal error: the recompute plan for the budget changed when rebuilt");
            mt_graph_free(&t);
        } else {
            mt_graph_free(g);
            *g = t;
            g->memory_budget = budget; g->peak_no_recompute = peak0;
        }
    } else if (!rc) {
        rc = mt_errf(err, "memory budget %s (%lld bytes) cannot be met: the smallest planned peak is %s (%lld bytes, %s persistent + "
                     "%s arena) recomputing %d of %d blocks; without recompute it is %s. Ask for at least %s, or shrink the step "
                     "(batch, seq_len) or the model",
                     mt__human((double)budget, h1), (long long)budget, mt__human((double)best, h2), (long long)best,
                     mt__human((double)persist, h3), mt__human((double)(best - persist), h4), best_k, L,
                     mt__human((double)peak0, h5), h2);
    }
out:
    mt_graph_free(&cur);
    MT_FREE(chosen); MT_FREE(taken); MT_FREE(want); MT_FREE(first); MT_FREE(last); MT_FREE(acc);
    return rc;
}

void mt_passes_all(mt_passes *p) { p->elide = 1; p->fuse = 1; p->plan_memory = 1; p->capture = 1; p->isolate_ep = 1; p->overlap = 1; p->fold_rope = 1; p->fuse_glu = 1; p->memory_budget = 0; p->moments = MT_F32; p->fp8 = 0; p->moe_chunks = 1; }
void mt_passes_none(mt_passes *p) { p->elide = 0; p->fuse = 0; p->plan_memory = 0; p->capture = 0; p->isolate_ep = 0; p->overlap = 0; p->fold_rope = 0; p->fuse_glu = 0; p->memory_budget = 0; p->moments = MT_F32; p->fp8 = 0; p->moe_chunks = 1; }
/* Every AdamW moment becomes bf16. The values only shrink, so a plan made before stays valid (if
 * wasteful); mt_run_passes runs this first, before anything is planned. */
int mt_pass_bf16_moments(mt_graph *g, mt_err *err) {
    int n = 0;
    (void)err;
    for (int i = 0; i < g->n_values; i++) {
        mt_value *v = &g->values[i];
        if (v->role != MT_ROLE_OPT || v->dtype == MT_BF16) continue;
        v->dtype = MT_BF16;
        v->nbytes = mt_value_numel_max(g, v) * mt_dtype_bytes(g, MT_BF16);
        n++;
    }
    return n;
}
int mt_graph_moe_chunks(const mt_graph *g) {
    int n = 0;
    for (int s = 0; s < g->n_syms; s++) n += g->syms[s].kind == MT_SYM_SIZE && g->syms[s].mesh_dim == MT_DIM_EP;
    return n > 1 ? n : 1;
}
int mt_graph_moments(const mt_graph *g) {
    for (int i = 0; i < g->n_values; i++)
        if (g->values[i].role == MT_ROLE_OPT) return g->values[i].dtype;
    return MT_F32;
}
/* --- the FP8 pass ---
 * A GEMM is in FP8 when it multiplies by, or forms the gradient of, a linear layer's weight: the
 * weight is the node's second input (forward Y = X W^T: MATMUL transB, GMM; the input gradient
 * dX = dY W: MATMUL plain, GMM_DX) or its output (the weight gradient dW = dY^T X: MATMUL transA,
 * GMM_DW). The weight is found by name: the value's name without what the builder adds around a
 * parameter's ("d." in front of a gradient, "@bf16", "@full", "#2" behind). */
int mt_graph_fp8(const mt_graph *g) {
    int k = 0;
    for (int i = 0; i < g->n_nodes; i++) k += mt_node_fp8(&g->nodes[i]);
    return k;
}
static int mt__fp8_weight(const mt_graph *g, int v) {   /* the linear layer's weight value v stands for, or -1 */
    char nm[MT_NAME_LEN];
    const mt_value *x = &g->values[v];
    const char *s = x->role == MT_ROLE_GRAD && x->param >= 0 ? g->values[x->param].name : x->name;
    if (!strncmp(s, "d.", 2)) s += 2;
    snprintf(nm, sizeof nm, "%s", s);
    nm[strcspn(nm, "@#")] = 0;
    int p = mt_graph_find(g, nm);
    if (p < 0) return -1;
    const mt_value *w = &g->values[p];
    size_t L = strlen(nm);
    if (w->role != MT_ROLE_PARAM || !(w->flags & MT_VF_TRAINABLE) || w->ndim < 2) return -1;
    if (!strcmp(nm, "lm_head.weight") || strstr(nm, "embed_tokens") ||   /* the head, the embedding and the */
        (L >= 16 && !strcmp(nm + L - 16, "mlp.gate.weight")))            /* router stay in higher precision */
        return -1;
    return p;
}
static int mt__fp8_fits(const mt_graph *g, const mt_node *n) {
    int wv = -1;
    switch (n->op) {
    case MT_OP_MATMUL: case MT_OP_MATMUL_ACC:
        if (!n->iattr[0]) wv = n->in[1];         /* forward (transB) or the input gradient (plain) */
        else if (!n->iattr[1]) wv = n->out[0];   /* the weight gradient */
        break;
    case MT_OP_GMM: case MT_OP_GMM_DX: case MT_OP_GMM_DX2: case MT_OP_GMM_GLU: wv = n->in[1]; break;
    case MT_OP_GMM_DW: case MT_OP_GMM_DW_SQ: wv = n->out[0]; break;
    }
    return wv >= 0 && mt__fp8_weight(g, wv) >= 0 && mt__fp8_shapes(g, n);
}
static int mt__fp8_wgrad(const mt_node *n) {   /* a weight gradient's GEMM (dW = dY^T X) */
    return n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ || ((n->op == MT_OP_MATMUL || n->op == MT_OP_MATMUL_ACC) && n->iattr[0]);
}
const char *mt_fp8_mode_name(int mode) {
    return mode == MT_FP8_ALL ? "fp8" : mode == MT_FP8_NO_WGRAD ? "fp8-bf16-wgrad" : "bf16";
}
int mt_graph_fp8_mode(const mt_graph *g) {
    int any = 0, wgrad = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        any |= mt_node_fp8(&g->nodes[i]);
        wgrad |= mt_node_fp8(&g->nodes[i]) && mt__fp8_wgrad(&g->nodes[i]);
    }
    return !any ? MT_FP8_OFF : wgrad ? MT_FP8_ALL : MT_FP8_NO_WGRAD;
}
int mt_pass_fp8(mt_graph *g, int mode, mt_err *err) {
    int k = 0;
    if (mode != MT_FP8_ALL && mode != MT_FP8_NO_WGRAD) return mt_errf(err, "FP8 pass: mode %d (MT_FP8_ALL or MT_FP8_NO_WGRAD)", mode);
    for (int i = 0; i < g->n_nodes; i++) {
        mt_node *n = &g->nodes[i];
        if (!mt__fp8_gemm_op(n->op) || n->iattr[MT_IATTR_FP8] || !mt__fp8_fits(g, n)) continue;
        if (mode == MT_FP8_NO_WGRAD && mt__fp8_wgrad(n)) continue;
        n->iattr[MT_IATTR_FP8] = 1;
        k++;
    }
    return k;
}
int mt_run_passes(mt_graph *g, const mt_passes *p, mt_err *err) {
    if (p->memory_budget < 0) return mt_errf(err, "memory budget %lld bytes is negative", (long long)p->memory_budget);
    if (p->moments != MT_F32 && p->moments != MT_BF16) return mt_errf(err, "AdamW moments are f32 or bf16, not dtype %d", p->moments);
    if (p->moments == MT_BF16 && mt_pass_bf16_moments(g, err) < 0) return -1;
    if (p->fp8 && mt_pass_fp8(g, p->fp8, err) < 0) return -1;
    if (p->elide && mt_pass_elide_collectives(g, err)) return -1;
    if (p->memory_budget > 0) { if (mt__recompute_for_budget(g, p, err)) return -1; }   /* recompute, fusion, plan */
    else if (mt__late_passes(g, p, err)) return -1;
    /* capture pass: the step replays as CUDA graphs, one per region between
     * host synchronizations (the runtime finds them with mt_node_syncs_host) */
    g->capture = p->capture && g->target.backend == MT_BACKEND_CUDA;
    return 0;
}
int mt_compile(mt_graph *g, const mt_config *c, const mt_mesh *m, const mt_target *t, int kind,
               const mt_passes *p, mt_err *err) {
    if (mt_build_chunked(g, c, m, t, kind, p->moe_chunks > 0 ? p->moe_chunks : 1, err)) return -1;
    if (mt_run_passes(g, p, err)) { mt_graph_free(g); return -1; }
    return 0;
}

#ifdef MT_CUDA
/* The GEMM keys of a graph, as the runtime will meet them (MATMUL and MATMUL_ACC; rows at their bound). */
int mt_tune(mt_graph *g, int device, mt_err *err) {
    if (g->target.backend != MT_BACKEND_CUDA) return mt_errf(err, "only CUDA graphs are tuned");
    mt_cuda *cu;
    if (mt_cuda_create(&cu, device, err)) return -1;
    mt_tuning_info info;
    mt_tuning *t = (mt_tuning *)mt__calloc(sizeof(mt_tuning) * (size_t)(g->n_nodes + 1));
    int n = 0, rc = t ? mt_cuda_device_info(cu, &info) : mt_errf(err, "out of memory");
    for (int i = 0; !rc && i < g->n_nodes; i++) {
        const mt_node *x = &g->nodes[i];
        if ((x->op != MT_OP_MATMUL && x->op != MT_OP_MATMUL_ACC) || mt_node_fp8(x)) continue;   /* FP8: not cuBLASLt's bf16 */
        const mt_value *a = &g->values[x->in[0]], *b = &g->values[x->in[1]];
        int64_t arows = mt_value_numel_max(g, a) / (a->dims[1] > 0 ? a->dims[1] : 1), brows = mt_value_numel_max(g, b) / (b->dims[1] > 0 ? b->dims[1] : 1);
        int ta = x->iattr[0], tb = x->iattr[1];
        int M = (int)(ta ? a->dims[1] : arows), K = (int)(ta ? arows : a->dims[1]), N = (int)(tb ? brows : b->dims[1]);
        if (M <= 0 || N <= 0 || K <= 0) continue;
        mt_tuning k;
        memset(&k, 0, sizeof k);
        int bf = a->dtype == MT_BF16 && b->dtype == MT_BF16;   /* as mt_cuda_matmul: else everything in f32 */
        k.ta = ta; k.tb = tb; k.n = N; k.k = K;
        k.at = bf ? MT_BF16 : MT_F32; k.bt = k.at; k.ct = bf ? g->values[x->out[0]].dtype : MT_F32;
        for (k.mb = 1; k.mb < M; k.mb <<= 1) {}
        int seen = 0;
        for (int j = 0; j < n && !seen; j++)
            seen = t[j].ta == k.ta && t[j].tb == k.tb && t[j].mb == k.mb && t[j].n == k.n && t[j].k == k.k && t[j].at == k.at &&
                   t[j].bt == k.bt && t[j].ct == k.ct;
        if (seen) continue;
        if (mt_cuda_gemm_choose(cu, &k, M)) rc = mt_errf(err, "tuning node %d: %s", i, mt_cuda_error(cu));
        else t[n++] = k;
    }
    mt_cuda_destroy(cu);
    if (rc) { MT_FREE(t); return -1; }
    MT_FREE(g->tuning);
    g->tuning = t; g->n_tuning = n; g->tuned_for = info;
    return 0;
}
#endif

/* ========================================================================
 * 7. Artifact
 * Layout (all integers little-endian):
 *   "MOETRAIN" | u32 format version | u32 n_sections | u64 file size
 *   n_sections x { u32 id | u32 0 | u64 offset | u64 length | u64 checksum }
 *   u64 checksum of all the bytes above
 *   sections: CONFIG MESH SYMBOLS VALUES NODES CONSTS TUNING PLAN FINGERPRINT
 * Checksums are FNV-1a 64, which changes for any single-byte change. The
 * file holds no pointers, device ordinals, rank numbers or communicators.
 * ====================================================================== */

enum { MT_SEC_CONFIG = 1, MT_SEC_MESH, MT_SEC_SYMBOLS, MT_SEC_VALUES, MT_SEC_NODES, MT_SEC_CONSTS,
       MT_SEC_TUNING, MT_SEC_PLAN, MT_SEC_FINGERPRINT, MT_NSECTIONS = 9 };
static const char *const mt__sec_names[MT_NSECTIONS + 1] = {"?", "config", "mesh", "symbols", "values",
                                                            "nodes", "constants", "tuning", "plan", "fingerprint"};
#define MT__HDR_FIXED 24
#define MT__SEC_ENTRY 32

typedef struct { uint8_t *p; size_t n, cap; int oom; } mt__buf;
static void mt__put(mt__buf *b, const void *src, size_t n) {
    if (b->oom || !n) return;
    if (b->n + n > b->cap) {
        size_t nc = b->cap ? b->cap : 4096;
        while (nc < b->n + n) nc *= 2;
        uint8_t *q = (uint8_t *)MT_REALLOC(b->p, nc);
        if (!q) { b->oom = 1; return; }
        b->p = q; b->cap = nc;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void mt__u32(mt__buf *b, uint32_t x) {
    uint8_t t[4] = {(uint8_t)x, (uint8_t)(x >> 8), (uint8_t)(x >> 16), (uint8_t)(x >> 24)};
    mt__put(b, t, 4);
}
static void mt__u64(mt__buf *b, uint64_t x) { mt__u32(b, (uint32_t)x); mt__u32(b, (uint32_t)(x >> 32)); }
static void mt__i32(mt__buf *b, int32_t x) { mt__u32(b, (uint32_t)x); }
static void mt__i64(mt__buf *b, int64_t x) { mt__u64(b, (uint64_t)x); }
static void mt__f32(mt__buf *b, float f) { uint32_t u; memcpy(&u, &f, 4); mt__u32(b, u); }
static void mt__fixstr(mt__buf *b, const char *s, size_t n) {  /* exactly n bytes, NUL padded */
    char t[256];
    memset(t, 0, sizeof t);
    snprintf(t, n < sizeof t ? n : sizeof t, "%s", s);
    mt__put(b, t, n);
}

typedef struct { const uint8_t *p; size_t n, at; int bad; } mt__rd;
static uint32_t mt__g32(mt__rd *r) {
    if (r->bad || r->n - r->at < 4 || r->at > r->n) { r->bad = 1; return 0; }
    const uint8_t *q = r->p + r->at;
    r->at += 4;
    return (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
}
static uint64_t mt__g64(mt__rd *r) { uint64_t lo = mt__g32(r); return lo | (uint64_t)mt__g32(r) << 32; }
static int32_t mt__gi32(mt__rd *r) { return (int32_t)mt__g32(r); }
static int64_t mt__gi64(mt__rd *r) { return (int64_t)mt__g64(r); }
static float mt__gf32(mt__rd *r) { uint32_t u = mt__g32(r); float f; memcpy(&f, &u, 4); return f; }
static void mt__gfix(mt__rd *r, char *dst, size_t n) {
    if (r->bad || r->n - r->at < n) { r->bad = 1; memset(dst, 0, n); return; }
    memcpy(dst, r->p + r->at, n);
    r->at += n;
}
static int mt__fixstr_ok(const char *s, size_t n) {   /* NUL-terminated, printable, NUL padded */
    size_t len = 0;
    while (len < n && s[len]) len++;
    if (len == 0 || len == n) return 0;
    for (size_t i = 0; i < len; i++) if ((unsigned char)s[i] < 32 || (unsigned char)s[i] > 126) return 0;
    for (size_t i = len; i < n; i++) if (s[i]) return 0;
    return 1;
}

/* Readable summary of what the fingerprint covers. */
static void mt__fingerprint_text(const mt_graph *g, char *out, size_t n) {
    int at = snprintf(out, n, "format=%u kernels=\"%s\" target=%s/%s/real%d graph=%s mesh=%dx%dx%d/ep%d config:",
                      MT_FORMAT_VERSION, MT_KERNELS_VERSION, g->target.backend == MT_BACKEND_CUDA ? "cuda" : "cpu",
                      g->target.arch, (int)g->target.real_bytes, g->kind == MT_GRAPH_TRAIN ? "train" : "forward",
                      g->mesh.size[0], g->mesh.size[1], g->mesh.size[2], g->mesh.size[3]);
    for (int i = 0; i < mt_n_config_fields && at > 0 && (size_t)at < n; i++) {
        const mt_field *f = &mt_config_fields[i];
        const void *p = (const char *)&g->cfg + f->offset;
        if (f->type == MT_FIELD_INT) at += snprintf(out + at, n - (size_t)at, " %s=%d", f->name, *(const int *)p);
        else at += snprintf(out + at, n - (size_t)at, " %s=%.9g", f->name, (double)*(const float *)p);
    }
    /* the recompute choice: which blocks the step re-runs, for which budget */
    if (at > 0 && (size_t)at < n) at += snprintf(out + at, n - (size_t)at, " memory_budget=%lld recompute=", (long long)g->memory_budget);
    for (int i = 0; i < g->n_recompute && at > 0 && (size_t)at < n; i++)
        at += snprintf(out + at, n - (size_t)at, "%s%d", i ? "," : "", g->recompute[i].layer);
    if (!g->n_recompute && at > 0 && (size_t)at < n) at += snprintf(out + at, n - (size_t)at, "none");
    /* the AdamW moments' dtype, where it is not the default */
    if (mt_graph_moments(g) == MT_BF16 && at > 0 && (size_t)at < n) at += snprintf(out + at, n - (size_t)at, " moments=bf16");
    /* how many GEMMs run in FP8, where any do */
    if (mt_graph_fp8(g) && at > 0 && (size_t)at < n) at += snprintf(out + at, n - (size_t)at, " fp8=%d", mt_graph_fp8(g));
    /* the MoE layers' chunks of tokens, where not 1 */
    if (mt_graph_moe_chunks(g) > 1 && at > 0 && (size_t)at < n) snprintf(out + at, n - (size_t)at, " moe_chunks=%d", mt_graph_moe_chunks(g));
}
uint64_t mt_fingerprint(const mt_graph *g) {
    char text[4096];
    mt__fingerprint_text(g, text, sizeof text);
    return mt_hash(text, strlen(text), MT_HASH_INIT);
}

static void mt__write_section(mt__buf *b, int id, const mt_graph *g) {
    switch (id) {
    case MT_SEC_CONFIG:
        mt__i32(b, g->target.backend); mt__i32(b, g->target.real_bytes); mt__fixstr(b, g->target.arch, 16);
        mt__i32(b, g->kind);
        mt__u32(b, (uint32_t)mt_n_config_fields);
        for (int i = 0; i < mt_n_config_fields; i++) {
            const mt_field *f = &mt_config_fields[i];
            uint32_t bits;
            memcpy(&bits, (const char *)&g->cfg + f->offset, 4);
            mt__fixstr(b, f->name, 32); mt__u32(b, (uint32_t)f->type); mt__u32(b, bits);
        }
        break;
    case MT_SEC_MESH:
        mt__u32(b, MT_NDIMS);
        for (int d = 0; d < MT_NDIMS; d++) mt__i32(b, g->mesh.size[d]);
        break;
    case MT_SEC_SYMBOLS:
        mt__u32(b, (uint32_t)g->n_syms);
        for (int i = 0; i < g->n_syms; i++) {
            const mt_symbol *s = &g->syms[i];
            mt__fixstr(b, s->name, 32); mt__i32(b, s->kind); mt__i32(b, s->mesh_dim); mt__i64(b, s->max);
        }
        break;
    case MT_SEC_VALUES:
        mt__u32(b, (uint32_t)g->n_values);
        for (int i = 0; i < g->n_values; i++) {
            const mt_value *v = &g->values[i];
            mt__fixstr(b, v->name, MT_NAME_LEN);
            mt__i32(b, v->dtype); mt__i32(b, v->role); mt__i32(b, v->ndim); mt__i32(b, v->init);
            mt__u32(b, v->flags); mt__u32(b, v->shard);
            for (int d = 0; d < MT_MAX_DIMS; d++) mt__i64(b, v->dims[d]);
            mt__f32(b, v->init_std); mt__i32(b, v->param);
            mt__i64(b, v->offset); mt__i64(b, v->nbytes); mt__i64(b, v->data_offset);
        }
        break;
    case MT_SEC_NODES:
        mt__u32(b, (uint32_t)g->n_nodes); mt__i32(b, g->n_forward_nodes);
        for (int i = 0; i < g->n_nodes; i++) {
            const mt_node *n = &g->nodes[i];
            mt__i32(b, n->op); mt__i32(b, n->queue); mt__i32(b, n->phase); mt__i32(b, n->layer);
            mt__i32(b, n->n_in); mt__i32(b, n->n_out);
            for (int k = 0; k < MT_MAX_IN; k++) mt__i32(b, n->in[k]);
            for (int k = 0; k < MT_MAX_OUT; k++) mt__i32(b, n->out[k]);
            for (int k = 0; k < MT_MAX_ATTR; k++) mt__i32(b, n->iattr[k]);
            mt__u32(b, n->sym_mask);
            for (int k = 0; k < 4; k++) mt__f32(b, n->fattr[k]);
        }
        break;
    case MT_SEC_CONSTS:
        mt__put(b, g->consts, (size_t)g->consts_bytes);
        break;
    case MT_SEC_TUNING:
        mt__fixstr(b, g->tuned_for.device, sizeof g->tuned_for.device);
        mt__i32(b, g->tuned_for.sm); mt__i32(b, g->tuned_for.n_sms); mt__i64(b, g->tuned_for.blas_version);
        mt__u32(b, (uint32_t)g->n_tuning);
        for (int i = 0; i < g->n_tuning; i++) {
            const mt_tuning *t = &g->tuning[i];
            mt__i32(b, t->ta); mt__i32(b, t->tb); mt__i32(b, t->mb); mt__i32(b, t->n); mt__i32(b, t->k);
            mt__i32(b, t->at); mt__i32(b, t->bt); mt__i32(b, t->ct);
            for (int w = 0; w < MT_ALGO_WORDS; w++) mt__u64(b, t->algo[w]);
        }
        break;
    case MT_SEC_PLAN:
        mt__i64(b, g->persist_bytes); mt__i64(b, g->arena_bytes); mt__i64(b, g->naive_arena_bytes);
        mt__i32(b, g->planned); mt__i32(b, g->capture | g->overlap << 1);   /* bit 0 capture, bit 1 overlap */
        mt__u32(b, MT_NIO);
        for (int i = 0; i < MT_NIO; i++) mt__i32(b, g->io[i]);
        mt__i64(b, g->memory_budget); mt__i64(b, g->peak_no_recompute);
        mt__u32(b, (uint32_t)g->n_recompute);
        for (int i = 0; i < g->n_recompute; i++) { mt__i32(b, g->recompute[i].layer); mt__i64(b, g->recompute[i].saved_bytes); }
        break;
    case MT_SEC_FINGERPRINT: {
        char text[4096];
        mt__fingerprint_text(g, text, sizeof text);
        mt__u64(b, mt_fingerprint(g));
        mt__u32(b, (uint32_t)strlen(text));
        mt__put(b, text, strlen(text));
        break;
    }
    }
}

int mt_artifact_write(const mt_graph *g, uint8_t **bytes, size_t *len, mt_err *err) {
    mt__buf sec[MT_NSECTIONS + 1];
    memset(sec, 0, sizeof sec);
    size_t hdr = MT__HDR_FIXED + MT__SEC_ENTRY * MT_NSECTIONS + 8, total = hdr;
    int oom = 0;
    for (int id = 1; id <= MT_NSECTIONS; id++) {
        mt__write_section(&sec[id], id, g);
        oom |= sec[id].oom;
        total += sec[id].n;
    }
    mt__buf out;
    memset(&out, 0, sizeof out);
    if (!oom) {
        mt__put(&out, "MOETRAIN", 8);
        mt__u32(&out, MT_FORMAT_VERSION); mt__u32(&out, MT_NSECTIONS); mt__u64(&out, (uint64_t)total);
        size_t off = hdr;
        for (int id = 1; id <= MT_NSECTIONS; id++) {
            mt__u32(&out, (uint32_t)id); mt__u32(&out, 0);
            mt__u64(&out, off); mt__u64(&out, sec[id].n);
            mt__u64(&out, mt_hash(sec[id].p, sec[id].n, MT_HASH_INIT));
            off += sec[id].n;
        }
        mt__u64(&out, mt_hash(out.p, out.n, MT_HASH_INIT));
        for (int id = 1; id <= MT_NSECTIONS; id++) mt__put(&out, sec[id].p, sec[id].n);
    }
    for (int id = 1; id <= MT_NSECTIONS; id++) MT_FREE(sec[id].p);
    if (oom || out.oom) { MT_FREE(out.p); return mt_errf(err, "out of memory writing the artifact"); }
    *bytes = out.p; *len = out.n;
    return 0;
}

/* Write a file atomically: "<path>.tmp" in the same directory, fsync, rename
 * over path, fsync the directory. A failure or a kill at any point leaves what
 * was at path before untouched (at worst a stale "<path>.tmp"). */
static int mt__fsync_dir_of(const char *path) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == dir) dir[1] = 0;
    else *slash = 0;
    int fd = open(dir, O_RDONLY);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}
static int mt__write_fd(int fd, const void *p, size_t n) {   /* all n bytes, or -1 */
    const uint8_t *b = (const uint8_t *)p;
    while (n) {
        ssize_t w = write(fd, b, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        b += w; n -= (size_t)w;
    }
    return 0;
}
static int mt__read_fd(int fd, void *p, size_t n) {          /* exactly n bytes, or -1 */
    uint8_t *b = (uint8_t *)p;
    while (n) {
        ssize_t r = read(fd, b, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        b += r; n -= (size_t)r;
    }
    return 0;
}
static int mt__write_atomic(const char *path, const void *a, size_t na, const void *b, size_t nb, mt_err *err) {
    char tmp[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) return mt_errf(err, "path too long: '%s'", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return mt_errf(err, "cannot write '%s': %s", tmp, strerror(errno));
    int bad = mt__write_fd(fd, a, na) || (nb && mt__write_fd(fd, b, nb));
    int e1 = errno;
    if (!bad && fsync(fd)) { bad = 1; e1 = errno; }
    if (close(fd) && !bad) { bad = 1; e1 = errno; }
    if (bad) { remove(tmp); return mt_errf(err, "writing '%s' failed: %s", tmp, strerror(e1)); }
    if (rename(tmp, path)) { int e2 = errno; remove(tmp); return mt_errf(err, "cannot rename '%s' to '%s': %s", tmp, path, strerror(e2)); }
    mt__fsync_dir_of(path);   /* best effort: some file systems refuse fsync on directories */
    return 0;
}

int mt_artifact_save(const mt_graph *g, const char *path, mt_err *err) {
    uint8_t *bytes; size_t len;
    if (mt_artifact_write(g, &bytes, &len, err)) return -1;
    int rc = mt__write_atomic(path, bytes, len, NULL, 0, err);
    MT_FREE(bytes);
    return rc;
}

int mt_read_file(const char *path, uint8_t **bytes, size_t *len, mt_err *err) {
    *bytes = NULL; *len = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return mt_errf(err, "cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) { close(fd); return mt_errf(err, "'%s' is not a regular file", path); }
    if ((uint64_t)st.st_size > (uint64_t)SIZE_MAX / 2) { close(fd); return mt_errf(err, "'%s' is too large", path); }
    size_t n = (size_t)st.st_size;
    uint8_t *p = (uint8_t *)MT_MALLOC(n ? n : 1);
    if (!p) { close(fd); return mt_errf(err, "out of memory reading '%s' (%zu bytes)", path, n); }
    if (mt__read_fd(fd, p, n)) { MT_FREE(p); close(fd); return mt_errf(err, "short read on '%s'", path); }
    close(fd);
    *bytes = p; *len = n;
    return 0;
}

/* --- validation of a loaded graph: everything an interpreter will trust --- */
/* The target, config, mesh and symbols. */
static int mt__validate_header(const mt_graph *g, mt_err *err) {
    mt_err e;
    if (g->target.backend != MT_BACKEND_CPU && g->target.backend != MT_BACKEND_CUDA)
        return mt_errf(err, "config: unknown backend %d", g->target.backend);
    if (!(g->target.real_bytes == 4 || (g->target.backend == MT_BACKEND_CPU && g->target.real_bytes == 8)))
        return mt_errf(err, "config: bad real size %d", g->target.real_bytes);
    if (!mt__fixstr_ok(g->target.arch, sizeof g->target.arch)) return mt_errf(err, "config: bad architecture name");
    if (g->kind != MT_GRAPH_TRAIN && g->kind != MT_GRAPH_FORWARD) return mt_errf(err, "config: bad graph kind %d", g->kind);
    if (mt_config_validate(&g->cfg, &e)) return mt_errf(err, "config section: %s", e.msg);
    if (mt_mesh_validate(&g->mesh, &g->cfg, &e)) return mt_errf(err, "mesh section: %s", e.msg);
    for (int i = 0; i < g->n_syms; i++) {
        const mt_symbol *s = &g->syms[i];
        if (!mt__fixstr_ok(s->name, sizeof s->name)) return mt_errf(err, "symbol %d: bad name", i);
        if (s->kind != MT_SYM_COORD && s->kind != MT_SYM_SIZE) return mt_errf(err, "symbol '%s': bad kind", s->name);
        if (s->mesh_dim < 0 || s->mesh_dim >= MT_NDIMS) return mt_errf(err, "symbol '%s': bad mesh dimension", s->name);
        if (s->max < 0 || s->max > ((int64_t)1 << 40)) return mt_errf(err, "symbol '%s': bound %lld out of range", s->name, (long long)s->max);
        if (s->kind == MT_SYM_COORD && s->max != g->mesh.size[s->mesh_dim] - 1)
            return mt_errf(err, "symbol '%s': bound disagrees with the mesh", s->name);
    }
    return 0;
}
/* Every value: name, dtype, role, shape, size, owner, constant bytes. */
static int mt__validate_values(const mt_graph *g, mt_err *err) {
    for (int i = 0; i < g->n_values; i++) {
        const mt_value *v = &g->values[i];
        if (!mt__fixstr_ok(v->name, MT_NAME_LEN)) return mt_errf(err, "value %d: bad name", i);
        if (v->dtype < 0 || v->dtype >= MT_NDTYPES) return mt_errf(err, "value '%s': bad dtype %d", v->name, v->dtype);
        if (v->dtype == MT_BF16 && g->target.backend != MT_BACKEND_CUDA && v->role != MT_ROLE_OPT)
            return mt_errf(err, "value '%s': bf16 in a CPU graph (only AdamW moments may be)", v->name);
        if (v->role < 0 || v->role >= MT_NROLES) return mt_errf(err, "value '%s': bad role %d", v->name, v->role);
        if (v->ndim < 1 || v->ndim > MT_MAX_DIMS) return mt_errf(err, "value '%s': bad rank %d", v->name, v->ndim);
        if (v->init < MT_INIT_NONE || v->init > MT_INIT_NORMAL || !isfinite(v->init_std) || v->init_std < 0 || v->init_std > 100)
            return mt_errf(err, "value '%s': bad initializer", v->name);
        if (v->flags & ~(uint32_t)(MT_VF_TRAINABLE | MT_VF_DECAY | MT_VF_EXPERTS | MT_VF_COUNTS | MT_VF_GATHERED | MT_VF_TP))
            return mt_errf(err, "value '%s': unknown flags 0x%x", v->name, v->flags);
        if (!mt_mesh_mask_valid(v->shard) || ((v->flags & MT_VF_GATHERED) && !v->shard))
            return mt_errf(err, "value '%s': bad shard mask 0x%x", v->name, v->shard);
        int64_t numel = 1;
        for (int d = 0; d < MT_MAX_DIMS; d++) {
            int64_t x = v->dims[d];
            if (d >= v->ndim) { if (x) return mt_errf(err, "value '%s': unused dim %d is %lld", v->name, d, (long long)x); continue; }
            if (x < 0 && -x - 1 >= g->n_syms) return mt_errf(err, "value '%s': dim %d names a missing symbol", v->name, d);
            if (x > ((int64_t)1 << 40)) return mt_errf(err, "value '%s': dim %d = %lld too large", v->name, d, (long long)x);
            int64_t m = mt__dim_max(g, x);
            if (m && numel > (((int64_t)1 << 48) / m)) return mt_errf(err, "value '%s': too many elements", v->name);
            numel *= m;
        }
        numel = mt_value_numel_max(g, v);   /* as stored: a shard, or padded when gathered */
        if (v->nbytes != numel * mt_dtype_bytes(g, v->dtype))
            return mt_errf(err, "value '%s': size %lld bytes, its shape needs %lld", v->name, (long long)v->nbytes,
                           (long long)(numel * mt_dtype_bytes(g, v->dtype)));
        if (v->offset % MT_ALIGN)   /* every plan aligns; kernels (and C's own alignment rules) rely on it */
            return mt_errf(err, "value '%s': offset %lld is not a multiple of %d", v->name, (long long)v->offset, MT_ALIGN);
        if (v->param < -1 || v->param >= g->n_values || (v->param >= 0 && g->values[v->param].role != MT_ROLE_PARAM))
            return mt_errf(err, "value '%s': bad owner %d", v->name, v->param);
        if (v->role == MT_ROLE_CONST) {
            if (v->data_offset < 0 || v->data_offset > g->consts_bytes || v->nbytes > g->consts_bytes - v->data_offset)
                return mt_errf(err, "constant '%s': bytes %lld+%lld outside the %lld-byte constants section", v->name,
                               (long long)v->data_offset, (long long)v->nbytes, (long long)g->consts_bytes);
        } else if (v->data_offset != -1) {
            return mt_errf(err, "value '%s': data offset on a non-constant", v->name);
        }
        for (int d = 0; d < v->ndim; d++)
            if (v->dims[d] < 0 && (v->role == MT_ROLE_CONST || !MT_ROLE_IN_ARENA(v->role)))
                return mt_errf(err, "value '%s': symbolic size outside the arena", v->name);
    }
    return 0;
}
/* The plan's regions and flags, and the recompute choice. */
static int mt__validate_plan(const mt_graph *g, mt_err *err) {
    if (g->persist_bytes < 0 || g->arena_bytes < 0 || g->naive_arena_bytes < g->arena_bytes ||
        g->persist_bytes > ((int64_t)1 << 46) || g->naive_arena_bytes > ((int64_t)1 << 46))
        return mt_errf(err, "plan: region sizes out of range");
    {   /* and no larger than their values need: every plan packs them (a padded region would be allocated whole) */
        int64_t pend = 0, aend = 0, naive = 0;
        for (int i = 0; i < g->n_values; i++) {
            const mt_value *v = &g->values[i];
            if (v->offset < 0 || v->offset > ((int64_t)1 << 56)) continue;   /* refused by the plan check below */
            int64_t end = v->offset + mt__align(v->nbytes);
            if (MT_ROLE_IN_ARENA(v->role)) { naive += mt__align(v->nbytes); if (end > aend) aend = end; }
            else if (end > pend) pend = end;
        }
        if (g->persist_bytes > pend || g->arena_bytes > aend || g->naive_arena_bytes > naive)
            return mt_errf(err, "plan: regions of %lld persistent, %lld arena (%lld naive) bytes, but the values need at most %lld, %lld (%lld)",
                           (long long)g->persist_bytes, (long long)g->arena_bytes, (long long)g->naive_arena_bytes, (long long)pend,
                           (long long)aend, (long long)naive);
    }
    if (g->planned != 0 && g->planned != 1) return mt_errf(err, "plan: bad planned flag");
    if (g->capture != 0 && g->capture != 1) return mt_errf(err, "plan: bad capture flag");
    if (g->overlap != 0 && g->overlap != 1) return mt_errf(err, "plan: bad overlap flag");
    if (g->n_forward_nodes < 0 || g->n_forward_nodes > g->n_nodes) return mt_errf(err, "nodes: bad forward count");
    /* the recompute choice: listed blocks in order, each re-run by recompute-phase nodes of forward ops */
    if (g->memory_budget < 0 || g->memory_budget > ((int64_t)1 << 56) || g->peak_no_recompute < 0 ||
        g->peak_no_recompute > ((int64_t)1 << 56))
        return mt_errf(err, "plan: memory budget or peak out of range");
    if (g->n_recompute < 0 || g->n_recompute > g->cfg.n_layers || (g->n_recompute && g->kind != MT_GRAPH_TRAIN))
        return mt_errf(err, "plan: %d recomputed blocks in a %s graph of %d blocks", g->n_recompute,
                       g->kind == MT_GRAPH_TRAIN ? "train" : "forward", g->cfg.n_layers);
    for (int i = 0; i < g->n_recompute; i++) {
        const mt_recompute *x = &g->recompute[i];
        if (x->layer < 0 || x->layer >= g->cfg.n_layers || (i && x->layer <= g->recompute[i - 1].layer))
            return mt_errf(err, "plan: recomputed block %d is not a block, or out of order", x->layer);
        if (x->saved_bytes < 0 || x->saved_bytes > ((int64_t)1 << 46))
            return mt_errf(err, "plan: recomputed block %d: saved bytes %lld out of range", x->layer, (long long)x->saved_bytes);
        int runs = 0;
        for (int k = g->n_forward_nodes; k < g->n_nodes && !runs; k++)
            runs = g->nodes[k].phase == MT_PHASE_RECOMPUTE && g->nodes[k].layer == x->layer;
        if (!runs) return mt_errf(err, "plan: block %d is listed as recomputed but no node re-runs it", x->layer);
    }
    return 0;
}
/* Nodes: shapes, then every value is written before it is read, and arena values once. */
static int mt__validate_nodes(const mt_graph *g, mt_err *err) {
    mt_err e;
    uint8_t *state = (uint8_t *)mt__calloc((size_t)g->n_values + 1);  /* 0 unwritten, 1 written */
    if (!state) return mt_errf(err, "out of memory validating");
    for (int i = 0; i < g->n_values; i++) {
        int r = g->values[i].role;
        state[i] = (r == MT_ROLE_PARAM || r == MT_ROLE_OPT || r == MT_ROLE_INPUT || r == MT_ROLE_CONST) ? 1 : 0;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        if (mt_check_node(g, n, &e)) { MT_FREE(state); return mt_errf(err, "node %d: %s", i, e.msg); }
        if ((n->phase == MT_PHASE_FORWARD) != (i < g->n_forward_nodes)) { MT_FREE(state); return mt_errf(err, "node %d: phase disagrees with the forward count", i); }
        if (n->phase == MT_PHASE_RECOMPUTE) {   /* a forward op of a listed block */
            int listed = 0;
            for (int k = 0; k < g->n_recompute && !listed; k++) listed = g->recompute[k].layer == n->layer;
            int fwd_op = mt_ops[n->op].differentiable || n->op == MT_OP_EP_COUNTS || n->op == MT_OP_ADD_RMSNORM || n->op == MT_OP_MATMUL_ACC ||
                         n->op == MT_OP_ROPE_PE || n->op == MT_OP_MLA_ATTENTION || n->op == MT_OP_GMM_GLU;   /* fused forward ops */
            if (!listed || !fwd_op) {
                MT_FREE(state);
                return mt_errf(err, "node %d (%s) re-runs %s of block %d, which the plan does not list as recomputed", i,
                               mt_ops[n->op].name, fwd_op ? "a forward op" : "a non-forward op", n->layer);
            }
        }
        for (int k = 0; k < n->n_out; k++)   /* a MoE layer's counts: the forward's router writes them, once */
            if (n->out[k] >= 0 && (g->values[n->out[k]].flags & MT_VF_COUNTS) && n->op != MT_OP_ALLREDUCE &&
                !(n->op == MT_OP_ROUTER && k == 3 && n->phase == MT_PHASE_FORWARD)) {
                MT_FREE(state);
                return mt_errf(err, "node %d (%s, %s) writes the expert counts '%s', which only the forward router may write", i,
                               mt_ops[n->op].name, n->phase == MT_PHASE_RECOMPUTE ? "recompute" : "not the forward", g->values[n->out[k]].name);
            }
        for (int k = 0; k < n->n_in; k++)
            if (n->in[k] >= 0 && !state[n->in[k]]) {
                MT_FREE(state);
                return mt_errf(err, "node %d (%s) reads '%s' before anything writes it", i, mt_ops[n->op].name, g->values[n->in[k]].name);
            }
        for (int k = 0; k < n->n_out; k++) {
            int v = n->out[k];
            if (v < 0) continue;
            int in_place = 0;
            for (int j = 0; j < n->n_in; j++) in_place |= n->in[j] == v;
            if (state[v] && MT_ROLE_IN_ARENA(g->values[v].role) && !in_place) {
                MT_FREE(state);
                return mt_errf(err, "node %d (%s) writes arena value '%s' a second time", i, mt_ops[n->op].name, g->values[v].name);
            }
            state[v] = 1;
        }
    }
    MT_FREE(state);
    return 0;
}
/* The well-known values: present as the graph kind needs, of their role, dtype and size. */
static int mt__validate_io(const mt_graph *g, mt_err *err) {
    static const struct { int slot, role, dtype, train, fwd; } io[MT_NIO] = {
        {MT_IO_TOKENS, MT_ROLE_INPUT, MT_I32, 1, 1}, {MT_IO_TARGETS, MT_ROLE_INPUT, MT_I32, 1, 1},
        {MT_IO_STEP, MT_ROLE_INPUT, MT_I32, 1, 0}, {MT_IO_HPARAMS, MT_ROLE_INPUT, MT_F32, 1, 0},
        {MT_IO_LOSS, MT_ROLE_OUTPUT, MT_F32, 1, 1}, {MT_IO_GRAD_NORM, MT_ROLE_OUTPUT, MT_F32, 1, 0},
        {MT_IO_LR, MT_ROLE_OUTPUT, MT_F32, 1, 0}, {MT_IO_LOGITS, MT_ROLE_OUTPUT, MT_F32, 0, 1}};
    int64_t N = (int64_t)g->cfg.batch * g->cfg.seq_len;
    for (int i = 0; i < MT_NIO; i++) {
        int v = g->io[io[i].slot], want = g->kind == MT_GRAPH_TRAIN ? io[i].train : io[i].fwd;
        if (!want) { if (v != -1) return mt_errf(err, "plan: unexpected well-known value %d", i); continue; }
        if (v < 0 || v >= g->n_values) return mt_errf(err, "plan: well-known value %d missing", i);
        const mt_value *x = &g->values[v];
        if (x->role != io[i].role || (x->dtype != io[i].dtype && !(i == MT_IO_LOGITS && x->dtype == MT_BF16)))
            return mt_errf(err, "plan: well-known value '%s' has the wrong role or dtype", x->name);
        int64_t want_n = 1;
        if (i == MT_IO_TOKENS || i == MT_IO_TARGETS) want_n = N;
        else if (i == MT_IO_HPARAMS) want_n = (int64_t)MT_HP_COUNT;
        else if (i == MT_IO_LOGITS) want_n = N * g->cfg.vocab_size;
        if (mt_value_numel_max(g, x) != want_n) return mt_errf(err, "plan: well-known value '%s' has the wrong size", x->name);
    }
    return 0;
}
static int mt__validate_graph(const mt_graph *g, mt_err *err) {
    mt_err e;
    if (mt__validate_header(g, err) || mt__validate_values(g, err) || mt__validate_plan(g, err) ||
        mt__validate_nodes(g, err) || mt__validate_io(g, err))
        return -1;
    if (mt_plan_check(g, &e)) return mt_errf(err, "plan: %s", e.msg);
    if (g->overlap) {   /* the streams' schedule is derived again here: it must be hazard-free with this plan */
        mt_schedule sc;
        if (mt_schedule_build(g, &sc, &e)) return mt_errf(err, "schedule: %s", e.msg);
        int bad = mt_schedule_check(g, &sc, &e);
        mt_schedule_free(&sc);
        if (bad) return mt_errf(err, "schedule: %s", e.msg);
    }
    return 0;
}

static int mt__read_section(mt_graph *g, int id, mt__rd *r, mt_err *err) {
    switch (id) {
    case MT_SEC_CONFIG: {
        g->target.backend = mt__gi32(r); g->target.real_bytes = mt__gi32(r);
        mt__gfix(r, g->target.arch, 16);
        g->kind = mt__gi32(r);
        uint32_t nf = mt__g32(r);
        if (r->bad) break;
        if (nf != (uint32_t)mt_n_config_fields)
            return mt_errf(err, "config section has %u fields, this build has %d", nf, mt_n_config_fields);
        for (uint32_t i = 0; i < nf && !r->bad; i++) {
            char name[32];
            mt__gfix(r, name, 32);
            uint32_t type = mt__g32(r), bits = mt__g32(r);
            if (r->bad) break;
            const mt_field *f = &mt_config_fields[i];
            if (strncmp(name, f->name, 32) || type != (uint32_t)f->type)
                return mt_errf(err, "config section: field %u is '%.31s', this build expects '%s'", i, name, f->name);
            memcpy((char *)&g->cfg + f->offset, &bits, 4);
        }
        break;
    }
    case MT_SEC_MESH: {
        uint32_t nd = mt__g32(r);
        if (!r->bad && nd != MT_NDIMS) return mt_errf(err, "mesh section has %u dimensions, expected %d", nd, MT_NDIMS);
        for (int d = 0; d < MT_NDIMS; d++) g->mesh.size[d] = mt__gi32(r);
        break;
    }
    case MT_SEC_SYMBOLS: {
        uint32_t n = mt__g32(r);
        if (r->bad) break;
        if (n > 64 || (size_t)n * 48 > r->n - r->at) return mt_errf(err, "symbols section: count %u does not fit", n);
        g->syms = (mt_symbol *)mt__calloc(sizeof(mt_symbol) * (n + 1));
        if (!g->syms) return mt_errf(err, "out of memory");
        g->n_syms = (int)n;
        for (uint32_t i = 0; i < n; i++) {
            mt_symbol *s = &g->syms[i];
            mt__gfix(r, s->name, 32); s->kind = mt__gi32(r); s->mesh_dim = mt__gi32(r); s->max = mt__gi64(r);
        }
        break;
    }
    case MT_SEC_VALUES: {
        uint32_t n = mt__g32(r);
        size_t rec = MT_NAME_LEN + 6 * 4 + MT_MAX_DIMS * 8 + 8 + 3 * 8;
        if (r->bad) break;
        if (n > (1u << 24) || (size_t)n * rec > r->n - r->at) return mt_errf(err, "values section: count %u does not fit", n);
        g->values = (mt_value *)mt__calloc(sizeof(mt_value) * (n + 1));
        if (!g->values) return mt_errf(err, "out of memory");
        g->n_values = g->cap_values = (int)n;
        for (uint32_t i = 0; i < n; i++) {
            mt_value *v = &g->values[i];
            mt__gfix(r, v->name, MT_NAME_LEN);
            v->dtype = mt__gi32(r); v->role = mt__gi32(r); v->ndim = mt__gi32(r); v->init = mt__gi32(r);
            v->flags = mt__g32(r); v->shard = mt__g32(r);
            for (int d = 0; d < MT_MAX_DIMS; d++) v->dims[d] = mt__gi64(r);
            v->init_std = mt__gf32(r); v->param = mt__gi32(r);
            v->offset = mt__gi64(r); v->nbytes = mt__gi64(r); v->data_offset = mt__gi64(r);
        }
        break;
    }
    case MT_SEC_NODES: {
        uint32_t n = mt__g32(r);
        size_t rec = 4 * (6 + MT_MAX_IN + MT_MAX_OUT + MT_MAX_ATTR + 1 + 4);
        g->n_forward_nodes = mt__gi32(r);
        if (r->bad) break;
        if (n > (1u << 24) || (size_t)n * rec > r->n - r->at) return mt_errf(err, "nodes section: count %u does not fit", n);
        g->nodes = (mt_node *)mt__calloc(sizeof(mt_node) * (n + 1));
        if (!g->nodes) return mt_errf(err, "out of memory");
        g->n_nodes = g->cap_nodes = (int)n;
        for (uint32_t i = 0; i < n; i++) {
            mt_node *x = &g->nodes[i];
            x->op = mt__gi32(r); x->queue = mt__gi32(r); x->phase = mt__gi32(r); x->layer = mt__gi32(r);
            x->n_in = mt__gi32(r); x->n_out = mt__gi32(r);
            for (int k = 0; k < MT_MAX_IN; k++) x->in[k] = mt__gi32(r);
            for (int k = 0; k < MT_MAX_OUT; k++) x->out[k] = mt__gi32(r);
            for (int k = 0; k < MT_MAX_ATTR; k++) x->iattr[k] = mt__gi32(r);
            x->sym_mask = mt__g32(r);
            for (int k = 0; k < 4; k++) x->fattr[k] = mt__gf32(r);
        }
        break;
    }
    case MT_SEC_CONSTS:
        g->consts_bytes = (int64_t)r->n;
        g->consts = (uint8_t *)MT_MALLOC(r->n ? r->n : 1);
        if (!g->consts) return mt_errf(err, "out of memory");
        memcpy(g->consts, r->p, r->n);
        r->at = r->n;
        break;
    case MT_SEC_TUNING: {
        mt_tuning_info *ti = &g->tuned_for;
        mt__gfix(r, ti->device, sizeof ti->device);
        ti->sm = mt__gi32(r); ti->n_sms = mt__gi32(r); ti->blas_version = mt__gi64(r);
        uint32_t n = mt__g32(r);
        if (r->bad) break;
        size_t len = strnlen(ti->device, sizeof ti->device);
        if (len == sizeof ti->device) return mt_errf(err, "tuning section: the device name is not terminated");
        for (size_t i = 0; i < len; i++)
            if (ti->device[i] < 32 || ti->device[i] > 126) return mt_errf(err, "tuning section: the device name is not printable");
        for (size_t i = len; i < sizeof ti->device; i++)
            if (ti->device[i]) return mt_errf(err, "tuning section: bytes after the device name");
        if (ti->sm < 0 || ti->sm > 10000 || ti->n_sms < 0 || ti->n_sms > 100000 || ti->blas_version < 0 || (!len && (ti->sm || ti->n_sms || n)))
            return mt_errf(err, "tuning section: bad device description (sm %d, %d SMs, %u entries)", ti->sm, ti->n_sms, n);
        size_t each = 8 * 4 + 8 * MT_ALGO_WORDS;
        if (n > (1u << 16) || (size_t)n * each > r->n - r->at) return mt_errf(err, "tuning section: count %u does not fit", n);
        g->tuning = (mt_tuning *)mt__calloc(sizeof(mt_tuning) * (n + 1));
        if (!g->tuning) return mt_errf(err, "out of memory");
        g->n_tuning = (int)n;
        for (uint32_t i = 0; i < n; i++) {
            mt_tuning *t = &g->tuning[i];
            t->ta = mt__gi32(r); t->tb = mt__gi32(r); t->mb = mt__gi32(r); t->n = mt__gi32(r); t->k = mt__gi32(r);
            t->at = mt__gi32(r); t->bt = mt__gi32(r); t->ct = mt__gi32(r);
            for (int w = 0; w < MT_ALGO_WORDS; w++) t->algo[w] = mt__g64(r);
            if ((t->ta | t->tb) & ~1 || t->mb < 1 || (t->mb & (t->mb - 1)) || t->n < 1 || t->k < 1 || t->at < 0 || t->at >= MT_NDTYPES ||
                t->bt < 0 || t->bt >= MT_NDTYPES || t->ct < 0 || t->ct >= MT_NDTYPES)
                return mt_errf(err, "tuning entry %u is invalid", i);
        }
        break;
    }
    case MT_SEC_PLAN: {
        g->persist_bytes = mt__gi64(r); g->arena_bytes = mt__gi64(r); g->naive_arena_bytes = mt__gi64(r);
        g->planned = mt__gi32(r); g->capture = mt__gi32(r);
        if (g->capture >= 0 && g->capture <= 3) { g->overlap = g->capture >> 1; g->capture &= 1; }
        uint32_t nio = mt__g32(r);
        if (!r->bad && nio != MT_NIO) return mt_errf(err, "plan section lists %u well-known values, expected %d", nio, MT_NIO);
        for (int i = 0; i < MT_NIO; i++) g->io[i] = mt__gi32(r);
        g->memory_budget = mt__gi64(r); g->peak_no_recompute = mt__gi64(r);
        uint32_t nr = mt__g32(r);
        if (r->bad) break;
        if (nr > 4096 || (size_t)nr * 12 > r->n - r->at) return mt_errf(err, "plan section: recompute count %u does not fit", nr);
        g->recompute = (mt_recompute *)mt__calloc(sizeof(mt_recompute) * (nr + 1));
        if (!g->recompute) return mt_errf(err, "out of memory");
        g->n_recompute = (int32_t)nr;
        for (uint32_t i = 0; i < nr; i++) { g->recompute[i].layer = mt__gi32(r); g->recompute[i].saved_bytes = mt__gi64(r); }
        break;
    }
    case MT_SEC_FINGERPRINT: {
        uint64_t fp = mt__g64(r);
        uint32_t tl = mt__g32(r);
        if (r->bad) break;
        if (tl >= 4096 || tl != r->n - r->at) return mt_errf(err, "fingerprint section: bad text length %u", tl);
        char text[4096];
        memcpy(text, r->p + r->at, tl);
        text[tl] = 0;
        r->at += tl;
        /* the graph is complete by now (fingerprint is the last section) */
        uint64_t mine = mt_fingerprint(g);
        if (fp != mine) {
            char here[4096];
            mt__fingerprint_text(g, here, sizeof here);
            return mt_errf(err, "fingerprint mismatch: the artifact was made for\n  %s\nbut this build, for the same contents, expects\n  %s\n"
                                "re-run precompile with this build", text, here);
        }
        break;
    }
    }
    if (r->bad) return mt_errf(err, "%s section is truncated", mt__sec_names[id]);
    if (r->at != r->n) return mt_errf(err, "%s section has %zu unexpected trailing bytes", mt__sec_names[id], r->n - r->at);
    return 0;
}

int mt_artifact_read(mt_graph *g, const uint8_t *p, size_t len, mt_err *err) {
    memset(g, 0, sizeof *g);
    mt_err e;
    if (len < MT__HDR_FIXED) return mt_errf(err, "not a moetrain artifact: %zu bytes is shorter than the header", len);
    if (memcmp(p, "MOETRAIN", 8)) return mt_errf(err, "not a moetrain artifact (bad magic)");
    mt__rd r = {p, len, 8, 0};
    uint32_t ver = mt__g32(&r), ns = mt__g32(&r);
    uint64_t fsize = mt__g64(&r);
    if (ver != MT_FORMAT_VERSION)
        return mt_errf(err, "artifact format version %u, this build reads version %u: re-run precompile with this build", ver, MT_FORMAT_VERSION);
    if (fsize != len)
        return mt_errf(err, "artifact is truncated or padded: its header says %llu bytes, the file has %zu", (unsigned long long)fsize, len);
    if (ns != MT_NSECTIONS) return mt_errf(err, "artifact has %u sections, this format has %d", ns, MT_NSECTIONS);
    size_t hdr = MT__HDR_FIXED + (size_t)MT__SEC_ENTRY * ns + 8;
    if (len < hdr) return mt_errf(err, "artifact is truncated inside its section table");
    mt__rd hr = {p, len, hdr - 8, 0};
    uint64_t want = mt__g64(&hr);
    if (mt_hash(p, hdr - 8, MT_HASH_INIT) != want) return mt_errf(err, "artifact header checksum mismatch (corrupt file)");
    uint64_t off[MT_NSECTIONS + 1], slen[MT_NSECTIONS + 1];
    size_t expect = hdr;
    for (uint32_t i = 0; i < ns; i++) {
        uint32_t id = mt__g32(&r), zero = mt__g32(&r);
        uint64_t o = mt__g64(&r), l = mt__g64(&r), sum = mt__g64(&r);
        if (id != i + 1 || zero) return mt_errf(err, "section table entry %u is malformed", i);
        if (o != expect || o > len || l > len - o) return mt_errf(err, "%s section lies outside the file", mt__sec_names[id]);
        if (mt_hash(p + o, (size_t)l, MT_HASH_INIT) != sum) return mt_errf(err, "%s section checksum mismatch (corrupt file)", mt__sec_names[id]);
        off[id] = o; slen[id] = l;
        expect = (size_t)(o + l);
    }
    if (expect != len) return mt_errf(err, "artifact has %zu bytes after its last section", len - expect);
    for (int id = 1; id <= MT_NSECTIONS; id++) {
        mt__rd sr = {p + off[id], (size_t)slen[id], 0, 0};
        if (mt__read_section(g, id, &sr, &e)) { mt_graph_free(g); return mt_errf(err, "%s", e.msg); }
    }
    if (mt__validate_graph(g, &e)) { mt_graph_free(g); return mt_errf(err, "invalid artifact: %s", e.msg); }
    return 0;
}

int mt_artifact_load(mt_graph *g, const char *path, mt_err *err) {
    uint8_t *bytes; size_t len;
    mt_err e;
    memset(g, 0, sizeof *g);
    if (mt_read_file(path, &bytes, &len, err)) return -1;
    int rc = mt_artifact_read(g, bytes, len, &e);
    MT_FREE(bytes);
    if (rc) return mt_errf(err, "%s: %s", path, e.msg);
    return 0;
}

static void mt__dims_str(const mt_graph *g, const mt_value *v, char *out, size_t n) {
    int at = 0;
    out[0] = 0;
    for (int d = 0; d < v->ndim && at >= 0 && (size_t)at < n; d++) {
        if (v->dims[d] >= 0) at += snprintf(out + at, n - (size_t)at, "%s%lld", d ? "," : "", (long long)v->dims[d]);
        else at += snprintf(out + at, n - (size_t)at, "%s%s", d ? "," : "", g->syms[-v->dims[d] - 1].name);
    }
}
static const char *mt__human(double bytes, char *buf) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int i = 0;
    while (bytes >= 1024 && i < 4) { bytes /= 1024; i++; }
    sprintf(buf, i ? "%.2f %s" : "%.0f %s", bytes, u[i]);
    return buf;
}

/* The graph for Graphviz: one box per node (colour = queue: compute grey, dp blue, ep orange; the
 * backward dashed), one edge per (producer, consumer) value, the node order as a left-to-right rank. */
int mt_graph_dot(const mt_graph *g, const char *path, mt_err *err) {
    FILE *f = fopen(path, "w");
    if (!f) return mt_errf(err, "cannot write '%s'", path);
    int *producer = (int *)MT_MALLOC(sizeof(int) * (size_t)(g->n_values + 1));
    if (!producer) { fclose(f); return mt_errf(err, "out of memory"); }
    for (int v = 0; v < g->n_values; v++) producer[v] = -1;
    static const char *const fill[MT_NQUEUES] = {"#e8e8e8", "#b9d7f5", "#f7c99a"};
    fprintf(f, "digraph moetrain {\n  rankdir=TB; node [shape=box, style=filled, fontname=Helvetica, fontsize=10];\n");
    fprintf(f, "  label=\"%d nodes, mesh", g->n_nodes);
    for (int d = 0; d < MT_NDIMS; d++) fprintf(f, " %s=%d", mt_dim_names[d], g->mesh.size[d]);
    fprintf(f, "\";\n");
    for (int i = 0; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        fprintf(f, "  n%d [label=\"n%d %s\\nL%d %s\", fillcolor=\"%s\"%s];\n", i, i, mt_ops[n->op].name, n->layer, mt_queue_names[n->queue],
                fill[n->queue], n->phase == MT_PHASE_BACKWARD ? ", style=\"filled,dashed\"" : n->phase == MT_PHASE_OPTIMIZER ? ", shape=ellipse" : "");
        for (int k = 0; k < n->n_in; k++) {
            int v = n->in[k];
            if (v >= 0 && producer[v] >= 0 && producer[v] != i)
                fprintf(f, "  n%d -> n%d [tooltip=\"%s\"];\n", producer[v], i, g->values[v].name);
        }
        for (int k = 0; k < n->n_out; k++) if (n->out[k] >= 0) producer[n->out[k]] = i;
    }
    fprintf(f, "}\n");
    MT_FREE(producer);
    if (fclose(f)) return mt_errf(err, "writing '%s' failed", path);
    return 0;
}

/* --dump: every value with its role, dtype, shape, place in its region and live range. */
static void mt__dump_values(const mt_graph *g, FILE *f) {
    char dims[160];
    int32_t *first = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(g->n_values + 1));
    int32_t *last = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(g->n_values + 1));
    if (first && last) mt__live_ranges(g, first, last);
    fprintf(f, "\n== values (%d)\n  %-5s %-52s %-7s %-4s %-22s %12s %10s  %s\n", g->n_values, "id", "name", "role", "type", "shape", "offset", "bytes", "live");
    for (int i = 0; i < g->n_values; i++) {
        const mt_value *v = &g->values[i];
        mt__dims_str(g, v, dims, sizeof dims);
        fprintf(f, "  v%-4d %-52s %-7s %-4s [%-20s] %12lld %10lld", i, v->name, mt__role_names[v->role], mt__dtype_names[v->dtype],
                dims, (long long)v->offset, (long long)v->nbytes);
        if (first && last && first[i] >= 0) fprintf(f, "  %d..%d", first[i], last[i]);
        if (v->shard) {
            char mn[64];
            mt_mesh_mask_name(v->shard, mn, sizeof mn);
            fprintf(f, "  %s over %s", (v->flags & MT_VF_GATHERED) ? "gathered" : "shard", mn);
        }
        if ((v->flags & MT_VF_TP) && g->mesh.size[MT_DIM_TP] > 1)
            fprintf(f, "  tp part: 1/%d of its %s", g->mesh.size[MT_DIM_TP], (v->flags & MT_VF_TP_ROWS) ? "rows" : "columns");
        fprintf(f, "\n");
    }
    MT_FREE(first); MT_FREE(last);
}
/* --dump: the nodes in order, and with g->overlap the schedule of the streams. */
static void mt__dump_nodes(const mt_graph *g, FILE *f) {
    static const char *const phase[] = {"fwd", "bwd", "opt", "rc"};
    mt_schedule sc;
    mt_err se;
    int have_sc = g->overlap && mt_schedule_build(g, &sc, &se) == 0;
    fprintf(f, "\n== nodes (%d: %d forward)%s\n", g->n_nodes, g->n_forward_nodes,
            have_sc ? "; 'wait' lists the nodes on other streams this one waits for (events)" : "");
    for (int i = 0; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        fprintf(f, "  n%-5d %-3s %-7s L%-3d %-18s", i, phase[n->phase], mt_queue_names[n->queue], n->layer, mt_ops[n->op].name);
        for (int k = 0; k < n->n_in; k++) fprintf(f, "%s%s", k ? ", " : " ", n->in[k] >= 0 ? g->values[n->in[k]].name : "-");
        fprintf(f, " ->");
        for (int k = 0; k < n->n_out; k++) fprintf(f, "%s%s", k ? ", " : " ", n->out[k] >= 0 ? g->values[n->out[k]].name : "-");
        int na = 0;
        for (int k = 0; k < MT_MAX_ATTR; k++)
            if ((n->iattr[k] && !(k == MT_IATTR_FP8 && mt_node_fp8(n))) || (n->sym_mask >> k & 1)) na = k + 1;
        if (na) {
            fprintf(f, "  [");
            for (int k = 0; k < na; k++) {
                if (n->sym_mask >> k & 1) fprintf(f, "%s%s", k ? " " : "", g->syms[n->iattr[k]].name);
                else fprintf(f, "%s%d", k ? " " : "", n->iattr[k]);
            }
            fprintf(f, "]");
        }
        if (n->fattr[0] != 0) fprintf(f, " f=%g", (double)n->fattr[0]);
        if (mt_node_fp8(n)) fprintf(f, " fp8");
        if (have_sc && sc.queue[i] != n->queue) fprintf(f, "  (runs on %s)", mt_queue_names[sc.queue[i]]);
        for (int k = have_sc ? sc.wait_at[i] : 0; have_sc && k < sc.wait_at[i + 1]; k++)
            fprintf(f, "%sn%d", k == sc.wait_at[i] ? "  wait " : ",", sc.wait[k]);
        fprintf(f, "\n");
    }
    if (have_sc) {   /* where each collective on a stream of its own starts, and where the compute stream joins it */
        int ns = 0, pre = 0, joins = 0;
        fprintf(f, "\n== overlap schedule (streams: compute, dp and ep at high priority; events between them)\n");
        for (int i = 0; i < g->n_nodes; i++) {
            if (sc.queue[i] == MT_Q_COMPUTE) {
                for (int k = sc.wait_at[i]; k < sc.wait_at[i + 1]; k++) joins++;
                continue;
            }
            const mt_node *n = &g->nodes[i];
            int nx = i + 1;
            while (nx < g->n_nodes && sc.queue[nx] != MT_Q_COMPUTE) nx++;
            int fetch = n->op == MT_OP_ALLGATHER && nx < g->n_nodes && g->nodes[nx].layer != n->layer;
            ns++; pre += fetch;
            fprintf(f, "  n%-5d %-14s %-3s %s L%-3d may start after n%d, compute joins at ", i, mt_ops[n->op].name,
                    mt_queue_names[sc.queue[i]], phase[n->phase], n->layer, sc.after[i]);
            if (sc.done[i] < g->n_nodes) fprintf(f, "n%d (%s L%d)", sc.done[i], mt_ops[g->nodes[sc.done[i]].op].name, g->nodes[sc.done[i]].layer);
            else fprintf(f, "the end of the step");
            if (fetch) fprintf(f, "  prefetch: issued during L%d", g->nodes[nx].layer);
            fprintf(f, "\n");
        }
        fprintf(f, "  %d collectives on their own streams (%d prefetched a stage early); %d waits of the compute stream on them\n",
                ns, pre, joins);
        mt_schedule_free(&sc);
    } else if (g->overlap) {
        fprintf(f, "\n== overlap schedule: %s\n", se.msg);
    } else {
        fprintf(f, "\n== overlap schedule: off (every node runs on the compute stream, in list order)\n");
    }
}
/* --dump: the collectives, and the communicator groups they resolve to at bind. */
static void mt__dump_groups(const mt_graph *g, FILE *f) {
    fprintf(f, "\n== collectives (communicators are resolved per rank at bind time)\n");
    for (int i = 0; i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        if (n->queue == MT_Q_COMPUTE) continue;
        fprintf(f, "  n%-5d %-14s queue=%-3s channel=%d over", i, mt_ops[n->op].name, mt_queue_names[n->queue], n->iattr[1]);
        for (int d = 0; d < MT_NDIMS; d++) if ((uint32_t)n->iattr[0] >> d & 1) fprintf(f, " %s(%d)", mt_dim_names[d], g->mesh.size[d]);
        fprintf(f, "  %s\n", n->in[0] >= 0 ? g->values[n->in[0]].name : "");
    }
    /* every (mesh mask, channel) the nodes name, the groups it splits the world into, and which
     * communicator serves it: the same ranks in the same order on the same channel share one */
    int world = mt_mesh_world(&g->mesh);
    fprintf(f, "\n== communicator groups (world %d; ranks in mesh order; channel 0 shared, 1 the isolated expert exchange)\n", world);
    int *mem = (int *)MT_MALLOC(sizeof(int) * (size_t)(world + 1));
    uint8_t *seen = (uint8_t *)mt__calloc((size_t)world + 1);
    uint32_t own_mask[64];
    int own_id[64], n_own = 1;
    own_mask[0] = MT__WORLD_MASK; own_id[0] = 0;   /* the world's communicator comes first */
    for (int i = 0; mem && seen && i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        if (!mt__is_collective(n->op)) continue;
        int dup = 0, uses = 0;
        for (int j = 0; j < i && !dup; j++)
            dup = mt__is_collective(g->nodes[j].op) && g->nodes[j].iattr[0] == n->iattr[0] && g->nodes[j].iattr[1] == n->iattr[1];
        if (dup) continue;
        for (int j = i; j < g->n_nodes; j++)
            uses += mt__is_collective(g->nodes[j].op) && g->nodes[j].iattr[0] == n->iattr[0] && g->nodes[j].iattr[1] == n->iattr[1];
        char mn[64], share[96] = "";
        mt_mesh_mask_name((uint32_t)n->iattr[0], mn, sizeof mn);
        int size = mt_mesh_group_size(&g->mesh, (uint32_t)n->iattr[0]), owner = -1;
        for (int k = 0; k < n_own && owner < 0; k++)
            if (own_id[k] == n->iattr[1] && mt_mesh_groups_equal(&g->mesh, own_mask[k], (uint32_t)n->iattr[0])) owner = k;
        if (size == 1) snprintf(share, sizeof share, "  (identity: no communicator)");
        else if (owner >= 0 && own_mask[owner] != (uint32_t)n->iattr[0]) {
            char on[64];
            mt_mesh_mask_name(own_mask[owner], on, sizeof on);
            snprintf(share, sizeof share, "  (shares the %s communicator)", owner == 0 ? "world" : on);
        } else if (owner < 0 && n_own < 64) {
            own_mask[n_own] = (uint32_t)n->iattr[0]; own_id[n_own++] = n->iattr[1];
            snprintf(share, sizeof share, "  (own communicator%s)", n->iattr[1] == MT_CHANNEL_EP ? ", isolated expert exchange" : "");
        }
        fprintf(f, "  %-22s ch %d  %d rank%s per group, %d node%s:", mn, n->iattr[1], size, size == 1 ? "" : "s", uses, uses == 1 ? "" : "s");
        memset(seen, 0, (size_t)world);
        for (int r = 0; r < world; r++) {
            if (seen[r]) continue;
            mt_mesh_group(&g->mesh, (uint32_t)n->iattr[0], r, mem);
            fprintf(f, " {");
            for (int k = 0; k < size; k++) { fprintf(f, "%s%d", k ? "," : "", mem[k]); seen[mem[k]] = 1; }
            fprintf(f, "}");
        }
        fprintf(f, "%s\n", share);
    }
    if (world > 1) fprintf(f, "  communicators per rank: %d (the world's included)\n", n_own);
    MT_FREE(mem); MT_FREE(seen);
}
/* --dump: the memory plan, the tuning, the recompute choice and how the step executes. */
static void mt__dump_plan(const mt_graph *g, FILE *f) {
    char b1[32], b2[32], b3[32];
    fprintf(f, "\n== memory plan (%s)\n", g->planned ? "liveness-planned arena" : "naive: every value its own bytes");
    fprintf(f, "  persistent %s, arena %s (naive %s, %.1f%% saved)\n", mt__human((double)g->persist_bytes, b1),
            mt__human((double)g->arena_bytes, b2), mt__human((double)g->naive_arena_bytes, b3),
            g->naive_arena_bytes ? 100.0 * (1.0 - (double)g->arena_bytes / (double)g->naive_arena_bytes) : 0.0);
    int64_t opt = 0;
    for (int i = 0; i < g->n_values; i++) opt += g->values[i].role == MT_ROLE_OPT ? g->values[i].nbytes : 0;
    if (opt) fprintf(f, "  of the persistent: AdamW moments %s (%s)\n", mt__human((double)opt, b1), mt__dtype_names[mt_graph_moments(g)]);
    fprintf(f, "  constants %lld bytes (device-free: materialized on each rank's own device at bind)\n", (long long)g->consts_bytes);
    if (!g->tuned_for.device[0])
        fprintf(f, "\n== tuning: none (%s)\n", g->target.backend == MT_BACKEND_CUDA ? "each rank chooses its GEMM algorithms at bind" : "the CPU backend has nothing to tune");
    else {
        fprintf(f, "\n== tuning: %d GEMM choices for %s (sm %d.%d, %d SMs, cuBLASLt %lld); loading ranks use these\n", g->n_tuning,
                g->tuned_for.device, g->tuned_for.sm / 10, g->tuned_for.sm % 10, g->tuned_for.n_sms, (long long)g->tuned_for.blas_version);
        static const char *const dt[MT_NDTYPES] = {"f32", "bf16", "i32"};
        for (int i = 0; i < g->n_tuning; i++) {
            const mt_tuning *t = &g->tuning[i];
            fprintf(f, "  gemm %c%c %s x %s -> %s  M<=%-7d N=%-6d K=%-6d algo %016llx%016llx\n", t->ta ? 'T' : 'N', t->tb ? 'T' : 'N',
                    dt[t->at], dt[t->bt], dt[t->ct], t->mb, t->n, t->k, (unsigned long long)t->algo[0], (unsigned long long)t->algo[1]);
        }
    }
    fprintf(f, "  planned peak %s (persistent + arena)", mt__human((double)mt_graph_peak_bytes(g), b1));
    if (g->memory_budget) fprintf(f, ", budget %s; without recompute %s", mt__human((double)g->memory_budget, b2),
                                  mt__human((double)g->peak_no_recompute, b3));
    fprintf(f, "\n");
    fprintf(f, "\n== recompute (%d of %d blocks keep only their input; their activations re-run before their backward)\n",
            g->n_recompute, g->cfg.n_layers);
    int64_t saved_all = 0;
    for (int i = 0; i < g->n_recompute; i++) {
        int nodes = 0;
        for (int k = 0; k < g->n_nodes; k++) nodes += g->nodes[k].phase == MT_PHASE_RECOMPUTE && g->nodes[k].layer == g->recompute[i].layer;
        saved_all += g->recompute[i].saved_bytes;
        fprintf(f, "  L%-3d %-9s %4d nodes re-run, %s of activations not held from forward to backward\n", g->recompute[i].layer,
                mt_config_is_moe_layer(&g->cfg, g->recompute[i].layer) ? "(MoE)" : "(dense)", nodes,
                mt__human((double)g->recompute[i].saved_bytes, b1));
    }
    if (g->n_recompute) fprintf(f, "  total %s not held; planned peak %s -> %s\n", mt__human((double)saved_all, b1),
                                mt__human((double)g->peak_no_recompute, b2), mt__human((double)mt_graph_peak_bytes(g), b3));
    else fprintf(f, "  none%s\n", g->memory_budget ? ": the plan fits the budget as it is" : "");
    int regions = 0, syncs = 0, eager = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        syncs += mt_node_syncs_host(&g->nodes[i]) && g->nodes[i].op == MT_OP_EP_COUNTS;
        if (!mt_node_capturable(g, &g->nodes[i])) { eager++; continue; }
        if (i == 0 || !mt_node_capturable(g, &g->nodes[i - 1])) regions++;
    }
    fprintf(f, "\n== execution\n  %d host synchronizations per step (expert counts); %d nodes run eagerly (collectives over "
               "several ranks, data-dependent sizes); %d regions between them%s\n", syncs, eager, regions,
            g->capture ? ", each replayed as a CUDA graph" : "; no graph capture");
}
void mt_graph_dump(const mt_graph *g, FILE *f) {
    fprintf(f, "moetrain step graph (format %u, %s)\n", MT_FORMAT_VERSION, g->kind == MT_GRAPH_TRAIN ? "train" : "forward");
    fprintf(f, "fingerprint %016llx  target %s %s (real %d bytes)\n", (unsigned long long)mt_fingerprint(g),
            g->target.backend == MT_BACKEND_CUDA ? "cuda" : "cpu", g->target.arch, (int)g->target.real_bytes);
    fprintf(f, "\n== config\n");
    for (int i = 0; i < mt_n_config_fields; i++) {
        const mt_field *fl = &mt_config_fields[i];
        const void *p = (const char *)&g->cfg + fl->offset;
        if (!strcmp(fl->name, "score_func")) fprintf(f, "  %-20s %s\n", fl->name, *(const int *)p ? "sigmoid" : "softmax");
        else if (fl->type == MT_FIELD_INT) fprintf(f, "  %-20s %d\n", fl->name, *(const int *)p);
        else fprintf(f, "  %-20s %g\n", fl->name, (double)*(const float *)p);
    }
    fprintf(f, "\n== mesh\n  ");
    for (int d = 0; d < MT_NDIMS; d++) fprintf(f, "%s=%d%s", mt_dim_names[d], g->mesh.size[d], d + 1 < MT_NDIMS ? "  " : "\n");
    fprintf(f, "\n== symbols (bound at load/run time)\n");
    for (int i = 0; i < g->n_syms; i++)
        fprintf(f, "  s%-3d %-20s %-6s %s max=%lld\n", i, g->syms[i].name, g->syms[i].kind == MT_SYM_COORD ? "coord" : "size",
                mt_dim_names[g->syms[i].mesh_dim], (long long)g->syms[i].max);
    mt__dump_values(g, f);
    mt__dump_nodes(g, f);
    mt__dump_groups(g, f);
    mt__dump_plan(g, f);
}

/* ========================================================================
 * 8. CPU reference ops
 * The specification the CUDA kernels are tested against. Plain loops; the
 * only cleverness is splitting independent rows over the thread pool.
 * Reductions run in a fixed order, so results are bitwise reproducible.
 * ====================================================================== */

/* --- embedding --- */
void mt_cpu_embed_forward(mt_real *x, const int32_t *tok, const mt_real *wte, int N, int D) {
    for (int n = 0; n < N; n++) memcpy(x + (int64_t)n * D, wte + (int64_t)tok[n] * D, sizeof(mt_real) * (size_t)D);
}
void mt_cpu_embed_forward_range(mt_real *x, const int32_t *tok, const mt_real *wte, int N, int D, int64_t lo, int64_t len) {
    for (int n = 0; n < N; n++) {
        int64_t r0 = (int64_t)tok[n] * D;
        mt_real *y = x + (int64_t)n * D;
        for (int64_t d = 0; d < D; d++) y[d] = r0 + d >= lo && r0 + d < lo + len ? wte[r0 + d - lo] : (mt_real)-0.0;
    }
}
void mt_cpu_embed_backward(mt_real *dwte, const mt_real *dx, const int32_t *tok, int N, int V, int D) {
    mt_cpu_embed_backward_range(dwte, dx, tok, N, D, 0, (int64_t)V * D);
}
void mt_cpu_embed_backward_range(mt_real *dw, const mt_real *dx, const int32_t *tok, int N, int D, int64_t lo, int64_t len) {
    memset(dw, 0, sizeof(mt_real) * (size_t)len);
    for (int n = 0; n < N; n++) {               /* token order: deterministic */
        int64_t r0 = (int64_t)tok[n] * D, d0 = lo > r0 ? lo - r0 : 0, d1 = lo + len - r0 < D ? lo + len - r0 : D;
        const mt_real *g = dx + (int64_t)n * D;
        for (int64_t d = d0; d < d1; d++) dw[r0 + d - lo] += g[d];
    }
}

/* --- RMSNorm: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps) --- */
void mt_cpu_rmsnorm_forward(mt_real *y, mt_real *rstd, const mt_real *x, const mt_real *w, int N, int D,
                            float eps) {
    for (int n = 0; n < N; n++) {
        const mt_real *xr = x + (int64_t)n * D;
        double ss = 0;
        for (int d = 0; d < D; d++) ss += (double)xr[d] * xr[d];
        mt_real r = (mt_real)(1.0 / sqrt(ss / D + eps));
        rstd[n] = r;
        for (int d = 0; d < D; d++) y[(int64_t)n * D + d] = xr[d] * r * w[d];
    }
}
/* dx = rstd * (w*dy) - rstd^3/D * x * sum(w*dy*x);  dw = sum_n dy * x * rstd */
void mt_cpu_rmsnorm_backward(mt_real *dx, mt_real *dw, const mt_real *dy, const mt_real *x, const mt_real *w,
                             const mt_real *rstd, int N, int D) {
    memset(dw, 0, sizeof(mt_real) * (size_t)D);
    for (int n = 0; n < N; n++) {
        const mt_real *xr = x + (int64_t)n * D, *g = dy + (int64_t)n * D;
        double r = rstd[n], dot = 0;
        for (int d = 0; d < D; d++) dot += (double)w[d] * g[d] * xr[d];
        double c = r * r * r * dot / D;
        for (int d = 0; d < D; d++) {
            dx[(int64_t)n * D + d] = (mt_real)(r * w[d] * g[d] - c * xr[d]);
            dw[d] += (mt_real)(g[d] * xr[d] * r);
        }
    }
}

/* --- matmul: C[M,Nn] = op(A)[M,K] op(B)[K,Nn], row-major, op = transpose if flag --- */
typedef struct { mt_real *C; const mt_real *A, *B; int M, Nn, K, ta, tb; } mt__mm;

static mt_real mt__dot(const mt_real *a, const mt_real *b, int K) {
    mt_real acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int k = 0;
    for (; k + 8 <= K; k += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[k + l] * b[k + l];
    mt_real tail = 0;
    for (; k < K; k++) tail += a[k] * b[k];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}
static void mt__mm_rows(void *ctx, int64_t i0, int64_t i1) {
    const mt__mm *m = (const mt__mm *)ctx;
    int Nn = m->Nn, K = m->K, M = m->M;
    for (int64_t i = i0; i < i1; i++) {
        mt_real *c = m->C + i * Nn;
        if (!m->ta && m->tb) {                  /* C[i,j] = A[i,:] . B[j,:]   (x W^T) */
            for (int j = 0; j < Nn; j++) c[j] = mt__dot(m->A + i * K, m->B + (int64_t)j * K, K);
        } else if (!m->tb) {                    /* C[i,:] = sum_k opA[i,k] B[k,:] */
            for (int j = 0; j < Nn; j++) c[j] = 0;
            for (int k = 0; k < K; k++) {
                mt_real a = m->ta ? m->A[(int64_t)k * M + i] : m->A[i * K + k];
                const mt_real *b = m->B + (int64_t)k * Nn;
                for (int j = 0; j < Nn; j++) c[j] += a * b[j];
            }
        } else {                                /* C[i,j] = sum_k A[k,i] B[j,k] */
            for (int j = 0; j < Nn; j++) {
                mt_real s = 0;
                for (int k = 0; k < K; k++) s += m->A[(int64_t)k * M + i] * m->B[(int64_t)j * K + k];
                c[j] = s;
            }
        }
    }
}
void mt_cpu_matmul(mt_pool *pool, mt_real *C, const mt_real *A, const mt_real *B, int M, int Nn, int K,
                   int ta, int tb) {
    mt__mm m = {C, A, B, M, Nn, K, ta, tb};
    mt_pool_for(pool, M, mt__mm_rows, &m);
}

/* --- split / concat along columns --- */
void mt_cpu_split(mt_real *x1, mt_real *x2, const mt_real *x, int N, int a, int b) {
    for (int n = 0; n < N; n++) {
        memcpy(x1 + (int64_t)n * a, x + (int64_t)n * (a + b), sizeof(mt_real) * (size_t)a);
        memcpy(x2 + (int64_t)n * b, x + (int64_t)n * (a + b) + a, sizeof(mt_real) * (size_t)b);
    }
}
void mt_cpu_concat(mt_real *x, const mt_real *x1, const mt_real *x2, int N, int a, int b) {
    for (int n = 0; n < N; n++) {
        mt_real *row = x + (int64_t)n * (a + b);
        if (x1) memcpy(row, x1 + (int64_t)n * a, sizeof(mt_real) * (size_t)a);
        else memset(row, 0, sizeof(mt_real) * (size_t)a);
        if (x2) memcpy(row + a, x2 + (int64_t)n * b, sizeof(mt_real) * (size_t)b);
        else memset(row + a, 0, sizeof(mt_real) * (size_t)b);
    }
}

/* --- RoPE (optionally YaRN) ---
 * Pairs (x[2i], x[2i+1]) of the rotary part rotate by angle t*freq_i, the
 * complex-multiplication convention of the original DeepSeek code. With YaRN
 * (rope_factor > 1) the low frequencies are divided by the factor, blended
 * by a linear ramp between the correction dims of beta_fast and beta_slow. */
static double mt__yarn_dim(double rotations, int dim, double base, int orig_len) {
    return dim * log(orig_len / (rotations * 2 * 3.141592653589793)) / (2 * log(base));
}
void mt_cpu_rope_tables(mt_real *cosv, mt_real *sinv, const mt_config *c) {
    int dr = c->qk_rope_head_dim, half = dr / 2;
    double base = c->rope_theta;
    double lo = 0, hi = 0;
    int yarn = mt_config_yarn(c);
    if (yarn) {
        lo = floor(mt__yarn_dim(c->beta_fast, dr, base, c->original_seq_len));
        hi = ceil(mt__yarn_dim(c->beta_slow, dr, base, c->original_seq_len));
        if (lo < 0) lo = 0;
        if (hi > dr - 1) hi = dr - 1;
        if (lo == hi) hi += 0.001;
    }
    for (int i = 0; i < half; i++) {
        double f = pow(base, -2.0 * i / dr);
        if (yarn) {
            double ramp = (i - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double smooth = 1 - ramp;
            f = f / c->rope_factor * (1 - smooth) + f * smooth;
        }
        for (int t = 0; t < c->seq_len; t++) {
            cosv[(int64_t)t * half + i] = (mt_real)cos(t * f);
            sinv[(int64_t)t * half + i] = (mt_real)sin(t * f);
        }
    }
}
/* softmax scale: 1/sqrt(qk head dim), times mscale^2 under YaRN */
double mt_attention_scale(const mt_config *c) {
    double s = 1.0 / sqrt((double)(c->qk_nope_head_dim + c->qk_rope_head_dim));
    if (mt_config_yarn(c)) {
        double m = 0.1 * c->mscale * log(c->rope_factor) + 1.0;
        s *= m * m;
    }
    return s;
}

/* --- MLA assembly: per head, Q = [q_nope, rope(q_pe)], K = [k_nope, rope(k_pe)]
 *     with k_pe shared by all heads, V = v. q [N,H*(dn+dr)], kv [N,H*(dn+dv)],
 *     kpe [N,dr]; token n sits at position n % T. --- */
static void mt__rotate(mt_real *out, const mt_real *in, const mt_real *c, const mt_real *s, int half, int inverse) {
    for (int i = 0; i < half; i++) {
        mt_real x0 = in[2 * i], x1 = in[2 * i + 1], sn = inverse ? -s[i] : s[i];
        out[2 * i] = x0 * c[i] - x1 * sn;
        out[2 * i + 1] = x0 * sn + x1 * c[i];
    }
}
void mt_cpu_mla_rope_forward(mt_real *Q, mt_real *K, mt_real *Vv, const mt_real *q, const mt_real *kv,
                             const mt_real *kpe, const mt_real *cosv, const mt_real *sinv, int N, int T, int H,
                             int dn, int dr, int dv) {
    int dq = dn + dr, half = dr / 2;
    for (int n = 0; n < N; n++) {
        const mt_real *c = cosv + (int64_t)(n % T) * half, *s = sinv + (int64_t)(n % T) * half;
        mt_real kr[1024];
        mt__rotate(kr, kpe + (int64_t)n * dr, c, s, half, 0);
        for (int h = 0; h < H; h++) {
            const mt_real *qh = q + ((int64_t)n * H + h) * dq, *kvh = kv + ((int64_t)n * H + h) * (dn + dv);
            mt_real *Qh = Q + ((int64_t)n * H + h) * dq, *Kh = K + ((int64_t)n * H + h) * dq;
            memcpy(Qh, qh, sizeof(mt_real) * (size_t)dn);
            mt__rotate(Qh + dn, qh + dn, c, s, half, 0);
            memcpy(Kh, kvh, sizeof(mt_real) * (size_t)dn);
            memcpy(Kh + dn, kr, sizeof(mt_real) * (size_t)dr);
            memcpy(Vv + ((int64_t)n * H + h) * dv, kvh + dn, sizeof(mt_real) * (size_t)dv);
        }
    }
}
void mt_cpu_mla_rope_backward(mt_real *dq, mt_real *dkv, mt_real *dkpe, const mt_real *dQ, const mt_real *dK,
                              const mt_real *dV, const mt_real *cosv, const mt_real *sinv, int N, int T, int H,
                              int dn, int dr, int dv) {
    int dq_ = dn + dr, half = dr / 2;
    for (int n = 0; n < N; n++) {
        const mt_real *c = cosv + (int64_t)(n % T) * half, *s = sinv + (int64_t)(n % T) * half;
        mt_real acc[1024], tmp[1024];
        for (int i = 0; i < dr; i++) acc[i] = 0;
        for (int h = 0; h < H; h++) {
            const mt_real *dQh = dQ + ((int64_t)n * H + h) * dq_, *dKh = dK + ((int64_t)n * H + h) * dq_;
            mt_real *dqh = dq + ((int64_t)n * H + h) * dq_, *dkvh = dkv + ((int64_t)n * H + h) * (dn + dv);
            memcpy(dqh, dQh, sizeof(mt_real) * (size_t)dn);
            mt__rotate(dqh + dn, dQh + dn, c, s, half, 1);     /* the rotation's transpose */
            memcpy(dkvh, dKh, sizeof(mt_real) * (size_t)dn);
            memcpy(dkvh + dn, dV + ((int64_t)n * H + h) * dv, sizeof(mt_real) * (size_t)dv);
            mt__rotate(tmp, dKh + dn, c, s, half, 1);
            for (int i = 0; i < dr; i++) acc[i] += tmp[i];       /* k_pe is shared: sum heads */
        }
        memcpy(dkpe + (int64_t)n * dr, acc, sizeof(mt_real) * (size_t)dr);
    }
}

/* --- RoPE folded into attention (see mt_pass_fold_rope): the same arithmetic as the two ops above,
 *     with Q, K, V (and their gradients) formed only inside the attention op, here in temporaries --- */
void mt_cpu_rope_pe_forward(mt_real *qr, mt_real *kr, const mt_real *q, const mt_real *kpe, const mt_real *cosv,
                            const mt_real *sinv, int N, int T, int H, int dn, int dr) {
    int half = dr / 2;
    for (int n = 0; n < N; n++) {
        const mt_real *c = cosv + (int64_t)(n % T) * half, *s = sinv + (int64_t)(n % T) * half;
        mt__rotate(kr + (int64_t)n * dr, kpe + (int64_t)n * dr, c, s, half, 0);
        for (int h = 0; h < H; h++)
            mt__rotate(qr + ((int64_t)n * H + h) * dr, q + ((int64_t)n * H + h) * (dn + dr) + dn, c, s, half, 0);
    }
}
void mt_cpu_rope_pe_backward(mt_real *dkpe, const mt_real *dkr, const mt_real *cosv, const mt_real *sinv,
                             int N, int T, int H, int dr) {
    int half = dr / 2;
    for (int n = 0; n < N; n++) {
        const mt_real *c = cosv + (int64_t)(n % T) * half, *s = sinv + (int64_t)(n % T) * half;
        mt_real acc[1024], tmp[1024];
        for (int i = 0; i < dr; i++) acc[i] = 0;
        for (int h = 0; h < H; h++) {
            mt__rotate(tmp, dkr + ((int64_t)n * H + h) * dr, c, s, half, 1);
            for (int i = 0; i < dr; i++) acc[i] += tmp[i];   /* in head order, as mt_cpu_mla_rope_backward */
        }
        memcpy(dkpe + (int64_t)n * dr, acc, sizeof(mt_real) * (size_t)dr);
    }
}
/* Q, K, V of MLA_ROPE from q, kv and the rotated parts [N*H, dq], [N*H, dq], [N*H, dv] */
static void mt__mla_assemble(mt_real *Q, mt_real *K, mt_real *Vv, const mt_real *q, const mt_real *kv, const mt_real *qr,
                             const mt_real *kr, int64_t N, int H, int dn, int dr, int dv) {
    int dq = dn + dr;
    for (int64_t n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            int64_t r = n * H + h;
            const mt_real *kvh = kv + r * (dn + dv);
            memcpy(Q + r * dq, q + r * dq, sizeof(mt_real) * (size_t)dn);
            memcpy(Q + r * dq + dn, qr + r * dr, sizeof(mt_real) * (size_t)dr);
            memcpy(K + r * dq, kvh, sizeof(mt_real) * (size_t)dn);
            memcpy(K + r * dq + dn, kr + n * dr, sizeof(mt_real) * (size_t)dr);
            memcpy(Vv + r * dv, kvh + dn, sizeof(mt_real) * (size_t)dv);
        }
}
int mt_cpu_mla_attention_forward(mt_pool *pool, mt_real *O, mt_real *lse, const mt_real *q, const mt_real *kv,
                                 const mt_real *qr, const mt_real *kr, const int32_t *dstart, int B, int T, int H,
                                 int dn, int dr, int dv, float scale) {
    int64_t N = (int64_t)B * T, nq = N * H * (dn + dr), nv = N * H * dv;
    mt_real *Q = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)(2 * nq + nv + 1));
    if (!Q) return -1;
    mt_real *K = Q + nq, *Vv = K + nq;
    mt__mla_assemble(Q, K, Vv, q, kv, qr, kr, N, H, dn, dr, dv);
    mt_cpu_attention_forward(pool, O, lse, Q, K, Vv, dstart, B, T, H, dn + dr, dv, scale);
    MT_FREE(Q);
    return 0;
}
int mt_cpu_mla_attention_backward(mt_pool *pool, mt_real *dq, mt_real *dkv, mt_real *dkr, const mt_real *q,
                                  const mt_real *kv, const mt_real *qr, const mt_real *kr, const mt_real *O,
                                  const mt_real *lse, const mt_real *dO, const int32_t *dstart, const mt_real *cosv,
                                  const mt_real *sinv, int B, int T, int H, int dn, int dr, int dv, float scale) {
    int64_t N = (int64_t)B * T, nq = N * H * (dn + dr), nv = N * H * dv;
    int dq_ = dn + dr, half = dr / 2;
    mt_real *Q = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)(4 * nq + 2 * nv + 1));
    if (!Q) return -1;
    mt_real *K = Q + nq, *Vv = K + nq, *dQ = Vv + nv, *dK = dQ + nq, *dV = dK + nq;
    mt__mla_assemble(Q, K, Vv, q, kv, qr, kr, N, H, dn, dr, dv);
    mt_cpu_attention_backward(pool, dQ, dK, dV, Q, K, Vv, O, lse, dO, dstart, B, T, H, dq_, dv, scale);
    for (int64_t n = 0; n < N; n++) {   /* as mt_cpu_mla_rope_backward, but k_pe's part per head */
        const mt_real *c = cosv + (int64_t)(n % T) * half, *s = sinv + (int64_t)(n % T) * half;
        for (int h = 0; h < H; h++) {
            int64_t r = n * H + h;
            memcpy(dq + r * dq_, dQ + r * dq_, sizeof(mt_real) * (size_t)dn);
            mt__rotate(dq + r * dq_ + dn, dQ + r * dq_ + dn, c, s, half, 1);
            memcpy(dkv + r * (dn + dv), dK + r * dq_, sizeof(mt_real) * (size_t)dn);
            memcpy(dkv + r * (dn + dv) + dn, dV + r * dv, sizeof(mt_real) * (size_t)dv);
            memcpy(dkr + r * dr, dK + r * dq_ + dn, sizeof(mt_real) * (size_t)dr);
        }
    }
    MT_FREE(Q);
    return 0;
}

/* --- token shift for multi-token prediction: within each sequence of T, k ahead; fill past its end --- */
void mt_cpu_shift_tokens(int32_t *y, const int32_t *x, int N, int T, int k, int fill) {
    for (int s0 = 0; s0 < N; s0 += T)
        for (int t = 0; t < T; t++) y[s0 + t] = t + k < T ? x[s0 + t + k] : fill;
}

/* --- document starts: tokens [N] -> dstart [N], per sequence of T tokens --- */
void mt_cpu_doc_starts(int32_t *dstart, const int32_t *tok, int N, int T, int eot) {
    for (int s0 = 0; s0 < N; s0 += T) {
        int32_t start = 0;
        for (int t = 0; t < T; t++) {
            dstart[s0 + t] = start;
            if (tok[s0 + t] == eot) start = t + 1;   /* the next token opens a document */
        }
    }
}

/* --- causal attention, one (batch, head) pair per task; never stores T x T ---
 * Q,K [N, H*dq], V,O [N, H*dv], lse [N, H] (log-sum-exp of the scaled scores).
 * Query i sees keys lo(i)..i: lo = dstart[i] with document masking, else 0. */
typedef struct {
    mt_real *O, *lse, *dQ, *dK, *dV;
    const mt_real *Q, *K, *V, *Oc, *lsec, *dO;
    const int32_t *ds;
    int B, T, H, dq, dv;
    float scale;
} mt__attn;
static int mt__attn_lo(const mt__attn *a, int b, int i) {
    if (!a->ds) return 0;
    int lo = a->ds[(int64_t)b * a->T + i];
    return lo < 0 ? 0 : lo > i ? i : lo;
}
static void mt__attn_fwd(void *ctx, int64_t t0, int64_t t1) {
    const mt__attn *a = (const mt__attn *)ctx;
    int T = a->T, H = a->H, dq = a->dq, dv = a->dv;
    mt_real *p = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)T);
    double *o = (double *)MT_MALLOC(sizeof(double) * (size_t)dv);
    if (!p || !o) { MT_FREE(p); MT_FREE(o); return; }  /* results stay NaN-poisoned: caught by the caller */
    for (int64_t task = t0; task < t1; task++) {
        int b = (int)(task / H), h = (int)(task % H);
        for (int i = 0; i < T; i++) {
            int64_t ni = (int64_t)b * T + i;
            const mt_real *q = a->Q + (ni * H + h) * dq;
            mt_real mx = -INFINITY;
            int lo = mt__attn_lo(a, b, i);
            for (int j = lo; j <= i; j++) {
                p[j] = a->scale * mt__dot(q, a->K + (((int64_t)b * T + j) * H + h) * dq, dq);
                if (p[j] > mx) mx = p[j];
            }
            double l = 0;
            for (int d = 0; d < dv; d++) o[d] = 0;
            for (int j = lo; j <= i; j++) {
                double e = exp((double)(p[j] - mx));
                l += e;
                const mt_real *v = a->V + (((int64_t)b * T + j) * H + h) * dv;
                for (int d = 0; d < dv; d++) o[d] += e * v[d];
            }
            mt_real *out = a->O + (ni * H + h) * dv;
            for (int d = 0; d < dv; d++) out[d] = (mt_real)(o[d] / l);
            a->lse[ni * H + h] = (mt_real)(mx + log(l));
        }
    }
    MT_FREE(p); MT_FREE(o);
}
void mt_cpu_attention_forward(mt_pool *pool, mt_real *O, mt_real *lse, const mt_real *Q, const mt_real *K,
                              const mt_real *Vv, const int32_t *dstart, int B, int T, int H, int dq, int dv, float scale) {
    mt__attn a;
    memset(&a, 0, sizeof a);
    a.O = O; a.lse = lse; a.Q = Q; a.K = K; a.V = Vv; a.ds = dstart;
    a.B = B; a.T = T; a.H = H; a.dq = dq; a.dv = dv; a.scale = scale;
    mt_pool_for(pool, (int64_t)B * H, mt__attn_fwd, &a);
}
/* P_ij = exp(s_ij - lse_i); dS_ij = P_ij (dO_i.V_j - dO_i.O_i);
 * dQ_i = scale sum_j dS_ij K_j; dK_j = scale sum_i dS_ij Q_i; dV_j = sum_i P_ij dO_i */
static void mt__attn_bwd(void *ctx, int64_t t0, int64_t t1) {
    const mt__attn *a = (const mt__attn *)ctx;
    int T = a->T, H = a->H, dq = a->dq, dv = a->dv;
    for (int64_t task = t0; task < t1; task++) {
        int b = (int)(task / H), h = (int)(task % H);
        for (int j = 0; j < T; j++) {
            int64_t nj = (int64_t)b * T + j;
            memset(a->dK + (nj * H + h) * dq, 0, sizeof(mt_real) * (size_t)dq);
            memset(a->dV + (nj * H + h) * dv, 0, sizeof(mt_real) * (size_t)dv);
        }
        for (int i = 0; i < T; i++) {
            int64_t ni = (int64_t)b * T + i;
            const mt_real *q = a->Q + (ni * H + h) * dq, *dOi = a->dO + (ni * H + h) * dv;
            mt_real Di = mt__dot(dOi, a->Oc + (ni * H + h) * dv, dv), L = a->lsec[ni * H + h];
            mt_real *dQi = a->dQ + (ni * H + h) * dq;
            for (int d = 0; d < dq; d++) dQi[d] = 0;
            for (int j = mt__attn_lo(a, b, i); j <= i; j++) {
                int64_t nj = (int64_t)b * T + j;
                const mt_real *k = a->K + (nj * H + h) * dq, *v = a->V + (nj * H + h) * dv;
                mt_real pij = (mt_real)exp((double)(a->scale * mt__dot(q, k, dq) - L));
                mt_real ds = pij * (mt__dot(dOi, v, dv) - Di) * a->scale;
                mt_real *dKj = a->dK + (nj * H + h) * dq, *dVj = a->dV + (nj * H + h) * dv;
                for (int d = 0; d < dq; d++) { dQi[d] += ds * k[d]; dKj[d] += ds * q[d]; }
                for (int d = 0; d < dv; d++) dVj[d] += pij * dOi[d];
            }
        }
    }
}
void mt_cpu_attention_backward(mt_pool *pool, mt_real *dQ, mt_real *dK, mt_real *dV, const mt_real *Q,
                               const mt_real *K, const mt_real *Vv, const mt_real *O, const mt_real *lse,
                               const mt_real *dO, const int32_t *dstart, int B, int T, int H, int dq, int dv,
                               float scale) {
    mt__attn a;
    memset(&a, 0, sizeof a);
    a.dQ = dQ; a.dK = dK; a.dV = dV; a.Q = Q; a.K = K; a.V = Vv; a.Oc = O; a.lsec = lse; a.dO = dO; a.ds = dstart;
    a.B = B; a.T = T; a.H = H; a.dq = dq; a.dv = dv; a.scale = scale;
    mt_pool_for(pool, (int64_t)B * H, mt__attn_bwd, &a);
}

/* --- SwiGLU: h = silu(g) * u --- */
static mt_real mt__sigmoid(mt_real x) { return (mt_real)(1.0 / (1.0 + exp(-(double)x))); }
void mt_cpu_swiglu_forward(mt_real *h, const mt_real *g, const mt_real *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] = g[i] * mt__sigmoid(g[i]) * u[i];
}
void mt_cpu_swiglu_backward(mt_real *dg, mt_real *du, const mt_real *g, const mt_real *u, const mt_real *dh,
                            int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        mt_real s = mt__sigmoid(g[i]);
        dg[i] = dh[i] * u[i] * s * (1 + g[i] * (1 - s));
        du[i] = dh[i] * g[i] * s;
    }
}
void mt_cpu_add(mt_real *c, const mt_real *a, const mt_real *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) c[i] = a[i] + b[i];
}
void mt_cpu_add_rmsnorm_forward(mt_real *h, mt_real *y, mt_real *rstd, const mt_real *a, const mt_real *b, const mt_real *w,
                                int N, int D, float eps) {
    mt_cpu_add(h, a, b, (int64_t)N * D);
    mt_cpu_rmsnorm_forward(y, rstd, h, w, N, D, eps);
}
void mt_cpu_rmsnorm_backward_add(mt_real *dx, mt_real *dw, const mt_real *dy, const mt_real *x, const mt_real *w,
                                 const mt_real *rstd, const mt_real *acc, int N, int D) {
    mt_cpu_rmsnorm_backward(dx, dw, dy, x, w, rstd, N, D);   /* dx may not alias acc: the plan keeps them apart */
    mt_cpu_add(dx, acc, dx, (int64_t)N * D);
}

/* --- router ---
 * scores = softmax(logits) or sigmoid(logits), in fp32. Selection uses
 * scores + bias (the bias balances load and never touches the weights).
 * Group-limited: a group's score is the sum of its two best biased scores;
 * only the best n_limited groups are eligible. Ties go to the lower index.
 * Weights are the unbiased scores of the chosen experts, optionally
 * normalised to sum 1 (+1e-20), times route_scale. */
void mt_cpu_router_forward(int32_t *idx, mt_real *w, mt_real *scores, int32_t *counts, const mt_real *logits,
                           const mt_real *bias, int N, int E, int K, int score_func, int route_norm,
                           float route_scale, int n_groups, int n_limited) {
    memset(counts, 0, sizeof(int32_t) * (size_t)E);
    mt_real *sel = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)E);
    mt_real *gscore = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)n_groups);
    if (!sel || !gscore) { MT_FREE(sel); MT_FREE(gscore); return; }
    int per = E / n_groups;
    for (int n = 0; n < N; n++) {
        const mt_real *l = logits + (int64_t)n * E;
        mt_real *s = scores + (int64_t)n * E;
        if (score_func == MT_SCORE_SIGMOID) {
            for (int e = 0; e < E; e++) s[e] = mt__sigmoid(l[e]);
        } else {
            mt_real mx = l[0];
            for (int e = 1; e < E; e++) if (l[e] > mx) mx = l[e];
            double z = 0;
            for (int e = 0; e < E; e++) z += exp((double)(l[e] - mx));
            for (int e = 0; e < E; e++) s[e] = (mt_real)(exp((double)(l[e] - mx)) / z);
        }
        for (int e = 0; e < E; e++) sel[e] = s[e] + bias[e];
        if (n_groups > 1) {
            for (int gi = 0; gi < n_groups; gi++) {           /* top-2 sum (or max of 1) */
                mt_real b1 = -INFINITY, b2 = -INFINITY;
                for (int e = gi * per; e < (gi + 1) * per; e++) {
                    if (sel[e] > b1) { b2 = b1; b1 = sel[e]; }
                    else if (sel[e] > b2) b2 = sel[e];
                }
                gscore[gi] = per >= 2 ? b1 + b2 : b1;
            }
            uint8_t keep[4096];
            memset(keep, 0, (size_t)n_groups);
            for (int r = 0; r < n_limited; r++) {
                int best = -1;
                for (int gi = 0; gi < n_groups; gi++)
                    if (!keep[gi] && (best < 0 || gscore[gi] > gscore[best])) best = gi;
                keep[best] = 1;
            }
            for (int e = 0; e < E; e++) if (!keep[e / per]) sel[e] = -INFINITY;
        }
        double sum = 0;
        for (int k = 0; k < K; k++) {                         /* repeated argmax */
            int best = -1;
            for (int e = 0; e < E; e++)
                if (sel[e] != -INFINITY && (best < 0 || sel[e] > sel[best])) best = e;
            if (best < 0) best = 0;  /* unreachable: config guarantees K eligible experts */
            sel[best] = -INFINITY;
            idx[(int64_t)n * K + k] = best;
            w[(int64_t)n * K + k] = s[best];
            sum += s[best];
            counts[best]++;
        }
        for (int k = 0; k < K; k++) {
            double x = w[(int64_t)n * K + k];
            if (route_norm) x /= (sum + 1e-20);
            w[(int64_t)n * K + k] = (mt_real)(x * route_scale);
        }
    }
    MT_FREE(sel); MT_FREE(gscore);
}
void mt_cpu_router_backward(mt_real *dlogits, const mt_real *scores, const int32_t *idx, const mt_real *w,
                            const mt_real *dw, int N, int E, int K, int score_func, int route_norm,
                            float route_scale) {
    (void)w;
    for (int n = 0; n < N; n++) {
        const mt_real *s = scores + (int64_t)n * E;
        const int32_t *ix = idx + (int64_t)n * K;
        const mt_real *g = dw + (int64_t)n * K;
        mt_real *dl = dlogits + (int64_t)n * E;
        double S = 0, gr = 0;
        for (int k = 0; k < K; k++) { S += s[ix[k]]; gr += (double)g[k] * s[ix[k]]; }
        for (int e = 0; e < E; e++) dl[e] = 0;                 /* dl holds d(scores) first */
        for (int k = 0; k < K; k++) {
            double dr = route_norm ? route_scale * (g[k] / (S + 1e-20) - gr / ((S + 1e-20) * (S + 1e-20)))
                                   : (double)route_scale * g[k];
            dl[ix[k]] += (mt_real)dr;
        }
        if (score_func == MT_SCORE_SIGMOID) {
            for (int e = 0; e < E; e++) dl[e] = dl[e] * s[e] * (1 - s[e]);
        } else {
            double dot = 0;
            for (int e = 0; e < E; e++) dot += (double)dl[e] * s[e];
            for (int e = 0; e < E; e++) dl[e] = (mt_real)(s[e] * (dl[e] - dot));
        }
    }
}

/* --- permutation into expert-major order ---
 * Assignment a = n*K + k goes to row slot[a] of xs; rows of expert e are
 * offs[e]..offs[e+1], in token order. Returns -1 on an expert id out of range. */
int mt_cpu_moe_permute(mt_real *xs, int32_t *slot, int32_t *offs, const mt_real *x, const int32_t *idx, int N,
                       int D, int K, int E) {
    int64_t NK = (int64_t)N * K;
    for (int e = 0; e <= E; e++) offs[e] = 0;
    for (int64_t a = 0; a < NK; a++) {
        if (idx[a] < 0 || idx[a] >= E) return -1;
        offs[idx[a] + 1]++;
    }
    for (int e = 0; e < E; e++) offs[e + 1] += offs[e];
    int32_t *cur = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)E);
    if (!cur) return -1;
    memcpy(cur, offs, sizeof(int32_t) * (size_t)E);
    for (int64_t a = 0; a < NK; a++) {
        int32_t s = cur[idx[a]]++;
        slot[a] = s;
        memcpy(xs + (int64_t)s * D, x + (a / K) * D, sizeof(mt_real) * (size_t)D);
    }
    MT_FREE(cur);
    return 0;
}
void mt_cpu_moe_permute_backward(mt_real *dx, const mt_real *dxs, const int32_t *slot, int N, int D, int K) {
    for (int n = 0; n < N; n++) {
        mt_real *o = dx + (int64_t)n * D;
        for (int d = 0; d < D; d++) o[d] = 0;
        for (int k = 0; k < K; k++) {
            const mt_real *r = dxs + (int64_t)slot[(int64_t)n * K + k] * D;
            for (int d = 0; d < D; d++) o[d] += r[d];
        }
    }
}

/* --- grouped GEMMs over experts: rows offs[e]..offs[e+1] use W_e --- */
typedef struct { mt_real *out; const mt_real *a, *b; const int32_t *offs; int E, M, K; } mt__gmm;
static int mt__expert_of(const int32_t *offs, int E, int64_t r) {   /* offs[e] <= r < offs[e+1] */
    int lo = 0, hi = E - 1;
    while (lo < hi) { int mid = (lo + hi + 1) / 2; if (offs[mid] <= r) lo = mid; else hi = mid - 1; }
    return lo;
}
static void mt__gmm_rows(void *ctx, int64_t r0, int64_t r1) {      /* Y[r] = W_e X[r] */
    const mt__gmm *g = (const mt__gmm *)ctx;
    for (int64_t r = r0; r < r1; r++) {
        const mt_real *W = g->b + (int64_t)mt__expert_of(g->offs, g->E, r) * g->M * g->K;
        for (int m = 0; m < g->M; m++) g->out[r * g->M + m] = mt__dot(g->a + r * g->K, W + (int64_t)m * g->K, g->K);
    }
}
static void mt__gmm_dx_rows(void *ctx, int64_t r0, int64_t r1) {   /* dX[r] = dY[r] W_e */
    const mt__gmm *g = (const mt__gmm *)ctx;
    for (int64_t r = r0; r < r1; r++) {
        const mt_real *W = g->b + (int64_t)mt__expert_of(g->offs, g->E, r) * g->M * g->K;
        mt_real *o = g->out + r * g->K;
        for (int k = 0; k < g->K; k++) o[k] = 0;
        for (int m = 0; m < g->M; m++) {
            mt_real a = g->a[r * g->M + m];
            const mt_real *w = W + (int64_t)m * g->K;
            for (int k = 0; k < g->K; k++) o[k] += a * w[k];
        }
    }
}
static void mt__gmm_dw_rows(void *ctx, int64_t t0, int64_t t1) {   /* dW_e[m,:] = sum_r dY[r,m] X[r,:] */
    const mt__gmm *g = (const mt__gmm *)ctx;
    for (int64_t t = t0; t < t1; t++) {
        int e = (int)(t / g->M), m = (int)(t % g->M);
        mt_real *o = g->out + t * g->K;
        for (int k = 0; k < g->K; k++) o[k] = 0;
        for (int64_t r = g->offs[e]; r < g->offs[e + 1]; r++) {
            mt_real a = g->a[r * g->M + m];
            const mt_real *x = g->b + r * g->K;
            for (int k = 0; k < g->K; k++) o[k] += a * x[k];
        }
    }
}
void mt_cpu_gmm(mt_pool *pool, mt_real *Y, const mt_real *X, const mt_real *W, const int32_t *offs, int E, int M,
                int K) {
    mt__gmm g = {Y, X, W, offs, E, M, K};
    mt_pool_for(pool, offs[E], mt__gmm_rows, &g);
}
void mt_cpu_gmm_dx(mt_pool *pool, mt_real *dX, const mt_real *dY, const mt_real *W, const int32_t *offs, int E,
                   int M, int K) {
    mt__gmm g = {dX, dY, W, offs, E, M, K};
    mt_pool_for(pool, offs[E], mt__gmm_dx_rows, &g);
}
/* dX[r] += dY[r] W_e: each sum is formed on its own, in GMM_DX's order, then
 * added, so GMM_DX2 is bitwise GMM_DX, GMM_DX, ADD on the CPU */
static void mt__gmm_dx_add_rows(void *ctx, int64_t r0, int64_t r1) {
    const mt__gmm *g = (const mt__gmm *)ctx;
    enum { KB = 64 };
    mt_real t[KB];
    for (int64_t r = r0; r < r1; r++) {
        const mt_real *W = g->b + (int64_t)mt__expert_of(g->offs, g->E, r) * g->M * g->K;
        mt_real *o = g->out + r * g->K;
        for (int k0 = 0; k0 < g->K; k0 += KB) {
            int nk = g->K - k0 < KB ? g->K - k0 : KB;
            for (int k = 0; k < nk; k++) t[k] = 0;
            for (int m = 0; m < g->M; m++) {
                mt_real a = g->a[r * g->M + m];
                const mt_real *w = W + (int64_t)m * g->K + k0;
                for (int k = 0; k < nk; k++) t[k] += a * w[k];
            }
            for (int k = 0; k < nk; k++) o[k0 + k] += t[k];
        }
    }
}
void mt_cpu_gmm_dx_add(mt_pool *pool, mt_real *dX, const mt_real *dY, const mt_real *W, const int32_t *offs, int E,
                       int M, int K) {
    mt__gmm g = {dX, dY, W, offs, E, M, K};
    mt_pool_for(pool, offs[E], mt__gmm_dx_add_rows, &g);
}
void mt_cpu_gmm_dw(mt_pool *pool, mt_real *dW, const mt_real *dY, const mt_real *X, const int32_t *offs, int E,
                   int M, int K) {
    mt__gmm g = {dW, dY, X, offs, E, M, K};
    mt_pool_for(pool, (int64_t)E * M, mt__gmm_dw_rows, &g);
}

/* --- FP8 (e4m3) quantization, as the CUDA kernels do it (docs/FP8.md) ---
 * e4m3: normal values 1.mmm x 2^(e-7) for e = 1..15 (448 the largest finite), subnormals m x 2^-9. A
 * value rounds to the nearest multiple of its binade's step (2^-9 below 2^-6), ties to even; beyond
 * 448 it saturates. NaN stays NaN. */
double mt_e4m3(double x) {
    if (x != x) return x;
    double a = fabs(x);
    if (a >= 448.0) return copysign(448.0, x);
    int e;
    (void)frexp(a, &e);                        /* a = f 2^e, f in [0.5, 1): the step is 2^(e - 4) */
    int sh = e - 4 < -9 ? -9 : e - 4;
    return copysign(ldexp(rint(ldexp(a, -sh)), sh), x);
}
/* one block: y[i * stride] for i < n = e4m3(x / s) s with s = amax / 448 */
static void mt__fp8_block(mt_real *y, const mt_real *x, int64_t n, int64_t stride) {
    mt_real amax = 0;
    for (int64_t i = 0; i < n; i++) { mt_real a = (mt_real)fabs((double)x[i * stride]); if (a > amax) amax = a; }   /* NaNs skipped */
    mt_real s = amax / (mt_real)448;
    for (int64_t i = 0; i < n; i++) y[i * stride] = s > 0 ? (mt_real)mt_e4m3((double)(x[i * stride] / s)) * s : (mt_real)0;
}
void mt_cpu_fp8_rows(mt_real *y, const mt_real *x, int64_t R, int64_t C) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c += 128) mt__fp8_block(y + r * C + c, x + r * C + c, C - c < 128 ? C - c : 128, 1);
}
void mt_cpu_fp8_cols(mt_real *y, const mt_real *x, const int32_t *offs, int E, int64_t R, int64_t C) {
    for (int e = 0; e < (offs ? E : 1); e++) {
        int64_t r0 = offs ? offs[e] : 0, r1 = offs ? offs[e + 1] : R;
        for (int64_t r = r0; r < r1; r += 128)
            for (int64_t c = 0; c < C; c++) mt__fp8_block(y + r * C + c, x + r * C + c, r1 - r < 128 ? r1 - r : 128, C);
    }
}
void mt_cpu_fp8_blocks(mt_real *y, const mt_real *x, int64_t E, int64_t N, int64_t K) {
    for (int64_t e = 0; e < E; e++)
        for (int64_t n0 = 0; n0 < N; n0 += 128)
            for (int64_t k0 = 0; k0 < K; k0 += 128) {
                int64_t bn = N - n0 < 128 ? N - n0 : 128, bk = K - k0 < 128 ? K - k0 : 128;
                mt_real amax = 0;
                for (int64_t i = 0; i < bn; i++)
                    for (int64_t j = 0; j < bk; j++) {
                        mt_real a = (mt_real)fabs((double)x[(e * N + n0 + i) * K + k0 + j]);
                        if (a > amax) amax = a;
                    }
                mt_real s = amax / (mt_real)448;
                for (int64_t i = 0; i < bn; i++)
                    for (int64_t j = 0; j < bk; j++) {
                        int64_t at = (e * N + n0 + i) * K + k0 + j;
                        y[at] = s > 0 ? (mt_real)mt_e4m3((double)(x[at] / s)) * s : (mt_real)0;
                    }
            }
}

/* --- weighted combine back to token order: y[n] = sum_k w[n,k] ys[slot[n*K+k]] --- */
void mt_cpu_moe_combine_forward(mt_real *y, const mt_real *ys, const int32_t *slot, const mt_real *w, int N, int D,
                                int K) {
    for (int n = 0; n < N; n++) {
        mt_real *o = y + (int64_t)n * D;
        for (int d = 0; d < D; d++) o[d] = 0;
        for (int k = 0; k < K; k++) {
            mt_real wk = w[(int64_t)n * K + k];
            const mt_real *r = ys + (int64_t)slot[(int64_t)n * K + k] * D;
            for (int d = 0; d < D; d++) o[d] += wk * r[d];
        }
    }
}
void mt_cpu_moe_combine_backward(mt_real *dys, mt_real *dw, const mt_real *dy, const mt_real *ys,
                                 const int32_t *slot, const mt_real *w, int N, int D, int K) {
    for (int n = 0; n < N; n++) {
        const mt_real *g = dy + (int64_t)n * D;
        for (int k = 0; k < K; k++) {
            int64_t s = slot[(int64_t)n * K + k];
            mt_real wk = w[(int64_t)n * K + k];
            mt_real *o = dys + s * D;
            for (int d = 0; d < D; d++) o[d] = wk * g[d];
            dw[(int64_t)n * K + k] = mt__dot(g, ys + s * D, D);
        }
    }
}

/* --- cross-entropy, mean over tokens; lse saved for the backward --- */
typedef struct { mt_real *out, *lse; const mt_real *logits, *lsec; const int32_t *tgt; int N, V; double scale; } mt__ce;
static void mt__ce_fwd_rows(void *ctx, int64_t n0, int64_t n1) {
    const mt__ce *c = (const mt__ce *)ctx;
    for (int64_t n = n0; n < n1; n++) {
        const mt_real *l = c->logits + n * c->V;
        mt_real mx = l[0];
        for (int v = 1; v < c->V; v++) if (l[v] > mx) mx = l[v];
        double z = 0;
        for (int v = 0; v < c->V; v++) z += exp((double)(l[v] - mx));
        c->lse[n] = (mt_real)(mx + log(z));
        c->out[n] = c->tgt[n] < 0 ? 0 : (mt_real)(mx + log(z) - l[c->tgt[n]]);   /* per-token loss, summed by the caller */
    }
}
void mt_cpu_cross_entropy_forward(mt_pool *pool, mt_real *loss, mt_real *lse, const mt_real *logits,
                                  const int32_t *tgt, int N, int V, int count) {
    mt_real *per = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)N);
    if (!per) { loss[0] = (mt_real)NAN; return; }
    mt__ce c = {per, lse, logits, NULL, tgt, N, V, 0};
    mt_pool_for(pool, N, mt__ce_fwd_rows, &c);
    double s = 0;
    for (int n = 0; n < N; n++) s += per[n];
    loss[0] = (mt_real)(s / (count > 0 ? count : N));
    MT_FREE(per);
}
static void mt__ce_bwd_rows(void *ctx, int64_t n0, int64_t n1) {
    const mt__ce *c = (const mt__ce *)ctx;
    double inv = c->scale;
    for (int64_t n = n0; n < n1; n++) {
        const mt_real *l = c->logits + n * c->V;
        mt_real *d = c->out + n * c->V;
        if (c->tgt[n] < 0) { for (int v = 0; v < c->V; v++) d[v] = 0; continue; }
        for (int v = 0; v < c->V; v++) d[v] = (mt_real)(exp((double)(l[v] - c->lsec[n])) * inv);
        d[c->tgt[n]] -= (mt_real)inv;
    }
}
void mt_cpu_cross_entropy_backward(mt_pool *pool, mt_real *dlogits, const mt_real *logits, const mt_real *lse,
                                   const int32_t *tgt, int N, int V, double scale) {
    mt__ce c = {dlogits, NULL, logits, lse, tgt, N, V, scale};
    mt_pool_for(pool, N, mt__ce_bwd_rows, &c);
}

void mt_cpu_ce_stats(mt_real *st, const mt_real *logits, const int32_t *tgt, int N, int Vl, int v0) {
    for (int n = 0; n < N; n++) {
        const mt_real *l = logits + (int64_t)n * Vl;
        mt_real mx = l[0];
        for (int v = 1; v < Vl; v++) if (l[v] > mx) mx = l[v];
        double z = 0;
        for (int v = 0; v < Vl; v++) z += exp((double)(l[v] - mx));
        int t = tgt[n] - v0;
        st[3 * n] = mx; st[3 * n + 1] = (mt_real)z; st[3 * n + 2] = t >= 0 && t < Vl ? l[t] : 0;
    }
}
void mt_cpu_ce_combine(mt_real *loss, mt_real *lse, const mt_real *st, const int32_t *tgt, int S, int N, int count) {
    double s = 0;
    for (int n = 0; n < N; n++) {
        mt_real mx = st[3 * n];
        for (int k = 1; k < S; k++) if (st[3 * ((int64_t)k * N + n)] > mx) mx = st[3 * ((int64_t)k * N + n)];
        double z = 0, t = 0;
        for (int k = 0; k < S; k++) {
            const mt_real *x = st + 3 * ((int64_t)k * N + n);
            z += (double)x[1] * exp((double)(x[0] - mx));
            t += (double)x[2];
        }
        lse[n] = (mt_real)(mx + log(z));
        if (tgt[n] >= 0) s += mx + log(z) - t;
    }
    loss[0] = (mt_real)(s / (count > 0 ? count : N));
}
void mt_cpu_ce_shard_backward(mt_real *dlogits, const mt_real *logits, const mt_real *lse, const int32_t *tgt,
                              int N, int Vl, int v0, double scale) {
    double inv = scale;
    for (int n = 0; n < N; n++) {
        const mt_real *l = logits + (int64_t)n * Vl;
        mt_real *d = dlogits + (int64_t)n * Vl;
        if (tgt[n] < 0) { for (int v = 0; v < Vl; v++) d[v] = 0; continue; }
        for (int v = 0; v < Vl; v++) d[v] = (mt_real)(exp((double)(l[v] - lse[n])) * inv);
        int t = tgt[n] - v0;
        if (t >= 0 && t < Vl) d[t] -= (mt_real)inv;
    }
}

/* --- AdamW, as torch.optim.AdamW: decoupled decay, bias-corrected moments.
 * coef scales the gradient (global-norm clipping); step is 0-based. --- */
void mt_cpu_adamw(mt_real *p, mt_real *m, mt_real *v, const mt_real *g, int64_t n, double lr, double coef,
                  const float hp[MT_HP_COUNT], int step, int decay) {
    double b1 = hp[MT_HP_BETA1], b2 = hp[MT_HP_BETA2], eps = hp[MT_HP_EPS], wd = decay ? hp[MT_HP_WD] : 0;
    double bc1 = 1 - pow(b1, step + 1), bc2 = 1 - pow(b2, step + 1);
    double step_size = lr / bc1, bc2_sqrt = sqrt(bc2);
    for (int64_t i = 0; i < n; i++) {
        double gi = (double)g[i] * coef;
        double mi = b1 * m[i] + (1 - b1) * gi;
        double vi = b2 * v[i] + (1 - b2) * gi * gi;
        m[i] = (mt_real)mi; v[i] = (mt_real)vi;
        double pi = (double)p[i] * (1 - lr * wd);
        p[i] = (mt_real)(pi - step_size * (double)m[i] / (sqrt((double)v[i]) / bc2_sqrt + eps));
    }
}
/* A double rounded to nearest even bf16 in one rounding: to float by round-to-odd (24 bits keep
 * the sticky information bf16's 8 need), then to bf16. */
static uint16_t mt__bf16_from_double(double x) {
    float f = (float)x;
    if ((double)f != x && isfinite(f)) {
        uint32_t u;
        memcpy(&u, &f, 4);
        if (fabs((double)f) > fabs(x)) u--;   /* toward zero ... */
        u |= 1u;                              /* ... and odd: inexact */
        memcpy(&f, &u, 4);
    }
    return mt_bf16_round(f);
}
void mt_cpu_adamw_bf16(mt_real *p, uint16_t *m, uint16_t *v, const mt_real *g, int64_t n, double lr, double coef,
                       const float hp[MT_HP_COUNT], int step, int decay) {
    if (sizeof(mt_real) == sizeof(float)) {   /* the CUDA kernels' arithmetic, operation for operation */
        mt_adamw_k k;
        mt_adamw_bf16_setup(&k, hp, (float)lr, (float)coef, step, decay);
        for (int64_t i = 0; i < n; i++) p[i] = (mt_real)mt_adamw_bf16_elem(&k, (float)p[i], (float)g[i], &m[i], &v[i]);
        return;
    }
    double b1 = hp[MT_HP_BETA1], b2 = hp[MT_HP_BETA2], eps = hp[MT_HP_EPS], wd = decay ? hp[MT_HP_WD] : 0;
    double bc1 = 1 - pow(b1, step + 1), bc2 = 1 - pow(b2, step + 1);
    double step_size = lr / bc1, bc2_sqrt = sqrt(bc2);
    for (int64_t i = 0; i < n; i++) {
        double gi = (double)g[i] * coef;
        double mi = b1 * mt_bf16_float(m[i]) + (1 - b1) * gi;
        double vi = b2 * mt_bf16_float(v[i]) + (1 - b2) * gi * gi;
        m[i] = mt__bf16_from_double(mi); v[i] = mt__bf16_from_double(vi);
        p[i] = (mt_real)((double)p[i] * (1 - lr * wd) - step_size * mi / (sqrt(vi) / bc2_sqrt + eps));
    }
}

/* --- auxiliary-loss-free balancing: bias += coeff*sign(mean - count), centred --- */
void mt_cpu_expert_bias_update(mt_real *bias, const int32_t *counts, int E, float coeff) {
    double mean = 0, dmean = 0;
    for (int e = 0; e < E; e++) mean += counts[e];
    mean /= E;
    double delta[4096];
    for (int e = 0; e < E; e++) {
        double d = mean - counts[e];
        delta[e] = coeff * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0);
        dmean += delta[e];
    }
    dmean /= E;
    for (int e = 0; e < E; e++) bias[e] += (mt_real)(delta[e] - dmean);
}

/* ========================================================================
 * 9. Collectives
 * A collective node names mesh dimensions (a bit mask), never a
 * communicator. The group of ranks that differ only along those dimensions
 * is resolved at bind from the binding (mt_mesh_group). A group of one rank
 * is the identity: the sum of one value is that value, and an all-to-all
 * with oneself keeps one's own rows.
 * ====================================================================== */

/* --- the CPU world: thread-ranks, a barrier, posted pointers --- */

struct mt_world {
    int n;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    uint64_t gen;            /* barrier generation */
    int failed;              /* first rank that failed, or -1 */
    char why[512];
    const void *(*slot)[4];  /* per rank: the buffers it posted for the collective in flight */
};

int mt_world_create(mt_world **out, int n, mt_err *err) {
    *out = NULL;
    if (n < 1 || n > 4096) return mt_errf(err, "a world of %d ranks: need 1..4096", n);
    mt_world *w = (mt_world *)mt__calloc(sizeof *w);
    if (!w || !(w->slot = (const void *(*)[4])mt__calloc(sizeof *w->slot * (size_t)n))) {
        MT_FREE(w);
        return mt_errf(err, "out of memory");
    }
    w->n = n; w->failed = -1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    *out = w;
    return 0;
}
void mt_world_destroy(mt_world *w) {
    if (!w) return;
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    MT_FREE(w->slot);
    MT_FREE(w);
}
void mt_world_fail(mt_world *w, int rank, const char *why) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    if (w->failed < 0) { w->failed = rank; snprintf(w->why, sizeof w->why, "%s", why ? why : "failed"); }
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}
int mt_world_failed(mt_world *w, char *why, size_t n) {
    pthread_mutex_lock(&w->mu);
    int r = w->failed;
    if (r >= 0 && why) snprintf(why, n, "%s", w->why);
    pthread_mutex_unlock(&w->mu);
    return r;
}
/* Every rank of the world arrives, or the call returns the first failure. */
static int mt__world_barrier(mt_world *w, mt_err *err) {
    pthread_mutex_lock(&w->mu);
    uint64_t gen = w->gen;
    int rc = 0;
    if (w->failed < 0) {
        if (++w->arrived == w->n) { w->arrived = 0; w->gen++; pthread_cond_broadcast(&w->cv); }
        else while (w->gen == gen && w->failed < 0) pthread_cond_wait(&w->cv, &w->mu);
    }
    if (w->gen == gen && w->failed >= 0) rc = mt_errf(err, "rank %d failed: %s", w->failed, w->why);
    pthread_mutex_unlock(&w->mu);
    return rc;
}

typedef struct { mt_rank_fn fn; void *ctx; int rank; mt_world *w; mt_err err; } mt__rank_job;
static void *mt__rank_main(void *arg) {
    mt__rank_job *j = (mt__rank_job *)arg;
    if (j->fn(j->ctx, j->rank, j->w, &j->err)) mt_world_fail(j->w, j->rank, j->err.msg);
    return NULL;
}
int mt_run_thread_ranks(int n, mt_rank_fn fn, void *ctx, mt_err *err) {
    mt_world *w;
    if (mt_world_create(&w, n, err)) return -1;
    mt__rank_job *jobs = (mt__rank_job *)mt__calloc(sizeof *jobs * (size_t)n);
    pthread_t *th = (pthread_t *)mt__calloc(sizeof *th * (size_t)n);
    int *started = (int *)mt__calloc(sizeof(int) * (size_t)n);
    if (!jobs || !th || !started) {
        MT_FREE(jobs); MT_FREE(th); MT_FREE(started); mt_world_destroy(w);
        return mt_errf(err, "out of memory");
    }
    for (int r = 0; r < n; r++) {
        jobs[r].fn = fn; jobs[r].ctx = ctx; jobs[r].rank = r; jobs[r].w = w;
        started[r] = pthread_create(&th[r], NULL, mt__rank_main, &jobs[r]) == 0;
        if (!started[r]) mt_world_fail(w, r, "could not start its thread");
    }
    for (int r = 0; r < n; r++) if (started[r]) pthread_join(th[r], NULL);
    char why[512];
    int failed = mt_world_failed(w, why, sizeof why), rc = 0;
    if (failed >= 0) rc = mt_errf(err, "rank %d: %s", failed, why);
    MT_FREE(jobs); MT_FREE(th); MT_FREE(started);
    mt_world_destroy(w);
    return rc;
}

/* --- the runtime's view of its groups --- */

typedef struct {
    uint32_t mask; int id;   /* what the collective nodes name: mesh mask and channel */
    int size, index;         /* ranks in the group, and mine (group order = mesh order) */
    int *members;            /* their world ranks, in group order */
    int owner;               /* index of the group whose communicator this one uses (itself: it made one) */
    void *comm;              /* NCCL communicator (CUDA, size > 1); only the owner frees it */
    void *lsa;               /* CUDA: the device-side expert exchange over comm (mt_cuda_lsa), or NULL; the owner's */
} mt__group;

/* CUDA, FP8: an operand quantized once for several nodes (mt__q8_plan; which operand: rt->q8_use) */
typedef struct mt__q8_slot {
    uint8_t *q[2];           /* the codes: rows / cols / W in q[0], W^T in q[1]; NULL: the form no later node takes */
    float *s[2];
    void *mem;
    int value;               /* the value quantized */
    int adamw;               /* a weight AdamW updates: that ADAMW node, which writes the forms (mt_cuda_adamw_fp8); else -1 */
    int shadow;              /* with adamw: the bf16 weight is also read elsewhere, so AdamW still writes it */
    int *fresh;              /* with adamw, on the device: 1 while the forms hold the weight (no node quantizes it) */
    int rows_node, cols_node;/* an activation read both by rows and down the tokens: its rows in q[0], its columns in q[1],
                                both made by the first reader from one read (the nodes whose shapes they take); else -1 */
    int producer;            /* with rows_node: the SwiGLU node (SWIGLU, SWIGLU_BWD, an FP8 GMM_GLU) that writes both forms
                                in place of the bf16 value, which nothing else reads (mt__q8_swiglu); else -1 */
} mt__q8_slot;
struct mt_runtime {
    mt_graph g;              /* the runtime's own copy of the graph */
    mt_binding bind;
    int backend;             /* MT_BACKEND_CPU or MT_BACKEND_CUDA */
    mt_pool *pool;           /* CPU worker threads */
    uint8_t *persist, *arena;/* host memory (CPU) or device memory (CUDA) */
    void **ptr;              /* per value: its bytes */
    int64_t *rows;           /* per value: actual leading dim when it is symbolic */
    int64_t *sym;            /* per symbol: bound value */
    int32_t *counts; int n_moe;
    int64_t n_tokens;
    void *cu;                /* mt_cuda context (CUDA builds) */
    void *scratch;           /* CUDA: op workspace, sized for the hungriest node */
    size_t scratch_bytes;
    void **graphs;           /* CUDA: one captured graph per region, by its first node */
    int64_t multi_nodes;      /* CUDA: nodes issued within multi-tensor launches (mt__exec_cuda_multi), all steps */
    double prof_ms[MT_NOPS];  /* binding.profile: time per op */
    double prof_step[5];      /* binding.profile, CUDA: step, compute, communication, exposed communication (ms), steps */
    double *prof_wait;        /* binding.profile, CUDA, per node: ms the compute stream waited for it */
    int64_t prof_calls[MT_NOPS];
    mt__group *groups; int n_groups;
    void *world_comm;        /* NCCL: every rank, in rank order */
    int32_t **host;          /* per value: a host copy (the expert exchange's counts over NCCL) */
    void *ep_stage;          /* CUDA: rows of the expert exchange in peer order */
    size_t ep_stage_bytes;
    mt_schedule sched;       /* CUDA with g.overlap: each node's stream and the events it waits for */
    int32_t *ev_of;          /* CUDA overlap: per node, the ordering event that marks it done (a captured region's last node) */
    uint8_t *ev_used;        /* CUDA overlap: per node, whether another stream waits for it */
    int host_syncs;          /* in the last step */
    char tuning_note[400];   /* how the graph's tuning applied at bind ("" = as recorded) */
    int64_t recv_rows;       /* rows my experts received in the last step's forward (summed over MoE layers) */
    int arena_symmetric;     /* CUDA: the arena came from ncclMemAlloc (a window can map it) */
    int ep_device;           /* CUDA: every ep group exchanges on the device (no host counts) */
    char exchange[240];      /* mt_runtime_exchange */
    int32_t **ep_plan;       /* CUDA device-side exchange: per EP_COUNTS output, the count matrix and layouts */
    int32_t **rows_dev;      /* CUDA device-side exchange: per value with symbolic rows, where the device holds them */
    long long *recv_rows_dev;/* CUDA device-side exchange: received rows, all steps (device counter) */
    long long recv_rows_read;
    int whole;               /* CUDA: the step replays as one captured graph (every node capturable) */
    int warm;                /* CUDA, whole: a step ran eagerly (the next one is captured) */
    void *step_graph;
    int ran;                 /* CUDA: a step ran (a profiled step may then be captured) */
    int prof_capture;        /* CUDA: the profiled step is being captured; its events are read after the replay */
    void *prof_graph;        /* CUDA: the profiled step, its events included, when every node is capturable */
    struct mt__q8_slot *q8;  /* CUDA, FP8: operands quantized once for several nodes (mt__q8_plan) */
    int n_q8;
    int32_t *q8_use;         /* CUDA, FP8: per (node, input < 5): its slot + 1, negated where it makes the slot; 0: none */
    void *q8_pool;           /* CUDA, FP8: the activations' slots, packed by their lifetimes in the step (mt__q8_plan) */
};

#ifdef MT_CUDA
static int mt__capturable(const mt_runtime *rt, const mt_node *n);
#endif
static mt__group *mt__find_group(mt_runtime *rt, uint32_t mask, int id) {
    for (int i = 0; i < rt->n_groups; i++)
        if (rt->groups[i].mask == mask && rt->groups[i].id == id) return &rt->groups[i];
    return NULL;
}

/* Resolve every (mask, id) the graph names, in node order (the same on every
 * rank, as ncclCommSplit needs), plus the whole world for host reductions. */
static int mt__bind_groups(mt_runtime *rt, mt_err *err) {
    const mt_graph *G = &rt->g;
    int cap = 1;
    for (int i = 0; i < G->n_nodes; i++) cap += mt__is_collective(G->nodes[i].op);
    rt->groups = (mt__group *)mt__calloc(sizeof(mt__group) * (size_t)cap);
    if (!rt->groups) return mt_errf(err, "out of memory");
    for (int i = -1; i < G->n_nodes; i++) {
        uint32_t mask = i < 0 ? MT__WORLD_MASK : (uint32_t)G->nodes[i].iattr[0];
        int id = i < 0 ? 0 : G->nodes[i].iattr[1];
        if ((i >= 0 && !mt__is_collective(G->nodes[i].op)) || mt__find_group(rt, mask, id)) continue;
        int me = rt->n_groups++;
        mt__group *gr = &rt->groups[me];
        gr->mask = mask; gr->id = id; gr->owner = me;
        gr->size = mt_mesh_group_size(&G->mesh, mask);
        if (!(gr->members = (int *)mt__calloc(sizeof(int) * (size_t)gr->size))) return mt_errf(err, "out of memory");
        gr->index = mt_mesh_group(&G->mesh, mask, rt->bind.rank, gr->members);
        /* the same ranks in the same order on the same channel: one communicator (the choice is the same on
         * every rank, so every rank makes the same ncclCommSplit calls in the same order) */
        for (int k = 0; k < me && gr->owner == me; k++)
            if (rt->groups[k].owner == k && rt->groups[k].id == id &&
                mt_mesh_groups_equal(&G->mesh, rt->groups[k].mask, mask)) gr->owner = k;
        if (gr->owner != me) { gr->comm = rt->groups[gr->owner].comm; continue; }
#ifdef MT_CUDA
        if (rt->backend == MT_BACKEND_CUDA && gr->size > 1) {
            char nm[64];
            mt_mesh_mask_name(mask, nm, sizeof nm);
            if (i < 0) gr->comm = rt->world_comm;   /* the world communicator itself (freed with it) */
            else if (mt_nccl_split((mt_cuda *)rt->cu, rt->world_comm, gr->members[0], gr->index, &gr->comm))
                return mt_errf(err, "rank %d: creating the %s communicator: %s", rt->bind.rank, nm, mt_cuda_error((mt_cuda *)rt->cu));
        }
#endif
    }
    return 0;
}
/* Communicators this rank made (the world's included when there is more than one rank). */
int mt_runtime_n_communicators(const mt_runtime *rt) {
    int n = 0;
    for (int i = 0; i < rt->n_groups; i++) n += rt->groups[i].owner == i && rt->groups[i].size > 1;
    return n;
}
static void mt__free_groups(mt_runtime *rt, int abort) {
    for (int i = 0; rt->groups && i < rt->n_groups; i++) {
#ifdef MT_CUDA
        if (rt->groups[i].comm && rt->groups[i].owner == i && i > 0) mt_nccl_free(rt->groups[i].comm, abort);
#endif
        MT_FREE(rt->groups[i].members);
    }
    MT_FREE(rt->groups);
    rt->groups = NULL; rt->n_groups = 0;
#ifdef MT_CUDA
    if (rt->world_comm) mt_nccl_free(rt->world_comm, abort);
#endif
    (void)abort;
    rt->world_comm = NULL;
}

/* --- CPU engine: post, barrier, read the peers, barrier --- */

/* buffer j that group member k posted (my own without a world) */
static const void *mt__peer(mt_runtime *rt, const mt__group *gr, int k, int j, const void *mine) {
    return k == gr->index ? mine : rt->bind.cpu_world->slot[gr->members[k]][j];
}
static int mt__cpu_post(mt_runtime *rt, const mt__group *gr, const void *p0, const void *p1, mt_err *err) {
    if (gr->size == 1) return 0;
    mt_world *w = rt->bind.cpu_world;
    w->slot[rt->bind.rank][0] = p0; w->slot[rt->bind.rank][1] = p1;
    return mt__world_barrier(w, err);
}
static int mt__cpu_done(mt_runtime *rt, const mt__group *gr, mt_err *err) {
    return gr->size == 1 ? 0 : mt__world_barrier(rt->bind.cpu_world, err);
}

/* sum (or max) over the group, in group order, then mean/scale */
static int mt__cpu_allreduce(mt_runtime *rt, const mt__group *gr, void *buf, int64_t n, int dtype, int mean,
                             float scale, mt_err *err) {
    size_t esz = dtype == MT_I32 ? 4 : sizeof(mt_real);
    void *tmp = NULL;
    if (gr->size > 1) {
        if (!(tmp = MT_MALLOC(esz * (size_t)n + 1))) return mt_errf(err, "out of memory");
        if (mt__cpu_post(rt, gr, buf, NULL, err)) { MT_FREE(tmp); return -1; }
        memcpy(tmp, mt__peer(rt, gr, 0, 0, buf), esz * (size_t)n);
        for (int k = 1; k < gr->size; k++) {
            const void *x = mt__peer(rt, gr, k, 0, buf);
            if (dtype == MT_I32) for (int64_t i = 0; i < n; i++) ((int32_t *)tmp)[i] += ((const int32_t *)x)[i];
            else for (int64_t i = 0; i < n; i++) ((mt_real *)tmp)[i] += ((const mt_real *)x)[i];
        }
        if (mt__cpu_done(rt, gr, err)) { MT_FREE(tmp); return -1; }
        memcpy(buf, tmp, esz * (size_t)n);
        MT_FREE(tmp);
    }
    if (dtype != MT_I32) {
        mt_real *x = (mt_real *)buf;
        if (mean && gr->size > 1) for (int64_t i = 0; i < n; i++) x[i] /= (mt_real)gr->size;
        if (scale != 0.0f && scale != 1.0f) for (int64_t i = 0; i < n; i++) x[i] *= (mt_real)scale;
    }
    return 0;
}

/* out[k*L .. (k+1)*L) = member k's shard */
static int mt__cpu_allgather(mt_runtime *rt, const mt__group *gr, const void *in, void *out, int64_t L, int dtype, mt_err *err) {
    size_t bytes = (dtype == MT_I32 ? 4 : sizeof(mt_real)) * (size_t)L;
    if (mt__cpu_post(rt, gr, in, NULL, err)) return -1;
    for (int k = 0; k < gr->size; k++) memcpy((uint8_t *)out + (size_t)k * bytes, mt__peer(rt, gr, k, 0, in), bytes);
    return mt__cpu_done(rt, gr, err);
}

/* my shard [index*L, (index+1)*L) of the sum; elements past the logical n are 0 */
static int mt__cpu_reduce_scatter(mt_runtime *rt, const mt__group *gr, const mt_real *in, mt_real *out, int64_t n,
                                  int64_t L, float scale, mt_err *err) {
    if (mt__cpu_post(rt, gr, in, NULL, err)) return -1;
    int64_t lo = (int64_t)gr->index * L, hi = lo + L < n ? lo + L : n;
    for (int64_t i = 0; i < L; i++) out[i] = 0;
    for (int k = 0; k < gr->size; k++) {
        const mt_real *x = (const mt_real *)mt__peer(rt, gr, k, 0, in);
        for (int64_t i = lo; i < hi; i++) out[i - lo] = k ? out[i - lo] + x[i] : x[i];
    }
    if (scale != 0.0f && scale != 1.0f) for (int64_t i = 0; i < L; i++) out[i] *= (mt_real)scale;
    return mt__cpu_done(rt, gr, err);
}

/* The expert exchange's engines (EP_COUNTS, EP_DISPATCH, EP_COMBINE) are in section 9a below. */
static int mt__cpu_ep(mt_runtime *rt, const mt_node *n, mt__group *gr, mt_err *err);

/* One collective node on the CPU. */
static int mt__cpu_collective(mt_runtime *rt, const mt_node *n, mt_err *err) {
    const mt_graph *G = &rt->g;
    mt__group *gr = mt__find_group(rt, (uint32_t)n->iattr[0], n->iattr[1]);
    if (!gr) return mt_errf(err, "%s: no communicator for mesh mask 0x%x", mt_ops[n->op].name, n->iattr[0]);
    if (gr->size > 1 && !rt->bind.cpu_world) return mt_errf(err, "%s over %d ranks without a world", mt_ops[n->op].name, gr->size);
    const mt_value *a = &G->values[n->in[0]];
    switch (n->op) {
    case MT_OP_ALLREDUCE:
        return mt__cpu_allreduce(rt, gr, rt->ptr[n->in[0]], mt_value_numel_max(G, a), a->dtype, n->iattr[2], n->fattr[0], err);
    case MT_OP_ALLGATHER:
        return mt__cpu_allgather(rt, gr, rt->ptr[n->in[0]], rt->ptr[n->out[0]], mt_value_numel_max(G, a), a->dtype, err);
    case MT_OP_REDUCE_SCATTER:
        return mt__cpu_reduce_scatter(rt, gr, (const mt_real *)rt->ptr[n->in[0]], (mt_real *)rt->ptr[n->out[0]],
                                      mt_value_numel_logical(G, a), mt_value_numel_max(G, &G->values[n->out[0]]), n->fattr[0], err);
    case MT_OP_SP_GATHER:
        return mt__cpu_allgather(rt, gr, rt->ptr[n->in[0]], rt->ptr[n->out[0]], mt_value_numel_max(G, a), a->dtype, err);
    case MT_OP_SP_SCATTER:
        return mt__cpu_reduce_scatter(rt, gr, (const mt_real *)rt->ptr[n->in[0]], (mt_real *)rt->ptr[n->out[0]],
                                      mt_value_numel_max(G, a), mt_value_numel_max(G, &G->values[n->out[0]]), 0.0f, err);
    default:
        return mt__cpu_ep(rt, n, gr, err);
    }
}

#ifdef MT_CUDA
/* --- CUDA engine: NCCL on the compute stream --- */

static int mt__cuda_ep(mt_runtime *rt, const mt_node *n, mt__group *gr, mt_err *err);

static int mt__cuda_collective(mt_runtime *rt, const mt_node *n, mt_err *err) {
    const mt_graph *G = &rt->g;
    mt_cuda *c = (mt_cuda *)rt->cu;
    mt__group *gr = mt__find_group(rt, (uint32_t)n->iattr[0], n->iattr[1]);
    if (!gr) return mt_errf(err, "%s: no communicator for mesh mask 0x%x", mt_ops[n->op].name, n->iattr[0]);
    void *comm = gr->comm ? gr->comm : rt->world_comm;
    const mt_value *a = &G->values[n->in[0]];
    int rc = 0;
    switch (n->op) {
    case MT_OP_ALLREDUCE: {
        int64_t cnt = mt_value_numel_max(G, a);
        float s = n->iattr[2] && gr->size > 1 ? 1.0f / (float)gr->size : 1.0f;
        if (n->fattr[0] != 0.0f) s *= n->fattr[0];
        if (gr->size > 1) rc = mt_nccl_allreduce(c, comm, rt->ptr[n->in[0]], cnt, a->dtype, 0);
        if (!rc && a->dtype == MT_F32 && s != 1.0f) rc = mt_cuda_scale(c, (float *)rt->ptr[n->in[0]], cnt, s);
        break;
    }
    case MT_OP_ALLGATHER: case MT_OP_SP_GATHER:
        rc = mt_nccl_allgather(c, comm, rt->ptr[n->in[0]], rt->ptr[n->out[0]], mt_value_numel_max(G, a), a->dtype);
        break;
    case MT_OP_SP_SCATTER:   /* a sum in the activations' dtype (bf16 on the GPU) */
        rc = mt_nccl_reduce_scatter(c, comm, rt->ptr[n->in[0]], rt->ptr[n->out[0]], mt_value_numel_max(G, &G->values[n->out[0]]), a->dtype);
        break;
    case MT_OP_REDUCE_SCATTER: {   /* zero the padding, sum-scatter, scale */
        int64_t nl = mt_value_numel_logical(G, a), np = mt_value_numel_max(G, a), L = mt_value_numel_max(G, &G->values[n->out[0]]);
        rc = mt_cuda_memset(c, (float *)rt->ptr[n->in[0]] + nl, 0, sizeof(float) * (size_t)(np - nl)) ||
             mt_nccl_reduce_scatter(c, comm, rt->ptr[n->in[0]], rt->ptr[n->out[0]], L, MT_F32);
        if (!rc && n->fattr[0] != 0.0f && n->fattr[0] != 1.0f) rc = mt_cuda_scale(c, (float *)rt->ptr[n->out[0]], L, n->fattr[0]);
        break;
    }
    default:
        return mt__cuda_ep(rt, n, gr, err);
    }
    return rc ? mt_errf(err, "%s: %s", mt_ops[n->op].name, mt_cuda_error(c)) : 0;
}
#endif

int mt_runtime_allreduce_host(mt_runtime *rt, double *x, int n, int op, mt_err *err) {
    mt__group *gr = mt__find_group(rt, MT__WORLD_MASK, 0);
    if (!gr || gr->size == 1 || n <= 0) return 0;
    if (n > 64) return mt_errf(err, "host reductions take at most 64 numbers");
#ifdef MT_CUDA
    if (rt->backend == MT_BACKEND_CUDA) {
        mt_cuda *c = (mt_cuda *)rt->cu;
        double *d = (double *)rt->scratch;   /* f64 through NCCL */
        if (mt_cuda_copy(c, d, x, sizeof(double) * (size_t)n, 0) || mt_nccl_allreduce(c, rt->world_comm, d, n, -1, op) ||
            mt_cuda_copy(c, x, d, sizeof(double) * (size_t)n, 1))
            return mt_errf(err, "%s", mt_cuda_error(c));
        return 0;
    }
#endif
    double acc[64];
    if (mt__cpu_post(rt, gr, x, NULL, err)) return -1;
    for (int i = 0; i < n; i++) acc[i] = ((const double *)mt__peer(rt, gr, 0, 0, x))[i];
    for (int k = 1; k < gr->size; k++) {
        const double *y = (const double *)mt__peer(rt, gr, k, 0, x);
        for (int i = 0; i < n; i++) acc[i] = op ? (y[i] > acc[i] ? y[i] : acc[i]) : acc[i] + y[i];
    }
    if (mt__cpu_done(rt, gr, err)) return -1;
    memcpy(x, acc, sizeof(double) * (size_t)n);
    return 0;
}

/* ========================================================================
 * 9a. THE EXPERT EXCHANGE: dispatch and combine, end to end
 * Expert parallelism splits the E routed experts over the ep ranks of a
 * group (mesh dimension MT_DIM_EP): rank i of the group holds experts
 * [i*El, (i+1)*El), El = E / ep. Every rank routes its own tokens; the
 * exchange carries each routed row to the rank that holds its expert, and
 * the experts' output back. One MoE layer, as mt__moe (section 5) builds it:
 *   ROUTER       logits -> idx, w (and the per-expert counts)
 *   MOE_PERMUTE  x, idx -> xs [N*K, D] expert-major over all E experts,
 *                offs [E+1]: the rows for rank p's experts are one block,
 *                xs[offs[p*El] .. offs[(p+1)*El])
 *   EP_COUNTS    offs -> recv [ep, El]: recv[s, e] = rows rank s sends to my
 *                local expert e (an all-to-all of counts)
 *   EP_DISPATCH  xs, offs, recv -> xr [R, D], roffs [El+1]: my experts' rows,
 *                expert-major and, inside an expert, in sender order. R is
 *                the symbol "ep_recv_tokens": the plan sizes xr at its bound
 *                (N/tp * K * ep), the data sets it each step (rt->rows)
 *   GMM x 3      the grouped SwiGLU over my El experts, offsets roffs
 *   EP_COMBINE   yr, offs, recv -> ys [N*K, D]: the reverse, each row back
 *                to where its sender had it
 *   MOE_COMBINE  ys, slot, w -> y: each token's K rows weighed and summed
 * With mt_passes.moe_chunks = C > 1 (--moe-chunks) a layer runs MOE_PERMUTE to
 * MOE_COMBINE once per chunk of its tokens (rows [N*c/C, N*(c+1)/C): their i1),
 * each chunk with its own counts, plan and received-rows symbol
 * ("ep_recv_tokens.c<c>"); every chunk's counts and dispatch come first, so a
 * chunk's rows travel while another chunk's experts compute. The router and
 * the layer's per-expert counts stay whole.
 * The three exchange nodes run on queue MT_Q_EP; iattr: i0 the mesh mask
 * (MT_DIM_EP), i1 the channel, i2 ep, i3 El, i4 the ep coordinate (a symbol).
 *  - Checked: mt__check_moe (the EP_* cases); mt_op_is_ep_exchange names them.
 *  - Differentiated: EP_DISPATCH and EP_COMBINE are each other's adjoint over
 *    the same offs and recv (mt__backward_rule); EP_COUNTS has no gradient.
 *  - Rewritten: on ep = 1 mt_pass_elide_collectives removes all three and
 *    pins R to N*K; mt_pass_isolate_ep moves them to a communicator of their
 *    own (MT_CHANNEL_EP) when FSDP uses the same ranks; mt_pass_overlap puts
 *    the work that does not depend on them just after the leading counts and
 *    dispatch (mt__ep_ahead) and the experts' weight gradients after the
 *    backward's combine (mt__dw_behind); mt_pass_recompute re-runs them in a
 *    recomputed block (not counted as received rows). The graph says they
 *    may need host counts (mt_node_syncs_host, mt_node_capturable); the
 *    runtime decides (mt__capturable): with the device-side engine nothing
 *    does, and the whole step is one captured CUDA graph (rt->whole).
 *  - The layout (which of my rows go where on which peer, both directions)
 *    is one function, mt_ep_layout (section 9), that the device-side engine
 *    runs on the GPU and test_ep_layout holds to the CPU engine's order.
 *  - Run: mt__exec_cpu and mt__exec_cuda hand them to mt__cpu_collective and
 *    mt__cuda_collective, which find the node's group (mt__find_group), then
 *    to the engines below, one semantics:
 *      CPU (mt__cpu_ep): ranks are threads sharing an mt_world; each posts
 *      pointers to its rows and offsets and copies its peers' blocks itself.
 *      CUDA, host-synchronized (mt__cuda_ep): EP_COUNTS forms the counts on the device
 *      (mt_cuda_ep_counts), exchanges them (mt_nccl_exchange: ncclSend and
 *      ncclRecv per peer in one NCCL group) and copies offs and recv to the
 *      host (rt->host): the step's only host synchronization
 *      (mt_runtime_host_syncs). The rows then travel as an all-to-all-v with
 *      byte ranges from those counts, through a buffer in peer order
 *      (rt->ep_stage, sized by mt__cuda_ep_stage_bytes, allocated by
 *      mt__bind_cuda) that mt_cuda_ep_regroup turns expert-major (dispatch)
 *      or back (combine); mt_cuda_ep_offsets_table writes roffs. On one rank
 *      without elision (eager graphs) mt__exec_cuda copies the rows itself
 *      (mt_cuda_ep_counts, mt_cuda_ep_offsets).
 *      CUDA, device-side (gr->lsa, chosen at bind by mt__bind_exchange when
 *      the arena is NCCL symmetric memory and NCCL's LSA team holds the whole
 *      group; --ep-exchange): mt_cuda_lsa_counts trades count rows through a
 *      control window and lays out both directions into the layer's plan
 *      (rt->ep_plan); mt_cuda_lsa_rows writes each row straight into the
 *      peer's xr or ys (the same arena offset on every rank) and writes roffs.
 *      Every wait is bounded (the binding's timeout_s) and reported through
 *      the error flag (MT_CUDA_FLAG_PEER). Symbolic rows stay at their bound:
 *      the grouped GEMMs read the offsets, SwiGLU the live count
 *      (rt->rows_dev). The kernels' protocol: moetrain_kernels.cu, "the
 *      device-side expert exchange". Both CUDA engines give the same bits
 *      (the grouped GEMMs take the planned row bound in both).
 *    The rows a rank's experts receive in the forward are counted in
 *    rt->recv_rows (mt_runtime_received_rows; device-side: a device counter
 *    read after the step).
 * ====================================================================== */

static int mt__check_offs(const int32_t *offs, int E, int64_t cap, const char *what, mt_err *err) {
    if (offs[0] != 0 || offs[E] > cap) return mt_errf(err, "%s: bad expert offsets", what);
    for (int e = 0; e < E; e++) if (offs[e + 1] < offs[e]) return mt_errf(err, "%s: bad expert offsets", what);
    return 0;
}
static int mt__cpu_ep(mt_runtime *rt, const mt_node *n, mt__group *gr, mt_err *err) {
    const mt_graph *G = &rt->g;
    int P = n->iattr[2], El = n->iattr[3], me = gr->index;
    if (gr->size != P) return mt_errf(err, "%s: the ep group has %d ranks, the graph says %d", mt_ops[n->op].name, gr->size, P);
    if (n->op == MT_OP_EP_COUNTS) {
        const int32_t *offs = (const int32_t *)rt->ptr[n->in[0]];
        int32_t *recv = (int32_t *)rt->ptr[n->out[0]];
        if (mt__check_offs(offs, P * El, (int64_t)1 << 40, "EP_COUNTS", err) || mt__cpu_post(rt, gr, offs, NULL, err)) return -1;
        for (int s = 0; s < P; s++) {
            const int32_t *o = (const int32_t *)mt__peer(rt, gr, s, 0, offs);
            for (int e = 0; e < El; e++) recv[s * El + e] = o[me * El + e + 1] - o[me * El + e];
        }
        return mt__cpu_done(rt, gr, err);
    }
    const mt_value *src = &G->values[n->in[0]], *dst = &G->values[n->out[0]];
    int64_t D = src->dims[1], cap_dst = mt_value_numel_max(G, dst) / D;
    size_t row = sizeof(mt_real) * (size_t)D;
    const int32_t *offs = (const int32_t *)rt->ptr[n->in[1]], *recv = (const int32_t *)rt->ptr[n->in[2]];
    const uint8_t *x = (const uint8_t *)rt->ptr[n->in[0]];
    uint8_t *y = (uint8_t *)rt->ptr[n->out[0]];
    int64_t total = 0;
    for (int i = 0; i < P * El; i++) {
        if (recv[i] < 0) return mt_errf(err, "%s: negative token count", mt_ops[n->op].name);
        total += recv[i];
    }
    if (n->op == MT_OP_EP_DISPATCH) {
        if (total > cap_dst) return mt_errf(err, "EP_DISPATCH: %lld tokens exceed the planned bound %lld", (long long)total, (long long)cap_dst);
        if (mt__cpu_post(rt, gr, x, offs, err)) return -1;
        int32_t *roffs = (int32_t *)rt->ptr[n->out[1]];
        int64_t at = 0;
        roffs[0] = 0;
        for (int e = 0; e < El; e++) {
            for (int s = 0; s < P; s++) {
                const uint8_t *xs = (const uint8_t *)mt__peer(rt, gr, s, 0, x);
                const int32_t *o = (const int32_t *)mt__peer(rt, gr, s, 1, offs);
                memcpy(y + at * row, xs + (size_t)o[me * El + e] * row, (size_t)recv[s * El + e] * row);
                at += recv[s * El + e];
            }
            roffs[e + 1] = (int32_t)at;
        }
        rt->rows[n->out[0]] = total;
        if (n->phase == MT_PHASE_FORWARD) rt->recv_rows += total;
    } else {
        if (mt__check_offs(offs, P * El, cap_dst, "EP_COMBINE", err) || mt__cpu_post(rt, gr, x, recv, err)) return -1;
        for (int p = 0; p < P; p++) {    /* rank p owns experts [p*El, (p+1)*El) and holds my rows for them */
            const uint8_t *yr = (const uint8_t *)mt__peer(rt, gr, p, 0, x);
            const int32_t *rp = (const int32_t *)mt__peer(rt, gr, p, 1, recv);
            int64_t base = 0;
            for (int e = 0; e < El; e++) {
                int64_t start = base;
                for (int s = 0; s < me; s++) start += rp[s * El + e];
                memcpy(y + (size_t)offs[p * El + e] * row, yr + start * row, (size_t)rp[me * El + e] * row);
                for (int s = 0; s < P; s++) base += rp[s * El + e];
            }
        }
    }
    return mt__cpu_done(rt, gr, err);
}

#ifdef MT_CUDA
/* CUDA: the staging buffer, rows in peer order (dispatch: as received; combine: as sent), and the counts EP_COUNTS sends. */
static size_t mt__cuda_ep_stage_bytes(const mt_graph *G) {
    size_t bytes = 0;
    for (int i = 0; i < G->n_nodes; i++) {
        const mt_node *n = &G->nodes[i];
        if ((n->op == MT_OP_EP_DISPATCH || n->op == MT_OP_EP_COMBINE) && n->iattr[2] > 1) {
            const mt_value *x = &G->values[n->op == MT_OP_EP_DISPATCH ? n->out[0] : n->in[0]];
            size_t need = (size_t)x->nbytes;
            if (need > bytes) bytes = need;
        }
        if (n->op == MT_OP_EP_COUNTS && n->iattr[2] > 1 && (size_t)n->iattr[2] * (size_t)n->iattr[3] * 4 > bytes)
            bytes = (size_t)n->iattr[2] * (size_t)n->iattr[3] * 4;   /* the counts it sends */
    }
    return bytes;
}

static int mt__cuda_ep(mt_runtime *rt, const mt_node *n, mt__group *gr, mt_err *err) {
    const mt_graph *G = &rt->g;
    mt_cuda *c = (mt_cuda *)rt->cu;
    int P = n->iattr[2], El = n->iattr[3];
    if (gr->size != P) return mt_errf(err, "%s: the ep group has %d ranks, the graph says %d", mt_ops[n->op].name, gr->size, P);
    if (gr->lsa) {   /* device-side: the counts never leave the device (mt__bind_exchange) */
        mt_cuda_lsa *l = (mt_cuda_lsa *)gr->lsa;
        int rc;
        if (n->op == MT_OP_EP_COUNTS) {
            rc = mt_cuda_lsa_counts(c, l, (const int32_t *)rt->ptr[n->in[0]], rt->ep_plan[n->out[0]], (int32_t *)rt->ptr[n->out[0]], El);
        } else {
            const int32_t *plan = rt->ep_plan[n->in[2]];
            if (!plan) return mt_errf(err, "%s: its counts come from no EP_COUNTS of this exchange", mt_ops[n->op].name);
            const mt_value *src = &G->values[n->in[0]], *dst = &G->values[n->out[0]];
            int64_t D = src->dims[1];
            int dispatch = n->op == MT_OP_EP_DISPATCH;
            rc = mt_cuda_lsa_rows(c, l, dispatch, rt->ptr[n->in[0]], (size_t)((uint8_t *)rt->ptr[n->out[0]] - rt->arena),
                                  D * mt_dtype_bytes(G, src->dtype), plan, El, mt_value_numel_max(G, dst) / D,
                                  dispatch ? (int32_t *)rt->ptr[n->out[1]] : NULL,
                                  dispatch && n->phase == MT_PHASE_FORWARD ? rt->recv_rows_dev : NULL);
        }
        return rc ? mt_errf(err, "%s: %s", mt_ops[n->op].name, mt_cuda_error(c)) : 0;
    }
    int64_t so[4096], sb[4096], ro[4096], rb[4096];
    if (P > 4096) return mt_errf(err, "ep > 4096");
    if (n->op == MT_OP_EP_COUNTS) {   /* counts per peer and expert, exchanged, then to the host (a sync) */
        int ins = n->in[0], outs = n->out[0];
        int32_t *send = (int32_t *)rt->ep_stage;   /* not the scratch: this may run on the EP stream */
        if (mt_cuda_ep_counts(c, send, (const int32_t *)rt->ptr[ins], P * El, 0)) return mt_errf(err, "%s", mt_cuda_error(c));
        for (int p = 0; p < P; p++) { so[p] = ro[p] = (int64_t)p * El * 4; sb[p] = rb[p] = (int64_t)El * 4; }
        if (mt_nccl_exchange(c, gr->comm, P, send, so, sb, rt->ptr[outs], ro, rb)) return mt_errf(err, "%s", mt_cuda_error(c));
        for (int k = 0; k < 2; k++) {
            int v = k ? outs : ins;
            if (!rt->host[v] && !(rt->host[v] = (int32_t *)MT_MALLOC((size_t)G->values[v].nbytes))) return mt_errf(err, "out of memory");
            if (mt_cuda_copy(c, rt->host[v], rt->ptr[v], (size_t)G->values[v].nbytes, 1)) return mt_errf(err, "%s", mt_cuda_error(c));
        }
        rt->host_syncs++;
        return mt__check_offs(rt->host[ins], P * El, (int64_t)1 << 40, "EP_COUNTS", err);
    }
    const int32_t *offs = rt->host[n->in[1]], *recv = rt->host[n->in[2]];
    if (!offs || !recv) return mt_errf(err, "%s: the expert counts are not on the host (no EP_COUNTS before it)", mt_ops[n->op].name);
    const mt_value *src = &G->values[n->in[0]], *dst = &G->values[n->out[0]];
    int64_t D = src->dims[1], row = D * mt_dtype_bytes(G, src->dtype), total = 0, at = 0;
    for (int i = 0; i < P * El; i++) {
        if (recv[i] < 0) return mt_errf(err, "%s: negative token count", mt_ops[n->op].name);
        total += recv[i];
    }
    int dispatch = n->op == MT_OP_EP_DISPATCH;
    int64_t cap = mt_value_numel_max(G, dispatch ? dst : src) / D;
    if (total > cap || total * row > (int64_t)rt->ep_stage_bytes)
        return mt_errf(err, "%s: %lld tokens exceed the planned bound %lld", mt_ops[n->op].name, (long long)total, (long long)cap);
    /* my rows for peer p: one block of xs; peer s's rows for me: one block of the stage, in sender order */
    for (int p = 0; p < P; p++) {
        int64_t mine = offs[(p + 1) * El] - offs[p * El], theirs = 0;
        for (int e = 0; e < El; e++) theirs += recv[p * El + e];
        int64_t *xo = dispatch ? so : ro, *xb = dispatch ? sb : rb, *yo = dispatch ? ro : so, *yb = dispatch ? rb : sb;
        xo[p] = offs[p * El] * row; xb[p] = mine * row;
        yo[p] = at * row; yb[p] = theirs * row;
        at += theirs;
    }
    const int32_t *drecv = (const int32_t *)rt->ptr[n->in[2]];
    int rc;
    if (dispatch) {
        rc = mt_nccl_exchange(c, gr->comm, P, rt->ptr[n->in[0]], so, sb, rt->ep_stage, ro, rb) ||
             mt_cuda_ep_regroup(c, rt->ptr[n->out[0]], rt->ep_stage, drecv, P, El, row, total, 1) ||
             mt_cuda_ep_offsets_table(c, (int32_t *)rt->ptr[n->out[1]], drecv, P, El);
        rt->rows[n->out[0]] = total;
        if (n->phase == MT_PHASE_FORWARD) rt->recv_rows += total;
    } else {
        rc = mt_cuda_ep_regroup(c, rt->ep_stage, rt->ptr[n->in[0]], drecv, P, El, row, total, 0) ||
             mt_nccl_exchange(c, gr->comm, P, rt->ep_stage, so, sb, rt->ptr[n->out[0]], ro, rb);
    }
    return rc ? mt_errf(err, "%s", mt_cuda_error(c)) : 0;
}

/* The engine, chosen at bind for each ep group (every member decides alike: the
 * window registrations are collective): device-side when the binding allows it,
 * the arena is symmetric memory and NCCL says every rank of the group is load/store
 * accessible; else the host-synchronized NCCL exchange. Device-side, each EP_COUNTS
 * output gets its plan buffer, and each value with symbolic rows learns where the
 * device holds its actual count (rt->rows_dev: the dispatch's roffs[El]). */
static int mt__bind_exchange(mt_runtime *rt, mt_err *err) {
    const mt_graph *G = &rt->g;
    mt_cuda *c = (mt_cuda *)rt->cu;
    int P = 0, El = 0, n_dev = 0, n_groups = 0;
    char why[200] = "";
    for (int i = 0; i < G->n_nodes; i++)
        if (mt_op_is_ep_exchange(G->nodes[i].op) && G->nodes[i].iattr[2] > 1) { P = G->nodes[i].iattr[2]; El = G->nodes[i].iattr[3]; }
    if (!P) return 0;
    if (rt->bind.ep_exchange == MT_EXCHANGE_HOST) snprintf(why, sizeof why, "as asked");
    else if (!rt->arena_symmetric) snprintf(why, sizeof why, "the arena is not NCCL symmetric memory");
    for (int i = 0; i < rt->n_groups; i++) {
        mt__group *gr = &rt->groups[i];
        int used = 0;
        for (int k = 0; k < G->n_nodes && !used; k++)
            used = mt_op_is_ep_exchange(G->nodes[k].op) && G->nodes[k].iattr[2] > 1 && mt__find_group(rt, (uint32_t)G->nodes[k].iattr[0], G->nodes[k].iattr[1]) == gr;
        if (!used) continue;
        n_groups++;
        if (gr->owner != i) { gr->lsa = rt->groups[gr->owner].lsa; n_dev += gr->lsa != NULL; continue; }
        if (why[0]) continue;
        mt_cuda_lsa *l = NULL;
        int r = mt_cuda_lsa_create(c, gr->comm, gr->size, P * El, rt->arena, (size_t)G->arena_bytes, rt->bind.timeout_s, &l, why, sizeof why);
        if (r < 0) {
            mt_cuda_lsa_destroy(c, l, 1);
            return mt_errf(err, "rank %d: the device-side expert exchange: %s", rt->bind.rank, mt_cuda_error(c));
        }
        if (r == 0) { gr->lsa = l; n_dev++; }
    }
    rt->ep_device = n_dev == n_groups;
    if (!rt->ep_device && rt->bind.ep_exchange == MT_EXCHANGE_DEVICE)
        return mt_errf(err, "rank %d: the device-side expert exchange is not possible here: %s", rt->bind.rank, why);
    if (n_dev < n_groups) {
        snprintf(rt->exchange, sizeof rt->exchange, "host-synchronized NCCL all-to-all (%s)", why);
        return 0;
    }
    snprintf(rt->exchange, sizeof rt->exchange, "device-side over NCCL symmetric memory (load/store to %d peers, no host sync)", P);
    rt->ep_plan = (int32_t **)mt__calloc(sizeof(int32_t *) * (size_t)(G->n_values + 1));
    rt->rows_dev = (int32_t **)mt__calloc(sizeof(int32_t *) * (size_t)(G->n_values + 1));
    if (!rt->ep_plan || !rt->rows_dev) return mt_errf(err, "out of memory");
    if (mt_cuda_malloc(c, (void **)&rt->recv_rows_dev, 64) || mt_cuda_memset(c, rt->recv_rows_dev, 0, 64))
        return mt_errf(err, "%s", mt_cuda_error(c));
    for (int i = 0; i < G->n_nodes; i++) {
        const mt_node *n = &G->nodes[i];
        if (n->op == MT_OP_EP_COUNTS && n->iattr[2] > 1 && !rt->ep_plan[n->out[0]] &&
            mt_cuda_malloc(c, (void **)&rt->ep_plan[n->out[0]], sizeof(int32_t) * mt_cuda_lsa_plan_ints(n->iattr[2], n->iattr[3])))
            return mt_errf(err, "%s", mt_cuda_error(c));
        if ((n->op == MT_OP_EP_DISPATCH || n->op == MT_OP_EP_COMBINE) && n->iattr[2] > 1 && !MT_ROLE_IN_ARENA(G->values[n->out[0]].role))
            return mt_errf(err, "%s writes '%s' outside the arena: the device-side exchange cannot reach it", mt_ops[n->op].name,
                           G->values[n->out[0]].name);
        for (int k = 0; k < n->n_out; k++) {
            int v = n->out[k];
            if (v < 0 || G->values[v].dims[0] >= 0) continue;
            if (n->op == MT_OP_EP_DISPATCH && n->iattr[2] > 1 && k == 0) rt->rows_dev[v] = (int32_t *)rt->ptr[n->out[1]] + n->iattr[3];
            else if (n->in[0] >= 0) rt->rows_dev[v] = rt->rows_dev[n->in[0]];
        }
    }
    if (rt->ep_stage) { mt_cuda_free(c, rt->ep_stage); rt->ep_stage = NULL; rt->ep_stage_bytes = 0; }
    return 0;
}
#endif

/* ========================================================================
 * 10. Runtime
 * ====================================================================== */

void mt_binding_single(mt_binding *b) {
    memset(b, 0, sizeof *b);
    b->world = 1;
}

/* Zeroed, 64-byte aligned; the original pointer sits just below. */
static void *mt__aligned(size_t n) {
    uint8_t *raw = (uint8_t *)MT_MALLOC(n + 64 + sizeof(void *));
    if (!raw) return NULL;
    uint8_t *p = (uint8_t *)(((uintptr_t)raw + sizeof(void *) + 63) & ~(uintptr_t)63);
    memcpy(p - sizeof(void *), &raw, sizeof(void *));
    memset(p, 0, n);
    return p;
}
static void mt__aligned_free(void *p) {
    if (!p) return;
    void *raw;
    memcpy(&raw, (uint8_t *)p - sizeof(void *), sizeof(void *));
    MT_FREE(raw);
}

/* ========================================================================
 * 10a. DEVICE HOISTING: one rank, one device, named by its binding
 * The artifact names an architecture, never a device ordinal (section 7).
 * Which device a rank computes on is decided once, when it binds, and
 * nothing after that relies on "the current device":
 *  - mt_binding.device says which: the launcher sets it to the rank's local
 *    rank (LOCAL_RANK or its peers, mt_launch_from_env) or, for one rank, to
 *    train's --gpu; every GPU stays visible (no CUDA_VISIBLE_DEVICES). On the
 *    CPU it is a virtual device id, used in checks and messages.
 *  - mt_runtime_create refuses what cannot bind (mt__bind_check), then makes
 *    everything device-bound on that device: mt__bind_cpu (host regions,
 *    worker threads) or mt__bind_cuda: the context (mt_cuda_create in
 *    moetrain_kernels.cu: cudaSetDevice, the streams, cuBLASLt's handle and
 *    workspaces, the error flag), the tuning checked against this GPU's model
 *    (mt_cuda_device_info, mt_tuning_mismatch, mt_cuda_gemm_preset), the op
 *    workspace (mt__cuda_scratch), the expert exchange's staging buffer
 *    (mt__cuda_ep_stage_bytes), the streams' ordering events, the persistent
 *    region and the arena (mt_cuda_malloc) and NCCL's world communicator
 *    (mt_nccl_init); the groups' communicators are split from it
 *    (mt__bind_groups, mt_nccl_split). Then every value gets its pointer into
 *    this rank's regions and the constants (MT_ROLE_CONST values: the RoPE
 *    tables) are uploaded into them (mt_runtime_write).
 *  - Every later entry point first makes the binding's device current on the
 *    calling thread (mt_cuda_use in mt_runtime_step, mt_runtime_read,
 *    mt_runtime_write, mt_runtime_init_params), so a runtime may be driven
 *    from any thread; mt_cuda_destroy and mt_nccl_init set it too.
 *  - mt_runtime_check_devices proves it at bind and before every step: each
 *    value's bytes lie in this rank's regions and, on CUDA, those regions are
 *    on the binding's GPU (mt_cuda_device_of).
 * test_devices binds two CPU runtimes to virtual devices 0 and 1 and plants a
 * pointer into the other's memory; the multi-rank GPU tests run ranks as
 * threads of one process, each bound to its own GPU.
 * ====================================================================== */
/* What cannot bind: another build's reals, CUDA without CUDA, the GEMMs' dims, a binding that
 * disagrees with the mesh, CPU ranks without their world, CUDA ranks without NCCL's id. */
static int mt__bind_check(const mt_graph *g, const mt_binding *b, mt_err *err) {
    if (g->target.backend == MT_BACKEND_CPU && g->target.real_bytes != (int)sizeof(mt_real))
        return mt_errf(err, "this graph was compiled for %d-byte reals, this build computes in %d-byte reals",
                       g->target.real_bytes, (int)sizeof(mt_real));
#ifndef MT_CUDA
    if (g->target.backend == MT_BACKEND_CUDA)
        return mt_errf(err, "this graph was compiled for CUDA (%s) but this build has no CUDA support: "
                            "build on a machine with the CUDA toolkit, or precompile with --device cpu", g->target.arch);
#else
    if (g->target.backend == MT_BACKEND_CUDA && sizeof(mt_real) != 4)
        return mt_errf(err, "CUDA graphs need a float32 build (MT_REAL=float)");
    for (int i = 0; g->target.backend == MT_BACKEND_CUDA && i < g->n_nodes; i++) {
        const mt_node *n = &g->nodes[i];
        if (n->op != MT_OP_GMM && n->op != MT_OP_GMM_DX && n->op != MT_OP_GMM_DW && n->op != MT_OP_GMM_DX2 && n->op != MT_OP_GMM_DW_SQ &&
            n->op != MT_OP_GMM_GLU) continue;
        const mt_value *W = &g->values[(n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ) ? n->out[0] : n->in[1]];
        if (W->dims[1] % 8 || W->dims[2] % 8)
            return mt_errf(err, "on CUDA the expert GEMMs need dim and moe_inter_dim to be multiples of 8 (got %lld and %lld)",
                           (long long)W->dims[2], (long long)W->dims[1]);
    }
#endif
    if (b->world != mt_mesh_world(&g->mesh))
        return mt_errf(err, "the graph's mesh has %d ranks, the launch has %d", mt_mesh_world(&g->mesh), b->world);
    if (b->rank < 0 || b->rank >= b->world) return mt_errf(err, "rank %d outside world %d", b->rank, b->world);
    if (b->world > 1 && g->target.backend == MT_BACKEND_CPU && (!b->cpu_world || b->cpu_world->n != b->world))
        return mt_errf(err, "CPU ranks are threads of one process: a world of %d needs the shared mt_world of its threads "
                            "(mt_run_thread_ranks)", b->world);
    if (b->world > 1 && g->target.backend == MT_BACKEND_CUDA) {
        int any = 0;
        for (int i = 0; i < MT_NCCL_ID_BYTES; i++) any |= b->nccl_id[i];
        if (!any) return mt_errf(err, "CUDA ranks need NCCL's unique id in the binding (from rank 0's rendezvous)");
    }
    return 0;
}
/* CPU: the regions in host memory and the worker threads; bind.device is a virtual device id. */
static int mt__bind_cpu(mt_runtime *rt, const mt_binding *b, mt_err *err) {
    const mt_graph *G = &rt->g;
    rt->persist = (uint8_t *)mt__aligned((size_t)G->persist_bytes);
    rt->arena = (uint8_t *)mt__aligned((size_t)G->arena_bytes);
    if (!rt->persist || !rt->arena) {
        char h1[32], h2[32];
        return mt_errf(err, "out of memory: the plan needs %s persistent + %s arena", mt__human((double)G->persist_bytes, h1),
                       mt__human((double)G->arena_bytes, h2));
    }
    int nt = b->n_threads > 0 ? b->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (nt > 64) nt = 64;
    return mt_pool_create(&rt->pool, nt, err);
}
#ifdef MT_CUDA
#define MT__CU(rt) ((mt_cuda *)(rt)->cu)
static int mt__cuda_fp8(mt_runtime *rt, const mt_graph *G, const mt_node *n, size_t *need, mt_err *err);
/* Workspace the hungriest node needs (cuBLASLt has its own). */
static size_t mt__cuda_scratch(const mt_graph *G, mt_cuda *cu) {
    size_t need = mt_cuda_sumsq_workspace();
    if (need < 4096 + 4 * (size_t)G->cfg.n_routed_experts) need = 4096 + 4 * (size_t)G->cfg.n_routed_experts;  /* host reductions, EP counts */
    for (int i = 0; i < G->n_nodes; i++) {
        const mt_node *n = &G->nodes[i];
        const mt_value *a = n->in[0] >= 0 ? &G->values[n->in[0]] : NULL, *b = n->in[1] >= 0 ? &G->values[n->in[1]] : NULL;
        size_t w = 0;
        switch (n->op) {
        case MT_OP_EMBED_BWD: w = mt_cuda_embed_backward_workspace((int)a->dims[0], (int)a->dims[1]); break;
        case MT_OP_RMSNORM_BWD: case MT_OP_RMSNORM_BWD_ADD: w = mt_cuda_rmsnorm_backward_workspace((int)b->dims[0], (int)b->dims[1]); break;
        case MT_OP_MATMUL: case MT_OP_MATMUL_ACC: {
            int M = (int)a->dims[n->iattr[0] ? 1 : 0], K = (int)a->dims[n->iattr[0] ? 0 : 1], Nn = (int)b->dims[n->iattr[1] ? 0 : 1];
            w = mt_cuda_matmul_workspace(M, Nn, K, G->values[n->out[0]].dtype, a->dtype, b->dtype);
            break;
        }
        case MT_OP_ATTENTION_BWD: case MT_OP_MLA_ATTENTION_BWD:
            w = mt_cuda_attention_backward_workspace(cu, (int)(a->dims[0] / n->iattr[3]), n->iattr[3], n->iattr[0], n->iattr[1], n->iattr[2]);
            break;
        case MT_OP_CROSS_ENTROPY: w = mt_cuda_cross_entropy_workspace((int)a->dims[0]); break;
        case MT_OP_CE_COMBINE: w = mt_cuda_cross_entropy_workspace((int)G->values[n->in[1]].dims[0]); break;
        case MT_OP_MOE_PERMUTE: w = mt_cuda_moe_permute_workspace(a->dims[0] * b->dims[1]); break;
        case MT_OP_MOE_COMBINE_BWD: w = (size_t)mt_value_numel_max(G, &G->values[n->in[2]]) * 4; break;   /* (mt__q8_moe's map) */
        case MT_OP_GMM: case MT_OP_GMM_DX: case MT_OP_GMM_DW: case MT_OP_GMM_DX2: case MT_OP_GMM_DW_SQ: {
            const mt_value *W = &G->values[(n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ) ? n->out[0] : n->in[1]];
            int mode = n->op == MT_OP_GMM ? 0 : n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ ? 2 : 1;
            w = mt_cuda_gmm_workspace(cu, mode, (int)W->dims[0], (int)W->dims[1], (int)W->dims[2], (int)mt_value_numel_max(G, a) / (int)a->dims[1]);
            break;
        }
        }
        if (mt_node_fp8(n)) mt__cuda_fp8(NULL, G, n, &w, NULL);   /* its quantized operands instead */
        if (w > need) need = w;
    }
    return need;
}

static int mt__q8_plan(mt_runtime *rt, mt_err *err);
static int mt__q8_stale(mt_runtime *rt, mt_err *err);
static int mt__q8_unwritten(const mt_runtime *rt, int v);
/* CUDA: everything device-bound, made on the binding's device (see DEVICE HOISTING above). */
static int mt__bind_cuda(mt_runtime *rt, const mt_binding *b, mt_err *err) {
    const mt_graph *G = &rt->g;
    mt_cuda *cu;
    if (mt_cuda_create(&cu, b->device, err)) return -1;
    rt->cu = cu;
    mt_tuning_info here;
    char why[320];
    if (mt_cuda_device_info(cu, &here)) return mt_errf(err, "%s", mt_cuda_error(cu));
    if (!G->tuned_for.device[0]) {
        snprintf(rt->tuning_note, sizeof rt->tuning_note, "the graph carries no tuning: rank %d chose its GEMM algorithms on %s", b->rank, here.device);
    } else if (mt_tuning_mismatch(&G->tuned_for, &here, why, sizeof why)) {
        if (b->strict_tuning) return mt_errf(err, "rank %d: the graph's tuning does not fit this GPU: %s", b->rank, why);
        snprintf(rt->tuning_note, sizeof rt->tuning_note, "rank %d re-derived the tuning: %s", b->rank, why);
    } else if (mt_cuda_gemm_preset(cu, G->tuning, G->n_tuning)) {
        return mt_errf(err, "%s", mt_cuda_error(cu));
    } else {
        mt_cuda_set_split_sms(cu, G->tuned_for.n_sms);
    }
    mt_cuda_set_attn_recompute_dq(cu, b->attn_recompute_dq);
    rt->scratch_bytes = mt__cuda_scratch(G, cu);
    rt->ep_stage_bytes = mt__cuda_ep_stage_bytes(G);   /* the expert exchange stages rows in peer order */
    if (G->overlap) {   /* streams per queue: the schedule, and which nodes' events someone waits for */
        if (mt_schedule_build(G, &rt->sched, err)) return -1;
        rt->ev_of = (int32_t *)mt__calloc(sizeof(int32_t) * (size_t)(G->n_nodes + 1));
        rt->ev_used = (uint8_t *)mt__calloc((size_t)G->n_nodes + 1);
        if (!rt->ev_of || !rt->ev_used) return mt_errf(err, "out of memory");
        for (int k = 0; k < rt->sched.n_wait; k++) rt->ev_used[rt->sched.wait[k]] = 1;
        if (mt_cuda_queue_events(cu, G->n_nodes + 1)) return mt_errf(err, "CUDA device %d: %s", b->device, mt_cuda_error(cu));
    }
    int ep_over_ranks = 0;   /* the device-side exchange maps the arena into the peers: NCCL symmetric memory */
    for (int i = 0; i < G->n_nodes; i++) ep_over_ranks |= mt_op_is_ep_exchange(G->nodes[i].op) && G->nodes[i].iattr[2] > 1;
    rt->arena_symmetric = b->world > 1 && ep_over_ranks && b->ep_exchange != MT_EXCHANGE_HOST;
    if (mt_cuda_malloc(cu, (void **)&rt->persist, (size_t)G->persist_bytes) ||
        (rt->arena_symmetric ? mt_cuda_malloc_symmetric(cu, (void **)&rt->arena, (size_t)G->arena_bytes)
                             : mt_cuda_malloc(cu, (void **)&rt->arena, (size_t)G->arena_bytes)) ||
        mt_cuda_malloc(cu, &rt->scratch, rt->scratch_bytes) || mt_cuda_memset(cu, rt->persist, 0, (size_t)G->persist_bytes) ||
        (rt->ep_stage_bytes && mt_cuda_malloc(cu, &rt->ep_stage, rt->ep_stage_bytes)))
        return mt_errf(err, "CUDA device %d: %s", b->device, mt_cuda_error(cu));
    if (mt__q8_plan(rt, err)) return -1;
    if (b->world > 1 && mt_nccl_init(cu, &rt->world_comm, b->nccl_id, b->world, b->rank))
        return mt_errf(err, "rank %d (device %d): joining the NCCL world of %d: %s", b->rank, b->device, b->world, mt_cuda_error(cu));
    return 0;
}
#endif

int mt_runtime_create(mt_runtime **out, const mt_graph *g, const mt_binding *b, mt_err *err) {
    *out = NULL;
    if (mt__bind_check(g, b, err)) return -1;
    mt_runtime *rt = (mt_runtime *)mt__calloc(sizeof *rt);
    if (!rt) return mt_errf(err, "out of memory");
    rt->bind = *b;
    rt->backend = g->target.backend;
    mt_mesh_coords(&g->mesh, b->rank, rt->bind.coord);
    if (mt_graph_copy(&rt->g, g, err)) { MT_FREE(rt); return -1; }
    const mt_graph *G = &rt->g;
    rt->ptr = (void **)mt__calloc(sizeof(void *) * (size_t)(G->n_values + 1));
    rt->rows = (int64_t *)mt__calloc(sizeof(int64_t) * (size_t)(G->n_values + 1));
    rt->sym = (int64_t *)mt__calloc(sizeof(int64_t) * (size_t)(G->n_syms + 1));
    rt->counts = (int32_t *)mt__calloc(sizeof(int32_t) * (size_t)(G->n_values + 1));
    rt->host = (int32_t **)mt__calloc(sizeof(int32_t *) * (size_t)(G->n_values + 1));
    if (!rt->ptr || !rt->rows || !rt->sym || !rt->counts || !rt->host) { mt_runtime_destroy(rt); return mt_errf(err, "out of memory"); }
    if (rt->backend == MT_BACKEND_CPU) {
        if (mt__bind_cpu(rt, b, err)) { mt_runtime_destroy(rt); return -1; }
    }
#ifdef MT_CUDA
    else if (mt__bind_cuda(rt, b, err)) { mt_runtime_destroy(rt); return -1; }
#endif
    if (mt__bind_groups(rt, err)) { mt_runtime_destroy(rt); return -1; }
    /* bind symbols: coordinates from the binding, sizes at their bounds until data says otherwise */
    for (int s = 0; s < G->n_syms; s++)
        rt->sym[s] = G->syms[s].kind == MT_SYM_COORD ? rt->bind.coord[G->syms[s].mesh_dim] : G->syms[s].max;
    for (int v = 0; v < G->n_values; v++) {
        const mt_value *x = &G->values[v];
        rt->ptr[v] = (MT_ROLE_IN_ARENA(x->role) ? rt->arena : rt->persist) + x->offset;
        if (x->flags & MT_VF_COUNTS) rt->counts[rt->n_moe++] = v;
        rt->rows[v] = x->ndim ? mt__dim_max(G, x->dims[0]) : 1;
        if (x->role == MT_ROLE_CONST && mt_runtime_write(rt, v, G->consts + x->data_offset, err)) { mt_runtime_destroy(rt); return -1; }
    }
    rt->n_tokens = (int64_t)G->cfg.batch * G->cfg.seq_len;
#ifdef MT_CUDA
    if (rt->backend == MT_BACKEND_CUDA) {
        if (mt__bind_exchange(rt, err)) { mt_runtime_destroy(rt); return -1; }
        rt->whole = b->world > 1 && G->capture;   /* every node capturable: the step is one graph */
        for (int i = 0; rt->whole && i < G->n_nodes; i++) rt->whole = mt__capturable(rt, &G->nodes[i]);
    }
#endif
    if (mt_runtime_check_devices(rt, err)) { mt_runtime_destroy(rt); return -1; }
    *out = rt;
    return 0;
}

/* Every value inside this rank's persistent region or arena; on CUDA those regions on the binding's GPU. */
int mt_runtime_check_devices(const mt_runtime *rt, mt_err *err) {
    const mt_graph *G = &rt->g;
    const uint8_t *lo[2] = {rt->persist, rt->arena};
    int64_t len[2] = {G->persist_bytes, G->arena_bytes};
    for (int v = 0; v < G->n_values; v++) {
        const uint8_t *p = (const uint8_t *)rt->ptr[v];
        int r = MT_ROLE_IN_ARENA(G->values[v].role) ? 1 : 0;
        if (!(p >= lo[r] && p + G->values[v].nbytes <= lo[r] + len[r]) && !(G->values[v].nbytes == 0 && p == lo[r] + len[r]))
            return mt_errf(err, "rank %d: value '%s' is bound to memory outside this rank's %s on %s %d: another device's buffer",
                           rt->bind.rank, G->values[v].name, r ? "arena" : "persistent region",
                           rt->backend == MT_BACKEND_CPU ? "virtual device" : "GPU", rt->bind.device);
    }
#ifdef MT_CUDA
    if (rt->backend == MT_BACKEND_CUDA)
        for (int r = 0; r < 2; r++) {
            int dev = -1;
            if (!len[r]) continue;
            if (mt_cuda_device_of(MT__CU(rt), lo[r], &dev)) return mt_errf(err, "%s", mt_cuda_error(MT__CU(rt)));
            if (dev != rt->bind.device)
                return mt_errf(err, "rank %d: its %s is on GPU %d, the binding says GPU %d", rt->bind.rank, r ? "arena" : "persistent region",
                               dev, rt->bind.device);
        }
#endif
    return 0;
}
const char *mt_runtime_tuning_note(const mt_runtime *rt) { return rt->tuning_note; }
uint64_t mt_runtime_kernel_digest(mt_runtime *rt, int *preset, int *derived) {
    if (preset) *preset = 0;
    if (derived) *derived = 0;
#ifdef MT_CUDA
    if (rt->backend == MT_BACKEND_CUDA) return mt_cuda_gemm_digest(MT__CU(rt), preset, derived);
#endif
    (void)rt;
    return 0;
}

void mt_runtime_destroy(mt_runtime *rt) {
    if (!rt) return;
#ifdef MT_CUDA
    /* captured graphs first (NCCL holds a communicator until the graphs that captured its work are gone),
       then the exchange's windows, then the communicators */
    for (int i = 0; rt->cu && rt->graphs && i < rt->g.n_nodes; i++) mt_cuda_graph_destroy(rt->graphs[i]);
    MT_FREE(rt->graphs);
    MT_FREE(rt->prof_wait);
    mt_cuda_graph_destroy(rt->step_graph);
    mt_cuda_graph_destroy(rt->prof_graph);
    rt->step_graph = rt->prof_graph = NULL;
    for (int i = 0; rt->cu && rt->groups && i < rt->n_groups; i++)
        if (rt->groups[i].owner == i) mt_cuda_lsa_destroy(MT__CU(rt), (mt_cuda_lsa *)rt->groups[i].lsa, 0);
    for (int v = 0; rt->cu && rt->ep_plan && v < rt->g.n_values; v++) mt_cuda_free(MT__CU(rt), rt->ep_plan[v]);
    MT_FREE(rt->ep_plan); MT_FREE(rt->rows_dev);
    if (rt->cu) mt_cuda_free(MT__CU(rt), rt->recv_rows_dev);
#endif
    mt__free_groups(rt, 0);
    for (int v = 0; rt->host && v < rt->g.n_values; v++) MT_FREE(rt->host[v]);
    MT_FREE(rt->host);
    mt_pool_destroy(rt->pool);
    if (rt->backend == MT_BACKEND_CPU) {
        mt__aligned_free(rt->persist); mt__aligned_free(rt->arena);
    }
#ifdef MT_CUDA
    else if (rt->cu) {
        mt_cuda_free(MT__CU(rt), rt->persist); mt_cuda_free(MT__CU(rt), rt->scratch);
        if (rt->arena_symmetric) mt_cuda_free_symmetric(MT__CU(rt), rt->arena); else mt_cuda_free(MT__CU(rt), rt->arena);
        mt_cuda_free(MT__CU(rt), rt->ep_stage);
        for (int i = 0; i < rt->n_q8; i++) mt_cuda_free(MT__CU(rt), rt->q8[i].mem);
        mt_cuda_free(MT__CU(rt), rt->q8_pool);
        mt_cuda_destroy(MT__CU(rt));
    }
    mt_schedule_free(&rt->sched);
    MT_FREE(rt->ev_of); MT_FREE(rt->ev_used);
    MT_FREE(rt->q8); MT_FREE(rt->q8_use);
#endif
    MT_FREE(rt->ptr); MT_FREE(rt->rows); MT_FREE(rt->sym); MT_FREE(rt->counts);
    mt_graph_free(&rt->g);
    MT_FREE(rt);
}
const mt_graph *mt_runtime_graph(const mt_runtime *rt) { return &rt->g; }
void mt_runtime_set_profile(mt_runtime *rt, int on) { rt->bind.profile = on; }
void mt_runtime_set_nan_check(mt_runtime *rt, int on) { rt->bind.nan_check = on; }
void mt_runtime_profile(const mt_runtime *rt, double ms[MT_NOPS], int64_t calls[MT_NOPS]) {
    for (int i = 0; i < MT_NOPS; i++) { ms[i] = rt->prof_ms[i]; calls[i] = rt->prof_calls[i]; }
}
int mt_runtime_profile_comm(const mt_runtime *rt, double out[4]) {
    double k = rt->prof_step[4];
    for (int i = 0; i < 4; i++) out[i] = k > 0 ? rt->prof_step[i] / k : 0;
    return k > 0;
}
int mt_runtime_profile_waits(const mt_runtime *rt, int k, int32_t *node, double *ms) {
    int n = 0;
    double steps = rt->prof_step[4];
    for (int i = 0; rt->prof_wait && steps > 0 && i < rt->g.n_nodes; i++) {
        double t = rt->prof_wait[i] / steps;
        if (t <= 0) continue;
        int at = n < k ? n++ : k;   /* insertion into the k longest so far, longest first */
        while (at > 0 && ms[at - 1] < t) { if (at < k) { ms[at] = ms[at - 1]; node[at] = node[at - 1]; } at--; }
        if (at < k) { ms[at] = t; node[at] = i; }
    }
    return n;
}
void *mt_runtime_value(mt_runtime *rt, int v) { return (v >= 0 && v < rt->g.n_values) ? rt->ptr[v] : NULL; }
int mt_runtime_n_moe_layers(const mt_runtime *rt) { return rt->n_moe; }
int64_t mt_runtime_multi_tensor_nodes(const mt_runtime *rt) { return rt->multi_nodes; }
int mt_runtime_backend(const mt_runtime *rt) { return rt->backend; }
int mt_runtime_fp8_shared(const mt_runtime *rt) { return rt->n_q8; }
int mt_runtime_fp8_both(const mt_runtime *rt) {
    int k = 0;
    for (int i = 0; i < rt->n_q8; i++) k += rt->q8[i].rows_node >= 0;
    return k;
}
static int mt__q8_by(const mt_runtime *rt, int moe) {
    int k = 0;
    for (int i = 0; i < rt->n_q8; i++) {
        int p = rt->q8[i].producer, op = p >= 0 ? rt->g.nodes[p].op : -1;
        k += p >= 0 && (op == MT_OP_MOE_PERMUTE || op == MT_OP_MOE_COMBINE_BWD) == moe;
    }
    return k;
}
int mt_runtime_fp8_by_swiglu(const mt_runtime *rt) { return mt__q8_by(rt, 0); }
int mt_runtime_fp8_by_moe(const mt_runtime *rt) { return mt__q8_by(rt, 1); }
int mt_runtime_fp8_by_optimizer(const mt_runtime *rt) {
    int k = 0;
    for (int i = 0; i < rt->n_q8; i++) k += rt->q8[i].adamw >= 0;
    return k;
}
size_t mt_runtime_peak_bytes(const mt_runtime *rt) {
#ifdef MT_CUDA
    if (rt->backend == MT_BACKEND_CUDA) return mt_cuda_peak_bytes(MT__CU(rt));
#endif
    return (size_t)(rt->g.persist_bytes + rt->g.arena_bytes);
}

int mt_runtime_read(mt_runtime *rt, int v, void *dst, mt_err *err) {
    if (v < 0 || v >= rt->g.n_values) return mt_errf(err, "no value %d", v);
    size_t n = (size_t)rt->g.values[v].nbytes;
    if (rt->backend == MT_BACKEND_CPU) { memcpy(dst, rt->ptr[v], n); return 0; }
#ifdef MT_CUDA
    if (mt_cuda_use(MT__CU(rt))) return mt_errf(err, "%s", mt_cuda_error(MT__CU(rt)));
    const mt_value *x = &rt->g.values[v];
    if (mt__q8_unwritten(rt, v) &&   /* a bf16 weight AdamW leaves to its FP8 forms: from its master first */
        mt_cuda_cast(MT__CU(rt), rt->ptr[v], x->dtype, rt->ptr[x->param], MT_F32, mt_value_numel_max(&rt->g, x)))
        return mt_errf(err, "refreshing '%s': %s", x->name, mt_cuda_error(MT__CU(rt)));
    if (mt_cuda_copy(MT__CU(rt), dst, rt->ptr[v], n, 1)) return mt_errf(err, "reading '%s': %s", rt->g.values[v].name, mt_cuda_error(MT__CU(rt)));
#endif
    return 0;
}
int mt_runtime_write(mt_runtime *rt, int v, const void *src, mt_err *err) {
    if (v < 0 || v >= rt->g.n_values) return mt_errf(err, "no value %d", v);
    size_t n = (size_t)rt->g.values[v].nbytes;
    if (rt->backend == MT_BACKEND_CPU) { memcpy(rt->ptr[v], src, n); return 0; }
#ifdef MT_CUDA
    if (mt_cuda_use(MT__CU(rt))) return mt_errf(err, "%s", mt_cuda_error(MT__CU(rt)));
    if (mt_cuda_copy(MT__CU(rt), rt->ptr[v], src, n, 0)) return mt_errf(err, "writing '%s': %s", rt->g.values[v].name, mt_cuda_error(MT__CU(rt)));
    if (rt->g.values[v].role == MT_ROLE_PARAM) return mt__q8_stale(rt, err);   /* FP8 forms of the old weights */
#endif
    return 0;
}

/* bf16 compute copies follow their f32 masters (after init or load) */
int mt_runtime_sync_shadows(mt_runtime *rt, mt_err *err) {
    (void)rt; (void)err;
#ifdef MT_CUDA
    const mt_graph *G = &rt->g;
    if (rt->backend != MT_BACKEND_CUDA) return 0;
    for (int i = 0; i < G->n_values; i++) {
        const mt_value *v = &G->values[i];
        if (v->role != MT_ROLE_PARAM || v->param < 0) continue;
        if (mt_cuda_cast(MT__CU(rt), rt->ptr[i], v->dtype, rt->ptr[v->param], MT_F32, mt_value_numel_max(G, v)))
            return mt_errf(err, "refreshing '%s': %s", v->name, mt_cuda_error(MT__CU(rt)));
    }
    return mt__q8_stale(rt, err);
#endif
    return 0;
}

int mt_runtime_expert_counts(mt_runtime *rt, int i, int32_t *counts) {
    mt_err e;
    if (i < 0 || i >= rt->n_moe) return -1;
    if (mt_runtime_read(rt, rt->counts[i], counts, &e)) return -1;
    return (int)rt->g.values[rt->counts[i]].dims[0];
}

/* The global index of local expert e of a stacked expert parameter. */
static int mt__global_expert(const mt_runtime *rt, const mt_value *v, int e) {
    return rt->bind.coord[MT_DIM_EP] * (int)v->dims[0] + e;
}

/* A stacked expert parameter's name for expert e (its '*'), or the name as it is. */
static void mt__expert_name(char *out, size_t n, const char *name, int e) {
    snprintf(out, n, "%s", name);
    char *star = strchr(out, '*');
    if (star) {
        char rest[MT_NAME_LEN];
        snprintf(rest, sizeof rest, "%s", star + 1);
        snprintf(star, n - (size_t)(star - out), "%d%s", e, rest);
    }
}

/* Each parameter draws from its own stream, keyed by (seed, name); stacked
 * experts draw one stream per global expert, so values do not depend on the
 * expert-parallel layout. Element i of a stream is mt_init_draw(table,
 * mt_init_bits(key, i)): it depends on nothing else, so an FSDP shard fills its
 * own flat range [i*L, (i+1)*L) of the whole tensor with the values the whole
 * tensor has on one rank, the CPU fills in parallel, and a GPU fills its own
 * memory in place with the CPU's bits (no host buffer, no upload). */
typedef struct {
    mt_real *p; const float *table; const uint64_t *keys; int init; double std;
    int64_t per, lo, n, c0;   /* elements per stream, first logical element stored, logical size, first stream */
    uint32_t tp;              /* a weight split over tp (MT_VF_TP_ROWS | MT_VF_TP_COLS): element l of this rank's part */
    int64_t tp_at, tp_cols, tp_parts;   /* is element mt__tp_element(l) of the whole weight */
} mt__init_job;
/* The whole weight's flat index of element l of tp part `at` (of `parts`): rows split, the parts
 * follow each other; columns split, each row holds the parts' `cols` columns side by side. */
static int64_t mt__tp_element(uint32_t split, int64_t l, int64_t at, int64_t len, int64_t cols, int64_t parts) {
    if (split & MT_VF_TP_ROWS) return at * len + l;
    if (split & MT_VF_TP_COLS) return (l / cols) * cols * parts + at * cols + l % cols;
    return l;
}
static void mt__init_range(void *ctx, int64_t k0, int64_t k1) {
    const mt__init_job *j = (const mt__init_job *)ctx;
    for (int64_t k = k0; k < k1; k++) {
        int64_t l = j->lo + k;
        double x = 0;   /* the padding past the last shard's end stays 0 */
        if (l < j->n) {
            if (j->init == MT_INIT_ONE) x = 1;
            else if (j->init == MT_INIT_NORMAL) {
                int64_t c = l / j->per, e = mt__tp_element(j->tp, l - c * j->per, j->tp_at, j->per, j->tp_cols, j->tp_parts);
                x = mt_init_draw(j->table, mt_init_bits(j->keys[c - j->c0], (uint64_t)e)) * j->std;
            }
        }
        j->p[k] = (mt_real)x;
    }
}

int mt_runtime_init_params(mt_runtime *rt, uint64_t seed, mt_err *err) {
    const mt_graph *G = &rt->g;
    int cuda = rt->backend == MT_BACKEND_CUDA, on_device = cuda && !rt->bind.init_on_host;
#ifdef MT_CUDA
    if (cuda && mt_cuda_use(MT__CU(rt))) return mt_errf(err, "%s", mt_cuda_error(MT__CU(rt)));
#endif
    int64_t max_keys = 1;
    for (int i = 0; i < G->n_values; i++)
        if (G->values[i].flags & MT_VF_EXPERTS && G->values[i].dims[0] > max_keys) max_keys = G->values[i].dims[0];
    float *table = (float *)MT_MALLOC(sizeof(float) * (MT_INIT_TABLE + 1));
    uint64_t *keys = (uint64_t *)MT_MALLOC(sizeof(uint64_t) * (size_t)max_keys);
    mt_pool *pool = rt->pool, *own = NULL;
    void *dev = NULL;   /* on the device: the table, then the keys */
    int rc = 0;
    if (!table || !keys) rc = mt_errf(err, "out of memory");
    else mt_init_table(table);
    if (!rc && cuda && !on_device && !pool) {   /* the CUDA runtime keeps no CPU workers: borrow some for the fill */
        int nt = (int)sysconf(_SC_NPROCESSORS_ONLN);
        if (mt_pool_create(&own, nt > 64 ? 64 : nt, err)) rc = -1;
        pool = own;
    }
#ifdef MT_CUDA
    size_t tbytes = (sizeof(float) * (MT_INIT_TABLE + 1) + 255) / 256 * 256;   /* the keys after it, aligned */
    if (!rc && on_device && (mt_cuda_malloc(MT__CU(rt), &dev, tbytes + sizeof(uint64_t) * (size_t)max_keys) ||
                             mt_cuda_copy(MT__CU(rt), dev, table, sizeof(float) * (MT_INIT_TABLE + 1), 0)))
        rc = mt_errf(err, "initializing parameters: %s", mt_cuda_error(MT__CU(rt)));
#endif
    for (int i = 0; i < G->n_values && !rc; i++) {
        const mt_value *v = &G->values[i];
        if (v->role != MT_ROLE_PARAM && v->role != MT_ROLE_OPT) continue;
        if (v->role == MT_ROLE_PARAM && v->param >= 0) continue;  /* compute shadows follow their master */
        if (v->role == MT_ROLE_OPT && v->dtype == MT_BF16) {    /* bf16 moments: zeros (+0.0 is all bits 0) */
            if (v->init != MT_INIT_ZERO && v->init != MT_INIT_NONE) { rc = mt_errf(err, "initializing '%s': bf16 state starts at zero", v->name); break; }
            if (!cuda) { memset(rt->ptr[i], 0, (size_t)v->nbytes); continue; }
#ifdef MT_CUDA
            if (mt_cuda_memset(MT__CU(rt), rt->ptr[i], 0, (size_t)v->nbytes)) rc = mt_errf(err, "initializing '%s': %s", v->name, mt_cuda_error(MT__CU(rt)));
#endif
            continue;
        }
        if (cuda && v->dtype != MT_F32) { rc = mt_errf(err, "initializing '%s': state on the device is f32, not %s", v->name, mt__dtype_names[v->dtype]); break; }
        int64_t n = mt_value_numel_logical(G, v), stored = mt_value_numel_max(G, v);
        int chunks = (v->flags & MT_VF_EXPERTS) ? (int)v->dims[0] : 1;
        mt__init_job job = {(mt_real *)rt->ptr[i], table, keys, v->init, (double)v->init_std, n / chunks, 0, n, 0,
                            v->flags & MT_VF_TP, rt->bind.coord[MT_DIM_TP], v->ndim > 1 ? v->dims[1] : 1, G->mesh.size[MT_DIM_TP]};
        if (job.per < 1) job.per = 1;
        if (v->shard) job.lo = (int64_t)mt_mesh_group(&G->mesh, v->shard, rt->bind.rank, NULL) * stored;
        int64_t hi = job.lo + stored < n ? job.lo + stored : n, nk = 0;
        if (v->init == MT_INIT_NORMAL && hi > job.lo) {   /* the streams [lo, hi) touches */
            job.c0 = job.lo / job.per;
            nk = (hi - 1) / job.per - job.c0 + 1;
            for (int64_t c = 0; c < nk; c++) {
                char nm[MT_NAME_LEN + 32];
                mt__expert_name(nm, sizeof nm, v->name, mt__global_expert(rt, v, (int)(job.c0 + c)));
                keys[c] = mt_hash(nm, strlen(nm), seed * 0x9e3779b97f4a7c15ull + 1);
            }
        }
        if (!cuda) { mt_pool_for(pool, stored, mt__init_range, &job); continue; }
#ifdef MT_CUDA
        mt_cuda *cu = MT__CU(rt);
        if (on_device && !job.tp) {   /* (a tp part's elements are not contiguous in the whole: filled on the host) */
            uint64_t *dkeys = (uint64_t *)((char *)dev + tbytes);
            if ((nk && mt_cuda_copy(cu, dkeys, keys, sizeof(uint64_t) * (size_t)nk, 0)) ||
                mt_cuda_init_fill(cu, (float *)rt->ptr[i], stored, job.lo, n, job.per, v->init, dkeys, job.c0, (const float *)dev,
                                  v->init_std))
                rc = mt_errf(err, "initializing '%s': %s", v->name, mt_cuda_error(cu));
        } else if (v->init == MT_INIT_ZERO || v->init == MT_INIT_NONE) {   /* zeros need no host buffer */
            if (mt_cuda_memset(cu, rt->ptr[i], 0, (size_t)v->nbytes)) rc = mt_errf(err, "initializing '%s': %s", v->name, mt_cuda_error(cu));
        } else {   /* filled on the host by every core, then uploaded */
            job.p = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)(stored + 1));
            if (!job.p) { rc = mt_errf(err, "out of memory initializing '%s'", v->name); break; }
            mt_pool_for(pool, stored, mt__init_range, &job);
            rc = mt_runtime_write(rt, i, job.p, err);
            MT_FREE(job.p);
        }
#endif
    }
#ifdef MT_CUDA
    if (cuda && !rc && mt_cuda_sync(MT__CU(rt))) rc = mt_errf(err, "initializing parameters: %s", mt_cuda_error(MT__CU(rt)));
    if (dev) mt_cuda_free(MT__CU(rt), dev);
#endif
    (void)dev;
    mt_pool_destroy(own);
    MT_FREE(table);
    MT_FREE(keys);
    return rc ? -1 : mt_runtime_sync_shadows(rt, err);
}

int mt_runtime_copy_params(mt_runtime *dst, mt_runtime *src, mt_err *err) {
    for (int i = 0; i < dst->g.n_values; i++) {
        const mt_value *v = &dst->g.values[i];
        if (v->role != MT_ROLE_PARAM || v->param >= 0) continue;
        int j = mt_graph_find(&src->g, v->name);
        if (j < 0 || src->g.values[j].nbytes != v->nbytes || src->g.values[j].dtype != v->dtype)
            return mt_errf(err, "parameter '%s' is missing or differs in the source runtime", v->name);
        void *buf = MT_MALLOC((size_t)v->nbytes + 1);
        if (!buf) return mt_errf(err, "out of memory");
        int rc = mt_runtime_read(src, j, buf, err) || mt_runtime_write(dst, i, buf, err);
        MT_FREE(buf);
        if (rc) return -1;
    }
    return mt_runtime_sync_shadows(dst, err);
}

/* Leading rows of a value: its dim 0, or for a symbolic dim what the data said. */
static int64_t mt__nrows(const mt_runtime *rt, int v) {
    const mt_value *x = &rt->g.values[v];
    return x->dims[0] < 0 ? rt->rows[v] : x->dims[0];
}
/* The grouped GEMMs' row bound: the planned one over several ranks, so both exchange engines launch
 * the same kernels (the split of dW depends on it) and give the same bits; their offsets say the rest. */
#ifdef MT_CUDA
static int64_t mt__gmm_bound(const mt_runtime *rt, int v) {
    const mt_value *x = &rt->g.values[v];
    return x->dims[0] < 0 && rt->bind.world > 1 ? mt__dim_max(&rt->g, x->dims[0]) : mt__nrows(rt, v);
}
#endif
static int64_t mt__cols(const mt_runtime *rt, int v) {
    const mt_value *x = &rt->g.values[v];
    int64_t c = 1;
    for (int d = 1; d < x->ndim; d++) c *= x->dims[d];
    return c;
}

/* The loss ops' mean (i1: rows counted, 0: all N) and backward scale (f0: weight, 0: 1). */
static int mt__ce_count(const mt_node *n, int N) { return n->iattr[1] > 0 ? n->iattr[1] : N; }
static double mt__ce_scale(const mt_node *n, int N) { return (n->fattr[0] > 0 ? (double)n->fattr[0] : 1.0) / mt__ce_count(n, N); }
/* EMBED / EMBED_BWD under tp: the first of this rank's tokens (i0 parts, i1 which part) */
static int64_t mt__token_slice(const mt_runtime *rt, const mt_node *n) {
    if (n->iattr[0] <= 1) return 0;
    const mt_value *x = &rt->g.values[n->op == MT_OP_EMBED ? n->out[0] : n->in[0]];
    return rt->sym[n->iattr[1]] * x->dims[0];
}
/* FP8 GEMMs (mt_pass_fp8): how a marked node's input i is quantized. ROWS: 1 x 128 tiles along each row
 * (the GEMM reduces along the row); COLS: 128 x 1 tiles down each column, by expert where the node has
 * offsets (it reduces over tokens: a weight gradient); BLOCKS: 128 x 128 (a weight); NONE: an addend. */
enum { MT__Q8_NONE = 0, MT__Q8_ROWS, MT__Q8_COLS, MT__Q8_BLOCKS };
static int mt__fp8_operand(const mt_node *n, int i) {
    switch (n->op) {
    case MT_OP_MATMUL: case MT_OP_MATMUL_ACC:
        if (i > 1) return MT__Q8_NONE;
        return n->iattr[0] ? MT__Q8_COLS : i == 0 ? MT__Q8_ROWS : MT__Q8_BLOCKS;
    case MT_OP_GMM: case MT_OP_GMM_DX: case MT_OP_GMM_DX2: case MT_OP_GMM_GLU:
        return i == 0 || (i == 3 && n->op == MT_OP_GMM_DX2) ? MT__Q8_ROWS : i == 1 || i == 3 || i == 4 ? MT__Q8_BLOCKS : MT__Q8_NONE;
    case MT_OP_GMM_DW: case MT_OP_GMM_DW_SQ: return i < 2 ? MT__Q8_COLS : MT__Q8_NONE;
    }
    return MT__Q8_NONE;
}
static int mt__cpu_fp8(mt_runtime *rt, const mt_node *n, mt_err *err);
/* A MoE op over a chunk of tokens (mt__moe): its n = nk / K tokens from row i1 of N. An output
 * [N, cols] holds them there, and zeros (bytes 0, any dtype) in the other rows. */
static int64_t mt__chunk_rows(const mt_graph *G, int nk_value, int K) {
    return G->values[nk_value].dims[0] / K;
}
static void mt__zero_other_rows(uint8_t *p, int64_t row_bytes, const mt_node *n, int64_t rows, int64_t N) {
    int64_t r0 = n->iattr[1];
    memset(p, 0, (size_t)(r0 * row_bytes));
    memset(p + (r0 + rows) * row_bytes, 0, (size_t)((N - r0 - rows) * row_bytes));
}
static int mt__exec_cpu(mt_runtime *rt, const mt_node *n, mt_err *err) {
    mt_graph *G = &rt->g;
    void **P = rt->ptr;
    if (mt_node_fp8(n)) return mt__cpu_fp8(rt, n, err);
#define R_(i) ((mt_real *)P[n->in[i]])
#define I_(i) ((int32_t *)P[n->in[i]])
#define RO(i) ((mt_real *)P[n->out[i]])
#define IO(i) ((int32_t *)P[n->out[i]])
#define DIM(v, d) ((int)G->values[v].dims[d])
    const int *a = n->iattr;
    switch (n->op) {
    case MT_OP_EMBED:
        if (n->iattr[2] > 1) {   /* the rows in my shard */
            int64_t L = mt_value_numel_max(G, &G->values[n->in[1]]);
            mt_cpu_embed_forward_range(RO(0), I_(0), R_(1), DIM(n->out[0], 0), DIM(n->in[1], 1), rt->sym[n->iattr[3]] * L, L);
        } else {
            mt_cpu_embed_forward(RO(0), I_(0) + mt__token_slice(rt, n), R_(1), DIM(n->out[0], 0), DIM(n->in[1], 1));
        }
        break;
    case MT_OP_EMBED_BWD:
        if (n->iattr[2] > 1) {   /* my FSDP shard of the gradient */
            int64_t L = mt_value_numel_max(G, &G->values[n->out[0]]);
            mt_cpu_embed_backward_range(RO(0), R_(0), I_(1), DIM(n->in[0], 0), DIM(n->out[0], 1), rt->sym[n->iattr[3]] * L, L);
        } else {
            mt_cpu_embed_backward(RO(0), R_(0), I_(1) + mt__token_slice(rt, n), DIM(n->in[0], 0), DIM(n->out[0], 0), DIM(n->out[0], 1));
        }
        break;
    case MT_OP_RMSNORM: mt_cpu_rmsnorm_forward(RO(0), RO(1), R_(0), R_(1), (int)mt__nrows(rt, n->in[0]), DIM(n->in[0], 1), n->fattr[0]); break;
    case MT_OP_RMSNORM_BWD: mt_cpu_rmsnorm_backward(RO(0), RO(1), R_(0), R_(1), R_(2), R_(3), (int)mt__nrows(rt, n->in[1]), DIM(n->in[1], 1)); break;
    case MT_OP_MATMUL: case MT_OP_MATMUL_ACC: {
        int M = DIM(n->in[0], a[0] ? 1 : 0), K = DIM(n->in[0], a[0] ? 0 : 1), Nn = DIM(n->in[1], a[1] ? 0 : 1);
        mt_cpu_matmul(rt->pool, RO(0), R_(0), R_(1), M, Nn, K, a[0], a[1]);
        if (n->op == MT_OP_MATMUL_ACC) mt_cpu_add(RO(0), R_(2), RO(0), (int64_t)M * Nn);   /* as the ADD it replaces */
        break;
    }
    case MT_OP_SPLIT: mt_cpu_split(RO(0), RO(1), R_(0), DIM(n->in[0], 0), DIM(n->out[0], 1), DIM(n->out[1], 1)); break;
    case MT_OP_CONCAT:
        mt_cpu_concat(RO(0), n->in[0] >= 0 ? R_(0) : NULL, n->in[1] >= 0 ? R_(1) : NULL, DIM(n->out[0], 0), a[0],
                      DIM(n->out[0], 1) - a[0]);
        break;
    case MT_OP_MLA_ROPE:
        mt_cpu_mla_rope_forward(RO(0), RO(1), RO(2), R_(0), R_(1), R_(2), R_(3), R_(4), DIM(n->in[0], 0), a[4], a[0], a[1], a[2], a[3]);
        break;
    case MT_OP_MLA_ROPE_BWD:
        mt_cpu_mla_rope_backward(RO(0), RO(1), RO(2), R_(0), R_(1), R_(2), R_(3), R_(4), DIM(n->in[0], 0), a[4], a[0], a[1], a[2], a[3]);
        break;
    case MT_OP_ATTENTION:
        mt_cpu_attention_forward(rt->pool, RO(0), RO(1), R_(0), R_(1), R_(2), n->in[3] >= 0 ? I_(3) : NULL,
                                 DIM(n->in[0], 0) / a[3], a[3], a[0], a[1], a[2], n->fattr[0]);
        break;
    case MT_OP_ATTENTION_BWD:
        mt_cpu_attention_backward(rt->pool, RO(0), RO(1), RO(2), R_(0), R_(1), R_(2), R_(3), R_(4), R_(5),
                                  n->in[6] >= 0 ? I_(6) : NULL, DIM(n->in[0], 0) / a[3], a[3], a[0], a[1], a[2], n->fattr[0]);
        break;
    case MT_OP_ROPE_PE:
        mt_cpu_rope_pe_forward(RO(0), RO(1), R_(0), R_(1), R_(2), R_(3), DIM(n->in[0], 0), a[4], a[0], a[1], a[2]);
        break;
    case MT_OP_ROPE_PE_BWD:
        mt_cpu_rope_pe_backward(RO(0), R_(0), R_(1), R_(2), DIM(n->in[0], 0), a[4], a[0], a[2]);
        break;
    case MT_OP_MLA_ATTENTION:
        if (mt_cpu_mla_attention_forward(rt->pool, RO(0), RO(1), R_(0), R_(1), R_(2), R_(3), n->in[4] >= 0 ? I_(4) : NULL,
                                         DIM(n->in[0], 0) / a[3], a[3], a[0], a[4], a[1] - a[4], a[2], n->fattr[0]))
            return mt_errf(err, "MLA_ATTENTION: out of memory");
        break;
    case MT_OP_MLA_ATTENTION_BWD:
        if (mt_cpu_mla_attention_backward(rt->pool, RO(0), RO(1), RO(2), R_(0), R_(1), R_(2), R_(3), R_(4), R_(5), R_(6),
                                          n->in[7] >= 0 ? I_(7) : NULL, R_(8), R_(9), DIM(n->in[0], 0) / a[3], a[3], a[0], a[4],
                                          a[1] - a[4], a[2], n->fattr[0]))
            return mt_errf(err, "MLA_ATTENTION_BWD: out of memory");
        break;
    case MT_OP_DOC_STARTS: mt_cpu_doc_starts(IO(0), I_(0), DIM(n->in[0], 0), a[0], a[1]); break;
    case MT_OP_SWIGLU: mt_cpu_swiglu_forward(RO(0), R_(0), R_(1), mt__nrows(rt, n->in[0]) * mt__cols(rt, n->in[0])); break;
    case MT_OP_SWIGLU_BWD: mt_cpu_swiglu_backward(RO(0), RO(1), R_(0), R_(1), R_(2), mt__nrows(rt, n->in[0]) * mt__cols(rt, n->in[0])); break;
    case MT_OP_ADD: mt_cpu_add(RO(0), R_(0), R_(1), mt__nrows(rt, n->in[0]) * mt__cols(rt, n->in[0])); break;
    case MT_OP_ROUTER:
        mt_cpu_router_forward(IO(0), RO(1), RO(2), IO(3), R_(0), R_(1), DIM(n->in[0], 0), DIM(n->in[0], 1), a[0], a[1], a[2],
                              n->fattr[0], a[3], a[4]);
        break;
    case MT_OP_ROUTER_BWD:
        mt_cpu_router_backward(RO(0), R_(0), I_(1), R_(2), R_(3), DIM(n->in[0], 0), DIM(n->in[0], 1), a[0], a[1], a[2], n->fattr[0]);
        break;
    case MT_OP_MOE_PERMUTE: {   /* tokens [i1, i1 + n) */
        int D = DIM(n->in[0], 1), K = DIM(n->in[1], 1);
        if (mt_cpu_moe_permute(RO(0), IO(1), IO(2), R_(0) + (int64_t)a[1] * D, I_(1) + (int64_t)a[1] * K,
                               (int)mt__chunk_rows(G, n->out[0], K), D, K, a[0]))
            return mt_errf(err, "MOE_PERMUTE: expert index out of range (or out of memory)");
        break;
    }
    case MT_OP_MOE_PERMUTE_BWD: {
        int D = DIM(n->out[0], 1), rows = (int)mt__chunk_rows(G, n->in[0], a[0]);
        mt__zero_other_rows((uint8_t *)RO(0), (int64_t)sizeof(mt_real) * D, n, rows, DIM(n->out[0], 0));
        mt_cpu_moe_permute_backward(RO(0) + (int64_t)a[1] * D, R_(0), I_(1), rows, D, a[0]);
        break;
    }
    case MT_OP_EP_COUNTS: case MT_OP_EP_DISPATCH: case MT_OP_EP_COMBINE:
    case MT_OP_ALLGATHER: case MT_OP_REDUCE_SCATTER: case MT_OP_SP_GATHER: case MT_OP_SP_SCATTER: return mt__cpu_collective(rt, n, err);
    case MT_OP_CE_STATS: mt_cpu_ce_stats(RO(0), R_(0), I_(1), DIM(n->in[0], 0), DIM(n->in[0], 1), (int)rt->sym[a[0]] * DIM(n->in[0], 1)); break;
    case MT_OP_CE_COMBINE:
        mt_cpu_ce_combine(RO(0), RO(1), R_(0), I_(2), DIM(n->in[0], 0) / DIM(n->in[1], 0), DIM(n->in[1], 0), mt__ce_count(n, DIM(n->in[1], 0)));
        break;
    case MT_OP_CE_SHARD_BWD:
        mt_cpu_ce_shard_backward(RO(0), R_(0), R_(1), I_(2), DIM(n->in[0], 0), DIM(n->in[0], 1), (int)rt->sym[a[0]] * DIM(n->in[0], 1),
                                 mt__ce_scale(n, DIM(n->in[0], 0)));
        break;
    case MT_OP_SHIFT_TOKENS: mt_cpu_shift_tokens(IO(0), I_(0), DIM(n->in[0], 0), a[0], a[1], a[2]); break;
    case MT_OP_GMM: case MT_OP_GMM_DX: case MT_OP_GMM_DW: case MT_OP_GMM_DX2: case MT_OP_GMM_DW_SQ: case MT_OP_GMM_GLU: {
        int dw = n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ;
        int wi = dw ? n->out[0] : n->in[1];
        int E = DIM(wi, 0), M = DIM(wi, 1), K = DIM(wi, 2);
        const int32_t *offs = I_(2);
        int64_t rows = mt__nrows(rt, n->in[0]);
        for (int e = 0; e < E; e++)
            if (offs[0] != 0 || offs[e + 1] < offs[e] || offs[E] > rows)
                return mt_errf(err, "%s: bad expert offsets", mt_ops[n->op].name);
        if (n->op == MT_OP_GMM_GLU) {   /* the three ops it stands for, in their order: bitwise theirs */
            mt_cpu_gmm(rt->pool, RO(0), R_(0), R_(1), offs, E, M, K);
            mt_cpu_gmm(rt->pool, RO(1), R_(0), R_(3), offs, E, M, K);
            mt_cpu_swiglu_forward(RO(2), RO(0), RO(1), rows * M);
            break;
        }
        if (n->op == MT_OP_GMM) mt_cpu_gmm(rt->pool, RO(0), R_(0), R_(1), offs, E, M, K);
        else if (dw) mt_cpu_gmm_dw(rt->pool, RO(0), R_(0), R_(1), offs, E, M, K);
        else mt_cpu_gmm_dx(rt->pool, RO(0), R_(0), R_(1), offs, E, M, K);
        if (n->op == MT_OP_GMM_DX2) mt_cpu_gmm_dx_add(rt->pool, RO(0), R_(3), R_(4), offs, E, M, K);
        if (n->op == MT_OP_GMM_DW_SQ) {   /* the whole sum in entry 0, as SUMSQ forms it; the rest zero */
            int64_t L = mt_value_numel_max(G, &G->values[n->out[1]]), cnt = (int64_t)E * M * K;
            double sq = 0;
            for (int64_t i = 0; i < cnt; i++) sq += (double)RO(0)[i] * RO(0)[i];
            for (int64_t i = 0; i < L; i++) RO(1)[i] = 0;
            RO(1)[0] = (mt_real)sq;
        }
        break;
    }
    case MT_OP_MOE_COMBINE: {   /* tokens [i1, i1 + n) of y; its other rows 0 */
        int D = DIM(n->in[0], 1), K = DIM(n->in[2], 1), rows = (int)mt__chunk_rows(G, n->in[1], K);
        mt__zero_other_rows((uint8_t *)RO(0), (int64_t)sizeof(mt_real) * D, n, rows, DIM(n->in[2], 0));
        mt_cpu_moe_combine_forward(RO(0) + (int64_t)a[1] * D, R_(0), I_(1), R_(2) + (int64_t)a[1] * K, rows, D, K);
        break;
    }
    case MT_OP_MOE_COMBINE_BWD: {
        int D = DIM(n->in[1], 1), K = DIM(n->in[3], 1), rows = (int)mt__chunk_rows(G, n->in[2], K);
        int64_t r0 = a[1];
        mt__zero_other_rows((uint8_t *)RO(1), (int64_t)sizeof(mt_real) * K, n, rows, DIM(n->in[3], 0));
        mt_cpu_moe_combine_backward(RO(0), RO(1) + r0 * K, R_(0) + r0 * D, R_(1), I_(2), R_(3) + r0 * K, rows, D, K);
        break;
    }
    case MT_OP_CROSS_ENTROPY:
        mt_cpu_cross_entropy_forward(rt->pool, RO(0), RO(1), R_(0), I_(1), DIM(n->in[0], 0), DIM(n->in[0], 1), mt__ce_count(n, DIM(n->in[0], 0)));
        break;
    case MT_OP_CROSS_ENTROPY_BWD:
        mt_cpu_cross_entropy_backward(rt->pool, RO(0), R_(0), R_(1), I_(2), DIM(n->in[0], 0), DIM(n->in[0], 1), mt__ce_scale(n, DIM(n->in[0], 0)));
        break;
    case MT_OP_SUMSQ: {
        const mt_real *g = R_(0);
        int64_t cnt = mt_value_numel_max(G, &G->values[n->in[0]]);
        double s = n->in[1] >= 0 ? (double)R_(1)[0] : 0.0;
        if (n->iattr[0]) for (int64_t i = 0; i < cnt; i++) s += (double)g[i];
        else for (int64_t i = 0; i < cnt; i++) s += (double)g[i] * g[i];
        RO(0)[0] = (mt_real)s;
        break;
    }
    case MT_OP_ALLREDUCE: return mt__cpu_collective(rt, n, err);
    case MT_OP_LR_SCHEDULE: {
        float hp[MT_HP_COUNT];
        for (int i = 0; i < MT_HP_COUNT; i++) hp[i] = (float)R_(0)[i];
        RO(0)[0] = (mt_real)mt_lr_at(hp, I_(1)[0]);
        break;
    }
    case MT_OP_CLIP: {
        double norm = sqrt((double)R_(0)[0]), clip = (double)R_(1)[MT_HP_CLIP];
        RO(0)[0] = (mt_real)(clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0);
        RO(1)[0] = (mt_real)norm;
        break;
    }
    case MT_OP_ADAMW: {
        float hp[MT_HP_COUNT];
        for (int i = 0; i < MT_HP_COUNT; i++) hp[i] = (float)R_(6)[i];
        if (G->values[n->in[2]].dtype == MT_BF16)
            mt_cpu_adamw_bf16(R_(0), (uint16_t *)P[n->in[2]], (uint16_t *)P[n->in[3]], R_(1),
                              mt_value_numel_max(G, &G->values[n->in[0]]), (double)R_(4)[0], (double)R_(5)[0], hp, I_(7)[0], a[0]);
        else
            mt_cpu_adamw(R_(0), R_(2), R_(3), R_(1), mt_value_numel_max(G, &G->values[n->in[0]]), (double)R_(4)[0],
                         (double)R_(5)[0], hp, I_(7)[0], a[0]);
        break;
    }
    case MT_OP_EXPERT_BIAS_UPDATE:
        mt_cpu_expert_bias_update(R_(0), I_(1), DIM(n->in[0], 0), n->fattr[0]);
        break;
    case MT_OP_ADD_RMSNORM:
        mt_cpu_add_rmsnorm_forward(RO(0), RO(1), RO(2), R_(0), R_(1), R_(2), (int)mt__nrows(rt, n->in[0]), DIM(n->in[0], 1), n->fattr[0]);
        break;
    case MT_OP_RMSNORM_BWD_ADD:
        mt_cpu_rmsnorm_backward_add(RO(0), RO(1), R_(0), R_(1), R_(2), R_(3), R_(4), (int)mt__nrows(rt, n->in[1]), DIM(n->in[1], 1));
        break;
    default:
        return mt_errf(err, "op %s has no CPU implementation", mt_ops[n->op].name);
    }
#undef R_
#undef I_
#undef RO
#undef IO
#undef DIM
    /* symbolic leading dims follow the data: an output inherits input 0's rows */
    for (int k = 0; k < n->n_out; k++) {
        int v = n->out[k];
        if (v >= 0 && G->values[v].dims[0] < 0 && n->op != MT_OP_EP_DISPATCH && n->in[0] >= 0)
            rt->rows[v] = mt__nrows(rt, n->in[0]);
    }
    return 0;
}
/* An FP8 node on the CPU, the FP8 step's reference: each input it quantizes is replaced, for this node
 * only, by a copy holding what its e4m3 codes and scales dequantize to (mt_cpu_fp8_*); then the node
 * runs as a bf16 one would. */
static int mt__cpu_fp8(mt_runtime *rt, const mt_node *n, mt_err *err) {
    const mt_graph *G = &rt->g;
    void *saved[MT_MAX_IN];
    mt_real *tmp[MT_MAX_IN] = {0};
    int grouped = n->op != MT_OP_MATMUL && n->op != MT_OP_MATMUL_ACC, rc = 0;
    const int32_t *offs = grouped ? (const int32_t *)rt->ptr[n->in[2]] : NULL;
    int E = grouped ? (int)G->values[n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ ? n->out[0] : n->in[1]].dims[0] : 1;
    for (int i = 0; i < n->n_in; i++) saved[i] = n->in[i] >= 0 ? rt->ptr[n->in[i]] : NULL;
    for (int i = 0; i < n->n_in && !rc; i++) {
        int how = mt__fp8_operand(n, i);
        if (how == MT__Q8_NONE || n->in[i] < 0) continue;
        const mt_value *v = &G->values[n->in[i]];
        const mt_real *x = (const mt_real *)saved[i];
        int64_t R = mt__nrows(rt, n->in[i]), C = mt__cols(rt, n->in[i]);
        tmp[i] = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)mt_value_numel_max(G, v));
        if (!tmp[i]) { rc = mt_errf(err, "%s (fp8): out of memory", mt_ops[n->op].name); break; }
        if (how == MT__Q8_ROWS) mt_cpu_fp8_rows(tmp[i], x, R, C);
        else if (how == MT__Q8_COLS) mt_cpu_fp8_cols(tmp[i], x, offs, E, R, C);
        else mt_cpu_fp8_blocks(tmp[i], x, v->ndim == 3 ? v->dims[0] : 1, v->dims[v->ndim - 2], v->dims[v->ndim - 1]);
    }
    if (!rc) {
        mt_node m = *n;
        m.iattr[MT_IATTR_FP8] = 0;
        for (int i = 0; i < n->n_in; i++) if (tmp[i]) rt->ptr[n->in[i]] = tmp[i];
        rc = mt__exec_cpu(rt, &m, err);
        for (int i = n->n_in - 1; i >= 0; i--) if (n->in[i] >= 0) rt->ptr[n->in[i]] = saved[i];
    }
    for (int i = 0; i < n->n_in; i++) MT_FREE(tmp[i]);
    return rc;
}

#ifdef MT_CUDA
/* FP8 operands quantized once (CUDA). Two nodes that quantize the same value the same way -- an
 * activation in the same layout (the two expert weight gradients' X), or a weight in either of its
 * forms (W for Y = X W^T, W^T for dX = dY W) -- share it: the first in node order quantizes into a slot
 * (a weight: both forms the later nodes take, from one read), and the later ones read the slot. The plan
 * follows from the node order alone, so captures and replays see the same, and the results are the same
 * bits (the same quantizers on the same values). A value is written once a step, so the slot stays
 * valid up to the value's last use. Slots are device memory outside the arena's plan: a weight's
 * second form costs its E x N x K bytes (and counts in the peak the run reports); a weight AdamW
 * quantizes (below) keeps both forms, and its bf16 copy is not written where nothing else reads it. */
/* The bytes of the 128 x 128 block scales of E weights W [N][K] (tr = 0) or of their transposes W^T
 * [K][N] (tr = 1): [E][rows / 128][ld] floats, rows the form's rows, ld its column blocks rounded up to 4. */
static size_t mt__fp8_wscale_bytes(int64_t E, int64_t N, int64_t K, int tr) {
    int64_t rows = tr ? K : N, cols = tr ? N : K;
    return (size_t)E * (size_t)((rows + 127) / 128) * (size_t)(((cols + 127) / 128 + 3) / 4 * 4) * 4;
}
/* node n's input i as mt__q8_plan keys it: how (MT__Q8_*; NONE: not quantized), the layout's key (the
 * offsets for cols, 1 for a grouped node's rows: their row count is the bound), the weight's form */
static int mt__q8_key(const mt_node *n, int i, int *key, int *form) {
    int how = mt__fp8_operand(n, i);
    int grouped = n->op != MT_OP_MATMUL && n->op != MT_OP_MATMUL_ACC;
    *key = how == MT__Q8_COLS ? (grouped ? n->in[2] : -1) : how == MT__Q8_ROWS ? grouped : 0;
    *form = how != MT__Q8_BLOCKS ? 0 : grouped ? !(n->op == MT_OP_GMM || n->op == MT_OP_GMM_GLU) : !n->iattr[1];
    return how;
}
static int mt__q8_plan(mt_runtime *rt, mt_err *err) {
    const mt_graph *G = &rt->g;
    if (!mt_graph_fp8(G) || rt->bind.fp8_requantize) return 0;
    int n = G->n_nodes, nc = 0;
    typedef struct { int value, how, key, first, forms, uses, adamw, twin; } cand_t;
    cand_t *cand = (cand_t *)mt__calloc(sizeof(cand_t) * (size_t)n * 5 + 1);
    int32_t *of = (int32_t *)mt__calloc(sizeof(int32_t) * (size_t)n * 5 + 1);   /* per use: its candidate */
    rt->q8_use = (int32_t *)mt__calloc(sizeof(int32_t) * (size_t)n * 5 + 1);
    rt->q8 = (mt__q8_slot *)mt__calloc(sizeof(mt__q8_slot) * (size_t)n * 5 + 1);
    if (!cand || !of || !rt->q8_use || !rt->q8) { MT_FREE(cand); MT_FREE(of); return mt_errf(err, "out of memory"); }
    for (int k = 0; k < n; k++) {
        const mt_node *nd = &G->nodes[k];
        for (int i = 0; mt_node_fp8(nd) && i < 5 && i < nd->n_in; i++) {
            int key, form, how = mt__q8_key(nd, i, &key, &form), c = 0;
            of[k * 5 + i] = -1;
            if (how == MT__Q8_NONE) continue;
            while (c < nc && !(cand[c].value == nd->in[i] && cand[c].how == how && cand[c].key == key)) c++;
            if (c == nc) cand[nc++] = (cand_t){nd->in[i], how, key, k * 5 + i, 0, 0, -1, -1};
            else cand[c].forms |= 1 << form;   /* a later use: the form it reads is kept */
            cand[c].uses++;
            of[k * 5 + i] = c;
        }
    }
    /* A weight that an ADAMW node writes (its bf16 copy, out[3]) and nothing else does: that node writes the
     * forms after each update, every form any node reads (the first node's too), and the first node quantizes
     * only while the slot is stale (after the host writes the weights: mt__q8_stale). */
    int64_t minel = rt->bind.fp8_adamw_min > 0 ? rt->bind.fp8_adamw_min : MT_FP8_ADAMW_MIN;
    for (int c = 0; c < nc; c++) {
        int ad = -1, other = 0;
        if (mt_value_numel_max(G, &G->values[cand[c].value]) < minel) continue;
        for (int k = 0; cand[c].how == MT__Q8_BLOCKS && k < n; k++)
            for (int o = 0; o < G->nodes[k].n_out; o++)
                if (G->nodes[k].out[o] == cand[c].value) {
                    if (G->nodes[k].op == MT_OP_ADAMW && o == 3 && ad < 0) ad = k; else other = 1;
                }
        if (ad < 0 || other || ad < cand[c].first / 5) continue;
        const mt_node *f = &G->nodes[cand[c].first / 5];
        int key, form;
        mt__q8_key(f, cand[c].first % 5, &key, &form);
        cand[c].forms |= 1 << form;
        cand[c].adamw = ad;
    }
    /* An activation quantized both by rows and down the tokens (an expert GEMM's input and its weight gradient's, dY
     * of a dX and a dW): one slot holds both forms, and the first reader makes both from one read (mt__q8_both).
     * The rows' and the columns' layouts must agree: grouped rows with columns grouped by offsets computed before
     * that first reader, plain rows with plain columns. */
    for (int c = 0; c < nc; c++) {
        if (cand[c].how != MT__Q8_ROWS) continue;
        for (int d = 0; d < nc; d++) {
            if (cand[d].how != MT__Q8_COLS || cand[d].value != cand[c].value || cand[d].twin >= 0 || (cand[c].key == 1) != (cand[d].key >= 0))
                continue;
            const mt_value *v = &G->values[cand[c].value];
            if (v->dims[v->ndim - 1] % 16) continue;
            int first = (cand[c].first < cand[d].first ? cand[c].first : cand[d].first) / 5, made = cand[d].key < 0;
            for (int k = 0; k < first && !made; k++)
                for (int o = 0; o < G->nodes[k].n_out; o++) made |= G->nodes[k].out[o] == cand[d].key;
            if (!made) continue;
            cand[c].twin = d; cand[d].twin = c;
            break;
        }
    }
    int rc = 0;
    mt_cuda *cu = MT__CU(rt);
    typedef struct { size_t off[4], qb[2], bytes, at; int lo, hi; } lay_t;   /* a slot's layout and lifetime (nodes) */
    lay_t *lay = (lay_t *)mt__calloc(sizeof(lay_t) * (size_t)n * 5 + 1);
    if (!lay) { MT_FREE(cand); MT_FREE(of); return mt_errf(err, "out of memory"); }
    for (int c = 0; c < nc && !rc; c++) {
        if (cand[c].how == MT__Q8_COLS && cand[c].twin >= 0) continue;   /* in its rows' slot */
        if (cand[c].uses < 2 && cand[c].adamw < 0 && cand[c].twin < 0) continue;
        const mt_node *nd = &G->nodes[cand[c].first / 5];
        const mt_value *v = &G->values[cand[c].value];
        int64_t C = v->dims[v->ndim - 1], R = mt_value_numel_max(G, v) / C, E = 1;
        size_t qb[2] = {0, 0}, sb[2] = {0, 0};
        int t = cand[c].twin;
        if (cand[c].how == MT__Q8_ROWS) {
            qb[0] = (size_t)(R * C); sb[0] = (size_t)((C + 127) / 128 * R * 4);
            if (t >= 0) {   /* the columns beside them, laid out as the column reader's */
                const mt_node *cn = &G->nodes[cand[t].first / 5];
                int64_t Ec = cand[t].key >= 0 ? G->values[cn->out[0]].dims[0] : 1;
                long long Lp = mt_cuda_fp8_tpad((int)R, (int)Ec);
                qb[1] = (size_t)(C * Lp); sb[1] = (size_t)(Lp / 128 * C * 4);
            }
        } else if (cand[c].how == MT__Q8_COLS) {
            if (cand[c].key >= 0) E = G->values[nd->out[0]].dims[0];
            long long Lp = mt_cuda_fp8_tpad((int)R, (int)E);
            qb[0] = (size_t)(C * Lp); sb[0] = (size_t)(Lp / 128 * C * 4);
        } else {
            int64_t N = v->dims[v->ndim - 2];
            if (v->ndim == 3) E = v->dims[0];
            for (int f = 0; f < 2; f++) {   /* W [E][N][K = C], W^T [E][K][N] */
                if (!(cand[c].forms >> f & 1)) continue;
                qb[f] = (size_t)(E * N * C);
                sb[f] = mt__fp8_wscale_bytes(E, N, C, f);
            }
        }
        mt__q8_slot *sl = &rt->q8[rt->n_q8];
        lay_t *L = &lay[rt->n_q8];
        size_t at = 0;
        for (int f = 0; f < 2; f++) {
            L->off[2 * f] = at; at = (at + qb[f] + 255) & ~(size_t)255;
            L->off[2 * f + 1] = at; at = (at + sb[f] + 255) & ~(size_t)255;
            L->qb[f] = qb[f];
        }
        L->at = at; L->bytes = at + 256; L->lo = n; L->hi = -1;
        sl->value = cand[c].value; sl->adamw = cand[c].adamw; sl->shadow = 0; sl->fresh = NULL; sl->mem = NULL;
        sl->rows_node = t >= 0 ? cand[c].first / 5 : -1;
        sl->cols_node = t >= 0 ? cand[t].first / 5 : -1;
        sl->producer = -1;
        for (int k = 0; sl->adamw >= 0 && k < n; k++)   /* a read not through this slot keeps the bf16 weight written */
            for (int i = 0; i < G->nodes[k].n_in; i++)
                sl->shadow |= G->nodes[k].in[i] == cand[c].value && !(i < 5 && of[k * 5 + i] == c);
        rt->n_q8++;
        int first = t >= 0 && cand[t].first < cand[c].first ? cand[t].first : cand[c].first;
        for (int u = 0; u < n * 5; u++)
            if (of[u] == c || (t >= 0 && of[u] == t)) {
                rt->q8_use[u] = u == first ? -rt->n_q8 : rt->n_q8;
                if (u / 5 < L->lo) L->lo = u / 5;
                if (u / 5 > L->hi) L->hi = u / 5;
            }
    }
    /* A slot of both forms whose value a SwiGLU makes (an expert's or a dense FFN's h, the backward's dgate and dup), or
     * the MoE permutation (the experts' input rows) or the combine's backward (the down projection's dY), and that no
     * node reads but through the slot: that node writes the forms in place of its bf16 output (mt__q8_swiglu,
     * mt__q8_moe), so the value is neither written nor read back. Its grouping offsets must be made before it (the
     * permutation's own: it sorts before it gathers); a SWIGLU_BWD, whose one kernel makes both outputs, takes both or
     * neither. */
    for (int i = 0; !rc && i < rt->n_q8; i++) {
        mt__q8_slot *sl = &rt->q8[i];
        if (sl->rows_node < 0) continue;
        int pk = -1, po = -1, ok = 1;
        for (int k = 0; k < n && pk < 0; k++)
            for (int o = 0; o < G->nodes[k].n_out; o++) if (G->nodes[k].out[o] == sl->value) { pk = k; po = o; }
        const mt_node *pn = pk >= 0 ? &G->nodes[pk] : NULL, *cn = &G->nodes[sl->cols_node];
        if (!pn || !((pn->op == MT_OP_SWIGLU && po == 0) || (pn->op == MT_OP_SWIGLU_BWD && po < 2) ||
                     (pn->op == MT_OP_GMM_GLU && mt_node_fp8(pn) && po == 2) || (pn->op == MT_OP_MOE_PERMUTE && po == 0) ||
                     (pn->op == MT_OP_MOE_COMBINE_BWD && po == 0)))
            continue;
        if (cn->op == MT_OP_MATMUL || cn->op == MT_OP_MATMUL_ACC) {
            if (pn->op == MT_OP_MOE_PERMUTE || pn->op == MT_OP_MOE_COMBINE_BWD) continue;   /* (their rows are routed: grouped readers) */
        } else if (!(pn->op == MT_OP_MOE_PERMUTE && pn->out[2] == cn->in[2])) {   /* the columns' offsets, made before the producer
                                                                                     (or by the permutation itself, before it gathers) */
            int made = 0;
            for (int k = 0; k < pk && !made; k++)
                for (int o = 0; o < G->nodes[k].n_out; o++) made |= G->nodes[k].out[o] == cn->in[2];
            ok = made;
        }
        for (int k = 0; ok && k < n; k++)   /* every read through the slot */
            for (int j = 0; j < G->nodes[k].n_in; j++)
                if (G->nodes[k].in[j] == sl->value) {
                    int u = j < 5 ? rt->q8_use[k * 5 + j] : 0;
                    ok &= (u < 0 ? -u : u) == i + 1;
                }
        if (ok) sl->producer = pk;
    }
    for (int i = 0; !rc && i < rt->n_q8; i++) {   /* a SWIGLU_BWD's two outputs both, or neither */
        int pk = rt->q8[i].producer, both = 0;
        if (pk < 0 || G->nodes[pk].op != MT_OP_SWIGLU_BWD) continue;
        for (int j = 0; j < rt->n_q8; j++) both += rt->q8[j].producer == pk;
        if (both != 2) rt->q8[i].producer = -1;
    }
    for (int i = 0; !rc && i < rt->n_q8; i++) {   /* its readers read; it lives from the SwiGLU */
        if (rt->q8[i].producer < 0) continue;
        for (int u = 0; u < n * 5; u++) if (rt->q8_use[u] == -(i + 1)) rt->q8_use[u] = i + 1;
        if (rt->q8[i].producer < lay[i].lo) lay[i].lo = rt->q8[i].producer;
    }
    /* Memory: a weight's slot (read across steps: AdamW writes its forms for the next one) is its own allocation; the
     * activations' slots live from their first reader to their last within a step, so they share one pool, larger
     * first, each at the lowest offset no slot alive at the same time takes (the backward's of one layer reuse the
     * next one's). */
    size_t *pos = (size_t *)mt__calloc(sizeof(size_t) * (size_t)rt->n_q8 + 1), pool = 0;
    char *placed = (char *)mt__calloc((size_t)rt->n_q8 + 1);
    if (!pos || !placed) rc = rc ? rc : mt_errf(err, "out of memory");
    for (int k = 0; !rc && k < rt->n_q8; k++) {
        int b = -1;   /* the largest activation slot not yet placed */
        for (int i = 0; i < rt->n_q8; i++)
            if (rt->q8[i].adamw < 0 && !placed[i] && (b < 0 || lay[i].bytes > lay[b].bytes)) b = i;
        if (b < 0) break;
        size_t o = 0;
        for (int moved = 1; moved;) {
            moved = 0;
            for (int j = 0; j < rt->n_q8; j++)
                if (placed[j] && lay[j].lo <= lay[b].hi && lay[b].lo <= lay[j].hi && pos[j] < o + lay[b].bytes && o < pos[j] + lay[j].bytes) {
                    o = pos[j] + lay[j].bytes;
                    moved = 1;
                }
        }
        pos[b] = o; placed[b] = 1;
        if (o + lay[b].bytes > pool) pool = o + lay[b].bytes;
    }
    if (!rc && pool && mt_cuda_malloc(cu, &rt->q8_pool, pool)) rc = mt_errf(err, "FP8 operand slots: %s", mt_cuda_error(cu));
    for (int i = 0; !rc && i < rt->n_q8; i++) {
        mt__q8_slot *sl = &rt->q8[i];
        uint8_t *base;
        if (sl->adamw >= 0) {
            if (mt_cuda_malloc(cu, &sl->mem, lay[i].bytes)) { rc = mt_errf(err, "FP8 operand slots: %s", mt_cuda_error(cu)); break; }
            base = (uint8_t *)sl->mem;
            sl->fresh = (int *)(base + lay[i].at);
            if (mt_cuda_memset(cu, sl->fresh, 0, sizeof(int))) { rc = mt_errf(err, "FP8 operand slots: %s", mt_cuda_error(cu)); break; }
        } else {
            base = (uint8_t *)rt->q8_pool + pos[i];
        }
        for (int f = 0; f < 2; f++)
            if (lay[i].qb[f]) { sl->q[f] = base + lay[i].off[2 * f]; sl->s[f] = (float *)(base + lay[i].off[2 * f + 1]); }
    }
    MT_FREE(pos); MT_FREE(placed); MT_FREE(lay);
    MT_FREE(cand); MT_FREE(of);
    return rc;
}
/* the weight slots AdamW refills are stale: the host wrote the weights (their first reader quantizes again) */
static int mt__q8_stale(mt_runtime *rt, mt_err *err) {
    for (int i = 0; i < rt->n_q8; i++)
        if (rt->q8[i].fresh && mt_cuda_memset(MT__CU(rt), rt->q8[i].fresh, 0, sizeof(int)))
            return mt_errf(err, "FP8 operand slots: %s", mt_cuda_error(MT__CU(rt)));
    return 0;
}
/* bf16 weight v is not written by its ADAMW node (no node reads it but through the forms AdamW writes) */
static int mt__q8_unwritten(const mt_runtime *rt, int v) {
    for (int i = 0; i < rt->n_q8; i++)
        if (rt->q8[i].value == v && rt->q8[i].adamw >= 0 && !rt->q8[i].shadow) return 1;
    return 0;
}
/* the slot whose forms ADAMW node n writes, or NULL */
static const mt__q8_slot *mt__q8_refill(const mt_runtime *rt, const mt_node *n) {
    int k = (int)(n - rt->g.nodes);
    for (int i = 0; n->op == MT_OP_ADAMW && i < rt->n_q8; i++)
        if (rt->q8[i].adamw == k) return &rt->q8[i];
    return NULL;
}
/* the slot node n's input i takes (NULL: none, it quantizes into the scratch); *make: it fills the slot */
static mt__q8_slot *mt__q8_of(const mt_runtime *rt, const mt_node *n, int i, int *make) {
    int u = rt->q8_use ? rt->q8_use[(n - rt->g.nodes) * 5 + i] : 0;
    *make = u < 0;
    return u ? &rt->q8[(u < 0 ? -u : u) - 1] : NULL;
}
/* the row count node n's FP8 kernel takes for its rows operands (mt__cuda_fp8) */
static int mt__q8_nrows(mt_runtime *rt, const mt_node *n) {
    return (int)(n->op == MT_OP_MATMUL || n->op == MT_OP_MATMUL_ACC ? mt__nrows(rt, n->in[0]) : mt__gmm_bound(rt, n->in[0]));
}
/* the layout of the columns node n (a weight gradient's GEMM) takes: the groups' offsets (NULL: one group), their count,
   the rows and the padded length, as mt__cuda_fp8 sets them */
static void mt__q8_cols_of(mt_runtime *rt, const mt_node *n, const int32_t **offs, int *E, int *R, long long *Lp) {
    int dense = n->op == MT_OP_MATMUL || n->op == MT_OP_MATMUL_ACC;
    *offs = dense ? NULL : (const int32_t *)rt->ptr[n->in[2]];
    *E = dense ? 1 : (int)rt->g.values[n->out[0]].dims[0];
    *R = mt__q8_nrows(rt, n);
    *Lp = mt_cuda_fp8_tpad(*R, *E);
}
/* a slot's two forms of an activation (rows_node set), made from one read */
static int mt__q8_both(mt_runtime *rt, const mt__q8_slot *sl, int C) {
    const int32_t *offs;
    int E, R, Rq = mt__q8_nrows(rt, &rt->g.nodes[sl->rows_node]);
    long long Lp;
    mt__q8_cols_of(rt, &rt->g.nodes[sl->cols_node], &offs, &E, &R, &Lp);
    const void *x = rt->ptr[sl->value];
    if (Rq >= R && (offs || Rq == R))
        return mt_cuda_fp8_quant_both(MT__CU(rt), sl->q[0], sl->s[0], Rq, sl->q[1], sl->s[1], x, offs, E, R, C, Lp);
    return mt_cuda_fp8_quant_rows(MT__CU(rt), sl->q[0], sl->s[0], x, Rq, C) ||   /* (shapes the one-read kernel does not take) */
           mt_cuda_fp8_quant_cols(MT__CU(rt), sl->q[1], sl->s[1], x, offs, E, R, C, Lp);
}
/* the slot whose forms node n writes in place of its output o (mt__q8_plan), or NULL */
static const mt__q8_slot *mt__q8_made_by(const mt_runtime *rt, const mt_node *n, int o) {
    int k = (int)(n - rt->g.nodes);
    for (int i = 0; o >= 0 && o < n->n_out && i < rt->n_q8; i++)
        if (rt->q8[i].producer == k && rt->q8[i].value == n->out[o]) return &rt->q8[i];
    return NULL;
}
/* A SwiGLU node (h = SwiGLU(g, u) in out[o]; or with dh its backward, dgate and dup in out[0], out[1]) whose outputs'
 * slots it produces: their forms from one kernel that never writes the bf16 values (mt_cuda_fp8_quant_swiglu). *done = 0
 * where it produces none; where the slots' shapes do not fit that kernel, or under nan_check (which reads the outputs),
 * the node runs as usual and then fills them (done = 1). */
static int mt__q8_swiglu(mt_runtime *rt, const mt_node *n, int o, const void *g, const void *u, const void *dh, int64_t elems, int *done) {
    const mt__q8_slot *a = mt__q8_made_by(rt, n, dh ? 0 : o), *b = dh ? mt__q8_made_by(rt, n, 1) : NULL;
    mt_cuda *c = MT__CU(rt);
    *done = 0;
    if (!a || (dh && !b)) return 0;
    *done = 1;
    const int32_t *offs[2] = {NULL, NULL};
    int E[2] = {1, 1}, R[2] = {0, 0}, Rq[2] = {0, 0}, C = (int)mt__cols(rt, a->value), same = 1;
    long long Lp[2] = {0, 0};
    for (int t = 0; t < (dh ? 2 : 1); t++) {
        const mt__q8_slot *sl = t ? b : a;
        mt__q8_cols_of(rt, &rt->g.nodes[sl->cols_node], &offs[t], &E[t], &R[t], &Lp[t]);
        Rq[t] = mt__q8_nrows(rt, &rt->g.nodes[sl->rows_node]);
        same &= Rq[t] >= R[t] && (offs[t] || Rq[t] == R[t]);
    }
    if (dh) same &= offs[0] == offs[1] && E[0] == E[1] && R[0] == R[1] && Lp[0] == Lp[1] && Rq[0] == Rq[1] && (int)mt__cols(rt, b->value) == C;
    if (same && !rt->bind.nan_check)
        return mt_cuda_fp8_quant_swiglu(c, a->q[0], a->s[0], a->q[1], a->s[1], b ? b->q[0] : NULL, b ? b->s[0] : NULL, b ? b->q[1] : NULL,
                                        b ? b->s[1] : NULL, g, u, dh, offs[0], E[0], R[0], C, Lp[0], Rq[0]);
    const int32_t *live = rt->rows_dev ? rt->rows_dev[n->in[0]] : NULL;   /* (as the plain nodes run them) */
    int rc = dh ? mt_cuda_swiglu_backward(c, rt->ptr[n->out[0]], rt->ptr[n->out[1]], g, u, dh, elems, live, C)
                : mt_cuda_swiglu_forward(c, rt->ptr[n->out[o]], g, u, elems, live, C);
    return rc || mt__q8_both(rt, a, C) || (b && mt__q8_both(rt, b, C));
}
/* The MoE permutation (x the tokens, idx their experts; its slot and offsets written too) or the combine's backward
 * (x = dy, with ys, slot, w and dw) writing its output's slot (mt__q8_plan) in place of the bf16 rows, from one kernel
 * that gathers them (mt_cuda_moe_permute_fp8, _combine_backward_fp8). *done = 0 where it produces none; where the slot's
 * layout does not fit that kernel, or under nan_check (which reads the output), the node runs as usual and then fills it. */
static int mt__q8_moe(mt_runtime *rt, const mt_node *n, const void *x, const int32_t *idx, const void *ys, const int32_t *slot,
                      const float *w, float *dw, int N, int D, int K, int E, int *done) {
    const mt__q8_slot *sl = mt__q8_made_by(rt, n, 0);
    mt_cuda *c = MT__CU(rt);
    *done = 0;
    if (!sl) return 0;
    *done = 1;
    const int32_t *offs;
    int Eg, R, Rq = mt__q8_nrows(rt, &rt->g.nodes[sl->rows_node]), perm = n->op == MT_OP_MOE_PERMUTE;
    long long Lp;
    mt__q8_cols_of(rt, &rt->g.nodes[sl->cols_node], &offs, &Eg, &R, &Lp);
    int32_t *own = perm ? (int32_t *)rt->ptr[n->out[2]] : NULL, *slot_out = perm ? (int32_t *)rt->ptr[n->out[1]] : NULL;
    if (offs && Rq >= R && (int64_t)R >= (int64_t)N * K && mt__cols(rt, sl->value) == D && !rt->bind.nan_check && (!perm || offs == own))
        return perm ? mt_cuda_moe_permute_fp8(c, slot_out, own, x, idx, N, D, K, E, rt->scratch, sl->q[0], sl->s[0], Rq, sl->q[1], sl->s[1], Lp)
                    : mt_cuda_moe_combine_backward_fp8(c, dw, x, ys, slot, w, N, D, K, (int32_t *)rt->scratch, sl->q[0], sl->s[0], Rq,
                                                       sl->q[1], sl->s[1], offs, Eg, Lp);
    int rc = perm ? mt_cuda_moe_permute(c, rt->ptr[n->out[0]], slot_out, own, x, idx, N, D, K, E, rt->scratch)
                  : mt_cuda_moe_combine_backward(c, rt->ptr[n->out[0]], dw, x, ys, slot, w, N, D, K);
    return rc || mt__q8_both(rt, sl, D);
}
/* node n's input i quantized into (*q, *s), or (*q, *s) pointed at the slot where an earlier node did */
static int mt__q8_rows(mt_runtime *rt, const mt_node *n, int i, uint8_t **q, float **s, int R, int C) {
    int make;
    mt__q8_slot *sl = mt__q8_of(rt, n, i, &make);
    if (sl) { *q = sl->q[0]; *s = sl->s[0]; }
    if (sl && make && sl->rows_node >= 0) return mt__q8_both(rt, sl, C);
    return sl && !make ? 0 : mt_cuda_fp8_quant_rows(MT__CU(rt), *q, *s, rt->ptr[n->in[i]], R, C);
}
static int mt__q8_cols(mt_runtime *rt, const mt_node *n, int i, uint8_t **q, float **s, const int32_t *offs, int E, int R, int C, long long Lp) {
    int make;
    mt__q8_slot *sl = mt__q8_of(rt, n, i, &make);
    int f = sl && sl->rows_node >= 0;   /* (a slot of both forms: the columns are its second) */
    if (sl) { *q = sl->q[f]; *s = sl->s[f]; }
    if (sl && make && f) return mt__q8_both(rt, sl, C);
    return sl && !make ? 0 : mt_cuda_fp8_quant_cols(MT__CU(rt), *q, *s, rt->ptr[n->in[i]], offs, E, R, C, Lp);
}
static int mt__q8_weight(mt_runtime *rt, const mt_node *n, int i, uint8_t **q, float **s, int E, int N, int K, int form) {
    int make;
    mt__q8_slot *sl = mt__q8_of(rt, n, i, &make);
    if (!sl) return mt_cuda_fp8_quant_weight(MT__CU(rt), *q, *s, rt->ptr[n->in[i]], E, N, K, form);
    if (sl->q[form]) { *q = sl->q[form]; *s = sl->s[form]; }
    if (!make) return 0;
    uint8_t *q0 = form ? sl->q[0] : *q, *q1 = form ? *q : sl->q[1];
    float *s0 = form ? sl->s[0] : *s, *s1 = form ? *s : sl->s[1];
    return mt_cuda_fp8_quant_weight2(MT__CU(rt), q0, s0, q1, s1, rt->ptr[n->in[i]], E, N, K, sl->fresh);
}

/* An FP8 node on CUDA: its inputs quantized into the scratch in the kernels' layouts (docs/FP8.md), then
 * the FP8 GEMM (mt_cuda_fp8_gemm for MATMUL, mt_cuda_fp8_gmm for the experts). GMM_DX2 runs both pairs
 * into one accumulator (mt_cuda_fp8_gmm2); MATMUL_ACC forms its product in the scratch and adds it;
 * GMM_GLU runs its two GEMMs on one quantized X and then its SwiGLU. With rt NULL nothing runs and *need
 * gets the scratch bytes the node takes at the graph's bounds, by the same steps. Rounding: the
 * quantizers' (docs/FP8.md), fp32 accumulation, one rounding to the output dtype, and for MATMUL_ACC's
 * sum one more (bf16) than the fused bf16 kernel makes. */
static int mt__cuda_fp8(mt_runtime *rt, const mt_graph *G, const mt_node *n, size_t *need, mt_err *err) {
    mt_cuda *c = rt ? MT__CU(rt) : NULL;
    uint8_t *base = rt ? (uint8_t *)rt->scratch : NULL;
    size_t used = 0;
    void **P = rt ? rt->ptr : NULL;
    int rc = 0;
#define TAKE(bytes) (used = (used + 255) & ~(size_t)255, used += (size_t)(bytes), (void *)(base ? base + used - (size_t)(bytes) : NULL))
#define KB(x) (((int64_t)(x) + 127) / 128)
    const mt_value *A = &G->values[n->in[0]];
    int64_t rows = rt ? mt__nrows(rt, n->in[0]) : A->dims[0];
    if (n->op == MT_OP_MATMUL || n->op == MT_OP_MATMUL_ACC) {
        const mt_value *B = &G->values[n->in[1]], *O = &G->values[n->out[0]];
        int f32 = O->dtype == MT_F32, acc = n->op == MT_OP_MATMUL_ACC;
        size_t osz = (size_t)mt_dtype_bytes(G, O->dtype);
        int Mr, Nc, K, lda, b_blk;
        uint8_t *qa, *qb;
        float *sa, *sb;
        if (!n->iattr[0]) {   /* Y = X W^T (B = W [Nc, K]) or dX = dY W (B = W [K, Nc]): A in 1 x 128 tiles, W in blocks */
            Mr = (int)rows; K = (int)A->dims[1]; Nc = (int)(n->iattr[1] ? B->dims[0] : B->dims[1]); lda = K; b_blk = 1;
            qa = (uint8_t *)TAKE((size_t)Mr * K); sa = (float *)TAKE((size_t)KB(K) * Mr * 4);
            qb = (uint8_t *)TAKE((size_t)Nc * K); sb = (float *)TAKE(mt__fp8_wscale_bytes(1, B->dims[0], B->dims[1], !n->iattr[1]));
            if (rt) rc = mt__q8_rows(rt, n, 0, &qa, &sa, Mr, K) ||
                         mt__q8_weight(rt, n, 1, &qb, &sb, 1, (int)B->dims[0], (int)B->dims[1], !n->iattr[1]);
        } else {              /* dW = dY^T X: both down the tokens, the reduction padded to 128 (the layout's last slot unused) */
            int T = (int)rows;
            long long Lp = mt_cuda_fp8_tpad(T, 1);
            Mr = (int)A->dims[1]; Nc = (int)B->dims[1]; K = (T + 127) / 128 * 128; lda = (int)Lp; b_blk = 0;
            qa = (uint8_t *)TAKE((size_t)Mr * Lp); sa = (float *)TAKE((size_t)(Lp / 128) * Mr * 4);
            qb = (uint8_t *)TAKE((size_t)Nc * Lp); sb = (float *)TAKE((size_t)(Lp / 128) * Nc * 4);
            if (rt) rc = mt__q8_cols(rt, n, 0, &qa, &sa, NULL, 1, T, Mr, Lp) || mt__q8_cols(rt, n, 1, &qb, &sb, NULL, 1, T, Nc, Lp);
        }
        void *dst = acc ? TAKE((size_t)Mr * Nc * osz) : (rt ? P[n->out[0]] : NULL);
        if (rt && !rc) rc = mt_cuda_fp8_gemm(c, dst, f32, qa, sa, lda, qb, sb, b_blk, lda, Mr, Nc, K);
        if (rt && !rc && acc) rc = mt_cuda_add(c, P[n->out[0]], P[n->in[2]], dst, (int64_t)Mr * Nc, O->dtype);
    } else {
        int dw = n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ;
        const mt_value *W = &G->values[dw ? n->out[0] : n->in[1]];
        int E = (int)W->dims[0], M = (int)W->dims[1], K = (int)W->dims[2];
        int R = (int)(rt ? mt__gmm_bound(rt, n->in[0]) : mt_value_numel_max(G, A) / A->dims[1]);
        const int32_t *offs = rt ? (const int32_t *)P[n->in[2]] : NULL;
        if (dw) {             /* dW_e = dY_e^T X_e: both down the tokens, each expert's from its first row */
            long long Lp = mt_cuda_fp8_tpad(R, E);
            uint8_t *qa = (uint8_t *)TAKE((size_t)M * Lp), *qb = (uint8_t *)TAKE((size_t)K * Lp);
            float *sa = (float *)TAKE((size_t)(Lp / 128) * M * 4), *sb = (float *)TAKE((size_t)(Lp / 128) * K * 4);
            int sq = n->op == MT_OP_GMM_DW_SQ;   /* with the partial sums of dW^2 the gradient norm takes */
            if (rt) rc = mt__q8_cols(rt, n, 0, &qa, &sa, offs, E, R, M, Lp) || mt__q8_cols(rt, n, 1, &qb, &sb, offs, E, R, K, Lp) ||
                         mt_cuda_fp8_gmm_dw(c, P[n->out[0]], qa, sa, qb, sb, offs, E, M, K, R, Lp, MT_FP8_GMM_KERNEL, 0,
                                            sq ? (float *)P[n->out[1]] : NULL, sq ? mt_value_numel_max(G, &G->values[n->out[1]]) : 0);
        } else if (n->op == MT_OP_GMM_DX2) {   /* dX = dY W + dY2 W2: both pairs quantized, one GEMM over both */
            uint8_t *q[2], *w[2];
            float *s[2], *ws[2];
            for (int t = 0; t < 2; t++) {
                q[t] = (uint8_t *)TAKE((size_t)R * M); s[t] = (float *)TAKE((size_t)KB(M) * R * 4);
                w[t] = (uint8_t *)TAKE((size_t)E * M * K); ws[t] = (float *)TAKE(mt__fp8_wscale_bytes(E, M, K, 1));
                if (rt && !rc) rc = mt__q8_rows(rt, n, t ? 3 : 0, &q[t], &s[t], R, M) || mt__q8_weight(rt, n, t ? 4 : 1, &w[t], &ws[t], E, M, K, 1);
            }
            if (rt && !rc) rc = mt_cuda_fp8_gmm2(c, 1, P[n->out[0]], q[0], s[0], w[0], ws[0], q[1], s[1], w[1], ws[1], offs, E, M, K, R,
                                                 MT_FP8_GMM_KERNEL, 0);
        } else {              /* mode 0: Y = X W^T (X [R, K]); mode 1: dX = dY W (dY [R, M], W transposed) */
            int mode = n->op == MT_OP_GMM || n->op == MT_OP_GMM_GLU ? 0 : 1, C = mode ? M : K;
            uint8_t *qa = (uint8_t *)TAKE((size_t)R * C), *qb = (uint8_t *)TAKE((size_t)E * M * K);
            float *sa = (float *)TAKE((size_t)KB(C) * R * 4), *sb = (float *)TAKE(mt__fp8_wscale_bytes(E, M, K, mode));
            uint8_t *xq = qa, *wq = qb;   /* the scratch's; a slot may stand in for either (mt__q8_plan) */
            float *xs = sa, *ws = sb;
            for (int t = 0; rt && !rc && t < (n->op == MT_OP_GMM_GLU ? 2 : 1); t++) {
                if (!t) rc = mt__q8_rows(rt, n, 0, &xq, &xs, R, C);
                wq = qb; ws = sb;
                rc = rc || mt__q8_weight(rt, n, t ? 3 : 1, &wq, &ws, E, M, K, mode) ||
                     mt_cuda_fp8_gmm(c, mode, P[n->out[t]], xq, xs, wq, ws, offs, E, M, K, R, 0, MT_FP8_GMM_KERNEL);
            }
            int done = 0;
            if (rt && !rc && n->op == MT_OP_GMM_GLU && n->out[2] >= 0 &&
                !(rc = mt__q8_swiglu(rt, n, 2, P[n->out[0]], P[n->out[1]], NULL, (int64_t)R * M, &done)) && !done)
                rc = mt_cuda_swiglu_forward(c, P[n->out[2]], P[n->out[0]], P[n->out[1]], (int64_t)R * M,
                                            rt->rows_dev ? rt->rows_dev[n->in[0]] : NULL, M);
        }
    }
#undef TAKE
#undef KB
    if (need) *need = used;
    if (rc) return mt_errf(err, "%s (fp8): %s", mt_ops[n->op].name, mt_cuda_error(c));
    return 0;
}

static int mt__cuda_zero_other_rows(mt_cuda *c, void *p, int64_t row_bytes, const mt_node *n, int64_t rows, int64_t N) {   /* as mt__zero_other_rows */
    int64_t r0 = n->iattr[1];
    return mt_cuda_memset(c, p, 0, (size_t)(r0 * row_bytes)) ||
           mt_cuda_memset(c, (uint8_t *)p + (r0 + rows) * row_bytes, 0, (size_t)((N - r0 - rows) * row_bytes));
}
/* The loss ops' backward scale in float as the kernels take it: 1.0f / N for the plain mean. */
static float mt__cuda_ce_scale(const mt_node *n, int N) { return (n->fattr[0] > 0 ? n->fattr[0] : 1.0f) / (float)mt__ce_count(n, N); }
static int mt__exec_cuda(mt_runtime *rt, const mt_node *n, mt_err *err) {
    mt_graph *G = &rt->g;
    mt_cuda *c = MT__CU(rt);
    void **P = rt->ptr;
#define V_(i) (P[n->in[i]])
#define F_(i) ((float *)P[n->in[i]])
#define I_(i) ((int32_t *)P[n->in[i]])
#define VO(i) (P[n->out[i]])
#define FO(i) ((float *)P[n->out[i]])
#define IO(i) ((int32_t *)P[n->out[i]])
#define DIM(v, d) ((int)G->values[v].dims[d])
#define DT(v) (G->values[v].dtype)
#define RD(v) (rt->rows_dev ? rt->rows_dev[v] : NULL)
    const int *a = n->iattr;
    int rc = 0;
    if (mt_node_fp8(n)) return mt__cuda_fp8(rt, G, n, NULL, err);
    switch (n->op) {
    case MT_OP_EMBED: {
        int64_t L = mt_value_numel_max(G, &G->values[n->in[1]]), lo = n->iattr[2] > 1 ? rt->sym[n->iattr[3]] * L : 0;
        rc = n->iattr[2] > 1 ? mt_cuda_embed_forward_range(c, VO(0), I_(0), V_(1), DIM(n->out[0], 0), DIM(n->in[1], 1), lo, L)
                             : mt_cuda_embed_forward(c, VO(0), I_(0) + mt__token_slice(rt, n), V_(1), DIM(n->out[0], 0), DIM(n->in[1], 1));
        break;
    }
    case MT_OP_EMBED_BWD: {
        int64_t L = mt_value_numel_max(G, &G->values[n->out[0]]), lo = n->iattr[2] > 1 ? rt->sym[n->iattr[3]] * L : 0;
        rc = mt_cuda_embed_backward_range(c, FO(0), V_(0), I_(1) + mt__token_slice(rt, n), DIM(n->in[0], 0), DIM(n->out[0], 0),
                                          DIM(n->out[0], 1), lo, L, rt->scratch);
        break;
    }
    case MT_OP_CE_STATS: rc = mt_cuda_ce_stats(c, FO(0), V_(0), I_(1), DIM(n->in[0], 0), DIM(n->in[0], 1), (int)rt->sym[a[0]] * DIM(n->in[0], 1)); break;
    case MT_OP_CE_COMBINE:
        rc = mt_cuda_ce_combine(c, FO(0), FO(1), F_(0), I_(2), DIM(n->in[0], 0) / DIM(n->in[1], 0), DIM(n->in[1], 0),
                                mt__ce_count(n, DIM(n->in[1], 0)), rt->scratch);
        break;
    case MT_OP_CE_SHARD_BWD:
        rc = mt_cuda_ce_shard_backward(c, VO(0), V_(0), F_(1), I_(2), DIM(n->in[0], 0), DIM(n->in[0], 1), (int)rt->sym[a[0]] * DIM(n->in[0], 1),
                                       mt__cuda_ce_scale(n, DIM(n->in[0], 0)));
        break;
    case MT_OP_SHIFT_TOKENS: rc = mt_cuda_shift_tokens(c, IO(0), I_(0), DIM(n->in[0], 0), a[0], a[1], a[2]); break;
    case MT_OP_RMSNORM: rc = mt_cuda_rmsnorm_forward(c, VO(0), FO(1), V_(0), F_(1), (int)mt__nrows(rt, n->in[0]), DIM(n->in[0], 1), n->fattr[0]); break;
    case MT_OP_RMSNORM_BWD:
        rc = mt_cuda_rmsnorm_backward(c, VO(0), FO(1), V_(0), V_(1), F_(2), F_(3), (int)mt__nrows(rt, n->in[1]), DIM(n->in[1], 1), rt->scratch);
        break;
    case MT_OP_MATMUL: case MT_OP_MATMUL_ACC: {
        int M = DIM(n->in[0], a[0] ? 1 : 0), K = DIM(n->in[0], a[0] ? 0 : 1), Nn = DIM(n->in[1], a[1] ? 0 : 1);
        rc = mt_cuda_matmul(c, VO(0), DT(n->out[0]), V_(0), DT(n->in[0]), V_(1), DT(n->in[1]), M, Nn, K, a[0], a[1], rt->scratch,
                            n->op == MT_OP_MATMUL_ACC ? V_(2) : NULL);
        break;
    }
    case MT_OP_SPLIT:
        rc = mt_cuda_split(c, VO(0), VO(1), V_(0), DIM(n->in[0], 0), DIM(n->out[0], 1), DIM(n->out[1], 1), (int)mt_dtype_bytes(G, DT(n->in[0])));
        break;
    case MT_OP_CONCAT:
        rc = mt_cuda_concat(c, VO(0), n->in[0] >= 0 ? V_(0) : NULL, n->in[1] >= 0 ? V_(1) : NULL, DIM(n->out[0], 0), a[0],
                            DIM(n->out[0], 1) - a[0], (int)mt_dtype_bytes(G, DT(n->out[0])));
        break;
    case MT_OP_MLA_ROPE:
        rc = mt_cuda_mla_rope_forward(c, VO(0), VO(1), VO(2), V_(0), V_(1), V_(2), F_(3), F_(4), DIM(n->in[0], 0), a[4], a[0], a[1], a[2], a[3]);
        break;
    case MT_OP_MLA_ROPE_BWD:
        rc = mt_cuda_mla_rope_backward(c, VO(0), VO(1), VO(2), V_(0), V_(1), V_(2), F_(3), F_(4), DIM(n->in[0], 0), a[4], a[0], a[1], a[2], a[3]);
        break;
    case MT_OP_ATTENTION:
        rc = mt_cuda_attention_forward(c, V_(0), V_(1), V_(2), n->in[3] >= 0 ? I_(3) : NULL, VO(0), FO(1), DIM(n->in[0], 0) / a[3], a[3],
                                       a[0], a[1], a[2], n->fattr[0]);
        break;
    case MT_OP_ATTENTION_BWD:
        rc = mt_cuda_attention_backward(c, V_(0), V_(1), V_(2), V_(3), F_(4), V_(5), n->in[6] >= 0 ? I_(6) : NULL, VO(0), VO(1), VO(2),
                                        rt->scratch, DIM(n->in[0], 0) / a[3], a[3], a[0], a[1], a[2], n->fattr[0]);
        break;
    case MT_OP_ROPE_PE:
        rc = mt_cuda_rope_pe_forward(c, VO(0), VO(1), V_(0), V_(1), F_(2), F_(3), DIM(n->in[0], 0), a[4], a[0], a[1], a[2]);
        break;
    case MT_OP_ROPE_PE_BWD: rc = mt_cuda_rope_pe_backward(c, VO(0), V_(0), F_(1), F_(2), DIM(n->in[0], 0), a[4], a[0], a[2]); break;
    case MT_OP_MLA_ATTENTION:
        rc = mt_cuda_mla_attention_forward(c, V_(0), V_(1), V_(2), V_(3), n->in[4] >= 0 ? I_(4) : NULL, VO(0), FO(1), DIM(n->in[0], 0) / a[3],
                                           a[3], a[0], a[4], a[1] - a[4], a[2], n->fattr[0]);
        break;
    case MT_OP_MLA_ATTENTION_BWD:
        rc = mt_cuda_mla_attention_backward(c, V_(0), V_(1), V_(2), V_(3), V_(4), F_(5), V_(6), n->in[7] >= 0 ? I_(7) : NULL, F_(8), F_(9),
                                            VO(0), VO(1), VO(2), rt->scratch, DIM(n->in[0], 0) / a[3], a[3], a[0], a[4], a[1] - a[4], a[2],
                                            n->fattr[0]);
        break;
    case MT_OP_DOC_STARTS: rc = mt_cuda_doc_starts(c, IO(0), I_(0), DIM(n->in[0], 0), a[0], a[1]); break;
    case MT_OP_SWIGLU: {   /* rows: the bound, or (device-side exchange) what the device says */
        int done = 0;   /* (FP8: or its readers' forms in its place) */
        if (!(rc = mt__q8_swiglu(rt, n, 0, V_(0), V_(1), NULL, mt__nrows(rt, n->in[0]) * mt__cols(rt, n->in[0]), &done)) && !done)
            rc = mt_cuda_swiglu_forward(c, VO(0), V_(0), V_(1), mt__nrows(rt, n->in[0]) * mt__cols(rt, n->in[0]), RD(n->in[0]), mt__cols(rt, n->in[0]));
        break;
    }
    case MT_OP_SWIGLU_BWD: {
        int done = 0;
        if (!(rc = mt__q8_swiglu(rt, n, 0, V_(0), V_(1), V_(2), mt__nrows(rt, n->in[0]) * mt__cols(rt, n->in[0]), &done)) && !done)
            rc = mt_cuda_swiglu_backward(c, VO(0), VO(1), V_(0), V_(1), V_(2), mt__nrows(rt, n->in[0]) * mt__cols(rt, n->in[0]), RD(n->in[0]),
                                         mt__cols(rt, n->in[0]));
        break;
    }
    case MT_OP_ADD: rc = mt_cuda_add(c, VO(0), V_(0), V_(1), mt__nrows(rt, n->in[0]) * mt__cols(rt, n->in[0]), DT(n->in[0])); break;
    case MT_OP_ROUTER:
        rc = mt_cuda_router_forward(c, IO(0), FO(1), FO(2), IO(3), F_(0), F_(1), DIM(n->in[0], 0), DIM(n->in[0], 1), a[0], a[1], a[2],
                                    n->fattr[0], a[3], a[4]);
        break;
    case MT_OP_ROUTER_BWD:
        rc = mt_cuda_router_backward(c, FO(0), F_(0), I_(1), F_(3), DIM(n->in[0], 0), DIM(n->in[0], 1), a[0], a[1], a[2], n->fattr[0]);
        break;
    case MT_OP_MOE_PERMUTE: {   /* tokens [i1, i1 + n) (mt__moe's chunks) */
        int D = DIM(n->in[0], 1), K = DIM(n->in[1], 1), rows = (int)mt__chunk_rows(G, n->out[0], K), done = 0;
        const void *x = (uint8_t *)V_(0) + (int64_t)a[1] * D * mt_dtype_bytes(G, DT(n->in[0]));
        if (!(rc = mt__q8_moe(rt, n, x, I_(1) + (int64_t)a[1] * K, NULL, NULL, NULL, NULL, rows, D, K, a[0], &done)) && !done)
            rc = mt_cuda_moe_permute(c, VO(0), IO(1), IO(2), x, I_(1) + (int64_t)a[1] * K, rows, D, K, a[0], rt->scratch);
        break;
    }
    case MT_OP_MOE_PERMUTE_BWD: {
        int D = DIM(n->out[0], 1), rows = (int)mt__chunk_rows(G, n->in[0], a[0]);
        int64_t row = D * mt_dtype_bytes(G, DT(n->out[0]));
        rc = mt__cuda_zero_other_rows(c, VO(0), row, n, rows, DIM(n->out[0], 0)) ||
             mt_cuda_moe_permute_backward(c, (uint8_t *)VO(0) + a[1] * row, V_(0), I_(1), rows, D, a[0]);
        break;
    }
    case MT_OP_EP_COUNTS:
        if (a[2] != 1) return mt__cuda_collective(rt, n, err);
        rc = mt_cuda_ep_counts(c, IO(0), I_(0), a[3], (int)rt->sym[a[4]] * a[3]);
        break;
    case MT_OP_EP_DISPATCH: case MT_OP_EP_COMBINE: {
        if (a[2] != 1) return mt__cuda_collective(rt, n, err);
        /* one rank: every row stays; rows [0, NK) of the source are the routed tokens */
        const mt_value *src = &G->values[n->in[0]];
        int64_t rows = mt__nrows(rt, n->in[0]);
        size_t bytes = (size_t)rows * (size_t)mt__cols(rt, n->in[0]) * (size_t)mt_dtype_bytes(G, src->dtype);
        rc = mt_cuda_copy(c, VO(0), V_(0), bytes, 2);
        if (!rc && n->op == MT_OP_EP_DISPATCH) { rc = mt_cuda_ep_offsets(c, IO(1), I_(2), a[3]); rt->rows[n->out[0]] = rows; }
        break;
    }
    case MT_OP_GMM_GLU:
        rc = mt_cuda_gmm_glu(c, VO(0), VO(1), VO(2), V_(0), V_(1), V_(3), I_(2), DIM(n->in[1], 0), DIM(n->in[1], 1), DIM(n->in[1], 2),
                             (int)mt__gmm_bound(rt, n->in[0]));
        break;
    case MT_OP_GMM: case MT_OP_GMM_DX: case MT_OP_GMM_DW: case MT_OP_GMM_DX2: case MT_OP_GMM_DW_SQ: {   /* the offsets come from our own permutation */
        int dw = n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ, sq = n->op == MT_OP_GMM_DW_SQ;
        int wi = dw ? n->out[0] : n->in[1];
        int E = DIM(wi, 0), M = DIM(wi, 1), K = DIM(wi, 2);
        int mode = n->op == MT_OP_GMM ? 0 : dw ? 2 : 1;
        int two = n->op == MT_OP_GMM_DX2;
        rc = mt_cuda_gmm(c, mode, VO(0), V_(0), V_(1), I_(2), E, M, K, (int)mt__gmm_bound(rt, n->in[0]), rt->scratch,
                         two ? V_(3) : NULL, two ? V_(4) : NULL, sq ? FO(1) : NULL,
                         sq ? mt_value_numel_max(G, &G->values[n->out[1]]) : 0);
        break;
    }
    case MT_OP_MOE_COMBINE: {   /* tokens [i1, i1 + n) of y; its other rows 0 */
        int D = DIM(n->in[0], 1), K = DIM(n->in[2], 1), rows = (int)mt__chunk_rows(G, n->in[1], K);
        int64_t row = D * mt_dtype_bytes(G, DT(n->out[0]));
        rc = mt__cuda_zero_other_rows(c, VO(0), row, n, rows, DIM(n->in[2], 0)) ||
             mt_cuda_moe_combine_forward(c, (uint8_t *)VO(0) + a[1] * row, V_(0), I_(1), F_(2) + (int64_t)a[1] * K, rows, D, K);
        break;
    }
    case MT_OP_MOE_COMBINE_BWD: {
        int D = DIM(n->in[1], 1), K = DIM(n->in[3], 1), rows = (int)mt__chunk_rows(G, n->in[2], K), done = 0;
        int64_t r0 = a[1];
        const void *dy = (uint8_t *)V_(0) + r0 * D * mt_dtype_bytes(G, DT(n->in[0]));
        if (!(rc = mt__cuda_zero_other_rows(c, FO(1), (int64_t)sizeof(float) * K, n, rows, DIM(n->in[3], 0))) &&
            !(rc = mt__q8_moe(rt, n, dy, NULL, V_(1), I_(2), F_(3) + r0 * K, FO(1) + r0 * K, rows, D, K, 0, &done)) && !done)
            rc = mt_cuda_moe_combine_backward(c, VO(0), FO(1) + r0 * K, dy, V_(1), I_(2), F_(3) + r0 * K, rows, D, K);
        break;
    }
    case MT_OP_CROSS_ENTROPY:
        rc = mt_cuda_cross_entropy_forward(c, FO(0), FO(1), V_(0), I_(1), DIM(n->in[0], 0), DIM(n->in[0], 1), mt__ce_count(n, DIM(n->in[0], 0)),
                                           rt->scratch);
        break;
    case MT_OP_CROSS_ENTROPY_BWD:
        rc = mt_cuda_cross_entropy_backward(c, VO(0), V_(0), F_(1), I_(2), DIM(n->in[0], 0), DIM(n->in[0], 1), mt__cuda_ce_scale(n, DIM(n->in[0], 0)));
        break;
    case MT_OP_SUMSQ:
        rc = mt_cuda_sumsq(c, FO(0), n->in[1] >= 0 ? F_(1) : NULL, F_(0), mt_value_numel_max(G, &G->values[n->in[0]]), !a[0],
                           rt->scratch);
        break;
    case MT_OP_ALLREDUCE: case MT_OP_ALLGATHER: case MT_OP_REDUCE_SCATTER: case MT_OP_SP_GATHER: case MT_OP_SP_SCATTER:
        return mt__cuda_collective(rt, n, err);
    case MT_OP_LR_SCHEDULE: rc = mt_cuda_lr_schedule(c, FO(0), F_(0), I_(1)); break;
    case MT_OP_CLIP: rc = mt_cuda_clip(c, FO(0), FO(1), F_(0), F_(1)); break;
    case MT_OP_ADAMW: {
        const mt__q8_slot *sl = mt__q8_refill(rt, n);
        if (sl) {   /* and the weight's FP8 forms (mt__q8_plan) */
            const mt_value *W = &G->values[n->out[3]];
            int E = W->ndim == 3 ? DIM(n->out[3], 0) : 1, Nw = DIM(n->out[3], W->ndim - 2), K = DIM(n->out[3], W->ndim - 1);
            rc = mt_cuda_adamw_fp8(c, F_(0), V_(2), V_(3), DT(n->in[2]) == MT_BF16, sl->shadow ? VO(3) : NULL, F_(1), E, Nw, K, F_(4),
                                   F_(5), F_(6), I_(7), a[0], sl->q[0], sl->s[0], sl->q[1], sl->s[1], sl->fresh);
            break;
        }
        if (G->values[n->in[2]].dtype == MT_BF16)
            rc = mt_cuda_adamw_bf16(c, F_(0), V_(2), V_(3), n->out[3] >= 0 ? VO(3) : NULL, F_(1), mt_value_numel_max(G, &G->values[n->in[0]]),
                                    F_(4), F_(5), F_(6), I_(7), a[0]);
        else
            rc = mt_cuda_adamw(c, F_(0), F_(2), F_(3), n->out[3] >= 0 ? VO(3) : NULL, F_(1), mt_value_numel_max(G, &G->values[n->in[0]]),
                               F_(4), F_(5), F_(6), I_(7), a[0]);
        break;
    }
    case MT_OP_EXPERT_BIAS_UPDATE: rc = mt_cuda_expert_bias_update(c, F_(0), I_(1), DIM(n->in[0], 0), n->fattr[0]); break;
    case MT_OP_ADD_RMSNORM:
        rc = mt_cuda_add_rmsnorm_forward(c, VO(0), VO(1), FO(2), V_(0), V_(1), F_(2), (int)mt__nrows(rt, n->in[0]), DIM(n->in[0], 1), n->fattr[0]);
        break;
    case MT_OP_RMSNORM_BWD_ADD:
        rc = mt_cuda_rmsnorm_backward_add(c, VO(0), FO(1), V_(0), V_(1), F_(2), F_(3), V_(4), (int)mt__nrows(rt, n->in[1]), DIM(n->in[1], 1), rt->scratch);
        break;
    default: return mt_errf(err, "op %s has no CUDA implementation", mt_ops[n->op].name);
    }
#undef V_
#undef F_
#undef I_
#undef VO
#undef FO
#undef RD
#undef IO
#undef DIM
#undef DT
    if (rc) return mt_errf(err, "%s", mt_cuda_error(c));
    for (int k = 0; k < n->n_out; k++) {
        int v = n->out[k];
        if (v >= 0 && G->values[v].dims[0] < 0 && n->op != MT_OP_EP_DISPATCH && n->in[0] >= 0) rt->rows[v] = mt__nrows(rt, n->in[0]);
    }
    return 0;
}
#endif

int mt_runtime_host_syncs(const mt_runtime *rt) { return rt->host_syncs; }
int64_t mt_runtime_received_rows(const mt_runtime *rt) { return rt->recv_rows; }
const char *mt_runtime_exchange(const mt_runtime *rt) { return rt->exchange; }
int mt_runtime_whole_step_graph(const mt_runtime *rt) { return rt->whole; }
void mt_runtime_abort(mt_runtime *rt) {
    if (!rt) return;
    if (rt->bind.cpu_world) mt_world_fail(rt->bind.cpu_world, rt->bind.rank, "aborted");
#ifdef MT_CUDA
    if (rt->world_comm) mt_nccl_free(rt->world_comm, 1);   /* ncclCommAbort: pending collectives return */
    rt->world_comm = NULL;
    for (int i = 1; i < rt->n_groups; i++)   /* group 0 is the world: its communicator went above */
        if (rt->groups[i].comm && rt->groups[i].owner == i) mt_nccl_free(rt->groups[i].comm, 1);
    for (int i = 0; i < rt->n_groups; i++) rt->groups[i].comm = NULL;
#endif
}
int mt_runtime_comm_error(mt_runtime *rt, mt_err *err) {
    (void)rt; (void)err;
#ifdef MT_CUDA
    char msg[256];
    if (rt->world_comm && mt_nccl_async_error(rt->world_comm, msg, sizeof msg)) return mt_errf(err, "NCCL: %s", msg);
    for (int i = 1; i < rt->n_groups; i++)
        if (rt->groups[i].comm && rt->groups[i].owner == i && mt_nccl_async_error(rt->groups[i].comm, msg, sizeof msg))
            return mt_errf(err, "NCCL: %s", msg);
#endif
    return 0;
}

/* --- binding.nan_check: find the first node that writes a NaN or Inf --- */

/* Index of the first non-finite among the first cnt elements of value v (-1: none). */
static int64_t mt__first_nonfinite(mt_runtime *rt, int v, int64_t cnt, double *bad, mt_err *err) {
    const mt_value *x = &rt->g.values[v];
    const uint8_t *p = (const uint8_t *)rt->ptr[v];
    uint8_t *host = NULL;
    if (x->dtype == MT_I32 || cnt <= 0) return -1;
    if (rt->backend != MT_BACKEND_CPU) {
        host = (uint8_t *)MT_MALLOC((size_t)x->nbytes + 1);
        if (!host || mt_runtime_read(rt, v, host, err)) { MT_FREE(host); return -2; }
        p = host;
    }
    int64_t esz = mt_dtype_bytes(&rt->g, x->dtype), at = -1;
    for (int64_t i = 0; i < cnt && at < 0; i++) {
        double d;
        if (x->dtype == MT_BF16) { uint32_t u = (uint32_t)(p[2 * i] | p[2 * i + 1] << 8) << 16; float f; memcpy(&f, &u, 4); d = f; }
        else if (esz == 8) memcpy(&d, p + 8 * i, 8);
        else { float f; memcpy(&f, p + 4 * i, 4); d = f; }
        if (!isfinite(d)) { at = i; *bad = d; }
    }
    MT_FREE(host);
    return at;
}
static int64_t mt__live_elems(mt_runtime *rt, int v) {   /* what this step wrote: symbolic rows at their data size */
    const mt_value *x = &rt->g.values[v];
    return x->dims[0] < 0 ? mt__nrows(rt, v) * mt__cols(rt, v) : mt_value_numel_max(&rt->g, x);
}
static int mt__nan_check(mt_runtime *rt, int node, int step, mt_err *err) {
    const mt_graph *G = &rt->g;
    const mt_node *n = &G->nodes[node];
    static const char *const phase[4] = {"forward", "backward", "optimizer", "recompute"};
    for (int k = 0; k < n->n_out; k++) {
        int v = n->out[k];
        double bad = 0;
        int64_t at = v < 0 ? -1 : mt__first_nonfinite(rt, v, mt__live_elems(rt, v), &bad, err);
        if (at == -2) return -1;
        if (at < 0) continue;
        char inputs[400] = "its inputs were finite";
        for (int i = 0, any = 0; i < n->n_in; i++) {   /* or did it receive the non-finite value? */
            double b2;
            int u = n->in[i];
            if (u < 0 || u == v || mt__first_nonfinite(rt, u, mt__live_elems(rt, u), &b2, err) < 0) continue;
            size_t l = any ? strlen(inputs) : 0;
            snprintf(inputs + l, sizeof inputs - l, "%s'%s'", any ? ", " : "input already non-finite: ", G->values[u].name);
            any = 1;
        }
        char layer[32] = "outside the blocks";
        if (n->layer >= 0) snprintf(layer, sizeof layer, "layer %d", n->layer);
        return mt_errf(err, "step %d: node %d (%s, %s, %s) wrote %g to '%s' (element %lld); %s", step + 1, node, mt_ops[n->op].name,
                       phase[n->phase >= 0 && n->phase < 4 ? n->phase : 0], layer, bad, G->values[v].name, (long long)at, inputs);
    }
    return 0;
}

#ifdef MT_CUDA
/* Runs that launch together (mt_cuda_sumsq_multi, mt_cuda_adamw_multi): SUMSQ nodes chained on one
 * accumulator, ADAMW nodes of the same lr, clip coefficient, hyperparameters and step. Runs nodes
 * [i, j), 2 <= j - i, j <= lim, as one batch and returns j; returns 0 (nothing run) where node i
 * starts no such run. The launches do what the nodes' own would, so the bits are the same. */
/* The end of the run from node i (before lim) that one multi-tensor launch takes: a chain of SUMSQ, or
 * ADAMW nodes with the same step scalars; 0 where there is none of 2 nodes or more. */
static int mt__multi_run(const mt_runtime *rt, int i, int lim) {
    const mt_graph *G = &rt->g;
    const mt_node *a = &G->nodes[i];
    if (rt->bind.one_launch_per_node || (a->op != MT_OP_SUMSQ && a->op != MT_OP_ADAMW) || mt__q8_refill(rt, a)) return 0;
    int j = i + 1;
    for (; j < lim; j++) {
        const mt_node *b = &G->nodes[j];
        if (b->op != a->op || mt__q8_refill(rt, b)) break;
        if (a->op == MT_OP_SUMSQ && b->in[1] != G->nodes[j - 1].out[0]) break;
        if (a->op == MT_OP_ADAMW && (b->in[4] != a->in[4] || b->in[5] != a->in[5] || b->in[6] != a->in[6] || b->in[7] != a->in[7])) break;
    }
    return j - i < 2 ? 0 : j;
}
static int mt__exec_cuda_multi(mt_runtime *rt, int i, int lim, mt_err *err) {
    const mt_graph *G = &rt->g;
    const mt_node *a = &G->nodes[i];
    int j = mt__multi_run(rt, i, lim);
    if (!j) return 0;
    void **P = rt->ptr;
    int rc, cnt = j - i;
    if (a->op == MT_OP_SUMSQ) {
        mt_cuda_sumsq_item *it = (mt_cuda_sumsq_item *)mt__calloc(sizeof *it * (size_t)cnt);
        if (!it) return mt_errf(err, "out of memory");
        for (int k = 0; k < cnt; k++) {
            const mt_node *n = &G->nodes[i + k];
            it[k].acc_out = (float *)P[n->out[0]];
            it[k].g = (const float *)P[n->in[0]];
            it[k].n = mt_value_numel_max(G, &G->values[n->in[0]]);
            it[k].squares = !n->iattr[0];
        }
        rc = mt_cuda_sumsq_multi(MT__CU(rt), a->in[1] >= 0 ? (const float *)P[a->in[1]] : NULL, it, cnt, rt->scratch);
        MT_FREE(it);
    } else {
        mt_cuda_adamw_item *it = (mt_cuda_adamw_item *)mt__calloc(sizeof *it * (size_t)cnt);
        if (!it) return mt_errf(err, "out of memory");
        for (int k = 0; k < cnt; k++) {
            const mt_node *n = &G->nodes[i + k];
            it[k].p = (float *)P[n->in[0]];
            it[k].g = (const float *)P[n->in[1]];
            it[k].m = P[n->in[2]];
            it[k].v = P[n->in[3]];
            it[k].bf16_moments = G->values[n->in[2]].dtype == MT_BF16;
            it[k].p_bf16 = n->out[3] >= 0 ? P[n->out[3]] : NULL;
            it[k].n = mt_value_numel_max(G, &G->values[n->in[0]]);
            it[k].decay = n->iattr[0];
        }
        rc = mt_cuda_adamw_multi(MT__CU(rt), it, cnt, (const float *)P[a->in[4]], (const float *)P[a->in[5]],
                                 (const float *)P[a->in[6]], (const int32_t *)P[a->in[7]]);
        MT_FREE(it);
    }
    if (rc) return mt_errf(err, "%s", mt_cuda_error(MT__CU(rt)));
    rt->multi_nodes += cnt;
    return j;
}

/* This runtime's capture rule: the graph's (mt_node_capturable), except that
 * when no exchange asks the host for counts (none over several ranks, or every
 * one device-side) nothing does: NCCL records its collectives into graphs, and
 * the symbolic-row nodes launch for their bound and read the actual rows on
 * the device (rt->rows_dev, the grouped GEMMs' offsets). */
static int mt__capturable(const mt_runtime *rt, const mt_node *n) {
    if (rt->ep_device || !rt->exchange[0]) return 1;
    return mt_node_capturable(&rt->g, n);
}

/* The step on CUDA. Without g.overlap every node goes to the compute stream in
 * list order. With it, each node goes to its queue's stream (mt_schedule) after
 * waiting for the events of the nodes it depends on; the side streams wait for
 * the step's start and the compute stream waits for all of them at its end.
 * Captured regions hold compute nodes only (a collective over several ranks
 * is never captured): the waits of a region's nodes are made before it is
 * replayed, and one event after it marks all its nodes done (a region ends at
 * a node another stream waits for, so that stream starts no later than the
 * schedule says). Both only make the waits stronger than the schedule's, so
 * the memory plan stays safe.
 * Profiling times the compute stream; time it spends waiting for another
 * stream is charged to the op it waited for (the exposed communication). */
static int mt__cuda_prof_read(mt_runtime *rt, int step, mt_err *err);
static int mt__cuda_issue(mt_runtime *rt, int step, int use_graphs, mt_err *err) {
    mt_graph *G = &rt->g;
    mt_cuda *cu = MT__CU(rt);
    int n = G->n_nodes, multi = G->overlap && rt->ev_of && !rt->bind.nan_check, prof = rt->bind.profile;
    const mt_schedule *S = &rt->sched;
    int last[MT_NQUEUES] = {-1, -1, -1};
#define CU_(x) do { if (x) return mt_errf(err, "step %d: %s", step, mt_cuda_error(cu)); } while (0)
    if (prof) { CU_(mt_cuda_events(cu, 3 * n + 2)); CU_(mt_cuda_event_record(cu, 0)); }
    if (use_graphs && !rt->graphs && !(rt->graphs = (void **)mt__calloc(sizeof(void *) * (size_t)(n + 1))))
        return mt_errf(err, "out of memory");
    if (multi) {   /* fence: the side streams start after everything before this step (those that run anything) */
        int used[MT_NQUEUES] = {0};
        for (int i = 0; i < n; i++) used[S->queue[i]] = 1;
        CU_(mt_cuda_queue_record(cu, n));
        for (int q = 1; q < MT_NQUEUES; q++) if (used[q]) { CU_(mt_cuda_set_queue(cu, q)); CU_(mt_cuda_queue_wait(cu, n)); }
        CU_(mt_cuda_set_queue(cu, MT_Q_COMPUTE));
        for (int i = 0; i < n; i++) rt->ev_of[i] = i;
    }
    for (int i = 0; i < n;) {
        mt_err e;
        int q = multi ? S->queue[i] : MT_Q_COMPUTE;
        if (use_graphs && q == MT_Q_COMPUTE && mt__capturable(rt, &G->nodes[i])) {   /* a region: replay, or capture it once */
            int end = i, used = 0;
            while (end < n && mt__capturable(rt, &G->nodes[end]) && (!multi || S->queue[end] == MT_Q_COMPUTE)) {
                int waited_on = multi && rt->ev_used[end];   /* another stream waits for this node: the region ends with it */
                end++;
                if (waited_on) break;
            }
            for (int k = i; multi && k < end; k++) {
                used |= rt->ev_used[k];
                for (int w = S->wait_at[k]; w < S->wait_at[k + 1]; w++) CU_(mt_cuda_queue_wait(cu, rt->ev_of[S->wait[w]]));
            }
            if (!rt->graphs[i]) {
                CU_(mt_cuda_capture_begin(cu));
                for (int k = i; k < end;) {
                    int to = mt__exec_cuda_multi(rt, k, end, &e);
                    if (to < 0 || (!to && mt__exec_cuda(rt, &G->nodes[k], &e))) {
                        mt_cuda_capture_end(cu, NULL);
                        return mt_errf(err, "capturing node %d (%s): %s", k, mt_ops[G->nodes[k].op].name, e.msg);
                    }
                    k = to ? to : k + 1;
                }
                CU_(mt_cuda_capture_end(cu, &rt->graphs[i]));
            }   /* a replay skips the nodes' host side; symbolic row counts keep their captured values */
            CU_(mt_cuda_graph_launch(cu, rt->graphs[i]));
            if (used) {
                CU_(mt_cuda_queue_record(cu, end - 1));
                for (int k = i; k < end; k++) rt->ev_of[k] = end - 1;
            }
            i = end;
            continue;
        }
        /* a run launched together (mt__exec_cuda_multi); with streams, one that no other stream waits
         * inside of: it waits for what all its nodes wait for, and its last node's event stands for it */
        int to = 0;
        if (!rt->bind.nan_check) {
            int lim = n;
            if (multi) for (lim = i + 1; lim < n && S->queue[lim] == q && !rt->ev_used[lim - 1];) lim++;
            to = mt__multi_run(rt, i, lim);
        }
        if (multi) {
            CU_(mt_cuda_set_queue(cu, q));
            if (prof && q == MT_Q_COMPUTE) CU_(mt_cuda_event_record(cu, 3 * i + 1));   /* before its waits */
            for (int k = i; k < (to ? to : i + 1); k++)
                for (int w = S->wait_at[k]; w < S->wait_at[k + 1]; w++) CU_(mt_cuda_queue_wait(cu, rt->ev_of[S->wait[w]]));
            if (prof) CU_(mt_cuda_event_record(cu, 3 * i + 2));   /* after them (on a side stream: its start) */
        }
        if (to) to = mt__exec_cuda_multi(rt, i, to, &e);
        if (to < 0 || (!to && mt__exec_cuda(rt, &G->nodes[i], &e)))
            return mt_errf(err, "step %d, node %d (%s, layer %d): %s", step, i, mt_ops[G->nodes[i].op].name, G->nodes[i].layer, e.msg);
        if (to) {   /* profiled: the run's time is its first node's */
            for (int k = i; prof && !multi && k < to; k++) CU_(mt_cuda_event_record(cu, k + 1));
            if (multi) {
                for (int k = i; prof && k < to; k++) {
                    if (k > i) { CU_(mt_cuda_event_record(cu, 3 * k + 1)); CU_(mt_cuda_event_record(cu, 3 * k + 2)); }
                    CU_(mt_cuda_event_record(cu, 3 * k + 3));
                }
                if (rt->ev_used[to - 1]) CU_(mt_cuda_queue_record(cu, to - 1));
                last[q] = to - 1;
                CU_(mt_cuda_set_queue(cu, MT_Q_COMPUTE));
            }
            i = to;
            continue;
        }
        if (multi) {
            if (prof) CU_(mt_cuda_event_record(cu, 3 * i + 3));
            if (rt->ev_used[i]) CU_(mt_cuda_queue_record(cu, i));
            last[q] = i;
            CU_(mt_cuda_set_queue(cu, MT_Q_COMPUTE));
        }
        if (rt->bind.nan_check && mt__nan_check(rt, i, step, err)) return -1;
        if (prof && !multi) CU_(mt_cuda_event_record(cu, i + 1));
        i++;
    }
    if (multi)   /* join: the compute stream waits for every side stream's last node */
        for (int q = 1; q < MT_NQUEUES; q++)
            if (last[q] >= 0) {
                if (!rt->ev_used[last[q]]) {   /* nobody waited for it: record now, on its stream */
                    CU_(mt_cuda_set_queue(cu, q)); CU_(mt_cuda_queue_record(cu, last[q])); CU_(mt_cuda_set_queue(cu, MT_Q_COMPUTE));
                }
                CU_(mt_cuda_queue_wait(cu, last[q]));
            }
    if (prof) CU_(mt_cuda_event_record(cu, 3 * n + 1));
#undef CU_
    return prof && !rt->prof_capture ? mt__cuda_prof_read(rt, step, err) : 0;
}
/* The profiled step's events, once it ran: per op; and the step's compute, communication, and
 * communication the compute stream waited for. */
static int mt__cuda_prof_read(mt_runtime *rt, int step, mt_err *err) {
    mt_graph *G = &rt->g;
    mt_cuda *cu = MT__CU(rt);
    int n = G->n_nodes, multi = G->overlap && rt->ev_of && !rt->bind.nan_check;
    const mt_schedule *S = &rt->sched;
    if (mt_cuda_sync(cu)) return mt_errf(err, "step %d: %s", step, mt_cuda_error(cu));
    if (multi && !rt->prof_wait && !(rt->prof_wait = (double *)mt__calloc(sizeof(double) * (size_t)(n + 1))))
        return mt_errf(err, "out of memory");
    {
        double *ps = rt->prof_step;
        ps[0] += mt_cuda_event_ms(cu, 0, 3 * n + 1);
        for (int i = 0; i < n; i++) {
            int coll = mt__is_collective(G->nodes[i].op);
            rt->prof_calls[G->nodes[i].op]++;
            if (!multi) {
                double t = mt_cuda_event_ms(cu, i, i + 1);
                rt->prof_ms[G->nodes[i].op] += t;
                ps[coll ? 2 : 1] += t;
                if (coll) ps[3] += t;   /* on the one stream: all of it in the way */
                continue;
            }
            double t = mt_cuda_event_ms(cu, 3 * i + 2, 3 * i + 3);
            if (S->queue[i] != MT_Q_COMPUTE) { ps[2] += t; continue; }   /* timed on its own stream: only its stall shows, below */
            rt->prof_ms[G->nodes[i].op] += t;
            ps[coll ? 2 : 1] += t;
            if (coll) ps[3] += t;
            int waited = -1;
            for (int w = S->wait_at[i]; w < S->wait_at[i + 1]; w++) if (S->wait[w] > waited) waited = S->wait[w];
            if (waited >= 0) {
                double stall = mt_cuda_event_ms(cu, 3 * i + 1, 3 * i + 2);
                rt->prof_ms[G->nodes[waited].op] += stall;
                if (rt->prof_wait) rt->prof_wait[waited] += stall;
                if (S->queue[waited] != MT_Q_COMPUTE && mt__is_collective(G->nodes[waited].op)) ps[3] += stall;
            }
        }
        ps[4] += 1;
    }
    return 0;
}
/* The step: with rt->whole one graph, captured on the second step (the host
 * issues every node once, streams and events included; the first runs
 * eagerly) and replayed after; else issued node by node, with the capturable
 * regions replayed. A profiled step, after a first step and where every node
 * can be captured, is one graph too, its events recorded inside it: it runs
 * as the unprofiled step does, not at the pace of a host issuing node by node. */
static int mt__cuda_run_step(mt_runtime *rt, int step, mt_err *err);
static int mt__cuda_run(mt_runtime *rt, int step, mt_err *err) {
    int rc = mt__cuda_run_step(rt, step, err);
    if (!rc) rt->ran = 1;
    return rc;
}
static int mt__cuda_run_step(mt_runtime *rt, int step, mt_err *err) {
    mt_cuda *cu = MT__CU(rt);
    int plain = !rt->bind.profile && !rt->bind.nan_check;
    if (rt->bind.profile && !rt->bind.nan_check && rt->g.capture && rt->ran) {
        int all = 1;
        for (int i = 0; all && i < rt->g.n_nodes; i++) all = mt__capturable(rt, &rt->g.nodes[i]);
        if (all && !rt->prof_graph) {
            if (mt_cuda_events(cu, 3 * rt->g.n_nodes + 2) || mt_cuda_capture_begin(cu)) return mt_errf(err, "step %d: %s", step, mt_cuda_error(cu));
            rt->prof_capture = 1;
            int rc = mt__cuda_issue(rt, step, 0, err);
            rt->prof_capture = 0;
            if (rc) { mt_cuda_capture_end(cu, NULL); return -1; }
            if (mt_cuda_capture_end(cu, &rt->prof_graph)) return mt_errf(err, "step %d: capturing the profiled step: %s", step, mt_cuda_error(cu));
        }
        if (all) {
            if (mt_cuda_graph_launch(cu, rt->prof_graph)) return mt_errf(err, "step %d: %s", step, mt_cuda_error(cu));
            return mt__cuda_prof_read(rt, step, err);
        }
    }
    if (!rt->whole || !plain) return mt__cuda_issue(rt, step, rt->g.capture && plain, err);
    if (!rt->warm) {   /* the first step eagerly: NCCL connects its peers lazily, which a capture may not do */
        rt->warm = 1;
        return mt__cuda_issue(rt, step, 0, err);
    }
    if (!rt->step_graph) {
        if (mt_cuda_capture_begin(cu)) return mt_errf(err, "step %d: %s", step, mt_cuda_error(cu));
        if (mt__cuda_issue(rt, step, 0, err)) { mt_cuda_capture_end(cu, NULL); return -1; }
        if (mt_cuda_capture_end(cu, &rt->step_graph)) return mt_errf(err, "step %d: capturing the step: %s", step, mt_cuda_error(cu));
    }
    if (mt_cuda_graph_launch(cu, rt->step_graph)) return mt_errf(err, "step %d: %s", step, mt_cuda_error(cu));
    return 0;
}
#endif

int mt_runtime_step(mt_runtime *rt, const int32_t *tokens, const int32_t *targets, int step, const mt_hparams *hp,
                    mt_step_stats *st, mt_err *err) {
    mt_graph *G = &rt->g;
    double t0 = mt_now();
    if (mt_runtime_check_devices(rt, err)) return -1;
#ifdef MT_CUDA
    if (rt->backend == MT_BACKEND_CUDA && mt_cuda_use(MT__CU(rt))) return mt_errf(err, "%s", mt_cuda_error(MT__CU(rt)));
#endif
    int V = G->cfg.vocab_size;
    for (int64_t i = 0; i < rt->n_tokens; i++) {
        if (tokens[i] < 0 || tokens[i] >= V) return mt_errf(err, "token %d at position %lld is outside the vocabulary (size %d)", tokens[i], (long long)i, V);
        if (targets[i] < 0 || targets[i] >= V) return mt_errf(err, "target %d at position %lld is outside the vocabulary (size %d)", targets[i], (long long)i, V);
    }
    if (mt_runtime_write(rt, G->io[MT_IO_TOKENS], tokens, err) || mt_runtime_write(rt, G->io[MT_IO_TARGETS], targets, err)) return -1;
    if (G->kind == MT_GRAPH_TRAIN) {
        if (!hp) return mt_errf(err, "a training step needs hyper-parameters");
        if (step < 0) return mt_errf(err, "step must be >= 0");
        float packed[MT_HP_COUNT];
        mt_real h[MT_HP_COUNT];
        mt_hparams_pack(hp, packed);
        for (int i = 0; i < MT_HP_COUNT; i++) h[i] = (mt_real)packed[i];
        int32_t s32 = step;
        if (mt_runtime_write(rt, G->io[MT_IO_HPARAMS], h, err) || mt_runtime_write(rt, G->io[MT_IO_STEP], &s32, err)) return -1;
    }
    rt->host_syncs = 0; rt->recv_rows = 0;
    if (rt->backend == MT_BACKEND_CPU) {
        if (rt->bind.poison) memset(rt->arena, 0xff, (size_t)G->arena_bytes);   /* NaN floats, -1 ints */
        for (int i = 0; i < G->n_nodes; i++) {
            mt_err e;
            double t = rt->bind.profile ? mt_now() : 0;
            if (mt__exec_cpu(rt, &G->nodes[i], &e)) {
                mt_errf(err, "step %d, node %d (%s, layer %d): %s", step, i, mt_ops[G->nodes[i].op].name, G->nodes[i].layer, e.msg);
                mt_world_fail(rt->bind.cpu_world, rt->bind.rank, err->msg);   /* the other ranks stop too */
                return -1;
            }
            if (rt->bind.nan_check && mt__nan_check(rt, i, step, err)) { mt_world_fail(rt->bind.cpu_world, rt->bind.rank, err->msg); return -1; }
            if (rt->bind.profile) { rt->prof_ms[G->nodes[i].op] += 1e3 * (mt_now() - t); rt->prof_calls[G->nodes[i].op]++; }
        }
    } else {
#ifdef MT_CUDA
        mt_cuda *cu = MT__CU(rt);
        if (rt->bind.poison && mt_cuda_memset(cu, rt->arena, 0xff, (size_t)G->arena_bytes)) return mt_errf(err, "%s", mt_cuda_error(cu));
        if (mt__cuda_run(rt, step, err)) {
            mt_cuda_set_queue(cu, MT_Q_COMPUTE);
            return -1;
        }
        if (mt_cuda_check_flag(cu)) return mt_errf(err, "step %d: %s", step, mt_cuda_error(cu));
        if (rt->recv_rows_dev) {   /* the device-side exchange counts received rows on the device */
            long long now = 0;
            if (mt_cuda_copy(cu, &now, rt->recv_rows_dev, sizeof now, 1)) return mt_errf(err, "%s", mt_cuda_error(cu));
            rt->recv_rows = now - rt->recv_rows_read;
            rt->recv_rows_read = now;
        }
#endif
    }
    if (st) {
        memset(st, 0, sizeof *st);
        mt_real x[3] = {0, 0, 0};
        if (mt_runtime_read(rt, G->io[MT_IO_LOSS], &x[0], err)) return -1;
        if (G->kind == MT_GRAPH_TRAIN &&
            (mt_runtime_read(rt, G->io[MT_IO_GRAD_NORM], &x[1], err) || mt_runtime_read(rt, G->io[MT_IO_LR], &x[2], err))) return -1;
        st->loss = (double)x[0]; st->grad_norm = (double)x[1]; st->lr = (double)x[2];
        for (int k = 1; k <= G->cfg.mtp_layers; k++) {
            char nm[32];
            snprintf(nm, sizeof nm, "mtp_loss.%d", k);
            int v = mt_graph_find(G, nm);
            if (v < 0) return mt_errf(err, "the graph has no output '%s'", nm);
            if (mt_runtime_read(rt, v, &x[0], err)) return -1;
            st->mtp_loss += (double)x[0] / G->cfg.mtp_layers;
        }
        st->seconds = mt_now() - t0;
    }
#ifdef MT_CUDA
    else if (rt->backend == MT_BACKEND_CUDA && mt_cuda_sync(MT__CU(rt))) return mt_errf(err, "%s", mt_cuda_error(MT__CU(rt)));
#endif
    return 0;
}

/* ========================================================================
 * 11. Checkpoints: safetensors with Hugging Face DeepSeek-V3 names
 * A stacked expert parameter "...experts.*.gate_proj.weight" [E_local,F,D]
 * is written as E_local tensors "...experts.<global e>.gate_proj.weight".
 * ====================================================================== */

typedef struct {
    char name[MT_NAME_LEN + 16]; int ndim; int64_t shape[3]; const mt_real *src; mt_real *dst; int64_t numel;
    int bf16;   /* stored as BF16 (bf16 moments; their staged reals are exact bf16 values) */
} mt__tensor;
/* Host copies of the values a checkpoint reads or writes (device values are
 * staged; CPU values too, for one code path). Staged as reals whatever the
 * value's dtype: bf16 moments widen exactly when read from the runtime and
 * round to nearest even when written to it (mt__staged_read, _commit), so
 * a file of either moment dtype loads into a graph of either. */
typedef struct {
    int value; mt_real *buf;   /* the value's stored bytes */
    mt_real *whole; int64_t lo; /* an FSDP-sharded or tp-split value being loaded: the whole (EP-local) tensor, and this rank's
                                   first element of its (tp) part */
} mt__staged;
/* A value's tp split (MT_VF_TP_ROWS / MT_VF_TP_COLS of its parameter; 0: whole on every tp rank). */
static uint32_t mt__tp_split(const mt_graph *G, const mt_value *v) {
    const mt_value *owner = v->role == MT_ROLE_OPT && v->param >= 0 ? &G->values[v->param] : v;
    return G->mesh.size[MT_DIM_TP] > 1 ? owner->flags & MT_VF_TP : 0;
}
/* A sharded run's checkpoint is written from every rank's part (see mt__checkpoint_save_parts). */
typedef struct { int64_t at, lo; int rank; } mt__part_slot;   /* a part's place in the whole tensor */
static int mt__part_slot_cmp(const void *a, const void *b) {
    const mt__part_slot *x = (const mt__part_slot *)a, *y = (const mt__part_slot *)b;
    return x->at != y->at ? (x->at < y->at ? -1 : 1) : x->rank - y->rank;
}
typedef struct { int world; const int *fd; const int64_t *off; mt__part_slot *slot; } mt__parts;
static uint16_t mt__bf16_from_real(mt_real x) { return sizeof(mt_real) == 8 ? mt__bf16_from_double((double)x) : mt_bf16_round((float)x); }
/* A value's bytes from the runtime into reals (buf: stored + 1 of them). */
static int mt__staged_read(mt_runtime *rt, int i, mt_real *buf, mt_err *err) {
    const mt_value *v = &rt->g.values[i];
    if (v->dtype != MT_BF16) return mt_runtime_read(rt, i, buf, err);
    int64_t stored = mt_value_numel_max(&rt->g, v);
    uint16_t *h = (uint16_t *)MT_MALLOC((size_t)v->nbytes + 2);
    if (!h) return mt_errf(err, "out of memory staging '%s'", v->name);
    int rc = mt_runtime_read(rt, i, h, err);
    for (int64_t k = 0; !rc && k < stored; k++) buf[k] = (mt_real)mt_bf16_float(h[k]);
    MT_FREE(h);
    return rc;
}
static int mt__staged_write(mt_runtime *rt, int i, const mt_real *buf, mt_err *err) {
    const mt_value *v = &rt->g.values[i];
    if (v->dtype != MT_BF16) return mt_runtime_write(rt, i, buf, err);
    int64_t stored = mt_value_numel_max(&rt->g, v);
    uint16_t *h = (uint16_t *)MT_MALLOC((size_t)v->nbytes + 2);
    if (!h) return mt_errf(err, "out of memory staging '%s'", v->name);
    for (int64_t k = 0; k < stored; k++) h[k] = mt__bf16_from_real(buf[k]);
    int rc = mt_runtime_write(rt, i, h, err);
    MT_FREE(h);
    return rc;
}
static void mt__staged_free(mt__staged *st, int n) {
    for (int i = 0; i < n; i++) { MT_FREE(st[i].buf); MT_FREE(st[i].whole); }
    MT_FREE(st);
}

/* The tensors of one role (PARAM masters, or one AdamW moment) under HF
 * names, pointing into freshly staged host copies (read from the runtime). */
/* The checkpoint tensors of one role under their Hugging Face names, stacked
 * experts split into one tensor per global expert, each value staged in a host
 * buffer. From this rank's runtime (parts == NULL): its experts; a value
 * sharded over FSDP ranks is staged whole as well (its EP-local tensor, for
 * loading: mt__staged_commit keeps this rank's range). From the parts of a
 * sharded run (rank 0 saving): every value whole, every expert of the mesh. */
static int mt__tensors(mt_runtime *rt, int role, const char *prefix, const mt__parts *parts, mt__tensor **out, int *n_out,
                       mt__staged **st_out, int *n_st, mt_err *err) {
    const mt_graph *G = &rt->g;
    int n = 0, cap = 0, ns = 0, scap = 0, ep = G->mesh.size[MT_DIM_EP];
    mt__tensor *t = NULL;
    mt__staged *st = NULL;
    *out = NULL; *n_out = 0; *st_out = NULL; *n_st = 0;
    for (int i = 0; i < G->n_values; i++) {
        const mt_value *v = &G->values[i];
        if (v->role != role) continue;
        if (role == MT_ROLE_PARAM && v->param >= 0) continue;           /* shadows */
        if (role == MT_ROLE_OPT && strncmp(v->name, prefix, strlen(prefix))) continue;
        const mt_value *owner = role == MT_ROLE_OPT ? &G->values[v->param] : v;
        int experts = (owner->flags & MT_VF_EXPERTS) != 0, chunks = experts ? (int)v->dims[0] : 1, first = 0;
        int64_t len = mt_value_numel_logical(G, v), stored = mt_value_numel_max(G, v), per = len / chunks;
        uint32_t split = mt__tp_split(G, v);   /* a tp part: the checkpoint holds the whole weight */
        int64_t tp = split ? G->mesh.size[MT_DIM_TP] : 1, cols = v->ndim > 1 ? v->dims[1] : 1;
        if (mt__grow((void **)&st, &scap, ns + 1, sizeof *st)) goto oom;
        mt__staged *x = &st[ns];
        memset(x, 0, sizeof *x);
        x->value = i;
        mt_real *base;
        if (parts) {   /* whole, from every rank's part */
            int64_t count = experts ? len * ep : len * tp;
            if (!(x->buf = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)(count + 1)))) goto oom;
            ns++;
            mt__part_slot *sl = parts->slot;   /* where each rank's part goes; replicas' parts once */
            for (int r = 0; r < parts->world; r++) {
                int co[MT_NDIMS];
                mt_mesh_coords(&G->mesh, r, co);
                sl[r].lo = v->shard ? (int64_t)mt_mesh_group(&G->mesh, v->shard, r, NULL) * stored : 0;
                sl[r].at = sl[r].lo < len ? (experts ? co[MT_DIM_EP] * len : 0) + (split ? co[MT_DIM_TP] * len : 0) + sl[r].lo : -1;   /* -1: padding only */
                sl[r].rank = r;
            }
            qsort(sl, (size_t)parts->world, sizeof *sl, mt__part_slot_cmp);
            int bf = v->dtype == MT_BF16;   /* a part holds the value's bytes: bf16 moments widen to reals here */
            for (int k = 0; k < parts->world; k++) {
                if (sl[k].at < 0 || (k && sl[k].at == sl[k - 1].at)) continue;
                int r = sl[k].rank;
                int64_t cnt = len - sl[k].lo < stored ? len - sl[k].lo : stored;
                size_t nb = (size_t)(bf ? 2 : sizeof(mt_real)) * (size_t)(cnt > 0 ? cnt : 0);
                void *tmp = NULL;   /* a row-parallel part's elements are spread over the whole tensor's rows */
                if (((split & MT_VF_TP_COLS) || bf) && !(tmp = MT_MALLOC(nb + sizeof(mt_real)))) goto oom;
                char *dst = tmp ? (char *)tmp : (char *)(x->buf + sl[k].at);
                for (size_t got = 0; got < nb;) {
                    ssize_t k = pread(parts->fd[r], dst + got, nb - got, (off_t)(parts->off[i] + (int64_t)got));
                    if (k <= 0) { MT_FREE(tmp); mt_errf(err, "reading rank %d's part of the checkpoint: %s", r, k ? strerror(errno) : "it is short"); goto fail; }
                    got += (size_t)k;
                }
                if (tmp) {
                    int co[MT_NDIMS];
                    mt_mesh_coords(&G->mesh, r, co);
                    for (int64_t j = 0; j < cnt; j++) {
                        mt_real y = bf ? (mt_real)mt_bf16_float(((const uint16_t *)tmp)[j]) : ((const mt_real *)tmp)[j];
                        x->buf[(split & MT_VF_TP_COLS) ? mt__tp_element(split, sl[k].lo + j, co[MT_DIM_TP], len, cols, tp) : sl[k].at + j] = y;
                    }
                    MT_FREE(tmp);
                }
            }
            if (experts) chunks *= ep;
            base = x->buf;
        } else {
            if (!(x->buf = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)(stored + 1)))) goto oom;
            ns++;
            if (mt__staged_read(rt, i, x->buf, err)) goto fail;
            base = x->buf;
            if ((v->shard && mt_mesh_group_size(&G->mesh, v->shard) > 1) || split) {
                if (!(x->whole = (mt_real *)MT_MALLOC(sizeof(mt_real) * (size_t)(len * tp + 1)))) goto oom;
                x->lo = v->shard ? (int64_t)mt_mesh_group(&G->mesh, v->shard, rt->bind.rank, NULL) * stored : 0;
                base = x->whole;
            }
            if (experts) first = mt__global_expert(rt, owner, 0);
        }
        for (int c = 0; c < chunks; c++) {
            if (mt__grow((void **)&t, &cap, n + 1, sizeof *t)) goto oom;
            mt__tensor *y = &t[n++];
            mt__expert_name(y->name, sizeof y->name, role == MT_ROLE_OPT ? v->name + strlen(prefix) : v->name, first + c);
            y->ndim = experts ? v->ndim - 1 : v->ndim;
            for (int d = 0; d < y->ndim; d++) y->shape[d] = v->dims[d + experts];
            if (split) y->shape[(split & MT_VF_TP_ROWS) ? 0 : 1] *= tp;   /* the whole weight */
            y->src = base + c * per;
            y->dst = base + c * per;
            y->numel = per * tp;
            y->bf16 = v->dtype == MT_BF16;
        }
    }
    *out = t; *n_out = n; *st_out = st; *n_st = ns;
    return 0;
oom:
    mt_errf(err, "out of memory staging a checkpoint");
fail:
    mt__staged_free(st, ns);
    MT_FREE(t);
    return -1;
}
static int mt__staged_commit(mt_runtime *rt, const mt__staged *st, int n, mt_err *err) {
    for (int i = 0; i < n; i++) {
        if (st[i].whole) {   /* this rank's flat range of (its tp part of) the whole tensor; 0 past its end */
            const mt_value *v = &rt->g.values[st[i].value];
            int64_t len = mt_value_numel_logical(&rt->g, v), stored = mt_value_numel_max(&rt->g, v);
            uint32_t split = mt__tp_split(&rt->g, v);
            int64_t tp = rt->g.mesh.size[MT_DIM_TP], at = rt->bind.coord[MT_DIM_TP], cols = v->ndim > 1 ? v->dims[1] : 1;
            for (int64_t k = 0; k < stored; k++)
                st[i].buf[k] = st[i].lo + k < len ? st[i].whole[mt__tp_element(split, st[i].lo + k, at, len, cols, tp)] : 0;
        }
        if (mt__staged_write(rt, st[i].value, st[i].buf, err)) return -1;
    }
    return 0;
}

static void mt__jfmt(mt__buf *b, const char *fmt, ...) {
    char t[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t, sizeof t, fmt, ap);
    va_end(ap);
    mt__put(b, t, strlen(t));
}

/* A checksum for large buffers: 8 bytes per step, each step a bijection of
 * the running value, so any single changed word (or byte) changes the sum. */
static uint64_t mt__hash_words(const void *p, size_t n, uint64_t h) {
    const uint8_t *b = (const uint8_t *)p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = mt__rotl((h ^ w) * 0x100000001b3ull, 29);
    }
    return mt_hash(b + i, n - i, h);
}

/* JSON string with the escapes a path may need. */
static void mt__jstr_esc(mt__buf *b, const char *s) {
    mt__put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') { char t[2] = {'\\', (char)ch}; mt__put(b, t, 2); }
        else if (ch < 0x20) { char t[8]; snprintf(t, sizeof t, "\\u%04x", ch); mt__put(b, t, 6); }
        else mt__put(b, s, 1);
    }
    mt__put(b, "\"", 1);
}
static void mt__jmeta(mt__buf *b, const char *key, const char *fmt, ...) {   /* ,"key":"value" */
    char t[1100];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t, sizeof t, fmt, ap);
    va_end(ap);
    mt__put(b, ",", 1); mt__jstr_esc(b, key); mt__put(b, ":", 1); mt__jstr_esc(b, t);
}

/* --- a small JSON reader, enough for safetensors headers --- */
typedef struct { const char *p, *begin, *end; int bad; } mt__js;
static void mt__jws(mt__js *j) { while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t')) j->p++; }
static int mt__jeat(mt__js *j, char c) {
    mt__jws(j);
    if (j->p < j->end && *j->p == c) { j->p++; return 1; }
    return 0;
}
static int mt__jhex4(const char *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}
/* A string into out (cap bytes with the NUL); out NULL: skip it. \uXXXX of
 * the Basic Multilingual Plane becomes UTF-8; anything malformed sets bad. */
static void mt__jstring(mt__js *j, char *out, size_t cap) {
    size_t n = 0;
    mt__jws(j);
    if (j->p >= j->end || *j->p != '"') { j->bad = 1; return; }
    j->p++;
    while (j->p < j->end && *j->p != '"') {
        char u[4];
        int k = 1;
        u[0] = *j->p++;
        if ((unsigned char)u[0] < 0x20) { j->bad = 1; return; }   /* raw control characters are not JSON */
        if (u[0] == '\\') {
            if (j->p >= j->end) { j->bad = 1; return; }
            char e = *j->p++;
            switch (e) {
            case '"': case '\\': case '/': u[0] = e; break;
            case 'n': u[0] = '\n'; break;
            case 't': u[0] = '\t'; break;
            case 'r': u[0] = '\r'; break;
            case 'b': u[0] = '\b'; break;
            case 'f': u[0] = '\f'; break;
            case 'u': {
                int cp = j->end - j->p >= 4 ? mt__jhex4(j->p) : -1;
                if (cp < 0 || (cp >= 0xd800 && cp <= 0xdfff)) { j->bad = 1; return; }
                j->p += 4;
                if (cp < 0x80) u[0] = (char)cp;
                else if (cp < 0x800) { u[0] = (char)(0xc0 | cp >> 6); u[1] = (char)(0x80 | (cp & 63)); k = 2; }
                else { u[0] = (char)(0xe0 | cp >> 12); u[1] = (char)(0x80 | ((cp >> 6) & 63)); u[2] = (char)(0x80 | (cp & 63)); k = 3; }
                break;
            }
            default: j->bad = 1; return;
            }
        }
        if (out) {
            if (n + (size_t)k >= cap) { j->bad = 1; return; }
            memcpy(out + n, u, (size_t)k);
        }
        n += (size_t)k;
    }
    if (j->p >= j->end) { j->bad = 1; return; }
    j->p++;
    if (out && cap) out[n] = 0;
}
static int64_t mt__jint(mt__js *j) {   /* a non-negative integer */
    mt__jws(j);
    int64_t v = 0; int digits = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        if (v > (INT64_MAX - 9) / 10) { j->bad = 1; return 0; }
        v = v * 10 + (*j->p++ - '0'); digits++;
    }
    if (!digits) j->bad = 1;
    return v;
}
static void mt__jskip(mt__js *j, int depth) {  /* skip any value */
    mt__jws(j);
    if (depth > 32 || j->p >= j->end) { j->bad = 1; return; }
    char ch = *j->p;
    if (ch == '"') { mt__jstring(j, NULL, 0); return; }
    if (ch == '{' || ch == '[') {
        char close = ch == '{' ? '}' : ']';
        j->p++;
        if (mt__jeat(j, close)) return;
        do {
            if (ch == '{') { mt__jstring(j, NULL, 0); if (!mt__jeat(j, ':')) { j->bad = 1; return; } }
            mt__jskip(j, depth + 1);
        } while (!j->bad && mt__jeat(j, ','));
        if (!mt__jeat(j, close)) j->bad = 1;
        return;
    }
    const char *start = j->p;   /* a number, true, false or null */
    while (j->p < j->end && ((*j->p >= '0' && *j->p <= '9') || (*j->p >= 'a' && *j->p <= 'z') || (*j->p >= 'A' && *j->p <= 'Z') ||
                             *j->p == '-' || *j->p == '+' || *j->p == '.')) j->p++;
    if (j->p == start) j->bad = 1;
}

/* --- safetensors: u64 header length | JSON header (8-byte padded) | data --- */
typedef struct { char name[256]; int dtype; int ndim; int64_t shape[8]; int64_t begin, end; int used; } mt__st_t;
typedef struct { char key[64]; char val[1040]; } mt__st_m;
typedef struct {
    uint8_t *file; size_t len;          /* what was read: the whole file, or its header only */
    int borrowed;                       /* file is not ours to free */
    uint64_t hl;                        /* JSON header length */
    const uint8_t *data; size_t data_len; /* data: NULL when only the header was read; data_len from the file size */
    mt__st_t *t; int n, cap;
    struct mt__st_name *by_name;        /* tensor names sorted, for lookups */
    mt__st_m *m; int nm, mcap;
    int ours;                           /* written by this moetrain: its checksums are required */
    uint64_t header_sum, data_sum;      /* as computed from the bytes */
} mt__st;
enum { MT__ST_F32 = 0, MT__ST_BF16 = 1, MT__ST_F16 = 2, MT__ST_F64 = 3 };
static const char *const mt__st_dtype_names[4] = {"F32", "BF16", "F16", "F64"};
static int64_t mt__st_esz(int dtype) { return dtype == MT__ST_F64 ? 8 : dtype == MT__ST_F32 ? 4 : 2; }

static void mt__st_free(mt__st *s) {
    if (!s->borrowed) MT_FREE(s->file);
    MT_FREE(s->t); MT_FREE(s->m); MT_FREE(s->by_name);
    memset(s, 0, sizeof *s);
}
static const char *mt__st_meta(const mt__st *s, const char *key) {
    for (int i = 0; i < s->nm; i++) if (!strcmp(s->m[i].key, key)) return s->m[i].val;
    return NULL;
}
typedef struct mt__st_name { const char *name; int idx; } mt__st_name;
static int mt__st_cmp_name(const void *a, const void *b) { return strcmp(((const mt__st_name *)a)->name, ((const mt__st_name *)b)->name); }
typedef struct { int64_t begin, end; int idx; } mt__st_range;
static int mt__st_cmp_range(const void *a, const void *b) {
    const mt__st_range *x = (const mt__st_range *)a, *y = (const mt__st_range *)b;
    return x->begin != y->begin ? (x->begin > y->begin) - (x->begin < y->begin) : (x->end > y->end) - (x->end < y->end);
}
static const mt__st_t *mt__st_find(const mt__st *s, const char *name) {
    mt__st_name key = {name, 0};
    const mt__st_name *hit = s->by_name ? (const mt__st_name *)bsearch(&key, s->by_name, (size_t)s->n, sizeof key, mt__st_cmp_name) : NULL;
    return hit ? &s->t[hit->idx] : NULL;
}

/* The header's checksum: metadata (but the two sums) and the tensor table,
 * as parsed, so that only meaning counts (not JSON spacing). */
static uint64_t mt__st_hsum(const mt__st *s) {
    uint64_t h = MT_HASH_INIT;
    for (int i = 0; i < s->nm; i++) {
        if (!strcmp(s->m[i].key, "mt.header_sum") || !strcmp(s->m[i].key, "mt.data_sum")) continue;
        h = mt_hash(s->m[i].key, strlen(s->m[i].key) + 1, h);
        h = mt_hash(s->m[i].val, strlen(s->m[i].val) + 1, h);
    }
    for (int i = 0; i < s->n; i++) {
        const mt__st_t *t = &s->t[i];
        int64_t f[11] = {t->dtype, t->ndim, t->begin, t->end};
        for (int d = 0; d < t->ndim && d < 7; d++) f[4 + d] = t->shape[d];
        h = mt_hash(t->name, strlen(t->name) + 1, h);
        h = mt_hash(f, sizeof f, h);
    }
    return h;
}

/* Parse and check s->file (s->len bytes: at least the header); data_len is
 * what the file holds after the header. Every tensor: a known dtype, a shape
 * whose size matches its byte range, ranges inside the data that tile it
 * exactly (no gaps, no overlaps, as the format requires), unique names. */
static int mt__st_parse(mt__st *s, const char *path, mt_err *err) {
    s->t = NULL; s->m = NULL; s->by_name = NULL; s->n = s->nm = s->cap = s->mcap = 0;
    mt__js j = {(const char *)s->file + 8, (const char *)s->file + 8, (const char *)s->file + 8 + s->hl, 0};
    const char *why = "malformed JSON";
    int seen_meta = 0;
    if (!mt__jeat(&j, '{')) j.bad = 1;
    if (!j.bad && !mt__jeat(&j, '}')) do {
        char key[256];
        mt__jstring(&j, key, sizeof key);
        if (j.bad || !mt__jeat(&j, ':')) { j.bad = 1; why = "bad or overlong name"; break; }
        if (!strcmp(key, "__metadata__")) {
            if (seen_meta++ || !mt__jeat(&j, '{')) { j.bad = 1; break; }
            if (!mt__jeat(&j, '}')) do {
                if (mt__grow((void **)&s->m, &s->mcap, s->nm + 1, sizeof *s->m)) { j.bad = 1; why = "out of memory"; break; }
                mt__st_m *m = &s->m[s->nm];
                mt__jstring(&j, m->key, sizeof m->key);
                if (j.bad || !mt__jeat(&j, ':')) { j.bad = 1; why = "bad metadata key"; break; }
                mt__jstring(&j, m->val, sizeof m->val);
                if (j.bad) { why = "metadata values must be strings of at most 1039 bytes"; break; }
                for (int k = 0; k < s->nm; k++) if (!strcmp(s->m[k].key, m->key)) { j.bad = 1; why = "duplicate metadata key"; }
                s->nm++;
            } while (!j.bad && mt__jeat(&j, ','));
            if (!j.bad && !mt__jeat(&j, '}')) j.bad = 1;
            continue;
        }
        if (!key[0]) { j.bad = 1; why = "empty tensor name"; break; }
        if (mt__grow((void **)&s->t, &s->cap, s->n + 1, sizeof *s->t)) { j.bad = 1; why = "out of memory"; break; }
        mt__st_t *t = &s->t[s->n++];
        memset(t, 0, sizeof *t);
        snprintf(t->name, sizeof t->name, "%s", key);
        t->dtype = -1; t->begin = t->end = -1;
        int got_shape = 0;
        if (!mt__jeat(&j, '{')) { j.bad = 1; break; }
        if (!mt__jeat(&j, '}')) do {
            char f[64];
            mt__jstring(&j, f, sizeof f);
            if (j.bad || !mt__jeat(&j, ':')) { j.bad = 1; break; }
            if (!strcmp(f, "dtype")) {
                char dt[16];
                mt__jstring(&j, dt, sizeof dt);
                t->dtype = -2;
                for (int k = 0; k < 4; k++) if (!j.bad && !strcmp(dt, mt__st_dtype_names[k])) t->dtype = k;
            } else if (!strcmp(f, "shape")) {
                got_shape = 1;
                if (!mt__jeat(&j, '[')) { j.bad = 1; break; }
                if (!mt__jeat(&j, ']')) {
                    do { if (t->ndim >= 7) { j.bad = 1; why = "too many dimensions"; break; } t->shape[t->ndim++] = mt__jint(&j); } while (!j.bad && mt__jeat(&j, ','));
                    if (!j.bad && !mt__jeat(&j, ']')) j.bad = 1;
                }
            } else if (!strcmp(f, "data_offsets")) {
                if (!mt__jeat(&j, '[')) { j.bad = 1; break; }
                t->begin = mt__jint(&j);
                if (!mt__jeat(&j, ',')) { j.bad = 1; break; }
                t->end = mt__jint(&j);
                if (!mt__jeat(&j, ']')) j.bad = 1;
            } else {
                mt__jskip(&j, 0);
            }
        } while (!j.bad && mt__jeat(&j, ','));
        if (!j.bad && !mt__jeat(&j, '}')) j.bad = 1;
        if (!j.bad && (!got_shape || t->begin < 0)) { j.bad = 1; why = "a tensor without shape or data_offsets"; }
    } while (!j.bad && mt__jeat(&j, ','));
    if (!j.bad && !mt__jeat(&j, '}')) j.bad = 1;
    mt__jws(&j);
    if (!j.bad && j.p != j.end) { j.bad = 1; why = "bytes after the JSON object"; }
    if (j.bad) return mt_errf(err, "'%s': malformed safetensors header (%s, near byte %lld)", path, why, (long long)(8 + (j.p - j.begin)));
    mt__st_range *r = (mt__st_range *)MT_MALLOC(sizeof *r * (size_t)(s->n + 1));
    s->by_name = (mt__st_name *)MT_MALLOC(sizeof *s->by_name * (size_t)(s->n + 1));
    if (!r || !s->by_name) { MT_FREE(r); return mt_errf(err, "out of memory reading '%s'", path); }
    for (int i = 0; i < s->n; i++) {
        mt__st_t *t = &s->t[i];
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] > ((int64_t)1 << 40) || (t->shape[d] && numel > ((int64_t)1 << 48) / t->shape[d])) { numel = -1; break; }
            numel *= t->shape[d];
        }
        if (t->dtype < 0) { MT_FREE(r); return mt_errf(err, "'%s': tensor '%s' has an unsupported dtype (F32, F64, BF16, F16 are read)", path, t->name); }
        if (numel < 0 || t->end < t->begin || t->end - t->begin != numel * mt__st_esz(t->dtype)) {   /* past the data: truncated, below */
            MT_FREE(r);
            return mt_errf(err, "'%s': tensor '%s': its shape needs %lld bytes, its data_offsets [%lld, %lld) of a %zu-byte data section disagree",
                           path, t->name, numel < 0 ? -1LL : (long long)(numel * mt__st_esz(t->dtype)), (long long)t->begin, (long long)t->end, s->data_len);
        }
        r[i].begin = t->begin; r[i].end = t->end; r[i].idx = i;
        s->by_name[i].name = t->name; s->by_name[i].idx = i;
    }
    qsort(r, (size_t)s->n, sizeof *r, mt__st_cmp_range);
    int64_t at = 0;
    for (int i = 0; i < s->n; i++) {
        if (r[i].begin != at) {
            const mt__st_t *t = &s->t[r[i].idx];
            MT_FREE(r);
            return mt_errf(err, "'%s': tensor '%s' starts at byte %lld of the data, where %lld was expected (overlapping or gapped tensors)",
                           path, t->name, (long long)t->begin, (long long)at);
        }
        at = r[i].end;
    }
    MT_FREE(r);
    if ((uint64_t)at > s->data_len)   /* the header is whole and consistent, the data short of it */
        return mt_errf(err, "'%s' is truncated: %llu bytes, its header says %llu (%llu of tensor data, the file holds %zu)", path,
                       (unsigned long long)(8 + s->hl + s->data_len), (unsigned long long)(8 + s->hl + (uint64_t)at), (unsigned long long)at, s->data_len);
    if ((uint64_t)at != s->data_len)
        return mt_errf(err, "'%s': the tensors cover %lld bytes but the data section has %zu (padded file)", path, (long long)at, s->data_len);
    qsort(s->by_name, (size_t)s->n, sizeof *s->by_name, mt__st_cmp_name);
    for (int i = 1; i < s->n; i++)
        if (!strcmp(s->by_name[i].name, s->by_name[i - 1].name)) return mt_errf(err, "'%s': tensor '%s' appears twice", path, s->by_name[i].name);
    /* this format's keys (any one of them): files of older moetrains and other tools have none and no checksums */
    static const char *const mine[] = {"mt.header_sum", "mt.data_sum", "mt.optimizer", "mt.rng", "mt.data_order", "mt.target", "mt.role"};
    for (size_t k = 0; k < sizeof mine / sizeof mine[0]; k++) s->ours |= mt__st_meta(s, mine[k]) != NULL;
    s->header_sum = mt__st_hsum(s);
    if (s->data) s->data_sum = mt__hash_words(s->data, s->data_len, MT_HASH_INIT);
    return 0;
}

/* A file of this moetrain must carry both checksums and match them; one of
 * another tool, or of an older moetrain, has none to check. */
static int mt__st_check_sums(const mt__st *s, const char *path, mt_err *err) {
    if (!s->ours) return 0;
    const char *hs = mt__st_meta(s, "mt.header_sum"), *ds = mt__st_meta(s, "mt.data_sum");
    char want[24];
    if (!hs || !ds) return mt_errf(err, "'%s': moetrain metadata without its checksums (damaged file)", path);
    snprintf(want, sizeof want, "%016llx", (unsigned long long)s->header_sum);
    if (strcmp(hs, want)) return mt_errf(err, "'%s': header checksum mismatch (corrupt file)", path);
    snprintf(want, sizeof want, "%016llx", (unsigned long long)s->data_sum);
    if (s->data && strcmp(ds, want)) return mt_errf(err, "'%s': data checksum mismatch (corrupt file)", path);
    return 0;
}

/* Open a safetensors file: all of it (full), or only its header (the data
 * section's length comes from the file size). Checksums are verified. */
static int mt__st_open(mt__st *s, const char *path, int full, mt_err *err) {
    memset(s, 0, sizeof *s);
    uint8_t head[8], first = 0;   /* first: the header's first byte, '{' in any safetensors file */
    size_t fsize;
    if (full) {
        if (mt_read_file(path, &s->file, &s->len, err)) return -1;
        fsize = s->len;
        if (fsize >= 8) memcpy(head, s->file, 8);
        if (fsize > 8) first = s->file[8];
    } else {
        int fd = open(path, O_RDONLY);
        if (fd < 0) return mt_errf(err, "cannot open '%s': %s", path, strerror(errno));
        struct stat st;
        if (fstat(fd, &st) || !S_ISREG(st.st_mode)) { close(fd); return mt_errf(err, "'%s' is not a regular file", path); }
        fsize = (size_t)st.st_size;
        if (fsize >= 8 && mt__read_fd(fd, head, 8)) { close(fd); return mt_errf(err, "short read on '%s'", path); }
        if (fsize > 8 && pread(fd, &first, 1, 8) != 1) first = 0;
        uint64_t hl = 0;
        for (int i = 0; fsize >= 8 && i < 8; i++) hl |= (uint64_t)head[i] << (8 * i);
        if (fsize >= 8 && hl <= fsize - 8 && hl <= 100000000) {
            s->len = 8 + (size_t)hl;
            s->file = (uint8_t *)MT_MALLOC(s->len);
            if (!s->file) { close(fd); return mt_errf(err, "out of memory reading '%s'", path); }
            memcpy(s->file, head, 8);
            if (mt__read_fd(fd, s->file + 8, (size_t)hl)) { close(fd); mt__st_free(s); return mt_errf(err, "short read on '%s'", path); }
        }
        close(fd);
    }
    if (fsize < 8) { mt__st_free(s); return mt_errf(err, "'%s' is not a safetensors file (%zu bytes)", path, fsize); }
    for (int i = 0; i < 8; i++) s->hl |= (uint64_t)head[i] << (8 * i);
    if (s->hl >= 2 && s->hl > fsize - 8 && s->hl <= 100000000 && first == '{') {   /* a header cut short */
        unsigned long long need = 8 + s->hl;
        mt__st_free(s);
        return mt_errf(err, "'%s' is truncated: %zu bytes, its header says at least %llu (the header alone)", path, fsize, need);
    }
    if (s->hl < 2 || s->hl > fsize - 8 || s->hl > 100000000) {
        mt__st_free(s);
        return mt_errf(err, "'%s': header length %llu does not fit a %zu-byte file (not safetensors, or truncated)", path, (unsigned long long)s->hl, fsize);
    }
    s->data_len = fsize - 8 - (size_t)s->hl;
    s->data = full ? s->file + 8 + s->hl : NULL;
    if (mt__st_parse(s, path, err) || mt__st_check_sums(s, path, err)) { mt__st_free(s); return -1; }
    return 0;
}

/* Build a safetensors file in memory: the tensors (mt_real, written as F32,
 * or F64 in float64 builds; BF16 where the tensor says so) and the metadata
 * members in meta (",\"k\":\"v\"..."), then its two checksums. *data_sum: the
 * data's checksum (names this file). */
static int mt__st_build(mt__buf *out, const mt__tensor *t, int n, const mt__buf *meta, uint64_t *data_sum, mt_err *err) {
    mt__buf h;
    memset(&h, 0, sizeof h);
    memset(out, 0, sizeof *out);
    int real_dt = sizeof(mt_real) == 8 ? MT__ST_F64 : MT__ST_F32;
    mt__jfmt(&h, "{\"__metadata__\":{\"format\":\"pt\"");
    if (meta->n) mt__put(&h, meta->p, meta->n);
    mt__jfmt(&h, ",\"mt.header_sum\":\"");
    size_t hs_at = h.n;
    mt__jfmt(&h, "%016llx\",\"mt.data_sum\":\"", 0ULL);
    size_t ds_at = h.n;
    mt__jfmt(&h, "%016llx\"}", 0ULL);
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        int dt = t[i].bf16 ? MT__ST_BF16 : real_dt;
        int64_t esz = mt__st_esz(dt);
        mt__put(&h, ",", 1); mt__jstr_esc(&h, t[i].name);
        mt__jfmt(&h, ":{\"dtype\":\"%s\",\"shape\":[", mt__st_dtype_names[dt]);
        for (int d = 0; d < t[i].ndim; d++) mt__jfmt(&h, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        mt__jfmt(&h, "],\"data_offsets\":[%lld,%lld]}", (long long)off, (long long)(off + esz * t[i].numel));
        off += esz * t[i].numel;
    }
    mt__put(&h, "}", 1);
    while ((h.n + 8) % 8) mt__put(&h, " ", 1);
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.n >> (8 * i));
    mt__put(out, len8, 8);
    if (!h.oom) mt__put(out, h.p, h.n);
    size_t data_at = out->n;
    /* the data, converted element by element into a buffer sized up front */
    if (!out->oom && !h.oom && out->cap < data_at + (size_t)off) {
        uint8_t *q = (uint8_t *)MT_REALLOC(out->p, data_at + (size_t)off + 1);
        if (!q) out->oom = 1; else { out->p = q; out->cap = data_at + (size_t)off + 1; }
    }
    if (h.oom || out->oom) { MT_FREE(h.p); MT_FREE(out->p); memset(out, 0, sizeof *out); return mt_errf(err, "out of memory building a checkpoint file"); }
    uint8_t *dst = out->p + data_at;
    for (int i = 0; i < n; i++)
        for (int64_t k = 0; k < t[i].numel; k++) {
            if (t[i].bf16) { uint16_t x = mt__bf16_from_real(t[i].src[k]); dst[0] = (uint8_t)x; dst[1] = (uint8_t)(x >> 8); dst += 2; }
            else if (real_dt == MT__ST_F64) { double x = (double)t[i].src[k]; memcpy(dst, &x, 8); dst += 8; }
            else { float x = (float)t[i].src[k]; memcpy(dst, &x, 4); dst += 4; }
        }
    out->n = data_at + (size_t)off;
    MT_FREE(h.p);
    /* the checksums: parse what was built, then write them into their places */
    mt__st s;
    memset(&s, 0, sizeof s);
    s.file = out->p; s.len = out->n; s.borrowed = 1;
    s.hl = (uint64_t)(data_at - 8);
    s.data = out->p + data_at; s.data_len = (size_t)off;
    if (mt__st_parse(&s, "(checkpoint being written)", err)) { mt__st_free(&s); MT_FREE(out->p); memset(out, 0, sizeof *out); return -1; }
    char hex[24];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)s.header_sum);
    memcpy(out->p + 8 + hs_at, hex, 16);
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)s.data_sum);
    memcpy(out->p + 8 + ds_at, hex, 16);
    *data_sum = s.data_sum;
    mt__st_free(&s);
    return 0;
}

static float mt__half_to_float(uint16_t h, int bf16) {
    if (bf16) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
    return (float)(s ? -v : v);
}

/* Copy every model tensor out of the file (any float dtype), checking names
 * and shapes; mark the file's tensors used. */
static int mt__load_tensors(mt__st *s, const char *path, mt__tensor *t, int n, mt_err *err) {
    for (int i = 0; i < n; i++) {
        mt__st_t *x = (mt__st_t *)mt__st_find(s, t[i].name);
        if (!x) return mt_errf(err, "'%s' has no tensor '%s'", path, t[i].name);
        int same = x->ndim == t[i].ndim;
        for (int d = 0; same && d < x->ndim; d++) same = x->shape[d] == t[i].shape[d];
        if (!same) {
            char a[96] = "", b[96] = "";
            for (int d = 0; d < x->ndim; d++) snprintf(a + strlen(a), sizeof a - strlen(a), "%s%lld", d ? "," : "", (long long)x->shape[d]);
            for (int d = 0; d < t[i].ndim; d++) snprintf(b + strlen(b), sizeof b - strlen(b), "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
            return mt_errf(err, "'%s': tensor '%s' has shape [%s], the model needs [%s]", path, t[i].name, a, b);
        }
        x->used = 1;
        const uint8_t *src = s->data + x->begin;
        for (int64_t j = 0; j < t[i].numel; j++) {
            if (x->dtype == MT__ST_F64) { double f; memcpy(&f, src + 8 * j, 8); t[i].dst[j] = (mt_real)f; continue; }
            float f;
            if (x->dtype == MT__ST_F32) memcpy(&f, src + 4 * j, 4);
            else f = mt__half_to_float((uint16_t)(src[2 * j] | src[2 * j + 1] << 8), x->dtype == MT__ST_BF16);
            t[i].dst[j] = (mt_real)f;
        }
    }
    return 0;
}
/* A moetrain file holds exactly the model's tensors: anything else is refused. */
static int mt__check_all_used(const mt__st *s, const char *path, mt_err *err) {
    for (int i = 0; s->ours && i < s->n; i++)
        if (!s->t[i].used) return mt_errf(err, "'%s': tensor '%s' is not part of this model", path, s->t[i].name);
    return 0;
}

/* A float as JSON that reads back as a float ("1.0", not "1"). */
static const char *mt__jf(double x, char *buf) {
    snprintf(buf, 32, "%.9g", x);
    if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
    return buf;
}

/* config.json for transformers' DeepseekV3ForCausalLM. Every key is explicit:
 * the library's defaults are those of the 671B model. */
static int mt__write_hf_config(const char *path, const mt_config *c, mt_err *err) {
    mt__buf b;
    memset(&b, 0, sizeof b);
    int yarn = mt_config_yarn(c);
    char rope[512], f1[32], f2[32], f3[32], f4[32], f5[32];
    if (yarn)
        snprintf(rope, sizeof rope, "{\"rope_type\": \"yarn\", \"rope_theta\": %s, \"factor\": %s, "
                 "\"original_max_position_embeddings\": %d, \"beta_fast\": %s, \"beta_slow\": %s, \"mscale\": %s, "
                 "\"mscale_all_dim\": %s, \"attention_factor\": 1.0}", mt__jf(c->rope_theta, f1), mt__jf(c->rope_factor, f2),
                 c->original_seq_len, mt__jf(c->beta_fast, f3), mt__jf(c->beta_slow, f4), mt__jf(c->mscale, f5), f5);
    else
        snprintf(rope, sizeof rope, "{\"rope_type\": \"default\", \"rope_theta\": %s}", mt__jf(c->rope_theta, f1));
    int max_pos = c->seq_len;
    if (yarn && (int)(c->original_seq_len * c->rope_factor + 0.5f) > max_pos) max_pos = (int)(c->original_seq_len * c->rope_factor + 0.5f);
    mt__jfmt(&b, "{\n  \"architectures\": [\"DeepseekV3ForCausalLM\"],\n  \"model_type\": \"deepseek_v3\",\n");
    mt__jfmt(&b, "  \"vocab_size\": %d,\n  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n  \"moe_intermediate_size\": %d,\n",
             c->vocab_size, c->dim, c->inter_dim, c->moe_inter_dim);
    mt__jfmt(&b, "  \"num_hidden_layers\": %d,\n  \"first_k_dense_replace\": %d,\n  \"moe_layer_freq\": 1,\n", c->n_layers, c->n_dense_layers);
    mt__jfmt(&b, "  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n", c->n_heads, c->n_heads);
    if (c->q_lora_rank > 0) mt__jfmt(&b, "  \"q_lora_rank\": %d,\n", c->q_lora_rank);
    else mt__jfmt(&b, "  \"q_lora_rank\": null,\n");
    mt__jfmt(&b, "  \"kv_lora_rank\": %d,\n  \"qk_nope_head_dim\": %d,\n  \"qk_rope_head_dim\": %d,\n  \"v_head_dim\": %d,\n",
             c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim);
    mt__jfmt(&b, "  \"n_routed_experts\": %d,\n  \"n_shared_experts\": %d,\n  \"num_experts_per_tok\": %d,\n",
             c->n_routed_experts, c->n_shared_experts, c->top_k);
    mt__jfmt(&b, "  \"n_group\": %d,\n  \"topk_group\": %d,\n  \"norm_topk_prob\": %s,\n  \"routed_scaling_factor\": %s,\n",
             c->n_expert_groups, c->n_limited_groups, c->route_norm ? "true" : "false", mt__jf(c->route_scale, f1));
    mt__jfmt(&b, "  \"scoring_func\": \"%s\",\n  \"topk_method\": \"noaux_tc\",\n  \"hidden_act\": \"silu\",\n",
             c->score_func == MT_SCORE_SIGMOID ? "sigmoid" : "softmax");
    mt__jfmt(&b, "  \"rms_norm_eps\": %s,\n  \"max_position_embeddings\": %d,\n  \"rope_theta\": %s,\n", mt__jf(c->norm_eps, f1),
             max_pos, mt__jf(c->rope_theta, f2));
    mt__jfmt(&b, "  \"rope_parameters\": %s,\n", rope);
    mt__jfmt(&b, "  \"rope_interleave\": true,\n  \"attention_bias\": false,\n  \"attention_dropout\": 0.0,\n");
    mt__jfmt(&b, "  \"tie_word_embeddings\": false,\n  \"num_nextn_predict_layers\": %d,\n  \"initializer_range\": 0.02,\n", c->mtp_layers);
    mt__jfmt(&b, "  \"use_cache\": false,\n  \"bos_token_id\": null,\n  \"eos_token_id\": null,\n  \"pad_token_id\": null,\n");
    mt__jfmt(&b, "  \"dtype\": \"float32\"\n}\n");
    if (b.oom) { MT_FREE(b.p); return mt_errf(err, "out of memory"); }
    int rc = mt__write_atomic(path, b.p, b.n, NULL, 0, err);
    MT_FREE(b.p);
    return rc;
}

void mt_run_state_init(mt_run_state *r) {
    memset(r, 0, sizeof *r);
    mt_hparams_default(&r->hp);
}

/* The run-state fields, as metadata "mt.run.<key>" (step is "mt.step"). */
enum { MT__RS_INT, MT__RS_U64, MT__RS_I64, MT__RS_FLOAT, MT__RS_STR };
static const struct { const char *key; int type; size_t off, cap; } mt__run_fields[] = {
    {"total_steps", MT__RS_INT, offsetof(mt_run_state, total_steps), 0},
    {"seed", MT__RS_U64, offsetof(mt_run_state, seed), 0},
    {"lr", MT__RS_FLOAT, offsetof(mt_run_state, hp.lr), 0},
    {"min_lr_ratio", MT__RS_FLOAT, offsetof(mt_run_state, hp.min_lr_ratio), 0},
    {"warmup_steps", MT__RS_INT, offsetof(mt_run_state, hp.warmup_steps), 0},
    {"decay_steps", MT__RS_INT, offsetof(mt_run_state, hp.decay_steps), 0},
    {"beta1", MT__RS_FLOAT, offsetof(mt_run_state, hp.beta1), 0},
    {"beta2", MT__RS_FLOAT, offsetof(mt_run_state, hp.beta2), 0},
    {"eps", MT__RS_FLOAT, offsetof(mt_run_state, hp.eps), 0},
    {"weight_decay", MT__RS_FLOAT, offsetof(mt_run_state, hp.weight_decay), 0},
    {"grad_clip", MT__RS_FLOAT, offsetof(mt_run_state, hp.grad_clip), 0},
    {"eager", MT__RS_INT, offsetof(mt_run_state, eager), 0},
    {"preset", MT__RS_STR, offsetof(mt_run_state, preset), sizeof(((mt_run_state *)0)->preset)},
    {"data", MT__RS_STR, offsetof(mt_run_state, data), sizeof(((mt_run_state *)0)->data)},
    {"data_tokens", MT__RS_I64, offsetof(mt_run_state, data_tokens), 0},
    {"data_hash", MT__RS_U64, offsetof(mt_run_state, data_hash), 0},
};
#define MT__N_RUN_FIELDS ((int)(sizeof mt__run_fields / sizeof mt__run_fields[0]))

/* model.safetensors' metadata: what the model is, where the run stands,
 * which optimizer file belongs to these weights. */
static void mt__meta_model(mt__buf *b, const mt_runtime *rt, int step, const mt_run_state *run, const char *opt_name, uint64_t opt_sum) {
    const mt_graph *G = &rt->g;
    mt__jmeta(b, "mt.version", "%s", MT_VERSION_STRING);
    mt__jmeta(b, "mt.step", "%d", step);
    for (int i = 0; i < mt_n_config_fields; i++) {
        const mt_field *f = &mt_config_fields[i];
        const void *p = (const char *)&G->cfg + f->offset;
        char key[64];
        snprintf(key, sizeof key, "mt.%s", f->name);
        if (f->type == MT_FIELD_INT) mt__jmeta(b, key, "%d", *(const int *)p);
        else mt__jmeta(b, key, "%.9g", (double)*(const float *)p);
    }
    mt__jmeta(b, "mt.target", "%s/%s/real%d", G->target.backend == MT_BACKEND_CUDA ? "cuda" : "cpu", G->target.arch, (int)G->target.real_bytes);
    mt__jmeta(b, "mt.mesh", "dp_replicate=%d dp_shard=%d tp=%d ep=%d", G->mesh.size[MT_DIM_DP_REPLICATE], G->mesh.size[MT_DIM_DP_SHARD],
              G->mesh.size[MT_DIM_TP], G->mesh.size[MT_DIM_EP]);
    mt__jmeta(b, "mt.data_order", "a pure function of (seed, step, dp_rank, dp_size): every rank's data position is mt.step");
    mt__jmeta(b, "mt.rng", "none: a step draws no random numbers");
    if (mt_graph_moe_chunks(G) > 1) mt__jmeta(b, "mt.moe_chunks", "%d", mt_graph_moe_chunks(G));   /* absent: 1 */
    if (run)   /* (has_settings is not written: it says whether these were read back) */
        for (int i = 0; i < MT__N_RUN_FIELDS; i++) {
            const char *p = (const char *)run + mt__run_fields[i].off;
            char key[64];
            snprintf(key, sizeof key, "mt.run.%s", mt__run_fields[i].key);
            switch (mt__run_fields[i].type) {
            case MT__RS_INT: mt__jmeta(b, key, "%d", *(const int32_t *)p); break;
            case MT__RS_U64: mt__jmeta(b, key, "%llu", (unsigned long long)*(const uint64_t *)p); break;
            case MT__RS_I64: mt__jmeta(b, key, "%lld", (long long)*(const int64_t *)p); break;
            case MT__RS_FLOAT: mt__jmeta(b, key, "%.9g", (double)*(const float *)p); break;
            default: mt__jmeta(b, key, "%.*s", (int)mt__run_fields[i].cap - 1, p); break;
            }
        }
    mt__jmeta(b, "mt.gemms", "%s", mt_fp8_mode_name(mt_graph_fp8_mode(G)));   /* the linear layers' GEMMs (mt_pass_fp8) */
    if (opt_name) {
        mt__jmeta(b, "mt.moments", "%s", mt__dtype_names[mt_graph_moments(G)]);
        mt__jmeta(b, "mt.optimizer", "%s", opt_name);
        mt__jmeta(b, "mt.optimizer_sum", "%016llx", (unsigned long long)opt_sum);
    }
}

/* mkdir -p */
static int mt__mkdirs(const char *dir, mt_err *err) {
    char p[4096];
    if (!dir[0] || snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) return mt_errf(err, "bad directory name '%s'", dir);
    for (char *q = p + 1; ; q++) {
        if (*q == '/' || !*q) {
            char c = *q;
            *q = 0;
            struct stat st;
            if (stat(p, &st)) {
                if (mkdir(p, 0755) && errno != EEXIST) return mt_errf(err, "cannot create directory '%s': %s", p, strerror(errno));
            } else if (!S_ISDIR(st.st_mode)) {
                return mt_errf(err, "cannot create directory '%s': '%s' is not a directory", dir, p);
            }
            *q = c;
            if (!c) break;
        }
    }
    return 0;
}

static void mt__ckpt_tidy(const char *dir, const char *keep, int at_start);
int mt_checkpoint_prepare_dir(const char *dir, mt_err *err) {
    if (mt__mkdirs(dir, err)) return -1;
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/.mt-probe-%ld.tmp", dir, (long)getpid());
    int fd = open(probe, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return mt_errf(err, "cannot write into '%s': %s", dir, strerror(errno));
    int bad = mt__write_fd(fd, "moetrain", 8) || fsync(fd);
    int e = errno;
    bad |= close(fd) != 0;
    remove(probe);
    if (bad) return mt_errf(err, "cannot write into '%s': %s", dir, strerror(e));
    mt__ckpt_tidy(dir, NULL, 1);
    return 0;
}

/* model.safetensors of a checkpoint (dir may also name the file itself), and
 * the directory the checkpoint's other files are in. */
static void mt__ckpt_paths(const char *dir, char *model, char *base, size_t n) {
    struct stat st;
    if (!stat(dir, &st) && S_ISREG(st.st_mode)) {
        snprintf(model, n, "%s", dir);
        snprintf(base, n, "%s", dir);
        char *slash = strrchr(base, '/');
        if (slash) *slash = 0; else snprintf(base, n, ".");
    } else {
        snprintf(model, n, "%s/model.safetensors", dir);
        snprintf(base, n, "%s", dir);
    }
}

/* Remove what a checkpoint directory holds that the committed checkpoint does
 * not use: older optimizer files and the .tmp files of interrupted saves (and
 * their write probes). at_start: before this run saves anything, only what
 * interrupted saves left, sharded saves' per-rank parts included (every
 * optimizer file stays: the directory may be the one being loaded). */
static void mt__ckpt_tidy(const char *dir, const char *keep, int at_start) {
    DIR *d = opendir(dir);
    if (!d) return;
    char (*names)[256] = NULL;
    int n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *nm = e->d_name;
        size_t len = strlen(nm);
        int opt = !at_start && !strncmp(nm, "optimizer", 9) && len > 12 && !strcmp(nm + len - 12, ".safetensors") && (!keep || strcmp(nm, keep));
        int tmp = len > 4 && !strcmp(nm + len - 4, ".tmp") &&
                  (!strncmp(nm, "optimizer", 9) || !strncmp(nm, "model.safetensors", 17) || !strncmp(nm, "config.json", 11) ||
                   !strncmp(nm, ".mt-probe-", 10));
        int part = at_start && !strncmp(nm, ".mt-part-", 9);
        if ((opt || tmp || part) && len < 256 && !mt__grow((void **)&names, &cap, n + 1, sizeof *names)) snprintf(names[n++], 256, "%s", nm);
    }
    closedir(d);
    for (int i = 0; i < n; i++) {
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        remove(p);
    }
    MT_FREE(names);
}

/* Stage one role's tensors, build the file, write it atomically. */
static int mt__save_file(mt_runtime *rt, const mt__parts *parts, const char *path, int role, const mt__buf *meta, uint64_t *sum, mt_err *err) {
    mt__tensor *t = NULL, *m = NULL, *v = NULL, *all = NULL;
    mt__staged *st = NULL, *sm = NULL, *sv = NULL;
    int n = 0, ns = 0, nm = 0, nv = 0, nsm = 0, nsv = 0, rc;
    if (role == MT_ROLE_PARAM) {
        rc = mt__tensors(rt, MT_ROLE_PARAM, "", parts, &t, &n, &st, &ns, err);
    } else {   /* optimizer state: exp_avg.<name>, exp_avg_sq.<name> */
        rc = mt__tensors(rt, MT_ROLE_OPT, "exp_avg.", parts, &m, &nm, &sm, &nsm, err) ||
             mt__tensors(rt, MT_ROLE_OPT, "exp_avg_sq.", parts, &v, &nv, &sv, &nsv, err);
        all = rc ? NULL : (mt__tensor *)MT_MALLOC(sizeof(mt__tensor) * (size_t)(nm + nv + 1));
        if (!rc && !all) rc = mt_errf(err, "out of memory");
        for (int i = 0; !rc && i < nm + nv; i++) {
            const mt__tensor *x = i < nm ? &m[i] : &v[i - nm];
            all[i] = *x;
            snprintf(all[i].name, sizeof all[i].name, "%s%.*s", i < nm ? "exp_avg." : "exp_avg_sq.", (int)sizeof all[i].name - 12, x->name);
        }
        t = all; n = nm + nv;
    }
    mt__buf file;
    memset(&file, 0, sizeof file);
    if (!rc) rc = mt__st_build(&file, t, n, meta, sum, err);
    if (!rc) rc = mt__write_atomic(path, file.p, file.n, NULL, 0, err);
    MT_FREE(file.p);
    if (role == MT_ROLE_PARAM) MT_FREE(t);
    MT_FREE(m); MT_FREE(v); MT_FREE(all);
    mt__staged_free(st, ns); mt__staged_free(sm, nsm); mt__staged_free(sv, nsv);
    return rc ? -1 : 0;
}

static int mt__checkpoint_save(mt_runtime *rt, const mt__parts *parts, const char *dir, int step, const mt_run_state *run, mt_err *err) {
    char mpath[4096], opath[4400], base[4096], oname[64], cur[1040] = "";
    if (mt__mkdirs(dir, err)) return -1;
    mt__ckpt_paths(dir, mpath, base, sizeof mpath);
    struct stat sb;
    if (!stat(dir, &sb) && !S_ISDIR(sb.st_mode)) return mt_errf(err, "'%s' is not a directory", dir);
    /* the optimizer file the committed checkpoint uses: ours goes elsewhere */
    mt__st old;
    mt_err ignore;
    if (!mt__st_open(&old, mpath, 0, &ignore)) {
        const char *o = mt__st_meta(&old, "mt.optimizer");
        snprintf(cur, sizeof cur, "%s", o ? o : "");
        mt__st_free(&old);
    }
    snprintf(oname, sizeof oname, "optimizer-step%d.safetensors", step);
    if (!strcmp(oname, cur)) snprintf(oname, sizeof oname, "optimizer-step%db.safetensors", step);
    snprintf(opath, sizeof opath, "%s/%s", base, oname);
    int train = rt->g.kind == MT_GRAPH_TRAIN;
    uint64_t osum = 0, msum = 0;
    mt__buf meta;
    memset(&meta, 0, sizeof meta);
    if (train) {   /* 1. the moments, under a new name */
        mt__jmeta(&meta, "mt.version", "%s", MT_VERSION_STRING);
        mt__jmeta(&meta, "mt.step", "%d", step);
        mt__jmeta(&meta, "mt.role", "AdamW moments of the weights in model.safetensors");
        int rc = meta.oom ? mt_errf(err, "out of memory") : mt__save_file(rt, parts, opath, MT_ROLE_OPT, &meta, &osum, err);
        MT_FREE(meta.p);
        memset(&meta, 0, sizeof meta);
        if (rc) return -1;
    }
    char cpath[4200];   /* 2. transformers' config */
    snprintf(cpath, sizeof cpath, "%s/config.json", base);
    if (mt__write_hf_config(cpath, &rt->g.cfg, err)) return -1;
    mt__meta_model(&meta, rt, step, run, train ? oname : NULL, osum);   /* 3. the weights: the commit */
    int rc = meta.oom ? mt_errf(err, "out of memory") : mt__save_file(rt, parts, mpath, MT_ROLE_PARAM, &meta, &msum, err);
    MT_FREE(meta.p);
    if (rc) return -1;
    mt__ckpt_tidy(base, train ? oname : NULL, 0);
    return 0;
}

/* A sharded run (world > 1) saves collectively, every rank calling: each
 * writes the bytes it stores (f32 masters, f32 or bf16 moments, in graph order) to
 * DIR/.mt-part-R; after a barrier rank 0 assembles every tensor whole (FSDP
 * shards in their flat ranges, experts by global index) and writes the files
 * one rank would, so any mesh can load them; after a second barrier the parts
 * are removed. The parts travel through DIR: across hosts it must be shared. */
#define MT__PART_HEADER 48   /* "moetrain-part1", graph fingerprint u64 @16, step, rank, world i32 @24..35 */
static void mt__part_path(char *out, size_t n, const char *dir, int rank, int world) {
    snprintf(out, n, "%s/.mt-part-%d-of-%d", dir, rank, world);
}
static int mt__part_value(const mt_value *v) { return (v->role == MT_ROLE_PARAM && v->param < 0) || v->role == MT_ROLE_OPT; }
static int mt__part_write(mt_runtime *rt, const char *path, int step, mt_err *err) {
    const mt_graph *G = &rt->g;
    uint8_t h[MT__PART_HEADER] = "moetrain-part1";
    uint64_t fp = mt_fingerprint(G);
    int32_t w[3] = {step, rt->bind.rank, rt->bind.world};
    memcpy(h + 16, &fp, 8); memcpy(h + 24, w, sizeof w);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return mt_errf(err, "cannot write '%s': %s", path, strerror(errno));
    int rc = mt__write_fd(fd, h, sizeof h) ? mt_errf(err, "writing '%s': %s", path, strerror(errno)) : 0;
    void *buf = NULL;
    for (int i = 0; i < G->n_values && !rc; i++) {
        const mt_value *v = &G->values[i];
        if (!mt__part_value(v)) continue;
        if (v->nbytes != (v->dtype == MT_BF16 ? 2 : (int64_t)sizeof(mt_real)) * mt_value_numel_max(G, v)) {
            rc = mt_errf(err, "'%s' is not stored as reals (or bf16 moments)", v->name);
            break;
        }
        void *nb = MT_REALLOC(buf, (size_t)v->nbytes + 1);
        if (!nb) { rc = mt_errf(err, "out of memory writing '%s'", path); break; }
        buf = nb;
        if (mt_runtime_read(rt, i, buf, err)) rc = -1;
        else if (mt__write_fd(fd, buf, (size_t)v->nbytes)) rc = mt_errf(err, "writing '%s': %s", path, strerror(errno));
    }
    MT_FREE(buf);
    if (close(fd) && !rc) rc = mt_errf(err, "writing '%s': %s", path, strerror(errno));
    return rc;
}
/* Rank 0: open every rank's part, check it is this graph's at this step, and save from them. */
static int mt__checkpoint_save_parts(mt_runtime *rt, const char *dir, int step, const mt_run_state *run, mt_err *err) {
    const mt_graph *G = &rt->g;
    int world = rt->bind.world, rc = 0;
    int *fd = (int *)MT_MALLOC(sizeof(int) * (size_t)world);
    int64_t *off = (int64_t *)MT_MALLOC(sizeof(int64_t) * (size_t)(G->n_values + 1));
    mt__part_slot *slot = (mt__part_slot *)MT_MALLOC(sizeof(mt__part_slot) * (size_t)world);
    if (!fd || !off || !slot) { MT_FREE(fd); MT_FREE(off); MT_FREE(slot); return mt_errf(err, "out of memory"); }
    int64_t at = MT__PART_HEADER;
    for (int i = 0; i < G->n_values; i++) {
        off[i] = at;
        if (mt__part_value(&G->values[i])) at += G->values[i].nbytes;
    }
    uint64_t fp = mt_fingerprint(G);
    for (int r = 0; r < world; r++) fd[r] = -1;
    for (int r = 0; r < world && !rc; r++) {
        char path[4400];
        mt__part_path(path, sizeof path, dir, r, world);
        uint8_t h[MT__PART_HEADER];
        struct stat sb;
        fd[r] = open(path, O_RDONLY);
        if (fd[r] < 0) { rc = mt_errf(err, "cannot read rank %d's part '%s': %s", r, path, strerror(errno)); break; }
        int32_t w[3] = {-1, -1, -1};
        uint64_t f = 0;
        memset(h, 0, sizeof h);
        if (pread(fd[r], h, sizeof h, 0) == (ssize_t)sizeof h) { memcpy(&f, h + 16, 8); memcpy(w, h + 24, sizeof w); }
        if (memcmp(h, "moetrain-part1", 14) || f != fp || w[0] != step || w[1] != r || w[2] != world || fstat(fd[r], &sb) || sb.st_size != at)
            rc = mt_errf(err, "'%s' is not rank %d's part of this checkpoint (another graph, step or run)", path, r);
    }
    mt__parts parts = {world, fd, off, slot};
    if (!rc) rc = mt__checkpoint_save(rt, &parts, dir, step, run, err);
    for (int r = 0; r < world; r++) if (fd[r] >= 0) close(fd[r]);
    MT_FREE(fd); MT_FREE(off); MT_FREE(slot);
    return rc;
}
static int mt__checkpoint_save_any(mt_runtime *rt, const char *dir, int step, const mt_run_state *run, mt_err *err) {
    if (rt->bind.world <= 1) return mt__checkpoint_save(rt, NULL, dir, step, run, err);
    char part[4400];
    mt_err mine, comm;
    mine.msg[0] = 0;
    mt__part_path(part, sizeof part, dir, rt->bind.rank, rt->bind.world);
    int rc = mt__mkdirs(dir, &mine) || mt__part_write(rt, part, step, &mine) ? -1 : 0;
    double bad = rc != 0;   /* barrier: every part written (or someone failed) */
    if (mt_runtime_allreduce_host(rt, &bad, 1, 1, &comm)) { remove(part); return mt_errf(err, "saving: %s", comm.msg); }
    if (!rc && bad) rc = mt_errf(&mine, "another rank could not write its part of the checkpoint");
    if (!rc && rt->bind.rank == 0) rc = mt__checkpoint_save_parts(rt, dir, step, run, &mine);
    bad = rc != 0;          /* barrier: rank 0 is done with the parts */
    if (mt_runtime_allreduce_host(rt, &bad, 1, 1, &comm)) { remove(part); return mt_errf(err, "saving: %s", comm.msg); }
    if (!rc && bad) rc = mt_errf(&mine, "rank 0 could not write the checkpoint (its message says why)");
    remove(part);
    return rc ? mt_errf(err, "%s", mine.msg) : 0;
}
int mt_checkpoint_save(mt_runtime *rt, const char *dir, int step, mt_err *err) { return mt__checkpoint_save_any(rt, dir, step, NULL, err); }
int mt_checkpoint_save_run(mt_runtime *rt, const char *dir, const mt_run_state *run, mt_err *err) {
    return mt__checkpoint_save_any(rt, dir, run->step, run, err);
}

/* The config in a moetrain file's metadata. */
static int mt__st_config(const mt__st *s, const char *path, mt_config *c, mt_err *err) {
    mt__config_common(c);
    for (int i = 0; i < mt_n_config_fields; i++) {
        const mt_field *f = &mt_config_fields[i];
        char key[64];
        snprintf(key, sizeof key, "mt.%s", f->name);
        const char *val = mt__st_meta(s, key);
        if (!val && (!strcmp(f->name, "doc_mask") || !strcmp(f->name, "eot_id") || !strcmp(f->name, "mtp_layers") ||
                     !strcmp(f->name, "mtp_weight"))) continue;  /* newer fields: defaults */
        if (!val) return mt_errf(err, "'%s' has no '%s' metadata: not written by moetrain, so the model's config is unknown", path, key);
        mt_err e;
        if (!strcmp(f->name, "score_func")) {
            long long v;
            if (mt__parse_int(val, 0, 1, &v)) return mt_errf(err, "'%s': bad %s", path, key);
            c->score_func = (int)v;
        } else if (mt_config_set(c, f->name, val, &e)) {
            return mt_errf(err, "'%s': %s", path, e.msg);
        }
    }
    mt_err e;
    if (mt_config_validate(c, &e)) return mt_errf(err, "'%s': %s", path, e.msg);
    return 0;
}

int mt_checkpoint_read_config(const char *dir, mt_config *c, mt_err *err) {
    char path[4096], base[4096];
    mt__ckpt_paths(dir, path, base, sizeof path);
    mt__st s;
    if (mt__st_open(&s, path, 0, err)) return -1;
    int rc = mt__st_config(&s, path, c, err);
    mt__st_free(&s);
    return rc;
}

int mt_checkpoint_read_run(const char *dir, mt_run_state *run, mt_err *err) {
    char path[4096], base[4096];
    mt__ckpt_paths(dir, path, base, sizeof path);
    mt__st s;
    if (mt__st_open(&s, path, 0, err)) return -1;
    mt_run_state_init(run);
    long long v;
    const char *sv = mt__st_meta(&s, "mt.step");
    int rc = 0;
    if (!sv || mt__parse_int(sv, 0, INT_MAX, &v)) rc = mt_errf(err, "'%s' records no step", path);
    else run->step = (int32_t)v;
    run->has_settings = !rc && mt__st_meta(&s, "mt.run.seed") != NULL;
    const char *mo = mt__st_meta(&s, "mt.moments");   /* absent: saved before bf16 moments existed, so f32 */
    if (!rc && mo && strcmp(mo, "f32") && strcmp(mo, "bf16")) rc = mt_errf(err, "'%s': bad mt.moments '%s'", path, mo);
    run->moments = mo && !strcmp(mo, "bf16") ? MT_BF16 : MT_F32;
    const char *gm = mt__st_meta(&s, "mt.gemms");    /* absent: saved before FP8 existed, so bf16 */
    int fm = MT_FP8_OFF;
    while (gm && fm <= MT_FP8_NO_WGRAD && strcmp(gm, mt_fp8_mode_name(fm))) fm++;
    if (!rc && gm && fm > MT_FP8_NO_WGRAD) rc = mt_errf(err, "'%s': bad mt.gemms '%s'", path, gm);
    run->fp8 = gm && fm <= MT_FP8_NO_WGRAD ? fm : MT_FP8_OFF;
    const char *mc = mt__st_meta(&s, "mt.moe_chunks");   /* absent: 1 */
    long long chunks = 1;
    if (!rc && mc && mt__parse_int(mc, 1, MT_MOE_CHUNKS_MAX, &chunks)) rc = mt_errf(err, "'%s': bad mt.moe_chunks '%s'", path, mc);
    run->moe_chunks = (int32_t)chunks;
    for (int i = 0; !rc && run->has_settings && i < MT__N_RUN_FIELDS; i++) {
        char key[64];
        snprintf(key, sizeof key, "mt.run.%s", mt__run_fields[i].key);
        const char *val = mt__st_meta(&s, key);
        char *p = (char *)run + mt__run_fields[i].off;
        if (!val) { rc = mt_errf(err, "'%s': run state without '%s'", path, key); break; }
        double d;
        int bad = 0;
        switch (mt__run_fields[i].type) {
        case MT__RS_INT: bad = mt__parse_int(val, INT_MIN, INT_MAX, &v); if (!bad) *(int32_t *)p = (int32_t)v; break;
        case MT__RS_I64: bad = mt__parse_int(val, 0, LLONG_MAX, &v); if (!bad) *(int64_t *)p = (int64_t)v; break;
        case MT__RS_U64: {
            char *end; errno = 0;
            unsigned long long u = strtoull(val, &end, 10);
            bad = errno || end == val || *end || val[0] == '-';
            if (!bad) *(uint64_t *)p = (uint64_t)u;
            break;
        }
        case MT__RS_FLOAT: bad = mt__parse_float(val, &d); if (!bad) *(float *)p = (float)d; break;
        default: bad = strlen(val) >= mt__run_fields[i].cap; if (!bad) memcpy(p, val, strlen(val) + 1); break;
        }
        if (bad) rc = mt_errf(err, "'%s': bad %s '%s'", path, key, val);
    }
    mt__st_free(&s);
    return rc;
}

/* Load weights (and AdamW moments when the graph trains). Everything is
 * checked first: checksums, every tensor's name, dtype, shape and byte range,
 * the config, the pairing of weights and optimizer file. Nothing in the
 * runtime changes unless all of it holds. */
int mt_checkpoint_load(mt_runtime *rt, const char *dir, int *step, mt_err *err) {
    char path[4096], base[4096], opath[5200];
    mt__ckpt_paths(dir, path, base, sizeof path);
    mt__st s, so;
    memset(&so, 0, sizeof so);
    if (mt__st_open(&s, path, 1, err)) return -1;
    int rc = 0, with_opt = 0;
    if (mt__st_meta(&s, "mt.dim")) {   /* the config it was saved for must be this model's (any batch, seq_len and mtp_weight: they shape
                                        * the step or weigh its loss, not the weights) */
        mt_config c;
        char diff[900];
        if (mt__st_config(&s, path, &c, err)) rc = -1;
        else {
            c.batch = rt->g.cfg.batch; c.seq_len = rt->g.cfg.seq_len; c.mtp_weight = rt->g.cfg.mtp_weight;
            if (mt_config_diff(&c, &rt->g.cfg, diff, sizeof diff))
                rc = mt_errf(err, "'%s' was saved for another model config (checkpoint vs this model): %s", path, diff);
        }
    }
    if (!rc && rt->g.kind == MT_GRAPH_TRAIN) {
        const char *oname = mt__st_meta(&s, "mt.optimizer");
        struct stat sb;
        if (oname) {
            if (!oname[0] || strchr(oname, '/') || !strcmp(oname, "..")) rc = mt_errf(err, "'%s': bad optimizer file name '%s'", path, oname);
            snprintf(opath, sizeof opath, "%s/%s", base, oname);
            with_opt = !rc;
        } else {   /* written before optimizer files were named: the fixed name, if there */
            snprintf(opath, sizeof opath, "%s/optimizer.safetensors", base);
            with_opt = strcmp(path, opath) && !stat(opath, &sb);
        }
        if (with_opt && mt__st_open(&so, opath, 1, err)) rc = -1;
        if (!rc && with_opt && oname) {
            char want[24];
            snprintf(want, sizeof want, "%016llx", (unsigned long long)so.data_sum);
            const char *osum = mt__st_meta(&s, "mt.optimizer_sum");
            if (!osum || strcmp(osum, want)) rc = mt_errf(err, "'%s' does not belong to the weights in '%s' (checksum differs)", opath, path);
        }
    }
    mt__tensor *t = NULL, *m = NULL, *v = NULL;
    mt__staged *st = NULL, *sm = NULL, *sv = NULL;
    int n = 0, nm = 0, nv = 0, ns = 0, nsm = 0, nsv = 0;
    int every = rt->g.mesh.size[MT_DIM_EP] == 1;   /* with expert parallelism a rank reads only its experts */
    if (!rc) rc = mt__tensors(rt, MT_ROLE_PARAM, "", NULL, &t, &n, &st, &ns, err);
    if (!rc) rc = mt__load_tensors(&s, path, t, n, err) || (every && mt__check_all_used(&s, path, err));
    if (!rc && with_opt) {
        rc = mt__tensors(rt, MT_ROLE_OPT, "exp_avg.", NULL, &m, &nm, &sm, &nsm, err) ||
             mt__tensors(rt, MT_ROLE_OPT, "exp_avg_sq.", NULL, &v, &nv, &sv, &nsv, err);
        for (int i = 0; !rc && i < nm; i++) { char x[MT_NAME_LEN + 16]; snprintf(x, sizeof x, "exp_avg.%.*s", (int)sizeof x - 9, m[i].name); memcpy(m[i].name, x, sizeof m[i].name); }
        for (int i = 0; !rc && i < nv; i++) { char x[MT_NAME_LEN + 16]; snprintf(x, sizeof x, "exp_avg_sq.%.*s", (int)sizeof x - 12, v[i].name); memcpy(v[i].name, x, sizeof v[i].name); }
        if (!rc) rc = mt__load_tensors(&so, opath, m, nm, err) || mt__load_tensors(&so, opath, v, nv, err) || (every && mt__check_all_used(&so, opath, err));
    }
    long long stepv = 0;
    const char *sv_ = mt__st_meta(&s, "mt.step");
    if (!rc && sv_ && mt__parse_int(sv_, 0, INT_MAX, &stepv)) rc = mt_errf(err, "'%s': bad mt.step '%s'", path, sv_);
    if (!rc) rc = mt__staged_commit(rt, st, ns, err) || mt__staged_commit(rt, sm, nsm, err) || mt__staged_commit(rt, sv, nsv, err) ||
                  mt_runtime_sync_shadows(rt, err);
    if (!rc && step) *step = (int)stepv;
    mt__st_free(&s); mt__st_free(&so);
    MT_FREE(t); MT_FREE(m); MT_FREE(v);
    mt__staged_free(st, ns); mt__staged_free(sm, nsm); mt__staged_free(sv, nsv);
    return rc ? -1 : 0;
}

/* ========================================================================
 * 12. Data
 * ====================================================================== */

void mt_data_free(mt_dataset *d) { MT_FREE(d->tokens); memset(d, 0, sizeof *d); }
uint64_t mt_data_hash(const mt_dataset *d) {
    uint64_t h = mt_hash(&d->n, sizeof d->n, MT_HASH_INIT);
    return d->n > 0 ? mt__hash_words(d->tokens, sizeof(int32_t) * (size_t)d->n, h) : h;
}

/* llm.c / nanoGPT shards: 256 int32 header (magic 20240520, version 1,
 * count) then uint16 tokens; llm.c's Llama-3 shards use magic 20240801,
 * version 7, uint32 tokens. */
#define MT__SHARD_HEADER 1024
int mt_data_format_parse(const char *name, int *format) {
    static const char *const names[] = {"auto", "bin", "raw"};
    for (int i = 0; i < 3; i++)
        if (!strcmp(name, names[i])) { *format = i; return 0; }
    return -1;
}

/* Why a file that is not exactly a shard still looks like one (NULL: it does
 * not), for MT_DATA_AUTO: read as bytes it would train on the header's and
 * the tokens' bytes without a word. */
static const char *mt__data_near_miss(const char *path, const uint8_t *b, size_t n, char *why, size_t cap) {
    static const int32_t magic[2] = {20240520, 20240801}, version[2] = {1, 7};
    int32_t h[3] = {0, 0, 0};
    memcpy(h, b, n < sizeof h ? n : sizeof h);
    size_t len = strlen(path);
    for (int k = 0; k < 2; k++) {
        if (n >= 4 && h[0] == magic[k] && n < MT__SHARD_HEADER)
            return snprintf(why, cap, "it starts with a token shard's magic %d but is %zu bytes, shorter than the %d-byte header", magic[k], n,
                            MT__SHARD_HEADER), why;
        if (n >= 8 && h[0] == magic[k] && h[1] != version[k])
            return snprintf(why, cap, "magic %d with version %d (a shard of that magic is version %d)", magic[k], h[1], version[k]), why;
        int bytes_off = 0;
        for (int i = 0; i < 4; i++) bytes_off += ((h[0] ^ magic[k]) >> (8 * i) & 0xff) != 0;
        if (n >= 4 && h[0] != magic[k] && ((h[0] > magic[k] - 100000 && h[0] < magic[k] + 100000) || bytes_off == 1))
            return snprintf(why, cap, "its first number %d is close to a token shard's magic %d", h[0], magic[k]), why;
    }
    if (n > MT__SHARD_HEADER && h[2] > 0 && (n - MT__SHARD_HEADER == 2 * (size_t)h[2] || n - MT__SHARD_HEADER == 4 * (size_t)h[2]))
        return snprintf(why, cap, "a shard's header layout: its third number %d counts the %zu bytes after a %d-byte header as tokens", h[2],
                        n - MT__SHARD_HEADER, MT__SHARD_HEADER), why;
    if (len >= 4 && (!strcmp(path + len - 4, ".bin") || !strcmp(path + len - 4, ".BIN")))
        return snprintf(why, cap, "its name ends in .bin but it starts with %d, not a token shard's magic 20240520 or 20240801", h[0]), why;
    return NULL;
}

int mt_data_load_as(mt_dataset *d, const char *path, int format, mt_err *err) {
    memset(d, 0, sizeof *d);
    if (format != MT_DATA_AUTO && format != MT_DATA_BIN && format != MT_DATA_RAW) return mt_errf(err, "unknown data format %d", format);
    uint8_t *b; size_t n;
    if (mt_read_file(path, &b, &n, err)) return -1;
    int32_t hdr[3] = {0, 0, 0};
    if (n >= MT__SHARD_HEADER) memcpy(hdr, b, sizeof hdr);
    int width = 0;
    if (format != MT_DATA_RAW) {   /* a shard only when its magic and version are exactly right */
        if (n >= MT__SHARD_HEADER && hdr[0] == 20240520 && hdr[1] == 1) width = 2;
        else if (n >= MT__SHARD_HEADER && hdr[0] == 20240801 && hdr[1] == 7) width = 4;
        char why[300];
        if (!width && format == MT_DATA_BIN) {
            int32_t h0 = 0, h1 = 0;
            if (n >= 4) memcpy(&h0, b, 4);
            if (n >= 8) memcpy(&h1, b + 4, 4);
            MT_FREE(b);
            return mt_errf(err, "'%s' is not an llm.c/nanoGPT token shard: it starts with %d, %d (a shard: 20240520, 1 or 20240801, 7, "
                                "then a %d-byte header)%s", path, h0, h1, MT__SHARD_HEADER, n < MT__SHARD_HEADER ? " and is shorter than the header" : "");
        }
        if (!width && mt__data_near_miss(path, b, n, why, sizeof why)) {
            MT_FREE(b);
            return mt_errf(err, "'%s' looks like an llm.c/nanoGPT token shard but is not one (%s): refusing to read it as raw bytes; "
                                "if it is raw bytes, say so (train: --data-format raw)", path, why);
        }
    }
    if (width) {
        size_t body = n - MT__SHARD_HEADER;
        if (hdr[2] >= 0 && body < (size_t)hdr[2] * (size_t)width) {
            MT_FREE(b);
            return mt_errf(err, "'%s' is truncated: %zu bytes, its header says %lld (%d tokens of %d bytes after the %d-byte header)", path, n,
                           (long long)MT__SHARD_HEADER + (long long)hdr[2] * width, hdr[2], width, MT__SHARD_HEADER);
        }
        if (hdr[2] < 0 || body != (size_t)hdr[2] * (size_t)width) {
            MT_FREE(b);
            return mt_errf(err, "'%s': header says %d tokens but the file holds %zu bytes of tokens", path, hdr[2], body);
        }
        d->n = hdr[2];
    } else {
        d->n = (int64_t)n;
    }
    d->format = width ? MT_DATA_BIN : MT_DATA_RAW;
    d->token_bytes = width ? width : 1;
    d->tokens = (int32_t *)MT_MALLOC(sizeof(int32_t) * (size_t)(d->n + 1));
    if (!d->tokens) { MT_FREE(b); return mt_errf(err, "out of memory loading '%s'", path); }
    for (int64_t i = 0; i < d->n; i++) {
        uint32_t t;
        if (width == 2) t = (uint32_t)(b[1024 + 2 * i] | b[1024 + 2 * i + 1] << 8);
        else if (width == 4) { memcpy(&t, b + 1024 + 4 * i, 4); }
        else t = b[i];
        if (t > INT32_MAX) { MT_FREE(b); mt_data_free(d); return mt_errf(err, "'%s': token %u out of range", path, t); }
        d->tokens[i] = (int32_t)t;
        if ((int)t > d->max_token) d->max_token = (int)t;
    }
    MT_FREE(b);
    if (d->n < 2) { mt_data_free(d); return mt_errf(err, "'%s' holds fewer than 2 tokens", path); }
    return 0;
}
int mt_data_load(mt_dataset *d, const char *path, mt_err *err) { return mt_data_load_as(d, path, MT_DATA_AUTO, err); }

const char *mt_data_describe(const mt_dataset *d, const char *path, char *buf, size_t cap) {
    char num[32], *q = num + sizeof num - 1;   /* the token count with thousands separators */
    uint64_t v = d->n > 0 ? (uint64_t)d->n : 0;
    *q = 0;
    for (int k = 0; k == 0 || v; k++, v /= 10) {
        if (k && k % 3 == 0) *--q = ',';
        *--q = (char)('0' + v % 10);
    }
    if (d->format == MT_DATA_EMBEDDED) snprintf(buf, cap, "embedded default corpus (%s tokens)", q);
    else if (d->format == MT_DATA_BIN) snprintf(buf, cap, "%s (llm.c token shard, uint%d, %s tokens)", path, 8 * d->token_bytes, q);
    else snprintf(buf, cap, "%s (raw bytes, %s tokens)", path, q);
    return buf;
}

/* The embedded default corpus: short stories from a small grammar, as bytes.
 * It has structure at every scale (spelling, agreement, story templates and
 * simple arithmetic), so a small model learns it well below the 5.545-nat
 * uniform line within a minute on two cores. Fixed seed: always the same. */
int mt_data_default(mt_dataset *d, mt_err *err) {
    static const char *const names[] = {"Mia", "Tom", "Lily", "Ben", "Anna", "Max", "Zoe", "Sam", "Ella", "Leo"};
    static const char *const animals[] = {"cat", "dog", "bird", "fox", "frog", "duck", "bear", "fish"};
    static const char *const adjs[] = {"little", "big", "happy", "sleepy", "red", "funny", "brave", "tiny"};
    static const char *const places[] = {"the park", "the garden", "the forest", "the river", "the hill", "the beach"};
    static const char *const verbs[] = {"play", "run", "jump", "sing", "swim", "dance"};
    static const char *const objects[] = {"ball", "kite", "box", "hat", "cake", "book", "boat", "drum"};
    static const char *const colors[] = {"blue", "green", "yellow", "pink", "orange", "purple"};
#define MT__PICK(arr) arr[mt_rng_u64(&r) % (sizeof arr / sizeof arr[0])]
    mt__buf b;
    memset(&b, 0, sizeof b);
    mt_rng r;
    mt_rng_seed(&r, 20240520);
    char s[512];
    while (b.n < 600000 && !b.oom) {
        const char *n1 = MT__PICK(names), *n2 = MT__PICK(names), *an = MT__PICK(animals), *ad = MT__PICK(adjs);
        const char *pl = MT__PICK(places), *vb = MT__PICK(verbs), *ob = MT__PICK(objects), *co = MT__PICK(colors);
        int x = (int)(mt_rng_u64(&r) % 10), y = (int)(mt_rng_u64(&r) % 10);
        switch (mt_rng_u64(&r) % 4) {
        case 0:
            snprintf(s, sizeof s, "Once upon a time, %s had a %s %s. Every day, %s and the %s went to %s to %s. "
                                  "One day, they found a %s %s. %s was very happy.\n", n1, ad, an, n1, an, pl, vb, co, ob, n1);
            break;
        case 1:
            snprintf(s, sizeof s, "%s saw a %s %s at %s. \"Can I %s with you?\" asked %s. \"Yes!\" said the %s. "
                                  "They liked to %s all day.\n", n1, ad, an, pl, vb, n2, an, vb);
            break;
        case 2:
            snprintf(s, sizeof s, "%s had %d %ss and %s gave %s %d more. Now %s has %d %ss.\n", n1, x, ob, n2, n1, y, n1, x + y, ob);
            break;
        default:
            snprintf(s, sizeof s, "The %s %s liked the color %s. It wanted a %s %s. %s made a %s %s for the %s, "
                                  "and the %s said thank you.\n", ad, an, co, co, ob, n1, co, ob, an, an);
            break;
        }
        mt__put(&b, s, strlen(s));
    }
#undef MT__PICK
    memset(d, 0, sizeof *d);
    if (b.oom) { MT_FREE(b.p); return mt_errf(err, "out of memory building the default corpus"); }
    d->n = (int64_t)b.n;
    d->format = MT_DATA_EMBEDDED; d->token_bytes = 1;
    d->tokens = (int32_t *)MT_MALLOC(sizeof(int32_t) * b.n);
    if (!d->tokens) { MT_FREE(b.p); return mt_errf(err, "out of memory building the default corpus"); }
    for (size_t i = 0; i < b.n; i++) {
        d->tokens[i] = b.p[i];
        if (b.p[i] > d->max_token) d->max_token = b.p[i];
    }
    MT_FREE(b.p);
    return 0;
}

/* A seeded bijection of [0, W): a 4-round Feistel network over the next even
 * power of two, walking the cycle until it lands inside [0, W). */
static uint64_t mt__permute(uint64_t i, uint64_t W, uint64_t key) {
    if (W <= 1) return 0;
    int bits = 0;
    while (((uint64_t)1 << bits) < W) bits++;
    bits += bits & 1;
    int half = bits / 2;
    uint64_t mask = ((uint64_t)1 << half) - 1;
    do {
        uint64_t l = i >> half, r = i & mask;
        for (int round = 0; round < 4; round++) {
            uint64_t x = r ^ (key + 0x9e3779b97f4a7c15ull * (uint64_t)(round + 1));
            uint64_t f = mt__splitmix(&x) & mask, t = r;
            r = l ^ f; l = t;
        }
        i = l << half | r;
    } while (i >= W);
    return i;
}

int64_t mt_data_window(const mt_dataset *d, uint64_t seed, int64_t sample, int T) {
    int64_t W = (d->n - 1) / T;
    if (W < 1 || sample < 0) return -1;
    int64_t epoch = sample / W, i = sample % W;
    uint64_t key = mt_hash(&epoch, sizeof epoch, mt_hash("data-order", 10, seed));
    return (int64_t)mt__permute((uint64_t)i, (uint64_t)W, key);
}

int mt_data_batch_at(const mt_dataset *d, uint64_t seed, int64_t step, int dp_rank, int dp_size, int B, int T,
                     int32_t *tokens, int32_t *targets, mt_err *err) {
    if (T < 1 || B < 1) return mt_errf(err, "a batch needs B >= 1 and T >= 1 (got %d, %d)", B, T);
    if (d->n < (int64_t)T + 1)
        return mt_errf(err, "the dataset has %lld tokens; a sequence of %d needs at least %d", (long long)d->n, T, T + 1);
    if (dp_size < 1 || dp_rank < 0 || dp_rank >= dp_size || step < 0)
        return mt_errf(err, "data-parallel rank %d of %d at step %lld is out of range", dp_rank, dp_size, (long long)step);
    for (int b = 0; b < B; b++) {
        int64_t q = (step * dp_size + dp_rank) * B + b;
        int64_t off = mt_data_window(d, seed, q, T) * T;
        for (int t = 0; t < T; t++) {
            tokens[(int64_t)b * T + t] = d->tokens[off + t];
            targets[(int64_t)b * T + t] = d->tokens[off + t + 1];
        }
    }
    return 0;
}

/* ========================================================================
 * 13. Metrics
 * ====================================================================== */

void mt_count_params(const mt_config *c, mt_param_count *pc) {
    int64_t D = c->dim, H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim;
    int64_t attn = (c->q_lora_rank ? D * c->q_lora_rank + c->q_lora_rank + (int64_t)c->q_lora_rank * H * (dn + dr)
                                   : D * H * (dn + dr)) +
                   D * (c->kv_lora_rank + dr) + c->kv_lora_rank + (int64_t)c->kv_lora_rank * H * (dn + dv) + H * dv * D;
    int64_t norms = 2 * D, dense_ffn = 3 * D * c->inter_dim;
    int64_t router = (int64_t)c->n_routed_experts * D, experts = (int64_t)c->n_routed_experts * 3 * D * c->moe_inter_dim;
    int64_t shared = 3 * D * (int64_t)c->n_shared_experts * c->moe_inter_dim;
    int n_moe = 0, L = c->n_layers + c->mtp_layers;   /* the MTP blocks too, with their eh_proj and three norms */
    for (int l = 0; l < L; l++) n_moe += mt_config_is_moe_layer(c, l);
    int n_dense = L - n_moe;
    memset(pc, 0, sizeof *pc);
    pc->embedding = (int64_t)c->vocab_size * D;
    pc->sparse_total = n_moe * (router + experts + shared);
    pc->sparse_active = n_moe * (router + shared + experts * c->top_k / (c->n_routed_experts ? c->n_routed_experts : 1));
    pc->total = 2 * pc->embedding + D + L * (attn + norms) + n_dense * dense_ffn + pc->sparse_total + c->mtp_layers * (2 * D * D + 3 * D);
    pc->dense = pc->total - pc->sparse_total;
}
/* torchtitan's DeepSeek-V3 formula: 6 * (dense - embedding + active sparse)
 * + 6 * layers * heads * (qk_nope + qk_rope + v_head) * seq_len; the MTP depths count as
 * layers, and each runs the shared output head once more. */
double mt_flops_per_token(const mt_config *c) {
    mt_param_count pc;
    mt_count_params(c, &pc);
    return 6.0 * (double)(pc.dense - pc.embedding + pc.sparse_active) + 6.0 * c->mtp_layers * (double)pc.embedding +
           6.0 * (c->n_layers + c->mtp_layers) * c->n_heads * (double)(c->qk_nope_head_dim + c->qk_rope_head_dim + c->v_head_dim) * c->seq_len;
}

/* A value's bytes as a step moves them: a data-dependent row count (tokens my
 * experts receive) counts at its balanced expectation, bound / ep, not at the
 * bound memory is planned for. */
static double mt__moved_bytes(const mt_graph *g, int v) {
    const mt_value *x = &g->values[v];
    double b = (double)x->nbytes;
    if (x->ndim && x->dims[0] < 0) {
        const mt_symbol *s = &g->syms[-x->dims[0] - 1];
        if (s->kind == MT_SYM_SIZE && s->mesh_dim >= 0 && g->mesh.size[s->mesh_dim] > 1) b /= g->mesh.size[s->mesh_dim];
    }
    return b;
}
void mt_node_cost(const mt_graph *g, const mt_node *n, double *flops, double *bytes) {
    double f = 0, b = 0;
    for (int i = 0; i < n->n_in; i++) if (n->in[i] >= 0) b += mt__moved_bytes(g, n->in[i]);
    for (int i = 0; i < n->n_out; i++) if (n->out[i] >= 0) b += mt__moved_bytes(g, n->out[i]);
    const mt_value *a = n->in[0] >= 0 ? &g->values[n->in[0]] : NULL;
    switch (n->op) {
    case MT_OP_MATMUL: case MT_OP_MATMUL_ACC: {
        const mt_value *bb = &g->values[n->in[1]];
        double M = (double)a->dims[n->iattr[0] ? 1 : 0], K = (double)a->dims[n->iattr[0] ? 0 : 1], Nn = (double)bb->dims[n->iattr[1] ? 0 : 1];
        f = 2 * M * Nn * K;
        break;
    }
    case MT_OP_GMM: case MT_OP_GMM_DX: case MT_OP_GMM_DW: case MT_OP_GMM_DX2: case MT_OP_GMM_DW_SQ: {
        const mt_value *W = &g->values[(n->op == MT_OP_GMM_DW || n->op == MT_OP_GMM_DW_SQ) ? n->out[0] : n->in[1]];
        double rows = mt__moved_bytes(g, n->in[0]) / (double)mt_dtype_bytes(g, a->dtype) / (double)a->dims[1];
        f = 2.0 * rows * (double)W->dims[1] * (double)W->dims[2];
        b = mt__moved_bytes(g, n->in[0]) + mt__moved_bytes(g, n->in[1]) + mt__moved_bytes(g, n->out[0]);
        if (n->op == MT_OP_GMM_DX2) { f *= 2; b += mt__moved_bytes(g, n->in[3]) + mt__moved_bytes(g, n->in[4]); }
        break;
    }
    case MT_OP_GMM_GLU: {   /* two GEMMs (the SwiGLU's few flops not counted), their operands and three results */
        const mt_value *W = &g->values[n->in[1]];
        double rows = mt__moved_bytes(g, n->in[0]) / (double)mt_dtype_bytes(g, a->dtype) / (double)a->dims[1];
        f = 4.0 * rows * (double)W->dims[1] * (double)W->dims[2];
        break;
    }
    case MT_OP_ATTENTION: case MT_OP_ATTENTION_BWD: case MT_OP_MLA_ATTENTION: case MT_OP_MLA_ATTENTION_BWD: {
        double N = (double)a->dims[0], T = n->iattr[3], H = n->iattr[0], dq = n->iattr[1], dv = n->iattr[2];
        double fwd = 2.0 * (N / T) * H * (T * (T + 1) / 2) * (dq + dv);
        f = n->op == MT_OP_ATTENTION || n->op == MT_OP_MLA_ATTENTION ? fwd : 2.5 * fwd;
        break;
    }
    default: break;
    }
    *flops = f; *bytes = b;
}

int mt_write_svg(const char *path, const double *loss, int n, const char *title, mt_err *err) {
    FILE *f = fopen(path, "w");
    if (!f) return mt_errf(err, "cannot write '%s': %s", path, strerror(errno));
    double lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < n; i++) if (isfinite(loss[i])) { if (loss[i] < lo) lo = loss[i]; if (loss[i] > hi) hi = loss[i]; }
    if (!(lo < hi)) { lo = isfinite(lo) ? lo - 1 : 0; hi = lo + 2; }
    const double W = 720, Hh = 420, L = 70, Rm = 20, Tm = 40, Bm = 50;
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" font-size=\"12\">\n", W, Hh);
    fprintf(f, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n<text x=\"%.0f\" y=\"24\" font-size=\"15\">%s</text>\n", L, title);
    fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L, Hh - Bm, W - Rm, Hh - Bm);
    fprintf(f, "<line x1=\"%.0f\" y1=\"%.0f\" x2=\"%.0f\" y2=\"%.0f\" stroke=\"black\"/>\n", L, Tm, L, Hh - Bm);
    for (int k = 0; k <= 4; k++) {
        double v = lo + (hi - lo) * k / 4, y = Hh - Bm - (Hh - Bm - Tm) * k / 4;
        fprintf(f, "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%.3f</text>\n", L - 6, y + 4, v);
        fprintf(f, "<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", L, y, W - Rm, y);
    }
    fprintf(f, "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">step</text>\n", (L + W - Rm) / 2, Hh - 12);
    fprintf(f, "<text x=\"%.0f\" y=\"%.0f\">%d</text>\n", W - Rm - 20, Hh - Bm + 16, n);
    fprintf(f, "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"");
    for (int i = 0; i < n; i++) {
        if (!isfinite(loss[i])) continue;
        double x = L + (W - Rm - L) * (n > 1 ? (double)i / (n - 1) : 0);
        double y = Hh - Bm - (Hh - Bm - Tm) * (loss[i] - lo) / (hi - lo);
        fprintf(f, "%.1f,%.1f ", x, y);
    }
    fprintf(f, "\"/>\n</svg>\n");
    if (fclose(f)) return mt_errf(err, "writing '%s' failed", path);
    return 0;
}

/* ========================================================================
 * 14. Launch: rendezvous and failure relay
 * Frames of 256 bytes: type, rank, text. HELLO (rank, world) -> rank 0;
 * BLOB (the blob, in pieces) -> each rank; FAIL (failed rank, why) both ways;
 * DONE -> rank 0; BYE -> each rank once all are done.
 * ====================================================================== */

enum { MT__RDV_HELLO = 1, MT__RDV_BLOB, MT__RDV_FAIL, MT__RDV_DONE, MT__RDV_BYE };
typedef struct { int32_t type, rank, world, len; char text[240]; } mt__frame;

struct mt_rdv {
    int rank, world;
    int *fd;                 /* rank 0: one per peer (index = rank); others: fd[0] to rank 0 */
    uint8_t *done;           /* rank 0: which ranks said DONE */
    int self_done, finished, failed;
    pthread_mutex_t mu;      /* writes come from the watchdog and the main thread */
};

static int mt__send_frame(int fd, const mt__frame *f) {
    const char *p = (const char *)f;
    size_t left = sizeof *f;
    while (left) {
        ssize_t k = send(fd, p, left, MSG_NOSIGNAL);
        if (k <= 0) { if (k < 0 && errno == EINTR) continue; return -1; }
        p += k; left -= (size_t)k;
    }
    return 0;
}
static int mt__recv_frame(int fd, mt__frame *f) {   /* 0 ok, -1 closed or error */
    char *p = (char *)f;
    size_t left = sizeof *f;
    while (left) {
        ssize_t k = recv(fd, p, left, 0);
        if (k <= 0) { if (k < 0 && errno == EINTR) continue; return -1; }
        p += k; left -= (size_t)k;
    }
    if (f->type != MT__RDV_BLOB) f->text[sizeof f->text - 1] = 0;   /* text frames are strings; a blob piece is bytes */
    return 0;
}
static int mt__recv_timeout(int fd, mt__frame *f, double timeout_s) {
    struct pollfd pf = {fd, POLLIN, 0};
    int ms = timeout_s > 0 ? (int)(timeout_s * 1000) : -1;
    int k = poll(&pf, 1, ms);
    if (k <= 0) return -2;   /* timed out */
    return mt__recv_frame(fd, f);
}
static void mt__sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}
static void mt__frame_set(mt__frame *f, int type, int rank, const char *text) {
    memset(f, 0, sizeof *f);
    f->type = type; f->rank = rank;
    if (text) snprintf(f->text, sizeof f->text, "%s", text);
}

int mt_free_port(mt_err *err) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK); a.sin_port = 0;
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &len)) {
        if (fd >= 0) close(fd);
        return mt_errf(err, "no free TCP port on this host: %s", strerror(errno));
    }
    close(fd);
    return ntohs(a.sin_port);
}

static int mt__rdv_connect(const char *addr, int port, double timeout_s, mt_err *err) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    double t0 = mt_now();
    for (;;) {
        struct addrinfo hints, *res = NULL;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC; hints.ai_socktype = SOCK_STREAM;
        int gai = getaddrinfo(addr, ps, &hints, &res);
        if (gai) return mt_errf(err, "MASTER_ADDR '%s': %s", addr, gai_strerror(gai));
        int fd = -1;
        for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
            fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
            if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen)) { close(fd); fd = -1; }
        }
        freeaddrinfo(res);
        if (fd >= 0) { int one = 1; setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); return fd; }
        if (mt_now() - t0 > timeout_s)
            return mt_errf(err, "could not reach rank 0 at %s:%d within %.0f s (is rank 0 running? MASTER_ADDR/MASTER_PORT right?)",
                           addr, port, timeout_s);
        mt__sleep_ms(100);
    }
}

void mt_rdv_close(mt_rdv *r) {
    if (!r) return;
    int n = r->rank == 0 ? r->world : 1;
    for (int i = 0; r->fd && i < n; i++) if (r->fd[i] >= 0) close(r->fd[i]);
    MT_FREE(r->fd); MT_FREE(r->done);
    pthread_mutex_destroy(&r->mu);
    MT_FREE(r);
}

int mt_rdv_listen(int *port, mt_err *err) {
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_ANY); a.sin_port = 0;
    socklen_t len = sizeof a;
    if (ls < 0 || setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) || bind(ls, (struct sockaddr *)&a, sizeof a) ||
        listen(ls, 128) || getsockname(ls, (struct sockaddr *)&a, &len)) {
        mt_errf(err, "cannot listen on a free TCP port: %s", strerror(errno));
        if (ls >= 0) close(ls);
        return -1;
    }
    *port = ntohs(a.sin_port);
    return ls;
}
static int mt__rdv_open(mt_rdv **out, const char *addr, int port, int rank, int world, uint8_t *blob, size_t len,
                        double timeout_s, int listen_fd, mt_err *err);
int mt_rdv_open(mt_rdv **out, const char *addr, int port, int rank, int world, uint8_t *blob, size_t len,
                double timeout_s, mt_err *err) {
    return mt__rdv_open(out, addr, port, rank, world, blob, len, timeout_s, -1, err);
}
int mt_rdv_open_on(mt_rdv **out, int listen_fd, int port, int world, uint8_t *blob, size_t len, double timeout_s, mt_err *err) {
    struct sockaddr_in a;
    socklen_t alen = sizeof a;
    int acc = 0;
    socklen_t ol = sizeof acc;
    *out = NULL;
    if (listen_fd < 0 || getsockname(listen_fd, (struct sockaddr *)&a, &alen) || a.sin_family != AF_INET || ntohs(a.sin_port) != port ||
        getsockopt(listen_fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &ol) || !acc)
        return mt_errf(err, "rank 0: descriptor %d is not a socket listening on port %d", listen_fd, port);
    return mt__rdv_open(out, "", port, 0, world, blob, len, timeout_s, listen_fd, err);
}
static int mt__rdv_open(mt_rdv **out, const char *addr, int port, int rank, int world, uint8_t *blob, size_t len,
                        double timeout_s, int listen_fd, mt_err *err) {
    *out = NULL;
    if (world < 1 || rank < 0 || rank >= world) return mt_errf(err, "rank %d outside a world of %d", rank, world);
    if (port < 1 || port > 65535) return mt_errf(err, "MASTER_PORT %d is not a TCP port", port);
    if (len > 64 * sizeof(((mt__frame *)0)->text)) return mt_errf(err, "rendezvous blob too large");
    mt_rdv *r = (mt_rdv *)mt__calloc(sizeof *r);
    if (!r) return mt_errf(err, "out of memory");
    r->rank = rank; r->world = world;
    pthread_mutex_init(&r->mu, NULL);
    r->fd = (int *)MT_MALLOC(sizeof(int) * (size_t)world);
    r->done = (uint8_t *)mt__calloc((size_t)world);
    if (!r->fd || !r->done) { mt_rdv_close(r); return mt_errf(err, "out of memory"); }
    for (int i = 0; i < world; i++) r->fd[i] = -1;
    mt__frame f;
    const size_t piece = sizeof f.text;
    if (rank == 0) {
        int ls = listen_fd >= 0 ? listen_fd : socket(AF_INET, SOCK_STREAM, 0), one = 1;
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_ANY); a.sin_port = htons((uint16_t)port);
        if (listen_fd < 0 && (ls < 0 || setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) || bind(ls, (struct sockaddr *)&a, sizeof a) ||
                              listen(ls, world))) {
            mt_errf(err, "rank 0 cannot listen on port %d: %s (another job on it? set MASTER_PORT)", port, strerror(errno));
            if (ls >= 0) close(ls);
            mt_rdv_close(r);
            return -1;
        }
        double t0 = mt_now();
        for (int got = 1; got < world;) {
            struct pollfd pf = {ls, POLLIN, 0};
            double left = timeout_s - (mt_now() - t0);
            if (left <= 0 || poll(&pf, 1, (int)(left * 1000)) <= 0) {
                mt_errf(err, "rank 0: only %d of %d ranks joined within %.0f s", got, world, timeout_s);
                close(ls); mt_rdv_close(r);
                return -1;
            }
            int fd = accept(ls, NULL, NULL);
            if (fd < 0) continue;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            if (mt__recv_timeout(fd, &f, 10) || f.type != MT__RDV_HELLO) { close(fd); continue; }   /* not one of ours */
            if (f.world != world || f.rank < 1 || f.rank >= world || r->fd[f.rank] >= 0) {
                mt__frame no;
                mt__frame_set(&no, MT__RDV_FAIL, 0, "");
                snprintf(no.text, sizeof no.text, "rank 0 expects a world of %d; a process says rank %d of %d", world, f.rank, f.world);
                mt__send_frame(fd, &no);
                mt_errf(err, "%s", no.text);
                close(fd); close(ls); mt_rdv_close(r);
                return -1;
            }
            r->fd[f.rank] = fd;
            got++;
        }
        close(ls);
        for (int p = 1; p < world; p++)
            for (size_t at = 0; at < len || (at == 0 && len == 0); at += piece) {
                mt__frame_set(&f, MT__RDV_BLOB, 0, NULL);
                f.len = (int32_t)(len - at < piece ? len - at : piece);
                memcpy(f.text, blob + at, (size_t)f.len);
                if (mt__send_frame(r->fd[p], &f)) { mt_rdv_close(r); return mt_errf(err, "rank 0: rank %d went away during the rendezvous", p); }
                if (len == 0) break;
            }
    } else {
        int fd = mt__rdv_connect(addr, port, timeout_s, err);
        if (fd < 0) { mt_rdv_close(r); return -1; }
        r->fd[0] = fd;
        mt__frame_set(&f, MT__RDV_HELLO, rank, NULL);
        f.world = world;
        if (mt__send_frame(fd, &f)) { mt_rdv_close(r); return mt_errf(err, "rank %d: rank 0 closed the rendezvous", rank); }
        for (size_t at = 0; at < len || (at == 0 && len == 0); at += piece) {
            int k = mt__recv_timeout(fd, &f, timeout_s);
            if (k || f.type != MT__RDV_BLOB) {
                if (!k && f.type == MT__RDV_FAIL) mt_errf(err, "rank %d: rank 0 refused: %s", rank, f.text);
                else mt_errf(err, "rank %d: no answer from rank 0 during the rendezvous", rank);
                mt_rdv_close(r);
                return -1;
            }
            if (f.len < 0 || (size_t)f.len > len - at || (size_t)f.len > sizeof f.text) {
                mt_rdv_close(r);
                return mt_errf(err, "rank %d: a malformed rendezvous message", rank);
            }
            memcpy(blob + at, f.text, (size_t)f.len);
            if (len == 0) break;
        }
    }
    *out = r;
    return 0;
}

static void mt__rdv_broadcast(mt_rdv *r, const mt__frame *f, int except) {
    for (int p = 1; p < r->world; p++)
        if (p != except && r->fd[p] >= 0 && mt__send_frame(r->fd[p], f)) { close(r->fd[p]); r->fd[p] = -1; }
}
void mt_rdv_fail(mt_rdv *r, const char *why) {
    if (!r) return;
    mt__frame f;
    mt__frame_set(&f, MT__RDV_FAIL, r->rank, why);
    pthread_mutex_lock(&r->mu);
    r->failed = 1;
    if (r->rank == 0) mt__rdv_broadcast(r, &f, -1);
    else if (r->fd[0] >= 0) mt__send_frame(r->fd[0], &f);
    pthread_mutex_unlock(&r->mu);
}
/* rank 0: every rank done -> BYE to all */
static int mt__rdv_all_done(mt_rdv *r) {
    if (!r->self_done) return 0;
    for (int p = 1; p < r->world; p++) if (!r->done[p]) return 0;
    mt__frame f;
    mt__frame_set(&f, MT__RDV_BYE, 0, NULL);
    mt__rdv_broadcast(r, &f, -1);
    r->finished = 1;
    return 1;
}
void mt_rdv_done(mt_rdv *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->self_done = 1;
    if (r->rank == 0) mt__rdv_all_done(r);
    else if (r->fd[0] >= 0) { mt__frame f; mt__frame_set(&f, MT__RDV_DONE, r->rank, NULL); mt__send_frame(r->fd[0], &f); }
    pthread_mutex_unlock(&r->mu);
}
int mt_rdv_poll(mt_rdv *r, int ms, int *who, char *why, size_t n) {
    if (r->finished) return 2;
    int np = r->rank == 0 ? r->world : 1;
    struct pollfd pf[4096];
    int idx[4096], k = 0;
    for (int i = (r->rank == 0 ? 1 : 0); i < np && k < 4096; i++)
        if (r->fd[i] >= 0) { pf[k].fd = r->fd[i]; pf[k].events = POLLIN; pf[k].revents = 0; idx[k++] = i; }
    if (!k) { mt__sleep_ms(ms); return r->finished ? 2 : 0; }
    if (poll(pf, (nfds_t)k, ms) <= 0) return 0;
    for (int j = 0; j < k; j++) {
        if (!pf[j].revents) continue;
        int peer = idx[j];
        mt__frame f;
        int closed = mt__recv_frame(pf[j].fd, &f) != 0;
        pthread_mutex_lock(&r->mu);
        int rc = 0;
        if (r->rank == 0) {
            if (closed) {
                close(r->fd[peer]); r->fd[peer] = -1;
                if (!r->done[peer]) {   /* a rank went away before its end: it died */
                    mt__frame_set(&f, MT__RDV_FAIL, peer, "its process exited or was killed (connection lost)");
                    rc = 1;
                }
            } else if (f.type == MT__RDV_DONE) {
                r->done[peer] = 1;
                if (mt__rdv_all_done(r)) rc = 2;
            } else if (f.type == MT__RDV_FAIL) {
                f.rank = peer;
                rc = 1;
            }
            if (rc == 1) { mt__rdv_broadcast(r, &f, peer); r->failed = 1; }
        } else {
            if (closed) {
                close(r->fd[0]); r->fd[0] = -1;
                if (!r->finished) { mt__frame_set(&f, MT__RDV_FAIL, 0, "its process exited or was killed (connection lost)"); rc = 1; }
            } else if (f.type == MT__RDV_BYE) {
                r->finished = 1; rc = 2;
            } else if (f.type == MT__RDV_FAIL) {
                rc = 1;
            }
        }
        pthread_mutex_unlock(&r->mu);
        if (rc == 1) {
            if (who) *who = f.rank;
            if (why) snprintf(why, n, "%s", f.text);
            return 1;
        }
        if (rc == 2) return 2;
    }
    return 0;
}

/* --- which launcher started this process: its variables, read through a callback --- */

const char *mt_env_get(void *env, const char *name) {
    size_t n = strlen(name);
    for (char **e = (char **)env; e && *e; e++)
        if (!strncmp(*e, name, n) && (*e)[n] == '=') return *e + n + 1;
    return NULL;
}

/* Slurm host lists. A number of 1..18 digits in [p, e). */
static int mt__hl_num(const char *p, const char *e, uint64_t *v) {
    if (p >= e || e - p > 18) return -1;
    uint64_t x = 0;
    for (; p < e; p++) {
        if (*p < '0' || *p > '9') return -1;
        x = x * 10 + (uint64_t)(*p - '0');
    }
    *v = x;
    return 0;
}
/* A bracket's body [b, e), "01-04,07": how many numbers, or -1; number k (0 <=
 * k < that) and its width (its range's low end as written: "01-04" pads to 2). */
static int64_t mt__hl_group(const char *b, const char *e, int64_t k, uint64_t *val, int *width) {
    int64_t count = 0;
    for (const char *p = b;;) {
        const char *q = p, *dash;
        while (q < e && *q != ',') q++;
        for (dash = p; dash < q && *dash != '-'; dash++) {}
        uint64_t lo, hi;
        if (mt__hl_num(p, dash, &lo)) return -1;
        if (dash < q) { if (mt__hl_num(dash + 1, q, &hi) || hi < lo) return -1; } else hi = lo;
        if (hi - lo >= (1ull << 40)) return -1;
        int64_t n = (int64_t)(hi - lo) + 1;
        if (k >= count && k < count + n) { *val = lo + (uint64_t)(k - count); *width = (int)(dash - p); }
        if ((count += n) > (1ll << 40)) return -1;
        if (q == e) return count;
        p = q + 1;
    }
}
/* One entry [b, e) of a list, "gpu-a[1-2]" or "rack[1-2]-n[01-02]": how many
 * hosts, or -1 (-2: host k does not fit in out[n]); host k into out when 0 <= k
 * < that. Several brackets expand as nested loops, the last one innermost. */
static int64_t mt__hl_entry(const char *b, const char *e, int64_t k, char *out, size_t n) {
    enum { G = 16 };
    const char *gb[G], *ge[G];
    int64_t gc[G], total = 1;
    int ng = 0;
    if (b == e) return -1;
    for (const char *p = b; p < e; p++) {
        if (*p == ']') return -1;
        if (*p != '[') continue;
        const char *c = p + 1;
        while (c < e && *c != ']' && *c != '[') c++;
        uint64_t v;
        int w;
        if (c == e || *c != ']' || ng == G) return -1;
        int64_t m = mt__hl_group(p + 1, c, -1, &v, &w);
        if (m < 0 || total > (1ll << 40) / m) return -1;
        gb[ng] = p + 1; ge[ng] = c; gc[ng++] = m;
        total *= m;
        p = c;
    }
    if (k < 0 || k >= total) return total;
    uint64_t val[G];
    int width[G];
    for (int g = ng - 1; g >= 0; g--) { mt__hl_group(gb[g], ge[g], k % gc[g], &val[g], &width[g]); k /= gc[g]; }
    size_t at = 0;
    int g = 0;
    for (const char *p = b; p < e; p++) {
        int w = 1;
        if (*p == '[') {
            w = snprintf(at < n ? out + at : NULL, at < n ? n - at : 0, "%0*llu", width[g], (unsigned long long)val[g]);
            p = ge[g++];
        } else if (at + 1 < n) {
            out[at] = *p;
        }
        at += (size_t)w;
    }
    if (at >= n) return -2;
    out[at] = 0;
    return total;
}
int64_t mt_hostlist_host(const char *list, int64_t i, char *host, size_t n, mt_err *err) {
    if (host && n) host[0] = 0;
    if (!list || !*list) return mt_errf(err, "an empty host list");
    int64_t total = 0;
    for (const char *p = list;;) {
        const char *q = p;
        for (int depth = 0; *q && (*q != ',' || depth); q++) depth += *q == '[' ? 1 : *q == ']' ? -1 : 0;
        int64_t k = i >= total && host ? i - total : -1;
        int64_t m = mt__hl_entry(p, q, k, host, n);
        if (m == -2) return mt_errf(err, "host list '%s': host %lld is longer than %zu bytes", list, (long long)i, n ? n - 1 : 0);
        if (m < 0)
            return mt_errf(err, "host list '%s': cannot read '%.*s' (Slurm's forms: host1,host2 or prefix[01-04,07])", list,
                           (int)(q - p), p);
        if ((total += m) > (1ll << 40)) return mt_errf(err, "host list '%s': more than 2^40 hosts", list);
        if (!*q) return total;
        p = q + 1;
    }
}

/* A variable as an integer in lo..hi: 1 when set, 0 when unset or empty, -1 when not such an integer. */
static int mt__env_int(mt_getenv_fn get, void *ctx, const char *name, long long lo, long long hi, long long *out, mt_err *err) {
    const char *v = get(ctx, name);
    if (!v || !*v) return 0;
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (*end || errno || x < lo || x > hi) { mt_errf(err, "%s=%s is not an integer in %lld..%lld", name, v, lo, hi); return -1; }
    *out = x;
    return 1;
}

int mt_launch_from_env(mt_launch *l, mt_getenv_fn get, void *ctx, mt_err *err) {
    static const struct { mt_launcher by; const char *name, *rank, *world, *local; } L[3] = {
        {MT_LAUNCH_TORCHRUN, "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
        {MT_LAUNCH_OPENMPI, "open mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
        {MT_LAUNCH_SLURM, "slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
    };
    const long long WMAX = 1 << 20;
    memset(l, 0, sizeof *l);
    l->by = MT_LAUNCH_SELF; l->world = 1; l->port = 29500;
    snprintf(l->addr, sizeof l->addr, "127.0.0.1");
    l->addr_from = l->port_from = "default";
    snprintf(l->what, sizeof l->what, "self");
    int which = -1;
    for (int i = 0; i < 3 && which < 0; i++) {
        const char *r = get(ctx, L[i].rank), *w = get(ctx, L[i].world);
        int set = (r && *r) || (w && *w);
        if (L[i].by == MT_LAUNCH_SLURM) {   /* srun's tasks: a job step's; a batch script's SLURM_PROCID is no launch */
            const char *step = get(ctx, "SLURM_STEP_ID");
            set = r && *r && step && *step;
        }
        if (set) which = i;
    }
    if (which < 0) return 0;
    const char *name = L[which].name, *rv = L[which].rank, *wv = L[which].world, *lv = L[which].local;
    long long rank = 0, world = 1, local = 0;
    int hr = mt__env_int(get, ctx, rv, 0, WMAX, &rank, err), hw = hr < 0 ? -1 : mt__env_int(get, ctx, wv, 1, WMAX, &world, err);
    if (hr < 0 || hw < 0) return -1;
    if (!hr || !hw) return mt_errf(err, "%s: %s is set but %s is not (a launcher sets both)", name, hr ? rv : wv, hr ? wv : rv);
    if (rank >= world) return mt_errf(err, "%s: %s=%lld but %s=%lld: a rank must be below the world size", name, rv, rank, wv, world);
    int hl = mt__env_int(get, ctx, lv, 0, WMAX, &local, err);
    if (hl < 0) return -1;
    if (!hl && L[which].by != MT_LAUNCH_TORCHRUN)   /* torchrun's conventions: LOCAL_RANK defaults to RANK (one host) */
        return mt_errf(err, "%s: %s=%lld of %s=%lld but %s is not set: which GPU of this host is the rank's?", name, rv, rank, wv,
                       world, lv);
    if (!hl) local = rank;
    if (local >= world) return mt_errf(err, "%s: %s=%lld but %s=%lld: a local rank must be below the world size", name, lv, local, wv, world);
    int n = snprintf(l->what, sizeof l->what, "%s (%s=%lld of %lld, ", name, rv, rank, world);
    if (hl) snprintf(l->what + n, sizeof l->what - (size_t)n, "%s=%lld)", lv, local);
    else snprintf(l->what + n, sizeof l->what - (size_t)n, "%s unset: %lld)", lv, local);
    if (world == 1 && L[which].by != MT_LAUNCH_TORCHRUN) {   /* one task: it starts its own ranks */
        char was[sizeof l->what];
        memcpy(was, l->what, sizeof was);
        snprintf(l->what, sizeof l->what, "self (a world of one from %.200s)", was);
        return 0;
    }
    l->by = L[which].by; l->rank = (int)rank; l->world = (int)world; l->local_rank = (int)local;

    /* the rendezvous host: MASTER_ADDR, else the launcher's default */
    const char *ma = get(ctx, "MASTER_ADDR");
    if (ma && *ma) {
        if (strlen(ma) >= sizeof l->addr) return mt_errf(err, "MASTER_ADDR is longer than %zu bytes", sizeof l->addr - 1);
        snprintf(l->addr, sizeof l->addr, "%s", ma);
        l->addr_from = "MASTER_ADDR";
    } else if (l->by == MT_LAUNCH_OPENMPI) {
        long long ls = 0;
        int h = mt__env_int(get, ctx, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, WMAX, &ls, err);
        if (h < 0) return -1;
        if (!h || ls != world)
            return mt_errf(err, "open mpi: %lld ranks over more than this host (OMPI_COMM_WORLD_LOCAL_SIZE=%s): set MASTER_ADDR to rank 0's "
                           "host (mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=PORT ...)", world, h ? get(ctx, "OMPI_COMM_WORLD_LOCAL_SIZE") : "unset");
        l->addr_from = "default (every rank on this host)";
    } else if (l->by == MT_LAUNCH_SLURM) {
        static const char *lists[3] = {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"};
        const char *list = NULL;
        for (int i = 0; i < 3 && !list; i++) {
            const char *v = get(ctx, lists[i]);
            if (v && *v) { list = v; l->addr_from = lists[i]; }
        }
        if (!list) return mt_errf(err, "slurm: no SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or MASTER_ADDR: which host is rank 0's?");
        mt_err e;
        if (mt_hostlist_host(list, 0, l->addr, sizeof l->addr, &e) < 0) return mt_errf(err, "slurm: %s: %s", l->addr_from, e.msg);
    }

    /* the port: MOETRAIN_PORT, else MASTER_PORT, else the launcher's default */
    long long port = 29500, job = 0, step = 0;
    int h = mt__env_int(get, ctx, "MASTER_PORT", 1, 65535, &port, err);
    if (h < 0) return -1;
    if (h) {
        l->port_from = "MASTER_PORT";
    } else if (l->by == MT_LAUNCH_SLURM) {   /* the same on every task of the step; another on the job's other steps */
        int hj = mt__env_int(get, ctx, "SLURM_JOB_ID", 0, LLONG_MAX / 32, &job, err);
        if (hj < 0 || mt__env_int(get, ctx, "SLURM_STEP_ID", 0, LLONG_MAX / 32, &step, err) < 0) return -1;
        if (hj) { port = 10000 + (16 * job + step) % 20000; l->port_from = "SLURM_JOB_ID"; }
    }
    if (l->by == MT_LAUNCH_TORCHRUN) {   /* torchrun's agent keeps its own store on MASTER_PORT: ours takes the next port */
        const char *agent = get(ctx, "TORCHELASTIC_USE_AGENT_STORE");
        if (agent && (!strcmp(agent, "True") || !strcmp(agent, "true") || !strcmp(agent, "1")) && port < 65535) {
            port++;
            l->port_from = h ? "MASTER_PORT + 1 (torchrun's store is on MASTER_PORT)" : "default + 1 (torchrun's store)";
        }
    }
    if ((h = mt__env_int(get, ctx, "MOETRAIN_PORT", 1, 65535, &port, err)) < 0) return -1;
    if (h) l->port_from = "MOETRAIN_PORT";
    l->port = (int)port;
    return 0;
}

#ifdef __cplusplus
}
#endif
#endif /* MOETRAIN_IMPLEMENTATION_DONE */
#endif /* MOETRAIN_IMPLEMENTATION */
