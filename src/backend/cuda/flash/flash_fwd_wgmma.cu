// upipe flash attention forward for Hopper (sm_90a): warpgroup MMA (wgmma),
// FlashAttention-3-style schedule, head dim 128.
//
// One block = 128 query rows of one query head = 2 warpgroups x 64 rows
// (256 threads). Q, and K/V tiles of 128 keys, sit in shared memory in the
// 128-byte-swizzle layout wgmma reads through matrix descriptors: a tile of
// ROWS x 128 bf16 is two column halves (64 bf16 = 128 bytes per row), each
// ROWS x 128 bytes, and 16-byte chunk c of row r sits at chunk c ^ (r & 7).
// - S = Q K^T: both operands from shared memory, K-major (descriptor start
//   advances 32 bytes per k16 step inside a half);
// - O += P V: P from registers (the S accumulator fragment, packed to bf16, is
//   the A fragment), V from shared memory as an MN-major ("transposed") B.
// Per key block j a warpgroup issues S_j = Q K_j^T and O += P_{j-1} V_{j-1}
// back to back, then runs the softmax of S_j while the P V product is still on
// the tensor cores (intra-warpgroup overlap). K/V stream through a WG_STAGES
// ring of shared-memory slots, filled with cp.async:
// - WG_WS=1 (default): warp specialization. A third warpgroup only copies (Q,
//   then K_g and V_{g-1} for every stage g) and gives most of its registers to
//   the two consumer warpgroups (setmaxnreg); after its copies of a stage
//   landed, each copy thread fences them into the async proxy and arrives on
//   the stage's "full" mbarrier; each consumer thread waits on it and, once its
//   wgmmas of the stage are done, arrives on the stage's "empty" mbarrier,
//   which the copy threads wait on before refilling the slot. The two consumer warpgroups take
//   turns issuing their wgmmas (two named barriers, FA3's "ping-pong"), so
//   one's softmax runs while the other's products use the tensor cores.
// - WG_WS=0: all 256 threads copy; one block barrier per stage publishes it.

#define WG_BM 128
#define WG_BN 128
#define WG_NT 256
#define WG_MAX_STAGES 3
#ifndef WG_WS
#define WG_WS 1
#endif
#ifndef WG_STAGES
#if WG_WS
#define WG_STAGES 3
#else
#define WG_STAGES 2
#endif
#endif
// WG_LATE_RESCALE=1: O is rescaled by the previous block's factor right before
// the next P V product is issued (while S runs on the tensor cores), not
// between the P V wait and the next step (off the critical path, as FA3).
#ifndef WG_LATE_RESCALE
#define WG_LATE_RESCALE 1
#endif
#if WG_WS
#define WG_THREADS (WG_NT + 128)
#define WG_PRODUCER_REGS 72
#define WG_CONSUMER_REGS 216
#else
#define WG_THREADS WG_NT
#endif
static_assert(WG_STAGES >= 2 && WG_STAGES <= WG_MAX_STAGES, "WG_STAGES: 2 ..= WG_MAX_STAGES");

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` of the mbarrier has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nWG_MBAR_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WG_MBAR_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// Keeps the compiler from moving accesses of wgmma accumulators across the
// (register-less) wait instructions.
__device__ __forceinline__ void wg_pin(float (&x)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(x[i])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle.
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)((lbo & 0x3FFFFu) >> 4) << 16) |
           ((u64)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

#define WG_ACC8(b)                                                                                     \
    "+f"(d[b + 0]), "+f"(d[b + 1]), "+f"(d[b + 2]), "+f"(d[b + 3]), "+f"(d[b + 4]), "+f"(d[b + 5]), \
        "+f"(d[b + 6]), "+f"(d[b + 7])
#define WG_ACC64 \
    WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24), WG_ACC8(32), WG_ACC8(40), WG_ACC8(48), WG_ACC8(56)
#define WG_D64                                                                              \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "              \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "     \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "     \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64x128 f32) (+)= A (64x16, shared, K-major) * B (16x128, shared, K-major).
__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 da, u64 db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC64
        : "l"(da), "l"(db), "r"(accumulate));
}

// d (64x128 f32) += A (64x16, registers) * B (16x128, shared, MN-major).
__device__ __forceinline__ void wgmma_rs(float (&d)[64], u32 a0, u32 a1, u32 a2, u32 a3, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_D64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : WG_ACC64
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(1));
}

// Byte offset of (row, 16-byte chunk 0..15) in a ROWS x 128 bf16 swizzled tile.
template <int ROWS>
__device__ __forceinline__ u32 wg_off(int r, int c) {
    return (u32)((c >> 3) * ROWS * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Async load of rows [row0, row0 + ROWS) of a strided bf16 matrix (128 per
// row) into a swizzled tile by NT threads; rows >= nrows are zero-filled.
template <int ROWS, int NT = WG_NT>
__device__ __forceinline__ void wg_load_tile(u32 s_base, const bf16_t* g, i64 stride, int row0, int nrows,
                                             int tid) {
#pragma unroll 8
    for (int i = tid; i < ROWS * 16; i += NT) {
        const int r = i >> 4, c = i & 15;
        const int gr = row0 + r;
        const bool ok = gr < nrows;
        const bf16_t* src = ok ? g + (i64)gr * stride + c * 8 : g;
        cp_async16(s_base + wg_off<ROWS>(r, c), src, ok ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1) upipe_flash_fwd_wgmma_d128(const FlashFwdParams p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    constexpr int BM = WG_BM, BN = WG_BN, D = 128, ST = WG_STAGES;
    constexpr u32 KV_TILE = BN * D * 2;

    const int n_mblocks = (p.sq + BM - 1) / BM;
    const int h = blockIdx.x % p.hq;
    const int m_block = n_mblocks - 1 - (int)(blockIdx.x / p.hq);
    const int kh = h / p.group;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int m0 = m_block * BM;

    // The swizzle pattern repeats every 1024 bytes: align the tiles to it.
    const u32 base = (smem_addr(smem) + 1023u) & ~1023u;
    const u32 sQ = base;
    const u32 sK = sQ + BM * D * 2;
    const u32 sV = sK + ST * KV_TILE;

    const bf16_t* gq = (const bf16_t*)p.q + (i64)h * D;
    const bf16_t* gk = (const bf16_t*)p.k + (i64)kh * D;
    const bf16_t* gv = (const bf16_t*)p.v + (i64)kh * D;

    // Key blocks kv0 / BN .. of the tile, n_blocks of them: from its first
    // visible key to its last (`RowBounds` for a documents mask).
    const RowBounds rb{(const int*)p.bounds, p.sq};
    int kv_begin = 0, kv_end = p.causal ? min(p.sk, m0 + BM) : p.sk;
    if (rb.on()) {
        kv_begin = rb.lo(m0);
        kv_end = rb.hi(min(m0 + BM, p.sq) - 1);
    }
    const int kv0 = kv_begin / BN * BN;
    const int n_blocks = (kv_end + BN - 1) / BN - kv0 / BN;
    if (n_blocks <= 0) {
        // no row of the tile sees a key (a ring block of other documents)
        for (int i = tid; i < BM; i += blockDim.x) {
            const int gr = m0 + i;
            if (gr >= p.sq) continue;
            bf16_t* orow = (bf16_t*)p.o + (i64)gr * p.o_stride + (i64)h * D;
            for (int c = 0; c < D; ++c) orow[c] = 0;
            ((float*)p.lse)[(i64)gr * p.lse_stride + h] = FL_NEG_INF;
        }
        return;
    }

#if WG_WS
    // Stage g (g = 0 ..= n_blocks) = K_g and V_{g-1} in slot g % ST (plus Q in stage 0).
    const u32 bar_full = sV + ST * KV_TILE, bar_empty = bar_full + 8 * ST;
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < ST; ++i) {
            mbar_init(bar_full + 8 * i, 128);
            mbar_init(bar_empty + 8 * i, WG_NT);
        }
    }
    __syncthreads();
    if (tid >= WG_NT) {
        // The copy warpgroup.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WG_PRODUCER_REGS));
        const int pl = tid - WG_NT;
        for (int g = 0; g <= n_blocks; ++g) {
            const int slot = g % ST;
            if (g >= ST) mbar_wait(bar_empty + 8 * slot, ((g / ST) - 1) & 1);
            if (g == 0) wg_load_tile<BM, 128>(sQ, gq, p.q_stride, m0, p.sq, pl);
            if (g < n_blocks) wg_load_tile<BN, 128>(sK + (u32)slot * KV_TILE, gk, p.k_stride, kv0 + g * BN, p.sk, pl);
            if (g >= 1) wg_load_tile<BN, 128>(sV + (u32)slot * KV_TILE, gv, p.v_stride, kv0 + (g - 1) * BN, p.sk, pl);
            cp_async_commit();
            if (g >= 1) {
                // Stage g - 1 landed: hand it to the async proxy, then to the consumers.
                cp_async_wait<1>();
                fence_proxy_async();
                mbar_arrive(bar_full + 8 * ((g - 1) % ST));
            }
        }
        cp_async_wait<0>();
        fence_proxy_async();
        mbar_arrive(bar_full + 8 * (n_blocks % ST));
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WG_CONSUMER_REGS));
#else
    // Copy group g holds K_g and V_{g-1}; groups 0 .. ST-2 are in flight
    // before the loop, group j + ST - 1 is issued at the top of iteration j.
    auto load_group = [&](int g) {
        if (g < n_blocks) wg_load_tile<BN>(sK + (u32)(g % ST) * KV_TILE, gk, p.k_stride, kv0 + g * BN, p.sk, tid);
        if (g >= 1 && g <= n_blocks)
            wg_load_tile<BN>(sV + (u32)((g - 1) % ST) * KV_TILE, gv, p.v_stride, kv0 + (g - 1) * BN, p.sk, tid);
        cp_async_commit();
    };
    wg_load_tile<BM>(sQ, gq, p.q_stride, m0, p.sq, tid);
#pragma unroll
    for (int g = 0; g < ST - 1; ++g) load_group(g);
#endif

    float o[64], s[64];
    u32 pf[32];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        o[i] = 0.f;
        s[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) pf[i] = 0u;
    float row_max[2] = {FL_NEG_INF, FL_NEG_INF}, row_sum[2] = {0.f, 0.f};

    const int wg_row0 = m0 + wg * 64;
    const int row_lo = wg_row0 + warp * 16 + (lane >> 2);  // this thread's rows: row_lo, row_lo + 8
    // their key bounds under a documents mask
    int rlo[2] = {0, 0}, rhi[2] = {0, 0};
    if (rb.on()) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (row_lo + r * 8 < p.sq) {
                rlo[r] = rb.lo(row_lo + r * 8);
                rhi[r] = rb.hi(row_lo + r * 8);
            }
    }
    const int lo_max = max(rlo[0], rlo[1]), hi_min = min(rhi[0], rhi[1]);
    const u32 sQw = sQ + (u32)wg * 64 * 128;                 // this warpgroup's 64 rows in each half

#if WG_WS
    // Top of step j: wait for stage j, then for this warpgroup's turn on the tensor cores.
    auto step_top = [&](int j) {
        mbar_wait(bar_full + 8 * (j % ST), (j / ST) & 1);
        fence_proxy_async();
        named_bar_sync(1 + wg, 2 * 128);
    };
    // After issuing: the other warpgroup's turn (warpgroup 1 skips its last
    // hand-over, so every named-barrier phase completes).
    auto step_issued = [&](bool last) {
        if (!(last && wg == 1)) named_bar_arrive(2 - wg, 2 * 128);
    };
    // After the wgmmas of step j are done: slot j % ST may be refilled.
    auto step_done = [&](int j) { mbar_arrive(bar_empty + 8 * (j % ST)); };
    auto v_slot = [&](int j) { return j % ST; };
    if (wg == 1) named_bar_arrive(1, 2 * 128);  // warpgroup 0 goes first
#else
    // Top of step j: publish copy group j (K_j, V_{j-1}) to every warp and the
    // async proxy, then start group j + ST - 1 into the slots freed by step j - 1.
    auto step_top = [&](int j) {
        cp_async_wait<ST - 2>();
        fence_proxy_async();
        __syncthreads();
        load_group(j + ST - 1);
    };
    auto step_issued = [&](bool) {};
    auto step_done = [&](int) {};
    auto v_slot = [&](int j) { return (j - 1) % ST; };
#endif
    // S = Q K_j^T (one commit group).
    auto issue_s = [&](int j) {
        const u32 kb = sK + (u32)(j % ST) * KV_TILE;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const u64 da = wg_desc(sQw + (kk >> 2) * BM * 128 + (kk & 3) * 32, 16, 1024);
            const u64 db = wg_desc(kb + (kk >> 2) * BN * 128 + (kk & 3) * 32, 16, 1024);
            wgmma_ss(s, da, db, kk);
        }
        wg_commit();
    };
    // O += P V_{j-1} (one commit group).
    auto issue_pv = [&](int j) {
        const u32 vb = sV + (u32)v_slot(j) * KV_TILE;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#ifdef WG_V_SWAP
            const u64 db = wg_desc(vb + kk * 16 * 128, 1024, BN * 128);
#else
            // MN-major: LBO = the next 64 head-dim columns, SBO = the next 8 keys.
            const u64 db = wg_desc(vb + kk * 16 * 128, BN * 128, 1024);
#endif
            wgmma_rs(o, pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2], pf[4 * kk + 3], db);
        }
        wg_commit();
    };
    // Mask and exponentiate S_j in place; alpha rescales the old O and row sums.
    float alpha[2], bsum[2];
    auto softmax = [&](int j) {
        const int n0 = kv0 + j * BN;
        const bool need_mask = (n0 + BN > p.sk) || (p.causal && n0 + BN - 1 > wg_row0) ||
                               (rb.on() && (n0 < lo_max || n0 + BN > hi_min));
        if (need_mask) {
#pragma unroll
            for (int t = 0; t < BN / 8; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int gr = row_lo + ((e >> 1) << 3);
                    const int gc = n0 + t * 8 + ((lane & 3) << 1) + (e & 1);
                    const bool hidden = rb.on() && (gc < rlo[e >> 1] || gc >= rhi[e >> 1]);
                    if (gc >= p.sk || (p.causal && gc > gr) || hidden) s[t * 4 + e] = FL_NEG_INF;
                }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            // max of the raw scores (4 independent chains), scaled once (scale > 0)
            float m4[4] = {FL_NEG_INF, FL_NEG_INF, FL_NEG_INF, FL_NEG_INF};
#pragma unroll
            for (int t = 0; t < BN / 8; ++t)
                m4[t & 3] = fmaxf(m4[t & 3], fmaxf(s[t * 4 + 2 * r], s[t * 4 + 2 * r + 1]));
            float mr = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
            mr = fmaxf(mr, __shfl_xor_sync(0xffffffffu, mr, 1));
            mr = fmaxf(mr, __shfl_xor_sync(0xffffffffu, mr, 2));
            const float mx = fmaxf(row_max[r], mr * p.scale_log2);
            const float m_use = (mx == FL_NEG_INF) ? 0.f : mx;
            alpha[r] = fast_exp2(row_max[r] - m_use);
            row_max[r] = mx;
            float sum4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int t = 0; t < BN / 8; ++t) {
                const float p0 = fast_exp2(fmaf(s[t * 4 + 2 * r], p.scale_log2, -m_use));
                const float p1 = fast_exp2(fmaf(s[t * 4 + 2 * r + 1], p.scale_log2, -m_use));
                s[t * 4 + 2 * r] = p0;
                s[t * 4 + 2 * r + 1] = p1;
                sum4[t & 3] += p0 + p1;
            }
            bsum[r] = (sum4[0] + sum4[1]) + (sum4[2] + sum4[3]);
        }
    };
    auto rescale_o = [&]() {
#pragma unroll
        for (int t = 0; t < D / 8; ++t) {
            o[t * 4 + 0] *= alpha[0];
            o[t * 4 + 1] *= alpha[0];
            o[t * 4 + 2] *= alpha[1];
            o[t * 4 + 3] *= alpha[1];
        }
    };
    // After the P V product in flight is done: row sums, P_j (bf16 A fragments)
    // and, without WG_LATE_RESCALE, the O rescale.
    auto rescale_pack = [&]() {
#pragma unroll
        for (int r = 0; r < 2; ++r) row_sum[r] = row_sum[r] * alpha[r] + bsum[r];
#if !WG_LATE_RESCALE
        rescale_o();
#endif
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            pf[4 * kk + 0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
            pf[4 * kk + 1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
            pf[4 * kk + 2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
            pf[4 * kk + 3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };

    // Step 0: S_0 alone.
    step_top(0);
    wg_fence();
    issue_s(0);
    step_issued(false);
    wg_wait<0>();
    wg_pin(s);
    softmax(0);
    step_done(0);
    rescale_pack();
    // Steady state: S_j and P_{j-1} V_{j-1} on the tensor cores, softmax of S_j
    // overlapping the P V product.
    for (int j = 1; j < n_blocks; ++j) {
        step_top(j);
        wg_fence();
        issue_s(j);
#if WG_LATE_RESCALE
        rescale_o();  // by alpha of block j - 1, before P_{j-1} V_{j-1} adds to O
        wg_fence();
#endif
        issue_pv(j);
        step_issued(false);
        wg_wait<1>();
        wg_pin(s);
        softmax(j);
        wg_wait<0>();
        wg_pin(o);
        step_done(j);
        rescale_pack();
    }
    // Last step: P_{n-1} V_{n-1}.
    step_top(n_blocks);
#if WG_LATE_RESCALE
    rescale_o();
#endif
    wg_fence();
    issue_pv(n_blocks);
    step_issued(true);
    wg_wait<0>();
    wg_pin(o);

    // Epilogue: normalize, write O (bf16) and LSE (natural log).
    bf16_t* go = (bf16_t*)p.o + (i64)h * D;
    float* glse = (float*)p.lse + h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = row_sum[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int gr = row_lo + r * 8;
        if (gr < p.sq) {
            bf16_t* orow = go + (i64)gr * p.o_stride;
#pragma unroll
            for (int t = 0; t < D / 8; ++t) {
                const int c = t * 8 + ((lane & 3) << 1);
                *(u32*)(orow + c) = pack_bf16(o[t * 4 + 2 * r] * inv, o[t * 4 + 2 * r + 1] * inv);
            }
            if ((lane & 3) == 0) {
                const float lse = l > 0.f ? (row_max[r] + fast_log2(l)) * FL_LN2 : FL_NEG_INF;
                glse[(i64)gr * p.lse_stride] = lse;
            }
        }
    }
}
