/* bench/kernel_variants.cuh — kernels and kernel variants that the benches time or check against
 * moetrain_kernels.cu's, and that the runtime never runs.  Included after ../moetrain_kernels.cu (it
 * uses that file's helpers and reopens its namespaces); nothing in the product refers to it.
 *
 * Attention:
 *   fa_bwd_dkdv_wg_kernel (launch_dkdv_wg_kernel)  the dK/dV kernel before fa_bwd_dkdv_split_kernel:
 *       two warpgroups x 64 keys, each forming both dK and dV of its keys, 128-key blocks.  The same
 *       dK, dV and dS^T bitwise as the split kernel (the same products in the same order).  Its VAR
 *       bits and DS 1, 2 (other ways of storing dS^T) are timing variants; see docs/KERNELS.md for
 *       what they measured.
 */
#ifndef MT_BENCH_KERNEL_VARIANTS_CUH
#define MT_BENCH_KERNEL_VARIANTS_CUH

namespace mt_fa {

template <int DQ, int DV>
__host__ __device__ constexpr int dkdv_wg_stages() { return (128 * (DQ + DV) + 3 * 64 * (DQ + DV)) * 2 + 4096 <= 227 * 1024 ? 3 : 2; }
template <int DQ, int DV>
constexpr size_t dkdv_wg_smem_bytes(bool ds_stage = false) {   /* ds_stage: DS 3's two 8 KB tiles */
    return 1024 + (size_t)(128 * DQ + 128 * DV + dkdv_wg_stages<DQ, DV>() * 64 * (DQ + DV)) * sizeof(bf16) +
           (size_t)dkdv_wg_stages<DQ, DV>() * 3 * 64 * sizeof(float) + 16 * 8 + (ds_stage ? 1024 + 2 * 8192 : 0);
}

/* A warp's 16 rows of a dS^T tile from the A fragments of dK += dS^T Q: da4[kk][e] holds the pair at row
   16(warp & 3) + g + 8(e & 1), columns 16kk + 8(e >> 1) + 2c.  V 1: as they are, 4-byte stores (8 rows
   a store); V 2: 4 x 4 transposes over the quad (xor shuffles, as store_acc_row) give thread c the
   8-column chunks c and 4 + c of its two rows, 16-byte stores.  H200, B=8 T=2048 H=16, 192/128, dK/dV
   without the stores 0.760 ms, V 1 0.945-0.954, V 2 0.876-0.882; V 2 before dK and dV are issued
   instead of after they complete, or as streaming stores (st.global.cs), within 0.003 ms. */
template <int V>
__device__ __forceinline__ void store_ds(bf16 *tile, const uint32_t (&da4)[4][4], int warp, int g, int c) {
    if constexpr (V == 1) {
        uint32_t *t = reinterpret_cast<uint32_t *>(tile) + (16 * (warp & 3) + g) * 32 + c;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) t[(e & 1) * 256 + 8 * kk + 4 * (e >> 1)] = da4[kk][e];
    } else {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            bf16 *row = tile + (16 * (warp & 3) + g + 8 * hh) * 64;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                uint32_t w[4];
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int i = c ^ r; /* send my pair of chunk 4q + i, receive thread i's of chunk 4q + c */
                    /* pair j = 4q + i of row hh: da4[j >> 1][hh + 2 (j & 1)] */
                    const uint32_t y = (i & 2) ? ((i & 1) ? da4[2 * q + 1][hh + 2] : da4[2 * q + 1][hh])
                                               : ((i & 1) ? da4[2 * q][hh + 2] : da4[2 * q][hh]);
                    const uint32_t x = r ? __shfl_xor_sync(0xffffffffu, y, r) : y;
#pragma unroll
                    for (int e = 0; e < 4; ++e) w[e] = i == e ? x : (r ? w[e] : 0u);
                }
                *reinterpret_cast<uint4 *>(row + 8 * (4 * q + c)) = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }
}

/* split_pt with the mask under the run-time flag need (the product runs separate code for masked
   tiles, split_pt<1> / split_pt<0>; folded under a flag it is if-converted into selects on every tile) */
__device__ __forceinline__ void split_pt_flag(float (&x)[32], const float *sL, const int *sS, const int *dsb, int q0, int kr, int c, int T,
                                         float sl2, bool need) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float2 l2 = *reinterpret_cast<const float2 *>(sL + 8 * j + 2 * c);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int bb = e & 1, hh = e >> 1;
            float y = fast_exp2(x[4 * j + e] * sl2 - (bb ? l2.y : l2.x) * MT_FA_LOG2E);
            if (need) {
                const int q = q0 + 8 * j + 2 * c + bb, key = kr + 8 * hh;
                if (key > q || q >= T || (dsb && key < sS[8 * j + 2 * c + bb])) y = 0.f;
            }
            x[4 * j + e] = y;
        }
    }
}

/* VAR: 0 in the runtime; bench/attention.cu's variants (results right unless said): bit 0 no loads in
   the loop (timing only), bit 2 no turns at S^T / dP^T, bit 3 turns at dV / dK too, bit 4 refills at
   the start of a tile instead of its end.  Measured (H200, B=8 T=2048 H=16, 192/128): the runtime's
   choice 0.810 ms; no turns 0.923, turns at dV / dK instead 0.878, at both 0.831; refilling at the
   start 0.839 (no turns 0.857, turns at both 0.876). */
/* DS: 0 no dS^T stores; 1, 2 store_ds<DS> once dK and dV have been formed (bench variants); 3 (the
   runtime's) through shared memory and a TMA store: 0.848-0.868 ms against 0.875-0.887 for 2 (H200, B=8
   T=2048 H=16, 192/128) */
template <int DQ, int DV, int VAR, bool FOLD, int DS>
__global__ void __launch_bounds__(256, 1) fa_bwd_dkdv_wg_kernel(const BwdCore p, const __grid_constant__ DkdvMaps tm) {
    constexpr int BNK = 128, BMQ = 64, NS = dkdv_wg_stages<DQ, DV>();
    static_assert(DQ % 64 == 0 && DV % 64 == 0 && DQ <= 192 && DV <= 128, "wgmma tiles");
    constexpr uint32_t K_BYTES = BNK * DQ * 2, V_BYTES = BNK * DV * 2, Q_BYTES = BMQ * DQ * 2, O_BYTES = BMQ * DV * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[]; /* aligned to 1024 below */
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
    const uint32_t sK = raw + pad, sV = sK + K_BYTES, sQ = sV + V_BYTES, sdO = sQ + NS * Q_BYTES;
    /* per stage: lse [64] f32, D [64] f32, document start [64] i32; then the mbarriers:
       K+V full; stage full [NS]; stage empty [NS] */
    const uint32_t sAux = sdO + NS * O_BYTES;
    const float *aux = reinterpret_cast<const float *>(smem_raw + pad + (sAux - sK));
    const uint32_t sBar = sAux + NS * 3 * BMQ * 4;
    const uint32_t barKV = sBar, barF = sBar + 8, barE = sBar + 8 + 8 * NS;
    const uint32_t sDs = (sBar + 128 + 1023u) & ~1023u; /* DS 3: two 8 KB tiles */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int g = lane >> 2, c = lane & 3;
    const int T = p.T, H = p.H;
    const int bh = blockIdx.y, b = bh / H, h = bh - b * H;
    const int n0 = (int)blockIdx.x * BNK; /* key block 0 (most work) first; heads in order (heavy_first
                                              measured 0.865 against 0.818 ms: it costs registers here) */
    const size_t ldqk = (size_t)H * p.dimq, ldv = (size_t)H * p.dimv;
    const size_t qoff = (size_t)b * T * ldqk + (size_t)h * p.dimq;
    const size_t voff = (size_t)b * T * ldv + (size_t)h * p.dimv;
    const int *dsb = p.dstart ? p.dstart + (size_t)b * T : nullptr;

    /* query tiles: from the one holding the block's first key to the last query that sees a key */
    const int i_first = n0 / BMQ;
    int q_end = T;
    if (dsb) { /* queries from the first one whose document starts after this block's last key see none of it */
        const int kmax = min(n0 + BNK, T) - 1;
        int lo = kmax + 1, hi = T;
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (dsb[mid] > kmax) hi = mid; else lo = mid + 1;
        }
        q_end = lo;
    }
    const int i_end = (q_end + BMQ - 1) / BMQ;
    const int n_tiles = i_end - i_first;

    if (tid == 0) {
        mbar_init(barKV, 1);
        for (int i = 0; i < NS; ++i) {
            mbar_init(barF + 8 * i, 33);
            mbar_init(barE + 8 * i, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads(); /* the only CTA-wide barrier */
    /* the dQ kernel that follows (launched with programmatic stream serialization) may start on the
       SMs this grid leaves idle once all of its CTAs have started: it needs none of its outputs */
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    /* warp 0: fill use u of the ring (tile i_first + u) into stage u % NS once its previous use is released */
    const float *lseb = p.lse + (size_t)b * T * H + h, *dsumb = p.dsum + (size_t)b * T * H + h;
    auto fill = [&](int u) {
        const int st = u % NS, q0 = (i_first + u) * BMQ;
        if (u >= NS) mbar_wait(barE + 8 * st, ((u / NS) - 1) & 1);
        const uint32_t full = barF + 8 * st, a = sAux + (uint32_t)(st * 3 * BMQ) * 4;
        fill_aux(a, full, lseb, dsumb, dsb, q0, T, H, lane);
        if (lane == 0) {
            if (!(VAR & 1) || u < NS) {
                mbar_expect_tx(full, Q_BYTES + O_BYTES);
                tma_qkv_tile<BMQ, DQ, FOLD, 0>(sQ + (uint32_t)st * Q_BYTES, &tm.q, &tm.q2, full, h, q0, b);
                tma_head_tile<BMQ, DV>(sdO + (uint32_t)st * O_BYTES, &tm.dout, full, h, q0, b);
            } else {
                mbar_arrive(full);
            }
        }
    };
    if (warp == 0) {
        if (lane == 0) {
            mbar_expect_tx(barKV, K_BYTES + V_BYTES);
            tma_qkv_tile<BNK, DQ, FOLD, 1>(sK, &tm.k, &tm.k2, barKV, h, n0, b);
            tma_qkv_tile<BNK, DV, FOLD, 2, DQ - 64>(sV, &tm.v, &tm.v, barKV, h, n0, b);
        }
        for (int u = 0; u < min(NS, n_tiles); ++u) fill(u);
    }

    float dk[DQ / 2], dv[DV / 2];
#pragma unroll
    for (int i = 0; i < DQ / 2; ++i) dk[i] = 0.f;
#pragma unroll
    for (int i = 0; i < DV / 2; ++i) dv[i] = 0.f;

    /* this thread's keys: kr + 8hh, hh = 0, 1 */
    const int kw0 = n0 + 64 * wg;
    const int kr = kw0 + 16 * (warp & 3) + g;
    const float sl2 = p.scale_log2;

    /* turns: the warpgroups take turns issuing S^T / dP^T (and, a bench variant, dV / dK) as in the
       forward's ping-pong, so that one's exponentials run while the other's products keep the tensor
       cores busy */
    constexpr bool TA = !(VAR & 4), TB = (VAR & 8) != 0;
    const Turns turns{wg};
    if (TA || TB) turns.start();

    mbar_wait(barKV, 0);
#pragma unroll 1
    for (int i = i_first; i < i_end; ++i) {
        const int u = i - i_first, st = u % NS, q0 = i * BMQ;
        if ((VAR & 16) && warp == 0 && u >= 1 && u + NS - 1 < n_tiles) fill(u + NS - 1);
        mbar_wait(barF + 8 * st, (u / NS) & 1);
        const uint32_t qst = sQ + (uint32_t)st * Q_BYTES, ost = sdO + (uint32_t)st * O_BYTES;
        const float *sL = aux + st * 3 * BMQ;
        const float *sD = sL + BMQ;
        const int *sS = reinterpret_cast<const int *>(sD + BMQ);

        float s[32], dp[32];
        fence_regs(dk);
        fence_regs(dv);
        if (TA) turns.begin();
        wgmma_fence();
        wgmma_abt<64, DQ, BNK, BMQ>(s, sK, qst, wg);
        wgmma_commit();
        wgmma_abt<64, DV, BNK, BMQ>(dp, sV, ost, wg);
        wgmma_commit();
        if (TA) turns.end();

        /* P^T: element s[4j + 2hh + bb] is (key kr + 8hh, query q0 + 8j + 2c + bb) */
        const int dlast = dsb ? sS[min(BMQ, T - q0) - 1] : 0;
        const bool need_mask = (kw0 + 63 > q0) || (q0 + BMQ > T) || (dlast > kw0);
        wgmma_wait<1>();
        fence_regs(s);
        split_pt_flag(s, sL, sS, dsb, q0, kr, c, T, sl2, need_mask);
        wgmma_wait<0>();
        fence_regs(dp);
        uint32_t pa[4][4], da4[4][4]; /* P^T and dS^T as A fragments (reduction over the 64 queries) */
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float2 d2 = *reinterpret_cast<const float2 *>(sD + 8 * j + 2 * c);
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? d2.y : d2.x));
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                pa[kk][e] = pack_bf16(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
                da4[kk][e] = pack_bf16(dp[8 * kk + 2 * e], dp[8 * kk + 2 * e + 1]);
            }
        }
        if (TB) turns.begin();
        wgmma_fence();
        wgmma_pb<DV, 4, BMQ>(dv, pa, ost);
        wgmma_pb<DQ, 4, BMQ>(dk, da4, qst);
        wgmma_commit();
        if (TB) turns.end();
        wgmma_wait<0>();
        fence_regs(dk);
        fence_regs(dv);
        fence_regs(pa);
        fence_regs(da4);
        mbar_arrive(barE + 8 * st); /* this thread is done with the stage (every thread: see the split kernel's done) */
        /* dS^T for the dQ kernel: this warpgroup's 64 keys x the tile's 64 queries, when any key is at or
           before a query */
        if constexpr (DS == 1 || DS == 2)
            if (kw0 <= q0 + BMQ - 1) store_ds<DS>(tm.ds + ds_tile(bh, tm.ntri, i, kw0 / 64), da4, warp, g, c);
        if constexpr (DS == 3)
            if (kw0 <= q0 + BMQ - 1) { /* warpgroup-uniform */
                const bool issuer = (tid & 127) == 0;
                if (issuer) bulk_wait_read0();  /* the previous tile's store has read the buffer */
                named_bar_sync(3 + wg, 128);
                const uint32_t sb = sDs + (uint32_t)wg * 8192u;
                const int m = lane >> 3, rr = lane & 7, row = 16 * (warp & 3) + 8 * (m & 1) + rr;
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
                    stmatrix_x4(sb + (uint32_t)(row * 128 + (((2 * kk + (m >> 1)) ^ rr) << 4)), da4[kk]);
                fence_proxy_async();
                named_bar_sync(3 + wg, 128);
                if (issuer) {
                    tma_store_2d(&tm.dsm, sb, 0, (int)(ds_tile(bh, tm.ntri, i, kw0 / 64) / 64));
                    bulk_commit();
                }
            }
        /* warp 0 refills tile u - 1's stage with tile u + NS - 1 (waiting, at worst, for the other
           warpgroup to finish tile u - 1: the warpgroups may drift a whole tile apart) */
        if (!(VAR & 16) && warp == 0 && u >= 1 && u + NS - 1 < n_tiles) fill(u + NS - 1);
    }
    if (TA || TB) turns.finish();
    if constexpr (DS == 3)
        if ((tid & 127) == 0) bulk_wait0(); /* the dS^T stores have completed */

    /* epilogue: dK * scale, dV; accumulator d[4j + 2hh + bb] = (key kr + 8hh, column 8j + 2c + bb) */
    const bool pq = p.pair_qk != 0, pv = p.pair_v != 0;
    if constexpr (!FOLD) {
        bf16 *dkbase = p.dk + qoff, *dvbase = p.dv + voff;
        const bool wq = rows16(p.dk, p.dimq, pq), wv = rows16(p.dv, p.dimv, pv);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int key = kr + 8 * hh;
            store_acc_row<DQ>(dkbase + (size_t)key * ldqk, key < T, p.dimq, wq, pq, dk, hh, p.scale, c);
            store_acc_row<DV>(dvbase + (size_t)key * ldv, key < T, p.dimv, wv, pv, dv, hh, 1.f, c);
        }
    } else { /* folded RoPE: dK's first dn columns and dV go to kv's gradient rows, dK's rope columns to dk2 */
        const int fd = tm.fold_dn;
        const size_t khs = (size_t)(fd + p.dimv), k2hs = (size_t)(p.dimq - fd);
        (void)qoff; (void)voff; (void)ldqk; (void)ldv;
        /* the row indices read afresh, not kept live through the loop */
        uint32_t cx, cy, tx;
        asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(cx));
        asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(cy));
        asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tx));
        const int b2 = (int)cy / p.H, h2 = (int)cy - b2 * p.H, c2 = (int)(tx & 3);
        const int kr2 = (int)cx * BNK + 64 * (int)(tx >> 7) + 16 * (int)((tx >> 5) & 3) + (int)((tx & 31) >> 2);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) { /* wide rows: mt__fa_mla_backward takes 16-byte aligned tensors only */
            const int key = kr2 + 8 * hh;
            const size_t tk = ((size_t)b2 * p.T + key) * p.H + h2;
            store_acc_row<DQ, DQ - 64>(p.dk + tk * khs, key < p.T, p.dimq, true, pq, dk, hh, p.scale, c2, tm.dk2 + tk * k2hs);
            store_acc_row<DV>(p.dv + tk * khs, key < p.T, p.dimv, true, pv, dv, hh, 1.f, c2);
        }
    }
}

template <int DQ, int DV, int VAR = 0, int DSV = 3>
static int launch_dkdv_wg_kernel(const BwdParams &p, int BH, cudaStream_t stream) {
    void (*kern)(const BwdCore, const DkdvMaps) = fa_bwd_dkdv_wg_kernel<DQ, DV, VAR, false, 0>;
    if constexpr (VAR == 0) if (p.ds) kern = fa_bwd_dkdv_wg_kernel<DQ, DV, 0, false, DSV>;
    if constexpr (VAR == 0 && DV == 128) if (p.fold.dn) kern = p.ds ? fa_bwd_dkdv_wg_kernel<DQ, DV, 0, true, DSV>
                                                                      : fa_bwd_dkdv_wg_kernel<DQ, DV, 0, true, 0>;
    if ((VAR != 0 || DV != 128) && p.fold.dn) return -1;
    const size_t smem = dkdv_wg_smem_bytes<DQ, DV>(VAR == 0 && DSV == 3 && p.ds);
    if (BH > 65535 || p.H <= 0) return -1;
    const int B = BH / p.H;
    EncodeTiledFn enc = tma_encoder();
    DkdvMaps tm;
    memset(&tm.dsm, 0, sizeof tm.dsm);
    if (VAR == 0 && DSV == 3 && p.ds && enc && ds_map(enc, &tm.dsm, p.ds, BH, p.ntri)) return -2;
    if (p.fold.dn && (p.dimq != DQ || p.dimv != DV)) return -1;
    tm.dk2 = p.dk2;
    tm.fold_dn = p.fold.dn;
    tm.ds = p.ds;
    tm.ntri = p.ntri;
    if (!enc || qkv_maps(enc, tm, p, B, 64, 128) || fa_map(enc, &tm.dout, p.dout, p.dimv, p.H, p.T, B, 64)) return -2;
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) return -1;
    dim3 grid((unsigned)((p.T + 127) / 128), (unsigned)BH);
    kern<<<grid, 256, smem, stream>>>(p, tm);
    return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

} /* namespace mt_fa */

#endif /* MT_BENCH_KERNEL_VARIANTS_CUH */
