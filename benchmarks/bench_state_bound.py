"""An upper bound on what any checkpoint policy can serve of a recurrent hybrid at equal bytes
beside an LRU page pool: whether the replay's target (>= 0.95 of the every-page oracle) can be
reached at all (ARCHITECTURE.md, "Recurrent state"; the replay: ``bench_state_replay``).

The oracle is an exact LRU of ``B`` pages (L1 + L2, the hybrid's full-attention KV bytes) with a
free checkpoint at every page boundary. A cache of the same bytes whose ``K`` state slots cost
``c`` pages each (Qwen3-Next's ratio: 6.14 pages at 512-token pages) keeps ``P = B - c K`` pages.
A request of that cache is served up to a prefix length ``q`` only if

- its pages hold that prefix: with pages kept in LRU order (the oracle's own order; an LRU's
  content depends on the pages referenced alone, and every request references all of its pages
  whatever it is served), at most what an exact LRU of ``P`` pages serves (**pages bound**);
- a slot holds the checkpoint at ``q`` from a request before it that went through ``q`` until
  this one starts, and no more than ``K`` slots are held at any time (**slots bound**: for
  ``q`` up to the oracle's hit of the request, an LP over which checkpoints are held between
  which requests, a slot shared by every later request that uses the same checkpoint; each
  request served at one ``q`` at most; an LP relaxation, so an upper bound on any policy,
  clairvoyant ones included).

A policy with a fixed split serves at most ``min(slots bound(K), pages bound(B - c K))``; the
best split's bound over the oracle is printed beside the target.

Beside the bounds, what achievable online designs serve (not bounds): no split, pages and
checkpoints share the ``B`` pages' bytes and go in one eviction order, LRU (**unified LRU**)
or GreedyDual with a checkpoint worth the pages it saves per byte (**GreedyDual p**, ``p ** 2``
for attention's quadratic recompute) (a request touches its pages and the checkpoint it was
served from; a checkpoint goes just before the page it ends: without that page it serves
nothing); checkpoints at each prompt's end, where it left the tree and every ``every`` pages,
as ``online_points`` without the tree's other node ends. The cache's fixed split is judged
against it in the same trace and bytes (``bench_state_replay``'s rows at the same intervals).
Usage: ``python -m
benchmarks.bench_state_bound [TRACE] [--capacities 3e5,3e6] [--host-ratio 4] [--slots
5,10,20,40,80,160,320] [--every 4,16,64,0] [--tail 4] [--shares 0.1,0.2,0.3] [--limit N]
[--json P]``. Beside them, the online designs with a tail checkpoint (``--tail``: the cache's
default placement for a recurrent hybrid) and the cache's own structure: a fixed split
(``--shares`` of the bytes in slots) with pages and slots each in an order of their own, LRU or
GreedyDual (``split_design``).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
from typing import Any

import numpy as np

from benchmarks.common import print_table, write_json
from hicache_jax.replay.block_lru import BlockLRU, PageKeys
from hicache_jax.replay.states import slot_bytes, state_spec
from hicache_jax.study import load_trace

NAME = "bench_state_bound"
TARGET = 0.95
PAGE = 512


def oracle_hits(keys: list[list[int]], capacity: int) -> list[int]:
    """Pages each request hits in an exact LRU of ``capacity`` pages."""
    lru = BlockLRU(capacity)
    return [lru.serve(k) for k in keys]


def slots_bound(
    keys: list[list[int]], hits: list[int], slots: int, every: int | None = None
) -> float:
    """The LP bound on the pages served with ``slots`` checkpoints held at a time (see the
    module docstring): candidates ``(request t, prefix q <= hits[t])`` whose checkpoint a
    request ``s < t`` could take (the last such one), held over the gaps ``s .. t - 1``.
    ``every`` None: any request through ``q`` could take it (a clairvoyant policy); an int:
    only where a cache that knows no future takes them (:func:`online_points`)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    last: dict[int, int] = {}
    cands: list[tuple[int, int, int, int]] = []  # (t, q, key, s)
    points = None if every is None else online_points(keys, every)
    for t, ks in enumerate(keys):
        for q in range(1, hits[t] + 1):
            s = last.get(ks[q - 1])
            if s is not None:
                cands.append((t, q, ks[q - 1], s))
        for q, k in enumerate(ks, 1):
            if points is None or q in points[t]:
                last[k] = t
    if not cands:
        return 0.0
    n_x = len(cands)
    # a key's slot variable is constant between the starts and ends of its candidates'
    # intervals (segments): fewer variables than one a gap, the same bound
    spans: dict[int, list[int]] = {}
    for _t, _q, key, s in cands:
        spans.setdefault(key, []).extend((s, _t))
    seg_of: dict[int, list[tuple[int, int, int]]] = {}  # key -> [(lo, hi, variable)]
    n_y = 0
    for key, points in spans.items():
        cuts = sorted(set(points))
        seg_of[key] = [
            (lo, hi, n_x + n_y + m) for m, (lo, hi) in enumerate(itertools.pairwise(cuts))
        ]
        n_y += len(cuts) - 1
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []
    r = 0
    for i, (_t, _q, key, s) in enumerate(cands):  # x_i <= y of each segment it spans
        for lo, hi, j in seg_of[key]:
            if s <= lo and hi <= _t:
                rows += [r, r]
                cols += [i, j]
                vals += [1.0, -1.0]
                rhs.append(0.0)
                r += 1
    by_t: dict[int, list[int]] = {}
    for i, (t, *_rest) in enumerate(cands):
        by_t.setdefault(t, []).append(i)
    for idx in by_t.values():  # one q a request
        rows += [r] * len(idx)
        cols += idx
        vals += [1.0] * len(idx)
        rhs.append(1.0)
        r += 1
    first = min(s for *_rest, s in cands)
    last_gap = max(t for t, *_rest in cands)
    for lo, hi, j in (seg for segs in seg_of.values() for seg in segs):  # K slots a gap
        for g in range(lo, hi):
            rows.append(r + g - first)
            cols.append(j)
            vals.append(1.0)
    rhs += [float(slots)] * (last_gap - first)
    r += last_gap - first
    n = n_x + n_y
    a = coo_matrix((vals, (rows, cols)), shape=(r, n)).tocsr()
    c = np.zeros(n)
    c[:n_x] = [-q for _t, q, _k, _s in cands]
    res = linprog(c, A_ub=a, b_ub=np.asarray(rhs), bounds=(0, 1), method="highs")
    if res.status != 0:
        raise RuntimeError(f"LP: {res.message}")
    return float(-res.fun)


def unified_lru(
    keys: list[list[int]],
    budget: float,
    cost: float,
    every: int,
    weight: float | None = None,
    tail: int = 0,
) -> int:
    """Pages served by the unified design of the module docstring: ``budget`` pages' bytes for
    pages (1 each) and checkpoints (``cost`` each) in one eviction order. ``weight`` None: LRU;
    a number: GreedyDual, a checkpoint at page ``p`` worth ``p ** weight`` (the pages it
    saves, 1: its tokens' recompute; 2: attention's) over its cost, a request's pages worth
    its deepest checkpoint, the clock raised to each evicted item's priority. ``tail``: a
    checkpoint that many pages before each prompt's end too (the cache's
    ``checkpoint_tail_pages``; 0: none)."""
    pages: dict[int, tuple[float, float]] = {}
    ckpts: dict[int, tuple[float, float]] = {}
    heap: list[tuple[tuple[float, float], int, int]] = []  # (priority, is checkpoint, key)
    used = 0.0
    served = 0
    clock = 0.0
    for t, ks in enumerate(keys):
        n = len(ks)
        m = 0  # pages held from the root
        while m < n and ks[m] in pages:
            m += 1
        q = next((p for p in range(m, 0, -1) if ks[p - 1] in ckpts), 0)
        served += q
        points = {n, m} | (set(range(every, n + 1, every)) if every else set())
        if tail and n - tail > 0:
            points.add(n - tail)
        points = {p for p in points if p > q} | ({q} if q else set())
        # priorities (first goes first): this request's time or worth, the deeper pages
        # first among equals, never lowered (a parent outlives its children), a checkpoint
        # just before the page it ends (without that page it serves nothing)
        worth = {p: float(t) if weight is None else clock + p**weight / cost for p in points | {n}}
        top = worth[n]
        for i, k in enumerate(ks, 1):
            used += k not in pages
            pages[k] = max(pages.get(k, (top, -i)), (top, -i))
            heapq.heappush(heap, (pages[k], 0, k))
        for p in points:
            k = ks[p - 1]
            used += cost * (k not in ckpts)
            ckpts[k] = (worth[p], -p - 0.5)
            heapq.heappush(heap, (ckpts[k], 1, k))
        while used > budget:
            prio, is_ckpt, k = heapq.heappop(heap)
            held = ckpts if is_ckpt else pages
            if held.get(k) == prio:  # else a stale entry: touched again since
                del held[k]
                used -= cost if is_ckpt else 1
                clock = max(clock, prio[0])
    return served


def online_points(keys: list[list[int]], every: int) -> list[set[int]]:
    """Where each request may take a checkpoint knowing only the requests before it (prefix
    lengths in pages): every ``every`` pages (0: none), its own end, and each node end of the
    tree its prompt passes when it arrives: where an earlier prompt ended or left its path,
    and where its own prompt leaves the tree (a cache's held point; the tree taken as holding
    every page ever seen, so these are a superset of a real tree's)."""
    children: dict[int, set[int]] = {}
    ended: set[int] = set()
    seen: set[int] = set()
    out = []
    for ks in keys:
        pts = {len(ks)} | (set(range(every, len(ks) + 1, every)) if every else set())
        pts.add(next((q for q, k in enumerate(ks) if k not in seen), len(ks)))
        for q, k in enumerate(ks, 1):
            nxt = ks[q] if q < len(ks) else None
            if k in ended or children.get(k, set()) - {nxt}:
                pts.add(q)
        pts.discard(0)
        out.append(pts)
        for a, b in itertools.pairwise(ks):
            children.setdefault(a, set()).add(b)
        if ks:
            ended.add(ks[-1])
        seen.update(ks)
    return out


def split_design(
    keys: list[list[int]],
    pages: int,
    slots: int,
    cost: float,
    tail: int,
    weight: float | None = None,
) -> int:
    """Pages served by a fixed split, as the cache has it: ``pages`` pages and ``slots``
    checkpoints (of ``cost`` pages each: only the slots' count is used here), each in an
    eviction order of its own, LRU (``weight`` None) or GreedyDual (a request's pages worth
    its length ``n ** weight``, a checkpoint at ``p`` worth ``p ** weight / cost``, each above
    its own clock raised to what it evicts); checkpoints at each prompt's end, where it left
    the tree and ``tail`` pages before its end (the cache's defaults for a recurrent hybrid:
    ``tail`` 4, no interior ones)."""
    del cost  # (the split already spent it)
    held: list[dict[int, tuple[float, float]]] = [{}, {}]  # pages, checkpoints
    heaps: list[list[tuple[tuple[float, float], int]]] = [[], []]
    clocks = [0.0, 0.0]
    limits = (pages, slots)
    served = 0
    for t, ks in enumerate(keys):
        n = len(ks)
        m = 0
        while m < n and ks[m] in held[0]:
            m += 1
        q = next((p for p in range(m, 0, -1) if ks[p - 1] in held[1]), 0)
        served += q
        points = {p for p in ({n, m, n - tail} if tail else {n, m}) if p > max(q, 0)}
        points |= {q} if q else set()
        top = float(t) if weight is None else clocks[0] + n**weight
        for i, k in enumerate(ks, 1):
            held[0][k] = max(held[0].get(k, (top, -i)), (top, -i))
            heapq.heappush(heaps[0], (held[0][k], k))
        for p in points:
            k = ks[p - 1]
            held[1][k] = (float(t) if weight is None else clocks[1] + p**weight, -p - 0.5)
            heapq.heappush(heaps[1], (held[1][k], k))
        for side in (0, 1):
            while len(held[side]) > limits[side]:
                prio, k = heapq.heappop(heaps[side])
                if held[side].get(k) == prio:
                    del held[side][k]
                    clocks[side] = max(clocks[side], prio[0])
    return served


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default="mooncake_synthetic_1000")
    ap.add_argument("--capacities", default="3e5,3e6", help="L1 sizes in tokens")
    ap.add_argument("--host-ratio", type=float, default=4.0)
    ap.add_argument("--slots", default="1,2,3,5,10,20,40,80,160")
    ap.add_argument(
        "--every", default="4,16,64,0", help="online policies' checkpoint intervals (0: none)"
    )
    ap.add_argument("--tail", type=int, default=4, help="the online designs' tail checkpoint")
    ap.add_argument(
        "--shares", default="0.1,0.2,0.3", help="state shares of the fixed-split designs"
    )
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    trace = load_trace(args.trace, block_size=PAGE, limit=args.limit)
    spec = state_spec("R3:F1", PAGE)
    cost = slot_bytes(spec) / spec.page_bytes  # a slot in pages
    keys_of = PageKeys(PAGE)
    keys = [keys_of(r.tokens()) for r in trace.requests]
    prompt_pages = sum(len(k) for k in keys)
    print(
        f"{trace.path}: {len(trace.requests)} requests, {prompt_pages:,} prompt pages of "
        f"{PAGE} tokens; R3:F1, a checkpoint {cost:.2f} pages; L2 {args.host_ratio:g}x"
    )
    everies = [int(x) for x in args.every.split(",") if x.strip()]
    out: list[dict[str, Any]] = []
    for cap in (float(x) for x in args.capacities.split(",")):
        l1 = int(cap) // PAGE
        total = l1 + int(round(args.host_ratio * l1))
        hits = oracle_hits(keys, total)
        oracle = sum(hits)
        rows = []
        best = best_any = 0.0
        for k in (int(x) for x in args.slots.split(",")):
            pages = total - int(np.ceil(k * cost))
            if pages < 1:
                continue
            pb = float(sum(oracle_hits(keys, pages)))
            any_ = slots_bound(keys, hits, k)
            online = {e: slots_bound(keys, hits, k, e) for e in everies}
            best_any = max(best_any, min(any_, pb))
            best = max(best, min(max(online.values()), pb))
            bound = min(max(online.values()), pb)
            rows.append(
                [k, pages, pb / oracle, any_ / oracle, *(v / oracle for v in online.values())]
                + [bound / oracle]
            )
            out.append({"l1_tokens": cap, "slots": k, "pages": pages, "pages_bound": pb,
                        "slots_bound_any": any_, "slots_bound_online": online,
                        "oracle": oracle})  # fmt: skip
        print_table(
            [
                "slots K",
                "pages B-cK",
                "pages bound",
                "slots: any",
                *(f"slots: every {e}" for e in everies),
                "bound (online)",
            ],
            rows,
            title=f"L1 {cap:,.0f} tokens ({l1} pages), B = {total} pages: bounds over the "
            f"oracle's {oracle} hit pages",
        )
        weights = (None, 1.0, 2.0)
        print_table(
            ["ckpt every", "unified LRU", "GreedyDual p", "GreedyDual p^2"],
            [[e, *(unified_lru(keys, total, cost, e, w) / oracle for w in weights)]
             for e in everies]
            + [[f"0, tail {args.tail}",
                *(unified_lru(keys, total, cost, 0, w, args.tail) / oracle for w in weights)]],
            title=f"L1 {cap:,.0f} tokens: online designs without a split, over the oracle "
            "(achieved, not bounds)",
        )  # fmt: skip
        split_rows = []
        for share in (float(x) for x in args.shares.split(",") if x.strip()):
            k = max(1, int(share * total / cost))
            p = int(total - k * cost)
            split_rows.append(
                [share, f"{p}/{k}",
                 *(split_design(keys, p, k, cost, args.tail, w) / oracle for w in (None, 2.0))]
            )  # fmt: skip
        print_table(
            ["state share", "pages/slots", "LRU", "GreedyDual p^2"],
            split_rows,
            title=f"L1 {cap:,.0f} tokens: a fixed split (the cache's), checkpoints at ends, "
            f"branch points and a tail of {args.tail}, over the oracle (achieved)",
        )
        for name, b in (
            ("a clairvoyant policy's", best_any),
            ("an online-checkpointing (clairvoyantly kept) policy's", best),
        ):
            verdict = "reachable" if b / oracle >= TARGET else "UNREACHABLE"
            print(
                f"{name} bound at the best fixed split: {b / oracle:.3f} of the oracle against "
                f"the target >= {TARGET}: {verdict} (LRU-ordered pages)"
            )
    write_json(args.json, NAME, vars(args), {"rows": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
