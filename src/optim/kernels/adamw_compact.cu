// AdamW with compact state (optim/adamw/compact_adamw.rs is the reference, and
// these are its IEEE operations in its order: explicit _rn intrinsics, no
// fused multiply-add, so results agree bit for bit). Moments in F32, BF16
// (nearest even) or 8-bit block-wise codes with an F32 scale per block of
// Q8_BLOCK elements of each piece; weights in an F32 master (with an
// optional narrow copy) or BF16 updated by stochastic rounding.

#define Q8_BLOCK 256
#define COMPACT_PIECES 24

// The pieces of one launch (the layout `cuda/adamw_compact.rs` writes):
// piece k covers elements start[k] .. start[k] + len[k] of its slot's
// tensors, and the launch's virtual blocks first_block[k] ..
// first_block[k + 1], one Q8_BLOCK of the piece each. ms/vs point at the
// piece's first block scale (8-bit moments only).
struct CompactPieces {
    void* p[COMPACT_PIECES];
    const void* g[COMPACT_PIECES];
    void* m[COMPACT_PIECES];
    void* v[COMPACT_PIECES];
    float* ms[COMPACT_PIECES];
    float* vs[COMPACT_PIECES];
    void* q[COMPACT_PIECES];
    i64 start[COMPACT_PIECES];
    i64 len[COMPACT_PIECES];
    i64 first_block[COMPACT_PIECES];
    int pdt[COMPACT_PIECES], gdt[COMPACT_PIECES], mdt[COMPACT_PIECES], qdt[COMPACT_PIECES];
    unsigned key[COMPACT_PIECES];
    float lr[COMPACT_PIECES], b1[COMPACT_PIECES], b2[COMPACT_PIECES], eps[COMPACT_PIECES];
    float wd[COMPACT_PIECES], bc1[COMPACT_PIECES], bc2[COMPACT_PIECES], grad_scale[COMPACT_PIECES];
};

// Level `code` of an 8-bit set whose top code is 1: (1 + m/8) * 2^(e - top_e).
__device__ __forceinline__ float q8_level(unsigned code, unsigned top_e) {
    if (code == 0) return 0.0f;
    unsigned t = code + 1;
    return __uint_as_float((((t >> 3) + 127u - top_e) << 23) | ((t & 7u) << 20));
}

// The nearest level to x among 0..codes, ties to the lower (0 for zero,
// negative values and NaN): level c >= 1 has the bits (c + 1 + 8 (127 -
// top_e)) << 20, nothing below the top three mantissa bits, so the highest
// level not above x is read off x's bits and one midpoint decides between it
// and the next (`nearest_level` in compact_adamw.rs; what a binary search
// over the midpoints finds, tested equal there).
__device__ __forceinline__ unsigned q8_nearest(float x, unsigned codes) {
    if (!(x > 0.0f)) return 0;
    const unsigned top_e = (codes + 1) >> 3;
    const int base = 8 * (127 - (int)top_e) + 1;
    const int below_i = (int)(__float_as_uint(x) >> 20) - base;
    const unsigned below = (unsigned)min(max(below_i, 0), (int)codes);
    const unsigned above = min(below + 1, codes);
    float mid = __fmul_rn(__fadd_rn(q8_level(below, top_e), q8_level(above, top_e)), 0.5f);
    return mid < x ? above : below;
}

__device__ __forceinline__ unsigned char q8_encode_signed(float m, float scale) {
    if (scale == 0.0f) return 0;
    unsigned mag = q8_nearest(__fdiv_rn(fabsf(m), scale), 127);
    unsigned sign = (m < 0.0f && mag > 0) ? 0x80u : 0u;
    return (unsigned char)(sign | mag);
}

__device__ __forceinline__ float q8_decode_signed(unsigned char c, float scale) {
    float v = __fmul_rn(q8_level(c & 0x7fu, 16), scale);
    return (c & 0x80u) ? -v : v;
}

__device__ __forceinline__ unsigned char q8_encode_unsigned(float v, float scale) {
    if (scale == 0.0f) return 0;
    unsigned c = q8_nearest(__fdiv_rn(v, scale), 255);
    if (v > 0.0f && c == 0) c = 1;
    return (unsigned char)c;
}

__device__ __forceinline__ float q8_decode_unsigned(unsigned char c, float scale) {
    return __fmul_rn(q8_level(c, 32), scale);
}

__device__ __forceinline__ unsigned mix32(unsigned x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    return x ^ (x >> 16);
}

__device__ __forceinline__ unsigned rounding_bits(unsigned key, unsigned i) {
    return mix32(mix32(i ^ key) ^ ((key << 16) | (key >> 16))) & 0xffffu;
}

__device__ __forceinline__ bf16_t bf16_stochastic(float x, unsigned r) {
    if (!isfinite(x)) return f2bf(x);
    unsigned bits = __float_as_uint(x);
    bf16_t up = (bf16_t)((bits + r) >> 16);
    return ((up & 0x7f80u) == 0x7f80u) ? (bf16_t)(bits >> 16) : up;
}

// The hyperparameters of one piece's update.
struct PieceStep {
    float lr, b1, b2, eps, wd, bc1, bc2, grad_scale;
};

// One element's AdamW in the reference's order: the new moments in `mi`,
// `vi`, the new weight returned.
__device__ __forceinline__ float adamw_element(float w, float g, float m, float v, const PieceStep& h,
                                               float& mi, float& vi) {
    float gi = __fmul_rn(g, h.grad_scale);
    mi = __fadd_rn(__fmul_rn(h.b1, m), __fmul_rn(__fsub_rn(1.0f, h.b1), gi));
    vi = __fadd_rn(__fmul_rn(h.b2, v), __fmul_rn(__fmul_rn(__fsub_rn(1.0f, h.b2), gi), gi));
    float mh = __fdiv_rn(mi, h.bc1), vh = __fdiv_rn(vi, h.bc2);
    float den = __fadd_rn(__fsqrt_rn(vh), h.eps);
    float step = __fadd_rn(__fdiv_rn(mh, den), __fmul_rn(h.wd, w));
    return __fsub_rn(w, __fmul_rn(h.lr, step));
}

__device__ __forceinline__ float moment_ld(const void* t, i64 i, int dt, float scale, bool signed_) {
    if (dt == DT_U8) {
        unsigned char c = ((const unsigned char*)t)[i];
        return signed_ ? q8_decode_signed(c, scale) : q8_decode_unsigned(c, scale);
    }
    return ld(t, i, dt);
}

__device__ __forceinline__ void moment_st(void* t, i64 i, int dt, float x, float scale, bool signed_) {
    if (dt == DT_U8)
        ((unsigned char*)t)[i] = signed_ ? q8_encode_signed(x, scale) : q8_encode_unsigned(x, scale);
    else if (dt == DT_F32) ((float*)t)[i] = x;
    else ((bf16_t*)t)[i] = f2bf(x);
}

// Threads of a block (`THREADS` in `optim/adamw/cuda_compact.rs`).
#define COMPACT_THREADS 128
#define PER_THREAD (Q8_BLOCK / COMPACT_THREADS)

// The largest of `a` and of `b` over the block (blockDim.x ==
// COMPACT_THREADS), in every thread: one pair of barriers for both.
__device__ __forceinline__ float2 q8_block_max2(float a, float b, float2* sh) {
    a = warp_max(a);
    b = warp_max(b);
    int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) sh[w] = make_float2(a, b);
    __syncthreads();
    float2 r = sh[0];
    for (int k = 1; k < (COMPACT_THREADS >> 5); k++) r = make_float2(fmaxf(r.x, sh[k].x), fmaxf(r.y, sh[k].y));
    __syncthreads();
    return r;
}

// The piece of virtual block `vb`: the last k with first_block[k] <= vb.
__device__ __forceinline__ int piece_of(const CompactPieces& t, int pieces, i64 vb) {
    int lo = 0, hi = pieces - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (t.first_block[mid] <= vb) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// A block of COMPACT_THREADS threads per virtual block (a Q8_BLOCK of one
// piece), PER_THREAD elements a thread, COMPACT_THREADS apart so that
// each load and store of a warp is contiguous. The block maxima (and so
// the codes) are those of one thread per element: max is exact in any
// order.
extern "C" __global__ void adamw_compact(int pieces, i64 vblocks, CompactPieces t) {
    __shared__ float2 sh[COMPACT_THREADS >> 5];
    for (i64 vb = blockIdx.x; vb < vblocks; vb += gridDim.x) {
        const int k = piece_of(t, pieces, vb);
        const i64 b = vb - t.first_block[k];
        const i64 first = b * Q8_BLOCK + threadIdx.x, len = t.len[k], start = t.start[k];
        const int pdt = t.pdt[k], gdt = t.gdt[k], mdt = t.mdt[k];
        const bool q8 = mdt == DT_U8;
        const PieceStep h = {t.lr[k], t.b1[k], t.b2[k], t.eps[k], t.wd[k], t.bc1[k], t.bc2[k], t.grad_scale[k]};
        const float m_scale = q8 ? t.ms[k][b] : 0.0f, v_scale = q8 ? t.vs[k][b] : 0.0f;
        float w[PER_THREAD], g[PER_THREAD], mi[PER_THREAD], vi[PER_THREAD];
#pragma unroll
        for (int e = 0; e < PER_THREAD; e++) {
            const i64 j = first + e * COMPACT_THREADS;
            if (j < len) {
                w[e] = ld(t.p[k], start + j, pdt);
                g[e] = ld(t.g[k], start + j, gdt);
                mi[e] = moment_ld(t.m[k], start + j, mdt, m_scale, true);
                vi[e] = moment_ld(t.v[k], start + j, mdt, v_scale, false);
            }
        }
        float m_max = 0.0f, v_max = 0.0f;
#pragma unroll
        for (int e = 0; e < PER_THREAD; e++) {
            const i64 j = first + e * COMPACT_THREADS;
            if (j >= len) continue;
            const i64 i = start + j;
            const float wn = adamw_element(w[e], g[e], mi[e], vi[e], h, mi[e], vi[e]);
            if (pdt == DT_F32) {
                ((float*)t.p[k])[i] = wn;
                if (t.q[k]) st(t.q[k], i, t.qdt[k], wn);
            } else {
                ((bf16_t*)t.p[k])[i] = bf16_stochastic(wn, rounding_bits(t.key[k], (unsigned)i));
            }
            m_max = fmaxf(m_max, fabsf(mi[e]));
            v_max = fmaxf(v_max, fabsf(vi[e]));
        }
        float ms = 0.0f, vs = 0.0f;
        if (q8) {
            const float2 top = q8_block_max2(m_max, v_max, sh);
            ms = top.x;
            vs = top.y;
            if (threadIdx.x == 0) {
                t.ms[k][b] = ms;
                t.vs[k][b] = vs;
            }
        }
#pragma unroll
        for (int e = 0; e < PER_THREAD; e++) {
            const i64 j = first + e * COMPACT_THREADS;
            if (j < len) {
                moment_st(t.m[k], start + j, mdt, mi[e], ms, true);
                moment_st(t.v[k], start + j, mdt, vi[e], vs, false);
            }
        }
    }
}
