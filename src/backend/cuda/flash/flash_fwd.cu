// upipe flash attention forward (FlashAttention-2 schedule, mma.sync m16n8k16 bf16).
// One block = 128 query rows of one query head: head dims 64 and 128 run 4
// warps, each owning 32 rows (two m16 tiles); head dim 256 runs 8 warps of 16
// rows (one m16 tile: a warp's O accumulator of 16 x 256 f32 is 128 registers
// a thread). K/V tiles of 64 keys stream through a double-buffered cp.async
// pipeline; the online softmax runs in base 2.

#define FWD_BM 128
#define FWD_BN 64
#define FWD_NT 128
#define FWD_NT_D256 256

// D: head dim; NT: threads (NT / 32 warps of MT m16 row tiles, NT / 2 * MT == FWD_BM).
template <int D, int NT>
__device__ __forceinline__ void flash_fwd_impl(const FlashFwdParams& p) {
    extern __shared__ __align__(128) unsigned char smem[];
    constexpr int BM = FWD_BM, BN = FWD_BN;
    constexpr int MT = BM / 16 / (NT / 32);  // m16 row tiles per warp
    static_assert(MT * 16 * (NT / 32) == BM, "warps x rows must cover the block");
    constexpr int NTD = D / 8;   // n8 tiles across the head dim
    constexpr int NTN = BN / 8;  // n8 tiles across a key block

    // Grid = m blocks x heads, heads fastest and the longest (causal) rows first,
    // so that the heaviest blocks of every head start in the first wave.
    const int n_mblocks = (p.sq + BM - 1) / BM;
    const int h = blockIdx.x % p.hq;
    const int m_block = n_mblocks - 1 - (int)(blockIdx.x / p.hq);
    const int kh = h / p.group;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int m0 = m_block * BM;

    const u32 sQ = smem_addr(smem);
    const u32 sK = sQ + BM * D * 2;
    const u32 sV = sK + 2 * BN * D * 2;

    const bf16_t* gq = (const bf16_t*)p.q + (i64)h * D;
    const bf16_t* gk = (const bf16_t*)p.k + (i64)kh * D;
    const bf16_t* gv = (const bf16_t*)p.v + (i64)kh * D;

    // Key blocks nb0 .. n_blocks: from the tile's first visible key to its last.
    const RowBounds rb{(const int*)p.bounds, p.sq};
    int kv_begin = 0, kv_end = p.causal ? min(p.sk, m0 + BM) : p.sk;
    if (rb.on()) {
        kv_begin = rb.lo(m0);
        kv_end = rb.hi(min(m0 + BM, p.sq) - 1);
    }
    const int nb0 = kv_begin / BN;
    const int n_blocks = (kv_end + BN - 1) / BN;

    load_tile<BM, D, NT>(sQ, gq, p.q_stride, m0, p.sq, tid);
    load_tile<BN, D, NT>(sK, gk, p.k_stride, nb0 * BN, p.sk, tid);
    load_tile<BN, D, NT>(sV, gv, p.v_stride, nb0 * BN, p.sk, tid);
    cp_async_commit();

    float acc_o[MT][NTD][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NTD; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_o[mt][j][e] = 0.f;
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[mt][r] = FL_NEG_INF;
            row_sum[mt][r] = 0.f;
        }

    const int warp_row0 = warp * 16 * MT;  // within the block
    // this thread's rows' key bounds (documents mask): [mt][r]
    int rlo[MT][2], rhi[MT][2], lo_max = 0, hi_min = p.sk;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int gr = m0 + warp_row0 + mt * 16 + (lane >> 2) + r * 8;
            const bool in = rb.on() && gr < p.sq;
            rlo[mt][r] = in ? rb.lo(gr) : 0;
            rhi[mt][r] = in ? rb.hi(gr) : 0;
            lo_max = max(lo_max, rlo[mt][r]);
            hi_min = min(hi_min, rhi[mt][r]);
        }

    for (int nb = nb0; nb < n_blocks; ++nb) {
        const int buf = (nb - nb0) & 1;
        const int n0 = nb * BN;
        cp_async_wait<0>();
        __syncthreads();
        if (nb + 1 < n_blocks) {
            load_tile<BN, D, NT>(sK + (buf ^ 1) * BN * D * 2, gk, p.k_stride, n0 + BN, p.sk, tid);
            load_tile<BN, D, NT>(sV + (buf ^ 1) * BN * D * 2, gv, p.v_stride, n0 + BN, p.sk, tid);
            cp_async_commit();
        }
        const u32 sKb = sK + buf * BN * D * 2;
        const u32 sVb = sV + buf * BN * D * 2;

        // S = Q K^T for this warp's 16 * MT rows x 64 keys.
        float s[MT][NTN][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NTN; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][j][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(a[mt], sQ + tile_off<D>(warp_row0 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
            for (int j2 = 0; j2 < NTN / 2; ++j2) {
                u32 b[4];
                ldsm_x4(b, sKb + tile_off<D>(j2 * 16 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(s[mt][2 * j2], a[mt], b[0], b[1]);
                    mma_bf16(s[mt][2 * j2 + 1], a[mt], b[2], b[3]);
                }
            }
        }

        // Mask key tails and the causal diagonal.
        const bool need_mask = (n0 + BN > p.sk) || (p.causal && n0 + BN - 1 > m0 + warp_row0) ||
                               (rb.on() && (n0 < lo_max || n0 + BN > hi_min));
        if (need_mask) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < NTN; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        int gr = m0 + warp_row0 + mt * 16 + (lane >> 2) + ((e >> 1) << 3);
                        int gc = n0 + j * 8 + ((lane & 3) << 1) + (e & 1);
                        const bool hidden = rb.on() && (gc < rlo[mt][e >> 1] || gc >= rhi[mt][e >> 1]);
                        if (gc >= p.sk || (p.causal && gc > gr) || hidden) s[mt][j][e] = FL_NEG_INF;
                    }
        }

        // Online softmax (base 2).
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = row_max[mt][r];
#pragma unroll
                for (int j = 0; j < NTN; ++j) {
                    mx = fmaxf(mx, s[mt][j][2 * r] * p.scale_log2);
                    mx = fmaxf(mx, s[mt][j][2 * r + 1] * p.scale_log2);
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_use = (mx == FL_NEG_INF) ? 0.f : mx;
                const float alpha = fast_exp2(row_max[mt][r] - m_use);
                row_max[mt][r] = mx;
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < NTN; ++j) {
                    float p0 = fast_exp2(s[mt][j][2 * r] * p.scale_log2 - m_use);
                    float p1 = fast_exp2(s[mt][j][2 * r + 1] * p.scale_log2 - m_use);
                    s[mt][j][2 * r] = p0;
                    s[mt][j][2 * r + 1] = p1;
                    sum += p0 + p1;
                }
                row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
#pragma unroll
                for (int j = 0; j < NTD; ++j) {
                    acc_o[mt][j][2 * r] *= alpha;
                    acc_o[mt][j][2 * r + 1] *= alpha;
                }
            }

        // O += P V.
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int j2 = 0; j2 < NTD / 2; ++j2) {
                u32 b[4];
                ldsm_x4_t(b, sVb + tile_off<D>(kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7), j2 * 2 + (lane >> 4)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(acc_o[mt][2 * j2], a[mt], b[0], b[1]);
                    mma_bf16(acc_o[mt][2 * j2 + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }

    cp_async_wait<0>();  // a tile that sees no key loaded one it never read

    // Epilogue: normalize, write O (bf16) and LSE (natural log); a row that
    // sees no key gets O = 0 and LSE = -inf.
    bf16_t* go = (bf16_t*)p.o + (i64)h * D;
    float* glse = (float*)p.lse + h;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = row_sum[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int gr = m0 + warp_row0 + mt * 16 + (lane >> 2) + r * 8;
            if (gr < p.sq) {
                bf16_t* orow = go + (i64)gr * p.o_stride;
#pragma unroll
                for (int j = 0; j < NTD; ++j) {
                    int c = j * 8 + ((lane & 3) << 1);
                    *(u32*)(orow + c) = pack_bf16(acc_o[mt][j][2 * r] * inv, acc_o[mt][j][2 * r + 1] * inv);
                }
                if ((lane & 3) == 0) {
                    float lse = l > 0.f ? (row_max[mt][r] + fast_log2(l)) * FL_LN2 : FL_NEG_INF;
                    glse[(i64)gr * p.lse_stride] = lse;
                }
            }
        }
}

extern "C" __global__ void __launch_bounds__(FWD_NT, 2) upipe_flash_fwd_d64(const FlashFwdParams p) {
    flash_fwd_impl<64, FWD_NT>(p);
}
extern "C" __global__ void __launch_bounds__(FWD_NT, 2) upipe_flash_fwd_d128(const FlashFwdParams p) {
    flash_fwd_impl<128, FWD_NT>(p);
}
extern "C" __global__ void __launch_bounds__(FWD_NT_D256, 1) upipe_flash_fwd_d256(const FlashFwdParams p) {
    flash_fwd_impl<256, FWD_NT_D256>(p);
}
