"""DevicePagePool with copy_backend="pallas": the generic Pallas kernels in interpret mode on CPU.

The same writes and reads go through a "pallas" pool and an "xla" pool; both must hold and
return the same bits, with bucket padding, KV-dtype and bits inputs, and head sharding over 4
CPU devices (the kernels then run per shard under shard_map). Shapes are tiny: interpret-mode
compiles dominate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from helpers import POISON
from helpers import poisoned_device_pool as poisoned
from hicache_jax.memory import device_pool as dp
from hicache_jax.memory.device_pool import DevicePagePool
from hicache_jax.spec import CopyBackend, KVSpec


def random_kv(spec: KVSpec, n: int, seed: int) -> np.ndarray:
    """Finite KV values of ``spec.dtype``, as bits."""
    values = np.random.default_rng(seed).standard_normal(spec.kv_shape(n))
    return values.astype(spec.jnp_dtype).view(spec.bits_dtype)


def same_ops(pools, spec, seed=0):
    """Write 3 pages (bits, bucket 4) and 2 (KV dtype), read 5 back; every pool must agree."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(pools[0].num_pages)[:5]
    first, second = random_kv(spec, 3, seed), random_kv(spec, 2, seed + 1)
    reads = []
    for pool in pools:
        pool.write(ids[:3], first)
        pool.write(ids[3:], jnp.asarray(second.view(spec.jnp_dtype)))
        reads.append(np.asarray(pool.read_bits(ids[::-1])))
    want = np.concatenate([first, second], axis=2)[:, :, ::-1]
    for pool, got in zip(pools, reads):
        np.testing.assert_array_equal(got, want)
        bits = np.asarray(pool.array)[:, :, : pool.num_pages]
        rest = np.setdiff1d(np.arange(pool.num_pages), ids)
        assert (bits[:, :, rest] == POISON[spec.dtype]).all()  # untouched pages keep the poison
    np.testing.assert_array_equal(
        np.asarray(pools[0].array)[:, :, :-1], np.asarray(pools[1].array)[:, :, :-1]
    )


@pytest.mark.parametrize("dtype, page_size", [("bfloat16", 16), ("float8_e4m3fn", 1)])
def test_pallas_pool_matches_xla_pool(dtype, page_size):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=page_size)
    pallas = poisoned(spec, 9, copy_backend="pallas")
    assert pallas.copy_backend is CopyBackend.PALLAS
    same_ops([pallas, poisoned(spec, 9, copy_backend="xla")], spec, seed=page_size)
    kv = pallas.read(np.array([0, 1], np.int32))
    assert kv.dtype == spec.jnp_dtype and kv.shape == spec.kv_shape(2)


def test_pallas_pool_sharded_over_heads():
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32", page_size=4)
    mesh = jax.make_mesh((4,), ("tp",))
    pallas = poisoned(spec, 7, mesh=mesh, copy_backend="pallas")
    same_ops([pallas, poisoned(spec, 7, copy_backend="xla")], spec, seed=3)
    assert pallas.array.sharding == NamedSharding(
        mesh, PartitionSpec(None, None, None, None, "tp", None)
    )


def test_auto_is_xla_on_cpu_and_pallas_fns_are_shared():
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, page_size=1)
    assert DevicePagePool(spec, 2).copy_backend is CopyBackend.XLA
    a = DevicePagePool(spec, 2, copy_backend="pallas")
    b = DevicePagePool(spec, 3, copy_backend="pallas")
    # The same static functions: pools of one impl share the jitted helpers' compiles.
    assert (a._scatter, a._gather) == (b._scatter, b._gather)


def test_pallas_pool_bad_ids_raise_before_dispatch():
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float32", page_size=1)
    pool = poisoned(spec, 4, copy_backend="pallas")
    before = np.asarray(pool.array).copy()
    with pytest.raises(ValueError, match="outside the device pool"):
        pool.write([4], random_kv(spec, 1, 0))  # the scratch page is not allocatable
    with pytest.raises(ValueError, match="duplicate"):
        pool.read([1, 1])
    np.testing.assert_array_equal(np.asarray(pool.array), before)


def test_pallas_needs_kernels_for_the_platform(monkeypatch):
    """A GPU without sm_90 (or any other platform without kernels) refuses 'pallas'."""
    import pallas_kernels as pk

    monkeypatch.setattr(pk, "compiled_impl", lambda device=None: None)
    with pytest.raises(ValueError, match="copy_backend='pallas' has no kernels"):
        dp._resolve_backend("pallas", "gpu")
