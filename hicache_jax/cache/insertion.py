"""Caching a request's pages in the tree (:meth:`HiCache.insert`, :meth:`HiCache.insert_locked`).

One owner of the insert path: the caller's pages are checked against the ownership map, the tree
inserts them, pages at positions the tree already held are freed, the rest become the tree's,
the new nodes are announced on the device medium, and the write policy sees the result (it may
start backups). Pure bookkeeping (no jax); the cache's thread only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from hicache_jax.cache.ownership import ALLOCATED, DevicePageOwners
from hicache_jax.cache.windows import Windows
from hicache_jax.events.recorder import NullRecorder, Recorder
from hicache_jax.events.records import Medium
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.tree.node import InsertResult
from hicache_jax.tree.radix import RadixTree
from hicache_jax.validation import check_bool, check_int, page_tokens

__all__ = ["Insertion"]


class Insertion:
    """The insert path over the tree, the device allocator, the ownership map and the events.

    Args:
        validate_ids: the device pool's ``validate_ids(pages, name) -> ids``.
        after_insert: the write policy's ``after_insert(result, chunked, callers_lock)``.
        caller_locks: the facade's map of caller-held locks (read only: whether any is held;
            the write policy defers on it).
        windows: the window groups' rules (None without window groups): the tree's pages
            take a duplicate's window pages they lack, and each inserted node keeps only the
            window pages a continuation at its end reads.
        copy_to_host: ``(device_ids, host_ids)``: copy those device pages over their node's
            host copy (the transfer engine's backup, tracked by it): a backed-up node whose
            device page took a window page or checkpoint its host copy lacks.
    """

    def __init__(
        self,
        page_size: int,
        tree: RadixTree,
        device: PageAllocator,
        owner: DevicePageOwners,
        events: NullRecorder | Recorder,
        counters: collections.Counter[str],
        validate_ids: Callable[[Any, str], np.ndarray],
        after_insert: Callable[[InsertResult, bool, bool], None],
        caller_locks: dict,
        windows: Windows | None = None,
        copy_to_host: Callable[[np.ndarray, np.ndarray], Any] | None = None,
    ) -> None:
        self._ps, self._tree, self._device, self._owner = page_size, tree, device, owner
        self._copy_to_host = copy_to_host
        self._events, self._n = events, counters
        self._validate, self._after_insert = validate_ids, after_insert
        self._caller_locks = caller_locks
        self._windows = windows

    def __call__(
        self, tokens: Any, pages: Any, extra_key: Hashable, chunked: bool, priority: int
    ) -> tuple[InsertResult, np.ndarray]:
        """The tree's InsertResult and the whole-page tokens inserted; every check before any
        change (TypeError / ValueError / HiCacheError)."""
        check_bool("chunked", chunked)
        check_int("priority", priority, -(2**62), 2**62)
        arr = page_tokens(tokens, extra_key, self._ps)
        ntok = arr.shape[0]
        ids = self._owner.check(self._validate(pages, "pages"), ALLOCATED, "caller-owned or cached")
        if ids.size != ntok // self._ps:
            raise ValueError(
                f"pages has {ids.size} ids, expected {ntok // self._ps} "
                "(one per whole page of tokens)"
            )
        # No polling here: the tree's own checks below must see the state the caller saw.
        res = self._tree.insert(
            arr, ids, extra_key, priority=int(priority), validated=True, chunked=bool(chunked)
        )
        dup = res.duplicate_pages
        if self._windows is not None:  # what the tree keeps of each window group
            held = self._events.group_snapshot(res)  # announced: what the trim changes
            taken = self._windows.before_free_duplicates(res, ids)
            self._n["window_pages_trimmed"] += self._windows.after_insert(res)
            stale_d, stale_h = self._windows.stale_host_copies(res, taken)
            if stale_d.size and self._copy_to_host is not None:
                self._copy_to_host(stale_d, stale_h)
                self._n["window_host_pages_patched"] += int(stale_d.size)
            self._events.group_changes(held)  # (the host pages' gains announced too)
        if dup.size:
            self._device.free(dup)
            self._owner.release(dup)
            self._n["duplicate_pages_freed"] += dup.size
        self._owner.adopt_caller_pages(ids)
        for node in res.revived_nodes:
            self._events.stored(node, Medium.DEVICE)
        if res.last_node.parent is not None and res.last_node not in res.existing_nodes:
            self._events.stored(res.last_node, Medium.DEVICE)
        self._after_insert(res, bool(chunked), bool(self._caller_locks))
        return res, arr
