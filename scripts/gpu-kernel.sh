#!/usr/bin/env bash
# The attention kernel a run decides before it plans, checked on one GPU:
#
#   scripts/gpu-kernel.sh build DIR   # on a machine with Rust: test-gpu_backend and upipe into DIR/bin
#   bash DIR/gpu-kernel.sh            # on the GPU machine, from the repository root
#
# tests: gpu_backend's kept documents-mask bounds, documents masks and cuDNN cases
# (documents on cuDNN's ragged path against the CPU and the flash kernels, and the
# timing table of documents on cuDNN against flash: 128K tokens, mean 8K);
# runs: Llama 3.2 1B at SEQ (32768), STEPS (3) steps, on a document mix: `auto` with
# cuDNN, `auto` with an unloadable UPIPE_CUDNN_LIB (a warning, the flash kernels),
# `--attn-kernel cudnn` with it (an error before anything is allocated), and
# `--pack documents` on cuDNN (`auto`) and on the flash kernels (`native`); each
# run's kernel, tokens/s, peak and the planner's peak.
set -u
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-kernel.sh build DIR}"
    set -e
    bash "$(dirname "$0")/bundle.sh" "$dest" gpu_backend
    cp "$0" scripts/doc_mix.py "$dest/"
    exit 0
fi
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
work=$(mktemp -d)
seq=${SEQ:-32768}
steps=${STEPS:-3}
"$bin/upipe" info 2>&1 | grep -iE "cudnn|attention" | head -4
echo "== tests"
"$bin/test-gpu_backend" --test-threads 1 --nocapture documents_mask_bounds flash_documents cudnn 2>&1 \
    | grep -E "^\||ragged plan|documents timing|test |panicked|FAILED|test result" | tail -60
echo "== runs (seq $seq)"
python3 "$here/doc_mix.py" --out "$work/mix.jsonl" --tokens $((seq * 4)) > /dev/null
"$bin/upipe" tokenize "$work/mix.jsonl" --tokenizer byte --eos 0 --out "$work/mix.u32" > "$work/tok.log" 2>&1 \
    || cat "$work/tok.log"
one() {
    local name="$1"; shift
    local log="$work/$name.log"
    "$@" --model llama3.2-1b --seq "$seq" --steps "$steps" --data "$work/mix.u32" --json > "$log" 2>&1
    echo "-- $name: exit $?"
    grep -E "WARN|ERROR|error|attention on" "$log" | head -4
    python3 - "$log" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
steps = [l for l in lines if "tokens_per_s" in l]
if steps:
    s = steps[-1]
    keys = ["attention_kernel", "tokens_per_s", "peak_bytes", "predicted_peak_bytes"]
    print("ROW step %s: %s" % (s["step"], " ".join(f"{k}={s.get(k)}" for k in keys)))
PY
}
bad=/nonexistent/libcudnn.so.9
one auto-stream "$bin/upipe" train --pack stream
UPIPE_CUDNN_LIB=$bad one auto-no-cudnn "$bin/upipe" train --pack stream
UPIPE_CUDNN_LIB=$bad one cudnn-no-cudnn "$bin/upipe" train --pack stream --attn-kernel cudnn
one auto-documents "$bin/upipe" train --pack documents
one native-documents "$bin/upipe" train --pack documents --attn-kernel native
one native-stream "$bin/upipe" train --pack stream --attn-kernel native
