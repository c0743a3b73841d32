"""Which tier holds each node's pages, and what each tier can give up (pure Python + numpy).

:class:`TierIndex` is the part of :class:`~hicache_jax.tree.radix.RadixTree` that owns the nodes'
page ids on both tiers and what follows from them: the moves between tiers (``set_value``,
``evict_device``, ``set_host_value``, ``drop_host_value``), the locks, the evictable-leaf sets,
the token counts and which page ids the tree holds. The tree (its subclass) owns the nodes'
structure (match, insert, split, delete) and calls the hooks here whenever a node joins or
leaves the tree:

* ``evictable_device`` = nodes that are unlocked, hold device pages and have no child holding
  device pages (what device eviction may take next);
* ``evictable_host`` = nodes that are unlocked, not host-pinned, host-only and childless;
* ``redundant`` = nodes that are unlocked, not host-pinned and hold pages on both tiers (a host copy
  whose device pages are still there: what ``drop_host_value`` may give up).

Each is kept in O(1) per changed node from the node's own fields (``lock_ref``, ``value``,
``host_value``, ``device_children``, ``children``), never by a scan; :meth:`TierIndex.check_index`
recomputes them from scratch (for tests).

Threading: not thread-safe; only the thread that owns the cache touches it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.tree.node import TreeNode
from hicache_jax.validation import as_distinct_ids

EMPTY_IDS = np.zeros(0, np.int32)


def _parent(node: TreeNode) -> TreeNode:
    """The parent of a non-root node of the tree (only the root and deleted nodes have none)."""
    parent = node.parent
    assert parent is not None, f"{node!r} is the root or not in the tree"
    return parent


class HeldPages:
    """Which page ids of one tier the tree holds: a growable bool mask (O(k) per batch)."""

    __slots__ = ("mask", "count")

    def __init__(self) -> None:
        self.mask = np.zeros(1024, np.bool_)
        self.count = 0

    def any_held(self, ids: np.ndarray) -> bool:
        ids = ids[ids < self.mask.shape[0]]
        return bool(ids.size and self.mask[ids].any())

    def add(self, ids: np.ndarray) -> None:
        if ids.size and ids.max() >= self.mask.shape[0]:
            grown = np.zeros(max(2 * self.mask.shape[0], int(ids.max()) + 1), np.bool_)
            grown[: self.mask.shape[0]] = self.mask
            self.mask = grown
        self.mask[ids] = True
        self.count += ids.size

    def remove(self, ids: np.ndarray) -> None:
        self.mask[ids] = False
        self.count -= ids.size


class TierIndex:
    """Page ids by tier, evictable sets, token counts and held page ids of a tree (see module
    docstring). The subclass sets ``root`` and ``_epoch`` and calls :meth:`_reset_index`.

    Attributes:
        root: the tree's root (in no set: never evicted).
        evictable_device: set of device-evictable nodes.
        evictable_host: set of host-evictable nodes.
        device_tokens / evictable_device_tokens / protected_device_tokens: tokens held on device
            in all / unlocked / locked nodes (evictable + protected = device).
        host_tokens: tokens held on host.
        host_evictable_tokens: tokens of unlocked, not host-pinned host-only nodes: exactly
            what host eviction can free (a host-only node's descendants are host-only, and a lock
            below it would lock it too).
        redundant: set of unlocked nodes holding pages on both tiers; redundant_tokens their
            tokens.
    """

    root: TreeNode
    _epoch: int  # device_epoch stamps (see TreeNode): never reused, not even across a reset

    def _reset_index(self) -> None:
        self.evictable_device: set[TreeNode] = set()
        self.evictable_host: set[TreeNode] = set()
        self.redundant: set[TreeNode] = set()
        self.redundant_tokens = 0
        self.device_tokens = 0
        self.evictable_device_tokens = 0
        self.protected_device_tokens = 0
        self.host_tokens = 0
        self.host_evictable_tokens = 0
        self._device_held = HeldPages()
        self._host_held = HeldPages()

    def _refresh(self, node: TreeNode) -> None:
        """Recompute ``node``'s membership of every set from its O(1) fields."""
        if node is self.root:
            return
        free = node.lock_ref == 0
        kept = free and node.host_pins == 0  # what the host tier may give up
        if free and node.value is not None and node.device_children == 0:
            self.evictable_device.add(node)
        else:
            self.evictable_device.discard(node)
        host_only = kept and node.value is None and node.host_value is not None
        if host_only and not node.children:
            self.evictable_host.add(node)
        else:
            self.evictable_host.discard(node)
        tokens = node.num_tokens if host_only else 0
        if tokens != node.host_only_tokens:
            self.host_evictable_tokens += tokens - node.host_only_tokens
            node.host_only_tokens = tokens
        both = kept and node.value is not None and node.host_value is not None
        tokens = node.num_tokens if both else 0
        if tokens != node.redundant_tokens:
            self.redundant_tokens += tokens - node.redundant_tokens
            node.redundant_tokens = tokens
            if both:
                self.redundant.add(node)
            else:
                self.redundant.discard(node)

    def _account_device(self, node: TreeNode, sign: int) -> None:
        n = sign * node.num_tokens
        self.device_tokens += n
        if node.lock_ref:
            self.protected_device_tokens += n
        else:
            self.evictable_device_tokens += n

    def _index_host(self, node: TreeNode, ids: np.ndarray) -> None:
        """``node`` (in the tree, no host copy) takes host pages ``ids``."""
        node.host_value = ids
        self._host_held.add(ids)
        self.host_tokens += node.num_tokens
        self._refresh(node)

    def _unindex_leaf(self, node: TreeNode) -> None:
        """A childless node leaves the tree: out of every set and count (its pages are the
        caller's now). The caller unlinks it and refreshes its parent."""
        self.evictable_device.discard(node)
        self.evictable_host.discard(node)
        if node.value is not None:
            self._account_device(node, -1)
            self._device_held.remove(node.value)
            _parent(node).device_children -= 1
        if node.host_value is not None:
            self.host_tokens -= node.num_tokens
            self._host_held.remove(node.host_value)
        self.host_evictable_tokens -= node.host_only_tokens
        node.host_only_tokens = 0
        self.redundant.discard(node)
        self.redundant_tokens -= node.redundant_tokens
        node.redundant_tokens = 0

    # -- moves between tiers (public API of the tree) -------------------------------------

    def _attach_value(self, node: TreeNode, ids: np.ndarray) -> None:
        """Give an evicted node device pages (load-back or revive); parent already resident."""
        self._epoch += 1
        node.device_epoch = self._epoch
        node.value = ids
        self._device_held.add(ids)
        self._account_device(node, +1)
        parent = _parent(node)
        parent.device_children += 1
        self._refresh(node)
        self._refresh(parent)

    def owns(self, node: TreeNode) -> bool:
        """Whether ``node`` (a TreeNode) is in this tree, root included (O(depth) walk): a node
        deleted since a caller matched it, or one of another tree, is not."""
        top = node
        while top.parent is not None:
            top = top.parent
        return top is self.root

    def _check_member(self, node: TreeNode) -> None:
        """A non-root node of this tree, else TypeError / HiCacheError."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"node must be a TreeNode, got {type(node).__name__}")
        if node is self.root or not self.owns(node):
            raise HiCacheError(f"{node!r} is not a non-root node of this tree")

    def evict_device(self, node: TreeNode) -> np.ndarray:
        """Drop ``node``'s device pages, keeping it as a host-only node.

        ``node`` must be in ``evictable_device`` and backed up. Returns its int32 device page ids;
        ownership passes to the caller (who frees them).
        """
        if node not in self.evictable_device:
            raise HiCacheError(
                f"{node!r} is not device-evictable (locked, evicted, has device "
                "children, or not in the tree)"
            )
        if node.host_value is None:
            raise HiCacheError(f"{node!r} has no host copy: back it up or delete_leaf it")
        ids, parent = node.value, _parent(node)
        assert ids is not None, "a device-evictable node holds device pages"
        self._account_device(node, -1)
        self._device_held.remove(ids)
        node.value = None
        parent.device_children -= 1
        self._refresh(node)
        self._refresh(parent)
        return ids

    def set_host_value(self, node: TreeNode, host_ids: Any, *, validated: bool = False) -> None:
        """Record a host backup of a device-resident, not yet backed-up node.

        Args:
            host_ids: 1-D int ``[node.num_pages]`` distinct host page ids; the tree takes them.
            validated: ``node`` is a node of this tree and ``host_ids`` an int32 numpy array of
                ``node.num_pages`` distinct ids fresh from the host allocator (the cache's
                backups): skip those checks (a walk to the root, a sort, the held-page lookup).
        """
        if validated:  # fresh from the host allocator: no page of them is held
            ids = host_ids
        else:
            self._check_member(node)
            ids = as_distinct_ids(host_ids, node.num_pages, "host_ids")
        if node.value is None or node.host_value is not None:
            raise HiCacheError(f"{node!r} must hold device pages and no host copy yet")
        if not validated and self._host_held.any_held(ids):
            raise HiCacheError("host_ids has pages the tree already holds")
        self._index_host(node, ids)

    def drop_host_value(self, node: TreeNode) -> np.ndarray:
        """Give up the host copy of a node that still holds device pages (``node`` must be in
        ``redundant``: unlocked, on both tiers). Returns its int32 host page ids; ownership
        passes to the caller (who frees them)."""
        if node not in self.redundant:
            raise HiCacheError(f"{node!r} is not redundant (locked, or not on both tiers)")
        ids = node.host_value
        assert ids is not None, "a redundant node holds host pages"
        node.host_value = None
        self._host_held.remove(ids)
        self.host_tokens -= node.num_tokens
        self._refresh(node)
        return ids

    def set_value(self, node: TreeNode, device_ids: Any, *, validated: bool = False) -> None:
        """Load-back: give a host-only node device pages. Go root-first: the parent must be
        device-resident (or the root).

        Args:
            device_ids: 1-D int ``[node.num_pages]`` distinct device page ids; the tree takes them.
            validated: as in :meth:`set_host_value` (``device_ids`` fresh from the device
                allocator: the cache's load-backs).
        """
        if validated:
            ids = device_ids
        else:
            self._check_member(node)
            ids = as_distinct_ids(device_ids, node.num_pages, "device_ids")
        if node.value is not None:
            raise HiCacheError(f"{node!r} already holds device pages")
        if _parent(node).value is None:
            raise HiCacheError(f"parent of {node!r} is not on device: load back root-first")
        if self._device_held.any_held(ids):
            raise HiCacheError("device_ids has pages the tree already holds")
        self._attach_value(node, ids)

    # -- locks: what no tier may give up ------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (device and host). Root: no-op."""
        chain = self._lock_chain(node)
        for n in chain:
            n.lock_ref += 1
            if n.lock_ref == 1:
                if n.value is not None:
                    self.evictable_device_tokens -= n.num_tokens
                    self.protected_device_tokens += n.num_tokens
                self._refresh(n)

    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock`. Raises ``HiCacheError`` (no change) if not locked."""
        chain = self._lock_chain(node)
        if any(n.lock_ref <= 0 for n in chain):
            raise HiCacheError(f"unlock of {node!r} below zero (not locked)")
        for n in chain:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                if n.value is not None:
                    self.protected_device_tokens -= n.num_tokens
                    self.evictable_device_tokens += n.num_tokens
                self._refresh(n)

    def pin_host(self, node: TreeNode) -> None:
        """Keep the host copies of ``node`` and its ancestors (every one must hold one): no
        host eviction, no redundant-copy drop; device eviction stays allowed."""
        chain = self._lock_chain(node)
        if any(n.host_value is None for n in chain):
            raise HiCacheError(f"pin_host of {node!r}: a node of its prefix has no host copy")
        for n in chain:
            n.host_pins += 1
            if n.host_pins == 1:
                self._refresh(n)

    def unpin_host(self, node: TreeNode) -> None:
        """Undo one :meth:`pin_host`. Raises ``HiCacheError`` (no change) if not pinned."""
        chain = self._lock_chain(node)
        if any(n.host_pins <= 0 for n in chain):
            raise HiCacheError(f"unpin_host of {node!r} below zero (not pinned)")
        for n in chain:
            n.host_pins -= 1
            if n.host_pins == 0:
                self._refresh(n)

    def _lock_chain(self, node: TreeNode) -> list:
        if not isinstance(node, TreeNode):
            raise TypeError(f"node must be a TreeNode, got {type(node).__name__}")
        chain = []
        while node.parent is not None:
            chain.append(node)
            node = node.parent
        if node is not self.root:
            raise HiCacheError("node is not in this tree (deleted, or from another tree)")
        return chain

    def check_index(self, nodes: list) -> None:
        """Recompute every set, count and held mask from ``nodes`` (every non-root node) and
        compare (for tests); raises AssertionError."""
        ev_dev, ev_host, redundant, dev, host = set(), set(), set(), [], []
        tok = dict.fromkeys(
            ("device", "evictable", "protected", "host", "host_evictable", "redundant"), 0
        )
        for node in nodes:
            kids, free = list(node.children.values()), node.lock_ref == 0
            kept = free and node.host_pins == 0
            if node.value is not None:
                dev.append(node.value)
                tok["device"] += node.num_tokens
                tok["evictable" if free else "protected"] += node.num_tokens
                if free and all(c.value is None for c in kids):
                    ev_dev.add(node)
            if node.host_value is not None:
                host.append(node.host_value)
                tok["host"] += node.num_tokens
                if node.value is None and kept:
                    tok["host_evictable"] += node.num_tokens
                    if not kids:
                        ev_host.add(node)
            assert node.host_only_tokens == (
                node.num_tokens
                if node.value is None and node.host_value is not None and kept
                else 0
            )
            if node.value is not None and node.host_value is not None and kept:
                redundant.add(node)
                tok["redundant"] += node.num_tokens
            assert node.redundant_tokens == (node.num_tokens if node in redundant else 0)
        assert self.evictable_device == ev_dev and self.evictable_host == ev_host
        assert self.redundant == redundant and self.redundant_tokens == tok["redundant"]
        assert (
            self.device_tokens,
            self.evictable_device_tokens,
            self.protected_device_tokens,
            self.host_tokens,
            self.host_evictable_tokens,
        ) == (tok["device"], tok["evictable"], tok["protected"], tok["host"], tok["host_evictable"])
        for held, parts in ((self._device_held, dev), (self._host_held, host)):
            ids = np.sort(np.concatenate(parts)) if parts else EMPTY_IDS
            assert np.unique(ids).size == ids.size, "a page held twice"
            assert np.array_equal(np.flatnonzero(held.mask), ids) and held.count == ids.size
