"""What the owning-thread check costs, beside the call it guards.

Every public call of :class:`~hicache_jax.HiCache` but ``stats()`` starts with one
``threading.get_ident()`` compared to the owner's (``HiCache._guard``). The limit it is judged
against: the run-to-run noise of a ``match_prefix`` (the interquartile range of its per-call
time over samples of the same call), measured in the same run. Target: guard < that noise.

Usage: ``python -m benchmarks.bench_guard [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import print_table, write_json
from hicache_jax import HiCache, HiCacheConfig, KVSpec
from hicache_jax.cli.results import figure


def per_call(fn, calls: int, samples: int) -> list[float]:
    """Seconds per call of ``fn()``, one figure per sample of ``calls`` calls."""
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--json", default=None, help="write raw figures here")
    args = ap.parse_args()
    calls, samples = (200, 15) if args.quick else (1000, 41)
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", page_size=16)
    cache = HiCache(spec, HiCacheConfig(device_pages=1024, host_pages=1024))
    rows, results, figures = [], {}, []
    for pages in (1, 64, 512):
        cache.reset()
        tokens = np.arange(pages * spec.page_size, dtype=np.int64)
        cache.insert(tokens, cache.alloc_pages(pages))
        match = per_call(lambda tokens=tokens: cache.match_prefix(tokens), calls, samples)
        guard = per_call(cache._guard, calls * 10, samples)
        q1, _, q3 = statistics.quantiles(match, n=4)
        m50, g50 = statistics.median(match), statistics.median(guard)
        rows.append([pages, m50 * 1e6, (q3 - q1) * 1e6, g50 * 1e6, g50 / m50, g50 / (q3 - q1)])
        results[pages] = {
            "match_p50_s": m50,
            "match_iqr_s": q3 - q1,
            "guard_p50_s": g50,
            "match_samples_s": match,
            "guard_samples_s": guard,
        }
        figures.append(
            figure(
                f"owning-thread check, prefix of {pages} pages",
                "us",
                g50 * 1e6,
                "match_prefix noise (IQR), same run",
                (q3 - q1) * 1e6,
                "bench_guard",
                higher_is_better=False,
            )
        )
    print_table(
        ["prefix pages", "match_prefix us", "its IQR us", "guard us", "guard/match", "guard/IQR"],
        rows,
        title="Owning-thread check vs match_prefix (target: guard/IQR < 1)",
    )
    ok = all(r[-1] < 1 for r in rows)
    print(f"\ntarget guard < match_prefix noise: {'met' if ok else 'NOT met'}")
    write_json(args.json, "bench_guard", {"calls": calls, "samples": samples}, results, figures)


if __name__ == "__main__":
    main()
