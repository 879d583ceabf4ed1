#!/usr/bin/env python3
"""upipe's LoRA training checked against PyTorch + PEFT, in f32 on the CPU:

    python3 scripts/check_lora_training.py UPIPE_BINARY [--family llama|qwen2] [--fsdp on]

It makes a small random HF model (Llama; or Qwen2 with q/k/v biases, tied
embeddings and an rsLoRA adapter), a PEFT adapter on all seven targets with
random A and B (so the first step already moves A), and one window of ids
(`SEQ + 1` ids: `--pack stream` cuts `(N - 1) / SEQ` = 1 window with no
slack, so every step trains on the same window), then checks:

1. PEFT's adapter loads in upipe: `upipe eval --lora-from` gives PEFT's loss.
2. Six upipe steps from that adapter (`local`, and `upipe` on the CPU's 2x2
   mesh) equal a PyTorch loop (PeftModel, torch.optim.AdamW over the adapter
   factors): loss at every step (rel 1e-5), gradient norm (rel 1e-4), the
   learning rate of upipe's warm-up + cosine schedule, the saved factors.
3. upipe's saved adapter loads in PeftModel.from_pretrained and gives upipe
   eval's loss and the PyTorch loop's final loss (rel 1e-4); a copy with one
   lora_B doubled must fail that check.
4. `--merge-lora`'s model equals PEFT's merge_and_unload() of upipe's
   adapter, every tensor to 1e-6, and gives its loss.

It prints a PASS/FAIL table and exits 1 if any check failed. It needs torch,
transformers, peft and safetensors (and check_peft.py beside it).
"""

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file

import check_peft as cp
from check_peft import SEVEN, check, rel, tensors

SEQ = 64
STEPS = 6
LR, MIN_LR, WARMUP = 5e-3, 5e-4, 2
BETAS, EPS, WD = (0.9, 0.99), 1e-7, 0.05


def lr_at(step: int) -> float:
    """upipe's `Schedule::lr_at` (1-based step): linear warm-up to LR, then
    cosine down to MIN_LR at the last step."""
    if WARMUP > 0 and step <= WARMUP:
        return LR * step / WARMUP
    t = min((step - WARMUP) / max(STEPS - WARMUP, 1), 1.0)
    return MIN_LR + 0.5 * (LR - MIN_LR) * (1.0 + math.cos(math.pi * t))


def load_base(d: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")


def make_inputs(root: str, family: str):
    """The base model, PEFT's adapter (random A and B) and the window's ids."""
    from peft import LoraConfig, get_peft_model
    base = os.path.join(root, "base")
    cp.base_model(family, tied=family == "qwen2").to(torch.float32).save_pretrained(base)
    rslora = family == "qwen2"
    config = LoraConfig(r=4, lora_alpha=6 if rslora else 8, use_rslora=rslora, lora_dropout=0.0,
                        target_modules=SEVEN, task_type="CAUSAL_LM")
    pm = get_peft_model(load_base(base), config)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.normal_(0.0, 0.05)
    adapter = os.path.join(root, "adapter")
    pm.save_pretrained(adapter)
    window = torch.randint(3, 256, (SEQ + 1,), generator=torch.Generator().manual_seed(2))
    ids = os.path.join(root, "ids.u32")
    with open(ids, "wb") as f:
        f.write(struct.pack(f"<{SEQ + 1}I", *window.tolist()))
    json.dump({"ids": window.tolist()}, open(os.path.join(root, "ids.json"), "w"))
    return base, adapter, ids, window


def upipe(binary: str, *args: str) -> str:
    r = subprocess.run([binary, *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"upipe {' '.join(args)} failed:\n{r.stderr}")
    return r.stdout


def upipe_eval(binary: str, base: str, adapter: str, ids: str) -> float:
    out = upipe(binary, "eval", "--json", "--device", "cpu", "--model-dir", base, "--lora-from", adapter,
                "--tokens", ids, "--seq", str(SEQ))
    return json.loads(out.strip().splitlines()[-1])["loss"]


def upipe_train(binary, root, base, adapter, ids, clip, attn, merged=None, fsdp="auto"):
    """Six steps from `adapter` (`fsdp`: upipe's `--fsdp`); the save
    directory and each step's metrics."""
    out = os.path.join(root, f"out-{attn}")
    m = out + ".jsonl"
    args = ["train", "--device", "cpu", "--attn", attn, "--model", base, "--init-from", base,
            "--lora-from", adapter, "--data", ids, "--pack", "stream", "--seq", str(SEQ),
            "--steps", str(STEPS), "--lr", str(LR), "--warmup", str(WARMUP),
            "--min-lr", str(MIN_LR), "--schedule", "cosine", "--clip", str(clip),
            "--weight-decay", str(WD), "--betas", f"{BETAS[0]},{BETAS[1]}", "--eps", str(EPS),
            "--save-dtype", "f32", "--save-dir", out, "--metrics", m, "--fsdp", fsdp]
    upipe(binary, *args, *(["--merge-lora", merged] if merged else []))
    with open(m) as f:
        return out, [json.loads(line) for line in f if line.startswith("{")]


def torch_loop(base: str, adapter: str, window, clip: float, steps: int = STEPS):
    """The PyTorch + PEFT loop doing what upipe does: mean next-token cross
    entropy over the window, the global gradient norm clipped to `clip`,
    AdamW with weight decay on every factor (upipe's `hyper` spares only
    norm weights and biases), upipe's schedule."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(load_base(base), adapter, is_trainable=True)
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in params], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD, foreach=False)
    # LambdaLR's factor i is the lr of the (i + 1)-th step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_at(i + 1) / LR)
    x, y = window[None, :-1], window[None, 1:]
    losses, norms, lrs = [], [], []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for _, p in params)).item()
        # upipe's clip_scale: clip / norm when norm > clip (clip_grad_norm_
        # would divide by norm + 1e-6)
        if clip > 0 and norm > clip:
            for _, p in params:
                p.grad.mul_(clip / norm)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        losses.append(loss.item())
        norms.append(norm)
    factors = {n.replace(".default", ""): p.detach().clone() for n, p in params}
    return model, losses, norms, lrs, factors


def check_steps(attn, ours, losses, norms, lrs, factors, out) -> None:
    worst = max((rel(o["loss"], t) for o, t in zip(ours, losses)), default=math.inf)
    check(f"{attn}: loss at each of {STEPS} steps == PyTorch + PEFT (rel <= 1e-5)",
          len(ours) == STEPS and worst <= 1e-5,
          " ".join(f"{o['loss']:.6f}/{t:.6f}" for o, t in zip(ours, losses)) + f" worst {worst:.1e}")
    worst_n = max((rel(o.get("grad_norm") or 0.0, t) for o, t in zip(ours, norms)), default=math.inf)
    check(f"{attn}: gradient norm at each step == PyTorch (rel <= 1e-4)", worst_n <= 1e-4,
          f"worst {worst_n:.1e}")
    worst_lr = max((rel(o.get("lr") or 0.0, t) for o, t in zip(ours, lrs)), default=math.inf)
    check(f"{attn}: lr at each step == warm-up + cosine (rel <= 1e-6)", worst_lr <= 1e-6,
          " ".join(f"{o.get('lr')}" for o in ours) + f" vs {' '.join(f'{x:.3g}' for x in lrs)}")
    saved = tensors(os.path.join(out, "adapter_model.safetensors"))
    missing = sorted(set(factors) ^ set(saved))
    diffs = {n: (saved[n].float() - w).abs().max().item() for n, w in factors.items() if n in saved}
    name, worst_w = max(diffs.items(), key=lambda kv: kv[1]) if diffs else ("", math.inf)
    # AdamW's step is scale-free: where a gradient element is near zero, last
    # bits of the f32 sums move it by a fraction of lr. 1% of the most any
    # element can move in the run.
    bound = 0.01 * sum(lrs)
    check(f"{attn}: saved factors after {STEPS} steps == PyTorch's (max abs <= {bound:.0e})",
          not missing and worst_w <= bound, f"worst {name} {worst_w:.1e}; unmatched {missing[:3]}")


def check_saved_adapter(binary, root, base, out, ids, window, trained) -> None:
    """upipe's adapter in PEFT: the loss upipe eval and the PyTorch loop give;
    with one lora_B doubled, the check must fail."""
    from peft import PeftModel
    theirs, _ = cp.loss_of(PeftModel.from_pretrained(load_base(base), out), window)
    ours = upipe_eval(binary, base, out, ids)
    after, _ = cp.loss_of(trained, window)
    check("upipe's adapter in PeftModel: loss == upipe eval --lora-from (rel <= 1e-4)",
          rel(theirs, ours) <= 1e-4, f"{theirs:.7f} vs {ours:.7f}")
    check("upipe's adapter in PeftModel: loss == the PyTorch loop's after 6 steps (rel <= 1e-4)",
          rel(theirs, after) <= 1e-4, f"{theirs:.7f} vs {after:.7f}")
    tampered = os.path.join(root, "tampered")
    os.makedirs(tampered)
    shutil.copy(os.path.join(out, "adapter_config.json"), tampered)
    st = tensors(os.path.join(out, "adapter_model.safetensors"))
    key = sorted(k for k in st if ".lora_B." in k)[0]
    st[key] = st[key] * 2
    save_file(st, os.path.join(tampered, "adapter_model.safetensors"), metadata={"format": "pt"})
    bad, _ = cp.loss_of(PeftModel.from_pretrained(load_base(base), tampered), window)
    check(f"the loss check fails for a copy with {key} doubled", rel(bad, ours) > 1e-4,
          f"{bad:.7f} vs {ours:.7f}")


def check_merge(binary: str, root: str, base: str, out: str, merged: str) -> None:
    """--merge-lora's model and `upipe merge BASE OUT MERGED`'s (no training)
    both equal PEFT's merge_and_unload()."""
    from peft import PeftModel
    ref = os.path.join(root, "merged-ref")
    PeftModel.from_pretrained(load_base(base), out).merge_and_unload().save_pretrained(ref)
    cp.check_merged(merged, ref, os.path.join(root, "ids.json"))
    again = os.path.join(root, "merged-cli")
    subprocess.run([binary, "merge", base, out, again, "--save-dtype", "f32"], check=True)
    cp.check_merged(again, ref, os.path.join(root, "ids.json"))


def check_adapter_only(base: str, out: str) -> None:
    """upipe's LoRA save is the adapter alone, naming its base."""
    files = sorted(os.listdir(out))
    model = [f for f in files if f.startswith("model") or f == "config.json"]
    check("upipe's save holds the adapter and no base weights or config.json", not model,
          f"{files}")
    with open(os.path.join(out, "adapter_config.json")) as f:
        named = json.load(f)["base_model_name_or_path"]
    check("adapter_config.json's base_model_name_or_path is the --init-from directory",
          os.path.realpath(named) == os.path.realpath(base), f"{named} vs {base}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("upipe", help="the upipe binary")
    ap.add_argument("--family", choices=["llama", "qwen2"], default="llama")
    ap.add_argument("--fsdp", choices=["auto", "on", "off"], default="auto",
                    help="upipe train's --fsdp (on: the base and the adapters sharded)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="upipe-lora-")
    base, adapter, ids, window = make_inputs(root, args.family)
    from peft import PeftModel
    peft_loss, _ = cp.loss_of(PeftModel.from_pretrained(load_base(base), adapter), window)
    base_loss, _ = cp.loss_of(load_base(base), window)
    check("PEFT's adapter changes the base model's loss", rel(peft_loss, base_loss) > 1e-3,
          f"{peft_loss:.7f} vs {base_loss:.7f}")
    ours = upipe_eval(args.upipe, base, adapter, ids)
    check("PEFT's adapter in upipe eval --lora-from: PEFT's loss (rel <= 1e-4)",
          rel(ours, peft_loss) <= 1e-4, f"{ours:.7f} vs {peft_loss:.7f}")
    # half the first step's norm, two digits: the clip acts from step 1 on
    first_norm = torch_loop(base, adapter, window, 0.0, steps=1)[2][0]
    clip = float(f"{0.5 * first_norm:.2g}")
    trained, losses, norms, lrs, factors = torch_loop(base, adapter, window, clip)
    print(f"clip {clip}: PyTorch's norms {' '.join(f'{n:.4f}' for n in norms)}", flush=True)
    merged = os.path.join(root, "merged")
    for attn in ["local", "upipe"]:
        out, steps = upipe_train(args.upipe, root, base, adapter, ids, clip, attn,
                                 merged if attn == "local" else None, args.fsdp)
        check_steps(attn, steps, losses, norms, lrs, factors, out)
    check("six steps lower the loss", losses[-1] < losses[0], f"{losses[0]:.6f} -> {losses[-1]:.6f}")
    out = os.path.join(root, "out-local")
    check_adapter_only(base, out)
    check_saved_adapter(args.upipe, root, base, out, ids, window, trained)
    check_merge(args.upipe, root, base, out, merged)
    print(f"\n{args.family}:")
    for name, ok, _ in cp.RESULTS:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    failed = [n for n, ok, _ in cp.RESULTS if not ok]
    print(f"{len(cp.RESULTS) - len(failed)}/{len(cp.RESULTS)} checks passed ({root})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
