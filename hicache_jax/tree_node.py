"""Nodes and results of the radix tree, page hashes, and the tree's input checks (no jax).

:class:`TreeNode` is what the tree is made of and what callers hold (``Match.node``, locks,
transfers in flight); :class:`TreeMatch` and :class:`InsertResult` are what
:meth:`~hicache_jax.radix.RadixTree.match` and :meth:`~hicache_jax.radix.RadixTree.insert`
return. Page hashes chain like SGLang's KV events: a page's hash covers its parent's hash and
its own tokens, and the root's children start from a hash of the ``extra_key`` namespace.
The tree itself (and the rules these objects follow) is in :mod:`hicache_jax.radix`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache_jax.allocator import as_page_ids, nonnegative_ints
from hicache_jax.hashing import canonical_key as _canonical  # noqa: F401 (tests import it here)
from hicache_jax.hashing import chain_hashes, namespace_hash

_EMPTY_I32 = np.zeros(0, np.int32)
_EMPTY_U64 = np.zeros(0, np.uint64)
_MEMCMP_MAX = 2048  # tokens; see _common_len


# ----------------------------------------------------------------------------- nodes / results

@dataclass(slots=True, eq=False)
class TreeNode:
    """One run of whole pages of one cached prefix. Identity-hashed (``eq=False``).

    Attributes:
        id: per-tree counter (the eviction tie-break: older ids first).
        key: int64 ``[num_pages * page_size]`` tokens of this node (empty for the root).
        parent: ``None`` for the root and for nodes deleted from the tree.
        children: first-page key -> child: the page's int64 token bytes (``(extra_key, bytes)``
            under the root).
        value: int32 ``[num_pages]`` device page ids, or ``None`` when evicted from device.
        host_value: int32 ``[num_pages]`` host page ids, or ``None`` when not backed up.
        lock_ref: locks on this node or a descendant (locks walk to the root).
        hit_count, last_access, created, priority: eviction keys (see ``eviction.py``).
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
    parent: "TreeNode | None"
    children: dict = field(default_factory=dict)
    value: "np.ndarray | None" = None
    host_value: "np.ndarray | None" = None
    lock_ref: int = 0
    hit_count: int = 0
    last_access: float = 0.0
    created: float = 0.0
    priority: int = 0
    extra_key: Any = None
    device_children: int = 0
    host_only_tokens: int = 0
    device_epoch: int = 0
    redundant_tokens: int = 0
    page_size: int = 1
    hash_parent: "TreeNode | None" = None
    hashes: "np.ndarray | None" = None

    @property
    def page_hashes(self) -> np.ndarray:
        """uint64 ``[num_pages]``: ``h_i = xxh3_64(tokens of page i, seed=h_{i-1})`` chained from
        the root (:func:`~hicache_jax.hashing.chain_hashes`; :func:`namespace_hash` of
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
        chain, node = [], self
        while node.hashes is None:
            chain.append(node)
            node = node.hash_parent
            if node is None:  # the root holds the empty array, so only a detached root-child
                break
        if node is None or (node.hash_parent is None and node.key.shape[0] == 0):
            prev = None  # under a root: the namespace seeds the chain
        else:
            prev = int(node.hashes[-1])
        for n in reversed(chain):
            seed = namespace_hash(n.extra_key) if prev is None else prev
            n.hashes = chain_hashes(seed, n.key.reshape(-1, n.page_size))
            prev = int(n.hashes[-1])
        return self.hashes

    def prefix_tokens(self) -> np.ndarray:
        """int64 tokens of the whole prefix ending at this node, root first (a new array). It
        follows ``hash_parent``, so it still answers once the node was deleted from the tree
        (``parent`` None): what a stale match re-matches. O(depth), one concatenation."""
        parts, node = [], self
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
        return (f"TreeNode(id={self.id}, tokens={self.num_tokens}, device={self.value is not None}, "
                f"host={self.host_value is not None}, lock_ref={self.lock_ref})")


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


class _HeldPages:
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


# ----------------------------------------------------------------------------- validation

def _as_tokens(tokens: Any) -> np.ndarray:
    """1-D non-negative integer sequence -> int64 numpy (no copy when already int64)."""
    arr = np.asarray(tokens)
    if not nonnegative_ints(arr, "tokens"):
        return np.zeros(0, np.int64)
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        raise ValueError("tokens has values beyond int64")
    return arr.astype(np.int64, copy=False)


def _as_ids(ids: Any, n: int, name: str) -> np.ndarray:
    """1-D distinct non-negative integer page ids of length ``n`` -> int32 copy."""
    out = as_page_ids(ids, name)
    if out.shape[0] != n:
        raise ValueError(f"{name} has {out.shape[0]} ids, expected {n} (one per whole page)")
    srt = np.sort(out)  # sort + neighbour compare: numpy 2's hash-based unique is ~20x slower
    if (srt[1:] == srt[:-1]).any():
        raise ValueError(f"{name} has duplicate ids")
    return out


def _common_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two equal-length int64 arrays (no Python loop)."""
    # Short runs: one memcmp of the bytes is cheapest. Long runs: an elementwise compare, since
    # copying hundreds of KiB out with tobytes() can cost page faults on every call.
    if a.shape[0] <= _MEMCMP_MAX:
        if a.tobytes() == b.tobytes():
            return a.shape[0]
        return int(np.argmax(a != b))
    diff = a != b
    k = int(np.argmax(diff))
    return k if diff[k] else a.shape[0]


def _has_nan(key: Any) -> bool:
    """Whether ``key`` is, or (in a tuple / frozenset) holds, a value unequal to itself."""
    if isinstance(key, (tuple, frozenset)):
        return any(_has_nan(k) for k in key)
    try:
        return bool(key != key)
    except Exception:  # an __ne__ that raises or returns an array: not a NaN-like scalar
        return False


def _check_extra_key(extra_key: Any) -> None:
    """Refuse unhashable keys and keys unequal to themselves (NaN): each insert under
    ``float("nan")`` would make a namespace that no later match finds."""
    if extra_key is None:
        return
    try:
        hash(extra_key)
    except TypeError:
        raise TypeError(f"extra_key must be hashable, got {type(extra_key).__name__}") from None
    if _has_nan(extra_key):
        raise ValueError(f"extra_key={extra_key!r} is not equal to itself (NaN): no later match "
                         "could find its namespace")


# ----------------------------------------------------------------------------- the tree
