// RMSNorm forward/backward (one block per row) and rotary embedding.
// `woff` is the norm's weight offset (`RmsNorm::weight_offset`): each weight
// scales as `w + woff` (Gemma's `1 + w`), and as `w` itself when it is 0.

__device__ __forceinline__ float norm_w(const void* w, i64 j, int wdt, float woff) {
    float g = ld(w, j, wdt);
    return woff != 0.0f ? g + woff : g;
}

// With `vec8` (x, w and y bf16, 16-byte aligned, dim a multiple of 8) each
// thread moves 8 elements per load and store.
extern "C" __global__ void rmsnorm_fwd(const void* x, int xdt, const void* w, int wdt, void* y, int ydt,
                                       i64 rows, i64 dim, float eps, float woff, int vec8) {
    __shared__ float sh[32];
    i64 r = blockIdx.x;
    if (r >= rows) return;
    const i64 base = r * dim;
    if (vec8) {
        const uint4* xv = (const uint4*)((const bf16_t*)x + base);
        const uint4* wv = (const uint4*)w;
        uint4* yv = (uint4*)((bf16_t*)y + base);
        const int nv = (int)(dim >> 3);
        float ss = 0.0f;
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            float a[8];
            unpack8(xv[k], a);
            for (int i = 0; i < 8; i++) ss += a[i] * a[i];
        }
        ss = block_sum(ss, sh);
        float rinv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            float a[8], g[8];
            unpack8(xv[k], a);
            unpack8(wv[k], g);
            if (woff != 0.0f) for (int i = 0; i < 8; i++) g[i] += woff;
            for (int i = 0; i < 8; i++) a[i] = a[i] * rinv * g[i];
            yv[k] = pack8(a);
        }
        return;
    }
    float ss = 0.0f;
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
        float a = ld(x, base + j, xdt);
        ss += a * a;
    }
    ss = block_sum(ss, sh);
    float rinv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x)
        st(y, base + j, ydt, ld(x, base + j, xdt) * rinv * norm_w(w, j, wdt, woff));
}

// x += y (rounded to x's dtype as `axpy` rounds it), then rmsnorm_fwd of the
// rounded sum into `out`, in one launch: the arithmetic of axpy then
// rmsnorm_fwd, each element added, stored and squared by the thread that
// later normalises it (so it reads back its own stores). `vec8`: x, y, w and
// out bf16, 16-byte aligned, dim a multiple of 8.
extern "C" __global__ void add_rmsnorm_fwd(void* x, int xdt, const void* y, int ydt, const void* w, int wdt,
                                           void* out, int odt, i64 rows, i64 dim, float eps, float woff, int vec8) {
    __shared__ float sh[32];
    i64 r = blockIdx.x;
    if (r >= rows) return;
    const i64 base = r * dim;
    if (vec8) {
        uint4* xv = (uint4*)((bf16_t*)x + base);
        const uint4* yv = (const uint4*)((const bf16_t*)y + base);
        const uint4* wv = (const uint4*)w;
        uint4* ov = (uint4*)((bf16_t*)out + base);
        const int nv = (int)(dim >> 3);
        float ss = 0.0f;
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            float a[8], b[8];
            unpack8(xv[k], a);
            unpack8(yv[k], b);
            for (int i = 0; i < 8; i++) a[i] = a[i] + b[i];
            const uint4 sum = pack8(a);
            xv[k] = sum;
            unpack8(sum, a);
            for (int i = 0; i < 8; i++) ss += a[i] * a[i];
        }
        ss = block_sum(ss, sh);
        float rinv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            float a[8], g[8];
            unpack8(xv[k], a);
            unpack8(wv[k], g);
            if (woff != 0.0f) for (int i = 0; i < 8; i++) g[i] += woff;
            for (int i = 0; i < 8; i++) a[i] = a[i] * rinv * g[i];
            ov[k] = pack8(a);
        }
        return;
    }
    float ss = 0.0f;
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
        st(x, base + j, xdt, ld(x, base + j, xdt) + ld(y, base + j, ydt));
        float a = ld(x, base + j, xdt);
        ss += a * a;
    }
    ss = block_sum(ss, sh);
    float rinv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x)
        st(out, base + j, odt, ld(x, base + j, xdt) * rinv * norm_w(w, j, wdt, woff));
}

// One row of rmsnorm_bwd with 8 bf16 per load (x, w, dy, dx bf16, aligned):
// thread t takes the columns 8k..8k+7 for k = t, t + blockDim, ...
__device__ void rmsnorm_bwd_row8(const bf16_t* x, const bf16_t* w, const bf16_t* dy, bf16_t* dx, float* dw,
                                 float* dws, int nv, float dim, float eps, float woff, float* sh, int add) {
    const uint4 *xv = (const uint4*)x, *wv = (const uint4*)w, *dv = (const uint4*)dy;
    float ss = 0.0f, s = 0.0f;
    for (int k = threadIdx.x; k < nv; k += blockDim.x) {
        float a[8], g[8], d[8];
        unpack8(xv[k], a);
        unpack8(wv[k], g);
            if (woff != 0.0f) for (int i = 0; i < 8; i++) g[i] += woff;
        unpack8(dv[k], d);
        for (int i = 0; i < 8; i++) {
            ss += a[i] * a[i];
            s += d[i] * g[i] * a[i];
        }
    }
    ss = block_sum(ss, sh);
    s = block_sum(s, sh);
    float rinv = 1.0f / sqrtf(ss / dim + eps);
    float c = rinv * rinv * rinv * s / dim;
    for (int k = threadIdx.x; k < nv; k += blockDim.x) {
        float a[8], g[8], d[8], o[8];
        unpack8(xv[k], a);
        unpack8(wv[k], g);
            if (woff != 0.0f) for (int i = 0; i < 8; i++) g[i] += woff;
        unpack8(dv[k], d);
        for (int i = 0; i < 8; i++) {
            o[i] = rinv * d[i] * g[i] - c * a[i];
            if (dws) dws[8 * k + i] += d[i] * a[i] * rinv;
            else if (dw) atomicAdd(dw + 8 * k + i, d[i] * a[i] * rinv);
        }
        if (add) {
            // axpy(dx, 1, o rounded to bf16)
            float res[8];
            unpack8(((const uint4*)dx)[k], res);
            unpack8(pack8(o), o);
            for (int i = 0; i < 8; i++) o[i] = res[i] + o[i];
        }
        ((uint4*)dx)[k] = pack8(o);
    }
}

// dx = r*dy*w - (r^3 * sum(dy*w*x) / dim) * x ; dw += dy*x*r. With `add`,
// dx += that instead, rounded to dx's dtype first (axpy(dx, 1, t) of the
// rounded t: `rms_norm_bwd_add`).
// Blocks stride over rows. With `smem_dw`, each block sums its rows' dw in
// shared memory (dim floats) and adds it to the f32 global dw once per column;
// otherwise (dim too large for shared memory) it adds per element. A null dw
// (a frozen norm weight) is not written.
// Every thread touches the same columns in all loops (j = tid + k*blockDim,
// or with `vec8` the 8 columns from 8*(tid + k*blockDim)), so the shared
// accumulator needs no barriers.
extern "C" __global__ void rmsnorm_bwd(const void* x, int xdt, const void* w, int wdt, const void* dy, int dydt,
                                       void* dx, int dxdt, float* dw, i64 rows, i64 dim, float eps, float woff, int smem_dw,
                                       int vec8, int add) {
    extern __shared__ float dws[];
    __shared__ float sh[32];
    if (vec8) {
        const int nv = (int)(dim >> 3);
        if (smem_dw)
            for (int k = threadIdx.x; k < nv; k += blockDim.x)
                for (int i = 0; i < 8; i++) dws[8 * k + i] = 0.0f;
        for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
            const i64 base = r * dim;
            rmsnorm_bwd_row8((const bf16_t*)x + base, (const bf16_t*)w, (const bf16_t*)dy + base,
                             (bf16_t*)dx + base, dw, smem_dw ? dws : nullptr, nv, (float)dim, eps, woff, sh, add);
        }
        if (smem_dw && dw)
            for (int k = threadIdx.x; k < nv; k += blockDim.x)
                for (int i = 0; i < 8; i++) atomicAdd(dw + 8 * k + i, dws[8 * k + i]);
        return;
    }
    if (smem_dw)
        for (i64 j = threadIdx.x; j < dim; j += blockDim.x) dws[j] = 0.0f;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = r * dim;
        float ss = 0.0f, s = 0.0f;
        for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
            float a = ld(x, base + j, xdt);
            ss += a * a;
            s += ld(dy, base + j, dydt) * norm_w(w, j, wdt, woff) * a;
        }
        ss = block_sum(ss, sh);
        s = block_sum(s, sh);
        float rinv = 1.0f / sqrtf(ss / (float)dim + eps);
        float c = rinv * rinv * rinv * s / (float)dim;
        for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
            float a = ld(x, base + j, xdt), g = ld(dy, base + j, dydt);
            float t = rinv * g * norm_w(w, j, wdt, woff) - c * a;
            if (add) t = ld(dx, base + j, dxdt) + (dxdt == DT_F32 ? t : bf2f(f2bf(t)));
            st(dx, base + j, dxdt, t);
            if (smem_dw) dws[j] += g * a * rinv;
            else if (dw) atomicAdd(dw + j, g * a * rinv);
        }
    }
    if (smem_dw && dw)
        for (i64 j = threadIdx.x; j < dim; j += blockDim.x) atomicAdd(dw + j, dws[j]);
}

// HF rotate-half: for i < d/2, (a, b) = (x[i], x[i+d/2]) ->
// (a*cos - b*sin', b*cos + a*sin') with sin' = sign*sin. x: [s, heads, d].
extern "C" __global__ void rope(void* x, int dt, const float* cosv, const float* sinv,
                                i64 s, i64 heads, i64 d, float sign) {
    i64 half = d / 2;
    GRID_STRIDE(idx, s * heads * half) {
        i64 i = idx % half;
        i64 th = idx / half;  // t * heads + h
        i64 t = th / heads;
        i64 o = th * d;
        float a = ld(x, o + i, dt), b = ld(x, o + i + half, dt);
        float c = cosv[t * half + i], sn = sign * sinv[t * half + i];
        st(x, o + i, dt, a * c - b * sn);
        st(x, o + i + half, dt, b * c + a * sn);
    }
}

// `rope` of bf16 rows, 8 pairs per thread: one 16-byte load and store of each
// half and two float4 loads of each table per 8 pairs, and one index
// division per 8. The same arithmetic per pair as `rope`. Needs half % 8 == 0
// and x, cos and sin 16-byte aligned (rope_impl checks).
extern "C" __global__ void rope_bf16x8(bf16_t* x, const float* cosv, const float* sinv,
                                       i64 s, i64 heads, i64 d, float sign) {
    i64 half = d / 2, groups = half / 8;
    GRID_STRIDE(idx, s * heads * groups) {
        i64 g = idx % groups;
        i64 th = idx / groups;  // t * heads + h
        i64 t = th / heads;
        uint4* lo = (uint4*)(x + th * d + g * 8);
        uint4* hi = (uint4*)(x + th * d + half + g * 8);
        const float4* cp = (const float4*)(cosv + t * half + g * 8);
        const float4* sp = (const float4*)(sinv + t * half + g * 8);
        float4 c0 = cp[0], c1 = cp[1], s0 = sp[0], s1 = sp[1];
        float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
        float a[8], b[8], ra[8], rb[8];
        unpack8(*lo, a);
        unpack8(*hi, b);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float sn = sign * sv[k];
            ra[k] = a[k] * c[k] - b[k] * sn;
            rb[k] = b[k] * c[k] + a[k] * sn;
        }
        *lo = pack8(ra);
        *hi = pack8(rb);
    }
}
