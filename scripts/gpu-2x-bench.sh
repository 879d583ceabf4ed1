#!/usr/bin/env bash
# Two-GPU run of everything GPU-side: library report, GPU tests, kernel
# benchmark (native flash vs auto = cuDNN), a correctness check of every
# strategy over NCCL, and the Llama3-8B attention layer (hidden 4096, H 32,
# Hkv 8, d 128) at 128K-1M for Ulysses and UPipe, overlap off and on, with
# a per-op GPU time profile at 128K.
#
#   scripts/gpu-check.sh build DIR        # here: binaries into DIR
#   cp scripts/gpu-2x-bench.sh DIR/       # and this script
#   BUDGET=400 bash DIR/gpu-2x-bench.sh   # on a 2-GPU machine
#   (PARTS="tests profile long" TESTS="gpu_nccl" ... runs a subset)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/bin"
out="${OUT:-/tmp/upipe-2x}"; mkdir -p "$out/logs"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 UPIPE_KERNEL_CACHE=/tmp/upipe-kernels
# CUDNN_PIP=1: torch's pip cuDNN (9.19 on our machine) instead of the system's
# 9.14; cudarc binds `libcudnn.so` by name, so a link to the pip file goes first
if [ "${CUDNN_PIP:-0}" = 1 ]; then
  pip_cudnn=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cudnn/lib
  mkdir -p /tmp/cudnn-link && ln -sf "$pip_cudnn/libcudnn.so.9" /tmp/cudnn-link/libcudnn.so
  export UPIPE_CUDNN_LIB="$pip_cudnn/libcudnn.so.9"
  export LD_LIBRARY_PATH=/tmp/cudnn-link:$pip_cudnn:$LD_LIBRARY_PATH
fi
T0=$(date +%s)
# PARTS picks what runs (default all but settle1 and rounds): kernel tests
# check profile long perf tune settle; settle1 is the one-GPU version of
# settle; rounds alternates Ulysses and UPipe (ROUNDS=4 rounds); ce compares
# copy-engine exchanges (CE_MB, CE_REPS, SEQS); ab compares an old build
# (bin/upipe-old) with this one, abprofile profiles both; power
# samples clocks and power under each; pins measures the peaks tests/integration/plan.rs pins
want() { [[ " ${PARTS:-kernel tests check profile long perf tune settle} " == *" $1 "* ]]; }
left() { echo $(( ${BUDGET:-400} - ($(date +%s) - T0) )); }
step() { # name timeout cmd...
  local name=$1 lim=$2; shift 2
  local l; l=$(left); [ "$l" -lt 15 ] && { echo "SKIP $name (time)"; return; }
  [ "$lim" -gt "$l" ] && lim=$l
  local s; s=$(date +%s%N)
  timeout -k 5 "$lim" "$@" > "$out/logs/$name.log" 2>&1; local rc=$?
  echo "## $name rc=$rc $(( ($(date +%s%N)-s)/1000000 ))ms"
  grep -a '"method"' "$out/logs/$name.log" | sed 's/^\[rank 0\] //' | cut -c1-600
  [ $rc -ne 0 ] && grep -a -iE "error|panick|FAILED" "$out/logs/$name.log" | head -4 | cut -c1-300
}
{ date -u; nvidia-smi -L
  nvidia-smi --query-gpu=index,power.limit,power.max_limit,clocks.max.sm,temperature.gpu --format=csv
} | tee "$out/logs/machine.txt"
"$bin/upipe" info 2>&1 | tail -9
# native flash kernels alone (one GPU): every case against a CPU reference, then speed
want kernel && step flash_check 120 "$bin/flash_check" check bench
want kernel && grep -a -E "ALL PASS|FAIL|^\| (mma|wgmma) \|" "$out/logs/flash_check.log" | head -12
want tests && for t in ${TESTS:-gpu_backend gpu_layer gpu_nccl gpu_plan gpu_train}; do
  step "test_$t" 100 "$bin/test-$t" --test-threads=2 --nocapture
  grep -a -E "test result|^gpu |cuDNN [0-9(]|forward on cuDNN|FAILED|panicked" "$out/logs/test_$t.log" | cut -c1-300 | head -40
done
L=("$bin/upipe" launch --nproc-per-node 2 --master-port 29531 -- bench attn --device cuda --json)
small=(--hidden 512 --heads 32 --kv-heads 8 --head-dim 128 --seq 1024 --check --warmup 0 --iters 1)
want check && step check_2x1 90 "${L[@]}" "${small[@]}" --ulysses 2 --methods ulysses,ring,usp,upipe --chunk-heads 2
want check && step check_2x1_overlap 60 "${L[@]}" "${small[@]}" --ulysses 2 --methods upipe --chunk-heads 2 --overlap
want check && step check_2x1_fwd16 60 "${L[@]}" "${small[@]}" --ulysses 2 --methods upipe --chunk-heads 2 --fwd-chunk-heads 16
want check && step check_2x1_settle_phase 60 "${L[@]}" "${small[@]}" --ulysses 2 --methods upipe --chunk-heads 2 --settle-every phase
# a plain run (no launcher) starts its 2 processes by itself
want check && step check_self_launch 60 "$bin/upipe" bench attn --device cuda --json "${small[@]}" --ulysses 2 --methods ulysses,upipe --chunk-heads 2
llama=(--hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 --warmup 1)
uly=(--ulysses 2)
# where the time goes: rank 0's GPU time by op (events add a little overhead)
# (by op shape: the costliest GEMM / copy / exchange shapes of each method)
want profile && UPIPE_PROFILE=shapes step profile_131072 90 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 131072 --methods ulysses,upipe --chunk-heads ${CHUNK:-2} ${FWD:+--fwd-chunk-heads $FWD}
want profile && UPIPE_PROFILE=shapes step profile_131072_overlap 90 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 131072 --methods upipe --chunk-heads 2 --overlap
# 512K and 1M first: the lengths not measured yet
want long && step perf_524288 150 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 524288 --methods ulysses,upipe --chunk-heads 2
want long && step perf_1048576 240 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 1048576 --methods ulysses,upipe --chunk-heads 2
# the longest lengths again (PARTS=long2: run with CUDNN_PIP=1 to compare cuDNN versions)
want long2 && step perf_524288 150 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 524288 --methods ulysses,upipe --chunk-heads 2
# overlap variants and U=4 without overlap (PARTS=tune)
want tune && step perf_131072_U2_overlap 120 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --seq 131072 --methods ulysses,upipe --chunk-heads 2 --overlap
want tune && NCCL_MAX_CTAS=4 step perf_131072_U2_overlap_cta4 120 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --seq 131072 --methods upipe --chunk-heads 2 --overlap
want tune && step perf_131072_U4 120 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --seq 131072 --methods upipe --chunk-heads 4
want tune && step perf_262144_U4 120 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --seq 262144 --methods upipe --chunk-heads 4
want perf && for s in 131072 262144; do
  step "perf_${s}" 150 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --seq $s --methods ulysses,upipe --chunk-heads 2
  step "perf_${s}_U2_overlap" 120 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --seq $s --methods upipe --chunk-heads 2 --overlap
  step "perf_${s}_U4_overlap" 120 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --seq $s --methods upipe --chunk-heads 4 --overlap
done
# query gradients settled every stage, every 2 stages (default) and per kv
# phase, in one run (PARTS=settle)
want settle && for s in 131072 262144; do
  step "perf_${s}" 150 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --seq $s --methods ulysses,upipe --chunk-heads 2
  for e in stage phase; do
    step "perf_${s}_${e}" 120 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --seq $s --methods upipe --chunk-heads 2 --settle-every $e
  done
done
want settle && UPIPE_PROFILE=shapes step profile_131072_settle 90 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 131072 --methods upipe --chunk-heads 2
# the same on one GPU (PARTS=settle1): the staged engine with Pu 1, so the
# stages' compute alone (U=1: one head per stage, 4 stages per kv phase, as
# each rank of UPipe U=2 on 2 GPUs)
one=("$bin/upipe" bench attn --device cuda --json --ulysses 1)
want settle1 && for s in 65536 131072; do
  step "one_${s}" 150 "${one[@]}" "${llama[@]}" --iters 2 --seq $s --methods ulysses,upipe --chunk-heads 1
  for e in stage phase; do
    step "one_${s}_${e}" 120 "${one[@]}" "${llama[@]}" --iters 2 --seq $s --methods upipe --chunk-heads 1 --settle-every $e
  done
done
want settle1 && UPIPE_PROFILE=shapes step one_profile_65536 90 "${one[@]}" "${llama[@]}" --iters 1 --seq 65536 --methods upipe --chunk-heads 1
# Ulysses and UPipe in alternating rounds (A B B A ...: a clock drift over the
# run weighs on both alike), the default settle and per phase (PARTS=rounds)
# (SEQS, SETTLES, CHUNK=U and FWDS = forward stage sizes, "-" for the default auto, pick the rows)
want rounds && for s in ${SEQS:-131072 262144}; do
  for e in ${SETTLES:-2 phase}; do
    for f in ${FWDS:--}; do
      fw=(); [ "$f" != - ] && fw=(--fwd-chunk-heads "$f")
      step "rounds_${s}_U${CHUNK:-2}f${f}_${e}" 150 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --rounds ${ROUNDS:-4} --seq $s --methods ulysses,upipe --chunk-heads ${CHUNK:-2} --settle-every $e "${fw[@]}"
    done
  done
done
# copy-engine exchanges (PARTS=ce): the same layer in separate processes
# without and with the exchange window (UPIPE_CE_EXCHANGE_MB=CE_MB), with
# and without overlap, alternating (CE_REPS times) on one machine; first a
# --check against the CPU layer through the window
want ce && {
  UPIPE_CE_EXCHANGE_MB=${CE_MB:-4096} NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT step ce_check 45 "${L[@]}" "${small[@]}" --ulysses 2 --methods ulysses,upipe --chunk-heads 2
  grep -a -m2 -E "Init CE|exchange window" "$out/logs/ce_check.log" | cut -c1-200
  UPIPE_CE_EXCHANGE_MB=${CE_MB:-4096} step ce_check_overlap 45 "${L[@]}" "${small[@]}" --ulysses 2 --methods upipe --chunk-heads 2 --overlap
  grep -a -q '"method":"upipe"' "$out/logs/ce_check.log" || echo "ce_check did not finish: no timed runs"
  grep -a -q '"method":"upipe"' "$out/logs/ce_check.log" && for r in $(seq ${CE_REPS:-2}); do
    for s in ${SEQS:-131072}; do
      step "ce_${s}_pool_$r" 100 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --rounds 2 --seq $s --methods ulysses,upipe --chunk-heads ${CHUNK:-2} --settle-every ${SETTLE:-2}
      UPIPE_CE_EXCHANGE_MB=${CE_MB:-4096} step "ce_${s}_window_$r" 100 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --rounds 2 --seq $s --methods ulysses,upipe --chunk-heads ${CHUNK:-2} --settle-every ${SETTLE:-2}
      UPIPE_CE_EXCHANGE_MB=${CE_MB:-4096} step "ce_${s}_window_overlap_$r" 100 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 2 --rounds 2 --seq $s --methods ulysses,upipe --chunk-heads ${CHUNK:-2} --settle-every ${SETTLE:-2} --overlap
    done
  done
  grep -a -h "exchange window" "$out"/logs/ce_*.log | sort | uniq -c | head -6
}
# an old build against this one (PARTS=ab; needs bin/upipe-old, e.g. the
# release binary of the commit before a change): separate processes in
# A B B A order (AB_REPS pairs), Ulysses and UPipe in each, SEQS lengths
want ab && [ ! -x "$bin/upipe-old" ] && echo "SKIP ab: no $bin/upipe-old"
want ab && [ -x "$bin/upipe-old" ] && for r in $(seq ${AB_REPS:-2}); do
  order="upipe-old upipe"; [ $((r % 2)) = 0 ] && order="upipe upipe-old"
  for s in ${SEQS:-131072}; do
    for b in $order; do
      step "ab_${s}_${b}_$r" 100 "$bin/$b" launch --nproc-per-node 2 --master-port 29531 -- bench attn --device cuda --json "${llama[@]}" "${uly[@]}" --iters 2 --rounds 2 --seq $s --methods ulysses,upipe --chunk-heads ${CHUNK:-2} --settle-every ${SETTLE:-2}
    done
  done
done
# and where their time goes: one profiled process per build (PARTS=abprofile,
# METHODS picks the strategies, UPipe by default)
want abprofile && [ -x "$bin/upipe-old" ] && for r in 1 2 3 4; do
  b=upipe; [ $((r % 2)) = 1 ] && b=upipe-old
  UPIPE_PROFILE=shapes step "abprofile_${r}_$b" 90 "$bin/$b" launch --nproc-per-node 2 --master-port 29531 -- bench attn --device cuda --json "${llama[@]}" "${uly[@]}" --iters 2 --seq ${SEQS:-131072} --methods ${METHODS:-upipe} --chunk-heads ${CHUNK:-2} --settle-every ${SETTLE:-2}
done
# the peaks tests/integration/plan.rs pins as measured (cuda_predictions_against_the_h200_ledger;
# PARTS=pins): 2 GPUs at 256K and 128K, one GPU at 64K and 128K
want pins && {
  one1=("$bin/upipe" bench attn --device cuda --json --ulysses 1 --iters 1)
  step pins_256K_uly_stage 120 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 262144 --methods ulysses,upipe --chunk-heads 2 --settle-every stage
  step pins_256K_overlap 90 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 262144 --methods upipe --chunk-heads 2 --settle-every stage --overlap
  for e in 2 phase; do
    step "pins_256K_$e" 90 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 262144 --methods upipe --chunk-heads 2 --settle-every $e
  done
  for e in stage 2 phase; do
    step "pins_128K_$e" 60 "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 1 --seq 131072 --methods upipe --chunk-heads 2 --settle-every $e
  done
  step pins_one_64K_U32 60 "${one1[@]}" "${llama[@]}" --seq 65536 --methods upipe --chunk-heads 32 --settle-every stage
  for s in 65536 131072; do
    for e in stage phase; do
      step "pins_one_${s}_U1_$e" 60 "${one1[@]}" "${llama[@]}" --seq $s --methods upipe --chunk-heads 1 --settle-every $e
    done
  done
}
# clocks and power under each strategy alone, 8 passes at 128K (PARTS=power;
# needs power-sample.sh next to this script)
want power && for m in ulysses upipe; do
  step "power_131072_$m" 90 bash "$here/power-sample.sh" "$m" "${L[@]}" "${llama[@]}" "${uly[@]}" --iters 8 --seq 131072 --methods $m --chunk-heads 2
  grep -a "^power " "$out/logs/power_131072_$m.log"
done
# ring (and usp = ulysses on one node) at 128K, K/V passes overlapped with attention
want perf && step perf_131072_ring 150 "${L[@]}" "${llama[@]}" --iters 2 --seq 131072 --ulysses 1 --ring 2 --methods ring
echo "total $(( $(date +%s) - T0 ))s"
tar -C "$out" -czf "$out/logs.tgz" logs && rm -rf "$out/logs"
