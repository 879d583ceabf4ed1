#!/usr/bin/env bash
# Kills a training run with SIGKILL at random moments (most of its steps
# save a checkpoint) and resumes it, N times; counts the resumed runs whose
# final weights are byte-identical to a run never interrupted.
# Usage: scripts/kill_resume_probe.sh [N] [path/to/upipe]
set -euo pipefail
n=${1:-30}
upipe=${2:-target/release/upipe}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run=(train --device cpu --seq 64 --warmup 0 --steps 12 --save-every 1)
"$upipe" "${run[@]}" --save-dir "$work/whole" >/dev/null 2>&1
exact=0
for i in $(seq 1 "$n"); do
    dir="$work/killed-$i"
    "$upipe" "${run[@]}" --save-dir "$dir" >/dev/null 2>&1 &
    pid=$!
    sleep "0.$(printf '%03d' $((RANDOM % 1000)))"
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    "$upipe" "${run[@]}" --save-dir "$dir" --resume >/dev/null 2>&1
    if cmp -s "$dir/model.safetensors" "$work/whole/model.safetensors" &&
        cmp -s "$dir/optimizer.safetensors" "$work/whole/optimizer.safetensors"; then
        exact=$((exact + 1))
    fi
done
echo "kill -9 at random moments, then --resume: $exact of $n byte-identical to the uninterrupted run"
[ "$exact" -eq "$n" ]
