// Fused softmax cross-entropy: one block per row of logits, two passes over
// the row. The first keeps each thread's running max and its sum of
// exp(x - max) (one exp per element) and merges them across the block; the
// second writes the gradient. bf16 rows of a length that is a multiple of 8,
// 16-byte aligned, move 8 elements per load and store.

// Folds x into the running (max m, sum s of exp(. - m)).
__device__ __forceinline__ void online_add(float x, float& m, float& s) {
    if (x > m) {
        s = s * expf(m - x) + 1.0f;  // exp(-inf) = 0 for the first element
        m = x;
    } else if (x != NEG_INF) {
        s += expf(x - m);
    }
}

// online_add of 8 elements: one rescale for their max.
__device__ __forceinline__ void online_add8(const float* f, float& m, float& s) {
    float m8 = f[0];
    for (int i = 1; i < 8; i++) m8 = fmaxf(m8, f[i]);
    if (m8 == NEG_INF) return;
    if (m8 > m) {
        s = (m == NEG_INF) ? 0.0f : s * expf(m - m8);
        m = m8;
    }
    for (int i = 0; i < 8; i++) s += expf(f[i] - m);
}

// The row's log-sum-exp from each thread's running (m, s).
__device__ float block_lse(float m, float s, float* sh) {
    float mx = block_max(m, sh);
    s = (m == NEG_INF) ? 0.0f : s * expf(m - mx);
    s = block_sum(s, sh);
    return mx + logf(s);
}

extern "C" __global__ void cross_entropy(const void* logits, int ldt, const unsigned* targets, i64 n, i64 vocab,
                                         float grad_scale, void* dlogits, int ddt, float* loss_sum) {
    __shared__ float sh[32];
    i64 r = blockIdx.x;
    if (r >= n) return;
    const i64 base = r * vocab;
    const unsigned t = targets[r];
    const bool vec = ldt == DT_BF16 && ddt == DT_BF16 && (vocab & 7) == 0 &&
                     ((((unsigned long long)logits) | ((unsigned long long)dlogits)) & 15) == 0;
    const int nv = (int)(vocab >> 3);
    const uint4* lv = (const uint4*)((const bf16_t*)logits + base);
    uint4* dv = (uint4*)((bf16_t*)dlogits + base);
    if (t == IGNORE_ID) {
        if (vec)
            for (int k = threadIdx.x; k < nv; k += blockDim.x) dv[k] = make_uint4(0, 0, 0, 0);
        else
            for (i64 j = threadIdx.x; j < vocab; j += blockDim.x) st(dlogits, base + j, ddt, 0.0f);
        return;
    }
    float m = NEG_INF, s = 0.0f;
    if (vec) {
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            float f[8];
            unpack8(lv[k], f);
            online_add8(f, m, s);
        }
    } else {
        for (i64 j = threadIdx.x; j < vocab; j += blockDim.x) online_add(ld(logits, base + j, ldt), m, s);
    }
    // read before the gradient is written (dlogits may alias logits)
    const float target_logit = ld(logits, base + t, ldt);
    const float lse = block_lse(m, s, sh);
    if (vec) {
        for (int k = threadIdx.x; k < nv; k += blockDim.x) {
            float f[8];
            unpack8(lv[k], f);
            for (int i = 0; i < 8; i++) {
                f[i] = grad_scale * expf(f[i] - lse);
                if ((i64)k * 8 + i == (i64)t) f[i] -= grad_scale;
            }
            dv[k] = pack8(f);
        }
    } else {
        for (i64 j = threadIdx.x; j < vocab; j += blockDim.x) {
            float g = grad_scale * expf(ld(logits, base + j, ldt) - lse);
            if (j == (i64)t) g -= grad_scale;
            st(dlogits, base + j, ddt, g);
        }
    }
    if (threadIdx.x == 0) atomicAdd(loss_sum, lse - target_logit);
}
