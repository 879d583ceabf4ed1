#!/usr/bin/env bash
# One H200 (or any one GPU): the GPU tests of FSDP, host offload, the planner
# and eval, then Llama 3.2 1B training steps with and without host offload.
#
#   scripts/gpu-1x.sh build DIR     # on a machine with Rust: the test binaries
#                                   # it runs and `upipe`, stripped, into DIR/bin
#   bash DIR/gpu-1x.sh [PARTS]      # on the GPU machine, from the repository root
#
# PARTS (default "tests offload"): tests = gpu_backend, gpu_plan, gpu_fsdp,
# gpu_eval, gpu_layer; offload = `train --checkpoint` against
# `--checkpoint --offload` at SEQS (default "131072 262144"), STEPS (2) each,
# printing step 2's tokens/s, GPU peak and host peak; eval = scripts/gpu-eval-long.sh.
set -u
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-1x.sh build DIR}"
    set -e
    mkdir -p "$dest/bin"
    rm -f "$dest"/bin/*
    cargo test --release --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
want = {"gpu_backend", "gpu_plan", "gpu_fsdp", "gpu_eval", "gpu_layer"}
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        print(m["target"]["name"] + "\t" + m["executable"])
' | while IFS=$'\t' read -r name exe; do cp "$exe" "$dest/bin/test-$name"; done
    cargo build --release --bin upipe
    cp target/release/upipe "$dest/bin/upipe"
    strip "$dest"/bin/* || true
    cp "$0" scripts/gpu-eval-long.sh "$dest/"
    du -sh "$dest"
    exit 0
fi
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
out="${OUT:-/tmp}"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
parts="${1:-tests offload}"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader; } 2>&1
"$bin/upipe" info 2>&1 | grep -iE "cudnn|nccl|driver|cuda" | head -8
declare -a table
status=0
if [[ " $parts " == *" tests "* ]]; then
    for t in "$bin"/test-*; do
        name="$(basename "$t")"
        log="$out/$name.log"
        s=$(date +%s)
        "$t" --test-threads=1 --nocapture > "$log" 2>&1
        rc=$?
        [ "$rc" -ne 0 ] && status=1
        res="$(grep -E '^test result:' "$log" | tail -1 | sed 's/test result: //; s/; finished.*//')"
        table+=("$(printf '%-22s rc=%-3s %5ss  %s' "$name" "$rc" "$(( $(date +%s) - s ))" "$res")")
        grep -E "panicked|FAILED|SKIP|gpu step|fsdp|GPU peak|step [0-9]:|eval" "$log" | head -60
    done
fi
if [[ " $parts " == *" offload "* ]]; then
    data=/tmp/upipe-1x-corpus.txt
    : > "$data"
    big=$(echo ${SEQS:-131072 262144} | tr ' ' '\n' | sort -n | tail -1)
    while [ "$(stat -c %s "$data")" -le "$big" ]; do cat assets/corpus.txt >> "$data"; done
    for seq in ${SEQS:-131072 262144}; do
        for pol in "--checkpoint" "--checkpoint --offload"; do
            read -r -a p <<< "$pol"
            log="$out/train-$seq-${#p[@]}.log"
            "$bin/upipe" train --model "${MODEL:-llama3.2-1b}" --data "$data" --seq "$seq" \
                --steps "${STEPS:-2}" --warmup 1 "${p[@]}" --json > "$log" 2>&1
            rc=$?
            [ "$rc" -ne 0 ] && { status=1; grep -aiE "error|panick" "$log" | head -5; }
            last=$(grep -a '"step"' "$log" | tail -1)
            f() { echo "$last" | grep -o "\"$1\":[0-9.e+-]*" | cut -d: -f2; }
            host=$(grep -a "offload_host" "$log" | tail -1 | tr -s ' ' | cut -c1-80)
            table+=("$(printf 'seq %-7s %-24s rc=%s %8.0f tok/s  peak %6.2f GB (planned %6.2f)  %s' "$seq" "$pol" "$rc" \
                "$(f tokens_per_s)" "$(f peak_bytes | awk '{print $1/1e9}')" "$(f predicted_peak_bytes | awk '{print $1/1e9}')" "$host")")
        done
    done
fi
if [[ " $parts " == *" eval "* ]]; then
    bash "$here/gpu-eval-long.sh" 2>&1 | tail -8
fi
echo "== summary"
for row in "${table[@]}"; do echo "$row"; done
exit $status
