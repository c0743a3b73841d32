"""HiCache benchmark: the multi-turn trace of bench_tree served through HiCache with real KV bytes.

For each write policy, the device pool holds ~25% of the trace's working set (distinct cached
tokens at infinite capacity) and the host pool 4x the device pool. Every request runs the
request flow through the cache's handle (begin: match, load back, lock; extend; write_kv of
the new pages' KV, real bytes; finish: insert, unlock). Reported per policy:

* token hit ratio by tier (device hits, host hits that were loaded back), tokens that would be
  recomputed, and the total hit ratio beside the **infinite-cache** hit ratio of the same trace
  (the limit; target: >= 95% of it) and beside a **device-only** radix cache of the same device
  size (HiCache with no host pool);
* bytes moved each way and the transfer engine's mean GB/s beside ``numpy.copyto`` of the same
  bytes (memcpy, measured in the same run);
* time in cache calls with the real KV vs the same trace with a 1-element page (bookkeeping
  only: transfers of ~nothing), so the table separates cache bookkeeping from data movement.

Usage: ``python -m benchmarks.bench_hicache [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from benchmarks.bench_tree import make_trace
from benchmarks.bench_tree import replay as tree_replay
from benchmarks.common import env_info, gbps, memcpy_seconds, print_table, write_json
from hicache_jax import HiCache, HiCacheConfig, KVSpec
from hicache_jax.cli.results import figure

POLICIES = ("write_through", "write_through_selective", "write_back")
TARGET = 0.95  # HiCache (host = 4x device) hit ratio / infinite-cache hit ratio


def size_pools(
    trace, page_size: int, device_fraction: float, host_ratio: float
) -> tuple[dict, int, int, int]:
    """Replay ``trace`` at infinite capacity and size the pools from its working set.

    Returns:
        (infinite-capacity replay stats, working-set pages, device pages, host pages): the
        device pool holds ``device_fraction`` of the working set (at least two of the longest
        requests, so nothing fails for lack of room), the host pool ``host_ratio`` times that.
    """
    total_pages = sum(p.shape[0] + r.shape[0] for p, r in trace) // page_size + 1
    inf = tree_replay(trace, page_size, total_pages, "lru")
    working = inf["device_tokens_end"] // page_size
    longest = max(p.shape[0] + r.shape[0] for p, r in trace) // page_size
    device = max(int(working * device_fraction), 2 * longest)
    return inf, working, device, int(device * host_ratio)


def serve(trace, spec: KVSpec, cfg: HiCacheConfig, *, repeats: int = 3) -> dict:
    """Serve the trace ``repeats`` times (fresh caches) after one untimed warm-up run that pays
    the jit compiles; hit counts are identical across runs, times are medians."""
    serve_once(trace, spec, cfg)
    runs = [serve_once(trace, spec, cfg) for _ in range(repeats)]
    out = runs[0]
    for key in ("cache_seconds", "write_kv_seconds"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def serve_once(trace, spec: KVSpec, cfg: HiCacheConfig) -> dict:
    """Replay the trace through a fresh HiCache; return hit tokens by tier, bytes and times."""
    cache = HiCache(spec, cfg)
    ps = spec.page_size
    longest = max(p.shape[0] + r.shape[0] for p, r in trace) // ps
    kv = np.random.default_rng(0).integers(0, 0x3F80, spec.kv_shape(longest), dtype=np.uint16)
    dev_hit = host_hit = prompt = 0
    t_cache = t_write = 0.0
    pc = time.perf_counter
    for p, r in trace:
        seq = np.concatenate([p, r])
        seq = seq[: seq.shape[0] // ps * ps]  # whole pages: what the cache keeps
        t0 = pc()
        req = cache.begin(p)  # match, load back, lock
        new = req.extend(seq.shape[0] - req.cached_len)
        t1 = pc()
        cache.write_kv(new, kv[:, :, : new.shape[0]])  # stands in for the model's prefill
        t2 = pc()
        req.finish(seq)  # insert, unlock
        t_cache += (t1 - t0) + (pc() - t2)
        t_write += t2 - t1
        dev_hit += req.cached_len - req.loaded_len
        host_hit += req.loaded_len
        prompt += p.shape[0]
    t0 = pc()
    cache.flush()
    t_cache += pc() - t0
    s = cache.stats()
    return {
        "prompt_tokens": prompt,
        "device_hit_tokens": dev_hit,
        "host_hit_tokens": host_hit,
        "recomputed_tokens": prompt - dev_hit - host_hit,
        "hit_ratio": (dev_hit + host_hit) / prompt,
        "cache_seconds": t_cache,
        "write_kv_seconds": t_write,
        "stats": s,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=256)
    ap.add_argument("--reply-tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--device-fraction", type=float, default=0.25)
    ap.add_argument("--host-ratio", type=float, default=4.0)
    ap.add_argument("--eviction", default="lru")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small trace")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.concurrency, args.turns = 24, 8, 4
    ps = args.page_size
    env = env_info()
    print(
        f"bench_hicache: {env['date']}  backend {env['backend']} ({env['device_kind']})  "
        f"jax {env['jax']}  cpus {env['cpu_count']}"
    )

    trace = make_trace(args)
    inf, working, device, host = size_pools(trace, ps, args.device_fraction, args.host_ratio)
    inf_ratio = inf["hit_tokens"] / inf["prompt_tokens"]
    spec = KVSpec(args.layers, args.kv_heads, args.head_dim, "bfloat16", page_size=ps)
    tiny = KVSpec(1, 1, 1, "bfloat16", page_size=ps)
    print(
        f"trace: {len(trace)} requests, {inf['prompt_tokens']:,} prompt tokens, working set "
        f"{working} pages; device {device} pages ({device / working:.0%}), host {host} pages; "
        f"page {spec.page_bytes / 1024:.0f} KiB"
    )

    base = dict(device_pages=device, eviction=args.eviction, load_back_threshold=ps)
    runs = {"device_only": serve(trace, spec, HiCacheConfig(host_pages=0, **base))}
    for policy in POLICIES:
        cfg = HiCacheConfig(host_pages=host, write_policy=policy, **base)
        runs[policy] = serve(trace, spec, cfg)
        runs[policy]["bookkeeping"] = serve(
            trace, tiny, HiCacheConfig(host_pages=host, write_policy=policy, **base)
        )["cache_seconds"]

    dev_only = runs["device_only"]["hit_ratio"]
    rows = []
    for name, r in runs.items():
        p = r["prompt_tokens"]
        rows.append(
            [
                name,
                r["device_hit_tokens"] / p,
                r["host_hit_tokens"] / p,
                r["hit_ratio"],
                inf_ratio,
                r["hit_ratio"] / inf_ratio,
                r["hit_ratio"] / dev_only,
                r["recomputed_tokens"],
            ]
        )
    print_table(
        [
            "policy",
            "device hit",
            "host hit",
            "hit ratio",
            "infinite",
            "vs inf",
            "vs device-only",
            "recomputed tok",
        ],
        rows,
        title=f"\nHit ratios (target: vs inf >= {TARGET})",
    )

    moved = max(
        max(r["stats"]["bytes_to_host"], r["stats"]["bytes_to_device"]) for r in runs.values()
    )
    mem_s = memcpy_seconds(max(moved // 8, spec.page_bytes)) * 8 if moved else 0.0
    mem_gbps = gbps(moved, mem_s) if moved else float("nan")
    rows = []
    for name, r in runs.items():
        s = r["stats"]
        nbytes = s["bytes_to_host"] + s["bytes_to_device"]
        book = r.get("bookkeeping", float("nan"))
        movement = r["cache_seconds"] - book
        eff = gbps(nbytes, movement) if nbytes and movement > 0 else float("nan")
        r["movement_seconds"], r["movement_gbps"] = movement, eff
        rows.append(
            [
                name,
                s["bytes_to_host"] / 1e6,
                s["bytes_to_device"] / 1e6,
                r["cache_seconds"],
                book,
                movement,
                eff,
                mem_gbps,
                eff / mem_gbps,
                s["mean_transfer_gbps"],
                r["write_kv_seconds"],
                s["backups"],
                s["load_backs"],
                s["evictions"],
                s["host_evictions"],
            ]
        )
    print_table(
        [
            "policy",
            "MB to host",
            "MB to device",
            "cache s",
            "bookkeeping s",
            "movement s",
            "moved GB/s",
            "memcpy GB/s",
            "ratio",
            "engine GB/s",
            "write_kv s",
            "backups",
            "load_backs",
            "evictions",
            "host evict",
        ],
        rows,
        title="\nData movement and time. cache s: every cache call, real KV; "
        "bookkeeping s: same trace with 2-byte pages (medians of 3);\nmovement s = "
        "the difference (copies are asynchronous: only waits show; < 0 is noise); "
        "moved GB/s = bytes both ways / movement s;\nengine GB/s: bytes / "
        "(dispatch -> completion seen at a later poll), a lower bound",
    )
    ok = all(runs[p]["hit_ratio"] / inf_ratio >= TARGET for p in POLICIES)
    print(f"\ntarget hit/inf >= {TARGET}: {'met' if ok else 'NOT met'} for all write policies")
    config = {
        **vars(args),
        "device_pages": device,
        "host_pages": host,
        "working_set_pages": working,
        "page_bytes": spec.page_bytes,
    }
    results = {
        "infinite_hit_ratio": inf_ratio,
        "memcpy_gbps": mem_gbps,
        **{k: dict(v) for k, v in runs.items()},
    }
    figures = [
        figure(
            f"hit ratio {name}",
            "share",
            r["hit_ratio"],
            "infinite cache, same trace",
            inf_ratio,
            "bench_hicache",
            higher_is_better=True,
        )
        for name, r in runs.items()
    ] + [
        figure(
            f"moved GB/s {name}",
            "GB/s",
            r["movement_gbps"],
            "numpy memcpy of the same bytes",
            mem_gbps,
            "bench_hicache",
            higher_is_better=True,
        )
        for name, r in runs.items()
        if math.isfinite(r["movement_gbps"]) and math.isfinite(mem_gbps)
    ]
    write_json(args.json, "bench_hicache", config, results, figures)


if __name__ == "__main__":
    main()
