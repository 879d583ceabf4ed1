#!/usr/bin/env python3
"""upipe's LoRA adapter files and merged models, checked against PEFT.

Modes (each prints one PASS/FAIL line per check and exits 1 if any failed;
it runs on the CPU and needs torch, transformers, peft and safetensors):

  --make DIR
      For a small random Llama (all seven target modules) and a small random
      Qwen2 (q/k/v biases; q_proj, v_proj, down_proj with rsLoRA), writes
      DIR/<kind>/base (the model, f32), DIR/<kind>/adapter (a PEFT LoRA
      adapter with random non-zero A and B, by `save_pretrained`),
      DIR/<kind>/merged-ref (`merge_and_unload()`, f32) and
      DIR/<kind>/reference.json (fixed ids, the adapted model's loss and
      logits' sum). It then proves its checks can fail: PEFT's own adapter
      passes --check-adapter, and copies with one factor or one merged
      tensor changed must fail.

  --check-adapter ADAPTER_DIR --base BASE_DIR [--loss L] [--ids-from REF.json] [--like DIR]
      The adapter's adapter_config.json fields, its tensor names and shapes
      (against the base model's modules), that PeftModel.from_pretrained
      loads every tensor (values compared after loading), and, with --loss,
      that the adapted model's loss on the reference ids equals L (rel 1e-5);
      with --like, that r, lora_alpha, use_rslora, target_modules and every
      tensor equal those of another adapter.

  --check-merged MERGED_DIR --ref REF_DIR [--ids-from REF.json]
      Every tensor of MERGED equals REF's (same names, max |diff| <= 1e-6),
      and with --ids-from both load and give the same loss (rel 1e-5).

  --check-fixture DIR
      After the Rust side wrote DIR/<kind>/upipe-adapter and upipe-merged
      (`UPIPE_PEFT_FIXTURE=DIR cargo test --release --test lora_files --
      --ignored`): --check-adapter on upipe's adapter (loss = the
      reference's, like PEFT's adapter) and --check-merged against
      merged-ref, for every kind.
"""

import argparse
import json
import os
import re
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

RESULTS = []
KINDS = ["llama", "qwen2"]
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_(A|B)\.weight$")


def check(name: str, ok: bool, detail: str = "", results=None) -> bool:
    (RESULTS if results is None else results).append((name, bool(ok), detail))
    if results is None:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    return bool(ok)


def transformers_major() -> int:
    import transformers
    return int(transformers.__version__.split(".")[0])


def rope_kwargs(theta: float) -> dict:
    if transformers_major() >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def tensors(path: str) -> dict:
    """Every tensor of one safetensors file, or of an HF directory's weight files."""
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        files = (sorted(set(json.load(open(index))["weight_map"].values()))
                 if os.path.exists(index) else ["model.safetensors"])
        out = {}
        for f in files:
            out.update(tensors(os.path.join(path, f)))
        return out
    with safe_open(path, "pt") as st:
        return {k: st.get_tensor(k) for k in st.keys()}


def base_model(kind: str, tied: bool = False):
    """A small random Llama, or Qwen2 with random q/k/v biases; `tied`: the
    LM head shares the embedding (tie_word_embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  max_position_embeddings=512, tie_word_embeddings=tied, bos_token_id=1,
                  eos_token_id=2, **rope_kwargs(10000.0))
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(head_dim=16, **common))
    model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **common))
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return model


def lora_config(kind: str):
    from peft import LoraConfig
    if kind == "llama":
        return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=SEVEN,
                          task_type="CAUSAL_LM")
    return LoraConfig(r=4, lora_alpha=6, lora_dropout=0.0, use_rslora=True,
                      target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")


def loss_of(model, ids) -> tuple:
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids[None], labels=ids[None])
    return out.loss.item(), out.logits.double().sum().item()


def make(root: str) -> None:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    for kind in KINDS:
        d = os.path.join(root, kind)
        shutil.rmtree(d, ignore_errors=True)
        base_dir = os.path.join(d, "base")
        base_model(kind).save_pretrained(base_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        pm = get_peft_model(base, lora_config(kind))
        torch.manual_seed(1)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_A" in n or "lora_B" in n:
                    p.normal_(0.0, 0.05)
        pm.save_pretrained(os.path.join(d, "adapter"))
        ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(2))
        loss, logits_sum = loss_of(pm, ids)
        merged = pm.merge_and_unload()
        merged_loss, _ = loss_of(merged, ids)
        merged.save_pretrained(os.path.join(d, "merged-ref"))
        json.dump({"ids": ids.tolist(), "loss": loss, "logits_sum": logits_sum,
                   "merged_loss": merged_loss}, open(os.path.join(d, "reference.json"), "w"))
        base_loss, _ = loss_of(AutoModelForCausalLM.from_pretrained(base_dir), ids)
        check(f"{kind}: the adapter changes the loss", abs(base_loss - loss) > 1e-3,
              f"base {base_loss:.6f}, adapted {loss:.6f}")
        check(f"{kind}: merge_and_unload keeps the loss", rel(merged_loss, loss) <= 1e-5,
              f"{merged_loss:.7f} vs {loss:.7f}")
        prove_checks_fail(kind, d, loss)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def prove_checks_fail(kind: str, d: str, loss: float) -> None:
    """PEFT's own adapter passes; one changed factor or merged tensor fails."""
    adapter, base, ref = (os.path.join(d, x) for x in ("adapter", "base", "reference.json"))
    mine = []
    check_adapter(adapter, base, loss, ref, None, mine)
    bad = [n for n, ok, _ in mine if not ok]
    check(f"{kind}: PEFT's own adapter passes --check-adapter", not bad, f"failed: {bad}")
    tampered = os.path.join(d, "tampered-adapter")
    shutil.copytree(adapter, tampered, dirs_exist_ok=True)
    st = tensors(os.path.join(adapter, "adapter_model.safetensors"))
    key = sorted(k for k in st if ".lora_B." in k)[0]
    st[key] = st[key] * 2
    save_file(st, os.path.join(tampered, "adapter_model.safetensors"), metadata={"format": "pt"})
    mine = []
    check_adapter(tampered, base, loss, ref, adapter, mine)
    check(f"{kind}: an adapter with {key} doubled fails --check-adapter",
          any(not ok for _, ok, _ in mine))
    merged = os.path.join(d, "merged-ref")
    wrong = os.path.join(d, "tampered-merged")
    shutil.copytree(merged, wrong, dirs_exist_ok=True)
    mt = tensors(merged)
    name = "model.layers.1.self_attn.v_proj.weight"
    mt[name] = mt[name] + 2e-6
    save_file(mt, os.path.join(wrong, "model.safetensors"), metadata={"format": "pt"})
    mine = []
    check_merged(wrong, merged, None, mine)
    check(f"{kind}: a merged model with {name} off by 2e-6 fails --check-merged",
          any(not ok for _, ok, _ in mine))
    shutil.rmtree(tampered)
    shutil.rmtree(wrong)


def check_config(adapter: str, like, results) -> dict:
    cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    want = {"peft_type": "LORA", "bias": "none", "task_type": "CAUSAL_LM", "lora_dropout": 0.0,
            "fan_in_fan_out": False, "use_dora": False, "rank_pattern": {},
            "alpha_pattern": {}, "modules_to_save": None, "layers_to_transform": None,
            "inference_mode": True, "init_lora_weights": True}
    wrong = {k: cfg.get(k, "<absent>") for k, v in want.items() if cfg.get(k, "<absent>") != v}
    check(f"{adapter}: adapter_config.json fields as PEFT writes them", not wrong,
          f"differing: {wrong}", results)
    targets = cfg.get("target_modules")
    check(f"{adapter}: target_modules are module names upipe knows",
          isinstance(targets, list) and set(targets) <= set(SEVEN), str(targets), results)
    check(f"{adapter}: r and lora_alpha are positive numbers",
          isinstance(cfg.get("r"), int) and cfg["r"] > 0
          and isinstance(cfg.get("lora_alpha"), (int, float)) and cfg["lora_alpha"] > 0,
          f"r {cfg.get('r')}, lora_alpha {cfg.get('lora_alpha')}", results)
    if like:
        other = json.load(open(os.path.join(like, "adapter_config.json")))
        keys = ["r", "lora_alpha", "use_rslora"]
        diff = [k for k in keys if cfg.get(k) != other.get(k)]
        if sorted(cfg.get("target_modules") or []) != sorted(other.get("target_modules") or []):
            diff.append("target_modules")
        check(f"{adapter}: r, lora_alpha, use_rslora, target_modules equal {like}'s", not diff,
              f"differing: {diff}", results)
    return cfg


def check_adapter(adapter: str, base: str, loss, ids_from, like, results=None) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    cfg = check_config(adapter, like, results)
    st = tensors(os.path.join(adapter, "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    modules = dict(model.named_modules())
    r, targets = cfg["r"], cfg.get("target_modules") or []
    want_names = {f"base_model.model.model.layers.{l}.{'self_attn' if t in SEVEN[:4] else 'mlp'}"
                  f".{t}.lora_{f}.weight" for l in range(layers) for t in targets for f in "AB"}
    check(f"{adapter}: tensor names are PEFT's, one A and B per layer and target",
          set(st) == want_names and all(NAME.match(n) for n in st),
          f"extra {sorted(set(st) - want_names)[:3]}, missing {sorted(want_names - set(st))[:3]}",
          results)
    bad_shapes = []
    for n, t in st.items():
        m = NAME.match(n)
        if not m:
            continue
        lin = modules.get(f"model.layers.{m[1]}.{m[2]}.{m[3]}")
        want = None if lin is None else (
            [r, lin.in_features] if m[4] == "A" else [lin.out_features, r])
        if list(t.shape) != want:
            bad_shapes.append(f"{n}: {list(t.shape)} vs {want}")
    check(f"{adapter}: shapes lora_A [r, in], lora_B [out, r] of the base's modules",
          not bad_shapes, "; ".join(bad_shapes[:3]), results)
    pm = PeftModel.from_pretrained(model, adapter)
    loaded = dict(pm.named_parameters())
    not_loaded = [n for n, t in st.items()
                  if n.replace(".weight", ".default.weight") not in loaded
                  or not torch.equal(loaded[n.replace(".weight", ".default.weight")].detach(),
                                     t.to(torch.float32))]
    check(f"{adapter}: PeftModel.from_pretrained loads every tensor as written",
          not not_loaded, f"not loaded: {not_loaded[:3]}", results)
    if like:
        other = tensors(os.path.join(like, "adapter_model.safetensors"))
        differ = [n for n in other if n not in st or not torch.equal(st[n].float(), other[n].float())]
        check(f"{adapter}: every tensor equals {like}'s", not differ and set(st) == set(other),
              f"differing: {differ[:3]}", results)
    if loss is not None:
        ids = torch.tensor(json.load(open(ids_from))["ids"])
        got, _ = loss_of(pm, ids)
        check(f"{adapter}: loss of the adapted model == {loss:.7f}", rel(got, loss) <= 1e-5,
              f"{got:.7f} (rel {rel(got, loss):.1e})", results)


def check_merged(merged: str, ref: str, ids_from, results=None) -> None:
    a, b = tensors(merged), tensors(ref)
    check(f"{merged}: the same tensor names as {ref}", set(a) == set(b),
          f"extra {sorted(set(a) - set(b))[:3]}, missing {sorted(set(b) - set(a))[:3]}", results)
    worst, where = 0.0, ""
    for n in set(a) & set(b):
        if a[n].shape != b[n].shape:
            worst, where = float("inf"), f"{n}: shape {list(a[n].shape)} vs {list(b[n].shape)}"
            break
        d = (a[n].double() - b[n].double()).abs().max().item() if a[n].numel() else 0.0
        if d > worst:
            worst, where = d, n
    check(f"{merged}: every tensor equals the reference's (max |diff| <= 1e-6)", worst <= 1e-6,
          f"max |diff| {worst:.2e} at {where}", results)
    if ids_from:
        from transformers import AutoModelForCausalLM
        ids = torch.tensor(json.load(open(ids_from))["ids"])
        got, _ = loss_of(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), ids)
        want, _ = loss_of(AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32), ids)
        check(f"{merged}: loads, and its loss equals the reference's", rel(got, want) <= 1e-5,
              f"{got:.7f} vs {want:.7f}", results)


def check_fixture(root: str) -> None:
    for kind in KINDS:
        d = os.path.join(root, kind)
        ref = os.path.join(d, "reference.json")
        loss = json.load(open(ref))["loss"]
        for part in ("upipe-adapter", "upipe-merged"):
            check(f"{kind}: {part} was written (by the Rust side)",
                  os.path.isdir(os.path.join(d, part)))
        if os.path.isdir(os.path.join(d, "upipe-adapter")):
            check_adapter(os.path.join(d, "upipe-adapter"), os.path.join(d, "base"), loss, ref,
                          os.path.join(d, "adapter"))
        if os.path.isdir(os.path.join(d, "upipe-merged")):
            check_merged(os.path.join(d, "upipe-merged"), os.path.join(d, "merged-ref"), ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--make", metavar="DIR")
    mode.add_argument("--check-adapter", metavar="ADAPTER_DIR")
    mode.add_argument("--check-merged", metavar="MERGED_DIR")
    mode.add_argument("--check-fixture", metavar="DIR")
    ap.add_argument("--base", help="the base model directory (--check-adapter)")
    ap.add_argument("--ref", help="the reference merged model directory (--check-merged)")
    ap.add_argument("--loss", type=float, help="the adapted model's expected loss")
    ap.add_argument("--ids-from", help="a reference.json holding the ids losses are taken on")
    ap.add_argument("--like", help="an adapter directory this one must equal")
    args = ap.parse_args()
    if args.make:
        make(args.make)
    elif args.check_adapter:
        if not args.base:
            ap.error("--check-adapter needs --base")
        if args.loss is not None and not args.ids_from:
            ap.error("--loss needs --ids-from (the ids it was taken on)")
        check_adapter(args.check_adapter, args.base, args.loss, args.ids_from, args.like)
    elif args.check_merged:
        if not args.ref:
            ap.error("--check-merged needs --ref")
        check_merged(args.check_merged, args.ref, args.ids_from)
    else:
        check_fixture(args.check_fixture)
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
