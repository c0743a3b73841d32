"""Pins under pressure: a pinned system prompt keeps its hit rate through a Mooncake replay
that evicts it when unpinned (``HiCache.pin``, ARCHITECTURE.md "Control API").

The shipped slice of Mooncake's synthetic trace (one Mooncake block = one page of 512 tokens) is
replayed through the request handle, one request at a time, into two caches of the same size
(L1 only: ``host_pages=0``; LRU), and every ``--every``-th request is a "system prompt" request:
the same ``--system-pages`` pages followed by one page of its own. One cache pins the system
prompt (``tier="device"``) after its first request; the other does not. Each system-prompt
request's hit is read with ``cache.lookup`` (no side effect) just before it runs. What is
compared, in the same run: the hit rate of the system-prompt prefix, pinned vs unpinned, against
its limit (every use after the first a full hit), and the trace's own device hit rate in both
(what pinning costs the other requests).

Target: pinned, the system prompt's hit rate >= 0.95 of its limit; the unpinned figure shows
that the capacity evicts it otherwise.

Usage: ``python -m benchmarks.bench_pins [TRACE] [--device-pages 400] [--every 20]
[--system-pages 4] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.common import env_info
from hicache_jax import HiCache, HiCacheConfig, KVSpec
from hicache_jax.cli.results import figure
from hicache_jax.replay.trace import load_trace

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.join(HERE, "data", "mooncake_synthetic_1000.jsonl")


def _serve(cache: HiCache, tokens: np.ndarray) -> int:
    """One request through the handle; returns the tokens it found cached."""
    with cache.begin(tokens) as req:
        cached = req.cached_len
        req.extend(tokens.size - cached)
        req.finish(tokens)
    return cached


def replay(trace, args, pinned: bool) -> dict:
    ps = trace.block_size
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float16", page_size=ps)
    cache = HiCache(spec, HiCacheConfig(device_pages=args.device_pages, host_pages=0))
    base = (max(int(r.hash_ids.max()) for r in trace.requests) + 1) * ps
    system = np.arange(base, base + args.system_pages * ps, dtype=np.int64)
    sys_len, sys_hit, uses, trace_tok, trace_hit = system.size, 0, 0, 0, 0
    t0 = time.perf_counter()
    for i, r in enumerate(trace.requests):
        if i % args.every == 0:
            own = np.arange(ps, dtype=np.int64) + base + (args.system_pages + uses) * ps
            prompt = np.concatenate([system, own])
            if uses:  # the first use computes it: not counted either way
                sys_hit += min(cache.lookup(prompt)["device"], sys_len)
            _serve(cache, prompt)
            if pinned and uses == 0:
                cache.pin(system)
            uses += 1
        toks = r.tokens()
        toks = toks[: toks.size // ps * ps]
        trace_hit += _serve(cache, toks)
        trace_tok += toks.size
    seconds = time.perf_counter() - t0
    st = cache.stats()
    cache.check_invariants()
    cache.close()
    return {
        "pinned": pinned,
        "system_uses_counted": uses - 1,
        "system_hit_rate": sys_hit / (sys_len * (uses - 1)),
        "trace_hit_rate": trace_hit / trace_tok,
        "evictions": st["evictions"],
        "pinned_device_pages": st["pinned_device_pages"],
        "seconds": seconds,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--device-pages", type=int, default=400)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--system-pages", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    trace = load_trace(args.trace)
    rows = [replay(trace, args, pinned) for pinned in (False, True)]
    print(
        f"{len(trace.requests)} requests, L1 {args.device_pages} pages of {trace.block_size} "
        f"tokens, a {args.system_pages}-page system prompt every {args.every} requests"
    )
    print("| system prompt | its hit rate | x limit (1.0) | trace hit rate | evictions |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {'pinned' if r['pinned'] else 'unpinned'} | {r['system_hit_rate']:.3f} | "
            f"{r['system_hit_rate'] / 1.0:.3f}x | {r['trace_hit_rate']:.4f} | "
            f"{r['evictions']:,} |"
        )
    ratio = rows[1]["system_hit_rate"] / 1.0
    print(
        f"target pinned system-prompt hit rate >= 0.95 of the limit: {ratio:.3f}x, "
        f"{'met' if ratio >= 0.95 else 'MISSED'} (unpinned: "
        f"{rows[0]['system_hit_rate']:.3f}x)"
    )
    figures = [
        figure(
            f"system-prompt hit rate, {'pinned' if r['pinned'] else 'unpinned'}",
            "share",
            r["system_hit_rate"],
            "every system-prompt request a hit",
            1.0,
            "bench_pins",
            higher_is_better=True,
        )
        for r in rows
    ]
    out = {
        "benchmark": "bench_pins",
        "env": env_info(),
        "config": vars(args),
        "results": rows,
        "figures": figures,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
