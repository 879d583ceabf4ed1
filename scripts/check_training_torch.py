#!/usr/bin/env python3
"""upipe's training arithmetic checked against PyTorch + transformers, in f32
on the CPU reference backend:

1. `adamw` (and `adamw-gemma3`, the same of a small Gemma 3): six AdamW
   steps from the same small random Llama (saved by
   transformers) on the same window: upipe's loss at every step, its gradient
   norm, and the saved parameters after the sixth step against a PyTorch loop
   doing what upipe documents (mean cross-entropy over the window, the global
   gradient norm clipped to `--clip`, `torch.optim.AdamW` with no weight decay
   on norm weights, a constant learning rate).
2. `packed`: one window of several documents (`--pack documents` and `bfd`,
   documents index written beside the ids): upipe's loss at lr 0 against
   transformers' loss of each document alone (each document's own prefix,
   positions from 0), summed over the counted targets.
3. `packed-hf`: the same kind of window given whole to transformers, Llama
   and Qwen3, with `position_ids` restarting at every document (from which
   transformers builds its document mask) and no label across a boundary,
   against `upipe eval --pack documents` on the same ids and document index.

It prints one PASS/FAIL line per check and exits 1 if any failed; it needs
only torch, transformers and safetensors, and no network:

    python3 scripts/check_training_torch.py --upipe target/release/upipe
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open

RESULTS = []
VOCAB = 256
SEQ = 128
STEPS = 6
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def make_source(root: str) -> str:
    """A small random Llama saved in f32, heads and widths that every
    strategy can split."""
    from transformers import LlamaConfig, LlamaForCausalLM
    src = os.path.join(root, "src")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(src)
    return src


def make_qwen3(root: str) -> str:
    """A small random Qwen3 (QK-norm) saved in f32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    src = os.path.join(root, "qwen3")
    torch.manual_seed(1)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=0)
    Qwen3ForCausalLM(cfg).to(torch.float32).save_pretrained(src)
    return src


def gemma3_config(vocab: int, query_pre_attn_scalar: int = 48, **more):
    """A small Gemma 3 text config: sliding and global layers (window 24),
    the global RoPE linearly scaled, scores scaled by 48^-1/2 (head dim 256,
    as Gemma 3 1B-12B have it),
    tied embeddings; `rope_parameters` per layer type from transformers 5 on."""
    from transformers import Gemma3TextConfig
    import transformers
    kw = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=256,
              query_pre_attn_scalar=query_pre_attn_scalar, sliding_window=24,
              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                           "sliding_attention"],
              rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=True,
              bos_token_id=2, eos_token_id=1, pad_token_id=0, **more)
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    else:
        kw.update(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                  rope_local_base_freq=10000.0)
    return Gemma3TextConfig(**kw)


def randomize_norms(model, seed: int) -> None:
    """Gemma's norms start at zero (a scale of one): random values make the
    `1 + w` offset and the norms' gradients matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def make_gemma3(root: str) -> str:
    """A small random Gemma 3 saved in f32, its scores scaled as Gemma's own
    (`query_pre_attn_scalar` = head dim): after QK-norm a smaller scalar
    makes the softmax nearly one-hot, q's and k's gradients vanish, and
    AdamW's first step (about lr times the gradient's sign) turns their
    last-bit noise into steps of lr."""
    from transformers import Gemma3ForCausalLM
    src = os.path.join(root, "gemma3")
    torch.manual_seed(2)
    model = Gemma3ForCausalLM(gemma3_config(VOCAB, query_pre_attn_scalar=256))
    randomize_norms(model, 2)
    model.to(torch.float32).save_pretrained(src)
    return src


def write_ids(path: str, ids) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{len(ids)}I", *ids))


def write_doc_index(ids_path: str, n: int, starts) -> None:
    """`IDS.docs` as `src/data/doc_index.rs` documents it (version 1)."""
    with open(ids_path + ".docs", "wb") as f:
        f.write(b"UPIPEDIX" + struct.pack("<II", 1, 0) + struct.pack("<QQ", n, len(starts)))
        f.write(struct.pack(f"<{len(starts)}Q", *starts))


def upipe(binary: str, *args: str) -> None:
    r = subprocess.run([binary, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"upipe {' '.join(args)} failed:\n{r.stderr}")


def metrics(path: str) -> list:
    with open(path) as f:
        return [json.loads(l) for l in f if l.startswith("{")]


def tensors(d: str) -> dict:
    index = os.path.join(d, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index))["weight_map"].values()))
             if os.path.exists(index) else ["model.safetensors"])
    out = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def load(src: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model


def torch_adamw(src: str, window: torch.Tensor):
    """The PyTorch loop: per-step loss and grad norm, and the final weights."""
    model = load(src)
    model.train()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not n.endswith("norm.weight")], "weight_decay": WD},
        {"params": [p for n, p in named if n.endswith("norm.weight")], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, foreach=False)
    losses, norms = [], []
    x, y = window[None, :-1], window[None, 1:]
    for _ in range(STEPS):
        opt.zero_grad()
        logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        grads = [p.grad for _, p in named]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        if norm > CLIP:  # upipe: multiply by clip / norm when the norm exceeds clip
            for g in grads:
                g.mul_(CLIP / norm)
        opt.step()
        losses.append(loss.item())
        norms.append(norm)
    return losses, norms, {n: p.detach().clone() for n, p in model.state_dict().items()}


def check_adamw(binary: str, root: str, src: str, attn: str, family: str = "llama") -> None:
    torch.manual_seed(1)
    window = torch.randint(3, VOCAB, (SEQ + 1,))
    tokens = os.path.join(root, "window.u32")
    write_ids(tokens, window.tolist())  # exactly one window: every step takes it
    tag = attn if family == "llama" else f"{family} {attn}"
    dst = os.path.join(root, f"adamw-{family}-{attn}")
    m = os.path.join(root, f"adamw-{family}-{attn}.jsonl")
    upipe(binary, "train", "--device", "cpu", "--attn", attn, "--seq", str(SEQ),
          "--model", src, "--init-from", src, "--data", tokens, "--pack", "stream",
          "--steps", str(STEPS),
          "--lr", str(LR), "--warmup", "0", "--schedule", "constant",
          "--betas", f"{BETAS[0]},{BETAS[1]}", "--eps", str(EPS), "--weight-decay", str(WD),
          "--clip", str(CLIP), "--save-dir", dst, "--save-dtype", "f32", "--metrics", m)
    ours = metrics(m)
    losses, norms, weights = torch_adamw(src, window)
    worst = max(abs(o["loss"] - t) / abs(t) for o, t in zip(ours, losses))
    check(f"adamw {tag}: loss at each of {STEPS} steps == PyTorch (rel <= 1e-5)",
          len(ours) == STEPS and worst <= 1e-5,
          " ".join(f"{o['loss']:.6f}/{t:.6f}" for o, t in zip(ours, losses)) + f" worst {worst:.1e}")
    worst_n = max(abs(o["grad_norm"] - t) / t for o, t in zip(ours, norms))
    check(f"adamw {tag}: gradient norm at each step == PyTorch (rel <= 1e-4)", worst_n <= 1e-4,
          f"worst {worst_n:.1e}")
    saved = tensors(dst)
    head, embed = weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
    if "lm_head.weight" not in saved and head is not None and torch.equal(head, embed):
        weights.pop("lm_head.weight")  # tied: saved once, as the embedding
    diffs = {n: (saved[n].float() - w).abs().max().item() for n, w in weights.items() if n in saved}
    missing = sorted(set(weights) - set(saved))
    name, worst_w = max(diffs.items(), key=lambda kv: kv[1])
    # AdamW's step m/(sqrt(v)+eps) is scale-free: where a gradient element is
    # near zero, last-bit differences of the f32 sums move that element's
    # step by a fraction of lr. The bound is 1% of the most any element can
    # move in the run (lr per step); 5% for Gemma 3, whose GeGLU saturates
    # (gelu(g) and its slope are ~0 for g < -3, so whole rows of up_proj take
    # gradients near zero), with the elements past 1% counted.
    bound = (0.01 if family == "llama" else 0.05) * LR * STEPS
    past = sum(int(((saved[n].float() - w).abs() > 0.01 * LR * STEPS).sum())
               for n, w in weights.items() if n in saved)
    check(f"adamw {tag}: parameters after {STEPS} steps == PyTorch (max abs <= {bound:.0e})",
          not missing and worst_w <= bound,
          f"worst {name} {worst_w:.1e}; {past} elements past 1% of that; missing {missing}")


def check_packed(binary: str, root: str, src: str, pack: str) -> None:
    """Four documents filling one window exactly, each ending with EOS (id 0):
    `documents` cuts a window of SEQ + 1 ids from the stream, `bfd` packs
    whole documents into SEQ input positions."""
    g = torch.Generator().manual_seed(2)
    total = SEQ + 1 if pack == "documents" else SEQ
    lengths = [37, 20, 51, total - 37 - 20 - 51]
    docs = [torch.cat([torch.randint(3, VOCAB, (n - 1,), generator=g), torch.zeros(1, dtype=torch.long)])
            for n in lengths]
    ids = torch.cat(docs).tolist()
    tokens = os.path.join(root, f"docs-{pack}.u32")
    write_ids(tokens, ids)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    write_doc_index(tokens, len(ids), starts)
    m = os.path.join(root, f"packed-{pack}.jsonl")
    upipe(binary, "train", "--device", "cpu", "--seq", str(SEQ), "--model", src, "--init-from", src,
          "--data", tokens, "--pack", pack, "--steps", "1", "--lr", "0", "--metrics", m)
    step = metrics(m)[0]
    model = load(src)
    model.eval()
    total, counted = 0.0, 0
    with torch.no_grad():
        for d in docs:
            logits = model(input_ids=d[None, :-1]).logits.float()[0]
            total += torch.nn.functional.cross_entropy(logits, d[1:], reduction="sum").item()
            counted += len(d) - 1
    theirs = total / counted
    rel = abs(step["loss"] - theirs) / theirs
    check(f"packed {pack}: counted targets == sum of (document length - 1)",
          step.get("counted_tokens") == counted, f"{step.get('counted_tokens')} vs {counted}")
    check(f"packed {pack}: loss == transformers on each document alone (rel <= 1e-5)",
          rel <= 1e-5, f"{step['loss']:.7f} vs {theirs:.7f} (rel {rel:.1e})")


def check_packed_hf(binary: str, root: str, src: str, family: str) -> None:
    """One window of SEQ + 1 ids holding five documents (each ending with
    EOS, id 0; the last cut by the window): transformers runs it as one
    sequence with restarting `position_ids`; upipe evaluates it with its
    document index."""
    g = torch.Generator().manual_seed(3)
    lengths = [29, 1, 40, 33, SEQ + 1 - 29 - 1 - 40 - 33]
    docs = [torch.cat([torch.randint(3, VOCAB, (n - 1,), generator=g), torch.zeros(1, dtype=torch.long)])
            for n in lengths]
    ids = torch.cat(docs)
    tokens = os.path.join(root, f"hf-{family}.u32")
    write_ids(tokens, ids.tolist())
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    write_doc_index(tokens, len(ids), starts)
    out = subprocess.run([binary, "eval", "--json", "--device", "cpu", "--model-dir", src, "--tokens", tokens,
                          "--seq", str(SEQ), "--pack", "documents"],
                         check=True, capture_output=True, text=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    inputs, targets = ids[:-1], ids[1:].clone()
    positions = torch.cat([torch.arange(n) for n in lengths])[:-1]
    # a target that starts the next document is not predicted across the boundary
    for s0 in starts[1:]:
        targets[s0 - 1] = -100
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    with torch.no_grad():
        # no cache: transformers builds the document mask from restarting
        # position_ids only when it keeps no key/value cache
        logits = model(input_ids=inputs[None], position_ids=positions[None],
                       use_cache=False).logits.float()[0]
    theirs = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100).item()
    counted = int((targets != -100).sum())
    rel = abs(report["loss"] - theirs) / theirs
    check(f"packed-hf {family}: counted targets == transformers' labels",
          report.get("counted_tokens") == counted, f"{report.get('counted_tokens')} vs {counted}")
    check(f"packed-hf {family}: upipe eval == transformers on the packed window (rel <= 1e-4)",
          rel <= 1e-4, f"{report['loss']:.7f} vs {theirs:.7f} (rel {rel:.1e})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upipe", default="target/release/upipe", help="the upipe binary")
    ap.add_argument("--parts", default="adamw adamw-gemma3 packed packed-hf")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="upipe-torch-")
    src = make_source(root)
    if "adamw" in args.parts.split():
        for attn in ["local", "upipe"]:
            check_adamw(args.upipe, root, src, attn)
    parts = args.parts.split()
    if "adamw-gemma3" in parts:
        gemma = make_gemma3(root)
        for attn in ["local", "upipe"]:
            check_adamw(args.upipe, root, gemma, attn, "gemma3")
    if "packed" in parts:
        for pack in ["documents", "bfd"]:
            check_packed(args.upipe, root, src, pack)
    if "packed-hf" in parts:
        check_packed_hf(args.upipe, root, src, "llama")
        check_packed_hf(args.upipe, root, make_qwen3(root), "qwen3")
    failed = [r for r in RESULTS if not r[1]]
    print(f"{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
