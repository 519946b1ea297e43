#!/usr/bin/env python3
# Randomized interleavings of mla_attend_wg_kernel's barrier protocol (producer, warpgroup 0, warpgroup 1;
# wgmma groups complete asynchronously, at any time up to the wait that needs them). Checks: no deadlock,
# consumers read the tile they expect, the producer never overwrites a stage and warpgroup 0 never overwrites
# a P buffer that an in-flight wgmma still reads.
import random

class Bar:
    def __init__(s, count): s.count, s.pending, s.phase, s.tx = count, count, 0, 0
    def arrive(s, n=1, tx=0):
        s.pending -= n; s.tx += tx; s._check()
    def complete_tx(s, tx): s.tx -= tx; s._check()
    def _check(s):
        assert s.pending >= 0
        if s.pending == 0 and s.tx == 0:
            s.phase += 1; s.pending = s.count
    def done(s, parity):  # phase with this parity completed: current phase parity differs
        return (s.phase & 1) != parity

def run(ntiles, seed):
    rnd = random.Random(seed)
    full = [Bar(1), Bar(1)]; empty = [Bar(8), Bar(8)]; pready = [Bar(4), Bar(4)]; pfree = [Bar(4), Bar(4)]
    stage = [None, None]; pbuf = [None, None]
    readers_stage = [set(), set()]; readers_p = [set(), set()]
    inflight = []          # (owner, kind, tile) wgmma groups
    tma_inflight = []      # (stage, tile)
    def producer():
        for it in range(ntiles):
            s, ph = it & 1, (it >> 1) & 1
            while not empty[s].done(ph ^ 1): yield
            assert not readers_stage[s], ("overwrite stage", it, readers_stage[s])
            if rnd.random() < 0.5 or it == ntiles - 1:  # cp.async path: synchronous then arrive
                stage[s] = it; full[s].arrive()
            else:
                full[s].arrive(tx=1); tma_inflight.append((s, it)); stage[s] = ('loading', it)
            yield
    def wg0():
        for it in range(ntiles):
            s, ph = it & 1, (it >> 1) & 1
            while not full[s].done(ph): yield
            assert stage[s] == it, ("wg0 reads", stage[s], it)
            readers_stage[s].add(('qk', it)); inflight.append(('wg0', 'qk', it, s, None))
            yield
            # wait<0>: everything of wg0 completes
            while any(g[0] == 'wg0' for g in inflight): yield
            if it > 0: empty[s ^ 1].arrive(4)
            yield
            while not pfree[s].done(ph ^ 1): yield
            assert not readers_p[s], ("overwrite P", it, readers_p[s])
            pbuf[s] = it; pready[s].arrive(4)
            yield
            readers_stage[s].add(('pv0', it)); readers_p[s].add(('pv0', it)); inflight.append(('wg0', 'pv0', it, s, s))
            yield
        while any(g[0] == 'wg0' for g in inflight): yield
    def wg1():
        for it in range(ntiles):
            s, ph = it & 1, (it >> 1) & 1
            while not full[s].done(ph): yield
            while not pready[s].done(ph): yield
            assert stage[s] == it and pbuf[s] == it, ("wg1 reads", stage[s], pbuf[s], it)
            readers_stage[s].add(('pv1', it)); readers_p[s].add(('pv1', it)); inflight.append(('wg1', 'pv1', it, s, s))
            yield
            while any(g[0] == 'wg1' for g in inflight): yield
            empty[s].arrive(4); pfree[s].arrive(4)
            yield
    agents = [producer(), wg0(), wg1()]
    alive = [True] * 3
    steps = 0
    while any(alive):
        steps += 1
        assert steps < 100000, "deadlock"
        r = rnd.random()
        if r < 0.15 and inflight:   # a wgmma group completes
            g = inflight.pop(rnd.randrange(len(inflight)))
            readers_stage[g[3]].discard((g[1], g[2]))
            if g[4] is not None: readers_p[g[4]].discard((g[1], g[2]))
            continue
        if r < 0.3 and tma_inflight:
            s, it = tma_inflight.pop(0); stage[s] = it; full[s].complete_tx(1); continue
        i = rnd.randrange(3)
        if alive[i]:
            try: next(agents[i])
            except StopIteration: alive[i] = False

for seed in range(3000):
    run(1 + seed % 9, seed)
print("protocol: 3000 random interleavings of 1..9 tiles, no deadlock, no overwrite, right tiles")
