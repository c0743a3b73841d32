"""CacheL3Port: the cache's side of the L3 port (:class:`~hicache_jax.l3.port.CachePort`).

The L3 tier reserves host pages, attaches fetched pages and holds locks only through this
object, so the host-page rule -- every host page is free, held by one node, the target of a
copy in flight, or reserved by an L3 prefetch -- is kept on the cache's side: the reservations
are recorded here (:meth:`CacheL3Port.reserved_pages`), and so are the locks the tier holds
(:meth:`CacheL3Port.locked_nodes`), for :meth:`HiCache.check_invariants`. With window groups
the port also gives the tier the groups' host pages (:class:`WindowHostPages`): it reads them
for puts and attaches fetched ones to the host pages the tree holds (ARCHITECTURE.md, "Layer
groups").

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from hicache_jax.errors import HiCacheError, OutOfPagesError
from hicache_jax.events.recorder import NullRecorder, Recorder
from hicache_jax.events.records import Medium
from hicache_jax.memory.group import Group, LocalGroup
from hicache_jax.memory.host_pool import HostPagePool
from hicache_jax.memory.window import WindowPages, read_by_node_end, spare_rank
from hicache_jax.spec import GroupKind, KVSpec
from hicache_jax.tree.node import TreeMatch, TreeNode
from hicache_jax.tree.radix import RadixTree


class HostPageSource(Protocol):
    """Where the port takes host pages: the one evict-and-retry path of the host tier."""

    def take_host(self, n: int) -> np.ndarray:
        """``n`` host page ids, evicting host pages as needed, or ``OutOfPagesError``."""


class FetchedPages:
    """Host pages an L3 prefetch filled (hung in the tree as a host-only leaf or as a device
    node's host copy) that no load-back has served from since: what a request's
    ``Served.l3_tokens`` counts (cache/request.py). A page is untagged when a load-back serves
    from it (:meth:`take`) or when it is taken for other data (a backup, another prefetch), so
    a tag never outlives the data L3 brought in.

    Cheap when unused: every call returns at once while no page is tagged (no L3 tier, or
    nothing fetched since the last load-back).
    """

    def __init__(self, num_pages: int) -> None:
        self._tagged = np.zeros(num_pages, np.bool_)
        #: host pages tagged now
        self.tagged = 0

    def mark(self, host_ids: np.ndarray) -> None:
        """Tag ``host_ids`` (distinct): an L3 prefetch filled them."""
        self.tagged += int(host_ids.size - np.count_nonzero(self._tagged[host_ids]))
        self._tagged[host_ids] = True

    def tagged_in(self, host_ids: np.ndarray) -> int:
        """How many of ``host_ids`` (distinct) are tagged (no change)."""
        return int(np.count_nonzero(self._tagged[host_ids])) if self.tagged else 0

    def take(self, host_ids: np.ndarray) -> int:
        """How many of ``host_ids`` (distinct) are tagged; their tags removed."""
        k = self.tagged_in(host_ids)
        if k:
            self._tagged[host_ids] = False
            self.tagged -= k
        return k

    def clear(self) -> None:
        self._tagged[:] = False
        self.tagged = 0


class WindowHostPages:
    """The window groups' host pages as the L3 tier sees them
    (:class:`~hicache_jax.l3.port.WindowHost`).

    Args:
        host: the host tier's window pages (``memory/window.py``).
        put_spare: put the spare window pages too (``HiCacheConfig.storage_window_spare``):
            True, all of them; an int ``k`` (a power of two), those the ends at multiples of
            ``k`` pages read (their rank, ``cache/windows.py``'s ``window_ranks``, at least
            ``log2 k``); False, none.
    """

    def __init__(self, host: WindowPages, put_spare: bool | int = False) -> None:
        self._host = host
        self.groups = host.groups
        every = 1 if put_spare is True else int(put_spare)  # (False: 0)
        rank = every.bit_length() - 1 if every else None  # the least rank put
        #: per group: the least spare rank put (0: every page), None: node ends' pages only
        self._rank = [0 if g.kind is GroupKind.STATE else rank for g in host.groups]
        self.specs = tuple(p.local_spec for p in host.pools)

    def pages(self, g: int, host_ids: np.ndarray) -> np.ndarray:
        # spare window pages (no node end reads them) are not written to L3 unless asked
        # (``put_spare``). Every checkpoint is (a STATE group's spare ones too): a request
        # diverging inside the node later, in this cache or another on the same store, is
        # served from the deepest one L3 holds, where without them it would recompute from
        # the root (one slot a checkpoint, taken every ``checkpoint_every_pages`` at most)
        w = self._host.attach[g, host_ids]
        rank = self._rank[g]
        if rank == 0:
            return w.astype(np.int32)
        stamps = self._host.spare[g, host_ids]
        put = read_by_node_end(stamps)
        if rank is not None:  # and the spare pages of the ends every 2 ** rank pages
            put |= spare_rank(stamps) >= rank
        return np.where(put, w, -1).astype(np.int32)

    def read_async(self, g: int, group_ids: np.ndarray) -> Any:
        return self._host.pools[g].read_async(group_ids)

    def attach(self, g: int, host_ids: np.ndarray, rows: np.ndarray, row_ids: np.ndarray) -> int:
        if (self._host.attach[g, host_ids] >= 0).any():
            raise HiCacheError(f"host pages already hold a page of window group {g}")
        pool = self._host.pools[g]
        if self._host.room(g) < host_ids.size:
            return 0  # that prefix is not servable from host (the match cuts it back)
        ids = self._host.take(g, host_ids.size)  # (spare pages freed first)
        pool.write_rows(ids, rows, row_ids)
        self._host.attach[g, host_ids] = ids
        if self._host.on_attach is not None:  # KV events (events/groups.py)
            self._host.on_attach(g, host_ids)
        return int(ids.size)


class CacheL3Port:
    """What a HiCache gives its L3 tier.

    Args:
        spec: the cache's KVSpec.
        clock: the cache's clock.
        tree: the cache's tree.
        host: the cache's host pool.
        group: the cache's processes (the tier agrees store results through it).
        windows: the host tier's window pages (a spec with window groups), else None.
        put_spare: put spare window pages to L3 too (``HiCacheConfig.storage_window_spare``:
            a bool, or the spacing in pages of the ends whose spare pages are put).

    The L3 tier needs host pages (which may evict host pages) and host eviction tells the tier
    first (``storage_write_policy="write_back"``), so the two cannot both be given the other at
    construction: the port is built first, the tier with it, the cache's parts with the tier,
    and then :meth:`bind` hands the port the parts' host-page source (again after ``reset()``).
    """

    def __init__(
        self,
        spec: KVSpec,
        clock: Callable[[], float],
        tree: RadixTree,
        host: HostPagePool,
        group: Group | None = None,
        windows: WindowPages | None = None,
        put_spare: bool | int = False,
    ) -> None:
        self.spec, self.clock = spec, clock
        #: the window groups' host pages (None without window groups)
        self.window_host = None if windows is None else WindowHostPages(windows, put_spare)
        self.group = group if group is not None else LocalGroup()
        self._tree, self._host = tree, host
        self.events: NullRecorder | Recorder = NullRecorder()
        self._host_pages: HostPageSource | None = None
        self._rule: Any = None
        self._cost: Any = None
        self._reserved = np.zeros(host.num_pages, np.bool_)
        self._locks: collections.Counter[TreeNode] = collections.Counter()
        #: host pages L3 filled and no load-back served from since (the tier's attaches)
        self.fetched = FetchedPages(host.num_pages)

    def bind(
        self,
        events: NullRecorder | Recorder,
        host_pages: HostPageSource,
        rule: Any = None,
        cost: Any = None,
    ) -> None:
        """The cache's recorder and host-page source (its write policy), once they exist; its
        load rule and cost model (cache/loading/load_policy.py, cache/loading/cost_model.py):
        L3 fetches are decided and measured there."""
        self.events, self._host_pages = events, host_pages
        self._rule, self._cost = rule, cost

    def fetch_pages(self, new_pages: int, covered: int) -> int:
        return self._rule.fetch_pages(new_pages, covered)

    def fetch_decision(self) -> Any:
        return self._rule.fetch_decision()

    def observe_fetch(self, nbytes: int, seconds: float, decision: Any = None) -> None:
        self._cost.observe_transfer("l3_l2", nbytes, max(0.0, seconds))
        if decision is not None:
            self._cost.settle_fetch(decision, nbytes, max(0.0, seconds))

    def reset(self) -> None:
        """The cache forgot everything (the tier's prefetches were flushed first)."""
        self._reserved[:] = False
        self._locks.clear()
        self.fetched.clear()

    # -- the port -----------------------------------------------------------------------------

    def match(self, tokens: np.ndarray, extra_key: Any) -> TreeMatch:
        return self._tree.match(tokens, extra_key)

    def path_tokens(self, node: TreeNode) -> np.ndarray:
        return self._tree.path_tokens(node)

    def lock(self, node: TreeNode) -> None:
        self._tree.lock(node)
        self._locks[node] += 1

    def unlock(self, node: TreeNode) -> None:
        if self._locks[node] <= 0:
            raise HiCacheError(f"L3 unlock of {node!r} without a matching lock")
        self._tree.unlock(node)
        self._locks[node] -= 1
        if not self._locks[node]:
            del self._locks[node]

    def reserve_host_pages(self, n: int) -> np.ndarray:
        source = self._host_pages
        assert source is not None  # bound by the cache before any L3 call
        try:
            ids = source.take_host(n)
        except OutOfPagesError:  # what is free: a prefetch of fewer pages
            alloc = self._host.allocator
            ids = alloc.alloc(min(n, alloc.num_free))
        self._reserved[ids] = True
        self.fetched.take(ids)  # a page freed while tagged: its tag was for other data
        return ids

    def _check_reserved(self, host_ids: np.ndarray) -> None:
        if not self._reserved[host_ids].all():
            bad = host_ids[~self._reserved[host_ids]][:8].tolist()
            raise HiCacheError(f"host pages {bad} are not reserved by L3")

    def release_host_pages(self, host_ids: np.ndarray) -> None:
        self._check_reserved(host_ids)
        self._host.allocator.free(host_ids)
        self._reserved[host_ids] = False

    def write_host_pages(self, host_ids: np.ndarray, rows: np.ndarray, row_ids: np.ndarray) -> None:
        self._check_reserved(host_ids)
        self._host.write_rows(host_ids, rows, row_ids)

    def attach_host_copy(self, node: TreeNode, host_ids: np.ndarray) -> None:
        self._check_reserved(host_ids)
        self._tree.set_host_value(node, host_ids)
        self._reserved[host_ids] = False
        self.fetched.mark(host_ids)
        self.events.stored(node, Medium.HOST)

    def attach_host_leaf(
        self, parent: TreeNode, tokens: np.ndarray, host_ids: np.ndarray, extra_key: Any
    ) -> TreeNode:
        self._check_reserved(host_ids)
        leaf = self._tree.add_host_leaf(parent, tokens, host_ids, extra_key)
        self._reserved[host_ids] = False
        self.fetched.mark(host_ids)
        self.events.stored(leaf, Medium.HOST)
        return leaf

    def read_host_async(self, host_ids: np.ndarray) -> Any:
        return self._host.read_async(host_ids)

    # -- what the cache checks ----------------------------------------------------------------

    def reserved_pages(self) -> np.ndarray:
        """int32 host pages reserved by L3 prefetches now."""
        return np.flatnonzero(self._reserved).astype(np.int32)

    def locked_nodes(self) -> list[tuple[TreeNode, int]]:
        """``(node, locks)`` the L3 tier holds (its prefetches' fetch bases)."""
        return list(self._locks.items())
