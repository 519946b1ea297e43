#!/usr/bin/env python3
# Emulation of mla_attend_wg_kernel's shared-memory layouts, wgmma descriptor reads (PTX / CUTLASS canonical
# layouts, 128B swizzle applied to the computed byte address), the D fragment layout, and the per-thread
# softmax / P / output index math of the kernel. Pure Python (no numpy).
import math, random, struct

def bf16(x):
    b = struct.unpack('<I', struct.pack('<f', x))[0]
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return struct.unpack('<f', struct.pack('<I', b))[0]
def f32(x): return struct.unpack('<f', struct.pack('<f', x))[0]

def swz(addr):  # 128B swizzle: byte address bits [4:6] ^= bits [7:9]
    return addr ^ (((addr >> 7) & 7) << 4)

class Smem:
    def __init__(self): self.m = {}
    def st16(self, addr, v): assert addr % 2 == 0; self.m[addr] = v
    def ld16(self, addr): return self.m[addr]   # KeyError: reading unwritten smem

# descriptor readers: return element (r, k) of the 64 x 16 (A) or N x 16 (B) operand
def kmajor(sm, start, sbo, r, k):      # K-major SW128 (LBO unused)
    return sm.ld16(swz(start + (r // 8) * sbo + (r % 8) * 128 + k * 2))
def mnmajor(sm, start, lbo, sbo, m, k):  # MN-major SW128: ((8,n),(8,k)):((1,LBO),(8,SBO)) u128
    return sm.ld16(swz(start + (m // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + (m % 64) * 2))

def wgmma(sm, N, da, db, ta, d, scale_d):
    # da, db: (start, lbo, sbo); d: dict (warp, lane) -> list of N/2 floats (D fragment)
    A = [[(mnmajor(sm, da[0], da[1], da[2], m, k) if ta else kmajor(sm, da[0], da[2], m, k)) for k in range(16)] for m in range(64)]
    B = [[kmajor(sm, db[0], db[2], n, k) for k in range(16)] for n in range(N)]  # B^T rows: n, k
    for w in range(4):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            regs = d[(w, lane)]
            for idx in range(N // 2):
                i, rem = idx // 4, idx % 4
                h, b = rem // 2, rem % 2
                row, col = 16 * w + g + 8 * h, 8 * i + 2 * t + b
                acc = sum(A[row][k] * B[col][k] for k in range(16))
                regs[idx] = (regs[idx] if scale_d else 0.0) + acc

def run_cta(N, nrows, lens, q, pool_rows, scale, page_size, tables, c0, c1, use_tma_tiles=True):
    """q: nrows x 576 (bf16 values), pool_rows: dict row -> 576 values; lens per row; returns o (nrows x 512), lse."""
    E, kBlocks, kBlockBytes, kStageBytes = 576, 9, 8192, 73728
    kv_s = 0
    q_s = 2 * kStageBytes
    p_s = q_s + kBlocks * N * 128
    sm = Smem()
    # Q load (kernel: c chunk of row r -> q_s + (c>>3)*N*128 + r*128 + (((c&7)^(r&7))<<4))
    for r in range(N):
        for c in range(72):
            base = q_s + (c >> 3) * (N * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4)
            for e in range(8):
                sm.st16(base + 2 * e, q[r][c * 8 + e] if r < nrows else 0.0)
    boxr = 64 if page_size % 64 == 0 else page_size
    def pool_row(pos):
        pg = pos // page_size
        page = tables[pg] if pg < len(tables) else -1
        return page * page_size + pos % page_size if page >= 0 else -1
    ntiles = (c1 - c0 + 63) // 64
    lim = [min(lens[n], c1) if n < nrows else 0 for n in range(N)]
    # per-thread state (WG0 threads and all consumer threads' O)
    NA, NC = N // 2, N // 4
    o = {(wg, w, l): [[0.0] * NA for _ in range(4)] for wg in range(2) for w in range(4) for l in range(32)}
    m_run = {(w, l): [-math.inf] * NC for w in range(4) for l in range(32)}
    l_run = {(w, l): [0.0] * NC for w in range(4) for l in range(32)}
    for it in range(ntiles):
        s = it & 1
        j0 = c0 + it * 64
        nvalid = min(64, c1 - j0)
        dst = kv_s + s * kStageBytes
        # producer
        rows_box = [pool_row(j0 + u * boxr) for u in range(64 // boxr)]
        if nvalid == 64 and all(r >= 0 for r in rows_box) and use_tma_tiles:
            for u, rr in enumerate(rows_box):
                for kb in range(kBlocks):
                    bdst = dst + kb * kBlockBytes + u * boxr * 128
                    for y in range(boxr):
                        for x in range(64):
                            sm.st16(swz(bdst + y * 128 + x * 2), pool_rows[rr + y][kb * 64 + x])
        else:
            for e in range(64):
                row = pool_row(j0 + e) if e < nvalid else -1
                for c in range(72):
                    a = dst + (c >> 3) * kBlockBytes + e * 128 + (((c & 7) ^ (e & 7)) << 4)
                    for k in range(8):
                        sm.st16(a + 2 * k, pool_rows[row][c * 8 + k] if row >= 0 else 0.0)
        # WG0: QK
        sacc = {(w, l): [0.0] * NA for w in range(4) for l in range(32)}
        for kb in range(kBlocks):
            for kk in range(4):
                wgmma(sm, N, (dst + kb * kBlockBytes + kk * 32, 16, 1024), (q_s + kb * (N * 128) + kk * 32, 16, 1024), 0, sacc, (kb | kk) != 0)
        # mask, column max
        red = [[None] * N for _ in range(4)]
        sv = {}
        for w in range(4):
            for lane in range(32):
                g, tq = lane >> 2, lane & 3
                e0 = j0 + 16 * w + g
                svv = []
                for c in range(NC):
                    i, bb = c >> 1, c & 1
                    v0 = f32(scale * sacc[(w, lane)][4 * i + bb]) if e0 < lim[8 * i + 2 * tq + bb] else -math.inf
                    v1 = f32(scale * sacc[(w, lane)][4 * i + 2 + bb]) if e0 + 8 < lim[8 * i + 2 * tq + bb] else -math.inf
                    svv.append([v0, v1])
                sv[(w, lane)] = svv
            for lane in range(4):  # g == 0 lanes; max over g (lanes lane + 4 g)
                tq = lane
                for c in range(NC):
                    n = 8 * (c >> 1) + 2 * tq + (c & 1)
                    red[w][n] = max(max(sv[(w, tq + 4 * g)][c]) for g in range(8))
        corr_s = [None] * N
        phi = p_s + (2 * s) * (N * 128); plo = phi + N * 128
        for w in range(4):
            for lane in range(32):
                g, tq = lane >> 2, lane & 3
                for c in range(NC):
                    n = 8 * (c >> 1) + 2 * tq + (c & 1)
                    tmax = max(red[0][n], red[1][n], red[2][n], red[3][n])
                    mr = m_run[(w, lane)][c]
                    m_new = max(mr, tmax)
                    cr, p0, p1 = 1.0, 0.0, 0.0
                    if m_new != -math.inf:
                        cr = math.exp(mr - m_new); p0 = math.exp(sv[(w, lane)][c][0] - m_new); p1 = math.exp(sv[(w, lane)][c][1] - m_new)
                    m_run[(w, lane)][c] = m_new
                    l_run[(w, lane)][c] = l_run[(w, lane)][c] * cr + (p0 + p1)
                    for h, pv in enumerate((p0, p1)):
                        hi = bf16(pv); lo = bf16(pv - hi)
                        off = n * 128 + (((2 * w + h) ^ (n & 7)) << 4) + g * 2
                        sm.st16(phi + off, hi); sm.st16(plo + off, lo)
                    if w == 0 and g == 0: corr_s[n] = cr
        # both WGs: rescale + PV
        for wg in range(2):
            for w in range(4):
                for lane in range(32):
                    tq = lane & 3
                    for c in range(NC):
                        i, bb = c >> 1, c & 1
                        cr = corr_s[8 * i + 2 * tq + bb]
                        for mt in range(4):
                            o[(wg, w, lane)][mt][4 * i + bb] *= cr
                            o[(wg, w, lane)][mt][4 * i + 2 + bb] *= cr
            for mt in range(4):
                d = {(w, l): o[(wg, w, l)][mt] for w in range(4) for l in range(32)}
                for kk in range(4):
                    da = (dst + (4 * wg + mt) * kBlockBytes + kk * 2048, kBlockBytes, 1024)
                    wgmma(sm, N, da, (phi + kk * 32, 16, 1024), 1, d, 1)
                    wgmma(sm, N, da, (plo + kk * 32, 16, 1024), 1, d, 1)
    # epilogue
    lfin = [0.0] * N; mfin = [0.0] * N
    for n in range(N):
        tq = (n % 8) // 2; c = 2 * (n // 8) + (n % 2)
        lw = []
        for w in range(4):
            lw.append(sum(l_run[(w, tq + 4 * g)][c] for g in range(8)))
        lfin[n] = (lw[0] + lw[1]) + (lw[2] + lw[3]); mfin[n] = m_run[(0, tq)][c]
    out = [[None] * 512 for _ in range(nrows)]
    for wg in range(2):
        for w in range(4):
            for lane in range(32):
                g, tq = lane >> 2, lane & 3
                for c in range(NC):
                    n = 8 * (c >> 1) + 2 * tq + (c & 1); i, bb = c >> 1, c & 1
                    if n >= nrows: continue
                    inv = 1.0 / lfin[n] if lfin[n] > 0 else 0.0
                    base = 256 * wg + 16 * w + g
                    for mt in range(4):
                        out[n][base + 64 * mt] = o[(wg, w, lane)][mt][4 * i + bb] * inv
                        out[n][base + 64 * mt + 8] = o[(wg, w, lane)][mt][4 * i + 2 + bb] * inv
    lse = [mfin[n] + math.log(lfin[n]) if lfin[n] > 0 else -math.inf for n in range(nrows)]
    return out, lse

def reference(q_row, entries, scale):
    s = [scale * sum(a * b for a, b in zip(q_row, e)) for e in entries]
    if not s: return [0.0] * 512, -math.inf
    m = max(s); w = [math.exp(x - m) for x in s]; tot = sum(w)
    o = [sum(w[j] * entries[j][r] for j in range(len(entries))) / tot for r in range(512)]
    return o, m + math.log(tot)

def case(N, nrows, lens, page_size, c0, c1, seed, use_tma=True):
    rnd = random.Random(seed)
    npos = max(lens)
    npages = (npos + page_size - 1) // page_size
    perm = list(range(npages + 2)); rnd.shuffle(perm)
    tables = perm[:npages]
    pool_rows = {}
    for pos in range(npages * page_size):
        row = tables[pos // page_size] * page_size + pos % page_size
        pool_rows[row] = [bf16(rnd.uniform(-1, 1)) for _ in range(576)] if pos < npos else [float('nan')] * 576
    q = [[bf16(rnd.uniform(-2, 2)) for _ in range(576)] for _ in range(nrows)]
    scale = 1 / math.sqrt(192)
    out, lse = run_cta(N, nrows, lens, q, pool_rows, scale, page_size, tables, c0, c1, use_tma)
    worst = 0.0
    for n in range(nrows):
        L = min(lens[n], c1)
        ents = [pool_rows[tables[p // page_size] * page_size + p % page_size] for p in range(c0, L)]
        ro, rl = reference(q[n], ents, scale)
        for r in range(512):
            assert out[n][r] is not None and not math.isnan(out[n][r]), (n, r, out[n][r])
            worst = max(worst, abs(out[n][r] - ro[r]))
        if rl == -math.inf: assert lse[n] == -math.inf
        else: assert abs(lse[n] - rl) < 1e-4, (n, lse[n], rl)
    print(f"N={N} rows={nrows} lens={lens} page={page_size} chunk=[{c0},{c1}) max|o-ref|={worst:.2e}")
    assert worst < 2e-5

if __name__ == '__main__':
    import sys
    case(16, 12, [70] * 12, 64, 0, 70, 1)                         # a full TMA tile + a partial cp.async tile
    case(16, 12, [1, 5, 64, 65, 30, 70, 2, 3, 9, 70, 64, 63], 16, 0, 70, 2)   # ragged rows, page 16 boxes
    case(32, 24, [100 + i for i in range(24)], 8, 0, 123, 3)      # page 8: 8 boxes per tile
    case(48, 36, [200 - 3 * i for i in range(36)], 128, 64, 200, 4)  # a split starting at tile 1, page 128
