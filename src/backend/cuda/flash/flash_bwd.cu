// upipe flash attention backward (FlashAttention-2 schedule, mma.sync m16n8k16 bf16).
//
// Preprocess: delta[i, h] = sum_d dO[i, h, d] * O[i, h, d]  (f32 workspace [sq, hq]).
// Main: one block = 128 keys of one kv head (64 at head dim 256, whose tiles
// would not fit the shared memory at 128; 8 warps); it loops over the group's
// query heads and all query blocks of 64 rows, keeping dK and dV for its keys in
// registers and adding dQ into the f32 output with vector reductions (no dQ
// workspace, no conversion pass). Q/dO/LSE/delta tiles are double-buffered with
// cp.async; P and dS pass through shared memory.

// FlashBwdParams: flash_common.cuh (shared with the wgmma backward).

// Tuning knobs (compile-time; the defaults are the measured best).
#ifndef BWD_HEADS_FASTEST
#define BWD_HEADS_FASTEST 1
#endif

#define BWD_BM 64
#define BWD_BN 128
#define BWD_BN_D256 64
#define BWD_NT 256

// One warp per (row, head): delta = <dO, O> in f32.
template <int D>
__device__ __forceinline__ void flash_bwd_pre_impl(const FlashBwdParams& p) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= p.sq * p.hq) return;
    const int i = warp / p.hq, h = warp % p.hq;
    const bf16_t* o = (const bf16_t*)p.o + (i64)i * p.o_stride + (i64)h * D;
    const bf16_t* d_o = (const bf16_t*)p.d_o + (i64)i * p.do_stride + (i64)h * D;
    float acc = 0.f;
#pragma unroll
    for (int c = lane * 2; c < D; c += 64) {
        u32 ov = *(const u32*)(o + c);
        u32 dv = *(const u32*)(d_o + c);
        acc += bf16_to_f32((bf16_t)(ov & 0xffff)) * bf16_to_f32((bf16_t)(dv & 0xffff));
        acc += bf16_to_f32((bf16_t)(ov >> 16)) * bf16_to_f32((bf16_t)(dv >> 16));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) ((float*)p.delta)[(i64)i * p.hq + h] = acc;
}

// Main kernel, BN keys a block. Warp layouts as in FlashAttention-2: S and dP
// are 32 x BN/4 warp tiles (2 query x 4 key warps), P and dS go through shared
// memory, dK/dV are 32-key x D/DSPLIT warp tiles (BN/32 x DSPLIT, DSPLIT =
// 256/BN: 4 x 2 at BN 128, 2 x 4 at BN 64, so a warp's dK and dV accumulators
// stay at 2 x 64 f32 a thread for head dim 256) and dQ 32-query x D/4 tiles
// (2 x 4). Measured
// on H200 (d=128, causal): 251-265 TFLOP/s, against 216-225 for a layout where
// each warp owns 16 keys and keeps P^T/dS^T in registers (more shared-memory
// bytes per flop).
template <int D, int BN>
__device__ __forceinline__ void flash_bwd_impl(const FlashBwdParams& p) {
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int BM = BWD_BM, NT = BWD_NT;
    constexpr int NTD = D / 8;
    constexpr int KW = BN / 32;        // n8 key tiles of a phase-1 warp (BN / 4 keys)
    constexpr int DSPLIT = 256 / BN;   // phase 2: warps across the head dim
    constexpr int NTDW = NTD / DSPLIT;  // phase 2: n8 head-dim tiles of a warp
    static_assert((BN / 32) * DSPLIT == NT / 32 && (DSPLIT == 2 || DSPLIT == 4), "phase-2 warps must cover the block");

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
#if BWD_HEADS_FASTEST
    const int kh = blockIdx.x % p.hkv;
    const int n_block = blockIdx.x / p.hkv;
#else
    const int n_kblocks = (p.sk + BN - 1) / BN;
    const int kh = blockIdx.x / n_kblocks;
    const int n_block = blockIdx.x % n_kblocks;
#endif
    const int n0 = n_block * BN;

    const u32 sK = smem_addr(smem);
    const u32 sV = sK + BN * D * 2;
    const u32 sQ = sV + BN * D * 2;        // 2 buffers
    const u32 sdO = sQ + 2 * BM * D * 2;   // 2 buffers
    const u32 sP = sdO + 2 * BM * D * 2;   // [BM queries][BN keys] bf16, swizzled
    const u32 sdS = sP + BM * BN * 2;      // same shape
    float* sLse = (float*)(smem + (2 * BN * D + 4 * BM * D + 2 * BN * BM) * 2);  // [2][BM]
    float* sDelta = sLse + 2 * BM;                                              // [2][BM]

    const bf16_t* gk = (const bf16_t*)p.k + (i64)kh * D;
    const bf16_t* gv = (const bf16_t*)p.v + (i64)kh * D;

    // Query blocks m_begin .. m_end: those with a row that sees one of these keys.
    const RowBounds rb{(const int*)p.bounds, p.sq};
    int m_begin = p.causal ? (n0 / BM) : 0;
    int m_end = (p.sq + BM - 1) / BM;
    if (rb.on()) {
        m_begin = rb.first_row_ending_after(n0) / BM;
        m_end = (rb.first_row_starting_at(min(n0 + BN, p.sk)) + BM - 1) / BM;
    }
    const int n_m = max(m_end - m_begin, 0);
    const int total = n_m * p.group;

    // Phase-2 ownership: keys wk*32.., head-dim part wd of DSPLIT.
    constexpr int DSHIFT = DSPLIT == 4 ? 2 : 1;  // log2(DSPLIT)
    const int wk = warp >> DSHIFT, wd = warp & (DSPLIT - 1);
    float acc_dk[2][NTDW][4], acc_dv[2][NTDW][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < NTDW; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc_dk[mt][j][e] = 0.f;
                acc_dv[mt][j][e] = 0.f;
            }

    load_tile<BN, D, NT>(sK, gk, p.k_stride, n0, p.sk, tid);
    load_tile<BN, D, NT>(sV, gv, p.v_stride, n0, p.sk, tid);

    auto issue = [&](int it, int buf) {
        const int h = kh * p.group + it / n_m;
        const int m0 = (m_begin + it % n_m) * BM;
        load_tile<BM, D, NT>(sQ + buf * BM * D * 2, (const bf16_t*)p.q + (i64)h * D, p.q_stride, m0, p.sq, tid);
        load_tile<BM, D, NT>(sdO + buf * BM * D * 2, (const bf16_t*)p.d_o + (i64)h * D, p.do_stride, m0, p.sq, tid);
        for (int i = tid; i < BM; i += NT) {
            const int r = m0 + i;
            const bool ok = r < p.sq;
            const float* gl = (const float*)p.lse + (ok ? (i64)r * p.lse_stride + h : 0);
            const float* gd = (const float*)p.delta + (ok ? (i64)r * p.hq + h : 0);
            cp_async4(smem_addr(sLse + buf * BM + i), gl, ok ? 4 : 0);
            cp_async4(smem_addr(sDelta + buf * BM + i), gd, ok ? 4 : 0);
        }
    };
    if (total > 0) issue(0, 0);
    cp_async_commit();

    for (int it = 0; it < total; ++it) {
        const int buf = it & 1;
        const int h = kh * p.group + it / n_m;
        const int m0 = (m_begin + it % n_m) * BM;
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < total) {
            issue(it + 1, buf ^ 1);
            cp_async_commit();
        }
        const u32 sQb = sQ + buf * BM * D * 2;
        const u32 sdOb = sdO + buf * BM * D * 2;
        const float* lse = sLse + buf * BM;
        const float* dlt = sDelta + buf * BM;

        // Phase 1: S = Q K^T and dP = dO V^T on 32 queries x BN/4 keys per warp.
        {
            const int wm = warp & 1, wn = warp >> 1;
            float s[2][KW][4], dp[2][KW][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int j = 0; j < KW; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[mt][j][e] = 0.f;
                        dp[mt][j][e] = 0.f;
                    }
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 a[2][4], c[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    ldsm_x4(a[mt], sQb + tile_off<D>(wm * 32 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
                    ldsm_x4(c[mt], sdOb + tile_off<D>(wm * 32 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
                }
#pragma unroll
                for (int j2 = 0; j2 < KW / 2; ++j2) {
                    u32 b[4], bv[4];
                    const int kr = wn * (BN / 4) + j2 * 16 + ((lane >> 4) << 3) + (lane & 7);
                    ldsm_x4(b, sK + tile_off<D>(kr, kk * 2 + ((lane >> 3) & 1)));
                    ldsm_x4(bv, sV + tile_off<D>(kr, kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        mma_bf16(s[mt][2 * j2], a[mt], b[0], b[1]);
                        mma_bf16(s[mt][2 * j2 + 1], a[mt], b[2], b[3]);
                        mma_bf16(dp[mt][2 * j2], c[mt], bv[0], bv[1]);
                        mma_bf16(dp[mt][2 * j2 + 1], c[mt], bv[2], bv[3]);
                    }
                }
            }
            const int m_last = min(m0 + BM, p.sq) - 1;
            const bool need_mask = (p.causal && m0 < n0 + BN) || (n0 + BN > p.sk) ||  // query tails: see issue()
                                   (rb.on() && (m0 + BM > p.sq || rb.lo(m_last) > n0 || rb.hi(m0) < n0 + BN));
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int qr = wm * 32 + mt * 16 + (lane >> 2) + r * 8;  // within the block
                    const float l2 = lse[qr] * FL_LOG2E;
                    const float dl = dlt[qr];
#pragma unroll
                    for (int j = 0; j < KW; ++j) {
                        const int kc = wn * (BN / 4) + j * 8 + ((lane & 3) << 1);  // within the block
                        float p0 = fast_exp2(s[mt][j][2 * r] * p.scale_log2 - l2);
                        float p1 = fast_exp2(s[mt][j][2 * r + 1] * p.scale_log2 - l2);
                        if (need_mask) {
                            const int gq = m0 + qr, gk0 = n0 + kc;
                            const bool out = rb.on() && gq >= p.sq;
                            if (gk0 >= p.sk || (p.causal && gk0 > gq) || out || (rb.on() && rb.hides(gq, gk0)))
                                p0 = 0.f;
                            if (gk0 + 1 >= p.sk || (p.causal && gk0 + 1 > gq) || out ||
                                (rb.on() && rb.hides(gq, gk0 + 1)))
                                p1 = 0.f;
                        }
                        const float d0 = p0 * (dp[mt][j][2 * r] - dl) * p.scale;
                        const float d1 = p1 * (dp[mt][j][2 * r + 1] - dl) * p.scale;
                        const u32 off = (u32)(qr * (BN * 2) + (((kc >> 3) ^ (qr & 7)) << 4) + ((kc & 7) << 1));
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + off), "r"(pack_bf16(p0, p1)));
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + off), "r"(pack_bf16(d0, d1)));
                    }
                }
        }
        __syncthreads();

        // Phase 2: dV += P^T dO, dK += dS^T Q on 32 keys x D/DSPLIT per warp.
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            u32 ap[2][4], as[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const int qrow = kk * 16 + ((lane >> 4) << 3) + (lane & 7);
                const int kch = (wk * 32 + mt * 16) / 8 + ((lane >> 3) & 1);
                const u32 off = (u32)(qrow * (BN * 2) + ((kch ^ (qrow & 7)) << 4));
                ldsm_x4_t(ap[mt], sP + off);
                ldsm_x4_t(as[mt], sdS + off);
            }
#pragma unroll
            for (int j2 = 0; j2 < NTDW / 2; ++j2) {
                u32 bo[4], bq[4];
                const int row = kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
                const int ch = wd * NTDW + j2 * 2 + (lane >> 4);
                ldsm_x4_t(bo, sdOb + tile_off<D>(row, ch));
                ldsm_x4_t(bq, sQb + tile_off<D>(row, ch));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    mma_bf16(acc_dv[mt][2 * j2], ap[mt], bo[0], bo[1]);
                    mma_bf16(acc_dv[mt][2 * j2 + 1], ap[mt], bo[2], bo[3]);
                    mma_bf16(acc_dk[mt][2 * j2], as[mt], bq[0], bq[1]);
                    mma_bf16(acc_dk[mt][2 * j2 + 1], as[mt], bq[2], bq[3]);
                }
            }
        }

        // Phase 3: dQ += dS K on 32 queries x D/4 per warp.
        {
            const int wq = warp & 1, w4 = warp >> 1;
            float dq[2][NTD / 4][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int j = 0; j < NTD / 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) dq[mt][j][e] = 0.f;
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                u32 a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
                    ldsm_x4(a[mt], sdS + tile_off<BN>(wq * 32 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
                for (int j2 = 0; j2 < NTD / 8; ++j2) {
                    u32 b[4];
                    ldsm_x4_t(b, sK + tile_off<D>(kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7),
                                                  w4 * (NTD / 4) + j2 * 2 + (lane >> 4)));
#pragma unroll
                    for (int mt = 0; mt < 2; ++mt) {
                        mma_bf16(dq[mt][2 * j2], a[mt], b[0], b[1]);
                        mma_bf16(dq[mt][2 * j2 + 1], a[mt], b[2], b[3]);
                    }
                }
            }
            float* gdq = (float*)p.dq + (i64)h * D + w4 * (D / 4) + ((lane & 3) << 1);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int qr = m0 + wq * 32 + mt * 16 + (lane >> 2) + r * 8;
                    if (qr < p.sq) {
                        float* row = gdq + (i64)qr * p.dq_stride;
#pragma unroll
                        for (int j = 0; j < NTD / 4; ++j) red_add_v2(row + j * 8, dq[mt][j][2 * r], dq[mt][j][2 * r + 1]);
                    }
                }
        }
    }

    // dK, dV += (no other block touches these rows of this kv head).
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int kr = n0 + wk * 32 + mt * 16 + (lane >> 2) + r * 8;
            if (kr < p.sk) {
                const int c0 = wd * (D / DSPLIT) + ((lane & 3) << 1);
                float* dkr = (float*)p.dk + (i64)kr * p.dk_stride + (i64)kh * D + c0;
                float* dvr = (float*)p.dv + (i64)kr * p.dv_stride + (i64)kh * D + c0;
#pragma unroll
                for (int j = 0; j < NTDW; ++j) {
                    float2 a = *(float2*)(dkr + j * 8);
                    a.x += acc_dk[mt][j][2 * r];
                    a.y += acc_dk[mt][j][2 * r + 1];
                    *(float2*)(dkr + j * 8) = a;
                    float2 b = *(float2*)(dvr + j * 8);
                    b.x += acc_dv[mt][j][2 * r];
                    b.y += acc_dv[mt][j][2 * r + 1];
                    *(float2*)(dvr + j * 8) = b;
                }
            }
        }
}

extern "C" __global__ void upipe_flash_bwd_pre_d64(const FlashBwdParams p) { flash_bwd_pre_impl<64>(p); }
extern "C" __global__ void upipe_flash_bwd_pre_d128(const FlashBwdParams p) { flash_bwd_pre_impl<128>(p); }
extern "C" __global__ void upipe_flash_bwd_pre_d256(const FlashBwdParams p) { flash_bwd_pre_impl<256>(p); }
extern "C" __global__ void __launch_bounds__(BWD_NT, 1) upipe_flash_bwd_d64(const FlashBwdParams p) {
    flash_bwd_impl<64, BWD_BN>(p);
}
extern "C" __global__ void __launch_bounds__(BWD_NT, 1) upipe_flash_bwd_d128(const FlashBwdParams p) {
    flash_bwd_impl<128, BWD_BN>(p);
}
extern "C" __global__ void __launch_bounds__(BWD_NT, 1) upipe_flash_bwd_d256(const FlashBwdParams p) {
    flash_bwd_impl<256, BWD_BN_D256>(p);
}
