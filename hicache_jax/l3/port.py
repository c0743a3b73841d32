"""The port between the L3 tier and its cache: what the tier may ask of the cache (the cache
implements it, :class:`hicache_jax.cache.l3_port.CacheL3Port`; tests fake it). Defined here, below
the tier and the prefetcher, so that neither imports the other to name it."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from hicache_jax.spec import KVSpec, LayerGroup
from hicache_jax.tree.node import TreeMatch, TreeNode


class CachePort(Protocol):
    """What the L3 tier needs of its cache (the cache implements it; tests fake it).

    Attributes:
        spec: the cache's KVSpec.
        events: the cache's event recorder (``l3_candidate`` / ``l3_stored``: what lands in L3
            is announced when the events ask for L3).
        group: the cache's processes (``memory/group.py``): the tier agrees every store result
            through it (a ``LocalGroup`` in one process).
    """

    spec: KVSpec
    events: Any
    group: Any

    def clock(self) -> float:
        """The cache's clock (deadlines)."""

    def match(self, tokens: np.ndarray, extra_key: Any) -> TreeMatch:
        """The tree's match of whole-page ``tokens`` (may split a node at the end)."""

    def path_tokens(self, node: TreeNode) -> np.ndarray:
        """int64 tokens of the prefix ending with ``node``."""

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (an L3 hold, counted)."""

    def unlock(self, node: TreeNode) -> None:
        """Undo one :meth:`lock`."""

    def reserve_host_pages(self, n: int) -> np.ndarray:
        """Up to ``n`` host pages (evicting host pages as needed; fewer when eviction cannot
        free enough), reserved for L3 until released or attached."""

    def release_host_pages(self, host_ids: np.ndarray) -> None:
        """Give back reserved host pages (free them)."""

    def write_host_pages(self, host_ids: np.ndarray, rows: np.ndarray, row_ids: np.ndarray) -> None:
        """Store ``rows[row_ids[i]]`` (staging entries) in the reserved host page
        ``host_ids[i]``."""

    def attach_host_copy(self, node: TreeNode, host_ids: np.ndarray) -> None:
        """Reserved host pages become the host copy of a device node (event recorded)."""

    def attach_host_leaf(
        self, parent: TreeNode, tokens: np.ndarray, host_ids: np.ndarray, extra_key: Any
    ) -> TreeNode:
        """Reserved host pages become a host-only leaf under ``parent`` (event recorded)."""

    def fetch_pages(self, new_pages: int, covered: int) -> int:
        """Of the ``new_pages`` pages a prefetch could fetch beyond the ``covered`` tokens L1 +
        L2 hold, how many to fetch (root end first; the rest is recomputed): all of them under
        the threshold load policy, the cost model's least-time split under ``"cost"``."""

    def fetch_decision(self) -> Any:
        """The record of the last :meth:`fetch_pages` decision (opaque; None where no model
        decided it), handed back with that fetch's :meth:`observe_fetch`."""

    def observe_fetch(self, nbytes: int, seconds: float, decision: Any = None) -> None:
        """A completed L3 -> L2 read of ``nbytes`` that took ``seconds`` (the cost model's
        ``l3_l2`` link); ``decision``: its :meth:`fetch_decision` (its predicted time is
        checked against ``seconds``)."""

    def read_host_async(self, host_ids: np.ndarray) -> Any:
        """Dispatch a copy of host pages out of the host pool (``HostRead``: ``done()``,
        ``copy_into(rows, row_ids)``)."""


class WindowHost(Protocol):
    """The window groups' host pages, as the L3 tier sees them (a cache whose spec has window
    groups gives its port one as ``window_host``; without, the port has none or None).

    Attributes:
        groups: the spec's window groups (``KVSpec.window_groups``).
        specs: each group's pages as the host pool holds them (``LayerGroup.spec``, this
            process's heads): what the group's L3 entries hold.
    """

    groups: tuple[LayerGroup, ...]
    specs: tuple[KVSpec, ...]

    def pages(self, g: int, host_ids: np.ndarray) -> np.ndarray:
        """int32: group ``g``'s host page attached to each of ``host_ids``, -1 where none."""

    def read_async(self, g: int, group_ids: np.ndarray) -> Any:
        """Dispatch a copy of group ``g``'s host pages ``group_ids`` (``HostRead``)."""

    def attach(self, g: int, host_ids: np.ndarray, rows: np.ndarray, row_ids: np.ndarray) -> int:
        """Give each of ``host_ids`` (host pages the tree holds, holding no group ``g`` page) a
        fresh group ``g`` page holding ``rows[row_ids[i]]`` (staging entries): all or none
        (none when the group's host pool has too few free pages); pages attached."""
