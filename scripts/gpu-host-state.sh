#!/usr/bin/env bash
# Compact optimizer state on the host (`--offload-optimizer` beside
# `--optim-state bf16|8bit` and `--master-weights none`) on one GPU, in parts
# (PARTS, default "tests rehearse speed"):
#
#   tests     the GPU tests of host offload (tests/integration/gpu_offload.rs)
#             and of the planner against the GPU's ledger (gpu_plan.rs)
#   rehearse  the planner's longest Llama3-8B full fine-tuning on this card
#             (its usable memory, --host-mem 108) with 8-bit moments, no
#             master and BF16 gradients, `--offload-optimizer auto`, then
#             `--rehearse` there: the plan's device and host peaks and the
#             rehearsal's
#   speed     Llama3-8B at SEQ (65536) tokens, STEPS (3) steps, that state
#             on the device (--offload-optimizer 0) and on the host (all),
#             each of HOSTS ("0 all") with --host-update UPDATE (auto: the
#             GPU pages the host's compact state): tokens/s (median of
#             steps 2 on) and peaks against the plan
#
#   scripts/bundle.sh DIR gpu_offload gpu_plan && cp scripts/gpu-host-state.sh DIR/
#   bash DIR/gpu-host-state.sh            # on the GPU machine, from a checkout
set -u
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
here="$(cd "$(dirname "$0")" && pwd)"
U="$here/bin/upipe"
parts="${PARTS:-tests rehearse speed}"
{ date -u; nvidia-smi -L; } 2>&1
has() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
corpus_of() {  # a text corpus of at least $1 + 1 bytes (from the repository root)
    local data="/tmp/corpus-$1.txt" src=assets/corpus.txt
    [ -f "$src" ] || src="$here/../assets/corpus.txt"
    : > "$data"
    while [ "$(stat -c %s "$data")" -le "$1" ]; do cat "$src" >> "$data"; done
    echo "$data"
}
STATE="--grad-dtype bf16 --optim-state 8bit --master-weights none"
P="--attn upipe --ulysses 1 --ring 1 --checkpoint --tiled-mlp --offload auto"

if has tests; then
    echo "== tests"
    "$here/bin/test-gpu_offload" 2>&1 | grep -E "^test |SKIP|panicked|test result" | head -20
    [ -x "$here/bin/test-gpu_plan" ] &&
        "$here/bin/test-gpu_plan" 2>&1 | grep -E "^test |SKIP|panicked|test result" | head -20
fi

if has rehearse; then
    usable=$($U train --model tiny --ulysses 1 --ring 1 --seq 1024 --rehearse 2>&1 |
        grep -o '[0-9.]* GiB usable' | head -1 | cut -d' ' -f1)
    mem=$(python3 -c "print($usable + 1.5)")
    A="$P --offload-optimizer auto --checkpoint-every auto --host-mem 108"
    line=$($U plan --model llama3-8b $A $STATE --gpus 1 --gpu-mem "$mem" --json 2> /dev/null | grep '^{' | head -1)
    seq=$(echo "$line" | python3 -c "import json,sys; print(json.load(sys.stdin)['longest_seq'])")
    echo "== llama3-8b $STATE: usable $usable GiB, longest $seq"
    timeout 300 $U train --model llama3-8b $A $STATE --seq "$seq" --rehearse 2>&1 |
        grep -E "auto|preflight|device peak|host peak|pool|fits|does not|rror" | cut -c1-600
fi

if has speed; then
    seq="${SEQ:-65536}"
    summary=/tmp/host-state-summary.py
    cat > "$summary" <<'PY'
import json, statistics, sys
rates, last = [], None
for line in sys.stdin:
    if not line.startswith("{"):
        print(line.rstrip()[:300])
        continue
    s = json.loads(line)
    if "step" not in s:
        continue
    if s["step"] >= 2:
        rates.append(s["tokens_per_s"])
    last = s
if last is not None and rates:
    gib = 2**30
    host = last["peak_by_category"].get("offload_host", 0) / gib
    plan_host = last["predicted_by_category"].get("offload_host", 0) / gib
    print(f"tok/s {statistics.median(rates):.0f} (steps 2 on: {[round(r) for r in rates]}); "
          f"peak {last['peak_bytes'] / gib:.2f} GiB, plan {last['predicted_peak_bytes'] / gib:.2f}; "
          f"host {host:.2f} GiB, plan {plan_host:.2f}")
PY
    data="$(corpus_of $((seq * 2)))"
    for host in ${HOSTS:-0 all}; do
        echo "== llama3-8b $STATE at $seq, --offload-optimizer $host --host-update ${UPDATE:-auto}"
        timeout 280 $U train --model llama3-8b $P $STATE --offload-optimizer "$host" --host-update "${UPDATE:-auto}" --seq "$seq" \
            --steps "${STEPS:-3}" --warmup 1 --lr 1e-5 --data "$data" --json 2>&1 |
            grep -E '^\{|rror|auto' | python3 "$summary"
    done
fi
