"""NVIDIA GPU page-copy kernels on Pallas' Mosaic GPU backend (Hopper and newer), via TMA.

Backend choice: JAX 0.11 deprecated the Pallas Triton backend ("To keep using Pallas on GPU,
please migrate to the Mosaic GPU backend", Pallas changelog, JAX 0.11.0), and Mosaic GPU kernels
are launched over a ``plgpu.Mesh`` (``pl.pallas_call`` for Mosaic GPU warns that it is
deprecated). These kernels use ``pl.kernel`` with a ``plgpu.Mesh`` (what ``plgpu.kernel`` does
inside, minus a custom_vmap wrapper that rejects Ref operands); the in-place update of the pool
goes through a ``jax.new_ref`` passed to the kernel, which ``pl.kernel`` aliases in and out
because the kernel writes it.

How memory is moved: TMA bulk copies, ``plgpu.copy_gmem_to_smem`` into a ring of SMEM buffers
and ``plgpu.copy_smem_to_gmem`` out of them, rather than register loads/stores. Reasons:

* the unit of work is a contiguous run of bytes (one page of one layer and one of K/V is
  ``ps * H * D`` contiguous elements in both the pool and the page buffer). For a contiguous
  slice with ``oob_mode=PROMISE_IN_BOUNDS`` and no swizzle, Mosaic GPU lowers the copy to a
  plain ``cp.async.bulk`` (no tensor map, no 256-element box limit, any size that is a multiple
  of 16 bytes), i.e. fully coalesced 16-byte-aligned transfers issued by one thread;
* one block keeps ``stages`` tiles (``stages * tile_bytes`` bytes, 128 KiB by default) in
  flight with no register pressure, which is what hides HBM latency on Hopper (Little's law:
  ~4.8 TB/s x ~1 us over 132 SMs is ~36 KiB per SM); register copies would need many warps
  and unrolling to keep as many bytes outstanding;
* the dtype never matters: bytes are bytes (uint8/16/32 alike).
The JAX source's own copy-shaped Mosaic GPU kernel (``ops/gpu/all_gather_mgpu.py``) uses
register loads with a "TODO: Use a TMA pipeline"; ``emit_pipeline`` is the TMA pattern for tiled
compute and is not needed for a pure copy.

Work split: the copy is ``L * kvf * n * (chunk / tile)`` tiles; block ``b`` of ``num_blocks``
(one per SM by default) moves a contiguous range of them through a ``stages``-deep ring:
load ``k + stages - 1`` is issued as soon as the store of tile ``k - 1`` has finished reading its
slot (``wait_smem_to_gmem(1, wait_read_only=True)``).

Requirements checked by the wrapper: chunk bytes (``ps * H * D * itemsize``) a multiple of 128
(TMA needs 16-byte multiples and Lane-semantics copies need multiples of the warpgroup size).
Without a CUDA device the module imports fine and ``available()`` is False.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import reference as _ref
from pallas_kernels.reference import ref_gather_pages, ref_scatter_layer_pages, ref_scatter_pages

plgpu: Any  # the module, or None where it does not import
try:  # Mosaic GPU ships with jaxlib; guard anyway so CPU-only installs can import this module.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the jaxlib build
    plgpu = None

if TYPE_CHECKING:
    from pallas_kernels.reference import LayerPages, PageIds, Pages, Pool

__all__ = [
    "available",
    "gather_pages",
    "scatter_layer_pages",
    "scatter_pages",
    "ref_gather_pages",
    "ref_scatter_layer_pages",
    "ref_scatter_pages",
]

#: Largest TMA tile; a chunk bigger than this is split into equal tiles.
DEFAULT_TILE_BYTES = 32 * 1024
#: SMEM ring depth: tiles in flight per block (4 x 32 KiB fits Hopper's 227 KiB SMEM).
DEFAULT_STAGES = 4
_ALIGN = 128  # bytes: TMA needs 16, Lane-semantics copies need the warpgroup size (128)


def available() -> bool:
    """True when a CUDA device is present and Mosaic GPU imported."""
    if plgpu is None:
        return False
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def _tile_elems(chunk_elems: int, itemsize: int, max_tile_bytes: int) -> int:
    """Largest tile dividing the chunk, at most ``max_tile_bytes`` and a multiple of 128 bytes."""
    if chunk_elems * itemsize % _ALIGN:
        raise ValueError(
            f"chunk bytes (page_size*heads*dim*itemsize = {chunk_elems * itemsize}) "
            f"must be a multiple of {_ALIGN} for TMA copies; use the XLA path"
        )
    tile = chunk_elems
    while (
        tile * itemsize > max_tile_bytes and tile % 2 == 0 and (tile // 2) * itemsize % _ALIGN == 0
    ):
        tile //= 2
    return tile


# ----------------------------------------------------------------------------------------------
# Kernel body. Sources and destinations are viewed as [chunks, pages, chunk_elems]: chunk = layer
# and K/V (flattened), page = pool page or position in the page buffer.


def _copy_body(
    ids_ref,
    base_ref,
    src_ref,
    dst_ref,
    buf,
    bars,
    *,
    scatter,
    num_chunks,
    n,
    tiles_per_chunk,
    tile,
    per_block,
    stages,
):
    """Move tiles [b * per_block, (b + 1) * per_block) of the copy through a ``stages`` ring.

    Tile t is (chunk c, page i, tile s) with t = (c * n + i) * tiles_per_chunk + s. For a scatter
    the source is pages[c, i] and the destination pool[base + c, ids[i]]; a gather swaps them.
    """
    total = num_chunks * n * tiles_per_chunk
    first = lax.axis_index("blocks") * per_block
    base = base_ref[0]

    def refs(k):
        t = first + k
        s = t % tiles_per_chunk
        i = (t // tiles_per_chunk) % n
        c = t // (tiles_per_chunk * n)
        window = pl.ds(s * tile, tile)
        dense = (c, i, window)
        pooled = (base + c, ids_ref[i], window)
        if scatter:
            return src_ref.at[dense], dst_ref.at[pooled]
        return src_ref.at[pooled], dst_ref.at[dense]

    def load(k):
        @pl.when(jnp.logical_and(k < per_block, first + k < total))
        def _():
            src, _ = refs(k)
            slot = k % stages
            plgpu.copy_gmem_to_smem(
                src, buf.at[slot], bars.at[slot], oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS
            )

    for k in range(min(stages - 1, per_block)):  # prologue: fill all slots but one
        load(k)

    def step(k, carry):
        @pl.when(first + k < total)
        def _():
            slot = k % stages
            plgpu.barrier_wait(bars.at[slot])
            _, dst = refs(k)
            plgpu.copy_smem_to_gmem(buf.at[slot], dst)

        # The store of tile k - 1 has read its slot once at most one store group is pending.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        load(k + stages - 1)  # goes into the slot of tile k - 1
        return carry

    lax.fori_loop(0, per_block, step, None)
    plgpu.wait_smem_to_gmem(0)  # every store landed before the kernel exits


def _launch(
    ids,
    base,
    src,
    dst_or_shape,
    *,
    scatter,
    num_chunks,
    n,
    chunk_elems,
    dtype,
    tile_bytes,
    stages,
    num_blocks,
    interpret,
):
    """Build and run the Mosaic GPU kernel; returns the destination array."""
    itemsize = jnp.dtype(dtype).itemsize
    tile = _tile_elems(chunk_elems, itemsize, tile_bytes)
    tiles_per_chunk = chunk_elems // tile
    total = num_chunks * n * tiles_per_chunk
    blocks = max(1, min(num_blocks, total))
    per_block = pl.cdiv(total, blocks)
    # At least two slots: the ring issues load k + stages - 1 after waiting on tile k, so with
    # one slot the first wait would be on a load never issued (a hang when a block gets one
    # tile, e.g. a 1-page copy over many blocks). A second slot costs one tile of SMEM.
    stages = max(2, min(stages, per_block))
    body = functools.partial(
        _copy_body,
        scatter=scatter,
        num_chunks=num_chunks,
        n=n,
        tiles_per_chunk=tiles_per_chunk,
        tile=tile,
        per_block=per_block,
        stages=stages,
    )
    scratch = (plgpu.SMEM((stages, tile), dtype), plgpu.Barrier(num_barriers=stages))

    def kernel_body(*refs):  # SMEM ring and barriers live for the whole kernel
        pl.run_scoped(functools.partial(body, *refs), *scratch)

    # pl.kernel rather than plgpu.kernel: the latter wraps the call in a custom_vmap that
    # rejects Ref operands, and the scatter passes the pool as a Ref to update it in place.
    name = "scatter_pages_mgpu" if scatter else "gather_pages_mgpu"
    launch = pl.kernel(
        kernel_body,
        out_type=() if scatter else dst_or_shape,
        mesh=plgpu.Mesh(grid=(blocks,), grid_names=("blocks",), kernel_name=name),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
        name=name,
    )
    if scatter:  # dst is a Ref to the pool: pl.kernel aliases it in and out (it is written)
        launch(ids, base, src, dst_or_shape)
        return None
    return launch(ids, base, src)


_STATIC = ("tile_bytes", "stages", "num_blocks", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _scatter(pool, layer, page_ids, pages, *, tile_bytes, stages, num_blocks, interpret):
    num_layers, kvf, num_pool_pages, ps, heads, dim = pool.shape
    chunk = ps * heads * dim
    n = page_ids.shape[0]
    per_layer = pages.ndim == 5
    chunks = kvf if per_layer else num_layers * kvf
    base = jnp.reshape(jnp.asarray(layer, jnp.int32) * kvf, (1,))
    pool_ref = jax.new_ref(
        pool.reshape(num_layers * kvf, num_pool_pages, chunk), memory_space=plgpu.GMEM
    )
    _launch(
        page_ids,
        base,
        pages.reshape(chunks, n, chunk),
        pool_ref,
        scatter=True,
        num_chunks=chunks,
        n=n,
        chunk_elems=chunk,
        dtype=pool.dtype,
        tile_bytes=tile_bytes,
        stages=stages,
        num_blocks=num_blocks,
        interpret=interpret,
    )
    return jax.freeze(pool_ref).reshape(pool.shape)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _gather(pool, page_ids, *, tile_bytes, stages, num_blocks, interpret):
    num_layers, kvf, num_pool_pages, ps, heads, dim = pool.shape
    chunk = ps * heads * dim
    n = page_ids.shape[0]
    out = jax.ShapeDtypeStruct((num_layers * kvf, n, chunk), pool.dtype)
    pages = _launch(
        page_ids,
        jnp.zeros((1,), jnp.int32),
        pool.reshape(num_layers * kvf, num_pool_pages, chunk),
        out,
        scatter=False,
        num_chunks=num_layers * kvf,
        n=n,
        chunk_elems=chunk,
        dtype=pool.dtype,
        tile_bytes=tile_bytes,
        stages=stages,
        num_blocks=num_blocks,
        interpret=interpret,
    )
    return pages.reshape(num_layers, kvf, n, ps, heads, dim)


#: Blocks when simulating (the GPU interpreter runs one Python thread per block).
_INTERPRET_BLOCKS = 4


def _default_blocks() -> int:
    """One block per SM on a GPU (132 on H100/H200); a few in the interpreter."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return _INTERPRET_BLOCKS
    return int(getattr(dev, "core_count", 0) or 132)


def _check_tuning(tile_bytes: int, stages: int, num_blocks: int | None) -> None:
    if plgpu is None:
        raise RuntimeError("jax.experimental.pallas.mosaic_gpu is not importable in this jaxlib")
    if tile_bytes < _ALIGN or stages < 1 or (num_blocks is not None and num_blocks < 1):
        raise ValueError(
            f"need tile_bytes >= {_ALIGN}, stages >= 1, num_blocks >= 1; got "
            f"{tile_bytes=}, {stages=}, {num_blocks=}"
        )


# ----------------------------------------------------------------------------------------------
# Public entry points.


def scatter_pages(
    pool: Pool,
    page_ids: PageIds,
    pages: Pages,
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    stages: int = DEFAULT_STAGES,
    num_blocks: int | None = None,
    interpret: Any = None,
) -> Pool:
    """Write ``pages[:, :, i]`` at page ``page_ids[i]`` of ``pool`` with TMA; returns the pool.

    Args:
        pool: bits[L, kvf, P, ps, H, D]; aliased (donate it in the caller's jit for an
            in-place update). ``ps * H * D * itemsize`` must be a multiple of 128 bytes.
        page_ids: int32[n], each in [0, P) (checked when concrete; traced ids must be validated
            by the caller).
        pages: bits[L, kvf, n, ps, H, D], the pool's dtype.
        tile_bytes: largest TMA transfer; chunks above it are split in equal tiles.
        stages: SMEM ring depth (tiles in flight per block).
        num_blocks: grid size; default one block per SM.
        interpret: None to compile for the GPU; GPU-interpreter params to simulate.

    Returns:
        bits[L, kvf, P, ps, H, D], equal to ``ref_scatter_pages(pool, page_ids, pages)``.
    """
    _check_tuning(tile_bytes, stages, num_blocks)
    _ref.check_pool(pool)
    _ref.check_page_ids(page_ids, pool.shape[2])
    _ref.check_pages(pages, pool, page_ids.shape[0])
    _tile_elems(math.prod(pool.shape[3:]), pool.dtype.itemsize, tile_bytes)
    if page_ids.shape[0] == 0:
        return pool
    return _scatter(
        pool,
        0,
        page_ids,
        pages,
        tile_bytes=tile_bytes,
        stages=stages,
        num_blocks=num_blocks or _default_blocks(),
        interpret=interpret,
    )


def scatter_layer_pages(
    pool: Pool,
    layer,
    page_ids: PageIds,
    layer_pages: LayerPages,
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    stages: int = DEFAULT_STAGES,
    num_blocks: int | None = None,
    interpret: Any = None,
) -> Pool:
    """Write one layer: ``pool[layer, :, page_ids[i]] = layer_pages[:, i]`` with TMA.

    Args:
        pool: bits[L, kvf, P, ps, H, D], aliased (donate it in the caller's jit).
        layer: int or int32 scalar; traced is fine (one compile for all layers).
        page_ids: int32[n], each in [0, P).
        layer_pages: bits[kvf, n, ps, H, D], the pool's dtype.
        tile_bytes: as in :func:`scatter_pages`.
        stages: as in :func:`scatter_pages`.
        num_blocks: as in :func:`scatter_pages`.
        interpret: as in :func:`scatter_pages`.

    Returns:
        The new pool, equal to ``ref_scatter_layer_pages(pool, layer, page_ids, layer_pages)``.
    """
    _check_tuning(tile_bytes, stages, num_blocks)
    _ref.check_pool(pool)
    _ref.check_layer(layer, pool.shape[0])
    _ref.check_page_ids(page_ids, pool.shape[2])
    _ref.check_pages(layer_pages, pool, page_ids.shape[0], layer=True)
    _tile_elems(math.prod(pool.shape[3:]), pool.dtype.itemsize, tile_bytes)
    if page_ids.shape[0] == 0:
        return pool
    return _scatter(
        pool,
        layer,
        page_ids,
        layer_pages,
        tile_bytes=tile_bytes,
        stages=stages,
        num_blocks=num_blocks or _default_blocks(),
        interpret=interpret,
    )


def gather_pages(
    pool: Pool,
    page_ids: PageIds,
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    stages: int = DEFAULT_STAGES,
    num_blocks: int | None = None,
    interpret: Any = None,
) -> Pages:
    """Copy pages ``page_ids`` of ``pool`` into a new contiguous array with TMA.

    Args:
        pool: bits[L, kvf, P, ps, H, D] (read only).
        page_ids: int32[n], each in [0, P); repeats allowed.
        tile_bytes: as in :func:`scatter_pages`.
        stages: as in :func:`scatter_pages`.
        num_blocks: as in :func:`scatter_pages`.
        interpret: as in :func:`scatter_pages`.

    Returns:
        bits[L, kvf, n, ps, H, D], equal to ``ref_gather_pages(pool, page_ids)``.
    """
    _check_tuning(tile_bytes, stages, num_blocks)
    _ref.check_pool(pool)
    _ref.check_page_ids(page_ids, pool.shape[2])
    _tile_elems(math.prod(pool.shape[3:]), pool.dtype.itemsize, tile_bytes)
    if page_ids.shape[0] == 0:
        return ref_gather_pages(pool, page_ids)
    return _gather(
        pool,
        page_ids,
        tile_bytes=tile_bytes,
        stages=stages,
        num_blocks=num_blocks or _default_blocks(),
        interpret=interpret,
    )
