#!/usr/bin/env bash
# The planner's longest for this card (its usable memory, --host-mem 108), then
# --rehearse at that length, for each target of TARGETS (one per line; default:
# Llama3-8B full with 8-bit moments, no master and BF16 gradients; LoRA r16;
# Llama 3.2 1B full with BF16 gradients): the plan's device and host peaks and
# the rehearsal's, one block per target.
#
#   mkdir -p DIR/bin && cp target/release/upipe DIR/bin/ && cp scripts/gpu-rehearse-targets.sh DIR/
#   bash DIR/gpu-rehearse-targets.sh      # on the GPU machine
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
U="$(dirname "$0")/bin/upipe"
nvidia-smi -L
usable=$($U train --model tiny --ulysses 1 --ring 1 --seq 1024 --rehearse 2>&1 | grep -o '[0-9.]* GiB usable' | head -1 | cut -d' ' -f1)
echo "usable: $usable GiB"
mem=$(python3 -c "print($usable + 1.5)")
P="--attn upipe --checkpoint --tiled-mlp --offload auto --offload-optimizer auto --checkpoint-every auto --host-mem 108"
TARGETS="${TARGETS:-llama3-8b --optim-state 8bit --master-weights none --grad-dtype bf16
llama3-8b --lora-rank 16
llama3.2-1b --grad-dtype bf16}"
# the plans first, all at once (the planner runs on the host's cores), then
# the rehearsals one at a time
i=0
while IFS= read -r what; do
    [ -n "$what" ] || continue
    $U plan --model $what $P --gpus 1 --gpu-mem "$mem" --json > "/tmp/rehearse-plan-$i.json" 2> /dev/null &
    i=$((i + 1))
done <<< "$TARGETS"
wait
i=0
while IFS= read -r what; do
    [ -n "$what" ] || continue
    seq=$(python3 -c "import json,sys; print([json.loads(l) for l in sys.stdin if l.startswith('{')][0]['longest_seq'])" < "/tmp/rehearse-plan-$i.json")
    i=$((i + 1))
    echo "== $what: longest $seq"
    timeout 240 $U train --model $what $P --ulysses 1 --ring 1 --seq "$seq" --rehearse 2>&1 | grep -E "checkpoint-every auto|device peak|host peak|fits|does not|rror" | cut -c1-300
done <<< "$TARGETS"
