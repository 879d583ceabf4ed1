#!/usr/bin/env bash
# One H200: LoRA adapters against full fine-tuning and against HF + PEFT,
# same model, same length, one call.
#
#   bash scripts/gpu-lora.sh [UPIPE]     # repo root; UPIPE defaults to gpu-bundle/bin/upipe
#
# For each (MODEL, SEQ, FLAGS) of RUNS and each mode of MODES, STEPS steps:
#   full        upipe, every parameter trained (FLAGS, plus FULL_FLAGS)
#   lora        upipe --lora-rank RANK on all seven targets, the base frozen (FLAGS)
#   peft        HF transformers + PEFT (LoRA r RANK, all-linear) + PyTorch fused AdamW,
#               checkpointing on (scripts/hf_peer_step.py --lora-rank RANK --checkpoint)
#   peft-liger  the same with Liger Kernel's RMSNorm, SwiGLU, RoPE and fused loss (as
#               installed, else from the liger_kernel wheel scripts/bundle.sh copies to DIR/wheels)
# A ROW per run: tokens/s (median of steps 2 on; step 1 when it is the only one),
# upipe's model TFLOP/s (what is computed), the ledger's peak and the planner's
# (`--json`); a run that does not fit prints its error, a peer out of memory "oom".
# RUNS is a ;-separated list of `model seq flags...`.
# LONGEST=model: first `upipe plan` for that model on this GPU and host
# (LoRA r RANK with LORA_PLAN_FLAGS, full fine-tuning with FULL_PLAN_FLAGS), then
# `upipe train --rehearse` of the LoRA run at the planner's longest length and
# at 1,024 tokens more (which must not fit), both with HOST_MEM GiB of pinned host
# memory (default: 90 % of the available memory less 2 GiB).
# DEVICE=cpu RUNS="tiny 256" STEPS=2 MODES="full lora": a dry run on the CPU.
set -u
upipe="${1:-gpu-bundle/bin/upipe}"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
device="${DEVICE:-cuda}"
steps="${STEPS:-3}"
rank="${RANK:-16}"
runs="${RUNS:-llama3.2-1b 32768}"
modes="${MODES:-full lora}"
here="$(cd "$(dirname "$0")" && pwd)"
peer="$here/hf_peer_step.py"
[ -f "$peer" ] || peer="$here/../scripts/hf_peer_step.py"
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
    if j.get("oom"):
        print(f"oom at step {j.get('step')}: {j.get('error', '')[:120]}")
        sys.exit(0)
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
tf = "-" if tf != tf else f"{tf:.0f}"
peak = max(s.get("peak_bytes", 0) for s in steps)
plan = plan or steps[-1].get("predicted_peak_bytes")
fmt = lambda b: "?" if not b else f"{b / 1e9:.2f}"
print(f"{tps:,.0f} tok/s  {tf} TFLOP/s  peak {fmt(peak)} GB  plan {fmt(plan)} GB  "
      f"loss {steps[-1].get('loss', float('nan')):.4f}")
EOF
}

# the planner's longest lengths on this machine, and the rehearsal there
if [ -n "${LONGEST:-}" ]; then
    gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{ printf "%.1f", $1 / 1024 }')
    host="${HOST_MEM:-$(awk '/MemAvailable/ { printf "%d", $2 / 1048576 * 0.9 - 2 }' /proc/meminfo)}"
    plan=(plan --model "$LONGEST" --gpus 1 --gpu-mem "$gib" --reserve "${RESERVE:-1.6}" --host-mem "$host" --attn upipe)
    lora_plan=(${LORA_PLAN_FLAGS:---checkpoint --tiled-mlp --offload auto})
    full_plan=(${FULL_PLAN_FLAGS:---checkpoint --tiled-mlp --offload auto --offload-optimizer auto})
    echo "## plan on $gib GiB GPU, $host GiB host"
    "$upipe" "${plan[@]}" --lora-rank "$rank" "${lora_plan[@]}" --json > "$work/plan-lora.json" 2> "$work/plan-lora.err"
    "$upipe" "${plan[@]}" "${full_plan[@]}" --json > "$work/plan-full.json" 2> "$work/plan-full.err"
    longest() { grep -o '"longest[a-z_]*":[0-9]*' "$1" | head -1 | cut -d: -f2; }
    lora_max=$(longest "$work/plan-lora.json") full_max=$(longest "$work/plan-full.json")
    echo "PLAN $LONGEST lora r $rank longest ${lora_max:-?}; full fine-tuning longest ${full_max:-?}"
    head -c 600 "$work/plan-lora.json"; echo
    if [ -n "$lora_max" ]; then
        for s in "$lora_max" $((lora_max + 1024)); do
            "$upipe" train --model "$LONGEST" --seq "$s" --attn upipe --ulysses 1 --ring 1 \
                --host-mem "$host" --lora-rank "$rank" "${lora_plan[@]}" --rehearse > "$work/rehearse-$s.log" 2>&1
            echo "REHEARSE lora $s: exit $? $(grep -iE "peak|fits|does not fit" "$work/rehearse-$s.log" | tail -3 | tr '\n' ' ' | cut -c1-400)"
        done
    fi
fi

# Liger Kernel for peft-liger: as installed, else from the bundle's wheel
if [[ " $modes " == *" peft-liger "* ]] && ! python3 -c "import liger_kernel.transformers" 2> /dev/null; then
    whl="$(ls "$here"/wheels/liger_kernel-*.whl 2> /dev/null | head -1)"
    if [ -n "$whl" ] && python3 -m pip install --quiet --no-deps --no-index --target "$work/liger" "$whl"; then
        export PYTHONPATH="$work/liger${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "no liger_kernel (installed or in $here/wheels): peft-liger will fail"
    fi
fi

# upipe's runs read the bundled corpus repeated past the longest length (the
# embedded one holds about 144K tokens)
data="$work/corpus.txt"
src=assets/corpus.txt
[ -f "$src" ] || src="$here/../assets/corpus.txt"
longest_run=$(echo "$runs" | tr ';' '\n' | awk '{ if ($2 > m) m = $2 } END { print m + 0 }')
: > "$data"
while [ "$(stat -c %s "$data")" -le $((longest_run * 6 + 8192)) ]; do cat "$src" >> "$data"; done

IFS=';' read -ra cases <<< "$runs"
for c in "${cases[@]}"; do
    read -ra f <<< "$c"
    model="${f[0]}" seq="${f[1]}" extra=("${f[@]:2}")
    for mode in $modes; do
        case "$mode" in
            full | lora)
                args=("$upipe" train --device "$device" --model "$model" --seq "$seq" --steps "$steps" --data "$data" --json "${extra[@]}")
                if [ "$mode" = lora ]; then args+=(--lora-rank "$rank"); else args+=(${FULL_FLAGS:-}); fi ;;
            peft | peft-liger)
                args=(python3 "$peer" --model "$model" --seq "$seq" --steps "$steps" --checkpoint --lora-rank "$rank")
                [ "$mode" = peft-liger ] && args+=(--liger) ;;
            *) echo "unknown mode $mode"; continue ;;
        esac
        log="$work/$model-$seq-$mode.log"
        start=$(date +%s)
        "${args[@]}" > "$log" 2>&1
        rc=$?
        took=$(( $(date +%s) - start ))
        if [ $rc -ne 0 ]; then
            echo "ROW $model $seq $mode: exit $rc (${took}s): $(grep -iE "error|refuse|does not fit" "$log" | tail -1 | cut -c1-200)"
        else
            echo "ROW $model $seq $mode: $(summarize "$log") (${took}s)"
        fi
    done
done
