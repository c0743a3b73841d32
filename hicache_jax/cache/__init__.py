"""HiCache, the facade (:mod:`~hicache_jax.cache.hicache`), and its parts, each the one owner
of a piece of state, built in dependency order: page ownership, operations in flight, the
write policies, the evictor, batched load-back, the request handle.
"""

from hicache_jax.cache.hicache import HiCache
from hicache_jax.cache.match import Match, NodeRef

__all__ = ["HiCache", "Match", "NodeRef"]
