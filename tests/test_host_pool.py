"""HostPagePool: layouts, placement, bit-exact write/read, validation before any change."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import heads_mesh as _mesh
from helpers import poison as _poison_value
from helpers import poisoned_host_pool as _poisoned
from helpers import random_bits
from hicache_jax.memory.host_pool import HostPagePool
from hicache_jax.memory.page_copy import STAGE_SIZES, copy_pages, gather_pages, stage_chunks
from hicache_jax.spec import SUPPORTED_DTYPES, HostLayout, KVSpec

LAYOUTS = ("layer_first", "page_first")


def _snapshot(pool: HostPagePool) -> np.ndarray:
    return np.array(pool.buffer)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shapes_and_default_placement(layout):
    spec = KVSpec(3, 2, 8, "float16", page_size=4)
    pool = HostPagePool(spec, 5, layout)
    want = (3, 2, 5, 4, 2, 8) if layout == "layer_first" else (5, 3, 2, 4, 2, 8)
    assert pool.shape == want and pool.buffer.shape == want
    assert pool.buffer.dtype == np.uint16
    assert pool.layout is HostLayout(layout)
    # CPU: "auto" keeps the buffer in the CPU device's own memory (host RAM).
    assert pool.memory_kind == jax.devices()[0].default_memory().kind
    assert pool.on_device_memory
    assert pool.allocator.num_pages == 5 and pool.allocator.num_free == 5
    assert pool.nbytes == 5 * spec.page_bytes


def test_mla_and_empty_pool():
    spec = KVSpec(2, 1, 16, "bfloat16", page_size=2, mla=True)
    pool = HostPagePool(spec, 3, "page_first")
    assert pool.shape == (3, 2, 1, 2, 1, 16)
    empty = HostPagePool(spec, 0)
    assert empty.read([]).shape == spec.kv_shape(0)
    with pytest.raises(ValueError, match="outside the host pool"):
        empty.read([0])


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(num_pages=-1), ValueError, "num_pages"),
        (dict(num_pages=2.0), TypeError, "num_pages"),
        (dict(layout="rows"), ValueError, "layout"),
        (dict(memory_kind="hbm"), ValueError, "memory_kind"),
        (dict(memory_kind="unpinned_host"), ValueError, "memory_kind"),  # its copies aborted
        (dict(axis="heads"), ValueError, "without a mesh"),
    ],
)
def test_bad_construction(kwargs, err, match):
    args = dict(num_pages=4) | kwargs
    spec = KVSpec(1, 4, 8)
    with pytest.raises(err, match=match):
        HostPagePool(spec, args.pop("num_pages"), **args)


def test_bad_mesh_axis_and_heads():
    with pytest.raises(ValueError, match="not an axis"):
        HostPagePool(KVSpec(1, 4, 8), 2, mesh=_mesh(), axis="x")
    with pytest.raises(ValueError, match="divisible"):
        HostPagePool(KVSpec(1, 2, 8), 2, mesh=_mesh())
    with pytest.raises(TypeError, match="KVSpec"):
        HostPagePool("spec", 2)


# Every dtype, both layouts, page sizes 1/16/64 (a full cross product only multiplies
# compiles: the copy depends on the bits width, the layout and the shapes). Specs and pool size
# match tests/test_transfer.py so a joint run shares compiles.
CASES = [
    ("bfloat16", "layer_first", 16),
    ("bfloat16", "page_first", 16),
    ("float16", "page_first", 1),
    ("float32", "layer_first", 64),
    ("float8_e4m3fn", "layer_first", 1),
    ("int8", "page_first", 64),
]
assert {c[0] for c in CASES} == set(SUPPORTED_DTYPES)


@pytest.mark.parametrize("dtype, layout, page_size", CASES)
def test_write_read_bit_exact(dtype, layout, page_size):
    spec = KVSpec(2, 2, 8, dtype, page_size=page_size)
    rng = np.random.default_rng(sum(map(ord, dtype + layout)) + page_size)
    pool = _poisoned(spec, 8, layout)
    ids = np.array([6, 2, 5])
    kv = random_bits(spec, 3, rng)
    pool.write(ids, kv)
    want = np.full(spec.kv_shape(8), _poison_value(spec), spec.bits_dtype)
    want[:, :, ids] = kv
    np.testing.assert_array_equal(pool.read(np.arange(8)), want)  # others still poison
    np.testing.assert_array_equal(pool.read([5, 6]), kv[:, :, [2, 0]])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("memory_kind", ["auto", "pinned_host"])
def test_sharded_write_read(layout, memory_kind):
    spec = KVSpec(2, 8, 4, "bfloat16", page_size=2)
    pool = _poisoned(spec, 6, layout, mesh=_mesh(), memory_kind=memory_kind)
    assert pool.buffer.sharding.spec[4] == "heads"
    assert pool.buffer.sharding.memory_kind == pool.memory_kind
    # Each device holds 2 of the 8 heads of every page: a contiguous buffer per shard.
    assert {s.data.shape[4] for s in pool.buffer.addressable_shards} == {2}
    kv = random_bits(spec, 2, np.random.default_rng(1))
    pool.write([4, 0], kv)
    np.testing.assert_array_equal(pool.read([4, 0]), kv)
    assert (pool.read([1, 2, 3, 5]) == _poison_value(spec)).all()
    assert pool.buffer.sharding.memory_kind == pool.memory_kind


def test_pinned_host_unsharded_round_trip():
    spec = KVSpec(2, 2, 8, "float32", page_size=3)
    pool = _poisoned(spec, 4, "page_first", memory_kind="pinned_host")
    assert pool.buffer.sharding.memory_kind == "pinned_host" and not pool.on_device_memory
    kv = random_bits(spec, 1, np.random.default_rng(2))
    pool.write([3], kv)
    np.testing.assert_array_equal(pool.read([3]), kv)


def test_write_accepts_spec_dtype_and_jax_arrays():
    spec = KVSpec(1, 2, 4, "bfloat16", page_size=2)
    pool = _poisoned(spec, 4)
    kv = jnp.asarray(np.random.default_rng(4).standard_normal(spec.kv_shape(2)), jnp.bfloat16)
    pool.write([1, 3], kv)
    np.testing.assert_array_equal(pool.read([1, 3]), np.asarray(kv).view(np.uint16))
    pool.write([0], np.asarray(kv)[:, :, :1])
    np.testing.assert_array_equal(pool.read([0]), np.asarray(kv)[:, :, :1].view(np.uint16))


@pytest.mark.parametrize(
    "ids, kv_pages, dtype, err, match",
    [
        ([0, 4], 2, np.uint16, ValueError, "outside the host pool"),
        ([1, 1], 2, np.uint16, ValueError, "duplicate"),
        ([-1], 1, np.uint16, ValueError, "negative"),
        ([[0]], 1, np.uint16, ValueError, "1-D"),
        ([0.5], 1, np.uint16, TypeError, "integers"),
        ([0, 1], 3, np.uint16, ValueError, "kv.shape"),
        ([0], 1, np.uint32, TypeError, "kv.dtype"),
        ([0], 1, np.float32, TypeError, "kv.dtype"),
    ],
)
def test_bad_write_changes_nothing(ids, kv_pages, dtype, err, match):
    spec = KVSpec(1, 2, 4, "float16", page_size=2)
    pool = _poisoned(spec, 4, "page_first")
    before = _snapshot(pool)
    kv = np.ones(spec.kv_shape(kv_pages), dtype)
    with pytest.raises(err, match=match):
        pool.write(ids, kv)
    with pytest.raises(TypeError, match="kv must be"):
        pool.write([0], [[1]])
    np.testing.assert_array_equal(_snapshot(pool), before)


def test_donation_keeps_buffer_and_rebinds():
    spec = KVSpec(2, 2, 8, "bfloat16", page_size=4)
    pool = HostPagePool(spec, 8)
    old = pool.buffer
    ptr = old.unsafe_buffer_pointer()
    pool.write([2], np.ones(spec.kv_shape(1), np.uint16))
    assert old.is_deleted()
    assert pool.buffer.unsafe_buffer_pointer() == ptr  # in place: no pool-sized copy


def test_run_rejects_a_step_that_does_not_donate():
    spec = KVSpec(1, 2, 4, page_size=2)
    pool = HostPagePool(spec, 4)
    step = jax.jit(lambda buf: (buf + 1, jnp.int32(0)))
    with pytest.raises(ValueError, match="did not donate"):
        pool.run(step)
    bad_shape = jax.jit(lambda buf: (buf[:, :1], jnp.int32(0)), donate_argnums=0)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match="shape"):
        pool.run(bad_shape)
    assert not pool.buffer.is_deleted()  # checked before dispatch
    np.testing.assert_array_equal(_snapshot(pool), before)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_read_async_sees_the_pages_as_of_its_dispatch(layout):
    """A read dispatched, then the same pages overwritten at once (what L3 write_back does when
    it frees evicted host pages): the read still yields the old bytes, the pool the new ones."""
    spec = KVSpec(2, 2, 4, "bfloat16", page_size=2)
    pool = HostPagePool(spec, 80, layout)
    rng = np.random.default_rng(7)
    ids = rng.permutation(80)[:70]  # two chunks: 64 + 6 (padded to 8)
    old, new = random_bits(spec, 70, rng), random_bits(spec, 70, rng)
    pool.write(ids, old)
    read = pool.read_async(ids)
    assert read.num_pages == 70
    pool.write(ids, new)
    np.testing.assert_array_equal(read.result(), old)
    assert read.done()
    out = np.zeros(spec.page_major_shape(75), spec.bits_dtype)
    rows = rng.permutation(75)[:70]
    read.copy_into(out, rows)  # out[rows[i]] = page i, a page-major buffer
    np.testing.assert_array_equal(np.moveaxis(out[rows], 0, 2), old)
    assert not out[np.setdiff1d(np.arange(75), rows)].any()
    np.testing.assert_array_equal(pool.read(ids), new)
    with pytest.raises(ValueError):
        pool.read_async([0, 0])  # validated before dispatch
    typed = np.zeros(spec.page_major_shape(75), jnp.bfloat16)  # numpy would convert values
    with pytest.raises(TypeError, match="bits dtype"):
        read.copy_into(typed, rows)
    assert not typed.view(np.uint16).any()


def test_mla_pools_on_a_mesh_are_replicated_and_round_trip():
    """MLA device pools are replicated over the mesh; the host pool used to refuse the mesh
    (one latent head does not divide by the axis), so no MLA HiCache could be sharded."""
    from hicache_jax import HiCache, HiCacheConfig

    spec = KVSpec(2, 1, 16, "bfloat16", page_size=2, mla=True)
    mesh = _mesh()
    pool = HostPagePool(spec, 6, "page_first", mesh=mesh)
    assert pool.sharding.spec == jax.sharding.PartitionSpec()
    cache = HiCache(
        spec, HiCacheConfig(device_pages=4, host_pages=8, mesh=mesh, load_back_threshold=2)
    )
    rng = np.random.default_rng(3)
    kv = random_bits(spec, 3, rng)
    toks = np.arange(6)
    pages = cache.alloc_pages(3)
    cache.write_kv(pages, kv)
    cache.insert(toks, pages)
    cache.insert(toks, cache.match_prefix(toks).device_pages)  # the hit backs it up
    cache.flush()
    assert cache.evict(6) == 6
    m = cache.load_back(cache.match_prefix(toks))
    assert m.device_len == 6
    np.testing.assert_array_equal(np.asarray(cache.read_kv(m.device_pages)).view(np.uint16), kv)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_write_rows_from_a_strided_page_major_buffer(layout):
    from hicache_jax.l3.storage import entry_pages, entry_rows

    spec = KVSpec(2, 2, 4, "bfloat16", page_size=2)
    pool = HostPagePool(spec, 90, layout)
    rng = np.random.default_rng(9)
    src = entry_pages(spec, entry_rows(spec, 80))  # page-major, rows strided by their headers
    src[:] = np.moveaxis(random_bits(spec, 80, rng), 2, 0)
    ids, rows = rng.permutation(90)[:70], rng.permutation(80)[:70]  # 64 + 6 pages
    pool.write_rows(ids, src, rows)
    np.testing.assert_array_equal(pool.read(ids), np.moveaxis(src[rows], 0, 2))
    before = _snapshot(pool)
    for args, err in (
        ((ids[:3], src, rows[:2]), ValueError),  # lengths differ
        ((ids[:2], src, [0, 80]), ValueError),  # row out of range
        ((ids[:2], src[:, :1], rows[:2]), ValueError),  # not page-major pages
        ((ids[:2], src.view(np.int16), rows[:2]), TypeError),
        ((ids[:2], src.tolist(), rows[:2]), TypeError),
        (([0, 0], src, rows[:2]), ValueError),
    ):  # duplicate host ids
        with pytest.raises(err):
            pool.write_rows(*args)
    np.testing.assert_array_equal(_snapshot(pool), before)


def test_compiles_bounded_by_stage_sizes():
    spec = KVSpec(1, 2, 4, "int8", page_size=2)
    pool = HostPagePool(spec, 160, "page_first")
    rng = np.random.default_rng(3)
    sizes = (1, 2, 3, 5, 8, 9, 17, 33, 64, 65, 100, 129, 160)
    before = copy_pages._cache_size(), gather_pages._cache_size()
    for n in sizes:
        ids = rng.permutation(160)[:n]
        kv = random_bits(spec, n, rng)
        pool.write(ids, kv)
        np.testing.assert_array_equal(pool.read(ids), kv)
    # one write and one read variant per staging size, nothing per batch size
    assert copy_pages._cache_size() - before[0] <= len(STAGE_SIZES)
    assert gather_pages._cache_size() - before[1] <= len(STAGE_SIZES)
    assert stage_chunks(0) == [] and stage_chunks(1) == [(0, 1, 1)]
    assert stage_chunks(130) == [(0, 64, 64), (64, 64, 64), (128, 2, 8)]
