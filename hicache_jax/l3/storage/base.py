"""Shared machinery of the L3 backends: host page views, handles, the two I/O lanes, counters.

Threads: each backend owns two worker threads, a *get* lane and a *put* lane, so a long
write-through never delays a prefetch. ``wait()`` without a timeout on a handle not started yet
runs it on the waiting thread instead (same lane lock, same buffers), saving two thread switches
on a busy machine. Workers touch only host numpy memory (the numpy page
buffer the backend was opened on, and the backend's own staging/header buffers), never a JAX
array. The caller (the cache's thread) must not free or reuse the host pages of a request until
its handle is ``done()``: a get writes into them, a put reads them. Counters are guarded by a lock.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.l3.storage.format import HEADER_BYTES, EntryCodec, check_keys
from hicache_jax.spec import HostLayout, KVSpec
from hicache_jax.validation import check_ids_in_range, is_int


class StorageError(HiCacheError):
    """Misuse of a storage backend (closed backend, bad host buffer)."""


class StorageUnavailableError(StorageError):
    """The L3 store cannot be reached or set up; the message names the address."""


#: Storage-only buffer layout: one row per page of ``HEADER_BYTES + page_bytes`` bytes, the
#: entry header slot followed by the page in page_first order -- exactly an L3 entry, so a
#: backend moves each page to or from the store in place (no staging copy) and checks it there.
#: Build one with :func:`entry_rows`; :func:`entry_pages` is its bits view for the cache.
ENTRY_ROWS = "entry_rows"


def entry_rows(spec: KVSpec, num_pages: int) -> np.ndarray:
    """A zeroed ``uint8[num_pages, HEADER_BYTES + page_bytes]`` buffer in the ``entry_rows``
    layout (the header slots belong to the backend opened on it)."""
    if not is_int(num_pages) or num_pages < 1:
        raise ValueError(f"num_pages={num_pages!r} must be an int >= 1")
    return np.zeros((int(num_pages), HEADER_BYTES + spec.page_bytes), np.uint8)


def entry_pages(spec: KVSpec, rows: np.ndarray) -> np.ndarray:
    """Writeable bits view ``[P, L, kvf, ps, H, D]`` (page_first order) of the pages in an
    ``entry_rows`` buffer: what the cache reads and writes; headers are not part of it."""
    HostPages(spec, rows, ENTRY_ROWS)  # validates
    page = rows[:, HEADER_BYTES:].view(spec.bits_dtype)
    return page.reshape(spec.page_major_shape(rows.shape[0]))


class HostPages:
    """Views of single pages of a numpy page buffer, in page_first byte order.

    Args:
        spec: KV spec.
        buffer: numpy array, C-contiguous. A host-pool layout (bits dtype):
            ``(P, L, kvf, ps, H, D)`` for page_first, ``(L, kvf, P, ps, H, D)`` for
            layer_first; or ``ENTRY_ROWS``: ``uint8 (P, HEADER_BYTES + page_bytes)`` (see
            :func:`entry_rows`). Borrowed, never reallocated.
        layout: ``HostLayout`` (or its name) or ``ENTRY_ROWS``.
    """

    def __init__(self, spec: KVSpec, buffer: np.ndarray, layout: HostLayout | str) -> None:
        self.entries = layout == ENTRY_ROWS
        if not self.entries:
            try:
                layout = HostLayout(layout)
            except ValueError:
                raise ValueError(
                    f"layout={layout!r} is not one of: "
                    f"{', '.join(m.value for m in HostLayout)}, {ENTRY_ROWS}"
                ) from None
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"host_buffer must be a numpy array, got {type(buffer).__name__}")
        dtype = np.dtype(np.uint8) if self.entries else spec.bits_dtype
        if buffer.dtype != dtype:
            raise ValueError(
                f"host_buffer.dtype={buffer.dtype} must be {dtype} for layout {layout}"
            )
        if not buffer.flags.c_contiguous or not buffer.flags.writeable:
            raise ValueError("host_buffer must be C-contiguous and writeable")
        tail = (spec.page_size, spec.num_kv_heads, spec.head_dim)
        if self.entries:
            ok = buffer.ndim == 2 and buffer.shape[1] == HEADER_BYTES + spec.page_bytes
            num_pages = buffer.shape[0] if buffer.ndim == 2 else 0
            expected = f"(pages, {HEADER_BYTES + spec.page_bytes}) rows of header + page"
        elif layout is HostLayout.PAGE_FIRST:
            ok = buffer.ndim == 6 and buffer.shape[1:] == (spec.num_layers, spec.kv_factor) + tail
            num_pages = buffer.shape[0] if buffer.ndim == 6 else 0
            expected = f"the page_first host layout of {spec}"
        else:
            ok = (
                buffer.ndim == 6
                and buffer.shape[:2] == (spec.num_layers, spec.kv_factor)
                and buffer.shape[3:] == tail
            )
            num_pages = buffer.shape[2] if buffer.ndim == 6 else 0
            expected = f"the layer_first host layout of {spec}"
        if not ok or num_pages < 1:
            raise ValueError(f"host_buffer.shape={buffer.shape} does not match {expected}")
        self.spec, self.buffer, self.layout, self.num_pages = spec, buffer, layout, num_pages
        self.base = buffer.ctypes.data
        self.nbytes = buffer.nbytes
        self._flat = buffer.reshape(-1).view(np.uint8)
        self._chunks = spec.num_layers * spec.kv_factor
        self._row_shape = (self._chunks, spec.chunk_bytes)
        # uint8 views [P, L*kvf, chunk] / [L*kvf, P, chunk]: a page is one basic index
        # (~0.2 us; an as_strided view per page cost ~8 us, 1 ms per 128-page batch)
        if self.entries:
            self.stride = HEADER_BYTES + spec.page_bytes
            self._pages = buffer[:, HEADER_BYTES:].reshape(
                num_pages, self._chunks, spec.chunk_bytes
            )
        elif layout is HostLayout.PAGE_FIRST:
            self.stride = spec.page_bytes
            self._pages = self._flat.reshape(num_pages, self._chunks, spec.chunk_bytes)
        else:
            self.stride = 0
            self._pages = self._flat.reshape(self._chunks, num_pages, spec.chunk_bytes)

    @property
    def contiguous(self) -> bool:
        """Whether one page is one contiguous run of bytes (page_first, entry rows)."""
        return self.stride > 0

    def parts(self, page: int) -> list[np.ndarray]:
        """uint8 views whose concatenation is ``page`` in page_first order (writeable)."""
        view = self._page_view(int(page))
        return [view.reshape(-1)] if self.contiguous else list(view)

    def address(self, page: int) -> int:
        """Address of a page's bytes (contiguous layouts only)."""
        return self.base + int(page) * self.stride + (HEADER_BYTES if self.entries else 0)

    def entry_address(self, page: int) -> int:
        """Address of a page's entry row, header slot first (``ENTRY_ROWS`` only)."""
        if not self.entries:
            raise StorageError(f"a {self.layout} buffer has no entry rows")
        return self.base + int(page) * self.stride

    def header(self, page: int) -> np.ndarray:
        """The header slot of a page's entry row, uint8 ``[HEADER_BYTES]`` (``ENTRY_ROWS`` only)."""
        if not self.entries:
            raise StorageError(f"a {self.layout} buffer has no header slots")
        return self.buffer[int(page), :HEADER_BYTES]

    def read_page(self, page: int, out: np.ndarray) -> None:
        """Copy host page ``page`` into ``out`` (uint8 ``[page_bytes]``) in page_first order: one
        memcpy-like copy, no temporaries."""
        np.copyto(out.reshape(self._row_shape), self._page_view(int(page)))

    def write_page(self, page: int, row: np.ndarray) -> None:
        """Copy a page_first ``row`` (uint8 ``[page_bytes]``) into host page ``page``."""
        np.copyto(self._page_view(int(page)), row.reshape(self._row_shape))

    def _page_view(self, page: int) -> np.ndarray:
        """uint8 view ``[L * kvf, chunk_bytes]`` of one page (strided for layer_first)."""
        return self._pages[page] if self.contiguous else self._pages[:, page]


class StorageHandle:
    """One batched get or put in flight.

    ``ok`` (after ``done()``) is a bool mask over the keys: for a get, page i landed in host page
    ``host_ids[i]`` and passed the header check; for a put, page i is in the store (stored now or
    already there). Pages are processed in sub-batches in key order; ``landed()`` is the mask so
    far, so a best-effort reader can use a prefix early.
    """

    def __init__(self, kind: str, keys: tuple[str, ...], host_ids: np.ndarray, page_bytes: int):
        self.kind = kind
        self.keys = keys
        self.host_ids = host_ids
        self.nbytes = len(keys) * page_bytes
        self.seconds: float | None = None
        self._ok = np.zeros(len(keys), dtype=bool)
        self._event = threading.Event()
        self._cancelled = False
        self._claimed = False
        self._claim_lock = threading.Lock()
        self._inline: Any = None  # backend callback that runs this handle in the caller
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until done (or ``timeout`` seconds: ``TimeoutError``); returns ``ok``.

        Without a timeout, a handle its worker has not started yet is run by the waiting thread
        itself (when its lane is free): the result is the same, minus two thread switches.
        """
        if timeout is None and self._inline is not None and not self._event.is_set():
            self._inline(self)
        if not self._event.wait(timeout):
            raise TimeoutError(
                f"storage {self.kind} of {len(self.keys)} pages not done after {timeout} s"
            )
        if self._error is not None:
            raise StorageError(f"storage {self.kind} worker failed") from self._error
        return self._ok.copy()

    @property
    def ok(self) -> np.ndarray:
        if not self.done():
            raise StorageError(f"storage {self.kind} still in flight; wait() or poll done()")
        return self.wait(0)

    def landed(self) -> np.ndarray:
        """Snapshot of the pages completed and verified so far (bool mask)."""
        return self._ok.copy()

    def cancel(self) -> None:
        """Skip the sub-batches not started yet (their pages stay ``False``)."""
        self._cancelled = True

    def _claim(self) -> bool:
        """True for the one thread (worker or waiter) that gets to run this handle."""
        with self._claim_lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self.seconds = time.perf_counter() - self._t0
        self._event.set()


class BackendBase:
    """Validation, lanes, sub-batching and counters shared by the backends.

    Subclasses implement ``_exists(keys) -> bool mask``, ``_get(keys, ids) -> ok mask`` and
    ``_put(keys, ids) -> ok mask`` (run on the lanes, never raise for I/O failures: they count
    them and return False) and ``_close()``; or override ``_run(handle)`` to schedule a
    handle's sub-batches themselves (the Mooncake backend pipelines them).
    """

    url: str

    def __init__(
        self,
        spec: KVSpec,
        host_buffer: np.ndarray,
        layout: HostLayout | str,
        *,
        batch_pages: int = 32,
        checksum: str = "auto",
    ) -> None:
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        if not is_int(batch_pages) or batch_pages < 1:
            raise ValueError(f"batch_pages={batch_pages!r} must be an int >= 1")
        self.spec = spec
        self.host = HostPages(spec, host_buffer, layout)
        self.codec = EntryCodec(spec, checksum)
        self.batch_pages = batch_pages
        self._lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self._lanes = {
            kind: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"hicache-l3-{kind}")
            for kind in ("get", "put")
        }
        # held while a handle runs, by the lane's worker or by a waiter running it inline:
        # a lane's buffers serve one handle at a time
        self._lane_locks = {kind: threading.Lock() for kind in ("get", "put")}
        self._closed = False

    # ---- public protocol -------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> np.ndarray:
        """Bool mask: which keys the store holds now (a later get may still miss)."""
        keys = self._check_open_keys(keys)
        if not keys:
            return np.zeros(0, dtype=bool)
        return np.asarray(self._exists(keys), dtype=bool)

    def get_into(self, keys: Sequence[str], host_ids: Any) -> StorageHandle:
        """Start reading ``keys`` into host pages ``host_ids`` (one each); returns a handle."""
        return self._submit("get", keys, host_ids)

    def put_from(self, keys: Sequence[str], host_ids: Any) -> StorageHandle:
        """Start storing host pages ``host_ids`` under ``keys``; returns a handle.

        Keys are write-once: a key already present is left as is and counts as stored.
        """
        return self._submit("put", keys, host_ids)

    def stats(self) -> dict[str, int]:
        """Counters: pages got/missed/corrupt, puts stored/dropped, bytes, backend errors
        (a backend's docstring says where its counts differ, e.g. Mooncake's write-once puts)."""
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        """Wait for work in flight, then release the backend. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes.values():
            lane.shutdown(wait=True)
        self._close()

    def __enter__(self) -> BackendBase:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- helpers ---------------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                if value:
                    self._counters[name] += value

    def _check_open_keys(self, keys: Sequence[str]) -> tuple[str, ...]:
        if self._closed:
            raise StorageError(f"storage backend {self.url} is closed")
        return check_keys(keys)

    def _submit(self, kind: str, keys: Sequence[str], host_ids: Any) -> StorageHandle:
        keys = self._check_open_keys(keys)
        ids = check_ids_in_range(host_ids, len(keys), self.host.num_pages)
        handle = StorageHandle(kind, keys, ids, self.spec.page_bytes)
        if not keys:
            handle._finish()
            return handle
        handle._inline = self._run_claimed
        self._lanes[kind].submit(self._run_claimed, handle)
        return handle

    def _run_claimed(self, handle: StorageHandle) -> None:
        if handle._claim():
            with self._lane_locks[handle.kind]:
                self._run(handle)

    def _run(self, handle: StorageHandle) -> None:
        """Runs on the lane: the handle's sub-batches in key order (a backend may override)."""
        fn = self._get if handle.kind == "get" else self._put
        error = None
        try:
            for start in range(0, len(handle.keys), self.batch_pages):
                if handle._cancelled:
                    break
                stop = start + self.batch_pages
                ok = np.asarray(
                    fn(handle.keys[start:stop], handle.host_ids[start:stop]), dtype=bool
                )
                handle._ok[start:stop] = ok
        except BaseException as e:  # a bug, not an I/O failure: surfaced by wait()
            error = e
        finally:
            handle._finish(error)

    def _exists(self, keys: tuple[str, ...]) -> np.ndarray:
        raise NotImplementedError

    def _get(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _put(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError
