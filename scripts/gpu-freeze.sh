#!/usr/bin/env bash
# One H200: `--freeze` on CUDA (bf16 weights, F32 gradients and AdamW state).
#
#   bash scripts/gpu-freeze.sh [UPIPE]      # repo root; UPIPE defaults to gpu-bundle/bin/upipe
#
# 1. Llama 3.2 1B (tied embeddings), 8K tokens, --checkpoint: one step and
#    three steps from the same seed with `embeddings,norms,blocks:0-7`
#    frozen; every frozen tensor of the two checkpoints is equal bit for bit
#    (both are the seeded initial weights), every trained one differs.
# 2. The same run rehearsed: measured peaks beside the planner's (equal on
#    the CPU to the byte; here the rehearsal's allocators against the plan).
# 3. Tokens/s and peak of 4 steps without and with the freeze set.
# (FSDP with frozen units needs two ranks or more: tests/integration/freeze.rs on CPU
# thread ranks, and the multi-GPU scripts.)
# DEVICE, MODEL, SEQ override the run (DEVICE=cpu MODEL=tiny SEQ=256 FREEZE=
# embeddings,norms,blocks:0: a dry run on the CPU).
# Prints one ROW line per result; exits 1 when a check fails.
set -u
upipe="${1:-gpu-bundle/bin/upipe}"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export UPIPE_KERNEL_CACHE=${UPIPE_KERNEL_CACHE:-/tmp/upipe-kernels}
work=/tmp/upipe-freeze
rm -rf "$work"
mkdir -p "$work"
status=0
row() { echo "ROW $1"; }
freeze="${FREEZE:-embeddings,norms,blocks:0-7}"
common=(--device "${DEVICE:-cuda}" --model "${MODEL:-llama3.2-1b}" --seq "${SEQ:-8192}" --checkpoint --seed 3 --save-dtype bf16)
{ date -u; nvidia-smi -L; } 2>&1

# compares the frozen tensors of two checkpoints (equal) and the others (differ)
compare() {
    python3 - "$1" "$2" "$3" <<'EOF'
import json, re, struct, sys
def load(path):  # raw bytes of each tensor: equal means equal bit for bit
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    return {k: body[v["data_offsets"][0]:v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}
a, b, spec = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
layers = set()
for part in spec.split(","):
    m = re.fullmatch(r"blocks:(\d+)(?:-(\d+))?", part)
    if m:
        lo = int(m.group(1)); hi = int(m.group(2) or lo)
        layers |= set(range(lo, hi + 1))
def frozen(name):
    parts = spec.split(",")
    if "embeddings" in parts and name == "model.embed_tokens.weight": return True
    if "norms" in parts and name.endswith("norm.weight"): return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) in layers
bad = []
for name in a:
    same = a[name] == b[name]
    if frozen(name) != same:
        bad.append(f"{name}: frozen={frozen(name)} equal={same}")
print(f"{len(a)} tensors, {sum(frozen(n) for n in a)} frozen; {len(bad)} wrong")
for line in bad[:10]: print("  " + line)
sys.exit(1 if bad else 0)
EOF
}

"$upipe" train "${common[@]}" --steps 1 --freeze "$freeze" --save-dir "$work/one" > "$work/one.log" 2>&1 || { row "freeze 1 step: FAILED"; tail -5 "$work/one.log"; status=1; }
"$upipe" train "${common[@]}" --steps 3 --freeze "$freeze" --save-dir "$work/three" > "$work/three.log" 2>&1 || { row "freeze 3 steps: FAILED"; tail -5 "$work/three.log"; status=1; }
if out=$(compare "$work/one/model.safetensors" "$work/three/model.safetensors" "$freeze"); then
    row "frozen unchanged, trained moved: $out"
else
    row "frozen/trained check FAILED: $out"; status=1
fi

"$upipe" train "${common[@]}" --steps 3 --freeze "$freeze" --rehearse > "$work/rehearse.log" 2>&1
row "rehearse --freeze (exit $?): $(grep -iE 'peak|predicted' "$work/rehearse.log" | head -4 | tr '\n' ';')"

# median tokens/s of steps 2 on, the last loss, the peak and the plan's
speed() {
    python3 - "$1" <<'EOF'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
if not steps:
    print("no steps"); sys.exit()
tps = sorted(s.get("tokens_per_s", 0) for s in steps[1:]) or [0]
peak = max(s.get("peak_bytes", 0) for s in steps) / 2**30
pred = (steps[-1].get("predicted_peak_bytes") or 0) / 2**30
loss = steps[-1]["loss"]
print(f"median tok/s {tps[len(tps) // 2]:.0f}, loss {loss:.3f}, peak {peak:.2f} GiB, predicted {pred:.2f} GiB")
EOF
}
for f in none "$freeze"; do
    "$upipe" train "${common[@]}" --steps 4 --freeze "$f" --json > "$work/speed.log" 2>&1
    row "--freeze $f: $(speed "$work/speed.log")"
done

exit $status
