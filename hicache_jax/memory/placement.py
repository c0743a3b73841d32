"""Where the pools' arrays live: the head sharding, the host memory kind, in-place allocation.

Both pools are placed the same way (ARCHITECTURE.md: a sharded device pool has a host pool sharded
the same way, so each device copies only to and from its own host shard):

* **Sharding** (optional mesh + axis): ``PartitionSpec(None, None, None, None, axis, None)``,
  the kv-head axis (axis 4 of every pool layout); an MLA latent cache (one "head") is
  replicated over the mesh instead. Without a mesh, device 0 (committed: see :func:`placed`).
* **Memory kind** of the host pool: ``pinned_host`` on accelerators (DMA-able), the device's own
  memory on CPU (which already is host RAM).

Pure functions of their arguments (compiled allocators are cached per shape); no pool state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import (
    AbstractMesh,
    AxisType,
    Mesh,
    NamedSharding,
    PartitionSpec,
    SingleDeviceSharding,
)

from hicache_jax.spec import KVSpec


def head_sharding(spec: KVSpec, mesh: Mesh | None, axis: str | None) -> NamedSharding | None:
    """The pools' sharding over kv heads, validated; None without a mesh.

    Raises:
        TypeError: ``mesh`` is not a Mesh.
        ValueError: ``axis`` without a mesh, not an axis of it, or heads not divisible by it.
    """
    if mesh is None:
        if axis is not None:
            raise ValueError(f"axis={axis!r} given without a mesh")
        return None
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    axis = names[0] if axis is None else axis
    if axis not in names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {names}")
    if spec.mla:
        # One latent "head": nothing to split. Every device keeps the whole latent cache, as
        # tensor-parallel MLA serving does.
        return NamedSharding(mesh, PartitionSpec())
    size = mesh.shape[axis]
    if spec.num_kv_heads % size:
        raise ValueError(
            f"num_kv_heads={spec.num_kv_heads} is not divisible by the size {size} "
            f"of mesh axis {axis!r}"
        )
    return NamedSharding(mesh, PartitionSpec(None, None, None, None, axis, None))


def placed(sharding: NamedSharding | None) -> jax.sharding.Sharding:
    """``sharding``, or this process's first device when None: a pool is always *committed*
    to its devices (an uncommitted array becomes committed after its first donated update,
    and every caller's jitted step would then compile twice, once per commitment state)."""
    return SingleDeviceSharding(jax.local_devices()[0]) if sharding is None else sharding


def local_heads(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> slice:
    """The kv heads (axis 4) this process's devices hold of an array of ``shape`` placed by
    ``sharding``: all of them unless the array spans several processes.

    Raises:
        ValueError: this process's heads are not one contiguous run (a mesh whose devices are
            not grouped by process along the head axis).
    """
    held = set()
    for idx in sharding.addressable_devices_indices_map(shape).values():
        assert idx is not None, "an addressable device holds part of the array"
        held.add(idx[4].indices(shape[4])[:2])
    runs = sorted(held)
    lo, hi = runs[0]
    for a, b in runs[1:]:
        if a > hi:
            raise ValueError(
                f"this process holds kv heads {runs}: not one contiguous run; "
                "order the mesh's devices by process along the head axis"
            )
        hi = max(hi, b)
    return slice(lo, hi)


def local_numpy(x: jax.Array) -> np.ndarray:
    """``x`` as numpy; of an array spanning several processes (heads sharded, axis 4), this
    process's heads only (:func:`local_heads`), read from its own shards."""
    if x.is_fully_addressable:
        return np.asarray(x)
    heads = local_heads(x.sharding, x.shape)
    out = np.empty(x.shape[:4] + (heads.stop - heads.start,) + x.shape[5:], x.dtype)
    for shard in x.addressable_shards:
        lo, hi = shard.index[4].indices(x.shape[4])[:2]
        out[:, :, :, :, lo - heads.start : hi - heads.start] = np.asarray(shard.data)
    return out


def shard_spec(spec: KVSpec, heads: slice) -> KVSpec:
    """The spec of ``heads`` of ``spec`` (``spec`` itself for all of them). Of a grouped spec
    (whose top-level fields describe its full group's pages), the full group's heads too; each
    other group's pools take their own group's spec."""
    if heads.start == 0 and heads.stop == spec.num_kv_heads:
        return spec
    n = heads.stop - heads.start
    full = spec.full_group if spec.groups else None
    groups = tuple(dataclasses.replace(g, num_kv_heads=n) if g is full else g for g in spec.groups)
    return dataclasses.replace(
        spec,
        num_kv_heads=n,
        groups=groups,
        shard=f"{heads.start}:{heads.stop}/{spec.num_kv_heads}",
    )


def from_local(
    local: np.ndarray, sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> jax.Array:
    """The array of ``shape`` placed by ``sharding`` from this process's heads ``local``
    (:func:`local_heads`); a plain ``device_put`` when the array is this process's alone."""
    if sharding.is_fully_addressable:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local, shape)


def has_explicit_axis(mesh: Mesh | AbstractMesh) -> bool:
    """Is any axis of ``mesh`` an ``AxisType.Explicit`` one (sharding in types: a constraint
    there must be a ``reshard``)?"""
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def constrain(x: jax.Array, sharding: NamedSharding | None) -> jax.Array:
    """Pin traced ``x`` to the head sharding: ``reshard`` when the mesh has Explicit axes, else
    a sharding constraint; unchanged without a mesh."""
    if sharding is None:
        return x
    if has_explicit_axis(sharding.mesh):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def resolve_memory_kind(device: jax.Device, memory_kind: str) -> str:
    """``"auto"`` -> ``pinned_host`` on accelerators that have it, else the device's default.

    On CPU the device's default memory already is host RAM; ``pinned_host`` there is accepted
    (it exercises the accelerator code path in tests) but buys nothing.

    Raises:
        ValueError: a memory kind the pool cannot use on ``device``.
    """
    kinds = [m.kind for m in device.addressable_memories()]
    default = device.default_memory().kind
    if memory_kind == "auto":
        if device.platform != "cpu" and "pinned_host" in kinds:
            return "pinned_host"
        return default
    # Other kinds (unpinned_host) are refused: the copies into them aborted the process on
    # XLA:CPU ("memory kind does not match"), and pageable memory is what L2 must avoid anyway.
    usable = [k for k in kinds if k in (default, "pinned_host")]
    if memory_kind not in usable:
        raise ValueError(
            f"memory_kind={memory_kind!r} is not one of {['auto'] + usable} "
            f"(the memories of {device} this pool can use)"
        )
    return memory_kind


@functools.cache
def _zeros_fn(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding) -> Any:
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def zeros_placed(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A new zeroed array built in place with ``sharding`` (a jitted ``zeros``), compiled once
    per (shape, dtype, sharding): a fresh jit per pool cost ~40-50 ms of compile each time,
    most of what constructing a HiCache took (measured on XLA:CPU)."""
    return _zeros_fn(tuple(int(d) for d in shape), np.dtype(dtype), sharding)()


def zeros_in_memory(
    shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding, on_default_memory: bool
) -> jax.Array:
    """Zeroed buffer placed directly with ``sharding`` (whose memory kind may be a host one).

    In the device's default memory a jitted ``zeros`` allocates in place. In a host memory kind
    of an accelerator that jit would build the zeros in device memory first (the host pool can be
    larger than the device), so the shards are copied from a ``np.zeros`` (calloc: its untouched
    pages cost no RAM). (``make_array_from_callback`` loses the host memory space of the aval in
    jax 0.10.)
    """
    if on_default_memory:
        return zeros_placed(shape, dtype, sharding)
    return jax.device_put(np.zeros(shape, dtype), sharding)
