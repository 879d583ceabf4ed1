// Copies, fills, axpy, reductions, gated activations, embedding.

extern "C" __global__ void copy2d(void* dst, int ddt, i64 doff, i64 drs, i64 dcs,
                                  const void* src, int sdt, i64 soff, i64 srs, i64 scs,
                                  i64 rows, i64 cols) {
    GRID_STRIDE(idx, rows * cols) {
        i64 i = idx / cols, j = idx - i * cols;
        st(dst, doff + i * drs + j * dcs, ddt, ld(src, soff + i * srs + j * scs, sdt));
    }
}

// Rows of 16-byte vectors between two views of one dtype with unit column
// stride (the caller checks alignment): row i of dst at dst + i * drs bytes,
// of src at src + i * srs bytes, row_vecs vectors each. Most copies in the
// attention layer (head blocks in and out of exchange buffers) take this path.
extern "C" __global__ void copy_rows16(char* dst, i64 drs, const char* src, i64 srs, i64 rows, i64 row_vecs) {
    GRID_STRIDE(idx, rows * row_vecs) {
        i64 i = idx / row_vecs, j = idx - i * row_vecs;
        reinterpret_cast<uint4*>(dst + i * drs)[j] = reinterpret_cast<const uint4*>(src + i * srs)[j];
    }
}

// Rows of 8-element groups between an F32 and a BF16 view (either way) with
// unit column stride and 16-byte aligned rows (the caller checks): 8 values
// per thread, in 16-byte loads and stores. Gradients cast for the exchanges.
extern "C" __global__ void cast_rows8(char* dst, int ddt, i64 drs, const char* src, int sdt, i64 srs, i64 rows,
                                      i64 row_groups) {
    GRID_STRIDE(idx, rows * row_groups) {
        i64 i = idx / row_groups, j = idx - i * row_groups;
        float v[8];
        if (sdt == DT_F32) {
            const float4* s = reinterpret_cast<const float4*>(src + i * srs) + 2 * j;
            float4 a = s[0], b = s[1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
            uint4 a = reinterpret_cast<const uint4*>(src + i * srs)[j];
            unsigned w[4] = {a.x, a.y, a.z, a.w};
            for (int k = 0; k < 4; k++) {
                v[2 * k] = bf2f((bf16_t)(w[k] & 0xffffu));
                v[2 * k + 1] = bf2f((bf16_t)(w[k] >> 16));
            }
        }
        if (ddt == DT_F32) {
            float4* d = reinterpret_cast<float4*>(dst + i * drs) + 2 * j;
            d[0] = make_float4(v[0], v[1], v[2], v[3]);
            d[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
            unsigned w[4];
            for (int k = 0; k < 4; k++) w[k] = (unsigned)f2bf(v[2 * k]) | ((unsigned)f2bf(v[2 * k + 1]) << 16);
            reinterpret_cast<uint4*>(dst + i * drs)[j] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// p = beta * p on a strided 2-D view (beta == 0 writes exact zeros).
extern "C" __global__ void scale2d(void* p, int dt, i64 off, i64 rs, i64 cs, i64 rows, i64 cols, float beta) {
    GRID_STRIDE(idx, rows * cols) {
        i64 i = idx / cols, j = idx - i * cols;
        i64 o = off + i * rs + j * cs;
        st(p, o, dt, beta == 0.0f ? 0.0f : beta * ld(p, o, dt));
    }
}

// x[i, j] += b[j] on a strided 2-D view: a q/k/v bias row added to every
// token's row of a projection (b one row of `cols` elements, stride bcs).
// `vec8`: x bf16 with unit column stride, rows, offset and cols multiples of
// 8 elements (16-byte aligned): each thread moves 8 elements of one row.
extern "C" __global__ void add_bias_rows(void* x, int xdt, i64 xoff, i64 xrs, i64 xcs, const void* b, int bdt,
                                         i64 boff, i64 bcs, i64 rows, i64 cols, int vec8) {
    if (vec8) {
        i64 c8 = cols >> 3;
        GRID_STRIDE(k, rows * c8) {
            i64 i = k / c8, j = (k - i * c8) << 3;
            uint4* q = (uint4*)((bf16_t*)x + xoff + i * xrs + j);
            float a[8];
            unpack8(*q, a);
            for (int t = 0; t < 8; t++) a[t] += ld(b, boff + (j + t) * bcs, bdt);
            *q = pack8(a);
        }
        return;
    }
    GRID_STRIDE(idx, rows * cols) {
        i64 i = idx / cols, j = idx - i * cols;
        i64 o = xoff + i * xrs + j * xcs;
        st(x, o, xdt, ld(x, o, xdt) + ld(b, boff + j * bcs, bdt));
    }
}

// db[j] += sum_i dy[i, j] (db F32): a bias's gradient. A block of 1024
// threads takes 32 columns; its 32 warps sum every 32nd row of them, then one
// thread per column adds the 32 partial sums in a fixed order
// (deterministic, no atomics).
extern "C" __global__ void bias_grad(float* db, i64 doff, i64 dcs, const void* dy, int ydt, i64 yoff, i64 yrs,
                                     i64 ycs, i64 rows, i64 cols) {
    __shared__ float part[32][33];
    int lane = threadIdx.x & 31, group = threadIdx.x >> 5;
    i64 j = (i64)blockIdx.x * 32 + lane;
    float acc = 0.0f;
    if (j < cols) {
        for (i64 i = group; i < rows; i += 32) acc += ld(dy, yoff + i * yrs + j * ycs, ydt);
    }
    part[group][lane] = acc;
    __syncthreads();
    if (group == 0 && j < cols) {
        float sum = 0.0f;
        for (int g = 0; g < 32; g++) sum += part[g][lane];
        db[doff + j * dcs] += sum;
    }
}

extern "C" __global__ void fill(void* p, int dt, i64 n, float v) {
    GRID_STRIDE(i, n) { st(p, i, dt, v); }
}

// `vec8` as in gated_act_fwd (y and x bf16).
extern "C" __global__ void axpy(void* y, int ydt, const void* x, int xdt, i64 n, float alpha, int vec8) {
    if (vec8) {
        GRID_STRIDE(k, n >> 3) {
            float a[8], b[8];
            unpack8(((const uint4*)y)[k], a);
            unpack8(((const uint4*)x)[k], b);
            for (int i = 0; i < 8; i++) a[i] = a[i] + alpha * b[i];
            ((uint4*)y)[k] = pack8(a);
        }
        return;
    }
    GRID_STRIDE(i, n) { st(y, i, ydt, ld(y, i, ydt) + alpha * ld(x, i, xdt)); }
}

// out[0] += sum(x^2) in f64 (out must be zeroed by the caller).
extern "C" __global__ void sum_squares(const void* x, int dt, i64 n, double* out) {
    __shared__ double sh[32];
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)ld(x, i, dt);
        acc += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (l == 0) sh[w] = acc;
    __syncthreads();
    if (w == 0) {
        acc = (l < nw) ? sh[l] : 0.0;
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (l == 0) atomicAdd(out, acc);
    }
}

__device__ __forceinline__ float sigmoidf_(float a) { return 1.0f / (1.0f + expf(-a)); }

// The gated activations (`GatedAct::code`): 0 SiLU, 1 GELU by tanh.
#define ACT_SILU 0
#define ACT_GELU_TANH 1
#define GELU_K 0.7978846f
#define GELU_C 0.044715f

__device__ __forceinline__ float gated_act(float a, float b, int act) {
    if (act == ACT_GELU_TANH) return 0.5f * a * (1.0f + tanhf(GELU_K * (a + GELU_C * a * a * a))) * b;
    return a * sigmoidf_(a) * b;
}

// With `vec8` (every tensor bf16, 16-byte aligned, n a multiple of 8; the
// grid sized for n / 8) each thread moves 8 elements per load and store;
// the arithmetic per element is the same either way.
extern "C" __global__ void gated_act_fwd(const void* g, int gdt, const void* u, int udt, void* out, int odt,
                                         i64 n, int act, int vec8) {
    if (vec8) {
        GRID_STRIDE(k, n >> 3) {
            float a[8], b[8];
            unpack8(((const uint4*)g)[k], a);
            unpack8(((const uint4*)u)[k], b);
            for (int i = 0; i < 8; i++) a[i] = gated_act(a[i], b[i], act);
            ((uint4*)out)[k] = pack8(a);
        }
        return;
    }
    GRID_STRIDE(i, n) {
        float a = ld(g, i, gdt);
        st(out, i, odt, gated_act(a, ld(u, i, udt), act));
    }
}

__device__ __forceinline__ void gated_act_grad(float a, float b, float d, int act, float& dg, float& du) {
    if (act == ACT_GELU_TANH) {
        float t = tanhf(GELU_K * (a + GELU_C * a * a * a));
        float dt = (1.0f - t * t) * GELU_K * (1.0f + 3.0f * GELU_C * a * a);
        du = d * (0.5f * a * (1.0f + t));
        dg = d * b * (0.5f * (1.0f + t) + 0.5f * a * dt);
        return;
    }
    float s = sigmoidf_(a);
    du = d * a * s;
    dg = d * b * s * (1.0f + a * (1.0f - s));
}

// `vec8` as in gated_act_fwd.
extern "C" __global__ void gated_act_bwd(const void* g, int gdt, const void* u, int udt, const void* dy, int dydt,
                                         void* dg, int dgdt, void* du, int dudt, i64 n, int act, int vec8) {
    if (vec8) {
        GRID_STRIDE(k, n >> 3) {
            float a[8], b[8], d[8], ga[8], gb[8];
            unpack8(((const uint4*)g)[k], a);
            unpack8(((const uint4*)u)[k], b);
            unpack8(((const uint4*)dy)[k], d);
            for (int i = 0; i < 8; i++) gated_act_grad(a[i], b[i], d[i], act, ga[i], gb[i]);
            ((uint4*)dg)[k] = pack8(ga);
            ((uint4*)du)[k] = pack8(gb);
        }
        return;
    }
    GRID_STRIDE(i, n) {
        float ga, gb;
        gated_act_grad(ld(g, i, gdt), ld(u, i, udt), ld(dy, i, dydt), act, ga, gb);
        st(du, i, dudt, gb);
        st(dg, i, dgdt, ga);
    }
}

// out = scale * table[ids] (the product in f32, rounded to out's dtype by st; x * 1.0f is exact).
extern "C" __global__ void embedding_fwd(const void* table, int tdt, const unsigned* ids, void* out, int odt,
                                         i64 n, i64 hidden, float scale) {
    GRID_STRIDE(idx, n * hidden) {
        i64 r = idx / hidden, c = idx - r * hidden;
        st(out, idx, odt, ld(table, (i64)ids[r] * hidden + c, tdt) * scale);
    }
}

// dtable[ids] += scale * dout, the product rounded to dout's dtype before the f32 add.
extern "C" __global__ void embedding_bwd(const void* dout, int ddt, const unsigned* ids, float* dtable,
                                         i64 n, i64 hidden, float scale) {
    GRID_STRIDE(idx, n * hidden) {
        i64 r = idx / hidden, c = idx - r * hidden;
        float g = ld(dout, idx, ddt) * scale;
        if (ddt == DT_BF16) g = bf2f(f2bf(g));
        atomicAdd(dtable + (i64)ids[r] * hidden + c, g);
    }
}
