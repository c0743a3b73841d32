"""Pure-jnp references of the page-copy kernels, and the static checks every wrapper shares.

The references define what each kernel must compute, bit for bit; tests compare every kernel
against them. They are also what ``copy_backend="xla"`` does in the device pool.

Shape vocabulary (the device pool layout, see the interfaces doc)::

    pool:   bits[num_layers, kv_factor, num_pool_pages, page_size, num_kv_heads, head_dim]
    pages:  bits[num_layers, kv_factor, n,              page_size, num_kv_heads, head_dim]
    layer pages (one layer): bits[kv_factor, n, page_size, num_kv_heads, head_dim]
    page_ids: int32[n]

``bits`` is uint8, uint16 or uint32: the pools store raw bits so that page movement never
touches float semantics (NaN payloads survive, bf16 is never widened).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # jaxtyping is a test/dev dependency only; annotations stay strings.
    from jaxtyping import Array, Int, UInt

    Pool = UInt[Array, "num_layers kv_factor num_pool_pages page_size num_kv_heads head_dim"]
    Pages = UInt[Array, "num_layers kv_factor n page_size num_kv_heads head_dim"]
    LayerPages = UInt[Array, "kv_factor n page_size num_kv_heads head_dim"]
    PageIds = Int[Array, "n"]

#: The dtypes a pool may have: unsigned integers of the KV dtype's width.
BITS_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32))


def ref_scatter_pages(pool: Pool, page_ids: PageIds, pages: Pages) -> Pool:
    """``pool`` with ``pages[:, :, i]`` written at page ``page_ids[i]`` for every ``i``."""
    return pool.at[:, :, page_ids].set(pages, mode="promise_in_bounds")


def ref_scatter_layer_pages(
    pool: Pool, layer: Any, page_ids: PageIds, layer_pages: LayerPages
) -> Pool:
    """``pool`` with ``layer_pages[:, i]`` written at ``pool[layer, :, page_ids[i]]``."""
    updated = pool[layer].at[:, page_ids].set(layer_pages, mode="promise_in_bounds")
    return jax.lax.dynamic_update_index_in_dim(pool, updated, layer, axis=0)


def ref_gather_pages(pool: Pool, page_ids: PageIds) -> Pages:
    """``pages[:, :, i] = pool[:, :, page_ids[i]]``: n scattered pages made contiguous."""
    return pool.at[:, :, page_ids].get(mode="promise_in_bounds")


# ----------------------------------------------------------------------------------------------
# Static checks (shapes and dtypes are known while tracing, so these run under jit too).


def is_concrete(x: Any) -> bool:
    """True for values that can be inspected now (numpy, committed jax arrays), not tracers."""
    return not isinstance(x, jax.core.Tracer)


def check_pool(pool: Any) -> None:
    """Raise unless ``pool`` is a 6-D array of uint8/uint16/uint32."""
    if getattr(pool, "ndim", None) != 6:
        raise ValueError(
            f"pool must be 6-D [layers, kv, pages, page_size, heads, dim], "
            f"got shape {getattr(pool, 'shape', None)}"
        )
    if np.dtype(pool.dtype) not in BITS_DTYPES:
        raise TypeError(
            f"{pool.dtype=} must be uint8, uint16 or uint32 (raw KV bits); "
            f"bitcast float pools with lax.bitcast_convert_type first"
        )


def check_page_ids(page_ids: Any, num_pool_pages: int) -> None:
    """Raise unless ``page_ids`` is 1-D int32; concrete values must lie in the pool.

    Traced ids cannot be range-checked here: the caller validates them on the host (the device
    pool does, ARCHITECTURE.md: validate on the host, before dispatch), because an out-of-range DMA
    is undefined behaviour on device. Checking concrete device arrays reads them back (a sync): hot
    paths call inside a jit.
    """
    shape = getattr(page_ids, "shape", None)
    if shape is None or len(shape) != 1 or np.dtype(page_ids.dtype) != np.int32:
        raise TypeError(
            f"page_ids must be a 1-D int32 array, got shape={shape} "
            f"dtype={getattr(page_ids, 'dtype', type(page_ids).__name__)}"
        )
    if is_concrete(page_ids) and shape[0]:
        ids = np.asarray(page_ids)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_pool_pages:
            raise ValueError(f"page_ids must lie in [0, {num_pool_pages}), got min={lo} max={hi}")


def check_layer(layer: Any, num_layers: int) -> None:
    """Raise unless ``layer`` is an int scalar; concrete values must lie in [0, num_layers)."""
    if isinstance(layer, (bool, np.bool_)):
        raise TypeError(f"layer={layer!r} must be an int")
    if isinstance(layer, (int, np.integer)):
        value: int | None = int(layer)
    else:
        if getattr(layer, "shape", None) != () or not jnp.issubdtype(layer.dtype, jnp.integer):
            raise TypeError(f"layer must be an int or a 0-d integer array, got {layer!r}")
        value = int(layer) if is_concrete(layer) else None
    if value is not None and not 0 <= value < num_layers:
        raise ValueError(f"layer={value} must lie in [0, {num_layers})")


def check_pages(pages: Any, pool: Any, n: int, *, layer: bool = False) -> None:
    """Raise unless ``pages`` holds ``n`` pages of ``pool``'s layout and dtype.

    Args:
        pages: [L, kvf, n, ps, H, D] (or [kvf, n, ps, H, D] when ``layer``).
        pool: a checked pool.
        n: the number of page ids.
        layer: ``pages`` holds one layer.
    """
    num_layers, kvf, _, ps, heads, dim = pool.shape
    want = (kvf, n, ps, heads, dim) if layer else (num_layers, kvf, n, ps, heads, dim)
    shape = tuple(getattr(pages, "shape", ()))
    if shape != want:
        raise ValueError(
            f"pages.shape={shape} must be {want} for {n} page ids and "
            f"pool.shape={tuple(pool.shape)}"
        )
    if np.dtype(pages.dtype) != np.dtype(pool.dtype):
        raise TypeError(f"{pages.dtype=} must equal {pool.dtype=} (bitcast KV to its bits first)")
