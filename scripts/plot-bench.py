#!/usr/bin/env python3
"""Plot `k3decode bench --json` records: step time and floor against rows, both steps.

usage: scripts/plot-bench.py OUT.svg BENCH.json [BENCH.json ...]

One panel per (variant, q): median step time of the stock and the hybrid step
(points joined by lines), and the floor (bytes touched / measured HBM read
bandwidth, dashed), in milliseconds against rows per step (log scale). The
output is SVG written with the standard library only, so it runs anywhere the
JSON is (no plotting package needed).
"""
import json
import math
import sys
from collections import defaultdict

W, H = 460, 320  # one panel
ML, MR, MT, MB = 64, 16, 36, 46  # margins
COLORS = {"stock": "#c0392b", "hybrid": "#2471a3", "hybrid-tp": "#1e8449", "floor-tp": "#58d68d",
          "floor": "#555555"}


def esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def nice_ticks(lo, hi, n=5):
    span = hi - lo
    if span <= 0:
        return [lo]
    step = 10 ** math.floor(math.log10(span / n))
    for m in (1, 2, 5, 10):
        if span / (step * m) <= n:
            step *= m
            break
    t = math.ceil(lo / step) * step
    out = []
    while t <= hi + 1e-9:
        out.append(round(t, 10))
        t += step
    return out


def panel(x0, y0, title, series, floor):
    """series: {step: [(rows, ms)]}; floor: [(rows, ms)]. Returns SVG elements."""
    pts = [p for s in series.values() for p in s] + floor
    rows = sorted({p[0] for p in pts})
    xmin, xmax = math.log2(min(rows)), math.log2(max(rows))
    if xmax == xmin:
        xmax = xmin + 1
    ymax = max(p[1] for p in pts) * 1.08
    pw, ph = W - ML - MR, H - MT - MB

    def X(r):
        return x0 + ML + (math.log2(r) - xmin) / (xmax - xmin) * pw

    def Y(v):
        return y0 + MT + ph - v / ymax * ph

    e = [f'<text x="{x0 + W / 2}" y="{y0 + 20}" text-anchor="middle" font-size="14">{esc(title)}</text>',
         f'<rect x="{x0 + ML}" y="{y0 + MT}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for t in nice_ticks(0, ymax):
        e.append(f'<line x1="{x0 + ML}" x2="{x0 + ML + pw}" y1="{Y(t):.1f}" y2="{Y(t):.1f}" stroke="#eee"/>')
        e.append(f'<text x="{x0 + ML - 6}" y="{Y(t) + 4:.1f}" text-anchor="end" font-size="11">{t:g}</text>')
    for r in rows:
        e.append(f'<text x="{X(r):.1f}" y="{y0 + MT + ph + 16}" text-anchor="middle" font-size="11">{r}</text>')
    e.append(f'<text x="{x0 + ML + pw / 2}" y="{y0 + H - 8}" text-anchor="middle" font-size="12">rows per step</text>')
    e.append(f'<text x="{x0 + 14}" y="{y0 + MT + ph / 2}" text-anchor="middle" font-size="12" '
             f'transform="rotate(-90 {x0 + 14} {y0 + MT + ph / 2})">ms per step</text>')

    def line(points, color, dash=""):
        points = sorted(points)
        d = " ".join(f"{X(r):.1f},{Y(v):.1f}" for r, v in points)
        out = [f'<polyline points="{d}" fill="none" stroke="{color}" stroke-width="2" {dash}/>']
        out += [f'<circle cx="{X(r):.1f}" cy="{Y(v):.1f}" r="3" fill="{color}"/>' for r, v in points]
        return out

    for step, p in sorted(series.items()):
        e += line(p, COLORS.get(step, "#000"))
    e += line(floor, COLORS["floor"], 'stroke-dasharray="6 4"')
    ly = y0 + MT + 8
    for i, name in enumerate(sorted(series) + ["floor"]):
        e.append(f'<line x1="{x0 + ML + 10}" x2="{x0 + ML + 34}" y1="{ly + 16 * i}" y2="{ly + 16 * i}" '
                 f'stroke="{COLORS.get(name, "#000")}" stroke-width="2"/>')
        e.append(f'<text x="{x0 + ML + 40}" y="{ly + 16 * i + 4}" font-size="11">{esc(name)}</text>')
    return e


def main(argv):
    if len(argv) < 3 or not argv[1].endswith(".svg"):
        sys.exit(__doc__)
    recs = []
    for path in argv[2:]:
        with open(path) as f:
            recs += json.load(f)
    if not recs:
        sys.exit("plot-bench: no records in " + " ".join(argv[2:]))
    groups = defaultdict(lambda: (defaultdict(list), {}))
    for r in recs:
        for key in ("variant", "q", "step", "rows", "median_us", "floor_us"):
            if key not in r:
                sys.exit(f"plot-bench: a record lacks '{key}' (not k3decode bench --json output?)")
        series, floor = groups[(r["variant"], r["q"])]
        # The hybrid step with TP-sharded shared experts has its own (lower) floor: both drawn as series.
        tp = r.get("shared_experts") == "tp"
        series[r["step"] + ("-tp" if tp else "")].append((r["rows"], r["median_us"] / 1e3))
        if tp:
            series["floor-tp"].append((r["rows"], r["floor_us"] / 1e3))
        else:
            floor[r["rows"]] = r["floor_us"] / 1e3
    keys = sorted(groups)
    cols = min(2, len(keys))
    nrows = (len(keys) + cols - 1) // cols
    commit = sorted({str(r.get("commit", "")) for r in recs})
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * W}" height="{nrows * H + 24}" '
           f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="8" y="{nrows * H + 16}" font-size="11" fill="#555">k3decode bench, commit '
           f'{esc(", ".join(commit))}; floor = bytes touched / measured HBM read bandwidth</text>']
    for i, (variant, q) in enumerate(keys):
        series, floor = groups[(variant, q)]
        ctx = {r["context"] for r in recs if r["variant"] == variant and r["q"] == q}
        title = f"{variant}, q = {q}, context {', '.join(map(str, sorted(ctx)))}"
        svg += panel((i % cols) * W, (i // cols) * H, title, series, sorted(floor.items()))
    svg.append("</svg>")
    with open(argv[1], "w") as f:
        f.write("\n".join(svg) + "\n")
    print(f"wrote {argv[1]} ({len(recs)} records, {len(keys)} panels)")


if __name__ == "__main__":
    main(sys.argv)
