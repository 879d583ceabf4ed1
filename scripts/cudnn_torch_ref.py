# torch cuDNN SDPA reference on the same machine (B=1, H=16, d=128, causal, bf16).
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
H, D = 16, 128
for S in (16384, 65536):
    q, k, v = [torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    g = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16)
    iters = 3 if S >= 32768 else 10
    flops = 2.0 * S * S * H * D

    def timed(f):
        f(); torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            f()
        e1.record(); e1.synchronize()
        return e0.elapsed_time(e1) / iters

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        def fb():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.backward(g)
        tf = timed(fwd)
        tfb = timed(fb)
    print(f"| torch cuDNN | {S} | {tf:.2f} ms | {flops/tf/1e9:.1f} | {tfb:.2f} ms | {3.5*flops/tfb/1e9:.1f} |")
