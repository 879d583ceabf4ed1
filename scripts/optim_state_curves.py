"""Loss curves of the runs scripts/gpu-optim-state.sh writes, one SVG.

    python3 scripts/optim_state_curves.py OUT.svg RUN.jsonl... [--by WHAT] [--model NAME]

Each run's training loss (a 10-step moving mean) against the step, named
by its file (`8bit-none.jsonl` -> `8bit/none` for the default WHAT, the
file's name otherwise); the title names the model (NAME, default
"Llama 3.2 1B") and what the runs differ by (WHAT, default "optimizer
state (moments/master)", e.g. "precision of the linear layers"). No
dependencies.
"""

import json
import sys


def losses(path):
    out = []
    for line in open(path, errors="replace"):
        try:
            j = json.loads(line)
        except ValueError:
            continue
        if "step" in j and j.get("lr") is not None:
            out.append((j["step"], j["loss"]))
    return out


def smooth(points, k=10):
    out = []
    for i in range(len(points)):
        window = points[max(0, i - k + 1): i + 1]
        out.append((points[i][0], sum(v for _, v in window) / len(window)))
    return out


def option(args, name, default):
    """Removes `name VALUE` from args; VALUE, or default where absent."""
    if name not in args:
        return default
    k = args.index(name)
    if k + 1 == len(args):
        sys.exit(f"{name} needs a value, e.g. {name} 'precision'")
    value = args[k + 1]
    del args[k:k + 2]
    return value


def label(path, by_state):
    name = path.rsplit("/", 1)[-1][: -len(".jsonl")]
    return name.replace("-", "/", 1) if by_state else name


def main():
    args = sys.argv[1:]
    state = "optimizer state (moments/master)"
    by = option(args, "--by", state)
    model = option(args, "--model", "Llama 3.2 1B")
    dest, runs = args[0], args[1:]
    colors = ["#1b6ca8", "#d1495b", "#edae49", "#00798c", "#6a4c93", "#3d3d3d"]
    w, h, left, top, right, bottom = 760, 420, 60, 40, 170, 50
    curves = [(label(p, by == state), smooth(losses(p))) for p in runs]
    steps = max(s for _, c in curves for s, _ in c)
    lo = min(v for _, c in curves for _, v in c[20:])
    hi = max(v for _, c in curves for _, v in c[20:])
    x = lambda s: left + (w - left - right) * (s - 1) / max(1, steps - 1)
    y = lambda v: top + (h - top - bottom) * (hi - min(max(v, lo), hi)) / (hi - lo)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{model}, 300 steps of 4,096 tokens: training loss (10-step mean) by {by}</text>']
    for k in range(6):
        v = lo + (hi - lo) * k / 5
        svg.append(f'<line x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        svg.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for s in range(0, steps + 1, 50):
        svg.append(f'<text x="{x(max(s, 1)):.1f}" y="{h - bottom + 18}" text-anchor="middle">{s}</text>')
    svg.append(f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">step</text>')
    for i, (name, c) in enumerate(curves):
        color = colors[i % len(colors)]
        pts = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in c if s >= 20)
        svg.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>')
        final = sum(v for _, v in losses(runs[i])[-20:]) / 20
        ly = top + 18 * i
        svg.append(f'<line x1="{w - right + 10}" x2="{w - right + 30}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        svg.append(f'<text x="{w - right + 36}" y="{ly + 4}">{name} {final:.3f}</text>')
    svg.append("</svg>")
    open(dest, "w").write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
