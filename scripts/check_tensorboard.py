#!/usr/bin/env python3
"""Reads the event files `upipe train --tensorboard DIR` wrote with
TensorBoard's own reader and checks that every scalar tag has one value at
every step of the run: PASS or FAIL per tag, exit status 1 on any FAIL.

    pip install tensorboard
    upipe train --steps 20 --metrics m.jsonl --tensorboard tb
    python3 scripts/check_tensorboard.py tb [m.jsonl]

With the metrics file, a tag's steps must be those of the lines that carry
its value (a key only some lines have, such as an evaluation's, is expected
at those steps only), and every value must equal the line's (as float32;
bytes in GiB); without it, every tag must have the steps 1..N of the
longest.
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
GIB = float(1 << 30)


def f32(x):
    import struct
    return struct.unpack("<f", struct.pack("<f", x))[0]


def expected(line, tag):
    """What metrics line `line` says scalar `tag` is (None: not there)."""
    if "/" in tag:
        group, name = tag.split("/", 1)
        if group.endswith("_gib"):
            v = (line.get(group[:-4]) or {}).get(name)
            return None if v is None else v / GIB
        return (line.get(group) or {}).get(name)
    if tag.endswith("_gib"):
        v = line.get(tag[:-4] + "_bytes")
        return None if v is None else v / GIB
    return line.get(tag)


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
    n = max((len(s) for s in series.values()), default=0)
    failed = 0
    for tag in sorted(set(tags) | set(REQUIRED)):
        got = series.get(tag, [])
        got_steps = [e.step for e in got]
        carrying = [l for l in lines if expected(l, tag) is not None]
        steps = [l["step"] for l in carrying] if lines else list(range(1, n + 1))
        why = None
        if tag not in series:
            why = "missing"
        elif got_steps != steps:
            why = f"steps {got_steps}, expected {steps}"
        else:
            for e, l in zip(got, carrying):
                want = f32(expected(l, tag))
                if not math.isclose(e.value, want, rel_tol=1e-6, abs_tol=1e-30):
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
