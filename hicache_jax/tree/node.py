"""Nodes and results of the radix tree, and page hashes (no jax).

:class:`TreeNode` is what the tree is made of and what callers hold (``Match.node``, locks,
transfers in flight); :class:`TreeMatch` and :class:`InsertResult` are what
:meth:`~hicache_jax.tree.radix.RadixTree.match` and :meth:`~hicache_jax.tree.radix.RadixTree.insert`
return. Page hashes chain like SGLang's KV events: a page's hash covers its parent's hash and
its own tokens, and the root's children start from a hash of the ``extra_key`` namespace.
The tree itself (and the rules these objects follow) is in :mod:`hicache_jax.tree.radix`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache_jax.tree.hashing import chain_hashes, namespace_hash

# ----------------------------------------------------------------------------- nodes / results


@dataclass(slots=True, eq=False)
class TreeNode:
    """One run of whole pages of one cached prefix. Identity-hashed (``eq=False``).

    Attributes:
        id: per-tree counter (the eviction tie-break: older ids first).
        key: int32 ``[num_pages * page_size]`` tokens of this node (empty for the root).
        parent: ``None`` for the root and for nodes deleted from the tree.
        children: first-page key -> child: the page's int32 token bytes (``(extra_key, bytes)``
            under the root).
        value: int32 ``[num_pages]`` device page ids, or ``None`` when evicted from device.
        host_value: int32 ``[num_pages]`` host page ids, or ``None`` when not backed up.
        lock_ref: locks on this node or a descendant (locks walk to the root).
        host_pins: host pins on this node or a descendant (they walk to the root like locks):
            a host-pinned node keeps its host copy (never host-evicted, never dropped as
            redundant) but may still leave the device.
        hit_count, last_access, created, priority: eviction keys (see ``eviction.py``).
        worth: the ``value`` eviction's key (GreedyDual: see ``eviction.py``), 0 otherwise.
        page_hashes: uint64 ``[num_pages]`` chained hashes of the prefix ending at each page
            (a property: computed on first access and kept, since only KV events and L3 use
            them; see :meth:`page_hashes`).
        extra_key: the namespace.
        device_children: how many children hold device pages (keeps evictability O(1)).
        host_only_tokens: this node's share of ``RadixTree.host_evictable_tokens`` (its tokens
            while it is host-only and unlocked, else 0).
        redundant_tokens: this node's share of ``RadixTree.redundant_tokens`` (its tokens while
            it is unlocked and holds pages on both tiers, else 0).
        page_size: tokens per page (the tree's).
        hash_parent: the node whose last page hash the chain continues from: ``parent`` while
            in the tree, kept when the node is deleted (``parent`` becomes None), so that the
            hashes of a removed node can still be computed for its BlockRemoved event, and its
            prefix rebuilt (:meth:`prefix_tokens`) for a stale match.
        hashes: the cached ``page_hashes`` (None until first computed).
        device_epoch: a per-tree stamp taken each time the node gets device pages (insert,
            revive, load-back): a Match whose deepest device node still holds the epoch the
            match saw still names the pages that hold its prefix (see ``Match``).
    """

    id: int
    key: np.ndarray
    parent: TreeNode | None
    children: dict = field(default_factory=dict)
    value: np.ndarray | None = None
    host_value: np.ndarray | None = None
    lock_ref: int = 0
    host_pins: int = 0
    hit_count: int = 0
    last_access: float = 0.0
    created: float = 0.0
    priority: int = 0
    worth: float = 0.0
    extra_key: Any = None
    device_children: int = 0
    host_only_tokens: int = 0
    device_epoch: int = 0
    redundant_tokens: int = 0
    page_size: int = 1
    hash_parent: TreeNode | None = None
    hashes: np.ndarray | None = None

    @property
    def page_hashes(self) -> np.ndarray:
        """uint64 ``[num_pages]``: ``h_i = xxh3_64(tokens of page i, seed=h_{i-1})`` chained from
        the root (:func:`~hicache_jax.tree.hashing.chain_hashes`; :func:`namespace_hash` of
        ``extra_key`` seeds the root's children).

        Computed on first access, for this node and the ancestors not computed yet (root-first,
        one :func:`chain_hashes` call per node, no recursion), then kept: inserts, matches and
        evictions do no per-page hashing unless events or L3 ask for the hashes.
        """
        hashes = self.hashes
        if hashes is None:
            hashes = self._compute_hashes()
        return hashes

    def _compute_hashes(self) -> np.ndarray:
        chain: list[TreeNode] = []
        node: TreeNode | None = self
        # node becomes None only above a detached root-child (the root holds the empty array)
        while node is not None and node.hashes is None:
            chain.append(node)
            node = node.hash_parent
        if node is None or (node.hash_parent is None and node.key.shape[0] == 0):
            prev = None  # under a root: the namespace seeds the chain
        else:
            prev = int(node.page_hashes[-1])  # computed: the loop stopped at it
        for n in reversed(chain):
            seed = namespace_hash(n.extra_key) if prev is None else prev
            n.hashes = chain_hashes(seed, n.key.reshape(-1, n.page_size))
            prev = int(n.hashes[-1])
        hashes = self.hashes
        assert hashes is not None  # self is chain[0]: computed above
        return hashes

    def prefix_tokens(self) -> np.ndarray:
        """int32 tokens of the whole prefix ending at this node, root first (a new array). It
        follows ``hash_parent``, so it still answers once the node was deleted from the tree
        (``parent`` None): what a stale match re-matches. O(depth), one concatenation."""
        parts: list[np.ndarray] = []
        node: TreeNode | None = self
        while node is not None:
            parts.append(node.key)
            node = node.hash_parent
        return np.concatenate(parts[::-1])

    @property
    def num_pages(self) -> int:
        return self.key.shape[0] // self.page_size

    @property
    def num_tokens(self) -> int:
        return self.key.shape[0]

    @property
    def evicted(self) -> bool:
        """No device pages (host-only)."""
        return self.value is None

    @property
    def backed_up(self) -> bool:
        return self.host_value is not None

    @property
    def is_root(self) -> bool:
        return self.parent is None and self.key.shape[0] == 0

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={self.num_tokens}, "
            f"device={self.value is not None}, host={self.host_value is not None}, "
            f"lock_ref={self.lock_ref})"
        )


@dataclass(frozen=True)
class TreeMatch:
    """Result of :meth:`RadixTree.match`.

    Attributes:
        device_pages: int32 ``[device_len // page_size]`` device page ids, root first (a copy).
        device_len: tokens matched on device.
        host_len: further tokens matched on host only.
        host_nodes: root-first chain of host-only nodes after the device part.
        last_device_node: deepest device-resident matched node (the root if none).
        node: deepest matched node (the root if nothing matched).
    """

    device_pages: np.ndarray
    device_len: int
    host_len: int
    host_nodes: tuple
    last_device_node: TreeNode
    node: TreeNode


@dataclass(frozen=True)
class InsertResult:
    """Result of :meth:`RadixTree.insert`.

    Attributes:
        prefix_len: tokens already cached (on either tier) before the call.
        duplicate_pages: int32 caller pages at positions the tree already held on device with a
            different page; the caller still owns them and frees them.
        existing_nodes: root-first nodes that already existed along the path.
        revived_nodes: host-only nodes that took the caller's pages (device-resident again).
        last_node: deepest node of the inserted prefix (the root if no whole page).
    """

    prefix_len: int
    duplicate_pages: np.ndarray
    existing_nodes: list
    revived_nodes: list
    last_node: TreeNode
