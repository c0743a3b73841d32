"""Evictor: the eviction rounds of a HiCache and its one evict-and-retry path.

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
* **evict_host(num_tokens)** deletes host-only unlocked leaves (a load's nodes are locked until
  it lands); host pages a backup still writes are parked until it lands
  (:meth:`InFlight.free_host`), and a host allocation that needs them waits for it. (Under
  clean_ahead the write policy first gives up redundant host copies:
  :mod:`hicache_jax.cache.write_policy`.)

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.errors import OutOfPagesError
from hicache_jax.events.recorder import NullRecorder, Recorder
from hicache_jax.events.records import Medium
from hicache_jax.tree.eviction import VictimHeap
from hicache_jax.cache.inflight import InFlight
from hicache_jax.cache.ownership import DevicePageOwners
from hicache_jax.tree.radix import RadixTree
from hicache_jax.spec import HiCacheConfig
from hicache_jax.tree.node import TreeNode


@dataclass(frozen=True)
class Tier:
    """What the single evict-and-retry path (:meth:`Evictor.take`) needs of one tier."""

    allocator: PageAllocator
    evict: Callable[[int], int]          # tokens -> tokens freed
    evictable_pages: Callable[[], int]   # upper bound of pages eviction could free
    wait_helps: bool                     # finishing loads in flight can free more (their locks)


class Evictor:
    """Frees pages of one cache's tiers (see the module docstring).

    Args:
        cfg, tree, owners, events, counters, flight: the cache's parts.
        device_allocator, host_allocator: the pools' allocators.
        write: the cache's write policy (claims backups on eviction, frees host room).
        l3: the cache's L3 tier (puts host pages before they are freed, write_back).
        complete: the cache's completion of transfers in flight (``upto`` a handle, ``wait``).
    """

    def __init__(self, cfg: HiCacheConfig, tree: RadixTree, device_allocator: PageAllocator,
                 host_allocator: PageAllocator, owners: DevicePageOwners,
                 events: NullRecorder | Recorder, counters: collections.Counter,
                 flight: InFlight, write: Any, l3: Any,
                 complete: Callable[..., None]) -> None:
        self.cfg, self._tree, self._ps = cfg, tree, tree.page_size
        self._owner, self._events, self._n = owners, events, counters
        self._flight, self._write, self._l3 = flight, write, l3
        self._device_free, self._host_free = device_allocator.free, flight.free_host
        self._complete = complete
        self.device = Tier(device_allocator, self.evict_device,
                           lambda: tree.evictable_device_tokens // self._ps, True)
        # Host eviction frees exactly the unlocked host-only nodes (and, under clean_ahead,
        # redundant host copies), and parked pages come free when their copies land, so a host
        # page request that cannot be met fails before deleting anything.
        self.host = Tier(host_allocator, write.evict_host,
                         lambda: write.host_evictable_pages() + flight.num_parked, False)

    def take(self, tier: Tier, n: int) -> np.ndarray:
        """The one evict-and-retry path: free pages, else evict the shortfall once, else raise.

        Raises before evicting anything when even full eviction could not cover ``n``.
        """
        alloc = tier.allocator
        if n <= alloc.num_free:  # the common case: no eviction bound to compute
            return self._granted(tier, alloc.alloc(n))
        if tier.wait_helps and len(self._flight) and n > alloc.num_free + tier.evictable_pages():
            self._complete(upto=None, wait=True)  # loads in flight hold locks; acks release them
        short = n - alloc.num_free
        if short > 0 and short <= tier.evictable_pages():
            tier.evict(short * self._ps)
        if n > alloc.num_free and tier is self.host and self._flight.num_parked:
            self._complete(upto=None, wait=True)  # host pages parked under copies in flight
        if n > alloc.num_free:
            evictable = tier.evictable_pages()
            raise OutOfPagesError(
                f"{alloc.name} pool: {n} pages needed, {alloc.num_free} free, {evictable} "
                "evictable: unlock finished requests or free caller pages",
                needed=n, free=alloc.num_free, evictable=evictable,
                locked=alloc.num_used - evictable)
        return self._granted(tier, alloc.alloc(n))

    def _granted(self, tier: Tier, ids: np.ndarray) -> np.ndarray:
        """The auto clean_ahead reserve follows the largest device allocation that succeeded
        (one that raised leaves the cache as it was)."""
        if tier is self.device:
            self._write.granted(ids.size)
        return ids

    def evict_device(self, num_tokens: int) -> int:
        """Evict rounds until ``num_tokens`` are freed or a round frees nothing."""
        freed = 0
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
            parent = node.parent
            if node.backed_up:
                freed += self._drop_device(node)
            elif self._write.backup_on_evict and (claim := self._write.claim(node)) is not None:
                claims.append(claim)  # copied below in one transfer, freed once dispatched
                promised += node.num_tokens
                continue
            else:  # no host copy and none to be had: the node goes, with any host-only
                freed += self._delete_subtree(node)  # children (none can be locked)
            if parent in tree.evictable_device:
                heap.push(parent)
        if claims:  # a copy on the allocation path: counted, a policy should make it rare
            self._n["eviction_backup_pages"] += sum(node.num_pages for node, _ in claims)
            self._flight.dispatch_backups(claims)  # backed up from here on: nothing to wait for
            for node, _ in claims:
                freed += self._drop_device(node)
        return freed

    def evict_host_leaves(self, num_tokens: int) -> int:
        tree = self._tree
        heap = VictimHeap(self.cfg.eviction, tree.evictable_host)
        freed = 0
        while freed < num_tokens and heap:
            node = heap.pop()
            if node not in tree.evictable_host:
                continue
            parent = node.parent
            freed += self._delete(node)
            if parent in tree.evictable_host:
                heap.push(parent)
        return freed

    def _drop_device(self, node: TreeNode) -> int:
        """Free a backed-up node's device pages; it stays as a host-only node."""
        ids = self._tree.evict_device(node)
        self._device_free(ids)
        self._owner.release(ids)
        self._events.removed(node, Medium.DEVICE)
        self._n["evictions"] += 1
        self._n["evicted_tokens"] += node.num_tokens
        return node.num_tokens

    def _delete_subtree(self, node: TreeNode) -> int:
        """Delete ``node`` (an unlocked device leaf) after its descendants, all host-only and
        unlocked (a lock below it would lock it): children first, so each is a leaf when
        deleted. Returns the device tokens freed (``node``'s)."""
        stack, order = list(node.children.values()), []
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(child.children.values())
        for child in reversed(order):  # every node after all of its descendants
            self._delete(child)
        return self._delete(node)

    def _delete(self, node: TreeNode) -> int:
        """Delete a leaf from the tree, freeing its pages on both tiers; returns its tokens."""
        value, host_value = self._tree.delete_leaf(node)
        if value is not None:
            self._device_free(value)
            self._owner.release(value)
            self._events.removed(node, Medium.DEVICE)
            self._n["evictions"] += 1
            self._n["evicted_tokens"] += node.num_tokens
            self._n["deleted_tokens"] += node.num_tokens
        if host_value is not None:
            if value is None:
                self._l3.on_host_evict(node, host_value)  # write_back: to L3 before the free
            self._host_free(host_value)
            self._events.removed(node, Medium.HOST)
            if value is None:
                self._n["host_evictions"] += 1
                self._n["host_evicted_tokens"] += node.num_tokens
        return node.num_tokens


    def take_host(self, n: int) -> np.ndarray:
        return self.take(self.host, n)
