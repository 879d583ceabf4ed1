// Interim attention: simple, obviously-correct kernels (one block per
// (query row, head), looping over keys in tiles of ATT_T). Correctness only;
// the FlashAttention-2 kernels in `flash/` replace them (see attention.rs).
//
// Masks: `bounds` null: keys 0..sk, or 0..=i when `causal`. Otherwise row i
// sees keys bounds[i] .. bounds[sq + i] (int32; a documents mask, the rows'
// ranges computed on the host from `AttnMask::visible_keys`); a row that sees
// none gets o = 0 and lse = -inf (a ring block of another document).

__device__ __forceinline__ void key_range(const int* bounds, i64 i, i64 sq, i64 sk, int causal, i64* k0, i64* nk) {
    if (bounds) {
        *k0 = bounds[i];
        *nk = bounds[sq + i];
    } else {
        *k0 = 0;
        *nk = causal ? i + 1 : sk;
    }
}

#define ATT_T 128
#define ATT_DPT 4  // head dims per thread: d <= ATT_T * ATT_DPT = 512

// Shared memory: q[d] + p[ATT_T] + red[32] floats.
extern "C" __global__ void attn_fwd_naive(const void* q, const void* k, const void* v, int dt,
                                          void* o, int odt, float* lse,
                                          i64 q_rs, i64 k_rs, i64 v_rs, i64 o_rs, i64 lse_rs,
                                          i64 sq, i64 sk, i64 hq, i64 hkv, i64 d, int causal, const int* bounds,
                                          float scale) {
    extern __shared__ float smem[];
    float* qs = smem;
    float* p = qs + d;
    float* red = p + ATT_T;
    const i64 i = blockIdx.x, h = blockIdx.y;
    const int tid = threadIdx.x;
    if (i >= sq) return;
    const i64 kh = h / (hq / hkv);
    for (i64 c = tid; c < d; c += ATT_T) qs[c] = ld(q, i * q_rs + h * d + c, dt);
    __syncthreads();
    i64 k0, nk;
    key_range(bounds, i, sq, sk, causal, &k0, &nk);
    float m = NEG_INF, l = 0.0f;
    float acc[ATT_DPT];
#pragma unroll
    for (int u = 0; u < ATT_DPT; u++) acc[u] = 0.0f;
    for (i64 j0 = k0; j0 < nk; j0 += ATT_T) {
        const i64 j = j0 + tid;
        float s = NEG_INF;
        if (j < nk) {
            float dotp = 0.0f;
            for (i64 c = 0; c < d; c++) dotp += qs[c] * ld(k, j * k_rs + kh * d + c, dt);
            s = dotp * scale;
        }
        const float mn = fmaxf(m, block_max(s, red));
        const float pj = (j < nk) ? expf(s - mn) : 0.0f;
        p[tid] = pj;
        const float ts = block_sum(pj, red);  // its barriers also publish p[]
        const float corr = expf(m - mn);
        l = l * corr + ts;
        const i64 tile = (nk - j0) < ATT_T ? (nk - j0) : ATT_T;
#pragma unroll
        for (int u = 0; u < ATT_DPT; u++) {
            const i64 c = tid + (i64)u * ATT_T;
            if (c < d) {
                float a = acc[u] * corr;
                for (i64 jj = 0; jj < tile; jj++) a += p[jj] * ld(v, (j0 + jj) * v_rs + kh * d + c, dt);
                acc[u] = a;
            }
        }
        m = mn;
        __syncthreads();  // p[] is rewritten by the next tile
    }
#pragma unroll
    for (int u = 0; u < ATT_DPT; u++) {
        const i64 c = tid + (i64)u * ATT_T;
        if (c < d) st(o, i * o_rs + h * d + c, odt, l > 0.0f ? acc[u] / l : 0.0f);
    }
    if (tid == 0) lse[i * lse_rs + h] = l > 0.0f ? m + logf(l) : NEG_INF;
}

// Backward given the final o and lse. dq, dk, dv are f32 and accumulated
// (dq row (i, h) is owned by this block; dk/dv are shared by many blocks: atomics).
// Shared memory: q[d] + dO[d] + p[ATT_T] + ds[ATT_T] + red[32] floats.
extern "C" __global__ void attn_bwd_naive(const void* q, const void* k, const void* v, int dt,
                                          const void* o, int odt, const void* dout, int dodt, const float* lse,
                                          float* dq, float* dk, float* dv,
                                          i64 q_rs, i64 k_rs, i64 v_rs, i64 o_rs, i64 do_rs, i64 lse_rs,
                                          i64 dq_rs, i64 dk_rs, i64 dv_rs,
                                          i64 sq, i64 sk, i64 hq, i64 hkv, i64 d, int causal, const int* bounds,
                                          float scale) {
    extern __shared__ float smem[];
    float* qs = smem;
    float* dos = qs + d;
    float* ps = dos + d;
    float* dss = ps + ATT_T;
    float* red = dss + ATT_T;
    const i64 i = blockIdx.x, h = blockIdx.y;
    const int tid = threadIdx.x;
    if (i >= sq) return;
    const i64 kh = h / (hq / hkv);
    float dl = 0.0f;
    for (i64 c = tid; c < d; c += ATT_T) {
        qs[c] = ld(q, i * q_rs + h * d + c, dt);
        const float g = ld(dout, i * do_rs + h * d + c, dodt);
        dos[c] = g;
        dl += g * ld(o, i * o_rs + h * d + c, odt);
    }
    const float delta = block_sum(dl, red);  // barriers publish qs/dos
    const float li = lse[i * lse_rs + h];
    i64 k0, nk;
    key_range(bounds, i, sq, sk, causal, &k0, &nk);
    float acc[ATT_DPT];
#pragma unroll
    for (int u = 0; u < ATT_DPT; u++) acc[u] = 0.0f;
    for (i64 j0 = k0; j0 < nk; j0 += ATT_T) {
        const i64 j = j0 + tid;
        float pj = 0.0f, dsj = 0.0f;
        if (j < nk) {
            float s = 0.0f, dp = 0.0f;
            for (i64 c = 0; c < d; c++) {
                s += qs[c] * ld(k, j * k_rs + kh * d + c, dt);
                dp += dos[c] * ld(v, j * v_rs + kh * d + c, dt);
            }
            pj = expf(s * scale - li);
            dsj = pj * (dp - delta) * scale;
        }
        ps[tid] = pj;
        dss[tid] = dsj;
        __syncthreads();
        const i64 tile = (nk - j0) < ATT_T ? (nk - j0) : ATT_T;
#pragma unroll
        for (int u = 0; u < ATT_DPT; u++) {
            const i64 c = tid + (i64)u * ATT_T;
            if (c < d) {
                float a = acc[u];
                for (i64 jj = 0; jj < tile; jj++) a += dss[jj] * ld(k, (j0 + jj) * k_rs + kh * d + c, dt);
                acc[u] = a;
            }
        }
        for (i64 idx = tid; idx < tile * d; idx += ATT_T) {
            const i64 jj = idx / d, c = idx - jj * d;
            atomicAdd(dk + (j0 + jj) * dk_rs + kh * d + c, dss[jj] * qs[c]);
            atomicAdd(dv + (j0 + jj) * dv_rs + kh * d + c, ps[jj] * dos[c]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int u = 0; u < ATT_DPT; u++) {
        const i64 c = tid + (i64)u * ATT_T;
        if (c < d) dq[i * dq_rs + h * d + c] += acc[u];
    }
}

// o_acc, lse_acc <- merge((o_acc, lse_acc), (o_blk, lse_blk)); one thread per (row, head).
extern "C" __global__ void lse_merge(void* oa, int oadt, float* la, const void* ob, int obdt, const float* lb,
                                     i64 rows, i64 h, i64 d) {
    GRID_STRIDE(idx, rows * h) {
        const float a = la[idx], b = lb[idx];
        const float m = fmaxf(a, b);
        if (m == NEG_INF) continue;
        const float l = m + logf(expf(a - m) + expf(b - m));
        const float wa = expf(a - l), wb = expf(b - l);
        for (i64 c = 0; c < d; c++) {
            const i64 e = idx * d + c;
            st(oa, e, oadt, wa * ld(oa, e, oadt) + wb * ld(ob, e, obdt));
        }
        la[idx] = l;
    }
}
