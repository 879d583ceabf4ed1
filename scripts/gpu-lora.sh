#!/usr/bin/env bash
# One H200: LoRA adapters against full fine-tuning, same model, same length,
# one call.
#
#   bash scripts/gpu-lora.sh [UPIPE]     # repo root; UPIPE defaults to gpu-bundle/bin/upipe
#
# For each (MODEL, SEQ, FLAGS) of RUNS, `full` (every parameter trained)
# and `lora` (--lora-rank RANK on all seven targets, the base frozen) run
# STEPS steps each: tokens/s (median of steps 2 on), model TFLOP/s, the
# ledger's peak and the planner's prediction (`--json`). A run that does not
# fit prints its error. RUNS is a ;-separated list of `model seq flags...`.
# DEVICE=cpu RUNS="tiny 256" STEPS=2: a dry run on the CPU.
set -u
upipe="${1:-gpu-bundle/bin/upipe}"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
device="${DEVICE:-cuda}"
steps="${STEPS:-3}"
rank="${RANK:-16}"
runs="${RUNS:-llama3.2-1b 32768}"
work=$(mktemp -d)
[ "$device" = cuda ] && { date -u; nvidia-smi -L; } 2>&1

# median tokens/s of steps 2.., TFLOP/s, peak and planned peak (GB) of a --json log
summarize() {
    python3 - "$1" <<'EOF'
import json, statistics, sys
steps, plan = [], None
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"):
        continue
    j = json.loads(line)
    if "tokens_per_s" in j and "step" in j:
        steps.append(j)
    for k in ("predicted_peak_bytes", "planned_peak_bytes"):
        if k in j:
            plan = j[k]
if not steps:
    print("no steps")
    sys.exit(0)
later = steps[1:] or steps
tps = statistics.median(s["tokens_per_s"] for s in later)
tf = statistics.median(s.get("tflops", float("nan")) for s in later)
peak = max(s.get("peak_bytes", 0) for s in steps)
plan = plan or steps[-1].get("predicted_peak_bytes")
fmt = lambda b: "?" if not b else f"{b / 1e9:.2f}"
print(f"{tps:,.0f} tok/s  {tf:.0f} TFLOP/s  peak {fmt(peak)} GB  plan {fmt(plan)} GB  "
      f"loss {steps[-1].get('loss', float('nan')):.4f}")
EOF
}

IFS=';' read -ra cases <<< "$runs"
for c in "${cases[@]}"; do
    read -ra f <<< "$c"
    model="${f[0]}" seq="${f[1]}" extra=("${f[@]:2}")
    for mode in full lora; do
        args=(train --device "$device" --model "$model" --seq "$seq" --steps "$steps" --json "${extra[@]}")
        [ "$mode" = lora ] && args+=(--lora-rank "$rank")
        log="$work/$model-$seq-$mode.log"
        start=$(date +%s)
        "$upipe" "${args[@]}" > "$log" 2>&1
        rc=$?
        took=$(( $(date +%s) - start ))
        if [ $rc -ne 0 ]; then
            echo "ROW $model $seq $mode: exit $rc (${took}s): $(grep -iE "error|refuse|does not fit" "$log" | tail -1 | cut -c1-200)"
        else
            echo "ROW $model $seq $mode: $(summarize "$log") (${took}s)"
        fi
    done
done
