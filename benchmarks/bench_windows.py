"""The bytes a cached prefix holds on each tier with window groups, beside the all-full model's.

A 5:1 model (five sliding-window layers of window ``W`` beside each full-attention layer, every
layer of one KV shape) serves one prompt of ``n`` tokens through the request handle; then, on
each tier, the bytes its cached prefix holds: the full-attention pages plus the window pages the
tree keeps (``stats()``: ``device_used_pages`` / ``window_device_used_pages``, the host's after
a write-through backup, L3's (a file store, write-through: the entries it stored), and the
device's again after an eviction to host and a load-back;
window pages no node end reads stay as spare pages while their pool has room
(``window_spare``, default on): reclaimable, so they are counted apart, "+spare"). The
limit it is judged against: the all-full model's bytes for the same prefix, whose share is
``1/6 + 5/6 * W/n`` when a node keeps exactly the last ``W`` tokens' pages (``W`` a multiple of
the page size; otherwise it keeps the pages overlapping them: up to one page more). Target:
each tier's share within 5% of the formula for prompts much longer than ``W``.

Usage: ``python -m benchmarks.bench_windows [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from typing import Any

import numpy as np

from benchmarks.common import print_table, write_json

PATTERN, LAYERS, HEADS, DIM, PAGE = "5:1", 12, 2, 64, 16
TARGET = 0.05


def _serve(cache: Any, tokens: np.ndarray) -> None:
    with cache.begin(tokens) as req:
        req.extend(tokens.size - req.cached_len)
        req.finish(tokens)


def measure(window: int, n: int) -> dict[str, Any]:
    """Bytes the prefix of one ``n``-token prompt holds on each tier (see module doc)."""
    from hicache_jax import HiCache, HiCacheConfig, KVSpec

    spec = KVSpec.from_pattern(
        PATTERN,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype="bfloat16",
        page_size=PAGE,
        window=window,
    )
    pages = n // PAGE
    store = tempfile.mkdtemp(prefix="bench_windows_")
    cfg = HiCacheConfig(
        device_pages=pages + 8,
        host_pages=pages + 8,
        write_policy="write_through",
        load_back_threshold=PAGE,
        storage=f"file://{store}",
    )
    full_b, win_b = spec.page_bytes, spec.window_groups[0].spec(PAGE).page_bytes
    all_full = pages * spec.model_page_bytes
    cache = HiCache(spec, cfg)
    try:
        tokens = np.arange(n, dtype=np.int32)
        _serve(cache, tokens)
        cache.flush()
        st = cache.stats()
        dev_spare, host_spare = st["window_device_spare_pages"], st["window_host_spare_pages"]
        device = (
            st["device_used_pages"] * full_b + (st["window_device_used_pages"] - dev_spare) * win_b
        )
        host = st["host_used_pages"] * full_b + (st["window_host_used_pages"] - host_spare) * win_b
        l3 = st["l3_put_pages_stored"] * full_b + st["l3_window_put_pages_stored"] * win_b
        cache.evict(n)  # to host only (backed up), then served back from it
        _serve(cache, tokens)
        cache.flush()
        st = cache.stats()
        assert st["load_backs"] > 0 and st["served_host_tokens"] == n
        loaded = (
            st["device_used_pages"] * full_b
            + (st["window_device_used_pages"] - st["window_device_spare_pages"]) * win_b
        )
    finally:
        cache.close()
        shutil.rmtree(store, ignore_errors=True)
    formula = 1 / 6 + 5 / 6 * window / n
    shares = {
        "device": device / all_full,
        "host": host / all_full,
        "l3": l3 / all_full,
        "loaded": loaded / all_full,
    }
    return {
        "window": window,
        "n": n,
        "formula": formula,
        "device_spare_share": dev_spare * win_b / all_full,
        "host_spare_share": host_spare * win_b / all_full,
        **{f"{k}_share": v for k, v in shares.items()},
        **{f"{k}_vs_formula": v / formula for k, v in shares.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two prompt lengths only")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    lengths = [1024, 4096] if a.quick else [1024, 2048, 4096, 8192]
    rows = [measure(w, n) for w in (128, 100) for n in lengths]
    print_table(
        [
            "W",
            "n",
            "formula",
            "L1 share",
            "L2 share",
            "L3 share",
            "L1 after load",
            "L1/formula",
            "L2/formula",
            "L3/formula",
            "+spare L1",
            "+spare L2",
        ],
        [
            (
                r["window"],
                r["n"],
                r["formula"],
                r["device_share"],
                r["host_share"],
                r["l3_share"],
                r["loaded_share"],
                r["device_vs_formula"],
                r["host_vs_formula"],
                r["l3_vs_formula"],
                r["device_spare_share"],
                r["host_spare_share"],
            )
            for r in rows
        ],
        title=f"bytes a cached prefix holds ({PATTERN}, page {PAGE}) over the all-full model's",
    )
    worst = max(
        abs(r[f"{t}_vs_formula"] - 1) for r in rows for t in ("device", "host", "l3", "loaded")
    )
    ok = worst <= TARGET
    print(
        f"target every tier within 5% of 1/6 + 5/6*W/n: worst {worst:.1%} "
        f"({'met' if ok else 'MISSED'})"
    )
    write_json(
        a.json,
        "bench_windows",
        {"pattern": PATTERN, "layers": LAYERS, "page_size": PAGE, "lengths": lengths},
        rows,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
