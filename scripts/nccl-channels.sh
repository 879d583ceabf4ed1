#!/usr/bin/env bash
# NCCL point-to-point channels against the all-to-all time of the Llama3-8B
# attention layer at 128K on 2 GPUs (Ulysses and UPipe U=2, one profiled
# pass each): for each variant of the NCCL channel variables, rank 0's
# all-to-all time and calls per pass, wall time and TF/s per GPU.
#   bash DIR/nccl-channels.sh   (DIR holds bin/upipe; OUT = folder for logs)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-/tmp}"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=/tmp/upipe-kernels
L=("$here/bin/upipe" launch --nproc-per-node 2 --master-port 29541 -- bench attn --device cuda --json)
layer=(--hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --ulysses 2 --chunk-heads 2 --warmup 1 --iters 1 --seq ${SEQ:-131072} --methods ulysses,upipe)
i=0
for v in ${VARIANTS:-"default" "NCCL_NCHANNELS_PER_PEER=8" "NCCL_NCHANNELS_PER_PEER=16" "NCCL_NCHANNELS_PER_PEER=32,NCCL_MIN_P2P_NCHANNELS=32"}; do
  i=$((i+1)); log="$out/nccl_channels_$i.log"
  envs=(); [ "$v" != default ] && IFS=, read -ra envs <<< "$v"
  env "${envs[@]}" NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING UPIPE_PROFILE=shapes timeout 120 "${L[@]}" "${layer[@]}" > "$log" 2>&1
  echo "## $v rc=$?"
  grep -a -m2 -E "p2p channels per peer|P2P Chunksize" "$log" | sed 's/.*NCCL INFO //' | cut -c1-160
  python3 - "$log" <<'PY'
import json, sys
for line in open(sys.argv[1], errors="replace"):
    line = line.split("] ", 1)[1] if line.startswith("[rank") else line
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if "tflops_per_gpu" in r:
        print(f"  {r['method']:8s} {r['tflops_per_gpu']:.1f} TF/s/GPU  pass {1e3*r['seconds']:.1f} ms")
    if "profile_by_shape" in r:
        a2a = [x for x in r["profile_by_shape"] if x["op"].startswith("all_to_all")]
        ops = r.get("profile_ms_per_pass", {})
        print(f"  {r['method']:8s} all_to_all {ops.get('all_to_all', 0):.2f} ms per pass, {sum(x['calls'] for x in a2a)} calls; attention fwd {ops.get('attention_fwd', 0):.1f} bwd {ops.get('attention_bwd', 0):.1f} ms")
PY
done
