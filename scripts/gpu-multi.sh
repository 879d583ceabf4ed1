#!/usr/bin/env bash
# Runs on one node of GPUS GPUs (2, 4 or 8), over NCCL: correctness of every
# strategy with FSDP against the CPU, Llama3-8B throughput, the longest
# context by planner and rehearsal, Qwen3-32B, and the NCCL watchdog.
#
#   scripts/gpu-multi.sh build DIR             # here: the GPU test binaries it runs
#                                              # and `upipe`, stripped, into DIR/bin
#   GPUS=2 BUDGET=560 bash DIR/gpu-multi.sh correct   # on the GPU machine, from the
#                                              # repository root (PARTS as arguments)
#   DRY=1 GPUS=8 bash scripts/gpu-multi.sh correct    # anywhere: CPU thread ranks,
#                                              # tiny models, short lengths
#
# PARTS (arguments, or $PARTS; default: GPUS=2 "correct llama8b longest
# watchdog", otherwise "correct throughput longest qwen32b"):
#   correct    the GPU test binaries (TESTS), then per config of CORRECT
#              ("model attn Pu Pr [U]" lines) 6 AdamW steps with --fsdp on on
#              the GPUs against the CPU f32 thread run of the same mesh
#              (losses within TOL, 1e-2 relative), rank 0's ledger peak
#              against the planner's, a rehearsal of the same run (every
#              rank's rehearsed peak against its planned one); then a
#              checkpoint of GPUS ranks resumed on 1 rank (and, where that is
#              refused, on 4 thread ranks of one GPU) and back on GPUS ranks,
#              on the GPUs and on the CPU
#   llama8b    Llama3-8B, --fsdp on --checkpoint --tiled-mlp --offload auto
#              --offload-optimizer OFFLOAD_OPTIMIZER (auto; all, none),
#              UPipe (U = Pu) against Ulysses at SEQS (131072 262144 524288),
#              the order alternating per length, STEPS (2) each, last step
#   throughput the same with UPipe, Ulysses, ring and USP at SEQS (131072
#              262144 524288 1048576)
#   longest    `upipe plan` over LONG_ATTN, then `--rehearse` at the planner's
#              longest and LONG_STEP (4 %) beyond, for each strategy
#   qwen32b    `longest` for Qwen3-32B (Ulysses, UPipe), and one attention
#              layer of it (`bench attn`, U = 8) at BENCH_SEQS: ledger
#              peaks and activation bytes of UPipe against Ulysses
#   watchdog   2 ranks started as srun would (no supervisor), rank 1 killed
#              (kill -9) after the first step: rank 0 must exit within
#              UPIPE_NCCL_TIMEOUT_S (30) naming the collective and its group;
#              the same under `upipe launch` (a failing status); a rank killed
#              while a checkpoint is written, then --resume
#
# Each part writes ONE file, $OUT/<GPUS>x-<part>.log: every command's output
# as it runs, and one JSON object per result on lines starting
# `{"result":` (grep '^{"result"' gives JSON lines). A part's table is
# printed after it and all tables at the end. BUDGET (seconds, default 560)
# is this call's time: every command is skipped, with a SKIP row, when its
# estimate does not fit in what is left, and is killed at what is left.
set -u
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-multi.sh build DIR}"
    set -e
    bash "$(dirname "$0")/bundle.sh" "$dest" gpu_train gpu_nccl gpu_fsdp
    cp "$0" "$dest/"
    du -sh "$dest"
    exit 0
fi

here="$(cd "$(dirname "$0")" && pwd)"
G=${GPUS:-2}
DRY=${DRY:-0}
U="${UPIPE:-$here/bin/upipe}"
[ -x "$U" ] || U="$(pwd)/target/release/upipe"
[ -x "$U" ] || U="$(command -v upipe || true)"
[ -n "$U" ] && [ -x "$U" ] || { echo "no upipe binary: run '$0 build DIR' or cargo build --release" >&2; exit 2; }
out="${OUT:-/tmp/upipe-multi-out}"
work="$(mktemp -d /tmp/upipe-multi.XXXXXX)"
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
T0=$(date +%s)
BUDGET=${BUDGET:-560}
if [ "$DRY" = 1 ]; then
    DEV=cpu                                  # "GPU" runs are CPU thread ranks
    : "${STEPS_CORRECT:=2}" "${SEQ_CORRECT:=128}" "${SEQS:=256 512}" "${STEPS:=2}"
    : "${MODEL8B:=small}" "${MODEL_LONG:=small}" "${MODEL_QWEN:=small}" "${GPU_MEM:=0.02}" "${PLAN_RESERVE:=0}" "${HOST_MEM:=1}"
    : "${PLAN_DEVICE:=cpu}" "${BENCH_SEQS:=256}" "${WD_MODEL:=tiny}" "${WD_SEQ:=256}"
    SMALL_D=16
else
    DEV=cuda
    SMALL_D=64
fi
: "${STEPS_CORRECT:=6}" "${SEQ_CORRECT:=512}" "${TOL:=1e-2}" "${STEPS:=2}"
: "${MODEL8B:=llama3-8b}" "${MODEL_LONG:=llama3-8b}" "${MODEL_QWEN:=qwen3-32b}"
: "${GPU_MEM:=139}" "${PLAN_DEVICE:=cuda}" "${LONG_STEP:=1.04}"
: "${WD_MODEL:=llama3.2-1b}" "${WD_SEQ:=8192}" "${UPIPE_NCCL_TIMEOUT_S:=30}"
# host memory per node for offload, GiB: what the machine has, less room for the rest
if [ -z "${HOST_MEM:-}" ]; then
    HOST_MEM=$(awk '/MemTotal/ {printf "%d", $2/1048576*0.92}' /proc/meminfo)
fi
if [ "$G" = 2 ]; then
    default_parts="correct llama8b longest watchdog"
    : "${TESTS=gpu_train gpu_fsdp gpu_nccl}" "${LONG_ATTN:=ulysses,upipe}"
else
    default_parts="correct throughput longest qwen32b"
    : "${TESTS=gpu_train}" "${LONG_ATTN:=ulysses,ring,usp,upipe}"
fi
parts=" ${*:-${PARTS:-$default_parts}} "
h=$((G / 2))
# the strategies' meshes on G GPUs: name and flags
mesh_of() {
    case "$1" in
        upipe) echo "--attn upipe --ulysses $G --ring 1 --chunk-heads $G" ;;
        ulysses) echo "--attn ulysses --ulysses $G --ring 1" ;;
        ring) echo "--attn ring --ulysses 1 --ring $G" ;;
        usp) echo "--attn usp --ulysses $h --ring 2" ;;
    esac
}
if [ -z "${CORRECT:-}" ]; then
    if [ "$G" = 2 ]; then
        CORRECT="tiny upipe 2 1
tiny ulysses 2 1
tiny ring 1 2
small upipe 2 1
small ulysses 2 1
small ring 1 2"
    else
        CORRECT="small ulysses $G 1
small ring 1 $G
small usp $h 2
small upipe $G 1 $G
small upipe $h 2"
    fi
fi

left() { echo $((BUDGET - ($(date +%s) - T0))); }
declare -a table
status=0
plog=/dev/null
begin() { # part: its log file, its header
    part=$1
    plog="$out/${G}x-$part.log"
    prow=()
    { echo "### part $part, $G GPUs, $(date -u +%FT%TZ), DRY=$DRY, $(left) s left"; } >> "$plog"
    echo "== $part ($(left) s left; log $plog)"
}
row() { # one line of the part's table
    prow+=("$1")
    table+=("$part: $1")
    echo "ROW $1" >> "$plog"
}
result() { # a JSON object of named values: result key value key value ...
    local s="{\"result\":\"$part\",\"gpus\":$G,\"dry\":$DRY" k v
    while [ $# -ge 2 ]; do
        k=$1 v=$2; shift 2
        case "$v" in
            ''|*[!0-9.e+-]*|[e+-]|*[0-9.]-*) [[ "$v" == \{* || "$v" == \[* ]] || v="\"${v//\"/\'}\"" ;;
        esac
        s="$s,\"$k\":$v"
    done
    echo "$s}" >> "$plog"
}
finish() { # the part's table
    echo "-- $part"
    for r in "${prow[@]}"; do echo "$r"; done
}
# run NAME ESTIMATE_S cmd...: the command's output appended to the part's log
# and kept in $work/NAME.out; RC its status (124/137: killed at the budget,
# 99: skipped, it would not have fit)
run() {
    local name=$1 est=$2 l off s
    shift 2
    [ "$DRY" = 1 ] && est=$((est / 10)) # tiny models on the CPU
    l=$(left)
    if [ "$est" -gt $((l - 5)) ]; then
        row "SKIP $name: needs about ${est} s, $l s left (run it in a call of its own)"
        RC=99
        : > "$work/$name.out"
        return 0
    fi
    echo "=== $name $(date -u +%T) (limit $((l - 5)) s): $*" >> "$plog"
    off=$(stat -c %s "$plog")
    s=$(date +%s)
    timeout -k 10 $((l - 5)) "$@" >> "$plog" 2>&1
    RC=$?
    SECS=$(($(date +%s) - s))
    tail -c +$((off + 1)) "$plog" > "$work/$name.out"
    echo "=== $name rc=$RC ${SECS}s" >> "$plog"
    [ "$RC" = 124 ] || [ "$RC" = 137 ] && row "TIMEOUT $name after ${SECS}s (budget)"
    return 0
}
field() { echo "$1" | grep -o "\"$2\":[0-9.e+-]*" | head -1 | cut -d: -f2; }
obj() { echo "$1" | grep -o "\"$2\":{[^}]*}" | head -1 | cut -d: -f2-; }
gb() { awk -v b="${1:-0}" 'BEGIN {printf "%.2f", b/1e9}'; }
steplines() { grep -a '"step":' "$work/$1.out" | sed 's/^\[rank [0-9]*\] //'; }
losses() { steplines "$1" | grep -o '"loss":[0-9.e+-]*' | cut -d: -f2 | paste -sd' '; }
# the largest relative difference of two loss lists (inf when their lengths differ)
maxrel() {
    awk -v a="$1" -v b="$2" 'BEGIN { n = split(a, x, " "); m = split(b, y, " ");
        if (n != m || n == 0) { print "inf"; exit }
        e = 0; for (i = 1; i <= n; i++) { d = (x[i] - y[i]) / y[i]; if (d < 0) d = -d; if (d > e) e = d }
        printf "%.2e", e }'
}
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a != "inf" && a + 0 <= b + 0) }'; }
corpus() { # the bundled corpus repeated past $1 bytes
    data="$work/corpus.txt"
    : > "$data"
    while [ "$(stat -c %s "$data")" -le "$1" ]; do cat assets/corpus.txt >> "$data"; done
}
# seconds a training run of $1 tokens, model $2, $3 steps should take on G
# GPUs (EST_TFLOPS per GPU, EST_START of start-up and offload set-up)
est_train() {
    [ "$DRY" = 1 ] && { echo 20; return; }
    case "$2" in
        llama3-8b) dims="32 4096 8.0e9" ;;
        llama3.2-1b) dims="16 2048 1.2e9" ;;
        qwen3-32b) dims="64 8192 3.2e10" ;;
        *) echo 60; return ;;
    esac
    awk -v s="$1" -v d="$dims" -v n="$3" -v g="$G" -v r="${EST_TFLOPS:-400}" -v st="${EST_START:-90}" 'BEGIN {
        split(d, x, " "); f = x[1] * 4.5 * 2 * s * s * x[2] + 8 * x[3] * s
        printf "%d", st + n * f / (g * r * 1e12) }'
}
{ date -u; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"; } 2>&1
echo "upipe $U; GPUS=$G DRY=$DRY DEV=$DEV BUDGET=$BUDGET HOST_MEM=$HOST_MEM GiB; parts:$parts"
"$U" info 2>&1 | grep -iE "cudnn|nccl|driver|cuda" | head -6 | cut -c1-160

# --- correct -------------------------------------------------------------
small_config() { # a Qwen3-style model (QK-norm, tied embeddings) as config.json
    cat > "$work/small.json" <<EOF
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
 "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": $SMALL_D,
 "vocab_size": 256, "rope_theta": 1000000.0, "rope_scaling": null, "rms_norm_eps": 1e-6,
 "tie_word_embeddings": true, "max_position_embeddings": 65536,
 "attention_bias": false, "mlp_bias": false}
EOF
}
model_arg() { [ "$1" = small ] && echo "$work/small.json" || echo "$1"; }
# every rank's rehearsed peak against its planned one, from a rehearsal's output
rehearsed_ranks() {
    local f="$work/$1.out" j r0 ranks bad
    j=$(grep -a '"rehearsal"' "$f" | sed 's/^\[rank [0-9]*\] //' | tail -1)
    r0=$(obj "$j" device_peak)
    ranks=1
    bad=0
    [ "$(field "$r0" measured)" = "$(field "$r0" planned)" ] && [ -n "$r0" ] || bad=1
    while read -r m p; do
        ranks=$((ranks + 1))
        [ "$m" = "$p" ] || bad=$((bad + 1))
    done < <(grep -a "rehearsed device peak" "$f" | sed -E 's/.*rehearsed device peak ([^(]*) \(planned ([^)]*)\).*/\1|\2/' | tr -d ' ' | tr '|' ' ')
    echo "$ranks $bad"
}
small_config
if [[ "$parts" == *" correct "* ]]; then
    begin correct
    for t in $TESTS; do
        exe="$here/bin/test-$t"
        if [ ! -x "$exe" ]; then row "SKIP test $t: $exe not built"; continue; fi
        run "test-$t" 120 "$exe" --test-threads=1 --nocapture
        res=$(grep -a '^test result:' "$work/test-$t.out" | tail -1 | sed 's/test result: //; s/; finished.*//')
        skips=$(grep -a -c 'SKIP' "$work/test-$t.out")
        [ "$RC" = 0 ] || status=1
        row "$(printf 'test %-10s rc=%-3s %4ss %s; %s SKIP lines' "$t" "$RC" "$SECS" "$res" "$skips")"
        result name "test-$t" rc "$RC" seconds "$SECS" summary "$res" skip_lines "$skips"
    done
    common=(--fsdp on --seq "$SEQ_CORRECT" --warmup 1 --seed 1 --lr 3e-3 --min-lr 3e-4 --json)
    while read -r model attn pu pr uu; do
        [ -z "$model" ] && continue
        name="$model-$attn-${pu}x$pr${uu:+-U$uu}"
        mesh=(--model "$(model_arg "$model")" --attn "$attn" --ulysses "$pu" --ring "$pr" --data-parallel 1 ${uu:+--chunk-heads "$uu"})
        run "cpu-$name" 120 "$U" train "${mesh[@]}" "${common[@]}" --steps "$STEPS_CORRECT" --device cpu
        cpu=$(losses "cpu-$name")
        run "dev-$name" 120 "$U" train "${mesh[@]}" "${common[@]}" --steps "$STEPS_CORRECT" --device "$DEV"
        drc=$RC
        dev=$(losses "dev-$name")
        last=$(steplines "dev-$name" | tail -1)
        peak=$(field "$last" peak_bytes) pred=$(field "$last" predicted_peak_bytes)
        run "rehearse-$name" 60 "$U" train "${mesh[@]}" "${common[@]}" --device "$DEV" --rehearse
        read -r nr bad <<< "$(rehearsed_ranks "rehearse-$name")"
        err=$(maxrel "$dev" "$cpu")
        ok=FAIL
        le "$err" "$TOL" && [ "$drc" = 0 ] && [ "$peak" = "$pred" ] && [ "$bad" = 0 ] && ok=ok
        [ "$ok" = ok ] || status=1
        row "$(printf '%-4s %-26s rc=%-3s loss rel err %-8s (tol %s)  rank-0 peak %s GB planned %s  rehearsed ranks %s, differing %s' \
            "$ok" "$name" "$drc" "$err" "$TOL" "$(gb "$peak")" "$(gb "$pred")" "$nr" "$bad")"
        result name "$name" ok "$ok" rc "$drc" max_rel_err "$err" cpu_losses "[$(echo $cpu | tr ' ' ',')]" \
            dev_losses "[$(echo $dev | tr ' ' ',')]" peak_bytes "${peak:-0}" predicted_peak_bytes "${pred:-0}" \
            rehearsed_ranks "$nr" rehearsed_ranks_differing "$bad"
    done <<< "$CORRECT"
    # resume: GPUS ranks -> 1 rank (or 4 thread ranks of one GPU) -> GPUS ranks
    rmodel=tiny; [ "$G" -gt 2 ] && rmodel=small
    rflags=(--model "$(model_arg "$rmodel")" --attn upipe --data-parallel 1 "${common[@]}")
    wide=(--ulysses "$G" --ring 1)
    chain=""
    for tag in cpu dev; do
        where=cpu; [ "$tag" = dev ] && where=$DEV
        d="$work/ckpt-$tag"
        rm -rf "$d"
        run "resume-$tag-a" 120 "$U" train "${rflags[@]}" "${wide[@]}" --steps 2 --save-dir "$d" --device "$where"
        run "resume-$tag-b1" 120 "$U" train "${rflags[@]}" --ulysses 1 --ring 1 --steps 4 --save-dir "$d" --resume --device "$where"
        one_rc=$RC
        one="rc $RC: $(grep -a -i -o 'error: .*' "$work/resume-$tag-b1.out" | head -1 | cut -c1-150)"
        b=b1
        if [ "$RC" != 0 ]; then # one rank cannot hold a sharded checkpoint: 4 thread ranks on one device
            b=b4
            if [ "$where" = cuda ]; then
                run "resume-$tag-b4" 120 env CUDA_VISIBLE_DEVICES=0 "$U" train "${rflags[@]}" --ulysses 2 --ring 2 --steps 4 --save-dir "$d" --resume --device "$where"
            else
                run "resume-$tag-b4" 120 "$U" train "${rflags[@]}" --ulysses 2 --ring 2 --steps 4 --save-dir "$d" --resume --device "$where"
            fi
        fi
        brc=$RC
        run "resume-$tag-c" 120 "$U" train "${rflags[@]}" "${wide[@]}" --steps 6 --save-dir "$d" --resume --device "$where"
        crc=$RC
        l="$(losses "resume-$tag-a") $(losses "resume-$tag-$b") $(losses "resume-$tag-c")"
        eval "chain_$tag=\"\$l\"; rcs_$tag=\"$one_rc/$brc/$crc via $b\""
        row "resume $tag $rmodel: 1 rank: $one; then via $b rc $brc, back on $G ranks rc $crc; losses $l"
    done
    err=$(maxrel "$chain_dev" "$chain_cpu")
    ok=FAIL; le "$err" "$TOL" && ok=ok
    [ "$ok" = ok ] || status=1
    row "$(printf '%-4s resume %s ranks -> 1 (or 4 threads of one device) -> %s: steps %s, loss rel err %s (dev %s)' "$ok" "$G" "$G" "$(echo $chain_dev | wc -w)" "$err" "$rcs_dev")"
    result name resume ok "$ok" max_rel_err "$err" cpu_losses "[$(echo $chain_cpu | tr ' ' ',')]" \
        dev_losses "[$(echo $chain_dev | tr ' ' ',')]" statuses_cpu "$rcs_cpu" statuses_dev "$rcs_dev"
    finish
fi

# --- llama8b / throughput ----------------------------------------------------
speed() { # strategies, lengths
    local strats=($1) i=0 s n k name last off
    corpus $(( $(echo $2 | tr ' ' '\n' | sort -n | tail -1) + 16 ))
    for s in $2; do
        n=${#strats[@]}
        for k in $(seq 0 $((n - 1))); do
            st=${strats[$(((k + i) % n))]}
            name="$st-$s"
            read -r -a m <<< "$(mesh_of "$st")"
            flags=(--model "$(model_arg "$MODEL8B")" --data "$data" --seq "$s" --steps "$STEPS" --warmup 1 --fsdp on
                --checkpoint --tiled-mlp --offload auto --profile --json --device "$DEV" "${m[@]}")
            # auto: the fewest units' optimizer state on the host that fit (none when all fit)
            case "${OFFLOAD_OPTIMIZER:-auto}" in
                1 | all) off="--offload-optimizer all" ;;
                0 | none) off="" ;;
                *) off="--offload-optimizer auto" ;;
            esac
            run "$name" "$(est_train "$s" "$MODEL8B" "$STEPS")" "$U" train "${flags[@]}" $off
            [ "$RC" = 0 ] || status=1
            last=$(steplines "$name" | tail -1)
            tps=$(field "$last" tokens_per_s)
            tpg=$(awk -v t="${tps:-0}" -v g="$G" 'BEGIN {printf "%.0f", t/g}')
            row "$(printf '%-8s %8s rc=%-3s step %s %6s tok/s/GPU %6.1f TFLOP/s/GPU peak %s GB (planned %s) collective %.0f ms idle %.0f ms wall %.0f ms %s' \
                "$st" "$s" "$RC" "$(field "$last" step)" "$tpg" "$(field "$last" tflops_per_rank)" \
                "$(gb "$(field "$last" peak_bytes)")" "$(gb "$(field "$last" predicted_peak_bytes)")" \
                "$(field "$last" collective_ms)" "$(field "$last" idle_ms)" "$(field "$last" wall_ms)" "$off")"
            result strategy "$st" seq "$s" rc "$RC" step "$(field "$last" step)" tokens_per_s_per_gpu "$tpg" \
                tflops_per_rank "$(field "$last" tflops_per_rank)" peak_bytes "$(field "$last" peak_bytes)" \
                predicted_peak_bytes "$(field "$last" predicted_peak_bytes)" \
                peak_by_category "$(obj "$last" peak_by_category)" \
                predicted_by_category "$(obj "$last" predicted_by_category)" \
                profile "$(obj "$last" profile)" offload_optimizer "${OFFLOAD_OPTIMIZER:-auto}" mesh "${m[*]}"
        done
        i=$((i + 1))
    done
}
if [[ "$parts" == *" llama8b "* ]]; then
    begin llama8b
    speed "${STRATS:-upipe ulysses}" "${SEQS:-131072 262144 524288}"
    finish
fi
if [[ "$parts" == *" throughput "* ]]; then
    begin throughput
    speed "${STRATS:-upipe ulysses ring usp}" "${SEQS:-131072 262144 524288 1048576}"
    finish
fi

# --- longest ---------------------------------------------------------------
longest() { # model, strategies
    local model=$1 attn=$2 j st L L2 u r c d name fits fits2
    run "plan-$model" 120 "$U" plan --model "$(model_arg "$model")" --gpus "$G" --gpus-per-node "$G" --gpu-mem "$GPU_MEM" \
        --reserve "${PLAN_RESERVE:-1}" --host-mem "$HOST_MEM" --policies checkpoint,tiled-mlp,fsdp,offload-auto,offload-optimizer \
        --attn "$attn" --device "$PLAN_DEVICE" --json
    [ "$RC" = 0 ] || { status=1; row "plan $model failed rc=$RC"; return; }
    declare -gA longest_of=() confirmed_of=()
    while read -r j; do
        st=$(echo "$j" | grep -o '"strategy":"[a-z]*"' | cut -d'"' -f4)
        L=$(field "$j" longest_seq)
        m=$(obj "$j" mesh)
        u=$(field "$m" ulysses) r=$(field "$m" ring) c=$(field "$m" chunk_heads) d=$(field "$m" data)
        L2=$(awk -v l="$L" -v f="$LONG_STEP" 'BEGIN {printf "%d", int(l * f / 4096 + 1) * 4096}')
        longest_of[$st]=$L
        confirmed_of[$st]=0
        for seq in "$L" "$L2"; do
            name="rehearse-$model-$st-$seq"
            ch=(); [ "$st" = upipe ] && ch=(--chunk-heads "$c")
            run "$name" "${EST_REHEARSE:-120}" "$U" train --model "$(model_arg "$model")" --seq "$seq" --attn "$st" --ulysses "$u" \
                --ring "$r" --data-parallel "$d" "${ch[@]}" --checkpoint --tiled-mlp --fsdp on \
                --offload auto --offload-optimizer --host-mem "$HOST_MEM" --device "$DEV" --rehearse --json
            rj=$(grep -a '"rehearsal"' "$work/$name.out" | sed 's/^\[rank [0-9]*\] //' | tail -1)
            fits=$(echo "$rj" | grep -o '"fits":[a-z]*' | cut -d: -f2)
            dp=$(obj "$rj" device_peak) hp=$(obj "$rj" host_peak)
            [ "$seq" = "$L" ] && [ "$fits" = true ] && confirmed_of[$st]=$L
            [ "$seq" = "$L2" ] && [ "$fits" = true ] && confirmed_of[$st]=$L2
            read -r nr bad <<< "$(rehearsed_ranks "$name")"
            row "$(printf '%-10s %-8s plan longest %9s  rehearse %9s rc=%-3s fits %-5s device %s/%s GB host %s/%s GB (measured/planned) ranks %s differing %s' \
                "$model" "$st" "$L" "$seq" "$RC" "${fits:-?}" "$(gb "$(field "$dp" measured)")" "$(gb "$(field "$dp" planned)")" \
                "$(gb "$(field "$hp" measured)")" "$(gb "$(field "$hp" planned)")" "$nr" "$bad")"
            result model "$model" strategy "$st" plan_longest "$L" seq "$seq" rc "$RC" fits "${fits:-unknown}" \
                device_peak "${dp:-null}" host_peak "${hp:-null}" by_category "$(echo "$rj" | grep -o '"by_category":{.*}},' | sed 's/,$//' | cut -d: -f2-)" \
                rehearsed_ranks "$nr" rehearsed_ranks_differing "$bad" mesh "$m"
        done
    done < <(grep -a '"longest_seq"' "$work/plan-$model.out")
    for st in "${!longest_of[@]}"; do
        [ "$st" = ulysses ] && continue
        [ -n "${longest_of[ulysses]:-}" ] || continue
        ratio=$(awk -v a="${longest_of[$st]}" -v b="${longest_of[ulysses]}" 'BEGIN {printf "%.2f", b ? a/b : 0}')
        rr=$(awk -v a="${confirmed_of[$st]}" -v b="${confirmed_of[ulysses]}" 'BEGIN {printf "%.2f", b ? a/b : 0}')
        row "$model $st/ulysses longest: planner ${longest_of[$st]}/${longest_of[ulysses]} = $ratio; rehearsed (fits) ${confirmed_of[$st]}/${confirmed_of[ulysses]} = $rr"
        result model "$model" strategy "$st" ratio_to_ulysses "$ratio" rehearsed_ratio_to_ulysses "$rr" \
            plan_longest "${longest_of[$st]}" plan_longest_ulysses "${longest_of[ulysses]}"
    done
}
if [[ "$parts" == *" longest "* ]]; then
    begin longest
    longest "$MODEL_LONG" "$LONG_ATTN"
    finish
fi

# --- qwen32b ---------------------------------------------------------------
if [[ "$parts" == *" qwen32b "* ]]; then
    begin qwen32b
    longest "$MODEL_QWEN" ulysses,upipe
    if [ "$DRY" = 1 ]; then dims=(--hidden 256 --heads 16 --kv-heads 8 --head-dim 16)
    else dims=(--hidden 5120 --heads 64 --kv-heads 8 --head-dim 128); fi
    for s in ${BENCH_SEQS:-262144 524288}; do
        run "attn-$s" 150 "$U" bench attn --device "$DEV" "${dims[@]}" --qk-norm --seq "$s" --ulysses "$G" --ring 1 \
            --methods ulysses,upipe --chunk-heads 8 --warmup 0 --iters 1 --json
        [ "$RC" = 0 ] || status=1
        while read -r j; do
            row "$(printf 'attn layer %8s %-8s U %-3s peak %s GB (planned %s) activations %s GB, %.2f of Ulysses' "$s" \
                "$(echo "$j" | grep -o '"method":"[a-z]*"' | cut -d'"' -f4)" "$(field "$j" chunk_heads)" \
                "$(gb "$(field "$j" peak_bytes)")" "$(gb "$(field "$j" predicted_peak_bytes)")" \
                "$(gb "$(field "$j" act_bytes)")" "$(field "$j" act_vs_ulysses)")"
            result seq "$s" layer "$j"
        done < <(grep -a '"method"' "$work/attn-$s.out" | sed 's/^\[rank [0-9]*\] //')
    done
    finish
fi

# --- watchdog --------------------------------------------------------------
# children of a process (the ranks a launcher started)
kids() { ps -o pid= --ppid "$1" 2>/dev/null | tr -d ' '; }
rank_pid() { # the child of $1 whose RANK is $2
    local p
    for p in $(kids "$1"); do
        tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$2" && { echo "$p"; return; }
    done
}
alive() { [ -e "/proc/$1" ] && ! grep -qE '^[0-9]+ \(.*\) Z' "/proc/$1/stat" 2>/dev/null; }
gone() { ! alive "$1"; }
has_rank() { [ -n "$(rank_pid "$1" "$2")" ]; }
wait_for() { # seconds, test command: polls every 0.05 s
    local end=$(($(date +%s) + $1))
    shift
    while [ "$(date +%s)" -lt "$end" ]; do "$@" && return 0; sleep 0.05; done
    return 1
}
if [[ "$parts" == *" watchdog "* ]]; then
    begin watchdog
    export UPIPE_NCCL_TIMEOUT_S
    wd=(train --model "$WD_MODEL" --seq "$WD_SEQ" --warmup 1 --fsdp on --checkpoint
        --attn upipe --data-parallel 1 --json --device "$DEV")
    two=(--ulysses 2 --ring 1)
    [ "$DRY" = 1 ] && two=(--ulysses 2 --ring 2) # CPU: one process of 4 thread ranks
    long=(--steps 100000)
    if [ "$DRY" = 1 ]; then
        # no NCCL ranks on the CPU: the rank commands must parse; the launcher's
        # failure path with long-running CPU children (the planner)
        for r in 0 1; do
            run "srun-rank$r-config" 20 env RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 \
                MASTER_ADDR=127.0.0.1 MASTER_PORT=29561 "$U" "${wd[@]}" "${two[@]}" "${long[@]}" --print-config
            row "srun-style rank $r: --print-config rc=$RC"
        done
        lcmd=("$U" launch --nproc-per-node 2 --master-port 29562 -- plan --model llama3-8b --gpus 8 --attn all --policies checkpoint,offload-auto --host-mem 500)
    else
        # (a) two ranks as srun starts them: nothing stops rank 0 but its watchdog
        port=$((29600 + RANDOM % 300))
        echo "=== srun-style ranks, UPIPE_NCCL_TIMEOUT_S=$UPIPE_NCCL_TIMEOUT_S port $port" >> "$plog"
        for r in 0 1; do
            RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
                "$U" "${wd[@]}" "${two[@]}" "${long[@]}" > "$work/srun$r.out" 2>&1 &
            eval "pid$r=$!"
        done
        if wait_for 240 grep -aq '"step":' "$work/srun0.out"; then
            kill -9 "$pid1"
            k=$(date +%s%N)
            # rank 0 should end within the timeout (plus a little)
            lim=$(awk -v t="$UPIPE_NCCL_TIMEOUT_S" 'BEGIN {printf "%d", t + 60}')
            wait_for "$lim" gone "$pid0"
            el=$(awk -v k="$k" -v n="$(date +%s%N)" 'BEGIN {printf "%.1f", (n - k) / 1e9}')
            hung=0
            alive "$pid0" && { kill -9 "$pid0"; hung=1; }
            wait "$pid0"; rc0=$?
            [ "$hung" = 1 ] && rc0=hung
            msg=$(grep -a -o "NCCL watchdog: .*" "$work/srun0.out" | head -1 | cut -c1-300)
            ok=FAIL
            [ "$rc0" != 0 ] && [ "$rc0" != hung ] && [ -n "$msg" ] && echo "$msg" | grep -q "on group" &&
                awk -v e="$el" -v t="$UPIPE_NCCL_TIMEOUT_S" 'BEGIN {exit !(e <= t + 15)}' && ok=ok
            [ "$ok" = ok ] || status=1
            row "$ok srun-style: rank 1 killed, rank 0 exited rc=$rc0 after ${el}s (timeout ${UPIPE_NCCL_TIMEOUT_S}s): $msg"
            result name srun_kill ok "$ok" rank0_rc "$rc0" seconds_after_kill "$el" timeout_s "$UPIPE_NCCL_TIMEOUT_S" message "$msg"
        else
            kill -9 "$pid0" "$pid1" 2>/dev/null
            status=1
            row "FAIL srun-style: no step line from rank 0 within 240 s"
        fi
        wait "$pid1" 2>/dev/null
        cat "$work/srun0.out" "$work/srun1.out" | head -c 4000000 >> "$plog"
        lcmd=("$U" launch --nproc-per-node 2 --master-port $((port + 1)) -- "${wd[@]}" "${two[@]}" "${long[@]}")
    fi
    # (b) under upipe launch: one rank killed, the launcher fails
    if [ "$(left)" -gt 60 ]; then
        echo "=== launch: ${lcmd[*]}" >> "$plog"
        "${lcmd[@]}" > "$work/launch.out" 2>&1 &
        lp=$!
        if [ "$DRY" = 1 ]; then wait_for 20 has_rank "$lp" 1; sleep 1
        else wait_for 240 grep -aq '"step":' "$work/launch.out"; fi
        victim=$(rank_pid $lp 1)
        if [ -n "$victim" ]; then
            kill -9 "$victim"
            k=$(date +%s%N)
            wait_for 60 gone "$lp"
            wait "$lp"; lrc=$?
            el=$(awk -v k="$k" -v n="$(date +%s%N)" 'BEGIN {printf "%.1f", (n - k) / 1e9}')
            msg=$(grep -a -o "upipe launch: rank 1 exited.*" "$work/launch.out" | head -1)
            ok=FAIL; [ "$lrc" != 0 ] && ok=ok
            [ "$ok" = ok ] || status=1
            row "$ok upipe launch: rank 1 (pid $victim) killed, launcher rc=$lrc after ${el}s: $msg"
            result name launch_kill ok "$ok" launcher_rc "$lrc" seconds_after_kill "$el" message "$msg"
        else
            kill "$lp" 2>/dev/null; wait "$lp"
            status=1
            row "FAIL upipe launch: no rank 1 child found"
        fi
        head -c 4000000 "$work/launch.out" >> "$plog"
    else
        row "SKIP launch kill: $(left) s left"
    fi
    # (c) a rank killed while a checkpoint is written, then --resume
    if [ "$(left)" -gt 90 ]; then
        d="$work/wd-ckpt"
        rm -rf "$d"
        ck=(--save-dir "$d" --save-every 2)
        if [ "$DRY" = 1 ]; then ckcmd=("$U" "${wd[@]}" "${two[@]}" "${long[@]}" "${ck[@]}")
        else ckcmd=("$U" launch --nproc-per-node 2 --master-port $((port + 2)) -- "${wd[@]}" "${two[@]}" "${long[@]}" "${ck[@]}"); fi
        echo "=== checkpoint kill: ${ckcmd[*]}" >> "$plog"
        "${ckcmd[@]}" > "$work/ckpt.out" 2>&1 &
        cp=$!
        saved() { grep -q '"step"' "$d/state.json" 2>/dev/null; }
        writing() { compgen -G "$d/*.tmp*" > /dev/null; }
        wait_for 240 saved
        first=$(grep -o '"step": *[0-9]*' "$d/state.json" 2>/dev/null | grep -o '[0-9]*$')
        # the next save: kill the process writing a temporary file (or, if none
        # is seen in time, rank 1)
        how="after a save (no write caught)"
        victim=""
        wmax=120; [ "$DRY" = 1 ] && wmax=2
        if wait_for $wmax writing; then
            f=$(compgen -G "$d/*.tmp*" | head -1)
            victim=${f##*.tmp-}
            [[ "$victim" =~ ^[0-9]+$ ]] || victim=$(rank_pid $cp 1)
            how="while writing ${f:+$(basename "$f")}${f:-(its temporary file gone by then)}"
        fi
        [ "$DRY" = 1 ] && victim=$cp
        [ -z "${victim:-}" ] && victim=$(rank_pid $cp 1)
        kill -9 "$victim" 2>/dev/null
        wait_for 60 gone "$cp"
        kill -9 "$cp" 2>/dev/null
        wait "$cp"; krc=$?
        left_state=$(grep -o '"step": *[0-9]*' "$d/state.json" 2>/dev/null | grep -o '[0-9]*$')
        ls -la "$d" >> "$plog" 2>&1
        head -c 2000000 "$work/ckpt.out" >> "$plog"
        run resume-after-kill 120 "$U" "${wd[@]}" "${two[@]}" --steps $(( ${left_state:-0} + 2 )) --save-dir "$d" --resume
        from=$(steplines resume-after-kill | head -1 | grep -o '"step":[0-9]*' | cut -d: -f2)
        ok=FAIL
        [ "$RC" = 0 ] && [ -n "$left_state" ] && [ "$from" = $((left_state + 1)) ] && ok=ok
        [ "$ok" = ok ] || status=1
        row "$ok checkpoint: first save at step ${first:-none}; pid $victim killed $how (rc $krc); state.json left at step ${left_state:-none (no complete checkpoint)}; resume rc=$RC started at step ${from:-?}"
        result name checkpoint_kill ok "$ok" first_saved "${first:-0}" killed "$how" state_step_after_kill "${left_state:-0}" \
            resume_rc "$RC" resume_first_step "${from:-0}"
    else
        row "SKIP checkpoint kill: $(left) s left"
    fi
    finish
fi

echo "== summary ($G GPUs, DRY=$DRY, $(($(date +%s) - T0)) s; logs in $out)"
for r in "${table[@]}"; do echo "$r"; done
rm -rf "$work"
exit $status
