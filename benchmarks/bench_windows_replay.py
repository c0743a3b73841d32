"""A sliding-window model at equal memory: Mooncake's trace through the windowed cache, beside the
exact LRU of an all-full cache (ARCHITECTURE.md, "Layer groups").

A 5:1 model (five sliding-window layers of ``W`` = 1024 tokens, then one full-attention layer,
repeating) with 512-token pages, at L1 capacities 1e5, 3e5, 1e6 and 3e6 tokens' worth of the
ALL-FULL model's bytes and L2 = 2x, 4x and 8x L1: each tier's bytes are split between the
full-attention pool and the window pools (:mod:`hicache_jax.replay.windows`: the default rule,
or ``--window-share F``), and the trace is replayed through the real cache
(:func:`hicache_jax.replay.driver.run`, the replay of ``hicache-jax replay --layer-pattern``).

Per row: the windowed cache's hit ratio; the bytes ratio ``r`` (all-full model bytes of the
full-attention pages it holds on both tiers over the bytes of the full and window pages it
uses, sampled after every request and averaged over the run); the exact LRU of an all-full
cache of ``r x`` the bytes of L1 + L2, and the hit ratio over it (judged: >= 0.97); the exact LRU
of an all-full cache of the same bytes (what the windows gain: the hit ratio over it); the window
pages' share of the bytes cached (mean); the tokens cut from matches because a window page a
continuation reads was not kept (``window_unservable_tokens``), and ``hit+cut``: the hit ratio
with those tokens added back (what the same cache would hit had it kept those window pages).

Usage: ``python -m benchmarks.bench_windows_replay [TRACE] [--capacities 1e5,3e5,1e6,3e6]
[--host-ratios 2,4,8] [--window 1024] [--window-share F] [--limit N] [--json P]`` (TRACE
defaults to benchmarks/data's ``mooncake_synthetic_1000``).
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import print_table, write_json
from hicache_jax.cli.results import figure
from hicache_jax.replay.driver import WINDOW_TARGET, run
from hicache_jax.replay.windows import check_share, pattern_spec
from hicache_jax.study import l1_pages, load_trace

NAME = "bench_windows_replay"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", default="mooncake_synthetic_1000")
    p.add_argument("--capacities", type=_floats, default=[1e5, 3e5, 1e6, 3e6])
    p.add_argument("--host-ratios", type=_floats, default=[2.0, 4.0, 8.0])
    p.add_argument("--layer-pattern", default="5:1")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=512)
    p.add_argument("--window-share", type=float, help="unset: the default rule")
    p.add_argument("--limit", type=int, help="first N requests only")
    p.add_argument("--json")
    a = p.parse_args(argv)
    share = check_share(a.window_share)
    trace = load_trace(a.trace, block_size=512, limit=a.limit)
    spec = pattern_spec(a.layer_pattern, a.window, a.page_size)
    pages = l1_pages(trace, a.page_size, capacities=a.capacities, name="--capacities")
    print(
        f"{trace.path}: {len(trace.requests)} requests, {trace.num_tokens:,} prompt tokens; "
        f"{a.layer_pattern} pattern, W {a.window}, page {a.page_size} tokens "
        f"({spec.describe_groups()}); window share: "
        + ("the default rule" if share is None else f"{share:g} of each tier's bytes"),
        flush=True,
    )
    rows, results, figures, misses = [], [], [], []
    for ratio in a.host_ratios:
        rep = run(trace, spec, device_pages=pages, host_ratio=ratio, window_share=share)
        results.append(rep)
        for r in rep["results"]:
            tokens, vs = r["device_pages"] * a.page_size, r["vs_lru_bytes_ratio"]
            ok = vs is not None and vs >= WINDOW_TARGET
            if not ok:
                misses.append(f"L1 {tokens:,} tokens, L2 {ratio:g}x: {vs}")
            pools = r["pools"]
            rows.append(
                (
                    f"{tokens:,}",
                    f"{ratio:g}x",
                    f"{pools['device_pages']}/{pools['window_device_pages']}",
                    f"{pools['host_pages']}/{pools['window_host_pages']}",
                    f"{pools['device_share']:.2f}/{pools['host_share']:.2f}",
                    f"{r['hit_ratio']:.4f}",
                    f"{r['bytes_ratio']:.2f}",
                    f"{r['lru_bytes_ratio_hit_ratio']:.4f}",
                    "-" if vs is None else f"{vs:.3f} {'ok' if ok else 'MISS'}",
                    f"{r['lru_total_hit_ratio']:.4f}",
                    "-" if r["vs_lru_total"] is None else f"{r['vs_lru_total']:.2f}",
                    f"{r['infinite_hit_ratio']:.4f}",
                    f"{r['window_bytes_share']:.3f}",
                    r["window_unservable_tokens"],
                    f"{r['hit_ratio'] + r['window_unservable_tokens'] / r['prompt_tokens']:.4f}",
                )
            )
            figures.append(_figure(r, tokens, ratio))
    print_table(
        (
            "L1 tokens",
            "L2",
            "L1 full/win pg",
            "L2 full/win pg",
            "win share L1/L2",
            "hit ratio",
            "r",
            "LRU(r x bytes)",
            f"hit/LRU(r) >= {WINDOW_TARGET:g}",
            "LRU(= bytes)",
            "gain",
            "infinite",
            "win bytes share",
            "unservable tok",
            "hit+cut",
        ),
        rows,
        title="windowed cache at the all-full model's bytes against the exact LRU of an "
        "all-full cache of r x those bytes (target >= 0.97) and of the same bytes (gain)",
    )
    print(
        f"all rows met {WINDOW_TARGET:g}"
        if not misses
        else f"below {WINDOW_TARGET:g} of LRU(r x bytes) in {len(misses)} of {len(rows)} rows"
    )
    config = {k: v for k, v in vars(a).items() if k != "json"} | {"spec": spec.as_json()}
    write_json(a.json, NAME, config, results, figures)


def _figure(r: dict[str, Any], tokens: int, ratio: float) -> dict[str, Any]:
    return figure(
        f"hit ratio windowed L1 {tokens} L2 {ratio:g}x",
        "share",
        r["hit_ratio"],
        "exact LRU of an all-full cache of r x the bytes",
        r["lru_bytes_ratio_hit_ratio"],
        NAME,
        higher_is_better=True,
    )


if __name__ == "__main__":
    main()
