#!/usr/bin/env bash
# BF16 gradients (`--grad-dtype bf16`) on one GPU, in parts (PARTS, default
# "tests rehearse"):
#
#   tests     the GPU tests of BF16 gradients and of the compact AdamW kernels
#   rehearse  the planner's longest length on this card (its usable memory,
#             --host-mem 108), then `--rehearse` there, for each target of
#             TARGETS (default: Llama3-8B full with F32 state on the host and
#             BF16 gradients; with 8-bit moments, no master and BF16
#             gradients on the device; LoRA r16; Llama 3.2 1B): one line each
#             with the plan's peaks and the rehearsal's
#   step      one real step of Llama3-8B (8-bit moments, no master, BF16
#             gradients) at STEPSEQ tokens (default 262144), peak against plan
#   gemma12   gemma3-12b (8-bit moments, no master, BF16 gradients) at the
#             planner's longest for this card: its plan, then 2 real steps,
#             peak against plan
#   auto      AUTOSTEPS (default 3) steps of gemma3-4b at AUTOSEQ (180224) under `auto`
#             (planned within a few hundred MiB of the card): the pool's
#             high-water and the memory outside it, or where it ran out
#
#   scripts/bundle.sh DIR grad_dtype gpu_backend && cp scripts/gpu-grad-dtype.sh DIR/
#   bash DIR/gpu-grad-dtype.sh            # on the GPU machine
set -u
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
here="$(cd "$(dirname "$0")" && pwd)"
U="$here/bin/upipe"
parts="${PARTS:-tests rehearse}"
{ date -u; nvidia-smi -L; } 2>&1
has() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
corpus_of() {  # a text corpus of at least $1 + 1 bytes (run from the repository root)
    local data="/tmp/corpus-$1.txt"
    : > "$data"
    while [ "$(stat -c %s "$data")" -le "$1" ]; do cat assets/corpus.txt >> "$data"; done
    echo "$data"
}

if has tests; then
    echo "== tests"
    "$here/bin/test-grad_dtype" gpu_ 2>&1 | grep -E "^test |SKIP|panicked|test result" | head -20
    "$here/bin/test-gpu_backend" compact 2>&1 | grep -E "^test |panicked|test result" | head -20
fi

usable=$($U train --model tiny --ulysses 1 --ring 1 --seq 1024 --rehearse 2>&1 |
    grep -o '[0-9.]* GiB usable' | head -1 | cut -d' ' -f1)
echo "usable: $usable GiB"
mem=$(python3 -c "print($usable + 1.5)")
P="--attn upipe --checkpoint --tiled-mlp --offload auto --offload-optimizer auto --checkpoint-every auto --host-mem 108"
TARGETS_DEFAULT="llama3-8b --grad-dtype bf16|llama3-8b --grad-dtype bf16 --optim-state 8bit --master-weights none|llama3-8b --lora-rank 16|llama3.2-1b --grad-dtype bf16"

if has rehearse; then
    IFS='|' read -r -a targets <<< "${TARGETS:-$TARGETS_DEFAULT}"
    for what in "${targets[@]}"; do
        line=$($U plan --model $what $P --gpus 1 --gpu-mem "$mem" --json 2> /dev/null | grep '^{' | head -1)
        seq=$(echo "$line" | python3 -c "import json,sys; print(json.load(sys.stdin)['longest_seq'])")
        echo "== $what: longest $seq"
        timeout 300 $U train --model $what $P --ulysses 1 --ring 1 --seq "$seq" --rehearse 2>&1 |
            grep -E "checkpoint-every auto|preflight|device peak|host peak|pool|fits|does not|rror" | cut -c1-600
    done
fi

if has step; then
    seq="${STEPSEQ:-262144}"
    F="--grad-dtype bf16 --optim-state 8bit --master-weights none"
    echo "== one step of llama3-8b $F at $seq"
    start=$(date +%s)
    timeout 560 $U train --model llama3-8b $P $F --ulysses 1 --ring 1 --seq "$seq" --steps 1 \
        --data "$(corpus_of "$seq")" \
        --json --lr 1e-5 2>&1 | grep -E '^\{|rror|checkpoint-every' | cut -c1-900
    echo "wall: $(($(date +%s) - start)) s"
fi

if has auto; then
    echo "== gemma3-4b at ${AUTOSEQ:-180224} under auto"
    timeout 300 $U train --model gemma3-4b --attn upipe --checkpoint --tiled-mlp --offload-optimizer auto --ulysses 1 --ring 1 \
        --data "$(corpus_of "${AUTOSEQ:-180224}")" --seq "${AUTOSEQ:-180224}" --steps "${AUTOSTEPS:-3}" --lr 1e-5 2>&1 |
        grep -E "auto|peak|pool|tok/s|rror" | cut -c1-700
fi

if has gemma12; then
    what="gemma3-12b --grad-dtype bf16 --optim-state 8bit --master-weights none"
    seq=$($U plan --model $what $P --gpus 1 --gpu-mem "$mem" --json 2> /dev/null | grep '^{' | head -1 |
        python3 -c "import json,sys; print(json.load(sys.stdin)['longest_seq'])")
    echo "== $what: longest $seq, 2 steps"
    timeout 400 $U train --model $what $P --ulysses 1 --ring 1 --seq "$seq" --steps 2 --json --lr 1e-5 \
        --data "$(corpus_of "$seq")" 2>&1 | grep -E '^\{|rror|decided|pool' | cut -c1-1200
fi
