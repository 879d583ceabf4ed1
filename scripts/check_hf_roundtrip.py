#!/usr/bin/env python3
"""The Hugging Face round trip of `upipe train`, checked against transformers.

For a small random Llama (Llama 3 rope scaling) and a small Qwen3 (tied
embeddings), each saved by transformers in bf16 with `save_pretrained` (and
a tokenizer built locally, when the `tokenizers` package is there), this:

1. runs `upipe train --init-from SRC --steps 1 --lr 0 --save-dir DST`: the
   faithful round trip. DST must hold the same tensors bit for bit in the
   same dtype, a config.json equal to SRC's field for field, and SRC's
   tokenizer and generation files;
2. runs a real training run (`--lr 1e-3`, 3 steps) and a `--save-dtype f32`
   one;
3. loads every DST with `from_pretrained`, checks its dtype, and compares
   transformers' f32 loss on a token file with `upipe eval`'s on the same
   directory (relative difference at most 1e-5).

It prints one PASS/FAIL line per check and exits 1 if any failed. It needs
only torch, transformers and safetensors, and no network:

    python3 scripts/check_hf_roundtrip.py --upipe target/release/upipe
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open

RESULTS = []
VOCAB = 512
SEQ = 64


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def transformers_major() -> int:
    import transformers
    return int(transformers.__version__.split(".")[0])


def rope_kwargs(theta: float, scaling=None) -> dict:
    """RoPE settings as this transformers takes them: `rope_parameters` from
    version 5 on, `rope_theta` and `rope_scaling` before."""
    if transformers_major() >= 5:
        return {"rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": theta}}
    return {"rope_theta": theta, "rope_scaling": scaling}


def llama_config():
    from transformers import LlamaConfig
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, **rope_kwargs(500000.0, scaling))


def qwen3_config():
    from transformers import Qwen3Config
    return Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, **rope_kwargs(1000000.0))


def save_tokenizer(src: str) -> bool:
    """A word-level tokenizer of VOCAB entries saved beside the model; False
    (and a note) when the `tokenizers` package is missing."""
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        vocab.update({f"w{i}": i for i in range(3, VOCAB)})
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                       bos_token="<s>", eos_token="</s>")
        fast.save_pretrained(src)
        return True
    except Exception as e:  # no tokenizers package, or an API this version lacks
        print(f"note: no tokenizer written, so its copy is not checked ({e!r})")
        return False


def make_source(kind: str, root: str) -> str:
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM
    src = os.path.join(root, f"{kind}-src")
    torch.manual_seed(0)
    cfg = llama_config() if kind == "llama" else qwen3_config()
    cls = LlamaForCausalLM if kind == "llama" else Qwen3ForCausalLM
    model = cls(cfg).to(torch.bfloat16)
    model.save_pretrained(src)
    save_tokenizer(src)
    return src


def tensors(d: str) -> dict:
    """Every tensor of an HF directory's weight files, by name."""
    index = os.path.join(d, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index))["weight_map"].values()))
             if os.path.exists(index) else ["model.safetensors"])
    out = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def upipe(binary: str, *args: str) -> None:
    r = subprocess.run([binary, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"upipe {' '.join(args)} failed:\n{r.stderr}")


def train(binary, src, dst, tokens, steps, lr, *more):
    upipe(binary, "train", "--device", "cpu", "--attn", "local", "--seq", str(SEQ),
          "--model", src, "--init-from", src, "--data", tokens, "--steps", str(steps),
          "--lr", str(lr), "--warmup", "1", "--save-dir", dst, *more)


def upipe_loss(binary: str, d: str, tokens: str, root: str) -> float:
    metrics = os.path.join(root, "eval.jsonl")
    upipe(binary, "eval", "--device", "cpu", "--attn", "local", "--model-dir", d,
          "--tokens", tokens, "--metrics", metrics)
    with open(metrics) as f:
        return json.loads(f.readline())["loss"]


def hf_loss(d: str, ids: torch.Tensor) -> tuple:
    """transformers' f32 loss of the whole token file as one sequence, and
    the dtype the directory loads in."""
    from transformers import AutoModelForCausalLM
    stored = AutoModelForCausalLM.from_pretrained(d, dtype="auto").dtype
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids[None], labels=ids[None]).loss.item()
    return loss, stored


def compare_faithful(kind: str, src: str, dst: str) -> None:
    a, b = tensors(src), tensors(dst)
    ca = json.load(open(os.path.join(src, "config.json")))
    if ca.get("tie_word_embeddings") and "lm_head.weight" not in b:
        # a tied head is the embedding: upipe writes it once, as transformers 5 does
        a.pop("lm_head.weight", None)
    same = a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    check(f"{kind}: tensors bit-identical, same dtype", same, f"{len(a)} tensors")
    cb = json.load(open(os.path.join(dst, "config.json")))
    diff = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    check(f"{kind}: config.json equal field for field", not diff, f"differing: {diff}")
    for f in ["generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja"]:
        s, t = os.path.join(src, f), os.path.join(dst, f)
        if not os.path.exists(s):
            check(f"{kind}: {f} absent from the source, absent from the copy",
                  not os.path.exists(t))
            continue
        same = os.path.exists(t) and open(s, "rb").read() == open(t, "rb").read()
        check(f"{kind}: {f} copied", same)


def compare_losses(kind: str, what: str, binary: str, d: str, tokens: str, ids, root: str,
                   dtype) -> None:
    ours = upipe_loss(binary, d, tokens, root)
    theirs, stored = hf_loss(d, ids)
    check(f"{kind} {what}: from_pretrained loads {dtype}", stored == dtype, str(stored))
    rel = abs(ours - theirs) / abs(theirs)
    check(f"{kind} {what}: loss upipe eval == transformers (f32)", rel <= 1e-5,
          f"{ours:.7f} vs {theirs:.7f} (rel {rel:.1e})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upipe", default="target/release/upipe", help="the upipe binary")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="upipe-hf-roundtrip-")
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (4 * SEQ + 1,))
    tokens = os.path.join(root, "tokens.u32")
    with open(tokens, "wb") as f:
        f.write(struct.pack(f"<{ids.numel()}I", *ids.tolist()))
    for kind in ["llama", "qwen3"]:
        src = make_source(kind, root)
        faithful = os.path.join(root, f"{kind}-lr0")
        train(args.upipe, src, faithful, tokens, 1, 0)
        compare_faithful(kind, src, faithful)
        compare_losses(kind, "lr 0", args.upipe, faithful, tokens, ids, root, torch.bfloat16)
        trained = os.path.join(root, f"{kind}-trained")
        train(args.upipe, src, trained, tokens, 3, 1e-3)
        moved = any(not torch.equal(x, tensors(trained)[k]) for k, x in tensors(src).items())
        check(f"{kind} trained: weights changed", moved)
        compare_losses(kind, "trained", args.upipe, trained, tokens, ids, root, torch.bfloat16)
        wide = os.path.join(root, f"{kind}-f32")
        train(args.upipe, src, wide, tokens, 3, 1e-3, "--save-dtype", "f32")
        compare_losses(kind, "--save-dtype f32", args.upipe, wide, tokens, ids, root,
                       torch.float32)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
