"""Evictor: the device eviction rounds of a HiCache, and its device pages taken through the one
evict-and-retry path (:mod:`~hicache_jax.cache.page_take`).

* **evict(num_tokens)** pops the least valuable device leaves: backed up -> free the device
  pages, keep the node host-only; not backed up -> delete it (write-through modes) or back it up
  first (write-back: one transfer for the round's nodes) and free its device pages as soon as
  the copy is dispatched (XLA orders the pages' next writes after the copy's read). Unlike
  SGLang, a write-back leaf whose backup finds no host room even after ``evict_host`` is
  deleted (its KV is lost, counted in ``deleted_tokens``) rather than kept, and so is a
  not-backed-up leaf with host-only children (their host copies go with it, to L3 first under
  ``storage_write_policy="write_back"``): every unlocked device page can be freed, so
  ``alloc_pages``' pre-check (unlocked device pages) is exact and it raises before evicting
  anything or not at all.
* **evict_host(num_tokens)** deletes unlocked host-only leaves
  (:meth:`~hicache_jax.cache.removal.Removal.evict_host_leaves`; a load's nodes are locked until
  it lands). The host room that backups and prefetches take is the write policy's
  (:meth:`~hicache_jax.cache.write_policy.WriteStrategy.take_host`: under clean_ahead,
  redundant host copies go first).

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections

import numpy as np

from hicache_jax.cache.completion import Completion
from hicache_jax.cache.inflight import InFlight
from hicache_jax.cache.page_take import Tier, take_pages
from hicache_jax.cache.removal import CutOk, Removal
from hicache_jax.cache.write_policy import WriteStrategy
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.spec import HiCacheConfig
from hicache_jax.tree.eviction import VictimHeap
from hicache_jax.tree.radix import RadixTree


class Evictor:
    """Frees device pages of one cache (see the module docstring).

    Args:
        cfg, tree, counters, flight: the cache's parts.
        device_allocator: the device pool's allocator.
        write: the cache's write policy (claims backups on eviction; follows allocation sizes).
        removal: frees the pages of the nodes a round takes.
        complete: applies finished transfers (the evict-and-retry path waits on copies in
            flight when their locks hold the pages it needs).
        cut_ok: with window groups, whether cutting a node's last pages leaves its head
            servable (``Windows.cut_keeps_servable``); where not, the whole node goes.
    """

    def __init__(
        self,
        cfg: HiCacheConfig,
        tree: RadixTree,
        device_allocator: PageAllocator,
        counters: collections.Counter,
        flight: InFlight,
        write: WriteStrategy,
        removal: Removal,
        complete: Completion,
        cut_ok: CutOk | None = None,
    ) -> None:
        self.cfg, self._tree, self._ps, self._n = cfg, tree, tree.page_size, counters
        self._flight, self._write, self._removal, self._complete = flight, write, removal, complete
        self._cut_ok = cut_ok
        self._tier = Tier(
            device_allocator,
            self.evict_device,
            lambda: tree.evictable_device_tokens // self._ps,
            True,
        )

    def take(self, n: int) -> np.ndarray:
        """``n`` device pages (int32 ids), evicting as needed, else ``OutOfPagesError`` before
        evicting anything. The auto clean_ahead reserve follows the largest allocation that
        succeeded (one that raised leaves the cache as it was)."""
        ids = take_pages(self._tier, n, self._ps, self._flight, self._complete)
        self._write.granted(ids.size)
        return ids

    def evict_device(self, num_tokens: int) -> int:
        """Evict rounds until ``num_tokens`` are freed or a round frees nothing. The device
        pages freed go back in one call at the end (``PageAllocator.deferring``: nothing
        allocates device pages meanwhile)."""
        freed = 0
        with self._tier.allocator.deferring():
            while freed < num_tokens:
                got = self._round(num_tokens - freed)
                if got == 0:
                    break
                freed += got
        return freed

    def _round(self, num_tokens: int) -> int:
        """One pass over the evictable leaves (see the module doc). Write-back nodes are backed up
        in the pass (one transfer for all of them) and freed at its end, once dispatched; their
        parents wait for the next round, as in SGLang."""
        tree = self._tree
        heap = VictimHeap(self.cfg.eviction, tree.evictable_device)
        freed, promised, claims = 0, 0, []
        while freed + promised < num_tokens and heap:
            node = heap.pop()
            if node not in tree.evictable_device:
                continue  # stale heap entry: locked, evicted or deleted meanwhile
            if self._write.page_granular:  # only the pages asked for: the head stays cached
                want = -(-(num_tokens - freed - promised) // self._ps)
                if (
                    want < node.num_pages
                    and not node.host_pins
                    and (self._cut_ok is None or self._cut_ok(node, want, True))
                ):
                    tree.trim_tail(node, want)
            parent = node.parent
            if node.backed_up:
                freed += self._removal.drop_device(node)
            elif self._write.backup_on_evict and (claim := self._write.claim(node)) is not None:
                claims.append(claim)  # copied below in one transfer, freed once dispatched
                promised += node.num_tokens
                continue
            else:  # no host copy and none to be had: the node goes, with any host-only
                freed += self._removal.delete_subtree(node)  # children (none can be locked)
            if parent in tree.evictable_device:
                heap.push(parent)
        if claims:  # a copy on the allocation path: counted, a policy should make it rare
            self._n["eviction_backup_pages"] += sum(node.num_pages for node, _ in claims)
            self._flight.dispatch_backups(claims)  # backed up from here on: nothing to wait for
            for node, _ in claims:
                freed += self._removal.drop_device(node)
        return freed
