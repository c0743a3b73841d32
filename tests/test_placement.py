"""Placement helpers: head sharding, Explicit-axis detection (public JAX API), memory kinds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding

from hicache_jax.memory.placement import (
    constrain,
    has_explicit_axis,
    head_sharding,
    placed,
    resolve_memory_kind,
    zeros_in_memory,
    zeros_placed,
)
from hicache_jax.spec import KVSpec

SPEC = KVSpec(num_layers=1, num_kv_heads=4, head_dim=4, page_size=2)


def _mesh(*types):
    return jax.make_mesh(
        (4, 1)[: len(types)] if len(types) == 2 else (4,),
        ("tp", "dp")[: len(types)],
        axis_types=types,
    )


@pytest.mark.parametrize(
    "types, explicit",
    [
        ((AxisType.Auto,), False),
        ((AxisType.Explicit,), True),
        ((AxisType.Auto, AxisType.Explicit), True),
        ((AxisType.Manual, AxisType.Auto), False),
    ],
)
def test_has_explicit_axis(types, explicit):
    assert has_explicit_axis(_mesh(*types)) is explicit


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_constrain_pins_the_head_sharding(axis_type):
    mesh = _mesh(axis_type)
    sharding = head_sharding(SPEC, mesh, None)
    x = jax.device_put(jnp.ones(SPEC.kv_shape(2), jnp.uint16), NamedSharding(mesh, PartitionSpec()))
    typed = []

    @jax.jit
    def f(x):
        y = constrain(x + 1, sharding)
        typed.append(jax.typeof(y).sharding.spec)
        return y

    y = f(x)
    assert y.sharding.is_equivalent_to(sharding, y.ndim)
    # On an Explicit mesh the sharding is part of the type (a reshard); on an Auto mesh it is
    # a constraint only, and the traced type carries no sharding.
    want = sharding.spec if axis_type is AxisType.Explicit else PartitionSpec(*[None] * 6)
    assert typed == [want]
    assert constrain(x, None) is x


def test_head_sharding_and_placed():
    mesh = _mesh(AxisType.Auto)
    assert head_sharding(SPEC, mesh, None).spec == PartitionSpec(None, None, None, None, "tp", None)
    mla = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=2, mla=True)
    assert head_sharding(mla, mesh, "tp").spec == PartitionSpec()
    assert head_sharding(SPEC, None, None) is None
    assert placed(None) == SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(TypeError, match="Mesh"):
        head_sharding(SPEC, "mesh", None)
    with pytest.raises(ValueError, match="not an axis"):
        head_sharding(SPEC, mesh, "x")
    with pytest.raises(ValueError, match="divisible"):
        head_sharding(KVSpec(1, 2, 4), mesh, None)
    with pytest.raises(ValueError, match="without a mesh"):
        head_sharding(SPEC, None, "tp")


def test_memory_kinds_and_zeros():
    device = jax.devices()[0]
    default = device.default_memory().kind
    assert resolve_memory_kind(device, "auto") == default  # CPU: its own memory is host RAM
    assert resolve_memory_kind(device, "pinned_host") == "pinned_host"
    with pytest.raises(ValueError, match="memory_kind='unpinned_host'"):
        resolve_memory_kind(device, "unpinned_host")
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
    host = zeros_in_memory((2, 3), np.uint16, pinned, on_default_memory=False)
    assert host.sharding.memory_kind == "pinned_host" and not np.asarray(host).any()
    a = zeros_placed((2, 3), np.uint8, placed(None))
    b = zeros_placed((2, 3), np.uint8, placed(None))
    assert a is not b and a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
