// RMSNorm forward/backward (one block per row) and rotary embedding.

extern "C" __global__ void rmsnorm_fwd(const void* x, int xdt, const void* w, int wdt, void* y, int ydt,
                                       i64 rows, i64 dim, float eps) {
    __shared__ float sh[32];
    i64 r = blockIdx.x;
    if (r >= rows) return;
    const i64 base = r * dim;
    float ss = 0.0f;
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
        float a = ld(x, base + j, xdt);
        ss += a * a;
    }
    ss = block_sum(ss, sh);
    float rinv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (i64 j = threadIdx.x; j < dim; j += blockDim.x)
        st(y, base + j, ydt, ld(x, base + j, xdt) * rinv * ld(w, j, wdt));
}

// dx = r*dy*w - (r^3 * sum(dy*w*x) / dim) * x ; dw += dy*x*r.
// Blocks stride over rows. With `smem_dw`, each block sums its rows' dw in
// shared memory (dim floats) and adds it to the f32 global dw once per column;
// otherwise (dim too large for shared memory) it adds per element.
// Every thread touches the same columns j = tid + k*blockDim in all loops, so
// the shared accumulator needs no barriers.
extern "C" __global__ void rmsnorm_bwd(const void* x, int xdt, const void* w, int wdt, const void* dy, int dydt,
                                       void* dx, int dxdt, float* dw, i64 rows, i64 dim, float eps, int smem_dw) {
    extern __shared__ float dws[];
    __shared__ float sh[32];
    if (smem_dw)
        for (i64 j = threadIdx.x; j < dim; j += blockDim.x) dws[j] = 0.0f;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 base = r * dim;
        float ss = 0.0f, s = 0.0f;
        for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
            float a = ld(x, base + j, xdt);
            ss += a * a;
            s += ld(dy, base + j, dydt) * ld(w, j, wdt) * a;
        }
        ss = block_sum(ss, sh);
        s = block_sum(s, sh);
        float rinv = 1.0f / sqrtf(ss / (float)dim + eps);
        float c = rinv * rinv * rinv * s / (float)dim;
        for (i64 j = threadIdx.x; j < dim; j += blockDim.x) {
            float a = ld(x, base + j, xdt), g = ld(dy, base + j, dydt);
            st(dx, base + j, dxdt, rinv * g * ld(w, j, wdt) - c * a);
            if (smem_dw) dws[j] += g * a * rinv;
            else atomicAdd(dw + j, g * a * rinv);
        }
    }
    if (smem_dw)
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
