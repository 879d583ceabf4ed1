#!/usr/bin/env bash
# Forward-only evaluation next to a training step, at long context on the
# GPUs of one machine: the Llama 3.2 1B architecture (random init, saved by a
# short training run), the bundled corpus repeated to the length as byte ids
# (`upipe tokenize --tokenizer byte`), `upipe eval --seq SEQ` over two
# windows (the second one timed). Prints the training step's and the eval's
# tokens/s and rank 0's ledger peak side by side.
#
#   scripts/gpu-check.sh build DIR          # here: binaries into DIR
#   cp scripts/gpu-eval-long.sh DIR/
#   SEQ=131072 bash DIR/gpu-eval-long.sh    # on the GPU machine, in the repo root
#   (MODEL, POLICY="--checkpoint", ATTN=upipe, EVAL_FLAGS="--buckets 8", WORK=/tmp/upipe-eval,
#    MESH: mesh flags for both, default one rank on one GPU, else the default mesh of the GPUs,
#    DEVICE=cuda; DEVICE=cpu MODEL=tiny SEQ=256 tries the script without a GPU)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=/tmp/upipe-kernels
seq=${SEQ:-131072}
work=${WORK:-/tmp/upipe-eval}
attn=${ATTN:-upipe}
device=${DEVICE:-cuda}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -le 1 ] && one="--ulysses 1 --ring 1" || one=""
read -r -a mesh <<< "${MESH:-$one}"
mkdir -p "$work"
{ date -u; nvidia-smi -L; } 2>&1
# two windows of SEQ inputs need 2 * SEQ + 1 tokens
text="$work/corpus.txt"
: > "$text"
while [ "$(stat -c %s "$text")" -le $(( 2 * seq )) ]; do cat assets/corpus.txt >> "$text"; done
"$bin/upipe" tokenize "$text" --tokenizer byte --eos 0 --out "$work/data.u32" || exit 1
read -r -a policy <<< "${POLICY:---checkpoint}"
# one training step at SEQ also writes the HF model directory eval reads
"$bin/upipe" train --model "${MODEL:-llama3.2-1b}" --data "$text" --seq "$seq" --steps 2 \
  --warmup 1 --attn "$attn" --device "$device" "${mesh[@]}" "${policy[@]}" --json --save-dir "$work/model" \
  > "$work/train.log" 2>&1 || { tail -20 "$work/train.log"; exit 1; }
read -r -a extra <<< "${EVAL_FLAGS:---buckets 8}"
"$bin/upipe" eval --json --model-dir "$work/model" --tokens "$work/data.u32" --seq "$seq" \
  --attn "$attn" --device "$device" "${mesh[@]}" "${extra[@]}" > "$work/eval.log" 2>&1 \
  || { tail -20 "$work/eval.log"; exit 1; }
field() { grep -o "\"$1\":[0-9.e+-]*" | tail -1 | cut -d: -f2; }
step=$(grep -a '"step":2' "$work/train.log")
ev=$(grep -a '"by_position"' "$work/eval.log")
echo "$ev" | cut -c1-600
printf '%-22s %14s %14s\n' "seq $seq ($attn, $gpus GPUs)" "tokens/s" "peak GB"
printf '%-22s %14.0f %14.2f\n' "train step 2 ${POLICY:---checkpoint}" \
  "$(echo "$step" | field tokens_per_s)" "$(echo "$step" | field peak_bytes | awk '{print $1/1e9}')"
printf '%-22s %14.0f %14.2f\n' "eval (forward only)" \
  "$(echo "$ev" | field tokens_per_s)" "$(echo "$ev" | field peak_bytes | awk '{print $1/1e9}')"
