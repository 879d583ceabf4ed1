#!/usr/bin/env bash
# The planner plans the cuDNN a run loads, checked on one GPU with the
# system cuDNN (9.14 on our machine) and torch's pip cuDNN (9.19):
#
#   scripts/gpu-cudnn-plan.sh build DIR   # on a machine with Rust: upipe and test-gpu_backend, test-gpu_plan into DIR/bin
#   bash DIR/gpu-cudnn-plan.sh            # on the GPU machine (UPIPE=path/to/upipe to use another binary)
#
# For each cuDNN: `upipe plan` (its header names the cuDNN loaded, JSON
# `cudnn_version`), and `upipe train` of Llama 3.2 1B at SEQ (8000: keys
# not a multiple of 128, whose backward 9.14 leaves to the flash kernels
# and 9.19 takes) on one GPU, its kernel, measured peak and the planner's
# peak (ROW lines). Then `upipe plan --cudnn-version 9.14` against `9.19`
# at that length, and the GPU tests of the cuDNN window and documents cases
# and of the planner, when their binaries are there.
set -u
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-cudnn-plan.sh build DIR}"
    set -e
    bash "$(dirname "$0")/bundle.sh" "$dest" gpu_backend gpu_plan
    cp "$0" "$dest/"
    exit 0
fi
here="$(cd "$(dirname "$0")" && pwd)"
upipe="${UPIPE:-$here/bin/upipe}"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
pip_cudnn=${PIP_CUDNN:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib}
seq=${SEQ:-8000}
work=$(mktemp -d)
at=(--model llama3.2-1b --seq "$seq")
row() { # name log: the last step's kernel, peak and planned peak
    python3 - "$1" "$2" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")]
steps = [l for l in lines if "tokens_per_s" in l]
if not steps:
    print("ROW %s: no step (see the log above)" % sys.argv[1])
    sys.exit()
s = steps[-1]
peak, planned = s.get("peak_bytes"), s.get("predicted_peak_bytes")
keys = ["attention_kernel", "tokens_per_s", "peak_bytes", "predicted_peak_bytes"]
print("ROW %s: %s equal=%s" % (sys.argv[1], " ".join(f"{k}={s.get(k)}" for k in keys), peak == planned))
PY
}
both() { # name, then the environment of that cuDNN
    local name=$1; shift
    echo "== $name"
    env "$@" "$upipe" plan "${at[@]}" --gpus 1 --gpu-mem 139 --attn local 2>&1 | head -3
    env "$@" "$upipe" train "${at[@]}" --steps 2 --json > "$work/$name.log" 2>&1
    echo "train exit $?"
    grep -E "WARN|ERROR|error" "$work/$name.log" | head -4
    row "$name" "$work/$name.log"
}
both system-cudnn
if [ -e "$pip_cudnn/libcudnn.so.9" ]; then
    # cudarc binds `libcudnn.so` by name: a link to the pip file goes first
    mkdir -p /tmp/cudnn-plan-link && ln -sf "$pip_cudnn/libcudnn.so.9" /tmp/cudnn-plan-link/libcudnn.so
    both pip-cudnn UPIPE_CUDNN_LIB="$pip_cudnn/libcudnn.so.9" \
        LD_LIBRARY_PATH="/tmp/cudnn-plan-link:$pip_cudnn:$LD_LIBRARY_PATH"
else
    echo "SKIP pip cuDNN: no $pip_cudnn/libcudnn.so.9 (PIP_CUDNN names its folder)"
fi
echo "== plan --cudnn-version"
for v in 9.14 9.19; do
    "$upipe" plan "${at[@]}" --gpus 1 --gpu-mem 139 --attn local --cudnn-version "$v" --json |
        python3 -c 'import json,sys; [print("PLAN", l["cudnn_version"], l["peak_bytes"]) for l in map(json.loads, sys.stdin) if "peak_bytes" in l]'
done
for t in gpu_backend gpu_plan; do
    [ -x "$here/bin/test-$t" ] || continue
    echo "== test-$t"
    filter=$([ "$t" = gpu_backend ] && echo cudnn || echo "")
    "$here/bin/test-$t" --test-threads 1 $filter 2>&1 | grep -E "test |panicked|FAILED|test result|SKIP" | tail -30
done
rm -rf "$work"
