"""The L3 storage tier: prefetch into host pages, puts of backed-up pages, their keys
(:mod:`~hicache_jax.l3.keys`), behind the port the cache implements
(:class:`~hicache_jax.l3.port.CachePort`); the storage backends (:mod:`hicache_jax.l3.storage`).
"""
