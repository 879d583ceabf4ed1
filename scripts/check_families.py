#!/usr/bin/env python3
"""Model families against transformers itself, one section per family.

Each section makes a small random model with transformers (its real config
fields), saves it, and checks upipe on it: `upipe eval`'s f32 loss against
transformers' f32 loss on the same tokens, and the `upipe train --lr 0`
round trip (same tensors in the same dtype, config.json equal field for
field, `from_pretrained` loads it with the same loss).

Sections (`--family`, default all):

- gemma3: a Gemma3ForCausalLM with sliding and global layers, random norm
  weights (each scaling by `1 + w`), scores scaled by
  `query_pre_attn_scalar`: upipe eval (local, UPipe 2x2, a ring of 4) in
  f32 against transformers (1e-5), the `--lr 0` round trip, the text model
  of a Gemma3ForConditionalGeneration checkpoint, and with `--cuda` bf16 on
  cuDNN and the native kernels;

- qwen2 (Qwen2 / Qwen2.5): biases on the q/k/v projections (set to random
  values: transformers initialises them to zero, which would test nothing),
  tied embeddings, and YaRN rope scaling (factor 4 over an original context
  of 128, beta_fast 16, beta_slow 2, evaluated over 256 positions so the
  interpolated frequencies matter): upipe eval on `local` and on a staged
  mesh (`--attn upipe --ulysses 2 --ring 2`, whose stages add their heads'
  bias rows) against transformers, and the `--lr 0` round trip with the
  biases bit for bit;

- mistral: a MistralForCausalLM with a sliding window shorter than the
  sequence (transformers' eager attention, which applies the window as a
  mask): upipe eval on `local`, a zigzag ring and USP against transformers;
  the same weights without the window give another loss in both (so the
  window is really applied on each side); with `--cuda`, `upipe eval
  --device cuda` (bf16, the flash kernels under the window's row bounds)
  too, to bf16 tolerance.

- gemma3-lora: upipe trains a LoRA adapter on the tiny random Gemma 3 and
  saves it; PeftModel.from_pretrained on Gemma3ForCausalLM loads it and
  gives upipe eval --lora-from's f32 loss (1e-4), the adapter moving the
  loss and a copy with one lora_B doubled failing; with `--cuda`, also for
  an adapter trained on the GPU.

It prints one PASS/FAIL line per check and exits 1 if any failed. It needs
torch, transformers and safetensors (and peft for gemma3-lora), and no
network:

    python3 scripts/check_families.py --upipe gpu-bundle/bin/upipe --cuda
    python3 scripts/check_families.py --upipe gpu-bundle/bin/upipe --family gemma3-lora
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


# ---- shared by every section ----

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


def write_tokens(root: str, ids: torch.Tensor) -> str:
    path = os.path.join(root, "tokens.u32")
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{ids.numel()}I", *ids.tolist()))
    return path


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


def upipe_loss(binary: str, d: str, tokens: str, root: str, *more: str) -> float:
    """`upipe eval`'s loss of the whole token file as one sequence."""
    metrics = os.path.join(root, "eval.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    upipe(binary, "eval", "--model-dir", d, "--tokens", tokens, "--metrics", metrics, *more)
    with open(metrics) as f:
        return json.loads(f.readline())["loss"]


def hf_loss(d: str, ids: torch.Tensor, **overrides) -> tuple:
    """transformers' f32 loss of `ids` as one sequence (eager attention,
    which applies every mask the config asks for), and the dtype the
    directory loads in."""
    from transformers import AutoModelForCausalLM
    stored = AutoModelForCausalLM.from_pretrained(d, dtype="auto").dtype
    model = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", **overrides)
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids[None], labels=ids[None]).loss.item()
    return loss, stored


def close(name: str, ours: float, theirs: float, tol: float) -> None:
    rel = abs(ours - theirs) / abs(theirs)
    check(name, rel <= tol, f"{ours:.7f} vs {theirs:.7f} (rel {rel:.1e}, limit {tol:.0e})")


def compare_faithful(kind: str, src: str, dst: str) -> None:
    a, b = tensors(src), tensors(dst)
    same = a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    check(f"{kind}: tensors bit-identical, same dtype", same, f"{len(a)} tensors")
    ca = json.load(open(os.path.join(src, "config.json")))
    cb = json.load(open(os.path.join(dst, "config.json")))
    diff = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    check(f"{kind}: config.json equal field for field", not diff, f"differing: {diff}")


# ---- mistral: a sliding window shorter than the sequence ----

MISTRAL_SEQ = 128
MISTRAL_WINDOW = 24
MISTRAL_VOCAB = 512


def mistral_source(root: str) -> str:
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(
        vocab_size=MISTRAL_VOCAB, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
        sliding_window=MISTRAL_WINDOW, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager", **rope_kwargs(1000000.0))
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).to(torch.bfloat16)
    src = os.path.join(root, "mistral-src")
    model.save_pretrained(src)
    saved = json.load(open(os.path.join(src, "config.json")))
    check("mistral: transformers saved sliding_window", saved.get("sliding_window") == MISTRAL_WINDOW,
          str(saved.get("sliding_window")))
    return src


def check_mistral(binary: str, root: str, cuda: bool) -> None:
    torch.manual_seed(1)
    ids = torch.randint(3, MISTRAL_VOCAB, (MISTRAL_SEQ + 1,))
    tokens = write_tokens(root, ids)
    src = mistral_source(root)
    theirs, _ = hf_loss(src, ids)
    full, _ = hf_loss(src, ids, sliding_window=None)
    check("mistral: transformers' loss depends on the window", abs(full - theirs) > 1e-4,
          f"windowed {theirs:.6f}, unwindowed {full:.6f}")
    meshes = [("local", ["--attn", "local"]), ("ring 4", ["--attn", "ring", "--ring", "4"]),
              ("usp 2x2", ["--attn", "usp", "--ulysses", "2", "--ring", "2"])]
    for name, mesh in meshes:
        ours = upipe_loss(binary, src, tokens, root, "--device", "cpu", *mesh)
        close(f"mistral: upipe eval ({name}, f32) == transformers (f32)", ours, theirs, 1e-4)
    dst = os.path.join(root, "mistral-lr0")
    upipe(binary, "train", "--device", "cpu", "--attn", "ring", "--ring", "2",
          "--seq", str(MISTRAL_SEQ), "--model", src, "--init-from", src, "--data", tokens,
          "--steps", "1", "--lr", "0", "--warmup", "1", "--save-dir", dst)
    compare_faithful("mistral", src, dst)
    loaded, stored = hf_loss(dst, ids)
    check("mistral lr 0: from_pretrained loads bfloat16", stored == torch.bfloat16, str(stored))
    check("mistral lr 0: from_pretrained keeps the window",
          json.load(open(os.path.join(dst, "config.json"))).get("sliding_window") == MISTRAL_WINDOW)
    close("mistral lr 0: transformers' loss of the saved model", loaded, theirs, 1e-6)
    ours = upipe_loss(binary, dst, tokens, root, "--device", "cpu", "--attn", "local")
    close("mistral lr 0: upipe eval == transformers (f32)", ours, loaded, 1e-4)
    unwindowed = os.path.join(root, "mistral-unwindowed")
    shutil.copytree(src, unwindowed)
    cfg = json.load(open(os.path.join(unwindowed, "config.json")))
    cfg["sliding_window"] = None
    json.dump(cfg, open(os.path.join(unwindowed, "config.json"), "w"))
    ours = upipe_loss(binary, unwindowed, tokens, root, "--device", "cpu", "--attn", "local")
    close("mistral without its window: upipe eval == transformers (f32)", ours, full, 1e-4)
    if cuda:
        for name, mesh in meshes[:2]:
            ours = upipe_loss(binary, src, tokens, root, "--device", "cuda", *mesh)
            close(f"mistral: upipe eval --device cuda ({name}, bf16) == transformers (f32)",
                  ours, theirs, 2e-2)


# ---- qwen2: q/k/v biases, tied embeddings, YaRN ----

QWEN2_VOCAB = 512
QWEN2_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
              "beta_fast": 16.0, "beta_slow": 2.0}


def qwen2_source(root: str) -> str:
    """A tiny random Qwen2 (random q/k/v biases, tied embeddings, YaRN) saved
    in bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(
        vocab_size=QWEN2_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
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


def check_qwen2(binary: str, root: str, _cuda: bool) -> None:
    src = qwen2_source(root)
    saved = tensors(src)
    biases = [k for k in saved if k.endswith("_proj.bias")]
    check("qwen2: the source holds q/k/v biases (none on o_proj)",
          len(biases) == 6 and not any("o_proj" in k for k in biases), f"{sorted(biases)}")
    ids = torch.randint(3, QWEN2_VOCAB, (257,), generator=torch.Generator().manual_seed(1))
    tokens = write_tokens(root, ids)
    theirs = hf_loss(src, ids)[0]
    cpu = ("--device", "cpu")
    close("qwen2: upipe eval --attn local == transformers (f32, yarn, biases)",
          upipe_loss(binary, src, tokens, root, *cpu, "--attn", "local"), theirs, 1e-4)
    close("qwen2: upipe eval --attn upipe --ulysses 2 --ring 2 == transformers",
          upipe_loss(binary, src, tokens, root, *cpu, "--attn", "upipe", "--ulysses", "2",
                     "--ring", "2"), theirs, 1e-4)
    dst = os.path.join(root, "qwen2-lr0")
    upipe(binary, "train", *cpu, "--attn", "local", "--seq", "64", "--init-from", src,
          "--data", tokens, "--steps", "1", "--lr", "0", "--warmup", "1", "--save-dir", dst)
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
    close("qwen2 lr 0: from_pretrained of upipe's save == the source",
          hf_loss(dst, ids)[0], theirs, 1e-6)


# ---- gemma3: sandwich norms, GeGLU, local and global layers ----

GEMMA_SEQ = 128
GEMMA_VOCAB = 512


def gemma3_source(root: str) -> str:
    """A tiny random Gemma3ForCausalLM (random norm weights) saved in bf16."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_training_torch import gemma3_config, randomize_norms
    from transformers import Gemma3ForCausalLM
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(gemma3_config(GEMMA_VOCAB))
    randomize_norms(model, 0)
    src = os.path.join(root, "gemma3-src")
    model.to(torch.bfloat16).save_pretrained(src)
    return src


def gemma3_multimodal(root: str, text_src: str) -> str:
    """The same text model inside a Gemma3ForConditionalGeneration with a
    tiny vision tower, saved as transformers saves it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from check_training_torch import gemma3_config
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration,
                              SiglipVisionConfig)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=gemma3_config(GEMMA_VOCAB).to_dict(),
                       vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=GEMMA_VOCAB - 1, boi_token_index=GEMMA_VOCAB - 3,
                       eoi_token_index=GEMMA_VOCAB - 2)
    model = Gemma3ForConditionalGeneration(cfg)
    text = tensors(text_src)
    with torch.no_grad():
        lm = model.get_decoder() if hasattr(model, "get_decoder") else model.language_model
        for n, p in lm.named_parameters():
            p.copy_(text["model." + n].float())
    dst = os.path.join(root, "gemma3-mm")
    model.to(torch.bfloat16).save_pretrained(dst)
    return dst


def check_gemma3(binary: str, root: str, cuda: bool) -> None:
    src = gemma3_source(root)
    ids = torch.randint(3, GEMMA_VOCAB - 3, (GEMMA_SEQ + 1,),
                        generator=torch.Generator().manual_seed(1))
    tokens = write_tokens(root, ids)
    theirs, _ = hf_loss(src, ids)
    cpu = ("--device", "cpu")
    meshes = [("local", ["--attn", "local"]), ("upipe 2x2", ["--attn", "upipe", "--ulysses", "2",
                                                            "--ring", "2"]),
              ("ring 4", ["--attn", "ring", "--ring", "4"])]
    for name, mesh in meshes:
        close(f"gemma3: upipe eval ({name}, f32) == transformers (f32)",
              upipe_loss(binary, src, tokens, root, *cpu, *mesh), theirs, 1e-5)
    dst = os.path.join(root, "gemma3-lr0")
    upipe(binary, "train", *cpu, "--attn", "local", "--seq", "64", "--init-from", src,
          "--model", src, "--data", tokens, "--steps", "1", "--lr", "0", "--warmup", "1",
          "--save-dir", dst)
    compare_faithful("gemma3", src, dst)
    close("gemma3 lr 0: from_pretrained of upipe's save == the source",
          hf_loss(dst, ids)[0], theirs, 1e-6)
    try:
        mm = gemma3_multimodal(root, src)
    except Exception as e:  # an API this transformers lacks: say so
        check("gemma3: a Gemma3ForConditionalGeneration checkpoint is made", False, repr(e))
        mm = None
    if mm:
        close("gemma3 multimodal: upipe eval of its text model == the text model's loss",
              upipe_loss(binary, mm, tokens, root, *cpu, "--attn", "local"), theirs, 1e-5)
    if cuda:
        for name, mesh in meshes[:2]:
            close(f"gemma3: upipe eval --device cuda ({name}, bf16) == transformers (f32)",
                  upipe_loss(binary, src, tokens, root, "--device", "cuda", *mesh), theirs,
                  2e-2)
            close(f"gemma3: upipe eval --device cuda --attn-kernel native ({name}, bf16)",
                  upipe_loss(binary, src, tokens, root, "--device", "cuda", "--attn-kernel",
                             "native", *mesh), theirs, 2e-2)


# ---- gemma3-lora: an adapter upipe trains, loaded by PEFT ----

LORA_SEQ = 64


def peft_loss(src: str, adapter, ids: torch.Tensor) -> float:
    """The f32 loss of `ids` by Gemma3ForCausalLM from `src` (eager
    attention), through PeftModel.from_pretrained of `adapter` when given."""
    from peft import PeftModel
    from transformers import Gemma3ForCausalLM
    model = Gemma3ForCausalLM.from_pretrained(src, dtype=torch.float32,
                                              attn_implementation="eager")
    if adapter:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids[None], labels=ids[None]).loss.item()


def doubled_lora_b(adapter: str, dst: str) -> str:
    """A copy of `adapter` with its first lora_B doubled: a copy the loss
    check must tell apart."""
    from safetensors.torch import save_file
    os.makedirs(dst)
    shutil.copy(os.path.join(adapter, "adapter_config.json"), dst)
    st = {}
    with safe_open(os.path.join(adapter, "adapter_model.safetensors"), "pt") as f:
        for k in f.keys():
            st[k] = f.get_tensor(k)
    key = sorted(k for k in st if ".lora_B." in k)[0]
    st[key] = st[key] * 2
    save_file(st, os.path.join(dst, "adapter_model.safetensors"), metadata={"format": "pt"})
    return dst


def check_gemma3_lora(binary: str, root: str, cuda: bool) -> None:
    """upipe trains a LoRA adapter (all seven targets) on the tiny random
    Gemma 3 and saves it in f32; PeftModel.from_pretrained on
    Gemma3ForCausalLM loads it and gives upipe eval --lora-from's f32 loss
    (rel 1e-4); the trained adapter moves the loss, and a copy with one
    lora_B doubled fails the check. With --cuda, again for an adapter
    trained on the GPU (bf16), evaluated in f32 on both sides."""
    src = gemma3_source(root)
    window = torch.randint(3, GEMMA_VOCAB - 3, (LORA_SEQ + 1,),
                           generator=torch.Generator().manual_seed(2))
    tokens = write_tokens(root, window)
    base = peft_loss(src, None, window)
    devices = ["cpu"] + (["cuda"] if cuda else [])
    for device in devices:
        out = os.path.join(root, f"gemma3-lora-{device}")
        upipe(binary, "train", "--device", device, "--attn", "local", "--model", src,
              "--init-from", src, "--data", tokens, "--pack", "stream", "--seq", str(LORA_SEQ),
              "--steps", "4", "--lr", "1e-2", "--warmup", "1", "--lora-rank", "4",
              "--lora-targets", "all-linear", "--save-dtype", "f32", "--save-dir", out)
        theirs = peft_loss(src, out, window)
        ours = upipe_loss(binary, src, tokens, root, "--device", "cpu", "--attn", "local",
                          "--lora-from", out)
        tag = f"gemma3 lora ({device}-trained)"
        close(f"{tag}: PeftModel on Gemma3ForCausalLM == upipe eval --lora-from (f32)",
              theirs, ours, 1e-4)
        moved = abs(theirs - base) / abs(base)
        check(f"{tag}: the trained adapter moves the loss", moved > 1e-3,
              f"{theirs:.7f} vs the base's {base:.7f}")
        bad = peft_loss(src, doubled_lora_b(out, out + "-doubled"), window)
        check(f"{tag}: a copy with one lora_B doubled fails the 1e-4 check",
              abs(bad - ours) / abs(ours) > 1e-4, f"{bad:.7f} vs {ours:.7f}")


SECTIONS = {"mistral": check_mistral, "qwen2": check_qwen2, "gemma3": check_gemma3,
            "gemma3-lora": check_gemma3_lora}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upipe", default="target/release/upipe", help="the upipe binary")
    ap.add_argument("--family", action="append", choices=sorted(SECTIONS),
                    help="a section to run (repeatable; default: all)")
    ap.add_argument("--cuda", action="store_true", help="also evaluate on the GPU (bf16)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="upipe-families-")
    for family in args.family or sorted(SECTIONS):
        work = os.path.join(root, family)
        os.makedirs(work)
        SECTIONS[family](args.upipe, work, args.cuda)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
