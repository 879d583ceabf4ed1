#!/usr/bin/env bash
# FP8 linear layers on one GPU, in parts (PARTS, default "tests speed"):
#
#   tests   the FP8 quantize kernel and GEMM against the CPU emulation
#           (gpu_fp8), and the backend's other kernels (gpu_backend)
#   speed   Llama 3.2 1B at each of SEQS ("32768 131072"), STEPS (4) steps with
#           --precision bf16 and fp8 (and bin/upipe-old's bf16 where the bundle
#           has it): median tokens/s of steps 2 on, TFLOP/s, peak against plan
#   peft    a LoRA adapter that upipe trains on a tiny Gemma 3, loaded by PEFT
#           (scripts/check_families.py --family gemma3-lora --cuda)
#
#   scripts/bundle.sh DIR gpu_fp8 gpu_backend && cp scripts/gpu-fp8.sh scripts/check_families.py DIR/
#   bash DIR/gpu-fp8.sh            # on the GPU machine, from the repository root
set -u
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
parts=" ${PARTS:-tests speed} "
{ date -u; nvidia-smi -L; } 2>&1
table=()
corpus_of() {  # a text corpus of at least $1 + 1 bytes
    local data="/tmp/corpus-$1.txt"
    : > "$data"
    while [ "$(stat -c %s "$data")" -le "$1" ]; do cat assets/corpus.txt >> "$data"; done
    echo "$data"
}
row() {  # NAME LOG: median tokens/s of steps 2 on, TFLOP/s, peak against plan
    table+=("$1: $(python3 - "$2" <<'PY'
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
tf = statistics.median(r["tflops"] for r in later)
last = rows[-1]
gib = lambda b: b / 2**30
print(f"{tok:,.0f} tok/s, {tf:.1f} TFLOP/s, loss {last['loss']:.4f}, peak {gib(last['peak_bytes']):.3f} GiB "
      f"(plan {gib(last['predicted_peak_bytes']):.3f})")
PY
)")
}

if [[ "$parts" == *" tests "* ]]; then
    for t in gpu_fp8 gpu_backend; do
        log="/tmp/$t.log"
        timeout -k 5 ${TEST_LIMIT:-240} "$bin/test-$t" --test-threads 1 > "$log" 2>&1
        rc=$?
        grep -aE "panicked|FAILED|SKIP" "$log" | head -8
        table+=("$t rc=$rc $(grep -a '^test result:' "$log" | tail -1)")
    done
fi

if [[ "$parts" == *" speed "* ]]; then
    for seq in ${SEQS:-32768 131072}; do
        flags=(train --model llama3.2-1b --ulysses 1 --ring 1 --seq "$seq" --steps "${STEPS:-4}"
               --data "$(corpus_of "$seq")" --json --lr 1e-5)
        [ "$seq" -gt 32768 ] && flags+=(--checkpoint)
        runs=("upipe bf16" "upipe fp8")
        [ -x "$bin/upipe-old" ] && runs=("upipe-old bf16" "${runs[@]}")
        for r in "${runs[@]}"; do
            set -- $r
            log="/tmp/speed-$1-$2-$seq.log"
            extra=()
            [ "$2" = fp8 ] && extra=(--precision fp8)
            timeout -k 5 300 "$bin/$1" "${flags[@]}" "${extra[@]}" > "$log" 2>&1 ||
                grep -aiE "error|panick" "$log" | head -3
            row "llama3.2-1b $seq $1 $2" "$log"
        done
    done
fi

if [[ "$parts" == *" peft "* ]]; then
    log=/tmp/peft.log
    python3 "$here/check_families.py" --upipe "$bin/upipe" --family gemma3-lora --cuda > "$log" 2>&1
    rc=$?
    tail -12 "$log"
    table+=("gemma3-lora PEFT check rc=$rc")
fi

echo
echo "== summary"
printf '%s\n' "${table[@]}"
