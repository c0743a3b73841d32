"""Removal of pages from the tree's nodes, the one place that frees a node's pages on either
tier and records it (events, counters), for the evictor's rounds and the write policies' host
room:

* :meth:`Removal.drop_device` -- a backed-up node gives up its device pages and stays host-only;
* :meth:`Removal.delete` -- a leaf leaves the tree, its pages on both tiers freed (host pages a
  backup still writes are parked until it lands, :meth:`InFlight.free_host`; under
  ``storage_write_policy="write_back"`` host-only pages go to L3 first);
* :meth:`Removal.evict_host_leaves` -- **evict_host**: unlocked host-only leaves, least valuable
  first;
* :meth:`Removal.invalidate` -- a leaf an operator invalidates: its pages on both tiers freed
  and announced, nothing written to L3, counted apart from evictions.

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

from hicache_jax.cache.inflight import InFlight
from hicache_jax.cache.ownership import DevicePageOwners
from hicache_jax.events.recorder import NullRecorder, Recorder
from hicache_jax.events.records import Medium
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.spec import HiCacheConfig
from hicache_jax.tree.eviction import VictimHeap
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree

#: ``(node, tail_pages, on_device) -> bool``: may eviction cut the node's last pages only?
CutOk = Callable[[TreeNode, int, bool], bool]


class Removal:
    """Frees nodes' pages (see the module docstring).

    Args:
        cfg, tree, owners, events, counters, flight: the cache's parts.
        device_allocator: the device pool's allocator.
        l3: the cache's L3 tier (``on_host_evict``: puts host-only pages before they are freed).
        cut_ok: with window groups, whether cutting a node's last pages leaves its head
            servable (``Windows.cut_keeps_servable``); where not, the whole node goes.
    """

    def __init__(
        self,
        cfg: HiCacheConfig,
        tree: RadixTree,
        device_allocator: PageAllocator,
        owners: DevicePageOwners,
        events: NullRecorder | Recorder,
        counters: collections.Counter,
        flight: InFlight,
        l3: Any,
        cut_ok: CutOk | None = None,
    ) -> None:
        self.cfg, self._tree = cfg, tree
        self._cut_ok = cut_ok
        self._owner, self._events, self._n, self._l3 = owners, events, counters, l3
        # a node's pages (its tree keeps them distinct, int32): only the double-free check
        self._device_free = functools.partial(device_allocator.free, validated=True)
        self._host_free = flight.free_host
        self._host_deferring = flight.host_allocator.deferring

    def evict_host_leaves(self, num_tokens: int, page_granular: bool = False) -> int:
        """Delete unlocked host-only leaves, least valuable first (a parent that becomes such a
        leaf joins the same round), until ``num_tokens`` are freed; returns tokens freed.
        ``page_granular``: of the last leaf, only the tail pages still needed go."""
        tree, ps = self._tree, self._tree.page_size
        heap = VictimHeap(self.cfg.eviction, tree.evictable_host)
        freed = 0
        with self._host_deferring():  # the round's host pages back in one call at its end
            while freed < num_tokens and heap:
                node = heap.pop()
                if node not in tree.evictable_host:
                    continue
                want = -(-(num_tokens - freed) // ps)
                if (
                    page_granular
                    and want < node.num_pages
                    and not node.host_pins
                    and (self._cut_ok is None or self._cut_ok(node, want, False))
                ):
                    tree.trim_tail(node, want)
                parent = node.parent
                freed += self.delete(node)
                if parent in tree.evictable_host:
                    heap.push(parent)
        return freed

    def drop_device(self, node: TreeNode) -> int:
        """Free a backed-up node's device pages; it stays as a host-only node."""
        ids = self._tree.evict_device(node)
        self._device_free(ids)
        self._owner.release(ids)
        self._events.removed(node, Medium.DEVICE, ids)  # ids: the node no longer holds them
        self._n["evictions"] += 1
        self._n["evicted_tokens"] += node.num_tokens
        return node.num_tokens

    def delete_subtree(self, node: TreeNode) -> int:
        """Delete ``node`` (an unlocked device leaf) after its descendants, all host-only and
        unlocked (a lock below it would lock it): children first, so each is a leaf when
        deleted. Returns the device tokens freed (``node``'s)."""
        stack, order = list(node.children.values()), []
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(child.children.values())
        for child in reversed(order):  # every node after all of its descendants
            self.delete(child)
        return self.delete(node)

    def delete(self, node: TreeNode) -> int:
        """Delete a leaf from the tree, freeing its pages on both tiers; returns its tokens."""
        value, host_value = self._tree.delete_leaf(node)
        if value is not None:
            self._device_free(value)
            self._owner.release(value)
            self._events.removed(node, Medium.DEVICE, value)
            self._n["evictions"] += 1
            self._n["evicted_tokens"] += node.num_tokens
            self._n["deleted_tokens"] += node.num_tokens
        if host_value is not None:
            if value is None:
                self._l3.on_host_evict(node, host_value)  # write_back: to L3 before the free
            self._host_free(host_value)
            self._events.removed(node, Medium.HOST, host_value)
            if value is None:
                self._n["host_evictions"] += 1
                self._n["host_evicted_tokens"] += node.num_tokens
        return node.num_tokens

    def invalidate(self, node: TreeNode) -> tuple[int, int]:
        """Delete a leaf an operator invalidates (unlocked, unpinned): pages on both tiers freed
        and announced (device first), none written to L3. Returns ``(device, host)`` tokens."""
        value, host_value = self._tree.delete_leaf(node)
        if value is not None:
            self._device_free(value)
            self._owner.release(value)
            self._events.removed(node, Medium.DEVICE, value)
        if host_value is not None:
            self._host_free(host_value)
            self._events.removed(node, Medium.HOST, host_value)
        dev = node.num_tokens if value is not None else 0
        host = node.num_tokens if host_value is not None else 0
        self._n["invalidated_device_tokens"] += dev
        self._n["invalidated_host_tokens"] += host
        return dev, host
