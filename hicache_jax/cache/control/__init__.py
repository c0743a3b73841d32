"""The control calls of a cache (ARCHITECTURE.md, "Control API"): an operator's view and levers,
beside the request path.

* :mod:`~hicache_jax.cache.control.calls`: :class:`~hicache_jax.cache.control.calls.Control`,
  the part the facade's control methods delegate to (owned by the facade, built in
  ``HiCache._init_state`` from the parts it uses);
* :mod:`~hicache_jax.cache.control.lookup`: where a prefix lives, without touching the cache;
* :mod:`~hicache_jax.cache.control.pins`: prefixes kept from eviction;
* :mod:`~hicache_jax.cache.control.invalidate`: a namespace or a prefix dropped from every tier;
* :mod:`~hicache_jax.cache.control.storage_attach`: the L3 tier behind a slot, so that storage
  is attached and detached at run time.
"""
