"""The cache's L3 tier behind one slot, so that storage can be attached and detached at run time
(ARCHITECTURE.md, "Control API").

The cache's parts are given the :class:`L3Slot` at construction instead of the tier itself, and
it forwards each hook to the tier it holds now (a :class:`~hicache_jax.l3.tier.NullL3Tier`
without storage). :meth:`L3Slot.attach` opens the new store first (a bad URL or an unreachable
store raises before anything changes), records the digests of the host copies already cached
(so that ``storage_write_policy="write_back"`` puts them when L2 evicts them; under write-through
only backups after the attach are put), then swaps it in. :meth:`L3Slot.detach` finishes the
tier's work in flight (puts stored, prefetches landed and attached as host pages: no page is
lost, and L1 / L2 are not touched otherwise), counts it, closes the store and swaps in a null
tier. Requests in flight keep their locks and pages throughout: neither touches a lock or a
page of L1 or L2.

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.l3.prefetch import PrefetchHandle
from hicache_jax.l3.tier import L3Tier, NullL3Tier, open_l3
from hicache_jax.tree.node import TreeNode


class L3Slot:
    """The tier a cache's parts call (see the module docstring).

    Args:
        tier: the tier opened at construction.
        counters: the cache's counters (``storage_attaches``, ``storage_detaches``,
            ``storage_detach_finished_ops``).
    """

    def __init__(self, tier: L3Tier | NullL3Tier, counters: collections.Counter) -> None:
        self.tier, self._n = tier, counters

    def rebind(self, counters: collections.Counter) -> None:
        """The cache's new counters (``reset()``)."""
        self._n = counters

    # -- forwarded hooks ----------------------------------------------------------------------

    @property
    def back_up_new(self) -> bool:
        return self.tier.back_up_new

    def on_backup(self, nodes: list[TreeNode]) -> None:
        self.tier.on_backup(nodes)

    def on_host_evict(self, node: TreeNode, host_ids: np.ndarray) -> None:
        self.tier.on_host_evict(node, host_ids)

    def prefetch(self, tokens: np.ndarray, extra_key: Any) -> PrefetchHandle | None:
        return self.tier.prefetch(tokens, extra_key)

    def before_match(self, tokens: np.ndarray, extra_key: Any) -> None:
        self.tier.before_match(tokens, extra_key)

    def poll(self, attach: bool = True) -> None:
        self.tier.poll(attach)

    def flush(self) -> None:
        self.tier.flush()

    def held_beyond(self, tokens: np.ndarray, extra_key: Any, covered: int) -> int:
        return self.tier.held_beyond(tokens, extra_key, covered)

    def delete(
        self, nodes: list[TreeNode], tokens: np.ndarray | None, extra_key: Any
    ) -> tuple[int, int]:
        return self.tier.delete(nodes, tokens, extra_key)

    def reset_counters(self) -> None:
        self.tier.reset_counters()

    def stats(self) -> dict[str, Any]:
        return self.tier.stats()

    def close(self) -> None:
        self.tier.close()

    # -- attach / detach ------------------------------------------------------------------------

    def attach(self, port: Any, spec: Any, cfg: Any, host_nodes: list[TreeNode]) -> None:
        """Open ``cfg.storage`` and make it the tier (see the module docstring).

        Args:
            host_nodes: the tree's nodes holding host copies, parents before children.

        Raises:
            HiCacheError: storage is attached already (detach it first).
            ValueError / TypeError / StorageUnavailableError: as at construction, before any
                change.
        """
        if isinstance(self.tier, L3Tier):
            raise HiCacheError(f"storage {self.tier.url!r} is attached: detach_storage() first")
        tier = open_l3(port, spec, cfg)
        if isinstance(tier, L3Tier):
            tier.adopt(host_nodes)
        self.tier = tier
        self._n["storage_attaches"] += 1

    def detach(self) -> int:
        """Finish the tier's work in flight, close its store, leave a null tier; returns the
        operations finished. HiCacheError without storage."""
        if not isinstance(self.tier, L3Tier):
            raise HiCacheError("detach_storage: no storage is attached")
        in_flight = self.tier.stats()["l3_in_flight"]
        self.tier.close()  # flushes: puts stored, prefetches landed and attached
        self.tier = NullL3Tier()
        self._n["storage_detaches"] += 1
        self._n["storage_detach_finished_ops"] += in_flight
        return in_flight
