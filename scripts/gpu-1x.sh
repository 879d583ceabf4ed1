#!/usr/bin/env bash
# One H200 (or any one GPU): the GPU tests of FSDP, host offload, the planner
# and eval, then Llama 3.2 1B training steps with and without host offload.
#
#   scripts/gpu-1x.sh build DIR     # on a machine with Rust: the test binaries
#                                   # it runs and `upipe`, stripped, into DIR/bin
#   bash DIR/gpu-1x.sh [PARTS]      # on the GPU machine, from the repository root
#
# PARTS (default "tests offload"): tests = gpu_backend, gpu_plan, gpu_fsdp, gpu_offload,
# gpu_eval, gpu_layer (TESTS: a space-separated subset); offload = `train --checkpoint` against
# `--checkpoint --offload` at SEQS (default "131072 262144"), STEPS (2) each,
# printing step 2's tokens/s, GPU peak and host peak; eval = scripts/gpu-eval-long.sh;
# optim = the tiny model with the optimizer on the host and on the GPU; rehearse =
# `--rehearse` around the planner's longest contexts (REHEARSALS: lines of
# "model seq flags", the mesh among the flags); profile = Llama 3.2 1B at PROFILE_SEQ
# (131072) with PROFILE_FLAGS (--checkpoint when unset; empty: none) and --trace; 8b = Llama3-8B (random init)
# at SEQ8B (65536) with --offload-optimizer OPT8B (auto; a line's own wins) --offload auto
# --checkpoint --tiled-mlp and --lr LR8B (1e-4) and EXTRA8B (more flags, e.g. --host-mem 112),
# STEPS8B (3) steps, under each line of ATTNS8B (UPipe on one GPU, local). MEMLOG=1 samples the cgroup's and upipe's
# host memory every 5 s into memory.log; ab = an old build against this one (below);
# peer = the HF transformers + PyTorch step (hf_peer_step.py) beside upipe's default policy
# at each line of PEERS ("seq steps [--checkpoint]"); runs = upipe training runs, one per
# line of RUNS ("model seq steps flags...").
set -u
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-1x.sh build DIR}"   # OLD=COMMIT adds bin/upipe-old
    set -e
    bash "$(dirname "$0")/bundle.sh" "$dest" gpu_backend gpu_plan gpu_fsdp gpu_eval gpu_layer gpu_offload
    cp "$0" scripts/gpu-eval-long.sh scripts/hf_peer_step.py "$dest/"
    du -sh "$dest"
    exit 0
fi
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
# every log goes to one folder, packed into $OUT/logs.tgz when the script
# ends or is stopped (a device call brings back few files); each result row
# is printed as soon as it exists, so a run stopped by its time limit still
# shows what it measured
out=/tmp/upipe-1x-logs
mkdir -p "$out"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C "$out" . 2>/dev/null; }
trap pack EXIT
trap 'pack; exit 124' TERM INT
row() { table+=("$1"); echo "ROW $1"; }
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
parts="${1:-tests offload}"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader; } 2>&1
"$bin/upipe" info 2>&1 | grep -iE "cudnn|nccl|driver|cuda" | head -8
declare -a table
status=0
if [ -n "${MEMLOG:-}" ]; then
    # the container's limit and use beside upipe's resident and pinned memory
    cg=/sys/fs/cgroup
    { echo "memory.max $(cat $cg/memory.max 2>/dev/null || cat $cg/memory/memory.limit_in_bytes 2>/dev/null)"
      grep -E "MemTotal|MemAvailable" /proc/meminfo; } | tee "$out/memory.log"
    ( while sleep 5; do
        p=$(pgrep -x upipe | head -1)
        echo "$(date +%T) cgroup $(cat $cg/memory.current 2>/dev/null || cat $cg/memory/memory.usage_in_bytes 2>/dev/null)" \
            "$( [ -n "$p" ] && grep -E "VmRSS|VmPin|VmLck" /proc/$p/status | tr -s ' \n' ' ')"
    done >> "$out/memory.log" 2>&1 ) &
    memlog=$!
    trap 'kill $memlog 2>/dev/null; pack' EXIT
fi
if [[ " $parts " == *" tests "* ]]; then
    for t in "$bin"/test-*; do
        name="$(basename "$t")"
        [ -n "${TESTS:-}" ] && [[ " $TESTS " != *" ${name#test-} "* ]] && continue
        log="$out/$name.log"
        s=$(date +%s)
        "$t" --test-threads=1 --nocapture > "$log" 2>&1
        rc=$?
        [ "$rc" -ne 0 ] && status=1
        res="$(grep -E '^test result:' "$log" | tail -1 | sed 's/test result: //; s/; finished.*//')"
        row "$(printf '%-22s rc=%-3s %5ss  %s' "$name" "$rc" "$(( $(date +%s) - s ))" "$res")"
        grep -E "panicked|FAILED|SKIP|gpu step|fsdp|GPU peak|step [0-9]:|eval" "$log" | head -60
    done
fi
corpus() { # the bundled corpus repeated past $1 bytes, at /tmp/upipe-1x-corpus.txt
    data=/tmp/upipe-1x-corpus.txt
    : > "$data"
    while [ "$(stat -c %s "$data")" -le "$1" ]; do cat assets/corpus.txt >> "$data"; done
}
field() { echo "$1" | grep -o "\"$2\":[0-9.e+-]*" | head -1 | cut -d: -f2; }
gb() { awk '{printf "%.2f", $1/1e9}'; }
if [[ " $parts " == *" offload "* ]]; then
    corpus "$(echo ${SEQS:-131072 262144} | tr ' ' '\n' | sort -n | tail -1)"
    for seq in ${SEQS:-131072 262144}; do
        for pol in "--checkpoint" "--checkpoint --offload"; do
            read -r -a p <<< "$pol"
            log="$out/train-$seq-${#p[@]}.log"
            "$bin/upipe" train --model "${MODEL:-llama3.2-1b}" --data "$data" --seq "$seq" \
                --steps "${STEPS:-2}" --warmup 1 "${p[@]}" --json > "$log" 2>&1
            rc=$?
            [ "$rc" -ne 0 ] && { status=1; grep -aiE "error|panick" "$log" | head -5; }
            last=$(grep -a '"step"' "$log" | tail -1)
            host=$(grep -a "offload_host" "$log" | tail -1 | tr -s ' ' | cut -c1-80)
            row "$(printf 'seq %-7s %-24s rc=%s %8.0f tok/s  peak %6.2f GB (planned %6.2f)  %s' "$seq" "$pol" "$rc" \
                "$(field "$last" tokens_per_s)" "$(field "$last" peak_bytes | gb)" "$(field "$last" predicted_peak_bytes | gb)" "$host")"
        done
    done
fi
if [[ " $parts " == *" optim "* ]]; then
    # the optimizer on the host against on the GPU, 5 steps of the tiny model
    for pol in "--checkpoint" "--checkpoint --offload-optimizer" "--checkpoint --offload 1 --offload-optimizer"; do
        read -r -a p <<< "$pol"
        losses=$("$bin/upipe" train --model tiny --steps 5 "${p[@]}" --json 2>&1 | grep -a '"step"' |
            grep -o '"loss":[0-9.]*' | cut -d: -f2 | tr '\n' ' ')
        row "$(printf 'tiny %-46s losses %s' "$pol" "$losses")"
    done
fi
if [[ " $parts " == *" rehearse "* ]]; then
    # rehearsals around the planner's longest contexts (nothing computed)
    while read -r model seq pol; do
        [ -z "$model" ] && continue
        read -r -a p <<< "$pol"
        log="$out/rehearse-$model-$seq-${#p[@]}.log"
        "$bin/upipe" train --model "$model" --seq "$seq" "${p[@]}" --rehearse --json > "$log" 2>&1
        rc=$?
        j=$(grep -a '"fits"' "$log" | tail -1 | grep -o '"device_peak":{[^}]*}\|"host_peak":{[^}]*}\|"fits":[a-z]*' | tr '\n' ' ')
        row "$(printf 'rehearse %-12s %8s rc=%s %-60s %s' "$model" "$seq" "$rc" "$pol" "$(echo "$j" | cut -c1-300)")"
    done <<< "${REHEARSALS:-llama3-8b 430080 --attn upipe --ulysses 1 --ring 1 --checkpoint --tiled-mlp --offload auto --offload-optimizer --host-mem 120
llama3-8b 347136 --attn local --checkpoint --tiled-mlp --offload auto --offload-optimizer --host-mem 120
llama3.2-1b 926720 --attn upipe --ulysses 1 --ring 1 --checkpoint --offload auto --host-mem 120
llama3.2-1b 651264 --attn upipe --ulysses 1 --ring 1 --checkpoint}"
fi
if [[ " $parts " == *" profile "* ]]; then
    corpus 262144
    read -r -a p <<< "${PROFILE_FLAGS---checkpoint}"
    pseq="${PROFILE_SEQ:-131072}"
    log="$out/profile-1b-$pseq.log"
    "$bin/upipe" train --model llama3.2-1b --data "$data" --seq "$pseq" --steps 3 --warmup 1 \
        "${p[@]}" --trace "$out/trace-1b-$pseq.json" > "$log" 2>&1 || status=1
    tail -20 "$log"
fi
if [[ " $parts " == *" 8b "* ]]; then
    corpus $(( ${SEQ8B:-65536} * 2 + 8192 ))
    k=0
    while read -r attn; do
        [ -z "$attn" ] && continue
        read -r -a at <<< "$attn"
        k=$((k + 1))
        log="$out/train-8b-$k-${at[0]}.log"
        # a line's own --offload-optimizer wins over OPT8B
        opt=(--offload-optimizer "${OPT8B:-auto}")
        [[ "$attn" == *--offload-optimizer* ]] && opt=()
        s=$(date +%s)
        "$bin/upipe" train --model llama3-8b --data "$data" --seq "${SEQ8B:-65536}" --steps "${STEPS8B:-3}" \
            --warmup 1 --lr "${LR8B:-1e-4}" --attn "${at[@]}" --checkpoint --tiled-mlp --offload auto "${opt[@]}" \
            ${EXTRA8B:-} --profile --json > "$log" 2>&1
        rc=$?
        [ "$rc" -ne 0 ] && { status=1; grep -aiE "error|panick" "$log" | head -5; }
        grep -aE "offload auto|offload-optimizer auto|save-attention|chunk-heads auto" "$log" | head -4
        grep -aE "^(gemm|attn|recompute|elementwise|loss|optimizer|copy|collective|idle|class|step)" "$log" | tail -14
        losses=$(grep -a '"step"' "$log" | grep -o '"loss":[0-9.]*' | cut -d: -f2 | tr '\n' ' ')
        last=$(grep -a '"step"' "$log" | tail -1)
        row "$(printf '8b %-28s rc=%s %5ss %7.0f tok/s %5.0f TFLOP/s peak %s GB (planned %s) host %s GB losses %s' \
            "$attn" "$rc" "$(( $(date +%s) - s ))" "$(field "$last" tokens_per_s)" "$(field "$last" tflops)" \
            "$(field "$last" peak_bytes | gb)" "$(field "$last" predicted_peak_bytes | gb)" \
            "$(field "$last" offload_host | gb)" "$losses")"
    done <<< "${ATTNS8B:-upipe --ulysses 1 --ring 1
local}"
fi
if [[ " $parts " == *" ab "* ]]; then
    # an old build (bin/upipe-old: OLD=COMMIT at build) against this one, the same
    # training run in A B B A order, AB_REPS pairs: Llama 3.2 1B at AB_SEQ (32768)
    # with AB_FLAGS (none), AB_STEPS (3) steps, the last step's tok/s
    if [ ! -x "$bin/upipe-old" ]; then
        row "SKIP ab: no $bin/upipe-old (build with OLD=COMMIT)"
    else
        corpus $(( ${AB_SEQ:-32768} * 2 + 8192 ))
        read -r -a p <<< "${AB_FLAGS:-}"
        for r in $(seq "${AB_REPS:-2}"); do
            order="upipe-old upipe"; [ $((r % 2)) = 0 ] && order="upipe upipe-old"
            for b in $order; do
                log="$out/ab-$b-$r.log"
                "$bin/$b" train --model llama3.2-1b --data "$data" --seq "${AB_SEQ:-32768}" \
                    --steps "${AB_STEPS:-3}" --warmup 1 "${p[@]}" --profile --json > "$log" 2>&1 || status=1
                last=$(grep -a '"step"' "$log" | tail -1)
                row "$(printf 'ab %-9s round %s seq %s %8.0f tok/s  loss %s  peak %s GB' "$b" "$r" "${AB_SEQ:-32768}" \
                    "$(field "$last" tokens_per_s)" "$(field "$last" loss)" "$(field "$last" peak_bytes | gb)")"
                grep -aE "^(gemm|attn_fwd|attn_bwd|elementwise|loss|copy|idle) " "$log" | tail -7 | tr -s ' ' | tr '\n' ';'; echo
            done
        done
    fi
fi
if [[ " $parts " == *" peer "* ]]; then
    # the peer's step and upipe's default policy for the same length, one after the other
    while read -r seq steps pol; do
        [ -z "$seq" ] && continue
        log="$out/peer-$seq.log"
        python3 "$here/hf_peer_step.py" --seq "$seq" --steps "$steps" $pol > "$log" 2>&1 || status=1
        last=$(grep -a '"peer"' "$log" | tail -1)
        [ -z "$last" ] && tail -5 "$log"
        row "$(printf 'peer hf   seq %-7s %-13s %8s tok/s  peak %s GB  loss %s' "$seq" "${pol:-none}" \
            "$(field "$last" tokens_per_s)" "$(field "$last" peak_bytes | gb)" "$(field "$last" loss)")"
        corpus $(( seq * 2 + 8192 ))
        log="$out/peer-upipe-$seq.log"
        "$bin/upipe" train --model llama3.2-1b --data "$data" --seq "$seq" --steps "$steps" --warmup 1 \
            $pol --profile --json > "$log" 2>&1 || status=1
        last=$(grep -a '"step"' "$log" | tail -1)
        grep -aE "^(class|gemm|attn_fwd|attn_bwd|recompute|elementwise|loss|optimizer|copy|collective|idle) " "$log" | tail -11
        row "$(printf 'peer upipe seq %-7s %-13s %8.0f tok/s  peak %s GB  loss %s' "$seq" "${pol:-none}" \
            "$(field "$last" tokens_per_s)" "$(field "$last" peak_bytes | gb)" "$(field "$last" loss)")"
    done <<< "${PEERS:-32768 3
262144 2 --checkpoint}"
fi
if [[ " $parts " == *" runs "* ]]; then
    # upipe training runs, one per line of RUNS ("model seq steps flags..."), in order
    k=0
    while read -r model seq steps flags; do
        [ -z "$model" ] && continue
        k=$((k + 1))
        corpus $(( seq * 2 + 8192 ))
        log="$out/run-$k-$model-$seq.log"
        "$bin/upipe" train --model "$model" --data "$data" --seq "$seq" --steps "$steps" --warmup 1 \
            $flags --profile --json > "$log" 2>&1 || { status=1; grep -aiE "error|panick" "$log" | head -5; }
        last=$(grep -a '"step"' "$log" | tail -1)
        grep -aE "auto:" "$log" | head -4
        grep -aE "^(class|gemm|attn_fwd|attn_bwd|recompute|elementwise|loss|optimizer|copy|collective|idle) " "$log" | tail -11
        row "$(printf 'run %-11s seq %-7s %-40s %8.0f tok/s %5.0f TFLOP/s peak %s GB (planned %s) loss %s' "$model" "$seq" \
            "${flags:-default}" "$(field "$last" tokens_per_s)" "$(field "$last" tflops)" "$(field "$last" peak_bytes | gb)" \
            "$(field "$last" predicted_peak_bytes | gb)" "$(field "$last" loss)")"
    done <<< "${RUNS:-llama3.2-1b 131072 3 --checkpoint
llama3.2-1b 131072 3 --checkpoint --tiled-mlp}"
fi
if [[ " $parts " == *" eval "* ]]; then
    bash "$here/gpu-eval-long.sh" 2>&1 | tail -8
fi
echo "== summary"
for row in "${table[@]}"; do echo "$row"; done
exit $status
