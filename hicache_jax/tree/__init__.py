"""The radix tree of token prefixes (pure Python and numpy, no jax): nodes and match results
(:mod:`~hicache_jax.tree.node`), the structure -- match, insert, split, delete
(:mod:`~hicache_jax.tree.radix`) -- over the per-tier bookkeeping of each node's pages, locks
and evictable sets (:mod:`~hicache_jax.tree.tiers`), eviction keys
(:mod:`~hicache_jax.tree.eviction`) and chained page hashes, the one definition that the
tree, the events and the L3 keys share (:mod:`~hicache_jax.tree.hashing`).
"""

from hicache_jax.tree.node import TreeMatch, TreeNode
from hicache_jax.tree.radix import RadixTree

__all__ = ["RadixTree", "TreeMatch", "TreeNode"]
