#!/usr/bin/env bash
# One H200: documents (packed windows) on the GPU, and the interop checks
# against transformers and TensorBoard.
#
#   scripts/gpu-documents.sh build DIR   # on a machine with Rust: `upipe` and the
#                                        # GPU test binaries into DIR/bin
#   bash DIR/gpu-documents.sh [PARTS]    # on the GPU machine, from the repository root
#
# PARTS (default "tests interop docs"):
#   tests   = gpu_backend (flash/naive documents masks against the CPU) and gpu_plan
#   interop = scripts/check_hf_roundtrip.py, check_tensorboard.py on a short run
#   docs    = Llama 3.2 1B at DOC_SEQ (131072) with --checkpoint on a document mix
#             (scripts/doc_mix.py: long-tailed lengths, mean about 8K, a few over
#             32K): --pack documents against --pack stream on the same tokens, and
#             the HF + PyTorch peer given the same packed position_ids
set -u
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-documents.sh build DIR}"
    set -e
    bash "$(dirname "$0")/bundle.sh" "$dest" gpu_backend gpu_plan
    cp "$0" "$dest/"
    du -sh "$dest"
    exit 0
fi
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
parts="${1:-tests interop docs}"
work=/tmp/upipe-docs
mkdir -p "$work"
declare -a table
row() { table+=("$1"); echo "ROW $1"; }
status=0
{ date -u; nvidia-smi -L; } 2>&1

if [[ " $parts " == *" tests "* ]]; then
    for t in gpu_backend gpu_plan; do
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
    python3 scripts/check_hf_roundtrip.py --upipe "$bin/upipe" 2>&1 | tail -30 | sed 's/^/  /'
    row "hf roundtrip: exit ${PIPESTATUS[0]}"
    ( cd "$work" && rm -rf tb && "$bin/upipe" train --steps 12 --metrics m.jsonl --tensorboard tb \
        --eval-data "$OLDPWD/assets/corpus.txt" --eval-every 4 > tb.log 2>&1 \
      || "$bin/upipe" train --steps 12 --metrics m.jsonl --tensorboard tb > tb.log 2>&1 )
    python3 scripts/check_tensorboard.py "$work/tb" "$work/m.jsonl" 2>&1 | tail -40 | sed 's/^/  /'
    row "tensorboard: exit ${PIPESTATUS[0]}"
fi

if [[ " $parts " == *" docs "* ]]; then
    seq=${DOC_SEQ:-131072}
    python3 scripts/doc_mix.py --out "$work/mix.jsonl" --tokens $((seq * 4))
    "$bin/upipe" tokenize "$work/mix.jsonl" --tokenizer byte --eos 0 --out "$work/mix.u32" > "$work/tok.log" 2>&1 \
        || { cat "$work/tok.log"; status=1; }
    for pack in documents stream; do
        log="$work/train-$pack.log"
        "$bin/upipe" train --model llama3.2-1b --seq "$seq" --steps 3 --checkpoint --lr 1e-4 \
            --data "$work/mix.u32" --pack "$pack" --json > "$log" 2>&1 || { tail -5 "$log"; status=1; }
        python3 - "$log" "$pack" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
steps = [l for l in lines if "step" in l and "tokens_per_s" in l]
if steps:
    s = steps[-1]
    keys = ["tokens_per_s", "tflops", "counted_tokens", "attn_flop_fraction", "peak_bytes", "predicted_peak_bytes"]
    print("ROW docs pack=%s step %s: %s" % (sys.argv[2], s["step"], " ".join(f"{k}={s.get(k)}" for k in keys)))
else:
    print("ROW docs pack=%s: no step line" % sys.argv[2])
PY
    done
    timeout "${PEER_TIMEOUT:-240}" python3 scripts/hf_peer_step.py --seq "$seq" --steps 2 --checkpoint \
        --doc-lengths "$work/mix.jsonl.lengths" > "$work/peer.log" 2>&1 || tail -5 "$work/peer.log"
    row "hf peer packed: $(tail -1 "$work/peer.log")"
    timeout "${PEER_TIMEOUT:-240}" python3 scripts/hf_peer_step.py --seq "$seq" --steps 2 --checkpoint > "$work/peer-stream.log" 2>&1 \
        || tail -5 "$work/peer-stream.log"
    row "hf peer unpacked: $(tail -1 "$work/peer-stream.log")"
fi

echo
echo "== summary"
printf '%s\n' "${table[@]}"
exit $status
