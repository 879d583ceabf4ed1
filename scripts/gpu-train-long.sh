#!/usr/bin/env bash
# A real model trained at long context on the GPUs of one machine: the
# Llama 3.2 1B architecture (random init), the bundled corpus repeated to the
# length, full activation checkpointing and tiled MLP, one NCCL process per
# GPU (`upipe train` starts them itself). Per method it prints each step's
# JSON (loss, tok/s, rank 0's ledger peak and the planner's prediction).
#
#   scripts/gpu-check.sh build DIR          # here: binaries into DIR
#   cp scripts/gpu-train-long.sh DIR/
#   SEQ=262144 STEPS=2 bash DIR/gpu-train-long.sh   # on the GPU machine, in the repo root
#   (METHODS="upipe ulysses", MODEL, POLICY="--checkpoint --tiled-mlp", BUDGET seconds)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=/tmp/upipe-kernels
seq=${SEQ:-262144}
T0=$(date +%s)
{ date -u; nvidia-smi -L
  nvidia-smi --query-gpu=index,power.limit,clocks.max.sm,temperature.gpu --format=csv
} 2>&1
# the corpus, repeated until it holds one sequence and its next token
corpus=assets/corpus.txt
data=/tmp/upipe-long-corpus.txt
: > "$data"
while [ "$(stat -c %s "$data")" -le "$seq" ]; do cat "$corpus" >> "$data"; done
echo "data: $(stat -c %s "$data") bytes (byte tokenizer) for seq $seq"
read -r -a policy <<< "${POLICY:---checkpoint --tiled-mlp}"
for m in ${METHODS:-upipe ulysses}; do
  left=$(( ${BUDGET:-500} - ($(date +%s) - T0) ))
  [ "$left" -lt 30 ] && { echo "SKIP $m (time)"; continue; }
  s=$(date +%s)
  timeout -k 5 "$left" "$bin/upipe" train --model "${MODEL:-llama3.2-1b}" --data "$data" \
    --seq "$seq" --steps "${STEPS:-2}" --attn "$m" "${policy[@]}" --warmup 1 --json \
    > "/tmp/train-$m.log" 2>&1
  rc=$?
  echo "## train $m seq $seq rc=$rc $(( $(date +%s) - s ))s"
  grep -a '"step"' "/tmp/train-$m.log" | cut -c1-400
  grep -a -iE "fwd|forward stages|mesh|attention kernel" "/tmp/train-$m.log" | head -4 | cut -c1-300
  [ $rc -ne 0 ] && grep -a -iE "error|panick|out of memory" "/tmp/train-$m.log" | head -6 | cut -c1-300
done
echo "total $(( $(date +%s) - T0 ))s"
