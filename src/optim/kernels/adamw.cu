// AdamW on F32 state: one piece (adamw) or up to ADAMW_PIECES pieces of
// one or more slots in one launch (adamw_multi). Compiled after the
// device's common helpers (common.cu: ld, st, f2bf, DT_*).

// One AdamW update of weight pi with raw gradient graw (the arithmetic of
// every AdamW kernel): m and v updated in place, the new weight returned.
__device__ __forceinline__ float adamw_update(float pi, float graw, float& m, float& v, float lr, float b1,
                                              float b2, float eps, float wd, float bc1, float bc2,
                                              float grad_scale) {
    float gi = graw * grad_scale;
    float mi = b1 * m + (1.0f - b1) * gi;
    float vi = b2 * v + (1.0f - b2) * gi * gi;
    m = mi;
    v = vi;
    float mh = mi / bc1, vh = vi / bc2;
    return pi - lr * (mh / (sqrtf(vh) + eps) + wd * pi);
}

// One AdamW update of element i: returns the new weight, written to p[i].
__device__ __forceinline__ float adamw_elem(float* p, const void* g, int gdt, float* m, float* v, i64 i,
                                            float lr, float b1, float b2, float eps, float wd, float bc1,
                                            float bc2, float grad_scale) {
    float mi = m[i], vi = v[i];
    float np = adamw_update(p[i], ld(g, i, gdt), mi, vi, lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
    m[i] = mi;
    v[i] = vi;
    p[i] = np;
    return np;
}

extern "C" __global__ void adamw(float* p, const void* g, int gdt, float* m, float* v, i64 n,
                                 float lr, float b1, float b2, float eps, float wd,
                                 float bc1, float bc2, float grad_scale) {
    GRID_STRIDE(i, n) {
        adamw_elem(p, g, gdt, m, v, i, lr, b1, b2, eps, wd, bc1, bc2, grad_scale);
    }
}

// The pieces of one multi-tensor AdamW launch (a kernel parameter; the
// layout `cuda/adamw_multi.rs` writes): piece k covers elements
// start[k] .. start[k] + len[k] of its slot's tensors p (F32 weights), g
// (gradient, dtype gdt), m, v (F32 moments) and q (narrow weights, dtype
// qdt; null for none), and the launch's virtual blocks first_block[k] ..
// first_block[k + 1] (4 * blockDim.x elements each). vec[k]: every tensor's
// element start[k] is aligned for 4-element loads.
#define ADAMW_PIECES 32
struct AdamWPieces {
    float* p[ADAMW_PIECES];
    const void* g[ADAMW_PIECES];
    float* m[ADAMW_PIECES];
    float* v[ADAMW_PIECES];
    void* q[ADAMW_PIECES];
    i64 start[ADAMW_PIECES];
    i64 len[ADAMW_PIECES];
    i64 first_block[ADAMW_PIECES];
    int gdt[ADAMW_PIECES], qdt[ADAMW_PIECES], vec[ADAMW_PIECES];
    float lr[ADAMW_PIECES], b1[ADAMW_PIECES], b2[ADAMW_PIECES], eps[ADAMW_PIECES];
    float wd[ADAMW_PIECES], bc1[ADAMW_PIECES], bc2[ADAMW_PIECES], grad_scale[ADAMW_PIECES];
};

// Four consecutive elements of piece k from element i, with 16-byte loads
// and stores of p, m, v (8-byte ones of bf16 g and q): the arithmetic of
// adamw_elem, element by element.
__device__ __forceinline__ void adamw_vec4(const AdamWPieces& t, int k, i64 i) {
    float4 p4 = *(const float4*)(t.p[k] + i), m4 = *(const float4*)(t.m[k] + i);
    float4 v4 = *(const float4*)(t.v[k] + i);
    float pv[4] = {p4.x, p4.y, p4.z, p4.w}, mv[4] = {m4.x, m4.y, m4.z, m4.w};
    float vv[4] = {v4.x, v4.y, v4.z, v4.w}, gv[4], np[4];
    if (t.gdt[k] == DT_F32) {
        float4 g4 = *(const float4*)((const float*)t.g[k] + i);
        gv[0] = g4.x, gv[1] = g4.y, gv[2] = g4.z, gv[3] = g4.w;
    } else {
        uint2 g2 = *(const uint2*)((const bf16_t*)t.g[k] + i);
        gv[0] = __uint_as_float(g2.x << 16), gv[1] = __uint_as_float(g2.x & 0xffff0000u);
        gv[2] = __uint_as_float(g2.y << 16), gv[3] = __uint_as_float(g2.y & 0xffff0000u);
    }
#pragma unroll
    for (int u = 0; u < 4; u++)
        np[u] = adamw_update(pv[u], gv[u], mv[u], vv[u], t.lr[k], t.b1[k], t.b2[k], t.eps[k], t.wd[k], t.bc1[k],
                             t.bc2[k], t.grad_scale[k]);
    *(float4*)(t.p[k] + i) = make_float4(np[0], np[1], np[2], np[3]);
    *(float4*)(t.m[k] + i) = make_float4(mv[0], mv[1], mv[2], mv[3]);
    *(float4*)(t.v[k] + i) = make_float4(vv[0], vv[1], vv[2], vv[3]);
    if (!t.q[k]) return;
    if (t.qdt[k] == DT_F32) {
        *(float4*)((float*)t.q[k] + i) = make_float4(np[0], np[1], np[2], np[3]);
    } else {
        unsigned lo = (unsigned)f2bf(np[0]) | ((unsigned)f2bf(np[1]) << 16);
        unsigned hi = (unsigned)f2bf(np[2]) | ((unsigned)f2bf(np[3]) << 16);
        *(uint2*)((bf16_t*)t.q[k] + i) = make_uint2(lo, hi);
    }
}

// AdamW of up to ADAMW_PIECES pieces, of one or more slots, in one launch,
// each with its hyper-parameters; a piece's q receives every updated
// weight, rounded as `copy` rounds (the narrow parameters of an F32
// master). Virtual block vb belongs to the last piece whose first_block is
// <= vb; each thread updates 4 consecutive elements of it.
extern "C" __global__ void adamw_multi(int pieces, i64 vblocks, AdamWPieces t) {
    for (i64 vb = blockIdx.x; vb < vblocks; vb += gridDim.x) {
        int k = 0;
        while (k + 1 < pieces && t.first_block[k + 1] <= vb) k++;
        i64 j = ((vb - t.first_block[k]) * blockDim.x + threadIdx.x) * 4;
        if (j >= t.len[k]) continue;
        i64 i = t.start[k] + j;
        if (t.vec[k] && j + 4 <= t.len[k]) {
            adamw_vec4(t, k, i);
            continue;
        }
        for (int u = 0; u < 4 && j + u < t.len[k]; u++) {
            float np = adamw_elem(t.p[k], t.g[k], t.gdt[k], t.m[k], t.v[k], i + u, t.lr[k], t.b1[k], t.b2[k],
                                  t.eps[k], t.wd[k], t.bc1[k], t.bc2[k], t.grad_scale[k]);
            if (t.q[k]) st(t.q[k], i + u, t.qdt[k], np);
        }
    }
}
