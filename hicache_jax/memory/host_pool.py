"""HostPagePool: the host (L2) page pool, one preallocated buffer of every layer's K and V pages.

Layouts (``HiCacheConfig.host_layout``), raw bits (``spec.bits_dtype``) like the device pool::

    layer_first: bits[num_layers, kv_factor, num_pages, page_size, num_kv_heads, head_dim]
    page_first: bits[num_pages, num_layers, kv_factor, page_size, num_kv_heads, head_dim]

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

Every write into and read out of the buffer is a page copy of :mod:`hicache_jax.memory.page_copy`
(staged through small device-side chunks of ``STAGE_SIZES`` pages, so compiles stay bounded);
placement comes from :mod:`hicache_jax.memory.placement`.

Threading: one thread (the cache's dispatching thread, ARCHITECTURE.md: one dispatching thread)
touches the pool.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh

from hicache_jax.memory.allocator import PageAllocator, PageIdChecker
from hicache_jax.memory.donated import DonatedArray, check_kv, run_pools
from hicache_jax.memory.hugepages import advise_huge_pages
from hicache_jax.memory.page_copy import copy_fn, copy_plan, gather_pages, stage_chunks
from hicache_jax.memory.placement import (
    from_local,
    head_sharding,
    local_heads,
    local_numpy,
    placed,
    resolve_memory_kind,
    shard_spec,
    zeros_in_memory,
)
from hicache_jax.spec import HostLayout, KVSpec
from hicache_jax.validation import check_bool, check_int, parse_enum

if TYPE_CHECKING:  # jaxtyping is a dev dependency only; the annotations stay strings.
    from jaxtyping import Array, Shaped

    #: ``n`` pages, ``spec.kv_shape(n)``, in ``spec.dtype`` or its bits.
    KV = Shaped[Array, "num_layers kv_factor n page_size num_kv_heads head_dim"]
    KVHost = Shaped[np.ndarray, "num_layers kv_factor n page_size num_kv_heads head_dim"]
    #: Page-major pages (one page per row, any strides): ``spec.page_major_shape(P)``.
    PageRows = Shaped[np.ndarray, "P num_layers kv_factor page_size num_kv_heads head_dim"]


class HostRead:
    """Pages being copied out of a host pool (:meth:`HostPagePool.read_async`).

    Attributes:
        num_pages: pages read.
    """

    __slots__ = ("spec", "num_pages", "_chunks")

    def __init__(
        self, spec: KVSpec, num_pages: int, chunks: list[tuple[int, int, jax.Array]]
    ) -> None:
        self.spec, self.num_pages, self._chunks = spec, num_pages, chunks

    def done(self) -> bool:
        """Non-blocking: have the pages been copied?"""
        # is_ready(): on jax's concrete arrays (ArrayImpl), not in the jax.Array interface
        return all(pages.is_ready() for _, _, pages in self._chunks)  # type: ignore[attr-defined]

    def result(self) -> KVHost:
        """The pages as a new numpy ``spec.kv_shape(num_pages)`` array (blocks until done)."""
        out = None
        for start, count, pages in self._chunks:
            local = local_numpy(pages)  # a pool over several processes: this one's heads
            if out is None:
                out = np.empty(local.shape[:2] + (self.num_pages,) + local.shape[3:], local.dtype)
            out[:, :, start : start + count] = local[:, :, :count]
        return out if out is not None else np.empty(self.spec.kv_shape(0), self.spec.bits_dtype)

    def copy_into(self, out: PageRows, rows: np.ndarray) -> None:
        """``out[rows[i]] = page i`` for a page-major ``out`` (``[P, L, kvf, ps, H, D]``, any
        strides; blocks until done): one copy per page, no intermediate array.

        Raises:
            TypeError: ``out`` is not of the bits dtype (numpy would convert values, not copy bits).
        """
        if out.dtype != self.spec.bits_dtype:
            raise TypeError(f"out.dtype={out.dtype} must be the bits dtype {self.spec.bits_dtype}")
        for start, count, pages in self._chunks:  # (several processes: this one's heads)
            out[rows[start : start + count]] = np.moveaxis(local_numpy(pages)[:, :, :count], 2, 0)


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

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        layout: HostLayout | str = "layer_first",
        *,
        mesh: Mesh | None = None,
        axis: str | None = None,
        memory_kind: str = "auto",
        huge_pages: bool = True,
    ) -> None:
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        check_int("num_pages", num_pages, 0)
        check_bool("huge_pages", huge_pages)
        self.spec = spec
        self.num_pages = int(num_pages)
        self.layout = parse_enum(HostLayout, "layout", layout)
        placement = placed(head_sharding(spec, mesh, axis))
        device: jax.Device = next(iter(placement.device_set))  # (set[Device] in jax: unresolved)
        self.memory_kind = resolve_memory_kind(device, memory_kind)
        default_kind = device.default_memory().kind
        self.device_sharding = placement.with_memory_kind(default_kind)
        self.sharding = placement.with_memory_kind(self.memory_kind)
        self.on_device_memory = self.memory_kind == default_kind
        self.shape = (
            spec.kv_shape(self.num_pages)
            if self.layout is HostLayout.LAYER_FIRST
            else spec.page_major_shape(self.num_pages)
        )
        self.allocator = PageAllocator(self.num_pages, "host")
        self._check_ids = PageIdChecker(self.num_pages, "host")
        self.buffer: jax.Array = zeros_in_memory(
            self.shape, spec.bits_dtype, self.sharding, self.on_device_memory
        )
        #: Bytes of the buffer on transparent huge pages (CPU backend only; see hugepages.py).
        self.huge_page_bytes = advise_huge_pages(self.buffer) if huge_pages else 0
        self._donated = DonatedArray("host buffer", self.buffer)
        # The heads this process holds (all of them unless the pool spans several processes;
        # ARCHITECTURE.md, "Several processes"): what write_rows takes and reads give back.
        self.local_heads = local_heads(self.sharding, self.shape)
        self.local_spec = shard_spec(spec, self.local_heads)
        # Staged chunks (page-major, in device memory) into the buffer: see _write_staged.
        self._write_fn = staged_write_fn(
            spec, self.layout, None if self.on_device_memory else self.sharding
        )

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

        ``fn`` must be jitted with ``donate_argnums=0`` and return ``(buffer, out)`` with a
        buffer of the same shape, dtype and sharding (memory kind included). A ``jax.jit``
        function's result shape is checked with ``eval_shape`` before dispatch (a mismatch
        raises ``ValueError``, buffer untouched). A sharding mismatch or a missing donation is
        found after the step ran: ``ValueError``, and the buffer keeps the step's result (moved
        back to the pool's placement). Same rules as ``DevicePagePool.run`` (one implementation:
        :class:`hicache_jax.memory.donated.DonatedArray`).

        Returns:
            ``out``, the step's other result.
        """
        return self._donated.run(self.buffer, self._rebind, fn, args)

    def run_with(
        self,
        others: Sequence[HostPagePool],
        fn: Callable[..., tuple[jax.Array, tuple[jax.Array, ...], Any]],
        *args: Any,
    ) -> Any:
        """``DevicePagePool.run_with`` for host pools: ``new, new_others, out = fn(self.buffer,
        tuple(o.buffer for o in others), *args)`` jitted with ``donate_argnums=(0, 1)``; every
        pool rebinds its new buffer (a backup of the full-attention pages and the window
        groups' in one program). Same checks and errors."""
        pools = (self, *others)
        return run_pools(pools, [p._rebind for p in pools], fn, args)

    def array_ref(self) -> jax.Array:
        """The pool's buffer (what :func:`~hicache_jax.memory.donated.run_pools` donates)."""
        return self.buffer

    def _rebind(self, buffer: jax.Array) -> None:
        self.buffer = buffer

    def write(self, host_ids: Any, kv: KV | KVHost) -> None:
        """Store the KV of ``n`` pages at ``host_ids`` (tests, the storage tier).

        Args:
            host_ids: n distinct ids in ``[0, num_pages)``.
            kv: ``spec.kv_shape(n)`` in ``spec.bits_dtype`` or ``spec.dtype``; a jax array is
                fetched to host first. Not consumed.

        Raises:
            TypeError / ValueError: bad ids, shape or dtype, before anything changes.
        """
        ids = self.validate_ids(host_ids)
        check_kv(self.spec, kv, ids.size)
        bits = np.asarray(kv).view(self.spec.bits_dtype)[:, :, :, :, self.local_heads]
        for start, count, staged in self._staging_chunks(ids.size):
            staged[:count] = np.moveaxis(bits[:, :, start : start + count], 2, 0)
            self._write_staged(ids[start : start + count], staged)

    def write_rows(self, host_ids: Any, pages: PageRows, rows: Any) -> None:
        """Store ``pages[rows[i]]`` at ``host_ids[i]``: pages taken straight from a page-major
        numpy buffer (``[P, L, kvf, ps, H, D]``, any strides, e.g. the L3 staging pool), with
        one host copy per page and no intermediate array.

        Raises:
            TypeError / ValueError: bad ids, rows, buffer shape or dtype, before anything changes.
        """
        ids = self.validate_ids(host_ids)
        tail = self.local_spec.page_major_shape(1)[1:]  # this process's heads
        if not isinstance(pages, np.ndarray):
            raise TypeError(f"pages must be a numpy array, got {type(pages).__name__}")
        if pages.ndim != 6 or pages.shape[1:] != tail:
            raise ValueError(f"pages.shape={pages.shape} must be (P,) + {tail} (page-major)")
        if pages.dtype not in (self.spec.jnp_dtype, self.spec.bits_dtype):
            raise TypeError(
                f"pages.dtype={pages.dtype} must be {self.spec.jnp_dtype} or {self.spec.bits_dtype}"
            )
        rows = np.asarray(rows)
        if rows.shape != ids.shape or not (rows.size == 0 or rows.dtype.kind in "iu"):
            raise ValueError(
                f"rows must be {ids.size} integers, got shape {rows.shape} dtype {rows.dtype}"
            )
        if rows.size and (rows.min() < 0 or rows.max() >= pages.shape[0]):
            raise ValueError(
                f"rows must be in [0, {pages.shape[0]}), got [{rows.min()}, {rows.max()}]"
            )
        src = pages.view(self.spec.bits_dtype)
        for start, count, staged in self._staging_chunks(ids.size):
            # page by page: np.take would first copy the whole of a non-contiguous ``pages``
            # (measured: 14.6 ms for 64 of 256 pages of an entry-rows view), fancy indexing
            # would make a temporary of the chunk
            for i, row in enumerate(rows[start : start + count].tolist()):
                staged[i] = src[row]
            self._write_staged(ids[start : start + count], staged)

    def _staging_chunks(self, n: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """``(start, count, staged)`` per chunk: a fresh page-major buffer of the chunk's stage
        size (padding rows are never read: the plan pads with its last pair). Fresh each time:
        on CPU ``device_put`` may alias it."""
        for start, count, size in stage_chunks(n):
            yield (
                start,
                count,
                np.empty(self.local_spec.page_major_shape(size), self.spec.bits_dtype),
            )

    def _write_staged(self, ids: np.ndarray, staged: np.ndarray) -> None:
        """Copy the first ``ids.size`` pages of a page-major staged chunk to ``ids``."""
        # Staged in device memory even when the buffer is pinned_host: a device computation
        # can move chunks device -> host, not update host memory from host memory.
        src = from_local(
            staged,
            self.device_sharding,  # several processes: our heads
            self.spec.page_major_shape(staged.shape[0]),
        )
        self.run(self._write_fn, src, copy_plan(ids, np.arange(ids.size, dtype=np.int32)))

    def read(self, host_ids: Any) -> KVHost:
        """Return the KV bits of ``host_ids``: a new ``spec.kv_shape(n)`` numpy array.

        Blocks until every update of those pages dispatched before has landed.
        """
        return self.read_async(host_ids).result()

    def read_async(self, host_ids: Any) -> HostRead:
        """Dispatch a copy of the pages ``host_ids`` out of the buffer and return at once.

        The copy is ordered after every update dispatched before it and before every later one
        (XLA data dependencies), so the pages may be freed and reused right after this call:
        the :class:`HostRead` still yields their current content.

        Raises:
            TypeError / ValueError: bad ids (before dispatch).
        """
        ids = self.validate_ids(host_ids)
        dev_put = None if self.on_device_memory else self.device_sharding
        chunks = [
            (
                start,
                count,
                staged_read_fn(self.spec, self.layout, size, self.device_sharding, dev_put)(
                    self.buffer,
                    copy_plan(np.arange(count, dtype=np.int32), ids[start : start + count]),
                )[0],
            )
            for start, count, size in stage_chunks(ids.size)
        ]
        return HostRead(self.spec, ids.size, chunks)


# The buffer's two copy programs with their static arguments bound, one place for the pool and
# for tools that lower them for a platform without its device (lowering/checks.py).
def staged_write_fn(
    spec: KVSpec, layout: HostLayout, host_put: jax.sharding.Sharding | None
) -> Callable:
    """``fn(buffer, staged, plan) -> (buffer, token)``: page-major staged chunk (device memory)
    into the buffer (donated); ``host_put`` is the buffer's sharding when it is in another
    memory space than the chunk (pinned_host), else None."""
    return copy_fn(
        dst_layout=layout,
        src_layout=HostLayout.PAGE_FIRST,
        num_layers=spec.num_layers,
        dst_put=host_put,
    )


def staged_read_fn(
    spec: KVSpec,
    layout: HostLayout,
    size: int,
    device_sharding: jax.sharding.Sharding,
    dev_put: jax.sharding.Sharding | None,
) -> Callable:
    """``fn(buffer, plan) -> (pages, token)``: pages of the buffer into a new device array of
    ``size`` pages (``STAGE_SIZES``); ``dev_put`` is ``device_sharding`` when the buffer is in
    another memory space, else None."""
    return functools.partial(
        gather_pages,
        size=size,
        out_sharding=device_sharding,
        src_layout=layout,
        num_layers=spec.num_layers,
        src_put=dev_put,
        dst_put=None,
    )
