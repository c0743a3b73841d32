"""Invalidation: an operator drops a namespace or a prefix from every tier (ARCHITECTURE.md,
"Control API").

* ``tokens=None``: every prefix of the namespace ``extra_key`` (the root's children of it).
* ``tokens=T``: T's last whole page and every cached continuation of T (the node that holds
  that page, split there, and its subtree); the shorter prefixes ``T[:-page_size]`` that other
  prompts share stay cached.

What goes: the nodes' device and host pages (freed, announced with ``removed()`` on each medium
they held), the pins on them, and the store's entries (``L3Tier.delete``): of a namespace, every
entry of it where the backend has the optional ``delete_prefix``, including pages the tree no
longer holds and other processes' (else the entries of the tree's pages, with ``delete``); of a
prefix, T's last page and the tree's pages below it. A store that cannot remove all of it keeps
the rest, and this cache moves the namespace to a new key generation so it never reads them
(``"l3_unreached"``). A prefix's continuations that only the store holds stay there, unreachable
while T's last page is absent (a lookup walks the chain from the root); once T is stored again
they are found again (the same tokens' pages in the same namespace and model): to drop them too,
invalidate the namespace. Pages that requests in flight hold are never freed: the
cache first waits for its transfers (loads land, L3 prefetches attach), then, if a node to drop
is still locked by a caller (a running request), raises :class:`InvalidateLockedError` naming
the locked prefixes before dropping anything; the operator retries once they finish.

Threading: the cache's thread only.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from hicache_jax.cache.control.pins import Pins
from hicache_jax.cache.control.storage_attach import L3Slot
from hicache_jax.cache.removal import Removal
from hicache_jax.errors import InvalidateLockedError
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree


class Invalidation:
    """Drops a namespace or a prefix (see the module docstring).

    Args:
        tree, removal, pins: the cache's parts.
        l3: the cache's L3 tier (``delete``).
    """

    def __init__(self, tree: RadixTree, removal: Removal, pins: Pins, l3: L3Slot) -> None:
        self._tree, self._removal, self._pins, self._l3 = tree, removal, pins, l3

    def __call__(self, extra_key: Hashable, tokens: np.ndarray | None) -> dict[str, int]:
        """Drop them (transfers already waited for); ``{"device", "host"}`` tokens freed,
        ``"l3"`` store pages deleted, ``"l3_unreached"`` 1 where the store kept some (see the
        module docstring)."""
        tops = self._tops(extra_key, tokens)
        nodes = _subtrees(tops)
        self._check_unlocked(nodes)
        if tokens is not None and tops:  # split where T's last page starts, drop from there
            ps = self._tree.page_size
            if tokens.size > ps:
                self._tree.node_at(tokens[:-ps], extra_key)
            tops = [self._tree.peek_path(tokens, extra_key)[-1][0]]
            nodes = _subtrees(tops)
        self._pins.drop_under(set(nodes))
        l3, unreached = self._l3.delete(nodes, tokens, extra_key)
        dev = host = 0
        for node in reversed(nodes):  # every node after its descendants: a leaf when deleted
            d, h = self._removal.invalidate(node)
            dev, host = dev + d, host + h
        return {"device": dev, "host": host, "l3": l3, "l3_unreached": unreached}

    def _tops(self, extra_key: Hashable, tokens: np.ndarray | None) -> list[TreeNode]:
        """The subtrees' roots (read-only): the namespace's root children, or the node holding
        T's last page (none when the tree does not hold it)."""
        if tokens is None:
            return [c for c in self._tree.root.children.values() if c.extra_key == extra_key]
        path = self._tree.peek_path(tokens, extra_key)
        if sum(t for _, t in path) < tokens.size:
            return []
        return [path[-1][0]]

    def _check_unlocked(self, nodes: list[TreeNode]) -> None:
        pinned = self._pins.device_locks(set(nodes))
        locked = [(n, n.lock_ref - pinned[n]) for n in nodes if n.lock_ref > pinned[n]]
        if locked:
            figures = [(len(self._tree.path_tokens(n)), k) for n, k in locked]
            raise InvalidateLockedError(
                f"invalidate: {len(locked)} node(s) to drop are held by requests in flight "
                f"(prefix tokens, locks: {figures[:8]}); nothing was dropped: retry once they "
                "finish (pins are dropped with them, locks are not)",
                locked=figures,
            )


def _subtrees(tops: list[TreeNode]) -> list[TreeNode]:
    """Every node of the subtrees under ``tops``, each before its descendants."""
    order, stack = [], list(tops)
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    return order
