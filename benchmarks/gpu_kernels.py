"""Pallas page-copy kernels (Mosaic GPU, TMA) vs a device-to-device copy and vs the XLA path.

For 16, 128 and 1024 scattered pages of a large device pool: ``gather_pages`` (pool -> a
contiguous buffer, the staging side of a backup) and ``scatter_pages`` (buffer -> pool, donated,
the device side of a load), each timed for

* ``pallas``: :mod:`pallas_kernels.gpu` at a few (tile_bytes, stages, blocks) settings,
* ``xla``: ``pool.at[:, :, ids].get/.set`` (donated), what ``copy_backend="xla"`` runs,

and printed as GB/s of bytes read + written beside the **limit**: one large contiguous
device-to-device copy measured in the same run (a jitted ``jnp.copy`` of ``LIMIT_BYTES``,
read + write counted). Target: >= 0.8 of the limit at 1024 pages, faster than XLA at
every size.

Timing: ``ITERS`` back-to-back calls (dispatch is asynchronous, so launch overhead overlaps),
one ``block_until_ready`` at the end, seconds / ITERS; median of ``REPEATS`` such rounds, the
implementations interleaved per round so drift hits all of them. Every implementation is first
checked bit-exact against ``pallas_kernels.ref_*`` on the same data; a failing one is reported
(row ``ok=False``) and not timed.

Needs an NVIDIA GPU of compute capability >= 9.0 (H100/H200). ``--smoke`` runs the same code
path on CPU with tiny shapes and the Mosaic GPU interpreter (checks the script, times nothing
meaningful). Budget: < 5 minutes on one H200.

Usage: python -m benchmarks.gpu_kernels [--smoke] [--json benchmarks/out/gpu_kernels.json]
       [--no-probe | --probe-only]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks.common import gbps, print_table, write_json
from pallas_kernels import gpu as pk_gpu

# Llama-3-8B-like KV: 32 layers x (K, V) x 16 tokens x 8 heads x 128 dims x bf16 (uint16 bits):
# 32 KiB contiguous chunks, 2 MiB per page; 1024 pages = 2 GiB moved each way.
FULL = dict(
    num_layers=32,
    kvf=2,
    page_size=16,
    heads=8,
    head_dim=128,
    pool_pages=3072,
    sizes=(16, 128, 1024),
    iters=(50, 20, 5),
    repeats=7,
    configs=((32 * 1024, 4, None), (16 * 1024, 8, None), (16 * 1024, 4, 2)),
    limit_bytes=2 << 30,
)
# CPU smoke test: same code path, tiny shapes, the GPU interpreter.
SMOKE = dict(
    num_layers=2,
    kvf=2,
    page_size=4,
    heads=2,
    head_dim=32,
    pool_pages=11,
    sizes=(2, 3),
    iters=(1, 1),
    repeats=1,
    configs=((128, 2, None),),
    limit_bytes=1 << 20,
)


def _blocks_label(mult):
    return "1/SM" if mult is None else f"{mult}/SM"


def _num_blocks(mult, smoke):
    if smoke:
        return 3
    sms = int(getattr(jax.devices()[0], "core_count", 0) or 132)
    return sms * (mult or 1)


def _time(fn, iters):
    """Seconds per call: ``iters`` asynchronous calls, then one block."""
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def _interleaved(fns: dict, iters: int, repeats: int) -> dict[str, float]:
    """Median seconds per call of each fn, rounds interleaved; one warm-up round."""
    samples = {k: [] for k in fns}
    for r in range(repeats + 1):
        for k, fn in fns.items():
            s = _time(fn, iters)
            if r:
                samples[k].append(s)
    return {k: statistics.median(v) for k, v in samples.items()}


class Scatter:
    """``pool = scatter(pool, ids, pages)`` with the pool donated; the object holds the pool."""

    def __init__(self, fn, pool, ids, pages):
        self.fn = jax.jit(fn, donate_argnums=0)
        self.pool, self.ids, self.pages = jnp.copy(pool), ids, pages

    def __call__(self):
        self.pool = self.fn(self.pool, self.ids, self.pages)
        return self.pool


def gpu_impls(cfg: dict, smoke: bool) -> dict:
    """name -> (gather, scatter) of the Mosaic GPU kernels at each of ``cfg["configs"]``'s
    (tile bytes, stages, blocks per SM) settings (``smoke``: in the GPU interpreter)."""
    interpret = pk.interpret_params(pk.Impl.MOSAIC_GPU_INTERPRET) if smoke else None
    impls = {}
    for tile, stages, mult in cfg["configs"]:
        kw = dict(
            tile_bytes=tile, stages=stages, num_blocks=_num_blocks(mult, smoke), interpret=interpret
        )
        size = f"{tile >> 10}K" if tile >= 1024 else f"{tile}B"
        name = f"pallas tile={size} stages={stages} blocks={_blocks_label(mult)}"
        # jitted: outside jit the wrappers range-check concrete ids (a device->host sync).
        impls[name] = (
            jax.jit(functools.partial(pk_gpu.gather_pages, **kw)),
            functools.partial(pk_gpu.scatter_pages, **kw),
        )
    return impls


def run(cfg: dict, smoke: bool, checkpoint=lambda results: None, make_impls=gpu_impls) -> dict:
    """Every size's table is printed, and ``checkpoint(results so far)`` called, as soon as the
    size is done: a run killed at its time limit keeps the sizes it finished. ``make_impls(cfg,
    smoke)`` gives the Pallas implementations timed beside XLA (``tpu_kernels`` passes its own)."""
    L, kvf, ps, H, D, P = (
        cfg[k] for k in ("num_layers", "kvf", "page_size", "heads", "head_dim", "pool_pages")
    )
    page_bytes = L * kvf * ps * H * D * 2
    key = jax.random.key(0)
    pool = jax.random.bits(key, (L, kvf, P, ps, H, D), jnp.uint16)

    results_so_far: list[dict] = []
    # Limit: one contiguous device-to-device copy, read + write counted.
    src = jax.random.bits(jax.random.key(1), (cfg["limit_bytes"] // 2,), jnp.uint16)
    copy = jax.jit(jnp.copy)
    # partial binds src now; a lambda would close over the name that `del src` removes below.
    limit_s = _interleaved(
        {"copy": functools.partial(copy, src)}, max(cfg["iters"]), cfg["repeats"]
    )["copy"]
    limit = gbps(2 * src.nbytes, limit_s)
    print(
        f"limit: jnp.copy of {src.nbytes / 2**20:.0f} MiB: {limit:.1f} GB/s (read + write)",
        flush=True,
    )
    del src
    # Dispatch floor: one tiny jitted call, timed the same way. Rows whose time is near it (16
    # pages move 64 MiB, ~15 us at HBM speed) measure the launch path, not the copy.
    tiny, bump = jnp.zeros((8,), jnp.int32), jax.jit(lambda x: x + 1)
    floor_s = _interleaved({"floor": lambda: bump(tiny)}, max(cfg["iters"]), cfg["repeats"])[
        "floor"
    ]
    print(f"dispatch floor: {floor_s * 1e6:.1f} us per jitted call", flush=True)
    title = (
        f"page copies on {jax.devices()[0].device_kind}, page {page_bytes >> 10} KiB "
        f"(chunk {ps * H * D * 2 >> 10} KiB), pool {P} pages; limit {limit:.1f} GB/s; "
        f"dispatch floor {floor_s * 1e6:.1f} us"
    )
    header = ["op", "pages", "impl", "ok", "us", "GB/s", "vs limit", "vs xla"]
    out = dict(
        limit=dict(
            kind="jnp.copy device->device", bytes=cfg["limit_bytes"], seconds=limit_s, gbps=limit
        ),
        dispatch_floor_seconds=floor_s,
        page_bytes=page_bytes,
        rows=results_so_far,
    )

    xla_scatter = lambda p, i, x: pk.ref_scatter_pages(p, i, x)  # noqa: E731
    xla_gather = jax.jit(pk.ref_gather_pages)
    rows = []
    rng = np.random.default_rng(0)
    for n, iters in zip(cfg["sizes"], cfg["iters"]):
        ids = jnp.asarray(rng.choice(P, n, replace=False).astype(np.int32))
        pages = jax.random.bits(jax.random.fold_in(key, n), (L, kvf, n, ps, H, D), jnp.uint16)
        want_pool = pk.ref_scatter_pages(pool, ids, pages)
        want_pages = pk.ref_gather_pages(pool, ids)
        impls = {"xla": (xla_gather, xla_scatter), **make_impls(cfg, smoke)}
        fns, ok = {}, {}
        for name, (gather, scatter) in impls.items():
            try:  # correctness first, bit-exact against the references
                g_ok = bool(jnp.array_equal(gather(pool, ids), want_pages))
                s = Scatter(scatter, pool, ids, pages)
                s_ok = bool(jnp.array_equal(s(), want_pool))
                ok[name] = g_ok and s_ok
                if ok[name]:
                    fns[("gather", name)] = functools.partial(gather, pool, ids)
                    fns[("scatter", name)] = s
            except Exception as e:  # report the failure as a row, keep measuring the others
                traceback.print_exc()
                ok[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        secs = _interleaved(fns, iters, cfg["repeats"])
        nbytes = 2 * n * page_bytes  # read + written
        size_rows = []
        for op in ("gather", "scatter"):
            xla_s = secs.get((op, "xla"))
            for name in impls:
                s = secs.get((op, name))
                bw = gbps(nbytes, s) if s else None
                size_rows.append(
                    [
                        op,
                        n,
                        name,
                        ok[name] is True,
                        s * 1e6 if s else "-",
                        bw if bw else "-",
                        bw / limit if bw else "-",
                        xla_s / s if (s and xla_s) else "-",
                    ]
                )
                results_so_far.append(
                    dict(
                        op=op,
                        pages=n,
                        impl=name,
                        ok=ok[name],
                        seconds=s,
                        bytes_read_plus_written=nbytes,
                        gbps=bw,
                        vs_limit=bw / limit if bw else None,
                        speedup_vs_xla=xla_s / s if (s and xla_s) else None,
                    )
                )
        rows += size_rows
        print_table(header, size_rows, title=f"{n} pages ({title})")
        checkpoint(out)
    print_table(header, rows, title=title)
    return out


def probe_host_operand(cfg: dict, smoke: bool) -> dict:
    """Stretch goal: can the TMA gather read a ``pinned_host`` pool directly (zero-copy)?

    Mosaic GPU has no host memory space, but a pinned_host array still lowers as the kernel's
    operand; XLA then either rejects it or copies it to the device first. Compare the gather of
    16 pages from a pinned_host pool with a device_put of that whole pool: about equal times
    mean XLA copied the pool (not zero-copy); an error is recorded as the answer.
    """
    dev = jax.devices()[0]
    if "pinned_host" not in [m.kind for m in dev.addressable_memories()]:
        return dict(ok=False, error="no pinned_host memory kind")
    L, kvf, ps, H, D = (cfg[k] for k in ("num_layers", "kvf", "page_size", "heads", "head_dim"))
    P = 4 if smoke else 128  # 256 MiB of pinned host memory at full size
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    pool = jax.device_put(
        np.random.default_rng(1).integers(0, 2**16, (L, kvf, P, ps, H, D), dtype=np.uint16), host
    )
    ids = jnp.arange(min(16, P), dtype=jnp.int32)
    kw = dict(
        num_blocks=_num_blocks(None, smoke),
        interpret=pk.interpret_params(pk.Impl.MOSAIC_GPU_INTERPRET) if smoke else None,
    )
    gather = jax.jit(functools.partial(pk_gpu.gather_pages, **kw))
    on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)
    try:
        ok = bool(
            jnp.array_equal(
                gather(pool, ids), pk.ref_gather_pages(jax.device_put(pool, on_device), ids)
            )
        )
        secs = _interleaved(
            {
                "gather": lambda: gather(pool, ids),
                "whole_pool_put": lambda: jax.device_put(pool, on_device),
            },
            iters=3,
            repeats=cfg["repeats"],
        )
    except Exception as e:  # the answer may well be "XLA refuses": record it
        traceback.print_exc()
        return dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    out = dict(
        ok=ok,
        pool_bytes=pool.nbytes,
        gather_16_pages_s=secs["gather"],
        whole_pool_device_put_s=secs["whole_pool_put"],
    )
    print(
        f"pinned_host operand: ok={ok}, gather of 16 pages {secs['gather'] * 1e3:.3g} ms vs "
        f"device_put of the whole {pool.nbytes >> 20} MiB pool "
        f"{secs['whole_pool_put'] * 1e3:.3g} ms",
        flush=True,
    )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, GPU interpreter")
    ap.add_argument("--json", default=None, help="write the raw figures here")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--no-probe", action="store_true", help="skip the pinned_host probe")
    mode.add_argument(
        "--probe-only",
        action="store_true",
        help="only the pinned_host probe (run apart: it may abort the process)",
    )
    args = ap.parse_args(argv)
    if not args.smoke and pk.compiled_impl() is not pk.Impl.MOSAIC_GPU:
        print(f"needs an sm_90+ NVIDIA GPU (found {jax.devices()[0]}); try --smoke")
        return 2
    cfg = SMOKE if args.smoke else FULL
    config = dict(cfg) | {"smoke": args.smoke}
    t0 = time.perf_counter()
    if args.probe_only:
        write_json(
            args.json,
            "gpu_kernels_probe",
            config,
            {"host_operand_probe": probe_host_operand(cfg, args.smoke)},
        )
        return 0
    results = run(
        cfg,
        args.smoke,
        checkpoint=lambda partial: write_json(args.json, "gpu_kernels", config, partial),
    )
    results["wall_seconds"] = time.perf_counter() - t0
    print(f"wall {results['wall_seconds']:.0f} s")
    write_json(args.json, "gpu_kernels", config, results)  # before the probe, which may abort
    if not args.no_probe:
        results["host_operand_probe"] = probe_host_operand(cfg, args.smoke)
        write_json(args.json, "gpu_kernels", config, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
