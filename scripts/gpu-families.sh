#!/usr/bin/env bash
# One H200: model families (Qwen2.5 biases and YaRN, Mistral sliding windows),
# the attention kernel decided per run, and the interop checks against
# PyTorch + transformers; an A/B of the whole step against an older build.
#
#   OLD=COMMIT scripts/gpu-families.sh build DIR   # on a machine with Rust:
#                     # `upipe`, the GPU test binaries and (with OLD) that
#                     # commit's `upipe` as DIR/bin/upipe-old
#   bash DIR/gpu-families.sh [PARTS]               # on the GPU machine, repo root
#
# PARTS (default "tests interop"):
#   tests   = every single-GPU gpu_* test binary (backend, plan, layer, eval,
#             fsdp, offload; TESTS names fewer): CUDA against the CPU
#             reference, planner == ledger
#   interop = scripts/check_families.py (qwen2, mistral against transformers),
#             check_training_torch.py (six AdamW steps and packed documents
#             against PyTorch), check_hf_roundtrip.py
#   ab      = Llama 3.2 1B, one GPU: 32K without and 128K with --checkpoint,
#             upipe-old and upipe alternating (AB_RUNS each at 32K, AB_RUNS_LONG
#             at 128K, AB_STEPS steps),
#             median tokens/s of steps 2 on, peak against the plan
#   window  = a Llama 3.2 1B-sized Mistral (sliding window WINDOW, 4096) at
#             WIN_SEQ (131072) with --checkpoint, on cuDNN (auto) and on the
#             flash kernels (native), against the same model with no window:
#             tokens/s, TFLOP/s (counted over the band), peaks
#   big     = 7B architectures (random init, --checkpoint --tiled-mlp, the
#             optimizer's state on the host as `auto` decides): Mistral-7B
#             (v0.1, window 4096) and the same with no window at BIG_SEQ
#             (131072), then Qwen2.5-7B at QWEN_SEQ (65536, 0: none);
#             BIG_STEPS (2) steps each, within BUDGET seconds (480);
#             BIG_WINDOWS ("4096 none") the Mistral windows
#   bias    = Qwen2.5-1.5B at BIAS_SEQ (32768), the last step's trace: the
#             GPU time of the q/k/v bias adds and their gradients
#   gemma   = Gemma 3 (random init): gemma3-4b at 32768 and, with
#             --checkpoint, 131072 (GEMMA_SEQS), on cuDNN and the native
#             kernels (GEMMA_KERNELS, "auto native"); tokens/s, TFLOP/s, peak
#             against the plan
#   gemma-peer = gemma3-4b at GEMMA_PEER_SEQ (32768) through
#             hf_peer_step.py --liger (apply_liger_kernel_to_gemma3), without
#             and with checkpointing, beside upipe's row of `gemma`
set -u
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-families.sh build DIR}"
    set -e
    bash "$(dirname "$0")/bundle.sh" "$dest" gpu_backend gpu_plan gpu_layer gpu_eval gpu_fsdp gpu_offload
    cp "$0" "$(dirname "$0")/hf_peer_step.py" "$dest/"
    du -sh "$dest"
    exit 0
fi
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
parts="${1:-tests interop}"
work=/tmp/upipe-families
mkdir -p "$work"
declare -a table
row() { table+=("$1"); echo "ROW $1"; }
status=0
{ date -u; nvidia-smi -L; } 2>&1

if [[ " $parts " == *" tests "* ]]; then
    for t in ${TESTS:-gpu_backend gpu_plan gpu_layer gpu_eval gpu_fsdp gpu_offload}; do
        [ -x "$bin/test-$t" ] || { row "test $t: not bundled"; continue; }
        if "$bin/test-$t" --test-threads 1 > "$work/$t.log" 2>&1; then
            row "test $t: $(grep -E '^test result' "$work/$t.log")"
        else
            status=1
            row "test $t: FAILED"
            grep -E "panicked|FAILED|failed" "$work/$t.log" | head -20
        fi
    done
fi

if [[ " $parts " == *" interop "* ]]; then
    for check in check_families check_training_torch check_hf_roundtrip; do
        [ -f "scripts/$check.py" ] || { row "$check: absent"; continue; }
        more=()
        [ "$check" = check_families ] && more=(--cuda)
        [ "$check" = check_training_torch ] && more=(--parts "${TORCH_PARTS:-adamw adamw-gemma3 packed packed-hf}")
        python3 "scripts/$check.py" --upipe "$bin/upipe" "${more[@]}" > "$work/$check.log" 2>&1
        rc=$?
        grep -E "^(PASS|FAIL)" "$work/$check.log" | sed 's/^/  /'
        [ $rc = 0 ] || { status=1; tail -15 "$work/$check.log" | sed 's/^/  | /'; }
        row "$check: exit $rc, $(tail -1 "$work/$check.log")"
    done
fi

# one training run's summary: median tokens/s of steps 2 on, TFLOP/s, peaks
run_row() {
    local label="$1" log="$2"
    shift 2
    "$@" --json > "$log" 2>&1 || { tail -5 "$log"; status=1; }
    local out
    out=$(python3 - "$log" "$label" <<'PY'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
steps = [l for l in lines if "step" in l and "tokens_per_s" in l]
if not steps:
    print("ROW %s: no step line" % sys.argv[2]); sys.exit()
later = steps[1:] or steps
tps = statistics.median(s["tokens_per_s"] for s in later)
tfl = statistics.median(s["tflops"] for s in later)
s = steps[-1]
gib = lambda b: "%.2f" % (b / 2**30) if b else "?"
print("ROW %s: %.0f tok/s, %.0f TFLOP/s, peak %s GiB, predicted %s GiB, attn_frac %s" % (
    sys.argv[2], tps, tfl, gib(s.get("peak_bytes")), gib(s.get("predicted_peak_bytes")),
    s.get("attn_flop_fraction")))
PY
)
    row "${out#ROW }"
}

corpus_of() {  # a text corpus holding at least $1 + 1 bytes
    local data="$work/corpus-$1.txt"
    [ -s "$data" ] && [ "$(stat -c %s "$data")" -gt "$1" ] && { echo "$data"; return; }
    : > "$data"
    while [ "$(stat -c %s "$data")" -le "$1" ]; do cat assets/corpus.txt >> "$data"; done
    echo "$data"
}

if [[ " $parts " == *" ab "* ]]; then
    for seq in 32768 131072; do
        runs=${AB_RUNS:-2}
        [ "$seq" -gt 32768 ] && runs=${AB_RUNS_LONG:-1}
        data=$(corpus_of "$seq")
        flags=(train --device cuda --model llama3.2-1b --data "$data" --seq "$seq"
               --steps "${AB_STEPS:-3}" --warmup 1 --attn upipe --ulysses 1 --ring 1)
        [ "$seq" -gt 32768 ] && flags+=(--checkpoint)
        for i in $(seq "$runs"); do
            for b in upipe-old upipe; do
                [ -x "$bin/$b" ] || continue
                run_row "ab $b seq $seq run $i" "$work/ab-$b-$seq-$i.log" "$bin/$b" "${flags[@]}"
            done
        done
    done
fi

if [[ " $parts " == *" window "* ]]; then
    seq=${WIN_SEQ:-131072}
    data=$(corpus_of "$seq")
    for w in "${WINDOW:-4096}" none; do
        dir="$work/mistral-1b-$w"
        mkdir -p "$dir"
        sw=$([ "$w" = none ] && echo null || echo "$w")
        cat > "$dir/config.json" <<JSON
{"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 128256,
 "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
 "sliding_window": $sw, "tie_word_embeddings": true, "hidden_act": "silu",
 "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
JSON
        kernels=(auto)
        [ "$w" = none ] || kernels=(auto native)
        for k in "${kernels[@]}"; do
            run_row "window $w seq $seq attn-kernel $k" "$work/window-$w-$k.log" "$bin/upipe" \
                train --device cuda --model "$dir" --data "$data" --seq "$seq" --steps 3 \
                --warmup 1 --attn upipe --ulysses 1 --ring 1 --checkpoint --attn-kernel "$k"
            grep -m1 -oE '"attention_kernel":"[^"]*"' "$work/window-$w-$k.log" | sed 's/^/  /'
        done
    done
fi

if [[ " $parts " == *" big "* ]]; then
    t0=$(date +%s)
    budget=${BUDGET:-480}
    big=(--steps "${BIG_STEPS:-2}" --warmup 1 --attn upipe --ulysses 1 --ring 1 --checkpoint
         --tiled-mlp --offload-optimizer auto --offload auto)
    for w in ${BIG_WINDOWS:-4096 none}; do
        dir="$work/mistral-7b-$w"
        mkdir -p "$dir"
        python3 - "$dir" "$w" <<'PY'
import json, sys
cfg = json.load(open("src/model/families/presets/mistral-7b-v0.1.json"))
cfg["sliding_window"] = None if sys.argv[2] == "none" else int(sys.argv[2])
json.dump(cfg, open(sys.argv[1] + "/config.json", "w"))
PY
        seq=${BIG_SEQ:-131072}
        left=$(( budget - ($(date +%s) - t0) ))
        [ "$left" -gt 60 ] || { row "big mistral-7b window $w: skipped (time)"; continue; }
        run_row "big mistral-7b window $w seq $seq" "$work/big-$w.log" timeout "$left" \
            "$bin/upipe" train --device cuda --model "$dir" --data "$(corpus_of "$seq")" --seq "$seq" "${big[@]}"
    done
    seq=${QWEN_SEQ:-65536}
    left=$(( budget - ($(date +%s) - t0) ))
    if [ "$seq" = 0 ]; then
        :
    elif [ "$left" -gt 60 ]; then
        run_row "big qwen2.5-7b seq $seq" "$work/big-qwen.log" timeout "$left" \
            "$bin/upipe" train --device cuda --model qwen2.5-7b-instruct --data "$(corpus_of "$seq")" \
            --seq "$seq" "${big[@]}"
    else
        row "big qwen2.5-7b: skipped (time)"
    fi
fi

if [[ " $parts " == *" bias "* ]]; then
    # what q/k/v biases cost as separate adds: the upper bound of what a GEMM
    # epilogue could save (Qwen2.5-1.5B, 32K, the last step's trace)
    seq=${BIAS_SEQ:-32768}
    "$bin/upipe" train --device cuda --model qwen2.5-1.5b-instruct --data "$(corpus_of "$seq")" \
        --seq "$seq" --steps 3 --warmup 1 --attn upipe --ulysses 1 --ring 1 \
        --trace "$work/bias-trace.json" > "$work/bias.log" 2>&1 || { tail -5 "$work/bias.log"; status=1; }
    out=$(python3 - "$work/bias-trace.json" <<'PY'
import json, sys
ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e.get("ph") == "X"]
compute = [e for e in ev if e.get("tid") == min(x["tid"] for x in ev)]
wall = (max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)) / 1e3
ms = lambda name: sum(e["dur"] for e in ev if e["name"] == name) / 1e3
n = lambda name: sum(1 for e in ev if e["name"] == name)
add, grad = ms("add_bias_rows"), ms("bias_grad")
print("bias qwen2.5-1.5b: step %.1f ms; add_bias_rows %.2f ms (%d), bias_grad %.2f ms (%d): %.2f%% of the step"
      % (wall, add, n("add_bias_rows"), grad, n("bias_grad"), 100 * (add + grad) / wall))
PY
)
    row "$out"
fi

if [[ " $parts " == *" gemma "* ]]; then
    for seq in ${GEMMA_SEQS:-32768 131072}; do
        flags=(train --device cuda --model gemma3-4b --data "$(corpus_of "$seq")" --seq "$seq"
               --steps 3 --warmup 1 --attn upipe --ulysses 1 --ring 1)
        [ "$seq" -gt 32768 ] && flags+=(--checkpoint)
        for k in ${GEMMA_KERNELS:-auto native}; do
            run_row "gemma3-4b seq $seq attn-kernel $k" "$work/gemma-$seq-$k.log" "$bin/upipe" \
                "${flags[@]}" --attn-kernel "$k"
        done
    done
fi

if [[ " $parts " == *" gemma-peer "* ]]; then
    seq=${GEMMA_PEER_SEQ:-32768}
    for policy in "" --checkpoint; do
        python3 "$here/hf_peer_step.py" --model gemma3-4b --seq "$seq" --steps 3 --liger $policy \
            > "$work/gemma-peer$policy.log" 2>&1
        row "hf+liger gemma3-4b seq $seq ${policy:-no checkpoint}: $(grep -E '^\{' "$work/gemma-peer$policy.log" | tail -1 | python3 -c 'import json,sys; d=json.loads(sys.stdin.read() or "{}"); print("%s tok/s, peak %s GiB" % (d.get("tokens_per_s"), round(d.get("peak_bytes", 0) / 2**30, 2)) if d else "no result")' 2>/dev/null || tail -2 "$work/gemma-peer$policy.log")"
    done
fi

echo
echo "== summary"
printf '%s\n' "${table[@]}"
exit $status
