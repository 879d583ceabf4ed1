#!/usr/bin/env bash
# One H200: the planner's prediction of a LoRA run against the ledger on
# CUDA (bf16 base and adapters, F32 adapter gradients, AdamW moments and
# masters).
#
#   bash scripts/gpu-lora-plan.sh [UPIPE]   # repo root; UPIPE defaults to gpu-bundle/bin/upipe
#
# For each run (Llama 3.2 1B, 8K tokens, --checkpoint; LoRA r 16 on every
# target, on q_proj,v_proj, and every target with the optimizer on the
# host): four steps with --json, the measured peak beside the planner's
# (`predicted_peak_bytes`, the preflight's prediction); a ROW per run.
# DEVICE, MODEL, SEQ override the run (DEVICE=cpu MODEL=tiny SEQ=256: a dry
# run on the CPU, where the two are equal to the byte); EXTRA adds flags to
# every run (EXTRA="--fsdp on" on a machine of 2 GPUs: the base and the
# adapters sharded over both). Exits 1 when a peak differs from its
# prediction.
set -u
upipe="${1:-gpu-bundle/bin/upipe}"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
work=/tmp/upipe-lora-plan
rm -rf "$work"
mkdir -p "$work"
status=0
common=(--device "${DEVICE:-cuda}" --model "${MODEL:-llama3.2-1b}" --seq "${SEQ:-8192}" --checkpoint --seed 3 --steps 4 --json)
# shellcheck disable=SC2206
common+=(${EXTRA:-})
{ date -u; nvidia-smi -L; } 2>&1

# the highest measured peak and the prediction of the last step (bytes)
peaks() {
    python3 - "$1" <<'EOF2'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if not steps:
    print("no steps"); sys.exit(2)
peak = max(s.get("peak_bytes", 0) for s in steps)
pred = steps[-1].get("predicted_peak_bytes") or 0
print(f"peak {peak} B ({peak / 2**30:.3f} GiB), predicted {pred} B, loss {steps[-1]['loss']:.3f}")
sys.exit(0 if peak == pred else 1)
EOF2
}
i=0
for flags in "--lora-rank 16" "--lora-rank 16 --lora-targets q_proj,v_proj" "--lora-rank 16 --offload-optimizer"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    "$upipe" train "${common[@]}" $flags > "$work/run$i.log" 2>&1 || { echo "ROW $flags: FAILED"; tail -5 "$work/run$i.log"; status=1; continue; }
    if out=$(peaks "$work/run$i.log"); then
        echo "ROW $flags: $out"
    else
        echo "ROW $flags: peak differs from the plan: $out"; status=1
    fi
done
exit $status
