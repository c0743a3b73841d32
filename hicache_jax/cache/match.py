"""Match and NodeRef: what :meth:`HiCache.match_prefix` and :meth:`HiCache.load_back` return.

Matches go stale (ARCHITECTURE.md): a :class:`Match` names device pages; later calls may evict them.
``Match.node`` is a :class:`NodeRef` that remembers the deepest device node of the match and the
epoch of its pages (the tree stamps a node each time it gets device pages), so
:meth:`HiCache.lock` refuses a stale match and :meth:`HiCache.load_back` always returns what
holds the prefix now.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree


@dataclass(frozen=True, eq=False)
class NodeRef:
    """Opaque handle to the deepest node of a :class:`Match` (``Match.node``): what
    :meth:`HiCache.lock`, :meth:`HiCache.unlock` and :meth:`HiCache.load_back` take.

    It remembers which device pages the match saw (the deepest device node and the epoch of its
    pages), so :meth:`HiCache.lock` can tell a match that went stale -- its device pages were
    evicted, or evicted and loaded back into other pages, by calls made since -- and refuse it.
    """

    _node: TreeNode
    _anchor: TreeNode  # deepest device-resident node of the match (the root if none)
    _epoch: int  # _anchor.device_epoch when the match was made

    @property
    def _prefix(self) -> np.ndarray:
        """int64 tokens of _node's prefix, which load_back re-matches when _node has left the
        tree: rebuilt from the node on demand (the node keeps its key and the node its prefix
        continues from once deleted), not copied at every match."""
        return self._node.prefix_tokens()

    def __eq__(self, other: object) -> bool:  # the same node, whichever match named it
        return isinstance(other, NodeRef) and other._node is self._node

    def __hash__(self) -> int:
        return id(self._node)

    def __repr__(self) -> str:
        return f"NodeRef({self._node!r})"


_NO_PAGES = np.zeros(0, np.int32)
_NO_PAGES.flags.writeable = False


@dataclass(frozen=True)
class Match:
    """Result of :meth:`HiCache.match_prefix` / :meth:`HiCache.load_back`.

    A Match describes the cache when it was made. Calls that may evict (``alloc_pages``,
    ``load_back``, ``insert``, ``evict``, other requests' work) can free or move its device
    pages: lock ``node`` before any of them (the request flow of ARCHITECTURE.md), or pass the match
    through :meth:`HiCache.load_back`, which always returns what holds the prefix now.
    :meth:`HiCache.lock` of a stale match raises :class:`HiCacheError` (match again).

    Attributes:
        device_pages: int32 ``[device_len // page_size]`` device page ids of the L1 part, root
            first (a copy).
        device_len: tokens covered on device (a multiple of page_size).
        host_len: further tokens that only :meth:`HiCache.load_back` serves (a multiple of
            page_size): those held on host only, and ``resident_len`` before them.
        node: opaque handle (:class:`NodeRef`) of the deepest matched node, for lock / unlock /
            load_back.
        load_handle: set only by ``load_back(m, layerwise=True)``: the transfer handle whose
            ``wait_layer(l)`` returns once layer ``l`` of the loaded pages is on device (the
            caller's forward waits per layer). ``None`` otherwise.
        l3_len: set only by ``load_back`` / ``load_back_many``: of the tokens this call
            loaded back for the match, those whose host copies an L3 prefetch brought in and
            that no load-back had served from before (the rest came from L2's own backups).
            0 otherwise.
        resident_len: of ``host_len``, the leading tokens whose pages are on device already
            (``resident_pages``): only with window or STATE groups (``KVSpec.window_groups``),
            where the tree's device pages go on past the longest prefix they serve alone (a
            recurrent group's checkpoint, or a window group's pages, are held at the end of
            the host part, not at theirs). ``device_pages`` never includes them, so they always
            serve alone; a load-back serves them, copying none; locking ``node`` protects
            them. 0 otherwise.
        resident_pages: int32 ``[resident_len // page_size]``: their device page ids, root
            first (after ``device_pages``).
    """

    device_pages: np.ndarray
    device_len: int
    host_len: int
    node: NodeRef
    load_handle: Any = None
    l3_len: int = 0
    resident_len: int = 0
    resident_pages: np.ndarray = field(default_factory=lambda: _NO_PAGES)


def held_pages(match: Match) -> int:
    """Device pages ``match`` holds already (its device part and resident pages): what
    admitting it takes of its prompt's pages without allocating."""
    return match.device_pages.size + match.resident_pages.size


def node_ref(node: TreeNode, anchor: TreeNode) -> NodeRef:
    """A handle of ``node`` whose match saw ``anchor``'s device pages as they are now."""
    return NodeRef(node, anchor, anchor.device_epoch)


def is_stale(ref: NodeRef) -> bool:
    """Whether the device pages ``ref``'s match named were freed or moved since. Device
    residency is prefix-closed and leaves go first, so the anchor (the match's deepest device
    node) loses its pages before any ancestor does; a node that gets device pages again gets a
    new epoch. Splits keep the anchor object on its tail: no change."""
    anchor = ref._anchor
    return anchor.value is None or anchor.device_epoch != ref._epoch


def path_pages(node: TreeNode) -> np.ndarray:
    """int32 device pages of the path ending at ``node`` (all device-resident), root first."""
    parts: list[np.ndarray] = []
    while node.parent is not None:
        assert node.value is not None  # the path is device-resident
        parts.append(node.value)
        node = node.parent
    return np.concatenate(parts[::-1]).astype(np.int32) if parts else np.zeros(0, np.int32)


def host_chain(node: TreeNode) -> list[TreeNode]:
    """The host-only nodes ending at ``node``, root-first."""
    chain = []
    while node.parent is not None and node.value is None:
        chain.append(node)
        node = node.parent
    chain.reverse()
    return chain


def current(match: Match, node: TreeNode, page_size: int) -> Match:
    """``match`` if it still describes the cache, else a Match of what holds the prefix of
    ``node`` now (its device part and the host-only chain after it)."""
    anchor, host_len = node, 0
    while anchor.parent is not None and anchor.value is None:
        host_len += anchor.num_tokens
        anchor = anchor.parent
    if not is_stale(match.node) and match.node._anchor is anchor and match.host_len == host_len:
        return match
    pages = path_pages(anchor)
    return Match(pages, pages.size * page_size, host_len, node_ref(node, anchor))


def revalidate(tree: RadixTree, match: Match) -> tuple[Match, TreeNode]:
    """``(match, node)`` of ``tree``, matched again when its node was deleted since (same
    prefix). Raises :class:`HiCacheError` for another tree's match."""
    node = top = match.node._node
    while top.parent is not None:
        top = top.parent
    if top.is_root and top is not tree.root:
        raise HiCacheError(
            f"{match.node!r} is not in this cache (another cache's, or from "
            "before reset()): match again"
        )
    if top is not tree.root:  # deleted since the match: what holds its prefix now
        tm = tree.match(match.node._prefix, node.extra_key)
        match = Match(
            tm.device_pages, tm.device_len, tm.host_len, node_ref(tm.node, tm.last_device_node)
        )
        node = tm.node
    return match, node


def cut_to(tree: RadixTree, match: Match, ntok: int) -> Match:
    """A Match of the first ``ntok`` tokens of ``match``'s prefix (a page multiple, within what
    it matched), the node holding them split there where needed: what a request uses where a
    window group's pages hold no longer prefix (cache/windows.py)."""
    ref = match.node
    tm = tree.match(ref._prefix[:ntok], ref._node.extra_key)
    return Match(
        tm.device_pages, tm.device_len, tm.host_len, node_ref(tm.node, tm.last_device_node)
    )


def check_node(tree: RadixTree, node: Any) -> TreeNode:
    """The tree node of a ``Match.node`` of ``tree``: TypeError for anything else, HiCacheError
    when it left the tree (evicted and deleted since the match) or is another cache's."""
    if not isinstance(node, NodeRef):
        raise TypeError(f"node must be a Match.node, got {type(node).__name__}")
    if not tree.owns(node._node):
        raise HiCacheError(
            f"{node!r} is not in this cache (evicted and deleted since the "
            "match, or from another cache): match again"
        )
    return node._node


def unprotected_device_pages(ref: NodeRef, seen: set[TreeNode]) -> int:
    """Device pages of ``ref``'s match that no lock protects now and that no node in ``seen``
    already counted: what locking the match takes out of the evictable pages. The nodes counted
    join ``seen`` (several matches of one admission share their common prefix's)."""
    node, n = ref._anchor, 0
    while node.parent is not None and node not in seen:
        if node.lock_ref == 0:
            n += node.num_pages
        seen.add(node)
        node = node.parent
    return n
