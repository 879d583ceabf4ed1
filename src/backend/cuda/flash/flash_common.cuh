// upipe flash attention: shared device helpers (NVRTC, no includes).
// bf16 tiles live in shared memory as rows of D elements split into 16-byte
// chunks; chunk c of row r is stored at chunk position c ^ (r & 7) so that
// ldmatrix reads of 8 consecutive rows hit 8 different bank groups.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define FL_INF __int_as_float(0x7f800000)
#define FL_NEG_INF __int_as_float(0xff800000)
#define FL_LOG2E 1.4426950408889634f
#define FL_LN2 0.6931471805599453f

// Forward parameters (shared by the mma.sync and the wgmma forward kernels).
struct FlashFwdParams {
    u64 q, k, v, o, lse;
    u64 bounds;  // null, or a documents mask's key rows per query row (see row_bounds)
    i64 q_stride, k_stride, v_stride, o_stride, lse_stride;
    int sq, sk, hq, hkv, group, causal;
    float scale_log2;
    int pad0;
};

// Backward parameters (shared by the mma.sync and the wgmma backward kernels).
struct FlashBwdParams {
    u64 q, k, v, o, d_o, lse, dq, dk, dv, delta;
    u64 bounds;  // as in FlashFwdParams
    i64 q_stride, k_stride, v_stride, o_stride, do_stride, lse_stride, dq_stride, dk_stride, dv_stride;
    int sq, sk, hq, hkv, group, causal;
    float scale, scale_log2;
};

// A documents mask (`bounds` non-null, int32 [2][sq]): query row r sees key
// rows bounds[r] .. bounds[sq + r] (the causal flag is then 0). Both bounds
// are nondecreasing in r, so a tile of rows m0..m1 needs the keys
// bounds[m0] .. bounds[sq + m1 - 1], and the key rows k0..k1 are seen by the
// rows from the first whose end passes k0 to the last whose start is before k1.
struct RowBounds {
    const int* b;
    int sq;
    __device__ __forceinline__ bool on() const { return b != nullptr; }
    __device__ __forceinline__ int lo(int r) const { return b[r]; }
    __device__ __forceinline__ int hi(int r) const { return b[sq + r]; }
    // First row in [0, sq] whose end is past key k (hi(r) > k).
    __device__ __forceinline__ int first_row_ending_after(int k) const {
        int a = 0, z = sq;
        while (a < z) {
            const int m = (a + z) >> 1;
            if (hi(m) > k) z = m; else a = m + 1;
        }
        return a;
    }
    // First row in [0, sq] whose start is at key k or later (lo(r) >= k).
    __device__ __forceinline__ int first_row_starting_at(int k) const {
        int a = 0, z = sq;
        while (a < z) {
            const int m = (a + z) >> 1;
            if (lo(m) >= k) z = m; else a = m + 1;
        }
        return a;
    }
    // Whether row r (< sq) may see key c.
    __device__ __forceinline__ bool hides(int r, int c) const { return c < lo(r) || c >= hi(r); }
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-byte async copy global -> shared; src_bytes == 0 zero-fills the destination.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 4-byte async copy (zero-fill when src_bytes == 0).
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// c += a * b, m16n8k16, bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 -> packed bf16x2 (round to nearest even); `lo` lands in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float bf16_to_f32(bf16_t x) { return __int_as_float(((u32)x) << 16); }

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Byte offset of (row, 16-byte chunk) in a swizzled tile with D bf16 per row.
template <int D>
__device__ __forceinline__ u32 tile_off(int row, int chunk) {
    return (u32)(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

// Async load of ROWS x D bf16 rows [row0, row0+ROWS) of a strided global
// matrix into a swizzled shared tile; rows >= nrows are zero-filled.
template <int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile(u32 s_base, const bf16_t* g, i64 stride, int row0, int nrows, int tid) {
    constexpr int CH = D / 8;
#pragma unroll
    for (int i = tid; i < ROWS * CH; i += NT) {
        int r = i / CH, c = i % CH;
        int gr = row0 + r;
        bool ok = gr < nrows;
        const bf16_t* src = ok ? g + (i64)gr * stride + c * 8 : g;
        cp_async16(s_base + tile_off<D>(r, c), src, ok ? 16 : 0);
    }
}

__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
}
