#!/usr/bin/env bash
# FP8 attention (--precision fp8-attention, fp8-attention-bwd) on one GPU,
# in parts (PARTS, default "check speed"):
#
#   check    cuDNN's FP8 graphs against its BF16 ones at head dim 128
#            (bin/cudnn_fp8_check: errors, amax against bound, kernel times at
#            FP8_S and FP8_HEADS), and the backend's FP8 route against the CPU
#            emulation (gpu_fp8::fp8_attention_tracks_the_emulation)
#   speed    MODEL (qwen2.5-7b-instruct) at SEQ (32768), STEPS (3) steps under
#            each --precision of SPEED ("fp8 fp8-attention fp8-attention-bwd"),
#            FLAGS (tiled MLP, no checkpointing, 8-bit moments on the GPU, no
#            master, BF16 gradients): median tokens/s of steps 2 on, peak
#            against plan
#   quality  qwen3-0.6b (head dim 128), 300 steps of 4,096 tokens of the text
#            corpus (byte tokens, lr 3e-4, 30 warm-up steps, cosine to 3e-5),
#            each --precision of QUALITY ("fp8-attention-bwd fp8-attention fp8
#            bf16"): final loss (mean of the last 20 steps); metrics in
#            $OUT/fp8-attention
#
#   scripts/bundle.sh DIR gpu_fp8 && cargo build --release --example cudnn_fp8_check &&
#   cp target/release/examples/cudnn_fp8_check DIR/bin/ && cp scripts/gpu-fp8-attention.sh DIR/
#   bash DIR/gpu-fp8-attention.sh      # on the GPU machine, from the repository root
set -u
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
parts=" ${PARTS:-check speed} "
out="${OUT:-/tmp}/fp8-attention"
mkdir -p "$out"
{ date -u; nvidia-smi -L; } 2>&1
table=()
summary() {  # LOG: median tokens/s of steps 2 on, final loss, peak against plan
    python3 - "$1" <<'PY'
import json, statistics, sys
rows = []
for line in open(sys.argv[1], errors="replace"):
    try:
        d = json.loads(line)
    except ValueError:
        continue
    if "tokens_per_s" in d:
        rows.append(d)
if not rows:
    print("no steps")
    sys.exit()
later = rows[1:] or rows
tok = statistics.median(r["tokens_per_s"] for r in later)
tail = [r["loss"] for r in rows[-20:]]
gib = lambda b: b / 2**30
last = rows[-1]
print(f"{tok:,.0f} tok/s, loss {sum(tail) / len(tail):.4f}, peak {last['peak_bytes']:,} B "
      f"(plan {last['predicted_peak_bytes']:,})")
PY
}

if [[ "$parts" == *" check "* ]]; then
    FP8_S="${FP8_S:-4096,32768}" FP8_HEADS="${FP8_HEADS:-32:8,28:4,8:2,32:32}" timeout -k 5 300 \
        "$bin/cudnn_fp8_check" 2>&1 | tail -25
    log="$out/test.log"
    timeout -k 5 120 "$bin/test-gpu_fp8" fp8_attention --nocapture > "$log" 2>&1
    rc=$?
    grep -aE "rel-L2|panicked|SKIP" "$log" | head -12
    table+=("gpu_fp8 attention rc=$rc $(grep -a '^test result:' "$log" | tail -1)")
fi

if [[ "$parts" == *" speed "* ]]; then
    corpus=/tmp/corpus.txt
    : > "$corpus"
    while [ "$(stat -c %s "$corpus")" -le "${SEQ:-32768}" ]; do cat assets/corpus.txt >> "$corpus"; done
    for p in ${SPEED:-fp8 fp8-attention fp8-attention-bwd}; do
        log="$out/speed-$p.jsonl"
        timeout -k 5 240 "$bin/upipe" train --model "${MODEL:-qwen2.5-7b-instruct}" --ulysses 1 --ring 1 \
            --seq "${SEQ:-32768}" --steps "${STEPS:-3}" --data "$corpus" --tokenizer byte --json --lr 1e-5 \
            --attn upipe ${FLAGS:---tiled-mlp --offload-optimizer 0 --optim-state 8bit --master-weights none --grad-dtype bf16} \
            --precision "$p" \
            > "$log" 2> "$out/speed-$p.err" || grep -aiE "error|panick" "$out/speed-$p.err" | head -3
        table+=("${MODEL:-qwen2.5-7b-instruct} ${SEQ:-32768} $p: $(summary "$log")")
        echo "${table[-1]}"
    done
fi

if [[ "$parts" == *" quality "* ]]; then
    text=/tmp/fp8-text.u32
    "$bin/upipe" tokenize "$here/text.jsonl" --tokenizer byte --eos 0 --out "$text" > "$out/tok.log" 2>&1 ||
        tail -3 "$out/tok.log"
    for p in ${QUALITY:-fp8-attention-bwd fp8-attention fp8 bf16}; do
        log="$out/$p.jsonl"
        timeout -k 5 300 "$bin/upipe" train --model qwen3-0.6b --ulysses 1 --ring 1 --seq 4096 \
            --steps "${STEPS_Q:-300}" --data "$text" --pack stream --lr 3e-4 --min-lr 3e-5 --warmup 30 \
            --seed 0 --json --precision "$p" > "$log" 2> "$out/$p.err" ||
            grep -aiE "error|panick" "$out/$p.err" | head -3
        table+=("qwen3-0.6b 4096 $p: $(summary "$log")")
        echo "${table[-1]}"
    done
fi

echo
echo "== summary"
printf '%s\n' "${table[@]}"
