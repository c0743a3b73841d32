"""L3 backends: put/get GB/s of batches of 1, 16, 128 pages through hicache_jax's backends against
the backend's own raw batch calls on the same bytes, in the same run (target >= 80% of raw).

- mooncake: ``MooncakeStorage.put_from/get_into`` (+ wait) against a second, plain
  ``MooncakeDistributedStore`` client doing ``batch_put_from`` / ``batch_get_into`` of the bare
  pages from a registered buffer, one call per batch (no header, no checksum, no thread hop).
  Servers: a master and a holder started on 127.0.0.1 (or ``--mooncake host:port``).
- file: ``FileStorage`` against plain ``open/write`` and ``open/readinto`` of the bare pages,
  one file each (no header, checksum, temp file or rename).

Puts use fresh keys every repeat (keys are write-once); gets read the keys of the first put.
Ours and raw run alternately, repeat by repeat, so load from other processes hits both alike.
Two figures per operation: one batch submitted and waited for (latency-bound: it includes the
hop to the backend's worker thread and back), and "x4": four batches submitted back to back and
then waited for, as a cache with queued work keeps them (throughput), against four raw calls.
Modes: buffer layout, ``zero-copy`` (Mooncake two-buffer calls) or staged, entry checksum (crc32;
xxh3 when the xxhash package is installed). ``entry_rows`` is the layout of HiCache's own L3
staging pool (a header slot before each page: the backend moves and checks each entry in place),
i.e. the path a cache's L3 traffic takes; page_first / layer_first are caller buffers (staged).
Page: 4 layers x 2 (K, V) x 16 tokens x 8 heads x 64 dims, bfloat16 = 128 KiB.

Second part (``--part cache``, default ``all``): HiCache with L3 on bench_tree's multi-turn
trace (real KV bytes, the request flow through the cache's handle, ``prefetch`` with
``wait_complete`` before each match). The device pool holds 15% of the working set
(``--device-fraction``) and the host pool 2x the device pool (``--host-ratio``), so L1 + L2
(45%) are too small for it: hit ratio without L3, with a file L3, with a Mooncake L3, each against
the infinite-cache hit ratio of the same trace (target: L3 brings it to >= 95% of it), and a
control that writes L3 (write_through to L3 also backs up new leaves) but never prefetches, which
separates the effect of reading L3 from that of the extra backups. Then two
instances sharing one store: instance A serves the first half of the trace, a fresh instance B
the second half; B's hits from L3 are prefixes only A computed (B alone, without L3, beside it).

    python -m benchmarks.bench_storage [--quick] [--json PATH] [--backends file,mooncake]
        [--part raw|cache|all]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from benchmarks.common import gbps, memcpy_seconds, print_table, write_json
from hicache_jax.l3.storage import ENTRY_ROWS, entry_pages, entry_rows, open_storage, page_keys
from hicache_jax.l3.storage.format import xxhash_available
from hicache_jax.spec import KVSpec

SPEC = KVSpec(num_layers=4, num_kv_heads=8, head_dim=64, dtype="bfloat16", page_size=16)
BATCHES = (1, 16, 128)
QUEUE = 4  # "x4" columns: 4 batches submitted back to back, then waited (throughput)
_XXH3 = ("xxh3",) if xxhash_available() else ()
_DEFAULT_SUM = "xxh3" if _XXH3 else "crc32"
# entry_rows (header slot + page per row) is the layout of HiCache's own L3 staging pool: the
# rows a cache's L3 traffic really goes through; the others are buffers a caller might bring.
CONFIGS = {  # file: (layout, checksum); mooncake: (layout, zero_copy, checksum)
    "file": [(ENTRY_ROWS, _DEFAULT_SUM), ("page_first", "crc32")]
    + [("page_first", c) for c in _XXH3]
    + [("layer_first", "crc32")],
    "mooncake": [(ENTRY_ROWS, False, _DEFAULT_SUM), ("page_first", False, "crc32")]
    + [("page_first", False, c) for c in _XXH3]
    + [("page_first", True, "crc32")]
    + [("page_first", True, c) for c in _XXH3]
    + [("layer_first", False, "crc32")],
}
_serial = itertools.count()


def fresh_keys(n: int) -> list[str]:
    base = (time.time_ns() % 10**12) * 1000 + next(_serial) * 200
    return page_keys(SPEC, np.arange(n * SPEC.page_size, dtype=np.int64) + base)


def key_hashing_cost(pages: int = 4096, repeats: int = 5) -> dict[str, float]:
    """Seconds per page of the L3 key chain (blake2b-128 over each page's tokens), beside the
    tree's 64-bit page hash chain and the entry checksum of one page (what every put and get
    pays per page anyway)."""
    from hicache_jax.l3.storage import EntryCodec
    from hicache_jax.tree.hashing import chain_digests, namespace_seed
    from hicache_jax.tree.node import chain_hashes

    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50_000, (pages, SPEC.page_size)).astype(np.int64)
    seed = namespace_seed(SPEC.fingerprint(), None)
    codec = EntryCodec(SPEC)
    page = [host_buffer("page_first", 1).view(np.uint8).reshape(-1)]
    header = np.zeros(64, np.uint8)

    def best(fn, n):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) / n)
        return min(times)

    return {
        "key_chain_s": best(lambda: chain_digests(seed, toks), pages),
        "tree_hash_s": best(lambda: chain_hashes(0, toks), pages),
        "checksum_s": best(lambda: [codec.pack_into(header, "k", page) for _ in range(64)], 64),
        "checksum": codec.checksum,
    }


def host_buffer(layout: str, num_pages: int) -> np.ndarray:
    if layout == ENTRY_ROWS:
        rows = entry_rows(SPEC, num_pages)
        entry_pages(SPEC, rows)[:] = host_buffer("page_first", num_pages)
        return rows
    shape = SPEC.page_major_shape(num_pages) if layout == "page_first" else SPEC.kv_shape(num_pages)
    return np.random.default_rng(0).integers(0, 2**16, shape, dtype=np.uint16)


def interleaved(pairs: dict[str, tuple], repeats: int) -> dict[str, float]:
    """Median seconds of each ``(fn, setup)`` in ``pairs``, run alternately rep by rep so that
    load from other processes hits ours and raw alike."""
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for rep in range(repeats + 1):
        for name, (fn, setup) in pairs.items():
            arg = setup()
            t0 = time.perf_counter()
            fn(arg)
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def ours_calls(store, n: int) -> dict[str, tuple]:
    """put_from+wait (fresh keys each call) and get_into+wait of n pages through our backend."""
    ids, get_ids = np.arange(n), np.arange(n) + 128
    first = fresh_keys(n)
    assert store.put_from(first, ids).wait().all(), store.stats()

    def get(_):
        assert store.get_into(first, get_ids).wait().all(), store.stats()

    def put_q(key_sets):  # QUEUE handles in flight, as a cache with work queued keeps them
        for h in [store.put_from(keys, ids) for keys in key_sets]:
            h.wait()

    def get_q(_):
        for h in [store.get_into(first, get_ids) for _ in range(QUEUE)]:
            assert h.wait().all()

    return {
        "put": (lambda keys: store.put_from(keys, ids).wait(), lambda: fresh_keys(n)),
        "get": (get, lambda: None),
        "put q": (put_q, lambda: [fresh_keys(n) for _ in range(QUEUE)]),
        "get q": (get_q, lambda: None),
    }


def with_queue(raw: dict[str, tuple], n: int) -> dict[str, tuple]:
    """Add the raw counterparts of QUEUE batches: QUEUE calls in a row (a raw client is
    synchronous)."""
    put, _ = raw["raw put"]
    get, _ = raw["raw get"]

    def put_q(key_sets):
        for keys in key_sets:
            put(keys)

    def get_q(_):
        for _ in range(QUEUE):
            get(None)

    return raw | {
        "raw put q": (put_q, lambda: [fresh_keys(n) for _ in range(QUEUE)]),
        "raw get q": (get_q, lambda: None),
    }


class RawMooncake:
    """A plain client: batch_put_from / batch_get_into of bare pages from a registered buffer."""

    def __init__(self, address: str, buf: np.ndarray) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        assert self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 0, "tcp", "", address) == 0
        self.buf = buf
        assert self.store.register_buffer(buf.ctypes.data, buf.nbytes) == 0

    def calls(self, n: int) -> dict[str, tuple]:
        page, base = SPEC.page_bytes, self.buf.ctypes.data
        src = [base + i * page for i in range(n)]
        dst = [base + (128 + i) * page for i in range(n)]
        first = fresh_keys(n)
        assert self.store.batch_put_from(first, src, [page] * n) == [0] * n

        def put(keys):
            assert self.store.batch_put_from(keys, src, [page] * n) == [0] * n

        def get(_):
            assert self.store.batch_get_into(first, dst, [page] * n) == [page] * n

        return with_queue(
            {"raw put": (put, lambda: fresh_keys(n)), "raw get": (get, lambda: None)}, n
        )

    def close(self) -> None:
        self.store.unregister_buffer(self.buf.ctypes.data)
        self.store.close()


class RawFile:
    """Plain files: open/write and open/readinto of bare pages, one file per key."""

    def __init__(self, root: str, buf: np.ndarray) -> None:
        os.makedirs(root, exist_ok=True)
        self.root, self.flat = root, buf.reshape(buf.shape[0], -1).view(np.uint8)

    def calls(self, n: int) -> dict[str, tuple]:
        def put(keys):
            for i, k in enumerate(keys):
                with open(os.path.join(self.root, k), "wb") as f:
                    f.write(self.flat[i])

        first = fresh_keys(n)
        put(first)

        def get(_):
            for i, k in enumerate(first):
                with open(os.path.join(self.root, k), "rb") as f:
                    f.readinto(self.flat[128 + i])

        return with_queue(
            {"raw put": (put, lambda: fresh_keys(n)), "raw get": (get, lambda: None)}, n
        )

    def close(self) -> None:
        return None


def measure(backend: str, mode: str, store, raw, repeats: int) -> list[dict]:
    rows = []
    for n in BATCHES:
        t = interleaved(ours_calls(store, n) | raw.calls(n), repeats)
        nbytes = n * SPEC.page_bytes
        row = {"backend": backend, "mode": mode, "pages": n}
        for op in ("put", "get"):
            row[f"{op}_gbps"] = gbps(nbytes, t[op])
            row[f"raw_{op}_gbps"] = gbps(nbytes, t[f"raw {op}"])
            row[f"{op}_ratio"] = t[f"raw {op}"] / t[op]
            row[f"{op}_q_gbps"] = gbps(QUEUE * nbytes, t[f"{op} q"])
            row[f"raw_{op}_q_gbps"] = gbps(QUEUE * nbytes, t[f"raw {op} q"])
            row[f"{op}_q_ratio"] = t[f"raw {op} q"] / t[f"{op} q"]
        rows.append(row)
    return rows


def batch_option(batch_pages: int | None) -> dict:
    return {} if batch_pages is None else {"batch_pages": batch_pages}


def bench_mooncake(address: str | None, repeats: int, batch_pages: int | None) -> list[dict]:
    from tests.storage_servers import MooncakeServers  # tests/: a namespace package from the root

    servers = None
    if address is None:
        servers = MooncakeServers.start(segment_bytes=3 << 30)
        address = servers.address
    raw = None
    try:
        raw = RawMooncake(address, host_buffer("page_first", 256))
        rows = []
        for layout, zero_copy, checksum in CONFIGS["mooncake"]:
            with open_storage(
                f"mooncake://{address}",
                SPEC,
                host_buffer(layout, 256),
                layout,
                zero_copy=zero_copy,
                checksum=checksum,
                **batch_option(batch_pages),
            ) as store:
                mode = f"{layout}{' zero-copy' if zero_copy else ''} {checksum}"
                rows += measure("mooncake", mode, store, raw, repeats)
        return rows
    finally:
        if raw is not None:
            raw.close()
        if servers is not None:
            servers.stop()


def bench_file(repeats: int, batch_pages: int | None) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="bench-storage-")
    try:
        raw = RawFile(os.path.join(tmp, "raw"), host_buffer("page_first", 256))
        rows = []
        for layout, checksum in CONFIGS["file"]:
            with open_storage(
                f"file://{tmp}/{layout}-{checksum}",
                SPEC,
                host_buffer(layout, 256),
                layout,
                checksum=checksum,
                **batch_option(batch_pages),
            ) as store:
                rows += measure("file", f"{layout} {checksum}", store, raw, repeats)
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- part 2: HiCache with L3 on the multi-turn trace ------------------------------------------

CACHE_TARGET = 0.95  # hit ratio with L3 / infinite-cache hit ratio


def serve_trace(trace, spec: KVSpec, cfg, *, cache=None, prefetch: bool = True) -> dict:
    """Serve ``trace`` (prefetch, match, load_back, lock, alloc, write_kv, insert, unlock) through
    ``cache`` (or a fresh HiCache of ``cfg``); hit tokens by source, seconds, L3 counters."""
    from hicache_jax import HiCache

    cache = cache if cache is not None else HiCache(spec, cfg)
    ps = spec.page_size
    longest = max(p.shape[0] + r.shape[0] for p, r in trace) // ps
    kv = np.random.default_rng(0).integers(0, 0x3F80, spec.kv_shape(longest), dtype=np.uint16)
    dev_hit = host_hit = prompt = 0
    l3_before = cache.stats().get("l3_prefetch_hit_pages", 0)
    t0 = time.perf_counter()
    for p, r in trace:
        seq = np.concatenate([p, r])
        if prefetch:
            cache.prefetch(p)
        seq = seq[: seq.shape[0] // ps * ps]  # whole pages: what the cache keeps
        with cache.begin(p) as req:  # match, load back, lock
            new = req.extend(seq.shape[0] - req.cached_len)
            cache.write_kv(new, kv[:, :, : new.shape[0]])
            req.finish(seq)  # insert, unlock
        dev_hit += req.cached_len - req.loaded_len
        host_hit += req.loaded_len
        prompt += p.shape[0]
    cache.flush()
    s = cache.stats()
    return {
        "prompt_tokens": prompt,
        "device_hit_tokens": dev_hit,
        "host_hit_tokens": host_hit,
        "hit_ratio": (dev_hit + host_hit) / prompt,
        "seconds": time.perf_counter() - t0,
        "l3_fetched_tokens": (s.get("l3_prefetch_hit_pages", 0) - l3_before) * ps,
        "l3_stored_pages": s.get("l3_put_pages_stored", 0),
        "l3_puts_dropped": s.get("l3_puts_dropped", 0) + s.get("l3_puts_skipped", 0),
        "host_evictions": s["host_evictions"],
        "backups_skipped": s["backups_skipped"],
    }


def bench_cache(args, backends: list[str]) -> tuple[list[dict], dict]:
    """Hit ratio without / with L3 vs the infinite cache, and the two-instance run."""
    from benchmarks.bench_hicache import size_pools
    from benchmarks.bench_tree import make_trace
    from hicache_jax import HiCache, HiCacheConfig

    targs = argparse.Namespace(
        seed=0,
        system_prompts=4,
        system_tokens=512,
        user_tokens=256,
        reply_tokens=256,
        conversations=24 if args.quick else 48,
        concurrency=8 if args.quick else 16,
        turns=4 if args.quick else 5,
    )
    ps = 16
    spec = KVSpec(4, 2, 64, "bfloat16", page_size=ps)
    trace = make_trace(targs)
    inf, working, device, host = size_pools(trace, ps, args.device_fraction, args.host_ratio)
    inf_ratio = inf["hit_tokens"] / inf["prompt_tokens"]
    print(
        f"\nmulti-turn trace: {len(trace)} requests, working set {working} pages; device "
        f"{device} pages, host {host} pages ({(device + host) / working:.0%} of the working set "
        f"together); page {spec.page_bytes // 1024} KiB; "
        f"infinite-cache hit ratio {inf_ratio:.3f}"
    )
    base = dict(
        device_pages=device,
        host_pages=host,
        load_back_threshold=ps,
        prefetch_policy="wait_complete",
    )
    tmp = tempfile.mkdtemp(prefix="bench-l3-")
    servers = None
    runs: dict[str, dict] = {}
    try:
        urls = {"file": f"file://{tmp}/store"} if "file" in backends else {}
        if "mooncake" in backends:
            from tests.storage_servers import MooncakeServers

            if args.mooncake is None:
                servers = MooncakeServers.start(segment_bytes=2 << 30)
            urls["mooncake"] = f"mooncake://{args.mooncake or servers.address}"
        serve_trace(trace[:8], spec, HiCacheConfig(**base))  # untimed: jit compiles
        runs["L1+L2, no L3"] = serve_trace(trace, spec, HiCacheConfig(**base))
        # control: the same L3 writes (new leaves backed up too) but never read back
        cache = HiCache(spec, HiCacheConfig(storage=f"file://{tmp}/control", **base))
        runs["L1+L2, L3 written not read"] = serve_trace(
            trace, spec, None, cache=cache, prefetch=False
        )
        cache.close()
        for name, url in urls.items():
            cache = HiCache(spec, HiCacheConfig(storage=url, **base))
            runs[f"L1+L2+L3 {name}"] = serve_trace(trace, spec, None, cache=cache)
            cache.close()
        # two instances, one store (a fresh file store: only A's pages are in it)
        half = len(trace) // 2
        url2 = f"file://{tmp}/shared"
        a = HiCache(spec, HiCacheConfig(storage=url2, **base))
        runs["instance A (1st half)"] = serve_trace(trace[:half], spec, None, cache=a)
        a.close()
        b = HiCache(spec, HiCacheConfig(storage=url2, **base))
        runs["instance B (2nd half)"] = serve_trace(trace[half:], spec, None, cache=b)
        b.close()
        runs["B alone, no L3"] = serve_trace(trace[half:], spec, HiCacheConfig(**base))
    finally:
        if servers is not None:
            servers.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [
        {"run": name, **r, "vs_infinite": r["hit_ratio"] / inf_ratio} for name, r in runs.items()
    ]
    print_table(
        [
            "run",
            "hit ratio",
            "vs infinite",
            "L1 hit tok",
            "L2 hit tok",
            "from L3 tok",
            "L3 stored pg",
            "L3 dropped",
            "host evictions",
            "backups skipped",
            "seconds",
        ],
        [
            [
                r["run"],
                r["hit_ratio"],
                r["vs_infinite"],
                r["device_hit_tokens"],
                r["host_hit_tokens"],
                r["l3_fetched_tokens"],
                r["l3_stored_pages"],
                r["l3_puts_dropped"],
                r["host_evictions"],
                r["backups_skipped"],
                r["seconds"],
            ]
            for r in rows
        ],
        title=f"HiCache + L3, host pool too small (target with L3: vs infinite >= "
        f"{CACHE_TARGET}; instance rows: vs the whole trace's infinite ratio)",
    )
    ok = all(r["vs_infinite"] >= CACHE_TARGET for r in rows if r["run"].startswith("L1+L2+L3"))
    print(
        f"target with L3 >= {CACHE_TARGET} of infinite: {'met' if ok else 'NOT met'}; "
        f"instance B got {runs['instance B (2nd half)']['l3_fetched_tokens']} tokens from L3 "
        f"that only A computed"
    )
    return rows, {
        "device_pages": device,
        "host_pages": host,
        "working_set_pages": working,
        "infinite_hit_ratio": inf_ratio,
        "trace": vars(targs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    ap.add_argument("--json", default=None)
    ap.add_argument("--backends", default="file,mooncake")
    ap.add_argument("--mooncake", default=None, help="host:port of a running master")
    ap.add_argument(
        "--batch-pages",
        type=int,
        default=None,
        help="pages per backend call (default: each backend's own)",
    )
    ap.add_argument("--part", default="all", choices=["raw", "cache", "all"])
    ap.add_argument(
        "--device-fraction",
        type=float,
        default=0.15,
        help="cache part: device pages / working-set pages",
    )
    ap.add_argument(
        "--host-ratio", type=float, default=2.0, help="cache part: host pages / device pages"
    )
    args = ap.parse_args()
    repeats = 3 if args.quick else 7
    backends = args.backends.split(",")
    if args.part != "raw":
        cache_rows, cache_cfg = bench_cache(args, backends)
        if args.part == "cache":
            write_json(args.json, "bench_storage_cache", cache_cfg, cache_rows)
            return
    rows = []
    if "file" in backends:
        rows += bench_file(repeats, args.batch_pages)
    if "mooncake" in backends:
        rows += bench_mooncake(args.mooncake, repeats, args.batch_pages)
    memcpy = gbps(128 * SPEC.page_bytes, memcpy_seconds(128 * SPEC.page_bytes))
    keys = key_hashing_cost()
    print(
        f"L3 keys (128-bit blake2b chain over {SPEC.page_size} tokens): "
        f"{keys['key_chain_s'] * 1e6:.2f} us/page; the tree's 64-bit chain "
        f"{keys['tree_hash_s'] * 1e6:.2f} us/page; an entry's {keys['checksum']} checksum of "
        f"its {SPEC.page_bytes // 1024} KiB page {keys['checksum_s'] * 1e6:.1f} us/page "
        f"(key / checksum = {keys['key_chain_s'] / keys['checksum_s']:.3f})"
    )
    headers = [
        "backend",
        "mode",
        "pages",
        "put GB/s",
        "raw",
        "ratio",
        f"put x{QUEUE}",
        "raw",
        "ratio",
        "get GB/s",
        "raw",
        "ratio",
        f"get x{QUEUE}",
        "raw",
        "ratio",
    ]
    cols = [
        "put_gbps",
        "raw_put_gbps",
        "put_ratio",
        "put_q_gbps",
        "raw_put_q_gbps",
        "put_q_ratio",
        "get_gbps",
        "raw_get_gbps",
        "get_ratio",
        "get_q_gbps",
        "raw_get_q_gbps",
        "get_q_ratio",
    ]
    print_table(
        headers,
        [[r["backend"], r["mode"], r["pages"]] + [r[c] for c in cols] for r in rows],
        title=f"L3 put/get, {SPEC.page_bytes // 1024} KiB pages, medians of {repeats}; "
        f"memcpy of 128 pages: {memcpy:.2f} GB/s; target ratio >= 0.8",
    )
    config = {
        "spec": str(SPEC),
        "batches": BATCHES,
        "batch_pages": args.batch_pages,
        "repeats": repeats,
        "memcpy_gbps": memcpy,
        "key_hashing": keys,
    }
    if args.part == "all":
        config, rows = config | {"cache": cache_cfg}, {"raw": rows, "cache": cache_rows}
    write_json(args.json, "bench_storage", config, rows)


if __name__ == "__main__":
    main()
