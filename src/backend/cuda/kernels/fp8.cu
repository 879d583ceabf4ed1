// FP8 quantization with a tensor-wise scale (backend::fp8): the largest
// magnitude of a strided 2-D view, the codes of view * scale (round to
// nearest even, saturated at the format's largest finite value, NaN kept),
// optionally their transpose, and the inverse scale the FP8 GEMM reads.
// Three launches over one 4-byte cell, zeroed first: fp8_amax leaves the
// bits of the largest |x| there (non-negative floats order as unsigned
// integers, a NaN above infinity), fp8_cast reads it, fp8_scale_inv turns it
// into 1 / scale in place.

// fmt: 3 = E4M3 (3 mantissa bits, bias 7, max 448, max code 0x7E),
//      4 = E5M2 (2 mantissa bits, bias 15, max 57344, max code 0x7B).
__device__ __forceinline__ float fp8_max(int fmt) { return fmt == 3 ? 448.0f : 57344.0f; }

__device__ __forceinline__ unsigned char fp8_encode(float x, int fmt) {
    const int mbits = fmt == 3 ? 3 : 2;
    const int bias = fmt == 3 ? 7 : 15;
    const unsigned maxcode = fmt == 3 ? 0x7Eu : 0x7Bu;
    unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
    if (x != x) return (unsigned char)(sign | 0x7Fu);
    float a = fabsf(x);
    if (a >= fp8_max(fmt)) return (unsigned char)(sign | maxcode);
    int emin = 1 - bias;
    int e = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;
    if (e < emin) e = emin;
    // a / 2^(e - mbits), exact: a multiplication by a power of two
    float inv_q = __uint_as_float((unsigned)(127 - (e - mbits)) << 23);
    unsigned n = (unsigned)rintf(__fmul_rn(a, inv_q));
    if (n >= (2u << mbits)) { n >>= 1; e += 1; }
    if (n < (1u << mbits)) return (unsigned char)(sign | n);
    return (unsigned char)(sign | ((unsigned)(e + bias) << mbits) | (n - (1u << mbits)));
}

// scale_for(amax): NaN for a non-finite amax, 1 for 0, max / amax, FLT_MAX
// where the quotient overflows.
__device__ __forceinline__ float fp8_scale(float amax, int fmt) {
    if (!(amax <= 3.402823466e38f)) return __int_as_float(0x7fc00000);
    if (amax == 0.0f) return 1.0f;
    float s = __fdiv_rn(fp8_max(fmt), amax);
    return s <= 3.402823466e38f ? s : 3.402823466e38f;
}

// Whether a view's lines (along its unit stride `cs`) read as uint4s of 8
// bf16: BF16, unit stride, whole vectors per line, 16-byte aligned lines.
__device__ __forceinline__ bool fp8_vec8(const void* p, int dt, i64 cols, i64 rs, i64 cs) {
    return dt == DT_BF16 && cs == 1 && (cols & 7) == 0 && (rs & 7) == 0 &&
           (((unsigned long long)p) & 15) == 0;
}

// The 8 codes of 8 bf16 times scale, packed low byte first.
__device__ __forceinline__ uint2 fp8_encode8(uint4 q, float scale, int fmt) {
    float f[8];
    unpack8(q, f);
    unsigned w[2] = {0u, 0u};
    for (int i = 0; i < 8; i++)
        w[i >> 2] |= (unsigned)fp8_encode(__fmul_rn(f[i], scale), fmt) << (8 * (i & 3));
    return make_uint2(w[0], w[1]);
}

// The largest |x| of a strided view. The view is read along its unit stride
// (order does not matter to a maximum), one line per block step, 8 bf16 a
// load where it can, so loads coalesce whether the view is row- or
// column-major; a bounded grid leaves one atomic per block.
extern "C" __global__ void fp8_amax(const void* src, int dt, i64 rows, i64 cols, i64 rs,
                                    i64 cs, unsigned* cell) {
    if (rs < cs) {  // read the transpose: its columns are contiguous
        i64 t = rows; rows = cols; cols = t;
        t = rs; rs = cs; cs = t;
    }
    unsigned m = 0;
    if (fp8_vec8(src, dt, cols, rs, cs)) {
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
            const uint4* line = (const uint4*)((const bf16_t*)src + r * rs);
            for (i64 v = threadIdx.x; v < (cols >> 3); v += blockDim.x) {
                uint4 q = line[v];
                unsigned w[4] = {q.x, q.y, q.z, q.w};
                for (int i = 0; i < 4; i++) {
                    // |x| as f32 bits: the sign cleared
                    unsigned lo = (w[i] << 16) & 0x7fffffffu, hi = w[i] & 0x7fff0000u;
                    m = lo > m ? lo : m;
                    m = hi > m ? hi : m;
                }
            }
        }
    } else {
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
            for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
                unsigned b = __float_as_uint(fabsf(ld(src, r * rs + c * cs, dt)));
                m = b > m ? b : m;
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        unsigned other = __shfl_xor_sync(0xffffffffu, m, o);
        m = other > m ? other : m;
    }
    __shared__ unsigned warp_max[32];
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) m = warp_max[w] > m ? warp_max[w] : m;
        if (m > 0) atomicMax(cell, m);
    }
}

// A row-major view, 8 bf16 a load: one line per block step, 8 codes a store.
__device__ void fp8_cast_rows(const bf16_t* src, i64 rows, i64 cols, i64 rs, float scale,
                              int fmt, unsigned char* dst) {
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const uint4* line = (const uint4*)(src + r * rs);
        uint2* out = (uint2*)(dst + r * cols);
        for (i64 v = threadIdx.x; v < (cols >> 3); v += blockDim.x)
            out[v] = fp8_encode8(line[v], scale, fmt);
    }
}

// A column-major view (the transpose of a row-major matrix, as a weight
// gradient reads its operands) of whole 64 x 64 tiles: each thread loads 8
// consecutive rows of two columns, the codes meet in shared memory, and each
// thread stores 16 consecutive columns of one row.
__device__ void fp8_cast_cols(const bf16_t* src, i64 rows, i64 cols, i64 cs, float scale,
                              int fmt, unsigned char* dst) {
    __shared__ __align__(16) unsigned char tile[64][80];
    const int t = threadIdx.x;
    const i64 tiles_c = cols >> 6, tiles = (rows >> 6) * tiles_c;
    for (i64 k = blockIdx.x; k < tiles; k += gridDim.x) {
        const i64 r0 = (k / tiles_c) << 6, c0 = (k % tiles_c) << 6;
        const int r8 = (t & 7) << 3;
        for (int half = 0; half < 2; half++) {
            const int c = (t >> 3) + 32 * half;
            uint2 q = fp8_encode8(*(const uint4*)(src + (c0 + c) * cs + r0 + r8), scale, fmt);
            for (int i = 0; i < 8; i++)
                tile[r8 + i][c] = (unsigned char)((i < 4 ? q.x : q.y) >> (8 * (i & 3)));
        }
        __syncthreads();
        const int r = t >> 2, c16 = (t & 3) << 4;
        *(uint4*)(dst + (r0 + r) * cols + c0 + c16) = *(const uint4*)&tile[r][c16];
        __syncthreads();
    }
}

// A row-major BF16 view of whole 64 x 64 tiles into dst and its transpose
// dst_t at once (a gradient that its input- and weight-gradient GEMMs read
// in both layouts): each thread loads 16 consecutive columns of one row and
// stores their codes to dst, the codes meet in shared memory, and each
// thread stores 16 consecutive rows of one column to dst_t.
__device__ void fp8_cast_rows_both(const bf16_t* src, i64 rows, i64 cols, i64 rs, float scale,
                                   int fmt, unsigned char* dst, unsigned char* dst_t) {
    __shared__ __align__(16) unsigned char tile[64][80];
    const int t = threadIdx.x;
    const i64 tiles_c = cols >> 6, tiles = (rows >> 6) * tiles_c;
    for (i64 k = blockIdx.x; k < tiles; k += gridDim.x) {
        const i64 r0 = (k / tiles_c) << 6, c0 = (k % tiles_c) << 6;
        const int r = t >> 2, c16 = (t & 3) << 4;
        const uint4* in = (const uint4*)(src + (r0 + r) * rs + c0 + c16);
        const uint2 lo = fp8_encode8(in[0], scale, fmt), hi = fp8_encode8(in[1], scale, fmt);
        const uint4 codes = make_uint4(lo.x, lo.y, hi.x, hi.y);
        *(uint4*)(dst + (r0 + r) * cols + c0 + c16) = codes;
        *(uint4*)&tile[r][c16] = codes;
        __syncthreads();
        const int c = t >> 2, r16 = (t & 3) << 4;
        unsigned w[4] = {0u, 0u, 0u, 0u};
        for (int i = 0; i < 16; i++) w[i >> 2] |= (unsigned)tile[r16 + i][c] << (8 * (i & 3));
        *(uint4*)(dst_t + (c0 + c) * rows + r0 + r16) = make_uint4(w[0], w[1], w[2], w[3]);
        __syncthreads();
    }
}

// Any view, 32 x 32 tiles of single elements: read along the view's unit
// stride into shared memory, written along rows in dst and, where dst_t is
// given, along rows of the transpose ([cols, rows]) in dst_t.
__device__ void fp8_cast_any(const void* src, int dt, i64 rows, i64 cols, i64 rs, i64 cs,
                             float scale, int fmt, unsigned char* dst, unsigned char* dst_t) {
    __shared__ unsigned char tile[32][33];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const bool col_major = rs < cs;
    const i64 tiles_c = (cols + 31) / 32, tiles = ((rows + 31) / 32) * tiles_c;
    for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const i64 r0 = (t / tiles_c) * 32, c0 = (t % tiles_c) * 32;
        for (int k = ty; k < 32; k += 8) {
            const int i = col_major ? tx : k, j = col_major ? k : tx;
            const i64 r = r0 + i, c = c0 + j;
            if (r < rows && c < cols)
                tile[i][j] = fp8_encode(__fmul_rn(ld(src, r * rs + c * cs, dt), scale), fmt);
        }
        __syncthreads();
        for (int k = ty; k < 32; k += 8) {
            const i64 r = r0 + k, c = c0 + tx;
            if (r < rows && c < cols) dst[r * cols + c] = tile[k][tx];
        }
        if (dst_t) {
            for (int k = ty; k < 32; k += 8) {
                const i64 r = r0 + tx, c = c0 + k;
                if (r < rows && c < cols) dst_t[c * rows + r] = tile[tx][k];
            }
        }
        __syncthreads();
    }
}

// The codes of view * scale, row-major [rows, cols] in dst and, where dst_t
// is given, column-major in dst_t ([cols, rows]). 256 threads a block; the
// two shapes the linear layers' GEMMs read most (a row-major BF16 view, and
// the column-major view of one) take vector paths, and so does a row-major
// BF16 view cast in both layouts; any other the tiled one.
extern "C" __global__ void fp8_cast(const void* src, int dt, i64 rows, i64 cols, i64 rs, i64 cs,
                                    const unsigned* cell, int fmt, unsigned char* dst,
                                    unsigned char* dst_t) {
    const float scale = fp8_scale(__uint_as_float(*cell), fmt);
    const bool tiles64 = (rows & 63) == 0 && (cols & 63) == 0;
    if (!dst_t && fp8_vec8(src, dt, cols, rs, cs)) {
        fp8_cast_rows((const bf16_t*)src, rows, cols, rs, scale, fmt, dst);
    } else if (dst_t && fp8_vec8(src, dt, cols, rs, cs) && tiles64) {
        fp8_cast_rows_both((const bf16_t*)src, rows, cols, rs, scale, fmt, dst, dst_t);
    } else if (!dst_t && fp8_vec8(src, dt, rows, cs, rs) && tiles64) {
        fp8_cast_cols((const bf16_t*)src, rows, cols, cs, scale, fmt, dst);
    } else {
        fp8_cast_any(src, dt, rows, cols, rs, cs, scale, fmt, dst, dst_t);
    }
}

extern "C" __global__ void fp8_scale_inv(unsigned* cell, int fmt) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        float s = fp8_scale(__uint_as_float(*cell), fmt);
        *(float*)cell = __fdiv_rn(1.0f, s);
    }
}

// backend::fp8::attention::pow2_scale: the largest power of two p with
// bound * p <= max (1 for a zero or non-finite bound), exact steps only.
__device__ float fp8_pow2_scale(float bound, float max) {
    if (!(bound > 0.0f && bound <= 3.402823466e38f)) return 1.0f;
    const float r = __fdiv_rn(max, bound);
    if (!(r >= 1.17549435e-38f && r <= 3.402823466e38f))
        return r > 1.0f ? __uint_as_float(254u << 23) : __uint_as_float(1u << 23);
    const float p = __uint_as_float(__float_as_uint(r) & 0x7f800000u);
    return __fmul_rn(bound, p) > max ? __fmul_rn(p, 0.5f) : p;
}

// The scale array of an FP8 attention call (cudnn::sdpa_fp8::Slot order),
// as backend::fp8::attention::scales sets it, from the inverse scales its
// operands were quantized with (inv_do 0 in a forward); extra receives
// max / scale_o (the amax that makes fp8_cast quantize with O's scale) and
// the descales of dQ, dK, dV. One thread.
extern "C" __global__ void fp8_attn_scales(const float* inv_q, const float* inv_k,
                                           const float* inv_v, const float* inv_do,
                                           float* cells, float* extra, i64 sq, int d,
                                           float scale) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const float e4 = 448.0f, e5 = 57344.0f, w4 = 1.125f, w5 = 1.25f;
    const float iq = *inv_q, ik = *inv_k, iv = *inv_v, ido = inv_do ? *inv_do : 0.0f;
    const float q = __fmul_rn(__fmul_rn(iq, e4), w4), k = __fmul_rn(__fmul_rn(ik, e4), w4);
    const float v = __fmul_rn(__fmul_rn(iv, e4), w4), dO = __fmul_rn(__fmul_rn(ido, e5), w5);
    const float bound_o = __fmul_rn(v, w4);
    const float bound_ds = __fmul_rn(__fmul_rn(__fmul_rn(scale, (float)d), dO),
                                     __fadd_rn(v, bound_o));
    const float ds_w = __fmul_rn(bound_ds, w5);
    const float bound_dq = __fmul_rn(ds_w, k);
    const float bound_dk = __fmul_rn(__fmul_rn((float)sq, ds_w), q);
    const float bound_dv = __fmul_rn(__fmul_rn((float)sq, w4), dO);
    const float s = fp8_pow2_scale(1.0f, e4), o = fp8_pow2_scale(bound_o, e4);
    const float dp = fp8_pow2_scale(bound_ds, e5);
    // Slot: DescaleQ, DescaleK, DescaleV, DescaleO, DescaleDo, DescaleS, ScaleS,
    // DescaleDp, ScaleDp, ScaleO, ScaleDq, ScaleDk, ScaleDv (then the amaxes)
    const float c[13] = {iq, ik, iv, __fdiv_rn(1.0f, o), ido, __fdiv_rn(1.0f, s), s,
                         __fdiv_rn(1.0f, dp), dp, o, fp8_pow2_scale(bound_dq, e5),
                         fp8_pow2_scale(bound_dk, e5), fp8_pow2_scale(bound_dv, e5)};
    for (int i = 0; i < 13; i++) cells[i] = c[i];
    extra[0] = __fdiv_rn(e4, o);
    for (int i = 0; i < 3; i++) extra[1 + i] = __fdiv_rn(1.0f, c[10 + i]);
}

// The value of an FP8 code.
__device__ __forceinline__ float fp8_decode(unsigned char c, int fmt) {
    const int mbits = fmt == 3 ? 3 : 2, bias = fmt == 3 ? 7 : 15;
    const unsigned sign = c & 0x80u, e = (c & 0x7fu) >> mbits, m = c & ((1u << mbits) - 1u);
    float a;
    if (fmt == 3 && (c & 0x7fu) == 0x7fu) a = __int_as_float(0x7fc00000);
    else if (fmt == 4 && e == 31u) a = m ? __int_as_float(0x7fc00000) : __int_as_float(0x7f800000);
    else if (e == 0u) a = ldexpf((float)m, 1 - bias - mbits);
    else a = ldexpf((float)((1u << mbits) | m), (int)e - bias - mbits);
    return sign ? -a : a;
}

// dst rows (F32 or BF16, [rows, cols] with row stride rs) = (add: +=) the
// dense codes src [rows, cols] times *descale.
extern "C" __global__ void fp8_dequant(void* dst, int dt, i64 rows, i64 cols, i64 rs,
                                       const unsigned char* src, int fmt, const float* descale,
                                       int add) {
    const float sc = *descale;
    const i64 n = rows * cols;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / cols, at = r * rs + (i - r * cols);
        float x = __fmul_rn(fp8_decode(src[i], fmt), sc);
        if (add) x = __fadd_rn(ld(dst, at, dt), x);
        st(dst, at, dt, x);
    }
}
