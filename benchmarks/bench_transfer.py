"""Backup (device -> host) and load (host -> device) of scattered pages vs numpy.copyto.

Page: 4 layers x 2 (K, V) x 16 tokens x 8 heads x 64 dims, bfloat16 = 128 KiB (the issue's
example "8 heads x 128 dims" is 256 KiB: ``--head-dim 128``). For k = 1, 16,
128, 1024 scattered pages (random device ids, random host ids), each direction is timed through
the real ``TransferEngine`` (dispatch + wait) and compared, round by round, with
``numpy.copyto`` of the same number of contiguous bytes: the limit of a host memory copy on this
machine. Rounds interleave the two so a noisy neighbour hits both; medians of per-round ratios.
That limit copies the same two buffers every round: up to 16 MiB (128 pages) they stay in this
machine's 32 MiB L3, while a transfer reads and writes pages spread over pools of hundreds of
MiB. The ``cold ratio`` column (information, not the target) compares with a copyto rotating
through buffers 4x the L3. ``dispatch us`` is the wall time until ``backup``/``load`` returned;
on a loaded 2-core machine it can include the whole copy when XLA's worker thread, woken by the
dispatch, preempts the caller (seen after the caller's own memcpy): compare totals, not it.

Rows ``backup copy`` / ``load copy`` time the copy executable alone (the engine's jitted copy
dispatched straight on the pools with a prepared plan, then waited for): no id validation, no
handle, no bookkeeping, so the gap between them and ``backup`` / ``load`` is the engine's fixed
cost per transfer, and their own ratio is the copy's speed per byte.

A reference row ``numpy_pages`` (device -> host, page_first only) times a plain numpy loop of
one ``np.copyto`` per page out of a zero-copy view of the device pool: not a design (it cannot
write into the device pool, and it is synchronous), but the same scattered access pattern moving
each byte once, so it separates "scattered pages" from "our path".

Layer-wise load: time from dispatch until ``wait_layer(0)`` returns vs until the whole load is
done (and the plain load of the same pages).

Sharding section (``--devices 4``, CPU only): the device pool sharded over kv heads on 4 devices
and the host pool sharded the same way (one host buffer per shard), against moving the same
pages into a single host buffer on one device (gather to one device first).

Usage: python -m benchmarks.bench_transfer [--quick] [--json out.json] [--devices 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (smoke run)")
    p.add_argument("--json", default=None, help="write raw figures here")
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="CPU devices for the sharding section (needs XLA before import; 1 = skip)",
    )
    p.add_argument("--layouts", default="layer_first,page_first")
    p.add_argument("--head-dim", type=int, default=64, help="64: 128 KiB pages, 128: 256 KiB")
    p.add_argument(
        "--huge-pages",
        choices=("on", "off"),
        default="on",
        help="pools on transparent huge pages (the library default: on)",
    )
    return p.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.devices > 1:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from benchmarks.common import aligned_bytes, env_info, gbps, memcpy_fn, print_table, write_json  # noqa: E402
from hicache_jax.cli.results import figure  # noqa: E402
from hicache_jax.memory.device_pool import DevicePagePool  # noqa: E402
from hicache_jax.memory.host_pool import HostPagePool  # noqa: E402
from hicache_jax.memory.page_copy import copy_plan  # noqa: E402
from hicache_jax.memory.transfer import TransferEngine  # noqa: E402
from hicache_jax.spec import KVSpec  # noqa: E402

SPEC = KVSpec(
    num_layers=4,
    num_kv_heads=8,
    head_dim=ARGS.head_dim if ARGS else 64,
    dtype="bfloat16",
    page_size=16,
)


def interleaved(
    fns: dict, repeats: int, warmup: int = 1, cpu: dict | None = None
) -> dict[str, list[float]]:
    """Run each fn once per round (in order), ``repeats`` rounds; wall seconds per fn per round.

    ``cpu``, when given, receives the process CPU seconds (all threads: XLA's execution thread
    included) per fn per round. On a shared machine wall time of anything longer than a
    scheduler slice is inflated by preemption, while CPU time still shows how much work a
    path does per byte (one pass vs a gather plus a second copy).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out = {k: [] for k in fns}
    for k in fns:
        if cpu is not None:
            cpu[k] = []
    for _ in range(repeats):
        for k, fn in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu[k].append(time.process_time() - c0)
    return out


def _memcpy_cold_fn(nbytes: int, footprint: int = 128 << 20):
    """``numpy.copyto`` of ``nbytes``, rotating through source and destination buffers of at
    least ``footprint`` bytes each (4x this machine's 32 MiB L3), so that, like the pages of a
    transfer, the bytes are not left in cache by the previous round. Information only: the
    target is against the plain (cache-warm for <= 16 MiB) ``memcpy_fn``."""
    slots = max(2, -(-footprint // nbytes))
    src = aligned_bytes(slots * nbytes)  # page-aligned, zeroed: no first-touch faults inside
    dst = aligned_bytes(slots * nbytes)  # the timing, no 4K aliasing (see common.memcpy_fn)
    turn = [0]

    def run():
        k = turn[0] = (turn[0] + 1) % slots
        np.copyto(dst[k * nbytes : (k + 1) * nbytes], src[k * nbytes : (k + 1) * nbytes])

    return run


def _numpy_pages_fn(dev: DevicePagePool, d: np.ndarray, n: int):
    """Reference, not a design: one ``np.copyto`` per page from a zero-copy numpy view of the
    device pool (CPU only) into a page-first numpy buffer -- what a hand-written host loop moving
    each byte once achieves on scattered pages (the view is read inside the call and dropped,
    so the pool can still be donated afterwards)."""
    dst = np.empty(SPEC.page_major_shape(n), SPEC.bits_dtype)
    order = np.random.default_rng(4).permutation(n)

    def run():
        src = np.asarray(dev.array)
        for i, page in zip(order, d):
            np.copyto(dst[i], src[:, :, page])

    return run


def bench_directions(eng: TransferEngine, sizes, repeats: int, layout: str) -> list[dict]:
    rng = np.random.default_rng(1)
    dev, host = eng.device_pool, eng.host_pool
    rows = []
    for n in sizes:
        d = rng.permutation(dev.num_pages)[:n]
        h = rng.permutation(host.num_pages)[:n]
        nbytes = n * SPEC.page_bytes
        dispatch = {
            "backup": [],
            "load": [],
            "numpy_pages": [0.0],
            "backup copy": [0.0],
            "load copy": [0.0],
        }
        plan_b = copy_plan(h.astype(np.int32), d.astype(np.int32))
        plan_l = copy_plan(d.astype(np.int32), h.astype(np.int32))

        # The factories take this iteration's values as defaults: their closures bind those.
        def copy_only(kind, plan_b=plan_b, plan_l=plan_l):
            def run():
                if kind == "backup":
                    host.run(eng._backup_fn, dev.array, plan_b).block_until_ready()
                else:
                    dev.run(eng._load_fn, host.buffer, plan_l).block_until_ready()

            return run

        def timed(kind, d=d, h=h, dispatch=dispatch):
            def run():
                t0 = time.perf_counter()
                handle = eng.backup(d, h) if kind == "backup" else eng.load(h, d)
                dispatch[kind].append(time.perf_counter() - t0)
                handle.wait()

            return run

        reps = repeats if n >= 128 else 3 * repeats
        cpu: dict = {}
        t = interleaved(
            {
                "memcpy": memcpy_fn(nbytes),
                "memcpy_cold": _memcpy_cold_fn(nbytes),
                "backup": timed("backup"),
                "load": timed("load"),
                "numpy_pages": _numpy_pages_fn(dev, d, n),
                "backup copy": copy_only("backup"),
                "load copy": copy_only("load"),
            },
            reps,
            cpu=cpu,
        )
        eng.poll()
        for kind in ("backup", "load", "backup copy", "load copy", "numpy_pages"):
            ratios = [m / x for m, x in zip(t["memcpy"], t[kind])]
            cold_ratios = [m / x for m, x in zip(t["memcpy_cold"], t[kind])]
            cpu_ratios = [m / x for m, x in zip(cpu["memcpy"], cpu[kind]) if x > 0]
            if kind == "numpy_pages" and layout != "page_first":
                continue  # the reference writes page-first; one row per size is enough
            rows.append(
                dict(
                    layout=layout,
                    direction=kind,
                    pages=n,
                    mib=nbytes / 2**20,
                    memcpy_gbps=gbps(nbytes, statistics.median(t["memcpy"])),
                    gbps=gbps(nbytes, statistics.median(t[kind])),
                    ratio=statistics.median(ratios),
                    cold_ratio=statistics.median(cold_ratios),
                    cpu_ratio=statistics.median(cpu_ratios) if cpu_ratios else 0.0,
                    dispatch_us=1e6 * statistics.median(dispatch[kind]),
                )
            )
    return rows


def bench_layerwise(eng: TransferEngine, sizes, repeats: int, layout: str) -> list[dict]:
    rng = np.random.default_rng(2)
    dev, host = eng.device_pool, eng.host_pool
    rows = []
    for n in sizes:
        d = rng.permutation(dev.num_pages)[:n]
        h = rng.permutation(host.num_pages)[:n]
        first, whole, plain = [], [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            handle = eng.load(h, d, layerwise=True)
            handle.wait_layer(0)
            t1 = time.perf_counter()
            handle.wait()
            t2 = time.perf_counter()
            eng.load(h, d).wait()
            t3 = time.perf_counter()
            if i:  # first round warms the compiles
                first.append(t1 - t0)
                whole.append(t2 - t0)
                plain.append(t3 - t2)
        eng.poll()
        rows.append(
            dict(
                layout=layout,
                pages=n,
                layer0_ms=1e3 * statistics.median(first),
                layerwise_all_ms=1e3 * statistics.median(whole),
                plain_load_ms=1e3 * statistics.median(plain),
                layer0_fraction=statistics.median(f / w for f, w in zip(first, whole)),
            )
        )
    return rows


def bench_sharding(num_devices: int, n: int, repeats: int) -> list[dict]:
    """Per-shard host buffers (what HostPagePool does) vs one host buffer on one device."""
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("heads",))
    dev = DevicePagePool(SPEC, 2 * n, mesh=mesh)
    host = HostPagePool(SPEC, 2 * n, "layer_first", mesh=mesh)
    single = HostPagePool(SPEC, 2 * n, "layer_first")  # device 0 only, all heads
    single_eng = TransferEngine(DevicePagePool(SPEC, 2 * n), single)
    dev.allocator.alloc(2 * n)
    host.allocator.alloc(2 * n)
    single_eng.device_pool.allocator.alloc(2 * n)
    single.allocator.alloc(2 * n)
    eng = TransferEngine(dev, host)
    rng = np.random.default_rng(3)
    d = rng.permutation(2 * n)[:n]
    h = rng.permutation(2 * n)[:n]
    nbytes = n * SPEC.page_bytes
    one = jax.devices()[0]

    def gathered():
        # The single-buffer design: the pages' heads from every device onto one device first
        # (a cross-device gather), then the same one-pass copy into that device's host buffer.
        pages = jax.device_put(dev.read_bits(d), one)
        single_eng.device_pool.write(np.arange(n), pages)
        single_eng.backup(np.arange(n), h).wait()

    t = interleaved(
        {
            "memcpy": memcpy_fn(nbytes),
            "per_shard": lambda: eng.backup(d, h).wait(),
            "single_buffer": gathered,
        },
        repeats,
    )
    eng.poll()
    single_eng.poll()
    return [
        dict(
            design=k,
            devices=num_devices,
            pages=n,
            gbps=gbps(nbytes, statistics.median(v)),
            ratio=statistics.median(m / x for m, x in zip(t["memcpy"], v)),
        )
        for k, v in t.items()
        if k != "memcpy"
    ]


def main(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    print(f"load average before: {load_before} on {os.cpu_count()} CPUs")
    sizes = (1, 16, 128) if args.quick else (1, 16, 128, 1024)
    repeats = 3 if args.quick else 7
    max_n = max(sizes)
    results = {"directions": [], "layerwise": [], "sharding": []}
    for layout in args.layouts.split(","):
        huge = args.huge_pages == "on"
        dev = DevicePagePool(SPEC, 2 * max_n, huge_pages=huge)
        host = HostPagePool(SPEC, 4 * max_n, layout, huge_pages=huge)
        print(
            f"{layout}: pools on huge pages: device {dev.huge_page_bytes >> 20} of "
            f"{dev.nbytes >> 20} MiB, host {host.huge_page_bytes >> 20} of "
            f"{host.nbytes >> 20} MiB"
        )
        dev.allocator.alloc(dev.num_pages)
        host.allocator.alloc(host.num_pages)
        eng = TransferEngine(dev, host)
        results["directions"] += bench_directions(eng, sizes, repeats, layout)
        results["layerwise"] += bench_layerwise(eng, [n for n in sizes if n >= 16], repeats, layout)
        del eng, dev, host
    rows = results["directions"]
    print_table(
        [
            "layout",
            "direction",
            "pages",
            "MiB",
            "memcpy GB/s",
            "GB/s",
            "ratio",
            "cpu ratio",
            "cold ratio",
            "dispatch us",
        ],
        [
            [
                r["layout"],
                r["direction"],
                r["pages"],
                r["mib"],
                r["memcpy_gbps"],
                r["gbps"],
                r["ratio"],
                r["cpu_ratio"],
                r["cold_ratio"],
                r["dispatch_us"],
            ]
            for r in rows
        ],
        title=f"backup / load of scattered {SPEC.page_bytes // 1024} KiB pages vs "
        "numpy.copyto of the same bytes (ratio: wall time, cpu ratio: process "
        "CPU time; cold ratio: vs a copyto of bytes not left in cache; medians of "
        "per-round ratios)",
    )
    print_table(
        ["layout", "pages", "layer 0 ms", "all layers ms", "plain load ms", "layer0 / all"],
        [
            [
                r["layout"],
                r["pages"],
                r["layer0_ms"],
                r["layerwise_all_ms"],
                r["plain_load_ms"],
                r["layer0_fraction"],
            ]
            for r in results["layerwise"]
        ],
        title="layer-wise load: time until layer 0 is on the device vs the whole load",
    )
    if args.devices > 1:
        results["sharding"] = bench_sharding(args.devices, 128, repeats)
        print_table(
            ["design", "devices", "pages", "GB/s", "ratio"],
            [
                [r["design"], r["devices"], r["pages"], r["gbps"], r["ratio"]]
                for r in results["sharding"]
            ],
            title="sharded backup: host buffer per shard vs one host buffer (vs memcpy)",
        )
    big = [r for r in rows if r["pages"] >= 128 and r["direction"] in ("backup", "load")]
    if big:
        print(
            f"target >= 0.70 of memcpy for >= 128 pages: worst ratio "
            f"{min(r['ratio'] for r in big):.2f} (wall), "
            f"{min(r['cpu_ratio'] for r in big):.2f} (CPU time)"
        )
    load_after = os.getloadavg()
    print(f"load average after: {load_after}")
    write_json(
        args.json,
        "bench_transfer",
        dict(
            spec=str(SPEC),
            page_bytes=SPEC.page_bytes,
            sizes=sizes,
            repeats=repeats,
            quick=args.quick,
            devices=args.devices,
            layouts=args.layouts,
            huge_pages=args.huge_pages,
            load_average_before=load_before,
            load_average_after=load_after,
        ),
        results,
        [
            figure(
                f"transfer {r['direction']} {r['pages']}p {r['layout']}",
                "GB/s",
                r["gbps"],
                "numpy.copyto of the same bytes (median of per-round ratios)",
                r["memcpy_gbps"],
                "bench_transfer",
                higher_is_better=True,
                ratio=r["ratio"],
            )
            for r in rows
        ]
        + [
            figure(
                f"layer-wise load {r['pages']}p {r['layout']}",
                "ms",
                r["layerwise_all_ms"],
                "plain load of the same pages",
                r["plain_load_ms"],
                "bench_transfer",
                higher_is_better=False,
            )
            for r in results["layerwise"]
        ],
    )
    return results


if __name__ == "__main__":
    print(env_info())
    main(ARGS)
