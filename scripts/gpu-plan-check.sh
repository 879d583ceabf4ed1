#!/usr/bin/env bash
# One GPU: the planner against the GPU ledger, and this build against an
# older one, in one call.
#
#   scripts/gpu-plan-check.sh build DIR   # on a machine with Rust: `upipe`, the GPU
#                                         # test modules it runs, this script and
#                                         # doc_mix.py into DIR (OLD=COMMIT: that
#                                         # commit's `upipe` as DIR/bin/upipe-old)
#   bash DIR/gpu-plan-check.sh [PARTS]    # on the GPU machine, from the repository root
#
# PARTS (default "tests ab"):
#   tests = the GPU test modules (TESTS, default: gpu_plan gpu_layer gpu_offload
#           gpu_eval gpu_fsdp gpu_backend), each under a time limit
#   ab    = Llama 3.2 1B at 32K (the default policy, 4 steps) and 128K (--checkpoint,
#           2 steps), this build and bin/upipe-old alternating (ROUNDS, default 1)
#   runs  = this build's peak against its plan: Llama3-8B at 64K with the optimizer
#           on the host, Llama 3.2 1B LoRA r 16 at 32K, and Llama 3.2 1B on packed
#           documents at 32K (RUNS: a subset of "8b lora docs")
# Each row: tokens/s (median of steps 2 on), the ledger peak and the plan's.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-plan-check.sh build DIR}"
    set -e
    bash "$here/bundle.sh" "$dest" gpu_plan gpu_layer gpu_offload gpu_eval gpu_fsdp gpu_backend
    cp "$0" "$here/doc_mix.py" "$dest/"
    du -sh "$dest"
    exit 0
fi
bin="$here/bin"
parts=" ${1:-tests ab} "
work=/tmp/upipe-plan-check
mkdir -p "$work"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
{ date -u; nvidia-smi -L; } 2>&1
table=()
status=0
row() {
    table+=("$1")
    echo "ROW $1"
}

if [[ "$parts" == *" tests "* ]]; then
    for t in ${TESTS:-gpu_plan gpu_layer gpu_offload gpu_eval gpu_fsdp gpu_backend}; do
        log="$work/test-$t.log"
        start=$(date +%s)
        timeout -k 5 "${TEST_LIMIT:-150}" "$bin/test-$t" --test-threads 1 > "$log" 2>&1
        rc=$?
        [ "$rc" -ne 0 ] && { status=1; grep -aE "panicked|FAILED" "$log" | head -5; }
        res=$(grep -a '^test result:' "$log" | tail -1 | sed 's/test result: //; s/; finished.*//')
        row "$(printf 'test %-12s rc=%-3s %4ss %s; %s SKIP lines' "$t" "$rc" "$(($(date +%s) - start))" "$res" "$(grep -ac SKIP "$log")")"
    done
fi

# One training run: NAME, then `upipe train`'s arguments; a row of its
# tokens/s (median of steps 2 on), peak and planned peak (GB).
train_row() {
    local name="$1" exe="$2"
    shift 2
    local log="$work/$name.log"
    "$exe" train --warmup 1 --json "$@" > "$log" 2>&1
    local rc=$?
    [ "$rc" -ne 0 ] && { status=1; grep -aiE "error|panick" "$log" | head -3; }
    python3 - "$log" "$name" "$rc" <<'PY'
import json, statistics, sys
log, name, rc = sys.argv[1:]
steps = []
for line in open(log, errors="replace"):
    line = line.strip()
    if line.startswith("{"):
        try:
            j = json.loads(line)
        except ValueError:
            continue
        if "tokens_per_s" in j and "step" in j:
            steps.append(j)
later = [s["tokens_per_s"] for s in steps if s["step"] >= 2] or [s["tokens_per_s"] for s in steps]
tps = statistics.median(later) if later else 0.0
last = steps[-1] if steps else {}
gb = lambda k: (last.get(k) or 0) / 1e9
same = "=" if last.get("peak_bytes") == last.get("predicted_peak_bytes") and last.get("peak_bytes") else "!="
print("ROW %-18s rc=%s %9.0f tok/s  peak %7.3f GB %s plan %7.3f GB  steps %d" % (
    name, rc, tps, gb("peak_bytes"), same, gb("predicted_peak_bytes"), len(steps)))
PY
}

if [[ "$parts" == *" ab "* ]]; then
    for round in $(seq 1 "${ROUNDS:-1}"); do
        for b in upipe upipe-old; do
            [ -x "$bin/$b" ] || continue
            train_row "$b-1b-32k-r$round" "$bin/$b" --model llama3.2-1b --ulysses 1 --ring 1 --seq 32768 --steps 4
            train_row "$b-1b-128k-r$round" "$bin/$b" --model llama3.2-1b --ulysses 1 --ring 1 --seq 131072 --steps 2 --checkpoint
        done
    done
fi

if [[ "$parts" == *" runs "* ]]; then
    want=" ${RUNS:-8b lora docs} "
    if [[ "$want" == *" 8b "* ]]; then
        train_row "8b-64k-optim-host" "$bin/upipe" --model llama3-8b --ulysses 1 --ring 1 --seq 65536 --steps 3 \
            --checkpoint --tiled-mlp --offload auto --offload-optimizer auto --lr 1e-5
    fi
    if [[ "$want" == *" lora "* ]]; then
        train_row "1b-lora16-32k" "$bin/upipe" --model llama3.2-1b --ulysses 1 --ring 1 --seq 32768 --steps 3 --lora-rank 16
    fi
    if [[ "$want" == *" docs "* ]]; then
        python3 "$here/doc_mix.py" --out "$work/mix.jsonl" --tokens $((32768 * 6)) > /dev/null 2>&1
        "$bin/upipe" tokenize "$work/mix.jsonl" --tokenizer byte --eos 0 --out "$work/mix.u32" > "$work/tok.log" 2>&1 \
            || { tail -3 "$work/tok.log"; status=1; }
        train_row "1b-docs-32k" "$bin/upipe" --model llama3.2-1b --ulysses 1 --ring 1 --seq 32768 --steps 3 \
            --data "$work/mix.u32" --pack documents
    fi
fi

echo
echo "== summary"
printf '%s\n' "${table[@]}"
exit $status
