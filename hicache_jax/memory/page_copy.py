"""The page copy core: copy plans, the jitted copy loop, and the staging chunks of the host pool.

Every page copy between the two pools (:class:`~hicache_jax.memory.transfer.TransferEngine`) and
every write into / read out of the host pool (:class:`~hicache_jax.memory.host_pool.HostPagePool`)
is :func:`copy_pages` (or :func:`gather_pages`, its variant into a new array): one jitted
``fori_loop`` of per-page ``dynamic_slice`` / ``dynamic_update_slice`` (XLA fuses the pair into
one in-place pass) with the destination donated. Each byte is moved once, no staging buffer. On
XLA:CPU a vectorised ``.at[ids].set(src[ids])`` ran at 0.13-0.3x ``numpy.copyto`` (element-wise
scatter/gather loops); this loop, on rows of H*D elements, costs about the CPU time of
``numpy.copyto`` per byte. The ids travel as one packed "copy plan" (:func:`copy_plan`) with a
traced trip count, so they are padded only for compile reuse; the loop copies ``UNROLL`` pages
per trip and the padding repeats the last pair (an idempotent extra copy), so neither pool needs
a scratch page.

Layouts (``HostLayout``), raw bits like the pools::

    layer_first: bits[num_layers, kv_factor, num_pages, page_size, num_kv_heads, head_dim]
    page_first: bits[num_pages, num_layers, kv_factor, page_size, num_kv_heads, head_dim]

The device pool is ``layer_first`` (with its scratch page).

Pure functions only: no pool state lives here. Callers are on the cache's one dispatching
thread (ARCHITECTURE.md: one dispatching thread).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hicache_jax.spec import HostLayout

if TYPE_CHECKING:  # jaxtyping is a dev dependency only; the annotations stay strings.
    from jaxtyping import Array, Int32, UInt

    #: A pool's raw bits in either layout (page axis 2 for layer_first, 0 for page_first).
    Bits = UInt[Array, "..."]
    #: ``copy_plan``'s packed rows: destination ids, source ids, ``[trips, layer, 0, ...]``.
    CopyPlan = Int32[np.ndarray, "3 plan_len"]
    PageIds = Int32[np.ndarray, "n"]

#: Minimum length of a copy plan's rows. Two reasons: XLA:CPU runs an executable whose estimated
#: cost is under 1000 flops inline, in the calling thread (PjRt CPU client, "cheap_computation");
#: a copy loop has no flops, so the completion token sums the plan (~1 flop per entry, 3 rows)
#: to make every copy asynchronous. And up to 1024 pages, every copy of a given pair of layouts
#: shares one compile (the trip count is a traced scalar anyway).
MIN_INDEX_LEN = 1024

#: Copies of at most this many bytes run inline on XLA:CPU (``inline_copy``): their completion
#: token has no flops, so the PjRt CPU client runs them in the calling thread when their inputs
#: are ready (still asynchronously behind a computation they wait for). Moving this much costs
#: less than handing the execution to XLA's thread and back: measured on XLA:CPU, a small copy
#: cost ~80-120 us of the process's CPU asynchronously (~50 us of them on XLA's thread) and
#: ~35-45 us inline.
INLINE_COPY_BYTES = 1 << 20

#: Pages copied per loop iteration (unrolled). Measured on XLA:CPU (128 KiB pages, 128 pages,
#: raw copy vs numpy.copyto): 1 page per trip 0.77, 4: 0.82, 8: 0.79 -- the while loop's
#: per-trip cost is small next to a 128 KiB copy and the differences are within run-to-run
#: noise; 4 is kept as it was never worse (one more compare per 4 pages).
UNROLL = 4

#: Rows of a copy plan: destination ids, source ids, and ``[trips, first layer, 0, ...]``.
PLAN_DST, PLAN_SRC, PLAN_META = 0, 1, 2

#: Page counts of the device-side arrays ``HostPagePool.write`` / ``read`` stage pages through:
#: ``n`` pages go in chunks of ``STAGE_SIZES[-1]``, each padded to the smallest size that holds
#: it, so those two jitted copies compile for these shapes only, whatever ``n``. Measured on
#: XLA:CPU (128 KiB pages): one compile of either costs 0.4-0.5 s, and power-of-two buckets
#: gave one per new size (up to ~10 per process, each a stall of the cache's thread when a
#: prefetch of a new size landed), while a chunk's extra dispatch is ~0.1-0.3 ms.
STAGE_SIZES = (1, 8, 64)


def bucket_size(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): the padded length of an index array."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def stage_chunks(n: int) -> list[tuple[int, int, int]]:
    """``(start, count, size)`` of the staged chunks that move ``n`` pages (see STAGE_SIZES)."""
    chunks = []
    for start in range(0, n, STAGE_SIZES[-1]):
        count = min(STAGE_SIZES[-1], n - start)
        chunks.append((start, count, next(s for s in STAGE_SIZES if s >= count)))
    return chunks


def index_len(n: int) -> int:
    """Padded length of the rows of an ``n``-page copy plan (a multiple of ``UNROLL``)."""
    return max(MIN_INDEX_LEN, bucket_size(n), UNROLL)


def copy_plan(
    dst_ids: PageIds,
    src_ids: PageIds,
    layer: int = 0,
    length: int | None = None,
    out: np.ndarray | None = None,
) -> CopyPlan:
    """Pack a copy ``dst[dst_ids[i]] = src[src_ids[i]]`` into one int32[3, index_len(n)] array.

    One array means one host -> device argument transfer per dispatch instead of four (measured
    ~0.14 ms less per call on XLA:CPU). Padding repeats the last pair: the loop copies whole
    groups of ``UNROLL`` pages, and copying the same page to the same place again is harmless
    (same bytes, same executable, in order), so no scratch page is needed in either pool.

    Args:
        dst_ids, src_ids: int32[n] validated ids, same length (n = 0: a plan that copies
            nothing, ``length`` given).
        layer: first layer copied.
        length: the rows' length, at least ``index_len(n)`` (a fused copy's window groups take
            the full pages' length: one program per length, whatever each group copies).
        out: an int32 ``[3, length]`` array of zeros to fill (a fused copy's row of its
            stacked plans) instead of a new one.
    """
    n = dst_ids.size
    plan = (
        np.zeros((3, index_len(n) if length is None else length), np.int32) if out is None else out
    )
    if n == 0:
        return plan  # zero trips
    plan[PLAN_DST, :n] = dst_ids
    plan[PLAN_DST, n:] = dst_ids[-1]
    plan[PLAN_SRC, :n] = src_ids
    plan[PLAN_SRC, n:] = src_ids[-1]
    plan[PLAN_META, 0] = -(-n // UNROLL)
    plan[PLAN_META, 1] = layer
    return plan


def layer_plans(plan: CopyPlan, num_layers: int) -> list[CopyPlan]:
    """One copy of ``plan`` per layer ``0 .. num_layers - 1``, each starting at that layer (the
    plans of a layer-wise load, copied with ``num_layers=1``)."""
    plans = []
    for layer in range(num_layers):
        layer_plan = plan.copy()
        layer_plan[PLAN_META, 1] = layer
        plans.append(layer_plan)
    return plans


# Between pools in the same memory space, the copy works on views with the two minor axes
# merged, [..., ps, H * D]: one token row of all heads is one contiguous run, so XLA:CPU's
# per-page slice/update copies long vectorised rows. Measured (XLA:CPU, 128 KiB pages): rows of
# H*D used about the CPU time of numpy.copyto per byte, rows of D (no merge) about 1.4x. Merging
# keeps the head sharding (the sharded H is the major part of the merged axis) and is a free
# reshape in row-major layout. Across memory spaces (an accelerator's pinned_host pool) the
# arrays are left as they are: XLA's host offloading handles slices and updates of host
# buffers, and a reshape of one is not worth the risk for a DMA that does not care about rows.
def _merge_minor(x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _slice_page(
    arr: jax.Array, layout: HostLayout, page: jax.Array, layer: jax.Array, num_layers: int
) -> jax.Array:
    """One page, layers ``[layer, layer + num_layers)``: [nl, kvf, 1, *row] (row: ps, H, D or
    ps, H*D in a merged view)."""
    zero = jnp.zeros((), jnp.int32)
    row_zeros = (zero,) * (arr.ndim - 3)
    if layout is HostLayout.PAGE_FIRST:
        kvf, row = arr.shape[2], arr.shape[3:]
        # [1, nl, kvf, *row] -> [nl, kvf, 1, *row]: moving a size-1 axis is a reshape.
        chunk = lax.dynamic_slice(arr, (page, layer, zero, *row_zeros), (1, num_layers, kvf, *row))
        return chunk.reshape(num_layers, kvf, 1, *row)
    kvf, row = arr.shape[1], arr.shape[3:]
    return lax.dynamic_slice(arr, (layer, zero, page, *row_zeros), (num_layers, kvf, 1, *row))


def _to_layout(chunk: jax.Array, layout: HostLayout) -> jax.Array:
    """A [nl, kvf, 1, *row] chunk in the shape one page of ``layout`` takes."""
    if layout is HostLayout.PAGE_FIRST:
        return chunk.reshape(1, *chunk.shape[:2], *chunk.shape[3:])
    return chunk


def _update_page(
    arr: jax.Array, layout: HostLayout, page: jax.Array, layer: jax.Array, chunk: jax.Array
) -> jax.Array:
    zero = jnp.zeros((), jnp.int32)
    row_zeros = (zero,) * (arr.ndim - 3)
    if layout is HostLayout.PAGE_FIRST:
        return lax.dynamic_update_slice(arr, chunk, (page, layer, zero, *row_zeros))
    return lax.dynamic_update_slice(arr, chunk, (layer, zero, page, *row_zeros))


#: The static arguments of :func:`copy_pages` (and, ``dst_layout`` aside, :func:`gather_pages`).
STATIC = ("dst_layout", "src_layout", "num_layers", "src_put", "dst_put")


def _copy_loop(
    dst: Bits,
    src: Bits,
    plan: jax.Array,
    *,
    dst_layout: HostLayout,
    src_layout: HostLayout,
    num_layers: int,
    src_put: jax.sharding.Sharding | None,
    dst_put: jax.sharding.Sharding | None,
    inline: bool = False,
) -> tuple[Bits, jax.Array]:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every pair of ``plan``, layers
    ``[layer, layer + num_layers)``.

    Args:
        dst: bits pool in ``dst_layout`` (donated; the caller rebinds to the result).
        src: bits pool in ``src_layout`` (read only).
        plan: int32[3, B] from :func:`copy_plan`: validated destination and source ids (padded by
            repeating the last pair), and ``plan[2, :2] = (trips, layer)``; the loop runs
            ``trips`` times, ``UNROLL`` pages per trip.
        dst_layout, src_layout: page axis placement (the device pool is ``LAYER_FIRST``).
        num_layers: layers copied per page (static: all of them, or 1 for a layer-wise load).
        src_put: pool sharding (with memory kind) to move each chunk to right after it is sliced
            from a pool in another memory space (host -> device), or None.
        dst_put: likewise right before it is written into ``dst`` (device -> host), or None.
        inline: a token without flops (plan[2, 0]): XLA:CPU then runs the copy in the caller
            (see ``INLINE_COPY_BYTES``); else one that sums the plan (asynchronous).

    Returns:
        ``(dst, token)``: the updated pool and an int32 scalar that becomes ready when the whole
        copy is done (a small completion token to poll: the pool itself is donated by the next
        call, so it cannot be held). The token's value means nothing.
    """
    shape = dst.shape
    merge = src_put is None and dst_put is None  # same memory space: see _merge_minor
    src_m, dst_m = (_merge_minor(src), _merge_minor(dst)) if merge else (src, dst)
    dst_ids, src_ids = plan[PLAN_DST], plan[PLAN_SRC]
    trips, layer = plan[PLAN_META, 0], plan[PLAN_META, 1]

    def body(i, out):
        for k in range(UNROLL):
            j = i * UNROLL + k
            # [nl, kvf, 1, *row]: one slice and one in-place update, fused into one pass.
            chunk = _slice_page(src_m, src_layout, src_ids[j], layer, num_layers)
            if src_put is not None:
                chunk = jax.device_put(chunk, src_put)
            chunk = _to_layout(chunk, dst_layout)
            if dst_put is not None:
                chunk = jax.device_put(chunk, dst_put)
            out = _update_page(out, dst_layout, dst_ids[j], layer, chunk)
        return out

    dst_m = lax.fori_loop(0, trips, body, dst_m)
    # The sum gives the executable enough estimated flops to be dispatched asynchronously on
    # XLA:CPU (see MIN_INDEX_LEN); an inline copy's token is a plain read of the plan.
    return dst_m.reshape(shape), trips if inline else jnp.sum(plan)


#: The page copy every transfer uses: :func:`_copy_loop` jitted with ``dst`` donated.
copy_pages = jax.jit(_copy_loop, donate_argnums=0, static_argnames=STATIC)


def copy_fn(
    *,
    dst_layout: HostLayout,
    src_layout: HostLayout,
    num_layers: int,
    src_put: jax.sharding.Sharding | None = None,
    dst_put: jax.sharding.Sharding | None = None,
) -> functools.partial:
    """:func:`copy_pages` with its static arguments bound: ``fn(dst, src, plan) -> (dst, token)``,
    ``dst`` donated (what ``DevicePagePool.run`` / ``HostPagePool.run`` take)."""
    return functools.partial(
        copy_pages,
        dst_layout=dst_layout,
        src_layout=src_layout,
        num_layers=num_layers,
        src_put=src_put,
        dst_put=dst_put,
    )


def bound_copy(fn: functools.partial) -> Callable:
    """A :func:`copy_fn` partial as one jit of the copy loop with its static arguments bound in
    (the same computation; what the transfer engine dispatches): a call then skips hashing
    the static keywords, ~10-25 us a dispatch on XLA:CPU. One jit per set of arguments, shared
    by every engine that binds the same (so they share its compiles)."""
    return _bound_copy(tuple(sorted(fn.keywords.items(), key=lambda kv: kv[0])))


def inline_copy(fn: functools.partial) -> Callable:
    """:func:`bound_copy` of the same copy with a token without flops, which XLA:CPU runs in
    the calling thread (``INLINE_COPY_BYTES``): the same pages copied, the same result."""
    return _bound_copy(
        tuple(sorted((fn.keywords | {"inline": True}).items(), key=lambda kv: kv[0]))
    )


@functools.cache
def _bound_copy(keywords: tuple) -> Callable:
    return jax.jit(functools.partial(_copy_loop, **dict(keywords)), donate_argnums=0)


def fused_copy(fns: Sequence[functools.partial], inline: bool = False) -> Callable:
    """The copies of several :func:`copy_fn` partials (the full-attention pages' and each
    window group's) as ONE jit: ``fn(dst, dsts, src, srcs, plans) -> (dst, dsts, token)``
    with ``dst`` and the tuple ``dsts`` donated (what ``run_with`` takes), ``plans`` int32
    ``[len(fns), 3, L]``: each copy's plan (:func:`copy_plan`, one length), stacked so that a
    dispatch moves one argument array, not one a group (~25 us less a call on XLA:CPU, the
    window group's copy then costing what its pages do): one dispatch for a transfer of every
    group. ``inline``: each copy in its :func:`inline_copy` form."""
    extra = {"inline": True} if inline else {}
    keys = tuple(tuple(sorted((f.keywords | extra).items(), key=lambda kv: kv[0])) for f in fns)
    return _fused_copy(keys)


@functools.cache
def _fused_copy(keys: tuple) -> Callable:
    loops: list[Callable[..., Any]] = [functools.partial(_copy_loop, **dict(kw)) for kw in keys]

    def step(dst, dsts, src, srcs, plans):
        dst, token = loops[0](dst, src, plans[0])
        out = tuple(
            loop(d, s, plans[i])[0]
            for i, (loop, d, s) in enumerate(zip(loops[1:], dsts, srcs, strict=True), 1)
        )
        return dst, out, token

    return jax.jit(step, donate_argnums=(0, 1))


@functools.partial(jax.jit, static_argnames=("size", "out_sharding") + STATIC[1:])
def gather_pages(
    src: Bits,
    plan: jax.Array,
    *,
    size: int,
    out_sharding: jax.sharding.Sharding,
    src_layout: HostLayout,
    num_layers: int,
    src_put: jax.sharding.Sharding | None,
    dst_put: None = None,
) -> tuple[Bits, jax.Array]:
    """Pages of ``src`` into a new [L, kvf, size, ps, H, D] array, row ``plan[0, i]`` from page
    ``plan[1, i]`` (the plan of ``copy_plan(arange(n), ids)``; rows >= n stay 0), and the
    copy's token: without its flops XLA:CPU would run the copy inline (see MIN_INDEX_LEN)."""
    if src_layout is HostLayout.PAGE_FIRST:
        _, num_l, kvf, ps, heads, dim = src.shape
    else:
        num_l, kvf, _, ps, heads, dim = src.shape
    out = lax.with_sharding_constraint(
        jnp.zeros((num_l, kvf, size, ps, heads, dim), src.dtype), out_sharding
    )
    return _copy_loop(
        out,
        src,
        plan,
        dst_layout=HostLayout.LAYER_FIRST,
        src_layout=src_layout,
        num_layers=num_layers,
        src_put=src_put,
        dst_put=dst_put,
    )
