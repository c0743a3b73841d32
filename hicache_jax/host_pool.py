"""HostPagePool: the host (L2) page pool, one preallocated buffer of every layer's K and V pages.

Layouts (``HiCacheConfig.host_layout``), raw bits (``spec.bits_dtype``) like the device pool::

    layer_first: bits[num_layers, kv_factor, num_pages, page_size, num_kv_heads, head_dim]
    page_first:  bits[num_pages, num_layers, kv_factor, page_size, num_kv_heads, head_dim]

``layer_first`` keeps each layer's pages together (layer-by-layer load-back reads one layer's
rows); ``page_first`` makes each page one contiguous run across layers (large transfers, a
storage tier). The kv-head axis is axis 4 in both, as in the device pool.

The buffer is a ``jax.Array`` in host memory:

* GPU/TPU: memory kind ``pinned_host`` (DMA-able), allocated from XLA's host allocator.
* CPU: the CPU device's own memory, which *is* host RAM (64-byte aligned by XLA). We keep a
  ``jax.Array`` rather than a numpy array so that every access -- page copies, reads, writes --
  is an XLA computation ordered by data dependencies: a copy in flight can never race a later
  write of the same pages, and the copy path is the same code on every backend.
* Sharded device pool (mesh over kv heads): the host buffer is sharded the same way, one
  contiguous host buffer per shard (its heads of every page), so each device copies only to and
  from its own host shard; nothing crosses devices (see benchmarks/RESULTS.md for the measure).

Page copies are :func:`copy_pages`: one jitted ``fori_loop`` of per-page ``dynamic_slice`` /
``dynamic_update_slice`` (XLA fuses the pair into one in-place pass) with the destination
donated. Each byte is moved once, no staging buffer. On XLA:CPU a vectorised
``.at[ids].set(src[ids])`` ran at 0.13-0.3x ``numpy.copyto`` (element-wise scatter/gather
loops); this loop, on rows of H*D elements, costs about the CPU time of ``numpy.copyto`` per
byte. The ids travel as one packed "copy plan" (:func:`copy_plan`) with a traced trip count, so
they are padded only for compile reuse; the loop copies ``UNROLL`` pages per trip and the
padding repeats the last pair (an idempotent extra copy), so neither pool needs a scratch page.

Threading: one thread (the cache's dispatching thread, DESIGN rule 4) touches the pool.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, SingleDeviceSharding

from hicache_jax.allocator import PageAllocator, PageIdChecker
from hicache_jax.device_pool import bucket_size, zeros_placed
from hicache_jax.device_pool import head_sharding as device_head_sharding
from hicache_jax.hugepages import advise_huge_pages
from hicache_jax.spec import HostLayout, KVSpec
from hicache_jax.validation import check_bool, check_int, parse_enum


#: Minimum length of a copy plan's rows. Two reasons: XLA:CPU runs an executable whose estimated
#: cost is under 1000 flops inline, in the calling thread (PjRt CPU client, "cheap_computation");
#: a copy loop has no flops, so the completion token sums the plan (~1 flop per entry, 3 rows)
#: to make every copy asynchronous. And up to 1024 pages, every copy of a given pair of layouts
#: shares one compile (the trip count is a traced scalar anyway).
MIN_INDEX_LEN = 1024

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


def copy_plan(dst_ids: np.ndarray, src_ids: np.ndarray, layer: int = 0) -> np.ndarray:
    """Pack a copy ``dst[dst_ids[i]] = src[src_ids[i]]`` into one int32[3, index_len(n)] array.

    One array means one host -> device argument transfer per dispatch instead of four (measured
    ~0.14 ms less per call on XLA:CPU). Padding repeats the last pair: the loop copies whole
    groups of ``UNROLL`` pages, and copying the same page to the same place again is harmless
    (same bytes, same executable, in order), so no scratch page is needed in either pool.

    Args:
        dst_ids, src_ids: int32[n] validated ids, n >= 1, same length.
        layer: first layer copied.
    """
    n = dst_ids.size
    plan = np.zeros((3, index_len(n)), np.int32)
    plan[PLAN_DST, :n] = dst_ids
    plan[PLAN_DST, n:] = dst_ids[-1]
    plan[PLAN_SRC, :n] = src_ids
    plan[PLAN_SRC, n:] = src_ids[-1]
    plan[PLAN_META, 0] = -(-n // UNROLL)
    plan[PLAN_META, 1] = layer
    return plan


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


def _slice_page(arr: jax.Array, layout: HostLayout, page: jax.Array, layer: jax.Array,
                num_layers: int) -> jax.Array:
    """One page, layers ``[layer, layer + num_layers)``: [nl, kvf, 1, *row] (row: ps, H, D or
    ps, H*D in a merged view)."""
    zero = jnp.zeros((), jnp.int32)
    row_zeros = (zero,) * (arr.ndim - 3)
    if layout is HostLayout.PAGE_FIRST:
        kvf, row = arr.shape[2], arr.shape[3:]
        # [1, nl, kvf, *row] -> [nl, kvf, 1, *row]: moving a size-1 axis is a reshape.
        chunk = lax.dynamic_slice(arr, (page, layer, zero, *row_zeros),
                                  (1, num_layers, kvf, *row))
        return chunk.reshape(num_layers, kvf, 1, *row)
    kvf, row = arr.shape[1], arr.shape[3:]
    return lax.dynamic_slice(arr, (layer, zero, page, *row_zeros), (num_layers, kvf, 1, *row))


def _to_layout(chunk: jax.Array, layout: HostLayout) -> jax.Array:
    """A [nl, kvf, 1, *row] chunk in the shape one page of ``layout`` takes."""
    if layout is HostLayout.PAGE_FIRST:
        return chunk.reshape(1, *chunk.shape[:2], *chunk.shape[3:])
    return chunk


def _update_page(arr: jax.Array, layout: HostLayout, page: jax.Array, layer: jax.Array,
                 chunk: jax.Array) -> jax.Array:
    zero = jnp.zeros((), jnp.int32)
    row_zeros = (zero,) * (arr.ndim - 3)
    if layout is HostLayout.PAGE_FIRST:
        return lax.dynamic_update_slice(arr, chunk, (page, layer, zero, *row_zeros))
    return lax.dynamic_update_slice(arr, chunk, (layer, zero, page, *row_zeros))


_STATIC = ("dst_layout", "src_layout", "num_layers", "src_put", "dst_put")


def _copy_loop(dst: jax.Array, src: jax.Array, plan: jax.Array, *, dst_layout: HostLayout,
               src_layout: HostLayout, num_layers: int, src_put: jax.sharding.Sharding | None,
               dst_put: jax.sharding.Sharding | None) -> tuple[jax.Array, jax.Array]:
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
    # XLA:CPU (see MIN_INDEX_LEN).
    return dst_m.reshape(shape), jnp.sum(plan)


#: The page copy every transfer uses: :func:`_copy_loop` jitted with ``dst`` donated.
copy_pages = jax.jit(_copy_loop, donate_argnums=0, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=("size", "out_sharding") + _STATIC[1:])
def _gather_pages(src: jax.Array, plan: jax.Array, *, size: int,
                  out_sharding: jax.sharding.Sharding, src_layout: HostLayout, num_layers: int,
                  src_put: jax.sharding.Sharding | None, dst_put: None
                  ) -> tuple[jax.Array, jax.Array]:
    """Pages of ``src`` into a new [L, kvf, size, ps, H, D] array, row ``plan[0, i]`` from page
    ``plan[1, i]`` (the plan of ``copy_plan(arange(n), ids)``; rows >= n stay 0), and the
    copy's token: without its flops XLA:CPU would run the copy inline (see MIN_INDEX_LEN)."""
    if src_layout is HostLayout.PAGE_FIRST:
        _, num_l, kvf, ps, heads, dim = src.shape
    else:
        num_l, kvf, _, ps, heads, dim = src.shape
    out = lax.with_sharding_constraint(jnp.zeros((num_l, kvf, size, ps, heads, dim), src.dtype),
                                       out_sharding)
    return _copy_loop(out, src, plan, dst_layout=HostLayout.LAYER_FIRST, src_layout=src_layout,
                      num_layers=num_layers, src_put=src_put, dst_put=dst_put)


def resolve_memory_kind(device: jax.Device, memory_kind: str) -> str:
    """``"auto"`` -> ``pinned_host`` on accelerators that have it, else the device's default.

    On CPU the device's default memory already is host RAM; ``pinned_host`` there is accepted
    (it exercises the accelerator code path in tests) but buys nothing.
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
        raise ValueError(f"memory_kind={memory_kind!r} is not one of {['auto'] + usable} "
                         f"(the memories of {device} this pool can use)")
    return memory_kind


def head_sharding(spec: KVSpec, mesh: Mesh | None, axis: str | None) -> jax.sharding.Sharding:
    """The device pool's sharding (over kv heads, axis 4 of every layout; replicated for MLA),
    or device 0 without a mesh."""
    sharding = device_head_sharding(spec, mesh, axis)
    return SingleDeviceSharding(jax.devices()[0]) if sharding is None else sharding


def _allocate(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding,
              on_default_memory: bool) -> jax.Array:
    """Zeroed buffer placed directly with ``sharding``.

    In the device's default memory a jitted ``zeros`` allocates in place. In a host memory kind
    of an accelerator that jit would build the zeros in device memory first (the host pool can be
    larger than the device), so the shards are copied from a ``np.zeros`` (calloc: its untouched
    pages cost no RAM). (``make_array_from_callback`` loses the host memory space of the aval in
    jax 0.10.)
    """
    if on_default_memory:
        return zeros_placed(shape, dtype, sharding)
    return jax.device_put(np.zeros(shape, dtype), sharding)


class HostRead:
    """Pages being copied out of a host pool (:meth:`HostPagePool.read_async`).

    Attributes:
        num_pages: pages read.
    """

    __slots__ = ("spec", "num_pages", "_chunks")

    def __init__(self, spec: KVSpec, num_pages: int,
                 chunks: list[tuple[int, int, jax.Array]]) -> None:
        self.spec, self.num_pages, self._chunks = spec, num_pages, chunks

    def done(self) -> bool:
        """Non-blocking: have the pages been copied?"""
        return all(pages.is_ready() for _, _, pages in self._chunks)

    def result(self) -> np.ndarray:
        """The pages as a new numpy ``spec.kv_shape(num_pages)`` array (blocks until done)."""
        out = np.empty(self.spec.kv_shape(self.num_pages), self.spec.bits_dtype)
        for start, count, pages in self._chunks:
            out[:, :, start:start + count] = np.asarray(pages)[:, :, :count]
        return out

    def copy_into(self, out: np.ndarray, rows: np.ndarray) -> None:
        """``out[rows[i]] = page i`` for a page-major ``out`` (``[P, L, kvf, ps, H, D]``, any
        strides; blocks until done): one copy per page, no intermediate array.

        Raises:
            TypeError: ``out`` is not of the bits dtype (numpy would convert values, not copy bits).
        """
        if out.dtype != self.spec.bits_dtype:
            raise TypeError(f"out.dtype={out.dtype} must be the bits dtype {self.spec.bits_dtype}")
        for start, count, pages in self._chunks:
            out[rows[start:start + count]] = np.moveaxis(np.asarray(pages)[:, :, :count], 2, 0)


class HostPagePool:
    """The host (L2) page pool: one preallocated host buffer (per shard) plus its allocator.

    Args:
        spec: what one page holds.
        num_pages: allocatable pages (0 allowed: an empty tier).
        layout: "layer_first" | "page_first" (see the module docstring).
        mesh, axis: the device pool's mesh and head axis; the buffer is then sharded the same way.
        memory_kind: "auto" (pinned_host on GPU/TPU, the device's own memory on CPU) or an
            explicit memory kind of the device.
        huge_pages: on the CPU backend, back the buffer with transparent huge pages (see
            hugepages.py: a construction-time cost that makes scattered page copies faster).

    Attributes:
        buffer: ``spec.bits_dtype`` array of ``shape``; this object holds the only reference and
            rebinds it after each donated update (do not keep it across ``write`` / ``run``).
        shape: ``(L, kvf, num_pages, ps, H, D)`` or ``(num_pages, L, kvf, ps, H, D)``.
        sharding: the buffer's sharding (with its memory kind).
        device_sharding: the same placement in the device's default memory (where pages read
            back to, and what the device pool uses).
        allocator: ``PageAllocator(num_pages, "host")``; the pool itself never allocates.
        huge_page_bytes: bytes of ``buffer`` on transparent huge pages (0 off the CPU backend).
    """

    def __init__(self, spec: KVSpec, num_pages: int, layout: HostLayout | str = "layer_first", *,
                 mesh: Mesh | None = None, axis: str | None = None,
                 memory_kind: str = "auto", huge_pages: bool = True) -> None:
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        check_int("num_pages", num_pages, 0)
        check_bool("huge_pages", huge_pages)
        self.spec = spec
        self.num_pages = int(num_pages)
        self.layout = parse_enum(HostLayout, "layout", layout)
        placement = head_sharding(spec, mesh, axis)
        device = next(iter(placement.device_set))
        self.memory_kind = resolve_memory_kind(device, memory_kind)
        default_kind = device.default_memory().kind
        self.device_sharding = placement.with_memory_kind(default_kind)
        self.sharding = placement.with_memory_kind(self.memory_kind)
        self.on_device_memory = self.memory_kind == default_kind
        self.shape = (spec.kv_shape(self.num_pages) if self.layout is HostLayout.LAYER_FIRST
                      else spec.page_major_shape(self.num_pages))
        self.allocator = PageAllocator(self.num_pages, "host")
        self._check_ids = PageIdChecker(self.num_pages, "host")
        self.buffer: jax.Array = _allocate(self.shape, spec.bits_dtype, self.sharding,
                                           self.on_device_memory)
        #: Bytes of the buffer on transparent huge pages (CPU backend only; see hugepages.py).
        self.huge_page_bytes = advise_huge_pages(self.buffer) if huge_pages else 0
        self._sharding_ok: Any = None  # the last result sharding of run() found equivalent

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.spec.page_bytes

    def validate_ids(self, page_ids: Any, name: str = "host_ids") -> np.ndarray:
        """Check ids are 1-D ints in ``[0, num_pages)`` and distinct; return an int32 copy.

        Raises:
            TypeError: not integers.  ValueError: not 1-D, out of range, or repeated.
        """
        return self._check_ids(page_ids, name)

    def run(self, fn: Callable[..., tuple[jax.Array, Any]], *args: Any) -> Any:
        """``new_buffer, out = fn(self.buffer, *args)`` with the buffer donated; rebinds it.

        ``fn`` must be jitted with ``donate_argnums=0`` and return a buffer of the same shape,
        dtype and sharding. A ``jax.jit`` function's result shape is checked with
        ``eval_shape`` before dispatch (a mismatch raises ``ValueError``, buffer untouched);
        a sharding mismatch or a missing donation is found after the step ran and raises too.
        """
        if hasattr(fn, "eval_shape"):
            self._check_shape(fn.eval_shape(self.buffer, *args)[0])
        old = self.buffer
        new, out = fn(old, *args)
        self._check_shape(new)
        # An executable returns the same sharding object every call: check a new one once
        # (is_equivalent_to costs ~50-65 us on a cold cache, per transfer).
        if new.sharding is not self._sharding_ok:
            if not new.sharding.is_equivalent_to(self.sharding, len(self.shape)) or \
                    new.sharding.memory_kind != self.memory_kind:
                raise ValueError(f"fn returned a host buffer with sharding {new.sharding}, "
                                 f"expected {self.sharding}")
            self._sharding_ok = new.sharding
        self.buffer = new
        if not old.is_deleted():
            raise ValueError("fn did not donate the host buffer (jit it with donate_argnums=0)")
        return out

    def _check_shape(self, new: Any) -> None:
        if tuple(new.shape) != self.shape or new.dtype != self.spec.bits_dtype:
            raise ValueError(f"fn returned a host buffer of shape {tuple(new.shape)} dtype "
                             f"{new.dtype}, expected {self.shape} {self.spec.bits_dtype}")

    def write(self, host_ids: Any, kv: np.ndarray | jax.Array) -> None:
        """Store the KV of ``n`` pages at ``host_ids`` (tests, the storage tier).

        Args:
            host_ids: n distinct ids in ``[0, num_pages)``.
            kv: ``spec.kv_shape(n)`` in ``spec.bits_dtype`` or ``spec.dtype``; a jax array is
                fetched to host first. Not consumed.

        Raises:
            TypeError / ValueError: bad ids, shape or dtype, before anything changes.
        """
        ids = self.validate_ids(host_ids)
        bits = self._check_kv(kv, ids.size)
        for start, count, staged in self._staging_chunks(ids.size):
            staged[:count] = np.moveaxis(bits[:, :, start:start + count], 2, 0)
            self._write_staged(ids[start:start + count], staged)

    def write_rows(self, host_ids: Any, pages: np.ndarray, rows: Any) -> None:
        """Store ``pages[rows[i]]`` at ``host_ids[i]``: pages taken straight from a page-major
        numpy buffer (``[P, L, kvf, ps, H, D]``, any strides, e.g. the L3 staging pool), with
        one host copy per page and no intermediate array.

        Raises:
            TypeError / ValueError: bad ids, rows, buffer shape or dtype, before anything changes.
        """
        ids = self.validate_ids(host_ids)
        tail = self.spec.page_major_shape(1)[1:]
        if not isinstance(pages, np.ndarray):
            raise TypeError(f"pages must be a numpy array, got {type(pages).__name__}")
        if pages.ndim != 6 or pages.shape[1:] != tail:
            raise ValueError(f"pages.shape={pages.shape} must be (P,) + {tail} (page-major)")
        if pages.dtype not in (self.spec.jnp_dtype, self.spec.bits_dtype):
            raise TypeError(f"pages.dtype={pages.dtype} must be {self.spec.jnp_dtype} or "
                            f"{self.spec.bits_dtype}")
        rows = np.asarray(rows)
        if rows.shape != ids.shape or not (rows.size == 0 or rows.dtype.kind in "iu"):
            raise ValueError(f"rows must be {ids.size} integers, got shape {rows.shape} "
                             f"dtype {rows.dtype}")
        if rows.size and (rows.min() < 0 or rows.max() >= pages.shape[0]):
            raise ValueError(f"rows must be in [0, {pages.shape[0]}), got "
                             f"[{rows.min()}, {rows.max()}]")
        src = pages.view(self.spec.bits_dtype)
        for start, count, staged in self._staging_chunks(ids.size):
            # page by page: np.take would first copy the whole of a non-contiguous ``pages``
            # (measured: 14.6 ms for 64 of 256 pages of an entry-rows view), fancy indexing
            # would make a temporary of the chunk
            for i, row in enumerate(rows[start:start + count].tolist()):
                staged[i] = src[row]
            self._write_staged(ids[start:start + count], staged)

    def _staging_chunks(self, n: int):
        """``(start, count, staged)`` per chunk: a fresh page-major buffer of the chunk's stage
        size (padding rows are never read: the plan pads with its last pair). Fresh each time:
        on CPU ``device_put`` may alias it."""
        for start, count, size in stage_chunks(n):
            yield start, count, np.empty(self.spec.page_major_shape(size), self.spec.bits_dtype)

    def _write_staged(self, ids: np.ndarray, staged: np.ndarray) -> None:
        """Copy the first ``ids.size`` pages of a page-major staged chunk to ``ids``."""
        # Staged in device memory even when the buffer is pinned_host: a device computation
        # can move chunks device -> host, not update host memory from host memory.
        src = jax.device_put(staged, self.device_sharding)
        self.run(functools.partial(
            copy_pages, dst_layout=self.layout, src_layout=HostLayout.PAGE_FIRST,
            num_layers=self.spec.num_layers, src_put=None,
            dst_put=None if self.on_device_memory else self.sharding),
            src, copy_plan(ids, np.arange(ids.size, dtype=np.int32)))

    def read(self, host_ids: Any) -> np.ndarray:
        """Return the KV bits of ``host_ids``: a new ``spec.kv_shape(n)`` numpy array.

        Blocks until every update of those pages dispatched before has landed.
        """
        return self.read_async(host_ids).result()

    def read_async(self, host_ids: Any) -> "HostRead":
        """Dispatch a copy of the pages ``host_ids`` out of the buffer and return at once.

        The copy is ordered after every update dispatched before it and before every later one
        (XLA data dependencies), so the pages may be freed and reused right after this call:
        the :class:`HostRead` still yields their current content.

        Raises:
            TypeError / ValueError: bad ids (before dispatch).
        """
        ids = self.validate_ids(host_ids)
        chunks = [(start, count, _gather_pages(
            self.buffer, copy_plan(np.arange(count, dtype=np.int32), ids[start:start + count]),
            size=size, out_sharding=self.device_sharding, src_layout=self.layout,
            num_layers=self.spec.num_layers,
            src_put=None if self.on_device_memory else self.device_sharding, dst_put=None)[0])
            for start, count, size in stage_chunks(ids.size)]
        return HostRead(self.spec, ids.size, chunks)

    def _check_kv(self, kv: Any, n: int) -> np.ndarray:
        if not isinstance(kv, (jax.Array, np.ndarray)):
            raise TypeError(f"kv must be a jax.Array or numpy array, got {type(kv).__name__}")
        want = self.spec.kv_shape(n)
        if tuple(kv.shape) != want:
            raise ValueError(f"kv.shape={tuple(kv.shape)} must be spec.kv_shape({n})={want} "
                             "[layers, kv, pages, page_size, heads, dim]")
        if kv.dtype not in (self.spec.jnp_dtype, self.spec.bits_dtype):
            raise TypeError(f"kv.dtype={kv.dtype} must be {self.spec.jnp_dtype} (spec dtype) "
                            f"or {self.spec.bits_dtype} (raw bits)")
        return np.asarray(kv).view(self.spec.bits_dtype)
