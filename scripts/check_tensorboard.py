#!/usr/bin/env python3
"""Reads the event files `upipe train --tensorboard DIR` wrote with
TensorBoard's own reader and checks that every scalar tag has one value at
every step of the run: PASS or FAIL per tag, exit status 1 on any FAIL.

    pip install tensorboard
    upipe train --steps 20 --metrics m.jsonl --tensorboard tb
    python3 scripts/check_tensorboard.py tb [m.jsonl]

With the metrics file, the steps to expect are its lines' steps, and the
loss, lr and grad_norm must equal the lines' (as float32); without it, the
steps 1..N of the longest tag.
"""

import json
import math
import sys

from tensorboard.backend.event_processing import event_accumulator

# tags every training step carries (more may follow: profile/..., eval ...)
REQUIRED = [
    "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "tflops",
    "tflops_per_rank", "peak_gib", "peak_by_category_gib/weights",
    "peak_by_category_gib/activations",
]
SAME_AS_LINE = ["loss", "lr", "grad_norm"]


def f32(x):
    import struct
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        return 2
    acc = event_accumulator.EventAccumulator(
        sys.argv[1], size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    lines = []
    if len(sys.argv) == 3:
        with open(sys.argv[2]) as f:
            lines = [json.loads(l) for l in f if l.strip()]
    series = {t: acc.Scalars(t) for t in tags}
    if lines:
        steps = [l["step"] for l in lines]
    else:
        n = max((len(s) for s in series.values()), default=0)
        steps = list(range(1, n + 1))
    failed = 0
    for tag in sorted(set(tags) | set(REQUIRED)):
        got = series.get(tag, [])
        got_steps = [e.step for e in got]
        why = None
        if tag not in series:
            why = "missing"
        elif got_steps != steps:
            why = f"steps {got_steps}, expected {steps}"
        elif lines and tag in SAME_AS_LINE:
            for e, l in zip(got, lines):
                want = l.get(tag)
                if want is None or not math.isclose(e.value, f32(want), rel_tol=1e-6):
                    why = f"step {e.step}: {e.value} against the metrics line's {want}"
                    break
        if why:
            failed += 1
            print(f"FAIL {tag}: {why}")
        else:
            print(f"PASS {tag} ({len(got)} steps)")
    print(f"{len(tags)} tags, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
