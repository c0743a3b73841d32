"""What a HiCache reports about itself: ``stats()`` and the invariants of ARCHITECTURE.md,
checked on the whole cache (O(cache); tests call :meth:`HiCache.check_invariants` after every step).

* Every device page is free, the caller's, or held by one tree node (checked by
  :class:`~hicache_jax.cache.ownership.DevicePageOwners`); every host page is free, held by one
  node, the target of a backup in flight, or reserved by an L3 prefetch.
* A node holds device or host pages (root aside); ``lock_ref`` equals the caller locks, the
  transfers in flight and the L3 prefetches below it.
* Write-through modes: a backed-up node's parent is backed up (continuous prefix from root).
* A node is in the evictable set iff it is unlocked, holds device pages, and no child does.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from hicache_jax.cache.control.pins import Pins
from hicache_jax.cache.inflight import InFlight
from hicache_jax.cache.l3_port import CacheL3Port
from hicache_jax.cache.ownership import DevicePageOwners
from hicache_jax.errors import HiCacheError
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.memory.transfer import TransferKind
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree


def check_cache(
    tree: RadixTree,
    owners: DevicePageOwners,
    device: PageAllocator,
    host: PageAllocator,
    flight: InFlight,
    caller_locks: dict[TreeNode, int],
    l3: CacheL3Port,
    continuous_prefix: bool,
    pins: Pins,
) -> None:
    """Raise :class:`HiCacheError` naming the first broken invariant of one cache.

    Args:
        l3: the cache's side of the L3 port: the host pages L3 prefetches reserve, the nodes
            they lock.
        pins: the cache's pins (device pins hold locks; host pins the nodes' ``host_pins``).
    """
    try:
        tree.check_invariants()
    except AssertionError as e:
        raise HiCacheError(f"invariant of the tree: {e}") from None
    nodes = list(tree.nodes())
    owners.check_invariants(
        (n.value for n in nodes if n.value is not None),
        device.is_allocated(np.arange(device.num_pages)),
    )
    ops = list(flight.ops())
    parts = [n.host_value for n in nodes if n.host_value is not None]
    parts += [flight.parked_host_pages(), l3.reserved_pages()]
    held = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    if np.unique(held).size != held.size:
        raise HiCacheError(
            "invariant: a host page is held twice (nodes, backups in flight, L3 prefetches)"
        )
    alloc = host.is_allocated(np.arange(host.num_pages))
    if alloc.sum() != held.size or not alloc[held].all():
        raise HiCacheError(
            "invariant: a host page is neither free, nor held by a node, a "
            "backup in flight or an L3 prefetch"
        )
    holders = list(caller_locks.items()) + [
        (op.node, 1) for op in ops if op.kind is TransferKind.LOAD
    ]
    _check_nodes(tree, nodes, holders + l3.locked_nodes() + pins.locked_nodes(), continuous_prefix)
    pins.check(nodes)
    if any(n.parent is None and n is not tree.root for n in caller_locks):
        raise HiCacheError("invariant: a caller lock is held on a deleted node")


def _check_nodes(
    tree: RadixTree, nodes: list[TreeNode], holders: list[tuple[TreeNode, int]], continuous: bool
) -> None:
    expected: collections.Counter = collections.Counter()
    for node, k in holders:
        while node.parent is not None:
            expected[node] += k
            node = node.parent
    evictable = tree.evictable_device
    for n in nodes:
        parent = n.parent
        assert parent is not None  # the tree's non-root nodes
        if n.value is None and n.host_value is None:
            raise HiCacheError(f"invariant: {n!r} holds no pages")
        if n.lock_ref != expected[n]:
            raise HiCacheError(
                f"invariant: {n!r} lock_ref {n.lock_ref} != {expected[n]} "
                "(caller locks + transfers in flight + L3 prefetches + device pins)"
            )
        if (
            continuous
            and n.host_value is not None
            and not (parent.parent is None or parent.host_value is not None)
        ):
            raise HiCacheError(
                f"invariant: {n!r} is backed up under a parent that is not (gap in the host prefix)"
            )
        dev_child = any(c.value is not None for c in n.children.values())
        if (n in evictable) != (n.lock_ref == 0 and n.value is not None and not dev_child):
            raise HiCacheError(
                f"invariant: {n!r} is in the evictable set iff unlocked, on device, no device child"
            )


_COUNTED = (
    "window_pages_trimmed",
    "window_host_pages_patched",
    "window_unservable_tokens",
    "match_tokens",
    "device_hit_tokens",
    "host_hit_tokens",
    "backups",
    "backup_tokens",
    "backups_skipped",
    "load_backs",
    "load_back_tokens",
    "load_backs_declined",
    "evictions",
    "evicted_tokens",
    "eviction_backup_pages",
    "clean_ahead_pages",
    "admission_clean_pages",
    "host_copies_dropped_tokens",
    "deleted_tokens",
    "host_evictions",
    "host_evicted_tokens",
    "duplicate_pages_freed",
    "bytes_to_host",
    "bytes_to_device",
    "invalidated_device_tokens",
    "invalidated_host_tokens",
    "storage_attaches",
    "storage_detaches",
    "storage_detach_finished_ops",
    "overlap_loads",
    "overlap_load_tokens",
    "admitted_requests",
    "admitted_prompt_tokens",
    "served_device_tokens",
    "served_host_tokens",
    "served_l3_tokens",
    "recomputed_tokens",
    "served_load_bytes",
    "served_load_wait_seconds",
)


def cache_stats(
    n: collections.Counter,
    dev: PageAllocator,
    host: PageAllocator,
    tree: RadixTree,
    owners: DevicePageOwners,
    in_flight: int,
    reserve_pages: int,
) -> dict[str, Any]:
    """The cache's own part of ``HiCache.stats()`` (reads only: any thread)."""
    ps = tree.page_size
    seconds = n["seconds_to_host"] + n["seconds_to_device"]
    moved = n["bytes_to_host"] + n["bytes_to_device"]
    return (
        {
            "device_pages": dev.num_pages,
            "device_free_pages": dev.num_free,
            "device_used_pages": dev.num_used,
            "device_caller_pages": owners.num_caller_pages(),
            "device_cached_tokens": tree.device_tokens,
            "device_evictable_pages": tree.evictable_device_tokens // ps,
            "device_protected_pages": tree.protected_device_tokens // ps,
            "host_pages": host.num_pages,
            "host_free_pages": host.num_free,
            "host_used_pages": host.num_used,
            "host_cached_tokens": tree.host_tokens,
            "host_evictable_leaves": len(tree.evictable_host),
            "host_evictable_pages": tree.host_evictable_tokens // ps,
        }
        | {name: n[name] for name in _COUNTED}
        | {
            "transfer_seconds": seconds,
            "mean_transfer_gbps": moved / seconds / 1e9 if seconds > 0 else 0.0,
            "transfers_in_flight": in_flight,
            "clean_ahead_reserve_pages": reserve_pages,
        }
    )
