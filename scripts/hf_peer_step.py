"""The HF transformers + PyTorch peer of `upipe train` on one GPU.

Llama 3.2 1B architecture (random init), one sequence of SEQ tokens per step,
bf16 parameters, fused torch AdamW, SDPA with cuDNN first, a chunked
cross-entropy of 4096 rows (each chunk checkpointed, so the logits of one
chunk exist at a time) and, with `--checkpoint`, non-reentrant activation
checkpointing of every decoder layer. Prints one JSON line per step: tokens/s,
the step's peak of allocated GPU memory, the loss.

With `--doc-lengths FILE` (one document length per line, as
`scripts/doc_mix.py` writes them; each document then ends with one more
token, its EOS) the window is packed: `position_ids` restart at every
document start, which transformers turns into a document mask (a packed
sequence) for the attention implementation in use.

    python3 scripts/hf_peer_step.py --seq 32768 --steps 3
    python3 scripts/hf_peer_step.py --seq 262144 --steps 2 --checkpoint
    python3 scripts/hf_peer_step.py --seq 131072 --steps 2 --checkpoint --doc-lengths mix.jsonl.lengths
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig, LlamaForCausalLM

LOSS_ROWS = 4096


def llama32_1b() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=1 << 20, tie_word_embeddings=True,
        attn_implementation="sdpa")


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
    hidden = model.model(input_ids=tokens[:, :-1],
                         position_ids=positions).last_hidden_state[0]  # [s, hidden]
    labels = tokens[0, 1:]
    total = hidden.new_zeros((), dtype=torch.float32)
    for r in range(0, hidden.shape[0], LOSS_ROWS):
        total = total + checkpoint(chunk_loss, model.lm_head, hidden[r:r + LOSS_ROWS],
                                   labels[r:r + LOSS_ROWS], use_reentrant=False)
    return total / labels.numel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--doc-lengths", help="pack the window: one document length per line")
    args = ap.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(llama32_1b()).to(torch.bfloat16)
    if args.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 128256, (1, args.seq + 1), device="cuda")
    positions = packed_positions(args.doc_lengths, args.seq) if args.doc_lengths else None
    docs = 1 if positions is None else int((positions[0] == 0).sum())
    policy = "checkpoint" if args.checkpoint else "none"
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
        for step in range(1, args.steps + 1):
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step_loss(model, tokens, positions)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(json.dumps({"peer": "hf", "seq": args.seq, "policy": policy, "step": step,
                              "documents": docs,
                              "attn_implementation": model.config._attn_implementation,
                              "tokens_per_s": round(args.seq / dt, 1),
                              "peak_bytes": torch.cuda.max_memory_allocated(),
                              "loss": round(loss.item(), 5)}, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
