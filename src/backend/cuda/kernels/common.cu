// Shared helpers for upipe's NVRTC kernels. No headers: bf16 is handled as
// raw 16-bit patterns, and dtype is a run-time flag (uniform per launch).
typedef long long i64;
typedef unsigned short bf16_t;

#define DT_F32 0
#define DT_BF16 1
#define DT_U8 2
#define IGNORE_ID 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf2f(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }

// Round to nearest even; NaN stays NaN.
__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float ld(const void* p, i64 i, int dt) {
    return dt == DT_F32 ? ((const float*)p)[i] : bf2f(((const bf16_t*)p)[i]);
}

__device__ __forceinline__ void st(void* p, i64 i, int dt, float v) {
    if (dt == DT_F32) ((float*)p)[i] = v;
    else ((bf16_t*)p)[i] = f2bf(v);
}

// The 8 floats of 8 bf16 packed in a uint4 (element 0 in the low half of x).
__device__ __forceinline__ void unpack8(uint4 q, float* f) {
    unsigned w[4] = {q.x, q.y, q.z, q.w};
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    unsigned w[4];
    for (int i = 0; i < 4; i++) w[i] = (unsigned)f2bf(f[2 * i]) | ((unsigned)f2bf(f[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions; blockDim.x must be a multiple of 32 (<= 1024) and
// every thread of the block must call them. `sh` holds 32 floats.
__device__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = (l < nw) ? sh[l] : 0.0f;
    v = warp_sum(v);
    return v;
}
__device__ float block_max(float v, float* sh) {
    v = warp_max(v);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = (l < nw) ? sh[l] : NEG_INF;
    v = warp_max(v);
    return v;
}

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)
