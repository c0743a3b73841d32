"""Device pool page movement: scatter (write) and gather (read) of k scattered pages.

Limit: ``numpy.copyto`` of the same bytes, measured in the same run. Targets:
scatter cost flat in pool size (2 GiB pool / 256 MiB pool <= 1.2) and <= 1.5x memcpy. A
bfloat16-typed pool row (the same donated scatter on a pool stored as bfloat16 instead of raw
bits) shows why the pool stores bits (ARCHITECTURE.md: the pool is stored as raw bits).

Page: 4 layers x 2 (K, V) x 16 tokens x 8 heads x 128 dims, bfloat16 = 256 KiB.

    python -m benchmarks.bench_pool [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    env_info,
    gbps,
    median_time,
    memcpy_fn,
    memcpy_seconds,
    print_table,
    write_json,
)
from hicache_jax.memory.device_pool import DevicePagePool
from hicache_jax.spec import KVSpec

MiB = 1 << 20
SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)


@functools.partial(jax.jit, donate_argnums=0)
def _typed_scatter(pool, page_ids, pages):
    """The naive pool: bfloat16 storage, the same donated ``.at[].set`` (comparison only)."""
    return pool.at[:, :, page_ids].set(pages)


def _pages(k: int, seed: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    bits = rng.integers(1, 2**16, size=SPEC.kv_shape(k), dtype=np.uint16)
    return jnp.asarray(bits.view(jnp.bfloat16))  # what a forward hands over: a bf16 device array


def paired_times(
    fn, nbytes: int, repeats: int, blocks: int = 5, same_work=None
) -> tuple[float, float, float, float | None]:
    """Median seconds of ``fn``, of ``numpy.copyto`` of ``nbytes``, their ratio, and the median
    seconds of ``same_work`` (numpy doing the same scatter / gather on a host pool) or None.

    They alternate in blocks of ``repeats`` back-to-back calls, so all see the same load
    (on a machine shared with other jobs a memcpy figure taken once drifts by 2-5x) while each
    runs in steady state (interleaving single calls made each one evict the other's caches
    and wake XLA's worker threads from sleep).
    """
    memcpy = memcpy_fn(nbytes)
    ts, ms, ws = [], [], []
    for _ in range(blocks):
        ms.append(median_time(memcpy, repeats=repeats, warmup=2))
        ts.append(median_time(fn, repeats=repeats, warmup=2))
        if same_work is not None:
            ws.append(median_time(same_work, repeats=repeats, warmup=2))
    t, m = statistics.median(ts), statistics.median(ms)
    return t, m, t / m, (statistics.median(ws) if ws else None)


def alloc_seconds(k: int, repeats: int) -> float:
    """A fresh k-page device buffer (what every read returns): page faults on first touch."""
    return median_time(
        lambda: jnp.zeros(SPEC.kv_shape(k), jnp.uint16).block_until_ready(),
        repeats=repeats,
        warmup=1,
    )


def _time_k(
    pool: DevicePagePool,
    host: np.ndarray,
    ids: np.ndarray,
    kv: jax.Array,
    repeats: int,
    pool_mib: int,
) -> list[dict]:
    """Scatter and gather rows of one k: ``pool`` against numpy on ``host``; the closures end
    with this frame, so the caller's ``del pool, host`` frees both."""
    k = len(ids)
    kv_host = np.asarray(kv).view(SPEC.bits_dtype)

    def write():
        pool.write(ids, kv)
        pool.array.block_until_ready()

    def read():
        pool.read(ids).block_until_ready()

    def np_scatter():
        for i, p in enumerate(ids):
            host[:, :, p] = kv_host[:, :, i]

    def np_gather():
        host[:, :, ids]  # a fresh k-page array, like read()

    rows = []
    for op, fn, same in (("scatter", write, np_scatter), ("gather", read, np_gather)):
        nbytes = k * SPEC.page_bytes
        t, m, ratio, w = paired_times(fn, nbytes, repeats, same_work=same)
        rows.append(
            dict(
                op=op,
                pool="bits",
                pool_mib=pool_mib,
                k=k,
                bytes=nbytes,
                seconds=t,
                memcpy_seconds=m,
                gbps=gbps(nbytes, t),
                vs_memcpy=ratio,
                numpy_same_seconds=w,
                vs_numpy_same=t / w,
            )
        )
    return rows


def bench_pool(pool_mib: int, ks: list[int], repeats: int, huge_pages: bool = True) -> list[dict]:
    """Scatter and gather rows for one pool size; the pool is freed on return."""
    num_pages = pool_mib * MiB // SPEC.page_bytes
    pool = DevicePagePool(SPEC, num_pages, huge_pages=huge_pages)
    print(f"pool {pool_mib} MiB: {pool.huge_page_bytes >> 20} MiB on huge pages", flush=True)
    # The same work done by numpy on a host pool of the same shape (page axis 2, so a page is
    # L * kvf strided chunks, like the device pool): scattered, cold destinations cost more
    # than the contiguous, cache-resident memcpy of the first limit, whoever copies.
    host = np.zeros(SPEC.kv_shape(num_pages + 1), SPEC.bits_dtype)
    rng = np.random.default_rng(pool_mib)
    rows = []
    for k in ks:
        ids = rng.choice(num_pages, size=k, replace=False).astype(np.int32)
        kv = _pages(k, k)
        rows += _time_k(pool, host, ids, kv, repeats, pool_mib)
        check = np.asarray(pool.read(ids)).view(np.uint16)
        assert np.array_equal(check, np.asarray(kv).view(np.uint16)), "round trip mismatch"
    del pool, host
    gc.collect()
    return rows


def bench_typed_pool(pool_mib: int, k: int, repeats: int) -> dict:
    """The same scatter into a bfloat16-typed pool (what storing the pool as raw bits avoids)."""
    num_pages = pool_mib * MiB // SPEC.page_bytes
    state = {"pool": jnp.zeros(SPEC.kv_shape(num_pages + 1), jnp.bfloat16)}
    ids = jnp.asarray(np.random.default_rng(1).choice(num_pages, size=k, replace=False), jnp.int32)
    kv = _pages(k, k)

    def write():
        state["pool"] = _typed_scatter(state["pool"], ids, kv)
        state["pool"].block_until_ready()

    nbytes = k * SPEC.page_bytes
    t = median_time(write, repeats=repeats, warmup=1)
    m = memcpy_seconds(nbytes, repeats=7)
    del state["pool"]
    gc.collect()
    return dict(
        op="scatter",
        pool="bfloat16",
        pool_mib=pool_mib,
        k=k,
        bytes=nbytes,
        seconds=t,
        memcpy_seconds=m,
        gbps=gbps(nbytes, t),
        vs_memcpy=t / m,
        numpy_same_seconds=None,
        vs_numpy_same=None,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small pools, fewer repeats")
    ap.add_argument("--json", default=None, help="write raw figures to this path")
    ap.add_argument(
        "--huge-pages",
        choices=("on", "off"),
        default="on",
        help="pool on transparent huge pages (the library default: on)",
    )
    args = ap.parse_args(argv)
    pools = [32, 256] if args.quick else [256, 2048]
    ks = [1, 16] if args.quick else [1, 16, 128]
    repeats = 5 if args.quick else 11
    config = dict(
        spec=repr(SPEC),
        page_bytes=SPEC.page_bytes,
        pools_mib=pools,
        ks=ks,
        repeats=repeats,
        typed_row=dict(pool_mib=pools[0], k=16),
        huge_pages=args.huge_pages,
        loadavg_start=os.getloadavg(),
    )
    print(
        f"page {SPEC.page_bytes // 1024} KiB ({SPEC}); {env_info()['backend']} "
        f"jax {jax.__version__}",
        flush=True,
    )

    alloc = {k: alloc_seconds(k, repeats) for k in ks}
    rows = []
    for mib in pools:
        rows += bench_pool(mib, ks, repeats, args.huge_pages == "on")
    typed = bench_typed_pool(pools[0], 16, 3)
    rows.append(typed)

    for r in rows:
        r["fresh_buffer_seconds"] = alloc[r["k"]]

    def opt(v, scale=1.0):
        return "-" if v is None else v * scale

    print_table(
        [
            "op",
            "pool",
            "pool MiB",
            "k",
            "MiB moved",
            "us",
            "GB/s",
            "memcpy us",
            "x memcpy",
            "numpy same us",
            "x numpy same",
            "fresh buf us",
        ],
        [
            [
                r["op"],
                r["pool"],
                r["pool_mib"],
                r["k"],
                r["bytes"] / MiB,
                r["seconds"] * 1e6,
                r["gbps"],
                r["memcpy_seconds"] * 1e6,
                r["vs_memcpy"],
                opt(r["numpy_same_seconds"], 1e6),
                opt(r["vs_numpy_same"]),
                alloc[r["k"]] * 1e6,
            ]
            for r in rows
        ],
        title="Device pool page movement (median; limit: numpy.copyto of the same bytes, "
        "contiguous; numpy same: numpy doing the same scatter / gather on a host array "
        "shaped like the pool; fresh buf: allocating the k-page array a read returns)",
    )

    by = {(r["op"], r["pool"], r["pool_mib"], r["k"]): r for r in rows}
    small, large = pools
    # Flatness: the ratio of times, and the ratio of each size's ratio to memcpy (which cancels
    # load that changed between the two pools, but carries the memcpy's own noise: at k=1 a
    # 256 KiB memcpy of 12 us can read 130 us in a busy moment). Both are printed.
    ratios = [
        [
            op,
            k,
            by[(op, "bits", large, k)]["seconds"] / by[(op, "bits", small, k)]["seconds"],
            by[(op, "bits", large, k)]["vs_memcpy"] / by[(op, "bits", small, k)]["vs_memcpy"],
            by[(op, "bits", small, k)]["vs_memcpy"],
            by[(op, "bits", large, k)]["vs_memcpy"],
            by[(op, "bits", small, k)]["vs_numpy_same"],
            by[(op, "bits", large, k)]["vs_numpy_same"],
        ]
        for op in ("scatter", "gather")
        for k in ks
    ]
    print_table(
        [
            "op",
            "k",
            f"{large}/{small} MiB time",
            f"{large}/{small} x memcpy",
            f"x memcpy ({small} MiB)",
            f"x memcpy ({large} MiB)",
            f"x numpy same ({small} MiB)",
            f"x numpy same ({large} MiB)",
        ],
        ratios,
        title="Targets: flat in pool size (<= 1.2), <= 1.5x memcpy (numpy same: "
        "the same scattered copy done by numpy, for reference)",
    )
    bits16 = by[("scatter", "bits", small, 16)]["seconds"]
    print(
        f"bfloat16-typed pool, {small} MiB, k=16: {typed['seconds'] * 1e3:.1f} ms = "
        f"{typed['seconds'] / bits16:.0f}x the raw-bits pool",
        flush=True,
    )
    config["loadavg_end"] = os.getloadavg()
    print(
        f"load average (1, 5, 15 min): start {config['loadavg_start']}, "
        f"end {config['loadavg_end']} on {os.cpu_count()} cores"
    )
    write_json(args.json, "bench_pool", config, rows)


if __name__ == "__main__":
    main()
