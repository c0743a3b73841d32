"""HiCache, the facade (:mod:`~hicache_jax.cache.hicache`), and its parts, each the one owner
of a piece of state, built in dependency order: page ownership, operations in flight, the
write policies, the evictor, load or recompute (:mod:`~hicache_jax.cache.loading`), the control
calls (:mod:`~hicache_jax.cache.control`); and the request handle
(:mod:`~hicache_jax.cache.request`).
"""

from hicache_jax.cache.hicache import HiCache
from hicache_jax.cache.match import Match, NodeRef

__all__ = ["HiCache", "Match", "NodeRef"]
