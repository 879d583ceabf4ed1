#!/usr/bin/env bash
# Runs a command while nvidia-smi samples every GPU each 100 ms, then prints
# per GPU over the busy samples (power above 200 W): how many, mean SM clock,
# mean power, and the share with the software power cap active (clock event
# reason bit 0x4).
#   bash scripts/power-sample.sh LABEL CMD...   (OUT = folder for the raw samples)
set -u
label=$1; shift
out="${OUT:-/tmp}"; raw="$out/power_$label.csv"
nvidia-smi --query-gpu=index,clocks.sm,power.draw,clocks_throttle_reasons.active \
  --format=csv,noheader,nounits -lms 100 > "$raw" 2>/dev/null &
sampler=$!
"$@"; rc=$?
kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
awk -F', *' -v label="$label" '
  $3 > 200 { n[$1]++; clk[$1] += $2; pw[$1] += $3; if (substr($4, length($4), 1) ~ /[4-7c-fC-F]/) cap[$1]++ }
  END { for (g in n) printf "power %s gpu %s: %d busy samples, SM clock %.0f MHz, power %.0f W, power cap active %.0f%%\n",
        label, g, n[g], clk[g] / n[g], pw[g] / n[g], 100 * cap[g] / n[g] }' "$raw"
exit $rc
