#!/usr/bin/env bash
# GPUs: evaluation during an FSDP run equals `upipe eval` of the checkpoint of
# that step, packed evaluation runs, and a mixture of corpora trains with its
# realised proportions logged.
#
#   bash scripts/gpu-eval-mix.sh            # from the repository root, 1+ GPUs
#
# The runs use two ranks (--ulysses 2): one process per GPU on two GPUs, two
# thread ranks sharing the GPU on one, so FSDP shards over two ranks either way.
# UPIPE (default gpu-bundle/bin/upipe) is the binary; OUT (default
# /tmp/upipe-eval-mix) the work directory. Prints one `RESULT` line per check
# and exits non-zero when one fails.
set -euo pipefail
upipe="${UPIPE:-gpu-bundle/bin/upipe}"
out="${OUT:-/tmp/upipe-eval-mix}"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
rm -rf "$out" && mkdir -p "$out"
# corpora: byte ids of two texts, each with a document index of 97-id documents
python3 - "$out" <<'PY'
import struct, sys
out = sys.argv[1]
def corpus(name, text, n, doc):
    ids = [b for b in (text * (n // len(text) + 1)).encode()[:n]]
    open(f"{out}/{name}", "wb").write(struct.pack(f"<{n}I", *ids))
    starts = list(range(0, n, doc))
    head = b"UPIPEDIX" + struct.pack("<IIQQ", 1, 0, n, len(starts))
    open(f"{out}/{name}.docs", "wb").write(head + struct.pack(f"<{len(starts)}Q", *starts))
corpus("a.u32", "Alice was beginning to get very tired of sitting by her sister. ", 200_000, 97)
corpus("b.u32", "0123456789 plus minus times equals; ", 100_000, 97)
corpus("held.u32", "The Queen of Hearts, she made some tarts, all on a summer day. ", 20_000, 97)
PY
train=(train --model tiny --seq 4096 --steps 4 --warmup 1 --ulysses 2 --json)
# 1. eval during an FSDP run against `upipe eval` of the saved step
"$upipe" "${train[@]}" --fsdp on --pack documents --data "$out/a.u32" \
    --eval-data "$out/held.u32" --eval-every 2 --eval-buckets 2 --save-dtype f32 \
    --save-dir "$out/ckpt" > "$out/train.jsonl"
"$upipe" eval --json --config "$out/ckpt/run.toml" --tokens "$out/held.u32" --seq 4096 \
    --buckets 2 > "$out/eval.json"
# 2. packed evaluation: every mode runs on the GPU
for pack in stream documents bfd; do
    "$upipe" eval --json --model-dir "$out/ckpt" --tokens "$out/held.u32" --seq 4096 --pack "$pack" \
        > "$out/eval-$pack.json"
done
# 3. a mixture of corpora
"$upipe" "${train[@]}" --grad-accum 4 --data "$out/a.u32:0.7,$out/b.u32:0.3" > "$out/mix.jsonl"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
ok = True
def result(name, good, detail):
    global ok
    ok &= good
    print(f"RESULT {name} {'ok' if good else 'FAIL'} {detail}")
lines = [json.loads(l) for l in open(f"{out}/train.jsonl")]
during = lines[-1]["eval"]
after = json.load(open(f"{out}/eval.json"))
rel = abs(during["loss"] - after["loss"]) / after["loss"]
# bf16 compute: the same weights, the same windows, another order of reductions
result("fsdp_eval_during", rel <= 1e-2 and during["windows"] == after["windows"],
       f"during {during['loss']:.5f} after {after['loss']:.5f} rel {rel:.2e}")
for pack in ["stream", "documents", "bfd"]:
    r = json.load(open(f"{out}/eval-{pack}.json"))
    result(f"eval_pack_{pack}", r["loss"] > 0 and r["counted_tokens"] > 0,
           f"loss {r['loss']:.5f} counted {r['counted_tokens']} windows {r['windows']}")
mix = [json.loads(l) for l in open(f"{out}/mix.jsonl")][-1]["mixture"]
shares = {m["data"].rsplit("/", 1)[-1]: m for m in mix}
a, b = shares["a.u32"], shares["b.u32"]
good = a["windows"] + b["windows"] == 16 and abs(a["windows"] - 0.7 * 16) < 1
result("mixture", good, f"a {a['windows']} windows ({a['share']:.3f}), b {b['windows']} ({b['share']:.3f})")
sys.exit(0 if ok else 1)
PY
