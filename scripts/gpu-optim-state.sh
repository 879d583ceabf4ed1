#!/usr/bin/env bash
# Compact optimizer state on one GPU, in one call:
#
#   scripts/gpu-optim-state.sh build DIR   # on a machine with Rust, from the repository
#                                          # root: `upipe`, the gpu_backend tests, this
#                                          # script and a corpus of real text (docs/,
#                                          # README.md, assets/corpus.txt as JSONL
#                                          # documents) into DIR
#   bash DIR/gpu-optim-state.sh [PARTS]    # on the GPU machine
#
# PARTS (default "kernel quality"):
#   kernel  = the compact AdamW kernel against the CPU reference, bit for bit
#             (gpu_backend::compact_adamw)
#   quality = Llama 3.2 1B, STEPS (300) steps at SEQ (4096) tokens on the text corpus
#             (byte tokens, packed documents, lr 3e-4, 30 warm-up steps, cosine to
#             3e-5), once per format of FORMATS ("f32/f32 bf16/f32 8bit/f32 8bit/none
#             bf16/none": moments/master); a row each: final loss (mean of the last 20
#             steps), its ratio to f32/f32's, tokens/s, peak = plan. Metrics files land
#             in $OUT/optim-state for the curves. SEED (0) seeds the run, TAG is added
#             to each row's name (another seed's rows beside the first's), EXTRA is
#             added to each run's flags (e.g. EXTRA="--precision fp8" TAG=-fp8).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${1:-}" = build ]; then
    dest="${2:?usage: gpu-optim-state.sh build DIR}"
    set -e
    bash "$here/bundle.sh" "$dest" gpu_backend
    cp "$0" "$dest/"
    python3 - "$dest/text.jsonl" <<'PY'
import glob, json, sys
out = open(sys.argv[1], "w")
files = sorted(glob.glob("docs/*.md")) + ["README.md", "RESULTS.md", "ARCHITECTURE.md"]
for f in files:
    out.write(json.dumps({"text": open(f).read()}) + "\n")
text = open("assets/corpus.txt").read()
for k in range(0, len(text), 8000):
    out.write(json.dumps({"text": text[k:k + 8000]}) + "\n")
PY
    du -sh "$dest"
    exit 0
fi
bin="$here/bin"
parts=" ${1:-kernel quality} "
work=/tmp/upipe-optim-state
out="${OUT:-$work}/optim-state"
mkdir -p "$work" "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE="${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}"
{ date -u; nvidia-smi -L; } 2>&1
table=()
status=0

if [[ "$parts" == *" kernel "* ]]; then
    log="$work/kernel.log"
    timeout -k 5 120 "$bin/test-gpu_backend" compact_adamw adamw_multi --test-threads 1 > "$log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && { status=1; grep -aE "panicked|FAILED|differs" "$log" | head -5; }
    table+=("kernel rc=$rc $(grep -a '^test result:' "$log" | tail -1)")
fi

if [[ "$parts" == *" quality "* ]]; then
    "$bin/upipe" tokenize "$here/text.jsonl" --tokenizer byte --eos 0 --out "$work/text.u32" > "$work/tok.log" 2>&1 \
        || { tail -3 "$work/tok.log"; status=1; }
    for f in ${FORMATS:-f32/f32 bf16/f32 8bit/f32 8bit/none bf16/none}; do
        name="${f%/*}-${f#*/}${TAG:-}"
        log="$out/$name.jsonl"
        "$bin/upipe" train --model llama3.2-1b --ulysses 1 --ring 1 --seq "${SEQ:-4096}" \
            --steps "${STEPS:-300}" --data "$work/text.u32" --pack documents --lr 3e-4 --min-lr 3e-5 \
            --warmup 30 --optim-state "${f%/*}" --master-weights "${f#*/}" --seed "${SEED:-0}" --json ${EXTRA:-} \
            > "$log" 2> "$work/$name.err"
        rc=$?
        [ "$rc" -ne 0 ] && { status=1; grep -aiE "error|panick" "$work/$name.err" | head -3; }
        table+=("$(python3 - "$log" "$name" "$rc" "$out/f32-f32.jsonl" <<'PY'
import json, statistics, sys
log, name, rc, ref = sys.argv[1:]
def steps(path):
    out = []
    for line in open(path, errors="replace"):
        try:
            j = json.loads(line)
        except ValueError:
            continue
        if "tokens_per_s" in j and "step" in j and j.get("lr") is not None:
            out.append(j)
    return out
s = steps(log)
final = lambda s: statistics.mean(x["loss"] for x in s[-20:]) if s else float("nan")
try:
    r = final(steps(ref))
except OSError:
    r = float("nan")
f = final(s)
tps = statistics.median(x["tokens_per_s"] for x in s[1:]) if len(s) > 1 else 0.0
last = s[-1] if s else {}
same = "=" if last.get("peak_bytes") and last.get("peak_bytes") == last.get("predicted_peak_bytes") else "!="
gb = lambda k: (last.get(k) or 0) / 1e9
print("ROW %-10s rc=%s steps %3d  final loss %.4f  x%.4f of f32/f32  %6.0f tok/s  peak %.3f GB %s plan %.3f GB  optim_state %.3f GB" % (
    name, rc, len(s), f, f / r, tps, gb("peak_bytes"), same, gb("predicted_peak_bytes"),
    (last.get("peak_by_category") or {}).get("optim_state", 0) / 1e9))
PY
)")
        echo "${table[-1]}"
    done
fi

echo
echo "== summary"
printf '%s\n' "${table[@]}"
exit $status
