#!/usr/bin/env bash
# Check of the wgmma (sm_90a) flash backward on one H100/H200, in two steps:
#
#   scripts/wgmma-bwd-check.sh build DIR   # on a machine with Rust: builds
#                                          # flash_check and the gpu_backend /
#                                          # gpu_layer test binaries, copies them
#                                          # (stripped) and this script into DIR
#   bash DIR/wgmma-bwd-check.sh [run]      # on the GPU machine (no Rust needed)
#
# With the device tool: build into /work/main/.carry-<name>/ and run
#   LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH \
#     bash .carry-<name>/wgmma-bwd-check.sh
# with carry [".carry-<name>"]; logs land in $OUT.
#
# The run: `flash_check check bench` with UPIPE_FLASH_BWD=wgmma (every check
# case through the mma.sync and the wgmma backward against the CPU oracle, the
# bench rows for both), then tests/gpu_backend.rs and tests/gpu_layer.rs with
# UPIPE_ATTN_KERNEL=native UPIPE_FLASH_BWD=wgmma (the backend's attention
# backward on the wgmma kernel), then a short table. FLASH_DEFINES (see
# examples/flash_check.rs) passes compile-time knobs, e.g. "WB_STAGES=3".
set -u
mode="${1:-run}"

if [ "$mode" = build ]; then
    dest="${2:?usage: wgmma-bwd-check.sh build DIR}"
    set -e
    mkdir -p "$dest/bin"
    rm -f "$dest"/bin/*
    cargo test --release --no-run --message-format=json --test gpu_backend --test gpu_layer 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["target"]["name"] + "\t" + m["executable"])
' > "$dest/tests.tsv"
    while IFS=$'\t' read -r name exe; do
        cp "$exe" "$dest/bin/test-$name"
    done < "$dest/tests.tsv"
    cargo build --release --example flash_check
    cp target/release/examples/flash_check "$dest/bin/flash_check"
    strip "$dest"/bin/* || true
    cp "$0" "$dest/wgmma-bwd-check.sh"
    du -sh "$dest"
    exit 0
fi

here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
out="${OUT:-/tmp}"
export NCCL_NVLS_ENABLE=0
export UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels-wgmma-bwd}"
rm -rf "$UPIPE_KERNEL_CACHE"
declare -a table
status=0

echo "== flash_check check bench (UPIPE_FLASH_BWD=wgmma)"
start=$(date +%s%N)
UPIPE_FLASH_BWD=wgmma timeout 420 "$bin/flash_check" check bench 2>&1 | tee "$out/flash_check.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && status=1
ms=$(( ($(date +%s%N) - start) / 1000000 ))
pass="$(grep -E '^correctness:' "$out/flash_check.txt" | tail -1)"
wg_ok="$(grep -cE '\| wgmma \| [0-9.e+-]+ \|.*\| yes \|$' "$out/flash_check.txt")"
wg_bad="$(grep -cE '\| wgmma \| [0-9.e+-]+ \|.*\| NO \|$' "$out/flash_check.txt")"
table+=("$(printf '%-28s rc=%-3s %7sms  %s; wgmma-bwd rows ok=%s bad=%s' flash_check "$rc" "$ms" "$pass" "$wg_ok" "$wg_bad")")
while read -r line; do
    table+=("  $line")
done < <(grep -E '^\| (mma|wgmma) \| (mma|wgmma) \| [0-9]+ ' "$out/flash_check.txt" |
    awk -F'|' '{printf "fwd %-5s bwd %-5s S=%-6s H=%-3s Hkv=%-3s bwd %6s TF/s  fwd+bwd %6s TF/s\n", $2, $3, $4, $5, $6, $11, $12}')

for t in "$bin"/test-*; do
    name="$(basename "$t")"
    log="$out/$name.log"
    start=$(date +%s%N)
    UPIPE_ATTN_KERNEL=native UPIPE_FLASH_BWD=wgmma timeout 300 "$t" --test-threads=2 --nocapture > "$log" 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    res="$(grep -E '^test result:' "$log" | tail -1 | sed 's/test result: //; s/; finished.*//')"
    [ "$rc" -ne 0 ] && status=1
    table+=("$(printf '%-28s rc=%-3s %7sms  %s (native attention, UPIPE_FLASH_BWD=wgmma)' "$name" "$rc" "$ms" "$res")")
    if [ "$rc" -ne 0 ]; then
        echo "== $name"
        grep -E 'rel err|panicked|FAILED|failed|SKIP|wgmma' "$log" | head -100
    fi
done

echo
echo "== summary"
for row in "${table[@]}"; do echo "$row"; done
exit $status
