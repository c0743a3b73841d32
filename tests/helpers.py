"""Helpers shared by the test files (no tests here): page bits, poison, poisoned pools, small
specs and caches.

Import them as ``from helpers import ...``: pytest puts ``tests/`` on ``sys.path`` (there is no
``tests/__init__.py``), as for ``storage_servers``.

Poison: every page a test has not written holds :data:`POISON` of its dtype, a NaN for the float
dtypes (a stray read shows in any arithmetic, and in bit compares), the most negative value for
int8. :func:`random_bits` never produces it, nor zero, so a page read from the wrong place or left
unwritten never passes for the data.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from hicache_jax import HiCache, HiCacheConfig, KVSpec
from hicache_jax.memory.device_pool import DevicePagePool
from hicache_jax.memory.host_pool import HostPagePool

#: KV dtype -> the unsigned dtype of its bits (what the pools store).
BITS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32,
        "float8_e4m3fn": np.uint8, "int8": np.uint8}

#: Poison bit pattern per KV dtype: a NaN for the floats, the most negative value for int8.
POISON = {"bfloat16": 0x7FC1, "float16": 0x7E01, "float32": 0x7FC00001,
          "float8_e4m3fn": 0x7F, "int8": 0x80}


def poison(spec: KVSpec) -> int:
    """The poison bit pattern of ``spec.dtype``."""
    return POISON[spec.dtype]


def random_bits(spec: KVSpec, n: int, seed: int | np.random.Generator) -> np.ndarray:
    """Random bits ``spec.kv_shape(n)`` of ``spec.bits_dtype``, never zero, never the poison.

    Args:
        seed: an int (the same bits every call) or a Generator (advanced by the call).
    """
    rng = np.random.default_rng(seed)
    bits = rng.integers(1, np.iinfo(spec.bits_dtype).max, size=spec.kv_shape(n),
                        dtype=spec.bits_dtype, endpoint=True)
    bits[bits == poison(spec)] = 1
    return bits


def poisoned_device_pool(spec: KVSpec, num_pages: int, **kw) -> DevicePagePool:
    """A device pool (``DevicePagePool(spec, num_pages, **kw)``) whose every page, the scratch
    page included, holds the poison; no page allocated."""
    pool = DevicePagePool(spec, num_pages, **kw)
    # A device_put, not pool.write: one compile less per test spec (compiles dominate run time).
    # Of a broadcast, not of a contiguous array, which the CPU client may alias when it is
    # aligned: the copy is a buffer of XLA's own, which donations then reuse in place.
    bits = np.broadcast_to(np.array(poison(spec), spec.bits_dtype), pool.shape)
    pool.array = jax.device_put(bits, pool.array.sharding)
    return pool


def poisoned_host_pool(spec: KVSpec, num_pages: int, layout: str = "layer_first",
                       **kw) -> HostPagePool:
    """A host pool (``HostPagePool(spec, num_pages, layout, **kw)``) whose every page holds the
    poison; no page allocated."""
    pool = HostPagePool(spec, num_pages, layout, **kw)
    pool.write(np.arange(num_pages), np.full(spec.kv_shape(num_pages), poison(spec),
                                             spec.bits_dtype))
    return pool


def heads_mesh() -> Mesh:
    """The 4 CPU devices of conftest on one axis, ``"heads"`` (axis type Auto)."""
    return Mesh(np.array(jax.devices()[:4]), ("heads",))


def bookkeeping_spec(page_size: int = 4) -> KVSpec:
    """The smallest KV (1 layer, 1 head of 2, float16: 8 bytes a token): for tests of what the
    cache records (events, routing), where the bytes do not matter."""
    return KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float16", page_size=page_size)


def make_cache(spec: KVSpec, device_pages: int = 16, host_pages: int = 32, **cfg) -> HiCache:
    """``HiCache(spec, HiCacheConfig(device_pages, host_pages, **cfg))``, with
    ``load_back_threshold`` one page unless given (a host hit of one page is loaded back)."""
    cfg.setdefault("load_back_threshold", spec.page_size)
    return HiCache(spec, HiCacheConfig(device_pages=device_pages, host_pages=host_pages, **cfg))


def serve(cache: HiCache, tokens, extra_key=None) -> None:
    """One request without KV bytes, through the handle: begin (match, load back, lock), the
    pages of the rest of the whole pages, finish (insert, unlock)."""
    tokens = np.asarray(tokens)
    tokens = tokens[:tokens.size // cache.spec.page_size * cache.spec.page_size]
    with cache.begin(tokens, extra_key) as req:
        req.extend(tokens.size - req.cached_len)
        req.finish(tokens)
