"""PageAllocator: a free list over a fixed range of page ids (pure numpy, no jax).

Batched alloc and free cost O(k) for k pages. Every id is exactly one of free / allocated;
freeing an id that is free (double free), out of range (foreign) or repeated within one call
raises ``HiCacheError`` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hicache_jax.errors import HiCacheError, OutOfPagesError
from hicache_jax.validation import as_page_ids, is_int


class PageIdChecker:
    """Validates page ids against a pool of ``num_pages`` on the per-call path, in O(k).

    Both pools call it before every dispatch (ARCHITECTURE.md: validate on the host, before
    dispatch: JAX clamps / drops bad indices silently). Valid ids are 1-D integers in
    ``[0, num_pages)``, distinct.

    Args:
        num_pages: ids allowed are ``0 .. num_pages-1``.
        pool: name used in errors ("device", "host").
    """

    __slots__ = ("num_pages", "pool", "_slot", "_positions")

    def __init__(self, num_pages: int, pool: str) -> None:
        self.num_pages = int(num_pages)
        self.pool = pool
        self._slot = np.zeros(self.num_pages, np.int32)  # scratch of the duplicate check
        self._positions = np.arange(self.num_pages, dtype=np.int32)

    def __call__(self, page_ids, name: str = "page_ids") -> np.ndarray:
        """Return ``page_ids`` as a validated int32 copy.

        Raises:
            TypeError: not integers.
            ValueError: not 1-D, out of range, or repeated.
        """
        ids = self._fast(page_ids)
        if ids is None:
            ids = as_page_ids(page_ids, name)
            if ids.size and ids.max() >= self.num_pages:
                raise ValueError(
                    f"{name} has ids outside the {self.pool} pool "
                    f"[0, {self.num_pages}): max {ids.max()}"
                )
        if ids.size > 1:
            # O(k) duplicate check (np.unique sorts): write each position at its id; with a
            # repeated id the last write wins and an earlier position reads back another value.
            if ids.size > self.num_pages:  # more ids than pages: some must repeat
                raise ValueError(f"{name} has duplicate ids")
            pos = self._positions[: ids.size]
            self._slot[ids] = pos
            if (self._slot[ids] != pos).any():
                raise ValueError(f"{name} has duplicate ids")
        return ids

    def _fast(self, page_ids) -> np.ndarray | None:
        """int32 copy if ``page_ids`` already is a non-empty 1-D integer numpy array in range,
        else None (the full checks then raise the precise error). The common case, in two
        reductions instead of ``as_page_ids``' generic checks plus a third for the range."""
        if (
            type(page_ids) is np.ndarray
            and page_ids.ndim == 1
            and page_ids.size
            and page_ids.dtype.kind in "iu"
            and page_ids.min() >= 0
            and page_ids.max() < self.num_pages
        ):
            return page_ids.astype(np.int32)
        return None


class PageAllocator:
    """Free list of page ids ``0 .. num_pages-1``.

    Args:
        num_pages: ids managed (0 allowed: an empty pool).
        name: used in error messages ("device", "host").
    """

    __slots__ = (
        "num_pages",
        "name",
        "on_free",
        "_stack",
        "_top",
        "_allocated",
        "_slot",
        "_pending",
    )

    def __init__(self, num_pages: int, name: str = "pool") -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages={num_pages} must be >= 0")
        self.num_pages = int(num_pages)
        self.name = name
        #: Called with the ids (validated, int32) before they return to the free list: the
        #: window groups' pages attached to a full-attention page leave with it (memory/window.py).
        self.on_free: Callable[[np.ndarray], None] | None = None
        # Free ids live in _stack[:_top]; popping from the end hands out low ids first.
        self._stack = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)
        self._top = self.num_pages
        self._allocated = np.zeros(self.num_pages, dtype=np.bool_)
        self._slot = np.zeros(self.num_pages, dtype=np.int32)  # scratch of the duplicate check
        self._pending: list[np.ndarray] | None = None  # frees held back by deferring()

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_pages - self._top

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free ids (int32, distinct). Raises ``OutOfPagesError`` if fewer are free."""
        if not is_int(n) or n < 0:
            raise ValueError(f"n={n!r} must be an int >= 0")
        n = int(n)  # a numpy count would make every later count a numpy integer
        if n > self._top:
            raise OutOfPagesError(
                f"{self.name} pool: {n} pages needed, {self._top} free", needed=n, free=self._top
            )
        ids = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._allocated[ids] = True
        return ids

    def check_allocated(self, ids, name: str = "page_ids") -> np.ndarray:
        """Validate that ``ids`` are distinct, in range and currently allocated; return int32
        (``ids`` itself when it already is a 1-D int32 numpy array of ids >= 0: the cache's own
        ids, freed on every eviction, skip the generic conversion and its copy)."""
        if (
            type(ids) is np.ndarray
            and ids.dtype == np.int32
            and ids.ndim == 1
            and ids.size
            and ids.min() >= 0
        ):
            arr = ids
        else:
            arr = as_page_ids(ids, name)
        if arr.size == 0:
            return arr
        if arr.max() >= self.num_pages:
            raise HiCacheError(
                f"{name} has ids outside the {self.name} pool [0, {self.num_pages}): "
                f"max {arr.max()}"
            )
        if arr.size > 1:
            # O(k), no sort: write each position at its id; with a repeated id the last write
            # wins and an earlier position reads back another value.
            pos = np.arange(arr.size, dtype=np.int32)
            self._slot[arr] = pos
            if (self._slot[arr] != pos).any():
                raise HiCacheError(f"{name} has duplicate ids")
        if not self._allocated[arr].all():
            bad = arr[~self._allocated[arr]][:8]
            raise HiCacheError(
                f"{name}: {self.name} pages {bad.tolist()} are not allocated (double free?)"
            )
        return arr

    def free(self, ids, *, validated: bool = False) -> None:
        """Return ``ids`` to the free list; all-or-nothing validation first.

        ``validated``: ``ids`` is an int32 numpy array of distinct in-range ids (a node's
        pages, which its tree keeps distinct): only the allocated check (a double free) runs."""
        if validated:
            arr = ids
            if np.count_nonzero(self._allocated[arr]) != arr.size:  # (cheaper than .all())
                self.check_allocated(arr)  # raises the precise error
        else:
            arr = self.check_allocated(ids)
        if self._pending is not None:  # deferring(): no longer allocated, back at its end
            if arr.size:
                self._allocated[arr] = False
                self._pending.append(arr)
            return
        if self.on_free is not None and arr.size:
            self.on_free(arr)
        k = arr.size
        self._allocated[arr] = False
        self._stack[self._top : self._top + k] = arr[::-1]
        self._top += k

    def deferring(self) -> _Deferral:
        """A context in which :meth:`free` checks its ids and marks them free at once, but
        hands them to ``on_free`` and back to the free list at the context's end, in one
        call: an eviction round frees many nodes' pages, and each ``on_free`` (the window
        groups' detach) costs a few numpy calls whatever its size. The free list ends as the
        frees one by one would leave it (the same ids, in the same order), and no id is handed
        out before the end: use it where nothing allocates from this allocator meanwhile.
        Nested contexts end with the outermost. Without an ``on_free`` there is nothing to
        batch: the frees go back at once."""
        return _Deferral(self)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if not pending:
            return
        # the frees one by one push each call's ids reversed on top of the last: the same
        # stack as one push of the calls' ids, last call first, reversed
        arr = pending[0] if len(pending) == 1 else np.concatenate(pending[::-1])
        if self.on_free is not None:
            self.on_free(arr)
        k = arr.size
        self._stack[self._top : self._top + k] = arr[::-1]
        self._top += k

    def is_allocated(self, ids) -> np.ndarray:
        """Boolean mask: which of ``ids`` (in range) are currently allocated."""
        return self._allocated[np.asarray(ids, dtype=np.int64)]

    def reset(self) -> None:
        """Mark every id free again."""
        self._pending = None
        self._stack[:] = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)
        self._top = self.num_pages
        self._allocated[:] = False


class _Deferral:
    """:meth:`PageAllocator.deferring`'s context."""

    __slots__ = ("_alloc", "_outer")

    def __init__(self, alloc: PageAllocator) -> None:
        self._alloc, self._outer = alloc, False

    def __enter__(self) -> None:
        if self._alloc._pending is None and self._alloc.on_free is not None:
            self._alloc._pending, self._outer = [], True

    def __exit__(self, *exc: object) -> None:
        if self._outer:
            self._alloc._flush()
