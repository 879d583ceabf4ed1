// Fused softmax cross-entropy: one block per row of logits.
extern "C" __global__ void cross_entropy(const void* logits, int ldt, const unsigned* targets, i64 n, i64 vocab,
                                         float grad_scale, void* dlogits, int ddt, float* loss_sum) {
    __shared__ float sh[32];
    i64 r = blockIdx.x;
    if (r >= n) return;
    const i64 base = r * vocab;
    unsigned t = targets[r];
    if (t == IGNORE_ID) {
        for (i64 j = threadIdx.x; j < vocab; j += blockDim.x) st(dlogits, base + j, ddt, 0.0f);
        return;
    }
    float m = NEG_INF;
    for (i64 j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, ld(logits, base + j, ldt));
    m = block_max(m, sh);
    float s = 0.0f;
    for (i64 j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(ld(logits, base + j, ldt) - m);
    s = block_sum(s, sh);
    float lse = m + logf(s);
    for (i64 j = threadIdx.x; j < vocab; j += blockDim.x) {
        float g = grad_scale * expf(ld(logits, base + j, ldt) - lse);
        if (j == (i64)t) g -= grad_scale;
        st(dlogits, base + j, ddt, g);
    }
    if (threadIdx.x == 0) atomicAdd(loss_sum, lse - ld(logits, base + t, ldt));
}
