#!/usr/bin/env python3
"""Model families upipe reads, checked against transformers itself.

Each section builds a tiny random model of one family with transformers,
with the fields that make the family what it is, saves it in bf16 with
`save_pretrained`, and checks upipe against it. Sections are
self-contained; run one with `--family NAME` or all by default.

`qwen2` (Qwen2 / Qwen2.5): biases on the q/k/v projections (set to random
values: transformers initialises them to zero, which would test nothing),
tied embeddings, and YaRN rope scaling (factor 4 over an original context
of 128, beta_fast 16, beta_slow 2, evaluated over 256 positions so the
interpolated frequencies matter). It checks

1. `upipe eval` (CPU, f32) on a token file against transformers' f32 loss
   of the same tokens, relative difference at most 1e-4, on one rank
   (`--attn local`) and on a staged mesh (`--attn upipe --ulysses 2
   --ring 2`, whose stages add their heads' bias rows);
2. `upipe train --lr 0` (one step): the saved directory holds the source's
   tensors bit for bit (the biases among them) and its config.json field
   for field, loads with `from_pretrained`, and gives the same loss.

It prints one PASS/FAIL line per check and exits 1 if any failed. It needs
torch, transformers and safetensors, and no network:

    python3 scripts/check_families.py --upipe gpu-bundle/bin/upipe
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


def write_tokens(root: str, n: int, seed: int) -> tuple:
    """`n` random ids as a `.u32` token file, and the ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n,), generator=g)
    path = os.path.join(root, f"tokens-{seed}.u32")
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{ids.numel()}I", *ids.tolist()))
    return path, ids


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


def upipe_loss(binary: str, d: str, tokens: str, root: str, *mesh: str) -> float:
    metrics = os.path.join(root, "eval.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    upipe(binary, "eval", "--device", "cpu", *(mesh or ("--attn", "local")), "--model-dir", d,
          "--tokens", tokens, "--metrics", metrics)
    with open(metrics) as f:
        return json.loads(f.readline())["loss"]


def hf_loss(d: str, ids: torch.Tensor) -> float:
    """transformers' f32 loss of the token file as one sequence."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids[None], labels=ids[None]).loss.item()


def compare_loss(name: str, ours: float, theirs: float, tol: float) -> None:
    rel = abs(ours - theirs) / abs(theirs)
    check(name, rel <= tol, f"{ours:.7f} vs {theirs:.7f} (rel {rel:.1e})")


# ---- qwen2 -----------------------------------------------------------------

QWEN2_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
              "beta_fast": 16.0, "beta_slow": 2.0}


def qwen2_source(root: str) -> str:
    """A tiny random Qwen2 (random q/k/v biases, tied embeddings, YaRN) saved
    in bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        max_position_embeddings=512, tie_word_embeddings=True, use_sliding_window=False,
        bos_token_id=1, eos_token_id=2, **rope_kwargs(10000.0, QWEN2_YARN))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
            assert layer.self_attn.o_proj.bias is None
    src = os.path.join(root, "qwen2-src")
    model.to(torch.bfloat16).save_pretrained(src)
    return src


def check_qwen2(binary: str, root: str) -> None:
    src = qwen2_source(root)
    saved = tensors(src)
    biases = [k for k in saved if k.endswith("_proj.bias")]
    check("qwen2: the source holds q/k/v biases (none on o_proj)",
          len(biases) == 6 and not any("o_proj" in k for k in biases), f"{sorted(biases)}")
    tokens, ids = write_tokens(root, 257, seed=1)
    theirs = hf_loss(src, ids)
    compare_loss("qwen2: upipe eval --attn local == transformers (f32, yarn, biases)",
                 upipe_loss(binary, src, tokens, root), theirs, 1e-4)
    compare_loss("qwen2: upipe eval --attn upipe --ulysses 2 --ring 2 == transformers",
                 upipe_loss(binary, src, tokens, root, "--attn", "upipe", "--ulysses", "2",
                            "--ring", "2"), theirs, 1e-4)
    dst = os.path.join(root, "qwen2-lr0")
    upipe(binary, "train", "--device", "cpu", "--attn", "local", "--seq", "64",
          "--model", src, "--init-from", src, "--data", tokens, "--steps", "1", "--lr", "0",
          "--warmup", "1", "--save-dir", dst)
    back = tensors(dst)
    if "lm_head.weight" not in back:
        saved.pop("lm_head.weight", None)  # tied: written once, as transformers 5 does
    same = saved.keys() == back.keys() and all(
        saved[k].dtype == back[k].dtype and torch.equal(saved[k], back[k]) for k in saved)
    check("qwen2 lr 0: tensors bit-identical (biases included), same dtype", same,
          f"{len(saved)} tensors")
    ca = json.load(open(os.path.join(src, "config.json")))
    cb = json.load(open(os.path.join(dst, "config.json")))
    diff = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    check("qwen2 lr 0: config.json equal field for field", not diff, f"differing: {diff}")
    compare_loss("qwen2 lr 0: from_pretrained of upipe's save == the source",
                 hf_loss(dst, ids), theirs, 1e-6)


SECTIONS = {"qwen2": check_qwen2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upipe", default="target/release/upipe", help="the upipe binary")
    ap.add_argument("--family", choices=sorted(SECTIONS), action="append",
                    help="the families to check (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="upipe-families-")
    for name in args.family or sorted(SECTIONS):
        work = os.path.join(root, name)
        os.makedirs(work, exist_ok=True)
        SECTIONS[name](args.upipe, work)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
