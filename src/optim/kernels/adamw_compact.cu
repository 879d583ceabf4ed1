// AdamW with compact state (backend/compact_adamw.rs is the reference, and
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

__device__ __forceinline__ float moment_ld(const void* t, i64 i, int dt, const float* scales, i64 b, bool signed_) {
    if (dt == DT_U8) {
        unsigned char c = ((const unsigned char*)t)[i];
        return signed_ ? q8_decode_signed(c, scales[b]) : q8_decode_unsigned(c, scales[b]);
    }
    return ld(t, i, dt);
}

// The largest of `x` over the block (blockDim.x == Q8_BLOCK), in every thread.
__device__ __forceinline__ float q8_block_max(float x, float* sh) {
    x = warp_max(x);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) sh[w] = x;
    __syncthreads();
    float y = (l < (Q8_BLOCK >> 5)) ? sh[l] : 0.0f;
    y = warp_max(y);
    __syncthreads();
    return y;
}

__device__ __forceinline__ void moment_st(void* t, i64 i, int dt, float x, float scale, bool signed_) {
    if (dt == DT_U8)
        ((unsigned char*)t)[i] = signed_ ? q8_encode_signed(x, scale) : q8_encode_unsigned(x, scale);
    else if (dt == DT_F32) ((float*)t)[i] = x;
    else ((bf16_t*)t)[i] = f2bf(x);
}

// One thread per element of a virtual block (a Q8_BLOCK of one piece).
extern "C" __global__ void adamw_compact(int pieces, i64 vblocks, CompactPieces t) {
    __shared__ float sh[Q8_BLOCK >> 5];
    for (i64 vb = blockIdx.x; vb < vblocks; vb += gridDim.x) {
        int k = 0;
        while (k + 1 < pieces && t.first_block[k + 1] <= vb) k++;
        i64 b = vb - t.first_block[k];
        i64 j = b * Q8_BLOCK + threadIdx.x;
        bool active = j < t.len[k];
        i64 i = t.start[k] + j;
        float mi = 0.0f, vi = 0.0f;
        if (active) {
            float w = ld(t.p[k], i, t.pdt[k]);
            float gi = __fmul_rn(ld(t.g[k], i, t.gdt[k]), t.grad_scale[k]);
            float m = moment_ld(t.m[k], i, t.mdt[k], t.ms[k], b, true);
            float v = moment_ld(t.v[k], i, t.mdt[k], t.vs[k], b, false);
            float b1 = t.b1[k], b2 = t.b2[k];
            mi = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(__fsub_rn(1.0f, b1), gi));
            vi = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(__fsub_rn(1.0f, b2), gi), gi));
            float mh = __fdiv_rn(mi, t.bc1[k]), vh = __fdiv_rn(vi, t.bc2[k]);
            float den = __fadd_rn(__fsqrt_rn(vh), t.eps[k]);
            float step = __fadd_rn(__fdiv_rn(mh, den), __fmul_rn(t.wd[k], w));
            w = __fsub_rn(w, __fmul_rn(t.lr[k], step));
            if (t.pdt[k] == DT_F32) {
                ((float*)t.p[k])[i] = w;
                if (t.q[k]) st(t.q[k], i, t.qdt[k], w);
            } else {
                ((bf16_t*)t.p[k])[i] = bf16_stochastic(w, rounding_bits(t.key[k], (unsigned)i));
            }
        }
        float ms = 0.0f, vs = 0.0f;
        if (t.mdt[k] == DT_U8) {
            ms = q8_block_max(active ? fabsf(mi) : 0.0f, sh);
            vs = q8_block_max(active ? fabsf(vi) : 0.0f, sh);
            if (threadIdx.x == 0) {
                t.ms[k][b] = ms;
                t.vs[k][b] = vs;
            }
        }
        if (active) {
            moment_st(t.m[k], i, t.mdt[k], mi, ms, true);
            moment_st(t.v[k], i, t.mdt[k], vi, vs, false);
        }
    }
}
