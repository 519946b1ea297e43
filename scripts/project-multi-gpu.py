#!/usr/bin/env python3
"""Project the TP8 x DP4 (EP32) decode step on eight-GPU H200 nodes from the rank-slice bench JSON.

usage: scripts/project-multi-gpu.py [--config configs/kimi-k3.config.json] [--json OUT.json]
                                    BENCH.json [BENCH.json ...]

PROJECTIONS, NOT MEASUREMENTS. For every record (variant, step mode, B, q) of `k3decode bench
--preset k3-rank-slice --tp 8 --dp 4` (rank 0 of TP8 x DP4, loopback collectives, one GPU):

  projected = kernel part + TP collectives + EP exchange + lm_head vocab gather

- kernel part = the measured median minus the time of the loopback collectives. The loopback
  collectives are device copies (runtime/gpu/collectives.cpp); the trace gives the time of all the
  step's copies: their busy time (trace_busy_us minus the kernels' time, or the `memcpy32_post`
  kernels where the copies ran as kernels) plus the uncovered time charged to them
  (trace_gaps_before). Every copy of the step is counted here from the code (which copies, how many
  bytes); the count reproduces copies_per_step at every point. Each copy is modelled as a + 2 bytes /
  HBM (read + write at the run's measured bandwidth), a fitted per point so that the copies sum to
  the traced time; the loopback share is its copies' a and bytes. The other copies (69 KDA gate
  columns in trees before kda_prep, told by the record's copy count; 8 AttnRes block starts, the 8 lm_head column blocks) stay in the kernel part: the real
  step makes them too.
- TP collectives (one node, NVLink), sizes per layer from docs/PARALLEL.md and runtime/steps.cpp:
    stock      all_gather (G c D 2 bytes out) per layer + 1 before the lm_head, reduce_scatter
               (G c D 2 in) per layer;
    hybrid     all_reduce (m D 2) per layer, all_gather of the MoE shard per MoE layer;
    hybrid-tp  all_reduce (m D 2) per attention layer and per FFN layer, no gather.
  Two tables: "nccl" (all three from NCCL's own cost model) and "custom" (all_reduce from a
  published one-shot / two-shot custom all-reduce; all_gather / reduce_scatter still NCCL).
- EP exchange per MoE layer over 32 GPUs in 4 nodes (InfiniBand NDR, 400 Gb/s per GPU), at
  DeepEP's published low-latency bandwidths: dispatch c k (2 L + 4) bytes (latent rows + ids), combine
  c k 2 L bytes, c = ceil(m / G), uniform routing. "ep_fixed" is the same for the fixed-capacity
  exchange as implemented (ops/ep.h: W cap slots per peer, cap = c k for a graph sized to this point's
  rows): 32x the bytes.
- lm_head: one F32 vocab all_gather (m V 4 bytes out) per step.
- left out: the 4-byte world all_reduce of Engine::step (outside the graph, one per step, the same
  for every mode), the EP pack / combine kernels, overlap of any collective with compute.

Then per point: which mode is fastest, by how much, and whether `--step auto` (runtime/steps.cpp
choose_step: hybrid when q > 1, rows % q == 0 and ceil(rows / G) <= 256, else stock; it never picks
the TP-sharded shared experts, which `--shared-experts tp` forces) picks the faster of stock and
hybrid.
"""
import argparse
import json
import math
import sys

G, DP = 8, 4
W = G * DP
MOE_CAPACITY = 256  # runtime/steps.h StepOptions::moe_capacity (auto's rule)

# ---------------------------------------------------------------------------------------------
# Latency / bandwidth table. Every figure has its source; assumptions are labelled as such.
# ---------------------------------------------------------------------------------------------
SOURCES = {
    "h200": "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: NVLink 900 GB/s, i.e. 450 GB/s "
            "per direction per GPU)",
    "nccl": "https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc (NCCL's cost model: "
            "time = baseLat + nsteps hwLat + bytes / algBw; Ring baseLat LL/LL128/Simple 6.6/14.0/8.4 us, "
            "NVLink Ring hwLat 0.6/1.9/3.4 us per step; LL at 1/3 (AG, RS) or 1/4 (AR) of the bus "
            "bandwidth, LL128 at 0.92)",
    "custom_ar": "https://github.com/sgl-project/sglang/pull/2904 (H100, TP 8, NVSwitch: TensorRT-LLM-"
                 "derived one-shot / two-shot custom all-reduce, 2 KiB 5.9 us, 16 KiB 5.7 us, 128 KiB 7.8 us, "
                 "1 MiB 16.7 us, 2 MiB 22.1 us, 4 MiB 33.8 us; vLLM's custom all-reduce in the same table "
                 "10.1 / 9.3 / 11.8 / 24.1 / 30.4 / 45.0 us)",
    "deepep": "https://github.com/deepseek-ai/DeepEP/blob/main/docs/legacy.md (low-latency kernels, "
              "H800 + ConnectX-7 InfiniBand 400 Gb/s, 128 tokens, hidden 7168, top-8: EP32 dispatch "
              "155 us at 48 GB/s, combine 273 us at 53 GB/s)",
}
NVLINK_DIR_GBPS = 450.0  # [h200] per direction
# ASSUMPTION: NCCL's bus bandwidth on 8 H200s = 80 % of the per-direction NVLink figure (no nccl-tests
# table for H100/H200 all_gather / reduce_scatter at these sizes was found in the searched corpus).
NCCL_BUS_GBPS = 0.8 * NVLINK_DIR_GBPS
NCCL_BASE_US = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}  # [nccl] Ring
NCCL_NVLINK_STEP_US = {"LL": 0.6, "LL128": 1.9, "Simple": 3.4}  # [nccl] Ring, NVLink
CUSTOM_AR_US = [(2048, 5.9), (16384, 5.7), (131072, 7.8), (1048576, 16.7), (2097152, 22.1),
                (4194304, 33.8)]  # [custom_ar] bytes -> us (TP 8, H100)
EP_DISPATCH_GBPS, EP_COMBINE_GBPS = 48.0, 53.0  # [deepep] EP32
# ASSUMPTION: a fixed cost per dispatch or combine (kernel launch, one InfiniBand round trip, arrival
# flags); DeepEP publishes its latencies at 128 tokens only, where bandwidth dominates.
EP_FIXED_US = 15.0


def nccl_us(coll, nbytes, ranks=G):
    """NCCL's own ring cost model on one NVLink node: the fastest protocol (nbytes: the op's total)."""
    nsteps = 2 * (ranks - 1) if coll == "all_reduce" else ranks - 1
    best = math.inf
    for p in ("LL", "LL128", "Simple"):
        bus = NCCL_BUS_GBPS
        if p == "LL":
            bus *= 0.25 if coll == "all_reduce" else 1.0 / 3.0
        elif p == "LL128":
            bus *= 0.92
        algbw = bus * ranks / nsteps  # GB/s = bytes per ns
        best = min(best, NCCL_BASE_US[p] + nsteps * NCCL_NVLINK_STEP_US[p] + nbytes / (1000.0 * algbw))
    return best


def custom_ar_us(nbytes):
    pts = CUSTOM_AR_US
    if nbytes <= pts[0][0]:
        return pts[0][1]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = pts[-2], pts[-1]
    return t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0)


def ep_us(dispatch_bytes, combine_bytes):
    return (2 * EP_FIXED_US + dispatch_bytes / (1000.0 * EP_DISPATCH_GBPS)
            + combine_bytes / (1000.0 * EP_COMBINE_GBPS))


# ---------------------------------------------------------------------------------------------
# The model's dimensions.
# ---------------------------------------------------------------------------------------------
def dims(config_path):
    t = json.load(open(config_path))["text_config"]
    layers = t["num_hidden_layers"]
    dense = t["first_k_dense_replace"]
    return {
        "D": t["hidden_size"], "L": t["routed_expert_hidden_size"], "k": t["num_experts_per_token"],
        "V": t["vocab_size"], "n_attn": layers, "n_moe": layers - dense, "n_dense": dense,
        "n_kda": len(t["linear_attn_config"]["kda_layers"]), "kda_d": t["linear_attn_config"]["head_dim"],
        "n_blocks": math.ceil(layers / t["attn_res_block_size"]),
    }


def doubling(first, total):
    """Copies (rows each) of GpuCollectives::replicate_rows: rows [0, first) doubled up to total."""
    out, filled = [], first
    while 0 < filled < total:
        n = min(filled, total - filled)
        out.append(n)
        filled += n
    return out


def step_copies(mode, m, d, kda_gate_copies=True, tree="current"):
    """Every device copy of one rank-slice step: (loopback?, bytes) per copy (runtime/gpu/*.cpp).
    kda_gate_copies: the tree copied the KDA gate columns (before kda_prep read them in place).
    tree "current" (from 453b43b and 519183b on): hybrid-tp dispatches the m rows' L / G latent slices,
    doubled up to the c k latent rows the rank receives, and no mode copies a combine (the latent norm
    reads the received rows); "272c18a": every mode dispatches c latent rows doubled to c k, and copies
    c latent rows back as the combine."""
    D, L, k = d["D"], d["L"], d["k"]
    c = (m + G - 1) // G
    row, lat = D * 2, L * 2
    cp = []

    def dispatch():  # GpuCollectives::ep_loopback_dispatch: the first min(in, out) elements, then doubling
        sent = m * (L // G) if tree == "current" and mode == "hybrid-tp" else c * L
        out = c * k * L
        first = min(sent, out)
        cp.append((True, 2 * first))
        cp.extend((True, 2 * n) for n in doubling(first, out))

    def gather():  # tp_all_gather_rows, loopback: the shard, then doubling copies
        first = min(m, c)
        cp.append((True, first * row))
        cp.extend((True, n * row) for n in doubling(first, m))

    def all_reduce():  # tp_all_reduce, loopback: two copies of the buffer
        cp.extend([(True, m * row)] * 2)

    for _ in range(d["n_attn"]):
        if mode == "stock":
            gather()
            cp.append((True, c * row))  # reduce_scatter: the own rows
            cp.extend([(True, c * row)] * (G - 1))  # and G - 1 copies of the shard's bytes
        else:
            all_reduce()
    for _ in range(d["n_moe"]):  # the EP loopback: the dispatch (and in 272c18a's tree a combine copy)
        dispatch()
        if tree != "current":
            cp.append((True, c * lat))
        if mode == "hybrid":
            gather()
    if mode == "hybrid-tp":
        for _ in range(d["n_attn"]):  # the FFN's all-reduce (dense and MoE layers)
            all_reduce()
    if mode == "stock":
        gather()  # before the lm_head
    res_rows = c if mode == "stock" else m
    if kda_gate_copies:
        cp.extend([(False, m * d["kda_d"] * 2)] * d["n_kda"])  # KDA gate columns
    cp.extend([(False, res_rows * row)] * d["n_blocks"])  # AttnRes block starts
    cp.extend([(False, m * (d["V"] // G) * 4)] * G)  # lm_head slices into the logits
    return cp


def mode_of(r):
    if r["step"] == "stock":
        return "stock"
    return "hybrid-tp" if r.get("shared_experts") == "tp" else "hybrid"


COPY_OPS = ("memcpy", "memset", "memcpy32_post", "memset32")


def loopback_us(r, mode, d):
    """(loopback copy time, all copies' traced time, copies counted) for one record."""
    for key in ("trace_busy_us", "trace_kernels", "trace_gaps_before", "copies_per_step", "hbm_gbps"):
        if key not in r:
            raise SystemExit(f"record {r.get('variant')} {r.get('step')} B={r.get('requests')} "
                             f"q={r.get('q')} has no {key}")
    kern = sum(k["us"] for k in r["trace_kernels"])
    as_kernels = sum(k["us"] for k in r["trace_kernels"] if k["name"] in COPY_OPS)
    busy = as_kernels if r["copies_per_step"] == 0 else r["trace_busy_us"] - kern
    gaps = sum(g["us"] for g in r["trace_gaps_before"] if g["before"] in COPY_OPS)
    traced = max(0.0, busy) + gaps
    # The tree's copies: a record that names its layer copies (bench from ca9a890 on) is the current
    # tree's; older ones are 272c18a's, before kda_prep or (by the count) with it.
    if "layer_copies" in r:
        cp = step_copies(mode, r["rows"], d, kda_gate_copies=False, tree="current")
    else:
        cp = step_copies(mode, r["rows"], d, tree="272c18a")
        if r["copies_per_step"] and abs(len(cp) - r["copies_per_step"]) > 2:
            cp = step_copies(mode, r["rows"], d, kda_gate_copies=False, tree="272c18a")  # a tree with kda_prep
    bw = r["hbm_gbps"] * 1e3  # bytes per us
    moved = sum(2 * b / bw for _, b in cp)
    a = max(0.0, (traced - moved) / len(cp))
    lb = sum(a + 2 * b / bw for is_lb, b in cp if is_lb)
    return min(lb, traced), traced, len(cp)


def collectives(mode, m, d):
    """Per-step TP collective time (nccl table, custom table), EP (ideal, fixed cap), lm_head, in us."""
    D, L, k = d["D"], d["L"], d["k"]
    c = (m + G - 1) // G
    rows_bytes = G * c * D * 2  # a gathered / scattered row set
    ar_bytes = m * D * 2
    if mode == "stock":
        n = nccl_us("all_gather", rows_bytes) * (d["n_attn"] + 1) + nccl_us("reduce_scatter", rows_bytes) * d["n_attn"]
        tp = (n, n)
    elif mode == "hybrid":
        ag = nccl_us("all_gather", rows_bytes) * d["n_moe"]
        tp = (nccl_us("all_reduce", ar_bytes) * d["n_attn"] + ag, custom_ar_us(ar_bytes) * d["n_attn"] + ag)
    else:
        n_ar = d["n_attn"] * 2
        tp = (nccl_us("all_reduce", ar_bytes) * n_ar, custom_ar_us(ar_bytes) * n_ar)
    pairs = c * k
    ep = ep_us(pairs * (2 * L + 4) + W * 4, pairs * 2 * L) * d["n_moe"]
    ep_fixed = ep_us(W * pairs * (2 * L + 4), W * pairs * 2 * L) * d["n_moe"]
    lm = nccl_us("all_gather", m * d["V"] * 4)
    return tp, ep, ep_fixed, lm


def auto_pick(m, q):
    c = (m + G - 1) // G
    return "hybrid" if q > 1 and m % q == 0 and c <= MOE_CAPACITY else "stock"


def project(records, d):
    rows = []
    for r in records:
        mode = mode_of(r)
        m = r["rows"]
        lb, traced, ncopies = loopback_us(r, mode, d)
        kernel = r["median_us"] - lb
        tp, ep, ep_fixed, lm = collectives(mode, m, d)
        rows.append({
            "variant": r["variant"], "B": r["requests"], "q": r["q"], "rows": m, "mode": mode,
            "measured_ms": r["median_us"] / 1e3, "copies_traced_ms": traced / 1e3, "copies": ncopies,
            "copies_json": r["copies_per_step"], "loopback_ms": lb / 1e3, "kernel_ms": kernel / 1e3,
            "tp_nccl_ms": tp[0] / 1e3, "tp_custom_ms": tp[1] / 1e3, "ep_ms": ep / 1e3,
            "ep_fixed_ms": ep_fixed / 1e3, "lm_head_ms": lm / 1e3,
            "projected_nccl_ms": (kernel + tp[0] + ep + lm) / 1e3,
            "projected_custom_ms": (kernel + tp[1] + ep + lm) / 1e3,
            "projected_fixed_ep_ms": (kernel + tp[1] + ep_fixed + lm) / 1e3,
        })
    return rows


def verdicts(rows):
    """Per (variant, B, q): the winner of each table and auto's check."""
    points = {}
    for x in rows:
        points.setdefault((x["variant"], x["B"], x["q"]), {})[x["mode"]] = x
    out = []
    for (variant, B, q), modes in sorted(points.items()):
        v = {"variant": variant, "B": B, "q": q, "rows": B * q}
        for table in ("nccl", "custom"):
            key = f"projected_{table}_ms"
            ranked = sorted(modes, key=lambda s: modes[s][key])
            v[f"winner_{table}"] = ranked[0]
            v[f"margin_{table}"] = modes[ranked[1]][key] / modes[ranked[0]][key] if len(ranked) > 1 else 1.0
            if "stock" in modes and "hybrid" in modes:
                best = min(("stock", "hybrid"), key=lambda s: modes[s][key])
                pick = auto_pick(B * q, q)
                v[f"auto_{table}"] = pick
                v[f"auto_ok_{table}"] = pick == best
                v[f"auto_loss_{table}"] = modes[pick][key] / modes[best][key] - 1.0
        out.append(v)
    return out


def print_tables(rows, verdict):
    for variant in sorted({x["variant"] for x in rows}):
        print(f"\n## {variant}: projected TP8 x DP4 step on 8 H200s per node (PROJECTION, not a measurement)\n")
        print("| B | q | rows | step | measured | loopback | kernel | TP nccl / custom | EP | lm_head "
              "| projected nccl | projected custom |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for x in rows:
            if x["variant"] != variant:
                continue
            print(f"| {x['B']} | {x['q']} | {x['rows']} | {x['mode']} | {x['measured_ms']:.1f} | "
                  f"{x['loopback_ms']:.2f} | {x['kernel_ms']:.1f} | {x['tp_nccl_ms']:.2f} / {x['tp_custom_ms']:.2f} | "
                  f"{x['ep_ms']:.2f} | {x['lm_head_ms']:.2f} | {x['projected_nccl_ms']:.1f} | "
                  f"{x['projected_custom_ms']:.1f} |")
        print(f"\n{variant}: fastest mode per point (margin: the runner-up's time / the winner's), and "
              "`--step auto` (stock or hybrid, replicated shared experts) against the faster of the two\n")
        print("| B | q | rows | winner nccl | by | winner custom | by | auto picks | auto right (nccl / custom) "
              "| auto's loss (nccl / custom) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for v in verdict:
            if v["variant"] != variant:
                continue
            ok = "/".join("yes" if v.get(f"auto_ok_{t}") else "no" for t in ("nccl", "custom"))
            loss = " / ".join(f"{100 * v.get(f'auto_loss_{t}', 0):.1f}%" for t in ("nccl", "custom"))
            print(f"| {v['B']} | {v['q']} | {v['rows']} | {v['winner_nccl']} | {100 * (v['margin_nccl'] - 1):.1f}% | "
                  f"{v['winner_custom']} | {100 * (v['margin_custom'] - 1):.1f}% | {v.get('auto_nccl', '-')} | "
                  f"{ok} | {loss} |")
    print("\nSources:")
    for k, s in SOURCES.items():
        print(f"- [{k}] {s}")
    print(f"- ASSUMPTION: NCCL bus bandwidth {NCCL_BUS_GBPS:.0f} GB/s (80 % of {NVLINK_DIR_GBPS:.0f} GB/s); "
          f"EP fixed cost {EP_FIXED_US:.0f} us per dispatch or combine")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="config.json (default: configs/kimi-k3.config.json)")
    ap.add_argument("--json", help="write the projected rows and the verdicts here")
    ap.add_argument("bench", nargs="+")
    a = ap.parse_args()
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = dims(a.config or os.path.join(root, "configs", "kimi-k3.config.json"))
    records = []
    for path in a.bench:
        records.extend(json.load(open(path)))
    for r in records:
        for key in ("variant", "step", "requests", "q", "rows", "median_us"):
            if key not in r:
                raise SystemExit(f"{key}: missing in a record")
        if r.get("preset") not in (None, "k3-rank-slice"):
            raise SystemExit(f"record of preset {r.get('preset')}: only the k3-rank-slice (TP8 x DP4) is projected")
    rows = project(records, d)
    verdict = verdicts(rows)
    print_tables(rows, verdict)
    if a.json:
        json.dump({"rows": rows, "points": verdict, "sources": SOURCES}, open(a.json, "w"), indent=1)
    mismatch = [x for x in rows if x["copies_json"] and abs(x["copies"] - x["copies_json"]) > 2]
    if mismatch:
        print(f"warning: the copy count differs from copies_per_step at {len(mismatch)} points", file=sys.stderr)


if __name__ == "__main__":
    main()
