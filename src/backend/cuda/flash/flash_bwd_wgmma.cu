// upipe flash attention backward for Hopper (sm_90a): warpgroup MMA (wgmma),
// FlashAttention-3-style schedule, head dim 128. Appended to the wgmma forward
// source (it reuses that file's wgmma / mbarrier / descriptor helpers) and
// compiled as its own module; the preprocessing kernel delta = rowsum(dO * O)
// stays in the mma.sync module.
//
// One block = 128 keys of one kv head = 2 consumer warpgroups x 64 keys, plus
// a copy warpgroup. The block loops over the group's query heads and all query
// blocks of WB_BM = 64 rows (causal: from the block holding its first key on).
// The copy warpgroup fills a WB_STAGES ring of (Q, dO, lse, delta) slots with
// cp.async ("full" / "empty" mbarriers as in the forward; K and V ride along
// with slot 0 of the first step). Per query block each consumer warpgroup w:
//   S^T  = K_w Q^T        (m64n64, both K-major from shared memory)
//   dP^T = V_w dO^T       (m64n64, both K-major from shared memory)
//   P^T  = exp2(S^T * scale*log2e - lse*log2e), masked; dS^T = P^T (dP^T - delta) * scale
//   dV_w += P^T dO        (m64n128, P^T from registers, dO an MN-major B)
//   dK_w += dS^T Q        (m64n128, dS^T from registers, Q an MN-major B)
//   dS^T -> shared memory (rows = keys, 64 queries per 128-byte row), then
//   after a named barrier of both warpgroups:
//   dQ[:, 64w .. 64w+64] = dS K[:, 64w ..]  (m64n64, dS an MN-major A, K an
//   MN-major B) added into the f32 dQ with vector red.global.add.
// dS is double-buffered in shared memory: a warpgroup rewrites its half of
// buffer b two steps later, after the barrier of the step in between, which
// the other warpgroup only reaches once its dQ product of buffer b is done.
// dK and dV stay in registers (64 + 64 f32 per thread) and are added into the
// f32 outputs at the end (no other block touches these rows).

#define WB_BM 64
#define WB_BN 128
#define WB_NT 256
#define WB_MAX_STAGES 3
#ifndef WB_STAGES
#define WB_STAGES 3
#endif
#define WB_THREADS (WB_NT + 128)
#ifndef WB_PRODUCER_REGS
#define WB_PRODUCER_REGS 40
#endif
#ifndef WB_CONSUMER_REGS
#define WB_CONSUMER_REGS 232
#endif
static_assert(WB_STAGES >= 2 && WB_STAGES <= WB_MAX_STAGES, "WB_STAGES: 2 ..= WB_MAX_STAGES");
// setmaxnreg moves registers within the block's launch allocation: 168 per
// thread for 384 threads (65536 / 384 rounded down to a multiple of 8).
static_assert(WB_PRODUCER_REGS * 128 + WB_CONSUMER_REGS * WB_NT <= 168 * WB_THREADS, "register budget");
static_assert(WB_PRODUCER_REGS % 8 == 0 && WB_CONSUMER_REGS % 8 == 0, "setmaxnreg takes multiples of 8");

#define WB_ACC32 WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24)
#define WB_D32                                                                          \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "          \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

#define WB_OUT8(b)                                                                                     \
    "=f"(d[b + 0]), "=f"(d[b + 1]), "=f"(d[b + 2]), "=f"(d[b + 3]), "=f"(d[b + 4]), "=f"(d[b + 5]), \
        "=f"(d[b + 6]), "=f"(d[b + 7])
#define WB_OUT32 WB_OUT8(0), WB_OUT8(8), WB_OUT8(16), WB_OUT8(24)

// d (64x64 f32) = A (64x16, shared) * B (16x64, shared) (ACC = 0: d is
// overwritten and not an input, so it is not live before the product) or
// d += A * B (ACC = 1). TA / TB = 1: that operand is MN-major ("transposed").
template <int ACC, int TA, int TB>
__device__ __forceinline__ void wb_mma_ss64(float (&d)[32], u64 da, u64 db) {
    if (ACC) {
        asm volatile(
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WB_D32 ", %32, %33, 1, 1, 1, %34, %35;\n"
            : WB_ACC32
            : "l"(da), "l"(db), "n"(TA), "n"(TB));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WB_D32 ", %32, %33, p, 1, 1, %34, %35;\n}\n"
            : WB_OUT32
            : "l"(da), "l"(db), "n"(TA), "n"(TB));
    }
}

// The 8 k16 steps of a product with K = 128 as one unrolled chain, starting from d = 0.
template <int TA, int TB, typename FA, typename FB>
__device__ __forceinline__ void wb_gemm8(float (&d)[32], FA desc_a, FB desc_b) {
    wb_mma_ss64<0, TA, TB>(d, desc_a(0), desc_b(0));
#pragma unroll
    for (int kk = 1; kk < 8; ++kk) wb_mma_ss64<1, TA, TB>(d, desc_a(kk), desc_b(kk));
}

__device__ __forceinline__ void wb_pin32(float (&x)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(x[i])::"memory");
}

// Copy-warpgroup load of rows [row0, row0 + ROWS) of a strided bf16 matrix
// (128 per row) into a swizzled tile (the layout of wg_load_tile); rows >=
// nrows are zero-filled. Thread pl always moves 16-byte chunk pl % 16 of rows
// pl / 16 + 8 j, so its swizzled column is fixed and few registers are live.
template <int ROWS>
__device__ __forceinline__ void wb_load_rows(u32 s_base, const bf16_t* g, i64 stride, int row0, int nrows, int pl) {
    const int c = pl & 15, r0 = pl >> 4;
    u32 dst = s_base + (u32)((c >> 3) * ROWS * 128 + r0 * 128 + (((c & 7) ^ r0) << 4));
    const bf16_t* src = g + (i64)(row0 + r0) * stride + c * 8;
    const i64 step = 8 * stride;
#pragma unroll 4
    for (int j = 0; j < ROWS / 8; ++j) {
        const bool ok = row0 + r0 + 8 * j < nrows;
        cp_async16(dst, ok ? src : g, ok ? 16 : 0);
        dst += 8 * 128;
        src += step;
    }
}

extern "C" __global__ void __launch_bounds__(WB_THREADS, 1) upipe_flash_bwd_wgmma_d128(const FlashBwdParams p) {
    extern __shared__ __align__(1024) unsigned char smem[];
    constexpr int BM = WB_BM, BN = WB_BN, D = 128, ST = WB_STAGES;
    constexpr u32 KV_TILE = BN * D * 2;  // 32 KiB: two halves of BN rows x 128 bytes
    constexpr u32 QD_TILE = BM * D * 2;  // 16 KiB: two halves of BM rows x 128 bytes
    constexpr u32 DS_TILE = BN * BM * 2; // 16 KiB: BN rows (keys) x 64 queries

    const int tid = threadIdx.x;
    const int kh = blockIdx.x % p.hkv;
    const int n0 = (int)(blockIdx.x / p.hkv) * BN;

    const u32 base = (smem_addr(smem) + 1023u) & ~1023u;
    const u32 sK = base;
    const u32 sV = sK + KV_TILE;
    const u32 sQ = sV + KV_TILE;        // ST slots
    const u32 sdO = sQ + ST * QD_TILE;  // ST slots
    const u32 sdS = sdO + ST * QD_TILE; // 2 buffers
    const u32 sRow = sdS + 2 * DS_TILE; // [ST][lse BM, delta BM] f32
    const u32 bar_full = sRow + ST * 2 * BM * 4, bar_empty = bar_full + 8 * ST;
    unsigned char* row_ptr = smem + (sRow - smem_addr(smem));

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

    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < ST; ++i) {
            mbar_init(bar_full + 8 * i, 128);
            mbar_init(bar_empty + 8 * i, WB_NT);
        }
    }
    __syncthreads();

    if (tid >= WB_NT) {
        // The copy warpgroup: step `it` = (query head, query block) into slot it % ST.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WB_PRODUCER_REGS));
        const int pl = tid - WB_NT;
        for (int it = 0; it < total; ++it) {
            const int slot = it % ST;
            if (it >= ST) mbar_wait(bar_empty + 8 * slot, ((it / ST) - 1) & 1);
            const int h = kh * p.group + it / n_m;
            const int m0 = (m_begin + it % n_m) * BM;
            if (it == 0) {
                wb_load_rows<BN>(sK, (const bf16_t*)p.k + (i64)kh * D, p.k_stride, n0, p.sk, pl);
                wb_load_rows<BN>(sV, (const bf16_t*)p.v + (i64)kh * D, p.v_stride, n0, p.sk, pl);
            }
            wb_load_rows<BM>(sQ + (u32)slot * QD_TILE, (const bf16_t*)p.q + (i64)h * D, p.q_stride, m0, p.sq,
                                  pl);
            wb_load_rows<BM>(sdO + (u32)slot * QD_TILE, (const bf16_t*)p.d_o + (i64)h * D, p.do_stride, m0,
                                  p.sq, pl);
            if (pl < BM) {
                const int r = m0 + pl;
                const bool ok = r < p.sq;
                const float* gl = (const float*)p.lse + (ok ? (i64)r * p.lse_stride + h : 0);
                const float* gd = (const float*)p.delta + (ok ? (i64)r * p.hq + h : 0);
                const u32 srow = sRow + (u32)slot * 2 * BM * 4;
                cp_async4(srow + pl * 4, gl, ok ? 4 : 0);
                cp_async4(srow + (BM + pl) * 4, gd, ok ? 4 : 0);
            }
            cp_async_commit();
            if (it >= 1) {
                // Step it - 1 landed: hand it to the async proxy, then to the consumers.
                cp_async_wait<1>();
                fence_proxy_async();
                mbar_arrive(bar_full + 8 * ((it - 1) % ST));
            }
        }
        if (total > 0) {
            cp_async_wait<0>();
            fence_proxy_async();
            mbar_arrive(bar_full + 8 * ((total - 1) % ST));
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WB_CONSUMER_REGS));

    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int kw0 = n0 + wg * 64;                          // this warpgroup's first key
    const int key_lo = kw0 + warp * 16 + (lane >> 2);      // this thread's keys: key_lo, key_lo + 8
    const u32 sKw = sK + (u32)wg * 64 * 128, sVw = sV + (u32)wg * 64 * 128;
    const int qc = (lane & 3) << 1;                        // this thread's first query column in an n-tile

    float dk[64], dv[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
        dk[i] = 0.f;
        dv[i] = 0.f;
    }

    for (int it = 0; it < total; ++it) {
        const int slot = it % ST;
        const int h = kh * p.group + it / n_m;
        const int m0 = (m_begin + it % n_m) * BM;
        const u32 sQb = sQ + (u32)slot * QD_TILE, sdOb = sdO + (u32)slot * QD_TILE;
        const u32 sdSb = sdS + (u32)(it & 1) * DS_TILE;
        const float* lse = (const float*)(row_ptr + slot * 2 * BM * 4);
        const float* dlt = lse + BM;

        float s[32], dp[32], dq[32];
        u32 pp[16], ps[16];
        mbar_wait(bar_full + 8 * slot, (it / ST) & 1);
        fence_proxy_async();

        // S^T = K_w Q^T and dP^T = V_w dO^T (two commit groups).
        wg_fence();
        // K-major operands: the k16 step kk is 32 bytes into half kk / 4 of the tile.
        wb_gemm8<0, 0>(
            s, [&](int kk) { return wg_desc(sKw + (kk >> 2) * BN * 128 + (kk & 3) * 32, 16, 1024); },
            [&](int kk) { return wg_desc(sQb + (kk >> 2) * BM * 128 + (kk & 3) * 32, 16, 1024); });
        wg_commit();
        wb_gemm8<0, 0>(
            dp, [&](int kk) { return wg_desc(sVw + (kk >> 2) * BN * 128 + (kk & 3) * 32, 16, 1024); },
            [&](int kk) { return wg_desc(sdOb + (kk >> 2) * BM * 128 + (kk & 3) * 32, 16, 1024); });
        wg_commit();

        // lse (base 2) of this thread's 16 query columns.
        float l2[16];
#pragma unroll
        for (int t = 0; t < BM / 8; ++t) {
            const float2 a = *(const float2*)(lse + t * 8 + qc);
            l2[2 * t] = a.x * FL_LOG2E;
            l2[2 * t + 1] = a.y * FL_LOG2E;
        }

        wg_wait<1>();
        wb_pin32(s);
        // Keys past the end, and (causal) keys after the query, get P = 0.
        const int m_last = min(m0 + BM, p.sq) - 1;
        const bool need_mask = (kw0 + 64 > p.sk) || (p.causal && kw0 + 63 > m0) ||
                               (rb.on() && (m0 + BM > p.sq || rb.lo(m_last) > kw0 || rb.hi(m0) < kw0 + 64));
#pragma unroll
        for (int t = 0; t < BM / 8; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float pv = fast_exp2(fmaf(s[t * 4 + e], p.scale_log2, -l2[2 * t + (e & 1)]));
                if (need_mask) {
                    const int key = key_lo + ((e >> 1) << 3);
                    const int q = m0 + t * 8 + qc + (e & 1);
                    if (key >= p.sk || (p.causal && key > q) || (rb.on() && (q >= p.sq || rb.hides(q, key))))
                        pv = 0.f;
                }
                s[t * 4 + e] = pv;
            }
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            pp[4 * kk + 0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
            pp[4 * kk + 1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
            pp[4 * kk + 2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
            pp[4 * kk + 3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
        }
        // dV_w += P^T dO (dO: K = queries, N = head dim, MN-major).
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            const u64 db = wg_desc(sdOb + kk * 16 * 128, BM * 128, 1024);
            wgmma_rs(dv, pp[4 * kk], pp[4 * kk + 1], pp[4 * kk + 2], pp[4 * kk + 3], db);
        }
        wg_commit();

        wg_wait<1>();  // dP^T (the dV product may still run)
        wb_pin32(dp);
#pragma unroll
        for (int t = 0; t < BM / 8; ++t) {
            const float2 dl = *(const float2*)(dlt + t * 8 + qc);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dp[t * 4 + e] = s[t * 4 + e] * (dp[t * 4 + e] - ((e & 1) ? dl.y : dl.x)) * p.scale;
        }
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            ps[4 * kk + 0] = pack_bf16(dp[8 * kk + 0], dp[8 * kk + 1]);
            ps[4 * kk + 1] = pack_bf16(dp[8 * kk + 2], dp[8 * kk + 3]);
            ps[4 * kk + 2] = pack_bf16(dp[8 * kk + 4], dp[8 * kk + 5]);
            ps[4 * kk + 3] = pack_bf16(dp[8 * kk + 6], dp[8 * kk + 7]);
        }
        // dS^T to shared memory: row = key within the block, 16-byte chunk t = queries t*8 ..
        {
            const int r0 = wg * 64 + warp * 16 + (lane >> 2);
#pragma unroll
            for (int t = 0; t < BM / 8; ++t)
#pragma unroll
                for (int rr = 0; rr < 2; ++rr) {
                    const int r = r0 + rr * 8;
                    const u32 off = wg_off<BN>(r, t) + (u32)(qc * 2);
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdSb + off),
                                 "r"(ps[4 * (t >> 1) + 2 * (t & 1) + rr])
                                 : "memory");
                }
        }
        // dK_w += dS^T Q (Q: K = queries, N = head dim, MN-major).
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            const u64 db = wg_desc(sQb + kk * 16 * 128, BM * 128, 1024);
            wgmma_rs(dk, ps[4 * kk], ps[4 * kk + 1], ps[4 * kk + 2], ps[4 * kk + 3], db);
        }
        wg_commit();

        // Both halves of dS in shared memory (visible to the async proxy).
        fence_proxy_async();
        named_bar_sync(1, WB_NT);

        // dQ[:, 64 wg ..] = dS K[:, 64 wg ..]: A = dS (M = queries, K = keys) read
        // from the dS^T rows (MN-major), B = K (K = keys, N = head dim, MN-major).
        wg_fence();
        wb_gemm8<1, 1>(
            dq, [&](int kk) { return wg_desc(sdSb + kk * 16 * 128, BN * 128, 1024); },
            [&](int kk) { return wg_desc(sK + (u32)wg * BN * 128 + kk * 16 * 128, BN * 128, 1024); });
        wg_commit();
        wg_wait<0>();
        wg_pin(dv);
        wg_pin(dk);
        wb_pin32(dq);
        // Every product of this slot is done: the copy warpgroup may refill it.
        mbar_arrive(bar_empty + 8 * slot);

        float* gdq = (float*)p.dq + (i64)h * D + wg * 64 + qc;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const int q = m0 + warp * 16 + (lane >> 2) + rr * 8;
            if (q < p.sq) {
                float* row = gdq + (i64)q * p.dq_stride;
#pragma unroll
                for (int t = 0; t < 8; ++t) red_add_v2(row + t * 8, dq[t * 4 + 2 * rr], dq[t * 4 + 2 * rr + 1]);
            }
        }
    }

    // dK, dV += (rows = keys, 16 n-tiles of 8 head-dim columns).
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int key = key_lo + rr * 8;
        if (key < p.sk) {
            float* dkr = (float*)p.dk + (i64)key * p.dk_stride + (i64)kh * D + qc;
            float* dvr = (float*)p.dv + (i64)key * p.dv_stride + (i64)kh * D + qc;
#pragma unroll
            for (int t = 0; t < D / 8; ++t) {
                float2 a = *(float2*)(dkr + t * 8);
                a.x += dk[t * 4 + 2 * rr];
                a.y += dk[t * 4 + 2 * rr + 1];
                *(float2*)(dkr + t * 8) = a;
                float2 b = *(float2*)(dvr + t * 8);
                b.x += dv[t * 4 + 2 * rr];
                b.y += dv[t * 4 + 2 * rr + 1];
                *(float2*)(dvr + t * 8) = b;
            }
        }
    }
}
