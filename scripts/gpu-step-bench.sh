#!/usr/bin/env bash
# What checkpointing's recompute costs one GPU, and what the options that cut
# it buy: the Llama 3.2 1B architecture (random init) trained on one GPU (one
# process, UPipe with Pu 1 and Pr 1) at 32K, 128K and 256K tokens under
#
#   ckpt        --checkpoint --save-attention none   (every block's attention forward runs again)
#   ckpt+save   --checkpoint --save-attention auto   (the blocks that fit keep O and the LSEs)
#   ckpt+tiled  --checkpoint --tiled-mlp --save-attention none
#   (and, with CONFIGS="... ckpt+tiled+save", --checkpoint --tiled-mlp --save-attention auto)
#
# a few steps each, then a table of tokens/s (median over the steps after the
# first, which compiles kernels), rank 0's ledger peak and the planner's
# prediction (both from `--json`), and each option's speed against `ckpt`.
#
#   scripts/gpu-check.sh build DIR           # on a machine with Rust: binaries into DIR
#   cp scripts/gpu-step-bench.sh DIR/
#   bash DIR/gpu-step-bench.sh               # on the GPU machine, in the repo root
#   (SEQS="32768 131072 262144", STEPS=2, MODEL=llama3.2-1b, BUDGET=580 seconds,
#    CONFIGS="ckpt ckpt+save ckpt+tiled", UPIPE=path of the binary, default DIR/bin/upipe;
#    at 256K one step takes about a minute: SEQS=262144 alone fits one 10-minute slot)
#   DRY=1 scripts/gpu-step-bench.sh          # anywhere: the same commands on the CPU
#                                            # (--device cpu --model tiny, short lengths)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
upipe="${UPIPE:-$here/bin/upipe}"
[ -x "$upipe" ] || upipe="$here/../target/release/upipe"
if [ "${DRY:-0}" = 1 ]; then
    device=(--device cpu)
    model="${MODEL:-tiny}"
    seqs="${SEQS:-256 512}"
    unit=1e6 uname=MB
else
    device=(--device cuda)
    model="${MODEL:-llama3.2-1b}"
    seqs="${SEQS:-32768 131072 262144}"
    unit=1e9 uname=GB
    export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
    export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
    { date -u; nvidia-smi -L; } 2>&1
fi
steps="${STEPS:-2}"
budget="${BUDGET:-580}"
logs="${OUT:-/tmp}/step-bench"
mkdir -p "$logs"
T0=$(date +%s)

read -r -a configs <<< "${CONFIGS:-ckpt ckpt+save ckpt+tiled}"
flags_of() {
    case "$1" in
        ckpt) echo "--checkpoint --save-attention none" ;;
        ckpt+save) echo "--checkpoint --save-attention auto" ;;
        ckpt+tiled) echo "--checkpoint --tiled-mlp --save-attention none" ;;
        ckpt+tiled+save) echo "--checkpoint --tiled-mlp --save-attention auto" ;;
        *) echo "unknown config $1 (ckpt, ckpt+save, ckpt+tiled, ckpt+tiled+save)" >&2; exit 2 ;;
    esac
}
for c in "${configs[@]}"; do flags_of "$c" > /dev/null || exit 2; done

# the corpus, repeated until it holds the longest sequence and its next token
longest=0
for s in $seqs; do [ "$s" -gt "$longest" ] && longest=$s; done
corpus=assets/corpus.txt
[ -f "$corpus" ] || corpus="$here/../assets/corpus.txt"
data="$logs/corpus.txt"
: > "$data"
while [ "$(stat -c %s "$data")" -le "$longest" ]; do cat "$corpus" >> "$data"; done

# the value of "key" in a flat JSON line
field() { grep -o "\"$1\":[-0-9.eE+]*" | head -1 | cut -d: -f2; }

declare -A rate peak pred saved
for seq in $seqs; do
    for c in "${configs[@]}"; do
        left=$(( budget - ($(date +%s) - T0) ))
        if [ "$left" -lt 20 ]; then echo "SKIP seq $seq $c (time)"; continue; fi
        log="$logs/$c-$seq.log"
        read -r -a flags <<< "$(flags_of "$c")"
        cmd=("$upipe" train "${device[@]}" --model "$model" --data "$data" --seq "$seq"
             --steps "$steps" --warmup 1 --attn upipe --ulysses 1 --ring 1 "${flags[@]}" --json)
        echo "## ${cmd[*]}"
        s0=$(date +%s)
        timeout -k 5 "$left" "${cmd[@]}" > "$log" 2>&1
        rc=$?
        echo "   rc=$rc $(( $(date +%s) - s0 ))s"
        if [ "$rc" -ne 0 ]; then
            grep -a -iE "error|panick|out of memory" "$log" | head -4 | cut -c1-300
            continue
        fi
        lines="$(grep -a '^{' "$log")"
        later="$(echo "$lines" | tail -n +2)"
        [ -z "$later" ] && later="$lines"
        rate[$c,$seq]="$(echo "$later" | while read -r l; do echo "$l" | field tokens_per_s; done |
            sort -g | awk '{v[NR] = $1} END {printf "%.0f", v[int((NR + 1) / 2)]}')"
        peak[$c,$seq]="$(echo "$lines" | tail -1 | field peak_bytes)"
        pred[$c,$seq]="$(echo "$lines" | tail -1 | field predicted_peak_bytes)"
        saved[$c,$seq]="$(grep -a -o 'the last [0-9]* of [0-9]* blocks' "$log" | awk '{print $3 "/" $5}')"
    done
done

echo
echo "model $model, $steps steps per run, tok/s = median of steps 2..$steps (step 1 if only one)"
printf '%-8s %-15s %7s %10s %12s %12s %9s\n' seq config saved "tok/s" "peak $uname" "planned $uname" "vs ckpt"
for seq in $seqs; do
    for c in "${configs[@]}"; do
        r="${rate[$c,$seq]:-}"
        [ -z "$r" ] && { printf '%-8s %-15s %7s\n' "$seq" "$c" "failed"; continue; }
        base="${rate[ckpt,$seq]:-}"
        vs="-"
        [ -n "$base" ] && [ "$base" != 0 ] && vs="$(awk -v a="$r" -v b="$base" 'BEGIN {printf "%.3fx", a / b}')"
        printf '%-8s %-15s %7s %10s %12s %12s %9s\n' "$seq" "$c" "${saved[$c,$seq]:--}" "$r" \
            "$(awk -v b="${peak[$c,$seq]}" -v u="$unit" 'BEGIN {printf "%.2f", b / u}')" \
            "$(awk -v b="${pred[$c,$seq]}" -v u="$unit" 'BEGIN {printf "%.2f", b / u}')" "$vs"
    done
done
echo "total $(( $(date +%s) - T0 ))s; logs in $logs"
