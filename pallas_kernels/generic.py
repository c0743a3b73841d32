"""Backend-neutral Pallas page-copy kernels for Pallas' generic interpreter (``interpret=True``).

These exist so the page-copy logic runs everywhere, CPU included: they are what
``copy_backend="pallas"`` uses on a platform without a compiled Pallas path, and what the tests
exercise on CPU. They are not a fast path: on TPU use :mod:`pallas_kernels.tpu` (DMA), on NVIDIA
GPUs :mod:`pallas_kernels.gpu` (Mosaic GPU, TMA). Compiling them for a GPU would go through the
Triton backend, which JAX deprecated in 0.11, so they are interpret-only by design.

Each grid step copies one page across all layers and K/V with whole-ref indexing; the pool is
aliased in and out (``input_output_aliases``), so inside a jit that donates the pool the update
is in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import reference as _ref
from pallas_kernels.reference import ref_gather_pages, ref_scatter_layer_pages, ref_scatter_pages

if TYPE_CHECKING:
    from pallas_kernels.reference import LayerPages, PageIds, Pages, Pool

__all__ = [
    "gather_pages",
    "scatter_layer_pages",
    "scatter_pages",
    "ref_gather_pages",
    "ref_scatter_layer_pages",
    "ref_scatter_pages",
]


# ----------------------------------------------------------------------------------------------
# Kernel bodies. Grid: (n,), step i moves page i. Refs are whole arrays (no BlockSpecs).


def _scatter_kernel(ids_ref, pages_ref, pool_in_ref, pool_ref):
    del pool_in_ref  # aliased with pool_ref: pages not written keep their contents
    i = pl.program_id(0)
    # [L, kvf, 1, ps, H, D]
    pool_ref[:, :, pl.ds(ids_ref[i], 1)] = pages_ref[:, :, pl.ds(i, 1)]


def _scatter_layer_kernel(layer_ref, ids_ref, pages_ref, pool_in_ref, pool_ref):
    del pool_in_ref
    i = pl.program_id(0)
    # [1, kvf, 1, ps, H, D] <- [kvf, 1, ps, H, D]
    pool_ref[pl.ds(layer_ref[0], 1), :, pl.ds(ids_ref[i], 1)] = pages_ref[:, pl.ds(i, 1)][None]


def _gather_kernel(ids_ref, pool_ref, out_ref):
    i = pl.program_id(0)
    out_ref[:, :, pl.ds(i, 1)] = pool_ref[:, :, pl.ds(ids_ref[i], 1)]


# ----------------------------------------------------------------------------------------------
# Jitted wrappers (static checks happen in the public functions below, before tracing).


@jax.jit
def _scatter(pool, page_ids, pages):
    return pl.pallas_call(
        _scatter_kernel,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=(page_ids.shape[0],),
        input_output_aliases={2: 0},
        interpret=True,
        name="scatter_pages_generic",
    )(page_ids, pages, pool)


@jax.jit
def _scatter_layer(pool, layer, page_ids, layer_pages):
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    return pl.pallas_call(
        _scatter_layer_kernel,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        grid=(page_ids.shape[0],),
        input_output_aliases={3: 0},
        interpret=True,
        name="scatter_layer_pages_generic",
    )(layer, page_ids, layer_pages, pool)


@jax.jit
def _gather(pool, page_ids):
    num_layers, kvf, _, ps, heads, dim = pool.shape
    n = page_ids.shape[0]
    return pl.pallas_call(
        _gather_kernel,
        out_shape=jax.ShapeDtypeStruct((num_layers, kvf, n, ps, heads, dim), pool.dtype),
        grid=(n,),
        interpret=True,
        name="gather_pages_generic",
    )(page_ids, pool)


# ----------------------------------------------------------------------------------------------
# Public entry points: same signatures and semantics as the references.


def scatter_pages(pool: Pool, page_ids: PageIds, pages: Pages) -> Pool:
    """Write ``pages[:, :, i]`` at page ``page_ids[i]`` of ``pool``; returns the new pool.

    Args:
        pool: bits[L, kvf, P, ps, H, D]; aliased into the output, so donate it in the caller's
            jit for an in-place update (outside a donating jit, XLA copies it first).
        page_ids: int32[n], each in [0, P). Repeated ids (bucket padding onto a scratch page)
            leave one of the repeated pages there, unspecified which.
        pages: bits[L, kvf, n, ps, H, D], the pool's dtype.

    Returns:
        bits[L, kvf, P, ps, H, D], equal to ``ref_scatter_pages(pool, page_ids, pages)``.
    """
    _ref.check_pool(pool)
    _ref.check_page_ids(page_ids, pool.shape[2])
    _ref.check_pages(pages, pool, page_ids.shape[0])
    if page_ids.shape[0] == 0:
        return pool
    return _scatter(pool, page_ids, pages)


def scatter_layer_pages(pool: Pool, layer, page_ids: PageIds, layer_pages: LayerPages) -> Pool:
    """Write one layer's pages: ``pool[layer, :, page_ids[i]] = layer_pages[:, i]``.

    Args:
        pool: bits[L, kvf, P, ps, H, D], aliased (donate it in the caller's jit).
        layer: int or int32 scalar (traced is fine: one compile serves every layer).
        page_ids: int32[n], each in [0, P).
        layer_pages: bits[kvf, n, ps, H, D], the pool's dtype.

    Returns:
        The new pool, equal to ``ref_scatter_layer_pages(pool, layer, page_ids, layer_pages)``.
    """
    _ref.check_pool(pool)
    _ref.check_layer(layer, pool.shape[0])
    _ref.check_page_ids(page_ids, pool.shape[2])
    _ref.check_pages(layer_pages, pool, page_ids.shape[0], layer=True)
    if page_ids.shape[0] == 0:
        return pool
    return _scatter_layer(pool, layer, page_ids, layer_pages)


def gather_pages(pool: Pool, page_ids: PageIds) -> Pages:
    """Copy pages ``page_ids`` of ``pool`` into a new contiguous array.

    Args:
        pool: bits[L, kvf, P, ps, H, D] (read only, not aliased).
        page_ids: int32[n], each in [0, P); repeats allowed.

    Returns:
        bits[L, kvf, n, ps, H, D], equal to ``ref_gather_pages(pool, page_ids)``.
    """
    _ref.check_pool(pool)
    _ref.check_page_ids(page_ids, pool.shape[2])
    if page_ids.shape[0] == 0:
        return ref_gather_pages(pool, page_ids)
    return _gather(pool, page_ids)
