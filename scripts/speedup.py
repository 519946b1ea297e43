#!/usr/bin/env python3
"""The issue's speedup table: a baseline build's rank-slice points against a newer build's.

usage: scripts/speedup.py --base BENCH.json [...] --new BENCH.json [...]
                          [--base-commit C] [--new-commit C] [--hybrid-base MODE] [--hybrid-new MODE]
                          [--hybrid-bar X] [--stock-bar X] [--json OUT]

BENCH.json is what `k3decode bench --json` writes (a list of points; scripts/gpu-test.sh and
scripts/device-ab.sh keep them), or a file of several commits' points such as
docs/perf/speedup_483d708_h100.json, from which --base-commit / --new-commit pick each side.
A point is (variant, step, B = requests, q); several runs of one point (device-ab.sh's
repetitions) count as the median of their medians.

The hybrid step is compared across its modes: by default the baseline's seed hybrid step
(replicated shared experts; a point without "shared_experts", from builds before the TP-sharded
mode, is that one) against the new build's default hybrid step (--shared-experts tp);
--hybrid-base / --hybrid-new pick other modes (tp or replicated). Stock is compared with stock.

Prints a markdown table (ms, ratio to the floor, speedup = base median / new median) and, per
step, the range of speedups and how many points reach the bar (the issue's: hybrid 1.5x, stock
1.25x). Warns when the two sides do not look like one GPU and one workload (HBM bandwidth 5%
apart, other layer copies, another machine name). --json writes one record per compared point.
Exit status 1 for a file that cannot be read or a point without the fields above, 2 when the
two sides share no point. Standard library only.
"""
import argparse
import json
import statistics
import sys

KEYS = ("variant", "step", "requests", "q", "median_us")


def fail(msg, code=1):
    print(f"speedup.py: {msg}", file=sys.stderr)
    sys.exit(code)


def load(paths, commit, side):
    pts = []
    for p in paths:
        try:
            with open(p) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            fail(f"{side} file {p}: {e}")
        if not isinstance(data, list):
            fail(f"{side} file {p}: expected a list of bench points, got {type(data).__name__}")
        for i, x in enumerate(data):
            if not isinstance(x, dict):
                fail(f"{side} file {p}: point {i} is not an object")
            missing = [k for k in KEYS if k not in x]
            if missing:
                fail(f"{side} file {p}: point {i} has no {', '.join(missing)}")
            if commit is not None and str(x.get("commit")) != commit:
                continue
            pts.append(x)
    if not pts:
        fail(f"{side}: no points" + (f" of commit {commit}" if commit else ""), 2)
    return pts


def mode(x):
    """The point's step mode: stock, or hybrid-<shared experts> (a hybrid point without the field: replicated)."""
    if x["step"] == "hybrid":
        return "hybrid-" + (x.get("shared_experts") or "replicated")
    return x["step"]


def gather(pts, hybrid_mode):
    """{(variant, step, B, q): [points]} for stock and the chosen hybrid mode."""
    out = {}
    for x in pts:
        m = mode(x)
        if m == "stock":
            step = "stock"
        elif m == "hybrid-" + hybrid_mode:
            step = "hybrid"
        else:
            continue
        out.setdefault((x["variant"], step, int(x["requests"]), int(x["q"])), []).append(x)
    return out


def med(xs, field):
    vals = [float(x[field]) for x in xs if x.get(field) is not None]
    return statistics.median(vals) if vals else None


def cell(xs):
    us, ratio = med(xs, "median_us"), med(xs, "ratio")
    return f"{us / 1000:.2f}" + (f" ({ratio:.2f})" if ratio is not None else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", nargs="+", required=True)
    ap.add_argument("--new", nargs="+", required=True)
    ap.add_argument("--base-commit")
    ap.add_argument("--new-commit")
    ap.add_argument("--hybrid-base", choices=["replicated", "tp"], default="replicated")
    ap.add_argument("--hybrid-new", choices=["replicated", "tp"], default="tp")
    ap.add_argument("--hybrid-bar", type=float, default=1.5)
    ap.add_argument("--stock-bar", type=float, default=1.25)
    ap.add_argument("--json")
    a = ap.parse_args()

    base_pts, new_pts = load(a.base, a.base_commit, "base"), load(a.new, a.new_commit, "new")
    base, new = gather(base_pts, a.hybrid_base), gather(new_pts, a.hybrid_new)
    keys = sorted(set(base) & set(new), key=lambda k: (k[0], k[3], k[2], k[1]))
    if not keys:
        fail("the two sides share no (variant, step, B, q) point", 2)

    # Like with like: one GPU class and one workload on both sides.
    bw = [med(base_pts, "hbm_gbps"), med(new_pts, "hbm_gbps")]
    if None not in bw and abs(bw[0] / bw[1] - 1) > 0.05:
        print(f"warning: HBM read bandwidth {bw[0]:.0f} (base) vs {bw[1]:.0f} GB/s (new): not one GPU class?")
    for field in ("layer_copies", "machine", "context"):
        vals = [sorted({str(x.get(field)) for x in pts if x.get(field) is not None}) for pts in (base_pts, new_pts)]
        if vals[0] and vals[1] and vals[0] != vals[1]:
            print(f"warning: {field} differs: base {', '.join(vals[0])}, new {', '.join(vals[1])}")

    label = lambda pts, c: c or ", ".join(sorted({str(x.get("commit", "?")) for x in pts}))
    bl, nl = label(base_pts, a.base_commit), label(new_pts, a.new_commit)
    print(f"base {bl} (hybrid: {a.hybrid_base}), new {nl} (hybrid: {a.hybrid_new}); ms (ratio to the floor)")
    print()
    print(f"| variant | B | q | hybrid {nl} | hybrid {bl} | speedup | stock {nl} | stock {bl} | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    records, speedups = [], {"hybrid": [], "stock": []}
    points = sorted({(k[0], k[2], k[3]) for k in keys}, key=lambda p: (p[0], p[2], p[1]))
    for v, b, q in points:
        cells = []
        for step in ("hybrid", "stock"):
            k = (v, step, b, q)
            if k not in keys:
                cells += ["-", "-", "-"]
                continue
            s = med(base[k], "median_us") / med(new[k], "median_us")
            bar = a.hybrid_bar if step == "hybrid" else a.stock_bar
            speedups[step].append(s)
            cells += [cell(new[k]), cell(base[k]), f"**{s:.2f}**"]
            records.append({"variant": v, "step": step, "requests": b, "q": q,
                            "base_commit": bl, "new_commit": nl,
                            "base_us": med(base[k], "median_us"), "new_us": med(new[k], "median_us"),
                            "base_runs": len(base[k]), "new_runs": len(new[k]),
                            "speedup": round(s, 4), "bar": bar, "met": s >= bar})
        print(f"| {v.upper()} | {b} | {q} | " + " | ".join(cells) + " |")
    print()
    for step, bar in (("hybrid", a.hybrid_bar), ("stock", a.stock_bar)):
        s = speedups[step]
        if s:
            met = sum(x >= bar for x in s)
            print(f"{step}: {min(s):.2f}-{max(s):.2f}x faster; the {bar}x bar met at {met} of {len(s)} points")
    only = (set(base) ^ set(new))
    if only:
        print(f"({len(only)} points on one side only, left out)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
