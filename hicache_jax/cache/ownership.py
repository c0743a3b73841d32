"""DevicePageOwners: who owns each device page (one int8 per page).

The allocator says whether a page is free or used; this says by whom: every device page is
exactly one of FREE, CALLER (``alloc_pages`` .. ``insert`` / ``free_pages``) or TREE (held by
one tree node). :class:`~hicache_jax.cache.hicache.HiCache` is the only writer; this class is
the one place that rule is written and checked.

Threading: the cache's thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import numpy as np

from hicache_jax.errors import HiCacheError


class PageOwner(enum.IntEnum):
    FREE = 0
    CALLER = 1
    TREE = 2


# The owner codes as numpy scalars of the map's dtype: comparing or filling an int8 array with
# an IntEnum member makes numpy look up array attributes on the enum class (EnumType.__getattr__,
# ~1.5 us a call); an np.int8 costs nothing extra.
_FREE, _CALLER, _TREE = (np.int8(o) for o in (PageOwner.FREE, PageOwner.CALLER, PageOwner.TREE))
# Which owners a call accepts, as owner -> allowed masks (indexing one costs ~10x less than
# np.isin): caller pages only, or caller pages and the tree's.
CALLERS = np.array([False, True, False])
ALLOCATED = np.array([False, True, True])


class DevicePageOwners:
    """The owner of every device page.

    Args:
        num_pages: device pool size.
    """

    def __init__(self, num_pages: int) -> None:
        self._owner = np.zeros(num_pages, np.int8)

    def check(self, ids: np.ndarray, allowed: np.ndarray, what: str) -> np.ndarray:
        """``ids`` (validated int32) if each page's owner is in ``allowed`` (:data:`CALLERS` or
        :data:`ALLOCATED`), else :class:`HiCacheError` naming the first bad pages."""
        ok = allowed[self._owner[ids]]
        if ids.size and not ok.all():
            bad = ids[~ok][:8].tolist()
            free = (
                " (free: a stale Match's pages, evicted since? match again)"
                if (self._owner[bad] == _FREE).any()
                else ""
            )
            raise HiCacheError(f"pages {bad} are not {what}{free}")
        return ids

    def to_caller(self, ids: np.ndarray) -> None:
        self._owner[ids] = _CALLER

    def to_tree(self, ids: np.ndarray) -> None:
        self._owner[ids] = _TREE

    def release(self, ids: np.ndarray) -> None:
        self._owner[ids] = _FREE

    def adopt_caller_pages(self, ids: np.ndarray) -> None:
        """The caller's pages among ``ids`` become the tree's (an insert kept them)."""
        self._owner[ids[self._owner[ids] == _CALLER]] = _TREE

    def num_caller_pages(self) -> int:
        return int((self._owner == _CALLER).sum())

    def owners(self) -> np.ndarray:
        """int8 ``[num_pages]`` copy: :class:`PageOwner` of each page."""
        return self._owner.copy()

    def check_invariants(self, tree_pages: Iterable[np.ndarray], allocated: np.ndarray) -> None:
        """Every device page is free, the caller's, or held by exactly one node.

        Args:
            tree_pages: the device pages of every tree node.
            allocated: bool ``[num_pages]``: the device allocator's used pages.

        Raises:
            HiCacheError: naming the broken rule.
        """
        parts = list(tree_pages)
        held = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        if np.unique(held).size != held.size:
            raise HiCacheError("invariant: a device page is held by two tree nodes")
        want = np.zeros_like(self._owner)
        want[held] = _TREE
        caller = self._owner == _CALLER
        if (caller & (want == _TREE)).any():
            raise HiCacheError("invariant: a caller-owned device page is also held by the tree")
        want[caller] = _CALLER
        if not (want == self._owner).all():
            raise HiCacheError("invariant: the device owner map disagrees with the tree")
        if not (allocated == (want != _FREE)).all():
            raise HiCacheError("invariant: the device allocator disagrees with the page owners")
