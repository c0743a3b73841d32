"""Load or recompute (ARCHITECTURE.md, "Load or recompute"): how much of a host-only prefix goes
back to device and how much is recomputed.

* :mod:`~hicache_jax.cache.loading.cost_model`: the measured costs (each link's fit, the
  prefill's fit), the plan of a chain, the record of every decision;
* :mod:`~hicache_jax.cache.loading.load_policy`: the load rule a config names (threshold and
  quota, or the cost model's plan) as a load-back's decision function;
* :mod:`~hicache_jax.cache.loading.load_many`: the load-back of one or several matches in one
  transfer, each chain decided by the rule;
* :mod:`~hicache_jax.cache.loading.overlap`: the two-ended split, its back copied into a
  request's own pages while the front is recomputed.
"""
