#!/usr/bin/env python3
"""Append rank-slice bench points to the performance history (a CSV file).

usage: scripts/perf-history.py [--history CSV] BENCH.json [BENCH.json ...]
       scripts/perf-history.py [--history CSV] --log BENCH.log --commit C [...]

BENCH.json is what `k3decode bench --json` writes (scripts/gpu-test.sh --bench
writes $OUT/rank_slice_{k3,k3.1}.json). --log reads the table the bench prints
instead, for a run whose JSON was not kept; the text has no commit, so --commit
names it (it also overrides the JSON's "commit" field). CSV defaults to
docs/perf/history.csv; it is created with its header when missing.

One row per (commit, variant, step, B, q): step = stock, hybrid (the seed's,
replicated shared experts) or hybrid-tp (--shared-experts tp); B = requests, q = tokens per request,
time_ms = median of the timed graph replays, floor_ms = bytes touched / the HBM
read bandwidth measured in the same run (hbm_gbps); a run with layer weight
copies (bench --layer-copies N, for a GPU too small for the slice) is its own
series, step "<step>-copiesN". A point already in the
file is left as it is and reported (so running twice adds nothing). Only
rank-slice points are taken (preset k3-rank-slice, or the slice's header in a
log): the history compares like with like. Standard library only.
"""
import argparse
import csv
import json
import os
import re
import sys

COLUMNS = ["commit", "variant", "step", "B", "q", "time_ms", "floor_ms", "ratio", "hbm_gbps"]
DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf", "history.csv")

ROW = re.compile(r"^\s*(stock|hybrid)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                 r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")
HBM = re.compile(r"HBM read bandwidth.*:\s*([\d.]+)\s*GB/s")
SLICE = re.compile(r"building the rank slice \((k3(?:\.1)?) ")
COPIES = re.compile(r"^weights .*\((?:.*; )?(\d+) copies per layer kind\)")
WEIGHTS = re.compile(r"^weights ")


def row(commit, variant, step, b, q, median_us, floor_us, hbm):
    return {"commit": commit, "variant": variant, "step": step, "B": str(b), "q": str(q),
            "time_ms": f"{median_us / 1e3:.3f}", "floor_ms": f"{floor_us / 1e3:.3f}",
            "ratio": f"{median_us / floor_us:.3f}", "hbm_gbps": "" if hbm is None else f"{hbm:.0f}"}


def from_json(path, commit):
    with open(path) as f:
        recs = json.load(f)
    out = []
    for r in recs:
        if r.get("preset") != "k3-rank-slice":
            print(f"perf-history: {path}: skipped a {r.get('preset')!r} record (not the rank slice)", file=sys.stderr)
            continue
        c = commit or r.get("commit", "")
        if not c:
            sys.exit(f"perf-history: {path} names no commit; pass --commit")
        # The hybrid step with TP-sharded shared experts (--shared-experts tp) is its own series.
        step = r["step"] + ("-tp" if r.get("shared_experts") == "tp" else "")
        if r.get("layer_copies", 0) > 0:
            step += f"-copies{r['layer_copies']}"
        out.append(row(c, r["variant"], step, r["requests"], r["q"], r["median_us"], r["floor_us"],
                       r.get("hbm_gbps")))
    return out


def from_log(path, commit):
    if not commit:
        sys.exit("perf-history: --log needs --commit (the printed table names none)")
    variant, hbm, copies, tp, out = None, None, 0, False, []
    with open(path) as f:
        for line in f:
            if m := HBM.search(line):
                hbm = float(m.group(1))
            elif m := SLICE.search(line):
                variant = m.group(1)
            elif WEIGHTS.match(line):  # each rank built: its shared experts' mode and any weight copies
                m = COPIES.match(line)
                copies = int(m.group(1)) if m else 0
                tp = "(TP-sharded shared experts" in line
            elif (m := ROW.match(line)) and variant:
                step, b, q, _rows, _ctx, med, _mn, _mx, _mb, floor, _ratio = m.groups()
                step += "-tp" if step == "hybrid" and tp else ""
                step += f"-copies{copies}" if copies else ""
                out.append(row(commit, variant, step, int(b), int(q), float(med), float(floor), hbm))
    if variant is None:
        sys.exit(f"perf-history: {path} is not a rank-slice log (no 'building the rank slice' line)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--history", default=DEFAULT, help="the CSV to append to (default docs/perf/history.csv)")
    ap.add_argument("--commit", default="", help="the commit of the run (needed with --log)")
    ap.add_argument("--log", action="append", default=[], help="a bench log to read instead of JSON")
    ap.add_argument("json", nargs="*", help="k3decode bench --json output")
    a = ap.parse_args()
    if not a.json and not a.log:
        ap.error("give at least one BENCH.json or --log")
    new = [r for p in a.json for r in from_json(p, a.commit)] + [r for p in a.log for r in from_log(p, a.commit)]
    key = lambda r: (r["commit"], r["variant"], r["step"], r["B"], r["q"])  # noqa: E731
    have = set()
    exists = os.path.exists(a.history) and os.path.getsize(a.history) > 0
    if exists:
        with open(a.history, newline="") as f:
            rd = csv.DictReader(f)
            if rd.fieldnames != COLUMNS:
                sys.exit(f"perf-history: {a.history} has columns {rd.fieldnames}, expected {COLUMNS}")
            have = {key(r) for r in rd}
    added, kept = [], 0
    for r in new:
        if key(r) in have:
            kept += 1
            continue
        have.add(key(r))
        added.append(r)
    with open(a.history, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        if not exists:
            w.writeheader()
        w.writerows(added)
    print(f"perf-history: {len(added)} rows added to {os.path.normpath(a.history)}"
          + (f", {kept} already there" if kept else ""))


if __name__ == "__main__":
    main()
