#!/usr/bin/env bash
# GPU check for the CUDA backend, in two steps on two machines:
#
#   scripts/gpu-check.sh build DIR   # on a machine with Rust: builds the GPU test
#                                    # modules, the benchmark and `upipe`, copies them
#                                    # (stripped) and this script into DIR
#   bash DIR/gpu-check.sh [run]      # on the GPU machine (no Rust needed): runs every
#                                    # GPU test module, `upipe info` and the benchmark,
#                                    # then prints a short table
#
set -u
mode="${1:-run}"

if [ "$mode" = build ]; then
    dest="${2:?usage: gpu-check.sh build DIR}"
    set -e
    mkdir -p "$dest/bin"
    rm -f "$dest"/bin/*
    # the GPU test modules, each as DIR/bin/test-MODULE (bundle.sh), and `upipe`
    bash "$(dirname "$0")/bundle.sh" "$dest" $(cd "$(dirname "$0")/../tests/integration" && ls gpu_*.rs | sed 's/\.rs$//')
    cargo build --release --examples --bins
    cp target/release/examples/gpu_bench "$dest/bin/gpu_bench"
    cp target/release/examples/flash_check "$dest/bin/flash_check"
    cp target/release/examples/cudnn_check "$dest/bin/cudnn_check"
    cp target/release/upipe "$dest/bin/upipe"
    strip "$dest"/bin/* || true
    cp "$0" "$dest/gpu-check.sh"
    du -sh "$dest"
    exit 0
fi

here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
out="${OUT:-/tmp}"
export NCCL_NVLS_ENABLE=0
export UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
rm -rf "$UPIPE_KERNEL_CACHE"   # first test compiles, later ones must hit the cache
echo "== upipe info"
"$bin/upipe" info 2>&1 | tee "$out/info.txt"
declare -a table
status=0
for t in "$bin"/test-gpu_*; do
    name="$(basename "$t")"
    log="$out/$name.log"
    start=$(date +%s%N)
    "$t" --test-threads=4 --nocapture > "$log" 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    res="$(grep -E '^test result:' "$log" | tail -1 | sed 's/test result: //; s/; finished.*//')"
    skipped="$(grep -c 'SKIP' "$log")"
    [ "$rc" -ne 0 ] && status=1
    table+=("$(printf '%-40s rc=%-3s %7sms  %s%s' "$name" "$rc" "$ms" "$res" "$([ "$skipped" -gt 0 ] && echo '  (SKIPPED: no GPU)')")")
    if [ "$rc" -ne 0 ] || [ "$name" = test-gpu_backend ]; then
        echo "== $name"
        grep -E 'rel err|panicked|FAILED|failed|SKIP|sum_squares|pool ' "$log" | sort | head -200
    fi
done
echo "== gpu_bench"
start=$(date +%s%N)
"$bin/gpu_bench" 2>&1 | tee "$out/bench.txt"
brc=${PIPESTATUS[0]}
[ "$brc" -ne 0 ] && status=1
table+=("$(printf '%-40s rc=%-3s %7sms  %s' gpu_bench "$brc" "$(( ($(date +%s%N) - start) / 1000000 ))" "$(grep -E '^gemm bf16 [0-9]+x.*\(NN\)' "$out/bench.txt" | awk '{print $NF " TFLOP/s (8192^3 bf16)"}')")")
echo
echo "== summary"
for row in "${table[@]}"; do echo "$row"; done
exit $status
