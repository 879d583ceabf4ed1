#!/usr/bin/env bash
# Retrieval trials (`upipe eval --task`) on one GPU, a short table each:
#
#   scores  the tiny model trained 200 steps on a passkey corpus
#           (written by `eval --task passkey --write-corpus`), then scored
#           on the CPU (f32) and on the GPU (bf16): trial by trial, pass
#           flags and argmax ids equal, mean answer log-prob within TOL
#           (default 0.1 nats/token)
#   trained each model directory of TRAINED (space-separated; e.g. the
#           tiny passkey models of docs/evaluation.md) scored on the CPU
#           and on the GPU with that page's short templates (3 digits,
#           lengths 64,96,128 x 5 depths x 8 trials), compared as above
#   long    BIG (default llama3.2-1b; random weights: one step at lr 1e-9,
#           saved, its context raised to the longest length) scored with
#           `--attn upipe` at BIG_LENGTHS (default 128K,1M), one trial each:
#           predicted peak, measured peak, seconds per trial
#
#   scripts/bundle.sh DIR && cp scripts/gpu-retrieval.sh DIR/
#   bash DIR/gpu-retrieval.sh             # on the GPU machine (about 5 minutes)
#
# DEVICE (default cuda) is the device compared with the CPU and the long
# trials run on; DEVICE=cpu BIG=tiny BIG_LENGTHS=1K,2K runs it all small on
# a CPU.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
here="$(cd "$(dirname "$0")" && pwd)"
U="${U:-$here/bin/upipe}"
W="${WORK:-/tmp/upipe-gpu-retrieval}"
DEV="${DEVICE:-cuda}" BIG="${BIG:-llama3.2-1b}" BIG_LENGTHS="${BIG_LENGTHS:-128K,1M}"
TOL="${TOL:-0.1}"
parts="${PARTS:-scores long}"
[ -n "${TRAINED:-}" ] && parts="$parts trained"
has() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
rm -rf "$W" && mkdir -p "$W"
{ date -u; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"; } 2>&1
# runs a command, keeping its stderr in $W/log; its last lines on failure
run() {
    if ! timeout "$1" "${@:2}" > "$W/out" 2> "$W/log"; then
        echo "FAILED: ${*:2}" | cut -c1-300
        tail -n 5 "$W/log" | cut -c1-300
        return 1
    fi
}

# compares two trials.jsonl trial by trial: pass flags, argmax ids, log-prob
compare() {
    python3 - "$1" "$2" "$TOL" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
tol = float(sys.argv[3])
assert len(a) == len(b), (len(a), len(b))
same_pass = sum(x["passed"] == y["passed"] for x, y in zip(a, b))
same_ids = sum(x["predicted_ids"] == y["predicted_ids"] for x, y in zip(a, b))
diff = max(abs(x["mean_logprob"] - y["mean_logprob"]) for x, y in zip(a, b))
print(f"{'trials':>8} {'pass equal':>11} {'argmax equal':>13} {'max |dlogp|':>12} {'tol':>6} verdict")
ok = same_pass == len(a) and same_ids == len(a) and diff <= tol
print(f"{len(a):>8} {same_pass:>11} {same_ids:>13} {diff:>12.4f} {tol:>6} {'ok' if ok else 'DIFFERS'}")
print(f"passed: cpu {sum(x['passed'] for x in a)}/{len(a)}, gpu {sum(y['passed'] for y in b)}/{len(b)}")
PY
}

if has scores; then
    echo "== scores: tiny, CPU (f32) against $DEV"
    run 60 $U eval --task passkey --tokenizer byte --lengths 384,512 --write-corpus "$W/passkey.u32" \
        --documents 400 &&
    run 240 $U train --model tiny --tokenizer byte --data "$W/passkey.u32" --pack bfd --seq 512 \
        --steps 200 --lr 3e-3 --save-dir "$W/tiny" --save-dtype f32 --device cpu &&
    T="eval --task passkey --model-dir $W/tiny --lengths 512,1K --depths 3 --trials 2" &&
    run 120 $U $T --device cpu --out "$W/cpu" &&
    run 120 $U $T --device "$DEV" --out "$W/dev" &&
    compare "$W/cpu/trials.jsonl" "$W/dev/trials.jsonl"
fi

if has trained; then
    for m in $TRAINED; do
        echo "== trained: $m, CPU (f32) against $DEV"
        P=(eval --task passkey --model-dir "$m" --tokenizer byte --digits 3 --intro-template ""
            --needle-template " pass key {value}." --question-template "\npass key"
            --lengths 64,96,128 --depths 5 --trials 8)
        run 120 $U "${P[@]}" --device cpu --out "$W/t-cpu" &&
        run 120 $U "${P[@]}" --device "$DEV" --out "$W/t-dev" &&
        compare "$W/t-cpu/trials.jsonl" "$W/t-dev/trials.jsonl"
    done
fi

if has long; then
    echo "== long: $BIG --attn upipe at $BIG_LENGTHS on $DEV, random weights"
    [ -f "$W/passkey.u32" ] || run 60 $U eval --task passkey --tokenizer byte --lengths 384,512 \
        --write-corpus "$W/passkey.u32" --documents 400
    run 240 $U train --model "$BIG" --tokenizer byte --data "$W/passkey.u32" --seq 512 --steps 1 \
        --lr 1e-9 --save-dir "$W/big" --save-dtype bf16 --device "$DEV" &&
    python3 - "$W/big/config.json" "$BIG_LENGTHS" <<'PY' &&
import json, sys
path, lengths = sys.argv[1], sys.argv[2]
n = max(int(l[:-1]) * {"K": 1024, "M": 1 << 20}[l[-1]] if l[-1] in "KM" else int(l)
        for l in lengths.split(","))
c = json.load(open(path))
c["max_position_embeddings"] = max(c.get("max_position_embeddings", 0), n)
json.dump(c, open(path, "w"), indent=2)
PY
    run 420 $U eval --task passkey --attn upipe --model-dir "$W/big" --tokenizer byte \
        --lengths "$BIG_LENGTHS" --depths 1 --trials 1 --device "$DEV" --out "$W/long" &&
    python3 - "$W/long/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
g = 1 << 30
print(f"{'length':>9} {'predicted GiB':>14} {'measured GiB':>13} {'s/trial':>9} {'passed':>7}")
for l, c in zip(s["by_length"], s["cells"]):
    print(f"{l['length']:>9} {l['predicted_peak_bytes'] / g:>14.3f} "
          f"{l['measured_peak_bytes'] / g:>13.3f} {l['seconds_per_trial']:>9.2f} "
          f"{c['passed']:>4}/{c['trials']}")
PY
fi
date -u
