"""The one donated ``run`` both pools use: the same checks, messages and outcomes for each."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from hicache_jax.memory.device_pool import DevicePagePool
from hicache_jax.memory.donated import DonatedArray, check_kv
from hicache_jax.memory.host_pool import HostPagePool
from hicache_jax.spec import KVSpec

SPEC = KVSpec(num_layers=1, num_kv_heads=4, head_dim=4, page_size=2)


def _mesh():
    return jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))


def _pool(kind: str, **kw):
    return DevicePagePool(SPEC, 4, **kw) if kind == "device" else HostPagePool(SPEC, 4, **kw)


def _array(pool) -> jax.Array:
    return pool.array if isinstance(pool, DevicePagePool) else pool.buffer


def _name(pool) -> str:
    return "pool" if isinstance(pool, DevicePagePool) else "host buffer"


@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_wrongly_sharded_result_is_kept_moved_back_and_raises(kind):
    """The two pools used to differ here: the host pool raised and kept its donated input,
    dropping the step's result. Now both keep the result, moved back to the pool's placement."""
    mesh = _mesh()
    pool = _pool(kind, mesh=mesh)
    placement = _array(pool).sharding
    replicated = jax.jit(
        lambda p: (p + 1, None),
        donate_argnums=0,
        out_shardings=(NamedSharding(mesh, PartitionSpec()), None),
    )
    # A replicated output cannot reuse the sharded buffers: JAX warns, run() then raises.
    with (
        pytest.warns(UserWarning, match="donated buffers were not usable"),
        pytest.raises(ValueError, match=f"the {_name(pool)} with sharding .*out_shardings"),
    ):
        pool.run(replicated)
    assert _array(pool).sharding.is_equivalent_to(placement, 6)
    assert (np.asarray(_array(pool)) == 1).all()  # the step ran once; its result is kept
    pool.run(jax.jit(lambda p: (p + 1, None), donate_argnums=0))  # and the pool still works
    assert (np.asarray(_array(pool)) == 2).all()


def test_a_result_in_another_memory_kind_is_moved_back():
    pool = HostPagePool(SPEC, 4, memory_kind="pinned_host")
    device = jax.devices()[0]
    to_device = jax.jit(
        lambda b: (b + 1, None),
        donate_argnums=0,
        out_shardings=(
            SingleDeviceSharding(device, memory_kind=device.default_memory().kind),
            None,
        ),
    )
    with (
        pytest.warns(UserWarning, match="donated buffers were not usable"),
        pytest.raises(ValueError, match="memory_kind=device"),
    ):
        pool.run(to_device)
    assert pool.buffer.sharding.memory_kind == "pinned_host"
    assert (np.asarray(pool.buffer) == 1).all()


@pytest.mark.parametrize("kind", ["device", "host"])
def test_shape_and_structure_are_checked_before_dispatch(kind):
    pool = _pool(kind)
    before = _array(pool)
    with pytest.raises(ValueError, match=f"fn returned a {_name(pool)} of shape"):
        pool.run(jax.jit(lambda p: (p[:, :1], 0), donate_argnums=0))
    with pytest.raises(ValueError, match="dtype int32"):
        pool.run(jax.jit(lambda p: (p.astype(jnp.int32), 0), donate_argnums=0))
    with pytest.raises(ValueError, match="must return"):
        pool.run(jax.jit(lambda p: p, donate_argnums=0))
    assert _array(pool) is before and not before.is_deleted()


@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_step_that_does_not_donate_runs_and_raises(kind):
    pool = _pool(kind)
    copy_step = jax.jit(lambda p: (p + 3, None))
    with pytest.raises(ValueError, match=f"did not donate the {_name(pool)}"):
        pool.run(copy_step)
    assert (np.asarray(_array(pool)) == 3).all()


@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_donated_step_rebinds_in_place_and_returns_its_output(kind):
    pool = _pool(kind)
    old = _array(pool)
    ptr = old.unsafe_buffer_pointer()
    out = pool.run(jax.jit(lambda p, x: (p + x, x * 2), donate_argnums=0), jnp.uint16(5))
    assert int(out) == 10 and old.is_deleted()
    assert _array(pool).unsafe_buffer_pointer() == ptr
    assert (np.asarray(_array(pool)) == 5).all()


def test_donated_array_records_the_reference():
    arr = jnp.zeros((2, 3), jnp.uint8)
    ref = DonatedArray("pool", arr)
    assert (ref.shape, ref.dtype, ref.sharding) == ((2, 3), np.dtype(np.uint8), arr.sharding)


@pytest.mark.parametrize(
    "kv, err, match",
    [
        ([[1]], TypeError, "kv must be"),
        (np.zeros(SPEC.kv_shape(2), np.uint16), ValueError, r"spec.kv_shape\(1\)"),
        (np.zeros(SPEC.kv_shape(1), np.float32), TypeError, "kv.dtype=float32"),
        (np.zeros(SPEC.kv_shape(1), np.int16), TypeError, "raw bits"),
    ],
)
def test_check_kv(kv, err, match):
    with pytest.raises(err, match=match):
        check_kv(SPEC, kv, 1)
    check_kv(SPEC, np.zeros(SPEC.kv_shape(1), np.uint16), 1)
    check_kv(SPEC, jnp.zeros(SPEC.kv_shape(1), jnp.bfloat16), 1)


class _CountingStep:
    """A jitted step that counts its ``eval_shape`` checks (what ``run`` calls before dispatch)."""

    def __init__(self, fn):
        self._fn, self.checks = fn, 0

    def __call__(self, *args):
        return self._fn(*args)

    def eval_shape(self, *args):
        self.checks += 1
        return self._fn.eval_shape(*args)


@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_step_is_checked_once_per_argument_shapes(kind):
    pool = _pool(kind)
    step = _CountingStep(jax.jit(lambda p, x: (p, x.sum()), donate_argnums=0))
    for _ in range(3):
        pool.run(step, np.zeros(4, np.int32))
    assert step.checks == 1  # same function, same argument shapes: checked at the first only
    pool.run(step, np.zeros(8, np.int32))
    pool.run(step, np.zeros(8, np.float32))
    assert step.checks == 3  # new shapes, new dtype: checked before their first dispatch
    other = _CountingStep(jax.jit(lambda p, x: (p, x.sum()), donate_argnums=0))
    pool.run(other, np.zeros(4, np.int32))
    assert other.checks == 1  # a function never seen before is checked


@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_step_valid_for_some_shapes_is_still_rejected_before_dispatch_for_others(kind):
    """The result shape follows the argument: a pass at one shape says nothing of another."""
    pool = _pool(kind)
    shape = _array(pool).shape
    step = jax.jit(lambda p, x: (p.reshape(-1)[: x.size].reshape(x.shape), 0), donate_argnums=0)
    pool.run(step, np.zeros(shape, np.int32))
    before = _array(pool)
    with pytest.raises(ValueError, match=f"fn returned a {_name(pool)} of shape"):
        pool.run(step, np.zeros(4, np.int32))
    assert _array(pool) is before and not before.is_deleted()
