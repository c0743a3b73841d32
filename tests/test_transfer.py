"""TransferEngine: bit-exact round trips, layer-wise loads, poll order, validation, reuse guard."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import heads_mesh, poisoned_device_pool, poisoned_host_pool, random_bits
from helpers import poison as _poison
from hicache_jax.errors import HiCacheError
from hicache_jax.memory.device_pool import DevicePagePool
from hicache_jax.memory.host_pool import HostPagePool
from hicache_jax.memory.page_copy import copy_pages, copy_plan
from hicache_jax.memory.transfer import TransferEngine, TransferHandle
from hicache_jax.spec import SUPPORTED_DTYPES, KVSpec

LAYOUTS = ("layer_first", "page_first")
# One spec and pool size for the tests that are not about dtypes or shapes: compiles are shared.
SPEC = KVSpec(2, 2, 8, "bfloat16", page_size=4)


def _setup(
    spec: KVSpec,
    layout: str = "layer_first",
    *,
    device_pages: int = 8,
    host_pages: int = 10,
    sharded: bool = False,
    memory_kind: str = "auto",
):
    """Pools with every page poisoned and allocated, and their engine."""
    mesh = heads_mesh() if sharded else None
    dev = poisoned_device_pool(spec, device_pages, mesh=mesh)
    host = poisoned_host_pool(spec, host_pages, layout, mesh=mesh, memory_kind=memory_kind)
    dev.allocator.alloc(device_pages)
    host.allocator.alloc(host_pages)
    return dev, host, TransferEngine(dev, host)


def _dev_bits(dev: DevicePagePool, ids) -> np.ndarray:
    return np.asarray(dev.read_bits(ids))


def _snapshots(dev: DevicePagePool, host: HostPagePool) -> tuple[np.ndarray, np.ndarray]:
    return np.array(dev.array), np.array(host.buffer)


def _round_trip(spec, layout, sharded, memory_kind="auto", seed=0):
    dev, host, eng = _setup(spec, layout, host_pages=8, sharded=sharded, memory_kind=memory_kind)
    rng = np.random.default_rng(seed)
    kv = random_bits(spec, 3, rng)
    dev.write([6, 1, 3], kv)
    backup = eng.backup([6, 1, 3], [2, 7, 4])
    assert isinstance(backup, TransferHandle) and backup.nbytes == 3 * spec.page_bytes
    dev.write([6, 1, 3], random_bits(spec, 3, rng))  # overwrite while the backup may be in flight
    load = eng.load([7, 2, 4], [0, 5, 7])
    assert eng.wait_all() == [backup, load]
    assert backup.done() and load.done() and eng.in_flight == 0
    # Whole pools read back (one read each): the copied pages hold kv, every other page of
    # the host pool and the untouched device pages are still poison.
    want_host = np.full(spec.kv_shape(8), _poison(spec), spec.bits_dtype)
    want_host[:, :, [2, 7, 4]] = kv
    np.testing.assert_array_equal(host.read(np.arange(8)), want_host)
    got_dev = _dev_bits(dev, np.arange(8))
    np.testing.assert_array_equal(got_dev[:, :, [5, 0, 7]], kv)
    assert (got_dev[:, :, [2, 4]] == _poison(spec)).all()


# Every dtype; each layout sharded and not; each page size 1/16/64 (a full cross product only
# multiplies compiles: the copy depends on the bits width, the layout and the shapes).
CASES = [
    ("bfloat16", "layer_first", 16, False),
    ("bfloat16", "page_first", 16, True),
    ("float16", "page_first", 1, False),
    ("float32", "layer_first", 64, True),
    ("float8_e4m3fn", "layer_first", 1, True),
    ("int8", "page_first", 64, False),
]
assert {c[0] for c in CASES} == set(SUPPORTED_DTYPES)


@pytest.mark.parametrize("dtype, layout, page_size, sharded", CASES)
def test_round_trip_bit_exact(dtype, layout, page_size, sharded):
    heads = 4 if sharded else 2
    _round_trip(KVSpec(2, heads, 8, dtype, page_size=page_size), layout, sharded)


@pytest.mark.parametrize("layout, sharded", [("page_first", True), ("layer_first", False)])
def test_round_trip_pinned_host(layout, sharded):
    # The accelerator code path (chunks moved between memory kinds inside the copy loop).
    _round_trip(KVSpec(2, 4, 8, "bfloat16", page_size=4), layout, sharded, "pinned_host")


def test_mla_round_trip():
    _round_trip(KVSpec(2, 1, 8, "bfloat16", page_size=4, mla=True), "page_first", False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layerwise_load(layout):
    spec = SPEC
    dev, host, eng = _setup(spec, layout)
    kv = random_bits(spec, 2, np.random.default_rng(1))
    host.write([3, 8], kv)
    handle = eng.load([3, 8], [4, 0], layerwise=True)
    assert handle.layerwise and eng.in_flight == 1
    for layer in range(spec.num_layers):
        handle.wait_layer(layer)
    assert handle.done() and handle.seconds is not None and handle.seconds >= 0
    np.testing.assert_array_equal(_dev_bits(dev, [4, 0]), kv)
    assert (_dev_bits(dev, [1, 2, 3, 5, 6, 7]) == _poison(spec)).all()
    with pytest.raises(ValueError, match="layer"):
        handle.wait_layer(spec.num_layers)
    with pytest.raises(ValueError, match="layer"):
        eng.load([3], [4]).wait_layer(-1)
    with pytest.raises(TypeError, match="layerwise"):
        eng.load([3], [4], layerwise=1)


def test_wait_layer_on_a_whole_load_waits_for_everything():
    spec = SPEC
    dev, host, eng = _setup(spec)
    kv = random_bits(spec, 1, np.random.default_rng(2))
    host.write([5], kv)
    handle = eng.load([5], [2])
    handle.wait_layer(0)
    assert handle.done()
    np.testing.assert_array_equal(_dev_bits(dev, [2]), kv)


def test_poll_returns_each_handle_once_in_completion_order():
    spec = SPEC
    _dev, _host, eng = _setup(spec, "page_first")
    handles = [eng.backup([i], [i]) for i in range(4)]
    handles.append(eng.load([0, 1], [6, 7], layerwise=True))
    assert eng.in_flight + len(eng._finished) == 5
    seen = []
    while len(seen) < 5:
        seen.extend(eng.poll())
    assert seen == handles, seen
    assert eng.poll() == [] and eng.in_flight == 0
    assert all(h.done() and h.seconds >= 0 for h in handles)
    # Waiting for the last transfer completes every earlier one (each depends on the previous).
    later = [eng.backup([i], [i + 4]) for i in range(3)]
    later[-1].wait()
    assert all(h.done() for h in later) and eng.in_flight == 0
    assert eng.poll() == later
    # A zero-page transfer dispatches nothing and completes at once.
    empty = eng.load([], [])
    assert empty.done() and empty.nbytes == 0 and eng.poll() == [empty]
    # Completed by wait(): still reported by the next poll, once.
    h = eng.backup([5], [5]).wait()
    assert eng.poll() == [h] and eng.poll() == []


@pytest.mark.parametrize(
    "call, args, err, match",
    [
        ("backup", ([0, 8], [0, 1]), ValueError, "device_ids has ids outside"),
        ("backup", ([0, 1], [0, 10]), ValueError, "host_ids has ids outside"),
        ("backup", ([2, 2], [0, 1]), ValueError, "device_ids has duplicate"),
        ("load", ([3, 3], [0, 1]), ValueError, "host_ids has duplicate"),
        ("load", ([0, 1, 2], [0, 1]), ValueError, "same length"),
        ("load", ([0], [-1]), ValueError, "negative"),
        ("backup", ([[0]], [[0]]), ValueError, "1-D"),
        ("backup", ([0.0], [0]), TypeError, "integers"),
        ("backup", ([0, 1], [7, 6]), HiCacheError, r"device_ids \[0\] are not allocated"),
        ("load", ([9, 1], [3, 4]), HiCacheError, r"host_ids \[9\] are not allocated"),
    ],
)
def test_bad_input_raises_before_dispatch(call, args, err, match):
    spec = SPEC
    dev, host, eng = _setup(spec, "page_first")
    dev.allocator.free([0])
    host.allocator.free([9])
    rng = np.random.default_rng(3)
    dev.write(np.arange(8), random_bits(spec, 8, rng))
    host.write(np.arange(10), random_bits(spec, 10, rng))
    before = _snapshots(dev, host)
    with pytest.raises(err, match=match):
        getattr(eng, call)(*args)
    assert eng.in_flight == 0 and eng.poll() == []
    after = _snapshots(dev, host)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])


def test_mismatched_pools_are_rejected():
    spec = KVSpec(2, 4, 8)
    mesh = heads_mesh()
    with pytest.raises(ValueError, match="spec"):
        TransferEngine(DevicePagePool(spec, 2), HostPagePool(KVSpec(2, 4, 8, "float16"), 2))
    with pytest.raises(ValueError, match="placement"):
        TransferEngine(DevicePagePool(spec, 2, mesh=mesh), HostPagePool(spec, 2))


def test_donation_keeps_both_buffers_in_place():
    spec = SPEC
    dev, host, eng = _setup(spec)
    dev_ptr, host_ptr = dev.array.unsafe_buffer_pointer(), host.buffer.unsafe_buffer_pointer()
    old_dev, old_host = dev.array, host.buffer
    eng.backup([1, 2], [3, 4])
    eng.load([3, 4], [5, 6], layerwise=True)
    eng.load([3], [7])
    eng.wait_all()
    assert old_dev.is_deleted() and old_host.is_deleted()
    assert dev.array.unsafe_buffer_pointer() == dev_ptr
    assert host.buffer.unsafe_buffer_pointer() == host_ptr


def test_in_flight_host_pages_are_busy_until_their_transfers_complete():
    spec = SPEC
    dev, host, eng = _setup(spec)
    rng = np.random.default_rng(4)
    old = random_bits(spec, 2, rng)
    host.write([1, 4], old)
    load = eng.load([1, 4], [2, 3])
    backup = eng.backup([0], [5])
    assert eng.busy_host_pages([0, 1, 4, 5]).tolist() == [False, True, True, True]
    # Writing new bytes into a page a load still reads does not change what the load copies
    # (XLA orders the write after the read).
    host.write([1], random_bits(spec, 1, rng))
    eng.wait_all()
    assert load.done() and backup.done()
    np.testing.assert_array_equal(_dev_bits(dev, [2, 3]), old)
    assert not eng.busy_host_pages([1, 4]).any()


class _PendingToken:
    """A completion token that never becomes ready (a copy still in flight)."""

    def is_ready(self) -> bool:
        return False

    def block_until_ready(self):
        return self


def test_zero_page_transfer_completes_alone():
    """A zero-page transfer used to complete every transfer dispatched before it: done() and
    busy_host_pages() lied while a copy was still pending."""
    _dev, _host, eng = _setup(SPEC)
    first = eng.backup([0, 1], [3, 4])
    first._tokens = [_PendingToken()]  # its copy is still running
    empty = eng.backup(np.zeros(0, np.int32), np.zeros(0, np.int32))
    assert empty.done() and empty.seconds == 0.0
    assert not first.done() and eng.busy_host_pages([3, 4]).all()
    assert eng.in_flight == 1
    assert eng.poll() == [empty]
    first._tokens = []  # the copy lands
    eng.wait_all()
    assert first.done() and not eng.busy_host_pages([3, 4]).any()


def test_device_write_after_backup_does_not_change_the_backup():
    spec = SPEC
    dev, host, eng = _setup(spec)
    rng = np.random.default_rng(5)
    kv = random_bits(spec, 8, rng)
    dev.write(np.arange(8), kv)
    handle = eng.backup(np.arange(8), np.arange(8)[::-1])
    dev.write(np.arange(8), random_bits(spec, 8, rng))  # donates the pool the backup reads
    handle.wait()
    np.testing.assert_array_equal(host.read(np.arange(8)[::-1]), kv)


def test_copies_are_dispatched_asynchronously():
    spec = SPEC
    dev, host, eng = _setup(spec)
    # XLA:CPU runs executables under 1000 estimated flops inline in the caller; the copy's
    # token makes it cost more than that, so it goes to XLA's execution thread.
    kw = dict(
        dst_layout=host.layout,
        src_layout=host.layout,
        num_layers=spec.num_layers,
        src_put=None,
        dst_put=None,
    )
    ids = np.arange(2, dtype=np.int32)
    compiled = copy_pages.lower(host.buffer, host.buffer, copy_plan(ids, ids), **kw).compile()
    assert compiled.cost_analysis()["flops"] >= 1000

    # Behaviour: a backup that reads a pool still being computed returns at once, unfinished
    # (a one-page copy: the inline form, which XLA:CPU runs in the caller only once its
    # inputs are ready).
    @functools.partial(jax.jit, donate_argnums=0)
    def slow_step(pool, x):
        y = jax.lax.fori_loop(0, 6, lambda i, y: jnp.tanh(y @ y), x)
        # The pool update depends on the slow result (scratch page: no test data touched).
        mark = (y.sum() > -1).astype(pool.dtype)
        return pool.at[0, 0, -1, 0, 0, 0].set(mark), y.sum()

    x = jnp.ones((768, 768), jnp.float32) / 768
    # Compile both outside the window (a compile would let the slow step finish first).
    slow_step(dev.array.copy(), x)[1].block_until_ready()
    eng.backup([1], [1]).wait()
    out = dev.run(slow_step, x)
    handle = eng.backup([1], [1])
    assert not handle.done() and not out.is_ready()
    handle.wait()
    assert out.is_ready()


def test_validated_ids_copy_like_checked_ones():
    """``validated=True`` (the cache's own ids) skips the checks, not the copy or its tracking."""
    spec = SPEC
    rng = np.random.default_rng(5)
    kv = random_bits(spec, 3, rng)
    results = []
    for validated in (False, True):
        dev, host, eng = _setup(spec, "page_first")
        dev.write([6, 1, 3], kv)
        ids = np.array([2, 7, 4], np.int32)
        backup = eng.backup(np.array([6, 1, 3], np.int32), ids, validated=validated)
        assert eng.busy_host_pages(ids, validated=validated).all()
        load = eng.load(ids[::-1].copy(), np.array([0, 5, 7], np.int32), validated=validated)
        assert eng.wait_all() == [backup, load]
        assert not eng.busy_host_pages(ids, validated=validated).any()
        results.append((host.read(np.arange(10)), _dev_bits(dev, np.arange(8))))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


class _TwoProcesses:
    """A group of two processes whose peer has seen every copy land (records its agreements)."""

    num_processes = 2

    def __init__(self) -> None:
        self.tags: list[str] = []

    def agree_min(self, tag, values):
        self.tags.append(tag)
        return np.asarray(values, np.int64)


def test_with_a_group_only_an_agreeing_poll_applies_copies_in_flight():
    # Several processes: a poll that does not agree leaves landed copies in flight (safe: a
    # decision that needs them waits); the agreeing one applies them, in one agreement.
    _dev, host, eng = _setup(SPEC)
    group = _TwoProcesses()
    eng.agree_with(group)
    assert eng.poll() == [] and group.tags == []  # nothing in flight: nothing to agree
    backup = eng.backup([0, 1], [2, 3])
    jax.block_until_ready(host.buffer)  # landed here
    assert eng.poll(agree=False) == [] and eng.in_flight == 1 and not backup.done()
    assert eng.busy_host_pages([2, 3]).all() and group.tags == []
    assert eng.poll() == [backup] and backup.done() and group.tags == ["transfers"]
    load = eng.load([2], [5])
    assert eng.wait_all() == [load] and group.tags == ["transfers"]  # a wait agrees nothing


def test_small_copies_dispatch_the_inline_copy_large_ones_the_asynchronous_one(monkeypatch):
    """XLA:CPU: a copy of at most INLINE_COPY_BYTES runs the copy whose token has no flops
    (the PjRt CPU client runs it in the caller once its inputs are ready), a larger one the
    copy whose token sums the plan; both copy the same bytes."""
    from hicache_jax.memory.page_copy import INLINE_COPY_BYTES

    spec = SPEC
    dev, host, eng = _setup(spec)
    assert eng._inline_pages == INLINE_COPY_BYTES // spec.page_bytes
    ids = np.arange(2, dtype=np.int32)
    plan = copy_plan(ids, ids)
    flops = [
        fn.lower(host.buffer, dev.array, plan).compile().cost_analysis()["flops"]
        for fn in (eng._backup_inline, eng._backup_fn)
    ]
    assert flops[0] < 1000 <= flops[1]
    used = []
    run = host.run
    monkeypatch.setattr(host, "run", lambda fn, *a: used.append(fn) or run(fn, *a))
    eng._inline_pages = 1  # one page inline, two not
    kv = random_bits(spec, 3, np.random.default_rng(3))
    dev.write([0, 1, 2], kv)
    eng.backup([0], [5]).wait()
    eng.backup([1, 2], [6, 7]).wait()
    assert used == [eng._backup_inline, eng._backup_fn]
    np.testing.assert_array_equal(host.read([5, 6, 7]), kv)
