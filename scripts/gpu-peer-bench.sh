#!/usr/bin/env bash
# upipe against the peers long-context users run, on one GPU, in one call:
# HF transformers + Liger Kernel (its RMSNorm, SwiGLU, RoPE and fused linear
# cross-entropy) and plain HF transformers + PyTorch, both through
# scripts/hf_peer_step.py: the same model (random init), the same length, the
# same step (one sequence, bf16 parameters, AdamW).
#
#   Llama 3.2 1B at each length of SEQS, the runs alternating:
#     upipe      its default policy: `upipe train` as is below LONG tokens,
#                `--checkpoint` from LONG on
#     hf+liger   no checkpointing and checkpointing below LONG, checkpointing from LONG on
#     hf         the same
#   BIG=1: Llama3-8B at SEQ8B tokens, upipe with part of the optimizer on the host
#     (UPipe `--ulysses 1 --ring 1`, `--checkpoint --tiled-mlp --offload auto
#     --offload-optimizer auto --lr 1e-5`) against hf+liger and hf with checkpointing
#
# Each run's tokens/s is the median of its steps 2..STEPS (step 1 compiles and
# allocates). The table gives, per length, upipe's tokens/s and its ledger
# peak against the planner's (both from `--json`), each peer's fastest
# configuration, and upipe's ratio to each; then one JSON line per row. A
# peer configuration that runs out of memory shows as "oom".
#
#   bash scripts/gpu-peer-bench.sh build DIR   # on a machine with Rust, from the repository root:
#                                              # `upipe` (scripts/bundle.sh, which replaces DIR/bin and
#                                              # copies the liger_kernel wheel from WHEELS, default
#                                              # /tmp/wheels, into DIR/wheels), this script and
#                                              # hf_peer_step.py into DIR
#   bash DIR/gpu-peer-bench.sh                 # on the GPU machine, from the repository root
#   DRY=1 bash scripts/gpu-peer-bench.sh       # anywhere: upipe's side on the CPU (tiny model,
#                                              # short lengths), the Python peers skipped
#
# VARIANTS: more upipe configurations in every row, alternating with the others, each
# NAME=BINARY (a path, e.g. an older build for an A/B row), NAME=pip-cudnn or NAME=pip-cublas
# (this build with torch's pip cuDNN or cuBLASLt, linked as docs/cuda-backend.md shows), or
# NAME=env:K=V,K2=V2 (this build with those environment variables, e.g.
# tune=env:UPIPE_CUDNN_PLAN=fastest) or NAME=flags:F1,F2 (this build with more flags, e.g.
# fp8=flags:--precision,fp8); they run as upipe-NAME.
# PEERS ("liger hf": which peers run; "none": upipe alone), SHORT_POLICIES ("none ckpt": the peers' policies
# below LONG), SEQS ("32768 131072 262144"; empty: none), LONG (131072), STEPS (4 below LONG, 2 from LONG
# on), ROUNDS (1: every configuration once; a second round runs them in reverse order),
# BIG (0), MODEL8B (llama3-8b; or qwen2.5-7b-instruct, gemma3-4b), SEQ8B (65536), STEPS8B (3), UPFLAGS8B (upipe's flags in the 8B row: the ones
# above, or e.g. compact optimizer state on the device: `--optim-state 8bit
# --master-weights none --offload-optimizer 0` with the same policy), BUDGET (570 seconds for the whole call: a run that
# would start with less than 20 s left is skipped), UPIPE (DIR/bin/upipe), OUT (logs under
# $OUT/peer-bench). Liger Kernel is imported as installed, else installed from DIR/wheels
# (or WHEELS) with `pip install --no-deps --no-index --target` into a folder put on PYTHONPATH.
# The default 1B lengths take about 9 minutes; for one device call of at most 10, run
# SEQS="32768 131072", SEQS=262144 and SEQS= BIG=1 as three calls.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-peer-bench.sh build DIR}"
    set -e
    bash "$here/bundle.sh" "$dest"
    cp "$0" "$here/hf_peer_step.py" "$dest/"
    ls "$dest"/wheels/liger_kernel-*.whl 2> /dev/null ||
        echo "gpu-peer-bench.sh: no liger_kernel wheel in WHEELS (${WHEELS:-/tmp/wheels}): the hf+liger runs will need it installed" >&2
    du -sh "$dest"
    exit 0
fi
upipe="${UPIPE:-$here/bin/upipe}"
[ -x "$upipe" ] || upipe="$here/../gpu-bundle/bin/upipe"
[ -x "$upipe" ] || upipe="$here/../target/release/upipe"
peer="$here/hf_peer_step.py"
[ -f "$peer" ] || peer="$here/../scripts/hf_peer_step.py"
if [ "${DRY:-0}" = 1 ]; then
    # one rank, as upipe's default is on a machine with one GPU
    device=(--device cpu) mesh1b="--attn upipe --ulysses 1 --ring 1"
    model1b=tiny model8b=tiny
    seqs="${SEQS-256 512}" long="${LONG:-512}" seq8b="${SEQ8B:-256}"
    unit=1e6 uname=MB
else
    device=() mesh1b=""
    model1b=llama3.2-1b model8b="${MODEL8B:-llama3-8b}"
    seqs="${SEQS-32768 131072 262144}" long="${LONG:-131072}" seq8b="${SEQ8B:-65536}"
    unit=1e9 uname=GB
    export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
    export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
    { date -u; nvidia-smi -L; } 2>&1
fi
big="${BIG:-0}"
rounds="${ROUNDS:-1}"
budget="${BUDGET:-570}"
logs="${OUT:-/tmp}/peer-bench"
mkdir -p "$logs"
T0=$(date +%s)

# Liger Kernel for the hf+liger runs: as installed, else from the bundle's wheel
liger=1
liger_setup() {
    python3 -c "import liger_kernel.transformers" 2> /dev/null && return 0
    local whl site=/tmp/upipe-liger-site
    whl="$(ls "${WHEELS:-$here/wheels}"/liger_kernel-*.whl "$here"/wheels/liger_kernel-*.whl \
        "$here"/../gpu-bundle/wheels/liger_kernel-*.whl 2> /dev/null | head -1)"
    [ -n "$whl" ] || { echo "no liger_kernel wheel in $here/wheels (or WHEELS)"; return 1; }
    rm -rf "$site"
    # a pure-Python wheel: pip installs it, or unpacking it is the install
    python3 -m pip install --quiet --no-deps --no-index --target "$site" "$whl" ||
        python3 -m zipfile -e "$whl" "$site" || return 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    python3 -c "import liger_kernel.transformers" && echo "liger_kernel from $whl"
}
if [ "${DRY:-0}" = 1 ]; then
    echo "DRY: the Python peers (hf, hf+liger) are skipped"
elif ! liger_setup; then
    liger=0
    echo "Liger Kernel not available: the hf+liger runs are skipped"
fi

# torch's pip cuDNN for a pip-cudnn variant: "UPIPE_CUDNN_LIB=... LD_LIBRARY_PATH=..."
pip_cudnn_env() {
    local lib
    lib="$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' 2> /dev/null)"
    [ -n "$lib" ] && [ -f "$lib/libcudnn.so.9" ] || return 1
    mkdir -p /tmp/cudnn-link && ln -sf "$lib/libcudnn.so.9" /tmp/cudnn-link/libcudnn.so
    echo "UPIPE_CUDNN_LIB=$lib/libcudnn.so.9 LD_LIBRARY_PATH=/tmp/cudnn-link:$lib:${LD_LIBRARY_PATH:-}"
}
# the cuBLASLt torch loads, for a pip-cublas variant: "UPIPE_CUBLASLT_LIB=... LD_LIBRARY_PATH=..."
pip_cublas_env() {
    local so
    so="$(python3 -c '
import torch
a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
(a @ a).sum().item()
print(next(l.split()[-1] for l in open("/proc/self/maps") if "libcublasLt.so" in l))' 2> /dev/null)"
    [ -n "$so" ] && [ -f "$so" ] || return 1
    # cudarc binds the unversioned name first, which the wheel does not ship
    mkdir -p /tmp/cublas-link && ln -sf "$so" /tmp/cublas-link/libcublasLt.so
    echo "UPIPE_CUBLASLT_LIB=$so LD_LIBRARY_PATH=/tmp/cublas-link:$(dirname "$so"):${LD_LIBRARY_PATH:-}"
}
declare -A variant_bin variant_env variant_flags
variants=()
for v in ${VARIANTS:-}; do
    name="${v%%=*}" what="${v#*=}"
    if [ "$what" = pip-cudnn ]; then
        env_line="$(pip_cudnn_env)" || { echo "no pip cuDNN: variant $name skipped"; continue; }
        variant_bin[$name]="$upipe" variant_env[$name]="$env_line"
    elif [ "$what" = pip-cublas ]; then
        env_line="$(pip_cublas_env)" || { echo "no pip cuBLASLt: variant $name skipped"; continue; }
        variant_bin[$name]="$upipe" variant_env[$name]="$env_line"
    elif [[ "$what" == flags:* ]]; then
        variant_bin[$name]="$upipe" variant_env[$name]="" variant_flags[$name]="${what#flags:}"
        variant_flags[$name]="${variant_flags[$name]//,/ }"
    elif [[ "$what" == env:* ]]; then
        variant_bin[$name]="$upipe" variant_env[$name]="${what#env:}"
        variant_env[$name]="${variant_env[$name]//,/ }"
    else
        [ -x "$what" ] || what="$here/$what"
        [ -x "$what" ] || { echo "no binary for variant $v: skipped"; continue; }
        variant_bin[$name]="$what" variant_env[$name]=""
    fi
    variants+=("$name")
done

# the bundled corpus, repeated past $1 bytes
data="$logs/corpus.txt"
corpus() {
    local src=assets/corpus.txt
    [ -f "$src" ] || src="$here/../assets/corpus.txt"
    : > "$data"
    while [ "$(stat -c %s "$data")" -le "$1" ]; do cat "$src" >> "$data"; done
}
longest=$seq8b
for s in $seqs; do [ "$s" -gt "$longest" ] && longest=$s; done
corpus $((longest * 2 + 8192))

# "step tokens_per_s peak_bytes" of each JSON step line on stdin (upipe's and the peer's)
steps_of() {
    sed -n 's/.*"step":\([0-9]*\).*"tokens_per_s":\([-0-9.eE+]*\).*"peak_bytes":\([0-9]*\).*/\1 \2 \3/p'
}
# the median tokens/s of steps 2 on (step 1 when it is the only one) of steps_of's lines on stdin
median_rate() {
    awk '{ if ($1 >= 2) later[++n] = $2; else first = $2 }
         END { if (n == 0) { if (first != "") print first; exit } for (i = 1; i <= n; i++) print later[i] }' |
        sort -g | awk '{ v[NR] = $1 } END { if (NR) printf "%.0f\n", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
# the value of "key" in a flat JSON line
field() { grep -o "\"$1\":[-0-9.eE+]*" | head -1 | cut -d: -f2; }
gb() { awk -v b="$1" -v u="$unit" 'BEGIN { printf "%.2f", b / u }'; }

declare -A steps peak pred oom
# one run of configuration $2 of row $1 (steps in $logs/$1-$2-rROUND.log): upipe or a peer
run() {
    local row="$1" cfg="$2" round="$3"
    shift 3
    local left=$((budget - ($(date +%s) - T0)))
    if [ "$left" -lt 20 ]; then echo "SKIP $row $cfg round $round (time)"; return; fi
    local log="$logs/$row-$cfg-r$round.log" s0
    s0=$(date +%s)
    echo "## $row $cfg: $*"
    timeout -k 5 "$left" "$@" > "$log" 2>&1
    local rc=$?
    local lines
    lines="$(grep -a '^{' "$log" | steps_of)"
    echo "   rc=$rc $(($(date +%s) - s0))s, steps (step tok/s peak): $(echo "$lines" | tr '\n' ' ')"
    if grep -aq '"oom":true' "$log"; then
        oom[$row,$cfg]=1
        echo "   out of memory: $(grep -a '"oom":true' "$log" | field step | sed 's/^0$/building the model/; s/^[1-9]/step &/')"
    elif [ "$rc" -ne 0 ] || [ -z "$lines" ]; then
        grep -a -iE "error|panick|out of memory|Traceback" "$log" | tail -4 | cut -c1-300
    fi
    [ -z "$lines" ] && return
    steps[$row,$cfg]+="$lines"$'\n'
    peak[$row,$cfg]="$(echo "$lines" | tail -1 | cut -d' ' -f3)"
    if [[ "$cfg" == upipe* ]]; then
        pred[$row,$cfg]="$(grep -a '^{' "$log" | tail -1 | field predicted_peak_bytes)"
        echo "   last step by class (ms): $(grep -a '^{' "$log" | grep -a '"profile"' | tail -1 | profile_line)"
    fi
}

# the last step's time by op class, largest first, from upipe's --profile JSON line on stdin
profile_line() {
    python3 -c '
import json, sys
for line in sys.stdin:
    p = json.loads(line).get("profile") or {}
    wall = p.pop("wall_ms", 0)
    top = sorted(((v, k[:-3]) for k, v in p.items() if v >= 1), reverse=True)
    print(" ".join(f"{k} {v:,.0f}" for v, k in top) + f" (wall {wall:,.0f})")
' 2> /dev/null
}

# every configuration of one row, alternating upipe, hf+liger and hf; rows of a model and length
bench_row() {
    local row="$1" model="$2" seq="$3" nsteps="$4" upflags="$5" policies="$6" r0
    r0=$(date +%s)
    local order=(upipe) p v
    for v in "${variants[@]}"; do order+=("upipe-$v"); done
    for p in $policies; do
        for w in ${PEERS:-liger hf}; do order+=("$w-$p"); done
    done
    local round cfgs cfg
    for round in $(seq "$rounds"); do
        cfgs=("${order[@]}")
        [ $((round % 2)) = 0 ] && cfgs=($(printf '%s\n' "${order[@]}" | tac))
        for cfg in "${cfgs[@]}"; do
            case "$cfg" in
                upipe)
                    read -r -a f <<< "$upflags"
                    run "$row" upipe "$round" "$upipe" train "${device[@]}" --model "$model" \
                        --data "$data" --seq "$seq" --steps "$nsteps" --warmup 1 "${f[@]}" --profile --json ;;
                upipe-*)
                    read -r -a f <<< "$upflags"
                    v="${cfg#upipe-}"
                    # shellcheck disable=SC2086
                    run "$row" "$cfg" "$round" env ${variant_env[$v]} "${variant_bin[$v]}" train "${device[@]}" \
                        --model "$model" --data "$data" --seq "$seq" --steps "$nsteps" --warmup 1 "${f[@]}" \
                        ${variant_flags[$v]:-} --profile --json ;;
                *)
                    [ "${DRY:-0}" = 1 ] && continue
                    [[ "$cfg" == liger-* || "$cfg" == hf-* ]] || continue
                    [[ "$cfg" == liger-* ]] && [ "$liger" = 0 ] && continue
                    local extra=()
                    [[ "$cfg" == liger-* ]] && extra+=(--liger)
                    [[ "$cfg" == *-ckpt ]] && extra+=(--checkpoint)
                    run "$row" "$cfg" "$round" python3 "$peer" --model "$model" --seq "$seq" \
                        --steps "$nsteps" "${extra[@]}" ;;
            esac
        done
    done
    echo "part $row: $(($(date +%s) - r0)) s"
}

rows=()
for seq in $seqs; do
    row="1b-$seq"
    rows+=("$row")
    if [ "$seq" -lt "$long" ]; then
        bench_row "$row" "$model1b" "$seq" "${STEPS:-4}" "$mesh1b" "${SHORT_POLICIES:-none ckpt}"
    else
        bench_row "$row" "$model1b" "$seq" "${STEPS:-2}" "$mesh1b --checkpoint" "ckpt"
    fi
done
if [ "$big" = 1 ]; then
    row="8b-$seq8b"
    rows+=("$row")
    bench_row "$row" "$model8b" "$seq8b" "${STEPS8B:-3}" \
        "${UPFLAGS8B:---lr 1e-5 --attn upipe --ulysses 1 --ring 1 --checkpoint --tiled-mlp --offload auto --offload-optimizer auto}" \
        "ckpt"
fi

# the fastest configuration of peer $2 ("liger" or "hf") in row $1: "tok/s config peak"
best() {
    local row="$1" who="$2" cfg r bestr="" bestc="" bestp=""
    for cfg in "$who-none" "$who-ckpt"; do
        [ -n "${steps[$row,$cfg]:-}" ] || continue
        r="$(echo -n "${steps[$row,$cfg]}" | median_rate)"
        if [ -z "$bestr" ] || awk -v a="$r" -v b="$bestr" 'BEGIN { exit !(a > b) }'; then
            bestr="$r" bestc="$cfg" bestp="${peak[$row,$cfg]}"
        fi
    done
    if [ -z "$bestr" ]; then
        [ -n "${oom[$row,$who-none]:-}${oom[$row,$who-ckpt]:-}" ] && echo "- oom -" || echo "- - -"
        return
    fi
    echo "$bestr ${bestc#*-} $bestp"
}
ratio() {
    if [ "$1" = - ] || [ "$2" = - ]; then echo -; else awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; fi
}
# JSON values: a number or a string, null for "-"
num() { if [ "$1" = - ]; then echo null; else echo "$1"; fi; }
str() { if [ "$1" = - ]; then echo null; else echo "\"$1\""; fi; }

echo
echo "every configuration, tok/s (median of steps 2 on; oom = out of memory):"
for row in "${rows[@]}"; do
    line="$row:"
    for cfg in upipe "${variants[@]/#/upipe-}" liger-none liger-ckpt hf-none hf-ckpt; do
        if [ -n "${steps[$row,$cfg]:-}" ]; then
            line+=" $cfg $(echo -n "${steps[$row,$cfg]}" | median_rate),"
        elif [ -n "${oom[$row,$cfg]:-}" ]; then
            line+=" $cfg oom,"
        fi
    done
    echo "${line%,}"
done
echo
echo "tok/s = median of steps 2 on; peaks in $uname; a peer's best configuration (none = no checkpointing, ckpt = checkpointing)"
printf '%-12s %9s %-24s %9s %-6s %9s %-6s %11s %8s\n' row "upipe" "upipe peak (planned)" "hf+liger" "cfg" "hf" "cfg" "upipe/liger" "upipe/hf"
json=()
for row in "${rows[@]}"; do
    up="-" upeak="-" upred="-" same=null
    if [ -n "${steps[$row,upipe]:-}" ]; then
        up="$(echo -n "${steps[$row,upipe]}" | median_rate)"
        upeak="${peak[$row,upipe]}" upred="${pred[$row,upipe]:-}"
        [ -n "$upred" ] && { [ "$upeak" = "$upred" ] && same=true || same=false; }
    fi
    read -r lr lc lp <<< "$(best "$row" liger)"
    read -r hr hc hp <<< "$(best "$row" hf)"
    shown="-"
    [ "$upeak" != - ] && shown="$(gb "$upeak") ($(gb "${upred:-0}"))$([ "$same" = true ] && echo " =" || echo " !=")"
    printf '%-12s %9s %-24s %9s %-6s %9s %-6s %11s %8s\n' "$row" "$up" "$shown" "$lr" "$lc" "$hr" "$hc" \
        "$(ratio "$up" "$lr")" "$(ratio "$up" "$hr")"
    json+=("$(printf '{"row":"%s","upipe_tokens_per_s":%s,"upipe_peak_bytes":%s,"upipe_predicted_peak_bytes":%s,"upipe_peak_equals_planned":%s,"liger_tokens_per_s":%s,"liger_config":%s,"liger_peak_bytes":%s,"hf_tokens_per_s":%s,"hf_config":%s,"hf_peak_bytes":%s,"upipe_over_liger":%s,"upipe_over_hf":%s}' \
        "$row" "$(num "$up")" "$(num "$upeak")" "$(num "${upred:--}")" "$same" "$(num "$lr")" "$(str "$lc")" \
        "$(num "$lp")" "$(num "$hr")" "$(str "$hc")" "$(num "$hp")" "$(num "$(ratio "$up" "$lr")")" \
        "$(num "$(ratio "$up" "$hr")")")")
done
printf '%s\n' "${json[@]}"
echo "total $(($(date +%s) - T0)) s; logs in $logs"
