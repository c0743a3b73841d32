"""Helpers shared by the tests of HiCache with an L3 tier (test_hicache_storage.py) and the
instance it runs in another process (l3_instance.py); no tests here.

A float32 spec of 4-token pages, a cache over a storage URL, random prompts with their KV, a
request that computes a prompt (through the request handle), the read of a cached prefix, and a
prompt written by one cache and prefetched from L3 by another.
Import them as ``from l3_helpers import ...`` (pytest puts ``tests/`` on ``sys.path``; the
instance runs from ``tests/``).
"""

import numpy as np

from hicache_jax import HiCache, HiCacheConfig, KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
PS = SPEC.page_size


def make(url, device_pages=32, host_pages=64, **kw) -> HiCache:
    """A cache of :data:`SPEC` over the L3 store ``url``; write-through at the first access and a
    load-back threshold of one page unless given."""
    kw = {"write_through_threshold": 1, "load_back_threshold": PS, **kw}
    cfg = HiCacheConfig(device_pages=device_pages, host_pages=host_pages, storage=url, **kw)
    return HiCache(SPEC, cfg)


def tokens_kv(seed, npages):
    """A random prompt of ``npages`` whole pages (int64 ``[npages * PS]``) and its KV (float32
    ``SPEC.kv_shape(npages)``), both from ``seed``."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 50_000, npages * PS)
    kv = rng.standard_normal(SPEC.kv_shape(npages)).astype(np.float32)
    return toks, kv


def write_then_prefetch(spec, cfg, npages, seed):
    """Cache ``a`` (``HiCacheConfig(**cfg)``) computes a random prompt of ``npages`` pages of
    ``spec`` and hits it (the hit backs it up, then L3), flushed; cache ``b`` (the same config,
    prefetch_policy wait_complete) prefetches it. Returns ``a, b, handle, toks, kv``, both open."""
    a = HiCache(spec, HiCacheConfig(**cfg))
    b = HiCache(spec, HiCacheConfig(**cfg, prefetch_policy="wait_complete"))
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 50_000, npages * spec.page_size)
    kv = rng.standard_normal(spec.kv_shape(npages)).astype(np.float32)
    with a.begin(toks) as req:
        a.write_kv(req.extend(len(toks)), kv)
        req.finish(toks)
    with a.begin(toks) as req:
        req.finish(toks)
    a.flush()
    return a, b, b.prefetch(toks), toks, kv


def compute(cache, toks, kv):
    """A request that computes the pages of ``toks`` it does not find cached (their KV: the
    pages of ``kv`` from there on), then a hit on it (the hit backs it up where the threshold
    asks for two accesses)."""
    with cache.begin(toks) as req:
        new = req.extend(len(toks) - req.cached_len)
        cache.write_kv(new, kv[:, :, req.cached_len // PS :])
        req.finish(toks)
    with cache.begin(toks) as req:
        req.finish(toks)


def read_prefix(cache, toks):
    """match + load_back; returns (host tokens matched (L2, or L3 landed), device tokens after
    the load-back, uint32 bits of every page on device)."""
    m = cache.match_prefix(toks)
    host = m.host_len
    m = cache.load_back(m)
    return host, m.device_len, np.asarray(cache.read_kv(m.device_pages)).view(np.uint32)


def bits32(kv):
    """The uint32 bit patterns of float32 KV (what :func:`read_prefix` returns)."""
    return kv.view(np.uint32)


def l3(cache):
    """The ``l3_*`` counters of ``cache.stats()``."""
    return {k: v for k, v in cache.stats().items() if k.startswith("l3_")}
