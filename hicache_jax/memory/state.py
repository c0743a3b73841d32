"""Recurrent state in a state slot: the arrays of a ``STATE`` group packed as raw bits.

A ``STATE`` group (``GroupKind.STATE``: linear attention, Mamba-2, Gated DeltaNet layers) keeps
no token's K/V; a *state slot* holds every layer's state at one prefix position (a checkpoint).
Its pools are page pools of the group's slot spec (``LayerGroup.spec``: ``len(layers)``
layers of one ``slot_words``-wide uint32 row a slot), so copies, backups, load-backs and L3
entries move slots exactly as they move pages (ARCHITECTURE.md, "Recurrent state").

A caller's state, as :meth:`HiCache.write_state` takes and :meth:`HiCache.read_state` returns
it: one array per ``StateArray`` of the group (a sequence in the group's order, or a mapping by
name), each ``[n, len(layers), *shape]`` in its dtype: ``n`` slots' worth. In a slot each
layer's row holds the arrays' bytes back to back, each padded to whole words. Packing is a
bitcast, so a state read back is bit-identical to the one written. :func:`pack_state` and
:func:`unpack_state` are traceable, so a jitted forward reads a checkpoint straight from the
pool (``pool[:, :, slots]``) and writes one with the pool's scatter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hicache_jax.spec import GroupKind, LayerGroup

__all__ = ["check_state", "pack_state", "unpack_state"]


def check_state(group: LayerGroup, state: Any, n: int) -> list[Any]:
    """The arrays of ``state`` in the group's order, checked against ``n`` slots.

    Raises:
        TypeError: ``state`` is not a sequence or mapping of arrays, or an array's dtype
            differs (naming the array).
        ValueError: a missing, extra or misshapen array (naming it and the shape wanted).
    """
    if group.kind is not GroupKind.STATE:
        raise ValueError(f"a {GroupKind(group.kind).value!r} group holds no recurrent state")
    names = [a.name for a in group.state]
    if isinstance(state, Mapping):
        extra = sorted(set(state) - set(names))
        missing = [n_ for n_ in names if n_ not in state]
        if extra or missing:
            raise ValueError(f"state has arrays {sorted(state)}; the group's are {names}")
        arrays = [state[n_] for n_ in names]
    elif isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
        if len(state) != len(names):
            raise ValueError(f"state has {len(state)} arrays; the group's are {names}")
        arrays = list(state)
    else:
        raise TypeError(f"state must be a sequence or mapping of arrays {names}, got {state!r}")
    layers = len(group.layers)
    for a, x in zip(group.state, arrays, strict=True):
        shape = getattr(x, "shape", None)
        want = (n, layers, *a.shape)
        if shape is None or tuple(shape) != want:
            raise ValueError(
                f"state[{a.name!r}] has shape {shape}, expected {want} (slots, layers, *{a.shape})"
            )
        dtype = np.dtype(x.dtype)
        if dtype != np.dtype(jnp.dtype(a.dtype)):
            raise TypeError(f"state[{a.name!r}] has dtype {dtype}, expected {a.dtype}")
    return arrays


def _words(x: jax.Array, lead: int) -> jax.Array:
    """``x`` ``[*lead_dims, ...]`` as uint32 words ``[*lead_dims, w]`` (bytes padded to 4)."""
    head = x.shape[:lead]
    nbytes = math.prod(x.shape[lead:]) * x.dtype.itemsize  # not -1: a reshape of 0 slots
    b = lax.bitcast_convert_type(x, jnp.uint8).reshape(*head, nbytes)
    pad = -nbytes % 4
    if pad:
        b = jnp.pad(b, [(0, 0)] * lead + [(0, pad)])
    return lax.bitcast_convert_type(b.reshape(*head, (nbytes + pad) // 4, 4), jnp.uint32)


def pack_state(group: LayerGroup, arrays: Sequence[Any]) -> jax.Array:
    """Checked ``arrays`` (:func:`check_state`) as slot bits, ``group.spec(...).kv_shape(n)``
    uint32: ``[len(layers), 1, n, 1, 1, slot_words]`` with one head; with ``state_heads``
    ``H`` > 1, ``[len(layers), 2, n, 1, H, head_words / 2]``: head ``h``'s part of every array
    (its ``h``-th slice along ``head_axis``; an array without one, its ``h``-th share of
    words) back to back, split in two halves. Traceable."""
    h = group.state_heads
    parts = []  # each [n, L, H, w_a]
    for a, x in zip(group.state, arrays, strict=True):
        x = jnp.asarray(x)
        n, layers = x.shape[:2]
        if a.head_axis is None or h == 1:
            w = _words(x, 2)  # [n, L, W]
            each = a.head_words(h)
            if h * each > w.shape[-1]:
                w = jnp.pad(w, [(0, 0), (0, 0), (0, h * each - w.shape[-1])])
            parts.append(w.reshape(n, layers, h, each))
        else:
            x = jnp.moveaxis(x, a.head_axis + 2, 2)
            parts.append(_words(x.reshape(n, layers, h, math.prod(a.shape) // h), 3))
    rows = jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    words = group.head_words
    if words > rows.shape[-1]:
        rows = jnp.pad(rows, [(0, 0)] * 3 + [(0, words - rows.shape[-1])])
    n, layers = rows.shape[:2]
    if h == 1:  # one latent row a layer
        return jnp.transpose(rows[:, :, 0], (1, 0, 2)).reshape(layers, 1, n, 1, 1, words)
    rows = rows.reshape(n, layers, h, 2, words // 2)
    return jnp.transpose(rows, (1, 3, 0, 2, 4)).reshape(layers, 2, n, 1, h, words // 2)


def _from_bytes(b: jax.Array, dtype: Any, lead: tuple[int, ...]) -> jax.Array:
    """uint8 ``[*lead, nbytes]`` as ``dtype`` ``[*lead, nbytes / itemsize]``."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(b, dtype)
    return lax.bitcast_convert_type(
        b.reshape(*lead, b.shape[-1] // dtype.itemsize, dtype.itemsize), dtype
    )


def unpack_state(group: LayerGroup, bits: jax.Array) -> tuple[jax.Array, ...]:
    """Slot bits (:func:`pack_state`'s layout; raw uint32 or their float32 view) as the
    group's arrays, each ``[n, len(layers), *shape]`` in its dtype. Traceable."""
    layers, n = bits.shape[0], bits.shape[2]
    if bits.dtype != jnp.uint32:
        bits = lax.bitcast_convert_type(bits, jnp.uint32)
    h, words = group.state_heads, group.head_words
    if h == 1:
        rows = jnp.transpose(bits.reshape(layers, n, 1, words), (1, 0, 2, 3))
    else:
        rows = jnp.transpose(bits.reshape(layers, 2, n, h, words // 2), (2, 0, 3, 1, 4))
        rows = rows.reshape(n, layers, h, words)  # [n, L, H, head_words]
    out, at = [], 0
    for a in group.state:
        w = a.head_words(h)
        part = rows[:, :, :, at : at + w]
        at += w
        if a.head_axis is None or h == 1:
            b = lax.bitcast_convert_type(part.reshape(n, layers, h * w), jnp.uint8)
            b = b.reshape(n, layers, 4 * h * w)[:, :, : a.nbytes]
            out.append(_from_bytes(b, a.dtype, (n, layers)).reshape(n, layers, *a.shape))
            continue
        b = lax.bitcast_convert_type(part, jnp.uint8).reshape(n, layers, h, 4 * w)
        b = b[:, :, :, : a.nbytes // h]
        shape = list(a.shape)
        heads = shape.pop(a.head_axis)
        x = _from_bytes(b, a.dtype, (n, layers, h)).reshape(n, layers, heads, *shape)
        out.append(jnp.moveaxis(x, 2, a.head_axis + 2))
    return tuple(out)
