#!/usr/bin/env python3
"""Loss curves of several runs in one SVG, from train's --metrics files (JSON lines).

  python3 tools/loss_curves.py OUT.svg LABEL=run.jsonl [LABEL=run.jsonl ...] [--smooth N] [--title T]

Each curve is the loss averaged over a sliding window of N steps (default 50); the legend gives each run's
mean loss over its last N steps and its difference from the first run's. Standard library only.
"""
import json
import sys


def load(path):
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                r = json.loads(line)
                if "loss" in r:
                    out.append(float(r["loss"]))
    if not out:
        raise SystemExit("%s: no loss lines" % path)
    return out


def smooth(xs, n):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= n:
            acc -= xs[i - n]
        out.append(acc / min(i + 1, n))
    return out


def main(argv):
    n, title, runs, out = 50, "loss", [], None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--smooth":
            n = int(argv[i + 1]); i += 2; continue
        if a == "--title":
            title = argv[i + 1]; i += 2; continue
        if out is None:
            out = a
        elif "=" in a:
            label, path = a.split("=", 1)
            runs.append((label, load(path)))
        else:
            raise SystemExit("expected LABEL=FILE, got %r" % a)
        i += 1
    if out is None or not runs or n < 1:
        raise SystemExit(__doc__)
    curves = [(label, smooth(xs, n), sum(xs[-n:]) / len(xs[-n:])) for label, xs in runs]
    steps = max(len(c) for _, c, _ in curves)
    skip = min(steps - 1, n)   # the first window is mostly the initial drop: start the y range after it
    lo = min(min(c[skip:] or c) for _, c, _ in curves)
    hi = max(max(c[skip:] or c) for _, c, _ in curves)
    hi, lo = hi + 0.02 * (hi - lo + 1e-9), lo - 0.02 * (hi - lo + 1e-9)
    W, H, L, R, T, B = 900, 520, 70, 20, 40, 60
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"]
    px = lambda s: L + (W - L - R) * s / max(steps - 1, 1)
    py = lambda v: T + (H - T - B) * (hi - min(max(v, lo), hi)) / (hi - lo)
    svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">' % (W, H),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="22" font-size="15">%s (mean over %d steps)</text>' % (L, title, n)]
    for k in range(6):
        v = lo + (hi - lo) * k / 5
        svg.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/><text x="%d" y="%.1f" text-anchor="end">%.3f</text>'
                   % (L, W - R, py(v), py(v), L - 6, py(v) + 4, v))
    for k in range(6):
        s = (steps - 1) * k / 5
        svg.append('<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (px(s), H - B + 18, round(s)))
    svg.append('<text x="%d" y="%d" text-anchor="middle">step</text>' % ((W + L) // 2, H - B + 36))
    base = curves[0][2]
    for j, (label, c, last) in enumerate(curves):
        col = colors[j % len(colors)]
        every = max(1, steps // 400)   # at most ~400 points a curve
        pts = " ".join("%.1f,%.1f" % (px(s), py(v)) for s, v in enumerate(c)
                       if (s >= skip or len(c) <= skip) and (s % every == 0 or s == len(c) - 1))
        svg.append('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>' % (col, pts))
        note = "" if j == 0 else " (%+.2f%%)" % (100 * (last / base - 1))
        y = T + 16 + 18 * j
        svg.append('<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="3"/><text x="%d" y="%d">%s: last %d steps %.4f%s</text>'
                   % (W - R - 330, W - R - 305, y - 4, y - 4, col, W - R - 298, y, label, n, last, note))
    svg.append("</svg>")
    with open(out, "w") as f:
        f.write("\n".join(svg) + "\n")
    for label, _, last in curves:
        print("%-12s last %d steps: %.5f (%+.2f%%)" % (label, n, last, 100 * (last / base - 1)))


if __name__ == "__main__":
    main(sys.argv[1:])
