"""TPU page-copy kernels: HBM-to-HBM DMAs, page ids scalar-prefetched into SMEM.

A page of the pool is ``L * kvf`` chunks (one per layer and K/V), each ``ps * H * D`` elements
and contiguous. The kernels never stage data through VMEM: each page is one strided DMA
descriptor ``pltpu.make_async_copy(src.at[:, :, page], dst.at[:, :, id], sem)`` between refs
left in HBM (``memory_space=pl.ANY``), so the DMA engines do the copy while the core only
issues descriptors. Page ids (and the layer, for the per-layer variant) arrive through
``PrefetchScalarGridSpec`` so the addresses are scalars in SMEM before the body runs.

Several DMAs stay in flight per program: a sliding window of ``window`` copies, each with its
own DMA semaphore; copy ``i`` starts after copy ``i - window`` completed. The grid splits the
pages over ``num_programs`` programs marked ``parallel`` (both TensorCores on megacore chips).

Run on TPU compiled (``interpret=None``) or anywhere in the TPU interpreter
(``interpret=pltpu.InterpretParams(...)``), which simulates DMAs and semaphores and raises on
out-of-bounds reads; the tests use it on CPU.

Repeated destination ids (bucket padding onto the scratch page) are concurrent DMAs to the same
page: that page ends up holding one of them, which is all the scratch page needs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import reference as _ref
from pallas_kernels.reference import ref_gather_pages, ref_scatter_layer_pages, ref_scatter_pages

if TYPE_CHECKING:
    from pallas_kernels.reference import LayerPages, PageIds, Pages, Pool

__all__ = [
    "DEFAULT_WINDOW",
    "gather_pages",
    "scatter_layer_pages",
    "scatter_pages",
    "ref_gather_pages",
    "ref_scatter_layer_pages",
    "ref_scatter_pages",
]

#: DMAs in flight per program. Each page is one multi-chunk descriptor, so a few suffice to keep
#: the DMA engines busy; more only costs semaphores.
DEFAULT_WINDOW = 8
#: Programs (grid size): 2 covers both TensorCores of megacore chips; harmless elsewhere.
DEFAULT_PROGRAMS = 2


# ----------------------------------------------------------------------------------------------
# Kernel body. One program moves pages [p * per, min(n, (p + 1) * per)).


def _copy_pages(copy, n: int, per: int, window: int) -> None:
    """Run ``copy(i)`` (a DMA descriptor for page i) for this program's pages, ``window`` in flight.

    ``copy(i, slot)`` must return a fresh descriptor each call: waiting rebuilds the descriptor of
    copy ``i`` (same semaphore, same byte count), which is how Pallas TPU DMAs are awaited.
    """
    first = pl.program_id(0) * per

    def start(k, carry):
        i = first + k

        @pl.when(jnp.logical_and(k >= window, i - window < n))
        def _():
            copy(i - window, (k - window) % window).wait()

        @pl.when(i < n)
        def _():
            copy(i, k % window).start()

        return carry

    lax.fori_loop(0, per, start, None)

    def drain(k, carry):  # the last min(per, window) copies are still in flight
        i = first + k

        @pl.when(i < n)
        def _():
            copy(i, k % window).wait()

        return carry

    lax.fori_loop(max(per - window, 0), per, drain, None)


def _scatter_kernel(ids_smem, pages_hbm, pool_in_hbm, pool_hbm, sems, *, n, per, window):
    del pool_in_hbm  # aliased with pool_hbm

    def copy(i, slot):
        # [L, kvf, 1, ps, H, D] -> [L, kvf, 1, ps, H, D]
        return pltpu.make_async_copy(
            pages_hbm.at[:, :, pl.ds(i, 1)], pool_hbm.at[:, :, pl.ds(ids_smem[i], 1)], sems.at[slot]
        )

    _copy_pages(copy, n, per, window)


def _scatter_layer_kernel(
    layer_smem, ids_smem, pages_hbm, pool_in_hbm, pool_hbm, sems, *, n, per, window
):
    del pool_in_hbm
    layer = layer_smem[0]

    def copy(i, slot):
        # [kvf, 1, ps, H, D] -> pool[layer]: [kvf, 1, ps, H, D]
        return pltpu.make_async_copy(
            pages_hbm.at[:, pl.ds(i, 1)],
            pool_hbm.at[layer, :, pl.ds(ids_smem[i], 1)],
            sems.at[slot],
        )

    _copy_pages(copy, n, per, window)


def _gather_kernel(ids_smem, pool_hbm, out_hbm, sems, *, n, per, window):
    def copy(i, slot):
        return pltpu.make_async_copy(
            pool_hbm.at[:, :, pl.ds(ids_smem[i], 1)], out_hbm.at[:, :, pl.ds(i, 1)], sems.at[slot]
        )

    _copy_pages(copy, n, per, window)


# ----------------------------------------------------------------------------------------------
# Jitted wrappers.


def _grid(n: int, num_programs: int, window: int) -> tuple[int, int, int]:
    """(programs, pages per program, window) for n pages."""
    programs = max(1, min(num_programs, n))
    per = pl.cdiv(n, programs)
    return programs, per, max(1, min(window, per))


def _call(
    kernel,
    *,
    n,
    num_scalar_prefetch,
    num_inputs,
    out_shape,
    aliases,
    window,
    num_programs,
    interpret,
    name,
):
    programs, per, window = _grid(n, num_programs, window)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=num_scalar_prefetch,
        grid=(programs,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * num_inputs,
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA((window,))],
    )
    return pl.pallas_call(
        functools.partial(kernel, n=n, per=per, window=window),
        out_shape=out_shape,
        grid_spec=grid_spec,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), has_side_effects=bool(aliases)
        ),
        interpret=interpret,
        name=name,
    )


@functools.partial(jax.jit, static_argnames=("window", "num_programs", "interpret"))
def _scatter(pool, page_ids, pages, *, window, num_programs, interpret):
    return _call(
        _scatter_kernel,
        n=page_ids.shape[0],
        num_scalar_prefetch=1,
        num_inputs=2,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        aliases={2: 0},
        window=window,
        num_programs=num_programs,
        interpret=interpret,
        name="scatter_pages_tpu",
    )(page_ids, pages, pool)


@functools.partial(jax.jit, static_argnames=("window", "num_programs", "interpret"))
def _scatter_layer(pool, layer, page_ids, layer_pages, *, window, num_programs, interpret):
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    return _call(
        _scatter_layer_kernel,
        n=page_ids.shape[0],
        num_scalar_prefetch=2,
        num_inputs=2,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        aliases={3: 0},
        window=window,
        num_programs=num_programs,
        interpret=interpret,
        name="scatter_layer_pages_tpu",
    )(layer, page_ids, layer_pages, pool)


@functools.partial(jax.jit, static_argnames=("window", "num_programs", "interpret"))
def _gather(pool, page_ids, *, window, num_programs, interpret):
    num_layers, kvf, _, ps, heads, dim = pool.shape
    n = page_ids.shape[0]
    out = jax.ShapeDtypeStruct((num_layers, kvf, n, ps, heads, dim), pool.dtype)
    return _call(
        _gather_kernel,
        n=n,
        num_scalar_prefetch=1,
        num_inputs=1,
        out_shape=out,
        aliases={},
        window=window,
        num_programs=num_programs,
        interpret=interpret,
        name="gather_pages_tpu",
    )(page_ids, pool)


# ----------------------------------------------------------------------------------------------
# Public entry points.


def scatter_pages(
    pool: Pool,
    page_ids: PageIds,
    pages: Pages,
    *,
    window: int = DEFAULT_WINDOW,
    num_programs: int = DEFAULT_PROGRAMS,
    interpret: Any = None,
) -> Pool:
    """Write ``pages[:, :, i]`` at page ``page_ids[i]`` of ``pool`` by DMA; returns the new pool.

    Args:
        pool: bits[L, kvf, P, ps, H, D]; aliased into the output (donate it in the caller's jit
            for an in-place update).
        page_ids: int32[n], each in [0, P) (checked here when concrete; traced ids must be
            validated by the caller: an out-of-range DMA faults the chip).
        pages: bits[L, kvf, n, ps, H, D], the pool's dtype.
        window: DMAs in flight per program.
        num_programs: grid size (parallel programs).
        interpret: None to compile for TPU, or a ``pltpu.InterpretParams`` to run in the TPU
            interpreter (any backend).

    Returns:
        bits[L, kvf, P, ps, H, D], equal to ``ref_scatter_pages(pool, page_ids, pages)``.
    """
    _ref.check_pool(pool)
    _ref.check_page_ids(page_ids, pool.shape[2])
    _ref.check_pages(pages, pool, page_ids.shape[0])
    if page_ids.shape[0] == 0:
        return pool
    return _scatter(
        pool, page_ids, pages, window=window, num_programs=num_programs, interpret=interpret
    )


def scatter_layer_pages(
    pool: Pool,
    layer,
    page_ids: PageIds,
    layer_pages: LayerPages,
    *,
    window: int = DEFAULT_WINDOW,
    num_programs: int = DEFAULT_PROGRAMS,
    interpret: Any = None,
) -> Pool:
    """Write one layer: ``pool[layer, :, page_ids[i]] = layer_pages[:, i]`` by DMA.

    Args:
        pool: bits[L, kvf, P, ps, H, D], aliased (donate it in the caller's jit).
        layer: int or int32 scalar; traced is fine (one compile for all layers).
        page_ids: int32[n], each in [0, P).
        layer_pages: bits[kvf, n, ps, H, D], the pool's dtype.
        window: as in :func:`scatter_pages`.
        num_programs: as in :func:`scatter_pages`.
        interpret: as in :func:`scatter_pages`.

    Returns:
        The new pool, equal to ``ref_scatter_layer_pages(pool, layer, page_ids, layer_pages)``.
    """
    _ref.check_pool(pool)
    _ref.check_layer(layer, pool.shape[0])
    _ref.check_page_ids(page_ids, pool.shape[2])
    _ref.check_pages(layer_pages, pool, page_ids.shape[0], layer=True)
    if page_ids.shape[0] == 0:
        return pool
    return _scatter_layer(
        pool,
        layer,
        page_ids,
        layer_pages,
        window=window,
        num_programs=num_programs,
        interpret=interpret,
    )


def gather_pages(
    pool: Pool,
    page_ids: PageIds,
    *,
    window: int = DEFAULT_WINDOW,
    num_programs: int = DEFAULT_PROGRAMS,
    interpret: Any = None,
) -> Pages:
    """Copy pages ``page_ids`` of ``pool`` into a new contiguous array by DMA.

    Args:
        pool: bits[L, kvf, P, ps, H, D] (read only).
        page_ids: int32[n], each in [0, P); repeats allowed.
        window: as in :func:`scatter_pages`.
        num_programs: as in :func:`scatter_pages`.
        interpret: as in :func:`scatter_pages`.

    Returns:
        bits[L, kvf, n, ps, H, D], equal to ``ref_gather_pages(pool, page_ids)``.
    """
    _ref.check_pool(pool)
    _ref.check_page_ids(page_ids, pool.shape[2])
    if page_ids.shape[0] == 0:
        return ref_gather_pages(pool, page_ids)
    return _gather(pool, page_ids, window=window, num_programs=num_programs, interpret=interpret)
