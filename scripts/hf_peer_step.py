"""The HF transformers + PyTorch peer of `upipe train` on one GPU.

A Llama architecture (`--model`: Llama 3.2 1B or Llama3-8B, HF dims, random
init) or Qwen2.5-7B (`qwen2.5-7b-instruct`: its HF config, biases on q/k/v), one sequence of SEQ tokens per step, bf16 parameters, fused torch
AdamW, SDPA with cuDNN first, no KV cache (`use_cache` off, as in training)
and, with `--checkpoint`, non-reentrant activation checkpointing of every
decoder layer. Prints one JSON line per step: tokens/s, the step's peak of
allocated GPU memory, the loss.

The loss is the mean cross-entropy of the SEQ next tokens. The plain peer
(`"peer": "hf"`) computes it in chunks of 4096 rows, each checkpointed, so
the logits of one chunk exist at a time. With `--liger` (`"peer":
"hf+liger"`) Liger Kernel is applied the way its users do, before the model
is built: `apply_liger_kernel_to_llama(rope=True, rms_norm=True,
swiglu=True, fused_linear_cross_entropy=True)` swaps in its RMSNorm, SwiGLU
MLP and RoPE kernels, and the model's own forward, given the targets as
`shift_labels`, computes the loss with Liger's fused linear cross-entropy,
which never builds the logits (the script checks that none came back).

With `--lora-rank R` (`"peer": "hf+peft"`, or `"hf+liger+peft"` with
`--liger`) PEFT wraps the model as its users do: `get_peft_model` with
`LoraConfig(r=R, lora_alpha=2R, target_modules="all-linear",
lora_dropout=0)`, so every linear layer of the blocks (not the LM head) gets
an adapter, the base is frozen and AdamW updates the adapters only. With
`--checkpoint` the model's input embeddings are marked as requiring a
gradient (`enable_input_require_grads`, as PEFT's guides say), so the
checkpointed layers' backward runs although the embedding is frozen.

With `--doc-lengths FILE` (one document length per line, as
`scripts/doc_mix.py` writes them; each document then ends with one more
token, its EOS) the window is packed: `position_ids` restart at every
document start, which transformers turns into a document mask (a packed
sequence) for the attention implementation in use.

With `--profile` the last step runs under `torch.profiler` and one more
JSON line gives its GPU kernel time by class (GEMM, attention forward and
backward, Triton, elementwise, copies, optimizer, other), the top kernels,
and the cuDNN and cuBLAS torch loaded: the peer's side of upipe's
`--profile`.

A step that runs out of GPU memory prints one JSON line with `"oom": true`
and the script exits 0, so a sweep goes on.

    python3 scripts/hf_peer_step.py --seq 32768 --steps 3
    python3 scripts/hf_peer_step.py --seq 262144 --steps 2 --checkpoint --liger
    python3 scripts/hf_peer_step.py --model llama3-8b --seq 65536 --steps 3 --checkpoint --liger
    python3 scripts/hf_peer_step.py --model llama3-8b --seq 131072 --steps 2 --checkpoint --lora-rank 16
    python3 scripts/hf_peer_step.py --seq 131072 --steps 2 --checkpoint --doc-lengths mix.jsonl.lengths
    python3 scripts/hf_peer_step.py --seq 32768 --steps 3 --liger --profile
"""

import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

LOSS_ROWS = 4096
VOCAB = 128256

# HF config fields of each model: hidden, layers, heads, ffn, RoPE scaling factor, tied embeddings
MODELS = {
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                        intermediate_size=8192, factor=32.0, tie_word_embeddings=True),
    # Llama 3.1 RoPE settings, as upipe's `llama3-8b` preset (Llama 3.0's weight shapes)
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      intermediate_size=14336, factor=8.0, tie_word_embeddings=False),
}


# Qwen2.5-7B(-Instruct)'s config.json: what upipe's `qwen2.5-7b-instruct` preset reads
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, tie_word_embeddings=False)


# Gemma 3 4B's text config (`upipe`'s `gemma3-4b` preset): the published
# text_config with Gemma3TextConfig's defaults for what it leaves out
GEMMA3_4B = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                 num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                 query_pre_attn_scalar=256, sliding_window=1024, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)


def vocab_of(name: str) -> int:
    return {"qwen2.5-7b-instruct": QWEN25_7B["vocab_size"],
            "gemma3-4b": GEMMA3_4B["vocab_size"]}.get(name, VOCAB)


def gemma3_model() -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    import transformers
    rope = ({"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
        if int(transformers.__version__.split(".")[0]) >= 5 else
        {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
         "rope_local_base_freq": 10000.0})
    cfg = Gemma3TextConfig(max_position_embeddings=1 << 20, use_cache=False,
                           attn_implementation="sdpa", **GEMMA3_4B, **rope)
    return Gemma3ForCausalLM(cfg)


def build_model(name: str) -> torch.nn.Module:
    """The model `name`, random init, on the current device."""
    if name == "gemma3-4b":
        return gemma3_model()
    if name == "qwen2.5-7b-instruct":
        cfg = Qwen2Config(max_position_embeddings=1 << 20, use_cache=False,
                          attn_implementation="sdpa", **QWEN25_7B)
        return Qwen2ForCausalLM(cfg)
    return LlamaForCausalLM(llama_config(name))


def llama_config(name: str) -> LlamaConfig:
    dims = dict(MODELS[name])
    factor = dims.pop("factor")
    return LlamaConfig(
        vocab_size=VOCAB, num_key_value_heads=8,
        head_dim=dims["hidden_size"] // dims["num_attention_heads"],
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=1 << 20, use_cache=False, attn_implementation="sdpa", **dims)


def apply_liger(name: str) -> None:
    """Liger's kernels into transformers' classes of `name` (before a model is built)."""
    from liger_kernel.transformers import (apply_liger_kernel_to_gemma3_text,
                                           apply_liger_kernel_to_llama,
                                           apply_liger_kernel_to_qwen2)
    if name == "gemma3-4b":
        apply_liger_kernel_to_gemma3_text(rope=True, rms_norm=True, geglu=True,
                                          cross_entropy=False, fused_linear_cross_entropy=True)
        return
    apply = apply_liger_kernel_to_qwen2 if name == "qwen2.5-7b-instruct" else apply_liger_kernel_to_llama
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)


def liger_modules(model: torch.nn.Module) -> dict:
    """Liger's version, how many modules of each Liger class the model holds,
    and whether RoPE is Liger's."""
    import sys
    from importlib.metadata import version
    counts: dict = {"version": version("liger_kernel")}
    for m in model.modules():
        name = type(m).__name__
        if name.startswith("Liger"):
            counts[name] = counts.get(name, 0) + 1
    modeling = sys.modules[type(model).__module__]  # modeling_llama or modeling_qwen2
    counts["rope"] = modeling.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
    return counts


def apply_peft(model: LlamaForCausalLM, rank: int, checkpointing: bool) -> None:
    """PEFT's LoRA on every linear layer of the blocks, in place: the base
    frozen, the adapters trained (B zero, A Kaiming-uniform)."""
    from peft import LoraConfig, get_peft_model
    get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                     lora_dropout=0.0, task_type="CAUSAL_LM"))
    if checkpointing:
        model.enable_input_require_grads()


def peer_name(args: argparse.Namespace) -> str:
    return "hf" + ("+liger" if args.liger else "") + ("+peft" if args.lora_rank else "")


def chunk_loss(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # hidden [rows, hidden] -> summed cross-entropy of these rows (f32 logits)
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, reduction="sum")


def packed_positions(path: str, seq: int) -> torch.Tensor:
    """[1, seq] positions restarting at each document of the lengths file."""
    pos, n = [], 0
    for line in open(path):
        if not line.strip():
            continue
        doc = int(line) + 1  # the document's EOS
        take = min(doc, seq - n)
        pos.extend(range(take))
        n += take
        if n == seq:
            break
    pos.extend(range(seq - n))  # the data ran out: the rest is one document
    return torch.tensor(pos, device="cuda").unsqueeze(0)


def step_loss(model: LlamaForCausalLM, tokens: torch.Tensor,
              positions: torch.Tensor | None) -> torch.Tensor:
    """The plain peer: mean cross-entropy of tokens[1:] in checkpointed chunks."""
    hidden = model.model(input_ids=tokens[:, :-1],
                         position_ids=positions).last_hidden_state[0]  # [s, hidden]
    labels = tokens[0, 1:]
    total = hidden.new_zeros((), dtype=torch.float32)
    for r in range(0, hidden.shape[0], LOSS_ROWS):
        total = total + checkpoint(chunk_loss, model.lm_head, hidden[r:r + LOSS_ROWS],
                                   labels[r:r + LOSS_ROWS], use_reentrant=False)
    return total / labels.numel()


def liger_step_loss(model: LlamaForCausalLM, tokens: torch.Tensor,
                    positions: torch.Tensor | None) -> torch.Tensor:
    """HF + Liger: the model's forward with the targets tokens[1:] (already
    shifted, so the same SEQ tokens as the plain peer) runs Liger's fused
    linear cross-entropy; its mean reduction is over those SEQ tokens."""
    out = model(input_ids=tokens[:, :-1], position_ids=positions, shift_labels=tokens[:, 1:])
    if out.logits is not None:
        raise RuntimeError("Liger's fused linear cross-entropy did not run: the model returned logits")
    return out.loss


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel by its name, as upipe's `--profile` groups its ops."""
    n = name.lower()
    if any(k in n for k in ("fmha", "flash", "sdpa", "cudnn_generated", "attention")):
        return "attn_bwd" if any(k in n for k in ("bprop", "bwd", "backward", "dq", "dkdv")) else "attn_fwd"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "matmul", "cublas")):
        return "gemm"
    if any(k in n for k in ("adam", "multi_tensor", "foreach")):
        return "optimizer"
    if "triton" in n or n.startswith("_") and "kernel" in n:
        return "triton"
    if any(k in n for k in ("copy", "memcpy", "memset", "cat", "fill")):
        return "copy"
    if "elementwise" in n or "reduce" in n or "vectorized" in n:
        return "elementwise"
    return "other"


def profile_report(prof, step_s: float) -> dict:
    """Kernel time of the profiled step by class, and the ten longest kernels."""
    by_class: dict[str, list] = {}
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time
        c = by_class.setdefault(kernel_class(e.name), [0.0, 0])
        c[0] += us
        c[1] += 1
        k = by_name.setdefault(e.name, [0.0, 0])
        k[0] += us
        k[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:10]
    return {
        "step_ms": round(step_s * 1e3, 1),
        "classes": {c: {"ms": round(v[0] / 1e3, 2), "kernels": v[1]} for c, v in
                    sorted(by_class.items(), key=lambda kv: -kv[1][0])},
        "top": [{"name": n[:120], "ms": round(v[0] / 1e3, 2), "calls": v[1]} for n, v in top],
        "cudnn": torch.backends.cudnn.version(),
        "cuda": torch.version.cuda,
        "nvidia_wheels": nvidia_wheels(),
    }


def nvidia_wheels() -> dict:
    """The versions of the pip cuBLAS and cuDNN wheels torch loads, where pip installed them."""
    import importlib.metadata as md
    found = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("nvidia-cublas", "nvidia-cudnn")):
            found[name] = dist.version
    return found


def report(args: argparse.Namespace, **fields) -> None:
    line = {"peer": peer_name(args), "model": args.model, "seq": args.seq,
            "policy": "checkpoint" if args.checkpoint else "none", **fields}
    print(json.dumps(line, separators=(",", ":")), flush=True)


def train(args: argparse.Namespace, progress: dict) -> None:
    """Builds the model and runs the steps; `progress["step"]` is the step running."""
    torch.manual_seed(0)
    if args.liger:
        apply_liger(args.model)
    with torch.device("cuda"):
        model = build_model(args.model).to(torch.bfloat16)
    if args.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank:
        # the adapters join the model's own modules: `model` stays the LlamaForCausalLM
        apply_peft(model, args.lora_rank, args.checkpoint)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab_of(args.model), (1, args.seq + 1), device="cuda")
    positions = packed_positions(args.doc_lengths, args.seq) if args.doc_lengths else None
    docs = 1 if positions is None else int((positions[0] == 0).sum())
    loss_fn = liger_step_loss if args.liger else step_loss
    extra = {"liger": liger_modules(model)} if args.liger else {}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
        for step in range(1, args.steps + 1):
            progress["step"] = step
            profiled = args.profile and step == args.steps
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) \
                if profiled else contextlib.nullcontext()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with prof:
                loss = loss_fn(model, tokens, positions)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if profiled:
                report(args, step=step, profile=profile_report(prof, dt))
            report(args, step=step, documents=docs,
                   attn_implementation=model.config._attn_implementation,
                   tokens_per_s=round(args.seq / dt, 1),
                   peak_bytes=torch.cuda.max_memory_allocated(),
                   loss=round(loss.item(), 5), trained_params=sum(p.numel() for p in trained),
                   **extra)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS) + ["qwen2.5-7b-instruct", "gemma3-4b"],
                    default="llama3.2-1b")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--liger", action="store_true",
                    help="Liger Kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="PEFT LoRA of this rank on all linear layers (0: full fine-tuning)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the last step: GPU kernel time by class (its tokens/s is then not comparable)")
    ap.add_argument("--doc-lengths", help="pack the window: one document length per line")
    args = ap.parse_args()
    progress = {"step": 0}  # 0 while the model is built
    try:
        train(args, progress)
    except torch.cuda.OutOfMemoryError as e:
        report(args, step=progress["step"], oom=True, error=str(e).splitlines()[0][:300],
               peak_bytes=torch.cuda.max_memory_allocated())


if __name__ == "__main__":
    main()
