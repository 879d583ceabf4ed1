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

extern "C" __global__ void fp8_amax(const void* src, int dt, i64 rows, i64 cols, i64 rs,
                                    i64 cs, unsigned* cell) {
    unsigned m = 0;
    i64 n = rows * cols;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / cols, c = i - r * cols;
        unsigned b = __float_as_uint(fabsf(ld(src, r * rs + c * cs, dt)));
        m = b > m ? b : m;
    }
    for (int o = 16; o > 0; o >>= 1) {
        unsigned other = __shfl_xor_sync(0xffffffffu, m, o);
        m = other > m ? other : m;
    }
    if ((threadIdx.x & 31) == 0 && m > 0) atomicMax(cell, m);
}

extern "C" __global__ void fp8_cast(const void* src, int dt, i64 rows, i64 cols, i64 rs, i64 cs,
                                    const unsigned* cell, int fmt, unsigned char* dst,
                                    unsigned char* dst_t) {
    float scale = fp8_scale(__uint_as_float(*cell), fmt);
    i64 n = rows * cols;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / cols, c = i - r * cols;
        unsigned char q = fp8_encode(__fmul_rn(ld(src, r * rs + c * cs, dt), scale), fmt);
        dst[i] = q;
        if (dst_t) dst_t[c * rows + r] = q;
    }
}

extern "C" __global__ void fp8_scale_inv(unsigned* cell, int fmt) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        float s = fp8_scale(__uint_as_float(*cell), fmt);
        *(float*)cell = __fdiv_rn(1.0f, s);
    }
}
