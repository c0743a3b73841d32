"""What a split that moves at run time would serve of a sliding-window model: the pages and
window pages of one byte budget in one eviction order, beside the fixed split the cache has,
in one page-level simulation (ARCHITECTURE.md, "Layer groups"; the replay through the real
cache: ``bench_windows_replay``).

The question: ``bench_windows_replay`` misses its target (the windowed model's hit ratio >= 0.97
of an exact LRU of an all-full cache of ``r`` times the bytes, ``r`` the measured bytes ratio per
cached token) at four of twelve sizes, and no fixed split rule closes them without costing other
traces' hits. A cache whose tier bytes are one budget, its full-attention pages and window pages
taken from it as the run needs them, is a build of several sessions (one raw pool per tier with
per-group page tables, every copy program and the engine's forward reading through them). This
simulation says what such a design would serve on the same trace before it is built.

Model (one tier of ``B`` bytes, L1 + L2 together, as ``bench_state_bound``; a 5:1 model: a page
costs 1 unit of full-attention KV and 5 units of window KV, the all-full model 6): a request of
``n`` pages is served up to the deepest ``q`` such that pages ``1..q`` hold full-attention KV and
the ``k = ceil(W / page)`` pages before ``q`` hold window KV; then every page of it holds both.
Node ends are prompt ends and the points where a prompt met the cached tree (branch points) and
was served; the window KV of the ``k`` pages before a held end is **firm**, the rest **spare**.
Designs:

- **fixed split** (the cache's structure): ``F`` full pages and ``N_w`` window pages, each in an
  order of its own: spare window pages go first, lowest rank first (the cache's
  ``window_ranks``), oldest first within a rank; pages by LRU or GreedyDual
  (a request's pages worth ``clock + n ** 2``, the cache's ``value``); where firm window pages
  alone overfill their pool, pages are evicted until they fit. ``--shares`` of the bytes in
  window pages, and the cache's default rule's share (``default``, from
  :func:`hicache_jax.replay.windows.tier_pools` of the budget, as one tier);
- **one budget, spare first**: the window pool takes whatever bytes the pages leave (spare
  window pages freed first, oldest first, then pages in the same order as the fixed split);
- **one budget, LRU**: pages and window KV in one LRU, each touched when read or written;
- **one budget, value over both**: GreedyDual over pages (``n ** 2``) and spare window KV (the
  prefix ``d`` pages deep that it serves, per its bytes: ``d ** 2 / 5``) in one order: the one
  worth less goes.

Per design: the hit ratio, ``r`` (the all-full model's bytes of the pages held over the bytes
held, averaged after every request), the exact LRU of ``r x B`` all-full pages over the same
trace, and the ratio (target >= 0.97).

Usage: ``python -m benchmarks.bench_windows_bound [TRACE] [--capacities 1e5,3e5,1e6,3e6]
[--host-ratios 2,4,8] [--shares 0.2,0.4,0.6] [--limit N] [--json P]``.
"""

from __future__ import annotations

import argparse
import heapq

from benchmarks.common import print_table, write_json
from hicache_jax.replay.block_lru import BlockLRU, PageKeys
from hicache_jax.replay.windows import pattern_spec, prompt_tokens, tier_pools
from hicache_jax.study import load_trace

NAME = "bench_windows_bound"
TARGET = 0.97
PAGE = 512
WINDOW = 1024
FULL, WIN = 1, 5  # units of a page's full-attention and window KV (5:1)


class Sim:
    """One design over a trace's page keys (module docstring).

    Args:
        budget: units of bytes (``FULL`` a page's full-attention KV, ``WIN`` its window KV).
        window_cap: the fixed split's window pages (None: one budget).
        policy: "lru" or "value" for pages (spare window KV apart); "unified": pages and
            window KV in one LRU; "value-all": pages and spare window KV in one GreedyDual.
        k: window pages a continuation reads.
    """

    def __init__(self, budget: int, window_cap: int | None, policy: str, k: int) -> None:
        self.budget, self.window_cap, self.policy, self.k = budget, window_cap, policy, k
        self.page_prio: dict[int, tuple[float, int]] = {}
        self.win_prio: dict[int, tuple[float, int]] = {}
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}  # cached children per page
        self.firm: dict[int, int] = {}  # ends reading a page's window KV
        self.ends: set[int] = set()
        self.heap: list[tuple[tuple[float, int], int, int]] = []  # (prio, is window, key)
        self.spare: list[tuple[tuple[int, float], tuple[float, int], int]] = []
        self.clock = 0.0
        self.r_sum = 0.0
        self.served = self.requests = 0

    def window_of(self, key: int) -> list[int]:
        """The pages whose window KV a continuation at ``key``'s end reads."""
        out: list[int] = []
        node: int | None = key
        while node is not None and len(out) < self.k:
            out.append(node)
            node = self.parent.get(node)
        return out

    def serve(self, ks: list[int], t: int) -> int:
        n = len(ks)
        m = 0
        while m < n and ks[m] in self.page_prio:
            m += 1
        q = m
        while q > 0 and any(j not in self.win_prio for j in ks[max(0, q - self.k) : q]):
            q -= 1
        valued = self.policy in ("value", "value-all")
        prio = self.clock + float(n) ** 2 if valued else float(t)
        for i, key in enumerate(ks):
            if key not in self.parent:
                self.parent[key] = ks[i - 1] if i else None
            if key not in self.page_prio:
                par = self.parent[key]
                if par is not None:
                    self.children[par] = self.children.get(par, 0) + 1
            p = (prio, -i)
            if self.policy in ("value", "value-all"):
                p = max(p, self.page_prio.get(key, p))
            self.page_prio[key] = p
            heapq.heappush(self.heap, (p, 0, key))
        for i in range(max(0, q - self.k), n):  # window KV read (before q) or written
            key, wp = ks[i], (float(t), -i)
            self.win_prio[key] = wp
            if self.policy == "unified":
                heapq.heappush(self.heap, (wp, 1, key))
            elif self.policy == "value-all":  # worth the prefix it serves, per its bytes
                self.win_prio[key] = (self.clock + float(i + 1) ** 2 * FULL / WIN, -i)
        for e in {n, m, q} - {0}:
            key = ks[e - 1]
            if key not in self.ends:
                self.ends.add(key)
                for j in self.window_of(key):
                    self.firm[j] = self.firm.get(j, 0) + 1
        for key in ks[max(0, q - self.k) :]:
            if not self.firm.get(key):
                self._push_spare(key)
        self._fit()
        self.served += q
        self.requests += 1
        nf, nw = len(self.page_prio), len(self.win_prio)
        self.r_sum += (FULL + WIN) * nf / max(1, FULL * nf + WIN * nw)
        return q

    def _used(self) -> int:
        return FULL * len(self.page_prio) + WIN * len(self.win_prio)

    def _fit(self) -> None:
        cap = self.window_cap
        if cap is not None:
            while len(self.win_prio) > cap and self._drop_spare():
                pass
            while len(self.win_prio) > cap and self._drop_page():
                pass
            while FULL * len(self.page_prio) > self.budget - WIN * cap and self._drop_page():
                pass
            return
        if self.policy == "value-all":
            while self._used() > self.budget and self._drop_cheapest():
                pass
        elif self.policy != "unified":
            while self._used() > self.budget and self._drop_spare():
                pass
        while self._used() > self.budget and self._drop_page():
            pass

    def _push_spare(self, key: int) -> None:
        """``key``'s window KV joins the spare order: lowest rank first (the cache's
        ``window_ranks``: the largest trailing-zero count of the ends, in pages from the root,
        that read it), oldest first within a rank."""
        depth = -self.win_prio[key][1] + 1
        rank = max(((e & -e).bit_length() for e in range(depth, depth + self.k)), default=0)
        order = self.win_prio[key] if self.policy == "value-all" else (rank, self.win_prio[key][0])
        heapq.heappush(self.spare, (order, self.win_prio[key], key))

    def _drop_spare(self) -> bool:
        while self.spare:
            _, prio, key = heapq.heappop(self.spare)
            if self.win_prio.get(key) == prio and not self.firm.get(key):
                del self.win_prio[key]
                return True
        return False

    def _drop_cheapest(self) -> bool:
        """``value-all``: a spare window KV or a page, whichever is worth less."""
        spare, heap = self.spare, self.heap
        while spare and (
            self.win_prio.get(spare[0][2]) != spare[0][1] or self.firm.get(spare[0][2])
        ):
            heapq.heappop(spare)  # stale, or firm again
        while heap and (
            self.page_prio.get(heap[0][2]) != heap[0][0] or self.children.get(heap[0][2])
        ):
            heapq.heappop(heap)  # stale, or a parent of held pages (pushed again as a leaf)
        if self.spare and (not self.heap or self.spare[0][1][0] <= self.heap[0][0][0]):
            _, prio, key = heapq.heappop(self.spare)
            del self.win_prio[key]
            self.clock = max(self.clock, prio[0])
            return True
        return self._drop_page()

    def _drop_page(self) -> bool:
        while self.heap:
            prio, is_win, key = heapq.heappop(self.heap)
            if is_win:
                if self.win_prio.get(key) == prio:
                    del self.win_prio[key]
                    return True
                continue
            if self.page_prio.get(key) != prio or self.children.get(key):
                continue  # stale, or a parent of held pages (they go first)
            self._remove(key)
            if self.policy in ("value", "value-all"):
                self.clock = max(self.clock, prio[0])
            return True
        return False

    def _remove(self, key: int) -> None:
        del self.page_prio[key]
        self.win_prio.pop(key, None)
        par = self.parent.get(key)
        if par is not None:
            self.children[par] -= 1
            if not self.children[par]:
                del self.children[par]
                heapq.heappush(self.heap, (self.page_prio[par], 0, par))  # a leaf now
        if key in self.ends:
            self.ends.discard(key)
            for j in self.window_of(key):
                self.firm[j] -= 1
                if not self.firm[j]:
                    del self.firm[j]
                    if j in self.win_prio:
                        self._push_spare(j)


def lru_hits(keys: list[list[int]], pages: int) -> int:
    lru = BlockLRU(max(1, pages))
    return sum(lru.serve(k) for k in keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default="mooncake_synthetic_1000")
    ap.add_argument("--capacities", default="1e5,3e5,1e6,3e6", help="L1 sizes in tokens")
    ap.add_argument("--host-ratios", default="2,4,8")
    ap.add_argument("--shares", default="0.2,0.4,0.6", help="fixed splits' window shares")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    trace = load_trace(args.trace, block_size=PAGE, limit=args.limit)
    spec = pattern_spec("5:1", WINDOW, PAGE)
    assert (spec.page_bytes, spec.model_page_bytes) == (FULL * 8 * PAGE, (FULL + WIN) * 8 * PAGE)
    k = -(-WINDOW // PAGE)
    keys_of = PageKeys(PAGE)
    keys = [keys_of(r.tokens()) for r in trace.requests]
    total_pages = sum(len(x) for x in keys)
    longest, mean = prompt_tokens(trace)
    print(
        f"{trace.path}: {len(trace.requests)} requests, {total_pages:,} prompt pages of {PAGE} "
        f"tokens; 5:1, W {WINDOW} ({k} pages); one tier of L1 + L2"
    )
    shares = [float(x) for x in args.shares.split(",") if x.strip()]
    rows, out, met = [], [], {}
    for cap in (float(x) for x in args.capacities.split(",")):
        for ratio in (float(x) for x in args.host_ratios.split(",")):
            model_pages = int(cap) // PAGE + int(round(ratio * (int(cap) // PAGE)))
            budget = model_pages * (FULL + WIN)
            _, n_w = tier_pools(spec, model_pages * spec.model_page_bytes, longest, mean,
                                  requests=True)  # fmt: skip
            designs: dict[str, tuple[int | None, str]] = {
                "fixed default, lru": (n_w, "lru"),
                "fixed default, value": (n_w, "value"),
            }
            for s in shares:
                designs[f"fixed {s:g}, value"] = (int(s * budget) // WIN, "value")
            designs |= {
                "one budget, spare first, lru": (None, "lru"),
                "one budget, spare first, value": (None, "value"),
                "one budget, lru": (None, "unified"),
                "one budget, value over both": (None, "value-all"),
            }
            for name, (wcap, policy) in designs.items():
                sim = Sim(budget, wcap, policy, k)
                for t, ks in enumerate(keys):
                    sim.serve(ks, t)
                r = sim.r_sum / max(1, sim.requests)
                ref = lru_hits(keys, int(r * model_pages))
                vs = sim.served / ref if ref else None
                ok = vs is not None and vs >= TARGET
                met.setdefault(name, []).append(ok)
                rows.append([f"{int(cap):,}", f"{ratio:g}x", name, sim.served / total_pages, r,
                             ref / total_pages, vs])  # fmt: skip
                out.append({"l1_tokens": cap, "host_ratio": ratio, "design": name,
                            "hit_ratio": sim.served / total_pages, "r": r,
                            "lru_r_bytes_hit_ratio": ref / total_pages, "vs": vs})  # fmt: skip
    print_table(
        ["L1 tokens", "L2", "design", "hit ratio", "r", "LRU(r x B)", "hit / LRU(r x B)"],
        rows,
        title="one tier of L1 + L2 bytes, page-level simulation (target >= 0.97)",
    )
    for name, oks in met.items():
        print(f"{name}: {sum(oks)} of {len(oks)} rows at >= {TARGET}")
    write_json(args.json, NAME, vars(args), {"rows": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
