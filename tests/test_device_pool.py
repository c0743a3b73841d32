"""DevicePagePool: bit-exact round trips, donation, bounded compiles, validation, run(),
sharding."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from helpers import POISON, random_bits
from helpers import poisoned_device_pool as poisoned_pool
from hicache_jax.memory import device_pool as dp
from hicache_jax.memory.device_pool import DevicePagePool, bucket_size
from hicache_jax.spec import CopyBackend, KVSpec

DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8")


def make_mesh(axis_type=AxisType.Auto):
    return jax.make_mesh((4,), ("tp",), axis_types=(axis_type,))


def pool_bits(pool: DevicePagePool) -> np.ndarray:
    """Host copy of the allocatable pages (scratch page excluded)."""
    return np.asarray(pool.array)[:, :, : pool.num_pages]


def shard_pointers(arr: jax.Array) -> list[int]:
    return [s.data.unsafe_buffer_pointer() for s in arr.addressable_shards]


def check_round_trip(pool: DevicePagePool, seed: int) -> None:
    """Write random pages (numpy bits padded to a bucket; jax in the spec dtype), read them back
    bit-exactly in another order, and check every other page still holds the poison."""
    spec = pool.spec
    rng = np.random.default_rng(seed)
    ids = rng.permutation(pool.num_pages)[:9]
    first, second = random_bits(spec, 5, seed), random_bits(spec, 4, seed + 1)
    pool.write(ids[:5], first)  # bucket 8: 3 padded rows
    pool.write(ids[5:], jnp.asarray(second.view(spec.jnp_dtype)))  # bitcast inside the jit
    order = rng.permutation(9)
    out = pool.read(ids[order])  # bucket 16: 7 padded rows
    chex.assert_shape(out, spec.kv_shape(9))
    assert out.dtype == spec.jnp_dtype
    expect = np.concatenate([first, second], axis=2)[:, :, order]
    np.testing.assert_array_equal(np.asarray(out).view(spec.bits_dtype), expect)
    rest = np.setdiff1d(np.arange(pool.num_pages), ids)
    assert (pool_bits(pool)[:, :, rest] == POISON[spec.dtype]).all()


@pytest.mark.parametrize(
    "dtype, page_size",
    [(d, 16) for d in DTYPES]
    + [("bfloat16", 1), ("bfloat16", 64), ("float32", 1), ("float8_e4m3fn", 64)],
)
def test_round_trip_every_dtype_and_page_size(dtype, page_size):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=page_size)
    check_round_trip(poisoned_pool(spec, 24), seed=page_size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_sharded(dtype):
    spec = KVSpec(num_layers=2, num_kv_heads=8, head_dim=4, dtype=dtype, page_size=4)
    pool = poisoned_pool(spec, 20, mesh=make_mesh())
    check_round_trip(pool, seed=7)
    assert pool.array.sharding == NamedSharding(
        pool.sharding.mesh, PartitionSpec(None, None, None, None, "tp", None)
    )
    # Each device holds its 2 heads of every page, scratch page included.
    assert {s.data.shape for s in pool.array.addressable_shards} == {(2, 2, 21, 4, 2, 4)}
    assert len(pool.array.addressable_shards) == 4


@pytest.mark.parametrize("page_size", [1, 64])
def test_round_trip_sharded_page_sizes_explicit_mesh(page_size):
    spec = KVSpec(num_layers=1, num_kv_heads=4, head_dim=8, page_size=page_size)
    pool = poisoned_pool(spec, 16, mesh=make_mesh(AxisType.Explicit))
    check_round_trip(pool, seed=3)
    assert pool.array.sharding.spec == PartitionSpec(None, None, None, None, "tp", None)


@pytest.mark.parametrize("sharded", [False, True])
def test_native_scatter_variant(sharded):
    """The XLA backend uses a per-page update loop on CPU and the native scatter elsewhere
    (GPU/TPU): run the latter here too."""
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16", page_size=4)
    pool = poisoned_pool(spec, 16, mesh=make_mesh() if sharded else None)
    assert pool._scatter is dp._xla_scatter_loop  # this is a CPU run
    pool._scatter = dp._xla_scatter
    check_round_trip(pool, seed=5)


def test_sharded_write_and_read_stay_local():
    """Heads are sharded and pages move along an unsharded axis: no collective is compiled."""
    spec = KVSpec(num_layers=2, num_kv_heads=8, head_dim=8, page_size=4)
    pool = DevicePagePool(spec, 8, mesh=make_mesh())
    ids = np.array([3, 1, 8, 8], np.int32)
    kv = jnp.zeros(spec.kv_shape(4), jnp.bfloat16)
    for fn in (dp._xla_scatter_loop, dp._xla_scatter):
        text = (
            dp._write_pages.lower(pool.array, ids, kv, scatter=fn, sharding=pool.sharding)
            .compile()
            .as_text()
        )
        assert not any(
            c in text for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce")
        ), text
    text = (
        dp._read_pages.lower(
            pool.array, ids, gather=pool._gather, dtype=spec.jnp_dtype, sharding=pool.sharding
        )
        .compile()
        .as_text()
    )
    assert "all-gather" not in text and "all-to-all" not in text


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("sharded", [False, True])
def test_round_trip_mla(dtype, sharded):
    spec = KVSpec(num_layers=3, num_kv_heads=1, head_dim=32, dtype=dtype, page_size=16, mla=True)
    pool = poisoned_pool(spec, 16, mesh=make_mesh() if sharded else None)
    assert pool.array.shape == (3, 1, 17, 16, 1, 32)
    check_round_trip(pool, seed=11)
    if sharded:  # one latent head cannot be split: replicated on every device
        assert pool.array.sharding.is_fully_replicated


@pytest.mark.parametrize("sharded", [False, True])
def test_write_and_read_donate_and_keep_the_buffer(sharded, recwarn):
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=16, page_size=8)
    pool = DevicePagePool(spec, 32, mesh=make_mesh() if sharded else None)
    ptrs = shard_pointers(pool.array)
    for n, kv in (
        (3, random_bits(spec, 3, 0)),  # numpy, padded on the host
        (3, jnp.asarray(random_bits(spec, 3, 1)).view(jnp.bfloat16)),  # jax, padded
        (16, jnp.asarray(random_bits(spec, 16, 2)).view(jnp.bfloat16)),
    ):  # bitcast in jit
        old = pool.array
        pool.write(np.arange(n), kv)
        assert old.is_deleted()
        assert shard_pointers(pool.array) == ptrs
    old = pool.array
    pool.read([0, 1, 2])
    assert pool.array is old and not old.is_deleted()  # reads never donate
    # filterwarnings=error already turns "Some donated buffers were not usable" into an error;
    # recwarn makes sure no other warning slipped through a filter.
    assert not [w for w in recwarn if "donated" in str(w.message)]


def test_pools_of_one_shape_share_a_compile_not_a_buffer():
    from hicache_jax.memory.placement import _zeros_fn

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)
    a = DevicePagePool(spec, 12)
    misses = _zeros_fn.cache_info().misses
    b = DevicePagePool(spec, 12)
    assert _zeros_fn.cache_info().misses == misses  # the second pool compiled nothing
    assert shard_pointers(a.array) != shard_pointers(b.array)
    a.write([3], random_bits(spec, 1, 0))
    assert not np.asarray(b.array).any()  # b is its own zeroed buffer
    b.write([3], random_bits(spec, 1, 1))
    np.testing.assert_array_equal(np.asarray(a.read_bits([3])), random_bits(spec, 1, 0))


def test_bounded_compiles_across_batch_sizes():
    """The pool-sized scatter and gather are traced once per power-of-two bucket (and input
    dtype), however many batch sizes go through them: chex fails the first trace beyond the
    bound, at the call that made it; the counts then say the bound is exact."""
    traces = {"scatter": 0, "gather": 0}
    buckets = {bucket_size(n) for n in range(1, 65)}
    assert len(buckets) == 7
    bound = {"scatter": len(buckets) + 2, "gather": 4}  # + bfloat16 at buckets 1 and 16
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=2)
    pool = DevicePagePool(spec, 64)
    scatter, gather = pool._scatter, pool._gather

    # Two functions of their own source: chex keys its trace counter by a function's source.
    def counted_scatter(*args):
        traces["scatter"] += 1  # runs at trace time only
        return scatter(*args)

    def counted_gather(*args):
        traces["gather"] += 1
        return gather(*args)

    chex.clear_trace_counter()  # the counters are global: a rerun in this process starts at 0
    pool._scatter = chex.assert_max_traces(counted_scatter, n=bound["scatter"])
    pool._gather = chex.assert_max_traces(counted_gather, n=bound["gather"])
    rng = np.random.default_rng(0)
    expect = np.zeros(spec.kv_shape(64), spec.bits_dtype)
    for n in range(1, 65):  # numpy input: padded on the host, bits dtype
        ids = rng.permutation(64)[:n]
        bits = random_bits(spec, n, n)
        pool.write(ids, bits)
        expect[:, :, ids] = bits
    for n in (1, 3, 16):  # jax input: bfloat16 at a bucket, padded bits otherwise
        ids = rng.permutation(64)[:n]
        bits = random_bits(spec, n, n)
        pool.write(ids, jnp.asarray(bits).view(jnp.bfloat16))
        expect[:, :, ids] = bits
    for n in (1, 3, 4, 17, 64):
        ids = rng.permutation(64)[:n]
        np.testing.assert_array_equal(np.asarray(pool.read_bits(ids)), expect[:, :, ids])
    assert traces["scatter"] == bound["scatter"]
    assert traces["gather"] == bound["gather"]  # buckets 1, 4, 32, 64


@functools.partial(jax.jit, donate_argnums=0)
def _slow_step(pool):
    """Returns the pool unchanged after ~0.1-1 s of matmuls: later work on it queues behind."""
    x = jnp.ones((512, 512), jnp.float32) * (pool.ravel()[0] + 1).astype(jnp.float32)
    for _ in range(16):
        x = jnp.tanh(x @ x)
    return pool + (x[0, 0] > 2).astype(pool.dtype), x[0, 0]


def test_write_does_not_read_the_callers_numpy_array_after_returning():
    """A numpy kv of a bucket-sized page count went to the scatter as is; on CPU the transfer
    aliased it and the scatter ran after write() returned, so a caller reusing its buffer
    changed the pool."""
    spec = KVSpec(2, 2, 8, "bfloat16", page_size=4)
    pool = DevicePagePool(spec, 8)
    for n in (4, 4, 3):  # bucket-sized (the first call compiles), and padded (always copied)
        want = random_bits(spec, n, seed=n)
        raw = np.empty(want.nbytes + 64, np.uint8)  # 64-byte aligned: what jax may alias
        start = (-raw.ctypes.data) % 64
        kv = raw[start : start + want.nbytes].view(want.dtype).reshape(want.shape)
        kv[...] = want
        pool.run(_slow_step)  # the scatter below queues behind it
        pool.write(np.arange(n), kv)
        kv[...] = 0  # the caller reuses its buffer
        np.testing.assert_array_equal(np.asarray(pool.read_bits(np.arange(n))), want)


def test_bf16_nan_payloads_survive_a_kv_sharded_unlike_the_pool():
    """Resharding bfloat16 values inside the scatter canonicalized NaN payloads on XLA:CPU."""
    spec = KVSpec(2, 4, 8, "bfloat16", page_size=4)
    mesh = make_mesh()
    pool = DevicePagePool(spec, 8, mesh=mesh)
    bits = np.full(spec.kv_shape(4), 0xFF81, np.uint16)  # NaNs with a payload
    bits[..., ::2] = random_bits(spec, 4, seed=1)[..., ::2]
    for spec_axes in (
        PartitionSpec(None, None, None, None, None, "tp"),  # over head_dim
        PartitionSpec(None, None, "tp"),  # over pages
        PartitionSpec(),
    ):  # replicated
        kv = jax.device_put(bits.view(jnp.bfloat16), NamedSharding(mesh, spec_axes))
        pool.write(np.arange(4), kv)
        np.testing.assert_array_equal(np.asarray(pool.read_bits(np.arange(4))), bits)


def test_bucket_size():
    assert [bucket_size(n) for n in (0, 1, 2, 3, 4, 5, 16, 17, 1000)] == [
        1,
        1,
        2,
        4,
        4,
        8,
        16,
        32,
        1024,
    ]


@pytest.fixture
def filled_pool():
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4)
    pool = DevicePagePool(spec, 8)
    pool.write(np.arange(8), random_bits(spec, 8, 0))
    return pool


BAD_WRITES = [
    ([8], None, ValueError, "outside the device pool"),
    ([-1], None, ValueError, "negative"),
    ([1, 2, 1], None, ValueError, "duplicate"),
    ([0, 3, 5, 7, 6, 4, 2, 1, 3], None, ValueError, "duplicate"),
    ([[1, 2]], None, ValueError, "1-D"),
    ([1.0], None, TypeError, "integers"),
    ([True], None, TypeError, "integers"),
    ([1, 2], (2, 2, 3, 4, 2, 4), ValueError, r"kv.shape=.*kv_shape\(2\)"),
    ([1, 2], (2, 2, 2, 4, 2), ValueError, "kv.shape"),
    ([1, 2], "float32", TypeError, "kv.dtype=float32"),
    ([1, 2], "int16", TypeError, "kv.dtype=int16"),
    ([1, 2], "list", TypeError, "kv must be a jax.Array or numpy"),
]


@pytest.mark.parametrize("ids, kv_kind, err, match", BAD_WRITES)
@pytest.mark.parametrize("as_jax", [False, True])
def test_bad_write_raises_before_dispatch(filled_pool, ids, kv_kind, err, match, as_jax):
    pool, spec = filled_pool, filled_pool.spec
    n = np.asarray(ids).size if kv_kind is None else 2
    kv = random_bits(spec, n, 1)
    if isinstance(kv_kind, tuple):
        kv = np.ones(kv_kind, spec.bits_dtype)
    elif kv_kind in ("float32", "int16"):
        kv = kv.astype(kv_kind)
    if as_jax and kv_kind != "list":
        kv = jnp.asarray(kv)
    if kv_kind == "list":
        kv = kv.tolist()
    before_array, before = pool.array, pool_bits(pool)
    with pytest.raises(err, match=match):
        pool.write(ids, kv)
    assert pool.array is before_array and not before_array.is_deleted()  # nothing dispatched
    np.testing.assert_array_equal(pool_bits(pool), before)


@pytest.mark.parametrize(
    "ids, err, match",
    [
        ([8], ValueError, "outside"),
        ([0, 0], ValueError, "duplicate"),
        (np.zeros((1, 1), int), ValueError, "1-D"),
        (["a"], TypeError, "integers"),
    ],
)
def test_bad_read_raises(filled_pool, ids, err, match):
    with pytest.raises(err, match=match):
        filled_pool.read(ids)


@pytest.mark.parametrize(
    "ids, err, match",
    [
        (np.array([3, 8], np.int32), ValueError, "outside"),
        (np.array([3, -1], np.int64), ValueError, "negative"),
        (np.array([2**40], np.uint64), ValueError, "beyond int32"),
        (np.array([1, 5, 1], np.int16), ValueError, "duplicate"),
        (np.array([True, False]), TypeError, "integers"),
        (np.array([1.0]), TypeError, "integers"),
        (np.zeros((1, 2), np.int32), ValueError, "1-D"),
    ],
)
def test_numpy_ids_take_the_same_checks(filled_pool, ids, err, match):
    # numpy int arrays (the per-call common case) skip the generic conversion when valid; every
    # invalid one must still get the precise error.
    with pytest.raises(err, match=match):
        filled_pool.validate_ids(ids)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.uint64])
def test_numpy_ids_are_copied_to_int32(filled_pool, dtype):
    given = np.array([7, 0, 3], dtype)
    ids = filled_pool.validate_ids(given)
    assert ids.dtype == np.int32 and ids.tolist() == [7, 0, 3]
    ids[0] = 1  # a copy: the caller's array is untouched
    assert given.tolist() == [7, 0, 3]


def test_validate_ids_and_empty_calls(filled_pool):
    pool = filled_pool
    ids = pool.validate_ids(np.array([7, 0, 3], np.int64))
    assert ids.dtype == np.int32 and ids.tolist() == [7, 0, 3]
    before = pool.array
    pool.write([], np.zeros(pool.spec.kv_shape(0), pool.spec.bits_dtype))
    assert pool.array is before  # nothing to move: no dispatch
    out = pool.read([])
    chex.assert_shape(out, pool.spec.kv_shape(0))
    assert out.dtype == jnp.bfloat16


@functools.partial(jax.jit, donate_argnums=0)
def _step_write_page0(pool, k_layer0):
    """A caller's forward in miniature: write K of layer 0, page 0, return a reduction."""
    bits = jax.lax.bitcast_convert_type(k_layer0, pool.dtype)
    pool = pool.at[0, 0, 0].set(bits)
    return pool, jnp.sum(k_layer0.astype(jnp.float32))


@pytest.mark.parametrize("sharded", [False, True])
def test_run_caller_step(sharded):
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=4, page_size=2)
    pool = DevicePagePool(spec, 4, mesh=make_mesh() if sharded else None)
    ptrs = shard_pointers(pool.array)
    k = jnp.arange(1, 33, dtype=jnp.bfloat16).reshape(2, 4, 4)
    old = pool.array
    out = pool.run(_step_write_page0, k)
    assert float(out) == float(np.arange(1, 33).sum())
    assert old.is_deleted() and shard_pointers(pool.array) == ptrs
    np.testing.assert_array_equal(np.asarray(pool.read([0]))[0, 0, 0], np.asarray(k))


def test_run_rejects_wrong_shape_before_dispatch(filled_pool):
    pool = filled_pool
    bad = jax.jit(lambda p: (p[:, :, :3], 0), donate_argnums=0)
    before_array, before = pool.array, pool_bits(pool)
    with pytest.raises(ValueError, match="fn returned a pool of shape"):
        pool.run(bad)
    assert pool.array is before_array and not before_array.is_deleted()
    np.testing.assert_array_equal(pool_bits(pool), before)
    with pytest.raises(ValueError, match="must return"):
        pool.run(jax.jit(lambda p: p, donate_argnums=0))


def test_run_rejects_a_step_that_does_not_donate(filled_pool):
    pool = filled_pool
    copy_step = jax.jit(lambda p: (p.at[0, 0, 1].set(7), None))
    with pytest.raises(ValueError, match="did not donate"):
        pool.run(copy_step)
    assert (pool_bits(pool)[0, 0, 1] == 7).all()  # the step ran; the pool holds its result


def test_run_reshards_a_wrongly_sharded_result():
    mesh = make_mesh()
    spec = KVSpec(num_layers=1, num_kv_heads=4, head_dim=4, page_size=2)
    pool = DevicePagePool(spec, 4, mesh=mesh)
    replicated = jax.jit(
        lambda p: (p + 1, None),
        donate_argnums=0,
        out_shardings=(NamedSharding(mesh, PartitionSpec()), None),
    )
    # A replicated output cannot reuse the sharded buffers: JAX warns, run() then raises.
    with (
        pytest.warns(UserWarning, match="donated buffers were not usable"),
        pytest.raises(ValueError, match="sharding"),
    ):
        pool.run(replicated)
    assert pool.array.sharding.is_equivalent_to(pool.sharding, 6)
    assert (pool_bits(pool) == 1).all()


def test_construction_errors():
    spec = KVSpec(num_layers=1, num_kv_heads=6, head_dim=4)
    with pytest.raises(ValueError, match="num_pages=0"):
        DevicePagePool(spec, 0)
    with pytest.raises(TypeError, match="num_pages"):
        DevicePagePool(spec, True)
    with pytest.raises(TypeError, match="spec"):
        DevicePagePool("spec", 4)
    with pytest.raises(ValueError, match="without a mesh"):
        DevicePagePool(spec, 4, axis="tp")
    with pytest.raises(ValueError, match="not an axis"):
        DevicePagePool(spec, 4, mesh=make_mesh(), axis="dp")
    with pytest.raises(ValueError, match="num_kv_heads=6 is not divisible"):
        DevicePagePool(spec, 4, mesh=make_mesh())
    with pytest.raises(ValueError, match="copy_backend='cuda'"):
        DevicePagePool(spec, 4, copy_backend="cuda")


def test_layout_and_backend():
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
    pool = DevicePagePool(spec, 5, copy_backend=CopyBackend.XLA)
    assert pool.array.shape == (3, 2, 6, 4, 2, 8) and pool.array.dtype == np.uint32
    assert pool.scratch_page == 5 and pool.nbytes == pool.array.nbytes
    assert pool.allocator.num_pages == 5 and pool.allocator.name == "device"
    assert DevicePagePool(spec, 5).copy_backend is CopyBackend.XLA  # auto -> xla
    # Attention of layer l reads pool[l, 0] / pool[l, 1] as [pages, page_size, heads, dim].
    bits = random_bits(spec, 1, 5)
    pool.write([2], bits)
    np.testing.assert_array_equal(np.asarray(pool.array)[1, 1, 2], bits[1, 1, 0])
