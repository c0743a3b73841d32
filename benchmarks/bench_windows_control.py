"""The control plane with two layer groups: requests/s of a trace replay with a full-attention
group and a sliding-window group, beside the same replay with one full-attention group.

Replays a Mooncake-format trace (default: benchmarks/data/mooncake_synthetic_1000.jsonl,
``--passes`` times over in one replay) through :func:`hicache_jax.replay.driver.replay` (the
request handle, one request at a time; L1 1/8 of the trace's distinct pages, L2 4x, 512-token
pages), with a tiny KV so that what is timed is the bookkeeping: "one group" is the replay's
own spec (one layer, 8 bytes a token); "two groups" is a ``1:1`` pattern of the same layer
shape, one sliding-window layer (``--window``, default 1024 tokens) beside one full layer, with
window pools as large as the full ones (``HiCacheConfig`` default); "all full" is the same
two-layer model described as one full-attention group (the single-group cache of that model:
every page copies both layers); "two groups, no spare" is the two groups with
``window_spare=False`` (window pages no node end reads freed at insert: fewer copies, fewer hits
at split points), printed to show what the spare pages cost and what they keep. They take
turns, one untimed warm-up replay each first, medians of ``--repeats``. Target: two groups
within 1.3x of one group (requests/s ratio >= 1/1.3), printed against both single-group
caches. The hit figures are printed: the window cuts matches back to prefixes whose window
pages are held, so they may differ.

Usage: ``python -m benchmarks.bench_windows_control [TRACE] [--quick] [--repeats N]
[--limit N] [--passes K] [--window W] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "data" / "mooncake_synthetic_1000.jsonl"
MODES = ("one group", "two groups", "all full", "two groups, no spare")
TARGET = 1 / 1.3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(TRACE))
    ap.add_argument("--quick", action="store_true", help="200 requests, 1 pass, 2 repeats")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--passes", type=int, default=3, help="times over the trace per replay")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.limit, args.repeats, args.passes = args.limit or 200, 2, 1
    from benchmarks.common import print_table, write_json
    from hicache_jax import HiCacheConfig, KVSpec
    from hicache_jax.replay.block_lru import default_device_pages
    from hicache_jax.replay.driver import TINY_SPEC, replay
    from hicache_jax.replay.trace import load_trace

    block = 512
    trace = load_trace(args.trace, block_size=block, limit=args.limit)
    trace = dataclasses.replace(trace, requests=trace.requests * args.passes)
    shape: dict[str, Any] = dict(
        num_layers=2, num_kv_heads=1, head_dim=1, dtype="float32", page_size=block
    )
    specs = {
        "one group": KVSpec.parse(None, TINY_SPEC, page_size=block),
        "two groups": KVSpec.from_pattern("1:1", window=args.window, **shape),
        "all full": KVSpec.from_pattern("full", **shape),
    }
    pages = default_device_pages(trace, block)
    cfg = HiCacheConfig(device_pages=pages, host_pages=4 * pages, load_back_threshold=block)
    specs["two groups, no spare"] = specs["two groups"]
    cfgs = dict.fromkeys(MODES, cfg) | {
        "two groups, no spare": dataclasses.replace(cfg, window_spare=False)
    }
    for mode in MODES:  # warm-up: jit compiles
        replay(trace, specs[mode], cfgs[mode])
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for i in range(args.repeats):  # rotating, so that no mode always runs first
        k = i % len(MODES)
        for mode in MODES[k:] + MODES[:k]:
            runs[mode].append(replay(trace, specs[mode], cfgs[mode]))
    rps = {m: statistics.median(r["requests_per_s"] for r in runs[m]) for m in MODES}

    def paired(base: str, mode: str = "two groups") -> list[float]:  # mode / base, by repeat
        return [b["requests_per_s"] / a["requests_per_s"] for a, b in zip(runs[base], runs[mode])]

    pairs, pairs_full = paired("one group"), paired("all full")
    pairs_nospare = paired("one group", "two groups, no spare")
    ratio = rps["two groups"] / rps["one group"]
    ratio_full = rps["two groups"] / rps["all full"]
    ratio_nospare = rps["two groups, no spare"] / rps["one group"]
    hit = {
        m: (runs[m][0]["device_hit_tokens"] + runs[m][0]["host_hit_tokens"])
        / runs[m][0]["prompt_tokens"]
        for m in MODES
    }
    print_table(
        ["groups", "req/s median", "req/s min", "req/s max", "hit ratio", "vs one group"],
        [
            [
                m,
                f"{rps[m]:,.0f}",
                f"{min(r['requests_per_s'] for r in runs[m]):,.0f}",
                f"{max(r['requests_per_s'] for r in runs[m]):,.0f}",
                hit[m],
                rps[m] / rps["one group"],
            ]
            for m in MODES
        ],
        title=f"control plane, {len(trace.requests)} requests a replay, L1 {pages} pages, L2 4x",
    )
    print(f"paired ratios two/one: {', '.join(f'{p:.3f}' for p in pairs)}")
    print(f"paired ratios two/all full: {', '.join(f'{p:.3f}' for p in pairs_full)}")
    print(f"paired ratios two, no spare/one: {', '.join(f'{p:.3f}' for p in pairs_nospare)}")
    for name, r in (("one group of one layer", ratio), ("the model all full", ratio_full)):
        print(
            f"target two groups within 1.3x of {name} (ratio >= {TARGET:.3f}): "
            f"{r:.3f} ({'met' if r >= TARGET else 'MISSED'})"
        )
    print(
        f"without spare window pages (window_spare=False): {ratio_nospare:.3f} of one group "
        f"({'within' if ratio_nospare >= TARGET else 'beyond'} 1.3x), hit ratio "
        f"{hit['two groups, no spare']:.4f} against {hit['two groups']:.4f} with them (this "
        "slice, its window pools as large as the full ones, run three times over); the default "
        "keeps them for the split points they serve where window pools are smaller than the "
        "full ones (bench_windows_replay, RESULTS.md: without them its rows lose most hits)"
    )
    write_json(
        args.json,
        "bench_windows_control",
        {"trace": args.trace, "limit": args.limit, "passes": args.passes, "window": args.window},
        {
            "requests_per_s": rps,
            "ratio": ratio,
            "pairs": pairs,
            "ratio_all_full": ratio_full,
            "pairs_all_full": pairs_full,
            "ratio_no_spare": ratio_nospare,
            "pairs_no_spare": pairs_nospare,
            "hit_ratio": hit,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
